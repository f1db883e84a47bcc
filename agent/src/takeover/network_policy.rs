//! NetworkPolicy that aws-node's node agent (`aws-eks-nodeagent`, the
//! network policy agent) enforced on the node, taken over without a gap.
//! Its programs sit on each pod's host veth (their pins under
//! `/sys/fs/bpf/globals/aws/programs`; `vpcnet_common::aws_network_policy`).
//!
//! vpcnet enforces the same policies, from the same PolicyEndpoints (or
//! NetworkPolicies), before it takes a pod: the pods' rules are in its
//! maps and its enforcement is on before any pod gets its datapath entry,
//! the connections conntrack saw answered and those aws-node's tracker
//! holds ([`tracked_flows`]) are tracked as let through, and only once a
//! pod's programs are attached do aws-node's filters go from its veth. On
//! TCX vpcnet's programs run before the clsact filters; on clsact
//! aws-node's run first (priority 1) until they are deleted, an atomic
//! step. Their pins stay: the hand-back ([`hand_back`]) puts the programs
//! back, and aws-node's agent recovers from them.

use std::{
    collections::BTreeSet,
    io,
    net::Ipv4Addr,
    path::{Path, PathBuf},
};

use aya::{
    maps::{HashMap, Map, MapData, MapError},
    programs::{ProgramError, SchedClassifier, TcAttachType, links::Link as _, tc},
};
use tracing::debug;
use vpcnet_api::aws_network_policy::pin_name;
pub use vpcnet_common::aws_network_policy::PINS_ROOT;
use vpcnet_common::{
    aws_network_policy::{
        CONNTRACK_MAP, ConntrackKey, ConntrackValue, EGRESS_POD_STATE_MAP, EGRESS_PROGRAM,
        FILTER_HANDLE, FILTER_PRIORITY, INGRESS_POD_STATE_MAP, INGRESS_PROGRAM, MAPS,
        POD_STATE_CLUSTER_POLICY, POD_STATE_NETWORK_POLICY, POLICIES_APPLIED, PROGRAMS, PodState,
        conntrack_states,
    },
    nat::FlowKey,
    policy::{FLOW_REVOKED, OPENED_BY_KEY_DESTINATION, PolicyFlow},
    port_to_raw, raw_to_addr, raw_to_port,
};
/// The pinned programs' name endings.
const PROGRAM_SUFFIXES: [&str; 2] = ["_handle_ingress", "_handle_egress"];

/// What the network policy agent left on the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Enforcement {
    pub dir: PathBuf,
    /// The pinned programs' names, sorted.
    pub programs: Vec<String>,
    /// The pods (by the agent's identifiers) it judged by
    /// ClusterNetworkPolicy too ([`cluster_policy_pods`]).
    pub cluster_policy_pods: Vec<String>,
}

/// The network policy agent's pinned programs under `root`; `None` when
/// there are none (or no such directory).
pub fn detect(root: &Path) -> io::Result<Option<Enforcement>> {
    let dir = root.join(PROGRAMS);
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut programs = Vec::new();
    for entry in entries {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if PROGRAM_SUFFIXES.iter().any(|s| name.ends_with(s)) {
            programs.push(name);
        }
    }
    programs.sort();
    Ok((!programs.is_empty()).then_some(Enforcement {
        dir,
        programs,
        cluster_policy_pods: Vec::new(),
    }))
}

/// Why the take-over does not happen.
#[derive(Debug, thiserror::Error)]
pub enum PolicyNodeError {
    #[error(
        "aws-node's network policy agent enforced NetworkPolicy on this node ({count} programs pinned in {dir}, e.g. {example}), and vpcnet's network policy is off: taking the node over would end that enforcement. Set ENABLE_NETWORK_POLICY=true (as aws-node's ConfigMap has it where its agent enforces) and vpcnet takes the enforcement over without a gap (deploy/README.md, \"Network policy\")",
        count = .0.programs.len(),
        dir = .0.dir.display(),
        example = .0.programs[0]
    )]
    Unenforced(Enforcement),

    #[error("reading {dir}: {source}")]
    Read {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error(transparent)]
    Pins(#[from] AwsPinsError),
}

/// The enforcement found under `root`, to be taken over; refused when
/// vpcnet would not enforce network policy itself.
pub fn check(policy_enabled: bool, root: &Path) -> Result<Option<Enforcement>, PolicyNodeError> {
    let found = detect(root).map_err(|source| PolicyNodeError::Read {
        dir: root.join(PROGRAMS),
        source,
    })?;
    match found {
        Some(enforcement) if !policy_enabled => Err(PolicyNodeError::Unenforced(enforcement)),
        Some(enforcement) => Ok(Some(Enforcement {
            cluster_policy_pods: cluster_policy_pods(root)?,
            ..enforcement
        })),
        None => Ok(None),
    }
}

/// The pod identifiers whose pinned pod states under `root` say a
/// `ClusterNetworkPolicy` selects them (aws-node's node agent from v1.3
/// keeps a second state per pod for its cluster-policy tier).
pub fn cluster_policy_pods(root: &Path) -> Result<Vec<String>, PolicyNodeError> {
    let dir = root.join(MAPS);
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(PolicyNodeError::Read { dir, source }),
    };
    let mut pods = BTreeSet::new();
    for entry in entries {
        let entry = entry.map_err(|source| PolicyNodeError::Read {
            dir: dir.clone(),
            source,
        })?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(identifier) = [INGRESS_POD_STATE_MAP, EGRESS_POD_STATE_MAP]
            .iter()
            .find_map(|map| name.strip_suffix(map)?.strip_suffix('_'))
        else {
            continue;
        };
        let path = entry.path();
        let states: HashMap<MapData, u32, PodState> = MapData::from_pin(&path)
            .map(Map::HashMap)
            .and_then(HashMap::try_from)
            .map_err(|source| AwsPinsError::Map { path, source })?;
        if states
            .get(&POD_STATE_CLUSTER_POLICY, 0)
            .is_ok_and(|state| state.state == POLICIES_APPLIED)
        {
            pods.insert(identifier.to_owned());
        }
    }
    Ok(pods.into_iter().collect())
}

/// Deletes the network policy agent's filters from both hooks of `veth`
/// (in the current network namespace). Returns how many there were.
pub fn detach_filters(veth: &str) -> usize {
    let mut detached = 0;
    for hook in [TcAttachType::Ingress, TcAttachType::Egress] {
        let Ok(filter) = tc::SchedClassifierLink::attached(
            veth,
            hook,
            FILTER_PRIORITY,
            tc::TcHandle::new(0, FILTER_HANDLE),
            None,
        ) else {
            continue;
        };
        match filter.detach() {
            Ok(()) => detached += 1,
            Err(e) => debug!(veth, ?hook, error = %e, "no filter of aws-node's to delete"),
        }
    }
    detached
}

/// A pod handed back, as aws-node's network policy agent knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HandedBackPod {
    pub addr: Ipv4Addr,
    /// Its host veth.
    pub ifindex: u32,
    /// The agent's identifier of it (`vpcnet_api::aws_network_policy`).
    pub identifier: String,
}

/// What handing the enforcement back did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyHandBack {
    /// aws-node's filters put back on the pods' veths.
    pub filters: usize,
    /// Connections written into aws-node's tracker, one entry per pod end.
    pub flows: usize,
}

/// Reading or writing what aws-node's network policy agent pinned.
#[derive(Debug, thiserror::Error)]
pub enum AwsPinsError {
    #[error("opening aws-node's pinned map {path}")]
    Map {
        path: PathBuf,
        #[source]
        source: MapError,
    },
    #[error("reading or writing aws-node's connection tracker")]
    Track(#[source] MapError),
    #[error("putting aws-node's {program} ({path}) back on {veth}")]
    Program {
        program: &'static str,
        path: PathBuf,
        veth: String,
        #[source]
        source: Box<ProgramError>,
    },
}

/// Hands the enforcement back to aws-node's network policy agent, as it
/// expects to find the node when it starts: the connections vpcnet let
/// through in its tracker (so their replies pass its programs), then its
/// pinned programs on the veths of the pods it knows (their identifier's
/// pins are under `root`), while vpcnet's still judge. Its agent then
/// recovers from its pins and reconciles the policies. Pods whose
/// identifier has no pins (started under vpcnet, no sibling aws-node
/// knew) get its programs when a policy selects them.
pub fn hand_back(
    root: &Path,
    pods: &[HandedBackPod],
    flows: &[(FlowKey, PolicyFlow)],
) -> Result<PolicyHandBack, AwsPinsError> {
    let maps = root.join(MAPS);
    let programs = root.join(PROGRAMS);
    let with_pins: Vec<&HandedBackPod> = pods
        .iter()
        .filter(|pod| {
            programs
                .join(pin_name(&pod.identifier, INGRESS_PROGRAM))
                .exists()
        })
        .collect();
    let mut done = PolicyHandBack::default();
    if with_pins.is_empty() {
        return Ok(done);
    }
    done.flows = track_flows(&maps, &with_pins, flows)?;
    done.filters = put_programs_back(&programs, &with_pins)?;
    Ok(done)
}

/// The connections aws-node's tracker under `root` let through for
/// `pods`, as their openers sent them (it tracks a connection the way its
/// first packet went, once per pod whose rules allowed it). A connection
/// between two of `pods` counts only if both ends' rules allowed it: the
/// sender's entry alone is a packet the receiver dropped. None where it
/// has no tracker.
pub fn tracked_flows(root: &Path, pods: &BTreeSet<Ipv4Addr>) -> Result<Vec<FlowKey>, AwsPinsError> {
    let maps = root.join(MAPS);
    if !maps.join(CONNTRACK_MAP).exists() {
        return Ok(Vec::new());
    }
    let tracker = open_tracker(&maps)?;
    let local = |raw: u32| pods.contains(&Ipv4Addr::from(raw_to_addr(raw)));
    let mut allowed_by: std::collections::HashMap<FlowKey, BTreeSet<u32>> =
        std::collections::HashMap::new();
    for entry in tracker.keys() {
        let key = entry.map_err(AwsPinsError::Track)?;
        if local(key.owner_ip) {
            let flow = FlowKey::new(
                key.src_ip,
                key.dest_ip,
                port_to_raw(key.src_port),
                port_to_raw(key.dest_port),
                key.protocol,
            );
            allowed_by.entry(flow).or_default().insert(key.owner_ip);
        }
    }
    Ok(allowed_by
        .into_iter()
        .filter(|(flow, owners)| {
            [flow.saddr, flow.daddr]
                .into_iter()
                .all(|end| !local(end) || owners.contains(&end))
        })
        .map(|(flow, _)| flow)
        .collect())
}

/// aws-node's pinned connection tracker in `maps`.
fn open_tracker(
    maps: &Path,
) -> Result<HashMap<MapData, ConntrackKey, ConntrackValue>, AwsPinsError> {
    let path = maps.join(CONNTRACK_MAP);
    MapData::from_pin(&path)
        .map(Map::LruHashMap)
        .and_then(HashMap::try_from)
        .map_err(|source| AwsPinsError::Map { path, source })
}

/// Writes the connections vpcnet let through into aws-node's tracker,
/// for each end that is one of `pods`. Returns how many entries.
fn track_flows(
    maps: &Path,
    pods: &[&HandedBackPod],
    flows: &[(FlowKey, PolicyFlow)],
) -> Result<usize, AwsPinsError> {
    let mut written = 0;
    let mut tracker = open_tracker(maps)?;
    let now = crate::datapath::monotonic_now_ns();
    for (key, flow) in flows
        .iter()
        .filter(|(_, flow)| flow.revoked != FLOW_REVOKED)
    {
        let opened = if flow.opener == OPENED_BY_KEY_DESTINATION {
            key.reversed()
        } else {
            *key
        };
        let ends = [
            (opened.saddr, EGRESS_POD_STATE_MAP),
            (opened.daddr, INGRESS_POD_STATE_MAP),
        ];
        for (owner, states_map) in ends {
            let owner_addr = Ipv4Addr::from(raw_to_addr(owner));
            let Some(pod) = pods.iter().find(|pod| pod.addr == owner_addr) else {
                continue;
            };
            let states = pod_states(&maps.join(pin_name(&pod.identifier, states_map)));
            let entry = ConntrackKey {
                src_ip: opened.saddr,
                src_port: raw_to_port(opened.sport),
                dest_ip: opened.daddr,
                dest_port: raw_to_port(opened.dport),
                protocol: opened.proto,
                owner_ip: owner,
                ifindex: pod.ifindex,
                ..ConntrackKey::default()
            };
            let value = ConntrackValue {
                states,
                last_seen_ns: now,
            };
            tracker
                .insert(entry, value, 0)
                .map_err(AwsPinsError::Track)?;
            written += 1;
        }
    }
    Ok(written)
}

/// aws-node's pinned programs back on the veths of `pods`. Returns how
/// many filters.
fn put_programs_back(programs: &Path, pods: &[&HandedBackPod]) -> Result<usize, AwsPinsError> {
    let mut attached = 0;
    for pod in pods {
        let Ok(veth) = nix::net::if_::if_indextoname(pod.ifindex) else {
            continue;
        };
        let veth = veth.to_string_lossy().into_owned();
        for (program, hook) in PROGRAM_HOOKS {
            let path = programs.join(pin_name(&pod.identifier, program));
            let err = |source| AwsPinsError::Program {
                program,
                path: path.clone(),
                veth: veth.clone(),
                source: Box::new(source),
            };
            let mut classifier = SchedClassifier::from_pin(&path).map_err(err)?;
            attach_as_aws_node(&mut classifier, &veth, hook).map_err(err)?;
            attached += 1;
        }
    }
    Ok(attached)
}

/// Where each of the agent's programs sits on a pod's host veth: what
/// reaches the pod leaves the veth.
pub const PROGRAM_HOOKS: [(&str, TcAttachType); 2] = [
    (INGRESS_PROGRAM, TcAttachType::Egress),
    (EGRESS_PROGRAM, TcAttachType::Ingress),
];

/// Attaches `program` to `veth`'s `hook` as aws-node's network policy
/// agent does: a clsact `cls_bpf` filter at its priority and handle,
/// whose program is replaced in place when the filter is there. The filter
/// outlives this process.
///
/// # Errors
/// The qdisc or the filter cannot be made.
pub fn attach_as_aws_node(
    program: &mut SchedClassifier,
    veth: &str,
    hook: TcAttachType,
) -> Result<(), ProgramError> {
    let _ = tc::qdisc_add_clsact(veth);
    let handle = tc::TcHandle::new(0, FILTER_HANDLE);
    let existing = tc::SchedClassifierLink::attached(veth, hook, FILTER_PRIORITY, handle, None)
        .map_err(|e| ProgramError::TcError(tc::TcError::IoError(e)))?;
    let id = program.attach_to_link(existing).or_else(|_| {
        program.attach_with_options(
            veth,
            hook,
            tc::TcAttachOptions::Netlink(tc::NlOptions {
                priority: FILTER_PRIORITY,
                handle,
                classid: None,
            }),
        )
    })?;
    std::mem::forget(program.take_link(id)?);
    Ok(())
}

/// A pod's states as aws-node's tracker records them, from its pinned
/// state map; "policies applied" when it cannot be read.
fn pod_states(path: &Path) -> u64 {
    let read = || -> Option<(u8, u8)> {
        let map = MapData::from_pin(path).ok()?;
        let states: HashMap<MapData, u32, PodState> = HashMap::try_from(Map::HashMap(map)).ok()?;
        let get = |key| states.get(&key, 0).ok().map(|s| s.state);
        Some((
            get(POD_STATE_NETWORK_POLICY)?,
            get(POD_STATE_CLUSTER_POLICY)?,
        ))
    };
    let (network_policy, cluster_policy) = read().unwrap_or((POLICIES_APPLIED, POLICIES_APPLIED));
    conntrack_states(network_policy, cluster_policy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_policy_programs_refuse_the_take_over_only_without_policy() {
        let root = std::env::temp_dir().join(format!("vpcnet-np-{}", std::process::id()));
        let dir = root.join(PROGRAMS);
        std::fs::create_dir_all(&dir).unwrap();
        assert!(check(false, &root).unwrap().is_none());
        assert!(check(false, &root.join("absent")).unwrap().is_none());
        for name in [
            "web-7d4b9@default_handle_ingress",
            "web-7d4b9@default_handle_egress",
            "other_map",
        ] {
            std::fs::write(dir.join(name), "").unwrap();
        }
        let refusal = check(false, &root).unwrap_err().to_string();
        assert!(refusal.contains("2 programs pinned"), "{refusal}");
        assert!(refusal.contains("ENABLE_NETWORK_POLICY=true"), "{refusal}");
        assert_eq!(check(true, &root).unwrap().unwrap().programs.len(), 2);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
