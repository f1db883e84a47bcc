//! The AWS calls' metrics, under aws-node's names: EC2 requests and their
//! failures by call name, the error codes AWS answered, and the latency of
//! every call (EC2's and IMDS's).

use std::collections::BTreeMap;

use prometheus::Registry;

use crate::telemetry::{Families, Recorded};

/// The families of what the cloud client recorded.
///
/// # Errors
/// A name the registry refuses (a bug) or has already.
pub fn register(registry: &Registry, recorded: &Recorded) -> prometheus::Result<()> {
    let by_fn = |map: &BTreeMap<&'static str, u64>| {
        map.iter()
            .map(|(function, n)| (vec![(*function).to_owned()], *n))
            .collect::<Vec<_>>()
    };
    let mut f = Families::new();
    f.counters(
        "awscni_ec2api_req_count",
        "The number of requests made to EC2 APIs by CNI",
        &["fn"],
        by_fn(&recorded.ec2_requests),
    )
    .counters(
        "awscni_ec2api_error_count",
        "The number of failed EC2 APIs requests",
        &["fn"],
        by_fn(&recorded.ec2_errors),
    )
    .counters(
        "awscni_aws_api_error_count",
        "The number of times AWS API returns an error",
        &["api", "error"],
        recorded
            .api_errors
            .iter()
            .map(|((api, code), n)| (vec![(*api).to_owned(), code.clone()], *n)),
    )
    .summaries(
        "awscni_aws_api_latency_ms",
        "AWS API call latency in ms",
        &["api", "error", "status"],
        recorded.latency.iter().map(|(key, latency)| {
            (
                vec![
                    key.api.to_owned(),
                    key.error.to_string(),
                    key.status.clone(),
                ],
                #[allow(clippy::cast_precision_loss)] // milliseconds
                (latency.count, latency.sum_ms as f64),
            )
        }),
    );
    f.register(registry)
}
