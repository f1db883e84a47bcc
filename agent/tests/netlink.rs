//! The agent's link setup against a real kernel, each test in network
//! namespaces of its own: a node with an ENI (one end of a veth) and, at the
//! other end, the subnet's gateway. What is checked is what an operator
//! would check with `ip -d link/addr/route/neigh` (read here as `ip -j`).
//!
//! Needs root. The tests take the lab's lock, so they never run alongside a
//! lab (whose teardown removes every `vpcnet-` namespace) or each other.

use std::{
    net::Ipv4Addr,
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;
use vpcnet_agent::netlink::{self, EniLinkConfig, MacAddr, NetlinkError, NetlinkHandle};

const NODE: &str = "vpcnet-nltest-node";
const GW: &str = "vpcnet-nltest-gw";
const ENI: &str = "eth1";
const ENI_MAC: &str = "02:ee:0a:14:0b:c8";
const GW_LINK: &str = "gw1";
const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 20, 11, 1);
/// Bounds a wait that should end at once; a test never sleeps.
const PATIENCE: Duration = Duration::from_secs(10);

fn config(mtu: u32) -> EniLinkConfig {
    EniLinkConfig {
        mac: ENI_MAC.parse().unwrap(),
        mtu,
        addr: "10.20.11.200/24".parse().unwrap(),
        gateway: GATEWAY,
    }
}

/// Runs `ip ARGS` and returns its output; a failure fails the test.
fn ip(args: &[&str]) -> String {
    let out = Command::new("ip").args(args).output().expect("running ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `ip -n NS -d -j ARGS`, parsed.
fn ip_json(ns: &str, args: &[&str]) -> Value {
    let mut full = vec!["-n", ns, "-d", "-j"];
    full.extend_from_slice(args);
    let text = ip(&full);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("ip {full:?} said {text:?}: {e}"))
}

/// A network namespace, removed when dropped (also when the test fails).
struct Netns(&'static str);

impl Netns {
    fn new(name: &'static str) -> Self {
        // A namespace left by a run that was killed before its guards ran.
        let _ = Command::new("ip").args(["netns", "del", name]).output();
        ip(&["netns", "add", name]);
        Self(name)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", self.0]).output();
    }
}

/// The node and the gateway, with the ENI between them down and at the
/// default MTU, as the kernel makes an ENI's link. Fields drop in order:
/// the namespaces go before the lock is released.
struct Bed {
    _node: Netns,
    _gw: Netns,
    _lock: vpcnet_lab::LabLock,
}

fn bed() -> Bed {
    assert!(nix::unistd::geteuid().is_root(), "these tests need root");
    let lock = vpcnet_lab::serial();
    let bed = Bed {
        _node: Netns::new(NODE),
        _gw: Netns::new(GW),
        _lock: lock,
    };
    add_eni(ENI, ENI_MAC, GW_LINK);
    ip(&["-n", GW, "addr", "add", "10.20.11.1/24", "dev", GW_LINK]);
    ip(&["-n", GW, "link", "set", GW_LINK, "up"]);
    bed
}

/// A new ENI link in the node, its peer in the gateway's namespace.
fn add_eni(name: &str, mac: &str, peer: &str) {
    ip(&[
        "-n", NODE, "link", "add", name, "address", mac, "type", "veth", "peer", "name", peer,
        "netns", GW,
    ]);
}

/// Runs `f` with a netlink handle whose socket is in the node's namespace
/// (a thread there, with a current-thread runtime).
fn in_node<T: Send>(f: impl AsyncFnOnce(&NetlinkHandle) -> T + Send) -> T {
    vpcnet_lab::run_in(NODE, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let netlink = NetlinkHandle::new().unwrap();
            f(&netlink).await
        })
    })
    .unwrap()
}

fn link_json(name: &str) -> Value {
    ip_json(NODE, &["link", "show", "dev", name])[0].clone()
}

/// The IPv4 addresses of `name` as `addr/prefix`.
fn ipv4_addrs(name: &str) -> Vec<String> {
    ip_json(NODE, &["-4", "addr", "show", "dev", name])[0]["addr_info"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap(), a["prefixlen"]))
        .collect()
}

/// The routes of table main that leave by `name`.
fn main_routes_by(name: &str) -> Vec<Value> {
    ip_json(NODE, &["-4", "route", "show", "table", "main"])
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["dev"] == name)
        .cloned()
        .collect()
}

/// The neighbour entry for the gateway on `name`, whatever its state.
fn gateway_entry(name: &str) -> Option<Value> {
    ip_json(
        NODE,
        &[
            "-4",
            "neigh",
            "show",
            "nud",
            "all",
            "dev",
            name,
            "to",
            "10.20.11.1",
        ],
    )
    .as_array()
    .unwrap()
    .first()
    .cloned()
}

/// What an operator checks after setup: MTU, up, the one address with its
/// prefix, no subnet route in main, the gateway managed.
fn assert_set_up(ifindex: u32, mtu: u64) {
    let link = link_json(ENI);
    assert_eq!(link["ifindex"], ifindex, "{link}");
    assert_eq!(link["mtu"], mtu, "{link}");
    assert!(
        link["flags"].as_array().unwrap().iter().any(|f| f == "UP"),
        "{ENI} is not up: {link}"
    );
    assert_eq!(ipv4_addrs(ENI), ["10.20.11.200/24"]);
    assert_eq!(
        main_routes_by(ENI),
        Vec::<Value>::new(),
        "routes by {ENI} in main"
    );
    let entry = gateway_entry(ENI).expect("no neighbour entry for the gateway");
    assert!(
        entry.get("managed").is_some(),
        "gateway entry not managed: {entry}"
    );
}

#[test]
fn eni_setup_is_what_an_operator_checks() {
    let _bed = bed();
    // The kernel's defaults for a new veth: the test must see them change.
    assert_eq!(link_json(ENI)["mtu"], 1500);
    let first = in_node(async |nl| nl.setup_eni(&config(9001)).await).unwrap();
    let ifindex = first.ifindex;
    assert_set_up(ifindex, 9001);
    assert_eq!(
        first.changed,
        ["mtu", "up", "address", "gateway neighbour"],
        "what a fresh link needed"
    );
    let before = (ipv4_addrs(ENI), gateway_entry(ENI));

    // The reconcile loop calls it again and again: nothing moves.
    let again = in_node(async |nl| nl.setup_eni(&config(9001)).await).unwrap();
    assert_eq!(again.ifindex, ifindex);
    assert!(again.changed.is_empty(), "{:?}", again.changed);
    assert_set_up(ifindex, 9001);
    assert_eq!(before.0, ipv4_addrs(ENI));
    assert_eq!(
        before.1.as_ref().map(|e| &e["managed"]),
        gateway_entry(ENI).as_ref().map(|e| &e["managed"])
    );

    // The kernel re-adds prefix routes when a link comes back up; the
    // address was added with noprefixroute, so no route comes back.
    ip(&["-n", NODE, "link", "set", ENI, "down"]);
    ip(&["-n", NODE, "link", "set", ENI, "up"]);
    assert_eq!(main_routes_by(ENI), Vec::<Value>::new(), "after down/up");
}

#[test]
fn stale_state_is_replaced() {
    let _bed = bed();
    // A previous owner's address, ours with the wrong prefix (each with its
    // prefix route in main), a pinned gateway entry, another MTU.
    ip(&["-n", NODE, "link", "set", ENI, "mtu", "1400", "up"]);
    ip(&["-n", NODE, "addr", "add", "10.20.11.99/24", "dev", ENI]);
    ip(&["-n", NODE, "addr", "add", "10.20.11.200/28", "dev", ENI]);
    ip(&[
        "-n",
        NODE,
        "neigh",
        "add",
        "10.20.11.1",
        "lladdr",
        "02:00:00:00:00:01",
        "dev",
        ENI,
        "nud",
        "permanent",
    ]);
    assert_eq!(main_routes_by(ENI).len(), 2, "the stale prefix routes");

    let ifindex = in_node(async |nl| nl.setup_eni(&config(9001)).await)
        .unwrap()
        .ifindex;
    assert_set_up(ifindex, 9001);

    // A route the kernel added for our own address before we were in
    // charge (no noprefixroute) is removed too.
    ip(&[
        "-n",
        NODE,
        "route",
        "add",
        "10.20.11.0/24",
        "dev",
        ENI,
        "proto",
        "kernel",
        "scope",
        "link",
        "src",
        "10.20.11.200",
    ]);
    let setup = in_node(async |nl| nl.setup_eni(&config(9001)).await).unwrap();
    assert_eq!(setup.changed, ["routes in main"]);
    assert_set_up(ifindex, 9001);

    // A DHCP client configuring the link as well (systemd-networkd racing
    // for an ENI it should leave alone): its address, and its subnet and
    // default routes in main. All of it goes.
    ip(&["-n", NODE, "addr", "add", "10.20.11.57/24", "dev", ENI]);
    ip(&[
        "-n",
        NODE,
        "route",
        "add",
        "default",
        "via",
        "10.20.11.1",
        "dev",
        ENI,
        "onlink",
        "proto",
        "dhcp",
        "metric",
        "612",
    ]);
    let setup = in_node(async |nl| nl.setup_eni(&config(9001)).await).unwrap();
    assert_eq!(setup.changed, ["address", "routes in main"]);
    assert_set_up(ifindex, 9001);

    // AWS_VPC_ENI_MTU changed between two runs of the agent.
    in_node(async |nl| nl.setup_eni(&config(1500)).await).unwrap();
    assert_set_up(ifindex, 1500);
}

#[test]
fn setup_needs_the_link() {
    let _bed = bed();
    let mut absent = config(9001);
    absent.mac = "02:ee:0a:14:0b:ff".parse().unwrap();
    let err = in_node(async |nl| nl.setup_eni(&absent).await).unwrap_err();
    assert!(
        matches!(err, NetlinkError::NoLinkWithMac(mac) if mac == absent.mac),
        "{err:?}"
    );
    assert_eq!(err.to_string(), "no link has the MAC 02:ee:0a:14:0b:ff");
}

#[test]
fn links_are_found_by_name_and_mac() {
    let _bed = bed();
    let mac: MacAddr = ENI_MAC.parse().unwrap();
    let (all, by_name, by_mac, missing) = in_node(async |nl| {
        (
            nl.links().await.unwrap(),
            nl.link_by_name(ENI).await.unwrap(),
            nl.link_by_mac(mac).await.unwrap(),
            nl.link_by_name("eth9").await.unwrap(),
        )
    });
    let eni = all.iter().find(|l| l.name == ENI).expect("eth1 listed");
    assert_eq!(eni.mac, Some(mac));
    assert_eq!(eni.mtu, 1500);
    assert!(!eni.up);
    assert_eq!(eni.index, link_json(ENI)["ifindex"]);
    assert_eq!(eni.oper_state, netlink::OperState::Down);
    assert!(all.iter().any(|l| l.name == "lo"), "{all:?}");
    assert_eq!(by_name.as_ref(), Some(eni));
    assert_eq!(by_mac.as_ref(), Some(eni));
    assert_eq!(missing, None);
}

#[test]
fn a_link_found_by_mac_is_found_again_when_replaced_or_readdressed() {
    let _bed = bed();
    let mac: MacAddr = ENI_MAC.parse().unwrap();
    let other: MacAddr = "02:ee:0a:14:0b:ca".parse().unwrap();
    let (first, replaced, moved, readdressed) = in_node(async |nl| {
        let first = nl.link_by_mac(mac).await.unwrap();
        // The ENI detached and attached again: a new link, a new index.
        ip(&["-n", NODE, "link", "del", ENI]);
        add_eni(ENI, ENI_MAC, GW_LINK);
        let replaced = nl.link_by_mac(mac).await.unwrap();
        // Its MAC moves to another link, as when a link is readdressed.
        ip(&[
            "-n",
            NODE,
            "link",
            "set",
            ENI,
            "address",
            &other.to_string(),
        ]);
        add_eni("eth3", ENI_MAC, "gw3");
        let moved = nl.link_by_mac(mac).await.unwrap();
        let readdressed = nl.link_by_mac(other).await.unwrap();
        (first, replaced, moved, readdressed)
    });
    let first = first.expect("eth1 found");
    let replaced = replaced.expect("the new eth1 found");
    assert_eq!(replaced.name, ENI);
    assert_ne!(
        replaced.index, first.index,
        "the link made since, not the one gone"
    );
    assert_eq!(replaced.index, link_json(ENI)["ifindex"]);
    let moved = moved.expect("eth3 found by the MAC eth1 had");
    assert_eq!(moved.name, "eth3");
    assert_eq!(moved.index, link_json("eth3")["ifindex"]);
    assert_eq!(readdressed.map(|l| l.index), Some(replaced.index));
}

#[test]
fn wait_for_link_sees_a_link_made_after_it_started() {
    let _bed = bed();
    let mac: MacAddr = "02:ee:0a:14:0b:c9".parse().unwrap();
    let link = in_node(async |nl| {
        let watch = nl.watch_link(mac).await.unwrap();
        assert!(watch.present().is_none(), "{watch:?}");
        // The cloud attaches the ENI: the kernel makes its link now, after
        // the watch looked, so only the link event can report it.
        add_eni("eth2", "02:ee:0a:14:0b:c9", "gw2");
        watch.wait(PATIENCE).await
    })
    .unwrap();
    assert_eq!(link.name, "eth2");
    assert_eq!(link.mac, Some(mac));
    assert_eq!(link.index, link_json("eth2")["ifindex"]);

    // A link that is already there is found without waiting.
    let started = Instant::now();
    let again = in_node(async |nl| nl.wait_for_link(mac, PATIENCE).await).unwrap();
    assert_eq!(again.index, link.index);
    assert!(started.elapsed() < PATIENCE);
}

#[test]
fn wait_for_link_times_out_clearly() {
    let _bed = bed();
    let mac: MacAddr = "02:ee:0a:14:0b:fe".parse().unwrap();
    let timeout = Duration::from_millis(300);
    let started = Instant::now();
    let err = in_node(async |nl| nl.wait_for_link(mac, timeout).await).unwrap_err();
    let waited = started.elapsed();
    assert!(matches!(err, NetlinkError::LinkTimeout { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "no link with the MAC 02:ee:0a:14:0b:fe appeared within 300ms \
         (is the ENI attached to this instance?)"
    );
    assert!(waited >= timeout && waited < PATIENCE, "waited {waited:?}");
}

#[test]
fn gateway_kept_resolved_from_sync_and_async_callers() {
    let _bed = bed();
    ip(&["-n", NODE, "addr", "add", "10.20.11.200/24", "dev", ENI]);
    ip(&["-n", NODE, "link", "set", ENI, "up"]);
    // The layout path: not async, on a thread in the node.
    vpcnet_lab::run_in(NODE, || {
        netlink::keep_gateway_resolved_blocking(ENI, GATEWAY)
    })
    .unwrap()
    .unwrap();
    let entry = gateway_entry(ENI).expect("no neighbour entry for the gateway");
    assert!(entry.get("managed").is_some(), "{entry}");
    // From inside a runtime the blocking form must not panic.
    in_node(async |_| netlink::keep_gateway_resolved_blocking(ENI, GATEWAY)).unwrap();
    let err =
        in_node(async |_| netlink::keep_gateway_resolved_blocking("eth9", GATEWAY)).unwrap_err();
    assert_eq!(err.to_string(), "no link is named eth9");
}

/// The rules of the VPC CNI the take-over removes and the rollback writes
/// back: added through netlink they are what `ip rule add` makes (a lookup
/// through them routes), listed they read back equal, and deleting picks
/// only them.
#[test]
fn rules_added_read_back_route_and_go() {
    use vpcnet_agent::netlink::rule::Ipv4Rule;
    let _bed = bed();
    let pod: ipnet::Ipv4Net = "10.20.11.30/32".parse().unwrap();
    let to_pod = Ipv4Rule {
        priority: 512,
        from: None,
        to: Some(pod),
        fwmark: None,
        iif: None,
        table: 254,
    };
    let marked = Ipv4Rule {
        priority: 1024,
        to: None,
        fwmark: Some((0x80, 0x80)),
        ..to_pod.clone()
    };
    let from_pod = Ipv4Rule {
        priority: 1536,
        from: Some(pod),
        to: None,
        table: 2,
        ..to_pod.clone()
    };
    // The same rule as `ip` adds it, to compare with.
    ip(&[
        "-n",
        NODE,
        "rule",
        "add",
        "from",
        "10.20.11.31",
        "priority",
        "1536",
        "table",
        "3",
    ]);
    let added = in_node(async |nl| {
        let mut added = Vec::new();
        for rule in [&to_pod, &marked, &from_pod, &to_pod] {
            added.push(nl.add_rule(rule).await.unwrap());
        }
        added
    });
    assert_eq!(
        added,
        [true, true, true, false],
        "an equal rule is not added twice"
    );
    let listed = ip(&["-n", NODE, "rule", "show"]);
    for line in [
        "512:\tfrom all to 10.20.11.30 lookup main",
        "1024:\tfrom all fwmark 0x80/0x80 lookup main",
        "1536:\tfrom 10.20.11.30 lookup 2",
        "1536:\tfrom 10.20.11.31 lookup 3",
    ] {
        assert!(
            listed.lines().any(|l| l.trim_end() == line),
            "{line:?} not in\n{listed}"
        );
    }
    // Routed through: the kernel answers a lookup the rule matches.
    ip(&["-n", NODE, "link", "set", ENI, "up"]);
    ip(&["-n", NODE, "route", "add", "10.20.11.30/32", "dev", ENI]);
    let route = ip(&["-n", NODE, "route", "get", "10.20.11.30"]);
    assert!(route.contains("dev eth1"), "{route}");
    let (rules, deleted) = in_node(async |nl| {
        let rules = nl.ipv4_rules().await.unwrap();
        let deleted = nl
            .delete_rules(|rule| rule.from == Some(pod) || rule.to == Some(pod))
            .await
            .unwrap();
        (rules, deleted)
    });
    for rule in [&to_pod, &marked, &from_pod] {
        assert!(rules.contains(rule), "{rule:?} not read back in {rules:?}");
    }
    assert_eq!(deleted, 2);
    let left = ip(&["-n", NODE, "rule", "show"]);
    assert!(!left.contains("10.20.11.30"), "{left}");
    assert!(left.contains("from 10.20.11.31 lookup 3") && left.contains("fwmark 0x80/0x80"));
}

/// A veth's peer MAC is read from the node's side, the peer being in
/// another namespace, as a pod's is when the agent adopts it.
#[test]
fn a_veths_peer_mac_is_read_across_namespaces() {
    let _bed = bed();
    let (eni, missing) = in_node(async |nl| {
        (
            nl.peer_mac(ENI).await.unwrap(),
            nl.peer_mac("eth9").await.unwrap(),
        )
    });
    let gw_mac = ip_json(GW, &["link", "show", "dev", GW_LINK])[0]["address"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(eni.map(|m| m.to_string()), Some(gw_mac));
    assert_eq!(missing, None);
}
