//! How big the slowest tests run, as environment variables: each test
//! reads its own and has a full size of its own; `cargo xtask test` sets
//! smaller ones (into the VMs' scripts too) unless it runs `--full`. Both
//! read these names, so each is written once. The fuzz test's packets are
//! [`crate::fuzz_settings::PACKETS_VAR`].

/// Branch pods the branch-pod churn of `security_groups` makes.
pub const BRANCH_POD_CHURN_VAR: &str = "VPCNET_SGP_CHURN_PODS";

/// Pod operations (ADDs, DELs, agent kills) `cri_churn` makes.
pub const CRI_CHURN_OPS_VAR: &str = "VPCNET_CHURN_OPS";

/// Simulated days `simulated_days` lives through.
pub const SIMULATED_DAYS_VAR: &str = "VPCNET_SIMULATED_DAYS";

/// The enforcing modes `routing_differential`'s paths run in, comma
/// separated (`strict,standard`, both, unless set).
pub const ROUTING_DIFFERENTIAL_MODES_VAR: &str = "VPCNET_ROUTING_DIFFERENTIAL_MODES";

/// An image archive `cargo xtask test` built from the suite's binaries
/// just before the tests: the image test's first build (it builds the
/// second and compares), so the suite builds that image twice, not thrice.
pub const SUITE_IMAGE_VAR: &str = "VPCNET_SUITE_IMAGE";
