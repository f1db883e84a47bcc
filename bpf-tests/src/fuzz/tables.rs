//! The real flow tables read as the model keeps them, and the two
//! compared.

use std::{collections::HashMap, net::Ipv4Addr};

use aya::maps::{Array, MapData};
use vpcnet_common::{
    nat::{FlowKey, NatEntry, RecentFlows, TCP_ACK_KNOWN, TCP_END_KNOWN},
    raw_to_addr, raw_to_port,
};

use super::{
    Bench, Report,
    model::{Datagram, FirstWent, Half, PolicyTrack, Stamp, Tables, show_end},
    policy,
};

/// The real tables, as the model keeps them (times left out: the clock
/// checks them).
pub(super) fn real_tables(bench: &Bench) -> Tables {
    let halves = |map: &aya::maps::HashMap<MapData, FlowKey, NatEntry>| -> HashMap<FlowKey, Half> {
        map.iter()
            .filter_map(Result::ok)
            .map(|(k, e)| {
                (
                    k,
                    Half {
                        addr: e.addr,
                        port: e.port,
                        kind: e.kind,
                        seen: e.seen,
                        // Numbers without their bit mean nothing.
                        seq_end: if e.tcp & TCP_END_KNOWN == 0 {
                            0
                        } else {
                            e.seq_end
                        },
                        ack: if e.tcp & TCP_ACK_KNOWN == 0 { 0 } else { e.ack },
                        tcp: e.tcp,
                        retrans: e.retrans,
                        last: Stamp::default(),
                        created: Stamp::default(),
                    },
                )
            })
            .collect()
    };
    let maps = &bench.h.datapath.maps;
    let ring = |map: &Array<MapData, RecentFlows>| map.get(&0, 0).expect("a ring of recent flows");
    Tables {
        nat_fwd: halves(&maps.nat_fwd),
        nat_rev: halves(&maps.nat_rev),
        stack: halves(&maps.stack_flows),
        policy_flows: policy::real_flows(maps)
            .into_iter()
            .map(|(c, opener)| {
                let last = Stamp::default();
                (c, PolicyTrack { opener, last })
            })
            .collect(),
        recent: ring(&bench.recent.0),
        recent_stack: ring(&bench.recent.1),
        frags: bench
            .frags
            .iter()
            .filter_map(Result::ok)
            .map(|(k, p)| {
                let d = Datagram {
                    saddr: k.saddr,
                    daddr: k.daddr,
                    id: k.id,
                    proto: k.proto,
                    hook: k.hook,
                };
                (
                    d,
                    FirstWent {
                        addr: p.addr,
                        ifindex: p.ifindex,
                        via: p.via,
                    },
                )
            })
            .collect(),
    }
}

/// A flow key as `source:port > destination:port/protocol`, ports in host
/// order.
fn show(k: &FlowKey) -> String {
    format!(
        "{}:{} > {}:{}/{}",
        Ipv4Addr::from(raw_to_addr(k.saddr)),
        raw_to_port(k.sport),
        Ipv4Addr::from(raw_to_addr(k.daddr)),
        raw_to_port(k.dport),
        k.proto
    )
}

pub(super) fn compare_tables(real: &Tables, model: &Tables, place: &str, report: &mut Report) {
    for (name, ours, theirs) in [
        ("NAT forward", &real.nat_fwd, &model.nat_fwd),
        ("NAT reverse", &real.nat_rev, &model.nat_rev),
        ("stack flows", &real.stack, &model.stack),
    ] {
        let theirs: HashMap<FlowKey, Half> =
            theirs.iter().map(|(k, h)| (*k, h.behaviour())).collect();
        let wrong: Vec<String> = ours
            .iter()
            .filter(|(k, v)| theirs.get(k) != Some(v))
            .map(|(k, v)| format!("{} = {v:?}, model {:?}", show(k), theirs.get(k)))
            .chain(
                theirs
                    .iter()
                    .filter(|(k, _)| !ours.contains_key(k))
                    .map(|(k, v)| format!("{} missing, model {v:?}", show(k))),
            )
            .take(3)
            .collect();
        if !wrong.is_empty() {
            report.disagree(format!("{place}: {name} table: {}", wrong.join("; ")));
        }
    }
    let opener =
        |tracks: &HashMap<_, PolicyTrack>, c| tracks.get(c).map(|t: &PolicyTrack| t.opener);
    let wrong: Vec<String> = real
        .policy_flows
        .iter()
        .filter(|(c, t)| opener(&model.policy_flows, c) != Some(t.opener))
        .map(|(c, t)| {
            format!(
                "{c} opened by {}, model {}",
                show_end(t.opener),
                opener(&model.policy_flows, c).map_or_else(|| "none".to_owned(), show_end)
            )
        })
        .chain(
            model
                .policy_flows
                .iter()
                .filter(|(c, _)| !real.policy_flows.contains_key(c))
                .map(|(c, t)| format!("{c} missing, model opened by {}", show_end(t.opener))),
        )
        .take(3)
        .collect();
    if !wrong.is_empty() {
        report.disagree(format!("{place}: policy flows table: {}", wrong.join("; ")));
    }
    if real.frags != model.frags {
        report.disagree(format!(
            "{place}: fragment table has {} entries, model {}",
            real.frags.len(),
            model.frags.len()
        ));
    }
    for (name, ours, theirs) in [
        ("NAT", &real.recent, &model.recent),
        ("stack", &real.recent_stack, &model.recent_stack),
    ] {
        if ours != theirs {
            report.disagree(format!(
                "{place}: the ring of recent {name} flows is at {}, model {}; slots differing: {:?}",
                ours.next,
                theirs.next,
                (0..ours.keys.len())
                    .filter(|&i| ours.keys[i] != theirs.keys[i])
                    .take(3)
                    .collect::<Vec<_>>()
            ));
        }
    }
}
