//! Signalling a process through a pidfd, which pins it: a signal sent
//! through it reaches that process and never one that reused its pid, and
//! the pidfd becomes readable when the process exits.

use std::{
    os::fd::{AsFd, FromRawFd, OwnedFd},
    time::{Duration, Instant},
};

use nix::{
    errno::Errno,
    poll::{PollFd, PollFlags, PollTimeout, poll},
    sys::signal::Signal,
};

/// A pidfd for process `pid`.
pub(crate) fn open(pid: i32) -> Result<OwnedFd, Errno> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor
    // or -1; no memory is shared with the kernel.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(Errno::last());
    }
    let fd = i32::try_from(fd).map_err(|_| Errno::EBADF)?;
    // SAFETY: the kernel just returned this descriptor and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends `signal` to the pidfd's process.
pub(crate) fn send_signal(pidfd: &OwnedFd, signal: Signal) -> Result<(), Errno> {
    use std::os::fd::AsRawFd;
    // SAFETY: a null siginfo is allowed (the kernel fills one as kill() would);
    // the descriptor is valid for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal as libc::c_int,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc < 0 { Err(Errno::last()) } else { Ok(()) }
}

/// Waits up to `grace` for the pidfd's process to exit; whether it did.
pub(crate) fn wait_exit(pidfd: &OwnedFd, grace: Duration) -> Result<bool, Errno> {
    let deadline = Instant::now() + grace;
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Ok(false);
        }
        let millis = u16::try_from(remaining.as_millis().max(1)).unwrap_or(u16::MAX);
        let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(millis)) {
            Ok(0) | Err(Errno::EINTR) => {}
            Ok(_) => return Ok(true),
            Err(err) => return Err(err),
        }
    }
}
