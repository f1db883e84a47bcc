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
            this.seen = l4.seen();
            if let Some(other) = self.tables.stack.get_mut(&flow.reversed()) {
                other.kind = kind;
                other.seen = 0;
            }
        } else {
            self.tables.stack.get_mut(flow).expect("looked up").seen |= l4.seen();
        }
        true
    }

    pub(super) fn stack_new(&mut self, pod_side: &FlowKey, kind: FlowKind, seen: u8) {
        let toward_pod = matches!(kind, FlowKind::StackToPod);
        let half = Half {
            addr: pod_side.saddr,
            port: pod_side.sport,
            kind: kind as u8,
            seen: 0,
        };
        self.tables.stack.insert(
            pod_side.reversed(),
            Half {
                seen: if toward_pod { seen } else { 0 },
                ..half
            },
        );
        self.tables.stack.insert(
            *pod_side,
            Half {
                seen: if toward_pod { 0 } else { seen },
                ..half
            },
        );
    }
}
