//! A rolling update under traffic: a node runs an earlier
//! release (its pins carry no layout version), long TCP connections run
//! through SNAT, to the VPC and pod to pod, and the agent and the plugin
//! are replaced with this build: no connection notices and each SNATed
//! one keeps its port. Then back to the release (a downgrade), with what
//! survives printed, and up again under connections opened meanwhile,
//! past the pins the downgrade left.
//!
//! The release is `vpcnet_lab::releases::FIRST_ON_6_1` on every kernel (TCX
//! links where the kernel has them, clsact filters on 6.1); `cargo xtask
//! setup` builds it.
//!
//! Run: `cargo build --workspace --bins && cargo test -p vpcnet-bpf-tests
//! --test upgrade -- --test-threads=1 --nocapture`.

use std::{collections::BTreeSet, net::Ipv4Addr, path::Path, time::Duration};

use vpcnet_agent::datapath::{pins, read_pinned_flows};
use vpcnet_bpf_tests::{
    agent_binary, cni_plugin_binary,
    cri::{self, CriNode, node_traces, remove_all_pods},
    echo::{EchoStream, FarEnds},
};
use vpcnet_common::{
    addr_to_raw,
    maps::{self as names, PIN_DIR},
    raw_to_port,
};
use vpcnet_lab::{Lab, addrs, releases::FIRST_ON_6_1, serial};

const PORT: u16 = 8080;
/// Echoes each connection completes in each phase.
const ECHOES: u64 = 100;
/// How long a connection may take to show it survived the downgrade.
const DOWNGRADE_PATIENCE: Duration = Duration::from_secs(10);

/// The SNAT ports of `pod`'s flows in the NAT map pinned at `pin` (of
/// whichever layout: the release's entries are narrower).
fn snat_ports(pin: &Path, pod: Ipv4Addr) -> BTreeSet<u16> {
    read_pinned_flows(pin)
        .unwrap_or_else(|e| panic!("reading {}: {e}", pin.display()))
        .into_iter()
        .filter(|(key, _)| key.saddr == addr_to_raw(pod.octets()))
        .map(|(_, entry)| raw_to_port(entry.port))
        .collect()
}

/// The eBPF objects whose loaded programs are pinned (a later start of
/// the same object keeps them).
fn pinned_program_objects() -> usize {
    let dir = Path::new(PIN_DIR)
        .join(names::LINKS_DIR)
        .join(names::PROGRAMS_DIR);
    std::fs::read_dir(dir).map_or(0, Iterator::count)
}

fn pin_names() -> BTreeSet<String> {
    std::fs::read_dir(PIN_DIR)
        .unwrap()
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("VPCNET_"))
        .collect()
}

fn versioned_nat_pin() -> std::path::PathBuf {
    let nat = names::ALL
        .into_iter()
        .find(|map| map.name == names::NAT_FWD)
        .unwrap();
    pins::pin_path(Path::new(PIN_DIR), &nat)
}

#[allow(clippy::too_many_lines, reason = "one story, told in order")]
#[test]
fn an_upgrade_from_the_release_nodes_run_breaks_no_flow_and_keeps_each_snat_port() {
    let release = FIRST_ON_6_1;
    assert!(
        release.agent().is_file() && release.cni_plugin().is_file(),
        "release {} is not built at {}: `cargo xtask setup` builds it",
        release.short(),
        release.dir().display()
    );
    let _lock = serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let mut lab: Lab = cri::up_with(&CriNode {
        agent: release.agent(),
        cni_plugin: release.cni_plugin(),
        ..CriNode::new(3, "m5.large")
    });
    let pods = lab.pods().to_vec();
    let FarEnds {
        inet,
        peer,
        pod: pod_server,
    } = FarEnds::start(&pods[2], PORT);
    let snat = EchoStream::open(&pods[0].netns, inet.addr());
    let vpc = EchoStream::open(&pods[1].netns, peer.addr());
    let pod_to_pod = EchoStream::open(&pods[0].netns, pod_server.addr());
    assert_eq!(*snat.seen_as.ip(), addrs::NODE_PRIMARY_ADDR, "SNATed");
    assert_eq!(*vpc.seen_as.ip(), pods[1].addr, "to the VPC, unNATed");
    assert_eq!(
        *pod_to_pod.seen_as.ip(),
        pods[0].addr,
        "pod to pod, unNATed"
    );
    let flows = [
        ("SNAT", &snat),
        ("to the VPC", &vpc),
        ("pod to pod", &pod_to_pod),
    ];
    for (name, flow) in flows {
        flow.wait_for_more_echoes(ECHOES, &format!("{name}, on release {}", release.short()));
    }
    let release_nat = Path::new(PIN_DIR).join(names::NAT_FWD);
    assert_eq!(
        snat_ports(&release_nat, pods[0].addr),
        BTreeSet::from([snat.seen_as.port()]),
        "the release's NAT map, pinned by bare name, holds the SNATed flow"
    );

    // Upgrade.
    lab.replace_agent(&agent_binary(), &cni_plugin_binary())
        .expect("upgrading the agent");
    for (name, flow) in flows {
        flow.wait_for_more_echoes(ECHOES, &format!("{name}, after the upgrade"));
    }
    assert_eq!(
        snat_ports(&versioned_nat_pin(), pods[0].addr),
        BTreeSet::from([snat.seen_as.port()]),
        "the SNATed flow kept its port in the new NAT map"
    );
    let expected: BTreeSet<String> = names::ALL
        .iter()
        .map(|map| format!("{}_v{}", map.name, map.layout))
        .collect();
    assert_eq!(
        pin_names(),
        expected,
        "the release's pins were carried and removed"
    );
    assert_eq!(
        pinned_program_objects(),
        1,
        "the new agent's programs are pinned for its next start"
    );
    let fresh = EchoStream::open(&pods[1].netns, inet.addr());
    fresh.wait_for_more_echoes(ECHOES, "a new SNAT connection after the upgrade");
    println!(
        "upgrade from {} ({}): SNAT (port {} kept), to the VPC and pod to pod: {ECHOES} echoes each \
         after it, 0 broken",
        release.short(),
        release.why,
        snat.seen_as.port()
    );

    // Downgrade: the release cannot read the new pins (it never looks for
    // them); whatever it does with the connections, which is printed, it
    // leaves the pins alone and serves new connections.
    lab.replace_agent(&release.agent(), &release.cni_plugin())
        .expect("downgrading the agent");
    for (name, flow) in flows
        .into_iter()
        .chain([("SNAT opened after the upgrade", &fresh)])
    {
        let outcome = flow.more_echoes(ECHOES, DOWNGRADE_PATIENCE);
        println!(
            "downgrade to {}: {name}: {}",
            release.short(),
            outcome
                .as_ref()
                .map_or_else(String::clone, |()| "kept".into())
        );
    }
    assert!(
        expected.is_subset(&pin_names()),
        "the downgraded agent left the new pins alone: {:?}",
        pin_names()
    );
    assert_eq!(
        pinned_program_objects(),
        0,
        "the release, which pins no programs, removed the newer agent's rather than leave them \
         loaded for nothing"
    );
    let again = [
        ("SNAT", EchoStream::open(&pods[1].netns, inet.addr())),
        ("to the VPC", EchoStream::open(&pods[1].netns, peer.addr())),
        (
            "pod to pod",
            EchoStream::open(&pods[1].netns, pod_server.addr()),
        ),
    ];
    for (name, flow) in &again {
        flow.wait_for_more_echoes(ECHOES, &format!("{name}, opened after the downgrade"));
    }

    // Up again, from what the downgraded agent pinned: those connections
    // keep working; the pins the downgrade left behind, which nothing used
    // since, are replaced.
    lab.replace_agent(&agent_binary(), &cni_plugin_binary())
        .expect("upgrading the agent again");
    for (name, flow) in &again {
        flow.wait_for_more_echoes(ECHOES, &format!("{name}, after upgrading again"));
    }
    let snat_again = again[0].1.seen_as.port();
    assert!(
        snat_ports(&versioned_nat_pin(), pods[1].addr).contains(&snat_again),
        "the SNATed flow of the downgraded agent kept its port"
    );
    assert_eq!(pin_names(), expected);
    assert_eq!(pinned_program_objects(), 1);
    println!(
        "upgrade again: SNAT (port {snat_again} kept), to the VPC and pod to pod, opened after the \
         downgrade: {ECHOES} echoes each, 0 broken; the pins the downgrade left were replaced"
    );

    for (_, flow) in again {
        flow.close();
    }
    drop((snat, vpc, pod_to_pod, fresh));
    drop((inet, peer, pod_server));
    let client = lab.cri().expect("a CRI client");
    remove_all_pods(&client);
    let traces = node_traces();
    assert!(traces.is_empty(), "left behind: {traces:?}");
    lab.down().expect("taking the lab down");
}
