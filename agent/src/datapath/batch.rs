//! Whole-table reads and judged removals on hash maps, with the commands
//! aya 0.14 does not wrap: `BPF_MAP_LOOKUP_BATCH` (Linux 5.6) reads
//! thousands of entries per call where iterating takes two calls per entry;
//! `BPF_MAP_LOOKUP_AND_DELETE_ELEM` (5.14 for hash maps) removes an entry
//! and returns what it removed, so a collector can put back an entry that
//! changed after it judged it, instead of losing it. Every EKS kernel has
//! both; on a kernel without them each falls back to one entry at a time.

use std::{
    borrow::Borrow,
    io,
    mem::MaybeUninit,
    os::fd::{AsFd as _, AsRawFd},
    sync::OnceLock,
};

use aya::{
    Pod,
    maps::{HashMap, IterableMap, MapData, MapError, PerCpuArray},
    sys::SyscallError,
};

const BPF_MAP_UPDATE_ELEM: u32 = 2;
const BPF_MAP_DELETE_ELEM: u32 = 3;
const BPF_MAP_LOOKUP_AND_DELETE_ELEM: u32 = 21;
const BPF_MAP_LOOKUP_BATCH: u32 = 24;
/// `BPF_NOEXIST`: insert only if absent.
pub(super) const BPF_NOEXIST: u64 = 1;
/// Entries asked for per batch call.
const BATCH_ENTRIES: usize = 4096;
/// The kernel's "operation not supported" (`ENOTSUPP`, not `EOPNOTSUPP`).
const ENOTSUPP: i32 = 524;

/// `union bpf_attr` for the element commands.
#[repr(C)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// `union bpf_attr` for the batch commands.
#[repr(C)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// The `bpf(2)` command `cmd` with `attr`, which must be the `bpf_attr`
/// layout of that command (also for the datapath's other raw commands).
pub(super) fn bpf<T>(cmd: u32, attr: &mut T) -> io::Result<()> {
    let size = u32::try_from(size_of::<T>()).expect("a small struct");
    // SAFETY: `attr` is a `bpf_attr` layout for `cmd`, alive for the call;
    // the pointers in it are the caller's, sized as the map says.
    let ret = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut(attr), size) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn unsupported(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EINVAL | ENOTSUPP))
}

fn syscall_error(call: &'static str, io_error: io::Error) -> MapError {
    MapError::SyscallError(SyscallError { call, io_error })
}

fn map_fd<T: Borrow<MapData>, K: Pod, V: Pod>(map: &HashMap<T, K, V>) -> u32 {
    u32::try_from(map.map().fd().as_fd().as_raw_fd()).expect("descriptors are not negative")
}

fn elem_attr<T: Borrow<MapData>, K: Pod, V: Pod>(
    map: &HashMap<T, K, V>,
    key: &K,
    value: *mut V,
    flags: u64,
) -> ElemAttr {
    ElemAttr {
        map_fd: map_fd(map),
        _pad: 0,
        key: std::ptr::from_ref(key) as u64,
        value: value as u64,
        flags,
    }
}

/// Every entry of `map`, [`BATCH_ENTRIES`] per call. A table that changes
/// meanwhile may be read without the entries added or moved during the
/// read, as with any walk of a live map.
///
/// # Errors
/// The kernel refused the read.
pub fn read_all<T: Borrow<MapData>, K: Pod, V: Pod>(
    map: &HashMap<T, K, V>,
) -> Result<Vec<(K, V)>, MapError> {
    let mut entries = Vec::new();
    let mut batch = BATCH_ENTRIES;
    // The kernel's position in the table: a bucket number for hash maps.
    let (mut position, mut next) = (0_u64, 0_u64);
    let mut first = true;
    loop {
        let mut keys: Vec<MaybeUninit<K>> = Vec::with_capacity(batch);
        let mut values: Vec<MaybeUninit<V>> = Vec::with_capacity(batch);
        let mut attr = BatchAttr {
            in_batch: if first {
                0
            } else {
                std::ptr::from_mut(&mut position) as u64
            },
            out_batch: std::ptr::from_mut(&mut next) as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: u32::try_from(batch).expect("a bounded batch"),
            map_fd: map_fd(map),
            elem_flags: 0,
            flags: 0,
        };
        let result = bpf(BPF_MAP_LOOKUP_BATCH, &mut attr);
        let done = match result {
            Ok(()) => false,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            // One bucket holds more entries than the batch: a bigger one.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && batch < 1 << 20 => {
                batch *= 2;
                continue;
            }
            Err(e) if first && unsupported(&e) => return map.iter().collect(),
            Err(e) => return Err(syscall_error("BPF_MAP_LOOKUP_BATCH", e)),
        };
        let count = usize::try_from(attr.count).expect("u32 fits usize");
        // SAFETY: the kernel wrote `count` keys and values, at most `batch`.
        unsafe {
            keys.set_len(count.min(batch));
            values.set_len(count.min(batch));
        }
        entries.extend(
            keys.into_iter()
                .zip(values)
                // SAFETY: written by the kernel, as above.
                .map(|(k, v)| unsafe { (k.assume_init(), v.assume_init()) }),
        );
        if done {
            return Ok(entries);
        }
        position = next;
        first = false;
    }
}

/// The entry of `key`, if any (aya's lookup, its "not found" as `None`).
///
/// # Errors
/// The kernel refused the lookup.
pub fn get<T: Borrow<MapData>, K: Pod, V: Pod>(
    map: &HashMap<T, K, V>,
    key: &K,
) -> Result<Option<V>, MapError> {
    match map.get(key, 0) {
        Ok(value) => Ok(Some(value)),
        Err(MapError::KeyNotFound) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Removes the entry of `key` if it is still `judged`; one that changed
/// since (a packet refreshed it, a new flow took the key) stays, or is put
/// back at once where the kernel cannot compare for us. Returns whether
/// the judged entry was removed.
///
/// # Errors
/// The kernel refused the removal.
pub fn remove_if_unchanged<T: Borrow<MapData>, K: Pod + PartialEq, V: Pod + PartialEq>(
    map: &HashMap<T, K, V>,
    key: &K,
    judged: &V,
) -> Result<bool, MapError> {
    let mut removed = MaybeUninit::<V>::uninit();
    let mut attr = elem_attr(map, key, removed.as_mut_ptr(), 0);
    match bpf(BPF_MAP_LOOKUP_AND_DELETE_ELEM, &mut attr) {
        Ok(()) => {
            // SAFETY: written by the kernel.
            let removed = unsafe { removed.assume_init() };
            if removed == *judged {
                return Ok(true);
            }
            // Changed since judged: back it goes, unless the datapath
            // already made a new entry in this instant.
            put_if_absent(map, key, &removed)?;
            Ok(false)
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) if unsupported(&e) => {
            // Compared, then removed: the instant between is left open.
            if get(map, key)?.as_ref() != Some(judged) {
                return Ok(false);
            }
            remove(map, key)
        }
        Err(e) => Err(syscall_error("BPF_MAP_LOOKUP_AND_DELETE_ELEM", e)),
    }
}

/// Inserts `value` at `key` unless an entry is there. Returns whether it did.
///
/// # Errors
/// The kernel refused the insert (other than for an existing entry).
pub fn put_if_absent<T: Borrow<MapData>, K: Pod, V: Pod>(
    map: &HashMap<T, K, V>,
    key: &K,
    value: &V,
) -> Result<bool, MapError> {
    let mut attr = elem_attr(map, key, std::ptr::from_ref(value).cast_mut(), BPF_NOEXIST);
    match bpf(BPF_MAP_UPDATE_ELEM, &mut attr) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(false),
        Err(e) => Err(syscall_error("BPF_MAP_UPDATE_ELEM", e)),
    }
}

/// Removes the entry of `key`. Returns whether there was one.
///
/// # Errors
/// The kernel refused the removal.
pub fn remove<T: Borrow<MapData>, K: Pod, V: Pod>(
    map: &HashMap<T, K, V>,
    key: &K,
) -> Result<bool, MapError> {
    let mut attr = elem_attr(map, key, std::ptr::null_mut::<V>(), 0);
    match bpf(BPF_MAP_DELETE_ELEM, &mut attr) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(syscall_error("BPF_MAP_DELETE_ELEM", e)),
    }
}

/// Each of the first `len` slots of per-CPU array `map`, summed over the
/// CPUs, in one call where the kernel has batches (a counter scrape, or a
/// test reading them after every packet).
///
/// # Errors
/// The kernel refused the read.
pub fn per_cpu_sums<T: Borrow<MapData>>(
    map: &PerCpuArray<T, u64>,
    len: u32,
) -> Result<Vec<u64>, MapError> {
    // Read from sysfs once: a scrape, or a test after every packet, reads
    // the counters often.
    static POSSIBLE_CPUS: OnceLock<usize> = OnceLock::new();
    let cpus = if let Some(cpus) = POSSIBLE_CPUS.get() {
        *cpus
    } else {
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| syscall_error("possible CPUs", e))?;
        *POSSIBLE_CPUS.get_or_init(|| cpus)
    };
    let slots = usize::try_from(len).expect("u32 fits usize");
    let mut keys = vec![0_u32; slots];
    // Per-CPU values come one per possible CPU, each 8-byte aligned.
    let mut values = vec![0_u64; slots * cpus];
    let mut next = 0_u32;
    let mut attr = BatchAttr {
        in_batch: 0,
        out_batch: std::ptr::from_mut(&mut next) as u64,
        keys: keys.as_mut_ptr() as u64,
        values: values.as_mut_ptr() as u64,
        count: len,
        map_fd: u32::try_from(map.map().fd().as_fd().as_raw_fd())
            .expect("descriptors are not negative"),
        elem_flags: 0,
        flags: 0,
    };
    match bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) {
        // ENOENT: the array ended within the batch, all of it read.
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
        Err(e) if unsupported(&e) => {
            return (0..len)
                .map(|index| map.get(&index, 0).map(|per_cpu| per_cpu.iter().sum()))
                .collect();
        }
        Err(e) => return Err(syscall_error("BPF_MAP_LOOKUP_BATCH", e)),
    }
    let read = usize::try_from(attr.count)
        .expect("u32 fits usize")
        .min(slots);
    let mut sums = vec![0_u64; slots];
    for (key, per_cpu) in keys[..read].iter().zip(values.chunks(cpus)) {
        if let Some(sum) = sums.get_mut(usize::try_from(*key).expect("u32 fits usize")) {
            *sum = per_cpu.iter().sum();
        }
    }
    Ok(sums)
}
