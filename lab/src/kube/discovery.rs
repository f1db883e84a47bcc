//! Discovery and OpenAPI documents, from the table of served kinds.
//!
//! Legacy discovery only (`/api`, `/apis`, `/apis/<g>/<v>`): client-go
//! reads the answer's content type and falls back to it. The OpenAPI v3
//! documents hold one PATCH operation per kind that declares the
//! `fieldValidation` parameter: that is what kubectl's `--validate=strict`
//! checks before it lets the server validate.

use serde_json::{Value, json};

use super::resources::{self, VERBS};

/// The hash kubectl caches OpenAPI documents by; the documents never change
/// while the server runs.
const OPENAPI_HASH: &str = "vpcnet-lab-1";

fn group_version_json(group: &str, version: &str) -> Value {
    json!({"groupVersion": format!("{group}/{version}"), "version": version})
}

fn api_group(group: &str) -> Option<Value> {
    let versions: Vec<Value> = resources::group_versions()
        .into_iter()
        .filter(|(g, _)| *g == group)
        .map(|(g, v)| group_version_json(g, v))
        .collect();
    let preferred = versions.first()?.clone();
    Some(json!({"name": group, "versions": versions, "preferredVersion": preferred}))
}

/// `/apis`.
pub fn group_list() -> Value {
    let mut groups: Vec<&str> = Vec::new();
    for (group, _) in resources::group_versions() {
        if !group.is_empty() && !groups.contains(&group) {
            groups.push(group);
        }
    }
    json!({
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": groups.into_iter().filter_map(api_group).collect::<Vec<_>>(),
    })
}

/// `/apis/<group>`.
pub fn group(group: &str) -> Option<Value> {
    let mut document = api_group(group)?;
    document["kind"] = json!("APIGroup");
    document["apiVersion"] = json!("v1");
    Some(document)
}

/// `/api/v1` or `/apis/<group>/<version>`.
pub fn resource_list(group: &str, version: &str) -> Option<Value> {
    let served: Vec<Value> = resources::served()
        .filter(|r| r.group == group && r.version == version)
        .map(|r| {
            json!({
                "name": r.plural,
                "singularName": r.singular,
                "namespaced": r.namespaced,
                "kind": r.kind,
                "verbs": VERBS,
                "shortNames": r.short_names,
            })
        })
        .collect();
    if served.is_empty() {
        return None;
    }
    let group_version = if group.is_empty() {
        version.to_owned()
    } else {
        format!("{group}/{version}")
    };
    Some(json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": served,
    }))
}

fn openapi_path(group: &str, version: &str) -> String {
    if group.is_empty() {
        format!("api/{version}")
    } else {
        format!("apis/{group}/{version}")
    }
}

/// `/openapi/v3`.
pub fn openapi_index() -> Value {
    let paths: serde_json::Map<String, Value> = resources::group_versions()
        .into_iter()
        .map(|(group, version)| {
            let path = openapi_path(group, version);
            let url = format!("/openapi/v3/{path}?hash={OPENAPI_HASH}");
            (path, json!({"serverRelativeURL": url}))
        })
        .collect();
    json!({"paths": paths})
}

/// `/openapi/v3/<api/v1 | apis/g/v>`.
pub fn openapi_group_version(path: &str) -> Option<Value> {
    let (group, version) = resources::group_versions()
        .into_iter()
        .find(|(g, v)| openapi_path(g, v) == path)?;
    let paths: serde_json::Map<String, Value> = resources::served()
        .filter(|r| r.group == group && r.version == version)
        .map(|r| {
            let object_path = if r.namespaced {
                format!("{}/namespaces/{{namespace}}/{}/{{name}}", r.base_path(), r.plural)
            } else {
                format!("{}/{}/{{name}}", r.base_path(), r.plural)
            };
            let operation = json!({"patch": {
                "x-kubernetes-group-version-kind": {"group": r.group, "version": r.version, "kind": r.kind},
                "parameters": [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}],
                "responses": {},
            }});
            (object_path, operation)
        })
        .collect();
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (vpcnet lab)", "version": "v1.33.0"},
        "components": {"schemas": {}},
        "paths": paths,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_group_version_is_discoverable_and_has_an_openapi_document() {
        for (group, version) in resources::group_versions() {
            let list = resource_list(group, version).unwrap();
            assert!(!list["resources"].as_array().unwrap().is_empty());
            let index = openapi_index();
            let url = index["paths"][openapi_path(group, version)]["serverRelativeURL"]
                .as_str()
                .unwrap()
                .to_owned();
            let path = url
                .strip_prefix("/openapi/v3/")
                .and_then(|p| p.split('?').next())
                .unwrap();
            assert!(openapi_group_version(path).is_some(), "{url}");
        }
        let groups = group_list();
        assert!(
            groups["groups"]
                .as_array()
                .unwrap()
                .iter()
                .any(|g| g["name"] == "vpcresources.k8s.aws")
        );
        assert!(group("nothing").is_none());
    }
}
