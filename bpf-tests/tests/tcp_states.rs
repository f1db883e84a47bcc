//! TCP connections live through their states as long as netfilter's would
//! on the same node, whose sysctls set both.
//!
//! A connection the pod half-closes (`vpcnet_bpf_tests::half_closed`) is
//! answered after `nf_conntrack_tcp_timeout_fin_wait`: netfilter has it in
//! `CLOSE_WAIT` by then, whose timeout kube-proxy raises to an hour, so the
//! answer reaches the pod through the iptables reference, and must through
//! vpcnet's SNAT too. The node's FIN_WAIT timeout is lowered to a few
//! seconds (both datapaths read it from the node's sysctls) so the wait is
//! short.
//!
//! Run: `cargo build --workspace --bins && cargo test -p vpcnet-bpf-tests
//! --test tcp_states -- --test-threads=1 --nocapture`.

use std::{net::SocketAddrV4, thread, time::Duration};

use vpcnet_bpf_tests::{
    agent_binary,
    half_closed::{HalfClosed, await_node_state},
};
use vpcnet_lab::{Lab, LabOptions, addrs, exec_ok, serial};

const PORT: u16 = 8080;
/// The node's `nf_conntrack_tcp_timeout_fin_wait` for the test.
const FIN_WAIT_SECS: u64 = 2;
/// The agent's collector runs this often, re-reading the timeouts.
const GC_INTERVAL_SECS: u64 = 1;
/// How long the server waits after the pod's FIN before it answers: the
/// FIN_WAIT timeout and two collections past it, all well inside
/// `CLOSE_WAIT`'s hour. Waiting is what the test is about: nothing happens
/// meanwhile that could be awaited instead.
const ANSWER_AFTER: Duration = Duration::from_secs(FIN_WAIT_SECS + 3 * GC_INTERVAL_SECS);

#[test]
fn a_half_closed_connection_gets_its_late_answer_through_the_iptables_reference() {
    late_answer_reaches_the_pod(&LabOptions::iptables(1));
}

#[test]
fn a_half_closed_connection_gets_its_late_answer_through_vpcnet() {
    late_answer_reaches_the_pod(&LabOptions {
        agent_env: vec![(
            "VPCNET_GC_INTERVAL".to_owned(),
            GC_INTERVAL_SECS.to_string(),
        )],
        ..LabOptions::ebpf(1, agent_binary())
    });
}

/// The pod half-closes its connection to the internet; the node's table
/// has it in `CLOSE_WAIT`; [`ANSWER_AFTER`] later the server answers, and
/// the pod must read the whole answer.
fn late_answer_reaches_the_pod(opts: &LabOptions) {
    let _lock = serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let lab = Lab::up(opts).expect("lab up");
    exec_ok(
        addrs::NS_NODE,
        &[
            "sysctl",
            "-w",
            &format!("net.netfilter.nf_conntrack_tcp_timeout_fin_wait={FIN_WAIT_SECS}"),
        ],
    )
    .expect("the node's FIN_WAIT timeout");
    let close_wait = exec_ok(
        addrs::NS_NODE,
        &[
            "sysctl",
            "-n",
            "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
        ],
    )
    .expect("the node's CLOSE_WAIT timeout");
    assert_eq!(close_wait.trim(), "3600", "kube-proxy's CLOSE_WAIT timeout");

    let pod = lab.pods()[0].clone();
    let connection = HalfClosed::open(&pod.netns, SocketAddrV4::new(addrs::INET_ADDR, PORT));
    let line = await_node_state(opts.datapath, &connection.pod_end(), "CLOSE_WAIT");
    println!("{}: the node's table: {line}", opts.datapath);
    thread::sleep(ANSWER_AFTER);
    let answered = connection.answer();
    println!(
        "{}: answered {ANSWER_AFTER:?} after the pod's FIN (FIN_WAIT {FIN_WAIT_SECS} s, CLOSE_WAIT {} s): {answered:?}",
        opts.datapath,
        close_wait.trim(),
    );
    assert!(answered.whole(), "the late answer did not reach the pod");
    lab.down().expect("lab down");
}
