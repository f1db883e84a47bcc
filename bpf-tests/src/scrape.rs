//! The agent's HTTP endpoints as a scraper sees them: a plain HTTP/1.1
//! GET from a namespace of the lab, and `/metrics` read strictly, as
//! Prometheus would, and checked by Prometheus' own `promtool`.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use vpcnet_lab::addrs::NS_NODE;

/// The agent's introspection endpoint, in the node (aws-node's port).
pub const INTROSPECTION: &str = "127.0.0.1:61679";
/// The agent's metrics endpoint, in the node (aws-node's port).
pub const METRICS: &str = "127.0.0.1:61678";

/// An answer: status, headers (lower-case names), body.
pub struct Answer {
    pub status: u16,
    pub headers: BTreeMap<String, String>,
    pub body: String,
}

/// `GET path` from `addr` with a plain HTTP/1.1 client written here (what
/// curl sends), from a thread in namespace `ns`.
pub fn get_in(ns: &str, addr: &str, path: &str) -> std::io::Result<Answer> {
    let addr: SocketAddr = addr.parse().expect("address:port");
    let path = path.to_owned();
    vpcnet_lab::run_in(ns, move || {
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: vpcnet-test\r\nAccept: */*\r\n\r\n"
        )?;
        // The server closes the connection after one answer.
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw)?;
        let text = String::from_utf8(raw).expect("UTF-8 answer");
        let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
        let mut lines = head.split("\r\n");
        let status_line = lines.next().expect("status line");
        let mut parts = status_line.splitn(3, ' ');
        assert_eq!(parts.next(), Some("HTTP/1.1"), "{status_line}");
        let status = parts.next().and_then(|s| s.parse().ok()).expect("status");
        let headers: BTreeMap<String, String> = lines
            .map(|l| {
                let (k, v) = l.split_once(':').expect("header");
                (k.trim().to_ascii_lowercase(), v.trim().to_owned())
            })
            .collect();
        assert_eq!(
            headers.get("content-length").map(String::as_str),
            Some(body.len().to_string().as_str()),
            "Content-Length of {path}"
        );
        Ok(Answer {
            status,
            headers,
            body: body.to_owned(),
        })
    })
    .expect("a thread in the namespace")
}

pub fn get(addr: &str, path: &str) -> Answer {
    get_in(NS_NODE, addr, path).unwrap_or_else(|e| panic!("GET {path} from {addr}: {e}"))
}

/// A scrape, read strictly: every family has `# HELP` then `# TYPE` before
/// its samples, names and label names are valid, label values quoted with
/// `\\`, `\"`, `\n` the only escapes, every value a number. Returns the
/// types by family and the samples (name, labels, value).
pub type Samples = Vec<(String, BTreeMap<String, String>, String)>;

pub fn parse_exposition(text: &str) -> (BTreeMap<String, String>, Samples) {
    let metric_name = |n: &str| {
        !n.is_empty()
            && !n.starts_with(|c: char| c.is_ascii_digit())
            && n.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    };
    let label_name = |n: &str| {
        !n.is_empty()
            && !n.starts_with(|c: char| c.is_ascii_digit())
            && !n.starts_with("__")
            && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    let mut help = BTreeSet::new();
    let mut types = BTreeMap::new();
    let mut samples = Vec::new();
    assert!(text.ends_with('\n'), "the last line ends with a line feed");
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, doc) = rest.split_once(' ').expect("HELP name doc");
            assert!(metric_name(name), "{line}");
            assert!(!doc.trim().is_empty(), "empty help: {line}");
            assert!(help.insert(name.to_owned()), "second HELP: {line}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE name type");
            assert!(help.contains(name), "TYPE before HELP: {line}");
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "{line}"
            );
            assert!(
                types.insert(name.to_owned(), kind.to_owned()).is_none(),
                "second TYPE: {line}"
            );
            continue;
        }
        assert!(!line.starts_with('#') && !line.is_empty(), "{line:?}");
        let (series, value) = line.rsplit_once(' ').expect("series value");
        assert!(value.parse::<f64>().is_ok(), "value: {line}");
        let (name, labels) = match series.split_once('{') {
            None => (series, BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').unwrap_or_else(|| panic!("{line}"));
                let mut labels = BTreeMap::new();
                let mut chars = body.chars().peekable();
                while chars.peek().is_some() {
                    let label: String = chars.by_ref().take_while(|c| *c != '=').collect();
                    assert!(label_name(&label), "label {label:?}: {line}");
                    assert_eq!(chars.next(), Some('"'), "{line}");
                    let mut value = String::new();
                    loop {
                        match chars
                            .next()
                            .unwrap_or_else(|| panic!("unterminated: {line}"))
                        {
                            '\\' => match chars.next() {
                                Some('\\') => value.push('\\'),
                                Some('"') => value.push('"'),
                                Some('n') => value.push('\n'),
                                other => panic!("escape {other:?}: {line}"),
                            },
                            '"' => break,
                            c => value.push(c),
                        }
                    }
                    assert!(labels.insert(label, value).is_none(), "{line}");
                    if chars.peek() == Some(&',') {
                        chars.next();
                    }
                }
                (name, labels)
            }
        };
        assert!(metric_name(name), "{line}");
        // A histogram's or a summary's samples carry a suffix.
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                name.strip_suffix(suffix).filter(|f| {
                    types
                        .get(*f)
                        .is_some_and(|k| k == "histogram" || k == "summary")
                })
            })
            .unwrap_or(name);
        assert!(types.contains_key(family), "sample before its TYPE: {line}");
        samples.push((name.to_owned(), labels, value.to_owned()));
    }
    (types, samples)
}

/// The sample `name{labels}`, a whole number.
pub fn sample(samples: &Samples, name: &str, labels: &[(&str, &str)]) -> u64 {
    sample_if(samples, name, labels).unwrap_or_else(|| panic!("no sample {name}{labels:?}"))
}

/// The sample `name{labels}` if the scrape has it, as it is written.
pub fn raw_sample<'a>(
    samples: &'a Samples,
    name: &str,
    labels: &[(&str, &str)],
) -> Option<&'a str> {
    samples
        .iter()
        .find(|(n, l, _)| {
            n == name
                && l.len() == labels.len()
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, _, value)| value.as_str())
}

/// The sample `name{labels}` if the scrape has it, a whole number.
pub fn sample_if(samples: &Samples, name: &str, labels: &[(&str, &str)]) -> Option<u64> {
    raw_sample(samples, name, labels).map(|value| {
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name}{labels:?} = {value}: not a count"))
    })
}

/// A scrape of /metrics, parsed.
pub fn scrape() -> (BTreeMap<String, String>, Samples) {
    let answer = get(METRICS, "/metrics");
    assert_eq!(answer.status, 200);
    parse_exposition(&answer.body)
}

/// Scrapes until `done` holds of a scrape (bounded), and returns it.
pub fn scrape_until(what: &str, timeout: Duration, done: impl Fn(&Samples) -> bool) -> Samples {
    let deadline = Instant::now() + timeout;
    loop {
        let (_, samples) = scrape();
        if done(&samples) {
            return samples;
        }
        assert!(Instant::now() < deadline, "{what}: not seen in {timeout:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// What `promtool check metrics` says of names the agent keeps as they are:
/// aws-node's (`awscni_*_count` counters, milliseconds) and vpcnet's own
/// released ones. Any other problem is a new metric's, to fix.
pub const KEPT_NAMES_LINTS: &[&str] = &[
    "counter metrics should have \"_total\" suffix",
    "non-histogram and non-summary metrics should not have \"_count\" suffix",
    "metric names should not contain abbreviated units",
    "use base unit \"seconds\" instead of \"microseconds\"",
];

/// `promtool check metrics` (Debian's `prometheus` package, which `cargo
/// xtask setup` installs) on a scrape: panics if the text does not parse
/// or promtool is missing; returns the lint problems, one per line (`name
/// problem`).
pub fn promtool_check(text: &str) -> Vec<String> {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run promtool ({e}): install Debian's prometheus package \
                 (cargo xtask setup does)"
            )
        });
    child
        .stdin
        .take()
        .expect("promtool's stdin")
        .write_all(text.as_bytes())
        .expect("writing the scrape to promtool");
    let output = child.wait_with_output().expect("promtool's answer");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    // 0: clean; 3: lint problems only; anything else (1): it does not parse.
    match output.status.code() {
        Some(0) => Vec::new(),
        Some(3) => said
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_owned)
            .collect(),
        _ => panic!(
            "promtool check metrics refused the scrape ({}):\n{said}",
            output.status
        ),
    }
}

/// [`promtool_check`] that allows only the problems of kept names
/// ([`KEPT_NAMES_LINTS`], on `awscni_*` or the listed vpcnet names).
pub fn promtool_check_kept_names(text: &str, kept: &[&str]) {
    let problems = promtool_check(text);
    let unexpected: Vec<&String> = problems
        .iter()
        .filter(|line| {
            let (name, problem) = line.split_once(' ').unwrap_or((line, ""));
            let kept_name = name.starts_with("awscni_") || kept.contains(&name);
            !(kept_name && KEPT_NAMES_LINTS.contains(&problem))
        })
        .collect();
    assert!(
        unexpected.is_empty(),
        "promtool check metrics: {unexpected:#?}"
    );
}
