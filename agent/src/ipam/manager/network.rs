//! What the node does with the manager's ENIs: the trait the node
//! implements (set up an attached ENI's link, put new VPC CIDRs in the
//! datapath), and the periodic check that the links stay as set up.

use std::{future::Future, net::Ipv4Addr, pin::Pin, time::Duration};

use ipnet::Ipv4Net;
use tracing::warn;

use super::{Manager, bump, gateway_of};

/// An ENI whose link the node must set up (and the datapath learn).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachedEni {
    pub id: String,
    pub mac: String,
    pub device_number: u32,
    /// The ENI's primary address, with its subnet's prefix length.
    pub addr: Ipv4Net,
    pub gateway: Ipv4Addr,
}

pub type NetworkResult<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A future a [`NodeNetwork`] method returns.
pub type NetworkFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the node does when the manager's view changes: set up an attached
/// ENI's link and datapath entry, put new VPC CIDRs into the datapath.
pub trait NodeNetwork: Send + Sync + 'static {
    fn eni_attached<'a>(
        &'a self,
        eni: &'a AttachedEni,
    ) -> Pin<Box<dyn Future<Output = NetworkResult> + Send + 'a>>;
    /// Puts an ENI's link back as `eni_attached` set it, if something else
    /// rewrote it; returns what had to change.
    fn eni_link_check<'a>(
        &'a self,
        _eni: &'a AttachedEni,
    ) -> NetworkFuture<'a, NetworkResult<Vec<&'static str>>> {
        Box::pin(async { Ok(Vec::new()) })
    }
    /// The interface of the ENI with `mac` and who manages it, for the log.
    fn interface_owner<'a>(&'a self, _mac: &'a str) -> NetworkFuture<'a, Option<(String, String)>> {
        Box::pin(async { None })
    }
    fn vpc_cidrs_changed(&self, cidrs: &[Ipv4Net]) -> NetworkResult;
}

/// How often the links of the agent's ENIs are checked (and put back if
/// something else rewrote them): each check dumps the node's routes, which
/// grow with its pods, so not on every pass of a fast pool loop.
pub(super) const LINK_CHECK_INTERVAL: Duration = Duration::from_secs(5);

impl Manager {
    /// The links of the pool's secondary ENIs as `track` set them up, every
    /// [`LINK_CHECK_INTERVAL`]. A failure is logged: the next check tries
    /// again.
    pub(super) async fn check_links(&self) {
        let me = &self.inner;
        let owned: Vec<AttachedEni> = {
            let st = me.state.lock().await;
            st.enis
                .iter()
                .filter(|(_, e)| !e.no_manage && e.mac != me.node.instance.primary_mac)
                .filter(|(id, _)| !st.draining.contains_key(*id))
                .filter_map(|(id, e)| {
                    Some(AttachedEni {
                        id: id.clone(),
                        mac: e.mac.clone(),
                        device_number: e.device_number,
                        addr: Ipv4Net::new(e.primary_addr?, e.subnet.prefix_len()).ok()?,
                        gateway: gateway_of(e.subnet),
                    })
                })
                .collect()
        };
        for eni in &owned {
            match me.network.eni_link_check(eni).await {
                Ok(changed) if !changed.is_empty() => {
                    bump(&me.counters.links_restored, 1);
                }
                Ok(_) => {}
                Err(e) => warn!(eni = %eni.id, error = %e, "checking the ENI's link"),
            }
        }
    }
}
