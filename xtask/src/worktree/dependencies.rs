//! Another commit's build asking of every dependency what this
//! checkout's build asks. Cargo compiles a dependency once per version
//! and set of features a build wants of it; another commit's `--bins`
//! build wants fewer (no dev-dependencies, none of the features added
//! since), so even in a shared build directory it compiled a variant of
//! its own of most dependencies and of all above them (the EC2 SDK,
//! kube: about 12 minutes of a cold CI run). A member added to the
//! worktree that depends on every registry crate this checkout's members
//! depend on, the way they do, and this checkout's lockfile make each
//! compiled dependency this checkout's. That holds while the commit's
//! lockfile pins no registry crate this checkout's does not; otherwise
//! the commit builds as it is, with its own lockfile.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fs,
    path::Path,
};

use anyhow::{Context, Result};
use serde::Deserialize;

use crate::{build::workspace_root, setup::stdout_of};

/// The member added to the worktree.
const MEMBER: &str = "vpcnet-tree-dependencies";

/// The registry every dependency of the workspace comes from.
const CRATES_IO: &str = "registry+https://github.com/rust-lang/crates.io-index";

/// How a worktree's build gets its dependencies.
#[derive(Debug, PartialEq, Eq)]
pub enum Dependencies {
    /// As this checkout's: the worktree has the added member and this
    /// checkout's lockfile (which cargo then completes with the commit's
    /// own crates, so the build is not `--locked`).
    Shared,
    /// Its own, from its lockfile (`--locked`), for the reason given.
    Own(String),
}

impl std::fmt::Display for Dependencies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Shared => f.write_str("its dependencies compiled as this checkout's"),
            Self::Own(why) => write!(f, "its own dependencies, as {why}"),
        }
    }
}

/// Sets up `source`, a worktree of another commit, to build with this
/// checkout's dependencies where its lockfile allows.
pub fn share_with(source: &Path) -> Result<Dependencies> {
    let tree_lock = read(&workspace_root().join("Cargo.lock"))?;
    let commit_lock = read(&source.join("Cargo.lock"))?;
    let missing = pinned_elsewhere(&commit_lock, &tree_lock)?;
    if !missing.is_empty() {
        return Ok(Dependencies::Own(format!(
            "its lockfile pins crates this checkout's does not: {}",
            missing.join(", ")
        )));
    }
    let metadata = stdout_of(
        vpcnet_lab::cargo_env::cargo()
            .args(["metadata", "--format-version", "1"])
            .current_dir(workspace_root()),
    )?;
    let metadata: Metadata =
        serde_json::from_str(&metadata).context("parsing `cargo metadata`'s output")?;
    let manifest = match member_manifest(&metadata) {
        Ok(manifest) => manifest,
        Err(Unshareable(why)) => return Ok(Dependencies::Own(why)),
    };
    let member = source.join(MEMBER);
    fs::create_dir_all(member.join("src"))
        .with_context(|| format!("creating {}", member.display()))?;
    write(&member.join("Cargo.toml"), &manifest)?;
    write(&member.join("src/main.rs"), "fn main() {}\n")?;
    // A build script, so that the build-dependencies compile too.
    write(&member.join("build.rs"), "fn main() {}\n")?;
    let root = source.join("Cargo.toml");
    write(&root, &with_member(&read(&root)?, MEMBER)?)?;
    write(&source.join("Cargo.lock"), &tree_lock)?;
    Ok(Dependencies::Shared)
}

fn read(path: &Path) -> Result<String> {
    fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

fn write(path: &Path, contents: &str) -> Result<()> {
    fs::write(path, contents).with_context(|| format!("writing {}", path.display()))
}

/// The registry crates (`name version`) `lock` pins and `other` does not.
fn pinned_elsewhere(lock: &str, other: &str) -> Result<Vec<String>> {
    let other = registry_pins(other)?;
    Ok(registry_pins(lock)?
        .difference(&other)
        .map(|(name, version)| format!("{name} {version}"))
        .collect())
}

#[derive(Deserialize)]
struct Lockfile {
    #[serde(default)]
    package: Vec<LockedPackage>,
}

#[derive(Deserialize)]
struct LockedPackage {
    name: String,
    version: String,
    source: Option<String>,
}

fn registry_pins(lock: &str) -> Result<BTreeSet<(String, String)>> {
    let lock: Lockfile = toml::from_str(lock).context("parsing a Cargo.lock")?;
    Ok(lock
        .package
        .into_iter()
        .filter(|package| package.source.is_some())
        .map(|package| (package.name, package.version))
        .collect())
}

/// `cargo metadata`, as far as it is read here.
#[derive(Deserialize)]
struct Metadata {
    packages: Vec<Package>,
    workspace_members: Vec<String>,
    resolve: Resolve,
}

#[derive(Deserialize)]
struct Package {
    id: String,
    name: String,
    dependencies: Vec<Dependency>,
}

#[derive(Deserialize)]
struct Dependency {
    name: String,
    source: Option<String>,
    req: String,
    kind: Option<String>,
    optional: bool,
    uses_default_features: bool,
    features: Vec<String>,
    target: Option<String>,
}

#[derive(Deserialize)]
struct Resolve {
    nodes: Vec<Node>,
}

#[derive(Deserialize)]
struct Node {
    id: String,
    deps: Vec<NodeDependency>,
}

#[derive(Deserialize)]
struct NodeDependency {
    pkg: String,
}

/// Why the commit's build cannot have this checkout's dependencies.
struct Unshareable(String);

/// One dependency as the added member asks for it: where it is declared
/// (the section, the target's `cfg`), the crate and its semver-compatible
/// range.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Slot {
    section: &'static str,
    target: Option<String>,
    name: String,
    compatible: String,
}

/// What the members ask of it, together.
struct Wanted {
    req: String,
    default_features: bool,
    features: BTreeSet<String>,
}

/// The added member's manifest: every registry dependency of every
/// member, normal and dev-dependencies as normal ones (a tree's build
/// builds its tests), build-dependencies as such, each under its target;
/// optional ones where the members' features turn them on. Members asking
/// for the same crate ask once, with the union of their features.
fn member_manifest(metadata: &Metadata) -> Result<String, Unshareable> {
    let names: HashMap<&str, &str> = metadata
        .packages
        .iter()
        .map(|package| (package.id.as_str(), package.name.as_str()))
        .collect();
    let mut slots: BTreeMap<Slot, Wanted> = BTreeMap::new();
    for id in &metadata.workspace_members {
        let Some(member) = metadata.packages.iter().find(|package| &package.id == id) else {
            continue;
        };
        let resolved: BTreeSet<&str> = metadata
            .resolve
            .nodes
            .iter()
            .filter(|node| &node.id == id)
            .flat_map(|node| &node.deps)
            .filter_map(|dependency| names.get(dependency.pkg.as_str()).copied())
            .collect();
        for dependency in &member.dependencies {
            match dependency.source.as_deref() {
                None => continue,
                Some(CRATES_IO) => {}
                Some(other) => {
                    return Err(Unshareable(format!(
                        "{} depends on {} from {other}",
                        member.name, dependency.name
                    )));
                }
            }
            if dependency.optional && !resolved.contains(dependency.name.as_str()) {
                continue;
            }
            let slot = Slot {
                section: if dependency.kind.as_deref() == Some("build") {
                    "build-dependencies"
                } else {
                    "dependencies"
                },
                target: dependency.target.clone(),
                name: dependency.name.clone(),
                compatible: compatible_range(&dependency.req),
            };
            let wanted = slots.entry(slot).or_insert_with(|| Wanted {
                req: dependency.req.clone(),
                default_features: false,
                features: BTreeSet::new(),
            });
            wanted.default_features |= dependency.uses_default_features;
            wanted.features.extend(dependency.features.iter().cloned());
        }
    }
    Ok(manifest_of(&slots))
}

fn manifest_of(slots: &BTreeMap<Slot, Wanted>) -> String {
    let mut ranges: HashMap<(&str, Option<&str>, &str), usize> = HashMap::new();
    for slot in slots.keys() {
        *ranges
            .entry((slot.section, slot.target.as_deref(), slot.name.as_str()))
            .or_default() += 1;
    }
    let mut manifest = toml::Table::new();
    let package = table_in(&mut manifest, "package");
    package.insert("name".into(), MEMBER.into());
    package.insert("version".into(), "0.0.0".into());
    package.insert("edition".into(), "2024".into());
    package.insert("publish".into(), false.into());
    for (slot, wanted) in slots {
        let mut entry = toml::Table::new();
        entry.insert("version".into(), wanted.req.clone().into());
        entry.insert("default-features".into(), wanted.default_features.into());
        entry.insert(
            "features".into(),
            toml::Value::Array(wanted.features.iter().cloned().map(Into::into).collect()),
        );
        // Two ranges of one crate (two majors) need two names.
        let key = if ranges[&(slot.section, slot.target.as_deref(), slot.name.as_str())] > 1 {
            entry.insert("package".into(), slot.name.clone().into());
            format!("{}-{}", slot.name, slot.compatible.replace('.', "-"))
        } else {
            slot.name.clone()
        };
        let mut table = &mut manifest;
        if let Some(target) = &slot.target {
            table = table_in(table_in(table, "target"), target);
        }
        table_in(table, slot.section).insert(key, toml::Value::Table(entry));
    }
    toml::to_string(&manifest).expect("a table of strings, booleans and arrays serialises")
}

fn table_in<'a>(table: &'a mut toml::Table, key: &str) -> &'a mut toml::Table {
    match table
        .entry(key)
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
    {
        toml::Value::Table(inner) => inner,
        _ => unreachable!("only tables are inserted under {key}"),
    }
}

/// The semver-compatible range a requirement's first comparator falls in:
/// `1` for `^1.2`, `0.14` for `=0.14.0`, `0.0.3` for `0.0.3`.
fn compatible_range(req: &str) -> String {
    let first = req.split(',').next().unwrap_or(req);
    let version = first.trim_start_matches(|c: char| "^~=<> ".contains(c));
    let parts: Vec<&str> = version.trim().split('.').collect();
    match parts.as_slice() {
        ["0", "0", patch, ..] => format!("0.0.{patch}"),
        ["0", minor, ..] => format!("0.{minor}"),
        [major, ..] => (*major).to_owned(),
        [] => String::new(),
    }
}

/// `manifest` (a workspace's root) with `member` added to its members.
fn with_member(manifest: &str, member: &str) -> Result<String> {
    let mut manifest: toml::Table = toml::from_str(manifest).context("parsing Cargo.toml")?;
    let members = manifest
        .get_mut("workspace")
        .and_then(|workspace| workspace.get_mut("members"))
        .and_then(toml::Value::as_array_mut)
        .context("Cargo.toml has no [workspace] members")?;
    members.push(member.into());
    toml::to_string(&manifest).context("writing Cargo.toml")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_requirement_falls_in_the_range_semver_calls_compatible() {
        assert_eq!(compatible_range("^1.2.3"), "1");
        assert_eq!(compatible_range("=0.14.0"), "0.14");
        assert_eq!(compatible_range("^0.0.3"), "0.0.3");
        assert_eq!(compatible_range(">=1.2, <2"), "1");
        assert_eq!(compatible_range("~0.9"), "0.9");
    }

    #[test]
    fn crates_one_lockfile_pins_and_the_other_does_not_are_named() {
        let lock = |packages: &str| format!("version = 4\n{packages}");
        let tree = lock(
            "[[package]]\nname = \"tokio\"\nversion = \"1.40.0\"\nsource = \"registry+x\"\n\
             [[package]]\nname = \"vpcnet-agent\"\nversion = \"0.1.0\"\n",
        );
        let commit = lock(
            "[[package]]\nname = \"tokio\"\nversion = \"1.39.0\"\nsource = \"registry+x\"\n\
             [[package]]\nname = \"vpcnet-old\"\nversion = \"0.1.0\"\n",
        );
        assert_eq!(pinned_elsewhere(&commit, &tree).unwrap(), ["tokio 1.39.0"]);
        assert!(pinned_elsewhere(&tree, &tree).unwrap().is_empty());
    }

    #[test]
    fn the_member_joins_the_workspace_and_keeps_its_settings() {
        let root = "[workspace]\nresolver = \"3\"\nmembers = [\"agent\"]\n\n\
                    [profile.dev.package.\"*\"]\nopt-level = 1\n";
        let joined: toml::Table = toml::from_str(&with_member(root, MEMBER).unwrap()).unwrap();
        assert_eq!(
            joined["workspace"]["members"].as_array().unwrap(),
            &vec![toml::Value::from("agent"), MEMBER.into()]
        );
        assert_eq!(
            joined["profile"]["dev"]["package"]["*"]["opt-level"],
            1.into()
        );
    }

    fn dependency(
        name: &str,
        req: &str,
        kind: Option<&str>,
        features: &[&str],
    ) -> serde_json::Value {
        serde_json::json!({
            "name": name, "source": CRATES_IO, "req": req, "kind": kind,
            "optional": false, "uses_default_features": true,
            "features": features, "target": null,
        })
    }

    fn metadata(members: &serde_json::Value, resolve: &serde_json::Value) -> Metadata {
        serde_json::from_value(serde_json::json!({
            "packages": members,
            "workspace_members": ["a", "b"],
            "resolve": { "nodes": resolve },
        }))
        .unwrap()
    }

    #[test]
    fn the_member_asks_of_each_crate_what_the_members_ask_together() {
        let mut optional = dependency("aya", "=0.14.0", None, &[]);
        optional["optional"] = true.into();
        let mut unused = dependency("never", "1", None, &[]);
        unused["optional"] = true.into();
        let mut untargeted = dependency("libc", "0.2", None, &[]);
        untargeted["target"] = "cfg(unix)".into();
        untargeted["uses_default_features"] = false.into();
        let metadata = metadata(
            &serde_json::json!([
                { "id": "a", "name": "a", "dependencies": [
                    dependency("tokio", "^1.0", None, &["net"]),
                    dependency("toml", "0.8", Some("dev"), &[]),
                    dependency("cc", "1", Some("build"), &[]),
                    optional, unused, untargeted,
                    { "name": "b", "source": null, "req": "*", "kind": null, "optional": false,
                      "uses_default_features": true, "features": [], "target": null },
                ]},
                { "id": "b", "name": "b", "dependencies": [
                    dependency("tokio", "^1.2", Some("dev"), &["time"]),
                    dependency("toml", "0.9", None, &[]),
                ]},
                { "id": "aya-id", "name": "aya", "dependencies": [] },
            ]),
            &serde_json::json!([
                { "id": "a", "deps": [{ "pkg": "aya-id" }] },
                { "id": "b", "deps": [] },
            ]),
        );
        let Ok(manifest) = member_manifest(&metadata) else {
            panic!("registry crates only");
        };
        let manifest: toml::Table = toml::from_str(&manifest).unwrap();
        assert_eq!(manifest["package"]["name"], MEMBER.into());
        let dependencies = manifest["dependencies"].as_table().unwrap();
        let keys: Vec<&String> = dependencies.keys().collect();
        assert_eq!(keys, ["aya", "tokio", "toml-0-8", "toml-0-9"]);
        assert_eq!(
            dependencies["tokio"]["features"],
            toml::Value::Array(vec!["net".into(), "time".into()])
        );
        assert_eq!(dependencies["toml-0-9"]["package"], "toml".into());
        assert_eq!(manifest["build-dependencies"]["cc"]["version"], "1".into());
        let libc = &manifest["target"]["cfg(unix)"]["dependencies"]["libc"];
        assert_eq!(libc["default-features"], false.into());
    }

    #[test]
    fn a_crate_from_elsewhere_than_the_registry_is_not_shared() {
        let mut git = dependency("aya", "0.14", None, &[]);
        git["source"] = "git+https://example.org/aya".into();
        let metadata = metadata(
            &serde_json::json!([{ "id": "a", "name": "a", "dependencies": [git] }]),
            &serde_json::json!([{ "id": "a", "deps": [] }]),
        );
        let Err(Unshareable(why)) = member_manifest(&metadata) else {
            panic!("a git dependency was shared");
        };
        assert!(why.contains("git+https://example.org/aya"), "{why}");
    }
}
