//! Fuzzing the programs: generated packets through each program with
//! `BPF_PROG_TEST_RUN`, every verdict, rewrite, mark, counter and table
//! entry compared with [`model`], a user-space model of the same decisions
//! written independently of the programs.
//!
//! A run is episodes of [`EPISODE_PACKETS`] packets, the four programs in
//! turn on one shared set of tables (a flow one program opens, another
//! answers). Each episode configures the node one way (SNAT or
//! EXTERNALSNAT, each port selection mode and range, a primary ENI or not,
//! the test run's link a branch ENI or not, network policy on with random
//! rules for some pods or off), starts from empty tables, and
//! is generated from the run's seed and its number alone: a disagreement
//! is reported with both, and `VPCNET_FUZZ_EPISODE` runs that episode again.

pub mod generate;
pub mod model;
pub mod policy;

use std::{
    collections::{BTreeMap, HashMap},
    fmt::Write as _,
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use aya::maps::{HashMap as BpfHashMap, MapData};
use ipnet::Ipv4Net;
use vpcnet_agent::policy::{Enforcer, rules::PodRules};
use vpcnet_common::{
    addr_to_raw,
    cidr::CidrKind,
    config::{Config, FLAG_EXTERNAL_SNAT, FLAG_NETWORK_POLICY, RandomizeMode},
    counters::Counter,
    endpoint::{ENDPOINT_BRANCH, ENDPOINT_STRICT, ENI_BRANCH, ENI_PRIMARY, Endpoint, Eni},
    maps,
    nat::{FlowKey, FragKey, FragPath, NatEntry, TCP_ACK_KNOWN, TCP_END_KNOWN, Timeouts},
    raw_to_addr, raw_to_port,
};
use vpcnet_lab::fuzz_settings;

use self::{
    generate::{Cast, Category, Generator},
    model::{Datagram, FirstWent, Half, Model, Tables, World, show_end},
};
use crate::{
    Harness, INET, NODE, NODE_LOCAL_DNS, ONPREM, PEER, POD, POD2, SERVICE_CIDR, TC_ACT_SHOT,
    TEST_RUN_IFINDEX, VPC_CIDRS, packets,
};

/// Packets per episode, all programs together.
pub const EPISODE_PACKETS: u64 = 4000;

/// The four programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Program {
    EniEgress = 0,
    EniIngress = 1,
    PodEgress = 2,
    PodIngress = 3,
}

impl Program {
    pub const ALL: [Self; 4] = [
        Self::EniEgress,
        Self::EniIngress,
        Self::PodEgress,
        Self::PodIngress,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Self::EniEgress => maps::PROG_ENI_EGRESS,
            Self::EniIngress => maps::PROG_ENI_INGRESS,
            Self::PodEgress => maps::PROG_POD_EGRESS,
            Self::PodIngress => maps::PROG_POD_INGRESS,
        }
    }
}

/// How much to fuzz.
#[derive(Clone, Debug)]
pub struct Options {
    pub packets_per_program: u64,
    pub seed: u64,
    /// Only this episode (to replay one a report names).
    pub episode: Option<u64>,
}

/// The seed CI runs.
pub const DEFAULT_SEED: u64 = 0x7670_636e_6574;
/// Packets per program when nothing says otherwise.
pub const DEFAULT_PACKETS_PER_PROGRAM: u64 = 1_000_000;

impl Options {
    /// From the environment ([`fuzz_settings`]).
    pub fn from_env() -> Self {
        let number = |name: &str| {
            std::env::var(name).ok().map(|v| {
                let v = v.trim();
                let parsed = match v.strip_prefix("0x") {
                    Some(hex) => u64::from_str_radix(hex, 16),
                    None => v.parse(),
                };
                parsed.unwrap_or_else(|_| panic!("{name}={v:?}: a whole number"))
            })
        };
        Self {
            packets_per_program: number(fuzz_settings::PACKETS_VAR)
                .unwrap_or(DEFAULT_PACKETS_PER_PROGRAM),
            seed: number(fuzz_settings::SEED_VAR).unwrap_or(DEFAULT_SEED),
            episode: number(fuzz_settings::EPISODE_VAR),
        }
    }
}

/// What a run found.
#[derive(Default)]
pub struct Report {
    pub packets: BTreeMap<Program, u64>,
    pub categories: BTreeMap<Category, u64>,
    /// Counters the programs moved (verdicts and the decisions on the way
    /// to them), by name.
    pub counted: BTreeMap<&'static str, u64>,
    pub disagreements: u64,
    /// The first disagreements, described.
    pub details: Vec<String>,
    pub episodes: u64,
    /// Frames `BPF_PROG_TEST_RUN` refused (shorter than an IP header), not
    /// among the packets counted.
    pub refused: u64,
    pub elapsed: Duration,
}

/// Frames at least this long are never refused by `BPF_PROG_TEST_RUN`: an
/// Ethernet header and the longest IPv4 header.
const REFUSED_BELOW: usize = 14 + 60;

const MAX_DETAILS: usize = 12;

impl Report {
    fn disagree(&mut self, detail: String) {
        self.disagreements += 1;
        if self.details.len() < MAX_DETAILS {
            self.details.push(detail);
        }
    }

    pub fn summary(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "fuzz: {} episodes in {:.1}s, {} disagreements, {} frames refused by the kernel (shorter than an IP header)",
            self.episodes,
            self.elapsed.as_secs_f64(),
            self.disagreements,
            self.refused
        );
        for (program, n) in &self.packets {
            let _ = writeln!(s, "  {:<12} {n} packets", program.name());
        }
        let cats: Vec<String> = self
            .categories
            .iter()
            .map(|(c, n)| format!("{c:?} {n}"))
            .collect();
        let _ = writeln!(s, "  categories: {}", cats.join(", "));
        let counted: Vec<String> = self
            .counted
            .iter()
            .map(|(c, n)| format!("{c} {n}"))
            .collect();
        let _ = writeln!(s, "  counters moved: {}", counted.join(", "));
        for d in &self.details {
            let _ = writeln!(s, "{d}");
        }
        s
    }
}

/// A local pod of the world: address, link, ENI link, flags.
struct PodSpec {
    addr: Ipv4Addr,
    ifindex: u32,
    eni_ifindex: u32,
    flags: u32,
}

const PRIMARY_ENI: u32 = 2;
const SECONDARY_ENI: u32 = 3;
const BRANCH_ENI: u32 = 4;
/// An ENI link no ENI map entry names.
const MISSING_ENI: u32 = 9;
const STRICT_POD: Ipv4Addr = Ipv4Addr::new(10, 20, 11, 30);
const ORPHAN_POD: Ipv4Addr = Ipv4Addr::new(10, 20, 11, 40);

fn pod_specs() -> [PodSpec; 4] {
    [
        PodSpec {
            addr: POD,
            ifindex: TEST_RUN_IFINDEX,
            eni_ifindex: PRIMARY_ENI,
            flags: 0,
        },
        PodSpec {
            addr: STRICT_POD,
            ifindex: TEST_RUN_IFINDEX,
            eni_ifindex: BRANCH_ENI,
            flags: ENDPOINT_BRANCH | ENDPOINT_STRICT,
        },
        PodSpec {
            addr: ORPHAN_POD,
            ifindex: TEST_RUN_IFINDEX,
            eni_ifindex: MISSING_ENI,
            flags: 0,
        },
        PodSpec {
            addr: POD2,
            ifindex: 5,
            eni_ifindex: SECONDARY_ENI,
            flags: 0,
        },
    ]
}

fn mac(kind: u8, addr: Ipv4Addr) -> [u8; 6] {
    let o = addr.octets();
    [0x02, kind, o[0], o[1], o[2], o[3]]
}

fn raw(addr: Ipv4Addr) -> u32 {
    addr_to_raw(addr.octets())
}

/// The episode's node: the same pods and ENIs always; SNAT settings, the
/// primary ENI and the test run link's role drawn from `rng`.
fn world(rng: &mut fastrand::Rng) -> World {
    let randomize = [
        RandomizeMode::Prng,
        RandomizeMode::HashRandom,
        RandomizeMode::None,
    ][rng.usize(0..3)];
    // Ranges no episode's flows to one remote endpoint can fill: which
    // closed flow a full range gives its port up from is `port_allocation`'s
    // to test, not the model's to predict.
    let (port_min, port_max) =
        [(1024, 65535), (1024, 65535), (30000, 30999), (0, 0)][rng.usize(0..4)];
    let config = Config {
        node_addr: raw(NODE),
        flags: if rng.u32(0..5) == 0 {
            FLAG_EXTERNAL_SNAT
        } else {
            0
        },
        randomize: randomize as u32,
        port_min,
        port_max,
        hash_seed: rng.u32(..),
        primary_ifindex: if rng.u32(0..10) == 0 { 0 } else { PRIMARY_ENI },
        // vpcnet's default bits, the ones the generator marks with.
        mark_decided_bit: 0,
        mark_via_service_bit: 0,
    };
    let mut prefixes = vec![];
    for cidr in VPC_CIDRS {
        let net: Ipv4Net = cidr.parse().expect("VPC CIDR");
        prefixes.push((raw(net.network()), net.prefix_len(), CidrKind::Vpc));
    }
    if rng.bool() {
        prefixes.push((raw(Ipv4Addr::new(192, 0, 2, 0)), 24, CidrKind::Excluded));
    }
    prefixes.push((raw(NODE), 32, CidrKind::Local));
    prefixes.push((raw(NODE_LOCAL_DNS), 32, CidrKind::Local));
    let service: Ipv4Net = SERVICE_CIDR.parse().expect("service CIDR");
    prefixes.push((
        raw(service.network()),
        service.prefix_len(),
        CidrKind::Service,
    ));
    let endpoints = pod_specs()
        .iter()
        .map(|p| {
            let ep = Endpoint {
                ifindex: p.ifindex,
                eni_ifindex: p.eni_ifindex,
                mac: mac(1, p.addr),
                host_mac: mac(2, p.addr),
                flags: p.flags,
            };
            (raw(p.addr), ep)
        })
        .collect();
    let gateway = raw(Ipv4Addr::new(10, 20, 11, 1));
    let mut enis: HashMap<u32, Eni> = [
        (
            PRIMARY_ENI,
            Eni {
                gateway,
                flags: ENI_PRIMARY,
            },
        ),
        (SECONDARY_ENI, Eni { gateway, flags: 0 }),
        (
            BRANCH_ENI,
            Eni {
                gateway,
                flags: ENI_BRANCH,
            },
        ),
    ]
    .into();
    if rng.u32(0..10) == 0 {
        enis.insert(
            TEST_RUN_IFINDEX,
            Eni {
                gateway,
                flags: ENI_BRANCH,
            },
        );
    }
    let mut config = config;
    let policy = episode_policy(rng, &mut config);
    World {
        config,
        prefixes,
        endpoints,
        enis,
        ifindex: TEST_RUN_IFINDEX,
        policy,
    }
}

/// A third of the episodes judge policy: policy on, and rules for some
/// pods, over the addresses and ports the generator sends to.
fn episode_policy(rng: &mut fastrand::Rng, config: &mut Config) -> BTreeMap<u32, PodRules> {
    if rng.u32(0..3) != 0 {
        return BTreeMap::new();
    }
    config.flags |= FLAG_NETWORK_POLICY;
    let cast = cast();
    let addresses: Vec<Ipv4Addr> = cast
        .others
        .iter()
        .chain(&cast.pods)
        .chain([&NODE])
        .copied()
        .collect();
    policy::pod_rules(rng, &cast.pods, &addresses, &generate::PORTS)
        .into_iter()
        .map(|(addr, rules)| (raw(addr), rules))
        .collect()
}

fn cast() -> Cast {
    let specs = pod_specs();
    Cast {
        node: NODE,
        senders: specs
            .iter()
            .filter(|p| p.ifindex == TEST_RUN_IFINDEX)
            .map(|p| (p.addr, mac(1, p.addr)))
            .collect(),
        pods: specs.iter().map(|p| p.addr).collect(),
        others: vec![
            PEER,
            Ipv4Addr::new(100, 64, 3, 4),
            Ipv4Addr::new(10, 20, 11, 99),
            INET,
            Ipv4Addr::new(203, 0, 113, 77),
            ONPREM,
            NODE_LOCAL_DNS,
            Ipv4Addr::new(10, 100, 0, 10),
        ],
    }
}

/// The real tables, as the model keeps them.
fn real_tables(h: &Harness, frags: &BpfHashMap<MapData, FragKey, FragPath>) -> Tables {
    let halves = |map: &aya::maps::HashMap<MapData, FlowKey, NatEntry>| -> HashMap<FlowKey, Half> {
        map.iter()
            .filter_map(Result::ok)
            .map(|(k, e)| {
                (
                    k,
                    Half {
                        addr: e.addr,
                        port: e.port,
                        kind: e.kind,
                        seen: e.seen,
                        // Numbers without their bit mean nothing.
                        seq_end: if e.tcp & TCP_END_KNOWN == 0 {
                            0
                        } else {
                            e.seq_end
                        },
                        ack: if e.tcp & TCP_ACK_KNOWN == 0 { 0 } else { e.ack },
                        tcp: e.tcp,
                        retrans: e.retrans,
                    },
                )
            })
            .collect()
    };
    let maps = &h.datapath.maps;
    Tables {
        nat_fwd: halves(&maps.nat_fwd),
        nat_rev: halves(&maps.nat_rev),
        stack: halves(&maps.stack_flows),
        policy_flows: policy::real_flows(maps),
        frags: frags
            .iter()
            .filter_map(Result::ok)
            .map(|(k, p)| {
                let d = Datagram {
                    saddr: k.saddr,
                    daddr: k.daddr,
                    id: k.id,
                    proto: k.proto,
                    hook: k.hook,
                };
                (
                    d,
                    FirstWent {
                        addr: p.addr,
                        ifindex: p.ifindex,
                        via: p.via,
                    },
                )
            })
            .collect(),
    }
}

fn clear<K: aya::Pod + Eq, V: aya::Pod>(map: &mut BpfHashMap<MapData, K, V>) {
    let keys: Vec<K> = map.keys().filter_map(Result::ok).collect();
    for k in keys {
        let _ = map.remove(&k);
    }
}

/// Puts the episode's world into the maps and empties every table.
fn install(bench: &mut Bench, world: &World) {
    let maps = &mut bench.h.datapath.maps;
    let prefixes: Vec<(Ipv4Net, CidrKind)> = world
        .prefixes
        .iter()
        .map(|(net, len, kind)| {
            (
                Ipv4Net::new(Ipv4Addr::from(raw_to_addr(*net)), *len).expect("prefix"),
                *kind,
            )
        })
        .collect();
    maps.set_cidrs(&prefixes).expect("prefixes");
    for (addr, ep) in &world.endpoints {
        maps.set_endpoint(Ipv4Addr::from(raw_to_addr(*addr)), ep)
            .expect("endpoint");
    }
    let _ = maps.enis.remove(&TEST_RUN_IFINDEX);
    for (ifindex, eni) in &world.enis {
        maps.set_eni(*ifindex, eni).expect("ENI");
    }
    // After the ENIs: writing the primary one sets its link in the
    // configuration, which some episodes leave unset (a node whose primary
    // ENI is not known yet).
    maps.set_config(&world.config).expect("config");
    // Nothing expires within a run: which flow a port goes to stays the
    // model's to know, not the clock's.
    let forever = 1_000_000_000;
    let mut timeouts = Timeouts::default();
    for (_, field) in Timeouts::SYSCTLS {
        *field(&mut timeouts) = forever;
    }
    maps.set_timeouts(&timeouts).expect("timeouts");
    clear(&mut maps.nat_fwd);
    clear(&mut maps.nat_rev);
    clear(&mut maps.stack_flows);
    clear(&mut bench.frags);
    policy::install(&mut bench.enforcer, maps, &world.policy);
}

/// Every counter, summed over the CPUs (one batch read).
fn counters(h: &Harness) -> Vec<(Counter, u64)> {
    h.datapath.maps.counters().expect("counters")
}

/// How the counters moved from `before` to `after` against what the model
/// counted for the packet; `None` when they agree. How many candidates a
/// port search tried depends on its random candidates (the port it settled
/// on is what is checked): `AllocRetry` is left out.
fn counters_disagree(
    before: &[(Counter, u64)],
    after: &[(Counter, u64)],
    counted: &[Counter],
) -> Option<String> {
    let mut wrong = Vec::new();
    for ((counter, was), (_, is)) in before.iter().zip(after) {
        if *counter == Counter::AllocRetry {
            continue;
        }
        let moved = is - was;
        let predicted = counted.iter().filter(|c| *c == counter).count() as u64;
        if moved != predicted {
            wrong.push(format!(
                "{} moved by {moved}, model {predicted}",
                counter.name()
            ));
        }
    }
    (!wrong.is_empty()).then(|| format!("counters: {}", wrong.join(", ")))
}

/// Whether the IP header checksum and the L4 one (TCP, UDP, ICMP) hold, for
/// a whole datagram that fills its frame; `None` for anything else.
fn checksums_hold(frame: &[u8]) -> Option<(bool, bool)> {
    if frame.len() < 34 || frame[12..14] != [0x08, 0x00] || frame[14] >> 4 != 4 {
        return None;
    }
    let ihl = usize::from(frame[14] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([frame[16], frame[17]]));
    let frag = u16::from_be_bytes([frame[20], frame[21]]) & 0x3fff;
    let l4_min = match frame[23] {
        6 => 20,
        17 | 1 => 8,
        _ => return None,
    };
    if ihl < 20 || frag != 0 || total != frame.len() - 14 || total < ihl + l4_min {
        return None;
    }
    let p = packets::parse(frame);
    Some((p.ip_csum_ok, p.l4_csum_ok))
}

/// Whether two checksums are the same ones' complement value.
fn same_sum(a: u16, b: u16) -> bool {
    a == b || (a | b == 0xffff && (a == 0 || b == 0))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// How the program's output differs from the model's, if it does.
fn compare(
    expected: &model::Expected,
    action: i32,
    packet: &[u8],
    mark: u32,
    input_sums: Option<(bool, bool)>,
) -> Vec<String> {
    let mut found = Vec::new();
    if action != expected.action {
        found.push(format!("action {action}, model {}", expected.action));
    }
    if mark != expected.mark {
        found.push(format!("mark {mark:#x}, model {:#x}", expected.mark));
    }
    if let Some(why) = &expected.bad_choice {
        found.push(format!("chose {why}"));
    }
    if packet.len() == expected.packet.len() {
        let mut at = 0;
        while at < packet.len() {
            if expected.checksums.contains(&at) && at + 1 < packet.len() {
                let (a, b) = (
                    u16::from_be_bytes([packet[at], packet[at + 1]]),
                    u16::from_be_bytes([expected.packet[at], expected.packet[at + 1]]),
                );
                if !same_sum(a, b) {
                    found.push(format!("checksum at {at}: {a:#06x}, model {b:#06x}"));
                }
                at += 2;
                continue;
            }
            if packet[at] != expected.packet[at] {
                found.push(format!(
                    "byte {at}: {:#04x}, model {:#04x}",
                    packet[at], expected.packet[at]
                ));
            }
            at += 1;
        }
    } else {
        found.push(format!(
            "length {}, model {}",
            packet.len(),
            expected.packet.len()
        ));
    }
    // Checked apart from the model: a rewrite keeps valid checksums valid.
    if action != TC_ACT_SHOT
        && let (Some(before), Some(after)) = (input_sums, checksums_hold(packet))
        && (before.0 && !after.0 || before.1 && !after.1)
    {
        found.push(format!(
            "checksums valid before, not after (IP {}, L4 {})",
            after.0, after.1
        ));
    }
    found
}

/// The programs loaded once for a run, and the fragment map, which the
/// harness's typed maps leave out.
struct Bench {
    h: Harness,
    frags: BpfHashMap<MapData, FragKey, FragPath>,
    /// The agent's writer of policy rules, over the run's maps.
    enforcer: Enforcer,
}

/// Runs the fuzzer as `opts` says.
pub fn run(opts: &Options) -> Report {
    let started = Instant::now();
    let mut report = Report::default();
    let h =
        Harness::load_in(Harness::new_pin_dir(), maps::NAT_DEFAULT_ENTRIES).unwrap_or_else(|e| {
            panic!("loading the programs (as root, after `cargo xtask setup`): {e:?}")
        });
    let frags = crate::loaded::frag_paths(&h.datapath).expect("the fragment map");
    let enforcer = Enforcer::new(&h.datapath.maps).expect("the policy maps");
    let mut bench = Bench { h, frags, enforcer };

    let per_episode = EPISODE_PACKETS / 4;
    if let Some(episode) = opts.episode {
        run_episode(&mut bench, opts.seed, episode, per_episode, &mut report);
    } else {
        let mut left = opts.packets_per_program;
        let mut episode = 0;
        while left > 0 {
            let packets = left.min(per_episode);
            run_episode(&mut bench, opts.seed, episode, packets, &mut report);
            left -= packets;
            episode += 1;
        }
    }
    report.elapsed = started.elapsed();
    report
}

/// One episode: `packets` packets per program from a world and tables of
/// its own, the counters compared after each packet, the tables at the
/// end.
fn run_episode(bench: &mut Bench, seed: u64, episode: u64, packets: u64, report: &mut Report) {
    let mut rng = fastrand::Rng::with_seed(seed ^ episode.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let world = world(&mut rng);
    install(bench, &world);
    let mut model = Model::new(world);
    let mut generator = Generator::new(rng.u64(..), cast());
    // Compared packet by packet: a counter off shows at its packet.
    let mut before = counters(&bench.h);
    // Each program runs `packets` packets; frames the kernel refuses do not
    // count.
    let mut ran = [0u64; 4];
    let mut index = 0u64;
    while ran.iter().any(|&n| n < packets) {
        let seq = index;
        index += 1;
        let program = Program::ALL[usize::try_from(seq % 4).unwrap_or(0)];
        if ran[program as usize] >= packets {
            continue;
        }
        let generated = generator.next(program, &model);
        let place = format!(
            "episode {episode} packet {seq} ({}, {:?})",
            program.name(),
            generated.category
        );
        let (outcome, mark) =
            match bench
                .h
                .try_run_with_mark(program.name(), &generated.packet, generated.mark)
            {
                Ok(ran) => ran,
                Err(e) => {
                    // Only frames shorter than the longest IPv4 header may be refused.
                    if generated.packet.len() >= REFUSED_BELOW {
                        report.disagree(format!(
                            "{place}: the kernel refused a {}-byte frame: {e}\n  in: {}",
                            generated.packet.len(),
                            hex(&generated.packet)
                        ));
                    }
                    report.refused += 1;
                    continue;
                }
            };
        ran[program as usize] += 1;
        *report.packets.entry(program).or_default() += 1;
        *report.categories.entry(generated.category).or_default() += 1;
        let expected = model.run(program, &generated.packet, generated.mark, &outcome.packet);
        for c in &expected.counted {
            *report.counted.entry(c.name()).or_default() += 1;
        }
        let mut found = compare(
            &expected,
            outcome.action,
            &outcome.packet,
            mark,
            checksums_hold(&generated.packet),
        );
        let after = counters(&bench.h);
        found.extend(counters_disagree(&before, &after, &expected.counted));
        before = after;
        if !found.is_empty() {
            report.disagree(format!(
                "{place}, mark {:#x}, model counted {:?}: {}\n  in:    {}\n  out:   {}\n  model: {}",
                generated.mark,
                expected.counted,
                found.join("; "),
                hex(&generated.packet),
                hex(&outcome.packet),
                hex(&expected.packet),
            ));
        }
    }
    compare_tables(
        &real_tables(&bench.h, &bench.frags),
        &model.tables,
        episode,
        report,
    );
    report.episodes += 1;
}

/// A flow key as `source:port > destination:port/protocol`, ports in host
/// order.
fn show(k: &FlowKey) -> String {
    format!(
        "{}:{} > {}:{}/{}",
        Ipv4Addr::from(raw_to_addr(k.saddr)),
        raw_to_port(k.sport),
        Ipv4Addr::from(raw_to_addr(k.daddr)),
        raw_to_port(k.dport),
        k.proto
    )
}

fn compare_tables(real: &Tables, model: &Tables, episode: u64, report: &mut Report) {
    for (name, ours, theirs) in [
        ("NAT forward", &real.nat_fwd, &model.nat_fwd),
        ("NAT reverse", &real.nat_rev, &model.nat_rev),
        ("stack flows", &real.stack, &model.stack),
    ] {
        let wrong: Vec<String> = ours
            .iter()
            .filter(|(k, v)| theirs.get(k) != Some(v))
            .map(|(k, v)| format!("{} = {v:?}, model {:?}", show(k), theirs.get(k)))
            .chain(
                theirs
                    .iter()
                    .filter(|(k, _)| !ours.contains_key(k))
                    .map(|(k, v)| format!("{} missing, model {v:?}", show(k))),
            )
            .take(3)
            .collect();
        if !wrong.is_empty() {
            report.disagree(format!(
                "episode {episode}: {name} table: {}",
                wrong.join("; ")
            ));
        }
    }
    let wrong: Vec<String> = real
        .policy_flows
        .iter()
        .filter(|(c, opener)| model.policy_flows.get(c) != Some(opener))
        .map(|(c, opener)| {
            format!(
                "{c} opened by {}, model {}",
                show_end(*opener),
                model
                    .policy_flows
                    .get(c)
                    .map_or_else(|| "none".to_owned(), |o| show_end(*o))
            )
        })
        .chain(
            model
                .policy_flows
                .iter()
                .filter(|(c, _)| !real.policy_flows.contains_key(c))
                .map(|(c, opener)| format!("{c} missing, model opened by {}", show_end(*opener))),
        )
        .take(3)
        .collect();
    if !wrong.is_empty() {
        report.disagree(format!(
            "episode {episode}: policy flows table: {}",
            wrong.join("; ")
        ));
    }
    if real.frags != model.frags {
        report.disagree(format!(
            "episode {episode}: fragment table has {} entries, model {}",
            real.frags.len(),
            model.frags.len()
        ));
    }
}
