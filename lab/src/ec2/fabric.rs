//! What EC2's changes do to the lab's network: an attached ENI gets a link
//! in the node and one on the VPC router, and every address and prefix an
//! ENI of the lab's node holds is delivered to that ENI's link by the
//! router (and accepted as a source from it), exactly while EC2 says so.
//!
//! The fabric reconciles: from the state it computes what the network must
//! look like ([`Desired`]) and changes only the difference from what it
//! did before. Only the lab's node instance (the one whose primary address
//! is 10.20.11.162) has a network; other instances are paper only.
//!
//! - Primary ENI (device 0): its router link is the lab's
//!   [`VPC_NODE_ETH0_LINK`], built with the lab; the fabric only delivers
//!   its secondary addresses and prefixes.
//! - ENI at device N ≥ 1: `eth<N>` in `vpcnet-node` with the ENI's MAC and
//!   MTU 9001, left down and without an address (configuring it is the
//!   agent's job, as ipamd's on EKS); its peer `n0-eth<N>` in `vpcnet-vpc`
//!   set up like the lab's static ENI links (the subnet gateway as a /32,
//!   up, proxy ARP, source/destination check). Detaching deletes the pair.
//! - A trunk ENI is such an ENI. Each branch ENI associated with it gets
//!   the router's side `n0-vlan<id>`, set up like an ENI's: where the
//!   kernel has 802.1Q, a VLAN of that id on the trunk's router link (the
//!   node's side, `vlan.eth.<id>`, is the node's job, as on EKS); elsewhere
//!   a veth whose node end is `vlan.eth.<id>`, made here, up, with the
//!   branch ENI's MAC. Disassociating deletes them.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use ipnet::Ipv4Net;
use tracing::{debug, info};
use vpcnet_api::vpc_cni::gateway_of;

use super::model::{AttachmentStatus, Ec2State};
use crate::{
    addrs::{
        NS_NODE, NS_VPC, VPC_MTU, VPC_NODE_ETH0_LINK, branch_link, eni_ifname, vpc_branch_link,
        vpc_branch_link_mac, vpc_eni_link, vpc_eni_link_mac,
    },
    error::{LabError, Result},
    netns::{ip_batch, set_sysctls},
    router::{self, Assignments, Removals},
    topology,
};

/// What one ENI of the lab's node needs from the network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredEni {
    pub device_index: u32,
    pub mac: String,
    /// The subnet's gateway (its network address + 1), the router's
    /// address on the ENI's link.
    pub gateway: Ipv4Addr,
    /// Every address, primary first.
    pub addresses: BTreeSet<Ipv4Addr>,
    pub prefixes: BTreeSet<Ipv4Net>,
}

/// What one branch ENI on a trunk of the lab's node needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredBranch {
    pub vlan_id: u16,
    /// The trunk's device index: its router link carries the VLAN.
    pub trunk_device_index: u32,
    pub mac: String,
    pub gateway: Ipv4Addr,
    pub address: Ipv4Addr,
}

/// The network as the state says it must be, by ENI id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Desired {
    pub enis: BTreeMap<String, DesiredEni>,
    /// Branch ENIs on trunks in [`Self::enis`], by branch ENI id.
    pub branches: BTreeMap<String, DesiredBranch>,
}

impl Desired {
    /// The ENIs of the instance that owns `node_addr` that are attached (or
    /// still detaching, as until EC2 has finished), plus `attaching` and
    /// less `detaching`: the attachment that completes now (its link must
    /// exist before EC2 says `attached`, and be gone before it says
    /// `available`).
    pub fn from_state(
        state: &Ec2State,
        node_addr: Ipv4Addr,
        attaching: Option<&str>,
        detaching: Option<&str>,
    ) -> Self {
        let Some(instance) = state.instance_by_address(node_addr) else {
            return Self::default();
        };
        let enis = state
            .enis()
            .filter_map(|eni| {
                let a = eni.attachment.as_ref()?;
                let present = match a.status {
                    AttachmentStatus::Attached => true,
                    AttachmentStatus::Detaching => detaching != Some(a.id.as_str()),
                    AttachmentStatus::Attaching => attaching == Some(a.id.as_str()),
                };
                if a.instance_id != instance.id || !present || a.network_card_index != 0 {
                    return None;
                }
                let subnet = state.subnet(&eni.subnet_id).ok()?;
                let gateway = gateway_of(subnet.cidr);
                Some((
                    eni.id.clone(),
                    DesiredEni {
                        device_index: a.device_index,
                        mac: eni.mac.clone(),
                        gateway,
                        addresses: eni.addresses().collect(),
                        prefixes: eni.prefixes.iter().copied().collect(),
                    },
                ))
            })
            .collect::<BTreeMap<_, _>>();
        let branches = state
            .trunk_associations()
            .filter_map(|association| {
                let trunk = enis.get(&association.trunk_id)?;
                let branch = state.eni(&association.branch_id).ok()?;
                let subnet = state.subnet(&branch.subnet_id).ok()?;
                Some((
                    branch.id.clone(),
                    DesiredBranch {
                        vlan_id: association.vlan_id,
                        trunk_device_index: trunk.device_index,
                        mac: branch.mac.clone(),
                        gateway: gateway_of(subnet.cidr),
                        address: branch.primary_ip,
                    },
                ))
            })
            .collect();
        Self { enis, branches }
    }
}

/// Something that makes the network match the state.
pub trait Fabric: Send {
    /// Changes the network to `desired`.
    fn apply(&mut self, desired: &Desired) -> Result<()>;
}

/// No network (wire tests, or an emulator outside the lab).
#[derive(Debug, Default)]
pub struct NoFabric;

impl Fabric for NoFabric {
    fn apply(&mut self, _desired: &Desired) -> Result<()> {
        Ok(())
    }
}

/// The lab's network: `vpcnet-node` and the VPC router in `vpcnet-vpc`.
#[derive(Debug, Default)]
pub struct LabFabric {
    /// What has been done, by ENI id.
    delivered: BTreeMap<String, DesiredEni>,
    /// Branch ENIs whose links exist, by branch ENI id.
    branches: BTreeMap<String, DesiredBranch>,
}

/// The router's link of the ENI at `device`.
fn router_link(device: u32) -> String {
    if device == 0 {
        VPC_NODE_ETH0_LINK.to_owned()
    } else {
        vpc_eni_link(device as usize)
    }
}

impl LabFabric {
    pub fn new() -> Self {
        Self::default()
    }

    /// Creates the ENI's link pair and sets up the router's side, like
    /// `topology::add_router_eni_links` does for the lab's static ENIs.
    fn create_link(eni: &DesiredEni) -> Result<()> {
        let device = eni.device_index as usize;
        let ifname = eni_ifname(device);
        let link = vpc_eni_link(device);
        info!(%ifname, %link, mac = %eni.mac, "attaching: creating the ENI's link");
        ip_batch(
            Some(NS_NODE),
            &[format!(
                "link add {ifname} address {mac} mtu {VPC_MTU} type veth peer name {link} address {vpc_mac} mtu {VPC_MTU} netns {NS_VPC}",
                mac = eni.mac,
                vpc_mac = vpc_eni_link_mac(device),
            )],
        )?;
        ip_batch(
            Some(NS_VPC),
            &[
                format!("addr add {}/32 dev {link}", eni.gateway),
                format!("link set {link} up"),
            ],
        )?;
        set_sysctls(NS_VPC, &[(&format!("net.ipv4.conf.{link}.proxy_arp"), "1")])?;
        router::add_eni_links(&[&link])
    }

    /// The router's side of a branch ENI, set up like an ENI link, and,
    /// without 802.1Q, the node's side too.
    fn create_branch_link(branch: &DesiredBranch) -> Result<()> {
        let vpc_link = vpc_branch_link(branch.vlan_id);
        let vpc_mac = vpc_branch_link_mac(branch.vlan_id);
        info!(%vpc_link, vlan_id = branch.vlan_id, mac = %branch.mac, "associated: the branch ENI's link");
        if topology::kernel_has_vlans() {
            ip_batch(
                Some(NS_VPC),
                &[topology::vlan_link_line(
                    &router_link(branch.trunk_device_index),
                    &vpc_link,
                    &vpc_mac,
                    branch.vlan_id,
                )],
            )?;
        } else {
            let link = branch_link(branch.vlan_id);
            ip_batch(
                Some(NS_NODE),
                &[
                    format!(
                        "link add {link} address {mac} mtu {VPC_MTU} type veth peer name {vpc_link} address {vpc_mac} mtu {VPC_MTU} netns {NS_VPC}",
                        mac = branch.mac,
                    ),
                    format!("link set {link} up"),
                ],
            )?;
        }
        ip_batch(
            Some(NS_VPC),
            &[
                format!("addr add {}/32 dev {vpc_link}", branch.gateway),
                format!("link set {vpc_link} up"),
            ],
        )?;
        set_sysctls(
            NS_VPC,
            &[(&format!("net.ipv4.conf.{vpc_link}.proxy_arp"), "1")],
        )?;
        router::add_eni_links(&[&vpc_link])
    }

    fn delete_branch_link(branch: &DesiredBranch) -> Result<()> {
        let vpc_link = vpc_branch_link(branch.vlan_id);
        info!(%vpc_link, "disassociated: deleting the branch ENI's link");
        router::remove_eni_links(&[&vpc_link])?;
        // The router's end, VLAN or veth, takes a veth's node end with it.
        // A trunk detached first took its VLANs along.
        if crate::netlink::link_exists(NS_VPC, &vpc_link)? {
            ip_batch(Some(NS_VPC), &[format!("link del {vpc_link}")])?;
        }
        Ok(())
    }

    /// Branch ENIs: links made for new ones (their trunk's link exists by
    /// now), deleted for gone ones, addresses delivered as for ENIs.
    fn apply_branches(
        &mut self,
        desired: &Desired,
        removals: &mut Removals,
        assignments: &mut Assignments,
    ) -> Result<()> {
        let gone: Vec<String> = self
            .branches
            .iter()
            .filter(|(id, had)| desired.branches.get(*id) != Some(*had))
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            let had = self.branches.remove(&id).expect("listed");
            removals.remove(&vpc_branch_link(had.vlan_id), &[had.address]);
            Self::delete_branch_link(&had)?;
        }
        for (id, want) in &desired.branches {
            if self.branches.contains_key(id) {
                continue;
            }
            Self::create_branch_link(want)?;
            assignments.add(&vpc_branch_link(want.vlan_id), &want.mac, &[want.address]);
            self.branches.insert(id.clone(), want.clone());
        }
        Ok(())
    }

    fn delete_link(eni: &DesiredEni) -> Result<()> {
        let device = eni.device_index as usize;
        let ifname = eni_ifname(device);
        let link = vpc_eni_link(device);
        info!(%ifname, %link, "detached: deleting the ENI's link");
        router::remove_eni_links(&[&link])?;
        // Deleting the node's end takes the router's end (and its routes and
        // neighbours) with it. The agent may have renamed or moved nothing:
        // the name is the contract.
        ip_batch(Some(NS_NODE), &[format!("link del {ifname}")])
    }
}

impl Fabric for LabFabric {
    fn apply(&mut self, desired: &Desired) -> Result<()> {
        let mut removals = Removals::default();
        let mut assignments = Assignments::default();
        let mut links_to_delete = Vec::new();
        // Gone (or moved to another device): take everything back.
        let gone: Vec<String> = self
            .delivered
            .iter()
            .filter(|(id, had)| {
                desired
                    .enis
                    .get(*id)
                    .is_none_or(|want| want.device_index != had.device_index)
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            let had = self.delivered.remove(&id).expect("listed");
            let link = router_link(had.device_index);
            removals.remove(&link, &had.addresses.iter().copied().collect::<Vec<_>>());
            for prefix in &had.prefixes {
                removals.remove_prefix(&link, *prefix);
            }
            if had.device_index != 0 {
                links_to_delete.push(had);
            }
        }
        for (id, want) in &desired.enis {
            let link = router_link(want.device_index);
            let had = if let Some(had) = self.delivered.get(id) {
                had.clone()
            } else {
                if want.device_index != 0 {
                    Self::create_link(want)?;
                }
                DesiredEni {
                    addresses: BTreeSet::new(),
                    prefixes: BTreeSet::new(),
                    ..want.clone()
                }
            };
            let added: Vec<Ipv4Addr> = want.addresses.difference(&had.addresses).copied().collect();
            let removed: Vec<Ipv4Addr> =
                had.addresses.difference(&want.addresses).copied().collect();
            assignments.add(&link, &want.mac, &added);
            removals.remove(&link, &removed);
            for prefix in want.prefixes.difference(&had.prefixes) {
                assignments.add_prefix(&link, &want.mac, *prefix);
            }
            for prefix in had.prefixes.difference(&want.prefixes) {
                removals.remove_prefix(&link, *prefix);
            }
            if !added.is_empty() || !removed.is_empty() || want.prefixes != had.prefixes {
                debug!(eni = %id, %link, added = added.len(), removed = removed.len(), "delivering");
            }
            self.delivered.insert(id.clone(), want.clone());
        }
        self.apply_branches(desired, &mut removals, &mut assignments)?;
        removals.apply()?;
        for had in &links_to_delete {
            Self::delete_link(had)?;
        }
        assignments.apply()
    }
}

/// Which fabric the emulator drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FabricMode {
    /// The lab's namespaces.
    Lab,
    /// None: the API and IMDS only.
    None,
}

impl std::str::FromStr for FabricMode {
    type Err = LabError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "lab" => Ok(Self::Lab),
            "none" => Ok(Self::None),
            other => Err(LabError::InvalidOption(format!(
                "fabric {other:?}: expected lab or none"
            ))),
        }
    }
}

impl FabricMode {
    /// A fabric of this kind.
    pub fn build(self) -> Box<dyn Fabric> {
        match self {
            Self::Lab => Box::new(LabFabric::new()),
            Self::None => Box::new(NoFabric),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ec2::{
        config::{Config, LAB_NODE_SUBNET_ID},
        model::{Assign, CreateEni},
    };

    #[test]
    fn desired_follows_attachments_of_the_lab_node_only() {
        let node = crate::addrs::NODE_PRIMARY_ADDR;
        let mut state = Ec2State::new(&Config::lab());
        assert!(
            Desired::from_state(&state, node, None, None)
                .enis
                .is_empty()
        );
        let other = state
            .run_instance("m5.large", "ami-1", LAB_NODE_SUBNET_ID, None, vec![], 0)
            .unwrap();
        let instance = state
            .run_instance(
                "m5.large",
                "ami-1",
                LAB_NODE_SUBNET_ID,
                Some(node),
                vec![],
                0,
            )
            .unwrap();
        let eni = state
            .create_eni(CreateEni {
                subnet_id: LAB_NODE_SUBNET_ID.into(),
                ..CreateEni::default()
            })
            .unwrap();
        let attachment = state.attach(&eni, &instance, 1, 0, 0).unwrap();
        assert_eq!(Desired::from_state(&state, node, None, None).enis.len(), 1);
        let desired = Desired::from_state(&state, node, Some(&attachment), None);
        assert_eq!(desired.enis.len(), 2);
        assert_eq!(desired.enis[&eni].gateway, Ipv4Addr::new(10, 20, 11, 1));
        state.complete_attach(&attachment);
        state
            .assign(
                &eni,
                &Assign {
                    prefix_count: Some(1),
                    ..Assign::default()
                },
            )
            .unwrap();
        let desired = Desired::from_state(&state, node, None, None);
        assert_eq!(desired.enis[&eni].prefixes.len(), 1);
        assert!(
            !desired
                .enis
                .contains_key(&state.instance(&other).unwrap().primary_eni)
        );
    }
}
