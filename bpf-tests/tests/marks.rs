//! vpcnet's skb mark bits and the node's other rules. Calico's default
//! mask (`0xffff0000`) covers vpcnet's default bits: `vpcnet-agent
//! settings` (and `run`) refuses them on a node whose iptables rules use
//! them, naming whose rule, and takes the bits an operator moves them to.
//! And whatever marks a pod's packet on its way through the node's stack
//! (a rule written after the agent started, which it could not see), the
//! packet never leaves for the internet un-NATed: a pod's connection
//! through a service whose backend is on the internet, its packets marked
//! with vpcnet's default "decided" bit by a Calico-like rule, still leaves
//! as the node, as it does through the iptables reference.
//!
//! Run: `cargo build --workspace --bins && cargo test -p vpcnet-bpf-tests
//! --test marks -- --test-threads=1 --nocapture`.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    process::Command,
    time::Duration,
};

use vpcnet_bpf_tests::{agent_binary, differential, lab_counter};
use vpcnet_common::{config::MARK_DECIDED, counters::Counter};
use vpcnet_lab::{
    ClusterIpService, Datapath, Lab, LabOptions, ServiceBackend, WhoamiServer, addrs, exec_ok,
    netns::netns_path, serial, tcp_whoami,
};

const PORT: u16 = 8080;
/// A service whose backend is the internet host.
const TO_INET: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 100, 0, 12), 80);
/// The bits an operator moves vpcnet's to, clear of kube-proxy's and
/// aws-node's.
const MOVED: [(&str, &str); 2] = [
    ("VPCNET_MARK_DECIDED", "0x1000"),
    ("VPCNET_MARK_VIA_SERVICE", "0x2000"),
];

/// `vpcnet-agent settings` in the node's namespace with `env`: whether it
/// succeeded, and its standard error.
fn settings_in_node(env: &[(&str, &str)]) -> (bool, String) {
    let output = Command::new("nsenter")
        .arg(format!("--net={}", netns_path(addrs::NS_NODE).display()))
        .arg("--")
        .arg(agent_binary())
        .arg("settings")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .envs(env.iter().copied())
        .output()
        .expect("running vpcnet-agent settings");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A pod's connection through a service whose backend is the internet
/// host, in a lab of `datapath`: what the host saw it as before and after
/// a Calico-like rule marks every pod packet the node's stack sees with
/// vpcnet's default "decided" bit, and, with vpcnet, how many packets its
/// programs decided again. `with_rule` runs in the lab, the rule in place.
fn through_a_marked_service(
    datapath: LabOptions,
    with_rule: impl FnOnce(),
) -> (Option<Ipv4Addr>, Option<Ipv4Addr>, Option<u64>) {
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let options = LabOptions {
        cluster_ips: vec![ClusterIpService {
            name: "to-inet".into(),
            addr: TO_INET,
            backend: ServiceBackend::Remote(SocketAddrV4::new(addrs::INET_ADDR, PORT)),
        }],
        ..datapath
    };
    let ebpf = options.datapath == Datapath::Ebpf;
    let lab = Lab::up(&options).unwrap_or_else(|e| panic!("bringing the lab up: {e}"));
    let inet = WhoamiServer::start(addrs::NS_INET, SocketAddrV4::new(addrs::INET_ADDR, PORT))
        .expect("whoami in inet");
    let pod = lab.pod(0).clone();
    let through_service = || {
        tcp_whoami(&pod.netns, TO_INET, Duration::from_secs(3))
            .expect("entering the pod")
            .map(|seen| *seen.ip())
    };
    let unmarked = through_service();
    let decided = format!("{MARK_DECIDED:#x}/{MARK_DECIDED:#x}");
    exec_ok(
        addrs::NS_NODE,
        &[
            "iptables",
            "-t",
            "mangle",
            "-A",
            "PREROUTING",
            "-s",
            "10.20.0.0/16",
            "-m",
            "comment",
            "--comment",
            "cali:policy-mark",
            "-j",
            "MARK",
            "--set-xmark",
            &decided,
        ],
    )
    .expect("a Calico-like mark rule");
    let before = ebpf.then(|| lab_counter(Counter::EgressDecidedRechecked));
    let marked = through_service();
    let rechecked = before.map(|before| lab_counter(Counter::EgressDecidedRechecked) - before);
    with_rule();
    drop(inet);
    lab.down().expect("taking the lab down");
    (unmarked, marked, rechecked)
}

#[test]
fn a_foreign_mark_is_refused_at_start_and_never_lets_a_pod_leave_un_natted() {
    let _lab_slot = serial();
    let reference =
        differential::reference_half(|| through_a_marked_service(LabOptions::iptables(1), || {}));
    let (unmarked, marked, rechecked) =
        through_a_marked_service(LabOptions::ebpf(1, agent_binary()), || {
            let (started, said) = settings_in_node(&[]);
            println!("vpcnet-agent settings with that rule: {said}");
            assert!(!started, "the default bits are refused");
            assert!(
                said.contains("VPCNET_MARK_DECIDED=0x200000 is a bit Calico's rule uses"),
                "{said}"
            );
            let (started, said) = settings_in_node(&MOVED);
            assert!(started, "moved bits are taken: {said}");
        });
    println!(
        "through a service to the internet, seen as (unmarked, marked {MARK_DECIDED:#x} by another rule):"
    );
    if let Some((unmarked, marked, _)) = reference {
        println!("iptables: {unmarked:?}, {marked:?}");
        assert_eq!(
            (unmarked, marked),
            (
                Some(addrs::NODE_PRIMARY_ADDR),
                Some(addrs::NODE_PRIMARY_ADDR)
            ),
            "the iptables reference SNATs, marked or not"
        );
    }
    let rechecked = rechecked.expect("vpcnet's lab counts the packets it decided again");
    println!("vpcnet:   {unmarked:?}, {marked:?}; {rechecked} packets decided again");
    assert_eq!(unmarked, Some(addrs::NODE_PRIMARY_ADDR), "SNATed");
    assert_eq!(marked, Some(addrs::NODE_PRIMARY_ADDR), "still SNATed");
    assert!(rechecked > 0, "the foreign mark was seen and set aside");
}
