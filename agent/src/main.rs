//! `vpcnet-agent`: the node daemon (`run`) and the operator's commands on
//! the node (`counters`, `nat`, `config`, `set`, `ipam`, `pods`, `enis`,
//! `verifier`). The command line is here; `run` hands over to [`app`], the
//! other commands to [`commands`].

mod app;
mod commands;

use std::{net::Ipv4Addr, path::PathBuf};

use anyhow::Result;
use clap::{Parser, Subcommand, ValueEnum};
use commands::{introspect, maps};
use vpcnet_agent::{env::Env, install, logging, pods::BranchLinks, takeover::network_policy};
use vpcnet_common::maps::PIN_DIR;

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
    Run(Box<RunArgs>),
    /// Read the environment as `run` does and print the settings in force,
    /// by variable, as JSON (what was tolerated or has no effect goes to
    /// standard error); exits non-zero where `run` would not start.
    Settings {
        /// As `run --ipam`: the address manager's variables too.
        #[arg(long)]
        ipam: bool,
    },
    /// Load the programs into a scratch pin directory and print what each
    /// cost this kernel's verifier (processed instructions, stack, load
    /// time) against vpcnet's budgets; exits non-zero when one is over.
    Verifier,
    /// Print the datapath's counters (per verdict and drop reason).
    Counters {
        /// Also print counters that are zero.
        #[arg(long)]
        all: bool,
    },
    /// Print the NAT table.
    Nat {
        /// Print how full the flow maps are, the remote endpoints whose
        /// flows hold the most ports, and the running agent's garbage
        /// collection (asked on its introspection endpoint) instead.
        #[arg(long)]
        summary: bool,
    },
    /// Print the datapath's configuration and CIDRs.
    Config,
    /// Print the address manager's pool, counters and recent events (asks
    /// the running agent on its CNI socket).
    Ipam {
        #[arg(long, default_value = vpcnet_api::DEFAULT_CNI_SOCKET)]
        cni_socket: PathBuf,
    },
    /// Change a datapath flag live: takes effect on the next new flow.
    Set {
        #[command(subcommand)]
        flag: SetFlag,
    },
    /// Print the pods the running agent holds addresses for, with their
    /// datapath entries (asks its introspection endpoint).
    Pods {
        #[command(flatten)]
        endpoint: introspect::IntrospectionEndpoint,
    },
    /// Print the node's ENIs, their addresses and which pod holds each
    /// (asks the running agent's introspection endpoint).
    Enis {
        #[command(flatten)]
        endpoint: introspect::IntrospectionEndpoint,
        /// Also list the free addresses.
        #[arg(long)]
        all: bool,
    },
    /// Exit 0 when the running agent answers on its CNI socket (the
    /// daemon set's liveness probe); with `--ready`, only when it can serve
    /// an ADD (the readiness probe).
    Probe {
        #[arg(long)]
        ready: bool,
        #[arg(long, default_value = vpcnet_api::DEFAULT_CNI_SOCKET)]
        cni_socket: PathBuf,
        /// Seconds to wait for the answer.
        #[arg(long, default_value_t = 5.0)]
        timeout: f64,
    },
    /// Hand the node back to aws-node, with the agent stopped: write back
    /// aws-node's iptables rules, rule 1024 and every checkpointed pod's
    /// rules 512/1536, detach the datapath (its pins go), remove vpcnet's
    /// conflist and put aws-node's back. Pods keep their addresses.
    Uninstall {
        /// The runtime's CNI configuration directory, as mounted.
        #[arg(long)]
        cni_conf_dir: Option<PathBuf>,
        /// The agent's socket: while it answers, the agent runs and nothing
        /// is done.
        #[arg(long, default_value = vpcnet_api::DEFAULT_CNI_SOCKET)]
        cni_socket: PathBuf,
    },
    /// Copy the CNI plugin binaries onto the node, each replaced whole (the
    /// daemon set's init container).
    InstallPlugins {
        /// The image's plugins.
        #[arg(long, default_value = "/opt/vpcnet/cni")]
        from: PathBuf,
        /// The runtime's CNI binary directory, as mounted.
        #[arg(long)]
        to: PathBuf,
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
    /// The primary ENI's interface: SNAT leaves by it (with `--ipam`: the
    /// link with the primary ENI's MAC).
    #[arg(long)]
    primary_interface: Option<String>,
    /// The primary ENI's address, SNAT's source (with `--ipam`: IMDS's
    /// `local-ipv4`).
    #[arg(long)]
    node_addr: Option<Ipv4Addr>,
    /// The VPC's CIDR blocks, comma-separated (with `--ipam`: IMDS's, and
    /// kept up to date).
    #[arg(long)]
    vpc_cidrs: Option<String>,
    /// Run the address manager (ENIs, addresses and prefixes through EC2
    /// and IMDS, settings from the VPC CNI's variables) and serve the CNI
    /// plugin on `--cni-socket`.
    #[arg(long)]
    ipam: bool,
    /// The CNI backend's Unix socket.
    #[arg(long, default_value = vpcnet_api::DEFAULT_CNI_SOCKET)]
    cni_socket: PathBuf,
    /// Seconds between two passes over the warm pool.
    #[arg(long, default_value_t = 5.0)]
    reconcile_interval: f64,
    /// Seconds an ENI lives at least before it may be freed.
    #[arg(long, default_value_t = 60.0)]
    min_eni_lifetime: f64,
    /// Seconds between two leaked-ENI sweeps (jittered).
    #[arg(long, default_value_t = 600.0)]
    leaked_eni_interval: f64,
    /// Seconds between two reads of the VPC's CIDRs from IMDS.
    #[arg(long, default_value_t = 30.0)]
    vpc_cidr_interval: f64,
    /// Seconds between two looks for ENIs and addresses someone else
    /// attached or took away (aws-node's node IP pool reconcile).
    #[arg(long, env = "VPCNET_NODE_RECONCILE_INTERVAL", default_value_t = 60.0)]
    node_reconcile_interval: f64,
    /// Seconds between two sweeps for pods gone without a DEL (their host
    /// veth vanished): their entries go and their addresses are released.
    #[arg(long, default_value_t = 5.0)]
    pod_sweep_interval: f64,
    /// Seconds an address may stay with a pod the datapath never got before
    /// a sweep takes it back.
    #[arg(long, default_value_t = 60.0)]
    orphan_grace: f64,
    /// Who makes a branch ENI's `vlan.eth.<vlan id>` link: `vlan`, the
    /// agent, as an 802.1Q link on the trunk ENI's (as the VPC CNI's plugin
    /// does); `existing`, someone else (the lab, on a kernel without
    /// 802.1Q): the agent finds it by the branch ENI's MAC and leaves it.
    #[arg(long, value_enum, default_value_t = BranchLinks::Vlan)]
    branch_links: BranchLinks,
    /// The node's ENIs and pods (JSON, see `vpcnet_api::layout`): every ENI
    /// and pod veth gets its programs, and the maps their entries.
    #[arg(long)]
    layout: Option<PathBuf>,
    /// Print READY on stdout once attached, then close stdout.
    #[arg(long)]
    notify_ready: bool,
    /// Seconds between NAT garbage collections.
    #[arg(long, env = "VPCNET_GC_INTERVAL", default_value_t = 5)]
    gc_interval: u64,
    /// Flows each NAT map holds.
    #[arg(long, env = "VPCNET_NAT_ENTRIES", default_value_t = vpcnet_common::maps::NAT_DEFAULT_ENTRIES)]
    nat_entries: u32,
    /// Entries of the map of flows through the node's stack (kube-proxy's
    /// services and node ports, the node's own connections to pods): two
    /// per flow.
    #[arg(long, env = "VPCNET_STACK_FLOW_ENTRIES", default_value_t = vpcnet_common::maps::STACK_FLOWS_DEFAULT_ENTRIES)]
    stack_flow_entries: u32,
    /// Serve introspection here (`address:port` or `unix:/path`), whatever
    /// `INTROSPECTION_BIND_ADDRESS` and `DISABLE_INTROSPECTION` say.
    #[arg(long)]
    introspection_address: Option<String>,
    /// Serve Prometheus metrics here (default 0.0.0.0:61678), whatever
    /// `DISABLE_METRICS` says.
    #[arg(long)]
    metrics_address: Option<String>,
    /// Write the CNI conflist (`10-vpcnet.conflist`) here once the CNI
    /// backend serves: the runtime's configuration directory, as mounted.
    #[arg(long, requires = "ipam")]
    cni_conf_dir: Option<PathBuf>,
    /// Where aws-node's network policy agent pins its programs: a node
    /// with any is taken over only with `VPCNET_TAKE_OVER_NETWORK_POLICY_NODE`.
    #[arg(long, default_value = network_policy::NETWORK_POLICY_PROGRAMS_DIR)]
    network_policy_pins: PathBuf,
}

fn main() {
    if let Err(e) = run_command() {
        // One line, every cause after a colon: what an operator reads in
        // `kubectl logs`.
        eprintln!("Error: {e:#}");
        std::process::exit(1);
    }
}

fn run_command() -> Result<()> {
    let cli = Cli::parse();
    let env = Env::from_process();
    logging::init(&env, matches!(cli.command, Command::Run(_)));
    match cli.command {
        Command::Run(args) => app::run(&cli.pin_dir, &args, &env),
        Command::Settings { ipam } => commands::settings::print_settings(&env, ipam),
        Command::Verifier => commands::verifier::print_budgets(),
        Command::Counters { all } => maps::print_counters(&maps::open(&cli.pin_dir)?, all),
        Command::Nat { summary: false } => maps::print_nat(&maps::open(&cli.pin_dir)?),
        Command::Nat { summary: true } => maps::print_nat_summary(&maps::open(&cli.pin_dir)?),
        Command::Config => maps::print_config(&maps::open(&cli.pin_dir)?),
        Command::Set { flag } => maps::set_flag(&mut maps::open(&cli.pin_dir)?, &flag),
        Command::Ipam { cni_socket } => commands::ipam::print_ipam(&cni_socket),
        Command::Pods { endpoint } => introspect::print_pods(&endpoint),
        Command::Enis { endpoint, all } => introspect::print_enis(&endpoint, all),
        Command::Probe {
            ready,
            cni_socket,
            timeout,
        } => introspect::probe(&cni_socket, ready, commands::seconds("--timeout", timeout)?),
        Command::Uninstall {
            cni_conf_dir,
            cni_socket,
        } => commands::uninstall::uninstall(&cli.pin_dir, cni_conf_dir, &cni_socket, &env),
        Command::InstallPlugins { from, to } => {
            for path in install::install_plugins(&from, &to)? {
                println!("installed {}", path.display());
            }
            Ok(())
        }
    }
}
