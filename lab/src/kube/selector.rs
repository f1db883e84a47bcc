//! Label and field selectors, as list and watch requests carry them.
//!
//! Field selectors match any dotted path of the object (`metadata.name`,
//! `spec.nodeName`, ...); the real server allows a few per kind, and a
//! client that uses another one gets the lab's answer instead of a 400.

use serde_json::Value;

/// A parsed selector: every requirement must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    requirements: Vec<Requirement>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A selector that cannot be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unable to parse requirement {requirement:?}: {reason}")]
pub struct SelectorError {
    requirement: String,
    reason: &'static str,
}

/// Splits on commas outside parentheses.
fn split_requirements(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0_i32, 0);
    for (at, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
        .into_iter()
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect()
}

fn set_values(text: &str, requirement: &str) -> Result<Vec<String>, SelectorError> {
    let inner = text
        .trim()
        .strip_prefix('(')
        .and_then(|t| t.strip_suffix(')'))
        .ok_or(SelectorError {
            requirement: requirement.to_owned(),
            reason: "a set must be in parentheses",
        })?;
    Ok(inner
        .split(',')
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
        .collect())
}

impl Selector {
    /// A label selector (`a=b,c!=d,e,!f,g in (h,i),j notin (k)`).
    pub fn labels(text: &str) -> Result<Self, SelectorError> {
        Self::parse(text, true)
    }

    /// A field selector (`metadata.name=x,spec.nodeName!=y`).
    pub fn fields(text: &str) -> Result<Self, SelectorError> {
        Self::parse(text, false)
    }

    fn parse(text: &str, sets_allowed: bool) -> Result<Self, SelectorError> {
        let mut requirements = Vec::new();
        for part in split_requirements(text) {
            let bad = |reason| SelectorError {
                requirement: part.to_owned(),
                reason,
            };
            let requirement = if let Some((key, value)) = part.split_once("!=") {
                Requirement::NotEquals(key.trim().into(), value.trim().into())
            } else if let Some((key, value)) = part.split_once("==") {
                Requirement::Equals(key.trim().into(), value.trim().into())
            } else if let Some((key, value)) = part.split_once('=') {
                Requirement::Equals(key.trim().into(), value.trim().into())
            } else if let Some((key, values)) = part.split_once(" notin ").filter(|_| sets_allowed)
            {
                Requirement::NotIn(key.trim().into(), set_values(values, part)?)
            } else if let Some((key, values)) = part.split_once(" in ").filter(|_| sets_allowed) {
                Requirement::In(key.trim().into(), set_values(values, part)?)
            } else if let Some(key) = part.strip_prefix('!').filter(|_| sets_allowed) {
                Requirement::NotExists(key.trim().into())
            } else if sets_allowed && !part.contains(char::is_whitespace) {
                Requirement::Exists(part.into())
            } else {
                return Err(bad("expected key=value, key!=value or a set"));
            };
            requirements.push(requirement);
        }
        Ok(Self { requirements })
    }

    /// Whether an object with `lookup(key)` values matches.
    fn matches_with<'a>(&self, lookup: impl Fn(&str) -> Option<&'a str>) -> bool {
        self.requirements
            .iter()
            .all(|requirement| match requirement {
                Requirement::Equals(key, value) => lookup(key) == Some(value.as_str()),
                // As the real server: a missing label or field is "not equal".
                Requirement::NotEquals(key, value) => lookup(key) != Some(value.as_str()),
                Requirement::In(key, values) => {
                    lookup(key).is_some_and(|v| values.iter().any(|x| x == v))
                }
                Requirement::NotIn(key, values) => {
                    lookup(key).is_none_or(|v| !values.iter().any(|x| x == v))
                }
                Requirement::Exists(key) => lookup(key).is_some(),
                Requirement::NotExists(key) => lookup(key).is_none(),
            })
    }

    /// Label selector match against `metadata.labels`.
    pub fn matches_labels(&self, object: &Value) -> bool {
        let labels = object.pointer("/metadata/labels");
        self.matches_with(|key| labels.and_then(|l| l.get(key)).and_then(Value::as_str))
    }

    /// Field selector match against dotted paths.
    pub fn matches_fields(&self, object: &Value) -> bool {
        self.matches_with(|path| {
            path.split('.')
                .try_fold(object, |value, segment| value.get(segment))
                .and_then(Value::as_str)
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn label_selectors_match_as_kubernetes_does() {
        let pod = json!({"metadata": {"labels": {"app": "web", "tier": "front"}}});
        let yes = [
            "app=web",
            "app==web,tier",
            "app in (web, db),!missing",
            "tier notin (back)",
            "app!=db",
            "missing!=x",
            "",
        ];
        for text in yes {
            assert!(
                Selector::labels(text).unwrap().matches_labels(&pod),
                "{text}"
            );
        }
        for text in [
            "app=db",
            "missing",
            "!app",
            "app notin (web)",
            "tier in (back,db)",
        ] {
            assert!(
                !Selector::labels(text).unwrap().matches_labels(&pod),
                "{text}"
            );
        }
        assert!(Selector::labels("app in web").is_err());
    }

    #[test]
    fn field_selectors_follow_dotted_paths() {
        let pod =
            json!({"metadata": {"name": "p", "namespace": "default"}, "spec": {"nodeName": "n1"}});
        let sel = Selector::fields("spec.nodeName=n1,metadata.namespace!=kube-system").unwrap();
        assert!(sel.matches_fields(&pod));
        assert!(
            !Selector::fields("metadata.name=q")
                .unwrap()
                .matches_fields(&pod)
        );
        assert!(Selector::fields("metadata.name").is_err());
    }
}
