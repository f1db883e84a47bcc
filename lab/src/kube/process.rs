//! The API server as the lab runs it: the `vpcnet-lab-kube` binary
//! listening on 10.20.0.20:443 in `vpcnet-vpc`, its credentials, admin
//! socket and log in the lab's state directory, and the cluster's own
//! objects made (the `kubernetes` Service and the ServiceCIDR).
//!
//! Ready means the binary printed `READY` (after binding its listener);
//! dropping the [`KubeApiProcess`] kills it.

use std::{
    fs::{self, File},
    net::{IpAddr, SocketAddr},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use serde_json::{Value, json};
use tracing::{info, warn};

use super::{
    KubeApiError,
    pki::{self, ClusterFiles},
    server::{CallsView, FaultRule, admin_paths},
};
use crate::{
    addrs::{KUBE_API_ADDR, KUBE_API_PORT, KUBERNETES_SERVICE_IP, NS_VPC, SERVICE_CIDR},
    helper_process::{SiblingError, log_tail, sibling_binary, wait_ready},
    state::state_dir,
    unix_http,
};

/// The binary's name.
pub const KUBE_API_BIN: &str = "vpcnet-lab-kube";
/// How long one admin call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The URL clients use: `https://10.20.0.20` (443 is implied).
pub fn kube_api_url() -> String {
    if KUBE_API_PORT == 443 {
        format!("https://{KUBE_API_ADDR}")
    } else {
        format!("https://{KUBE_API_ADDR}:{KUBE_API_PORT}")
    }
}

/// How to run the API server.
#[derive(Debug, Clone)]
pub struct KubeApiOptions {
    /// The binary; `None`: next to the running executable.
    pub binary: Option<PathBuf>,
    /// Where the credentials, the admin socket and the log go.
    pub work_dir: PathBuf,
    /// The namespace it listens in (the lab's VPC router, or a test's own).
    pub netns: String,
    /// How often watches that ask for them get bookmarks.
    pub bookmark_interval: Duration,
    /// How many changes watches can replay (older ones get `410 Gone`).
    pub history: usize,
    /// How long the binary may take to say `READY`.
    pub ready_timeout: Duration,
    /// Custom resources (by plural) the cluster has not installed: a
    /// cluster without, say, EKS's network policy controller.
    pub uninstalled: Vec<String>,
}

impl Default for KubeApiOptions {
    fn default() -> Self {
        Self {
            binary: None,
            work_dir: state_dir().join("kube"),
            netns: NS_VPC.to_owned(),
            bookmark_interval: Duration::from_mins(1),
            history: super::store::DEFAULT_HISTORY,
            ready_timeout: Duration::from_secs(20),
            uninstalled: Vec::new(),
        }
    }
}

impl KubeApiOptions {
    pub fn files(&self) -> ClusterFiles {
        ClusterFiles::new(&self.work_dir)
    }

    pub fn admin_socket(&self) -> PathBuf {
        self.work_dir.join("apiserver-admin.sock")
    }

    pub fn log_path(&self) -> PathBuf {
        self.work_dir.join("apiserver.log")
    }
}

/// The running API server; killed when dropped.
#[derive(Debug)]
pub struct KubeApiProcess {
    child: Child,
    admin: KubeAdmin,
    files: ClusterFiles,
    log: PathBuf,
}

impl KubeApiProcess {
    /// Writes fresh credentials, starts the binary in `opts.netns`, waits
    /// for it, and makes the cluster's own objects.
    pub fn start(opts: &KubeApiOptions) -> Result<Self, KubeApiError> {
        let binary = match &opts.binary {
            Some(path) if path.is_file() => path.clone(),
            Some(path) => return Err(KubeApiError::BinaryMissing(path.clone())),
            None => sibling_binary(KUBE_API_BIN).map_err(|err| match err {
                SiblingError::Missing(path) => KubeApiError::BinaryMissing(path),
                SiblingError::Io(source) => {
                    KubeApiError::io("finding the running executable", source)
                }
            })?,
        };
        fs::create_dir_all(&opts.work_dir).map_err(|source| {
            KubeApiError::io(format!("creating {}", opts.work_dir.display()), source)
        })?;
        let files = opts.files();
        let mut config = pki::write_cluster_files(
            &files,
            &[IpAddr::V4(KUBE_API_ADDR), IpAddr::V4(KUBERNETES_SERVICE_IP)],
            &kube_api_url(),
        )?;
        config.bookmark_interval_ms =
            u64::try_from(opts.bookmark_interval.as_millis()).unwrap_or(u64::MAX);
        config.history = opts.history;
        config.uninstalled.clone_from(&opts.uninstalled);
        fs::write(
            files.server_config(),
            serde_json::to_vec_pretty(&config).expect("serializes"),
        )
        .map_err(|source| KubeApiError::io("writing the server's configuration", source))?;
        let log_path = opts.log_path();
        let log = File::create(&log_path).map_err(|source| {
            KubeApiError::io(format!("creating {}", log_path.display()), source)
        })?;
        let listen = SocketAddr::from((KUBE_API_ADDR, KUBE_API_PORT));
        let mut command = Command::new(&binary);
        command
            .arg("--config")
            .arg(files.server_config())
            .arg("--tls-cert")
            .arg(files.server_cert())
            .arg("--tls-key")
            .arg(files.server_key())
            .args(["--listen", &listen.to_string()])
            .arg("--admin-socket")
            .arg(opts.admin_socket())
            .args(["--netns", &opts.netns])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            // Its own process group: a Ctrl-C meant for whoever started it
            // does not take a lab left running down with it.
            .process_group(0);
        if std::env::var_os("RUST_LOG").is_none() {
            command.env("RUST_LOG", "vpcnet_lab=info");
        }
        info!(binary = %binary.display(), "starting the Kubernetes API server");
        let mut child = command
            .spawn()
            .map_err(|source| KubeApiError::io(format!("starting {}", binary.display()), source))?;
        let stdout = child.stdout.take().expect("piped");
        if let Err(reason) = wait_ready(stdout, opts.ready_timeout) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(KubeApiError::NotReady {
                binary,
                reason,
                log_tail: log_tail(&log_path),
            });
        }
        let process = Self {
            child,
            admin: KubeAdmin::new(opts.admin_socket()),
            files,
            log: log_path,
        };
        process.admin.seed_cluster()?;
        info!(url = %kube_api_url(), "the Kubernetes API server is ready");
        Ok(process)
    }

    pub fn admin(&self) -> &KubeAdmin {
        &self.admin
    }

    pub fn files(&self) -> &ClusterFiles {
        &self.files
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Lets the server outlive this value (a lab left running); it is then
    /// killed through its pid file.
    pub fn leave_running(self) {
        std::mem::forget(self);
    }
}

impl Drop for KubeApiProcess {
    fn drop(&mut self) {
        if let Err(err) = self.child.kill() {
            warn!(%err, "killing the Kubernetes API server");
        }
        let _ = self.child.wait();
    }
}

/// The lab's client of the API server, on its admin socket: it acts as the
/// cluster's administrator (kubelet, the VPC resource controller, the
/// operator), so RBAC does not apply to it.
#[derive(Debug, Clone)]
pub struct KubeAdmin {
    socket: PathBuf,
}

impl KubeAdmin {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
        }
    }

    /// The admin socket it talks to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn call(
        &self,
        method: &str,
        path: &str,
        content_type: &str,
        body: Option<&Value>,
    ) -> Result<Value, KubeApiError> {
        let request = format!("{method} {path}");
        let body = body
            .map(|b| serde_json::to_vec(b).expect("serializes"))
            .unwrap_or_default();
        let (status, reply) = unix_http::exchange(
            &self.socket,
            method,
            path,
            content_type,
            &body,
            CALL_TIMEOUT,
        )
        .map_err(|source| {
            KubeApiError::io(format!("{request} on {}", self.socket.display()), source)
        })?;
        let value: Value =
            serde_json::from_slice(&reply).map_err(|err| KubeApiError::BadResponse {
                request: request.clone(),
                reason: format!("{err}: {}", String::from_utf8_lossy(&reply)),
            })?;
        if (200..300).contains(&status) {
            return Ok(value);
        }
        let field = |name: &str| {
            value
                .get(name)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        Err(KubeApiError::Api {
            request,
            code: status,
            reason: field("reason"),
            message: field("message"),
        })
    }

    /// `GET path` (an object or a list).
    pub fn get(&self, path: &str) -> Result<Value, KubeApiError> {
        self.call("GET", path, "application/json", None)
    }

    /// `POST` to a collection.
    pub fn create(&self, collection: &str, object: &Value) -> Result<Value, KubeApiError> {
        self.call("POST", collection, "application/json", Some(object))
    }

    /// A JSON merge patch.
    pub fn merge_patch(&self, path: &str, changes: &Value) -> Result<Value, KubeApiError> {
        self.call("PATCH", path, "application/merge-patch+json", Some(changes))
    }

    /// Server-side apply as the lab (`fieldManager=vpcnet-lab`): creates
    /// the object or merges into it.
    pub fn apply(&self, path: &str, object: &Value) -> Result<Value, KubeApiError> {
        let path = format!("{path}?fieldManager=vpcnet-lab&force=true");
        self.call("PATCH", &path, "application/apply-patch+yaml", Some(object))
    }

    pub fn delete(&self, path: &str) -> Result<Value, KubeApiError> {
        self.call("DELETE", path, "application/json", None)
    }

    /// Requests by user, verb and resource, and their answers.
    pub fn calls(&self) -> Result<CallsView, KubeApiError> {
        let value = self.get(admin_paths::CALLS)?;
        serde_json::from_value(value).map_err(|err| KubeApiError::BadResponse {
            request: admin_paths::CALLS.to_owned(),
            reason: err.to_string(),
        })
    }

    /// Replaces the fault rules (an empty list stops all faults).
    pub fn set_faults(&self, rules: &[FaultRule]) -> Result<(), KubeApiError> {
        let rules = serde_json::to_value(rules).expect("serializes");
        self.call("PUT", admin_paths::FAULTS, "application/json", Some(&rules))
            .map(drop)
    }

    /// Ends every open watch, as an API server's restart does: clients
    /// must watch again (and meet the faults set then).
    pub fn end_watches(&self) -> Result<(), KubeApiError> {
        self.call("POST", admin_paths::END_WATCHES, "application/json", None)
            .map(drop)
    }

    /// What every cluster has: the `kubernetes` Service in front of the API
    /// server, and the ServiceCIDR its address comes from (Kubernetes 1.33
    /// makes one named `kubernetes` from the server's flag).
    fn seed_cluster(&self) -> Result<(), KubeApiError> {
        self.apply(
            "/apis/networking.k8s.io/v1/servicecidrs/kubernetes",
            &json!({
                "apiVersion": "networking.k8s.io/v1",
                "kind": "ServiceCIDR",
                "metadata": {"name": "kubernetes"},
                "spec": {"cidrs": [SERVICE_CIDR.to_string()]},
            }),
        )?;
        self.apply(
            "/api/v1/namespaces/default/services/kubernetes",
            &json!({
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "kubernetes", "namespace": "default",
                    "labels": {"component": "apiserver", "provider": "kubernetes"}},
                "spec": {
                    "type": "ClusterIP",
                    "clusterIP": KUBERNETES_SERVICE_IP.to_string(),
                    "clusterIPs": [KUBERNETES_SERVICE_IP.to_string()],
                    "ports": [{"name": "https", "port": 443, "protocol": "TCP", "targetPort": KUBE_API_PORT}],
                },
            }),
        )?;
        Ok(())
    }
}
