//! aws-node's network policy agent, as the lab reproduces it for the
//! take-over tests: the pods' PolicyEndpoints written into the tries of
//! the reproduction's programs
//! (`ebpf/vpcnet-ebpf/src/bin/aws_network_policy.rs`), one object per pod
//! identifier, pinned and attached as the agent does
//! (`vpcnet_common::aws_network_policy`), under a pin root of the test's
//! own instead of `/sys/fs/bpf/globals/aws`.
//!
//! The encoding follows the agent's: the node's address always allowed,
//! one trie entry per CIDR with its protocols and ports (at most 24),
//! each `except` a deny entry, a direction no PolicyEndpoint isolates
//! allowed from anywhere, the pod state "policies applied" once rules are
//! written, else the mode's default. Not reproduced: a CIDR inside a
//! broader one inheriting the broader one's ports (the tests use disjoint
//! CIDRs).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap, LpmTrie, MapData, lpm_trie::Key},
    programs::SchedClassifier,
};
use ipnet::Ipv4Net;
use vpcnet_agent::{
    datapath::LAB_AWS_NETWORK_POLICY_OBJECT,
    takeover::network_policy::{PROGRAM_HOOKS, attach_as_aws_node},
};
use vpcnet_api::{
    aws_network_policy::{pin_name, pod_identifier},
    policy_endpoint::{EndpointInfo, ISOLATION_EGRESS, ISOLATION_INGRESS, PolicyEndpointSpec},
};
use vpcnet_common::{
    addr_to_raw,
    aws_network_policy::{
        DEFAULT_ALLOW, DEFAULT_DENY, EGRESS_MAP, EGRESS_POD_STATE_MAP, EGRESS_PROGRAM, INGRESS_MAP,
        INGRESS_POD_STATE_MAP, INGRESS_PROGRAM, MAPS, POD_STATE_CLUSTER_POLICY,
        POD_STATE_NETWORK_POLICY, POLICIES_APPLIED, PORT_RULES, PROGRAMS, PROTOCOL_ANY,
        PROTOCOL_DENY, PodState, PortRule, TrieValue,
    },
};
use vpcnet_lab::{PodInfo, addrs};

/// One direction of a pod's rules as the agent writes them: each prefix's
/// port rules, and the pod state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DirectionRules {
    pub prefixes: BTreeMap<Ipv4Net, Vec<PortRule>>,
    pub state: u8,
}

/// Both directions of a pod's rules.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodRules {
    pub ingress: DirectionRules,
    pub egress: DirectionRules,
}

/// The rules of the pod at `pod_addr` from the PolicyEndpoints that select
/// it; `strict` is the enforcing mode.
#[must_use]
pub fn pod_rules(
    endpoints: &[PolicyEndpointSpec],
    pod_addr: Ipv4Addr,
    node_addr: Ipv4Addr,
    strict: bool,
) -> PodRules {
    let selecting: Vec<&PolicyEndpointSpec> = endpoints
        .iter()
        .filter(|pe| {
            pe.pod_selector_endpoints
                .iter()
                .any(|ep| ep.pod_ip.parse() == Ok(pod_addr))
        })
        .collect();
    let default = if strict { DEFAULT_DENY } else { DEFAULT_ALLOW };
    let direction = |isolation: &str, entries: fn(&PolicyEndpointSpec) -> &[EndpointInfo]| {
        if selecting.is_empty() {
            return DirectionRules {
                prefixes: BTreeMap::new(),
                state: default,
            };
        }
        let infos: Vec<&EndpointInfo> = selecting.iter().flat_map(|pe| entries(pe)).collect();
        let isolated = selecting
            .iter()
            .any(|pe| pe.pod_isolation.iter().any(|i| i == isolation));
        encode(&infos, isolated, node_addr)
    };
    PodRules {
        ingress: direction(ISOLATION_INGRESS, |pe| &pe.ingress),
        egress: direction(ISOLATION_EGRESS, |pe| &pe.egress),
    }
}

fn encode(infos: &[&EndpointInfo], isolated: bool, node_addr: Ipv4Addr) -> DirectionRules {
    let any = PortRule {
        protocol: PROTOCOL_ANY,
        start_port: 0,
        end_port: 0,
    };
    let mut prefixes: BTreeMap<Ipv4Net, Vec<PortRule>> = BTreeMap::new();
    let mut excepts = BTreeSet::new();
    for info in infos {
        let Some(net) = parse_cidr(&info.cidr) else {
            continue;
        };
        let rules = prefixes.entry(net).or_default();
        if info.ports.is_empty() {
            rules.push(any);
        }
        for port in &info.ports {
            rules.push(PortRule {
                protocol: match port.protocol.as_deref() {
                    Some("TCP") => 6,
                    Some("UDP") => 17,
                    Some("SCTP") => 132,
                    _ => PROTOCOL_ANY,
                },
                start_port: port.port.and_then(|p| u32::try_from(p).ok()).unwrap_or(0),
                end_port: port
                    .end_port
                    .and_then(|p| u32::try_from(p).ok())
                    .unwrap_or(0),
            });
        }
        excepts.extend(info.except.iter().filter_map(|e| parse_cidr(e)));
    }
    if prefixes.is_empty() && !isolated {
        prefixes.insert(Ipv4Net::default(), vec![any]);
    }
    for except in excepts {
        prefixes.entry(except).or_insert_with(|| {
            vec![PortRule {
                protocol: PROTOCOL_DENY,
                ..PortRule::default()
            }]
        });
    }
    for rules in prefixes.values_mut() {
        rules.dedup();
        rules.truncate(PORT_RULES);
    }
    prefixes.insert(Ipv4Net::from(node_addr), vec![any]);
    DirectionRules {
        prefixes,
        state: POLICIES_APPLIED,
    }
}

fn parse_cidr(text: &str) -> Option<Ipv4Net> {
    text.parse::<Ipv4Net>()
        .or_else(|_| text.parse::<Ipv4Addr>().map(Ipv4Net::from))
        .ok()
        .map(|net| net.trunc())
}

/// The reproduction's objects, one per pod identifier, pinned under
/// `root` (`programs/`, `maps/`). Dropping it removes the pins; the
/// filters go with the lab's veths.
pub struct AwsPolicyAgent {
    root: PathBuf,
    strict: bool,
    loaded: BTreeMap<String, Ebpf>,
}

impl AwsPolicyAgent {
    /// An agent pinning under `root` (on a bpffs; made here).
    ///
    /// # Panics
    /// The directories cannot be made.
    #[must_use]
    pub fn new(root: &Path, strict: bool) -> Self {
        for dir in [programs_dir(root), maps_dir(root)] {
            std::fs::create_dir_all(&dir)
                .unwrap_or_else(|e| panic!("making {}: {e}", dir.display()));
        }
        Self {
            root: root.to_owned(),
            strict,
            loaded: BTreeMap::new(),
        }
    }

    /// The root of the pins (the agent's `--network-policy-pins`).
    #[must_use]
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The directory of the programs' pins.
    #[must_use]
    pub fn programs_dir(&self) -> PathBuf {
        programs_dir(&self.root)
    }

    /// The directory of the maps' pins.
    #[must_use]
    pub fn maps_dir(&self) -> PathBuf {
        maps_dir(&self.root)
    }

    /// Every pod of `pods` judged by its programs, with the rules of the
    /// PolicyEndpoints that select it, as the agent reconciles them.
    ///
    /// # Panics
    /// Loading, pinning, attaching or writing fails.
    pub fn enforce(&mut self, endpoints: &[PolicyEndpointSpec], pods: &[PodInfo]) {
        for pod in pods {
            let rules = pod_rules(endpoints, pod.addr, addrs::NODE_PRIMARY_ADDR, self.strict);
            let identifier = pod_identifier(&pod.k8s_name, &pod.k8s_namespace);
            let maps_dir = self.maps_dir();
            let programs_dir = self.programs_dir();
            let ebpf = self
                .loaded
                .entry(identifier.clone())
                .or_insert_with(|| load(&identifier, &programs_dir, &maps_dir));
            attach(ebpf, &pod.host_veth);
            write(ebpf, INGRESS_MAP, INGRESS_POD_STATE_MAP, &rules.ingress);
            write(ebpf, EGRESS_MAP, EGRESS_POD_STATE_MAP, &rules.egress);
        }
    }

    /// Marks `pod` selected by a `ClusterNetworkPolicy`, as aws-node's agent
    /// from v1.3 records it in the pod's states (the tier itself is not
    /// reproduced).
    ///
    /// # Panics
    /// The pod is not enforced yet, or its states cannot be written.
    pub fn select_by_cluster_policy(&mut self, pod: &PodInfo) {
        let identifier = pod_identifier(&pod.k8s_name, &pod.k8s_namespace);
        let ebpf = self
            .loaded
            .get_mut(&identifier)
            .unwrap_or_else(|| panic!("{identifier} is not enforced"));
        for states in [INGRESS_POD_STATE_MAP, EGRESS_POD_STATE_MAP] {
            write_state(ebpf, states, POD_STATE_CLUSTER_POLICY, POLICIES_APPLIED);
        }
    }
}

impl Drop for AwsPolicyAgent {
    fn drop(&mut self) {
        self.loaded.clear();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn programs_dir(root: &Path) -> PathBuf {
    root.join(PROGRAMS)
}

fn maps_dir(root: &Path) -> PathBuf {
    root.join(MAPS)
}

fn load(identifier: &str, programs_dir: &Path, maps_dir: &Path) -> Ebpf {
    let object = std::fs::read(LAB_AWS_NETWORK_POLICY_OBJECT)
        .unwrap_or_else(|e| panic!("reading {LAB_AWS_NETWORK_POLICY_OBJECT}: {e}"));
    let mut ebpf = EbpfLoader::new()
        .default_map_pin_directory(maps_dir)
        .load(&object)
        .expect("loading the reproduction of aws-node's policy programs");
    for name in [
        INGRESS_MAP,
        EGRESS_MAP,
        INGRESS_POD_STATE_MAP,
        EGRESS_POD_STATE_MAP,
    ] {
        let map = ebpf.map(name).expect("the object's map");
        map.pin(maps_dir.join(pin_name(identifier, name)))
            .unwrap_or_else(|e| panic!("pinning {name} of {identifier}: {e}"));
    }
    for name in [INGRESS_PROGRAM, EGRESS_PROGRAM] {
        let program: &mut SchedClassifier = ebpf
            .program_mut(name)
            .expect("the object's program")
            .try_into()
            .expect("a classifier");
        program.load().expect("the verifier takes it");
        program
            .pin(programs_dir.join(pin_name(identifier, name)))
            .unwrap_or_else(|e| panic!("pinning {name} of {identifier}: {e}"));
    }
    ebpf
}

/// The identifier's programs on `veth`, as the agent attaches them.
fn attach(ebpf: &mut Ebpf, veth: &str) {
    let veth = veth.to_owned();
    for (name, hook) in PROGRAM_HOOKS {
        let program: &mut SchedClassifier = ebpf
            .program_mut(name)
            .expect("the object's program")
            .try_into()
            .expect("a classifier");
        let veth = veth.clone();
        vpcnet_lab::run_in(addrs::NS_NODE, move || {
            attach_as_aws_node(program, &veth, hook)
                .unwrap_or_else(|e| panic!("attaching {name} to {veth}: {e}"));
        })
        .expect("entering the node");
    }
}

fn write(ebpf: &mut Ebpf, trie: &str, states: &str, rules: &DirectionRules) {
    let mut trie: LpmTrie<&mut MapData, u32, TrieValue> = ebpf
        .map_mut(trie)
        .expect("the trie")
        .try_into()
        .expect("an LPM trie");
    let stale: Vec<Key<u32>> = trie.keys().filter_map(Result::ok).collect();
    for (net, port_rules) in &rules.prefixes {
        let mut value = TrieValue::default();
        for (slot, rule) in value.rules.iter_mut().zip(port_rules) {
            *slot = *rule;
        }
        let key = Key::new(
            u32::from(net.prefix_len()),
            addr_to_raw(net.addr().octets()),
        );
        trie.insert(&key, value, 0).expect("writing a prefix");
    }
    for key in stale {
        let net = Ipv4Net::new(
            Ipv4Addr::from(key.data().to_ne_bytes()),
            u8::try_from(key.prefix_len()).expect("an IPv4 prefix length"),
        )
        .expect("a prefix");
        if !rules.prefixes.contains_key(&net) {
            let _ = trie.remove(&key);
        }
    }
    write_state(ebpf, states, POD_STATE_NETWORK_POLICY, rules.state);
    write_state(ebpf, states, POD_STATE_CLUSTER_POLICY, DEFAULT_ALLOW);
}

/// One of a pod's states (`key`: its network policy or cluster policy
/// tier) into the pod state map `states`.
fn write_state(ebpf: &mut Ebpf, states: &str, key: u32, state: u8) {
    let mut states: HashMap<&mut MapData, u32, PodState> = ebpf
        .map_mut(states)
        .expect("the pod states")
        .try_into()
        .expect("a hash");
    states
        .insert(key, PodState { state }, 0)
        .expect("writing the pod state");
}

#[cfg(test)]
mod tests {
    use vpcnet_api::policy_endpoint::{PodEndpoint, Port};

    use super::*;

    fn info(cidr: &str, except: &[&str], ports: &[(&str, i32)]) -> EndpointInfo {
        EndpointInfo {
            cidr: cidr.to_owned(),
            except: except.iter().map(|e| (*e).to_owned()).collect(),
            ports: ports
                .iter()
                .map(|(protocol, port)| Port {
                    protocol: Some((*protocol).to_owned()),
                    port: Some(*port),
                    end_port: None,
                })
                .collect(),
            ..EndpointInfo::default()
        }
    }

    #[test]
    fn endpoints_are_encoded_as_the_agent_encodes_them() {
        let pod = Ipv4Addr::new(10, 0, 0, 5);
        let node = Ipv4Addr::new(10, 0, 0, 1);
        let pe = PolicyEndpointSpec {
            pod_isolation: vec![ISOLATION_INGRESS.to_owned()],
            pod_selector_endpoints: vec![PodEndpoint {
                pod_ip: pod.to_string(),
                ..PodEndpoint::default()
            }],
            ingress: vec![info("10.1.0.0/16", &["10.1.2.0/24"], &[("TCP", 80)])],
            ..PolicyEndpointSpec::default()
        };
        let rules = pod_rules(std::slice::from_ref(&pe), pod, node, false);
        let tcp80 = PortRule {
            protocol: 6,
            start_port: 80,
            end_port: 0,
        };
        let any = PortRule {
            protocol: PROTOCOL_ANY,
            ..PortRule::default()
        };
        let deny = PortRule {
            protocol: PROTOCOL_DENY,
            ..PortRule::default()
        };
        let net = |s: &str| s.parse::<Ipv4Net>().unwrap();
        assert_eq!(
            rules.ingress,
            DirectionRules {
                prefixes: BTreeMap::from([
                    (net("10.1.0.0/16"), vec![tcp80]),
                    (net("10.1.2.0/24"), vec![deny]),
                    (net("10.0.0.1/32"), vec![any]),
                ]),
                state: POLICIES_APPLIED,
            }
        );
        // Egress is not isolated: allowed from anywhere.
        assert_eq!(
            rules.egress.prefixes.get(&net("0.0.0.0/0")),
            Some(&vec![any])
        );
        // A pod no PolicyEndpoint selects: the mode's default, no rules.
        let other = pod_rules(&[pe], Ipv4Addr::new(10, 0, 0, 6), node, true);
        assert_eq!(other.ingress.state, DEFAULT_DENY);
        assert!(other.ingress.prefixes.is_empty());
    }
}
