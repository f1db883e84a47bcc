//! The emulator as the lab runs it: the `vpcnet-lab-ec2` binary with its
//! listeners in `vpcnet-vpc` (the EC2 endpoint on 10.20.0.10:80, IMDS on
//! 169.254.169.254:80, both on the router's `lo`; the node reaches them
//! through its default route), its admin socket and log in the lab's state
//! directory, and the lab's own set-up done: the node's instance launched
//! with its primary address 10.20.11.162 (so `eth0` is its primary ENI).
//!
//! Ready means the binary printed `READY` (after binding every listener);
//! dropping the [`EmulatorProcess`] kills it.

use std::{
    fs::{self, File},
    net::SocketAddr,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use tracing::{info, warn};

use super::{
    EmulatorError,
    admin::{AdminClient, RunInstanceRequest},
    config::{Config, LAB_NODE_SUBNET_ID},
};
use crate::{
    addrs::{EC2_ENDPOINT_ADDR, IMDS_ADDR, NODE_PRIMARY_ADDR, NS_VPC},
    helper_process::{SiblingError, log_tail, sibling_binary, wait_ready},
    state::state_dir,
};

/// The EC2 endpoint the agent is given (`AWS_ENDPOINT_URL_EC2`).
pub const EC2_ENDPOINT_URL: &str = "http://10.20.0.10";
/// The IMDS endpoint (`AWS_EC2_METADATA_SERVICE_ENDPOINT`; also the SDK's
/// default).
pub const IMDS_ENDPOINT_URL: &str = "http://169.254.169.254";
/// The binary's name.
pub const EMULATOR_BIN: &str = "vpcnet-lab-ec2";

/// How to run the emulator for the lab.
#[derive(Debug, Clone)]
pub struct EmulatorOptions {
    /// The binary; `None`: [`emulator_binary`].
    pub binary: Option<PathBuf>,
    pub config: Config,
    /// The node's instance type (its ENI and address limits).
    pub instance_type: String,
    /// Where the configuration, the admin socket and the log go.
    pub work_dir: PathBuf,
    /// `--fabric lab` (attachments make links in the lab) or `none`.
    pub fabric: bool,
    /// How long the binary may take to say `READY`.
    pub ready_timeout: Duration,
}

impl Default for EmulatorOptions {
    fn default() -> Self {
        Self {
            binary: None,
            config: Config::lab(),
            instance_type: "m5.large".to_owned(),
            work_dir: state_dir().to_path_buf(),
            fabric: true,
            ready_timeout: Duration::from_secs(20),
        }
    }
}

impl EmulatorOptions {
    pub fn config_path(&self) -> PathBuf {
        self.work_dir.join("ec2-config.json")
    }

    pub fn admin_socket(&self) -> PathBuf {
        self.work_dir.join("ec2-admin.sock")
    }

    pub fn log_path(&self) -> PathBuf {
        self.work_dir.join("ec2.log")
    }
}

/// The binary next to the running executable (see
/// [`crate::helper_process::sibling_binary`]).
pub fn emulator_binary() -> Result<PathBuf, EmulatorError> {
    sibling_binary(EMULATOR_BIN).map_err(|source| match source {
        SiblingError::Missing(path) => EmulatorError::BinaryMissing(path),
        SiblingError::Io(source) => EmulatorError::Io {
            context: "finding the running executable".into(),
            source,
        },
    })
}

/// The running emulator; killed when dropped.
#[derive(Debug)]
pub struct EmulatorProcess {
    child: Child,
    admin: AdminClient,
    instance_id: String,
    log: PathBuf,
}

impl EmulatorProcess {
    /// Starts the binary in `vpcnet-vpc` (the lab's namespaces must exist),
    /// waits for it to be ready, launches the node's instance.
    pub fn start(opts: &EmulatorOptions) -> Result<Self, EmulatorError> {
        let binary = match &opts.binary {
            Some(path) if path.is_file() => path.clone(),
            Some(path) => return Err(EmulatorError::BinaryMissing(path.clone())),
            None => emulator_binary()?,
        };
        let io = |context: String| move |source| EmulatorError::Io { context, source };
        fs::create_dir_all(&opts.work_dir)
            .map_err(io(format!("creating {}", opts.work_dir.display())))?;
        let config_path = opts.config_path();
        fs::write(&config_path, serde_json::to_vec_pretty(&opts.config)?)
            .map_err(io(format!("writing {}", config_path.display())))?;
        let log_path = opts.log_path();
        let log =
            File::create(&log_path).map_err(io(format!("creating {}", log_path.display())))?;
        let ec2 = SocketAddr::from((EC2_ENDPOINT_ADDR, 80));
        let imds = SocketAddr::from((IMDS_ADDR, 80));
        let mut command = Command::new(&binary);
        command
            .arg("--config")
            .arg(&config_path)
            .args(["--ec2-listen", &ec2.to_string()])
            .args(["--imds-listen", &imds.to_string()])
            .arg("--admin-socket")
            .arg(opts.admin_socket())
            .args(["--netns", NS_VPC])
            .args(["--fabric", if opts.fabric { "lab" } else { "none" }])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            // Its own process group: a Ctrl-C meant for whoever started it
            // does not take a lab left running down with it.
            .process_group(0);
        if std::env::var_os("RUST_LOG").is_none() {
            command.env("RUST_LOG", "vpcnet_lab=info");
        }
        info!(binary = %binary.display(), "starting the EC2 emulator");
        let mut child = command
            .spawn()
            .map_err(io(format!("starting {}", binary.display())))?;
        let mut process = Self {
            admin: AdminClient::new(opts.admin_socket()),
            instance_id: String::new(),
            log: log_path.clone(),
            child: {
                let stdout = child.stdout.take().expect("piped");
                wait_ready(stdout, opts.ready_timeout).map_err(|reason| {
                    let _ = child.kill();
                    let _ = child.wait();
                    EmulatorError::NotReady {
                        binary: binary.clone(),
                        reason,
                        log_tail: log_tail(&log_path),
                    }
                })?;
                child
            },
        };
        process.admin.health()?;
        process.instance_id = process.admin.run_instance(&RunInstanceRequest {
            instance_type: opts.instance_type.clone(),
            subnet_id: LAB_NODE_SUBNET_ID.to_owned(),
            private_ip: Some(NODE_PRIMARY_ADDR),
            image_id: None,
        })?;
        info!(instance = %process.instance_id, "the EC2 emulator is ready; the node's instance runs");
        Ok(process)
    }

    /// The node's instance id.
    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// The admin client.
    pub fn admin(&self) -> &AdminClient {
        &self.admin
    }

    /// The emulator's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Lets the emulator outlive this value and this process (a lab left
    /// running); it is then killed through its pid file.
    pub fn leave_running(self) {
        std::mem::forget(self);
    }

    /// The emulator's log.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// The environment the agent needs to use this emulator.
    pub fn agent_env() -> Vec<(&'static str, &'static str)> {
        vec![
            ("AWS_ENDPOINT_URL_EC2", EC2_ENDPOINT_URL),
            ("AWS_EC2_METADATA_SERVICE_ENDPOINT", IMDS_ENDPOINT_URL),
        ]
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for EmulatorProcess {
    fn drop(&mut self) {
        // SIGKILL: the emulator keeps nothing worth a clean shutdown.
        if let Err(err) = self.child.kill() {
            warn!(%err, "killing the EC2 emulator");
        }
        let _ = self.child.wait();
    }
}
