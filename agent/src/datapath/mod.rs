//! The datapath manager: loads the embedded programs, pins their maps,
//! attaches the programs to ENIs and fills the maps.

mod error;
mod maps;
mod nat;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    programs::{SchedClassifier, TcAttachType, tc::SchedClassifierLinkId},
};
pub use error::DatapathError;
pub use maps::DatapathMaps;
pub use nat::{Flow, GcStats, monotonic_now_ns};
use vpcnet_common::maps as names;

/// The compiled programs (see build.rs); empty when built without bpf-linker.
pub static PROGRAMS: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/vpcnet.bpf.o"));

/// Where bpffs is mounted.
const BPFFS: &str = "/sys/fs/bpf";

#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Maps are pinned here and reused from here when already pinned.
    pub pin_dir: PathBuf,
    /// Flows each NAT map holds.
    pub nat_entries: u32,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            pin_dir: PathBuf::from(names::PIN_DIR),
            nat_entries: names::NAT_DEFAULT_ENTRIES,
        }
    }
}

/// The loaded programs and their maps.
pub struct Datapath {
    ebpf: Ebpf,
    pub maps: DatapathMaps,
    pin_dir: PathBuf,
    /// Attachments per interface: (egress, ingress).
    links: BTreeMap<String, (SchedClassifierLinkId, SchedClassifierLinkId)>,
}

impl Datapath {
    /// Loads the programs, reusing maps already pinned in `pin_dir` (so a
    /// restarted agent keeps every flow) and pinning the others there.
    pub fn load(opts: &LoadOptions) -> Result<Self, DatapathError> {
        if PROGRAMS.is_empty() {
            return Err(DatapathError::NoPrograms);
        }
        ensure_bpffs(&opts.pin_dir)?;
        std::fs::create_dir_all(&opts.pin_dir).map_err(|source| DatapathError::PinDir {
            path: opts.pin_dir.clone(),
            source,
        })?;
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(&opts.pin_dir)
            .map_max_entries(names::NAT_FWD, opts.nat_entries)
            .map_max_entries(names::NAT_REV, opts.nat_entries)
            .load(PROGRAMS)?;
        for name in [
            names::PROG_ENI_EGRESS,
            names::PROG_ENI_INGRESS,
            names::PROG_POD_EGRESS,
            names::PROG_POD_INGRESS,
        ] {
            let program = classifier_mut(&mut ebpf, name)?;
            program
                .load()
                .map_err(|source| DatapathError::Program { name, source })?;
        }
        let maps = DatapathMaps::from_ebpf(&mut ebpf)?;
        Ok(Self {
            ebpf,
            maps,
            pin_dir: opts.pin_dir.clone(),
            links: BTreeMap::new(),
        })
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// A loaded program, e.g. to run it on a crafted packet.
    pub fn program(&self, name: &'static str) -> Result<&SchedClassifier, DatapathError> {
        self.ebpf
            .program(name)
            .ok_or(DatapathError::MissingProgram(name))?
            .try_into()
            .map_err(|source| DatapathError::Program { name, source })
    }

    /// Attaches the ENI programs to `iface` (tc egress and ingress, TCX where
    /// the kernel has it). Attaching twice is a no-op.
    pub fn attach_eni(&mut self, iface: &str) -> Result<(), DatapathError> {
        self.attach_pair(iface, names::PROG_ENI_EGRESS, names::PROG_ENI_INGRESS)
    }

    /// Attaches the pod programs to a pod's host veth `iface`: what the pod
    /// sends arrives on the veth's tc ingress, what the stack hands it
    /// leaves by its tc egress.
    pub fn attach_pod(&mut self, iface: &str) -> Result<(), DatapathError> {
        self.attach_pair(iface, names::PROG_POD_INGRESS, names::PROG_POD_EGRESS)
    }

    /// Attaches `on_egress` to tc egress and `on_ingress` to tc ingress.
    fn attach_pair(
        &mut self,
        iface: &str,
        on_egress: &'static str,
        on_ingress: &'static str,
    ) -> Result<(), DatapathError> {
        if self.links.contains_key(iface) {
            return Ok(());
        }
        if nix::net::if_::if_nametoindex(iface).is_err() {
            return Err(DatapathError::NoInterface(iface.to_owned()));
        }
        let egress = attach(&mut self.ebpf, on_egress, iface, TcAttachType::Egress)?;
        let ingress = match attach(&mut self.ebpf, on_ingress, iface, TcAttachType::Ingress) {
            Ok(link) => link,
            Err(e) => {
                let _ = classifier_mut(&mut self.ebpf, on_egress).map(|p| p.detach(egress));
                return Err(e);
            }
        };
        self.links.insert(iface.to_owned(), (egress, ingress));
        Ok(())
    }

    /// Interfaces the programs are attached to.
    pub fn attached(&self) -> impl Iterator<Item = &str> {
        self.links.keys().map(String::as_str)
    }

    /// Removes the pins: the maps live on only while this process holds them.
    pub fn unpin(&self) -> std::io::Result<()> {
        remove_pins(&self.pin_dir)
    }
}

/// Removes every map pin in `pin_dir`, then the directory if empty.
pub fn remove_pins(pin_dir: &Path) -> std::io::Result<()> {
    for name in names::ALL {
        match std::fs::remove_file(pin_dir.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    match std::fs::remove_dir(pin_dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn classifier_mut<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut SchedClassifier, DatapathError> {
    ebpf.program_mut(name)
        .ok_or(DatapathError::MissingProgram(name))?
        .try_into()
        .map_err(|source| DatapathError::Program { name, source })
}

fn attach(
    ebpf: &mut Ebpf,
    name: &'static str,
    iface: &str,
    direction: TcAttachType,
) -> Result<SchedClassifierLinkId, DatapathError> {
    let program = classifier_mut(ebpf, name)?;
    program
        .attach(iface, direction)
        .map_err(|source| DatapathError::Program { name, source })
}

/// Mounts bpffs at /sys/fs/bpf when `pin_dir` is under it and it is not
/// mounted yet (containers and minimal hosts often lack it).
fn ensure_bpffs(pin_dir: &Path) -> Result<(), DatapathError> {
    if !pin_dir.starts_with(BPFFS) || bpffs_mounted() {
        return Ok(());
    }
    nix::mount::mount(
        Some("bpf"),
        BPFFS,
        Some("bpf"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .map_err(|source| DatapathError::MountBpffs {
        path: PathBuf::from(BPFFS),
        source,
    })
}

fn bpffs_mounted() -> bool {
    std::fs::read_to_string("/proc/self/mounts").is_ok_and(|mounts| {
        mounts.lines().any(|line| {
            let mut fields = line.split_whitespace();
            let _source = fields.next();
            fields.next() == Some(BPFFS) && fields.next() == Some("bpf")
        })
    })
}
