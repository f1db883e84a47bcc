//! An address-manager lab for tests: the real agent with `--ipam` against
//! the lab's EC2 emulator, driven through the CNI backend as the plugin
//! drives it, and the emulator's state to check what EC2 holds.

use std::{
    collections::BTreeSet,
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use tonic::{Code, transport::Channel};
use vpcnet_api::cni::{
    AddNetworkReply, AddNetworkRequest, DelNetworkRequest, IpamStatusReply, IpamStatusRequest,
    PodKey, cni_backend_client::CniBackendClient,
};
use vpcnet_lab::{
    IpamLabOptions, Lab, LabOptions, cni_socket_file,
    ec2::{EmulatorProcess, model::StateSnapshot},
};

use crate::agent_binary;

/// Intervals short enough for tests: a pass every 200 ms, ENIs freed after
/// a second, leaked ENIs looked for every second or so.
pub const FAST_AGENT_ARGS: &[&str] = &[
    "--reconcile-interval",
    "0.2",
    "--min-eni-lifetime",
    "1",
    "--vpc-cidr-interval",
    "1",
    "--leaked-eni-interval",
    "1",
];

/// The node's reconcile every second (aws-node: every minute), as an
/// environment variable: the agent releases the upgrade test starts know no
/// such flag.
pub const FAST_AGENT_ENV: &[(&str, &str)] = &[("VPCNET_NODE_RECONCILE_INTERVAL", "1")];

/// The lab, a runtime and a client of the agent's CNI backend.
pub struct IpamLab {
    pub lab: Lab,
    runtime: tokio::runtime::Runtime,
    client: Option<CniBackendClient<Channel>>,
    /// ADDs told to try again (`ABORTED`) and tried again.
    pub tried_again: usize,
}

/// The lab for this test alone: root checked, the lab lock taken, a lab
/// left by an earlier run removed.
pub fn lab_lock() -> vpcnet_lab::LabLock {
    assert!(
        nix::unistd::geteuid().is_root(),
        "the address-manager tests need root (network namespaces, eBPF)"
    );
    let lock = vpcnet_lab::serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    lock
}

/// A pod's IPAM key for container `id`.
#[must_use]
pub fn pod(id: usize) -> PodKey {
    PodKey {
        network_name: "aws-cni".into(),
        container_id: format!("{id:064x}"),
        if_name: "eth0".into(),
        k8s_pod_namespace: "default".into(),
        k8s_pod_name: format!("pod-{id}"),
    }
}

impl IpamLab {
    /// Brings up a lab whose node is an `instance_type`, the agent running
    /// with the VPC CNI variables `env`.
    pub fn up(instance_type: &str, env: &[(&str, &str)]) -> Self {
        Self::up_with_args(instance_type, env, &[])
    }

    /// [`IpamLab::up`] with more `vpcnet-agent run` arguments.
    pub fn up_with_args(instance_type: &str, env: &[(&str, &str)], args: &[&str]) -> Self {
        Self::up_with_options(Self::options(instance_type, env, args))
    }

    /// [`IpamLab::up`] with the lab's Kubernetes API server: the agent runs
    /// in-cluster.
    pub fn up_in_cluster(instance_type: &str, env: &[(&str, &str)]) -> Self {
        let mut ipam = Self::options(instance_type, env, &[]);
        ipam.kube_api = true;
        // Its tests write the resource controller's annotations themselves.
        ipam.resource_controller_held = true;
        Self::up_with_options(ipam)
    }

    fn options(instance_type: &str, env: &[(&str, &str)], args: &[&str]) -> IpamLabOptions {
        let mut ipam = IpamLabOptions::new(instance_type);
        ipam.env = FAST_AGENT_ENV
            .iter()
            .chain(env)
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        ipam.agent_args = FAST_AGENT_ARGS
            .iter()
            .chain(args)
            .map(|a| (*a).to_owned())
            .collect();
        ipam
    }

    fn up_with_options(ipam: IpamLabOptions) -> Self {
        let opts = LabOptions {
            ipam: Some(ipam),
            ..LabOptions::ebpf(0, agent_binary())
        };
        let lab = Lab::up(&opts).expect("bringing up the address-manager lab");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let mut lab = Self {
            lab,
            runtime,
            client: None,
            tried_again: 0,
        };
        lab.connect();
        lab
    }

    /// (Re)connects to the agent's socket.
    pub fn connect(&mut self) {
        let client = self
            .runtime
            .block_on(vpcnet_api::connect_cni(cni_socket_file()))
            .expect("connecting to the agent's CNI backend");
        self.client = Some(client);
    }

    /// A client of the agent's CNI backend (connected).
    pub fn client(&mut self) -> CniBackendClient<Channel> {
        self.client.clone().expect("connected")
    }

    /// Runs `call` (a backend call) to completion.
    pub fn block_on<F: std::future::Future>(&self, call: F) -> F::Output {
        self.runtime.block_on(call)
    }

    /// CNI ADD of the address alone: no host veth, so no datapath entry
    /// (the address-manager tests need pods by the hundred, not veths).
    pub fn add(&mut self, id: usize) -> Result<AddNetworkReply, tonic::Status> {
        let mut client = self.client();
        self.runtime
            .block_on(client.add_network(AddNetworkRequest {
                pod: Some(pod(id)),
                netns: format!("/var/run/netns/test-{id}"),
                ..AddNetworkRequest::default()
            }))
            .map(tonic::Response::into_inner)
    }

    /// CNI DEL; the address released, if any.
    pub fn del(&mut self, id: usize) -> Result<Option<Ipv4Addr>, tonic::Status> {
        let mut client = self.client();
        let reply = self
            .runtime
            .block_on(client.del_network(DelNetworkRequest {
                pod: Some(pod(id)),
                ..DelNetworkRequest::default()
            }))?
            .into_inner();
        Ok((!reply.ipv4_addr.is_empty()).then(|| reply.ipv4_addr.parse().expect("an address")))
    }

    /// The agent's pool.
    pub fn status(&mut self) -> IpamStatusReply {
        let mut client = self.client();
        self.runtime
            .block_on(client.ipam_status(IpamStatusRequest {}))
            .expect("IpamStatus")
            .into_inner()
    }

    pub fn emulator(&self) -> &EmulatorProcess {
        self.lab.emulator().expect("an address-manager lab")
    }

    /// What EC2 holds.
    pub fn ec2_state(&self) -> StateSnapshot {
        self.emulator()
            .admin()
            .state()
            .expect("the emulator's state")
    }

    /// Waits (bounded) for `done` on the agent's status: the agent reports
    /// no events for the pool settling, so this polls its status.
    pub fn wait_status(
        &mut self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&IpamStatusReply) -> bool,
    ) -> IpamStatusReply {
        let deadline = Instant::now() + timeout;
        loop {
            let status = self.status();
            if done(&status) {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within {timeout:?}; last status {status:?}\nagent log (tail):\n{}",
                agent_log_tail()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits (bounded) for `done` on EC2's state (polled: EC2 has no
    /// notifications either).
    pub fn wait_ec2(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&StateSnapshot) -> bool,
    ) -> StateSnapshot {
        let deadline = Instant::now() + timeout;
        loop {
            let state = self.ec2_state();
            if done(&state) {
                return state;
            }
            assert!(Instant::now() < deadline, "{what}: not within {timeout:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// ADDs pods `from..` until the node is full (`RESOURCE_EXHAUSTED`), with
    /// no other error; returns the addresses in order and the time the last
    /// one took to arrive. An ADD told to try again (`ABORTED`: the pool did
    /// not grow within the agent's wait) is tried again, as kubelet does,
    /// for [`ADD_RETRIES_FOR`] at most.
    pub fn fill(&mut self, from: usize, limit: usize) -> (Vec<Ipv4Addr>, Duration) {
        let started = Instant::now();
        let mut addrs = Vec::new();
        let mut last = Duration::ZERO;
        for id in from..from + limit {
            match self.add_retrying(id) {
                Ok(reply) => {
                    addrs.push(reply.ipv4_addr.parse().expect("an address"));
                    last = started.elapsed();
                }
                Err(status) if status.code() == Code::ResourceExhausted => break,
                Err(status) => panic!(
                    "ADD of pod {id} failed: {status}\nagent log (tail):\n{}",
                    agent_log_tail()
                ),
            }
        }
        (addrs, last)
    }

    /// CNI ADD of pod `id`, tried again while the agent says the pool is
    /// still growing (`ABORTED`), for [`ADD_RETRIES_FOR`] at most.
    pub fn add_retrying(&mut self, id: usize) -> Result<AddNetworkReply, tonic::Status> {
        let deadline = Instant::now() + ADD_RETRIES_FOR;
        loop {
            match self.add(id) {
                Err(status) if status.code() == Code::Aborted && Instant::now() < deadline => {
                    self.tried_again += 1;
                }
                other => return other,
            }
        }
    }
}

/// How long a pod's ADD is tried again while the pool grows: kubelet has
/// no bound, but a test does.
pub const ADD_RETRIES_FOR: Duration = Duration::from_mins(2);

/// Runs `call` with an EC2 client such as the agent's, from the node (where
/// the lab's EC2 endpoint answers): what an operator's tooling does to the
/// account, through the Query API.
pub fn ec2_call<T, Fut>(call: impl FnOnce(vpcnet_agent::cloud::Cloud) -> Fut + Send) -> T
where
    Fut: std::future::Future<Output = T>,
    T: Send,
{
    vpcnet_lab::run_in(vpcnet_lab::addrs::NS_NODE, move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
            .block_on(async {
                let cloud =
                    vpcnet_agent::cloud::Cloud::connect(vpcnet_agent::cloud::CloudOptions {
                        region: Some(vpcnet_lab::ec2::config::LAB_REGION.into()),
                        ec2_endpoint: Some(vpcnet_lab::ec2::EC2_ENDPOINT_URL.into()),
                        ..vpcnet_agent::cloud::CloudOptions::default()
                    })
                    .await
                    .expect("an EC2 client");
                call(cloud).await
            })
    })
    .expect("running in the node")
}

/// Sets `tags` on an EC2 resource (a subnet, an ENI) through `CreateTags`.
pub fn tag(resource_id: &str, tags: &[(&str, &str)]) {
    ec2_call(|cloud| async move {
        cloud
            .tag(resource_id, tags)
            .await
            .unwrap_or_else(|e| panic!("tagging {resource_id}: {e}"));
    });
}

/// What EC2 holds for `instance`: its attached ENIs, their addresses
/// available to pods (secondaries and prefix addresses), and every ENI not
/// attached to anything.
#[derive(Debug)]
pub struct Ec2Holdings {
    pub attached_enis: usize,
    pub pod_addrs: BTreeSet<Ipv4Addr>,
    pub detached_enis: Vec<String>,
}

#[must_use]
pub fn holdings(state: &StateSnapshot, instance: &str) -> Ec2Holdings {
    let mine: Vec<_> = state
        .enis
        .iter()
        .filter(|e| {
            e.attachment
                .as_ref()
                .is_some_and(|a| a.instance_id == instance)
        })
        .collect();
    let mut pod_addrs = BTreeSet::new();
    for eni in &mine {
        pod_addrs.extend(eni.secondary_ips.iter().copied());
        for prefix in &eni.prefixes {
            pod_addrs.extend(prefix.hosts().chain([prefix.network(), prefix.broadcast()]));
        }
    }
    Ec2Holdings {
        attached_enis: mine.len(),
        pod_addrs,
        detached_enis: state
            .enis
            .iter()
            .filter(|e| e.attachment.is_none())
            .map(|e| e.id.clone())
            .collect(),
    }
}

/// The last lines of the lab agent's log, for failure messages.
#[must_use]
pub fn agent_log_tail() -> String {
    let log = std::fs::read_to_string(vpcnet_lab::agent_log_file()).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}
