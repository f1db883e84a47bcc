//! The lab node's kubelet for the DaemonSet pods: which DaemonSet objects the
//! node runs, as the API server says ([`daemon_sets`]), each pod template
//! made into the runtime's calls ([`pod_spec`]), run and kept running
//! through containerd's CRI ([`runner`]) as kubelet runs it, so the agent
//! the lab tests is the image's, with the DaemonSet's mounts,
//! environment, security context and probes.

pub mod daemon_sets;
pub mod host_paths;
pub mod pod_spec;
pub mod runner;

pub use daemon_sets::{LABEL_DAEMON_SET, NodeDaemonSets, NodeTemplate, SyncError};
pub use pod_spec::{ContainerPlan, ExecProbe, NodeContext, PlanError, PodPlan, plan};
pub use runner::{ContainerStatusLine, PodRunner, PodStatus, RELIST, RunError};
