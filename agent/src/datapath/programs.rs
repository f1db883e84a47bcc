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
//! and no other but its object's data sections.

use std::{
    collections::{BTreeMap, BTreeSet},
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
    /// The object's maps that are not pinned (the policy events' ring, the
    /// rings of recent flows, the port search) and that the kept programs
    /// use, by their names in the object: those the load that verified
    /// them made.
    pub unpinned: BTreeMap<String, Map>,
}

/// Puts the programs pinned in `dir` in place of `ebpf`'s unloaded ones
/// when each is there and uses only the maps pinned in `pin_dir` (which
/// the caller knows `ebpf` reuses, every one), data sections and the
/// object's unpinned maps; `None` (and `ebpf` untouched) otherwise.
pub(super) fn keep_pinned(ebpf: &mut Ebpf, pin_dir: &Path, dir: &Path) -> Option<Kept> {
    let pinned_maps: BTreeSet<u32> = names::ALL
        .iter()
        .map(|map| MapInfo::from_pin(pins::pin_path(pin_dir, map)).map(|info| info.id()))
        .collect::<Result<_, _>>()
        .ok()?;
    let unpinned_names = unpinned_names(ebpf);
    let mut kept = Vec::new();
    let mut unpinned = BTreeMap::new();
    for name in PROGRAMS_BY_NAME {
        let path = dir.join(name);
        let program = SchedClassifier::from_pin(&path).ok()?;
        let info = program.info().ok()?;
        let map_ids = info.map_ids().ok()??;
        for id in map_ids {
            if pinned_maps.contains(&id) {
                continue;
            }
            let map_name = MapInfo::from_id(id)
                .ok()
                .and_then(|map| map.name_as_str().map(str::to_owned))
                .unwrap_or_default();
            if map_name.starts_with('.') {
                // A data section: each load makes it anew with the
                // object's same contents.
                continue;
            }
            let Some(object_name) = unpinned_names
                .iter()
                .find(|object_name| kernel_map_name(object_name) == map_name)
            else {
                info!(
                    program = name,
                    map_id = id,
                    map = map_name,
                    "the pinned program uses a map this start does not: verified again"
                );
                return None;
            };
            if !unpinned.contains_key(object_name) {
                let map = MapData::from_id(id).and_then(Map::from_map_data).ok()?;
                unpinned.insert(object_name.clone(), map);
            }
        }
        let stats = ProgramStats {
            name,
            processed_insns: info.verified_instruction_count(),
            load_time: Duration::ZERO,
        };
        kept.push((name, program, stats));
    }
    if PROGRAMS_BY_NAME
        .iter()
        .any(|name| ebpf.program(name).is_none())
    {
        return None;
    }
    let mut stats = Vec::new();
    for (name, program, program_stats) in kept {
        if let Some(slot) = ebpf.program_mut(name) {
            *slot = Program::SchedClassifier(program);
        }
        stats.push(program_stats);
    }
    Some(Kept { stats, unpinned })
}

/// The names of the object's maps that are neither pinned nor data
/// sections.
fn unpinned_names(ebpf: &Ebpf) -> Vec<String> {
    ebpf.maps()
        .map(|(name, _)| name)
        .filter(|name| !name.starts_with('.') && names::ALL.iter().all(|map| map.name != *name))
        .map(str::to_owned)
        .collect()
}

/// The object's unpinned maps, taken from `ebpf` (which made them in this
/// load), by name.
pub(super) fn take_unpinned(ebpf: &mut Ebpf) -> BTreeMap<String, Map> {
    unpinned_names(ebpf)
        .into_iter()
        .filter_map(|name| ebpf.take_map(&name).map(|map| (name, map)))
        .collect()
}

/// The name the kernel gives a map named `name` in its object: the
/// first 15 bytes (`BPF_OBJ_NAME_LEN` with its NUL).
fn kernel_map_name(name: &str) -> &str {
    name.get(..name.len().min(15)).unwrap_or(name)
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

/// Pins `ebpf`'s loaded programs in `dir`, for a later start to keep.
/// What an interrupted pinning left there goes first: a start keeps only
/// a whole set.
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
    std::fs::create_dir_all(dir).map_err(|source| pin_err(dir, source))?;
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
