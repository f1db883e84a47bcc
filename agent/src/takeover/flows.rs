//! The connections of the pods taken over, between conntrack and the
//! datapath: what iptables translated and kube-proxy must keep seeing goes
//! into the datapath's tables at the take-over, and back to conntrack at
//! the hand-back; what network policy let through is tracked on.

use std::{collections::BTreeSet, net::Ipv4Addr, path::Path};

use vpcnet_common::{
    addr_to_raw,
    nat::{FlowKey, FlowKind, FlowState, NS_PER_SEC, PROTO_TCP, PROTO_UDP},
    port_to_raw, raw_to_addr, raw_to_port,
};

use super::{TakeOverError, run};
use crate::{
    datapath::{DatapathMaps, monotonic_now_ns},
    policy,
};

/// One direction of a connection, as conntrack shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuple {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub sport: u16,
    pub dport: u16,
}

impl Tuple {
    fn flow_key(&self, proto: u8) -> FlowKey {
        FlowKey::new(
            addr_to_raw(self.src.octets()),
            addr_to_raw(self.dst.octets()),
            port_to_raw(self.sport),
            port_to_raw(self.dport),
            proto,
        )
    }
}

/// A TCP or UDP connection of conntrack's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Connection {
    pub proto: u8,
    /// The TCP state (`ESTABLISHED`, ...); `None` for UDP.
    pub tcp_state: Option<String>,
    /// Whether the reply direction has seen a packet.
    pub replied: bool,
    pub original: Tuple,
    pub reply: Tuple,
}

/// A line of `conntrack -L` (`tcp 6 431999 ESTABLISHED src=... dst=...
/// sport=... dport=... src=... ...`): the original tuple, then the reply
/// tuple. Other protocols and malformed lines are `None`.
#[must_use]
pub fn parse_conntrack_line(line: &str) -> Option<Connection> {
    let mut words = line.split_whitespace();
    let proto = match words.next()? {
        "tcp" => PROTO_TCP,
        "udp" => PROTO_UDP,
        _ => return None,
    };
    let mut tcp_state = None;
    let mut replied = true;
    let mut fields: Vec<(&str, &str)> = Vec::new();
    for word in words.skip(2) {
        if let Some((key, value)) = word.split_once('=') {
            fields.push((key, value));
        } else if word == "[UNREPLIED]" {
            replied = false;
        } else if proto == PROTO_TCP && fields.is_empty() {
            tcp_state = Some(word.to_owned());
        }
    }
    let tuple = |nth: usize| -> Option<Tuple> {
        let value = |key: &str| {
            fields
                .iter()
                .filter(|(k, _)| *k == key)
                .nth(nth)
                .map(|(_, v)| *v)
        };
        Some(Tuple {
            src: value("src")?.parse().ok()?,
            dst: value("dst")?.parse().ok()?,
            sport: value("sport")?.parse().ok()?,
            dport: value("dport")?.parse().ok()?,
        })
    };
    Some(Connection {
        proto,
        tcp_state,
        replied,
        original: tuple(0)?,
        reply: tuple(1)?,
    })
}

/// Every IPv4 TCP and UDP connection conntrack holds in this namespace.
pub fn conntrack_connections() -> Result<Vec<Connection>, TakeOverError> {
    Ok(run("conntrack", &["-L", "-f", "ipv4"])?
        .lines()
        .filter_map(parse_conntrack_line)
        .collect())
}

/// The state of a connection as conntrack has it, one to one; a TCP
/// state conntrack-tools names and this version does not know counts as
/// established, as conntrack picks such a connection up.
fn conntrack_state(connection: &Connection) -> FlowState {
    match connection.tcp_state.as_deref() {
        None if connection.replied => FlowState::Established,
        None => FlowState::New,
        Some(name) => FlowState::from_conntrack_name(name).unwrap_or(FlowState::Established),
    }
}

/// What to copy from conntrack into the datapath.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FlowImports {
    /// A pod's connection iptables source-NATed: its tuple, the address
    /// and port it leaves as, and its state.
    pub translated: Vec<(FlowKey, Ipv4Addr, u16, FlowState)>,
    /// Connections kube-proxy must keep seeing (a DNAT to or from a pod),
    /// by the pod's tuple: a node port's to the pod, the pod's to a service.
    pub stack: Vec<FlowKey>,
    /// Connections of a pod that saw replies, so were let through by
    /// whatever enforced network policy: the tuple as network policy
    /// judges it (the opener's address before any source NAT, the
    /// receiver's after any destination NAT), from the opener.
    pub policy: Vec<FlowKey>,
}

/// Picks the connections of `pods` the datapath must carry on as iptables
/// did.
#[must_use]
pub fn plan_flow_imports(connections: &[Connection], pods: &BTreeSet<Ipv4Addr>) -> FlowImports {
    let mut imports = FlowImports::default();
    for connection in connections {
        let (original, reply) = (connection.original, connection.reply);
        if connection.replied {
            let judged = if pods.contains(&original.src) {
                Some((original.src, original.sport))
            } else if pods.contains(&reply.src) {
                Some((reply.dst, reply.dport))
            } else {
                None
            };
            if let Some((opener, port)) = judged {
                let receiver = Tuple {
                    src: opener,
                    sport: port,
                    dst: reply.src,
                    dport: reply.sport,
                };
                imports.policy.push(receiver.flow_key(connection.proto));
            }
        }
        let dnat = reply.src != original.dst || reply.sport != original.dport;
        let snat = reply.dst != original.src || reply.dport != original.sport;
        if dnat {
            let reply_key = reply.flow_key(connection.proto);
            if pods.contains(&reply.src) {
                imports.stack.push(reply_key);
            } else if pods.contains(&reply.dst) {
                imports.stack.push(reply_key.reversed());
            }
        } else if snat && pods.contains(&original.src) {
            imports.translated.push((
                original.flow_key(connection.proto),
                reply.dst,
                reply.dport,
                conntrack_state(connection),
            ));
        }
    }
    imports
}

/// Copies the connections of `pods` that iptables translated (and
/// kube-proxy's) among `connections` (conntrack's) into the datapath's
/// maps. Returns what the datapath carries of them now: imported here,
/// or by an earlier start.
pub fn import_flows(
    maps: &mut DatapathMaps,
    pods: &BTreeSet<Ipv4Addr>,
    connections: &[Connection],
) -> Result<FlowImports, TakeOverError> {
    let mut imports = plan_flow_imports(connections, pods);
    let now = monotonic_now_ns();
    let mut imported = Vec::new();
    for (key, addr, port, state) in imports.translated {
        let raw_addr = addr_to_raw(addr.octets());
        // Already carried: imported by a start killed before the pods'
        // programs, whose stack aliases are still to go.
        if maps.import_translated_flow(key, raw_addr, port_to_raw(port), state, now)?
            || maps.carries_translated_flow(key, raw_addr, port_to_raw(port))
        {
            imported.push((key, addr, port, state));
        }
    }
    imports.translated = imported;
    for key in &imports.stack {
        maps.import_stack_flow(*key, now)?;
    }
    Ok(imports)
}

/// Tracks the connections of `pods` that whatever enforced network policy
/// let through: those of `connections` (conntrack's) that were answered,
/// and, with `aws_policy` (where
/// aws-node's network policy agent pinned), those its tracker holds (a
/// connection idle past conntrack's timeout is still there). Returns how
/// many were not tracked yet.
pub fn track_policy_flows(
    maps: &DatapathMaps,
    pods: &BTreeSet<Ipv4Addr>,
    connections: &[Connection],
    aws_policy: Option<&Path>,
) -> Result<usize, TakeOverError> {
    let mut opened = plan_flow_imports(connections, pods).policy;
    if let Some(root) = aws_policy {
        opened.extend(super::network_policy::tracked_flows(root, pods)?);
    }
    let now = monotonic_now_ns();
    let mut tracked = 0;
    for key in &opened {
        tracked += usize::from(policy::maps::track_flow(maps, key, now)?);
    }
    Ok(tracked)
}

/// Once the pods' programs carry the imported flows, their packets no
/// longer go through iptables: the node-socket aliases go, and so does
/// what `pod_ingress` learnt from the replies the stack delivered meanwhile.
pub(super) fn forget_stack_aliases(maps: &mut DatapathMaps, imports: &FlowImports) {
    for (key, addr, port, _) in &imports.translated {
        maps.forget_stack_flow(*key);
        maps.forget_stack_alias(*key, addr_to_raw(addr.octets()), port_to_raw(*port));
    }
}

/// Hands the datapath's translated connections to conntrack (each as a
/// source-NATed entry to the same address and port, with aws-node's
/// connmark), so iptables carries them on once the programs are gone.
/// An entry conntrack kept from before the take-over is replaced: its
/// TCP window is long out of date. Returns how many were written.
pub fn export_flows(maps: &DatapathMaps, connmark: u32) -> Result<usize, TakeOverError> {
    let mut exported = 0;
    let timeouts = maps.timeouts()?;
    let now = monotonic_now_ns();
    for flow in maps.flows()? {
        if flow.kind() != Some(FlowKind::Snat) {
            continue;
        }
        let state = flow.state();
        // Every state goes over, one to one: a closed flow's port stays
        // held for the remote's TIME_WAIT as it was here.
        let (proto, conntrack_state) = match flow.key.proto {
            PROTO_TCP => ("tcp", Some(state.conntrack_name())),
            PROTO_UDP => ("udp", None),
            _ => continue,
        };
        // What is left of the flow's life here, as conntrack's timeout.
        let timeout = flow
            .timeout_ns(&timeouts)
            .saturating_sub(now.saturating_sub(flow.last_seen_ns()))
            .div_ceil(NS_PER_SEC)
            .max(1)
            .to_string();
        let key = flow.key;
        let (src, dst) = (
            Ipv4Addr::from(raw_to_addr(key.saddr)).to_string(),
            Ipv4Addr::from(raw_to_addr(key.daddr)).to_string(),
        );
        let (sport, dport) = (
            raw_to_port(key.sport).to_string(),
            raw_to_port(key.dport).to_string(),
        );
        let tuple = [
            "-p", proto, "-s", &src, "-d", &dst, "--sport", &sport, "--dport", &dport,
        ];
        // None there is the usual case, and conntrack says so by failing.
        let mut delete = vec!["-D"];
        delete.extend(tuple);
        let _ = run("conntrack", &delete);
        let nat = format!(
            "{}:{}",
            Ipv4Addr::from(raw_to_addr(flow.fwd.addr)),
            raw_to_port(flow.fwd.port)
        );
        let mark = connmark.to_string();
        let replied = state != FlowState::New;
        let mut create = vec!["-I"];
        create.extend(tuple);
        create.extend(["-t", &timeout, "--src-nat", &nat]);
        if let Some(state) = conntrack_state {
            create.extend(["--state", state]);
        }
        if replied {
            create.extend(["-u", "SEEN_REPLY,ASSURED"]);
        }
        // After `-u`: conntrack-tools 1.4.7 writes the status bits over a
        // mark given before them.
        create.extend(["--mark", &mark]);
        run("conntrack", &create)?;
        exported += 1;
    }
    Ok(exported)
}

/// Removes conntrack's entries of untranslated TCP connections of `pods`
/// (to the VPC, pod to pod, opened from outside): the datapath carried
/// them past the stack, so an entry conntrack kept from before the take-over
/// has a TCP window long out of date. Back in the stack, their packets
/// would be out of window, INVALID, and dropped by kube-proxy's
/// `KUBE-FORWARD`; without an entry conntrack picks each up mid-stream
/// instead (`nf_conntrack_tcp_loose`, on by default). NATed entries
/// (kube-proxy's DNAT, the SNAT just handed over) stay. Returns how many
/// went.
pub fn forget_stale_connections(pods: &[Ipv4Addr]) -> Result<usize, TakeOverError> {
    let mut forgotten = 0;
    for connection in conntrack_connections()? {
        let (orig, reply) = (connection.original, connection.reply);
        let untranslated = reply.src == orig.dst
            && reply.dst == orig.src
            && reply.sport == orig.dport
            && reply.dport == orig.sport;
        let of_a_pod = pods.contains(&orig.src) || pods.contains(&orig.dst);
        if connection.proto != PROTO_TCP || !untranslated || !of_a_pod {
            continue;
        }
        let (src, dst) = (orig.src.to_string(), orig.dst.to_string());
        let (sport, dport) = (orig.sport.to_string(), orig.dport.to_string());
        let delete = [
            "-D", "-p", "tcp", "-s", &src, "-d", &dst, "--sport", &sport, "--dport", &dport,
        ];
        // Gone meanwhile is as good.
        if run("conntrack", &delete).is_ok() {
            forgotten += 1;
        }
    }
    Ok(forgotten)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conntrack_lines_parse() {
        let tcp = parse_conntrack_line(
            "tcp      6 431999 ESTABLISHED src=10.20.11.20 dst=203.0.113.10 sport=40000 dport=5201 \
             src=203.0.113.10 dst=10.20.11.162 sport=5201 dport=61000 [ASSURED] mark=128 use=1",
        )
        .unwrap();
        assert_eq!(tcp.tcp_state.as_deref(), Some("ESTABLISHED"));
        assert!(tcp.replied);
        assert_eq!(tcp.original.sport, 40000);
        assert_eq!(tcp.reply.dst, Ipv4Addr::new(10, 20, 11, 162));
        assert_eq!(tcp.reply.dport, 61000);
        let udp = parse_conntrack_line(
            "udp      17 25 src=10.20.11.20 dst=203.0.113.10 sport=5353 dport=53 [UNREPLIED] \
             src=203.0.113.10 dst=10.20.11.162 sport=53 dport=5353 mark=0 use=1",
        )
        .unwrap();
        assert!(!udp.replied && udp.tcp_state.is_none());
        assert!(
            parse_conntrack_line(
                "icmp     1 29 src=10.20.11.20 dst=203.0.113.10 type=8 code=0 id=7 \
                 src=203.0.113.10 dst=10.20.11.162 type=0 code=0 id=7 mark=0 use=1"
            )
            .is_none()
        );
    }

    #[test]
    fn pods_snat_and_kube_proxy_flows_are_imported_and_nothing_else() {
        let pod = Ipv4Addr::new(10, 20, 11, 20);
        let pods = BTreeSet::from([pod]);
        let lines = [
            // The pod's connection to the internet, source-NATed.
            "tcp 6 100 ESTABLISHED src=10.20.11.20 dst=203.0.113.10 sport=40000 dport=80 \
             src=203.0.113.10 dst=10.20.11.162 sport=80 dport=61000 [ASSURED] use=1",
            // To the VPC: untranslated.
            "tcp 6 100 ESTABLISHED src=10.20.11.20 dst=10.20.12.50 sport=40001 dport=80 \
             src=10.20.12.50 dst=10.20.11.20 sport=80 dport=40001 [ASSURED] use=1",
            // A node port to the pod, DNATed by kube-proxy.
            "tcp 6 100 ESTABLISHED src=10.20.12.50 dst=10.20.11.162 sport=50000 dport=30080 \
             src=10.20.11.20 dst=10.20.12.50 sport=8080 dport=50000 [ASSURED] use=1",
            // The node's own connection.
            "tcp 6 100 ESTABLISHED src=10.20.11.162 dst=203.0.113.10 sport=33000 dport=443 \
             src=203.0.113.10 dst=10.20.11.162 sport=443 dport=33000 [ASSURED] use=1",
            // The pod's connection to a service, DNATed to peer.
            "tcp 6 100 ESTABLISHED src=10.20.11.20 dst=10.100.0.10 sport=40002 dport=80 \
             src=10.20.12.50 dst=10.20.11.20 sport=8080 dport=40002 [ASSURED] use=1",
            // Knocking at the pod, never answered (its policy denied it).
            "tcp 6 100 SYN_SENT src=10.20.12.60 dst=10.20.11.20 sport=50001 dport=22 [UNREPLIED] \
             src=10.20.11.20 dst=10.20.12.60 sport=22 dport=50001 use=1",
        ];
        let connections: Vec<_> = lines
            .iter()
            .map(|l| parse_conntrack_line(l).unwrap())
            .collect();
        let imports = plan_flow_imports(&connections, &pods);
        assert_eq!(imports.translated.len(), 1);
        let (key, addr, port, state) = imports.translated[0];
        assert_eq!(key, connections[0].original.flow_key(PROTO_TCP));
        assert_eq!((addr, port), (Ipv4Addr::new(10, 20, 11, 162), 61000));
        assert_eq!(state, FlowState::Established);
        // Both by the pod's tuple: the one its packets carry.
        assert_eq!(
            imports.stack,
            [
                connections[2].reply.flow_key(PROTO_TCP),
                connections[4].reply.flow_key(PROTO_TCP).reversed()
            ]
        );
        // What policy let through, as it judges it: from the opener, to the
        // backend a service DNATed to; nothing unanswered, nothing the
        // node's own.
        let judged = |src: [u8; 4], sport, dst: [u8; 4], dport| Tuple {
            src: Ipv4Addr::from(src),
            sport,
            dst: Ipv4Addr::from(dst),
            dport,
        };
        assert_eq!(
            imports.policy,
            [
                judged([10, 20, 11, 20], 40000, [203, 0, 113, 10], 80),
                judged([10, 20, 11, 20], 40001, [10, 20, 12, 50], 80),
                judged([10, 20, 12, 50], 50000, [10, 20, 11, 20], 8080),
                judged([10, 20, 11, 20], 40002, [10, 20, 12, 50], 8080),
            ]
            .map(|tuple| tuple.flow_key(PROTO_TCP))
        );
    }
}
