//! The four programs against a model of them written independently
//! (`vpcnet_bpf_tests::fuzz`): generated packets through `BPF_PROG_TEST_RUN`,
//! each verdict, rewrite, checksum, mark, counter, table entry and entry
//! time compared, on a clock the fuzz moves on (flows end by their
//! timeouts, the agent's collector runs), with port ranges of a few ports.
//!
//! `VPCNET_FUZZ_PACKETS` sets the packets per program (1,000,000 unless
//! set; `cargo xtask test` sets fewer in the VMs), `VPCNET_FUZZ_SEED` the
//! seed (a fixed one unless set), `VPCNET_FUZZ_EPISODE` replays one
//! episode of a report.

use vpcnet_bpf_tests::fuzz::{self, Options, Report};
use vpcnet_common::counters::Counter;

/// Runs the fuzz as `opts` says and asserts the programs and the model
/// agreed on every packet.
fn agree(opts: &Options) -> Report {
    println!(
        "fuzz: {} packets per program, seed {:#x}, tables of {:?}{}",
        opts.packets_per_program,
        opts.seed,
        opts.tables,
        opts.episode
            .map_or(String::new(), |e| format!(", episode {e} only"))
    );
    let report = fuzz::run(opts);
    println!("{}", report.summary());
    assert_eq!(
        report.disagreements,
        0,
        "the programs and the model disagree:\n{}",
        report.summary()
    );
    for program in fuzz::Program::ALL {
        let ran = report.packets.get(&program).copied().unwrap_or(0);
        assert!(
            opts.episode.is_some() || ran >= opts.packets_per_program,
            "{}: {ran} packets, {} asked",
            program.name(),
            opts.packets_per_program
        );
    }
    report
}

/// Episodes enough for every rare path to come up: CI's runs here have
/// 300 and 75 (the VMs' runs are for the kernels' verdicts, and shorter).
const EPISODES_TO_REACH_ALL: u64 = 50;

/// Asserts a run long enough went where it was meant to: each of
/// `counters` moved.
fn reached(report: &Report, counters: &[Counter]) {
    if report.episodes < EPISODES_TO_REACH_ALL {
        return;
    }
    let missed: Vec<&str> = counters
        .iter()
        .map(|c| c.name())
        .filter(|name| !report.counted.contains_key(name))
        .collect();
    assert!(
        missed.is_empty(),
        "the fuzz never reached {missed:?}:\n{}",
        report.summary()
    );
}

#[test]
fn every_verdict_and_rewrite_agrees_with_the_model() {
    let opts = Options::from_env();
    let report = agree(&opts);
    // Flows over by their timeouts and closed flows holding every port of
    // a small range give their ports up; the collector removes flows over.
    reached(
        &report,
        &[
            Counter::EgressTakeover,
            Counter::AllocOldestClosed,
            Counter::DropNatNoPort,
        ],
    );
    assert!(
        report.episodes < EPISODES_TO_REACH_ALL || report.collected.expired > 0,
        "the clock never moved flows past their timeouts:\n{}",
        report.summary()
    );
}

#[test]
fn with_tables_full_every_verdict_agrees_with_the_model() {
    let opts = Options::from_env().with_small_tables();
    let report = agree(&opts);
    reached(
        &report,
        &[
            Counter::NatEarlyDrop,
            Counter::StackFlowEarlyDrop,
            Counter::DropNatTableFull,
            Counter::StackFlowUntracked,
        ],
    );
}
