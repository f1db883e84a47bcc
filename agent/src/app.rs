//! The running node, assembled from its parts: the datapath, the address
//! manager, the Kubernetes followers, the CNI server, introspection and the
//! garbage collector. [`run_node`] reads as the list of what runs; each
//! part brings its own start.

use std::{
    io::Write,
    net::Ipv4Addr,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result};
use ipnet::Ipv4Net;
use tokio::{sync::watch, task::JoinSet};
use tracing::{error, info, warn};
use vpcnet_agent::{
    bring_up::{BringUp, bring_up},
    cloud::{Cloud, CloudOptions},
    cni_server, cni_waiting,
    datapath::{AttachMode, CollectorReport, Datapath, LoadOptions, gc},
    env::{Env, parse_cidrs},
    install, introspect,
    ipam::{
        manager::{Manager, ManagerError, ManagerOptions, NodeNetwork, gateway_of},
        settings::{EniConfig, IpamSettings},
    },
    k8s::{
        self, K8sSettings,
        network_policies::NetworkPolicySources,
        node::NodeViews,
        policy_endpoints::{ClusterNetworkPolicies, ClusterPolicyEndpoints, PolicyEndpoints},
        service_cidrs,
    },
    link_owner::LinkOwners,
    netlink::NetlinkHandle,
    node::{CidrClasses, NodeLinks, NodeSysctls, SharedCidrClasses},
    pods::{BranchLinks, Pods, PodsOptions},
    policy::{
        self,
        node::{ClusterPolicies, NodePolicy, PodName, Policies},
        settings::{PolicySettings, Source},
    },
    retry,
    settings::Settings,
    snat::SnatSettings,
    takeover::{self, network_policy},
    telemetry,
};

use crate::commands::{self, seconds};

/// `run`'s options.
#[derive(clap::Args)]
pub struct RunArgs {
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
    /// Where aws-node's network policy agent pins its programs and maps: a
    /// node with any program has its policies taken over (with
    /// `ENABLE_NETWORK_POLICY`).
    #[arg(long, default_value = network_policy::PINS_ROOT)]
    network_policy_pins: PathBuf,
    /// The node's network sysctls, as mounted: an unprivileged container's
    /// `/proc/sys` is read-only, so the DaemonSet mounts the node's
    /// `/proc/sys/net` elsewhere, writable.
    #[arg(long, default_value = vpcnet_agent::node::PROC_SYS_NET)]
    proc_sys_net: PathBuf,
}

/// `vpcnet-agent run`: every variable read and checked, then the node run
/// until SIGTERM.
pub fn run(pin_dir: &Path, args: &RunArgs, env: &Env) -> Result<()> {
    // Every variable is checked before anything changes on the node.
    let settings = Settings::read(
        env,
        args.ipam,
        args.introspection_address.as_deref(),
        args.metrics_address.as_deref(),
    )?;
    info!(settings = %settings.view(env)?, "settings in force");
    if args.ipam {
        vpcnet_agent::takeover::iptables::tell_backend_meanwhile();
    }
    settings
        .snat
        .check_node_marks(&vpcnet_agent::takeover::iptables::node_mark_uses())?;
    // Before anything changes on the node.
    let aws_policy = if args.ipam {
        network_policy::check(settings.policy.is_some(), &args.network_policy_pins)?
    } else {
        None
    };
    if let Some(enforcement) = &aws_policy {
        info!(
            programs = enforcement.programs.len(),
            dir = %enforcement.dir.display(),
            "aws-node's network policy agent enforced NetworkPolicy here: vpcnet takes its policies over before its programs go"
        );
        if !enforcement.cluster_policy_pods.is_empty() {
            info!(
                pods = %enforcement.cluster_policy_pods.join(", "),
                "aws-node's network policy agent judged these pods by ClusterNetworkPolicy too: vpcnet enforces them from the cluster's ClusterPolicyEndpoints"
            );
        }
    }
    let runtime = commands::runtime()?;
    runtime.block_on(run_node(pin_dir, args, settings, aws_policy))
}

#[allow(clippy::too_many_lines)] // the node's start, part by part
async fn run_node(
    pin_dir: &Path,
    args: &RunArgs,
    settings: Settings,
    aws_policy: Option<network_policy::Enforcement>,
) -> Result<()> {
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
        policy,
    } = settings;
    let kube = connect_kubernetes(&k8s)?;
    if args.ipam {
        wait_for_ipamd(args, kube.as_ref(), k8s.node_name.as_deref()).await?;
    }
    let netlink = NetlinkHandle::new()?;
    let cloud = match &ipam {
        Some(_) => Some(connect_cloud(&cloud).await?),
        None => None,
    };
    let node = node_facts(args, cloud.as_ref(), &netlink).await?;
    let (service_cidrs, service_cidrs_next) = match &kube {
        Some(client) if !service_cidrs_overridden => {
            service_cidrs::at_start(client, service_cidrs).await
        }
        _ => (service_cidrs, service_cidrs::Next::Nothing),
    };
    prepare_node(&sysctls, &args.proc_sys_net, ipam.as_ref(), &node, &netlink).await?;
    let cidr_classes = SharedCidrClasses::new(CidrClasses {
        vpc: node.vpc_cidrs.clone(),
        excluded: snat.exclude_snat_cidrs.clone(),
        services: service_cidrs.clone(),
    });
    let datapath = start_datapath(
        pin_dir,
        args,
        &snat,
        &node,
        &cidr_classes.get(),
        policy.as_ref().map_or(0, PolicySettings::config_flags),
        &netlink,
    )
    .await?;
    let mut parts = Parts {
        args,
        datapath: Arc::new(Mutex::new(datapath)),
        kube,
        k8s,
        node_views: None,
        aws_policy,
        tasks: JoinSet::new(),
    };
    let collector = Arc::new(Mutex::new(CollectorReport::default()));
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let in_flight = Arc::new(cni_server::InFlight::default());
    parts.follow_cluster(service_cidrs_next, service_cidrs, &cidr_classes);
    let (ipam_settings, mut introspected_pods) = (ipam.clone(), None);
    let mut introspected_eni_config = None;
    if let (Some(settings), Some(cloud)) = (ipam, cloud) {
        // Pods with a branch ENI are served with ENABLE_POD_ENI only.
        let branch_mode = settings.pod_eni.then_some(settings.sg_enforcing_mode);
        let conflist = install::ConflistSettings {
            eni_mtu: settings.eni_mtu,
            veth_prefix,
            enforcing_mode: settings.sg_enforcing_mode,
            agent_socket: args.cni_socket.clone(),
            plugin,
        };
        let network = Arc::new(NodeLinks {
            netlink,
            datapath: Arc::clone(&parts.datapath),
            mtu: settings.eni_mtu,
            cidrs: cidr_classes.clone(),
            owners: LinkOwners::default(),
        });
        let (manager, eni_configs) = parts
            .start_address_manager(settings, &cloud, network)
            .await?;
        introspected_eni_config = eni_configs;
        let pods = parts
            .serve_cni(
                manager,
                branch_mode,
                &conflist,
                snat.connmark,
                policy,
                &in_flight,
            )
            .await?;
        introspected_pods = Some(pods);
    }
    // Without --ipam: the datapath's own entries, the IPAM parts empty.
    introspect::start(
        &endpoints,
        introspect::Sources {
            datapath: Arc::clone(&parts.datapath),
            pods: introspected_pods,
            ipam_settings,
            primary_interface: node.primary_interface.clone(),
            collector: Arc::clone(&collector),
            eni_config_objects: introspected_eni_config,
        },
        &shutdown_rx,
        &mut parts.tasks,
    )?;
    // Before READY: a SIGTERM right after it is a shutdown, never the
    // default action's exit half-way.
    let stop = StopSignals::register()?;
    if args.notify_ready {
        notify_ready()?;
    }
    let result = collect_until_stopped(
        stop,
        pin_dir,
        Duration::from_secs(args.gc_interval.max(1)),
        &collector,
    )
    .await;
    let _ = shutdown_tx.send(true);
    vpcnet_agent::crash_points::step("shutdown: serving stopped");
    if args.ipam {
        drain_cni(&args.cni_socket, &in_flight).await;
    }
    parts.tasks.abort_all();
    vpcnet_agent::crash_points::step("shutdown: requests drained, tasks stopped");
    result
}

/// The running node's shared parts, and the tasks that run them.
struct Parts<'a> {
    args: &'a RunArgs,
    datapath: Arc<Mutex<Datapath>>,
    kube: Option<kube::Client>,
    k8s: K8sSettings,
    /// The node's Node, once followed.
    node_views: Option<NodeViews>,
    /// aws-node's network policy enforcement, to be taken over.
    aws_policy: Option<network_policy::Enforcement>,
    tasks: JoinSet<()>,
}

impl Parts<'_> {
    /// With an API server: follows the node's Node, and keeps the
    /// datapath's service CIDRs (`current` at start) the cluster's.
    fn follow_cluster(
        &mut self,
        next: service_cidrs::Next,
        current: Vec<Ipv4Net>,
        classes: &SharedCidrClasses,
    ) {
        let Some(client) = &self.kube else {
            return;
        };
        let (views, follow) = k8s::node::following(client.clone(), self.k8s.clone());
        self.tasks.spawn(follow);
        self.node_views = Some(views);
        let (classes, datapath) = (classes.clone(), Arc::clone(&self.datapath));
        self.tasks.spawn(service_cidrs::keep(
            client.clone(),
            next,
            current,
            move |cidrs| {
                if let Err(error) = classes.update(&datapath, |c| c.services = cidrs.to_vec()) {
                    error!(%error, "writing the service CIDRs into the datapath");
                }
            },
        ));
    }

    /// Starts the address manager and what it follows and publishes of the
    /// cluster: the Node's cordon and max pods, the ENIConfig, the
    /// CNINode's feature, the events. Returns it, running, and the
    /// ENIConfig it follows.
    async fn start_address_manager(
        &mut self,
        mut settings: IpamSettings,
        cloud: &Cloud,
        network: Arc<dyn NodeNetwork>,
    ) -> Result<(Manager, Option<watch::Receiver<Option<EniConfig>>>)> {
        if settings.max_pods.is_none()
            && let Some(views) = &self.node_views
        {
            settings.max_pods = k8s::node::max_pods(views).await;
        }
        let (cordoned, eni_configs) = match (&self.kube, &self.node_views) {
            (Some(client), Some(views)) => {
                let (cordoned, configs) =
                    follow_for_manager(client, views, &settings, &mut self.tasks);
                (Some(cordoned), configs)
            }
            _ => (None, None),
        };
        let pod_eni = settings.pod_eni;
        let args = self.args;
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
        let eni_configs = opts.eni_configs.clone();
        let manager = start_manager(cloud, &opts, network).await?;
        if let Some(client) = &self.kube {
            if pod_eni {
                self.tasks
                    .spawn(k8s::cninode::enable_security_groups_for_pods(
                        client.clone(),
                        self.k8s.clone(),
                    ));
            }
            self.tasks.spawn(k8s::events::publish(
                client.clone(),
                self.k8s.clone(),
                manager.subscribe_events(),
            ));
        }
        self.tasks.spawn(manager.clone().run());
        Ok((manager, eni_configs))
    }

    /// Serves the CNI plugin: the node's pods (those aws-node left taken
    /// over first, those gone without a DEL swept), the socket, and the
    /// conflist that points the runtime at it. Returns the pods.
    async fn serve_cni(
        &mut self,
        manager: Manager,
        branch_mode: Option<vpcnet_api::layout::EnforcingMode>,
        conflist: &install::ConflistSettings,
        connmark: u32,
        policy: Option<PolicySettings>,
        in_flight: &Arc<cni_server::InFlight>,
    ) -> Result<Pods> {
        let args = self.args;
        let mut cluster_pods = None;
        if let Some(client) = &self.kube {
            match k8s::pods::NodePods::follow(client.clone(), &self.k8s) {
                Ok((pods, follow)) => {
                    self.tasks.spawn(follow);
                    cluster_pods = Some(pods);
                }
                Err(error) => warn!(%error, "this node's pods are not followed"),
            }
        }
        let netlink = NetlinkHandle::new()?;
        let pods = Pods::new(
            manager,
            Arc::clone(&self.datapath),
            NetlinkHandle::new()?,
            PodsOptions {
                veth_prefix: conflist.veth_prefix.clone(),
                orphan_grace: seconds("--orphan-grace", args.orphan_grace)?,
                branch_mode,
                branch_links: args.branch_links,
                cluster_pods,
            },
        );
        // Policy first: a pod the take-over gives a datapath entry is
        // judged by its rules from then on.
        if let Some(settings) = policy {
            self.enforce_policy(settings, &pods).await?;
        }
        // Before the plugin is served: pods aws-node left keep their
        // addresses, connections and paths.
        let aws_policy = self
            .aws_policy
            .is_some()
            .then_some(self.args.network_policy_pins.as_path());
        match takeover::take_over(&pods, &self.datapath, &netlink, connmark, aws_policy).await {
            Ok(report) => report.log(),
            Err(e) => error!(error = %e, "taking the node over from aws-node failed"),
        }
        self.tasks.spawn(sweep_pods(
            pods.clone(),
            seconds("--pod-sweep-interval", args.pod_sweep_interval)?,
        ));
        let listener = cni_server::bind(&args.cni_socket)?;
        let (served, counter) = (pods.clone(), Arc::clone(in_flight));
        self.tasks.spawn(async move {
            if let Err(e) = cni_server::serve(served, listener, counter).await {
                error!(error = %e, "CNI backend stopped");
            }
        });
        info!(socket = %args.cni_socket.display(), "CNI backend serving");
        telemetry::started(self.kube.is_some());
        if let Some(dir) = &args.cni_conf_dir {
            let text = install::render_conflist(conflist)?;
            let path = install::write_conflist(dir, &text)?;
            info!(conflist = %path.display(), "CNI configuration written");
            vpcnet_agent::crash_points::step("vpcnet's conflist written");
            if takeover::set_aside_aws_conflist(dir)? {
                info!(
                    set_aside = takeover::AWS_CONFLIST_SET_ASIDE,
                    "aws-node's CNI configuration set aside"
                );
            }
        }
        Ok(pods)
    }
}

impl Parts<'_> {
    /// Network policy from the cluster's PolicyEndpoints, or its
    /// NetworkPolicies resolved here: the pods already
    /// on the node get their rules, then enforcement is on, and every ADD
    /// from now on writes the pod's rules before its endpoint.
    async fn enforce_policy(&mut self, settings: PolicySettings, pods: &Pods) -> Result<()> {
        let client = self
            .kube
            .clone()
            .context("network policy needs the API server")?;
        let event_log = settings.event_log.clone();
        // AWS's ClusterNetworkPolicy comes the way NetworkPolicy does.
        let (policies, cluster_policies) = match settings.source {
            Source::PolicyEndpoints => {
                let (policies, follow) = PolicyEndpoints::follow(client.clone());
                self.tasks.spawn(follow);
                let (cluster, follow) = ClusterPolicyEndpoints::follow(client.clone());
                self.tasks.spawn(follow);
                (
                    Policies::Endpoints(policies),
                    ClusterPolicies::Endpoints(cluster),
                )
            }
            Source::NetworkPolicies => {
                let (sources, follow) = NetworkPolicySources::follow(&client);
                self.tasks.spawn(follow);
                let (cluster, follow) = ClusterNetworkPolicies::follow(client.clone());
                self.tasks.spawn(follow);
                (
                    Policies::NetworkPolicies(sources),
                    ClusterPolicies::Resolved(cluster),
                )
            }
        };
        let existing = pods
            .attachments()
            .await?
            .into_iter()
            .map(|a| {
                let name = PodName {
                    namespace: a.metadata.k8s_pod_namespace,
                    name: a.metadata.k8s_pod_name,
                };
                (a.addr, name)
            })
            .collect();
        let (problems, unsent) = tokio::sync::broadcast::channel(policy::node::PROBLEMS_QUEUED);
        self.tasks
            .spawn(k8s::events::publish(client, self.k8s.clone(), unsent));
        let node = NodePolicy::start(
            settings,
            Arc::clone(&self.datapath),
            policies,
            cluster_policies,
            pods.cluster_pods().cloned(),
            existing,
            problems,
            self.aws_policy.is_some(),
        )
        .await?;
        pods.enforce_policy(node.clone());
        self.tasks.spawn(node.follow());
        if let Some(log) = event_log {
            let ring = self
                .datapath
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take_policy_events()
                .context("the policy event ring buffer")?;
            self.tasks.spawn(policy::events::write_events(ring, log));
        }
        Ok(())
    }
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

/// The node's sysctls, and with `--ipam` the primary ENI's MTU: aws-node
/// gives it the ENIs' MTU too.
async fn prepare_node(
    sysctls: &NodeSysctls,
    proc_sys_net: &Path,
    ipam: Option<&IpamSettings>,
    node: &NodeFacts,
    netlink: &NetlinkHandle,
) -> Result<()> {
    sysctls
        .apply(proc_sys_net, &node.primary_interface)
        .context("setting the node's sysctls")?;
    if let Some(settings) = ipam {
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
    Ok(())
}

/// Loads the datapath and brings it up on the primary ENI.
async fn start_datapath(
    pin_dir: &Path,
    args: &RunArgs,
    snat: &SnatSettings,
    node: &NodeFacts,
    cidr_classes: &CidrClasses,
    policy_flags: u32,
    netlink: &NetlinkHandle,
) -> Result<Datapath> {
    let mut datapath = Datapath::load(&LoadOptions {
        pin_dir: pin_dir.to_owned(),
        nat_entries: args.nat_entries,
        stack_flow_entries: args.stack_flow_entries,
        attach_mode: AttachMode::from_env()?,
    })
    .context("loading the datapath")?;
    info!(attach = ?datapath.attach_mode(), "datapath loaded");
    let plan = BringUp {
        primary_interface: &node.primary_interface,
        node_addr: node.node_addr,
        gateway: node.gateway,
        snat,
        cidr_classes,
        layout: args.layout.as_deref(),
        policy_flags,
    };
    bring_up(&mut datapath, netlink, &plan).await?;
    Ok(datapath)
}

/// The Kubernetes client, when the agent runs with an API server.
/// Never beside aws-node's ipamd: while it runs on the node nothing
/// changes, and the CNI socket answers the DaemonSet's probes with why
/// the agent is not ready.
async fn wait_for_ipamd(
    args: &RunArgs,
    kube: Option<&kube::Client>,
    node: Option<&str>,
) -> Result<()> {
    let now = takeover::ipamd::presence(kube, node).await;
    if now.gone() {
        return Ok(());
    }
    let (why, reason) = watch::channel(now.to_string());
    let listener = cni_server::bind(&args.cni_socket)?;
    let waiting = tokio::spawn(cni_waiting::serve(listener, reason));
    takeover::ipamd::wait_until_gone(kube, node, now, &why).await;
    waiting.abort();
    Ok(())
}

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

/// What the address manager follows of the cluster: the Node's cordon,
/// and with custom networking the node's ENIConfig, unless
/// `VPCNET_ENI_CONFIG_SUBNET` overrides it.
fn follow_for_manager(
    client: &kube::Client,
    views: &k8s::node::NodeViews,
    settings: &IpamSettings,
    tasks: &mut JoinSet<()>,
) -> (
    watch::Receiver<bool>,
    Option<watch::Receiver<Option<EniConfig>>>,
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
    let (configs, subscribed) = watch::channel(None);
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

/// SIGTERM (the kubelet's) and SIGINT, caught from their registration on.
struct StopSignals {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn register() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            terminate: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
        })
    }

    async fn received(mut self) {
        tokio::select! {
            _ = self.terminate.recv() => {}
            _ = self.interrupt.recv() => {}
        }
    }
}

/// Collects garbage until `stop` is received.
async fn collect_until_stopped(
    stop: StopSignals,
    pin_dir: &Path,
    gc_interval: Duration,
    report: &Arc<Mutex<CollectorReport>>,
) -> Result<()> {
    let collector = gc::Collector::start(pin_dir, gc_interval, report)?;
    stop.received().await;
    collector.stop().await;
    info!("stopping: programs stay attached and maps pinned for the next agent");
    Ok(())
}

/// New requests find no socket (the plugin says the agent is down); those
/// under way finish: an ADD cut short would leave the plugin to undo it.
/// Idle connections are not waited for.
async fn drain_cni(socket: &Path, in_flight: &cni_server::InFlight) {
    if let Err(e) = std::fs::remove_file(socket)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        warn!(socket = %socket.display(), error = %e, "removing the CNI socket");
    }
    if !in_flight.wait_idle(SHUTDOWN_GRACE).await {
        warn!(grace = ?SHUTDOWN_GRACE, "CNI requests still running at exit");
    }
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
