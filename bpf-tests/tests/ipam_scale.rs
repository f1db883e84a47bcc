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

use vpcnet_agent::cloud::{TAG_CREATED_AT, TAG_INSTANCE_ID};
use vpcnet_bpf_tests::ipam::{IpamLab, holdings, lab_lock};
use vpcnet_lab::{
    addrs::NS_NODE,
    ec2::{
        config::{FaultRule, LAB_CUSTOM_SUBNET_ID, LAB_NODE_SUBNET_ID},
        model::StateSnapshot,
    },
};

/// Released addresses rest one second, so the scale-down is quick.
const ENV: &[(&str, &str)] = &[("IP_COOLDOWN_PERIOD", "1")];

/// Custom networking: pods in the VPC's secondary CIDR (the node subnet, a
/// /24, could not hold a c5.18xlarge's 735 pods), the primary ENI serving
/// none.
const CUSTOM_NETWORKING: &[(&str, &str)] = &[
    ("IP_COOLDOWN_PERIOD", "1"),
    ("AWS_VPC_K8S_CNI_CUSTOM_NETWORK_CFG", "true"),
    ("VPCNET_ENI_CONFIG_SUBNET", LAB_CUSTOM_SUBNET_ID),
    ("VPCNET_ENI_CONFIG_SECURITY_GROUPS", PODS_SG),
];

/// The security group custom networking gives pods' ENIs.
const PODS_SG: &str = "sg-0a5e1ab0000000002";

/// The ENIs the agent attached, as an operator checks them: aws-node's
/// description and tags, the configured subnet, and in the node a link with
/// the ENI's MAC, up, MTU 9001, the ENI's address and no subnet route.
fn check_new_enis(state: &StateSnapshot, instance: &str, custom: bool) {
    let subnet = if custom {
        LAB_CUSTOM_SUBNET_ID
    } else {
        LAB_NODE_SUBNET_ID
    };
    let routes = vpcnet_lab::exec_ok(NS_NODE, &["ip", "-4", "route", "show", "table", "main"])
        .expect("the node's routes");
    for eni in &state.enis {
        let Some(attachment) = &eni.attachment else {
            continue;
        };
        if attachment.instance_id != instance || attachment.device_index == 0 {
            continue;
        }
        assert_eq!(eni.description, format!("aws-K8S-{instance}"), "{}", eni.id);
        assert_eq!(
            eni.tags.get(TAG_INSTANCE_ID).map(String::as_str),
            Some(instance)
        );
        assert!(
            eni.tags.contains_key(TAG_CREATED_AT),
            "{} has no createdAt",
            eni.id
        );
        assert_eq!(eni.subnet_id, subnet, "{} is in the wrong subnet", eni.id);
        if custom {
            assert_eq!(eni.groups, [PODS_SG], "{}'s security groups", eni.id);
        }
        let link = format!("eth{}", attachment.device_index);
        let json = vpcnet_lab::exec_ok(NS_NODE, &["ip", "-j", "addr", "show", "dev", &link])
            .expect("the ENI's link");
        let info: serde_json::Value = serde_json::from_str(&json).expect("ip -j");
        let info = &info[0];
        assert_eq!(info["address"], eni.mac.as_str(), "{link}'s MAC");
        assert_eq!(info["mtu"], 9001, "{link}'s MTU");
        assert!(
            info["flags"]
                .as_array()
                .is_some_and(|f| f.iter().any(|f| f == "UP")),
            "{link} is up"
        );
        let addrs: Vec<&str> = info["addr_info"]
            .as_array()
            .map(|a| a.iter().filter_map(|a| a["local"].as_str()).collect())
            .unwrap_or_default();
        assert_eq!(addrs, [eni.primary_ip.to_string()], "{link}'s addresses");
        assert!(
            !routes.lines().any(|r| r.contains(&format!("dev {link} "))),
            "no route by {link} in main: {routes}"
        );
    }
}

/// The node under test: its instance, limits and mode.
struct Node<'a> {
    instance_type: &'a str,
    instance: String,
    max_enis: usize,
    ips_per_eni: usize,
    custom: bool,
}

impl Node<'_> {
    /// Pod addresses at most: every secondary slot of every pod ENI.
    fn capacity(&self) -> usize {
        let pod_enis = if self.custom {
            self.max_enis - 1
        } else {
            self.max_enis
        };
        pod_enis * (self.ips_per_eni - 1)
    }
}

/// Fills the node with pods, checks every address is handed out once and
/// EC2 holds exactly the pods' addresses, releases them all and waits for
/// the pool to settle at `WARM_ENI_TARGET=1` with nothing leaked. Returns
/// the time to max pods, the time back to the warm pool, and the counters.
fn up_and_down(
    lab: &mut IpamLab,
    node: &Node<'_>,
    first_pod: usize,
) -> (Duration, Duration, std::collections::HashMap<String, u64>) {
    let (instance, capacity) = (node.instance.as_str(), node.capacity());
    let (addrs, to_max_pods) = lab.fill(first_pod, capacity + 10);
    let unique: BTreeSet<Ipv4Addr> = addrs.iter().copied().collect();
    assert_eq!(
        addrs.len(),
        capacity,
        "{}: pods that got an address (every secondary slot of every ENI)",
        node.instance_type
    );
    assert_eq!(unique.len(), addrs.len(), "an address was handed out twice");
    let status = lab.status();
    assert_eq!(status.assigned_addrs as usize, capacity);
    assert_eq!(status.enis as usize, node.max_enis);
    let state = lab.ec2_state();
    check_new_enis(&state, instance, node.custom);
    let ec2 = holdings(&state, instance);
    assert_eq!(ec2.attached_enis, node.max_enis, "ENIs EC2 has attached");
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
    for id in first_pod..first_pod + capacity {
        assert!(
            lab.del(id).expect("DEL").is_some(),
            "pod {id} held an address"
        );
    }
    assert_eq!(
        lab.del(first_pod).expect("DEL twice"),
        None,
        "a second DEL is a no-op"
    );
    // WARM_ENI_TARGET=1: back to one ENI's worth of free addresses (with
    // custom networking on a second ENI: the primary serves no pod).
    let warm = node.ips_per_eni - 1;
    let enis_left: usize = if node.custom { 2 } else { 1 };
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
            let ec2 = holdings(state, instance);
            ec2.attached_enis == enis_left && ec2.detached_enis.is_empty()
        },
    );
    let to_warm_pool = started.elapsed();
    let ec2 = holdings(&ec2, instance);
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
    (to_max_pods, to_warm_pool, settled.counters)
}

/// Scales an empty `instance_type` node to max pods and back to the warm
/// pool (three times, the agent restarted first, when EC2 fails 30 % of
/// the calls).
fn scale(instance_type: &str, max_enis: usize, ips_per_eni: usize, faults: bool, custom: bool) {
    let _lock = lab_lock();
    let mut lab = IpamLab::up(instance_type, if custom { CUSTOM_NETWORKING } else { ENV });
    let node = Node {
        instance_type,
        instance: lab.emulator().instance_id().to_owned(),
        max_enis,
        ips_per_eni,
        custom,
    };
    let rounds = if faults { 3 } else { 1 };
    if faults {
        lab.emulator()
            .admin()
            .set_faults(&[FaultRule {
                action: "*".into(),
                throttle: 0.1,
                unavailable: 0.1,
                internal: 0.1,
                ..FaultRule::default()
            }])
            .expect("injecting faults");
        // The start-up (IMDS, instance type, subnet, ENIs) under faults too.
        lab.lab.stop_agent().expect("stopping the agent");
        lab.lab
            .start_agent()
            .expect("starting the agent while EC2 fails");
        lab.connect();
    }
    for round in 0..rounds {
        let (to_max_pods, to_warm_pool, counters) = up_and_down(&mut lab, &node, round * 1000);
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
            "{instance_type:<12} {:<6} faults {:<3} round {} max pods {:>4} ({max_enis} ENIs): empty -> max {:>6.2} s, back to warm pool {:>6.2} s; EC2 calls {total_calls}, injected faults {injected}, ADDs told to try again {}, leaked ENIs 0, leaked addresses 0, double assignments 0; counters {counters:?}",
            if custom { "custom" } else { "node" },
            if faults { "30%" } else { "no" },
            round + 1,
            node.capacity(),
            to_max_pods.as_secs_f64(),
            to_warm_pool.as_secs_f64(),
            lab.tried_again,
        );
    }
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
