//! What sits on the tc hooks of a namespace's interfaces, as the kernel
//! lists it: TCX programs (`BPF_PROG_QUERY`) and clsact filters (`bpftool
//! net`, which reads the filters over netlink).

use std::{collections::BTreeMap, process::Command};

use aya::programs::{SchedClassifier, TcAttachType};
use vpcnet_lab::{netns::netns_path, run_in};

/// A program on a hook: how it is attached (`tcx` or `clsact`), its name
/// and its kernel id.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct HookProgram {
    pub attach: String,
    pub name: String,
    pub id: u32,
}

/// `(interface, "ingress" | "egress")` to the programs on that hook, in
/// namespace `ns`.
pub fn hook_programs(ns: &str) -> BTreeMap<(String, String), Vec<HookProgram>> {
    let mut hooks: BTreeMap<(String, String), Vec<HookProgram>> = BTreeMap::new();
    let tcx = run_in(ns, || {
        let mut found = Vec::new();
        let interfaces = nix::net::if_::if_nameindex().expect("listing interfaces");
        for iface in &interfaces {
            let name = iface.name().to_string_lossy().into_owned();
            for (hook, direction) in [
                ("ingress", TcAttachType::Ingress),
                ("egress", TcAttachType::Egress),
            ] {
                let Ok((_, programs)) = SchedClassifier::query_tcx(&name, direction) else {
                    continue;
                };
                for program in programs {
                    found.push((
                        (name.clone(), hook.to_owned()),
                        HookProgram {
                            attach: "tcx".to_owned(),
                            name: program.name_as_str().unwrap_or_default().to_owned(),
                            id: program.id(),
                        },
                    ));
                }
            }
        }
        found
    })
    .expect("entering the namespace");
    for (hook, program) in tcx {
        hooks.entry(hook).or_default().push(program);
    }
    let output = Command::new("nsenter")
        .arg(format!("--net={}", netns_path(ns).display()))
        .args(["--", "bpftool", "-j", "net", "show"])
        .output()
        .expect("running bpftool net show");
    assert!(output.status.success(), "bpftool net show failed");
    let listing: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("bpftool's JSON");
    for entry in listing[0]["tc"].as_array().into_iter().flatten() {
        let kind = entry["kind"].as_str().unwrap_or_default();
        let Some(hook) = kind.strip_prefix("clsact/") else {
            continue;
        };
        hooks
            .entry((
                entry["devname"].as_str().unwrap_or_default().to_owned(),
                hook.to_owned(),
            ))
            .or_default()
            .push(HookProgram {
                attach: "clsact".to_owned(),
                name: entry["name"].as_str().unwrap_or_default().to_owned(),
                id: entry["id"]
                    .as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .unwrap_or_default(),
            });
    }
    hooks
}
