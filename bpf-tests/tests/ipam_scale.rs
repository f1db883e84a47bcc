//! The address manager against the lab's EC2 emulator: an empty node
//! scales to max pods and back on real instance-type limits, with and
//! without EC2 failing 30 % of the calls, and leaks nothing.
//!
//! Run: `cargo build -p vpcnet-agent && cargo test -p vpcnet-bpf-tests --test
//! ipam_scale -- --test-threads=1 --nocapture`.

use std::{
    collections::BTreeSet,
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use vpcnet_bpf_tests::ipam::{IpamLab, holdings};
use vpcnet_lab::ec2::config::{FaultRule, LAB_CUSTOM_SUBNET_ID};

/// Released addresses rest one second, so the scale-down is quick.
const ENV: &[(&str, &str)] = &[("IP_COOLDOWN_PERIOD", "1")];

/// Custom networking: pods in the VPC's secondary CIDR (the node subnet, a
/// /24, could not hold a c5.18xlarge's 735 pods), the primary ENI serving
/// none.
const CUSTOM_NETWORKING: &[(&str, &str)] = &[
    ("IP_COOLDOWN_PERIOD", "1"),
    ("AWS_VPC_K8S_CNI_CUSTOM_NETWORK_CFG", "true"),
    ("VPCNET_ENI_CONFIG_SUBNET", LAB_CUSTOM_SUBNET_ID),
];

fn lab_lock() -> vpcnet_lab::LabLock {
    assert!(
        nix::unistd::geteuid().is_root(),
        "the address-manager tests need root (network namespaces, eBPF)"
    );
    let lock = vpcnet_lab::serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    lock
}

/// Scales an empty `instance_type` node to max pods and back to the warm
/// pool; checks every address is handed out once and EC2 ends holding
/// exactly what the agent holds.
fn scale(instance_type: &str, max_enis: usize, ips_per_eni: usize, faults: bool, custom: bool) {
    let _lock = lab_lock();
    let mut lab = IpamLab::up(instance_type, if custom { CUSTOM_NETWORKING } else { ENV });
    let instance = lab.emulator().instance_id().to_owned();
    if faults {
        lab.emulator()
            .admin()
            .set_faults(&[FaultRule {
                action: "*".into(),
                throttle: 0.1,
                unavailable: 0.1,
                internal: 0.1,
            }])
            .expect("injecting faults");
    }
    let pod_enis = if custom { max_enis - 1 } else { max_enis };
    let capacity = pod_enis * (ips_per_eni - 1);

    let (addrs, to_max_pods) = lab.fill(0, capacity + 10);
    let unique: BTreeSet<Ipv4Addr> = addrs.iter().copied().collect();
    assert_eq!(
        addrs.len(),
        capacity,
        "{instance_type}: pods that got an address (every secondary slot of every ENI)"
    );
    assert_eq!(unique.len(), addrs.len(), "an address was handed out twice");
    let status = lab.status();
    assert_eq!(status.assigned_addrs as usize, capacity);
    assert_eq!(status.enis as usize, max_enis);
    let ec2 = holdings(&lab.ec2_state(), &instance);
    assert_eq!(ec2.attached_enis, max_enis, "ENIs EC2 has attached");
    assert_eq!(
        ec2.pod_addrs, unique,
        "EC2's secondary addresses are the pods'"
    );
    assert!(
        ec2.detached_enis.is_empty(),
        "leaked ENIs: {:?}",
        ec2.detached_enis
    );

    let started = Instant::now();
    for id in 0..capacity {
        assert!(
            lab.del(id).expect("DEL").is_some(),
            "pod {id} held an address"
        );
    }
    assert_eq!(
        lab.del(0).expect("DEL twice"),
        None,
        "a second DEL is a no-op"
    );
    // WARM_ENI_TARGET=1: back to one ENI's worth of free addresses (with
    // custom networking on a second ENI: the primary serves no pod).
    let warm = ips_per_eni - 1;
    let enis_left: usize = if custom { 2 } else { 1 };
    let settled = lab.wait_status(
        "scaling back to the warm pool",
        Duration::from_mins(2),
        |s| s.enis as usize == enis_left && s.total_addrs as usize == warm && s.assigned_addrs == 0,
    );
    // Freed ENIs are detached and deleted after they leave the pool.
    let ec2 = lab.wait_ec2(
        "freed ENIs detached and deleted",
        Duration::from_mins(1),
        |state| {
            let ec2 = holdings(state, &instance);
            ec2.attached_enis == enis_left && ec2.detached_enis.is_empty()
        },
    );
    let to_warm_pool = started.elapsed();
    let ec2 = holdings(&ec2, &instance);
    assert_eq!(ec2.attached_enis, enis_left, "ENIs still attached");
    assert_eq!(
        ec2.pod_addrs.len(),
        warm,
        "EC2 holds the warm pool, nothing more"
    );
    assert!(
        ec2.detached_enis.is_empty(),
        "leaked ENIs: {:?}",
        ec2.detached_enis
    );

    let calls = lab.emulator().admin().calls().expect("calls");
    let injected: u64 = calls
        .actions
        .values()
        .map(|c| c.throttled + c.unavailable + c.internal)
        .sum();
    let total_calls: u64 = calls.actions.values().map(|c| c.calls).sum();
    if faults {
        assert!(injected > 0, "faults were injected");
    }
    println!(
        "{instance_type:<12} {:<6} faults {:<3} max pods {capacity:>4} ({max_enis} ENIs): empty -> max {:>6.2} s, back to warm pool {:>6.2} s; EC2 calls {total_calls}, injected faults {injected}, leaked ENIs 0, leaked addresses 0, double assignments 0; counters {:?}",
        if custom { "custom" } else { "node" },
        if faults { "30%" } else { "no" },
        to_max_pods.as_secs_f64(),
        to_warm_pool.as_secs_f64(),
        settled.counters,
    );
    lab.lab.down().expect("taking the lab down");
}

#[test]
fn m5_large_scales_to_max_pods_and_back() {
    scale("m5.large", 3, 10, false, false);
}

#[test]
fn t3_medium_scales_to_max_pods_and_back() {
    scale("t3.medium", 3, 6, false, false);
}

#[test]
fn c5_18xlarge_with_custom_networking_scales_to_max_pods_and_back() {
    scale("c5.18xlarge", 15, 50, false, true);
}

#[test]
fn throttling_and_server_errors_on_every_call_leak_nothing() {
    scale("m5.large", 3, 10, true, false);
}
