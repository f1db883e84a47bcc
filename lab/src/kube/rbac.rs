//! Authorisation as the real server's RBAC authoriser decides it, from the
//! roles and bindings in the store: so the lab proves that the ClusterRole
//! `deploy/` ships is enough for what the agent does.

use serde_json::Value;

use super::{
    resources::{self, Resource},
    selector::Selector,
    store::{ApiError, Store},
};

/// Who a request comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub user: String,
    pub groups: Vec<String>,
}

/// The group that may do anything.
pub const MASTERS_GROUP: &str = "system:masters";
/// The lab itself on its admin socket (kubelet, the resource controller,
/// the cluster's administrator).
pub const LAB_ADMIN_USER: &str = "vpcnet-lab-admin";

impl Identity {
    pub fn lab_admin() -> Self {
        Self {
            user: LAB_ADMIN_USER.to_owned(),
            groups: vec![MASTERS_GROUP.to_owned()],
        }
    }

    pub fn anonymous() -> Self {
        Self {
            user: "system:anonymous".to_owned(),
            groups: vec!["system:unauthenticated".to_owned()],
        }
    }

    /// The user name of ServiceAccount `name` in `namespace`.
    pub fn service_account_user(namespace: &str, name: &str) -> String {
        format!("system:serviceaccount:{namespace}:{name}")
    }

    fn is_authenticated(&self) -> bool {
        self.user != "system:anonymous"
    }

    /// The groups the server adds: every authenticated user's, and a
    /// ServiceAccount's own.
    fn all_groups(&self) -> Vec<String> {
        let mut groups = self.groups.clone();
        if self.is_authenticated() {
            groups.push("system:authenticated".to_owned());
        }
        if let Some(rest) = self.user.strip_prefix("system:serviceaccount:")
            && let Some((namespace, _)) = rest.split_once(':')
        {
            groups.push("system:serviceaccounts".to_owned());
            groups.push(format!("system:serviceaccounts:{namespace}"));
        }
        groups
    }
}

fn strings<'a>(value: &'a Value, field: &str) -> Vec<&'a str> {
    value
        .get(field)
        .and_then(Value::as_array)
        .map(|items| items.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn subject_matches(subject: &Value, identity: &Identity, groups: &[String]) -> bool {
    let field = |name: &str| {
        subject
            .get(name)
            .and_then(Value::as_str)
            .unwrap_or_default()
    };
    match field("kind") {
        "User" => field("name") == identity.user,
        "Group" => groups.iter().any(|g| g == field("name")),
        "ServiceAccount" => {
            identity.user == Identity::service_account_user(field("namespace"), field("name"))
        }
        _ => false,
    }
}

fn rule_allows(rule: &Value, verb: &str, resource: &Resource, name: Option<&str>) -> bool {
    let any_or = |items: Vec<&str>, wanted: &str| items.iter().any(|i| *i == "*" || *i == wanted);
    any_or(strings(rule, "verbs"), verb)
        && any_or(strings(rule, "apiGroups"), resource.group)
        && any_or(strings(rule, "resources"), resource.plural)
        && {
            let names = strings(rule, "resourceNames");
            names.is_empty() || name.is_some_and(|n| names.contains(&n))
        }
}

/// Whether `identity` may `verb` `resource` (in `namespace`, named `name`).
pub fn authorize(
    store: &Store,
    identity: &Identity,
    verb: &str,
    resource: &'static Resource,
    namespace: Option<&str>,
    name: Option<&str>,
) -> Result<(), ApiError> {
    let groups = identity.all_groups();
    if groups.iter().any(|g| g == MASTERS_GROUP) {
        return Ok(());
    }
    let rbac = |plural| resources::find("rbac.authorization.k8s.io", "v1", plural).expect("served");
    let everything = Selector::default();
    let role_rules = |kind: &str, role: &str, binding_namespace: Option<&str>| -> Vec<Value> {
        let found = match kind {
            "ClusterRole" => store.get(rbac("clusterroles"), None, role),
            "Role" => store.get(rbac("roles"), binding_namespace, role),
            _ => return Vec::new(),
        };
        found
            .ok()
            .and_then(|role| role.get("rules").and_then(Value::as_array).cloned())
            .unwrap_or_default()
    };
    let bound = |binding: &Value| {
        binding
            .get("subjects")
            .and_then(Value::as_array)
            .is_some_and(|subjects| {
                subjects
                    .iter()
                    .any(|s| subject_matches(s, identity, &groups))
            })
    };
    let role_ref = |binding: &Value| {
        let field = |f: &str| {
            binding
                .pointer(&format!("/roleRef/{f}"))
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        (field("kind"), field("name"))
    };
    let mut rules = Vec::new();
    for binding in store.list(rbac("clusterrolebindings"), None, &everything, &everything) {
        if bound(&binding) {
            let (kind, role) = role_ref(&binding);
            rules.extend(role_rules(&kind, &role, None));
        }
    }
    if let Some(namespace) = namespace {
        for binding in store.list(
            rbac("rolebindings"),
            Some(namespace),
            &everything,
            &everything,
        ) {
            if bound(&binding) {
                let (kind, role) = role_ref(&binding);
                rules.extend(role_rules(&kind, &role, Some(namespace)));
            }
        }
    }
    if rules
        .iter()
        .any(|rule| rule_allows(rule, verb, resource, name))
    {
        return Ok(());
    }
    let what = match name {
        Some(name) => format!("{} \"{name}\"", qualified(resource)),
        None => qualified(resource),
    };
    let scope = match namespace {
        Some(ns) => format!("in the namespace \"{ns}\""),
        None => "at the cluster scope".to_owned(),
    };
    Err(ApiError::new(
        403,
        "Forbidden",
        format!(
            "{what} is forbidden: User \"{}\" cannot {verb} resource \"{}\" in API group \"{}\" {scope}",
            identity.user, resource.plural, resource.group
        ),
    ))
}

fn qualified(resource: &Resource) -> String {
    if resource.group.is_empty() {
        resource.plural.to_owned()
    } else {
        format!("{}.{}", resource.plural, resource.group)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::kube::store::DEFAULT_HISTORY;

    #[test]
    fn a_service_account_may_do_what_its_cluster_role_binding_grants_and_nothing_else() {
        let mut store = Store::new(DEFAULT_HISTORY);
        let rbac = |plural| resources::find("rbac.authorization.k8s.io", "v1", plural).unwrap();
        store
            .create(rbac("clusterroles"), None, json!({"metadata": {"name": "agent"}, "rules": [
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["vpcresources.k8s.aws"], "resources": ["cninodes"], "verbs": ["patch"], "resourceNames": ["n1"]}
            ]}))
            .unwrap();
        store
            .create(rbac("clusterrolebindings"), None, json!({"metadata": {"name": "agent"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "agent"},
                "subjects": [{"kind": "ServiceAccount", "name": "vpcnet", "namespace": "kube-system"}]}))
            .unwrap();
        let agent = Identity {
            user: Identity::service_account_user("kube-system", "vpcnet"),
            groups: vec![],
        };
        let nodes = resources::find("", "v1", "nodes").unwrap();
        let pods = resources::find("", "v1", "pods").unwrap();
        let cninodes = resources::find("vpcresources.k8s.aws", "v1alpha1", "cninodes").unwrap();
        assert!(authorize(&store, &agent, "watch", nodes, None, None).is_ok());
        assert!(authorize(&store, &agent, "patch", cninodes, None, Some("n1")).is_ok());
        assert!(authorize(&store, &agent, "patch", cninodes, None, Some("n2")).is_err());
        let denied = authorize(&store, &agent, "list", pods, Some("default"), None).unwrap_err();
        assert_eq!(denied.code, 403);
        assert_eq!(
            denied.message,
            "pods is forbidden: User \"system:serviceaccount:kube-system:vpcnet\" cannot list resource \"pods\" in API group \"\" in the namespace \"default\""
        );
        let other = Identity {
            user: Identity::service_account_user("default", "vpcnet"),
            groups: vec![],
        };
        assert!(authorize(&store, &other, "get", nodes, None, Some("n1")).is_err());
        assert!(
            authorize(
                &store,
                &Identity::lab_admin(),
                "delete",
                pods,
                Some("default"),
                Some("x")
            )
            .is_ok()
        );
    }
}
