//! One lab user at a time, within a process and across processes.

use std::{
    fs,
    sync::{Mutex, MutexGuard, PoisonError},
};

/// Held by whoever uses the lab; see [`serial`].
pub struct LabLock {
    _file: nix::fcntl::Flock<fs::File>,
    _in_process: MutexGuard<'static, ()>,
}

/// The lock file that serialises lab users across processes.
const LOCK_FILE: &str = "/run/vpcnet-lab.lock";

/// Serialises lab users: tests that bring labs up share kernel state
/// (namespace names, the state directory, the pin directory), so each holds
/// this for as long as its lab exists. It is a lock within the process (a
/// test that panicked does not poison it) and an `flock` across processes,
/// so two test runs on one machine take turns instead of colliding.
pub fn serial() -> LabLock {
    static LAB_IN_USE: Mutex<()> = Mutex::new(());
    let in_process = LAB_IN_USE.lock().unwrap_or_else(PoisonError::into_inner);
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(LOCK_FILE)
        .unwrap_or_else(|e| panic!("opening {LOCK_FILE}: {e}"));
    let file = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
        .unwrap_or_else(|(_, e)| panic!("locking {LOCK_FILE}: {e}"));
    LabLock {
        _file: file,
        _in_process: in_process,
    }
}
