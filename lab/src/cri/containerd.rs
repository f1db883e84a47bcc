//! containerd 1.6 with its CRI plugin, run inside a lab namespace.
//!
//! Everything it makes is in directories the project owns:
//! [`CONTAINERD_ROOT_DIR`] (images, snapshots, sandbox metadata),
//! [`CONTAINERD_STATE_DIR`] (socket, configuration, log, pid file, runc's
//! state, shim bundles, the pods' network namespaces), and cgroups under
//! [`POD_CGROUP_PARENT`]. Two things live where containerd 1.6 puts them
//! whatever it is told, and are cleaned up by name: the shims' sockets
//! (`/run/containerd/s/<hash>`) and libcni's result cache
//! (`/var/lib/cni/results/<network>-<sandbox id>-<interface>`).
//!
//! The daemon is started with `nsenter --net=/var/run/netns/<ns>` (not
//! `ip netns exec`, which remounts `/sys`, after which runc finds no
//! cgroups), so the pods' CNI plugins run in that namespace. Stopping it,
//! or dropping [`Containerd`], removes every sandbox through CRI (so CNI
//! plugins see their DEL), stops the daemon and then removes by force
//! whatever is left: shims, pause processes, cgroups, mounts, directories.
//! [`teardown_leftovers`] does the same for a containerd whose owner died.

use std::{
    fmt::Write as _,
    fs::{self, File},
    io::ErrorKind,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use nix::{
    mount::{MsFlags, mount, umount},
    sys::signal::Signal,
};
use tracing::{debug, info, warn};

use super::{
    Context, CriClient, CriError, Result,
    image::{self, PAUSE_IMAGE},
    node_paths::{self, NodePath},
    sweep,
};
use crate::{addrs::NS_PREFIX, netns::netns_path};

/// containerd's root: images, snapshots, sandbox metadata.
pub const CONTAINERD_ROOT_DIR: &str = "/var/lib/vpcnet-lab/containerd";
/// containerd's state: socket, configuration, log, pid file, runc's state,
/// shim bundles, the pods' network namespaces.
pub const CONTAINERD_STATE_DIR: &str = "/run/vpcnet-lab/containerd";
/// The CRI (and containerd) socket of a containerd with the default dirs.
pub const CONTAINERD_SOCKET: &str = "/run/vpcnet-lab/containerd/containerd.sock";
/// The cgroup (in every hierarchy) the lab's sandboxes go under: kubelet
/// gives the pod's quality-of-service cgroup, the lab its own, so every pause process can
/// be found and its cgroup removed.
pub const POD_CGROUP_PARENT: &str = "/vpcnet-lab-pods";
/// Where Debian's `containernetworking-plugins` installs the reference
/// plugins (`loopback`, `ptp`, `host-local`, `portmap`, ...).
pub const DEBIAN_CNI_BIN_DIR: &str = "/usr/lib/cni";

/// The label of a sandbox that runs one of the node's own agents (a
/// DaemonSet's pod with host network): removed after every other.
pub const LABEL_NODE_AGENT: &str = "lab.vpcnet.dev/node-agent";

/// Where root and state directories may be: teardown removes them whole.
const ROOT_PARENT: &str = "/var/lib/vpcnet-lab";
const STATE_PARENT: &str = "/run/vpcnet-lab";

/// Names inside the state directory.
const SOCKET_FILE: &str = "containerd.sock";
const CONFIG_FILE: &str = "config.toml";
const LOG_FILE: &str = "containerd.log";
const PID_FILE: &str = "containerd.pid";
/// runc's `--root` (the runc shim's `Root` option; its default is
/// `/run/containerd/runc`). The shim appends the containerd namespace.
const RUNC_ROOT: &str = "runc";

/// The CRI plugin keeps its sandboxes in this containerd namespace.
const CRI_NAMESPACE: &str = image::CRI_CONTAINERD_NAMESPACE;
/// Where containerd 1.6 puts shim sockets, whatever its state directory.
const SHIM_SOCKET_DIR: &str = "/run/containerd/s";
/// libcni's cache (containerd 1.6 cannot move it).
pub const CNI_CACHE_DIR: &str = "/var/lib/cni";
/// libcni's cache of ADD results.
const CNI_RESULTS_DIR: &str = "/var/lib/cni/results";

/// How long containerd has to exit after SIGTERM before SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(10);
/// The limit on each CRI call made while tearing down (`StopPodSandbox` runs
/// the CNI DEL).
const TEARDOWN_CALL_TIMEOUT: Duration = Duration::from_mins(1);
/// How often readiness is polled: the socket gives no event for "serving".
const READY_POLL: Duration = Duration::from_millis(50);

/// containerd's root and state directories.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerdDirs {
    /// Under `/var/lib/vpcnet-lab/`.
    pub root: PathBuf,
    /// Under `/run/vpcnet-lab/`.
    pub state: PathBuf,
}

impl Default for ContainerdDirs {
    fn default() -> Self {
        Self {
            root: PathBuf::from(CONTAINERD_ROOT_DIR),
            state: PathBuf::from(CONTAINERD_STATE_DIR),
        }
    }
}

impl ContainerdDirs {
    /// The CRI socket.
    pub fn socket(&self) -> PathBuf {
        self.state.join(SOCKET_FILE)
    }

    /// The generated `config.toml`.
    pub fn config_file(&self) -> PathBuf {
        self.state.join(CONFIG_FILE)
    }

    /// containerd's standard output and error.
    pub fn log_file(&self) -> PathBuf {
        self.state.join(LOG_FILE)
    }

    /// The daemon's pid, for a teardown by another process.
    pub fn pid_file(&self) -> PathBuf {
        self.state.join(PID_FILE)
    }

    /// runc's root (the shim adds the containerd namespace below it).
    pub fn runc_root(&self) -> PathBuf {
        self.state.join(RUNC_ROOT)
    }

    /// Teardown removes both directories whole: only project paths will do.
    fn check(&self) -> Result<()> {
        for (dir, parent) in [(&self.root, ROOT_PARENT), (&self.state, STATE_PARENT)] {
            let below_parent = dir.is_absolute()
                && dir.starts_with(parent)
                && dir != Path::new(parent)
                && !dir
                    .components()
                    .any(|c| c == std::path::Component::ParentDir);
            if !below_parent {
                return Err(CriError::InvalidOption(format!(
                    "{} must be a directory below {parent} (teardown removes it whole)",
                    dir.display()
                )));
            }
        }
        Ok(())
    }
}

/// The snapshotter that unpacks images into sandbox root file systems.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Snapshotter {
    Overlayfs,
    /// Plain copies: for file systems overlayfs cannot sit on.
    Native,
}

impl Snapshotter {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Overlayfs => "overlayfs",
            Self::Native => "native",
        }
    }
}

/// How to run containerd.
#[derive(Debug, Clone)]
pub struct ContainerdOptions {
    /// The lab namespace containerd (and so every CNI plugin) runs in,
    /// such as `vpcnet-node`.
    pub netns: String,
    /// Where CNI plugins are found. containerd 1.6 takes one directory:
    /// one that holds the lab's plugin must hold `loopback` too (containerd
    /// sets up each sandbox's `lo` with it); see [`link_cni_plugins`].
    pub cni_bin_dir: PathBuf,
    /// Where the CNI network configuration is (containerd uses the first
    /// file, by name, and watches the directory).
    pub cni_conf_dir: PathBuf,
    pub dirs: ContainerdDirs,
    /// `None`: overlayfs if this machine can mount one in the root
    /// directory, otherwise native.
    pub snapshotter: Option<Snapshotter>,
    /// How long containerd may take to answer CRI Version.
    pub ready_timeout: Duration,
    /// Node paths containerd (its plugins, its containers' `hostPath`s)
    /// sees as lab directories; none: it sees the machine's.
    pub node_paths: Vec<NodePath>,
    /// Mount points a container may mount below (`Bidirectional`), shared
    /// in containerd's namespace (with `node_paths` only).
    pub shared_mounts: Vec<PathBuf>,
}

impl ContainerdOptions {
    /// containerd in `netns`, with the default directories.
    pub fn new(
        netns: impl Into<String>,
        cni_bin_dir: impl Into<PathBuf>,
        cni_conf_dir: impl Into<PathBuf>,
    ) -> Self {
        Self {
            netns: netns.into(),
            cni_bin_dir: cni_bin_dir.into(),
            cni_conf_dir: cni_conf_dir.into(),
            dirs: ContainerdDirs::default(),
            snapshotter: None,
            ready_timeout: Duration::from_secs(30),
            node_paths: Vec::new(),
            shared_mounts: Vec::new(),
        }
    }
}

/// A running containerd; stopped (leaving nothing) when dropped.
#[derive(Debug)]
pub struct Containerd {
    /// `None` once stopped.
    child: Option<Child>,
    pid: u32,
    dirs: ContainerdDirs,
    netns: String,
    snapshotter: Snapshotter,
}

impl Containerd {
    /// Starts containerd in `opts.netns`, waits until its CRI answers and
    /// imports the pause image. Fails if a containerd of the lab is there
    /// already (its directories exist).
    pub fn start(opts: &ContainerdOptions) -> Result<Self> {
        if !nix::unistd::geteuid().is_root() {
            return Err(CriError::InvalidOption(
                "containerd needs root; run as root".into(),
            ));
        }
        opts.dirs.check()?;
        check_netns(&opts.netns)?;
        for dir in [&opts.dirs.state, &opts.dirs.root] {
            if dir.exists() {
                return Err(CriError::AlreadyExists {
                    what: dir.display().to_string(),
                });
            }
        }
        let started = Instant::now();
        let dirs = &opts.dirs;
        for dir in [&dirs.state, &dirs.root] {
            fs::create_dir_all(dir).context(|| format!("creating {}", dir.display()))?;
        }
        // From here on a failure must not leave the directories behind.
        let snapshotter = match opts.snapshotter {
            Some(snapshotter) => snapshotter,
            None => pick_snapshotter(&dirs.root),
        };
        let config = config_toml(opts, snapshotter);
        let log_path = dirs.log_file();
        let prepared = if opts.node_paths.is_empty() {
            Ok(())
        } else {
            node_paths::prepare(&opts.node_paths, &dirs.state)
        };
        let spawned = prepared
            .and_then(|()| {
                fs::write(dirs.config_file(), config)
                    .context(|| format!("writing {}", dirs.config_file().display()))
            })
            .and_then(|()| {
                File::create(&log_path).context(|| format!("creating {}", log_path.display()))
            })
            .and_then(|log| spawn_daemon(opts, &log));
        let child = match spawned {
            Ok(child) => child,
            Err(err) => {
                if let Err(cleanup) = teardown_leftovers_in(dirs) {
                    warn!(%cleanup, "cleaning up after a failed start");
                }
                return Err(err);
            }
        };
        let mut containerd = Self {
            pid: child.id(),
            child: Some(child),
            dirs: dirs.clone(),
            netns: opts.netns.clone(),
            snapshotter,
        };
        // Dropping `containerd` on an error below tears everything down.
        fs::write(dirs.pid_file(), format!("{}\n", containerd.pid))
            .context(|| format!("writing {}", dirs.pid_file().display()))?;
        info!(pid = containerd.pid, netns = %opts.netns, snapshotter = snapshotter.as_str(), "containerd started");
        let version = containerd.wait_ready(opts.ready_timeout)?;
        let ready_after = started.elapsed();
        image::ensure_pause_image(&dirs.socket(), snapshotter.as_str(), &dirs.state).map_err(
            |err| CriError::NotReady {
                socket: dirs.socket(),
                reason: format!("importing the pause image {PAUSE_IMAGE}: {err}"),
                log_tail: sweep::log_tail(&log_path),
            },
        )?;
        info!(
            runtime = %format!("{} {}", version.runtime_name, version.runtime_version),
            ready_after = ?ready_after,
            with_image_after = ?started.elapsed(),
            "containerd's CRI is ready"
        );
        Ok(containerd)
    }

    /// Polls CRI Version until it answers, the daemon dies, or `timeout`.
    fn wait_ready(&mut self, timeout: Duration) -> Result<super::RuntimeVersion> {
        let socket = self.dirs.socket();
        let deadline = Instant::now() + timeout;
        let mut last_error = String::from("no answer yet");
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(self.not_ready(format!("containerd exited ({status})")));
            }
            if socket.exists() {
                match CriClient::connect(&socket)
                    .map(|client| client.with_call_timeout(Duration::from_secs(2)))
                    .and_then(|client| client.version())
                {
                    Ok(version) => return Ok(version),
                    // The daemon serves, without the CRI plugin: it failed
                    // to load and will not come later.
                    Err(CriError::Rpc {
                        code: tonic::Code::Unimplemented,
                        ..
                    }) => {
                        return Err(self.not_ready(
                            "containerd serves but its CRI plugin did not load \
                             (look for \"failed to load plugin\" in the log)"
                                .into(),
                        ));
                    }
                    Err(err) => last_error = err.to_string(),
                }
            }
            if Instant::now() >= deadline {
                return Err(self.not_ready(format!(
                    "CRI Version did not answer within {timeout:?} (last: {last_error})"
                )));
            }
            std::thread::sleep(READY_POLL);
        }
    }

    fn not_ready(&self, reason: String) -> CriError {
        CriError::NotReady {
            socket: self.dirs.socket(),
            reason,
            log_tail: sweep::log_tail(&self.dirs.log_file()),
        }
    }

    /// The daemon's pid.
    /// Lets containerd outlive this value and this process (a lab left
    /// running); [`teardown_leftovers`] removes it later.
    pub fn leave_running(self) {
        std::mem::forget(self);
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The CRI socket.
    pub fn socket(&self) -> PathBuf {
        self.dirs.socket()
    }

    /// A new CRI client on the socket.
    pub fn client(&self) -> Result<CriClient> {
        CriClient::connect(self.dirs.socket())
    }

    /// The directories.
    pub fn dirs(&self) -> &ContainerdDirs {
        &self.dirs
    }

    /// containerd's log.
    pub fn log_file(&self) -> PathBuf {
        self.dirs.log_file()
    }

    /// The namespace it runs in.
    pub fn netns(&self) -> &str {
        &self.netns
    }

    /// The snapshotter in use.
    pub fn snapshotter(&self) -> Snapshotter {
        self.snapshotter
    }

    /// Removes every sandbox through CRI, stops containerd and removes
    /// whatever is left. An error says what went wrong; whatever could be
    /// removed by force was removed anyway.
    pub fn stop(mut self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let mut forced = Vec::new();
        let mut left = Vec::new();
        // Until it is reaped (below) its pid cannot be reused, so the
        // signals reach containerd and nothing else.
        if matches!(child.try_wait(), Ok(None)) {
            forced = remove_sandboxes_through_cri(&self.dirs.socket());
            if let Err(err) = stop_daemon(self.pid_i32()) {
                left.push(err.to_string());
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        left.extend(sweep_dirs(&self.dirs));
        info!(pid = self.pid, "containerd stopped");
        teardown_result(&left, &forced)
    }

    fn pid_i32(&self) -> i32 {
        i32::try_from(self.pid).expect("pids fit in i32")
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if let Err(err) = self.shutdown() {
            warn!(%err, "stopping containerd on drop");
        }
    }
}

/// Removes a containerd of the lab with the default directories, whatever
/// state its owner left it in (crashed test, killed daemon); see
/// [`teardown_leftovers_in`].
pub fn teardown_leftovers() -> Result<()> {
    teardown_leftovers_in(&ContainerdDirs::default())
}

/// Removes what a containerd with `dirs` left: if its daemon (pid file)
/// still runs, its sandboxes are removed through CRI first (CNI DEL), then
/// it is stopped; shims, pause processes, cgroups, mounts and directories
/// go by force. Nothing there is fine.
pub fn teardown_leftovers_in(dirs: &ContainerdDirs) -> Result<()> {
    dirs.check()?;
    let mut forced = Vec::new();
    let mut left = Vec::new();
    if let Some(pid) = recorded_daemon(dirs) {
        info!(pid, "a containerd of the lab is still running; stopping it");
        forced = remove_sandboxes_through_cri(&dirs.socket());
        if let Err(err) = stop_daemon(pid) {
            left.push(err.to_string());
        }
    }
    left.extend(sweep_dirs(dirs));
    teardown_result(&left, &forced)
}

/// What is left is an error; so are sandboxes removed by force, a milder one.
fn teardown_result(left: &[String], forced: &[String]) -> Result<()> {
    if !left.is_empty() {
        let mut problems = left.to_vec();
        problems.extend_from_slice(forced);
        Err(CriError::Teardown(problems.join("; ")))
    } else if !forced.is_empty() {
        Err(CriError::SandboxesForced(forced.join("; ")))
    } else {
        Ok(())
    }
}

/// Makes `bin_dir` (if needed) and links each of `plugins` into it under its
/// own name: one directory for containerd 1.6, which takes only one, with
/// plugins from several places (say the lab's own plugin and Debian's
/// `loopback`, which containerd needs).
pub fn link_cni_plugins(bin_dir: &Path, plugins: &[&Path]) -> Result<()> {
    fs::create_dir_all(bin_dir).context(|| format!("creating {}", bin_dir.display()))?;
    for plugin in plugins {
        let name = plugin.file_name().ok_or_else(|| {
            CriError::InvalidOption(format!("{} names no file", plugin.display()))
        })?;
        let link = bin_dir.join(name);
        match fs::remove_file(&link) {
            Ok(()) => {}
            Err(err) if err.kind() == ErrorKind::NotFound => {}
            Err(err) => return Err(err).context(|| format!("replacing {}", link.display())),
        }
        std::os::unix::fs::symlink(plugin, &link)
            .context(|| format!("linking {} to {}", link.display(), plugin.display()))?;
    }
    Ok(())
}

fn check_netns(ns: &str) -> Result<()> {
    if !ns.starts_with(NS_PREFIX) || ns.len() == NS_PREFIX.len() || ns.contains('/') {
        return Err(CriError::InvalidOption(format!(
            "namespace {ns:?} is not a lab namespace (they start with {NS_PREFIX})"
        )));
    }
    if !netns_path(ns).exists() {
        return Err(CriError::InvalidOption(format!(
            "namespace {ns} does not exist ({} is missing)",
            netns_path(ns).display()
        )));
    }
    Ok(())
}

/// `nsenter --net=<ns> -- containerd --config <config>`. nsenter execs
/// containerd (no fork without a pid namespace), so the child's pid is
/// containerd's.
fn spawn_daemon(opts: &ContainerdOptions, log: &File) -> Result<Child> {
    let config = opts.dirs.config_file();
    let mut daemon = Command::new("containerd");
    daemon.arg("--config").arg(&config);
    if !opts.node_paths.is_empty() {
        daemon = node_paths::wrap(&daemon, &opts.node_paths, &opts.shared_mounts);
    }
    let mut command = Command::new("nsenter");
    command
        .arg(format!("--net={}", netns_path(&opts.netns).display()))
        .arg("--")
        .arg(daemon.get_program())
        .args(daemon.get_args())
        .stdin(Stdio::null())
        .stdout(
            log.try_clone()
                .context(|| "duplicating the log file".into())?,
        )
        .stderr(
            log.try_clone()
                .context(|| "duplicating the log file".into())?,
        )
        // Its own process group: a Ctrl-C at the terminal reaches the test,
        // whose teardown stops containerd in order.
        .process_group(0);
    debug!(config = %config.display(), netns = %opts.netns, "starting containerd");
    command
        .spawn()
        .map_err(|err| sweep::spawn_error("nsenter", &err))
}

/// Whether an overlay file system can be mounted in `root`, tried the way
/// containerd's overlayfs snapshotter would use it; native otherwise.
fn pick_snapshotter(root: &Path) -> Snapshotter {
    let check = root.join("overlay-check");
    let [lower, upper, work, merged] =
        ["lower", "upper", "work", "merged"].map(|name| check.join(name));
    let mounted = [&lower, &upper, &work, &merged]
        .iter()
        .try_for_each(fs::create_dir_all)
        .is_ok()
        && mount(
            Some("overlay"),
            &merged,
            Some("overlay"),
            MsFlags::empty(),
            Some(
                format!(
                    "lowerdir={},upperdir={},workdir={}",
                    lower.display(),
                    upper.display(),
                    work.display()
                )
                .as_str(),
            ),
        )
        .map_err(
            |err| warn!(%err, "overlayfs cannot be mounted here; using the native snapshotter"),
        )
        .is_ok();
    if mounted && let Err(err) = umount(&merged) {
        warn!(%err, "unmounting the overlayfs check");
    }
    let _ = fs::remove_dir_all(&check);
    if mounted {
        Snapshotter::Overlayfs
    } else {
        Snapshotter::Native
    }
}

/// containerd's configuration (version 2): the CRI plugin with runc as
/// the only runtime, cgroupfs, the pause image built here, the given CNI
/// directories; plugins the lab does not need are off.
fn config_toml(opts: &ContainerdOptions, snapshotter: Snapshotter) -> String {
    let dirs = &opts.dirs;
    let cri = r#"plugins."io.containerd.grpc.v1.cri""#;
    format!(
        r#"# Generated by vpcnet-lab (lab/src/cri/containerd.rs); rewritten at each start.
version = 2
root = {root}
state = {state}
disabled_plugins = [
  # Snapshotters the lab does not use.
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  # Makes /opt/containerd (outside the lab's directories) for nothing the lab uses.
  "io.containerd.internal.v1.opt",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = {socket}

[{cri}]
  sandbox_image = {sandbox_image}
  # Its oom_score_adj may not be lowered below containerd's own.
  restrict_oom_score_adj = true
  # Pod network namespaces in the state directory, not /var/run/netns.
  netns_mounts_under_state_dir = true
  # The streaming server (exec, attach) inside the node namespace, on any port.
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

  [{cri}.containerd]
    snapshotter = {snapshotter}
    default_runtime_name = "runc"

    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [{cri}.containerd.runtimes.runc.options]
        # No systemd here: cgroupfs.
        SystemdCgroup = false
        Root = {runc_root}

  [{cri}.cni]
    bin_dir = {bin_dir}
    conf_dir = {conf_dir}
    max_conf_num = 1
"#,
        root = toml_string(&dirs.root.to_string_lossy()),
        state = toml_string(&dirs.state.to_string_lossy()),
        socket = toml_string(&dirs.socket().to_string_lossy()),
        sandbox_image = toml_string(PAUSE_IMAGE),
        snapshotter = toml_string(snapshotter.as_str()),
        runc_root = toml_string(&dirs.runc_root().to_string_lossy()),
        bin_dir = toml_string(&opts.cni_bin_dir.to_string_lossy()),
        conf_dir = toml_string(&opts.cni_conf_dir.to_string_lossy()),
    )
}

/// A TOML basic string.
fn toml_string(value: &str) -> String {
    let mut quoted = String::from("\"");
    for c in value.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            c if c.is_control() => {
                let _ = write!(quoted, "\\u{:04x}", u32::from(c));
            }
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted
}

/// Stops and removes every sandbox, as kubelet would; returns what failed.
fn remove_sandboxes_through_cri(socket: &Path) -> Vec<String> {
    let client = match CriClient::connect(socket) {
        Ok(client) => client.with_call_timeout(TEARDOWN_CALL_TIMEOUT),
        Err(err) => return vec![format!("containerd does not answer, so no CNI DEL: {err}")],
    };
    let sandboxes = match client.list_pod_sandboxes() {
        Ok(sandboxes) => sandboxes,
        // No CRI plugin loaded: no sandbox either.
        Err(CriError::Rpc {
            code: tonic::Code::Unimplemented,
            ..
        }) => return Vec::new(),
        Err(err) => return vec![err.to_string()],
    };
    let mut problems = Vec::new();
    // The node's own agents last: their CNI socket serves the others' DELs.
    let mut sandboxes = sandboxes;
    sandboxes.sort_by_key(|sandbox| sandbox.labels.contains_key(LABEL_NODE_AGENT));
    for sandbox in sandboxes {
        let removed = client
            .stop_pod_sandbox(&sandbox.id)
            .and_then(|()| client.remove_pod_sandbox(&sandbox.id));
        match removed {
            Ok(()) => debug!(id = %sandbox.id, pod = %sandbox.name, "sandbox removed"),
            Err(err) => {
                warn!(id = %sandbox.id, pod = %sandbox.name, %err, "removing a sandbox through CRI");
                problems.push(format!(
                    "sandbox {} of pod {}/{}: {err}",
                    sandbox.id, sandbox.namespace, sandbox.name
                ));
            }
        }
    }
    problems
}

/// SIGTERM, then SIGKILL if it lingers.
fn stop_daemon(pid: i32) -> Result<()> {
    if sweep::signal_and_wait(pid, Signal::SIGTERM, TERM_GRACE)? {
        return Ok(());
    }
    warn!(
        pid,
        "containerd ignored SIGTERM for {TERM_GRACE:?}; killing it"
    );
    sweep::kill_and_wait(pid, "containerd")
}

/// The pid in the pid file, if that process is this containerd (its
/// command line names our configuration).
fn recorded_daemon(dirs: &ContainerdDirs) -> Option<i32> {
    let pid: i32 = fs::read_to_string(dirs.pid_file())
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let config = dirs.config_file().to_string_lossy().into_owned();
    sweep::cmdline(pid).contains(&config).then_some(pid)
}

/// Everything but the daemon: shims, containers (pause processes), cgroups,
/// caches outside the directories, mounts, the directories. Checks that
/// nothing is left; returns what went wrong and what is left.
fn sweep_dirs(dirs: &ContainerdDirs) -> Vec<String> {
    let mut problems = Vec::new();
    let socket = dirs.socket();
    // The daemon, if it still runs (an owner that died mid-teardown).
    if let Some(pid) = recorded_daemon(dirs)
        && let Err(err) = sweep::kill_and_wait(pid, "containerd")
    {
        problems.push(err.to_string());
    }
    // Read before the directories go: which sandboxes there were, and
    // where their shims listen.
    let sandbox_ids = sandbox_ids(dirs);
    let shim_sockets = shim_sockets(dirs, &sandbox_ids);

    // Shims outlive containerd by design; they serve only our socket.
    match sweep::shims_of(&socket) {
        Ok(shims) => {
            for pid in shims {
                warn!(pid, "killing a leftover containerd shim");
                if let Err(err) = sweep::kill_and_wait(pid, "a containerd shim") {
                    problems.push(err.to_string());
                }
            }
        }
        Err(err) => problems.push(err.to_string()),
    }
    // Each sandbox's pause process and each container, with their
    // cgroups, through runc.
    let runc_root = dirs.runc_root().join(CRI_NAMESPACE);
    delete_runc_containers(&runc_root, &runc_container_ids(&runc_root));
    // The node's mount points, once containerd's namespace is gone.
    problems.extend(node_paths::remove_mount_points(&dirs.state));
    // Whatever runc could not remove.
    if let Err(err) = sweep::remove_cgroup_trees(POD_CGROUP_PARENT) {
        problems.push(err.to_string());
    }
    for path in shim_sockets.iter().chain(&cni_cache_files(&sandbox_ids)) {
        match fs::remove_file(path) {
            Ok(()) => debug!(path = %path.display(), "removed"),
            Err(err) if err.kind() == ErrorKind::NotFound => {}
            Err(err) => problems.push(format!("removing {}: {err}", path.display())),
        }
    }
    // Shim sockets' directories are containerd's defaults, made by this
    // containerd if they are not there: removed only when empty.
    // So are libcni's cache directories.
    for dir in [
        SHIM_SOCKET_DIR,
        "/run/containerd",
        CNI_RESULTS_DIR,
        CNI_CACHE_DIR,
    ] {
        sweep::remove_if_empty(Path::new(dir));
    }

    let both = [dirs.state.as_path(), dirs.root.as_path()];
    match sweep::unmount_all_under(&both) {
        Ok(()) => {
            for dir in both {
                if let Err(err) = sweep::remove_tree(dir) {
                    problems.push(err.to_string());
                }
                if let Some(parent) = dir.parent() {
                    // The lab's own state directory: `Lab` takes an empty
                    // one for a lab that is there.
                    sweep::remove_if_empty(parent);
                }
            }
        }
        // Removing files through a mount that is still there would reach
        // into whatever it shows.
        Err(err) => problems.push(format!("{err}; the directories are kept")),
    }

    problems.extend(leftovers(dirs));
    problems
}

/// What of a containerd with `dirs` is still there, described.
fn leftovers(dirs: &ContainerdDirs) -> Vec<String> {
    let mut left = Vec::new();
    if let Some(pid) = recorded_daemon(dirs) {
        left.push(format!("containerd (pid {pid})"));
    }
    if let Ok(shims) = sweep::shims_of(&dirs.socket())
        && !shims.is_empty()
    {
        left.push(format!("shims {shims:?}"));
    }
    let config = dirs.config_file().to_string_lossy().into_owned();
    if let Ok(daemons) = sweep::processes_with_arg(&config)
        && !daemons.is_empty()
    {
        left.push(format!("processes running with {config}: {daemons:?}"));
    }
    match sweep::mounts_under(&[&dirs.state, &dirs.root]) {
        Ok(mounts) if !mounts.is_empty() => left.push(format!("mounts {mounts:?}")),
        Ok(_) => {}
        Err(err) => left.push(err.to_string()),
    }
    if let Ok(cgroups) = sweep::cgroup_trees(POD_CGROUP_PARENT)
        && !cgroups.is_empty()
    {
        left.push(format!("cgroups {cgroups:?}"));
    }
    for dir in [&dirs.state, &dirs.root] {
        if dir.exists() {
            left.push(format!("directory {}", dir.display()));
        }
    }
    left
}

/// The ids of the sandboxes containerd knew: CRI metadata, shim bundles,
/// runc state.
fn sandbox_ids(dirs: &ContainerdDirs) -> Vec<String> {
    let places = [
        dirs.root.join("io.containerd.grpc.v1.cri/sandboxes"),
        dirs.state
            .join("io.containerd.runtime.v2.task")
            .join(CRI_NAMESPACE),
        dirs.runc_root().join(CRI_NAMESPACE),
    ];
    let mut ids: Vec<String> = places
        .iter()
        .filter_map(|dir| fs::read_dir(dir).ok())
        .flatten()
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|name| is_container_id(name))
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

/// containerd ids are 64 hex digits: safe to match in shared directories.
fn is_container_id(name: &str) -> bool {
    name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The shims' sockets, from each bundle's `address` file
/// (`unix:///run/containerd/s/<hash>`), only where containerd 1.6 puts them.
fn shim_sockets(dirs: &ContainerdDirs, ids: &[String]) -> Vec<PathBuf> {
    let bundles = dirs
        .state
        .join("io.containerd.runtime.v2.task")
        .join(CRI_NAMESPACE);
    ids.iter()
        .filter_map(|id| fs::read_to_string(bundles.join(id).join("address")).ok())
        .filter_map(|address| {
            let path = PathBuf::from(address.trim().trim_start_matches("unix://"));
            path.starts_with(SHIM_SOCKET_DIR).then_some(path)
        })
        .collect()
}

/// libcni's cached results of our sandboxes (`<network>-<id>-<ifname>`).
fn cni_cache_files(ids: &[String]) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(CNI_RESULTS_DIR) else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|name| ids.iter().any(|id| name.contains(&format!("-{id}-"))))
        .map(|name| Path::new(CNI_RESULTS_DIR).join(name))
        .collect()
}

/// `runc delete --force` for each container runc knows: kills its
/// processes and removes its cgroups. Failures are left to the cgroup
/// sweep, which comes next.
/// Every container runc keeps state for under `runc_root`.
fn runc_container_ids(runc_root: &Path) -> Vec<String> {
    fs::read_dir(runc_root)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|entry| entry.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn delete_runc_containers(runc_root: &Path, ids: &[String]) {
    for id in ids {
        if !runc_root.join(id).exists() {
            continue;
        }
        let output = Command::new("runc")
            .arg("--root")
            .arg(runc_root)
            .args(["delete", "--force", id])
            .stdin(Stdio::null())
            .output();
        match output {
            Ok(output) if output.status.success() => {
                debug!(id, "runc deleted a leftover container");
            }
            Ok(output) => warn!(
                id,
                stderr = %String::from_utf8_lossy(&output.stderr).trim(),
                "runc delete --force failed"
            ),
            Err(err) => warn!(id, %err, "running runc"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dirs_must_be_below_the_project_directories() {
        assert!(ContainerdDirs::default().check().is_ok());
        for (root, state) in [
            ("/var/lib/containerd", CONTAINERD_STATE_DIR),
            (CONTAINERD_ROOT_DIR, "/run/containerd"),
            ("/var/lib/vpcnet-lab", CONTAINERD_STATE_DIR),
            ("/var/lib/vpcnet-lab/../x", CONTAINERD_STATE_DIR),
            ("relative/vpcnet-lab", CONTAINERD_STATE_DIR),
        ] {
            let dirs = ContainerdDirs {
                root: root.into(),
                state: state.into(),
            };
            assert!(dirs.check().is_err(), "{root} {state}");
        }
        assert_eq!(
            ContainerdDirs::default().socket(),
            PathBuf::from(CONTAINERD_SOCKET)
        );
    }

    #[test]
    fn config_names_the_cri_settings() {
        let opts = ContainerdOptions::new("vpcnet-node", "/opt/bin", "/tmp/net \"d\"");
        let config = config_toml(&opts, Snapshotter::Native);
        for line in [
            r#"root = "/var/lib/vpcnet-lab/containerd""#,
            r#"address = "/run/vpcnet-lab/containerd/containerd.sock""#,
            r#"sandbox_image = "vpcnet.lab/pause:1""#,
            "restrict_oom_score_adj = true",
            "netns_mounts_under_state_dir = true",
            r#"snapshotter = "native""#,
            "SystemdCgroup = false",
            r#"Root = "/run/vpcnet-lab/containerd/runc""#,
            r#"bin_dir = "/opt/bin""#,
            r#"conf_dir = "/tmp/net \"d\"""#,
            "max_conf_num = 1",
        ] {
            assert!(config.contains(line), "{line} missing from\n{config}");
        }
    }

    #[test]
    fn cni_cache_names_match_only_whole_ids() {
        assert!(is_container_id(&"a1".repeat(32)));
        assert!(!is_container_id("a1"));
        assert!(!is_container_id(&"g1".repeat(32)));
    }
}
