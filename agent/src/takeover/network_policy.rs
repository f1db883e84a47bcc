//! NetworkPolicy that aws-node's node agent (`aws-eks-nodeagent`, the
//! network policy agent) enforced on the node. It enforces with eBPF
//! programs on each pod's host veth, pinned as
//! `<pod>_handle_ingress` / `<pod>_handle_egress` under
//! `/sys/fs/bpf/globals/aws/programs`. vpcnet does not take that
//! enforcement over without a gap yet: its programs would take the pods
//! before their policies are in its maps, and aws-node's would stay
//! attached with policies nobody updates. So the take-over refuses such a
//! node unless the operator opts in knowingly.

use std::{
    io,
    path::{Path, PathBuf},
};

use crate::env::Env;

/// Where the network policy agent pins its programs.
pub const NETWORK_POLICY_PROGRAMS_DIR: &str = "/sys/fs/bpf/globals/aws/programs";
/// `true`: take a node whose pods had NetworkPolicy enforced over anyway
/// (their policies are enforced again once vpcnet's agent has written
/// them, with `ENABLE_NETWORK_POLICY`).
pub const ENV_TAKE_OVER_POLICY_NODE: &str = "VPCNET_TAKE_OVER_NETWORK_POLICY_NODE";
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
        "aws-node's network policy agent enforced NetworkPolicy on this node ({count} programs pinned in {dir}, e.g. {example}); vpcnet does not take that enforcement over without a gap yet (its pods would be unenforced until vpcnet's agent has written their policies). Keep aws-node on this node, or set {ENV_TAKE_OVER_POLICY_NODE}=true to take it over knowingly (deploy/README.md, \"Network policy\")",
        count = .0.programs.len(),
        dir = .0.dir.display(),
        example = .0.programs[0]
    )]
    Enforced(Enforcement),

    #[error("{ENV_TAKE_OVER_POLICY_NODE}={0:?} is not a boolean")]
    BadOptIn(String),

    #[error("reading {dir}: {source}")]
    Read {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Refuses a node with enforced policies unless the operator opted in;
/// with the opt-in, the enforcement found (to be logged).
pub fn check(env: &Env, dir: &Path) -> Result<Option<Enforcement>, PolicyNodeError> {
    let opted_in = match env.get(ENV_TAKE_OVER_POLICY_NODE) {
        None => false,
        Some(v) => {
            crate::env::parse_go_bool(v).ok_or_else(|| PolicyNodeError::BadOptIn(v.to_owned()))?
        }
    };
    let found = detect(dir).map_err(|source| PolicyNodeError::Read {
        dir: dir.to_owned(),
        source,
    })?;
    match found {
        Some(enforcement) if !opted_in => Err(PolicyNodeError::Enforced(enforcement)),
        found => Ok(found),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_policy_programs_refuse_the_take_over_unless_opted_in() {
        let dir = std::env::temp_dir().join(format!("vpcnet-np-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let none = Env::from_pairs::<&str, &str>([]);
        assert!(check(&none, &dir).unwrap().is_none());
        assert!(check(&none, &dir.join("absent")).unwrap().is_none());
        for name in [
            "web-7d4b9-default_handle_ingress",
            "web-7d4b9-default_handle_egress",
            "other_map",
        ] {
            std::fs::write(dir.join(name), "").unwrap();
        }
        let refusal = check(&none, &dir).unwrap_err().to_string();
        assert!(refusal.contains("2 programs pinned"), "{refusal}");
        assert!(
            refusal.contains("web-7d4b9-default_handle_egress"),
            "{refusal}"
        );
        let opted_in = Env::from_pairs([(ENV_TAKE_OVER_POLICY_NODE, "true")]);
        assert_eq!(check(&opted_in, &dir).unwrap().unwrap().programs.len(), 2);
        let bad = Env::from_pairs([(ENV_TAKE_OVER_POLICY_NODE, "sure")]);
        assert!(matches!(
            check(&bad, &dir),
            Err(PolicyNodeError::BadOptIn(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
