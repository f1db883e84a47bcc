//! The lab as a whole: bring it up, use it, take it down
//! ([`teardown`]); one user at a time ([`lock`]).

mod lock;
mod teardown;

use std::{
    fs,
    io::ErrorKind,
    path::Path,
    process::{Child, Output},
    time::Instant,
};

pub use lock::{LabLock, serial};
pub use teardown::down_all;
use teardown::{Processes, teardown};
use tracing::{info, warn};

use crate::{
    addrs::NS_NODE,
    agent, agent_pod, cluster,
    cri::{self, Containerd, CriClient},
    cri_pods,
    ec2::{EmulatorOptions, EmulatorProcess},
    error::{Context, LabError, Result},
    kube::{KubeAdmin, KubeApiOptions, KubeApiProcess},
    kube_proxy, layout,
    netns::{self, lab_namespaces},
    options::{AgentImage, Datapath, LabOptions, NamedPod},
    router,
    state::{self, LabState, PodInfo, state_dir},
    topology,
};

/// A lab that exists. Unless [`Lab::leave_running`] is called, dropping it
/// tears it down (the guard tests rely on); [`Lab::open`] attaches to a lab
/// some other process left running, and dropping that one leaves it alone.
#[derive(Debug)]
pub struct Lab {
    state: LabState,
    /// The agent, when this process started it.
    agent: Option<Child>,
    /// The EC2 emulator of an address-manager lab (killed when dropped).
    emulator: Option<EmulatorProcess>,
    /// The container runtime of a lab whose pods come through CRI.
    containerd: Option<Containerd>,
    /// The Kubernetes API server of a lab with one (killed when dropped).
    kube_api: Option<KubeApiProcess>,
    /// The lab's kubelet, keeping the agent's pod (an agent image lab).
    kubelet: Option<Child>,
    teardown_on_drop: bool,
}

impl Lab {
    /// Builds the lab and returns once every pod is ready (and, for the
    /// eBPF datapath, the agent has said `READY`). Refuses if a lab (or any
    /// `vpcnet-` namespace) already exists, leaving it as it is; if building
    /// fails midway, removes what it built.
    pub fn up(opts: &LabOptions) -> Result<Self> {
        opts.validate()?;
        if !nix::unistd::geteuid().is_root() {
            return Err(LabError::NotRoot);
        }
        claim()?;
        // From here on everything named vpcnet- is this lab's: on failure
        // remove all of it.
        let started = Instant::now();
        let mut lab = Self {
            state: LabState {
                options: opts.clone(),
                pods: Vec::new(),
                namespaces: Vec::new(),
                agent: None,
                ready: false,
            },
            agent: None,
            emulator: None,
            containerd: None,
            kube_api: None,
            kubelet: None,
            teardown_on_drop: true,
        };
        match lab.build() {
            Ok(()) => {
                info!(
                    pods = opts.pods,
                    datapath = %opts.datapath,
                    elapsed = ?started.elapsed(),
                    "the lab is up"
                );
                Ok(lab)
            }
            Err(err) => {
                warn!(%err, "building the lab failed; removing what was built");
                lab.teardown_on_drop = false;
                if let Err(teardown_err) = teardown(lab.take_processes()) {
                    warn!(%teardown_err, "removing the half-built lab failed too");
                }
                Err(err)
            }
        }
    }

    fn build(&mut self) -> Result<()> {
        let opts = self.state.options.clone();
        // Pods through the runtime come after the agent; static ones now.
        let static_pods = if opts.cri().is_some() { 0 } else { opts.pods };
        self.state.pods = (0..static_pods)
            .map(|index| PodInfo::in_lab(index, &opts))
            .collect::<Result<_>>()?;
        self.state.namespaces = topology::namespaces(&self.state.pods);
        // Recorded first, so `down` knows what may exist even if this fails.
        self.state.save()?;
        fs::create_dir_all(state::aws_node_run_dir())
            .context(|| "creating the node's aws-node directory".to_owned())?;
        netns::create_namespaces(&self.state.namespaces)?;
        topology::build_network(&opts)?;
        topology::build_branch_enis(&self.state.pods)?;
        topology::wire_pods(&self.state.pods, opts.datapath)?;
        topology::wait_ready(&self.state.pods, opts.enis)?;
        kube_proxy::install(&opts, &self.state.pods)?;
        // Written for both datapaths (the eBPF agent reads it; for the
        // iptables reference it documents what was built).
        let layout = layout::write(&opts, &self.state.pods)?;
        info!(path = %layout.display(), "wrote the node layout");
        if let Some(ipam) = &opts.ipam {
            let emulator = EmulatorProcess::start(&EmulatorOptions {
                instance_type: ipam.instance_type.clone(),
                ..EmulatorOptions::default()
            })
            .map_err(|err| LabError::InvalidOption(format!("starting the EC2 emulator: {err}")))?;
            fs::write(state::emulator_pid_file(), format!("{}\n", emulator.pid()))
                .context(|| "writing the EC2 emulator's pid file".to_owned())?;
            if opts.datapath == Datapath::Iptables {
                crate::vpc_cni::record_aws_node_state(&emulator, &self.state.pods)?;
            }
            if ipam.kube_api {
                let kube_api = KubeApiProcess::start(&KubeApiOptions {
                    uninstalled: ipam.uninstalled_crds.clone(),
                    ..KubeApiOptions::default()
                })
                .map_err(|err| {
                    LabError::InvalidOption(format!("starting the Kubernetes API server: {err}"))
                })?;
                fs::write(state::kube_api_pid_file(), format!("{}\n", kube_api.pid()))
                    .context(|| "writing the Kubernetes API server's pid file".to_owned())?;
                self.kube_api = Some(kube_api);
                let kube_api = self.kube_api.as_ref().expect("just set");
                cluster::bootstrap(
                    kube_api.admin(),
                    kube_api.files(),
                    &ipam.instance_type,
                    emulator.instance_id(),
                )?;
                cluster::make_service_account_mount()?;
                if !ipam.resource_controller_held {
                    start_resource_controller(&emulator, kube_api)?;
                }
                // Pods wired before the agent (aws-node's) run already.
                for pod in &self.state.pods {
                    cluster::bind_pod(kube_api.admin(), &pod.k8s_name)?;
                    cluster::pod_running(kube_api.admin(), &pod.k8s_name, pod.addr)?;
                }
            }
            self.emulator = Some(emulator);
        }
        if let Some(image) = &opts.agent_image {
            self.start_node_kubelet(&opts, image)?;
        } else if opts.datapath == Datapath::Ebpf {
            let (child, info) = agent::start(&opts)?;
            self.agent = Some(child);
            self.state.agent = Some(info);
            self.state.save()?;
        }
        if let Some(cri) = opts.cri() {
            if self.containerd.is_none() {
                self.containerd = Some(cri_pods::start_containerd(
                    &cri.cni_plugin,
                    opts.sg_enforcing_mode,
                )?);
            }
            let client = self.containerd.as_ref().expect("just set").client()?;
            for index in 0..opts.pods {
                // kubelet runs what the API server bound to its node.
                if let Some(kube_api) = &self.kube_api {
                    cluster::bind_pod(kube_api.admin(), &crate::addrs::pod_name(index))?;
                }
                let pod = cri_pods::run_pod(&client, index, &cri_pods::pod_spec(index))?;
                if let Some(kube_api) = &self.kube_api {
                    cluster::pod_running(kube_api.admin(), &pod.k8s_name, pod.addr)?;
                }
                info!(pod = %pod.k8s_name, addr = %pod.addr, eni = %pod.eni, "pod running");
                self.state.pods.push(pod);
                self.state.save()?;
            }
            if !opts.named_pods.is_empty() {
                let admin = self.kube_admin()?;
                for (offset, named) in opts.named_pods.iter().enumerate() {
                    let pod = run_named_pod(&client, &admin, opts.pods + offset, named)?;
                    self.state.pods.push(pod);
                    self.state.save()?;
                }
            }
        }
        self.state.ready = true;
        self.state.save()
    }

    /// The agent as the DaemonSet's pod: the node's containerd with the
    /// node's directories, the image imported, vpcnet's two DaemonSet objects and
    /// ConfigMap applied to the API server, the node labelled for vpcnet
    /// if the lab's datapath is vpcnet's (an iptables node stays aws-node's
    /// until a test moves it), and the lab's kubelet running the node's
    /// pods until they are ready.
    fn start_node_kubelet(&mut self, opts: &LabOptions, image: &AgentImage) -> Result<()> {
        let rendered = agent_pod::render(image)?;
        let containerd = agent_pod::start_containerd(&rendered.agent)?;
        self.containerd = Some(containerd);
        let containerd = self.containerd.as_ref().expect("just set");
        let kube_api = self.kube_api.as_ref().ok_or_else(|| {
            LabError::InvalidOption("the agent's pod needs the lab's API server".into())
        })?;
        let name = agent_pod::import_image(containerd, &image.archive)?;
        agent_pod::apply(
            kube_api.files(),
            &rendered,
            &name,
            &agent::configured_env(opts),
        )?;
        if opts.datapath == Datapath::Ebpf {
            agent_pod::label_node(kube_api.files(), Some(agent_pod::ON_VPCNET))?;
        }
        self.kubelet = Some(agent_pod::start_kubelet(
            containerd,
            &rendered,
            kube_api.files(),
            kube_api.admin().socket(),
        )?);
        Ok(())
    }

    /// A rolling update of vpcnet's DaemonSet objects to `image` (imported, its
    /// manifests rendered and applied): the lab's kubelet deletes the
    /// node's pod and makes the new one. Returns once the node runs a
    /// ready pod of the new image.
    pub fn roll_agent_image(&self, image: &AgentImage) -> Result<()> {
        let (Some(containerd), Some(kube_api)) = (&self.containerd, &self.kube_api) else {
            return Err(LabError::InvalidOption(
                "a rolling update needs a lab whose agent runs from an image (--agent-image)"
                    .into(),
            ));
        };
        let rendered = agent_pod::render(image)?;
        let name = agent_pod::import_image(containerd, &image.archive)?;
        if let Ok(running) = agent_pod::agent_status()
            && running.containers.iter().all(|c| c.image == name)
        {
            // The same tag is the same template: nothing would roll.
            return Err(LabError::InvalidOption(format!(
                "the node runs {name} already: a rolling update needs an image of another tag (`cargo xtask image --tag`)"
            )));
        }
        agent_pod::apply(
            kube_api.files(),
            &rendered,
            &name,
            &agent::configured_env(&self.state.options),
        )?;
        agent_pod::wait_for(
            &format!("vpcnet's pod from {name}, ready"),
            agent_pod::READY_TIMEOUT,
            |pods| {
                pods.of(agent_pod::AGENT_DAEMON_SET)
                    .is_some_and(|pod| pod.ready && pod.containers.iter().all(|c| c.image == name))
            },
        )
        .map(drop)
    }

    /// `kubectl label node` with `vpcnet.dev/cni=<value>` (`None` removes
    /// it), as the guide moves a node.
    pub fn label_node(&self, value: Option<&str>) -> Result<()> {
        let kube_api = self.kube_api.as_ref().ok_or_else(|| {
            LabError::InvalidOption("labelling the node needs the lab's API server".into())
        })?;
        agent_pod::label_node(kube_api.files(), value)
    }

    fn take_processes(&mut self) -> Processes {
        Processes {
            kubelet: self.kubelet.take(),
            agent: self.agent.take(),
            emulator: self.emulator.take(),
            containerd: self.containerd.take(),
            kube_api: self.kube_api.take(),
        }
    }

    /// Gives the node a branch ENI (security groups for pods) that owns
    /// `addr`, as the VPC resource controller makes one: on the node's
    /// trunk ENI (attached first if it has none), on the lowest free VLAN
    /// id. The router's side of it follows from EC2's state, and so does
    /// the node's where the kernel has no 802.1Q (elsewhere the node makes
    /// its `vlan.eth.<id>`, as on EKS). Needs the EC2 emulator. Returns the
    /// `vpc.amazonaws.com/pod-eni` annotation a pod on it carries.
    pub fn add_branch_eni(&self, addr: std::net::Ipv4Addr) -> Result<String> {
        let emulator = self.emulator.as_ref().ok_or_else(|| {
            LabError::InvalidOption("a branch ENI needs the lab's EC2 emulator (--enis)".into())
        })?;
        let branch = emulator
            .admin()
            .branch_eni(Some(addr))
            .map_err(|err| LabError::InvalidOption(format!("a branch ENI at {addr}: {err}")))?;
        Ok(serde_json::to_string(&[branch]).expect("serializable"))
    }

    /// Starts the VPC resource controller of a lab that held it
    /// ([`crate::IpamLabOptions::resource_controller_held`]).
    pub fn start_resource_controller(&self) -> Result<()> {
        let (Some(emulator), Some(kube_api)) = (&self.emulator, &self.kube_api) else {
            return Err(LabError::InvalidOption(
                "the resource controller needs the EC2 emulator and the API server".into(),
            ));
        };
        start_resource_controller(emulator, kube_api)
    }

    /// A Service of type `NodePort` in front of `backend` (a pod made
    /// through CRI, say) on `target_port`: kube-proxy's sync of the node's
    /// rules, the lab's other services kept.
    pub fn add_node_port(&mut self, backend: &PodInfo, target_port: u16) -> Result<()> {
        self.state.options.node_port = Some(crate::options::NodePortService {
            pod: backend.index,
            target_port,
        });
        let mut pods = self.state.pods.clone();
        pods.retain(|pod| pod.index != backend.index);
        pods.push(backend.clone());
        kube_proxy::sync(&self.state.options, &pods)?;
        self.state.save()
    }

    /// The lab's own client of its API server (this process's, or that of
    /// a lab left running).
    pub fn kube_admin(&self) -> Result<KubeAdmin> {
        if let Some(kube_api) = &self.kube_api {
            return Ok(kube_api.admin().clone());
        }
        if self.state.options.kube_api() {
            return Ok(KubeAdmin::new(KubeApiOptions::default().admin_socket()));
        }
        Err(LabError::InvalidOption(
            "the lab has no Kubernetes API server".into(),
        ))
    }

    /// The pod `NS/NAME` (a numbered pod is `default/pod-N`).
    pub fn pod_named(&self, key: &str) -> Result<&PodInfo> {
        self.state
            .pod_named(key)
            .ok_or_else(|| LabError::InvalidOption(format!("the lab has no pod {key}")))
    }

    /// Makes a pod as kubelet does once the scheduler bound it to the
    /// node: its Pod object (and Namespace), its sandbox through CRI, its
    /// address reported. Returns it, recorded in the lab's state.
    pub fn add_pod(&mut self, pod: &NamedPod) -> Result<PodInfo> {
        if self.state.pod_named(&pod.key()).is_some() {
            return Err(LabError::InvalidOption(format!(
                "pod {} exists already",
                pod.key()
            )));
        }
        if self.state.options.cri().is_none() {
            return Err(LabError::InvalidOption(
                "pods are added through CRI: the lab has no container runtime".into(),
            ));
        }
        if pod.branch_eni && !agent::pod_eni(&self.state.options) {
            return Err(LabError::InvalidOption(format!(
                "pod {}: a branch ENI needs security groups for pods on the node (`lab up` with a --branch-eni-pod, or ENABLE_POD_ENI=true)",
                pod.key()
            )));
        }
        let admin = self.kube_admin()?;
        let index = self
            .state
            .pods
            .iter()
            .map(|p| p.index + 1)
            .max()
            .unwrap_or(0);
        let info = run_named_pod(&self.cri()?, &admin, index, pod)?;
        self.state.pods.push(info.clone());
        self.state.save()?;
        Ok(info)
    }

    /// Removes pod `NS/NAME` as kubelet does when it is deleted: its
    /// sandbox stopped and removed (CNI DEL), then its object.
    pub fn remove_pod(&mut self, key: &str) -> Result<()> {
        let pod = self.pod_named(key)?.clone();
        let sandbox = pod.sandbox.as_deref().ok_or_else(|| {
            LabError::InvalidOption(format!("pod {key} was not made through CRI"))
        })?;
        cri_pods::remove_pod(&self.cri()?, sandbox)?;
        if let Ok(admin) = self.kube_admin() {
            cluster::delete_pod(&admin, &pod.k8s_namespace, &pod.k8s_name)?;
        }
        self.state.pods.retain(|p| p.index != pod.index);
        info!(pod = key, "pod removed");
        self.state.save()
    }

    /// Changes pod `NS/NAME`'s labels (`None` removes one): an update of
    /// its Pod object, which watchers see.
    pub fn label_pod(&mut self, key: &str, changes: &[(String, Option<String>)]) -> Result<()> {
        let (namespace, name) = crate::options::parse_pod_key(key)?;
        self.pod_named(key)?;
        cluster::label_pod(&self.kube_admin()?, &namespace, &name, changes)?;
        let pod = self
            .state
            .pods
            .iter_mut()
            .find(|p| p.k8s_namespace == namespace && p.k8s_name == name)
            .expect("found above");
        for (label, value) in changes {
            match value {
                Some(value) => pod.labels.insert(label.clone(), value.clone()),
                None => pod.labels.remove(label),
            };
        }
        self.state.save()
    }

    /// Changes Namespace `namespace`'s labels (`None` removes one).
    pub fn label_namespace(
        &self,
        namespace: &str,
        changes: &[(String, Option<String>)],
    ) -> Result<()> {
        cluster::label_namespace(&self.kube_admin()?, namespace, changes)
    }

    /// A client of the lab's container runtime (CRI).
    pub fn cri(&self) -> Result<CriClient> {
        Ok(CriClient::connect(cri::CONTAINERD_SOCKET)?)
    }

    /// Attaches to the lab that is running (brought up by this or another
    /// process). Dropping the result leaves the lab running.
    pub fn open() -> Result<Self> {
        let state = LabState::load()?;
        Ok(Self {
            state,
            agent: None,
            emulator: None,
            containerd: None,
            kube_api: None,
            kubelet: None,
            teardown_on_drop: false,
        })
    }

    /// Lets the lab outlive this value (and this process): `cargo xtask lab
    /// up` does this. Returns what was built.
    pub fn leave_running(mut self) -> LabState {
        self.teardown_on_drop = false;
        // The agent keeps running; its handle is simply forgotten (it is in
        // its own process group and is stopped through its pid file).
        drop(self.agent.take());
        drop(self.kubelet.take());
        // The emulator and containerd too: `lab down` finds them through
        // their pid files.
        if let Some(emulator) = self.emulator.take() {
            emulator.leave_running();
        }
        if let Some(kube_api) = self.kube_api.take() {
            kube_api.leave_running();
        }
        if let Some(containerd) = self.containerd.take() {
            containerd.leave_running();
        }
        self.state.clone()
    }

    /// Tears the lab down: the agent, its pins, every `vpcnet-` namespace,
    /// the state directory.
    pub fn down(mut self) -> Result<()> {
        self.teardown_on_drop = false;
        teardown(self.take_processes())
    }

    /// The Kubernetes API server, in a lab with one this process started.
    pub fn kube_api(&self) -> Option<&KubeApiProcess> {
        self.kube_api.as_ref()
    }

    /// The EC2 emulator, in an address-manager lab this process started.
    pub fn emulator(&self) -> Option<&EmulatorProcess> {
        self.emulator.as_ref()
    }

    /// Kills the agent with SIGKILL (a crash: no clean-up of its own) and
    /// waits for it to be gone.
    pub fn kill_agent(&mut self) -> Result<()> {
        if let Some(mut child) = self.agent.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.state.agent = None;
        self.state.save()
    }

    /// Stops the agent as the kubelet would (SIGTERM, then SIGKILL).
    pub fn stop_agent(&mut self) -> Result<()> {
        if let Some(info) = self.state.agent.take() {
            agent::stop(&info, self.agent.as_mut())?;
        }
        self.agent = None;
        self.state.save()
    }

    /// Starts the agent again (after [`Lab::kill_agent`] or
    /// [`Lab::stop_agent`]) and waits for its `READY`.
    pub fn start_agent(&mut self) -> Result<()> {
        let (child, info) = agent::start(&self.state.options)?;
        self.agent = Some(child);
        self.state.agent = Some(info);
        self.state.save()
    }

    /// Sets one of the agent's environment variables for its next start
    /// (what an operator's ConfigMap change does).
    pub fn set_agent_env(&mut self, name: &str, value: &str) -> Result<()> {
        let env = &mut self.state.options.agent_env;
        env.retain(|(k, _)| k != name);
        env.push((name.to_owned(), value.to_owned()));
        self.state.save()
    }

    /// Replaces the agent and the CNI plugin with other builds, as a
    /// rolling update does: the running agent is stopped
    /// (SIGTERM, then SIGKILL), the plugin swapped where the runtime finds
    /// it, the other agent started and awaited.
    pub fn replace_agent(&mut self, agent_bin: &Path, cni_plugin: &Path) -> Result<()> {
        self.stop_agent()?;
        self.state.options.agent_bin = Some(agent_bin.to_owned());
        if let Some(cri) = self
            .state
            .options
            .ipam
            .as_mut()
            .and_then(|ipam| ipam.cri.as_mut())
        {
            cni_plugin.clone_into(&mut cri.cni_plugin);
            cri::link_cni_plugins(&cri_pods::cni_bin_dir(), &[cni_plugin])?;
        }
        self.start_agent()
    }

    /// What was built.
    pub fn state(&self) -> &LabState {
        &self.state
    }

    /// The options the lab was built with.
    pub fn options(&self) -> &LabOptions {
        &self.state.options
    }

    /// The pods.
    pub fn pods(&self) -> &[PodInfo] {
        &self.state.pods
    }

    /// Pod `index`.
    pub fn pod(&self, index: usize) -> &PodInfo {
        &self.state.pods[index]
    }

    /// The pods whose address belongs to the ENI (or branch ENI) with
    /// interface `eni` in the node (`eth1`, `vlan.eth.1`).
    pub fn pods_on<'a>(&'a self, eni: &'a str) -> impl Iterator<Item = &'a PodInfo> + 'a {
        self.state.pods.iter().filter(move |pod| pod.eni == eni)
    }

    /// `ip rule show` in the node, one rule a line.
    pub fn ip_rules(&self) -> Result<Vec<String>> {
        Ok(netns::exec_ok(NS_NODE, &["ip", "-4", "rule", "show"])?
            .lines()
            .map(str::to_owned)
            .collect())
    }

    /// The node's `ip rule`s that belong to `pod`: those that name its
    /// address or its host veth (rules 512 and 1536, and strict mode's
    /// `iif <host veth>`); a strict pod's `iif vlan.eth.<id>` rule names its
    /// branch link, which is its own too.
    pub fn pod_ip_rules(&self, pod: &PodInfo) -> Result<Vec<String>> {
        let addr = format!(" {} ", pod.addr);
        let iifs: Vec<String> = std::iter::once(&pod.host_veth)
            .chain(pod.branch.as_ref().map(|branch| &branch.link))
            .map(|link| format!("iif {link} "))
            .collect();
        Ok(self
            .ip_rules()?
            .into_iter()
            .filter(|rule| {
                let spaced = format!("{} ", rule.replace('\t', " "));
                spaced.contains(&addr) || iifs.iter().any(|iif| spaced.contains(iif.as_str()))
            })
            .collect())
    }

    /// Runs `argv` in namespace `ns`; its output whatever its exit status.
    pub fn exec(&self, ns: &str, argv: &[&str]) -> Result<Output> {
        netns::exec(ns, argv)
    }

    /// Runs `argv` in namespace `ns`; its standard output, or an error with
    /// its standard error if it failed.
    pub fn exec_ok(&self, ns: &str, argv: &[&str]) -> Result<String> {
        netns::exec_ok(ns, argv)
    }

    /// Packets the VPC router's source/destination check dropped.
    pub fn srcdst_check_drops(&self) -> Result<u64> {
        router::read_counter(router::SRCDST_CHECK_DROPS)
    }

    /// Packets the internet gateway refused to pass to `inet` (their source
    /// was not a node's primary address).
    pub fn igw_drops(&self) -> Result<u64> {
        router::read_counter(router::IGW_EGRESS_DROPS)
    }

    /// Packets from `inet` the internet gateway dropped (destination without
    /// a public IP).
    pub fn igw_ingress_drops(&self) -> Result<u64> {
        router::read_counter(router::IGW_INGRESS_DROPS)
    }

    /// Packets the VPC router received from the node on `vpc_link` (the
    /// router's side of an ENI: [`crate::addrs::vpc_eni_link`], or a branch
    /// ENI's `vpc_link`): what left the node by that ENI.
    pub fn packets_from(&self, vpc_link: &str) -> Result<u64> {
        router::link_rx_packets(vpc_link)
    }

    /// The agent's log file (eBPF datapath).
    pub fn agent_log(&self) -> Option<&Path> {
        self.state.agent.as_ref().map(|agent| agent.log.as_path())
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if self.teardown_on_drop
            && let Err(err) = teardown(self.take_processes())
        {
            warn!(%err, "tearing the lab down on drop failed; run `cargo xtask lab down`");
        }
    }
}

/// A named pod as kubelet makes it: bound (its Namespace made if new),
/// its sandbox run with its labels, its address reported.
fn run_named_pod(
    client: &CriClient,
    admin: &KubeAdmin,
    index: usize,
    named: &NamedPod,
) -> Result<PodInfo> {
    cluster::bind_named_pod(admin, named)?;
    let mut spec = cri_pods::named_pod_spec(index, named);
    if named.branch_eni {
        let annotation = cluster::wait_pod_eni_annotation(admin, &named.namespace, &named.name)?;
        spec.annotations
            .insert(vpcnet_api::pod::POD_ENI_ANNOTATION.to_owned(), annotation);
    }
    let mut pod = cri_pods::run_pod(client, index, &spec)?;
    cluster::named_pod_running(admin, &named.namespace, &named.name, pod.addr)?;
    pod.labels.clone_from(&named.labels);
    info!(pod = %named.key(), addr = %pod.addr, "pod running");
    Ok(pod)
}

/// The lab's VPC resource controller, in the EC2 emulator, on the lab's
/// API server.
fn start_resource_controller(emulator: &EmulatorProcess, kube_api: &KubeApiProcess) -> Result<()> {
    emulator
        .admin()
        .start_resource_controller(&cluster::resource_controller(kube_api.admin()))
        .map_err(|err| {
            LabError::InvalidOption(format!("starting the VPC resource controller: {err}"))
        })
}

/// Whether any trace of a lab exists (state directory or namespaces).
pub fn exists() -> Result<bool> {
    Ok(state_dir().exists() || !lab_namespaces()?.is_empty())
}

/// Takes the lab slot: fails if a lab exists. Creating the state directory
/// is atomic, so two concurrent `up`s cannot both get here.
fn claim() -> Result<()> {
    let namespaces = lab_namespaces()?;
    if !namespaces.is_empty() {
        return Err(LabError::AlreadyExists {
            what: format!("namespaces {}", namespaces.join(", ")),
        });
    }
    if let Some(parent) = state_dir().parent() {
        fs::create_dir_all(parent).context(|| format!("creating {}", parent.display()))?;
    }
    match fs::create_dir(state_dir()) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == ErrorKind::AlreadyExists => Err(LabError::AlreadyExists {
            what: format!("state directory {}", state_dir().display()),
        }),
        Err(err) => Err(err).context(|| format!("creating {}", state_dir().display())),
    }
}
