//! The commands that read or change the pinned datapath's maps on the
//! node (`counters`, `nat`, `config`, `set`), and their printers.

use std::{net::Ipv4Addr, path::Path, time::Duration};

use anyhow::{Context, Result, bail};
use clap::{Subcommand, ValueEnum};
use vpcnet_agent::{
    datapath::{CollectorReport, DatapathMaps, monotonic_now_ns},
    env::Env,
    introspect,
};
use vpcnet_common::{
    config::{FLAG_EXTERNAL_SNAT, RandomizeMode},
    raw_to_addr, raw_to_port,
};

/// `set`'s flags.
#[derive(Subcommand)]
pub enum SetFlag {
    /// `AWS_VPC_K8S_CNI_EXTERNALSNAT`: new flows to non-VPC destinations leave un-NATed.
    ExternalSnat { value: OnOff },
    /// `AWS_VPC_K8S_CNI_RANDOMIZESNAT`: none, hashrandom or prng.
    RandomizeSnat { mode: String },
}

#[derive(Clone, Copy, ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

pub fn open(pin_dir: &Path) -> Result<DatapathMaps> {
    DatapathMaps::open_pinned(pin_dir).with_context(|| {
        format!(
            "is the agent running? no datapath pinned in {}",
            pin_dir.display()
        )
    })
}

pub fn print_counters(maps: &DatapathMaps, all: bool) -> Result<()> {
    for (counter, value) in maps.counters()? {
        if all || value != 0 {
            println!("{:<32} {value:>12}  {}", counter.name(), counter.help());
        }
    }
    Ok(())
}

pub fn print_nat(maps: &DatapathMaps) -> Result<()> {
    let now = monotonic_now_ns();
    println!(
        "{:<5} {:<7} {:<12} {:<22} {:<22} {:<22} {:>6}",
        "proto", "kind", "state", "original", "remote", "translated", "idle_s"
    );
    for flow in maps.flows()? {
        let proto = match flow.key.proto {
            1 => "icmp",
            6 => "tcp",
            17 => "udp",
            _ => "?",
        };
        let kind = flow.kind().map_or("?", vpcnet_common::nat::FlowKind::name);
        let last = flow.last_seen_ns();
        println!(
            "{proto:<5} {kind:<7} {:<12} {:<22} {:<22} {:<22} {:>6}",
            flow.state().name(),
            endpoint(flow.key.saddr, flow.key.sport),
            endpoint(flow.key.daddr, flow.key.dport),
            endpoint(flow.fwd.addr, flow.fwd.port),
            now.saturating_sub(last) / 1_000_000_000,
        );
    }
    Ok(())
}

/// `nat --summary`: the maps' figures read here, the collector's from the
/// running agent.
pub fn print_nat_summary(maps: &DatapathMaps) -> Result<()> {
    let config = maps.config()?;
    let port_range = u32::from(config.port_max) - u32::from(config.port_min) + 1;
    let summary = introspect::nat_summary_view(
        &maps.nat_pressure()?,
        &CollectorReport::default(),
        port_range,
    );
    println!(
        "{:<20} {:>9} {:>9} {:>6}",
        "map", "entries", "capacity", "fill"
    );
    for map in &summary.maps {
        println!(
            "{:<20} {:>9} {:>9} {:>5.1}%",
            map.map,
            map.entries,
            map.capacity,
            percent(map.entries, map.capacity)
        );
    }
    println!(
        "\nbusiest remote endpoints: ports of the node address their flows hold, of {port_range}"
    );
    println!(
        "{:<5} {:<22} {:>6} {:>6}",
        "proto", "remote", "ports", "range"
    );
    for remote in &summary.busiest_remote_endpoints {
        println!(
            "{:<5} {:<22} {:>6} {:>5.1}%",
            remote.proto,
            remote.remote,
            remote.ports,
            percent(remote.ports, port_range)
        );
    }
    println!(
        "port allocation retries {}, oldest closed port reused {}",
        maps.counter(vpcnet_common::counters::Counter::AllocRetry)?,
        maps.counter(vpcnet_common::counters::Counter::AllocOldestClosed)?
    );
    match agent_collector() {
        Ok(c) => println!(
            "\ngarbage collector: {} passes, the last took {:.1} ms; {} flows expired, {} halves left alone removed",
            c.passes,
            Duration::from_micros(c.last_pass_microseconds).as_secs_f64() * 1e3,
            c.expired,
            c.orphans
        ),
        Err(e) => println!("\ngarbage collector: {e:#}"),
    }
    Ok(())
}

fn percent(part: usize, whole: u32) -> f64 {
    // Display only: map sizes are far below 2^52.
    #[allow(clippy::cast_precision_loss)]
    let (part, whole) = (part as f64, f64::from(whole.max(1)));
    100.0 * part / whole
}

/// The running agent's collector figures, from its introspection endpoint.
fn agent_collector() -> Result<introspect::views::CollectorView> {
    let endpoints = introspect::Endpoints::from_env(&Env::from_process(), None, None)?;
    let addr = endpoints
        .introspection
        .context("introspection is disabled: no figures from the running agent")?;
    let runtime = super::runtime()?;
    let (status, body) = runtime
        .block_on(introspect::get(&addr, "/v1/nat/summary"))
        .with_context(|| format!("no figures from the running agent at {addr}"))?;
    anyhow::ensure!(
        status.is_success(),
        "the agent at {addr} answered {status}: {}",
        String::from_utf8_lossy(&body)
    );
    let summary: introspect::views::NatSummaryView =
        serde_json::from_slice(&body).context("the agent's /v1/nat/summary")?;
    Ok(summary.collector)
}

fn endpoint(addr: u32, port: u16) -> String {
    format!(
        "{}:{}",
        Ipv4Addr::from(raw_to_addr(addr)),
        raw_to_port(port)
    )
}

pub fn print_config(maps: &DatapathMaps) -> Result<()> {
    let cfg = maps.config()?;
    println!(
        "node_addr      {}",
        Ipv4Addr::from(raw_to_addr(cfg.node_addr))
    );
    println!("external_snat  {}", cfg.external_snat());
    println!("randomize_snat {}", cfg.randomize_mode().env_value());
    println!("port_range     {}-{}", cfg.port_min, cfg.port_max);
    println!("primary_link   {}", cfg.primary_ifindex);
    for (net, kind) in maps.cidrs()? {
        println!("cidr           {net:<20} {kind:?}");
    }
    for net in maps.external_service_cidrs()? {
        println!("cidr           {net:<20} ExternalService");
    }
    Ok(())
}

pub fn set_flag(maps: &mut DatapathMaps, flag: &SetFlag) -> Result<()> {
    let mut cfg = maps.config()?;
    match flag {
        SetFlag::ExternalSnat { value } => match value {
            OnOff::On => cfg.flags |= FLAG_EXTERNAL_SNAT,
            OnOff::Off => cfg.flags &= !FLAG_EXTERNAL_SNAT,
        },
        SetFlag::RandomizeSnat { mode } => {
            let Some(mode) = RandomizeMode::from_env_value(mode) else {
                bail!("randomize-snat must be one of none, hashrandom, prng, not {mode:?}");
            };
            cfg.randomize = mode as u32;
        }
    }
    maps.set_config(&cfg)?;
    println!(
        "external_snat={} randomize_snat={}",
        cfg.external_snat(),
        cfg.randomize_mode().env_value()
    );
    Ok(())
}
