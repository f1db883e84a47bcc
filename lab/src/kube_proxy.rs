//! What kube-proxy would install for a `NodePort` service with
//! `externalTrafficPolicy: Local`, reduced to its effect: connections to the
//! node's primary address on [`NODE_PORT`] are DNATed to one pod, with no
//! masquerade (the pod sees the client's address). kube-proxy runs whatever
//! the CNI, so both datapaths get this.

use crate::{
    addrs::{NODE_PORT, NODE_PRIMARY_ADDR, NS_NODE},
    error::Result,
    netns::exec_ok,
    options::NodePortService,
    state::PodInfo,
};

/// The `iptables` invocations (without the program name), TCP then UDP.
pub fn node_port_commands(service: &NodePortService, backend: &PodInfo) -> Vec<Vec<String>> {
    ["tcp", "udp"]
        .into_iter()
        .map(|proto| {
            format!(
                "-t nat -A PREROUTING -d {NODE_PRIMARY_ADDR}/32 -p {proto} --dport {NODE_PORT} \
                 -j DNAT --to-destination {}:{}",
                backend.addr, service.target_port
            )
            .split_whitespace()
            .map(str::to_owned)
            .collect()
        })
        .collect()
}

/// Installs the service in the node.
pub fn install(service: &NodePortService, backend: &PodInfo) -> Result<()> {
    for command in node_port_commands(service, backend) {
        let mut argv = vec!["iptables", "-w"];
        argv.extend(command.iter().map(String::as_str));
        exec_ok(NS_NODE, &argv)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dnat_to_the_backend_without_masquerade() {
        let backend = PodInfo::new(1).unwrap();
        let commands = node_port_commands(
            &NodePortService {
                pod: 1,
                target_port: 8080,
            },
            &backend,
        );
        let joined: Vec<String> = commands.iter().map(|c| c.join(" ")).collect();
        assert_eq!(
            joined,
            vec![
                "-t nat -A PREROUTING -d 10.20.11.162/32 -p tcp --dport 30080 -j DNAT --to-destination 10.20.11.21:8080",
                "-t nat -A PREROUTING -d 10.20.11.162/32 -p udp --dport 30080 -j DNAT --to-destination 10.20.11.21:8080",
            ]
        );
    }
}
