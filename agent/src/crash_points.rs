//! A test hook: with `VPCNET_TEST_CRASH_AT=N`, the agent kills itself
//! (SIGKILL, as a crash or the OOM killer would) at the Nth step it passes
//! of its start, a migration of its maps or its shutdown, so that a test
//! can start it again from every point between two steps. Unset, a step
//! costs a read of a value set once.

use std::sync::{
    OnceLock,
    atomic::{AtomicU32, Ordering},
};

use nix::sys::signal::{Signal, raise};

/// The hook's environment variable.
pub const ENV_CRASH_AT: &str = "VPCNET_TEST_CRASH_AT";
/// What the agent logs before it kills itself at a step.
pub const KILLED_HERE: &str = "test hook: killed at this step";

static CRASH_AT: OnceLock<Option<u32>> = OnceLock::new();
static PASSED: AtomicU32 = AtomicU32::new(0);

/// A step of the start, a migration or the shutdown, `what` it is.
pub fn step(what: &str) {
    let Some(crash_at) = *CRASH_AT.get_or_init(|| {
        std::env::var(ENV_CRASH_AT)
            .ok()
            .and_then(|value| value.trim().parse().ok())
    }) else {
        return;
    };
    let number = PASSED.fetch_add(1, Ordering::SeqCst) + 1;
    tracing::debug!(step = number, what, "test hook: step");
    if number == crash_at {
        tracing::warn!(step = number, what, "{KILLED_HERE}");
        let _ = raise(Signal::SIGKILL);
    }
}
