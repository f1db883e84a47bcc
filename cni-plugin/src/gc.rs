//! STATUS and GC, the two commands about the whole network rather than one
//! attachment (CNI 1.1.0).

use std::collections::HashSet;

use tracing::{info, warn};
use vpcnet_netlink::{NetlinkHandle, pod::PodNetError};

use crate::{
    config::{NetConf, OWN_VERSION},
    error::{self, CniError, code},
    result::version_at_least,
};

fn needs_1_1(conf: &NetConf, command: &str) -> Result<(), CniError> {
    if version_at_least(&conf.cni_version, OWN_VERSION) {
        Ok(())
    } else {
        Err(CniError::new(
            code::INCOMPATIBLE_VERSION,
            format!("config version does not allow {command}"),
            format!(
                "cniVersion {} ({command} needs {OWN_VERSION})",
                conf.cni_version
            ),
        ))
    }
}

/// STATUS: ready when the agent says it can serve an ADD now.
pub async fn status(conf: &NetConf) -> Result<(), CniError> {
    needs_1_1(conf, "STATUS")?;
    let not_available = |details: String| {
        CniError::new(
            code::NOT_AVAILABLE,
            "the vpcnet agent cannot serve ADD now",
            details,
        )
    };
    let agent = crate::agent::Agent::connect(conf.agent_socket.clone(), conf.agent_timeout)
        .await
        .map_err(|err| not_available(err.to_string()))?;
    let reply = agent
        .status()
        .await
        .map_err(|err| not_available(err.to_string()))?;
    if reply.ready {
        info!(
            available_addrs = reply.available_addrs,
            "the agent is ready"
        );
        Ok(())
    } else {
        Err(not_available(if reply.reason.is_empty() {
            "the agent is not ready and gave no reason".to_owned()
        } else {
            reply.reason
        }))
    }
}

/// Deletes the link `name` if it is there and a veth (a record naming
/// anything else is not trusted with it).
async fn delete_veth(node: &NetlinkHandle, name: &str) -> Result<(), PodNetError> {
    match node.link_details(name).await? {
        Some(link) if link.veth => {
            node.delete_link(link.link.index, name).await?;
        }
        Some(_) => warn!(link = name, "gc: not deleting a link that is not a veth"),
        None => {}
    }
    Ok(())
}

/// GC: every attachment of this network the agent holds and the runtime
/// does not list in `cni.dev/valid-attachments` loses its host veth (when
/// no valid attachment's record names the same veth) and its address.
/// Errors do not stop the sweep; they are all reported at the end.
pub async fn gc(conf: &NetConf) -> Result<(), CniError> {
    needs_1_1(conf, "GC")?;
    let Some(valid) = &conf.valid_attachments else {
        return Err(CniError::new(
            code::INVALID_CONFIG,
            "required cni.dev/valid-attachments missing",
            "GC deletes every attachment not listed: without the list it would delete them all",
        ));
    };
    let valid: HashSet<(&str, &str)> = valid
        .iter()
        .map(|a| (a.container_id.as_str(), a.ifname.as_str()))
        .collect();
    let agent = crate::agent::Agent::connect(conf.agent_socket.clone(), conf.agent_timeout)
        .await
        .map_err(|err| err.to_cni())?;
    let attachments = agent.list_attachments().await.map_err(|err| err.to_cni())?;
    let (stale, kept): (Vec<_>, Vec<_>) = attachments
        .into_iter()
        .filter(|a| {
            a.pod
                .as_ref()
                .is_some_and(|pod| pod.network_name == conf.name)
        })
        .partition(|a| {
            let pod = a.pod.as_ref().expect("filtered on having a pod");
            !valid.contains(&(pod.container_id.as_str(), pod.if_name.as_str()))
        });
    let kept_veths: HashSet<&str> = kept.iter().map(|a| a.host_veth.as_str()).collect();
    let node = NetlinkHandle::new()
        .map_err(|err| error::netlink("opening netlink", &PodNetError::from(err)))?;

    let mut errors = Vec::new();
    // The code of the first failure: the agent's, or a netlink one.
    let mut first_code = None;
    let mut removed = 0usize;
    for attachment in &stale {
        let pod = attachment.pod.clone().unwrap_or_default();
        // A veth a valid attachment also names is that attachment's now.
        let host_veth = if kept_veths.contains(attachment.host_veth.as_str()) {
            String::new()
        } else {
            attachment.host_veth.clone()
        };
        if !host_veth.is_empty()
            && let Err(err) = delete_veth(&node, &host_veth).await
        {
            first_code.get_or_insert(code::NETLINK);
            errors.push(format!(
                "{}/{}: deleting {host_veth}: {}",
                pod.container_id,
                pod.if_name,
                error::chain(&err)
            ));
        }
        match agent
            .del_network(
                pod.clone(),
                host_veth.clone(),
                vpcnet_api::del_reason::GARBAGE_COLLECTED,
            )
            .await
        {
            Ok(_) => {
                removed += 1;
                info!(
                    container = %pod.container_id,
                    ifname = %pod.if_name,
                    pod = %format!("{}/{}", pod.k8s_pod_namespace, pod.k8s_pod_name),
                    addr = %attachment.ipv4_addr,
                    host_veth,
                    "gc: removed a stale attachment"
                );
            }
            Err(err) => {
                warn!(container = %pod.container_id, error = %err, "gc: DelNetwork failed");
                first_code.get_or_insert(err.to_cni().code);
                errors.push(format!("{}/{}: {err}", pod.container_id, pod.if_name));
            }
        }
    }
    info!(
        removed,
        stale = stale.len(),
        kept = kept.len(),
        "gc: removed {removed} of {} stale attachments",
        stale.len()
    );
    if errors.is_empty() {
        Ok(())
    } else {
        Err(CniError::new(
            first_code.unwrap_or(code::AGENT_REFUSED),
            format!(
                "gc: {} errors removing {} stale attachments",
                errors.len(),
                stale.len()
            ),
            errors.join("; "),
        ))
    }
}
