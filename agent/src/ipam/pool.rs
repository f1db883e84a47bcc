//! When the warm pool is too low or too high: the VPC CNI's own decisions
//! (ipamd's `datastoreTargetState`, `isDatastorePoolTooLow`,
//! `isDatastorePoolTooHigh`, `shouldRemoveExtraENIs`), so operators' values
//! of `WARM_ENI_TARGET`, `WARM_IP_TARGET`, `MINIMUM_IP_TARGET` and
//! `WARM_PREFIX_TARGET` mean exactly what they mean with aws-node; the
//! node's limits (max pods, max addresses); and what to take when the pool
//! is too low ([`plan_growth`]) or give back when it is too high
//! ([`plan_shrink`]), pure functions of a snapshot the address manager
//! takes and then carries out.

use std::{collections::BTreeSet, net::Ipv4Addr};

use ipnet::Ipv4Net;
use tracing::debug;

use crate::cloud::InstanceTypeLimits;

/// Addresses in one /28 prefix.
pub const IPS_PER_PREFIX: usize = 16;

/// Max pods as the EKS max-pods calculator computes it: every secondary
/// slot of every ENI (16 per slot with prefixes), plus the two host-network
/// pods; with prefixes capped at 110 (250 from 30 vCPUs).
#[must_use]
pub fn default_max_pods(limits: InstanceTypeLimits, max_enis: usize, prefixes: bool) -> usize {
    let slots = max_enis * limits.ips_per_eni.saturating_sub(1);
    if prefixes {
        (slots * IPS_PER_PREFIX + 2).min(if limits.vcpus >= 30 { 250 } else { 110 })
    } else {
        slots + 2
    }
}

/// Addresses the node could hold for pods at most: every secondary slot of
/// every ENI it may attach, 16 per slot with prefixes (ipamd's
/// `maxIPsPerENI * maxENI`, its `awscni_ip_max`).
#[must_use]
pub fn max_ips(limits: InstanceTypeLimits, max_enis: usize, prefixes: bool) -> usize {
    let per_eni = limits.ips_per_eni.saturating_sub(1);
    let per_slot = if prefixes { IPS_PER_PREFIX } else { 1 };
    max_enis * per_eni * per_slot
}

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
    /// Secondary address slots of one ENI of this instance type (its IPv4
    /// addresses less the primary). With prefix delegation each slot holds
    /// a /28, so an ENI's worth is `max_ips_per_eni * IPS_PER_PREFIX`
    /// addresses, as ipamd's `maxIPsPerENI` is then (`GetIPv4Limit`).
    pub max_ips_per_eni: usize,
    /// The node's max pods: the pool never grows past it.
    pub max_pods: usize,
}

/// The datastore's counts (ipamd's `DataStoreStats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Addresses the node holds (secondary addresses, or the addresses of its prefixes).
    pub total_ips: usize,
    /// Addresses assigned to pods.
    pub assigned_ips: usize,
    /// Free addresses still in their cooldown (`IP_COOLDOWN_PERIOD`): no pod
    /// gets them yet. ipamd's `CooldownIPs`, and like it only reported: the
    /// decisions below count them as available, as ipamd does (its
    /// `AvailableAddresses` is total less assigned; see the cooldown rows of
    /// the tests).
    pub cooling_ips: usize,
    /// Prefixes the node holds, and those with no address assigned (a prefix
    /// whose addresses are only cooling counts as free, as in ipamd's
    /// `GetFreePrefixes`).
    pub total_prefixes: usize,
    pub free_prefixes: usize,
}

impl PoolStats {
    /// Addresses no pod holds, cooling ones included (ipamd's `AvailableAddresses`).
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
        // One unit more than the target, so freeing never goes below it,
        // times an ENI's worth of addresses (ipamd's `maxIPsPerENI`: the
        // slots, times 16 with prefixes), whichever the target's unit.
        let (warm_target, ips_per_eni) = if self.prefix_delegation {
            (
                self.warm_prefix_target + 1,
                self.max_ips_per_eni * IPS_PER_PREFIX,
            )
        } else {
            (self.warm_eni_target + 1, self.max_ips_per_eni)
        };
        stats.available() >= warm_target * ips_per_eni
            || (self.prefix_delegation && freeable_eni_exists)
    }
}

/// One ENI of the pool as the shrink plan sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EniSnapshot {
    pub id: String,
    pub device_number: u32,
    /// The instance's primary ENI: never freed.
    pub primary: bool,
    /// Its addresses serve no pod (custom networking's primary ENI).
    pub excluded_for_pods: bool,
    /// Not the pool's to free: left alone (its tags), or younger than
    /// `min_eni_lifetime`.
    pub kept: bool,
    /// Addresses held by pods.
    pub assigned: usize,
    /// Address slots taken (a prefix takes one).
    pub slots_used: usize,
    /// Addresses it holds (a prefix's 16 included).
    pub total_ips: usize,
    /// Prefixes it holds.
    pub prefixes: usize,
    /// Free addresses out of their cooldown, and prefixes wholly so.
    pub idle_addrs: Vec<Ipv4Addr>,
    pub idle_prefixes: Vec<Ipv4Net>,
}

impl EniSnapshot {
    /// Nothing on it is held or cooling: it may go whole.
    fn all_idle(&self) -> bool {
        self.assigned == 0
            && self.idle_addrs.len() + self.idle_prefixes.len() * IPS_PER_PREFIX == self.total_ips
    }
}

/// What the node has room for, beside its pool's ENIs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EniRoom {
    /// IPv4 addresses of one ENI (its own included).
    pub slots_per_eni: usize,
    /// Device numbers taken (ENIs left alone included).
    pub devices_used: BTreeSet<u32>,
    /// ENIs attached or being deleted.
    pub attached: usize,
    pub max_enis: usize,
    /// Whether a new ENI can be made (custom networking without an
    /// ENIConfig cannot).
    pub can_make_eni: bool,
}

/// What growing the pool takes next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Growth {
    /// `n` more addresses or prefixes on an attached ENI.
    OnEni {
        eni: String,
        n: usize,
        prefixes: bool,
    },
    /// A new ENI at `device` with `n` addresses or prefixes.
    NewEni {
        device: u32,
        n: usize,
        prefixes: bool,
    },
}

/// What to take, if the pool is too low: as many addresses (prefixes in
/// `in_force`'s prefix mode) as the targets lack, up to max pods, on the
/// lowest ENI with a free slot, else on a new ENI at the lowest free
/// device. `configured`: the targets as set, which say whether the pool is
/// too low; `in_force`: the same after a fall back from prefixes to
/// addresses (the unit taken).
#[must_use]
pub fn plan_growth(
    configured: &PoolTargets,
    in_force: &PoolTargets,
    stats: &PoolStats,
    enis: &[EniSnapshot],
    room: &EniRoom,
) -> Option<Growth> {
    // Judged by the configured mode: after a fallback, addresses fill
    // the same targets prefixes would have.
    if !configured.pool_too_low(stats) {
        return None;
    }
    let prefixes = in_force.prefix_delegation;
    let unit = if prefixes { IPS_PER_PREFIX } else { 1 };
    let below_max_pods = configured
        .max_pods
        .saturating_sub(stats.total_ips)
        .div_ceil(unit);
    let wanted = match in_force.target_state(stats) {
        Some(target) => target.short,
        None if configured.prefix_delegation => {
            let warm = configured.warm_prefix_target.max(1);
            if prefixes {
                warm.saturating_sub(stats.free_prefixes).max(1)
            } else {
                (warm * IPS_PER_PREFIX)
                    .saturating_sub(stats.available())
                    .max(1)
            }
        }
        // WARM_ENI_TARGET: fill the ENI, as aws-node does.
        None => usize::MAX,
    };
    let wanted = wanted.min(below_max_pods).max(1);
    let slots = room.slots_per_eni;
    if let Some(eni) = enis
        .iter()
        .filter(|e| !e.excluded_for_pods && e.slots_used < slots)
        .min_by_key(|e| e.device_number)
    {
        return Some(Growth::OnEni {
            eni: eni.id.clone(),
            n: wanted.min(slots - eni.slots_used),
            prefixes,
        });
    }
    if room.attached >= room.max_enis {
        debug!("pool too low but every ENI slot and address is in use");
        return None;
    }
    if !room.can_make_eni {
        // Said by the ENIConfig's follower.
        debug!("pool too low but custom networking has no ENIConfig to make an ENI from");
        return None;
    }
    let device = (1..=u32::MAX)
        .find(|d| !room.devices_used.contains(d))
        .unwrap_or(1);
    Some(Growth::NewEni {
        device,
        n: wanted.min(slots.saturating_sub(1)),
        prefixes,
    })
}

/// What shrinking the pool gives back next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shrink {
    /// Idle addresses or prefixes of one ENI, back to EC2.
    Release {
        eni: String,
        addrs: Vec<Ipv4Addr>,
        prefixes: Vec<Ipv4Net>,
    },
    /// A whole ENI, detached and deleted.
    FreeEni(String),
}

/// What to give back, if anything: with the pool too high, the idle
/// addresses (prefixes with prefix delegation) beyond the targets, from the
/// highest ENI that has any; else, unless `enis_held` (a cordoned node), the
/// highest ENI with nothing held or cooling, if freeing it keeps the pool
/// above its targets (ipamd's `decreaseDatastorePool`, `tryFreeENI`).
#[must_use]
pub fn plan_shrink(
    targets: &PoolTargets,
    stats: &PoolStats,
    enis: &[EniSnapshot],
    enis_held: bool,
) -> Option<Shrink> {
    let mut by_device: Vec<&EniSnapshot> = enis.iter().collect();
    by_device.sort_by_key(|e| std::cmp::Reverse(e.device_number));
    if targets.pool_too_high(stats) {
        let over = targets.target_state(stats).map_or_else(
            || {
                stats
                    .free_prefixes
                    .saturating_sub(targets.warm_prefix_target)
            },
            |s| s.over,
        );
        let release = by_device
            .iter()
            .filter(|e| !e.excluded_for_pods)
            .find_map(|e| {
                let (addrs, prefixes) = if targets.prefix_delegation {
                    (Vec::new(), e.idle_prefixes.clone())
                } else {
                    (e.idle_addrs.clone(), Vec::new())
                };
                (!addrs.is_empty() || !prefixes.is_empty()).then(|| Shrink::Release {
                    eni: e.id.clone(),
                    addrs: addrs.into_iter().take(over).collect(),
                    prefixes: prefixes.into_iter().take(over).collect(),
                })
            });
        if release.is_some() {
            return release;
        }
    }
    if enis_held {
        return None;
    }
    let candidates: Vec<&EniSnapshot> = by_device
        .into_iter()
        .filter(|e| !e.primary && !e.kept && e.all_idle())
        .collect();
    if !targets.should_remove_extra_enis(stats, !candidates.is_empty()) {
        return None;
    }
    let eni = candidates.first()?;
    let after = PoolStats {
        total_ips: stats.total_ips - eni.total_ips,
        total_prefixes: stats.total_prefixes - eni.prefixes,
        free_prefixes: stats.free_prefixes - eni.prefixes,
        ..*stats
    };
    (!targets.pool_too_low(&after)).then(|| Shrink::FreeEni(eni.id.clone()))
}

#[cfg(test)]
mod tests {
    //! One table per decision (two for ENI removal: without and with a
    //! freeable ENI). A row is (name, targets, stats, expected, reason).
    //! Rows named after an upstream test reproduce its values (see
    //! `pkg/ipamd/ipamd_test.go` in aws/amazon-vpc-cni-k8s, v1.23.1); "docs"
    //! rows are steady states from its `docs/eni-and-ip-target.md` table.
    //! Every failing row is reported by name.

    use std::fmt::Debug;

    use super::*;

    type Row<W> = (&'static str, PoolTargets, PoolStats, W, &'static str);

    /// Checks every row, then fails once, naming each row that did not hold.
    fn check<W: PartialEq + Debug>(
        decision: &str,
        rows: &[Row<W>],
        decide: impl Fn(&PoolTargets, &PoolStats) -> W,
    ) {
        let failures: Vec<String> = rows
            .iter()
            .filter_map(|(name, targets, stats, want, why)| {
                let got = decide(targets, stats);
                (got != *want).then(|| {
                    format!(
                        "{decision}: row {name:?}: got {got:?}, want {want:?} ({why})\n  \
                         targets {targets:?}\n  stats {stats:?}"
                    )
                })
            })
            .collect();
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// Secondary-IP mode: `WARM_ENI_TARGET`, `WARM_IP_TARGET`,
    /// `MINIMUM_IP_TARGET`, address slots per ENI, max pods.
    const fn ips(
        warm_eni: usize,
        warm_ip: usize,
        minimum_ip: usize,
        per_eni: usize,
        max_pods: usize,
    ) -> PoolTargets {
        PoolTargets {
            warm_eni_target: warm_eni,
            warm_ip_target: warm_ip,
            minimum_ip_target: minimum_ip,
            warm_prefix_target: 0,
            prefix_delegation: false,
            max_ips_per_eni: per_eni,
            max_pods,
        }
    }

    /// Prefix mode: `WARM_PREFIX_TARGET`, `WARM_IP_TARGET`,
    /// `MINIMUM_IP_TARGET`, prefix slots per ENI, max pods
    /// (`WARM_ENI_TARGET` left at its default 1: prefix mode ignores it).
    const fn pd(
        warm_prefix: usize,
        warm_ip: usize,
        minimum_ip: usize,
        per_eni: usize,
        max_pods: usize,
    ) -> PoolTargets {
        PoolTargets {
            warm_eni_target: 1,
            warm_ip_target: warm_ip,
            minimum_ip_target: minimum_ip,
            warm_prefix_target: warm_prefix,
            prefix_delegation: true,
            max_ips_per_eni: per_eni,
            max_pods,
        }
    }

    /// Secondary addresses: total, assigned, cooling.
    const fn st(total_ips: usize, assigned_ips: usize, cooling_ips: usize) -> PoolStats {
        PoolStats {
            total_ips,
            assigned_ips,
            cooling_ips,
            total_prefixes: 0,
            free_prefixes: 0,
        }
    }

    /// Prefixes: held, free (nothing assigned), addresses assigned, cooling.
    const fn pfx(
        prefixes: usize,
        free: usize,
        assigned_ips: usize,
        cooling_ips: usize,
    ) -> PoolStats {
        PoolStats {
            total_ips: prefixes * IPS_PER_PREFIX,
            assigned_ips,
            cooling_ips,
            total_prefixes: prefixes,
            free_prefixes: free,
        }
    }

    const fn ts(short: usize, over: usize) -> TargetState {
        TargetState { short, over }
    }

    // Instance types: address (or prefix) slots per ENI and max pods.
    const T3_SMALL: (usize, usize) = (3, 11);
    const M5_LARGE: (usize, usize) = (9, 29);
    const M4_4XLARGE: (usize, usize) = (29, 234);
    const P3DN_24XLARGE: (usize, usize) = (49, 737);

    #[test]
    #[rustfmt::skip]
    fn datastore_target_state() {
        let (t3, t3_pods) = T3_SMALL;
        let (m5, m5_pods) = M5_LARGE;
        let (p3, p3_pods) = P3DN_24XLARGE;
        let rows: &[Row<Option<TargetState>>] = &[
            // Secondary-IP mode.
            ("WARM_ENI_TARGET alone: disabled", ips(1, 0, 0, m5, m5_pods), st(9, 3, 0), None,
             "TestGetWarmIPTargetState: no IP target, enabled false"),
            ("WARM_IP_TARGET 5, empty", ips(1, 5, 0, m5, m5_pods), st(0, 0, 0), Some(ts(5, 0)),
             "TestGetWarmIPTargetState"),
            ("WARM_IP_TARGET 5, 2 free", ips(1, 5, 0, m5, m5_pods), st(2, 0, 0), Some(ts(3, 0)),
             "TestGetWarmIPTargetState"),
            ("WARM_IP_TARGET 5, 5 free", ips(1, 5, 0, m5, m5_pods), st(5, 0, 0), Some(ts(0, 0)),
             "TestGetWarmIPTargetState"),
            ("WARM_IP_TARGET 1, 4 held 2 assigned", ips(1, 1, 0, m5, m5_pods), st(4, 2, 0), Some(ts(0, 1)),
             "TestDecreaseIPPool: one beyond the warm one"),
            ("WARM_IP_TARGET 1, after the decrease", ips(1, 1, 0, m5, m5_pods), st(3, 2, 0), Some(ts(0, 0)),
             "TestDecreaseIPPool"),
            ("MINIMUM_IP_TARGET 10 alone, empty", ips(1, 0, 10, m5, m5_pods), st(0, 0, 0), Some(ts(10, 0)),
             "the minimum alone counts in total addresses"),
            ("MINIMUM_IP_TARGET 10 alone, 12 held", ips(1, 0, 10, m5, m5_pods), st(12, 2, 0), Some(ts(0, 2)),
             "with no warm target every free address is over, down to the minimum"),
            ("both: WARM 1 MIN 12, 9 pods on 12", ips(1, 1, 12, m5, m5_pods), st(12, 9, 0), Some(ts(0, 0)),
             "docs: the minimum holds 2 more than the warm target"),
            ("both: WARM 1 MIN 12, 9 pods on 10", ips(1, 1, 12, m5, m5_pods), st(10, 9, 0), Some(ts(2, 0)),
             "short of the minimum, not of the warm target"),
            ("both: WARM 1 MIN 12, 9 pods on 20", ips(1, 1, 12, m5, m5_pods), st(20, 9, 0), Some(ts(0, 8)),
             "10 beyond the warm one, but only 8 above the minimum"),
            ("docs t3.small WARM 1 MIN 1, 5 pods", ips(0, 1, 1, t3, t3_pods), st(6, 5, 0), Some(ts(0, 0)),
             "docs table: 6 addresses, 1 unused"),
            ("docs t3.small WARM 2 MIN 5, 0 pods", ips(0, 2, 5, t3, t3_pods), st(5, 0, 0), Some(ts(0, 0)),
             "docs table: the minimum's 5"),
            ("docs t3.small WARM 2 MIN 5, 5 pods", ips(0, 2, 5, t3, t3_pods), st(7, 5, 0), Some(ts(0, 0)),
             "docs table: 7 addresses, 2 unused"),
            ("docs t3.small WARM 2 MIN 5, 9 pods", ips(0, 2, 5, t3, t3_pods), st(9, 9, 0), Some(ts(2, 0)),
             "docs table: 3 full ENIs, still short (no ENI left to add)"),
            ("docs p3dn WARM 5 MIN 10, 0 pods", ips(0, 5, 10, p3, p3_pods), st(10, 0, 0), Some(ts(0, 0)),
             "docs table"),
            ("docs p3dn WARM 5 MIN 10, 15 pods", ips(0, 5, 10, p3, p3_pods), st(20, 15, 0), Some(ts(0, 0)),
             "docs table"),
            ("docs p3dn WARM 5 MIN 10, 45 pods", ips(0, 5, 10, p3, p3_pods), st(50, 45, 0), Some(ts(0, 0)),
             "docs table: 49 + 1 over two ENIs"),
            ("WARM_IP_TARGET 20 > ENI of 9, one ENI", ips(1, 20, 0, m5, m5_pods), st(9, 0, 0), Some(ts(11, 0)),
             "a target larger than one ENI: short past the ENI"),
            ("WARM_IP_TARGET 20 > ENI of 9, two ENIs", ips(1, 20, 0, m5, m5_pods), st(18, 0, 0), Some(ts(2, 0)),
             "still short after a second full ENI"),
            ("WARM_IP_TARGET 20 > ENI of 9, three ENIs", ips(1, 20, 0, m5, m5_pods), st(27, 0, 0), Some(ts(0, 7)),
             "the third ENI overshoots by 7"),
            ("cooldown: issue 2896 values", ips(0, 2, 23, m5, m5_pods), st(23, 19, 4), Some(ts(0, 0)),
             "issue 2896: 4 cooling, none assignable, short stays 0: ipamd counts cooling as available"),
            ("cooldown: issue 1700 values", ips(1, 2, 0, m5, m5_pods), st(18, 16, 2), Some(ts(0, 0)),
             "issue 1700: 2 available, both cooling"),
            // Prefix mode: in prefixes.
            ("PD WARM_IP_TARGET 5, empty", pd(0, 5, 0, m5, 110), pfx(0, 0, 0, 0), Some(ts(1, 0)),
             "TestGetWarmIPTargetStateWithPDenabled: 5 short rounds up to a prefix"),
            ("PD WARM_IP_TARGET 5, 2 free prefixes", pd(0, 5, 0, m5, 110), pfx(2, 2, 0, 0), Some(ts(0, 1)),
             "TestGetWarmIPTargetStateWithPDenabled"),
            ("PD WARM_IP_TARGET 5, 1 free prefix", pd(0, 5, 0, m5, 110), pfx(1, 1, 0, 0), Some(ts(0, 0)),
             "TestGetWarmIPTargetStateWithPDenabled"),
            ("PD WARM_IP_TARGET 16, 1 assigned on 1", pd(0, 16, 0, m5, 110), pfx(1, 0, 1, 0), Some(ts(1, 0)),
             "ipamd's comment: 1 assigned + 16 warm needs 2 prefixes"),
            ("PD WARM_IP_TARGET 16, 1 assigned on 3", pd(0, 16, 0, m5, 110), pfx(3, 2, 1, 0), Some(ts(0, 1)),
             "2 prefixes needed, the third is over"),
            ("PD WARM_IP_TARGET 20 rounds up, empty", pd(0, 20, 0, m5, 110), pfx(0, 0, 0, 0), Some(ts(2, 0)),
             "20 addresses: 2 prefixes"),
            ("PD WARM_IP_TARGET 20 rounds up, 1 free", pd(0, 20, 0, m5, 110), pfx(1, 1, 0, 0), Some(ts(1, 0)),
             "4 short: a whole prefix"),
            ("PD MINIMUM_IP_TARGET 40 on 2 prefixes", pd(0, 0, 40, m5, 110), pfx(2, 2, 0, 0), Some(ts(1, 0)),
             "8 short of the minimum: a prefix"),
            ("PD MINIMUM_IP_TARGET 40 on 4 prefixes", pd(0, 0, 40, m5, 110), pfx(4, 4, 0, 0), Some(ts(0, 1)),
             "the minimum needs 3"),
            ("PD WARM_IP_TARGET 15 after churn", pd(0, 15, 0, m5, 110), pfx(3, 0, 3, 0), Some(ts(0, 0)),
             "ipamd's comment: 3 prefixes with 1 pod each, none free, none over"),
            ("PD cooldown: the only free prefix cooling", pd(0, 16, 0, m5, 110), pfx(2, 1, 16, 16), Some(ts(0, 0)),
             "16 available (all cooling): not short, as in ipamd"),
        ];
        check("datastoreTargetState", rows, PoolTargets::target_state);
    }

    #[test]
    #[rustfmt::skip]
    fn pool_too_low() {
        let (t3, t3_pods) = T3_SMALL;
        let (m5, m5_pods) = M5_LARGE;
        let (p3, p3_pods) = P3DN_24XLARGE;
        let rows: &[Row<bool>] = &[
            // Secondary-IP mode, TestIPAMContext_nodeIPPoolTooLow's rows.
            ("new ds, all defaults", ips(1, 0, 0, 14, 500), st(0, 0, 0), true,
             "TestIPAMContext_nodeIPPoolTooLow"),
            ("new ds, 0 ENIs", ips(0, 0, 0, 14, 500), st(0, 0, 0), true,
             "TestIPAMContext_nodeIPPoolTooLow: WARM_ENI_TARGET 0 still wants one address"),
            ("new ds, 3 warm IPs", ips(0, 3, 0, 14, 500), st(0, 0, 0), true,
             "TestIPAMContext_nodeIPPoolTooLow"),
            ("3 unused IPs, 1 warm", ips(1, 1, 0, 3, 500), st(3, 0, 0), false,
             "TestIPAMContext_nodeIPPoolTooLow: WARM_IP_TARGET replaces WARM_ENI_TARGET"),
            ("1 used, 1 warm ENI", ips(1, 0, 0, 3, 500), st(3, 1, 0), true,
             "TestIPAMContext_nodeIPPoolTooLow"),
            ("1 used, 0 warm ENI", ips(0, 0, 0, 3, 500), st(3, 1, 0), false,
             "TestIPAMContext_nodeIPPoolTooLow"),
            ("3 used, 1 warm ENI", ips(1, 0, 0, 3, 500), st(3, 3, 0), true,
             "TestIPAMContext_nodeIPPoolTooLow"),
            ("3 used, 0 warm ENI", ips(0, 0, 0, 3, 500), st(3, 3, 0), true,
             "TestIPAMContext_nodeIPPoolTooLow: none free"),
            ("max pods exceeded", ips(0, 5, 0, 3, 3), st(3, 3, 0), false,
             "TestIPAMContext_nodeIPPoolTooLow: max pods beats WARM_IP_TARGET"),
            ("WARM_ENI_TARGET 2, no address", ips(2, 0, 0, 10, 100), st(0, 0, 0), true,
             "TestIPAMContext_WarmTargetWithExcludedPrimary"),
            ("WARM_ENI_TARGET 2, one ENI", ips(2, 0, 0, 10, 100), st(10, 0, 0), true,
             "TestIPAMContext_WarmTargetWithExcludedPrimary"),
            ("WARM_ENI_TARGET 2, two ENIs", ips(2, 0, 0, 10, 100), st(20, 0, 0), false,
             "TestIPAMContext_WarmTargetWithExcludedPrimary"),
            ("WARM_ENI_TARGET 1, one pod on one ENI", ips(1, 0, 0, m5, m5_pods), st(9, 1, 0), true,
             "issue 1635: one pod and the next ENI comes"),
            ("docs t3.small WARM_ENI 1, 5 pods", ips(1, 0, 0, t3, t3_pods), st(9, 5, 0), false,
             "docs table: 4 unused >= 3"),
            ("docs p3dn WARM_ENI 1, 95 pods", ips(1, 0, 0, p3, p3_pods), st(147, 95, 0), false,
             "docs table: 52 unused >= 49"),
            ("MINIMUM_IP_TARGET 10 alone, one ENI", ips(1, 0, 10, m5, m5_pods), st(9, 0, 0), true,
             "one short of the minimum"),
            ("MINIMUM_IP_TARGET 10 alone, two ENIs", ips(1, 0, 10, m5, m5_pods), st(18, 0, 0), false,
             "WARM_ENI_TARGET no longer applies"),
            ("both: WARM 1 MIN 12, 12 pods", ips(1, 1, 12, m5, m5_pods), st(12, 12, 0), true,
             "the warm address is gone"),
            ("WARM_IP_TARGET 20 > ENI of 9, one ENI", ips(1, 20, 0, m5, m5_pods), st(9, 0, 0), true,
             "a target larger than one ENI"),
            ("WARM_IP_TARGET 20 > ENI of 9, two ENIs", ips(1, 20, 0, m5, m5_pods), st(18, 0, 0), true,
             "2 short after two full ENIs"),
            ("WARM_IP_TARGET 20 > ENI of 9, 27 for 9 pods", ips(1, 20, 0, m5, m5_pods), st(27, 9, 0), true,
             "short, below max pods: too low (whether an ENI is left is not this decision's)"),
            ("max pods reached, still short", ips(1, 20, 0, 49, 110), st(110, 95, 0), false,
             "15 free < 20, but max pods: never grow past it"),
            ("max pods passed by whole ENIs", ips(1, 0, 0, 49, 110), st(147, 100, 0), false,
             "47 free < 49, but 147 >= 110"),
            ("max pods not reached", ips(1, 0, 0, 49, 110), st(98, 60, 0), true,
             "38 free < 49 and 98 < 110"),
            ("cooldown: every free address cooling (WARM_ENI)", ips(1, 0, 0, m5, m5_pods), st(18, 9, 9), false,
             "starvation: nothing assignable, yet ipamd counts cooling as available (issue 2896, open)"),
            ("cooldown: issue 2896 values", ips(0, 2, 23, m5, m5_pods), st(23, 19, 4), false,
             "issue 2896: short never > 0; PR 3752's opt-in fix was closed unmerged"),
            ("cooldown: issue 1700 values", ips(1, 2, 0, m5, m5_pods), st(18, 16, 2), false,
             "issue 1700: the 2 available are cooling"),
            ("cooldown over: addresses out of cooldown", ips(1, 2, 0, m5, m5_pods), st(18, 16, 0), false,
             "same figures: cooling changes nothing"),
            // Prefix mode, TestIPAMContext_nodePrefixPoolTooLow's rows.
            ("PD new ds, all defaults", pd(1, 0, 0, 16, 500), pfx(0, 0, 0, 0), true,
             "TestIPAMContext_nodePrefixPoolTooLow"),
            ("PD new ds, 0 ENIs", pd(0, 0, 0, 16, 500), pfx(0, 0, 0, 0), true,
             "TestIPAMContext_nodePrefixPoolTooLow: WARM_PREFIX_TARGET 0 still wants one"),
            ("PD 16 unused, 1 warm prefix", pd(1, 0, 0, 16, 500), pfx(1, 1, 0, 0), false,
             "TestIPAMContext_nodePrefixPoolTooLow"),
            ("PD 1 used, 1 warm prefix", pd(1, 0, 0, 16, 500), pfx(1, 0, 1, 0), true,
             "TestIPAMContext_nodePrefixPoolTooLow: 15 < 16"),
            ("PD 1 used, 0 warm prefix", pd(0, 0, 0, 16, 500), pfx(1, 0, 1, 0), false,
             "TestIPAMContext_nodePrefixPoolTooLow"),
            ("PD 3 used, 1 warm prefix", pd(1, 0, 0, 16, 500), pfx(1, 0, 3, 0), true,
             "TestIPAMContext_nodePrefixPoolTooLow"),
            ("PD 3 used, 0 warm prefix", pd(0, 0, 0, 16, 500), pfx(1, 0, 3, 0), false,
             "TestIPAMContext_nodePrefixPoolTooLow"),
            ("PD max pods exceeded", pd(1, 0, 0, 16, 4), pfx(1, 0, 3, 0), false,
             "TestIPAMContext_nodePrefixPoolTooLow"),
            ("PD WARM_PREFIX_TARGET 1, 3 pods on 2", pd(1, 0, 0, m5, 110), pfx(2, 1, 3, 0), false,
             "29 free >= 16"),
            ("PD WARM_PREFIX_TARGET 0, full prefix", pd(0, 0, 0, m5, 110), pfx(1, 0, 16, 0), true,
             "none free"),
            ("PD WARM_IP_TARGET 16, 1 assigned on 1", pd(1, 16, 0, m5, 110), pfx(1, 0, 1, 0), true,
             "one prefix short (WARM_PREFIX_TARGET ignored)"),
            ("PD WARM_IP_TARGET 5, 1 free prefix", pd(1, 5, 0, m5, 110), pfx(1, 1, 0, 0), false,
             "TestGetWarmIPTargetStateWithPDenabled's last state"),
            ("PD MINIMUM_IP_TARGET 40 on 2 prefixes", pd(0, 0, 40, m5, 110), pfx(2, 2, 0, 0), true,
             "32 < 40: rounds up to a prefix"),
            ("PD max pods reached", pd(1, 0, 0, m5, 110), pfx(7, 0, 100, 0), false,
             "112 >= 110 though 12 free < 16"),
            ("PD cooldown: the only free prefix cooling", pd(1, 0, 0, m5, 110), pfx(2, 1, 16, 16), false,
             "starvation in prefixes: 16 cooling count as available"),
        ];
        check("isDatastorePoolTooLow", rows, PoolTargets::pool_too_low);
    }

    #[test]
    #[rustfmt::skip]
    fn pool_too_high() {
        let (m4, m4_pods) = M4_4XLARGE;
        let (m5, m5_pods) = M5_LARGE;
        let rows: &[Row<bool>] = &[
            // Secondary-IP mode.
            ("WARM_ENI_TARGET alone, 3 ENIs for 9 pods", ips(1, 0, 0, m4, m4_pods), st(87, 9, 0), false,
             "never too high without an IP or prefix target: whole ENIs go instead"),
            ("WARM_ENI_TARGET 0 alone, all free", ips(0, 0, 0, m5, m5_pods), st(27, 0, 0), false,
             "idem"),
            ("WARM_IP_TARGET 1, 4 held 2 assigned", ips(1, 1, 0, m5, m5_pods), st(4, 2, 0), true,
             "TestDecreaseIPPool: over 1"),
            ("WARM_IP_TARGET 1, after the decrease", ips(1, 1, 0, m5, m5_pods), st(3, 2, 0), false,
             "TestDecreaseIPPool: over 0"),
            ("both: WARM 1 MIN 12, 9 pods on 12", ips(1, 1, 12, m5, m5_pods), st(12, 9, 0), false,
             "the minimum keeps the 2 extra"),
            ("both: WARM 1 MIN 12, 9 pods on 20", ips(1, 1, 12, m5, m5_pods), st(20, 9, 0), true,
             "8 above the minimum"),
            ("MINIMUM_IP_TARGET 10 alone, 12 held", ips(1, 0, 10, m5, m5_pods), st(12, 2, 0), true,
             "2 above the minimum"),
            ("MINIMUM_IP_TARGET 10 alone, 10 free", ips(1, 0, 10, m5, m5_pods), st(10, 0, 0), false,
             "all free, all needed for the minimum"),
            ("WARM_IP_TARGET 20 > ENI of 9, 27 free", ips(1, 20, 0, m5, m5_pods), st(27, 0, 0), true,
             "the third ENI overshoots by 7"),
            ("WARM_IP_TARGET 20 > ENI of 9, 7 pods", ips(1, 20, 0, m5, m5_pods), st(27, 7, 0), false,
             "exactly 20 free"),
            ("past max pods", ips(1, 1, 0, m5, 29), st(40, 29, 0), true,
             "too-high ignores max pods (ipamd's note): allocation enforces it"),
            ("cooldown: cooling counts as available", ips(1, 2, 0, m5, m5_pods), st(18, 10, 6), true,
             "8 available, 6 cooling: over 6 as in ipamd; only idle addresses are released"),
            // Prefix mode.
            ("PD WARM_PREFIX_TARGET 1, 1 free", pd(1, 0, 0, m5, 110), pfx(2, 1, 3, 0), false,
             "free prefixes == target"),
            ("PD WARM_PREFIX_TARGET 1, 2 free", pd(1, 0, 0, m5, 110), pfx(3, 2, 3, 0), true,
             "free prefixes > target"),
            ("PD WARM_PREFIX_TARGET 0, 1 free", pd(0, 0, 0, m5, 110), pfx(1, 1, 0, 0), true,
             "WARM_PREFIX_TARGET 0 is defined with prefixes (TestIPAMContext_WarmPrefixTargetDefined)"),
            ("PD WARM_PREFIX_TARGET 1, partly used", pd(1, 0, 0, m5, 110), pfx(3, 0, 3, 0), false,
             "no free prefix: used prefixes never count"),
            ("PD WARM_IP_TARGET 5, 2 free prefixes", pd(0, 5, 0, m5, 110), pfx(2, 2, 0, 0), true,
             "TestGetWarmIPTargetStateWithPDenabled: over 1"),
            ("PD WARM_IP_TARGET 5, 1 free prefix", pd(0, 5, 0, m5, 110), pfx(1, 1, 0, 0), false,
             "TestGetWarmIPTargetStateWithPDenabled: over 0"),
            ("PD WARM_IP_TARGET 16, 1 assigned on 3", pd(0, 16, 0, m5, 110), pfx(3, 2, 1, 0), true,
             "2 needed, 1 over"),
            ("PD WARM_IP_TARGET 16, 1 assigned on 2", pd(0, 16, 0, m5, 110), pfx(2, 1, 1, 0), false,
             "both needed: 15 + 16 free"),
            ("PD WARM_IP_TARGET 15 after churn", pd(0, 15, 0, m5, 110), pfx(3, 0, 3, 0), false,
             "42 beyond the target but no free prefix"),
            ("PD MINIMUM_IP_TARGET 40 on 4 prefixes", pd(0, 0, 40, m5, 110), pfx(4, 4, 0, 0), true,
             "3 needed for the minimum"),
            ("PD MINIMUM_IP_TARGET 40 on 3 prefixes", pd(0, 0, 40, m5, 110), pfx(3, 3, 0, 0), false,
             "all 3 needed"),
            ("PD cooldown: a cooling prefix counts free", pd(1, 0, 0, m5, 110), pfx(3, 2, 16, 16), true,
             "GetFreePrefixes looks at assignment only; only idle prefixes are released"),
        ];
        check("isDatastorePoolTooHigh", rows, PoolTargets::pool_too_high);
    }

    #[test]
    #[rustfmt::skip]
    fn should_remove_extra_enis() {
        let (m4, m4_pods) = M4_4XLARGE;
        let (m5, m5_pods) = M5_LARGE;
        let rows: &[Row<bool>] = &[
            // Secondary-IP mode: (WARM_ENI_TARGET + 1) ENIs' worth free.
            ("WARM_ENI_TARGET 1, two ENIs' worth minus pods", ips(1, 0, 0, m4, m4_pods), st(58, 9, 0), false,
             "49 free < 58"),
            ("WARM_ENI_TARGET 1, three ENIs", ips(1, 0, 0, m4, m4_pods), st(87, 9, 0), true,
             "78 free >= 58"),
            ("WARM_ENI_TARGET 1, exactly two ENIs free", ips(1, 0, 0, m4, m4_pods), st(58, 0, 0), true,
             "the +1 keeps WARM_ENI_TARGET: >= is enough"),
            ("WARM_ENI_TARGET 0, one ENI free", ips(0, 0, 0, m5, m5_pods), st(9, 0, 0), true,
             "9 >= 9"),
            ("WARM_ENI_TARGET 0, one pod", ips(0, 0, 0, m5, m5_pods), st(9, 1, 0), false,
             "8 < 9"),
            ("WARM_IP_TARGET set", ips(1, 1, 12, m5, m5_pods), st(12, 9, 0), true,
             "always: getDeletableENI checks the targets ENI by ENI"),
            ("MINIMUM_IP_TARGET alone", ips(1, 0, 10, m5, m5_pods), st(10, 10, 0), true,
             "always, as with WARM_IP_TARGET"),
            ("cooldown: cooling counts as available", ips(1, 0, 0, m4, m4_pods), st(87, 9, 29), true,
             "78 available; an ENI with a cooling address is not the one chosen (hasIPInCooling)"),
            // Prefix mode: (WARM_PREFIX_TARGET + 1) ENIs' worth, an ENI's worth
            // being 9 slots x 16 = 144 addresses on an m5.large.
            ("PD WARM_PREFIX_TARGET 1, 3 prefixes", pd(1, 0, 0, m5, 110), pfx(3, 2, 3, 0), false,
             "45 free < 2 x 144, no freeable ENI"),
            ("PD WARM_PREFIX_TARGET 1, two ENIs' worth free", pd(1, 0, 0, m5, 110), pfx(18, 18, 0, 0), true,
             "288 free >= 2 x 144"),
            ("PD WARM_PREFIX_TARGET 0, one ENI's worth free", pd(0, 0, 0, m5, 110), pfx(9, 9, 0, 0), true,
             "144 >= 144"),
            ("PD WARM_PREFIX_TARGET 0, one pod", pd(0, 0, 0, m5, 110), pfx(9, 8, 1, 0), false,
             "143 < 144, no freeable ENI"),
            ("PD WARM_IP_TARGET set", pd(1, 5, 0, m5, 110), pfx(1, 0, 1, 0), true,
             "always, as in secondary-IP mode"),
        ];
        check("shouldRemoveExtraENIs", rows, |t, s| t.should_remove_extra_enis(s, false));

        // With a freeable ENI (CheckFreeableENIexists): prefix mode only.
        let rows: &[Row<bool>] = &[
            ("PD freeable ENI, 3 prefixes", pd(1, 0, 0, m5, 110), pfx(3, 2, 3, 0), true,
             "prefixes went below the threshold after WARM_PREFIX_TARGET dropped, an empty ENI is left"),
            ("PD freeable ENI, one pod", pd(0, 0, 0, m5, 110), pfx(9, 8, 1, 0), true,
             "the ENI without pods may go"),
            ("freeable ENI ignored without prefixes", ips(1, 0, 0, m4, m4_pods), st(58, 9, 0), false,
             "secondary-IP mode looks at the addresses only"),
        ];
        check("shouldRemoveExtraENIs (freeable ENI)", rows, |t, s| t.should_remove_extra_enis(s, true));
    }

    #[test]
    fn max_pods_as_the_eks_calculator() {
        let m5_large = InstanceTypeLimits {
            max_enis: 3,
            ips_per_eni: 10,
            vcpus: 2,
        };
        assert_eq!(default_max_pods(m5_large, 3, false), 29);
        assert_eq!(default_max_pods(m5_large, 3, true), 110);
        let t3_medium = InstanceTypeLimits {
            max_enis: 3,
            ips_per_eni: 6,
            vcpus: 2,
        };
        assert_eq!(default_max_pods(t3_medium, 3, false), 17);
        let c5_18xl = InstanceTypeLimits {
            max_enis: 15,
            ips_per_eni: 50,
            vcpus: 72,
        };
        assert_eq!(default_max_pods(c5_18xl, 15, false), 737);
        assert_eq!(default_max_pods(c5_18xl, 15, true), 250);
    }

    #[test]
    fn max_ips_every_slot_of_every_eni() {
        let m5_large = InstanceTypeLimits {
            max_enis: 3,
            ips_per_eni: 10,
            vcpus: 2,
        };
        assert_eq!(
            max_ips(m5_large, 3, false),
            27,
            "9 secondary slots on 3 ENIs"
        );
        assert_eq!(max_ips(m5_large, 3, true), 432, "a /28 in each slot");
        assert_eq!(max_ips(m5_large, 2, false), 18, "MAX_ENI 2");
    }

    fn eni(id: &str, device_number: u32) -> EniSnapshot {
        EniSnapshot {
            id: id.to_owned(),
            device_number,
            ..EniSnapshot::default()
        }
    }

    /// `n` addresses of ENI `device`.
    fn addrs(device: u8, n: u8) -> Vec<Ipv4Addr> {
        (1..=n).map(|i| Ipv4Addr::new(10, 0, device, i)).collect()
    }

    /// An ENI whose `n` addresses are all free and out of their cooldown.
    fn idle(id: &str, device: u8, n: u8) -> EniSnapshot {
        EniSnapshot {
            total_ips: n.into(),
            idle_addrs: addrs(device, n),
            ..eni(id, device.into())
        }
    }

    /// The primary ENI with `held` of its `n` addresses assigned.
    fn primary(n: u8, held: u8) -> EniSnapshot {
        EniSnapshot {
            primary: true,
            assigned: held.into(),
            total_ips: n.into(),
            idle_addrs: addrs(0, n - held),
            ..eni("eni-primary", 0)
        }
    }

    #[test]
    fn shrink_gives_back_what_warm_ip_target_does_not_need_from_the_highest_eni() {
        let (m5, m5_pods) = M5_LARGE;
        // WARM_IP_TARGET 2: 6 free of 14, so 4 over.
        let targets = ips(1, 2, 0, m5, m5_pods);
        let enis = [primary(9, 8), idle("eni-1", 1, 5)];
        assert_eq!(
            plan_shrink(&targets, &st(14, 8, 0), &enis, false),
            Some(Shrink::Release {
                eni: "eni-1".to_owned(),
                addrs: addrs(1, 4),
                prefixes: Vec::new(),
            })
        );
        // Custom networking's primary ENI serves no pod: its idle
        // addresses are not the pool's to give back.
        let excluded = EniSnapshot {
            excluded_for_pods: true,
            ..idle("eni-2", 2, 3)
        };
        let enis = [primary(9, 8), idle("eni-1", 1, 5), excluded];
        assert_eq!(
            plan_shrink(&targets, &st(17, 8, 0), &enis, true),
            Some(Shrink::Release {
                eni: "eni-1".to_owned(),
                addrs: addrs(1, 5),
                prefixes: Vec::new(),
            }),
            "7 over, 5 idle on eni-1; a cordon holds ENIs, not addresses"
        );
    }

    #[test]
    fn shrink_gives_back_prefixes_beyond_warm_prefix_target() {
        let (m5, _) = M5_LARGE;
        let prefix = |i: u8| Ipv4Net::new(Ipv4Addr::new(10, 0, 16, i * 16), 28).unwrap();
        let with_prefixes = EniSnapshot {
            total_ips: 32,
            prefixes: 2,
            idle_prefixes: vec![prefix(0), prefix(1)],
            // Never given back one by one with prefix delegation.
            idle_addrs: addrs(1, 2),
            ..eni("eni-1", 1)
        };
        let enis = [
            EniSnapshot {
                prefixes: 1,
                ..primary(16, 3)
            },
            with_prefixes,
        ];
        assert_eq!(
            plan_shrink(&pd(1, 0, 0, m5, 110), &pfx(3, 2, 3, 0), &enis, false),
            Some(Shrink::Release {
                eni: "eni-1".to_owned(),
                addrs: Vec::new(),
                prefixes: vec![prefix(0)],
            }),
            "2 free prefixes, WARM_PREFIX_TARGET 1: one goes"
        );
    }

    #[test]
    fn shrink_frees_the_highest_eni_nothing_holds() {
        let (m5, m5_pods) = M5_LARGE;
        // WARM_ENI_TARGET 1: 22 free >= 2 ENIs' worth (18).
        let targets = ips(1, 0, 0, m5, m5_pods);
        let stats = st(27, 5, 0);
        let free = |enis: &[EniSnapshot], held| plan_shrink(&targets, &stats, enis, held);
        let (eni1, eni2) = (idle("eni-1", 1, 9), idle("eni-2", 2, 9));
        assert_eq!(
            free(&[primary(9, 5), eni1.clone(), eni2.clone()], false),
            Some(Shrink::FreeEni("eni-2".to_owned()))
        );
        assert_eq!(
            free(&[primary(9, 5), eni1.clone(), eni2.clone()], true),
            None,
            "cordoned: no ENI freed"
        );
        let young = EniSnapshot {
            kept: true,
            ..eni2.clone()
        };
        assert_eq!(
            free(&[primary(9, 5), eni1.clone(), young], false),
            Some(Shrink::FreeEni("eni-1".to_owned())),
            "younger than min_eni_lifetime (or left alone): kept"
        );
        let cooling = EniSnapshot {
            idle_addrs: addrs(2, 8),
            ..eni2.clone()
        };
        assert_eq!(
            free(&[primary(9, 5), eni1.clone(), cooling], false),
            Some(Shrink::FreeEni("eni-1".to_owned())),
            "an address still cooling keeps its ENI"
        );
        let in_use = EniSnapshot {
            assigned: 1,
            idle_addrs: addrs(1, 8),
            ..eni1
        };
        assert_eq!(
            free(&[primary(9, 9), in_use, eni2], false),
            Some(Shrink::FreeEni("eni-2".to_owned()))
        );
        assert_eq!(
            free(&[primary(9, 5)], false),
            None,
            "the primary ENI is never freed"
        );
    }

    #[test]
    fn shrink_keeps_an_eni_the_targets_need() {
        let (m5, m5_pods) = M5_LARGE;
        // WARM_IP_TARGET 10: 10 free of 18, none over; freeing eni-1 would
        // leave 1.
        let enis = [primary(9, 8), idle("eni-1", 1, 9)];
        assert_eq!(
            plan_shrink(&ips(1, 10, 0, m5, m5_pods), &st(18, 8, 0), &enis, false),
            None
        );
        // WARM_ENI_TARGET 1: 17 free < 2 ENIs' worth.
        let enis = [primary(9, 1), idle("eni-1", 1, 9)];
        assert_eq!(
            plan_shrink(&ips(1, 0, 0, m5, m5_pods), &st(18, 1, 0), &enis, false),
            None
        );
    }

    /// An m5.large's room (10 addresses an ENI, 3 ENIs), the ENIs at
    /// `devices` attached.
    fn room(devices: &[u32]) -> EniRoom {
        EniRoom {
            slots_per_eni: 10,
            devices_used: devices.iter().copied().collect(),
            attached: devices.len(),
            max_enis: 3,
            can_make_eni: true,
        }
    }

    /// An ENI using `slots` of its slots (its own address included).
    fn using(id: &str, device: u32, slots: usize) -> EniSnapshot {
        EniSnapshot {
            slots_used: slots,
            ..eni(id, device)
        }
    }

    #[test]
    fn growth_fills_the_lowest_eni_with_room_then_makes_one() {
        let (m5, m5_pods) = M5_LARGE;
        // WARM_ENI_TARGET 1: 4 free < an ENI's 9.
        let targets = ips(1, 0, 0, m5, m5_pods);
        let grow = |enis: &[EniSnapshot], room: &EniRoom| {
            plan_growth(&targets, &targets, &st(9, 5, 0), enis, room)
        };
        let full = using("eni-primary", 0, 10);
        assert_eq!(
            grow(std::slice::from_ref(&full), &room(&[0])),
            Some(Growth::NewEni {
                device: 1,
                n: 9,
                prefixes: false
            }),
            "a new ENI, filled"
        );
        assert_eq!(
            grow(
                &[full.clone(), using("eni-2", 2, 4), using("eni-1", 1, 7)],
                &room(&[0, 1, 2])
            ),
            Some(Growth::OnEni {
                eni: "eni-1".to_owned(),
                n: 3,
                prefixes: false
            }),
            "the lowest ENI with a free slot, filled"
        );
        let excluded = EniSnapshot {
            excluded_for_pods: true,
            ..using("eni-1", 1, 2)
        };
        assert_eq!(
            grow(&[full.clone(), excluded], &room(&[0, 1, 3])),
            None,
            "3 ENIs attached (one left alone), the one with room serves no pod"
        );
        assert_eq!(
            grow(std::slice::from_ref(&full), &room(&[0, 1])),
            Some(Growth::NewEni {
                device: 2,
                n: 9,
                prefixes: false
            }),
            "device 1 is taken by an ENI left alone"
        );
        let no_eni_config = EniRoom {
            can_make_eni: false,
            ..room(&[0])
        };
        assert_eq!(grow(std::slice::from_ref(&full), &no_eni_config), None);
        assert_eq!(
            plan_growth(&targets, &targets, &st(18, 5, 0), &[full], &room(&[0, 1])),
            None,
            "13 free: not too low"
        );
    }

    #[test]
    fn growth_takes_what_warm_ip_target_lacks_up_to_max_pods() {
        let (m5, m5_pods) = M5_LARGE;
        let full = [using("eni-primary", 0, 10)];
        let new_eni = |n| {
            Some(Growth::NewEni {
                device: 1,
                n,
                prefixes: false,
            })
        };
        let targets = ips(1, 5, 0, m5, m5_pods);
        assert_eq!(
            plan_growth(&targets, &targets, &st(9, 7, 0), &full, &room(&[0])),
            new_eni(3),
            "2 free, 5 wanted"
        );
        let targets = ips(1, 5, 0, m5, 11);
        assert_eq!(
            plan_growth(&targets, &targets, &st(9, 7, 0), &full, &room(&[0])),
            new_eni(2),
            "max pods 11 leaves room for 2"
        );
        let targets = ips(1, 0, 12, m5, m5_pods);
        assert_eq!(
            plan_growth(&targets, &targets, &st(9, 0, 0), &full, &room(&[0])),
            new_eni(3),
            "MINIMUM_IP_TARGET 12 on 9"
        );
    }

    #[test]
    fn growth_with_prefixes_and_after_falling_back_to_addresses() {
        let (m5, _) = M5_LARGE;
        let configured = pd(1, 0, 0, m5, 110);
        let fell_back = PoolTargets {
            prefix_delegation: false,
            ..configured
        };
        // One prefix, all 16 held: WARM_PREFIX_TARGET 1 wants one more.
        let stats = pfx(1, 0, 16, 0);
        let enis = [using("eni-primary", 0, 2)];
        assert_eq!(
            plan_growth(&configured, &configured, &stats, &enis, &room(&[0])),
            Some(Growth::OnEni {
                eni: "eni-primary".to_owned(),
                n: 1,
                prefixes: true
            })
        );
        assert_eq!(
            plan_growth(&configured, &fell_back, &stats, &enis, &room(&[0])),
            Some(Growth::OnEni {
                eni: "eni-primary".to_owned(),
                n: 8,
                prefixes: false
            }),
            "a prefix's worth of addresses, as many as the ENI's 8 free slots take"
        );
    }
}
