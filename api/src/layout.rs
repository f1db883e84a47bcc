//! The node layout: which ENIs the node has and which pods sit behind which
//! host veth, on which ENI. Until the CNI plugin talks to the agent, the lab
//! writes this as JSON and starts the agent with `--layout FILE`.

use std::{net::Ipv4Addr, path::Path};

use serde::{Deserialize, Serialize};

/// An ENI as the node sees it: a link, and the subnet gateway behind it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EniSpec {
    /// The node's interface for the ENI (`eth0`, `eth1`, `vlan.eth.5`).
    pub interface: String,
    /// The subnet's router (its `.1`): packets leaving by this ENI go there.
    pub gateway: Ipv4Addr,
    /// The primary ENI: SNAT's source and way out.
    #[serde(default)]
    pub primary: bool,
}

/// The security groups for pods enforcing mode
/// (`POD_SECURITY_GROUP_ENFORCING_MODE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EnforcingMode {
    /// Every packet of the pod goes out and comes in by its branch ENI.
    Strict,
    /// The pod uses the node's paths and SNAT like any other.
    Standard,
}

impl EnforcingMode {
    /// The value of `POD_SECURITY_GROUP_ENFORCING_MODE`.
    pub fn env_value(self) -> &'static str {
        match self {
            Self::Strict => "strict",
            Self::Standard => "standard",
        }
    }
}

/// A pod on this node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointSpec {
    /// The pod's address.
    pub addr: Ipv4Addr,
    /// The pod's `eth0` MAC: the only source MAC its packets may carry.
    pub mac: String,
    /// The host side of its veth, in the node's namespace.
    pub host_veth: String,
    /// The interface of the ENI that owns `addr` (a branch ENI's link for a
    /// pod with security groups).
    pub eni: String,
    /// Set for a pod on a branch ENI (security groups for pods).
    #[serde(default)]
    pub enforcing_mode: Option<EnforcingMode>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeLayout {
    pub enis: Vec<EniSpec>,
    pub endpoints: Vec<EndpointSpec>,
}

#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("reading the node layout {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing the node layout {path}")]
    Parse {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("the node layout is inconsistent: {0}")]
    Inconsistent(String),
}

impl NodeLayout {
    pub fn read(path: &Path) -> Result<Self, LayoutError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| LayoutError::Read {
            path: shown.clone(),
            source,
        })?;
        let layout: Self = serde_json::from_str(&text).map_err(|source| LayoutError::Parse {
            path: shown,
            source,
        })?;
        layout.validate()?;
        Ok(layout)
    }

    /// One primary ENI, every endpoint on a known ENI, no address twice.
    pub fn validate(&self) -> Result<(), LayoutError> {
        let primaries = self.enis.iter().filter(|e| e.primary).count();
        if primaries != 1 {
            return Err(LayoutError::Inconsistent(format!(
                "{primaries} primary ENIs, expected exactly one"
            )));
        }
        let mut seen = std::collections::HashSet::new();
        for ep in &self.endpoints {
            if !self.enis.iter().any(|e| e.interface == ep.eni) {
                return Err(LayoutError::Inconsistent(format!(
                    "pod {} is on ENI {}, which is not listed",
                    ep.addr, ep.eni
                )));
            }
            if !seen.insert(ep.addr) {
                return Err(LayoutError::Inconsistent(format!(
                    "pod address {} twice",
                    ep.addr
                )));
            }
        }
        Ok(())
    }

    pub fn primary(&self) -> Option<&EniSpec> {
        self.enis.iter().find(|e| e.primary)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> NodeLayout {
        serde_json::from_str(
            r#"{
              "enis": [
                {"interface": "eth0", "gateway": "10.20.11.1", "primary": true},
                {"interface": "eth1", "gateway": "10.20.11.1"},
                {"interface": "vlan.eth.7", "gateway": "10.20.11.1"}
              ],
              "endpoints": [
                {"addr": "10.20.11.20", "mac": "02:00:00:00:00:01", "host_veth": "enic220f2ba281", "eni": "eth1"},
                {"addr": "10.20.11.30", "mac": "02:00:00:00:00:02", "host_veth": "vlan0123456789a",
                 "eni": "vlan.eth.7", "enforcing_mode": "strict"}
              ]
            }"#,
        )
        .unwrap()
    }

    #[test]
    fn reads_enis_and_endpoints() {
        let l = layout();
        l.validate().unwrap();
        assert_eq!(l.primary().unwrap().interface, "eth0");
        assert_eq!(l.endpoints[1].enforcing_mode, Some(EnforcingMode::Strict));
        assert_eq!(l.endpoints[0].enforcing_mode, None);
    }

    #[test]
    fn rejects_an_unknown_eni_and_duplicate_addresses() {
        let mut l = layout();
        l.endpoints[0].eni = "eth9".into();
        assert!(l.validate().unwrap_err().to_string().contains("eth9"));
        let mut l = layout();
        l.endpoints[1].addr = l.endpoints[0].addr;
        assert!(l.validate().unwrap_err().to_string().contains("twice"));
        let mut l = layout();
        l.enis[0].primary = false;
        assert!(l.validate().is_err());
    }
}
