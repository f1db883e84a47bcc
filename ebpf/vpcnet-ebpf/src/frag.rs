//! Ports of fragmented datagrams: the first fragment carries the L4 header,
//! later ones are translated with the ports it had.

use vpcnet_common::nat::{FragKey, FragPorts};

use crate::{
    maps::FRAGS,
    packet::{Ipv4, L4},
};

#[inline(always)]
const fn key(ip: &Ipv4) -> FragKey {
    FragKey {
        saddr: ip.saddr,
        daddr: ip.daddr,
        id: ip.id,
        proto: ip.proto,
        _pad: 0,
    }
}

/// Called for a first fragment, with the header as it arrived (before any
/// rewrite), which is what the later fragments carry.
#[inline(always)]
pub fn remember(ip: &Ipv4, l4: &L4) {
    let ports = FragPorts {
        sport: l4.sport,
        dport: l4.dport,
    };
    // An LRU map: a datagram whose later fragments never come ages out.
    let _ = FRAGS.insert(key(ip), ports, 0);
}

#[inline(always)]
pub fn recall(ip: &Ipv4) -> Option<FragPorts> {
    // SAFETY: read-only copy of a map value.
    unsafe { FRAGS.get(key(ip)) }.copied()
}
