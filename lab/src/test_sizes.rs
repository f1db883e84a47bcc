//! How big the slowest tests run, as environment variables: each test
//! reads its own and has a full size of its own; `cargo xtask test` sets
//! smaller ones (into the VMs' scripts too) unless it runs `--full`. Both
//! read these names, so each is written once. The fuzz test's packets are
//! [`crate::fuzz_settings::PACKETS_VAR`].

/// The value of the size variable `name`, or `default` when it is unset.
///
/// # Panics
///
/// When it is set to something that does not parse: a typo must not run a
/// test at a size nobody asked for.
#[must_use]
pub fn size_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).map_or(default, |value| {
        value
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?}: not a size"))
    })
}

/// Connections of `time_wait`'s burst from one pod (each pod of its paced
/// run then makes an eighth as many).
pub const TIME_WAIT_CONNECTIONS_VAR: &str = "VPCNET_TIME_WAIT_CONNECTIONS";

/// The seconds a lab's agent may take to print `READY` (90 unless set):
/// `cargo xtask test` sets more in the VMs, whose emulated CPU can take a
/// minute to verify the programs of a first start when the machine is
/// busy, and whose earlier releases wait for `iptables -S` besides.
pub const AGENT_READY_SECS_VAR: &str = "VPCNET_LAB_AGENT_READY_SECS";

/// Branch pods the branch-pod churn of `security_groups` makes.
pub const BRANCH_POD_CHURN_VAR: &str = "VPCNET_SGP_CHURN_PODS";

/// Pod operations (ADDs, DELs, agent kills) `cri_churn` makes.
pub const CRI_CHURN_OPS_VAR: &str = "VPCNET_CHURN_OPS";

/// Simulated days `simulated_days` lives through.
pub const SIMULATED_DAYS_VAR: &str = "VPCNET_SIMULATED_DAYS";

/// The real seconds of one of `simulated_days`' days: its hours must keep
/// up with real time, agent restarts included.
pub const SIMULATED_DAY_SECS_VAR: &str = "VPCNET_SIMULATED_DAY_SECS";

/// The enforcing modes `routing_differential`'s paths run in, comma
/// separated (`strict,standard`, both, unless set).
pub const ROUTING_DIFFERENTIAL_MODES_VAR: &str = "VPCNET_ROUTING_DIFFERENTIAL_MODES";

/// An image archive `cargo xtask test` built from the suite's binaries
/// just before the tests: the image test's first build (it builds the
/// second and compares), so the suite builds that image twice, not thrice.
pub const SUITE_IMAGE_VAR: &str = "VPCNET_SUITE_IMAGE";

/// Whether the comparative lab tests run the iptables reference next to
/// vpcnet: `0` leaves it out, and vpcnet's half is checked against the
/// expectations the reference meets where it runs. `cargo xtask test` sets
/// `0` in CI's VMs: the reference is the kernel's own netfilter, which this
/// machine's run compares with the same expectations, and CI's hour does not
/// hold both halves on every kernel.
pub const REFERENCE_LABS_VAR: &str = "VPCNET_REFERENCE_LABS";

/// [`REFERENCE_LABS_VAR`]'s value: yes unless it is `0`.
#[must_use]
pub fn reference_labs() -> bool {
    std::env::var(REFERENCE_LABS_VAR).map_or(true, |value| value.trim() != "0")
}
