//! A DaemonSet's pod template made into what kubelet hands the runtime:
//! the sandbox, the init containers and the containers (image, command,
//! environment from the ConfigMap and the downward API, `hostPath` mounts
//! with their propagation, the service account token, the security
//! context) and their exec probes.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{ConfigMap, Container, EnvVar, PodSpec as K8sPodSpec, Probe as K8sProbe, Volume},
};

use crate::{
    cluster::SERVICE_ACCOUNT_MOUNT,
    cri::{ContainerSpec, Mount, PodSpec, Propagation},
};

/// What the node and the cluster give the pod.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct NodeContext {
    pub node_name: String,
    /// The node's address (`status.hostIP`, and the pod's for host
    /// network).
    pub host_ip: String,
    pub pod_name: String,
    pub pod_uid: String,
    /// The service account's token, `ca.crt` and `namespace`, mounted
    /// where every pod has them.
    pub service_account_dir: PathBuf,
    /// kubelet's service variables (`KUBERNETES_SERVICE_HOST`, ...).
    pub cluster_env: Vec<(String, String)>,
    /// Variables the lab adds to every container after the pod's own (its
    /// stand-ins for what EKS gives a node: the EC2 and IMDS endpoints).
    pub node_env: Vec<(String, String)>,
    /// Where the runtime writes the containers' output.
    pub log_directory: PathBuf,
}

/// An exec probe, with kubelet's defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ExecProbe {
    pub command: Vec<String>,
    pub initial_delay: Duration,
    pub period: Duration,
    pub timeout: Duration,
    pub failure_threshold: u32,
    pub success_threshold: u32,
}

/// A container and its probes.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ContainerPlan {
    pub spec: ContainerSpec,
    pub readiness: Option<ExecProbe>,
    pub liveness: Option<ExecProbe>,
}

/// The pod as kubelet runs it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct PodPlan {
    pub sandbox: PodSpec,
    /// Run in order, each to a successful exit, before the containers.
    pub init: Vec<ContainerPlan>,
    pub containers: Vec<ContainerPlan>,
    /// `terminationGracePeriodSeconds`.
    pub grace: Duration,
    /// The `hostPath`s the pod mounts, as the node names them, with their
    /// type (`DirectoryOrCreate`, `Directory`, `FileOrCreate`, ...).
    pub host_paths: Vec<(PathBuf, String)>,
}

/// Why a pod template cannot run here.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PlanError(String);

fn unsupported(what: impl Into<String>) -> PlanError {
    PlanError(what.into())
}

/// `daemon_set`'s pod on the node `node` describes, its `envFrom` read
/// from `config_maps`.
pub fn plan(
    daemon_set: &DaemonSet,
    config_maps: &[ConfigMap],
    node: &NodeContext,
) -> Result<PodPlan, PlanError> {
    let template = daemon_set
        .spec
        .as_ref()
        .map(|spec| &spec.template)
        .ok_or_else(|| unsupported("the DaemonSet has no spec"))?;
    let spec = template
        .spec
        .as_ref()
        .ok_or_else(|| unsupported("the pod template has no spec"))?;
    let namespace = daemon_set
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".to_owned());
    let metadata = template.metadata.clone().unwrap_or_default();
    let privileged = spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
        .any(|container| security(container).0);
    let sandbox = PodSpec {
        name: node.pod_name.clone(),
        namespace: namespace.clone(),
        uid: node.pod_uid.clone(),
        annotations: metadata.annotations.unwrap_or_default(),
        labels: metadata.labels.unwrap_or_default(),
        host_network: spec.host_network == Some(true),
        privileged,
        log_directory: Some(node.log_directory.clone()),
        ..PodSpec::default()
    };
    let pod = PodFacts {
        namespace: &namespace,
        spec,
        config_maps,
        node,
    };
    let init = spec
        .init_containers
        .iter()
        .flatten()
        .map(|container| pod.container(container))
        .collect::<Result<_, _>>()?;
    let containers = spec
        .containers
        .iter()
        .map(|container| pod.container(container))
        .collect::<Result<_, _>>()?;
    let host_paths = spec
        .volumes
        .iter()
        .flatten()
        .filter_map(|volume| {
            let host_path = volume.host_path.as_ref()?;
            Some((
                PathBuf::from(&host_path.path),
                host_path.type_.clone().unwrap_or_default(),
            ))
        })
        .collect();
    Ok(PodPlan {
        sandbox,
        init,
        containers,
        grace: Duration::from_secs(
            spec.termination_grace_period_seconds
                .and_then(|seconds| u64::try_from(seconds).ok())
                .unwrap_or(30),
        ),
        host_paths,
    })
}

/// What every container of the pod draws on.
struct PodFacts<'a> {
    namespace: &'a str,
    spec: &'a K8sPodSpec,
    config_maps: &'a [ConfigMap],
    node: &'a NodeContext,
}

impl PodFacts<'_> {
    fn container(&self, container: &Container) -> Result<ContainerPlan, PlanError> {
        let (privileged, add, drop, run_as_user) = security(container);
        let spec = ContainerSpec {
            name: container.name.clone(),
            image: container
                .image
                .clone()
                .ok_or_else(|| unsupported(format!("container {}: no image", container.name)))?,
            command: container.command.clone().unwrap_or_default(),
            args: container.args.clone().unwrap_or_default(),
            env: self.env(container)?,
            mounts: self.mounts(container)?,
            privileged,
            add_capabilities: add,
            drop_capabilities: drop,
            run_as_user,
            attempt: 0,
        };
        Ok(ContainerPlan {
            spec,
            readiness: container
                .readiness_probe
                .as_ref()
                .map(exec_probe)
                .transpose()?,
            liveness: container
                .liveness_probe
                .as_ref()
                .map(exec_probe)
                .transpose()?,
        })
    }

    /// kubelet's order: its service variables, then `envFrom`, then `env`
    /// (a later one of the same name wins).
    fn env(&self, container: &Container) -> Result<Vec<(String, String)>, PlanError> {
        let mut env = self.node.cluster_env.clone();
        for source in container.env_from.iter().flatten() {
            let Some(reference) = &source.config_map_ref else {
                return Err(unsupported(format!(
                    "container {}: envFrom other than a ConfigMap",
                    container.name
                )));
            };
            let data = self.config_map(&reference.name)?;
            let prefix = source.prefix.clone().unwrap_or_default();
            env.extend(
                data.iter()
                    .map(|(key, value)| (format!("{prefix}{key}"), value.clone())),
            );
        }
        for var in container.env.iter().flatten() {
            env.push((var.name.clone(), self.env_value(container, var)?));
        }
        env.extend(self.node.node_env.iter().cloned());
        Ok(env)
    }

    fn env_value(&self, container: &Container, var: &EnvVar) -> Result<String, PlanError> {
        let Some(from) = &var.value_from else {
            return Ok(var.value.clone().unwrap_or_default());
        };
        if let Some(field) = &from.field_ref {
            let node = self.node;
            return Ok(match field.field_path.as_str() {
                "metadata.name" => node.pod_name.clone(),
                "metadata.namespace" => self.namespace.to_owned(),
                "metadata.uid" => node.pod_uid.clone(),
                "spec.nodeName" => node.node_name.clone(),
                "spec.serviceAccountName" => {
                    self.spec.service_account_name.clone().unwrap_or_default()
                }
                // Host network: the pod's address is the node's.
                "status.hostIP" | "status.podIP" => node.host_ip.clone(),
                other => {
                    return Err(unsupported(format!(
                        "container {}: env {} from field {other}",
                        container.name, var.name
                    )));
                }
            });
        }
        if let Some(key) = &from.config_map_key_ref {
            return self
                .config_map(&key.name)?
                .get(&key.key)
                .cloned()
                .ok_or_else(|| {
                    unsupported(format!(
                        "container {}: env {}: no key {} in ConfigMap {}",
                        container.name, var.name, key.key, key.name
                    ))
                });
        }
        Err(unsupported(format!(
            "container {}: env {} from a source the lab has no value for",
            container.name, var.name
        )))
    }

    fn config_map(&self, name: &str) -> Result<BTreeMap<String, String>, PlanError> {
        self.config_maps
            .iter()
            .find(|map| map.metadata.name.as_deref() == Some(name))
            .map(|map| map.data.clone().unwrap_or_default())
            .ok_or_else(|| unsupported(format!("no ConfigMap {name}")))
    }

    fn mounts(&self, container: &Container) -> Result<Vec<Mount>, PlanError> {
        let mut mounts = Vec::new();
        for mount in container.volume_mounts.iter().flatten() {
            let volume = self.volume(&mount.name).ok_or_else(|| {
                unsupported(format!(
                    "container {}: no volume {}",
                    container.name, mount.name
                ))
            })?;
            let Some(host_path) = &volume.host_path else {
                return Err(unsupported(format!(
                    "container {}: volume {} is not a hostPath",
                    container.name, mount.name
                )));
            };
            mounts.push(Mount {
                container_path: PathBuf::from(&mount.mount_path),
                host_path: PathBuf::from(&host_path.path),
                readonly: mount.read_only == Some(true),
                propagation: match mount.mount_propagation.as_deref() {
                    None | Some("None") => Propagation::None,
                    Some("HostToContainer") => Propagation::HostToContainer,
                    Some("Bidirectional") => Propagation::Bidirectional,
                    Some(other) => {
                        return Err(unsupported(format!(
                            "container {}: mountPropagation {other}",
                            container.name
                        )));
                    }
                },
            });
        }
        if self.spec.automount_service_account_token != Some(false) {
            mounts.push(Mount {
                container_path: PathBuf::from(SERVICE_ACCOUNT_MOUNT),
                host_path: self.node.service_account_dir.clone(),
                readonly: true,
                propagation: Propagation::None,
            });
        }
        Ok(mounts)
    }

    fn volume(&self, name: &str) -> Option<&Volume> {
        self.spec
            .volumes
            .iter()
            .flatten()
            .find(|volume| volume.name == name)
    }
}

/// The container's privileged flag, added and dropped capabilities and
/// user, from its security context.
fn security(container: &Container) -> (bool, Vec<String>, Vec<String>, Option<i64>) {
    let context = container.security_context.clone().unwrap_or_default();
    let capabilities = context.capabilities.unwrap_or_default();
    (
        context.privileged == Some(true),
        capabilities.add.unwrap_or_default(),
        capabilities.drop.unwrap_or_default(),
        context.run_as_user,
    )
}

/// An exec probe with kubelet's defaults (period 10 s, timeout 1 s, three
/// failures, one success).
fn exec_probe(probe: &K8sProbe) -> Result<ExecProbe, PlanError> {
    let command = probe
        .exec
        .as_ref()
        .and_then(|exec| exec.command.clone())
        .ok_or_else(|| unsupported("a probe other than exec"))?;
    let seconds = |value: Option<i32>, default: u64| {
        Duration::from_secs(
            value
                .and_then(|value| u64::try_from(value).ok())
                .unwrap_or(default),
        )
    };
    let count = |value: Option<i32>, default: u32| {
        value
            .and_then(|value| u32::try_from(value).ok())
            .unwrap_or(default)
    };
    Ok(ExecProbe {
        command,
        initial_delay: seconds(probe.initial_delay_seconds, 0),
        period: seconds(probe.period_seconds, 10),
        timeout: seconds(probe.timeout_seconds, 1),
        failure_threshold: count(probe.failure_threshold, 3),
        success_threshold: count(probe.success_threshold, 1),
    })
}
