//! The DaemonSet controller's work for the lab's one node, done where the
//! lab's kubelet runs: every relist it reads the node's labels, the
//! DaemonSet and ConfigMap objects from the API server, and the node runs
//! one pod of each DaemonSet whose node affinity admits it (the label
//! `vpcnet.dev/cni` moves a node between vpcnet's and the rollback's), as
//! its pod template says now. A pod whose DaemonSet no longer admits the
//! node, or whose template changed (a rolling update: a new image), is
//! deleted first, as kubelet deletes one (the grace period), and only
//! then its successor made (`maxUnavailable`: the node's one pod).

use std::{
    collections::BTreeMap,
    path::PathBuf,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::ConfigMap};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tracing::{info, warn};
use vpcnet_deploy::node_selection;

use super::{
    host_paths,
    pod_spec::{NodeContext, plan},
    runner::{PodRunner, PodStatus, RunError},
};
use crate::{cri::CriClient, kube::KubeAdmin};

/// The sandbox label naming the DaemonSet a pod belongs to.
pub const LABEL_DAEMON_SET: &str = "lab.vpcnet.dev/daemon-set";

/// The namespace whose DaemonSet objects the node runs (where `deploy/` puts
/// vpcnet's).
const NAMESPACE: &str = "kube-system";

/// What the node gives every pod, and which of its paths a pod may have
/// made for it (`DirectoryOrCreate`, `FileOrCreate`): only those the lab
/// put behind the node's paths, never the machine's own.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeTemplate {
    /// The node's context; each pod's name, uid and log directory are
    /// filled in for it.
    pub context: NodeContext,
    /// Where the pods' log directories go (kubelet's `/var/log/pods`).
    pub log_root: PathBuf,
    /// The host paths a pod may ask to be made.
    pub creatable_host_paths: Vec<PathBuf>,
    /// Labels every sandbox gets besides its template's.
    pub sandbox_labels: BTreeMap<String, String>,
}

/// What went wrong reconciling.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("the API server: {0}")]
    Api(#[from] crate::kube::KubeApiError),
    #[error("{what}: {reason}")]
    Invalid { what: String, reason: String },
    #[error("DaemonSet {daemon_set}: {source}")]
    Run {
        daemon_set: String,
        #[source]
        source: RunError,
    },
}

struct NodePod {
    /// The pod template it was made from, serialized.
    template: String,
    name: String,
    runner: PodRunner,
}

/// The node's DaemonSet pods, kept as the API server says.
pub struct NodeDaemonSets {
    node: NodeTemplate,
    admin: KubeAdmin,
    /// containerd's CRI socket.
    runtime: PathBuf,
    init_timeout: Duration,
    pods: BTreeMap<String, NodePod>,
}

impl NodeDaemonSets {
    #[must_use]
    pub fn new(
        node: NodeTemplate,
        admin: KubeAdmin,
        runtime: PathBuf,
        init_timeout: Duration,
    ) -> Self {
        Self {
            node,
            admin,
            runtime,
            init_timeout,
            pods: BTreeMap::new(),
        }
    }

    /// One reconcile: the pods that must go go, then those that must come
    /// come (each run until its init containers are done), then every pod
    /// is relisted.
    pub fn sync(&mut self) -> Result<(), SyncError> {
        let wanted = self.wanted()?;
        let outdated: Vec<String> = self
            .pods
            .iter()
            .filter(|(name, pod)| {
                wanted
                    .get(*name)
                    .is_none_or(|(template, _)| *template != pod.template)
            })
            .map(|(name, _)| name.clone())
            .collect();
        for daemon_set in outdated {
            let pod = self.pods.remove(&daemon_set).expect("listed");
            info!(%daemon_set, pod = %pod.name, "deleting the pod: its DaemonSet no longer runs it here as it is");
            self.delete_pod_object(&pod.name);
            pod.runner.stop().map_err(|err| SyncError::Run {
                daemon_set: daemon_set.clone(),
                source: err.into(),
            })?;
        }
        for (daemon_set, (template, object)) in wanted {
            if self.pods.contains_key(&daemon_set) {
                continue;
            }
            let pod = self.start(&daemon_set, template, &object)?;
            self.pods.insert(daemon_set, pod);
        }
        for (daemon_set, pod) in &mut self.pods {
            pod.runner.relist().map_err(|err| SyncError::Run {
                daemon_set: daemon_set.clone(),
                source: err.into(),
            })?;
        }
        Ok(())
    }

    /// Whether every pod the node runs is ready.
    #[must_use]
    pub fn ready(&self) -> bool {
        self.pods.values().all(|pod| pod.runner.ready())
    }

    /// The pods, by DaemonSet.
    #[must_use]
    pub fn status(&self) -> Vec<PodStatus> {
        self.pods
            .iter()
            .map(|(daemon_set, pod)| PodStatus {
                daemon_set: daemon_set.clone(),
                ..pod.runner.status()
            })
            .collect()
    }

    /// The DaemonSet objects that admit the node, each with its template
    /// (serialized) and itself.
    fn wanted(&self) -> Result<BTreeMap<String, (String, DaemonSet)>, SyncError> {
        let node = self
            .admin
            .get(&format!("/api/v1/nodes/{}", self.node.context.node_name))?;
        let labels: BTreeMap<String, String> =
            serde_json::from_value(node["metadata"]["labels"].clone()).unwrap_or_default();
        let daemon_sets: Vec<DaemonSet> = self.items("/apis/apps/v1", "daemonsets")?;
        let mut wanted = BTreeMap::new();
        for daemon_set in daemon_sets {
            let Some(spec) = daemon_set
                .spec
                .as_ref()
                .and_then(|spec| spec.template.spec.as_ref())
            else {
                continue;
            };
            if !node_selection::admits(spec, &labels) {
                continue;
            }
            let name = daemon_set.metadata.name.clone().unwrap_or_default();
            let template =
                serde_json::to_string(&daemon_set.spec.as_ref().expect("has a spec").template)
                    .expect("templates serialize");
            wanted.insert(name, (template, daemon_set));
        }
        Ok(wanted)
    }

    fn items<T: serde::de::DeserializeOwned>(
        &self,
        group: &str,
        resource: &str,
    ) -> Result<Vec<T>, SyncError> {
        let list = self
            .admin
            .get(&format!("{group}/namespaces/{NAMESPACE}/{resource}"))?;
        serde_json::from_value(list["items"].clone()).map_err(|err| SyncError::Invalid {
            what: format!("the {resource} of {NAMESPACE}"),
            reason: err.to_string(),
        })
    }

    /// Makes the pod of `daemon_set` (its object in the API, as the
    /// controller makes it, then kubelet's sandbox and containers).
    fn start(
        &self,
        daemon_set: &str,
        template: String,
        object: &DaemonSet,
    ) -> Result<NodePod, SyncError> {
        let config_maps: Vec<ConfigMap> = self.items("/api/v1", "configmaps")?;
        // A name and uid of its own, as the controller gives each pod.
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let suffix = format!("{:05x}", nanos & 0xf_ffff);
        let name = format!("{daemon_set}-{suffix}");
        let mut context = self.node.context.clone();
        context.pod_name.clone_from(&name);
        context.pod_uid = format!("00000000-0000-4000-8000-{:012x}", nanos & 0xffff_ffff_ffff);
        context.log_directory = self
            .node
            .log_root
            .join(format!("{NAMESPACE}_{name}_{uid}", uid = context.pod_uid));
        let invalid = |reason: String| SyncError::Invalid {
            what: format!("DaemonSet {daemon_set}"),
            reason,
        };
        let mut pod_plan =
            plan(object, &config_maps, &context).map_err(|err| invalid(err.to_string()))?;
        for (path, kind) in &pod_plan.host_paths {
            if kind.ends_with("OrCreate") && !self.node.creatable_host_paths.contains(path) {
                return Err(invalid(format!(
                    "host path {} ({kind}) is not one of the lab node's own paths",
                    path.display()
                )));
            }
            if kind == host_paths::FILE_OR_CREATE {
                host_paths::ensure_file(path).map_err(invalid)?;
            }
        }
        pod_plan
            .sandbox
            .labels
            .insert(LABEL_DAEMON_SET.to_owned(), daemon_set.to_owned());
        pod_plan
            .sandbox
            .labels
            .extend(self.node.sandbox_labels.clone());
        std::fs::create_dir_all(&context.log_directory).map_err(|err| {
            invalid(format!(
                "creating {}: {err}",
                context.log_directory.display()
            ))
        })?;
        self.create_pod_object(&name, object);
        info!(%daemon_set, pod = %name, "running the DaemonSet's pod");
        let run_error = |source| SyncError::Run {
            daemon_set: daemon_set.to_owned(),
            source,
        };
        let client = CriClient::connect(&self.runtime).map_err(|err| run_error(err.into()))?;
        let runner = PodRunner::start(client, pod_plan, self.init_timeout).map_err(run_error)?;
        Ok(NodePod {
            template,
            name,
            runner,
        })
    }

    /// The pod's object, bound to the node (what the agent's events name).
    fn create_pod_object(&self, name: &str, daemon_set: &DaemonSet) {
        let template = daemon_set.spec.as_ref().map(|spec| &spec.template);
        let labels = template
            .and_then(|t| t.metadata.as_ref())
            .and_then(|m| m.labels.clone())
            .unwrap_or_default();
        let containers: Vec<Value> = template
            .and_then(|t| t.spec.as_ref())
            .map(|spec| {
                spec.containers
                    .iter()
                    .map(|c| json!({"name": c.name, "image": c.image}))
                    .collect()
            })
            .unwrap_or_default();
        let object = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
            "spec": {"nodeName": self.node.context.node_name, "hostNetwork": true,
                "containers": containers},
        });
        if let Err(err) = self.admin.apply(
            &format!("/api/v1/namespaces/{NAMESPACE}/pods/{name}"),
            &object,
        ) {
            warn!(pod = %name, %err, "recording the pod in the API server");
        }
    }

    fn delete_pod_object(&self, name: &str) {
        if let Err(err) = self
            .admin
            .delete(&format!("/api/v1/namespaces/{NAMESPACE}/pods/{name}"))
        {
            warn!(pod = %name, %err, "deleting the pod from the API server");
        }
    }
}
