//! One definition of every map key, value, flag and constant that the vpcnet
//! eBPF programs and user space share.
//!
//! Byte order: addresses and ports inside map keys and values are kept as the
//! packet carries them (network order, read as native integers), so the
//! datapath never swaps bytes on the per-packet path. Values that the
//! datapath does arithmetic on (the port range) are in host order and say so.

#![no_std]
// `#[repr(C)]` types spell out their padding as `_pad` fields, public so
// both sides can build them with struct literals.
#![allow(clippy::pub_underscore_fields)]

pub mod aws_network_policy;
pub mod cidr;
pub mod config;
pub mod counters;
pub mod endpoint;
pub mod maps;
pub mod nat;
pub mod policy;

/// Marks a `#[repr(C)]` type as plain data for aya's user-space maps.
macro_rules! impl_pod {
    ($($ty:ty),* $(,)?) => {
        $(
            #[cfg(feature = "user")]
            // SAFETY: the type is `#[repr(C)]`, `Copy`, has explicit padding
            // fields and no pointers, so every bit pattern is valid.
            unsafe impl aya::Pod for $ty {}
        )*
    };
}
pub(crate) use impl_pod;

/// Converts an address to the datapath's representation (network order).
#[must_use]
pub const fn addr_to_raw(octets: [u8; 4]) -> u32 {
    u32::from_ne_bytes(octets)
}

/// Converts a datapath address back to its octets.
#[must_use]
pub const fn raw_to_addr(raw: u32) -> [u8; 4] {
    raw.to_ne_bytes()
}

/// Converts a host-order port to the datapath's representation.
#[must_use]
pub const fn port_to_raw(port: u16) -> u16 {
    port.to_be()
}

/// Converts a datapath port back to host order.
#[must_use]
pub const fn raw_to_port(raw: u16) -> u16 {
    u16::from_be(raw)
}
