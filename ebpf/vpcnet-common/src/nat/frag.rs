//! Fragmented datagrams: where each one's first fragment went.

/// The program that saw a fragmented datagram: each keeps its own record,
/// as the same datagram may cross two of them (a pod's program, then an
/// ENI's after the stack).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FragHook {
    PodEgress = 1,
    EniEgress = 2,
    EniIngress = 3,
    /// A datagram sent through the stack's reassembly, keyed by its
    /// fragments' address there ([`REASSEMBLY_ADDR`]): the address and
    /// ENI it arrived with, which `eni_egress` gives it back.
    Reassembly = 4,
}

/// Key of the fragment map: a datagram is its addresses, IP id and
/// protocol as it arrived, per program.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragKey {
    pub saddr: u32,
    pub daddr: u32,
    pub id: u16,
    pub proto: u8,
    /// A [`FragHook`] as `u8`.
    pub hook: u8,
}

/// The first fragment was handed on (to the stack, or on out of the ENI
/// it was leaving by).
pub const FRAG_VIA_PASS: u8 = 0;
/// The first fragment went straight into the local pod it is addressed to.
pub const FRAG_VIA_POD: u8 = 1;
/// The first fragment was routed out of an ENI (the TTL went down by one).
pub const FRAG_VIA_ENI_FORWARDED: u8 = 2;
/// The first fragment, already routed by the stack, was steered out of
/// another ENI (the TTL stays).
pub const FRAG_VIA_ENI_ROUTED: u8 = 3;

/// A later fragment came before its first, at an ENI's ingress. The stack
/// holds such a fragment until the first comes (conntrack reassembles), so
/// the whole datagram goes through the stack's reassembly: each fragment is
/// readdressed to [`REASSEMBLY_ADDR`], which the stack routes out of an ENI
/// once the datagram is whole, cut again in order; there `eni_egress` gives
/// each fragment its address back and returns it to the ingress it arrived
/// at, where the first fragment now comes first.
pub const FRAG_VIA_REASSEMBLY: u8 = 4;

/// Where datagrams wait for reassembly: 192.0.0.8, the IPv4 dummy address
/// (RFC 7600), which is nobody's, as it is stored (network order).
pub const REASSEMBLY_ADDR: u32 = u32::from_ne_bytes([192, 0, 0, 8]);

/// Where a datagram's first fragment went and what it became: every later
/// fragment, which carries no L4 header, is rewritten and sent the same
/// way, so none takes another path (the node's stack, with conntrack
/// reassembling, would wait for a first fragment that never comes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragPath {
    /// The address the NAT rewrote (the source leaving, the destination
    /// arriving) to; 0 when it was not rewritten. Under
    /// [`FragHook::Reassembly`], the destination the datagram arrived with.
    pub addr: u32,
    /// The ENI's link for the `FRAG_VIA_ENI_*` ways; under
    /// [`FragHook::Reassembly`], the ENI the datagram arrived by.
    pub ifindex: u32,
    /// A `FRAG_VIA_*`.
    pub via: u8,
    pub _pad1: u8,
    pub _pad2: u16,
}

crate::impl_pod!(FragKey, FragPath);
