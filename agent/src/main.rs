//! `vpcnet-agent`: the node daemon (`run`) and the operator's commands on
//! the node (`counters`, `nat`, `config`, `set`, `ipam`, `pods`, `enis`,
//! `verifier`). The command line is here; `run` hands over to [`app`], the
//! other commands to [`commands`].

mod app;
mod commands;

use std::path::PathBuf;

use anyhow::Result;
use app::RunArgs;
use clap::{Parser, Subcommand};
use commands::{
    introspect,
    maps::{self, SetFlag},
};
use vpcnet_agent::{env::Env, install, logging};
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
    Verifier {
        /// Load nothing: check the embedded object holds every program and
        /// map, without a kernel (an image's check on another
        /// architecture, under qemu).
        #[arg(long)]
        dry_run: bool,
    },
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
    /// Print the network policy in force for each pod (or one pod), rule by
    /// rule, with the NetworkPolicy each rule came from (asks the running
    /// agent's introspection endpoint).
    Policy {
        #[command(flatten)]
        endpoint: introspect::IntrospectionEndpoint,
        /// `NAMESPACE/NAME` of one pod.
        pod: Option<String>,
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
        /// Where aws-node's network policy agent pins: its programs go back
        /// on the pods it knows.
        #[arg(long, default_value = vpcnet_agent::takeover::network_policy::PINS_ROOT)]
        network_policy_pins: PathBuf,
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
    /// Mount bpffs at /sys/fs/bpf if the node has none: the DaemonSet's
    /// privileged init step (its mount propagates to the node), so the
    /// agent's own container needs no `CAP_SYS_ADMIN` for it.
    MountBpffs,
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
        Command::Verifier { dry_run: false } => commands::verifier::print_budgets(),
        Command::Verifier { dry_run: true } => {
            println!("{}", vpcnet_agent::datapath::embedded_object()?);
            Ok(())
        }
        Command::Counters { all } => maps::print_counters(&maps::open(&cli.pin_dir)?, all),
        Command::Nat { summary: false } => maps::print_nat(&maps::open(&cli.pin_dir)?),
        Command::Nat { summary: true } => maps::print_nat_summary(&maps::open(&cli.pin_dir)?),
        Command::Config => maps::print_config(&maps::open(&cli.pin_dir)?),
        Command::Set { flag } => maps::set_flag(&mut maps::open(&cli.pin_dir)?, &flag),
        Command::Ipam { cni_socket } => commands::ipam::print_ipam(&cni_socket),
        Command::Pods { endpoint } => introspect::print_pods(&endpoint),
        Command::Enis { endpoint, all } => introspect::print_enis(&endpoint, all),
        Command::Policy { endpoint, pod } => introspect::print_policy(&endpoint, pod.as_deref()),
        Command::Probe {
            ready,
            cni_socket,
            timeout,
        } => introspect::probe(&cni_socket, ready, commands::seconds("--timeout", timeout)?),
        Command::Uninstall {
            cni_conf_dir,
            cni_socket,
            network_policy_pins,
        } => commands::uninstall::uninstall(
            &cli.pin_dir,
            cni_conf_dir,
            &cni_socket,
            &network_policy_pins,
            &env,
        ),
        Command::MountBpffs => {
            if vpcnet_agent::datapath::mount_bpffs()? {
                println!("mounted bpffs at /sys/fs/bpf");
            } else {
                println!("bpffs is mounted at /sys/fs/bpf already");
            }
            Ok(())
        }
        Command::InstallPlugins { from, to } => {
            for path in install::install_plugins(&from, &to)? {
                println!("installed {}", path.display());
            }
            Ok(())
        }
    }
}
