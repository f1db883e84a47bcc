//! What the VPC resource controller asks of EC2 for security groups for
//! pods (aws/amazon-vpc-resource-controller-k8s, `pkg/provider/branch`):
//! one trunk ENI per node, attached at a free device index, and per pod a
//! branch ENI in the node's subnet associated with the trunk on the lowest
//! free VLAN id. Pure functions of [`Ec2State`]; the emulator's server runs
//! them and makes the network follow.

use std::{collections::BTreeMap, net::Ipv4Addr};

use vpcnet_api::pod::{BranchEni, TAG_INSTANCE_ID};

use super::model::{CreateEni, Ec2Error, Ec2Result, Ec2State, InterfaceType};

/// The trunk ENI's description (`aws-k8s-` + `trunk-eni`).
pub const TRUNK_DESCRIPTION: &str = "aws-k8s-trunk-eni";
/// Each branch ENI's description.
pub const BRANCH_DESCRIPTION: &str = "aws-k8s-branch-eni";
/// The tags by which the controller finds its branch ENIs after a restart.
pub const VLAN_ID_TAG: &str = "vpcresources.k8s.aws/vlan-id";
pub const TRUNK_ENI_ID_TAG: &str = "vpcresources.k8s.aws/trunk-eni-id";
/// The VLAN ids the controller hands out: 1 to 120 (its
/// `MaxAllocatableVlanIds` is 121, id 0 reserved).
pub const CONTROLLER_VLAN_IDS: std::ops::RangeInclusive<u16> = 1..=120;

/// The trunk ENI of `instance_id`: the one attached (or attaching), or one
/// made now and attached at the lowest free device index of card 0.
/// Returns its id and, when it was attached now, the attachment to
/// complete.
pub fn ensure_trunk(
    state: &mut Ec2State,
    instance_id: &str,
    now_ms: u64,
) -> Ec2Result<(String, Option<String>)> {
    let theirs: Vec<_> = state
        .enis()
        .filter(|eni| {
            eni.attachment
                .as_ref()
                .is_some_and(|a| a.instance_id == instance_id)
        })
        .collect();
    if let Some(trunk) = theirs
        .iter()
        .find(|eni| eni.interface_type == InterfaceType::Trunk)
    {
        return Ok((trunk.id.clone(), None));
    }
    let used: Vec<u32> = theirs
        .iter()
        .filter_map(|eni| eni.attachment.as_ref())
        .filter(|a| a.network_card_index == 0)
        .map(|a| a.device_index)
        .collect();
    let device_index = (1..=u32::MAX)
        .find(|d| !used.contains(d))
        .expect("fewer ENIs than device indices");
    let instance = state.instance(instance_id)?;
    let request = CreateEni {
        subnet_id: instance.subnet_id.clone(),
        groups: instance.groups.clone(),
        description: TRUNK_DESCRIPTION.to_owned(),
        tags: BTreeMap::from([(TAG_INSTANCE_ID.to_owned(), instance_id.to_owned())]),
        interface_type: InterfaceType::Trunk,
        ..CreateEni::default()
    };
    let trunk = state.create_eni(request)?;
    match state.attach(&trunk, instance_id, device_index, 0, now_ms) {
        Ok(attachment) => Ok((trunk, Some(attachment))),
        Err(err) => {
            // EC2 keeps an ENI that failed to attach; the controller does
            // not: it deletes it and tries again later.
            state.delete_eni(&trunk)?;
            Err(err)
        }
    }
}

/// A branch ENI for one pod on `trunk_id`: in the trunk's subnet, with the
/// trunk's groups (the lab has no `SecurityGroupPolicy`), `private_ip` if
/// given, on the lowest VLAN id no association of the trunk uses. Returns
/// it as the pod's `vpc.amazonaws.com/pod-eni` annotation names it.
pub fn create_branch(
    state: &mut Ec2State,
    trunk_id: &str,
    private_ip: Option<Ipv4Addr>,
) -> Ec2Result<BranchEni> {
    let trunk = state.eni(trunk_id)?;
    let used: Vec<u16> = state
        .trunk_associations()
        .filter(|a| a.trunk_id == trunk_id)
        .map(|a| a.vlan_id)
        .collect();
    let vlan_id = CONTROLLER_VLAN_IDS
        .clone()
        .find(|id| !used.contains(id))
        .ok_or_else(|| {
            Ec2Error::new(
                "InvalidParameterValue",
                format!("trunk {trunk_id} has no free VLAN id left"),
            )
        })?;
    let subnet_id = trunk.subnet_id.clone();
    let mut tags = BTreeMap::from([
        (VLAN_ID_TAG.to_owned(), vlan_id.to_string()),
        (TRUNK_ENI_ID_TAG.to_owned(), trunk_id.to_owned()),
    ]);
    if let Some(instance) = trunk.tags.get(TAG_INSTANCE_ID) {
        tags.insert(TAG_INSTANCE_ID.to_owned(), instance.clone());
    }
    let request = CreateEni {
        subnet_id: subnet_id.clone(),
        groups: trunk.groups.clone(),
        description: BRANCH_DESCRIPTION.to_owned(),
        tags,
        private_ip,
        ..CreateEni::default()
    };
    let branch_id = state.create_eni(request)?;
    let association = match state.associate_trunk(&branch_id, trunk_id, vlan_id) {
        Ok(association) => association,
        Err(err) => {
            state.delete_eni(&branch_id)?;
            return Err(err);
        }
    };
    let branch = state.eni(&branch_id)?;
    Ok(BranchEni {
        eni_id: branch_id,
        mac: branch.mac.clone(),
        private_ip: branch.primary_ip,
        ipv6_addr: String::new(),
        vlan_id,
        subnet_cidr: state.subnet(&subnet_id)?.cidr,
        subnet_v6_cidr: String::new(),
        association_id: association.id,
    })
}

/// A branch ENI after its pod's cooldown: disassociated (one already gone
/// is no error, as for the controller) and deleted.
pub fn delete_branch(state: &mut Ec2State, branch: &BranchEni) -> Ec2Result<()> {
    match state.disassociate_trunk(&branch.association_id) {
        Ok(_) => {}
        Err(err) if err.code == "InvalidAssociationID.NotFound" => {}
        Err(err) => return Err(err),
    }
    state.delete_eni(&branch.eni_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ec2::config::{Config, LAB_NODE_SUBNET_ID};

    fn node(state: &mut Ec2State) -> String {
        state
            .run_instance(
                "m5.large",
                "ami-1",
                LAB_NODE_SUBNET_ID,
                Some(crate::addrs::NODE_PRIMARY_ADDR),
                vec![],
                0,
            )
            .unwrap()
    }

    #[test]
    fn one_trunk_per_node_and_branches_on_the_lowest_free_vlan() {
        let mut state = Ec2State::new(&Config::lab());
        let instance = node(&mut state);
        let (trunk, attaching) = ensure_trunk(&mut state, &instance, 0).unwrap();
        let attachment = attaching.expect("attached now");
        state.complete_attach(&attachment);
        let eni = state.eni(&trunk).unwrap();
        assert_eq!(eni.interface_type, InterfaceType::Trunk);
        assert_eq!(eni.description, TRUNK_DESCRIPTION);
        assert_eq!(eni.attachment.as_ref().unwrap().device_index, 1);
        assert_eq!(
            ensure_trunk(&mut state, &instance, 0).unwrap(),
            (trunk.clone(), None)
        );

        let first = create_branch(&mut state, &trunk, None).unwrap();
        let second = create_branch(&mut state, &trunk, None).unwrap();
        assert_eq!((first.vlan_id, second.vlan_id), (1, 2));
        let tags = &state.eni(&second.eni_id).unwrap().tags;
        assert_eq!(tags[VLAN_ID_TAG], "2");
        assert_eq!(tags[TRUNK_ENI_ID_TAG], trunk);
        assert_eq!(tags[TAG_INSTANCE_ID], instance);
        assert_eq!(first.subnet_cidr.to_string(), "10.20.11.0/24");
        delete_branch(&mut state, &first).unwrap();
        assert!(state.eni(&first.eni_id).is_err());
        // VLAN 1 is free again: the next branch takes it.
        assert_eq!(create_branch(&mut state, &trunk, None).unwrap().vlan_id, 1);
        // Deleting twice: the association is gone, the ENI too.
        assert!(delete_branch(&mut state, &first).is_err());
    }

    #[test]
    fn a_node_without_a_free_slot_gets_no_trunk_and_keeps_no_eni() {
        let mut state = Ec2State::new(&Config::lab());
        let instance = node(&mut state);
        // m5.large: three ENIs; fill devices 1 and 2.
        for device in 1..=2 {
            let eni = state
                .create_eni(CreateEni {
                    subnet_id: LAB_NODE_SUBNET_ID.into(),
                    ..CreateEni::default()
                })
                .unwrap();
            state.attach(&eni, &instance, device, 0, 0).unwrap();
        }
        let before = state.enis().count();
        let err = ensure_trunk(&mut state, &instance, 0).unwrap_err();
        assert_eq!(err.code, "AttachmentLimitExceeded");
        assert_eq!(state.enis().count(), before);
    }
}
