//! The garbage collector: a thread that, every interval, gives the
//! datapath the node's conntrack timeouts when they changed and removes
//! the NAT flows and the stack's flows that expired or lost their other
//! half.
//!
//! It runs at the lowest CPU priority, with map handles of its own: a pass
//! over 236k flows takes a few hundred ms of CPU (`cargo xtask bench
//! --parts nat-load`), and neither the datapath's lock (CNI ADD and DEL
//! need it), the agent's runtime nor an ADD's CPU time waits for it.

use std::{
    path::Path,
    sync::{Arc, Mutex, PoisonError, mpsc},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use tracing::{info, warn};
use vpcnet_common::nat::Timeouts;

use super::{
    CollectorReport, DatapathError, DatapathMaps, GcStats, monotonic_now_ns,
    timeouts::{NETFILTER_SYSCTL_DIR, read_timeouts},
};

/// Why the collector did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("the collector's maps")]
    Maps(#[source] DatapathError),
    #[error("starting the garbage collector's thread")]
    Thread(#[source] std::io::Error),
}

/// The running collector's thread.
pub struct Collector {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<()>,
}

impl Collector {
    /// Starts collecting on maps of its own, opened from `pin_dir`, a pass
    /// every `interval`; each pass goes into `report`.
    pub fn start(
        pin_dir: &Path,
        interval: Duration,
        report: &Arc<Mutex<CollectorReport>>,
    ) -> Result<Self, StartError> {
        let maps = DatapathMaps::open_pinned(pin_dir).map_err(StartError::Maps)?;
        let (stop, stopped) = mpsc::channel::<()>();
        let report = Arc::clone(report);
        let thread = std::thread::Builder::new()
            .name("vpcnet-gc".into())
            .spawn(move || collect_until_stopped(maps, interval, &report, &stopped))
            .map_err(StartError::Thread)?;
        Ok(Self { stop, thread })
    }

    /// Stops the thread; a pass under way finishes first.
    pub async fn stop(self) {
        let Self { stop, thread } = self;
        drop(stop);
        let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    }
}

/// The collector's thread: a pass every `interval` until `stopped` says so.
fn collect_until_stopped(
    mut maps: DatapathMaps,
    interval: Duration,
    report: &Mutex<CollectorReport>,
    stopped: &mpsc::Receiver<()>,
) {
    // SCHED_IDLE for this thread alone (Linux's policies are per thread):
    // any other task that wakes takes the CPU from it at once, where nice
    // 19 still cost the ADDs' tail (`cargo xtask bench --parts nat-load`).
    // A busy node still gives it a sliver of CPU, so passes go on.
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` lives through the call; failing changes nothing.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &raw const param) } != 0 {
        warn!(error = %std::io::Error::last_os_error(), "the collector keeps its CPU priority");
    }
    loop {
        let started = Instant::now();
        match collect(&mut maps) {
            Ok(c) => {
                c.log();
                report
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .record([&c.nat, &c.stack], c.took);
            }
            Err(e) => warn!(error = %e, "garbage collection failed"),
        }
        let rest = interval.saturating_sub(started.elapsed());
        if !matches!(
            stopped.recv_timeout(rest),
            Err(mpsc::RecvTimeoutError::Timeout)
        ) {
            return;
        }
    }
}

/// What one garbage collection did, and how long it took.
struct Collected {
    nat: GcStats,
    stack: GcStats,
    took: Duration,
}

impl Collected {
    fn log(&self) {
        let Self { nat, stack, took } = self;
        if nat.expired + nat.orphans + nat.paired > 0 {
            info!(
                flows = nat.flows,
                expired = nat.expired,
                orphans = nat.orphans,
                paired = nat.paired,
                ?took,
                "NAT garbage collected"
            );
        }
        if stack.expired + stack.orphans > 0 {
            info!(
                flows = stack.flows,
                expired = stack.expired,
                orphans = stack.orphans,
                ?took,
                "stack flows garbage collected"
            );
        }
    }
}

/// One garbage collection: the node's timeouts, then the NAT table and
/// the stack flows.
fn collect(maps: &mut DatapathMaps) -> Result<Collected, DatapathError> {
    let started = Instant::now();
    let timeouts = sync_timeouts(maps)?;
    let now = monotonic_now_ns();
    let nat = maps.collect_garbage(&timeouts, now)?;
    let stack = maps.collect_stack_flows(&timeouts, now)?;
    Ok(Collected {
        nat,
        stack,
        took: started.elapsed(),
    })
}

/// Gives the datapath the node's conntrack timeouts when they changed (at
/// start, or after a `sysctl -w`), and returns them.
pub fn sync_timeouts(maps: &mut DatapathMaps) -> Result<Timeouts, DatapathError> {
    let wanted = read_timeouts(Path::new(NETFILTER_SYSCTL_DIR));
    if maps.timeouts()? != wanted {
        maps.set_timeouts(&wanted)?;
        info!(timeouts = ?wanted, "flow timeouts from the node's conntrack settings (0: netfilter's default)");
    }
    Ok(wanted)
}
