//! What kubelet does with a `FileOrCreate` host path before the pod's
//! containers start: makes an empty file where nothing is, and refuses
//! anything there that is not a file. The runtime alone would make a
//! missing bind source a directory (containerd's CRI does), and a
//! directory at `/run/xtables.lock` breaks every `iptables -w` on the
//! machine after it.
//!
//! `DirectoryOrCreate` paths are the lab node's own directories, made
//! behind the node's paths before containerd starts
//! ([`crate::cri::NodePath`]).

use std::{fs, io, path::Path};

/// The host path type kubelet makes as an empty file.
pub const FILE_OR_CREATE: &str = "FileOrCreate";

/// Makes `path` an empty file if nothing is there (not its parent, as
/// kubelet does not), and checks that what is there is a file.
pub fn ensure_file(path: &Path) -> Result<(), String> {
    match fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
    {
        Ok(_) => return Ok(()),
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {}
        Err(err) => return Err(format!("creating {}: {err}", path.display())),
    }
    let metadata =
        fs::metadata(path).map_err(|err| format!("checking {}: {err}", path.display()))?;
    if metadata.is_file() {
        Ok(())
    } else {
        Err(format!(
            "hostPath type check failed: {} is not a file",
            path.display()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scratch::ScratchDir;

    #[test]
    fn a_missing_file_or_create_path_becomes_an_empty_file() {
        let dir = ScratchDir::new("vpcnet-host-paths").unwrap();
        let lock = dir.path().join("xtables.lock");
        ensure_file(&lock).unwrap();
        let metadata = fs::metadata(&lock).unwrap();
        assert!(metadata.is_file(), "{} is not a file", lock.display());
        assert_eq!(metadata.len(), 0);
    }

    #[test]
    fn an_existing_file_is_kept_as_it_is() {
        let dir = ScratchDir::new("vpcnet-host-paths").unwrap();
        let lock = dir.path().join("xtables.lock");
        fs::write(&lock, "held").unwrap();
        ensure_file(&lock).unwrap();
        assert_eq!(fs::read_to_string(&lock).unwrap(), "held");
    }

    #[test]
    fn a_directory_where_a_file_belongs_is_refused() {
        let dir = ScratchDir::new("vpcnet-host-paths").unwrap();
        let lock = dir.path().join("xtables.lock");
        fs::create_dir(&lock).unwrap();
        let err = ensure_file(&lock).unwrap_err();
        assert!(err.contains("is not a file"), "{err}");
    }

    #[test]
    fn a_missing_parent_is_not_made() {
        let dir = ScratchDir::new("vpcnet-host-paths").unwrap();
        let lock = dir.path().join("run").join("xtables.lock");
        assert!(ensure_file(&lock).is_err());
        assert!(!dir.path().join("run").exists());
    }
}
