//! DEL: best effort and idempotent. The agent is told (its datapath entry
//! and address go), the pod's veth pair is deleted (with it the node's
//! route to the pod), and the interface in the pod's namespace if it is
//! still there. A missing namespace, a missing veth, a DEL for an unknown
//! container or a second DEL all succeed; so does a DEL while the agent is
//! down or silent: the links are torn down anyway, a warning is logged, and
//! the agent reclaims the address when it finds the veth gone.
//!
//! The host veth is named after the pod, so another sandbox of the same pod
//! may own a veth of that name by now (a runtime sends DEL again for a
//! sandbox long gone, and the pod's next sandbox is up). The veth is only
//! deleted when it is this attachment's: its peer is `CNI_IFNAME` in
//! `CNI_NETNS`, or its MAC is the one in `prevResult`, or the agent's record
//! of this attachment names it. A veth pair dies with either namespace, so
//! when the pod's namespace is gone a veth of that name that is still there
//! belongs to someone else, unless the agent or `prevResult` say otherwise.

use tracing::{debug, info, warn};
use vpcnet_api::cni::CheckNetworkReply;
use vpcnet_netlink::{NetlinkHandle, netns::Netns, pod::PodNetError, veth::LinkDetails};

use crate::{
    agent::Agent,
    error::{self, CniError, code},
    plugin::{Ctx, netns_error},
    result::CniResult,
};

pub async fn del(ctx: &Ctx) -> Result<(), CniError> {
    let prev = ctx.conf.prev_result.as_ref().and_then(|value| {
        CniResult::from_prev_result(value)
            .inspect_err(|err| warn!(error = %err, "ignoring a prevResult that does not decode"))
            .ok()
    });
    let netns = open_if_present(ctx)?;
    let (agent, record) = agent_and_record(ctx).await;
    let pod_peer = match &netns {
        Some(netns) => pod_peer(ctx, netns).await,
        None => None,
    };
    let node = NetlinkHandle::new()
        .map_err(|err| error::netlink("opening netlink", &PodNetError::from(err)))?;
    let (host_veth, host) = find_host_veth(ctx, &node, prev.as_ref(), record.as_ref()).await?;
    let ours = host
        .as_ref()
        .is_none_or(|link| is_ours(link, pod_peer, prev.as_ref(), record.as_ref()));

    let agent_error = match &agent {
        Some(agent) => tell_agent(ctx, agent, &host_veth, ours).await,
        None => None,
    };
    let mut link_error = None;
    match &host {
        Some(link) if ours => {
            if let Err(err) = node.delete_link(link.link.index, &host_veth).await {
                link_error = Some(error::netlink("deleting the host veth", &err));
            }
        }
        Some(link) => warn!(
            host_veth,
            index = link.link.index,
            "left the host veth alone: it belongs to another attachment of the pod"
        ),
        None => debug!(host_veth, "no host veth"),
    }
    if let Some(netns) = &netns {
        delete_pod_interface(ctx, netns).await;
    }
    match (agent_error, link_error) {
        (Some(err), _) | (None, Some(err)) => Err(err),
        (None, None) => Ok(()),
    }
}

/// The agent, if it is there, and its record of the attachment, if it has
/// one.
async fn agent_and_record(ctx: &Ctx) -> (Option<Agent>, Option<CheckNetworkReply>) {
    let agent = match ctx.agent().await {
        Ok(agent) => agent,
        Err(err) => {
            warn!(error = %err, "tearing down without the agent");
            return (None, None);
        }
    };
    match agent.check_network(ctx.pod_key()).await {
        Ok(record) => (Some(agent), Some(record)),
        Err(err) if err.unavailable() => {
            warn!(error = %err, "tearing down without the agent");
            (None, None)
        }
        Err(err) => {
            warn!(error = %err, "no record of the attachment from the agent");
            (Some(agent), None)
        }
    }
}

/// The index of the peer of the pod's interface (a veth), if it has one.
async fn pod_peer(ctx: &Ctx, netns: &Netns) -> Option<u32> {
    let ifname = ctx.env.ifname.clone();
    netns
        .run(async move |netlink| netlink.link_details(&ifname).await)
        .await
        .inspect_err(
            |err| warn!(error = %error::chain(err), "looking at the container's interface"),
        )
        .ok()
        .flatten()
        .filter(|link| link.veth)
        .and_then(|link| link.peer_index)
}

/// The host veth: the one the agent's record names, else the one this
/// config names, else a host interface of `prevResult` (a config whose
/// prefix changed since ADD); the first that exists, with its link, or the
/// first name if none does.
async fn find_host_veth(
    ctx: &Ctx,
    node: &NetlinkHandle,
    prev: Option<&CniResult>,
    record: Option<&CheckNetworkReply>,
) -> Result<(String, Option<LinkDetails>), CniError> {
    let mut candidates: Vec<String> = Vec::new();
    let record_veth = record.map(|record| record.host_veth.clone());
    let prev_veths = prev.into_iter().flat_map(|prev| {
        prev.interfaces
            .iter()
            .filter(|iface| iface.sandbox.is_empty())
            .map(|iface| iface.name.clone())
    });
    for name in record_veth
        .into_iter()
        .chain([ctx.host_veth_name()])
        .chain(prev_veths)
    {
        if !name.is_empty() && !candidates.contains(&name) {
            candidates.push(name);
        }
    }
    for name in &candidates {
        let link = node
            .link_details(name)
            .await
            .map_err(|err| error::netlink("looking up the host veth", &err))?;
        if link.is_some() {
            return Ok((name.clone(), link));
        }
    }
    Ok((candidates.swap_remove(0), None))
}

/// Whether the host veth `link` is this attachment's: a veth whose peer is
/// the pod's interface, or that has the MAC `prevResult` gives it, or that
/// the agent's record of the attachment names.
fn is_ours(
    link: &LinkDetails,
    pod_peer: Option<u32>,
    prev: Option<&CniResult>,
    record: Option<&CheckNetworkReply>,
) -> bool {
    let name = &link.link.name;
    let prev_mac = prev
        .and_then(|prev| {
            prev.interfaces
                .iter()
                .find(|iface| iface.sandbox.is_empty() && iface.name == *name)
        })
        .map(|iface| iface.mac.as_str())
        .filter(|mac| !mac.is_empty());
    link.veth
        && (pod_peer == Some(link.link.index)
            || prev_mac.is_some_and(|mac| {
                link.link
                    .mac
                    .is_some_and(|actual| mac.eq_ignore_ascii_case(&actual.to_string()))
            })
            || record.is_some_and(|record| record.host_veth == *name))
}

/// `CNI_NETNS` opened, if it is given and still there. The plugin's own
/// namespace is refused (4): DEL would delete the node's `CNI_IFNAME`.
fn open_if_present(ctx: &Ctx) -> Result<Option<Netns>, CniError> {
    if ctx.env.netns.is_empty() {
        return Ok(None);
    }
    match Netns::open(&ctx.env.netns) {
        Ok(netns) => match netns.is_current() {
            Ok(false) => Ok(Some(netns)),
            Ok(true) => Err(CniError::new(
                code::INVALID_ENV,
                "invalid CNI_NETNS: it is the plugin's own network namespace",
                ctx.env.netns.clone(),
            )),
            Err(err) => Err(netns_error(&err)),
        },
        Err(PodNetError::NetnsMissing(path)) => {
            debug!(netns = %path.display(), "the container's namespace is gone");
            Ok(None)
        }
        Err(err) => {
            warn!(error = %error::chain(&err), "opening the container's namespace");
            Ok(None)
        }
    }
}

/// `DelNetwork`. The agent being unavailable is only a warning; an error it
/// answers is the DEL's (after the links are torn down), so the runtime
/// tries again.
async fn tell_agent(ctx: &Ctx, agent: &Agent, host_veth: &str, ours: bool) -> Option<CniError> {
    // A veth that is someone else's is not named: the agent must not take
    // its programs off.
    let host_veth = if ours {
        host_veth.to_owned()
    } else {
        String::new()
    };
    match agent
        .del_network(
            ctx.pod_key(),
            host_veth,
            vpcnet_api::del_reason::POD_DELETED,
        )
        .await
    {
        Ok(reply) if reply.ipv4_addr.is_empty() => {
            debug!("the agent held no address for the attachment");
            None
        }
        Ok(reply) => {
            info!(released = %reply.ipv4_addr, "the agent released the pod's address");
            None
        }
        Err(err) if err.unavailable() => {
            warn!(
                error = %err,
                "tearing down without the agent; it reclaims the address when it finds the veth gone"
            );
            None
        }
        Err(err) => Some(err.to_cni()),
    }
}

/// Deletes `CNI_IFNAME` in the pod's namespace if it is still there (it
/// went with the pair when the host veth was deleted).
async fn delete_pod_interface(ctx: &Ctx, netns: &Netns) {
    let ifname = ctx.env.ifname.clone();
    let outcome = netns
        .run(async move |netlink| {
            let link: Option<LinkDetails> = netlink.link_details(&ifname).await?;
            match link {
                Some(link) => netlink.delete_link(link.link.index, &ifname).await,
                None => Ok(false),
            }
        })
        .await;
    match outcome {
        Ok(true) => info!(ifname = %ctx.env.ifname, "deleted the container's interface"),
        Ok(false) => {}
        Err(err) => warn!(error = %error::chain(&err), "deleting the container's interface"),
    }
}
