//! The lab node's kubelet for a DaemonSet's pod: the pod template
//! rendered from `deploy/` made into the runtime's calls ([`pod_spec`]),
//! run and kept running through containerd's CRI ([`runner`]) as kubelet
//! runs it, so the agent the lab tests is the image's, with the
//! DaemonSet's mounts, environment, security context and probes.

pub mod pod_spec;
pub mod runner;

pub use pod_spec::{ContainerPlan, ExecProbe, NodeContext, PlanError, PodPlan, plan};
pub use runner::{ContainerStatusLine, PodRunner, PodStatus, RELIST, RunError};
