//! Fragments: where a datagram's first fragment went, its later ones follow.

use vpcnet_common::{
    counters::Counter,
    nat::{FRAG_VIA_ENI_FORWARDED, FRAG_VIA_ENI_ROUTED, FRAG_VIA_POD, FragHook},
};

use super::{Datagram, Decided, FirstWent, IP, Ip, Model, Out, Run, headers::raw32};

impl Model {
    pub(super) fn datagram(ip: &Ip, hook: FragHook) -> Datagram {
        Datagram {
            saddr: ip.saddr,
            daddr: ip.daddr,
            id: ip.id,
            proto: ip.proto,
            hook: hook as u8,
        }
    }

    pub(super) fn first_fragment(&self, ip: &Ip, hook: FragHook) -> Option<FirstWent> {
        self.tables.frags.get(&Self::datagram(ip, hook)).copied()
    }

    pub(super) fn remember_first(&mut self, run: &Run, ip: &Ip, hook: FragHook, out: Out) {
        let (at, arrived) = if hook == FragHook::EniIngress {
            (IP + 16, ip.daddr)
        } else {
            (IP + 12, ip.saddr)
        };
        let now = raw32(&run.p, at).unwrap_or(arrived);
        self.tables.frags.insert(
            Self::datagram(ip, hook),
            FirstWent {
                addr: if now == arrived { 0 } else { now },
                ifindex: out.ifindex,
                via: out.via,
            },
        );
    }

    /// A later fragment goes where its first went, rewritten alike.
    pub(super) fn like_first(
        &mut self,
        run: &mut Run,
        ip: &Ip,
        hook: FragHook,
        first: FirstWent,
        counter: Counter,
    ) -> Decided {
        let ingress = hook == FragHook::EniIngress;
        if first.addr != 0 {
            run.set_addr(ip, !ingress, first.addr, false);
        }
        match first.via {
            FRAG_VIA_POD => {
                let daddr = if ingress && first.addr != 0 {
                    first.addr
                } else {
                    ip.daddr
                };
                Ok(match self.world.endpoints.get(&daddr).copied() {
                    Some(ep) => Self::into_pod(run, &ep, counter),
                    None => Out::pass(counter),
                })
            }
            FRAG_VIA_ENI_FORWARDED => self.out_of_eni(run, first.ifindex, true, counter),
            FRAG_VIA_ENI_ROUTED => self.out_of_eni(run, first.ifindex, false, counter),
            _ => Ok(Out::pass(counter)),
        }
    }
}
