//! Fragments: where a datagram's first fragment went, its later ones follow.

use vpcnet_common::{
    counters::Counter,
    nat::{
        FRAG_VIA_ENI_FORWARDED, FRAG_VIA_ENI_ROUTED, FRAG_VIA_POD, FRAG_VIA_REASSEMBLY, FragHook,
        REASSEMBLY_ADDR,
    },
};

use super::{Datagram, Decided, FirstWent, Frag, IP, Ip, Model, Out, Run, headers::raw32};
use crate::{TC_ACT_REDIRECT, TEST_RUN_IFINDEX};

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
            let with_l4 = ip.frag == Frag::First;
            if with_l4 && run.l4_csum_cut(ip) {
                return Err(Counter::DropRewrite);
            }
            run.set_addr(ip, !ingress, first.addr, with_l4);
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

    /// A later fragment before its first, at an ENI's ingress: its
    /// datagram goes through the stack's reassembly.
    pub(super) fn reorder(&mut self, run: &mut Run, ip: &Ip) -> Out {
        if ip.daddr == REASSEMBLY_ADDR {
            return Out::pass(Counter::IngressNotNode);
        }
        let way = |addr| FirstWent {
            addr,
            ifindex: TEST_RUN_IFINDEX,
            via: FRAG_VIA_REASSEMBLY,
        };
        let back = Datagram {
            daddr: REASSEMBLY_ADDR,
            ..Self::datagram(ip, FragHook::Reassembly)
        };
        self.tables.frags.insert(back, way(ip.daddr));
        self.tables.frags.insert(
            Self::datagram(ip, FragHook::EniIngress),
            way(REASSEMBLY_ADDR),
        );
        run.set_addr(ip, false, REASSEMBLY_ADDR, false);
        Out::pass(Counter::IngressFragmentReordered)
    }

    /// At an ENI's egress, a fragment back from the stack's reassembly:
    /// its address back, one hop given back, to the ingress it arrived at.
    /// `None`: no datagram of ours.
    pub(super) fn reassembled(&mut self, run: &mut Run, ip: &Ip) -> Option<Decided> {
        let back = *self
            .tables
            .frags
            .get(&Self::datagram(ip, FragHook::Reassembly))?;
        let arrived = Datagram {
            daddr: back.addr,
            ..Self::datagram(ip, FragHook::EniIngress)
        };
        if ip.frag == Frag::Later {
            if self
                .tables
                .frags
                .get(&arrived)
                .is_some_and(|way| way.via == FRAG_VIA_REASSEMBLY)
            {
                return Some(Err(Counter::DropFragmentNotReassembled));
            }
        } else {
            self.tables.frags.remove(&arrived);
        }
        let with_l4 = ip.frag != Frag::Later;
        if with_l4 && run.l4_csum_cut(ip) {
            return Some(Err(Counter::DropRewrite));
        }
        run.set_addr(ip, false, back.addr, with_l4);
        let word = [run.ttl().saturating_add(1), run.p[IP + 9]];
        run.write(IP + 8, &word, Some(IP), None);
        let own_mac: [u8; 6] = run.p[6..12].try_into().expect("six bytes");
        run.p[..6].copy_from_slice(&own_mac);
        Some(Ok(Out {
            counter: Counter::EgressReassembled,
            action: TC_ACT_REDIRECT,
            via: FRAG_VIA_REASSEMBLY,
            ifindex: back.ifindex,
        }))
    }
}
