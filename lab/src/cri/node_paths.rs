//! The node's own directories for the lab's containerd: a DaemonSet's
//! `hostPath` volumes name node paths (`/etc/cni/net.d`, `/run/vpcnet`,
//! ...), and the CNI plugins containerd runs read the same paths (the
//! conflist's agent socket). The lab's node shares the machine's file
//! system, so containerd runs in a mount namespace of its own where each
//! such path is a bind mount of a lab directory: the node's files live in
//! the lab, the machine's paths stay as they were. A mount point the
//! machine lacks is made (empty) and recorded, and removed at teardown.
//!
//! What containerd mounts in its state directory (the pods' network
//! namespaces) must reach the machine, where the lab enters them: the
//! state directory is made a shared mount of its own first, so its copy
//! in containerd's namespace stays its peer. The node paths' binds sit on
//! mounts made private in containerd's namespace, so none of them reaches
//! the machine.

use std::{
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use nix::mount::{MsFlags, mount};

use super::{Context, Result};

/// A node path and the lab directory it shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePath {
    /// The path as the node (and its pods' `hostPath`s) name it.
    pub node: PathBuf,
    /// The lab directory behind it.
    pub source: PathBuf,
}

/// The record of mount points made on the machine, in the state directory.
const RECORD: &str = "node-mount-points";

/// Makes each source directory and each missing mount point (recorded in
/// `state_dir`, for [`remove_mount_points`]), and `state_dir` a shared
/// mount (the runtime's teardown unmounts everything there).
pub(super) fn prepare(paths: &[NodePath], state_dir: &Path) -> Result<()> {
    share(state_dir)?;
    let mut made = Vec::new();
    for path in paths {
        fs::create_dir_all(&path.source)
            .context(|| format!("creating {}", path.source.display()))?;
        // Each missing ancestor too, outermost first, so teardown can
        // remove them innermost first.
        let mut missing: Vec<&Path> = path
            .node
            .ancestors()
            .take_while(|dir| !dir.exists())
            .collect();
        missing.reverse();
        for dir in missing {
            fs::create_dir(dir)
                .context(|| format!("creating the mount point {}", dir.display()))?;
            made.push(dir.display().to_string());
        }
    }
    let record = state_dir.join(RECORD);
    let mut recorded = fs::read_to_string(&record).unwrap_or_default();
    for dir in made {
        recorded.push_str(&dir);
        recorded.push('\n');
    }
    fs::write(&record, recorded).context(|| format!("writing {}", record.display()))
}

/// `dir` bound on itself and shared.
fn share(dir: &Path) -> Result<()> {
    let flags = MsFlags::MS_BIND;
    mount(Some(dir), dir, None::<&str>, flags, None::<&str>)
        .context(|| format!("binding {} on itself", dir.display()))?;
    mount(
        None::<&str>,
        dir,
        None::<&str>,
        MsFlags::MS_SHARED,
        None::<&str>,
    )
    .context(|| format!("sharing {}", dir.display()))
}

/// `command` run in a mount namespace of its own where every node path is
/// its lab directory. `shared`: mount points a container may mount below
/// (`Bidirectional`), made shared in that namespace (a mount there
/// reaches the namespace, not the machine, unless the machine shares it).
pub(super) fn wrap(command: &Command, paths: &[NodePath], shared: &[PathBuf]) -> Command {
    let mut script = String::from("set -e\n");
    for (index, _) in paths.iter().enumerate() {
        // Arguments, not text in the script: paths are never parsed by sh.
        let (source, node) = (2 * index + 1, 2 * index + 2);
        let _ = writeln!(
            script,
            "mount --make-private \"$(findmnt -n -o TARGET -T \"${{{node}}}\")\"\n\
             mount --bind \"${{{source}}}\" \"${{{node}}}\""
        );
    }
    let skip = 2 * paths.len();
    for index in 0..shared.len() {
        let _ = writeln!(script, "mount --make-shared \"${{{}}}\"", skip + index + 1);
    }
    let _ = write!(script, "shift {}\nexec \"$@\"\n", skip + shared.len());
    let mut wrapped = Command::new("unshare");
    // The machine's propagation, unchanged: the shared state directory
    // stays its peer; the mounts the binds sit on are made private above.
    wrapped
        .args(["--mount", "--propagation", "unchanged", "--", "sh", "-c"])
        .arg(script)
        .arg("sh");
    for path in paths {
        wrapped.arg(&path.source).arg(&path.node);
    }
    wrapped.args(shared);
    wrapped.arg(command.get_program()).args(command.get_args());
    for (key, value) in command.get_envs() {
        match value {
            Some(value) => wrapped.env(key, value),
            None => wrapped.env_remove(key),
        };
    }
    wrapped
}

/// Removes the mount points [`prepare`] made, innermost first, if empty
/// (the mounts died with containerd's namespace); returns what is left.
pub(super) fn remove_mount_points(state_dir: &Path) -> Vec<String> {
    let record = state_dir.join(RECORD);
    let Ok(recorded) = fs::read_to_string(&record) else {
        return Vec::new();
    };
    let mut left = Vec::new();
    let mut dirs: Vec<PathBuf> = recorded.lines().map(PathBuf::from).collect();
    dirs.sort_by_key(|dir| std::cmp::Reverse(dir.components().count()));
    dirs.dedup();
    for dir in dirs {
        if let Err(err) = fs::remove_dir(&dir)
            && err.kind() != std::io::ErrorKind::NotFound
        {
            left.push(format!("the mount point {}: {err}", dir.display()));
        }
    }
    let _ = fs::remove_file(&record);
    left
}
