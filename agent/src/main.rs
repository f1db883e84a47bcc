//! `vpcnet-agent`: the node daemon (`run`) and the operator's commands on
//! the node (`counters`, `nat`, `config`, `set`).

use std::{io::Write, net::Ipv4Addr, os::fd::AsRawFd, path::PathBuf, time::Duration};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use ipnet::Ipv4Net;
use tracing::{info, warn};
use vpcnet_agent::{
    config::{SnatSettings, parse_cidrs, service_cidrs_from_env},
    datapath::{Datapath, DatapathMaps, LoadOptions, monotonic_now_ns},
    layout,
};
use vpcnet_api::layout::NodeLayout;
use vpcnet_common::{
    cidr::CidrKind,
    config::{FLAG_EXTERNAL_SNAT, RandomizeMode},
    maps::PIN_DIR,
    raw_to_addr, raw_to_port,
};

#[derive(Parser)]
#[command(name = "vpcnet-agent", version, about = "vpcnet node agent")]
struct Cli {
    /// Where the datapath's maps are pinned.
    #[arg(long, global = true, default_value = PIN_DIR)]
    pin_dir: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent: load the datapath, attach it, keep its maps filled and
    /// its NAT table clean until SIGTERM.
    Run(RunArgs),
    /// Print the datapath's counters (per verdict and drop reason).
    Counters {
        /// Also print counters that are zero.
        #[arg(long)]
        all: bool,
    },
    /// Print the NAT table.
    Nat,
    /// Print the datapath's configuration and CIDRs.
    Config,
    /// Change a datapath flag live: takes effect on the next new flow.
    Set {
        #[command(subcommand)]
        flag: SetFlag,
    },
}

#[derive(Subcommand)]
enum SetFlag {
    /// `AWS_VPC_K8S_CNI_EXTERNALSNAT`: new flows to non-VPC destinations leave un-NATed.
    ExternalSnat { value: OnOff },
    /// `AWS_VPC_K8S_CNI_RANDOMIZESNAT`: none, hashrandom or prng.
    RandomizeSnat { mode: String },
}

#[derive(Clone, Copy, ValueEnum)]
enum OnOff {
    On,
    Off,
}

#[derive(clap::Args)]
struct RunArgs {
    /// The primary ENI's interface: SNAT leaves by it.
    #[arg(long)]
    primary_interface: String,
    /// The primary ENI's address, SNAT's source.
    #[arg(long)]
    node_addr: Ipv4Addr,
    /// The VPC's CIDR blocks, comma-separated.
    #[arg(long)]
    vpc_cidrs: String,
    /// The node's ENIs and pods (JSON, see `vpcnet_api::layout`): every ENI
    /// and pod veth gets its programs, and the maps their entries.
    #[arg(long)]
    layout: Option<PathBuf>,
    /// Print READY on stdout once attached, then close stdout.
    #[arg(long)]
    notify_ready: bool,
    /// Seconds between NAT garbage collections.
    #[arg(long, default_value_t = 5)]
    gc_interval: u64,
    /// Flows each NAT map holds.
    #[arg(long, default_value_t = vpcnet_common::maps::NAT_DEFAULT_ENTRIES)]
    nat_entries: u32,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colours only for a person at a terminal, not in log files.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => run(&cli.pin_dir, &args),
        Command::Counters { all } => print_counters(&open(&cli.pin_dir)?, all),
        Command::Nat => print_nat(&open(&cli.pin_dir)?),
        Command::Config => print_config(&open(&cli.pin_dir)?),
        Command::Set { flag } => set_flag(&mut open(&cli.pin_dir)?, &flag),
    }
}

fn open(pin_dir: &std::path::Path) -> Result<DatapathMaps> {
    DatapathMaps::open_pinned(pin_dir).with_context(|| {
        format!(
            "is the agent running? no datapath pinned in {}",
            pin_dir.display()
        )
    })
}

fn run(pin_dir: &std::path::Path, args: &RunArgs) -> Result<()> {
    let settings = SnatSettings::from_env()?;
    let vpc_cidrs = parse_cidrs("--vpc-cidrs", &args.vpc_cidrs)?;
    let mut datapath = Datapath::load(&LoadOptions {
        pin_dir: pin_dir.to_owned(),
        nat_entries: args.nat_entries,
    })
    .context("loading the datapath")?;
    // Keep the hash key of a previous run so hashrandom ports stay stable.
    let seed = match datapath.maps.config() {
        Ok(old) if old.hash_seed != 0 => old.hash_seed,
        _ => random_seed()?,
    };
    datapath
        .maps
        .set_config(&settings.datapath_config(args.node_addr, seed))?;
    let service_cidrs = service_cidrs_from_env()?;
    datapath.maps.set_cidrs(&cidr_entries(
        &vpc_cidrs,
        &settings.exclude_snat_cidrs,
        &service_cidrs,
    )?)?;
    if let Some(path) = &args.layout {
        let layout = NodeLayout::read(path)?;
        layout::apply(&mut datapath, &layout)
            .with_context(|| format!("applying the node layout {}", path.display()))?;
        info!(
            enis = layout.enis.len(),
            pods = layout.endpoints.len(),
            "node layout applied"
        );
    }
    datapath
        .attach_eni(&args.primary_interface)
        .with_context(|| format!("attaching to {}", args.primary_interface))?;
    info!(
        interface = %args.primary_interface,
        node_addr = %args.node_addr,
        external_snat = settings.external_snat,
        randomize = settings.randomize.env_value(),
        "datapath attached"
    );
    if args.notify_ready {
        notify_ready()?;
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(serve(
        &mut datapath,
        Duration::from_secs(args.gc_interval.max(1)),
    ))
}

/// Collects NAT garbage until SIGTERM or SIGINT.
async fn serve(datapath: &mut Datapath, gc_interval: Duration) -> Result<()> {
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut gc = tokio::time::interval(gc_interval);
    loop {
        tokio::select! {
            _ = sigterm.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
            _ = gc.tick() => match datapath.maps.collect_garbage(monotonic_now_ns()) {
                Ok(stats) if stats.expired + stats.orphans > 0 => {
                    info!(flows = stats.flows, expired = stats.expired, orphans = stats.orphans, "NAT garbage collected");
                }
                Ok(_) => {}
                Err(e) => warn!(error = %e, "NAT garbage collection failed"),
            },
        }
    }
    info!("stopping: programs detach, pinned maps stay for the next start");
    Ok(())
}

/// The trie's content: service CIDRs, VPC CIDRs, exclusions and every node
/// address, in that order, so that for the same prefix the later wins (a
/// VPC CIDR over a service CIDR, a node address over anything).
fn cidr_entries(
    vpc: &[Ipv4Net],
    excluded: &[Ipv4Net],
    services: &[Ipv4Net],
) -> Result<Vec<(Ipv4Net, CidrKind)>> {
    let mut entries: Vec<(Ipv4Net, CidrKind)> =
        services.iter().map(|n| (*n, CidrKind::Service)).collect();
    entries.extend(vpc.iter().map(|n| (*n, CidrKind::Vpc)));
    entries.extend(excluded.iter().map(|n| (*n, CidrKind::Excluded)));
    for ifaddr in nix::ifaddrs::getifaddrs().context("listing node addresses")? {
        if let Some(addr) = ifaddr.address.as_ref().and_then(|a| a.as_sockaddr_in()) {
            let host = Ipv4Net::new(addr.ip(), 32).expect("/32 is valid");
            entries.push((host, CidrKind::Local));
        }
    }
    Ok(entries)
}

fn random_seed() -> Result<u32> {
    let mut bytes = [0u8; 4];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .context("reading /dev/urandom")?;
    Ok(u32::from_ne_bytes(bytes).max(1))
}

/// Tells whoever started us that the datapath is attached, then lets go of
/// stdout so a reader that goes away never blocks or kills us.
fn notify_ready() -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "READY")?;
    stdout.flush()?;
    let devnull = std::fs::OpenOptions::new().write(true).open("/dev/null")?;
    nix::unistd::dup2(devnull.as_raw_fd(), std::io::stdout().as_raw_fd())?;
    Ok(())
}

fn print_counters(maps: &DatapathMaps, all: bool) -> Result<()> {
    for (counter, value) in maps.counters()? {
        if all || value != 0 {
            println!("{:<32} {value:>12}  {}", counter.name(), counter.help());
        }
    }
    Ok(())
}

fn print_nat(maps: &DatapathMaps) -> Result<()> {
    let now = monotonic_now_ns();
    println!(
        "{:<5} {:<6} {:<12} {:<22} {:<22} {:<22} {:>6}",
        "proto", "kind", "state", "original", "remote", "translated", "idle_s"
    );
    for flow in maps.flows()? {
        let proto = match flow.key.proto {
            1 => "icmp",
            6 => "tcp",
            17 => "udp",
            _ => "?",
        };
        let kind = flow.kind().map_or("?", |k| match k {
            vpcnet_common::nat::FlowKind::Snat => "snat",
            vpcnet_common::nat::FlowKind::Host => "host",
            vpcnet_common::nat::FlowKind::NoSnat => "nosnat",
        });
        let last = flow.rev.map_or(flow.fwd.last_seen_ns, |(_, rev)| {
            flow.fwd.last_seen_ns.max(rev.last_seen_ns)
        });
        println!(
            "{proto:<5} {kind:<6} {:<12} {:<22} {:<22} {:<22} {:>6}",
            flow.state().name(),
            endpoint(flow.key.saddr, flow.key.sport),
            endpoint(flow.key.daddr, flow.key.dport),
            endpoint(flow.fwd.addr, flow.fwd.port),
            now.saturating_sub(last) / 1_000_000_000,
        );
    }
    Ok(())
}

fn endpoint(addr: u32, port: u16) -> String {
    format!(
        "{}:{}",
        Ipv4Addr::from(raw_to_addr(addr)),
        raw_to_port(port)
    )
}

fn print_config(maps: &DatapathMaps) -> Result<()> {
    let cfg = maps.config()?;
    println!(
        "node_addr      {}",
        Ipv4Addr::from(raw_to_addr(cfg.node_addr))
    );
    println!("external_snat  {}", cfg.external_snat());
    println!("randomize_snat {}", cfg.randomize_mode().env_value());
    println!("port_range     {}-{}", cfg.port_min, cfg.port_max);
    for (net, kind) in maps.cidrs()? {
        println!("cidr           {net:<20} {kind:?}");
    }
    Ok(())
}

fn set_flag(maps: &mut DatapathMaps, flag: &SetFlag) -> Result<()> {
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
