//! The node's side of the address manager: an attached ENI's link set up
//! through rtnetlink and handed to the datapath, the VPC's and the
//! cluster's CIDRs put into the datapath's CIDR map.

use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex},
    time::Duration,
};

use ipnet::Ipv4Net;
use tracing::{info, warn};
use vpcnet_common::{addr_to_raw, cidr::CidrKind, endpoint::Eni};

use crate::{
    datapath::Datapath,
    ipam::manager::{AttachedEni, NetworkFuture, NetworkResult, NodeNetwork},
    link_owner::{LinkOwner, LinkOwners},
    netlink::{EniLinkConfig, MacAddr, NetlinkHandle},
};

/// How long an attached ENI's link may take to appear.
const LINK_TIMEOUT: Duration = Duration::from_secs(30);

/// The datapath's CIDR trie: service CIDRs, VPC CIDRs, exclusions and every
/// node address, in that order, so that for the same prefix the later wins
/// (a VPC CIDR over a service CIDR, a node address over anything).
pub fn cidr_entries(
    vpc: &[Ipv4Net],
    excluded: &[Ipv4Net],
    services: &[Ipv4Net],
) -> Result<Vec<(Ipv4Net, CidrKind)>, nix::Error> {
    let mut entries: Vec<(Ipv4Net, CidrKind)> =
        services.iter().map(|n| (*n, CidrKind::Service)).collect();
    entries.extend(vpc.iter().map(|n| (*n, CidrKind::Vpc)));
    entries.extend(excluded.iter().map(|n| (*n, CidrKind::Excluded)));
    for ifaddr in nix::ifaddrs::getifaddrs()? {
        if let Some(addr) = ifaddr.address.as_ref().and_then(|a| a.as_sockaddr_in()) {
            let host = Ipv4Net::new(addr.ip(), 32).expect("/32 is valid");
            entries.push((host, CidrKind::Local));
        }
    }
    Ok(entries)
}

/// The classes of the datapath's CIDR map, kept together: any one of them
/// can change (the VPC's CIDRs, the cluster's service CIDRs) and the map is
/// then written whole.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CidrClasses {
    pub vpc: Vec<Ipv4Net>,
    /// `AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS`.
    pub excluded: Vec<Ipv4Net>,
    pub services: Vec<Ipv4Net>,
}

impl CidrClasses {
    /// Writes the classes into the datapath's CIDR map.
    pub fn write(&self, datapath: &mut Datapath) -> NetworkResult {
        let entries = cidr_entries(&self.vpc, &self.excluded, &self.services)?;
        datapath.maps.set_cidrs(&entries)?;
        Ok(())
    }
}

/// The classes as the datapath has them, shared by whoever changes one.
#[derive(Clone, Debug, Default)]
pub struct SharedCidrClasses(Arc<Mutex<CidrClasses>>);

impl SharedCidrClasses {
    pub fn new(classes: CidrClasses) -> Self {
        Self(Arc::new(Mutex::new(classes)))
    }

    /// Changes the classes with `change` and writes the map.
    pub fn update(
        &self,
        datapath: &Mutex<Datapath>,
        change: impl FnOnce(&mut CidrClasses),
    ) -> NetworkResult {
        let mut classes = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        change(&mut classes);
        let mut datapath = datapath
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        classes.write(&mut datapath)
    }

    pub fn get(&self) -> CidrClasses {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// Links and datapath of this node.
pub struct NodeLinks {
    pub netlink: NetlinkHandle,
    pub datapath: Arc<Mutex<Datapath>>,
    /// `AWS_VPC_ENI_MTU`.
    pub mtu: u32,
    /// The CIDR map's classes (the VPC's change here).
    pub cidrs: SharedCidrClasses,
    /// Who else claims the node's interfaces, for the log.
    pub owners: LinkOwners,
}

impl NodeLinks {
    fn datapath(&self) -> std::sync::MutexGuard<'_, Datapath> {
        // A panic elsewhere leaves the maps as they were: usable.
        self.datapath
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn link_config(&self, eni: &AttachedEni) -> NetworkResult<EniLinkConfig> {
        Ok(EniLinkConfig {
            mac: eni.mac.parse()?,
            mtu: self.mtu,
            addr: eni.addr,
            gateway: eni.gateway,
        })
    }

    async fn setup(&self, eni: &AttachedEni) -> NetworkResult {
        let config = self.link_config(eni)?;
        let link = self.netlink.wait_for_link(config.mac, LINK_TIMEOUT).await?;
        let ifindex = self.netlink.setup_eni_link(&link, &config).await?.ifindex;
        match self.owners.owner(ifindex) {
            LinkOwner::Unclaimed => {
                info!(eni = %eni.id, link = %link.name, manager = "vpcnet", "ENI link owner");
            }
            other => warn!(
                eni = %eni.id,
                link = %link.name,
                manager = %other,
                "another network manager claims this ENI's link too and may rewrite it \
                 (its configuration should match the primary ENI only); vpcnet puts its \
                 own back every 5 s"
            ),
        }
        let mut datapath = self.datapath();
        datapath.maps.set_eni(
            ifindex,
            &Eni {
                gateway: addr_to_raw(eni.gateway.octets()),
                flags: 0,
            },
        )?;
        datapath.attach_eni(&link.name)?;
        info!(eni = %eni.id, link = %link.name, ifindex, addr = %eni.addr, "ENI link set up, datapath attached");
        Ok(())
    }
}

impl NodeNetwork for NodeLinks {
    fn eni_attached<'a>(
        &'a self,
        eni: &'a AttachedEni,
    ) -> Pin<Box<dyn Future<Output = NetworkResult> + Send + 'a>> {
        Box::pin(self.setup(eni))
    }

    fn eni_link_check<'a>(
        &'a self,
        eni: &'a AttachedEni,
    ) -> NetworkFuture<'a, NetworkResult<Vec<&'static str>>> {
        Box::pin(async move {
            let setup = self.netlink.setup_eni(&self.link_config(eni)?).await?;
            if !setup.changed.is_empty() {
                warn!(
                    eni = %eni.id,
                    ifindex = setup.ifindex,
                    manager = %self.owners.owner(setup.ifindex),
                    changed = ?setup.changed,
                    "ENI link rewritten by someone else: put back"
                );
            }
            Ok(setup.changed)
        })
    }

    fn interface_owner<'a>(&'a self, mac: &'a str) -> NetworkFuture<'a, Option<(String, String)>> {
        Box::pin(async move {
            let mac: MacAddr = mac.parse().ok()?;
            let link = self.netlink.link_by_mac(mac).await.ok()??;
            Some((link.name, self.owners.owner(link.index).to_string()))
        })
    }

    fn vpc_cidrs_changed(&self, cidrs: &[Ipv4Net]) -> NetworkResult {
        self.cidrs
            .update(&self.datapath, |classes| classes.vpc = cidrs.to_vec())?;
        info!(?cidrs, "VPC CIDRs in the datapath");
        Ok(())
    }
}

/// Turns TCP early demux off (aws-node's init container's variable): a
/// strict-mode branch-ENI pod's kubelet probes need it off, as its replies
/// come back by another link than the one early demux cached.
pub const ENV_DISABLE_TCP_EARLY_DEMUX: &str = "DISABLE_TCP_EARLY_DEMUX";

/// Where the kernel shows the network sysctls of the reader's namespace.
pub const PROC_SYS_NET: &str = "/proc/sys/net";

/// The node's sysctls aws-node's init container sets, in the agent's
/// network namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeSysctls {
    pub disable_tcp_early_demux: bool,
}

impl NodeSysctls {
    pub fn from_env(env: &crate::env::Env) -> Self {
        Self {
            disable_tcp_early_demux: env.bool_or(ENV_DISABLE_TCP_EARLY_DEMUX, false),
        }
    }

    /// What is written where: loose reverse-path filtering (2) on the
    /// primary interface, whose replies may arrive for addresses of other
    /// ENIs; TCP early demux 0 or 1 where the kernel has it (aws-node
    /// writes 1 too, so a node's earlier 0 does not linger).
    #[must_use]
    pub fn writes(
        &self,
        proc_sys_net: &std::path::Path,
        primary_interface: &str,
    ) -> Vec<(std::path::PathBuf, &'static str)> {
        let ipv4 = proc_sys_net.join("ipv4");
        let mut writes = vec![(
            ipv4.join("conf").join(primary_interface).join("rp_filter"),
            "2",
        )];
        let early_demux = ipv4.join("tcp_early_demux");
        if early_demux.exists() {
            writes.push((
                early_demux,
                if self.disable_tcp_early_demux {
                    "0"
                } else {
                    "1"
                },
            ));
        }
        writes
    }

    /// Writes them; aws-node's init container stops on a failure, so does
    /// the agent's start.
    pub fn apply(
        &self,
        proc_sys_net: &std::path::Path,
        primary_interface: &str,
    ) -> std::io::Result<()> {
        for (path, value) in self.writes(proc_sys_net, primary_interface) {
            std::fs::write(&path, value).map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("writing {value} to {}: {e}", path.display()),
                )
            })?;
            info!(sysctl = %path.display(), value, "node sysctl set, as aws-node's init container does");
        }
        Ok(())
    }
}
