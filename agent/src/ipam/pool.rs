//! When the warm pool is too low or too high: the VPC CNI's own decisions
//! (ipamd's `datastoreTargetState`, `isDatastorePoolTooLow`,
//! `isDatastorePoolTooHigh`, `shouldRemoveExtraENIs`), so operators' values
//! of `WARM_ENI_TARGET`, `WARM_IP_TARGET`, `MINIMUM_IP_TARGET` and
//! `WARM_PREFIX_TARGET` mean exactly what they mean with aws-node.

/// Addresses in one /28 prefix.
pub const IPS_PER_PREFIX: usize = 16;

/// The targets, as configured (see `settings`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolTargets {
    pub warm_eni_target: usize,
    /// 0: not set.
    pub warm_ip_target: usize,
    /// 0: not set.
    pub minimum_ip_target: usize,
    pub warm_prefix_target: usize,
    pub prefix_delegation: bool,
    /// Secondary addresses one ENI of this instance type holds.
    pub max_ips_per_eni: usize,
    /// The node's max pods: the pool never grows past it.
    pub max_pods: usize,
}

/// The datastore's counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Addresses the node holds (secondary addresses, or the addresses of its prefixes).
    pub total_ips: usize,
    /// Addresses assigned to pods.
    pub assigned_ips: usize,
    /// Prefixes the node holds, and those with no address assigned.
    pub total_prefixes: usize,
    pub free_prefixes: usize,
}

impl PoolStats {
    #[must_use]
    pub fn available(&self) -> usize {
        self.total_ips.saturating_sub(self.assigned_ips)
    }
}

/// How far the pool is from `WARM_IP_TARGET` / `MINIMUM_IP_TARGET`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TargetState {
    /// Addresses (prefixes with prefix delegation) missing.
    pub short: usize,
    /// Addresses (prefixes with prefix delegation) beyond what is needed.
    pub over: usize,
}

impl PoolTargets {
    /// Whether `WARM_IP_TARGET` or `MINIMUM_IP_TARGET` is set: they then
    /// replace `WARM_ENI_TARGET` / `WARM_PREFIX_TARGET`.
    #[must_use]
    pub fn ip_targets_defined(&self) -> bool {
        self.warm_ip_target != 0 || self.minimum_ip_target != 0
    }

    /// `None` when neither IP target is set (ipamd's `enabled == false`).
    #[must_use]
    pub fn target_state(&self, stats: &PoolStats) -> Option<TargetState> {
        if !self.ip_targets_defined() {
            return None;
        }
        let available = stats.available();
        let short = self
            .warm_ip_target
            .saturating_sub(available)
            .max(self.minimum_ip_target.saturating_sub(stats.total_ips));
        let over = available
            .saturating_sub(self.warm_ip_target)
            .min(stats.total_ips.saturating_sub(self.minimum_ip_target));
        if !self.prefix_delegation {
            return Some(TargetState { short, over });
        }
        // In prefixes: what is short rounds up to whole prefixes; what is
        // over counts only free prefixes that neither target needs.
        let needed_for_warm = (stats.assigned_ips + self.warm_ip_target).div_ceil(IPS_PER_PREFIX);
        let needed_for_minimum = self.minimum_ip_target.div_ceil(IPS_PER_PREFIX);
        let over = stats
            .free_prefixes
            .min(stats.total_prefixes.saturating_sub(needed_for_warm))
            .min(stats.total_prefixes.saturating_sub(needed_for_minimum));
        Some(TargetState {
            short: short.div_ceil(IPS_PER_PREFIX),
            over,
        })
    }

    /// Whether to allocate: an address, a prefix or an ENI more.
    #[must_use]
    pub fn pool_too_low(&self, stats: &PoolStats) -> bool {
        if stats.total_ips >= self.max_pods {
            return false;
        }
        if let Some(state) = self.target_state(stats) {
            return state.short > 0;
        }
        let (warm_target, ips_per_unit) = if self.prefix_delegation {
            (self.warm_prefix_target, IPS_PER_PREFIX)
        } else {
            (self.warm_eni_target, self.max_ips_per_eni)
        };
        let available = stats.available();
        available < ips_per_unit * warm_target || (warm_target == 0 && available == 0)
    }

    /// Whether addresses or prefixes may be released. With `WARM_ENI_TARGET`
    /// alone it never is: whole ENIs go (see [`Self::should_remove_extra_enis`]).
    #[must_use]
    pub fn pool_too_high(&self, stats: &PoolStats) -> bool {
        if let Some(state) = self.target_state(stats) {
            return state.over > 0;
        }
        if self.prefix_delegation {
            return stats.free_prefixes > self.warm_prefix_target;
        }
        false
    }

    /// Whether an ENI may be freed. `freeable_eni_exists`: with prefix
    /// delegation, an ENI without assigned addresses exists.
    #[must_use]
    pub fn should_remove_extra_enis(&self, stats: &PoolStats, freeable_eni_exists: bool) -> bool {
        if self.ip_targets_defined() {
            // Checked address by address when choosing the ENI.
            return true;
        }
        // One unit more than the target, so freeing never goes below it.
        let warm_target = if self.prefix_delegation {
            self.warm_prefix_target + 1
        } else {
            self.warm_eni_target + 1
        };
        stats.available() >= warm_target * self.max_ips_per_eni
            || (self.prefix_delegation && freeable_eni_exists)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An m4.4xlarge: 30 addresses per ENI.
    fn m4_4xlarge() -> PoolTargets {
        PoolTargets {
            warm_eni_target: 1,
            warm_ip_target: 0,
            minimum_ip_target: 0,
            warm_prefix_target: 0,
            prefix_delegation: false,
            max_ips_per_eni: 30,
            max_pods: 234,
        }
    }

    fn stats(total_ips: usize, assigned_ips: usize) -> PoolStats {
        PoolStats {
            total_ips,
            assigned_ips,
            ..PoolStats::default()
        }
    }

    #[test]
    fn warm_eni_target_keeps_a_whole_free_eni() {
        let t = m4_4xlarge();
        // 9 pods on one ENI: 21 free < 30: allocate the next ENI.
        assert!(t.pool_too_low(&stats(30, 9)));
        // Two ENIs: 51 free, one ENI's worth: enough.
        assert!(!t.pool_too_low(&stats(60, 9)));
        // Never too high with `WARM_ENI_TARGET` alone; an ENI goes only when
        // two ENIs' worth are free.
        assert!(!t.pool_too_high(&stats(90, 9)));
        assert!(!t.should_remove_extra_enis(&stats(60, 9), false));
        assert!(t.should_remove_extra_enis(&stats(90, 9), false));
    }

    #[test]
    fn warm_ip_and_minimum_ip_targets_replace_the_eni_target() {
        // The VPC CNI's own example: `WARM_IP_TARGET`=1, `MINIMUM_IP_TARGET`=12,
        // 9 pods: 12 addresses, 3 free.
        let t = PoolTargets {
            warm_ip_target: 1,
            minimum_ip_target: 12,
            ..m4_4xlarge()
        };
        assert_eq!(
            t.target_state(&stats(12, 9)),
            Some(TargetState { short: 0, over: 0 })
        );
        assert!(!t.pool_too_low(&stats(12, 9)));
        assert!(!t.pool_too_high(&stats(12, 9)));
        assert_eq!(
            t.target_state(&stats(10, 9)),
            Some(TargetState { short: 2, over: 0 })
        );
        // 20 addresses, 9 assigned: 10 free beyond the warm one, but only 8
        // above the minimum may go.
        assert_eq!(
            t.target_state(&stats(20, 9)),
            Some(TargetState { short: 0, over: 8 })
        );
        assert!(t.should_remove_extra_enis(&stats(20, 9), false));
    }

    #[test]
    fn max_pods_stops_growth() {
        let t = PoolTargets {
            max_pods: 29,
            ..m4_4xlarge()
        };
        assert!(!t.pool_too_low(&stats(30, 29)));
    }

    #[test]
    fn prefix_delegation_counts_in_prefixes() {
        let t = PoolTargets {
            warm_eni_target: 1,
            warm_prefix_target: 1,
            prefix_delegation: true,
            ..m4_4xlarge()
        };
        // One prefix, 3 pods: 13 free < 16: another prefix.
        let one = PoolStats {
            total_ips: 16,
            assigned_ips: 3,
            total_prefixes: 1,
            free_prefixes: 0,
        };
        assert!(t.pool_too_low(&one));
        let two = PoolStats {
            total_ips: 32,
            assigned_ips: 3,
            total_prefixes: 2,
            free_prefixes: 1,
        };
        assert!(!t.pool_too_low(&two));
        assert!(!t.pool_too_high(&two));
        let three = PoolStats {
            total_ips: 48,
            assigned_ips: 3,
            total_prefixes: 3,
            free_prefixes: 2,
        };
        assert!(t.pool_too_high(&three));

        // `WARM_IP_TARGET`=16 with prefixes: 1 assigned needs 2 prefixes.
        let t = PoolTargets {
            warm_ip_target: 16,
            ..t
        };
        let s = PoolStats {
            total_ips: 16,
            assigned_ips: 1,
            total_prefixes: 1,
            free_prefixes: 0,
        };
        assert_eq!(t.target_state(&s), Some(TargetState { short: 1, over: 0 }));
        let s = PoolStats {
            total_ips: 48,
            assigned_ips: 1,
            total_prefixes: 3,
            free_prefixes: 2,
        };
        assert_eq!(t.target_state(&s), Some(TargetState { short: 0, over: 1 }));
    }
}
