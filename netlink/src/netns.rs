//! Network namespaces by path (`/var/run/netns/<name>`, `/proc/<pid>/ns/net`,
//! what a container runtime passes as `CNI_NETNS`), and netlink work done
//! inside one.
//!
//! A netlink socket belongs to the namespace of the thread that opens it, so
//! work inside a pod's namespace runs on a thread of its own that enters the
//! namespace (`setns`) and opens its own [`NetlinkHandle`] there. The thread
//! is new and ends with the work: the namespace of the caller's threads never
//! changes, and no pooled thread is ever left in a pod's namespace.

use std::{
    fs::File,
    io,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use nix::sched::{CloneFlags, setns};

use crate::{NetlinkHandle, pod::PodNetError};

/// An open network namespace: holding the file keeps the namespace alive
/// while it is used, even if its path is unmounted meanwhile.
#[derive(Debug)]
pub struct Netns {
    file: File,
    path: PathBuf,
}

impl Netns {
    /// Opens the namespace at `path`. A path that does not exist is
    /// [`PodNetError::NetnsMissing`]; whether it is a network namespace at
    /// all is found out when it is entered.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, PodNetError> {
        let path = path.as_ref().to_owned();
        match File::open(&path) {
            Ok(file) => Ok(Self { file, path }),
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                Err(PodNetError::NetnsMissing(path))
            }
            Err(source) => Err(PodNetError::OpenNetns { path, source }),
        }
    }

    /// The path it was opened by.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open namespace file (for `IFLA_NET_NS_FD`).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Whether this is the namespace the calling thread is in (a runtime
    /// that passes its own namespace as a pod's would have the plugin move
    /// the node's interfaces around).
    pub fn is_current(&self) -> Result<bool, PodNetError> {
        let own = Path::new("/proc/thread-self/ns/net");
        let mine = std::fs::metadata(own).map_err(|source| PodNetError::OpenNetns {
            path: own.to_owned(),
            source,
        })?;
        let theirs = self
            .file
            .metadata()
            .map_err(|source| PodNetError::OpenNetns {
                path: self.path.clone(),
                source,
            })?;
        Ok(mine.dev() == theirs.dev() && mine.ino() == theirs.ino())
    }

    /// Runs `f` with a [`NetlinkHandle`] opened inside this namespace, on a
    /// new thread that enters it, with a current-thread runtime of its own;
    /// the caller's task waits without blocking its runtime. A panic in `f`
    /// is passed on to the caller.
    pub async fn run<T, F>(&self, f: F) -> Result<T, PodNetError>
    where
        T: Send + 'static,
        F: AsyncFnOnce(&NetlinkHandle) -> Result<T, PodNetError> + Send + 'static,
    {
        let file = self.file.try_clone().map_err(PodNetError::Thread)?;
        let path = self.path.clone();
        let (done, result) = tokio::sync::oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("netns".into())
            .spawn(move || {
                let outcome = enter_and_run(&file, &path, f);
                // The receiver only goes away with a cancelled caller.
                let _ = done.send(outcome);
            })
            .map_err(PodNetError::Thread)?;
        match result.await {
            Ok(outcome) => outcome,
            // The sender was dropped without a word: the thread panicked.
            Err(_) => match thread.join() {
                Err(panic) => std::panic::resume_unwind(panic),
                Ok(()) => Err(PodNetError::Thread(io::Error::other(
                    "the namespace thread ended without an answer",
                ))),
            },
        }
    }
}

/// The body of [`Netns::run`]'s thread.
fn enter_and_run<T, F>(file: &File, path: &Path, f: F) -> Result<T, PodNetError>
where
    F: AsyncFnOnce(&NetlinkHandle) -> Result<T, PodNetError>,
{
    setns(file, CloneFlags::CLONE_NEWNET).map_err(|source| PodNetError::Setns {
        path: path.to_owned(),
        source,
    })?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(PodNetError::Thread)?;
    runtime.block_on(async move {
        let handle = NetlinkHandle::new()?;
        f(&handle).await
    })
}
