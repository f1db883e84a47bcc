//! Which pinned map a starting agent takes for each of the datapath's maps.
//!
//! A map is pinned as `<name>_v<layout>` (both from
//! `vpcnet_common::maps::ALL`), so an agent opens by name only the layout
//! it was built for: an older agent never finds a newer agent's map under
//! its own name, whatever it does with it. Releases before versioned pins
//! pinned layout 1 under the bare name.
//!
//! The map the running datapath uses is the one its attached programs
//! reference (their pinned links say which); that one decides:
//!
//! - this agent's own layout and size: reused as it is (a restart);
//! - a layout this agent reads (older, or its own at another size): its
//!   entries are carried into a new map (see [`super::carry`]);
//! - a layout it does not read (a newer agent's, a downgrade): left as it
//!   is, said in one line, and the map starts empty.
//!
//! Pins of layouts this agent reads that nothing uses are left-overs of an
//! earlier upgrade or downgrade (or of a crash in one): removed once the new
//! programs run. Pins it does not read are never touched.

use std::{
    collections::BTreeSet,
    ffi::CString,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::{Path, PathBuf},
};

use aya::{maps::MapInfo, programs::loaded_programs};
use tracing::warn;
use vpcnet_common::maps::{self as names, LINKS_DIR, PinnedMap};

/// The pin of `map`'s layout in `pin_dir`.
#[must_use]
pub fn pin_path(pin_dir: &Path, map: &PinnedMap) -> PathBuf {
    pin_dir.join(format!("{}_v{}", map.name, map.layout))
}

/// A pin whose name says it holds one of the datapath's maps: `<name>`,
/// `<name>_v<layout>`, or either with a suffix this module adds
/// (`_v<layout>_resized`: set aside while its entries move to a map of
/// another size).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    pub path: PathBuf,
    /// The layout its name says; `None`: a name this agent cannot read.
    pub layout: Option<u16>,
    pub shape: Shape,
    /// The map's id, to tell whether the running programs use it.
    pub id: u32,
}

/// What the kernel says of a map: enough to tell whether a layout's
/// entries fit it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// A `bpf_map_type`.
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
}

impl Shape {
    pub fn of(info: &MapInfo) -> Self {
        Self {
            map_type: info.map_type().map_or(u32::MAX, |map_type| map_type as u32),
            key_size: info.key_size(),
            value_size: info.value_size(),
            max_entries: info.max_entries(),
        }
    }
}

/// What a starting agent does with one map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// The running datapath's map is of this agent's layout and size: the
    /// programs are loaded against it as it is.
    Reuse,
    /// A new map, filled from this one's entries.
    Carry(Found),
    /// A new, empty map: nothing pinned, or nothing this agent can read.
    Fresh,
}

/// The plan for one map, and what to do with the other pins of it.
#[derive(Clone, Debug)]
pub struct Resolution {
    pub map: PinnedMap,
    pub plan: Plan,
    /// The running datapath's map, when it is of a layout this agent does
    /// not read.
    pub unreadable_live: Option<Found>,
    /// The other pins of layouts this agent reads: removed once the new
    /// programs run. Some programs may still use one (an upgrade stopped
    /// while it swapped links one by one), or it may hold flows made after
    /// the last copy (stopped before its second pass): a flow map's
    /// entries are merged in first.
    pub superseded: Vec<Found>,
    /// Pins this agent does not read (a newer layout, a size its layout
    /// never had): never touched.
    pub foreign: Vec<Found>,
}

/// Decides what to do with `map` (whose new map has `wanted`'s shape),
/// given its pins (`found`, own pin at `own`) and the maps the running
/// programs use (`live_ids`).
#[must_use]
pub fn resolve(
    map: PinnedMap,
    wanted: Shape,
    own: &Path,
    found: Vec<Found>,
    live_ids: &BTreeSet<u32>,
) -> Resolution {
    // Every layout up to this agent's own keeps the key and value of today,
    // or (`names::WIDENED`) a value today's extends.
    let widened = names::widened_from(map.name).and_then(|size| u32::try_from(size).ok());
    let readable = |pin: &Found| {
        pin.layout.is_some_and(|layout| layout <= map.layout)
            && pin.shape.map_type == wanted.map_type
            && pin.shape.key_size == wanted.key_size
            && (pin.shape.value_size == wanted.value_size
                || (Some(pin.shape.value_size) == widened
                    && pin.layout.is_some_and(|layout| layout < map.layout)))
    };
    // Our own pin first: with links on two sets of maps (an upgrade
    // stopped half-way), the newer programs' maps stay and the others'
    // entries are merged into them.
    let live = found
        .iter()
        .position(|pin| pin.path == own && live_ids.contains(&pin.id))
        .or_else(|| found.iter().position(|pin| live_ids.contains(&pin.id)))
        .or_else(|| found.iter().position(|pin| pin.path == own))
        .or_else(|| {
            found
                .iter()
                .enumerate()
                .filter(|(_, pin)| readable(pin))
                .max_by_key(|(_, pin)| pin.layout)
                .map(|(index, _)| index)
        });
    let mut plan = Plan::Fresh;
    let mut unreadable_live = None;
    let (mut superseded, mut foreign) = (Vec::new(), Vec::new());
    for (index, pin) in found.into_iter().enumerate() {
        let is_live = Some(index) == live;
        if !readable(&pin) {
            if is_live {
                unreadable_live = Some(pin.clone());
            }
            foreign.push(pin);
        } else if !is_live {
            superseded.push(pin);
        } else if pin.path == own && pin.shape.max_entries == wanted.max_entries {
            plan = Plan::Reuse;
        } else {
            plan = Plan::Carry(pin);
        }
    }
    Resolution {
        map,
        plan,
        unreadable_live,
        superseded,
        foreign,
    }
}

/// The layout a pin's file name says it holds for map `name`: `None` when
/// the name is not one of `name`'s pins, `Some(None)` when it is but its
/// layout cannot be read.
#[must_use]
pub fn layout_of_pin(name: &str, file_name: &str) -> Option<Option<u16>> {
    if file_name == name {
        return Some(Some(1));
    }
    let versioned = file_name.strip_prefix(name)?.strip_prefix("_v")?;
    let digits = versioned
        .split_once('_')
        .map_or(versioned, |(digits, _)| digits);
    Some(digits.parse().ok())
}

/// Whether a datapath is pinned in `pin_dir`: its configuration map, of
/// any layout.
#[must_use]
pub fn datapath_pinned(pin_dir: &Path) -> bool {
    !find(pin_dir, vpcnet_common::maps::CONFIG).is_empty()
}

/// Every pin of map `name` in `pin_dir`, with what the kernel says of it.
pub fn find(pin_dir: &Path, name: &str) -> Vec<Found> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(pin_dir).into_iter().flatten().flatten() {
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let Some(layout) = layout_of_pin(name, &file_name) else {
            continue;
        };
        let path = entry.path();
        match MapInfo::from_pin(&path) {
            Ok(info) => found.push(Found {
                shape: Shape::of(&info),
                id: info.id(),
                layout,
                path,
            }),
            Err(e) => warn!(pin = %path.display(), error = %e, "not a map: left as it is"),
        }
    }
    found.sort_by(|a, b| a.path.cmp(&b.path));
    found
}

/// The ids of the maps the programs attached through `pin_dir`'s pinned
/// links use: TCX links, or the programs of clsact filters.
pub fn live_map_ids(pin_dir: &Path) -> BTreeSet<u32> {
    let program_ids: BTreeSet<u32> = std::fs::read_dir(pin_dir.join(LINKS_DIR))
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|dir| {
            std::fs::read_dir(dir.path())
                .into_iter()
                .flatten()
                .flatten()
        })
        .filter_map(|pin| attached_program_id(&pin.path()))
        .collect();
    if program_ids.is_empty() {
        return BTreeSet::new();
    }
    loaded_programs()
        .flatten()
        .filter(|program| program_ids.contains(&program.id()))
        .filter_map(|program| program.map_ids().ok().flatten())
        .flatten()
        .collect()
}

/// The id of the program a pin of the links directory attaches: the
/// pinned program of a clsact filter, or a TCX link's. The kernel's
/// `fdinfo` of either says it (`prog_id:`); asking for a program's or a
/// link's info would read the other kind's as its own.
fn attached_program_id(pin: &Path) -> Option<u32> {
    let fd = object_of_pin(pin).ok()?;
    // One read of a buffer that holds the whole of it (a few hundred bytes):
    // `read_to_string` takes six calls, and a node of a thousand pods has
    // two thousand pins to read at each start.
    let mut buffer = [0u8; 1024];
    let read = std::fs::File::open(format!("/proc/self/fdinfo/{}", fd.as_raw_fd()))
        .and_then(|mut file| std::io::Read::read(&mut file, &mut buffer))
        .ok()?;
    std::str::from_utf8(&buffer[..read])
        .ok()?
        .lines()
        .find_map(|line| line.strip_prefix("prog_id:"))
        .and_then(|id| id.trim().parse().ok())
}

/// `BPF_OBJ_GET`: the object pinned at `pin`, whatever its kind.
fn object_of_pin(pin: &Path) -> std::io::Result<OwnedFd> {
    /// `union bpf_attr` for `BPF_OBJ_GET`.
    #[repr(C)]
    struct ObjGetAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    const BPF_OBJ_GET: libc::c_long = 7;
    let path = CString::new(pin.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let mut attr = ObjGetAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    // SAFETY: `attr` is `BPF_OBJ_GET`'s layout; `path` outlives the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET,
            std::ptr::from_mut(&mut attr),
            size_of::<ObjGetAttr>(),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(std::io::Error::other)?;
    // SAFETY: the kernel gave us this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use aya::maps::MapType;

    use super::*;

    const NAT: PinnedMap = PinnedMap {
        name: "VPCNET_NAT_FWD",
        layout: 2,
    };

    const WANTED: Shape = Shape {
        map_type: MapType::Hash as u32,
        key_size: 16,
        value_size: 24,
        max_entries: 1024,
    };

    fn pin(name: &str, id: u32, shape: Shape) -> Found {
        Found {
            path: PathBuf::from("/pins").join(name),
            layout: layout_of_pin(NAT.name, name).expect("a NAT pin"),
            shape,
            id,
        }
    }

    fn own() -> PathBuf {
        pin_path(Path::new("/pins"), &NAT)
    }

    fn live(ids: &[u32]) -> BTreeSet<u32> {
        ids.iter().copied().collect()
    }

    #[test]
    fn pin_names_say_their_layout() {
        assert_eq!(own(), Path::new("/pins/VPCNET_NAT_FWD_v2"));
        assert_eq!(layout_of_pin(NAT.name, "VPCNET_NAT_FWD"), Some(Some(1)));
        assert_eq!(layout_of_pin(NAT.name, "VPCNET_NAT_FWD_v2"), Some(Some(2)));
        assert_eq!(
            layout_of_pin(NAT.name, "VPCNET_NAT_FWD_v12_resized"),
            Some(Some(12))
        );
        assert_eq!(layout_of_pin(NAT.name, "VPCNET_NAT_FWD_vX"), Some(None));
        assert_eq!(layout_of_pin(NAT.name, "VPCNET_NAT_REV_v2"), None);
        assert_eq!(layout_of_pin(NAT.name, "links"), None);
    }

    #[test]
    fn a_restart_reuses_its_own_map() {
        let found = vec![pin("VPCNET_NAT_FWD_v2", 7, WANTED)];
        let resolved = resolve(NAT, WANTED, &own(), found, &live(&[7]));
        assert_eq!(resolved.plan, Plan::Reuse);
        assert!(resolved.superseded.is_empty() && resolved.foreign.is_empty());
    }

    #[test]
    fn an_upgrade_carries_the_unversioned_map_of_earlier_releases() {
        let found = vec![pin("VPCNET_NAT_FWD", 3, WANTED)];
        let resolved = resolve(NAT, WANTED, &own(), found.clone(), &live(&[3]));
        assert_eq!(resolved.plan, Plan::Carry(found[0].clone()));
    }

    #[test]
    fn another_size_is_carried_into_a_new_map() {
        let smaller = Shape {
            max_entries: 512,
            ..WANTED
        };
        let found = vec![pin("VPCNET_NAT_FWD_v2", 7, smaller)];
        let resolved = resolve(NAT, WANTED, &own(), found.clone(), &live(&[7]));
        assert_eq!(resolved.plan, Plan::Carry(found[0].clone()));
    }

    #[test]
    fn a_newer_layout_is_left_alone_and_the_map_starts_empty() {
        let found = vec![pin("VPCNET_NAT_FWD_v3", 9, WANTED)];
        let resolved = resolve(NAT, WANTED, &own(), found.clone(), &live(&[9]));
        assert_eq!(resolved.plan, Plan::Fresh);
        assert_eq!(resolved.unreadable_live, Some(found[0].clone()));
        assert_eq!(resolved.foreign, found);
        assert!(resolved.superseded.is_empty());
    }

    #[test]
    fn a_key_or_value_of_another_size_is_not_read() {
        let other = Shape {
            value_size: 32,
            ..WANTED
        };
        let found = vec![pin("VPCNET_NAT_FWD_v2", 7, other)];
        let resolved = resolve(NAT, WANTED, &own(), found.clone(), &live(&[7]));
        assert_eq!(resolved.plan, Plan::Fresh);
        assert_eq!(resolved.foreign, found);
    }

    #[test]
    fn after_a_downgrade_and_back_the_map_in_use_is_carried_not_the_stale_own() {
        // Upgraded to layout 2, downgraded to a release of layout 1 (which
        // left the layout 2 pin alone), upgraded again.
        let found = vec![
            pin("VPCNET_NAT_FWD", 3, WANTED),
            pin("VPCNET_NAT_FWD_v2", 7, WANTED),
        ];
        let resolved = resolve(NAT, WANTED, &own(), found.clone(), &live(&[3]));
        assert_eq!(resolved.plan, Plan::Carry(found[0].clone()));
        assert_eq!(resolved.superseded, vec![found[1].clone()]);
    }

    #[test]
    fn with_links_on_two_sets_of_maps_our_own_stays_and_the_other_is_merged() {
        // An upgrade stopped while it swapped links one by one: some run
        // the release's programs on its maps, some ours.
        let found = vec![
            pin("VPCNET_NAT_FWD", 3, WANTED),
            pin("VPCNET_NAT_FWD_v2", 7, WANTED),
        ];
        for order in [found.clone(), found.iter().rev().cloned().collect()] {
            let resolved = resolve(NAT, WANTED, &own(), order, &live(&[3, 7]));
            assert_eq!(resolved.plan, Plan::Reuse);
            assert_eq!(resolved.superseded, vec![found[0].clone()]);
        }
    }

    #[test]
    fn with_nothing_attached_the_own_pin_then_the_newest_readable_one_is_taken() {
        let found = vec![
            pin("VPCNET_NAT_FWD", 3, WANTED),
            pin("VPCNET_NAT_FWD_v2", 7, WANTED),
        ];
        let resolved = resolve(NAT, WANTED, &own(), found, &live(&[]));
        assert_eq!(resolved.plan, Plan::Reuse);
        let found = vec![
            pin("VPCNET_NAT_FWD", 3, WANTED),
            pin("VPCNET_NAT_FWD_v2_resized", 7, WANTED),
        ];
        let resolved = resolve(NAT, WANTED, &own(), found.clone(), &live(&[]));
        assert_eq!(resolved.plan, Plan::Carry(found[1].clone()));
    }

    #[test]
    fn nothing_pinned_starts_empty() {
        let resolved = resolve(NAT, WANTED, &own(), Vec::new(), &live(&[1]));
        assert_eq!(resolved.plan, Plan::Fresh);
    }
}
