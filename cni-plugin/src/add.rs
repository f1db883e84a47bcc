//! ADD: the veth pair, the agent's address and datapath entry, the two
//! sides configured; on any failure, everything made so far undone.
//!
//! A host veth that exists already under the pod's name is deleted and
//! made again when no attachment of the agent holds it (a leftover of a
//! sandbox of the same pod whose DEL never ran to the end); when another
//! attachment holds it, that sandbox is still wired and ADD fails (101)
//! rather than cut it off.

use std::net::Ipv4Addr;

use ipnet::IpNet;
use serde_json::{Map, Value};
use tracing::{info, warn};
use vpcnet_api::cni::{AddNetworkReply, AddNetworkRequest, PodKey};
use vpcnet_netlink::{
    NetlinkHandle,
    netns::Netns,
    pod::{POD_GATEWAY, PodNetError, PodSide},
    veth::VethSpec,
};

use crate::{
    agent::Agent,
    error::{self, CniError, code},
    plugin::{Ctx, netns_error, random_mac},
    result::{CniResult, Interface, IpConfig, Route},
};

/// The MTUs an agent's answer may set.
const AGENT_MTU_RANGE: std::ops::RangeInclusive<u32> = 576..=9001;

fn same_key(a: &PodKey, b: &PodKey) -> bool {
    a.network_name == b.network_name && a.container_id == b.container_id && a.if_name == b.if_name
}

pub async fn add(ctx: &Ctx) -> Result<Value, CniError> {
    let prev = ctx
        .conf
        .prev_result
        .as_ref()
        .map(CniResult::from_prev_result)
        .transpose()?;
    let netns = ctx.pod_netns()?;
    let ifname = ctx.env.ifname.clone();
    let taken = netns
        .run(async move |netlink| Ok(netlink.link_by_name(&ifname).await?.is_some()))
        .await
        .map_err(|err| netns_error(&err))?;
    if taken {
        return Err(CniError::new(
            code::INTERFACE_EXISTS,
            format!(
                "interface {} exists already in the container",
                ctx.env.ifname
            ),
            ctx.env.netns.clone(),
        ));
    }
    // Before anything is made: an agent that is down fails the ADD with
    // nothing to undo.
    let agent = ctx.agent().await.map_err(|err| err.to_cni())?;
    let node = NetlinkHandle::new()
        .map_err(|err| error::netlink("opening netlink", &PodNetError::from(err)))?;
    let host_veth = ctx.host_veth_name();
    free_host_veth(ctx, &agent, &node, &host_veth).await?;

    let spec = VethSpec {
        host_name: host_veth.clone(),
        host_mac: random_mac()?,
        peer_name: ctx.env.ifname.clone(),
        peer_mac: random_mac()?,
        mtu: ctx.conf.veth_mtu(),
    };
    node.create_veth(&spec, &netns)
        .await
        .map_err(|err| match err {
            PodNetError::LinkExists { .. } => CniError::new(
                code::INTERFACE_EXISTS,
                format!(
                    "interface {} (container) or {} (node) exists already",
                    spec.peer_name, spec.host_name
                ),
                error::chain(&err),
            ),
            _ => error::netlink("creating the veth pair", &err),
        })?;

    let mut agent_holds = false;
    match wire(ctx, &agent, &node, &netns, &spec, &mut agent_holds).await {
        Ok(ours) => {
            let result = match prev {
                Some(mut prev) => {
                    prev.append(ours);
                    prev
                }
                None => ours,
            };
            Ok(result.to_json(&ctx.conf.cni_version))
        }
        Err(err) => {
            undo(ctx, &agent, &node, &host_veth, agent_holds).await;
            Err(err)
        }
    }
}

/// Makes sure no link is named `host_veth`: deletes a stale one, fails on
/// one another attachment holds.
async fn free_host_veth(
    ctx: &Ctx,
    agent: &Agent,
    node: &NetlinkHandle,
    host_veth: &str,
) -> Result<(), CniError> {
    let existing = node
        .link_details(host_veth)
        .await
        .map_err(|err| error::netlink("looking up the host veth", &err))?;
    let Some(existing) = existing else {
        return Ok(());
    };
    if !existing.veth {
        return Err(CniError::new(
            code::INTERFACE_EXISTS,
            format!("a link named {host_veth} exists on the node and is not a veth"),
            "vpcnet-cni only ever replaces a stale veth of its own",
        ));
    }
    let key = ctx.pod_key();
    let attachments = agent.list_attachments().await.map_err(|err| err.to_cni())?;
    if let Some(owner) = attachments.iter().find(|attachment| {
        attachment.host_veth == host_veth
            && attachment
                .pod
                .as_ref()
                .is_some_and(|pod| !same_key(pod, &key))
    }) {
        let pod = owner.pod.clone().unwrap_or_default();
        return Err(CniError::new(
            code::HOST_VETH_IN_USE,
            format!("host veth {host_veth} is in use by another attachment"),
            format!(
                "container {} ({}/{}, {}) holds it with {}; DEL that attachment first",
                pod.container_id,
                pod.k8s_pod_namespace,
                pod.k8s_pod_name,
                pod.if_name,
                owner.ipv4_addr
            ),
        ));
    }
    warn!(
        host_veth,
        index = existing.link.index,
        "deleting a stale host veth that no attachment of the agent holds"
    );
    node.delete_link(existing.link.index, host_veth)
        .await
        .map_err(|err| error::netlink("deleting a stale host veth", &err))?;
    Ok(())
}

/// Everything after the pair exists: the agent's address and datapath
/// entry, then both sides. `agent_holds` is set as soon as the agent may
/// hold something for the pod.
async fn wire(
    ctx: &Ctx,
    agent: &Agent,
    node: &NetlinkHandle,
    netns: &Netns,
    spec: &VethSpec,
    agent_holds: &mut bool,
) -> Result<CniResult, CniError> {
    let request = AddNetworkRequest {
        pod: Some(ctx.pod_key()),
        netns: ctx.env.netns.clone(),
        host_veth: spec.host_name.clone(),
        pod_mac: spec.peer_mac.to_string(),
        annotations: ctx.conf.annotations.clone(),
    };
    let reply = match agent.add_network(request).await {
        Ok(reply) => {
            *agent_holds = true;
            reply
        }
        Err(err) => {
            *agent_holds = err.outcome_unknown();
            return Err(err.to_cni());
        }
    };
    let addr = pod_addr(&reply)?;
    info!(
        %addr,
        eni = %reply.eni_id,
        device = reply.device_number,
        branch = reply.branch_eni,
        "the agent gave the pod its address"
    );
    // The config's MTU wins; without one, the agent's (AWS_VPC_ENI_MTU).
    let new_mtu =
        (ctx.conf.mtu.is_none() && reply.mtu != spec.mtu && AGENT_MTU_RANGE.contains(&reply.mtu))
            .then_some(reply.mtu);

    let host = node
        .link_by_name(&spec.host_name)
        .await
        .map_err(PodNetError::from)
        .and_then(|link| link.ok_or_else(|| PodNetError::NoLink(spec.host_name.clone())))
        .map_err(|err| error::netlink("finding the host veth", &err))?
        .link_ref();
    if let Some(mtu) = new_mtu {
        node.set_mtu(&host, mtu)
            .await
            .map_err(|err| error::netlink("setting the host veth's MTU", &err.into()))?;
    }
    node.set_up(&host)
        .await
        .map_err(|err| error::netlink("setting the host veth up", &err.into()))?;
    node.replace_link_route(&host, addr)
        .await
        .map_err(|err| error::netlink("adding the node's route to the pod", &err))?;
    let side = PodSide {
        ifname: spec.peer_name.clone(),
        addr,
        gateway_mac: spec.host_mac,
        mtu: new_mtu,
    };
    netns
        .run(async move |netlink| netlink.configure_pod_side(&side).await)
        .await
        .map_err(|err| error::netlink("configuring the container's interface", &err))?;

    Ok(pod_result(ctx, spec, addr))
}

/// The pod's address in the agent's answer.
fn pod_addr(reply: &AddNetworkReply) -> Result<Ipv4Addr, CniError> {
    reply.ipv4_addr.parse().map_err(|_| {
        CniError::new(
            code::AGENT_REFUSED,
            "the vpcnet agent answered AddNetwork without a valid address",
            format!("ipv4_addr {:?}", reply.ipv4_addr),
        )
    })
}

/// This plugin's result: the host veth, the pod's interface and its /32,
/// the default route through the link-local gateway.
fn pod_result(ctx: &Ctx, spec: &VethSpec, addr: Ipv4Addr) -> CniResult {
    let gateway = std::net::IpAddr::V4(POD_GATEWAY);
    CniResult {
        interfaces: vec![
            Interface {
                name: spec.host_name.clone(),
                mac: spec.host_mac.to_string(),
                ..Interface::default()
            },
            Interface {
                name: spec.peer_name.clone(),
                mac: spec.peer_mac.to_string(),
                sandbox: ctx.env.netns.clone(),
                ..Interface::default()
            },
        ],
        ips: vec![IpConfig {
            version: None,
            address: IpNet::new(addr.into(), 32).expect("32 is a valid IPv4 prefix length"),
            gateway: Some(gateway),
            interface: Some(1),
            extra: Map::new(),
        }],
        routes: vec![Route {
            dst: "0.0.0.0/0".parse().expect("a valid network"),
            gw: Some(gateway),
            extra: Map::new(),
        }],
        dns: Map::new(),
    }
}

/// Undoes a failed ADD: the agent's entry (when it may hold one), then the
/// pair (with it go the pod's end, its address and routes, and the node's
/// route). Failures are logged: the ADD's own error is what the runtime
/// must see.
async fn undo(ctx: &Ctx, agent: &Agent, node: &NetlinkHandle, host_veth: &str, agent_holds: bool) {
    if agent_holds {
        match agent
            .del_network(
                ctx.pod_key(),
                host_veth.to_owned(),
                vpcnet_api::del_reason::SETUP_NS_FAILED,
            )
            .await
        {
            Ok(reply) => info!(released = %reply.ipv4_addr, "undo: the agent released the pod"),
            Err(err) => warn!(
                error = %err,
                "undo: DelNetwork failed; the agent reclaims the address when it finds the veth gone"
            ),
        }
    }
    match node.delete_link_named(host_veth).await {
        Ok(_) => info!(host_veth, "undo: veth pair deleted"),
        Err(err) => {
            warn!(host_veth, error = %error::chain(&err), "undo: deleting the veth pair failed");
        }
    }
}
