//! Flows the node's stack must see (kube-proxy's DNAT, the node's sockets).

use vpcnet_common::{
    counters::Counter,
    nat::{FlowKey, FlowKind, PROTO_TCP},
};

use super::{Half, Model, Ports, Run, headers::progressed, tables::Map};

impl Model {
    /// Whether `flow` (one direction's tuple) is a stack flow; records the
    /// packet in its half if so.
    pub(super) fn stack_packet(&mut self, flow: &FlowKey, l4: Ports) -> bool {
        let Some(half) = self.tables.stack.get(flow).copied() else {
            return false;
        };
        let now = self.now;
        if flow.proto == PROTO_TCP && l4.syn_only() && progressed(half.seen) {
            let from_pod = flow.saddr == half.addr && flow.sport == half.port;
            let kind = if from_pod {
                FlowKind::StackFromPod
            } else {
                FlowKind::StackToPod
            } as u8;
            let this = self.tables.stack.get_mut(flow).expect("looked up");
            this.kind = kind;
            this.restart(Some(l4), now);
            if let Some(other) = self.tables.stack.get_mut(&flow.reversed()) {
                other.kind = kind;
                other.restart(None, now);
            }
        } else {
            self.tables
                .stack
                .get_mut(flow)
                .expect("looked up")
                .record(l4, now);
        }
        true
    }

    /// A new stack flow whose pod side is `pod_side`, opened by `l4`; a
    /// full map makes room by early drop, or the flow goes untracked.
    pub(super) fn stack_new(
        &mut self,
        run: &mut Run,
        pod_side: &FlowKey,
        kind: FlowKind,
        l4: Ports,
    ) {
        let now = self.now;
        let (mut toward, mut from) = (
            Half::new(pod_side.saddr, pod_side.sport, kind, now),
            Half::new(pod_side.saddr, pod_side.sport, kind, now),
        );
        if kind == FlowKind::StackToPod {
            toward.record(l4, now);
        } else {
            from.record(l4, now);
        }
        let reverse = pod_side.reversed();
        if !self.insert_making_room(run, Map::Stack, reverse, toward) {
            run.count(Counter::StackFlowUntracked);
            return;
        }
        if !self.insert_making_room(run, Map::Stack, *pod_side, from) {
            self.tables.stack.remove(&reverse);
            run.count(Counter::StackFlowUntracked);
            return;
        }
        Self::remember_recent(&mut self.tables.recent_stack, *pod_side);
    }
}
