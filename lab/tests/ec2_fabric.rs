//! The EC2 emulator in the real lab: the `vpcnet-lab-ec2` binary run by
//! `EmulatorProcess` in `vpcnet-vpc`, called by the SDK from `vpcnet-node`
//! (where the agent runs) through the node's default route. An attach
//! makes `eth1` in the node with the ENI's MAC, an assigned address or
//! prefix is routed by the VPC router to the ENI's link, a detach removes
//! the link again.
//!
//! Root needed; one lab at a time; the lab (and the emulator) are torn
//! down by their guards even when an assertion fails.

mod common;

use std::time::Duration;

use aws_config::{BehaviorVersion, Region};
use aws_sdk_ec2::{
    Client,
    config::Credentials,
    types::{AttachmentStatus, NetworkInterfaceStatus},
};
use common::lab_session;
use vpcnet_lab::{
    Lab, LabOptions, addrs,
    ec2::{
        Config, EmulatorOptions, EmulatorProcess,
        config::{LAB_CUSTOM_SUBNET_ID, LAB_NODE_SUBNET_ID, LAB_REGION},
    },
    exec_ok, run_in,
};

/// The router's route to `addr` (`ip route get`), e.g. `... dev n0-eth1 ...`.
fn router_route(addr: &str) -> String {
    exec_ok(addrs::NS_VPC, &["ip", "-4", "route", "get", addr])
        .unwrap_or_else(|err| format!("no route: {err}"))
}

fn node_link(name: &str) -> Option<serde_json::Value> {
    let out = exec_ok(addrs::NS_NODE, &["ip", "-j", "link", "show", "dev", name]).ok()?;
    serde_json::from_str::<serde_json::Value>(&out)
        .ok()?
        .get(0)
        .cloned()
}

fn nft_set() -> String {
    exec_ok(
        addrs::NS_VPC,
        &[
            "nft",
            "list",
            "set",
            "ip",
            vpcnet_lab::router::NFT_TABLE,
            "eni_addresses",
        ],
    )
    .unwrap()
}

#[test]
fn ec2_attach_assign_detach_change_the_lab() {
    let _lock = lab_session();
    let _lab = Lab::up(&LabOptions::iptables(0)).unwrap();
    let emulator = EmulatorProcess::start(&EmulatorOptions {
        config: Config {
            attach_delay_ms: 200,
            ..Config::lab()
        },
        ..EmulatorOptions::default()
    })
    .unwrap();
    let instance = emulator.instance_id().to_owned();

    let (eni, mac, attachment) = attach_in_node(&instance);
    check_attached_links(&mac);
    let (address, in_prefix) = assign_and_check_delivery(&eni, &mac);
    unassign_detach_and_check(&eni, &attachment, &address, &in_prefix);
    assert!(!nft_set().contains("n0-eth1"));
    assert_eq!(emulator.admin().calls().unwrap().fabric_errors, 0);
    admin_levers(&emulator, &eni);
}

/// Creates an ENI and attaches it at device 1 from the node; (ENI, MAC, attachment).
fn attach_in_node(instance: &str) -> (String, String, String) {
    let instance = instance.to_owned();
    // The SDK as the agent runs it: in the node, endpoints overridden.
    let (eni, mac, attachment) = in_node(async || {
        let ec2 = client();
        let imds = aws_config::imds::Client::builder()
            .endpoint(vpcnet_lab::ec2::IMDS_ENDPOINT_URL)
            .unwrap()
            .build();
        assert_eq!(
            imds.get("/latest/meta-data/instance-id")
                .await
                .unwrap()
                .as_ref(),
            instance
        );
        let created = ec2
            .create_network_interface()
            .subnet_id(LAB_NODE_SUBNET_ID)
            .send()
            .await
            .unwrap();
        let eni = created.network_interface().unwrap();
        let (id, mac) = (
            eni.network_interface_id().unwrap().to_owned(),
            eni.mac_address().unwrap().to_owned(),
        );
        let attachment = ec2
            .attach_network_interface()
            .network_interface_id(&id)
            .instance_id(&instance)
            .device_index(1)
            .send()
            .await
            .unwrap()
            .attachment_id()
            .unwrap()
            .to_owned();
        wait_attachment(&ec2, &id, Some(AttachmentStatus::Attached)).await;
        (id, mac, attachment)
    });
    (eni, mac, attachment)
}

/// Attached: `eth1` in the node, the router side up.
fn check_attached_links(mac: &str) {
    // Attached: eth1 exists with the ENI's MAC and the VPC's MTU, down and
    // bare for the agent to configure; the router's side is up.
    let eth1 = node_link("eth1").expect("eth1 in the node once attached");
    assert_eq!(eth1["address"], mac);
    assert_eq!(eth1["mtu"], 9001);
    assert!(
        !eth1["flags"].as_array().unwrap().iter().any(|f| f == "UP"),
        "{eth1}"
    );
    let vpc_side = exec_ok(
        addrs::NS_VPC,
        &["ip", "-4", "addr", "show", "dev", "n0-eth1"],
    )
    .unwrap();
    assert!(vpc_side.contains("10.20.11.1/32"), "{vpc_side}");
    let primary = exec_ok(
        addrs::NS_VPC,
        &["ip", "-4", "route", "show", "dev", "n0-eth1"],
    )
    .unwrap();
    assert!(
        !primary.is_empty(),
        "the ENI's primary address is routed to its link"
    );
}

/// The router delivers an assigned address and prefix; (address, an address of the prefix).
fn assign_and_check_delivery(eni: &str, mac: &str) -> (String, String) {
    let eni = eni.to_owned();
    // Assign: the router delivers the address and the prefix to eth1's link.
    let (address, prefix) = in_node(async || {
        let ec2 = client();
        let assigned = ec2
            .assign_private_ip_addresses()
            .network_interface_id(&eni)
            .secondary_private_ip_address_count(1)
            .send()
            .await
            .unwrap();
        let address = assigned.assigned_private_ip_addresses()[0]
            .private_ip_address()
            .unwrap()
            .to_owned();
        let prefix = ec2
            .assign_private_ip_addresses()
            .network_interface_id(&eni)
            .ipv4_prefix_count(1)
            .send()
            .await
            .unwrap()
            .assigned_ipv4_prefixes()[0]
            .ipv4_prefix()
            .unwrap()
            .to_owned();
        (address, prefix)
    });
    assert!(
        router_route(&address).contains("dev n0-eth1"),
        "{}",
        router_route(&address)
    );
    let prefix_net: ipnet::Ipv4Net = prefix.parse().unwrap();
    let in_prefix = std::net::Ipv4Addr::from(u32::from(prefix_net.network()) + 5).to_string();
    assert!(
        router_route(&in_prefix).contains("dev n0-eth1"),
        "{}",
        router_route(&in_prefix)
    );
    let set = nft_set();
    assert!(set.contains(&format!("\"n0-eth1\" . {address}")), "{set}");
    assert!(set.contains(&format!("\"n0-eth1\" . {in_prefix}")), "{set}");
    let neigh = exec_ok(
        addrs::NS_VPC,
        &["ip", "neigh", "show", &in_prefix, "dev", "n0-eth1"],
    )
    .unwrap();
    assert!(neigh.contains(mac), "{neigh}");

    (address, in_prefix)
}

fn unassign_detach_and_check(eni: &str, attachment: &str, address: &str, in_prefix: &str) {
    let (eni, attachment, address) = (eni.to_owned(), attachment.to_owned(), address.to_owned());
    // Unassign: no longer delivered nor accepted.
    in_node(async || {
        client()
            .unassign_private_ip_addresses()
            .network_interface_id(&eni)
            .private_ip_addresses(&address)
            .send()
            .await
            .unwrap();
    });
    assert!(
        !router_route(&address).contains("n0-eth1"),
        "{}",
        router_route(&address)
    );
    assert!(!nft_set().contains(&format!("\"n0-eth1\" . {address}")));

    // Detach: the link goes, and with it every delivery.
    in_node(async || {
        let ec2 = client();
        ec2.detach_network_interface()
            .attachment_id(&attachment)
            .send()
            .await
            .unwrap();
        wait_attachment(&ec2, &eni, None).await;
        let described = ec2
            .describe_network_interfaces()
            .network_interface_ids(&eni)
            .send()
            .await
            .unwrap();
        assert_eq!(
            described.network_interfaces()[0].status(),
            Some(&NetworkInterfaceStatus::Available)
        );
    });
    assert!(node_link("eth1").is_none(), "eth1 left after detach");
    assert!(exec_ok(addrs::NS_VPC, &["ip", "link", "show", "dev", "n0-eth1"]).is_err());
    assert!(!router_route(in_prefix).contains("n0-eth1"));
}

/// The admin socket: state, counters, faults, delay, occupancy, leaks.
fn admin_levers(emulator: &EmulatorProcess, eni: &str) {
    let admin = emulator.admin();
    let state = admin.state().unwrap();
    assert_eq!(state.instances.len(), 1);
    assert!(state.eni(eni).unwrap().attachment.is_none());
    let before = state
        .subnet(LAB_CUSTOM_SUBNET_ID)
        .unwrap()
        .available_ip_address_count;
    let state = admin
        .occupy(
            LAB_CUSTOM_SUBNET_ID,
            &["100.64.0.200".parse().unwrap()],
            &["100.64.1.16/28".parse().unwrap()],
        )
        .unwrap();
    let subnet = state.subnet(LAB_CUSTOM_SUBNET_ID).unwrap();
    assert_eq!(subnet.available_ip_address_count, before - 17);
    assert_eq!(subnet.occupied_by_others, 17);
    let err = admin
        .occupy(
            LAB_CUSTOM_SUBNET_ID,
            &["100.64.0.200".parse().unwrap()],
            &[],
        )
        .unwrap_err();
    assert!(err.to_string().contains("InvalidIPAddress.InUse"), "{err}");
    let tags = std::collections::BTreeMap::from([(
        "node.k8s.amazonaws.com/instance_id".to_owned(),
        "i-0dead000000000000".to_owned(),
    )]);
    let leaked = admin
        .create_leaked_eni(LAB_CUSTOM_SUBNET_ID, &tags, 2)
        .unwrap();
    let state = admin.state().unwrap();
    let leaked = state.eni(&leaked).unwrap();
    assert_eq!(leaked.tags, tags);
    assert_eq!(leaked.secondary_ips.len(), 2);
    assert!(leaked.attachment.is_none());
    let calls = admin
        .set_faults(&[vpcnet_lab::ec2::config::FaultRule {
            action: "*".into(),
            throttle: 1.0,
            ..Default::default()
        }])
        .unwrap();
    assert_eq!(calls.faults.len(), 1);
    let calls = admin.set_attach_delay(Duration::from_millis(50)).unwrap();
    assert_eq!(calls.attach_delay_ms, 50);
    let throttled = in_node(async || client().describe_vpcs().send().await.is_err());
    assert!(throttled);
    let calls = admin.set_faults(&[]).unwrap();
    assert!(calls.action("DescribeVpcs").throttled >= 1);
    assert_eq!(calls.action("AttachNetworkInterface").calls, 1);
}

fn client() -> Client {
    Client::from_conf(
        aws_sdk_ec2::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new(LAB_REGION))
            .endpoint_url(vpcnet_lab::ec2::EC2_ENDPOINT_URL)
            .credentials_provider(Credentials::new("AKIDLAB", "secret", None, None, "test"))
            .build(),
    )
}

/// Runs `f` on a tokio runtime inside `vpcnet-node`.
fn in_node<T: Send>(f: impl AsyncFnOnce() -> T + Send) -> T {
    run_in(addrs::NS_NODE, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f())
    })
    .unwrap()
}

/// Polls (bounded) until the ENI's attachment status is `want`.
async fn wait_attachment(ec2: &Client, eni: &str, want: Option<AttachmentStatus>) {
    for _ in 0..200 {
        let described = ec2
            .describe_network_interfaces()
            .network_interface_ids(eni)
            .send()
            .await
            .unwrap();
        let status = described.network_interfaces()[0]
            .attachment()
            .and_then(|a| a.status())
            .cloned();
        if status == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{eni} never reached {want:?}");
}
