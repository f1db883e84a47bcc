//! The node layout the lab hands the agent (`--layout FILE`): which ENIs
//! the node has and which pod sits behind which host veth on which ENI, in
//! the agent's own types (`vpcnet_api::layout`). Until the CNI plugin talks
//! to the agent, this file is how the agent learns it.

use std::{fs, path::PathBuf};

use vpcnet_api::layout::{EndpointSpec, EniSpec, NodeLayout};

use crate::{
    addrs::{NODE_SUBNET_GW, eni_ifname},
    error::{Context, LabError, Result},
    options::LabOptions,
    state::{PodInfo, layout_file},
};

/// The layout of a lab built with `opts` and `pods`: every ENI (eth0 first,
/// the primary), every branch ENI link, every pod.
pub fn node_layout(opts: &LabOptions, pods: &[PodInfo]) -> NodeLayout {
    // Every ENI of the lab, branch ENIs included, is in the node subnet.
    let eni = |interface: String, primary: bool| EniSpec {
        interface,
        gateway: NODE_SUBNET_GW,
        primary,
    };
    let enis = (0..opts.enis)
        .map(|device| eni(eni_ifname(device), device == 0))
        .chain(
            pods.iter()
                .filter_map(|pod| pod.branch.as_ref())
                .map(|branch| eni(branch.link.clone(), false)),
        )
        .collect();
    let endpoints = pods
        .iter()
        .map(|pod| EndpointSpec {
            addr: pod.addr,
            mac: pod.mac.clone(),
            host_veth: pod.host_veth.clone(),
            eni: pod.eni.clone(),
            enforcing_mode: pod.branch.as_ref().map(|branch| branch.mode),
        })
        .collect();
    NodeLayout { enis, endpoints }
}

/// Writes the layout to [`layout_file`] (atomically) and returns its path.
pub fn write(opts: &LabOptions, pods: &[PodInfo]) -> Result<PathBuf> {
    let layout = node_layout(opts, pods);
    layout
        .validate()
        .map_err(|err| LabError::InvalidOption(err.to_string()))?;
    let path = layout_file();
    let tmp = path.with_extension("json.tmp");
    let json = serde_json::to_string_pretty(&layout).expect("the layout always serializes");
    fs::write(&tmp, json).context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, &path).context(|| format!("renaming {} into place", tmp.display()))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::EnforcingMode;

    #[test]
    fn every_eni_branch_link_and_pod_is_listed() {
        let opts = LabOptions {
            enis: 3,
            branch_pods: vec![3],
            sg_enforcing_mode: EnforcingMode::Standard,
            ..LabOptions::iptables(4)
        };
        let pods: Vec<_> = (0..4).map(|i| PodInfo::in_lab(i, &opts).unwrap()).collect();
        let layout = node_layout(&opts, &pods);
        layout.validate().unwrap();
        let enis: Vec<_> = layout.enis.iter().map(|e| e.interface.as_str()).collect();
        assert_eq!(enis, ["eth0", "eth1", "eth2", "vlan.eth.1"]);
        assert_eq!(layout.primary().unwrap().interface, "eth0");
        let on: Vec<_> = layout.endpoints.iter().map(|e| e.eni.as_str()).collect();
        assert_eq!(on, ["eth0", "eth1", "eth2", "vlan.eth.1"]);
        assert_eq!(
            layout.endpoints[3].enforcing_mode,
            Some(EnforcingMode::Standard)
        );
        assert_eq!(layout.endpoints[1].enforcing_mode, None);
        assert_eq!(layout.endpoints[1].mac, "02:cb:00:00:00:01");
        assert_eq!(layout.endpoints[1].host_veth, "eni83dbd022cd5");
        // What the agent reads back.
        let json = serde_json::to_string(&layout).unwrap();
        assert_eq!(serde_json::from_str::<NodeLayout>(&json).unwrap(), layout);
    }
}
