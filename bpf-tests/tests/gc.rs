//! The agent's NAT garbage collector on flows the real program created:
//! each flow is removed whole (both halves) once its timeout passed, live
//! flows stay, and halves left alone are cleaned up.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use vpcnet_agent::{datapath::monotonic_now_ns, snat::SnatSettings};
use vpcnet_bpf_tests::{
    Harness, INET, NODE, ONPREM, POD,
    packets::{self, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
};
use vpcnet_common::{
    counters::Counter,
    maps::NAT_DEFAULT_ENTRIES,
    nat::{
        DEFAULT_TIMEOUTS, FlowKey, FlowKind, NS_PER_SEC, NatEntry, SEEN_ANY, SEEN_SYN,
        TOUCH_INTERVAL_NS, Timeouts,
    },
};

const SEC: u64 = NS_PER_SEC;
const TIMEOUTS: Timeouts = DEFAULT_TIMEOUTS;

/// Collects with netfilter's default timeouts at `now`.
fn collect(h: &mut Harness, now: u64) -> vpcnet_agent::datapath::GcStats {
    h.datapath.maps.collect_garbage(&TIMEOUTS, now).unwrap()
}

fn secs(seconds: u32) -> u64 {
    u64::from(seconds) * SEC
}

fn nat_port(h: &Harness, packet: &[u8]) -> u16 {
    packets::parse(&h.egress(packet).packet).sport
}

#[test]
fn expired_flows_go_whole_and_live_ones_stay() {
    let mut h = Harness::lab_default();
    // An unanswered UDP flow: 30 s.
    nat_port(&h, &packets::udp(POD, 5000, INET, 53, b"q"));
    // An established TCP flow, nothing unacknowledged: days.
    let est = nat_port(
        &h,
        &packets::tcp_seq(POD, 40000, INET, 443, TCP_SYN, (100, 0), b""),
    );
    h.ingress(&packets::tcp_seq(
        INET,
        443,
        NODE,
        est,
        TCP_SYN | TCP_ACK,
        (500, 101),
        b"",
    ));
    h.egress(&packets::tcp_seq(
        POD,
        40000,
        INET,
        443,
        TCP_ACK,
        (101, 501),
        b"",
    ));
    // A TCP flow closed by both sides, each FIN acknowledged (TIME_WAIT):
    // held for the remote's TIME_WAIT.
    let pod = |flags, numbers| packets::tcp_seq(POD, 40001, INET, 443, flags, numbers, b"");
    let closed = nat_port(&h, &pod(TCP_SYN, (100, 0)));
    let inet = |flags, numbers| packets::tcp_seq(INET, 443, NODE, closed, flags, numbers, b"");
    h.ingress(&inet(TCP_SYN | TCP_ACK, (500, 101)));
    h.ingress(&inet(TCP_FIN | TCP_ACK, (501, 101)));
    h.egress(&pod(TCP_FIN | TCP_ACK, (101, 502)));
    h.ingress(&inet(TCP_ACK, (502, 102)));
    assert_eq!(h.table_sizes(), (3, 3));

    let now = monotonic_now_ns();
    let stats = collect(&mut h, now);
    assert_eq!(
        (stats.flows, stats.expired, stats.orphans),
        (3, 0, 0),
        "nothing is over yet"
    );

    let stats = collect(&mut h, now + secs(TIMEOUTS.udp) + SEC);
    assert_eq!(stats.expired, 1, "the UDP flow timed out");
    assert_eq!(h.table_sizes(), (2, 2), "its pair went whole");

    let stats = collect(&mut h, now + secs(TIMEOUTS.tcp_time_wait) + SEC);
    assert_eq!(stats.expired, 1, "the closed flow's TIME_WAIT hold is over");
    assert_eq!(h.table_sizes(), (1, 1));

    let stats = collect(&mut h, now + 3600 * SEC);
    assert_eq!(stats.expired, 0, "an established flow lives on");
    let stats = collect(&mut h, now + secs(TIMEOUTS.tcp_established) + SEC);
    assert_eq!(stats.expired, 1);
    assert_eq!(h.table_sizes(), (0, 0));
}

/// The collector reads the table in batches (`BPF_MAP_LOOKUP_BATCH`): a
/// table of more flows than one batch holds is read whole, every flow
/// paired with its claim, as an entry-by-entry walk reads it.
#[test]
fn a_table_larger_than_a_batch_is_read_whole() {
    let h = Harness::lab_default();
    let count = 10_000_u16;
    for port in 10_000..10_000 + count {
        h.egress(&packets::udp(POD, port, INET, 53, b"q"));
    }
    let flows = h.datapath.maps.flows().unwrap();
    assert_eq!(flows.len(), usize::from(count));
    assert!(flows.iter().all(|f| f.rev.is_some()), "each with its claim");
    let walked: std::collections::HashSet<FlowKey> =
        h.datapath.maps.nat_fwd.keys().map(Result::unwrap).collect();
    let read: std::collections::HashSet<FlowKey> = flows.iter().map(|f| f.key).collect();
    assert_eq!(read, walked);
}

/// Closes `port`'s TCP flow from the pod to inet, both sides; returns its
/// translated port.
fn closed_flow(h: &Harness, port: u16) -> u16 {
    let nat = nat_port(h, &packets::tcp(POD, port, INET, 443, TCP_SYN, b""));
    h.ingress(&packets::tcp(INET, 443, NODE, nat, TCP_SYN | TCP_ACK, b""));
    h.ingress(&packets::tcp(INET, 443, NODE, nat, TCP_FIN | TCP_ACK, b""));
    h.egress(&packets::tcp(POD, port, INET, 443, TCP_FIN | TCP_ACK, b""));
    nat
}

/// The collector removes only what it judged (issue 17). It reads the
/// table and finds a closed flow over; before it removes it, the pod
/// connects again from the same port, a new connection on the same tuple,
/// which keeps its port. The new flow keeps both halves, its claim
/// included, and its replies reach the pod.
#[test]
fn a_new_flow_reusing_a_collected_flows_port_keeps_its_claim() {
    let h = Harness::lab_default();
    let port = closed_flow(&h, 41000);
    let later = monotonic_now_ns() + secs(TIMEOUTS.tcp_time_wait) + SEC;
    let judgement = h.datapath.maps.judge_garbage(&TIMEOUTS, later).unwrap();
    assert_eq!(judgement.over(), 1, "the closed flow is over");

    let again = nat_port(&h, &packets::tcp(POD, 41000, INET, 443, TCP_SYN, b""));
    assert_eq!(again, port, "the tuple connecting again keeps its port");
    assert_eq!(h.counter(Counter::EgressReopen), 1);
    let stats = h.datapath.maps.collect_judged(&judgement).unwrap();

    assert_eq!(stats.expired, 0, "the flow it judged is gone already");
    assert_eq!(h.table_sizes(), (1, 1), "the new flow keeps both halves");
    let reply = h.ingress(&packets::tcp(INET, 443, NODE, port, TCP_SYN | TCP_ACK, b""));
    let reply = packets::parse(&reply.packet);
    assert_eq!(
        (reply.dst, reply.dport),
        (POD, 41000),
        "its replies reach the pod"
    );
    // Judged afresh, the new flow is not over.
    let stats = h
        .datapath
        .maps
        .collect_garbage(&TIMEOUTS, monotonic_now_ns())
        .unwrap();
    assert_eq!((stats.flows, stats.expired), (1, 0));
}

/// A flow a packet changed after the collector judged it is left whole for
/// the next pass, which judges it afresh (issue 17).
#[test]
fn a_flow_changed_after_it_was_judged_is_left_for_the_next_pass() {
    let h = Harness::lab_default();
    let port = closed_flow(&h, 41001);
    let later = monotonic_now_ns() + secs(TIMEOUTS.tcp_time_wait) + SEC;
    let judgement = h.datapath.maps.judge_garbage(&TIMEOUTS, later).unwrap();
    assert_eq!(judgement.over(), 1);
    // The remote resets it: the claim's flags change.
    h.ingress(&packets::tcp(INET, 443, NODE, port, TCP_RST, b""));
    let stats = h.datapath.maps.collect_judged(&judgement).unwrap();
    assert_eq!(stats.expired, 0);
    assert_eq!(h.table_sizes(), (1, 1), "the pair stays whole");
    let stats = h.datapath.maps.collect_garbage(&TIMEOUTS, later).unwrap();
    assert_eq!(stats.expired, 1, "judged afresh");
    assert_eq!(h.table_sizes(), (0, 0));
}

#[test]
fn untranslated_flows_expire_by_their_own_state() {
    let mut h = Harness::new(
        &SnatSettings {
            external_snat: true,
            ..SnatSettings::default()
        },
        NAT_DEFAULT_ENTRIES,
    );
    // EXTERNALSNAT: a pod's SYN nobody answers, and an answered one.
    h.egress(&packets::tcp(POD, 40000, INET, 443, TCP_SYN, b""));
    h.egress(&packets::tcp(POD, 40001, INET, 443, TCP_SYN, b""));
    h.ingress(&packets::tcp(INET, 443, POD, 40001, TCP_SYN | TCP_ACK, b""));
    h.egress(&packets::tcp(POD, 40001, INET, 443, TCP_ACK, b""));
    // From outside the VPC: a SYN the pod never answers, a UDP datagram
    // it never answers.
    h.ingress(&packets::tcp(ONPREM, 50000, POD, 8080, TCP_SYN, b""));
    h.ingress(&packets::udp(ONPREM, 50001, POD, 53, b"q"));
    assert_eq!(h.table_sizes(), (4, 4), "each flow a pair");

    let now = monotonic_now_ns();
    let stats = collect(&mut h, now + secs(TIMEOUTS.udp) + SEC);
    assert_eq!(
        stats.expired, 1,
        "the unanswered UDP flow, at 30 s: {stats:?}"
    );
    let stats = collect(&mut h, now + secs(TIMEOUTS.tcp_syn_sent) + SEC);
    assert_eq!(
        stats.expired, 2,
        "both unanswered SYNs, at 120 s: {stats:?}"
    );
    let flows = h.datapath.maps.flows().unwrap();
    assert_eq!(flows.len(), 1);
    assert_eq!(
        (flows[0].key.sport, flows[0].kind()),
        (40001_u16.to_be(), Some(FlowKind::NoSnat)),
        "the established one stays"
    );
    assert_eq!(h.table_sizes(), (1, 1));
}

#[test]
fn timeouts_come_from_the_map_the_agent_fills() {
    // One port to give: a second flow gets it only once the first is over.
    let mut h = Harness::new(
        &SnatSettings {
            port_min: 20000,
            port_max: 20000,
            ..SnatSettings::default()
        },
        NAT_DEFAULT_ENTRIES,
    );
    let short = Timeouts {
        tcp_syn_sent: 1,
        ..Timeouts::default()
    };
    h.datapath.maps.set_timeouts(&short).unwrap();
    assert_eq!(h.datapath.maps.timeouts().unwrap(), short);
    let first = packets::parse(
        &h.egress(&packets::tcp(POD, 40000, INET, 443, TCP_SYN, b""))
            .packet,
    );
    assert_eq!((first.src, first.sport), (NODE, 20000));
    let created = std::time::Instant::now();
    h.assert_dropped(
        vpcnet_common::maps::PROG_ENI_EGRESS,
        &packets::tcp(POD, 40001, INET, 443, TCP_SYN, b""),
        Counter::DropNatNoPort,
    );
    // The datapath judges the first flow by the map's 1 s (and the touch
    // interval its last packet may be recorded late by): past both, the
    // port is free for the next flow. (Waiting is the point: the
    // datapath's clock cannot be moved.)
    std::thread::sleep(
        (Duration::from_secs(1)
            + Duration::from_nanos(TOUCH_INTERVAL_NS)
            + Duration::from_millis(100))
        .saturating_sub(created.elapsed()),
    );
    let second = packets::parse(
        &h.egress(&packets::tcp(POD, 40001, INET, 443, TCP_SYN, b""))
            .packet,
    );
    assert_eq!((second.src, second.sport), (NODE, 20000));
    assert_eq!(h.counter(Counter::EgressTakeover), 1);
    // The collector judges by them too.
    h.egress(&packets::tcp(POD, 40002, INET, 80, TCP_SYN, b""));
    let stats = h
        .datapath
        .maps
        .collect_garbage(&short, monotonic_now_ns() + 3 * SEC)
        .unwrap();
    assert_eq!(stats.expired, 2, "{stats:?}");
}

#[test]
fn an_earlier_versions_single_entry_becomes_a_pair() {
    let mut h = Harness::lab_default();
    // What an agent before pairs left for an EXTERNALSNAT flow: one entry,
    // written by both directions.
    let key = FlowKey::new(
        vpcnet_common::addr_to_raw(POD.octets()),
        vpcnet_common::addr_to_raw(INET.octets()),
        40000_u16.to_be(),
        443_u16.to_be(),
        vpcnet_common::nat::PROTO_TCP,
    );
    let now = monotonic_now_ns();
    let single = NatEntry {
        addr: key.saddr,
        port: key.sport,
        kind: FlowKind::NoSnat as u8,
        seen: SEEN_ANY | SEEN_SYN,
        last_seen_ns: now,
        created_ns: now,
        ..NatEntry::default()
    };
    h.datapath.maps.nat_fwd.insert(key, single, 0).unwrap();
    let stats = collect(&mut h, now);
    assert_eq!((stats.paired, stats.orphans), (1, 0), "{stats:?}");
    assert_eq!(h.table_sizes(), (1, 1));
    // The pod's packets still leave untranslated.
    h.assert_egress_untouched(
        &packets::tcp(POD, 40000, INET, 443, TCP_ACK, b"x"),
        Counter::EgressUntranslated,
    );
}

#[test]
fn halves_left_alone_are_removed() {
    let mut h = Harness::lab_default();
    let port = nat_port(&h, &packets::tcp(POD, 40000, INET, 443, TCP_SYN, b""));
    let fwd_key = h.datapath.maps.nat_fwd.keys().next().unwrap().unwrap();
    let rev_key: FlowKey = h.datapath.maps.nat_rev.keys().next().unwrap().unwrap();
    assert_eq!(vpcnet_common::raw_to_port(rev_key.dport), port);

    // A forward half without its claim is useless: removed at once.
    h.datapath.maps.nat_rev.remove(&rev_key).unwrap();
    let stats = collect(&mut h, monotonic_now_ns());
    assert_eq!(stats.orphans, 1);
    assert_eq!(h.table_sizes(), (0, 0));

    // A claim without its forward half may be a flow being created on
    // another CPU: kept for a grace period, then removed.
    let _ = nat_port(&h, &packets::tcp(POD, 40001, INET, 443, TCP_SYN, b""));
    let fwd_key2 = h.datapath.maps.nat_fwd.keys().next().unwrap().unwrap();
    assert_ne!(fwd_key, fwd_key2);
    h.datapath.maps.nat_fwd.remove(&fwd_key2).unwrap();
    let now = monotonic_now_ns();
    assert_eq!(collect(&mut h, now).orphans, 0);
    assert_eq!(h.table_sizes(), (0, 1));
    assert_eq!(collect(&mut h, now + 11 * SEC).orphans, 1);
    assert_eq!(h.table_sizes(), (0, 0));
}

/// A stack flow whose tuple is its own reverse (a pod's ICMP query to
/// itself by a service's address, identifier 0) is one entry for both
/// halves: the collector removes it once it is over, as any other. (Found
/// by the fuzz: the pass removed the entry as one half, failed to remove it
/// as the other, and put it back.)
#[test]
fn a_stack_flow_that_is_its_own_reverse_is_removed_once_over() {
    let mut h = Harness::lab_default();
    let pod = vpcnet_common::addr_to_raw(POD.octets());
    let key = FlowKey::new(pod, pod, 0, 0, vpcnet_common::nat::PROTO_ICMP);
    assert_eq!(key, key.reversed());
    let now = monotonic_now_ns();
    h.datapath.maps.import_stack_flow(key, now).unwrap();
    let stats = h.datapath.maps.collect_stack_flows(&TIMEOUTS, now).unwrap();
    assert_eq!((stats.flows, stats.expired), (1, 0), "live: {stats:?}");
    let stats = h
        .datapath
        .maps
        .collect_stack_flows(&TIMEOUTS, now + 3600 * SEC)
        .unwrap();
    assert_eq!(stats.expired, 1, "{stats:?}");
    assert_eq!(h.datapath.maps.stack_flows.keys().count(), 0);
}

/// Removes a test's pins, also when it fails.
struct Unpin(std::path::PathBuf);

impl Drop for Unpin {
    fn drop(&mut self) {
        let _ = vpcnet_agent::datapath::remove_pins(&self.0);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn an_earlier_versions_stack_flows_are_carried_into_pairs() {
    let pin_dir = std::path::PathBuf::from(format!(
        "/sys/fs/bpf/vpcnet-test-stack-carry-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&pin_dir).unwrap();
    let _unpin = Unpin(pin_dir.clone());
    // What an earlier agent pinned: an LRU map of single tuples.
    let retired = pin_dir.join(vpcnet_common::maps::STACK_FLOWS_LRU);
    let retired = retired.to_str().unwrap();
    let bpftool = |args: &[&str]| {
        let out = std::process::Command::new("bpftool")
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "bpftool {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    bpftool(&[
        "map",
        "create",
        retired,
        "type",
        "lru_hash",
        "key",
        "16",
        "value",
        "8",
        "entries",
        "64",
        "name",
        "VPCNET_STACK_FLOWS",
    ]);
    let key = FlowKey::new(
        vpcnet_common::addr_to_raw(POD.octets()),
        vpcnet_common::addr_to_raw(ONPREM.octets()),
        8080_u16.to_be(),
        51000_u16.to_be(),
        vpcnet_common::nat::PROTO_TCP,
    );
    // The key's bytes as the map holds them (`FlowKey` is `repr(C)`).
    let mut raw = Vec::new();
    raw.extend(key.saddr.to_ne_bytes());
    raw.extend(key.daddr.to_ne_bytes());
    raw.extend(key.sport.to_ne_bytes());
    raw.extend(key.dport.to_ne_bytes());
    raw.extend([key.proto, 0, 0, 0]);
    let key_bytes: Vec<String> = raw.iter().map(|b| format!("0x{b:02x}")).collect();
    let mut update = vec!["map", "update", "pinned", retired, "key"];
    update.extend(key_bytes.iter().map(String::as_str));
    update.extend(["value", "0", "0", "0", "0", "0", "0", "0", "1"]);
    bpftool(&update);

    let datapath = vpcnet_agent::datapath::Datapath::load(&vpcnet_agent::datapath::LoadOptions {
        pin_dir: pin_dir.clone(),
        ..vpcnet_agent::datapath::LoadOptions::default()
    })
    .expect("loading over the earlier version's pins");
    let carried: Vec<(FlowKey, NatEntry)> = datapath.maps.stack_flows.iter().flatten().collect();
    assert_eq!(carried.len(), 2, "the flow, as a pair: {carried:?}");
    assert!(carried.iter().any(|(k, _)| *k == key));
    assert!(carried.iter().any(|(k, _)| *k == key.reversed()));
    assert!(
        !std::path::Path::new(retired).exists(),
        "the retired map's pin is gone"
    );
    // Carried as established: an hour idle does not end it.
    let maps = datapath.maps;
    let stats = maps
        .collect_stack_flows(&TIMEOUTS, monotonic_now_ns() + 3600 * SEC)
        .unwrap();
    assert_eq!((stats.flows, stats.expired), (1, 0), "{stats:?}");
}

/// A flow whose packets come within its timeout keeps its port while the
/// collector's passes loop, its packets sent from several threads at once
/// and interleaving with the passes as they may: a pass judges a flow by
/// the last packet its entries record, which may be up to a touch
/// interval before its last one, so a flow is over only once idle past
/// both. (A packet after a flow's whole timeout starts a new flow, as it
/// does in conntrack.)
#[test]
fn a_flow_alive_within_its_timeout_keeps_its_port_while_passes_loop() {
    const RACE_FOR: Duration = Duration::from_secs(4);
    let mut h = Harness::lab_default();
    // UDP's timeout at the shortest its sysctl gives, in the programs' map.
    let timeouts = Timeouts {
        udp: 1,
        ..Timeouts::default()
    };
    h.datapath.maps.set_timeouts(&timeouts).unwrap();
    let packet = packets::udp(POD, 5000, INET, 53, b"q");
    let port = nat_port(&h, &packet);
    let made = h.counter(Counter::EgressSnatNew);
    let deadline = Instant::now() + RACE_FOR;
    let h = &h;
    let packet = &packet;
    let (ports, sent, passes) = std::thread::scope(|scope| {
        let senders: Vec<_> = (0..3_u64)
            .map(|seed| {
                scope.spawn(move || {
                    let mut rng = fastrand::Rng::with_seed(seed);
                    let mut ports = BTreeSet::new();
                    let mut sent = 0;
                    while Instant::now() < deadline {
                        // Each thread at most 0.9 s apart: the flow's
                        // packets always come within its second.
                        std::thread::sleep(Duration::from_millis(rng.u64(300..900)));
                        ports.insert(nat_port(h, packet));
                        sent += 1;
                    }
                    (ports, sent)
                })
            })
            .collect();
        let mut passes = 0_u64;
        while Instant::now() < deadline {
            h.datapath
                .maps
                .collect_garbage(&timeouts, monotonic_now_ns())
                .unwrap();
            passes += 1;
        }
        let mut ports = BTreeSet::new();
        let mut sent = 0;
        for sender in senders {
            let (seen, count) = sender.join().expect("a sender");
            ports.extend(seen);
            sent += count;
        }
        (ports, sent, passes)
    });
    println!("{sent} packets from 3 threads, {passes} collections: ports {ports:?}");
    assert!(passes > 100 && sent > 10, "{passes} passes, {sent} packets");
    assert_eq!(ports, BTreeSet::from([port]), "the flow kept its port");
    assert_eq!(
        h.counter(Counter::EgressSnatNew),
        made,
        "the flow was never made anew"
    );
}
