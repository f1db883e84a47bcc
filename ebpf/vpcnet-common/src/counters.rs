//! Per-CPU counters: one slot per verdict and per drop reason.

macro_rules! counters {
    ($($variant:ident => $name:literal, $help:literal;)*) => {
        /// Index into the `COUNTERS` per-CPU array.
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Counter {
            $($variant,)*
        }

        impl Counter {
            /// Every counter, in index order.
            pub const ALL: &'static [Counter] = &[$(Counter::$variant,)*];

            /// Stable name, used in metrics and by the CLI.
            #[must_use]
            pub const fn name(self) -> &'static str {
                match self {
                    $(Counter::$variant => $name,)*
                }
            }

            /// One line saying what the counter counts.
            #[must_use]
            pub const fn help(self) -> &'static str {
                match self {
                    $(Counter::$variant => $help,)*
                }
            }

            /// Whether the counter is a drop reason.
            #[must_use]
            pub const fn is_drop(self) -> bool {
                let name = self.name().as_bytes();
                name.len() > 5
                    && name[0] == b'd'
                    && name[1] == b'r'
                    && name[2] == b'o'
                    && name[3] == b'p'
                    && name[4] == b'_'
            }
        }
    };
}

counters! {
    // Verdicts of eni_egress (tc egress of an ENI).
    EgressNotIpv4 => "egress_pass_not_ipv4", "egress: not IPv4, passed untouched";
    EgressUnconfigured => "egress_pass_unconfigured", "egress: no node address configured yet, passed";
    EgressNoSnatCidr => "egress_pass_no_snat_cidr", "egress: destination in a VPC or excluded CIDR, not SNATed";
    EgressLocal => "egress_pass_local", "egress: destination is a node address, not SNATed";
    EgressOtherProto => "egress_pass_other_proto", "egress: protocol other than TCP, UDP and ICMP, passed (no longer counted: those are translated by address)";
    EgressIcmpOther => "egress_pass_icmp_other", "egress: ICMP neither echo nor a handled error, passed";
    EgressSnatNew => "egress_snat_new", "egress: new flow SNATed to the node address";
    EgressSnat => "egress_snat", "egress: packet of a SNATed flow translated";
    EgressExternalSnatNew => "egress_external_snat_new", "egress: new flow left un-NATed (EXTERNALSNAT)";
    EgressUntranslated => "egress_pass_untranslated_flow", "egress: packet of a flow tracked as un-NATed (started under EXTERNALSNAT, or opened from outside the VPC), passed";
    EgressNotOpening => "egress_pass_not_opening", "egress: no flow and not a packet that opens one (SYN-ACK, RST, FIN, echo reply), passed un-NATed";
    EgressHostUntracked => "egress_host_untracked", "egress: node flow not reserved because the NAT table is full, passed";
    EgressHostNew => "egress_host_new", "egress: new node-originated flow, its port reserved";
    EgressHost => "egress_host", "egress: packet of a node-originated flow";
    EgressHostRemapped => "egress_host_remapped", "egress: node flow whose port a NAT flow held, moved to another port";
    EgressIcmpErrorNat => "egress_icmp_error_nat", "egress: ICMP error about a NATed flow translated inside and out";
    EgressIcmpErrorPass => "egress_pass_icmp_error", "egress: ICMP error about no NATed flow, passed";
    EgressFragment => "egress_fragment", "egress: non-first fragment, rewritten and sent the way its first fragment was";
    EgressReopen => "egress_reopen", "egress: closed flow reopened by a new SYN on the same tuple";
    EgressTakeover => "egress_port_takeover", "egress: port of an expired or closed flow reused";
    AllocRetry => "nat_alloc_retry", "NAT: port candidates tried beyond the first";
    AllocOldestClosed => "nat_alloc_oldest_closed", "NAT: every candidate held, the port of the flow closed longest ago reused within its TIME_WAIT hold";

    // Verdicts of eni_ingress (tc ingress of an ENI).
    IngressNotIpv4 => "ingress_pass_not_ipv4", "ingress: not IPv4, passed untouched";
    IngressNotNode => "ingress_pass_not_node", "ingress: destination not the node address, passed";
    IngressNoEntry => "ingress_pass_no_entry", "ingress: to the node address but no NAT entry (or a non-first fragment whose first was not seen), passed to the stack";
    IngressRevSnat => "ingress_rev_snat", "ingress: reply of a SNATed flow translated back to the pod";
    IngressHost => "ingress_host", "ingress: reply of a node-originated flow";
    IngressIcmpErrorRevNat => "ingress_icmp_error_rev_nat", "ingress: ICMP error about a NATed flow translated inside and out";
    IngressInboundTracked => "ingress_inbound_tracked", "ingress: flow opened from outside the VPC to a pod, tracked so its replies are not SNATed";
    // Was ingress_inbound_untracked, a pass: the pod's packets after the
    // handshake then opened SNAT flows of their own.
    DropInboundUntracked => "drop_inbound_untracked", "dropped: flow opened from outside the VPC to a pod that the full NAT table cannot track (untracked, the pod's replies would be SNATed)";
    IngressFragment => "ingress_fragment", "ingress: non-first fragment, rewritten and sent the way its first fragment was";

    EgressBranchNoSnat => "egress_pass_branch_eni", "egress: leaving by a branch ENI, never SNATed (the chain's ! -o vlan+)";
    EgressSteered => "egress_steered", "egress: pod packet routed out the wrong ENI, redirected to its own ENI's gateway";
    IngressToPod => "ingress_to_pod", "ingress: packet for a local pod delivered straight into it";
    IngressStackFlow => "ingress_pass_stack_flow", "ingress: reply of a pod's flow to a service, passed to the stack to be un-DNATed";
    EgressServiceFlow => "egress_service_flow", "egress: pod packet DNATed by the stack from a service address, its replies routed back through the stack";
    TtlToStack => "forward_pass_ttl", "forwarding: TTL would expire, passed to the stack, which answers time exceeded";

    // Verdicts of pod_egress (tc ingress of a pod's host veth).
    PodNotIpv4 => "pod_pass_not_ipv4", "pod: not IPv4 (ARP), passed";
    PodToPod => "pod_to_pod", "pod: to a pod on this node, delivered straight into it";
    PodSteered => "pod_steered", "pod: to the VPC or an excluded CIDR, sent out its own ENI to the ENI's gateway";
    PodStrict => "pod_strict_branch", "pod: strict security-group pod, sent out its branch ENI";
    PodToService => "pod_pass_service", "pod: to a service CIDR, passed to the stack (kube-proxy)";
    PodToLocal => "pod_pass_local", "pod: to a node address, passed to the stack";
    PodToSnat => "pod_pass_outside_vpc", "pod: to outside the VPC, passed to the stack (no primary ENI known yet, or its TTL expiring)";
    PodStackFlow => "pod_pass_stack_flow", "pod: reply of a flow that came through the stack (DNAT), passed back to it";
    PodFragment => "pod_pass_fragment", "pod: non-first fragment, sent the way its first fragment was (to the stack when that one went there or was not seen)";

    // Verdicts of pod_ingress (tc egress of a pod's host veth).
    PodIngressStack => "pod_ingress_stack", "pod ingress: packet that came through the stack, its flow remembered";

    // Drop reasons.
    DropTruncated => "drop_truncated", "dropped: header shorter than its protocol requires";
    DropMalformed => "drop_malformed", "dropped: header with impossible values (IHL below 5, bad lengths)";
    DropNatTableFull => "drop_nat_table_full", "dropped: new flow, the NAT table is full";
    DropNatNoPort => "drop_nat_no_port", "dropped: new flow, no free source port after every retry";
    DropFragmentNoFlow => "drop_fragment_no_flow", "dropped: non-first fragment whose first fragment was not seen";
    DropRewrite => "drop_rewrite_failed", "dropped: the kernel refused a packet rewrite";
    DropSpoofedAddr => "drop_spoofed_source_addr", "dropped: a pod's packet with a source address that is not its own";
    DropSpoofedMac => "drop_spoofed_source_mac", "dropped: a pod's packet with a source MAC that is not its own";
    DropNoEni => "drop_no_eni", "dropped: a pod's ENI is not in the ENI map";

    // Appended, so the indexes above keep their meaning in a pinned map.
    PodOutsideVpc => "pod_outside_vpc", "pod: to outside the VPC, SNATed (or left un-NATed) here and sent out the ENI it must leave by";
    EgressDecided => "egress_pass_decided", "egress: packet a vpcnet program already translated or steered, passed";
    StackFlowUntracked => "stack_flow_untracked", "stack flows: a packet of a flow through the node's stack that could not be remembered because the table is full (the flow's packets take the stack's path only where their destination sends them there)";
    NatEarlyDrop => "nat_early_drop", "NAT: the table was full, an unanswered flow created shortly before was dropped to make room for a new one (conntrack's early drop)";
    PodExternalService => "pod_pass_external_service", "pod: a pod on a secondary ENI to an AWS_EXTERNAL_SERVICE_CIDRS destination, passed to the stack to take the node's route (aws-node's rule 1535: the main table), its replies back through it";
    EgressExternalService => "egress_external_service", "egress: a pod's packet to an AWS_EXTERNAL_SERVICE_CIDRS destination, left on the route the stack gave it instead of steered to the pod's own ENI";
    PolicyFlowNew => "policy_flow_new", "policy: a new connection the rules of both ends allow, tracked";
    PolicyFlowPickedUp => "policy_flow_picked_up", "policy: a TCP connection opened before it was tracked (a take-over, a flow evicted or revalidated) whose other end the rules allow to open it, tracked";
    DropPolicyEgress => "drop_policy_egress", "dropped: network policy: the sending pod's egress rules do not allow it";
    DropPolicyIngress => "drop_policy_ingress", "dropped: network policy: the receiving pod's ingress rules do not allow it";
    DropPolicyRevoked => "drop_policy_revoked", "dropped: network policy: a packet of a connection that a policy change denies";
    PolicyEventLost => "policy_event_lost", "policy: a verdict not logged, the event ring buffer full (ENABLE_POLICY_EVENT_LOGS)";
    StackFlowEarlyDrop => "stack_flow_early_drop", "stack flows: the table was full, an unanswered flow through the node's stack created shortly before was dropped to make room for a new one (conntrack's early drop)";
    EgressDecidedRechecked => "egress_decided_rechecked", "egress: a pod's packet marked decided leaving un-NATed for outside the VPC, decided again (a flow tracked untranslated passes as it was; another component's mark bit no longer skips the NAT)";
    ForwardTooBig => "forward_pass_too_big", "forwarding: bigger than the link it would leave by (a GSO packet: its segments), passed to the stack, which fragments it or answers fragmentation needed";
    IngressFragmentReordered => "ingress_fragment_reordered", "ingress: a later fragment before its first: its datagram goes through the stack's reassembly, and comes back in order";
    EgressReassembled => "egress_reassembled", "egress: a fragment of a datagram the stack reassembled and cut again in order, given its address back and returned to the ingress it arrived at";
    DropFragmentNotReassembled => "drop_fragment_not_reassembled", "dropped: a later fragment sent to the stack's reassembly came back before its first (the node's stack did not reassemble: conntrack not loaded)";

}

/// Number of counter slots.
#[allow(clippy::cast_possible_truncation)] // a few dozen counters
pub const COUNTER_SLOTS: u32 = Counter::ALL.len() as u32;
