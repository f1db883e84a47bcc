//! Pod churn through containerd's CRI with the agent killed (SIGKILL) at random
//! moments, as a node lives through an agent that crashes: kubelet keeps
//! making and removing pods (`RunPodSandbox`; `StopPodSandbox` and
//! `RemovePodSandbox`), the real plugin runs for each, and the agent dies
//! in the middle of ADDs, DELs, sweeps and EC2 calls. After every call no
//! address is held by two pods, every pod's address is one EC2 assigned to
//! the node and one the agent holds for that pod, and the node carries no
//! veth, namespace or CNI cache of a pod that is gone. At the end the
//! plugin's GC leaves the agent exactly the attachments the runtime names,
//! and once every pod is gone nothing is left on the node, in the agent
//! or with EC2.
//!
//! `VPCNET_CHURN_SEED` replays a run's choices (the kill moments are
//! timing, so they differ); `VPCNET_CHURN_OPS` changes the number of
//! operations: 500 by default (the test suite's, leaving CI room for the
//! kernel matrix), `VPCNET_CHURN_OPS=2000` for the full churn. A
//! `RunPodSandbox` or a Stop+Remove takes about 120 ms on 2 cores, the
//! checks after it 15 ms, and a restart until the agent is READY a few
//! hundred ms now that the programs verify in 0.1 s.
//!
//! Run: `cargo build --workspace --bins && cargo test -p vpcnet-bpf-tests
//! --test cri_churn -- --test-threads=1 --nocapture`.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::Write,
    net::{IpAddr, Ipv4Addr},
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicI32, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use nix::{sys::signal::Signal, unistd::Pid};
use serde_json::{Value, json};
use vpcnet_api::cni::{AddNetworkRequest, Attachment, ListAttachmentsRequest, PodKey};
use vpcnet_bpf_tests::{
    cni_plugin_binary,
    cri::{self, NodeTraces, node_traces, wait_ipam},
    ipam::{agent_log_tail, holdings, lab_lock},
};
use vpcnet_lab::{
    Lab,
    addrs::NS_NODE,
    cni_socket_file,
    cri::{CriClient, PodSpec, SandboxState},
    cri_pods, test_sizes,
};

/// The node: an m5.large holds 27 pods; churn keeps at most 15 alive.
const INSTANCE_TYPE: &str = "m5.large";
const MAX_LIVE: usize = 15;
/// Pods kept at the end, named to the plugin's GC as the valid ones.
const KEEP: usize = 3;
/// Attachments the runtime does not know, handed to GC to remove.
const ORPHANS: usize = 2;
const DEFAULT_OPS: usize = 500;
const SEED_VAR: &str = "VPCNET_CHURN_SEED";
/// The agent is killed after 0.5 to 3 s of life, at most this many times.
const KILL_AFTER_MS: std::ops::Range<u64> = 500..3000;
const MAX_KILLS: usize = 250;
/// After a kill the agent stays down for up to this many operations, as
/// it does on a node while its `DaemonSet` pod restarts.
const MAX_DOWN_OPS: usize = 2;
/// The whole churn, whatever the rate: the test fails rather than hang.
const CHURN_LIMIT: Duration = Duration::from_mins(20);
/// The agent's grace (`--orphan-grace 5`) plus restarts and sweeps: an
/// address of a gone pod the agent still holds after this is leaked.
const STALE_LIMIT: Duration = Duration::from_secs(30);
const NAMESPACE: &str = "default";
/// The conflist's network name (the IPAM key's `network_name`).
const NETWORK: &str = "aws-cni";

/// A pod the runtime runs.
#[derive(Clone, Debug)]
struct LivePod {
    name: String,
    sandbox: String,
    addr: Ipv4Addr,
}

impl LivePod {
    fn host_veth(&self) -> String {
        vpcnet_api::pod::host_veth_name("eni", NAMESPACE, &self.name)
    }
}

/// Kills the agent whose pid `pid` holds at random moments; the pid is
/// swapped for 0 before the signal, so 0 means "killed, not restarted".
struct Killer {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<usize>>,
}

impl Killer {
    fn start(pid: Arc<AtomicI32>, seed: u64) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let handle = std::thread::spawn(move || {
            let mut rng = fastrand::Rng::with_seed(seed);
            let mut kills = 0;
            while kills < MAX_KILLS && !stopping.load(Ordering::SeqCst) {
                std::thread::park_timeout(Duration::from_millis(rng.u64(KILL_AFTER_MS)));
                if stopping.load(Ordering::SeqCst) {
                    break;
                }
                let victim = pid.swap(0, Ordering::SeqCst);
                if victim > 0 {
                    let _ = nix::sys::signal::kill(Pid::from_raw(victim), Signal::SIGKILL);
                    kills += 1;
                }
            }
            kills
        });
        Self {
            stop,
            handle: Some(handle),
        }
    }

    /// Stops the thread; the number of kills.
    fn finish(&mut self) -> usize {
        self.stop.store(true, Ordering::SeqCst);
        self.handle.take().map_or(0, |handle| {
            handle.thread().unpark();
            handle.join().expect("the killer thread")
        })
    }
}

/// A panicking test stops killing too.
impl Drop for Killer {
    fn drop(&mut self) {
        self.finish();
    }
}

/// The lab and the agent's life: its pid as the killer sees it, restarts.
struct Node {
    lab: Lab,
    pid: Arc<AtomicI32>,
    restarts: usize,
    restart_time: Vec<Duration>,
    /// Killed at operation `.0`, to be restarted `.1` operations later.
    down: Option<(usize, usize)>,
    runtime: tokio::runtime::Runtime,
}

impl Node {
    fn agent_pid(lab: &Lab) -> i32 {
        lab.state().agent.as_ref().map_or(0, |agent| agent.pid)
    }

    fn agent_up(&self) -> bool {
        self.pid.load(Ordering::SeqCst) != 0
    }

    /// Reaps the killed agent and starts another (waiting for READY).
    fn restart(&mut self) {
        let started = Instant::now();
        self.lab.kill_agent().expect("reaping the killed agent");
        self.lab.start_agent().unwrap_or_else(|e| {
            panic!(
                "restarting the agent after a SIGKILL: {e}\nagent log (tail):\n{}",
                agent_log_tail()
            )
        });
        self.restart_time.push(started.elapsed());
        self.pid.store(Self::agent_pid(&self.lab), Ordering::SeqCst);
        self.restarts += 1;
        self.down = None;
    }

    fn ensure_up(&mut self) {
        if !self.agent_up() {
            self.restart();
        }
    }

    /// The agent's attachments; `None` if the agent is down (or was killed
    /// during the call).
    fn attachments(&self) -> Option<Vec<Attachment>> {
        if !self.agent_up() {
            return None;
        }
        let reply = self.runtime.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), async {
                let mut client = vpcnet_api::connect_cni(cni_socket_file())
                    .await
                    .map_err(|e| e.to_string())?;
                client
                    .list_attachments(ListAttachmentsRequest {})
                    .await
                    .map(|r| r.into_inner().attachments)
                    .map_err(|e| e.to_string())
            })
            .await
            .unwrap_or_else(|_| Err("no answer within 10 s".to_owned()))
        });
        match reply {
            Ok(attachments) => Some(attachments),
            Err(_) if !self.agent_up() => None,
            Err(e) => panic!(
                "ListAttachments failed with the agent up: {e}\nagent log (tail):\n{}",
                agent_log_tail()
            ),
        }
    }

    /// An address the agent holds for a pod the runtime never ran (no
    /// veth, no datapath entry): what a runtime that lost track leaves.
    fn add_orphan(&self, n: usize) -> Ipv4Addr {
        let reply = self.runtime.block_on(async {
            let mut client = vpcnet_api::connect_cni(cni_socket_file())
                .await
                .expect("connecting to the agent");
            client
                .add_network(AddNetworkRequest {
                    pod: Some(PodKey {
                        network_name: NETWORK.into(),
                        container_id: format!("{:064x}", 0xdead_0000 + n),
                        if_name: "eth0".into(),
                        k8s_pod_namespace: NAMESPACE.into(),
                        k8s_pod_name: format!("orphan-{n}"),
                    }),
                    netns: format!("/var/run/netns/orphan-{n}"),
                    ..AddNetworkRequest::default()
                })
                .await
                .expect("AddNetwork of an orphan")
                .into_inner()
        });
        reply.ipv4_addr.parse().expect("an address")
    }

    fn ec2_pod_addrs(&self) -> BTreeSet<Ipv4Addr> {
        let emulator = self.lab.emulator().expect("an address-manager lab");
        let state = emulator.admin().state().expect("the emulator's state");
        holdings(&state, emulator.instance_id()).pod_addrs
    }
}

/// Counts and latencies of the run.
#[derive(Default)]
struct Figures {
    adds: usize,
    adds_ok: usize,
    /// Failed `RunPodSandbox`: the agent was down when it started / was
    /// killed during it.
    adds_failed_down: usize,
    adds_failed_killed: usize,
    /// Sandboxes a failed `RunPodSandbox` left for kubelet to remove.
    failed_sandboxes_left: usize,
    dels: usize,
    dels_with_agent_down: usize,
    /// Failed `StopPodSandbox` and `RemovePodSandbox` calls (retried).
    del_failures: BTreeMap<&'static str, usize>,
    run_latency: Vec<Duration>,
    del_latency: Vec<Duration>,
    check_time: Vec<Duration>,
    /// Attachments of gone pods seen held, and the longest time one was.
    stale_seen: usize,
    stale_longest: Duration,
    /// One failure of each kind: the call and the plugin's message.
    failure_kinds: BTreeMap<String, (usize, String)>,
}

impl Figures {
    /// Counts a failed CRI call by its kind: the call and the message of
    /// the plugin that failed (`... failed (add): <message>; <details>`).
    fn failed(&mut self, call: &str, error: &str) {
        let message = error
            .rsplit_once("failed (")
            .and_then(|(_, rest)| rest.split_once("): "))
            .map_or(error, |(_, message)| {
                message.split(';').next().unwrap_or(message)
            });
        self.failure_kinds
            .entry(format!("{call}: {message}"))
            .or_insert_with(|| (0, error.to_owned()))
            .0 += 1;
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let index = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[index]
}

fn p50_p99(mut samples: Vec<Duration>) -> String {
    samples.sort();
    format!(
        "p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms (n={})",
        percentile(&samples, 0.5).as_secs_f64() * 1e3,
        percentile(&samples, 0.99).as_secs_f64() * 1e3,
        samples.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
        samples.len()
    )
}

/// The plugin's own figures from its log: `elapsed_ms` of each ADD that
/// succeeded, and the error of each that failed (by its CNI code).
fn plugin_adds() -> (Vec<Duration>, BTreeMap<String, usize>) {
    let mut elapsed = Vec::new();
    let mut failed = BTreeMap::new();
    for call in cri_pods::plugin_calls()
        .into_iter()
        .filter(|c| c.command == "ADD")
    {
        match (call.elapsed, call.error_code) {
            (_, Some(code)) => *failed.entry(code).or_insert(0) += 1,
            (Some(elapsed_ms), None) => elapsed.push(elapsed_ms),
            (None, None) => {}
        }
    }
    (elapsed, failed)
}

/// What must hold after every operation.
fn check_invariants(
    client: &CriClient,
    node: &Node,
    live: &[LivePod],
    stale_since: &mut BTreeMap<String, Instant>,
    figures: &mut Figures,
    op: usize,
) {
    let started = Instant::now();
    let ctx = || format!("after operation {op}");

    // The runtime runs exactly the live pods, each with its own address.
    let sandboxes = client.list_pod_sandboxes().expect("ListPodSandbox");
    let running: BTreeMap<&str, SandboxState> =
        sandboxes.iter().map(|s| (s.id.as_str(), s.state)).collect();
    let expected: BTreeMap<&str, SandboxState> = live
        .iter()
        .map(|p| (p.sandbox.as_str(), SandboxState::Ready))
        .collect();
    assert_eq!(
        running,
        expected,
        "{}: the runtime's sandboxes (crictl pods) are not the live pods",
        ctx()
    );
    let mut by_addr: BTreeMap<Ipv4Addr, &str> = BTreeMap::new();
    for pod in live {
        let status = client
            .pod_sandbox_status(&pod.sandbox)
            .expect("PodSandboxStatus");
        assert_eq!(
            status.ip,
            Some(IpAddr::V4(pod.addr)),
            "{}: pod {}'s address (crictl inspectp) changed",
            ctx(),
            pod.name
        );
        if let Some(other) = by_addr.insert(pod.addr, &pod.name) {
            panic!(
                "{}: {} is the address of both {other} and {}",
                ctx(),
                pod.addr,
                pod.name
            );
        }
    }

    // EC2 assigned every pod's address to the node.
    let ec2 = node.ec2_pod_addrs();
    for pod in live {
        assert!(
            ec2.contains(&pod.addr),
            "{}: pod {} has {}, which EC2 has not assigned to the node (its ENIs hold {ec2:?})",
            ctx(),
            pod.name,
            pod.addr
        );
    }

    // The node: a veth, a namespace and a CNI result per live pod, no
    // more; each live pod in the datapath.
    let traces = node_traces();
    let veths: BTreeSet<String> = live.iter().map(LivePod::host_veth).collect();
    assert_eq!(
        traces.host_veths,
        veths,
        "{}: the node's pod veths (ip link show type veth) are not the live pods'",
        ctx()
    );
    assert_eq!(
        traces.pod_netns.len(),
        live.len(),
        "{}: pod network namespaces {:?} for {} live pods",
        ctx(),
        traces.pod_netns,
        live.len()
    );
    let results: BTreeSet<String> = live
        .iter()
        .map(|p| format!("{NETWORK}-{}-eth0", p.sandbox))
        .collect();
    assert_eq!(
        traces.cni_results,
        results,
        "{}: CNI result caches (/var/lib/cni/results) are not the live pods'",
        ctx()
    );
    for pod in live {
        assert!(
            traces.endpoints.contains(&pod.addr),
            "{}: pod {} ({}) has no endpoint entry in the datapath",
            ctx(),
            pod.name,
            pod.addr
        );
    }

    if let Some(attachments) = node.attachments() {
        check_agent(&attachments, live, &ec2, stale_since, figures, &ctx());
    }
    figures.check_time.push(started.elapsed());
}

/// The agent holds each live pod's address for that pod, no address twice,
/// only addresses EC2 assigned to the node, and gives back gone pods'
/// addresses within [`STALE_LIMIT`].
fn check_agent(
    attachments: &[Attachment],
    live: &[LivePod],
    ec2: &BTreeSet<Ipv4Addr>,
    stale_since: &mut BTreeMap<String, Instant>,
    figures: &mut Figures,
    ctx: &str,
) {
    let mut held: BTreeMap<Ipv4Addr, &Attachment> = BTreeMap::new();
    for a in attachments {
        let addr: Ipv4Addr = a.ipv4_addr.parse().expect("an attachment's address");
        if let Some(other) = held.insert(addr, a) {
            panic!("{ctx}: the agent holds {addr} for two pods: {other:?} and {a:?}");
        }
        assert!(
            ec2.contains(&addr),
            "{}: the agent holds {addr} for {:?}, an address EC2 has not assigned to the node",
            ctx,
            a.pod
        );
    }
    for pod in live {
        let holder = held.get(&pod.addr);
        assert!(
            holder.is_some_and(|a| a
                .pod
                .as_ref()
                .is_some_and(|k| k.container_id == pod.sandbox)),
            "{}: pod {}'s address {} is {} in the agent (vpcnet-agent pods)",
            ctx,
            pod.name,
            pod.addr,
            holder.map_or_else(|| "free".to_owned(), |a| format!("held by {:?}", a.pod))
        );
    }
    // Gone pods' addresses come back within the grace and a sweep.
    let live_ids: BTreeSet<&str> = live.iter().map(|p| p.sandbox.as_str()).collect();
    let now = Instant::now();
    let stale: BTreeSet<String> = attachments
        .iter()
        .filter_map(|a| a.pod.as_ref())
        .map(|k| k.container_id.clone())
        .filter(|id| !live_ids.contains(id.as_str()))
        .collect();
    stale_since.retain(|id, since| {
        let keep = stale.contains(id);
        if !keep {
            figures.stale_longest = figures.stale_longest.max(now - *since);
        }
        keep
    });
    for id in stale {
        let since = *stale_since.entry(id.clone()).or_insert_with(|| {
            figures.stale_seen += 1;
            now
        });
        assert!(
            now - since < STALE_LIMIT,
            "{}: the agent still holds an address for gone container {id} after {:?}\nagent log (tail):\n{}",
            ctx,
            now - since,
            agent_log_tail()
        );
    }
}

/// Stop and Remove as kubelet does: a failed call is retried once the
/// agent is back (kubelet's pod workers and sandbox GC retry). A call that
/// fails with the agent up all along fails the test.
fn stop_and_remove(client: &CriClient, node: &mut Node, sandbox: &str, figures: &mut Figures) {
    type Call = fn(&CriClient, &str) -> vpcnet_lab::cri::Result<()>;
    let calls: [(&str, Call); 2] = [
        ("StopPodSandbox", CriClient::stop_pod_sandbox),
        ("RemovePodSandbox", CriClient::remove_pod_sandbox),
    ];
    for (name, call) in calls {
        let mut attempts = 0;
        loop {
            let up_before = node.agent_up();
            let Err(e) = call(client, sandbox) else {
                break;
            };
            attempts += 1;
            assert!(
                !(up_before && node.agent_up()) && attempts < 5,
                "{name} {sandbox} failed (attempt {attempts}) with the agent up all along: {e}\nagent log (tail):\n{}",
                agent_log_tail()
            );
            *figures.del_failures.entry(name).or_insert(0) += 1;
            figures.failed(name, &e.to_string());
            node.ensure_up();
        }
    }
}

fn pod_spec(n: usize) -> PodSpec {
    PodSpec::new(
        NAMESPACE,
        format!("churn-{n}"),
        format!("00000000-0000-4000-9000-{n:012}"),
    )
}

/// `RunPodSandbox` of a new pod, kubelet's way: a failure is followed by
/// stopping and removing whatever sandbox of it the runtime has.
fn run_pod(
    client: &CriClient,
    node: &mut Node,
    n: usize,
    figures: &mut Figures,
) -> Option<LivePod> {
    let spec = pod_spec(n);
    let up_before = node.agent_up();
    figures.adds += 1;
    let started = Instant::now();
    let outcome = client.run_pod_sandbox(&spec);
    let took = started.elapsed();
    match outcome {
        Ok(sandbox) => {
            figures.adds_ok += 1;
            figures.run_latency.push(took);
            let status = client
                .pod_sandbox_status(&sandbox)
                .expect("PodSandboxStatus");
            let Some(IpAddr::V4(addr)) = status.ip else {
                panic!("pod {} runs without an IPv4 address: {status:?}", spec.name);
            };
            Some(LivePod {
                name: spec.name,
                sandbox,
                addr,
            })
        }
        Err(e) => {
            // The agent was up before and after: nothing excuses it.
            assert!(
                !(up_before && node.agent_up()),
                "RunPodSandbox of {} failed with the agent up all along: {e}\nagent log (tail):\n{}",
                spec.name,
                agent_log_tail()
            );
            if up_before {
                figures.adds_failed_killed += 1;
            } else {
                figures.adds_failed_down += 1;
            }
            figures.failed("RunPodSandbox", &e.to_string());
            let left: Vec<String> = client
                .list_pod_sandboxes()
                .expect("ListPodSandbox")
                .into_iter()
                .filter(|s| s.name == spec.name)
                .map(|s| s.id)
                .collect();
            figures.failed_sandboxes_left += left.len();
            for sandbox in left {
                stop_and_remove(client, node, &sandbox, figures);
            }
            // Nothing of the failed pod on the node.
            let veth = vpcnet_api::pod::host_veth_name("eni", NAMESPACE, &spec.name);
            assert!(
                !node_traces().host_veths.contains(&veth),
                "the failed ADD of {} left its host veth {veth}",
                spec.name
            );
            None
        }
    }
}

/// The plugin's GC, as the runtime runs it: the deploy conflist's plugin
/// config at 1.1.0 with `cni.dev/valid-attachments`, in the node.
fn plugin_gc(valid: &[&LivePod]) -> String {
    let conflist =
        cri_pods::lab_conflist(vpcnet_lab::EnforcingMode::Strict).expect("the lab's conflist");
    let mut conf = conflist["plugins"]
        .as_array()
        .and_then(|plugins| {
            plugins
                .iter()
                .find(|p| p["type"].as_str() == Some("vpcnet-cni"))
        })
        .cloned()
        .expect("the conflist's vpcnet-cni plugin");
    conf["cniVersion"] = json!("1.1.0");
    conf["name"] = conflist["name"].clone();
    conf["cni.dev/valid-attachments"] = Value::from(
        valid
            .iter()
            .map(|p| json!({"containerID": p.sandbox, "ifname": "eth0"}))
            .collect::<Vec<_>>(),
    );
    let mut child = Command::new("nsenter")
        .arg(format!(
            "--net={}/{NS_NODE}",
            vpcnet_lab::netns::NETNS_RUN_DIR
        ))
        .arg(cni_plugin_binary())
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("CNI_COMMAND", "GC")
        .env("CNI_PATH", cri_pods::cni_bin_dir())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running vpcnet-cni GC");
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(conf.to_string().as_bytes())
        .expect("writing the config");
    let out = child.wait_with_output().expect("vpcnet-cni GC");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "CNI GC failed ({}): {} {stderr}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    // `gc: removed N of M stale attachments`
    stderr
        .lines()
        .filter_map(|l| l.split_once("gc: removed ").map(|(_, said)| said))
        .find(|said| said.contains(" stale attachments"))
        .map_or_else(|| stderr.clone(), |said| format!("removed {said}"))
}

#[test]
#[allow(clippy::too_many_lines)]
fn churn_with_the_agent_killed_never_double_assigns_leaks_nothing_and_gc_converges() {
    let _lock = lab_lock();
    let seed = test_sizes::size_or(SEED_VAR, fastrand::u64(..));
    let ops = test_sizes::size_or(test_sizes::CRI_CHURN_OPS_VAR, DEFAULT_OPS);
    println!("seed {seed} (replay the choices: {SEED_VAR}={seed}); {ops} operations");
    let mut rng = fastrand::Rng::with_seed(seed);
    let lab = cri::up(0, INSTANCE_TYPE);
    let client = lab.cri().expect("a CRI client");
    let pid = Arc::new(AtomicI32::new(Node::agent_pid(&lab)));
    let mut node = Node {
        lab,
        pid: Arc::clone(&pid),
        restarts: 0,
        restart_time: Vec::new(),
        down: None,
        runtime: tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime"),
    };
    // Declared after the node: stops killing before the lab goes down.
    let mut killer = Killer::start(Arc::clone(&pid), seed ^ 0x6b69_6c6c);

    let mut figures = Figures::default();
    let mut live: Vec<LivePod> = Vec::new();
    let mut stale_since = BTreeMap::new();
    let mut next = 0;
    let started = Instant::now();
    for op in 0..ops {
        assert!(
            started.elapsed() < CHURN_LIMIT,
            "{op} of {ops} operations in {CHURN_LIMIT:?}: too slow"
        );
        // A killed agent stays down a few operations, then comes back.
        if !node.agent_up() {
            let (at, wait) = *node
                .down
                .get_or_insert_with(|| (op, rng.usize(0..=MAX_DOWN_OPS)));
            if op >= at + wait {
                node.restart();
            }
        }
        let add = live.is_empty() || (live.len() < MAX_LIVE && rng.f32() < 0.55);
        if add {
            if let Some(pod) = run_pod(&client, &mut node, next, &mut figures) {
                live.push(pod);
            }
            next += 1;
        } else {
            let pod = live.swap_remove(rng.usize(0..live.len()));
            figures.dels += 1;
            if !node.agent_up() {
                figures.dels_with_agent_down += 1;
            }
            let del_started = Instant::now();
            stop_and_remove(&client, &mut node, &pod.sandbox, &mut figures);
            figures.del_latency.push(del_started.elapsed());
        }
        check_invariants(&client, &node, &live, &mut stale_since, &mut figures, op);
        if (op + 1) % 250 == 0 {
            println!(
                "  {} operations in {:.0} s: {} live pods, {} restarts",
                op + 1,
                started.elapsed().as_secs_f64(),
                live.len(),
                node.restarts
            );
        }
    }
    let kills = killer.finish();
    let churn_time = started.elapsed();
    node.ensure_up();

    // The end: KEEP pods stay, the rest go; two attachments no pod has
    // (a runtime that lost track) are added; the plugin's GC, told the
    // KEEP pods are the valid ones, leaves the agent exactly those.
    while live.len() < KEEP {
        let pod = run_pod(&client, &mut node, next, &mut figures)
            .expect("RunPodSandbox with the agent up and no killer");
        next += 1;
        live.push(pod);
    }
    for pod in live.split_off(KEEP) {
        stop_and_remove(&client, &mut node, &pod.sandbox, &mut figures);
    }
    let orphans: Vec<Ipv4Addr> = (0..ORPHANS).map(|n| node.add_orphan(n)).collect();
    let held_before_gc = node.attachments().expect("the agent is up").len();
    let kept: Vec<&LivePod> = live.iter().collect();
    let gc_said = plugin_gc(&kept);
    let gc_removed: usize = gc_said
        .strip_prefix("removed ")
        .and_then(|said| said.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("CNI GC did not log what it removed: {gc_said}"));
    assert!(
        gc_removed >= ORPHANS,
        "CNI GC removed {gc_removed} attachments, not the {ORPHANS} no pod has: {gc_said}"
    );
    let after_gc: BTreeMap<String, String> = node
        .attachments()
        .expect("the agent is up")
        .into_iter()
        .map(|a| (a.pod.unwrap_or_default().container_id, a.ipv4_addr))
        .collect();
    let wanted: BTreeMap<String, String> = live
        .iter()
        .map(|p| (p.sandbox.clone(), p.addr.to_string()))
        .collect();
    assert_eq!(
        after_gc, wanted,
        "after CNI GC with the {KEEP} running pods valid, the agent's attachments (vpcnet-agent pods) are not exactly theirs"
    );
    // GC took nothing from the pods it was told to keep.
    check_invariants(&client, &node, &live, &mut stale_since, &mut figures, ops);
    println!(
        "GC with {KEEP} valid attachments: the agent held {held_before_gc} (orphans {orphans:?}), holds {}; plugin: {gc_said}",
        after_gc.len()
    );

    // Every pod gone: nothing on the node, in the agent, with EC2.
    for pod in std::mem::take(&mut live) {
        stop_and_remove(&client, &mut node, &pod.sandbox, &mut figures);
    }
    let converge = Instant::now();
    let status = wait_ipam(
        "every address back in the agent's pool",
        Duration::from_secs(30),
        |s| s.assigned_addrs == 0,
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut traces = node_traces();
    while !traces.is_empty() {
        assert!(
            Instant::now() < deadline,
            "the node still holds pod traces 30 s after the last pod went: {traces:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
        traces = node_traces();
    }
    assert_eq!(traces, NodeTraces::default());
    assert_eq!(
        node.attachments().expect("the agent is up").len(),
        0,
        "attachments left with no pod"
    );
    // EC2 and the agent agree on the node's addresses (the warm pool may
    // still be trimming: polled until both sides settle on one count).
    let deadline = Instant::now() + Duration::from_secs(30);
    let (ec2, total) = loop {
        let before = cri::ipam_status().total_addrs as usize;
        let ec2 = node.ec2_pod_addrs();
        let after = cri::ipam_status().total_addrs as usize;
        if before == after && ec2.len() == after {
            break (ec2, after);
        }
        assert!(
            Instant::now() < deadline,
            "EC2 assigned {} addresses to the node's ENIs, the agent's pool has {after}: addresses leaked",
            ec2.len()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    // An agent killed between an ENI's detach and its delete finds the ENI
    // at its restart and deletes it on a later pass: polled, bounded.
    let emulator = node.lab.emulator().expect("an address-manager lab");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let state = emulator.admin().state().expect("the emulator's state");
        let detached = holdings(&state, emulator.instance_id()).detached_enis;
        if detached.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "ENIs leaked (detached, not deleted 10 s after the pool settled): {detached:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let converged = converge.elapsed();

    let (plugin_ok, plugin_failed) = plugin_adds();
    let total_time = started.elapsed();
    println!(
        "{ops} operations in {:.1} s ({:.1} op/s): {} RunPodSandbox ({} ok), {} Stop+Remove ({} with the agent down)",
        churn_time.as_secs_f64(),
        f64::from(u32::try_from(ops).unwrap_or(u32::MAX)) / churn_time.as_secs_f64(),
        figures.adds,
        figures.adds_ok,
        figures.dels,
        figures.dels_with_agent_down
    );
    println!(
        "agent: {kills} SIGKILLs, {} restarts (start to READY {})",
        node.restarts,
        p50_p99(node.restart_time.clone())
    );
    println!(
        "failed ADDs: {} with the agent down, {} with the agent killed during them; sandboxes they left for kubelet: {}; veths, namespaces, CNI caches they left: 0; failed (and retried) pod removals: {:?}",
        figures.adds_failed_down,
        figures.adds_failed_killed,
        figures.failed_sandboxes_left,
        figures.del_failures
    );
    for (kind, (count, example)) in &figures.failure_kinds {
        println!("  {count} x {kind}, e.g. {example}");
    }
    println!(
        "RunPodSandbox wall time: {}",
        p50_p99(figures.run_latency.clone())
    );
    println!(
        "plugin ADD (its log's elapsed_ms): {}; failed ADDs by code: {plugin_failed:?}",
        p50_p99(plugin_ok)
    );
    println!(
        "Stop+Remove wall time: {}",
        p50_p99(figures.del_latency.clone())
    );
    println!("invariant checks: {}", p50_p99(figures.check_time.clone()));
    println!(
        "addresses of gone pods the agent held for a while: {} (longest seen {:.1} s); double assignments 0, addresses outside EC2's 0",
        figures.stale_seen,
        figures.stale_longest.as_secs_f64()
    );
    println!(
        "converged in {:.1} s after the last pod: 0 of {} addresses assigned, EC2 holds {total} for the node, leaked ENIs 0, node traces none; total {:.1} s",
        converged.as_secs_f64(),
        status.total_addrs,
        total_time.as_secs_f64()
    );
    assert_eq!(ec2.len(), total);
    assert!(kills >= 3, "the agent was killed only {kills} times");
    drop(killer);
    node.lab.down().expect("taking the lab down");
}
