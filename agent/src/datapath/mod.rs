//! The datapath manager: loads the embedded programs, pins their maps,
//! attaches the programs to ENIs and fills the maps.

pub(crate) mod batch;
mod carry;
mod error;
pub mod gc;
mod maps;
pub mod metrics;
mod nat;
pub mod pins;
mod programs;
pub mod tc;
pub mod timeouts;
pub mod verifier;

use std::{
    collections::BTreeMap,
    net::Ipv4Addr,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::MapData,
    programs::{
        LinkOrder, SchedClassifier, TcAttachType,
        links::{FdLink, PinnedLink},
        tc::{SchedClassifierLink, TcAttachOptions},
    },
};
use carry::Pass;
pub use carry::read_pinned_flows;
pub use error::DatapathError;
pub use maps::DatapathMaps;
pub use nat::{
    BUSIEST_ENDPOINTS, CollectorReport, EndpointPorts, Flow, GcStats, Judgement, MapFill,
    NatPressure, ORPHAN_GRACE_NS, monotonic_now_ns,
};
pub use programs::ProgramsOrigin;
pub use tc::AttachMode;
use tracing::{info, warn};
use vpcnet_common::{maps as names, nat::FlowKey};

use crate::crash_points;

/// The compiled programs (see build.rs); empty when built without bpf-linker.
pub static PROGRAMS: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/vpcnet.bpf.o"));

/// Where the build put the lab's reproduction of aws-node's network
/// policy programs (`ebpf/vpcnet-ebpf/src/bin/aws_network_policy.rs`): the
/// tests load it as aws-node's agent would. Not part of the agent.
pub const LAB_AWS_NETWORK_POLICY_OBJECT: &str =
    concat!(env!("OUT_DIR"), "/aws-network-policy.bpf.o");

/// Refuses, in one line, a kernel the programs cannot run on.
fn check_kernel() -> Result<(), DatapathError> {
    let release = verifier::kernel_release();
    if verifier::release_version(&release).is_some_and(|version| version < verifier::MIN_KERNEL) {
        return Err(DatapathError::KernelTooOld { release });
    }
    if aya::features().btf().is_none() {
        return Err(DatapathError::NoBtf { release });
    }
    Ok(())
}

/// A program's load error; the verifier's refusal as one line, its whole
/// log at debug level.
fn refused(name: &'static str, source: aya::programs::ProgramError) -> DatapathError {
    match source {
        aya::programs::ProgramError::LoadError { verifier_log, .. } => {
            let log = verifier_log.to_string();
            tracing::debug!(program = name, log = %log, "the verifier's log");
            DatapathError::Refused {
                program: name,
                release: verifier::kernel_release(),
                reason: verifier::refusal_reason(&log),
            }
        }
        source => DatapathError::Program { name, source },
    }
}

/// Where bpffs is mounted.
const BPFFS: &str = "/sys/fs/bpf";

#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Maps are pinned here and reused from here when already pinned.
    pub pin_dir: PathBuf,
    /// Flows each NAT map holds.
    pub nat_entries: u32,
    /// Entries of the stack flows map (two per flow).
    pub stack_flow_entries: u32,
    /// TCX links or clsact filters.
    pub attach_mode: AttachMode,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            pin_dir: PathBuf::from(names::PIN_DIR),
            nat_entries: names::NAT_DEFAULT_ENTRIES,
            stack_flow_entries: names::STACK_FLOWS_DEFAULT_ENTRIES,
            attach_mode: AttachMode::of_kernel(),
        }
    }
}

/// Every program, in the order they are loaded.
const PROGRAMS_BY_NAME: [&str; 4] = [
    names::PROG_ENI_EGRESS,
    names::PROG_ENI_INGRESS,
    names::PROG_POD_EGRESS,
    names::PROG_POD_INGRESS,
];

/// The loaded programs and their maps.
pub struct Datapath {
    ebpf: Ebpf,
    pub maps: DatapathMaps,
    pin_dir: PathBuf,
    /// Interfaces the programs are attached to: ifindex to name.
    attached: BTreeMap<u32, String>,
    attach_mode: AttachMode,
    /// What loading each program cost, in load order.
    stats: Vec<verifier::ProgramStats>,
    origin: ProgramsOrigin,
    /// The maps the programs use that are not pinned, by name: this load's,
    /// or the kept programs' own; each taken by its one reader.
    unpinned: BTreeMap<String, aya::maps::Map>,
}

impl Datapath {
    /// Loads the programs, reusing maps already pinned in `pin_dir` (so a
    /// restarted agent keeps every flow) and pinning the others there.
    pub fn load(opts: &LoadOptions) -> Result<Self, DatapathError> {
        if PROGRAMS.is_empty() {
            return Err(DatapathError::NoPrograms);
        }
        check_kernel()?;
        ensure_bpffs(&opts.pin_dir)?;
        std::fs::create_dir_all(&opts.pin_dir).map_err(|source| DatapathError::PinDir {
            path: opts.pin_dir.clone(),
            source,
        })?;
        // An earlier version's stack flows, read once its programs are
        // swapped out, so none it saw is forgotten.
        let retired_stack_flows = MapData::from_pin(opts.pin_dir.join(names::STACK_FLOWS_LRU)).ok();
        remove_retired_pins(&opts.pin_dir);
        let plans = plan_maps(opts)?;
        let mut loader = EbpfLoader::new();
        let pin_paths: Vec<(&str, PathBuf)> = names::ALL
            .iter()
            .map(|map| (map.name, pins::pin_path(&opts.pin_dir, map)))
            .collect();
        for (name, path) in &pin_paths {
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = loader
            .map_max_entries(names::NAT_FWD, opts.nat_entries)
            .map_max_entries(names::NAT_REV, opts.nat_entries)
            .map_max_entries(names::STACK_FLOWS, opts.stack_flow_entries)
            .load(PROGRAMS)?;
        let object_dir = programs::object_dir(&opts.pin_dir, PROGRAMS);
        let kept = if plans.reuse_every_map() {
            programs::keep_pinned(&mut ebpf, &opts.pin_dir, &object_dir)
        } else {
            Err("maps carried or superseded, which the programs must use".to_owned())
        };
        let (stats, origin, unpinned) = match kept {
            Ok(kept) => {
                info!("the programs already loaded are this agent's, over the same maps: kept");
                (kept.stats, ProgramsOrigin::Kept, kept.unpinned)
            }
            Err(why) => {
                info!(why, "the programs are loaded through the verifier");
                let stats = programs::verify(&mut ebpf)?;
                programs::pin(&mut ebpf, &object_dir)?;
                let unpinned = programs::take_unpinned(&mut ebpf);
                (stats, ProgramsOrigin::Verified, unpinned)
            }
        };
        let maps = DatapathMaps::from_ebpf(&mut ebpf)?;
        let mut datapath = Self {
            ebpf,
            maps,
            pin_dir: opts.pin_dir.clone(),
            attached: BTreeMap::new(),
            attach_mode: opts.attach_mode,
            stats,
            origin,
            unpinned,
        };
        datapath.take_over_running(plans)?;
        programs::remove_other_objects(&opts.pin_dir, &object_dir);
        if let Some(retired) = retired_stack_flows {
            datapath.carry_retired_stack_flows(retired);
        }
        Ok(datapath)
    }

    /// Takes over from the running datapath, as `plans` says: its entries
    /// copied, its links swapped to this agent's programs one by one, what
    /// its programs did meanwhile carried, its superseded pins removed.
    fn take_over_running(&mut self, plans: MapPlans) -> Result<(), DatapathError> {
        let mut carries = plans.carries;
        for carry in &mut carries {
            carry.pass(Pass::BeforeSwap, &mut self.maps, &mut self.ebpf)?;
            crash_points::step("a map's entries copied before the swap");
        }
        self.adopt_pinned_links()?;
        for carry in &mut carries {
            carry.pass(Pass::AfterSwap, &mut self.maps, &mut self.ebpf)?;
            report_carried(carry);
            crash_points::step("a map's entries carried after the swap");
            remove_pin(&carry.from.path);
            crash_points::step("a carried map's pin removed");
        }
        for path in &plans.superseded {
            remove_pin(path);
        }
        Ok(())
    }

    /// Carries the flows of an earlier version's stack flows map (single
    /// tuples, the pod's or the reverse) into this one's pairs, as
    /// established flows. Which side is the pod's does not matter to a
    /// carried pair: both tuples are keys, and it is judged from one.
    fn carry_retired_stack_flows(&mut self, retired: MapData) {
        let Ok(map) = aya::maps::Map::from_map_data(retired)
            .and_then(aya::maps::HashMap::<MapData, FlowKey, u64>::try_from)
        else {
            warn!(
                "the earlier version's stack flows map could not be read: its flows are not carried over"
            );
            return;
        };
        let now = nat::monotonic_now_ns();
        let mut carried = 0;
        for key in map.keys().flatten() {
            if self.maps.import_stack_flow(key, now).is_ok() {
                carried += 1;
            }
        }
        info!(
            flows = carried,
            "stack flows of the earlier version's map carried over"
        );
    }

    fn links_dir(&self) -> PathBuf {
        self.pin_dir.join(names::LINKS_DIR)
    }

    /// Takes over the links (or clsact filters) a previous agent pinned:
    /// each gets this agent's program in one atomic swap (`bpf_link_update`,
    /// or a filter change on the same handle), so packets never meet an
    /// interface without one. Links of interfaces that are gone, and of
    /// programs this build no longer has, are dropped.
    fn adopt_pinned_links(&mut self) -> Result<(), DatapathError> {
        let links_dir = self.links_dir();
        let entries = match std::fs::read_dir(&links_dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(source) => {
                return Err(DatapathError::LinkPin {
                    path: links_dir,
                    source,
                });
            }
        };
        for entry in entries.flatten() {
            let dir = entry.path();
            if entry.file_name() == names::PROGRAMS_DIR {
                continue;
            }
            let Some((ifindex, iface)) = parse_link_dir(&entry.file_name().to_string_lossy())
            else {
                remove_link_dir(&dir);
                continue;
            };
            if interface_index(&iface) != Some(ifindex) {
                info!(interface = %iface, ifindex, "interface gone: its pinned links go too");
                remove_link_dir(&dir);
                continue;
            }
            let mut adopted = 0;
            for pin in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let path = pin.path();
                let program = PROGRAMS_BY_NAME
                    .into_iter()
                    .find(|name| *name == pin.file_name().to_string_lossy());
                let Some(program) = program else {
                    let _ = std::fs::remove_file(&path);
                    continue;
                };
                let swapped = match self.attach_mode {
                    AttachMode::Tcx => swap_pinned(&mut self.ebpf, program, &path),
                    AttachMode::Clsact => swap_filter(&mut self.ebpf, program, &iface, &path),
                };
                match swapped {
                    Ok(()) => {
                        adopted += 1;
                        crash_points::step("a pinned link's program swapped");
                    }
                    Err(e) => {
                        warn!(pin = %path.display(), error = %e, "pinned link not taken over: dropped");
                        let _ = std::fs::remove_file(&path);
                    }
                }
            }
            if adopted == 2 {
                self.attached.insert(ifindex, iface);
            } else {
                // Half an attachment is worse than none: attach again whole.
                remove_link_dir(&dir);
            }
        }
        if !self.attached.is_empty() {
            info!(interfaces = ?self.attached.values().collect::<Vec<_>>(), "took over the pinned links");
        }
        Ok(())
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    pub fn attach_mode(&self) -> AttachMode {
        self.attach_mode
    }

    /// What loading each program cost on this kernel, in load order (no
    /// time when the programs were kept).
    pub fn program_stats(&self) -> &[verifier::ProgramStats] {
        &self.stats
    }

    /// Whether this start verified the programs or kept those loaded.
    pub fn programs_origin(&self) -> ProgramsOrigin {
        self.origin
    }

    /// The ring buffer of policy's verdicts (`ENABLE_POLICY_EVENT_LOGS`),
    /// for its one reader; `None` once taken.
    pub fn take_policy_events(&mut self) -> Option<aya::maps::RingBuf<MapData>> {
        let map = self.unpinned.remove(names::POLICY_EVENTS)?;
        aya::maps::RingBuf::try_from(map).ok()
    }

    /// The rings of the NAT flows and of the stack flows created last, which
    /// a full table's early drop chooses from (see
    /// `vpcnet_common::nat::RecentFlows`), for their one reader (a test
    /// that checks or resets them); `None` once taken.
    pub fn take_recent_flows(
        &mut self,
    ) -> Option<(
        aya::maps::Array<MapData, vpcnet_common::nat::RecentFlows>,
        aya::maps::Array<MapData, vpcnet_common::nat::RecentFlows>,
    )> {
        let mut ring = |name| {
            let map = self.unpinned.remove(name)?;
            aya::maps::Array::try_from(map).ok()
        };
        Some((ring(names::RECENT_FLOWS)?, ring(names::RECENT_STACK_FLOWS)?))
    }

    /// Whether [`Self::take_policy_events`] has taken the ring.
    #[must_use]
    pub fn policy_events_taken(&self) -> bool {
        !self.unpinned.contains_key(names::POLICY_EVENTS)
    }

    /// A loaded program, e.g. to run it on a crafted packet.
    pub fn program(&self, name: &'static str) -> Result<&SchedClassifier, DatapathError> {
        self.ebpf
            .program(name)
            .ok_or(DatapathError::MissingProgram(name))?
            .try_into()
            .map_err(|source| DatapathError::Program { name, source })
    }

    /// Attaches the ENI programs to `iface` (tc egress and ingress: TCX links
    /// or clsact filters, see [`tc`]), pinned so they outlive this process.
    /// Attaching twice is a no-op.
    pub fn attach_eni(&mut self, iface: &str) -> Result<(), DatapathError> {
        self.attach_pair(iface, [names::PROG_ENI_EGRESS, names::PROG_ENI_INGRESS])
    }

    /// Attaches the pod programs to a pod's host veth `iface`: what the pod
    /// sends arrives on the veth's tc ingress, what the stack hands it
    /// leaves by its tc egress.
    pub fn attach_pod(&mut self, iface: &str) -> Result<(), DatapathError> {
        self.attach_pair(iface, [names::PROG_POD_INGRESS, names::PROG_POD_EGRESS])
    }

    /// Attaches `programs` each to its hook ([`hook_of`]) and pins both links
    /// (clsact: both programs) under `links/<ifindex>-<iface>/`.
    fn attach_pair(
        &mut self,
        iface: &str,
        programs: [&'static str; 2],
    ) -> Result<(), DatapathError> {
        let ifindex =
            interface_index(iface).ok_or_else(|| DatapathError::NoInterface(iface.to_owned()))?;
        if self
            .attached
            .get(&ifindex)
            .is_some_and(|name| name == iface)
        {
            return Ok(());
        }
        // An ifindex the kernel gave a new interface: the old one's pins go.
        self.detach_ifindex(ifindex);
        let dir = self.links_dir().join(link_dir_name(ifindex, iface));
        std::fs::create_dir_all(&dir).map_err(|source| DatapathError::LinkPin {
            path: dir.clone(),
            source,
        })?;
        let pinned = programs.into_iter().try_for_each(|program| {
            let direction = hook_of(program);
            let path = dir.join(program);
            if self.attach_mode == AttachMode::Clsact {
                let classifier = classifier_mut(&mut self.ebpf, program)?;
                tc::attach(classifier, program, iface, direction)?;
                tc::pin_program(classifier, program, &path)?;
            } else {
                let link = attach_tcx(&mut self.ebpf, program, iface, direction)?;
                FdLink::try_from(link)
                    .map_err(|e| DatapathError::PinnedLink {
                        path: path.clone(),
                        source: e,
                    })?
                    .pin(&path)
                    .map_err(|e| DatapathError::LinkPin {
                        path,
                        source: std::io::Error::other(e),
                    })?;
            }
            crash_points::step("a program attached and pinned");
            Ok(())
        });
        if let Err(e) = pinned {
            remove_link_dir(&dir);
            return Err(e);
        }
        self.attached.insert(ifindex, iface.to_owned());
        Ok(())
    }

    /// Detaches the programs from interface `ifindex` (its pins go, and
    /// with them the links). Nothing attached there: nothing to do.
    pub fn detach_ifindex(&mut self, ifindex: u32) {
        self.attached.remove(&ifindex);
        let prefix = format!("{ifindex}-");
        for entry in std::fs::read_dir(self.links_dir())
            .into_iter()
            .flatten()
            .flatten()
        {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                remove_link_dir(&entry.path());
            }
        }
    }

    /// Drops the attachments of interfaces that are gone (a pod's veth
    /// goes with its namespace): returns their ifindexes.
    pub fn prune_attachments(&mut self) -> Vec<u32> {
        let gone: Vec<u32> = self
            .attached
            .iter()
            .filter(|(ifindex, name)| interface_index(name) != Some(**ifindex))
            .map(|(ifindex, _)| *ifindex)
            .collect();
        for ifindex in &gone {
            self.detach_ifindex(*ifindex);
        }
        gone
    }

    /// Interfaces the programs are attached to.
    pub fn attached(&self) -> impl Iterator<Item = &str> {
        self.attached.values().map(String::as_str)
    }

    /// Whether the programs are attached to interface `ifindex`.
    pub fn is_attached(&self, ifindex: u32) -> bool {
        self.attached.contains_key(&ifindex)
    }

    /// Whether the pod at `addr` is in the datapath whole: its entry, and
    /// the programs on its veth (a start killed between the two leaves
    /// only the entry).
    pub fn holds_pod(&self, addr: Ipv4Addr) -> Result<bool, DatapathError> {
        Ok(self
            .maps
            .endpoint(addr)?
            .is_some_and(|entry| self.is_attached(entry.ifindex)))
    }

    /// Removes the pins: the maps live on only while this process holds them.
    pub fn unpin(&self) -> std::io::Result<()> {
        remove_pins(&self.pin_dir)
    }
}

/// Removes the pins of maps an earlier version used and this one does not:
/// nothing reads them any more.
fn remove_retired_pins(pin_dir: &Path) {
    for name in names::RETIRED {
        if std::fs::remove_file(pin_dir.join(name)).is_ok() {
            info!(
                map = name,
                "removed the pin of a map this version no longer uses"
            );
        }
    }
}

/// What the embedded object holds, read without a kernel: its size and
/// every program and map the agent loads from it. `Err`: the agent was
/// built without its programs, or one is missing (what an image's smoke
/// check on another architecture can prove).
pub fn embedded_object() -> Result<String, DatapathError> {
    if PROGRAMS.is_empty() {
        return Err(DatapathError::NoPrograms);
    }
    let object = aya_obj::Object::parse(PROGRAMS)
        .map_err(|e| DatapathError::Load(aya::EbpfError::ParseError(e)))?;
    for name in PROGRAMS_BY_NAME {
        if !object.programs.contains_key(name) {
            return Err(DatapathError::MissingProgram(name));
        }
    }
    for map in names::ALL {
        if !object.maps.contains_key(map.name) {
            return Err(DatapathError::MissingMap(map.name));
        }
    }
    Ok(format!(
        "embedded eBPF object: {} bytes, programs {}, {} maps",
        PROGRAMS.len(),
        PROGRAMS_BY_NAME.join(", "),
        names::ALL.len()
    ))
}

/// What a starting agent does with each pinned map (see [`pins`]), done as
/// far as it goes before the programs load: the pin each map's new map
/// takes is freed, the maps whose entries are carried are opened.
struct MapPlans {
    carries: Vec<carry::Carry>,
    /// Pins of readable layouts whose entries are not merged: removed once
    /// the new programs run.
    superseded: Vec<PathBuf>,
}

impl MapPlans {
    /// Whether every map is the pinned one as it is: programs loaded over
    /// them may be kept.
    fn reuse_every_map(&self) -> bool {
        self.carries.is_empty() && self.superseded.is_empty()
    }
}

fn plan_maps(opts: &LoadOptions) -> Result<MapPlans, DatapathError> {
    let object = aya_obj::Object::parse(PROGRAMS)
        .map_err(|e| DatapathError::Load(aya::EbpfError::ParseError(e)))?;
    let live_ids = pins::live_map_ids(&opts.pin_dir);
    let mut plans = MapPlans {
        carries: Vec::new(),
        superseded: Vec::new(),
    };
    for map in names::ALL {
        let definition = object
            .maps
            .get(map.name)
            .ok_or(DatapathError::MissingMap(map.name))?;
        let wanted = pins::Shape {
            map_type: definition.map_type(),
            key_size: definition.key_size(),
            value_size: definition.value_size(),
            max_entries: match map.name {
                names::NAT_FWD | names::NAT_REV => opts.nat_entries,
                names::STACK_FLOWS => opts.stack_flow_entries,
                _ => definition.max_entries(),
            },
        };
        let own = pins::pin_path(&opts.pin_dir, &map);
        let found = pins::find(&opts.pin_dir, map.name);
        let resolution = pins::resolve(map, wanted, &own, found, &live_ids);
        for pin in &resolution.foreign {
            // The running datapath's own map or a left-over: either way
            // never touched, and its entries not carried.
            warn!(
                map = map.name,
                pin = %pin.path.display(),
                layout = ?pin.layout,
                key_size = pin.shape.key_size,
                value_size = pin.shape.value_size,
                this_agent_layout = map.layout,
                in_use = resolution.unreadable_live.as_ref() == Some(pin),
                "a pinned map of a layout this agent cannot read (a newer version's?): left as \
                 it is, its entries not carried; when in use, this agent starts the map empty"
            );
        }
        // The loader pins the new map at `own`, or reuses what is there.
        let mut plan = resolution.plan;
        if plan != pins::Plan::Reuse && own.exists() {
            match &mut plan {
                pins::Plan::Carry(from) if from.path == own => {
                    let aside = own.with_file_name(format!(
                        "{}_resized",
                        own.file_name().unwrap_or_default().to_string_lossy()
                    ));
                    rename_pin(&own, &aside)?;
                    from.path = aside;
                }
                _ if resolution.superseded.iter().any(|pin| pin.path == own) => {
                    // A copy an earlier start left behind, stale.
                    remove_pin(&own);
                }
                _ => {
                    // Our own name, but not a map of our layout's key and
                    // value: never deleted, set aside.
                    let aside = own.with_file_name(format!(
                        "{}_unreadable",
                        own.file_name().unwrap_or_default().to_string_lossy()
                    ));
                    rename_pin(&own, &aside)?;
                }
            }
        }
        if let pins::Plan::Carry(from) = plan {
            plans.carries.push(carry::Carry::open(map, from)?);
        }
        for pin in resolution.superseded {
            if pin.path == own {
                continue;
            }
            if carry::merges(map.name) {
                // Removed once merged, as a carried map is.
                plans.carries.push(carry::Carry::open_merging(map, pin)?);
            } else {
                plans.superseded.push(pin.path);
            }
        }
    }
    Ok(plans)
}

fn report_carried(carry: &carry::Carry) {
    info!(
        map = carry.map.name,
        from = %carry.from.path.display(),
        from_layout = ?carry.from.layout,
        layout = carry.map.layout,
        entries = carry.tally.carried,
        "carried the running datapath's entries into a new map"
    );
    if carry.tally.dropped > 0 {
        warn!(
            map = carry.map.name,
            not_carried = carry.tally.dropped,
            "entries not carried: the new map has no room for them, or they mean something else now"
        );
    }
}

fn rename_pin(from: &Path, to: &Path) -> Result<(), DatapathError> {
    std::fs::rename(from, to).map_err(|source| DatapathError::PinDir {
        path: from.to_owned(),
        source,
    })
}

fn remove_pin(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => warn!(pin = %path.display(), error = %e, "removing a superseded pin"),
    }
}

/// Removes every pin in `pin_dir` (links first: that detaches the
/// programs; clsact filters are deleted), then the directory if empty.
/// The ENIs' programs go before the pods': a flow then never has its pod's
/// half on the stack's path (conntrack's) while its replies still go
/// straight into the pod, which would leave conntrack's view of it behind.
pub fn remove_pins(pin_dir: &Path) -> std::io::Result<()> {
    let links = pin_dir.join(names::LINKS_DIR);
    if let Ok(dirs) = std::fs::read_dir(&links) {
        for dir in dirs.flatten() {
            if dir.path().join(names::PROG_ENI_INGRESS).exists() {
                delete_filters_of(&dir.path());
            }
            for program in [names::PROG_ENI_INGRESS, names::PROG_ENI_EGRESS] {
                match std::fs::remove_file(dir.path().join(program)) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
    if let Ok(dirs) = std::fs::read_dir(&links) {
        for dir in dirs.flatten() {
            delete_filters_of(&dir.path());
        }
    }
    match std::fs::remove_dir_all(links) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    for name in names::RETIRED {
        match std::fs::remove_file(pin_dir.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    // Every layout's pins: removing vpcnet removes what any version of it
    // pinned.
    for map in names::ALL {
        for pin in pins::find(pin_dir, map.name) {
            std::fs::remove_file(&pin.path)?;
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

/// Attaches program `name` as a TCX link and takes the link out of aya's
/// hands (whose drop would detach it).
fn attach_tcx(
    ebpf: &mut Ebpf,
    name: &'static str,
    iface: &str,
    direction: TcAttachType,
) -> Result<SchedClassifierLink, DatapathError> {
    let program = classifier_mut(ebpf, name)?;
    let err = |source| DatapathError::Program { name, source };
    let id = program
        .attach_with_options(
            iface,
            direction,
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        )
        .map_err(err)?;
    program.take_link(id).map_err(err)
}

/// The hook program `name` sits on: tc egress for what leaves an ENI
/// (`eni_egress`) and what the stack hands a pod (`pod_ingress`), tc
/// ingress for the others.
fn hook_of(name: &str) -> TcAttachType {
    match name {
        names::PROG_ENI_EGRESS | names::PROG_POD_INGRESS => TcAttachType::Egress,
        _ => TcAttachType::Ingress,
    }
}

/// Puts program `name` into vpcnet's clsact filter on `iface` (the hook
/// its pin at `path` is for), in place, and pins it there instead of the
/// previous agent's.
fn swap_filter(
    ebpf: &mut Ebpf,
    name: &'static str,
    iface: &str,
    path: &Path,
) -> Result<(), DatapathError> {
    let program = classifier_mut(ebpf, name)?;
    tc::attach(program, name, iface, hook_of(name))?;
    tc::pin_program(program, name, path)
}

/// Puts program `name` into the link pinned at `path`, atomically.
fn swap_pinned(ebpf: &mut Ebpf, name: &'static str, path: &Path) -> Result<(), DatapathError> {
    let pinned_err = |source| DatapathError::PinnedLink {
        path: path.to_owned(),
        source,
    };
    let pinned = PinnedLink::from_pin(path).map_err(pinned_err)?;
    let link = SchedClassifierLink::try_from(FdLink::from(pinned)).map_err(pinned_err)?;
    let program = classifier_mut(ebpf, name)?;
    let err = |source| DatapathError::Program { name, source };
    let id = program.attach_to_link(link).map_err(err)?;
    // The pin keeps the link; our descriptor of it can go.
    drop(program.take_link(id).map_err(err)?);
    Ok(())
}

/// `<ifindex>-<ifname>`, a link directory's name. bpffs refuses names with
/// a dot (`vlan.eth.5`): dots become colons, which no interface name has.
fn link_dir_name(ifindex: u32, iface: &str) -> String {
    format!("{ifindex}-{}", iface.replace('.', ":"))
}

fn parse_link_dir(name: &str) -> Option<(u32, String)> {
    let (ifindex, iface) = name.split_once('-')?;
    Some((ifindex.parse().ok()?, iface.replace(':', ".")))
}

/// Deletes vpcnet's clsact filters from the interface of link directory
/// `dir`, when that interface is still the one the directory names.
fn delete_filters_of(dir: &Path) {
    let Some((ifindex, iface)) = dir
        .file_name()
        .and_then(|name| parse_link_dir(&name.to_string_lossy()))
    else {
        return;
    };
    if interface_index(&iface) == Some(ifindex) {
        tc::detach(&iface);
    }
}

fn interface_index(iface: &str) -> Option<u32> {
    nix::net::if_::if_nametoindex(iface).ok()
}

/// Removes a link directory: unpinning detaches the TCX links in it, and
/// vpcnet's clsact filters on its interface, if any, are deleted.
fn remove_link_dir(dir: &Path) {
    delete_filters_of(dir);
    if let Err(e) = std::fs::remove_dir_all(dir)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        warn!(dir = %dir.display(), error = %e, "removing pinned links");
    }
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

/// Mounts bpffs at /sys/fs/bpf unless it is there (the DaemonSet's
/// privileged init step, whose `Bidirectional` mount the node then has);
/// returns whether it mounted one.
///
/// # Errors
/// The mount's, named.
pub fn mount_bpffs() -> Result<bool, DatapathError> {
    if bpffs_mounted() {
        return Ok(false);
    }
    ensure_bpffs(Path::new(BPFFS))?;
    Ok(true)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_directories_name_any_interface() {
        for iface in ["eth0", "vlan.eth.5", "enic220f2ba281"] {
            let name = link_dir_name(7, iface);
            assert!(!name.contains('.'), "{name}: bpffs refuses dots");
            assert_eq!(parse_link_dir(&name), Some((7, iface.to_owned())));
        }
        assert_eq!(parse_link_dir("junk"), None);
    }
}
