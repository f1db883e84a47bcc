//! The EC2 emulator on the wire, through the agent's own clients:
//! `aws-sdk-ec2` for the Query API and `aws-config`'s IMDS client, both
//! talking to an in-process emulator inside a namespace this test makes
//! (`vpcnet-ec2-wire`), where the EC2 endpoint (10.20.0.10), IMDS
//! (169.254.169.254) and the node's address (10.20.11.162, the source IMDS
//! sees) are on `lo`.
//!
//! Root needed; one at a time (`serial()`); the namespace is removed by a
//! guard even when an assertion fails.

mod common;

use std::{
    collections::BTreeSet,
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use aws_config::{BehaviorVersion, Region};
use aws_sdk_ec2::{
    Client,
    config::{Credentials, retry::RetryConfig},
    error::ProvideErrorMetadata,
    types::{
        AttachmentStatus, AttributeBooleanValue, Filter, InstanceStateName, InstanceType,
        InstanceTypeHypervisor, InterfaceProtocolType, NetworkInterfaceAttachmentChanges,
        NetworkInterfaceCreationType, NetworkInterfaceStatus, NetworkInterfaceType, ResourceType,
        Tag, TagSpecification,
    },
};
use common::lab_session;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vpcnet_lab::{
    addrs::{EC2_ENDPOINT_ADDR, IMDS_ADDR, NODE_ETH0_MAC, NODE_PRIMARY_ADDR},
    ec2::{
        Config, Emulator,
        admin::RunInstanceRequest,
        config::{
            FaultRule, LAB_CUSTOM_SUBNET_ID, LAB_DEFAULT_SG_ID, LAB_NODE_SG_ID, LAB_NODE_SUBNET_ID,
            LAB_PEER_SUBNET_ID, LAB_VPC_ID,
        },
        fabric::NoFabric,
    },
    netns,
};

const NS: &str = "vpcnet-ec2-wire";

/// The test's namespace, removed when dropped.
struct TestNs;

impl TestNs {
    fn new() -> Self {
        netns::create_namespaces(&[NS.to_owned()]).unwrap();
        let guard = Self;
        netns::ip_batch(
            Some(NS),
            &[
                "link set lo up".to_owned(),
                format!("addr add {NODE_PRIMARY_ADDR}/32 dev lo"),
                format!("addr add {EC2_ENDPOINT_ADDR}/32 dev lo"),
                format!("addr add {IMDS_ADDR}/32 dev lo"),
                // Calls to IMDS leave from the node's address, as the
                // node's do in the lab.
                format!(
                    "route replace local {IMDS_ADDR} dev lo table local src {NODE_PRIMARY_ADDR}"
                ),
            ],
        )
        .unwrap();
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

/// What a wire test gets.
struct Ctx {
    emulator: Emulator,
    ec2: Client,
    imds: aws_config::imds::Client,
    instance: String,
}

fn ec2_client() -> Client {
    let config = aws_sdk_ec2::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-west-2"))
        .endpoint_url(format!("http://{EC2_ENDPOINT_ADDR}"))
        .credentials_provider(Credentials::new("AKIDLAB", "secret", None, None, "test"))
        // Injected faults must reach the test, not be retried away.
        .retry_config(RetryConfig::disabled())
        .build();
    Client::from_conf(config)
}

fn imds_client() -> aws_config::imds::Client {
    aws_config::imds::Client::builder()
        .endpoint(format!("http://{IMDS_ADDR}"))
        .unwrap()
        .max_attempts(1)
        .build()
}

/// Runs `test` against a fresh emulator (the node's instance launched,
/// `instance_type`) inside the test namespace.
fn wire(config: Config, instance_type: &str, test: impl AsyncFnOnce(Ctx) + Send) {
    let _lock = lab_session();
    let _ns = TestNs::new();
    let instance_type = instance_type.to_owned();
    netns::run_in(NS, move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let emulator = Emulator::new(&config, Box::new(NoFabric));
            let ec2 = tokio::net::TcpListener::bind((EC2_ENDPOINT_ADDR, 80))
                .await
                .unwrap();
            let imds = tokio::net::TcpListener::bind((IMDS_ADDR, 80))
                .await
                .unwrap();
            let server = emulator.clone();
            tokio::spawn(async move { server.serve_ec2(ec2).await });
            let server = emulator.clone();
            tokio::spawn(async move { server.serve_imds(imds).await });
            let instance = emulator
                .run_instance(&RunInstanceRequest {
                    instance_type,
                    subnet_id: LAB_NODE_SUBNET_ID.into(),
                    private_ip: Some(NODE_PRIMARY_ADDR),
                    image_id: None,
                })
                .unwrap();
            test(Ctx {
                emulator,
                ec2: ec2_client(),
                imds: imds_client(),
                instance,
            })
            .await;
        });
    })
    .unwrap();
}

fn quick() -> Config {
    Config {
        attach_delay_ms: 0,
        ..Config::lab()
    }
}

/// The EC2 error code of a failed call.
fn code<T: std::fmt::Debug, E: ProvideErrorMetadata + std::fmt::Debug>(
    result: Result<T, E>,
) -> String {
    let err = result.expect_err("the call should have failed");
    err.code().unwrap_or("<no code>").to_owned()
}

/// One raw HTTP/1.1 request (what the SDK would never send); status, body.
async fn raw(addr: Ipv4Addr, request: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect((addr, 80)).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).await.unwrap();
    let status = reply
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = reply
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

async fn create_eni(ec2: &Client, subnet: &str) -> String {
    ec2.create_network_interface()
        .subnet_id(subnet)
        .send()
        .await
        .unwrap()
        .network_interface()
        .unwrap()
        .network_interface_id()
        .unwrap()
        .to_owned()
}

async fn describe_eni(ec2: &Client, id: &str) -> aws_sdk_ec2::types::NetworkInterface {
    ec2.describe_network_interfaces()
        .network_interface_ids(id)
        .send()
        .await
        .unwrap()
        .network_interfaces()[0]
        .clone()
}

#[test]
fn ec2_every_action_parses_with_the_sdk() {
    wire(quick(), "m5.large", async |ctx| {
        describes_parse(&ctx).await;
        let (eni_id, attachment_id) = eni_lifecycle_parses(&ctx).await;
        eni_changes_parse(&ctx, &eni_id, &attachment_id).await;
        trunks_parse(&ctx).await;
        instances_parse(&ctx).await;
    });
}

async fn describes_parse(ctx: &Ctx) {
    let ec2 = &ctx.ec2;
    // DescribeInstanceTypes: the limits the warm pool depends on.
    let types = ec2
        .describe_instance_types()
        .instance_types(InstanceType::M5Large)
        .instance_types(InstanceType::from("c5.18xlarge"))
        .send()
        .await
        .unwrap();
    let limits: Vec<_> = types
        .instance_types()
        .iter()
        .map(|t| {
            let net = t.network_info().unwrap();
            assert_eq!(t.hypervisor(), Some(&InstanceTypeHypervisor::Nitro));
            assert_eq!(net.default_network_card_index(), Some(0));
            assert_eq!(
                net.network_cards()[0].maximum_network_interfaces(),
                net.maximum_network_interfaces()
            );
            (
                t.instance_type().unwrap().as_str().to_owned(),
                net.maximum_network_interfaces().unwrap(),
                net.ipv4_addresses_per_interface().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        limits,
        vec![
            ("c5.18xlarge".to_owned(), 15, 50),
            ("m5.large".to_owned(), 3, 10)
        ]
    );

    // DescribeVpcs: both CIDRs.
    let vpcs = ec2.describe_vpcs().send().await.unwrap();
    let vpc = &vpcs.vpcs()[0];
    assert_eq!(vpc.vpc_id(), Some(LAB_VPC_ID));
    let cidrs: Vec<_> = vpc
        .cidr_block_association_set()
        .iter()
        .filter_map(|a| a.cidr_block())
        .collect();
    assert_eq!(cidrs, vec!["10.20.0.0/16", "100.64.0.0/16"]);

    // DescribeSubnets: free counts (the node's primary takes one).
    let subnets = ec2
        .describe_subnets()
        .subnet_ids(LAB_NODE_SUBNET_ID)
        .send()
        .await
        .unwrap();
    let subnet = &subnets.subnets()[0];
    assert_eq!(subnet.cidr_block(), Some("10.20.11.0/24"));
    assert_eq!(subnet.available_ip_address_count(), Some(250));
    assert_eq!(subnet.vpc_id(), Some(LAB_VPC_ID));
    assert_eq!(subnet.availability_zone(), Some("us-west-2a"));
    assert_eq!(subnet.tags()[0].key(), Some("Name"));

    // DescribeInstances: the node with its primary ENI.
    let reservations = ec2
        .describe_instances()
        .instance_ids(&ctx.instance)
        .send()
        .await
        .unwrap();
    let instance = &reservations.reservations()[0].instances()[0];
    assert_eq!(instance.private_ip_address(), Some("10.20.11.162"));
    assert_eq!(instance.instance_type(), Some(&InstanceType::M5Large));
    let primary = &instance.network_interfaces()[0];
    assert_eq!(primary.mac_address(), Some(NODE_ETH0_MAC));
    assert_eq!(primary.attachment().unwrap().device_index(), Some(0));
}

async fn eni_lifecycle_parses(ctx: &Ctx) -> (String, String) {
    let ec2 = &ctx.ec2;
    // CreateNetworkInterface with everything the agent sends.
    let created = ec2
        .create_network_interface()
        .subnet_id(LAB_NODE_SUBNET_ID)
        .groups(LAB_NODE_SG_ID)
        .description("aws-K8S-i-node")
        .secondary_private_ip_address_count(2)
        .tag_specifications(
            TagSpecification::builder()
                .resource_type(ResourceType::NetworkInterface)
                .tags(
                    Tag::builder()
                        .key("node.k8s.amazonaws.com/instance_id")
                        .value(&ctx.instance)
                        .build(),
                )
                .build(),
        )
        .send()
        .await
        .unwrap();
    let eni = created.network_interface().unwrap();
    let eni_id = eni.network_interface_id().unwrap().to_owned();
    assert_eq!(eni.status(), Some(&NetworkInterfaceStatus::Available));
    assert_eq!(eni.private_ip_addresses().len(), 3);
    assert_eq!(eni.private_ip_addresses()[0].primary(), Some(true));
    assert_eq!(eni.groups()[0].group_id(), Some(LAB_NODE_SG_ID));
    assert_eq!(eni.tag_set()[0].value(), Some(ctx.instance.as_str()));
    assert_eq!(eni.description(), Some("aws-K8S-i-node"));

    // AttachNetworkInterface (no delay in this config).
    let attachment = ec2
        .attach_network_interface()
        .network_interface_id(&eni_id)
        .instance_id(&ctx.instance)
        .device_index(1)
        .network_card_index(0)
        .send()
        .await
        .unwrap();
    let attachment_id = attachment.attachment_id().unwrap().to_owned();
    assert_eq!(attachment.network_card_index(), Some(0));
    let described = describe_eni(ec2, &eni_id).await;
    assert_eq!(described.status(), Some(&NetworkInterfaceStatus::InUse));
    let a = described.attachment().unwrap();
    assert_eq!(a.status(), Some(&AttachmentStatus::Attached));
    assert_eq!(a.instance_id(), Some(ctx.instance.as_str()));
    assert!(a.attach_time().is_some());

    // Assign and unassign addresses and prefixes.
    let assigned = ec2
        .assign_private_ip_addresses()
        .network_interface_id(&eni_id)
        .secondary_private_ip_address_count(3)
        .send()
        .await
        .unwrap();
    assert_eq!(assigned.assigned_private_ip_addresses().len(), 3);
    let prefix = ec2
        .assign_private_ip_addresses()
        .network_interface_id(&eni_id)
        .ipv4_prefix_count(1)
        .send()
        .await
        .unwrap();
    let prefix = prefix.assigned_ipv4_prefixes()[0]
        .ipv4_prefix()
        .unwrap()
        .to_owned();
    assert!(prefix.ends_with("/28"), "{prefix}");
    let one = assigned.assigned_private_ip_addresses()[0]
        .private_ip_address()
        .unwrap()
        .to_owned();
    ec2.unassign_private_ip_addresses()
        .network_interface_id(&eni_id)
        .private_ip_addresses(&one)
        .send()
        .await
        .unwrap();
    ec2.unassign_private_ip_addresses()
        .network_interface_id(&eni_id)
        .ipv4_prefixes(&prefix)
        .send()
        .await
        .unwrap();
    let described = describe_eni(ec2, &eni_id).await;
    assert_eq!(described.private_ip_addresses().len(), 5);
    assert!(described.ipv4_prefixes().is_empty());

    (eni_id, attachment_id)
}

async fn eni_changes_parse(ctx: &Ctx, eni_id: &str, attachment_id: &str) {
    let ec2 = &ctx.ec2;
    let (eni_id, attachment_id) = (eni_id.to_owned(), attachment_id.to_owned());
    // ModifyNetworkInterfaceAttribute, one attribute a call.
    ec2.modify_network_interface_attribute()
        .network_interface_id(&eni_id)
        .attachment(
            NetworkInterfaceAttachmentChanges::builder()
                .attachment_id(&attachment_id)
                .delete_on_termination(true)
                .build(),
        )
        .send()
        .await
        .unwrap();
    ec2.modify_network_interface_attribute()
        .network_interface_id(&eni_id)
        .source_dest_check(AttributeBooleanValue::builder().value(false).build())
        .send()
        .await
        .unwrap();
    ec2.modify_network_interface_attribute()
        .network_interface_id(&eni_id)
        .groups(LAB_DEFAULT_SG_ID)
        .groups(LAB_NODE_SG_ID)
        .send()
        .await
        .unwrap();
    let described = describe_eni(ec2, &eni_id).await;
    assert_eq!(
        described.attachment().unwrap().delete_on_termination(),
        Some(true)
    );
    assert_eq!(described.source_dest_check(), Some(false));
    assert_eq!(described.groups().len(), 2);

    // Tags.
    ec2.create_tags()
        .resources(&eni_id)
        .tags(
            Tag::builder()
                .key("cluster.k8s.amazonaws.com/name")
                .value("lab")
                .build(),
        )
        .send()
        .await
        .unwrap();
    ec2.delete_tags()
        .resources(&eni_id)
        .tags(
            Tag::builder()
                .key("node.k8s.amazonaws.com/instance_id")
                .build(),
        )
        .send()
        .await
        .unwrap();
    let described = describe_eni(ec2, &eni_id).await;
    let keys: Vec<_> = described.tag_set().iter().filter_map(|t| t.key()).collect();
    assert_eq!(keys, vec!["cluster.k8s.amazonaws.com/name"]);

    // Detach, delete.
    ec2.detach_network_interface()
        .attachment_id(&attachment_id)
        .force(true)
        .send()
        .await
        .unwrap();
    let described = describe_eni(ec2, &eni_id).await;
    assert_eq!(described.status(), Some(&NetworkInterfaceStatus::Available));
    assert!(described.attachment().is_none());
    ec2.delete_network_interface()
        .network_interface_id(&eni_id)
        .send()
        .await
        .unwrap();
}

/// `branch` on VLAN `vlan` of `trunk`, ready to send.
fn associate(
    ec2: &Client,
    branch: &str,
    trunk: &str,
    vlan: i32,
) -> aws_sdk_ec2::operation::associate_trunk_interface::builders::AssociateTrunkInterfaceFluentBuilder
{
    ec2.associate_trunk_interface()
        .branch_interface_id(branch)
        .trunk_interface_id(trunk)
        .vlan_id(vlan)
}

/// A trunk ENI and a branch ENI on one of its VLANs, as the VPC resource
/// controller makes them, and the rules EC2 keeps around them.
async fn trunks_parse(ctx: &Ctx) {
    let ec2 = &ctx.ec2;
    let trunk = ec2
        .create_network_interface()
        .subnet_id(LAB_NODE_SUBNET_ID)
        .interface_type(NetworkInterfaceCreationType::Trunk)
        .description("aws-k8s-trunk-eni")
        .send()
        .await
        .unwrap()
        .network_interface()
        .unwrap()
        .clone();
    assert_eq!(trunk.interface_type(), Some(&NetworkInterfaceType::Trunk));
    let trunk_id = trunk.network_interface_id().unwrap().to_owned();
    let branch = create_eni(ec2, LAB_NODE_SUBNET_ID).await;
    let other = create_eni(ec2, LAB_NODE_SUBNET_ID).await;
    assert_eq!(
        describe_eni(ec2, &branch).await.interface_type(),
        Some(&NetworkInterfaceType::Interface)
    );
    let association = associate(ec2, &branch, &trunk_id, 7)
        .send()
        .await
        .unwrap()
        .interface_association()
        .unwrap()
        .clone();
    assert_eq!(association.vlan_id(), Some(7));
    assert_eq!(association.branch_interface_id(), Some(branch.as_str()));
    assert_eq!(association.trunk_interface_id(), Some(trunk_id.as_str()));
    assert_eq!(
        association.interface_protocol(),
        Some(&InterfaceProtocolType::Vlan)
    );
    let association_id = association.association_id().unwrap().to_owned();
    trunk_rules_hold(ctx, &trunk_id, &branch, &other).await;
    // Found by the filter the controller sends.
    let by_trunk = |trunk: &str| {
        ec2.describe_trunk_interface_associations()
            .filters(
                Filter::builder()
                    .name("trunk-interface-association.trunk-interface-id")
                    .values(trunk)
                    .build(),
            )
            .send()
    };
    let described = by_trunk(&trunk_id).await.unwrap();
    let ids: Vec<&str> = described
        .interface_associations()
        .iter()
        .filter_map(|a| a.association_id())
        .collect();
    assert_eq!(ids, [association_id.as_str()]);
    let disassociated = ec2
        .disassociate_trunk_interface()
        .association_id(&association_id)
        .send()
        .await
        .unwrap();
    assert_eq!(disassociated.r#return(), Some(true));
    assert_eq!(
        code(
            ec2.disassociate_trunk_interface()
                .association_id(&association_id)
                .send()
                .await
        ),
        "InvalidAssociationID.NotFound"
    );
    assert!(
        by_trunk(&trunk_id)
            .await
            .unwrap()
            .interface_associations()
            .is_empty()
    );
    for eni in [&branch, &other, &trunk_id] {
        ec2.delete_network_interface()
            .network_interface_id(eni)
            .send()
            .await
            .unwrap();
    }
}

/// Around an association (`branch` on VLAN 7 of `trunk`): a VLAN is one
/// branch's, a branch is on one VLAN, only a trunk carries branches, and
/// neither is deleted or attached while associated.
async fn trunk_rules_hold(ctx: &Ctx, trunk_id: &str, branch: &str, other: &str) {
    let ec2 = &ctx.ec2;
    for (branch, trunk, vlan, expected) in [
        (other, trunk_id, 7, "InvalidParameterValue"),
        (branch, trunk_id, 8, "InvalidNetworkInterface.InUse"),
        (other, branch, 8, "InvalidParameterValue"),
        (other, trunk_id, 4095, "InvalidParameterValue"),
    ] {
        assert_eq!(
            code(associate(ec2, branch, trunk, vlan).send().await),
            expected,
            "{branch} on VLAN {vlan} of {trunk}"
        );
    }
    for eni in [trunk_id, branch] {
        assert_eq!(
            code(
                ec2.delete_network_interface()
                    .network_interface_id(eni)
                    .send()
                    .await
            ),
            "InvalidNetworkInterface.InUse"
        );
    }
    assert_eq!(
        code(
            ec2.attach_network_interface()
                .network_interface_id(branch)
                .instance_id(&ctx.instance)
                .device_index(3)
                .send()
                .await
        ),
        "InvalidNetworkInterface.InUse"
    );
}

async fn instances_parse(ctx: &Ctx) {
    let ec2 = &ctx.ec2;
    // RunInstances and TerminateInstances.
    let run = ec2
        .run_instances()
        .image_id("ami-0123456789abcdef0")
        .instance_type(InstanceType::T3Small)
        .min_count(1)
        .max_count(1)
        .subnet_id(LAB_PEER_SUBNET_ID)
        .send()
        .await
        .unwrap();
    let other = run.instances()[0].instance_id().unwrap().to_owned();
    assert_eq!(run.instances()[0].network_interfaces().len(), 1);
    let terminated = ec2
        .terminate_instances()
        .instance_ids(&other)
        .send()
        .await
        .unwrap();
    let change = &terminated.terminating_instances()[0];
    assert_eq!(
        change.current_state().unwrap().name(),
        Some(&InstanceStateName::Terminated)
    );
    assert_eq!(
        change.previous_state().unwrap().name(),
        Some(&InstanceStateName::Running)
    );
    let calls = ctx.emulator.calls();
    for action in vpcnet_lab::ec2::query::ACTIONS {
        assert!(calls.action(action).calls > 0, "{action} was not exercised");
    }
}

#[test]
fn ec2_pagination_and_filters() {
    wire(quick(), "c5.18xlarge", async |ctx| {
        let tagged_a = paging_covers_everything(&ctx).await;
        filters_select(&ctx, &tagged_a).await;
        paging_is_validated(&ctx, tagged_a.iter().next().unwrap()).await;
    });
}

async fn paging_covers_everything(ctx: &Ctx) -> BTreeSet<String> {
    let ec2 = &ctx.ec2;
    let mut tagged_a = BTreeSet::new();
    for i in 0..12 {
        let id = create_eni(ec2, LAB_CUSTOM_SUBNET_ID).await;
        let cluster = if i < 7 { "a" } else { "b" };
        ec2.create_tags()
            .resources(&id)
            .tags(Tag::builder().key("cluster").value(cluster).build())
            .send()
            .await
            .unwrap();
        if i < 7 {
            tagged_a.insert(id);
        }
    }
    // 13 ENIs (with the node's primary) in pages of 5: three pages.
    let mut seen = Vec::new();
    let mut token: Option<String> = None;
    let mut pages = 0;
    loop {
        let page = ec2
            .describe_network_interfaces()
            .max_results(5)
            .set_next_token(token.clone())
            .send()
            .await
            .unwrap();
        pages += 1;
        assert!(page.network_interfaces().len() <= 5);
        seen.extend(
            page.network_interfaces()
                .iter()
                .map(|e| e.network_interface_id().unwrap().to_owned()),
        );
        token = page.next_token().map(str::to_owned);
        if token.is_none() || pages > 10 {
            break;
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(seen.len(), 13);
    assert_eq!(
        seen.iter().collect::<BTreeSet<_>>().len(),
        13,
        "no ENI twice"
    );
    // The SDK's own paginator agrees.
    let all: Vec<_> = ec2
        .describe_network_interfaces()
        .max_results(5)
        .into_paginator()
        .items()
        .send()
        .collect::<Result<Vec<_>, _>>()
        .await
        .unwrap();
    assert_eq!(all.len(), 13);

    tagged_a
}

async fn filters_select(ctx: &Ctx, tagged_a: &BTreeSet<String>) {
    let ec2 = &ctx.ec2;
    let ids = async |filters: Vec<Filter>| -> BTreeSet<String> {
        ec2.describe_network_interfaces()
            .set_filters(Some(filters))
            .send()
            .await
            .unwrap()
            .network_interfaces()
            .iter()
            .map(|e| e.network_interface_id().unwrap().to_owned())
            .collect()
    };
    let filter = |name: &str, values: &[&str]| {
        Filter::builder()
            .name(name)
            .set_values(Some(values.iter().map(|v| (*v).to_owned()).collect()))
            .build()
    };
    assert_eq!(ids(vec![filter("tag:cluster", &["a"])]).await, *tagged_a);
    assert_eq!(ids(vec![filter("tag-key", &["cluster"])]).await.len(), 12);
    assert_eq!(
        ids(vec![filter("subnet-id", &[LAB_CUSTOM_SUBNET_ID])])
            .await
            .len(),
        12
    );
    assert_eq!(ids(vec![filter("vpc-id", &[LAB_VPC_ID])]).await.len(), 13);
    assert_eq!(ids(vec![filter("status", &["available"])]).await.len(), 12);
    let node = ids(vec![filter("attachment.instance-id", &[&ctx.instance])]).await;
    assert_eq!(node.len(), 1);
    let by_addr = ids(vec![filter(
        "addresses.private-ip-address",
        &["10.20.11.162"],
    )])
    .await;
    assert_eq!(by_addr, node);
    assert_eq!(
        ids(vec![filter("attachment.status", &["attached"])]).await,
        node
    );
    let one = tagged_a.iter().next().unwrap().clone();
    assert_eq!(
        ids(vec![
            filter("network-interface-id", &[&one]),
            filter("tag:cluster", &["a", "b"])
        ])
        .await,
        BTreeSet::from([one.clone()])
    );
    // A filter of two conditions is an AND; values within one an OR.
    assert!(
        ids(vec![
            filter("tag:cluster", &["b"]),
            filter("network-interface-id", &[&one])
        ])
        .await
        .is_empty()
    );
    assert_eq!(
        ids(vec![filter("tag:cluster", &["?"])]).await.len(),
        12,
        "wildcards"
    );
}

async fn paging_is_validated(ctx: &Ctx, one: &str) {
    let ec2 = &ctx.ec2;
    let one = one.to_owned();
    let filter = |name: &str, values: &[&str]| {
        Filter::builder()
            .name(name)
            .set_values(Some(values.iter().map(|v| (*v).to_owned()).collect()))
            .build()
    };
    // EC2's validation of paging.
    assert_eq!(
        code(
            ec2.describe_network_interfaces()
                .max_results(4)
                .send()
                .await
        ),
        "InvalidParameterValue"
    );
    assert_eq!(
        code(
            ec2.describe_network_interfaces()
                .max_results(1001)
                .send()
                .await
        ),
        "InvalidParameterValue"
    );
    assert_eq!(
        code(
            ec2.describe_network_interfaces()
                .network_interface_ids(&one)
                .max_results(5)
                .send()
                .await
        ),
        "InvalidParameterCombination"
    );
    assert_eq!(
        code(
            ec2.describe_network_interfaces()
                .next_token("garbage")
                .send()
                .await
        ),
        "InvalidPaginationToken"
    );
    assert_eq!(
        code(
            ec2.describe_network_interfaces()
                .filters(filter("no-such-filter", &["x"]))
                .send()
                .await
        ),
        "InvalidParameterValue"
    );
}

#[test]
fn ec2_errors_arrive_as_ec2_codes() {
    wire(quick(), "m5.large", async |ctx| {
        unknown_ids_are_errors(&ctx).await;
        let second = limits_are_errors(&ctx).await;
        subnet_errors(&ctx, &second).await;
    });
}

async fn unknown_ids_are_errors(ctx: &Ctx) {
    let ec2 = &ctx.ec2;
    assert_eq!(
        code(
            ec2.describe_network_interfaces()
                .network_interface_ids("eni-0123456789abcdef0")
                .send()
                .await
        ),
        "InvalidNetworkInterfaceID.NotFound"
    );
    assert_eq!(
        code(
            ec2.describe_network_interfaces()
                .network_interface_ids("eni-xyz")
                .send()
                .await
        ),
        "InvalidNetworkInterfaceID.Malformed"
    );
    assert_eq!(
        code(
            ec2.create_network_interface()
                .subnet_id("subnet-0123456789abcdef0")
                .send()
                .await
        ),
        "InvalidSubnetID.NotFound"
    );
}

async fn limits_are_errors(ctx: &Ctx) -> String {
    let ec2 = &ctx.ec2;
    let eni = create_eni(ec2, LAB_NODE_SUBNET_ID).await;
    assert_eq!(
        code(
            ec2.attach_network_interface()
                .network_interface_id(&eni)
                .instance_id("i-0123456789abcdef0")
                .device_index(1)
                .send()
                .await
        ),
        "InvalidInstanceID.NotFound"
    );
    assert_eq!(
        code(
            ec2.detach_network_interface()
                .attachment_id("eni-attach-0123456789abcdef0")
                .send()
                .await
        ),
        "InvalidAttachmentID.NotFound"
    );
    let attach = async |eni: &str, device: i32| {
        ec2.attach_network_interface()
            .network_interface_id(eni)
            .instance_id(&ctx.instance)
            .device_index(device)
            .send()
            .await
    };
    attach(&eni, 1).await.unwrap();
    assert_eq!(code(attach(&eni, 2).await), "InvalidNetworkInterface.InUse");
    assert_eq!(
        code(
            ec2.delete_network_interface()
                .network_interface_id(&eni)
                .send()
                .await
        ),
        "InvalidNetworkInterface.InUse"
    );
    let second = create_eni(ec2, LAB_NODE_SUBNET_ID).await;
    assert_eq!(code(attach(&second, 1).await), "InvalidParameterValue");
    attach(&second, 2).await.unwrap();
    // m5.large: three ENIs.
    let third = create_eni(ec2, LAB_NODE_SUBNET_ID).await;
    assert_eq!(code(attach(&third, 3).await), "AttachmentLimitExceeded");
    // m5.large: ten addresses an ENI, the primary included.
    ec2.assign_private_ip_addresses()
        .network_interface_id(&eni)
        .secondary_private_ip_address_count(9)
        .send()
        .await
        .unwrap();
    assert_eq!(
        code(
            ec2.assign_private_ip_addresses()
                .network_interface_id(&eni)
                .ipv4_prefix_count(1)
                .send()
                .await
        ),
        "PrivateIpAddressLimitExceeded"
    );
    assert_eq!(
        code(
            ec2.assign_private_ip_addresses()
                .network_interface_id(&second)
                .secondary_private_ip_address_count(1)
                .ipv4_prefix_count(1)
                .send()
                .await
        ),
        "InvalidParameterCombination"
    );
    assert_eq!(
        code(
            ec2.assign_private_ip_addresses()
                .network_interface_id(&second)
                .send()
                .await
        ),
        "MissingParameter"
    );
    assert_eq!(
        code(
            ec2.assign_private_ip_addresses()
                .network_interface_id(&second)
                .private_ip_addresses("10.20.11.162")
                .send()
                .await
        ),
        "InvalidIPAddress.InUse"
    );
    second
}

async fn subnet_errors(ctx: &Ctx, second: &str) {
    let ec2 = &ctx.ec2;
    let second = second.to_owned();
    // A fragmented subnet: addresses left, no free aligned /28.
    ctx.emulator.with_state(|state| {
        let one_per_block: Vec<Ipv4Addr> = (0..16u8)
            .map(|b| Ipv4Addr::new(10, 20, 11, b * 16 + 9))
            .filter(|a| state.enis().all(|e| e.addresses().all(|x| x != *a)))
            .collect();
        state
            .occupy(LAB_NODE_SUBNET_ID, &one_per_block, &[])
            .unwrap();
    });
    assert_eq!(
        code(
            ec2.assign_private_ip_addresses()
                .network_interface_id(&second)
                .ipv4_prefix_count(1)
                .send()
                .await
        ),
        "InsufficientCidrBlocks"
    );
    ec2.assign_private_ip_addresses()
        .network_interface_id(&second)
        .secondary_private_ip_address_count(1)
        .send()
        .await
        .unwrap();
    // An exhausted subnet.
    ctx.emulator.with_state(|state| {
        let free: Vec<Ipv4Addr> = (4..255u8).map(|h| Ipv4Addr::new(10, 20, 12, h)).collect();
        state.occupy(LAB_PEER_SUBNET_ID, &free, &[]).unwrap();
    });
    assert_eq!(
        code(
            ec2.create_network_interface()
                .subnet_id(LAB_PEER_SUBNET_ID)
                .send()
                .await
        ),
        "InsufficientFreeAddressesInSubnet"
    );
    // Not an action at all: only a raw request can send that.
    let body = "Action=FlyToTheMoon&Version=2016-11-15";
    let (status, reply) = raw(
        EC2_ENDPOINT_ADDR,
        &format!(
            "POST / HTTP/1.1\r\nHost: ec2\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        reply.contains("<Response><Errors><Error><Code>InvalidAction</Code>"),
        "{reply}"
    );
    assert!(reply.contains("<RequestID>"), "{reply}");
}

#[test]
fn ec2_injected_faults_are_ec2_errors_and_counted() {
    wire(quick(), "m5.large", async |ctx| {
        let ec2 = &ctx.ec2;
        for (rule, code_expected, status) in [
            (
                FaultRule {
                    throttle: 1.0,
                    ..FaultRule::default()
                },
                "RequestLimitExceeded",
                503,
            ),
            (
                FaultRule {
                    unavailable: 1.0,
                    ..FaultRule::default()
                },
                "Unavailable",
                503,
            ),
            (
                FaultRule {
                    internal: 1.0,
                    ..FaultRule::default()
                },
                "InternalError",
                500,
            ),
            (
                FaultRule {
                    unauthorized: 1.0,
                    ..FaultRule::default()
                },
                "UnauthorizedOperation",
                403,
            ),
        ] {
            ctx.emulator.set_faults(vec![FaultRule {
                action: "DescribeNetworkInterfaces".into(),
                ..rule
            }]);
            let err = ec2.describe_network_interfaces().send().await.unwrap_err();
            assert_eq!(err.code(), Some(code_expected));
            assert_eq!(err.raw_response().unwrap().status().as_u16(), status);
            // Other actions are untouched.
            ec2.describe_vpcs().send().await.unwrap();
        }
        ctx.emulator.set_faults(vec![FaultRule {
            action: "*".into(),
            throttle: 0.5,
            ..FaultRule::default()
        }]);
        let mut throttled = 0;
        for _ in 0..40 {
            if let Err(err) = ec2.describe_subnets().send().await {
                assert_eq!(err.code(), Some("RequestLimitExceeded"));
                throttled += 1;
            }
        }
        assert!(
            (5..35).contains(&throttled),
            "{throttled} of 40 throttled at 0.5"
        );
        // The SDK's standard retries see throttling as retryable.
        ctx.emulator.set_faults(vec![]);
        let calls = ctx.emulator.calls();
        let dni = calls.action("DescribeNetworkInterfaces");
        assert_eq!(
            (
                dni.calls,
                dni.throttled,
                dni.unavailable,
                dni.internal,
                dni.unauthorized
            ),
            (4, 1, 1, 1, 1)
        );
        let subnets = calls.action("DescribeSubnets");
        assert_eq!(subnets.calls, 40);
        assert_eq!(subnets.throttled, throttled);
        let retrying = Client::from_conf(
            ctx.ec2
                .config()
                .to_builder()
                .retry_config(
                    RetryConfig::standard()
                        .with_max_attempts(10)
                        .with_initial_backoff(Duration::from_millis(1)),
                )
                .build(),
        );
        ctx.emulator.set_faults(vec![FaultRule {
            action: "DescribeVpcs".into(),
            throttle: 0.5,
            ..FaultRule::default()
        }]);
        for _ in 0..5 {
            retrying.describe_vpcs().send().await.unwrap();
        }
    });
}

#[test]
fn ec2_attach_delay_is_observable() {
    let config = Config {
        attach_delay_ms: 300,
        ..Config::lab()
    };
    wire(config, "m5.large", async |ctx| {
        let ec2 = &ctx.ec2;
        let eni = create_eni(ec2, LAB_NODE_SUBNET_ID).await;
        let started = Instant::now();
        let attachment = ec2
            .attach_network_interface()
            .network_interface_id(&eni)
            .instance_id(&ctx.instance)
            .device_index(1)
            .send()
            .await
            .unwrap()
            .attachment_id()
            .unwrap()
            .to_owned();
        let described = describe_eni(ec2, &eni).await;
        assert_eq!(
            described.attachment().unwrap().status(),
            Some(&AttachmentStatus::Attaching)
        );
        let macs = ctx
            .imds
            .get("/latest/meta-data/network/interfaces/macs/")
            .await
            .unwrap();
        assert_eq!(
            macs.as_ref().lines().count(),
            1,
            "IMDS shows an ENI only once attached"
        );
        let status = poll_attachment(ec2, &eni, Some(AttachmentStatus::Attached)).await;
        assert!(status >= Duration::ZERO);
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "attached before the delay"
        );
        let mac = describe_eni(ec2, &eni)
            .await
            .mac_address()
            .unwrap()
            .to_owned();
        let macs = ctx
            .imds
            .get("/latest/meta-data/network/interfaces/macs/")
            .await
            .unwrap();
        assert!(
            macs.as_ref().lines().any(|l| l == format!("{mac}/")),
            "{}",
            macs.as_ref()
        );
        let device = ctx
            .imds
            .get(format!(
                "/latest/meta-data/network/interfaces/macs/{mac}/device-number"
            ))
            .await
            .unwrap();
        assert_eq!(device.as_ref(), "1");

        ec2.detach_network_interface()
            .attachment_id(&attachment)
            .send()
            .await
            .unwrap();
        let described = describe_eni(ec2, &eni).await;
        assert_eq!(
            described.attachment().unwrap().status(),
            Some(&AttachmentStatus::Detaching)
        );
        poll_attachment(ec2, &eni, None).await;
        assert_eq!(
            describe_eni(ec2, &eni).await.status(),
            Some(&NetworkInterfaceStatus::Available)
        );
    });
}

/// Polls (bounded) until the ENI's attachment status is `want` (`None`: no
/// attachment); how long it took.
async fn poll_attachment(ec2: &Client, eni: &str, want: Option<AttachmentStatus>) -> Duration {
    let started = Instant::now();
    for _ in 0..200 {
        let described = describe_eni(ec2, eni).await;
        let status = described.attachment().and_then(|a| a.status()).cloned();
        if status == want {
            return started.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{eni} never reached {want:?}");
}

#[test]
fn imds_token_flow_and_metadata() {
    wire(quick(), "m5.large", async |ctx| {
        imds_refuses_without_token().await;
        let (eni, mac, local_ipv4s) = imds_setup(&ctx).await;
        imds_metadata(&ctx, &eni, &mac, &local_ipv4s).await;
    });
}

async fn imds_refuses_without_token() {
    // IMDSv2 only: no token, no answer; a bad TTL, no token.
    let (status, _) = raw(
        IMDS_ADDR,
        "GET /latest/meta-data/instance-id HTTP/1.1\r\nHost: imds\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 401);
    for ttl in ["0", "21601"] {
        let (status, _) = raw(
            IMDS_ADDR,
            &format!("PUT /latest/api/token HTTP/1.1\r\nHost: imds\r\nX-aws-ec2-metadata-token-ttl-seconds: {ttl}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"),
        )
        .await;
        assert_eq!(status, 400, "ttl {ttl}");
    }
    let (status, _) = raw(
        IMDS_ADDR,
        "GET /latest/meta-data/instance-id HTTP/1.1\r\nHost: imds\r\nX-aws-ec2-metadata-token: forged\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 401);
}

async fn imds_setup(ctx: &Ctx) -> (String, String, Vec<String>) {
    // A second ENI with addresses and a prefix, attached at once.
    let ec2 = &ctx.ec2;
    let eni = create_eni(ec2, LAB_NODE_SUBNET_ID).await;
    ec2.attach_network_interface()
        .network_interface_id(&eni)
        .instance_id(&ctx.instance)
        .device_index(1)
        .send()
        .await
        .unwrap();
    let assigned = ec2
        .assign_private_ip_addresses()
        .network_interface_id(&eni)
        .secondary_private_ip_address_count(2)
        .send()
        .await
        .unwrap();
    let primary_eni = &ec2
        .describe_instances()
        .send()
        .await
        .unwrap()
        .reservations()[0]
        .instances()[0]
        .network_interfaces()[0]
        .network_interface_id()
        .unwrap()
        .to_owned();
    ec2.assign_private_ip_addresses()
        .network_interface_id(primary_eni)
        .ipv4_prefix_count(1)
        .send()
        .await
        .unwrap();
    let described = describe_eni(ec2, &eni).await;
    let mac = described.mac_address().unwrap().to_owned();
    let eni_primary = described.private_ip_address().unwrap().to_owned();
    let mut expected = vec![eni_primary];
    expected.extend(
        assigned
            .assigned_private_ip_addresses()
            .iter()
            .map(|a| a.private_ip_address().unwrap().to_owned()),
    );
    (eni, mac, expected)
}

async fn imds_metadata(ctx: &Ctx, eni: &str, mac: &str, expected: &[String]) {
    let get = async |path: &str| -> String {
        ctx.imds
            .get(path)
            .await
            .unwrap_or_else(|e| panic!("{path}: {e}"))
            .as_ref()
            .to_owned()
    };
    assert_eq!(get("/latest/meta-data/instance-id").await, ctx.instance);
    assert_eq!(get("/latest/meta-data/instance-type").await, "m5.large");
    assert_eq!(get("/latest/meta-data/local-ipv4").await, "10.20.11.162");
    assert_eq!(get("/latest/meta-data/mac").await, NODE_ETH0_MAC);
    assert_eq!(
        get("/latest/meta-data/placement/availability-zone").await,
        "us-west-2a"
    );
    assert_eq!(get("/latest/meta-data/placement/region").await, "us-west-2");
    assert!(
        get("/latest/meta-data/")
            .await
            .lines()
            .any(|l| l == "network/")
    );
    assert_eq!(
        get("/latest/meta-data/network/interfaces/macs/").await,
        format!("{NODE_ETH0_MAC}/\n{mac}/")
    );
    let key = async |mac: &str, key: &str| {
        get(&format!(
            "/latest/meta-data/network/interfaces/macs/{mac}/{key}"
        ))
        .await
    };
    assert_eq!(key(mac, "device-number").await, "1");
    assert_eq!(key(mac, "network-card-index").await, "0");
    assert_eq!(key(mac, "interface-id").await, eni);
    assert_eq!(key(mac, "subnet-id").await, LAB_NODE_SUBNET_ID);
    assert_eq!(key(mac, "vpc-id").await, LAB_VPC_ID);
    assert_eq!(key(mac, "owner-id").await, "111122223333");
    assert_eq!(key(mac, "subnet-ipv4-cidr-block").await, "10.20.11.0/24");
    assert_eq!(key(mac, "vpc-ipv4-cidr-block").await, "10.20.0.0/16");
    assert_eq!(
        key(mac, "vpc-ipv4-cidr-blocks").await,
        "10.20.0.0/16\n100.64.0.0/16"
    );
    assert_eq!(key(mac, "security-group-ids").await, LAB_DEFAULT_SG_ID);
    let local: Vec<String> = key(mac, "local-ipv4s")
        .await
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(local, expected, "primary first");
    assert!(!key(mac, "").await.contains("ipv4-prefix"));
    let no_prefix = ctx
        .imds
        .get(format!(
            "/latest/meta-data/network/interfaces/macs/{mac}/ipv4-prefix"
        ))
        .await;
    assert!(no_prefix.is_err(), "404 when the ENI has no prefix");
    assert!(key(NODE_ETH0_MAC, "ipv4-prefix").await.ends_with("/28"));
    assert_eq!(key(NODE_ETH0_MAC, "device-number").await, "0");
    let document: serde_json::Value =
        serde_json::from_str(&get("/latest/dynamic/instance-identity/document").await).unwrap();
    assert_eq!(document["instanceId"], ctx.instance.as_str());
    assert_eq!(document["privateIp"], "10.20.11.162");
    assert_eq!(document["region"], "us-west-2");
    assert_eq!(document["accountId"], "111122223333");
    assert_eq!(
        get("/latest/meta-data/iam/security-credentials/").await,
        "vpcnet-lab-node"
    );
}

#[test]
fn imds_credentials_serve_the_sdk_default_chain() {
    wire(quick(), "m5.large", async |ctx| {
        use aws_config::default_provider::credentials::DefaultCredentialsChain;
        use aws_sdk_ec2::config::ProvideCredentials;
        let chain = DefaultCredentialsChain::builder()
            .imds_client(imds_client())
            .region(Region::new("us-west-2"))
            .build()
            .await;
        let credentials = chain.provide_credentials().await.unwrap();
        assert!(
            credentials.access_key_id().starts_with("ASIAVPCNETLAB"),
            "{} did not come from IMDS",
            credentials.access_key_id()
        );
        assert!(credentials.session_token().is_some());
        assert!(credentials.expiry().unwrap() > std::time::SystemTime::now());
        // And they sign calls the emulator answers.
        let client = Client::from_conf(
            aws_sdk_ec2::Config::builder()
                .behavior_version(BehaviorVersion::latest())
                .region(Region::new("us-west-2"))
                .endpoint_url(format!("http://{EC2_ENDPOINT_ADDR}"))
                .credentials_provider(chain)
                .build(),
        );
        let vpcs = client.describe_vpcs().send().await.unwrap();
        assert_eq!(vpcs.vpcs().len(), 1);
        drop(ctx);
    });
}
