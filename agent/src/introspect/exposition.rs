//! Prometheus' text exposition format, version 0.0.4, written by hand: one
//! `# HELP` and one `# TYPE` line per metric family, then its samples, with
//! the format's escaping (`\\` and `\n` in help text; `\\`, `\"` and `\n` in
//! label values).

use std::{collections::BTreeSet, fmt::Write};

/// The `Content-Type` of the format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A family's type. Counters and gauges are whole numbers; histograms and
/// summaries have a float sum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricType {
    /// Only goes up (restarts from zero with the process or the maps).
    Counter,
    /// Goes up and down.
    Gauge,
    /// Observations in buckets: `_bucket{le}`, `_sum`, `_count`.
    Histogram,
    /// Observations without quantiles: `_sum`, `_count`.
    Summary,
}

impl MetricType {
    fn as_str(self) -> &'static str {
        match self {
            Self::Counter => "counter",
            Self::Gauge => "gauge",
            Self::Histogram => "histogram",
            Self::Summary => "summary",
        }
    }
}

/// One series of a histogram: its labels, the observations at or below
/// each bound (cumulative), their count and sum.
pub type HistogramSample<'a> = (Vec<(&'static str, String)>, &'a [u64], u64, f64);

/// One sample: its labels (name, value) and its value.
pub type Sample = (Vec<(&'static str, String)>, u64);

/// A scrape being written.
#[derive(Debug, Default)]
pub struct Exposition {
    out: String,
    families: BTreeSet<String>,
}

impl Exposition {
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// A family of one unlabelled sample.
    pub fn single(&mut self, name: &str, kind: MetricType, help: &str, value: u64) {
        self.family(name, kind, help, [(Vec::new(), value)]);
    }

    /// A family and its samples. A family without samples is left out, and
    /// each name is written once (a second family of the same name is a bug
    /// of the caller: debug builds panic, release builds drop it).
    pub fn family(
        &mut self,
        name: &str,
        kind: MetricType,
        help: &str,
        samples: impl IntoIterator<Item = Sample>,
    ) {
        debug_assert!(
            matches!(kind, MetricType::Counter | MetricType::Gauge),
            "{name}: histograms and summaries have their own writers"
        );
        let mut samples = samples.into_iter().peekable();
        if samples.peek().is_none() || !self.begin(name, kind, help) {
            return;
        }
        for (labels, value) in samples {
            self.sample(name, &labels, None, value);
        }
    }

    /// A histogram family over `bounds` (seconds, say); `+Inf` is added.
    pub fn histogram<'a>(
        &mut self,
        name: &str,
        help: &str,
        bounds: &[f64],
        series: impl IntoIterator<Item = HistogramSample<'a>>,
    ) {
        let mut series = series.into_iter().peekable();
        if series.peek().is_none() || !self.begin(name, MetricType::Histogram, help) {
            return;
        }
        let bucket = format!("{name}_bucket");
        for (labels, buckets, count, sum) in series {
            debug_assert_eq!(buckets.len(), bounds.len(), "{name}: one count per bound");
            for (bound, n) in bounds.iter().zip(buckets) {
                self.sample(&bucket, &labels, Some(("le", &float(*bound))), n);
            }
            self.sample(&bucket, &labels, Some(("le", "+Inf")), count);
            self.sample(&format!("{name}_sum"), &labels, None, float(sum));
            self.sample(&format!("{name}_count"), &labels, None, count);
        }
    }

    /// A summary family without quantiles (aws-node's latency summaries
    /// have none): per series its labels, count and sum.
    pub fn summary(
        &mut self,
        name: &str,
        help: &str,
        series: impl IntoIterator<Item = (Vec<(&'static str, String)>, u64, f64)>,
    ) {
        let mut series = series.into_iter().peekable();
        if series.peek().is_none() || !self.begin(name, MetricType::Summary, help) {
            return;
        }
        for (labels, count, sum) in series {
            self.sample(&format!("{name}_sum"), &labels, None, float(sum));
            self.sample(&format!("{name}_count"), &labels, None, count);
        }
    }

    /// `# HELP` and `# TYPE` of a family not written yet; `false`: written
    /// already (a bug of the caller: debug builds panic, release builds
    /// drop the second).
    fn begin(&mut self, name: &str, kind: MetricType, help: &str) -> bool {
        debug_assert!(valid_metric_name(name), "metric name {name:?}");
        if !self.families.insert(name.to_owned()) {
            debug_assert!(false, "metric family {name} written twice");
            return false;
        }
        let _ = writeln!(self.out, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.out, "# TYPE {name} {}", kind.as_str());
        true
    }

    /// One sample line; `extra`: a label after `labels` (a bucket's `le`).
    fn sample(
        &mut self,
        name: &str,
        labels: &[(&'static str, String)],
        extra: Option<(&'static str, &str)>,
        value: impl std::fmt::Display,
    ) {
        let out = &mut self.out;
        out.push_str(name);
        if !labels.is_empty() || extra.is_some() {
            out.push('{');
            let labels = labels.iter().map(|(label, value)| (*label, value.as_str()));
            for (i, (label, label_value)) in labels.chain(extra).enumerate() {
                debug_assert!(valid_label_name(label), "label name {label:?}");
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{label}=\"{}\"", escape_label_value(label_value));
            }
            out.push('}');
        }
        let _ = writeln!(out, " {value}");
    }

    /// The text, ready to serve.
    #[must_use]
    pub fn finish(self) -> String {
        self.out
    }
}

/// A float as the format has it: `1`, `0.25`, `+Inf`.
#[must_use]
pub fn float(value: f64) -> String {
    if value.is_infinite() {
        return if value > 0.0 { "+Inf" } else { "-Inf" }.to_owned();
    }
    format!("{value}")
}

/// `[a-zA-Z_:][a-zA-Z0-9_:]*`
#[must_use]
pub fn valid_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// `[a-zA-Z_][a-zA-Z0-9_]*`, and not starting with `__` (reserved).
#[must_use]
pub fn valid_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    !name.starts_with("__")
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Help text: backslash and line feed escaped.
#[must_use]
pub fn escape_help(text: &str) -> String {
    text.replace('\\', r"\\").replace('\n', r"\n")
}

/// A label value: backslash, double quote and line feed escaped.
#[must_use]
pub fn escape_label_value(text: &str) -> String {
    text.replace('\\', r"\\")
        .replace('"', r#"\""#)
        .replace('\n', r"\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_type_then_samples() {
        let mut e = Exposition::new();
        e.single("up_things", MetricType::Gauge, "Things that are up.", 3);
        e.family(
            "events_total",
            MetricType::Counter,
            "Events, by kind.",
            [
                (vec![("kind", "a".to_owned())], 1),
                (vec![("kind", "b".to_owned()), ("zone", "z".to_owned())], 2),
            ],
        );
        assert_eq!(
            e.finish(),
            "# HELP up_things Things that are up.\n\
             # TYPE up_things gauge\n\
             up_things 3\n\
             # HELP events_total Events, by kind.\n\
             # TYPE events_total counter\n\
             events_total{kind=\"a\"} 1\n\
             events_total{kind=\"b\",zone=\"z\"} 2\n"
        );
    }

    #[test]
    fn escaping() {
        assert_eq!(escape_help("a\\b\nc \"q\""), r#"a\\b\nc "q""#);
        assert_eq!(escape_label_value("a\\b\nc \"q\""), r#"a\\b\nc \"q\""#);
        let mut e = Exposition::new();
        e.family(
            "x",
            MetricType::Gauge,
            "line one\nline two \\ end",
            [(vec![("v", "say \"hi\"\n".to_owned())], 1)],
        );
        assert_eq!(
            e.finish(),
            "# HELP x line one\\nline two \\\\ end\n# TYPE x gauge\nx{v=\"say \\\"hi\\\"\\n\"} 1\n"
        );
    }

    #[test]
    fn names() {
        for good in ["a", "awscni_eni_max", "_x", "ns:sub_total", "A9"] {
            assert!(valid_metric_name(good), "{good}");
        }
        for bad in ["", "9a", "a-b", "a b", "é"] {
            assert!(!valid_metric_name(bad), "{bad}");
        }
        for good in ["reason", "_r", "r2"] {
            assert!(valid_label_name(good), "{good}");
        }
        for bad in ["", "__name__", "a:b", "2r", "a-b"] {
            assert!(!valid_label_name(bad), "{bad}");
        }
    }

    #[test]
    fn histograms_and_summaries() {
        let mut e = Exposition::new();
        e.histogram(
            "start_seconds",
            "Starts.",
            &[0.5, 1.0],
            [(vec![("ok", "true".to_owned())], &[0, 1][..], 2, 3.75)],
        );
        e.summary(
            "call_ms",
            "Calls.",
            [(vec![("api", "A".to_owned())], 4, 25.0)],
        );
        assert_eq!(
            e.finish(),
            "# HELP start_seconds Starts.\n\
             # TYPE start_seconds histogram\n\
             start_seconds_bucket{ok=\"true\",le=\"0.5\"} 0\n\
             start_seconds_bucket{ok=\"true\",le=\"1\"} 1\n\
             start_seconds_bucket{ok=\"true\",le=\"+Inf\"} 2\n\
             start_seconds_sum{ok=\"true\"} 3.75\n\
             start_seconds_count{ok=\"true\"} 2\n\
             # HELP call_ms Calls.\n\
             # TYPE call_ms summary\n\
             call_ms_sum{api=\"A\"} 25\n\
             call_ms_count{api=\"A\"} 4\n"
        );
        assert_eq!(float(0.005), "0.005");
        assert_eq!(float(f64::INFINITY), "+Inf");
    }

    #[test]
    fn empty_families_are_left_out() {
        let mut e = Exposition::new();
        e.family("nothing", MetricType::Gauge, "No samples.", []);
        assert_eq!(e.finish(), "");
    }
}
