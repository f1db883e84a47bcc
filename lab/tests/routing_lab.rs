//! The VPC CNI's policy routing in the iptables reference: secondary ENIs
//! (per-ENI tables, rules 512/1536), the VPC router's source/destination
//! check proving the steering, NodePort-style inbound to a pod on `eth1`
//! with its reply leaving by the primary ENI (connmark 0x80, rule 1024), and
//! branch-ENI pods (security groups for pods) in strict and standard modes.
//!
//! Root needed, one lab at a time (`serial()`), every lab torn down by its
//! guard even when an assertion fails.

mod common;

use std::net::{Ipv4Addr, SocketAddrV4};

use common::{DROP_TIMEOUT, PORT, REPLY_TIMEOUT, assert_no_lab_left, at, lab_session};
use vpcnet_lab::{
    EnforcingMode, Lab, LabOptions, NodePortService, PodInfo, Proto, WhoamiServer, addrs, exec_ok,
    icmp_echo, tcp_whoami, udp_whoami,
};

/// The far ends, each with a whoami server.
struct FarEnds {
    peer: WhoamiServer,
    onprem: WhoamiServer,
    inet: WhoamiServer,
}

impl FarEnds {
    fn start() -> Self {
        Self {
            peer: WhoamiServer::start(addrs::NS_PEER, at(addrs::PEER_ADDR)).unwrap(),
            onprem: WhoamiServer::start(addrs::NS_ONPREM, at(addrs::ONPREM_ADDR)).unwrap(),
            inet: WhoamiServer::start(addrs::NS_INET, at(addrs::INET_ADDR)).unwrap(),
        }
    }
}

/// TCP, UDP and ICMP echo from `pod` to the server at `addr`: each reaches
/// it with source `expected` and its reply comes back.
fn assert_seen_as(pod: &PodInfo, server: &WhoamiServer, addr: Ipv4Addr, expected: Ipv4Addr) {
    let what = format!("{} ({} on {}) -> {addr}", pod.netns, pod.addr, pod.eni);
    let tcp = tcp_whoami(&pod.netns, at(addr), REPLY_TIMEOUT).unwrap();
    assert_eq!(tcp.map(|s| *s.ip()), Some(expected), "tcp {what}");
    let udp = udp_whoami(&pod.netns, at(addr), REPLY_TIMEOUT).unwrap();
    assert_eq!(udp.map(|s| *s.ip()), Some(expected), "udp {what}");
    server.clear();
    let replier = icmp_echo(&pod.netns, addr, REPLY_TIMEOUT).unwrap();
    assert_eq!(replier, Some(addr), "icmp reply {what}");
    let request = server
        .wait_for(REPLY_TIMEOUT, |o| o.proto == Proto::Icmp)
        .unwrap_or_else(|| panic!("icmp request {what} not seen"));
    assert_eq!(*request.source.ip(), expected, "icmp {what}");
}

/// An `ip rule` taken out of the node for the length of a check, put back
/// when dropped (also when the check panics).
struct RuleRemoved {
    spec: Vec<String>,
}

impl RuleRemoved {
    fn new(spec: &str) -> Self {
        let spec: Vec<String> = spec.split_whitespace().map(str::to_owned).collect();
        let mut argv = vec!["ip", "rule", "del"];
        argv.extend(spec.iter().map(String::as_str));
        exec_ok(addrs::NS_NODE, &argv).unwrap();
        Self { spec }
    }
}

impl Drop for RuleRemoved {
    fn drop(&mut self) {
        let mut argv = vec!["ip", "rule", "add"];
        argv.extend(self.spec.iter().map(String::as_str));
        if let Err(err) = exec_ok(addrs::NS_NODE, &argv) {
            eprintln!(
                "putting back `ip rule {}` failed: {err}",
                self.spec.join(" ")
            );
        }
    }
}

/// Every secondary ENI as the VPC CNI leaves it, and its pods' rules.
fn check_secondary_enis(lab: &Lab) {
    let rules = lab.ip_rules().unwrap();
    println!("ip rule show (node):\n  {}", rules.join("\n  "));
    for device in 1..lab.options().enis {
        let eth = addrs::eni_ifname(device);
        let link = exec_ok(addrs::NS_NODE, &["ip", "-o", "link", "show", &eth]).unwrap();
        assert!(
            link.contains(&addrs::eni_mac(device)) && link.contains("mtu 9001"),
            "{link}"
        );
        let addr = exec_ok(addrs::NS_NODE, &["ip", "-o", "-4", "addr", "show", &eth]).unwrap();
        assert!(
            addr.contains(&format!("inet {}/24", addrs::eni_primary_addr(device))),
            "{addr}"
        );
        // ipamd removes the subnet route the address brings into main.
        let main = exec_ok(addrs::NS_NODE, &["ip", "route", "show", "table", "main"]).unwrap();
        assert!(!main.contains(&format!("dev {eth}")), "{main}");
        let table = addrs::eni_route_table(device).to_string();
        let routes = exec_ok(
            addrs::NS_NODE,
            &["ip", "route", "show", "table", table.as_str()],
        )
        .unwrap();
        assert!(
            routes.contains(&format!("default via 10.20.11.1 dev {eth}"))
                && routes.contains(&format!("10.20.11.1 dev {eth} scope link")),
            "table {table}: {routes}"
        );
        assert!(
            rules.contains(&format!(
                "32765:\tfrom {} lookup {table}",
                addrs::eni_primary_addr(device)
            )),
            "{rules:#?}"
        );
    }
    for pod in lab.pods() {
        let device = pod.eni_device.expect("no branch pods here");
        assert_eq!(device, pod.index % lab.options().enis);
        let own = lab.pod_ip_rules(pod).unwrap();
        let mut expected = vec![format!("512:\tfrom all to {} lookup main", pod.addr)];
        if device > 0 {
            expected.push(format!(
                "1536:\tfrom {} lookup {}",
                pod.addr,
                addrs::eni_route_table(device)
            ));
        }
        println!("{} on {}: {} ip rule(s)", pod.netns, pod.eni, own.len());
        assert_eq!(own, expected, "{}", pod.netns);
        // The router delivers the address to the ENI that owns it.
        let delivery = exec_ok(
            addrs::NS_VPC,
            &["ip", "neigh", "show", &pod.addr.to_string()],
        )
        .unwrap();
        assert!(
            delivery.contains(&format!("dev {}", addrs::vpc_eni_link(device)))
                && delivery.contains(&addrs::eni_mac(device)),
            "{delivery}"
        );
    }
}

#[test]
fn secondary_enis_steering_and_node_port_replies() {
    let _lab_lock = lab_session();

    let opts = LabOptions {
        enis: 3,
        node_port: Some(NodePortService {
            pod: 1,
            target_port: PORT,
        }),
        ..LabOptions::iptables(6)
    };
    let lab = Lab::up(&opts).expect("lab up");
    check_secondary_enis(&lab);
    let far = FarEnds::start();

    // Pods on eth1 and eth2: their own address inside the VPC, SNAT to the
    // node's primary address outside it; nothing dropped on the way.
    for pod in [lab.pod(1), lab.pod(2), lab.pod(4), lab.pod(0)] {
        assert_seen_as(pod, &far.peer, addrs::PEER_ADDR, pod.addr);
        assert_seen_as(
            pod,
            &far.onprem,
            addrs::ONPREM_ADDR,
            addrs::NODE_PRIMARY_ADDR,
        );
        assert_seen_as(pod, &far.inet, addrs::INET_ADDR, addrs::NODE_PRIMARY_ADDR);
    }
    // Pod to pod on the node across ENIs: straight through the node.
    let pod5_server = WhoamiServer::start(&lab.pod(5).netns, at(lab.pod(5).addr)).unwrap();
    let seen = tcp_whoami(&lab.pod(1).netns, at(lab.pod(5).addr), REPLY_TIMEOUT).unwrap();
    assert_eq!(
        seen.map(|s| *s.ip()),
        Some(lab.pod(1).addr),
        "pod-1 -> pod-5"
    );
    drop(pod5_server);
    assert_eq!(
        lab.srcdst_check_drops().unwrap(),
        0,
        "nothing legitimate dropped"
    );
    assert_eq!(lab.igw_drops().unwrap(), 0, "nothing legitimate dropped");

    check_steering_is_what_gets_through(&lab, &far);
    check_node_port(&lab);

    drop(far);
    lab.down().unwrap();
    assert_no_lab_left();
}

/// Without its rule 1536 a pod on eth1 leaves by eth0 (main table), and the
/// VPC router's source/destination check drops it: the rule is what steers.
fn check_steering_is_what_gets_through(lab: &Lab, far: &FarEnds) {
    let pod = lab.pod(1);
    let before = lab.srcdst_check_drops().unwrap();
    let eth0_before = lab.packets_from(addrs::VPC_NODE_ETH0_LINK).unwrap();
    {
        let _removed = RuleRemoved::new(&format!("from {}/32 priority 1536 table 2", pod.addr));
        far.peer.clear();
        let udp = udp_whoami(&pod.netns, at(addrs::PEER_ADDR), DROP_TIMEOUT).unwrap();
        assert_eq!(udp, None, "forced out eth0, it must not arrive");
        assert!(far.peer.observations().is_empty());
    }
    let after = lab.srcdst_check_drops().unwrap();
    println!(
        "pod-1 ({}) forced out eth0: src/dst check drops {before} -> {after}",
        pod.addr
    );
    assert_eq!(after, before + 1);
    assert!(lab.packets_from(addrs::VPC_NODE_ETH0_LINK).unwrap() > eth0_before);
    // The rule is back: the pod gets through again.
    let udp = udp_whoami(&pod.netns, at(addrs::PEER_ADDR), REPLY_TIMEOUT).unwrap();
    assert_eq!(udp.map(|s| *s.ip()), Some(pod.addr));
}

/// `peer` connects to the node port; the pod on eth1 sees the client's own
/// address (no masquerade) and its reply leaves by eth0 (connmark 0x80 and
/// rule 1024). Without rule 1024 the reply follows rule 1536 out of eth1
/// with the node's primary address as source and is dropped.
fn check_node_port(lab: &Lab) {
    let pod = lab.pod(1);
    assert_eq!(pod.eni, "eth1");
    let nat = exec_ok(addrs::NS_NODE, &["iptables", "-t", "nat", "-S"]).unwrap();
    assert!(
        nat.contains(&format!(
            "-p tcp -m comment --comment \"default/node-port:tcp\" -m tcp -j DNAT --to-destination {}:{PORT}",
            pod.addr
        )),
        "{nat}"
    );
    let server = WhoamiServer::start(&pod.netns, at(pod.addr)).unwrap();
    let node_port = SocketAddrV4::new(addrs::NODE_PRIMARY_ADDR, addrs::NODE_PORT);
    let eth0_before = lab.packets_from(addrs::VPC_NODE_ETH0_LINK).unwrap();
    let eth1_before = lab.packets_from(&addrs::vpc_eni_link(1)).unwrap();
    let tcp = tcp_whoami(addrs::NS_PEER, node_port, REPLY_TIMEOUT).unwrap();
    assert_eq!(
        tcp.map(|s| *s.ip()),
        Some(addrs::PEER_ADDR),
        "tcp node port"
    );
    let udp = udp_whoami(addrs::NS_PEER, node_port, REPLY_TIMEOUT).unwrap();
    assert_eq!(
        udp.map(|s| *s.ip()),
        Some(addrs::PEER_ADDR),
        "udp node port"
    );
    let seen = server
        .observations()
        .iter()
        .map(|o| (o.proto, *o.source.ip()))
        .collect::<Vec<_>>();
    assert_eq!(
        seen,
        [
            (Proto::Tcp, addrs::PEER_ADDR),
            (Proto::Udp, addrs::PEER_ADDR)
        ]
    );
    assert!(lab.packets_from(addrs::VPC_NODE_ETH0_LINK).unwrap() > eth0_before);
    assert_eq!(
        lab.packets_from(&addrs::vpc_eni_link(1)).unwrap(),
        eth1_before,
        "the replies left by eth0, not by the pod's eth1"
    );

    let before = lab.srcdst_check_drops().unwrap();
    {
        let _removed = RuleRemoved::new("fwmark 0x80/0x80 priority 1024 table main");
        let udp = udp_whoami(addrs::NS_PEER, node_port, DROP_TIMEOUT).unwrap();
        assert_eq!(udp, None, "without rule 1024 the reply leaves by eth1");
    }
    let after = lab.srcdst_check_drops().unwrap();
    println!("node port reply without rule 1024: src/dst check drops {before} -> {after}");
    assert!(after > before);
    let udp = udp_whoami(addrs::NS_PEER, node_port, REPLY_TIMEOUT).unwrap();
    assert_eq!(
        udp.map(|s| *s.ip()),
        Some(addrs::PEER_ADDR),
        "rule 1024 is back"
    );
    server.stop();
}

#[test]
fn branch_eni_pods_in_strict_mode() {
    branch_eni_pods(EnforcingMode::Strict);
}

#[test]
fn branch_eni_pods_in_standard_mode() {
    branch_eni_pods(EnforcingMode::Standard);
}

/// Pod 2 has a branch ENI (`vlan.eth.1`), pods 0 and 1 are on eth0 and
/// eth1. The branch pod reaches `peer` with its own address by its branch
/// ENI in both modes; in strict mode everything it sends leaves by the
/// branch ENI (other pods of the node too, and never SNATed: outside the
/// VPC it needs a NAT gateway, so the internet gateway drops it); in
/// standard mode it reaches local pods directly and is SNATed like any pod
/// outside the VPC.
fn branch_eni_pods(mode: EnforcingMode) {
    let _lab_lock = lab_session();

    let opts = LabOptions {
        enis: 2,
        branch_pods: vec![2],
        sg_enforcing_mode: mode,
        ..LabOptions::iptables(3)
    };
    let lab = Lab::up(&opts).expect("lab up");
    let pod = lab.pod(2).clone();
    let branch = pod.branch.clone().expect("pod 2 has a branch ENI");
    check_branch_wiring(&lab, &pod);

    let far = FarEnds::start();
    let from_branch = || lab.packets_from(&branch.vpc_link).unwrap();

    let before = from_branch();
    assert_seen_as(&pod, &far.peer, addrs::PEER_ADDR, pod.addr);
    assert!(from_branch() > before, "to peer by the branch ENI");

    // To a pod of the same node.
    let pod0 = lab.pod(0);
    let pod0_server = WhoamiServer::start(&pod0.netns, at(pod0.addr)).unwrap();
    let before = from_branch();
    let seen = tcp_whoami(&pod.netns, at(pod0.addr), REPLY_TIMEOUT).unwrap();
    assert_eq!(seen.map(|s| *s.ip()), Some(pod.addr), "branch pod -> pod-0");
    let by_branch = from_branch() - before;
    drop(pod0_server);

    match mode {
        EnforcingMode::Strict => {
            assert!(by_branch > 0, "strict: to a local pod by the branch ENI");
            assert_seen_as(&pod, &far.onprem, addrs::ONPREM_ADDR, pod.addr);
            let igw_before = lab.igw_drops().unwrap();
            let udp = udp_whoami(&pod.netns, at(addrs::INET_ADDR), DROP_TIMEOUT).unwrap();
            assert_eq!(udp, None, "strict: not SNATed, no public IP");
            assert!(lab.igw_drops().unwrap() > igw_before);
        }
        EnforcingMode::Standard => {
            assert_eq!(by_branch, 0, "standard: to a local pod through the node");
            assert_seen_as(
                &pod,
                &far.onprem,
                addrs::ONPREM_ADDR,
                addrs::NODE_PRIMARY_ADDR,
            );
            assert_seen_as(&pod, &far.inet, addrs::INET_ADDR, addrs::NODE_PRIMARY_ADDR);
        }
    }
    // The other pods are unaffected.
    for other in [lab.pod(0), lab.pod(1)] {
        assert_seen_as(other, &far.peer, addrs::PEER_ADDR, other.addr);
        assert_seen_as(other, &far.inet, addrs::INET_ADDR, addrs::NODE_PRIMARY_ADDR);
    }
    assert_eq!(
        lab.srcdst_check_drops().unwrap(),
        0,
        "nothing dropped by the check"
    );

    drop(far);
    lab.down().unwrap();
    assert_no_lab_left();
}

/// The branch link, its VLAN table and the rules of the mode.
fn check_branch_wiring(lab: &Lab, pod: &PodInfo) {
    let branch = pod.branch.as_ref().unwrap();
    assert_eq!(branch.link, "vlan.eth.1");
    assert_eq!(pod.eni, "vlan.eth.1");
    let link = exec_ok(addrs::NS_NODE, &["ip", "-o", "link", "show", &branch.link]).unwrap();
    assert!(
        link.contains(&branch.mac) && link.contains("mtu 9001"),
        "{link}"
    );
    let table = branch.route_table.to_string();
    let routes = exec_ok(addrs::NS_NODE, &["ip", "route", "show", "table", &table]).unwrap();
    assert!(
        routes.contains("default via 10.20.11.1 dev vlan.eth.1")
            && routes.contains("10.20.11.1 dev vlan.eth.1 scope link"),
        "{routes}"
    );
    let rules = lab.ip_rules().unwrap();
    println!("ip rule show (node):\n  {}", rules.join("\n  "));
    let own = lab.pod_ip_rules(pod).unwrap();
    println!(
        "{} ({} mode, host veth {}): {} ip rule(s)",
        pod.netns,
        branch.mode.env_value(),
        pod.host_veth,
        own.len()
    );
    match branch.mode {
        EnforcingMode::Strict => {
            assert!(pod.host_veth.starts_with("vlan"), "{}", pod.host_veth);
            assert_eq!(
                own,
                [
                    "10:\tfrom all iif vlan.eth.1 lookup 101".to_owned(),
                    format!("10:\tfrom all iif {} lookup 101", pod.host_veth),
                ]
            );
            assert!(routes.contains(&format!("{} dev {}", pod.addr, pod.host_veth)));
            // The local table's rule moved from 0 to 20, after the VLAN rules.
            assert!(rules.contains(&"20:\tfrom all lookup local".to_owned()));
            assert!(!rules.iter().any(|r| r.starts_with("0:")), "{rules:#?}");
        }
        EnforcingMode::Standard => {
            assert!(pod.host_veth.starts_with("eni"), "{}", pod.host_veth);
            assert_eq!(
                own,
                [
                    format!("512:\tfrom all to {} lookup main", pod.addr),
                    format!("1536:\tfrom {} lookup 101", pod.addr),
                ]
            );
            assert!(rules.contains(&"0:\tfrom all lookup local".to_owned()));
        }
    }
    let delivery = exec_ok(
        addrs::NS_VPC,
        &["ip", "neigh", "show", &pod.addr.to_string()],
    )
    .unwrap();
    assert!(
        delivery.contains(&format!("dev {}", branch.vpc_link)) && delivery.contains(&branch.mac),
        "{delivery}"
    );
}

/// Scale in the iptables reference: 4096 pods' worth of rules (8192) and 64
/// SNAT exclusions before the lab's own, then the pod whose rules sit last
/// (pod 1, on eth1) still gets out right: its own address to `peer` and to
/// the excluded `onprem` (whose exclusion is the last one evaluated), the
/// node's to `inet`.
#[test]
fn a_pod_whose_rules_sit_last_behind_4096_pods_still_forwards() {
    let _lab_lock = lab_session();

    // The exclusions are inserted at the top of the chain one by one, so the
    // first listed is evaluated last.
    let exclusions = std::iter::once(addrs::ONPREM_NET)
        .chain((0..63u8).map(|i| ipnet::Ipv4Net::new(Ipv4Addr::new(198, 18, i, 0), 24).unwrap()))
        .collect();
    let opts = LabOptions {
        enis: 2,
        filler_pods: 4096,
        exclude_snat_cidrs: exclusions,
        ..LabOptions::iptables(2)
    };
    let started = std::time::Instant::now();
    let lab = Lab::up(&opts).expect("lab up");
    let rules = lab.ip_rules().unwrap();
    println!(
        "up in {:?} with {} ip rules in the node",
        started.elapsed(),
        rules.len()
    );
    let pod = lab.pod(1);
    assert_eq!(pod.eni, "eth1");
    let own = lab.pod_ip_rules(pod).unwrap();
    let last_512 = rules.iter().rposition(|r| r.starts_with("512:")).unwrap();
    let last_1536 = rules.iter().rposition(|r| r.starts_with("1536:")).unwrap();
    assert_eq!(own, [rules[last_512].clone(), rules[last_1536].clone()]);
    // 2 per filler pod, 1 + 2 for pods 0 and 1, 1024, 32765 for eth1, and
    // the kernel's 0, 32766 and 32767.
    assert_eq!(rules.len(), 2 * 4096 + 3 + 1 + 1 + 3, "{:?}", &rules[..5]);
    let snat = exec_ok(
        addrs::NS_NODE,
        &["iptables", "-t", "nat", "-S", "AWS-SNAT-CHAIN-0"],
    )
    .unwrap();
    let returns: Vec<&str> = snat.lines().filter(|l| l.ends_with("-j RETURN")).collect();
    assert_eq!(returns.len(), 64 + 2);
    assert!(returns[63].contains("-d 192.0.2.0/24"), "{snat}");

    let far = FarEnds::start();
    assert_seen_as(pod, &far.peer, addrs::PEER_ADDR, pod.addr);
    assert_seen_as(pod, &far.onprem, addrs::ONPREM_ADDR, pod.addr);
    assert_seen_as(pod, &far.inet, addrs::INET_ADDR, addrs::NODE_PRIMARY_ADDR);
    assert_eq!(lab.srcdst_check_drops().unwrap(), 0);

    drop(far);
    lab.down().unwrap();
    assert_no_lab_left();
}
