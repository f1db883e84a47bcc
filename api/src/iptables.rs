//! The node's iptables backend. iptables 1.8 writes either the kernel's
//! legacy tables or nftables, and each sees only its own rules: whoever
//! reads or writes a node's rules must use the backend its kubelet and
//! kube-proxy use (Amazon Linux 2 and Bottlerocket up to Kubernetes 1.33:
//! legacy; Amazon Linux 2023: nft). The backend is told apart as
//! Kubernetes' `iptables-wrappers` does it, by the chains kubelet creates.

use std::{fmt, str::FromStr};

use serde::{Deserialize, Serialize};

/// One of iptables' two backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IptablesBackend {
    /// The kernel's `ip_tables` (`iptables-legacy`).
    Legacy,
    /// nftables through iptables' compatibility layer (`iptables-nft`):
    /// what is assumed when nothing tells.
    #[default]
    Nft,
}

impl IptablesBackend {
    pub const ALL: [Self; 2] = [Self::Legacy, Self::Nft];

    /// Its name, as `--iptables-backend` takes it.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Legacy => "legacy",
            Self::Nft => "nft",
        }
    }

    /// `iptables` of this backend.
    #[must_use]
    pub const fn iptables(self) -> &'static str {
        match self {
            Self::Legacy => "iptables-legacy",
            Self::Nft => "iptables-nft",
        }
    }

    /// `iptables-save` of this backend.
    #[must_use]
    pub const fn save(self) -> &'static str {
        match self {
            Self::Legacy => "iptables-legacy-save",
            Self::Nft => "iptables-nft-save",
        }
    }

    /// `iptables-restore` of this backend.
    #[must_use]
    pub const fn restore(self) -> &'static str {
        match self {
            Self::Legacy => "iptables-legacy-restore",
            Self::Nft => "iptables-nft-restore",
        }
    }

    /// `ip6tables-save` of this backend.
    #[must_use]
    pub const fn save6(self) -> &'static str {
        match self {
            Self::Legacy => "ip6tables-legacy-save",
            Self::Nft => "ip6tables-nft-save",
        }
    }
}

impl fmt::Display for IptablesBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A backend name that is neither `legacy` nor `nft`.
#[derive(Debug, thiserror::Error)]
#[error("unknown iptables backend {0:?} (legacy or nft)")]
pub struct UnknownBackend(String);

impl FromStr for IptablesBackend {
    type Err = UnknownBackend;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|backend| backend.name() == s)
            .ok_or_else(|| UnknownBackend(s.to_owned()))
    }
}

/// The chains kubelet (1.17 and later) creates in the mangle table of the
/// backend it uses.
pub const KUBELET_CHAINS: [&str; 2] = ["KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"];

/// The table [`KUBELET_CHAINS`] are in.
pub const KUBELET_CHAINS_TABLE: &str = "mangle";

/// Whether an `iptables-save` listing declares one of [`KUBELET_CHAINS`].
#[must_use]
pub fn has_kubelet_chains(listing: &str) -> bool {
    listing.lines().any(|line| {
        line.strip_prefix(':')
            .and_then(|declared| declared.split_whitespace().next())
            .is_some_and(|chain| KUBELET_CHAINS.contains(&chain))
    })
}

/// The listings that tell the backend, in the order they are read, each
/// with the backend it names when it declares kubelet's chains: nft's
/// mangle table first (cheap, and the common case), then legacy's whole
/// rule set (`-t mangle` would make the kernel create that legacy table).
#[must_use]
pub fn detection_probes() -> [(IptablesBackend, &'static str, &'static [&'static str]); 4] {
    const MANGLE: &[&str] = &["-t", KUBELET_CHAINS_TABLE];
    let (nft, legacy) = (IptablesBackend::Nft, IptablesBackend::Legacy);
    [
        (nft, nft.save(), MANGLE),
        (nft, nft.save6(), MANGLE),
        (legacy, legacy.save(), &[]),
        (legacy, legacy.save6(), &[]),
    ]
}

/// The node's backend, from `listing(program, args)` (a save command's
/// output, `None` where it failed): the first of [`detection_probes`]
/// declaring kubelet's chains; nft when none does.
pub fn detect(mut listing: impl FnMut(&str, &[&str]) -> Option<String>) -> IptablesBackend {
    detection_probes()
        .into_iter()
        .find(|(_, program, args)| listing(program, args).is_some_and(|l| has_kubelet_chains(&l)))
        .map_or(IptablesBackend::Nft, |(backend, _, _)| backend)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEGACY_NODE: &str = "*mangle\n:PREROUTING ACCEPT [0:0]\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n*nat\n:AWS-SNAT-CHAIN-0 - [0:0]\nCOMMIT\n";
    const EMPTY_MANGLE: &str = "*mangle\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n";

    #[test]
    fn kubelets_chains_name_the_backend_and_nft_is_assumed_otherwise() {
        let legacy = detect(|program, _| {
            Some(if program.contains("legacy") {
                LEGACY_NODE.to_owned()
            } else {
                EMPTY_MANGLE.to_owned()
            })
        });
        assert_eq!(legacy, IptablesBackend::Legacy);
        let nft = detect(|program, args| {
            assert!(
                program.contains("nft") || args.is_empty(),
                "legacy is listed whole, never with -t: {program} {args:?}"
            );
            program
                .contains("nft")
                .then(|| LEGACY_NODE.replace("KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"))
        });
        assert_eq!(nft, IptablesBackend::Nft);
        assert_eq!(detect(|_, _| None), IptablesBackend::Nft);
        assert!(!has_kubelet_chains("-A KUBE-IPTABLES-HINT -j RETURN"));
        assert!(!has_kubelet_chains(":KUBE-IPTABLES-HINTS - [0:0]"));
    }

    #[test]
    fn names_round_trip() {
        for backend in IptablesBackend::ALL {
            assert_eq!(backend.name().parse::<IptablesBackend>().unwrap(), backend);
        }
        assert!("xtables".parse::<IptablesBackend>().is_err());
    }
}
