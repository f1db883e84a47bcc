//! What the guest reads through 9p shares of its own besides virtme-ng's
//! root share: the system's programs and libraries, and a snapshot of the
//! workspace's build output, both cached by the guest; and what of the
//! root share it must not see: the lab's state this machine's tests write
//! meanwhile.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use super::shell_word;
use crate::{build::workspace_root, setup::run_checked};

/// The build output the guests run, as it was when they booted: hard links
/// of `target/debug` (but for cargo's incremental caches and fingerprints)
/// and `target/image`, under `target/vm/tree`. This machine's tests run
/// beside the VMs, and the guests cache what they read: a build here
/// meanwhile (a test that runs cargo, a cargo that finds a source newer
/// than its output) must not change an executable under a running guest.
/// A rebuild writes new files, so the links keep the old ones. Removed when
/// dropped.
#[derive(Debug)]
pub struct BuildSnapshot {
    dir: PathBuf,
}

/// Entries of `target/debug` no test reads: cargo's own bookkeeping, and
/// most of the build directory's files.
const NOT_SNAPSHOT: [&str; 3] = ["incremental", ".fingerprint", ".cargo-lock"];

impl BuildSnapshot {
    /// Takes the snapshot, replacing one an earlier run left.
    pub fn take() -> Result<Self> {
        let target = workspace_root().join("target");
        let dir = target.join("vm").join("tree");
        remove_tree(&dir)?;
        let debug = dir.join("debug");
        std::fs::create_dir_all(&debug).with_context(|| format!("create {}", debug.display()))?;
        let snapshot = Self { dir };
        let mut sources: Vec<PathBuf> = Vec::new();
        let built = target.join("debug");
        for entry in
            std::fs::read_dir(&built).with_context(|| format!("read {}", built.display()))?
        {
            let entry = entry.with_context(|| format!("read {}", built.display()))?;
            if !NOT_SNAPSHOT.iter().any(|name| entry.file_name() == *name) {
                sources.push(entry.path());
            }
        }
        if !sources.is_empty() {
            run_checked(Command::new("cp").arg("-al").args(&sources).arg(&debug))
                .context("link the build output into the guests' snapshot")?;
        }
        let images = target.join("image");
        if images.is_dir() {
            run_checked(
                Command::new("cp")
                    .arg("-al")
                    .arg(&images)
                    .arg(&snapshot.dir),
            )
            .context("link the images into the guests' snapshot")?;
        }
        Ok(snapshot)
    }
}

#[cfg(test)]
impl BuildSnapshot {
    /// A snapshot said to be at `dir`, for the guest script's tests.
    pub(super) fn at(dir: PathBuf) -> Self {
        Self { dir }
    }
}

impl Drop for BuildSnapshot {
    fn drop(&mut self) {
        if let Err(error) = remove_tree(&self.dir) {
            eprintln!("vm: {error:#}");
        }
    }
}

fn remove_tree(dir: &Path) -> Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
            Err(error).with_context(|| format!("remove {}", dir.display()))
        }
        _ => Ok(()),
    }
}

/// Trees the guest reads through 9p shares of their own with the guest's
/// page cache on (`cache=loose`). virtme-ng's root share caches nothing, so
/// every exec read its whole file from the host again: the 100 MB debug
/// agent took 1.5-2 s to start under TCG, 0.4 s cached, and a lab execs the
/// agent, `ip`, `nft`, `iptables` and `nsenter` dozens of times. Nothing on
/// the host changes either tree while a guest runs: setup is done, and the
/// build output is a snapshot.
#[derive(Debug)]
pub(super) struct CachedTree {
    /// The 9p share's tag.
    tag: &'static str,
    /// What the host shares.
    host: PathBuf,
    /// Where the guest mounts it.
    guest: PathBuf,
    /// Writable in the guest, as virtme-ng's own view of it is: a tmpfs
    /// overlay over the cached share; otherwise read-only.
    overlay: bool,
}

/// The system's programs and libraries, and the workspace's build output
/// (the test executables and the binaries they start) where it was built.
pub(super) fn cached_trees(build: &BuildSnapshot) -> [CachedTree; 2] {
    [
        CachedTree {
            tag: "vpcnet_usr",
            host: PathBuf::from("/usr"),
            guest: PathBuf::from("/usr"),
            overlay: true,
        },
        CachedTree {
            tag: "vpcnet_target",
            host: build.dir.clone(),
            guest: workspace_root().join("target"),
            overlay: false,
        },
    ]
}

/// qemu's options sharing `trees` with the guest, read-only.
pub(super) fn cached_tree_options(trees: &[CachedTree]) -> Result<String> {
    let mut options = Vec::new();
    for tree in trees {
        let host = tree.host.to_string_lossy();
        // qemu's option syntax would split the path at a comma.
        if host.contains(',') || host.contains(' ') {
            bail!("cannot share {host} with the guest: its path has a comma or a space");
        }
        options.push(format!(
            "-virtfs local,path={host},mount_tag={},security_model=none,readonly=on",
            tree.tag
        ));
    }
    Ok(options.join(" "))
}

/// The guest's commands mounting `trees` where they belong; a tree that
/// cannot be mounted stops the guest, as every test would run slower
/// unnoticed.
pub(super) fn mount_cached_trees(trees: &[CachedTree]) -> String {
    let mut script = String::new();
    for tree in trees {
        let path = shell_word(&tree.guest.to_string_lossy());
        let share = format!("/run/vpcnet-vm/{}", tree.tag);
        let nine_p = "-t 9p -o trans=virtio,version=9p2000.L,cache=loose,msize=512000,ro";
        let mount = if tree.overlay {
            format!(
                "mkdir -p {share}/lower {share}/upper {share}/work && \
                 mount {nine_p} {tag} {share}/lower && \
                 mount -t overlay -o lowerdir={share}/lower,upperdir={share}/upper,workdir={share}/work \
                 {tag} {path}",
                tag = tree.tag
            )
        } else {
            format!("mount {nine_p} {} {path}", tree.tag)
        };
        let _ = writeln!(
            script,
            "{{ {mount}; }} || {{ echo \"vm: cannot mount the cached view of {guest}\"; exit 1; }}",
            guest = tree.guest.display()
        );
    }
    script
}

/// The guest script's lines that give the guest lab state of its own where
/// virtme-ng's view of `/var` (a tmpfs overlay over this machine's) would
/// show this machine's: the tests here, running beside the guest, write
/// containerd's root and libcni's cache there, and a lab's teardown in the
/// guest then finds (and cannot remove) another containerd's files. The
/// rest of the lab's directory (the releases, moto's virtualenv, kubectl
/// and helm) stays this machine's, read through bind mounts.
pub(super) fn private_lab_state() -> String {
    let containerd_root = Path::new(vpcnet_lab::cri::CONTAINERD_ROOT_DIR);
    private_state(
        containerd_root.parent().unwrap_or(containerd_root),
        &containerd_root
            .file_name()
            .unwrap_or_default()
            .to_string_lossy(),
        Path::new(vpcnet_lab::cri::CNI_CACHE_DIR),
    )
}

/// [`private_lab_state`]'s lines for `lab_dir`, whose child `written` and
/// `cache` the guest gets empty.
fn private_state(lab_dir: &Path, written: &str, cache: &Path) -> String {
    let lab_dir = shell_word(&lab_dir.to_string_lossy());
    let containerd = shell_word(written);
    let cni_cache = shell_word(&cache.to_string_lossy());
    format!(
        r#"private_lab_state() {{
    local host entry name
    host=$(mktemp -d) && mount --bind {lab_dir} "$host" && mount -t tmpfs tmpfs {lab_dir} || return 1
    for entry in "$host"/*; do
        name=${{entry##*/}}
        [ -e "$entry" ] && [ "$name" != {containerd} ] || continue
        mkdir -p {lab_dir}/"$name" && mount --bind "$entry" {lab_dir}/"$name" || return 1
    done
    mkdir -p {cni_cache} && mount -t tmpfs tmpfs {cni_cache}
}}
private_lab_state || {{ echo "vm: cannot give the guest lab state of its own"; exit 1; }}
"#
    )
}

#[cfg(test)]
mod tests {
    use std::{fs, process::Command};

    use super::private_state;

    #[test]
    fn the_guest_sees_the_lab_directory_but_what_the_tests_here_write_meanwhile() {
        let dir = tempfile::tempdir().unwrap();
        let lab = dir.path().join("vpcnet-lab");
        let cache = dir.path().join("cni");
        for made in [
            "releases",
            "containerd",
            "containerd/io.containerd.metadata.v1.bolt",
        ] {
            fs::create_dir_all(lab.join(made)).unwrap();
        }
        fs::write(lab.join("releases").join("vpcnet-agent"), "release").unwrap();
        fs::create_dir_all(cache.join("results")).unwrap();
        let fragment = private_state(&lab, "containerd", &cache);
        // What a guest's lab then does: reads a release, makes containerd's
        // root and libcni's cache, and removes them whole at its teardown.
        let checks = format!(
            "{fragment}\n\
             cat {lab}/releases/vpcnet-agent && \
             ! [ -e {lab}/containerd ] && ! [ -e {cache}/results ] && \
             mkdir -p {lab}/containerd/x {cache}/results && \
             rm -r {lab}/containerd {cache}/results && echo ' clean'",
            lab = lab.display(),
            cache = cache.display(),
        );
        // In a mount namespace of its own, as the guest's are its own.
        let out = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "bash", "-c", &checks])
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "release clean\n",
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            lab.join("containerd/io.containerd.metadata.v1.bolt")
                .is_dir(),
            "this machine's containerd root is untouched"
        );
    }
}
