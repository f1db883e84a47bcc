use std::path::PathBuf;

/// Everything that can go wrong managing the datapath.
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    #[error(
        "this agent was built without its eBPF programs (bpf-linker was missing); \
         run `cargo xtask setup` and build again"
    )]
    NoPrograms,
    #[error("mounting bpffs at {path}")]
    MountBpffs {
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error("creating pin directory {path}")]
    PinDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("loading the eBPF object")]
    Load(#[from] aya::EbpfError),
    #[error(
        "kernel {release} is too old: vpcnet needs Linux {}.{} or later",
        super::verifier::MIN_KERNEL.0,
        super::verifier::MIN_KERNEL.1
    )]
    KernelTooOld { release: String },
    #[error(
        "kernel {release} cannot load BTF (CONFIG_DEBUG_INFO_BTF), which the programs' \
         callbacks need: vpcnet needs Linux {}.{} or later built with BTF",
        super::verifier::MIN_KERNEL.0,
        super::verifier::MIN_KERNEL.1
    )]
    NoBtf { release: String },
    #[error(
        "the verifier of kernel {release} refused program {program}: {reason}; vpcnet needs \
         Linux {}.{} or later (the full log is at debug level: RUST_LOG=debug)",
        super::verifier::MIN_KERNEL.0,
        super::verifier::MIN_KERNEL.1
    )]
    Refused {
        program: &'static str,
        release: String,
        reason: String,
    },
    #[error("counting the possible CPUs (for a per-CPU map's entry)")]
    Cpus(#[source] std::io::Error),
    #[error("program {0} is missing from the eBPF object")]
    MissingProgram(&'static str),
    #[error("map {0} is missing from the eBPF object")]
    MissingMap(&'static str),
    #[error("program {name}")]
    Program {
        name: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("map {name}")]
    Map {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("opening pinned map {path}")]
    OpenPinned {
        path: PathBuf,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("interface {0} not found")]
    NoInterface(String),
    #[error("{var}={value:?}: not tcx or clsact", var = super::tc::ENV_TC_ATTACH, value = .0)]
    AttachMode(String),
    #[error(
        "adding a clsact qdisc to {iface}: this kernel has no clsact (sch_ingress) and no TCX; \
         vpcnet needs one of them"
    )]
    Clsact {
        iface: String,
        #[source]
        source: aya::programs::tc::TcError,
    },
    #[error("program pin {path}")]
    ProgramPin {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("link pin {path}")]
    LinkPin {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("pinned link {path}")]
    PinnedLink {
        path: PathBuf,
        #[source]
        source: aya::programs::links::LinkError,
    },
}

impl DatapathError {
    pub(crate) fn map(name: &'static str) -> impl FnOnce(aya::maps::MapError) -> Self {
        move |source| Self::Map { name, source }
    }
}
