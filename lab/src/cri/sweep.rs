//! The machinery that makes a containerd leave nothing behind: finding its
//! processes, shims and pause processes, its mounts and its cgroups, and
//! ending them with bounded waits.

use std::{
    fs::{self, File},
    io::{ErrorKind, Read, Seek, SeekFrom},
    path::{Path, PathBuf},
    process::Output,
    time::Duration,
};

use nix::{
    errno::Errno,
    mount::{MntFlags, umount2},
    sys::signal::Signal,
};
use tracing::{debug, warn};

use super::{Context, CriError, Result};

/// How much of a log an error shows.
const LOG_TAIL_BYTES: u64 = 8 * 1024;
/// Rounds of unmounting: a mount can hide another at the same place.
const UNMOUNT_ROUNDS: usize = 8;

/// The error for a program that could not be started.
pub(super) fn spawn_error(program: &str, err: &std::io::Error) -> CriError {
    if err.kind() == ErrorKind::NotFound {
        CriError::ToolMissing {
            program: program.to_owned(),
        }
    } else {
        CriError::Io {
            context: format!("starting `{program}`"),
            source: std::io::Error::new(err.kind(), err.to_string()),
        }
    }
}

/// A non-zero exit is an error that carries standard error.
pub(super) fn check_output(described: &str, output: &Output) -> Result<()> {
    if output.status.success() {
        return Ok(());
    }
    Err(CriError::CommandFailed {
        command: described.to_owned(),
        status: output.status.to_string(),
        stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
    })
}

/// The end of a log file.
pub(super) fn log_tail(path: &Path) -> String {
    let Ok(mut file) = File::open(path) else {
        return format!("(no log at {})", path.display());
    };
    let len = file.metadata().map_or(0, |m| m.len());
    let mut bytes = Vec::new();
    if file
        .seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)))
        .is_ok()
    {
        let _ = file.read_to_end(&mut bytes);
    }
    let text = String::from_utf8_lossy(&bytes).into_owned();
    if text.trim().is_empty() {
        "(nothing logged)".into()
    } else {
        text
    }
}

/// The command line of process `pid` (empty for a zombie or a process that
/// is gone).
pub(super) fn cmdline(pid: i32) -> Vec<String> {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|bytes| {
            bytes
                .split(|&b| b == 0)
                .filter(|arg| !arg.is_empty())
                .map(|arg| String::from_utf8_lossy(arg).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Every process's pid and command line.
fn processes() -> Result<Vec<(i32, Vec<String>)>> {
    let entries = fs::read_dir("/proc").context(|| "listing /proc".into())?;
    Ok(entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .map(|pid| (pid, cmdline(pid)))
        .filter(|(_, argv)| !argv.is_empty())
        .collect())
}

/// The containerd shims serving the containerd on `socket`: containerd
/// starts each with `-address <its socket>`.
pub(super) fn shims_of(socket: &Path) -> Result<Vec<i32>> {
    let socket = socket.to_string_lossy();
    Ok(processes()?
        .into_iter()
        .filter(|(_, argv)| {
            let is_shim = argv.first().is_some_and(|program| {
                Path::new(program)
                    .file_name()
                    .is_some_and(|name| name.to_string_lossy().starts_with("containerd-shim"))
            });
            is_shim
                && argv
                    .windows(2)
                    .any(|pair| pair[0] == "-address" && pair[1] == socket)
        })
        .map(|(pid, _)| pid)
        .collect())
}

/// Processes whose command line has `needle` as one of its arguments.
pub(super) fn processes_with_arg(needle: &str) -> Result<Vec<i32>> {
    Ok(processes()?
        .into_iter()
        .filter(|(_, argv)| argv.iter().any(|arg| arg == needle))
        .map(|(pid, _)| pid)
        .collect())
}

/// Sends `signal` to `pid` and waits up to `grace` for it to exit; `true`
/// if it is gone. A pidfd makes the wait an event, and makes the signal
/// safe from pid reuse once it is open.
pub(super) fn signal_and_wait(pid: i32, signal: Signal, grace: Duration) -> Result<bool> {
    let pidfd = match crate::pidfd::open(pid) {
        Ok(fd) => fd,
        Err(Errno::ESRCH) => return Ok(true),
        Err(err) => return Err(err).context(|| format!("opening a pidfd for {pid}")),
    };
    match crate::pidfd::send_signal(&pidfd, signal) {
        Ok(()) => {}
        Err(Errno::ESRCH) => return Ok(true),
        Err(err) => return Err(err).context(|| format!("sending {signal} to {pid}")),
    }
    crate::pidfd::wait_exit(&pidfd, grace).context(|| format!("waiting for {pid} to exit"))
}

/// SIGKILLs `pid` and waits (bounded) for it to be gone.
pub(super) fn kill_and_wait(pid: i32, what: &str) -> Result<()> {
    const KILL_GRACE: Duration = Duration::from_secs(5);
    if signal_and_wait(pid, Signal::SIGKILL, KILL_GRACE)? {
        Ok(())
    } else {
        Err(CriError::Timeout {
            what: format!("{what} (pid {pid}) to die after SIGKILL"),
            waited: KILL_GRACE,
        })
    }
}

/// The mount points of this mount namespace, in mount order.
pub(super) fn mount_points() -> Result<Vec<(PathBuf, String)>> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo")
        .context(|| "reading /proc/self/mountinfo".into())?;
    Ok(parse_mountinfo(&mountinfo))
}

/// Mount points and file system types of a mountinfo listing.
fn parse_mountinfo(mountinfo: &str) -> Vec<(PathBuf, String)> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let mount_point = fields.nth(4)?;
            // Optional fields end with "-"; the file system type follows.
            let fs_type = fields.skip_while(|field| *field != "-").nth(1)?;
            Some((
                PathBuf::from(unescape_mount_path(mount_point)),
                fs_type.to_owned(),
            ))
        })
        .collect()
}

/// mountinfo writes space, tab, newline and backslash as `\ooo`.
fn unescape_mount_path(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && let Some(octal) = bytes.get(i + 1..i + 4)
            && let Ok(text) = std::str::from_utf8(octal)
            && let Ok(value) = u8::from_str_radix(text, 8)
        {
            out.push(value);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Mount points under any of `dirs` (or at them), deepest first.
pub(super) fn mounts_under(dirs: &[&Path]) -> Result<Vec<PathBuf>> {
    let mut mounts: Vec<PathBuf> = mount_points()?
        .into_iter()
        .map(|(path, _)| path)
        .filter(|path| dirs.iter().any(|dir| path.starts_with(dir)))
        .collect();
    mounts.sort_by_key(|path| std::cmp::Reverse(path.components().count()));
    mounts.dedup();
    Ok(mounts)
}

/// Unmounts everything under `dirs`, deepest first; a mount that will not
/// go is detached (lazy unmount) as a last resort.
pub(super) fn unmount_all_under(dirs: &[&Path]) -> Result<()> {
    for _ in 0..UNMOUNT_ROUNDS {
        let mounts = mounts_under(dirs)?;
        if mounts.is_empty() {
            return Ok(());
        }
        for mount in mounts {
            match umount2(&mount, MntFlags::empty()) {
                Ok(()) | Err(Errno::EINVAL | Errno::ENOENT) => {
                    debug!(mount = %mount.display(), "unmounted");
                }
                Err(err) => {
                    warn!(mount = %mount.display(), %err, "unmount failed; detaching it");
                    umount2(&mount, MntFlags::MNT_DETACH)
                        .context(|| format!("detaching {}", mount.display()))?;
                }
            }
        }
    }
    let left = mounts_under(dirs)?;
    if left.is_empty() {
        Ok(())
    } else {
        Err(CriError::Teardown(format!(
            "mounts left after {UNMOUNT_ROUNDS} rounds of unmounting: {left:?}"
        )))
    }
}

/// Where the cgroup hierarchies are mounted (each v1 controller and the
/// unified v2 hierarchy).
pub(super) fn cgroup_mounts() -> Result<Vec<PathBuf>> {
    Ok(mount_points()?
        .into_iter()
        .filter(|(_, fs_type)| fs_type == "cgroup" || fs_type == "cgroup2")
        .map(|(path, _)| path)
        .collect())
}

/// The cgroup directories at `relative` (for example `/vpcnet-lab-pods`)
/// in every hierarchy, with all their descendants, deepest first.
pub(super) fn cgroup_trees(relative: &str) -> Result<Vec<PathBuf>> {
    let relative = relative.trim_start_matches('/');
    let mut dirs = Vec::new();
    for mount in cgroup_mounts()? {
        let top = mount.join(relative);
        if top.is_dir() {
            collect_dirs(&top, &mut dirs)?;
        }
    }
    dirs.sort_by_key(|path| std::cmp::Reverse(path.components().count()));
    Ok(dirs)
}

fn collect_dirs(dir: &Path, into: &mut Vec<PathBuf>) -> Result<()> {
    into.push(dir.to_owned());
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(err).context(|| format!("listing {}", dir.display())),
    };
    for entry in entries {
        let entry = entry.context(|| format!("listing {}", dir.display()))?;
        if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
            collect_dirs(&entry.path(), into)?;
        }
    }
    Ok(())
}

/// The pids in cgroup directory `dir` (`cgroup.procs`).
pub(super) fn cgroup_pids(dir: &Path) -> Vec<i32> {
    fs::read_to_string(dir.join("cgroup.procs"))
        .map(|procs| {
            procs
                .lines()
                .filter_map(|pid| pid.trim().parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Kills every process in the cgroup trees at `relative` and removes the
/// cgroups, deepest first.
pub(super) fn remove_cgroup_trees(relative: &str) -> Result<()> {
    let dirs = cgroup_trees(relative)?;
    for dir in &dirs {
        for pid in cgroup_pids(dir) {
            warn!(pid, cgroup = %dir.display(), "killing a process left in the pods' cgroup");
            kill_and_wait(pid, "a pod process")?;
        }
    }
    for dir in &dirs {
        match fs::remove_dir(dir) {
            Ok(()) => debug!(cgroup = %dir.display(), "removed"),
            Err(err) if err.kind() == ErrorKind::NotFound => {}
            Err(err) => return Err(err).context(|| format!("removing cgroup {}", dir.display())),
        }
    }
    Ok(())
}

/// Removes `dir` and everything in it; nothing there is fine.
pub(super) fn remove_tree(dir: &Path) -> Result<()> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == ErrorKind::NotFound => Ok(()),
        Err(err) => Err(err).context(|| format!("removing {}", dir.display())),
    }
}

/// Removes `dir` if it is empty (a parent others may share).
pub(super) fn remove_if_empty(dir: &Path) {
    match fs::remove_dir(dir) {
        Ok(()) => debug!(dir = %dir.display(), "removed the empty directory"),
        Err(err) => debug!(dir = %dir.display(), %err, "left in place"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_gives_unescaped_mount_points_and_types() {
        let mountinfo = "\
            22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n\
            41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n\
            90 22 0:50 / /run/vpcnet-lab/containerd/a\\040b rw master:3 - tmpfs shm rw\n";
        assert_eq!(
            parse_mountinfo(mountinfo),
            vec![
                (PathBuf::from("/"), "ext4".to_owned()),
                (
                    PathBuf::from("/sys/fs/cgroup/unified"),
                    "cgroup2".to_owned()
                ),
                (
                    PathBuf::from("/run/vpcnet-lab/containerd/a b"),
                    "tmpfs".to_owned()
                ),
            ]
        );
    }

    #[test]
    fn this_process_has_a_command_line() {
        let pid = i32::try_from(std::process::id()).unwrap();
        assert!(!cmdline(pid).is_empty());
        assert!(processes().unwrap().iter().any(|(p, _)| *p == pid));
    }
}
