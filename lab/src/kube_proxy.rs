//! kube-proxy in the lab's node: the rules its iptables mode writes
//! ([`vpcnet_api::kube_proxy`]) for the lab's services, installed the way it
//! installs them, under both datapaths, as on every EKS node. With them
//! conntrack is active in the node (so it defragments what the stack
//! receives) and `KUBE-FORWARD` drops what conntrack calls INVALID.
//!
//! The lab's services: the node port in front of one pod
//! (`externalTrafficPolicy: Local`, as [`NodePortService`] says) and the
//! cluster IPs the options ask for.

use std::{net::SocketAddrV4, process::Command};

use vpcnet_api::{
    iptables::IptablesBackend,
    kube_proxy::{
        CONNTRACK_SYSCTLS, Endpoint, KUBE_FORWARD, Options, Protocol, ROUTE_LOCALNET_SYSCTL,
        ServicePort, TrafficPolicy, jumps_restore_input, restore_input,
    },
};

use crate::{
    addrs::{NODE_PORT, NODE_PORT_CLUSTER_IP, NS_NODE},
    error::Result,
    netns::{exec_ok, netns_path, run_with_stdin, set_sysctls},
    options::{ClusterIpService, LabOptions, NodePortService, ServiceBackend},
    state::PodInfo,
};

/// The namespace the lab's services live in.
const NAMESPACE: &str = "default";
/// The node port service's name.
const NODE_PORT_SERVICE: &str = "node-port";

/// The node port service's ports, TCP and UDP, each with its own cluster IP
/// rule and node port.
fn node_port_ports(service: &NodePortService, backend: &PodInfo) -> Vec<ServicePort> {
    [Protocol::Tcp, Protocol::Udp]
        .into_iter()
        .map(|protocol| ServicePort {
            namespace: NAMESPACE.into(),
            service: NODE_PORT_SERVICE.into(),
            port_name: protocol.name().into(),
            protocol,
            cluster_ip: NODE_PORT_CLUSTER_IP,
            port: service.target_port,
            node_port: Some(NODE_PORT),
            external_traffic_policy: TrafficPolicy::Local,
            endpoints: vec![Endpoint {
                addr: SocketAddrV4::new(backend.addr, service.target_port),
                local: true,
            }],
        })
        .collect()
}

fn cluster_ip_ports(service: &ClusterIpService, pods: &[PodInfo]) -> Vec<ServicePort> {
    let endpoint = match service.backend {
        ServiceBackend::Pod { pod, port } => pods.get(pod).map(|info| Endpoint {
            addr: SocketAddrV4::new(info.addr, port),
            local: true,
        }),
        ServiceBackend::Remote(addr) => Some(Endpoint { addr, local: false }),
    };
    [Protocol::Tcp, Protocol::Udp]
        .into_iter()
        .map(|protocol| ServicePort {
            namespace: NAMESPACE.into(),
            service: service.name.clone(),
            port_name: protocol.name().into(),
            protocol,
            cluster_ip: *service.addr.ip(),
            port: service.addr.port(),
            node_port: None,
            external_traffic_policy: TrafficPolicy::Cluster,
            endpoints: endpoint.into_iter().collect(),
        })
        .collect()
}

/// Every service port of the lab, as kube-proxy sees them.
pub fn service_ports(opts: &LabOptions, pods: &[PodInfo]) -> Vec<ServicePort> {
    let mut ports = Vec::new();
    if let Some(service) = &opts.node_port
        && let Some(backend) = pods.iter().find(|pod| pod.index == service.pod)
    {
        ports.extend(node_port_ports(service, backend));
    }
    for service in &opts.cluster_ips {
        ports.extend(cluster_ip_ports(service, pods));
    }
    if opts.kube_api() {
        ports.extend(cluster_ip_ports(
            &crate::cluster::kubernetes_service(),
            pods,
        ));
    }
    ports
}

/// Installs kube-proxy's rules in the lab's new node: its sysctl, the
/// restore of its chains, conntrack's timeouts as it sets them, then the
/// jumps from the built-in chains, each at the head of its chain as
/// `EnsureRule(Prepend)` puts it. The node has none of them yet, so one
/// restore inserts them all: a check and an insert each cost a lab half a
/// minute under TCG.
pub fn install(opts: &LabOptions, pods: &[PodInfo]) -> Result<()> {
    set_sysctls(NS_NODE, &[ROUTE_LOCALNET_SYSCTL])?;
    restore(opts, pods, &jumps_restore_input())?;
    // Once its rules loaded conntrack (a module on some kernels).
    set_sysctls(NS_NODE, &CONNTRACK_SYSCTLS)
}

/// kube-proxy's sync after the lab's services changed: the restore of its
/// chains; the jumps to them are there since [`install`].
pub fn sync(opts: &LabOptions, pods: &[PodInfo]) -> Result<()> {
    restore(opts, pods, "")
}

/// `iptables-restore --noflush` of kube-proxy's chains for the lab's
/// services, then `more` input.
fn restore(opts: &LabOptions, pods: &[PodInfo], more: &str) -> Result<()> {
    let input = restore_input(&service_ports(opts, pods), Options::default()) + more;
    let mut restore = Command::new("nsenter");
    restore
        .arg(format!("--net={}", netns_path(NS_NODE).display()))
        .args([
            opts.iptables_backend.restore(),
            "-w",
            "--noflush",
            "--counters",
        ]);
    let output = run_with_stdin(&mut restore, &input)?;
    crate::netns::check_output(
        &format!("[{NS_NODE}] iptables-restore (kube-proxy)"),
        &output,
    )
}

/// Packets `KUBE-FORWARD` dropped because conntrack called them INVALID,
/// in the node's iptables `backend`.
pub fn invalid_drops(backend: IptablesBackend) -> Result<u64> {
    let rules = exec_ok(NS_NODE, &[backend.save(), "-c", "-t", "filter"])?;
    let chain = format!("-A {KUBE_FORWARD} ");
    Ok(rules
        .lines()
        .filter(|rule| {
            rule.contains(&chain) && rule.contains("--ctstate INVALID") && rule.ends_with("-j DROP")
        })
        .filter_map(|rule| {
            // "[packets:bytes] -A ..."
            let counters = rule.strip_prefix('[')?.split(']').next()?;
            counters.split(':').next()?.parse::<u64>().ok()
        })
        .sum())
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    #[test]
    fn node_port_and_cluster_ips_become_kube_proxy_service_ports() {
        let backend = PodInfo::new(1).unwrap();
        let opts = LabOptions {
            node_port: Some(NodePortService {
                pod: backend.index,
                target_port: 8080,
            }),
            cluster_ips: vec![ClusterIpService {
                name: "to-peer".into(),
                addr: SocketAddrV4::new(Ipv4Addr::new(10, 100, 0, 10), 80),
                backend: ServiceBackend::Remote(SocketAddrV4::new(
                    Ipv4Addr::new(10, 20, 12, 50),
                    8080,
                )),
            }],
            ..LabOptions::default()
        };
        let ports = service_ports(&opts, std::slice::from_ref(&backend));
        let names: Vec<String> = ports.iter().map(ServicePort::name).collect();
        assert_eq!(
            names,
            [
                "default/node-port:tcp",
                "default/node-port:udp",
                "default/to-peer:tcp",
                "default/to-peer:udp"
            ]
        );
        assert_eq!(ports[0].node_port, Some(NODE_PORT));
        assert_eq!(
            ports[1].endpoints[0].addr,
            SocketAddrV4::new(backend.addr, 8080)
        );
        assert!(!ports[2].endpoints[0].local);
    }
}
