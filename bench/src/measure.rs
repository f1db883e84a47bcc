//! Load inside the lab's namespaces: the load generator's server and
//! clients, and iperf3, each a process entered into its namespace with
//! `nsenter`, killed if dropped.

use std::{
    io::{BufRead, BufReader},
    net::SocketAddrV4,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc::{self, Receiver, RecvTimeoutError},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use vpcnet_lab::netns::netns_path;

use crate::loadgen::LoadResult;

/// How long a process may take to say it is ready (listening, connected).
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client may overrun its duration before it counts as hung.
const FINISH_GRACE: Duration = Duration::from_secs(30);

/// A process in a namespace whose standard output is read line by line on
/// a thread of its own (so waiting for a line has a bound).
struct NsProcess {
    what: String,
    child: Child,
    lines: Receiver<String>,
}

/// Which end of a flow a process is: clients run on the first CPU, servers
/// on the second, so that the two ends of an exchange never wait for each
/// other's CPU and the scheduler does not move them between runs (the
/// round-to-round noise halves on two cores).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Client,
    Server,
}

impl End {
    fn cpu(self) -> Option<usize> {
        let cpus = thread::available_parallelism().map_or(1, usize::from);
        (cpus >= 2).then_some(match self {
            Self::Client => 0,
            Self::Server => 1,
        })
    }
}

impl NsProcess {
    fn spawn(ns: &str, end: End, program: &Path, args: &[String]) -> Result<Self> {
        let what = format!("[{ns}] {} {}", program.display(), args.join(" "));
        let mut command = Command::new("nsenter");
        command
            .arg(format!("--net={}", netns_path(ns).display()))
            .arg("--");
        if let Some(cpu) = end.cpu() {
            command.args(["taskset", "--cpu-list", &cpu.to_string()]);
        }
        let mut child = command
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {what}"))?;
        let stdout = child.stdout.take().context("the child's stdout")?;
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self { what, child, lines })
    }

    /// The next line that `pred` accepts, within `timeout`.
    fn wait_line(&mut self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if pred(&line) => return Ok(line),
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => {
                    bail!("{}: nothing expected within {timeout:?}", self.what)
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let status = self.child.wait()?;
                    bail!("{}: exited ({status}) before saying it", self.what)
                }
            }
        }
    }

    /// Waits for the process to exit successfully.
    fn wait_success(&mut self) -> Result<()> {
        let status = self.child.wait()?;
        if !status.success() {
            bail!("{}: {status}", self.what);
        }
        Ok(())
    }
}

impl Drop for NsProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Where the benchmark's programs are.
#[derive(Debug, Clone)]
pub struct Tools {
    pub loadgen: PathBuf,
}

/// A load generator server in a namespace, stopped when dropped.
pub struct Server {
    _process: NsProcess,
}

impl Server {
    /// Starts `vpcnet-loadgen serve` in `ns` on `listen` and waits until it
    /// listens.
    pub fn start(tools: &Tools, ns: &str, listen: SocketAddrV4) -> Result<Self> {
        let mut process = NsProcess::spawn(
            ns,
            End::Server,
            &tools.loadgen,
            &["serve".into(), "--listen".into(), listen.to_string()],
        )?;
        process.wait_line(READY_TIMEOUT, |line| line.starts_with("listening "))?;
        Ok(Self { _process: process })
    }
}

/// What a load generator client does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Load {
    Rr,
    /// CRR, the client closing first.
    Crr,
    /// CRR, the server closing first.
    CrrServerCloses,
    Hold,
}

impl Load {
    fn subcommand(self) -> &'static str {
        match self {
            Self::Rr => "rr",
            Self::Crr | Self::CrrServerCloses => "crr",
            Self::Hold => "hold",
        }
    }
}

/// A client run's settings beyond the target.
#[derive(Debug, Clone, Copy)]
pub struct ClientRun {
    pub load: Load,
    pub duration: Duration,
    pub threads: usize,
    pub timeout: Duration,
    /// RR: the pause between two exchanges.
    pub pace: Duration,
}

/// A running load generator client.
pub struct Client {
    process: NsProcess,
    duration: Duration,
}

impl Client {
    /// Starts a client in `ns` against `to` and waits until it is ready
    /// (an RR client: connected and warmed up).
    pub fn start(tools: &Tools, ns: &str, to: SocketAddrV4, run: ClientRun) -> Result<Self> {
        let args = [
            run.load.subcommand().to_owned(),
            "--to".into(),
            to.to_string(),
            "--duration".into(),
            run.duration.as_secs_f64().to_string(),
            "--threads".into(),
            run.threads.to_string(),
            "--timeout-ms".into(),
            run.timeout.as_millis().to_string(),
            "--pace-ms".into(),
            run.pace.as_millis().to_string(),
        ];
        let mut args = args.to_vec();
        if run.load == Load::CrrServerCloses {
            args.push("--server-closes".into());
        }
        let mut process = NsProcess::spawn(ns, End::Client, &tools.loadgen, &args)?;
        process.wait_line(READY_TIMEOUT, |line| line == "ready")?;
        Ok(Self {
            process,
            duration: run.duration,
        })
    }

    /// Waits for the run to end and returns what it measured.
    pub fn finish(mut self) -> Result<LoadResult> {
        let line = self
            .process
            .wait_line(self.duration + FINISH_GRACE, |line| line.starts_with('{'))?;
        self.process.wait_success()?;
        serde_json::from_str(&line).with_context(|| format!("{}: its result", self.process.what))
    }

    /// Starts a client and waits for its result.
    pub fn run(tools: &Tools, ns: &str, to: SocketAddrV4, run: ClientRun) -> Result<LoadResult> {
        Self::start(tools, ns, to, run)?.finish()
    }
}

/// The port iperf3 listens on.
const IPERF_PORT: u16 = 5201;

/// One single-stream iperf3 TCP run from `client_ns` to the server started
/// in `server_ns` at `server`, for `duration`: what the receiver got, in
/// Gbit/s.
pub fn iperf3_stream(
    client_ns: &str,
    server_ns: &str,
    server: std::net::Ipv4Addr,
    duration: Duration,
) -> Result<f64> {
    let iperf3 = Path::new("iperf3");
    let mut server_process = NsProcess::spawn(
        server_ns,
        End::Server,
        iperf3,
        &[
            "--server".into(),
            "--one-off".into(),
            "--port".into(),
            IPERF_PORT.to_string(),
            "--forceflush".into(),
        ],
    )?;
    server_process.wait_line(READY_TIMEOUT, |line| line.contains("Server listening"))?;
    let mut client = NsProcess::spawn(
        client_ns,
        End::Client,
        iperf3,
        &[
            "--client".into(),
            server.to_string(),
            "--port".into(),
            IPERF_PORT.to_string(),
            "--time".into(),
            format!("{}", duration.as_secs_f64().ceil().max(1.0)),
            "--json".into(),
        ],
    )?;
    let mut json = String::new();
    let deadline = Instant::now() + duration + FINISH_GRACE;
    while let Ok(line) = client
        .lines
        .recv_timeout(deadline.saturating_duration_since(Instant::now()))
    {
        json.push_str(&line);
        json.push('\n');
    }
    client.wait_success()?;
    let report: serde_json::Value = serde_json::from_str(&json).context("iperf3's JSON report")?;
    let bits = report["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .with_context(|| format!("iperf3 reported no received rate: {json}"))?;
    Ok(bits / 1e9)
}
