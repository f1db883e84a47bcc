//! containerd's CRI in a lab namespace, driven as kubelet drives it:
//! sandboxes get addresses from Debian's `ptp` + `host-local` plugins, in a
//! namespace this test makes (`vpcnet-cri-test`); a CNI plugin's error
//! reaches the caller; and stopping containerd, or tearing down one whose
//! owner died (or that was killed with SIGKILL), leaves no process, mount,
//! cgroup or directory behind.
//!
//! Root needed; one at a time (`serial()`); the namespace and the temporary
//! directory are removed by guards even when an assertion fails.

mod common;

use std::{
    collections::BTreeSet,
    fs,
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use common::lab_session;
use ipnet::Ipv4Net;
use nix::{
    sys::{signal::Signal, wait::waitpid},
    unistd::Pid,
};
use vpcnet_lab::{
    cri::{
        self, Containerd, ContainerdDirs, ContainerdOptions, CriClient, DEBIAN_CNI_BIN_DIR,
        POD_CGROUP_PARENT, PodSpec, PortMapping, Protocol, SandboxState,
    },
    netns,
};

const NS: &str = "vpcnet-cri-test";
/// The pods' subnet, inside the test's namespace only.
const POD_SUBNET: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(10, 99, 0, 0), 24);
const NETWORK_NAME: &str = "vpcnet-cri-test";

/// The test's namespace (with `lo` up), removed when dropped.
struct TestNs;

impl TestNs {
    fn new() -> Self {
        netns::create_namespaces(&[NS.to_owned()]).unwrap();
        let guard = Self;
        netns::ip_batch(Some(NS), &["link set lo up".to_owned()]).unwrap();
        guard
    }
}

impl Drop for TestNs {
    fn drop(&mut self) {
        if let Err(err) = netns::delete_namespaces(&[NS.to_owned()]) {
            eprintln!("removing {NS}: {err}");
        }
    }
}

/// The CNI configuration directory and host-local's lease directory,
/// removed when dropped.
struct CniDirs {
    top: PathBuf,
}

impl CniDirs {
    /// `ptp` with `host-local` addresses from [`POD_SUBNET`], then `portmap`.
    fn new() -> Self {
        Self::with_main_plugin("ptp")
    }

    fn with_main_plugin(plugin: &str) -> Self {
        let top = std::env::temp_dir().join(format!("vpcnet-cri-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&top);
        let guard = Self { top };
        fs::create_dir_all(guard.conf_dir()).unwrap();
        let conflist = serde_json::json!({
            "cniVersion": "0.4.0",
            "name": NETWORK_NAME,
            "plugins": [
                {
                    "type": plugin,
                    "ipMasq": false,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_SUBNET.to_string()}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": guard.top.join("ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": true}},
            ],
        });
        fs::write(
            guard.conf_dir().join("10-vpcnet-cri-test.conflist"),
            serde_json::to_vec_pretty(&conflist).unwrap(),
        )
        .unwrap();
        guard
    }

    fn conf_dir(&self) -> PathBuf {
        self.top.join("net.d")
    }

    /// The addresses host-local has handed out (a file per address).
    fn leases(&self) -> Vec<String> {
        fs::read_dir(self.top.join("ipam").join(NETWORK_NAME))
            .into_iter()
            .flatten()
            .flatten()
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .filter(|name| name.parse::<Ipv4Addr>().is_ok())
            .collect()
    }
}

impl Drop for CniDirs {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.top);
    }
}

/// Removes a containerd nobody owns any more, when dropped.
struct LeftoversGuard;

impl Drop for LeftoversGuard {
    fn drop(&mut self) {
        if let Err(err) = cri::teardown_leftovers() {
            eprintln!("teardown_leftovers: {err}");
        }
    }
}

fn start_containerd(cni: &CniDirs) -> Containerd {
    let started = Instant::now();
    let containerd = Containerd::start(&ContainerdOptions::new(
        NS,
        DEBIAN_CNI_BIN_DIR,
        cni.conf_dir(),
    ))
    .unwrap();
    println!(
        "containerd (pid {}) ready with the pause image after {:?}, snapshotter {}",
        containerd.pid(),
        started.elapsed(),
        containerd.snapshotter().as_str()
    );
    containerd
}

fn pod(index: usize) -> PodSpec {
    let mut pod = PodSpec::new(
        "cri-test",
        format!("pod-{index}"),
        format!("uid-cri-test-{index}"),
    );
    pod.annotations
        .insert("vpcnet.test/index".into(), index.to_string());
    pod
}

fn run_pod(client: &CriClient, pod: &PodSpec) -> String {
    let started = Instant::now();
    let id = client.run_pod_sandbox(pod).unwrap();
    println!("RunPodSandbox {} took {:?}", pod.name, started.elapsed());
    id
}

/// `ip -br addr show eth0` inside the namespace at `path` (which need not
/// be under /var/run/netns).
fn eth0_of(netns_path: &Path) -> String {
    let output = Command::new("nsenter")
        .arg(format!("--net={}", netns_path.display()))
        .args(["--", "ip", "-br", "addr", "show", "eth0"])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "ip in {}: {}",
        netns_path.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// Processes whose command line has `socket` as the argument of
/// `-address` (containerd's shims) or that are `pid`.
fn processes_of(pid: u32, socket: &Path) -> Vec<String> {
    let socket = socket.to_string_lossy();
    let mut found = Vec::new();
    for entry in fs::read_dir("/proc").unwrap().flatten() {
        let Ok(proc_pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let argv: Vec<String> = cmdline
            .split(|&b| b == 0)
            .map(|arg| String::from_utf8_lossy(arg).into_owned())
            .collect();
        let serves_socket = argv
            .windows(2)
            .any(|pair| pair[0] == "-address" && pair[1] == socket);
        // A zombie has an empty command line: it is gone but for its entry.
        if (proc_pid == pid && !cmdline.is_empty()) || serves_socket {
            found.push(format!("{proc_pid}: {}", argv.join(" ")));
        }
    }
    found
}

/// Mount points at or under `dirs`, from /proc/self/mountinfo.
fn mounts_under(dirs: &[&Path]) -> Vec<String> {
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .filter(|mount_point| {
            dirs.iter()
                .any(|dir| Path::new(mount_point).starts_with(dir))
        })
        .map(str::to_owned)
        .collect()
}

/// Cgroup directories named after the pods' cgroup parent, in every
/// hierarchy.
fn pod_cgroups() -> Vec<PathBuf> {
    let parent = POD_CGROUP_PARENT.trim_start_matches('/');
    let mut found = Vec::new();
    for line in fs::read_to_string("/proc/self/mountinfo").unwrap().lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let fs_type = fields
            .iter()
            .skip_while(|field| **field != "-")
            .nth(1)
            .copied();
        if matches!(fs_type, Some("cgroup" | "cgroup2")) {
            let dir = Path::new(fields[4]).join(parent);
            if dir.exists() {
                found.push(dir);
            }
        }
    }
    found
}

fn assert_nothing_left(pid: u32, dirs: &ContainerdDirs, sandbox_ids: &[String]) {
    assert_eq!(
        processes_of(pid, &dirs.socket()),
        Vec::<String>::new(),
        "containerd or its shims are left"
    );
    assert_eq!(
        mounts_under(&[&dirs.state, &dirs.root]),
        Vec::<String>::new(),
        "mounts are left"
    );
    assert_eq!(pod_cgroups(), Vec::<PathBuf>::new(), "pod cgroups are left");
    assert!(!dirs.state.exists(), "{} is left", dirs.state.display());
    assert!(!dirs.root.exists(), "{} is left", dirs.root.display());
    assert!(
        !vpcnet_lab::state_dir().exists(),
        "an empty lab state directory is left (a lab would seem to exist)"
    );
    let cni_results: Vec<String> = fs::read_dir("/var/lib/cni/results")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| sandbox_ids.iter().any(|id| name.contains(id.as_str())))
        .collect();
    assert_eq!(cni_results, Vec::<String>::new(), "libcni results are left");
    assert_eq!(
        netns::lab_namespaces().unwrap(),
        vec![NS.to_owned()],
        "a namespace other than the test's appeared in /var/run/netns"
    );
}

#[test]
fn sandboxes_get_addresses_and_containerd_leaves_nothing() {
    let _lock = lab_session();
    cri::teardown_leftovers().expect("removing a containerd left by an earlier run");
    let _ns = TestNs::new();
    let cni = CniDirs::new();
    let containerd = start_containerd(&cni);
    let dirs = containerd.dirs().clone();
    let pid = containerd.pid();
    let client = containerd.client().unwrap();
    let version = client.version().unwrap();
    assert_eq!(version.runtime_name, "containerd");
    assert_eq!(version.runtime_api_version, "v1");
    println!("runtime: {version:?}");

    let mut pods: Vec<PodSpec> = (0..3).map(pod).collect();
    pods[0].port_mappings.push(PortMapping {
        protocol: Protocol::Tcp,
        container_port: 80,
        host_port: 8080,
    });
    let ids: Vec<String> = pods.iter().map(|pod| run_pod(&client, pod)).collect();

    let mut addresses = BTreeSet::new();
    for (pod, id) in pods.iter().zip(&ids) {
        let status = client.pod_sandbox_status(id).unwrap();
        assert_eq!(status.state, SandboxState::Ready, "{}", pod.name);
        assert_eq!(
            (
                status.name.as_str(),
                status.namespace.as_str(),
                status.uid.as_str()
            ),
            (pod.name.as_str(), pod.namespace.as_str(), pod.uid.as_str())
        );
        let Some(IpAddr::V4(ip)) = status.ip else {
            panic!("{} has no IPv4 address: {status:?}", pod.name);
        };
        assert!(POD_SUBNET.contains(&ip), "{} got {ip}", pod.name);
        assert!(addresses.insert(ip), "{ip} was given twice");
        let netns = status.netns.expect("a network namespace path");
        println!("{}: {ip} in {}", pod.name, netns.display());
        assert!(netns.exists(), "{} does not exist", netns.display());
        assert!(
            netns.starts_with(&dirs.state),
            "{} is not under the state directory (netns_mounts_under_state_dir)",
            netns.display()
        );
        let eth0 = eth0_of(&netns);
        assert!(
            eth0.contains(&format!("{ip}/")),
            "eth0 of {} lacks {ip}: {eth0}",
            pod.name
        );
    }

    for id in &ids {
        client.stop_pod_sandbox(id).unwrap();
        // kubelet stops more than once; it must stay a success.
        client.stop_pod_sandbox(id).unwrap();
        assert_eq!(
            client.pod_sandbox_status(id).unwrap().state,
            SandboxState::NotReady
        );
        client.remove_pod_sandbox(id).unwrap();
    }
    assert_eq!(client.list_pod_sandboxes().unwrap(), Vec::new());
    let missing = client.pod_sandbox_status(&ids[0]).unwrap_err();
    assert!(
        missing
            .rpc_message()
            .is_some_and(|m| m.contains("not found")),
        "{missing}"
    );
    drop(client);

    containerd.stop().unwrap();
    assert_nothing_left(pid, &dirs, &ids);
}

#[test]
fn teardown_leftovers_removes_a_killed_containerd_and_its_sandbox() {
    let _lock = lab_session();
    cri::teardown_leftovers().expect("removing a containerd left by an earlier run");
    let _ns = TestNs::new();
    let cni = CniDirs::new();
    let containerd = start_containerd(&cni);
    let dirs = containerd.dirs().clone();
    let pid = containerd.pid();
    let client = containerd.client().unwrap();
    let mut pod = pod(0);
    pod.port_mappings.push(PortMapping {
        protocol: Protocol::Udp,
        container_port: 53,
        host_port: 5353,
    });
    let id = run_pod(&client, &pod);
    let status = client.pod_sandbox_status(&id).unwrap();
    let pause_pid = status.info["pid"]
        .as_i64()
        .expect("the pause process's pid");
    let pause_pid = i32::try_from(pause_pid).unwrap();
    let netns = status.netns.expect("a network namespace path");
    drop(client);

    // The owner "crashes": containerd is SIGKILLed and nobody stops it.
    let raw_pid = Pid::from_raw(i32::try_from(pid).unwrap());
    nix::sys::signal::kill(raw_pid, Signal::SIGKILL).unwrap();
    waitpid(raw_pid, None).unwrap();
    std::mem::forget(containerd);
    // Whatever happens below, nothing of it may outlive the test.
    let _leftovers = LeftoversGuard;

    // What a crash leaves: the shim, the pause process, the mounts.
    assert!(
        !processes_of(0, &dirs.socket()).is_empty(),
        "no shim left to clean up"
    );
    assert!(Path::new(&format!("/proc/{pause_pid}")).exists());
    assert!(!mounts_under(&[&dirs.state, &dirs.root]).is_empty());
    assert!(netns.exists());

    let started = Instant::now();
    cri::teardown_leftovers().unwrap();
    println!("teardown_leftovers took {:?}", started.elapsed());
    let pause_stat = fs::read_to_string(format!("/proc/{pause_pid}/stat")).unwrap_or_default();
    assert!(
        pause_stat.is_empty() || pause_stat.contains(") Z "),
        "the pause process {pause_pid} still runs: {pause_stat}"
    );
    assert!(!netns.exists());
    assert_nothing_left(pid, &dirs, &[id]);
}

#[test]
fn a_cni_failure_surfaces_in_the_rpc_message() {
    const MISSING_PLUGIN: &str = "vpcnet-no-such-plugin";
    let _lock = lab_session();
    cri::teardown_leftovers().expect("removing a containerd left by an earlier run");
    let _ns = TestNs::new();
    let cni = CniDirs::with_main_plugin(MISSING_PLUGIN);
    let containerd = start_containerd(&cni);
    let dirs = containerd.dirs().clone();
    let pid = containerd.pid();
    let client = containerd.client().unwrap();

    let err = client.run_pod_sandbox(&pod(0)).unwrap_err();
    println!("RunPodSandbox failed as it should: {err}");
    let message = err.rpc_message().expect("a CRI error");
    assert!(message.contains(MISSING_PLUGIN), "{message}");
    // containerd 1.6 keeps the sandbox, not ready, for kubelet to stop and
    // remove.
    let sandboxes = client.list_pod_sandboxes().unwrap();
    assert_eq!(sandboxes.len(), 1, "{sandboxes:?}");
    assert_eq!(sandboxes[0].state, SandboxState::NotReady);
    drop(client);

    // Its CNI DEL fails the same way, so stopping says so, and removes
    // everything by force anyway.
    let err = containerd.stop().unwrap_err();
    println!("stop: {err}");
    assert!(
        matches!(&err, cri::CriError::SandboxesForced(why) if why.contains(MISSING_PLUGIN)),
        "{err}"
    );
    assert_nothing_left(pid, &dirs, &[]);
}

#[test]
fn teardown_leftovers_removes_sandboxes_of_a_containerd_nobody_owns() {
    let _lock = lab_session();
    cri::teardown_leftovers().expect("removing a containerd left by an earlier run");
    let _ns = TestNs::new();
    let cni = CniDirs::new();
    let containerd = start_containerd(&cni);
    let dirs = containerd.dirs().clone();
    let pid = containerd.pid();
    let client = containerd.client().unwrap();
    let id = run_pod(&client, &pod(0));
    drop(client);
    assert_eq!(cni.leases().len(), 1, "host-local gave one address");

    // The owner "crashes" (as a panicking test that aborts would): the
    // daemon runs on, unowned.
    std::mem::forget(containerd);
    let _leftovers = LeftoversGuard;

    cri::teardown_leftovers().unwrap();
    // It was this process's child: reap it.
    waitpid(Pid::from_raw(i32::try_from(pid).unwrap()), None).unwrap();
    // The daemon answered, so the sandbox went through CRI: the CNI DEL
    // released its address.
    assert_eq!(
        cni.leases(),
        Vec::<String>::new(),
        "the CNI DEL did not run"
    );
    assert_nothing_left(pid, &dirs, &[id]);
}
