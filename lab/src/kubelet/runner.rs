//! Runs a [`PodPlan`] through CRI as kubelet runs a DaemonSet's pod: the
//! sandbox, each init container to a successful exit, then the
//! containers; every relist (each second, kubelet's PLEG period) a
//! container that exited is restarted with kubelet's back-off, and the
//! exec probes that are due run: a container that fails its liveness
//! probe is stopped and restarted, the pod is ready while every readiness
//! probe passes.

use std::{
    thread,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::pod_spec::{ContainerPlan, ExecProbe, PodPlan};
use crate::cri::{ContainerState, CriClient, CriError};

/// kubelet's PLEG relist period.
pub const RELIST: Duration = Duration::from_secs(1);
/// kubelet's crash-loop back-off: 10 s, doubling, at most 5 minutes.
const BACKOFF_FIRST: Duration = Duration::from_secs(10);
const BACKOFF_MAX: Duration = Duration::from_mins(5);
/// How often an init container's end is looked for.
const INIT_POLL: Duration = Duration::from_millis(200);

/// What can go wrong running the pod.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Cri(#[from] CriError),
    #[error("init container {name} exited with {exit_code}: {output}")]
    InitFailed {
        name: String,
        exit_code: i32,
        output: String,
    },
    #[error("init container {name} did not finish within {waited:?}")]
    InitTimeout { name: String, waited: Duration },
}

/// What the pod's containers are doing, as `kubectl get pod` would say.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodStatus {
    /// The pod's name.
    pub name: String,
    /// Its DaemonSet's name (when a controller made it).
    #[serde(default)]
    pub daemon_set: String,
    pub sandbox_id: String,
    pub ready: bool,
    pub containers: Vec<ContainerStatusLine>,
}

/// One container's line of [`PodStatus`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerStatusLine {
    pub name: String,
    pub id: String,
    pub image: String,
    pub restarts: u32,
    pub ready: bool,
    pub running: bool,
    /// Why it last restarted (exited with a code, failed its liveness
    /// probe), if it did.
    pub last_restart: Option<String>,
}

#[derive(Debug, Default)]
struct ProbeState {
    /// Consecutive failures and successes.
    failures: u32,
    successes: u32,
    next: Option<Instant>,
}

#[derive(Debug)]
struct LiveContainer {
    plan: ContainerPlan,
    id: String,
    started: Instant,
    restarts: u32,
    ready: bool,
    running: bool,
    readiness: ProbeState,
    liveness: ProbeState,
    backoff: Duration,
    /// When an exited container may start again.
    restart_at: Option<Instant>,
    last_restart: Option<String>,
}

/// A running pod.
#[derive(Debug)]
pub struct PodRunner {
    client: CriClient,
    plan: PodPlan,
    sandbox_id: String,
    containers: Vec<LiveContainer>,
}

impl PodRunner {
    /// Runs the sandbox, the init containers (each must exit 0 within
    /// `init_timeout`) and starts the containers.
    pub fn start(
        client: CriClient,
        plan: PodPlan,
        init_timeout: Duration,
    ) -> Result<Self, RunError> {
        let sandbox_id = client.run_pod_sandbox(&plan.sandbox)?;
        info!(pod = %plan.sandbox.name, sandbox = %sandbox_id, "sandbox running");
        let mut runner = Self {
            client,
            plan,
            sandbox_id,
            containers: Vec::new(),
        };
        for init in runner.plan.init.clone() {
            runner.run_to_completion(&init, init_timeout)?;
        }
        for plan in runner.plan.containers.clone() {
            let id = runner.create_and_start(&plan, 0)?;
            runner.containers.push(LiveContainer::new(plan, id));
        }
        Ok(runner)
    }

    fn create_and_start(&self, plan: &ContainerPlan, attempt: u32) -> Result<String, CriError> {
        let mut spec = plan.spec.clone();
        spec.attempt = attempt;
        let id = self
            .client
            .create_container(&self.sandbox_id, &self.plan.sandbox, &spec)?;
        self.client.start_container(&id)?;
        info!(container = %spec.name, attempt, id = %id, "container started");
        Ok(id)
    }

    fn run_to_completion(&self, init: &ContainerPlan, timeout: Duration) -> Result<(), RunError> {
        let id = self.create_and_start(init, 0)?;
        let deadline = Instant::now() + timeout;
        loop {
            let status = self.client.container_status(&id)?;
            if status.state == ContainerState::Exited {
                if status.exit_code == 0 {
                    info!(container = %init.spec.name, "init container done");
                    return Ok(());
                }
                return Err(RunError::InitFailed {
                    name: init.spec.name.clone(),
                    exit_code: status.exit_code,
                    output: output_tail(&status.log_path),
                });
            }
            if Instant::now() >= deadline {
                return Err(RunError::InitTimeout {
                    name: init.spec.name.clone(),
                    waited: timeout,
                });
            }
            thread::sleep(INIT_POLL);
        }
    }

    /// One relist: restarts what exited (after its back-off), runs the
    /// probes that are due.
    pub fn relist(&mut self) -> Result<(), CriError> {
        let now = Instant::now();
        for index in 0..self.containers.len() {
            let status = self.client.container_status(&self.containers[index].id)?;
            let container = &mut self.containers[index];
            container.running = status.state == ContainerState::Running;
            if !container.running {
                container.ready = false;
                if container.restart_at.is_none() {
                    let why = format!("exited with {} ({})", status.exit_code, status.reason);
                    let output = output_tail(&status.log_path);
                    warn!(container = %container.plan.spec.name, %why, backoff = ?container.backoff, %output, "container exited; restarting after the back-off");
                    container.last_restart = Some(why);
                    container.restart_at = Some(now + container.backoff);
                }
                if container.restart_at.is_some_and(|at| at <= now) {
                    self.restart(index)?;
                }
                continue;
            }
            self.probe(index, now)?;
        }
        Ok(())
    }

    fn probe(&mut self, index: usize, now: Instant) -> Result<(), CriError> {
        let container = &self.containers[index];
        let id = container.id.clone();
        let started = container.started;
        if let Some(probe) = container.plan.liveness.clone()
            && due(&self.containers[index].liveness, &probe, started, now)
        {
            let passed = self.exec_probe(&id, &probe);
            let container = &mut self.containers[index];
            record(&mut container.liveness, &probe, passed, now);
            if container.liveness.failures >= probe.failure_threshold {
                let why = format!(
                    "failed its liveness probe {} times",
                    container.liveness.failures
                );
                warn!(container = %container.plan.spec.name, %why, "restarting it");
                container.last_restart = Some(why);
                self.client.stop_container(&id, self.plan.grace)?;
                return self.restart(index);
            }
        }
        let container = &self.containers[index];
        if let Some(probe) = container.plan.readiness.clone()
            && due(&container.readiness, &probe, started, now)
        {
            let passed = self.exec_probe(&id, &probe);
            let container = &mut self.containers[index];
            record(&mut container.readiness, &probe, passed, now);
            let ready = if passed {
                container.readiness.successes >= probe.success_threshold
            } else {
                container.ready && container.readiness.failures < probe.failure_threshold
            };
            if ready != container.ready {
                info!(container = %container.plan.spec.name, ready, "readiness changed");
            }
            container.ready = ready;
        } else if container.plan.readiness.is_none() {
            self.containers[index].ready = true;
        }
        Ok(())
    }

    fn exec_probe(&self, id: &str, probe: &ExecProbe) -> bool {
        match self.client.exec_sync(id, &probe.command, probe.timeout) {
            Ok(result) if result.exit_code == 0 => true,
            Ok(result) => {
                info!(command = ?probe.command, exit_code = result.exit_code, stdout = %result.stdout.trim(), stderr = %result.stderr.trim(), "probe failed");
                false
            }
            Err(err) => {
                info!(command = ?probe.command, %err, "probe failed");
                false
            }
        }
    }

    /// Removes the container at `index` and starts its next attempt.
    fn restart(&mut self, index: usize) -> Result<(), CriError> {
        let old = self.containers[index].id.clone();
        let attempt = self.containers[index].restarts + 1;
        let plan = self.containers[index].plan.clone();
        if let Err(err) = self.client.remove_container(&old) {
            warn!(%err, id = %old, "removing the exited container");
        }
        let id = self.create_and_start(&plan, attempt)?;
        let container = &mut self.containers[index];
        let backoff = (container.backoff * 2).min(BACKOFF_MAX);
        let last_restart = container.last_restart.take();
        *container = LiveContainer::new(plan, id);
        container.restarts = attempt;
        container.backoff = backoff;
        container.last_restart = last_restart;
        Ok(())
    }

    /// Whether every container is ready.
    pub fn ready(&self) -> bool {
        !self.containers.is_empty() && self.containers.iter().all(|c| c.ready)
    }

    pub fn status(&self) -> PodStatus {
        PodStatus {
            name: self.plan.sandbox.name.clone(),
            daemon_set: String::new(),
            sandbox_id: self.sandbox_id.clone(),
            ready: self.ready(),
            containers: self
                .containers
                .iter()
                .map(|c| ContainerStatusLine {
                    name: c.plan.spec.name.clone(),
                    id: c.id.clone(),
                    image: c.plan.spec.image.clone(),
                    restarts: c.restarts,
                    ready: c.ready,
                    running: c.running,
                    last_restart: c.last_restart.clone(),
                })
                .collect(),
        }
    }

    /// Deletes the pod as kubelet does: each container stopped with the
    /// grace period, then the sandbox stopped and removed.
    pub fn stop(self) -> Result<(), CriError> {
        for container in &self.containers {
            self.client.stop_container(&container.id, self.plan.grace)?;
        }
        self.client.stop_pod_sandbox(&self.sandbox_id)?;
        self.client.remove_pod_sandbox(&self.sandbox_id)?;
        info!(pod = %self.plan.sandbox.name, "pod deleted");
        Ok(())
    }
}

impl LiveContainer {
    fn new(plan: ContainerPlan, id: String) -> Self {
        Self {
            plan,
            id,
            started: Instant::now(),
            restarts: 0,
            ready: false,
            running: true,
            readiness: ProbeState::default(),
            liveness: ProbeState::default(),
            backoff: BACKOFF_FIRST,
            restart_at: None,
            last_restart: None,
        }
    }
}

/// The last lines a container wrote, from its CRI log (`<time> <stream>
/// <P|F> <text>` per line).
fn output_tail(log: &std::path::Path) -> String {
    const LINES: usize = 8;
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text
        .lines()
        .map(|line| line.splitn(4, ' ').nth(3).unwrap_or(line))
        .collect();
    lines[lines.len().saturating_sub(LINES)..].join("\n")
}

fn due(state: &ProbeState, probe: &ExecProbe, started: Instant, now: Instant) -> bool {
    match state.next {
        Some(next) => next <= now,
        None => started + probe.initial_delay <= now,
    }
}

fn record(state: &mut ProbeState, probe: &ExecProbe, passed: bool, now: Instant) {
    if passed {
        state.successes += 1;
        state.failures = 0;
    } else {
        state.failures += 1;
        state.successes = 0;
    }
    state.next = Some(now + probe.period);
}
