//! The container calls kubelet makes in a pod's sandbox: create, start,
//! status, exec (its exec probes), stop, remove; with the fields kubelet
//! fills for a container of a pod spec.

use std::{collections::HashMap, path::PathBuf, time::Duration};

use super::{
    CriError, Result,
    client::{CriClient, LABEL_POD_NAME, LABEL_POD_NAMESPACE, LABEL_POD_UID, PodSpec},
    proto,
};

/// kubelet's label naming a container's name in its pod.
pub const LABEL_CONTAINER_NAME: &str = "io.kubernetes.container.name";

/// How a host path's mounts propagate (`mountPropagation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Propagation {
    #[default]
    None,
    HostToContainer,
    Bidirectional,
}

/// A host path mounted into a container.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Mount {
    pub container_path: PathBuf,
    pub host_path: PathBuf,
    pub readonly: bool,
    pub propagation: Propagation,
}

/// A container as kubelet describes it to the runtime.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ContainerSpec {
    pub name: String,
    /// The image reference, as the runtime knows it.
    pub image: String,
    /// The entrypoint (`command`) and its arguments (`args`).
    pub command: Vec<String>,
    pub args: Vec<String>,
    /// Environment, in order (a later one wins, as in a pod spec).
    pub env: Vec<(String, String)>,
    pub mounts: Vec<Mount>,
    pub privileged: bool,
    /// Capabilities added to and dropped from the runtime's default set.
    pub add_capabilities: Vec<String>,
    pub drop_capabilities: Vec<String>,
    pub run_as_user: Option<i64>,
    /// kubelet's restart count for this container in this sandbox.
    pub attempt: u32,
}

/// A container's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContainerState {
    Created,
    Running,
    Exited,
    Unknown,
}

impl ContainerState {
    fn from_proto(state: i32) -> Self {
        match proto::ContainerState::try_from(state) {
            Ok(proto::ContainerState::ContainerCreated) => Self::Created,
            Ok(proto::ContainerState::ContainerRunning) => Self::Running,
            Ok(proto::ContainerState::ContainerExited) => Self::Exited,
            _ => Self::Unknown,
        }
    }
}

/// `ContainerStatus`.
#[derive(Debug, Clone, PartialEq)]
pub struct ContainerStatus {
    pub id: String,
    pub name: String,
    pub attempt: u32,
    pub state: ContainerState,
    pub exit_code: i32,
    /// Why it exited (`Completed`, `Error`, `OOMKilled`).
    pub reason: String,
    pub message: String,
    /// Where the runtime writes its output (CRI log format).
    pub log_path: PathBuf,
    /// containerd's verbose info: the pid, the runtime spec (the
    /// capabilities and mounts it really ran with).
    pub info: serde_json::Value,
}

/// What an exec wrote and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecResult {
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl CriClient {
    /// `CreateContainer` in sandbox `sandbox_id` of `pod`; returns its id.
    pub fn create_container(
        &self,
        sandbox_id: &str,
        pod: &PodSpec,
        container: &ContainerSpec,
    ) -> Result<String> {
        let request = proto::CreateContainerRequest {
            pod_sandbox_id: sandbox_id.to_owned(),
            config: Some(container_config(pod, container)),
            sandbox_config: Some(super::client::sandbox_config(pod)),
        };
        let reply = self.call(
            "CreateContainer",
            |mut service, request| async move { service.create_container(request).await },
            request,
        )?;
        if reply.container_id.is_empty() {
            return Err(CriError::BadResponse {
                call: "CreateContainer",
                reason: "no container id".into(),
            });
        }
        Ok(reply.container_id)
    }

    /// `StartContainer`.
    pub fn start_container(&self, id: &str) -> Result<()> {
        self.call(
            "StartContainer",
            |mut service, request| async move { service.start_container(request).await },
            proto::StartContainerRequest {
                container_id: id.to_owned(),
            },
        )?;
        Ok(())
    }

    /// `StopContainer`: SIGTERM (or the image's stop signal), SIGKILL after
    /// `grace`.
    pub fn stop_container(&self, id: &str, grace: Duration) -> Result<()> {
        self.call(
            "StopContainer",
            |mut service, request| async move { service.stop_container(request).await },
            proto::StopContainerRequest {
                container_id: id.to_owned(),
                timeout: i64::try_from(grace.as_secs()).unwrap_or(i64::MAX),
            },
        )?;
        Ok(())
    }

    /// `RemoveContainer`.
    pub fn remove_container(&self, id: &str) -> Result<()> {
        self.call(
            "RemoveContainer",
            |mut service, request| async move { service.remove_container(request).await },
            proto::RemoveContainerRequest {
                container_id: id.to_owned(),
            },
        )?;
        Ok(())
    }

    /// The ids of the containers in sandbox `sandbox_id`.
    pub fn list_containers(&self, sandbox_id: &str) -> Result<Vec<String>> {
        let reply = self.call(
            "ListContainers",
            |mut service, request| async move { service.list_containers(request).await },
            proto::ListContainersRequest {
                filter: Some(proto::ContainerFilter {
                    pod_sandbox_id: sandbox_id.to_owned(),
                    ..proto::ContainerFilter::default()
                }),
            },
        )?;
        Ok(reply.containers.into_iter().map(|c| c.id).collect())
    }

    /// `ContainerStatus`, verbose.
    pub fn container_status(&self, id: &str) -> Result<ContainerStatus> {
        const CALL: &str = "ContainerStatus";
        let reply = self.call(
            CALL,
            |mut service, request| async move { service.container_status(request).await },
            proto::ContainerStatusRequest {
                container_id: id.to_owned(),
                verbose: true,
            },
        )?;
        let status = reply.status.ok_or_else(|| CriError::BadResponse {
            call: CALL,
            reason: "no status".into(),
        })?;
        let info = super::client::verbose_info(CALL, &reply.info)?;
        let metadata = status.metadata.unwrap_or_default();
        Ok(ContainerStatus {
            id: status.id,
            name: metadata.name,
            attempt: metadata.attempt,
            state: ContainerState::from_proto(status.state),
            exit_code: status.exit_code,
            reason: status.reason,
            message: status.message,
            log_path: status.log_path.into(),
            info,
        })
    }

    /// `ExecSync`: runs `command` in the container, as an exec probe does,
    /// killed after `timeout`.
    pub fn exec_sync(&self, id: &str, command: &[String], timeout: Duration) -> Result<ExecResult> {
        let reply = self.call(
            "ExecSync",
            |mut service, request| async move { service.exec_sync(request).await },
            proto::ExecSyncRequest {
                container_id: id.to_owned(),
                cmd: command.to_vec(),
                timeout: i64::try_from(timeout.as_secs().max(1)).unwrap_or(i64::MAX),
            },
        )?;
        Ok(ExecResult {
            exit_code: reply.exit_code,
            stdout: String::from_utf8_lossy(&reply.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&reply.stderr).into_owned(),
        })
    }
}

/// What kubelet masks and makes read-only in an unprivileged container's
/// /proc and /sys (its `securitycontext` defaults).
const DEFAULT_MASKED_PATHS: &[&str] = &[
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];
const DEFAULT_READONLY_PATHS: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

fn owned(paths: &[&str]) -> Vec<String> {
    paths.iter().map(|path| (*path).to_owned()).collect()
}

/// The container configuration kubelet sends (its
/// `generateContainerConfig`), minus what the lab has no use for.
fn container_config(pod: &PodSpec, container: &ContainerSpec) -> proto::ContainerConfig {
    let labels: HashMap<String, String> = [
        (LABEL_POD_NAME, pod.name.as_str()),
        (LABEL_POD_NAMESPACE, pod.namespace.as_str()),
        (LABEL_POD_UID, pod.uid.as_str()),
        (LABEL_CONTAINER_NAME, container.name.as_str()),
    ]
    .into_iter()
    .map(|(key, value)| (key.to_owned(), value.to_owned()))
    .collect();
    proto::ContainerConfig {
        metadata: Some(proto::ContainerMetadata {
            name: container.name.clone(),
            attempt: container.attempt,
        }),
        image: Some(proto::ImageSpec {
            image: container.image.clone(),
            annotations: HashMap::new(),
        }),
        command: container.command.clone(),
        args: container.args.clone(),
        working_dir: String::new(),
        envs: container
            .env
            .iter()
            .map(|(key, value)| proto::KeyValue {
                key: key.clone(),
                value: value.clone(),
            })
            .collect(),
        mounts: container
            .mounts
            .iter()
            .map(|mount| proto::Mount {
                container_path: mount.container_path.display().to_string(),
                host_path: mount.host_path.display().to_string(),
                readonly: mount.readonly,
                selinux_relabel: false,
                propagation: match mount.propagation {
                    Propagation::None => proto::MountPropagation::PropagationPrivate,
                    Propagation::HostToContainer => {
                        proto::MountPropagation::PropagationHostToContainer
                    }
                    Propagation::Bidirectional => proto::MountPropagation::PropagationBidirectional,
                } as i32,
            })
            .collect(),
        labels,
        annotations: HashMap::new(),
        // kubelet's `<name>/<attempt>.log` below the sandbox's directory.
        log_path: format!("{}/{}.log", container.name, container.attempt),
        linux: Some(proto::LinuxContainerConfig {
            security_context: Some(proto::LinuxContainerSecurityContext {
                capabilities: Some(proto::Capability {
                    add_capabilities: container.add_capabilities.clone(),
                    drop_capabilities: container.drop_capabilities.clone(),
                }),
                privileged: container.privileged,
                namespace_options: Some(super::client::namespace_options(pod)),
                run_as_user: container
                    .run_as_user
                    .map(|value| proto::Int64Value { value }),
                readonly_rootfs: false,
                no_new_privs: false,
                // kubelet's default /proc masking (`procMount: Default`),
                // none for a privileged container.
                masked_paths: if container.privileged {
                    Vec::new()
                } else {
                    owned(DEFAULT_MASKED_PATHS)
                },
                readonly_paths: if container.privileged {
                    Vec::new()
                } else {
                    owned(DEFAULT_READONLY_PATHS)
                },
            }),
        }),
    }
}
