//! EC2's state and rules: the VPC, its subnets, instances, ENIs with their
//! addresses and /28 prefixes, tags, per-instance-type limits, and the
//! errors EC2 answers when a call breaks a rule.
//!
//! Pure: no I/O and no clock (callers pass the time), and randomness from a
//! seeded generator, so a run is reproducible and every rule is unit-tested
//! here without a server. The server ([`super::server`]) wraps one
//! [`Ec2State`] in a lock; the Query API ([`super::query`]) and IMDS
//! ([`super::imds`]) read and change it.
//!
//! What EC2 does that the agent depends on:
//! - A subnet's first four addresses and its last are AWS's (network, VPC
//!   router, DNS, future use; broadcast): never handed out.
//! - Secondary addresses and prefixes are picked at random among the free
//!   ones, so an agent must never assume which it gets.
//! - A /28 prefix is an aligned block whose 16 addresses are all free; a
//!   fragmented subnet has free addresses but no free block
//!   (`InsufficientCidrBlocks`).
//! - Per instance type, a number of ENIs and of IPv4 slots per ENI; the
//!   primary address takes a slot, and so does each prefix.

use std::{collections::BTreeMap, net::Ipv4Addr};

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};

use super::{
    config::Config,
    instance_types::{self, InstanceType, MAX_IPV4_PER_ENI},
};

/// An error as EC2 reports it: a code the SDK maps to its typed errors and
/// a human message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct Ec2Error {
    pub code: String,
    pub message: String,
}

impl Ec2Error {
    pub fn new(code: &str, message: impl Into<String>) -> Self {
        Self {
            code: code.to_owned(),
            message: message.into(),
        }
    }

    /// `InvalidParameterValue`.
    pub fn invalid_value(message: impl Into<String>) -> Self {
        Self::new("InvalidParameterValue", message)
    }

    /// `InvalidParameterCombination`.
    pub fn combination(message: impl Into<String>) -> Self {
        Self::new("InvalidParameterCombination", message)
    }

    /// `MissingParameter`.
    pub fn missing(parameter: &str) -> Self {
        Self::new(
            "MissingParameter",
            format!("The request must contain the parameter {parameter}"),
        )
    }

    /// The HTTP status EC2 sends with this code: 503 for throttling and
    /// unavailability, 500 for internal errors, 403 for a missing
    /// permission, 400 for the client's other errors.
    pub fn http_status(&self) -> u16 {
        match self.code.as_str() {
            "RequestLimitExceeded" | "Unavailable" | "ServiceUnavailable" => 503,
            "InternalError" | "InternalFailure" => 500,
            "UnauthorizedOperation" => 403,
            _ => 400,
        }
    }
}

/// The result of an EC2 action.
pub type Ec2Result<T> = Result<T, Ec2Error>;

/// `SplitMix64`: small, seedable, good enough to spread picks evenly.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        let n64 = u64::try_from(n).expect("usize fits in u64");
        usize::try_from(self.next_u64() % n64).expect("below n")
    }

    /// A number in `0..1`.
    pub fn unit(&mut self) -> f64 {
        // 53 random bits over 2^53: exact in an f64, uniform in 0..1.
        let bits = u32::try_from(self.next_u64() >> 40).expect("24 bits");
        let low = u32::try_from(self.next_u64() >> 35).expect("29 bits");
        (f64::from(bits) * f64::from(1u32 << 29) + f64::from(low)) / 9_007_199_254_740_992.0
    }

    /// `k` distinct elements of `items`, in random order.
    fn pick<T: Copy>(&mut self, items: &mut [T], k: usize) -> Vec<T> {
        let k = k.min(items.len());
        for i in 0..k {
            let j = i + self.below(items.len() - i);
            items.swap(i, j);
        }
        items[..k].to_vec()
    }
}

/// The state of an ENI (`NetworkInterface.Status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EniStatus {
    Available,
    InUse,
}

impl EniStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Available => "available",
            Self::InUse => "in-use",
        }
    }
}

/// The state of an attachment (`NetworkInterfaceAttachment.Status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttachmentStatus {
    Attaching,
    Attached,
    Detaching,
}

impl AttachmentStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Attaching => "attaching",
            Self::Attached => "attached",
            Self::Detaching => "detaching",
        }
    }
}

/// An ENI's attachment to an instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    pub id: String,
    pub instance_id: String,
    pub device_index: u32,
    pub network_card_index: u32,
    pub status: AttachmentStatus,
    pub delete_on_termination: bool,
    /// Milliseconds since the Unix epoch.
    pub attach_time_ms: u64,
}

/// An ENI's `interfaceType`: the kinds the VPC resource controller uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InterfaceType {
    #[default]
    Interface,
    /// Carries the VLAN-tagged frames of its branch ENIs.
    Trunk,
}

impl InterfaceType {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Interface => "interface",
            Self::Trunk => "trunk",
        }
    }

    /// `CreateNetworkInterface`'s `InterfaceType`: what the lab serves.
    pub fn parse(value: &str) -> Ec2Result<Self> {
        match value {
            "interface" => Ok(Self::Interface),
            "trunk" => Ok(Self::Trunk),
            other => Err(Ec2Error::invalid_value(format!(
                "Value ({other}) for parameter interfaceType is invalid or not served by the lab (interface, trunk)"
            ))),
        }
    }
}

/// A branch ENI's association with a trunk ENI, on a VLAN.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrunkAssociation {
    pub id: String,
    pub branch_id: String,
    pub trunk_id: String,
    pub vlan_id: u16,
}

/// The VLAN ids a trunk carries (802.1Q's, 0 and 4095 reserved).
pub const VLAN_IDS: std::ops::RangeInclusive<u16> = 1..=4094;

/// A network interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Eni {
    pub id: String,
    pub subnet_id: String,
    pub vpc_id: String,
    pub availability_zone: String,
    pub description: String,
    /// `02:ee:` and the four bytes of the primary address (the lab's
    /// convention: the node's `eth0` is the instance's primary ENI).
    pub mac: String,
    pub primary_ip: Ipv4Addr,
    /// In the order they were assigned.
    pub secondary_ips: Vec<Ipv4Addr>,
    pub prefixes: Vec<Ipv4Net>,
    pub groups: Vec<String>,
    pub tags: BTreeMap<String, String>,
    pub source_dest_check: bool,
    pub status: EniStatus,
    pub attachment: Option<Attachment>,
    pub owner_id: String,
    #[serde(default)]
    pub interface_type: InterfaceType,
}

impl Eni {
    /// IPv4 slots used: the primary address, each secondary, each prefix.
    pub fn slots(&self) -> usize {
        1 + self.secondary_ips.len() + self.prefixes.len()
    }

    /// Primary first, then the secondaries.
    pub fn addresses(&self) -> impl Iterator<Item = Ipv4Addr> + '_ {
        std::iter::once(self.primary_ip).chain(self.secondary_ips.iter().copied())
    }

    /// Whether the attachment (if any) has completed.
    pub fn is_attached(&self) -> bool {
        self.attachment
            .as_ref()
            .is_some_and(|a| a.status == AttachmentStatus::Attached)
    }
}

/// The state of an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InstanceState {
    Running,
    Terminated,
}

impl InstanceState {
    /// EC2's (code, name).
    pub fn code_and_name(self) -> (u32, &'static str) {
        match self {
            Self::Running => (16, "running"),
            Self::Terminated => (48, "terminated"),
        }
    }
}

/// An instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    pub id: String,
    pub reservation_id: String,
    pub instance_type: String,
    pub image_id: String,
    pub subnet_id: String,
    pub vpc_id: String,
    pub availability_zone: String,
    pub state: InstanceState,
    pub launch_time_ms: u64,
    pub primary_eni: String,
    pub primary_ip: Ipv4Addr,
    pub groups: Vec<String>,
    pub tags: BTreeMap<String, String>,
}

/// Who holds an address of a subnet.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Occupant {
    Eni(String),
    /// Another instance, outside the emulator (admin `occupy`).
    Other,
}

/// A subnet and who uses which of its addresses.
#[derive(Debug, Clone)]
pub struct Subnet {
    pub id: String,
    pub cidr: Ipv4Net,
    pub vpc_id: String,
    pub availability_zone: String,
    pub tags: BTreeMap<String, String>,
    occupied: BTreeMap<u32, Occupant>,
}

impl Subnet {
    fn new(
        id: &str,
        cidr: Ipv4Net,
        vpc_id: &str,
        az: &str,
        tags: BTreeMap<String, String>,
    ) -> Self {
        Self {
            id: id.to_owned(),
            cidr: cidr.trunc(),
            vpc_id: vpc_id.to_owned(),
            availability_zone: az.to_owned(),
            tags,
            occupied: BTreeMap::new(),
        }
    }

    /// The addresses EC2 may hand out: all but the first four and the last.
    fn usable(&self) -> std::ops::RangeInclusive<u32> {
        let first = u32::from(self.cidr.network()) + 4;
        let last = u32::from(self.cidr.broadcast()) - 1;
        first..=last
    }

    /// Whether `addr` is one AWS keeps for itself.
    pub fn is_reserved(&self, addr: Ipv4Addr) -> bool {
        self.cidr.contains(&addr) && !self.usable().contains(&u32::from(addr))
    }

    /// `AvailableIpAddressCount`: usable addresses nobody holds (a prefix
    /// holds its 16).
    pub fn available_ip_address_count(&self) -> usize {
        self.usable().count() - self.occupied.len()
    }

    fn is_free(&self, addr: u32) -> bool {
        self.usable().contains(&addr) && !self.occupied.contains_key(&addr)
    }

    fn free_addresses(&self) -> Vec<u32> {
        self.usable()
            .filter(|addr| !self.occupied.contains_key(addr))
            .collect()
    }

    /// Aligned /28s whose 16 addresses are usable and free.
    fn free_prefixes(&self) -> Vec<Ipv4Net> {
        if self.cidr.prefix_len() > 28 {
            return Vec::new();
        }
        let start = u32::from(self.cidr.network());
        let end = u32::from(self.cidr.broadcast());
        (start..=end)
            .step_by(16)
            .filter(|block| (*block..block + 16).all(|addr| self.is_free(addr)))
            .map(|block| Ipv4Net::new(Ipv4Addr::from(block), 28).expect("valid /28"))
            .collect()
    }

    /// How many /28 prefixes could be assigned now.
    pub fn free_prefix_count(&self) -> usize {
        self.free_prefixes().len()
    }

    fn occupy(&mut self, addr: Ipv4Addr, occupant: Occupant) {
        self.occupied.insert(u32::from(addr), occupant);
    }

    fn occupy_prefix(&mut self, prefix: Ipv4Net, occupant: &Occupant) {
        for addr in prefix.hosts_all() {
            self.occupy(addr, occupant.clone());
        }
    }

    fn release(&mut self, addr: Ipv4Addr) {
        self.occupied.remove(&u32::from(addr));
    }

    fn release_prefix(&mut self, prefix: Ipv4Net) {
        for addr in prefix.hosts_all() {
            self.release(addr);
        }
    }

    /// Addresses held by something other than an emulated ENI.
    pub fn occupied_by_others(&self) -> usize {
        self.occupied
            .values()
            .filter(|o| **o == Occupant::Other)
            .count()
    }
}

/// Every address of a prefix, network and broadcast included.
trait AllHosts {
    fn hosts_all(&self) -> Box<dyn Iterator<Item = Ipv4Addr>>;
}

impl AllHosts for Ipv4Net {
    fn hosts_all(&self) -> Box<dyn Iterator<Item = Ipv4Addr>> {
        let start = u32::from(self.network());
        let end = u32::from(self.broadcast());
        Box::new((start..=end).map(Ipv4Addr::from))
    }
}

/// What `CreateNetworkInterface` asks for.
#[derive(Debug, Clone, Default)]
pub struct CreateEni {
    pub subnet_id: String,
    pub groups: Vec<String>,
    pub description: String,
    pub tags: BTreeMap<String, String>,
    pub private_ip: Option<Ipv4Addr>,
    pub secondary_count: Option<u32>,
    pub prefix_count: Option<u32>,
    pub prefixes: Vec<Ipv4Net>,
    pub interface_type: InterfaceType,
}

/// What `AssignPrivateIpAddresses` asks for.
#[derive(Debug, Clone, Default)]
pub struct Assign {
    pub secondary_count: Option<u32>,
    pub addresses: Vec<Ipv4Addr>,
    pub prefix_count: Option<u32>,
    pub prefixes: Vec<Ipv4Net>,
}

/// One attribute `ModifyNetworkInterfaceAttribute` changes.
#[derive(Debug, Clone)]
pub enum Modify {
    DeleteOnTermination { attachment_id: String, value: bool },
    SourceDestCheck(bool),
    Groups(Vec<String>),
    Description(String),
}

/// The VPC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vpc {
    pub id: String,
    pub cidrs: Vec<Ipv4Net>,
}

/// The whole of EC2 as the emulator knows it.
#[derive(Debug, Clone)]
pub struct Ec2State {
    pub region: String,
    pub availability_zone: String,
    pub account_id: String,
    pub iam_role: String,
    pub vpc: Vpc,
    subnets: BTreeMap<String, Subnet>,
    security_groups: BTreeMap<String, String>,
    enis: BTreeMap<String, Eni>,
    instances: BTreeMap<String, Instance>,
    trunk_associations: BTreeMap<String, TrunkAssociation>,
    /// Address and prefix picks.
    rng: Rng,
    /// Resource ids: their own stream, so an extra id never changes which
    /// addresses a run gets.
    ids: Rng,
}

/// EC2's id shape: the prefix, a dash, 8 or 17 lowercase hex digits.
pub fn is_well_formed_id(prefix: &str, id: &str) -> bool {
    id.strip_prefix(prefix)
        .and_then(|rest| rest.strip_prefix('-'))
        .is_some_and(|hex| {
            (hex.len() == 8 || hex.len() == 17)
                && hex
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
}

/// The lab's MAC convention for an ENI whose primary address is `addr`.
pub fn eni_mac(addr: Ipv4Addr) -> String {
    let [a, b, c, d] = addr.octets();
    format!("02:ee:{a:02x}:{b:02x}:{c:02x}:{d:02x}")
}

impl Ec2State {
    /// The state a configuration describes: subnets empty, no instance.
    pub fn new(config: &Config) -> Self {
        let subnets = config
            .subnets
            .iter()
            .map(|s| {
                let az = s
                    .availability_zone
                    .clone()
                    .unwrap_or_else(|| config.availability_zone.clone());
                (
                    s.id.clone(),
                    Subnet::new(&s.id, s.cidr, &config.vpc.id, &az, s.tags.clone()),
                )
            })
            .collect();
        Self {
            region: config.region.clone(),
            availability_zone: config.availability_zone.clone(),
            account_id: config.account_id.clone(),
            iam_role: config.iam_role.clone(),
            vpc: Vpc {
                id: config.vpc.id.clone(),
                cidrs: config.vpc.cidrs.clone(),
            },
            subnets,
            security_groups: config
                .security_groups
                .iter()
                .map(|g| (g.id.clone(), g.name.clone()))
                .collect(),
            enis: BTreeMap::new(),
            instances: BTreeMap::new(),
            trunk_associations: BTreeMap::new(),
            rng: Rng::new(config.seed),
            ids: Rng::new(config.seed ^ 0x1d5_1d5_1d5),
        }
    }

    fn new_id(&mut self, prefix: &str) -> String {
        // 17 hex digits, as EC2's current ids.
        format!("{prefix}-0{:016x}", self.ids.next_u64())
    }

    // ---- lookups -------------------------------------------------------

    pub fn subnets(&self) -> impl Iterator<Item = &Subnet> {
        self.subnets.values()
    }

    pub fn enis(&self) -> impl Iterator<Item = &Eni> {
        self.enis.values()
    }

    pub fn instances(&self) -> impl Iterator<Item = &Instance> {
        self.instances.values()
    }

    pub fn security_group_name(&self, id: &str) -> Option<&str> {
        self.security_groups.get(id).map(String::as_str)
    }

    pub fn subnet(&self, id: &str) -> Ec2Result<&Subnet> {
        if !is_well_formed_id("subnet", id) {
            return Err(Ec2Error::new(
                "InvalidSubnetID.Malformed",
                format!("Invalid id: \"{id}\""),
            ));
        }
        self.subnets.get(id).ok_or_else(|| {
            Ec2Error::new(
                "InvalidSubnetID.NotFound",
                format!("The subnet ID '{id}' does not exist"),
            )
        })
    }

    pub fn eni(&self, id: &str) -> Ec2Result<&Eni> {
        if !is_well_formed_id("eni", id) {
            return Err(Ec2Error::new(
                "InvalidNetworkInterfaceID.Malformed",
                format!("Invalid id: \"{id}\" (expecting \"eni-...\")"),
            ));
        }
        self.enis.get(id).ok_or_else(|| {
            Ec2Error::new(
                "InvalidNetworkInterfaceID.NotFound",
                format!("The networkInterface ID '{id}' does not exist"),
            )
        })
    }

    fn eni_mut(&mut self, id: &str) -> Ec2Result<&mut Eni> {
        self.eni(id)?;
        Ok(self.enis.get_mut(id).expect("checked"))
    }

    pub fn instance(&self, id: &str) -> Ec2Result<&Instance> {
        if !is_well_formed_id("i", id) {
            return Err(Ec2Error::new(
                "InvalidInstanceID.Malformed",
                format!("Invalid id: \"{id}\""),
            ));
        }
        self.instances.get(id).ok_or_else(|| {
            Ec2Error::new(
                "InvalidInstanceID.NotFound",
                format!("The instance ID '{id}' does not exist"),
            )
        })
    }

    /// The instance type of `instance`.
    fn instance_type_of(instance: &Instance) -> &'static InstanceType {
        instance_types::lookup(&instance.instance_type).expect("checked at RunInstances")
    }

    /// The ENI holding attachment `attachment_id`.
    pub fn eni_by_attachment(&self, attachment_id: &str) -> Ec2Result<&Eni> {
        self.enis
            .values()
            .find(|eni| {
                eni.attachment
                    .as_ref()
                    .is_some_and(|a| a.id == attachment_id)
            })
            .ok_or_else(|| {
                Ec2Error::new(
                    "InvalidAttachmentID.NotFound",
                    format!("The attachment ID '{attachment_id}' does not exist"),
                )
            })
    }

    /// The running instance that owns `addr` through one of its attached
    /// ENIs (how IMDS knows who is asking).
    pub fn instance_by_address(&self, addr: Ipv4Addr) -> Option<&Instance> {
        let eni = self
            .enis
            .values()
            .find(|eni| eni.addresses().any(|a| a == addr))?;
        let attachment = eni.attachment.as_ref()?;
        self.instances
            .get(&attachment.instance_id)
            .filter(|i| i.state == InstanceState::Running)
    }

    /// The ENIs attached (completely) to `instance_id`, by card and device.
    pub fn attached_enis(&self, instance_id: &str) -> Vec<&Eni> {
        let mut enis: Vec<&Eni> = self
            .enis
            .values()
            .filter(|eni| {
                eni.attachment.as_ref().is_some_and(|a| {
                    a.instance_id == instance_id && a.status == AttachmentStatus::Attached
                })
            })
            .collect();
        enis.sort_by_key(|eni| {
            let a = eni.attachment.as_ref().expect("filtered");
            (a.network_card_index, a.device_index)
        });
        enis
    }

    fn check_groups(&self, groups: &[String]) -> Ec2Result<()> {
        for group in groups {
            if !self.security_groups.contains_key(group) {
                return Err(Ec2Error::new(
                    "InvalidGroup.NotFound",
                    format!(
                        "The security group '{group}' does not exist in VPC '{}'",
                        self.vpc.id
                    ),
                ));
            }
        }
        Ok(())
    }

    fn default_group(&self) -> String {
        self.security_groups
            .iter()
            .find(|(_, name)| *name == "default")
            .or_else(|| self.security_groups.iter().next())
            .map(|(id, _)| id.clone())
            .unwrap_or_default()
    }

    // ---- allocation ----------------------------------------------------

    /// Checks that `addr` can be taken in `subnet`.
    fn check_free(subnet: &Subnet, addr: Ipv4Addr) -> Ec2Result<()> {
        if !subnet.cidr.contains(&addr) {
            return Err(Ec2Error::invalid_value(format!(
                "Address {addr} does not fall within the subnet's address range"
            )));
        }
        if subnet.is_reserved(addr) {
            return Err(Ec2Error::invalid_value(format!(
                "Address {addr} is reserved by AWS in subnet {} ({})",
                subnet.id, subnet.cidr
            )));
        }
        if subnet.occupied.contains_key(&u32::from(addr)) {
            return Err(Ec2Error::new(
                "InvalidIPAddress.InUse",
                format!("Address {addr} is in use."),
            ));
        }
        Ok(())
    }

    /// Picks `count` free addresses at random.
    fn pick_addresses(&mut self, subnet_id: &str, count: usize) -> Ec2Result<Vec<Ipv4Addr>> {
        let subnet = &self.subnets[subnet_id];
        let mut free = subnet.free_addresses();
        if free.len() < count {
            return Err(Ec2Error::new(
                "InsufficientFreeAddressesInSubnet",
                format!(
                    "There are not enough free addresses in subnet '{subnet_id}' to satisfy the requested number of instances."
                ),
            ));
        }
        Ok(self
            .rng
            .pick(&mut free, count)
            .into_iter()
            .map(Ipv4Addr::from)
            .collect())
    }

    /// Picks `count` free aligned /28s at random.
    fn pick_prefixes(&mut self, subnet_id: &str, count: usize) -> Ec2Result<Vec<Ipv4Net>> {
        let mut free = self.subnets[subnet_id].free_prefixes();
        if free.len() < count {
            return Err(Ec2Error::new(
                "InsufficientCidrBlocks",
                format!(
                    "There are not enough free cidr blocks in the specified subnet '{subnet_id}' to satisfy the request."
                ),
            ));
        }
        Ok(self.rng.pick(&mut free, count))
    }

    /// Checks explicit prefixes: aligned /28s in the subnet, all free.
    fn check_prefixes(subnet: &Subnet, prefixes: &[Ipv4Net]) -> Ec2Result<()> {
        for (i, prefix) in prefixes.iter().enumerate() {
            if prefix.prefix_len() != 28 || prefix.trunc() != *prefix {
                return Err(Ec2Error::invalid_value(format!(
                    "Invalid IPv4 prefix {prefix}: only aligned /28 prefixes can be assigned"
                )));
            }
            if !subnet.cidr.contains(prefix) {
                return Err(Ec2Error::invalid_value(format!(
                    "Prefix {prefix} does not fall within the subnet's address range"
                )));
            }
            if prefixes[..i].contains(prefix) {
                return Err(Ec2Error::invalid_value(format!(
                    "Prefix {prefix} given twice"
                )));
            }
            if !prefix.hosts_all().all(|a| subnet.is_free(u32::from(a))) {
                return Err(Ec2Error::new(
                    "InvalidIPAddress.InUse",
                    format!("Prefix {prefix} is in use or overlaps reserved addresses."),
                ));
            }
        }
        Ok(())
    }

    fn slot_limit(&self, eni: &Eni) -> u32 {
        eni.attachment
            .as_ref()
            .and_then(|a| self.instances.get(&a.instance_id))
            .map_or(MAX_IPV4_PER_ENI, |i| Self::instance_type_of(i).ipv4_per_eni)
    }

    fn check_slots(limit: u32, used: usize, more: usize) -> Ec2Result<()> {
        if used + more > usize::try_from(limit).expect("small") {
            return Err(Ec2Error::new(
                "PrivateIpAddressLimitExceeded",
                format!(
                    "Number of private addresses will exceed limit: {} requested, the interface takes {limit}.",
                    used + more
                ),
            ));
        }
        Ok(())
    }

    fn new_eni(
        &mut self,
        subnet_id: &str,
        primary_ip: Option<Ipv4Addr>,
        groups: Vec<String>,
        description: String,
        tags: BTreeMap<String, String>,
    ) -> Ec2Result<String> {
        let subnet = self.subnet(subnet_id)?;
        let (vpc_id, az) = (subnet.vpc_id.clone(), subnet.availability_zone.clone());
        let primary_ip = match primary_ip {
            Some(addr) => {
                Self::check_free(subnet, addr)?;
                addr
            }
            None => self.pick_addresses(subnet_id, 1)?[0],
        };
        let groups = if groups.is_empty() {
            vec![self.default_group()]
        } else {
            self.check_groups(&groups)?;
            groups
        };
        let id = self.new_id("eni");
        self.subnets
            .get_mut(subnet_id)
            .expect("checked")
            .occupy(primary_ip, Occupant::Eni(id.clone()));
        self.enis.insert(
            id.clone(),
            Eni {
                id: id.clone(),
                subnet_id: subnet_id.to_owned(),
                vpc_id,
                availability_zone: az,
                description,
                mac: eni_mac(primary_ip),
                primary_ip,
                secondary_ips: Vec::new(),
                prefixes: Vec::new(),
                groups,
                tags,
                source_dest_check: true,
                status: EniStatus::Available,
                attachment: None,
                owner_id: self.account_id.clone(),
                interface_type: InterfaceType::Interface,
            },
        );
        Ok(id)
    }

    // ---- actions -------------------------------------------------------

    /// `RunInstances` for one instance: its primary ENI at device index 0,
    /// attached at once.
    pub fn run_instance(
        &mut self,
        instance_type: &str,
        image_id: &str,
        subnet_id: &str,
        private_ip: Option<Ipv4Addr>,
        groups: Vec<String>,
        now_ms: u64,
    ) -> Ec2Result<String> {
        let ty = instance_types::lookup(instance_type).ok_or_else(|| {
            Ec2Error::invalid_value(format!("Invalid value '{instance_type}' for InstanceType."))
        })?;
        let eni_id = self.new_eni(
            subnet_id,
            private_ip,
            groups,
            "Primary network interface".to_owned(),
            BTreeMap::new(),
        )?;
        let id = self.new_id("i");
        let reservation_id = self.new_id("r");
        let attachment_id = self.new_id("eni-attach");
        let eni = self.enis.get_mut(&eni_id).expect("just made");
        eni.status = EniStatus::InUse;
        eni.attachment = Some(Attachment {
            id: attachment_id,
            instance_id: id.clone(),
            device_index: 0,
            network_card_index: InstanceType::DEFAULT_NETWORK_CARD_INDEX,
            status: AttachmentStatus::Attached,
            delete_on_termination: true,
            attach_time_ms: now_ms,
        });
        let eni = eni.clone();
        self.instances.insert(
            id.clone(),
            Instance {
                id: id.clone(),
                reservation_id,
                instance_type: ty.name.to_owned(),
                image_id: image_id.to_owned(),
                subnet_id: subnet_id.to_owned(),
                vpc_id: eni.vpc_id,
                availability_zone: eni.availability_zone,
                state: InstanceState::Running,
                launch_time_ms: now_ms,
                primary_eni: eni_id,
                primary_ip: eni.primary_ip,
                groups: eni.groups,
                tags: BTreeMap::new(),
            },
        );
        Ok(id)
    }

    /// `TerminateInstances` for one: ENIs marked delete-on-termination go,
    /// the others are detached. Returns the previous state.
    pub fn terminate_instance(&mut self, instance_id: &str) -> Ec2Result<InstanceState> {
        let previous = self.instance(instance_id)?.state;
        let attached: Vec<(String, bool)> = self
            .enis
            .values()
            .filter_map(|eni| {
                let a = eni.attachment.as_ref()?;
                (a.instance_id == instance_id).then(|| (eni.id.clone(), a.delete_on_termination))
            })
            .collect();
        for (eni_id, delete) in attached {
            let eni = self.enis.get_mut(&eni_id).expect("listed");
            eni.attachment = None;
            eni.status = EniStatus::Available;
            if delete {
                self.delete_eni(&eni_id)?;
            }
        }
        self.instances.get_mut(instance_id).expect("checked").state = InstanceState::Terminated;
        Ok(previous)
    }

    /// `CreateNetworkInterface`.
    pub fn create_eni(&mut self, request: CreateEni) -> Ec2Result<String> {
        if request.secondary_count.is_some()
            && (request.prefix_count.is_some() || !request.prefixes.is_empty())
        {
            return Err(Ec2Error::combination(
                "You cannot specify secondary private IPv4 addresses and IPv4 prefixes in the same request.",
            ));
        }
        if request.prefix_count.is_some() && !request.prefixes.is_empty() {
            return Err(Ec2Error::combination(
                "You cannot specify both Ipv4Prefixes and Ipv4PrefixCount.",
            ));
        }
        let subnet = self.subnet(&request.subnet_id)?;
        let secondary = request.secondary_count.unwrap_or(0);
        let prefix_count = request
            .prefix_count
            .map_or(request.prefixes.len(), |n| n as usize);
        Self::check_slots(MAX_IPV4_PER_ENI, 1, secondary as usize + prefix_count)?;
        Self::check_prefixes(subnet, &request.prefixes)?;
        // Check everything that can fail before anything is taken.
        if subnet.free_addresses().len() < 1 + secondary as usize {
            return Err(Ec2Error::new(
                "InsufficientFreeAddressesInSubnet",
                format!(
                    "There are not enough free addresses in subnet '{}' to satisfy the requested number of addresses.",
                    request.subnet_id
                ),
            ));
        }
        let id = self.new_eni(
            &request.subnet_id,
            request.private_ip,
            request.groups,
            request.description,
            request.tags,
        )?;
        self.eni_mut(&id).expect("made").interface_type = request.interface_type;
        let assign = Assign {
            secondary_count: request.secondary_count.filter(|n| *n > 0),
            addresses: Vec::new(),
            prefix_count: request.prefix_count.filter(|n| *n > 0),
            prefixes: request.prefixes,
        };
        if (assign.secondary_count.is_some()
            || assign.prefix_count.is_some()
            || !assign.prefixes.is_empty())
            && let Err(err) = self.assign(&id, &assign)
        {
            // Undo: EC2 creates nothing when it fails.
            self.delete_eni(&id).expect("just made, unattached");
            return Err(err);
        }
        Ok(id)
    }

    /// `DeleteNetworkInterface`: only an ENI attached to nothing and in no
    /// trunk association.
    pub fn delete_eni(&mut self, eni_id: &str) -> Ec2Result<()> {
        let eni = self.eni(eni_id)?;
        let associated = self
            .trunk_associations
            .values()
            .any(|a| a.trunk_id == eni_id || a.branch_id == eni_id);
        if eni.attachment.is_some() || associated {
            return Err(Ec2Error::new(
                "InvalidNetworkInterface.InUse",
                format!("The network interface '{eni_id}' is currently in use."),
            ));
        }
        let eni = self.enis.remove(eni_id).expect("checked");
        let subnet = self
            .subnets
            .get_mut(&eni.subnet_id)
            .expect("ENIs live in subnets");
        for addr in eni.addresses() {
            subnet.release(addr);
        }
        for prefix in eni.prefixes {
            subnet.release_prefix(prefix);
        }
        Ok(())
    }

    /// `AssociateTrunkInterface`: `branch` (an unattached ENI of the
    /// trunk's VPC, in no other association) on `vlan_id` of `trunk`, which
    /// no other branch of it uses. Returns the association.
    pub fn associate_trunk(
        &mut self,
        branch_id: &str,
        trunk_id: &str,
        vlan_id: u16,
    ) -> Ec2Result<TrunkAssociation> {
        let trunk = self.eni(trunk_id)?;
        if trunk.interface_type != InterfaceType::Trunk {
            return Err(Ec2Error::invalid_value(format!(
                "The network interface '{trunk_id}' is not a trunk interface"
            )));
        }
        let branch = self.eni(branch_id)?;
        if branch.interface_type != InterfaceType::Interface || branch.attachment.is_some() {
            return Err(Ec2Error::invalid_value(format!(
                "The network interface '{branch_id}' cannot be a branch interface: it is a trunk or attached"
            )));
        }
        if branch.vpc_id != trunk.vpc_id {
            return Err(Ec2Error::invalid_value(format!(
                "The branch interface '{branch_id}' and the trunk interface '{trunk_id}' are in different VPCs"
            )));
        }
        if !VLAN_IDS.contains(&vlan_id) {
            return Err(Ec2Error::invalid_value(format!(
                "Value ({vlan_id}) for parameter vlanId is invalid: 1 to 4094"
            )));
        }
        for association in self.trunk_associations.values() {
            if association.branch_id == branch_id {
                return Err(Ec2Error::new(
                    "InvalidNetworkInterface.InUse",
                    format!(
                        "The network interface '{branch_id}' is already associated ({})",
                        association.id
                    ),
                ));
            }
            if association.trunk_id == trunk_id && association.vlan_id == vlan_id {
                return Err(Ec2Error::invalid_value(format!(
                    "VLAN {vlan_id} of trunk interface '{trunk_id}' is in use by '{}'",
                    association.branch_id
                )));
            }
        }
        let association = TrunkAssociation {
            id: self.new_id("trunk-assoc"),
            branch_id: branch_id.to_owned(),
            trunk_id: trunk_id.to_owned(),
            vlan_id,
        };
        self.trunk_associations
            .insert(association.id.clone(), association.clone());
        Ok(association)
    }

    /// `DisassociateTrunkInterface`.
    pub fn disassociate_trunk(&mut self, association_id: &str) -> Ec2Result<TrunkAssociation> {
        self.trunk_associations
            .remove(association_id)
            .ok_or_else(|| {
                Ec2Error::new(
                    "InvalidAssociationID.NotFound",
                    format!("The association ID '{association_id}' does not exist"),
                )
            })
    }

    /// Every trunk association, by id.
    pub fn trunk_associations(&self) -> impl Iterator<Item = &TrunkAssociation> {
        self.trunk_associations.values()
    }

    /// `AttachNetworkInterface`: returns the attachment id; the attachment
    /// is `attaching` until [`Self::complete_attach`].
    pub fn attach(
        &mut self,
        eni_id: &str,
        instance_id: &str,
        device_index: u32,
        network_card_index: u32,
        now_ms: u64,
    ) -> Ec2Result<String> {
        let eni = self.eni(eni_id)?;
        let instance = self.instance(instance_id)?;
        if instance.state != InstanceState::Running {
            return Err(Ec2Error::new(
                "IncorrectInstanceState",
                format!("The instance '{instance_id}' is not in a valid state for this operation."),
            ));
        }
        // A branch reaches the instance through its trunk, never attached.
        if eni.attachment.is_some()
            || self
                .trunk_associations
                .values()
                .any(|a| a.branch_id == eni_id)
        {
            return Err(Ec2Error::new(
                "InvalidNetworkInterface.InUse",
                format!("Interface: [{eni_id}] in use."),
            ));
        }
        if eni.availability_zone != instance.availability_zone {
            return Err(Ec2Error::invalid_value(format!(
                "The network interface '{eni_id}' is in {} and the instance '{instance_id}' in {}.",
                eni.availability_zone, instance.availability_zone
            )));
        }
        if eni.vpc_id != instance.vpc_id {
            return Err(Ec2Error::invalid_value(format!(
                "The network interface '{eni_id}' is not in the instance's VPC."
            )));
        }
        let ty = Self::instance_type_of(instance);
        let Some(card_max) = ty.max_enis_on_card(network_card_index) else {
            return Err(Ec2Error::invalid_value(format!(
                "Network card index {network_card_index} is out of range for {} (it has {} network cards).",
                ty.name,
                ty.network_cards.len()
            )));
        };
        let theirs: Vec<&Attachment> = self
            .enis
            .values()
            .filter_map(|e| e.attachment.as_ref())
            .filter(|a| a.instance_id == instance_id)
            .collect();
        if theirs
            .iter()
            .any(|a| a.device_index == device_index && a.network_card_index == network_card_index)
        {
            return Err(Ec2Error::invalid_value(format!(
                "Instance '{instance_id}' already has an interface attached at device index '{device_index}'."
            )));
        }
        let count = theirs.len() + 1;
        if count > ty.max_enis as usize {
            return Err(Ec2Error::new(
                "AttachmentLimitExceeded",
                format!("Interface count {count} exceeds the limit for {}", ty.name),
            ));
        }
        let on_card = theirs
            .iter()
            .filter(|a| a.network_card_index == network_card_index)
            .count()
            + 1;
        if on_card > card_max as usize {
            return Err(Ec2Error::new(
                "AttachmentLimitExceeded",
                format!(
                    "Interface count {on_card} exceeds the limit of network card {network_card_index} for {}",
                    ty.name
                ),
            ));
        }
        Self::check_slots(ty.ipv4_per_eni, eni.slots(), 0)?;
        let id = self.new_id("eni-attach");
        let eni = self.enis.get_mut(eni_id).expect("checked");
        eni.status = EniStatus::InUse;
        eni.attachment = Some(Attachment {
            id: id.clone(),
            instance_id: instance_id.to_owned(),
            device_index,
            network_card_index,
            status: AttachmentStatus::Attaching,
            // ENIs attached after launch keep theirs unless told otherwise.
            delete_on_termination: false,
            attach_time_ms: now_ms,
        });
        Ok(id)
    }

    /// The attachment delay is over: `attaching` becomes `attached`.
    /// Returns the ENI, or `None` if the attachment is gone meanwhile.
    pub fn complete_attach(&mut self, attachment_id: &str) -> Option<String> {
        let eni = self.enis.values_mut().find(|eni| {
            eni.attachment
                .as_ref()
                .is_some_and(|a| a.id == attachment_id && a.status == AttachmentStatus::Attaching)
        })?;
        eni.attachment.as_mut().expect("found").status = AttachmentStatus::Attached;
        Some(eni.id.clone())
    }

    /// `DetachNetworkInterface`: the attachment is `detaching` until
    /// [`Self::complete_detach`]. The primary ENI cannot be detached.
    pub fn detach(&mut self, attachment_id: &str, _force: bool) -> Ec2Result<String> {
        let eni = self.eni_by_attachment(attachment_id)?;
        let attachment = eni.attachment.as_ref().expect("found by it");
        if attachment.device_index == 0 {
            return Err(Ec2Error::new(
                "OperationNotPermitted",
                format!(
                    "The network interface at device index 0 cannot be detached (attachment '{attachment_id}')."
                ),
            ));
        }
        if attachment.status == AttachmentStatus::Detaching {
            return Err(Ec2Error::new(
                "IncorrectState",
                format!("The attachment '{attachment_id}' is already detaching."),
            ));
        }
        let eni_id = eni.id.clone();
        let eni = self.enis.get_mut(&eni_id).expect("found");
        eni.attachment.as_mut().expect("found").status = AttachmentStatus::Detaching;
        Ok(eni_id)
    }

    /// The detachment is over: the ENI is `available`, without attachment.
    pub fn complete_detach(&mut self, attachment_id: &str) -> Option<String> {
        let eni = self.enis.values_mut().find(|eni| {
            eni.attachment
                .as_ref()
                .is_some_and(|a| a.id == attachment_id && a.status == AttachmentStatus::Detaching)
        })?;
        eni.attachment = None;
        eni.status = EniStatus::Available;
        Some(eni.id.clone())
    }

    /// `AssignPrivateIpAddresses`: returns what was assigned.
    pub fn assign(
        &mut self,
        eni_id: &str,
        request: &Assign,
    ) -> Ec2Result<(Vec<Ipv4Addr>, Vec<Ipv4Net>)> {
        let eni = self.eni(eni_id)?;
        let wants_addresses = request.secondary_count.is_some() || !request.addresses.is_empty();
        let wants_prefixes = request.prefix_count.is_some() || !request.prefixes.is_empty();
        if request.secondary_count.is_some() && !request.addresses.is_empty() {
            return Err(Ec2Error::combination(
                "You may specify secondaryPrivateIpAddressCount or specific secondary private IP addresses, but not both.",
            ));
        }
        if request.prefix_count.is_some() && !request.prefixes.is_empty() {
            return Err(Ec2Error::combination(
                "You may specify ipv4PrefixCount or specific IPv4 prefixes, but not both.",
            ));
        }
        if wants_addresses && wants_prefixes {
            return Err(Ec2Error::combination(
                "You cannot assign secondary private IPv4 addresses and IPv4 prefixes in the same request.",
            ));
        }
        if !wants_addresses && !wants_prefixes {
            return Err(Ec2Error::missing(
                "secondaryPrivateIpAddressCount, privateIpAddress, ipv4PrefixCount or ipv4Prefix",
            ));
        }
        for (name, count) in [
            ("SecondaryPrivateIpAddressCount", request.secondary_count),
            ("Ipv4PrefixCount", request.prefix_count),
        ] {
            if count == Some(0) {
                return Err(Ec2Error::invalid_value(format!(
                    "Value (0) for parameter {name} is invalid. It must be at least 1."
                )));
            }
        }
        let subnet = &self.subnets[&eni.subnet_id];
        let more = request
            .secondary_count
            .map_or(request.addresses.len(), |n| n as usize)
            + request
                .prefix_count
                .map_or(request.prefixes.len(), |n| n as usize);
        Self::check_slots(self.slot_limit(eni), eni.slots(), more)?;
        for (i, addr) in request.addresses.iter().enumerate() {
            if request.addresses[..i].contains(addr) {
                return Err(Ec2Error::invalid_value(format!(
                    "Address {addr} given twice"
                )));
            }
            Self::check_free(subnet, *addr)?;
        }
        Self::check_prefixes(subnet, &request.prefixes)?;
        let subnet_id = eni.subnet_id.clone();
        let addresses = match request.secondary_count {
            Some(n) => self.pick_addresses(&subnet_id, n as usize)?,
            None => request.addresses.clone(),
        };
        let prefixes = match request.prefix_count {
            Some(n) => self.pick_prefixes(&subnet_id, n as usize)?,
            None => request.prefixes.clone(),
        };
        let occupant = Occupant::Eni(eni_id.to_owned());
        let subnet = self.subnets.get_mut(&subnet_id).expect("exists");
        for addr in &addresses {
            subnet.occupy(*addr, occupant.clone());
        }
        for prefix in &prefixes {
            subnet.occupy_prefix(*prefix, &occupant);
        }
        let eni = self.enis.get_mut(eni_id).expect("checked");
        eni.secondary_ips.extend(&addresses);
        eni.prefixes.extend(&prefixes);
        Ok((addresses, prefixes))
    }

    /// `UnassignPrivateIpAddresses`.
    pub fn unassign(
        &mut self,
        eni_id: &str,
        addresses: &[Ipv4Addr],
        prefixes: &[Ipv4Net],
    ) -> Ec2Result<()> {
        let eni = self.eni(eni_id)?;
        if addresses.is_empty() && prefixes.is_empty() {
            return Err(Ec2Error::missing("privateIpAddress or ipv4Prefix"));
        }
        for addr in addresses {
            if *addr == eni.primary_ip {
                return Err(Ec2Error::invalid_value(format!(
                    "The primary private IP address {addr} of '{eni_id}' cannot be unassigned."
                )));
            }
            if !eni.secondary_ips.contains(addr) {
                return Err(Ec2Error::invalid_value(format!(
                    "Some of the specified addresses are not assigned to interface {eni_id}"
                )));
            }
        }
        for prefix in prefixes {
            if !eni.prefixes.contains(prefix) {
                return Err(Ec2Error::invalid_value(format!(
                    "Some of the specified prefixes are not assigned to interface {eni_id}"
                )));
            }
        }
        let subnet_id = eni.subnet_id.clone();
        let eni = self.enis.get_mut(eni_id).expect("checked");
        eni.secondary_ips.retain(|a| !addresses.contains(a));
        eni.prefixes.retain(|p| !prefixes.contains(p));
        let subnet = self.subnets.get_mut(&subnet_id).expect("exists");
        for addr in addresses {
            subnet.release(*addr);
        }
        for prefix in prefixes {
            subnet.release_prefix(*prefix);
        }
        Ok(())
    }

    /// `ModifyNetworkInterfaceAttribute` (one attribute a call, as EC2).
    pub fn modify(&mut self, eni_id: &str, change: Modify) -> Ec2Result<()> {
        self.eni(eni_id)?;
        if let Modify::Groups(groups) = &change {
            if groups.is_empty() {
                return Err(Ec2Error::missing("groupId"));
            }
            self.check_groups(groups)?;
        }
        let eni = self.eni_mut(eni_id)?;
        match change {
            Modify::DeleteOnTermination {
                attachment_id,
                value,
            } => match eni.attachment.as_mut() {
                Some(a) if a.id == attachment_id => a.delete_on_termination = value,
                _ => {
                    return Err(Ec2Error::new(
                        "InvalidAttachmentID.NotFound",
                        format!(
                            "The attachment ID '{attachment_id}' does not exist for '{eni_id}'"
                        ),
                    ));
                }
            },
            Modify::SourceDestCheck(value) => eni.source_dest_check = value,
            Modify::Groups(groups) => eni.groups = groups,
            Modify::Description(text) => eni.description = text,
        }
        Ok(())
    }

    /// The tags of resource `id` (ENI, instance, subnet, VPC).
    fn tags_mut(&mut self, id: &str) -> Ec2Result<&mut BTreeMap<String, String>> {
        if id.starts_with("eni-") {
            return Ok(&mut self.eni_mut(id)?.tags);
        }
        if id.starts_with("i-") {
            self.instance(id)?;
            return Ok(&mut self.instances.get_mut(id).expect("checked").tags);
        }
        if id.starts_with("subnet-") {
            self.subnet(id)?;
            return Ok(&mut self.subnets.get_mut(id).expect("checked").tags);
        }
        Err(Ec2Error::new(
            "InvalidID",
            format!("The ID '{id}' is not valid"),
        ))
    }

    /// `CreateTags`: all resources or none.
    pub fn create_tags(
        &mut self,
        resources: &[String],
        tags: &BTreeMap<String, String>,
    ) -> Ec2Result<()> {
        if resources.is_empty() {
            return Err(Ec2Error::missing("resourceIdSet"));
        }
        for id in resources {
            self.tags_mut(id)?;
        }
        for id in resources {
            self.tags_mut(id)?.extend(tags.clone());
        }
        Ok(())
    }

    /// `DeleteTags`: a tag goes if its key matches and, when a value is
    /// given, its value too.
    pub fn delete_tags(
        &mut self,
        resources: &[String],
        tags: &[(String, Option<String>)],
    ) -> Ec2Result<()> {
        if resources.is_empty() {
            return Err(Ec2Error::missing("resourceIdSet"));
        }
        for id in resources {
            self.tags_mut(id)?;
        }
        for id in resources {
            let existing = self.tags_mut(id)?;
            if tags.is_empty() {
                existing.clear();
            }
            for (key, value) in tags {
                if value.as_ref().is_none_or(|v| existing.get(key) == Some(v)) {
                    existing.remove(key);
                }
            }
        }
        Ok(())
    }

    // ---- the lab's levers (admin API) ----------------------------------

    /// Marks addresses and prefixes of a subnet as used by instances the
    /// emulator does not model (to fragment a subnet, or fill it).
    pub fn occupy(
        &mut self,
        subnet_id: &str,
        addresses: &[Ipv4Addr],
        prefixes: &[Ipv4Net],
    ) -> Ec2Result<()> {
        let subnet = self.subnet(subnet_id)?;
        for addr in addresses {
            Self::check_free(subnet, *addr)?;
        }
        Self::check_prefixes(subnet, prefixes)?;
        let subnet = self.subnets.get_mut(subnet_id).expect("checked");
        for addr in addresses {
            subnet.occupy(*addr, Occupant::Other);
        }
        for prefix in prefixes {
            subnet.occupy_prefix(*prefix, &Occupant::Other);
        }
        Ok(())
    }

    /// An ENI left behind by a crashed agent: available, tagged.
    pub fn create_leaked_eni(
        &mut self,
        subnet_id: &str,
        tags: BTreeMap<String, String>,
        secondary_count: u32,
    ) -> Ec2Result<String> {
        self.create_eni(CreateEni {
            subnet_id: subnet_id.to_owned(),
            description: "aws-K8S-i-leaked".to_owned(),
            tags,
            secondary_count: (secondary_count > 0).then_some(secondary_count),
            ..CreateEni::default()
        })
    }

    /// Everything, for the admin API.
    pub fn snapshot(&self) -> StateSnapshot {
        StateSnapshot {
            vpc: self.vpc.clone(),
            subnets: self
                .subnets
                .values()
                .map(|s| SubnetView {
                    id: s.id.clone(),
                    cidr: s.cidr,
                    availability_zone: s.availability_zone.clone(),
                    available_ip_address_count: s.available_ip_address_count(),
                    free_prefix_count: s.free_prefix_count(),
                    occupied_by_others: s.occupied_by_others(),
                    tags: s.tags.clone(),
                })
                .collect(),
            enis: self.enis.values().cloned().collect(),
            instances: self.instances.values().cloned().collect(),
            trunk_associations: self.trunk_associations.values().cloned().collect(),
        }
    }
}

/// A subnet as the admin API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubnetView {
    pub id: String,
    pub cidr: Ipv4Net,
    pub availability_zone: String,
    pub available_ip_address_count: usize,
    pub free_prefix_count: usize,
    pub occupied_by_others: usize,
    pub tags: BTreeMap<String, String>,
}

/// The whole state as the admin API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateSnapshot {
    pub vpc: Vpc,
    pub subnets: Vec<SubnetView>,
    pub enis: Vec<Eni>,
    pub instances: Vec<Instance>,
    #[serde(default)]
    pub trunk_associations: Vec<TrunkAssociation>,
}

impl StateSnapshot {
    /// The ENI `id`.
    pub fn eni(&self, id: &str) -> Option<&Eni> {
        self.enis.iter().find(|e| e.id == id)
    }

    /// The subnet `id`.
    pub fn subnet(&self, id: &str) -> Option<&SubnetView> {
        self.subnets.iter().find(|s| s.id == id)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::ec2::config::{LAB_CUSTOM_SUBNET_ID, LAB_NODE_SUBNET_ID, LAB_PEER_SUBNET_ID};

    const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 20, 11, 162);

    fn state() -> Ec2State {
        Ec2State::new(&Config::lab())
    }

    fn node(state: &mut Ec2State, ty: &str) -> String {
        state
            .run_instance(
                ty,
                "ami-0123456789abcdef0",
                LAB_NODE_SUBNET_ID,
                Some(NODE_IP),
                vec![],
                0,
            )
            .unwrap()
    }

    fn eni(state: &mut Ec2State) -> String {
        state
            .create_eni(CreateEni {
                subnet_id: LAB_NODE_SUBNET_ID.into(),
                ..CreateEni::default()
            })
            .unwrap()
    }

    fn attach(state: &mut Ec2State, eni: &str, instance: &str, device: u32) -> Ec2Result<String> {
        let id = state.attach(eni, instance, device, 0, 0)?;
        state.complete_attach(&id);
        Ok(id)
    }

    fn count(n: u32) -> Assign {
        Assign {
            secondary_count: Some(n),
            ..Assign::default()
        }
    }

    fn prefixes(n: u32) -> Assign {
        Assign {
            prefix_count: Some(n),
            ..Assign::default()
        }
    }

    #[test]
    fn run_instances_makes_the_primary_eni_with_the_lab_mac() {
        let mut s = state();
        let id = node(&mut s, "m5.large");
        let instance = s.instance(&id).unwrap().clone();
        let primary = s.eni(&instance.primary_eni).unwrap();
        assert_eq!(primary.primary_ip, NODE_IP);
        assert_eq!(primary.mac, crate::addrs::NODE_ETH0_MAC);
        let a = primary.attachment.as_ref().unwrap();
        assert_eq!((a.device_index, a.status), (0, AttachmentStatus::Attached));
        assert_eq!(s.instance_by_address(NODE_IP).unwrap().id, id);
        assert!(is_well_formed_id("i", &id) && is_well_formed_id("eni", &primary.id));
        assert_eq!(
            s.run_instance("m5.huge", "ami-1", LAB_NODE_SUBNET_ID, None, vec![], 0)
                .unwrap_err()
                .code,
            "InvalidParameterValue"
        );
        assert_eq!(
            s.run_instance(
                "m5.large",
                "ami-1",
                LAB_NODE_SUBNET_ID,
                Some(NODE_IP),
                vec![],
                0
            )
            .unwrap_err()
            .code,
            "InvalidIPAddress.InUse"
        );
    }

    #[test]
    fn eni_limit_per_instance_type() {
        for (ty, max) in [
            ("m5.large", 3),
            ("m5.xlarge", 4),
            ("t3.small", 3),
            ("m5.4xlarge", 8),
        ] {
            let mut s = state();
            let instance = node(&mut s, ty);
            for device in 1..max {
                let e = eni(&mut s);
                attach(&mut s, &e, &instance, device).unwrap();
            }
            let e = eni(&mut s);
            let err = attach(&mut s, &e, &instance, max).unwrap_err();
            assert_eq!(err.code, "AttachmentLimitExceeded", "{ty}");
            assert_eq!(s.attached_enis(&instance).len(), max as usize);
        }
    }

    #[test]
    fn attach_rules_device_index_in_use_and_cards() {
        let mut s = state();
        let instance = node(&mut s, "p4d.24xlarge");
        let a = eni(&mut s);
        let b = eni(&mut s);
        attach(&mut s, &a, &instance, 1).unwrap();
        assert_eq!(
            attach(&mut s, &a, &instance, 2).unwrap_err().code,
            "InvalidNetworkInterface.InUse"
        );
        assert_eq!(
            attach(&mut s, &b, &instance, 1).unwrap_err().code,
            "InvalidParameterValue"
        );
        // The same device index on another card is fine.
        s.attach(&b, &instance, 1, 3, 0).unwrap();
        let c = eni(&mut s);
        assert_eq!(
            s.attach(&c, &instance, 1, 4, 0).unwrap_err().code,
            "InvalidParameterValue"
        );
        assert_eq!(
            s.delete_eni(&a).unwrap_err().code,
            "InvalidNetworkInterface.InUse"
        );
        assert_eq!(
            attach(&mut s, &c, "i-0123456789abcdef0", 2)
                .unwrap_err()
                .code,
            "InvalidInstanceID.NotFound"
        );
        assert_eq!(
            attach(&mut s, "eni-nothex", &instance, 2).unwrap_err().code,
            "InvalidNetworkInterfaceID.Malformed"
        );
        assert_eq!(
            attach(&mut s, "eni-0123456789abcdef0", &instance, 2)
                .unwrap_err()
                .code,
            "InvalidNetworkInterfaceID.NotFound"
        );
    }

    #[test]
    fn attach_and_detach_go_through_their_transient_states() {
        let mut s = state();
        let instance = node(&mut s, "m5.large");
        let e = eni(&mut s);
        let attachment = s.attach(&e, &instance, 1, 0, 0).unwrap();
        assert_eq!(
            s.eni(&e).unwrap().attachment.as_ref().unwrap().status,
            AttachmentStatus::Attaching
        );
        assert_eq!(s.eni(&e).unwrap().status, EniStatus::InUse);
        assert_eq!(
            s.attached_enis(&instance).len(),
            1,
            "only the primary until attached"
        );
        assert_eq!(s.complete_attach(&attachment), Some(e.clone()));
        assert!(s.eni(&e).unwrap().is_attached());
        assert_eq!(s.detach(&attachment, false).unwrap(), e);
        assert_eq!(
            s.eni(&e).unwrap().attachment.as_ref().unwrap().status,
            AttachmentStatus::Detaching
        );
        assert_eq!(s.complete_detach(&attachment), Some(e.clone()));
        assert_eq!(s.eni(&e).unwrap().status, EniStatus::Available);
        assert!(s.eni(&e).unwrap().attachment.is_none());
        assert_eq!(
            s.detach(&attachment, false).unwrap_err().code,
            "InvalidAttachmentID.NotFound"
        );
        let primary = s.eni(&s.instance(&instance).unwrap().primary_eni).unwrap();
        let primary_attachment = primary.attachment.as_ref().unwrap().id.clone();
        assert_eq!(
            s.detach(&primary_attachment, true).unwrap_err().code,
            "OperationNotPermitted"
        );
        s.delete_eni(&e).unwrap();
        assert_eq!(
            s.eni(&e).unwrap_err().code,
            "InvalidNetworkInterfaceID.NotFound"
        );
    }

    #[test]
    fn ip_slots_per_type_count_the_primary() {
        for (ty, per_eni) in [
            ("m5.large", 10),
            ("t3.medium", 6),
            ("t3.small", 4),
            ("c5.18xlarge", 50),
        ] {
            let mut s = state();
            let instance = node(&mut s, ty);
            let primary = s.instance(&instance).unwrap().primary_eni.clone();
            s.assign(&primary, &count(per_eni - 1)).unwrap();
            let err = s.assign(&primary, &count(1)).unwrap_err();
            assert_eq!(err.code, "PrivateIpAddressLimitExceeded", "{ty}");
            assert_eq!(s.eni(&primary).unwrap().slots(), per_eni as usize);
        }
    }

    #[test]
    fn each_prefix_takes_one_slot() {
        let mut s = state();
        let instance = node(&mut s, "t3.medium");
        let primary = s.instance(&instance).unwrap().primary_eni.clone();
        let (_, got) = s.assign(&primary, &prefixes(5)).unwrap();
        assert_eq!(got.len(), 5);
        assert_eq!(
            s.assign(&primary, &prefixes(1)).unwrap_err().code,
            "PrivateIpAddressLimitExceeded"
        );
        assert_eq!(
            s.assign(&primary, &count(1)).unwrap_err().code,
            "PrivateIpAddressLimitExceeded"
        );
        s.unassign(&primary, &[], &got[..1]).unwrap();
        s.assign(&primary, &count(1)).unwrap();
    }

    #[test]
    fn random_addresses_avoid_reserved_and_used_ones() {
        let mut s = state();
        // The peer subnet (10.20.12.0/24): 251 usable addresses.
        let subnet = s.subnet(LAB_PEER_SUBNET_ID).unwrap().clone();
        assert_eq!(subnet.available_ip_address_count(), 251);
        let taken = [Ipv4Addr::new(10, 20, 12, 50), Ipv4Addr::new(10, 20, 12, 4)];
        s.occupy(LAB_PEER_SUBNET_ID, &taken, &[]).unwrap();
        let mut seen = BTreeSet::new();
        for _ in 0..249 {
            let e = s
                .create_eni(CreateEni {
                    subnet_id: LAB_PEER_SUBNET_ID.into(),
                    ..CreateEni::default()
                })
                .unwrap();
            let addr = s.eni(&e).unwrap().primary_ip;
            assert!(
                !subnet.is_reserved(addr) && subnet.cidr.contains(&addr),
                "{addr}"
            );
            assert!(!taken.contains(&addr), "{addr}");
            assert!(seen.insert(addr), "{addr} handed out twice");
        }
        assert_eq!(
            s.subnet(LAB_PEER_SUBNET_ID)
                .unwrap()
                .available_ip_address_count(),
            0
        );
        let err = s
            .create_eni(CreateEni {
                subnet_id: LAB_PEER_SUBNET_ID.into(),
                ..CreateEni::default()
            })
            .unwrap_err();
        assert_eq!(err.code, "InsufficientFreeAddressesInSubnet");
        for reserved in [0, 1, 2, 3, 255] {
            assert!(!seen.contains(&Ipv4Addr::new(10, 20, 12, reserved)));
        }
    }

    #[test]
    fn picks_are_random_but_reproducible() {
        let picks = |seed| {
            let mut config = Config::lab();
            config.seed = seed;
            let mut s = Ec2State::new(&config);
            let instance = node(&mut s, "c5.18xlarge");
            let primary = s.instance(&instance).unwrap().primary_eni.clone();
            s.assign(&primary, &count(10)).unwrap().0
        };
        assert_eq!(picks(7), picks(7));
        assert_ne!(picks(7), picks(8));
        let got = picks(7);
        let mut sorted = got.clone();
        sorted.sort();
        assert_ne!(got, sorted, "not handed out in order");
    }

    #[test]
    fn prefixes_are_aligned_free_28s() {
        let mut s = state();
        let instance = node(&mut s, "c5.18xlarge");
        let primary = s.instance(&instance).unwrap().primary_eni.clone();
        // A /24 has 16 blocks; the first holds the reserved .0-.3, the last
        // .255, the one of .160 the node's .162: 13 are free.
        let (_, got) = s.assign(&primary, &prefixes(13)).unwrap();
        assert_eq!(got.len(), 13);
        for prefix in &got {
            assert_eq!(prefix.prefix_len(), 28);
            assert_eq!(u32::from(prefix.network()) % 16, 0);
            assert!(!prefix.contains(&NODE_IP));
            assert_ne!(prefix.network(), Ipv4Addr::new(10, 20, 11, 0));
            assert_ne!(prefix.network(), Ipv4Addr::new(10, 20, 11, 240));
        }
        assert_eq!(
            s.assign(&primary, &prefixes(1)).unwrap_err().code,
            "InsufficientCidrBlocks"
        );
    }

    #[test]
    fn fragmentation_leaves_addresses_but_no_block() {
        let mut s = state();
        let instance = node(&mut s, "c5.18xlarge");
        let primary = s.instance(&instance).unwrap().primary_eni.clone();
        // One address used in every /28 of the node subnet.
        let used: Vec<Ipv4Addr> = (0..16u8)
            .map(|block| Ipv4Addr::new(10, 20, 11, block * 16 + 7))
            .filter(|a| *a != Ipv4Addr::new(10, 20, 11, 167))
            .collect();
        s.occupy(LAB_NODE_SUBNET_ID, &used, &[]).unwrap();
        let subnet = s.subnet(LAB_NODE_SUBNET_ID).unwrap();
        assert!(subnet.available_ip_address_count() > 200);
        assert_eq!(subnet.free_prefix_count(), 0);
        let err = s.assign(&primary, &prefixes(1)).unwrap_err();
        assert_eq!(err.code, "InsufficientCidrBlocks");
        // Addresses are still there.
        s.assign(&primary, &count(5)).unwrap();
    }

    #[test]
    fn explicit_addresses_and_prefixes_are_checked() {
        let mut s = state();
        let instance = node(&mut s, "c5.18xlarge");
        let primary = s.instance(&instance).unwrap().primary_eni.clone();
        let ask = |addrs: &[Ipv4Addr]| Assign {
            addresses: addrs.to_vec(),
            ..Assign::default()
        };
        let code = |s: &mut Ec2State, a: Assign| s.assign(&primary, &a).unwrap_err().code;
        assert_eq!(code(&mut s, ask(&[NODE_IP])), "InvalidIPAddress.InUse");
        assert_eq!(
            code(&mut s, ask(&[Ipv4Addr::new(10, 20, 11, 2)])),
            "InvalidParameterValue"
        );
        assert_eq!(
            code(&mut s, ask(&[Ipv4Addr::new(10, 20, 12, 9)])),
            "InvalidParameterValue"
        );
        let prefix = |p: &str| Assign {
            prefixes: vec![p.parse().unwrap()],
            ..Assign::default()
        };
        assert_eq!(
            code(&mut s, prefix("10.20.11.8/28")),
            "InvalidParameterValue"
        );
        assert_eq!(
            code(&mut s, prefix("10.20.11.0/28")),
            "InvalidIPAddress.InUse"
        );
        assert_eq!(
            code(&mut s, prefix("10.20.11.160/28")),
            "InvalidIPAddress.InUse"
        );
        s.assign(&primary, &prefix("10.20.11.32/28")).unwrap();
        assert_eq!(
            code(&mut s, ask(&[Ipv4Addr::new(10, 20, 11, 40)])),
            "InvalidIPAddress.InUse"
        );
        let both = Assign {
            secondary_count: Some(1),
            prefix_count: Some(1),
            ..Assign::default()
        };
        assert_eq!(code(&mut s, both), "InvalidParameterCombination");
        assert_eq!(code(&mut s, Assign::default()), "MissingParameter");
        s.assign(&primary, &ask(&[Ipv4Addr::new(10, 20, 11, 99)]))
            .unwrap();
        let err = s.unassign(&primary, &[NODE_IP], &[]).unwrap_err();
        assert_eq!(err.code, "InvalidParameterValue");
        let err = s
            .unassign(&primary, &[Ipv4Addr::new(10, 20, 11, 98)], &[])
            .unwrap_err();
        assert_eq!(err.code, "InvalidParameterValue");
        s.unassign(
            &primary,
            &[Ipv4Addr::new(10, 20, 11, 99)],
            &["10.20.11.32/28".parse().unwrap()],
        )
        .unwrap();
        assert_eq!(s.eni(&primary).unwrap().slots(), 1);
        assert_eq!(
            s.subnet(LAB_NODE_SUBNET_ID)
                .unwrap()
                .available_ip_address_count(),
            250
        );
    }

    #[test]
    fn unattached_enis_take_up_to_50_and_attach_checks_the_type() {
        let mut s = state();
        let instance = node(&mut s, "t3.small");
        let e = s
            .create_eni(CreateEni {
                subnet_id: LAB_CUSTOM_SUBNET_ID.into(),
                secondary_count: Some(49),
                ..CreateEni::default()
            })
            .unwrap();
        assert_eq!(s.eni(&e).unwrap().slots(), 50);
        assert_eq!(
            s.assign(&e, &count(1)).unwrap_err().code,
            "PrivateIpAddressLimitExceeded"
        );
        assert_eq!(
            attach(&mut s, &e, &instance, 1).unwrap_err().code,
            "PrivateIpAddressLimitExceeded"
        );
        let err = s
            .create_eni(CreateEni {
                subnet_id: LAB_NODE_SUBNET_ID.into(),
                secondary_count: Some(1),
                prefix_count: Some(1),
                ..CreateEni::default()
            })
            .unwrap_err();
        assert_eq!(err.code, "InvalidParameterCombination");
        let err = s
            .create_eni(CreateEni {
                subnet_id: "subnet-0123456789abcdef0".into(),
                ..CreateEni::default()
            })
            .unwrap_err();
        assert_eq!(err.code, "InvalidSubnetID.NotFound");
        let err = s
            .create_eni(CreateEni {
                subnet_id: LAB_NODE_SUBNET_ID.into(),
                groups: vec!["sg-0123456789abcdef0".into()],
                ..CreateEni::default()
            })
            .unwrap_err();
        assert_eq!(err.code, "InvalidGroup.NotFound");
    }

    #[test]
    fn a_failed_create_takes_nothing() {
        let mut s = state();
        let before = s
            .subnet(LAB_NODE_SUBNET_ID)
            .unwrap()
            .available_ip_address_count();
        let used: Vec<Ipv4Addr> = (0..16u8)
            .map(|b| Ipv4Addr::new(10, 20, 11, b * 16 + 5))
            .collect();
        s.occupy(LAB_NODE_SUBNET_ID, &used, &[]).unwrap();
        let err = s
            .create_eni(CreateEni {
                subnet_id: LAB_NODE_SUBNET_ID.into(),
                prefix_count: Some(1),
                ..CreateEni::default()
            })
            .unwrap_err();
        assert_eq!(err.code, "InsufficientCidrBlocks");
        assert_eq!(s.enis().count(), 0);
        assert_eq!(
            s.subnet(LAB_NODE_SUBNET_ID)
                .unwrap()
                .available_ip_address_count(),
            before - 16
        );
    }

    #[test]
    fn terminate_deletes_or_detaches() {
        let mut s = state();
        let instance = node(&mut s, "m5.large");
        let kept = eni(&mut s);
        let gone = eni(&mut s);
        attach(&mut s, &kept, &instance, 1).unwrap();
        let attachment = attach(&mut s, &gone, &instance, 2).unwrap();
        s.modify(
            &gone,
            Modify::DeleteOnTermination {
                attachment_id: attachment,
                value: true,
            },
        )
        .unwrap();
        assert_eq!(
            s.terminate_instance(&instance).unwrap(),
            InstanceState::Running
        );
        assert_eq!(s.enis().count(), 1);
        assert_eq!(s.eni(&kept).unwrap().status, EniStatus::Available);
        assert!(s.instance_by_address(NODE_IP).is_none());
        assert_eq!(
            s.instance(&instance).unwrap().state,
            InstanceState::Terminated
        );
    }

    #[test]
    fn tags_and_modify() {
        let mut s = state();
        let e = eni(&mut s);
        let tags = BTreeMap::from([
            ("a".to_owned(), "1".to_owned()),
            ("b".to_owned(), "2".to_owned()),
        ]);
        s.create_tags(std::slice::from_ref(&e), &tags).unwrap();
        s.delete_tags(
            std::slice::from_ref(&e),
            &[("a".into(), Some("other".into())), ("b".into(), None)],
        )
        .unwrap();
        assert_eq!(
            s.eni(&e).unwrap().tags,
            BTreeMap::from([("a".to_owned(), "1".to_owned())])
        );
        assert_eq!(
            s.create_tags(&["eni-0123456789abcdef0".into()], &tags)
                .unwrap_err()
                .code,
            "InvalidNetworkInterfaceID.NotFound"
        );
        s.modify(&e, Modify::SourceDestCheck(false)).unwrap();
        s.modify(
            &e,
            Modify::Groups(vec![crate::ec2::config::LAB_NODE_SG_ID.into()]),
        )
        .unwrap();
        assert!(!s.eni(&e).unwrap().source_dest_check);
        assert_eq!(
            s.modify(
                &e,
                Modify::DeleteOnTermination {
                    attachment_id: "eni-attach-01234567".into(),
                    value: true
                }
            )
            .unwrap_err()
            .code,
            "InvalidAttachmentID.NotFound"
        );
    }

    #[test]
    fn errors_carry_ec2_statuses() {
        assert_eq!(Ec2Error::new("RequestLimitExceeded", "").http_status(), 503);
        assert_eq!(Ec2Error::new("Unavailable", "").http_status(), 503);
        assert_eq!(Ec2Error::new("InternalError", "").http_status(), 500);
        assert_eq!(Ec2Error::invalid_value("").http_status(), 400);
    }
}
