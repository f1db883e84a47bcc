//! NetworkPolicy that aws-node's node agent (`aws-eks-nodeagent`, the
//! network policy agent) enforced on the node, taken over without a gap.
//! Its programs sit on each pod's host veth (their pins under
//! `/sys/fs/bpf/globals/aws/programs`; `vpcnet_common::aws_network_policy`).
//!
//! vpcnet enforces the same policies, from the same PolicyEndpoints (or
//! NetworkPolicies), before it takes a pod: the pods' rules are in its
//! maps and its enforcement is on before any pod gets its datapath entry,
//! the connections conntrack saw replied are tracked as let through, and
//! only once a pod's programs are attached do aws-node's filters go from
//! its veth. On TCX vpcnet's programs run before the clsact filters; on
//! clsact aws-node's run first (priority 1) until they are deleted, an
//! atomic step. Their pins stay: they are what aws-node's agent recovers
//! from when the node is handed back.

use std::{
    io,
    path::{Path, PathBuf},
};

use aya::programs::{TcAttachType, links::Link as _, tc};
use tracing::debug;
use vpcnet_common::aws_network_policy::{FILTER_HANDLE, FILTER_PRIORITY};

/// Where the network policy agent pins its programs.
pub const NETWORK_POLICY_PROGRAMS_DIR: &str = vpcnet_common::aws_network_policy::PROGRAMS_DIR;
/// The pinned programs' name endings.
const PROGRAM_SUFFIXES: [&str; 2] = ["_handle_ingress", "_handle_egress"];

/// What the network policy agent left on the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Enforcement {
    pub dir: PathBuf,
    /// The pinned programs' names, sorted.
    pub programs: Vec<String>,
}

/// The network policy agent's pinned programs in `dir`; `None` when there
/// are none (or no such directory).
pub fn detect(dir: &Path) -> io::Result<Option<Enforcement>> {
    let entries = match std::fs::read_dir(dir) {
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
    Ok((!programs.is_empty()).then(|| Enforcement {
        dir: dir.to_owned(),
        programs,
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
}

/// The enforcement found in `dir`, to be taken over; refused when vpcnet
/// would not enforce network policy itself.
pub fn check(policy_enabled: bool, dir: &Path) -> Result<Option<Enforcement>, PolicyNodeError> {
    let found = detect(dir).map_err(|source| PolicyNodeError::Read {
        dir: dir.to_owned(),
        source,
    })?;
    match found {
        Some(enforcement) if !policy_enabled => Err(PolicyNodeError::Unenforced(enforcement)),
        found => Ok(found),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_policy_programs_refuse_the_take_over_only_without_policy() {
        let dir = std::env::temp_dir().join(format!("vpcnet-np-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(check(false, &dir).unwrap().is_none());
        assert!(check(false, &dir.join("absent")).unwrap().is_none());
        for name in [
            "web-7d4b9@default_handle_ingress",
            "web-7d4b9@default_handle_egress",
            "other_map",
        ] {
            std::fs::write(dir.join(name), "").unwrap();
        }
        let refusal = check(false, &dir).unwrap_err().to_string();
        assert!(refusal.contains("2 programs pinned"), "{refusal}");
        assert!(refusal.contains("ENABLE_NETWORK_POLICY=true"), "{refusal}");
        assert_eq!(check(true, &dir).unwrap().unwrap().programs.len(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
