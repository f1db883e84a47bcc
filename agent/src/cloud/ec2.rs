//! The EC2 calls the address manager makes, with aws-node's tags and
//! descriptions so either agent recognises the other's ENIs.

use std::{collections::BTreeMap, net::Ipv4Addr, time::Instant};

use aws_sdk_ec2::{
    config::http::HttpResponse,
    error::{ProvideErrorMetadata, SdkError},
    types::{
        AssignedPrivateIpAddress, Filter, Ipv4PrefixSpecification, NetworkInterface,
        NetworkInterfaceAttachmentChanges, ResourceType, Subnet, Tag, TagSpecification,
    },
};
use ipnet::Ipv4Net;

use super::{Cloud, CloudError};
use crate::telemetry::{self, Outcome};

/// Awaits EC2 call `action` and records it for the metrics, as aws-node's
/// awsutils does per call: the request, its failure, its latency, EC2's
/// error code. The SDK's own retries are inside one call.
async fn recorded<T, E>(
    action: &'static str,
    call: impl Future<Output = Result<T, SdkError<E, HttpResponse>>>,
) -> Result<T, CloudError>
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let began = Instant::now();
    record(action, began, call.await)
}

/// The `result` of EC2 call `action` begun at `began`, recorded (see
/// [`recorded`]).
fn record<T, E>(
    action: &'static str,
    began: Instant,
    result: Result<T, SdkError<E, HttpResponse>>,
) -> Result<T, CloudError>
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let elapsed = began.elapsed();
    match result {
        Ok(out) => {
            telemetry::ec2_call(action, elapsed, Outcome::Ok);
            Ok(out)
        }
        Err(e) => {
            let error = CloudError::from_sdk(action, &e);
            telemetry::ec2_call(action, elapsed, error.outcome());
            Err(error)
        }
    }
}

pub use vpcnet_api::pod::TAG_INSTANCE_ID;
/// When it was made, RFC 3339 (aws-node's tag; leaked-ENI cleanup reads it).
pub const TAG_CREATED_AT: &str = "node.k8s.amazonaws.com/createdAt";
/// The cluster it belongs to.
pub const TAG_CLUSTER_NAME: &str = "cluster.k8s.amazonaws.com/name";
/// Who manages an ENI of a named cluster (aws-node's tag), and its value.
pub const TAG_ENI_OWNER: &str = "eks:eni:owner";
pub const ENI_OWNER: &str = "amazon-vpc-cni";
/// An ENI tagged `true` is left alone: no address of it goes to pods.
pub const TAG_NO_MANAGE: &str = "node.k8s.amazonaws.com/no_manage";

/// The description aws-node gives its ENIs.
#[must_use]
pub fn eni_description(instance_id: &str) -> String {
    format!("aws-K8S-{instance_id}")
}

/// An instance type's network limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InstanceTypeLimits {
    pub max_enis: usize,
    /// IPv4 addresses per ENI, the ENI's primary address included.
    pub ips_per_eni: usize,
    /// Default vCPUs: the EKS max-pods cap with prefixes depends on them.
    pub vcpus: usize,
}

/// A subnet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubnetInfo {
    pub id: String,
    pub cidr: Ipv4Net,
    pub available_addresses: u32,
    pub vpc_id: String,
    pub availability_zone: String,
    pub tags: BTreeMap<String, String>,
}

impl SubnetInfo {
    fn from_sdk(action: &'static str, subnet: &Subnet) -> Result<Self, CloudError> {
        let incomplete = |field| CloudError::Incomplete { action, field };
        Ok(Self {
            id: subnet.subnet_id().ok_or(incomplete("SubnetId"))?.to_owned(),
            cidr: subnet
                .cidr_block()
                .and_then(|c| c.parse().ok())
                .ok_or(incomplete("CidrBlock"))?,
            available_addresses: subnet
                .available_ip_address_count()
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(0),
            vpc_id: subnet.vpc_id().unwrap_or_default().to_owned(),
            availability_zone: subnet.availability_zone().unwrap_or_default().to_owned(),
            tags: subnet
                .tags()
                .iter()
                .filter_map(|t| Some((t.key()?.to_owned(), t.value().unwrap_or("").to_owned())))
                .collect(),
        })
    }
}

/// An ENI as EC2 describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EniInfo {
    pub id: String,
    pub mac: String,
    pub subnet_id: String,
    /// `available`, `in-use`, ...
    pub status: String,
    pub attachment_id: Option<String>,
    /// `attaching`, `attached`, `detaching`, `detached`.
    pub attachment_status: Option<String>,
    pub device_index: Option<u32>,
    pub primary_addr: Option<Ipv4Addr>,
    pub secondary_addrs: Vec<Ipv4Addr>,
    pub prefixes: Vec<Ipv4Net>,
    pub tags: BTreeMap<String, String>,
    /// `interface`, `trunk`, `efa`, `efa-only`, ...
    pub interface_type: Option<String>,
}

/// EC2's `interfaceType` of a trunk ENI.
pub const INTERFACE_TYPE_TRUNK: &str = "trunk";

impl EniInfo {
    /// Tagged `no_manage=true` (exactly, as aws-node reads it): an ENI the
    /// operator keeps for themselves.
    #[must_use]
    pub fn no_manage(&self) -> bool {
        self.tags.get(TAG_NO_MANAGE).is_some_and(|v| v == "true")
    }

    /// An interface whose addresses may go to pods: not a trunk (the VPC
    /// resource controller's, for branch ENIs) nor an EFA-only one.
    #[must_use]
    pub fn holds_addresses(&self) -> bool {
        matches!(
            self.interface_type.as_deref(),
            None | Some("interface" | "efa")
        )
    }

    /// The VPC resource controller's trunk, which carries branch ENIs.
    #[must_use]
    pub fn is_trunk(&self) -> bool {
        self.interface_type.as_deref() == Some(INTERFACE_TYPE_TRUNK)
    }

    fn from_sdk(action: &'static str, eni: &NetworkInterface) -> Result<Self, CloudError> {
        let incomplete = |field| CloudError::Incomplete { action, field };
        let mut primary_addr = None;
        let mut secondary_addrs = Vec::new();
        for a in eni.private_ip_addresses() {
            let Some(addr) = a.private_ip_address().and_then(|a| a.parse().ok()) else {
                return Err(incomplete("PrivateIpAddress"));
            };
            if a.primary() == Some(true) {
                primary_addr = Some(addr);
            } else {
                secondary_addrs.push(addr);
            }
        }
        let prefixes = eni
            .ipv4_prefixes()
            .iter()
            .map(|p| {
                p.ipv4_prefix()
                    .and_then(|p| p.parse().ok())
                    .ok_or_else(|| incomplete("Ipv4Prefix"))
            })
            .collect::<Result<_, _>>()?;
        let attachment = eni.attachment();
        Ok(Self {
            id: eni
                .network_interface_id()
                .ok_or_else(|| incomplete("NetworkInterfaceId"))?
                .to_owned(),
            mac: eni.mac_address().unwrap_or_default().to_ascii_lowercase(),
            subnet_id: eni.subnet_id().unwrap_or_default().to_owned(),
            status: eni
                .status()
                .map(|s| s.as_str().to_owned())
                .unwrap_or_default(),
            attachment_id: attachment
                .and_then(|a| a.attachment_id())
                .map(str::to_owned),
            attachment_status: attachment
                .and_then(|a| a.status())
                .map(|s| s.as_str().to_owned()),
            device_index: attachment
                .and_then(aws_sdk_ec2::types::NetworkInterfaceAttachment::device_index)
                .and_then(|i| u32::try_from(i).ok()),
            primary_addr,
            secondary_addrs,
            prefixes,
            tags: eni
                .tag_set()
                .iter()
                .filter_map(|t| Some((t.key()?.to_owned(), t.value().unwrap_or("").to_owned())))
                .collect(),
            interface_type: eni.interface_type().map(|t| t.as_str().to_owned()),
        })
    }
}

/// What a new ENI gets.
#[derive(Clone, Debug)]
pub struct NewEni<'a> {
    pub subnet_id: &'a str,
    pub security_groups: &'a [String],
    pub instance_id: &'a str,
    /// [`managed_eni_tags`]; `createdAt` is added.
    pub tags: &'a BTreeMap<String, String>,
    /// Secondary addresses to assign with the ENI.
    pub secondary_addrs: usize,
    /// /28 prefixes to assign with the ENI (instead of addresses).
    pub prefixes: usize,
}

/// The tags aws-node keeps on every ENI it manages, the primary one
/// included: this instance's, the cluster's and its owner's when the
/// cluster is named, then the operator's (`ADDITIONAL_ENI_TAGS`, which
/// cannot name aws-node's own keys).
#[must_use]
pub fn managed_eni_tags(
    instance_id: &str,
    cluster_name: Option<&str>,
    additional: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut tags = BTreeMap::from([(TAG_INSTANCE_ID.to_owned(), instance_id.to_owned())]);
    if let Some(cluster) = cluster_name {
        tags.insert(TAG_CLUSTER_NAME.to_owned(), cluster.to_owned());
        tags.insert(TAG_ENI_OWNER.to_owned(), ENI_OWNER.to_owned());
    }
    tags.extend(additional.iter().map(|(k, v)| (k.clone(), v.clone())));
    tags
}

fn filter(name: &str, value: &str) -> Filter {
    Filter::builder().name(name).values(value).build()
}

/// Each of `items` parsed from its `field` (`get`): what an assignment
/// answered.
fn parsed_each<I, T: std::str::FromStr>(
    items: &[I],
    action: &'static str,
    field: &'static str,
    get: impl Fn(&I) -> Option<&str>,
) -> Result<Vec<T>, CloudError> {
    items
        .iter()
        .map(|item| {
            get(item)
                .and_then(|v| v.parse().ok())
                .ok_or(CloudError::Incomplete { action, field })
        })
        .collect()
}

fn count(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

impl Cloud {
    /// The instance type's ENI and address limits.
    pub async fn instance_type_limits(
        &self,
        instance_type: &str,
    ) -> Result<InstanceTypeLimits, CloudError> {
        const ACTION: &str = "DescribeInstanceTypes";
        let out = recorded(
            ACTION,
            self.ec2
                .describe_instance_types()
                .instance_types(instance_type.into())
                .send(),
        )
        .await?;
        let instance_type_info = out.instance_types().first();
        let vcpus = instance_type_info
            .and_then(|t| t.v_cpu_info())
            .and_then(aws_sdk_ec2::types::VCpuInfo::default_v_cpus)
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(1);
        let info =
            instance_type_info
                .and_then(|t| t.network_info())
                .ok_or(CloudError::Incomplete {
                    action: ACTION,
                    field: "NetworkInfo",
                })?;
        let positive = |n: Option<i32>, field| {
            n.and_then(|n| usize::try_from(n).ok())
                .filter(|&n| n > 0)
                .ok_or(CloudError::Incomplete {
                    action: ACTION,
                    field,
                })
        };
        Ok(InstanceTypeLimits {
            max_enis: positive(
                info.maximum_network_interfaces(),
                "MaximumNetworkInterfaces",
            )?,
            ips_per_eni: positive(
                info.ipv4_addresses_per_interface(),
                "Ipv4AddressesPerInterface",
            )?,
            vcpus,
        })
    }

    /// A subnet by id.
    pub async fn subnet(&self, id: &str) -> Result<SubnetInfo, CloudError> {
        const ACTION: &str = "DescribeSubnets";
        let out = recorded(ACTION, self.ec2.describe_subnets().subnet_ids(id).send()).await?;
        let subnet = out.subnets().first().ok_or(CloudError::Incomplete {
            action: ACTION,
            field: "Subnet",
        })?;
        SubnetInfo::from_sdk(ACTION, subnet)
    }

    /// The subnets of VPC `vpc_id` in zone `zone`, every page, as EC2 lists
    /// them.
    pub async fn zone_subnets(
        &self,
        vpc_id: &str,
        zone: &str,
    ) -> Result<Vec<SubnetInfo>, CloudError> {
        const ACTION: &str = "DescribeSubnets";
        let mut pages = self
            .ec2
            .describe_subnets()
            .filters(filter("vpc-id", vpc_id))
            .filters(filter("availability-zone", zone))
            .into_paginator()
            .send();
        let mut subnets = Vec::new();
        // Each page is a request of its own.
        loop {
            let began = Instant::now();
            let Some(page) = pages.next().await else {
                break;
            };
            let page = record(ACTION, began, page)?;
            for subnet in page.subnets() {
                subnets.push(SubnetInfo::from_sdk(ACTION, subnet)?);
            }
        }
        Ok(subnets)
    }

    /// ENIs matching `filters`, every page.
    async fn describe_enis(&self, filters: Vec<Filter>) -> Result<Vec<EniInfo>, CloudError> {
        const ACTION: &str = "DescribeNetworkInterfaces";
        let mut pages = self
            .ec2
            .describe_network_interfaces()
            .set_filters(Some(filters))
            .max_results(1000)
            .into_paginator()
            .send();
        let mut enis = Vec::new();
        // Each page is a request of its own.
        loop {
            let began = Instant::now();
            let Some(page) = pages.next().await else {
                break;
            };
            let page = record(ACTION, began, page)?;
            for eni in page.network_interfaces() {
                enis.push(EniInfo::from_sdk(ACTION, eni)?);
            }
        }
        Ok(enis)
    }

    /// The ENIs attached (or attaching) to an instance.
    pub async fn instance_enis(&self, instance_id: &str) -> Result<Vec<EniInfo>, CloudError> {
        self.describe_enis(vec![filter("attachment.instance-id", instance_id)])
            .await
    }

    /// One ENI.
    pub async fn eni(&self, eni_id: &str) -> Result<EniInfo, CloudError> {
        self.describe_enis(vec![filter("network-interface-id", eni_id)])
            .await?
            .into_iter()
            .next()
            .ok_or(CloudError::Incomplete {
                action: "DescribeNetworkInterfaces",
                field: "NetworkInterface",
            })
    }

    /// Detached ENIs made by aws-node or vpcnet (for `cluster`, if given):
    /// candidates for leaked-ENI cleanup.
    pub async fn detached_agent_enis(
        &self,
        cluster: Option<&str>,
    ) -> Result<Vec<EniInfo>, CloudError> {
        let mut filters = vec![
            filter("status", "available"),
            filter("tag-key", TAG_INSTANCE_ID),
        ];
        if let Some(cluster) = cluster {
            filters.push(filter(&format!("tag:{TAG_CLUSTER_NAME}"), cluster));
        }
        self.describe_enis(filters).await
    }

    /// Creates an ENI with aws-node's description and tags, and its first
    /// addresses or prefixes.
    pub async fn create_eni(&self, new: &NewEni<'_>) -> Result<EniInfo, CloudError> {
        const ACTION: &str = "CreateNetworkInterface";
        let now = time_now_rfc3339();
        let mut tags = TagSpecification::builder()
            .resource_type(ResourceType::NetworkInterface)
            .tags(Tag::builder().key(TAG_CREATED_AT).value(now).build());
        for (key, value) in new.tags {
            tags = tags.tags(Tag::builder().key(key).value(value).build());
        }
        let mut call = self
            .ec2
            .create_network_interface()
            .subnet_id(new.subnet_id)
            .description(eni_description(new.instance_id))
            .set_groups((!new.security_groups.is_empty()).then(|| new.security_groups.to_vec()))
            .tag_specifications(tags.build());
        if new.prefixes > 0 {
            call = call.ipv4_prefix_count(count(new.prefixes));
        } else if new.secondary_addrs > 0 {
            call = call.secondary_private_ip_address_count(count(new.secondary_addrs));
        }
        let out = recorded(ACTION, call.send()).await?;
        let eni = out.network_interface().ok_or(CloudError::Incomplete {
            action: ACTION,
            field: "NetworkInterface",
        })?;
        EniInfo::from_sdk(ACTION, eni)
    }

    /// Attaches an ENI at `device_index` and has it deleted with the
    /// instance (so a terminated node leaks nothing). Returns the attachment id.
    pub async fn attach_eni(
        &self,
        eni_id: &str,
        instance_id: &str,
        device_index: u32,
    ) -> Result<String, CloudError> {
        const ACTION: &str = "AttachNetworkInterface";
        let out = recorded(
            ACTION,
            self.ec2
                .attach_network_interface()
                .network_interface_id(eni_id)
                .instance_id(instance_id)
                .device_index(i32::try_from(device_index).unwrap_or(i32::MAX))
                .network_card_index(0)
                .send(),
        )
        .await?;
        let attachment_id = out
            .attachment_id()
            .ok_or(CloudError::Incomplete {
                action: ACTION,
                field: "AttachmentId",
            })?
            .to_owned();
        recorded(
            "ModifyNetworkInterfaceAttribute",
            self.ec2
                .modify_network_interface_attribute()
                .network_interface_id(eni_id)
                .attachment(
                    NetworkInterfaceAttachmentChanges::builder()
                        .attachment_id(&attachment_id)
                        .delete_on_termination(true)
                        .build(),
                )
                .send(),
        )
        .await?;
        Ok(attachment_id)
    }

    pub async fn detach_eni(&self, attachment_id: &str) -> Result<(), CloudError> {
        recorded(
            "DetachNetworkInterface",
            self.ec2
                .detach_network_interface()
                .attachment_id(attachment_id)
                .force(true)
                .send(),
        )
        .await?;
        Ok(())
    }

    pub async fn delete_eni(&self, eni_id: &str) -> Result<(), CloudError> {
        recorded(
            "DeleteNetworkInterface",
            self.ec2
                .delete_network_interface()
                .network_interface_id(eni_id)
                .send(),
        )
        .await?;
        Ok(())
    }

    /// Assigns `n` secondary addresses EC2 picks.
    pub async fn assign_addrs(&self, eni_id: &str, n: usize) -> Result<Vec<Ipv4Addr>, CloudError> {
        const ACTION: &str = "AssignPrivateIpAddresses";
        let out = recorded(
            ACTION,
            self.ec2
                .assign_private_ip_addresses()
                .network_interface_id(eni_id)
                .secondary_private_ip_address_count(count(n))
                .send(),
        )
        .await?;
        parsed_each(
            out.assigned_private_ip_addresses(),
            ACTION,
            "PrivateIpAddress",
            AssignedPrivateIpAddress::private_ip_address,
        )
    }

    /// Assigns `n` /28 prefixes EC2 picks.
    pub async fn assign_prefixes(
        &self,
        eni_id: &str,
        n: usize,
    ) -> Result<Vec<Ipv4Net>, CloudError> {
        const ACTION: &str = "AssignPrivateIpAddresses";
        let out = recorded(
            ACTION,
            self.ec2
                .assign_private_ip_addresses()
                .network_interface_id(eni_id)
                .ipv4_prefix_count(count(n))
                .send(),
        )
        .await?;
        parsed_each(
            out.assigned_ipv4_prefixes(),
            ACTION,
            "Ipv4Prefix",
            Ipv4PrefixSpecification::ipv4_prefix,
        )
    }

    pub async fn unassign_addrs(&self, eni_id: &str, addrs: &[Ipv4Addr]) -> Result<(), CloudError> {
        recorded(
            "UnassignPrivateIpAddresses",
            self.ec2
                .unassign_private_ip_addresses()
                .network_interface_id(eni_id)
                .set_private_ip_addresses(Some(addrs.iter().map(ToString::to_string).collect()))
                .send(),
        )
        .await?;
        Ok(())
    }

    pub async fn unassign_prefixes(
        &self,
        eni_id: &str,
        prefixes: &[Ipv4Net],
    ) -> Result<(), CloudError> {
        recorded(
            "UnassignPrivateIpAddresses",
            self.ec2
                .unassign_private_ip_addresses()
                .network_interface_id(eni_id)
                .set_ipv4_prefixes(Some(prefixes.iter().map(ToString::to_string).collect()))
                .send(),
        )
        .await?;
        Ok(())
    }

    /// Sets tags on a resource.
    pub async fn tag(&self, resource_id: &str, tags: &[(&str, &str)]) -> Result<(), CloudError> {
        recorded(
            "CreateTags",
            self.ec2
                .create_tags()
                .resources(resource_id)
                .set_tags(Some(
                    tags.iter()
                        .map(|(k, v)| Tag::builder().key(*k).value(*v).build())
                        .collect(),
                ))
                .send(),
        )
        .await?;
        Ok(())
    }
}

/// Now as RFC 3339 in UTC, the form aws-node writes in `createdAt`.
pub fn time_now_rfc3339() -> String {
    aws_sdk_ec2::primitives::DateTime::from(std::time::SystemTime::now())
        .fmt(aws_sdk_ec2::primitives::DateTimeFormat::DateTime)
        .unwrap_or_default()
}
