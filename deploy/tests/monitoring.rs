//! The chart's monitoring, offline: the `PodMonitor` and the `ServiceMonitor`
//! (off by default) reach the agent's metrics port, the alert rules pass
//! `promtool` (Debian's `prometheus` package, which `cargo xtask setup`
//! installs) and fire on what they name, and the alerts and the Grafana
//! dashboard read only metrics the agent serves.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::Ipv4Addr,
    path::Path,
    process::Command,
    time::Duration,
};

use k8s_openapi::{
    api::{apps::v1::DaemonSet, core::v1::PodSpec},
    apimachinery::pkg::{
        apis::meta::v1::{LabelSelector, ObjectMeta},
        util::intstr::IntOrString,
    },
};
use serde::Deserialize;
use serde_json::Value;
use vpcnet_agent::{
    datapath::{CollectorReport, EndpointPorts, MapFill, NatPressure, metrics::DatapathSnapshot},
    introspect::{DEFAULT_METRICS_ADDRESS, MetricsSnapshot, render_metrics},
    ipam::{
        manager::IpamStatus,
        metrics::{IpamCounters, PoolSnapshot},
        pool::PoolStats,
    },
    policy::node::{PodName, PodSnapshot},
    telemetry::{self, Outcome, Recorded, StartupKey},
};
use vpcnet_common::{counters::Counter, policy::PodVerdicts};
use vpcnet_deploy::{DEPLOY_DIR, Objects, chart_dir, documents, objects, output_of, promql, typed};
use vpcnet_lab::kube_tools::{HELM, KUBECTL};

/// kube-state-metrics' series the rules read (`VpcnetAgentNotReady`).
const KUBE_STATE_METRICS: &[&str] = &["kube_pod_status_ready", "kube_pod_owner", "kube_pod_info"];

/// A Prometheus Operator relabeling, as far as the chart writes them.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)] // read to refuse unknown fields
struct RelabelConfig {
    source_labels: Option<Vec<String>>,
    separator: Option<String>,
    target_label: Option<String>,
    regex: Option<String>,
    modulus: Option<u64>,
    replacement: Option<String>,
    action: Option<String>,
}

/// A `PodMonitor`'s `podMetricsEndpoints` item or a `ServiceMonitor`'s
/// `endpoints` item (`monitoring.coreos.com/v1`), as far as the chart
/// writes them.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct Endpoint {
    port: Option<String>,
    path: Option<String>,
    interval: Option<String>,
    scrape_timeout: Option<String>,
    relabelings: Option<Vec<RelabelConfig>>,
    metric_relabelings: Option<Vec<RelabelConfig>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NamespaceSelector {
    match_names: Option<Vec<String>>,
    any: Option<bool>,
}

/// A `PodMonitor` or a `ServiceMonitor`: both select by labels, in the
/// namespaces named.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct MonitorSpec {
    job_label: Option<String>,
    namespace_selector: Option<NamespaceSelector>,
    selector: LabelSelector,
    pod_metrics_endpoints: Option<Vec<Endpoint>>,
    endpoints: Option<Vec<Endpoint>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct Rule {
    alert: Option<String>,
    record: Option<String>,
    expr: String,
    #[serde(rename = "for")]
    for_: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct RuleGroup {
    name: String,
    interval: Option<String>,
    rules: Vec<Rule>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RuleSpec {
    groups: Vec<RuleGroup>,
}

/// One `monitoring.coreos.com/v1` object: its kind's spec, unknown fields
/// refused at every level the chart writes.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct Monitoring<Spec> {
    api_version: String,
    kind: String,
    metadata: ObjectMeta,
    spec: Spec,
}

/// A rendering: the Kubernetes objects, and the monitoring ones by kind.
struct Rendering {
    objects: Objects,
    monitoring: BTreeMap<String, Value>,
}

impl Rendering {
    fn typed<Spec: for<'de> Deserialize<'de>>(&self, kind: &str) -> Monitoring<Spec> {
        let doc = self
            .monitoring
            .get(kind)
            .unwrap_or_else(|| panic!("no {kind}"));
        assert_eq!(doc["apiVersion"], "monitoring.coreos.com/v1", "{kind}");
        serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("{kind}: {e}"))
    }
}

/// `helm template` of the chart with `args`.
fn render(args: &[&str]) -> Rendering {
    let text = vpcnet_deploy::helm_template(HELM, "vpcnet", args).unwrap();
    let mut objects = Objects::default();
    let mut monitoring = BTreeMap::new();
    for doc in documents(&text, "helm template").unwrap() {
        let api_version = doc["apiVersion"].as_str().unwrap_or_default();
        if api_version.starts_with("monitoring.coreos.com/") {
            let kind = doc["kind"].as_str().unwrap_or_default().to_owned();
            assert!(monitoring.insert(kind, doc).is_none(), "one of each kind");
        } else {
            objects.0.push(typed(&doc, "helm template").unwrap());
        }
    }
    Rendering {
        objects,
        monitoring,
    }
}

fn pod_spec(ds: &DaemonSet) -> &PodSpec {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("a pod template")
}

fn pod_labels(ds: &DaemonSet) -> BTreeMap<String, String> {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.labels.clone())
        .unwrap_or_default()
}

/// Whether `selector` (labels only, as the chart writes them) takes `labels`.
fn selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    assert!(selector.match_expressions.is_none());
    let wanted = selector.match_labels.clone().unwrap_or_default();
    !wanted.is_empty() && wanted.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The kustomized DaemonSet (`kubectl kustomize deploy/kubernetes`): the
/// chart's monitors find its pods too.
fn kustomized() -> DaemonSet {
    let text = output_of(
        Command::new(KUBECTL)
            .arg("kustomize")
            .arg(Path::new(DEPLOY_DIR).join("kubernetes")),
    )
    .unwrap();
    objects(&text, "kubectl kustomize")
        .unwrap()
        .daemon_set()
        .clone()
}

/// The agent's metrics port number.
fn metrics_port() -> i32 {
    DEFAULT_METRICS_ADDRESS
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .unwrap()
}

/// The agent container's port named `name`, if any.
fn agent_port(ds: &DaemonSet, name: &str) -> Option<i32> {
    pod_spec(ds).containers[0]
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(name))
        .map(|p| p.container_port)
}

/// Checks an endpoint: `/metrics`, labelled with the pod's node.
fn assert_scrapes_metrics_with_the_node(endpoint: &Endpoint, what: &str) {
    assert_eq!(endpoint.path.as_deref(), Some("/metrics"), "{what}");
    let node = endpoint.relabelings.iter().flatten().any(|r| {
        r.source_labels.as_deref() == Some(&["__meta_kubernetes_pod_node_name".to_owned()])
            && r.target_label.as_deref() == Some("node")
    });
    assert!(node, "{what}: the series are labelled with the node");
}

#[test]
fn the_monitors_are_off_by_default() {
    let plain = render(&[]);
    assert!(plain.monitoring.is_empty(), "{:?}", plain.monitoring.keys());
    assert_eq!(plain.objects.services().count(), 0);
}

/// The `PodMonitor` takes the agent's pods (the chart's and the kustomized
/// ones, never the rollback's) in the release's namespace and scrapes the
/// port that serves the metrics.
#[test]
fn the_pod_monitor_scrapes_the_agents_metrics_port() {
    let rendering = render(&[
        "--set",
        "metrics.podMonitor.enabled=true",
        "--set",
        "metrics.podMonitor.namespace=monitoring",
        "--set",
        "metrics.podMonitor.labels.release=kube-prometheus-stack",
        "--set",
        "metrics.podMonitor.interval=30s",
        "--set",
        "rollback.enabled=true",
    ]);
    let monitor: Monitoring<MonitorSpec> = rendering.typed("PodMonitor");
    assert_eq!(monitor.metadata.namespace.as_deref(), Some("monitoring"));
    let labels = monitor.metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels["release"], "kube-prometheus-stack");
    let namespaces = monitor.spec.namespace_selector.as_ref().unwrap();
    assert_eq!(
        namespaces.match_names.as_deref(),
        Some(&["kube-system".to_owned()][..])
    );
    assert_eq!(namespaces.any, None);
    assert_eq!(monitor.spec.job_label, None);
    assert!(monitor.spec.endpoints.is_none());

    let agent = rendering.objects.daemon_set_named("vpcnet");
    let rollback = rendering.objects.daemon_set_named("vpcnet-rollback");
    let kustomized = kustomized();
    assert!(selects(&monitor.spec.selector, &pod_labels(agent)));
    assert!(selects(&monitor.spec.selector, &pod_labels(&kustomized)));
    assert!(!selects(&monitor.spec.selector, &pod_labels(rollback)));
    let endpoints = monitor.spec.pod_metrics_endpoints.as_ref().unwrap();
    assert_eq!(endpoints.len(), 1);
    let port = endpoints[0].port.as_deref().unwrap();
    assert_eq!(agent_port(agent, port), Some(metrics_port()), "port {port}");
    assert_eq!(
        agent_port(&kustomized, port),
        Some(metrics_port()),
        "port {port}"
    );
    assert_eq!(endpoints[0].interval.as_deref(), Some("30s"));
    assert_scrapes_metrics_with_the_node(&endpoints[0], "PodMonitor");
}

/// The `ServiceMonitor` takes the headless Service the chart renders with it,
/// whose endpoints are the agent's pods on the same port.
#[test]
fn the_service_monitor_scrapes_the_same_port_through_a_headless_service() {
    let rendering = render(&[
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.serviceMonitor.relabelings[0].action=labeldrop",
        "--set",
        "metrics.serviceMonitor.relabelings[0].regex=container",
    ]);
    let monitor: Monitoring<MonitorSpec> = rendering.typed("ServiceMonitor");
    assert_eq!(monitor.metadata.namespace.as_deref(), Some("kube-system"));
    assert!(monitor.spec.pod_metrics_endpoints.is_none());
    let agent = rendering.objects.daemon_set();
    let services: Vec<_> = rendering.objects.services().collect();
    assert_eq!(services.len(), 1);
    let service = services[0];
    let spec = service.spec.as_ref().unwrap();
    assert_eq!(spec.cluster_ip.as_deref(), Some("None"), "headless");
    let selector = spec.selector.clone().unwrap_or_default();
    assert!(!selector.is_empty());
    for pods in [pod_labels(agent), pod_labels(&kustomized())] {
        assert!(selector.iter().all(|(k, v)| pods.get(k) == Some(v)));
    }
    assert!(selects(
        &monitor.spec.selector,
        &service.metadata.labels.clone().unwrap_or_default()
    ));
    let endpoints = monitor.spec.endpoints.as_ref().unwrap();
    assert_eq!(endpoints.len(), 1);
    assert_scrapes_metrics_with_the_node(&endpoints[0], "ServiceMonitor");
    assert_eq!(endpoints[0].relabelings.as_ref().map(Vec::len), Some(2));
    let port_name = endpoints[0].port.as_deref().unwrap();
    let port = spec
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(port_name))
        .unwrap_or_else(|| panic!("the Service has no port {port_name}"));
    let target = match port.target_port.as_ref().unwrap() {
        IntOrString::String(name) => agent_port(agent, name),
        IntOrString::Int(number) => Some(*number),
    };
    assert_eq!(target, Some(metrics_port()));
}

/// Every metric the agent serves (with the sample names of its
/// histograms and summaries), from the agent's own scrape of a node where
/// every family has a sample.
fn agent_metrics() -> BTreeSet<String> {
    let mut recorded = Recorded::default();
    recorded.ec2_call(
        "CreateNetworkInterface",
        Duration::from_millis(40),
        Outcome::ApiError("UnauthorizedOperation"),
    );
    recorded.aws_call(telemetry::IMDS_API, Duration::from_millis(2), Outcome::Ok);
    recorded.del_request("PodDeleted");
    recorded
        .pod_eni_errors
        .insert(telemetry::POD_ENI_ENABLE_SECURITY_GROUPS, 1);
    recorded.kubernetes_answers.insert(Some(200), 1);
    recorded
        .startup
        .entry(StartupKey {
            success: true,
            with_api_server: true,
            failure_reason: "",
        })
        .or_default()
        .observe(1.0);
    recorded.node_init.entry(true).or_default().observe(0.5);
    let fill = MapFill {
        entries: 1,
        capacity: 16,
    };
    let snapshot = MetricsSnapshot {
        ipam: Some(PoolSnapshot {
            status: IpamStatus {
                stats: PoolStats::default(),
                enis: 1,
                max_enis: 3,
                max_pods: 29,
                max_ips: 27,
                prefix_fallback: false,
                counters: IpamCounters::default().snapshot(),
                events: Vec::new(),
            },
            per_eni: vec![("eni-0".to_owned(), 1)],
            per_cidr: vec![("10.20.11.20/32".to_owned(), 1)],
        }),
        datapath: DatapathSnapshot {
            counters: Counter::ALL.iter().map(|c| (*c, 1)).collect(),
            endpoints: 1,
            attached_interfaces: 2,
            external_snat: false,
            pressure: NatPressure {
                nat_fwd: fill,
                nat_rev: fill,
                stack_flows: fill,
                busiest: vec![EndpointPorts {
                    proto: 6,
                    addr: 0,
                    port: 0,
                    ports: 1,
                }],
            },
            collector: CollectorReport::default(),
        },
        policy: vec![PodSnapshot {
            addr: Ipv4Addr::new(10, 20, 11, 20),
            name: PodName {
                namespace: "default".to_owned(),
                name: "web".to_owned(),
            },
            rules: None,
            verdicts: PodVerdicts::default(),
        }],
        recorded,
    };
    let text = render_metrics(&snapshot).unwrap();
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let Some((name, kind)) = line.strip_prefix("# TYPE ").and_then(|l| l.split_once(' '))
        else {
            continue;
        };
        names.insert(name.to_owned());
        let suffixes: &[&str] = match kind {
            "histogram" => &["_bucket", "_sum", "_count"],
            "summary" => &["_sum", "_count"],
            _ => &[],
        };
        names.extend(suffixes.iter().map(|s| format!("{name}{s}")));
    }
    // The families the guide names, so a scrape that lost some shows here.
    for family in [
        "awscni_assigned_ip_addresses",
        "awscni_no_available_ip_addresses",
        "awscni_aws_api_error_count",
        "vpcnet_datapath_drops_total",
        "vpcnet_map_entries",
        "vpcnet_policy_pod_verdicts_total",
        "vpcnet_ipam_subnet_exhausted_total",
    ] {
        assert!(names.contains(family), "{family}");
    }
    names
}

/// The reasons of `vpcnet_datapath_drops_total`.
fn drop_reasons() -> BTreeSet<String> {
    Counter::ALL
        .iter()
        .filter(|c| c.is_drop())
        .map(|c| c.name().trim_start_matches("drop_").to_owned())
        .collect()
}

/// The `PrometheusRule` of the chart with `args` added, typed.
fn rules(args: &[&str]) -> (Monitoring<RuleSpec>, Value) {
    let mut all = vec!["--set", "metrics.prometheusRule.enabled=true"];
    all.extend_from_slice(args);
    let rendering = render(&all);
    let spec = rendering.monitoring["PrometheusRule"]["spec"].clone();
    (rendering.typed("PrometheusRule"), spec)
}

/// The alerts that matter, checked by Prometheus' own `promtool`, each on
/// metrics the agent serves (or kube-state-metrics' pod status), with a
/// severity and a text; the drop reasons they leave out are the agent's.
#[test]
fn the_alert_rules_pass_promtool_and_read_metrics_that_exist() {
    let (rule, spec) = rules(&[]);
    assert_eq!(rule.metadata.namespace.as_deref(), Some("kube-system"));
    let scratch = vpcnet_lab::ScratchDir::new("vpcnet-rules").unwrap();
    let file = scratch.path().join("vpcnet.rules.yaml");
    std::fs::write(&file, serde_json::to_string_pretty(&spec).unwrap()).unwrap();
    let said = output_of(Command::new("promtool").args(["check", "rules"]).arg(&file))
        .unwrap_or_else(|e| {
            panic!("promtool check rules (Debian's prometheus package, cargo xtask setup): {e}")
        });
    assert!(said.contains("SUCCESS: 6 rules found"), "{said}");

    let served = agent_metrics();
    let mut alerts = Vec::new();
    for rule in rule.spec.groups.iter().flat_map(|g| &g.rules) {
        let alert = rule.alert.clone().expect("alerts only");
        for metric in promql::metric_names(&rule.expr) {
            assert!(
                served.contains(&metric) || KUBE_STATE_METRICS.contains(&metric.as_str()),
                "{alert} reads {metric}, which the agent does not serve"
            );
        }
        let labels = rule.labels.clone().unwrap_or_default();
        assert!(
            ["warning", "critical"].contains(&labels["severity"].as_str()),
            "{alert}"
        );
        let annotations = rule.annotations.clone().unwrap_or_default();
        assert!(
            annotations.contains_key("summary") && annotations.contains_key("description"),
            "{alert}"
        );
        alerts.push(alert);
    }
    alerts.sort();
    assert_eq!(
        alerts,
        [
            "VpcnetAddressPoolExhausted",
            "VpcnetAgentNotReady",
            "VpcnetDropsRising",
            "VpcnetEc2PermissionMissing",
            "VpcnetNatTableNearFull",
            "VpcnetSubnetExhausted"
        ]
    );

    // The reasons the schema takes, and the ones left out by default, are
    // the agent's.
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(chart_dir().join("values.schema.json")).unwrap(),
    )
    .unwrap();
    let taken: BTreeSet<String> = schema["properties"]["metrics"]["properties"]["prometheusRule"]
        ["properties"]["ignoredDropReasons"]["items"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(taken, drop_reasons());
    let values = documents(
        &std::fs::read_to_string(chart_dir().join("values.yaml")).unwrap(),
        "values.yaml",
    )
    .unwrap()
    .remove(0);
    for reason in values["metrics"]["prometheusRule"]["ignoredDropReasons"]
        .as_array()
        .unwrap()
    {
        assert!(
            reason.as_str().unwrap().starts_with("policy_"),
            "only network policy's verdicts are left out by default: {reason}"
        );
    }
}

/// The node every made-up series is on.
const NODE: &str = "ip-10-20-11-162";
/// A vpcnet agent's pod, and an aws-node pod, of that node.
const VPCNET_POD: &str = "vpcnet-x7k2p";
const AWS_NODE_POD: &str = "aws-node-q9z4m";

/// A series of pod `pod` in `kube-system` on [`NODE`], with `labels` more.
fn series(metric: &str, pod: &str, labels: &str) -> String {
    format!("{metric}{{namespace=\"kube-system\", pod=\"{pod}\", node=\"{NODE}\"{labels}}}")
}

/// kube-state-metrics' series of pod `pod`: never ready, of DaemonSet
/// `owner`.
fn not_ready(pod: &str, owner: &str) -> [(String, &'static str); 3] {
    let ns = "namespace=\"kube-system\"";
    [
        (
            format!("kube_pod_status_ready{{{ns}, pod=\"{pod}\", condition=\"true\"}}"),
            "0x30",
        ),
        (
            format!(
                "kube_pod_owner{{{ns}, pod=\"{pod}\", owner_kind=\"DaemonSet\", owner_name=\"{owner}\"}}"
            ),
            "1x30",
        ),
        (series("kube_pod_info", pod, ""), "1x30"),
    ]
}

/// Made-up series, a sample a minute for half an hour, in promtool's
/// notation: each alert's trouble on the vpcnet pod, and what must raise
/// nothing (a half-full map, network policy's drops, a trickle of
/// malformed packets, a throttled call, aws-node's pod).
fn troubled_node() -> Vec<(String, &'static str)> {
    let (vpcnet, aws_node) = (VPCNET_POD, AWS_NODE_POD);
    let fwd = ", map=\"VPCNET_NAT_FWD\"";
    let stack = ", map=\"VPCNET_STACK_PAIRS\"";
    let mut input = vec![
        (series("vpcnet_map_entries", vpcnet, fwd), "950x30"),
        (series("vpcnet_map_capacity", vpcnet, fwd), "1000x30"),
        (series("vpcnet_map_entries", vpcnet, stack), "500x30"),
        (series("vpcnet_map_capacity", vpcnet, stack), "1000x30"),
        // 10 packets a second, 100, 0.1.
        (
            series(
                "vpcnet_datapath_drops_total",
                vpcnet,
                ", reason=\"nat_no_port\"",
            ),
            "0+600x30",
        ),
        (
            series(
                "vpcnet_datapath_drops_total",
                vpcnet,
                ", reason=\"policy_ingress\"",
            ),
            "0+6000x30",
        ),
        (
            series(
                "vpcnet_datapath_drops_total",
                vpcnet,
                ", reason=\"malformed\"",
            ),
            "0+6x30",
        ),
        (
            series("awscni_no_available_ip_addresses", vpcnet, ""),
            "0+1x30",
        ),
        (
            series("awscni_no_available_ip_addresses", aws_node, ""),
            "0+1x30",
        ),
        (
            series("vpcnet_ipam_subnet_exhausted_total", vpcnet, ""),
            "0x5 1x25",
        ),
        (
            series(
                "awscni_aws_api_error_count",
                vpcnet,
                ", api=\"CreateNetworkInterface\", error=\"UnauthorizedOperation\"",
            ),
            "0x5 1+1x24",
        ),
        (
            series(
                "awscni_aws_api_error_count",
                vpcnet,
                ", api=\"AssignPrivateIpAddresses\", error=\"RequestLimitExceeded\"",
            ),
            "0+1x30",
        ),
    ];
    input.extend(not_ready(vpcnet, "vpcnet"));
    input.extend(not_ready(aws_node, "aws-node"));
    input
}

/// The alerts fire on made-up series, as Prometheus evaluates them
/// (`promtool test rules`), on the node that has the trouble only: a full
/// NAT map, drops of a reason (not network policy's), ADDs that find no
/// address, a subnet out of addresses, a refused permission, an agent not
/// ready; aws-node's pods and a half-full map raise nothing.
#[test]
fn the_alerts_fire_on_what_they_name_and_nothing_else() {
    let (_, mut spec) = rules(&[]);
    // What is tested is when each fires; promtool compares annotations
    // too, which say it in words.
    for group in spec["groups"].as_array_mut().unwrap() {
        for rule in group["rules"].as_array_mut().unwrap() {
            rule.as_object_mut().unwrap().remove("annotations");
        }
    }
    let scratch = vpcnet_lab::ScratchDir::new("vpcnet-rules-test").unwrap();
    std::fs::write(
        scratch.path().join("vpcnet.rules.yaml"),
        serde_json::to_string_pretty(&spec).unwrap(),
    )
    .unwrap();
    let on = format!("namespace: kube-system, pod: {VPCNET_POD}, node: {NODE}");
    let expected = [
        (
            "VpcnetNatTableNearFull",
            format!("{{severity: warning, {on}, map: VPCNET_NAT_FWD}}"),
        ),
        (
            "VpcnetDropsRising",
            format!("{{severity: warning, {on}, reason: nat_no_port}}"),
        ),
        (
            "VpcnetAddressPoolExhausted",
            format!("{{severity: critical, {on}}}"),
        ),
        (
            "VpcnetSubnetExhausted",
            format!("{{severity: warning, {on}}}"),
        ),
        (
            "VpcnetEc2PermissionMissing",
            format!("{{severity: warning, {on}, api: CreateNetworkInterface}}"),
        ),
        (
            "VpcnetAgentNotReady",
            format!("{{severity: critical, {on}}}"),
        ),
    ];
    let mut test = String::from(
        "rule_files: [vpcnet.rules.yaml]\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n",
    );
    for (series, values) in troubled_node() {
        writeln!(
            test,
            "      - series: '{series}'\n        values: '{values}'"
        )
        .unwrap();
    }
    test.push_str("    alert_rule_test:\n");
    for (alert, labels) in &expected {
        // Not yet at 3 minutes (each waits its `for`, or its window's first
        // increase), firing at 20.
        writeln!(
            test,
            "      - eval_time: 3m\n        alertname: {alert}\n        exp_alerts: []"
        )
        .unwrap();
        writeln!(
            test,
            "      - eval_time: 20m\n        alertname: {alert}\n        exp_alerts:\n          - exp_labels: {labels}"
        )
        .unwrap();
    }
    let file = scratch.path().join("vpcnet.rules.test.yaml");
    std::fs::write(&file, &test).unwrap();
    let said = output_of(Command::new("promtool").args(["test", "rules"]).arg(&file));
    assert!(said.is_ok(), "{}\n{test}", said.unwrap_err());
}

/// The dashboard (`deploy/grafana/vpcnet-dashboard.json`, the chart's
/// `dashboards/vpcnet.json`) reads only metrics the agent serves, picks
/// its data source and agent pods by variables, and the chart's ConfigMap
/// holds it for Grafana's sidecar.
#[test]
fn the_dashboard_reads_only_metrics_the_agent_serves() {
    let standalone = Path::new(DEPLOY_DIR).join("grafana/vpcnet-dashboard.json");
    let charted = chart_dir().join("dashboards/vpcnet.json");
    assert_eq!(
        standalone.canonicalize().unwrap(),
        charted.canonicalize().unwrap(),
        "one dashboard"
    );
    let text = std::fs::read_to_string(&standalone).unwrap();
    let dashboard: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(dashboard["uid"], "vpcnet");
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(variables, ["datasource", "namespace", "pod"]);

    let served = agent_metrics();
    let exprs = promql::dashboard_exprs(&dashboard);
    let mut read = BTreeSet::new();
    for expr in &exprs {
        let metrics = promql::metric_names(expr);
        assert!(!metrics.is_empty(), "{expr}");
        for metric in metrics {
            assert!(
                served.contains(&metric),
                "the dashboard reads {metric}, which the agent does not serve: {expr}"
            );
            read.insert(metric);
        }
    }
    // Pools (aws-node's names) and the datapath (vpcnet's own) alike.
    assert!(
        read.iter().filter(|m| m.starts_with("awscni_")).count() >= 10,
        "{read:?}"
    );
    assert!(
        read.iter().filter(|m| m.starts_with("vpcnet_")).count() >= 10,
        "{read:?}"
    );

    let mut ids = BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        assert!(
            ids.insert(panel["id"].as_u64().unwrap()),
            "panel ids are unique"
        );
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(
            panel["datasource"]["uid"], "${datasource}",
            "{}",
            panel["title"]
        );
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            assert!(
                expr.contains("namespace=\"$namespace\"") && expr.contains("pod=~\"$pod\""),
                "{}: {expr}",
                panel["title"]
            );
        }
    }

    let rendering = render(&[
        "--set",
        "metrics.grafanaDashboard.enabled=true",
        "--set",
        "metrics.grafanaDashboard.annotations.grafana_folder=Networking",
    ]);
    let config_map = rendering
        .objects
        .config_maps()
        .find(|cm| cm.metadata.name.as_deref() == Some("vpcnet-dashboard"))
        .expect("the dashboard's ConfigMap");
    let labels = config_map.metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels["grafana_dashboard"], "1");
    let data = config_map.data.clone().unwrap_or_default();
    let held: Value = serde_json::from_str(&data["vpcnet.json"]).unwrap();
    assert_eq!(held, dashboard);
}
