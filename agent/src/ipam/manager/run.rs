//! The pool's one task: a pass over the pool, the periodic jobs when due
//! (node sync, VPC CIDRs, link check, leak sweep), backing off on errors;
//! the node's cordon holds the pool as aws-node holds it.

use std::time::{Duration, Instant};

use backon::ExponentialBackoff;
use tokio::sync::watch;
use tracing::{info, warn};
use vpcnet_api::node::UNSCHEDULABLE_TAINT;

use super::{Manager, ManagerError, ManagerOptions, Severity, bump, network::LINK_CHECK_INTERVAL};
use crate::{ipam::settings::ENV_MANAGE_ENIS_NON_SCHEDULABLE, retry};

/// The delays between failed passes: [`retry`]'s schedule, from its first
/// delay again after a pass that succeeds.
struct Backoff {
    first: Duration,
    cap: Duration,
    delays: ExponentialBackoff,
}

impl Backoff {
    fn new(first: Duration, cap: Duration) -> Self {
        Self {
            first,
            cap,
            delays: retry::delays(first, cap),
        }
    }

    fn next_delay(&mut self) -> Duration {
        // The schedule never ends; the cap if it did.
        self.delays.next().unwrap_or(self.cap)
    }

    fn reset(&mut self) {
        self.delays = retry::delays(self.first, self.cap);
    }
}

/// Whether the node is cordoned, as far as the manager is told.
fn cordoned(opts: &ManagerOptions) -> bool {
    opts.cordoned.as_ref().is_some_and(|c| *c.borrow())
}

/// Returns when `input` changes; never once its sender is gone (or if
/// there is none).
async fn input_changed<T>(input: &mut Option<watch::Receiver<T>>) {
    if let Some(receiver) = input.as_mut() {
        if receiver.changed().await.is_ok() {
            return;
        }
        *input = None;
    }
    std::future::pending::<()>().await;
}

impl Manager {
    /// Keeps the pool at its targets until the task is dropped.
    pub async fn run(self) {
        let me = &self.inner;
        let mut backoff = Backoff::new(me.opts.backoff_base, me.opts.backoff_max);
        let mut next_leak_sweep = Instant::now();
        let mut next_cidr_read = Instant::now();
        let mut next_link_check = Instant::now();
        let mut next_node_reconcile = Instant::now() + me.opts.node_reconcile_interval;
        let provisioning = me.opts.settings.provisioning;
        // The EC2 call and code of the last failed pass: an event is
        // raised when they change, not on every retry.
        let mut last_failure: Option<(Option<&'static str>, Option<String>)> = None;
        // Their changes wake the loop.
        let (mut cordon_changes, mut eni_config_changes) =
            (me.opts.cordoned.clone(), me.opts.eni_configs.clone());
        let mut was_cordoned = false;
        loop {
            self.say_cordon(&mut was_cordoned);
            let mut result = if provisioning {
                self.reconcile().await
            } else {
                Ok(())
            };
            if Instant::now() >= next_node_reconcile {
                let found = self.reconcile_attached().await;
                next_node_reconcile = Instant::now() + me.opts.node_reconcile_interval;
                result = result.and(found);
            }
            if result.is_ok() && Instant::now() >= next_cidr_read {
                result = self.refresh_vpc_cidrs().await;
                next_cidr_read = Instant::now() + me.opts.vpc_cidr_interval;
            }
            if Instant::now() >= next_link_check {
                self.check_links().await;
                next_link_check = Instant::now() + LINK_CHECK_INTERVAL;
            }
            if result.is_ok()
                && provisioning
                && me.opts.settings.leaked_eni_cleanup
                && Instant::now() >= next_leak_sweep
            {
                result = self.sweep_leaked_enis().await;
                // Jittered so the nodes of a cluster do not sweep together.
                next_leak_sweep =
                    Instant::now() + me.opts.leaked_eni_interval.mul_f64(0.5 + fastrand::f64());
            }
            me.pool_changed.notify_waiters();
            let pause = match result {
                Ok(()) => {
                    backoff.reset();
                    last_failure = None;
                    me.opts.reconcile_interval
                }
                Err(e) => {
                    if let ManagerError::Cloud(c) = &e {
                        if c.is_throttling() {
                            bump(&me.counters.ec2_throttled, 1);
                        }
                        if c.is_subnet_exhausted() {
                            bump(&me.counters.subnet_exhausted, 1);
                        }
                        let failure = (c.action(), c.code().map(str::to_owned));
                        if last_failure.as_ref() != Some(&failure) {
                            self.cloud_error_event(c);
                            last_failure = Some(failure);
                        }
                    }
                    bump(&me.counters.ec2_errors, 1);
                    let delay = backoff.next_delay();
                    if e.backs_off() {
                        info!(error = %e, retry_in = ?delay, "pool reconcile backing off");
                    } else {
                        warn!(error = %e, retry_in = ?delay, "pool reconcile failed");
                    }
                    // Backing off: a pod waiting does not cut it short.
                    tokio::time::sleep(delay).await;
                    continue;
                }
            };
            tokio::select! {
                _ = tokio::time::timeout(pause, me.wake.notified()) => {}
                () = input_changed(&mut cordon_changes) => {}
                () = input_changed(&mut eni_config_changes) => {}
            }
        }
    }

    /// One pass: finish draining, give back what excluded subnets' ENIs
    /// hold idle, grow if too low, shrink if too high.
    async fn reconcile(&self) -> Result<(), ManagerError> {
        self.drain().await?;
        self.release_excluded().await?;
        let held = self.cordon_holds();
        if held {
            if self.plan_growth().await.is_some() {
                bump(&self.inner.counters.cordon_held, 1);
            }
        } else {
            // Bounded: each step adds at least one address or an ENI.
            for _ in 0..self.inner.node.max_enis * 2 + 2 {
                let plan = self.plan_growth().await;
                let Some(plan) = plan else { break };
                self.grow(plan).await?;
            }
        }
        self.shrink(held).await
    }

    /// Whether the node is cordoned and `AWS_MANAGE_ENIS_NON_SCHEDULABLE`
    /// is not true: no ENI attached or freed, no address or prefix
    /// assigned (aws-node's `isENIAttachmentAllowed`, `tryFreeENI`).
    fn cordon_holds(&self) -> bool {
        let opts = &self.inner.opts;
        !opts.settings.manage_enis_non_schedulable && cordoned(opts)
    }

    /// Logs (and records) the node's cordon when it changes from `was`.
    fn say_cordon(&self, was: &mut bool) {
        let now = cordoned(&self.inner.opts);
        if now == *was {
            return;
        }
        *was = now;
        let message = match (now, self.inner.opts.settings.manage_enis_non_schedulable) {
            (true, false) => format!(
                "the node is cordoned (its Node is tainted {UNSCHEDULABLE_TAINT}:NoSchedule): \
                 no ENI attached or freed and no address or prefix assigned until it is not \
                 ({ENV_MANAGE_ENIS_NON_SCHEDULABLE} is false); pods get the warm pool's addresses"
            ),
            (true, true) => format!(
                "the node is cordoned (its Node is tainted {UNSCHEDULABLE_TAINT}:NoSchedule): \
                 the pool is managed anyway ({ENV_MANAGE_ENIS_NON_SCHEDULABLE} is true)"
            ),
            (false, _) => "the node is schedulable again: the pool follows its targets".to_owned(),
        };
        self.event(
            Severity::Normal,
            if now {
                "NodeCordoned"
            } else {
                "NodeSchedulable"
            },
            "NodeWatch",
            message,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_its_cap_with_jitter() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let delays: Vec<Duration> = (0..12).map(|_| b.next_delay()).collect();
        for (i, d) in delays.iter().enumerate() {
            let full = Duration::from_millis(100)
                .saturating_mul(1 << i)
                .min(Duration::from_secs(5));
            assert!(
                *d >= full / 2 && *d <= full,
                "attempt {i}: {d:?} not in [{:?}, {full:?}]",
                full / 2
            );
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
