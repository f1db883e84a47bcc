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

mod clock;
pub mod generate;
pub mod model;
pub mod policy;
mod tables;
mod world;

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use ipnet::Ipv4Net;
use vpcnet_agent::{
    datapath::{GcStats, ORPHAN_GRACE_NS, monotonic_now_ns},
    policy::Enforcer,
};
use vpcnet_common::{
    cidr::CidrKind,
    counters::Counter,
    maps,
    nat::{FragKey, FragPath, NS_PER_SEC, RecentFlows},
    raw_to_addr,
};
use vpcnet_lab::fuzz_settings;

use self::{
    clock::Clock,
    generate::{Category, Generator},
    model::{Collected, Model, World},
};
use crate::{Harness, TC_ACT_SHOT, TEST_RUN_IFINDEX, packets};

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
    /// Entries of each NAT map and of the stack flows map.
    pub tables: TableSizes,
}

/// How many entries the flow maps hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableSizes {
    pub nat: u32,
    pub stack: u32,
}

impl TableSizes {
    /// The agent's.
    pub const AGENT: Self = Self {
        nat: maps::NAT_DEFAULT_ENTRIES,
        stack: maps::STACK_FLOWS_DEFAULT_ENTRIES,
    };
    /// Small enough that an episode fills them many times over: every new
    /// flow then makes room by early drop, or finds none.
    pub const SMALL: Self = Self { nat: 24, stack: 24 };
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
            tables: TableSizes::AGENT,
        }
    }

    /// The same run with small tables, over a quarter of the packets (an
    /// episode at least).
    #[must_use]
    pub fn with_small_tables(self) -> Self {
        Self {
            packets_per_program: (self.packets_per_program / 4).max(EPISODE_PACKETS / 4),
            tables: TableSizes::SMALL,
            ..self
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
    /// Seconds the model's clock moved on, over all episodes, and the
    /// episodes whose flows had the node's timeouts rather than none.
    pub simulated_seconds: u64,
    pub timed_episodes: u64,
    /// What the collector's passes removed, as the agent counted it.
    pub collected: GcStats,
    pub stack_collected: GcStats,
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
        let _ = writeln!(
            s,
            "  time: {} episodes with the node's timeouts, {} simulated seconds; the collector removed {} NAT flows over, {} orphans, paired {}; {} stack flows over, {} orphans",
            self.timed_episodes,
            self.simulated_seconds,
            self.collected.expired,
            self.collected.orphans,
            self.collected.paired,
            self.stack_collected.expired,
            self.stack_collected.orphans
        );
        for d in &self.details {
            let _ = writeln!(s, "{d}");
        }
        s
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
    maps.set_timeouts(&world.timeouts).expect("timeouts");
    clear(&mut maps.nat_fwd);
    clear(&mut maps.nat_rev);
    clear(&mut maps.stack_flows);
    clear(&mut bench.frags);
    for ring in [&mut bench.recent.0, &mut bench.recent.1] {
        ring.set(0, RecentFlows::EMPTY, 0)
            .expect("emptying a ring of recent flows");
    }
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
    /// The rings of recent NAT flows and stack flows.
    recent: (Array<MapData, RecentFlows>, Array<MapData, RecentFlows>),
    /// The agent's writer of policy rules, over the run's maps.
    enforcer: Enforcer,
    tables: TableSizes,
}

/// Runs the fuzzer as `opts` says.
pub fn run(opts: &Options) -> Report {
    let started = Instant::now();
    let mut report = Report::default();
    let mut h = Harness::load_sized(Harness::new_pin_dir(), opts.tables.nat, opts.tables.stack)
        .unwrap_or_else(|e| {
            panic!("loading the programs (as root, after `cargo xtask setup`): {e:?}")
        });
    let frags = crate::loaded::frag_paths(&h.datapath).expect("the fragment map");
    let recent = h
        .datapath
        .take_recent_flows()
        .expect("the rings of recent flows");
    let enforcer = Enforcer::new(&h.datapath.maps).expect("the policy maps");
    let mut bench = Bench {
        h,
        frags,
        recent,
        enforcer,
        tables: opts.tables,
    };

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

/// Clock jumps, in seconds: most within a short timeout, some past the
/// longer defaults.
const JUMPS: [u64; 14] = [0, 1, 1, 2, 2, 3, 4, 6, 8, 11, 31, 61, 121, 301];

/// One episode: `packets` packets per program from a world and tables of
/// its own, the counters compared after each packet, the tables after
/// each collector's pass and at the end. An episode with timeouts moves
/// the clock on now and then, and runs the collector after some jumps.
fn run_episode(bench: &mut Bench, seed: u64, episode: u64, packets: u64, report: &mut Report) {
    let mut rng = fastrand::Rng::with_seed(seed ^ episode.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let world = world::world(&mut rng, bench.tables);
    let timed = world::timed(&world.timeouts);
    install(bench, &world);
    let mut model = Model::new(world);
    let mut generator = Generator::new(rng.u64(..), world::cast());
    let mut clock = Clock::start();
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
        let jump = (timed && rng.u32(0..48) == 0).then(|| JUMPS[rng.usize(..JUMPS.len())]);
        if jump.is_some() || clock.due() {
            let place = format!("episode {episode} before packet {seq}");
            let step = Step {
                seconds: jump.unwrap_or(0),
                collect: jump.is_some() && rng.u32(0..3) == 0,
                seq,
            };
            step.run(bench, &mut clock, &mut model, &place, report);
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
        let expected = model.run(
            program,
            &generated.packet,
            generated.mark,
            &outcome.packet,
            seq,
        );
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
    tables::compare_tables(
        &tables::real_tables(bench),
        &model.tables,
        &format!("episode {episode}"),
        report,
    );
    report.episodes += 1;
    report.timed_episodes += u64::from(timed);
}

/// A step of the clock before a packet: the model's clock moved on (or
/// only the entries' times written again), and maybe a collector's pass.
struct Step {
    seconds: u64,
    collect: bool,
    /// The next packet.
    seq: u64,
}

impl Step {
    fn run(
        &self,
        bench: &mut Bench,
        clock: &mut Clock,
        model: &mut Model,
        place: &str,
        report: &mut Report,
    ) {
        let was = model.now.tick;
        let wrong = clock.advance(self.seconds, self.seq, &mut bench.h.datapath.maps, model);
        report.simulated_seconds += model.now.tick - was;
        if !wrong.is_empty() {
            report.disagree(format!(
                "{place}: times: {}",
                wrong.into_iter().take(3).collect::<Vec<_>>().join("; ")
            ));
        }
        if self.collect {
            collect(bench, model, place, report);
        }
    }
}

/// The agent's collector's pass over the maps, and the model's: what each
/// removed, and the tables after.
fn collect(bench: &mut Bench, model: &mut Model, place: &str, report: &mut Report) {
    let maps = &bench.h.datapath.maps;
    let now = monotonic_now_ns();
    let timeouts = &model.world.timeouts;
    let nat = maps
        .collect_garbage(timeouts, now)
        .expect("collecting NAT flows");
    let stack = maps
        .collect_stack_flows(timeouts, now)
        .expect("collecting stack flows");
    let ours = Collected {
        expired: nat.expired,
        orphans: nat.orphans,
        paired: nat.paired,
        stack_expired: stack.expired,
        stack_orphans: stack.orphans,
    };
    let theirs = model.collect(ORPHAN_GRACE_NS / NS_PER_SEC);
    let place = format!("{place}, the collector");
    if ours != theirs {
        report.disagree(format!("{place}: removed {ours:?}, model {theirs:?}"));
    }
    for (total, pass) in [
        (&mut report.collected, nat),
        (&mut report.stack_collected, stack),
    ] {
        total.expired += pass.expired;
        total.orphans += pass.orphans;
        total.paired += pass.paired;
    }
    tables::compare_tables(&tables::real_tables(bench), &model.tables, &place, report);
}
