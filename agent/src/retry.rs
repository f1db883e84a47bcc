//! The agent's one retry schedule: exponential backoff with "equal jitter"
//! (each delay half fixed, half random), so agents throttled together do
//! not retry together. Every call the agent retries (EC2 and IMDS at start,
//! the address manager's EC2 calls and attachment polls, the Kubernetes
//! patches, the service CIDRs' read, introspection's bind) takes its delays
//! from here; the caller bounds the tries by its own deadline or error kind.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// Delays that start near `first` and double up to `cap`, each drawn from
/// `[d/2, d)` of its step `d`, without end.
///
/// backon's jitter adds up to one more step to a step (`[s, 2s)`), so its
/// steps are half of ours.
#[must_use]
pub fn policy(first: Duration, cap: Duration) -> ExponentialBuilder {
    ExponentialBuilder::new()
        .with_min_delay(first / 2)
        .with_max_delay(cap / 2)
        .with_jitter()
        .without_max_times()
}

/// The delays of [`policy`], for loops that sleep between their own tries.
#[must_use]
pub fn delays(first: Duration, cap: Duration) -> ExponentialBackoff {
    policy(first, cap).build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_to_the_cap_with_half_of_each_random() {
        let (first, cap) = (Duration::from_millis(200), Duration::from_secs(20));
        let mut step = first;
        for (n, delay) in delays(first, cap).take(12).enumerate() {
            assert!(
                delay >= step / 2 && delay <= step,
                "try {n}: {delay:?} outside [{:?}, {step:?}]",
                step / 2
            );
            step = (step * 2).min(cap);
        }
    }

    #[test]
    fn delays_never_end() {
        assert_eq!(
            delays(Duration::from_millis(10), Duration::from_millis(40))
                .take(1000)
                .count(),
            1000
        );
    }
}
