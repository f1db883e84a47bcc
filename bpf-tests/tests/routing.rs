//! The routing replacement's verdicts on crafted packets: pod to pod,
//! steering out of a pod's own ENI, the stack for services, node addresses
//! and flows kube-proxy translated, local delivery from ENIs,
//! anti-spoofing. (Which device a redirect goes to is proven in the lab,
//! where the VPC's source/destination check sees it.)

use std::net::Ipv4Addr;

use vpcnet_agent::{datapath::monotonic_now_ns, snat::SnatSettings};
use vpcnet_bpf_tests::{
    Harness, INET, NODE, NODE_LOCAL_DNS, PEER, POD, POD2, TC_ACT_REDIRECT, TC_ACT_UNSPEC,
    TEST_RUN_IFINDEX,
    packets::{self, TCP_ACK, TCP_FIN, TCP_SYN, parse},
};
use vpcnet_common::{
    config::MARK_DECIDED,
    counters::Counter,
    endpoint::{ENDPOINT_BRANCH, ENDPOINT_STRICT, ENI_PRIMARY, Endpoint},
    maps,
    nat::{DEFAULT_TIMEOUTS, NS_PER_SEC},
};

const POD_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
const POD2_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x22];
const HOST_VETH_MAC: [u8; 6] = [0x02, 0xaa, 0, 0, 0, 0x01];
const HOST_VETH2_MAC: [u8; 6] = [0x02, 0xaa, 0, 0, 0, 0x22];
/// Link indexes of ENIs other than the test run's device.
const ETH1: u32 = 1001;
const BRANCH: u32 = 1002;
const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 20, 11, 1);

/// `packet` as sent by `POD` (its MAC as the source).
fn from_pod(mut packet: Vec<u8>) -> Vec<u8> {
    packet[6..12].copy_from_slice(&POD_MAC);
    packet
}

fn ttl(frame: &[u8]) -> u8 {
    frame[14 + 8]
}

/// POD behind the test run's device on ETH1, POD2 another local pod.
fn harness() -> Harness {
    let mut h = Harness::lab_default();
    h.add_eni(TEST_RUN_IFINDEX, GATEWAY, ENI_PRIMARY);
    h.add_eni(ETH1, GATEWAY, 0);
    h.add_endpoint(
        POD,
        &Endpoint {
            ifindex: TEST_RUN_IFINDEX,
            eni_ifindex: ETH1,
            mac: POD_MAC,
            host_mac: HOST_VETH_MAC,
            flags: 0,
        },
    );
    h.add_endpoint(
        POD2,
        &Endpoint {
            ifindex: 2002,
            eni_ifindex: TEST_RUN_IFINDEX,
            mac: POD2_MAC,
            host_mac: HOST_VETH2_MAC,
            flags: 0,
        },
    );
    h
}

/// [`harness`] with POD on its own branch ENI in strict mode.
fn strict_harness() -> Harness {
    let mut h = harness();
    h.add_eni(BRANCH, GATEWAY, 0);
    h.add_endpoint(
        POD,
        &Endpoint {
            ifindex: TEST_RUN_IFINDEX,
            eni_ifindex: BRANCH,
            mac: POD_MAC,
            host_mac: HOST_VETH_MAC,
            flags: ENDPOINT_BRANCH | ENDPOINT_STRICT,
        },
    );
    h
}

/// Found writing the fuzzer's model: an ICMP error (or another ICMP type
/// the NAT leaves alone) that a pod on a secondary ENI sends outside the
/// VPC keeps the pod's address, yet left by the primary ENI, where the
/// VPC's source/destination check drops it. Like every packet leaving with
/// a pod's own address, it leaves by that pod's ENI, as the VPC CNI's
/// per-pod rule routes it.
#[test]
fn an_untranslated_icmp_message_from_a_pod_leaves_by_its_own_eni() {
    let h = harness();
    // Port unreachable about a datagram no flow of the node's knows.
    let quoted = packets::udp(INET, 5353, POD, 9, b"q");
    let unreachable = from_pod(packets::icmp_error(POD, INET, 3, 3, &quoted, 28));
    // A router solicitation: no query conntrack tracks.
    let solicitation = from_pod(packets::icmp_query(POD, INET, 10, 1, 0));
    for (sent, decision) in [
        (&unreachable, Counter::EgressIcmpErrorPass),
        (&solicitation, Counter::EgressIcmpOther),
    ] {
        // Routed by the stack out of the primary ENI.
        let steered = h.counter(Counter::EgressSteered);
        let (out, mark) = h.run_with_mark(maps::PROG_ENI_EGRESS, sent, 0);
        assert_eq!(out.action, TC_ACT_REDIRECT, "{decision:?}: out of ETH1");
        assert_eq!(mark, MARK_DECIDED);
        assert_eq!(h.counter(Counter::EgressSteered), steered + 1);
        assert_eq!(parse(&out.packet).src, POD, "{decision:?}: untranslated");
        // Past the stack, straight from the pod.
        let outside = h.counter(Counter::PodOutsideVpc);
        let (out, _) = h.run_with_mark(maps::PROG_POD_EGRESS, sent, 0);
        assert_eq!(out.action, TC_ACT_REDIRECT, "{decision:?}: out of ETH1");
        assert_eq!(h.counter(Counter::PodOutsideVpc), outside + 1);
        assert_eq!(ttl(&out.packet), ttl(sent) - 1);
        assert_eq!(parse(&out.packet).src, POD);
    }
}

#[test]
fn pod_to_pod_goes_straight_into_the_other_pod() {
    let h = harness();
    let sent = from_pod(packets::tcp(POD, 40000, POD2, 8080, TCP_SYN, b""));
    let out = h.run(maps::PROG_POD_EGRESS, &sent);
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(h.counter(Counter::PodToPod), 1);
    // Addressed from the destination pod's gateway to the pod, routed once.
    assert_eq!(&out.packet[0..6], &POD2_MAC);
    assert_eq!(&out.packet[6..12], &HOST_VETH2_MAC);
    assert_eq!(ttl(&out.packet), ttl(&sent) - 1);
    let p = parse(&out.packet);
    assert_eq!((p.src, p.sport, p.dst, p.dport), (POD, 40000, POD2, 8080));
    assert!(p.ip_csum_ok && p.l4_csum_ok, "{p:?}");
}

#[test]
fn vpc_destinations_leave_by_the_pods_own_eni() {
    let h = harness();
    let sent = from_pod(packets::udp(POD, 5000, PEER, 53, b"q"));
    let out = h.run(maps::PROG_POD_EGRESS, &sent);
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(h.counter(Counter::PodSteered), 1);
    let p = parse(&out.packet);
    assert_eq!((p.src, p.dst), (POD, PEER), "never SNATed");
    assert!(p.ip_csum_ok && p.l4_csum_ok);
    assert_eq!(ttl(&out.packet), ttl(&sent) - 1);
}

#[test]
fn services_and_node_addresses_go_to_the_stack() {
    let h = harness();
    let service = Ipv4Addr::new(10, 100, 0, 10);
    for (dst, verdict) in [
        (service, Counter::PodToService),
        (NODE, Counter::PodToLocal),
        (NODE_LOCAL_DNS, Counter::PodToLocal),
    ] {
        h.assert_untouched(
            maps::PROG_POD_EGRESS,
            &from_pod(packets::tcp(POD, 40000, dst, 80, TCP_SYN, b"")),
            verdict,
        );
    }
}

#[test]
fn the_internet_is_snated_by_the_pods_program_and_leaves_by_the_primary_eni() {
    let h = harness();
    let sent = from_pod(packets::tcp(POD, 40000, INET, 443, TCP_SYN, b""));
    let (out, mark) = h.run_with_mark(maps::PROG_POD_EGRESS, &sent, 0);
    assert_eq!(out.action, TC_ACT_REDIRECT, "past the stack");
    assert_eq!(h.counter(Counter::PodOutsideVpc), 1);
    assert_eq!(h.counter(Counter::EgressSnatNew), 1);
    let p = parse(&out.packet);
    assert_eq!((p.src, p.dst, p.dport), (NODE, INET, 443));
    assert!(p.ip_csum_ok && p.l4_csum_ok, "{p:?}");
    assert_eq!(ttl(&out.packet), ttl(&sent) - 1, "routed once");
    // The primary ENI's program passes it as it is: a second decision would
    // take the translated source for a node socket.
    assert_eq!(mark & MARK_DECIDED, MARK_DECIDED);
    let (again, mark) = h.run_with_mark(maps::PROG_ENI_EGRESS, &out.packet, mark);
    assert_eq!(again.action, TC_ACT_UNSPEC);
    assert_eq!(again.packet, out.packet, "untouched by eni_egress");
    assert_eq!(mark, 0, "the mark does not outlive the node");
    assert_eq!(h.counter(Counter::EgressDecided), 1);
    assert_eq!(h.counter(Counter::EgressHostNew), 0);
    // The flow's next packet takes the same port; the reply goes back in.
    let next = h.run(
        maps::PROG_POD_EGRESS,
        &from_pod(packets::tcp(POD, 40000, INET, 443, TCP_ACK, b"x")),
    );
    assert_eq!(parse(&next.packet).sport, p.sport);
    assert_eq!(h.counter(Counter::EgressSnat), 1);
    let reply = h.ingress(&packets::tcp(INET, 443, NODE, p.sport, TCP_ACK, b"y"));
    assert_eq!(reply.action, TC_ACT_REDIRECT);
    assert_eq!(parse(&reply.packet).dst, POD);
}

#[test]
fn with_external_snat_the_internet_leaves_un_natted_by_the_pods_own_eni() {
    let mut h = harness();
    h.configure(&SnatSettings {
        external_snat: true,
        ..SnatSettings::default()
    });
    let sent = from_pod(packets::udp(POD, 5000, INET, 53, b"q"));
    let out = h.run(maps::PROG_POD_EGRESS, &sent);
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(h.counter(Counter::PodOutsideVpc), 1);
    assert_eq!(h.counter(Counter::EgressExternalSnatNew), 1);
    let p = parse(&out.packet);
    assert_eq!((p.src, p.sport), (POD, 5000), "never SNATed");
    assert_eq!(ttl(&out.packet), ttl(&sent) - 1);
}

#[test]
fn a_pods_icmp_error_about_a_natted_flow_leaves_by_the_primary_eni_translated() {
    let h = harness();
    let sent = h.run(
        maps::PROG_POD_EGRESS,
        &from_pod(packets::udp(POD, 5000, INET, 9999, b"hello")),
    );
    let nat_port = parse(&sent.packet).sport;
    let reply = h
        .ingress(&packets::udp(INET, 9999, NODE, nat_port, b"late"))
        .packet;
    // The pod has no socket any more: port unreachable, about the reply.
    let unreach = from_pod(packets::icmp_error(POD, INET, 3, 3, &reply, 1000));
    let out = h.run(maps::PROG_POD_EGRESS, &unreach);
    // From the node's address, the stack would drop it (a martian source):
    // it goes straight out, like the flow's own packets.
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(parse(&out.packet).src, NODE);
    assert_eq!(h.counter(Counter::EgressIcmpErrorNat), 1);
    assert_eq!(h.counter(Counter::PodOutsideVpc), 2);
}

#[test]
fn portless_protocols_to_the_internet_are_snated_and_sent_out() {
    let h = harness();
    let mut gre = from_pod(packets::udp(POD, 5000, INET, 53, b"q"));
    gre[14 + 9] = 47;
    gre[14 + 10] = 0;
    gre[14 + 11] = 0;
    let csum = packets::internet_checksum(&[&gre[14..34]]);
    gre[14 + 10..14 + 12].copy_from_slice(&csum.to_be_bytes());
    let (out, mark) = h.run_with_mark(maps::PROG_POD_EGRESS, &gre, 0);
    // Translated by address, as the SNAT chain does, and sent out of the
    // primary ENI like any SNATed packet.
    assert_eq!(out.action, TC_ACT_REDIRECT);
    let sent = parse(&out.packet);
    assert_eq!((sent.src, sent.dst, sent.proto), (NODE, INET, 47));
    assert!(sent.ip_csum_ok);
    assert_eq!(h.counter(Counter::EgressSnatNew), 1);
    assert_eq!(h.counter(Counter::PodOutsideVpc), 1);
    assert_eq!(mark & MARK_DECIDED, MARK_DECIDED);
}

#[test]
fn replies_of_flows_that_came_through_the_stack_go_back_through_it() {
    let h = harness();
    // kube-proxy DNATed a NodePort connection from peer to POD: the stack
    // hands it to the pod.
    h.assert_untouched(
        maps::PROG_POD_INGRESS,
        &packets::tcp(PEER, 51000, POD, 8080, TCP_SYN, b""),
        Counter::PodIngressStack,
    );
    // The pod's reply must be un-DNATed by the stack, not fast-pathed.
    h.assert_untouched(
        maps::PROG_POD_EGRESS,
        &from_pod(packets::tcp(POD, 8080, PEER, 51000, TCP_SYN | TCP_ACK, b"")),
        Counter::PodStackFlow,
    );
    // Another flow to the same peer is not.
    let out = h.run(
        maps::PROG_POD_EGRESS,
        &from_pod(packets::tcp(POD, 8081, PEER, 51000, TCP_ACK, b"")),
    );
    assert_eq!(out.action, TC_ACT_REDIRECT);
}

#[test]
fn stack_flows_are_pairs_that_live_as_long_as_their_connection() {
    let mut h = harness();
    let to_pod = |flags, numbers| packets::tcp_seq(PEER, 51000, POD, 8080, flags, numbers, b"");
    let from_pod_with = |flags, numbers| {
        from_pod(packets::tcp_seq(
            POD, 8080, PEER, 51000, flags, numbers, b"",
        ))
    };
    h.run(maps::PROG_POD_INGRESS, &to_pod(TCP_SYN, (100, 0)));
    h.run(
        maps::PROG_POD_EGRESS,
        &from_pod_with(TCP_SYN | TCP_ACK, (500, 101)),
    );
    h.run(maps::PROG_POD_INGRESS, &to_pod(TCP_ACK, (101, 501)));
    let pairs: Vec<_> = h.datapath.maps.stack_flows.iter().flatten().collect();
    assert_eq!(pairs.len(), 2, "one flow, two halves: {pairs:?}");
    let collect_after = |h: &mut Harness, seconds: u64| {
        h.datapath
            .maps
            .collect_stack_flows(&DEFAULT_TIMEOUTS, monotonic_now_ns() + seconds * NS_PER_SEC)
            .unwrap()
    };
    // Idle for an hour: an established connection lives on, whatever
    // came since.
    let stats = collect_after(&mut h, 3600);
    assert_eq!((stats.flows, stats.expired), (1, 0), "{stats:?}");
    // Closed by both sides: gone after TIME_WAIT, both halves.
    h.run(
        maps::PROG_POD_EGRESS,
        &from_pod_with(TCP_FIN | TCP_ACK, (501, 101)),
    );
    h.run(
        maps::PROG_POD_INGRESS,
        &to_pod(TCP_FIN | TCP_ACK, (101, 502)),
    );
    h.run(maps::PROG_POD_EGRESS, &from_pod_with(TCP_ACK, (502, 102)));
    let stats = collect_after(&mut h, 60);
    assert_eq!(stats.expired, 0, "still in TIME_WAIT: {stats:?}");
    let stats = collect_after(&mut h, 122);
    assert_eq!(stats.expired, 1, "{stats:?}");
    assert_eq!(h.datapath.maps.stack_flows.keys().count(), 0);
}

#[test]
fn a_pod_cannot_send_with_another_address_or_mac() {
    let h = harness();
    // An address that is no pod's.
    let mut spoofed = from_pod(packets::tcp(
        Ipv4Addr::new(10, 20, 11, 99),
        1,
        PEER,
        80,
        TCP_SYN,
        b"",
    ));
    h.assert_dropped(maps::PROG_POD_EGRESS, &spoofed, Counter::DropSpoofedAddr);
    // Another local pod's address (its veth is not this one).
    spoofed = from_pod(packets::tcp(POD2, 1, PEER, 80, TCP_SYN, b""));
    h.assert_dropped(maps::PROG_POD_EGRESS, &spoofed, Counter::DropSpoofedAddr);
    // Its own address with another MAC.
    let mut wrong_mac = packets::tcp(POD, 1, PEER, 80, TCP_SYN, b"");
    wrong_mac[6..12].copy_from_slice(&[0x02, 0xde, 0xad, 0xbe, 0xef, 0x01]);
    h.assert_dropped(maps::PROG_POD_EGRESS, &wrong_mac, Counter::DropSpoofedMac);
    // Malformed and truncated packets are dropped and counted too.
    let mut bad = from_pod(packets::tcp(POD, 1, PEER, 80, TCP_SYN, b""));
    bad[14] = 0x44;
    h.assert_dropped(maps::PROG_POD_EGRESS, &bad, Counter::DropMalformed);
    let cut = from_pod(packets::tcp(POD, 1, POD2, 80, TCP_SYN, b""));
    h.assert_dropped(
        maps::PROG_POD_EGRESS,
        &cut[..14 + 20 + 6],
        Counter::DropTruncated,
    );
    // ARP and other non-IPv4 frames pass.
    let mut arp = vec![0xffu8; 6];
    arp.extend_from_slice(&POD_MAC);
    arp.extend_from_slice(&0x0806u16.to_be_bytes());
    arp.extend_from_slice(&[0u8; 28]);
    h.assert_untouched(maps::PROG_POD_EGRESS, &arp, Counter::PodNotIpv4);
}

#[test]
fn strict_security_group_pods_use_their_branch_eni_for_everything() {
    let h = strict_harness();
    for dst in [POD2, PEER, INET, NODE] {
        let out = h.run(
            maps::PROG_POD_EGRESS,
            &from_pod(packets::tcp(POD, 40000, dst, 80, TCP_SYN, b"")),
        );
        assert_eq!(out.action, TC_ACT_REDIRECT, "to {dst}");
        assert_eq!(parse(&out.packet).src, POD, "never SNATed");
    }
    assert_eq!(h.counter(Counter::PodStrict), 4);
    assert_eq!(h.counter(Counter::PodToPod), 0);
}

#[test]
fn local_pods_reach_a_strict_pod_through_the_vpc() {
    let mut h = harness();
    h.add_eni(BRANCH, GATEWAY, 0);
    h.add_endpoint(
        POD2,
        &Endpoint {
            ifindex: 2002,
            eni_ifindex: BRANCH,
            mac: POD2_MAC,
            host_mac: HOST_VETH2_MAC,
            flags: ENDPOINT_BRANCH | ENDPOINT_STRICT,
        },
    );
    let out = h.run(
        maps::PROG_POD_EGRESS,
        &from_pod(packets::tcp(POD, 40000, POD2, 80, TCP_SYN, b"")),
    );
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(h.counter(Counter::PodSteered), 1);
    assert_eq!(h.counter(Counter::PodToPod), 0);
    // And from an ENI that is not its branch, the stack gets it.
    h.assert_ingress_untouched(
        &packets::tcp(PEER, 80, POD2, 40000, TCP_SYN, b""),
        Counter::IngressNotNode,
    );
}

#[test]
fn an_expiring_ttl_is_left_to_the_stack() {
    let h = harness();
    let mut last_hop = from_pod(packets::tcp(POD, 40000, PEER, 80, TCP_SYN, b""));
    last_hop[14 + 8] = 1;
    last_hop[14 + 10] = 0;
    last_hop[14 + 11] = 0;
    let csum = packets::internet_checksum(&[&last_hop[14..34]]);
    last_hop[14 + 10..14 + 12].copy_from_slice(&csum.to_be_bytes());
    h.assert_untouched(maps::PROG_POD_EGRESS, &last_hop, Counter::TtlToStack);
    // To the internet too, and before the NAT: the stack's time exceeded
    // must reach the pod, not the node.
    last_hop[14 + 16..14 + 20].copy_from_slice(&INET.octets());
    last_hop[14 + 10] = 0;
    last_hop[14 + 11] = 0;
    let csum = packets::internet_checksum(&[&last_hop[14..34]]);
    last_hop[14 + 10..14 + 12].copy_from_slice(&csum.to_be_bytes());
    h.assert_untouched(maps::PROG_POD_EGRESS, &last_hop, Counter::PodToSnat);
    assert_eq!(h.counter(Counter::EgressSnatNew), 0, "no flow made");
}

#[test]
fn enis_deliver_local_pods_straight_into_them() {
    let h = harness();
    let inbound = packets::tcp(PEER, 51000, POD2, 8080, TCP_SYN, b"");
    let out = h.ingress(&inbound);
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(h.counter(Counter::IngressToPod), 1);
    assert_eq!(&out.packet[0..6], &POD2_MAC);
    assert_eq!(&out.packet[6..12], &HOST_VETH2_MAC);
    assert_eq!(ttl(&out.packet), ttl(&inbound) - 1);
    assert!(parse(&out.packet).ip_csum_ok);

    // A reply of a SNATed flow: translated back, then straight in.
    let sent = h.egress(&packets::tcp(POD2, 40000, INET, 443, TCP_SYN, b""));
    let nat_port = parse(&sent.packet).sport;
    let reply = h.ingress(&packets::tcp(
        INET,
        443,
        NODE,
        nat_port,
        TCP_SYN | TCP_ACK,
        b"",
    ));
    assert_eq!(reply.action, TC_ACT_REDIRECT);
    let p = parse(&reply.packet);
    assert_eq!((p.dst, p.dport), (POD2, 40000));
    assert!(p.ip_csum_ok && p.l4_csum_ok);
    assert_eq!(&reply.packet[0..6], &POD2_MAC);
    assert_eq!(h.counter(Counter::IngressRevSnat), 1);
    assert_eq!(h.counter(Counter::IngressToPod), 2);
}

#[test]
fn stack_traffic_from_a_pod_on_another_eni_is_steered_to_it() {
    let h = harness();
    // POD's address belongs to ETH1; the stack sent its packet out of the
    // test run's device (as the main table sends everything out of eth0).
    let sent = packets::tcp(POD, 40000, PEER, 80, TCP_ACK, b"x");
    let out = h.egress(&sent);
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(h.counter(Counter::EgressSteered), 1);
    assert_eq!(h.counter(Counter::EgressNoSnatCidr), 1);
    assert_eq!(ttl(&out.packet), ttl(&sent), "the stack routed it already");
    // POD2 is on this very ENI: left alone.
    h.assert_egress_untouched(
        &packets::tcp(POD2, 40000, PEER, 80, TCP_ACK, b"x"),
        Counter::EgressNoSnatCidr,
    );
    // SNATed traffic is not steered: it leaves by the primary ENI.
    let out = h.egress(&packets::tcp(POD, 40001, INET, 80, TCP_SYN, b""));
    assert_eq!(out.action, TC_ACT_UNSPEC);
    assert_eq!(parse(&out.packet).src, NODE);
}

#[test]
fn a_pod_on_an_eni_missing_from_the_map_is_dropped_and_counted() {
    let mut h = harness();
    h.add_endpoint(
        POD,
        &Endpoint {
            ifindex: TEST_RUN_IFINDEX,
            eni_ifindex: 4242,
            mac: POD_MAC,
            host_mac: HOST_VETH_MAC,
            flags: 0,
        },
    );
    h.assert_dropped(
        maps::PROG_POD_EGRESS,
        &from_pod(packets::tcp(POD, 40000, PEER, 80, TCP_SYN, b"")),
        Counter::DropNoEni,
    );
}

#[test]
fn nothing_leaving_by_a_branch_eni_is_snated() {
    let mut h = harness();
    // The test run's device is a branch ENI's link here, and POD's own.
    h.add_eni(
        TEST_RUN_IFINDEX,
        GATEWAY,
        vpcnet_common::endpoint::ENI_BRANCH,
    );
    h.add_endpoint(
        POD,
        &Endpoint {
            ifindex: 3003,
            eni_ifindex: TEST_RUN_IFINDEX,
            mac: POD_MAC,
            host_mac: HOST_VETH_MAC,
            flags: ENDPOINT_BRANCH | ENDPOINT_STRICT,
        },
    );
    for dst in [INET, vpcnet_bpf_tests::ONPREM] {
        h.assert_egress_untouched(
            &packets::tcp(POD, 40000, dst, 80, TCP_SYN, b""),
            Counter::EgressBranchNoSnat,
        );
    }
    assert_eq!(h.table_sizes(), (0, 0));
}

#[test]
fn an_untranslated_service_address_at_the_eni_is_snated_like_any_other() {
    let h = harness();
    let out = h.egress(&packets::tcp(
        POD2,
        40000,
        Ipv4Addr::new(10, 100, 0, 10),
        80,
        TCP_SYN,
        b"",
    ));
    assert_eq!(out.action, TC_ACT_UNSPEC);
    assert_eq!(parse(&out.packet).src, NODE);
}

#[test]
fn replies_of_a_pods_service_flow_go_back_through_the_stack() {
    use vpcnet_common::config::MARK_VIA_SERVICE;
    let h = harness();
    // The pod asks a service: to the stack, marked.
    let (out, mark) = h.run_with_mark(
        maps::PROG_POD_EGRESS,
        &from_pod(packets::udp(
            POD,
            5000,
            Ipv4Addr::new(10, 100, 0, 10),
            80,
            b"q",
        )),
        0,
    );
    assert_eq!(out.action, TC_ACT_UNSPEC);
    assert_eq!(mark & MARK_VIA_SERVICE, MARK_VIA_SERVICE);
    // kube-proxy DNATed it to PEER:8080; the ENI remembers the flow and the
    // mark does not leave the node.
    let (out, mark) = h.run_with_mark(
        maps::PROG_ENI_EGRESS,
        &packets::udp(POD, 5000, PEER, 8080, b"q"),
        MARK_VIA_SERVICE | 0x4000,
    );
    assert_eq!(out.action, TC_ACT_REDIRECT, "steered out of POD's own ENI");
    assert_eq!(
        mark,
        0x4000 | MARK_DECIDED,
        "the service bit is cleared, the ENI it goes to passes it"
    );
    assert_eq!(h.counter(Counter::EgressServiceFlow), 1);
    // PEER's reply is for the stack (to be un-DNATed), not for the pod.
    h.assert_ingress_untouched(
        &packets::udp(PEER, 8080, POD, 5000, b"a"),
        Counter::IngressStackFlow,
    );
    // Another flow from PEER to the pod is delivered straight.
    let out = h.ingress(&packets::udp(PEER, 8081, POD, 5000, b"a"));
    assert_eq!(out.action, TC_ACT_REDIRECT);
}

#[test]
fn strict_pods_reach_services_through_the_stack_and_are_never_snated() {
    let h = strict_harness();
    let (out, mark) = h.run_with_mark(
        maps::PROG_POD_EGRESS,
        &from_pod(packets::tcp(
            POD,
            40000,
            Ipv4Addr::new(10, 100, 0, 10),
            80,
            TCP_SYN,
            b"",
        )),
        0,
    );
    assert_eq!(out.action, TC_ACT_UNSPEC, "to the stack for the DNAT");
    assert_ne!(mark & vpcnet_common::config::MARK_VIA_SERVICE, 0);
    // DNATed to an address outside the VPC and routed out of the primary
    // ENI: not SNATed, sent to the branch ENI.
    let out = h.egress(&packets::tcp(POD, 40000, INET, 80, TCP_SYN, b""));
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(parse(&out.packet).src, POD);
    assert_eq!(h.counter(Counter::EgressBranchNoSnat), 1);
    assert_eq!(h.counter(Counter::EgressSteered), 1);
}

/// `AWS_EXTERNAL_SERVICE_CIDRS`: a pod on a secondary ENI reaches them by
/// the node's route (aws-node's rule 1535: the main table), so its packet
/// goes to the stack, marked for the replies to come back through it, and
/// the primary ENI's program leaves it there instead of steering it to the
/// pod's ENI; any other destination is as before, and so is a pod whose
/// ENI is the primary.
#[test]
fn external_service_cidrs_take_the_nodes_route_instead_of_the_pods_eni() {
    use vpcnet_common::config::MARK_VIA_SERVICE;
    let mut h = harness();
    h.datapath
        .maps
        .set_external_service_cidrs(&[
            "10.20.12.0/24".parse().unwrap(),
            "203.0.113.0/24".parse().unwrap(),
        ])
        .unwrap();
    for (dst, after_stack) in [
        (PEER, Counter::EgressNoSnatCidr),
        (INET, Counter::EgressSnatNew),
    ] {
        let sent = from_pod(packets::udp(POD, 5000, dst, 53, b"q"));
        let (out, mark) = h.run_with_mark(maps::PROG_POD_EGRESS, &sent, 0);
        assert_eq!(out.action, TC_ACT_UNSPEC, "{dst}: to the stack");
        assert_eq!(out.packet, sent, "{dst}: untouched");
        assert_eq!(
            mark & MARK_VIA_SERVICE,
            MARK_VIA_SERVICE,
            "{dst}: replies through the stack"
        );
        // The stack routes it out of the primary ENI, the test run's device.
        let steered = h.counter(Counter::EgressSteered);
        let (out, _) = h.run_with_mark(maps::PROG_ENI_EGRESS, &sent, mark);
        assert_eq!(
            out.action, TC_ACT_UNSPEC,
            "{dst}: left on the stack's route"
        );
        assert_eq!(
            h.counter(Counter::EgressSteered),
            steered,
            "{dst}: not steered"
        );
        assert_eq!(h.counter(after_stack), 1, "{dst}: {after_stack:?}");
    }
    assert_eq!(h.counter(Counter::PodExternalService), 2);
    assert_eq!(
        h.counter(Counter::EgressExternalService),
        1,
        "the un-NATed one"
    );
    assert_eq!(h.counter(Counter::EgressServiceFlow), 2, "both remembered");
    // Another VPC address leaves by the pod's own ENI, as before.
    let other = Ipv4Addr::new(10, 20, 13, 5);
    let out = h.run(
        maps::PROG_POD_EGRESS,
        &from_pod(packets::udp(POD, 5000, other, 53, b"q")),
    );
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(h.counter(Counter::PodSteered), 1);
    // A pod on the primary ENI leaves by it straight, past the stack.
    h.add_endpoint(
        POD,
        &Endpoint {
            ifindex: TEST_RUN_IFINDEX,
            eni_ifindex: TEST_RUN_IFINDEX,
            mac: POD_MAC,
            host_mac: HOST_VETH_MAC,
            flags: 0,
        },
    );
    let out = h.run(
        maps::PROG_POD_EGRESS,
        &from_pod(packets::udp(POD, 5001, PEER, 53, b"q")),
    );
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(h.counter(Counter::PodSteered), 2);
    assert_eq!(h.counter(Counter::PodExternalService), 2);
    // The agent's table, read back.
    assert_eq!(
        h.datapath.maps.external_service_cidrs().unwrap(),
        [
            "10.20.12.0/24".parse::<ipnet::Ipv4Net>().unwrap(),
            "203.0.113.0/24".parse().unwrap()
        ]
    );
}
