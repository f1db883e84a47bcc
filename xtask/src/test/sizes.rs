//! How big the slowest tests run, and what each VM leaves out: CI has an
//! hour for a cold build, this machine's tests and two VMs under TCG.

use vpcnet_lab::{
    fuzz_settings,
    test_sizes::{
        AGENT_READY_SECS_VAR, BRANCH_POD_CHURN_VAR, CRI_CHURN_OPS_VAR, REFERENCE_LABS_VAR,
        ROUTING_DIFFERENTIAL_MODES_VAR, SIMULATED_DAY_SECS_VAR, SIMULATED_DAYS_VAR,
        TIME_WAIT_CONNECTIONS_VAR,
    },
};

use crate::kernels::{KERNELS, Kernel};

/// The tests' settings other than sizes a VM's tests get from this
/// environment: the fuzz test's seed. (Sizes set here go in through
/// [`Sizes::vm_env`].)
pub(super) const GUEST_SETTINGS: [&str; 1] = [fuzz_settings::SEED_VAR];

/// How big the slowest tests run. `cargo xtask test` is CI's command, and
/// CI has an hour for a cold build, this machine's tests and two VMs:
/// there the slowest run smaller counts of the same checks; `--full` runs
/// each test's own. An environment variable the user set wins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Sizes {
    /// Fuzz packets per program here (`None`: the test's 1,000,000).
    host_fuzz_packets: Option<u64>,
    /// Fuzz packets per program in a VM: under TCG a packet costs some
    /// fifteen times what it costs here (20,000 take 40 s).
    vm_fuzz_packets: u64,
    /// `cri_churn`'s operations (`None`: its 500).
    cri_churn_ops: Option<u32>,
    /// `simulated_days`' days (`None`: its three). Two still restart the
    /// agent both ways and flip EXTERNALSNAT four times.
    simulated_days: Option<u32>,
    /// `simulated_days`' days in a VM: one still restarts the agent and
    /// flips EXTERNALSNAT twice.
    vm_simulated_days: u32,
    /// The real seconds of a simulated day in a VM (its own 60 here): an
    /// agent restart under TCG takes up to 40 s, sixteen of a 60-second
    /// day's hours, and the idle flows' margin is four; with 5-second
    /// hours the day has caught up again well before they are used.
    vm_simulated_day_secs: u32,
    /// `time_wait`'s burst here (`None`: its 20,000): 10,000 still hold a
    /// sixth of the range in TIME_WAIT.
    time_wait_connections: Option<u64>,
    /// `time_wait`'s burst in a VM (its own 20,000 take a minute a test
    /// under TCG): 4,000 still hold a sixteenth of the range in TIME_WAIT
    /// for the paced pods' ports to meet.
    vm_time_wait_connections: u64,
    /// Whether the VMs' comparative labs run the iptables reference too
    /// ([`REFERENCE_LABS_VAR`]); without it they hold vpcnet to the
    /// expectations this machine's run checks the reference against, and
    /// leave out [`REFERENCE_ONLY_TESTS`].
    vm_reference_labs: bool,
    /// Branch pods of `security_groups`' churn in a VM: under TCG each
    /// takes seconds (its own fifty take 7 minutes).
    vm_branch_pods: u32,
    /// The enforcing modes of `routing_differential`'s paths in a VM (two
    /// labs each, minutes under TCG); this machine runs both.
    vm_routing_modes: &'static str,
    /// Whether this machine leaves out [`FULL_ONLY_ON_HOST`].
    host_full_only: bool,
    /// Whether the VM kernels share out [`SPREAD_VLAN_TESTS`] rather than
    /// each running all of them, and leave [`HOST_ENOUGH_IN_CI`] to this
    /// machine.
    spread_vlan_tests: bool,
    /// `--fuzz-packets`: here and in the VMs, over the environment too.
    fuzz_packets: Option<u64>,
}

impl Sizes {
    const CI: Self = Self {
        host_fuzz_packets: Some(150_000),
        vm_fuzz_packets: 5_000,
        cri_churn_ops: Some(200),
        simulated_days: Some(2),
        vm_simulated_days: 1,
        vm_simulated_day_secs: 120,
        time_wait_connections: Some(10_000),
        vm_time_wait_connections: 4_000,
        vm_reference_labs: false,
        vm_branch_pods: 4,
        vm_routing_modes: "standard",
        host_full_only: true,
        spread_vlan_tests: true,
        fuzz_packets: None,
    };
    const FULL: Self = Self {
        host_fuzz_packets: None,
        vm_fuzz_packets: 20_000,
        cri_churn_ops: None,
        simulated_days: None,
        vm_simulated_days: 3,
        vm_simulated_day_secs: 120,
        time_wait_connections: None,
        vm_time_wait_connections: 20_000,
        vm_reference_labs: true,
        vm_branch_pods: 50,
        vm_routing_modes: "strict,standard",
        host_full_only: false,
        spread_vlan_tests: false,
        fuzz_packets: None,
    };

    /// CI's sizes, or with `full` each test's own; `fuzz_packets` wins
    /// over either and over the environment.
    pub(super) fn new(full: bool, fuzz_packets: Option<u64>) -> Self {
        let sizes = if full { Self::FULL } else { Self::CI };
        Self {
            fuzz_packets,
            ..sizes
        }
    }

    /// The variables for this machine's tests.
    pub(super) fn host_env(self) -> Vec<(&'static str, String)> {
        self.host_env_over(|name| std::env::var(name).ok())
    }

    /// The variables for a VM's tests (its guest starts from a clean
    /// environment).
    pub(super) fn vm_env(self) -> Vec<(&'static str, String)> {
        self.vm_env_over(|name| std::env::var(name).ok())
    }

    fn host_env_over(self, user: impl Fn(&str) -> Option<String>) -> Vec<(&'static str, String)> {
        let mut env = Vec::new();
        if let Some(packets) = self.host_fuzz_packets {
            env.push((fuzz_settings::PACKETS_VAR, packets.to_string()));
        }
        if let Some(ops) = self.cri_churn_ops {
            env.push((CRI_CHURN_OPS_VAR, ops.to_string()));
        }
        if let Some(days) = self.simulated_days {
            env.push((SIMULATED_DAYS_VAR, days.to_string()));
        }
        if let Some(connections) = self.time_wait_connections {
            env.push((TIME_WAIT_CONNECTIONS_VAR, connections.to_string()));
        }
        self.settle(env, user)
    }

    fn vm_env_over(self, user: impl Fn(&str) -> Option<String>) -> Vec<(&'static str, String)> {
        let env = vec![
            (AGENT_READY_SECS_VAR, VM_AGENT_READY_SECS.to_string()),
            (fuzz_settings::PACKETS_VAR, self.vm_fuzz_packets.to_string()),
            (BRANCH_POD_CHURN_VAR, self.vm_branch_pods.to_string()),
            (
                ROUTING_DIFFERENTIAL_MODES_VAR,
                self.vm_routing_modes.to_owned(),
            ),
            (SIMULATED_DAYS_VAR, self.vm_simulated_days.to_string()),
            (
                SIMULATED_DAY_SECS_VAR,
                self.vm_simulated_day_secs.to_string(),
            ),
            (
                TIME_WAIT_CONNECTIONS_VAR,
                self.vm_time_wait_connections.to_string(),
            ),
            (
                REFERENCE_LABS_VAR,
                u8::from(self.vm_reference_labs).to_string(),
            ),
        ];
        self.settle(env, user)
    }

    /// `env` with the user's value of each variable they set, then
    /// `--fuzz-packets` over both.
    fn settle(
        self,
        env: Vec<(&'static str, String)>,
        user: impl Fn(&str) -> Option<String>,
    ) -> Vec<(&'static str, String)> {
        let mut env: Vec<(&'static str, String)> = env
            .into_iter()
            .map(|(name, ours)| (name, user(name).unwrap_or(ours)))
            .collect();
        if let Some(packets) = self.fuzz_packets {
            env.retain(|(name, _)| *name != fuzz_settings::PACKETS_VAR);
            env.push((fuzz_settings::PACKETS_VAR, packets.to_string()));
        }
        env
    }

    /// The tests this machine leaves out.
    pub(super) fn skipped_on_host(self) -> &'static [&'static str] {
        if self.host_full_only {
            &FULL_ONLY_ON_HOST
        } else {
            &[]
        }
    }

    /// The tests `kernel`'s VM leaves out.
    pub(super) fn skipped_in(self, kernel: &Kernel) -> Vec<&'static str> {
        let mut skipped = HOST_ENOUGH.to_vec();
        skipped.extend(IMAGE_TESTS_ON_HOST);
        if !kernel.tcx {
            skipped.extend(SAME_AS_CLSACT_WITHOUT_TCX);
        }
        if !self.vm_reference_labs {
            skipped.extend(REFERENCE_ONLY_TESTS);
        }
        if self.spread_vlan_tests {
            let index = KERNELS.iter().position(|k| k.name == kernel.name);
            skipped.extend(
                SPREAD_VLAN_TESTS
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| Some(i % KERNELS.len()) != index)
                    .map(|(_, test)| *test),
            );
            skipped.extend(HOST_ENOUGH_IN_CI);
        }
        skipped
    }
}

/// How long a lab's agent may take to print `READY` in a VM: there a
/// first start's verifier took 45 s on 6.12 when this machine was busy,
/// and an earlier release's start, `iptables -S` and all, more than 30 s.
const VM_AGENT_READY_SECS: u32 = 300;

/// The arm64 image: its cross build and its root filesystem's maintainer
/// scripts under qemu take some twelve minutes, more than CI's hour
/// leaves; CI builds the amd64 image (the same steps but the cross
/// compiler and qemu), and `--full` both.
const FULL_ONLY_ON_HOST: [&str; 1] =
    ["an_arm64_image_is_cross_built_and_its_agent_runs_under_qemu"];

/// The network policy matrix's runs: under TCG one takes about ten
/// minutes (its lab's containerd and nine pods through CRI a third of
/// that), more than CI's hour leaves, so CI runs them on this machine only;
/// the VMs' verdict tests and fuzz test judge policy with the same programs
/// on their kernels, and `--full` runs the matrix in the VMs too.
const HOST_ENOUGH_IN_CI: [&str; 4] = [
    "standard_mode_enforces_the_specification_through_policy_endpoints",
    "strict_mode_enforces_the_specification_through_policy_endpoints",
    "standard_mode_enforces_the_specification_resolved_by_the_agent",
    "strict_mode_enforces_the_specification_resolved_by_the_agent",
];

/// Lab tests over 802.1Q, each minutes under TCG, that CI shares out over
/// the VM kernels, one each in turn: security groups for pods in each
/// enforcing mode (the routing differential runs them both again, on
/// 6.12).
const SPREAD_VLAN_TESTS: [&str; 2] = [
    "a_standard_branch_pod_over_802_1q",
    "strict_branch_pods_refused_churned_and_one_over_802_1q",
];

/// Tests of the VMs' targets whose outcome no kernel changes (they count
/// `ip rule`s the agent never writes): this machine's run is theirs.
const HOST_ENOUGH: [&str; 1] = ["no_ip_rule_per_pod_in_ebpf_mode"];

/// The image tests whose outcome is the manifests' and the lab's, not the
/// kernel's: the take-over through the image (like the take-over's own
/// tests, `take_over`, not a VM target) and the rolling update (two images
/// do not fit in a VM's root); the VMs run the image's agent not
/// privileged, through a container restart.
const IMAGE_TESTS_ON_HOST: [&str; 3] = [
    "a_rolling_update_from_the_previous_commits_image_keeps_flows",
    "the_guides_take_over_and_rollback_through_the_image_with_legacy_iptables_and_kustomize",
    "the_guides_take_over_and_rollback_through_the_image_with_nft_iptables_and_helm",
];

/// Tests of the iptables reference alone, which a run that leaves the
/// reference to this machine ([`Sizes::vm_reference_labs`]) leaves out.
const REFERENCE_ONLY_TESTS: [&str; 1] =
    ["a_half_closed_connection_gets_its_late_answer_through_the_iptables_reference"];

/// Tests that repeat another on a kernel without TCX: forcing clsact there
/// is what the agent chooses anyway.
const SAME_AS_CLSACT_WITHOUT_TCX: [&str; 1] = ["restarts_keep_every_flow_with_clsact_filters"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ci_runs_each_spread_test_on_one_vm_kernel_and_full_on_all() {
        let ci = Sizes::new(false, None);
        for test in SPREAD_VLAN_TESTS {
            let running = KERNELS
                .iter()
                .filter(|k| !ci.skipped_in(k).contains(&test))
                .count();
            assert_eq!(running, 1, "{test}");
        }
        for kernel in &KERNELS {
            let skipped = ci.skipped_in(kernel);
            assert!(HOST_ENOUGH_IN_CI.iter().all(|t| skipped.contains(t)));
            let full = Sizes::new(true, None).skipped_in(kernel);
            assert!(
                SPREAD_VLAN_TESTS
                    .iter()
                    .chain(&HOST_ENOUGH_IN_CI)
                    .all(|t| !full.contains(t))
            );
        }
    }

    #[test]
    fn sizes_are_cis_unless_full() {
        assert_eq!(Sizes::new(false, None), Sizes::CI);
        assert_eq!(Sizes::new(true, None), Sizes::FULL);
        assert_eq!(Sizes::CI.skipped_on_host(), FULL_ONLY_ON_HOST);
        assert!(Sizes::FULL.skipped_on_host().is_empty());
    }

    fn value<'a>(env: &'a [(&str, String)], name: &str) -> Option<&'a str> {
        env.iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn the_users_variables_win_over_sizes_and_fuzz_packets_over_both() {
        let user = |name: &str| match name {
            ROUTING_DIFFERENTIAL_MODES_VAR => Some("strict".to_owned()),
            fuzz_settings::PACKETS_VAR => Some("5".to_owned()),
            _ => None,
        };
        let vm = Sizes::new(false, None).vm_env_over(user);
        assert_eq!(value(&vm, ROUTING_DIFFERENTIAL_MODES_VAR), Some("strict"));
        assert_eq!(value(&vm, fuzz_settings::PACKETS_VAR), Some("5"));
        assert_eq!(value(&vm, BRANCH_POD_CHURN_VAR), Some("4"));
        assert_eq!(value(&vm, SIMULATED_DAY_SECS_VAR), Some("120"));
        let host = Sizes::new(false, None).host_env_over(user);
        assert_eq!(value(&host, fuzz_settings::PACKETS_VAR), Some("5"));
        assert_eq!(value(&host, SIMULATED_DAYS_VAR), Some("2"));
        assert_eq!(value(&host, SIMULATED_DAY_SECS_VAR), None);
        assert_eq!(value(&host, TIME_WAIT_CONNECTIONS_VAR), Some("10000"));
        assert_eq!(value(&host, REFERENCE_LABS_VAR), None);
        assert_eq!(value(&vm, REFERENCE_LABS_VAR), Some("0"));
        let full = Sizes::new(true, None).vm_env_over(user);
        assert_eq!(value(&full, REFERENCE_LABS_VAR), Some("1"));

        let flagged = Sizes::new(true, Some(7));
        for env in [flagged.vm_env_over(user), flagged.host_env_over(user)] {
            assert_eq!(value(&env, fuzz_settings::PACKETS_VAR), Some("7"));
            assert_eq!(
                env.iter()
                    .filter(|(n, _)| *n == fuzz_settings::PACKETS_VAR)
                    .count(),
                1
            );
        }
    }
}
