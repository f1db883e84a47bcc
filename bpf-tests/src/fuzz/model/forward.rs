//! Forwarding: into a local pod, or out of an ENI.

use vpcnet_common::{
    config::MARK_DECIDED,
    counters::Counter,
    endpoint::Endpoint,
    nat::{FRAG_VIA_ENI_FORWARDED, FRAG_VIA_ENI_ROUTED, FRAG_VIA_POD},
};

use super::{Decided, IP, Model, Out, Run};
use crate::TC_ACT_REDIRECT;

impl Model {
    /// Straight into a local pod: one hop, addressed from its gateway.
    pub(super) fn into_pod(run: &mut Run, ep: &Endpoint, counter: Counter) -> Out {
        let ttl = run.ttl();
        if ttl <= 1 {
            return Out::pass(Counter::TtlToStack);
        }
        let word = [ttl - 1, run.p[IP + 9]];
        run.write(IP + 8, &word, Some(IP), None);
        run.p[..6].copy_from_slice(&ep.mac);
        run.p[6..12].copy_from_slice(&ep.host_mac);
        Out {
            counter,
            action: TC_ACT_REDIRECT,
            via: FRAG_VIA_POD,
            ifindex: 0,
        }
    }

    /// Out of the ENI on `ifindex` to its gateway; `forwarded`: routed here,
    /// one hop.
    pub(super) fn out_of_eni(
        &self,
        run: &mut Run,
        ifindex: u32,
        forwarded: bool,
        counter: Counter,
    ) -> Decided {
        if !self.world.enis.contains_key(&ifindex) {
            return Err(Counter::DropNoEni);
        }
        if forwarded {
            let ttl = run.ttl();
            if ttl <= 1 {
                return Ok(Out::pass(Counter::TtlToStack));
            }
            let word = [ttl - 1, run.p[IP + 9]];
            run.write(IP + 8, &word, Some(IP), None);
        }
        run.mark |= MARK_DECIDED;
        Ok(Out {
            counter,
            action: TC_ACT_REDIRECT,
            via: if forwarded {
                FRAG_VIA_ENI_FORWARDED
            } else {
                FRAG_VIA_ENI_ROUTED
            },
            ifindex,
        })
    }
}
