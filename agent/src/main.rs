//! `vpcnet-agent`: the node daemon (`run`) and the operator's commands on
//! the node (`counters`, `nat`, `config`, `set`, `ipam`, `pods`, `enis`,
//! `verifier`).

mod cli;

use std::{
    io::Write,
    net::Ipv4Addr,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use ipnet::Ipv4Net;
use tracing::{error, info, warn};
use vpcnet_agent::{
    cloud::{Cloud, CloudOptions},
    cni_server,
    datapath::{
        AttachMode, CollectorReport, Datapath, DatapathMaps, LoadOptions, monotonic_now_ns,
        timeouts::{NETFILTER_SYSCTL_DIR, read_timeouts},
        verifier,
    },
    env::{Env, parse_cidrs},
    install, introspect,
    ipam::{
        manager::{Manager, ManagerError, ManagerOptions, NodeNetwork, gateway_of},
        settings::{DEFAULT_BACKING_STORE, ENV_BACKING_STORE, EniConfig, IpamSettings},
    },
    k8s::{self, K8sSettings, service_cidrs},
    layout, logging,
    netlink::NetlinkHandle,
    node::{CidrClasses, NodeLinks, SharedCidrClasses},
    pods::{BranchLinks, Pods, PodsOptions},
    retry,
    settings::Settings,
    snat::SnatSettings,
    takeover::{self, network_policy},
};
use vpcnet_api::layout::NodeLayout;
use vpcnet_common::{
    addr_to_raw,
    config::{FLAG_EXTERNAL_SNAT, RandomizeMode},
    endpoint::{ENI_PRIMARY, Eni},
    maps::PIN_DIR,
    nat::Timeouts,
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
        endpoint: cli::IntrospectionEndpoint,
    },
    /// Print the node's ENIs, their addresses and which pod holds each
    /// (asks the running agent's introspection endpoint).
    Enis {
        #[command(flatten)]
        endpoint: cli::IntrospectionEndpoint,
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
        Command::Run(args) => run(&cli.pin_dir, &args, &env),
        Command::Settings { ipam } => print_settings(&env, ipam),
        Command::Verifier => print_verifier_budgets(),
        Command::Counters { all } => print_counters(&open(&cli.pin_dir)?, all),
        Command::Nat { summary: false } => print_nat(&open(&cli.pin_dir)?),
        Command::Nat { summary: true } => print_nat_summary(&open(&cli.pin_dir)?),
        Command::Config => print_config(&open(&cli.pin_dir)?),
        Command::Set { flag } => set_flag(&mut open(&cli.pin_dir)?, &flag),
        Command::Ipam { cni_socket } => print_ipam(&cni_socket),
        Command::Pods { endpoint } => cli::print_pods(&endpoint),
        Command::Enis { endpoint, all } => cli::print_enis(&endpoint, all),
        Command::Probe {
            ready,
            cni_socket,
            timeout,
        } => cli::probe(&cni_socket, ready, seconds("--timeout", timeout)?),
        Command::Uninstall {
            cni_conf_dir,
            cni_socket,
        } => uninstall(&cli.pin_dir, cni_conf_dir, &cni_socket, &env),
        Command::InstallPlugins { from, to } => {
            for path in install::install_plugins(&from, &to)? {
                println!("installed {}", path.display());
            }
            Ok(())
        }
    }
}

/// `vpcnet-agent verifier`.
fn print_verifier_budgets() -> Result<()> {
    let pin_dir = PathBuf::from(format!(
        "/sys/fs/bpf/vpcnet-verifier-{}",
        std::process::id()
    ));
    let loaded = Datapath::load(&LoadOptions {
        pin_dir: pin_dir.clone(),
        ..LoadOptions::default()
    });
    let removed = vpcnet_agent::datapath::remove_pins(&pin_dir);
    let datapath = loaded.context("loading the datapath")?;
    removed.with_context(|| format!("removing {}", pin_dir.display()))?;
    let release = verifier::kernel_release();
    let budgets = verifier::budgets(
        datapath.program_stats(),
        vpcnet_agent::datapath::PROGRAMS,
        &release,
    )?;
    println!("{}", verifier::table(&release, &budgets));
    let overruns: Vec<String> = budgets
        .iter()
        .flat_map(verifier::Budget::overruns)
        .collect();
    if !overruns.is_empty() {
        bail!("over budget:\n  {}", overruns.join("\n  "));
    }
    Ok(())
}

fn uninstall(
    pin_dir: &std::path::Path,
    cni_conf_dir: Option<PathBuf>,
    cni_socket: &std::path::Path,
    env: &Env,
) -> Result<()> {
    if std::os::unix::net::UnixStream::connect(cni_socket).is_ok() {
        bail!(
            "the agent is running (it answers on {}): stop it first (delete vpcnet's DaemonSet); its programs stay attached until this command detaches them",
            cni_socket.display()
        );
    }
    let snat = SnatSettings::from_env(env)?;
    let cloud_opts = CloudOptions::from_env(env);
    let opts = takeover::HandBackOptions {
        pin_dir: pin_dir.to_owned(),
        checkpoint: PathBuf::from(env.get(ENV_BACKING_STORE).unwrap_or(DEFAULT_BACKING_STORE)),
        cni_conf_dir,
        connmark: snat.connmark,
        veth_prefix: vpcnet_agent::pods::veth_prefix(env)?,
    };
    if !vpcnet_agent::datapath::pins::datapath_pinned(pin_dir) {
        // Done before, or the node rebooted since: only the conflists.
        println!(
            "no vpcnet datapath is pinned in {}: no rules to write back",
            pin_dir.display()
        );
        if let Some(dir) = &opts.cni_conf_dir
            && takeover::hand_back_conflist(dir)?
        {
            println!("aws-node's conflist {} restored", takeover::AWS_CONFLIST);
        }
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let done = runtime.block_on(async {
        let netlink = NetlinkHandle::new()?;
        // IMDS only if a pod is on a secondary ENI (its table is the
        // ENI's device number + 1).
        let cloud = tokio::sync::OnceCell::new();
        let device_number = async |mac: vpcnet_agent::netlink::MacAddr| {
            let failed = |message: String| takeover::TakeOverError::DeviceNumber { mac, message };
            let cloud = cloud
                .get_or_try_init(|| Cloud::connect(cloud_opts.clone()))
                .await
                .map_err(|e| failed(e.to_string()))?;
            Ok(cloud
                .imds_eni(&mac.to_string())
                .await
                .map_err(|e| failed(e.to_string()))?
                .device_number)
        };
        anyhow::Ok(takeover::hand_back(&opts, &netlink, device_number).await?)
    })?;
    println!(
        "aws-node's rules written back for the node and {} pods ({} ip rules added); {} translated connections handed to conntrack, {} stale entries of untranslated ones removed from it; datapath detached from {}",
        done.pods,
        done.ip_rules_added,
        done.flows_exported,
        done.stale_forgotten,
        pin_dir.display()
    );
    if done.conflist_restored {
        println!("aws-node's conflist {} restored", takeover::AWS_CONFLIST);
    }
    Ok(())
}

fn open(pin_dir: &std::path::Path) -> Result<DatapathMaps> {
    DatapathMaps::open_pinned(pin_dir).with_context(|| {
        format!(
            "is the agent running? no datapath pinned in {}",
            pin_dir.display()
        )
    })
}

/// `vpcnet-agent settings`.
fn print_settings(env: &Env, ipam: bool) -> Result<()> {
    let settings = Settings::read(env, ipam, None, None)?;
    println!("{}", serde_json::to_string_pretty(&settings.view(env)?)?);
    Ok(())
}

fn run(pin_dir: &std::path::Path, args: &RunArgs, env: &Env) -> Result<()> {
    // Every variable is checked before anything changes on the node.
    let settings = Settings::read(
        env,
        args.ipam,
        args.introspection_address.as_deref(),
        args.metrics_address.as_deref(),
    )?;
    info!(settings = %settings.view(env)?, "settings in force");
    if args.ipam {
        // Before anything changes on the node.
        if let Some(enforcement) = network_policy::check(env, &args.network_policy_pins)? {
            warn!(
                programs = enforcement.programs.len(),
                dir = %enforcement.dir.display(),
                "taking over a node where aws-node's network policy agent enforced NetworkPolicy, as {} says: its policies are no longer enforced",
                network_policy::ENV_TAKE_OVER_POLICY_NODE
            );
        }
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(run_node(pin_dir, args, settings))
}

/// What the node is: from the command line, or from IMDS with `--ipam`.
struct NodeFacts {
    primary_interface: String,
    node_addr: Ipv4Addr,
    vpc_cidrs: Vec<Ipv4Net>,
    /// The primary ENI's subnet gateway, when known.
    gateway: Option<Ipv4Addr>,
}

async fn node_facts(
    args: &RunArgs,
    cloud: Option<&Cloud>,
    netlink: &NetlinkHandle,
) -> Result<NodeFacts> {
    let vpc_cidrs = args
        .vpc_cidrs
        .as_deref()
        .map(|v| parse_cidrs("--vpc-cidrs", v))
        .transpose()?;
    let Some(cloud) = cloud else {
        return Ok(NodeFacts {
            primary_interface: args
                .primary_interface
                .clone()
                .context("--primary-interface is needed without --ipam")?,
            node_addr: args
                .node_addr
                .context("--node-addr is needed without --ipam")?,
            vpc_cidrs: vpc_cidrs.context("--vpc-cidrs is needed without --ipam")?,
            gateway: None,
        });
    };
    let instance = cloud.instance_metadata().await?;
    let primary = cloud.imds_eni(&instance.primary_mac).await?;
    let primary_interface = if let Some(name) = &args.primary_interface {
        name.clone()
    } else {
        let mac = instance.primary_mac.parse()?;
        netlink
            .link_by_mac(mac)
            .await?
            .with_context(|| format!("no link has the primary ENI's MAC {mac}"))?
            .name
    };
    Ok(NodeFacts {
        primary_interface,
        node_addr: args.node_addr.unwrap_or(instance.local_ipv4),
        vpc_cidrs: match vpc_cidrs {
            Some(cidrs) => cidrs,
            None => primary.vpc_cidrs.clone(),
        },
        gateway: Some(gateway_of(primary.subnet_cidr)),
    })
}

/// The Kubernetes client, when the agent runs with an API server.
fn connect_kubernetes(settings: &K8sSettings) -> Result<Option<kube::Client>> {
    if !settings.enabled {
        info!(
            "no Kubernetes API ({} and {} unset): the node's facts come from IMDS and the environment",
            k8s::ENV_SERVICE_HOST,
            k8s::ENV_CLUSTER_ENDPOINT
        );
        return Ok(None);
    }
    let client = k8s::connect(settings)?;
    info!(node = ?settings.node_name, "Kubernetes API client configured (in-cluster)");
    Ok(Some(client))
}

/// What to do about the service CIDRs once the agent runs.
enum ServiceCidrsNext {
    /// Follow the ServiceCIDR objects.
    Follow,
    /// The API did not answer at start: look them up until it does.
    Retry,
    Nothing,
}

/// The cluster's service CIDRs at start; the defaults (`fallback`) when
/// the API does not answer in time.
async fn cluster_service_cidrs(
    client: &kube::Client,
    fallback: Vec<Ipv4Net>,
) -> (Vec<Ipv4Net>, ServiceCidrsNext) {
    let error = match tokio::time::timeout(k8s::START_CALL_TIMEOUT, service_cidrs::discover(client))
        .await
    {
        Ok(Ok(found)) => {
            info!(cidrs = ?found.cidrs, origin = ?found.origin, "the cluster's service CIDRs");
            let next = match found.origin {
                service_cidrs::Origin::ServiceCidrObjects => ServiceCidrsNext::Follow,
                service_cidrs::Origin::KubernetesService(_) => ServiceCidrsNext::Nothing,
            };
            return (found.cidrs, next);
        }
        Ok(Err(error)) => error.to_string(),
        Err(_) => format!("no answer within {:?}", k8s::START_CALL_TIMEOUT),
    };
    warn!(%error, defaults = ?fallback, "the cluster's service CIDRs are unknown: the defaults until the API answers");
    (fallback, ServiceCidrsNext::Retry)
}

/// Keeps the datapath's service CIDRs the cluster's.
async fn follow_service_cidrs(
    client: kube::Client,
    next: ServiceCidrsNext,
    classes: SharedCidrClasses,
    datapath: Arc<std::sync::Mutex<Datapath>>,
) {
    let set = |cidrs: &[Ipv4Net]| {
        if let Err(error) = classes.update(&datapath, |c| c.services = cidrs.to_vec()) {
            error!(%error, "writing the service CIDRs into the datapath");
        }
    };
    let follow = match next {
        ServiceCidrsNext::Nothing => return,
        ServiceCidrsNext::Follow => true,
        ServiceCidrsNext::Retry => {
            let Some(found) = service_cidrs_once_answered(&client).await else {
                return;
            };
            info!(cidrs = ?found.cidrs, origin = ?found.origin, "the cluster's service CIDRs, now that the API answers");
            set(&found.cidrs);
            found.origin == service_cidrs::Origin::ServiceCidrObjects
        }
    };
    if follow {
        service_cidrs::follow(client, classes.get().services, set).await;
    }
}

/// The service CIDRs once the API answers, asked again after each delay
/// of the agent's backoff from 1 s to 30 s.
async fn service_cidrs_once_answered(client: &kube::Client) -> Option<service_cidrs::ServiceCidrs> {
    for delay in retry::delays(Duration::from_secs(1), Duration::from_secs(30)) {
        tokio::time::sleep(delay).await;
        match service_cidrs::discover(client).await {
            Ok(found) => return Some(found),
            Err(error) => warn!(%error, waited = ?delay, "looking up the cluster's service CIDRs"),
        }
    }
    None
}

/// Max pods from the Node's capacity (what kubelet was started with), as
/// aws-node reads it; `None` (computed from the instance type) when the
/// API does not say in time.
async fn node_max_pods(views: &k8s::node::NodeViews) -> Option<usize> {
    let Some(node) = k8s::node::first(views, k8s::START_CALL_TIMEOUT).await else {
        warn!(timeout = ?k8s::START_CALL_TIMEOUT, "max pods computed from the instance type: the Node could not be read in time");
        return None;
    };
    info!(node = %node.name, max_pods = ?node.max_pods, "the Node read");
    node.max_pods
}

/// Follows the node's Node for as long as the agent runs.
async fn follow_node(
    client: kube::Client,
    settings: K8sSettings,
    views: tokio::sync::watch::Sender<Option<k8s::node::NodeView>>,
) {
    if let Err(error) = k8s::node::follow(client, settings, views).await {
        error!(%error, "the Node cannot be followed");
    }
}

/// What the address manager follows of the cluster: the Node's cordon,
/// and with custom networking the node's ENIConfig, unless
/// `VPCNET_ENI_CONFIG_SUBNET` overrides it.
fn follow_for_manager(
    client: &kube::Client,
    views: &k8s::node::NodeViews,
    settings: &IpamSettings,
    tasks: &mut tokio::task::JoinSet<()>,
) -> (
    tokio::sync::watch::Receiver<bool>,
    Option<tokio::sync::watch::Receiver<Option<EniConfig>>>,
) {
    let (cordoned, follow_cordon) =
        k8s::node::derived(views.clone(), false, |node| node.unschedulable);
    tasks.spawn(follow_cordon);
    if !settings.custom_network {
        return (cordoned, None);
    }
    if let Some(config) = settings.eni_config_override() {
        info!(
            subnet = %config.subnet_id,
            security_groups = ?config.security_groups,
            "custom networking from {}: ENIConfig objects are not read",
            config.source()
        );
        return (cordoned, None);
    }
    let (configs, subscribed) = tokio::sync::watch::channel(None);
    tasks.spawn(k8s::eni_config::follow(
        client.clone(),
        views.clone(),
        configs,
    ));
    (cordoned, Some(subscribed))
}

/// Starts the address manager, retrying while EC2 throttles or fails.
async fn start_manager(
    cloud: &Cloud,
    opts: &ManagerOptions,
    network: Arc<dyn NodeNetwork>,
) -> Result<Manager> {
    retry_start(
        "starting the address manager",
        || Manager::start(cloud.clone(), opts.clone(), Arc::clone(&network)),
        ManagerError::backs_off,
    )
    .await
}

/// The region from IMDS, retried like the address manager's start: an
/// IMDS that answers late (a busy node, a throttled endpoint) delays the
/// start instead of ending it.
async fn connect_cloud(opts: &CloudOptions) -> Result<Cloud> {
    retry_start(
        "connecting to IMDS",
        || Cloud::connect(opts.clone()),
        |_| true,
    )
    .await
}

/// How long the start's calls to AWS are retried.
const START_RETRY_FOR: Duration = Duration::from_mins(5);

/// `attempt` until it succeeds, fails for good (not `retryable`) or
/// [`START_RETRY_FOR`] has passed, with the agent's backoff from 200 ms
/// to 20 s.
async fn retry_start<T, E, Fut>(
    what: &'static str,
    mut attempt: impl FnMut() -> Fut,
    retryable: impl Fn(&E) -> bool,
) -> Result<T>
where
    Fut: Future<Output = Result<T, E>>,
    E: std::error::Error + Send + Sync + 'static,
{
    let deadline = tokio::time::Instant::now() + START_RETRY_FOR;
    let mut delays = retry::delays(Duration::from_millis(200), Duration::from_secs(20));
    loop {
        let error = match attempt().await {
            Ok(done) => return Ok(done),
            Err(error) => error,
        };
        match delays.next() {
            Some(delay) if retryable(&error) && tokio::time::Instant::now() < deadline => {
                warn!(%error, retry_in = ?delay, "{what}");
                tokio::time::sleep(delay).await;
            }
            _ => return Err(error).context(what),
        }
    }
}

#[allow(clippy::too_many_lines)] // the node's start, step by step
async fn run_node(pin_dir: &std::path::Path, args: &RunArgs, settings: Settings) -> Result<()> {
    let Settings {
        snat,
        service_cidrs,
        service_cidrs_overridden,
        k8s,
        ipam,
        endpoints,
        plugin,
        veth_prefix,
        cloud,
        sysctls,
    } = settings;
    let endpoints = &endpoints;
    let netlink = NetlinkHandle::new()?;
    let cloud = match &ipam {
        Some(_) => Some(connect_cloud(&cloud).await?),
        None => None,
    };
    let node = node_facts(args, cloud.as_ref(), &netlink).await?;
    let kube = connect_kubernetes(&k8s)?;
    let (service_cidrs, service_cidrs_next) = match &kube {
        Some(client) if !service_cidrs_overridden => {
            cluster_service_cidrs(client, service_cidrs).await
        }
        _ => (service_cidrs, ServiceCidrsNext::Nothing),
    };
    sysctls
        .apply(&node.primary_interface)
        .context("setting the node's sysctls")?;
    if let Some(settings) = &ipam {
        // aws-node gives the primary ENI the ENIs' MTU too.
        let primary = netlink
            .link_by_name(&node.primary_interface)
            .await?
            .with_context(|| format!("no link {}", node.primary_interface))?;
        if primary.mtu != settings.eni_mtu {
            netlink
                .set_mtu(&primary.link_ref(), settings.eni_mtu)
                .await?;
            info!(interface = %node.primary_interface, mtu = settings.eni_mtu, "primary ENI's MTU set");
        }
    }
    let mut datapath = Datapath::load(&LoadOptions {
        pin_dir: pin_dir.to_owned(),
        nat_entries: args.nat_entries,
        stack_flow_entries: args.stack_flow_entries,
        attach_mode: AttachMode::from_env()?,
    })
    .context("loading the datapath")?;
    info!(attach = ?datapath.attach_mode(), "datapath loaded");
    // Keep the hash key of a previous run so hashrandom ports stay stable.
    let seed = match datapath.maps.config() {
        Ok(old) if old.hash_seed != 0 => old.hash_seed,
        _ => random_seed()?,
    };
    datapath
        .maps
        .set_config(&snat.datapath_config(node.node_addr, seed))?;
    sync_timeouts(&mut datapath.maps)?;
    let cidr_classes = SharedCidrClasses::new(CidrClasses {
        vpc: node.vpc_cidrs.clone(),
        excluded: snat.exclude_snat_cidrs.clone(),
        services: service_cidrs.clone(),
    });
    cidr_classes
        .get()
        .write(&mut datapath)
        .map_err(|e| anyhow::anyhow!("writing the CIDR map: {e}"))?;
    // Read at start only, as aws-node writes its rules 1535 at start.
    datapath
        .maps
        .set_external_service_cidrs(&snat.external_service_cidrs)?;
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
    if let Some(gateway) = node.gateway {
        let link = netlink
            .link_by_name(&node.primary_interface)
            .await?
            .with_context(|| format!("no link {}", node.primary_interface))?;
        datapath.maps.set_eni(
            link.index,
            &Eni {
                gateway: addr_to_raw(gateway.octets()),
                flags: ENI_PRIMARY,
            },
        )?;
        netlink
            .keep_gateway_resolved(&link.link_ref(), gateway)
            .await?;
    }
    datapath
        .attach_eni(&node.primary_interface)
        .with_context(|| format!("attaching to {}", node.primary_interface))?;
    info!(
        interface = %node.primary_interface,
        node_addr = %node.node_addr,
        external_snat = snat.external_snat,
        randomize = snat.randomize.env_value(),
        "datapath attached"
    );
    let datapath = Arc::new(std::sync::Mutex::new(datapath));
    let collector = Arc::new(std::sync::Mutex::new(CollectorReport::default()));
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    let in_flight = Arc::new(cni_server::InFlight::default());
    let node_views = kube.as_ref().map(|client| {
        let (views, subscribed) = k8s::node::channel();
        tasks.spawn(follow_node(client.clone(), k8s.clone(), views));
        subscribed
    });
    if let Some(client) = &kube {
        tasks.spawn(follow_service_cidrs(
            client.clone(),
            service_cidrs_next,
            cidr_classes.clone(),
            Arc::clone(&datapath),
        ));
    }
    let (ipam_settings, mut introspected_pods) = (ipam.clone(), None);
    let mut introspected_eni_config = None;
    if let (Some(settings), Some(cloud)) = (ipam, cloud) {
        // Pods with a branch ENI are served with ENABLE_POD_ENI only.
        let branch_mode = settings.pod_eni.then_some(settings.sg_enforcing_mode);
        let conflist_settings = install::ConflistSettings {
            eni_mtu: settings.eni_mtu,
            veth_prefix: veth_prefix.clone(),
            enforcing_mode: settings.sg_enforcing_mode,
            agent_socket: args.cni_socket.clone(),
            plugin,
        };
        let network = Arc::new(NodeLinks {
            netlink,
            datapath: Arc::clone(&datapath),
            mtu: settings.eni_mtu,
            cidrs: cidr_classes.clone(),
            owners: vpcnet_agent::link_owner::LinkOwners::default(),
        });
        let mut settings = settings;
        if settings.max_pods.is_none()
            && let Some(views) = &node_views
        {
            settings.max_pods = node_max_pods(views).await;
        }
        let (cordoned, eni_configs) = match (&kube, &node_views) {
            (Some(client), Some(views)) => {
                let (cordoned, configs) = follow_for_manager(client, views, &settings, &mut tasks);
                (Some(cordoned), configs)
            }
            _ => (None, None),
        };
        let opts = ManagerOptions {
            cordoned,
            eni_configs,
            reconcile_interval: seconds("--reconcile-interval", args.reconcile_interval)?,
            min_eni_lifetime: seconds("--min-eni-lifetime", args.min_eni_lifetime)?,
            leaked_eni_interval: seconds("--leaked-eni-interval", args.leaked_eni_interval)?,
            vpc_cidr_interval: seconds("--vpc-cidr-interval", args.vpc_cidr_interval)?,
            node_reconcile_interval: seconds(
                "--node-reconcile-interval",
                args.node_reconcile_interval,
            )?,
            ..ManagerOptions::new(settings)
        };
        introspected_eni_config.clone_from(&opts.eni_configs);
        let manager = start_manager(&cloud, &opts, network).await?;
        if branch_mode.is_some()
            && let Some(client) = &kube
        {
            tasks.spawn(k8s::cninode::enable_security_groups_for_pods(
                client.clone(),
                k8s.clone(),
            ));
        }
        let mut cluster_pods = None;
        if let Some(client) = &kube {
            tasks.spawn(k8s::events::publish(
                client.clone(),
                k8s.clone(),
                manager.subscribe_events(),
            ));
            match k8s::pods::NodePods::follow(client.clone(), &k8s) {
                Ok((pods, follow)) => {
                    tasks.spawn(follow);
                    cluster_pods = Some(pods);
                }
                Err(error) => warn!(%error, "this node's pods are not followed"),
            }
        }
        tasks.spawn(manager.clone().run());
        let netlink_for_pods = NetlinkHandle::new()?;
        let pods = Pods::new(
            manager,
            Arc::clone(&datapath),
            NetlinkHandle::new()?,
            PodsOptions {
                veth_prefix: conflist_settings.veth_prefix.clone(),
                orphan_grace: seconds("--orphan-grace", args.orphan_grace)?,
                branch_mode,
                branch_links: args.branch_links,
                cluster_pods,
            },
        );
        // Before the plugin is served: pods aws-node left keep their
        // addresses, connections and paths.
        match takeover::take_over(&pods, &datapath, &netlink_for_pods, snat.connmark).await {
            Ok(report) => report.log(),
            Err(e) => error!(error = %e, "taking the node over from aws-node failed"),
        }
        introspected_pods = Some(pods.clone());
        tasks.spawn(sweep_pods(
            pods.clone(),
            seconds("--pod-sweep-interval", args.pod_sweep_interval)?,
        ));
        let listener = cni_server::bind(&args.cni_socket)?;
        let counter = Arc::clone(&in_flight);
        tasks.spawn(async move {
            if let Err(e) = cni_server::serve(pods, listener, counter).await {
                error!(error = %e, "CNI backend stopped");
            }
        });
        info!(socket = %args.cni_socket.display(), "CNI backend serving");
        introspect::recorder::started(kube.is_some());
        if let Some(dir) = &args.cni_conf_dir {
            let conflist = install::render_conflist(&conflist_settings)?;
            let path = install::write_conflist(dir, &conflist)?;
            info!(conflist = %path.display(), "CNI configuration written");
            if takeover::set_aside_aws_conflist(dir)? {
                info!(
                    set_aside = takeover::AWS_CONFLIST_SET_ASIDE,
                    "aws-node's CNI configuration set aside"
                );
            }
        }
    }
    // Without --ipam: the datapath's own entries, the IPAM parts empty.
    introspect::start(
        endpoints,
        introspect::Sources {
            datapath: Arc::clone(&datapath),
            pods: introspected_pods,
            ipam_settings,
            primary_interface: node.primary_interface.clone(),
            collector: Arc::clone(&collector),
            eni_config_objects: introspected_eni_config,
        },
        &shutdown_rx,
        &mut tasks,
    )?;
    if args.notify_ready {
        notify_ready()?;
    }
    let result = serve(
        pin_dir,
        Duration::from_secs(args.gc_interval.max(1)),
        &collector,
    )
    .await;
    let _ = shutdown_tx.send(true);
    if args.ipam {
        // New requests find no socket (the plugin says the agent is down);
        // those under way finish: an ADD cut short would leave the plugin
        // to undo it. Idle connections are not waited for.
        if let Err(e) = std::fs::remove_file(&args.cni_socket)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            warn!(socket = %args.cni_socket.display(), error = %e, "removing the CNI socket");
        }
        if !in_flight.wait_idle(SHUTDOWN_GRACE).await {
            warn!(grace = ?SHUTDOWN_GRACE, "CNI requests still running at exit");
        }
    }
    tasks.abort_all();
    result
}

/// How long requests under way may take to finish at SIGTERM (an ADD
/// waits up to 10 s for the pool; kubelet allows 30 s before SIGKILL).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(12);

/// Sweeps for pods that went away without a DEL, every `interval`.
async fn sweep_pods(pods: Pods, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match pods.sweep().await {
            Ok(stats) if stats.gone + stats.never_attached > 0 => {
                info!(
                    gone = stats.gone,
                    never_attached = stats.never_attached,
                    "pod sweep released addresses"
                );
            }
            Ok(_) => {}
            Err(e) => warn!(error = %e, "pod sweep failed"),
        }
    }
}

fn seconds(flag: &str, value: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(value)
        .with_context(|| format!("{flag}: {value} is not a duration in seconds"))
}

/// Collects garbage until SIGTERM or SIGINT, on a thread of its own at
/// the lowest CPU priority, with map handles of its own: a pass over 236k
/// flows takes a few hundred ms of CPU (`cargo xtask bench --parts nat-load`),
/// and neither the datapath's lock (CNI ADD and DEL need it), this runtime
/// nor an ADD's CPU time waits for it.
async fn serve(
    pin_dir: &Path,
    gc_interval: Duration,
    report: &Arc<std::sync::Mutex<CollectorReport>>,
) -> Result<()> {
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let maps = DatapathMaps::open_pinned(pin_dir).context("the collector's maps")?;
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    let report = Arc::clone(report);
    let collector = std::thread::Builder::new()
        .name("vpcnet-gc".into())
        .spawn(move || collect_until_stopped(maps, gc_interval, &report, &stopped))
        .context("starting the garbage collector's thread")?;
    tokio::select! {
        _ = sigterm.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    drop(stop);
    // A pass under way finishes first.
    let _ = tokio::task::spawn_blocking(move || collector.join()).await;
    info!("stopping: programs stay attached and maps pinned for the next agent");
    Ok(())
}

/// The collector's thread: a pass every `interval` until `stopped` says so.
fn collect_until_stopped(
    mut maps: DatapathMaps,
    interval: Duration,
    report: &std::sync::Mutex<CollectorReport>,
    stopped: &std::sync::mpsc::Receiver<()>,
) {
    // SCHED_IDLE for this thread alone (Linux's policies are per thread):
    // any other task that wakes takes the CPU from it at once, where nice
    // 19 still cost the ADDs' tail (`cargo xtask bench --parts nat-load`).
    // A busy node still gives it a sliver of CPU, so passes go on.
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` lives through the call; failing changes nothing.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &raw const param) } != 0 {
        warn!(error = %std::io::Error::last_os_error(), "the collector keeps its CPU priority");
    }
    loop {
        let started = std::time::Instant::now();
        match collect(&mut maps) {
            Ok(c) => {
                c.log();
                report
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .record([&c.nat, &c.stack], c.took);
            }
            Err(e) => warn!(error = %e, "garbage collection failed"),
        }
        let rest = interval.saturating_sub(started.elapsed());
        if !matches!(
            stopped.recv_timeout(rest),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout)
        ) {
            return;
        }
    }
}

/// What one garbage collection did, and how long it took.
struct Collected {
    nat: vpcnet_agent::datapath::GcStats,
    stack: vpcnet_agent::datapath::GcStats,
    took: Duration,
}

impl Collected {
    fn log(&self) {
        let Self { nat, stack, took } = self;
        if nat.expired + nat.orphans + nat.paired > 0 {
            info!(
                flows = nat.flows,
                expired = nat.expired,
                orphans = nat.orphans,
                paired = nat.paired,
                ?took,
                "NAT garbage collected"
            );
        }
        if stack.expired + stack.orphans > 0 {
            info!(
                flows = stack.flows,
                expired = stack.expired,
                orphans = stack.orphans,
                ?took,
                "stack flows garbage collected"
            );
        }
    }
}

/// One garbage collection: the node's timeouts, then the NAT table and
/// the stack flows.
fn collect(maps: &mut DatapathMaps) -> Result<Collected> {
    let started = std::time::Instant::now();
    let timeouts = sync_timeouts(maps)?;
    let now = monotonic_now_ns();
    let nat = maps.collect_garbage(&timeouts, now)?;
    let stack = maps.collect_stack_flows(&timeouts, now)?;
    Ok(Collected {
        nat,
        stack,
        took: started.elapsed(),
    })
}

/// Gives the datapath the node's conntrack timeouts when they changed (at
/// start, or after a `sysctl -w`), and returns them.
fn sync_timeouts(maps: &mut DatapathMaps) -> Result<Timeouts> {
    let wanted = read_timeouts(Path::new(NETFILTER_SYSCTL_DIR));
    if maps.timeouts()? != wanted {
        maps.set_timeouts(&wanted)?;
        info!(timeouts = ?wanted, "flow timeouts from the node's conntrack settings (0: netfilter's default)");
    }
    Ok(wanted)
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

fn print_ipam(socket: &std::path::Path) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let status = runtime.block_on(async {
        let mut client = vpcnet_api::connect_cni(socket).await.with_context(|| {
            format!(
                "is the agent running with --ipam? no answer on {}",
                socket.display()
            )
        })?;
        anyhow::Ok(
            client
                .ipam_status(vpcnet_api::cni::IpamStatusRequest {})
                .await?
                .into_inner(),
        )
    })?;
    println!(
        "addresses {} ({} assigned), prefixes {}, ENIs {}/{}, max pods {}{}",
        status.total_addrs,
        status.assigned_addrs,
        status.total_prefixes,
        status.enis,
        status.max_enis,
        status.max_pods,
        if status.prefix_fallback {
            ", prefix delegation fell back to addresses"
        } else {
            ""
        }
    );
    let mut counters: Vec<_> = status.counters.into_iter().collect();
    counters.sort();
    for (name, value) in counters {
        println!("{name:<44} {value:>10}");
    }
    for event in status.events {
        println!("event {} {}: {}", event.time, event.reason, event.message);
    }
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
fn print_nat_summary(maps: &DatapathMaps) -> Result<()> {
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
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
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

fn print_config(maps: &DatapathMaps) -> Result<()> {
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
