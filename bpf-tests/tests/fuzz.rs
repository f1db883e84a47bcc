//! The four programs against a model of them written independently
//! (`vpcnet_bpf_tests::fuzz`): generated packets through `BPF_PROG_TEST_RUN`,
//! each verdict, rewrite, checksum, mark, counter and table entry compared.
//!
//! `VPCNET_FUZZ_PACKETS` sets the packets per program (1,000,000 unless
//! set; `cargo xtask test` sets fewer in the VMs), `VPCNET_FUZZ_SEED` the
//! seed (a fixed one unless set), `VPCNET_FUZZ_EPISODE` replays one
//! episode of a report.

use vpcnet_bpf_tests::fuzz::{self, Options};

#[test]
fn every_verdict_and_rewrite_agrees_with_the_model() {
    let opts = Options::from_env();
    println!(
        "fuzz: {} packets per program, seed {:#x}{}",
        opts.packets_per_program,
        opts.seed,
        opts.episode
            .map_or(String::new(), |e| format!(", episode {e} only"))
    );
    let report = fuzz::run(&opts);
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
}
