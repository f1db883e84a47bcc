//! vpcnet's AWS credentials: the IAM policy in `deploy/aws/` grants the EC2
//! actions the agent calls and nothing else, all of them within aws-node's
//! managed policy; the trust policies name the agent's ServiceAccount as
//! the manifests and the chart create it; the guide says all of it.

use std::{collections::BTreeSet, path::Path};

use vpcnet_deploy::{DEPLOY_DIR, Objects, aws, kubernetes_manifests, objects};
use vpcnet_lab::kube_tools::HELM;

/// What `AmazonEKS_CNI_Policy` (version 5, the default since March 2024)
/// allows on every resource; and `ec2:CreateTags`, on network interfaces
/// only.
const AMAZON_EKS_CNI_POLICY: &[&str] = &[
    "ec2:AssignPrivateIpAddresses",
    "ec2:AttachNetworkInterface",
    "ec2:CreateNetworkInterface",
    "ec2:DeleteNetworkInterface",
    "ec2:DescribeInstances",
    "ec2:DescribeTags",
    "ec2:DescribeNetworkInterfaces",
    "ec2:DescribeInstanceTypes",
    "ec2:DescribeSubnets",
    "ec2:DetachNetworkInterface",
    "ec2:ModifyNetworkInterfaceAttribute",
    "ec2:UnassignPrivateIpAddresses",
];

/// The resources `ec2:CreateTags` is allowed on, in both policies.
const NETWORK_INTERFACES: &str = "arn:aws:ec2:*:*:network-interface/*";

/// The EC2 actions the agent's cloud client calls, read from its source:
/// each operation on its `ec2` client, and `ec2:CreateTags` for the tags
/// an ENI gets when it is made (`TagSpecifications`).
fn agent_ec2_actions() -> BTreeSet<String> {
    let dir = Path::new(DEPLOY_DIR).join("../agent/src/cloud");
    let mut actions = BTreeSet::new();
    let mut tags_on_create = false;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "rs") {
            let source = std::fs::read_to_string(&path).unwrap();
            actions.extend(aws::ec2_operations(&source));
            tags_on_create |= source.contains(".tag_specifications(");
        }
    }
    if tags_on_create {
        actions.insert("ec2:CreateTags".to_owned());
    }
    actions
}

#[test]
fn the_iam_policy_grants_exactly_the_ec2_actions_the_agent_calls() {
    let called = agent_ec2_actions();
    // The agent's ENI and address management, as aws-node's ipamd does it.
    for action in [
        "ec2:CreateNetworkInterface",
        "ec2:AttachNetworkInterface",
        "ec2:AssignPrivateIpAddresses",
        "ec2:DescribeNetworkInterfaces",
        "ec2:CreateTags",
    ] {
        assert!(called.contains(action), "{action} in {called:?}");
    }
    let policy = aws::read_json(aws::IAM_POLICY).unwrap();
    assert_eq!(policy["Version"], "2012-10-17");
    let allowed = aws::allowed_actions(&policy);
    let granted: BTreeSet<String> = allowed.keys().cloned().collect();
    assert_eq!(granted, called, "deploy/{}", aws::IAM_POLICY);
    for (action, resources) in &allowed {
        let expected = if action == "ec2:CreateTags" {
            NETWORK_INTERFACES
        } else {
            "*"
        };
        assert_eq!(
            resources,
            &BTreeSet::from([expected.to_owned()]),
            "{action}"
        );
    }
    // Nothing beyond the managed policy aws-node runs with.
    for action in &called {
        assert!(
            AMAZON_EKS_CNI_POLICY.contains(&action.as_str()) || action == "ec2:CreateTags",
            "{action} is not in AmazonEKS_CNI_Policy"
        );
    }
}

/// The operator's guide lists each action of the policy, and the commands
/// that make the role.
#[test]
fn the_guide_lists_every_action_and_how_to_give_them() {
    let guide = std::fs::read_to_string(Path::new(DEPLOY_DIR).join("README.md")).unwrap();
    for action in aws::allowed_actions(&aws::read_json(aws::IAM_POLICY).unwrap()).keys() {
        assert!(guide.contains(&format!("`{action}`")), "{action}");
    }
    for needed in [
        aws::IAM_POLICY,
        aws::IRSA_TRUST_POLICY,
        aws::POD_IDENTITY_TRUST_POLICY,
        "aws eks create-pod-identity-association",
        "eks.amazonaws.com/role-arn",
        "MissingIAMPermissions",
    ] {
        assert!(
            guide.contains(needed),
            "deploy/README.md does not say {needed}"
        );
    }
}

/// `system:serviceaccount:<namespace>:<name>` of the agent's pods.
fn service_account_subject(all: &Objects) -> String {
    let ds = all.daemon_set();
    let spec = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let account = spec.service_account_name.clone().unwrap();
    assert!(
        all.service_accounts()
            .any(|sa| sa.metadata.name.as_deref() == Some(account.as_str())),
        "the rendering creates {account}"
    );
    format!(
        "system:serviceaccount:{}:{account}",
        ds.metadata.namespace.as_deref().unwrap()
    )
}

/// The IRSA trust policy lets the ServiceAccount the manifests and the
/// chart (installed as the guide says, `helm install vpcnet -n
/// kube-system`) create assume the role through the cluster's OIDC
/// provider, for STS only; Pod Identity's lets EKS's agent assume it and
/// tag the session.
#[test]
fn the_trust_policies_name_the_agents_service_account() {
    let (kustomized, _) = kubernetes_manifests().unwrap();
    let charted = objects(
        &vpcnet_deploy::helm_template(HELM, "vpcnet", &[]).unwrap(),
        "helm template",
    )
    .unwrap();
    let subject = service_account_subject(&kustomized);
    assert_eq!(subject, "system:serviceaccount:kube-system:vpcnet");
    assert_eq!(service_account_subject(&charted), subject);

    let irsa = aws::read_json(aws::IRSA_TRUST_POLICY).unwrap();
    let statements = irsa["Statement"].as_array().unwrap();
    assert_eq!(statements.len(), 1);
    let trust = &statements[0];
    assert_eq!(trust["Effect"], "Allow");
    assert_eq!(trust["Action"], "sts:AssumeRoleWithWebIdentity");
    let provider = trust["Principal"]["Federated"].as_str().unwrap();
    let (_, issuer) = provider.split_once(":oidc-provider/").unwrap();
    let conditions = trust["Condition"]["StringEquals"].as_object().unwrap();
    assert_eq!(conditions.len(), 2);
    assert_eq!(conditions[&format!("{issuer}:sub")], subject.as_str());
    assert_eq!(conditions[&format!("{issuer}:aud")], "sts.amazonaws.com");

    let pod_identity = aws::read_json(aws::POD_IDENTITY_TRUST_POLICY).unwrap();
    let trust = &pod_identity["Statement"][0];
    assert_eq!(trust["Effect"], "Allow");
    assert_eq!(trust["Principal"]["Service"], "pods.eks.amazonaws.com");
    assert_eq!(
        aws::allowed_actions(&pod_identity)
            .keys()
            .collect::<Vec<_>>(),
        ["sts:AssumeRole", "sts:TagSession"]
    );
}
