//! Latency summaries and distributions, and medians over rounds.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Buckets per doubling of the latency histogram: bucket edges grow by
/// 2^(1/16), about 4.4 %, finer than the round-to-round noise.
const BUCKETS_PER_OCTAVE: f64 = 16.0;

/// What a set of latency samples looks like: percentiles, and a
/// log-scaled histogram (the distribution, for plots) in microseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    pub samples: u64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
    pub mean_us: f64,
    /// `(upper edge in µs, samples)` of every non-empty bucket, ascending.
    pub histogram: Vec<(f64, u64)>,
}

impl Latency {
    /// Summarises `samples` (nanoseconds); sorts them.
    pub fn of(samples: &mut [u64]) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_unstable();
        let us = |ns: u64| ns as f64 / 1000.0;
        let at = |q: f64| us(percentile_sorted(samples, q));
        let sum: u128 = samples.iter().map(|&ns| u128::from(ns)).sum();
        Self {
            samples: samples.len() as u64,
            p50_us: at(0.50),
            p90_us: at(0.90),
            p99_us: at(0.99),
            p999_us: at(0.999),
            max_us: us(samples[samples.len() - 1]),
            mean_us: sum as f64 / samples.len() as f64 / 1000.0,
            histogram: histogram(samples),
        }
    }
}

/// The nearest-rank percentile of ascending `sorted` (`q` in 0..=1).
fn percentile_sorted(sorted: &[u64], q: f64) -> u64 {
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The bucket of a sample of `ns` nanoseconds (1 µs and below share the
/// first).
fn bucket_of(ns: u64) -> i32 {
    let us = (ns as f64 / 1000.0).max(1.0);
    (us.log2() * BUCKETS_PER_OCTAVE).ceil() as i32
}

fn bucket_upper_us(bucket: i32) -> f64 {
    (f64::from(bucket) / BUCKETS_PER_OCTAVE).exp2()
}

/// Histogram of ascending `sorted`: `(upper edge µs, count)`.
fn histogram(sorted: &[u64]) -> Vec<(f64, u64)> {
    let mut buckets: Vec<(i32, u64)> = Vec::new();
    for &ns in sorted {
        let bucket = bucket_of(ns);
        match buckets.last_mut() {
            Some((last, count)) if *last == bucket => *count += 1,
            _ => buckets.push((bucket, 1)),
        }
    }
    buckets
        .into_iter()
        .map(|(bucket, count)| (bucket_upper_us(bucket), count))
        .collect()
}

/// The median of `values` (the mean of the middle two for an even count);
/// `None` when there are none.
pub fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    Some(if sorted.len().is_multiple_of(2) {
        f64::midpoint(sorted[mid - 1], sorted[mid])
    } else {
        sorted[mid]
    })
}

/// Nanoseconds of `d`, saturating (a sample never comes near 584 years).
pub fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let mut samples: Vec<u64> = (1..=1000).map(|i| i * 1000).collect();
        samples.reverse();
        let latency = Latency::of(&mut samples);
        assert_eq!(latency.samples, 1000);
        assert!((latency.p50_us - 500.0).abs() < f64::EPSILON);
        assert!((latency.p99_us - 990.0).abs() < f64::EPSILON);
        assert!((latency.p999_us - 999.0).abs() < f64::EPSILON);
        assert!((latency.max_us - 1000.0).abs() < f64::EPSILON);
        assert!((latency.mean_us - 500.5).abs() < 1e-9);
        let counted: u64 = latency.histogram.iter().map(|(_, n)| n).sum();
        assert_eq!(counted, 1000);
        assert!(latency.histogram.windows(2).all(|w| w[0].0 < w[1].0));
    }

    #[test]
    fn histogram_edges_bound_their_samples() {
        let mut samples = vec![900, 25_000, 25_400, 1_000_000];
        let latency = Latency::of(&mut samples);
        // 0.9 µs in the first bucket (1 µs), 25 and 25.4 µs together in a
        // bucket whose upper edge is just above, 1 ms alone.
        assert_eq!(latency.histogram.len(), 3);
        assert!((latency.histogram[0].0 - 1.0).abs() < f64::EPSILON);
        assert_eq!(latency.histogram[1].1, 2);
        let edge = latency.histogram[1].0;
        assert!((25.4..25.4 * 1.045).contains(&edge), "{edge}");
    }

    #[test]
    fn medians() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(Latency::of(&mut []), Latency::default());
    }
}
