//! The fields every source of policy shares (a CIDR with its exceptions, a
//! port with its protocol and end), read one way, and what is reported of
//! the ones that cannot be enforced as written. Reading never widens what
//! is allowed: a field that cannot be read takes its whole peer or port
//! out, never leaves a wider one in.

use std::{fmt, net::IpAddr};

use ipnet::{IpNet, Ipv4Net};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType};

use super::rules::{Peers, Ports, Protocol};
use crate::k8s::events::AgentEvent;

/// A kind of object policies come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Kind {
    /// `PolicyEndpoint`, `NetworkPolicy`.
    pub name: &'static str,
    pub api_version: &'static str,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// A field of an object that is not enforced as written.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    pub kind: Kind,
    /// `namespace/name` of the object.
    pub object: String,
    /// The field's path, e.g. `spec.ingress[2].ports[0].endPort`.
    pub field: String,
    pub value: String,
    pub why: &'static str,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} {}={:?}: {}",
            self.kind, self.object, self.field, self.value, self.why
        )
    }
}

/// The Event's reason (a warning on the agent's pod).
pub const PROBLEM_REASON: &str = "PolicyNotEnforcedAsWritten";
/// The longest action the API takes.
const MAX_ACTION: usize = 128;

impl AgentEvent for Problem {
    const SOURCE: &'static str = "network policy";

    /// About the object (`related`); the field in the action, so each
    /// field is an Event of its own (one series per action and object).
    fn event(&self) -> Event {
        let (namespace, name) = self
            .object
            .split_once('/')
            .unwrap_or(("", self.object.as_str()));
        let mut action = format!("Enforce {}", self.field);
        if action.len() > MAX_ACTION {
            let mut end = MAX_ACTION;
            while !action.is_char_boundary(end) {
                end -= 1;
            }
            action.truncate(end);
        }
        Event {
            type_: EventType::Warning,
            reason: PROBLEM_REASON.to_owned(),
            note: Some(self.to_string()),
            action,
            secondary: Some(ObjectReference {
                api_version: Some(self.kind.api_version.to_owned()),
                kind: Some(self.kind.name.to_owned()),
                // A cluster-scoped object (a cluster policy's) has none.
                namespace: (!namespace.is_empty()).then(|| namespace.to_owned()),
                name: Some(name.to_owned()),
                ..ObjectReference::default()
            }),
        }
    }
}

/// Collects the problems of one object.
pub struct Report<'a> {
    pub kind: Kind,
    pub object: String,
    pub problems: &'a mut Vec<Problem>,
}

impl Report<'_> {
    pub fn add(&mut self, field: String, value: &str, why: &'static str) {
        self.problems.push(Problem {
            kind: self.kind,
            object: self.object.clone(),
            field,
            value: value.to_owned(),
            why,
        });
    }
}

/// An address without a mask is a host; `Ok(None)` for IPv6 (the node
/// serves IPv4: a `::/0` beside `0.0.0.0/0` says nothing here).
fn prefix(value: &str) -> Result<Option<Ipv4Net>, ()> {
    if let Ok(net) = value.parse::<IpNet>() {
        return Ok(match net {
            IpNet::V4(v4) => Some(v4.trunc()),
            IpNet::V6(_) => None,
        });
    }
    match value.parse::<IpAddr>() {
        Ok(IpAddr::V4(addr)) => Ok(Some(Ipv4Net::from(addr))),
        Ok(IpAddr::V6(_)) => Ok(None),
        Err(_) => Err(()),
    }
}

/// A CIDR less its exceptions, at `field` (`field.cidr`,
/// `field.except[i]`); `None` when IPv6 or unreadable (reported: without
/// an exception it would allow more, so the whole peer goes).
pub fn peers(cidr: &str, except: &[String], field: &str, report: &mut Report<'_>) -> Option<Peers> {
    let Ok(cidr_net) = prefix(cidr) else {
        report.add(
            format!("{field}.cidr"),
            cidr,
            "not an address or a CIDR: this peer is not enforced",
        );
        return None;
    };
    let cidr_net = cidr_net?;
    let mut nets = Vec::new();
    for (i, value) in except.iter().enumerate() {
        match prefix(value) {
            Ok(Some(net)) => nets.push(net),
            Ok(None) => {}
            Err(()) => {
                report.add(
                    format!("{field}.except[{i}]"),
                    value,
                    "not a CIDR: this peer is not enforced (without it, it would allow more)",
                );
                return None;
            }
        }
    }
    Some(Peers {
        cidr: cidr_net,
        except: nets,
    })
}

/// A protocol as NetworkPolicy spells it (TCP when missing), at `field`.
pub fn protocol(name: Option<&str>, field: &str, report: &mut Report<'_>) -> Option<Protocol> {
    let Some(name) = name else {
        return Some(Protocol::Tcp);
    };
    let protocol = Protocol::from_name(name);
    if protocol.is_none() {
        report.add(
            format!("{field}.protocol"),
            name,
            "not TCP, UDP or SCTP: this port is not enforced",
        );
    }
    protocol
}

/// A numbered port (none: every port of `protocol`) up to `end_port`, at
/// `field`; `None` when out of range (reported).
pub fn ports(
    protocol: Protocol,
    port: Option<i32>,
    end_port: Option<i32>,
    field: &str,
    report: &mut Report<'_>,
) -> Option<Ports> {
    let Some(first) = port else {
        return Some(Ports::all(protocol));
    };
    let Some(first) = u16::try_from(first).ok().filter(|p| *p != 0) else {
        report.add(
            format!("{field}.port"),
            &first.to_string(),
            "not a port from 1 to 65535: not enforced",
        );
        return None;
    };
    let last = match end_port {
        None => first,
        Some(end) => {
            let Some(last) = u16::try_from(end).ok().filter(|e| *e >= first) else {
                report.add(
                    format!("{field}.endPort"),
                    &end.to_string(),
                    "below its port or above 65535: this port is not enforced",
                );
                return None;
            };
            last
        }
    };
    Some(Ports {
        protocol,
        first,
        last,
    })
}

/// An endpoint entry's ports (`field.ports[i]`); `None` when it names
/// ports and none can be read (without ports it would take them all).
pub fn entry_ports(
    ports: &[vpcnet_api::policy_endpoint::Port],
    field: &str,
    report: &mut Report<'_>,
) -> Option<Vec<Ports>> {
    let mut out = Vec::new();
    for (i, port) in ports.iter().enumerate() {
        let at = format!("{field}.ports[{i}]");
        out.extend(
            protocol(port.protocol.as_deref(), &at, report)
                .and_then(|protocol| self::ports(protocol, port.port, port.end_port, &at, report)),
        );
    }
    (ports.is_empty() || !out.is_empty()).then_some(out)
}
