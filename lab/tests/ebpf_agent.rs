//! The eBPF lab's handling of the agent, with stand-in agents (shell
//! scripts) that keep or break the contract: started in `vpcnet-node` with
//! the agreed arguments and environment, ready on `READY`, stopped by `down`;
//! an agent that exits, says something else or says nothing fails `up` with
//! its log, and leaves no lab behind.
//!
//! Like every lab test: root needed, one lab at a time (`serial()`).

mod common;

use std::{
    fs,
    os::unix::fs::{MetadataExt, PermissionsExt},
    path::PathBuf,
    time::Duration,
};

use common::{assert_no_lab_left, lab_session};
use vpcnet_api::layout::NodeLayout;
use vpcnet_lab::{EnforcingMode, Lab, LabError, LabOptions, NodePortService, addrs, netns};

/// A directory for one test's stand-in agent, removed on drop.
struct FakeAgent {
    dir: PathBuf,
}

impl FakeAgent {
    fn new(test: &str, body: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("vpcnet-lab-{test}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let script = dir.join("agent");
        fs::write(&script, format!("#!/bin/sh\n{body}\n")).unwrap();
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
        Self { dir }
    }

    fn bin(&self) -> PathBuf {
        self.dir.join("agent")
    }

    fn recorded(&self, file: &str) -> String {
        fs::read_to_string(self.dir.join(file)).unwrap_or_default()
    }
}

impl Drop for FakeAgent {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Whether `pid` is gone (or a zombie nobody reaped yet).
fn exited(pid: i32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z')),
    }
}

#[test]
fn a_contract_keeping_agent_runs_in_the_node_until_down() {
    let _lab_lock = lab_session();
    let here = std::env::temp_dir().join(format!("vpcnet-lab-keeps-{}", std::process::id()));
    let agent = FakeAgent::new(
        "keeps",
        &format!(
            r#"echo "$@" > {dir}/args
env | grep ^AWS_VPC_K8S_CNI_ | sort > {dir}/env
echo "starting" >&2
echo READY
exec >&-
exec sleep 600"#,
            dir = here.display()
        ),
    );
    let opts = LabOptions {
        external_snat: true,
        exclude_snat_cidrs: vec![addrs::ONPREM_NET, "198.51.100.0/24".parse().unwrap()],
        randomize_snat: vpcnet_lab::RandomizeSnat::Sequential,
        ..LabOptions::ebpf(1, agent.bin())
    };
    let lab = Lab::up(&opts).expect("lab up with a ready agent");

    assert_eq!(
        agent.recorded("args").trim(),
        "run --primary-interface eth0 --node-addr 10.20.11.162 \
         --vpc-cidrs 10.20.0.0/16,100.64.0.0/16 --notify-ready \
         --layout /run/vpcnet-lab/layout.json"
    );
    assert_eq!(
        agent.recorded("env"),
        "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS=192.0.2.0/24,198.51.100.0/24\n\
         AWS_VPC_K8S_CNI_EXTERNALSNAT=true\n\
         AWS_VPC_K8S_CNI_RANDOMIZESNAT=none\n"
    );
    let info = lab.state().agent.clone().expect("the agent is recorded");
    let its_ns = fs::metadata(format!("/proc/{}/ns/net", info.pid)).unwrap();
    let node_ns = fs::metadata(netns::netns_path(addrs::NS_NODE)).unwrap();
    assert_eq!(its_ns.ino(), node_ns.ino(), "the agent runs in vpcnet-node");
    assert_eq!(
        fs::read_to_string(vpcnet_lab::state_dir().join("agent.pid"))
            .unwrap()
            .trim(),
        info.pid.to_string()
    );
    assert!(
        fs::read_to_string(lab.agent_log().unwrap())
            .unwrap()
            .contains("starting")
    );
    // No iptables wiring in the eBPF lab: the agent does the node's job.
    let nat = netns::exec_ok(addrs::NS_NODE, &["iptables", "-t", "nat", "-S"]).unwrap();
    assert!(!nat.contains("AWS-SNAT-CHAIN-0"), "{nat}");

    // Left running (as `cargo xtask lab up` does), then removed by
    // `down_all` (as `cargo xtask lab down` does, from another process).
    let state = lab.leave_running();
    assert!(!exited(state.agent.as_ref().unwrap().pid));
    vpcnet_lab::down_all().unwrap();
    assert!(exited(info.pid), "down stops the agent");
    assert_no_lab_left();
}

fn up_fails_with(test: &str, body: &str, timeout: Duration) -> (LabError, FakeAgent) {
    vpcnet_lab::down_all().unwrap();
    let agent = FakeAgent::new(test, body);
    let opts = LabOptions {
        agent_ready_timeout: timeout,
        ..LabOptions::ebpf(1, agent.bin())
    };
    let err = Lab::up(&opts).expect_err("the agent is not ready");
    assert_no_lab_left();
    (err, agent)
}

#[test]
fn an_agent_that_exits_fails_up_with_its_log() {
    let _lab_lock = lab_session();
    let (err, _agent) = up_fails_with(
        "exits",
        "echo 'error: could not load the datapath: no bpffs' >&2\nexit 3",
        Duration::from_secs(10),
    );
    let LabError::AgentNotReady {
        reason, log_tail, ..
    } = &err
    else {
        panic!("wrong error: {err}");
    };
    assert!(reason.contains("without printing READY"), "{reason}");
    assert!(log_tail.contains("no bpffs"), "{log_tail}");
    assert!(
        err.to_string().contains("no bpffs"),
        "the message shows the log: {err}"
    );
}

#[test]
fn an_agent_that_says_something_else_fails_up() {
    let _lab_lock = lab_session();
    let (err, _agent) = up_fails_with(
        "garbles",
        "echo 'ready!'\nexec sleep 600",
        Duration::from_secs(10),
    );
    assert!(err.to_string().contains("\"ready!\", not READY"), "{err}");
}

#[test]
fn a_silent_agent_times_out_and_is_stopped() {
    let _lab_lock = lab_session();
    let here = std::env::temp_dir().join(format!("vpcnet-lab-silent-{}", std::process::id()));
    let (err, agent) = up_fails_with(
        "silent",
        &format!("echo $$ > {}/pid\nexec sleep 600", here.display()),
        Duration::from_millis(1500),
    );
    assert!(err.to_string().contains("printed nothing within"), "{err}");
    // What it was waiting in when given up on: `sleep`, in the kernel's
    // sleep function.
    let LabError::AgentNotReady { waiting_in, .. } = &err else {
        panic!("wrong error: {err}");
    };
    assert!(waiting_in.contains("sleep 600"), "{waiting_in}");
    assert!(waiting_in.contains("nanosleep"), "{waiting_in}");
    let pid: i32 = agent.recorded("pid").trim().parse().unwrap();
    assert!(exited(pid), "the silent agent was stopped");
}

/// An eBPF lab with three ENIs, a branch pod and a node port: the agent is
/// handed the node layout (`--layout`) and the enforcing mode, and the node
/// has the links but none of the VPC CNI's policy routing: no ip rule per
/// pod or per ENI, no ENI or VLAN route table.
#[test]
fn an_ebpf_lab_hands_the_agent_its_layout_and_has_no_policy_routing() {
    let _lab_lock = lab_session();
    let here = std::env::temp_dir().join(format!("vpcnet-lab-layout-{}", std::process::id()));
    let agent = FakeAgent::new(
        "layout",
        &format!(
            r#"echo "$@" > {dir}/args
env | grep -E '^(POD_SECURITY_GROUP_ENFORCING_MODE|ENABLE_POD_ENI)=' | sort > {dir}/env
for layout; do :; done  # the last argument: --layout's
cp "$layout" {dir}/layout.json
echo READY
exec >&-
exec sleep 600"#,
            dir = here.display()
        ),
    );
    let opts = LabOptions {
        enis: 3,
        branch_pods: vec![3],
        sg_enforcing_mode: EnforcingMode::Standard,
        node_port: Some(NodePortService {
            pod: 1,
            target_port: 8080,
        }),
        ..LabOptions::ebpf(4, agent.bin())
    };
    let lab = Lab::up(&opts).expect("lab up");

    assert!(
        agent
            .recorded("args")
            .trim()
            .ends_with("--layout /run/vpcnet-lab/layout.json"),
        "{}",
        agent.recorded("args")
    );
    assert_eq!(
        agent.recorded("env"),
        "ENABLE_POD_ENI=true\nPOD_SECURITY_GROUP_ENFORCING_MODE=standard\n"
    );
    // What the agent read is the layout of this lab.
    let layout: NodeLayout = serde_json::from_str(&agent.recorded("layout.json")).unwrap();
    layout.validate().unwrap();
    assert_eq!(layout, vpcnet_lab::layout::node_layout(&opts, lab.pods()));
    let enis: Vec<_> = layout
        .enis
        .iter()
        .map(|e| (e.interface.as_str(), e.primary))
        .collect();
    assert_eq!(
        enis,
        [
            ("eth0", true),
            ("eth1", false),
            ("eth2", false),
            ("vlan.eth.1", false)
        ]
    );
    for (endpoint, pod) in layout.endpoints.iter().zip(lab.pods()) {
        assert_eq!(
            (
                endpoint.addr,
                endpoint.host_veth.as_str(),
                endpoint.eni.as_str()
            ),
            (pod.addr, pod.host_veth.as_str(), pod.eni.as_str())
        );
    }
    assert_eq!(
        layout.endpoints[3].enforcing_mode,
        Some(EnforcingMode::Standard)
    );

    check_links_without_policy_routing(&lab);
    // kube-proxy's rules run whatever the datapath: its node port, and
    // its drop of what conntrack calls invalid.
    let nat = netns::exec_ok(addrs::NS_NODE, &["iptables", "-t", "nat", "-S"]).unwrap();
    assert!(
        nat.contains("-A KUBE-NODEPORTS -p tcp -m comment --comment \"default/node-port:tcp\" -m tcp --dport 30080 -j KUBE-EXT-")
            && nat.contains("-j DNAT --to-destination 10.20.11.21:8080"),
        "{nat}"
    );
    let filter = netns::exec_ok(addrs::NS_NODE, &["iptables", "-S", "KUBE-FORWARD"]).unwrap();
    assert!(
        filter.contains("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP"),
        "{filter}"
    );

    lab.down().unwrap();
    assert_no_lab_left();
}

/// The ENI and branch links exist; no ip rule per pod or ENI, no ENI or
/// VLAN route table.
fn check_links_without_policy_routing(lab: &Lab) {
    let links = netns::exec_ok(addrs::NS_NODE, &["ip", "-o", "link", "show"]).unwrap();
    for link in ["eth1", "eth2", "vlan.eth.1"] {
        assert!(links.contains(&format!(": {link}@")), "{link}: {links}");
    }
    let rules = lab.ip_rules().unwrap();
    assert_eq!(
        rules,
        [
            "0:\tfrom all lookup local",
            "32766:\tfrom all lookup main",
            "32767:\tfrom all lookup default"
        ],
        "no ip rule per pod or ENI in the eBPF datapath"
    );
    for pod in lab.pods() {
        assert!(lab.pod_ip_rules(pod).unwrap().is_empty(), "{}", pod.netns);
    }
    let tables = netns::exec_ok(addrs::NS_NODE, &["ip", "route", "show", "table", "all"]).unwrap();
    assert!(
        !tables.contains("table 2") && !tables.contains("table 3") && !tables.contains("table 101"),
        "{tables}"
    );
}
