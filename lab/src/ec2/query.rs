//! The EC2 Query API: a form-urlencoded POST with `Action` and `Version`,
//! lists as `Name.N`, structures as `Name.N.Field`, filters as
//! `Filter.N.Name` / `Filter.N.Value.M`, paging with `MaxResults` and
//! `NextToken`; answered in XML ([`super::xml`]).
//!
//! [`dispatch`] runs one action against the state and says what else the
//! server must do ([`Effect`]): start an attachment's clock, update the
//! lab's network.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use ipnet::Ipv4Net;

use super::{
    instance_types::{self, INSTANCE_TYPES, InstanceType},
    model::{
        Assign, CreateEni, Ec2Error, Ec2Result, Ec2State, Eni, Instance, InterfaceType, Modify,
        Subnet, TrunkAssociation,
    },
    xml::{Xml, timestamp},
};

/// The API version the SDK sends (and the only one there is).
pub const API_VERSION: &str = "2016-11-15";

/// The actions the emulator implements.
pub const ACTIONS: &[&str] = &[
    "RunInstances",
    "DescribeInstances",
    "TerminateInstances",
    "DescribeInstanceTypes",
    "DescribeSubnets",
    "DescribeVpcs",
    "DescribeNetworkInterfaces",
    "CreateNetworkInterface",
    "AttachNetworkInterface",
    "DetachNetworkInterface",
    "DeleteNetworkInterface",
    "ModifyNetworkInterfaceAttribute",
    "AssignPrivateIpAddresses",
    "UnassignPrivateIpAddresses",
    "CreateTags",
    "DeleteTags",
    "AssociateTrunkInterface",
    "DescribeTrunkInterfaceAssociations",
    "DisassociateTrunkInterface",
];

/// The decoded form of one request.
#[derive(Debug, Clone, Default)]
pub struct Params(BTreeMap<String, String>);

impl Params {
    /// Decodes an `application/x-www-form-urlencoded` body.
    pub fn parse(body: &[u8]) -> Self {
        Self(form_urlencoded::parse(body).into_owned().collect())
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }

    pub fn required(&self, name: &str) -> Ec2Result<&str> {
        self.get(name)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| Ec2Error::missing(name))
    }

    fn number<T: std::str::FromStr>(&self, name: &str) -> Ec2Result<Option<T>> {
        self.get(name)
            .map(|v| {
                v.parse()
                    .map_err(|_| Ec2Error::invalid_value(format!("Invalid value '{v}' for {name}")))
            })
            .transpose()
    }

    fn u32(&self, name: &str) -> Ec2Result<Option<u32>> {
        self.number(name)
    }

    fn bool(&self, name: &str) -> Ec2Result<Option<bool>> {
        self.get(name)
            .map(|v| match v {
                "true" => Ok(true),
                "false" => Ok(false),
                other => Err(Ec2Error::invalid_value(format!(
                    "Invalid value '{other}' for {name}: expected true or false"
                ))),
            })
            .transpose()
    }

    fn addr(&self, name: &str) -> Ec2Result<Option<Ipv4Addr>> {
        self.get(name).map(|v| parse_addr(name, v)).transpose()
    }

    /// The indices N of `prefix.N` and `prefix.N.*`, in order.
    fn indices(&self, prefix: &str) -> BTreeSet<u32> {
        self.0
            .keys()
            .filter_map(|key| {
                let rest = key.strip_prefix(prefix)?.strip_prefix('.')?;
                rest.split('.').next()?.parse().ok()
            })
            .collect()
    }

    /// The values of `prefix.1`, `prefix.2`...
    pub fn list(&self, prefix: &str) -> Vec<String> {
        self.indices(prefix)
            .into_iter()
            .filter_map(|n| self.get(&format!("{prefix}.{n}")).map(str::to_owned))
            .collect()
    }

    /// The fields of `prefix.N.*`, with `prefix.N.` taken off.
    fn sub(&self, prefix: &str, n: u32) -> Self {
        let start = format!("{prefix}.{n}.");
        Self(
            self.0
                .iter()
                .filter_map(|(k, v)| Some((k.strip_prefix(&start)?.to_owned(), v.clone())))
                .collect(),
        )
    }

    /// `prefix.N.Key` / `prefix.N.Value` pairs.
    fn tags(&self, prefix: &str) -> Ec2Result<BTreeMap<String, String>> {
        self.indices(prefix)
            .into_iter()
            .map(|n| {
                let tag = self.sub(prefix, n);
                let key = tag.required("Key")?.to_owned();
                if key.starts_with("aws:") {
                    return Err(Ec2Error::invalid_value(format!(
                        "Tag keys starting with 'aws:' are reserved for internal use: {key}"
                    )));
                }
                Ok((key, tag.get("Value").unwrap_or_default().to_owned()))
            })
            .collect()
    }

    /// `Filter.N.Name` / `Filter.N.Value.M`.
    fn filters(&self) -> Ec2Result<Vec<Filter>> {
        self.indices("Filter")
            .into_iter()
            .map(|n| {
                let filter = self.sub("Filter", n);
                Ok(Filter {
                    name: filter.required("Name")?.to_owned(),
                    values: filter.list("Value"),
                })
            })
            .collect()
    }
}

fn parse_addr(name: &str, value: &str) -> Ec2Result<Ipv4Addr> {
    value.parse().map_err(|_| {
        Ec2Error::invalid_value(format!(
            "Invalid value '{value}' for {name}: not an IPv4 address"
        ))
    })
}

fn parse_prefix(value: &str) -> Ec2Result<Ipv4Net> {
    value.parse().map_err(|_| {
        Ec2Error::invalid_value(format!(
            "Invalid value '{value}' for Ipv4Prefix: not an IPv4 CIDR"
        ))
    })
}

/// One `Filter.N`.
#[derive(Debug, Clone)]
struct Filter {
    name: String,
    values: Vec<String>,
}

impl Filter {
    /// Whether any of the resource's values for this filter matches any of
    /// the filter's values (`*` and `?` are wildcards, as in EC2).
    fn matches(&self, values: &[String]) -> bool {
        values
            .iter()
            .any(|value| self.values.iter().any(|pattern| glob(pattern, value)))
    }
}

/// EC2's filter wildcards: `*` any run, `?` one character.
fn glob(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// Values of the tag filters (`tag:<key>`, `tag-key`, `tag-value`).
fn tag_filter(tags: &BTreeMap<String, String>, name: &str) -> Option<Vec<String>> {
    if let Some(key) = name.strip_prefix("tag:") {
        return Some(tags.get(key).cloned().into_iter().collect());
    }
    match name {
        "tag-key" => Some(tags.keys().cloned().collect()),
        "tag-value" => Some(tags.values().cloned().collect()),
        _ => None,
    }
}

fn unknown_filter(name: &str) -> Ec2Error {
    Ec2Error::invalid_value(format!("The filter '{name}' is invalid"))
}

/// Keeps the items every filter matches; a filter name not in `known` (nor
/// a tag filter) is an error, even when there is nothing to filter.
fn apply_filters<'a, T>(
    items: Vec<&'a T>,
    filters: &[Filter],
    known: &[&str],
    values: impl Fn(&T, &str) -> Option<Vec<String>>,
) -> Ec2Result<Vec<&'a T>> {
    for filter in filters {
        let name = filter.name.as_str();
        if !known.contains(&name)
            && !name.starts_with("tag:")
            && !matches!(name, "tag-key" | "tag-value")
        {
            return Err(unknown_filter(name));
        }
    }
    let mut kept = Vec::with_capacity(items.len());
    'item: for item in items {
        for filter in filters {
            let Some(have) = values(item, &filter.name) else {
                return Err(unknown_filter(&filter.name));
            };
            if !filter.matches(&have) {
                continue 'item;
            }
        }
        kept.push(item);
    }
    Ok(kept)
}

/// `DescribeNetworkInterfaces`' filters (besides the tag ones).
const ENI_FILTERS: &[&str] = &[
    "network-interface-id",
    "attachment.instance-id",
    "attachment.attachment-id",
    "attachment.status",
    "attachment.device-index",
    "attachment.delete-on-termination",
    "attachment.instance-owner-id",
    "status",
    "subnet-id",
    "vpc-id",
    "availability-zone",
    "description",
    "mac-address",
    "owner-id",
    "requester-managed",
    "interface-type",
    "source-dest-check",
    "private-ip-address",
    "addresses.private-ip-address",
    "addresses.primary",
    "ipv4-prefix",
    "group-id",
    "group-name",
];

/// `DescribeSubnets`' filters.
const SUBNET_FILTERS: &[&str] = &[
    "subnet-id",
    "vpc-id",
    "availability-zone",
    "availabilityZone",
    "cidr-block",
    "cidr",
    "cidrBlock",
    "state",
    "default-for-az",
    "defaultForAz",
    "owner-id",
    "available-ip-address-count",
];

/// `DescribeInstances`' filters.
const INSTANCE_FILTERS: &[&str] = &[
    "instance-id",
    "instance-type",
    "instance-state-name",
    "instance-state-code",
    "subnet-id",
    "vpc-id",
    "availability-zone",
    "private-ip-address",
    "image-id",
    "network-interface.network-interface-id",
];

fn eni_filter_values(eni: &Eni, state: &Ec2State, name: &str) -> Option<Vec<String>> {
    let one = |v: String| Some(vec![v]);
    let attachment = eni.attachment.as_ref();
    let from_attachment = |f: &dyn Fn(&super::model::Attachment) -> String| {
        Some(attachment.map(f).into_iter().collect::<Vec<_>>())
    };
    match name {
        "network-interface-id" => one(eni.id.clone()),
        "attachment.instance-id" => from_attachment(&|a| a.instance_id.clone()),
        "attachment.attachment-id" => from_attachment(&|a| a.id.clone()),
        "attachment.status" => from_attachment(&|a| a.status.as_str().to_owned()),
        "attachment.device-index" => from_attachment(&|a| a.device_index.to_string()),
        "attachment.delete-on-termination" => {
            from_attachment(&|a| a.delete_on_termination.to_string())
        }
        "attachment.instance-owner-id" => from_attachment(&|_| state.account_id.clone()),
        "status" => one(eni.status.as_str().to_owned()),
        "subnet-id" => one(eni.subnet_id.clone()),
        "vpc-id" => one(eni.vpc_id.clone()),
        "availability-zone" => one(eni.availability_zone.clone()),
        "description" => one(eni.description.clone()),
        "mac-address" => one(eni.mac.clone()),
        "owner-id" => one(eni.owner_id.clone()),
        "requester-managed" => one("false".into()),
        "interface-type" => one("interface".into()),
        "source-dest-check" => one(eni.source_dest_check.to_string()),
        "private-ip-address" | "addresses.private-ip-address" => {
            Some(eni.addresses().map(|a| a.to_string()).collect())
        }
        "addresses.primary" => one("true".into()),
        "ipv4-prefix" => Some(eni.prefixes.iter().map(ToString::to_string).collect()),
        "group-id" => Some(eni.groups.clone()),
        "group-name" => Some(
            eni.groups
                .iter()
                .filter_map(|g| state.security_group_name(g).map(str::to_owned))
                .collect(),
        ),
        _ => tag_filter(&eni.tags, name),
    }
}

fn subnet_filter_values(subnet: &Subnet, state: &Ec2State, name: &str) -> Option<Vec<String>> {
    let one = |v: String| Some(vec![v]);
    match name {
        "subnet-id" => one(subnet.id.clone()),
        "vpc-id" => one(subnet.vpc_id.clone()),
        "availability-zone" | "availabilityZone" => one(subnet.availability_zone.clone()),
        "cidr-block" | "cidr" | "cidrBlock" => one(subnet.cidr.to_string()),
        "state" => one("available".into()),
        "default-for-az" | "defaultForAz" => one("false".into()),
        "owner-id" => one(state.account_id.clone()),
        "available-ip-address-count" => one(subnet.available_ip_address_count().to_string()),
        _ => tag_filter(&subnet.tags, name),
    }
}

fn instance_filter_values(
    instance: &Instance,
    state: &Ec2State,
    name: &str,
) -> Option<Vec<String>> {
    let one = |v: String| Some(vec![v]);
    match name {
        "instance-id" => one(instance.id.clone()),
        "instance-type" => one(instance.instance_type.clone()),
        "instance-state-name" => one(instance.state.code_and_name().1.to_owned()),
        "instance-state-code" => one(instance.state.code_and_name().0.to_string()),
        "subnet-id" => one(instance.subnet_id.clone()),
        "vpc-id" => one(instance.vpc_id.clone()),
        "availability-zone" => one(instance.availability_zone.clone()),
        "private-ip-address" => one(instance.primary_ip.to_string()),
        "image-id" => one(instance.image_id.clone()),
        "network-interface.network-interface-id" => Some(
            state
                .enis()
                .filter(|e| {
                    e.attachment
                        .as_ref()
                        .is_some_and(|a| a.instance_id == instance.id)
                })
                .map(|e| e.id.clone())
                .collect(),
        ),
        _ => tag_filter(&instance.tags, name),
    }
}

/// A page of `items` (sorted by key) after `token`, at most `max`.
fn paginate<'a, T>(
    items: &[&'a T],
    key: &impl Fn(&T) -> String,
    max: Option<u32>,
    token: Option<&str>,
) -> Ec2Result<(Vec<&'a T>, Option<String>)> {
    let start = match token {
        None | Some("") => 0,
        Some(token) => {
            let after = decode_token(token)?;
            items.iter().take_while(|item| key(item) <= after).count()
        }
    };
    let rest = &items[start..];
    let Some(max) = max else {
        return Ok((rest.to_vec(), None));
    };
    let max = max as usize;
    if rest.len() <= max {
        return Ok((rest.to_vec(), None));
    }
    let page = rest[..max].to_vec();
    let next = encode_token(&key(page[max - 1]));
    Ok((page, Some(next)))
}

/// Tokens are opaque to clients: the last key of the page, hex-encoded.
fn encode_token(last: &str) -> String {
    use std::fmt::Write;
    last.bytes().fold(String::from("vpcnet1."), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn decode_token(token: &str) -> Ec2Result<String> {
    let invalid = || {
        Ec2Error::new(
            "InvalidPaginationToken",
            format!("The pagination token '{token}' is invalid or expired."),
        )
    };
    let hex = token.strip_prefix("vpcnet1.").ok_or_else(invalid)?;
    if hex.len() % 2 != 0 {
        return Err(invalid());
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).map_err(|_| invalid()))
        .collect::<Ec2Result<Vec<u8>>>()?;
    String::from_utf8(bytes).map_err(|_| invalid())
}

/// `MaxResults` within EC2's bounds for the action.
fn max_results(params: &Params, min: u32, max: u32) -> Ec2Result<Option<u32>> {
    let value = params.u32("MaxResults")?;
    if let Some(n) = value
        && !(min..=max).contains(&n)
    {
        return Err(Ec2Error::invalid_value(format!(
            "Value ( {n} ) for parameter maxResults is invalid. Expecting a value between {min} and {max}."
        )));
    }
    Ok(value)
}

/// What the server does after an action succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Nothing changed that the network sees.
    None,
    /// Addresses, prefixes or ENIs changed: reconcile the lab's network.
    Changed,
    /// An attachment started: complete it after the delay.
    Attaching(String),
    /// A detachment started: complete it after the delay.
    Detaching(String),
}

/// Runs `action`; the XML answer and what the server must do next.
pub fn dispatch(
    state: &mut Ec2State,
    action: &str,
    params: &Params,
    request_id: &str,
    now_ms: u64,
) -> Ec2Result<(String, Effect)> {
    if let Some(version) = params.get("Version")
        && version != API_VERSION
    {
        return Err(Ec2Error::new(
            "InvalidParameterValue",
            format!("Unsupported API version {version}; this endpoint speaks {API_VERSION}"),
        ));
    }
    let mut xml = Xml::response(action, request_id);
    let effect = match action {
        "RunInstances" => run_instances(state, params, &mut xml, now_ms)?,
        "DescribeInstances" => describe_instances(state, params, &mut xml)?,
        "TerminateInstances" => terminate_instances(state, params, &mut xml)?,
        "DescribeInstanceTypes" => describe_instance_types(params, &mut xml)?,
        "DescribeSubnets" => describe_subnets(state, params, &mut xml)?,
        "DescribeVpcs" => describe_vpcs(state, params, &mut xml)?,
        "DescribeNetworkInterfaces" => describe_network_interfaces(state, params, &mut xml)?,
        "CreateNetworkInterface" => create_network_interface(state, params, &mut xml)?,
        "AttachNetworkInterface" => attach_network_interface(state, params, &mut xml, now_ms)?,
        "DetachNetworkInterface" => {
            let attachment = params.required("AttachmentId")?;
            let force = params.bool("Force")?.unwrap_or(false);
            state.detach(attachment, force)?;
            xml.leaf("return", true);
            Effect::Detaching(attachment.to_owned())
        }
        "DeleteNetworkInterface" => {
            state.delete_eni(params.required("NetworkInterfaceId")?)?;
            xml.leaf("return", true);
            Effect::Changed
        }
        "ModifyNetworkInterfaceAttribute" => modify_attribute(state, params, &mut xml)?,
        "AssociateTrunkInterface" => associate_trunk_interface(state, params, &mut xml)?,
        "DescribeTrunkInterfaceAssociations" => {
            describe_trunk_interface_associations(state, params, &mut xml)?
        }
        "DisassociateTrunkInterface" => {
            state.disassociate_trunk(params.required("AssociationId")?)?;
            xml.leaf("return", true)
                .opt_leaf("clientToken", params.get("ClientToken"));
            Effect::Changed
        }
        "AssignPrivateIpAddresses" => assign(state, params, &mut xml)?,
        "UnassignPrivateIpAddresses" => {
            let eni = params.required("NetworkInterfaceId")?;
            let addrs = params
                .list("PrivateIpAddress")
                .iter()
                .map(|a| parse_addr("PrivateIpAddress", a))
                .collect::<Ec2Result<Vec<_>>>()?;
            let prefixes = params
                .list("Ipv4Prefix")
                .iter()
                .map(|p| parse_prefix(p))
                .collect::<Ec2Result<Vec<_>>>()?;
            state.unassign(eni, &addrs, &prefixes)?;
            xml.leaf("return", true);
            Effect::Changed
        }
        "CreateTags" => {
            state.create_tags(&params.list("ResourceId"), &params.tags("Tag")?)?;
            xml.leaf("return", true);
            Effect::None
        }
        "DeleteTags" => {
            let tags = params
                .indices("Tag")
                .into_iter()
                .map(|n| {
                    let tag = params.sub("Tag", n);
                    Ok((
                        tag.required("Key")?.to_owned(),
                        tag.get("Value").map(str::to_owned),
                    ))
                })
                .collect::<Ec2Result<Vec<_>>>()?;
            state.delete_tags(&params.list("ResourceId"), &tags)?;
            xml.leaf("return", true);
            Effect::None
        }
        other => {
            return Err(Ec2Error::new(
                "InvalidAction",
                format!("The action {other} is not valid for this web service."),
            ));
        }
    };
    Ok((xml.finish(action), effect))
}

fn run_instances(
    state: &mut Ec2State,
    params: &Params,
    xml: &mut Xml,
    now_ms: u64,
) -> Ec2Result<Effect> {
    let image = params.required("ImageId")?;
    let min = params
        .u32("MinCount")?
        .ok_or_else(|| Ec2Error::missing("MinCount"))?;
    let max = params
        .u32("MaxCount")?
        .ok_or_else(|| Ec2Error::missing("MaxCount"))?;
    if min == 0 || min > max {
        return Err(Ec2Error::invalid_value(format!(
            "Invalid counts: MinCount {min}, MaxCount {max}"
        )));
    }
    let private_ip = params.addr("PrivateIpAddress")?;
    if private_ip.is_some() && max > 1 {
        return Err(Ec2Error::combination(
            "A private IP address can only be given when launching one instance.",
        ));
    }
    let subnet = params
        .get("SubnetId")
        .map(str::to_owned)
        .or_else(|| state.subnets().next().map(|s| s.id.clone()))
        .ok_or_else(|| Ec2Error::missing("SubnetId"))?;
    let instance_type = params.get("InstanceType").unwrap_or("m1.small");
    let groups = params.list("SecurityGroupId");
    let mut ids = Vec::new();
    for _ in 0..max {
        match state.run_instance(
            instance_type,
            image,
            &subnet,
            private_ip,
            groups.clone(),
            now_ms,
        ) {
            Ok(id) => ids.push(id),
            Err(err) if ids.len() < min as usize => return Err(err),
            Err(_) => break,
        }
    }
    let tags = tag_specifications(params, "instance")?;
    if !tags.is_empty() {
        state.create_tags(&ids, &tags)?;
    }
    let instances: Vec<&Instance> = ids
        .iter()
        .map(|id| state.instance(id).expect("made"))
        .collect();
    xml.leaf("reservationId", &instances[0].reservation_id)
        .leaf("ownerId", &state.account_id)
        .set("groupSet", std::iter::empty::<()>(), |_, ()| {});
    xml.set("instancesSet", instances, |x, instance| {
        write_instance(x, state, instance);
    });
    Ok(Effect::Changed)
}

/// `TagSpecification.N` for `resource_type`.
fn tag_specifications(params: &Params, resource_type: &str) -> Ec2Result<BTreeMap<String, String>> {
    let mut tags = BTreeMap::new();
    for n in params.indices("TagSpecification") {
        let spec = params.sub("TagSpecification", n);
        let ty = spec.required("ResourceType")?;
        if ty != resource_type {
            return Err(Ec2Error::invalid_value(format!(
                "'{ty}' is not a valid taggable resource type for this operation."
            )));
        }
        tags.extend(spec.tags("Tag")?);
    }
    Ok(tags)
}

fn private_dns_name(state: &Ec2State, addr: Ipv4Addr) -> String {
    let [a, b, c, d] = addr.octets();
    format!("ip-{a}-{b}-{c}-{d}.{}.compute.internal", state.region)
}

fn write_groups(x: &mut Xml, state: &Ec2State, groups: &[String]) {
    x.set("groupSet", groups, |x, group| {
        x.leaf("groupId", group).leaf(
            "groupName",
            state.security_group_name(group).unwrap_or_default(),
        );
    });
}

fn write_instance(x: &mut Xml, state: &Ec2State, instance: &Instance) {
    let (code, name) = instance.state.code_and_name();
    let running = instance.state == super::model::InstanceState::Running;
    x.leaf("instanceId", &instance.id)
        .leaf("imageId", &instance.image_id)
        .el("instanceState", |x| {
            x.leaf("code", code).leaf("name", name);
        })
        .leaf(
            "privateDnsName",
            private_dns_name(state, instance.primary_ip),
        )
        .leaf("dnsName", "")
        .leaf("amiLaunchIndex", 0)
        .leaf("instanceType", &instance.instance_type)
        .leaf("launchTime", timestamp(instance.launch_time_ms))
        .el("placement", |x| {
            x.leaf("availabilityZone", &instance.availability_zone)
                .leaf("groupName", "")
                .leaf("tenancy", "default");
        })
        .el("monitoring", |x| {
            x.leaf("state", "disabled");
        });
    if running {
        x.leaf("subnetId", &instance.subnet_id)
            .leaf("vpcId", &instance.vpc_id)
            .leaf("privateIpAddress", instance.primary_ip);
    }
    x.leaf("sourceDestCheck", true);
    write_groups(x, state, &instance.groups);
    x.leaf("architecture", "x86_64")
        .leaf("rootDeviceType", "ebs")
        .leaf("rootDeviceName", "/dev/xvda")
        .leaf("virtualizationType", "hvm")
        .leaf("hypervisor", "xen")
        .leaf("enaSupport", true)
        .tags(&instance.tags);
    let mut enis: Vec<&Eni> = state
        .enis()
        .filter(|e| {
            e.attachment
                .as_ref()
                .is_some_and(|a| a.instance_id == instance.id)
        })
        .collect();
    enis.sort_by_key(|e| {
        let a = e.attachment.as_ref().expect("filtered");
        (a.network_card_index, a.device_index)
    });
    x.set("networkInterfaceSet", enis, |x, eni| {
        x.leaf("networkInterfaceId", &eni.id)
            .leaf("subnetId", &eni.subnet_id)
            .leaf("vpcId", &eni.vpc_id)
            .leaf("description", &eni.description)
            .leaf("ownerId", &eni.owner_id)
            .leaf("status", eni.status.as_str())
            .leaf("macAddress", &eni.mac)
            .leaf("privateIpAddress", eni.primary_ip)
            .leaf("privateDnsName", private_dns_name(state, eni.primary_ip))
            .leaf("sourceDestCheck", eni.source_dest_check);
        write_groups(x, state, &eni.groups);
        let a = eni.attachment.as_ref().expect("filtered");
        x.el("attachment", |x| {
            x.leaf("attachmentId", &a.id)
                .leaf("deviceIndex", a.device_index)
                .leaf("status", a.status.as_str())
                .leaf("attachTime", timestamp(a.attach_time_ms))
                .leaf("deleteOnTermination", a.delete_on_termination)
                .leaf("networkCardIndex", a.network_card_index);
        });
        write_private_ips(x, state, eni);
        x.set("ipv4PrefixSet", &eni.prefixes, |x, p| {
            x.leaf("ipv4Prefix", p);
        })
        .leaf("interfaceType", "interface");
    });
}

fn write_private_ips(x: &mut Xml, state: &Ec2State, eni: &Eni) {
    x.set("privateIpAddressesSet", eni.addresses(), |x, addr| {
        x.leaf("privateIpAddress", addr)
            .leaf("privateDnsName", private_dns_name(state, addr))
            .leaf("primary", addr == eni.primary_ip);
    });
}

fn write_eni(x: &mut Xml, state: &Ec2State, eni: &Eni) {
    x.leaf("networkInterfaceId", &eni.id)
        .leaf("subnetId", &eni.subnet_id)
        .leaf("vpcId", &eni.vpc_id)
        .leaf("availabilityZone", &eni.availability_zone)
        .leaf("description", &eni.description)
        .leaf("ownerId", &eni.owner_id)
        .leaf("requesterManaged", false)
        .leaf("status", eni.status.as_str())
        .leaf("macAddress", &eni.mac)
        .leaf("privateIpAddress", eni.primary_ip)
        .leaf("privateDnsName", private_dns_name(state, eni.primary_ip))
        .leaf("sourceDestCheck", eni.source_dest_check);
    write_groups(x, state, &eni.groups);
    if let Some(a) = &eni.attachment {
        x.el("attachment", |x| {
            x.leaf("attachmentId", &a.id)
                .leaf("instanceId", &a.instance_id)
                .leaf("instanceOwnerId", &state.account_id)
                .leaf("deviceIndex", a.device_index)
                .leaf("networkCardIndex", a.network_card_index)
                .leaf("status", a.status.as_str())
                .leaf("attachTime", timestamp(a.attach_time_ms))
                .leaf("deleteOnTermination", a.delete_on_termination);
        });
    }
    x.tags(&eni.tags);
    write_private_ips(x, state, eni);
    x.set("ipv4PrefixSet", &eni.prefixes, |x, p| {
        x.leaf("ipv4Prefix", p);
    })
    .set("ipv6AddressesSet", std::iter::empty::<()>(), |_, ()| {})
    .leaf("interfaceType", eni.interface_type.as_str());
}

fn write_trunk_association(x: &mut Xml, association: &TrunkAssociation) {
    x.leaf("associationId", &association.id)
        .leaf("branchInterfaceId", &association.branch_id)
        .leaf("trunkInterfaceId", &association.trunk_id)
        .leaf("interfaceProtocol", "VLAN")
        .leaf("vlanId", association.vlan_id)
        .set("tagSet", std::iter::empty::<()>(), |_, ()| {});
}

fn associate_trunk_interface(
    state: &mut Ec2State,
    params: &Params,
    xml: &mut Xml,
) -> Ec2Result<Effect> {
    let branch = params.required("BranchInterfaceId")?;
    let trunk = params.required("TrunkInterfaceId")?;
    let vlan_id = params
        .number::<u16>("VlanId")?
        .ok_or_else(|| Ec2Error::missing("VlanId"))?;
    if params.get("GreKey").is_some() {
        return Err(Ec2Error::invalid_value(
            "GRE associations are not served by the lab: VLAN only",
        ));
    }
    let association = state.associate_trunk(branch, trunk, vlan_id)?;
    xml.el("interfaceAssociation", |x| {
        write_trunk_association(x, &association);
    })
    .opt_leaf("clientToken", params.get("ClientToken"));
    Ok(Effect::Changed)
}

/// `DescribeTrunkInterfaceAssociations`: by id, or filtered by the trunk
/// or branch ENI (the filters the resource controller sends).
fn describe_trunk_interface_associations(
    state: &Ec2State,
    params: &Params,
    xml: &mut Xml,
) -> Ec2Result<Effect> {
    let ids = params.list("AssociationId");
    let max = max_results(params, 5, 255)?;
    let associations: Vec<&TrunkAssociation> = state
        .trunk_associations()
        .filter(|a| ids.is_empty() || ids.contains(&a.id))
        .collect();
    for id in &ids {
        if !associations.iter().any(|a| &a.id == id) {
            return Err(Ec2Error::new(
                "InvalidAssociationID.NotFound",
                format!("The association ID '{id}' does not exist"),
            ));
        }
    }
    let associations = apply_filters(
        associations,
        &params.filters()?,
        TRUNK_ASSOCIATION_FILTERS,
        |a, name| match name {
            "trunk-interface-association.trunk-interface-id" => Some(vec![a.trunk_id.clone()]),
            "trunk-interface-association.branch-interface-id" => Some(vec![a.branch_id.clone()]),
            "interface-protocol" => Some(vec!["VLAN".to_owned()]),
            // The lab's associations carry no tags.
            _ => name.starts_with("tag").then(Vec::new),
        },
    )?;
    let (page, next) = paginate(
        &associations,
        &|a| a.id.clone(),
        max,
        params.get("NextToken"),
    )?;
    xml.set("interfaceAssociationSet", page, |x, a| {
        write_trunk_association(x, a);
    })
    .opt_leaf("nextToken", next);
    Ok(Effect::None)
}

/// The filters `DescribeTrunkInterfaceAssociations` serves.
const TRUNK_ASSOCIATION_FILTERS: &[&str] = &[
    "trunk-interface-association.trunk-interface-id",
    "trunk-interface-association.branch-interface-id",
    "interface-protocol",
];

fn describe_instances(state: &Ec2State, params: &Params, xml: &mut Xml) -> Ec2Result<Effect> {
    let ids = params.list("InstanceId");
    let max = max_results(params, 5, 1000)?;
    if !ids.is_empty() && max.is_some() {
        return Err(Ec2Error::combination(
            "The parameter instancesSet cannot be used with the parameter maxResults",
        ));
    }
    let mut instances: Vec<&Instance> = Vec::new();
    if ids.is_empty() {
        instances.extend(state.instances());
    } else {
        for id in &ids {
            instances.push(state.instance(id)?);
        }
    }
    let instances = apply_filters(
        instances,
        &params.filters()?,
        INSTANCE_FILTERS,
        |i, name| instance_filter_values(i, state, name),
    )?;
    let (page, next) = paginate(&instances, &|i| i.id.clone(), max, params.get("NextToken"))?;
    // One reservation an instance: RunInstances here launches them so.
    xml.set("reservationSet", page, |x, instance| {
        x.leaf("reservationId", &instance.reservation_id)
            .leaf("ownerId", &state.account_id)
            .set("groupSet", std::iter::empty::<()>(), |_, ()| {})
            .set("instancesSet", [instance], |x, i| {
                write_instance(x, state, i);
            });
    })
    .opt_leaf("nextToken", next);
    Ok(Effect::None)
}

fn terminate_instances(state: &mut Ec2State, params: &Params, xml: &mut Xml) -> Ec2Result<Effect> {
    let ids = params.list("InstanceId");
    if ids.is_empty() {
        return Err(Ec2Error::missing("InstanceId"));
    }
    for id in &ids {
        state.instance(id)?;
    }
    let mut changes = Vec::new();
    for id in &ids {
        changes.push((id.clone(), state.terminate_instance(id)?));
    }
    xml.set("instancesSet", changes, |x, (id, previous)| {
        let (pc, pn) = previous.code_and_name();
        let (cc, cn) = super::model::InstanceState::Terminated.code_and_name();
        x.leaf("instanceId", id)
            .el("currentState", |x| {
                x.leaf("code", cc).leaf("name", cn);
            })
            .el("previousState", |x| {
                x.leaf("code", pc).leaf("name", pn);
            });
    });
    Ok(Effect::Changed)
}

fn describe_instance_types(params: &Params, xml: &mut Xml) -> Ec2Result<Effect> {
    let names = params.list("InstanceType");
    let max = max_results(params, 5, 100)?;
    let mut types: Vec<&InstanceType> = Vec::new();
    if names.is_empty() {
        types.extend(INSTANCE_TYPES);
    } else {
        let unknown: Vec<&String> = names
            .iter()
            .filter(|n| instance_types::lookup(n).is_none())
            .collect();
        if !unknown.is_empty() {
            return Err(Ec2Error::new(
                "InvalidInstanceType",
                format!(
                    "The following supplied instance types do not exist: [{}]",
                    unknown
                        .iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        types.extend(names.iter().filter_map(|n| instance_types::lookup(n)));
    }
    let filters = params.filters()?;
    let known = [
        "instance-type",
        "hypervisor",
        "network-info.maximum-network-interfaces",
        "network-info.ipv4-addresses-per-interface",
    ];
    let types = apply_filters(types, &filters, &known, |ty, name| match name {
        "instance-type" => Some(vec![ty.name.to_owned()]),
        "hypervisor" => Some(vec!["nitro".to_owned()]),
        "network-info.maximum-network-interfaces" => Some(vec![ty.max_enis.to_string()]),
        "network-info.ipv4-addresses-per-interface" => Some(vec![ty.ipv4_per_eni.to_string()]),
        _ => None,
    })?;
    let mut types = types;
    types.sort_by_key(|t| t.name);
    let (page, next) = paginate(&types, &|t| t.name.to_owned(), max, params.get("NextToken"))?;
    xml.set("instanceTypeSet", page, |x, ty| {
        x.leaf("instanceType", ty.name)
            .leaf("currentGeneration", true)
            .leaf("freeTierEligible", false)
            .set("supportedUsageClasses", ["on-demand", "spot"], |x, c| {
                x.text(c);
            })
            .set("supportedRootDeviceTypes", ["ebs"], |x, c| {
                x.text(c);
            })
            .set("supportedVirtualizationTypes", ["hvm"], |x, c| {
                x.text(c);
            })
            .leaf("bareMetal", false)
            .leaf("hypervisor", "nitro")
            .el("vCpuInfo", |x| {
                x.leaf("defaultVCpus", ty.vcpus);
            })
            .el("memoryInfo", |x| {
                x.leaf("sizeInMiB", ty.memory_mib);
            })
            .leaf("instanceStorageSupported", false)
            .el("networkInfo", |x| {
                x.leaf("networkPerformance", ty.network_performance)
                    .leaf("maximumNetworkInterfaces", ty.max_enis)
                    .leaf("maximumNetworkCards", ty.network_cards.len())
                    .leaf(
                        "defaultNetworkCardIndex",
                        InstanceType::DEFAULT_NETWORK_CARD_INDEX,
                    )
                    .set(
                        "networkCards",
                        ty.network_cards.iter().enumerate(),
                        |x, (i, max)| {
                            x.leaf("networkCardIndex", i)
                                .leaf("networkPerformance", ty.network_performance)
                                .leaf("maximumNetworkInterfaces", max);
                        },
                    )
                    .leaf("ipv4AddressesPerInterface", ty.ipv4_per_eni)
                    .leaf("ipv6AddressesPerInterface", ty.ipv4_per_eni)
                    .leaf("ipv6Supported", true)
                    .leaf("enaSupport", "required")
                    .leaf("efaSupported", false)
                    .leaf("encryptionInTransitSupported", false);
            })
            .leaf("hibernationSupported", false)
            .leaf("burstablePerformanceSupported", ty.name.starts_with("t3"))
            .leaf("dedicatedHostsSupported", true)
            .leaf("autoRecoverySupported", true);
    })
    .opt_leaf("nextToken", next);
    Ok(Effect::None)
}

fn describe_subnets(state: &Ec2State, params: &Params, xml: &mut Xml) -> Ec2Result<Effect> {
    let ids = params.list("SubnetId");
    let max = max_results(params, 5, 1000)?;
    let mut subnets: Vec<&Subnet> = Vec::new();
    if ids.is_empty() {
        subnets.extend(state.subnets());
    } else {
        for id in &ids {
            subnets.push(state.subnet(id)?);
        }
    }
    let subnets = apply_filters(subnets, &params.filters()?, SUBNET_FILTERS, |s, name| {
        subnet_filter_values(s, state, name)
    })?;
    let (page, next) = paginate(&subnets, &|s| s.id.clone(), max, params.get("NextToken"))?;
    xml.set("subnetSet", page, |x, subnet| {
        x.leaf("subnetId", &subnet.id)
            .leaf(
                "subnetArn",
                format!(
                    "arn:aws:ec2:{}:{}:subnet/{}",
                    state.region, state.account_id, subnet.id
                ),
            )
            .leaf("state", "available")
            .leaf("ownerId", &state.account_id)
            .leaf("vpcId", &subnet.vpc_id)
            .leaf("cidrBlock", subnet.cidr)
            .set(
                "ipv6CidrBlockAssociationSet",
                std::iter::empty::<()>(),
                |_, ()| {},
            )
            .leaf(
                "availableIpAddressCount",
                subnet.available_ip_address_count(),
            )
            .leaf("availabilityZone", &subnet.availability_zone)
            .leaf("availabilityZoneId", az_id(&subnet.availability_zone))
            .leaf("defaultForAz", false)
            .leaf("mapPublicIpOnLaunch", false)
            .leaf("assignIpv6AddressOnCreation", false)
            .tags(&subnet.tags);
    })
    .opt_leaf("nextToken", next);
    Ok(Effect::None)
}

/// `us-west-2a` -> `usw2-az1`: zone ids are per account in AWS; this
/// mapping is stable, which is all a client may rely on.
fn az_id(az: &str) -> String {
    let letter = az.chars().last().unwrap_or('a');
    let region = &az[..az.len().saturating_sub(1)];
    let mut parts = region.split('-');
    let mut id = parts.next().unwrap_or_default().to_owned();
    for part in parts {
        id.push_str(match part {
            "northeast" => "ne",
            "northwest" => "nw",
            "southeast" => "se",
            "southwest" => "sw",
            other if other.chars().all(|c| c.is_ascii_digit()) => other,
            other => &other[..1],
        });
    }
    let index = u32::from(letter) - u32::from('a') + 1;
    format!("{id}-az{index}")
}

fn describe_vpcs(state: &Ec2State, params: &Params, xml: &mut Xml) -> Ec2Result<Effect> {
    let ids = params.list("VpcId");
    let vpc = &state.vpc;
    for id in &ids {
        if *id != vpc.id {
            return Err(Ec2Error::new(
                "InvalidVpcID.NotFound",
                format!("The vpc ID '{id}' does not exist"),
            ));
        }
    }
    let known = [
        "vpc-id",
        "cidr",
        "cidr-block",
        "cidrBlock",
        "cidr-block-association.cidr-block",
        "state",
        "is-default",
        "isDefault",
        "owner-id",
    ];
    let vpcs = apply_filters(
        vec![vpc],
        &params.filters()?,
        &known,
        |v, name| match name {
            "vpc-id" => Some(vec![v.id.clone()]),
            "cidr" | "cidr-block" | "cidrBlock" => Some(vec![v.cidrs[0].to_string()]),
            "cidr-block-association.cidr-block" => {
                Some(v.cidrs.iter().map(ToString::to_string).collect())
            }
            "state" => Some(vec!["available".into()]),
            "is-default" | "isDefault" => Some(vec!["false".into()]),
            "owner-id" => Some(vec![state.account_id.clone()]),
            _ => tag_filter(&BTreeMap::new(), name),
        },
    )?;
    xml.set("vpcSet", vpcs, |x, vpc| {
        x.leaf("vpcId", &vpc.id)
            .leaf("ownerId", &state.account_id)
            .leaf("state", "available")
            .leaf("cidrBlock", vpc.cidrs[0])
            .set(
                "cidrBlockAssociationSet",
                vpc.cidrs.iter().enumerate(),
                |x, (i, cidr)| {
                    x.leaf("associationId", format!("vpc-cidr-assoc-0{:016x}", i + 1))
                        .leaf("cidrBlock", cidr)
                        .el("cidrBlockState", |x| {
                            x.leaf("state", "associated");
                        });
                },
            )
            .set(
                "ipv6CidrBlockAssociationSet",
                std::iter::empty::<()>(),
                |_, ()| {},
            )
            .leaf("dhcpOptionsId", "dopt-0a5e1ab0000000001")
            .leaf("instanceTenancy", "default")
            .leaf("isDefault", false)
            .set("tagSet", std::iter::empty::<()>(), |_, ()| {});
    });
    Ok(Effect::None)
}

fn describe_network_interfaces(
    state: &Ec2State,
    params: &Params,
    xml: &mut Xml,
) -> Ec2Result<Effect> {
    let ids = params.list("NetworkInterfaceId");
    let max = max_results(params, 5, 1000)?;
    if !ids.is_empty() && max.is_some() {
        return Err(Ec2Error::combination(
            "The parameter NetworkInterfaceIds cannot be used with the parameter MaxResults",
        ));
    }
    let mut enis: Vec<&Eni> = Vec::new();
    if ids.is_empty() {
        enis.extend(state.enis());
    } else {
        for id in &ids {
            enis.push(state.eni(id)?);
        }
        enis.sort_by(|a, b| a.id.cmp(&b.id));
        enis.dedup_by(|a, b| a.id == b.id);
    }
    let enis = apply_filters(enis, &params.filters()?, ENI_FILTERS, |eni, name| {
        eni_filter_values(eni, state, name)
    })?;
    let (page, next) = paginate(&enis, &|e| e.id.clone(), max, params.get("NextToken"))?;
    xml.set("networkInterfaceSet", page, |x, eni| {
        write_eni(x, state, eni);
    })
    .opt_leaf("nextToken", next);
    Ok(Effect::None)
}

fn create_network_interface(
    state: &mut Ec2State,
    params: &Params,
    xml: &mut Xml,
) -> Ec2Result<Effect> {
    let prefixes = params
        .indices("Ipv4Prefix")
        .into_iter()
        .map(|n| {
            let spec = params.sub("Ipv4Prefix", n);
            parse_prefix(spec.required("Ipv4Prefix")?)
        })
        .collect::<Ec2Result<Vec<_>>>()?;
    let request = CreateEni {
        subnet_id: params.required("SubnetId")?.to_owned(),
        groups: params.list("SecurityGroupId"),
        description: params.get("Description").unwrap_or_default().to_owned(),
        tags: tag_specifications(params, "network-interface")?,
        private_ip: params.addr("PrivateIpAddress")?,
        secondary_count: params.u32("SecondaryPrivateIpAddressCount")?,
        prefix_count: params.u32("Ipv4PrefixCount")?,
        prefixes,
        interface_type: params
            .get("InterfaceType")
            .map_or(Ok(InterfaceType::Interface), InterfaceType::parse)?,
    };
    let id = state.create_eni(request)?;
    let eni = state.eni(&id).expect("made");
    xml.el("networkInterface", |x| write_eni(x, state, eni));
    Ok(Effect::Changed)
}

fn attach_network_interface(
    state: &mut Ec2State,
    params: &Params,
    xml: &mut Xml,
    now_ms: u64,
) -> Ec2Result<Effect> {
    let eni = params.required("NetworkInterfaceId")?;
    let instance = params.required("InstanceId")?;
    let device = params
        .u32("DeviceIndex")?
        .ok_or_else(|| Ec2Error::missing("DeviceIndex"))?;
    let card = params.u32("NetworkCardIndex")?.unwrap_or(0);
    let id = state.attach(eni, instance, device, card, now_ms)?;
    xml.leaf("attachmentId", &id).leaf("networkCardIndex", card);
    Ok(Effect::Attaching(id))
}

fn modify_attribute(state: &mut Ec2State, params: &Params, xml: &mut Xml) -> Ec2Result<Effect> {
    let eni = params.required("NetworkInterfaceId")?;
    let mut changes = Vec::new();
    if let Some(value) = params.bool("Attachment.DeleteOnTermination")? {
        changes.push(Modify::DeleteOnTermination {
            attachment_id: params.required("Attachment.AttachmentId")?.to_owned(),
            value,
        });
    }
    if let Some(value) = params.bool("SourceDestCheck.Value")? {
        changes.push(Modify::SourceDestCheck(value));
    }
    let groups = params.list("SecurityGroupId");
    if !groups.is_empty() {
        changes.push(Modify::Groups(groups));
    }
    if let Some(text) = params.get("Description.Value") {
        changes.push(Modify::Description(text.to_owned()));
    }
    let change = match changes.len() {
        0 => return Err(Ec2Error::missing("attribute")),
        1 => changes.pop().expect("one"),
        _ => {
            return Err(Ec2Error::combination(
                "Fields for multiple attribute types specified: only one attribute can be modified at a time",
            ));
        }
    };
    state.modify(eni, change)?;
    xml.leaf("return", true);
    Ok(Effect::None)
}

fn assign(state: &mut Ec2State, params: &Params, xml: &mut Xml) -> Ec2Result<Effect> {
    let eni = params.required("NetworkInterfaceId")?;
    let request = Assign {
        secondary_count: params.u32("SecondaryPrivateIpAddressCount")?,
        addresses: params
            .list("PrivateIpAddress")
            .iter()
            .map(|a| parse_addr("PrivateIpAddress", a))
            .collect::<Ec2Result<_>>()?,
        prefix_count: params.u32("Ipv4PrefixCount")?,
        prefixes: params
            .list("Ipv4Prefix")
            .iter()
            .map(|p| parse_prefix(p))
            .collect::<Ec2Result<_>>()?,
    };
    if params.bool("AllowReassignment")? == Some(true) {
        // Moving an address between ENIs is not modelled: say so rather
        // than pretend.
        return Err(Ec2Error::invalid_value(
            "AllowReassignment is not supported by the lab's EC2 emulator",
        ));
    }
    let (addresses, prefixes) = state.assign(eni, &request)?;
    xml.leaf("networkInterfaceId", eni)
        .set("assignedPrivateIpAddressesSet", addresses, |x, a| {
            x.leaf("privateIpAddress", a);
        })
        .set("assignedIpv4PrefixSet", prefixes, |x, p| {
            x.leaf("ipv4Prefix", p);
        })
        .leaf("return", true);
    Ok(Effect::Changed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ec2::config::{Config, LAB_NODE_SUBNET_ID};

    fn call(state: &mut Ec2State, body: &str) -> Ec2Result<(String, Effect)> {
        let params = Params::parse(body.as_bytes());
        let action = params.get("Action").unwrap_or_default().to_owned();
        dispatch(state, &action, &params, "req", 0)
    }

    #[test]
    fn params_lists_and_structures() {
        let params = Params::parse(
            b"Action=X&Filter.2.Name=b&Filter.1.Name=a&Filter.1.Value.2=y&Filter.1.Value.1=x&NetworkInterfaceId.10=e10&NetworkInterfaceId.2=e2",
        );
        assert_eq!(params.list("NetworkInterfaceId"), vec!["e2", "e10"]);
        let filters = params.filters().unwrap();
        assert_eq!(filters[0].name, "a");
        assert_eq!(filters[0].values, vec!["x", "y"]);
        assert_eq!(filters[1].name, "b");
    }

    #[test]
    fn globs() {
        assert!(glob("eni-*", "eni-0123"));
        assert!(glob("10.20.11.?", "10.20.11.5"));
        assert!(!glob("10.20.11.?", "10.20.11.50"));
        assert!(glob("*", ""));
        assert!(glob("a*b*c", "aXXbYYc"));
        assert!(!glob("a*b*c", "aXXbYY"));
    }

    #[test]
    fn az_ids() {
        assert_eq!(az_id("us-west-2a"), "usw2-az1");
        assert_eq!(az_id("eu-central-1c"), "euc1-az3");
    }

    #[test]
    fn tokens_round_trip_and_reject_garbage() {
        assert_eq!(decode_token(&encode_token("eni-01")).unwrap(), "eni-01");
        assert_eq!(
            decode_token("nope").unwrap_err().code,
            "InvalidPaginationToken"
        );
    }

    #[test]
    fn unknown_action_and_filter() {
        let mut state = Ec2State::new(&Config::lab());
        assert_eq!(
            call(&mut state, "Action=Nope").unwrap_err().code,
            "InvalidAction"
        );
        let err = call(
            &mut state,
            "Action=DescribeNetworkInterfaces&Filter.1.Name=bogus&Filter.1.Value.1=x",
        )
        .unwrap_err();
        assert_eq!(err.code, "InvalidParameterValue");
        let err = call(&mut state, "Action=DescribeNetworkInterfaces&MaxResults=4").unwrap_err();
        assert_eq!(err.code, "InvalidParameterValue");
    }

    #[test]
    fn create_then_describe_by_tag() {
        let mut state = Ec2State::new(&Config::lab());
        let body = format!(
            "Action=CreateNetworkInterface&SubnetId={LAB_NODE_SUBNET_ID}&TagSpecification.1.ResourceType=network-interface&TagSpecification.1.Tag.1.Key=node.k8s.amazonaws.com/instance_id&TagSpecification.1.Tag.1.Value=i-1&SecondaryPrivateIpAddressCount=2"
        );
        let (xml, effect) = call(&mut state, &body).unwrap();
        assert_eq!(effect, Effect::Changed);
        assert!(xml.contains("<CreateNetworkInterfaceResponse"));
        assert_eq!(xml.matches("<primary>false</primary>").count(), 2);
        let (xml, _) = call(
            &mut state,
            "Action=DescribeNetworkInterfaces&Filter.1.Name=tag:node.k8s.amazonaws.com/instance_id&Filter.1.Value.1=i-*",
        )
        .unwrap();
        assert_eq!(xml.matches("<networkInterfaceId>").count(), 1);
    }
}
