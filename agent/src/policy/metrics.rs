//! Network policy's metrics: what it decided for each local pod, as
//! `vpcnet-agent policy` shows it.

use prometheus::Registry;

use super::node::PodSnapshot;
use crate::telemetry::Families;

/// Registers the pods' verdicts (no samples when policy is off).
///
/// # Errors
/// A name the registry refuses (a bug) or has already.
pub fn register(registry: &Registry, pods: &[PodSnapshot]) -> prometheus::Result<()> {
    let samples = pods.iter().flat_map(|pod| {
        let v = pod.verdicts;
        [
            ("ingress", "allowed", v.ingress_allowed),
            ("ingress", "denied", v.ingress_denied),
            ("egress", "allowed", v.egress_allowed),
            ("egress", "denied", v.egress_denied),
        ]
        .map(|(direction, verdict, value)| {
            let labels = vec![
                pod.name.namespace.clone(),
                pod.name.name.clone(),
                direction.to_owned(),
                verdict.to_owned(),
            ];
            (labels, value)
        })
    });
    let mut f = Families::new();
    f.counters(
        "vpcnet_policy_pod_verdicts_total",
        "Network policy's verdicts per local pod: connections its rules allowed (at their first \
         packet) and packets they denied, by direction.",
        &["namespace", "pod", "direction", "verdict"],
        samples,
    );
    f.register(registry)
}
