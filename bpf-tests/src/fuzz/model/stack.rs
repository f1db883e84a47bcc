//! Flows the node's stack must see (kube-proxy's DNAT, the node's sockets).

use vpcnet_common::nat::{FlowKey, FlowKind, PROTO_TCP};

use super::{Half, Model, Ports, headers::progressed};

impl Model {
    /// Whether `flow` (one direction's tuple) is a stack flow; records the
    /// packet in its half if so.
    pub(super) fn stack_packet(&mut self, flow: &FlowKey, l4: Ports) -> bool {
        let Some(half) = self.tables.stack.get(flow).copied() else {
            return false;
        };
        if flow.proto == PROTO_TCP && l4.syn_only() && progressed(half.seen) {
            let from_pod = flow.saddr == half.addr && flow.sport == half.port;
            let kind = if from_pod {
                FlowKind::StackFromPod
            } else {
                FlowKind::StackToPod
            } as u8;
            let this = self.tables.stack.get_mut(flow).expect("looked up");
            this.kind = kind;
            this.restart(Some(l4));
            if let Some(other) = self.tables.stack.get_mut(&flow.reversed()) {
                other.kind = kind;
                other.restart(None);
            }
        } else {
            self.tables
                .stack
                .get_mut(flow)
                .expect("looked up")
                .record(l4);
        }
        true
    }

    /// A new stack flow whose pod side is `pod_side`, opened by `l4`.
    pub(super) fn stack_new(&mut self, pod_side: &FlowKey, kind: FlowKind, l4: Ports) {
        let (mut toward, mut from) = (
            Half::new(pod_side.saddr, pod_side.sport, kind),
            Half::new(pod_side.saddr, pod_side.sport, kind),
        );
        if kind == FlowKind::StackToPod {
            toward.record(l4);
        } else {
            from.record(l4);
        }
        self.tables.stack.insert(pod_side.reversed(), toward);
        self.tables.stack.insert(*pod_side, from);
    }
}
