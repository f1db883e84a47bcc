//! The datapath's metrics: its packet counters by verdict and drop reason,
//! the SNAT port allocator's, the NAT pressure (each flow map's fill, the
//! busiest remote endpoints, the collector's work) and what it serves.

use std::net::Ipv4Addr;

use prometheus::Registry;
use vpcnet_common::{counters::Counter, maps as names, raw_to_addr, raw_to_port};

use super::{CollectorReport, DatapathError, DatapathMaps, NatPressure};
use crate::telemetry::Families;

/// The datapath as one scrape reports it.
#[derive(Clone, Debug)]
pub struct DatapathSnapshot {
    /// Every datapath counter summed over the CPUs.
    pub counters: Vec<(Counter, u64)>,
    pub endpoints: usize,
    pub attached_interfaces: usize,
    pub external_snat: bool,
    pub pressure: NatPressure,
    pub collector: CollectorReport,
}

impl DatapathSnapshot {
    /// Reads the maps (walks the flow maps: call it off the runtime).
    ///
    /// # Errors
    /// A map that cannot be read.
    pub fn read(
        maps: &DatapathMaps,
        attached_interfaces: usize,
        collector: CollectorReport,
    ) -> Result<Self, DatapathError> {
        Ok(Self {
            counters: maps.counters()?,
            endpoints: maps.endpoints.keys().flatten().count(),
            attached_interfaces,
            external_snat: maps.config()?.external_snat(),
            pressure: maps.nat_pressure()?,
            collector,
        })
    }

    fn counter(&self, which: Counter) -> u64 {
        self.counters
            .iter()
            .find(|(c, _)| *c == which)
            .map_or(0, |(_, v)| *v)
    }
}

/// A protocol number as the metrics and the views name it.
#[must_use]
pub fn proto_name(proto: u8) -> String {
    match proto {
        1 => "icmp".into(),
        6 => "tcp".into(),
        17 => "udp".into(),
        other => other.to_string(),
    }
}

/// `address:port` of a map's address and port (network order).
#[must_use]
pub fn endpoint(addr: u32, port: u16) -> String {
    format!(
        "{}:{}",
        Ipv4Addr::from(raw_to_addr(addr)),
        raw_to_port(port)
    )
}

fn n(value: usize) -> u64 {
    u64::try_from(value).unwrap_or(u64::MAX)
}

/// The datapath's families.
///
/// # Errors
/// A name the registry refuses (a bug) or has already.
pub fn register(registry: &Registry, snapshot: &DatapathSnapshot) -> prometheus::Result<()> {
    let alloc = [Counter::AllocRetry, Counter::AllocOldestClosed];
    let mut f = Families::new();
    f.counters(
        "vpcnet_datapath_verdicts_total",
        "Packets by the datapath's verdict (vpcnet-agent counters --all says what each means).",
        &["verdict"],
        snapshot
            .counters
            .iter()
            .filter(|(c, _)| !c.is_drop() && !alloc.contains(c))
            .map(|(c, v)| (vec![c.name().to_owned()], *v)),
    )
    .counters(
        "vpcnet_datapath_drops_total",
        "Packets the datapath dropped, by reason.",
        &["reason"],
        snapshot
            .counters
            .iter()
            .filter(|(c, _)| c.is_drop())
            .map(|(c, v)| {
                let reason = c.name().strip_prefix("drop_").unwrap_or(c.name());
                (vec![reason.to_owned()], *v)
            }),
    )
    .counter(
        "vpcnet_nat_port_alloc_retries_total",
        "SNAT source port candidates tried beyond the first.",
        snapshot.counter(Counter::AllocRetry),
    )
    .counter(
        "vpcnet_nat_port_alloc_oldest_closed_total",
        "New flows that found every candidate port held and took the port of the flow closed \
         longest ago (within its TIME_WAIT hold).",
        snapshot.counter(Counter::AllocOldestClosed),
    );
    nat_pressure(&mut f, &snapshot.pressure, &snapshot.collector);
    f.gauge(
        "vpcnet_datapath_endpoints",
        "Pods in the datapath's endpoint map.",
        n(snapshot.endpoints),
    )
    .gauge(
        "vpcnet_datapath_attached_interfaces",
        "Interfaces the programs are attached to (ENIs and pods' host veths).",
        n(snapshot.attached_interfaces),
    )
    .gauge(
        "vpcnet_datapath_external_snat",
        "1 when AWS_VPC_K8S_CNI_EXTERNALSNAT is in force (no SNAT on the node).",
        u64::from(snapshot.external_snat),
    );
    f.register(registry)
}

/// The flow maps' fill, the busiest remote endpoints, the collector's work.
fn nat_pressure(f: &mut Families, pressure: &NatPressure, collector: &CollectorReport) {
    let maps = [
        (names::NAT_FWD, pressure.nat_fwd),
        (names::NAT_REV, pressure.nat_rev),
        (names::STACK_FLOWS, pressure.stack_flows),
    ];
    f.gauge(
        "vpcnet_nat_flows",
        "Flows in the NAT table.",
        n(pressure.nat_fwd.entries),
    )
    .gauge(
        "vpcnet_nat_table_size",
        "Flows the NAT table holds at most (when it is full, an unanswered flow makes room \
         or the new flow is dropped).",
        u64::from(pressure.nat_fwd.capacity),
    )
    .gauges(
        "vpcnet_map_entries",
        "Entries in each flow map.",
        &["map"],
        maps.iter()
            .map(|(map, fill)| (vec![(*map).to_owned()], n(fill.entries))),
    )
    .gauges(
        "vpcnet_map_capacity",
        "Entries each flow map holds at most.",
        &["map"],
        maps.iter()
            .map(|(map, fill)| (vec![(*map).to_owned()], u64::from(fill.capacity))),
    )
    .gauges(
        "vpcnet_nat_remote_endpoint_ports",
        "Ports of the node address held toward each of the busiest remote endpoints (address, \
         port, protocol): SNAT ports are unique per remote endpoint, so the port range runs \
         out one remote endpoint at a time.",
        &["proto", "remote"],
        pressure.busiest.iter().map(|e| {
            (
                vec![proto_name(e.proto), endpoint(e.addr, e.port)],
                n(e.ports),
            )
        }),
    )
    .counter(
        "vpcnet_gc_passes_total",
        "Passes of the flow garbage collector.",
        collector.passes,
    )
    .gauge(
        "vpcnet_gc_last_pass_microseconds",
        "How long the collector's last pass over the NAT and stack flow maps took.",
        u64::try_from(collector.last_pass.as_micros()).unwrap_or(u64::MAX),
    )
    .counters(
        "vpcnet_gc_removed_total",
        "Flows the collector removed: over by their timeouts (expired), or halves left alone \
         (orphan).",
        &["reason"],
        [
            (vec!["expired".to_owned()], collector.expired),
            (vec!["orphan".to_owned()], collector.orphans),
        ],
    );
}
