//! `cargo xtask lab`: the node in a box. `up` leaves it running, `down`
//! removes every trace, `status` shows it, and nothing at all runs the demo.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use vpcnet_lab::{
    AgentImage, CriLabOptions, Datapath, EnforcingMode, IpamLabOptions, IptablesBackend, Lab,
    LabOptions, LabState, Manifests, NamedPod, NodePortService, RandomizeSnat, WhoamiServer, addrs,
    icmp_echo, send_spoofed_udp, tcp_whoami, udp_whoami,
};

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    action: Option<Action>,
    /// Options of the demo, when no subcommand is given. (Boxed, as in
    /// the subcommands: the options are large next to other commands'.)
    #[command(flatten)]
    demo: Box<UpArgs>,
}

#[derive(Subcommand)]
enum Action {
    /// Bring the lab up and leave it running; returns when every pod is ready.
    Up(Box<UpArgs>),
    /// Remove every trace of the lab: agent, pins, namespaces, state.
    Down,
    /// Show the running lab.
    Status,
    /// Up, show what each path does, down (the default).
    Demo(Box<UpArgs>),
    /// Pods of the running lab: add, delete, label.
    #[command(subcommand)]
    Pod(PodAction),
    /// Namespaces of the running lab's cluster: label.
    #[command(subcommand)]
    Namespace(NamespaceAction),
}

#[derive(Subcommand)]
enum PodAction {
    /// Make a pod (through CRI, its Pod object bound to the node; its
    /// Namespace made if new).
    Add {
        #[arg(value_name = "NS/NAME[:KEY=VALUE,...]")]
        pod: NamedPod,
        /// The pod asks for a branch ENI (`vpc.amazonaws.com/pod-eni`,
        /// security groups for pods on the node).
        #[arg(long)]
        branch_eni: bool,
    },
    /// Delete a pod (its sandbox, then its object).
    Del {
        #[arg(value_name = "NS/NAME")]
        pod: String,
    },
    /// Change a pod's labels (`KEY=VALUE` sets, `KEY-` removes).
    Label {
        #[arg(value_name = "NS/NAME")]
        pod: String,
        #[arg(value_name = "KEY=VALUE[,KEY-,...]")]
        labels: String,
    },
}

#[derive(Subcommand)]
enum NamespaceAction {
    /// Change a namespace's labels (`KEY=VALUE` sets, `KEY-` removes).
    Label {
        namespace: String,
        #[arg(value_name = "KEY=VALUE[,KEY-,...]")]
        labels: String,
    },
}

#[derive(clap::Args, Clone)]
struct UpArgs {
    /// How many pods.
    #[arg(long, default_value_t = 2)]
    pods: usize,
    /// The node's datapath: ebpf (the agent), iptables (the VPC CNI's), or
    /// routed (no NAT, no rules: the benchmarks' ceiling).
    #[arg(long, default_value = "ebpf")]
    datapath: Datapath,
    /// No SNAT on the node (`AWS_VPC_K8S_CNI_EXTERNALSNAT=true`).
    #[arg(long)]
    external_snat: bool,
    /// Comma-separated CIDRs never source-NATed (`AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS`).
    #[arg(long, default_value = "")]
    exclude_snat_cidrs: String,
    /// SNAT port randomization: prng, hashrandom or none (`AWS_VPC_K8S_CNI_RANDOMIZESNAT`).
    #[arg(long, default_value = "prng")]
    randomize_snat: RandomizeSnat,
    /// Use this agent binary instead of building vpcnet-agent.
    #[arg(long)]
    agent_bin: Option<PathBuf>,
    /// Seconds the agent may take to print READY.
    #[arg(long, default_value_t = 30)]
    agent_ready_timeout: u64,
    /// How many ENIs the node has (1 to 3: eth0, eth1, eth2); pod i is on ENI i % N.
    #[arg(long, default_value_t = 1)]
    enis: usize,
    /// Comma-separated pod indices that get a branch ENI of their own
    /// (security groups for pods; a `vlan.eth.<id>` link each).
    #[arg(long, default_value = "")]
    branch_pods: String,
    /// Security groups for pods enforcing mode, node-wide: strict or standard
    /// (`POD_SECURITY_GROUP_ENFORCING_MODE`, the VPC CNI's default is strict).
    #[arg(long, default_value = "strict", value_parser = enforcing_mode)]
    sg_enforcing_mode: EnforcingMode,
    /// The iptables backend of the node's kubelet, kube-proxy and aws-node:
    /// legacy (Amazon Linux 2, Bottlerocket up to Kubernetes 1.33) or nft.
    #[arg(long, default_value_t = IptablesBackend::Nft)]
    iptables_backend: IptablesBackend,
    /// Run the agent as the DaemonSet's pod from this image archive,
    /// through the node's containerd, as kubelet runs it; without a path,
    /// the image `cargo xtask image` builds from the debug binaries.
    #[arg(long, value_name = "ARCHIVE")]
    #[allow(clippy::option_option)]
    agent_image: Option<Option<PathBuf>>,
    /// With --agent-image: render vpcnet's DaemonSet objects from the kustomization
    /// (`kubectl kustomize deploy/kubernetes`) or the chart (`helm template`).
    #[arg(long, default_value_t = Manifests::Kustomize, requires = "agent_image")]
    agent_manifests: Manifests,
    /// With --agent-image and no archive: build the image from the release
    /// profile's binaries (what ships) instead of the debug profile's.
    #[arg(long, requires = "agent_image")]
    release: bool,
    /// Put a NodePort-style service (10.20.11.162:30080, TCP and UDP,
    /// externalTrafficPolicy=Local) in front of this pod.
    #[arg(long, value_name = "POD")]
    node_port: Option<usize>,
    /// The port the --node-port pod listens on.
    #[arg(long, default_value_t = 8080, requires = "node_port")]
    node_port_target: u16,
    /// Scale: this many pods' worth of ip rules (512 and 1536 each, iptables
    /// datapath) before the lab's own pods, for addresses in 100.64.32.0/19.
    #[arg(long, default_value_t = 0)]
    filler_pods: usize,
    /// With the ebpf datapath, wire the pods from the lab's static layout
    /// instead of through containerd, the CNI plugin and the agent's
    /// address manager (implied by --enis, --branch-pods, --node-port and
    /// --filler-pods, which only the static layout has).
    #[arg(long)]
    static_pods: bool,
    /// The node's EC2 instance type (its ENI and address limits), for pods
    /// through containerd.
    #[arg(long, default_value = "m5.large")]
    instance_type: String,
    /// A pod by namespace and name, with labels, after the --pods ones
    /// (repeatable; pods through containerd only). Its Namespace is made
    /// if new.
    #[arg(long = "pod", value_name = "NS/NAME[:KEY=VALUE,...]")]
    named_pods: Vec<NamedPod>,
    /// A --pod that asks for a branch ENI (`vpc.amazonaws.com/pod-eni`):
    /// the lab's resource controller gives it one, security groups for
    /// pods on (repeatable).
    #[arg(long = "branch-eni-pod", value_name = "NS/NAME[:KEY=VALUE,...]")]
    branch_eni_pods: Vec<NamedPod>,
    /// Network policy enforced by the agent in this mode (`standard` or
    /// `strict`: `ENABLE_NETWORK_POLICY=true` and
    /// `NETWORK_POLICY_ENFORCING_MODE`); pods through containerd only.
    #[arg(long, value_name = "MODE", value_parser = ["standard", "strict"])]
    network_policy: Option<String>,
    /// With --network-policy, where the agent reads policy from:
    /// `policy-endpoints` (the lab's controller's, as on EKS) or
    /// `network-policies` (resolved by the agent; the lab then serves no
    /// PolicyEndpoint CRD).
    #[arg(
        long,
        default_value = "policy-endpoints",
        value_parser = ["policy-endpoints", "network-policies"],
        requires = "network_policy"
    )]
    policy_source: String,
}

impl UpArgs {
    /// Whether the pods come through containerd's CRI and the CNI plugin,
    /// with the agent's address manager against the EC2 emulator.
    fn through_cri(&self) -> bool {
        self.datapath == Datapath::Ebpf
            && !self.static_pods
            && self.enis == 1
            && self.branch_pods.is_empty()
            && self.node_port.is_none()
            && self.filler_pods == 0
    }
}

fn enforcing_mode(value: &str) -> Result<EnforcingMode, String> {
    vpcnet_lab::parse_enforcing_mode(value).map_err(|err| err.to_string())
}

pub fn run(args: &Args) -> Result<()> {
    match &args.action {
        Some(Action::Up(up_args)) => up(up_args),
        Some(Action::Down) => {
            vpcnet_lab::down_all().context("taking the lab down")?;
            println!("lab down: no vpcnet- namespace, agent or state is left");
            Ok(())
        }
        Some(Action::Status) => status(),
        Some(Action::Demo(demo_args)) => demo(demo_args),
        Some(Action::Pod(action)) => pod(action),
        Some(Action::Namespace(NamespaceAction::Label { namespace, labels })) => {
            let changes = vpcnet_lab::parse_label_changes(labels)?;
            Lab::open()
                .context("looking for the lab")?
                .label_namespace(namespace, &changes)
                .with_context(|| format!("labelling namespace {namespace}"))?;
            println!("namespace {namespace} labelled");
            Ok(())
        }
        None => demo(&args.demo),
    }
}

/// `lab pod ...` on the running lab.
fn pod(action: &PodAction) -> Result<()> {
    let mut lab = Lab::open().context("looking for the lab")?;
    match action {
        PodAction::Add { pod, branch_eni } => {
            let pod = NamedPod {
                branch_eni: *branch_eni,
                ..pod.clone()
            };
            let info = lab
                .add_pod(&pod)
                .with_context(|| format!("adding pod {}", pod.key()))?;
            println!(
                "pod {} running at {} (netns {})",
                pod.key(),
                info.addr,
                info.netns
            );
        }
        PodAction::Del { pod } => {
            lab.remove_pod(pod)
                .with_context(|| format!("deleting pod {pod}"))?;
            println!("pod {pod} deleted");
        }
        PodAction::Label { pod, labels } => {
            let changes = vpcnet_lab::parse_label_changes(labels)?;
            lab.label_pod(pod, &changes)
                .with_context(|| format!("labelling pod {pod}"))?;
            println!("pod {pod} labelled");
        }
    }
    Ok(())
}

fn options(args: &UpArgs) -> Result<LabOptions> {
    // The lab needs iproute2, nftables and iptables whatever the datapath.
    crate::setup::ensure(crate::setup::Scope::Lab)?;
    let mut opts = LabOptions {
        pods: args.pods,
        datapath: args.datapath,
        external_snat: args.external_snat,
        exclude_snat_cidrs: vpcnet_lab::parse_cidr_list(&args.exclude_snat_cidrs)?,
        randomize_snat: args.randomize_snat,
        agent_bin: None,
        agent_ready_timeout: Duration::from_secs(args.agent_ready_timeout),
        enis: args.enis,
        branch_pods: vpcnet_lab::parse_index_list(&args.branch_pods)?,
        sg_enforcing_mode: args.sg_enforcing_mode,
        node_port: args.node_port.map(|pod| NodePortService {
            pod,
            target_port: args.node_port_target,
        }),
        cluster_ips: Vec::new(),
        filler_pods: args.filler_pods,
        ipam: None,
        agent_env: Vec::new(),
        named_pods: args
            .named_pods
            .iter()
            .cloned()
            .chain(args.branch_eni_pods.iter().map(|pod| NamedPod {
                branch_eni: true,
                ..pod.clone()
            }))
            .collect(),
        iptables_backend: args.iptables_backend,
        agent_image: None,
    };
    // Refuse bad input, or a lab that exists already, before building the
    // agent (that takes a while); `Lab::up` checks it all again.
    opts.validate_settings()?;
    if vpcnet_lab::exists()? {
        bail!("a lab already exists; use it, or remove it first with `cargo xtask lab down`");
    }
    if opts.datapath == Datapath::Ebpf {
        let agent_bin = if let Some(path) = &args.agent_bin {
            path.clone()
        } else {
            let started = step("building vpcnet-agent");
            // Its build script builds the eBPF programs it embeds.
            let agent = crate::build::agent_binary(false).context("building the agent")?;
            took(started);
            agent
        };
        opts.agent_bin = Some(agent_bin);
    }
    if !opts.named_pods.is_empty() && !args.through_cri() {
        bail!(
            "--pod and --branch-eni-pod make pods through containerd: not with --datapath iptables/routed, --static-pods, --enis, --branch-pods, --node-port or --filler-pods"
        );
    }
    if args.agent_image.is_some() && !args.through_cri() {
        bail!(
            "--agent-image runs the agent as the DaemonSet's pod through containerd: not with --datapath iptables/routed, --static-pods, --enis, --branch-pods, --node-port or --filler-pods"
        );
    }
    if args.network_policy.is_some() && !args.through_cri() {
        bail!(
            "--network-policy needs the cluster's API server, which pods through containerd have: not with --datapath iptables/routed, --static-pods, --enis, --branch-pods, --node-port or --filler-pods"
        );
    }
    if args.through_cri() {
        let started = step("building vpcnet-cni, the EC2 emulator and the Kubernetes API server");
        let cni_plugin =
            crate::build::cni_plugin_binary(false).context("building the CNI plugin")?;
        crate::build::binary("vpcnet-lab", vpcnet_lab::ec2::EMULATOR_BIN, false)
            .context("building the EC2 emulator")?;
        crate::build::binary("vpcnet-lab", vpcnet_lab::kube::KUBE_API_BIN, false)
            .context("building the Kubernetes API server")?;
        took(started);
        let mut ipam = IpamLabOptions::new(&args.instance_type);
        ipam.cri = Some(CriLabOptions { cni_plugin });
        // The agent in-cluster, as on EKS.
        ipam.kube_api = true;
        if let Some(mode) = &args.network_policy {
            ipam.enforce_network_policy(mode, &args.policy_source);
        }
        opts.ipam = Some(ipam);
    }
    opts.agent_image = agent_image(args)?;
    opts.validate()?;
    Ok(opts)
}

/// The agent's image `--agent-image` names, or builds.
fn agent_image(args: &UpArgs) -> Result<Option<AgentImage>> {
    let Some(archive) = &args.agent_image else {
        return Ok(None);
    };
    let archive = if let Some(archive) = archive {
        crate::build::binary("vpcnet-lab", vpcnet_lab::agent_pod::KUBELET_BIN, false)
            .context("building the lab's kubelet")?;
        archive.clone()
    } else {
        let profile = if args.release { "release" } else { "debug" };
        let started = step(&format!(
            "building the image ({profile} binaries; `cargo xtask image`)"
        ));
        crate::build::binary("vpcnet-lab", vpcnet_lab::agent_pod::KUBELET_BIN, false)
            .context("building the lab's kubelet")?;
        let archive = crate::image::build(&crate::image::Args {
            release: args.release,
            arch: vec![crate::image::Arch::Amd64],
            out: None,
            bin_dir: None,
            commit: None,
            tag: None,
        })?;
        took(started);
        archive
    };
    Ok(Some(AgentImage {
        manifests: args.agent_manifests,
        ..AgentImage::new(archive)
    }))
}

/// Says that a step starts; [`took`] then says how long it took.
fn step(what: &str) -> Instant {
    println!("{what}...");
    Instant::now()
}

fn took(started: Instant) {
    println!("  done in {:.1} s", started.elapsed().as_secs_f64());
}

fn up(args: &UpArgs) -> Result<()> {
    let opts = options(args)?;
    let lab = Lab::up(&opts).context("bringing the lab up")?;
    let state = lab.leave_running();
    print_state(&state);
    println!("\nthe lab is running; `cargo xtask lab down` removes it");
    Ok(())
}

fn status() -> Result<()> {
    let lab = Lab::open().context("looking for the lab")?;
    print_state(lab.state());
    Ok(())
}

fn print_state(state: &LabState) {
    let opts = &state.options;
    if let Some(ipam) = &opts.ipam {
        println!(
            "pods through containerd's CRI (vpcnet-cni, then portmap) in {}; the agent's address manager on a {} of the lab's EC2 emulator",
            addrs::NS_NODE,
            ipam.instance_type
        );
        if ipam.kube_api {
            print_kube_api();
        }
    }
    println!(
        "lab: datapath {}, {} pod(s), {} ENI(s), external SNAT {}, randomize SNAT {}, SNAT exclusions [{}]",
        opts.datapath,
        opts.pods,
        opts.enis,
        opts.external_snat,
        opts.randomize_snat,
        opts.exclude_snat_cidrs_env()
    );
    println!(
        "  {:<16} {} on {}, gateway {}",
        addrs::NS_NODE,
        addrs::NODE_PRIMARY_ADDR,
        addrs::NODE_ETH0,
        addrs::NODE_SUBNET_GW
    );
    for device in 1..opts.enis {
        println!(
            "  {:<16} {} on {} (secondary ENI, route table {} in the iptables datapath)",
            "",
            addrs::eni_primary_addr(device),
            addrs::eni_ifname(device),
            addrs::eni_route_table(device)
        );
    }
    println!("  {:<16} {}", addrs::NS_PEER, addrs::PEER_ADDR);
    println!(
        "  {:<16} {} (behind the internet gateway)",
        addrs::NS_INET,
        addrs::INET_ADDR
    );
    println!(
        "  {:<16} {} (Direct Connect)",
        addrs::NS_ONPREM,
        addrs::ONPREM_ADDR
    );
    for pod in &state.pods {
        let branch = pod.branch.as_ref().map_or(String::new(), |branch| {
            format!(
                ", branch ENI {} (VLAN {}, {})",
                branch.mac,
                branch.vlan_id,
                branch.mode.env_value()
            )
        });
        match &pod.sandbox {
            Some(sandbox) => println!(
                "  {:<16} {} on {} (host veth {} in {}, sandbox {}){}",
                format!("{}/{}", pod.k8s_namespace, pod.k8s_name),
                pod.addr,
                pod.eni,
                pod.host_veth,
                addrs::NS_NODE,
                &sandbox[..sandbox.len().min(12)],
                labels_of(pod)
            ),
            None => println!(
                "  {:<16} {} on {}{branch} (host veth {} in {})",
                pod.netns,
                pod.addr,
                pod.eni,
                pod.host_veth,
                addrs::NS_NODE
            ),
        }
    }
    if let Some(service) = &opts.node_port {
        let backend = &state.pods[service.pod];
        println!(
            "  node port        {}:{} (TCP, UDP) -> {}:{} (externalTrafficPolicy=Local)",
            addrs::NODE_PRIMARY_ADDR,
            addrs::NODE_PORT,
            backend.addr,
            service.target_port
        );
    }
    if let Some(agent) = &state.agent {
        println!(
            "  agent pid {} ({}), log {}",
            agent.pid,
            agent.bin.display(),
            agent.log.display()
        );
    }
}

/// ` labels k=v,...`, or nothing for a pod without labels.
fn labels_of(pod: &vpcnet_lab::PodInfo) -> String {
    if pod.labels.is_empty() {
        return String::new();
    }
    let labels: Vec<String> = pod.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!(" labels {}", labels.join(","))
}

const PROBE_PORT: u16 = 8080;
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Up, then from pod-0 to every far end over TCP, UDP and ICMP, printing
/// what each far end saw; then the router's two checks; then down.
fn demo(args: &UpArgs) -> Result<()> {
    let opts = options(args)?;
    if opts.pods == 0 {
        bail!("the demo needs at least one pod");
    }
    let started = step(&format!(
        "bringing the lab up ({} datapath, {} pods)",
        opts.datapath, opts.pods
    ));
    // One lab user at a time on this machine (tests take the same lock).
    let _lab_lock = vpcnet_lab::serial();
    // Dropped at the end, on error or on panic: the lab goes with it.
    let lab = Lab::up(&opts).context("bringing the lab up")?;
    took(started);
    print_state(lab.state());
    print_cluster(&lab);

    let far_ends = [
        ("peer (same VPC)", addrs::NS_PEER, addrs::PEER_ADDR),
        (
            "onprem (Direct Connect)",
            addrs::NS_ONPREM,
            addrs::ONPREM_ADDR,
        ),
        ("inet (internet gateway)", addrs::NS_INET, addrs::INET_ADDR),
    ];
    let servers = far_ends
        .iter()
        .map(|(_, ns, addr)| WhoamiServer::start(ns, SocketAddrV4::new(*addr, PROBE_PORT)))
        .collect::<Result<Vec<_>, _>>()
        .context("starting the far ends' whoami servers")?;

    let pod = lab.pod(0).clone();
    print_pod_to_pod(&lab)?;
    println!(
        "\nfrom {} ({}), what each far end sees as the source:",
        pod.k8s_name, pod.addr
    );
    for ((label, _, addr), server) in far_ends.iter().zip(&servers) {
        let target = SocketAddrV4::new(*addr, PROBE_PORT);
        let tcp = tcp_whoami(&pod.netns, target, PROBE_TIMEOUT);
        let udp = udp_whoami(&pod.netns, target, PROBE_TIMEOUT);
        server.clear();
        let icmp = icmp_echo(&pod.netns, *addr, PROBE_TIMEOUT);
        let icmp_seen = server
            .wait_for(Duration::from_millis(200), |o| {
                o.proto == vpcnet_lab::Proto::Icmp
            })
            .map(|o| *o.source.ip());
        println!("  -> {label:<26} {addr}");
        println!(
            "       tcp:  {}",
            describe(tcp.map(|seen| seen.map(|s| s.to_string())))
        );
        println!(
            "       udp:  {}",
            describe(udp.map(|seen| seen.map(|s| s.to_string())))
        );
        let icmp_text = match (icmp, icmp_seen) {
            (Ok(Some(_)), Some(seen)) => format!("request seen from {seen}, reply delivered"),
            (Ok(None), Some(seen)) => format!("request seen from {seen}, no reply came back"),
            (Ok(_), None) => "dropped on the way".to_owned(),
            (Err(err), _) => format!("error: {err}"),
        };
        println!("       icmp: {icmp_text}");
    }
    drop(servers);

    println!("\nthe VPC router's checks:");
    let before = lab.srcdst_check_drops()?;
    let spoofed = Ipv4Addr::new(10, 20, 11, 99);
    send_spoofed_udp(
        addrs::NS_NODE,
        SocketAddrV4::new(spoofed, 4000),
        SocketAddrV4::new(addrs::PEER_ADDR, PROBE_PORT),
        b"spoofed",
    )?;
    println!(
        "  source/destination check: node sent from {spoofed} (not its ENI's) -> drops {before} -> {}",
        lab.srcdst_check_drops()?
    );
    let before = lab.igw_drops()?;
    let peer_to_inet = udp_whoami(
        addrs::NS_PEER,
        SocketAddrV4::new(addrs::INET_ADDR, PROBE_PORT),
        Duration::from_millis(500),
    )?;
    println!(
        "  internet gateway: peer ({}, no public IP) -> inet: {} -> drops {before} -> {}",
        addrs::PEER_ADDR,
        if peer_to_inet.is_some() {
            "passed (unexpected)"
        } else {
            "dropped"
        },
        lab.igw_drops()?
    );

    if let Some(agent) = &opts.agent_bin {
        print_datapath(&lab, agent, opts.ipam.is_some())?;
    }

    println!("\ntaking the lab down...");
    lab.down().context("taking the lab down")?;
    println!("done");
    Ok(())
}

/// From the first pod to the second, when there are two: what the second
/// saw.
fn print_pod_to_pod(lab: &Lab) -> Result<()> {
    let [from, to, ..] = lab.pods() else {
        return Ok(());
    };
    let server = WhoamiServer::start(&to.netns, SocketAddrV4::new(to.addr, PROBE_PORT))
        .context("starting a whoami server in the second pod")?;
    let tcp = tcp_whoami(&from.netns, server.addr(), PROBE_TIMEOUT);
    println!(
        "\n{} ({}) -> {} ({}), pod to pod on the node:\n       tcp:  {}",
        from.k8s_name,
        from.addr,
        to.k8s_name,
        to.addr,
        describe(tcp.map(|seen| seen.map(|s| s.to_string())))
    );
    Ok(())
}

/// What the eBPF datapath did: its NAT table and counters, read from the
/// pinned maps by the agent's own CLI, as an operator on the node would.
fn print_datapath(lab: &Lab, agent: &std::path::Path, ipam: bool) -> Result<()> {
    let agent = agent.to_string_lossy();
    let socket = vpcnet_lab::cni_socket_file().display().to_string();
    let mut views = vec![
        ("NAT table (vpcnet-agent nat)", vec!["nat"]),
        (
            "datapath counters (vpcnet-agent counters)",
            vec!["counters"],
        ),
    ];
    if ipam {
        views.insert(0, ("pods (vpcnet-agent pods)", vec!["pods"]));
        views.insert(1, ("ENIs (vpcnet-agent enis)", vec!["enis"]));
        views.push((
            "address pool (vpcnet-agent ipam)",
            vec!["ipam", "--cni-socket", socket.as_str()],
        ));
    }
    for (title, args) in views {
        let argv: Vec<&str> = std::iter::once(agent.as_ref())
            .chain(args.iter().copied())
            .collect();
        let out = lab
            .exec_ok(addrs::NS_NODE, &argv)
            .with_context(|| format!("running {}", argv.join(" ")))?;
        println!("\n{title}:");
        for line in out.lines() {
            println!("  {line}");
        }
    }
    Ok(())
}

fn describe(outcome: vpcnet_lab::Result<Option<String>>) -> String {
    match outcome {
        Ok(Some(seen)) => format!("seen as {seen}, reply delivered"),
        Ok(None) => "no reply (dropped on the way)".to_owned(),
        Err(err) => format!("error: {err}"),
    }
}

/// The cluster as kubectl sees it from the node: the node and its pods.
fn print_cluster(lab: &Lab) {
    let Some(kube_api) = lab.kube_api() else {
        return;
    };
    let kubeconfig = kube_api.files().admin_kubeconfig();
    let kubectl = vpcnet_lab::exec_ok(
        addrs::NS_NODE,
        &[
            vpcnet_lab::kube_tools::KUBECTL,
            "--kubeconfig",
            &kubeconfig.display().to_string(),
            "--request-timeout=20s",
            "get",
            "nodes,pods",
            "-A",
        ],
    );
    match kubectl {
        Ok(out) => print!("\n{out}"),
        Err(err) => println!("kubectl: {err}"),
    }
}

fn print_kube_api() {
    println!(
        "the cluster's API server at {} (kubectl --kubeconfig {}); the agent in-cluster as node {}",
        vpcnet_lab::kube::kube_api_url(),
        vpcnet_lab::kube::KubeApiOptions::default()
            .files()
            .admin_kubeconfig()
            .display(),
        vpcnet_lab::cluster::node_name()
    );
}
