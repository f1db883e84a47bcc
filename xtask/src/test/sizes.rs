//! How big the slowest tests run, and what each VM leaves out: CI has an
//! hour for a cold build, this machine's tests and two VMs under TCG.

use vpcnet_lab::{
    fuzz_settings,
    test_sizes::{
        BRANCH_POD_CHURN_VAR, CRI_CHURN_OPS_VAR, ROUTING_DIFFERENTIAL_MODES_VAR, SIMULATED_DAYS_VAR,
    },
};

use crate::kernels::{KERNELS, Kernel};

/// The tests' settings a VM's tests get from this environment: the fuzz
/// test's seed and packets, the branch-pod churn's count.
pub(super) const GUEST_SETTINGS: [&str; 3] = [
    fuzz_settings::SEED_VAR,
    fuzz_settings::PACKETS_VAR,
    BRANCH_POD_CHURN_VAR,
];

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
    /// Branch pods of `security_groups`' churn in a VM: under TCG each
    /// takes seconds (its own fifty take 7 minutes).
    vm_branch_pods: u32,
    /// The enforcing modes of `routing_differential`'s paths in a VM (two
    /// labs each, minutes under TCG); this machine runs both.
    vm_routing_modes: &'static str,
    /// Whether the VM kernels share out [`SPREAD_VLAN_TESTS`] rather than
    /// each running all of them.
    spread_vlan_tests: bool,
}

impl Sizes {
    const CI: Self = Self {
        host_fuzz_packets: Some(400_000),
        vm_fuzz_packets: 10_000,
        cri_churn_ops: Some(200),
        simulated_days: Some(2),
        vm_branch_pods: 4,
        vm_routing_modes: "standard",
        spread_vlan_tests: true,
    };
    const FULL: Self = Self {
        host_fuzz_packets: None,
        vm_fuzz_packets: 20_000,
        cri_churn_ops: None,
        simulated_days: None,
        vm_branch_pods: 50,
        vm_routing_modes: "strict,standard",
        spread_vlan_tests: false,
    };

    /// CI's sizes, or with `full` each test's own; `fuzz_packets` wins
    /// over either.
    pub(super) fn new(full: bool, fuzz_packets: Option<u64>) -> Self {
        let mut sizes = if full { Self::FULL } else { Self::CI };
        if let Some(packets) = fuzz_packets {
            sizes.host_fuzz_packets = Some(packets);
            sizes.vm_fuzz_packets = packets;
        }
        sizes
    }

    /// The variables for this machine's tests.
    pub(super) fn host_env(self) -> Vec<(&'static str, String)> {
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
        unset_by_user(env)
    }

    /// The variables for a VM's tests.
    pub(super) fn vm_env(self) -> Vec<(&'static str, String)> {
        unset_by_user(vec![
            (fuzz_settings::PACKETS_VAR, self.vm_fuzz_packets.to_string()),
            (BRANCH_POD_CHURN_VAR, self.vm_branch_pods.to_string()),
            (
                ROUTING_DIFFERENTIAL_MODES_VAR,
                self.vm_routing_modes.to_owned(),
            ),
        ])
    }

    /// The tests `kernel`'s VM leaves out.
    pub(super) fn skipped_in(self, kernel: &Kernel) -> Vec<&'static str> {
        let mut skipped = HOST_ENOUGH.to_vec();
        if !kernel.tcx {
            skipped.extend(SAME_AS_CLSACT_WITHOUT_TCX);
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
        }
        skipped
    }
}

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

/// Tests that repeat another on a kernel without TCX: forcing clsact there
/// is what the agent chooses anyway.
const SAME_AS_CLSACT_WITHOUT_TCX: [&str; 1] = ["restarts_keep_every_flow_with_clsact_filters"];

/// `env` without what the user's environment sets (which the tests here
/// read, and [`GUEST_SETTINGS`] carry into the VMs).
fn unset_by_user(env: Vec<(&'static str, String)>) -> Vec<(&'static str, String)> {
    env.into_iter()
        .filter(|(name, _)| std::env::var_os(name).is_none())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_cis_unless_full_and_fuzz_packets_set_both_places() {
        assert_eq!(Sizes::new(false, None), Sizes::CI);
        assert_eq!(Sizes::new(true, None), Sizes::FULL);
        let sizes = Sizes::new(true, Some(7));
        assert_eq!(
            (sizes.host_fuzz_packets, sizes.vm_fuzz_packets),
            (Some(7), 7)
        );
    }
}
