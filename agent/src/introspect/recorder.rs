//! The events `/metrics` counts that leave no trace in the pool's state:
//! AWS API calls (per call name, as aws-node's awsutils counts them), the
//! address manager's actions under way, DEL requests by reason, pod-ENI
//! errors, and how long the start took. One recorder for the process, as
//! aws-node has one Prometheus registry: the cloud client, the address
//! manager and the CNI backend write to it, a scrape reads a copy.

use std::{
    collections::BTreeMap,
    sync::{Mutex, MutexGuard, PoisonError},
    time::Duration,
};

/// aws-node's names for the address manager's actions
/// (`awscni_ipamd_action_inprogress{fn}`): the start, growing and shrinking
/// the pool, the node's reconcile with what is attached.
pub const ACTION_NODE_INIT: &str = "nodeInit";
pub const ACTION_INCREASE_POOL: &str = "increaseDatastorePool";
pub const ACTION_DECREASE_POOL: &str = "decreaseDatastorePool";
pub const ACTION_NODE_RECONCILE: &str = "nodeIPPoolReconcile";
/// Every action, in the order the scrape lists them.
pub const ACTIONS: [&str; 4] = [
    ACTION_NODE_INIT,
    ACTION_INCREASE_POOL,
    ACTION_DECREASE_POOL,
    ACTION_NODE_RECONCILE,
];

/// aws-node's name for asking the VPC resource controller for a trunk ENI
/// (`awscni_pod_eni_error_count{fn}`).
pub const POD_ENI_ENABLE_SECURITY_GROUPS: &str = "tryEnableSecurityGroupsForPods";

/// The instance metadata service's call name (`awscni_aws_api_latency_ms`).
pub const IMDS_API: &str = "GetMetadata";

/// Bucket bounds (seconds) of aws-node's duration histograms: Prometheus'
/// default buckets, which aws-node keeps.
pub const DURATION_BUCKETS: [f64; 11] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Longest `reason` a DEL request's label keeps (the plugin sends a word).
const MAX_REASON_LEN: usize = 64;

/// Observations of a duration, in [`DURATION_BUCKETS`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    /// Observations at or below each bound (cumulative, as exposed).
    pub buckets: [u64; DURATION_BUCKETS.len()],
    pub count: u64,
    pub sum: f64,
}

impl Histogram {
    pub fn observe(&mut self, value: f64) {
        for (bound, n) in DURATION_BUCKETS.iter().zip(&mut self.buckets) {
            if value <= *bound {
                *n += 1;
            }
        }
        self.count += 1;
        self.sum += value;
    }
}

/// How an AWS call ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome<'a> {
    Ok,
    /// The service answered with an error code (EC2's `RequestLimitExceeded`).
    ApiError(&'a str),
    /// Anything else: no answer, or an answer without a code (`status`: the
    /// HTTP status when there was one).
    OtherError {
        status: Option<u16>,
    },
}

impl Outcome<'_> {
    /// aws-node's `status` label: `200` when it worked, the error code for
    /// an API error, else empty (the HTTP status for IMDS, which has no
    /// codes).
    fn status(self) -> String {
        match self {
            Self::Ok => "200".to_owned(),
            Self::ApiError(code) => code.to_owned(),
            Self::OtherError { status } => status.map(|s| s.to_string()).unwrap_or_default(),
        }
    }
}

/// `awscni_aws_api_latency_ms`'s labels.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LatencyKey {
    pub api: &'static str,
    pub error: bool,
    pub status: String,
}

/// Calls, and their whole milliseconds summed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Latency {
    pub count: u64,
    pub sum_ms: u64,
}

/// `awscni_ipamd_startup_duration_seconds`'s labels.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct StartupKey {
    pub success: bool,
    pub with_api_server: bool,
    pub failure_reason: &'static str,
}

/// Everything recorded so far.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Recorded {
    /// EC2 calls made, and failed, by call name.
    pub ec2_requests: BTreeMap<&'static str, u64>,
    pub ec2_errors: BTreeMap<&'static str, u64>,
    /// Calls AWS refused with an error code, by (call name, code).
    pub api_errors: BTreeMap<(&'static str, String), u64>,
    pub latency: BTreeMap<LatencyKey, Latency>,
    /// Actions under way, by name.
    pub actions: BTreeMap<&'static str, u64>,
    /// DEL requests by the plugin's reason.
    pub del_requests: BTreeMap<String, u64>,
    pub pod_eni_errors: BTreeMap<&'static str, u64>,
    pub startup: BTreeMap<StartupKey, Histogram>,
    /// The address manager's start, by success.
    pub node_init: BTreeMap<bool, Histogram>,
    /// Kubernetes API requests by the answer's HTTP status (`None`: no
    /// answer).
    pub kubernetes_answers: BTreeMap<Option<u16>, u64>,
}

impl Recorded {
    const fn new() -> Self {
        Self {
            ec2_requests: BTreeMap::new(),
            ec2_errors: BTreeMap::new(),
            api_errors: BTreeMap::new(),
            latency: BTreeMap::new(),
            actions: BTreeMap::new(),
            del_requests: BTreeMap::new(),
            pod_eni_errors: BTreeMap::new(),
            startup: BTreeMap::new(),
            node_init: BTreeMap::new(),
            kubernetes_answers: BTreeMap::new(),
        }
    }

    /// An EC2 call `api` that took `elapsed` and ended as `outcome`.
    pub fn ec2_call(&mut self, api: &'static str, elapsed: Duration, outcome: Outcome<'_>) {
        *self.ec2_requests.entry(api).or_default() += 1;
        if outcome != Outcome::Ok {
            *self.ec2_errors.entry(api).or_default() += 1;
        }
        self.aws_call(api, elapsed, outcome);
    }

    /// Any AWS call (EC2's or IMDS's): its latency, its error code.
    pub fn aws_call(&mut self, api: &'static str, elapsed: Duration, outcome: Outcome<'_>) {
        if let Outcome::ApiError(code) = outcome {
            *self.api_errors.entry((api, code.to_owned())).or_default() += 1;
        }
        let latency = self
            .latency
            .entry(LatencyKey {
                api,
                error: outcome != Outcome::Ok,
                status: outcome.status(),
            })
            .or_default();
        latency.count += 1;
        // Whole milliseconds, as aws-node measures them.
        latency.sum_ms += u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
    }

    pub fn del_request(&mut self, reason: &str) {
        let reason: String = reason.chars().take(MAX_REASON_LEN).collect();
        *self.del_requests.entry(reason).or_default() += 1;
    }
}

static RECORDED: Mutex<Recorded> = Mutex::new(Recorded::new());

fn recorded() -> MutexGuard<'static, Recorded> {
    RECORDED.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A copy of what is recorded, for a scrape.
#[must_use]
pub fn snapshot() -> Recorded {
    recorded().clone()
}

/// Records an EC2 call (see [`Recorded::ec2_call`]).
pub fn ec2_call(api: &'static str, elapsed: Duration, outcome: Outcome<'_>) {
    recorded().ec2_call(api, elapsed, outcome);
}

/// Records an IMDS read (latency only, as aws-node records it).
pub fn imds_call(elapsed: Duration, outcome: Outcome<'_>) {
    recorded().aws_call(IMDS_API, elapsed, outcome);
}

/// A DEL request the CNI backend served, by the plugin's reason.
pub fn del_request(reason: &str) {
    recorded().del_request(reason);
}

/// A failure on the way to branch ENIs (security groups for pods).
pub fn pod_eni_error(function: &'static str) {
    *recorded().pod_eni_errors.entry(function).or_default() += 1;
}

/// A Kubernetes API request was answered with `status`, or not at all.
pub fn kubernetes_answer(status: Option<u16>) {
    *recorded().kubernetes_answers.entry(status).or_default() += 1;
}

/// The address manager's start took `elapsed` and ended as `success` says.
pub fn node_initialized(success: bool, elapsed: Duration) {
    recorded()
        .node_init
        .entry(success)
        .or_default()
        .observe(elapsed.as_secs_f64());
}

/// The agent serves CNI requests: the time since the process started.
/// `with_api_server`: it has a Kubernetes API client.
pub fn started(with_api_server: bool) {
    let Some(age) = process_age() else {
        return;
    };
    recorded()
        .startup
        .entry(StartupKey {
            success: true,
            with_api_server,
            failure_reason: "",
        })
        .or_default()
        .observe(age.as_secs_f64());
}

/// Marks `action` under way until the guard drops.
#[must_use = "the action ends when the guard drops"]
pub fn action(action: &'static str) -> ActionGuard {
    *recorded().actions.entry(action).or_default() += 1;
    ActionGuard(action)
}

/// An action under way (see [`action`]).
#[derive(Debug)]
pub struct ActionGuard(&'static str);

impl Drop for ActionGuard {
    fn drop(&mut self) {
        if let Some(n) = recorded().actions.get_mut(self.0) {
            *n = n.saturating_sub(1);
        }
    }
}

/// How long this process has run: its start time in `/proc/self/stat`
/// (clock ticks since boot) against `/proc/uptime`.
fn process_age() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let uptime = std::fs::read_to_string("/proc/uptime").ok()?;
    // The command name may hold spaces: fields count from its closing ')'.
    let after_name = stat.rsplit_once(')')?.1;
    // Field 22 (starttime) is the 20th after the name.
    let start_ticks: f64 = after_name.split_whitespace().nth(19)?.parse().ok()?;
    let uptime: f64 = uptime.split_whitespace().next()?.parse().ok()?;
    // SAFETY: sysconf reads a constant of the system; no memory is shared.
    let ticks_per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks_per_second <= 0 {
        return None;
    }
    #[allow(clippy::cast_precision_loss)] // ticks per second: 100
    let age = uptime - start_ticks / ticks_per_second as f64;
    Duration::try_from_secs_f64(age.max(0.0)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ec2_calls_by_name_error_and_code() {
        let mut r = Recorded::new();
        r.ec2_call(
            "AssignPrivateIpAddresses",
            Duration::from_millis(12),
            Outcome::Ok,
        );
        r.ec2_call(
            "AssignPrivateIpAddresses",
            Duration::from_millis(30),
            Outcome::ApiError("RequestLimitExceeded"),
        );
        r.ec2_call(
            "CreateTags",
            Duration::from_micros(1500),
            Outcome::OtherError { status: None },
        );
        assert_eq!(r.ec2_requests["AssignPrivateIpAddresses"], 2);
        assert_eq!(r.ec2_errors["AssignPrivateIpAddresses"], 1);
        assert_eq!(r.ec2_errors["CreateTags"], 1);
        assert_eq!(
            r.api_errors,
            BTreeMap::from([(
                (
                    "AssignPrivateIpAddresses",
                    "RequestLimitExceeded".to_owned()
                ),
                1
            )])
        );
        let key = |api, error, status: &str| LatencyKey {
            api,
            error,
            status: status.to_owned(),
        };
        assert_eq!(
            r.latency[&key("AssignPrivateIpAddresses", false, "200")],
            Latency {
                count: 1,
                sum_ms: 12
            }
        );
        assert_eq!(
            r.latency[&key("AssignPrivateIpAddresses", true, "RequestLimitExceeded")],
            Latency {
                count: 1,
                sum_ms: 30
            }
        );
        assert_eq!(r.latency[&key("CreateTags", true, "")].sum_ms, 1);
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::default();
        h.observe(0.003);
        h.observe(0.7);
        h.observe(30.0);
        assert_eq!(h.buckets, [1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2]);
        assert_eq!(h.count, 3);
        assert!((h.sum - 30.703).abs() < 1e-9);
    }

    #[test]
    fn actions_count_while_their_guards_live() {
        let name = "testAction";
        let first = action(name);
        let second = action(name);
        assert_eq!(snapshot().actions[name], 2);
        drop(first);
        assert_eq!(snapshot().actions[name], 1);
        drop(second);
        assert_eq!(snapshot().actions[name], 0);
    }

    #[test]
    fn del_reasons_are_kept_short() {
        let mut r = Recorded::new();
        r.del_request("PodDeleted");
        r.del_request(&"x".repeat(1000));
        assert_eq!(r.del_requests["PodDeleted"], 1);
        assert!(r.del_requests.keys().all(|k| k.len() <= MAX_REASON_LEN));
    }

    #[test]
    fn this_process_has_an_age() {
        let age = process_age().expect("an age");
        assert!(age < Duration::from_hours(24), "{age:?}");
    }
}
