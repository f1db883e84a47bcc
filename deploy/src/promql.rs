//! The metric names a Prometheus expression reads, and the expressions of a
//! Grafana dashboard: to check that alerts and panels look at metrics that
//! exist.

use std::collections::BTreeSet;

use serde_json::Value;

/// Words of the query language where a metric name could stand.
const KEYWORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "atan2",
    "inf",
    "nan",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];

/// Words followed by a list of label names in parentheses.
const LABEL_LISTS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// The metric names `expr` selects: every name that is not a function, a
/// keyword or a label name, with label matchers, ranges, strings, numbers
/// and Grafana's variables (`$pod`, `${pod}`, `$__rate_interval`) left out.
#[must_use]
pub fn metric_names(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = past_string(&chars, i);
        } else if c == '{' {
            i = past_group(&chars, i, '{', '}');
        } else if c == '[' {
            i = past_group(&chars, i, '[', ']');
        } else if c.is_ascii_digit() || c == '.' {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if c == '$' {
            i += 1;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || "_{}:".contains(chars[i]))
            {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || "_:".contains(chars[i])) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut next = i;
            while next < chars.len() && chars[next].is_whitespace() {
                next += 1;
            }
            let before_paren = chars.get(next) == Some(&'(');
            if LABEL_LISTS.contains(&word.as_str()) {
                if before_paren {
                    i = past_group(&chars, next, '(', ')');
                }
            } else if !before_paren && !KEYWORDS.contains(&word.as_str()) {
                names.insert(word);
            }
        } else {
            i += 1;
        }
    }
    names
}

/// The index after the string that starts at `start`.
fn past_string(chars: &[char], start: usize) -> usize {
    let quote = chars[start];
    let mut i = start + 1;
    while i < chars.len() {
        match chars[i] {
            '\\' if quote != '`' => i += 2,
            c if c == quote => return i + 1,
            _ => i += 1,
        }
    }
    i
}

/// The index after the group that `open` starts at `start` (strings in it
/// skipped).
fn past_group(chars: &[char], start: usize, open: char, close: char) -> usize {
    let mut depth = 0;
    let mut i = start;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = past_string(chars, i);
            continue;
        }
        if c == open {
            depth += 1;
        } else if c == close {
            depth -= 1;
            if depth == 0 {
                return i + 1;
            }
        }
        i += 1;
    }
    i
}

/// Every Prometheus expression of a Grafana dashboard: its panels' targets
/// (rows' panels included) and its query variables (the series of
/// `label_values(series, label)`).
#[must_use]
pub fn dashboard_exprs(dashboard: &Value) -> Vec<String> {
    let mut exprs = Vec::new();
    let mut panels: Vec<&Value> = dashboard["panels"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    while let Some(panel) = panels.pop() {
        panels.extend(panel["panels"].as_array().into_iter().flatten());
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                exprs.push(expr.to_owned());
            }
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if variable["type"] != "query" {
            continue;
        }
        let query = variable["query"]["query"]
            .as_str()
            .or_else(|| variable["query"].as_str())
            .unwrap_or_default();
        let series = query
            .strip_prefix("label_values(")
            .and_then(|args| args.rsplit_once(','))
            .map_or(query, |(series, _label)| series);
        exprs.push(series.to_owned());
    }
    exprs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(expr: &str) -> Vec<String> {
        metric_names(expr).into_iter().collect()
    }

    #[test]
    fn functions_keywords_labels_and_matchers_are_not_metric_names() {
        assert_eq!(
            names(
                r#"sum by (namespace, pod) (rate(vpcnet_datapath_drops_total{reason!~"a|b", pod=~"$pod"}[$__rate_interval])) > 1"#
            ),
            ["vpcnet_datapath_drops_total"]
        );
        assert_eq!(
            names(
                "(kube_pod_status_ready == 0) and on (pod) kube_pod_owner * on (pod) group_left (node) max without (uid) (kube_pod_info) offset 5m"
            ),
            ["kube_pod_info", "kube_pod_owner", "kube_pod_status_ready"]
        );
        assert_eq!(
            names("topk(10, a_total / b) or vector(0) > 1e3 and c group_left d"),
            ["a_total", "b", "c", "d"]
        );
        assert_eq!(names(r#"x{l="}{"} / ${var} + 0.5"#), ["x"]);
    }

    #[test]
    fn a_dashboard_gives_its_targets_and_the_series_of_its_variables() {
        let dashboard = serde_json::json!({
            "panels": [
                {"type": "row", "panels": [{"targets": [{"expr": "a"}]}]},
                {"targets": [{"expr": "b"}, {"refId": "C"}]}
            ],
            "templating": {"list": [
                {"type": "datasource", "query": "prometheus"},
                {"type": "query", "query": {"query": "label_values(c{ns=\"$ns\"}, pod)"}},
                {"type": "query", "query": "label_values(d, pod)"}
            ]}
        });
        let mut exprs = dashboard_exprs(&dashboard);
        exprs.sort();
        assert_eq!(exprs, ["a", "b", "c{ns=\"$ns\"}", "d"]);
    }
}
