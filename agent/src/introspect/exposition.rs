//! Prometheus' text exposition format, version 0.0.4, written by hand: one
//! `# HELP` and one `# TYPE` line per metric family, then its samples, with
//! the format's escaping (`\\` and `\n` in help text; `\\`, `\"` and `\n` in
//! label values).

use std::{collections::BTreeSet, fmt::Write};

/// The `Content-Type` of the format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A family's type. Every value here is a whole number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricType {
    /// Only goes up (restarts from zero with the process or the maps).
    Counter,
    /// Goes up and down.
    Gauge,
}

impl MetricType {
    fn as_str(self) -> &'static str {
        match self {
            Self::Counter => "counter",
            Self::Gauge => "gauge",
        }
    }
}

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
        debug_assert!(valid_metric_name(name), "metric name {name:?}");
        let mut samples = samples.into_iter().peekable();
        if samples.peek().is_none() {
            return;
        }
        if !self.families.insert(name.to_owned()) {
            debug_assert!(false, "metric family {name} written twice");
            return;
        }
        let out = &mut self.out;
        let _ = writeln!(out, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(out, "# TYPE {name} {}", kind.as_str());
        for (labels, value) in samples {
            out.push_str(name);
            if !labels.is_empty() {
                out.push('{');
                for (i, (label, label_value)) in labels.iter().enumerate() {
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
    }

    /// The text, ready to serve.
    #[must_use]
    pub fn finish(self) -> String {
        self.out
    }
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
    fn empty_families_are_left_out() {
        let mut e = Exposition::new();
        e.family("nothing", MetricType::Gauge, "No samples.", []);
        assert_eq!(e.finish(), "");
    }
}
