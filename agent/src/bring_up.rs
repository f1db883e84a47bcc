//! The datapath's bring-up on this node once loaded (above the datapath,
//! which knows nothing of the node's settings): the maps filled (configuration,
//! timeouts, CIDR classes, the routing exception, the node layout, the
//! primary ENI) before the programs go on the primary ENI, so that no
//! packet meets an empty map.

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
};

use tracing::info;
use vpcnet_api::layout::NodeLayout;
use vpcnet_common::{
    addr_to_raw,
    endpoint::{ENI_PRIMARY, Eni},
};

use crate::{
    datapath::{Datapath, DatapathError, gc::sync_timeouts},
    layout::{self, LayoutError},
    netlink::{NetlinkError, NetlinkHandle},
    node::CidrClasses,
    snat::SnatSettings,
};

/// What the datapath is brought up with.
pub struct BringUp<'a> {
    /// The primary ENI's interface: SNAT leaves by it.
    pub primary_interface: &'a str,
    /// The primary ENI's address, SNAT's source.
    pub node_addr: Ipv4Addr,
    /// The primary ENI's subnet gateway, when known.
    pub gateway: Option<Ipv4Addr>,
    pub snat: &'a SnatSettings,
    pub cidr_classes: &'a CidrClasses,
    /// The node's ENIs and pods, `--layout`'s.
    pub layout: Option<&'a Path>,
    /// The configuration flags network policy sets once this start has
    /// listed the policies (`PolicySettings::config_flags`; 0 without it).
    pub policy_flags: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum BringUpError {
    #[error("reading /dev/urandom")]
    Seed(#[source] std::io::Error),
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    #[error("writing the CIDR map: {0}")]
    CidrMap(String),
    #[error(transparent)]
    ReadLayout(#[from] vpcnet_api::layout::LayoutError),
    #[error("applying the node layout {}", path.display())]
    ApplyLayout {
        path: PathBuf,
        #[source]
        source: LayoutError,
    },
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error("no link {0}")]
    NoLink(String),
    #[error("attaching to {interface}")]
    Attach {
        interface: String,
        #[source]
        source: DatapathError,
    },
}

/// Fills the maps of a loaded `datapath` and attaches it to the primary
/// ENI.
pub async fn bring_up(
    datapath: &mut Datapath,
    netlink: &NetlinkHandle,
    node: &BringUp<'_>,
) -> Result<(), BringUpError> {
    let earlier = datapath.maps.config().ok();
    // Keep the hash key of a previous run so hashrandom ports stay stable.
    let seed = match earlier {
        Some(old) if old.hash_seed != 0 => old.hash_seed,
        _ => random_seed().map_err(BringUpError::Seed)?,
    };
    let mut config = node.snat.datapath_config(node.node_addr, seed);
    if let Some(earlier) = earlier {
        // What this start writes only later (the primary ENI's link with
        // its entry, network policy's flags once the policies are listed)
        // stays as the earlier start left it. Cleared meanwhile, a pod's
        // packets to the internet would go through the stack, whose
        // conntrack may translate them as it did before a take-over, and
        // its policies would go unenforced.
        config.primary_ifindex = earlier.primary_ifindex;
        config.flags |= earlier.flags & node.policy_flags;
    }
    datapath.maps.set_config(&config)?;
    sync_timeouts(&mut datapath.maps)?;
    node.cidr_classes
        .write(datapath)
        .map_err(|e| BringUpError::CidrMap(e.to_string()))?;
    // Read at start only, as aws-node writes its rules 1535 at start.
    datapath
        .maps
        .set_external_service_cidrs(&node.snat.external_service_cidrs)?;
    if let Some(path) = node.layout {
        let layout = NodeLayout::read(path)?;
        layout::apply(datapath, &layout).map_err(|source| BringUpError::ApplyLayout {
            path: path.to_owned(),
            source,
        })?;
        info!(
            enis = layout.enis.len(),
            pods = layout.endpoints.len(),
            "node layout applied"
        );
    }
    if let Some(gateway) = node.gateway {
        let link = netlink
            .link_by_name(node.primary_interface)
            .await?
            .ok_or_else(|| BringUpError::NoLink(node.primary_interface.to_owned()))?;
        datapath.maps.set_eni(
            link.index,
            &Eni {
                gateway: addr_to_raw(gateway.octets()),
                flags: ENI_PRIMARY,
            },
        )?;
        netlink
            .keep_gateway_resolved(&link.link_ref(), gateway)
            .await?;
    }
    datapath
        .attach_eni(node.primary_interface)
        .map_err(|source| BringUpError::Attach {
            interface: node.primary_interface.to_owned(),
            source,
        })?;
    info!(
        interface = %node.primary_interface,
        node_addr = %node.node_addr,
        external_snat = node.snat.external_snat,
        randomize = node.snat.randomize.env_value(),
        "datapath attached"
    );
    Ok(())
}

fn random_seed() -> std::io::Result<u32> {
    let mut bytes = [0u8; 4];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))?;
    Ok(u32::from_ne_bytes(bytes).max(1))
}
