//! What the introspection endpoints answer, as JSON. The operator's
//! commands (`vpcnet-agent pods`, `enis`) read the same types back.

use std::{collections::BTreeMap, net::Ipv4Addr};

use serde::{Deserialize, Serialize};

/// Any error: `{"error": "..."}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorView {
    pub error: String,
}

/// `GET /`: the endpoints there are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexView {
    pub paths: Vec<String>,
}

/// `GET /v1/policy[?pod=NAMESPACE/NAME]`: the network policy in force for
/// each local pod, rule by rule, with the policy each rule came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyView {
    /// Whether network policy is enforced (`ENABLE_NETWORK_POLICY`).
    pub enforced: bool,
    /// `NETWORK_POLICY_ENFORCING_MODE`, when enforced.
    pub mode: Option<String>,
    pub pods: Vec<PodPolicyView>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodPolicyView {
    pub namespace: String,
    pub name: String,
    pub address: Ipv4Addr,
    /// The rules, unless held from before the policies were listed (the
    /// agent started without the API server): the datapath keeps the ones
    /// it had.
    pub held: bool,
    pub ingress: DirectionView,
    pub egress: DirectionView,
    /// What policy decided for the pod.
    pub verdicts: VerdictsView,
}

/// Connections a pod's rules allowed (counted once, at their first
/// packet) and packets they denied, each way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerdictsView {
    pub ingress_allowed: u64,
    pub ingress_denied: u64,
    pub egress_allowed: u64,
    pub egress_denied: u64,
}

/// One direction of a pod: not isolated (everything passes), or only what
/// one of the rules allows; and around them the cluster policies' rules.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectionView {
    pub isolated: bool,
    pub rules: Vec<RuleView>,
    /// AWS ClusterNetworkPolicy rules, in the order they are judged:
    /// Admin (before `rules`) then Baseline (after them), each tier by
    /// priority.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cluster: Vec<ClusterRuleView>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterRuleView {
    /// `Admin` or `Baseline`.
    pub tier: String,
    pub priority: u16,
    /// `Accept`, `Deny` or `Pass`.
    pub action: String,
    pub peers: Vec<String>,
    pub ports: Vec<String>,
    /// The ClusterNetworkPolicy's name.
    pub policy: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleView {
    /// `CIDR` or `CIDR except CIDR,CIDR`.
    pub peers: Vec<String>,
    /// `TCP/80`, `UDP/1000-2000`, `SCTP`; none: every protocol and port.
    pub ports: Vec<String>,
    /// `namespace/name` of the NetworkPolicy.
    pub policy: String,
}

/// `GET /v1/pods`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodsView {
    /// Whether the address manager runs (`run --ipam`); without it `pods`
    /// is empty and the datapath's entries are all in `datapath_only`.
    pub ipam: bool,
    /// Pods holding an address.
    pub count: usize,
    pub pods: Vec<PodView>,
    /// Datapath entries for addresses no pod holds through the address
    /// manager (pods of a `--layout`, or entries the sweep has yet to take).
    pub datapath_only: Vec<EndpointView>,
}

/// A pod holding an address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodView {
    pub namespace: String,
    pub name: String,
    pub container_id: String,
    /// The CNI network's name (`aws-cni`).
    pub network: String,
    /// The interface in the pod (`eth0`).
    pub ifname: String,
    pub address: Ipv4Addr,
    /// The ENI that owns the address, and its device number.
    pub eni: Option<String>,
    pub device_number: Option<u32>,
    /// The pod's host veth, if the datapath has an entry for it.
    pub host_veth: Option<String>,
    /// Its entry in the datapath's endpoint map (`None`: none, which a
    /// pod that is being added or that never got wired has).
    pub endpoint: Option<EndpointEntryView>,
}

/// An entry of the datapath's endpoint map with its address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointView {
    pub address: Ipv4Addr,
    #[serde(flatten)]
    pub entry: EndpointEntryView,
}

/// An entry of the datapath's endpoint map.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointEntryView {
    /// The pod's host veth (`interface`: its name, `None` if it is gone).
    pub ifindex: u32,
    pub interface: Option<String>,
    /// The link its packets leave by (its ENI, or its branch ENI's vlan).
    pub eni_ifindex: u32,
    pub eni_interface: Option<String>,
    /// The pod's MAC, and the host veth's.
    pub mac: String,
    pub host_mac: String,
    pub branch: bool,
    pub strict: bool,
    /// The pod programs are on its host veth.
    pub programs_attached: bool,
}

/// `GET /v1/enis`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnisView {
    /// Whether the address manager runs; without it `enis` is empty and
    /// the datapath's ENI entries are all in `datapath_only`.
    pub ipam: bool,
    /// Attached ENIs.
    pub count: usize,
    /// ENIs the node may have (`MAX_ENI` or the instance type's).
    pub max_enis: Option<usize>,
    /// Addresses for pods, and those held by pods (as `awscni_total_ip_addresses`
    /// and `awscni_assigned_ip_addresses`: no-manage ENIs and custom
    /// networking's primary ENI do not count).
    pub total_addresses: usize,
    pub assigned_addresses: usize,
    pub enis: Vec<EniView>,
    /// Entries of the datapath's ENI map that are no ENI of the address
    /// manager (branch ENIs' vlans, the ENIs of a `--layout`).
    pub datapath_only: Vec<DatapathEniView>,
}

/// One attached ENI.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EniView {
    pub id: String,
    pub device_number: u32,
    pub mac: String,
    pub attachment_id: Option<String>,
    pub primary: bool,
    /// Tagged `no_manage`: none of its addresses go to pods.
    pub no_manage: bool,
    /// Custom networking's primary ENI: no pod gets its addresses.
    pub excluded_for_pods: bool,
    pub subnet: String,
    pub gateway: Ipv4Addr,
    /// The ENI's own address (never a pod's).
    pub primary_address: Option<Ipv4Addr>,
    /// Its link in the node (found by MAC).
    pub link: Option<LinkView>,
    /// Its entry in the datapath's ENI map, by its link.
    pub datapath: Option<DatapathEniEntryView>,
    pub total_addresses: usize,
    pub assigned_addresses: usize,
    /// Its /28 prefixes.
    pub prefixes: Vec<String>,
    /// Every address it has for pods (secondary addresses, then the
    /// addresses of its prefixes), with the pod holding it.
    pub addresses: Vec<AddressView>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkView {
    pub name: String,
    pub ifindex: u32,
}

/// One address of an ENI.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AddressView {
    pub address: Ipv4Addr,
    /// The prefix it comes with (`None`: a secondary address).
    pub prefix: Option<String>,
    /// The pod holding it.
    pub pod: Option<PodRef>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub container_id: String,
}

/// An entry of the datapath's ENI map with its link.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatapathEniView {
    pub ifindex: u32,
    pub interface: Option<String>,
    #[serde(flatten)]
    pub entry: DatapathEniEntryView,
}

/// An entry of the datapath's ENI map.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatapathEniEntryView {
    /// The subnet's router, where packets leaving by it go.
    pub gateway: Ipv4Addr,
    pub primary: bool,
    pub branch: bool,
    /// The ENI programs are on the link.
    pub programs_attached: bool,
}

/// `GET /v1/nat[?limit=N]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NatView {
    /// Flows in the table, and how many it holds at most.
    pub total: usize,
    pub table_size: u32,
    /// The most flows returned (`?limit=`), how many were, and whether
    /// some were left out.
    pub limit: usize,
    pub returned: usize,
    pub truncated: bool,
    pub flows: Vec<FlowView>,
}

/// `GET /v1/nat/summary`: how full the flow maps are, the remote
/// endpoints whose flows hold the most of the node address's ports, and the
/// garbage collector's work since the agent started.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NatSummaryView {
    pub maps: Vec<MapFillView>,
    /// The busiest first.
    pub busiest_remote_endpoints: Vec<RemoteEndpointView>,
    /// Ports each remote endpoint can have (the SNAT port range).
    pub port_range: u32,
    pub collector: CollectorView,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MapFillView {
    pub map: String,
    pub entries: usize,
    pub capacity: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteEndpointView {
    pub proto: String,
    /// `address:port`.
    pub remote: String,
    /// Ports of the node address its flows hold.
    pub ports: usize,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectorView {
    pub passes: u64,
    pub last_pass_microseconds: u64,
    pub expired: u64,
    pub orphans: u64,
}

/// One flow, as `vpcnet-agent nat` prints it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowView {
    /// `tcp`, `udp`, `icmp`.
    pub proto: String,
    /// `snat` (a pod's flow, translated), `host` (the node's own, its port
    /// reserved), `nosnat` (tracked, not translated).
    pub kind: String,
    pub state: String,
    /// `address:port` (ICMP: the echo id as the port): the flow's source,
    /// its destination, and the source it was translated to.
    pub original: String,
    pub remote: String,
    pub translated: String,
    /// Seconds since the last packet either way.
    pub idle_seconds: u64,
}

/// `GET /v1/eni-configs`: the ENIConfig custom networking uses on this
/// node. aws-node answers with the ENIConfig's name alone (a JSON string,
/// from the Node's labels); vpcnet with what new ENIs get from it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EniConfigView {
    /// `AWS_VPC_K8S_CNI_CUSTOM_NETWORK_CFG`: whether it is used at all.
    pub custom_networking: bool,
    /// The ENIConfig's name; `None`: the subnet and groups come from
    /// variables, not from an ENIConfig object.
    pub name: Option<String>,
    /// The subnet of new ENIs (an ENIConfig's `spec.subnet`).
    pub subnet: Option<String>,
    /// Their security groups (`spec.securityGroups`; empty: the primary
    /// ENI's).
    pub security_groups: Vec<String>,
    /// Where the above comes from.
    pub source: String,
}

/// `GET /v1/config`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConfigView {
    pub datapath: DatapathConfigView,
    /// The primary ENI's link (SNAT leaves by it).
    pub primary_interface: String,
    /// Links the programs are attached to (ENIs and pods' host veths).
    pub attached_interfaces: Vec<String>,
    /// The address manager's settings by the VPC CNI's variable names,
    /// `None` without `--ipam`.
    pub ipam: Option<serde_json::Map<String, serde_json::Value>>,
    /// Where introspection and metrics are served (`None`: disabled).
    pub introspection_address: Option<String>,
    pub metrics_address: Option<String>,
}

/// The datapath's configuration map and CIDRs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatapathConfigView {
    /// SNAT's source address.
    pub node_address: Ipv4Addr,
    /// `AWS_VPC_K8S_CNI_EXTERNALSNAT`.
    pub external_snat: bool,
    /// `AWS_VPC_K8S_CNI_RANDOMIZESNAT`: `none`, `hashrandom` or `prng`.
    pub randomize_snat: String,
    /// SNAT's source ports, inclusive.
    pub port_min: u16,
    pub port_max: u16,
    /// The CIDR map by kind: `vpc`, `excluded`, `local`, `service`.
    pub cidrs: BTreeMap<String, Vec<String>>,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn entry() -> EndpointEntryView {
        EndpointEntryView {
            ifindex: 12,
            interface: Some("eni1234".into()),
            eni_ifindex: 2,
            eni_interface: Some("eth0".into()),
            mac: "02:00:00:00:00:01".into(),
            host_mac: "02:00:00:00:00:02".into(),
            branch: false,
            strict: false,
            programs_attached: true,
        }
    }

    #[test]
    fn pods_shape() {
        let view = PodsView {
            ipam: true,
            count: 1,
            pods: vec![PodView {
                namespace: "default".into(),
                name: "web-0".into(),
                container_id: "c0ffee".into(),
                network: "aws-cni".into(),
                ifname: "eth0".into(),
                address: Ipv4Addr::new(10, 20, 11, 20),
                eni: Some("eni-0".into()),
                device_number: Some(0),
                host_veth: Some("eni1234".into()),
                endpoint: Some(entry()),
            }],
            datapath_only: vec![EndpointView {
                address: Ipv4Addr::new(10, 20, 11, 21),
                entry: entry(),
            }],
        };
        let value = serde_json::to_value(&view).unwrap();
        assert_eq!(value["pods"][0]["address"], "10.20.11.20");
        assert_eq!(value["pods"][0]["endpoint"]["eni_interface"], "eth0");
        // The entry's fields sit next to the address, not under a key.
        assert_eq!(
            value["datapath_only"][0],
            json!({
                "address": "10.20.11.21", "ifindex": 12, "interface": "eni1234",
                "eni_ifindex": 2, "eni_interface": "eth0",
                "mac": "02:00:00:00:00:01", "host_mac": "02:00:00:00:00:02",
                "branch": false, "strict": false, "programs_attached": true,
            })
        );
        let back: PodsView = serde_json::from_value(value).unwrap();
        assert_eq!(back, view);
    }

    #[test]
    fn enis_shape() {
        let view = EnisView {
            ipam: true,
            count: 1,
            max_enis: Some(3),
            total_addresses: 1,
            assigned_addresses: 1,
            enis: vec![EniView {
                id: "eni-0".into(),
                device_number: 0,
                mac: "02:ee:0a:14:0b:a2".into(),
                attachment_id: Some("eni-attach-0".into()),
                primary: true,
                no_manage: false,
                excluded_for_pods: false,
                subnet: "10.20.11.0/24".into(),
                gateway: Ipv4Addr::new(10, 20, 11, 1),
                primary_address: Some(Ipv4Addr::new(10, 20, 11, 162)),
                link: Some(LinkView {
                    name: "eth0".into(),
                    ifindex: 2,
                }),
                datapath: Some(DatapathEniEntryView {
                    gateway: Ipv4Addr::new(10, 20, 11, 1),
                    primary: true,
                    branch: false,
                    programs_attached: true,
                }),
                total_addresses: 1,
                assigned_addresses: 1,
                prefixes: vec![],
                addresses: vec![AddressView {
                    address: Ipv4Addr::new(10, 20, 11, 20),
                    prefix: None,
                    pod: Some(PodRef {
                        namespace: "default".into(),
                        name: "web-0".into(),
                        container_id: "c0ffee".into(),
                    }),
                }],
            }],
            datapath_only: vec![],
        };
        let value = serde_json::to_value(&view).unwrap();
        assert_eq!(
            value["enis"][0]["link"],
            json!({"name": "eth0", "ifindex": 2})
        );
        assert_eq!(value["enis"][0]["addresses"][0]["pod"]["name"], "web-0");
        assert_eq!(value["enis"][0]["addresses"][0]["prefix"], json!(null));
        let back: EnisView = serde_json::from_value(value).unwrap();
        assert_eq!(back, view);
    }

    #[test]
    fn nat_and_config_shapes() {
        let nat = NatView {
            total: 2,
            table_size: 262_144,
            limit: 1,
            returned: 1,
            truncated: true,
            flows: vec![FlowView {
                proto: "tcp".into(),
                kind: "snat".into(),
                state: "established".into(),
                original: "10.20.11.20:40000".into(),
                remote: "203.0.113.10:80".into(),
                translated: "10.20.11.162:1025".into(),
                idle_seconds: 3,
            }],
        };
        let value = serde_json::to_value(&nat).unwrap();
        assert_eq!(value["flows"][0]["translated"], "10.20.11.162:1025");
        assert_eq!(value["truncated"], true);

        let config = ConfigView {
            datapath: DatapathConfigView {
                node_address: Ipv4Addr::new(10, 20, 11, 162),
                external_snat: false,
                randomize_snat: "prng".into(),
                port_min: 1024,
                port_max: 65535,
                cidrs: BTreeMap::from([("vpc".into(), vec!["10.20.0.0/16".into()])]),
            },
            primary_interface: "eth0".into(),
            attached_interfaces: vec!["eth0".into()],
            ipam: None,
            introspection_address: Some("127.0.0.1:61679".into()),
            metrics_address: None,
        };
        let value = serde_json::to_value(&config).unwrap();
        assert_eq!(value["datapath"]["cidrs"]["vpc"][0], "10.20.0.0/16");
        assert_eq!(value["ipam"], json!(null));
        assert_eq!(value["metrics_address"], json!(null));
    }
}
