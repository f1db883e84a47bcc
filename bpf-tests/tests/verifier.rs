//! The programs load on the running kernel with room to spare: each one's
//! processed instructions within half the verifier's limit, and its
//! deepest call chain within 448 of the 512 stack bytes under the pre-6.9
//! rounding (6.1 refuses what 6.18 takes otherwise). Run on every kernel
//! of the matrix (`cargo xtask test --kernel all`); the table it prints is
//! the one `vpcnet-agent verifier` prints.

use std::io::Write as _;

use vpcnet_agent::datapath::{PROGRAMS, verifier};
use vpcnet_bpf_tests::Harness;

#[test]
fn every_program_loads_within_its_budgets() {
    let _lock = vpcnet_lab::serial();
    let harness = Harness::lab_default();
    let release = verifier::kernel_release();
    let budgets = verifier::budgets(harness.datapath.program_stats(), PROGRAMS, &release)
        .expect("reading the programs' call chains");
    // Straight to stdout, past libtest's capture: the table is the point of
    // a run on each kernel of the matrix.
    let table = verifier::table(&release, &budgets);
    let _ = writeln!(std::io::stdout().lock(), "\n{table}");
    let names: Vec<&str> = budgets.iter().map(|b| b.stats.name).collect();
    assert_eq!(
        names.len(),
        4,
        "every program was loaded and measured: {names:?}"
    );
    let overruns: Vec<String> = budgets
        .iter()
        .flat_map(verifier::Budget::overruns)
        .collect();
    assert!(overruns.is_empty(), "over budget:\n{}", overruns.join("\n"));
}
