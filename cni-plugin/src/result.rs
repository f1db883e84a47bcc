//! The CNI result (`interfaces`, `ips`, `routes`, `dns`): what ADD prints,
//! and what `prevResult` carries back on ADD (chained), DEL and CHECK, in
//! the 0.3.x/0.4.0 form (each IP has a `version`) or the 1.x one (none).
//! Fields the plugin does not use are kept as they came, so a result passed
//! through is not stripped.

use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{CniError, code};

/// Whether semantic version `version` is at least `min` (both "x.y.z";
/// anything unparsable is lower than everything).
pub fn version_at_least(version: &str, min: &str) -> bool {
    fn parse(v: &str) -> Option<(u32, u32, u32)> {
        let mut parts = v.split('.').map(str::parse::<u32>);
        let triple = (
            parts.next()?.ok()?,
            parts.next()?.ok()?,
            parts.next()?.ok()?,
        );
        parts.next().is_none().then_some(triple)
    }
    match (parse(version), parse(min)) {
        (Some(v), Some(m)) => v >= m,
        _ => false,
    }
}

/// One interface of a result.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Interface {
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,
    /// The namespace path for an interface in the container, empty on the
    /// host.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sandbox: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One address of a result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IpConfig {
    /// "4" or "6" before 1.0.0; rewritten on output for the version asked.
    #[serde(default, skip_serializing)]
    pub version: Option<String>,
    pub address: IpNet,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<IpAddr>,
    /// Index into `interfaces`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<usize>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One route of a result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Route {
    pub dst: IpNet,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gw: Option<IpAddr>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A result, whatever the version it came in.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CniResult {
    #[serde(default)]
    pub interfaces: Vec<Interface>,
    #[serde(default)]
    pub ips: Vec<IpConfig>,
    #[serde(default)]
    pub routes: Vec<Route>,
    #[serde(default)]
    pub dns: Map<String, Value>,
}

impl CniResult {
    /// Parses a `prevResult`: a result object of 0.3.x, 0.4.0 or 1.x.
    /// Anything else is the spec's "failed to decode" (6).
    pub fn from_prev_result(value: &Value) -> Result<Self, CniError> {
        let bad = |details: String| {
            CniError::new(
                code::DECODING_FAILURE,
                "failed to decode prevResult",
                details,
            )
        };
        if !value.is_object() {
            return Err(bad(format!("expected a result object, got {value}")));
        }
        let result = Self::deserialize(value).map_err(|err| bad(err.to_string()))?;
        for ip in &result.ips {
            if let Some(index) = ip.interface
                && index >= result.interfaces.len()
            {
                return Err(bad(format!(
                    "ip {} names interface {index}, and there are {} interfaces",
                    ip.address,
                    result.interfaces.len()
                )));
            }
            if let Some(version) = &ip.version {
                let family = if ip.address.addr().is_ipv4() {
                    "4"
                } else {
                    "6"
                };
                if version != family {
                    return Err(bad(format!("ip {} has version {version:?}", ip.address)));
                }
            }
        }
        Ok(result)
    }

    /// The result as `cni_version` has it: with `"version"` in each IP
    /// before 1.0.0.
    pub fn to_json(&self, cni_version: &str) -> Value {
        let mut value = serde_json::to_value(self).expect("a result always serializes");
        if !version_at_least(cni_version, "1.0.0")
            && let Some(ips) = value.get_mut("ips").and_then(Value::as_array_mut)
        {
            for (ip, config) in ips.iter_mut().zip(&self.ips) {
                let family = if config.address.addr().is_ipv4() {
                    "4"
                } else {
                    "6"
                };
                if let Some(ip) = ip.as_object_mut() {
                    ip.insert("version".into(), Value::from(family));
                }
            }
        }
        let object = value.as_object_mut().expect("a result is an object");
        object.insert("cniVersion".into(), Value::from(cni_version));
        value
    }

    /// The interface named `name` in `sandbox` (the pod's end), with its
    /// index.
    pub fn sandbox_interface(&self, name: &str) -> Option<(usize, &Interface)> {
        self.interfaces
            .iter()
            .enumerate()
            .find(|(_, iface)| iface.name == name && !iface.sandbox.is_empty())
    }

    /// The first host-side interface (no sandbox): the host veth.
    pub fn host_interface(&self) -> Option<&Interface> {
        self.interfaces
            .iter()
            .find(|iface| iface.sandbox.is_empty())
    }

    /// The IPv4 addresses given to interface `index`.
    pub fn ipv4_of(&self, index: usize) -> Vec<&IpConfig> {
        self.ips
            .iter()
            .filter(|ip| ip.interface == Some(index) && ip.address.addr().is_ipv4())
            .collect()
    }

    /// Appends `other` (this plugin's own result) to `self` (a previous
    /// plugin's), moving its interface indices past `self`'s interfaces.
    pub fn append(&mut self, other: Self) {
        let offset = self.interfaces.len();
        self.interfaces.extend(other.interfaces);
        self.ips.extend(other.ips.into_iter().map(|mut ip| {
            ip.interface = ip.interface.map(|index| index + offset);
            ip
        }));
        self.routes.extend(other.routes);
        for (key, value) in other.dns {
            self.dns.entry(key).or_insert(value);
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod_result() -> CniResult {
        CniResult {
            interfaces: vec![
                Interface {
                    name: "enic220f2ba281".into(),
                    mac: "02:aa:bb:cc:dd:01".into(),
                    ..Interface::default()
                },
                Interface {
                    name: "eth0".into(),
                    mac: "02:aa:bb:cc:dd:02".into(),
                    sandbox: "/var/run/netns/pod".into(),
                    ..Interface::default()
                },
            ],
            ips: vec![IpConfig {
                version: None,
                address: "10.20.11.20/32".parse().unwrap(),
                gateway: Some("169.254.1.1".parse().unwrap()),
                interface: Some(1),
                extra: Map::new(),
            }],
            routes: vec![Route {
                dst: "0.0.0.0/0".parse().unwrap(),
                gw: Some("169.254.1.1".parse().unwrap()),
                extra: Map::new(),
            }],
            dns: Map::new(),
        }
    }

    #[test]
    fn renders_per_version() {
        let result = pod_result();
        let v1 = result.to_json("1.1.0");
        assert_eq!(
            v1,
            json!({
                "cniVersion": "1.1.0",
                "interfaces": [
                    {"name": "enic220f2ba281", "mac": "02:aa:bb:cc:dd:01"},
                    {"name": "eth0", "mac": "02:aa:bb:cc:dd:02", "sandbox": "/var/run/netns/pod"}
                ],
                "ips": [{"address": "10.20.11.20/32", "gateway": "169.254.1.1", "interface": 1}],
                "routes": [{"dst": "0.0.0.0/0", "gw": "169.254.1.1"}],
                "dns": {}
            })
        );
        for old in ["0.3.1", "0.4.0"] {
            let value = result.to_json(old);
            assert_eq!(value["cniVersion"], old);
            assert_eq!(
                value["ips"],
                json!([{"version": "4", "address": "10.20.11.20/32", "gateway": "169.254.1.1", "interface": 1}])
            );
            assert_eq!(value["interfaces"], v1["interfaces"]);
        }
    }

    #[test]
    fn prev_results_of_every_version_parse() {
        let expected = pod_result();
        let v031 = json!({
            "cniVersion": "0.3.1",
            "interfaces": [
                {"name": "enic220f2ba281", "mac": "02:aa:bb:cc:dd:01"},
                {"name": "eth0", "mac": "02:aa:bb:cc:dd:02", "sandbox": "/var/run/netns/pod"}
            ],
            "ips": [{"version": "4", "address": "10.20.11.20/32", "gateway": "169.254.1.1", "interface": 1}],
            "routes": [{"dst": "0.0.0.0/0", "gw": "169.254.1.1"}],
            "dns": {}
        });
        let mut parsed = CniResult::from_prev_result(&v031).unwrap();
        assert_eq!(parsed.ips[0].version.as_deref(), Some("4"));
        parsed.ips[0].version = None;
        assert_eq!(parsed, expected);
        let mut v040 = v031.clone();
        v040["cniVersion"] = json!("0.4.0");
        assert!(CniResult::from_prev_result(&v040).is_ok());
        let v100 = expected.to_json("1.0.0");
        assert_eq!(CniResult::from_prev_result(&v100).unwrap(), expected);
        // A result without dns or routes (a minimal plugin's) is fine.
        let minimal = json!({"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "/x"}],
            "ips": [{"address": "10.0.0.5/24", "interface": 0}]});
        let parsed = CniResult::from_prev_result(&minimal).unwrap();
        assert_eq!(parsed.sandbox_interface("eth0").unwrap().0, 0);
        assert_eq!(parsed.host_interface(), None);
    }

    #[test]
    fn unknown_fields_pass_through() {
        let prev = json!({
            "cniVersion": "1.1.0",
            "interfaces": [{"name": "eth0", "sandbox": "/x", "mtu": 9001, "socketPath": "/s"}],
            "ips": [{"address": "10.0.0.5/32", "interface": 0}],
            "routes": [{"dst": "10.1.0.0/16", "table": 100, "scope": 253}],
            "dns": {"nameservers": ["10.0.0.2"]}
        });
        let parsed = CniResult::from_prev_result(&prev).unwrap();
        assert_eq!(parsed.to_json("1.1.0"), prev);
    }

    #[test]
    fn bad_prev_results_are_decode_failures() {
        for bad in [
            json!("a string"),
            json!([1, 2]),
            json!({"ips": [{"address": "not-an-address"}]}),
            json!({"ips": [{"address": "10.0.0.5"}]}),
            json!({"interfaces": "eth0"}),
            json!({"interfaces": [], "ips": [{"address": "10.0.0.5/32", "interface": 0}]}),
            json!({"ips": [{"version": "6", "address": "10.0.0.5/32"}]}),
            json!({"routes": [{"gw": "169.254.1.1"}]}),
        ] {
            let err = CniResult::from_prev_result(&bad).unwrap_err();
            assert_eq!(err.code, code::DECODING_FAILURE, "{bad}");
            assert_eq!(err.msg, "failed to decode prevResult");
        }
    }

    #[test]
    fn append_moves_interface_indices() {
        let mut prev = CniResult {
            interfaces: vec![Interface {
                name: "dummy0".into(),
                ..Interface::default()
            }],
            ..CniResult::default()
        };
        prev.append(pod_result());
        assert_eq!(prev.interfaces.len(), 3);
        assert_eq!(prev.ips[0].interface, Some(2));
    }

    #[test]
    fn versions_compare() {
        assert!(version_at_least("0.4.0", "0.4.0"));
        assert!(version_at_least("1.0.0", "0.4.0"));
        assert!(!version_at_least("0.3.1", "0.4.0"));
        assert!(version_at_least("1.1.0", "1.1.0"));
        assert!(!version_at_least("1.0.0", "1.1.0"));
        assert!(!version_at_least("x", "0.1.0"));
    }
}
