//! A node with the eBPF datapath on two ENIs carries three long-lived TCP
//! connections: SNAT (pod-0 to the internet), VPC steering (pod-1, whose
//! address is `eth1`'s, to the peer: the VPC's source/destination check
//! drops it unless it leaves by `eth1`) and pod to pod (pod-2 to pod-0).
//! The agent is killed (SIGKILL, a crash), then stopped (SIGTERM, as a
//! rolling update stops it) and started again each time. The programs stay
//! on every hook while no agent runs, the new agent, whose object is the
//! same, keeps each (the same program, not verified again: one program per
//! hook, never two), no connection breaks and the SNAT flow keeps its
//! port. Last, the datapath is removed as `vpcnet-agent uninstall` removes
//! it, and no program of vpcnet is left on any hook.
//!
//! It runs with the kernel's attach mode (TCX links from 6.6, clsact
//! filters before) and with clsact filters forced, so that both ways are
//! tested on every kernel.
//!
//! Run: `cargo build --workspace --bins && cargo test -p vpcnet-bpf-tests
//! --test node_restart -- --test-threads=1 --nocapture`; on 6.1:
//! `cargo xtask test --kernel 6.1 --test node_restart`.

use std::{
    collections::BTreeMap,
    io::Write as _,
    path::Path,
    time::{Duration, Instant},
};

use vpcnet_agent::datapath::{AttachMode, remove_pins, tc::ENV_TC_ATTACH};
use vpcnet_bpf_tests::{
    agent_binary,
    echo::NodeConnections,
    hooks::{HookProgram, hook_programs},
    pinned_nat_table,
};
use vpcnet_common::maps::{self as names, PIN_DIR};
use vpcnet_lab::{Lab, LabOptions, addrs, run_in, serial};

const PORT: u16 = 8080;
/// Echoes each connection must complete in each phase.
const ECHOES: u64 = 100;

/// vpcnet's programs on the node's hooks.
fn vpcnet_hooks() -> BTreeMap<(String, String), Vec<HookProgram>> {
    let ours = [
        names::PROG_ENI_EGRESS,
        names::PROG_ENI_INGRESS,
        names::PROG_POD_EGRESS,
        names::PROG_POD_INGRESS,
    ];
    hook_programs(addrs::NS_NODE)
        .into_iter()
        .filter_map(|(hook, programs)| {
            let programs: Vec<HookProgram> = programs
                .into_iter()
                .filter(|p| ours.contains(&p.name.as_str()))
                .collect();
            (!programs.is_empty()).then_some((hook, programs))
        })
        .collect()
}

/// Checks that every ENI and pod veth has exactly one vpcnet program on
/// each hook, attached as `attach`, the right one; returns the programs.
fn one_program_per_hook(
    lab: &Lab,
    attach: &str,
    phase: &str,
) -> BTreeMap<(String, String), HookProgram> {
    let hooks = vpcnet_hooks();
    let mut expected: BTreeMap<(String, String), &str> = BTreeMap::new();
    for eni in ["eth0", "eth1"] {
        expected.insert((eni.into(), "ingress".into()), names::PROG_ENI_INGRESS);
        expected.insert((eni.into(), "egress".into()), names::PROG_ENI_EGRESS);
    }
    for pod in lab.pods() {
        expected.insert(
            (pod.host_veth.clone(), "ingress".into()),
            names::PROG_POD_EGRESS,
        );
        expected.insert(
            (pod.host_veth.clone(), "egress".into()),
            names::PROG_POD_INGRESS,
        );
    }
    let found: BTreeMap<(String, String), &str> = hooks
        .iter()
        .map(|(hook, programs)| (hook.clone(), programs[0].name.as_str()))
        .collect();
    assert_eq!(
        found, expected,
        "{phase}: vpcnet's programs by hook: {hooks:#?}"
    );
    hooks
        .into_iter()
        .map(|(hook, mut programs)| {
            assert_eq!(programs.len(), 1, "{phase}: {hook:?} has {programs:?}");
            let program = programs.remove(0);
            assert_eq!(
                program.attach, attach,
                "{phase}: {hook:?} attached as {program:?}"
            );
            (hook, program)
        })
        .collect()
}

fn restarts_keep_every_flow(forced: Option<AttachMode>) {
    let _lock = serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let mode = forced.unwrap_or_else(AttachMode::of_kernel);
    let attach = match mode {
        AttachMode::Tcx => "tcx",
        AttachMode::Clsact => "clsact",
    };
    let mut opts = LabOptions {
        enis: 2,
        ..LabOptions::ebpf(3, agent_binary())
    };
    if forced.is_some() {
        opts.agent_env
            .push((ENV_TC_ATTACH.to_owned(), attach.to_owned()));
    }
    let mut lab = Lab::up(&opts).expect("the lab");
    let pods = lab.pods().to_vec();
    assert_eq!(pods[1].eni, "eth1", "pod-1's address is eth1's");

    let connections = NodeConnections::open(&pods, PORT);
    assert_eq!(
        *connections.snat.seen_as.ip(),
        addrs::NODE_PRIMARY_ADDR,
        "SNATed"
    );
    assert_eq!(
        *connections.vpc.seen_as.ip(),
        pods[1].addr,
        "to the VPC, un-NATed, by eth1"
    );
    assert_eq!(
        *connections.pod_to_pod.seen_as.ip(),
        pods[2].addr,
        "pod to pod, un-NATed"
    );
    connections.wait_for_more_echoes(ECHOES, "before the restarts");
    let nat_before = pinned_nat_table();
    assert!(!nat_before.is_empty(), "the SNAT flow is in the NAT table");
    let programs = one_program_per_hook(&lab, attach, "at start");

    for (how, crash) in [("SIGKILL", true), ("SIGTERM", false)] {
        if crash {
            lab.kill_agent().expect("killing the agent");
        } else {
            lab.stop_agent().expect("stopping the agent");
        }
        connections.wait_for_more_echoes(ECHOES, &format!("with the agent down ({how})"));
        let down = one_program_per_hook(&lab, attach, &format!("agent down ({how})"));
        assert_eq!(
            down, programs,
            "the programs stay as they were with the agent down ({how})"
        );

        lab.start_agent().expect("restarting the agent");
        connections.wait_for_more_echoes(ECHOES, &format!("after the restart ({how})"));
        let after = one_program_per_hook(&lab, attach, &format!("after the restart ({how})"));
        assert_eq!(
            after, programs,
            "the restarted agent, whose object and maps are the same, keeps the programs \
             running on each hook, not verified again ({how})"
        );
        let nat_after = pinned_nat_table();
        let lost: Vec<_> = nat_before.difference(&nat_after).collect();
        assert!(
            lost.is_empty(),
            "NAT entries lost or changed across {how}: {lost:?}"
        );
    }

    let echoes = connections.close();
    lab.stop_agent().expect("stopping the agent");
    // In the node, as `uninstall` runs: filters are found by interface.
    run_in(addrs::NS_NODE, || remove_pins(Path::new(PIN_DIR)))
        .expect("entering the node")
        .expect("removing the datapath as uninstall does");
    // The kernel releases an unpinned link in deferred work (the pin's
    // inode after an RCU grace period, then the link), a moment after the
    // unpin returns.
    let deadline = Instant::now() + Duration::from_secs(5);
    let left = loop {
        let left = vpcnet_hooks();
        if left.is_empty() || Instant::now() > deadline {
            break left;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(left.is_empty(), "programs left after uninstall: {left:#?}");
    let _ = writeln!(
        std::io::stdout().lock(),
        "{attach}: SNAT, VPC and pod-to-pod connections through SIGKILL and SIGTERM restarts: \
         {echoes:?} echoes, 0 broken, {} NAT entries kept, the same program on each hook throughout",
        nat_before.len()
    );
    lab.down().expect("lab down");
}

#[test]
fn restarts_keep_every_flow_with_the_kernels_attach_mode() {
    restarts_keep_every_flow(None);
}

#[test]
fn restarts_keep_every_flow_with_clsact_filters() {
    restarts_keep_every_flow(Some(AttachMode::Clsact));
}
