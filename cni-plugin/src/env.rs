//! The CNI environment variables: the command, the attachment
//! (`CNI_CONTAINERID`, `CNI_NETNS`, `CNI_IFNAME`) and `CNI_ARGS`, with the
//! Kubernetes pod they name.

use crate::error::{CniError, code};

/// `CNI_COMMAND`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Status,
    Gc,
    Version,
}

impl Command {
    /// The command named by `CNI_COMMAND`.
    pub fn from_env(value: Option<&str>) -> Result<Self, CniError> {
        match value {
            None | Some("") => Err(CniError::new(
                code::INVALID_ENV,
                "required env variables [CNI_COMMAND] missing",
                "",
            )),
            Some("ADD") => Ok(Self::Add),
            Some("DEL") => Ok(Self::Del),
            Some("CHECK") => Ok(Self::Check),
            Some("STATUS") => Ok(Self::Status),
            Some("GC") => Ok(Self::Gc),
            Some("VERSION") => Ok(Self::Version),
            Some(other) => Err(CniError::new(
                code::INVALID_ENV,
                "invalid CNI_COMMAND",
                format!("{other:?} is not one of ADD, DEL, CHECK, STATUS, GC, VERSION"),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Add => "ADD",
            Self::Del => "DEL",
            Self::Check => "CHECK",
            Self::Status => "STATUS",
            Self::Gc => "GC",
            Self::Version => "VERSION",
        }
    }

    /// Whether the command is about one attachment (and needs
    /// `CNI_CONTAINERID` and `CNI_IFNAME`).
    fn per_attachment(self) -> bool {
        matches!(self, Self::Add | Self::Del | Self::Check)
    }

    /// Whether the command needs `CNI_NETNS` (DEL must work without it:
    /// the namespace may be gone already).
    fn needs_netns(self) -> bool {
        matches!(self, Self::Add | Self::Check)
    }
}

/// The Kubernetes arguments of `CNI_ARGS` (what kubelet's CRI runtime
/// passes), empty when absent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct K8sArgs {
    pub pod_namespace: String,
    pub pod_name: String,
    pub infra_container_id: String,
    pub pod_uid: String,
}

/// Parses `CNI_ARGS` ("K=V;K2=V2"), as libcni's `LoadArgs` does: a key the
/// plugin does not know is an error unless `IgnoreUnknown` is true (kubelet
/// always sets it).
pub fn parse_cni_args(args: &str) -> Result<K8sArgs, CniError> {
    let invalid = |details: String| CniError::new(code::INVALID_ENV, "invalid CNI_ARGS", details);
    let mut k8s = K8sArgs::default();
    let mut ignore_unknown = false;
    let mut unknown = Vec::new();
    for pair in args.split(';').filter(|pair| !pair.is_empty()) {
        let mut parts = pair.split('=');
        let (Some(key), Some(value), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(invalid(format!("{pair:?} is not KEY=VALUE")));
        };
        match key {
            "K8S_POD_NAMESPACE" => value.clone_into(&mut k8s.pod_namespace),
            "K8S_POD_NAME" => value.clone_into(&mut k8s.pod_name),
            "K8S_POD_INFRA_CONTAINER_ID" => value.clone_into(&mut k8s.infra_container_id),
            "K8S_POD_UID" => value.clone_into(&mut k8s.pod_uid),
            "IgnoreUnknown" => {
                ignore_unknown = match value.to_ascii_lowercase().as_str() {
                    "1" | "true" => true,
                    "0" | "false" => false,
                    _ => return Err(invalid(format!("IgnoreUnknown={value:?} is not a boolean"))),
                };
            }
            _ => unknown.push(pair),
        }
    }
    if !unknown.is_empty() && !ignore_unknown {
        return Err(invalid(format!(
            "unknown args [{}] (set IgnoreUnknown=1 to ignore them)",
            unknown.join(",")
        )));
    }
    Ok(k8s)
}

/// Whether `id` is a valid container id (and network name): an
/// alphanumeric character, then alphanumerics, `_`, `.` or `-`.
pub fn valid_name(id: &str) -> bool {
    let mut chars = id.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// Why `name` cannot be a Linux interface name, if it cannot.
pub fn invalid_ifname(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("is empty")
    } else if name.len() > 15 {
        Some("is longer than 15 bytes")
    } else if name == "." || name == ".." {
        Some("is . or ..")
    } else if name
        .chars()
        .any(|c| c == '/' || c == ':' || c.is_whitespace())
    {
        Some("contains /, : or whitespace")
    } else {
        None
    }
}

/// The attachment a command is about.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Env {
    pub container_id: String,
    /// Empty when the runtime passed none (DEL after the namespace went).
    pub netns: String,
    pub ifname: String,
    pub k8s: K8sArgs,
}

impl Env {
    /// Reads and checks the variables `command` needs; every missing one
    /// is named in one error, as libcni does.
    pub fn from_lookup(
        command: Command,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, CniError> {
        let get = |name: &str| lookup(name).unwrap_or_default();
        let env = Self {
            container_id: get("CNI_CONTAINERID"),
            netns: get("CNI_NETNS"),
            ifname: get("CNI_IFNAME"),
            k8s: K8sArgs::default(),
        };
        let mut missing = Vec::new();
        if command.per_attachment() {
            if env.container_id.is_empty() {
                missing.push("CNI_CONTAINERID");
            }
            if command.needs_netns() && env.netns.is_empty() {
                missing.push("CNI_NETNS");
            }
            if env.ifname.is_empty() {
                missing.push("CNI_IFNAME");
            }
        }
        if !missing.is_empty() {
            return Err(CniError::new(
                code::INVALID_ENV,
                format!("required env variables [{}] missing", missing.join(",")),
                "",
            ));
        }
        if !command.per_attachment() {
            return Ok(env);
        }
        if !valid_name(&env.container_id) {
            return Err(CniError::new(
                code::INVALID_ENV,
                "invalid characters in CNI_CONTAINERID",
                env.container_id,
            ));
        }
        if let Some(why) = invalid_ifname(&env.ifname) {
            return Err(CniError::new(
                code::INVALID_ENV,
                format!("invalid CNI_IFNAME: {why}"),
                env.ifname,
            ));
        }
        let k8s = parse_cni_args(&get("CNI_ARGS"))?;
        Ok(Self { k8s, ..env })
    }

    /// The pod as logs name it: `namespace/name`, or the container id when
    /// `CNI_ARGS` has no pod.
    pub fn pod_label(&self) -> String {
        if self.k8s.pod_name.is_empty() {
            format!("container {}", self.container_id)
        } else {
            format!("{}/{}", self.k8s.pod_namespace, self.k8s.pod_name)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env_of(command: Command, vars: &[(&str, &str)]) -> Result<Env, CniError> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Env::from_lookup(command, |name| vars.get(name).cloned())
    }

    #[test]
    fn kubelet_args_parse() {
        let args = parse_cni_args(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc123;K8S_POD_UID=5f1e",
        )
        .unwrap();
        assert_eq!(
            args,
            K8sArgs {
                pod_namespace: "default".into(),
                pod_name: "web-0".into(),
                infra_container_id: "abc123".into(),
                pod_uid: "5f1e".into(),
            }
        );
        assert_eq!(parse_cni_args("").unwrap(), K8sArgs::default());
        // Unknown keys are fine with IgnoreUnknown, wherever it is.
        let args = parse_cni_args("FOO=bar;K8S_POD_NAME=p;IgnoreUnknown=true").unwrap();
        assert_eq!(args.pod_name, "p");
    }

    #[test]
    fn bad_args_are_invalid_env() {
        for (args, needle) in [
            ("FOO=bar", "unknown args [FOO=bar]"),
            ("FOO=bar;IgnoreUnknown=0", "unknown args"),
            ("K8S_POD_NAME", "is not KEY=VALUE"),
            ("K8S_POD_NAME=a=b", "is not KEY=VALUE"),
            ("IgnoreUnknown=maybe", "not a boolean"),
        ] {
            let err = parse_cni_args(args).unwrap_err();
            assert_eq!(err.code, code::INVALID_ENV, "{args}");
            assert!(err.details.contains(needle), "{args}: {err:?}");
        }
    }

    #[test]
    fn missing_variables_are_named_together() {
        let err = env_of(Command::Add, &[]).unwrap_err();
        assert_eq!(err.code, code::INVALID_ENV);
        assert_eq!(
            err.msg,
            "required env variables [CNI_CONTAINERID,CNI_NETNS,CNI_IFNAME] missing"
        );
        // DEL does without the namespace.
        let env = env_of(
            Command::Del,
            &[("CNI_CONTAINERID", "c1"), ("CNI_IFNAME", "eth0")],
        )
        .unwrap();
        assert_eq!(env.netns, "");
        // STATUS and GC need none of them.
        assert!(env_of(Command::Gc, &[]).is_ok());
        assert!(env_of(Command::Status, &[]).is_ok());
    }

    #[test]
    fn invalid_values_are_named() {
        let base = [("CNI_NETNS", "/var/run/netns/x"), ("CNI_IFNAME", "eth0")];
        let err = env_of(
            Command::Add,
            &[&base[..], &[("CNI_CONTAINERID", "-bad")]].concat(),
        )
        .unwrap_err();
        assert_eq!(err.msg, "invalid characters in CNI_CONTAINERID");
        let err = env_of(
            Command::Add,
            &[
                ("CNI_CONTAINERID", "c1"),
                ("CNI_NETNS", "/x"),
                ("CNI_IFNAME", "a-very-long-interface-name"),
            ],
        )
        .unwrap_err();
        assert_eq!(err.msg, "invalid CNI_IFNAME: is longer than 15 bytes");
        let err = env_of(
            Command::Add,
            &[
                ("CNI_CONTAINERID", "c1"),
                ("CNI_NETNS", "/x"),
                ("CNI_IFNAME", "eth:0"),
            ],
        )
        .unwrap_err();
        assert!(err.msg.starts_with("invalid CNI_IFNAME"), "{err:?}");
        let err = env_of(
            Command::Add,
            &[&base[..], &[("CNI_CONTAINERID", "c1"), ("CNI_ARGS", "X=1")]].concat(),
        )
        .unwrap_err();
        assert_eq!(err.msg, "invalid CNI_ARGS");
    }

    #[test]
    fn commands_parse() {
        assert_eq!(Command::from_env(Some("GC")).unwrap(), Command::Gc);
        assert_eq!(
            Command::from_env(None).unwrap_err().msg,
            "required env variables [CNI_COMMAND] missing"
        );
        assert_eq!(
            Command::from_env(Some("add")).unwrap_err().code,
            code::INVALID_ENV
        );
    }

    #[test]
    fn names_are_checked_like_libcni() {
        assert!(valid_name("0a1b2c"));
        assert!(valid_name("aws-cni"));
        assert!(valid_name("a_b.c-d"));
        assert!(!valid_name(""));
        assert!(!valid_name("_a"));
        assert!(!valid_name("a/b"));
        assert_eq!(invalid_ifname("eth0"), None);
        assert!(invalid_ifname("").is_some());
        assert!(invalid_ifname("..").is_some());
        assert!(invalid_ifname("a b").is_some());
    }
}
