//! An agent starting over maps another version pinned: those of its own
//! layout and size are reused, those of a layout it reads are carried into
//! new maps (the releases before versioned pins, another `--nat-entries`,
//! appended counters), and those it cannot read (a newer version's, after a
//! downgrade) are left as they are, said in one line, never deleted.

use std::{
    io::Write,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use aya::{
    EbpfLoader,
    maps::{Array, HashMap, MapInfo, PerCpuArray, PerCpuValues},
};
use vpcnet_agent::datapath::{PROGRAMS, ProgramsOrigin, monotonic_now_ns, pins};
use vpcnet_bpf_tests::{
    Harness, INET, NODE, ONPREM, POD,
    packets::{self, TCP_ACK},
};
use vpcnet_common::{
    addr_to_raw,
    config::Config,
    counters::{COUNTER_SLOTS, Counter},
    endpoint::Endpoint,
    maps::{self as names, PinnedMap},
    nat::{
        FlowKey, FlowKind, NatEntry, PROTO_TCP, SEEN_ACK, SEEN_ANY, SEEN_FIN, SEEN_SYN, reply_key,
    },
    port_to_raw,
};

/// The counters of the last release before versioned pins.
const RELEASE_COUNTER_SLOTS: u32 = 58;
/// Maps this version has that the releases before versioned pins had
/// not: whoever pinned those pinned none of them by a bare name.
const NEWER_THAN_BARE_PINS: [&str; 5] = [
    names::POLICY_PODS,
    names::POLICY_CIDRS,
    names::POLICY_PORTS,
    names::POLICY_FLOWS,
    names::POLICY_VERDICTS,
];

/// Removes the bare-name pins a loader of this version's object made of
/// maps the releases before versioned pins did not have.
fn unpin_maps_bare_pins_never_had(pin_dir: &Path) {
    for name in NEWER_THAN_BARE_PINS {
        std::fs::remove_file(pin_dir.join(name)).unwrap();
    }
}

/// The SNAT port of the carried flow.
const SNAT_PORT: u16 = 30_001;

fn layout_of(name: &str) -> PinnedMap {
    names::ALL.into_iter().find(|map| map.name == name).unwrap()
}

fn established(addr: Ipv4Addr, port: u16, kind: FlowKind, now: u64) -> NatEntry {
    NatEntry {
        addr: addr_to_raw(addr.octets()),
        port: port_to_raw(port),
        kind: kind as u8,
        seen: SEEN_ANY | SEEN_SYN | SEEN_ACK,
        last_seen_ns: now,
        created_ns: now,
        ..NatEntry::default()
    }
}

fn tcp_key(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> FlowKey {
    FlowKey::new(
        addr_to_raw(src.octets()),
        addr_to_raw(dst.octets()),
        port_to_raw(sport),
        port_to_raw(dport),
        PROTO_TCP,
    )
}

/// The pod's SNATed flow to `inet` and its EXTERNALSNAT-era flow to
/// `onprem`, which the release kept as a forward entry alone, last seen
/// at `now`.
fn release_flows(now: u64) -> [(FlowKey, NatEntry); 2] {
    [
        (
            tcp_key(POD, 40_000, INET, 443),
            established(NODE, SNAT_PORT, FlowKind::Snat, now),
        ),
        (
            tcp_key(POD, 40_001, ONPREM, 22),
            established(POD, 40_001, FlowKind::NoSnat, now),
        ),
    ]
}

/// Pins maps as the release before versioned pins did: by bare name, its
/// counters fewer, and fills them with a node's state.
fn pin_as_the_release_did(pin_dir: &Path, now: u64) {
    std::fs::create_dir_all(pin_dir).unwrap();
    let mut release = EbpfLoader::new()
        .default_map_pin_directory(pin_dir)
        .map_max_entries(names::COUNTERS, RELEASE_COUNTER_SLOTS)
        .map_max_entries(names::NAT_FWD, 1024)
        .map_max_entries(names::NAT_REV, 1024)
        .map_max_entries(names::STACK_FLOWS, 1024)
        .load(PROGRAMS)
        .expect("creating the release's maps");
    unpin_maps_bare_pins_never_had(pin_dir);
    let mut config: Array<_, Config> =
        Array::try_from(release.map_mut(names::CONFIG).unwrap()).unwrap();
    let mut node = config.get(&0, 0).unwrap();
    node.node_addr = addr_to_raw(NODE.octets());
    config.set(0, node, 0).unwrap();
    let mut endpoints: HashMap<_, u32, Endpoint> =
        HashMap::try_from(release.map_mut(names::ENDPOINTS).unwrap()).unwrap();
    let pod = Endpoint {
        ifindex: 42,
        ..Endpoint::default()
    };
    endpoints.insert(addr_to_raw(POD.octets()), pod, 0).unwrap();
    let [(snat_key, snat), (nosnat_key, nosnat)] = release_flows(now);
    let mut fwd: HashMap<_, FlowKey, NatEntry> =
        HashMap::try_from(release.map_mut(names::NAT_FWD).unwrap()).unwrap();
    fwd.insert(snat_key, snat, 0).unwrap();
    fwd.insert(nosnat_key, nosnat, 0).unwrap();
    let mut rev: HashMap<_, FlowKey, NatEntry> =
        HashMap::try_from(release.map_mut(names::NAT_REV).unwrap()).unwrap();
    let claim = reply_key(&snat_key, snat.addr, snat.port);
    rev.insert(claim, established(POD, 40_000, FlowKind::Snat, now), 0)
        .unwrap();
    let mut counters: PerCpuArray<_, u64> =
        PerCpuArray::try_from(release.map_mut(names::COUNTERS).unwrap()).unwrap();
    let cpus = aya::util::nr_cpus().unwrap();
    for (counter, count) in [
        (Counter::EgressSnatNew, 5),
        // The release counted passes here; the index counts drops now.
        (Counter::DropInboundUntracked, 7),
    ] {
        let mut values = vec![0_u64; cpus];
        values[0] = count;
        counters
            .set(counter as u32, PerCpuValues::try_from(values).unwrap(), 0)
            .unwrap();
    }
}

fn pin_names(pin_dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(pin_dir)
        .unwrap()
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("VPCNET_"))
        .collect();
    names.sort();
    names
}

#[test]
fn an_unversioned_release_s_maps_are_carried_into_versioned_ones() {
    let pin_dir = Harness::new_pin_dir();
    let _cleanup = Unpin(pin_dir.clone());
    let now = monotonic_now_ns();
    pin_as_the_release_did(&pin_dir, now);

    let mut h = Harness::load_in(pin_dir.clone(), 4096).expect("loading over the release's pins");

    // Every map at its versioned pin, the release's bare names gone.
    let mut expected: Vec<String> = names::ALL
        .iter()
        .map(|map| format!("{}_v{}", map.name, map.layout))
        .collect();
    expected.sort();
    assert_eq!(pin_names(&pin_dir), expected);
    let counters = MapInfo::from_pin(pins::pin_path(&pin_dir, &layout_of(names::COUNTERS)));
    assert_eq!(
        counters.unwrap().max_entries(),
        COUNTER_SLOTS,
        "room for every counter"
    );
    let nat = MapInfo::from_pin(pins::pin_path(&pin_dir, &layout_of(names::NAT_FWD))).unwrap();
    assert_eq!(
        nat.max_entries(),
        4096,
        "the new NAT map has the size asked for"
    );

    // The node's state, as the release left it.
    let maps = &h.datapath.maps;
    assert_eq!(maps.config().unwrap().node_addr, addr_to_raw(NODE.octets()));
    assert_eq!(maps.endpoint(POD).unwrap().map(|e| e.ifindex), Some(42));
    assert_eq!(maps.counter(Counter::EgressSnatNew).unwrap(), 5);
    assert_eq!(
        maps.counter(Counter::DropInboundUntracked).unwrap(),
        0,
        "a counter whose meaning changed is not carried"
    );
    let [(snat_key, snat), (nosnat_key, nosnat)] = release_flows(now);
    assert_eq!(maps.nat_fwd.get(&snat_key, 0).unwrap(), snat);
    assert_eq!(maps.nat_fwd.get(&nosnat_key, 0).unwrap(), nosnat);
    let paired = maps.nat_rev.get(&nosnat_key.reversed(), 0).unwrap();
    assert_eq!(
        (paired.addr, paired.port, paired.kind),
        (nosnat.addr, nosnat.port, FlowKind::NoSnat as u8),
        "an untranslated flow of the release became a pair"
    );
    assert_eq!(h.table_sizes(), (2, 2));

    // And the programs use them: the SNATed flow's reply reaches the pod.
    h.configure(&vpcnet_agent::snat::SnatSettings::default());
    let reply = h.ingress(&packets::tcp(INET, 443, NODE, SNAT_PORT, TCP_ACK, b""));
    let reply = packets::parse(&reply.packet);
    assert_eq!((reply.dst, reply.dport), (POD, 40_000));
    assert!(reply.ip_csum_ok && reply.l4_csum_ok);
    assert_eq!(h.counter(Counter::IngressRevSnat), 1);
}

/// The NAT maps pinned at `pin_name`'s paths, the forward one and the
/// reverse one.
fn pinned_nat_maps(
    pin_name: impl Fn(&str) -> PathBuf,
) -> [HashMap<aya::maps::MapData, FlowKey, NatEntry>; 2] {
    [names::NAT_FWD, names::NAT_REV].map(|name| {
        let data = aya::maps::MapData::from_pin(pin_name(name)).unwrap();
        HashMap::try_from(aya::maps::Map::HashMap(data)).unwrap()
    })
}

/// An upgrade stopped after it pinned its own maps and copied the running
/// ones in (its first pass), before its second pass: the release's
/// programs ran on meanwhile, and the next start must lose none of what
/// either set of maps holds.
#[test]
fn an_upgrade_stopped_half_way_loses_no_flow_of_either_set_of_maps() {
    let pin_dir = Harness::new_pin_dir();
    let _cleanup = Unpin(pin_dir.clone());
    let now = monotonic_now_ns();
    pin_as_the_release_did(&pin_dir, now);
    let [(snat_key, snat), _] = release_flows(now);

    // The stopped agent's maps, at its own pins: the release's SNATed flow
    // copied, and a flow its programs made.
    let mut loader = EbpfLoader::new();
    for map in names::ALL {
        loader.map_pin_path(map.name, pins::pin_path(&pin_dir, &map));
    }
    let ours = loader
        .map_max_entries(names::NAT_FWD, 4096)
        .map_max_entries(names::NAT_REV, 4096)
        .map_max_entries(names::STACK_FLOWS, names::STACK_FLOWS_DEFAULT_ENTRIES)
        .load(PROGRAMS)
        .expect("the stopped agent's maps");
    drop(ours);
    let [mut new_fwd, mut new_rev] =
        pinned_nat_maps(|name| pins::pin_path(&pin_dir, &layout_of(name)));
    new_fwd.insert(snat_key, snat, 0).unwrap();
    let new_flow = tcp_key(POD, 40_010, INET, 443);
    let new_snat = established(NODE, SNAT_PORT + 1, FlowKind::Snat, now);
    new_fwd.insert(new_flow, new_snat, 0).unwrap();
    new_rev
        .insert(
            reply_key(&new_flow, new_snat.addr, new_snat.port),
            established(POD, 40_010, FlowKind::Snat, now),
            0,
        )
        .unwrap();

    // The release's programs after the copy: the SNATed flow closes, and a
    // new flow begins.
    let [mut old_fwd, mut old_rev] = pinned_nat_maps(|name| pin_dir.join(name));
    let closing = NatEntry {
        seen: snat.seen | SEEN_FIN,
        last_seen_ns: now + 1_000,
        ..snat
    };
    old_fwd.insert(snat_key, closing, 0).unwrap();
    let late_flow = tcp_key(POD, 40_020, INET, 443);
    let late_snat = established(NODE, SNAT_PORT + 2, FlowKind::Snat, now + 2_000);
    old_fwd.insert(late_flow, late_snat, 0).unwrap();
    old_rev
        .insert(
            reply_key(&late_flow, late_snat.addr, late_snat.port),
            established(POD, 40_020, FlowKind::Snat, now + 2_000),
            0,
        )
        .unwrap();
    drop((new_fwd, new_rev, old_fwd, old_rev));

    let mut h = Harness::load_in(pin_dir.clone(), 4096).expect("starting again");
    h.configure(&vpcnet_agent::snat::SnatSettings::default());
    let maps = &h.datapath.maps;
    assert_eq!(
        maps.nat_fwd.get(&snat_key, 0).unwrap(),
        closing,
        "what the release's programs saw of a copied flow is added"
    );
    assert_eq!(
        maps.nat_fwd.get(&new_flow, 0).unwrap(),
        new_snat,
        "our flow"
    );
    assert_eq!(
        maps.nat_fwd.get(&late_flow, 0).ok(),
        Some(late_snat),
        "the release's flow made after the copy"
    );
    let late_reply = h.ingress(&packets::tcp(INET, 443, NODE, SNAT_PORT + 2, TCP_ACK, b""));
    let late_reply = packets::parse(&late_reply.packet);
    assert_eq!((late_reply.dst, late_reply.dport), (POD, 40_020));
    assert!(
        !pin_names(&pin_dir)
            .iter()
            .any(|name| names::ALL.iter().any(|map| map.name == name.as_str())),
        "the release's pins are gone once merged: {:?}",
        pin_names(&pin_dir)
    );
}

/// The kernel's ids of the loaded programs, in load order.
fn program_ids(h: &Harness) -> Vec<u32> {
    [
        names::PROG_ENI_EGRESS,
        names::PROG_ENI_INGRESS,
        names::PROG_POD_EGRESS,
        names::PROG_POD_INGRESS,
    ]
    .into_iter()
    .map(|name| h.datapath.program(name).unwrap().info().unwrap().id())
    .collect()
}

#[test]
fn a_start_over_its_own_object_and_maps_keeps_the_loaded_programs() {
    let pin_dir = Harness::new_pin_dir();
    let _cleanup = Unpin(pin_dir.clone());
    let syn = packets::tcp(POD, 41_000, INET, 443, 0x02, b"");
    let (first_ids, port) = {
        let mut h = Harness::load_in(pin_dir.clone(), 1024).unwrap();
        assert_eq!(h.datapath.programs_origin(), ProgramsOrigin::Verified);
        h.configure(&vpcnet_agent::snat::SnatSettings::default());
        let port = packets::parse(&h.egress(&syn).packet).sport;
        let ids = program_ids(&h);
        // The agent exits; its pins stay.
        std::mem::forget(h);
        (ids, port)
    };
    // What an earlier object pinned: nothing uses it once this one runs.
    let programs_dir = pin_dir.join(names::LINKS_DIR).join(names::PROGRAMS_DIR);
    let earlier_object = programs_dir.join("0123456789abcdef01234567");
    std::fs::create_dir(&earlier_object).unwrap();

    let mut h = Harness::load_in(pin_dir.clone(), 1024).unwrap();
    assert_eq!(
        h.datapath.programs_origin(),
        ProgramsOrigin::Kept,
        "the same object over the same maps: the loaded programs are kept"
    );
    // The maps that are not pinned are the kept programs' own: the ring
    // of recent flows still holds the flow the first start's programs
    // made (this start's own, fresh, would be empty).
    let (recent, _) = h.datapath.take_recent_flows().expect("the rings");
    let ring = recent.get(&0, 0).unwrap();
    assert_eq!(
        ring.next, 1,
        "the kept programs' ring of recent flows, with the one flow in it"
    );
    assert_eq!(
        program_ids(&h),
        first_ids,
        "the very programs, not loaded again"
    );
    assert!(
        h.datapath
            .program_stats()
            .iter()
            .all(|stats| stats.load_time.is_zero() && stats.processed_insns.is_some()),
        "{:?}",
        h.datapath.program_stats()
    );
    assert!(
        !earlier_object.exists(),
        "the earlier object's programs removed"
    );
    let ack = packets::tcp(POD, 41_000, INET, 443, TCP_ACK, b"");
    assert_eq!(
        packets::parse(&h.egress(&ack).packet).sport,
        port,
        "the flow kept"
    );
    std::mem::forget(h);

    // Another size: the maps are new, and programs that used the old ones
    // cannot be kept.
    let h = Harness::load_in(pin_dir.clone(), 2048).unwrap();
    assert_eq!(h.datapath.programs_origin(), ProgramsOrigin::Verified);
    let resized_ids = program_ids(&h);
    assert!(
        resized_ids.iter().all(|id| !first_ids.contains(id)),
        "{resized_ids:?} against {first_ids:?}"
    );
    assert_eq!(
        packets::parse(&h.egress(&ack).packet).sport,
        port,
        "the flow carried"
    );
    std::mem::forget(h);
    let h = Harness::load_in(pin_dir.clone(), 2048).unwrap();
    assert_eq!(h.datapath.programs_origin(), ProgramsOrigin::Kept);
    assert_eq!(
        program_ids(&h),
        resized_ids,
        "the programs pinned are the resized maps' ones"
    );
    assert_eq!(std::fs::read_dir(&programs_dir).unwrap().count(), 1);
}

#[test]
fn another_nat_size_carries_every_flow_into_maps_of_that_size() {
    let pin_dir = Harness::new_pin_dir();
    let _cleanup = Unpin(pin_dir.clone());
    let ports: Vec<u16> = {
        let mut h = Harness::load_in(pin_dir.clone(), 1024).unwrap();
        h.configure(&vpcnet_agent::snat::SnatSettings::default());
        let ports = (0..100)
            .map(|i| {
                let out = h.egress(&packets::tcp(POD, 41_000 + i, INET, 443, 0x02, b""));
                packets::parse(&out.packet).sport
            })
            .collect();
        // The agent exits; its pins stay.
        std::mem::forget(h);
        ports
    };
    let h = Harness::load_in(pin_dir.clone(), 2048).unwrap();
    assert_eq!(h.table_sizes(), (100, 100), "every flow carried");
    for map in [names::NAT_FWD, names::NAT_REV] {
        let info = MapInfo::from_pin(pins::pin_path(&pin_dir, &layout_of(map))).unwrap();
        assert_eq!(info.max_entries(), 2048, "{map}");
    }
    assert!(
        !pin_names(&pin_dir)
            .iter()
            .any(|name| name.ends_with("_resized")),
        "the smaller maps are gone: {:?}",
        pin_names(&pin_dir)
    );
    // Each flow keeps its port.
    for (i, port) in (0..100).zip(ports) {
        let out = h.egress(&packets::tcp(POD, 41_000 + i, INET, 443, TCP_ACK, b""));
        assert_eq!(packets::parse(&out.packet).sport, port);
    }
    assert_eq!(h.counter(Counter::EgressSnatNew), 100, "carried, not new");
}

#[test]
fn a_newer_layout_is_left_as_it_is_said_and_the_map_starts_empty() {
    let pin_dir = Harness::new_pin_dir();
    let _cleanup = Unpin(pin_dir.clone());
    std::fs::create_dir_all(&pin_dir).unwrap();
    // A newer agent's NAT map: the layout after this agent's, which it does
    // not read.
    let nat = layout_of(names::NAT_FWD);
    let newer = pin_dir.join(format!("{}_v{}", nat.name, nat.layout + 1));
    {
        let mut newer_agent = EbpfLoader::new()
            .default_map_pin_directory(&pin_dir)
            .map_pin_path(names::NAT_FWD, newer.as_path())
            .load(PROGRAMS)
            .unwrap();
        let mut fwd: HashMap<_, FlowKey, NatEntry> =
            HashMap::try_from(newer_agent.map_mut(names::NAT_FWD).unwrap()).unwrap();
        let [(key, entry), _] = release_flows(monotonic_now_ns());
        fwd.insert(key, entry, 0).unwrap();
    }
    unpin_maps_bare_pins_never_had(&pin_dir);
    // The bare-name pins that loader made are the release's: carried.
    let log = Log::default();
    let h = tracing::subscriber::with_default(log.subscriber(), || {
        Harness::load_in(pin_dir.clone(), 1024).unwrap()
    });
    assert_eq!(h.table_sizes().0, 0, "this agent's NAT map starts empty");
    let left = aya::maps::MapData::from_pin(&newer).expect("the newer map is still pinned");
    let left: HashMap<_, FlowKey, NatEntry> =
        HashMap::try_from(aya::maps::Map::from_map_data(left).unwrap()).unwrap();
    assert_eq!(left.keys().count(), 1, "and still holds its flow");
    let said = log.contents();
    let line = said
        .lines()
        .find(|line| line.contains(&newer.display().to_string()))
        .unwrap_or_else(|| panic!("no line names {}: {said}", newer.display()));
    for what in [
        "VPCNET_NAT_FWD".to_owned(),
        format!("layout=Some({})", nat.layout + 1),
        format!("this_agent_layout={}", nat.layout),
        "left as it is".to_owned(),
    ] {
        assert!(line.contains(&what), "{what:?} missing from {line}");
    }
}

/// What the agent logged, for the test to read.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl Log {
    fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + use<> {
        let log = self.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || log.clone())
            .finish()
    }

    fn contents(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Removes a test's pins, also when it fails (the harness's own guard does
/// too; this one covers what a test pinned before a harness existed).
struct Unpin(PathBuf);

impl Drop for Unpin {
    fn drop(&mut self) {
        let _ = vpcnet_agent::datapath::remove_pins(&self.0);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
