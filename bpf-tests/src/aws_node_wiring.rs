//! What aws-node wires on a node, as a test reads it back: its iptables
//! rules in the node's backend, its ip rules, its conflist; and the SNAT
//! flows the take-over copied into the datapath. The take-over tests
//! compare them before, during and after vpcnet.

use std::{collections::BTreeSet, path::Path};

use vpcnet_agent::datapath::DatapathMaps;
use vpcnet_common::{maps::PIN_DIR, nat::FlowKind, raw_to_port};
use vpcnet_lab::{IptablesBackend, addrs, exec_ok};

/// aws-node's conflist as it installs it (the content does not matter
/// here, only that the runtime would pick it).
pub const AWS_CONFLIST: &str =
    r#"{"cniVersion":"1.0.0","name":"aws-cni","plugins":[{"type":"aws-cni"}]}"#;

/// The node's wiring: its iptables rules (nat and mangle, as `iptables
/// -S` of `backend` lists them) and the ip rules.
pub fn wiring_in(backend: IptablesBackend) -> BTreeSet<String> {
    let mut wiring = iptables_rules(backend);
    let rules = exec_ok(addrs::NS_NODE, &["ip", "-4", "rule", "show"]).expect("ip rule");
    wiring.extend(rules.lines().map(str::to_owned));
    wiring
}

/// The nat and mangle rules `backend` holds, as `iptables -S` lists them.
pub fn iptables_rules(backend: IptablesBackend) -> BTreeSet<String> {
    let mut rules = BTreeSet::new();
    for table in ["nat", "mangle"] {
        let listing = exec_ok(
            addrs::NS_NODE,
            &[backend.iptables(), "-w", "-t", table, "-S"],
        )
        .expect("iptables -S");
        rules.extend(listing.lines().map(|line| format!("{table} {line}")));
    }
    rules
}

/// The backend other than `backend`.
#[must_use]
pub fn other_backend(backend: IptablesBackend) -> IptablesBackend {
    match backend {
        IptablesBackend::Legacy => IptablesBackend::Nft,
        IptablesBackend::Nft => IptablesBackend::Legacy,
    }
}

/// The backend the node does not use holds nothing of aws-node's.
pub fn assert_other_backend_clean(backend: IptablesBackend, when: &str) {
    let other = other_backend(backend);
    let rules = iptables_rules(other);
    let aws = aws_node_parts(&rules);
    assert!(
        aws.is_empty(),
        "aws-node's rules in {other} {when}: {aws:#?}"
    );
}

/// The parts of the node's wiring that are aws-node's.
pub fn aws_node_parts(wiring: &BTreeSet<String>) -> Vec<&String> {
    wiring
        .iter()
        .filter(|line| {
            line.contains("AWS")
                || line.starts_with("10:")
                || line.starts_with("512:")
                || line.starts_with("1024:")
                || line.starts_with("1536:")
        })
        .collect()
}

/// The SNAT flows of the pinned datapath: pod port to translated port.
#[must_use]
pub fn datapath_snat_ports() -> Vec<(u16, u16)> {
    DatapathMaps::open_pinned(Path::new(PIN_DIR))
        .and_then(|maps| maps.flows())
        .expect("reading the NAT table")
        .into_iter()
        .filter(|flow| flow.kind() == Some(FlowKind::Snat))
        .map(|flow| (raw_to_port(flow.key.sport), raw_to_port(flow.fwd.port)))
        .collect()
}
