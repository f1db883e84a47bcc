//! The image recipe, without a container engine: its build steps
//! (`deploy/image/build.sh`, which the Containerfile's build stage runs) run
//! here as a script, and what they stage is what a node runs. The staged
//! agent installs the staged plugins as the init container does, then runs
//! a node of the lab whose pods containerd's CRI wires with the staged
//! plugin; the pods reach the internet through the datapath, the agent
//! writes its conflist once it serves, and the probes answer.
//!
//! The script builds the dev profile of the whole workspace here (what the
//! suite built already); the image builds release of the agent and the
//! plugin, with the same steps.

use std::{
    net::SocketAddrV4,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use serde_json::Value;
use vpcnet_bpf_tests::cri::{self, CriNode};
use vpcnet_deploy::{DEPLOY_DIR, output_of};
use vpcnet_lab::{ScratchDir, WhoamiServer, addrs, cni_socket_file, serial, tcp_whoami};

const PORT: u16 = 8080;
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);

/// The `COPY --from=build <src> <dst>` lines of the Containerfile, and
/// whether its build stage runs build.sh into the directory they copy from.
fn copies_from_build_stage(containerfile: &str) -> Vec<(String, String)> {
    containerfile
        .lines()
        .filter_map(|line| line.strip_prefix("COPY --from=build "))
        .map(|rest| {
            let words: Vec<&str> = rest.split_whitespace().collect();
            assert_eq!(words.len(), 2, "COPY --from=build {rest}");
            (words[0].to_owned(), words[1].to_owned())
        })
        .collect()
}

fn staged(out: &Path, path: &str) -> PathBuf {
    out.join(path.trim_start_matches('/'))
}

/// Runs the recipe's build steps into `root`, as the image's build stage
/// does, then adds what its final stage adds; returns the agent and the
/// plugins' directory.
fn build_image_files(root: &Path) -> (PathBuf, PathBuf) {
    let image_dir = Path::new(DEPLOY_DIR).join("image");
    let containerfile = std::fs::read_to_string(image_dir.join("Containerfile")).unwrap();
    assert!(
        containerfile.contains("RUN deploy/image/build.sh --install-toolchain /out"),
        "the build stage runs build.sh into /out"
    );

    // As a shell runs it: cargo's variables for this test would make the
    // build's cargo rebuild what the suite built (see cargo_env).
    let printed = output_of(
        vpcnet_lab::cargo_env::without_crate_vars(&mut Command::new(image_dir.join("build.sh")))
            .arg(root)
            .env("VPCNET_BUILD_PROFILE", "dev")
            .env("VPCNET_BUILD_PACKAGES", "--workspace"),
    )
    .unwrap_or_else(|e| panic!("build.sh: {e}"));
    println!("{}", printed.trim());
    // Every COPY of the final stage finds what the script staged.
    let out = root;
    for (source, _) in copies_from_build_stage(&containerfile) {
        let relative = source.strip_prefix("/out").expect("copied from /out");
        assert!(
            staged(out, relative).exists(),
            "the Containerfile copies {source}, which build.sh did not stage"
        );
    }
    let agent = staged(out, "/usr/local/bin/vpcnet-agent");
    let plugins = staged(out, "/opt/vpcnet/cni");
    // The final stage adds Debian's portmap and loopback to the plugins,
    // from the same package as this machine's.
    for name in ["portmap", "loopback"] {
        let debian = Path::new("/usr/lib/cni").join(name);
        assert!(
            debian.is_file(),
            "{} (containernetworking-plugins)",
            debian.display()
        );
        std::fs::copy(&debian, plugins.join(name)).unwrap();
    }
    (agent, plugins)
}

#[test]
fn the_image_recipe_builds_binaries_that_run_a_node() {
    let _lock = serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let scratch = ScratchDir::new("vpcnet-image").unwrap();
    let (agent, plugins) = build_image_files(&scratch.path().join("out"));

    // The init container's job.
    let cni_bin = scratch.path().join("opt-cni-bin");
    let installed = output_of(
        Command::new(&agent)
            .arg("install-plugins")
            .arg("--from")
            .arg(&plugins)
            .arg("--to")
            .arg(&cni_bin),
    )
    .unwrap();
    for name in ["vpcnet-cni", "portmap", "loopback"] {
        assert!(
            installed.contains(&cni_bin.join(name).display().to_string()),
            "{installed}"
        );
    }
    let version = output_of(
        Command::new(cni_bin.join("vpcnet-cni"))
            .env("CNI_COMMAND", "VERSION")
            .stdin(std::process::Stdio::null()),
    )
    .unwrap();
    let version: Value = serde_json::from_str(&version).unwrap();
    assert!(
        version["supportedVersions"]
            .as_array()
            .is_some_and(|v| v.iter().any(|v| v == "1.0.0")),
        "{version}"
    );

    // A node run by the staged binaries: the agent writes its conflist
    // once it serves, and pods wired by the staged plugin reach the
    // internet SNATed to the node's address.
    let conf_dir = scratch.path().join("etc-cni-net.d");
    let conf_arg = conf_dir.display().to_string();
    let lab = cri::up_with(&CriNode {
        agent: agent.clone(),
        cni_plugin: cni_bin.join("vpcnet-cni"),
        agent_args: &["--cni-conf-dir", &conf_arg],
        ..CriNode::new(2, "m5.large")
    });
    let conflist: Value = serde_json::from_slice(
        &std::fs::read(conf_dir.join("10-vpcnet.conflist")).expect("the agent's conflist"),
    )
    .unwrap();
    assert_eq!(conflist["plugins"][0]["type"], "vpcnet-cni");
    assert_eq!(
        conflist["plugins"][0]["agentSocket"],
        cni_socket_file().display().to_string()
    );
    let server = WhoamiServer::start(addrs::NS_INET, SocketAddrV4::new(addrs::INET_ADDR, PORT))
        .expect("whoami in inet");
    for pod in lab.pods() {
        let seen = tcp_whoami(&pod.netns, server.addr(), REPLY_TIMEOUT).expect("tcp probe");
        assert_eq!(
            seen.map(|s| *s.ip()),
            Some(addrs::NODE_PRIMARY_ADDR),
            "{} reached inet as",
            pod.k8s_name
        );
    }
    drop(server);

    // The DaemonSet's probes.
    for args in [&["probe"][..], &["probe", "--ready"]] {
        let answer = output_of(
            Command::new(&agent)
                .args(args)
                .arg("--cni-socket")
                .arg(cni_socket_file()),
        )
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
        assert!(answer.starts_with("ready"), "{args:?}: {answer}");
    }
    cri::remove_all_pods(&lab.cri().expect("a CRI client"));
    lab.down().expect("taking the lab down");
    let gone = output_of(
        Command::new(&agent)
            .args(["probe", "--timeout", "2", "--cni-socket"])
            .arg(cni_socket_file()),
    );
    assert!(gone.is_err(), "the probe fails with the agent gone");
}
