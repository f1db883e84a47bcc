//! Flows whose packets must go through the node's stack: kube-proxy DNATs
//! them (a pod's connection to a service, a node port's client to a pod)
//! and must see every packet to undo it, or the node's own sockets talk to
//! a pod. Each is a pair in `STACK_FLOWS` like a NAT flow (see
//! `vpcnet_common::maps::STACK_FLOWS`), each direction writing its own
//! half, so the agent's collector removes it when conntrack would, never
//! while it lives, however many newer flows came since.

use core::ffi::c_void;

use vpcnet_common::{
    counters::Counter,
    nat::{FlowKey, FlowKind, NatEntry, PROTO_TCP, RecentFlows, SEEN_ANY, SEEN_SYN, flags_view},
};

use crate::{
    maps::{PORT_SEARCH, RECENT_STACK_FLOWS, STACK_FLOWS, count},
    nat::{E2BIG, first_packet, make_room_with, now_ns, remember_recent, touch},
    packet::L4,
};

/// Whether a stack flow has the half keyed `key` (nothing recorded: an
/// ICMP error about the flow, say).
#[inline(always)]
pub fn known(key: &FlowKey) -> bool {
    // SAFETY: only the presence matters.
    unsafe { STACK_FLOWS.get(key) }.is_some()
}

/// Whether the packet (tuple `key`: the pod's own, or one toward the pod)
/// belongs to a stack flow, and then records it in that half.
#[inline(always)]
pub fn record(key: &FlowKey, l4: &L4) -> bool {
    let Some(half) = STACK_FLOWS.get_ptr_mut(key) else {
        return false;
    };
    let now = now_ns();
    // SAFETY: a live map value.
    let old_seen = unsafe { (*half).seen };
    if key.proto == PROTO_TCP && l4.is_syn() && old_seen & !(SEEN_SYN | SEEN_ANY) != 0 {
        // The same tuple connecting again after its close: a new flow.
        reopen(key, half, l4, now);
    } else {
        touch(half, l4, now);
    }
    true
}

/// Starts the flow of the half `half` (keyed `key`) afresh, the side that
/// sent this SYN its opener.
#[inline(always)]
fn reopen(key: &FlowKey, half: *mut NatEntry, l4: &L4, now: u64) {
    // SAFETY: a live map value.
    let (addr, port) = unsafe { ((*half).addr, (*half).port) };
    let from_pod = key.saddr == addr && key.sport == port;
    let other = key.reversed();
    let kind = if from_pod {
        FlowKind::StackFromPod
    } else {
        FlowKind::StackToPod
    };
    // SAFETY: live map values.
    unsafe {
        (*half).kind = kind as u8;
        (*half).forget_segments();
        first_packet(&mut *half, l4);
        (*half).last_seen_ns = now;
        (*half).created_ns = now;
        if let Some(other) = STACK_FLOWS.get_ptr_mut(other) {
            (*other).kind = kind as u8;
            (*other).seen = 0;
            (*other).forget_segments();
            (*other).last_seen_ns = now;
            (*other).created_ns = now;
        }
    }
}

/// Remembers a new stack flow whose pod-side tuple is `pod_tuple`, opened
/// by `kind`'s side with the packet `l4`, the oldest unanswered recent one
/// dropped when the table is full. A flow it has no room for even then (a
/// table full of answered flows) is counted; its packets still take the
/// stack's path whenever the destination alone sends them there.
#[inline(always)]
pub fn remember(pod_tuple: &FlowKey, kind: FlowKind, l4: &L4) {
    let now = now_ns();
    let toward_pod = FlowKind::opened_from_outside(kind as u8);
    let mut half = NatEntry::new(pod_tuple.saddr, pod_tuple.sport, kind, now);
    if toward_pod {
        first_packet(&mut half, l4);
    }
    let reverse = pod_tuple.reversed();
    if !insert_making_room(&reverse, &half) {
        count(Counter::StackFlowUntracked);
        return;
    }
    half.seen = 0;
    half.forget_segments();
    if !toward_pod {
        first_packet(&mut half, l4);
    }
    if !insert_making_room(pod_tuple, &half) {
        let _ = STACK_FLOWS.remove(reverse);
        count(Counter::StackFlowUntracked);
        return;
    }
    remember_recent(&RECENT_STACK_FLOWS, pod_tuple);
}

/// Inserts a half, making room by early drop when the table is full, as
/// the NAT does (a flood of flows nobody answers, at a node port say, makes
/// way for new flows; answered ones are never touched). Whether it is in.
#[inline(always)]
fn insert_making_room(key: &FlowKey, half: &NatEntry) -> bool {
    match STACK_FLOWS.insert(key, half, 0) {
        Ok(()) => true,
        Err(e) if e == -E2BIG && make_room_with(drop_step, Counter::StackFlowEarlyDrop) => {
            STACK_FLOWS.insert(key, half, 0).is_ok()
        }
        Err(_) => false,
    }
}

/// One recent stack flow for the early drop: both halves dropped if the
/// flow is unanswered (the opener's answer not acknowledged counts, as
/// conntrack's `SYN_RECV` is not assured). Returns 1 to stop.
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "keys are passed as pointers into map values: by value they would be copied to the stack"
)]
#[inline(never)]
extern "C" fn drop_step(index: u32, _ctx: *mut c_void) -> i64 {
    let (Some(recent), Some(search)) = (
        RECENT_STACK_FLOWS.get_ptr_mut(0),
        PORT_SEARCH.get_ptr_mut(0),
    ) else {
        return 1;
    };
    // SAFETY: the ring's one value, and this CPU's search slot, whose
    // holder key is free while no candidate port is judged.
    let (recent, search) = unsafe { (&mut *recent, &mut *search) };
    let slot = RecentFlows::slot(recent.next.wrapping_add(index));
    let Some(pod_tuple) = recent.keys.get_mut(slot) else {
        return 1;
    };
    // SAFETY: a map value, valid for the program's run even if deleted.
    let Some(from_pod) = (unsafe { STACK_FLOWS.get(&*pod_tuple) }) else {
        return 0;
    };
    search.holder_key = pod_tuple.reversed();
    // SAFETY: as above.
    let toward_pod = unsafe { STACK_FLOWS.get(&search.holder_key) }.unwrap_or(from_pod);
    if !flags_view(pod_tuple.proto, from_pod, toward_pod).unanswered() {
        return 0;
    }
    if STACK_FLOWS.remove(&*pod_tuple).is_err() {
        return 0;
    }
    let _ = STACK_FLOWS.remove(&search.holder_key);
    // Taken: the slot no longer names a flow.
    pod_tuple.proto = 0;
    search.room_made = 1;
    1
}
