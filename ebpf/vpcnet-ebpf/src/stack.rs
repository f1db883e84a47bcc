//! Flows whose packets must go through the node's stack: kube-proxy DNATs
//! them (a pod's connection to a service, a node port's client to a pod)
//! and must see every packet to undo it, or the node's own sockets talk to
//! a pod. Each is a pair in `STACK_FLOWS` like a NAT flow (see
//! `vpcnet_common::maps::STACK_FLOWS`), each direction writing its own
//! half, so the agent's collector removes it when conntrack would, never
//! while it lives, however many newer flows came since.

use vpcnet_common::{
    counters::Counter,
    nat::{FlowKey, FlowKind, NatEntry, PROTO_TCP, SEEN_ANY, SEEN_SYN},
};

use crate::{
    maps::{STACK_FLOWS, count},
    nat::{first_packet, now_ns, touch},
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
/// by `kind`'s side with the packet `l4`. A flow the table
/// has no room for is counted; its packets still take the stack's path
/// whenever the destination alone sends them there.
#[inline(always)]
pub fn remember(pod_tuple: &FlowKey, kind: FlowKind, l4: &L4) {
    let now = now_ns();
    let toward_pod = FlowKind::opened_from_outside(kind as u8);
    let mut half = NatEntry::new(pod_tuple.saddr, pod_tuple.sport, kind, now);
    if toward_pod {
        first_packet(&mut half, l4);
    }
    let reverse = pod_tuple.reversed();
    if STACK_FLOWS.insert(reverse, half, 0).is_err() {
        count(Counter::StackFlowUntracked);
        return;
    }
    half.seen = 0;
    half.forget_segments();
    if !toward_pod {
        first_packet(&mut half, l4);
    }
    if STACK_FLOWS.insert(pod_tuple, half, 0).is_err() {
        let _ = STACK_FLOWS.remove(reverse);
        count(Counter::StackFlowUntracked);
    }
}
