//! Network policy's verdicts on crafted packets, on every way a packet
//! reaches a local pod or leaves one: rules written by the agent's own
//! compiler and enforcer, judged by the programs.

use std::net::Ipv4Addr;

use vpcnet_agent::{
    datapath::monotonic_now_ns,
    policy::{
        self, Enforcer,
        rules::{
            Action, ClusterRule, Direction, Origin, Peers, PodRules, Ports, Protocol, Rule, Tier,
        },
    },
};
use vpcnet_bpf_tests::{
    Harness, INET, NODE, ONPREM, PEER, POD, POD2, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC,
    TEST_RUN_IFINDEX,
    packets::{self, TCP_ACK, TCP_SYN},
};
use vpcnet_common::{
    config::{FLAG_NETWORK_POLICY, MARK_VIA_SERVICE},
    counters::Counter,
    endpoint::{ENDPOINT_BRANCH, ENDPOINT_STRICT, ENI_BRANCH, ENI_PRIMARY, Endpoint},
    maps,
    nat::{PROTO_TCP, PROTO_UDP, Timeouts},
    policy::{PodVerdicts, PolicyFlow},
};

const POD_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
const POD2_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x22];
const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 20, 11, 1);
/// A branch ENI's VLAN link (or, with the test run's device as the link,
/// the branch pod's host veth) that is not the test run's device.
const BRANCH_LINK: u32 = 3003;
const SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 10);

/// The node with POD and POD2, both behind the test run's device (so both
/// may send through `pod_egress`), policy on, and the agent's enforcer over
/// its maps.
struct Node {
    h: Harness,
    enforcer: Enforcer,
}

impl Node {
    fn new() -> Self {
        let mut h = Harness::lab_default();
        h.add_eni(TEST_RUN_IFINDEX, GATEWAY, ENI_PRIMARY);
        for (addr, mac) in [(POD, POD_MAC), (POD2, POD2_MAC)] {
            h.add_endpoint(
                addr,
                &Endpoint {
                    ifindex: TEST_RUN_IFINDEX,
                    eni_ifindex: TEST_RUN_IFINDEX,
                    mac,
                    host_mac: [0x02, 0xaa, 0, 0, 0, mac[5]],
                    flags: 0,
                },
            );
        }
        let mut cfg = h.datapath.maps.config().unwrap();
        cfg.flags |= FLAG_NETWORK_POLICY;
        h.datapath.maps.set_config(&cfg).unwrap();
        let mut enforcer = Enforcer::new(&h.datapath.maps).unwrap();
        enforcer.set_node_addresses([NODE]);
        Self { h, enforcer }
    }

    /// Gives `pod` these rules and writes them; returns how many tracked
    /// connections the change revoked.
    fn rules(&mut self, pod: Ipv4Addr, rules: PodRules) -> usize {
        self.enforcer.set_pod(pod, rules);
        self.enforcer.sync(&mut self.h.datapath.maps).unwrap()
    }

    /// What `pod_egress` does with `packet` sent by `from` (its MAC set).
    fn send(&self, from: Ipv4Addr, mut packet: Vec<u8>) -> i32 {
        packet[6..12].copy_from_slice(if from == POD { &POD_MAC } else { &POD2_MAC });
        self.h.run(maps::PROG_POD_EGRESS, &packet).action
    }

    fn counted(&self, counter: Counter, f: impl FnOnce() -> i32) -> (i32, u64) {
        let before = self.h.counter(counter);
        let action = f();
        (action, self.h.counter(counter) - before)
    }
}

fn peers(cidr: &str, except: &[&str]) -> Peers {
    Peers {
        cidr: cidr.parse().unwrap(),
        except: except.iter().map(|e| e.parse().unwrap()).collect(),
    }
}

fn rule(peers: Vec<Peers>, ports: Vec<Ports>) -> Rule {
    Rule {
        peers,
        ports,
        origin: Origin {
            namespace: "x".into(),
            name: "test".into(),
        },
    }
}

fn ingress_only(rules: Vec<Rule>) -> PodRules {
    PodRules {
        ingress: Direction::Isolated(rules),
        egress: Direction::Open,
        ..PodRules::default()
    }
}

fn egress_only(rules: Vec<Rule>) -> PodRules {
    PodRules {
        ingress: Direction::Open,
        egress: Direction::Isolated(rules),
        ..PodRules::default()
    }
}

#[test]
fn with_policy_off_nothing_is_judged() {
    let mut node = Node::new();
    node.rules(POD2, PodRules::deny_all());
    let mut cfg = node.h.datapath.maps.config().unwrap();
    cfg.flags &= !FLAG_NETWORK_POLICY;
    node.h.datapath.maps.set_config(&cfg).unwrap();
    let sent = packets::tcp(POD, 40000, POD2, 8080, TCP_SYN, b"");
    assert_eq!(node.send(POD, sent), TC_ACT_REDIRECT);
    assert_eq!(node.h.counter(Counter::PolicyFlowNew), 0, "nothing tracked");
}

#[test]
fn pod_to_pod_meets_the_receivers_ingress_rules_and_its_replies_pass() {
    let mut node = Node::new();
    node.rules(
        POD2,
        ingress_only(vec![rule(
            vec![peers("10.20.11.20/32", &[])],
            vec![Ports::one(Protocol::Tcp, 8080)],
        )]),
    );
    // POD may open 8080 on POD2, not 9090.
    let (action, new) = node.counted(Counter::PolicyFlowNew, || {
        node.send(POD, packets::tcp(POD, 40000, POD2, 8080, TCP_SYN, b""))
    });
    assert_eq!((action, new), (TC_ACT_REDIRECT, 1));
    let (action, dropped) = node.counted(Counter::DropPolicyIngress, || {
        node.send(POD, packets::tcp(POD, 40001, POD2, 9090, TCP_SYN, b""))
    });
    assert_eq!((action, dropped), (TC_ACT_SHOT, 1));
    // POD2 answers the allowed connection.
    let reply = packets::tcp(POD2, 8080, POD, 40000, TCP_SYN | TCP_ACK, b"");
    assert_eq!(node.send(POD2, reply), TC_ACT_REDIRECT);
    // UDP is not TCP on the same port.
    let (action, _) = node.counted(Counter::DropPolicyIngress, || {
        node.send(POD, packets::udp(POD, 40000, POD2, 8080, b"q"))
    });
    assert_eq!(action, TC_ACT_SHOT);
    // On POD2's verdicts: one connection allowed in, two packets denied;
    // POD, under no policy, has none.
    let verdicts = policy::maps::verdicts(&node.h.datapath.maps).unwrap();
    assert_eq!(
        verdicts.get(&POD2),
        Some(&PodVerdicts {
            ingress_allowed: 1,
            ingress_denied: 2,
            ..PodVerdicts::default()
        })
    );
    assert_eq!(verdicts.get(&POD), None);
}

#[test]
fn egress_rules_judge_every_destination_with_their_exceptions() {
    let mut node = Node::new();
    node.rules(
        POD,
        egress_only(vec![
            rule(
                vec![peers("10.20.12.50/32", &[])],
                vec![Ports::one(Protocol::Tcp, 443)],
            ),
            rule(
                vec![peers("0.0.0.0/0", &["203.0.113.0/24"])],
                vec![Ports::one(Protocol::Udp, 53)],
            ),
        ]),
    );
    let cases = [
        (packets::tcp(POD, 40000, PEER, 443, TCP_SYN, b""), true),
        (packets::tcp(POD, 40001, PEER, 80, TCP_SYN, b""), false),
        (packets::udp(POD, 40002, ONPREM, 53, b"q"), true),
        (packets::udp(POD, 40003, INET, 53, b"q"), false),
        (packets::icmp_echo(POD, PEER, true, 7, 1), false),
        (packets::tcp(POD, 40004, POD2, 443, TCP_SYN, b""), false),
    ];
    for (i, (sent, allowed)) in cases.into_iter().enumerate() {
        let (action, dropped) =
            node.counted(Counter::DropPolicyEgress, || node.send(POD, sent.clone()));
        assert_eq!(dropped == 0, allowed, "case {i}: action {action}");
        assert_eq!(action == TC_ACT_SHOT, !allowed, "case {i}");
    }
    let verdicts = policy::maps::verdicts(&node.h.datapath.maps).unwrap();
    assert_eq!(
        verdicts[&POD],
        PodVerdicts {
            egress_allowed: 2,
            egress_denied: 4,
            ..PodVerdicts::default()
        }
    );
}

#[test]
fn a_branch_eni_pods_rules_judge_what_reaches_it_over_its_vlan_and_what_it_sends() {
    let mut node = Node::new();
    // The test run's device is POD2's branch ENI's link (strict mode: all
    // its traffic goes by it).
    node.h.add_eni(TEST_RUN_IFINDEX, GATEWAY, ENI_BRANCH);
    node.h.add_endpoint(
        POD2,
        &Endpoint {
            ifindex: BRANCH_LINK,
            eni_ifindex: TEST_RUN_IFINDEX,
            mac: POD2_MAC,
            host_mac: [0x02, 0xaa, 0, 0, 0, 0x22],
            flags: ENDPOINT_BRANCH | ENDPOINT_STRICT,
        },
    );
    node.rules(
        POD2,
        PodRules {
            ingress: Direction::Isolated(vec![rule(
                vec![peers("10.20.12.0/24", &[])],
                vec![Ports::one(Protocol::Tcp, 8080)],
            )]),
            egress: Direction::Isolated(vec![rule(vec![peers("10.20.0.0/16", &[])], vec![])]),
            ..PodRules::default()
        },
    );
    // In by the VLAN: PEER on 8080 only.
    let (action, new) = node.counted(Counter::PolicyFlowNew, || {
        node.h
            .ingress(&packets::tcp(PEER, 40000, POD2, 8080, TCP_SYN, b""))
            .action
    });
    assert_eq!((action, new), (TC_ACT_REDIRECT, 1));
    let (action, dropped) = node.counted(Counter::DropPolicyIngress, || {
        node.h
            .ingress(&packets::tcp(PEER, 40001, POD2, 9090, TCP_SYN, b""))
            .action
    });
    assert_eq!((action, dropped), (TC_ACT_SHOT, 1));
    // Out by the VLAN: the VPC, not the internet. The test run's device is
    // POD2's host veth now, its branch ENI's link another.
    node.h.add_eni(BRANCH_LINK, GATEWAY, ENI_BRANCH);
    node.h.add_endpoint(
        POD2,
        &Endpoint {
            ifindex: TEST_RUN_IFINDEX,
            eni_ifindex: BRANCH_LINK,
            mac: POD2_MAC,
            host_mac: [0x02, 0xaa, 0, 0, 0, 0x22],
            flags: ENDPOINT_BRANCH | ENDPOINT_STRICT,
        },
    );
    let (action, _) = node.counted(Counter::DropPolicyEgress, || {
        node.send(POD2, packets::tcp(POD2, 40002, PEER, 443, TCP_SYN, b""))
    });
    assert_eq!(action, TC_ACT_REDIRECT);
    let (action, dropped) = node.counted(Counter::DropPolicyEgress, || {
        node.send(POD2, packets::tcp(POD2, 40003, INET, 443, TCP_SYN, b""))
    });
    assert_eq!((action, dropped), (TC_ACT_SHOT, 1));
}

#[test]
fn sctp_is_judged_on_its_ports_as_tcp_and_udp_are() {
    let mut node = Node::new();
    node.rules(
        POD2,
        ingress_only(vec![rule(
            vec![peers("0.0.0.0/0", &[])],
            vec![Ports {
                protocol: Protocol::Sctp,
                first: 3868,
                last: 3870,
            }],
        )]),
    );
    for (port, allowed) in [(3868, true), (3870, true), (3871, false)] {
        let (action, dropped) = node.counted(Counter::DropPolicyIngress, || {
            node.send(POD, packets::sctp_init(POD, 40000, POD2, port))
        });
        assert_eq!(dropped == 0, allowed, "SCTP {port}: action {action}");
    }
    // TCP on an SCTP rule's port is not SCTP.
    let (_, dropped) = node.counted(Counter::DropPolicyIngress, || {
        node.send(POD, packets::tcp(POD, 40001, POD2, 3868, TCP_SYN, b""))
    });
    assert_eq!(dropped, 1);
}

/// aws-node's policy agent holds at most 24 port entries per CIDR
/// (containers-roadmap #2481): here one CIDR carries 200 single ports and
/// 50 ranges, over TCP, UDP and SCTP, and every one is judged.
#[test]
fn one_cidr_carries_hundreds_of_ports_and_ranges_all_judged() {
    let mut node = Node::new();
    let protocols = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];
    let mut ports: Vec<Ports> = (0..200u16)
        .map(|i| Ports::one(protocols[usize::from(i % 3)], 1000 + i * 7))
        .collect();
    ports.extend((0..50u16).map(|i| Ports {
        protocol: protocols[usize::from(i % 3)],
        first: 20_000 + i * 100,
        last: 20_000 + i * 100 + 9,
    }));
    node.rules(
        POD2,
        ingress_only(vec![rule(vec![peers("10.20.0.0/16", &[])], ports.clone())]),
    );
    let send = |protocol: Protocol, sport: u16, port: u16| {
        let packet = match protocol {
            Protocol::Tcp => packets::tcp(POD, sport, POD2, port, TCP_SYN, b""),
            Protocol::Udp => packets::udp(POD, sport, POD2, port, b"q"),
            Protocol::Sctp => packets::sctp_init(POD, sport, POD2, port),
        };
        node.counted(Counter::DropPolicyIngress, || node.send(POD, packet))
            .1
            == 0
    };
    let mut sport = 30_000;
    for allowed in &ports {
        for (port, expected) in [
            (allowed.first, true),
            (allowed.last, true),
            (allowed.last + 1, false),
        ] {
            sport += 1;
            assert_eq!(
                send(allowed.protocol, sport, port),
                expected,
                "{}/{port} under {allowed}",
                allowed.protocol.name()
            );
        }
        // The same port over another protocol is not allowed by it.
        let other = protocols[(protocols
            .iter()
            .position(|p| *p == allowed.protocol)
            .unwrap()
            + 1)
            % 3];
        sport += 1;
        assert!(
            !send(other, sport, allowed.first),
            "{}/{} allowed by {allowed}",
            other.name(),
            allowed.first
        );
    }
}

#[test]
fn an_isolated_pod_gets_replies_of_its_own_connections_and_nothing_new() {
    let mut node = Node::new();
    node.rules(
        POD,
        PodRules {
            ingress: Direction::Isolated(vec![]),
            egress: Direction::Open,
            ..PodRules::default()
        },
    );
    assert_eq!(
        node.send(POD, packets::tcp(POD, 40000, PEER, 80, TCP_SYN, b"")),
        TC_ACT_REDIRECT
    );
    // The reply comes in by the ENI and goes straight into POD.
    let out = node
        .h
        .ingress(&packets::tcp(PEER, 80, POD, 40000, TCP_SYN | TCP_ACK, b""));
    assert_eq!(out.action, TC_ACT_REDIRECT);
    // PEER opening a connection of its own is dropped, by the ENI's program
    // and by the pod's when the stack hands it over.
    node.h.assert_dropped(
        maps::PROG_ENI_INGRESS,
        &packets::tcp(PEER, 81, POD, 8080, TCP_SYN, b""),
        Counter::DropPolicyIngress,
    );
    node.h.assert_dropped(
        maps::PROG_POD_INGRESS,
        &packets::tcp(INET, 81, POD, 8080, TCP_SYN, b""),
        Counter::DropPolicyIngress,
    );
    // An ICMP error about POD's connection is part of it.
    let quoted = packets::tcp(POD, 40000, PEER, 80, TCP_ACK, b"");
    let frag_needed = packets::icmp_error(GATEWAY, POD, 3, 4, &quoted, 28);
    assert_eq!(node.h.ingress(&frag_needed).action, TC_ACT_REDIRECT);
}

#[test]
fn the_nodes_own_addresses_always_reach_its_pods() {
    let mut node = Node::new();
    node.rules(POD, PodRules::deny_all());
    // kubelet's probe, handed over by the stack.
    let (out, _) = node.h.run_with_mark(
        maps::PROG_POD_INGRESS,
        &packets::tcp(NODE, 50000, POD, 8080, TCP_SYN, b""),
        0,
    );
    assert_eq!(out.action, TC_ACT_UNSPEC);
    // POD's answer passes on the connection.
    let answer = packets::tcp(POD, 8080, NODE, 50000, TCP_SYN | TCP_ACK, b"");
    assert_ne!(node.send(POD, answer), TC_ACT_SHOT);
    // Strict mode's pod that no policy selects: nothing else in or out.
    node.h.assert_dropped(
        maps::PROG_POD_INGRESS,
        &packets::tcp(POD2, 50000, POD, 8080, TCP_SYN, b""),
        Counter::DropPolicyIngress,
    );
    let (action, _) = node.counted(Counter::DropPolicyEgress, || {
        node.send(POD, packets::udp(POD, 5353, ONPREM, 53, b"q"))
    });
    assert_eq!(action, TC_ACT_SHOT);
}

#[test]
fn a_service_is_judged_on_the_backend_kube_proxy_chose() {
    let mut node = Node::new();
    node.rules(
        POD,
        PodRules {
            ingress: Direction::Isolated(vec![]),
            egress: Direction::Isolated(vec![rule(
                vec![peers("10.20.12.0/24", &[])],
                vec![Ports::one(Protocol::Tcp, 8080)],
            )]),
            ..PodRules::default()
        },
    );
    // To the service's address: the stack's, whatever the rules.
    let to_service = packets::tcp(POD, 40000, SERVICE_IP, 80, TCP_SYN, b"");
    assert_eq!(node.send(POD, to_service), TC_ACT_UNSPEC);
    // After DNAT to an allowed backend, out by the ENI; to another, dropped.
    let (out, _) = node.h.run_with_mark(
        maps::PROG_ENI_EGRESS,
        &packets::tcp(POD, 40000, PEER, 8080, TCP_SYN, b""),
        MARK_VIA_SERVICE,
    );
    assert_ne!(out.action, TC_ACT_SHOT);
    let (out, _) = node.h.run_with_mark(
        maps::PROG_ENI_EGRESS,
        &packets::tcp(POD, 40001, INET, 8080, TCP_SYN, b""),
        MARK_VIA_SERVICE,
    );
    assert_eq!(out.action, TC_ACT_SHOT);
    // A local backend, handed over by the stack: POD2 is not allowed.
    node.h.assert_dropped(
        maps::PROG_POD_INGRESS,
        &packets::tcp(POD, 40002, POD2, 8080, TCP_SYN, b""),
        Counter::DropPolicyEgress,
    );
    // The reply, un-DNATed, comes from the service's address.
    let (out, _) = node.h.run_with_mark(
        maps::PROG_POD_INGRESS,
        &packets::tcp(SERVICE_IP, 80, POD, 40000, TCP_SYN | TCP_ACK, b""),
        0,
    );
    assert_eq!(out.action, TC_ACT_UNSPEC);
}

/// Makes the tracked connections of `proto` last seen `seconds` ago, as if
/// they had been idle that long.
fn idle_for(node: &mut Node, proto: u8, seconds: u64) {
    let last_seen_ns = monotonic_now_ns().wrapping_sub(seconds * 1_000_000_000);
    for (key, flow) in policy::maps::flows(&node.h.datapath.maps).unwrap() {
        if key.proto == proto {
            let idle = PolicyFlow {
                last_seen_ns,
                ..flow
            };
            node.h
                .datapath
                .maps
                .policy_flows
                .insert(key, idle, 0)
                .unwrap();
        }
    }
}

/// aws-node's agent deletes the entries of its tracker that kernel
/// conntrack lacks, racing the kernel's own timeouts, and long-lived
/// connections are cut (its #246, #462, #204, #318). A connection tracked
/// here lives as long as the node's conntrack keeps an established one of
/// its protocol (its sysctls, as the agent writes them into the timeouts
/// map), counted from its last packet; nothing else removes it.
#[test]
fn an_idle_connection_lives_as_long_as_the_nodes_conntrack_keeps_it() {
    let mut node = Node::new();
    // The node's sysctls: UDP streams kept 300 s, TCP 5 days.
    let timeouts = Timeouts {
        udp_stream: 300,
        tcp_established: 432_000,
        ..Timeouts::default()
    };
    node.h.datapath.maps.set_timeouts(&timeouts).unwrap();
    // POD2 takes POD's UDP/5353 and TCP/8080, and may open nothing itself.
    node.rules(
        POD2,
        PodRules {
            ingress: Direction::Isolated(vec![rule(
                vec![peers("10.20.11.20/32", &[])],
                vec![
                    Ports::one(Protocol::Udp, 5353),
                    Ports::one(Protocol::Tcp, 8080),
                ],
            )]),
            egress: Direction::Isolated(vec![]),
            ..PodRules::default()
        },
    );
    let query = packets::udp(POD, 40000, POD2, 5353, b"q");
    assert_eq!(node.send(POD, query), TC_ACT_REDIRECT);
    let syn = packets::tcp(POD, 40001, POD2, 8080, TCP_SYN, b"");
    assert_eq!(node.send(POD, syn), TC_ACT_REDIRECT);
    let answer = || packets::udp(POD2, 5353, POD, 40000, b"a");

    idle_for(&mut node, PROTO_UDP, 290);
    assert_eq!(
        node.send(POD2, answer()),
        TC_ACT_REDIRECT,
        "a UDP stream idle 290 s of the node's 300"
    );
    idle_for(&mut node, PROTO_UDP, 310);
    let (action, dropped) = node.counted(Counter::DropPolicyEgress, || node.send(POD2, answer()));
    assert_eq!(
        (action, dropped),
        (TC_ACT_SHOT, 1),
        "past the node's UDP timeout, POD2's datagram opens a flow it may not"
    );

    idle_for(&mut node, PROTO_TCP, 4 * 24 * 3600);
    let (action, picked_up) = node.counted(Counter::PolicyFlowPickedUp, || {
        node.send(
            POD2,
            packets::tcp(POD2, 8080, POD, 40001, TCP_ACK, b"still here"),
        )
    });
    assert_eq!(
        (action, picked_up),
        (TC_ACT_REDIRECT, 0),
        "a TCP connection idle 4 days of the node's 5 passes on its own entry"
    );
}

#[test]
fn a_change_that_denies_a_running_connection_stops_it() {
    let mut node = Node::new();
    let allow_port = |port| {
        egress_only(vec![rule(
            vec![peers("10.20.12.50/32", &[])],
            vec![Ports::one(Protocol::Tcp, port)],
        )])
    };
    node.rules(POD, allow_port(80));
    let data = packets::tcp(POD, 40000, PEER, 80, TCP_ACK, b"data");
    assert_eq!(
        node.send(POD, packets::tcp(POD, 40000, PEER, 80, TCP_SYN, b"")),
        TC_ACT_REDIRECT
    );
    assert_eq!(node.send(POD, data.clone()), TC_ACT_REDIRECT);
    // Another change that still allows it leaves it alone.
    node.rules(POD2, PodRules::deny_all());
    assert_eq!(node.send(POD, data.clone()), TC_ACT_REDIRECT);

    assert_eq!(
        node.rules(POD, allow_port(443)),
        1,
        "one connection revoked"
    );
    let (action, revoked) =
        node.counted(Counter::DropPolicyRevoked, || node.send(POD, data.clone()));
    assert_eq!((action, revoked), (TC_ACT_SHOT, 1));
    // Its replies too.
    let reply = packets::tcp(PEER, 80, POD, 40000, TCP_ACK, b"");
    assert_eq!(node.h.ingress(&reply).action, TC_ACT_SHOT);
    // Allowed again, it goes on.
    assert_eq!(node.rules(POD, allow_port(80)), 0);
    assert_eq!(node.send(POD, data), TC_ACT_REDIRECT);
}

#[test]
fn a_connection_running_before_it_was_tracked_goes_on_when_either_end_may_open_it() {
    let mut node = Node::new();
    // POD2 serves 8080 to POD; POD's egress is open.
    node.rules(
        POD2,
        ingress_only(vec![rule(
            vec![peers("10.20.11.20/32", &[])],
            vec![Ports::one(Protocol::Tcp, 8080)],
        )]),
    );
    // POD takes nothing new in. POD2's answer on a connection nothing
    // tracked (running before a take-over, say) passes all the same: POD
    // may open that connection to POD2's 8080.
    node.rules(POD, ingress_only(vec![]));
    let (action, picked) = node.counted(Counter::PolicyFlowPickedUp, || {
        node.send(POD2, packets::tcp(POD2, 8080, POD, 40000, TCP_ACK, b"a"))
    });
    assert_eq!((action, picked), (TC_ACT_REDIRECT, 1));
    // A UDP datagram has no such reading, and a SYN opens anew.
    let (action, _) = node.counted(Counter::DropPolicyIngress, || {
        node.send(POD2, packets::udp(POD2, 8080, POD, 40001, b"a"))
    });
    assert_eq!(action, TC_ACT_SHOT);
    let (action, _) = node.counted(Counter::DropPolicyIngress, || {
        node.send(POD2, packets::tcp(POD2, 8080, POD, 40002, TCP_SYN, b""))
    });
    assert_eq!(action, TC_ACT_SHOT);
}

#[test]
fn verdicts_go_to_the_event_ring_only_when_asked_and_never_block() {
    use vpcnet_agent::policy::events::line;
    use vpcnet_common::config::FLAG_POLICY_EVENTS;

    let mut node = Node::new();
    let mut ring = node.h.datapath.take_policy_events().unwrap();
    node.rules(POD, PodRules::default());
    node.rules(POD2, ingress_only(vec![]));
    let denied = packets::tcp(POD, 40000, POD2, 8080, TCP_SYN, b"");
    assert_eq!(node.send(POD, denied.clone()), TC_ACT_SHOT);
    assert!(ring.next().is_none(), "no events unless asked");

    let mut cfg = node.h.datapath.maps.config().unwrap();
    cfg.flags |= FLAG_POLICY_EVENTS;
    node.h.datapath.maps.set_config(&cfg).unwrap();
    assert_eq!(node.send(POD, denied), TC_ACT_SHOT);
    let allowed = packets::tcp(POD2, 40001, POD, 8080, TCP_SYN, b"");
    assert_eq!(node.send(POD2, allowed), TC_ACT_REDIRECT);
    let mut lines = Vec::new();
    while let Some(item) = ring.next() {
        // SAFETY: the ring's records are `PolicyEvent`s, plain data.
        let event: vpcnet_common::policy::PolicyEvent =
            unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
        let ts = "2026-11-27T10:00:00Z".parse().unwrap();
        lines.push(line(&event, true, ts).unwrap());
    }
    let msgs: Vec<String> = lines
        .iter()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["msg"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(
        msgs,
        [
            "Flow Info: Src IP: 10.20.11.20 Src Port: 40000 Dest IP: 10.20.11.21 Dest Port: 8080 Proto TCP Verdict DENY Direction ingress, Tier NETWORK_POLICY",
            "Flow Info: Src IP: 10.20.11.21 Src Port: 40001 Dest IP: 10.20.11.20 Dest Port: 8080 Proto TCP Verdict ACCEPT Direction egress, Tier DEFAULT",
            "Flow Info: Src IP: 10.20.11.21 Src Port: 40001 Dest IP: 10.20.11.20 Dest Port: 8080 Proto TCP Verdict ACCEPT Direction ingress, Tier DEFAULT",
        ]
    );
    // A full ring loses events, counted; the packets drop as ever. (A
    // record is the event and an 8-byte header.)
    let record = std::mem::size_of::<vpcnet_common::policy::PolicyEvent>() + 8;
    let room = vpcnet_common::policy::POLICY_EVENTS_BYTES as usize / record;
    let sent = packets::tcp(POD, 1024, POD2, 9, TCP_SYN, b"");
    for _ in 0..room + 100 {
        assert_eq!(node.send(POD, sent.clone()), TC_ACT_SHOT);
    }
    assert!(node.h.counter(Counter::PolicyEventLost) > 0);
}

fn cluster_rule(
    tier: Tier,
    priority: u16,
    action: Action,
    peer: &str,
    ports: Vec<Ports>,
) -> ClusterRule {
    ClusterRule {
        tier,
        priority,
        action,
        peers: vec![peer.parse().unwrap()],
        ports,
        origin: Origin {
            namespace: String::new(),
            name: "cluster".into(),
        },
    }
}

/// AWS ClusterNetworkPolicy around a NetworkPolicy, on crafted packets:
/// an Admin Deny carves a port out of what the NetworkPolicy allows, an
/// Admin Accept lets through what it does not, a Pass leaves it to the
/// NetworkPolicy, and a pod no NetworkPolicy selects meets Baseline; the
/// event log names the tier that decided.
#[test]
#[allow(clippy::too_many_lines, reason = "one story, told in order")]
fn cluster_policy_tiers_judge_around_the_network_policy_and_the_log_names_them() {
    use vpcnet_common::config::FLAG_POLICY_EVENTS;

    let mut node = Node::new();
    let mut cfg = node.h.datapath.maps.config().unwrap();
    cfg.flags |= FLAG_POLICY_EVENTS;
    node.h.datapath.maps.set_config(&cfg).unwrap();
    let mut ring = node.h.datapath.take_policy_events().unwrap();
    // POD2: its NetworkPolicy allows POD on every port; Admin denies TCP
    // 22 from the whole subnet, passes TCP 23 at a lower number, and
    // accepts UDP 53 from anywhere.
    node.rules(
        POD2,
        PodRules {
            selected: true,
            cluster_ingress: vec![
                cluster_rule(
                    Tier::Admin,
                    10,
                    Action::Deny,
                    "10.20.11.0/24",
                    vec![Ports::one(Protocol::Tcp, 22)],
                ),
                cluster_rule(
                    Tier::Admin,
                    5,
                    Action::Pass,
                    "10.20.11.0/24",
                    vec![Ports::one(Protocol::Tcp, 23)],
                ),
                cluster_rule(
                    Tier::Admin,
                    10,
                    Action::Deny,
                    "10.20.11.0/24",
                    vec![Ports::one(Protocol::Tcp, 23)],
                ),
                cluster_rule(
                    Tier::Admin,
                    20,
                    Action::Accept,
                    "0.0.0.0/0",
                    vec![Ports::one(Protocol::Udp, 53)],
                ),
                cluster_rule(Tier::Baseline, 0, Action::Deny, "0.0.0.0/0", vec![]),
            ],
            ..ingress_only(vec![rule(vec![peers("10.20.11.20/32", &[])], vec![])])
        },
    );
    let to_pod2 = |sport, proto, dport| match proto {
        PROTO_TCP => packets::tcp(POD, sport, POD2, dport, TCP_SYN, b""),
        _ => packets::udp(POD, sport, POD2, dport, b"q"),
    };
    assert_eq!(
        node.send(POD, to_pod2(40000, PROTO_TCP, 22)),
        TC_ACT_SHOT,
        "Admin's Deny"
    );
    assert_eq!(
        node.send(POD, to_pod2(40001, PROTO_TCP, 23)),
        TC_ACT_REDIRECT,
        "Admin's Pass"
    );
    assert_eq!(
        node.send(POD, to_pod2(40002, PROTO_TCP, 80)),
        TC_ACT_REDIRECT,
        "the NetworkPolicy"
    );
    assert_eq!(
        node.send(POD, to_pod2(40003, PROTO_UDP, 53)),
        TC_ACT_REDIRECT,
        "Admin's Accept"
    );
    // POD: no NetworkPolicy selects it; Baseline denies what comes from
    // POD2 but UDP 53, which Admin accepts.
    node.rules(
        POD,
        PodRules {
            cluster_ingress: vec![
                cluster_rule(Tier::Baseline, 0, Action::Deny, "10.20.11.21/32", vec![]),
                cluster_rule(
                    Tier::Admin,
                    0,
                    Action::Accept,
                    "10.20.11.21/32",
                    vec![Ports::one(Protocol::Udp, 53)],
                ),
            ],
            ..PodRules::default()
        },
    );
    let to_pod = |sport, proto, dport| match proto {
        PROTO_TCP => packets::tcp(POD2, sport, POD, dport, TCP_SYN, b""),
        _ => packets::udp(POD2, sport, POD, dport, b"q"),
    };
    assert_eq!(
        node.send(POD2, to_pod(40004, PROTO_TCP, 80)),
        TC_ACT_SHOT,
        "Baseline's Deny"
    );
    assert_eq!(
        node.send(POD2, to_pod(40005, PROTO_UDP, 53)),
        TC_ACT_REDIRECT,
        "Admin's Accept"
    );
    let tiers = ingress_verdicts(&mut ring);
    assert_eq!(
        tiers,
        [
            "22 DENY ADMIN",
            "23 ACCEPT NETWORK_POLICY",
            "80 ACCEPT NETWORK_POLICY",
            "53 ACCEPT ADMIN",
            "80 DENY BASELINE",
            "53 ACCEPT ADMIN",
        ]
    );
}

/// Each ingress event in `ring`: `PORT VERDICT TIER`.
fn ingress_verdicts(ring: &mut aya::maps::RingBuf<aya::maps::MapData>) -> Vec<String> {
    use vpcnet_agent::policy::events::line;

    let mut tiers = Vec::new();
    while let Some(item) = ring.next() {
        // SAFETY: the ring's records are `PolicyEvent`s, plain data.
        let event: vpcnet_common::policy::PolicyEvent =
            unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
        let ts = "2026-11-27T10:00:00Z".parse().unwrap();
        let record: serde_json::Value =
            serde_json::from_str(&line(&event, true, ts).unwrap()).unwrap();
        let msg = record["msg"].as_str().unwrap();
        if msg.contains("Direction ingress") {
            let tail = msg.split("Dest Port: ").nth(1).unwrap();
            let (port, rest) = tail.split_once(' ').unwrap();
            let verdict = rest
                .split("Verdict ")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap();
            let tier = rest.split("Tier ").nth(1).unwrap();
            tiers.push(format!("{port} {verdict} {tier}"));
        }
    }
    tiers
}
