//! Every verdict of both programs on crafted packets, checked byte by byte:
//! addresses, ports, IP and L4 checksums (verified independently).

use std::net::Ipv4Addr;

use vpcnet_agent::snat::SnatSettings;
use vpcnet_bpf_tests::{
    Harness, INET, NODE, NODE_LOCAL_DNS, ONPREM, PEER, POD, POD2, TC_ACT_REDIRECT, TC_ACT_UNSPEC,
    packets::{self, Parsed, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN, parse, parse_quoted},
};
use vpcnet_common::{
    config::RandomizeMode,
    counters::Counter,
    maps,
    nat::{FlowKind, FlowState},
};

fn settings(f: impl FnOnce(&mut SnatSettings)) -> SnatSettings {
    let mut s = SnatSettings::default();
    f(&mut s);
    s
}

fn assert_checksums(p: &Parsed) {
    assert!(p.ip_csum_ok, "IP checksum wrong: {p:?}");
    assert!(p.l4_csum_ok, "L4 checksum wrong: {p:?}");
}

/// Sends `packet` out and returns what left, asserting it passed.
fn egress_pass(h: &Harness, packet: &[u8]) -> Parsed {
    let out = h.egress(packet);
    assert_eq!(out.action, TC_ACT_UNSPEC);
    let p = parse(&out.packet);
    assert_checksums(&p);
    p
}

fn ingress_pass(h: &Harness, packet: &[u8]) -> Parsed {
    let out = h.ingress(packet);
    assert_eq!(out.action, TC_ACT_UNSPEC);
    let p = parse(&out.packet);
    assert_checksums(&p);
    p
}

#[test]
fn tcp_to_internet_is_snated_and_replies_come_back() {
    let h = Harness::lab_default();
    let syn = egress_pass(&h, &packets::tcp(POD, 40000, INET, 80, TCP_SYN, b""));
    assert_eq!((syn.src, syn.dst, syn.dport), (NODE, INET, 80));
    assert!(
        syn.sport >= 1024,
        "port from the default range: {}",
        syn.sport
    );
    assert_eq!(h.counter(Counter::EgressSnatNew), 1);

    // The reply goes back to the pod's own address and port.
    let synack = ingress_pass(
        &h,
        &packets::tcp(INET, 80, NODE, syn.sport, TCP_SYN | TCP_ACK, b""),
    );
    assert_eq!(
        (synack.src, synack.sport, synack.dst, synack.dport),
        (INET, 80, POD, 40000)
    );
    assert_eq!(h.counter(Counter::IngressRevSnat), 1);

    // Later packets of the flow keep the same translation, payload and all.
    let data = egress_pass(
        &h,
        &packets::tcp(POD, 40000, INET, 80, TCP_ACK, b"GET / HTTP/1.0\r\n\r\n"),
    );
    assert_eq!((data.src, data.sport), (NODE, syn.sport));
    assert_eq!(h.counter(Counter::EgressSnat), 1);
    assert_eq!(h.table_sizes(), (1, 1), "one flow, one pair");
}

#[test]
fn udp_is_snated_and_a_zero_checksum_stays_zero() {
    let h = Harness::lab_default();
    let out = egress_pass(&h, &packets::udp(POD, 5353, INET, 53, b"query"));
    assert_eq!((out.src, out.dst, out.dport), (NODE, INET, 53));
    let back = ingress_pass(&h, &packets::udp(INET, 53, NODE, out.sport, b"answer"));
    assert_eq!((back.dst, back.dport), (POD, 5353));

    let mut no_csum = packets::udp(POD, 5354, INET, 53, b"q");
    no_csum[14 + 20 + 6] = 0;
    no_csum[14 + 20 + 7] = 0;
    let out = h.egress(&no_csum);
    assert_eq!(
        out.packet[14 + 20 + 6..14 + 20 + 8],
        [0, 0],
        "UDP without checksum keeps none"
    );
    assert_eq!(parse(&out.packet).src, NODE);
    assert!(parse(&out.packet).ip_csum_ok);
}

#[test]
fn icmp_echo_identifier_is_the_port() {
    let h = Harness::lab_default();
    let req = egress_pass(&h, &packets::icmp_echo(POD, INET, true, 77, 1));
    assert_eq!((req.src, req.dst), (NODE, INET));
    let reply = ingress_pass(&h, &packets::icmp_echo(INET, NODE, false, req.sport, 1));
    assert_eq!((reply.dst, reply.dport), (POD, 77));
    // An echo reply that answers nothing of ours is left alone.
    h.assert_ingress_untouched(
        &packets::icmp_echo(INET, NODE, false, 9, 1),
        Counter::IngressNoEntry,
    );
}

/// The other queries conntrack tracks as flows, as echo is: timestamp,
/// information and address mask, each request's identifier the port its
/// reply comes back to.
#[test]
fn icmp_timestamp_information_and_address_mask_queries_are_translated() {
    let h = Harness::lab_default();
    for (request, reply, body) in [(13, 14, 12), (15, 16, 0), (17, 18, 4)] {
        let id = 700 + u16::from(request);
        let asked = egress_pass(&h, &packets::icmp_query(POD, INET, request, id, body));
        assert_eq!(
            (asked.src, asked.dst),
            (NODE, INET),
            "type {request} leaves as the node"
        );
        let answered = ingress_pass(
            &h,
            &packets::icmp_query(INET, NODE, reply, asked.sport, body),
        );
        assert_eq!(
            (answered.dst, answered.dport),
            (POD, id),
            "type {reply} comes back to the pod"
        );
    }
    assert_eq!(h.table_sizes(), (3, 3), "a flow for each");
}

#[test]
fn vpc_excluded_and_local_destinations_are_never_snated() {
    let onprem_excluded =
        settings(|s| s.exclude_snat_cidrs = vec!["192.0.2.0/24".parse().unwrap()]);
    let h = Harness::new(&onprem_excluded, maps::NAT_DEFAULT_ENTRIES);
    h.assert_egress_untouched(
        &packets::tcp(POD, 40000, PEER, 80, TCP_SYN, b""),
        Counter::EgressNoSnatCidr,
    );
    h.assert_egress_untouched(
        &packets::tcp(POD, 40000, Ipv4Addr::new(100, 64, 3, 4), 80, TCP_SYN, b""),
        Counter::EgressNoSnatCidr,
    );
    h.assert_egress_untouched(
        &packets::udp(POD, 40000, ONPREM, 53, b"q"),
        Counter::EgressNoSnatCidr,
    );
    h.assert_egress_untouched(
        &packets::udp(POD, 40000, NODE_LOCAL_DNS, 53, b"q"),
        Counter::EgressLocal,
    );
    assert_eq!(
        h.table_sizes(),
        (0, 0),
        "no state for flows that are never translated"
    );

    // Without the exclusion, on-prem is SNATed like the internet.
    let h = Harness::lab_default();
    assert_eq!(
        egress_pass(&h, &packets::udp(POD, 40000, ONPREM, 53, b"q")).src,
        NODE
    );
}

#[test]
fn packets_that_open_no_flow_are_not_translated() {
    let h = Harness::lab_default();
    for flags in [
        TCP_SYN | TCP_ACK,
        TCP_RST,
        TCP_FIN | TCP_ACK,
        TCP_RST | TCP_ACK,
    ] {
        h.assert_egress_untouched(
            &packets::tcp(POD, 40000, INET, 80, flags, b""),
            Counter::EgressNotOpening,
        );
    }
    h.assert_egress_untouched(
        &packets::icmp_echo(POD, INET, false, 5, 1),
        Counter::EgressNotOpening,
    );
    // A bare ACK opens a flow (picked up mid-stream, like netfilter's loose mode).
    assert_eq!(
        egress_pass(&h, &packets::tcp(POD, 40001, INET, 80, TCP_ACK, b"x")).src,
        NODE
    );
}

#[test]
fn portless_protocols_are_snated_by_address_one_flow_per_remote() {
    let h = Harness::lab_default();
    // GRE (no ports): the source becomes the node's, the payload stays.
    let gre_header = [0u8, 0, 0x08, 0, 1, 2, 3, 4];
    let out = h.egress(&packets::ipv4_frame(POD, INET, 47, &gre_header, &[]));
    assert_eq!(out.action, TC_ACT_UNSPEC);
    let sent = parse(&out.packet);
    assert_eq!((sent.src, sent.dst, sent.proto), (NODE, INET, 47));
    assert!(sent.ip_csum_ok);
    assert_eq!(&out.packet[out.packet.len() - 8..], &gre_header);
    assert_eq!(h.counter(Counter::EgressSnatNew), 1);
    // The remote's GRE back to the node address goes to the pod.
    let back = h.ingress(&packets::ipv4_frame(INET, NODE, 47, &gre_header, &[]));
    let back_parsed = parse(&back.packet);
    assert_eq!((back_parsed.src, back_parsed.dst), (INET, POD));
    assert!(back_parsed.ip_csum_ok);
    // The node address carries one GRE flow per remote: a second pod's to
    // the same remote is dropped (the chain's SNAT could not tell their
    // replies apart either), one to another remote is not.
    let second = h.egress(&packets::ipv4_frame(POD2, INET, 47, &gre_header, &[]));
    assert_eq!(second.action, vpcnet_bpf_tests::TC_ACT_SHOT);
    assert_eq!(h.counter(Counter::DropNatNoPort), 1);
    let elsewhere = egress_pass_l3(&h, &packets::ipv4_frame(POD2, ONPREM, 47, &gre_header, &[]));
    assert_eq!(elsewhere.src, NODE);
    // ESP and SCTP alike.
    for proto in [50, 132] {
        let out = egress_pass_l3(&h, &packets::ipv4_frame(POD, INET, proto, &[0u8; 12], &[]));
        assert_eq!((out.src, out.proto), (NODE, proto));
    }
}

/// Like [`egress_pass`], for a protocol whose checksum does not cover the
/// addresses.
fn egress_pass_l3(h: &Harness, packet: &[u8]) -> Parsed {
    let out = h.egress(packet);
    assert_eq!(out.action, TC_ACT_UNSPEC);
    let p = parse(&out.packet);
    assert!(p.ip_csum_ok, "IP checksum wrong: {p:?}");
    p
}

#[test]
fn icmp_types_other_than_queries_and_errors_pass_untouched() {
    let h = Harness::lab_default();
    // A router solicitation: no query conntrack tracks.
    h.assert_egress_untouched(
        &packets::icmp_query(POD, INET, 10, 1, 0),
        Counter::EgressIcmpOther,
    );
    let mut arp = vec![0xffu8; 12];
    arp.extend_from_slice(&0x0806u16.to_be_bytes());
    arp.extend_from_slice(&[0u8; 28]);
    h.assert_egress_untouched(&arp, Counter::EgressNotIpv4);
    h.assert_ingress_untouched(&arp, Counter::IngressNotIpv4);
    // Ingress: traffic for a pod from inside the VPC is not ours to touch.
    h.assert_ingress_untouched(
        &packets::tcp(PEER, 80, POD, 40000, TCP_SYN, b""),
        Counter::IngressNotNode,
    );
    // Ingress: to the node but no flow of ours (e.g. kubelet's port).
    h.assert_ingress_untouched(
        &packets::tcp(INET, 5000, NODE, 10250, TCP_SYN, b""),
        Counter::IngressNoEntry,
    );
}

#[test]
fn unconfigured_datapath_passes_everything() {
    let mut h = Harness::lab_default();
    h.datapath
        .maps
        .set_config(&vpcnet_common::config::Config::default())
        .unwrap();
    h.assert_egress_untouched(
        &packets::tcp(POD, 40000, INET, 80, TCP_SYN, b""),
        Counter::EgressUnconfigured,
    );
}

#[test]
fn truncated_and_malformed_headers_are_dropped_and_counted() {
    let h = Harness::lab_default();
    let syn = packets::tcp(POD, 40000, INET, 80, TCP_SYN, b"");
    // (BPF_PROG_TEST_RUN refuses frames shorter than an IPv4 header, so a
    // header cut inside its first 20 bytes cannot be fed here.) IP options
    // announced (IHL 15) but cut short: no L4 header where it should be.
    let mut cut_options = syn[..14 + 20 + 8].to_vec();
    cut_options[14] = 0x4f;
    h.assert_dropped(maps::PROG_ENI_EGRESS, &cut_options, Counter::DropTruncated);
    // TCP header cut before the flags.
    h.assert_dropped(
        maps::PROG_ENI_EGRESS,
        &syn[..14 + 20 + 10],
        Counter::DropTruncated,
    );
    let reply = packets::tcp(INET, 80, NODE, 40000, TCP_ACK, b"");
    h.assert_dropped(
        maps::PROG_ENI_INGRESS,
        &reply[..14 + 20 + 3],
        Counter::DropTruncated,
    );
    // IHL below 5.
    let mut bad_ihl = syn.clone();
    bad_ihl[14] = 0x43;
    h.assert_dropped(maps::PROG_ENI_EGRESS, &bad_ihl, Counter::DropMalformed);
    // IPv6 version nibble under the IPv4 ethertype.
    let mut bad_version = syn.clone();
    bad_version[14] = 0x65;
    h.assert_dropped(maps::PROG_ENI_INGRESS, &bad_version, Counter::DropMalformed);
    assert_eq!(h.table_sizes(), (0, 0), "nothing created from a bad packet");
}

/// Found writing the fuzzer's model: a TCP header cut between its flags and its
/// checksum made a NAT flow, then the packet was dropped when the checksum
/// could not be rewritten; a pod could fill the table with such flows.
#[test]
fn fuzz_an_l4_header_cut_short_makes_no_flow() {
    let h = Harness::lab_default();
    let syn = packets::tcp(POD, 40000, INET, 80, TCP_SYN, b"");
    // Flags there, checksum not.
    h.assert_dropped(
        maps::PROG_ENI_EGRESS,
        &syn[..14 + 20 + 16],
        Counter::DropTruncated,
    );
    let udp = packets::udp(POD, 5353, INET, 53, b"");
    // Ports there, checksum not.
    h.assert_dropped(
        maps::PROG_ENI_EGRESS,
        &udp[..14 + 20 + 6],
        Counter::DropTruncated,
    );
    let inbound = packets::tcp(INET, 80, POD, 40000, TCP_SYN, b"");
    h.assert_dropped(
        maps::PROG_ENI_INGRESS,
        &inbound[..14 + 20 + 19],
        Counter::DropTruncated,
    );
    assert_eq!(h.table_sizes(), (0, 0), "no flow for a dropped packet");
    assert_eq!(h.counter(Counter::DropRewrite), 0);
}

/// Found writing the fuzzer's model: `eni_egress` parsed any frame carrying the
/// service mark bit as IPv4, and dropped an ARP frame (say) whose mark
/// had that bit from someone else's use of the mark.
#[test]
fn fuzz_the_service_mark_on_a_frame_other_than_ipv4_passes_it() {
    let h = Harness::lab_default();
    let mut arp = vec![0xff; 6];
    arp.extend_from_slice(&[0x02, 0, 0, 0, 0, 1, 0x08, 0x06]);
    arp.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
    arp.extend_from_slice(&[0u8; 20]);
    let (out, mark) = h.run_with_mark(
        maps::PROG_ENI_EGRESS,
        &arp,
        vpcnet_common::config::MARK_VIA_SERVICE | 0x4000,
    );
    assert_eq!(out.action, TC_ACT_UNSPEC, "passed, not dropped");
    assert_eq!(out.packet, arp, "untouched");
    assert_eq!(mark, 0x4000, "the service bit cleared, the others kept");
    assert_eq!(h.counter(Counter::EgressNotIpv4), 1);
    assert_eq!(h.counter(Counter::DropMalformed), 0);
}

#[test]
fn ip_options_shift_the_l4_header_and_are_handled() {
    let h = Harness::lab_default();
    // A UDP datagram behind 8 bytes of options (NOPs and an end).
    let mut udp = vec![0u8; 8];
    udp[0..2].copy_from_slice(&4444u16.to_be_bytes());
    udp[2..4].copy_from_slice(&53u16.to_be_bytes());
    udp[4..6].copy_from_slice(&8u16.to_be_bytes());
    let pseudo = [
        &POD.octets()[..],
        &INET.octets(),
        &[0, 17],
        &8u16.to_be_bytes(),
    ]
    .concat();
    let csum = packets::internet_checksum(&[&pseudo, &udp]);
    udp[6..8].copy_from_slice(&csum.to_be_bytes());
    let frame = packets::ipv4_frame(POD, INET, 17, &udp, &[1, 1, 1, 1, 1, 1, 1, 0]);
    assert_checksums(&parse(&frame));
    let out = egress_pass(&h, &frame);
    assert_eq!((out.src, out.dport), (NODE, 53));
    let options_kept = h.egress(&frame).packet[14 + 20..14 + 28].to_vec();
    assert_eq!(options_kept, [1, 1, 1, 1, 1, 1, 1, 0]);
}

#[test]
fn external_snat_flag_applies_to_new_flows_and_never_breaks_running_ones() {
    let mut h = Harness::lab_default();
    let natted = egress_pass(&h, &packets::tcp(POD, 41000, INET, 443, TCP_SYN, b""));
    assert_eq!(natted.src, NODE);

    h.configure(&settings(|s| s.external_snat = true));
    // The NATed flow finishes as it started.
    assert_eq!(
        egress_pass(&h, &packets::tcp(POD, 41000, INET, 443, TCP_ACK, b"x")).sport,
        natted.sport
    );
    // A new flow leaves un-NATed, and is remembered as such.
    h.assert_egress_untouched(
        &packets::tcp(POD, 42000, INET, 443, TCP_SYN, b""),
        Counter::EgressExternalSnatNew,
    );

    h.configure(&SnatSettings::default());
    h.assert_egress_untouched(
        &packets::tcp(POD, 42000, INET, 443, TCP_ACK, b"y"),
        Counter::EgressUntranslated,
    );
    // New flows are NATed again.
    assert_eq!(
        egress_pass(&h, &packets::tcp(POD, 43000, INET, 443, TCP_SYN, b"")).src,
        NODE
    );
}

#[test]
fn flows_opened_from_outside_the_vpc_are_answered_un_natted() {
    let h = Harness::lab_default();
    let before = h.counter(Counter::IngressInboundTracked);
    h.assert_ingress_untouched(
        &packets::tcp(ONPREM, 50000, POD, 8080, TCP_SYN, b""),
        Counter::IngressInboundTracked,
    );
    assert_eq!(h.counter(Counter::IngressInboundTracked), before + 1);
    h.assert_egress_untouched(
        &packets::tcp(POD, 8080, ONPREM, 50000, TCP_SYN | TCP_ACK, b""),
        Counter::EgressUntranslated,
    );
    h.assert_egress_untouched(
        &packets::icmp_echo(POD, ONPREM, false, 3, 1),
        Counter::EgressNotOpening,
    );
}

#[test]
fn an_inbound_flow_is_a_pair_whose_state_follows_each_side() {
    let h = Harness::lab_default();
    let state = |h: &Harness| {
        let flows = h.datapath.maps.flows().unwrap();
        assert_eq!(flows.len(), 1, "{flows:?}");
        assert_eq!(flows[0].kind(), Some(FlowKind::Inbound));
        assert!(flows[0].rev.is_some(), "a pair: {flows:?}");
        flows[0].state()
    };
    h.ingress(&packets::tcp(ONPREM, 50000, POD, 8080, TCP_SYN, b""));
    assert_eq!(h.table_sizes(), (1, 1));
    assert_eq!(state(&h), FlowState::New, "nothing answered");
    h.egress(&packets::tcp(
        POD,
        8080,
        ONPREM,
        50000,
        TCP_SYN | TCP_ACK,
        b"",
    ));
    assert_eq!(state(&h), FlowState::SynRecv, "answered, not acknowledged");
    h.ingress(&packets::tcp(ONPREM, 50000, POD, 8080, TCP_ACK, b""));
    assert_eq!(state(&h), FlowState::Established);
    h.ingress(&packets::tcp(ONPREM, 50000, POD, 8080, TCP_RST, b""));
    assert_eq!(state(&h), FlowState::Close);
    // The remote connects again from the same port: a new connection.
    h.ingress(&packets::tcp(ONPREM, 50000, POD, 8080, TCP_SYN, b""));
    assert_eq!(state(&h), FlowState::New);
    assert_eq!(h.table_sizes(), (1, 1));
}

#[test]
fn randomize_none_keeps_the_pod_port_when_free() {
    let h = Harness::new(
        &settings(|s| s.randomize = RandomizeMode::None),
        maps::NAT_DEFAULT_ENTRIES,
    );
    let first = egress_pass(&h, &packets::tcp(POD, 40000, INET, 80, TCP_SYN, b""));
    assert_eq!(first.sport, 40000);
    // Another pod with the same port to the same remote gets another port.
    let second = egress_pass(&h, &packets::tcp(POD2, 40000, INET, 80, TCP_SYN, b""));
    assert_ne!(second.sport, 40000);
    // ... but to another remote port, 40000 is free again.
    assert_eq!(
        egress_pass(&h, &packets::tcp(POD2, 40000, INET, 443, TCP_SYN, b"")).sport,
        40000
    );
}

#[test]
fn hashrandom_and_prng_stay_in_the_port_range() {
    for mode in [RandomizeMode::HashRandom, RandomizeMode::Prng] {
        let h = Harness::new(
            &settings(|s| {
                s.randomize = mode;
                s.port_min = 20000;
                s.port_max = 20009;
            }),
            maps::NAT_DEFAULT_ENTRIES,
        );
        let mut ports = std::collections::BTreeSet::new();
        for i in 0..10 {
            let out = egress_pass(&h, &packets::tcp(POD, 30000 + i, INET, 80, TCP_SYN, b""));
            assert!(
                (20000..=20009).contains(&out.sport),
                "{mode:?}: {}",
                out.sport
            );
            ports.insert(out.sport);
        }
        assert_eq!(ports.len(), 10, "{mode:?}: every flow its own port");
        // The range is used up: the next new flow is dropped and counted.
        h.assert_dropped(
            maps::PROG_ENI_EGRESS,
            &packets::tcp(POD, 31000, INET, 80, TCP_SYN, b""),
            Counter::DropNatNoPort,
        );
        // ... while the flows that have their ports keep working.
        assert_eq!(
            egress_pass(&h, &packets::tcp(POD, 30000, INET, 80, TCP_ACK, b"x")).src,
            NODE
        );
    }
}

/// Opens `port`'s flow from the pod to inet and has it answered and
/// acknowledged; returns its translated port.
fn establish(h: &Harness, port: u16) -> u16 {
    let out = egress_pass(h, &packets::tcp(POD, port, INET, 80, TCP_SYN, b""));
    ingress_pass(
        h,
        &packets::tcp(INET, 80, NODE, out.sport, TCP_SYN | TCP_ACK, b""),
    );
    egress_pass(h, &packets::tcp(POD, port, INET, 80, TCP_ACK, b""));
    out.sport
}

#[test]
fn full_table_drops_new_flows_and_keeps_established_ones() {
    let h = Harness::new(&SnatSettings::default(), 4);
    for i in 0..4 {
        establish(&h, 30000 + i);
    }
    h.assert_dropped(
        maps::PROG_ENI_EGRESS,
        &packets::tcp(POD, 31000, INET, 80, TCP_SYN, b""),
        Counter::DropNatTableFull,
    );
    assert_eq!(h.counter(Counter::NatEarlyDrop), 0, "none was unanswered");
    assert_eq!(
        h.table_sizes(),
        (4, 4),
        "no half pair left by the failed flow"
    );
    let established = egress_pass(&h, &packets::tcp(POD, 30002, INET, 80, TCP_ACK, b"x"));
    assert_eq!(established.src, NODE);
    let reply = ingress_pass(
        &h,
        &packets::tcp(INET, 80, NODE, established.sport, TCP_ACK, b"y"),
    );
    assert_eq!((reply.dst, reply.dport), (POD, 30002));
}

/// Bad input (issue 16): in a table full of established flows (nothing to
/// make room with), what cannot be tracked is passed or dropped under its
/// own counter, never translated half-way; the node's own traffic goes on.
#[test]
fn a_full_table_never_stops_the_node_and_drops_what_it_cannot_track() {
    let mut h = Harness::new(&SnatSettings::default(), 4);
    let ports: Vec<u16> = (0..4).map(|i| establish(&h, 30000 + i)).collect();

    // A node socket's connection, both ways and past its handshake:
    // untouched, its port simply not reserved.
    h.assert_egress_untouched(
        &packets::tcp(NODE, 45000, INET, 80, TCP_SYN, b""),
        Counter::EgressHostUntracked,
    );
    h.assert_ingress_untouched(
        &packets::tcp(INET, 80, NODE, 45000, TCP_SYN | TCP_ACK, b""),
        Counter::IngressNoEntry,
    );
    h.assert_egress_untouched(
        &packets::tcp(NODE, 45000, INET, 80, TCP_ACK, b"x"),
        Counter::EgressHostUntracked,
    );

    // A flow opened from outside the VPC that cannot be tracked: the pod's
    // packets after its SYN-ACK (and any UDP reply) would open a SNAT flow
    // of their own as soon as the table had room, so it is not delivered.
    h.assert_dropped(
        maps::PROG_ENI_INGRESS,
        &packets::tcp(ONPREM, 50000, POD, 8080, TCP_SYN, b""),
        Counter::DropInboundUntracked,
    );
    h.assert_dropped(
        maps::PROG_ENI_INGRESS,
        &packets::udp(ONPREM, 50001, POD, 53, b"q"),
        Counter::DropInboundUntracked,
    );

    // Under EXTERNALSNAT a new flow that cannot be tracked is dropped: left
    // untracked, its next packet would be SNATed once the flag is off.
    h.configure(&settings(|s| s.external_snat = true));
    h.assert_dropped(
        maps::PROG_ENI_EGRESS,
        &packets::udp(POD, 40000, INET, 53, b"q"),
        Counter::DropNatTableFull,
    );
    h.configure(&SnatSettings::default());
    // Protocols without ports need a flow for their address too.
    h.assert_dropped(
        maps::PROG_ENI_EGRESS,
        &packets::ipv4_frame(POD, INET, 47, &[0u8, 0, 0x08, 0, 1, 2, 3, 4], &[]),
        Counter::DropNatTableFull,
    );

    assert_eq!(h.counter(Counter::NatEarlyDrop), 0, "none was unanswered");
    assert_eq!(h.table_sizes(), (4, 4), "nothing half-tracked");
    for (i, port) in (30000..).zip(ports) {
        let out = egress_pass(&h, &packets::tcp(POD, i, INET, 80, TCP_ACK, b"x"));
        assert_eq!((out.src, out.sport), (NODE, port), "flow {i} kept its port");
    }
}

#[test]
fn a_full_table_makes_room_by_dropping_an_unanswered_flow() {
    let h = Harness::new(&SnatSettings::default(), 4);
    let answered = establish(&h, 30000);
    // An answered SYN the pod never acknowledged is not established either
    // (conntrack's SYN_RECV is not assured).
    let half_open = egress_pass(&h, &packets::tcp(POD, 30001, INET, 80, TCP_SYN, b""));
    ingress_pass(
        &h,
        &packets::tcp(INET, 80, NODE, half_open.sport, TCP_SYN | TCP_ACK, b""),
    );
    for i in 2..4 {
        egress_pass(&h, &packets::tcp(POD, 30000 + i, INET, 80, TCP_SYN, b""));
    }
    // A flood of new flows nobody answers: each takes an unanswered
    // flow's place.
    for i in 0..8 {
        let out = egress_pass(&h, &packets::tcp(POD, 31000 + i, INET, 80, TCP_SYN, b""));
        assert_eq!(out.src, NODE, "new flow {i} got a port");
    }
    assert_eq!(h.counter(Counter::NatEarlyDrop), 8);
    assert_eq!(h.counter(Counter::DropNatTableFull), 0);
    assert_eq!(h.table_sizes(), (4, 4), "pairs dropped whole");
    // The established flow kept its entries.
    let still = egress_pass(&h, &packets::tcp(POD, 30000, INET, 80, TCP_ACK, b"x"));
    assert_eq!((still.src, still.sport), (NODE, answered));
    let reply = ingress_pass(&h, &packets::tcp(INET, 80, NODE, answered, TCP_ACK, b"y"));
    assert_eq!((reply.dst, reply.dport), (POD, 30000));
    // Untranslated flows make room alike: an inbound SYN from outside the
    // VPC is tracked in a table full of unanswered SNAT flows.
    h.assert_ingress_untouched(
        &packets::tcp(ONPREM, 50000, POD, 8080, TCP_SYN, b""),
        Counter::IngressInboundTracked,
    );
    assert_eq!(h.counter(Counter::NatEarlyDrop), 9);
}

#[test]
fn node_sockets_keep_their_ports_and_nat_never_takes_them() {
    let h = Harness::new(
        &settings(|s| s.randomize = RandomizeMode::None),
        maps::NAT_DEFAULT_ENTRIES,
    );
    // A node socket's flow: untouched, its port reserved.
    h.assert_egress_untouched(
        &packets::tcp(NODE, 45000, INET, 80, TCP_SYN, b""),
        Counter::EgressHostNew,
    );
    // A pod asking for the same port to the same remote does not get it.
    let pod = egress_pass(&h, &packets::tcp(POD, 45000, INET, 80, TCP_SYN, b""));
    assert_ne!(pod.sport, 45000);
    // Replies to the node socket are left alone.
    h.assert_ingress_untouched(
        &packets::tcp(INET, 80, NODE, 45000, TCP_SYN | TCP_ACK, b""),
        Counter::IngressHost,
    );

    // The other order: a pod holds 46000, then a node socket picks 46000 to
    // the same remote: the node flow is moved, like netfilter does.
    assert_eq!(
        egress_pass(&h, &packets::tcp(POD, 46000, INET, 80, TCP_SYN, b"")).sport,
        46000
    );
    let moved = egress_pass(&h, &packets::tcp(NODE, 46000, INET, 80, TCP_SYN, b""));
    assert_eq!(moved.src, NODE);
    assert_ne!(moved.sport, 46000);
    assert_eq!(h.counter(Counter::EgressHostRemapped), 1);
    let back = ingress_pass(
        &h,
        &packets::tcp(INET, 80, NODE, moved.sport, TCP_SYN | TCP_ACK, b""),
    );
    assert_eq!((back.dst, back.dport), (NODE, 46000));
}

#[test]
fn icmp_errors_about_natted_flows_are_translated_inside_and_out() {
    let h = Harness::lab_default();
    // UDP flow; the remote answers port unreachable, quoting the whole datagram.
    let sent = h.egress(&packets::udp(POD, 5000, INET, 9999, b"hello"));
    let nat = parse(&sent.packet);
    let unreach = packets::icmp_error(INET, NODE, 3, 3, &sent.packet, 1000);
    let out = h.ingress(&unreach);
    assert_eq!(out.action, TC_ACT_UNSPEC);
    let outer = parse(&out.packet);
    assert_eq!(outer.dst, POD);
    assert_checksums(&outer);
    let quoted = parse_quoted(&out.packet);
    assert_eq!(
        (quoted.src, quoted.sport, quoted.dst, quoted.dport),
        (POD, 5000, INET, 9999)
    );
    assert_checksums(&quoted);
    assert_eq!(h.counter(Counter::IngressIcmpErrorRevNat), 1);

    // TCP flow; a router says fragmentation needed, quoting only 8 bytes of TCP.
    let sent = h.egress(&packets::tcp(POD, 6000, INET, 443, TCP_SYN, b""));
    let frag_needed =
        packets::icmp_error(Ipv4Addr::new(203, 0, 113, 1), NODE, 3, 4, &sent.packet, 28);
    let out = h.ingress(&frag_needed);
    let outer = parse(&out.packet);
    assert_eq!(outer.dst, POD);
    assert_checksums(&outer);
    let quoted = parse_quoted(&out.packet);
    assert_eq!((quoted.src, quoted.sport), (POD, 6000));
    assert!(quoted.ip_csum_ok);
    assert_eq!(
        out.packet[14 + 20 + 6..14 + 20 + 8],
        1400u16.to_be_bytes(),
        "next-hop MTU kept"
    );

    // ICMP echo; time exceeded on the way.
    let sent = h.egress(&packets::icmp_echo(POD, INET, true, 99, 1));
    let exceeded = packets::icmp_error(
        Ipv4Addr::new(203, 0, 113, 1),
        NODE,
        11,
        0,
        &sent.packet,
        1000,
    );
    let out = h.ingress(&exceeded);
    assert_checksums(&parse(&out.packet));
    let quoted = parse_quoted(&out.packet);
    assert_eq!((quoted.src, quoted.sport), (POD, 99));
    assert_checksums(&quoted);

    // UDP; a router finds a bad option and says parameter problem.
    let sent = h.egress(&packets::udp(POD, 5100, INET, 9999, b"opts"));
    let problem = packets::icmp_error(
        Ipv4Addr::new(203, 0, 113, 1),
        NODE,
        12,
        0,
        &sent.packet,
        1000,
    );
    let out = h.ingress(&problem);
    let outer = parse(&out.packet);
    assert_eq!(outer.dst, POD, "parameter problem translated back");
    assert_checksums(&outer);
    let quoted = parse_quoted(&out.packet);
    assert_eq!((quoted.src, quoted.sport), (POD, 5100));
    assert_checksums(&quoted);

    // An error about something that is not ours passes untouched.
    let stranger = packets::icmp_error(
        INET,
        NODE,
        3,
        3,
        &packets::udp(NODE, 7000, INET, 53, b"x"),
        1000,
    );
    h.assert_ingress_untouched(&stranger, Counter::IngressNoEntry);
    assert_eq!(nat.src, NODE);
}

#[test]
fn icmp_errors_a_pod_sends_about_natted_flows_leave_translated() {
    let h = Harness::lab_default();
    let sent = parse(
        &h.egress(&packets::udp(POD, 5000, INET, 9999, b"hello"))
            .packet,
    );
    // The remote's answer reaches the pod, which has no socket any more.
    let reply = h
        .ingress(&packets::udp(INET, 9999, NODE, sent.sport, b"late"))
        .packet;
    let unreach = packets::icmp_error(POD, INET, 3, 3, &reply, 1000);
    let out = h.egress(&unreach);
    assert_eq!(out.action, TC_ACT_UNSPEC);
    let outer = parse(&out.packet);
    assert_eq!(outer.src, NODE);
    assert_checksums(&outer);
    let quoted = parse_quoted(&out.packet);
    assert_eq!(
        (quoted.src, quoted.sport, quoted.dst, quoted.dport),
        (INET, 9999, NODE, sent.sport)
    );
    assert_checksums(&quoted);
    assert_eq!(h.counter(Counter::EgressIcmpErrorNat), 1);
}

/// A fragment of `payload` at `offset` (bytes, multiple of 8), `more` set
/// when more follow; IP id 0x4242.
fn fragment(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    payload: &[u8],
    offset: usize,
    more: bool,
) -> Vec<u8> {
    let mut frame = packets::ipv4_frame(src, dst, proto, payload, &[]);
    let field = u16::try_from(offset / 8).unwrap() | if more { 0x2000 } else { 0 };
    frame[14 + 4..14 + 6].copy_from_slice(&0x4242u16.to_be_bytes());
    frame[14 + 6..14 + 8].copy_from_slice(&field.to_be_bytes());
    frame[14 + 10] = 0;
    frame[14 + 11] = 0;
    let csum = packets::internet_checksum(&[&frame[14..34]]);
    frame[14 + 10..14 + 12].copy_from_slice(&csum.to_be_bytes());
    frame
}

#[test]
fn fragments_follow_their_first_fragment() {
    let h = Harness::lab_default();
    // A 40-byte UDP datagram in two fragments: header + 16 bytes, then 16.
    let whole = packets::udp(POD, 7000, INET, 7001, &[0xab; 32]);
    let datagram = &whole[14 + 20..];
    let first = fragment(POD, INET, 17, &datagram[..24], 0, true);
    let later = fragment(POD, INET, 17, &datagram[24..], 24, false);
    let out = h.egress(&first);
    assert_eq!(out.action, TC_ACT_UNSPEC);
    let first_out = &out.packet;
    assert_eq!(&first_out[14 + 12..14 + 16], &NODE.octets());
    let out = h.egress(&later);
    assert_eq!(out.action, TC_ACT_UNSPEC);
    assert_eq!(&out.packet[14 + 12..14 + 16], &NODE.octets());
    assert_eq!(packets::internet_checksum(&[&out.packet[14..34]]), 0);
    assert_eq!(h.counter(Counter::EgressFragment), 1);
    // Reassembled, the datagram's UDP checksum holds for the new source.
    let reassembled = [&first_out[14 + 20..], &out.packet[14 + 20..]].concat();
    let pseudo = [
        &NODE.octets()[..],
        &INET.octets(),
        &[0, 17],
        &40u16.to_be_bytes(),
    ]
    .concat();
    assert_eq!(packets::internet_checksum(&[&pseudo, &reassembled]), 0);

    // A later fragment whose first was never seen: no guessing.
    let stray = fragment(POD2, INET, 17, &[0u8; 16], 24, false);
    h.assert_dropped(maps::PROG_ENI_EGRESS, &stray, Counter::DropFragmentNoFlow);
    // ... unless it goes where nothing is translated.
    h.assert_egress_untouched(
        &fragment(POD2, PEER, 17, &[0u8; 16], 24, false),
        Counter::EgressNoSnatCidr,
    );
}

/// The stack's reassembly address (192.0.0.8).
const REASSEMBLY: Ipv4Addr = Ipv4Addr::new(192, 0, 0, 8);

/// Whether a datagram's fragments (IP payloads, in order) reassemble with
/// a valid UDP checksum from `src` to `dst`.
fn udp_checksum_holds(src: Ipv4Addr, dst: Ipv4Addr, fragments: &[&[u8]]) -> bool {
    let datagram: Vec<u8> = fragments
        .iter()
        .flat_map(|f| f[14 + 20..].to_vec())
        .collect();
    let len = u16::try_from(datagram.len()).unwrap().to_be_bytes();
    let pseudo = [&src.octets()[..], &dst.octets(), &[0, 17], &len].concat();
    packets::internet_checksum(&[&pseudo, &datagram]) == 0
}

#[test]
fn a_datagram_whose_first_fragment_comes_last_goes_round_the_stacks_reassembly() {
    let h = Harness::lab_default();
    let port = egress_pass(&h, &packets::udp(POD, 7000, INET, 7001, b"query")).sport;
    // The answer: 40 bytes of UDP in two fragments, the later one first.
    let whole = packets::udp(INET, 7001, NODE, port, &[0xcd; 32]);
    let datagram = &whole[14 + 20..];
    let first = fragment(INET, NODE, 17, &datagram[..24], 0, true);
    let later = fragment(INET, NODE, 17, &datagram[24..], 24, false);
    // Both go to the stack readdressed, the first too: the stack holds the
    // later one until then.
    let later_in = h.ingress(&later);
    let first_in = h.ingress(&first);
    for out in [&later_in, &first_in] {
        assert_eq!(out.action, TC_ACT_UNSPEC);
        assert_eq!(&out.packet[14 + 16..14 + 20], &REASSEMBLY.octets());
        assert_eq!(packets::internet_checksum(&[&out.packet[14..34]]), 0);
    }
    assert!(udp_checksum_holds(
        INET,
        REASSEMBLY,
        &[&first_in.packet, &later_in.packet]
    ));
    assert_eq!(h.counter(Counter::IngressFragmentReordered), 2);

    // Reassembled, routed (one hop off) and cut again in order, each
    // fragment leaves for the ENI's ingress with its address back.
    let routed = |packet: &[u8]| {
        let mut packet = packet.to_vec();
        packet[14 + 8] -= 1;
        packet[14 + 10..14 + 12].fill(0);
        let csum = packets::internet_checksum(&[&packet[14..34]]);
        packet[14 + 10..14 + 12].copy_from_slice(&csum.to_be_bytes());
        packet
    };
    let first_back = h.egress(&routed(&first_in.packet));
    let later_back = h.egress(&routed(&later_in.packet));
    for out in [&first_back, &later_back] {
        assert_eq!(out.action, TC_ACT_REDIRECT);
        assert_eq!(&out.packet[14 + 16..14 + 20], &NODE.octets());
        assert_eq!(out.packet[14 + 8], first[14 + 8], "the hop given back");
        assert_eq!(
            out.packet[..6],
            out.packet[6..12],
            "framed for the ENI itself"
        );
        assert_eq!(packets::internet_checksum(&[&out.packet[14..34]]), 0);
    }
    assert!(udp_checksum_holds(
        INET,
        NODE,
        &[&first_back.packet, &later_back.packet]
    ));
    assert_eq!(h.counter(Counter::EgressReassembled), 2);
    // Back at the ingress, in order: the reply goes to the pod.
    let first_to_pod = h.ingress(&first_back.packet);
    let reply = parse(&first_to_pod.packet);
    assert_eq!((reply.dst, reply.dport), (POD, 7000));
    let later_to_pod = h.ingress(&later_back.packet);
    assert_eq!(&later_to_pod.packet[14 + 16..14 + 20], &POD.octets());
    assert!(udp_checksum_holds(
        INET,
        POD,
        &[&first_to_pod.packet, &later_to_pod.packet]
    ));
    assert_eq!(h.counter(Counter::IngressFragment), 1);

    // A later fragment that comes back before its first was never
    // reassembled: dropped, or it would go round again.
    let elsewhere = Ipv4Addr::new(203, 0, 113, 77);
    let stray_in = h.ingress(&fragment(elsewhere, NODE, 17, &[0u8; 16], 24, false));
    assert_eq!(&stray_in.packet[14 + 16..14 + 20], &REASSEMBLY.octets());
    h.assert_dropped(
        maps::PROG_ENI_EGRESS,
        &routed(&stray_in.packet),
        Counter::DropFragmentNotReassembled,
    );
    // Fragments sent to the reassembly address from outside pass as they
    // came.
    let addressed = fragment(INET, REASSEMBLY, 17, &[0u8; 16], 24, false);
    let out = h.ingress(&addressed);
    assert_eq!((out.action, &out.packet), (TC_ACT_UNSPEC, &addressed));
}

#[test]
fn when_every_port_is_held_the_longest_closed_one_is_reused() {
    let h = Harness::new(
        &settings(|s| {
            s.port_min = 20000;
            s.port_max = 20003;
        }),
        maps::NAT_DEFAULT_ENTRIES,
    );
    // Four flows take the four ports, then close in order, oldest first.
    let mut ports = Vec::new();
    for i in 0..4 {
        let sport = 30000 + i;
        let port = egress_pass(&h, &packets::tcp(POD, sport, INET, 80, TCP_SYN, b"")).sport;
        ingress_pass(
            &h,
            &packets::tcp(INET, 80, NODE, port, TCP_SYN | TCP_ACK, b""),
        );
        ingress_pass(
            &h,
            &packets::tcp(INET, 80, NODE, port, TCP_FIN | TCP_ACK, b""),
        );
        egress_pass(
            &h,
            &packets::tcp(POD, sport, INET, 80, TCP_FIN | TCP_ACK, b""),
        );
        ports.push(port);
    }
    // Every port is within its TIME_WAIT hold: the new flow gets the one
    // whose flow closed first, instead of being dropped.
    let out = egress_pass(&h, &packets::tcp(POD2, 40000, INET, 80, TCP_SYN, b""));
    assert_eq!(out.sport, ports[0]);
    assert_eq!(h.counter(Counter::AllocOldestClosed), 1);
    assert_eq!(h.counter(Counter::DropNatNoPort), 0);
    assert_eq!(
        h.table_sizes(),
        (4, 4),
        "the old pair went whole, the new one came whole"
    );
    // Its replies reach the new pod.
    let back = ingress_pass(
        &h,
        &packets::tcp(INET, 80, NODE, out.sport, TCP_SYN | TCP_ACK, b""),
    );
    assert_eq!((back.dst, back.dport), (POD2, 40000));
}

#[test]
fn a_tuple_connecting_again_keeps_its_port_and_starts_afresh() {
    let h = Harness::lab_default();
    let syn = packets::tcp(POD, 40000, INET, 80, TCP_SYN, b"");
    let port = egress_pass(&h, &syn).sport;
    // A retransmitted SYN is the same attempt, not a new one.
    assert_eq!(egress_pass(&h, &syn).sport, port);
    assert_eq!(h.counter(Counter::EgressReopen), 0);
    ingress_pass(
        &h,
        &packets::tcp(INET, 80, NODE, port, TCP_SYN | TCP_ACK, b""),
    );
    egress_pass(&h, &packets::tcp(POD, 40000, INET, 80, TCP_ACK, b""));
    // The remote resets the connection; the pod connects again from the
    // same port, and then after a clean close, once more.
    ingress_pass(&h, &packets::tcp(INET, 80, NODE, port, TCP_RST, b""));
    let state = |h: &Harness| h.datapath.maps.flows().unwrap()[0].state();
    assert_eq!(state(&h), FlowState::Close);
    assert_eq!(
        egress_pass(&h, &syn).sport,
        port,
        "the same tuple keeps its port"
    );
    assert_eq!(h.counter(Counter::EgressReopen), 1);
    assert_eq!(state(&h), FlowState::New, "and starts afresh");
    ingress_pass(
        &h,
        &packets::tcp(INET, 80, NODE, port, TCP_SYN | TCP_ACK, b""),
    );
    ingress_pass(
        &h,
        &packets::tcp(INET, 80, NODE, port, TCP_FIN | TCP_ACK, b""),
    );
    egress_pass(
        &h,
        &packets::tcp(POD, 40000, INET, 80, TCP_FIN | TCP_ACK, b""),
    );
    assert_eq!(egress_pass(&h, &syn).sport, port);
    assert_eq!(h.counter(Counter::EgressReopen), 2);
    assert_eq!(h.table_sizes(), (1, 1));
}

/// A pod's connection closed as netfilter follows it, from each side's
/// sequence numbers: FIN sent, acknowledged (`CLOSE_WAIT`, a half-closed
/// connection that may go on for an hour under kube-proxy), the other
/// FIN (`LAST_ACK`), the last acknowledgement (`TIME_WAIT`). Frames padded
/// to Ethernet's minimum count only their IP length.
#[test]
fn a_connection_closes_through_netfilters_states_by_its_numbers() {
    let h = Harness::lab_default();
    let kube_proxy = vpcnet_common::nat::Timeouts {
        tcp_established: 86_400,
        tcp_close_wait: 3_600,
        ..Default::default()
    };
    let state = |h: &Harness| {
        let flows = h.datapath.maps.flows().unwrap();
        assert_eq!(flows.len(), 1, "{flows:?}");
        let flow = flows[0];
        (
            flow.state(),
            flow.timeout_ns(&kube_proxy) / vpcnet_common::nat::NS_PER_SEC,
        )
    };
    let pod = |flags, numbers, payload: &[u8]| {
        let mut frame = packets::tcp_seq(POD, 40000, INET, 443, flags, numbers, payload);
        // Ethernet's minimum frame: padding past the IP length.
        frame.resize(frame.len().max(60), 0);
        egress_pass(&h, &frame)
    };
    let port = pod(TCP_SYN, (100, 0), b"").sport;
    let inet = |flags, numbers, payload: &[u8]| {
        ingress_pass(
            &h,
            &packets::tcp_seq(INET, 443, NODE, port, flags, numbers, payload),
        )
    };
    assert_eq!(state(&h), (FlowState::New, 120));
    inet(TCP_SYN | TCP_ACK, (500, 101), b"");
    assert_eq!(state(&h), (FlowState::SynRecv, 60));
    pod(TCP_ACK, (101, 501), b"");
    assert_eq!(state(&h), (FlowState::Established, 86_400));
    pod(TCP_ACK, (101, 501), b"0123456789");
    assert_eq!(
        state(&h),
        (FlowState::Established, 300),
        "ten bytes unacknowledged"
    );
    inet(TCP_ACK, (501, 111), b"");
    assert_eq!(state(&h), (FlowState::Established, 86_400));
    pod(TCP_FIN | TCP_ACK, (111, 501), b"");
    assert_eq!(state(&h), (FlowState::FinWait, 120));
    inet(TCP_ACK, (501, 112), b"");
    assert_eq!(
        state(&h),
        (FlowState::CloseWait, 3_600),
        "half-closed: kube-proxy's hour"
    );
    inet(TCP_FIN | TCP_ACK, (501, 112), &[7; 20]);
    assert_eq!(state(&h), (FlowState::LastAck, 30));
    pod(TCP_ACK, (112, 522), b"");
    assert_eq!(state(&h), (FlowState::TimeWait, 120));
}

/// Another component's mark bit (Calico's mask covers vpcnet's default
/// bits) on a pod's packet for the internet never makes it leave
/// un-NATed: a decided mark is trusted as it is only for a translated
/// packet or one that needs no NAT; such a packet is decided again.
#[test]
fn a_foreign_decided_mark_never_lets_a_pods_packet_leave_un_natted() {
    let h = Harness::lab_default();
    let decided = vpcnet_common::config::MARK_DECIDED;
    let to_inet = packets::tcp(POD, 40000, INET, 443, TCP_SYN, b"");
    let (out, mark) = h.run_with_mark(maps::PROG_ENI_EGRESS, &to_inet, decided | 0x1_0000);
    let left = parse(&out.packet);
    assert_eq!((left.src, out.action), (NODE, TC_ACT_UNSPEC), "SNATed");
    assert_eq!(mark, 0x1_0000, "vpcnet's bit cleared, the other kept");
    assert_eq!(h.counter(Counter::EgressDecidedRechecked), 1);
    // What needs no NAT, or got it, passes on the mark as it is.
    for (packet, what) in [
        (
            packets::tcp(POD, 40001, PEER, 443, TCP_SYN, b""),
            "to the VPC",
        ),
        (
            packets::tcp(NODE, 30000, INET, 443, TCP_SYN, b""),
            "translated",
        ),
    ] {
        let (out, _) = h.run_with_mark(maps::PROG_ENI_EGRESS, &packet, decided);
        assert_eq!(out.packet, packet, "{what}: untouched");
    }
    assert_eq!(h.counter(Counter::EgressDecided), 2);
    assert_eq!(h.counter(Counter::EgressDecidedRechecked), 1);
}

/// `VPCNET_MARK_DECIDED` and `VPCNET_MARK_VIA_SERVICE` move vpcnet's bits:
/// the defaults then mean nothing to it, its own bits what they meant.
#[test]
fn the_mark_bits_are_the_configured_ones() {
    let h = Harness::new(
        &settings(|s| {
            s.mark_decided = 0x1000;
            s.mark_via_service = 0x2000;
        }),
        maps::NAT_DEFAULT_ENTRIES,
    );
    let to_inet = packets::tcp(NODE, 30000, INET, 443, TCP_SYN, b"");
    let (_, mark) = h.run_with_mark(maps::PROG_ENI_EGRESS, &to_inet, 0x1000);
    assert_eq!(mark, 0, "the configured decided bit cleared");
    assert_eq!(h.counter(Counter::EgressDecided), 1);
    let default_bits =
        vpcnet_common::config::MARK_DECIDED | vpcnet_common::config::MARK_VIA_SERVICE;
    let (_, mark) = h.run_with_mark(maps::PROG_ENI_EGRESS, &to_inet, default_bits);
    assert_eq!(mark, default_bits, "another component's bits now, kept");
    assert_eq!(
        h.counter(Counter::EgressDecided),
        1,
        "not taken for decided"
    );
    // A pod's packet to a service, after kube-proxy's DNAT: the
    // configured service bit is vpcnet's, cleared as it leaves.
    let (_, mark) = h.run_with_mark(
        maps::PROG_ENI_EGRESS,
        &packets::tcp(POD, 40000, PEER, 8080, TCP_SYN, b""),
        0x2000,
    );
    assert_eq!(mark, 0, "the configured service bit cleared");
}
