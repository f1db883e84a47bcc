//! The lab's Kubernetes API server on the wire, with kubectl (the one
//! setup installs) as the independent client: discovery, `version`,
//! client-side and server-side apply of the deploy manifests with strict
//! validation, merge patches, watches with their events, `410 Gone`,
//! RBAC's 403 and the 401 of an unknown token. The server runs as the lab
//! runs it, the `vpcnet-lab-kube` binary, listening at the lab's API
//! address inside a namespace this test makes (`vpcnet-kube-wire`).
//!
//! Root needed; one at a time (`serial()`); the namespace and the server
//! go with guards even when an assertion fails.

mod common;

use std::{
    io::BufReader,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::mpsc,
    time::Duration,
};

use common::lab_session;
use serde_json::{Value, json};
use vpcnet_lab::{
    ScratchDir,
    kube::{KubeApiOptions, KubeApiProcess},
    kube_tools::KUBECTL,
    netns,
};

const NS: &str = "vpcnet-kube-wire";
/// How long one kubectl command may take.
const KUBECTL_TIMEOUT: &str = "--request-timeout=20s";
/// How long a watch event may take to arrive.
const EVENT_TIMEOUT: Duration = Duration::from_secs(20);

/// The test's namespace, removed when dropped.
struct TestNs;

impl TestNs {
    fn new() -> Self {
        netns::create_namespaces(&[NS.to_owned()]).unwrap();
        Self
    }
}

impl Drop for TestNs {
    fn drop(&mut self) {
        if let Err(err) = netns::delete_namespaces(&[NS.to_owned()]) {
            eprintln!("removing {NS}: {err}");
        }
    }
}

/// kubectl as one user, inside the test's namespace, with its own
/// discovery cache.
struct Kubectl {
    kubeconfig: PathBuf,
    cache: PathBuf,
}

impl Kubectl {
    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new("nsenter");
        command
            .arg(format!("--net={}", netns::netns_path(NS).display()))
            .arg(KUBECTL)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(&self.cache)
            .arg(KUBECTL_TIMEOUT)
            .args(args);
        command
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("running kubectl")
    }

    /// Runs and expects success: standard output.
    fn ok(&self, args: &[&str]) -> String {
        let output = self.run(args);
        assert!(
            output.status.success(),
            "kubectl {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).unwrap()
    }

    /// Runs and expects failure: standard error.
    fn fails(&self, args: &[&str]) -> String {
        let output = self.run(args);
        assert!(
            !output.status.success(),
            "kubectl {} succeeded: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stdout)
        );
        String::from_utf8(output.stderr).unwrap()
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut args = args.to_vec();
        args.extend(["-o", "json"]);
        serde_json::from_str(&self.ok(&args)).unwrap()
    }
}

/// A kubectl that keeps running (a watch); killed when dropped. Its
/// output's JSON documents arrive on `events`.
struct Watching {
    child: Child,
    events: mpsc::Receiver<Value>,
}

impl Watching {
    fn start(mut command: Command) -> Self {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting kubectl");
        let stdout = child.stdout.take().unwrap();
        let (tx, events) = mpsc::channel();
        std::thread::spawn(move || {
            for document in
                serde_json::Deserializer::from_reader(BufReader::new(stdout)).into_iter::<Value>()
            {
                let Ok(document) = document else { return };
                if tx.send(document).is_err() {
                    return;
                }
            }
        });
        Self { child, events }
    }

    fn next(&self) -> Value {
        self.events
            .recv_timeout(EVENT_TIMEOUT)
            .expect("a watch event within the limit")
    }
}

impl Drop for Watching {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Cluster {
    // Field order is drop order: the server goes before its namespace.
    server: KubeApiProcess,
    admin: Kubectl,
    agent: Kubectl,
    scratch: ScratchDir,
    _ns: TestNs,
}

fn cluster(history: usize) -> Cluster {
    let ns = TestNs::new();
    let scratch = ScratchDir::new("vpcnet-kube-wire").unwrap();
    let server = KubeApiProcess::start(&KubeApiOptions {
        work_dir: scratch.path().join("cluster"),
        netns: NS.to_owned(),
        history,
        bookmark_interval: Duration::from_millis(500),
        ..KubeApiOptions::default()
    })
    .unwrap();
    let kubectl = |kubeconfig: PathBuf, cache: &str| Kubectl {
        kubeconfig,
        cache: scratch.path().join(cache),
    };
    Cluster {
        admin: kubectl(server.files().admin_kubeconfig(), "admin-cache"),
        agent: kubectl(server.files().agent_kubeconfig(), "agent-cache"),
        server,
        scratch,
        _ns: ns,
    }
}

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes")
}

#[test]
fn kubectl_discovers_and_applies_the_deploy_manifests() {
    let _lab = lab_session();
    let cluster = cluster(4096);
    let kubectl = &cluster.admin;

    let version = kubectl.ok(&["version"]);
    assert!(
        version.contains("Server Version: v1.33.0-vpcnet-lab"),
        "{version}"
    );
    let resources = kubectl.ok(&["api-resources"]);
    for line in ["cninodes", "eniconfigs", "servicecidrs", "daemonsets"] {
        assert!(
            resources.contains(line),
            "{line} missing from:\n{resources}"
        );
    }

    // Client-side apply with strict validation, as an operator runs it.
    let manifests = deploy_dir();
    let manifests = manifests.to_str().unwrap();
    let created = kubectl.ok(&["apply", "-k", manifests]);
    for object in [
        "serviceaccount/vpcnet created",
        "configmap/vpcnet-config created",
        "daemonset.apps/vpcnet created",
    ] {
        assert!(created.contains(object), "{object} in:\n{created}");
    }
    let again = kubectl.ok(&["apply", "-k", manifests]);
    assert!(again.contains("daemonset.apps/vpcnet unchanged"), "{again}");
    let daemon_set = kubectl.json(&["get", "daemonset", "-n", "kube-system", "vpcnet"]);
    assert_eq!(
        daemon_set["metadata"]["labels"]["app.kubernetes.io/name"],
        "vpcnet"
    );
    assert!(
        daemon_set["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"]
            .is_string()
    );

    // A change goes as kubectl's strategic merge patch: one container's
    // image changes, its env stays.
    let env_before = daemon_set["spec"]["template"]["spec"]["containers"][0]["env"].clone();
    // An overlay that sets another image, as the guide says to.
    let base = cluster.scratch.path().join("base");
    let edited = cluster.scratch.path().join("edited");
    std::fs::create_dir_all(&base).unwrap();
    std::fs::create_dir_all(&edited).unwrap();
    for entry in std::fs::read_dir(deploy_dir()).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), base.join(entry.file_name())).unwrap();
        }
    }
    std::fs::write(
        edited.join("kustomization.yaml"),
        "resources:\n  - ../base\nimages:\n  - name: vpcnet\n    newName: vpcnet\n    newTag: v2\n",
    )
    .unwrap();
    let configured = kubectl.ok(&["apply", "-k", edited.to_str().unwrap()]);
    assert!(
        configured.contains("daemonset.apps/vpcnet configured"),
        "{configured}"
    );
    let daemon_set = kubectl.json(&["get", "daemonset", "-n", "kube-system", "vpcnet"]);
    let container = &daemon_set["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["image"], "vpcnet:v2");
    assert_eq!(container["env"], env_before);

    // Server-side apply of the custom kinds, and kubectl's merge patch.
    let eni_config = cluster.scratch.path().join("eniconfig.json");
    std::fs::write(
        &eni_config,
        json!({"apiVersion": "crd.k8s.amazonaws.com/v1alpha1", "kind": "ENIConfig",
            "metadata": {"name": "us-west-2a"},
            "spec": {"subnet": "subnet-0123", "securityGroups": ["sg-1"]}})
        .to_string(),
    )
    .unwrap();
    let applied = kubectl.ok(&["apply", "--server-side", "-f", eni_config.to_str().unwrap()]);
    assert!(
        applied.contains("eniconfig.crd.k8s.amazonaws.com/us-west-2a serverside-applied"),
        "{applied}"
    );
    kubectl.ok(&[
        "patch",
        "eniconfig",
        "us-west-2a",
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"securityGroups":["sg-2"]}}"#,
    ]);
    let eni_config = kubectl.json(&["get", "eniconfig", "us-west-2a"]);
    assert_eq!(
        eni_config["spec"],
        json!({"subnet": "subnet-0123", "securityGroups": ["sg-2"]})
    );

    // What every cluster has.
    let service = kubectl.json(&["get", "service", "kubernetes"]);
    assert_eq!(service["spec"]["clusterIP"], "10.100.0.1");
    let cidrs = kubectl.json(&["get", "servicecidrs", "kubernetes"]);
    assert_eq!(cidrs["spec"]["cidrs"], json!(["10.100.0.0/16"]));
    let missing = kubectl.fails(&["get", "node", "nowhere"]);
    assert!(
        missing.contains(r#"Error from server (NotFound): nodes "nowhere" not found"#),
        "{missing}"
    );
}

#[test]
fn kubectl_watches_see_every_change() {
    let _lab = lab_session();
    let cluster = cluster(8);
    let kubectl = &cluster.admin;
    let admin = cluster.server.admin();
    admin
        .create("/api/v1/nodes", &json!({"metadata": {"name": "node-a"}}))
        .unwrap();

    let watch = Watching::start(kubectl.command(&[
        "get",
        "nodes",
        "--watch",
        "--output-watch-events",
        "-o",
        "json",
    ]));
    let first = watch.next();
    assert_eq!(
        (
            first["type"].as_str(),
            first["object"]["metadata"]["name"].as_str()
        ),
        (Some("ADDED"), Some("node-a"))
    );
    admin
        .merge_patch(
            "/api/v1/nodes/node-a",
            &json!({"metadata": {"labels": {"k8s.amazonaws.com/eniConfig": "us-west-2a"}}}),
        )
        .unwrap();
    let modified = watch.next();
    assert_eq!(modified["type"], "MODIFIED");
    assert_eq!(
        modified["object"]["metadata"]["labels"]["k8s.amazonaws.com/eniConfig"],
        "us-west-2a"
    );
    admin
        .create("/api/v1/nodes", &json!({"metadata": {"name": "node-b"}}))
        .unwrap();
    admin.delete("/api/v1/nodes/node-a").unwrap();
    let added = watch.next();
    let deleted = watch.next();
    assert_eq!(
        (
            added["type"].as_str(),
            added["object"]["metadata"]["name"].as_str()
        ),
        (Some("ADDED"), Some("node-b"))
    );
    assert_eq!(
        (
            deleted["type"].as_str(),
            deleted["object"]["metadata"]["name"].as_str()
        ),
        (Some("DELETED"), Some("node-a"))
    );
    drop(watch);

    // A field selector (what the agent uses for its own node and pods).
    let selected = Watching::start(kubectl.command(&[
        "get",
        "pods",
        "-A",
        "--watch",
        "--output-watch-events",
        "-o",
        "json",
        "--field-selector",
        "spec.nodeName=node-b",
    ]));
    admin
        .create(
            "/api/v1/namespaces/default/pods",
            &json!({"metadata": {"name": "elsewhere"}, "spec": {"nodeName": "node-c"}}),
        )
        .unwrap();
    admin
        .create(
            "/api/v1/namespaces/default/pods",
            &json!({"metadata": {"name": "here"}, "spec": {"nodeName": "node-b"}}),
        )
        .unwrap();
    let event = selected.next();
    assert_eq!(
        (
            event["type"].as_str(),
            event["object"]["metadata"]["name"].as_str()
        ),
        (Some("ADDED"), Some("here"))
    );
}

#[test]
fn watches_get_bookmarks_and_a_too_old_version_is_gone() {
    let _lab = lab_session();
    let cluster = cluster(8);
    let kubectl = &cluster.admin;
    let admin = cluster.server.admin();
    // Bookmarks when asked, and 410 inside the stream for a version the
    // history (8 changes here) no longer holds, as kube-rs expects it.
    for i in 0..10 {
        admin
            .create(
                "/api/v1/nodes",
                &json!({"metadata": {"name": format!("filler-{i}")}}),
            )
            .unwrap();
    }
    // kubectl prints lists it builds itself (no resourceVersion): ask the
    // server.
    let list = admin.get("/api/v1/nodes").unwrap();
    let now: u64 = list["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let raw = Watching::start(kubectl.command(&[
        "get",
        "--raw",
        &format!("/api/v1/nodes?watch=true&allowWatchBookmarks=true&resourceVersion={now}"),
    ]));
    let bookmark = raw.next();
    assert_eq!(bookmark["type"], "BOOKMARK");
    assert_eq!(bookmark["object"]["kind"], "Node");
    assert_eq!(
        bookmark["object"]["metadata"]["resourceVersion"],
        now.to_string()
    );
    drop(raw);
    let gone = Watching::start(kubectl.command(&[
        "get",
        "--raw",
        "/api/v1/nodes?watch=true&resourceVersion=2",
    ]));
    let error = gone.next();
    assert_eq!(error["type"], "ERROR");
    assert_eq!(
        (
            error["object"]["code"].as_u64(),
            error["object"]["reason"].as_str()
        ),
        (Some(410), Some("Expired"))
    );
}

#[test]
fn requests_are_authenticated_and_authorised_by_rbac() {
    let _lab = lab_session();
    let cluster = cluster(4096);

    let denied = cluster.agent.fails(&["get", "nodes"]);
    assert!(
        denied.contains(r#"nodes is forbidden: User "system:serviceaccount:kube-system:vpcnet" cannot list resource "nodes" in API group "" at the cluster scope"#),
        "{denied}"
    );
    // One file per object (a `kind: List` would make kubectl validate with
    // OpenAPI v2, which the lab does not serve).
    let role = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": "node-reader"},
        "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "get"]}]});
    let binding = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "node-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "node-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "vpcnet", "namespace": "kube-system"}]});
    let role_file = cluster.scratch.path().join("role.json");
    let binding_file = cluster.scratch.path().join("binding.json");
    std::fs::write(&role_file, role.to_string()).unwrap();
    std::fs::write(&binding_file, binding.to_string()).unwrap();
    cluster.admin.ok(&[
        "apply",
        "-f",
        role_file.to_str().unwrap(),
        "-f",
        binding_file.to_str().unwrap(),
    ]);
    cluster.agent.ok(&["get", "nodes"]);
    let still_denied = cluster.agent.fails(&["get", "pods", "-n", "kube-system"]);
    assert!(still_denied.contains("Forbidden"), "{still_denied}");

    let stranger = Kubectl {
        kubeconfig: cluster.scratch.path().join("stranger.kubeconfig"),
        cache: cluster.scratch.path().join("stranger-cache"),
    };
    let config = std::fs::read_to_string(cluster.server.files().agent_kubeconfig()).unwrap();
    let mut config: Value = serde_json::from_str(&config).unwrap();
    config["users"][0]["user"]["token"] = json!("not-a-token");
    std::fs::write(&stranger.kubeconfig, config.to_string()).unwrap();
    let unauthorized = stranger.fails(&["get", "nodes"]);
    assert!(
        unauthorized.contains("error: You must be logged in to the server"),
        "{unauthorized}"
    );

    let calls = cluster.server.admin().calls().unwrap();
    let agent = "system:serviceaccount:kube-system:vpcnet";
    assert_eq!(
        calls.answers(agent, "list", "nodes").get(&403),
        Some(&1),
        "{calls:?}"
    );
    assert!(
        calls.answers(agent, "list", "nodes").contains_key(&200),
        "{calls:?}"
    );
}
