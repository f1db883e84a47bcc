//! The agent killed at every step of a start that migrates its maps (here
//! into NAT maps of another size, which a new layout's upgrade shares every
//! step with: the copy before the swap, the links swapped one by one, the
//! second pass, the old pins removed) and of its shutdown, then started
//! again: every flow from before still works, on every link.
//!
//! A node with two ENIs carries three long-lived TCP connections (SNAT,
//! VPC steering by `eth1`, pod to pod). Round N starts the agent with
//! `VPCNET_TEST_CRASH_AT=N` and the other NAT size: it kills itself
//! (SIGKILL) at its Nth step, in its start or, once N passes them all, at
//! SIGTERM. Then it starts again, as the kubelet restarts it, and each
//! connection must echo, each hook hold one vpcnet program, and the SNAT
//! flow keep its port. Rounds go on until one passes every step.
//!
//! It runs with the kernel's attach mode and with clsact filters forced.

use vpcnet_agent::{
    crash_points::ENV_CRASH_AT,
    datapath::{AttachMode, tc::ENV_TC_ATTACH},
};
use vpcnet_bpf_tests::{
    agent_binary,
    crashes::{killed_itself, one_program_per_hook},
    echo::NodeConnections,
    pinned_nat_table,
};
use vpcnet_lab::{Lab, LabOptions, serial};

const PORT: u16 = 8081;
/// Echoes each connection must complete after each round.
const ECHOES: u64 = 50;
/// The two NAT sizes the rounds alternate between: each start migrates.
const NAT_SIZES: [u32; 2] = [65_536, 131_072];
/// More steps than a start and a shutdown have: the rounds are bounded.
const MAX_ROUNDS: u32 = 80;

fn killed_at_every_step_keeps_every_flow(forced: Option<AttachMode>) {
    let _lock = serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let mut opts = LabOptions {
        enis: 2,
        ..LabOptions::ebpf(3, agent_binary())
    };
    opts.agent_env
        .push(("VPCNET_NAT_ENTRIES".to_owned(), NAT_SIZES[0].to_string()));
    if let Some(AttachMode::Clsact) = forced {
        opts.agent_env
            .push((ENV_TC_ATTACH.to_owned(), "clsact".to_owned()));
    }
    let mut lab = Lab::up(&opts).expect("the lab");
    let pods = lab.pods().to_vec();
    let connections = NodeConnections::open(&pods, PORT);
    connections.wait_for_more_echoes(ECHOES, "at start");
    let nat_before = pinned_nat_table();
    assert!(!nat_before.is_empty(), "the SNAT flow is in the NAT table");

    let (mut in_start, mut in_shutdown) = (0, 0);
    let mut round = 1;
    loop {
        assert!(
            round <= MAX_ROUNDS,
            "more than {MAX_ROUNDS} steps: a step is passed again and again"
        );
        lab.stop_agent().expect("stopping the agent");
        let size = NAT_SIZES[usize::try_from(round).unwrap() % 2];
        lab.set_agent_env("VPCNET_NAT_ENTRIES", &size.to_string())
            .unwrap();
        lab.set_agent_env(ENV_CRASH_AT, &round.to_string()).unwrap();
        let started = lab.start_agent();
        if started.is_ok() {
            // Every step of the start passed: the next is the shutdown's.
            lab.stop_agent().expect("stopping the agent");
        }
        let killed = killed_itself();
        match (started.is_ok(), killed) {
            (false, true) => in_start += 1,
            (true, true) => in_shutdown += 1,
            (true, false) => break,
            (false, false) => panic!("round {round}: the agent failed to start: {started:?}"),
        }
        // Started again, as the kubelet does, with the round's NAT size
        // (step 0 is none).
        lab.set_agent_env(ENV_CRASH_AT, "0").unwrap();
        lab.start_agent()
            .unwrap_or_else(|e| panic!("round {round}: starting again: {e}"));
        connections.wait_for_more_echoes(ECHOES, &format!("after a kill at step {round}"));
        one_program_per_hook(&lab, &["eth0", "eth1"], round);
        let nat_after = pinned_nat_table();
        let lost: Vec<_> = nat_before.difference(&nat_after).collect();
        assert!(
            lost.is_empty(),
            "round {round}: NAT entries lost or changed: {lost:?}"
        );
        round += 1;
    }
    assert!(
        in_start > 0 && in_shutdown > 0,
        "kills in the start {in_start}, in the shutdown {in_shutdown}: the hook tests nothing"
    );
    let echoes = connections.close();
    println!(
        "killed at each of {in_start} steps of a migrating start and {in_shutdown} of the \
         shutdown, started again each time: {echoes:?} echoes, 0 broken, one program per hook, \
         {} NAT entries kept",
        nat_before.len()
    );
    lab.down().expect("lab down");
}

#[test]
fn killed_at_every_step_the_agent_keeps_every_flow_with_the_kernels_attach_mode() {
    killed_at_every_step_keeps_every_flow(None);
}

#[test]
fn killed_at_every_step_the_agent_keeps_every_flow_with_clsact_filters() {
    killed_at_every_step_keeps_every_flow(Some(AttachMode::Clsact));
}
