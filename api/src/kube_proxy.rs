//! kube-proxy's iptables mode, one definition for the lab's node (which runs
//! it under both datapaths, as every EKS node does) and for anything that
//! must recognise its rules.
//!
//! These are the rules `kube-proxy --proxy-mode=iptables` writes, in its
//! order and with its comments, as EKS runs it: no `--cluster-cidr` (so no
//! "pod traffic" or `! -s <cluster CIDR>` rules), `masqueradeAll` off, mark
//! bit 14, localhost node ports on, `nodePortAddresses` unset (node ports on
//! every local address). Where each comes from in `kubernetes/kubernetes`,
//! `pkg/proxy/iptables/proxier.go`:
//!
//! - the jumps from the built-in chains: `iptablesJumpChains` and
//!   `iptablesKubeletJumpChains`, each `EnsureRule(Prepend, ...)`, that is
//!   inserted at the head of its chain;
//! - the fixed chains (`KUBE-POSTROUTING`, `KUBE-MARK-MASQ`, `KUBE-FORWARD`
//!   with its `--ctstate INVALID -j DROP`, `KUBE-FIREWALL`): `syncProxyRules`,
//!   written on every sync;
//! - per service port: the cluster IP rule in `KUBE-SERVICES`, node port
//!   rules in `KUBE-NODEPORTS`, the `KUBE-EXT-`, `KUBE-SVC-`, `KUBE-SVL-`
//!   and `KUBE-SEP-` chains, or `REJECT`/`DROP` in filter when there is no
//!   endpoint to send to; chain names from `portProtoHash` and
//!   `servicePortEndpointChainName`;
//! - the whole is handed to `iptables-restore --noflush --counters`.
//!
//! Two of kube-proxy's choices depend on the host and are options here:
//! `--random-fully` (iptables 1.6.2 and later) and the `nfacct` counters
//! (kube-proxy 1.30 and later, when the kernel has `nfnetlink_acct`;
//! without them it writes the same rules without the counter match).

use std::{
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddrV4},
};

use sha2::{Digest, Sha256};

/// kube-proxy's masquerade mark (`1 << masqueradeBit`, bit 14), as it
/// formats it (`%#08x`).
pub const MASQ_MARK: &str = "0x00004000";
/// The sysctl kube-proxy turns on for localhost node ports, and its value.
pub const ROUTE_LOCALNET_SYSCTL: (&str, &str) = ("net/ipv4/conf/all/route_localnet", "1");
/// The conntrack timeouts kube-proxy sets at start with its default
/// configuration (`conntrack.tcpEstablishedTimeout: 24h`,
/// `tcpCloseWaitTimeout: 1h`, as EKS's kube-proxy add-on keeps them), and
/// their values in seconds.
pub const CONNTRACK_SYSCTLS: [(&str, &str); 2] = [
    (
        "net/netfilter/nf_conntrack_tcp_timeout_established",
        "86400",
    ),
    ("net/netfilter/nf_conntrack_tcp_timeout_close_wait", "3600"),
];

const KUBE_SERVICES: &str = "KUBE-SERVICES";
const KUBE_EXTERNAL_SERVICES: &str = "KUBE-EXTERNAL-SERVICES";
const KUBE_NODEPORTS: &str = "KUBE-NODEPORTS";
const KUBE_POSTROUTING: &str = "KUBE-POSTROUTING";
const KUBE_MARK_MASQ: &str = "KUBE-MARK-MASQ";
pub const KUBE_FORWARD: &str = "KUBE-FORWARD";
const KUBE_PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";
/// Kubelet's chain, which kube-proxy also fills when localhost node ports
/// are on.
const KUBE_FIREWALL: &str = "KUBE-FIREWALL";

/// A service port's protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    /// As kube-proxy writes it in rules and hashes (`strings.ToLower`).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
        }
    }
}

/// `externalTrafficPolicy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TrafficPolicy {
    /// Node ports reach every endpoint, masqueraded to the node.
    #[default]
    Cluster,
    /// Node ports reach only this node's endpoints, with the client's
    /// address kept.
    Local,
}

/// One endpoint of a service port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    pub addr: SocketAddrV4,
    /// On this node (a `KUBE-SVL-` target under the `Local` policy).
    pub local: bool,
}

/// One port of a service, what kube-proxy turns into rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePort {
    pub namespace: String,
    pub service: String,
    /// The port's name; empty for a service's only, unnamed port.
    pub port_name: String,
    pub protocol: Protocol,
    pub cluster_ip: Ipv4Addr,
    pub port: u16,
    pub node_port: Option<u16>,
    pub external_traffic_policy: TrafficPolicy,
    pub endpoints: Vec<Endpoint>,
}

impl ServicePort {
    /// `ServicePortName.String()`: `namespace/name[:port]`.
    #[must_use]
    pub fn name(&self) -> String {
        if self.port_name.is_empty() {
            format!("{}/{}", self.namespace, self.service)
        } else {
            format!("{}/{}:{}", self.namespace, self.service, self.port_name)
        }
    }

    /// `portProtoHash`: what `KUBE-SVC-`, `KUBE-SVL-` and `KUBE-EXT-` end
    /// with.
    fn hash(&self) -> String {
        chain_hash(&format!("{}{}", self.name(), self.protocol.name()))
    }

    #[must_use]
    pub fn svc_chain(&self) -> String {
        format!("KUBE-SVC-{}", self.hash())
    }

    #[must_use]
    pub fn svl_chain(&self) -> String {
        format!("KUBE-SVL-{}", self.hash())
    }

    #[must_use]
    pub fn ext_chain(&self) -> String {
        format!("KUBE-EXT-{}", self.hash())
    }

    /// `servicePortEndpointChainName`.
    #[must_use]
    pub fn sep_chain(&self, endpoint: &Endpoint) -> String {
        format!(
            "KUBE-SEP-{}",
            chain_hash(&format!(
                "{}{}{}",
                self.name(),
                self.protocol.name(),
                endpoint.addr
            ))
        )
    }

    fn local_endpoints(&self) -> impl Iterator<Item = &Endpoint> {
        self.endpoints.iter().filter(|e| e.local)
    }
}

/// The host-dependent parts of kube-proxy's rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// The iptables binary knows `--random-fully` (1.6.2 and later).
    pub random_fully: bool,
    /// The `nfacct` counters exist (kube-proxy 1.30+ with `nfnetlink_acct`).
    pub nfacct: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            random_fully: true,
            nfacct: false,
        }
    }
}

/// SHA-256, base32 (RFC 4648), the first 16 characters.
fn chain_hash(input: &str) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let digest = Sha256::digest(input.as_bytes());
    // 16 characters of 5 bits are the first 10 bytes.
    let mut bits: u64 = 0;
    let mut pending = 0;
    let mut out = String::with_capacity(16);
    for &byte in &digest[..10] {
        bits = (bits << 8) | u64::from(byte);
        pending += 8;
        while pending >= 5 {
            pending -= 5;
            out.push(char::from(ALPHABET[((bits >> pending) & 31) as usize]));
        }
    }
    out
}

/// A jump from a built-in chain to one of kube-proxy's, inserted with
/// `iptables -I` in the order kube-proxy (then kubelet) ensures them; each
/// goes to the head of its chain, so the last one ends up first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JumpRule {
    pub table: &'static str,
    pub chain: &'static str,
    pub args: Vec<String>,
}

/// `(table, chain, target, only NEW connections, comment)`, as
/// `iptablesJumpChains` then `iptablesKubeletJumpChains` list them.
const JUMPS: [(&str, &str, &str, bool, &str); 14] = [
    (
        "filter",
        "INPUT",
        KUBE_EXTERNAL_SERVICES,
        true,
        "kubernetes externally-visible service portals",
    ),
    (
        "filter",
        "FORWARD",
        KUBE_EXTERNAL_SERVICES,
        true,
        "kubernetes externally-visible service portals",
    ),
    (
        "filter",
        "INPUT",
        KUBE_NODEPORTS,
        false,
        "kubernetes health check service ports",
    ),
    (
        "filter",
        "FORWARD",
        KUBE_SERVICES,
        true,
        "kubernetes service portals",
    ),
    (
        "filter",
        "OUTPUT",
        KUBE_SERVICES,
        true,
        "kubernetes service portals",
    ),
    (
        "filter",
        "FORWARD",
        KUBE_FORWARD,
        false,
        "kubernetes forwarding rules",
    ),
    (
        "filter",
        "INPUT",
        KUBE_PROXY_FIREWALL,
        true,
        "kubernetes load balancer firewall",
    ),
    (
        "filter",
        "OUTPUT",
        KUBE_PROXY_FIREWALL,
        true,
        "kubernetes load balancer firewall",
    ),
    (
        "filter",
        "FORWARD",
        KUBE_PROXY_FIREWALL,
        true,
        "kubernetes load balancer firewall",
    ),
    (
        "nat",
        "OUTPUT",
        KUBE_SERVICES,
        false,
        "kubernetes service portals",
    ),
    (
        "nat",
        "PREROUTING",
        KUBE_SERVICES,
        false,
        "kubernetes service portals",
    ),
    (
        "nat",
        "POSTROUTING",
        KUBE_POSTROUTING,
        false,
        "kubernetes postrouting rules",
    ),
    // Kubelet's, without a comment.
    ("filter", "INPUT", KUBE_FIREWALL, false, ""),
    ("filter", "OUTPUT", KUBE_FIREWALL, false, ""),
];

/// The jumps, in the order they are ensured.
#[must_use]
pub fn jump_rules() -> Vec<JumpRule> {
    JUMPS
        .into_iter()
        .map(|(table, chain, target, only_new, comment)| {
            let mut args = Vec::new();
            if only_new {
                args.extend(["-m", "conntrack", "--ctstate", "NEW"].map(str::to_owned));
            }
            if !comment.is_empty() {
                args.extend(["-m", "comment", "--comment", comment].map(str::to_owned));
            }
            args.extend(["-j".to_owned(), target.to_owned()]);
            JumpRule { table, chain, args }
        })
        .collect()
}

/// The jumps as `iptables-restore --noflush` input for a node that has
/// none of them yet: the same inserts in the same order, a table block
/// each, so they land where `-I` one by one puts them.
#[must_use]
pub fn jumps_restore_input() -> String {
    let mut input = String::new();
    let jumps = jump_rules();
    for table in ["filter", "nat"] {
        let lines: Vec<String> = jumps
            .iter()
            .filter(|jump| jump.table == table)
            .map(|jump| {
                let args: Vec<String> = jump
                    .args
                    .iter()
                    .map(|arg| {
                        if arg.contains(' ') {
                            format!("\"{arg}\"")
                        } else {
                            arg.clone()
                        }
                    })
                    .collect();
                format!("-I {} {}\n", jump.chain, args.join(" "))
            })
            .collect();
        if !lines.is_empty() {
            let _ = write!(input, "*{table}\n{}COMMIT\n", lines.concat());
        }
    }
    input
}

/// Rules of one table being assembled: chain declarations first, then the
/// rules, as kube-proxy's `utilproxy.LineBuffer`s come out.
#[derive(Default)]
struct Table {
    chains: Vec<String>,
    rules: Vec<String>,
}

impl Table {
    fn chain(&mut self, name: &str) {
        if !self.chains.iter().any(|c| c == name) {
            self.chains.push(name.to_owned());
        }
    }

    fn rule(&mut self, chain: &str, args: &str) {
        self.rules.push(format!("-A {chain} {args}"));
    }

    fn write(&self, name: &str, out: &mut String) {
        let _ = writeln!(out, "*{name}");
        for chain in &self.chains {
            let _ = writeln!(out, ":{chain} - [0:0]");
        }
        for rule in &self.rules {
            let _ = writeln!(out, "{rule}");
        }
        let _ = writeln!(out, "COMMIT");
    }
}

/// What kube-proxy hands `iptables-restore --noflush --counters` for
/// `ports`.
#[must_use]
pub fn restore_input(ports: &[ServicePort], opts: Options) -> String {
    let mut filter = Table::default();
    let mut nat = Table::default();
    for chain in [
        KUBE_SERVICES,
        KUBE_EXTERNAL_SERVICES,
        KUBE_FORWARD,
        KUBE_NODEPORTS,
        KUBE_PROXY_FIREWALL,
        KUBE_FIREWALL,
    ] {
        filter.chain(chain);
    }
    for chain in [
        KUBE_SERVICES,
        KUBE_NODEPORTS,
        KUBE_POSTROUTING,
        KUBE_MARK_MASQ,
    ] {
        nat.chain(chain);
    }
    // Localhost node ports are on: kube-proxy writes kubelet's guard too.
    filter.rule(
        KUBE_FIREWALL,
        "-m comment --comment \"block incoming localnet connections\" -d 127.0.0.0/8 \
         ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP",
    );
    for port in ports {
        service_port_rules(port, opts, &mut filter, &mut nat);
    }
    let counter = |name: &str| {
        if opts.nfacct {
            format!(" -m nfacct --nfacct-name {name}")
        } else {
            String::new()
        }
    };
    filter.rule(
        KUBE_FORWARD,
        &format!(
            "-m conntrack --ctstate INVALID{} -j DROP",
            counter("ct_state_invalid_dropped_pkts")
        ),
    );
    filter.rule(
        KUBE_FORWARD,
        &format!(
            "-m comment --comment \"kubernetes forwarding rules\" -m mark --mark \
             {MASQ_MARK}/{MASQ_MARK} -j ACCEPT"
        ),
    );
    filter.rule(
        KUBE_FORWARD,
        "-m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack \
         --ctstate RELATED,ESTABLISHED -j ACCEPT",
    );
    // The fixed nat chains go before the services' rules.
    let random_fully = if opts.random_fully {
        " --random-fully"
    } else {
        ""
    };
    let fixed = [
        format!("-A {KUBE_POSTROUTING} -m mark ! --mark {MASQ_MARK}/{MASQ_MARK} -j RETURN"),
        format!("-A {KUBE_POSTROUTING} -j MARK --xor-mark {MASQ_MARK}"),
        format!(
            "-A {KUBE_POSTROUTING} -m comment --comment \"kubernetes service traffic requiring \
             SNAT\" -j MASQUERADE{random_fully}"
        ),
        format!("-A {KUBE_MARK_MASQ} -j MARK --or-mark {MASQ_MARK}"),
    ];
    nat.rules.splice(0..0, fixed);
    nat.rule(
        KUBE_SERVICES,
        "-m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule \
         in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS",
    );
    let mut out = String::new();
    filter.write("filter", &mut out);
    nat.write("nat", &mut out);
    out
}

/// One service port's rules, in the order `syncProxyRules` writes them.
fn service_port_rules(port: &ServicePort, opts: Options, filter: &mut Table, nat: &mut Table) {
    let name = port.name();
    let proto = port.protocol.name();
    let matches = format!("-m {proto} -p {proto}");
    let local_only = port.external_traffic_policy == TrafficPolicy::Local;
    let has_local = port.local_endpoints().next().is_some();
    if port.endpoints.is_empty() {
        filter.rule(
            KUBE_SERVICES,
            &format!(
                "-m comment --comment \"{name} has no endpoints\" {matches} -d {} --dport {} \
                 -j REJECT",
                port.cluster_ip, port.port
            ),
        );
        if let Some(node_port) = port.node_port {
            filter.rule(
                KUBE_EXTERNAL_SERVICES,
                &format!(
                    "-m comment --comment \"{name} has no endpoints\" -m addrtype --dst-type \
                     LOCAL {matches} --dport {node_port} -j REJECT"
                ),
            );
        }
        return;
    }
    let svc = port.svc_chain();
    nat.chain(&svc);
    nat.rule(
        KUBE_SERVICES,
        &format!(
            "-m comment --comment \"{name} cluster IP\" {matches} -d {} --dport {} -j {svc}",
            port.cluster_ip, port.port
        ),
    );
    if let Some(node_port) = port.node_port {
        node_port_rules(port, node_port, opts, filter, nat);
    }
    balance(port, &svc, &port.endpoints.iter().collect::<Vec<_>>(), nat);
    if local_only && port.node_port.is_some() && has_local {
        let svl = port.svl_chain();
        balance(port, &svl, &port.local_endpoints().collect::<Vec<_>>(), nat);
    }
    for endpoint in &port.endpoints {
        let sep = port.sep_chain(endpoint);
        nat.chain(&sep);
        nat.rule(
            &sep,
            &format!(
                "-m comment --comment {name} -s {} -j {KUBE_MARK_MASQ}",
                endpoint.addr.ip()
            ),
        );
        nat.rule(
            &sep,
            &format!(
                "-m comment --comment {name} {matches} -j DNAT --to-destination {}",
                endpoint.addr
            ),
        );
    }
}

/// A node port's rules: `KUBE-NODEPORTS` to the port's `KUBE-EXT-` chain,
/// which masquerades (`Cluster`) or keeps to local endpoints (`Local`).
fn node_port_rules(
    port: &ServicePort,
    node_port: u16,
    opts: Options,
    filter: &mut Table,
    nat: &mut Table,
) {
    let name = port.name();
    let proto = port.protocol.name();
    let matches = format!("-m {proto} -p {proto}");
    let svc = port.svc_chain();
    let ext = port.ext_chain();
    let local_only = port.external_traffic_policy == TrafficPolicy::Local;
    let has_local = port.local_endpoints().next().is_some();
    nat.chain(&ext);
    if opts.nfacct {
        nat.rule(
            KUBE_NODEPORTS,
            &format!(
                "-m comment --comment {name} {matches} -d 127.0.0.0/8 --dport {node_port} \
                 -m nfacct --nfacct-name localhost_nps_accepted_pkts -j {ext}"
            ),
        );
    }
    nat.rule(
        KUBE_NODEPORTS,
        &format!("-m comment --comment {name} {matches} --dport {node_port} -j {ext}"),
    );
    if local_only {
        let svl = port.svl_chain();
        nat.chain(&svl);
        nat.rule(
            &ext,
            &format!(
                "-m comment --comment \"masquerade LOCAL traffic for {name} external \
                 destinations\" -m addrtype --src-type LOCAL -j {KUBE_MARK_MASQ}"
            ),
        );
        nat.rule(
            &ext,
            &format!(
                "-m comment --comment \"route LOCAL traffic for {name} external \
                 destinations\" -m addrtype --src-type LOCAL -j {svc}"
            ),
        );
        if has_local {
            nat.rule(&ext, &format!("-j {svl}"));
        } else {
            filter.rule(
                KUBE_EXTERNAL_SERVICES,
                &format!(
                    "-m comment --comment \"{name} has no local endpoints\" -m addrtype \
                     --dst-type LOCAL {matches} --dport {node_port} -j DROP"
                ),
            );
        }
    } else {
        nat.rule(
            &ext,
            &format!(
                "-m comment --comment \"masquerade traffic for {name} external \
                 destinations\" -j {KUBE_MARK_MASQ}"
            ),
        );
        nat.rule(&ext, &format!("-j {svc}"));
    }
}

/// `writeServiceToEndpointRules`: each endpoint but the last with the
/// probability that leaves the rest an equal share.
fn balance(port: &ServicePort, chain: &str, endpoints: &[&Endpoint], nat: &mut Table) {
    let name = port.name();
    let count = endpoints.len();
    for (index, endpoint) in endpoints.iter().enumerate() {
        let sep = port.sep_chain(endpoint);
        let statistic = if index + 1 < count {
            #[allow(clippy::cast_precision_loss)] // a handful of endpoints
            let probability = 1.0 / (count - index) as f64;
            format!(" -m statistic --mode random --probability {probability:.10}")
        } else {
            String::new()
        };
        nat.rule(
            chain,
            &format!(
                "-m comment --comment \"{name} -> {}\"{statistic} -j {sep}",
                endpoint.addr
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(
        service: &str,
        port_name: &str,
        protocol: Protocol,
        cluster_ip: [u8; 4],
        endpoints: &[(SocketAddrV4, bool)],
    ) -> ServicePort {
        ServicePort {
            namespace: "ns1".into(),
            service: service.into(),
            port_name: port_name.into(),
            protocol,
            cluster_ip: cluster_ip.into(),
            port: 80,
            node_port: None,
            external_traffic_policy: TrafficPolicy::Cluster,
            endpoints: endpoints
                .iter()
                .map(|&(addr, local)| Endpoint { addr, local })
                .collect(),
        }
    }

    fn ep(a: [u8; 4], p: u16) -> SocketAddrV4 {
        SocketAddrV4::new(a.into(), p)
    }

    /// Names kube-proxy's own tests expect (`TestOverallIPTablesRules`):
    /// the hash is over `ns/name:port` + protocol (+ endpoint).
    #[test]
    fn chain_names_match_kube_proxys_tests() {
        let svc1 = port(
            "svc1",
            "p80",
            Protocol::Tcp,
            [172, 30, 0, 41],
            &[(ep([10, 180, 0, 1], 80), false)],
        );
        assert_eq!(svc1.svc_chain(), "KUBE-SVC-XPGD46QRK7WJZT7O");
        assert_eq!(
            svc1.sep_chain(&svc1.endpoints[0]),
            "KUBE-SEP-SXIVWICOYRO3J4NJ"
        );
        let mut svc4 = port(
            "svc4",
            "p80",
            Protocol::Tcp,
            [172, 30, 0, 44],
            &[
                (ep([10, 180, 0, 4], 80), false),
                (ep([10, 180, 0, 5], 80), false),
            ],
        );
        svc4.namespace = "ns4".into();
        assert_eq!(svc4.svc_chain(), "KUBE-SVC-4SW47YFZTEDKD3PK");
        assert_eq!(
            svc4.sep_chain(&svc4.endpoints[0]),
            "KUBE-SEP-UKSFD7AGPMPPLUHC"
        );
    }

    #[test]
    fn cluster_ip_and_local_node_port_rules() {
        let cluster = port(
            "svc1",
            "p80",
            Protocol::Tcp,
            [10, 100, 0, 10],
            &[(ep([10, 20, 12, 50], 8080), false)],
        );
        let node_port = ServicePort {
            node_port: Some(30080),
            external_traffic_policy: TrafficPolicy::Local,
            ..port(
                "svc3",
                "p80-udp",
                Protocol::Udp,
                [10, 100, 0, 12],
                &[(ep([10, 20, 11, 21], 8080), true)],
            )
        };
        let out = restore_input(&[cluster, node_port], Options::default());
        let expected_nat = [
            "-A KUBE-POSTROUTING -m mark ! --mark 0x00004000/0x00004000 -j RETURN",
            "-A KUBE-POSTROUTING -j MARK --xor-mark 0x00004000",
            "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully",
            "-A KUBE-MARK-MASQ -j MARK --or-mark 0x00004000",
            "-A KUBE-SERVICES -m comment --comment \"ns1/svc1:p80 cluster IP\" -m tcp -p tcp -d 10.100.0.10 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O",
            "-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment \"ns1/svc1:p80 -> 10.20.12.50:8080\" -j KUBE-SEP-YC2PYEJLD7SPT636",
            "-A KUBE-SEP-YC2PYEJLD7SPT636 -m comment --comment ns1/svc1:p80 -s 10.20.12.50 -j KUBE-MARK-MASQ",
            "-A KUBE-SEP-YC2PYEJLD7SPT636 -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.20.12.50:8080",
            "-A KUBE-SERVICES -m comment --comment \"ns1/svc3:p80-udp cluster IP\" -m udp -p udp -d 10.100.0.12 --dport 80 -j KUBE-SVC-7VTWJ7VF7W4RU6XQ",
            "-A KUBE-NODEPORTS -m comment --comment ns1/svc3:p80-udp -m udp -p udp --dport 30080 -j KUBE-EXT-7VTWJ7VF7W4RU6XQ",
            "-A KUBE-EXT-7VTWJ7VF7W4RU6XQ -m comment --comment \"masquerade LOCAL traffic for ns1/svc3:p80-udp external destinations\" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ",
            "-A KUBE-EXT-7VTWJ7VF7W4RU6XQ -m comment --comment \"route LOCAL traffic for ns1/svc3:p80-udp external destinations\" -m addrtype --src-type LOCAL -j KUBE-SVC-7VTWJ7VF7W4RU6XQ",
            "-A KUBE-EXT-7VTWJ7VF7W4RU6XQ -j KUBE-SVL-7VTWJ7VF7W4RU6XQ",
            "-A KUBE-SVC-7VTWJ7VF7W4RU6XQ -m comment --comment \"ns1/svc3:p80-udp -> 10.20.11.21:8080\" -j KUBE-SEP-NR6T7QF2Y6H2R3NI",
            "-A KUBE-SVL-7VTWJ7VF7W4RU6XQ -m comment --comment \"ns1/svc3:p80-udp -> 10.20.11.21:8080\" -j KUBE-SEP-NR6T7QF2Y6H2R3NI",
            "-A KUBE-SEP-NR6T7QF2Y6H2R3NI -m comment --comment ns1/svc3:p80-udp -s 10.20.11.21 -j KUBE-MARK-MASQ",
            "-A KUBE-SEP-NR6T7QF2Y6H2R3NI -m comment --comment ns1/svc3:p80-udp -m udp -p udp -j DNAT --to-destination 10.20.11.21:8080",
            "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS",
        ];
        let nat: Vec<&str> = out
            .split("*nat\n")
            .nth(1)
            .unwrap()
            .lines()
            .filter(|l| l.starts_with("-A"))
            .collect();
        assert_eq!(nat, expected_nat);
        assert!(out.contains(
            "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n\
             -A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x00004000/0x00004000 -j ACCEPT\n\
             -A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n"
        ));
    }

    #[test]
    fn no_endpoints_rejects_and_two_endpoints_share() {
        let empty = ServicePort {
            node_port: Some(30081),
            ..port("svc4", "p80", Protocol::Tcp, [10, 100, 0, 13], &[])
        };
        let two = port(
            "svc5",
            "",
            Protocol::Tcp,
            [10, 100, 0, 14],
            &[
                (ep([10, 0, 0, 1], 80), false),
                (ep([10, 0, 0, 2], 80), false),
            ],
        );
        let out = restore_input(&[empty, two], Options::default());
        assert!(out.contains(
            "-A KUBE-SERVICES -m comment --comment \"ns1/svc4:p80 has no endpoints\" -m tcp -p tcp -d 10.100.0.13 --dport 80 -j REJECT\n"
        ));
        assert!(out.contains(
            "-A KUBE-EXTERNAL-SERVICES -m comment --comment \"ns1/svc4:p80 has no endpoints\" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 30081 -j REJECT\n"
        ));
        assert!(out.contains(
            "\"ns1/svc5 -> 10.0.0.1:80\" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-"
        ));
    }

    #[test]
    fn jumps_in_kube_proxys_order() {
        let jumps = jump_rules();
        assert_eq!(jumps.len(), 14);
        assert_eq!(
            jumps[5].args.join(" "),
            "-m comment --comment kubernetes forwarding rules -j KUBE-FORWARD"
        );
        assert_eq!(jumps[13].args, ["-j", "KUBE-FIREWALL"]);
    }

    #[test]
    fn the_jumps_restore_as_the_inserts_one_by_one() {
        let input = jumps_restore_input();
        let inserts: Vec<&str> = input.lines().filter(|l| l.starts_with("-I ")).collect();
        assert_eq!(inserts.len(), jump_rules().len());
        assert!(input.starts_with(
            "*filter\n-I INPUT -m conntrack --ctstate NEW -m comment --comment \
             \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES\n"
        ));
        assert!(input.ends_with("-I POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\nCOMMIT\n"));
        assert_eq!(input.matches("COMMIT").count(), 2);
    }
}
