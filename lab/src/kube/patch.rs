//! The patch formats the API server applies: JSON merge patch (RFC 7386),
//! the strategic merge patch kubectl's client-side apply sends for built-in
//! kinds, and server-side apply as far as kube-rs and kubectl use it.
//!
//! The strategic merge patch here finds a list's merge key by the list's
//! field name (the real server reads it from the Go types): the lists of the
//! kinds the lab serves that carry one. Every other list is replaced.

use serde_json::{Map, Value};

/// A patch that cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PatchError(pub String);

/// RFC 7386: objects merge, `null` removes, anything else replaces.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let target = target.as_object_mut().expect("made an object");
    for (key, value) in patch {
        if value.is_null() {
            target.remove(key);
        } else {
            merge_patch(target.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

/// How a list field merges in a strategic merge patch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ListMerge {
    /// Elements are objects matched by this key.
    ByKey(&'static str),
    /// A set of primitives (union).
    Primitives,
    Replace,
}

/// The merge strategy of list field `field`, whose elements look like
/// `sample` (`ports` is keyed by `containerPort` in a container and by
/// `port` in a Service).
fn list_merge(field: &str, sample: Option<&Value>) -> ListMerge {
    let has = |key: &str| sample.and_then(|s| s.get(key)).is_some();
    match field {
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "env"
        | "volumes"
        | "imagePullSecrets"
        | "resourceClaims" => ListMerge::ByKey("name"),
        "volumeMounts" => ListMerge::ByKey("mountPath"),
        "volumeDevices" => ListMerge::ByKey("devicePath"),
        "ports" if has("containerPort") => ListMerge::ByKey("containerPort"),
        "ports" => ListMerge::ByKey("port"),
        "hostAliases" => ListMerge::ByKey("ip"),
        "conditions" => ListMerge::ByKey("type"),
        "taints" => ListMerge::ByKey("key"),
        "ownerReferences" => ListMerge::ByKey("uid"),
        "topologySpreadConstraints" => ListMerge::ByKey("topologyKey"),
        "finalizers" => ListMerge::Primitives,
        _ => ListMerge::Replace,
    }
}

const PATCH_DIRECTIVE: &str = "$patch";
const RETAIN_KEYS: &str = "$retainKeys";
const SET_ELEMENT_ORDER: &str = "$setElementOrder/";
const DELETE_FROM_PRIMITIVE_LIST: &str = "$deleteFromPrimitiveList/";

/// A strategic merge patch: maps merge, lists with a merge key merge by
/// it, `$patch: replace|delete`, `$retainKeys`,
/// `$deleteFromPrimitiveList/` and `$setElementOrder/` (order only: new
/// elements go last) as kubectl sends them.
pub fn strategic_merge_patch(target: &mut Value, patch: &Value) -> Result<(), PatchError> {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return Ok(());
    };
    match patch.get(PATCH_DIRECTIVE).and_then(Value::as_str) {
        Some("replace") => {
            let mut replacement = patch.clone();
            replacement.remove(PATCH_DIRECTIVE);
            *target = Value::Object(replacement);
            return Ok(());
        }
        Some("delete") => {
            *target = Value::Null;
            return Ok(());
        }
        Some(other) => return Err(PatchError(format!("unknown $patch directive {other:?}"))),
        None => {}
    }
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let object = target.as_object_mut().expect("made an object");
    for (key, value) in patch {
        if key == RETAIN_KEYS || key.starts_with(SET_ELEMENT_ORDER) {
            continue;
        }
        if let Some(field) = key.strip_prefix(DELETE_FROM_PRIMITIVE_LIST) {
            let remove = value.as_array().cloned().unwrap_or_default();
            if let Some(Value::Array(list)) = object.get_mut(field) {
                list.retain(|item| !remove.contains(item));
            }
            continue;
        }
        if value.is_null() {
            object.remove(key);
            continue;
        }
        match value {
            Value::Object(_) => {
                let slot = object.entry(key.clone()).or_insert(Value::Null);
                strategic_merge_patch(slot, value)?;
                if slot.is_null() {
                    object.remove(key);
                }
            }
            Value::Array(items) => {
                let slot = object
                    .entry(key.clone())
                    .or_insert(Value::Array(Vec::new()));
                merge_list(key, slot, items)?;
            }
            _ => {
                object.insert(key.clone(), value.clone());
            }
        }
    }
    if let Some(Value::Array(retain)) = patch.get(RETAIN_KEYS) {
        let keep: Vec<&str> = retain.iter().filter_map(Value::as_str).collect();
        object.retain(|key, _| keep.contains(&key.as_str()));
    }
    Ok(())
}

fn merge_list(field: &str, slot: &mut Value, items: &[Value]) -> Result<(), PatchError> {
    if items
        .iter()
        .any(|item| item.get(PATCH_DIRECTIVE).and_then(Value::as_str) == Some("replace"))
    {
        let kept = items
            .iter()
            .filter(|item| item.get(PATCH_DIRECTIVE).is_none())
            .cloned()
            .collect();
        *slot = Value::Array(kept);
        return Ok(());
    }
    let strategy = list_merge(field, items.first());
    let Value::Array(current) = slot else {
        *slot = Value::Array(items.to_vec());
        return Ok(());
    };
    match strategy {
        ListMerge::Replace => *current = items.to_vec(),
        ListMerge::Primitives => {
            for item in items {
                if !current.contains(item) {
                    current.push(item.clone());
                }
            }
        }
        ListMerge::ByKey(merge_key) => {
            for item in items {
                let key = item.get(merge_key).ok_or_else(|| {
                    PatchError(format!(
                        "an element of {field} has no merge key {merge_key}: {item}"
                    ))
                })?;
                let position = current.iter().position(|c| c.get(merge_key) == Some(key));
                let delete = item.get(PATCH_DIRECTIVE).and_then(Value::as_str) == Some("delete");
                match (position, delete) {
                    (Some(at), true) => {
                        current.remove(at);
                    }
                    (None, true) => {}
                    (Some(at), false) => strategic_merge_patch(&mut current[at], item)?,
                    (None, false) => {
                        let mut fresh = Value::Null;
                        strategic_merge_patch(&mut fresh, item)?;
                        current.push(fresh);
                    }
                }
            }
        }
    }
    Ok(())
}

/// Server-side apply as the lab does it: the applied configuration merges
/// into the object the strategic way (keyed lists by key, other lists
/// replaced). Fields a manager stops applying are not removed: the lab keeps
/// no managed fields.
pub fn apply(target: &mut Value, applied: &Value) -> Result<(), PatchError> {
    strategic_merge_patch(target, applied)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn merge_patch_follows_rfc_7386() {
        // The RFC's own example (section 3).
        let mut target = json!({"a": "b", "c": {"d": "e", "f": "g"}});
        merge_patch(&mut target, &json!({"a": "z", "c": {"f": null}}));
        assert_eq!(target, json!({"a": "z", "c": {"d": "e"}}));
        let mut target = json!({"a": [1, 2]});
        merge_patch(&mut target, &json!({"a": [3]}));
        assert_eq!(target, json!({"a": [3]}));
    }

    #[test]
    fn kubectls_daemon_set_patch_merges_containers_and_env_by_name() {
        let mut daemon_set = json!({"spec": {"template": {"spec": {"containers": [
            {"name": "agent", "image": "vpcnet:v1", "env": [{"name": "A", "value": "1"}]},
            {"name": "other", "image": "x"}
        ]}}}});
        let patch = json!({"spec": {"template": {"spec": {
            "$setElementOrder/containers": [{"name": "agent"}, {"name": "other"}],
            "containers": [{
                "$setElementOrder/env": [{"name": "A"}, {"name": "B"}],
                "env": [{"name": "B", "value": "2"}],
                "image": "vpcnet:v2",
                "name": "agent"
            }]
        }}}});
        strategic_merge_patch(&mut daemon_set, &patch).unwrap();
        assert_eq!(
            daemon_set,
            json!({"spec": {"template": {"spec": {"containers": [
                {"name": "agent", "image": "vpcnet:v2",
                 "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]},
                {"name": "other", "image": "x"}
            ]}}}})
        );
    }

    #[test]
    fn strategic_directives_delete_replace_and_remove_primitives() {
        let mut pod = json!({
            "metadata": {"finalizers": ["a", "b"], "labels": {"x": "1"}},
            "spec": {"containers": [{"name": "c1"}, {"name": "c2"}], "tolerations": [{"key": "t"}]}
        });
        let patch = json!({
            "metadata": {"$deleteFromPrimitiveList/finalizers": ["a"], "labels": {"$patch": "replace", "y": "2"}},
            "spec": {"containers": [{"name": "c1", "$patch": "delete"}], "tolerations": [{"key": "u"}]}
        });
        strategic_merge_patch(&mut pod, &patch).unwrap();
        assert_eq!(
            pod,
            json!({
                "metadata": {"finalizers": ["b"], "labels": {"y": "2"}},
                "spec": {"containers": [{"name": "c2"}], "tolerations": [{"key": "u"}]}
            })
        );
    }

    #[test]
    fn service_ports_merge_by_port_and_container_ports_by_container_port() {
        let mut service = json!({"spec": {"ports": [{"port": 80, "name": "http"}]}});
        strategic_merge_patch(
            &mut service,
            &json!({"spec": {"ports": [{"port": 443, "name": "https"}]}}),
        )
        .unwrap();
        assert_eq!(service["spec"]["ports"].as_array().unwrap().len(), 2);
        let err = strategic_merge_patch(
            &mut json!({"spec": {"containers": []}}),
            &json!({"spec": {"containers": [{"image": "no-name"}]}}),
        )
        .unwrap_err();
        assert!(err.0.contains("no merge key name"), "{err}");
    }
}
