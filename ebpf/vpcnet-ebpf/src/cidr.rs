//! The prefix lookups: the SNAT decision's, and `AWS_EXTERNAL_SERVICE_CIDRS`.

use aya_ebpf::maps::lpm_trie::Key;
use vpcnet_common::cidr::CidrKind;

use crate::maps::{CIDRS, EXTERNAL_SERVICE_CIDRS};

/// What `addr` (network order) is to the SNAT decision: a VPC, excluded or
/// node-local prefix, or `None` for anything else (SNATed).
#[inline(always)]
pub fn lookup(addr: u32) -> Option<CidrKind> {
    let key = Key::new(32, addr.to_ne_bytes());
    CIDRS.get(&key).and_then(|v| CidrKind::from_raw(v.kind))
}

/// Whether `addr` (network order) is in one of `AWS_EXTERNAL_SERVICE_CIDRS`.
#[inline(always)]
pub fn external_service(addr: u32) -> bool {
    let key = Key::new(32, addr.to_ne_bytes());
    EXTERNAL_SERVICE_CIDRS.get(&key).is_some()
}
