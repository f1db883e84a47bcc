//! The fields every source of policy shares (a CIDR with its exceptions, a
//! port with its protocol and end), read one way, and what is reported of
//! the ones that cannot be enforced as written. Reading never widens what
//! is allowed: a field that cannot be read takes its whole peer or port
//! out, never leaves a wider one in.

use std::{fmt, net::IpAddr};

use ipnet::{IpNet, Ipv4Net};

use super::rules::{Peers, Ports, Protocol};

/// A field of an object that is not enforced as written.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    /// `PolicyEndpoint`, `NetworkPolicy`.
    pub kind: &'static str,
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

/// Collects the problems of one object.
pub struct Report<'a> {
    pub kind: &'static str,
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
