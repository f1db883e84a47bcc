//! How aws-node's network policy agent names what it pins for a pod (the
//! layouts and directories are `vpcnet_common::aws_network_policy`'s).

/// The agent's identifier of a pod: its name with `.` as `_`, without its
/// last `-` part (the pods of one ReplicaSet share it), `@` its namespace.
#[must_use]
pub fn pod_identifier(name: &str, namespace: &str) -> String {
    let name = name.replace('.', "_");
    let prefix = name
        .rsplit_once('-')
        .map_or(name.as_str(), |(head, _)| head);
    format!("{prefix}@{namespace}")
}

/// The pin of `what` (a program or map name) of the pods of `identifier`.
#[must_use]
pub fn pin_name(identifier: &str, what: &str) -> String {
    format!("{identifier}_{what}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_of_one_replica_set_share_an_identifier() {
        assert_eq!(pod_identifier("web-7d9f8-abcde", "prod"), "web-7d9f8@prod");
        assert_eq!(pod_identifier("web-7d9f8-xyz12", "prod"), "web-7d9f8@prod");
        assert_eq!(pod_identifier("db.v2-0", "x"), "db_v2@x");
        assert_eq!(pod_identifier("solo", "x"), "solo@x");
        assert_eq!(
            pin_name("solo@x", "handle_ingress"),
            "solo@x_handle_ingress"
        );
    }
}
