//! The embedded object's programs on the kernel: verified side by side and
//! pinned under the object's own directory, or, when a restart or an
//! upgrade changes neither a program nor a map, the pinned ones kept as
//! they are. The verifier takes about a second for each of the two large
//! programs, and an agent restarting under running pods waits for it.
//!
//! A program is kept only when all of these hold: the object is the same
//! (its directory is named after the object's SHA-256), every pinned map
//! is reused as it is (nothing carried into a new map, nothing superseded),
//! and each pinned program uses those very maps (by the kernel's map ids)
//! and no other but those of its own load, pinned beside it.

use std::{
    collections::{BTreeMap, BTreeSet},
    os::fd::{AsFd, AsRawFd, BorrowedFd},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use aya::{
    Ebpf,
    maps::{Map, MapData, MapInfo},
    programs::{Program, SchedClassifier},
};
use sha2::{Digest, Sha256};
use tracing::{debug, info, warn};
use vpcnet_common::maps as names;

use super::{DatapathError, PROGRAMS_BY_NAME, pins, refused, verifier::ProgramStats};

/// Whether this start verified the programs or kept the pinned ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgramsOrigin {
    /// Loaded through the verifier, then pinned.
    Verified,
    /// The identical programs already loaded (by an earlier start), kept.
    Kept,
}

/// The directory of `object`'s programs under `pin_dir`:
/// `links/programs/<digest>/<program>`, in the links' directory so that an
/// earlier version, which takes it for a link directory it cannot parse,
/// removes it rather than leaving programs loaded that nothing uses.
pub(super) fn object_dir(pin_dir: &Path, object: &[u8]) -> PathBuf {
    programs_dir(pin_dir).join(object_digest(object))
}

fn programs_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join(names::LINKS_DIR).join(names::PROGRAMS_DIR)
}

/// The first 12 bytes of the object's SHA-256, in hex.
fn object_digest(object: &[u8]) -> String {
    hex::encode(&Sha256::digest(object)[..12])
}

/// Programs kept from an earlier start, and the maps of theirs this start
/// uses in place of its own.
pub(super) struct Kept {
    pub stats: Vec<ProgramStats>,
    /// The object's maps that are not pinned with the others (the policy
    /// events' ring, the rings of recent flows, the port search), by their
    /// names in the object: those the load that verified the kept programs
    /// made, pinned beside them.
    pub unpinned: BTreeMap<String, Map>,
}

/// The subdirectory of an object's directory holding the maps its load
/// made that are not pinned with the others ([`unpinned_names`]): a kept
/// program's own, which a start can open only from a pin (opening a map by
/// its id takes `CAP_SYS_ADMIN`, which the DaemonSet's agent has not).
const OBJECT_MAPS_DIR: &str = "maps";

/// Puts the programs pinned in `dir` in place of `ebpf`'s unloaded ones
/// when each is there and uses only the maps pinned in `pin_dir` (which
/// the caller knows `ebpf` reuses, every one) and those pinned beside it
/// in `dir`; otherwise (and `ebpf` untouched) why not.
pub(super) fn keep_pinned(ebpf: &mut Ebpf, pin_dir: &Path, dir: &Path) -> Result<Kept, String> {
    if !dir.is_dir() {
        return Err("no programs of this object are pinned".to_owned());
    }
    let mut pinned_maps = BTreeSet::new();
    for map in names::ALL {
        let path = pins::pin_path(pin_dir, &map);
        let info = MapInfo::from_pin(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        pinned_maps.insert(info.id());
    }
    let mut object_maps = BTreeMap::new();
    for name in unpinned_names(ebpf) {
        let path = dir.join(OBJECT_MAPS_DIR).join(pin_name(&name));
        let opened = MapData::from_pin(&path).and_then(|map| Ok((map.info()?.id(), map)));
        let (id, map) = opened.map_err(|e| format!("{}: {e}", path.display()))?;
        object_maps.insert(id, (name, map));
    }
    let mut kept = Vec::new();
    for name in PROGRAMS_BY_NAME {
        let path = dir.join(name);
        let program =
            SchedClassifier::from_pin(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let info = program
            .info()
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let map_ids = program
            .fd()
            .map_err(|e| e.to_string())
            .and_then(|fd| map_ids_of(fd.as_fd()).map_err(|e| e.to_string()))
            .map_err(|e| format!("{}: its maps: {e}", path.display()))?;
        if let Some(stranger) = map_ids
            .iter()
            .find(|id| !pinned_maps.contains(id) && !object_maps.contains_key(id))
        {
            return Err(format!(
                "{name} uses a map this start does not (id {stranger})"
            ));
        }
        let stats = ProgramStats {
            name,
            processed_insns: info.verified_instruction_count(),
            load_time: Duration::ZERO,
        };
        kept.push((name, program, stats));
    }
    if let Some(name) = PROGRAMS_BY_NAME
        .iter()
        .find(|name| ebpf.program(name).is_none())
    {
        return Err(format!("the object has no program {name}"));
    }
    let mut stats = Vec::new();
    for (name, program, program_stats) in kept {
        if let Some(slot) = ebpf.program_mut(name) {
            *slot = Program::SchedClassifier(program);
        }
        stats.push(program_stats);
    }
    let unpinned = object_maps
        .into_values()
        .filter(|(name, _)| !name.starts_with('.'))
        .filter_map(|(name, map)| Some((name, Map::from_map_data(map).ok()?)))
        .collect();
    Ok(Kept { stats, unpinned })
}

/// The ids of the maps the program `fd` uses, by `BPF_OBJ_GET_INFO_BY_FD`
/// on the program's own descriptor. (aya's `ProgramInfo::map_ids` opens
/// the program again by its id, which takes `CAP_SYS_ADMIN`.)
fn map_ids_of(fd: BorrowedFd<'_>) -> std::io::Result<Vec<u32>> {
    /// `struct bpf_prog_info` up to `map_ids`: the kernel fills what fits.
    #[repr(C)]
    #[derive(Default)]
    struct ProgInfoPrefix {
        type_: u32,
        id: u32,
        tag: [u8; 8],
        jited_prog_len: u32,
        xlated_prog_len: u32,
        jited_prog_insns: u64,
        xlated_prog_insns: u64,
        load_time: u64,
        created_by_uid: u32,
        nr_map_ids: u32,
        map_ids: u64,
    }
    /// `union bpf_attr` for `BPF_OBJ_GET_INFO_BY_FD`.
    #[repr(C)]
    struct InfoAttr {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    const BPF_OBJ_GET_INFO_BY_FD: u32 = 15;
    let get = |info: &mut ProgInfoPrefix| {
        let mut attr = InfoAttr {
            bpf_fd: u32::try_from(fd.as_raw_fd()).map_err(std::io::Error::other)?,
            info_len: u32::try_from(size_of::<ProgInfoPrefix>()).map_err(std::io::Error::other)?,
            // `info`, whose `map_ids` (if set) points at a buffer of
            // `nr_map_ids` ids: both outlive the call.
            info: std::ptr::from_mut(info) as u64,
        };
        super::batch::bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)
    };
    let mut info = ProgInfoPrefix::default();
    get(&mut info)?;
    let mut ids = vec![0u32; info.nr_map_ids as usize];
    let mut info = ProgInfoPrefix {
        nr_map_ids: info.nr_map_ids,
        map_ids: ids.as_mut_ptr() as u64,
        ..ProgInfoPrefix::default()
    };
    get(&mut info)?;
    // The kernel writes no more ids than asked for; fewer, if it has fewer.
    ids.truncate(info.nr_map_ids as usize);
    Ok(ids)
}

/// The names of the object's maps that are not pinned with the others:
/// its data sections (`.rodata`, `.bss`: each load makes them anew) and
/// the maps that hold nothing between two starts.
fn unpinned_names(ebpf: &Ebpf) -> Vec<String> {
    ebpf.maps()
        .map(|(name, _)| name)
        .filter(|name| names::ALL.iter().all(|map| map.name != *name))
        .map(str::to_owned)
        .collect()
}

/// `name` as bpffs takes it: no dots.
fn pin_name(name: &str) -> String {
    name.replace('.', "_")
}

/// The object's unpinned maps but its data sections, taken from `ebpf`
/// (which made them in this load), by name.
pub(super) fn take_unpinned(ebpf: &mut Ebpf) -> BTreeMap<String, Map> {
    unpinned_names(ebpf)
        .into_iter()
        .filter(|name| !name.starts_with('.'))
        .filter_map(|name| ebpf.take_map(&name).map(|map| (name, map)))
        .collect()
}

/// Loads `ebpf`'s programs through the verifier, side by side (an agent
/// restarting under running pods waits for the two large ones).
pub(super) fn verify(ebpf: &mut Ebpf) -> Result<Vec<ProgramStats>, DatapathError> {
    let started = Instant::now();
    let mut classifiers = Vec::new();
    for (name, program) in ebpf.programs_mut() {
        let Some(name) = PROGRAMS_BY_NAME.into_iter().find(|known| *known == name) else {
            continue;
        };
        let classifier: &mut SchedClassifier = program
            .try_into()
            .map_err(|source| DatapathError::Program { name, source })?;
        classifiers.push((name, classifier));
    }
    classifiers.sort_by_key(|(name, _)| PROGRAMS_BY_NAME.iter().position(|known| known == name));
    let stats = std::thread::scope(|scope| {
        let loads: Vec<_> = classifiers
            .into_iter()
            .map(|(name, classifier)| {
                scope.spawn(move || {
                    let started = Instant::now();
                    classifier.load().map_err(|source| refused(name, source))?;
                    let load_time = started.elapsed();
                    let processed_insns = classifier
                        .info()
                        .ok()
                        .and_then(|info| info.verified_instruction_count());
                    Ok(ProgramStats {
                        name,
                        processed_insns,
                        load_time,
                    })
                })
            })
            .collect();
        loads
            .into_iter()
            .map(|load| load.join().expect("a program load panicked"))
            .collect::<Result<Vec<_>, DatapathError>>()
    })?;
    for program in &stats {
        debug!(
            program = program.name,
            processed_insns = program.processed_insns,
            load_time = ?program.load_time,
            "program verified"
        );
    }
    info!(elapsed = ?started.elapsed(), "programs verified and loaded");
    Ok(stats)
}

/// Pins `ebpf`'s loaded programs in `dir`, for a later start to keep,
/// after the maps of the load they use that are not pinned elsewhere.
/// What an interrupted pinning left there goes first: a start keeps only
/// a whole set (the programs go last).
pub(super) fn pin(ebpf: &mut Ebpf, dir: &Path) -> Result<(), DatapathError> {
    let pin_err = |path: &Path, source| DatapathError::ProgramPin {
        path: path.to_owned(),
        source,
    };
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(pin_err(dir, source)),
    }
    let maps_dir = dir.join(OBJECT_MAPS_DIR);
    std::fs::create_dir_all(&maps_dir).map_err(|source| pin_err(&maps_dir, source))?;
    for name in unpinned_names(ebpf) {
        let path = maps_dir.join(pin_name(&name));
        ebpf.map(&name)
            .ok_or(DatapathError::MissingMap("an unpinned map of the object"))?
            .pin(&path)
            .map_err(|e| pin_err(&path, std::io::Error::other(e)))?;
    }
    for name in PROGRAMS_BY_NAME {
        let path = dir.join(name);
        super::classifier_mut(ebpf, name)?
            .pin(&path)
            .map_err(|e| pin_err(&path, std::io::Error::other(e)))?;
        crate::crash_points::step("a program pinned for later starts");
    }
    Ok(())
}

/// Removes the pinned programs of every object but the one in `keep`:
/// once the links run this start's programs, nothing uses theirs.
pub(super) fn remove_other_objects(pin_dir: &Path, keep: &Path) {
    for entry in std::fs::read_dir(programs_dir(pin_dir))
        .into_iter()
        .flatten()
        .flatten()
    {
        let path = entry.path();
        if path == keep {
            continue;
        }
        match std::fs::remove_dir_all(&path) {
            Ok(()) => info!(dir = %path.display(), "removed an earlier object's pinned programs"),
            Err(e) => {
                warn!(dir = %path.display(), error = %e, "removing an earlier object's pinned programs");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_object_has_a_directory_of_its_own_under_the_links() {
        let pin_dir = Path::new("/sys/fs/bpf/vpcnet");
        let one = object_dir(pin_dir, b"one object");
        let other = object_dir(pin_dir, b"another object");
        assert_ne!(one, other);
        assert_eq!(one, object_dir(pin_dir, b"one object"));
        assert!(
            one.starts_with("/sys/fs/bpf/vpcnet/links/programs"),
            "{}",
            one.display()
        );
        let digest = one.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(digest.len(), 24);
        assert!(!digest.contains('.'), "bpffs refuses dots: {digest}");
    }
}
