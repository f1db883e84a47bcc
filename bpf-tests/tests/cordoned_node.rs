//! `AWS_MANAGE_ENIS_NON_SCHEDULABLE`, as aws-node reads it: the agent
//! in-cluster follows its Node; while the Node carries the
//! `node.kubernetes.io/unschedulable:NoSchedule` taint (put there with
//! kubectl, as the node lifecycle controller puts it on a cordoned node),
//! pods get the warm pool's addresses but the pool does not grow (no
//! `AssignPrivateIpAddresses`, no ENI); once the taint goes it grows again
//! without a restart. With the variable true it grows while cordoned.

use std::time::{Duration, Instant};

use vpcnet_bpf_tests::ipam::{IpamLab, agent_log_tail, lab_lock};
use vpcnet_lab::cluster::{kubectl, node_name};

/// How long the agent may take to follow a change of its Node.
const FOLLOW_TIMEOUT: Duration = Duration::from_secs(30);
const TAINT: &str = "node.kubernetes.io/unschedulable:NoSchedule";
/// The manager's count of passes that held growth back on a cordoned node.
const HELD: &str = "vpcnet_ipam_cordon_held_total";

fn taint(lab: &IpamLab, on: bool) {
    let files = lab.lab.kube_api().expect("in-cluster").files();
    let taint = if on {
        TAINT.to_owned()
    } else {
        format!("{TAINT}-")
    };
    kubectl(files, &["taint", "nodes", &node_name(), &taint], None).expect("kubectl taint");
}

/// The agent's log.
fn agent_log() -> String {
    std::fs::read_to_string(vpcnet_lab::agent_log_file()).unwrap_or_default()
}

/// EC2 calls of `action` so far.
fn calls(lab: &IpamLab, action: &str) -> u64 {
    lab.emulator()
        .admin()
        .calls()
        .expect("the emulator's calls")
        .action(action)
        .calls
}

/// Waits (bounded) until the agent's pool has recorded the event `reason`
/// `n` times.
fn wait_event(lab: &mut IpamLab, reason: &str, n: usize) {
    let deadline = Instant::now() + FOLLOW_TIMEOUT;
    loop {
        let status = lab.status();
        if status.events.iter().filter(|e| e.reason == reason).count() >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no {reason} event #{n}: {:?}\n{}",
            status.events,
            agent_log_tail()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_cordoned_node_does_not_grow_its_pool_until_the_taint_goes() {
    let _lock = lab_lock();
    let mut lab = IpamLab::up_in_cluster("m5.large", &[("WARM_IP_TARGET", "2")]);
    lab.wait_status("the warm pool", FOLLOW_TIMEOUT, |s| s.total_addrs == 2);

    taint(&lab, true);
    wait_event(&mut lab, "NodeCordoned", 1);
    let assigns = calls(&lab, "AssignPrivateIpAddresses");
    let created = calls(&lab, "CreateNetworkInterface");
    // The warm pool's two addresses go to pods.
    for id in 0..2 {
        lab.add(id).expect("an address from the warm pool");
    }
    // The pool is now below WARM_IP_TARGET: the manager sees it and holds.
    let held = lab.wait_status("growth held back", FOLLOW_TIMEOUT, |s| {
        s.counters.get(HELD).copied().unwrap_or(0) >= 3
    });
    assert_eq!((held.total_addrs, held.assigned_addrs), (2, 2), "{held:?}");
    assert_eq!(calls(&lab, "AssignPrivateIpAddresses"), assigns);
    assert_eq!(calls(&lab, "CreateNetworkInterface"), created);

    // The taint goes: the pool grows again, with no restart.
    taint(&lab, false);
    let grown = lab.wait_status("the pool grown again", FOLLOW_TIMEOUT, |s| {
        s.total_addrs == 4
    });
    assert!(calls(&lab, "AssignPrivateIpAddresses") > assigns);
    // Each transition logged once.
    let log = agent_log();
    let said = |text: &str| log.lines().filter(|l| l.contains(text)).count();
    assert_eq!(said("the node is cordoned"), 1, "{log}");
    assert_eq!(said("the node is schedulable again"), 1, "{log}");
    println!(
        "cordoned: 2 pods took the warm pool, {} passes held growth, no EC2 call; uncordoned: {} addresses",
        held.counters[HELD], grown.total_addrs
    );
    drop(lab);
}

#[test]
fn with_aws_manage_enis_non_schedulable_a_cordoned_node_grows_its_pool() {
    let _lock = lab_lock();
    let mut lab = IpamLab::up_in_cluster(
        "m5.large",
        &[
            ("WARM_IP_TARGET", "2"),
            ("AWS_MANAGE_ENIS_NON_SCHEDULABLE", "true"),
        ],
    );
    lab.wait_status("the warm pool", FOLLOW_TIMEOUT, |s| s.total_addrs == 2);
    taint(&lab, true);
    wait_event(&mut lab, "NodeCordoned", 1);
    for id in 0..2 {
        lab.add(id).expect("an address from the warm pool");
    }
    let grown = lab.wait_status("the pool grown while cordoned", FOLLOW_TIMEOUT, |s| {
        s.total_addrs == 4
    });
    assert_eq!(grown.counters.get(HELD).copied().unwrap_or(0), 0);
    let log = agent_log();
    assert!(
        log.contains("AWS_MANAGE_ENIS_NON_SCHEDULABLE is true"),
        "{log}"
    );
    drop(lab);
}
