//! vpcnet's tc programs. One unit per job, following the packet: `packet`
//! (headers, rewrites), `cidr` (the SNAT decision's lookup), `nat` (flows,
//! ports), `stack` (flows kube-proxy must see), `icmp` (errors), `frag`
//! (fragments), `policy` (network policy), and the programs that compose them, `egress`, `ingress`
//! and `pod`.

#![no_std]
#![no_main]

mod cidr;
mod egress;
mod forward;
mod frag;
mod icmp;
mod ingress;
mod maps;
mod nat;
mod packet;
mod pod;
mod policy;
mod stack;

use aya_ebpf::{bindings::TC_ACT_SHOT, macros::classifier, programs::TcContext};
use forward::Verdict;
use vpcnet_common::counters::Counter;

/// Counts the verdict and returns its tc action. Passing is
/// `TC_ACT_UNSPEC` (TCX "next"): programs after ours still see the packet.
#[inline(always)]
fn finish(result: Result<Verdict, Counter>) -> i32 {
    match result {
        Ok(verdict) => {
            maps::count(verdict.counter);
            verdict.action
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

/// tc ingress of a pod's host veth: what the pod sends.
#[classifier]
pub fn pod_egress(ctx: TcContext) -> i32 {
    finish(pod::egress(&ctx))
}

/// tc egress of a pod's host veth: what the stack hands the pod.
#[classifier]
pub fn pod_ingress(ctx: TcContext) -> i32 {
    finish(pod::ingress(&ctx))
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
