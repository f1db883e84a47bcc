//! Taking a node over from aws-node, and handing it back.
//!
//! Taking over ([`take_over`]) keeps every running pod as it is: its
//! address (from aws-node's checkpoint, which the address manager
//! replays), its veth and its connections. In order:
//!
//! 1. Each pod gets its datapath entry (`Pods::adopt`): replies to it go
//!    straight into it from then on.
//! 2. The connections iptables translated are copied from conntrack into
//!    the NAT table, and kube-proxy's into the stack flows, so the programs
//!    keep each on its port and path ([`import_flows`]). (Before step 1,
//!    and again here, the connections network policy let through are
//!    tracked: [`track_policy_flows`].) Until the next
//!    step, what the pods send still goes through iptables.
//! 3. The pods get their programs (`Pods::finish_adoption`).
//! 4. Only then do aws-node's iptables rules and ip rules go
//!    ([`remove_vpc_cni_iptables`], [`remove_vpc_cni_rules`]); a pod that
//!    could not be adopted keeps its rules, and the node-wide ones stay
//!    while any is left. Where aws-node's network policy agent enforced
//!    policies, its filters go from the adopted pods' veths
//!    ([`network_policy`]): vpcnet enforced the same policies before step
//!    1, and step 2 tracked the connections policy let through.
//! 5. aws-node's conflist is set aside, so the runtime picks vpcnet's.
//!
//! Every step can be taken again: a start killed half-way (a crash, the
//! OOM killer) leaves the next one what is left to do. A pod with its
//! entry but not its programs is adopted again from step 1, and step 4
//! takes aws-node's rules of every pod the datapath has whole.
//!
//! Branch-ENI pods (security groups for pods) are in no checkpoint: their
//! wiring tells them ([`vpc_cni_branch_pods`]: each `vlan.eth.<id>`, its
//! VLAN table, the pod's route or rule 1536 there). In step 1 each also
//! gets its VLAN link into the datapath; in step 4 its rules 10 (strict) or
//! 512 and 1536 (standard) go.
//!
//! Handing back ([`hand_back`], `vpcnet-agent uninstall`) writes aws-node's
//! rules back from the checkpoint and the datapath's settings, and each
//! branch pod's VLAN table and rules from the datapath's entries
//! ([`restore_vpc_cni_wiring`]), gives conntrack the connections the
//! datapath translated ([`export_flows`]), detaches the programs and puts
//! aws-node's conflist back.

pub mod flows;
pub mod ipamd;
pub mod iptables;
pub mod network_policy;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, PoisonError},
};

use flows::{
    conntrack_connections, export_flows, forget_stack_aliases, forget_stale_connections,
    import_flows, track_policy_flows,
};
use tracing::{debug, info, warn};
use vpcnet_api::{
    aws_network_policy::pod_identifier,
    pod::BRANCH_LINK_PREFIX,
    vpc_cni::{
        self, BranchPodWiring, FROM_POD_RULE_PRIORITY, HOST_RULE_PRIORITY, IpRule, MAIN_TABLE,
        NodeWiring, TO_POD_RULE_PRIORITY, VLAN_RULE_PRIORITY,
    },
};
use vpcnet_common::{
    cidr::CidrKind,
    endpoint::{ENDPOINT_BRANCH, ENDPOINT_STRICT, ENI_PRIMARY},
    raw_to_addr,
};
use vpcnet_netlink::{MacAddr, NetlinkError, NetlinkHandle, route::Ipv4Route, rule::Ipv4Rule};

use crate::{
    crash_points,
    datapath::{Datapath, DatapathError, DatapathMaps, remove_pins},
    install::CONFLIST_NAME,
    ipam::checkpoint::{Checkpoint, CheckpointError},
    pods::{PodError, Pods},
};

/// aws-node's CNI configuration (`10-aws.conflist`).
pub const AWS_CONFLIST: &str = "10-aws.conflist";
/// What it is renamed to while vpcnet runs the node: a name the runtime
/// does not load (it reads `.conf`, `.conflist` and `.json` only).
pub const AWS_CONFLIST_SET_ASIDE: &str = "10-aws.conflist.vpcnet-takeover";

#[derive(Debug, thiserror::Error)]
pub enum TakeOverError {
    #[error("running {command}: {source} (is it installed?)")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{command} failed: {stderr}")]
    Failed { command: String, stderr: String },
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error(transparent)]
    Pod(#[from] PodError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    PolicyHandBack(#[from] network_policy::AwsPinsError),
    #[error("the primary ENI's link (ifindex {0}) is gone")]
    NoPrimaryLink(u32),
    #[error("no link is named {0}")]
    NoLink(String),
    #[error("the ENI link of ifindex {0} is gone")]
    NoEniLink(u32),
    #[error("asking IMDS for the device number of {mac}: {message}")]
    DeviceNumber { mac: MacAddr, message: String },
    #[error("removing the datapath's pins in {pin_dir}")]
    Unpin {
        pin_dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("removing {path}")]
    Remove {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("renaming {from} to {to}")]
    Rename {
        from: PathBuf,
        to: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Runs `program args`, returning its standard output.
pub(super) fn run(program: &str, args: &[&str]) -> Result<String, TakeOverError> {
    let command = format!("{program} {}", args.join(" "));
    let output = Command::new(program)
        .args(args)
        .output()
        .map_err(|source| TakeOverError::Spawn {
            command: command.clone(),
            source,
        })?;
    if !output.status.success() {
        return Err(TakeOverError::Failed {
            command,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The iptables tables ipamd writes to.
const TABLES: [&str; 2] = ["nat", "mangle"];

/// Whether any of ipamd's iptables rules or chains is on this node: a
/// take-over killed half-way through removing them may have left only the
/// connmark rules, with no chain.
pub fn vpc_cni_iptables_present() -> Result<bool, TakeOverError> {
    for table in TABLES {
        let listing = run(iptables::program(), &["-w", "-t", table, "-S"])?;
        let present = listing.lines().any(|line| {
            let args = vpc_cni::split_iptables_line(line);
            match args.first().map(String::as_str) {
                Some("-N") => args[1].starts_with(vpc_cni::CHAIN_PREFIX),
                Some("-A") => vpc_cni::is_vpc_cni_rule(&args),
                _ => false,
            }
        });
        if present {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Removes ipamd's iptables rules and chains (`AWS-SNAT-CHAIN-*`,
/// `AWS-CONNMARK-CHAIN-*`, the jumps to them, the connmark rules), told
/// apart by their `AWS` comments and chain names. Returns how many rules
/// and chains went.
pub fn remove_vpc_cni_iptables() -> Result<usize, TakeOverError> {
    let mut removed = 0;
    for table in TABLES {
        let listing = run(iptables::program(), &["-w", "-t", table, "-S"])?;
        let mut chains = Vec::new();
        for line in listing.lines() {
            let args = vpc_cni::split_iptables_line(line);
            match args.first().map(String::as_str) {
                Some("-N") if args[1].starts_with(vpc_cni::CHAIN_PREFIX) => {
                    chains.push(args[1].clone());
                }
                Some("-A")
                    if !args[1].starts_with(vpc_cni::CHAIN_PREFIX)
                        && vpc_cni::is_vpc_cni_rule(&args) =>
                {
                    let mut delete = vec!["-w", "-t", table, "-D"];
                    delete.extend(args[1..].iter().map(String::as_str));
                    run(iptables::program(), &delete)?;
                    debug!(table, rule = line, "aws-node's rule removed");
                    crash_points::step("take-over: an aws-node iptables rule removed");
                    removed += 1;
                }
                _ => {}
            }
        }
        // Flushed first, all of them: one may jump to another.
        for chain in &chains {
            run(iptables::program(), &["-w", "-t", table, "-F", chain])?;
            crash_points::step("take-over: an aws-node iptables chain flushed");
        }
        for chain in &chains {
            run(iptables::program(), &["-w", "-t", table, "-X", chain])?;
            crash_points::step("take-over: an aws-node iptables chain removed");
            removed += 1;
        }
    }
    Ok(removed)
}

/// Removes aws-node's ip rules: rule 1024 (`fwmark <connmark>`) when
/// `node_wide`, rules 512 and 1536 of each of `pods`, and the rules 10 of
/// each of `branch_pods` (strict mode's). Returns how many went.
pub async fn remove_vpc_cni_rules(
    netlink: &NetlinkHandle,
    pods: &BTreeSet<Ipv4Addr>,
    branch_pods: &[BranchPodWiring],
    connmark: u32,
    node_wide: bool,
) -> Result<usize, TakeOverError> {
    let of_pod = |prefix: Option<ipnet::Ipv4Net>| {
        prefix.is_some_and(|net| net.prefix_len() == 32 && pods.contains(&net.addr()))
    };
    let vlan_rules: Vec<Ipv4Rule> = branch_pods
        .iter()
        .flat_map(BranchPodWiring::rules)
        .filter(|rule| rule.priority == VLAN_RULE_PRIORITY)
        .map(|rule| netlink_rule(&rule))
        .collect();
    Ok(netlink
        .delete_rules(|rule| match rule.priority {
            VLAN_RULE_PRIORITY => vlan_rules.contains(rule),
            TO_POD_RULE_PRIORITY => rule.table == MAIN_TABLE && of_pod(rule.to),
            FROM_POD_RULE_PRIORITY => of_pod(rule.from),
            HOST_RULE_PRIORITY => {
                node_wide && rule.table == MAIN_TABLE && rule.fwmark == Some((connmark, connmark))
            }
            _ => false,
        })
        .await?)
}

/// aws-node's branch-ENI pods, read back from what its plugin wired
/// ([`BranchPodWiring`]): each `vlan.eth.<id>` with a default route in its
/// VLAN table; strict: the pod's route in that table, by its host veth;
/// standard: rule 1536 from the pod to that table, and the pod's route in
/// `main`.
pub async fn vpc_cni_branch_pods(
    netlink: &NetlinkHandle,
) -> Result<Vec<BranchPodWiring>, TakeOverError> {
    let links = netlink.links().await?;
    let name_of = |index: u32| {
        links
            .iter()
            .find(|link| link.index == index)
            .map(|link| link.name.clone())
    };
    let mut found = Vec::new();
    let (mut rules, mut main) = (None, None);
    for link in &links {
        let Some(vlan_id) = link
            .name
            .strip_prefix(BRANCH_LINK_PREFIX)
            .and_then(|id| id.parse::<u16>().ok())
        else {
            continue;
        };
        let table = vpc_cni::vlan_route_table(vlan_id);
        let routes = netlink.ipv4_routes(table).await?;
        let Some(gateway) = routes
            .iter()
            .find(|route| route.dst.prefix_len() == 0)
            .and_then(|route| route.via)
        else {
            continue;
        };
        let host_route = |route: &&Ipv4Route| {
            route.dst.prefix_len() == 32 && route.via.is_none() && route.oif != Some(link.index)
        };
        let (addr, oif, strict) = if let Some(route) = routes.iter().find(host_route) {
            (route.dst.addr(), route.oif, true)
        } else {
            if rules.is_none() {
                rules = Some(netlink.ipv4_rules().await?);
                main = Some(netlink.ipv4_routes(MAIN_TABLE).await?);
            }
            let from_pod = rules.iter().flatten().find_map(|rule| {
                (rule.priority == FROM_POD_RULE_PRIORITY && rule.table == table)
                    .then_some(rule.from)
                    .flatten()
                    .filter(|from| from.prefix_len() == 32)
            });
            let Some(from) = from_pod else {
                continue;
            };
            let oif = main
                .iter()
                .flatten()
                .find(|route| route.dst == from)
                .and_then(|route| route.oif);
            (from.addr(), oif, false)
        };
        if let Some(host_veth) = oif.and_then(name_of) {
            found.push(BranchPodWiring {
                addr,
                host_veth,
                vlan_id,
                gateway,
                strict,
            });
        }
    }
    Ok(found)
}

/// Renames `from` to `to` in `dir` if `from` is there; returns whether it
/// did.
fn rename_in(dir: &Path, from: &str, to: &str) -> Result<bool, TakeOverError> {
    let (from, to) = (dir.join(from), dir.join(to));
    match std::fs::rename(&from, &to) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(TakeOverError::Rename { from, to, source }),
    }
}

/// Sets aws-node's conflist in `dir` aside (it sorts before vpcnet's, so
/// the runtime would keep using it); returns whether there was one.
pub fn set_aside_aws_conflist(dir: &Path) -> Result<bool, TakeOverError> {
    rename_in(dir, AWS_CONFLIST, AWS_CONFLIST_SET_ASIDE)
}

/// Puts aws-node's conflist back; returns whether one was set aside.
pub fn restore_aws_conflist(dir: &Path) -> Result<bool, TakeOverError> {
    rename_in(dir, AWS_CONFLIST_SET_ASIDE, AWS_CONFLIST)
}

/// A pod to give back to aws-node: its address and its ENI's route table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandedBackPod {
    pub addr: Ipv4Addr,
    pub table: u32,
}

/// Writes aws-node's wiring back: its iptables rules (after removing any
/// left), rule 1024 and each pod's rules 512 and 1536. Returns how many
/// ip rules were added.
pub async fn restore_vpc_cni_wiring(
    netlink: &NetlinkHandle,
    wiring: &NodeWiring,
    pods: &[HandedBackPod],
    branch_pods: &[BranchPodWiring],
) -> Result<usize, TakeOverError> {
    remove_vpc_cni_iptables()?;
    for command in wiring.iptables_commands() {
        let mut args = vec!["-w"];
        args.extend(command.iter().map(String::as_str));
        run(iptables::program(), &args)?;
    }
    let mut rules = vec![wiring.host_rule()];
    for pod in pods {
        rules.extend(IpRule::pod_rules(pod.addr, pod.table));
    }
    for pod in branch_pods {
        for route in pod.routes() {
            let oif = nix::net::if_::if_nametoindex(route.dev.as_str())
                .map_err(|_| TakeOverError::NoLink(route.dev.clone()))?;
            let netlink_route = Ipv4Route {
                dst: route.dst,
                via: route.via,
                oif: Some(oif),
            };
            netlink
                .replace_ipv4_route(&netlink_route, route.table)
                .await?;
        }
        rules.extend(pod.rules());
    }
    let mut added = 0;
    for rule in &rules {
        if netlink.add_rule(&netlink_rule(rule)).await? {
            added += 1;
        }
    }
    info!(
        iptables = wiring.iptables_commands().len(),
        ip_rules = added,
        pods = pods.len(),
        "aws-node's wiring written back"
    );
    Ok(added)
}

/// The netlink form of one of the VPC CNI's rules.
fn netlink_rule(rule: &IpRule) -> Ipv4Rule {
    Ipv4Rule {
        priority: rule.priority,
        from: rule.from,
        to: rule.to,
        fwmark: rule.fwmark.map(|mark| (mark, mark)),
        iif: rule.iif.clone(),
        table: rule.table,
    }
}

/// What taking the node over did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TakeOver {
    pub adopted: usize,
    /// Pods with a veth that could not be adopted: they keep aws-node's
    /// rules, and so does the node.
    pub not_adopted: usize,
    pub translated_flows: usize,
    pub stack_flows: usize,
    /// Connections network policy let through, tracked on.
    pub policy_flows: usize,
    /// aws-node's network policy filters deleted from the pods' veths.
    pub policy_filters_removed: usize,
    pub iptables_removed: usize,
    pub ip_rules_removed: usize,
}

impl TakeOver {
    /// Logs what was done, if anything.
    pub fn log(&self) {
        if *self == Self::default() {
            return;
        }
        if self.not_adopted > 0 {
            warn!(
                not_adopted = self.not_adopted,
                "some pods of aws-node could not be adopted: aws-node's node-wide rules stay"
            );
        }
        info!(
            adopted = self.adopted,
            translated_flows = self.translated_flows,
            stack_flows = self.stack_flows,
            policy_flows = self.policy_flows,
            policy_filters_removed = self.policy_filters_removed,
            iptables_removed = self.iptables_removed,
            ip_rules_removed = self.ip_rules_removed,
            "node taken over from aws-node"
        );
    }
}

/// Takes the node over from aws-node (see the module's doc): imports the
/// flows of the pods it left, adopts them, then removes its rules, and
/// with `aws_policy` (where its network policy agent pinned) that agent's
/// filters from the adopted pods' veths. Does nothing on a node aws-node never ran (no pod
/// to adopt, no chain).
pub async fn take_over(
    pods: &Pods,
    datapath: &Mutex<Datapath>,
    netlink: &NetlinkHandle,
    connmark: u32,
    aws_policy: Option<&Path>,
) -> Result<TakeOver, TakeOverError> {
    let lock = || datapath.lock().unwrap_or_else(PoisonError::into_inner);
    let PodsToTake {
        all_branch_pods,
        already,
        branch_pods,
        candidates,
    } = pods_to_take(pods, datapath, netlink).await?;
    let iptables_left = vpc_cni_iptables_present()?;
    let mut report = TakeOver::default();
    if candidates.is_empty() && !iptables_left {
        return Ok(report);
    }
    // What policy let through is tracked before the entries, which make
    // the datapath judge what reaches the pods.
    report.policy_flows += track_policy_flows(
        &lock().maps,
        &candidates,
        &conntrack_connections()?,
        aws_policy,
    )?;
    crash_points::step("take-over: the connections policy let through tracked");
    // Entries first: replies go straight into the pods from then on,
    // never rewritten by a claim and handed to a stack that knows nothing
    // of it. Then the claims, then the programs.
    let (adoptees, entry_failures) = pods.adopt(&branch_pods).await?;
    crash_points::step("take-over: the pods' entries written");
    let mut imported = Vec::new();
    if !candidates.is_empty() {
        match conntrack_connections()
            .and_then(|connections| import_flows(&mut lock().maps, &candidates, &connections))
        {
            Ok(imports) => {
                imported.push(imports);
                crash_points::step("take-over: the translated connections imported");
            }
            Err(e) => {
                // Without the connections the pods would lose them: they
                // stay on aws-node's wiring, whole.
                pods.abandon_adoption(&adoptees);
                return Err(e);
            }
        }
    }
    let (adopted, attach_failures) = pods.finish_adoption(&adoptees).await;
    let adopted: BTreeSet<Ipv4Addr> = adopted.into_iter().collect();
    let failed = entry_failures + attach_failures;
    report.adopted = adopted.len();
    report.not_adopted = failed;
    // Every pod in the datapath now, with those an earlier start adopted
    // before it was killed: their stack aliases, aws-node's rules and
    // filters go too.
    let in_datapath: BTreeMap<Ipv4Addr, &str> = adoptees
        .iter()
        .filter(|pod| adopted.contains(&pod.addr))
        .map(|pod| (pod.addr, pod.host_veth.as_str()))
        .chain(already.iter().map(|(addr, veth)| (*addr, veth.as_str())))
        .collect();
    let in_datapath_addrs: BTreeSet<Ipv4Addr> = in_datapath.keys().copied().collect();
    if !in_datapath.is_empty() {
        // Connections opened between the first import and the programs.
        let second = conntrack_connections().and_then(|connections| {
            let pods = &in_datapath_addrs;
            let imports = import_flows(&mut lock().maps, pods, &connections)?;
            let tracked = track_policy_flows(&lock().maps, pods, &connections, aws_policy)?;
            Ok((imports, tracked))
        });
        match second {
            Ok((imports, tracked)) => {
                imported.push(imports);
                report.policy_flows += tracked;
                crash_points::step("take-over: the connections opened meanwhile imported");
            }
            Err(e) => warn!(error = %e, "importing the connections opened during the take-over"),
        }
    }
    for imports in &imported {
        forget_stack_aliases(&mut lock().maps, imports);
        report.translated_flows += imports.translated.len();
        report.stack_flows += imports.stack.len();
    }
    if aws_policy.is_some() {
        // The adopted pods' programs judge them now, with their policies.
        for veth in in_datapath.values() {
            report.policy_filters_removed += network_policy::detach_filters(veth);
            crash_points::step("take-over: a pod's policy filters removed");
        }
    }
    let branch_in_datapath: Vec<BranchPodWiring> = all_branch_pods
        .into_iter()
        .filter(|pod| in_datapath.contains_key(&pod.addr))
        .collect();
    report.ip_rules_removed = remove_vpc_cni_rules(
        netlink,
        &in_datapath_addrs,
        &branch_in_datapath,
        connmark,
        failed == 0,
    )
    .await?;
    crash_points::step("take-over: aws-node's ip rules removed");
    if failed == 0 && iptables_left {
        report.iptables_removed = remove_vpc_cni_iptables()?;
    }
    Ok(report)
}

/// The node's pods as a take-over finds them.
struct PodsToTake {
    /// aws-node's branch-ENI pods, read from their wiring.
    all_branch_pods: Vec<BranchPodWiring>,
    /// Those an earlier start took over whole (entry and programs), with
    /// their host veths.
    already: BTreeMap<Ipv4Addr, String>,
    /// Branch pods to adopt.
    branch_pods: Vec<BranchPodWiring>,
    /// Every pod to adopt: those with no entry, and those a start killed
    /// half-way left with an entry but not their programs.
    candidates: BTreeSet<Ipv4Addr>,
}

async fn pods_to_take(
    pods: &Pods,
    datapath: &Mutex<Datapath>,
    netlink: &NetlinkHandle,
) -> Result<PodsToTake, TakeOverError> {
    let in_datapath = |addr: Ipv4Addr| {
        datapath
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .holds_pod(addr)
    };
    // A strict pod keeps its VLAN table after the take-over: one the
    // datapath has is not aws-node's any more.
    let all_branch_pods = vpc_cni_branch_pods(netlink).await?;
    let (mut already, mut branch_pods) = (BTreeMap::new(), Vec::new());
    for pod in &all_branch_pods {
        if in_datapath(pod.addr)? {
            already.insert(pod.addr, pod.host_veth.clone());
        } else {
            branch_pods.push(pod.clone());
        }
    }
    let mut candidates = BTreeSet::new();
    for pod in pods.attachments().await? {
        match pod.host_veth {
            Some(veth) if in_datapath(pod.addr)? => {
                already.insert(pod.addr, veth);
            }
            _ => {
                candidates.insert(pod.addr);
            }
        }
    }
    candidates.extend(branch_pods.iter().map(|pod| pod.addr));
    Ok(PodsToTake {
        all_branch_pods,
        already,
        branch_pods,
        candidates,
    })
}

/// What `vpcnet-agent uninstall` works from.
#[derive(Clone, Debug)]
pub struct HandBackOptions {
    pub pin_dir: PathBuf,
    /// aws-node's checkpoint (`AWS_VPC_K8S_CNI_BACKING_STORE`).
    pub checkpoint: PathBuf,
    /// The runtime's CNI configuration directory, as mounted.
    pub cni_conf_dir: Option<PathBuf>,
    pub connmark: u32,
    pub veth_prefix: String,
    /// Where aws-node's network policy agent pins (its enforcement is
    /// handed back where it has pins).
    pub network_policy_pins: PathBuf,
}

/// What handing the node back did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HandBack {
    pub pods: usize,
    pub ip_rules_added: usize,
    /// Translated connections handed to conntrack.
    pub flows_exported: usize,
    /// Entries conntrack kept of untranslated pod connections the datapath
    /// carried, removed (see [`forget_stale_connections`]).
    pub stale_forgotten: usize,
    /// aws-node's network policy enforcement put back.
    pub policy: network_policy::PolicyHandBack,
    pub conflist_restored: bool,
}

/// Hands the node back to aws-node (`vpcnet-agent uninstall`, with the
/// agent stopped): aws-node's rules written back for the node and every
/// pod of the checkpoint, the datapath's pins removed (which detaches its
/// programs), vpcnet's conflist removed and aws-node's put back.
pub async fn hand_back(
    opts: &HandBackOptions,
    netlink: &NetlinkHandle,
    device_number: impl AsyncFn(MacAddr) -> Result<u32, TakeOverError>,
) -> Result<HandBack, TakeOverError> {
    let maps = DatapathMaps::open_pinned(&opts.pin_dir)?;
    let config = maps.config()?;
    let primary_interface = nix::net::if_::if_indextoname(config.primary_ifindex)
        .map_err(|_| TakeOverError::NoPrimaryLink(config.primary_ifindex))?
        .to_string_lossy()
        .into_owned();
    let (mut vpc_cidrs, mut exclude_snat_cidrs) = (Vec::new(), Vec::new());
    for (net, kind) in maps.cidrs()? {
        match kind {
            Some(CidrKind::Vpc) => vpc_cidrs.push(net),
            Some(CidrKind::Excluded) => exclude_snat_cidrs.push(net),
            _ => {}
        }
    }
    let wiring = NodeWiring {
        node_addr: Ipv4Addr::from(raw_to_addr(config.node_addr)),
        primary_interface,
        vpc_cidrs,
        exclude_snat_cidrs,
        external_snat: config.external_snat(),
        randomize_snat: config.randomize_mode().env_value().to_owned(),
        connmark: opts.connmark,
        veth_prefix: opts.veth_prefix.clone(),
    };
    let allocations = Checkpoint::read(&opts.checkpoint)?.map(|c| c.allocations);
    let mut pods = Vec::new();
    let mut policy_pods = Vec::new();
    for allocation in allocations.iter().flatten() {
        let Some(addr) = allocation.ipv4 else {
            continue;
        };
        let table = match maps.endpoint(addr)? {
            Some(entry) if entry.flags & ENDPOINT_BRANCH != 0 => continue,
            Some(entry) => {
                policy_pods.push(network_policy::HandedBackPod {
                    addr,
                    ifindex: entry.ifindex,
                    identifier: pod_identifier(
                        &allocation.metadata.k8s_pod_name,
                        &allocation.metadata.k8s_pod_namespace,
                    ),
                });
                eni_table(&maps, netlink, entry.eni_ifindex, &device_number).await?
            }
            None => MAIN_TABLE,
        };
        pods.push(HandedBackPod { addr, table });
    }
    let branch_pods = handed_back_branch_pods(&maps)?;
    let ip_rules_added = restore_vpc_cni_wiring(netlink, &wiring, &pods, &branch_pods).await?;
    let flows_exported = export_flows(&maps, opts.connmark)?;
    let pod_addrs: Vec<Ipv4Addr> = pods
        .iter()
        .map(|pod| pod.addr)
        .chain(branch_pods.iter().map(|pod| pod.addr))
        .collect();
    let stale_forgotten = forget_stale_connections(&pod_addrs)?;
    // While the datapath still judges: aws-node's programs take over on
    // the pods' veths as its own go.
    let policy = network_policy::hand_back(
        &opts.network_policy_pins,
        &policy_pods,
        &crate::policy::maps::flows(&maps)?,
    )?;
    drop(maps);
    remove_pins(&opts.pin_dir).map_err(|source| TakeOverError::Unpin {
        pin_dir: opts.pin_dir.clone(),
        source,
    })?;
    let conflist_restored = match &opts.cni_conf_dir {
        Some(dir) => hand_back_conflist(dir)?,
        None => false,
    };
    Ok(HandBack {
        pods: pods.len() + branch_pods.len(),
        ip_rules_added,
        flows_exported,
        stale_forgotten,
        policy,
        conflist_restored,
    })
}

/// The datapath's branch-ENI pods, as aws-node's plugin would have wired
/// them: each entry's host veth and branch link by their indices, the
/// link's gateway from its ENI entry, the mode from the entry's flags.
fn handed_back_branch_pods(maps: &DatapathMaps) -> Result<Vec<BranchPodWiring>, TakeOverError> {
    let enis = maps.enis()?;
    let mut pods = Vec::new();
    for (addr, entry) in maps.endpoints()? {
        if entry.flags & ENDPOINT_BRANCH == 0 {
            continue;
        }
        let name = |index| {
            nix::net::if_::if_indextoname(index)
                .ok()
                .map(|name| name.to_string_lossy().into_owned())
        };
        let (Some(host_veth), Some(link)) = (name(entry.ifindex), name(entry.eni_ifindex)) else {
            warn!(%addr, "a branch pod whose links are gone: nothing to hand back");
            continue;
        };
        let vlan_id = link
            .strip_prefix(BRANCH_LINK_PREFIX)
            .and_then(|id| id.parse().ok());
        let gateway = enis
            .iter()
            .find(|(index, _)| *index == entry.eni_ifindex)
            .map(|(_, eni)| Ipv4Addr::from(raw_to_addr(eni.gateway)));
        let (Some(vlan_id), Some(gateway)) = (vlan_id, gateway) else {
            warn!(%addr, %link, "a branch pod on a link that is not a VLAN of the VPC CNI's: not handed back");
            continue;
        };
        pods.push(BranchPodWiring {
            addr,
            host_veth,
            vlan_id,
            gateway,
            strict: entry.flags & ENDPOINT_STRICT != 0,
        });
    }
    Ok(pods)
}

/// Removes vpcnet's conflist from `dir` and puts aws-node's back; returns
/// whether aws-node's was set aside.
pub fn hand_back_conflist(dir: &Path) -> Result<bool, TakeOverError> {
    let ours = dir.join(CONFLIST_NAME);
    match std::fs::remove_file(&ours) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(TakeOverError::Remove { path: ours, source }),
    }
    restore_aws_conflist(dir)
}

/// The route table of the ENI at `ifindex`: `main` for the primary ENI,
/// else its device number + 1, the device number asked of `device_number`
/// (IMDS) by the link's MAC.
async fn eni_table(
    maps: &DatapathMaps,
    netlink: &NetlinkHandle,
    ifindex: u32,
    device_number: &impl AsyncFn(MacAddr) -> Result<u32, TakeOverError>,
) -> Result<u32, TakeOverError> {
    if maps
        .enis
        .get(&ifindex, 0)
        .is_ok_and(|eni| eni.flags & ENI_PRIMARY != 0)
    {
        return Ok(MAIN_TABLE);
    }
    let mac = netlink
        .links()
        .await?
        .into_iter()
        .find(|link| link.index == ifindex)
        .and_then(|link| link.mac)
        .ok_or(TakeOverError::NoEniLink(ifindex))?;
    Ok(vpc_cni::eni_route_table(device_number(mac).await?))
}
