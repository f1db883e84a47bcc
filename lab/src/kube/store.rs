//! The API server's state: every object by resource, namespace and name,
//! one resourceVersion counter for all of them (as etcd's revision), and a
//! bounded history of changes that watches replay from.

use std::{
    collections::{BTreeMap, VecDeque},
    sync::Arc,
    time::{SystemTime, UNIX_EPOCH},
};

use serde_json::{Value, json};
use tokio::sync::broadcast;

use super::{
    patch::{self, PatchError},
    resources::{self, Resource},
    selector::Selector,
};
use crate::ec2::xml::timestamp_secs;

/// How many changes the history keeps; a watch from an older
/// resourceVersion gets `410 Gone` (the real server keeps a few minutes'
/// worth in its watch cache).
pub const DEFAULT_HISTORY: usize = 4096;
/// How many changes a watcher may fall behind before its stream ends.
const WATCHER_BACKLOG: usize = 4096;
/// The namespaces every cluster has.
pub const SYSTEM_NAMESPACES: [&str; 4] =
    ["default", "kube-system", "kube-public", "kube-node-lease"];

/// An answer other than success, as the API's `Status` says it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code} {reason}: {message}")]
pub struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
        }
    }

    pub fn not_found(resource: &Resource, name: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", qualified(resource)),
        )
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    pub fn invalid(resource: &Resource, name: &str, why: &str) -> Self {
        Self::new(
            422,
            "Invalid",
            format!("{} \"{name}\" is invalid: {why}", resource.kind),
        )
    }

    pub fn conflict(resource: &Resource, name: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                qualified(resource)
            ),
        )
    }

    /// The `Status` object.
    pub fn status(&self) -> Value {
        json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        })
    }
}

/// `pods` or `eniconfigs.crd.k8s.amazonaws.com`, as errors name resources.
fn qualified(resource: &Resource) -> String {
    if resource.group.is_empty() {
        resource.plural.to_owned()
    } else {
        format!("{}.{}", resource.plural, resource.group)
    }
}

/// What a change did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeType {
    Added,
    Modified,
    Deleted,
}

impl ChangeType {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Added => "ADDED",
            Self::Modified => "MODIFIED",
            Self::Deleted => "DELETED",
        }
    }
}

/// One change, as watches see it.
#[derive(Debug, Clone)]
pub struct Change {
    pub revision: u64,
    pub resource: &'static Resource,
    pub change: ChangeType,
    /// The object after the change (before it, with the new revision, for
    /// a deletion).
    pub object: Value,
    /// The object before a modification (watches with selectors need it).
    pub previous: Option<Value>,
}

impl Change {
    pub fn namespace(&self) -> &str {
        namespace_of(&self.object)
    }
}

/// How a PATCH body is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchKind {
    Merge,
    Strategic,
    Apply { force: bool },
}

fn namespace_of(object: &Value) -> &str {
    object
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or("")
}

fn name_of(object: &Value) -> Option<&str> {
    object.pointer("/metadata/name").and_then(Value::as_str)
}

/// Where an object lives: its resource (by table index), namespace (empty
/// for cluster-scoped kinds) and name.
type Key = (usize, String, String);

fn resource_index(resource: &Resource) -> usize {
    resources::RESOURCES
        .iter()
        .position(|r| r == resource)
        .expect("a served resource")
}

/// A watch's start: what happened since the asked revision, then live.
#[derive(Debug)]
pub struct Subscription {
    pub backlog: Vec<Arc<Change>>,
    pub live: broadcast::Receiver<Arc<Change>>,
}

/// The state.
#[derive(Debug)]
pub struct Store {
    objects: BTreeMap<Key, Value>,
    revision: u64,
    history: VecDeque<Arc<Change>>,
    history_len: usize,
    /// The newest revision no longer in the history.
    compacted: u64,
    changes: broadcast::Sender<Arc<Change>>,
    next_uid: u64,
}

impl Store {
    /// A cluster with its system namespaces and a history of `history_len`.
    pub fn new(history_len: usize) -> Self {
        let (changes, _) = broadcast::channel(WATCHER_BACKLOG);
        let mut store = Self {
            objects: BTreeMap::new(),
            revision: 0,
            history: VecDeque::new(),
            history_len: history_len.max(1),
            compacted: 0,
            changes,
            next_uid: 1,
        };
        let namespaces = resources::find("", "v1", "namespaces").expect("served");
        for name in SYSTEM_NAMESPACES {
            store
                .create(
                    namespaces,
                    None,
                    json!({"metadata": {"name": name}, "status": {"phase": "Active"}}),
                )
                .expect("a fresh store takes its namespaces");
        }
        store
    }

    /// The current resourceVersion.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// The objects of `resource` in `namespace` (all if `None`) that match.
    pub fn list(
        &self,
        resource: &'static Resource,
        namespace: Option<&str>,
        labels: &Selector,
        fields: &Selector,
    ) -> Vec<Value> {
        let index = resource_index(resource);
        self.objects
            .range((index, String::new(), String::new())..)
            .take_while(|((i, _, _), _)| *i == index)
            .filter(|((_, ns, _), _)| namespace.is_none_or(|want| want == ns))
            .map(|(_, object)| object)
            .filter(|object| labels.matches_labels(object) && fields.matches_fields(object))
            .cloned()
            .collect()
    }

    pub fn get(
        &self,
        resource: &'static Resource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Value, ApiError> {
        self.objects
            .get(&key(resource, namespace, name))
            .cloned()
            .ok_or_else(|| ApiError::not_found(resource, name))
    }

    fn check_namespace(
        &self,
        resource: &Resource,
        namespace: Option<&str>,
    ) -> Result<(), ApiError> {
        match (resource.namespaced, namespace) {
            (true, None) => Err(ApiError::bad_request(format!(
                "{} are namespaced: the path needs a namespace",
                resource.plural
            ))),
            (true, Some(ns)) => {
                let namespaces = resources::find("", "v1", "namespaces").expect("served");
                if self.objects.contains_key(&key(namespaces, None, ns)) {
                    Ok(())
                } else {
                    Err(ApiError::new(
                        404,
                        "NotFound",
                        format!("namespaces \"{ns}\" not found"),
                    ))
                }
            }
            (false, _) => Ok(()),
        }
    }

    /// POST: a new object (`metadata.generateName` gives it a name).
    pub fn create(
        &mut self,
        resource: &'static Resource,
        namespace: Option<&str>,
        mut object: Value,
    ) -> Result<Value, ApiError> {
        self.check_namespace(resource, namespace)?;
        if !object.is_object() {
            return Err(ApiError::bad_request("the body is not an object"));
        }
        let metadata = object
            .as_object_mut()
            .expect("checked")
            .entry("metadata")
            .or_insert_with(|| json!({}));
        if !metadata.is_object() {
            return Err(ApiError::bad_request("metadata is not an object"));
        }
        if metadata.get("name").and_then(Value::as_str).is_none() {
            let prefix = metadata
                .get("generateName")
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::invalid(
                        resource,
                        "",
                        "metadata.name: Required value: name or generateName is required",
                    )
                })?
                .to_owned();
            metadata["name"] = json!(format!("{prefix}{:05x}", self.next_uid % 0x10_0000));
        }
        let name = name_of(&object).expect("set").to_owned();
        validate_name(resource, &name)?;
        let key = key(resource, namespace, &name);
        if self.objects.contains_key(&key) {
            return Err(ApiError::new(
                409,
                "AlreadyExists",
                format!("{} \"{name}\" already exists", qualified(resource)),
            ));
        }
        let uid = self.uid();
        let metadata = object["metadata"].as_object_mut().expect("checked");
        metadata.insert("uid".into(), json!(uid));
        metadata.insert("creationTimestamp".into(), json!(now()));
        metadata.remove("resourceVersion");
        if let Some(ns) = namespace {
            metadata.insert("namespace".into(), json!(ns));
        }
        Ok(self.commit(resource, key, object, None))
    }

    /// PUT: the whole object; a resourceVersion in it must be current.
    pub fn update(
        &mut self,
        resource: &'static Resource,
        namespace: Option<&str>,
        name: &str,
        mut object: Value,
    ) -> Result<Value, ApiError> {
        let key = key(resource, namespace, name);
        let current = self
            .objects
            .get(&key)
            .ok_or_else(|| ApiError::not_found(resource, name))?;
        if name_of(&object) != Some(name) {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({:?}) does not match the name on the URL ({name:?})",
                name_of(&object).unwrap_or_default()
            )));
        }
        check_revision(resource, name, current, &object)?;
        keep_identity(current, &mut object);
        let previous = current.clone();
        Ok(self.commit(resource, key, object, Some(previous)))
    }

    /// PATCH. Merge and strategic patches that carry a resourceVersion are
    /// optimistic (409 when it is not current); an apply creates the object
    /// when it does not exist.
    pub fn patch(
        &mut self,
        resource: &'static Resource,
        namespace: Option<&str>,
        name: &str,
        kind: PatchKind,
        body: &Value,
    ) -> Result<(Value, bool), ApiError> {
        let key = key(resource, namespace, name);
        let Some(current) = self.objects.get(&key) else {
            return match kind {
                PatchKind::Apply { .. } => {
                    let mut object = body.clone();
                    if name_of(&object) != Some(name) {
                        return Err(ApiError::bad_request(
                            "the applied object's name does not match the URL",
                        ));
                    }
                    strip_server_fields(&mut object);
                    self.create(resource, namespace, object).map(|o| (o, true))
                }
                _ => Err(ApiError::not_found(resource, name)),
            };
        };
        if !body.is_object() {
            return Err(ApiError::bad_request("the patch is not an object"));
        }
        if !matches!(kind, PatchKind::Apply { .. }) {
            check_revision(resource, name, current, body)?;
        }
        let mut object = current.clone();
        let result = match kind {
            PatchKind::Merge => {
                patch::merge_patch(&mut object, body);
                Ok(())
            }
            PatchKind::Strategic => patch::strategic_merge_patch(&mut object, body),
            PatchKind::Apply { .. } => {
                let mut applied = body.clone();
                strip_server_fields(&mut applied);
                patch::apply(&mut object, &applied)
            }
        };
        result.map_err(|PatchError(why)| ApiError::invalid(resource, name, &why))?;
        keep_identity(current, &mut object);
        if name_of(&object) != Some(name) {
            return Err(ApiError::invalid(
                resource,
                name,
                "metadata.name: the patch changes the name",
            ));
        }
        if object == *current {
            // No change, no new revision: as the real server.
            return Ok((object, false));
        }
        let previous = current.clone();
        Ok((self.commit(resource, key, object, Some(previous)), false))
    }

    /// DELETE: the object's last state, with the deletion's revision.
    pub fn delete(
        &mut self,
        resource: &'static Resource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Value, ApiError> {
        let key = key(resource, namespace, name);
        let object = self
            .objects
            .remove(&key)
            .ok_or_else(|| ApiError::not_found(resource, name))?;
        let mut object = object;
        self.revision += 1;
        object["metadata"]["resourceVersion"] = json!(self.revision.to_string());
        self.record(resource, ChangeType::Deleted, object.clone(), None);
        Ok(object)
    }

    /// The changes after `revision` and the live feed, atomically (the
    /// caller holds the store's lock): `None` when the history no longer
    /// reaches back that far (410 Gone).
    pub fn subscribe(&self, revision: u64) -> Option<Subscription> {
        if revision < self.compacted {
            return None;
        }
        let live = self.changes.subscribe();
        let backlog = self
            .history
            .iter()
            .filter(|change| change.revision > revision)
            .cloned()
            .collect();
        Some(Subscription { backlog, live })
    }

    /// The oldest revision a watch can start from.
    pub fn compacted(&self) -> u64 {
        self.compacted
    }

    fn uid(&mut self) -> String {
        let n = self.next_uid;
        self.next_uid += 1;
        // A UUID's shape, unique within the server's life.
        format!("7670636e-6574-4000-8000-{n:012x}")
    }

    fn commit(
        &mut self,
        resource: &'static Resource,
        key: Key,
        mut object: Value,
        previous: Option<Value>,
    ) -> Value {
        self.revision += 1;
        let change = if previous.is_some() {
            ChangeType::Modified
        } else {
            ChangeType::Added
        };
        set_defaults(resource, &mut object);
        let map = object.as_object_mut().expect("objects are objects");
        map.insert("apiVersion".into(), json!(resource.group_version()));
        map.insert("kind".into(), json!(resource.kind));
        object["metadata"]["resourceVersion"] = json!(self.revision.to_string());
        self.objects.insert(key, object.clone());
        self.record(resource, change, object.clone(), previous);
        object
    }

    fn record(
        &mut self,
        resource: &'static Resource,
        change: ChangeType,
        object: Value,
        previous: Option<Value>,
    ) {
        let change = Arc::new(Change {
            revision: self.revision,
            resource,
            change,
            object,
            previous,
        });
        self.history.push_back(change.clone());
        while self.history.len() > self.history_len {
            if let Some(old) = self.history.pop_front() {
                self.compacted = old.revision;
            }
        }
        // No receiver is not an error: nobody watches.
        let _ = self.changes.send(change);
    }
}

/// The label every Namespace carries, set by the server on each write.
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// What the real server's defaulting and admission set on every write of
/// the kinds the lab's controllers read: a Namespace's name label, a
/// NetworkPolicy's `policyTypes` and its ports' protocol.
fn set_defaults(resource: &Resource, object: &mut Value) {
    match (resource.group, resource.plural) {
        ("", "namespaces") => {
            let name = name_of(object).unwrap_or_default().to_owned();
            let metadata = &mut object["metadata"];
            if !metadata["labels"].is_object() {
                metadata["labels"] = json!({});
            }
            metadata["labels"][NAMESPACE_NAME_LABEL] = json!(name);
        }
        ("networking.k8s.io", "networkpolicies") => {
            let Some(spec) = object.get_mut("spec").and_then(Value::as_object_mut) else {
                return;
            };
            let has_egress = spec
                .get("egress")
                .and_then(Value::as_array)
                .is_some_and(|rules| !rules.is_empty());
            let types_given = spec
                .get("policyTypes")
                .and_then(Value::as_array)
                .is_some_and(|types| !types.is_empty());
            if !types_given {
                let mut types = vec![json!("Ingress")];
                if has_egress {
                    types.push(json!("Egress"));
                }
                spec.insert("policyTypes".into(), Value::Array(types));
            }
            for direction in ["ingress", "egress"] {
                let rules = spec.get_mut(direction).and_then(Value::as_array_mut);
                for rule in rules.into_iter().flatten() {
                    let ports = rule.get_mut("ports").and_then(Value::as_array_mut);
                    for port in ports.into_iter().flatten() {
                        if let Some(port) = port.as_object_mut() {
                            port.entry("protocol").or_insert_with(|| json!("TCP"));
                        }
                    }
                }
            }
        }
        _ => {}
    }
}

fn key(resource: &Resource, namespace: Option<&str>, name: &str) -> Key {
    let namespace = if resource.namespaced {
        namespace.unwrap_or_default()
    } else {
        ""
    };
    (
        resource_index(resource),
        namespace.to_owned(),
        name.to_owned(),
    )
}

/// A DNS-1123 subdomain, as the server requires of most names.
fn validate_name(resource: &Resource, name: &str) -> Result<(), ApiError> {
    let valid = !name.is_empty()
        && name.len() <= 253
        && name.chars().all(|c| {
            c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.' || c == ':'
        })
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    if valid {
        Ok(())
    } else {
        Err(ApiError::invalid(
            resource,
            name,
            "metadata.name: Invalid value: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.'",
        ))
    }
}

/// A write that names a resourceVersion must name the current one.
fn check_revision(
    resource: &Resource,
    name: &str,
    current: &Value,
    write: &Value,
) -> Result<(), ApiError> {
    match write
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
    {
        Some(rv)
            if Some(rv)
                != current
                    .pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str) =>
        {
            Err(ApiError::conflict(resource, name))
        }
        _ => Ok(()),
    }
}

/// What only the server sets stays as it was.
fn keep_identity(current: &Value, object: &mut Value) {
    for field in ["uid", "creationTimestamp", "namespace", "name"] {
        match current["metadata"].get(field) {
            Some(value) => object["metadata"][field] = value.clone(),
            None => {
                if let Some(metadata) = object["metadata"].as_object_mut() {
                    metadata.remove(field);
                }
            }
        }
    }
}

fn strip_server_fields(object: &mut Value) {
    if let Some(metadata) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        for field in [
            "resourceVersion",
            "uid",
            "creationTimestamp",
            "managedFields",
        ] {
            metadata.remove(field);
        }
    }
}

fn now() -> String {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    timestamp_secs(ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes() -> &'static Resource {
        resources::find("", "v1", "nodes").unwrap()
    }

    fn pods() -> &'static Resource {
        resources::find("", "v1", "pods").unwrap()
    }

    #[test]
    fn every_write_takes_the_next_revision_and_watches_replay_after_theirs() {
        let mut store = Store::new(DEFAULT_HISTORY);
        let start = store.revision();
        let node = store
            .create(nodes(), None, json!({"metadata": {"name": "n1"}}))
            .unwrap();
        assert_eq!(
            node["metadata"]["resourceVersion"],
            json!((start + 1).to_string())
        );
        assert_eq!(node["kind"], "Node");
        let sub = store.subscribe(start + 1).unwrap();
        assert!(sub.backlog.is_empty());
        store
            .patch(
                nodes(),
                None,
                "n1",
                PatchKind::Merge,
                &json!({"metadata": {"labels": {"a": "b"}}}),
            )
            .unwrap();
        let deleted = store.delete(nodes(), None, "n1").unwrap();
        assert_eq!(
            deleted["metadata"]["resourceVersion"],
            json!((start + 3).to_string())
        );
        let replay = store.subscribe(start).unwrap().backlog;
        let seen: Vec<_> = replay.iter().map(|c| (c.revision, c.change)).collect();
        assert_eq!(
            seen,
            [
                (start + 1, ChangeType::Added),
                (start + 2, ChangeType::Modified),
                (start + 3, ChangeType::Deleted)
            ]
        );
    }

    #[test]
    fn a_watch_from_before_the_history_is_gone() {
        let mut store = Store::new(2);
        for i in 0..4 {
            store
                .create(
                    nodes(),
                    None,
                    json!({"metadata": {"name": format!("n{i}")}}),
                )
                .unwrap();
        }
        let now = store.revision();
        assert!(store.subscribe(now - 2).is_some());
        assert!(store.subscribe(now - 3).is_none());
    }

    #[test]
    fn a_stale_resource_version_conflicts_and_an_unchanged_patch_writes_nothing() {
        let mut store = Store::new(DEFAULT_HISTORY);
        let node = store
            .create(nodes(), None, json!({"metadata": {"name": "n1"}}))
            .unwrap();
        let rv = node["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .to_owned();
        let patch = json!({"metadata": {"resourceVersion": rv, "labels": {"a": "b"}}});
        store
            .patch(nodes(), None, "n1", PatchKind::Merge, &patch)
            .unwrap();
        let err = store
            .patch(nodes(), None, "n1", PatchKind::Merge, &patch)
            .unwrap_err();
        assert_eq!((err.code, err.reason), (409, "Conflict"));
        let before = store.revision();
        store
            .patch(
                nodes(),
                None,
                "n1",
                PatchKind::Merge,
                &json!({"metadata": {"labels": {"a": "b"}}}),
            )
            .unwrap();
        assert_eq!(store.revision(), before);
    }

    #[test]
    fn namespaced_objects_need_an_existing_namespace_and_names_are_unique() {
        let mut store = Store::new(DEFAULT_HISTORY);
        let pod = json!({"metadata": {"name": "p"}});
        let err = store.create(pods(), Some("nope"), pod.clone()).unwrap_err();
        assert_eq!(err.message, "namespaces \"nope\" not found");
        store.create(pods(), Some("default"), pod.clone()).unwrap();
        let err = store
            .create(pods(), Some("default"), pod.clone())
            .unwrap_err();
        assert_eq!((err.code, err.reason), (409, "AlreadyExists"));
        store.create(pods(), Some("kube-system"), pod).unwrap();
        let all = store.list(pods(), None, &Selector::default(), &Selector::default());
        assert_eq!(all.len(), 2);
        let err = store
            .create(
                pods(),
                Some("default"),
                json!({"metadata": {"name": "Bad_Name"}}),
            )
            .unwrap_err();
        assert_eq!(err.code, 422);
    }

    #[test]
    fn apply_creates_then_merges() {
        let mut store = Store::new(DEFAULT_HISTORY);
        let cninodes = resources::find(resources::CNINODE_GROUP, "v1alpha1", "cninodes").unwrap();
        let applied = json!({"apiVersion": "vpcresources.k8s.aws/v1alpha1", "kind": "CNINode",
            "metadata": {"name": "n1"}, "spec": {"features": [{"name": "SecurityGroupsForPods"}]}});
        let (_, created) = store
            .patch(
                cninodes,
                None,
                "n1",
                PatchKind::Apply { force: true },
                &applied,
            )
            .unwrap();
        assert!(created);
        let (object, created) = store
            .patch(
                cninodes,
                None,
                "n1",
                PatchKind::Apply { force: true },
                &json!({"metadata": {"name": "n1", "labels": {"x": "y"}}}),
            )
            .unwrap();
        assert!(!created);
        assert_eq!(
            object["spec"]["features"][0]["name"],
            "SecurityGroupsForPods"
        );
        assert_eq!(object["metadata"]["labels"]["x"], "y");
    }
}
