//! The durable IPAM state, in the VPC CNI's own checkpoint format, so that
//! vpcnet can take a node over from aws-node (and hand it back) without
//! moving a pod.
//!
//! # The format, as aws-node writes it
//!
//! Source: aws/amazon-vpc-cni-k8s, `pkg/ipamd/datastore/data_store.go`
//! (types `CheckpointData`, `CheckpointEntry`, `IPAMKey`, `IPAMMetadata`,
//! constant `CheckpointFormatVersion`, methods `ReadBackingStore` and
//! `writeBackingStoreUnsafe`), `pkg/ipamd/datastore/checkpoint.go` (type
//! `JSONFile`, the file writer) and `pkg/ipamd/ipamd.go`
//! (`defaultBackingStorePath`). aws-node has used it since v1.12.0.
//!
//! - Location: `/var/run/aws-node/ipam.json`. With several network cards,
//!   card N > 0 has a file of its own, the `.json` suffix replaced by
//!   `-nic-N.json` (`ipam-nic-1.json`); see [`network_card_path`].
//! - One JSON object with two members: `version`, a string that must be
//!   exactly `vpc-cni-ipam/1` (aws-node refuses to start on any other value,
//!   naming both), and `allocations`, an array with one object per address
//!   assigned to a pod. Only assigned addresses are recorded: the ENIs, the
//!   warm pool and the prefixes are not in the file, they are rebuilt from
//!   IMDS and EC2 and the allocations are matched against them.
//! - An allocation is keyed like a CNI attachment: `networkName` (the CNI
//!   network's name, `aws-cni` from the conflist), `containerID` (the
//!   sandbox ID the runtime passed as `CNI_CONTAINERID`) and `ifName` (the
//!   interface inside the pod, `eth0`). The three are an embedded struct in
//!   Go, so they sit flat in the entry object. Entries backfilled from the
//!   container runtime by older releases carry `_migrated-from-cri` and
//!   `unknown` as network and interface names.
//! - Then `ipv4` or `ipv6` (dotted-quad or RFC 5952 text; each left out
//!   when empty, a node being IPv4 or IPv6), `allocationTimestamp` (when the
//!   address was assigned, nanoseconds since the Unix epoch, always
//!   written) and `metadata`, an object always written, whose members are
//!   each left out when empty: `k8sPodNamespace`, `k8sPodName` and
//!   `interfacesCount` (how many interfaces a multi-NIC pod asked for).
//!   aws-node uses the pod's namespace and name, when both are present, to
//!   find the pod's host veth and drop allocations whose pod is gone.
//! - Encoding: Go's `json.Encoder`, compact, one line, ending with a
//!   newline, members in the order above. Go's decoder ignores members it
//!   does not know and leaves missing ones at their zero value; this module
//!   does the same, so a file from a newer aws-node still loads.
//! - Writing (`JSONFile.Checkpoint`): a temporary file `ipam.json.tmp*`
//!   (mode 0600) is created in the same directory, the JSON written to it,
//!   the file fsynced and renamed over the checkpoint; on an error the
//!   temporary file is removed. aws-node does not fsync the directory; this
//!   module does, so the rename itself survives a power loss.

use std::{
    ffi::OsString,
    fs::{self, File, OpenOptions},
    io::{self, Write},
    net::{Ipv4Addr, Ipv6Addr},
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
};

use serde::{Deserialize, Deserializer, Serialize};

/// The only format version aws-node writes and accepts
/// (`CheckpointFormatVersion`).
pub const CHECKPOINT_FORMAT_VERSION: &str = "vpc-cni-ipam/1";

/// Where aws-node keeps the checkpoint of network card 0.
pub const DEFAULT_CHECKPOINT_PATH: &str = "/var/run/aws-node/ipam.json";

/// The network name aws-node's CNI configuration gives (`aws-cni`).
pub const DEFAULT_NETWORK_NAME: &str = "aws-cni";

/// The file mode of the checkpoint, as Go's `os.CreateTemp` makes it.
const CHECKPOINT_MODE: u32 = 0o600;

/// How many temporary names are tried before giving up.
const TEMP_ATTEMPTS: u32 = 16;

/// The checkpoint file of a network card: `base` itself for card 0, and for
/// card N the `.json` suffix of `base` replaced by `-nic-N.json`.
pub fn network_card_path(base: &Path, network_card: u32) -> PathBuf {
    if network_card == 0 {
        return base.to_path_buf();
    }
    let text = base.to_string_lossy();
    let stem = text.strip_suffix(".json").unwrap_or(&text);
    PathBuf::from(format!("{stem}-nic-{network_card}.json"))
}

/// The whole file (`CheckpointData`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// Always [`CHECKPOINT_FORMAT_VERSION`] once read or built here.
    pub version: String,
    /// One entry per address assigned to a pod. `null` reads as empty.
    #[serde(default, deserialize_with = "null_as_default")]
    pub allocations: Vec<CheckpointEntry>,
}

/// The key of an allocation (`IPAMKey`): a CNI attachment.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
pub struct IpamKey {
    /// The CNI network's name (`aws-cni`).
    #[serde(rename = "networkName", default, deserialize_with = "null_as_default")]
    pub network_name: String,
    /// The pod sandbox's container ID.
    #[serde(rename = "containerID", default, deserialize_with = "null_as_default")]
    pub container_id: String,
    /// The interface inside the pod (`eth0`).
    #[serde(rename = "ifName", default, deserialize_with = "null_as_default")]
    pub if_name: String,
}

/// One assigned address (`CheckpointEntry`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointEntry {
    /// The attachment that holds the address; flat in the JSON object.
    #[serde(flatten)]
    pub key: IpamKey,
    /// The pod's IPv4 address, on an IPv4 node.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "optional_address"
    )]
    pub ipv4: Option<Ipv4Addr>,
    /// The pod's IPv6 address, on an IPv6 node.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "optional_address"
    )]
    pub ipv6: Option<Ipv6Addr>,
    /// When the address was assigned, in nanoseconds since the Unix epoch.
    #[serde(
        rename = "allocationTimestamp",
        default,
        deserialize_with = "null_as_default"
    )]
    pub allocation_timestamp: i64,
    /// The pod the address belongs to, when the CNI plugin said.
    #[serde(default, deserialize_with = "null_as_default")]
    pub metadata: IpamMetadata,
}

/// What is known of the pod (`IPAMMetadata`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct IpamMetadata {
    #[serde(
        rename = "k8sPodNamespace",
        default,
        skip_serializing_if = "String::is_empty",
        deserialize_with = "null_as_default"
    )]
    pub k8s_pod_namespace: String,
    #[serde(
        rename = "k8sPodName",
        default,
        skip_serializing_if = "String::is_empty",
        deserialize_with = "null_as_default"
    )]
    pub k8s_pod_name: String,
    /// How many interfaces (one per network card) the pod asked for; 0 when
    /// the plugin did not say, which aws-node reads as 1.
    #[serde(
        rename = "interfacesCount",
        default,
        skip_serializing_if = "is_zero",
        deserialize_with = "null_as_default"
    )]
    pub interfaces_count: u32,
}

/// What can go wrong with the checkpoint; every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot read the IPAM checkpoint {path}: {source}", path = path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("the IPAM checkpoint {path} is not valid {CHECKPOINT_FORMAT_VERSION} JSON: {source}", path = path.display())]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error(
        "the IPAM checkpoint {path} has format version {found:?}; only {supported:?} is supported",
        path = path.display()
    )]
    UnsupportedVersion {
        path: PathBuf,
        found: String,
        supported: &'static str,
    },
    #[error("cannot encode the IPAM checkpoint for {path}: {source}", path = path.display())]
    Encode {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("cannot write the IPAM checkpoint {path}: {step}: {source}", path = path.display())]
    Write {
        path: PathBuf,
        step: String,
        source: io::Error,
    },
}

impl Default for Checkpoint {
    fn default() -> Self {
        Self::new(Vec::new())
    }
}

impl Checkpoint {
    /// A checkpoint of the supported version holding `allocations`.
    pub fn new(allocations: Vec<CheckpointEntry>) -> Self {
        Self {
            version: CHECKPOINT_FORMAT_VERSION.to_owned(),
            allocations,
        }
    }

    /// Reads the checkpoint at `path`: `None` when there is no file (a node
    /// that never ran aws-node or vpcnet, or was rebooted and cleared), an
    /// error when it cannot be read, is not JSON of this format, or carries
    /// another version.
    pub fn read(path: &Path) -> Result<Option<Self>, CheckpointError> {
        let bytes = match fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(CheckpointError::Read {
                    path: path.to_path_buf(),
                    source,
                });
            }
        };
        Self::parse(path, &bytes).map(Some)
    }

    /// Parses the bytes of a checkpoint; `path` is only for the messages.
    /// The version is checked before the rest, so a file of another version
    /// says so rather than failing on its shape.
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Self, CheckpointError> {
        let parse_error = |source| CheckpointError::Parse {
            path: path.to_path_buf(),
            source,
        };
        let value: serde_json::Value = serde_json::from_slice(bytes).map_err(parse_error)?;
        // A missing version reads as Go's zero value, "".
        let found = value
            .get("version")
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default();
        if found != CHECKPOINT_FORMAT_VERSION {
            return Err(CheckpointError::UnsupportedVersion {
                path: path.to_path_buf(),
                found: found.to_owned(),
                supported: CHECKPOINT_FORMAT_VERSION,
            });
        }
        serde_json::from_value(value).map_err(parse_error)
    }

    /// The file's bytes as aws-node would write them: compact JSON and a
    /// newline.
    pub fn to_bytes(&self, path: &Path) -> Result<Vec<u8>, CheckpointError> {
        let mut bytes = serde_json::to_vec(self).map_err(|source| CheckpointError::Encode {
            path: path.to_path_buf(),
            source,
        })?;
        bytes.push(b'\n');
        Ok(bytes)
    }

    /// Replaces the checkpoint at `path` atomically and durably: a temporary
    /// file in the same directory is written and fsynced, renamed over
    /// `path`, and the directory fsynced. When this returns `Ok`, the new
    /// state survives a crash or a power loss; when it returns an error, the
    /// previous file is untouched (unless only the directory's fsync failed,
    /// in which case the new file is in place but possibly not durable) and
    /// the temporary file is gone. The directory must exist.
    pub fn write(&self, path: &Path) -> Result<(), CheckpointError> {
        let bytes = self.to_bytes(path)?;
        write_atomically(path, |file| file.write_all(&bytes))
    }
}

/// Removes the temporary file unless the rename consumed it.
struct TempGuard {
    path: Option<PathBuf>,
}

impl Drop for TempGuard {
    fn drop(&mut self) {
        if let Some(path) = self.path.take() {
            // Best effort: the error that got us here is the one to report.
            let _ = fs::remove_file(path);
        }
    }
}

/// The atomic replacement of `path` by what `contents` writes; `contents` is a
/// parameter so that the tests can fail it midway.
fn write_atomically(
    path: &Path,
    contents: impl FnOnce(&mut File) -> io::Result<()>,
) -> Result<(), CheckpointError> {
    let error = |step: String| {
        let path = path.to_path_buf();
        move |source| CheckpointError::Write { path, step, source }
    };
    let Some(name) = path.file_name() else {
        return Err(error("the path has no file name".to_owned())(
            io::Error::from(io::ErrorKind::InvalidInput),
        ));
    };
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };

    let (mut file, temp) = create_temp(dir, name).map_err(|(attempted, source)| {
        error(format!(
            "creating the temporary file {}",
            attempted.display()
        ))(source)
    })?;
    let mut guard = TempGuard {
        path: Some(temp.clone()),
    };
    contents(&mut file).map_err(error(format!("writing {}", temp.display())))?;
    file.sync_all()
        .map_err(error(format!("syncing {}", temp.display())))?;
    drop(file);
    fs::rename(&temp, path).map_err(error(format!("renaming {} over it", temp.display())))?;
    guard.path = None;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(error(format!("syncing the directory {}", dir.display())))?;
    Ok(())
}

/// Creates a new, exclusive temporary file next to the checkpoint, named
/// like aws-node's (`ipam.json.tmp…`) so the same clean-up finds both.
fn create_temp(
    dir: &Path,
    name: &std::ffi::OsStr,
) -> Result<(File, PathBuf), (PathBuf, io::Error)> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut last = None;
    for _ in 0..TEMP_ATTEMPTS {
        let mut temp_name = OsString::from(name);
        temp_name.push(format!(
            ".tmp{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let temp = dir.join(temp_name);
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(CHECKPOINT_MODE)
            .open(&temp)
        {
            Ok(file) => return Ok((file, temp)),
            // A leftover of a crashed process with the same PID: try another.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some((temp, e)),
            Err(e) => return Err((temp, e)),
        }
    }
    Err(last.expect("at least one attempt"))
}

fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// An address that Go may have left as `""` (or `null`): `None`.
fn optional_address<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    match Option::<String>::deserialize(deserializer)? {
        None => Ok(None),
        Some(text) if text.is_empty() => Ok(None),
        Some(text) => text.parse().map(Some).map_err(serde::de::Error::custom),
    }
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    /// A checkpoint as aws-node writes it on an IPv4 node: compact, one
    /// line, a newline at the end; two pods of the CNI network `aws-cni`,
    /// a multi-NIC pod, and an entry an older release backfilled from the
    /// container runtime (no metadata).
    const SAMPLE_V4: &str = concat!(
        r#"{"version":"vpc-cni-ipam/1","allocations":["#,
        r#"{"networkName":"aws-cni","containerID":"3f9a1c0d5e7b2a4c6d8e0f1a3b5c7d9e1f2a4b6c8d0e2f4a6b8c0d2e4f6a8b0c","#,
        r#""ifName":"eth0","ipv4":"192.168.43.17","allocationTimestamp":1718006453812345678,"#,
        r#""metadata":{"k8sPodNamespace":"kube-system","k8sPodName":"coredns-5d78c9869d-x2k8q"}},"#,
        r#"{"networkName":"aws-cni","containerID":"a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1","#,
        r#""ifName":"eth0","ipv4":"192.168.51.200","allocationTimestamp":1718006460001000000,"#,
        r#""metadata":{"k8sPodNamespace":"shop","k8sPodName":"cart-7b9f6c8d4-m4pzl","interfacesCount":2}},"#,
        r#"{"networkName":"_migrated-from-cri","containerID":"77e0c1d2b3a4958677e0c1d2b3a4958677e0c1d2b3a4958677e0c1d2b3a49586","#,
        r#""ifName":"unknown","ipv4":"192.168.60.5","allocationTimestamp":1650000000000000000,"#,
        r#""metadata":{}}"#,
        "]}\n",
    );

    /// The same on an IPv6 node.
    const SAMPLE_V6: &str = concat!(
        r#"{"version":"vpc-cni-ipam/1","allocations":["#,
        r#"{"networkName":"aws-cni","containerID":"c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5","#,
        r#""ifName":"eth0","ipv6":"2600:1f14:e3a:c901:7a2e::3","allocationTimestamp":1718006453812345678,"#,
        r#""metadata":{"k8sPodNamespace":"default","k8sPodName":"web-0"}}"#,
        "]}\n",
    );

    /// A fresh directory under the system's temporary directory, removed
    /// at the end of the test.
    struct TestDir(PathBuf);

    impl TestDir {
        fn new(name: &str) -> Self {
            static N: AtomicU64 = AtomicU64::new(0);
            let dir = std::env::temp_dir().join(format!(
                "vpcnet-checkpoint-{name}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }

        fn file(&self) -> PathBuf {
            self.0.join("ipam.json")
        }

        /// A directory whose checkpoint file already holds one entry: the
        /// previous file a failed write must keep. Its path and content too.
        fn with_previous(name: &str) -> (Self, PathBuf, Checkpoint) {
            let dir = Self::new(name);
            let path = dir.file();
            let before = Checkpoint::new(vec![entry("old", [10, 0, 0, 1], "old")]);
            before.write(&path).unwrap();
            (dir, path, before)
        }

        fn names(&self) -> Vec<String> {
            let mut names: Vec<String> = fs::read_dir(&self.0)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        }
    }

    impl Drop for TestDir {
        fn drop(&mut self) {
            let _ = fs::set_permissions(&self.0, fs::Permissions::from_mode(0o755));
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn entry(container: &str, ipv4: [u8; 4], pod: &str) -> CheckpointEntry {
        CheckpointEntry {
            key: IpamKey {
                network_name: DEFAULT_NETWORK_NAME.to_owned(),
                container_id: container.to_owned(),
                if_name: "eth0".to_owned(),
            },
            ipv4: Some(Ipv4Addr::from(ipv4)),
            ipv6: None,
            allocation_timestamp: 1_718_006_453_812_345_678,
            metadata: IpamMetadata {
                k8s_pod_namespace: "default".to_owned(),
                k8s_pod_name: pod.to_owned(),
                interfaces_count: 0,
            },
        }
    }

    #[test]
    fn sample_reads_field_by_field() {
        let path = Path::new("/var/run/aws-node/ipam.json");
        let cp = Checkpoint::parse(path, SAMPLE_V4.as_bytes()).unwrap();
        assert_eq!(cp.version, CHECKPOINT_FORMAT_VERSION);
        assert_eq!(cp.allocations.len(), 3);
        let first = &cp.allocations[0];
        assert_eq!(first.key.network_name, "aws-cni");
        assert_eq!(
            first.key.container_id,
            "3f9a1c0d5e7b2a4c6d8e0f1a3b5c7d9e1f2a4b6c8d0e2f4a6b8c0d2e4f6a8b0c"
        );
        assert_eq!(first.key.if_name, "eth0");
        assert_eq!(first.ipv4, Some(Ipv4Addr::new(192, 168, 43, 17)));
        assert_eq!(first.ipv6, None);
        assert_eq!(first.allocation_timestamp, 1_718_006_453_812_345_678);
        assert_eq!(first.metadata.k8s_pod_namespace, "kube-system");
        assert_eq!(first.metadata.k8s_pod_name, "coredns-5d78c9869d-x2k8q");
        assert_eq!(first.metadata.interfaces_count, 0);
        assert_eq!(cp.allocations[1].metadata.interfaces_count, 2);
        let backfilled = &cp.allocations[2];
        assert_eq!(backfilled.key.network_name, "_migrated-from-cri");
        assert_eq!(backfilled.key.if_name, "unknown");
        assert_eq!(backfilled.metadata, IpamMetadata::default());

        let v6 = Checkpoint::parse(path, SAMPLE_V6.as_bytes()).unwrap();
        assert_eq!(v6.allocations[0].ipv4, None);
        assert_eq!(
            v6.allocations[0].ipv6,
            Some("2600:1f14:e3a:c901:7a2e::3".parse().unwrap())
        );
    }

    #[test]
    fn samples_encode_back_byte_for_byte() {
        for sample in [SAMPLE_V4, SAMPLE_V6] {
            let path = Path::new("ipam.json");
            let cp = Checkpoint::parse(path, sample.as_bytes()).unwrap();
            assert_eq!(
                String::from_utf8(cp.to_bytes(path).unwrap()).unwrap(),
                sample
            );
        }
    }

    #[test]
    fn write_then_read_round_trips() {
        let dir = TestDir::new("round-trip");
        let path = dir.file();
        let cp = Checkpoint::parse(&path, SAMPLE_V4.as_bytes()).unwrap();
        cp.write(&path).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), SAMPLE_V4);
        assert_eq!(Checkpoint::read(&path).unwrap(), Some(cp));

        let mut next = Checkpoint::new(vec![entry("abc", [10, 0, 0, 9], "a")]);
        next.allocations[0].ipv6 = Some(Ipv6Addr::LOCALHOST);
        next.write(&path).unwrap();
        assert_eq!(Checkpoint::read(&path).unwrap(), Some(next));

        Checkpoint::default().write(&path).unwrap();
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            "{\"version\":\"vpc-cni-ipam/1\",\"allocations\":[]}\n"
        );
        assert_eq!(
            Checkpoint::read(&path).unwrap(),
            Some(Checkpoint::default())
        );

        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(dir.names(), ["ipam.json"], "no temporary file lingers");
    }

    #[test]
    fn missing_file_and_directory_read_as_none() {
        let dir = TestDir::new("missing");
        assert_eq!(Checkpoint::read(&dir.file()).unwrap(), None);
        assert_eq!(
            Checkpoint::read(&dir.0.join("absent/ipam.json")).unwrap(),
            None
        );
    }

    #[test]
    fn other_version_is_refused_by_name() {
        let path = Path::new("/var/run/aws-node/ipam.json");
        let future = SAMPLE_V4.replace("vpc-cni-ipam/1", "vpc-cni-ipam/2");
        let err = Checkpoint::parse(path, future.as_bytes()).unwrap_err();
        assert!(matches!(
            &err,
            CheckpointError::UnsupportedVersion { found, supported, .. }
                if found == "vpc-cni-ipam/2" && *supported == CHECKPOINT_FORMAT_VERSION
        ));
        let message = err.to_string();
        assert!(message.contains("/var/run/aws-node/ipam.json"), "{message}");
        assert!(message.contains("\"vpc-cni-ipam/2\""), "{message}");
        assert!(message.contains("\"vpc-cni-ipam/1\""), "{message}");

        // Another version is reported as such even when its shape differs.
        let err = Checkpoint::parse(
            path,
            br#"{"version":"vpc-cni-ipam/9","allocations":{"x":1}}"#,
        )
        .unwrap_err();
        assert!(
            matches!(err, CheckpointError::UnsupportedVersion { .. }),
            "{err}"
        );
        // No version at all is Go's empty string.
        let err = Checkpoint::parse(path, br#"{"allocations":[]}"#).unwrap_err();
        assert!(
            matches!(&err, CheckpointError::UnsupportedVersion { found, .. } if found.is_empty()),
            "{err}"
        );
    }

    #[test]
    fn newer_fields_and_go_zero_values_are_tolerated() {
        let newer = concat!(
            r#"{"version":"vpc-cni-ipam/1","nodeName":"ip-192-168-1-1","allocations":["#,
            r#"{"networkName":"aws-cni","containerID":"c1","ifName":"eth0","ipv4":"10.0.0.7","#,
            r#""networkCard":1,"allocationTimestamp":5,"#,
            r#""metadata":{"k8sPodNamespace":"ns","k8sPodName":"p","k8sPodUID":"0a1b"}},"#,
            r#"{"networkName":"aws-cni","containerID":"c2","ifName":"eth0","ipv4":"","ipv6":null}"#,
            "]}"
        );
        let path = Path::new("ipam.json");
        let cp = Checkpoint::parse(path, newer.as_bytes()).unwrap();
        assert_eq!(cp.allocations[0].ipv4, Some(Ipv4Addr::new(10, 0, 0, 7)));
        assert_eq!(cp.allocations[0].metadata.k8s_pod_name, "p");
        assert_eq!(cp.allocations[1].ipv4, None);
        assert_eq!(cp.allocations[1].ipv6, None);
        assert_eq!(cp.allocations[1].allocation_timestamp, 0);
        assert_eq!(cp.allocations[1].metadata, IpamMetadata::default());

        let null = Checkpoint::parse(path, br#"{"version":"vpc-cni-ipam/1","allocations":null}"#);
        assert_eq!(null.unwrap(), Checkpoint::default());
    }

    #[test]
    fn malformed_files_name_the_path() {
        let dir = TestDir::new("malformed");
        let path = dir.file();
        for bad in [
            &b""[..],
            b"{\"version\":\"vpc-cni-ipam/1\",\"allocations\":[",
            b"{\"version\":\"vpc-cni-ipam/1\",\"allocations\":[{\"ipv4\":\"10.0.0.300\"}]}",
        ] {
            fs::write(&path, bad).unwrap();
            let err = Checkpoint::read(&path).unwrap_err();
            assert!(matches!(err, CheckpointError::Parse { .. }), "{err}");
            assert!(err.to_string().contains(&*path.to_string_lossy()), "{err}");
        }
        // A directory where the file should be cannot be read.
        let err = Checkpoint::read(&dir.0).unwrap_err();
        assert!(matches!(err, CheckpointError::Read { .. }), "{err}");
        assert!(err.to_string().contains(&*dir.0.to_string_lossy()), "{err}");
    }

    #[test]
    fn failure_while_writing_keeps_the_previous_file() {
        let (dir, path, before) = TestDir::with_previous("midway");

        // Half the new file written, then the disk fails.
        let after = Checkpoint::new(vec![entry("new", [10, 0, 0, 2], "new")]);
        let bytes = after.to_bytes(&path).unwrap();
        let err = write_atomically(&path, |file| {
            file.write_all(&bytes[..bytes.len() / 2])?;
            Err(io::Error::other("No space left on device (injected)"))
        })
        .unwrap_err();
        let message = err.to_string();
        assert!(message.contains(&*path.to_string_lossy()), "{message}");
        assert!(message.contains("injected"), "{message}");
        assert_eq!(Checkpoint::read(&path).unwrap(), Some(before.clone()));
        assert_eq!(dir.names(), ["ipam.json"], "the temporary file is removed");

        // A panic midway is cleaned up too.
        let result = std::panic::catch_unwind(|| {
            write_atomically(&path, |file| {
                file.write_all(b"{\"vers")?;
                panic!("injected");
            })
        });
        assert!(result.is_err());
        assert_eq!(Checkpoint::read(&path).unwrap(), Some(before));
        assert_eq!(dir.names(), ["ipam.json"]);
    }

    #[test]
    fn failed_rename_removes_the_temporary_file() {
        // A non-empty directory where the checkpoint goes: everything up to
        // the fsync succeeds, the rename fails.
        let dir = TestDir::new("rename");
        let path = dir.file();
        fs::create_dir(&path).unwrap();
        fs::write(path.join("keep"), b"x").unwrap();
        let err = Checkpoint::default().write(&path).unwrap_err();
        assert!(
            matches!(&err, CheckpointError::Write { step, .. } if step.starts_with("renaming")),
            "{err}"
        );
        assert!(err.to_string().contains(&*path.to_string_lossy()), "{err}");
        assert_eq!(dir.names(), ["ipam.json"]);
        assert_eq!(fs::read(path.join("keep")).unwrap(), b"x");
    }

    #[test]
    fn uncreatable_temporary_file_keeps_the_previous_file() {
        let (dir, path, before) = TestDir::with_previous("readonly");

        // A read-only directory; root ignores the mode, so check it bites.
        fs::set_permissions(&dir.0, fs::Permissions::from_mode(0o555)).unwrap();
        let probe = dir.0.join("probe");
        if fs::write(&probe, b"").is_ok() {
            fs::remove_file(&probe).unwrap();
            eprintln!("running with CAP_DAC_OVERRIDE: the read-only case is not checked");
        } else {
            let err = Checkpoint::new(Vec::new()).write(&path).unwrap_err();
            assert!(
                matches!(&err, CheckpointError::Write { step, .. } if step.starts_with("creating")),
                "{err}"
            );
            assert_eq!(Checkpoint::read(&path).unwrap(), Some(before.clone()));
            assert_eq!(dir.names(), ["ipam.json"]);
        }
        fs::set_permissions(&dir.0, fs::Permissions::from_mode(0o755)).unwrap();

        // A directory that does not exist: nothing can be created, for root too.
        let missing = dir.0.join("absent/ipam.json");
        let err = before.write(&missing).unwrap_err();
        assert!(
            matches!(&err, CheckpointError::Write { step, source, .. }
                if step.starts_with("creating") && source.kind() == io::ErrorKind::NotFound),
            "{err}"
        );
        assert!(
            err.to_string().contains(&*missing.to_string_lossy()),
            "{err}"
        );
        assert_eq!(Checkpoint::read(&path).unwrap(), Some(before));
        assert_eq!(dir.names(), ["ipam.json"]);
    }

    #[test]
    fn network_card_paths_follow_aws_node() {
        let base = Path::new(DEFAULT_CHECKPOINT_PATH);
        assert_eq!(network_card_path(base, 0), base);
        assert_eq!(
            network_card_path(base, 1),
            Path::new("/var/run/aws-node/ipam-nic-1.json")
        );
        assert_eq!(
            network_card_path(Path::new("/tmp/state"), 3),
            Path::new("/tmp/state-nic-3.json")
        );
    }

    #[test]
    fn path_without_file_name_is_refused() {
        for path in ["", "/", "/var/run/aws-node/.."] {
            let err = Checkpoint::default().write(Path::new(path)).unwrap_err();
            assert!(
                matches!(&err, CheckpointError::Write { step, .. } if step.contains("no file name")),
                "{err}"
            );
        }
    }
}
