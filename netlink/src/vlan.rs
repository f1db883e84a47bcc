//! 802.1Q links: a branch ENI's `vlan.eth.<vlan id>` on the trunk ENI's
//! link, as the VPC CNI's plugin makes it (`setupVlan`): the branch ENI's
//! MAC, the trunk's MTU (the kernel's default for a VLAN), no address, up.

use rtnetlink::{
    LinkMessageBuilder, LinkVlan,
    packet_route::link::{
        InfoData, InfoVlan, LinkAttribute, LinkInfo as PacketLinkInfo, LinkMessage, VlanProtocol,
    },
};
use tracing::info;

use crate::{LinkInfo, MacAddr, NetlinkError, NetlinkHandle, link::LinkKey};

/// What a VLAN link is made of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VlanSpec {
    pub name: String,
    /// The trunk's link.
    pub parent_index: u32,
    pub vlan_id: u16,
    pub mac: MacAddr,
}

/// A link, and what makes it a VLAN if it is one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VlanDetails {
    pub link: LinkInfo,
    /// Its parent (`IFLA_LINK`) and 802.1Q id: `None` for a link that is
    /// not a VLAN.
    pub vlan: Option<(u32, u16)>,
}

impl VlanDetails {
    fn from_message(message: &LinkMessage) -> Self {
        // Only a VLAN has VLAN data, and it always says its id.
        let vlan_id = message
            .attributes
            .iter()
            .find_map(|attribute| match attribute {
                LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|info| match info {
                    PacketLinkInfo::Data(InfoData::Vlan(data)) => {
                        data.iter().find_map(|d| match d {
                            InfoVlan::Id(id) => Some(*id),
                            _ => None,
                        })
                    }
                    _ => None,
                }),
                _ => None,
            });
        let parent = message
            .attributes
            .iter()
            .find_map(|attribute| match attribute {
                LinkAttribute::Link(index) => Some(*index),
                _ => None,
            });
        Self {
            link: LinkInfo::from_message(message),
            vlan: parent.zip(vlan_id),
        }
    }
}

impl NetlinkHandle {
    /// Creates the VLAN link `spec`, up, and returns it.
    pub async fn create_vlan(&self, spec: &VlanSpec) -> Result<LinkInfo, NetlinkError> {
        let message = LinkMessageBuilder::<LinkVlan>::new(&spec.name)
            .link(spec.parent_index)
            .id(spec.vlan_id)
            .protocol(VlanProtocol::Ieee8021Q)
            .address(spec.mac.0.to_vec())
            .up()
            .build();
        self.handle
            .link()
            .add(message)
            .execute()
            .await
            .map_err(|source| NetlinkError::CreateVlan {
                name: spec.name.clone(),
                vlan_id: spec.vlan_id,
                parent_index: spec.parent_index,
                source: Box::new(source),
            })?;
        let found = self.link_by_name(&spec.name).await;
        let Ok(Some(link)) = found else {
            // Not left behind half-made: the caller sees an error.
            if let Ok(Some(details)) = self.vlan_details(&spec.name).await {
                let _ = self.handle.link().del(details.link.index).execute().await;
            }
            return Err(found
                .err()
                .unwrap_or_else(|| NetlinkError::NoLinkNamed(spec.name.clone())));
        };
        info!(link = %spec.name, vlan_id = spec.vlan_id, parent = spec.parent_index, mac = %spec.mac, "VLAN link created");
        Ok(link)
    }

    /// The link named `name` and whether it is a VLAN, if there is one.
    pub async fn vlan_details(&self, name: &str) -> Result<Option<VlanDetails>, NetlinkError> {
        Ok(self
            .link_message(LinkKey::Name(name))
            .await?
            .map(|message| VlanDetails::from_message(&message)))
    }

    /// The link with `index` and whether it is a VLAN, if there is one.
    pub async fn vlan_details_by_index(
        &self,
        index: u32,
    ) -> Result<Option<VlanDetails>, NetlinkError> {
        Ok(self
            .link_message(LinkKey::Index(index))
            .await?
            .map(|message| VlanDetails::from_message(&message)))
    }
}
