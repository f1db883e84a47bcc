//! The fuzz's clock: time passes for the programs as the model says.
//!
//! The programs read the kernel's clock (`bpf_ktime_get_ns`), which no
//! test sets. What they compare it with is the times in their entries, and
//! those the fuzz can write: to move the model's clock on by some seconds,
//! [`Clock::advance`] rewrites every entry's times so that each is as old,
//! measured from now, as the model says (its whole seconds, plus a few
//! nanoseconds that keep the packets of one second in order). A program's
//! comparison of "now" with an entry then differs from the model's whole
//! seconds by the real time since the clock last wrote, which the clock
//! keeps under a second by writing again ([`Clock::due`]) before it grows.
//!
//! Before writing, it checks the times the programs wrote against the
//! model's: an entry the model says a packet of this second touched must
//! have a time from this second, every other the time the clock wrote.

use std::time::{Duration, Instant};

use aya::maps::{HashMap as BpfHashMap, MapData};
use vpcnet_agent::datapath::{DatapathMaps, monotonic_now_ns};
use vpcnet_common::nat::{FlowKey, NS_PER_SEC, NatEntry};

use super::model::{Connection, Half, Model, Stamp};

/// Nanoseconds set aside below each second for the packets' order: more
/// than an episode's packets.
const SEQ_SPAN_NS: u64 = 1_000_000;

/// Real time the clock lets pass between two writes; the programs'
/// comparisons hold while it stays under a second.
const REWRITE_AFTER: Duration = Duration::from_millis(200);

pub struct Clock {
    /// The model's second, and when (real, the programs' clock) it began.
    tick: u64,
    base_ns: u64,
    base: Instant,
    /// The first packet of this second: times from before it are the
    /// clock's own.
    since_seq: u64,
    /// The model's clock goes no further than this: the times it writes
    /// are real times this many seconds back, which must be after boot.
    last_tick: u64,
}

impl Clock {
    pub fn start() -> Self {
        let base_ns = monotonic_now_ns();
        Self {
            tick: 0,
            base_ns,
            base: Instant::now(),
            since_seq: 0,
            last_tick: base_ns.saturating_sub(SEQ_SPAN_NS) / NS_PER_SEC,
        }
    }

    /// Whether the real time since the clock last wrote calls for writing
    /// again.
    pub fn due(&self) -> bool {
        self.base.elapsed() >= REWRITE_AFTER
    }

    /// The real time the clock writes for the model's `stamp`.
    fn real(&self, stamp: Stamp) -> u64 {
        self.base_ns
            - (self.tick - stamp.tick) * NS_PER_SEC
            - (SEQ_SPAN_NS - stamp.seq.min(SEQ_SPAN_NS - 1))
    }

    /// What is wrong with the real time `real` of a time the model says is
    /// `stamp`, if anything.
    fn check(&self, what: &str, real: u64, stamp: Stamp, wrong: &mut Vec<String>) {
        let fine = if stamp.tick == self.tick && stamp.seq >= self.since_seq {
            real > self.base_ns
        } else {
            real == self.real(stamp)
        };
        if !fine {
            let from_start = i128::from(real) - i128::from(self.base_ns);
            wrong.push(format!(
                "{what}: {}ns {} the second began, model: second {} packet {} (now second {}, from packet {})",
                from_start.abs(),
                if from_start < 0 { "before" } else { "after" },
                stamp.tick,
                stamp.seq,
                self.tick,
                self.since_seq
            ));
        }
    }

    /// Moves the model's clock on by `seconds` (capped at
    /// [`Clock::last_tick`]), the next packet numbered `next_seq`: checks
    /// the programs' times against the model's, then rewrites every entry.
    /// Returns what was wrong.
    pub fn advance(
        &mut self,
        seconds: u64,
        next_seq: u64,
        maps: &mut DatapathMaps,
        model: &mut Model,
    ) -> Vec<String> {
        let mut wrong = Vec::new();
        let read = |map: &BpfHashMap<MapData, FlowKey, NatEntry>,
                    halves: &std::collections::HashMap<FlowKey, Half>| {
            map.iter()
                .filter_map(Result::ok)
                .filter_map(|(k, e)| Some((k, e, *halves.get(&k)?)))
                .collect::<Vec<_>>()
        };
        let tables = &model.tables;
        let entries = [
            ("NAT forward", read(&maps.nat_fwd, &tables.nat_fwd)),
            ("NAT reverse", read(&maps.nat_rev, &tables.nat_rev)),
            ("stack flows", read(&maps.stack_flows, &tables.stack)),
        ];
        for (name, entries) in &entries {
            for (k, e, half) in entries {
                self.check(
                    &format!("{name} {k:?} last seen"),
                    e.last_seen_ns,
                    half.last,
                    &mut wrong,
                );
                self.check(
                    &format!("{name} {k:?} created"),
                    e.created_ns,
                    half.created,
                    &mut wrong,
                );
            }
        }
        let policy: Vec<_> = maps
            .policy_flows
            .iter()
            .filter_map(Result::ok)
            .filter_map(|(k, f)| {
                let track = tables.policy_flows.get(&Connection::of(&k))?;
                Some((k, f, track.last))
            })
            .collect();
        for (k, f, last) in &policy {
            self.check(
                &format!("policy flow {k:?}"),
                f.last_seen_ns,
                *last,
                &mut wrong,
            );
        }

        self.tick = (self.tick + seconds).min(self.last_tick.max(self.tick));
        self.base_ns = monotonic_now_ns();
        self.base = Instant::now();
        self.since_seq = next_seq;
        model.now = Stamp {
            tick: self.tick,
            seq: next_seq,
        };
        let [(_, fwd), (_, rev), (_, stack)] = entries;
        rewrite(self, &mut maps.nat_fwd, fwd);
        rewrite(self, &mut maps.nat_rev, rev);
        rewrite(self, &mut maps.stack_flows, stack);
        for (k, mut f, last) in policy {
            f.last_seen_ns = self.real(last);
            let _ = maps.policy_flows.insert(k, f, 0);
        }
        wrong
    }
}

fn rewrite(
    clock: &Clock,
    map: &mut BpfHashMap<MapData, FlowKey, NatEntry>,
    entries: Vec<(FlowKey, NatEntry, Half)>,
) {
    for (k, mut e, half) in entries {
        e.last_seen_ns = clock.real(half.last);
        e.created_ns = clock.real(half.created);
        let _ = map.insert(k, e, 0);
    }
}
