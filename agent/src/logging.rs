//! Where the agent's log goes, how much of it and in what form: aws-node's
//! variables (`AWS_VPC_K8S_CNI_LOGLEVEL`, `AWS_VPC_K8S_CNI_LOG_FILE`, a
//! file rotated as aws-node rotates its own) for the running agent;
//! `RUST_LOG`, when set, over the level; `VPCNET_LOG_FORMAT=json` for
//! aws-node's JSON lines. The operator's commands (`nat`, `config`, ...)
//! log to standard error whatever the file says: they must not write into
//! the running agent's log.

use std::{fmt, sync::Mutex};

use serde_json::Value;
use tracing::{Event, Subscriber, field::Field};
use tracing_subscriber::{
    EnvFilter,
    fmt::{FmtContext, FormatEvent, FormatFields, format::Writer},
    registry::LookupSpan,
};
use vpcnet_api::log_files;

use crate::env::Env;

pub const ENV_LOG_LEVEL: &str = "AWS_VPC_K8S_CNI_LOGLEVEL";
/// A file, `stdout` or `stderr`; unset: standard error (`kubectl logs`).
pub const ENV_LOG_FILE: &str = "AWS_VPC_K8S_CNI_LOG_FILE";

/// `text` (the default: tracing's lines) or `json` (aws-node's fields:
/// `level`, `ts`, `caller`, `msg`, then the event's own).
pub const ENV_LOG_FORMAT: &str = "VPCNET_LOG_FORMAT";

/// The level when neither variable says.
pub const DEFAULT_LEVEL: &str = "info";

/// How each line is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    /// One JSON object per line, as aws-node's zap encoder writes them.
    Json,
}

/// The agent's log format; unknown: text, tolerated.
pub fn format(env: &Env) -> LogFormat {
    match env.get(ENV_LOG_FORMAT).map(str::trim) {
        None => LogFormat::Text,
        Some(v) if v.eq_ignore_ascii_case("text") => LogFormat::Text,
        Some(v) if v.eq_ignore_ascii_case("json") => LogFormat::Json,
        Some(v) => {
            env.tolerate(ENV_LOG_FORMAT, v, "not text or json", "text");
            LogFormat::Text
        }
    }
}

/// Where the log goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogTarget {
    Stderr,
    Stdout,
    File(std::path::PathBuf),
}

/// The agent's level, as a tracing directive ([`aws_node_level`]).
pub fn level(env: &Env) -> Option<&'static str> {
    aws_node_level(env, ENV_LOG_LEVEL)
}

/// A level as aws-node reads one (the agent's, the plugin's): debug, info,
/// warn, error or fatal in any case, fatal being error here (nothing is
/// above it); unset: `None`; unknown: debug, as aws-node, tolerated.
pub fn aws_node_level(env: &Env, variable: &'static str) -> Option<&'static str> {
    let value = env.get(variable)?;
    Some(match value.trim().to_ascii_lowercase().as_str() {
        "debug" => "debug",
        "info" => "info",
        "warn" => "warn",
        "error" | "fatal" => "error",
        _ => {
            env.tolerate(
                variable,
                value,
                "not debug, info, warn, error or fatal",
                "debug",
            );
            "debug"
        }
    })
}

/// Where the running agent logs.
pub fn target(env: &Env) -> LogTarget {
    match env.get(ENV_LOG_FILE).map(str::trim) {
        None => LogTarget::Stderr,
        Some(stream) if stream.eq_ignore_ascii_case("stderr") => LogTarget::Stderr,
        Some(stream) if stream.eq_ignore_ascii_case("stdout") => LogTarget::Stdout,
        Some(file) => LogTarget::File(file.into()),
    }
}

/// Starts logging: the running agent (`agent`) where and as `env` says,
/// any other command to standard error as text. A log file that cannot be
/// opened leaves the log on standard error, tolerated (said once logging
/// runs).
pub fn init(env: &Env, agent: bool) {
    let filter = || {
        EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| EnvFilter::new(level(env).unwrap_or(DEFAULT_LEVEL)))
    };
    let (target, json) = if agent {
        (target(env), format(env) == LogFormat::Json)
    } else {
        (LogTarget::Stderr, false)
    };
    // One builder per writer and format: each is its own type.
    macro_rules! install {
        ($writer:expr, $ansi:expr) => {{
            let builder = tracing_subscriber::fmt()
                .with_env_filter(filter())
                .with_writer($writer)
                .with_ansi($ansi && !json);
            if json {
                builder.event_format(AwsNodeJson).init();
            } else {
                builder.init();
            }
        }};
    }
    // Colours only for a person at a terminal, not in log files.
    let stderr_tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    match target {
        LogTarget::File(path) => match log_files::open(&path) {
            Ok(file) => install!(Mutex::new(file), false),
            Err(e) => {
                env.tolerate(
                    ENV_LOG_FILE,
                    &path.display().to_string(),
                    "cannot be opened",
                    format_args!("standard error ({e})"),
                );
                install!(std::io::stderr, stderr_tty);
            }
        },
        LogTarget::Stdout => install!(
            std::io::stdout,
            std::io::IsTerminal::is_terminal(&std::io::stdout())
        ),
        LogTarget::Stderr => install!(std::io::stderr, stderr_tty),
    }
}

/// aws-node's JSON lines (zap's production encoder, ISO 8601 times):
/// `level`, `ts`, `caller` (`file:line`), `msg`, then the event's fields.
struct AwsNodeJson;

impl<S, N> FormatEvent<S, N> for AwsNodeJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        writeln!(writer, "{}", json_line(event, &jiff::Timestamp::now()))
    }
}

/// `event` as aws-node's JSON object, at `now`: its fields in zap's
/// order, then the event's own.
fn json_line(event: &Event<'_>, now: &jiff::Timestamp) -> String {
    let meta = event.metadata();
    let mut fields = JsonFields::default();
    event.record(&mut fields);
    let caller = match (meta.file(), meta.line()) {
        (Some(file), Some(line)) => format!("{file}:{line}"),
        _ => meta.target().to_owned(),
    };
    let head: [(&str, Value); 4] = [
        ("level", meta.level().as_str().to_ascii_lowercase().into()),
        (
            "ts",
            now.strftime("%Y-%m-%dT%H:%M:%S%.3fZ").to_string().into(),
        ),
        ("caller", caller.into()),
        ("msg", fields.message.into()),
    ];
    let members: Vec<String> = head
        .into_iter()
        .map(|(key, value)| (key.to_owned(), value))
        .chain(fields.others)
        .map(|(key, value)| format!("{}:{value}", Value::from(key)))
        .collect();
    format!("{{{}}}", members.join(","))
}

/// An event's message and its other fields, as JSON values, in the
/// order they were recorded.
#[derive(Default)]
struct JsonFields {
    message: String,
    others: Vec<(String, Value)>,
}

impl tracing::field::Visit for JsonFields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.record_value(field, format!("{value:?}").into());
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.record_value(field, value.into());
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.record_value(field, value.into());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.record_value(field, value.into());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.record_value(field, value.into());
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.record_value(field, value.into());
    }
}

impl JsonFields {
    fn record_value(&mut self, field: &Field, value: Value) {
        if field.name() == "message" {
            self.message = value
                .as_str()
                .map_or_else(|| value.to_string(), str::to_owned);
        } else {
            self.others.push((field.name().to_owned(), value));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn json_lines_carry_aws_nodes_fields_then_the_events_own() {
        let buffer = Arc::new(Mutex::new(Vec::<u8>::new()));
        let sink = Arc::clone(&buffer);
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || SharedBuffer(Arc::clone(&sink)))
            .event_format(AwsNodeJson)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(pods = 3, eni = "eni-0a1", "node taken over");
        });
        let text = String::from_utf8(buffer.lock().unwrap().clone()).unwrap();
        let line: Value = serde_json::from_str(text.trim()).unwrap();
        let keys: Vec<&str> = ["level", "ts", "caller", "msg", "pods", "eni"]
            .into_iter()
            .filter(|key| text.contains(&format!("\"{key}\":")))
            .collect();
        assert_eq!(keys.len(), 6, "{text}");
        let at = |key: &str| text.find(&format!("\"{key}\":")).unwrap();
        assert!(
            at("level") < at("ts") && at("ts") < at("caller") && at("caller") < at("msg"),
            "zap's order: {text}"
        );
        assert_eq!(line.as_object().unwrap().len(), 6, "{text}");
        assert_eq!(line["level"], "warn");
        assert_eq!(line["msg"], "node taken over");
        assert_eq!(
            (line["pods"].as_u64(), line["eni"].as_str()),
            (Some(3), Some("eni-0a1"))
        );
        assert!(
            line["caller"]
                .as_str()
                .unwrap()
                .starts_with("agent/src/logging.rs:")
        );
        let ts = line["ts"].as_str().unwrap();
        assert!(
            ts.parse::<jiff::Timestamp>().is_ok() && ts.ends_with('Z'),
            "{ts}"
        );
    }

    #[test]
    fn the_format_is_text_unless_json_is_asked() {
        let env = Env::from_pairs([(ENV_LOG_FORMAT, "JSON")]);
        assert_eq!(format(&env), LogFormat::Json);
        let env = Env::from_pairs([(ENV_LOG_FORMAT, "yaml")]);
        assert_eq!(format(&env), LogFormat::Text);
        assert_eq!(env.tolerated()[0].variable, ENV_LOG_FORMAT);
    }

    struct SharedBuffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for SharedBuffer {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn levels_and_targets_as_aws_node_reads_them() {
        let env = Env::from_pairs([(ENV_LOG_LEVEL, "DEBUG"), (ENV_LOG_FILE, "STDOUT")]);
        assert_eq!(level(&env), Some("debug"));
        assert_eq!(target(&env), LogTarget::Stdout);
        let env = Env::from_pairs([
            (ENV_LOG_LEVEL, "verbose"),
            (ENV_LOG_FILE, "/host/var/log/aws-routed-eni/ipamd.log"),
        ]);
        assert_eq!(level(&env), Some("debug"));
        assert_eq!(
            target(&env),
            LogTarget::File("/host/var/log/aws-routed-eni/ipamd.log".into())
        );
        assert_eq!(env.tolerated()[0].variable, ENV_LOG_LEVEL);
        let unset = Env::from_pairs(std::iter::empty::<(&str, &str)>());
        assert_eq!((level(&unset), target(&unset)), (None, LogTarget::Stderr));
    }
}
