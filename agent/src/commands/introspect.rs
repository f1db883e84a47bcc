//! The operator's commands that ask the running agent's introspection
//! endpoint (`vpcnet-agent pods`, `enis`) and print readable tables, and
//! the `DaemonSet`'s probe (`vpcnet-agent probe`), which asks its CNI socket.

use std::{fmt::Write, path::Path, time::Duration};

use anyhow::{Context, Result, bail};
use hyper::StatusCode;
use serde::de::DeserializeOwned;
use vpcnet_agent::introspect::{
    self, ListenAddr,
    views::{DirectionView, EnisView, ErrorView, PodsView, PolicyView},
};
use vpcnet_api::cluster_policy::{TIER_ADMIN, TIER_BASELINE};

/// Where the running agent serves introspection.
#[derive(clap::Args)]
pub struct IntrospectionEndpoint {
    /// The agent's introspection endpoint: `address:port` or `unix:/path`.
    #[arg(
        long,
        env = introspect::ENV_INTROSPECTION_BIND_ADDRESS,
        default_value = introspect::DEFAULT_INTROSPECTION_ADDRESS
    )]
    introspection_address: String,
}

/// `GET path` as `T`; an error answer becomes an error naming the agent's
/// reason.
fn fetch<T: DeserializeOwned>(endpoint: &IntrospectionEndpoint, path: &str) -> Result<T> {
    let addr: ListenAddr = endpoint
        .introspection_address
        .parse()
        .map_err(anyhow::Error::msg)
        .context("--introspection-address")?;
    let runtime = super::runtime()?;
    let (status, body) = runtime
        .block_on(introspect::get(&addr, path))
        .with_context(|| {
            format!("is the agent running, with introspection on {addr}? (DISABLE_INTROSPECTION)")
        })?;
    if status != StatusCode::OK {
        let reason = serde_json::from_slice::<ErrorView>(&body)
            .map_or_else(|_| String::from_utf8_lossy(&body).into_owned(), |e| e.error);
        bail!("{path}: {status}: {reason}");
    }
    serde_json::from_slice(&body).with_context(|| format!("reading the answer to {path}"))
}

/// Asks the agent's CNI backend for its status within `timeout`: an
/// answer is alive; with `ready`, the agent must also be able to serve an
/// ADD. An error (the probe's failure) says why not.
pub fn probe(socket: &Path, ready: bool, timeout: Duration) -> Result<()> {
    let runtime = super::runtime()?;
    let status = runtime
        .block_on(async {
            tokio::time::timeout(timeout, async {
                let mut client = vpcnet_api::connect_cni(socket).await?;
                let status = client
                    .status(vpcnet_api::cni::StatusRequest {})
                    .await?
                    .into_inner();
                anyhow::Ok(status)
            })
            .await
            .map_err(|_| anyhow::anyhow!("no answer within {timeout:?}"))?
        })
        .with_context(|| format!("the agent does not answer on {}", socket.display()))?;
    if ready && !status.ready {
        bail!("the agent answers but is not ready: {}", status.reason);
    }
    println!(
        "{} ({} addresses free)",
        if status.ready { "ready" } else { "alive" },
        status.available_addrs
    );
    Ok(())
}

pub fn print_pods(endpoint: &IntrospectionEndpoint) -> Result<()> {
    let view: PodsView = fetch(endpoint, "/v1/pods")?;
    print!("{}", pods_table(&view));
    Ok(())
}

/// `vpcnet-agent policy [NAMESPACE/POD]`: the rules in force, one line per
/// rule, with the policy each came from.
pub fn print_policy(endpoint: &IntrospectionEndpoint, pod: Option<&str>) -> Result<()> {
    let path = match pod {
        Some(pod) => format!("/v1/policy?pod={pod}"),
        None => "/v1/policy".to_owned(),
    };
    let view: PolicyView = fetch(endpoint, &path)?;
    print!("{}", policy_table(&view));
    Ok(())
}

/// A rule's ports, or `any` for a rule without.
fn ports_or_any(ports: &[String]) -> String {
    if ports.is_empty() {
        "any".to_owned()
    } else {
        ports.join(",")
    }
}

/// One direction's rules, (tier, peers, ports, policy), in the order they
/// are judged: Admin, NetworkPolicy, Baseline.
fn direction_lines(direction: &DirectionView) -> Vec<[String; 4]> {
    let cluster = |tier: &'static str| {
        direction
            .cluster
            .iter()
            .filter(move |r| r.tier == tier)
            .map(|r| {
                [
                    format!("{} {} {}", r.tier, r.priority, r.action),
                    r.peers.join(" "),
                    ports_or_any(&r.ports),
                    r.policy.clone(),
                ]
            })
    };
    let mut lines: Vec<[String; 4]> = cluster(TIER_ADMIN).collect();
    let policy = || "NetworkPolicy".to_owned();
    match direction {
        DirectionView {
            isolated: false, ..
        } => lines.push([
            policy(),
            "everything (not isolated)".into(),
            "-".into(),
            "-".into(),
        ]),
        DirectionView { rules, .. } if rules.is_empty() => {
            lines.push([policy(), "nothing".into(), "-".into(), "-".into()]);
        }
        DirectionView { rules, .. } => lines.extend(rules.iter().map(|rule| {
            [
                policy(),
                rule.peers.join(" "),
                ports_or_any(&rule.ports),
                rule.policy.clone(),
            ]
        })),
    }
    lines.extend(cluster(TIER_BASELINE));
    lines
}

fn policy_table(view: &PolicyView) -> String {
    let Some(mode) = &view.mode else {
        return "network policy is not enforced (ENABLE_NETWORK_POLICY)\n".to_owned();
    };
    let mut rows = Vec::new();
    for pod in &view.pods {
        let who = format!("{}/{}", pod.namespace, pod.name);
        for (name, direction) in [("ingress", &pod.ingress), ("egress", &pod.egress)] {
            let lines = if pod.held {
                vec![[
                    "-".into(),
                    "as the datapath held them (policies not listed yet)".into(),
                    "-".into(),
                    "-".into(),
                ]]
            } else {
                direction_lines(direction)
            };
            for [tier, peers, ports, policy] in lines {
                rows.push(vec![
                    who.clone(),
                    pod.address.to_string(),
                    name.to_owned(),
                    tier,
                    peers,
                    ports,
                    policy,
                ]);
            }
        }
    }
    let verdicts: Vec<Vec<String>> = view
        .pods
        .iter()
        .map(|pod| {
            let v = &pod.verdicts;
            vec![
                format!("{}/{}", pod.namespace, pod.name),
                pod.address.to_string(),
                v.ingress_allowed.to_string(),
                v.ingress_denied.to_string(),
                v.egress_allowed.to_string(),
                v.egress_denied.to_string(),
            ]
        })
        .collect();
    format!(
        "mode: {mode}\n{}\nverdicts (connections allowed, packets denied):\n{}",
        table(
            &[
                "POD",
                "ADDRESS",
                "DIRECTION",
                "TIER",
                "PEERS",
                "PORTS",
                "POLICY"
            ],
            &rows
        ),
        table(
            &[
                "POD",
                "ADDRESS",
                "IN ALLOWED",
                "IN DENIED",
                "OUT ALLOWED",
                "OUT DENIED"
            ],
            &verdicts
        )
    )
}

pub fn print_enis(endpoint: &IntrospectionEndpoint, all: bool) -> Result<()> {
    let view: EnisView = fetch(endpoint, "/v1/enis")?;
    print!("{}", enis_table(&view, all));
    Ok(())
}

/// Columns padded to their widest cell, two spaces apart.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = header.iter().map(|h| (*h).to_owned()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (i, (cell, width)) in row.iter().zip(&widths).enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            let _ = write!(line, "{cell:<width$}");
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn or_dash(value: Option<impl ToString>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// The first 12 characters of a container id, as the runtimes print it.
fn short_id(id: &str) -> &str {
    id.get(..12).unwrap_or(id)
}

fn pods_table(view: &PodsView) -> String {
    let mut out = String::new();
    if view.ipam {
        let rows: Vec<Vec<String>> = view
            .pods
            .iter()
            .map(|p| {
                let entry = p.endpoint.as_ref();
                vec![
                    p.namespace.clone(),
                    p.name.clone(),
                    p.address.to_string(),
                    match (&p.eni, p.device_number) {
                        (Some(eni), Some(device)) => format!("{eni} ({device})"),
                        (eni, _) => or_dash(eni.as_ref()),
                    },
                    or_dash(p.host_veth.as_ref()),
                    or_dash(entry.map(|e| e.ifindex)),
                    or_dash(entry.and_then(|e| e.eni_interface.as_ref())),
                    match entry {
                        None => "no entry".to_owned(),
                        Some(e) if e.programs_attached => "yes".to_owned(),
                        Some(_) => "NOT ATTACHED".to_owned(),
                    },
                    short_id(&p.container_id).to_owned(),
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                "NAMESPACE",
                "NAME",
                "ADDRESS",
                "ENI (DEVICE)",
                "HOST VETH",
                "IFINDEX",
                "LEAVES BY",
                "DATAPATH",
                "CONTAINER",
            ],
            &rows,
        ));
        let _ = writeln!(out, "{} pods", view.count);
    } else {
        out.push_str("the agent runs without --ipam: no address manager, only datapath entries\n");
    }
    if !view.datapath_only.is_empty() {
        let rows: Vec<Vec<String>> = view
            .datapath_only
            .iter()
            .map(|e| {
                vec![
                    e.address.to_string(),
                    or_dash(e.entry.interface.as_ref()),
                    e.entry.ifindex.to_string(),
                    or_dash(e.entry.eni_interface.as_ref()),
                    e.entry.mac.clone(),
                    if e.entry.programs_attached {
                        "yes"
                    } else {
                        "NOT ATTACHED"
                    }
                    .to_owned(),
                ]
            })
            .collect();
        out.push_str("\ndatapath entries of no pod of the address manager:\n");
        out.push_str(&table(
            &[
                "ADDRESS",
                "HOST VETH",
                "IFINDEX",
                "LEAVES BY",
                "POD MAC",
                "DATAPATH",
            ],
            &rows,
        ));
    }
    out
}

fn enis_table(view: &EnisView, all: bool) -> String {
    let mut out = String::new();
    if view.ipam {
        let rows: Vec<Vec<String>> = view
            .enis
            .iter()
            .map(|e| {
                let mut flags = Vec::new();
                if e.primary {
                    flags.push("primary");
                }
                if e.no_manage {
                    flags.push("no_manage");
                }
                if e.excluded_for_pods {
                    flags.push("no pods");
                }
                if e.link.is_none() {
                    flags.push("NO LINK");
                } else if !e.datapath.as_ref().is_some_and(|d| d.programs_attached) {
                    flags.push("NOT ATTACHED");
                }
                vec![
                    e.id.clone(),
                    e.device_number.to_string(),
                    e.mac.clone(),
                    or_dash(
                        e.link
                            .as_ref()
                            .map(|l| format!("{} ({})", l.name, l.ifindex)),
                    ),
                    e.subnet.clone(),
                    or_dash(e.primary_address),
                    format!("{}/{}", e.assigned_addresses, e.total_addresses),
                    if e.prefixes.is_empty() {
                        "-".to_owned()
                    } else {
                        e.prefixes.join(",")
                    },
                    flags.join(","),
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                "ENI",
                "DEVICE",
                "MAC",
                "LINK",
                "SUBNET",
                "ENI ADDRESS",
                "ASSIGNED",
                "PREFIXES",
                "",
            ],
            &rows,
        ));
        let _ = writeln!(
            out,
            "{} ENIs (at most {}), {} of {} addresses assigned",
            view.count,
            or_dash(view.max_enis),
            view.assigned_addresses,
            view.total_addresses
        );
        out.push_str(&addresses_table(view, all));
    } else {
        out.push_str("the agent runs without --ipam: no address manager, only datapath entries\n");
    }
    if !view.datapath_only.is_empty() {
        out.push_str("\ndatapath ENI entries of no ENI of the address manager:\n");
        out.push_str(&datapath_enis_table(view));
    }
    out
}

/// Each ENI's addresses held by pods (`all`: and the free ones).
fn addresses_table(view: &EnisView, all: bool) -> String {
    let mut out = String::new();
    for eni in &view.enis {
        let rows: Vec<Vec<String>> = eni
            .addresses
            .iter()
            .filter(|a| all || a.pod.is_some())
            .map(|a| {
                vec![
                    format!("  {}", a.address),
                    a.pod.as_ref().map_or_else(
                        || "free".to_owned(),
                        |p| format!("{}/{}", p.namespace, p.name),
                    ),
                    a.prefix.clone().unwrap_or_default(),
                ]
            })
            .collect();
        if rows.is_empty() {
            continue;
        }
        let _ = writeln!(out, "\n{}:", eni.id);
        let table = table(&["  ADDRESS", "POD", "PREFIX"], &rows);
        out.push_str(&table);
    }
    out
}

/// The datapath's ENI entries of no ENI of the address manager.
fn datapath_enis_table(view: &EnisView) -> String {
    let rows: Vec<Vec<String>> = view
        .datapath_only
        .iter()
        .map(|e| {
            let mut flags = Vec::new();
            if e.entry.primary {
                flags.push("primary");
            }
            if e.entry.branch {
                flags.push("branch");
            }
            if !e.entry.programs_attached {
                flags.push("NOT ATTACHED");
            }
            vec![
                or_dash(e.interface.as_ref()),
                e.ifindex.to_string(),
                e.entry.gateway.to_string(),
                flags.join(","),
            ]
        })
        .collect();
    table(&["LINK", "IFINDEX", "GATEWAY", ""], &rows)
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use vpcnet_agent::introspect::views::{
        AddressView, ClusterRuleView, DatapathEniEntryView, EndpointEntryView, EniView, LinkView,
        PodPolicyView, PodRef, PodView, RuleView, VerdictsView,
    };

    use super::*;

    #[test]
    fn policy_as_a_table_rule_by_rule() {
        let view = PolicyView {
            enforced: true,
            mode: Some("strict".into()),
            pods: vec![PodPolicyView {
                namespace: "x".into(),
                name: "a".into(),
                address: Ipv4Addr::new(10, 20, 11, 20),
                held: false,
                ingress: DirectionView {
                    isolated: true,
                    rules: vec![RuleView {
                        peers: vec!["0.0.0.0/0 except 203.0.113.0/24".into()],
                        ports: vec!["TCP/80".into(), "UDP/1000-2000".into()],
                        policy: "x/web".into(),
                    }],
                    cluster: vec![ClusterRuleView {
                        tier: "Admin".into(),
                        priority: 10,
                        action: "Deny".into(),
                        peers: vec!["203.0.113.7/32".into()],
                        ports: vec![],
                        policy: "deny-scanner".into(),
                    }],
                },
                egress: DirectionView {
                    isolated: false,
                    rules: vec![],
                    cluster: vec![],
                },
                verdicts: VerdictsView {
                    ingress_allowed: 3,
                    ingress_denied: 12,
                    egress_allowed: 7,
                    egress_denied: 0,
                },
            }],
        };
        assert_eq!(
            policy_table(&view),
            "mode: strict\n\
             POD  ADDRESS      DIRECTION  TIER           PEERS                            PORTS                 POLICY\n\
             x/a  10.20.11.20  ingress    Admin 10 Deny  203.0.113.7/32                   any                   deny-scanner\n\
             x/a  10.20.11.20  ingress    NetworkPolicy  0.0.0.0/0 except 203.0.113.0/24  TCP/80,UDP/1000-2000  x/web\n\
             x/a  10.20.11.20  egress     NetworkPolicy  everything (not isolated)        -                     -\n\
             \n\
             verdicts (connections allowed, packets denied):\n\
             POD  ADDRESS      IN ALLOWED  IN DENIED  OUT ALLOWED  OUT DENIED\n\
             x/a  10.20.11.20  3           12         7            0\n"
        );
        let off = PolicyView {
            enforced: false,
            mode: None,
            pods: vec![],
        };
        assert!(policy_table(&off).contains("not enforced"));
    }

    #[test]
    fn tables_align_and_trim() {
        assert_eq!(
            table(
                &["A", "BB", "C"],
                &[
                    vec!["xxx".into(), "y".into(), String::new()],
                    vec!["x".into(), "yyy".into(), "z".into()]
                ]
            ),
            "A    BB   C\nxxx  y\nx    yyy  z\n"
        );
    }

    #[test]
    fn pods_as_a_table() {
        let view = PodsView {
            ipam: true,
            count: 2,
            pods: vec![
                PodView {
                    namespace: "default".into(),
                    name: "web-0".into(),
                    container_id: "0123456789abcdef".into(),
                    network: "aws-cni".into(),
                    ifname: "eth0".into(),
                    address: Ipv4Addr::new(10, 20, 11, 20),
                    eni: Some("eni-0a".into()),
                    device_number: Some(0),
                    host_veth: Some("eni0123456789a".into()),
                    endpoint: Some(EndpointEntryView {
                        ifindex: 12,
                        interface: Some("eni0123456789a".into()),
                        eni_ifindex: 2,
                        eni_interface: Some("eth0".into()),
                        mac: "02:00:00:00:00:01".into(),
                        host_mac: "02:00:00:00:00:02".into(),
                        branch: false,
                        strict: false,
                        programs_attached: true,
                    }),
                },
                PodView {
                    namespace: "default".into(),
                    name: "web-1".into(),
                    container_id: "ff".into(),
                    network: "aws-cni".into(),
                    ifname: "eth0".into(),
                    address: Ipv4Addr::new(10, 20, 11, 21),
                    eni: Some("eni-0a".into()),
                    device_number: Some(0),
                    host_veth: None,
                    endpoint: None,
                },
            ],
            datapath_only: vec![],
        };
        let text = pods_table(&view);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("NAMESPACE  NAME   ADDRESS "), "{text}");
        assert!(
            lines[1].contains("web-0")
                && lines[1].contains("10.20.11.20")
                && lines[1].contains("eni-0a (0)")
                && lines[1].contains(" yes ")
                && lines[1].ends_with("0123456789ab"),
            "{text}"
        );
        assert!(lines[2].contains("no entry"), "{text}");
        assert_eq!(lines[3], "2 pods");
    }

    #[test]
    fn enis_as_a_table() {
        let view = EnisView {
            ipam: true,
            count: 1,
            max_enis: Some(3),
            total_addresses: 2,
            assigned_addresses: 1,
            enis: vec![EniView {
                id: "eni-0a".into(),
                device_number: 0,
                mac: "02:ee:0a:14:0b:a2".into(),
                attachment_id: None,
                primary: true,
                no_manage: false,
                excluded_for_pods: false,
                subnet: "10.20.11.0/24".into(),
                gateway: Ipv4Addr::new(10, 20, 11, 1),
                primary_address: Some(Ipv4Addr::new(10, 20, 11, 162)),
                link: Some(LinkView {
                    name: "eth0".into(),
                    ifindex: 2,
                }),
                datapath: Some(DatapathEniEntryView {
                    gateway: Ipv4Addr::new(10, 20, 11, 1),
                    primary: true,
                    branch: false,
                    programs_attached: true,
                }),
                total_addresses: 2,
                assigned_addresses: 1,
                prefixes: vec![],
                addresses: vec![
                    AddressView {
                        address: Ipv4Addr::new(10, 20, 11, 20),
                        prefix: None,
                        pod: Some(PodRef {
                            namespace: "default".into(),
                            name: "web-0".into(),
                            container_id: "c".into(),
                        }),
                    },
                    AddressView {
                        address: Ipv4Addr::new(10, 20, 11, 21),
                        prefix: None,
                        pod: None,
                    },
                ],
            }],
            datapath_only: vec![],
        };
        let text = enis_table(&view, false);
        assert!(text.contains("eth0 (2)") && text.contains("1/2"), "{text}");
        assert!(text.contains("1 ENIs (at most 3), 1 of 2 addresses assigned"));
        assert!(text.contains("10.20.11.20  default/web-0"), "{text}");
        assert!(!text.contains("free"), "{text}");
        assert!(enis_table(&view, true).contains("10.20.11.21  free"));
    }
}
