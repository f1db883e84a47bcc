//! The lab: a node in a box made of network namespaces.
//!
//! `Lab::up` builds, inside namespaces named `vpcnet-*` and nowhere else:
//!
//! ```text
//!   vpcnet-pod-N ── eni<sha1> ┐
//!   (10.20.11.20+N)           │ vpcnet-node                    vpcnet-vpc (VPC router)
//!                             └ eth0 10.20.11.162 ─── n0-eth0  ├ peer-eth0 ─── vpcnet-peer   10.20.12.50
//!                               nodelocaldns 169.254.20.10     ├ igw0 ──────── vpcnet-inet   203.0.113.10
//!                                                              └ dx0 ───────── vpcnet-onprem 192.0.2.10
//! ```
//!
//! The VPC router does what AWS does: delivery to the ENI that owns an
//! address, the source/destination check, an internet gateway that passes
//! only node primary addresses (see [`router`]). The node runs either the
//! VPC CNI's own iptables wiring ([`vpc_cni`]) or this project's agent.
//!
//! For tests: take [`serial()`], bring a [`Lab`] up (dropping it tears it
//! down), run probes from [`probe`] in pods and far ends, read the router's
//! counters. Addresses and names are in [`addrs`].
//!
//! Pods made the way kubelet makes them, through containerd's CRI, are in
//! [`cri`].

pub mod addrs;
pub mod agent;
pub mod agent_pod;
pub mod cargo_env;
pub mod cluster;
pub mod cri;
pub mod cri_pods;
pub mod ec2;
mod error;
pub mod fuzz_settings;
pub mod helper_process;
pub mod kube;
pub mod kube_proxy;
pub mod kube_tools;
pub mod kubelet;
mod lab;
pub mod layout;
pub mod moto;
pub mod netlink;
pub mod netns;
mod options;
mod pidfd;
pub mod probe;
pub mod releases;
pub mod router;
mod scratch;
mod state;
pub mod test_sizes;
mod topology;
mod unix_http;
pub mod vpc_cni;

pub use error::{LabError, Result};
pub use lab::{Lab, LabLock, down_all, exists, serial};
pub use netns::{NetnsThread, exec, exec_ok, run_in, set_mtu, spawn_in};
pub use options::{
    AgentImage, ClusterIpService, CriLabOptions, Datapath, EnforcingMode, IpamLabOptions,
    LabOptions, Manifests, NamedPod, NodePortService, RandomizeSnat, ServiceBackend,
    parse_cidr_list, parse_enforcing_mode, parse_index_list, parse_label_changes, parse_pod_key,
};
pub use probe::{
    Observation, PacketCapture, Proto, WhoamiServer, WhoamiTarget, icmp_echo, send_spoofed_udp,
    tcp_whoami, udp_whoami, whoami_each,
};
pub use scratch::ScratchDir;
pub use state::{
    AgentInfo, BranchEni, LabState, PodInfo, agent_log_file, aws_node_run_dir, cni_socket_file,
    ipam_checkpoint_file, layout_file, state_dir, state_file,
};
/// The node's iptables backend, a lab option.
pub use vpcnet_api::iptables::IptablesBackend;
