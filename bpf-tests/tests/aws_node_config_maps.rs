//! aws-node's `ConfigMaps`, copied as operators copy them, start vpcnet with
//! the settings aws-node would use: the aws-vpc-cni chart's default env
//! (v1.23.1's `values.yaml`), and `ConfigMaps` for prefix delegation, custom
//! networking, security groups for pods and external SNAT, with values
//! aws-node tolerates mixed in. For each, `vpcnet-agent settings --ipam`
//! prints the settings in force, the values tolerated and the variables
//! without effect; then the agent starts in the lab with the same
//! environment and logs the same settings. The expected values are what
//! aws-node v1.23.1 reads from each (its fallbacks noted where used).

use std::{path::Path, process::Command};

use serde_json::{Value, json};
use vpcnet_bpf_tests::{
    agent_binary,
    ipam::{FAST_AGENT_ARGS, lab_lock},
};
use vpcnet_lab::{IpamLabOptions, Lab, LabOptions, ScratchDir, ec2::config::LAB_CUSTOM_SUBNET_ID};

/// A `ConfigMap`'s data, the settings aws-node would use for it (by
/// variable, as `vpcnet-agent settings` names them), what is tolerated
/// (variable and the value used) and what has no effect here.
struct ConfigMap {
    name: &'static str,
    data: Vec<(&'static str, String)>,
    expected: Vec<(&'static str, Value)>,
    tolerated: Vec<(&'static str, &'static str)>,
    no_effect: Vec<&'static str>,
}

/// The log file the chart names, moved under the test's scratch directory
/// (the lab's node shares the machine's file system).
const CHART_LOG_FILE: &str = "/host/var/log/aws-routed-eni/ipamd.log";

fn chart_defaults(log_dir: &Path) -> Vec<(&'static str, String)> {
    let log_file = log_dir.join(CHART_LOG_FILE.trim_start_matches('/'));
    [
        ("ADDITIONAL_ENI_TAGS", "{}"),
        ("AWS_VPC_CNI_NODE_PORT_SUPPORT", "true"),
        ("AWS_VPC_ENI_MTU", "9001"),
        ("AWS_VPC_K8S_CNI_CUSTOM_NETWORK_CFG", "false"),
        ("AWS_VPC_K8S_CNI_EXTERNALSNAT", "false"),
        ("AWS_VPC_K8S_CNI_LOGLEVEL", "DEBUG"),
        ("AWS_VPC_K8S_CNI_RANDOMIZESNAT", "prng"),
        ("AWS_VPC_K8S_CNI_VETHPREFIX", "eni"),
        (
            "AWS_VPC_K8S_PLUGIN_LOG_FILE",
            "/var/log/aws-routed-eni/plugin.log",
        ),
        ("AWS_VPC_K8S_PLUGIN_LOG_LEVEL", "DEBUG"),
        ("DISABLE_INTROSPECTION", "false"),
        ("DISABLE_METRICS", "false"),
        ("ENABLE_POD_ENI", "false"),
        ("ENABLE_PREFIX_DELEGATION", "false"),
        ("WARM_ENI_TARGET", "1"),
        ("WARM_PREFIX_TARGET", "1"),
        ("DISABLE_NETWORK_RESOURCE_PROVISIONING", "false"),
        ("ENABLE_IPv4", "true"),
        ("ENABLE_IPv6", "false"),
        ("ENABLE_SUBNET_DISCOVERY", "true"),
        ("VPC_CNI_VERSION", "v1.23.1"),
        ("NETWORK_POLICY_ENFORCING_MODE", "standard"),
        ("ENABLE_IMDS_ONLY_MODE", "false"),
        ("ENABLE_MULTI_NIC", "false"),
    ]
    .into_iter()
    .map(|(k, v)| (k, v.to_owned()))
    .chain([("AWS_VPC_K8S_CNI_LOG_FILE", log_file.display().to_string())])
    .collect()
}

/// The chart's defaults with `changes` over them.
fn chart_with(log_dir: &Path, changes: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
    let mut data = chart_defaults(log_dir);
    for (name, value) in changes {
        data.retain(|(k, _)| k != name);
        data.push((name, (*value).to_owned()));
    }
    data
}

/// What the chart's defaults leave without effect here.
/// (`NETWORK_POLICY_ENFORCING_MODE` is read: with `ENABLE_NETWORK_POLICY`.)
const CHART_NO_EFFECT: &[&str] = &["AWS_VPC_CNI_NODE_PORT_SUPPORT", "VPC_CNI_VERSION"];

#[allow(clippy::too_many_lines)] // five ConfigMaps, each spelled out
fn config_maps(log_dir: &Path) -> Vec<ConfigMap> {
    let log_file = log_dir
        .join(CHART_LOG_FILE.trim_start_matches('/'))
        .display()
        .to_string();
    vec![
        ConfigMap {
            name: "the chart's defaults",
            data: chart_defaults(log_dir),
            expected: vec![
                ("AWS_VPC_K8S_CNI_EXTERNALSNAT", json!(false)),
                ("AWS_VPC_K8S_CNI_RANDOMIZESNAT", json!("prng")),
                ("AWS_VPC_K8S_CNI_CONNMARK", json!(0x80)),
                ("WARM_ENI_TARGET", json!(1)),
                ("WARM_PREFIX_TARGET", json!(1)),
                ("ENABLE_PREFIX_DELEGATION", json!(false)),
                ("AWS_VPC_ENI_MTU", json!(9001)),
                ("POD_MTU", json!(9001)),
                ("AWS_VPC_K8S_CNI_VETHPREFIX", json!("eni")),
                ("AWS_VPC_K8S_CNI_LOGLEVEL", json!("debug")),
                ("AWS_VPC_K8S_CNI_LOG_FILE", json!(log_file)),
                (
                    "AWS_VPC_K8S_PLUGIN_LOG_FILE",
                    json!("/var/log/aws-routed-eni/plugin.log"),
                ),
                ("AWS_VPC_K8S_PLUGIN_LOG_LEVEL", json!("debug")),
                ("ENABLE_POD_ENI", json!(false)),
                ("HTTP_TIMEOUT", json!(10)),
                ("DISABLE_TCP_EARLY_DEMUX", json!(false)),
                ("ENABLE_SUBNET_DISCOVERY", json!(true)),
                ("MANAGE_UNTAGGED_ENI", json!(true)),
                ("DISABLE_NETWORK_RESOURCE_PROVISIONING", json!(false)),
                ("AWS_EXTERNAL_SERVICE_CIDRS", json!([])),
            ],
            tolerated: vec![],
            no_effect: CHART_NO_EFFECT.to_vec(),
        },
        ConfigMap {
            name: "prefix delegation",
            data: chart_with(
                log_dir,
                &[
                    ("ENABLE_PREFIX_DELEGATION", "true"),
                    ("WARM_PREFIX_TARGET", "1"),
                    // aws-node: negative or unreadable targets are unset (0),
                    // a negative WARM_ENI_TARGET is 1.
                    ("WARM_IP_TARGET", "-5"),
                    ("MINIMUM_IP_TARGET", "two"),
                    ("WARM_ENI_TARGET", "-1"),
                    // aws-node: an unknown mode is prng.
                    ("AWS_VPC_K8S_CNI_RANDOMIZESNAT", "random"),
                ],
            ),
            expected: vec![
                ("ENABLE_PREFIX_DELEGATION", json!(true)),
                ("WARM_PREFIX_TARGET", json!(1)),
                ("WARM_IP_TARGET", Value::Null),
                ("MINIMUM_IP_TARGET", Value::Null),
                ("WARM_ENI_TARGET", json!(1)),
                ("AWS_VPC_K8S_CNI_RANDOMIZESNAT", json!("prng")),
            ],
            tolerated: vec![
                ("AWS_VPC_K8S_CNI_RANDOMIZESNAT", "prng"),
                ("WARM_ENI_TARGET", "1"),
                ("WARM_IP_TARGET", "0"),
                ("MINIMUM_IP_TARGET", "0"),
            ],
            no_effect: CHART_NO_EFFECT.to_vec(),
        },
        ConfigMap {
            name: "custom networking",
            data: chart_with(
                log_dir,
                &[
                    ("AWS_VPC_K8S_CNI_CUSTOM_NETWORK_CFG", "true"),
                    ("ENI_CONFIG_LABEL_DEF", "topology.kubernetes.io/zone"),
                    // No API server here: the ENIConfig's subnet.
                    ("VPCNET_ENI_CONFIG_SUBNET", LAB_CUSTOM_SUBNET_ID),
                    // aws-node skips an IPv6 item and one that is no CIDR.
                    (
                        "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS",
                        "10.30.0.0/16, fd00:ec2::/64,not-a-cidr",
                    ),
                    // aws-node: below 10 s is 10 s.
                    ("HTTP_TIMEOUT", "3"),
                    // aws-node: below 1 is the instance type's limit.
                    ("MAX_ENI", "0"),
                ],
            ),
            expected: vec![
                ("AWS_VPC_K8S_CNI_CUSTOM_NETWORK_CFG", json!(true)),
                ("ENI_CONFIG_LABEL_DEF", json!("topology.kubernetes.io/zone")),
                ("VPCNET_ENI_CONFIG_SUBNET", json!(LAB_CUSTOM_SUBNET_ID)),
                (
                    "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS",
                    json!(["10.30.0.0/16"]),
                ),
                ("HTTP_TIMEOUT", json!(10)),
                ("MAX_ENI", Value::Null),
            ],
            tolerated: vec![
                ("AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS", "the list without it"),
                ("AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS", "the list without it"),
                ("HTTP_TIMEOUT", "10"),
            ],
            no_effect: CHART_NO_EFFECT.to_vec(),
        },
        ConfigMap {
            name: "security groups for pods",
            data: chart_with(
                log_dir,
                &[
                    ("ENABLE_POD_ENI", "true"),
                    ("POD_SECURITY_GROUP_ENFORCING_MODE", "standard"),
                    ("DISABLE_TCP_EARLY_DEMUX", "true"),
                    // Go's ParseInt(v, 0, 64): octal 0200 is 0x80.
                    ("AWS_VPC_K8S_CNI_CONNMARK", "0200"),
                    // aws-node: an unknown level is debug.
                    ("AWS_VPC_K8S_CNI_LOGLEVEL", "verbose"),
                ],
            ),
            expected: vec![
                ("ENABLE_POD_ENI", json!(true)),
                ("POD_SECURITY_GROUP_ENFORCING_MODE", json!("standard")),
                ("DISABLE_TCP_EARLY_DEMUX", json!(true)),
                ("AWS_VPC_K8S_CNI_CONNMARK", json!(0x80)),
                ("AWS_VPC_K8S_CNI_LOGLEVEL", json!("debug")),
            ],
            tolerated: vec![("AWS_VPC_K8S_CNI_LOGLEVEL", "debug")],
            no_effect: CHART_NO_EFFECT.to_vec(),
        },
        ConfigMap {
            name: "external SNAT",
            data: chart_with(
                log_dir,
                &[
                    ("AWS_VPC_K8S_CNI_EXTERNALSNAT", "true"),
                    ("AWS_VPC_K8S_CNI_RANDOMIZESNAT", "none"),
                    ("WARM_IP_TARGET", "5"),
                    ("MINIMUM_IP_TARGET", "10"),
                    ("POD_MTU", "1500"),
                    ("ENABLE_BANDWIDTH_PLUGIN", "true"),
                    // aws-node: an unreadable boolean is its default.
                    ("DISABLE_POD_V6", "yes"),
                    // aws-node leaves out a key of its own.
                    (
                        "ADDITIONAL_ENI_TAGS",
                        r#"{"team":"payments","node.k8s.amazonaws.com/instance_id":"i-0"}"#,
                    ),
                ],
            ),
            expected: vec![
                ("AWS_VPC_K8S_CNI_EXTERNALSNAT", json!(true)),
                ("AWS_VPC_K8S_CNI_RANDOMIZESNAT", json!("none")),
                ("WARM_IP_TARGET", json!(5)),
                ("MINIMUM_IP_TARGET", json!(10)),
                ("AWS_VPC_ENI_MTU", json!(9001)),
                ("POD_MTU", json!(1500)),
                ("ENABLE_BANDWIDTH_PLUGIN", json!(true)),
                ("DISABLE_POD_V6", json!(false)),
                ("ADDITIONAL_ENI_TAGS", json!({"team": "payments"})),
            ],
            tolerated: vec![
                ("DISABLE_POD_V6", "false"),
                ("ADDITIONAL_ENI_TAGS", "the tags without it"),
            ],
            no_effect: CHART_NO_EFFECT.to_vec(),
        },
    ]
}

/// `vpcnet-agent settings --ipam` with `data` as its whole environment:
/// the settings it prints, and its standard error's lines.
fn settings_of(data: &[(&'static str, String)]) -> (Value, Vec<String>) {
    let out = Command::new(agent_binary())
        .args(["settings", "--ipam"])
        .env_clear()
        .envs(data.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("running vpcnet-agent settings");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "vpcnet-agent settings failed:\n{stderr}"
    );
    let settings = serde_json::from_slice(&out.stdout).expect("the settings' JSON");
    (settings, stderr.lines().map(str::to_owned).collect())
}

fn check_settings(map: &ConfigMap, settings: &Value, source: &str) {
    for (name, value) in &map.expected {
        assert_eq!(
            settings.get(name),
            Some(value),
            "{}: {name} as {source} says",
            map.name
        );
    }
}

#[test]
fn aws_nodes_config_maps_start_the_agent_with_aws_nodes_settings() {
    let scratch = ScratchDir::new("vpcnet-config-maps").unwrap();
    for map in config_maps(scratch.path()) {
        let (settings, stderr) = settings_of(&map.data);
        check_settings(&map, &settings, "vpcnet-agent settings");
        // One line per tolerated value, naming the variable and what is
        // used instead.
        let tolerated: Vec<&String> = stderr
            .iter()
            .filter(|line| line.ends_with(", as aws-node does"))
            .collect();
        assert_eq!(
            tolerated.len(),
            map.tolerated.len(),
            "{}: tolerated values\n{}",
            map.name,
            stderr.join("\n")
        );
        for (variable, used) in &map.tolerated {
            assert!(
                tolerated
                    .iter()
                    .any(|line| line.contains(&format!(" {variable}=\""))
                        && line.contains(&format!("; using {used}, as aws-node does"))),
                "{}: nothing says {variable} is taken as {used}\n{}",
                map.name,
                stderr.join("\n")
            );
        }
        for variable in &map.no_effect {
            assert!(
                stderr
                    .iter()
                    .any(|line| line.contains(&format!("{variable}="))
                        && line.contains("has no effect in vpcnet")),
                "{}: no warning for {variable}\n{}",
                map.name,
                stderr.join("\n")
            );
        }
        // What a reader compares with aws-node's: the settings checked,
        // then each tolerated value as the agent said it.
        let checked: Vec<String> = map
            .expected
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        println!("{}: as aws-node: {}", map.name, checked.join(" "));
        for line in tolerated {
            println!("  {line}");
        }
    }
}

#[test]
fn the_agent_starts_in_the_lab_with_each_config_map() {
    let _lock = lab_lock();
    let scratch = ScratchDir::new("vpcnet-config-maps-lab").unwrap();
    for map in config_maps(scratch.path()) {
        let mut ipam = IpamLabOptions::new("m5.large");
        ipam.agent_args = FAST_AGENT_ARGS.iter().map(|a| (*a).to_owned()).collect();
        let opts = LabOptions {
            ipam: Some(ipam),
            // Last on the agent's command line: over the lab's own choices.
            agent_env: map
                .data
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .collect(),
            ..LabOptions::ebpf(0, agent_binary())
        };
        let lab =
            Lab::up(&opts).unwrap_or_else(|e| panic!("{}: the agent did not start: {e}", map.name));
        let log_file = map
            .data
            .iter()
            .find(|(k, _)| *k == "AWS_VPC_K8S_CNI_LOG_FILE")
            .map(|(_, v)| v.clone())
            .expect("every map names a log file");
        let log = std::fs::read_to_string(&log_file)
            .unwrap_or_else(|e| panic!("{}: the agent's log {log_file}: {e}", map.name));
        let line = log
            .lines()
            .rev()
            .find(|l| l.contains("settings in force"))
            .unwrap_or_else(|| panic!("{}: no settings in the agent's log:\n{log}", map.name));
        let json = &line[line.find("settings=").expect("the settings field") + "settings=".len()..];
        let settings: Value = serde_json::from_str(json).expect("the logged settings' JSON");
        check_settings(&map, &settings, "the running agent's log");
        lab.down().unwrap();
        std::fs::remove_file(&log_file).unwrap();
    }
}
