//! The lab's VPC resource controller (EKS runs it in its control plane):
//! for a node whose CNINode has the `SecurityGroupsForPods` feature it
//! attaches a trunk ENI, and for each pod of that node that asks for
//! `vpc.amazonaws.com/pod-eni` it makes a branch ENI on the trunk and
//! writes the pod's `vpc.amazonaws.com/pod-eni` annotation, as the
//! controller does (aws/amazon-vpc-resource-controller-k8s,
//! `pkg/provider/branch`). A pod that is gone or finished gives its branch
//! ENI back after a cooldown (the controller's `branch-eni-cooldown`,
//! 60 s by default; the lab's is shorter).
//!
//! It reads and writes the lab's API server through its admin socket, by
//! polling: the lab's API server has few objects, and a controller that
//! misses nothing between two looks needs no watch bookmarks.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tracing::{info, warn};
use vpcnet_api::pod::{BranchEni, POD_ENI_ANNOTATION, POD_ENI_RESOURCE, SECURITY_GROUPS_FOR_PODS};

use super::model::Ec2Result;
use crate::kube::KubeAdmin;

/// How often the controller looks at the cluster.
const POLL: Duration = Duration::from_millis(200);

/// Where the controller finds the cluster and how it behaves.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ControllerOptions {
    /// The lab API server's admin socket.
    pub kube_admin_socket: PathBuf,
    /// The node it serves (the lab's one node).
    pub node_name: String,
    /// How long a branch ENI outlives its pod.
    pub cooldown_ms: u64,
}

/// What the controller asks of EC2.
pub trait TrunkProvider: Send + Sync {
    /// The node's trunk ENI, attached now if it has none.
    fn node_trunk(&self) -> Ec2Result<String>;
    /// A branch ENI on `trunk`, at `private_ip` if given.
    fn create_branch(&self, trunk: &str, private_ip: Option<Ipv4Addr>) -> Ec2Result<BranchEni>;
    /// A branch ENI disassociated and deleted.
    fn delete_branch(&self, branch: &BranchEni) -> Ec2Result<()>;
}

/// Runs the controller on its own thread for the life of the process.
pub fn spawn(opts: ControllerOptions, ec2: Arc<dyn TrunkProvider>) {
    std::thread::Builder::new()
        .name("resource-controller".into())
        .spawn(move || {
            let mut controller = Controller::new(opts, ec2);
            loop {
                controller.round();
                std::thread::sleep(POLL);
            }
        })
        .expect("spawning the resource controller's thread");
}

/// A pod of the node, as far as branch ENIs go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    /// `namespace/name`.
    pub key: String,
    /// Its `metadata.uid`: a pod deleted and made again under its name is
    /// another pod.
    pub uid: String,
    pub asks: bool,
    pub annotated: bool,
    pub finished: bool,
}

impl PodView {
    fn of(pod: &Value) -> Option<Self> {
        let meta = &pod["metadata"];
        let key = format!("{}/{}", meta["namespace"].as_str()?, meta["name"].as_str()?);
        let asks = pod["spec"]["containers"][0]["resources"]["limits"]
            .as_object()
            .is_some_and(|limits| limits.keys().any(|k| k.starts_with(POD_ENI_RESOURCE)));
        Some(Self {
            key,
            uid: meta["uid"].as_str().unwrap_or_default().to_owned(),
            asks: asks && !pod["spec"]["hostNetwork"].as_bool().unwrap_or(false),
            annotated: meta["annotations"][POD_ENI_ANNOTATION].is_string(),
            finished: matches!(
                pod["status"]["phase"].as_str(),
                Some("Succeeded" | "Failed")
            ),
        })
    }
}

struct Controller {
    opts: ControllerOptions,
    kube: KubeAdmin,
    ec2: Arc<dyn TrunkProvider>,
    trunk: Option<String>,
    /// Branch ENIs handed to pods, by pod uid.
    owned: BTreeMap<String, BranchEni>,
    /// Branch ENIs of pods that are gone, each with when it goes.
    cooling: Vec<(Instant, BranchEni)>,
    /// The last error said, so a persisting one is said once.
    last_error: Option<String>,
}

impl Controller {
    fn new(opts: ControllerOptions, ec2: Arc<dyn TrunkProvider>) -> Self {
        Self {
            kube: KubeAdmin::new(&opts.kube_admin_socket),
            opts,
            ec2,
            trunk: None,
            owned: BTreeMap::new(),
            cooling: Vec::new(),
            last_error: None,
        }
    }

    fn say(&mut self, what: &str, err: &dyn std::fmt::Display) {
        let said = format!("{what}: {err}");
        if self.last_error.as_deref() != Some(said.as_str()) {
            warn!("{said}");
            self.last_error = Some(said);
        }
    }

    fn round(&mut self) {
        self.expire_cooldowns();
        let cninode = format!(
            "/apis/vpcresources.k8s.aws/v1alpha1/cninodes/{}",
            self.opts.node_name
        );
        let wants_trunk = match self.kube.get(&cninode) {
            Ok(object) => object["spec"]["features"]
                .as_array()
                .is_some_and(|features| {
                    features
                        .iter()
                        .any(|f| f["name"] == SECURITY_GROUPS_FOR_PODS)
                }),
            Err(err) if err.code() == Some(404) => false,
            Err(err) => return self.say("reading the CNINode", &err),
        };
        let pods = match self.kube.get("/api/v1/pods") {
            Ok(list) => list["items"]
                .as_array()
                .map(|items| {
                    items
                        .iter()
                        .filter(|pod| pod["spec"]["nodeName"] == self.opts.node_name.as_str())
                        .filter_map(PodView::of)
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default(),
            Err(err) => return self.say("listing pods", &err),
        };
        self.release_gone(&pods);
        if !wants_trunk {
            return;
        }
        let trunk = match &self.trunk {
            Some(trunk) => trunk.clone(),
            None => match self.ec2.node_trunk() {
                Ok(trunk) => {
                    info!(%trunk, node = %self.opts.node_name, "trunk ENI attached");
                    self.trunk = Some(trunk.clone());
                    trunk
                }
                Err(err) => return self.say("attaching a trunk ENI", &err),
            },
        };
        for pod in pods {
            if pod.asks && !pod.annotated && !pod.finished && !self.owned.contains_key(&pod.uid) {
                self.give_branch(&trunk, &pod);
            }
        }
    }

    /// A branch ENI for `pod`, written into its annotation.
    fn give_branch(&mut self, trunk: &str, view: &PodView) {
        let pod = view.key.as_str();
        let branch = match self.ec2.create_branch(trunk, None) {
            Ok(branch) => branch,
            Err(err) => return self.say(&format!("a branch ENI for {pod}"), &err),
        };
        let annotation = serde_json::to_string(&[&branch]).expect("serializable");
        let (namespace, name) = pod.split_once('/').expect("namespace/name");
        let pod_path = format!("/api/v1/namespaces/{namespace}/pods/{name}");
        let changes = json!({"metadata": {"annotations": {POD_ENI_ANNOTATION: annotation}}});
        match self.kube.merge_patch(&pod_path, &changes) {
            Ok(_) => {
                info!(%pod, eni = %branch.eni_id, vlan_id = branch.vlan_id, addr = %branch.private_ip, "branch ENI allocated");
                self.owned.insert(view.uid.clone(), branch);
            }
            Err(err) => {
                self.say(&format!("annotating {pod}"), &err);
                self.cool(branch);
            }
        }
    }

    /// Branch ENIs of pods that are gone or finished go to the cooldown.
    fn release_gone(&mut self, pods: &[PodView]) {
        let live: BTreeSet<&str> = pods
            .iter()
            .filter(|pod| !pod.finished)
            .map(|pod| pod.uid.as_str())
            .collect();
        let gone: Vec<String> = self
            .owned
            .keys()
            .filter(|key| !live.contains(key.as_str()))
            .cloned()
            .collect();
        for uid in gone {
            let branch = self.owned.remove(&uid).expect("listed");
            info!(pod_uid = %uid, eni = %branch.eni_id, "pod gone: its branch ENI cools down");
            self.cool(branch);
        }
    }

    fn cool(&mut self, branch: BranchEni) {
        let due = Instant::now() + Duration::from_millis(self.opts.cooldown_ms);
        self.cooling.push((due, branch));
    }

    fn expire_cooldowns(&mut self) {
        let now = Instant::now();
        let (due, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.cooling)
            .into_iter()
            .partition(|(at, _)| *at <= now);
        self.cooling = waiting;
        for (_, branch) in due {
            match self.ec2.delete_branch(&branch) {
                Ok(()) => {
                    info!(eni = %branch.eni_id, vlan_id = branch.vlan_id, "branch ENI deleted");
                }
                Err(err) => {
                    self.say(&format!("deleting branch ENI {}", branch.eni_id), &err);
                    self.cool(branch);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_asks_by_its_first_containers_limits() {
        let pod = |limits: Value, extra: Value| {
            let mut pod = json!({"metadata": {"namespace": "default", "name": "p"},
                "spec": {"containers": [{"resources": {"limits": limits}}]}});
            crate::kube::patch::merge_patch(&mut pod, &extra);
            PodView::of(&pod).unwrap()
        };
        let asking = pod(json!({"vpc.amazonaws.com/pod-eni": "1"}), json!({}));
        assert!(asking.asks && !asking.annotated && !asking.finished);
        assert_eq!(asking.key, "default/p");
        assert!(!pod(json!({"cpu": "1"}), json!({})).asks);
        let host = pod(
            json!({"vpc.amazonaws.com/pod-eni": "1"}),
            json!({"spec": {"hostNetwork": true}}),
        );
        assert!(!host.asks);
        let done = pod(
            json!({"vpc.amazonaws.com/pod-eni": "1"}),
            json!({"status": {"phase": "Succeeded"},
                "metadata": {"annotations": {"vpc.amazonaws.com/pod-eni": "[]"}}}),
        );
        assert!(done.finished && done.annotated);
    }
}
