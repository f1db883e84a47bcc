//! vpcnet's tc programs. One unit per job, following the packet: `packet`
//! (headers, rewrites), `cidr` (the SNAT decision's lookup), `nat` (flows,
//! ports), `icmp` (errors), `frag` (fragments), and the two programs that
//! compose them, `egress` and `ingress`.

#![no_std]
#![no_main]

mod cidr;
mod egress;
mod frag;
mod icmp;
mod ingress;
mod maps;
mod nat;
mod packet;

use aya_ebpf::{
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC},
    macros::classifier,
    programs::TcContext,
};
use vpcnet_common::counters::Counter;

/// Counts the verdict and turns it into a tc action. Passing is
/// `TC_ACT_UNSPEC` (TCX "next"): programs after ours still see the packet.
#[inline(always)]
fn finish(result: Result<Counter, Counter>) -> i32 {
    match result {
        Ok(verdict) => {
            maps::count(verdict);
            TC_ACT_UNSPEC
        }
        Err(reason) => {
            maps::count(reason);
            TC_ACT_SHOT
        }
    }
}

/// tc egress of an ENI.
#[classifier]
pub fn eni_egress(ctx: TcContext) -> i32 {
    finish(egress::handle(&ctx))
}

/// tc ingress of an ENI.
#[classifier]
pub fn eni_ingress(ctx: TcContext) -> i32 {
    finish(ingress::handle(&ctx))
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
