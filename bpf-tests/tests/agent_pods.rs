//! The agent's side of a pod, checked as an operator would with bpftool
//! and the CNI backend: ADD puts the pod into the datapath (endpoint entry,
//! programs on its host veth, links pinned), a restarted agent takes the
//! pinned links over without detaching them, a pod whose veth vanished
//! while the agent was down has its address back after the restart, an
//! address no pod ever used comes back after the grace period, and only
//! root can talk to the socket.
//!
//! Run: `cargo build --workspace --bins && cargo test -p vpcnet-bpf-tests
//! --test agent_pods -- --test-threads=1 --nocapture`.

use std::{
    net::Ipv4Addr,
    os::unix::fs::{MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use aya::programs::{SchedClassifier, TcAttachType};
use vpcnet_agent::datapath::DatapathMaps;
use vpcnet_api::cni::{
    AddNetworkRequest, CheckNetworkRequest, DelNetworkRequest, ListAttachmentsRequest,
    StatusRequest,
};
use vpcnet_bpf_tests::ipam::{IpamLab, lab_lock, pod};
use vpcnet_common::maps::{LINKS_DIR, PIN_DIR, PROG_POD_EGRESS, PROG_POD_INGRESS};
use vpcnet_lab::{addrs::NS_NODE, agent_log_file, cni_socket_file, run_in};

const POD_NS: &str = "vpcnet-agentpod";
const HOST_VETH: &str = "enitest0";
const POD_MAC: &str = "02:aa:00:00:00:02";
const HOST_MAC: &str = "02:aa:00:00:00:01";

/// The pod namespace of this test, deleted when dropped.
struct PodNamespace;

impl PodNamespace {
    fn create() -> Self {
        if Path::new("/var/run/netns").join(POD_NS).exists() {
            run(&["ip", "netns", "del", POD_NS]);
        }
        run(&["ip", "netns", "add", POD_NS]);
        Self
    }
}

impl Drop for PodNamespace {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", POD_NS]).status();
    }
}

fn run(argv: &[&str]) -> String {
    let out = Command::new(argv[0])
        .args(&argv[1..])
        .output()
        .expect("running a command");
    assert!(
        out.status.success(),
        "{argv:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The veth pair the plugin would create: host side in the node.
fn create_veth() -> u32 {
    run(&[
        "ip", "-n", NS_NODE, "link", "add", HOST_VETH, "address", HOST_MAC, "type", "veth", "peer",
        "name", "eth0", "address", POD_MAC, "netns", POD_NS,
    ]);
    run(&["ip", "-n", NS_NODE, "link", "set", HOST_VETH, "up"]);
    ifindex(HOST_VETH).expect("the host veth")
}

fn ifindex(name: &str) -> Option<u32> {
    let out = Command::new("ip")
        .args(["-n", NS_NODE, "-j", "link", "show", name])
        .output()
        .expect("ip link show");
    if !out.status.success() {
        return None;
    }
    let links: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ip -j output");
    links[0]["ifindex"]
        .as_u64()
        .map(|i| u32::try_from(i).expect("an ifindex"))
}

fn link_dir(ifindex: u32, name: &str) -> PathBuf {
    Path::new(PIN_DIR)
        .join(LINKS_DIR)
        .join(format!("{ifindex}-{name}"))
}

/// bpftool's (link id, program id) of a pinned link.
fn pinned_link(path: &Path) -> (u64, u64) {
    let out = run(&[
        "bpftool",
        "-j",
        "link",
        "show",
        "pinned",
        path.to_str().unwrap(),
    ]);
    let link: serde_json::Value = serde_json::from_str(&out).expect("bpftool JSON");
    (
        link["id"].as_u64().expect("a link id"),
        link["prog_id"].as_u64().expect("a program id"),
    )
}

/// The names of the programs on `dev`'s TCX hooks, both directions (this
/// bpftool predates TCX, so the kernel is asked directly).
fn programs_on(dev: &str) -> Vec<String> {
    let dev = dev.to_owned();
    run_in(NS_NODE, move || {
        [TcAttachType::Ingress, TcAttachType::Egress]
            .into_iter()
            .flat_map(
                |direction| match SchedClassifier::query_tcx(&dev, direction) {
                    Ok((_, programs)) => programs
                        .iter()
                        .map(|p| p.name_as_str().unwrap_or("?").to_owned())
                        .collect(),
                    Err(_) => Vec::new(),
                },
            )
            .collect()
    })
    .expect("querying TCX in the node")
}

fn add(
    lab: &mut IpamLab,
    id: usize,
    host_veth: &str,
    pod_mac: &str,
) -> Result<Ipv4Addr, tonic::Status> {
    let mut client = lab.client();
    let reply = lab.block_on(client.add_network(AddNetworkRequest {
        pod: Some(pod(id)),
        netns: format!("/var/run/netns/{POD_NS}"),
        host_veth: host_veth.to_owned(),
        pod_mac: pod_mac.to_owned(),
        ..AddNetworkRequest::default()
    }))?;
    Ok(reply.into_inner().ipv4_addr.parse().expect("an address"))
}

fn endpoint_ifindex(addr: Ipv4Addr) -> Option<u32> {
    let maps = DatapathMaps::open_pinned(Path::new(PIN_DIR)).expect("the pinned maps");
    maps.endpoint(addr)
        .expect("reading the endpoint map")
        .map(|e| e.ifindex)
}

#[test]
fn pod_datapath_follows_add_del_restarts_and_vanished_veths() {
    let _lock = lab_lock();
    let mut lab = IpamLab::up_with_args(
        "m5.large",
        &[("IP_COOLDOWN_PERIOD", "1")],
        &["--pod-sweep-interval", "0.2", "--orphan-grace", "2"],
    );
    let _pod_ns = PodNamespace::create();
    let veth_index = create_veth();

    // A host veth that does not exist: refused, and the address goes back.
    let err = add(&mut lab, 9, "enimissing", POD_MAC).unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("enimissing"), "{err:?}");
    assert_eq!(lab.status().assigned_addrs, 0, "a failed ADD holds nothing");

    let addr = add(&mut lab, 1, HOST_VETH, POD_MAC).expect("ADD");
    assert_eq!(endpoint_ifindex(addr), Some(veth_index));
    let dir = link_dir(veth_index, HOST_VETH);
    let (ingress_link, ingress_prog) = pinned_link(&dir.join(PROG_POD_INGRESS));
    let (egress_link, egress_prog) = pinned_link(&dir.join(PROG_POD_EGRESS));
    let shown = programs_on(HOST_VETH);
    assert!(
        shown.iter().any(|p| p == PROG_POD_INGRESS) && shown.iter().any(|p| p == PROG_POD_EGRESS),
        "{shown:?}"
    );
    let mut client = lab.client();
    let check = lab
        .block_on(client.check_network(CheckNetworkRequest { pod: Some(pod(1)) }))
        .expect("CHECK")
        .into_inner();
    assert_eq!(check.ipv4_addr, addr.to_string());
    assert_eq!(check.host_veth, HOST_VETH);
    assert_eq!(check.problem, "");
    let listed = lab
        .block_on(client.list_attachments(ListAttachmentsRequest {}))
        .expect("ListAttachments")
        .into_inner()
        .attachments;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].host_veth, HOST_VETH);

    // SIGKILL: the programs stay on the veth; the next agent, of the same
    // object over the same maps, keeps them in the same links.
    lab.lab.kill_agent().expect("killing the agent");
    assert!(programs_on(HOST_VETH).iter().any(|p| p == PROG_POD_INGRESS));
    lab.lab.start_agent().expect("restarting the agent");
    lab.connect();
    let (ingress_link_after, ingress_prog_after) = pinned_link(&dir.join(PROG_POD_INGRESS));
    let (egress_link_after, egress_prog_after) = pinned_link(&dir.join(PROG_POD_EGRESS));
    assert_eq!(
        (ingress_link_after, egress_link_after),
        (ingress_link, egress_link)
    );
    assert_eq!(
        (ingress_prog_after, egress_prog_after),
        (ingress_prog, egress_prog),
        "the same programs, kept"
    );
    println!(
        "restart: links {ingress_link}/{egress_link} and programs {ingress_prog}/{egress_prog} kept"
    );

    // SIGTERM: the socket goes, the programs stay.
    lab.lab.stop_agent().expect("stopping the agent");
    assert!(
        !cni_socket_file().exists(),
        "socket left after SIGTERM; agent log:\n{}",
        std::fs::read_to_string(agent_log_file()).unwrap_or_default()
    );
    assert!(programs_on(HOST_VETH).iter().any(|p| p == PROG_POD_INGRESS));
    // The pod goes while the agent is down (the plugin's DEL without an
    // agent removes the veth): the restarted agent gives its address back.
    run(&["ip", "-n", NS_NODE, "link", "del", HOST_VETH]);
    lab.lab.start_agent().expect("restarting the agent");
    lab.connect();
    lab.wait_status(
        "the vanished pod's address released",
        Duration::from_secs(10),
        |s| s.assigned_addrs == 0,
    );
    assert_eq!(endpoint_ifindex(addr), None, "endpoint entry left");
    assert!(!dir.exists(), "link pins left in {}", dir.display());

    // DEL of a pod the agent holds: entry, pins and address go at once.
    let veth_index = create_veth();
    let addr = add(&mut lab, 2, HOST_VETH, POD_MAC).expect("ADD");
    let mut client = lab.client();
    let released = lab
        .block_on(client.del_network(DelNetworkRequest {
            pod: Some(pod(2)),
            host_veth: HOST_VETH.to_owned(),
            reason: vpcnet_api::del_reason::POD_DELETED.to_owned(),
        }))
        .expect("DEL")
        .into_inner();
    assert_eq!(released.ipv4_addr, addr.to_string());
    assert_eq!(endpoint_ifindex(addr), None);
    assert!(!link_dir(veth_index, HOST_VETH).exists());
    assert!(programs_on(HOST_VETH).is_empty());
    assert_eq!(lab.status().assigned_addrs, 0);

    // An address handed out for a pod that never reaches the datapath
    // comes back once the grace period is over.
    lab.add(3).expect("address-only ADD");
    lab.wait_status(
        "the unused address released",
        Duration::from_secs(10),
        |s| s.assigned_addrs == 0,
    );

    let ready = lab
        .block_on(client.status(StatusRequest {}))
        .expect("Status")
        .into_inner();
    assert!(ready.ready && ready.available_addrs > 0, "{ready:?}");
}

#[test]
fn cni_socket_is_roots_alone() {
    let _lock = lab_lock();
    let lab = IpamLab::up("m5.large", &[]);
    let socket = cni_socket_file();
    let meta = std::fs::metadata(&socket).expect("the socket");
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(meta.uid(), 0);
    let connect = "import socket,sys\ns=socket.socket(socket.AF_UNIX)\ntry:\n s.connect(sys.argv[1]); print('connected')\nexcept PermissionError: print('refused')\n";
    let as_nobody = {
        use std::os::unix::process::CommandExt;
        Command::new("python3")
            .args(["-c", connect, socket.to_str().unwrap()])
            .uid(65534)
            .gid(65534)
            .output()
            .expect("python3 as nobody")
    };
    assert_eq!(String::from_utf8_lossy(&as_nobody.stdout).trim(), "refused");
    let as_root = run(&["python3", "-c", connect, socket.to_str().unwrap()]);
    assert_eq!(as_root.trim(), "connected");
    drop(lab);
}
