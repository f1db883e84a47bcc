//! The agent killed by its test hook (`VPCNET_TEST_CRASH_AT`), and what
//! must hold once it is started again.

use vpcnet_agent::crash_points::KILLED_HERE;
use vpcnet_common::maps as names;
use vpcnet_lab::{Lab, addrs, agent_log_file};

use crate::hooks::hook_programs;

/// Whether the log of the agent started last (each start begins it anew)
/// says it killed itself.
pub fn killed_itself() -> bool {
    std::fs::read_to_string(agent_log_file())
        .unwrap_or_default()
        .contains(KILLED_HERE)
}

/// Every hook of the node's `enis` and pods with its one vpcnet program,
/// or a failure naming what is missing or doubled, in `round`.
///
/// # Panics
/// One is missing or doubled.
pub fn one_program_per_hook(lab: &Lab, enis: &[&str], round: u32) {
    let ours = [
        names::PROG_ENI_EGRESS,
        names::PROG_ENI_INGRESS,
        names::PROG_POD_EGRESS,
        names::PROG_POD_INGRESS,
    ];
    let hooks = hook_programs(addrs::NS_NODE);
    let mut links: Vec<(String, &str)> = enis
        .iter()
        .map(|eni| (*eni).to_owned())
        .flat_map(|eni| [(eni.clone(), "ingress"), (eni, "egress")])
        .collect();
    for pod in lab.pods() {
        links.push((pod.host_veth.clone(), "ingress"));
        links.push((pod.host_veth.clone(), "egress"));
    }
    for (link, direction) in links {
        let programs: Vec<&str> = hooks
            .get(&(link.clone(), direction.to_owned()))
            .map(|programs| {
                programs
                    .iter()
                    .map(|p| p.name.as_str())
                    .filter(|name| ours.contains(name))
                    .collect()
            })
            .unwrap_or_default();
        assert_eq!(
            programs.len(),
            1,
            "round {round}: {link} {direction}: vpcnet's programs {programs:?}"
        );
    }
}
