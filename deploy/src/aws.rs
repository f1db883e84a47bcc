//! vpcnet's AWS credentials as files of `deploy/aws/`: the IAM policy the
//! agent needs and the trust policies of its role (IRSA, EKS Pod
//! Identity), and the EC2 operations the agent's source calls, to check
//! the policy with.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use serde_json::Value;

use crate::{DEPLOY_DIR, ManifestError};

/// The EC2 actions the agent calls, and nothing more.
pub const IAM_POLICY: &str = "aws/iam-policy.json";
/// The role's trust policy for IRSA (`ACCOUNT_ID` and `OIDC_PROVIDER` to
/// fill in).
pub const IRSA_TRUST_POLICY: &str = "aws/irsa-trust-policy.json";
/// The role's trust policy for EKS Pod Identity.
pub const POD_IDENTITY_TRUST_POLICY: &str = "aws/pod-identity-trust-policy.json";

/// The JSON file `file` of `deploy/`.
pub fn read_json(file: &str) -> Result<Value, ManifestError> {
    let path = Path::new(DEPLOY_DIR).join(file);
    let text = std::fs::read_to_string(&path).map_err(|e| ManifestError::Tool {
        command: format!("reading {}", path.display()),
        message: e.to_string(),
    })?;
    serde_json::from_str(&text).map_err(|e| ManifestError::Yaml {
        source_name: file.to_owned(),
        message: e.to_string(),
    })
}

/// The EC2 operations Rust `source` calls on a client named `ec2`
/// (`self.ec2.describe_subnets()`, or the call on the next line), as IAM
/// names their actions: `ec2:DescribeSubnets`.
#[must_use]
pub fn ec2_operations(source: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = source;
    while let Some(at) = rest.find(".ec2") {
        rest = &rest[at + ".ec2".len()..];
        let Some(call) = rest.trim_start().strip_prefix('.') else {
            continue;
        };
        let name: String = call
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() && call[name.len()..].starts_with('(') {
            found.insert(format!("ec2:{}", pascal_case(&name)));
        }
    }
    found
}

/// `describe_subnets` as `DescribeSubnets`.
fn pascal_case(snake: &str) -> String {
    snake
        .split('_')
        .map(|word| {
            let mut chars = word.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_ascii_uppercase().to_string() + chars.as_str()
            })
        })
        .collect()
}

/// One string or a list of them, as IAM writes `Action` and `Resource`.
fn strings(value: &Value) -> Vec<String> {
    match value {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) => items
            .iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect(),
        _ => Vec::new(),
    }
}

/// Each action `policy` allows, with the resources it allows it on.
#[must_use]
pub fn allowed_actions(policy: &Value) -> BTreeMap<String, BTreeSet<String>> {
    let mut allowed: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for statement in policy["Statement"].as_array().into_iter().flatten() {
        if statement["Effect"] != "Allow" {
            continue;
        }
        let resources = strings(&statement["Resource"]);
        for action in strings(&statement["Action"]) {
            allowed
                .entry(action)
                .or_default()
                .extend(resources.iter().cloned());
        }
    }
    allowed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_operations_called_on_the_ec2_client_are_named_as_iam_actions() {
        let source = "let out = self.ec2.describe_subnets().subnet_ids(id);\n\
                      self\n    .ec2\n    .create_network_interface()\n\
                      // the ec2 field, not a call: self.ec2\n\
                      let ec2 = aws_sdk_ec2::Client::new(); x.ec2s.run();";
        assert_eq!(
            ec2_operations(source),
            BTreeSet::from([
                "ec2:CreateNetworkInterface".to_owned(),
                "ec2:DescribeSubnets".to_owned()
            ])
        );
    }

    #[test]
    fn allowed_actions_read_strings_and_lists_of_allow_statements() {
        let policy = serde_json::json!({
            "Statement": [
                {"Effect": "Allow", "Action": "ec2:A", "Resource": "*"},
                {"Effect": "Allow", "Action": ["ec2:B", "ec2:A"], "Resource": ["arn:x"]},
                {"Effect": "Deny", "Action": "ec2:C", "Resource": "*"},
            ]
        });
        let allowed = allowed_actions(&policy);
        assert_eq!(allowed.keys().collect::<Vec<_>>(), ["ec2:A", "ec2:B"]);
        assert_eq!(allowed["ec2:A"].len(), 2);
    }
}
