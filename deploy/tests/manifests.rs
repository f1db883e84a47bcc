//! The Kubernetes manifests, the kustomization and the Helm chart, offline:
//! every object parses as its kind with no field the kind lacks, the parts
//! refer to each other correctly, the `ConfigMap` is the agent's defaults, the
//! commands are the agent's, and kustomize's and Helm's renderings (the real
//! tools, `cargo xtask setup` installs them) set a node up alike.

use std::{collections::BTreeMap, fmt::Write as _, path::Path, process::Command};

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{PodSpec, Probe},
};
use vpcnet_agent::{
    cloud::CloudOptions,
    env::Env,
    install::PluginEnv,
    introspect::Endpoints,
    ipam::settings::IpamSettings,
    k8s::service_cidrs,
    node::NodeSysctls,
    settings::{VARIABLES, aws_node},
    snat::SnatSettings,
};
use vpcnet_deploy::{
    DEPLOY_DIR, Objects, chart_dir, kubernetes_manifests, kustomization_manifests, node_selection,
    objects, output_of,
};
use vpcnet_lab::{
    IpamLabOptions, Lab, LabOptions, cluster,
    kube_tools::{HELM, KUBECTL},
};

/// Keys of the `ConfigMap` that are not the agent's variables.
const OTHER_KEYS: &[&str] = &["RUST_LOG"];

fn pod_spec(ds: &DaemonSet) -> &PodSpec {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("a pod template")
}

/// The host path of each `hostPath` volume, by volume name.
fn host_paths(spec: &PodSpec) -> BTreeMap<&str, &str> {
    spec.volumes
        .iter()
        .flatten()
        .filter_map(|v| Some((v.name.as_str(), v.host_path.as_ref()?.path.as_str())))
        .collect()
}

/// What a `DaemonSet` does on a node, whatever it is named: its containers'
/// images and commands, its host paths by mount path, the probes.
fn node_setup(ds: &DaemonSet) -> String {
    let spec = pod_spec(ds);
    let host_paths = host_paths(spec);
    let mut out = String::new();
    for c in spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
    {
        let privileged = c.security_context.as_ref().and_then(|s| s.privileged);
        writeln!(
            out,
            "{} {:?} {:?} privileged={privileged:?}",
            c.name, c.image, c.command
        )
        .unwrap();
        for m in c.volume_mounts.iter().flatten() {
            let host = host_paths.get(m.name.as_str());
            writeln!(
                out,
                "  {} <- {host:?} {:?}",
                m.mount_path, m.mount_propagation
            )
            .unwrap();
        }
        let exec = |p: &Option<Probe>| p.as_ref().and_then(|p| p.exec.clone());
        writeln!(
            out,
            "  ready {:?}\n  live {:?}",
            exec(&c.readiness_probe),
            exec(&c.liveness_probe)
        )
        .unwrap();
    }
    writeln!(
        out,
        "hostNetwork={:?} priority={:?} tolerations={:?} token={:?}",
        spec.host_network,
        spec.priority_class_name,
        spec.tolerations,
        spec.automount_service_account_token
    )
    .unwrap();
    out
}

/// Checks what any rendering must hold: one `DaemonSet` whose pod uses the
/// `ServiceAccount` and the `ConfigMap` of the same rendering, mounts only
/// volumes it declares, runs on the node's network, and whose commands the
/// agent binary accepts.
/// The rules of every ClusterRole bound to ServiceAccount `account` in
/// `namespace`, as (group, resource, sorted verbs), sorted.
fn granted_rules(
    all: &Objects,
    namespace: &str,
    account: &str,
) -> Vec<(String, String, Vec<String>)> {
    let mut rules = Vec::new();
    for binding in all.cluster_role_bindings() {
        let bound = binding.subjects.iter().flatten().any(|s| {
            s.kind == "ServiceAccount"
                && s.name == account
                && s.namespace.as_deref() == Some(namespace)
        });
        if !bound {
            continue;
        }
        let role = all
            .cluster_roles()
            .find(|r| r.metadata.name.as_deref() == Some(binding.role_ref.name.as_str()))
            .unwrap_or_else(|| {
                panic!(
                    "the bound ClusterRole {} is not in the rendering",
                    binding.role_ref.name
                )
            });
        for rule in role.rules.iter().flatten() {
            for group in rule.api_groups.iter().flatten() {
                for resource in rule.resources.iter().flatten() {
                    let mut verbs = rule.verbs.clone();
                    verbs.sort();
                    rules.push((group.clone(), resource.clone(), verbs));
                }
            }
        }
    }
    rules.sort();
    rules
}

fn assert_consistent(all: &Objects, what: &str) {
    let ds = all.daemon_set();
    let spec = pod_spec(ds);
    assert_eq!(spec.host_network, Some(true), "{what}: hostNetwork");
    let account = spec.service_account_name.as_deref().unwrap_or("default");
    assert!(
        all.service_accounts()
            .any(|sa| sa.metadata.name.as_deref() == Some(account)),
        "{what}: the DaemonSet's ServiceAccount {account} is not in the rendering"
    );
    // The ServiceAccount may do exactly what the agent does with the API.
    assert_eq!(
        spec.automount_service_account_token,
        Some(true),
        "{what}: the token is mounted"
    );
    let namespace = ds.metadata.namespace.as_deref().unwrap_or("kube-system");
    let mut used: Vec<(String, String, Vec<String>)> = vpcnet_agent::k8s::API_ACCESS
        .iter()
        .map(|(group, resource, verbs)| {
            let mut verbs: Vec<String> = verbs.iter().map(|v| (*v).to_owned()).collect();
            verbs.sort();
            ((*group).to_owned(), (*resource).to_owned(), verbs)
        })
        .collect();
    used.sort();
    assert_eq!(
        granted_rules(all, namespace, account),
        used,
        "{what}: the agent's RBAC"
    );
    let volumes: Vec<&str> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    let config_map = all.config_map().metadata.name.clone().unwrap_or_default();
    let agent = vpcnet_bpf_tests::agent_binary();
    for c in spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
    {
        for m in c.volume_mounts.iter().flatten() {
            assert!(
                volumes.contains(&m.name.as_str()),
                "{what}: {} mounts undeclared volume {}",
                c.name,
                m.name
            );
        }
        for source in c.env_from.iter().flatten() {
            let name = source.config_map_ref.as_ref().map(|r| r.name.as_str());
            assert_eq!(
                name,
                Some(config_map.as_str()),
                "{what}: {} envFrom",
                c.name
            );
        }
        let probes = [&c.readiness_probe, &c.liveness_probe];
        let commands = std::iter::once(c.command.as_ref()).chain(
            probes
                .iter()
                .map(|p| p.as_ref().and_then(|p| p.exec.as_ref()?.command.as_ref())),
        );
        for argv in commands.flatten() {
            assert_eq!(argv[0], "vpcnet-agent", "{what}: {} runs {argv:?}", c.name);
            // `--help` after the arguments: clap checks the subcommand and
            // every flag before it, and prints the help instead of running.
            output_of(Command::new(&agent).args(&argv[1..]).arg("--help"))
                .unwrap_or_else(|e| panic!("{what}: the agent does not take {argv:?}: {e}"));
        }
    }
}

#[test]
fn the_manifests_are_valid_objects_that_fit_together() {
    let (all, kustomization) = kubernetes_manifests().unwrap();
    let kinds: Vec<&str> = all.0.iter().map(vpcnet_deploy::Object::kind).collect();
    assert_eq!(
        kinds,
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "DaemonSet"
        ]
    );
    assert_consistent(&all, "deploy/kubernetes");
    for object in &all.0 {
        let namespace = match object {
            vpcnet_deploy::Object::DaemonSet(o) => &o.metadata.namespace,
            vpcnet_deploy::Object::ServiceAccount(o) => &o.metadata.namespace,
            vpcnet_deploy::Object::ConfigMap(o) => &o.metadata.namespace,
            vpcnet_deploy::Object::Service(o) => &o.metadata.namespace,
            // Cluster-scoped.
            vpcnet_deploy::Object::ClusterRole(_)
            | vpcnet_deploy::Object::ClusterRoleBinding(_) => continue,
        };
        assert_eq!(
            namespace.as_deref(),
            Some("kube-system"),
            "{}",
            object.name()
        );
    }
    // The kustomization's image name is the one the containers use.
    let image = kustomization["images"][0]["name"].as_str().unwrap();
    for c in &pod_spec(all.daemon_set()).containers {
        assert_eq!(c.image.as_deref(), Some(image), "{}", c.name);
    }
}

/// The host path of each mount of `ds`'s containers, by mount path.
fn host_mounts(ds: &DaemonSet) -> BTreeMap<String, String> {
    let spec = pod_spec(ds);
    let host_paths = host_paths(spec);
    spec.init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
        .flat_map(|c| c.volume_mounts.iter().flatten())
        .map(|m| {
            let host = host_paths.get(m.name.as_str()).copied().unwrap_or("?");
            (m.mount_path.clone(), host.to_owned())
        })
        .collect()
}

/// aws-node's log file (`AWS_VPC_K8S_CNI_LOG_FILE` as aws-node's
/// ConfigMap has it) and the policy event log land in the host's
/// `/var/log/aws-routed-eni`, where EKS's log collector reads them, with
/// kustomize and Helm alike.
#[test]
fn aws_nodes_log_paths_land_in_the_hosts_log_directory() {
    let policy_log = Path::new(vpcnet_agent::policy::settings::DEFAULT_POLICY_EVENT_LOG_FILE);
    for (tool, objects) in [("kustomize", kustomize()), ("helm", helm_template(&[]))] {
        let mounts = host_mounts(objects.daemon_set());
        for in_container in [
            "/host/var/log/aws-routed-eni",
            policy_log.parent().unwrap().to_str().unwrap(),
        ] {
            assert_eq!(
                mounts.get(in_container).map(String::as_str),
                Some("/var/log/aws-routed-eni"),
                "{tool}: {in_container}"
            );
        }
    }
}

#[test]
fn the_rollback_runs_uninstall_where_the_agent_keeps_its_state() {
    let (agent, _) = kubernetes_manifests().unwrap();
    let (rollback, kustomization) = kustomization_manifests("kubernetes/rollback").unwrap();
    let kinds: Vec<&str> = rollback.0.iter().map(vpcnet_deploy::Object::kind).collect();
    assert_eq!(kinds, ["DaemonSet"]);
    let (agent_ds, rollback_ds) = (agent.daemon_set(), rollback.daemon_set());
    let spec = pod_spec(rollback_ds);
    assert_eq!(spec.host_network, Some(true));
    // The ServiceAccount and ConfigMap are vpcnet's own, kept for it.
    assert_eq!(
        spec.service_account_name,
        pod_spec(agent_ds).service_account_name
    );
    let init = &spec.init_containers.as_ref().expect("an init container")[0];
    let config_map = init.env_from.as_ref().unwrap()[0]
        .config_map_ref
        .as_ref()
        .unwrap()
        .name
        .clone();
    assert_eq!(Some(config_map), agent.config_map().metadata.name.clone());
    let argv = init.command.as_ref().unwrap();
    assert_the_agent_uninstalls_with(argv);
    // Every path uninstall works on is where the agent keeps it.
    let agent_mounts = host_mounts(agent_ds);
    for (mount, host) in host_mounts(rollback_ds) {
        assert_eq!(
            agent_mounts.get(&mount),
            Some(&host),
            "the rollback mounts {host} at {mount}"
        );
    }
    let conf_dir = &argv[argv.iter().position(|a| a == "--cni-conf-dir").unwrap() + 1];
    assert!(
        agent_mounts.contains_key(conf_dir),
        "--cni-conf-dir {conf_dir} is not mounted"
    );
    let image = kustomization["images"][0]["name"].as_str().unwrap();
    for c in spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
    {
        assert_eq!(c.image.as_deref(), Some(image), "{}", c.name);
    }
    // kustomize renders it as it is.
    let rendered = output_of(
        Command::new(KUBECTL)
            .arg("kustomize")
            .arg(Path::new(DEPLOY_DIR).join("kubernetes/rollback")),
    )
    .unwrap();
    let rendered = objects(&rendered, "kubectl kustomize rollback").unwrap();
    assert_eq!(
        node_setup(rendered.daemon_set()),
        node_setup(rollback_ds).replace("Some(\"vpcnet\")", "Some(\"vpcnet:latest\")")
    );
}

#[test]
fn the_config_map_holds_every_variable_with_the_agents_defaults() {
    let (all, _) = kubernetes_manifests().unwrap();
    let data = all.config_map().data.clone().unwrap_or_default();
    for variable in VARIABLES {
        assert!(
            data.contains_key(*variable),
            "{variable} is not in the ConfigMap"
        );
    }
    for key in data.keys() {
        assert!(
            VARIABLES.contains(&key.as_str()) || OTHER_KEYS.contains(&key.as_str()),
            "the ConfigMap sets {key}, which the agent does not read"
        );
    }
    // The agent reads the ConfigMap exactly as it reads nothing at all,
    // tolerating nothing and warning of nothing.
    let (set, unset) = (
        Env::from_pairs(data.clone()),
        Env::from_pairs(std::iter::empty::<(String, String)>()),
    );
    assert_eq!(
        SnatSettings::from_env(&set).unwrap(),
        SnatSettings::from_env(&unset).unwrap()
    );
    assert_eq!(
        IpamSettings::from_env(&set).unwrap(),
        IpamSettings::from_env(&unset).unwrap()
    );
    assert_eq!(
        Endpoints::from_env(&set, None, None).unwrap(),
        Endpoints::from_env(&unset, None, None).unwrap()
    );
    assert_eq!(
        service_cidrs::from_env(&set).unwrap(),
        service_cidrs::from_env(&unset).unwrap()
    );
    assert_eq!(
        PluginEnv::from_env(&set).unwrap(),
        PluginEnv::from_env(&unset).unwrap()
    );
    assert_eq!(CloudOptions::from_env(&set), CloudOptions::from_env(&unset));
    assert_eq!(NodeSysctls::from_env(&set), NodeSysctls::from_env(&unset));
    assert_eq!(aws_node::check(&set).unwrap(), Vec::<String>::new());
    assert_eq!(set.tolerated(), []);
    assert_eq!(
        data["AWS_VPC_K8S_CNI_VETHPREFIX"],
        vpcnet_api::pod::DEFAULT_VETH_PREFIX
    );
    // And the operator's guide describes every one.
    let guide = std::fs::read_to_string(Path::new(DEPLOY_DIR).join("README.md")).unwrap();
    for key in data.keys() {
        assert!(
            guide.contains(&format!("| `{key}` |")),
            "deploy/README.md has no row for {key}"
        );
    }
}

/// `kubectl kustomize deploy/kubernetes`, with the image set as an
/// operator sets it.
fn kustomize() -> Objects {
    kustomize_with(&[])
}

/// [`kustomize`] with the components in `deploy/kubernetes/<component>`.
fn kustomize_with(components: &[&str]) -> Objects {
    let scratch = vpcnet_lab::ScratchDir::new("vpcnet-kustomize").unwrap();
    // kustomize takes a base by relative path only.
    let up = "../".repeat(scratch.path().components().count() - 1);
    let base = format!("{up}{}", DEPLOY_DIR.trim_start_matches('/'));
    let mut kustomization = format!(
        "resources:\n  - {base}/kubernetes\nimages:\n  - name: vpcnet\n    newName: registry.example/vpcnet\n    newTag: v9\n"
    );
    if !components.is_empty() {
        kustomization.push_str("components:\n");
        for component in components {
            let _ = writeln!(kustomization, "  - {base}/kubernetes/{component}");
        }
    }
    std::fs::write(scratch.path().join("kustomization.yaml"), kustomization).unwrap();
    let text = output_of(Command::new(KUBECTL).arg("kustomize").arg(scratch.path())).unwrap();
    objects(&text, "kubectl kustomize").unwrap()
}

/// `helm template` of the chart with `args`, as release `vpcnet`.
fn helm_template(args: &[&str]) -> Objects {
    helm_release("vpcnet", args)
}

/// `helm template` of the chart with `args`, as release `release`.
fn helm_release(release: &str, args: &[&str]) -> Objects {
    let text = vpcnet_deploy::helm_template(HELM, release, args).unwrap();
    objects(&text, "helm template").unwrap()
}

#[test]
fn kustomize_and_helm_set_a_node_up_alike() {
    let kustomized = kustomize();
    assert_consistent(&kustomized, "kustomize");
    let ds = kustomized.daemon_set();
    assert_eq!(
        pod_spec(ds).containers[0].image.as_deref(),
        Some("registry.example/vpcnet:v9")
    );
    let labels = ds.metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels["app.kubernetes.io/part-of"], "vpcnet");

    output_of(Command::new(HELM).arg("lint").arg(chart_dir())).unwrap();
    let charted = helm_template(&[
        "--set",
        "image.repository=registry.example/vpcnet",
        "--set",
        "image.tag=v9",
    ]);
    assert_consistent(&charted, "helm");
    assert_eq!(node_setup(charted.daemon_set()), node_setup(ds));
    assert_eq!(charted.config_map().data, kustomized.config_map().data);
}

/// cni-metrics-helper lists the pods labelled `k8s-app=aws-node` in
/// `kube-system` and reads port 61678 of each through the API server:
/// vpcnet's pods get the label when asked (the kustomize component, the
/// chart's `podLabels`), never in the DaemonSet's selector.
#[test]
fn cni_metrics_helper_finds_the_pods_when_asked() {
    let (key, value) = vpcnet_agent::introspect::METRICS_HELPER_POD_LABEL;
    let metrics_port: i32 = vpcnet_agent::introspect::DEFAULT_METRICS_ADDRESS
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .unwrap();
    let check = |all: &Objects, what: &str, labelled: bool| {
        let ds = all.daemon_set();
        assert_eq!(
            ds.metadata.namespace.as_deref(),
            Some("kube-system"),
            "{what}: cni-metrics-helper looks in kube-system only"
        );
        let spec = ds.spec.as_ref().unwrap();
        assert!(
            spec.selector.match_expressions.is_none()
                && !spec
                    .selector
                    .match_labels
                    .as_ref()
                    .is_some_and(|l| l.contains_key(key)),
            "{what}: the DaemonSet's selector must not take aws-node's pods"
        );
        let labels = spec
            .template
            .metadata
            .as_ref()
            .and_then(|m| m.labels.clone());
        assert_eq!(
            labels.unwrap_or_default().get(key).map(String::as_str) == Some(value),
            labelled,
            "{what}: {key}={value} on the pods"
        );
        let agent = &pod_spec(ds).containers[0];
        assert!(
            agent
                .ports
                .iter()
                .flatten()
                .any(|p| p.container_port == metrics_port),
            "{what}: the agent's metrics port"
        );
    };
    check(&kustomize(), "kustomize", false);
    check(&helm_template(&[]), "helm", false);
    check(
        &kustomize_with(&["cni-metrics-helper"]),
        "kustomize with the component",
        true,
    );
    check(
        &helm_template(&["--set", &format!("podLabels.{key}={value}")]),
        "helm with podLabels",
        true,
    );
}

#[test]
fn helm_values_keep_the_aws_vpc_cni_charts_names() {
    let charted = helm_template(&[
        "--set",
        "env.AWS_VPC_K8S_CNI_EXTERNALSNAT=true",
        "--set",
        "env.WARM_IP_TARGET=5",
        "--set",
        "serviceAccount.annotations.eks\\.amazonaws\\.com/role-arn=arn:aws:iam::111122223333:role/vpcnet",
        "--set",
        "nodeSelector.pool=dense",
        "--set",
        "resources.requests.cpu=50m",
    ]);
    assert_consistent(&charted, "helm with values");
    let data = charted.config_map().data.clone().unwrap_or_default();
    assert_eq!(data["AWS_VPC_K8S_CNI_EXTERNALSNAT"], "true");
    assert_eq!(data["WARM_IP_TARGET"], "5");
    let settings = IpamSettings::from_env(&Env::from_pairs(data.clone())).unwrap();
    assert_eq!(settings.warm_ip_target, 5);
    let sa = charted.service_accounts().next().unwrap();
    let annotations = sa.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        annotations["eks.amazonaws.com/role-arn"],
        "arn:aws:iam::111122223333:role/vpcnet"
    );
    let spec = pod_spec(charted.daemon_set());
    assert_eq!(
        spec.node_selector.as_ref().unwrap()["pool"],
        "dense",
        "nodeSelector"
    );
    let cpu = spec.containers[0]
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .map(|r| r["cpu"].0.clone());
    assert_eq!(cpu.as_deref(), Some("50m"));

    // A changed variable changes the pod template: the pods roll.
    let checksum = |all: &Objects| {
        all.daemon_set()
            .spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.annotations.as_ref())
            .map(|a| a["checksum/config"].clone())
    };
    assert_ne!(checksum(&charted), checksum(&helm_template(&[])));

    // Without a ServiceAccount of its own, the chart uses the one named.
    let borrowed = helm_template(&[
        "--set",
        "serviceAccount.create=false",
        "--set",
        "serviceAccount.name=aws-node",
    ]);
    assert_eq!(borrowed.service_accounts().count(), 0);
    assert_eq!(
        pod_spec(borrowed.daemon_set())
            .service_account_name
            .as_deref(),
        Some("aws-node")
    );
}

/// `helm template` with `args` and its error: the chart refuses them.
fn helm_refuses(args: &[&str]) -> String {
    match vpcnet_deploy::helm_template(HELM, "vpcnet", args) {
        Ok(_) => panic!("helm took {args:?}"),
        Err(e) => e.to_string(),
    }
}

/// The chart's `values.schema.json` holds: its defaults pass, and a value
/// it does not know or of the wrong shape is refused by `helm template`
/// with a message naming it (a typo never goes unnoticed, nor does one
/// of the aws-vpc-cni chart's values vpcnet does not have).
#[test]
fn the_chart_refuses_values_its_schema_does_not_allow() {
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(chart_dir().join("values.schema.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(schema["additionalProperties"], false);
    // The defaults: the chart's own values pass, lint included.
    output_of(Command::new(HELM).arg("lint").arg(chart_dir())).unwrap();
    helm_template(&[]);
    // Each refused by the schema, naming the value (the words around it
    // are the schema validator's, which Helm versions change).
    for (args, names) in [
        (&["--set", "image.pullPolicy=Sometimes"][..], "pullPolicy"),
        // The aws-vpc-cni chart's name of what is metrics.podMonitor here.
        (&["--set", "podMonitor.create=true"], "podMonitor"),
        (&["--set", "env.WARM IP TARGET=5"], "WARM IP TARGET"),
        (
            &[
                "--set",
                "extraEnv[0].name=HTTPS_PROXY",
                "--set",
                "extraEnv[0].valu=x",
            ],
            "valu",
        ),
        // An EnvVar's value is a string: a number needs --set-string.
        (
            &[
                "--set",
                "extraEnv[0].name=MTU",
                "--set",
                "extraEnv[0].value=9001",
            ],
            "value",
        ),
        (
            &[
                "--set",
                "extraEnv[0].name=NODE",
                "--set",
                "extraEnv[0].valueFrom.fieldRef.path=spec.nodeName",
            ],
            "fieldPath",
        ),
        (&["--set", "init.env.RUST_LOG[0]=debug"], "RUST_LOG"),
        (&["--set", "rollback.enabled=yes"], "enabled"),
        (
            &["--set", "metrics.podMonitor.interval=30 seconds"],
            "interval",
        ),
        (
            &["--set", "metrics.prometheusRule.natTableFullRatio=90"],
            "natTableFullRatio",
        ),
        (
            &[
                "--set",
                "metrics.prometheusRule.ignoredDropReasons[0]=nat_full",
            ],
            "ignoredDropReasons",
        ),
        (&["--set", "resources.request.cpu=1"], "request"),
    ] {
        let error = helm_refuses(args);
        assert!(
            error.contains("values don't meet the specifications of the schema")
                && error.contains(names),
            "{args:?}: {error}"
        );
    }
    // And the chart's own check: an EnvVar with both.
    let error = helm_refuses(&[
        "--set",
        "extraEnv[0].name=X",
        "--set-string",
        "extraEnv[0].value=1",
        "--set",
        "extraEnv[0].valueFrom.fieldRef.fieldPath=spec.nodeName",
    ]);
    assert!(
        error.contains("extraEnv: X has both value and valueFrom: give one"),
        "{error}"
    );
}

/// The variable named `name` of container `c`.
fn env_var<'a>(
    c: &'a k8s_openapi::api::core::v1::Container,
    name: &str,
) -> Option<&'a k8s_openapi::api::core::v1::EnvVar> {
    c.env.iter().flatten().find(|e| e.name == name)
}

/// `init.env` goes to the init container by name; `extraEnv` (whole
/// `EnvVar`s, `valueFrom` included) after the agent's own variables, and to
/// the rollback's `uninstall`, which reads the same settings.
#[test]
fn init_env_and_extra_env_reach_their_containers() {
    let charted = helm_template(&[
        "--set",
        "init.env.RUST_LOG=debug",
        "--set-string",
        "init.env.HTTP_TIMEOUT=30",
        "--set",
        "extraEnv[0].name=HTTPS_PROXY",
        "--set",
        "extraEnv[0].valueFrom.secretKeyRef.name=egress-proxy",
        "--set",
        "extraEnv[0].valueFrom.secretKeyRef.key=url",
        "--set",
        "extraEnv[1].name=AWS_STS_REGIONAL_ENDPOINTS",
        "--set",
        "extraEnv[1].value=regional",
        "--set",
        "rollback.enabled=true",
    ]);
    assert_consistent_agent(&charted);
    let spec = pod_spec(charted.daemon_set_named("vpcnet"));
    let init = spec
        .init_containers
        .iter()
        .flatten()
        .find(|c| c.name == "vpcnet-init")
        .expect("the plugins' init container");
    assert_eq!(
        env_var(init, "RUST_LOG").and_then(|e| e.value.as_deref()),
        Some("debug")
    );
    assert_eq!(
        env_var(init, "HTTP_TIMEOUT").and_then(|e| e.value.as_deref()),
        Some("30")
    );
    let agent = &spec.containers[0];
    let names: Vec<&str> = agent
        .env
        .iter()
        .flatten()
        .map(|e| e.name.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "MY_NODE_NAME",
            "MY_POD_NAME",
            "HTTPS_PROXY",
            "AWS_STS_REGIONAL_ENDPOINTS"
        ]
    );
    let secret = env_var(agent, "HTTPS_PROXY")
        .and_then(|e| e.value_from.as_ref())
        .and_then(|v| v.secret_key_ref.as_ref())
        .unwrap();
    assert_eq!(
        (secret.name.as_str(), secret.key.as_str()),
        ("egress-proxy", "url")
    );
    let uninstall = &pod_spec(charted.daemon_set_named("vpcnet-rollback"))
        .init_containers
        .as_ref()
        .unwrap()[0];
    assert_eq!(
        uninstall.env,
        agent.env.as_ref().map(|env| env[2..].to_vec())
    );
    // Without them, neither has an env of its own.
    let plain = helm_template(&["--set", "rollback.enabled=true"]);
    let init = &pod_spec(plain.daemon_set_named("vpcnet"))
        .init_containers
        .as_ref()
        .unwrap()[0];
    assert_eq!(init.env, None);
}

/// [`assert_consistent`] for a rendering that may hold the rollback's
/// DaemonSet too: the agent's objects without it.
fn assert_consistent_agent(all: &Objects) {
    let agent_only = Objects(
        all.0
            .iter()
            .filter(|o| !(o.kind() == "DaemonSet" && o.name().ends_with("-rollback")))
            .cloned()
            .collect(),
    );
    assert_consistent(&agent_only, "helm");
}

/// The chart's rollback DaemonSet (`rollback.enabled`) as the Helm test
/// renders it.
fn helm_rollback_spec() -> PodSpec {
    pod_spec(helm_template(&["--set", "rollback.enabled=true"]).daemon_set_named("vpcnet-rollback"))
        .clone()
}

/// A Helm release rolls back with its own names: `rollback.enabled`
/// renders a DaemonSet that sets a node up as `deploy/kubernetes/rollback`
/// does, with the release's ServiceAccount, ConfigMap and image, and whose
/// pods neither DaemonSet's selector takes for the other's.
#[test]
fn the_charts_rollback_runs_uninstall_with_the_releases_names() {
    assert_eq!(
        helm_template(&[]).daemon_sets().count(),
        1,
        "off by default"
    );
    let charted = helm_release(
        "edge",
        &[
            "--set",
            "rollback.enabled=true",
            "--set",
            "image.repository=registry.example/vpcnet",
            "--set",
            "image.tag=v9",
        ],
    );
    let agent = charted.daemon_set_named("edge-vpcnet");
    let rollback = charted.daemon_set_named("edge-vpcnet-rollback");
    let spec = pod_spec(rollback);
    assert_eq!(
        spec.service_account_name,
        pod_spec(agent).service_account_name
    );
    assert!(
        charted
            .service_accounts()
            .any(|sa| sa.metadata.name == spec.service_account_name)
    );
    let init = &spec.init_containers.as_ref().unwrap()[0];
    assert_eq!(
        init.env_from.as_ref().unwrap()[0]
            .config_map_ref
            .as_ref()
            .map(|r| r.name.as_str()),
        Some("edge-vpcnet-config")
    );
    // As kustomize's rollback, on the node.
    let (kustomized, _) = kustomization_manifests("kubernetes/rollback").unwrap();
    assert_eq!(
        node_setup(rollback),
        node_setup(kustomized.daemon_set())
            .replace("Some(\"vpcnet\")", "Some(\"registry.example/vpcnet:v9\")")
    );
    // Neither selector takes the other's pods.
    let pod_labels = |ds: &DaemonSet| {
        ds.spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.labels.clone())
            .unwrap_or_default()
    };
    let selects = |ds: &DaemonSet, labels: &BTreeMap<String, String>| {
        let selector = ds.spec.as_ref().unwrap().selector.match_labels.clone();
        selector
            .unwrap_or_default()
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
    };
    assert!(selects(agent, &pod_labels(agent)) && selects(rollback, &pod_labels(rollback)));
    assert!(!selects(agent, &pod_labels(rollback)) && !selects(rollback, &pod_labels(agent)));
    // Its commands are the agent's.
    assert_the_agent_uninstalls_with(init.command.as_ref().unwrap());
}

/// Each DaemonSet, kustomize's and the chart's, runs where the node label
/// says, and nowhere else: the scheduler's rule on an EKS node's labels.
#[test]
fn each_daemon_set_runs_only_where_the_node_label_says() {
    let label = node_selection::NODE_LABEL;
    let renderings = [
        (
            "vpcnet (kustomize)",
            pod_spec(kustomize().daemon_set()).clone(),
            Some(node_selection::ON_VPCNET),
        ),
        (
            "vpcnet (Helm)",
            pod_spec(helm_template(&[]).daemon_set()).clone(),
            Some(node_selection::ON_VPCNET),
        ),
        (
            "vpcnet-rollback (kustomize)",
            pod_spec(
                kustomization_manifests("kubernetes/rollback")
                    .unwrap()
                    .0
                    .daemon_set(),
            )
            .clone(),
            Some(node_selection::ROLLBACK),
        ),
        (
            "vpcnet-rollback (Helm)",
            helm_rollback_spec(),
            Some(node_selection::ROLLBACK),
        ),
    ];
    for (value, arch) in [
        None,
        Some(node_selection::ON_VPCNET),
        Some(node_selection::ROLLBACK),
    ]
    .into_iter()
    .flat_map(|value| ["amd64", "arm64"].map(|arch| (value, arch)))
    {
        let mut labels: BTreeMap<String, String> = [
            ("kubernetes.io/os", "linux"),
            ("kubernetes.io/arch", arch),
            ("eks.amazonaws.com/nodegroup", "general"),
        ]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        if let Some(value) = value {
            labels.insert(label.to_owned(), value.to_owned());
        }
        for (name, spec, runs_on) in &renderings {
            assert_eq!(
                node_selection::admits(spec, &labels),
                value == *runs_on,
                "{name} with {label}={value:?} on {arch}"
            );
        }
    }
}

/// The guide's table of aws-node's variables is the agent's.
#[test]
fn the_guide_prints_the_agents_table_of_aws_node_variables() {
    let guide = std::fs::read_to_string(Path::new(DEPLOY_DIR).join("README.md")).unwrap();
    let (begin, end) = (
        "<!-- aws-node variables: begin -->\n",
        "<!-- aws-node variables: end -->",
    );
    let start = guide.find(begin).expect("the table's begin marker") + begin.len();
    let stop = guide.find(end).expect("the table's end marker");
    let expected = aws_node::markdown_table();
    assert!(
        guide[start..stop] == expected,
        "deploy/README.md's table differs from the agent's; it should read:\n{expected}"
    );
}

/// A node group moves with one label, through the lab's Kubernetes API
/// and the real kubectl: unlabelled, only aws-node runs on the node
/// (with the EKS add-on's configuration or the Helm values of
/// `deploy/aws-node/`); `vpcnet.dev/cni=vpcnet`, only vpcnet's DaemonSet
/// (kustomize's and the chart's alike); `=rollback`, only the rollback's;
/// the label removed, aws-node again.
#[test]
fn one_node_label_moves_a_node_between_aws_node_vpcnet_and_the_rollback() {
    let _lock = vpcnet_lab::serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let mut ipam = IpamLabOptions::new("m5.large");
    ipam.kube_api = true;
    let lab = Lab::up(&LabOptions {
        ipam: Some(ipam),
        agent_bin: Some(vpcnet_bpf_tests::agent_binary()),
        ..LabOptions::iptables(1)
    })
    .expect("a node with the API server");
    let files = lab.kube_api().unwrap().files().clone();
    let spec_of = |objects: &Objects| pod_spec(objects.daemon_set()).clone();
    let aws_node_spec = |file| PodSpec {
        affinity: Some(node_selection::aws_node_affinity(file).unwrap()),
        ..PodSpec::default()
    };
    let daemon_sets = [
        (
            "aws-node (EKS add-on)",
            aws_node_spec(node_selection::ADDON_CONFIGURATION),
        ),
        (
            "aws-node (Helm values)",
            aws_node_spec(node_selection::HELM_VALUES),
        ),
        ("vpcnet (kustomize)", spec_of(&kustomize())),
        ("vpcnet (Helm)", spec_of(&helm_template(&[]))),
        (
            "vpcnet-rollback (kustomize)",
            spec_of(&kustomization_manifests("kubernetes/rollback").unwrap().0),
        ),
        ("vpcnet-rollback (Helm)", helm_rollback_spec()),
    ];
    let node = cluster::node_name();
    let label = node_selection::NODE_LABEL;
    for (set, runs) in [
        (None, "aws-node"),
        (Some(node_selection::ON_VPCNET), "vpcnet ("),
        (Some(node_selection::ROLLBACK), "vpcnet-rollback"),
        (None, "aws-node"),
    ] {
        let change = set.map_or_else(|| format!("{label}-"), |value| format!("{label}={value}"));
        cluster::kubectl(
            &files,
            &["label", "node", &node, &change, "--overwrite"],
            None,
        )
        .expect("kubectl label node");
        let got = cluster::kubectl(&files, &["get", "node", &node, "-o", "json"], None)
            .expect("kubectl get node");
        let got: k8s_openapi::api::core::v1::Node = serde_json::from_str(&got).unwrap();
        let labels = got.metadata.labels.unwrap_or_default();
        let running: Vec<&str> = daemon_sets
            .iter()
            .filter(|(_, spec)| node_selection::admits(spec, &labels))
            .map(|(name, _)| *name)
            .collect();
        let expected: Vec<&str> = daemon_sets
            .iter()
            .map(|(name, _)| *name)
            .filter(|name| name.starts_with(runs))
            .collect();
        assert_eq!(running, expected, "with {change}, what runs on the node");
        println!("kubectl label node {node} {change}: {running:?}");
    }
    lab.down().expect("lab down");
}

/// `argv` is `vpcnet-agent uninstall ...`, with arguments the agent takes.
fn assert_the_agent_uninstalls_with(argv: &[String]) {
    assert_eq!(argv[..2], ["vpcnet-agent", "uninstall"]);
    output_of(
        Command::new(vpcnet_bpf_tests::agent_binary())
            .args(&argv[1..])
            .arg("--help"),
    )
    .unwrap_or_else(|e| panic!("the agent does not take {argv:?}: {e}"));
}
