//! The process environment, read as aws-node reads it. A copied aws-node
//! `ConfigMap` must start vpcnet as it starts aws-node: where aws-node
//! falls back to a default on a value it cannot read (`WARM_ENI_TARGET=-1`,
//! an IPv6 item in a CIDR list, an unknown `RANDOMIZESNAT`), vpcnet does
//! the same and says so once at start; where aws-node stops, vpcnet stops.
//! Each module declares the variables it reads and reads them through
//! [`Env`] and the parsers here; this module imports nothing of the crate's
//! (`crate::settings` lists every variable and aws-node's table).

use std::{cell::RefCell, collections::BTreeMap, fmt};

use ipnet::{IpNet, Ipv4Net};

/// A value of one of vpcnet's own variables it cannot use: the agent stops,
/// naming the variable and what it accepts.
#[derive(Debug, thiserror::Error)]
#[error("{variable}={value:?} is invalid: {allowed}")]
pub struct ConfigError {
    pub variable: &'static str,
    pub value: String,
    pub allowed: &'static str,
}

/// A value aws-node tolerates and vpcnet took its way: the variable, the
/// value as set, and what is used instead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tolerated {
    pub variable: &'static str,
    pub value: String,
    pub used: String,
    /// Why the value could not be used as set.
    pub why: &'static str,
}

impl fmt::Display for Tolerated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}={:?}: {}; using {}, as aws-node does",
            self.variable, self.value, self.why, self.used
        )
    }
}

/// Variables by name, and the values tolerated while reading them.
pub struct Env {
    vars: BTreeMap<String, String>,
    tolerated: RefCell<Vec<Tolerated>>,
}

impl Env {
    /// The process environment.
    #[must_use]
    pub fn from_process() -> Self {
        Self::from_pairs(std::env::vars())
    }

    /// Variables given as pairs (a `ConfigMap`'s data, a test's).
    pub fn from_pairs<K: Into<String>, V: Into<String>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        Self {
            vars: pairs
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
            tolerated: RefCell::default(),
        }
    }

    /// The value as set, empty or not.
    #[must_use]
    pub fn raw(&self, name: &str) -> Option<&str> {
        self.vars.get(name).map(String::as_str)
    }

    /// The value, if set and not blank (aws-node's manifests often leave
    /// variables empty, which it reads as unset).
    #[must_use]
    pub fn get(&self, name: &str) -> Option<&str> {
        self.raw(name).filter(|v| !v.trim().is_empty())
    }

    /// Records that `variable`'s `value` is not used as set; once, however
    /// often it is read.
    pub fn tolerate(
        &self,
        variable: &'static str,
        value: &str,
        why: &'static str,
        used: impl fmt::Display,
    ) {
        let tolerated = Tolerated {
            variable,
            value: value.to_owned(),
            used: used.to_string(),
            why,
        };
        let mut all = self.tolerated.borrow_mut();
        if !all.contains(&tolerated) {
            all.push(tolerated);
        }
    }

    /// What was tolerated so far, in the order it was read.
    #[must_use]
    pub fn tolerated(&self) -> Vec<Tolerated> {
        self.tolerated.borrow().clone()
    }

    /// A boolean as Go's `strconv.ParseBool` reads it; unset or blank:
    /// `default`; anything else: `default`, tolerated.
    pub fn bool_or(&self, name: &'static str, default: bool) -> bool {
        let Some(value) = self.get(name) else {
            return default;
        };
        parse_go_bool(value).unwrap_or_else(|| {
            self.tolerate(name, value, "not a boolean", default);
            default
        })
    }

    /// A count aws-node reads with `strconv.Atoi` and takes only when 0 or
    /// more; unset: `default`; not a whole number or negative: `default`,
    /// tolerated.
    pub fn count_or(&self, name: &'static str, default: usize) -> usize {
        let Some(value) = self.get(name) else {
            return default;
        };
        match value.trim().parse::<i64>() {
            Ok(n) if n >= 0 => usize::try_from(n).unwrap_or(usize::MAX),
            Ok(_) => {
                self.tolerate(name, value, "negative", default);
                default
            }
            Err(_) => {
                self.tolerate(name, value, "not a whole number", default);
                default
            }
        }
    }

    /// aws-node's CIDR lists: each item an IPv4 CIDR; an invalid or IPv6
    /// item is left out, tolerated.
    pub fn lenient_cidrs(&self, variable: &'static str) -> Vec<Ipv4Net> {
        let Some(value) = self.get(variable) else {
            return Vec::new();
        };
        let mut cidrs = Vec::new();
        for item in value.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            match item.parse::<IpNet>() {
                Ok(IpNet::V4(net)) => cidrs.push(net.trunc()),
                Ok(IpNet::V6(_)) => {
                    self.tolerate(variable, item, "an IPv6 CIDR", "the list without it");
                }
                Err(_) => self.tolerate(variable, item, "not a CIDR", "the list without it"),
            }
        }
        cidrs
    }
}

/// A comma-separated list of IPv4 CIDRs (spaces allowed, empty items skipped).
pub fn parse_cidrs(variable: &'static str, value: &str) -> Result<Vec<Ipv4Net>, ConfigError> {
    value
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| {
            item.parse::<Ipv4Net>()
                .map(|net| net.trunc())
                .map_err(|_| ConfigError {
                    variable,
                    value: value.to_owned(),
                    allowed: "a comma-separated list of IPv4 CIDRs such as 10.0.0.0/8,192.168.0.0/16",
                })
        })
        .collect()
}

/// Go's `strconv.ParseInt(v, 0, 64)`: decimal, `0x` hex, `0o` or leading-0
/// octal, `0b` binary, `_` between digits, an optional sign.
pub(crate) fn go_int(value: &str) -> Option<i64> {
    let (negative, digits) = match value.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, value.strip_prefix('+').unwrap_or(value)),
    };
    let lower = digits.to_ascii_lowercase();
    let (radix, body) = if let Some(hex) = lower.strip_prefix("0x") {
        (16, hex)
    } else if let Some(octal) = lower.strip_prefix("0o") {
        (8, octal)
    } else if let Some(binary) = lower.strip_prefix("0b") {
        (2, binary)
    } else if lower.len() > 1 && lower.starts_with('0') {
        (8, &lower[1..])
    } else {
        (10, lower.as_str())
    };
    // Underscores only between digits (and after a base prefix).
    if body.is_empty() || body.ends_with('_') || body.contains("__") {
        return None;
    }
    if body.starts_with('_') && radix == 10 {
        return None;
    }
    let magnitude = i64::from_str_radix(&body.replace('_', ""), radix).ok()?;
    Some(if negative { -magnitude } else { magnitude })
}

/// Go's `strconv.ParseBool`.
pub(crate) fn parse_go_bool(value: &str) -> Option<bool> {
    match value {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn booleans_read_as_go_reads_them_and_the_rest_fall_back() {
        let env = Env::from_pairs([("A", "True"), ("B", "0"), ("C", "yes"), ("D", " ")]);
        assert!(env.bool_or("A", false));
        assert!(!env.bool_or("B", true));
        assert!(env.bool_or("C", true));
        assert!(!env.bool_or("D", false));
        assert!(env.bool_or("UNSET", true));
        assert!(env.bool_or("C", true), "read twice, said once");
        let tolerated = env.tolerated();
        assert_eq!(tolerated.len(), 1, "{tolerated:?}");
        assert_eq!(
            tolerated[0].to_string(),
            r#"C="yes": not a boolean; using true, as aws-node does"#
        );
    }

    #[test]
    fn counts_below_zero_or_unreadable_take_the_default() {
        let env = Env::from_pairs([("A", "-1"), ("B", "five"), ("C", " 3 ")]);
        assert_eq!(env.count_or("A", 1), 1);
        assert_eq!(env.count_or("B", 0), 0);
        assert_eq!(env.count_or("C", 0), 3);
        let whys: Vec<_> = env.tolerated().iter().map(|t| t.why).collect();
        assert_eq!(whys, ["negative", "not a whole number"]);
    }
}
