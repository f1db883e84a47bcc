//! NAT flows: lookup, port allocation and the pair's life (see
//! `vpcnet_common::nat` for why a flow is two entries in two plain hash maps).

use core::ffi::c_void;

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns, bpf_loop},
    maps::{Array, HashMap},
};
use vpcnet_common::{
    config::{Config, RandomizeMode},
    counters::Counter,
    maps::RECENT_FLOWS_LEN,
    nat::{
        FlowKey, FlowKind, NatEntry, RecentFlows, TOUCH_INTERVAL_NS, flags_view, flow_last_seen_ns,
        forward_key, idle_past, is_portless, reply_key,
    },
};

use crate::{
    maps::{NAT_FWD, NAT_REV, PORT_SEARCH, RECENT_FLOWS, count, count_n, timeouts},
    packet::L4,
};

/// Candidates tried before a new flow is dropped for want of a port. With
/// independent random candidates the failure rate at a fill of `f` is `f^64`:
/// 1e-10 at 70 %, 0.1 % at 90 %.
const ALLOC_TRIES: u32 = 64;

pub(crate) const E2BIG: i32 = 7;
const EEXIST: i32 = 17;

#[inline(always)]
pub fn now_ns() -> u64 {
    // SAFETY: a helper without arguments.
    unsafe { bpf_ktime_get_ns() }
}

/// Records a packet in one direction's entry: new flags always, TCP's
/// sequence numbers as they move, the time only once per
/// [`TOUCH_INTERVAL_NS`] so established flows do not write it on every
/// packet.
#[inline(always)]
pub fn touch(entry: *mut NatEntry, l4: &L4, now: u64) {
    let seen = l4.seen_bits();
    // SAFETY: `entry` points into a map value the caller just looked up;
    // concurrent writers of the same direction can at worst lose one flag
    // bit, timestamp or sequence update, which the next packet repeats.
    unsafe {
        let old = (*entry).seen;
        if old | seen != old {
            (*entry).seen = old | seen;
            (*entry).last_seen_ns = now;
        } else if now.wrapping_sub((*entry).last_seen_ns) > TOUCH_INTERVAL_NS {
            (*entry).last_seen_ns = now;
        }
        if l4.is_tcp {
            (*entry).track_segment(&l4.segment());
        }
    }
}

/// Records the packet that creates an entry, in its direction's entry.
#[inline(always)]
pub fn first_packet(entry: &mut NatEntry, l4: &L4) {
    entry.seen = l4.seen_bits();
    if l4.is_tcp {
        entry.track_segment(&l4.segment());
    }
}

/// 32-bit mix (murmur3's finalizer).
#[inline(always)]
const fn mix(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// Keyed hash of the flow's tuple (`hashrandom`, like netfilter's
/// `--random`): flows start their searches in different places, and the
/// same tuple always starts in the same one.
#[inline(always)]
const fn tuple_hash(seed: u32, fwd: &FlowKey) -> u32 {
    let mut h = mix(seed ^ fwd.saddr);
    h = mix(h ^ fwd.daddr);
    mix(h ^ (((fwd.sport as u32) << 16) | fwd.dport as u32) ^ ((fwd.proto as u32) << 8))
}

/// How new flows of one kind pick their candidates.
pub struct PortPicker {
    min: u32,
    span: u32,
    mode: RandomizeMode,
    start: u32,
    /// A port to try first (the pod's own in `none` mode, the node socket's
    /// own for node flows), host order.
    first: Option<u16>,
}

impl PortPicker {
    #[inline(always)]
    pub fn new(cfg: &Config, fwd: &FlowKey, kind: FlowKind) -> Self {
        let (min, max) = if cfg.port_min <= cfg.port_max && cfg.port_min != 0 {
            (u32::from(cfg.port_min), u32::from(cfg.port_max))
        } else {
            (1024, 65535)
        };
        let own = u16::from_be(fwd.sport);
        let mode = cfg.randomize_mode();
        let first = match kind {
            // Nothing to choose: the address alone is translated.
            _ if is_portless(fwd.proto) => Some(0),
            // A node socket keeps its port unless a NAT flow holds it.
            FlowKind::Host => Some(own),
            _ if mode == RandomizeMode::None && u32::from(own) >= min && u32::from(own) <= max => {
                Some(own)
            }
            _ => None,
        };
        Self {
            min,
            span: max - min + 1,
            mode,
            start: tuple_hash(cfg.hash_seed, fwd),
            first,
        }
    }

    /// The `i`th candidate, host order.
    #[inline(always)]
    fn candidate(&self, i: u32) -> u16 {
        if i == 0
            && let Some(first) = self.first
        {
            return first;
        }
        let offset = match self.mode {
            // SAFETY: a helper without arguments.
            RandomizeMode::Prng => unsafe { bpf_get_prandom_u32() },
            RandomizeMode::HashRandom | RandomizeMode::None => self.start.wrapping_add(i),
        };
        // `span` is at least 1; checked so no panic path reaches the object.
        (self.min + offset.checked_rem(self.span).unwrap_or(0)) as u16
    }
}

/// What a new flow got.
pub struct Claimed {
    pub port: u16,
    pub took_over: bool,
}

/// State of the port search, shared with [`claim_step`].
///
/// It lives in a per-CPU map ([`PORT_SEARCH`]), not on the searching
/// program's stack: `bpf_loop` would otherwise need a pointer into the
/// caller's frame, and that frame, the callback's and the kernel's
/// rounding of each (32 bytes before 6.9) all count against the 512 bytes
/// a call chain may use. The verifier also tracks map contents as unknown
/// values, so iterations of the callback converge at once instead of being
/// explored per value. A program runs to its end on its CPU before the
/// next one there starts (softirq, or transmit with bottom halves off), so
/// one slot per CPU is enough.
pub struct ClaimSearch {
    picker: PortPicker,
    fwd: FlowKey,
    /// The reply tuple of the candidate being tried, and the forward tuple
    /// of the flow holding it.
    rev_key: FlowKey,
    pub(crate) holder_key: FlowKey,
    rev_value: NatEntry,
    nat_addr: u32,
    now: u64,
    tries: u32,
    port: u16,
    outcome: u8,
    /// Set by [`drop_step`] when it dropped a flow to make room.
    pub(crate) room_made: u8,
    /// The candidate held by the closed TCP flow that ended longest ago
    /// (0: none seen), and when that flow saw its last packet.
    oldest_closed_port: u16,
    oldest_closed_ns: u64,
}

const SEARCHING: u8 = 0;
const CLAIMED: u8 = 1;
const TOOK_OVER: u8 = 2;
const TABLE_FULL: u8 = 3;

/// One candidate of the port search. Runs under `bpf_loop`, so the verifier
/// checks this body once instead of once per try. Returns 1 to stop.
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "keys and values are passed as pointers into the search's map slot: by value they would be copied to the stack"
)]
#[inline(never)]
extern "C" fn claim_step(index: u32, _ctx: *mut c_void) -> i64 {
    let Some(search) = PORT_SEARCH.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: this CPU's slot, which only this program uses while it runs.
    let search = unsafe { &mut *search };
    search.tries = index + 1;
    let port = search.picker.candidate(index).to_be();
    search.rev_key = reply_key(&search.fwd, search.nat_addr, port);
    match NAT_REV.insert(&search.rev_key, &search.rev_value, u64::from(BPF_NOEXIST)) {
        Ok(()) => search.outcome = CLAIMED,
        Err(e) if e == -E2BIG => search.outcome = TABLE_FULL,
        Err(_) => match take_over(&search.rev_key, &mut search.holder_key, search.now, false) {
            Holder::Gone
                if NAT_REV
                    .insert(&search.rev_key, &search.rev_value, u64::from(BPF_NOEXIST))
                    .is_ok() =>
            {
                search.outcome = TOOK_OVER;
            }
            Holder::Closed(last_seen)
                if search.oldest_closed_port == 0 || last_seen < search.oldest_closed_ns =>
            {
                search.oldest_closed_port = port;
                search.oldest_closed_ns = last_seen;
                return 0;
            }
            _ => return 0,
        },
    }
    search.port = port;
    1
}

/// Claims a port for the flow `fwd` (kind `kind`) translated to `nat_addr`:
/// inserts the reverse entry, the claim, taking over the port of a flow that
/// is over (see `flags_view`).
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "keys and values are passed as pointers into the search's map slot: by value they would be copied to the stack"
)]
#[inline(always)]
fn claim_port(
    picker: PortPicker,
    fwd: &FlowKey,
    kind: FlowKind,
    nat_addr: u32,
    now: u64,
) -> Result<Claimed, Counter> {
    let search = PORT_SEARCH.get_ptr_mut(0).ok_or(Counter::DropNatNoPort)?;
    // SAFETY: this CPU's slot, which only this program uses while it runs.
    let search = unsafe { &mut *search };
    search.picker = picker;
    search.fwd = *fwd;
    search.rev_value = NatEntry::new(fwd.saddr, fwd.sport, kind, now);
    search.nat_addr = nat_addr;
    search.now = now;
    search.tries = 0;
    search.port = 0;
    search.outcome = SEARCHING;
    search.oldest_closed_port = 0;
    search.oldest_closed_ns = 0;
    // A portless flow has one candidate: port 0.
    let tries = if is_portless(fwd.proto) {
        1
    } else {
        ALLOC_TRIES
    };
    // SAFETY: the callback takes no context; it finds the search in its map.
    unsafe {
        bpf_loop(tries, claim_step as *mut c_void, core::ptr::null_mut(), 0);
    }
    count_n(
        Counter::AllocRetry,
        u64::from(search.tries.saturating_sub(1)),
    );
    if search.outcome == TABLE_FULL
        && make_room()
        && NAT_REV
            .insert(&search.rev_key, &search.rev_value, u64::from(BPF_NOEXIST))
            .is_ok()
    {
        // The candidate that met the full table was free: it is ours now.
        search.outcome = CLAIMED;
        search.port = search.rev_key.dport;
    }
    if search.outcome == SEARCHING && search.oldest_closed_port != 0 {
        // Every candidate is held. Rather than drop the flow, take the port
        // whose flow closed longest ago: the remote has most likely let its
        // TIME_WAIT go, and at worst refuses this SYN, which the client
        // retries as it would after a drop.
        search.rev_key = reply_key(fwd, nat_addr, search.oldest_closed_port);
        if matches!(
            take_over(&search.rev_key, &mut search.holder_key, now, true),
            Holder::Gone
        ) && NAT_REV
            .insert(&search.rev_key, &search.rev_value, u64::from(BPF_NOEXIST))
            .is_ok()
        {
            count(Counter::AllocOldestClosed);
            search.outcome = TOOK_OVER;
            search.port = search.oldest_closed_port;
        }
    }
    match search.outcome {
        CLAIMED => Ok(Claimed {
            port: search.port,
            took_over: false,
        }),
        TOOK_OVER => Ok(Claimed {
            port: search.port,
            took_over: true,
        }),
        TABLE_FULL => Err(Counter::DropNatTableFull),
        _ => Err(Counter::DropNatNoPort),
    }
}

/// Who holds a port, as [`take_over`] found it.
enum Holder {
    /// Nobody (any more): the caller may claim it.
    Gone,
    /// A closed TCP flow whose last packet was at this time, still within
    /// its TIME_WAIT hold.
    Closed(u64),
    /// A flow in progress.
    Active,
}

/// Removes the flow holding `rev_key` when it is over, or, with `force`,
/// when it is a closed TCP flow even within its TIME_WAIT hold. The
/// holder's forward tuple is built in `fwd_key` (the search's slot, off
/// the stack), and both entries are judged where they lie in their maps.
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "keys and values are passed as pointers into the search's map slot: by value they would be copied to the stack"
)]
#[inline(always)]
fn take_over(rev_key: &FlowKey, fwd_key: &mut FlowKey, now: u64, force: bool) -> Holder {
    // SAFETY: a map value, valid for the program's run even if deleted.
    let Some(rev) = (unsafe { NAT_REV.get(rev_key) }) else {
        // Removed since our insert failed: free.
        return Holder::Gone;
    };
    *fwd_key = forward_key(rev_key, rev);
    // SAFETY: as above.
    let fwd = unsafe { NAT_FWD.get(&*fwd_key) };
    // A reverse entry whose forward half is not there yet is a flow being
    // created on another CPU: judge it by its own age only.
    let fwd = fwd.unwrap_or(rev);
    let Some(timeouts) = timeouts() else {
        return Holder::Active;
    };
    let view = flags_view(rev_key.proto, fwd, rev);
    let timeout = view.longest_timeout_ns(rev_key.proto, fwd, rev, timeouts);
    if !idle_past(fwd, rev, now, timeout) {
        let closed = view.closed();
        if !(closed && force) {
            return if closed {
                Holder::Closed(flow_last_seen_ns(fwd, rev))
            } else {
                Holder::Active
            };
        }
    }
    // Whoever removes the claim owns the port.
    if remove_pair(rev_key, fwd_key) {
        Holder::Gone
    } else {
        Holder::Active
    }
}

/// Removes the flow whose claim is `rev_key` and whose forward tuple is
/// `fwd_key`: the claim, then the forward half unless it was reopened
/// meanwhile under another claim (then it no longer points here). `false`
/// when another CPU removed the claim first.
#[inline(always)]
fn remove_pair(rev_key: &FlowKey, fwd_key: &FlowKey) -> bool {
    if NAT_REV.remove(rev_key).is_err() {
        return false;
    }
    // SAFETY: a map value, valid for the program's run even if deleted.
    if let Some(old) = unsafe { NAT_FWD.get(fwd_key) }
        && old.port == rev_key.dport
        && old.addr == rev_key.daddr
    {
        let _ = NAT_FWD.remove(fwd_key);
    }
    true
}

/// Adds a new flow's key (a NAT flow's claim, a stack flow's pod-side
/// tuple) to the ring `ring`.
#[inline(always)]
pub(crate) fn remember_recent(ring: &Array<RecentFlows>, rev_key: &FlowKey) {
    let Some(recent) = ring.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: the map's one value; see `RecentFlows` for concurrent writers.
    let recent = unsafe { &mut *recent };
    let slot = RecentFlows::slot(recent.next);
    recent.next = recent.next.wrapping_add(1);
    if let Some(key) = recent.keys.get_mut(slot) {
        *key = *rev_key;
    }
}

/// Drops one unanswered NAT flow among the recent ones, oldest first, to
/// make room in a full table. Returns whether it did.
#[inline(always)]
fn make_room() -> bool {
    make_room_with(drop_step, Counter::NatEarlyDrop)
}

/// Runs `step` over a ring of recent flows, oldest first, until it drops
/// one (it sets the search slot's `room_made`), counted as `counter`.
/// Returns whether one was dropped.
#[inline(always)]
pub(crate) fn make_room_with(
    step: extern "C" fn(u32, *mut c_void) -> i64,
    counter: Counter,
) -> bool {
    let Some(search) = PORT_SEARCH.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's slot, which only this program uses while it runs.
    unsafe { (*search).room_made = 0 };
    // SAFETY: the callback takes no context; it finds its state in maps.
    unsafe {
        bpf_loop(
            RECENT_FLOWS_LEN,
            step as *mut c_void,
            core::ptr::null_mut(),
            0,
        );
    }
    // SAFETY: as above.
    let dropped = unsafe { (*search).room_made } != 0;
    if dropped {
        count(counter);
    }
    dropped
}

/// One recent flow for [`make_room`]: dropped if nothing answered it (a
/// TCP flow's answer not acknowledged counts as unanswered, as conntrack's
/// SYN_RECV is not assured). Returns 1 to stop.
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "keys are passed as pointers into map values: by value they would be copied to the stack"
)]
#[inline(never)]
extern "C" fn drop_step(index: u32, _ctx: *mut c_void) -> i64 {
    let (Some(recent), Some(search)) = (RECENT_FLOWS.get_ptr_mut(0), PORT_SEARCH.get_ptr_mut(0))
    else {
        return 1;
    };
    // SAFETY: the ring's one value, and this CPU's search slot, whose
    // holder key is free while no candidate port is judged.
    let (recent, search) = unsafe { (&mut *recent, &mut *search) };
    let slot = RecentFlows::slot(recent.next.wrapping_add(index));
    let Some(rev_key) = recent.keys.get_mut(slot) else {
        return 1;
    };
    // SAFETY: a map value, valid for the program's run even if deleted.
    let Some(rev) = (unsafe { NAT_REV.get(&*rev_key) }) else {
        return 0;
    };
    search.holder_key = forward_key(rev_key, rev);
    // SAFETY: as above.
    let fwd = unsafe { NAT_FWD.get(&search.holder_key) }.unwrap_or(rev);
    if !flags_view(rev_key.proto, fwd, rev).unanswered() {
        return 0;
    }
    if !remove_pair(rev_key, &search.holder_key) {
        return 0;
    }
    // Taken: the slot no longer names a flow.
    rev_key.proto = 0;
    search.room_made = 1;
    1
}

/// Inserts a new flow's entry into `map`, making room by early drop when
/// the map is full. An entry already there is the same flow's (created by
/// another CPU meanwhile) and is kept.
#[inline(always)]
fn insert_making_room(
    map: &HashMap<FlowKey, NatEntry>,
    key: &FlowKey,
    entry: &NatEntry,
) -> Result<(), Counter> {
    match map.insert(key, entry, u64::from(BPF_NOEXIST)) {
        Ok(()) => Ok(()),
        Err(e) if e == -EEXIST => Ok(()),
        Err(e) if e == -E2BIG && make_room() => {
            match map.insert(key, entry, u64::from(BPF_NOEXIST)) {
                Ok(()) => Ok(()),
                Err(e) if e == -EEXIST => Ok(()),
                Err(_) => Err(Counter::DropNatTableFull),
            }
        }
        Err(_) => Err(Counter::DropNatTableFull),
    }
}

/// Creates a translated flow (kind `Snat` or `Host`) for `fwd`, whose
/// first packet is `l4`, returning its forward entry.
#[inline(always)]
pub fn create_flow(
    cfg: &Config,
    fwd: &FlowKey,
    kind: FlowKind,
    l4: &L4,
    now: u64,
) -> Result<*mut NatEntry, Counter> {
    let picker = PortPicker::new(cfg, fwd, kind);
    let claimed = claim_port(picker, fwd, kind, cfg.node_addr, now)?;
    if claimed.took_over {
        count(Counter::EgressTakeover);
    }
    let search = PORT_SEARCH.get_ptr_mut(0).ok_or(Counter::DropNatNoPort)?;
    // SAFETY: this CPU's slot, which only this program uses while it runs.
    // The claim is in its map: the slot's value, made for it with this
    // flow's kind and times, becomes the forward entry, off the stack.
    let entry = unsafe { &mut (*search).rev_value };
    entry.addr = cfg.node_addr;
    entry.port = claimed.port;
    first_packet(entry, l4);
    let ours = reply_key(fwd, cfg.node_addr, claimed.port);
    match insert_forward(fwd, entry) {
        // Another CPU created the same flow meanwhile: keep theirs, free ours.
        Ok(existing) if unsafe { (*existing).port } != claimed.port => {
            let _ = NAT_REV.remove(ours);
            Ok(existing)
        }
        Ok(existing) => {
            remember_recent(&RECENT_FLOWS, &ours);
            Ok(existing)
        }
        Err(reason) => {
            // Never leave a claim without its flow.
            let _ = NAT_REV.remove(ours);
            Err(reason)
        }
    }
}

/// Tracks an untranslated flow (kind `NoSnat` or `Inbound`) so it stays
/// untranslated whatever the flags do later: a pair like a translated
/// flow's, keyed by the pod's tuple `fwd` and its reverse, each direction
/// writing its own entry so the flow's state, and with it its timeout, is
/// known. Its first packet `l4` went the pod's way out for `NoSnat`, toward
/// the pod for `Inbound`.
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "keys and values are passed as pointers into the search's map slot: by value they would be copied to the stack"
)]
#[inline(always)]
pub fn track_untranslated(
    fwd: &FlowKey,
    kind: FlowKind,
    l4: &L4,
    now: u64,
) -> Result<*mut NatEntry, Counter> {
    // The entry and the reverse key are built in the port search's slot,
    // free while no port is searched, off the stack: this is on
    // `pod_egress`'s deepest path.
    let search = PORT_SEARCH
        .get_ptr_mut(0)
        .ok_or(Counter::DropNatTableFull)?;
    // SAFETY: this CPU's slot, which only this program uses while it runs.
    let search = unsafe { &mut *search };
    search.rev_key = fwd.reversed();
    search.rev_value = NatEntry::new(fwd.saddr, fwd.sport, kind, now);
    let toward_pod = FlowKind::opened_from_outside(kind as u8);
    if toward_pod {
        first_packet(&mut search.rev_value, l4);
    }
    insert_making_room(&NAT_REV, &search.rev_key, &search.rev_value)?;
    search.rev_value.seen = 0;
    search.rev_value.forget_segments();
    if !toward_pod {
        first_packet(&mut search.rev_value, l4);
    }
    match insert_forward(fwd, &search.rev_value) {
        Ok(forward) => {
            remember_recent(&RECENT_FLOWS, &search.rev_key);
            Ok(forward)
        }
        Err(reason) => {
            let _ = NAT_REV.remove(&search.rev_key);
            Err(reason)
        }
    }
}

#[inline(always)]
fn insert_forward(fwd: &FlowKey, entry: &NatEntry) -> Result<*mut NatEntry, Counter> {
    insert_making_room(&NAT_FWD, fwd, entry)?;
    NAT_FWD.get_ptr_mut(fwd).ok_or(Counter::DropNatTableFull)
}

/// A closed flow whose tuple opens again (the pod reuses its port for the
/// same remote): keeps the mapping if the claim is still this flow's and
/// starts the state afresh. Returns false when the claim went to someone
/// else; the caller then drops the stale forward entry and allocates anew.
#[inline(always)]
pub fn reopen(fwd: &FlowKey, entry: *mut NatEntry, l4: &L4, now: u64) -> bool {
    // SAFETY: `entry` is a live map value of NAT_FWD.
    let (addr, port) = unsafe { ((*entry).addr, (*entry).port) };
    let rev_key = reply_key(fwd, addr, port);
    let Some(rev) = NAT_REV.get_ptr_mut(rev_key) else {
        return false;
    };
    // SAFETY: live map values.
    unsafe {
        if (*rev).addr != fwd.saddr || (*rev).port != fwd.sport {
            return false;
        }
        if FlowKind::untranslated((*entry).kind) {
            // The pod opens it now, whoever opened it before.
            (*rev).kind = FlowKind::NoSnat as u8;
            (*entry).kind = FlowKind::NoSnat as u8;
        }
        // Both halves say when this flow began: an upgrade's second pass
        // tells it from the one before by that.
        (*rev).seen = 0;
        (*rev).forget_segments();
        (*rev).last_seen_ns = now;
        (*rev).created_ns = now;
        (*entry).forget_segments();
        first_packet(&mut *entry, l4);
        (*entry).last_seen_ns = now;
        (*entry).created_ns = now;
    }
    true
}

/// A flow opened from outside the VPC whose tuple opens again from there
/// (the remote reuses its port after a close): the remote is the opener,
/// and the state starts afresh. `rev` is the entry keyed `rev_key`, the
/// tuple as the remote's packets carry it.
#[inline(always)]
pub fn reopen_inbound(rev_key: &FlowKey, rev: *mut NatEntry, l4: &L4, now: u64) {
    // SAFETY: `rev` is a live map value of NAT_REV.
    let fwd_key = forward_key(rev_key, unsafe { &*rev });
    let Some(fwd) = NAT_FWD.get_ptr_mut(fwd_key) else {
        return;
    };
    // SAFETY: live map values.
    unsafe {
        (*rev).kind = FlowKind::Inbound as u8;
        (*rev).forget_segments();
        first_packet(&mut *rev, l4);
        (*rev).last_seen_ns = now;
        (*rev).created_ns = now;
        (*fwd).kind = FlowKind::Inbound as u8;
        (*fwd).seen = 0;
        (*fwd).forget_segments();
        (*fwd).last_seen_ns = now;
        (*fwd).created_ns = now;
    }
}

/// Removes a forward entry that no longer owns its claim.
#[inline(always)]
pub fn forget_forward(fwd: &FlowKey) {
    let _ = NAT_FWD.remove(fwd);
}
