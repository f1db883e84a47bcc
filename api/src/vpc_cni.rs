//! The AWS VPC CNI's own node wiring, one definition for the lab's
//! `--datapath iptables` (the reference vpcnet is compared with), the
//! agent's take-over from aws-node (what it removes) and `vpcnet-agent
//! uninstall` (what it writes back for aws-node).
//!
//! These are the rules `aws-node` (ipamd) installs on an IPv4 node (node
//! port support on, the default), in its order and with its comments, and
//! the ip rules its CNI plugin adds per pod. Where each comes from in
//! `aws/amazon-vpc-cni-k8s`:
//!
//! - SNAT chain, mangle connmark for the primary ENI: `pkg/networkutils/
//!   network.go`, `buildIptablesSNATRules`; the connmark chain:
//!   `pkg/networkutils/iptables_connmark.go`, `buildRules`.
//! - Rule 1024 (`fwmark <connmark> lookup main`): `network.go`,
//!   `SetupHostNetwork`.
//! - Per pod: rule 512 `to <pod> lookup main`, and for pods on a secondary
//!   ENI rule 1536 `from <pod> lookup <ENI table>`:
//!   `cmd/routed-eni-cni-plugin/driver/driver.go`,
//!   `setupIPBasedContainerRouteRules`.
//! - Per branch-ENI pod (security groups for pods), [`BranchPodWiring`]:
//!   `driver.go`, `SetupBranchENIPodNetwork`.
//!
//! The connmark rules are the iptables flavour (the chain
//! `AWS-CONNMARK-CHAIN-0`); recent VPC CNI releases write the same marks with
//! an nftables table on nft-backed hosts.

use std::{fmt, net::Ipv4Addr};

use ipnet::Ipv4Net;

/// Where ipamd serves its CNI plugin over gRPC (`pkg/ipamd/rpc_handler.go`,
/// `ipamdgRPCaddress`): while it answers there, ipamd runs on the node.
pub const IPAMD_GRPC_ADDRESS: &str = "127.0.0.1:50051";
/// aws-node's DaemonSet: its namespace and its pods' label.
pub const AWS_NODE_NAMESPACE: &str = "kube-system";
pub const AWS_NODE_POD_LABEL: (&str, &str) = ("k8s-app", "aws-node");

/// ipamd's SNAT chain (network card 0).
pub const SNAT_CHAIN: &str = "AWS-SNAT-CHAIN-0";
/// ipamd's connmark chain (network card 0).
pub const CONNMARK_CHAIN: &str = "AWS-CONNMARK-CHAIN-0";
/// The prefix of every chain ipamd creates (`AWS-SNAT-CHAIN-<n>`,
/// `AWS-CONNMARK-CHAIN-<n>`).
pub const CHAIN_PREFIX: &str = "AWS-";
/// Every comment of ipamd's rules starts with this: what tells them from
/// kube-proxy's and anyone else's.
pub const COMMENT_PREFIX: &str = "AWS";
/// `AWS_VPC_K8S_CNI_CONNMARK`'s default.
pub const DEFAULT_CONNMARK: u32 = 0x80;
/// Table `main`.
pub const MAIN_TABLE: u32 = 254;

// `ip rule` priorities the VPC CNI uses (`pkg/networkutils/network.go`).
/// `VlanRulePriority`: branch-ENI pods in strict mode.
pub const VLAN_RULE_PRIORITY: u32 = 10;
/// `localRulePriority`: where strict mode moves the `local` table rule.
pub const LOCAL_RULE_PRIORITY: u32 = 20;
/// `ToContainerRulePriority`: `to <pod> lookup main`.
pub const TO_POD_RULE_PRIORITY: u32 = 512;
/// `hostRulePriority`: `fwmark <connmark> lookup main`.
pub const HOST_RULE_PRIORITY: u32 = 1024;
/// `FromPodRulePriority`: `from <pod> lookup <ENI table>`.
pub const FROM_POD_RULE_PRIORITY: u32 = 1536;
/// `FromPrimaryIPofENIRulePriority`: `from <ENI address> lookup <ENI table>`.
pub const FROM_ENI_PRIMARY_IP_RULE_PRIORITY: u32 = 32765;

/// The route table of the ENI with device number `device` (ipamd's
/// `deviceNumber + 1`; the primary ENI, device 0, uses `main`).
#[must_use]
pub fn eni_route_table(device: u32) -> u32 {
    if device == 0 { MAIN_TABLE } else { device + 1 }
}

/// The first address of a subnet after its network address: the VPC
/// router's address in it (ipamd's `GetIPv4Gateway`).
#[must_use]
pub fn gateway_of(subnet: Ipv4Net) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(subnet.network()) + 1)
}

/// The route table of the branch ENI on VLAN `vlan_id` (`vlanID + 100`).
#[must_use]
pub fn vlan_route_table(vlan_id: u16) -> u32 {
    u32::from(vlan_id) + 100
}

/// One IPv4 route of the VPC CNI's: `dst` by `dev`, through `via` or on
/// the link.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Route {
    pub dst: Ipv4Net,
    pub via: Option<Ipv4Addr>,
    pub dev: String,
    pub table: u32,
}

/// `ip route replace ...` as `ip -batch` takes it.
impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.dst.prefix_len() == 0 {
            f.write_str("route replace default")?;
        } else {
            write!(f, "route replace {}", self.dst)?;
        }
        match self.via {
            Some(via) => write!(f, " via {via} dev {}", self.dev)?,
            None => write!(f, " dev {} scope link", self.dev)?,
        }
        if self.table != MAIN_TABLE {
            write!(f, " table {}", self.table)?;
        }
        Ok(())
    }
}

/// A branch-ENI pod as the VPC CNI's plugin wires it
/// (`SetupBranchENIPodNetwork`): the VLAN's table (its gateway on the link,
/// the default route through it); strict: the pod's route in that table and
/// the two rules 10 (`iif vlan.eth.<id>`, `iif <host veth>`), everything of
/// the pod by the VLAN; standard: the pod's route in `main`, rule 512, and
/// rule 1536 to the VLAN's table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BranchPodWiring {
    pub addr: Ipv4Addr,
    pub host_veth: String,
    pub vlan_id: u16,
    /// The branch ENI's subnet gateway.
    pub gateway: Ipv4Addr,
    pub strict: bool,
}

impl BranchPodWiring {
    /// Its VLAN link, `vlan.eth.<id>`.
    #[must_use]
    pub fn vlan_link(&self) -> String {
        crate::pod::branch_link_name(self.vlan_id)
    }

    #[must_use]
    pub fn table(&self) -> u32 {
        vlan_route_table(self.vlan_id)
    }

    /// Its routes, in the plugin's order.
    #[must_use]
    pub fn routes(&self) -> Vec<Route> {
        let (vlan, table) = (self.vlan_link(), self.table());
        let on = |dst: Ipv4Net, dev: &str, table| Route {
            dst,
            via: None,
            dev: dev.to_owned(),
            table,
        };
        vec![
            on(Ipv4Net::from(self.gateway), &vlan, table),
            Route {
                via: Some(self.gateway),
                ..on(Ipv4Net::default(), &vlan, table)
            },
            on(
                Ipv4Net::from(self.addr),
                &self.host_veth,
                if self.strict { table } else { MAIN_TABLE },
            ),
        ]
    }

    /// Its rules.
    #[must_use]
    pub fn rules(&self) -> Vec<IpRule> {
        let table = self.table();
        if self.strict {
            [self.vlan_link(), self.host_veth.clone()]
                .into_iter()
                .map(|iif| IpRule {
                    iif: Some(iif),
                    ..IpRule::new(VLAN_RULE_PRIORITY, table)
                })
                .collect()
        } else {
            IpRule::pod_rules(self.addr, table)
        }
    }
}

/// What ipamd's rules depend on: the node and the VPC CNI's variables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeWiring {
    /// The primary ENI's address, SNAT's source.
    pub node_addr: Ipv4Addr,
    /// The primary ENI's link (node port marks come in by it).
    pub primary_interface: String,
    /// The VPC's CIDRs: never translated.
    pub vpc_cidrs: Vec<Ipv4Net>,
    /// `AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS`.
    pub exclude_snat_cidrs: Vec<Ipv4Net>,
    /// `AWS_VPC_K8S_CNI_EXTERNALSNAT`.
    pub external_snat: bool,
    /// `AWS_VPC_K8S_CNI_RANDOMIZESNAT` (`prng`, `hashrandom`, `none`).
    pub randomize_snat: String,
    /// `AWS_VPC_K8S_CNI_CONNMARK`.
    pub connmark: u32,
    /// `AWS_VPC_K8S_CNI_VETHPREFIX`.
    pub veth_prefix: String,
}

/// An iptables argument list from `spec`, split at whitespace, where the
/// token `@comment` stands for `comment` (which has spaces of its own).
fn rule(spec: &str, comment: &str) -> Vec<String> {
    spec.split_whitespace()
        .map(|token| if token == "@comment" { comment } else { token }.to_owned())
        .collect()
}

/// The flag `AWS_VPC_K8S_CNI_RANDOMIZESNAT` puts on the SNAT rule: `prng`
/// (the default, and any value the VPC CNI does not know) `--random-fully`,
/// `hashrandom` `--random`, `none` no flag.
#[must_use]
pub fn randomize_flag(randomize_snat: &str) -> Option<&'static str> {
    match randomize_snat {
        "none" => None,
        "hashrandom" => Some("--random"),
        _ => Some("--random-fully"),
    }
}

/// `-d <cidr> ` the way the VPC CNI writes it: for 0.0.0.0/0 it leaves the
/// match out (the kernel would strip it anyway).
fn dest_match(cidr: Ipv4Net) -> String {
    if cidr.prefix_len() == 0 {
        String::new()
    } else {
        format!("-d {cidr} ")
    }
}

impl NodeWiring {
    /// The `iptables` invocations (without the program name) that wire the
    /// node, in order.
    #[must_use]
    pub fn iptables_commands(&self) -> Vec<Vec<String>> {
        let mut commands = self.snat_commands();
        commands.extend(self.node_port_commands());
        if !self.external_snat {
            commands.extend(self.connmark_commands());
        }
        commands
    }

    /// The VPC CIDRs, then the exclusions (flagged): never translated or
    /// marked.
    fn exempt_cidrs(&self) -> impl Iterator<Item = (Ipv4Net, bool)> + '_ {
        self.vpc_cidrs
            .iter()
            .map(|cidr| (*cidr, false))
            .chain(self.exclude_snat_cidrs.iter().map(|cidr| (*cidr, true)))
    }

    /// SNAT for traffic leaving the VPC. The chain exists even with
    /// external SNAT; only its rules go.
    fn snat_commands(&self) -> Vec<Vec<String>> {
        let mut commands = vec![rule(&format!("-t nat -N {SNAT_CHAIN}"), "")];
        if self.external_snat {
            return commands;
        }
        commands.push(rule(
            &format!("-t nat -A POSTROUTING -m comment --comment @comment -j {SNAT_CHAIN}"),
            "AWS SNAT CHAIN",
        ));
        // Each exemption is inserted at the top, so they all end up before
        // the SNAT rule (in reverse order, as on a real node).
        for (cidr, excluded) in self.exempt_cidrs() {
            let comment = if excluded {
                "AWS SNAT CHAIN EXCLUSION"
            } else {
                "AWS SNAT CHAIN"
            };
            commands.push(rule(
                &format!(
                    "-t nat -I {SNAT_CHAIN} 1 {}-m comment --comment @comment -j RETURN",
                    dest_match(cidr)
                ),
                comment,
            ));
        }
        let mut snat = rule(
            &format!(
                "-t nat -A {SNAT_CHAIN} ! -o vlan+ -m comment --comment @comment \
                 -m addrtype ! --dst-type LOCAL -j SNAT --to-source {}",
                self.node_addr
            ),
            "AWS, SNAT",
        );
        snat.extend(randomize_flag(&self.randomize_snat).map(ToOwned::to_owned));
        commands.push(snat);
        commands
    }

    /// Node port support (on by default): connections that come in on the
    /// primary ENI to a local address are marked, and replies from pods get
    /// the mark back, so they leave by the primary ENI (ip rule 1024).
    fn node_port_commands(&self) -> Vec<Vec<String>> {
        let comment = "AWS, primary ENI";
        let mark = self.connmark;
        vec![
            rule(
                &format!(
                    "-t mangle -A PREROUTING -m comment --comment @comment -i {} \
                     -m addrtype --dst-type LOCAL --limit-iface-in \
                     -j CONNMARK --set-mark {mark:#x}/{mark:#x}",
                    self.primary_interface
                ),
                comment,
            ),
            rule(
                &format!(
                    "-t mangle -A PREROUTING -m comment --comment @comment -i {}+ \
                     -j CONNMARK --restore-mark --mask {mark:#x}",
                    self.veth_prefix
                ),
                comment,
            ),
            rule(
                &format!(
                    "-t mangle -A PREROUTING -m comment --comment @comment -i vlan+ \
                     -j CONNMARK --restore-mark --mask {mark:#x}"
                ),
                comment,
            ),
        ]
    }

    /// Connmark for source-NATed pod connections (gone with external SNAT):
    /// pod traffic to outside the VPC and the exclusions gets the mark, so
    /// replies are routed by the main table (ip rule 1024).
    fn connmark_commands(&self) -> Vec<Vec<String>> {
        let mark = self.connmark;
        let mut commands = vec![
            rule(&format!("-t nat -N {CONNMARK_CHAIN}"), ""),
            rule(
                &format!(
                    "-t nat -A PREROUTING -i {}+ -m comment --comment @comment \
                     -j {CONNMARK_CHAIN}",
                    self.veth_prefix
                ),
                "AWS, outbound connections",
            ),
        ];
        for (cidr, _) in self.exempt_cidrs() {
            commands.push(rule(
                &format!(
                    "-t nat -I {CONNMARK_CHAIN} 1 {}-m comment --comment @comment -j RETURN",
                    dest_match(cidr)
                ),
                "AWS CONNMARK CHAIN",
            ));
        }
        commands.push(rule(
            &format!(
                "-t nat -A PREROUTING -m comment --comment @comment \
                 -j CONNMARK --restore-mark --mask {mark:#x}"
            ),
            "AWS, CONNMARK",
        ));
        commands.push(rule(
            &format!(
                "-t nat -A {CONNMARK_CHAIN} -m comment --comment @comment \
                 -j CONNMARK --set-xmark {mark:#x}/{mark:#x}"
            ),
            "AWS, CONNMARK",
        ));
        commands
    }

    /// The node-wide `ip rule`: marked traffic is routed by the main table.
    #[must_use]
    pub fn host_rule(&self) -> IpRule {
        IpRule {
            priority: HOST_RULE_PRIORITY,
            fwmark: Some(self.connmark),
            ..IpRule::new(HOST_RULE_PRIORITY, MAIN_TABLE)
        }
    }
}

/// One IPv4 policy routing rule of the VPC CNI's, with the fields it uses.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct IpRule {
    pub priority: u32,
    pub from: Option<Ipv4Net>,
    pub to: Option<Ipv4Net>,
    /// `fwmark <mark>/<mark>`.
    pub fwmark: Option<u32>,
    pub iif: Option<String>,
    pub table: u32,
}

impl IpRule {
    /// A rule matching everything, `lookup table`.
    #[must_use]
    pub fn new(priority: u32, table: u32) -> Self {
        Self {
            priority,
            from: None,
            to: None,
            fwmark: None,
            iif: None,
            table,
        }
    }

    /// The plugin's rules for a pod at `addr` on the ENI whose route table
    /// is `table`: 512 always, 1536 when that is not `main`.
    #[must_use]
    pub fn pod_rules(addr: Ipv4Addr, table: u32) -> Vec<Self> {
        let host = Ipv4Net::from(addr);
        let mut rules = vec![Self {
            to: Some(host),
            ..Self::new(TO_POD_RULE_PRIORITY, MAIN_TABLE)
        }];
        if table != MAIN_TABLE {
            rules.push(Self {
                from: Some(host),
                ..Self::new(FROM_POD_RULE_PRIORITY, table)
            });
        }
        rules
    }
}

/// `ip rule add ...` as `ip -batch` takes it.
impl fmt::Display for IpRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("rule add")?;
        if let Some(from) = self.from {
            write!(f, " from {from}")?;
        }
        if let Some(to) = self.to {
            write!(f, " to {to}")?;
        }
        if let Some(mark) = self.fwmark {
            write!(f, " fwmark {mark:#x}/{mark:#x}")?;
        }
        if let Some(iif) = &self.iif {
            write!(f, " iif {iif}")?;
        }
        let table = self.table;
        if table == MAIN_TABLE {
            write!(f, " priority {} table main", self.priority)
        } else {
            write!(f, " priority {} table {table}", self.priority)
        }
    }
}

/// Splits a line of `iptables -S` into its arguments: words, or a double
/// quoted string (a comment with spaces) with `\"` and `\\` escapes.
#[must_use]
pub fn split_iptables_line(line: &str) -> Vec<String> {
    let mut args = Vec::new();
    let mut chars = line.chars().peekable();
    while let Some(&c) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
            continue;
        }
        let mut arg = String::new();
        if c == '"' {
            chars.next();
            while let Some(c) = chars.next() {
                match c {
                    '"' => break,
                    '\\' => arg.extend(chars.next()),
                    _ => arg.push(c),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                arg.push(c);
                chars.next();
            }
        }
        args.push(arg);
    }
    args
}

/// Whether `args` (a rule as `iptables -S` lists it, split) is one of
/// ipamd's: its comment says AWS, or it jumps to one of its chains.
#[must_use]
pub fn is_vpc_cni_rule(args: &[String]) -> bool {
    args.windows(2).any(|pair| {
        (pair[0] == "--comment" && pair[1].starts_with(COMMENT_PREFIX))
            || (pair[0] == "-j" && pair[1].starts_with(CHAIN_PREFIX))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wiring() -> NodeWiring {
        NodeWiring {
            node_addr: Ipv4Addr::new(10, 20, 11, 162),
            primary_interface: "eth0".into(),
            vpc_cidrs: vec!["10.20.0.0/16".parse().unwrap()],
            exclude_snat_cidrs: vec![],
            external_snat: false,
            randomize_snat: "prng".into(),
            connmark: DEFAULT_CONNMARK,
            veth_prefix: "eni".into(),
        }
    }

    #[test]
    fn randomization_flags() {
        assert_eq!(randomize_flag("prng"), Some("--random-fully"));
        assert_eq!(randomize_flag("hashrandom"), Some("--random"));
        assert_eq!(randomize_flag("none"), None);
    }

    #[test]
    fn rules_print_as_ip_takes_them() {
        assert_eq!(
            wiring().host_rule().to_string(),
            "rule add fwmark 0x80/0x80 priority 1024 table main"
        );
        let rules: Vec<String> = IpRule::pod_rules(Ipv4Addr::new(10, 20, 11, 21), 2)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            rules,
            [
                "rule add to 10.20.11.21/32 priority 512 table main",
                "rule add from 10.20.11.21/32 priority 1536 table 2",
            ]
        );
        assert_eq!(
            IpRule::pod_rules(Ipv4Addr::new(10, 0, 0, 1), MAIN_TABLE).len(),
            1
        );
    }

    #[test]
    fn listed_rules_split_and_are_told_apart() {
        let line = r#"-A POSTROUTING -m comment --comment "AWS SNAT CHAIN" -j AWS-SNAT-CHAIN-0"#;
        let args = split_iptables_line(line);
        assert_eq!(
            args,
            [
                "-A",
                "POSTROUTING",
                "-m",
                "comment",
                "--comment",
                "AWS SNAT CHAIN",
                "-j",
                "AWS-SNAT-CHAIN-0"
            ]
        );
        assert!(is_vpc_cni_rule(&args));
        let kube_proxy = split_iptables_line(
            r#"-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING"#,
        );
        assert!(!is_vpc_cni_rule(&kube_proxy));
        assert_eq!(
            split_iptables_line(r#"-m comment --comment "a \"quoted\" word""#)[3],
            r#"a "quoted" word"#
        );
    }

    #[test]
    fn every_written_rule_is_recognised_as_the_vpc_cni_s() {
        for command in wiring().iptables_commands() {
            if command.iter().any(|a| a == "-A" || a == "-I") {
                assert!(is_vpc_cni_rule(&command), "{command:?}");
            }
        }
    }
}
