//! A secondary ENI's link, set up as ipamd's `setupENINetwork` does, minus
//! its policy routing (the ENI's route table and rules), which the eBPF
//! datapath's ENI steering replaces.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use tracing::info;

use super::{LinkInfo, MacAddr, NetlinkError, NetlinkHandle};

/// The MTU ipamd gives ENIs when `AWS_VPC_ENI_MTU` is not set (jumbo
/// frames, which the VPC carries between instances).
pub const DEFAULT_ENI_MTU: u32 = 9001;

/// What an ENI's link needs, all of it from IMDS and the environment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EniLinkConfig {
    /// The ENI's MAC (`network/interfaces/macs/<mac>`): how its link is found.
    pub mac: MacAddr,
    /// `AWS_VPC_ENI_MTU` ([`DEFAULT_ENI_MTU`] when unset).
    pub mtu: u32,
    /// The ENI's primary private IP with its subnet's prefix length
    /// (`subnet-ipv4-cidr-block`).
    pub addr: Ipv4Net,
    /// The subnet's gateway, its first address (`.1`).
    pub gateway: Ipv4Addr,
}

/// What [`NetlinkHandle::setup_eni`] found to set: empty when the link was
/// as vpcnet left it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EniLinkSetup {
    /// The link's index, the key of the datapath's ENI map.
    pub ifindex: u32,
    /// What was not as it should be, and was put right.
    pub changed: Vec<&'static str>,
}

impl NetlinkHandle {
    /// Sets up the link of the ENI with `config.mac`: MTU, up, the ENI's
    /// address as its only IPv4 address, no route in `main`, and the
    /// gateway kept resolved. Idempotent: the agent's reconcile loop calls
    /// it for every ENI it owns on every pass, so what something else
    /// rewrote (systemd-networkd racing for a new ENI) is put back, and
    /// says what that was.
    ///
    /// The link must exist; after an attachment, wait for it first with
    /// [`NetlinkHandle::wait_for_link`].
    pub async fn setup_eni(&self, config: &EniLinkConfig) -> Result<EniLinkSetup, NetlinkError> {
        let link = self
            .link_by_mac(config.mac)
            .await?
            .ok_or(NetlinkError::NoLinkWithMac(config.mac))?;
        self.setup_eni_link(&link, config).await
    }

    /// [`NetlinkHandle::setup_eni`] on `link`, which the caller has just
    /// found (by [`NetlinkHandle::wait_for_link`]), without finding it again.
    pub async fn setup_eni_link(
        &self,
        link: &LinkInfo,
        config: &EniLinkConfig,
    ) -> Result<EniLinkSetup, NetlinkError> {
        let link_ref = link.link_ref();
        let mut changed = Vec::new();
        // The MTU first, as ipamd does: the link never carries a packet at
        // the wrong size.
        if link.mtu != config.mtu {
            self.set_mtu(&link_ref, config.mtu).await?;
            info!(link = %link.name, from = link.mtu, to = config.mtu, "MTU set");
            changed.push("mtu");
        }
        if !link.up {
            self.set_up(&link_ref).await?;
            info!(link = %link.name, "link set up");
            changed.push("up");
        }
        if self.set_only_ipv4_address(&link_ref, config.addr).await? {
            changed.push("address");
        }
        // The subnet route the kernel adds with an address that went in
        // without noprefixroute (ipamd's, an operator's), and a DHCP
        // client's routes.
        if self.delete_main_routes(&link_ref).await? > 0 {
            changed.push("routes in main");
        }
        if self
            .keep_gateway_resolved(&link_ref, config.gateway)
            .await?
        {
            changed.push("gateway neighbour");
        }
        Ok(EniLinkSetup {
            ifindex: link.index,
            changed,
        })
    }
}
