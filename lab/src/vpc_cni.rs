//! The VPC CNI's own node wiring (`--datapath iptables`): the reference the
//! eBPF datapath is compared with.
//!
//! The iptables rules, rule 1024 and the per-pod rules are
//! [`vpcnet_api::vpc_cni`]'s (one definition with the agent's take-over and
//! uninstall); this adds what only the lab builds by hand, with the lab's
//! addresses:
//!
//! - With security groups for pods in strict mode, the `local` table rule
//!   moved from 0 to 20: `pkg/networkutils/network.go`, `SetupHostNetwork`.
//! - Per secondary ENI: table device number + 1 with a link route to the
//!   gateway and a default route through it, rule 32765 `from <ENI
//!   address>`: `network.go`, `setupENINetwork`.
//! - Per pod: route to its host veth and the plugin's rules
//!   (`cmd/routed-eni-cni-plugin/driver/driver.go`).
//! - Per branch-ENI pod: the VLAN table (VLAN id + 100) with a link route to
//!   the gateway and a default route (`setupVlan`, `buildRoutesForVlan`);
//!   strict mode: the pod's route in that table and rules 10 `iif
//!   vlan.eth.<id>` and `iif <host veth>` (`setupIIFBasedContainerRouteRules`);
//!   standard mode: rules 512 and 1536 with the VLAN table
//!   (`setupIPBasedContainerRouteRules`); all from `SetupBranchENIPodNetwork`.

use std::net::Ipv4Addr;

use vpcnet_api::vpc_cni::{BranchPodWiring, IpRule, NodeWiring};
pub use vpcnet_api::vpc_cni::{
    FROM_ENI_PRIMARY_IP_RULE_PRIORITY, FROM_POD_RULE_PRIORITY, HOST_RULE_PRIORITY,
    LOCAL_RULE_PRIORITY, TO_POD_RULE_PRIORITY, VLAN_RULE_PRIORITY,
};

use crate::{
    addrs::{
        CONNMARK, NODE_ETH0, NODE_PRIMARY_ADDR, NODE_SUBNET_GW, NS_NODE, VETH_PREFIX, VPC_CIDRS,
        eni_ifname, eni_primary_addr, eni_route_table, filler_pod_addr,
    },
    ec2::EmulatorProcess,
    error::{Context, Result},
    netns::{exec_ok, ip_batch},
    options::{EnforcingMode, LabOptions},
    state::PodInfo,
};

/// What aws-node's rules depend on, for the lab's node.
pub fn node_wiring(opts: &LabOptions) -> NodeWiring {
    NodeWiring {
        node_addr: NODE_PRIMARY_ADDR,
        primary_interface: NODE_ETH0.to_owned(),
        vpc_cidrs: VPC_CIDRS.to_vec(),
        exclude_snat_cidrs: opts.exclude_snat_cidrs.clone(),
        external_snat: opts.external_snat,
        randomize_snat: opts.randomize_snat.env_value().to_owned(),
        connmark: CONNMARK,
        veth_prefix: VETH_PREFIX.to_owned(),
    }
}

/// The `iptables` invocations (without the program name) that wire the node,
/// in order.
pub fn iptables_commands(opts: &LabOptions) -> Vec<Vec<String>> {
    node_wiring(opts).iptables_commands()
}

/// The node-wide `ip rule`: marked traffic is routed by the main table
/// (present whenever node port support is on, which is the default).
pub fn host_rule_lines(opts: &LabOptions) -> Vec<String> {
    vec![node_wiring(opts).host_rule().to_string()]
}

/// With security groups for pods (`ENABLE_POD_ENI`) in strict mode, the
/// `local` table rule moves from priority 0 to 20, after the VLAN rules
/// (10): a strict pod's packets to node-local addresses also leave by its
/// branch ENI (`SetupHostNetwork`).
pub fn strict_local_rule_lines() -> Vec<String> {
    vec![
        format!("rule add priority {LOCAL_RULE_PRIORITY} table local"),
        "rule del priority 0 table local".to_owned(),
    ]
}

/// What ipamd sets up in policy routing for secondary ENI `device`
/// (`setupENINetwork`): the ENI's route table (device number + 1) with a
/// link route to the subnet gateway and a default route through it, and
/// rule 32765 for the ENI's own primary address. (The link itself, its
/// address and the removal of the subnet route from `main` are done for
/// both datapaths: see `topology`.)
pub fn eni_table_lines(device: usize) -> Vec<String> {
    let link = eni_ifname(device);
    let table = eni_route_table(device);
    vec![
        format!("route replace {NODE_SUBNET_GW}/32 dev {link} scope link table {table}"),
        format!("route replace default via {NODE_SUBNET_GW} dev {link} table {table}"),
        format!(
            "rule add from {}/32 priority {FROM_ENI_PRIMARY_IP_RULE_PRIORITY} table {table}",
            eni_primary_addr(device)
        ),
    ]
}

/// The CNI plugin's per-pod rule for a pod on the primary ENI.
pub fn pod_rule_line(pod_addr: Ipv4Addr) -> String {
    IpRule::pod_rules(pod_addr, crate::addrs::RT_TABLE_MAIN)[0].to_string()
}

/// The CNI plugin's node-side routes and rules for `pod` (after its veth
/// exists), in the plugin's order:
///
/// - on an ENI (`SetupPodNetwork`): `<pod> dev <veth> scope link` in
///   `main`, rule 512, and on a secondary ENI rule 1536 to the ENI's table;
/// - on a branch ENI (`SetupBranchENIPodNetwork`): the VLAN table's routes,
///   then strict: the pod's route in the VLAN table and two rules 10
///   (`iif vlan.eth.<id>`, `iif <host veth>`); standard: as on an ENI, with
///   the VLAN table for rule 1536.
pub fn pod_lines(pod: &PodInfo) -> Vec<String> {
    let addr = pod.addr;
    let veth = &pod.host_veth;
    let main_route = format!("route replace {addr}/32 dev {veth} scope link");
    let Some(branch) = &pod.branch else {
        let table = eni_route_table(pod.eni_device.unwrap_or(0));
        let mut lines = vec![main_route];
        lines.extend(
            IpRule::pod_rules(addr, table)
                .iter()
                .map(ToString::to_string),
        );
        return lines;
    };
    let wiring = BranchPodWiring {
        addr,
        host_veth: veth.clone(),
        vlan_id: branch.vlan_id,
        gateway: NODE_SUBNET_GW,
        strict: branch.mode == EnforcingMode::Strict,
    };
    wiring
        .routes()
        .iter()
        .map(ToString::to_string)
        .chain(wiring.rules().iter().map(ToString::to_string))
        .collect()
}

/// The rules of `count` filler pods: 512 and 1536 each, as the plugin gives
/// a pod on `eth1` (whose table is used whether or not `eth1` exists: the
/// addresses carry no traffic, only the rule list grows).
pub fn filler_rule_lines(count: usize) -> Vec<String> {
    let table = eni_route_table(1);
    (0..count)
        .filter_map(filler_pod_addr)
        .flat_map(|addr| {
            [
                pod_rule_line(addr),
                format!("rule add from {addr}/32 priority {FROM_POD_RULE_PRIORITY} table {table}"),
            ]
        })
        .collect()
}

/// Wires the node with the VPC CNI's rules (pods' rules come with the pods).
pub fn wire_node(opts: &LabOptions) -> Result<()> {
    for command in iptables_commands(opts) {
        let mut argv = vec![opts.iptables_backend.iptables(), "-w"];
        argv.extend(command.iter().map(String::as_str));
        exec_ok(NS_NODE, &argv)?;
    }
    let mut lines = host_rule_lines(opts);
    if !opts.branch_pods.is_empty() && opts.sg_enforcing_mode == EnforcingMode::Strict {
        lines.extend(strict_local_rule_lines());
    }
    for device in 1..opts.enis {
        lines.extend(eni_table_lines(device));
    }
    // Before any pod: the lab's own pods' rules come after these.
    lines.extend(filler_rule_lines(opts.filler_pods));
    ip_batch(Some(NS_NODE), &lines)
}

/// What aws-node leaves behind on its node besides the wiring, for the
/// agent to take over: the pods' addresses assigned to the primary ENI in
/// EC2, and its checkpoint listing them with their pods' names.
pub fn record_aws_node_state(emulator: &EmulatorProcess, pods: &[PodInfo]) -> Result<()> {
    let admin_error = |err: crate::ec2::EmulatorError| {
        crate::error::LabError::InvalidOption(format!("recording aws-node's addresses: {err}"))
    };
    let state = emulator.admin().state().map_err(admin_error)?;
    let primary_eni = state
        .instances
        .iter()
        .find(|instance| instance.id == emulator.instance_id())
        .map(|instance| instance.primary_eni.clone())
        .ok_or_else(|| {
            crate::error::LabError::InvalidOption("the emulator has no lab instance".into())
        })?;
    // A branch-ENI pod's address is its branch ENI's: ipamd neither holds
    // nor checkpoints it, and EC2 gives it to nobody else.
    let branch_addrs: Vec<Ipv4Addr> = pods
        .iter()
        .filter(|pod| pod.branch.is_some())
        .map(|pod| pod.addr)
        .collect();
    emulator
        .admin()
        .occupy(crate::ec2::config::LAB_NODE_SUBNET_ID, &branch_addrs, &[])
        .map_err(admin_error)?;
    let pods: Vec<&PodInfo> = pods.iter().filter(|pod| pod.branch.is_none()).collect();
    let addrs: Vec<Ipv4Addr> = pods.iter().map(|pod| pod.addr).collect();
    emulator
        .admin()
        .assign(&primary_eni, &addrs)
        .map_err(admin_error)?;
    let allocations: Vec<serde_json::Value> = pods
        .iter()
        .map(|pod| {
            serde_json::json!({
                "networkName": "aws-cni",
                "containerID": format!("aws-node-{}", pod.k8s_name),
                "ifName": "eth0",
                "ipv4": pod.addr.to_string(),
                "allocationTimestamp": 1_700_000_000_000_000_000_i64,
                "metadata": {
                    "k8sPodNamespace": pod.k8s_namespace,
                    "k8sPodName": pod.k8s_name,
                },
            })
        })
        .collect();
    let checkpoint = serde_json::json!({
        "version": "vpc-cni-ipam/1",
        "allocations": allocations,
    });
    let path = crate::state::ipam_checkpoint_file();
    std::fs::write(&path, checkpoint.to_string())
        .context(|| format!("writing aws-node's checkpoint {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::RandomizeSnat;

    fn joined(opts: &LabOptions) -> Vec<String> {
        iptables_commands(opts)
            .into_iter()
            .map(|c| c.join(" "))
            .collect()
    }

    #[test]
    fn default_wiring_matches_the_vpc_cni() {
        let rules = joined(&LabOptions {
            exclude_snat_cidrs: vec!["192.0.2.0/24".parse().unwrap()],
            ..LabOptions::iptables(1)
        });
        let expected_in_order = [
            "-t nat -N AWS-SNAT-CHAIN-0",
            "-t nat -A POSTROUTING -m comment --comment AWS SNAT CHAIN -j AWS-SNAT-CHAIN-0",
            "-t nat -I AWS-SNAT-CHAIN-0 1 -d 10.20.0.0/16 -m comment --comment AWS SNAT CHAIN -j RETURN",
            "-t nat -I AWS-SNAT-CHAIN-0 1 -d 100.64.0.0/16 -m comment --comment AWS SNAT CHAIN -j RETURN",
            "-t nat -I AWS-SNAT-CHAIN-0 1 -d 192.0.2.0/24 -m comment --comment AWS SNAT CHAIN EXCLUSION -j RETURN",
            "-t nat -A AWS-SNAT-CHAIN-0 ! -o vlan+ -m comment --comment AWS, SNAT -m addrtype ! --dst-type LOCAL -j SNAT --to-source 10.20.11.162 --random-fully",
            "-t nat -A PREROUTING -i eni+ -m comment --comment AWS, outbound connections -j AWS-CONNMARK-CHAIN-0",
            "-t nat -A AWS-CONNMARK-CHAIN-0 -m comment --comment AWS, CONNMARK -j CONNMARK --set-xmark 0x80/0x80",
        ];
        let mut position = 0;
        for rule in expected_in_order {
            let found = rules[position..].iter().position(|r| r == rule);
            assert!(
                found.is_some(),
                "missing or out of order: {rule}\nin {rules:#?}"
            );
            position += found.unwrap() + 1;
        }
    }

    #[test]
    fn external_snat_removes_snat_and_connmark_but_keeps_node_port_marks() {
        let rules = joined(&LabOptions {
            external_snat: true,
            ..LabOptions::iptables(1)
        });
        assert!(rules.iter().all(|r| !r.contains("-j SNAT")));
        assert!(rules.iter().all(|r| !r.contains("AWS-CONNMARK-CHAIN-0")));
        assert!(rules.contains(&"-t nat -N AWS-SNAT-CHAIN-0".to_owned()));
        assert!(rules.iter().any(|r| r.contains("--set-mark 0x80/0x80")));
    }

    #[test]
    fn randomization_flags() {
        for (mode, tail) in [
            (
                RandomizeSnat::Prng,
                "--to-source 10.20.11.162 --random-fully",
            ),
            (
                RandomizeSnat::HashRandom,
                "--to-source 10.20.11.162 --random",
            ),
            (RandomizeSnat::Sequential, "--to-source 10.20.11.162"),
        ] {
            let rules = joined(&LabOptions {
                randomize_snat: mode,
                ..LabOptions::iptables(1)
            });
            let snat = rules.iter().find(|r| r.contains("-j SNAT")).unwrap();
            assert!(snat.ends_with(tail), "{mode}: {snat}");
        }
    }

    #[test]
    fn a_default_route_exclusion_has_no_destination_match() {
        let rules = joined(&LabOptions {
            exclude_snat_cidrs: vec!["0.0.0.0/0".parse().unwrap()],
            ..LabOptions::iptables(1)
        });
        assert!(rules.contains(
            &"-t nat -I AWS-SNAT-CHAIN-0 1 -m comment --comment AWS SNAT CHAIN EXCLUSION -j RETURN"
                .to_owned()
        ));
    }

    #[test]
    fn pod_lines_per_kind_of_pod() {
        let opts = LabOptions {
            enis: 3,
            branch_pods: vec![2],
            ..LabOptions::iptables(4)
        };
        let pod = |index, opts: &LabOptions| PodInfo::in_lab(index, opts).unwrap();
        assert_eq!(
            pod_lines(&pod(0, &opts)),
            vec![
                "route replace 10.20.11.20/32 dev enic220f2ba281 scope link",
                "rule add to 10.20.11.20/32 priority 512 table main",
            ]
        );
        assert_eq!(
            pod_lines(&pod(1, &opts))[1..],
            [
                "rule add to 10.20.11.21/32 priority 512 table main",
                "rule add from 10.20.11.21/32 priority 1536 table 2",
            ]
        );
        let strict = pod(2, &opts);
        assert_eq!(strict.host_veth, "vlanfbd243bfedd");
        assert_eq!(
            pod_lines(&strict),
            vec![
                "route replace 10.20.11.1/32 dev vlan.eth.1 scope link table 101",
                "route replace default via 10.20.11.1 dev vlan.eth.1 table 101",
                "route replace 10.20.11.22/32 dev vlanfbd243bfedd scope link table 101",
                "rule add iif vlan.eth.1 priority 10 table 101",
                "rule add iif vlanfbd243bfedd priority 10 table 101",
            ]
        );
        let standard = pod(
            2,
            &LabOptions {
                sg_enforcing_mode: EnforcingMode::Standard,
                ..opts
            },
        );
        assert!(standard.host_veth.starts_with("eni"));
        assert_eq!(
            pod_lines(&standard)[2..],
            [
                format!(
                    "route replace 10.20.11.22/32 dev {} scope link",
                    standard.host_veth
                ),
                "rule add to 10.20.11.22/32 priority 512 table main".to_owned(),
                "rule add from 10.20.11.22/32 priority 1536 table 101".to_owned(),
            ]
        );
        assert_eq!(
            eni_table_lines(2),
            vec![
                "route replace 10.20.11.1/32 dev eth2 scope link table 3",
                "route replace default via 10.20.11.1 dev eth2 table 3",
                "rule add from 10.20.11.12/32 priority 32765 table 3",
            ]
        );
    }

    #[test]
    fn pod_rule() {
        assert_eq!(
            pod_rule_line(Ipv4Addr::new(10, 20, 11, 20)),
            "rule add to 10.20.11.20/32 priority 512 table main"
        );
    }
}
