//! What every command about an attachment shares: the config and the
//! environment, the agent's key for the pod, the host veth's name, and the
//! pod's namespace.

use vpcnet_api::{
    cni::PodKey,
    pod::{branch_eni, host_veth_name},
};
use vpcnet_netlink::{MacAddr, netns::Netns, pod::PodNetError};

use crate::{
    agent::{Agent, AgentError},
    config::{EnforcingMode, NetConf, STRICT_BRANCH_VETH_PREFIX},
    env::Env,
    error::{self, CniError, code},
};

/// One command's inputs.
#[derive(Clone, Debug)]
pub struct Ctx {
    pub conf: NetConf,
    pub env: Env,
}

impl Ctx {
    /// The agent's key for the attachment, with the pod it belongs to.
    pub fn pod_key(&self) -> PodKey {
        PodKey {
            network_name: self.conf.name.clone(),
            container_id: self.env.container_id.clone(),
            if_name: self.env.ifname.clone(),
            k8s_pod_namespace: self.env.k8s.pod_namespace.clone(),
            k8s_pod_name: self.env.k8s.pod_name.clone(),
        }
    }

    /// The host veth's name, the VPC CNI's: the prefix (`vethPrefix`, or
    /// "vlan" for a branch-ENI pod in strict mode) and the first 11 hex
    /// digits of sha1("<namespace>.<pod>"), so operators' tools that know
    /// the VPC CNI's names find the pod's veth.
    ///
    /// Two cases the VPC CNI does not have: without a pod in `CNI_ARGS` (a
    /// runtime other than kubelet's) the container id is hashed in the
    /// pod's place (as "<namespace>.<container id>", namespace empty), and
    /// an interface other than eth0 (a second attachment of the same pod)
    /// hashes "<namespace>.<pod>.<ifname>", so the two never collide.
    pub fn host_veth_name(&self) -> String {
        let branch = branch_eni(&self.conf.annotations).is_ok_and(|eni| eni.is_some());
        let prefix = if branch && self.conf.pod_sg_enforcing_mode == EnforcingMode::Strict {
            STRICT_BRANCH_VETH_PREFIX
        } else {
            &self.conf.veth_prefix
        };
        let k8s = &self.env.k8s;
        if k8s.pod_name.is_empty() {
            host_veth_name(prefix, &k8s.pod_namespace, &self.env.container_id)
        } else if self.env.ifname == "eth0" {
            host_veth_name(prefix, &k8s.pod_namespace, &k8s.pod_name)
        } else {
            let pod = format!("{}.{}", k8s.pod_name, self.env.ifname);
            host_veth_name(prefix, &k8s.pod_namespace, &pod)
        }
    }

    /// Connects to the agent.
    pub async fn agent(&self) -> Result<Agent, AgentError> {
        Agent::connect(self.conf.agent_socket.clone(), self.conf.agent_timeout).await
    }

    /// Opens the pod's namespace for ADD and CHECK, which need it: missing
    /// is the spec's "container unknown" (3); the plugin's own namespace is
    /// an invalid `CNI_NETNS` (4).
    pub fn pod_netns(&self) -> Result<Netns, CniError> {
        let netns = Netns::open(&self.env.netns).map_err(|err| netns_error(&err))?;
        match netns.is_current() {
            Ok(false) => Ok(netns),
            Ok(true) => Err(CniError::new(
                code::INVALID_ENV,
                "invalid CNI_NETNS: it is the plugin's own network namespace",
                self.env.netns.clone(),
            )),
            Err(err) => Err(netns_error(&err)),
        }
    }
}

/// A failure to open or enter the pod's namespace, as the runtime sees it.
pub fn netns_error(err: &PodNetError) -> CniError {
    match err {
        PodNetError::NetnsMissing(path) => CniError::new(
            code::UNKNOWN_CONTAINER,
            "the container's network namespace does not exist",
            path.display().to_string(),
        ),
        PodNetError::Setns { .. } => CniError::new(
            code::INVALID_ENV,
            "invalid CNI_NETNS: not a network namespace",
            error::chain(err),
        ),
        PodNetError::OpenNetns { .. } => CniError::new(
            code::IO_FAILURE,
            "opening the container's network namespace",
            error::chain(err),
        ),
        _ => error::netlink("working in the container's network namespace", err),
    }
}

/// A random MAC, locally administered and unicast (what `ip link` and the
/// kernel give veths, chosen here so the plugin knows both before the
/// pair exists).
pub fn random_mac() -> Result<MacAddr, CniError> {
    let mut bytes = [0u8; 6];
    getrandom::fill(&mut bytes).map_err(|err| {
        CniError::new(
            code::IO_FAILURE,
            "reading random bytes for a MAC",
            err.to_string(),
        )
    })?;
    bytes[0] = (bytes[0] & 0xfe) | 0x02;
    Ok(MacAddr(bytes))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use serde_json::json;
    use vpcnet_api::pod::POD_ENI_ANNOTATION;

    use super::*;
    use crate::env::K8sArgs;

    fn ctx(config: &serde_json::Value, ifname: &str, k8s: K8sArgs) -> Ctx {
        Ctx {
            conf: NetConf::from_value(config).unwrap(),
            env: Env {
                container_id: "0123abcd".into(),
                netns: "/var/run/netns/x".into(),
                ifname: ifname.into(),
                k8s,
            },
        }
    }

    fn pod0() -> K8sArgs {
        K8sArgs {
            pod_namespace: "default".into(),
            pod_name: "pod-0".into(),
            ..K8sArgs::default()
        }
    }

    #[test]
    fn host_veths_are_named_like_the_vpc_cni() {
        let config = json!({"cniVersion": "1.1.0", "name": "aws-cni"});
        assert_eq!(
            ctx(&config, "eth0", pod0()).host_veth_name(),
            "enic220f2ba281"
        );
        let custom = json!({"cniVersion": "1.1.0", "name": "aws-cni", "vethPrefix": "veth"});
        assert_eq!(
            ctx(&custom, "eth0", pod0()).host_veth_name(),
            "vethc220f2ba281"
        );
        // Without a pod, the container id; another interface, another name.
        let no_pod = ctx(&config, "eth0", K8sArgs::default()).host_veth_name();
        assert_eq!(no_pod, host_veth_name("eni", "", "0123abcd"));
        let second = ctx(&config, "net1", pod0()).host_veth_name();
        assert_eq!(second, host_veth_name("eni", "default", "pod-0.net1"));
        assert_ne!(second, "enic220f2ba281");
    }

    #[test]
    fn strict_branch_pods_get_the_vlan_prefix() {
        let eni = r#"[{"eniId":"eni-0123","ifAddress":"02:ee:0a:14:0c:05","privateIp":"10.20.12.5","vlanId":5,"subnetCidr":"10.20.12.0/24"}]"#;
        let annotations: HashMap<_, _> = [(POD_ENI_ANNOTATION, eni)].into_iter().collect();
        let strict = json!({"cniVersion": "1.1.0", "name": "aws-cni",
            "runtimeConfig": {"io.kubernetes.cri.pod-annotations": annotations}});
        assert_eq!(
            ctx(&strict, "eth0", pod0()).host_veth_name(),
            "vlanc220f2ba281"
        );
        let standard = json!({"cniVersion": "1.1.0", "name": "aws-cni", "podSGEnforcingMode": "standard",
            "runtimeConfig": {"io.kubernetes.cri.pod-annotations": annotations}});
        assert_eq!(
            ctx(&standard, "eth0", pod0()).host_veth_name(),
            "enic220f2ba281"
        );
    }

    #[test]
    fn the_key_names_the_attachment_and_the_pod() {
        let key = ctx(
            &json!({"cniVersion": "1.1.0", "name": "aws-cni"}),
            "eth0",
            pod0(),
        )
        .pod_key();
        assert_eq!(key.network_name, "aws-cni");
        assert_eq!(key.container_id, "0123abcd");
        assert_eq!(key.if_name, "eth0");
        assert_eq!(key.k8s_pod_namespace, "default");
        assert_eq!(key.k8s_pod_name, "pod-0");
    }

    #[test]
    fn random_macs_are_local_unicast() {
        for _ in 0..64 {
            let mac = random_mac().unwrap();
            assert_eq!(mac.0[0] & 0x03, 0x02, "{mac}");
        }
        assert_ne!(random_mac().unwrap(), random_mac().unwrap());
    }
}
