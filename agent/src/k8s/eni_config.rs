//! Custom networking's ENIConfig objects (`crd.k8s.amazonaws.com/v1alpha1`,
//! cluster-scoped, `spec: {subnet, securityGroups}`): the subnet and
//! security groups of the node's new ENIs, from the ENIConfig its Node
//! names ([`super::node::NodeView::eni_config`]), followed as the objects
//! and the Node's choice change.
//!
//! As aws-node, a new config applies to ENIs attached after it; the ENIs
//! already attached stay. Where aws-node fails every ENI while the
//! ENIConfig is missing or unreadable, the node here keeps the config in
//! force (if there was none, no ENI for pods is attached), with one error
//! naming the object and what is wrong. The objects are read untyped so a
//! malformed one is reported, not dropped by the watch.

use std::collections::BTreeMap;

use futures_util::StreamExt;
use kube::{
    Api,
    api::{ApiResource, DynamicObject},
    runtime::{WatchStreamExt, watcher},
};
use serde_json::Value;
use tokio::sync::watch;
use tracing::{error, info, warn};

use super::node::NodeViews;
use crate::ipam::settings::EniConfig;

pub const GROUP: &str = "crd.k8s.amazonaws.com";
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "ENIConfig";
pub const PLURAL: &str = "eniconfigs";

/// The kind, for kube-rs's untyped API.
fn api_resource() -> ApiResource {
    ApiResource {
        group: GROUP.to_owned(),
        version: VERSION.to_owned(),
        api_version: format!("{GROUP}/{VERSION}"),
        kind: KIND.to_owned(),
        plural: PLURAL.to_owned(),
    }
}

/// Why the node's ENIConfig cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EniConfigProblem {
    #[error("ENIConfig {name:?} does not exist")]
    Missing { name: String },
    #[error("ENIConfig {name:?} is malformed: {why}")]
    Malformed { name: String, why: String },
}

/// The subnet and security groups an ENIConfig object gives, checked as the
/// CRD's schema and EC2 would (a subnet id, security group ids).
pub fn parse(name: &str, object: &DynamicObject) -> Result<EniConfig, EniConfigProblem> {
    let malformed = |why: String| EniConfigProblem::Malformed {
        name: name.to_owned(),
        why,
    };
    let spec = match object.data.get("spec") {
        Some(Value::Object(spec)) => spec,
        Some(other) => return Err(malformed(format!("spec is not an object: {other}"))),
        None => return Err(malformed("it has no spec".to_owned())),
    };
    let subnet_id = match spec.get("subnet") {
        Some(Value::String(subnet)) if subnet.starts_with("subnet-") => subnet.clone(),
        Some(Value::String(subnet)) if subnet.is_empty() => {
            return Err(malformed("spec.subnet is empty".to_owned()));
        }
        Some(Value::String(subnet)) => {
            return Err(malformed(format!(
                "spec.subnet {subnet:?} is not a subnet id (subnet-...)"
            )));
        }
        Some(Value::Null) | None => return Err(malformed("spec.subnet is missing".to_owned())),
        Some(other) => return Err(malformed(format!("spec.subnet is not a string: {other}"))),
    };
    let security_groups = match spec.get("securityGroups") {
        Some(Value::Null) | None => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                Value::String(group) if group.starts_with("sg-") => Ok(group.clone()),
                other => Err(malformed(format!(
                    "spec.securityGroups holds {other}, not a security group id (sg-...)"
                ))),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(malformed(format!(
                "spec.securityGroups is not a list: {other}"
            )));
        }
    };
    Ok(EniConfig {
        name: Some(name.to_owned()),
        subnet_id,
        security_groups,
    })
}

/// The config for the ENIConfig named `name` among `known`.
fn choose(
    name: &str,
    known: &BTreeMap<String, DynamicObject>,
) -> Result<EniConfig, EniConfigProblem> {
    let object = known.get(name).ok_or_else(|| EniConfigProblem::Missing {
        name: name.to_owned(),
    })?;
    parse(name, object)
}

/// Follows the ENIConfig objects and the Node's choice among them,
/// publishing the config new ENIs use on `configs` when it changes. A
/// missing or malformed ENIConfig is logged once (until the choice or the
/// object changes) and leaves the config in force. Runs until every
/// subscriber is gone or the task is dropped.
pub async fn follow(
    client: kube::Client,
    mut node: NodeViews,
    configs: watch::Sender<Option<EniConfig>>,
) {
    let objects = Api::<DynamicObject>::all_with(client, &api_resource());
    let mut events = watcher(objects, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut known: BTreeMap<String, DynamicObject> = BTreeMap::new();
    let mut listing: Option<BTreeMap<String, DynamicObject>> = None;
    let mut listed = false;
    let mut failing: Option<String> = None;
    let mut said: Option<EniConfigProblem> = None;
    loop {
        tokio::select! {
            event = events.next() => {
                let Some(event) = event else { return };
                let key = |o: &DynamicObject| o.metadata.name.clone().unwrap_or_default();
                match event {
                    Ok(watcher::Event::Init) => listing = Some(BTreeMap::new()),
                    Ok(watcher::Event::InitApply(object)) => {
                        if let Some(listing) = listing.as_mut() {
                            listing.insert(key(&object), object);
                        }
                    }
                    Ok(watcher::Event::InitDone) => {
                        if let Some(listed_now) = listing.take() {
                            known = listed_now;
                            listed = true;
                        }
                    }
                    Ok(watcher::Event::Apply(object)) => {
                        known.insert(key(&object), object);
                    }
                    Ok(watcher::Event::Delete(object)) => {
                        known.remove(&key(&object));
                    }
                    Err(e) => {
                        let e = e.to_string();
                        if failing.as_ref() != Some(&e) {
                            warn!(error = %e, "watching ENIConfigs: retrying with backoff");
                            failing = Some(e);
                        }
                        continue;
                    }
                }
                if failing.take().is_some() {
                    info!("watching ENIConfigs again");
                }
            }
            changed = node.changed() => if changed.is_err() { return },
            () = configs.closed() => return,
        }
        let Some(name) = node
            .borrow_and_update()
            .as_ref()
            .map(|view| view.eni_config.clone())
        else {
            continue;
        };
        if !listed || listing.is_some() {
            continue;
        }
        match choose(&name, &known) {
            Ok(config) => {
                said = None;
                if configs.borrow().as_ref() != Some(&config) {
                    info!(
                        eni_config = %name,
                        subnet = %config.subnet_id,
                        security_groups = ?config.security_groups,
                        "custom networking: new ENIs from this ENIConfig (empty security groups: the primary ENI's)"
                    );
                    configs.send_replace(Some(config));
                }
            }
            Err(problem) if said.as_ref() != Some(&problem) => {
                let kept = configs.borrow().as_ref().map_or_else(
                    || "none: no ENI for pods is attached until it is fixed".to_owned(),
                    |c| format!("{} ({})", c.source(), c.subnet_id),
                );
                error!(eni_config = %name, %problem, config_kept = %kept, "custom networking: the node's ENIConfig cannot be used");
                said = Some(problem);
            }
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn object(value: Value) -> DynamicObject {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn an_eniconfig_gives_its_subnet_and_groups() {
        let config = parse(
            "us-west-2a",
            &object(
                json!({"apiVersion": "crd.k8s.amazonaws.com/v1alpha1", "kind": "ENIConfig",
                "metadata": {"name": "us-west-2a"},
                "spec": {"subnet": "subnet-0pods", "securityGroups": ["sg-1", "sg-2"]}}),
            ),
        )
        .unwrap();
        assert_eq!(config.subnet_id, "subnet-0pods");
        assert_eq!(config.security_groups, ["sg-1", "sg-2"]);
        assert_eq!(config.source(), "ENIConfig us-west-2a");
        let no_groups = parse(
            "a",
            &object(json!({"metadata": {"name": "a"}, "spec": {"subnet": "subnet-1"}})),
        )
        .unwrap();
        assert!(no_groups.security_groups.is_empty());
    }

    #[test]
    fn a_malformed_eniconfig_says_what_is_wrong() {
        let why = |spec: Value| {
            parse(
                "bad",
                &object(json!({"metadata": {"name": "bad"}, "spec": spec})),
            )
            .unwrap_err()
            .to_string()
        };
        assert_eq!(
            why(json!({"securityGroups": ["sg-1"]})),
            r#"ENIConfig "bad" is malformed: spec.subnet is missing"#
        );
        assert!(
            why(json!({"subnet": "pods"})).contains(r#"spec.subnet "pods" is not a subnet id"#)
        );
        assert!(why(json!({"subnet": 7})).contains("spec.subnet is not a string: 7"));
        assert!(
            why(json!({"subnet": "subnet-1", "securityGroups": "sg-1"}))
                .contains("spec.securityGroups is not a list")
        );
        assert!(
            why(json!({"subnet": "subnet-1", "securityGroups": ["default"]}))
                .contains(r#"spec.securityGroups holds "default""#)
        );
        assert!(
            parse("bad", &object(json!({"metadata": {"name": "bad"}})))
                .unwrap_err()
                .to_string()
                .contains("it has no spec")
        );
        assert_eq!(
            choose("gone", &BTreeMap::new()).unwrap_err().to_string(),
            r#"ENIConfig "gone" does not exist"#
        );
    }
}
