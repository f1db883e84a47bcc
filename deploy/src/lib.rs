//! vpcnet's deployment files read as Kubernetes objects, for the tests of
//! `deploy/`: YAML documents into `k8s-openapi`'s typed structs, strictly.
//!
//! Strictly: the typed structs ignore a field they do not have, as the API
//! server's lenient decoding would (and then drops it). So every object is
//! also written back from its struct and compared with what was read: a
//! field that did not survive (a typo, a field at the wrong level) is an
//! error naming its path.

pub mod aws;
pub mod node_selection;
pub mod promql;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, Service, ServiceAccount},
        rbac::v1::{ClusterRole, ClusterRoleBinding},
    },
    serde::{Deserialize, Serialize, de::DeserializeOwned},
};
use serde_json::Value;

/// This directory: `deploy/` of the repository.
pub const DEPLOY_DIR: &str = env!("CARGO_MANIFEST_DIR");

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("{source_name}: not YAML: {message}")]
    Yaml {
        source_name: String,
        message: String,
    },
    #[error("{source_name}: a document without apiVersion and kind")]
    NoKind { source_name: String },
    #[error("{source_name}: {api_version} {kind} is not a kind vpcnet deploys")]
    UnexpectedKind {
        source_name: String,
        api_version: String,
        kind: String,
    },
    #[error("{source_name}: not a valid {kind}: {message}")]
    Invalid {
        source_name: String,
        kind: &'static str,
        message: String,
    },
    #[error("{source_name}: fields a {kind} does not have: {fields:?}")]
    UnknownFields {
        source_name: String,
        kind: &'static str,
        fields: Vec<String>,
    },
    #[error("{command}: {message}")]
    Tool { command: String, message: String },
}

/// One object of the deployment.
#[derive(Clone, Debug)]
pub enum Object {
    DaemonSet(Box<DaemonSet>),
    ServiceAccount(Box<ServiceAccount>),
    ConfigMap(Box<ConfigMap>),
    Service(Box<Service>),
    ClusterRole(Box<ClusterRole>),
    ClusterRoleBinding(Box<ClusterRoleBinding>),
}

impl Object {
    pub fn kind(&self) -> &'static str {
        match self {
            Self::DaemonSet(_) => "DaemonSet",
            Self::ServiceAccount(_) => "ServiceAccount",
            Self::ConfigMap(_) => "ConfigMap",
            Self::Service(_) => "Service",
            Self::ClusterRole(_) => "ClusterRole",
            Self::ClusterRoleBinding(_) => "ClusterRoleBinding",
        }
    }

    pub fn name(&self) -> &str {
        let meta = match self {
            Self::DaemonSet(o) => &o.metadata,
            Self::ServiceAccount(o) => &o.metadata,
            Self::ConfigMap(o) => &o.metadata,
            Self::Service(o) => &o.metadata,
            Self::ClusterRole(o) => &o.metadata,
            Self::ClusterRoleBinding(o) => &o.metadata,
        };
        meta.name.as_deref().unwrap_or_default()
    }
}

/// The objects of one rendering (a directory's files, kustomize's or
/// Helm's output), with lookups by kind.
#[derive(Clone, Debug, Default)]
pub struct Objects(pub Vec<Object>);

impl Objects {
    pub fn daemon_sets(&self) -> impl Iterator<Item = &DaemonSet> {
        self.0.iter().filter_map(|o| match o {
            Object::DaemonSet(ds) => Some(ds.as_ref()),
            _ => None,
        })
    }

    pub fn service_accounts(&self) -> impl Iterator<Item = &ServiceAccount> {
        self.0.iter().filter_map(|o| match o {
            Object::ServiceAccount(sa) => Some(sa.as_ref()),
            _ => None,
        })
    }

    pub fn config_maps(&self) -> impl Iterator<Item = &ConfigMap> {
        self.0.iter().filter_map(|o| match o {
            Object::ConfigMap(cm) => Some(cm.as_ref()),
            _ => None,
        })
    }

    pub fn services(&self) -> impl Iterator<Item = &Service> {
        self.0.iter().filter_map(|o| match o {
            Object::Service(service) => Some(service.as_ref()),
            _ => None,
        })
    }

    pub fn cluster_roles(&self) -> impl Iterator<Item = &ClusterRole> {
        self.0.iter().filter_map(|o| match o {
            Object::ClusterRole(role) => Some(role.as_ref()),
            _ => None,
        })
    }

    pub fn cluster_role_bindings(&self) -> impl Iterator<Item = &ClusterRoleBinding> {
        self.0.iter().filter_map(|o| match o {
            Object::ClusterRoleBinding(binding) => Some(binding.as_ref()),
            _ => None,
        })
    }

    /// The one `DaemonSet`.
    pub fn daemon_set(&self) -> &DaemonSet {
        let all: Vec<&DaemonSet> = self.daemon_sets().collect();
        assert_eq!(all.len(), 1, "one DaemonSet");
        all[0]
    }

    /// The `DaemonSet` named `name`.
    pub fn daemon_set_named(&self, name: &str) -> &DaemonSet {
        self.daemon_sets()
            .find(|ds| ds.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no DaemonSet {name}"))
    }

    /// The one `ConfigMap`.
    pub fn config_map(&self) -> &ConfigMap {
        let all: Vec<&ConfigMap> = self.config_maps().collect();
        assert_eq!(all.len(), 1, "one ConfigMap");
        all[0]
    }
}

/// The YAML documents of `text` (empty ones skipped), as JSON values.
pub fn documents(text: &str, source_name: &str) -> Result<Vec<Value>, ManifestError> {
    let mut docs = Vec::new();
    for document in serde_norway::Deserializer::from_str(text) {
        let value = Value::deserialize(document).map_err(|e| ManifestError::Yaml {
            source_name: source_name.to_owned(),
            message: e.to_string(),
        })?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}

/// Every object of `text`, typed and checked.
pub fn objects(text: &str, source_name: &str) -> Result<Objects, ManifestError> {
    documents(text, source_name)?
        .iter()
        .map(|doc| typed(doc, source_name))
        .collect::<Result<_, _>>()
        .map(Objects)
}

/// `doc` as its typed object; an error names what is wrong or unknown.
pub fn typed(doc: &Value, source_name: &str) -> Result<Object, ManifestError> {
    let field = |name: &str| doc.get(name).and_then(Value::as_str);
    let (Some(api_version), Some(kind)) = (field("apiVersion"), field("kind")) else {
        return Err(ManifestError::NoKind {
            source_name: source_name.to_owned(),
        });
    };
    Ok(match (api_version, kind) {
        ("apps/v1", "DaemonSet") => {
            Object::DaemonSet(Box::new(strict(doc, source_name, "DaemonSet")?))
        }
        ("v1", "ServiceAccount") => {
            Object::ServiceAccount(Box::new(strict(doc, source_name, "ServiceAccount")?))
        }
        ("v1", "ConfigMap") => Object::ConfigMap(Box::new(strict(doc, source_name, "ConfigMap")?)),
        ("v1", "Service") => Object::Service(Box::new(strict(doc, source_name, "Service")?)),
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
            Object::ClusterRole(Box::new(strict(doc, source_name, "ClusterRole")?))
        }
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            Object::ClusterRoleBinding(Box::new(strict(doc, source_name, "ClusterRoleBinding")?))
        }
        _ => {
            return Err(ManifestError::UnexpectedKind {
                source_name: source_name.to_owned(),
                api_version: api_version.to_owned(),
                kind: kind.to_owned(),
            });
        }
    })
}

/// Deserializes `doc` as `T` and checks that writing it back loses nothing.
pub fn strict<T: DeserializeOwned + Serialize>(
    doc: &Value,
    source_name: &str,
    kind: &'static str,
) -> Result<T, ManifestError> {
    let invalid = |message: String| ManifestError::Invalid {
        source_name: source_name.to_owned(),
        kind,
        message,
    };
    let object: T = serde_json::from_value(doc.clone()).map_err(|e| invalid(e.to_string()))?;
    let back = serde_json::to_value(&object).map_err(|e| invalid(e.to_string()))?;
    let mut fields = Vec::new();
    lost_fields(doc, &back, "", &mut fields);
    if fields.is_empty() {
        Ok(object)
    } else {
        Err(ManifestError::UnknownFields {
            source_name: source_name.to_owned(),
            kind,
            fields,
        })
    }
}

/// Paths of the fields of `original` that `back` does not have. An empty
/// map or list counts as absent: the typed structs may drop them.
fn lost_fields(original: &Value, back: &Value, path: &str, out: &mut Vec<String>) {
    let is_empty = |v: &Value| match v {
        Value::Null => true,
        Value::Object(map) => map.is_empty(),
        Value::Array(list) => list.is_empty(),
        _ => false,
    };
    match (original, back) {
        (Value::Object(fields), Value::Object(kept)) => {
            for (name, value) in fields {
                let here = format!("{path}.{name}");
                match kept.get(name) {
                    None if !is_empty(value) => out.push(here),
                    None => {}
                    Some(kept_value) => lost_fields(value, kept_value, &here, out),
                }
            }
        }
        (Value::Array(items), Value::Array(kept)) => {
            for (index, (item, kept_item)) in items.iter().zip(kept).enumerate() {
                lost_fields(item, kept_item, &format!("{path}[{index}]"), out);
            }
        }
        _ => {}
    }
}

/// The files of `deploy/kubernetes` that its kustomization lists, as
/// objects, and the kustomization itself.
pub fn kubernetes_manifests() -> Result<(Objects, Value), ManifestError> {
    kustomization_manifests("kubernetes")
}

/// The objects of the kustomization in `deploy/<sub>` (its resources,
/// paths relative to it), and the kustomization itself.
pub fn kustomization_manifests(sub: &str) -> Result<(Objects, Value), ManifestError> {
    let dir = Path::new(DEPLOY_DIR).join(sub);
    let read = |name: &str| {
        std::fs::read_to_string(dir.join(name)).map_err(|e| ManifestError::Yaml {
            source_name: name.to_owned(),
            message: e.to_string(),
        })
    };
    let kustomization = documents(&read("kustomization.yaml")?, "kustomization.yaml")?
        .pop()
        .unwrap_or_default();
    let mut all = Objects::default();
    for resource in kustomization["resources"].as_array().into_iter().flatten() {
        let name = resource.as_str().unwrap_or_default();
        all.0.extend(objects(&read(name)?, name)?.0);
    }
    Ok((all, kustomization))
}

/// The chart's directory.
pub fn chart_dir() -> PathBuf {
    Path::new(DEPLOY_DIR).join("helm/vpcnet")
}

/// `helm template RELEASE <the chart> --namespace kube-system ARGS...`
/// with the `helm` at `helm`: the rendered text.
pub fn helm_template(helm: &str, release: &str, args: &[&str]) -> Result<String, ManifestError> {
    output_of(
        Command::new(helm)
            .args(["template", release])
            .arg(chart_dir())
            .args(["--namespace", "kube-system"])
            .args(args),
    )
}

/// Runs `command` and returns its standard output; a failure quotes its
/// standard error.
pub fn output_of(command: &mut Command) -> Result<String, ManifestError> {
    let line = format!("{command:?}");
    let output = command.output().map_err(|e| ManifestError::Tool {
        command: line.clone(),
        message: e.to_string(),
    })?;
    if !output.status.success() {
        return Err(ManifestError::Tool {
            command: line,
            message: format!(
                "{}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG_MAP: &str = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n";

    #[test]
    fn a_field_the_kind_does_not_have_is_named() {
        let text = format!("{CONFIG_MAP}  labelz:\n    a: b\ndata:\n  A: \"1\"\n");
        let err = objects(&text, "x.yaml").unwrap_err();
        match err {
            ManifestError::UnknownFields { fields, .. } => {
                assert_eq!(fields, vec![".metadata.labelz".to_owned()]);
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn a_wrong_type_or_kind_is_an_error() {
        let text = format!("{CONFIG_MAP}data:\n  A: [1]\n");
        assert!(matches!(
            objects(&text, "x.yaml"),
            Err(ManifestError::Invalid { .. })
        ));
        assert!(matches!(
            objects("apiVersion: v1\nkind: Secret\n", "x.yaml"),
            Err(ManifestError::UnexpectedKind { .. })
        ));
        assert!(matches!(
            objects("a: 1\n", "x.yaml"),
            Err(ManifestError::NoKind { .. })
        ));
    }

    #[test]
    fn documents_split_and_empty_ones_skip() {
        let text = format!("---\n{CONFIG_MAP}---\n---\n{CONFIG_MAP}");
        assert_eq!(objects(&text, "x.yaml").unwrap().0.len(), 2);
    }
}
