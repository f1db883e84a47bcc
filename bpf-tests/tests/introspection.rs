//! The running agent's introspection (127.0.0.1:61679) and Prometheus
//! metrics (:61678) as an operator on the node uses them: the pool and the
//! ENIs they show are what the CNI backend handed out and what EC2 holds,
//! every metric line parses, and `vpcnet-agent pods` / `enis` print it.
//!
//! Run: `cargo build -p vpcnet-agent --bins && cargo test -p
//! vpcnet-bpf-tests --test introspection -- --test-threads=1 --nocapture`.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, UdpSocket},
    time::{Duration, Instant},
};

use serde_json::Value;
use vpcnet_api::cni::DelNetworkRequest;
use vpcnet_bpf_tests::{
    agent_cli,
    ipam::{IpamLab, ec2_call, holdings, lab_lock, pod},
    scrape::{
        INTROSPECTION, METRICS, Samples, get, get_in, parse_exposition, promtool_check_kept_names,
        raw_sample, sample, sample_if, scrape, scrape_until,
    },
};
use vpcnet_lab::{
    addrs::{INET_ADDR, NODE_PRIMARY_ADDR, NS_NODE, NS_PEER},
    ec2::config::{FaultRule, LAB_NODE_SUBNET_ID},
};

/// ADDs the test makes.
const PODS: usize = 5;
/// The agent's variables besides the lab's.
const SETTINGS_ENV: &[(&str, &str)] = &[
    ("AWS_VPC_K8S_CNI_CONNMARK", "0x40"),
    ("AWS_VPC_CNI_NODE_PORT_SUPPORT", "false"),
    ("AWS_MANAGE_ENIS_NON_SCHEDULABLE", "true"),
];

/// vpcnet's metric names promtool would name otherwise, kept as released.
const KEPT_VPCNET_NAMES: &[&str] = &["vpcnet_gc_last_pass_microseconds"];

/// `GET path` on the introspection endpoint: 200 and JSON.
fn get_json(path: &str) -> Value {
    let answer = get(INTROSPECTION, path);
    assert_eq!(answer.status, 200, "GET {path}: {}", answer.body);
    assert_eq!(
        answer.headers.get("content-type").map(String::as_str),
        Some("application/json"),
        "{path}"
    );
    serde_json::from_str(&answer.body).unwrap_or_else(|e| panic!("{path}: {e}: {}", answer.body))
}

fn n(count: usize) -> u64 {
    u64::try_from(count).expect("a count")
}

/// The agent's ENIs and EC2's for this instance agree (the pool may still
/// be moving just after the ADDs: both are read again until they do).
fn settled_enis(lab: &IpamLab, instance: &str) -> (Value, vpcnet_lab::ec2::model::StateSnapshot) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let enis = get_json("/v1/enis");
        let ec2 = lab.ec2_state();
        let theirs: BTreeSet<String> = ec2
            .enis
            .iter()
            .filter(|e| {
                e.attachment
                    .as_ref()
                    .is_some_and(|a| a.instance_id == instance)
            })
            .map(|e| e.id.clone())
            .collect();
        let ours: BTreeSet<String> = enis["enis"]
            .as_array()
            .expect("enis")
            .iter()
            .map(|e| e["id"].as_str().expect("id").to_owned())
            .collect();
        let held = holdings(&ec2, instance).pod_addrs.len();
        if ours == theirs && enis["total_addresses"] == held {
            return (enis, ec2);
        }
        assert!(
            Instant::now() < deadline,
            "the agent's ENIs {ours:?} ({} addresses) never matched EC2's {theirs:?} ({held})",
            enis["total_addresses"]
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
#[allow(clippy::too_many_lines)] // one operator's session, endpoint by endpoint
fn introspection_and_metrics_show_what_the_agent_holds() {
    let _lock = lab_lock();
    // Variables aws-node's settings paths show as read (one of them has no
    // effect in vpcnet, and says so at start).
    let mut lab = IpamLab::up("m5.large", SETTINGS_ENV);
    let instance = lab.emulator().instance_id().to_owned();
    let mut added = BTreeMap::new();
    for id in 0..PODS {
        let reply = lab.add(id).expect("ADD");
        let addr: Ipv4Addr = reply.ipv4_addr.parse().expect("an address");
        added.insert(format!("pod-{id}"), addr);
    }
    // WARM_ENI_TARGET=1 on an m5.large (9 secondary addresses an ENI):
    // with 5 assigned, a second ENI comes, 18 addresses in all.
    lab.wait_status("the warm pool", Duration::from_secs(30), |s| {
        s.total_addrs >= s.assigned_addrs + 9
    });
    let status = lab.status();

    // /v1/enis: the ENIs EC2 has attached to this instance, each with its
    // link, datapath entry, addresses, and the pods holding them.
    let (enis, ec2) = settled_enis(&lab, &instance);
    assert_eq!(enis["ipam"], true);
    assert_eq!(enis["max_enis"], 3, "an m5.large takes 3 ENIs");
    assert_eq!(enis["assigned_addresses"], PODS);
    let mut assigned_seen = BTreeMap::new();
    for eni in enis["enis"].as_array().expect("enis") {
        let id = eni["id"].as_str().expect("id");
        let theirs = ec2.eni(id).expect("the ENI in EC2");
        let attachment = theirs.attachment.as_ref().expect("attached");
        assert_eq!(eni["device_number"], attachment.device_index, "{id}");
        assert_eq!(eni["mac"], theirs.mac.as_str(), "{id}");
        assert_eq!(
            eni["primary_address"],
            theirs.primary_ip.to_string(),
            "{id}"
        );
        let addresses: BTreeSet<Ipv4Addr> = eni["addresses"]
            .as_array()
            .expect("addresses")
            .iter()
            .map(|a| {
                a["address"]
                    .as_str()
                    .expect("address")
                    .parse()
                    .expect("IPv4")
            })
            .collect();
        let ec2_addresses: BTreeSet<Ipv4Addr> = theirs.secondary_ips.iter().copied().collect();
        assert_eq!(addresses, ec2_addresses, "addresses of {id}");
        assert_eq!(eni["total_addresses"], addresses.len());
        let link = &eni["link"];
        assert!(link["ifindex"].as_u64().is_some(), "{id} has a link: {eni}");
        if eni["primary"] == true {
            assert_eq!(link["name"], "eth0");
            assert_eq!(eni["primary_address"], NODE_PRIMARY_ADDR.to_string());
        }
        assert_eq!(
            eni["datapath"]["programs_attached"], true,
            "{id}: the ENI programs are on its link: {eni}"
        );
        assert_eq!(eni["datapath"]["gateway"], eni["gateway"], "{id}");
        for a in eni["addresses"].as_array().expect("addresses") {
            if let Some(pod) = a["pod"].as_object() {
                assigned_seen.insert(
                    pod["name"].as_str().expect("name").to_owned(),
                    a["address"]
                        .as_str()
                        .expect("address")
                        .parse::<Ipv4Addr>()
                        .expect("IPv4"),
                );
            }
        }
    }
    assert_eq!(assigned_seen, added, "who holds what, as the ADDs said");

    // /v1/pods: the five pods. The test's ADDs name no host veth, so the
    // datapath has no entry for them, and says so.
    let pods = get_json("/v1/pods");
    assert_eq!(pods["ipam"], true);
    assert_eq!(pods["count"], PODS);
    let listed: BTreeMap<String, Ipv4Addr> = pods["pods"]
        .as_array()
        .expect("pods")
        .iter()
        .map(|p| {
            assert_eq!(p["namespace"], "default");
            assert_eq!(p["ifname"], "eth0");
            assert_eq!(p["network"], "aws-cni");
            assert_eq!(p["container_id"].as_str().map(str::len), Some(64));
            assert!(
                p["eni"].as_str().is_some_and(|e| e.starts_with("eni-")),
                "{p}"
            );
            assert!(p["endpoint"].is_null() && p["host_veth"].is_null(), "{p}");
            (
                p["name"].as_str().expect("name").to_owned(),
                p["address"]
                    .as_str()
                    .expect("address")
                    .parse()
                    .expect("IPv4"),
            )
        })
        .collect();
    assert_eq!(listed, added);
    assert_eq!(pods["datapath_only"], serde_json::json!([]));

    // /v1/config: the datapath's flags and CIDRs, the IPAM settings.
    let config = get_json("/v1/config");
    let datapath = &config["datapath"];
    assert_eq!(datapath["node_address"], NODE_PRIMARY_ADDR.to_string());
    assert_eq!(datapath["external_snat"], false);
    assert_eq!(datapath["randomize_snat"], "prng");
    assert_eq!(datapath["port_min"], 1024);
    assert_eq!(datapath["port_max"], 65535);
    assert_eq!(
        datapath["cidrs"]["vpc"],
        serde_json::json!(["10.20.0.0/16", "100.64.0.0/16"])
    );
    assert!(
        datapath["cidrs"]["local"]
            .as_array()
            .is_some_and(|l| l.contains(&Value::from(format!("{NODE_PRIMARY_ADDR}/32")))),
        "{datapath}"
    );
    assert_eq!(config["primary_interface"], "eth0");
    assert_eq!(config["ipam"]["WARM_ENI_TARGET"], 1);
    assert_eq!(config["ipam"]["WARM_IP_TARGET"], Value::Null);
    assert_eq!(config["introspection_address"], INTROSPECTION);
    assert_eq!(config["metrics_address"], "0.0.0.0:61678");

    // /v1/nat: a flow of the node's own (UDP to the lab's internet host)
    // is in the table, with its port reserved.
    let local_port = vpcnet_lab::run_in(NS_NODE, || {
        let socket = UdpSocket::bind("0.0.0.0:0").expect("a UDP socket");
        socket
            .send_to(b"introspection", (INET_ADDR, 9))
            .expect("sending");
        socket.local_addr().expect("bound").port()
    })
    .expect("a thread in the node");
    let nat = get_json("/v1/nat");
    let total = nat["total"].as_u64().expect("total");
    assert!(total >= 1, "{nat}");
    assert_eq!(nat["limit"], 1000);
    assert_eq!(nat["table_size"], vpcnet_common::maps::NAT_DEFAULT_ENTRIES);
    let flow = nat["flows"]
        .as_array()
        .expect("flows")
        .iter()
        .find(|f| f["remote"] == format!("{INET_ADDR}:9"))
        .unwrap_or_else(|| panic!("the node's UDP flow in {nat}"));
    assert_eq!(flow["proto"], "udp");
    assert_eq!(flow["kind"], "host");
    assert_eq!(
        flow["original"],
        format!("{NODE_PRIMARY_ADDR}:{local_port}")
    );
    // /v1/nat/summary: the maps' fill, the node's UDP flow among the
    // busiest remote endpoints, the collector's passes (its first runs at
    // start, its figures come with the pass after it ends).
    let remote = format!("{INET_ADDR}:9");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    let summary = loop {
        let summary = get_json("/v1/nat/summary");
        if summary["collector"]["passes"].as_u64() >= Some(1)
            || std::time::Instant::now() > deadline
        {
            break summary;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert!(
        summary["collector"]["passes"].as_u64() >= Some(1),
        "{summary}"
    );
    let fwd = summary["maps"]
        .as_array()
        .and_then(|maps| maps.iter().find(|m| m["map"] == "VPCNET_NAT_FWD"))
        .unwrap_or_else(|| panic!("the NAT map in {summary}"));
    assert!(fwd["entries"].as_u64() >= Some(1), "{summary}");
    assert_eq!(fwd["capacity"], vpcnet_common::maps::NAT_DEFAULT_ENTRIES);
    let busiest = summary["busiest_remote_endpoints"]
        .as_array()
        .expect("busiest_remote_endpoints");
    assert!(
        busiest
            .iter()
            .any(|e| e["remote"] == remote && e["proto"] == "udp" && e["ports"] == 1),
        "{summary}"
    );
    assert_eq!(
        summary["port_range"],
        u32::from(vpcnet_common::config::DEFAULT_PORT_MAX)
            - u32::from(vpcnet_common::config::DEFAULT_PORT_MIN)
            + 1
    );
    // The same from the command line, on the node.
    let agent = vpcnet_bpf_tests::agent_binary();
    let printed = vpcnet_lab::exec_ok(
        NS_NODE,
        &[agent.to_str().expect("a UTF-8 path"), "nat", "--summary"],
    )
    .expect("vpcnet-agent nat --summary");
    assert!(printed.contains("VPCNET_NAT_FWD"), "{printed}");
    assert!(
        printed
            .lines()
            .any(|line| line.starts_with("udp") && line.contains(&remote)),
        "{printed}"
    );
    assert!(printed.contains("garbage collector: "), "{printed}");
    assert!(!printed.contains("no figures"), "{printed}");
    println!("vpcnet-agent nat --summary:\n{printed}");
    let none = get_json("/v1/nat?limit=0");
    assert_eq!(none["returned"], 0);
    assert_eq!(none["truncated"], true);
    assert!(none["total"].as_u64() >= Some(1));
    let bad = get(INTROSPECTION, "/v1/nat?limit=many");
    assert_eq!(bad.status, 400);
    let missing = get(INTROSPECTION, "/v1/nothing");
    assert_eq!(missing.status, 404);
    let error: Value = serde_json::from_str(&missing.body).expect("a JSON error");
    assert!(
        error["error"]
            .as_str()
            .is_some_and(|e| e.contains("/v1/pods"))
    );

    // /metrics: every line parses; the pool's figures are the ones above.
    let scrape = get(METRICS, "/metrics");
    assert_eq!(scrape.status, 200);
    assert_eq!(
        scrape.headers.get("content-type").map(String::as_str),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    let (types, samples) = parse_exposition(&scrape.body);
    promtool_check_kept_names(&scrape.body, KEPT_VPCNET_NAMES);
    let value = |name: &str| sample(&samples, name, &[]);
    let pod_addrs = holdings(&ec2, &instance).pod_addrs.len();
    assert_eq!(value("awscni_assigned_ip_addresses"), n(PODS));
    assert_eq!(value("awscni_total_ip_addresses"), n(pod_addrs));
    assert_eq!(
        value("awscni_total_ip_addresses"),
        u64::from(status.total_addrs)
    );
    assert_eq!(
        value("awscni_eni_allocated"),
        enis["count"].as_u64().expect("count")
    );
    assert_eq!(value("awscni_eni_max"), 3);
    assert_eq!(
        value("awscni_ip_max"),
        27,
        "3 ENIs of 9 secondary addresses"
    );
    assert_eq!(value("awscni_total_ipv4_prefixes"), 0);
    assert_eq!(value("awscni_add_ip_req_count"), n(PODS));
    assert_eq!(value("vpcnet_ipam_assigned_total"), n(PODS));
    assert_eq!(value("vpcnet_ipam_released_total"), 0);
    let per_eni: u64 = samples
        .iter()
        .filter(|(name, _, _)| name == "awscni_assigned_ip_per_eni")
        .map(|(_, labels, _)| {
            let eni = &labels["eni"];
            sample(&samples, "awscni_assigned_ip_per_eni", &[("eni", eni)])
        })
        .sum();
    assert_eq!(per_eni, n(PODS));
    assert_eq!(
        value("vpcnet_nat_table_size"),
        u64::from(vpcnet_common::maps::NAT_DEFAULT_ENTRIES)
    );
    assert!(value("vpcnet_nat_flows") >= 1);
    assert!(
        sample(
            &samples,
            "vpcnet_nat_remote_endpoint_ports",
            &[("proto", "udp"), ("remote", remote.as_str())]
        ) >= 1,
        "the node's UDP flow holds a port toward inet"
    );
    assert_eq!(
        sample(
            &samples,
            "vpcnet_map_capacity",
            &[("map", "VPCNET_STACK_PAIRS")]
        ),
        u64::from(vpcnet_common::maps::STACK_FLOWS_DEFAULT_ENTRIES)
    );
    assert!(value("vpcnet_gc_passes_total") >= 1);
    assert!(
        sample(
            &samples,
            "vpcnet_datapath_verdicts_total",
            &[("verdict", "egress_host_new")]
        ) >= 1,
        "the UDP flow counted"
    );
    assert_eq!(
        sample(
            &samples,
            "vpcnet_datapath_drops_total",
            &[("reason", "nat_table_full")]
        ),
        0
    );
    for (name, kind) in [
        ("awscni_add_ip_req_count", "counter"),
        ("awscni_assigned_ip_addresses", "gauge"),
        ("vpcnet_datapath_drops_total", "counter"),
        ("vpcnet_nat_port_alloc_retries_total", "counter"),
        ("vpcnet_nat_flows", "gauge"),
    ] {
        assert_eq!(types[name], kind, "{name}");
    }
    assert_eq!(
        get(METRICS, "/v1/pods").status,
        404,
        "metrics port: /metrics only"
    );

    // A Prometheus elsewhere in the VPC scrapes the node's address; the
    // introspection endpoint stays on the node's loopback.
    let node_metrics = format!("{NODE_PRIMARY_ADDR}:61678");
    let remote = get_in(NS_PEER, &node_metrics, "/metrics").expect("scraping from the peer");
    assert_eq!(remote.status, 200);
    let refused = get_in(NS_PEER, &format!("{NODE_PRIMARY_ADDR}:61679"), "/v1/pods");
    assert!(
        refused.is_err(),
        "introspection must not answer outside the node"
    );

    // The operator's commands, in the node.
    let printed = agent_cli(&["pods"]);
    println!("vpcnet-agent pods:\n{printed}");
    for (name, addr) in &added {
        assert!(
            printed
                .lines()
                .any(|l| l.contains(&format!(" {name} ")) && l.contains(&addr.to_string())),
            "{name} {addr} in:\n{printed}"
        );
    }
    assert!(printed.contains(&format!("{PODS} pods")), "{printed}");
    let printed = agent_cli(&["enis"]);
    println!("vpcnet-agent enis:\n{printed}");
    for eni in enis["enis"].as_array().expect("enis") {
        assert!(
            printed.contains(eni["id"].as_str().expect("id")),
            "{printed}"
        );
    }
    assert!(printed.contains("eth0 ("), "{printed}");
    assert!(
        printed.contains(&format!("{PODS} of {pod_addrs} addresses assigned")),
        "{printed}"
    );
    for (name, addr) in &added {
        assert!(
            printed.lines().any(|l| {
                let fields: Vec<&str> = l.split_whitespace().collect();
                fields == [addr.to_string().as_str(), &format!("default/{name}")]
            }),
            "{printed}"
        );
    }
    let all = agent_cli(&["enis", "--all"]);
    assert_eq!(
        all.lines().filter(|l| l.contains(" free")).count(),
        pod_addrs - PODS,
        "{all}"
    );
    println!(
        "GET /metrics: {} families, {} samples; /v1/nat: {total} flows",
        types.len(),
        samples.len()
    );
    aws_node_metrics_follow_real_events(&mut lab, &added);
    aws_node_settings_paths();
    lab.lab.down().expect("taking the lab down");
}

/// aws-node's metrics that count events, after real ones: EC2 calls as the
/// emulator saw them, the start, a DEL, an address someone else assigned,
/// an EC2 error.
#[allow(clippy::too_many_lines)] // one event after another
fn aws_node_metrics_follow_real_events(lab: &mut IpamLab, added: &BTreeMap<String, Ipv4Addr>) {
    let (types, samples) = scrape();
    for (name, kind) in [
        ("awscni_ec2api_req_count", "counter"),
        ("awscni_aws_api_latency_ms", "summary"),
        ("awscni_ipamd_action_inprogress", "gauge"),
        ("awscni_reconcile_count", "counter"),
        ("awscni_assigned_ip_per_cidr", "gauge"),
        ("awscni_ipamd_startup_duration_seconds", "histogram"),
        (
            "awscni_ipamd_node_initialization_duration_seconds",
            "histogram",
        ),
    ] {
        assert_eq!(types.get(name).map(String::as_str), Some(kind), "{name}");
    }
    // Settled ENIs are made and attached no more: the agent's counts are
    // the emulator's.
    let calls = lab
        .emulator()
        .admin()
        .calls()
        .expect("the emulator's calls");
    for action in [
        "DescribeInstanceTypes",
        "CreateNetworkInterface",
        "AttachNetworkInterface",
    ] {
        let theirs = calls.action(action).calls;
        assert!(theirs >= 1, "{action} was called");
        let ours = sample_if(&samples, "awscni_ec2api_req_count", &[("fn", action)]);
        assert_eq!(ours, Some(theirs), "awscni_ec2api_req_count{{fn={action}}}");
        let ok = [("api", action), ("error", "false"), ("status", "200")];
        assert_eq!(
            sample_if(&samples, "awscni_aws_api_latency_ms_count", &ok),
            Some(theirs),
            "{action}'s latency"
        );
    }
    let imds = [
        ("api", "GetMetadata"),
        ("error", "false"),
        ("status", "200"),
    ];
    assert!(sample_if(&samples, "awscni_aws_api_latency_ms_count", &imds) >= Some(1));
    assert_eq!(
        sample_if(
            &samples,
            "awscni_ec2api_error_count",
            &[("fn", "CreateNetworkInterface")]
        ),
        None,
        "no failed call yet"
    );
    // One start, without a Kubernetes API (this lab has none), and one
    // address manager start, both over.
    let started = [
        ("success", "true"),
        ("with_api_server", "false"),
        ("failure_reason", ""),
    ];
    assert_eq!(
        sample_if(
            &samples,
            "awscni_ipamd_startup_duration_seconds_count",
            &started
        ),
        Some(1)
    );
    let startup: f64 = raw_sample(
        &samples,
        "awscni_ipamd_startup_duration_seconds_sum",
        &started,
    )
    .and_then(|v| v.parse().ok())
    .expect("the start's duration");
    assert!(startup > 0.0 && startup < 300.0, "{startup}");
    let mut inf = started.to_vec();
    inf.push(("le", "+Inf"));
    assert_eq!(
        sample_if(
            &samples,
            "awscni_ipamd_startup_duration_seconds_bucket",
            &inf
        ),
        Some(1)
    );
    assert_eq!(
        sample_if(
            &samples,
            "awscni_ipamd_node_initialization_duration_seconds_count",
            &[("success", "true")]
        ),
        Some(1)
    );
    assert_eq!(
        sample_if(
            &samples,
            "awscni_ipamd_action_inprogress",
            &[("fn", "nodeInit")]
        ),
        Some(0)
    );
    for action in [
        "increaseDatastorePool",
        "decreaseDatastorePool",
        "nodeIPPoolReconcile",
    ] {
        let under_way = sample_if(
            &samples,
            "awscni_ipamd_action_inprogress",
            &[("fn", action)],
        );
        assert!(
            under_way == Some(0) || under_way == Some(1),
            "{action}: {under_way:?}"
        );
    }
    // Each pod's address is a /32 of the pool holding one pod.
    for addr in added.values() {
        assert_eq!(
            sample_if(
                &samples,
                "awscni_assigned_ip_per_cidr",
                &[("cidr", &format!("{addr}/32"))]
            ),
            Some(1),
            "{addr}"
        );
    }
    let per_cidr: u64 = samples
        .iter()
        .filter(|(name, _, _)| name == "awscni_assigned_ip_per_cidr")
        .map(|(_, _, v)| v.parse::<u64>().expect("a count"))
        .sum();
    assert_eq!(per_cidr, n(PODS));

    // A DEL, as the plugin sends it for a deleted pod.
    let mut client = lab.client();
    let released = lab
        .block_on(client.del_network(DelNetworkRequest {
            pod: Some(pod(0)),
            host_veth: String::new(),
            reason: vpcnet_api::del_reason::POD_DELETED.to_owned(),
        }))
        .expect("DEL")
        .into_inner();
    assert_eq!(released.ipv4_addr, added["pod-0"].to_string());
    let (_, samples) = scrape();
    assert_eq!(
        sample_if(
            &samples,
            "awscni_del_ip_req_count",
            &[("reason", "PodDeleted")]
        ),
        Some(1)
    );
    assert_eq!(
        sample_if(
            &samples,
            "awscni_assigned_ip_per_cidr",
            &[("cidr", &format!("{}/32", added["pod-0"]))]
        ),
        Some(0),
        "the released address holds no pod"
    );

    // An ENI someone else attaches (an operator's, untagged): the node's
    // reconcile takes it in (aws-node's eniReconcileAdd).
    let found = [("fn", "eniReconcileAdd")];
    let found_before =
        sample_if(&samples, "awscni_reconcile_count", &found).expect("the reconcile's count");
    let instance = lab.emulator().instance_id().to_owned();
    let operators = lab
        .emulator()
        .admin()
        .create_leaked_eni(LAB_NODE_SUBNET_ID, &BTreeMap::new(), 3)
        .expect("the operator's ENI");
    let eni = operators.clone();
    ec2_call(|cloud| async move { cloud.attach_eni(&eni, &instance, 2).await })
        .expect("attaching the operator's ENI");
    scrape_until(
        &format!("{operators} taken in by the node's reconcile"),
        Duration::from_secs(30),
        |samples| sample_if(samples, "awscni_reconcile_count", &found) >= Some(found_before + 1),
    );

    // EC2 throttles every call that could grow the pool; pods enough to
    // go below a free ENI's worth make the agent ask, fail, and count it.
    let grow = ["AssignPrivateIpAddresses", "CreateNetworkInterface"];
    let admin = lab.emulator().admin();
    admin
        .set_faults(&grow.map(|action| FaultRule {
            action: action.to_owned(),
            throttle: 1.0,
            ..FaultRule::default()
        }))
        .expect("injecting throttling");
    for id in PODS..PODS + 10 {
        lab.add(id).expect("ADD");
    }
    let failed_call = |samples: &Samples| {
        grow.into_iter().find(|action| {
            sample_if(samples, "awscni_ec2api_error_count", &[("fn", action)]) >= Some(1)
        })
    };
    let samples = scrape_until(
        "a throttled call counted",
        Duration::from_secs(90),
        |samples| failed_call(samples).is_some(),
    );
    lab.emulator()
        .admin()
        .set_faults(&[])
        .expect("ending the throttling");
    let action = failed_call(&samples).expect("a failed call");
    let failed = [("fn", action)];
    let body = get(METRICS, "/metrics").body;
    promtool_check_kept_names(&body, KEPT_VPCNET_NAMES);
    let types = parse_exposition(&body).0;
    assert_eq!(types["awscni_ec2api_error_count"], "counter");
    assert_eq!(types["awscni_aws_api_error_count"], "counter");
    assert_eq!(types["awscni_del_ip_req_count"], "counter");
    let errors = sample_if(&samples, "awscni_ec2api_error_count", &failed).expect("errors");
    let throttled = lab
        .emulator()
        .admin()
        .calls()
        .expect("the emulator's calls")
        .action(action)
        .throttled;
    assert!(
        errors <= throttled,
        "{errors} failed calls, {throttled} throttled answers (the SDK retries within a call)"
    );
    assert!(
        sample_if(
            &samples,
            "awscni_aws_api_error_count",
            &[("api", action), ("error", "RequestLimitExceeded")]
        ) >= Some(errors),
        "every failed call was a throttled one"
    );
    assert!(
        sample_if(
            &samples,
            "awscni_aws_api_latency_ms_count",
            &[
                ("api", action),
                ("error", "true"),
                ("status", "RequestLimitExceeded")
            ]
        ) >= Some(errors)
    );
    assert!(
        sample_if(&samples, "awscni_ec2api_req_count", &failed) >= Some(errors),
        "the failed calls are requests too"
    );
    println!("{action}: {errors} failed calls, {throttled} throttled answers");
}

/// aws-node's three settings paths, with its JSON shapes.
fn aws_node_settings_paths() {
    let ipamd = get_json("/v1/ipamd-env-settings");
    assert_eq!(
        ipamd,
        serde_json::json!({
            "WARM_IP_TARGET": 0,
            "WARM_ENI_TARGET": 1,
            "AWS_VPC_K8S_CNI_CUSTOM_NETWORK_CFG": false,
            "AWS_MANAGE_ENIS_NON_SCHEDULABLE": true,
            "ENABLE_SUBNET_DISCOVERY": true,
        })
    );
    let network = get_json("/v1/networkutils-env-settings");
    assert_eq!(
        network,
        serde_json::json!({
            "AWS_VPC_K8S_CNI_CONNMARK": 64,
            "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS": null,
            "AWS_VPC_K8S_CNI_EXTERNALSNAT": false,
            "AWS_EXTERNAL_SERVICE_CIDRS": null,
            "AWS_VPC_ENI_MTU": 9001,
            "AWS_VPC_K8S_CNI_VETHPREFIX": "eni",
            "AWS_VPC_CNI_NODE_PORT_SUPPORT": false,
            "AWS_VPC_K8S_CNI_RANDOMIZESNAT": 2,
        })
    );
    let eni_config = get_json("/v1/eni-configs");
    assert_eq!(eni_config["custom_networking"], false);
    assert_eq!(eni_config["name"], Value::Null);
    assert_eq!(eni_config["subnet"], Value::Null);
    let index = get_json("/");
    for path in [
        "/v1/eni-configs",
        "/v1/ipamd-env-settings",
        "/v1/networkutils-env-settings",
    ] {
        assert!(
            index["paths"]
                .as_array()
                .is_some_and(|p| p.contains(&Value::from(path))),
            "{path} in {index}"
        );
    }
}

/// Without `--ipam` (the lab's layout gives the node its pods): no pool to
/// show, but the datapath's entries, and the metrics of the datapath.
#[test]
fn without_the_address_manager_the_datapath_is_shown() {
    let _lock = lab_lock();
    let lab = vpcnet_lab::Lab::up(&vpcnet_lab::LabOptions {
        enis: 2,
        ..vpcnet_lab::LabOptions::ebpf(2, vpcnet_bpf_tests::agent_binary())
    })
    .expect("bringing up the lab");

    let pods = get_json("/v1/pods");
    assert_eq!(pods["ipam"], false);
    assert_eq!(pods["count"], 0);
    let entries = pods["datapath_only"].as_array().expect("entries");
    assert_eq!(entries.len(), lab.pods().len(), "{pods}");
    for pod in lab.pods() {
        let entry = entries
            .iter()
            .find(|e| e["address"] == pod.addr.to_string())
            .unwrap_or_else(|| panic!("{} in {pods}", pod.addr));
        assert_eq!(entry["interface"], pod.host_veth.as_str(), "{entry}");
        assert_eq!(entry["eni_interface"], pod.eni.as_str(), "{entry}");
        assert_eq!(entry["mac"], pod.mac.as_str(), "{entry}");
        assert_eq!(entry["host_mac"], pod.host_veth_mac.as_str(), "{entry}");
        assert_eq!(entry["programs_attached"], true, "{entry}");
    }

    let enis = get_json("/v1/enis");
    assert_eq!(enis["ipam"], false);
    assert_eq!(enis["enis"], serde_json::json!([]));
    let links: BTreeSet<&str> = enis["datapath_only"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| {
            assert_eq!(e["programs_attached"], true, "{e}");
            e["interface"].as_str().expect("a link name")
        })
        .collect();
    assert!(links.contains("eth0") && links.contains("eth1"), "{enis}");

    let config = get_json("/v1/config");
    assert_eq!(config["ipam"], Value::Null);
    assert_eq!(
        config["datapath"]["node_address"],
        NODE_PRIMARY_ADDR.to_string()
    );

    let scrape = get(METRICS, "/metrics");
    assert_eq!(scrape.status, 200);
    let (types, samples) = parse_exposition(&scrape.body);
    promtool_check_kept_names(&scrape.body, KEPT_VPCNET_NAMES);
    assert!(
        !types.contains_key("awscni_total_ip_addresses"),
        "no pool without the address manager"
    );
    assert_eq!(
        sample(&samples, "vpcnet_datapath_endpoints", &[]),
        n(lab.pods().len())
    );

    let printed = agent_cli(&["pods"]);
    println!("vpcnet-agent pods (no --ipam):\n{printed}");
    assert!(printed.contains("without --ipam"), "{printed}");
    for pod in lab.pods() {
        assert!(
            printed.contains(&pod.addr.to_string()) && printed.contains(&pod.host_veth),
            "{printed}"
        );
    }
    let printed = agent_cli(&["enis"]);
    println!("vpcnet-agent enis (no --ipam):\n{printed}");
    assert!(
        printed.contains("eth0") && printed.contains("primary"),
        "{printed}"
    );
    lab.down().expect("taking the lab down");
}
