//! The built `vpcnet-cni` binary, run as a container runtime runs it: in a
//! "node" network namespace (`nsenter --net`), for a "pod" namespace, both
//! made here (`vpcnet-cnitest-*`, deleted by their guards), against a fake
//! agent served on a temporary Unix socket that answers from canned state
//! and records every call.
//!
//! Every failure case checks the spec's code and message and that neither
//! namespace changed (`ip -br link`, `ip -br addr`, `ip route`, `ip neigh`
//! before and after). Run as root, one test at a time
//! (`cargo test -p vpcnet-cni -- --test-threads=1`); each test holds
//! `vpcnet_lab::serial()` so no other suite's lab runs meanwhile.

use std::{
    collections::BTreeMap,
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use serde_json::{Value, json};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};
use vpcnet_api::cni::{
    AddNetworkReply, AddNetworkRequest, Attachment, CheckNetworkReply, CheckNetworkRequest,
    DelNetworkReply, DelNetworkRequest, IpamStatusReply, IpamStatusRequest, ListAttachmentsReply,
    ListAttachmentsRequest, PodKey, StatusReply, StatusRequest,
    cni_backend_server::{CniBackend, CniBackendServer},
};

const BIN: &str = env!("CARGO_BIN_EXE_vpcnet-cni");

/// The binary under test: `VPCNET_CNI_BIN` (e.g. a release build, for
/// timings) or the one cargo built with the test.
fn bin() -> String {
    std::env::var("VPCNET_CNI_BIN").unwrap_or_else(|_| BIN.to_owned())
}
/// Every namespace of this suite starts with this.
const NS_PREFIX: &str = "vpcnet-cnitest-";
/// The host veth of default/pod-0 (`vpcnet_api::pod::host_veth_name`).
const POD0_VETH: &str = "enic220f2ba281";
const NETWORK: &str = "aws-cni";

// ---------------------------------------------------------------- netns

/// A network namespace of this suite, deleted when dropped.
struct Netns {
    name: String,
}

fn ip(args: &[&str]) -> String {
    let output = Command::new("ip").args(args).output().expect("running ip");
    assert!(
        output.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("ip prints UTF-8")
}

impl Netns {
    fn new(role: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("{NS_PREFIX}{role}{n}-{}", std::process::id());
        ip(&["netns", "add", &name]);
        Self { name }
    }

    fn path(&self) -> String {
        format!("/var/run/netns/{}", self.name)
    }

    fn ip(&self, args: &[&str]) -> String {
        let mut full = vec!["-n", &self.name];
        full.extend_from_slice(args);
        ip(&full)
    }

    /// The link named `name` as `ip -j` has it, if there is one.
    fn link(&self, name: &str) -> Option<Value> {
        let output = Command::new("ip")
            .args(["-j", "-n", &self.name, "link", "show", "dev", name])
            .output()
            .expect("running ip");
        if !output.status.success() {
            return None;
        }
        let links: Value = serde_json::from_slice(&output.stdout).expect("ip -j prints JSON");
        links.as_array().and_then(|links| links.first()).cloned()
    }

    /// What a failed command must leave as it was.
    fn snapshot(&self) -> String {
        [
            self.ip(&["-br", "link"]),
            self.ip(&["-br", "-4", "addr"]),
            self.ip(&["route", "show", "table", "all"]),
            self.ip(&["neigh"]),
        ]
        .join("--\n")
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Deletes namespaces a crashed run of this suite left (under the lock).
fn sweep_stale_namespaces() {
    for line in ip(&["netns", "list"]).lines() {
        if let Some(name) = line.split_whitespace().next()
            && name.starts_with(NS_PREFIX)
        {
            let _ = Command::new("ip").args(["netns", "del", name]).output();
        }
    }
}

fn link_flags(link: &Value) -> Vec<String> {
    link["flags"]
        .as_array()
        .map(|flags| {
            flags
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

fn link_mac(link: &Value) -> String {
    link["address"].as_str().unwrap_or_default().to_owned()
}

fn is_local_unicast(mac: &str) -> bool {
    u8::from_str_radix(&mac[..2], 16).is_ok_and(|first| first & 0x03 == 0x02)
}

// ---------------------------------------------------------------- fake agent

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum AddMode {
    /// Addresses from 10.20.11.20 up, the same one again for the same key.
    #[default]
    Assign,
    /// `INVALID_ARGUMENT`, as for a request the agent cannot serve.
    Refuse,
    /// `RESOURCE_EXHAUSTED`: no address left.
    Exhausted,
    /// Never answers.
    Hang,
    /// Answers with something that is not an address.
    BadAddress,
}

#[derive(Clone, Debug)]
struct Record {
    pod: PodKey,
    addr: String,
    host_veth: String,
}

type Key = (String, String, String);

fn key_of(pod: &PodKey) -> Key {
    (
        pod.network_name.clone(),
        pod.container_id.clone(),
        pod.if_name.clone(),
    )
}

#[derive(Debug, Default)]
struct FakeState {
    add_mode: AddMode,
    next_host: u8,
    records: BTreeMap<Key, Record>,
    /// One line per call: "`AddNetwork` <container> <ifname> veth=<host veth>"...
    calls: Vec<String>,
    /// The last `AddNetwork` request.
    last_add: Option<AddNetworkRequest>,
    ready: bool,
    reason: String,
}

#[derive(Clone, Default)]
struct Fake(Arc<Mutex<FakeState>>);

impl Fake {
    fn state(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[tonic::async_trait]
impl CniBackend for Fake {
    async fn add_network(
        &self,
        request: Request<AddNetworkRequest>,
    ) -> Result<Response<AddNetworkReply>, Status> {
        let request = request.into_inner();
        let pod = request.pod.clone().unwrap_or_default();
        let mode = {
            let mut state = self.state();
            state.calls.push(format!(
                "AddNetwork {} {} veth={}",
                pod.container_id, pod.if_name, request.host_veth
            ));
            state.last_add = Some(request.clone());
            state.add_mode
        };
        match mode {
            AddMode::Hang => std::future::pending().await,
            AddMode::Refuse => Err(Status::invalid_argument(
                "branch-ENI pods are not served by this agent",
            )),
            AddMode::Exhausted => Err(Status::resource_exhausted(
                "no free address: the node has 29 pods, its maximum",
            )),
            AddMode::BadAddress => Ok(Response::new(AddNetworkReply {
                ipv4_addr: "ten.twenty".into(),
                ..AddNetworkReply::default()
            })),
            AddMode::Assign => {
                let mut state = self.state();
                let key = key_of(&pod);
                let addr = if let Some(record) = state.records.get(&key) {
                    record.addr.clone()
                } else {
                    let addr = format!("10.20.11.{}", 20 + state.next_host);
                    state.next_host += 1;
                    addr
                };
                state.records.insert(
                    key,
                    Record {
                        pod,
                        addr: addr.clone(),
                        host_veth: request.host_veth,
                    },
                );
                Ok(Response::new(AddNetworkReply {
                    ipv4_addr: addr,
                    eni_id: "eni-0a1b2c3d4e5f60718".into(),
                    device_number: 0,
                    subnet_prefix_len: 24,
                    subnet_gateway: "10.20.11.1".into(),
                    mtu: 9001,
                    branch_eni: false,
                }))
            }
        }
    }

    async fn del_network(
        &self,
        request: Request<DelNetworkRequest>,
    ) -> Result<Response<DelNetworkReply>, Status> {
        let request = request.into_inner();
        let pod = request.pod.unwrap_or_default();
        let mut state = self.state();
        state.calls.push(format!(
            "DelNetwork {} {} veth={}",
            pod.container_id, pod.if_name, request.host_veth
        ));
        let released = state.records.remove(&key_of(&pod));
        Ok(Response::new(DelNetworkReply {
            ipv4_addr: released.map(|r| r.addr).unwrap_or_default(),
        }))
    }

    async fn check_network(
        &self,
        request: Request<CheckNetworkRequest>,
    ) -> Result<Response<CheckNetworkReply>, Status> {
        let pod = request.into_inner().pod.unwrap_or_default();
        let mut state = self.state();
        state
            .calls
            .push(format!("CheckNetwork {} {}", pod.container_id, pod.if_name));
        let reply = state
            .records
            .get(&key_of(&pod))
            .map(|record| CheckNetworkReply {
                ipv4_addr: record.addr.clone(),
                host_veth: record.host_veth.clone(),
                problem: String::new(),
            })
            .unwrap_or_default();
        Ok(Response::new(reply))
    }

    async fn list_attachments(
        &self,
        _: Request<ListAttachmentsRequest>,
    ) -> Result<Response<ListAttachmentsReply>, Status> {
        let mut state = self.state();
        state.calls.push("ListAttachments".into());
        let attachments = state
            .records
            .values()
            .map(|record| Attachment {
                pod: Some(record.pod.clone()),
                ipv4_addr: record.addr.clone(),
                host_veth: record.host_veth.clone(),
            })
            .collect();
        Ok(Response::new(ListAttachmentsReply { attachments }))
    }

    async fn status(&self, _: Request<StatusRequest>) -> Result<Response<StatusReply>, Status> {
        let mut state = self.state();
        state.calls.push("Status".into());
        Ok(Response::new(StatusReply {
            ready: state.ready,
            reason: state.reason.clone(),
            available_addrs: if state.ready { 14 } else { 0 },
        }))
    }

    async fn ipam_status(
        &self,
        _: Request<IpamStatusRequest>,
    ) -> Result<Response<IpamStatusReply>, Status> {
        Err(Status::unimplemented("not faked"))
    }
}

/// The fake agent serving on a socket of its own.
struct FakeAgent {
    fake: Fake,
    socket: PathBuf,
    runtime: Option<tokio::runtime::Runtime>,
}

impl FakeAgent {
    fn start(dir: &Path) -> Self {
        let socket = dir.join("cni.sock");
        let fake = Fake::default();
        fake.state().ready = true;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime for the fake agent");
        let listener = {
            let _guard = runtime.enter();
            tokio::net::UnixListener::bind(&socket).expect("binding the fake agent's socket")
        };
        runtime.spawn(
            tonic::transport::Server::builder()
                .add_service(CniBackendServer::new(fake.clone()))
                .serve_with_incoming(UnixListenerStream::new(listener)),
        );
        Self {
            fake,
            socket,
            runtime: Some(runtime),
        }
    }

    /// The agent goes away: its socket with it.
    fn stop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
            let _ = std::fs::remove_file(&self.socket);
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.fake.state()
    }

    fn calls(&self) -> Vec<String> {
        self.state().calls.clone()
    }

    fn take_calls(&self) -> Vec<String> {
        std::mem::take(&mut self.state().calls)
    }

    fn records(&self) -> Vec<Record> {
        self.state().records.values().cloned().collect()
    }
}

impl Drop for FakeAgent {
    fn drop(&mut self) {
        self.stop();
    }
}

// ---------------------------------------------------------------- the plugin

/// One execution of the plugin.
#[derive(Debug)]
struct Run {
    status: i32,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {self:?}"))
    }

    fn ok(&self) -> &Self {
        assert_eq!(self.status, 0, "the plugin failed: {self:#?}");
        self
    }

    /// Asserts the spec's error object with `code` and a `msg` containing
    /// `msg`; returns it.
    fn error(&self, code: u64, msg: &str) -> Value {
        assert_ne!(self.status, 0, "the plugin succeeded: {self:#?}");
        let error = self.json();
        assert_eq!(error["code"], code, "{self:#?}");
        let text = error["msg"].as_str().unwrap_or_default();
        assert!(text.contains(msg), "msg {text:?} lacks {msg:?}: {self:#?}");
        assert!(error["cniVersion"].is_string(), "{error}");
        assert!(error["details"].is_string(), "{error}");
        error
    }
}

/// The attachment environment of one container.
#[derive(Clone, Debug)]
struct Attach {
    container: String,
    ifname: String,
    netns: String,
    args: String,
}

impl Attach {
    fn pod(container: &str, netns: &Netns, pod: &str) -> Self {
        Self {
            container: container.into(),
            ifname: "eth0".into(),
            netns: netns.path(),
            args: format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={pod};K8S_POD_INFRA_CONTAINER_ID={container};K8S_POD_UID=0f1e2d3c"
            ),
        }
    }
}

/// Runs the plugin in `node` with `env` (besides `CNI_PATH`) and `stdin`.
fn exec(node: &Netns, env: &[(&str, &str)], stdin: &[u8]) -> Run {
    let started = Instant::now();
    let mut child = Command::new("nsenter")
        .arg(format!("--net={}", node.path()))
        .arg(bin())
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("CNI_PATH", "/opt/cni/bin")
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the plugin");
    // A plugin that rejects its environment exits without reading its
    // input, as it may: a closed pipe is not an error here.
    match child.stdin.take().expect("piped stdin").write_all(stdin) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        Err(e) => panic!("writing the config: {e}"),
    }
    let output = child.wait_with_output().expect("waiting for the plugin");
    Run {
        status: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).trim().to_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        elapsed: started.elapsed(),
    }
}

/// A node, a pod, a fake agent and a log file; the lab lock is held
/// until the end (the last field drops last).
struct Fixture {
    node: Netns,
    pod: Netns,
    agent: FakeAgent,
    dir: tempfile::TempDir,
    _lock: vpcnet_lab::LabLock,
}

impl Fixture {
    fn new() -> Self {
        let lock = vpcnet_lab::serial();
        sweep_stale_namespaces();
        let dir = tempfile::tempdir().expect("a temporary directory");
        Self {
            node: Netns::new("node"),
            pod: Netns::new("pod"),
            agent: FakeAgent::start(dir.path()),
            dir,
            _lock: lock,
        }
    }

    fn log_file(&self) -> PathBuf {
        self.dir.path().join("log").join("plugin.log")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_file()).unwrap_or_default()
    }

    /// The conflist's plugin object as the runtime derives it.
    fn conf(&self, version: &str) -> Value {
        json!({
            "cniVersion": version,
            "name": NETWORK,
            "type": "vpcnet-cni",
            "agentSocket": self.agent.socket,
            "agentTimeoutSeconds": 5,
            "logFile": self.log_file(),
            "logLevel": "debug",
            "runtimeConfig": {
                "io.kubernetes.cri.pod-annotations": {"kubernetes.io/config.source": "api"}
            }
        })
    }

    fn pod0(&self) -> Attach {
        Attach::pod("c0ffee01", &self.pod, "pod-0")
    }

    fn cni(&self, command: &str, attach: Option<&Attach>, conf: &Value) -> Run {
        let mut env = vec![("CNI_COMMAND", command)];
        if let Some(a) = attach {
            env.extend([
                ("CNI_CONTAINERID", a.container.as_str()),
                ("CNI_IFNAME", a.ifname.as_str()),
                ("CNI_NETNS", a.netns.as_str()),
                ("CNI_ARGS", a.args.as_str()),
            ]);
        }
        exec(&self.node, &env, conf.to_string().as_bytes())
    }

    fn snapshots(&self) -> (String, String) {
        (self.node.snapshot(), self.pod.snapshot())
    }

    fn assert_unchanged(&self, before: &(String, String)) {
        let after = self.snapshots();
        assert_eq!(before.0, after.0, "the node changed");
        assert_eq!(before.1, after.1, "the pod changed");
    }
}

fn with_prev(conf: &Value, prev: &Value) -> Value {
    let mut conf = conf.clone();
    conf["prevResult"] = prev.clone();
    conf
}

// ---------------------------------------------------------------- tests

#[test]
fn version_needs_no_config() {
    let fx = Fixture::new();
    let run = exec(&fx.node, &[("CNI_COMMAND", "VERSION")], b"");
    run.ok();
    assert_eq!(
        run.json(),
        json!({"cniVersion": "1.1.0", "supportedVersions": ["0.3.1", "0.4.0", "1.0.0", "1.1.0"]})
    );
}

#[test]
fn bad_environment_and_input_change_nothing() {
    let fx = Fixture::new();
    let before = fx.snapshots();
    let conf = fx.conf("1.1.0");
    let pod = fx.pod0();

    exec(&fx.node, &[], b"{}").error(4, "required env variables [CNI_COMMAND] missing");
    exec(&fx.node, &[("CNI_COMMAND", "ADDD")], b"{}").error(4, "invalid CNI_COMMAND");
    let run = exec(
        &fx.node,
        &[("CNI_COMMAND", "ADD")],
        conf.to_string().as_bytes(),
    );
    let error = run.error(
        4,
        "required env variables [CNI_CONTAINERID,CNI_NETNS,CNI_IFNAME] missing",
    );
    // The error answers in the config's version.
    assert_eq!(error["cniVersion"], "1.1.0");
    let mut bad = pod.clone();
    bad.container = "../etc".into();
    fx.cni("ADD", Some(&bad), &conf)
        .error(4, "invalid characters in CNI_CONTAINERID");
    let mut bad = pod.clone();
    bad.ifname = "eth0:1".into();
    fx.cni("ADD", Some(&bad), &conf)
        .error(4, "invalid CNI_IFNAME");
    let mut bad = pod.clone();
    bad.args = "K8S_POD_NAME=pod-0;COLOR=blue".into();
    let error = fx
        .cni("ADD", Some(&bad), &conf)
        .error(4, "invalid CNI_ARGS");
    assert!(
        error["details"].as_str().unwrap().contains("COLOR=blue"),
        "{error}"
    );

    let run = exec(
        &fx.node,
        &[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_NETNS", &fx.pod.path()),
        ],
        b"{\"cniVersion\": \"1.1.0\", ",
    );
    run.error(6, "failed to decode the network config");

    let mut old = conf.clone();
    old["cniVersion"] = json!("0.2.0");
    let error = fx
        .cni("ADD", Some(&pod), &old)
        .error(1, "incompatible CNI versions");
    assert!(
        error["details"]
            .as_str()
            .unwrap()
            .contains("0.3.1, 0.4.0, 1.0.0, 1.1.0"),
        "{error}"
    );

    let mut no_name = conf.clone();
    no_name.as_object_mut().unwrap().remove("name");
    fx.cni("ADD", Some(&pod), &no_name)
        .error(7, "missing network name");
    let mut bad_mtu = conf.clone();
    bad_mtu["mtu"] = json!("jumbo");
    fx.cni("ADD", Some(&pod), &bad_mtu).error(7, "invalid mtu");
    let mut ipam = conf.clone();
    ipam["ipam"] = json!({"type": "host-local"});
    fx.cni("ADD", Some(&pod), &ipam).error(2, "ipam");

    // A prevResult that is not a result.
    let bad_prev = with_prev(&conf, &json!({"ips": [{"address": "10.20.11.20"}]}));
    fx.cni("CHECK", Some(&pod), &bad_prev)
        .error(6, "failed to decode prevResult");
    fx.cni("ADD", Some(&pod), &bad_prev)
        .error(6, "failed to decode prevResult");
    fx.cni("CHECK", Some(&pod), &with_prev(&conf, &json!("eth0")))
        .error(6, "failed to decode prevResult");
    fx.cni("CHECK", Some(&pod), &conf)
        .error(7, "required prevResult missing");

    fx.assert_unchanged(&before);
    assert!(fx.agent.calls().is_empty(), "{:?}", fx.agent.calls());
}

#[test]
fn a_missing_or_wrong_namespace_is_refused() {
    let fx = Fixture::new();
    let before = fx.snapshots();
    let mut pod = fx.pod0();
    pod.netns = format!("/var/run/netns/{NS_PREFIX}missing");
    let error = fx
        .cni("ADD", Some(&pod), &fx.conf("1.0.0"))
        .error(3, "network namespace does not exist");
    assert_eq!(error["cniVersion"], "1.0.0");
    // The node's own namespace is not a pod's.
    pod.netns = fx.node.path();
    fx.cni("ADD", Some(&pod), &fx.conf("1.0.0"))
        .error(4, "the plugin's own network namespace");
    // Nor is a file that is no namespace.
    pod.netns = fx
        .log_file()
        .parent()
        .unwrap()
        .join("x")
        .display()
        .to_string();
    std::fs::create_dir_all(fx.log_file().parent().unwrap()).unwrap();
    std::fs::write(&pod.netns, b"").unwrap();
    fx.cni("ADD", Some(&pod), &fx.conf("1.0.0"))
        .error(4, "not a network namespace");
    fx.assert_unchanged(&before);
    // DEL never takes the node's own interface of that name.
    fx.node.ip(&[
        "link", "add", "eth0", "type", "veth", "peer", "name", "eth0peer",
    ]);
    let before = fx.snapshots();
    pod.netns = fx.node.path();
    fx.cni("DEL", Some(&pod), &fx.conf("1.0.0"))
        .error(4, "the plugin's own network namespace");
    fx.assert_unchanged(&before);
    assert!(fx.agent.calls().is_empty(), "{:?}", fx.agent.calls());
}

#[test]
fn add_when_the_interface_exists_changes_nothing() {
    let fx = Fixture::new();
    // (A veth: the kernel may have no dummy driver.)
    fx.pod.ip(&[
        "link", "add", "eth0", "type", "veth", "peer", "name", "eth0peer",
    ]);
    let before = fx.snapshots();
    let error = fx
        .cni("ADD", Some(&fx.pod0()), &fx.conf("1.1.0"))
        .error(100, "interface eth0 exists already");
    assert_eq!(error["details"], fx.pod.path());
    fx.assert_unchanged(&before);
    assert!(fx.agent.calls().is_empty(), "{:?}", fx.agent.calls());
}

#[test]
fn add_with_the_agent_down_changes_nothing() {
    let mut fx = Fixture::new();
    fx.agent.stop();
    let before = fx.snapshots();
    let error = fx
        .cni("ADD", Some(&fx.pod0()), &fx.conf("1.1.0"))
        .error(11, "the vpcnet agent is not available");
    let details = error["details"].as_str().unwrap();
    assert!(details.contains("cni.sock"), "{details}");
    fx.assert_unchanged(&before);
}

#[test]
fn add_with_a_silent_agent_times_out_and_undoes() {
    let fx = Fixture::new();
    fx.agent.state().add_mode = AddMode::Hang;
    let before = fx.snapshots();
    let mut conf = fx.conf("1.1.0");
    conf["agentTimeoutSeconds"] = json!(1);
    let run = fx.cni("ADD", Some(&fx.pod0()), &conf);
    let error = run.error(11, "the vpcnet agent is not available");
    assert!(
        error["details"]
            .as_str()
            .unwrap()
            .contains("did not answer AddNetwork within 1s"),
        "{error}"
    );
    assert!(run.elapsed >= Duration::from_secs(1), "{:?}", run.elapsed);
    assert!(run.elapsed < Duration::from_secs(4), "{:?}", run.elapsed);
    fx.assert_unchanged(&before);
    // The agent may have assigned before going quiet: it is told to release.
    assert_eq!(
        fx.agent.calls(),
        [
            format!("AddNetwork c0ffee01 eth0 veth={POD0_VETH}"),
            format!("DelNetwork c0ffee01 eth0 veth={POD0_VETH}"),
        ]
    );
}

#[test]
fn add_refused_by_the_agent_changes_nothing() {
    let fx = Fixture::new();
    fx.agent.state().add_mode = AddMode::Refuse;
    let before = fx.snapshots();
    let error = fx
        .cni("ADD", Some(&fx.pod0()), &fx.conf("1.1.0"))
        .error(102, "the vpcnet agent refused");
    let details = error["details"].as_str().unwrap();
    assert!(details.contains("InvalidArgument"), "{details}");
    assert!(
        details.contains("branch-ENI pods are not served by this agent"),
        "{details}"
    );
    fx.assert_unchanged(&before);
    // A refusal holds nothing: no DelNetwork.
    assert_eq!(
        fx.agent.take_calls(),
        [format!("AddNetwork c0ffee01 eth0 veth={POD0_VETH}")]
    );

    fx.agent.state().add_mode = AddMode::Exhausted;
    let error = fx
        .cni("ADD", Some(&fx.pod0()), &fx.conf("1.1.0"))
        .error(103, "no address available");
    assert!(
        error["details"].as_str().unwrap().contains("its maximum"),
        "{error}"
    );
    fx.assert_unchanged(&before);

    // An answer without an address: what was made is undone, the agent
    // told to release.
    fx.agent.take_calls();
    fx.agent.state().add_mode = AddMode::BadAddress;
    fx.cni("ADD", Some(&fx.pod0()), &fx.conf("1.1.0"))
        .error(102, "without a valid address");
    fx.assert_unchanged(&before);
    assert_eq!(
        fx.agent.calls(),
        [
            format!("AddNetwork c0ffee01 eth0 veth={POD0_VETH}"),
            format!("DelNetwork c0ffee01 eth0 veth={POD0_VETH}"),
        ]
    );
}

#[test]
fn del_of_an_unknown_container_and_del_twice_succeed() {
    let fx = Fixture::new();
    let before = fx.snapshots();
    let pod = Attach::pod("deadbeef", &fx.pod, "never-added");
    let conf = fx.conf("1.1.0");
    let run = fx.cni("DEL", Some(&pod), &conf);
    run.ok();
    assert_eq!(run.stdout, "");
    fx.cni("DEL", Some(&pod), &conf).ok();
    // Without a namespace at all, and with one that is gone.
    let mut gone = pod.clone();
    gone.netns = String::new();
    fx.cni("DEL", Some(&gone), &conf).ok();
    gone.netns = format!("/var/run/netns/{NS_PREFIX}gone");
    fx.cni("DEL", Some(&gone), &conf).ok();
    fx.assert_unchanged(&before);
    // Every DEL told the agent.
    let dels = fx
        .agent
        .calls()
        .iter()
        .filter(|call| call.starts_with("DelNetwork deadbeef eth0"))
        .count();
    assert_eq!(dels, 4, "{:?}", fx.agent.calls());
}

/// What ADD must have made for pod-0 with `addr`; returns the host veth's
/// and the pod interface's MACs.
fn assert_wired(fx: &Fixture, addr: &str) -> (String, String) {
    let host = fx.node.link(POD0_VETH).expect("the host veth exists");
    assert!(link_flags(&host).contains(&"UP".to_owned()), "{host}");
    assert_eq!(host["mtu"], 9001, "{host}");
    let host_mac = link_mac(&host);
    let routes = fx.node.ip(&["route"]);
    assert!(
        routes.contains(&format!("{addr} dev {POD0_VETH} scope link")),
        "{routes}"
    );

    let eth0 = fx.pod.link("eth0").expect("eth0 in the pod");
    assert!(link_flags(&eth0).contains(&"UP".to_owned()), "{eth0}");
    assert_eq!(eth0["mtu"], 9001, "{eth0}");
    let pod_mac = link_mac(&eth0);
    assert!(is_local_unicast(&host_mac), "{host_mac}");
    assert!(is_local_unicast(&pod_mac), "{pod_mac}");
    assert_ne!(host_mac, pod_mac);
    let lo = fx.pod.link("lo").unwrap();
    assert!(link_flags(&lo).contains(&"UP".to_owned()), "{lo}");
    let addrs = fx.pod.ip(&["-br", "-4", "addr", "show", "dev", "eth0"]);
    let addrs: Vec<&str> = addrs.split_whitespace().skip(2).collect();
    assert_eq!(addrs, [format!("{addr}/32")]);
    let routes = fx.pod.ip(&["route"]);
    assert!(
        routes.contains("default via 169.254.1.1 dev eth0"),
        "{routes}"
    );
    assert!(
        routes.contains("169.254.1.1 dev eth0 scope link"),
        "{routes}"
    );
    let neigh = fx.pod.ip(&["neigh"]);
    assert!(
        neigh.contains(&format!("169.254.1.1 dev eth0 lladdr {host_mac} PERMANENT")),
        "{neigh}"
    );
    (host_mac, pod_mac)
}

/// What the agent was asked on ADD of pod-0.
fn assert_asked(fx: &Fixture, pod_mac: &str) {
    let asked = fx.agent.state().last_add.clone().unwrap();
    let key = asked.pod.clone().unwrap();
    assert_eq!(
        (
            key.network_name.as_str(),
            key.container_id.as_str(),
            key.if_name.as_str(),
            key.k8s_pod_namespace.as_str(),
            key.k8s_pod_name.as_str()
        ),
        (NETWORK, "c0ffee01", "eth0", "default", "pod-0")
    );
    assert_eq!(asked.netns, fx.pod.path());
    assert_eq!(asked.host_veth, POD0_VETH);
    assert_eq!(asked.pod_mac, pod_mac);
    assert_eq!(asked.annotations["kubernetes.io/config.source"], "api");
}

#[test]
fn add_check_del_1_1_0() {
    let fx = Fixture::new();
    let node_before = fx.node.snapshot();
    let conf = fx.conf("1.1.0");
    let pod = fx.pod0();

    let add = fx.cni("ADD", Some(&pod), &conf);
    add.ok();
    let result = add.json();
    let (host_mac, pod_mac) = assert_wired(&fx, "10.20.11.20");
    assert_eq!(
        result,
        json!({
            "cniVersion": "1.1.0",
            "interfaces": [
                {"name": POD0_VETH, "mac": host_mac},
                {"name": "eth0", "mac": pod_mac, "sandbox": fx.pod.path()}
            ],
            "ips": [{"address": "10.20.11.20/32", "gateway": "169.254.1.1", "interface": 1}],
            "routes": [{"dst": "0.0.0.0/0", "gw": "169.254.1.1"}],
            "dns": {}
        })
    );
    assert_asked(&fx, &pod_mac);

    // CHECK: as ADD left it.
    let checked = with_prev(&conf, &result);
    let check = fx.cni("CHECK", Some(&pod), &checked);
    check.ok();
    assert_eq!(check.stdout, "");
    // The agent's record must agree.
    fx.agent
        .state()
        .records
        .values_mut()
        .for_each(|record| record.addr = "10.20.11.99".into());
    fx.cni("CHECK", Some(&pod), &checked).error(
        105,
        "the vpcnet agent holds 10.20.11.99 for the attachment, prevResult has 10.20.11.20",
    );
    fx.agent
        .state()
        .records
        .values_mut()
        .for_each(|record| record.addr = "10.20.11.20".into());
    // A route gone is reported.
    fx.pod.ip(&["route", "del", "default"]);
    fx.cni("CHECK", Some(&pod), &checked).error(
        105,
        "the container has no route default via 169.254.1.1 dev eth0",
    );
    fx.pod.ip(&[
        "route",
        "add",
        "default",
        "via",
        "169.254.1.1",
        "dev",
        "eth0",
    ]);
    fx.cni("CHECK", Some(&pod), &checked).ok();
    // So is the neighbour entry.
    fx.pod.ip(&["neigh", "del", "169.254.1.1", "dev", "eth0"]);
    fx.cni("CHECK", Some(&pod), &checked).error(
        105,
        "the container has no neighbour entry for 169.254.1.1 on eth0",
    );

    fx.agent.take_calls();
    let del = fx.cni("DEL", Some(&pod), &checked);
    del.ok();
    assert_eq!(del.stdout, "");
    assert!(fx.node.link(POD0_VETH).is_none());
    assert!(fx.pod.link("eth0").is_none());
    assert_eq!(
        fx.node.snapshot(),
        node_before,
        "DEL left something on the node"
    );
    assert!(fx.agent.records().is_empty());
    assert_eq!(
        fx.agent.calls(),
        [
            "CheckNetwork c0ffee01 eth0".to_owned(),
            format!("DelNetwork c0ffee01 eth0 veth={POD0_VETH}"),
        ]
    );
    // One log line per command, on stderr and in the log file.
    for line in [&add.stderr, &fx.log()] {
        assert!(
            line.contains(r#"ok command="ADD" container="c0ffee01""#)
                && line.contains(r#"pod="default/pod-0""#),
            "{line}"
        );
    }
    // And again, as runtimes do.
    fx.cni("DEL", Some(&pod), &checked).ok();
    eprintln!(
        "timings (plugin exec to exit): ADD {:?}, CHECK {:?}, DEL {:?}",
        add.elapsed, check.elapsed, del.elapsed
    );
}

#[test]
fn add_del_0_3_1() {
    let fx = Fixture::new();
    let node_before = fx.node.snapshot();
    let conf = fx.conf("0.3.1");
    let pod = fx.pod0();
    let add = fx.cni("ADD", Some(&pod), &conf);
    add.ok();
    let result = add.json();
    let (host_mac, pod_mac) = assert_wired(&fx, "10.20.11.20");
    assert_eq!(
        result,
        json!({
            "cniVersion": "0.3.1",
            "interfaces": [
                {"name": POD0_VETH, "mac": host_mac},
                {"name": "eth0", "mac": pod_mac, "sandbox": fx.pod.path()}
            ],
            "ips": [{"version": "4", "address": "10.20.11.20/32", "gateway": "169.254.1.1", "interface": 1}],
            "routes": [{"dst": "0.0.0.0/0", "gw": "169.254.1.1"}],
            "dns": {}
        })
    );
    // 0.3.1 has no CHECK.
    fx.cni("CHECK", Some(&pod), &with_prev(&conf, &result))
        .error(1, "config version does not allow CHECK");
    // A 0.4.0 prevResult (with "version") checks fine.
    let mut v040 = with_prev(&fx.conf("0.4.0"), &result);
    v040["prevResult"]["cniVersion"] = json!("0.4.0");
    fx.cni("CHECK", Some(&pod), &v040).ok();
    // 0.3.1 runtimes pass no prevResult on DEL.
    let del = fx.cni("DEL", Some(&pod), &conf);
    del.ok();
    assert!(fx.node.link(POD0_VETH).is_none());
    assert!(fx.pod.link("eth0").is_none());
    assert_eq!(fx.node.snapshot(), node_before);
    eprintln!(
        "timings (plugin exec to exit): ADD {:?}, DEL {:?}",
        add.elapsed, del.elapsed
    );
}

#[test]
fn del_tears_down_without_the_agent() {
    let mut fx = Fixture::new();
    let node_before = fx.node.snapshot();
    let conf = fx.conf("1.1.0");
    let pod = fx.pod0();
    let result = fx.cni("ADD", Some(&pod), &conf).ok().json();
    fx.agent.stop();
    fx.cni("DEL", Some(&pod), &with_prev(&conf, &result)).ok();
    assert!(fx.node.link(POD0_VETH).is_none());
    assert!(fx.pod.link("eth0").is_none());
    assert_eq!(fx.node.snapshot(), node_before);
    assert!(
        fx.log().contains("tearing down without the agent"),
        "{}",
        fx.log()
    );
    // An agent that accepts connections and never answers is the same as
    // none, after agentTimeoutSeconds.
    fx.agent = FakeAgent::start(fx.dir.path());
    fx.cni("ADD", Some(&pod), &conf).ok();
    fx.agent.stop();
    let _silent = std::os::unix::net::UnixListener::bind(&fx.agent.socket).unwrap();
    let mut quick = conf.clone();
    quick["agentTimeoutSeconds"] = json!(0.5);
    let run = fx.cni("DEL", Some(&pod), &quick);
    run.ok();
    assert!(run.elapsed < Duration::from_secs(3), "{:?}", run.elapsed);
    assert!(fx.node.link(POD0_VETH).is_none());
    assert_eq!(fx.node.snapshot(), node_before);
}

#[test]
fn del_after_the_namespace_is_gone() {
    let fx = Fixture::new();
    let node_before = fx.node.snapshot();
    let conf = fx.conf("1.1.0");
    let pod = fx.pod0();
    let result = fx.cni("ADD", Some(&pod), &conf).ok().json();
    // The runtime deletes the namespace; the veth pair goes with it.
    ip(&["netns", "del", &fx.pod.name]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while fx.node.link(POD0_VETH).is_some() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    fx.cni("DEL", Some(&pod), &with_prev(&conf, &result)).ok();
    assert_eq!(fx.node.snapshot(), node_before);
    assert!(fx.agent.records().is_empty());
    // With CNI_NETNS empty, as some runtimes pass it then.
    let mut no_netns = pod.clone();
    no_netns.netns = String::new();
    fx.cni("DEL", Some(&no_netns), &conf).ok();
}

#[test]
fn a_late_del_of_an_old_sandbox_leaves_the_new_one_alone() {
    let fx = Fixture::new();
    let conf = fx.conf("1.1.0");
    // Sandbox 1 of default/pod-0 comes and goes; its namespace is deleted.
    let old_ns = Netns::new("oldpod");
    let old = Attach::pod("0ld5a4db0x", &old_ns, "pod-0");
    let old_result = fx.cni("ADD", Some(&old), &conf).ok().json();
    fx.cni("DEL", Some(&old), &with_prev(&conf, &old_result))
        .ok();
    drop(old_ns);
    // Sandbox 2 of the same pod: the same host veth name.
    let new = fx.pod0();
    let new_result = fx.cni("ADD", Some(&new), &conf).ok().json();
    let (host_mac, _) = assert_wired(&fx, "10.20.11.21");
    // The runtime sends sandbox 1's DEL again, without prevResult (its
    // cache is gone) and with its namespace gone.
    fx.agent.take_calls();
    fx.cni("DEL", Some(&old), &conf).ok();
    let host = fx
        .node
        .link(POD0_VETH)
        .expect("sandbox 2's veth is still there");
    assert_eq!(link_mac(&host), host_mac);
    // The agent is not told to take that veth's programs off.
    assert_eq!(
        fx.agent.calls(),
        [
            "CheckNetwork 0ld5a4db0x eth0",
            "DelNetwork 0ld5a4db0x eth0 veth="
        ]
    );
    fx.cni("CHECK", Some(&new), &with_prev(&conf, &new_result))
        .ok();
    fx.cni("DEL", Some(&new), &with_prev(&conf, &new_result))
        .ok();
}

#[test]
fn a_stale_host_veth_is_replaced_unless_another_attachment_holds_it() {
    let fx = Fixture::new();
    let conf = fx.conf("1.1.0");
    // A veth of the pod's name that nobody holds (a DEL that never ran).
    fx.node.ip(&[
        "link", "add", POD0_VETH, "type", "veth", "peer", "name", "stale0",
    ]);
    let result = fx.cni("ADD", Some(&fx.pod0()), &conf).ok().json();
    assert_wired(&fx, "10.20.11.20");
    assert!(fx.node.link("stale0").is_none(), "the stale pair is gone");
    assert!(
        fx.log().contains("deleting a stale host veth"),
        "{}",
        fx.log()
    );
    fx.cni("DEL", Some(&fx.pod0()), &with_prev(&conf, &result))
        .ok();

    // The same name held by another attachment: ADD fails, nothing moves.
    fx.node.ip(&[
        "link", "add", POD0_VETH, "type", "veth", "peer", "name", "other0",
    ]);
    fx.agent.state().records.insert(
        (NETWORK.into(), "0th3r".into(), "eth0".into()),
        Record {
            pod: PodKey {
                network_name: NETWORK.into(),
                container_id: "0th3r".into(),
                if_name: "eth0".into(),
                k8s_pod_namespace: "default".into(),
                k8s_pod_name: "pod-0".into(),
            },
            addr: "10.20.11.30".into(),
            host_veth: POD0_VETH.into(),
        },
    );
    let before = fx.snapshots();
    let error = fx
        .cni("ADD", Some(&fx.pod0()), &conf)
        .error(101, &format!("host veth {POD0_VETH} is in use"));
    assert!(
        error["details"].as_str().unwrap().contains("0th3r"),
        "{error}"
    );
    fx.assert_unchanged(&before);
}

#[test]
fn gc_removes_the_attachments_not_listed() {
    let fx = Fixture::new();
    let record = |container: &str, network: &str, veth: &str, addr: &str| {
        let pod = PodKey {
            network_name: network.into(),
            container_id: container.into(),
            if_name: "eth0".into(),
            k8s_pod_namespace: "default".into(),
            k8s_pod_name: format!("pod-{container}"),
        };
        (
            key_of(&pod),
            Record {
                pod,
                addr: addr.into(),
                host_veth: veth.into(),
            },
        )
    };
    fx.agent.state().records.extend([
        record("keep1", NETWORK, "enikeep1", "10.20.11.40"),
        record("stale1", NETWORK, "enistale1", "10.20.11.41"),
        record("elsewhere", "other-net", "enielse1", "10.20.11.42"),
    ]);
    for (veth, peer) in [
        ("enikeep1", "pkeep1"),
        ("enistale1", "pstale1"),
        ("enielse1", "pelse1"),
    ] {
        fx.node
            .ip(&["link", "add", veth, "type", "veth", "peer", "name", peer]);
    }
    let mut conf = fx.conf("1.1.0");
    conf["cni.dev/valid-attachments"] = json!([
        {"containerID": "keep1", "ifname": "eth0"},
        {"containerID": "gone-already", "ifname": "eth0"}
    ]);
    let run = fx.cni("GC", None, &conf);
    run.ok();
    assert_eq!(run.stdout, "");
    assert!(fx.node.link("enistale1").is_none());
    assert!(fx.node.link("pstale1").is_none());
    assert!(fx.node.link("enikeep1").is_some());
    assert!(fx.node.link("enielse1").is_some(), "another network's");
    assert_eq!(
        fx.agent.calls(),
        ["ListAttachments", "DelNetwork stale1 eth0 veth=enistale1"]
    );
    let mut kept: Vec<String> = fx
        .agent
        .records()
        .into_iter()
        .map(|r| r.pod.container_id)
        .collect();
    kept.sort();
    assert_eq!(kept, ["elsewhere", "keep1"]);
    assert!(
        fx.log().contains("gc: removed 1 of 1 stale attachments"),
        "{}",
        fx.log()
    );

    // GC is 1.1.0's, and needs the list.
    let mut old = conf.clone();
    old["cniVersion"] = json!("1.0.0");
    fx.cni("GC", None, &old)
        .error(1, "config version does not allow GC");
    fx.cni("GC", None, &fx.conf("1.1.0"))
        .error(7, "cni.dev/valid-attachments missing");
}

#[test]
fn status_follows_the_agent() {
    let mut fx = Fixture::new();
    let conf = fx.conf("1.1.0");
    let run = fx.cni("STATUS", None, &conf);
    run.ok();
    assert_eq!(run.stdout, "");
    {
        let mut state = fx.agent.state();
        state.ready = false;
        state.reason = "no free address and the node is at its ENI limit".into();
    }
    let error = fx.cni("STATUS", None, &conf).error(50, "cannot serve ADD");
    assert_eq!(
        error["details"],
        "no free address and the node is at its ENI limit"
    );
    let mut old = conf.clone();
    old["cniVersion"] = json!("1.0.0");
    fx.cni("STATUS", None, &old)
        .error(1, "config version does not allow STATUS");
    fx.agent.stop();
    let error = fx.cni("STATUS", None, &conf).error(50, "cannot serve ADD");
    assert!(
        error["details"].as_str().unwrap().contains("unreachable"),
        "{error}"
    );
}

/// Debian's portmap, where `containernetworking-plugins` puts it.
const DEBIAN_PORTMAP: &str = "/usr/lib/cni/portmap";

/// Runs Debian's portmap in `node`; returns its stdout.
fn portmap(node: &Netns, env: &[(&str, &str)], conf: &Value) -> String {
    let mut child = Command::new("nsenter")
        .arg(format!("--net={}", node.path()))
        .arg(DEBIAN_PORTMAP)
        .env("CNI_PATH", "/usr/lib/cni")
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(conf.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "portmap: {} {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// `deploy/10-vpcnet.conflist` run as a runtime runs a list: ADD through
/// `vpcnet-cni` then Debian's `portmap` (each given the previous result),
/// DEL in reverse; the node is as before, iptables included.
#[test]
fn the_deploy_conflist_chains_with_debians_portmap() {
    // `cargo xtask setup` installs it: missing, the chain is untested.
    assert!(
        Path::new(DEBIAN_PORTMAP).exists(),
        "no {DEBIAN_PORTMAP}: `cargo xtask setup` (or apt-get install containernetworking-plugins) installs it"
    );
    let fx = Fixture::new();
    let list_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/10-vpcnet.conflist");
    let list: Value = serde_json::from_slice(&std::fs::read(&list_path).unwrap()).unwrap();
    assert_eq!(list["name"], NETWORK);
    let plugins = list["plugins"].as_array().unwrap();
    assert_eq!(plugins[0]["type"], "vpcnet-cni");
    assert_eq!(plugins[1]["type"], "portmap");
    // The runtime's derivation: cniVersion and name from the list,
    // runtimeConfig from the capabilities, capabilities removed.
    let derive = |plugin: &Value, prev: Option<&Value>| {
        let mut conf = plugin.clone();
        let object = conf.as_object_mut().unwrap();
        object.insert("cniVersion".into(), list["cniVersion"].clone());
        object.insert("name".into(), list["name"].clone());
        if object.remove("capabilities").is_some() {
            object.insert(
                "runtimeConfig".into(),
                json!({"portMappings": [{"hostPort": 18080, "containerPort": 80, "protocol": "tcp"}]}),
            );
        }
        if plugin["type"] == "vpcnet-cni" {
            object.insert("agentSocket".into(), json!(fx.agent.socket));
            object.insert("logFile".into(), json!(fx.log_file()));
        }
        if let Some(prev) = prev {
            object.insert("prevResult".into(), prev.clone());
        }
        conf
    };
    let iptables = || {
        let out = Command::new("ip")
            .args(["netns", "exec", &fx.node.name, "iptables-save"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|line| !line.starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let node_before = fx.node.snapshot();
    let pod = fx.pod0();
    let env = |command: &'static str| {
        vec![
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", pod.container.as_str()),
            ("CNI_IFNAME", "eth0"),
            ("CNI_NETNS", pod.netns.as_str()),
            ("CNI_ARGS", pod.args.as_str()),
        ]
    };
    let portmap = |command: &'static str, conf: &Value| portmap(&fx.node, &env(command), conf);

    let ours = exec(
        &fx.node,
        &env("ADD"),
        derive(&plugins[0], None).to_string().as_bytes(),
    );
    let result = ours.ok().json();
    assert_eq!(result["cniVersion"], "1.0.0");
    let final_result: Value =
        serde_json::from_str(&portmap("ADD", &derive(&plugins[1], Some(&result)))).unwrap();
    assert_eq!(final_result["ips"], result["ips"]);
    assert_eq!(final_result["interfaces"], result["interfaces"]);
    assert!(iptables().contains("18080"), "{}", iptables());

    portmap("DEL", &derive(&plugins[1], Some(&final_result)));
    exec(
        &fx.node,
        &env("DEL"),
        derive(&plugins[0], Some(&final_result))
            .to_string()
            .as_bytes(),
    )
    .ok();
    assert_eq!(fx.node.snapshot(), node_before);
    assert!(!iptables().contains("18080"), "{}", iptables());
}
