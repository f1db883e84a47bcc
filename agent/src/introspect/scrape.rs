//! The scrape: each owner (the address manager, the datapath, the cloud
//! client, the Kubernetes side) registers and describes its families in a
//! registry of the scrape, read from its snapshot; this side only gathers
//! them and writes Prometheus' text format.

use std::sync::Arc;

use prometheus::{Registry, TextEncoder};

use super::{
    IntrospectError,
    handlers::{self, Shared},
};
use crate::{
    cloud,
    datapath::{self, metrics::DatapathSnapshot},
    ipam::{self, metrics::PoolSnapshot},
    k8s,
    policy::{self, node::PodSnapshot},
    telemetry::{self, Recorded},
};

/// The `Content-Type` of Prometheus' text format, version 0.0.4.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What one scrape reports, gathered from the owners.
#[derive(Clone, Debug)]
pub struct MetricsSnapshot {
    /// The address manager's pool (`None` without `--ipam`).
    pub ipam: Option<PoolSnapshot>,
    pub datapath: DatapathSnapshot,
    /// Network policy's local pods (none when it is off).
    pub policy: Vec<PodSnapshot>,
    /// What the cloud client, the address manager, the Kubernetes side and
    /// the CNI backend recorded.
    pub recorded: Recorded,
}

/// Asks each owner for its part of a scrape.
pub(super) async fn snapshot(state: &Arc<Shared>) -> Result<MetricsSnapshot, IntrospectError> {
    let ipam = match &state.pods {
        Some(pods) => Some(PoolSnapshot::read(pods.manager()).await),
        None => None,
    };
    let datapath = handlers::read_maps(state, |s| {
        DatapathSnapshot::read(&s.maps, s.datapath().attached().count(), s.collector())
    })
    .await?;
    let policy = match state.pods.as_ref().and_then(|p| p.policy()) {
        Some(node) => node.snapshot().await?,
        None => Vec::new(),
    };
    Ok(MetricsSnapshot {
        ipam,
        datapath,
        policy,
        recorded: telemetry::snapshot(),
    })
}

/// The scrape's text: each owner registers its families with the scrape's
/// registry, which the text encoder writes out.
///
/// # Errors
/// A family an owner described wrongly (a name the registry refuses, or one
/// name twice).
pub fn render_metrics(snapshot: &MetricsSnapshot) -> prometheus::Result<String> {
    let registry = Registry::new();
    ipam::metrics::register_agent(&registry, &snapshot.recorded)?;
    if let Some(pool) = &snapshot.ipam {
        ipam::metrics::register_pool(&registry, pool, &snapshot.recorded)?;
    }
    cloud::metrics::register(&registry, &snapshot.recorded)?;
    k8s::metrics::register(&registry, &snapshot.recorded)?;
    datapath::metrics::register(&registry, &snapshot.datapath)?;
    policy::metrics::register(&registry, &snapshot.policy)?;
    TextEncoder::new().encode_to_string(&registry.gather())
}

#[cfg(test)]
mod tests {
    use std::{
        collections::{BTreeMap, BTreeSet},
        time::Duration,
    };

    use vpcnet_common::{addr_to_raw, counters::Counter, policy::PodVerdicts, port_to_raw};

    use super::*;
    use crate::{
        datapath::{CollectorReport, EndpointPorts, MapFill, NatPressure},
        ipam::{manager::IpamStatus, pool::PoolStats},
        policy::node::PodName,
    };

    fn n(value: usize) -> u64 {
        u64::try_from(value).unwrap_or(u64::MAX)
    }

    /// `[a-zA-Z_:][a-zA-Z0-9_:]*`
    fn valid_metric_name(name: &str) -> bool {
        let mut chars = name.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    }

    /// `[a-zA-Z_][a-zA-Z0-9_]*`, and not starting with `__` (reserved).
    fn valid_label_name(name: &str) -> bool {
        let mut chars = name.chars();
        !name.starts_with("__")
            && chars
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
    }

    #[test]
    fn names() {
        for good in ["a", "awscni_eni_max", "_x", "ns:sub_total", "A9"] {
            assert!(valid_metric_name(good), "{good}");
        }
        for bad in ["", "9a", "a-b", "a b", "é"] {
            assert!(!valid_metric_name(bad), "{bad}");
        }
        for good in ["reason", "_r", "r2"] {
            assert!(valid_label_name(good), "{good}");
        }
        for bad in ["", "__name__", "a:b", "2r", "a-b"] {
            assert!(!valid_label_name(bad), "{bad}");
        }
    }

    fn snapshot(ipam: bool) -> MetricsSnapshot {
        let status = IpamStatus {
            stats: PoolStats {
                total_ips: 18,
                assigned_ips: 3,
                cooling_ips: 1,
                total_prefixes: 0,
                free_prefixes: 0,
            },
            enis: 2,
            max_enis: 3,
            max_pods: 29,
            max_ips: 27,
            prefix_fallback: false,
            counters: vec![
                ("assigned", 4),
                ("assign_failures", 1),
                ("released", 1),
                ("ec2_errors", 2),
                ("ec2_throttled", 1),
                ("enis_found", 1),
                ("cidrs_found", 3),
                ("cidrs_lost", 2),
            ],
            events: vec![],
        };
        MetricsSnapshot {
            ipam: ipam.then(|| PoolSnapshot {
                status,
                per_eni: vec![("eni-0".to_owned(), 2), ("eni-\"odd\"\n".to_owned(), 1)],
                per_cidr: vec![
                    ("10.0.1.5/32".to_owned(), 1),
                    ("10.0.2.16/28".to_owned(), 3),
                ],
            }),
            datapath: DatapathSnapshot {
                counters: Counter::ALL
                    .iter()
                    .enumerate()
                    .map(|(i, c)| (*c, n(i)))
                    .collect(),
                endpoints: 3,
                attached_interfaces: 5,
                external_snat: false,
                pressure: NatPressure {
                    nat_fwd: MapFill {
                        entries: 5,
                        capacity: 262_144,
                    },
                    nat_rev: MapFill {
                        entries: 6,
                        capacity: 262_144,
                    },
                    stack_flows: MapFill {
                        entries: 4,
                        capacity: 262_144,
                    },
                    busiest: vec![
                        EndpointPorts {
                            proto: 6,
                            addr: addr_to_raw([203, 0, 113, 10]),
                            port: port_to_raw(443),
                            ports: 4,
                        },
                        EndpointPorts {
                            proto: 17,
                            addr: addr_to_raw([203, 0, 113, 53]),
                            port: port_to_raw(53),
                            ports: 2,
                        },
                    ],
                },
                collector: CollectorReport {
                    passes: 7,
                    last_pass: Duration::from_micros(1500),
                    expired: 9,
                    orphans: 1,
                },
            },
            policy: vec![PodSnapshot {
                addr: std::net::Ipv4Addr::new(10, 20, 11, 20),
                name: PodName {
                    namespace: "x".into(),
                    name: "web".into(),
                },
                rules: None,
                verdicts: PodVerdicts {
                    ingress_allowed: 3,
                    ingress_denied: 12,
                    egress_allowed: 7,
                    egress_denied: 0,
                },
            }],
            // Without the address manager nothing calls AWS or serves the
            // plugin.
            recorded: if ipam {
                recorded()
            } else {
                Recorded::default()
            },
        }
    }

    /// AWS calls, a DEL, a pod-ENI error, a start, as the recorder holds
    /// them.
    fn recorded() -> Recorded {
        use telemetry::Outcome;
        let mut r = Recorded::default();
        r.ec2_call(
            "CreateNetworkInterface",
            Duration::from_millis(40),
            Outcome::Ok,
        );
        r.ec2_call(
            "CreateNetworkInterface",
            Duration::from_millis(7),
            Outcome::ApiError("RequestLimitExceeded"),
        );
        r.aws_call(telemetry::IMDS_API, Duration::from_millis(2), Outcome::Ok);
        r.del_request("PodDeleted");
        r.pod_eni_errors
            .insert(telemetry::POD_ENI_ENABLE_SECURITY_GROUPS, 2);
        r.kubernetes_answers.insert(Some(403), 3);
        r.kubernetes_answers.insert(None, 1);
        r.actions.insert(telemetry::ACTION_INCREASE_POOL, 1);
        r.startup
            .entry(telemetry::StartupKey {
                success: true,
                with_api_server: false,
                failure_reason: "",
            })
            .or_default()
            .observe(1.5);
        r.node_init.entry(true).or_default().observe(0.2);
        r
    }

    /// A sample line: name, labels (unescaped), value.
    type Parsed = (String, Vec<(String, String)>, f64);

    /// Reads an exposition as Prometheus would, strictly: every family
    /// has HELP then TYPE before its samples, names are valid, label
    /// values are quoted and escaped.
    fn parse(text: &str) -> (BTreeMap<String, String>, Vec<Parsed>) {
        let mut types = BTreeMap::new();
        let mut helped = BTreeSet::new();
        let mut samples = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, _) = rest.split_once(' ').expect("HELP name text");
                assert!(helped.insert(name.to_owned()), "HELP twice for {name}");
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("TYPE name kind");
                assert!(helped.contains(name), "TYPE before HELP for {name}");
                assert!(
                    ["counter", "gauge", "histogram", "summary"].contains(&kind),
                    "{line}"
                );
                assert!(
                    types.insert(name.to_owned(), kind.to_owned()).is_none(),
                    "TYPE twice for {name}"
                );
                continue;
            }
            assert!(!line.starts_with('#'), "{line}");
            let (series, value) = line.rsplit_once(' ').expect("series value");
            let value: f64 = value.parse().expect("a number");
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => {
                    let body = rest.strip_suffix('}').expect("closing brace");
                    (name, parse_labels(body))
                }
                None => (series, Vec::new()),
            };
            assert!(valid_metric_name(name), "{name}");
            // A histogram's or a summary's samples carry a suffix.
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| {
                    name.strip_suffix(suffix).filter(|f| {
                        types
                            .get(*f)
                            .is_some_and(|k| k != "counter" && k != "gauge")
                    })
                })
                .unwrap_or(name);
            assert!(
                types.contains_key(family),
                "sample of {name} before its TYPE"
            );
            samples.push((name.to_owned(), labels, value));
        }
        (types, samples)
    }

    fn parse_labels(body: &str) -> Vec<(String, String)> {
        let mut labels = Vec::new();
        let mut chars = body.chars().peekable();
        while chars.peek().is_some() {
            let name: String = chars.by_ref().take_while(|c| *c != '=').collect();
            assert!(valid_label_name(&name), "{name}");
            assert_eq!(chars.next(), Some('"'));
            let mut value = String::new();
            loop {
                match chars.next().expect("unterminated label value") {
                    '\\' => match chars.next() {
                        Some('\\') => value.push('\\'),
                        Some('"') => value.push('"'),
                        Some('n') => value.push('\n'),
                        other => panic!("bad escape {other:?}"),
                    },
                    '"' => break,
                    '\n' => panic!("raw line feed in a label value"),
                    c => value.push(c),
                }
            }
            labels.push((name, value));
            if chars.peek() == Some(&',') {
                chars.next();
            }
        }
        labels
    }

    fn value(samples: &[Parsed], name: &str, labels: &[(&str, &str)]) -> u64 {
        let value = float_value(samples, name, labels);
        assert!(value.fract() == 0.0 && value >= 0.0, "{name}: {value}");
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // checked
        {
            value as u64
        }
    }

    fn float_value(samples: &[Parsed], name: &str, labels: &[(&str, &str)]) -> f64 {
        samples
            .iter()
            .find(|(n, l, _)| {
                n == name
                    && l.len() == labels.len()
                    && labels
                        .iter()
                        .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .unwrap_or_else(|| panic!("no sample {name}{labels:?}"))
            .2
    }

    /// A sample's name, labels and value.
    type Expected<'a> = (&'a str, &'a [(&'a str, &'a str)], u64);

    #[test]
    fn metrics_with_the_address_manager() {
        let text = render_metrics(&snapshot(true)).unwrap();
        let (types, samples) = parse(&text);
        let expected: &[Expected] = &[
            ("awscni_eni_allocated", &[], 2),
            ("awscni_eni_max", &[], 3),
            ("awscni_ip_max", &[], 27),
            ("awscni_total_ip_addresses", &[], 18),
            ("awscni_assigned_ip_addresses", &[], 3),
            ("awscni_add_ip_req_count", &[], 5),
            ("awscni_no_available_ip_addresses", &[], 1),
            ("awscni_ipamd_error_count", &[("fn", "reconcile")], 2),
            ("awscni_assigned_ip_per_eni", &[("eni", "eni-0")], 2),
            // A label value with a quote and a line feed comes back intact.
            ("awscni_assigned_ip_per_eni", &[("eni", "eni-\"odd\"\n")], 1),
            ("vpcnet_ipam_released_total", &[], 1),
            ("vpcnet_ipam_cooling_ip_addresses", &[], 1),
            // NAT pressure: each map's fill, the busiest remote endpoints,
            // the collector's work.
            ("vpcnet_nat_flows", &[], 5),
            ("vpcnet_map_entries", &[("map", "VPCNET_NAT_REV")], 6),
            (
                "vpcnet_map_capacity",
                &[("map", "VPCNET_STACK_PAIRS")],
                262_144,
            ),
            (
                "vpcnet_nat_remote_endpoint_ports",
                &[("proto", "tcp"), ("remote", "203.0.113.10:443")],
                4,
            ),
            ("vpcnet_gc_passes_total", &[], 7),
            ("vpcnet_gc_last_pass_microseconds", &[], 1500),
            ("vpcnet_gc_removed_total", &[("reason", "expired")], 9),
            (
                "vpcnet_policy_pod_verdicts_total",
                &[
                    ("namespace", "x"),
                    ("pod", "web"),
                    ("direction", "ingress"),
                    ("verdict", "denied"),
                ],
                12,
            ),
        ];
        for (name, labels, want) in expected {
            assert_eq!(value(&samples, name, labels), *want, "{name}{labels:?}");
        }
        // Counters are counters, pool figures gauges.
        for (name, kind) in [
            ("awscni_add_ip_req_count", "counter"),
            ("awscni_force_removed_ips", "counter"),
            ("vpcnet_ipam_assigned_total", "counter"),
            ("vpcnet_datapath_drops_total", "counter"),
            ("vpcnet_nat_port_alloc_retries_total", "counter"),
            ("awscni_total_ip_addresses", "gauge"),
            ("awscni_build_info", "gauge"),
            ("vpcnet_nat_flows", "gauge"),
            ("vpcnet_nat_table_size", "gauge"),
            ("vpcnet_map_entries", "gauge"),
            ("vpcnet_nat_remote_endpoint_ports", "gauge"),
            ("vpcnet_gc_removed_total", "counter"),
        ] {
            assert_eq!(types[name], kind, "{name}");
        }
        // Every counter family ends in _total except aws-node's own names.
        for (name, kind) in &types {
            if kind == "counter" && !name.starts_with("awscni_") {
                assert!(name.ends_with("_total"), "{name}");
            }
        }
    }

    #[test]
    #[allow(clippy::too_many_lines)] // one metric after another
    fn metrics_aws_node_serves_with_its_labels() {
        let text = render_metrics(&snapshot(true)).unwrap();
        let (types, samples) = parse(&text);
        let create = [("fn", "CreateNetworkInterface")];
        assert_eq!(value(&samples, "awscni_ec2api_req_count", &create), 2);
        assert_eq!(value(&samples, "awscni_ec2api_error_count", &create), 1);
        assert_eq!(
            value(
                &samples,
                "awscni_aws_api_error_count",
                &[
                    ("api", "CreateNetworkInterface"),
                    ("error", "RequestLimitExceeded")
                ]
            ),
            1
        );
        let ok = [
            ("api", "CreateNetworkInterface"),
            ("error", "false"),
            ("status", "200"),
        ];
        assert_eq!(value(&samples, "awscni_aws_api_latency_ms_count", &ok), 1);
        assert_eq!(value(&samples, "awscni_aws_api_latency_ms_sum", &ok), 40);
        let throttled = [
            ("api", "CreateNetworkInterface"),
            ("error", "true"),
            ("status", "RequestLimitExceeded"),
        ];
        assert_eq!(
            value(&samples, "awscni_aws_api_latency_ms_sum", &throttled),
            7
        );
        let imds = [
            ("api", "GetMetadata"),
            ("error", "false"),
            ("status", "200"),
        ];
        assert_eq!(value(&samples, "awscni_aws_api_latency_ms_count", &imds), 1);
        assert_eq!(
            value(
                &samples,
                "awscni_del_ip_req_count",
                &[("reason", "PodDeleted")]
            ),
            1
        );
        assert_eq!(
            value(
                &samples,
                "awscni_pod_eni_error_count",
                &[("fn", "tryEnableSecurityGroupsForPods")]
            ),
            2
        );
        for (code, answers) in [("403", 3), ("none", 1)] {
            assert_eq!(
                value(
                    &samples,
                    "vpcnet_kubernetes_api_answers_total",
                    &[("code", code)]
                ),
                answers
            );
        }
        for (action, under_way) in [
            ("nodeInit", 0),
            ("increaseDatastorePool", 1),
            ("decreaseDatastorePool", 0),
            ("nodeIPPoolReconcile", 0),
        ] {
            assert_eq!(
                value(
                    &samples,
                    "awscni_ipamd_action_inprogress",
                    &[("fn", action)]
                ),
                under_way,
                "{action}"
            );
        }
        for (function, n) in [
            ("eniReconcileAdd", 1),
            ("eniReconcileDel", 0),
            ("eniDataStorePoolReconcileAdd", 3),
            ("eniIPPoolReconcileDel", 2),
        ] {
            assert_eq!(
                value(&samples, "awscni_reconcile_count", &[("fn", function)]),
                n,
                "{function}"
            );
        }
        assert_eq!(
            value(
                &samples,
                "awscni_assigned_ip_per_cidr",
                &[("cidr", "10.0.2.16/28")]
            ),
            3
        );
        let started = [
            ("success", "true"),
            ("with_api_server", "false"),
            ("failure_reason", ""),
        ];
        assert_eq!(
            value(
                &samples,
                "awscni_ipamd_startup_duration_seconds_count",
                &started
            ),
            1
        );
        let le = |bound: &'static str| {
            let mut labels = started.to_vec();
            labels.push(("le", bound));
            value(
                &samples,
                "awscni_ipamd_startup_duration_seconds_bucket",
                &labels,
            )
        };
        assert_eq!((le("1"), le("2.5"), le("+Inf")), (0, 1, 1));
        assert!(
            (float_value(
                &samples,
                "awscni_ipamd_startup_duration_seconds_sum",
                &started
            ) - 1.5)
                .abs()
                < 1e-9
        );
        assert_eq!(
            value(
                &samples,
                "awscni_ipamd_node_initialization_duration_seconds_count",
                &[("success", "true")]
            ),
            1
        );
        for (name, kind) in [
            ("awscni_ec2api_req_count", "counter"),
            ("awscni_ec2api_error_count", "counter"),
            ("awscni_aws_api_error_count", "counter"),
            ("awscni_aws_api_latency_ms", "summary"),
            ("awscni_del_ip_req_count", "counter"),
            ("awscni_pod_eni_error_count", "counter"),
            ("vpcnet_kubernetes_api_answers_total", "counter"),
            ("awscni_ipamd_action_inprogress", "gauge"),
            ("awscni_reconcile_count", "counter"),
            ("awscni_assigned_ip_per_cidr", "gauge"),
            ("awscni_ipamd_startup_duration_seconds", "histogram"),
            (
                "awscni_ipamd_node_initialization_duration_seconds",
                "histogram",
            ),
        ] {
            assert_eq!(types.get(name).map(String::as_str), Some(kind), "{name}");
        }
    }

    #[test]
    fn metrics_of_the_datapath() {
        let snap = snapshot(false);
        let (types, samples) = parse(&render_metrics(&snap).unwrap());
        assert!(
            !types
                .keys()
                .any(|n| n.starts_with("awscni_") && n != "awscni_build_info"),
            "no pool figures without the address manager: {types:?}"
        );
        // Every datapath counter is reported exactly once.
        let mut reported = 0;
        for (counter, v) in &snap.datapath.counters {
            let found: Vec<&Parsed> = samples
                .iter()
                .filter(|(name, labels, _)| match counter {
                    Counter::AllocRetry => name == "vpcnet_nat_port_alloc_retries_total",
                    Counter::AllocOldestClosed => {
                        name == "vpcnet_nat_port_alloc_oldest_closed_total"
                    }
                    c if c.is_drop() => {
                        name == "vpcnet_datapath_drops_total"
                            && labels[0].1 == c.name().trim_start_matches("drop_")
                    }
                    c => name == "vpcnet_datapath_verdicts_total" && labels[0].1 == c.name(),
                })
                .collect();
            assert_eq!(found.len(), 1, "{counter:?}");
            #[allow(clippy::cast_precision_loss)] // small test values
            let expected = *v as f64;
            assert!((found[0].2 - expected).abs() < f64::EPSILON, "{counter:?}");
            reported += 1;
        }
        assert_eq!(reported, Counter::ALL.len());
        assert_eq!(
            value(
                &samples,
                "vpcnet_datapath_drops_total",
                &[("reason", "nat_no_port")]
            ),
            n(Counter::ALL
                .iter()
                .position(|c| *c == Counter::DropNatNoPort)
                .unwrap())
        );
        assert_eq!(value(&samples, "vpcnet_nat_flows", &[]), 5);
        assert_eq!(value(&samples, "vpcnet_nat_table_size", &[]), 262_144);
    }
}
