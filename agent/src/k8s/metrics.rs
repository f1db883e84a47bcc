//! The Kubernetes side's metrics: the API server's answers (a failing API
//! server shows here while the watchers retry), and aws-node's pod-ENI
//! errors on the way to branch ENIs.

use prometheus::Registry;

use crate::telemetry::{Families, Recorded};

/// The families of what the Kubernetes client and followers recorded.
///
/// # Errors
/// A name the registry refuses (a bug) or has already.
pub fn register(registry: &Registry, recorded: &Recorded) -> prometheus::Result<()> {
    let mut f = Families::new();
    f.counters(
        "vpcnet_kubernetes_api_answers_total",
        "Kubernetes API requests by the HTTP status of the answer (none: no answer)",
        &["code"],
        recorded.kubernetes_answers.iter().map(|(status, n)| {
            let code = status.map_or_else(|| "none".to_owned(), |s| s.to_string());
            (vec![code], *n)
        }),
    )
    .counters(
        "awscni_pod_eni_error_count",
        "The number of errors encountered for pod ENIs",
        &["fn"],
        recorded
            .pod_eni_errors
            .iter()
            .map(|(function, n)| (vec![(*function).to_owned()], *n)),
    );
    f.register(registry)
}
