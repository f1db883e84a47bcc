//! The address manager and EC2's harder answers: prefix delegation in a
//! fragmented subnet falls back to single addresses (and says so), and
//! leaked ENIs are cleaned up while the operator's `no_manage` ENIs and
//! fresh ones another node may be attaching are left alone.
//!
//! Run: `cargo build --workspace --bins && cargo test -p vpcnet-bpf-tests
//! --test ipam_cloud -- --test-threads=1 --nocapture`.

use std::{collections::BTreeMap, net::Ipv4Addr, time::Duration};

use ipnet::Ipv4Net;
use vpcnet_agent::cloud::{TAG_CREATED_AT, TAG_INSTANCE_ID, TAG_NO_MANAGE};
use vpcnet_bpf_tests::ipam::{IpamLab, ec2_call, holdings, lab_lock};
use vpcnet_lab::ec2::config::LAB_NODE_SUBNET_ID;

#[test]
fn prefix_delegation_falls_back_to_addresses_when_no_28_is_free() {
    let _lock = lab_lock();
    let mut lab = IpamLab::up(
        "m5.large",
        &[
            ("ENABLE_PREFIX_DELEGATION", "true"),
            ("WARM_PREFIX_TARGET", "1"),
            ("IP_COOLDOWN_PERIOD", "1"),
        ],
    );
    let instance = lab.emulator().instance_id().to_owned();
    let state = lab.wait_ec2("the first prefix", Duration::from_secs(30), |s| {
        s.enis.iter().any(|e| !e.prefixes.is_empty())
    });
    // Fragment the node subnet: one address taken in every /28 nobody uses,
    // plenty of single addresses left.
    let used: Vec<Ipv4Addr> = state
        .enis
        .iter()
        .flat_map(|e| {
            e.addresses()
                .chain(e.prefixes.iter().flat_map(Ipv4Net::hosts))
                .collect::<Vec<_>>()
        })
        .collect();
    let subnet: Ipv4Net = "10.20.11.0/24".parse().expect("CIDR");
    let blocks = subnet.subnets(28).expect("/28s");
    let taken: Vec<Ipv4Addr> = blocks
        .filter(|b| !used.iter().any(|a| b.contains(a)))
        .map(|b| Ipv4Addr::from(u32::from(b.network()) + 9))
        .collect();
    let after = lab
        .emulator()
        .admin()
        .occupy(LAB_NODE_SUBNET_ID, &taken, &[])
        .expect("fragmenting the subnet");
    let view = after.subnet(LAB_NODE_SUBNET_ID).expect("the node subnet");
    assert_eq!(view.free_prefix_count, 0, "no free /28 left");
    assert!(
        view.available_ip_address_count > 100,
        "single addresses left"
    );

    // More pods than one prefix holds: the pool must grow without prefixes.
    let (addrs, _) = lab.fill(0, 40);
    assert_eq!(addrs.len(), 40, "every pod got an address");
    let status = lab.status();
    assert!(status.prefix_fallback, "the agent says it fell back");
    assert!(
        status.counters["vpcnet_ipam_prefix_fallbacks_total"] >= 1,
        "the fallback metric counts it: {:?}",
        status.counters
    );
    let event = status
        .events
        .iter()
        .find(|e| e.reason == "PrefixDelegationFallback")
        .expect("a PrefixDelegationFallback event");
    assert!(
        event.message.contains("InsufficientCidrBlocks"),
        "{}",
        event.message
    );
    // What an operator sees on the node.
    let socket = vpcnet_lab::cni_socket_file();
    let printed = vpcnet_bpf_tests::agent_cli(&["ipam", "--cni-socket", &socket.to_string_lossy()]);
    assert!(
        printed.contains("prefix delegation fell back to addresses")
            && printed.contains("PrefixDelegationFallback"),
        "vpcnet-agent ipam printed:\n{printed}"
    );
    let ec2 = lab.ec2_state();
    let secondaries: usize = ec2
        .enis
        .iter()
        .filter(|e| {
            e.attachment
                .as_ref()
                .is_some_and(|a| a.instance_id == instance)
        })
        .map(|e| e.secondary_ips.len())
        .sum();
    assert!(
        secondaries >= 40 - 16,
        "the rest are secondary addresses: {secondaries}"
    );
    let ec2 = holdings(&ec2, &instance);
    for addr in &addrs {
        assert!(
            ec2.pod_addrs.contains(addr),
            "{addr} is not the node's in EC2"
        );
    }
    println!(
        "prefix delegation: 1 prefix, then InsufficientCidrBlocks; fell back to {secondaries} secondary addresses; event: {}",
        event.message
    );
    lab.lab.down().expect("taking the lab down");
}

#[test]
fn leaked_enis_are_deleted_but_not_fresh_or_no_manage_ones() {
    let _lock = lab_lock();
    let lab = IpamLab::up("m5.large", &[("CLUSTER_NAME", "lab")]);
    let admin = lab.emulator().admin();
    let tags = |created: &str, extra: &[(&str, &str)]| {
        let mut tags: BTreeMap<String, String> = [
            (TAG_INSTANCE_ID, "i-0gone0000000000"),
            (TAG_CREATED_AT, created),
            ("cluster.k8s.amazonaws.com/name", "lab"),
        ]
        .iter()
        .chain(extra)
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        tags.retain(|_, v| !v.is_empty());
        tags
    };
    let now = vpcnet_agent::cloud::time_now_rfc3339();
    let leaked = admin
        .create_leaked_eni(LAB_NODE_SUBNET_ID, &tags("2026-01-01T00:00:00Z", &[]), 2)
        .expect("a leaked ENI");
    let fresh = admin
        .create_leaked_eni(LAB_NODE_SUBNET_ID, &tags(&now, &[]), 0)
        .expect("a fresh ENI");
    let kept = admin
        .create_leaked_eni(
            LAB_NODE_SUBNET_ID,
            &tags("2026-01-01T00:00:00Z", &[(TAG_NO_MANAGE, "true")]),
            0,
        )
        .expect("a no_manage ENI");
    let untagged_time = admin
        .create_leaked_eni(LAB_NODE_SUBNET_ID, &tags("", &[]), 0)
        .expect("an ENI without createdAt");

    let state = lab.wait_ec2("the leaked ENI deleted", Duration::from_secs(30), |s| {
        s.eni(&leaked).is_none()
            && s.eni(&untagged_time)
                .is_some_and(|e| e.tags.contains_key(TAG_CREATED_AT))
    });
    assert!(
        state.eni(&fresh).is_some(),
        "an ENI younger than 5 minutes stays"
    );
    assert!(state.eni(&kept).is_some(), "a no_manage ENI stays");
    let untagged = state.eni(&untagged_time).expect("kept");
    println!(
        "leaked-ENI sweep: deleted {leaked} (created 2026-01-01), kept {fresh} (fresh) and {kept} (no_manage), tagged {} createdAt={}",
        untagged.id, untagged.tags[TAG_CREATED_AT]
    );
    drop(lab);
}

/// The datapath's VPC CIDRs, as `vpcnet-agent config` prints them.
fn datapath_vpc_cidrs() -> Vec<String> {
    vpcnet_bpf_tests::agent_cli(&["config"])
        .lines()
        .filter(|l| l.starts_with("cidr") && l.ends_with("(Vpc)"))
        .filter_map(|l| l.split_whitespace().nth(1).map(str::to_owned))
        .collect()
}

#[test]
fn a_cidr_associated_with_the_vpc_reaches_the_datapath() {
    let _lock = lab_lock();
    let lab = IpamLab::up("m5.large", &[]);
    assert_eq!(
        datapath_vpc_cidrs(),
        ["10.20.0.0/16", "100.64.0.0/16"],
        "the VPC's CIDRs from IMDS at start"
    );
    let added: Ipv4Net = "100.65.0.0/16".parse().expect("CIDR");
    lab.emulator()
        .admin()
        .associate_vpc_cidr(added)
        .expect("associating a CIDR");
    // The agent re-reads IMDS every second here (`--vpc-cidr-interval`);
    // nothing tells this test when, so it looks, for at most 10 s.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let cidrs = datapath_vpc_cidrs();
        if cidrs.contains(&added.to_string()) {
            println!("VPC CIDRs in the datapath after the association: {cidrs:?}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{added} never reached the datapath: {cidrs:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(lab);
}

/// Creates an ENI in the node's subnet with `tags` and 3 secondary
/// addresses, and attaches it at device 2 as an operator would (through
/// EC2, as the node sees it); returns its id and EC2's view once attached.
fn attach_operators_eni(
    lab: &IpamLab,
    tags: &[(&str, &str)],
) -> (String, vpcnet_lab::ec2::model::StateSnapshot) {
    let instance = lab.emulator().instance_id().to_owned();
    let tags: BTreeMap<String, String> = tags
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let operators = lab
        .emulator()
        .admin()
        .create_leaked_eni(LAB_NODE_SUBNET_ID, &tags, 3)
        .expect("the operator's ENI");
    let eni = operators.as_str();
    ec2_call(|cloud| async move {
        cloud
            .attach_eni(eni, &instance, 2)
            .await
            .expect("attaching")
    });
    let state = lab.wait_ec2(
        "the operator's ENI attached",
        Duration::from_secs(10),
        |s| {
            s.eni(&operators)
                .is_some_and(vpcnet_lab::ec2::model::Eni::is_attached)
        },
    );
    (operators, state)
}

#[test]
fn a_no_manage_eni_gives_no_address_to_pods() {
    let _lock = lab_lock();
    let mut lab = IpamLab::up("m5.large", &[]);
    let instance = lab.emulator().instance_id().to_owned();
    let (operators, state) =
        attach_operators_eni(&lab, &[(TAG_NO_MANAGE, "true"), ("team", "storage")]);
    let theirs: Vec<Ipv4Addr> = state
        .eni(&operators)
        .expect("attached")
        .secondary_ips
        .clone();
    // The agent learns the node's ENIs at start.
    lab.lab.stop_agent().expect("stopping the agent");
    lab.lab.start_agent().expect("starting the agent");
    lab.connect();

    let (addrs, _) = lab.fill(0, 40);
    assert_eq!(
        addrs.len(),
        2 * 9,
        "two ENIs' worth: the third slot is the operator's"
    );
    for addr in &theirs {
        assert!(
            !addrs.contains(addr),
            "{addr} of the no_manage ENI went to a pod"
        );
    }
    let after = holdings(&lab.ec2_state(), &instance);
    assert_eq!(after.attached_enis, 3);
    let still = lab.ec2_state();
    assert_eq!(
        still.eni(&operators).expect("kept").secondary_ips,
        theirs,
        "the operator's ENI is left as it was"
    );
    println!(
        "no_manage ENI {operators}: kept its {} addresses; pods got {} others",
        theirs.len(),
        addrs.len()
    );
    drop(lab);
}

/// `ip -j <args>` in the node, as JSON.
fn node_ip_json(ip_args: &[&str]) -> serde_json::Value {
    let mut command = vec!["ip", "-j"];
    command.extend(ip_args);
    let out = vpcnet_lab::exec_ok(vpcnet_lab::addrs::NS_NODE, &command).expect("ip in the node");
    serde_json::from_str(&out).expect("ip's JSON")
}

/// What an operator checks of a link: MTU, state and IPv4 addresses, and
/// the routes in main that leave by it.
fn link_view(link: &str) -> (serde_json::Value, serde_json::Value, Vec<String>, usize) {
    let shown = node_ip_json(&["link", "show", link]);
    let addrs: Vec<String> = node_ip_json(&["-4", "addr", "show", "dev", link])[0]["addr_info"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap_or(""), a["prefixlen"]))
        .collect();
    let routes = node_ip_json(&["-4", "route", "show", "table", "main", "dev", link]);
    (
        shown[0]["mtu"].clone(),
        shown[0]["operstate"].clone(),
        addrs,
        routes.as_array().map_or(0, Vec::len),
    )
}

/// With `MANAGE_UNTAGGED_ENI=false`, an ENI someone else attached is left
/// as it is; the agent's own links are put back when something rewrites
/// them.
#[test]
fn enis_of_others_are_left_alone_and_the_agents_own_links_are_put_back() {
    let _lock = lab_lock();
    let mut lab = IpamLab::up("m5.large", &[("MANAGE_UNTAGGED_ENI", "false")]);
    // An ENI attached by someone else, untagged: neither vpcnet's nor the
    // VPC CNI's, and not tagged no_manage either.
    let (theirs, state) = attach_operators_eni(&lab, &[("team", "storage")]);
    let their_addrs = state.eni(&theirs).expect("attached").secondary_ips.clone();
    let their_link = vpcnet_lab::addrs::eni_ifname(2);
    let before = link_view(&their_link);
    lab.lab.stop_agent().expect("stopping the agent");
    lab.lab.start_agent().expect("starting the agent");
    lab.connect();

    // The pods fill the primary ENI, then eth1, which the agent attaches.
    let (addrs, _) = lab.fill(0, 40);
    assert_eq!(addrs.len(), 2 * 9, "the primary ENI's and eth1's addresses");
    for addr in &their_addrs {
        assert!(!addrs.contains(addr), "{addr} of {theirs} went to a pod");
    }
    assert_eq!(
        link_view(&their_link),
        before,
        "{their_link} (MTU, state, addresses, routes) as the agent found it"
    );
    let log = std::fs::read_to_string(vpcnet_lab::agent_log_file()).unwrap_or_default();
    assert!(
        log.lines()
            .any(|l| l.contains(&theirs) && l.contains("not made by vpcnet or the VPC CNI")),
        "the agent says whose {theirs} is:\n{log}"
    );

    // Something else rewrites the agent's own ENI link, as a DHCP client
    // does: another MTU, its own address, a default route in main.
    let ours = vpcnet_lab::addrs::eni_ifname(1);
    let settled = link_view(&ours);
    let restored = |s: &vpcnet_api::cni::IpamStatusReply| {
        s.counters
            .get("vpcnet_ipam_links_restored_total")
            .copied()
            .unwrap_or(0)
    };
    let restored_before = restored(&lab.status());
    for args in [
        &["link", "set", &ours, "mtu", "1500"][..],
        &["addr", "add", "10.20.11.250/24", "dev", &ours],
        &[
            "route",
            "add",
            "default",
            "via",
            "10.20.11.1",
            "dev",
            &ours,
            "onlink",
            "proto",
            "dhcp",
            "metric",
            "612",
        ],
    ] {
        let mut argv = vec!["ip"];
        argv.extend(args);
        vpcnet_lab::exec_ok(vpcnet_lab::addrs::NS_NODE, &argv).expect("rewriting the link");
    }
    // The agent may put part of it back between two of those commands: the
    // wait is for all of it, and for the agent to have counted it.
    lab.wait_status(
        &format!("{ours} put back as the agent set it up ({settled:?})"),
        // The links are checked every 5 s.
        Duration::from_secs(15),
        |s| restored(s) > restored_before && link_view(&ours) == settled,
    );
    println!("{theirs} ({their_link}) left alone: {before:?}; {ours} put back: {settled:?}");
    drop(lab);
}

/// `MANAGE_UNTAGGED_ENI` (true unless set, as in aws-node): an ENI someone
/// else attached, without this instance's tag, is the pool's: it gets
/// aws-node's tags, the agent sets its link up and its addresses go to pods.
#[test]
fn an_untagged_eni_someone_else_attached_is_managed_by_default() {
    let _lock = lab_lock();
    let mut lab = IpamLab::up("m5.large", &[]);
    let instance = lab.emulator().instance_id().to_owned();
    let (theirs, state) = attach_operators_eni(&lab, &[("team", "storage")]);
    let their_eni = state.eni(&theirs).expect("attached").clone();
    // The agent learns the node's ENIs at start.
    lab.lab.stop_agent().expect("stopping the agent");
    lab.lab.start_agent().expect("starting the agent");
    lab.connect();

    let state = lab.wait_ec2(
        "the ENI tagged as one of this instance's",
        Duration::from_secs(30),
        |s| {
            s.eni(&theirs)
                .is_some_and(|e| e.tags.get(TAG_INSTANCE_ID) == Some(&instance))
        },
    );
    assert_eq!(
        state
            .eni(&theirs)
            .expect("kept")
            .tags
            .get("team")
            .map(String::as_str),
        Some("storage"),
        "its own tags stay"
    );
    let (addrs, _) = lab.fill(0, 40);
    assert_eq!(addrs.len(), 3 * 9, "three ENIs' addresses, theirs included");
    for addr in &their_eni.secondary_ips {
        assert!(addrs.contains(addr), "{addr} of {theirs} went to no pod");
    }
    let their_link = vpcnet_lab::addrs::eni_ifname(2);
    let (mtu, _, link_addrs, _) = link_view(&their_link);
    assert_eq!(mtu, 9001, "{their_link} set up as the agent's own");
    assert_eq!(link_addrs, [format!("{}/24", their_eni.primary_ip)]);
    let log = std::fs::read_to_string(vpcnet_lab::agent_log_file()).unwrap_or_default();
    assert!(
        log.lines()
            .any(|l| l.contains(&theirs) && l.contains("managed (MANAGE_UNTAGGED_ENI is true)")),
        "the agent says whose {theirs} is"
    );
    println!(
        "{theirs} ({their_link}), attached untagged: tagged {TAG_INSTANCE_ID}={instance}, its {} addresses among the pods' {}",
        their_eni.secondary_ips.len(),
        addrs.len()
    );
    drop(lab);
}

/// `DISABLE_NETWORK_RESOURCE_PROVISIONING=true`: the agent tags nothing,
/// assigns, releases, makes and frees nothing; its reconcile finds the ENI
/// someone else attaches while it runs (and its going), and pods get that
/// ENI's addresses, which stay assigned when they are released.
#[test]
fn without_provisioning_pods_get_what_others_attach_and_nothing_is_changed() {
    use tonic::Code;
    let _lock = lab_lock();
    let mut lab = IpamLab::up(
        "m5.large",
        &[
            ("DISABLE_NETWORK_RESOURCE_PROVISIONING", "true"),
            ("CLUSTER_NAME", "lab"),
            ("IP_COOLDOWN_PERIOD", "1"),
        ],
    );
    let counter = |s: &vpcnet_api::cni::IpamStatusReply, name: &str| {
        s.counters
            .get(&format!("vpcnet_ipam_{name}_total"))
            .copied()
            .unwrap_or(0)
    };
    // The primary ENI has no secondary address, and none comes.
    let refused = lab.add(0).expect_err("no address to give");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused}");
    assert!(
        refused
            .message()
            .contains("DISABLE_NETWORK_RESOURCE_PROVISIONING"),
        "{refused}"
    );

    let (theirs, state) = attach_operators_eni(&lab, &[("team", "storage")]);
    let their_eni = state.eni(&theirs).expect("attached").clone();
    lab.wait_status(
        "the attached ENI's addresses in the pool",
        Duration::from_secs(15),
        |s| counter(s, "enis_found") == 1 && s.total_addrs == 3,
    );
    let (addrs, _) = lab.fill(1, 10);
    assert_eq!(
        addrs
            .iter()
            .copied()
            .collect::<std::collections::BTreeSet<_>>(),
        their_eni.secondary_ips.iter().copied().collect(),
        "the pods have the attached ENI's addresses, and only those"
    );
    let their_link = vpcnet_lab::addrs::eni_ifname(2);
    let (_, _, link_addrs, _) = link_view(&their_link);
    assert_eq!(link_addrs, [format!("{}/24", their_eni.primary_ip)]);
    for id in 1..=3 {
        lab.del(id).expect("DEL");
    }
    // Past the cooldown, two more passes: nothing is given back.
    let passes = counter(&lab.status(), "node_reconciles");
    let status = lab.wait_status(
        "two more passes of the reconcile",
        Duration::from_secs(15),
        |s| counter(s, "node_reconciles") >= passes + 2,
    );
    assert_eq!((status.total_addrs, status.assigned_addrs), (3, 0));

    // Someone else detaches it: out of the pool.
    let attachment = their_eni.attachment.clone().expect("attached").id;
    ec2_call(|cloud| async move {
        cloud.detach_eni(&attachment).await.expect("detaching");
    });
    lab.wait_status(
        "the detached ENI out of the pool",
        Duration::from_secs(15),
        |s| counter(s, "enis_lost") == 1 && s.total_addrs == 0 && s.enis == 1,
    );

    let calls = lab
        .emulator()
        .admin()
        .calls()
        .expect("the emulator's calls");
    for action in [
        "CreateTags",
        "CreateNetworkInterface",
        "AttachNetworkInterface",
        "DeleteNetworkInterface",
        "AssignPrivateIpAddresses",
        "UnassignPrivateIpAddresses",
        "ModifyNetworkInterfaceAttribute",
        "DetachNetworkInterface",
    ] {
        // The test's own attach (with delete-on-termination) and detach.
        let own = u64::from(matches!(
            action,
            "AttachNetworkInterface" | "ModifyNetworkInterfaceAttribute" | "DetachNetworkInterface"
        ));
        assert_eq!(calls.action(action).calls, own, "{action}");
    }
    let state = lab.ec2_state();
    let after = state.eni(&theirs).expect("left in EC2");
    assert_eq!(
        after.secondary_ips, their_eni.secondary_ips,
        "none released"
    );
    assert_eq!(after.tags, their_eni.tags, "not tagged");
    println!(
        "no provisioning: {theirs} found ({} addresses to pods), left as it was, found gone; EC2 calls: {:?}",
        addrs.len(),
        calls.actions.keys().collect::<Vec<_>>()
    );
    drop(lab);
}

/// `CLUSTER_NAME` and `ADDITIONAL_ENI_TAGS`: the ENI the agent makes
/// carries aws-node's tags and the operator's, and so does the primary ENI,
/// which the agent manages without having made it; a key of aws-node's own
/// in the operator's tags is left out.
#[test]
fn managed_enis_carry_aws_nodes_tags_and_the_operators() {
    use vpcnet_agent::cloud::{ENI_OWNER, TAG_CLUSTER_NAME, TAG_ENI_OWNER};
    let _lock = lab_lock();
    let mut lab = IpamLab::up(
        "m5.large",
        &[
            ("CLUSTER_NAME", "lab"),
            (
                "ADDITIONAL_ENI_TAGS",
                r#"{"team":"payments","node.k8s.amazonaws.com/no_manage":"true"}"#,
            ),
        ],
    );
    let instance = lab.emulator().instance_id().to_owned();
    // More pods than the primary ENI holds: the agent makes a second ENI.
    let (addrs, _) = lab.fill(0, 12);
    assert_eq!(addrs.len(), 12);
    let attached = |s: &vpcnet_lab::ec2::model::StateSnapshot| {
        s.enis
            .iter()
            .filter(|e| {
                e.attachment
                    .as_ref()
                    .is_some_and(|a| a.instance_id == instance)
            })
            .cloned()
            .collect::<Vec<_>>()
    };
    let state = lab.wait_ec2(
        "two ENIs attached, both with the operator's tag",
        Duration::from_secs(30),
        |s| {
            let enis = attached(s);
            enis.len() >= 2
                && enis
                    .iter()
                    .all(|e| e.tags.get("team").map(String::as_str) == Some("payments"))
        },
    );
    for eni in attached(&state) {
        let tag = |key: &str| eni.tags.get(key).map(String::as_str);
        assert_eq!(tag(TAG_INSTANCE_ID), Some(instance.as_str()), "{}", eni.id);
        assert_eq!(tag(TAG_CLUSTER_NAME), Some("lab"), "{}", eni.id);
        assert_eq!(tag(TAG_ENI_OWNER), Some(ENI_OWNER), "{}", eni.id);
        assert_eq!(
            tag(TAG_NO_MANAGE),
            None,
            "{}: the reserved key stays out",
            eni.id
        );
        println!("{}: {:?}", eni.id, eni.tags);
    }
    drop(lab);
}

/// The ENIs attached to `instance` in EC2, by device index.
fn attached_enis(
    state: &vpcnet_lab::ec2::model::StateSnapshot,
    instance: &str,
) -> Vec<vpcnet_lab::ec2::model::Eni> {
    let mut enis: Vec<_> = state
        .enis
        .iter()
        .filter(|e| {
            e.attachment
                .as_ref()
                .is_some_and(|a| a.instance_id == instance)
        })
        .cloned()
        .collect();
    enis.sort_by_key(|e| e.attachment.as_ref().map(|a| a.device_index));
    enis
}

/// `ENABLE_SUBNET_DISCOVERY` (on by default): a new ENI goes to the
/// subnet of the node's VPC and zone tagged `kubernetes.io/role/cni` with
/// the most free addresses, or the primary ENI's subnet, untagged; a
/// subnet tagged for other clusters only is not for this one; the ENI
/// gets the primary ENI's security groups.
#[test]
fn subnet_discovery_puts_new_enis_in_the_tagged_subnet_with_most_free_addresses() {
    use vpcnet_agent::ipam::subnets::{TAG_CLUSTER_PREFIX, TAG_ROLE_CNI};
    use vpcnet_lab::{
        addrs::{CUSTOM_POD_SUBNET, NODE_SUBNET},
        ec2::config::{LAB_CUSTOM_SUBNET_ID, LAB_PEER_SUBNET_ID},
    };
    let _lock = lab_lock();
    // One address ahead of the pods: an ENI comes only when the last is full.
    let mut lab = IpamLab::up(
        "m5.large",
        &[("CLUSTER_NAME", "lab"), ("WARM_IP_TARGET", "1")],
    );
    let instance = lab.emulator().instance_id().to_owned();
    let other_cluster = format!("{TAG_CLUSTER_PREFIX}other");
    let this_cluster = format!("{TAG_CLUSTER_PREFIX}lab");
    // The largest subnet of the zone is tagged for pods, of another
    // cluster only.
    vpcnet_bpf_tests::ipam::tag(
        LAB_CUSTOM_SUBNET_ID,
        &[(TAG_ROLE_CNI, "1"), (&other_cluster, "shared")],
    );
    let (addrs, _) = lab.fill(0, 12);
    assert_eq!(addrs.len(), 12);
    let state = lab.wait_ec2("a second ENI", Duration::from_secs(30), |s| {
        attached_enis(s, &instance).len() == 2
    });
    let enis = attached_enis(&state, &instance);
    assert_eq!(
        enis[1].subnet_id, LAB_NODE_SUBNET_ID,
        "another cluster's subnet is passed over for the primary ENI's"
    );
    assert!(addrs.iter().all(|a| NODE_SUBNET.contains(a)), "{addrs:?}");

    // Now it is this cluster's too, and a smaller subnet is tagged as well:
    // the next ENI goes to the one with most free addresses.
    vpcnet_bpf_tests::ipam::tag(LAB_CUSTOM_SUBNET_ID, &[(&this_cluster, "shared")]);
    vpcnet_bpf_tests::ipam::tag(LAB_PEER_SUBNET_ID, &[(TAG_ROLE_CNI, "1")]);
    let (more, _) = lab.fill(12, 40);
    assert_eq!(more.len(), 3 * 9 - 12, "the node fills its three ENIs");
    let state = lab.ec2_state();
    let enis = attached_enis(&state, &instance);
    assert_eq!(enis.len(), 3);
    let third = &enis[2];
    assert_eq!(
        third.subnet_id, LAB_CUSTOM_SUBNET_ID,
        "the tagged subnet with most free addresses"
    );
    assert_eq!(
        third.groups, enis[0].groups,
        "a discovered subnet's ENI has the primary ENI's security groups"
    );
    let in_custom: Vec<_> = more
        .iter()
        .filter(|a| CUSTOM_POD_SUBNET.contains(*a))
        .collect();
    assert_eq!(in_custom.len(), 9, "the third ENI's addresses: {more:?}");
    for addr in &in_custom {
        assert!(third.secondary_ips.contains(addr), "{addr} of {}", third.id);
    }
    let subnets = state
        .subnets
        .iter()
        .map(|s| (s.id.as_str(), s.available_ip_address_count));
    println!(
        "subnet discovery: ENI 2 in {} (the custom subnet was another cluster's), ENI 3 in {} with groups {:?}; free addresses: {:?}",
        enis[1].subnet_id,
        third.subnet_id,
        third.groups,
        subnets.collect::<Vec<_>>()
    );
    drop(lab);
}

/// A primary ENI whose subnet is tagged `kubernetes.io/role/cni=0` gives
/// pods none of its addresses: its idle ones go back to EC2, and pods get
/// addresses of ENIs in the subnet tagged for them.
#[test]
fn a_primary_subnet_tagged_0_gives_pods_none_of_its_addresses() {
    use vpcnet_agent::ipam::subnets::TAG_ROLE_CNI;
    use vpcnet_lab::{addrs::CUSTOM_POD_SUBNET, ec2::config::LAB_CUSTOM_SUBNET_ID};
    let _lock = lab_lock();
    let mut lab = IpamLab::up("m5.large", &[("IP_COOLDOWN_PERIOD", "1")]);
    let instance = lab.emulator().instance_id().to_owned();
    let state = lab.wait_ec2(
        "the primary ENI's warm addresses",
        Duration::from_secs(30),
        |s| attached_enis(s, &instance)[0].secondary_ips.len() == 9,
    );
    let primary = attached_enis(&state, &instance)[0].id.clone();
    lab.lab.stop_agent().expect("stopping the agent");
    vpcnet_bpf_tests::ipam::tag(LAB_NODE_SUBNET_ID, &[(TAG_ROLE_CNI, "0")]);
    vpcnet_bpf_tests::ipam::tag(LAB_CUSTOM_SUBNET_ID, &[(TAG_ROLE_CNI, "1")]);
    lab.lab.start_agent().expect("starting the agent");
    lab.connect();

    lab.wait_ec2(
        "the primary ENI's idle addresses back in EC2",
        Duration::from_secs(30),
        |s| s.eni(&primary).is_some_and(|e| e.secondary_ips.is_empty()),
    );
    let (addrs, _) = lab.fill(0, 40);
    assert_eq!(addrs.len(), 2 * 9, "the two other ENIs' addresses");
    assert!(
        addrs.iter().all(|a| CUSTOM_POD_SUBNET.contains(a)),
        "every pod in the subnet tagged for pods: {addrs:?}"
    );
    let enis = attached_enis(&lab.ec2_state(), &instance);
    assert!(
        enis[1..]
            .iter()
            .all(|e| e.subnet_id == LAB_CUSTOM_SUBNET_ID),
        "{enis:?}"
    );
    let log = std::fs::read_to_string(vpcnet_lab::agent_log_file()).unwrap_or_default();
    assert!(
        log.lines()
            .any(|l| l.contains(&primary) && l.contains("no pod gets its addresses")),
        "the agent says why {primary} serves no pod"
    );
    println!(
        "primary ENI {primary} in a subnet tagged {TAG_ROLE_CNI}=0: its 9 addresses returned; pods got {} addresses of {}",
        addrs.len(),
        LAB_CUSTOM_SUBNET_ID
    );
    drop(lab);
}

/// `ENABLE_SUBNET_DISCOVERY=false`: new ENIs go to the primary ENI's
/// subnet, whatever other subnets are tagged.
#[test]
fn without_subnet_discovery_new_enis_go_to_the_primary_enis_subnet() {
    use vpcnet_agent::ipam::subnets::TAG_ROLE_CNI;
    use vpcnet_lab::ec2::config::LAB_CUSTOM_SUBNET_ID;
    let _lock = lab_lock();
    let mut lab = IpamLab::up(
        "m5.large",
        &[
            ("ENABLE_SUBNET_DISCOVERY", "false"),
            ("WARM_IP_TARGET", "1"),
        ],
    );
    let instance = lab.emulator().instance_id().to_owned();
    vpcnet_bpf_tests::ipam::tag(LAB_CUSTOM_SUBNET_ID, &[(TAG_ROLE_CNI, "1")]);
    let (addrs, _) = lab.fill(0, 12);
    assert_eq!(addrs.len(), 12);
    let state = lab.wait_ec2("a second ENI", Duration::from_secs(30), |s| {
        attached_enis(s, &instance).len() == 2
    });
    assert_eq!(
        attached_enis(&state, &instance)[1].subnet_id,
        LAB_NODE_SUBNET_ID
    );
    drop(lab);
}

/// EC2 failing every call: pods get the warm pool's addresses, the next
/// ADD waits for the pool, then is told to try again (`ABORTED`, the
/// plugin's `TRY_AGAIN_LATER`), not that the node is full; once EC2 answers
/// again, the same pod's next try gets an address from a new ENI.
#[test]
fn an_add_while_ec2_fails_is_told_to_try_again_and_a_later_try_gets_an_address() {
    use tonic::Code;
    use vpcnet_lab::ec2::config::FaultRule;
    let _lock = lab_lock();
    let mut lab = IpamLab::up("m5.large", &[]);
    // WARM_ENI_TARGET=1: the primary ENI's nine secondary addresses.
    let warm = 9;
    lab.wait_status("the warm pool", Duration::from_secs(30), |s| {
        s.total_addrs == warm
    });
    lab.emulator()
        .admin()
        .set_faults(&[FaultRule {
            action: "*".into(),
            unavailable: 1.0,
            ..FaultRule::default()
        }])
        .expect("failing every EC2 call");
    for id in 0..warm as usize {
        lab.add(id).expect("an address of the warm pool");
    }
    let refused = lab
        .add(warm as usize)
        .expect_err("no address while EC2 fails");
    assert_eq!(refused.code(), Code::Aborted, "{refused}");
    assert!(
        refused.message().contains("could not grow in time"),
        "{refused}"
    );
    let status = lab.status();
    assert_eq!(
        (status.assigned_addrs, status.enis),
        (warm, 1),
        "nothing held for the refused pod, no ENI made"
    );

    lab.emulator()
        .admin()
        .set_faults(&[])
        .expect("EC2 answering again");
    let reply = lab
        .add_retrying(warm as usize)
        .expect("an address once EC2 answers");
    let status = lab.status();
    assert_eq!(status.assigned_addrs, warm + 1);
    assert_eq!(status.enis, 2, "the address is on a new ENI");
    println!(
        "refused while EC2 failed: {:?} {}; later: {}",
        refused.code(),
        refused.message(),
        reply.ipv4_addr
    );
    drop(lab);
}

/// A node at its ENI limit whose freed ENIs EC2 has not let it delete yet
/// (`DeleteNetworkInterface` failing): it is not full, an ENI slot is
/// coming free, so an ADD past the warm pool is told to try again
/// (`ABORTED`), not that the node is at its limit; once EC2 deletes the
/// freed ENIs, the same pod's next try gets an address on a new ENI.
#[test]
fn an_add_while_freed_enis_await_deletion_is_told_to_try_again() {
    use tonic::Code;
    use vpcnet_lab::ec2::config::FaultRule;
    let _lock = lab_lock();
    let mut lab = IpamLab::up("m5.large", &[]);
    let instance = lab.emulator().instance_id().to_owned();
    // m5.large: three ENIs of nine pod addresses each.
    let (max_enis, per_eni) = (3, 9);
    let (addrs, _) = lab.fill(0, max_enis * per_eni + 1);
    assert_eq!(addrs.len(), max_enis * per_eni, "max pods");
    lab.emulator()
        .admin()
        .set_faults(&[FaultRule {
            action: "DeleteNetworkInterface".into(),
            unavailable: 1.0,
            ..FaultRule::default()
        }])
        .expect("failing every ENI deletion");
    for id in 0..addrs.len() {
        lab.del(id).expect("DEL");
    }
    // WARM_ENI_TARGET=1: the pool gives an ENI back, which EC2 then keeps,
    // detached (the pool frees the next once that one is deleted).
    let settled = lab.wait_status("an ENI given back", Duration::from_mins(1), |s| {
        (s.enis as usize) < max_enis && s.assigned_addrs == 0
    });
    let (kept, freed) = (settled.enis as usize, max_enis - settled.enis as usize);
    lab.wait_ec2(
        "the freed ENIs detached, not deleted",
        Duration::from_mins(1),
        |state| holdings(state, &instance).detached_enis.len() == freed,
    );
    let in_pool = kept * per_eni;
    for id in 100..100 + in_pool {
        lab.add(id).expect("an address of the pool");
    }
    let refused = lab
        .add(100 + in_pool)
        .expect_err("no address while the freed ENIs await deletion");
    assert_eq!(refused.code(), Code::Aborted, "{refused}");

    lab.emulator()
        .admin()
        .set_faults(&[])
        .expect("EC2 deleting again");
    let reply = lab
        .add_retrying(100 + in_pool)
        .expect("an address once the freed ENIs are deleted");
    let status = lab.status();
    assert_eq!(
        status.enis as usize,
        kept + 1,
        "the address is on a new ENI"
    );
    let ec2 = lab.wait_ec2("the freed ENIs deleted", Duration::from_mins(1), |state| {
        holdings(state, &instance).detached_enis.is_empty()
    });
    assert_eq!(holdings(&ec2, &instance).attached_enis, kept + 1);
    println!(
        "refused while the freed ENIs awaited deletion: {:?} {}; later: {}",
        refused.code(),
        refused.message(),
        reply.ipv4_addr
    );
    drop(lab);
}
