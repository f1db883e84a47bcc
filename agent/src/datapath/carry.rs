//! Carrying the running datapath's entries into the new maps of an agent
//! whose layout or sizes differ (which maps: [`super::pins`]).
//!
//! Two passes around the swap of the programs. Before it, everything is
//! copied, so the new programs start with every pod, ENI, prefix and flow.
//! Between that copy and the swap the old programs still run: after it,
//! the flows they created meanwhile are copied too, and the TCP flags they
//! saw are added to the copies. Counters are carried once, after the swap,
//! added to what the new programs counted, so no packet counts twice.

use std::{borrow::Borrow, collections::HashMap as StdHashMap};

use aya::{
    Ebpf, Pod,
    maps::{
        Array, HashMap, LpmTrie, Map, MapData, MapError, PerCpuArray, PerCpuValues, lpm_trie::Key,
    },
};
use vpcnet_common::{
    cidr::{CidrValue, ExternalServiceCidr},
    config::{CONFIG_LAYOUT1_SIZE, Config},
    counters::Counter,
    endpoint::{Endpoint, Eni},
    maps::{self as names, PinnedMap},
    nat::{
        FlowKey, FlowKind, FragKey, FragPath, NAT_ENTRY_UNTRACKED_SIZE, NatEntry, TCP_ACK_KNOWN,
        TCP_END_KNOWN, TCP_OWES_FIN_ACK, TIMEOUTS_LAYOUT1_SIZE, Timeouts, seq_after,
    },
};

use super::{DatapathError, DatapathMaps, batch, pins::Found};

/// A map of the running datapath whose entries go into a new map.
pub struct Carry {
    pub map: PinnedMap,
    pub from: Found,
    /// The layout of `from` (a carried pin's name always says one: it is
    /// of a layout this agent reads).
    from_layout: u16,
    source: Source,
    /// Whether its entries are merged into a map that holds entries of its
    /// own (see [`merges`]), rather than copied into a new one.
    merging: bool,
    pub tally: Tally,
}

/// Whether a superseded pin of map `name` has its entries merged into the
/// map the new programs use before it is removed: the flows, which an
/// upgrade stopped half-way may have left on either set of maps. (The
/// other maps are the agent's to fill again, or counted once already.)
#[must_use]
pub fn merges(name: &str) -> bool {
    matches!(name, names::NAT_FWD | names::NAT_REV | names::STACK_FLOWS)
}

enum Source {
    /// Layout 1's is narrower: before the mark bits.
    Config(OneValue<Config, CONFIG_LAYOUT1_SIZE>),
    /// Layout 1's is narrower: the first ten timeouts.
    Timeouts(OneValue<Timeouts, TIMEOUTS_LAYOUT1_SIZE>),
    Cidrs(LpmTrie<MapData, [u8; 4], CidrValue>),
    ExternalServiceCidrs(LpmTrie<MapData, [u8; 4], ExternalServiceCidr>),
    /// NAT and stack flows, and what the first pass copied of them.
    Flows(FlowMap, StdHashMap<FlowKey, NatEntry>),
    FragPaths(HashMap<MapData, FragKey, FragPath>),
    Counters(PerCpuArray<MapData, u64>),
    Endpoints(HashMap<MapData, u32, Endpoint>),
    Enis(HashMap<MapData, u32, Eni>),
}

impl Carry {
    /// Opens the map pinned at `from` as `map`'s entries.
    pub fn open(map: PinnedMap, from: Found) -> Result<Self, DatapathError> {
        let opened = MapData::from_pin(&from.path)
            .and_then(Map::from_map_data)
            .map_err(|source| DatapathError::OpenPinned {
                path: from.path.clone(),
                source,
            })?;
        let typed = |e| DatapathError::map(map.name)(e);
        // A value of an earlier, narrower layout (`names::WIDENED`).
        let narrow = names::widened_from(map.name)
            .is_some_and(|size| u32::try_from(size).ok() == Some(from.shape.value_size));
        let source = match map.name {
            names::CONFIG => Source::Config(OneValue::open(opened, narrow).map_err(typed)?),
            names::CT_TIMEOUTS => Source::Timeouts(OneValue::open(opened, narrow).map_err(typed)?),
            names::CIDRS => Source::Cidrs(LpmTrie::try_from(opened).map_err(typed)?),
            names::EXTERNAL_SERVICE_CIDRS => {
                Source::ExternalServiceCidrs(LpmTrie::try_from(opened).map_err(typed)?)
            }
            names::NAT_FWD | names::NAT_REV | names::STACK_FLOWS => {
                let flows = if narrow {
                    FlowMap::Untracked(HashMap::try_from(opened).map_err(typed)?)
                } else {
                    FlowMap::Tracked(HashMap::try_from(opened).map_err(typed)?)
                };
                Source::Flows(flows, StdHashMap::new())
            }
            names::FRAG_PATHS => Source::FragPaths(HashMap::try_from(opened).map_err(typed)?),
            names::COUNTERS => Source::Counters(PerCpuArray::try_from(opened).map_err(typed)?),
            names::ENDPOINTS => Source::Endpoints(HashMap::try_from(opened).map_err(typed)?),
            names::ENIS => Source::Enis(HashMap::try_from(opened).map_err(typed)?),
            _ => return Err(DatapathError::MissingMap(map.name)),
        };
        Ok(Self {
            map,
            from_layout: from.layout.unwrap_or(1),
            from,
            source,
            merging: false,
            tally: Tally::default(),
        })
    }

    /// Opens the superseded pin at `from`, a flow map (see [`merges`]), to
    /// merge its entries into `map`'s.
    pub fn open_merging(map: PinnedMap, from: Found) -> Result<Self, DatapathError> {
        Ok(Self {
            merging: true,
            ..Self::open(map, from)?
        })
    }

    /// One `pass` of this map's entries into the new `maps` (see the
    /// module's documentation for what each pass carries).
    pub fn pass(
        &mut self,
        pass: Pass,
        maps: &mut DatapathMaps,
        ebpf: &mut Ebpf,
    ) -> Result<(), DatapathError> {
        let name = self.map.name;
        let err = |source| DatapathError::Map { name, source };
        let from_layout = self.from_layout;
        let tally = match (pass, &mut self.source) {
            (Pass::BeforeSwap, Source::Config(from)) => {
                maps.set_config(&from.value().map_err(err)?)?;
                Tally::one()
            }
            (Pass::BeforeSwap, Source::Timeouts(from)) => {
                maps.set_timeouts(&from.value().map_err(err)?)?;
                Tally::one()
            }

            (Pass::BeforeSwap, Source::Cidrs(from)) => {
                let mut tally = Tally::default();
                for entry in from.iter() {
                    let (key, value): (Key<[u8; 4]>, CidrValue) = entry.map_err(err)?;
                    tally
                        .count(maps.cidrs.insert(&key, value, 0).map(|()| true))
                        .map_err(err)?;
                }
                tally
            }
            (Pass::BeforeSwap, Source::ExternalServiceCidrs(from)) => {
                let mut tally = Tally::default();
                for entry in from.iter() {
                    let (key, value) = entry.map_err(err)?;
                    tally
                        .count(
                            maps.external_service_cidrs
                                .insert(&key, value, 0)
                                .map(|()| true),
                        )
                        .map_err(err)?;
                }
                tally
            }
            (Pass::BeforeSwap, Source::Flows(from, copied)) => {
                let to = flows_of_mut(maps, name);
                let entries = from.read_all().map_err(err)?;
                let mut tally = Tally::default();
                for (key, entry) in &entries {
                    let put = if self.merging {
                        merge_newest(to, key, entry)
                    } else {
                        batch::put_if_absent(to, key, entry)
                    };
                    tally.count(put).map_err(err)?;
                }
                if name == names::NAT_FWD && from_layout < 2 {
                    let paired = pair_untranslated_flows(&maps.nat_rev, &entries);
                    tally.merge(paired.map_err(DatapathError::map(names::NAT_REV))?);
                }
                copied.extend(entries);
                tally
            }
            // The flows the old programs created between the passes; the
            // TCP flags they saw added to the copies.
            (Pass::AfterSwap, Source::Flows(from, copied)) => {
                let to = flows_of_mut(maps, name);
                let mut tally = Tally::default();
                let mut added = Vec::new();
                for (key, entry) in from.read_all().map_err(err)? {
                    match copied.get(&key) {
                        Some(first) if *first == entry => {}
                        Some(first) => after_first_pass(to, &key, first, &entry).map_err(err)?,
                        None => {
                            tally
                                .count(batch::put_if_absent(to, &key, &entry))
                                .map_err(err)?;
                            added.push((key, entry));
                        }
                    }
                }
                if name == names::NAT_FWD && from_layout < 2 {
                    let paired = pair_untranslated_flows(&maps.nat_rev, &added);
                    tally.merge(paired.map_err(DatapathError::map(names::NAT_REV))?);
                }
                tally
            }
            (_, Source::FragPaths(from)) => copy_absent(from, &frag_paths(ebpf)?).map_err(err)?,
            (Pass::BeforeSwap, Source::Endpoints(from)) => {
                copy_absent(from, &maps.endpoints).map_err(err)?
            }
            (Pass::BeforeSwap, Source::Enis(from)) => copy_absent(from, &maps.enis).map_err(err)?,
            // Counters after the swap only: see the module's documentation.
            (Pass::AfterSwap, Source::Counters(from)) => {
                add_counters(from, &mut maps.counters, from_layout)?
            }
            (Pass::BeforeSwap, Source::Counters(_))
            | (
                Pass::AfterSwap,
                Source::Config(_)
                | Source::Timeouts(_)
                | Source::Cidrs(_)
                | Source::ExternalServiceCidrs(_)
                | Source::Endpoints(_)
                | Source::Enis(_),
            ) => Tally::default(),
        };
        self.tally.merge(tally);
        Ok(())
    }
}

/// A pinned array of one value (the configuration, the timeouts), of
/// today's layout or of an earlier, narrower one (`N` bytes, a prefix).
enum OneValue<T: Pod, const N: usize> {
    Current(Array<MapData, T>),
    Narrow(Array<MapData, [u8; N]>),
}

impl<T: Pod + Default, const N: usize> OneValue<T, N> {
    fn open(map: Map, narrow: bool) -> Result<Self, MapError> {
        Ok(if narrow {
            Self::Narrow(Array::try_from(map)?)
        } else {
            Self::Current(Array::try_from(map)?)
        })
    }

    /// Its value, widened to today's with the appended fields zero.
    fn value(&self) -> Result<T, MapError> {
        match self {
            Self::Current(map) => map.get(&0, 0),
            Self::Narrow(map) => Ok(widen(&map.get(&0, 0)?)),
        }
    }
}

/// A pinned map of flows, of today's entries or of the narrower ones
/// before TCP sequence tracking.
enum FlowMap {
    Tracked(HashMap<MapData, FlowKey, NatEntry>),
    Untracked(HashMap<MapData, FlowKey, [u8; NAT_ENTRY_UNTRACKED_SIZE]>),
}

impl FlowMap {
    /// Every entry, as today's: a narrower one with its sequence numbers
    /// unknown, which the state derivation reads as acknowledged.
    fn read_all(&self) -> Result<Vec<(FlowKey, NatEntry)>, MapError> {
        match self {
            Self::Tracked(map) => batch::read_all(map),
            Self::Untracked(map) => Ok(batch::read_all(map)?
                .into_iter()
                .map(|(key, narrow)| (key, widen(&narrow)))
                .collect()),
        }
    }
}

/// The entries of the flow map (NAT or stack flows) pinned at `path`, of
/// whichever layout: narrower entries as today's, their sequence numbers
/// unknown.
///
/// # Errors
/// The pin cannot be opened, or it is no flow map.
pub fn read_pinned_flows(
    path: &std::path::Path,
) -> Result<Vec<(FlowKey, NatEntry)>, DatapathError> {
    let opened = |e| DatapathError::OpenPinned {
        path: path.to_owned(),
        source: e,
    };
    let data = MapData::from_pin(path).map_err(opened)?;
    let narrow = data.info().map_err(opened)?.value_size()
        == u32::try_from(NAT_ENTRY_UNTRACKED_SIZE).unwrap_or(u32::MAX);
    let map = Map::from_map_data(data).map_err(opened)?;
    let flows = if narrow {
        FlowMap::Untracked(HashMap::try_from(map).map_err(opened)?)
    } else {
        FlowMap::Tracked(HashMap::try_from(map).map_err(opened)?)
    };
    flows.read_all().map_err(opened)
}

/// A value of an earlier layout that is a prefix of `T` (its fields only
/// ever appended), the appended ones zero.
fn widen<T: Pod + Default, const N: usize>(narrow: &[u8; N]) -> T {
    const { assert!(N <= size_of::<T>()) };
    let mut value = T::default();
    // SAFETY: `T` is `Pod` (any bytes are a value) and at least `N` bytes
    // long; the two do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(narrow.as_ptr(), (&raw mut value).cast::<u8>(), N);
    }
    value
}

/// The two passes around the swap of the programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// Everything, before the new programs are swapped in.
    BeforeSwap,
    /// Once the new programs run: what the old ones did after the first.
    AfterSwap,
}

/// Entries carried, and entries not carried: no room in the new map, or
/// a meaning that changed.
#[derive(Clone, Copy, Default)]
pub struct Tally {
    pub carried: usize,
    pub dropped: usize,
}

impl Tally {
    fn one() -> Self {
        Self {
            carried: 1,
            dropped: 0,
        }
    }

    /// Counts an insert: done, already there (not counted), or no room.
    fn count(&mut self, inserted: Result<bool, MapError>) -> Result<(), MapError> {
        match inserted {
            Ok(true) => self.carried += 1,
            Ok(false) => {}
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::E2BIG) => {
                self.dropped += 1;
            }
            Err(e) => return Err(e),
        }
        Ok(())
    }

    fn merge(&mut self, other: Self) {
        self.carried += other.carried;
        self.dropped += other.dropped;
    }
}

fn flows_of_mut<'a>(
    maps: &'a mut DatapathMaps,
    name: &str,
) -> &'a mut HashMap<MapData, FlowKey, NatEntry> {
    match name {
        names::NAT_FWD => &mut maps.nat_fwd,
        names::NAT_REV => &mut maps.nat_rev,
        _ => &mut maps.stack_flows,
    }
}

/// The new object's map of fragmented datagrams in flight, which no
/// typed handle holds.
fn frag_paths(ebpf: &mut Ebpf) -> Result<HashMap<&mut MapData, FragKey, FragPath>, DatapathError> {
    let map = ebpf
        .map_mut(names::FRAG_PATHS)
        .ok_or(DatapathError::MissingMap(names::FRAG_PATHS))?;
    HashMap::try_from(map).map_err(DatapathError::map(names::FRAG_PATHS))
}

fn copy_absent<T: Borrow<MapData>, K: Pod, V: Pod>(
    from: &HashMap<MapData, K, V>,
    to: &HashMap<T, K, V>,
) -> Result<Tally, MapError> {
    let mut tally = Tally::default();
    for (key, value) in &batch::read_all(from)? {
        tally.count(batch::put_if_absent(to, key, value))?;
    }
    Ok(tally)
}

/// Layout 1 kept a flow it left untranslated (EXTERNALSNAT, or opened
/// from outside the VPC) as a forward entry alone; layout 2 keeps it as a
/// pair, its reverse entry keyed by the reverse tuple. Which side opened it
/// layout 1 did not say: the pod's, as a flow it reopens becomes.
fn pair_untranslated_flows(
    nat_rev: &HashMap<MapData, FlowKey, NatEntry>,
    forward: &[(FlowKey, NatEntry)],
) -> Result<Tally, MapError> {
    let mut tally = Tally::default();
    for (key, entry) in forward {
        if entry.kind == FlowKind::NoSnat as u8 {
            tally.count(batch::put_if_absent(nat_rev, &key.reversed(), entry))?;
        }
    }
    Ok(tally)
}

/// Merges `entry` of a superseded map into the entry of its key in `to`:
/// the flow begun last stays (`created_ns`), what each saw of one same
/// flow is added up. `Ok(true)` when `to` changed.
fn merge_newest(
    to: &mut HashMap<MapData, FlowKey, NatEntry>,
    key: &FlowKey,
    entry: &NatEntry,
) -> Result<bool, MapError> {
    let merged = match batch::get(to, key)? {
        None => *entry,
        Some(current) if entry.created_ns > current.created_ns => *entry,
        Some(mut current) if entry.created_ns == current.created_ns => {
            merge_into(&mut current, entry);
            current
        }
        Some(_) => return Ok(false),
    };
    to.insert(key, merged, 0)?;
    Ok(true)
}

/// An entry the old programs changed after the first pass (`first` then,
/// `old` now), into the new map's entry of its key.
fn after_first_pass(
    to: &mut HashMap<MapData, FlowKey, NatEntry>,
    key: &FlowKey,
    first: &NatEntry,
    old: &NatEntry,
) -> Result<(), MapError> {
    match second_pass(batch::get(to, key)?, first, old) {
        Some(entry) => to.insert(key, entry, 0),
        None => Ok(()),
    }
}

/// What the new map's entry (`current`, `None` if there is none) becomes,
/// given what the first pass copied (`first`) and what the old programs
/// hold now (`old`); `None`: it stays as it is.
///
/// The old programs may have made another flow of the tuple meanwhile: a
/// port taken over re-points its claim, a tuple reopened starts afresh.
/// Each starts a new `created_ns`, and a reopen empties `seen`, whose
/// flags otherwise only accumulate (releases before this one left the
/// reverse half's `created_ns` as it was). That flow is the live one
/// unless the new programs made a newer one since.
fn second_pass(current: Option<NatEntry>, first: &NatEntry, old: &NatEntry) -> Option<NatEntry> {
    let started_afresh = old.created_ns != first.created_ns || old.seen & first.seen != first.seen;
    if started_afresh {
        return match current {
            Some(current) if current.created_ns > old.created_ns => None,
            _ => Some(*old),
        };
    }
    let mut entry = current?;
    if entry.created_ns != first.created_ns {
        // The new programs made another flow of this tuple meanwhile.
        return None;
    }
    merge_into(&mut entry, old);
    Some(entry)
}

/// What an old program recorded after the first pass (`old`), added to
/// the new map's copy (`entry`), which the new programs may have moved on
/// since: the flags, the later last packet, and the TCP numbers further
/// along in sequence space (a copy left behind would show data as
/// unacknowledged, and a flow idle after the upgrade would end at the
/// unacknowledged timeout).
fn merge_into(entry: &mut NatEntry, old: &NatEntry) {
    entry.seen |= old.seen;
    entry.last_seen_ns = entry.last_seen_ns.max(old.last_seen_ns);
    let further = |known: u8, old_value: u32, tcp: u8, value: u32| {
        old.tcp & known != 0 && (tcp & known == 0 || seq_after(old_value, value))
    };
    if further(TCP_END_KNOWN, old.seq_end, entry.tcp, entry.seq_end) {
        entry.seq_end = old.seq_end;
        entry.tcp |= TCP_END_KNOWN;
    }
    if further(TCP_ACK_KNOWN, old.ack, entry.tcp, entry.ack) {
        entry.ack = old.ack;
        entry.tcp = (entry.tcp | TCP_ACK_KNOWN) & !TCP_OWES_FIN_ACK;
    }
}

/// Adds the old counters to the new ones, index by index, except those
/// whose meaning changed since `from_layout`.
fn add_counters(
    from: &PerCpuArray<MapData, u64>,
    to: &mut PerCpuArray<MapData, u64>,
    from_layout: u16,
) -> Result<Tally, DatapathError> {
    let err = |source| DatapathError::Map {
        name: names::COUNTERS,
        source,
    };
    let mut tally = Tally::default();
    let slots = from.len().min(to.len());
    for index in 0..slots {
        if !counter_carries(from_layout, index) {
            tally.dropped += 1;
            continue;
        }
        let old = from.get(&index, 0).map_err(err)?;
        if old.iter().all(|count| *count == 0) {
            continue;
        }
        let new = to.get(&index, 0).map_err(err)?;
        let sum: Vec<u64> = new.iter().zip(old.iter()).map(|(a, b)| a + b).collect();
        let values = PerCpuValues::try_from(sum).map_err(|e| {
            err(MapError::SyscallError(aya::sys::SyscallError {
                call: "per-CPU values",
                io_error: e,
            }))
        })?;
        to.set(index, values, 0).map_err(err)?;
        tally.carried += 1;
    }
    Ok(tally)
}

/// Whether counter `index` of a map of layout `from_layout` counts what
/// today's counter of that index counts.
fn counter_carries(from_layout: u16, index: u32) -> bool {
    // Layout 1 counted at this index the inbound flows it passed untracked
    // (`ingress_inbound_untracked`); they are dropped now.
    !(from_layout < 2 && index == Counter::DropInboundUntracked as u32)
}

#[cfg(test)]
mod tests {
    use vpcnet_common::nat::{SEEN_ACK, SEEN_ANY, SEEN_FIN};

    use super::*;

    fn flow(created_ns: u64, seen: u8, port: u16) -> NatEntry {
        NatEntry {
            created_ns,
            last_seen_ns: created_ns,
            seen,
            port,
            ..NatEntry::default()
        }
    }

    #[test]
    fn a_flow_the_old_programs_made_after_the_copy_replaces_the_copy() {
        let copied = flow(100, SEEN_ANY | SEEN_ACK | SEEN_FIN, 1000);
        // A port taken over: the claim points at another flow now.
        let taken_over = flow(200, SEEN_ANY, 2000);
        assert_eq!(
            second_pass(Some(copied), &copied, &taken_over),
            Some(taken_over)
        );
        // A tuple reopened by a release that kept the reverse half's time:
        // its flags start again.
        let reopened = NatEntry {
            last_seen_ns: 300,
            ..flow(100, SEEN_ANY, 1000)
        };
        assert_eq!(
            second_pass(Some(copied), &copied, &reopened),
            Some(reopened)
        );
        // Removed by the new programs meanwhile: the old programs' flow is
        // put back.
        assert_eq!(second_pass(None, &copied, &taken_over), Some(taken_over));
        // The new programs made a newer flow still: theirs stays.
        let newer = flow(400, SEEN_ANY, 3000);
        assert_eq!(second_pass(Some(newer), &copied, &taken_over), None);
    }

    #[test]
    fn what_the_old_programs_saw_of_the_same_flow_is_added_to_the_copy() {
        let copied = flow(100, SEEN_ANY, 1000);
        let answered = NatEntry {
            last_seen_ns: 150,
            ..flow(100, SEEN_ANY | SEEN_ACK, 1000)
        };
        let merged = second_pass(Some(copied), &copied, &answered).unwrap();
        assert_eq!(
            (merged.seen, merged.last_seen_ns),
            (SEEN_ANY | SEEN_ACK, 150)
        );
        // Another flow of the tuple the new programs made meanwhile stays.
        let theirs = flow(120, SEEN_ANY, 4000);
        assert_eq!(second_pass(Some(theirs), &copied, &answered), None);
        // Gone from the new map (closed and collected): it stays gone.
        assert_eq!(second_pass(None, &copied, &answered), None);
    }

    #[test]
    fn numbers_the_old_programs_moved_on_are_carried_and_newer_ones_kept() {
        let tracked = |seq_end, ack| NatEntry {
            seen: SEEN_ANY | SEEN_ACK,
            seq_end,
            ack,
            tcp: TCP_END_KNOWN | TCP_ACK_KNOWN,
            ..NatEntry::default()
        };
        // The old programs saw data and its acknowledgement after the copy.
        let mut copy = tracked(100, 50);
        merge_into(&mut copy, &tracked(600, 70));
        assert_eq!((copy.seq_end, copy.ack), (600, 70));
        // The new programs are further along already: theirs stay.
        let mut copy = tracked(900, 80);
        merge_into(&mut copy, &tracked(600, 70));
        assert_eq!((copy.seq_end, copy.ack), (900, 80));
        // A copy from before sequence tracking takes the old numbers.
        let mut untracked = NatEntry::default();
        merge_into(&mut untracked, &tracked(u32::MAX, 3));
        assert_eq!((untracked.seq_end, untracked.ack), (u32::MAX, 3));
        assert_eq!(untracked.tcp, TCP_END_KNOWN | TCP_ACK_KNOWN);
    }
}
