//! What the process records as it happens, for the metrics to report: AWS
//! API calls (per call name, as aws-node's awsutils counts them), the
//! address manager's actions under way, DEL requests by reason, pod-ENI
//! errors, Kubernetes API answers, and how long the start took. One
//! recorder for the process, as aws-node has one Prometheus registry: the
//! cloud client, the address manager, the Kubernetes followers and the CNI
//! backend write to it; a scrape reads a copy, and each owner's `metrics`
//! module describes what it recorded. A leaf: it imports nothing from the
//! crate, so recording never pulls in introspection.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use prometheus::{
    Registry,
    core::{Collector, Desc},
    proto::{self, MetricFamily, MetricType},
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
pub const DURATION_BUCKETS: [f64; 11] = *prometheus::DEFAULT_BUCKETS;

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

/// The families one owner reports at a scrape, read from its snapshot:
/// a Prometheus [`Collector`] for a registry of the scrape. The registry
/// checks names, labels and help and refuses a name twice; its text encoder
/// writes names as given (`awscni_*_count` counters keep their names).
/// Families without samples are left out of the scrape by the registry.
#[derive(Default)]
pub struct Families {
    descs: Vec<Desc>,
    collected: Vec<MetricFamily>,
    /// The first name or label the registry's rules refuse.
    error: Option<prometheus::Error>,
}

impl Families {
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// A counter of one unlabelled sample.
    pub fn counter(&mut self, name: &str, help: &str, value: u64) -> &mut Self {
        self.counters(name, help, &[], [(Vec::new(), value)])
    }

    /// A gauge of one unlabelled sample.
    pub fn gauge(&mut self, name: &str, help: &str, value: u64) -> &mut Self {
        self.gauges(name, help, &[], [(Vec::new(), value)])
    }

    /// A counter family: per sample its label values (in `labels`' order)
    /// and its value.
    pub fn counters(
        &mut self,
        name: &str,
        help: &str,
        labels: &[&str],
        samples: impl IntoIterator<Item = (Vec<String>, u64)>,
    ) -> &mut Self {
        self.numbers(name, help, labels, MetricType::COUNTER, samples)
    }

    /// A gauge family, as [`Self::counters`].
    pub fn gauges(
        &mut self,
        name: &str,
        help: &str,
        labels: &[&str],
        samples: impl IntoIterator<Item = (Vec<String>, u64)>,
    ) -> &mut Self {
        self.numbers(name, help, labels, MetricType::GAUGE, samples)
    }

    /// Counters and gauges: whole numbers, exposed as the format's floats.
    fn numbers(
        &mut self,
        name: &str,
        help: &str,
        labels: &[&str],
        kind: MetricType,
        samples: impl IntoIterator<Item = (Vec<String>, u64)>,
    ) -> &mut Self {
        self.family(name, help, labels, kind, samples, |m, v| {
            #[allow(clippy::cast_precision_loss)] // exact up to 2^53
            let value = v as f64;
            if kind == MetricType::COUNTER {
                let mut counter = proto::Counter::default();
                counter.set_value(value);
                m.set_counter(counter);
            } else {
                let mut gauge = proto::Gauge::default();
                gauge.set_value(value);
                m.set_gauge(gauge);
            }
        })
    }

    /// A histogram family of [`DURATION_BUCKETS`] (the encoder adds `+Inf`).
    pub fn histograms<'a>(
        &mut self,
        name: &str,
        help: &str,
        labels: &[&str],
        series: impl IntoIterator<Item = (Vec<String>, &'a Histogram)>,
    ) -> &mut Self {
        self.family(name, help, labels, MetricType::HISTOGRAM, series, |m, h| {
            let mut histogram = proto::Histogram::default();
            histogram.set_sample_count(h.count);
            histogram.set_sample_sum(h.sum);
            histogram.set_bucket(
                DURATION_BUCKETS
                    .iter()
                    .zip(h.buckets)
                    .map(|(bound, n)| {
                        let mut bucket = proto::Bucket::default();
                        bucket.set_upper_bound(*bound);
                        bucket.set_cumulative_count(n);
                        bucket
                    })
                    .collect(),
            );
            m.set_histogram(histogram);
        })
    }

    /// A summary family without quantiles (aws-node's latency summaries
    /// have none): per series its label values, count and sum.
    pub fn summaries(
        &mut self,
        name: &str,
        help: &str,
        labels: &[&str],
        series: impl IntoIterator<Item = (Vec<String>, (u64, f64))>,
    ) -> &mut Self {
        self.family(
            name,
            help,
            labels,
            MetricType::SUMMARY,
            series,
            |m, (count, sum)| {
                let mut summary = proto::Summary::default();
                summary.set_sample_count(count);
                summary.set_sample_sum(sum);
                m.set_summary(summary);
            },
        )
    }

    fn family<T>(
        &mut self,
        name: &str,
        help: &str,
        labels: &[&str],
        kind: MetricType,
        samples: impl IntoIterator<Item = (Vec<String>, T)>,
        set: impl Fn(&mut proto::Metric, T),
    ) -> &mut Self {
        let variable = labels.iter().map(|l| (*l).to_owned()).collect();
        let desc = match Desc::new(name.to_owned(), help.to_owned(), variable, HashMap::new()) {
            Ok(desc) => desc,
            Err(e) => {
                self.error.get_or_insert(e);
                return self;
            }
        };
        let mut family = MetricFamily::default();
        family.set_name(name.to_owned());
        family.set_help(help.to_owned());
        family.set_field_type(kind);
        for (values, value) in samples {
            debug_assert_eq!(values.len(), labels.len(), "{name}: a value per label");
            let mut metric = proto::Metric::from_label(
                labels
                    .iter()
                    .zip(values)
                    .map(|(label, value)| {
                        let mut pair = proto::LabelPair::default();
                        pair.set_name((*label).to_owned());
                        pair.set_value(value);
                        pair
                    })
                    .collect(),
            );
            set(&mut metric, value);
            family.mut_metric().push(metric);
        }
        self.descs.push(desc);
        self.collected.push(family);
        self
    }

    /// Registers the families with a scrape's `registry`.
    ///
    /// # Errors
    /// A name, label or help the registry's rules refuse, or a name
    /// registered already.
    pub fn register(self, registry: &Registry) -> prometheus::Result<()> {
        if let Some(e) = self.error {
            return Err(e);
        }
        registry.register(Box::new(self))
    }
}

impl Collector for Families {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.collected.clone()
    }
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

    /// The text a registry of `families` writes.
    fn encoded(families: Families) -> String {
        let registry = Registry::new();
        families.register(&registry).expect("registered");
        prometheus::TextEncoder::new()
            .encode_to_string(&registry.gather())
            .expect("encoded")
    }

    #[test]
    fn help_type_then_samples() {
        let mut f = Families::new();
        f.gauge("up_things", "Things that are up.", 3).counters(
            "events_total",
            "Events, by kind.",
            &["kind", "zone"],
            [
                (vec!["a".to_owned(), "y".to_owned()], 1),
                (vec!["b".to_owned(), "z".to_owned()], 2),
            ],
        );
        // Families by name, as the registry sorts them.
        assert_eq!(
            encoded(f),
            "# HELP events_total Events, by kind.\n\
             # TYPE events_total counter\n\
             events_total{kind=\"a\",zone=\"y\"} 1\n\
             events_total{kind=\"b\",zone=\"z\"} 2\n\
             # HELP up_things Things that are up.\n\
             # TYPE up_things gauge\n\
             up_things 3\n"
        );
    }

    #[test]
    fn escaping() {
        let mut f = Families::new();
        f.gauges(
            "x",
            "line one\nline two \\ end",
            &["v"],
            [(vec!["say \"hi\"\n".to_owned()], 1)],
        );
        assert_eq!(
            encoded(f),
            "# HELP x line one\\nline two \\\\ end\n# TYPE x gauge\nx{v=\"say \\\"hi\\\"\\n\"} 1\n"
        );
    }

    #[test]
    fn histograms_and_summaries() {
        let mut h = Histogram::default();
        h.observe(0.7);
        h.observe(3.05);
        let mut f = Families::new();
        f.histograms(
            "start_seconds",
            "Starts.",
            &["ok"],
            [(vec!["true".to_owned()], &h)],
        )
        .summaries(
            "call_ms",
            "Calls.",
            &["api"],
            [(vec!["A".to_owned()], (4, 25.0))],
        );
        let text = encoded(f);
        assert!(
            text.starts_with(
                "# HELP call_ms Calls.\n\
                 # TYPE call_ms summary\n\
                 call_ms_sum{api=\"A\"} 25\n\
                 call_ms_count{api=\"A\"} 4\n\
                 # HELP start_seconds Starts.\n\
                 # TYPE start_seconds histogram\n\
                 start_seconds_bucket{ok=\"true\",le=\"0.005\"} 0\n"
            ),
            "{text}"
        );
        for line in [
            "start_seconds_bucket{ok=\"true\",le=\"0.5\"} 0\n",
            "start_seconds_bucket{ok=\"true\",le=\"1\"} 1\n",
            "start_seconds_bucket{ok=\"true\",le=\"5\"} 2\n",
            "start_seconds_bucket{ok=\"true\",le=\"+Inf\"} 2\n",
            "start_seconds_sum{ok=\"true\"} 3.75\n",
            "start_seconds_count{ok=\"true\"} 2\n",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }

    #[test]
    fn empty_families_are_left_out() {
        let mut f = Families::new();
        f.gauges("nothing", "No samples.", &["a"], []);
        assert_eq!(encoded(f), "");
    }

    #[test]
    fn names_the_registry_refuses() {
        let mut f = Families::new();
        f.gauge("a-b", "A bad name.", 1);
        assert!(f.register(&Registry::new()).is_err());
        let registry = Registry::new();
        let mut f = Families::new();
        f.gauge("twice", "Once.", 1);
        f.register(&registry).expect("registered");
        let mut f = Families::new();
        f.gauge("twice", "Twice.", 1);
        assert!(f.register(&registry).is_err(), "one name, one family");
    }
}
