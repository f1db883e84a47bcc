//! The fuzz test's settings (`vpcnet-bpf-tests`' `fuzz`), as environment
//! variables: the test reads them, `cargo xtask test` sets them (into the
//! VMs' scripts too). Both read these names, so each is written once.

/// Packets per program.
pub const PACKETS_VAR: &str = "VPCNET_FUZZ_PACKETS";
/// The seed of the run (decimal, or hexadecimal with `0x`).
pub const SEED_VAR: &str = "VPCNET_FUZZ_SEED";
/// One episode of a report to run again.
pub const EPISODE_VAR: &str = "VPCNET_FUZZ_EPISODE";
