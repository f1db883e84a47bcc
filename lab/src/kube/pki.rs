//! The lab cluster's credentials: a CA, the API server's certificate, and
//! bearer tokens (the agent's ServiceAccount, the administrator's), written
//! where the server, the agent and kubectl read them.

use std::{
    fmt::Write as _,
    fs,
    io::Read,
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};

use super::{
    KubeApiError,
    rbac::{Identity, MASTERS_GROUP},
    server::{ServerConfig, TokenEntry},
};

/// The names the API server's certificate carries: those in-cluster
/// clients use (`kubernetes.default.svc`), besides its addresses.
pub const SERVER_DNS_NAMES: [&str; 4] = [
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
];
/// The agent's ServiceAccount, as `deploy/` names it.
pub const AGENT_SERVICE_ACCOUNT: (&str, &str) = ("kube-system", "vpcnet");
/// The administrator kubectl acts as.
pub const ADMIN_USER: &str = "kubernetes-admin";

/// The files of one lab cluster, under one directory.
#[derive(Debug, Clone)]
pub struct ClusterFiles {
    dir: PathBuf,
}

impl ClusterFiles {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    pub fn server_cert(&self) -> PathBuf {
        self.dir.join("apiserver.crt")
    }

    pub fn server_key(&self) -> PathBuf {
        self.dir.join("apiserver.key")
    }

    /// The server's configuration (its tokens).
    pub fn server_config(&self) -> PathBuf {
        self.dir.join("apiserver.json")
    }

    /// What a pod of the agent's ServiceAccount finds mounted at
    /// `/var/run/secrets/kubernetes.io/serviceaccount`: `token`, `ca.crt`,
    /// `namespace`.
    pub fn service_account_dir(&self) -> PathBuf {
        self.dir.join("serviceaccount")
    }

    /// The administrator's kubeconfig.
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.dir.join("admin.kubeconfig")
    }

    /// A kubeconfig with the agent's ServiceAccount token (to act as the
    /// agent with kubectl).
    pub fn agent_kubeconfig(&self) -> PathBuf {
        self.dir.join("agent.kubeconfig")
    }
}

fn random_token() -> Result<String, KubeApiError> {
    let mut bytes = [0_u8; 24];
    fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|source| KubeApiError::io("reading /dev/urandom", source))?;
    Ok(bytes.iter().fold(String::new(), |mut hex, b| {
        let _ = write!(hex, "{b:02x}");
        hex
    }))
}

fn kubeconfig(server: &str, ca: &Path, user: &str, token: &str) -> String {
    // JSON is YAML: kubectl and kube-rs read it as a kubeconfig.
    serde_json::to_string_pretty(&serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "vpcnet-lab", "cluster": {"server": server, "certificate-authority": ca}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "vpcnet-lab", "context": {"cluster": "vpcnet-lab", "user": user}}],
        "current-context": "vpcnet-lab",
    }))
    .expect("serializes")
}

/// Makes a fresh CA, a server certificate for `addrs` and the names
/// above, the tokens, and writes them all; `server_url` goes into the
/// kubeconfigs.
pub fn write_cluster_files(
    files: &ClusterFiles,
    addrs: &[IpAddr],
    server_url: &str,
) -> Result<ServerConfig, KubeApiError> {
    let tls = |err: rcgen::Error| KubeApiError::Tls(err.to_string());
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(tls)?;
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "vpcnet-lab-ca");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate().map_err(tls)?;
    let ca_cert = ca_params.self_signed(&ca_key).map_err(tls)?;
    let issuer = Issuer::new(ca_params, ca_key);

    let mut server_params =
        CertificateParams::new(SERVER_DNS_NAMES.map(str::to_owned).to_vec()).map_err(tls)?;
    server_params
        .distinguished_name
        .push(DnType::CommonName, "kube-apiserver");
    let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
    for addr in addrs.iter().chain([&loopback]) {
        server_params
            .subject_alt_names
            .push(SanType::IpAddress(*addr));
    }
    let server_key = KeyPair::generate().map_err(tls)?;
    let server_cert = server_params.signed_by(&server_key, &issuer).map_err(tls)?;

    let agent_token = random_token()?;
    let admin_token = random_token()?;
    let config = ServerConfig {
        tokens: vec![
            TokenEntry {
                token: agent_token.clone(),
                user: Identity::service_account_user(
                    AGENT_SERVICE_ACCOUNT.0,
                    AGENT_SERVICE_ACCOUNT.1,
                ),
                groups: Vec::new(),
            },
            TokenEntry {
                token: admin_token.clone(),
                user: ADMIN_USER.to_owned(),
                groups: vec![MASTERS_GROUP.to_owned()],
            },
        ],
        bookmark_interval_ms: 60_000,
        default_watch_timeout_secs: 1800,
        history: super::store::DEFAULT_HISTORY,
        uninstalled: Vec::new(),
    };

    let sa_dir = files.service_account_dir();
    fs::create_dir_all(&sa_dir)
        .map_err(|source| KubeApiError::io(format!("creating {}", sa_dir.display()), source))?;
    let writes: [(PathBuf, String); 9] = [
        (files.ca_cert(), ca_cert.pem()),
        (files.server_cert(), server_cert.pem()),
        (files.server_key(), server_key.serialize_pem()),
        (
            files.server_config(),
            serde_json::to_string_pretty(&config).expect("serializes"),
        ),
        (sa_dir.join("token"), agent_token.clone()),
        (sa_dir.join("ca.crt"), ca_cert.pem()),
        (sa_dir.join("namespace"), AGENT_SERVICE_ACCOUNT.0.to_owned()),
        (
            files.admin_kubeconfig(),
            kubeconfig(server_url, &files.ca_cert(), ADMIN_USER, &admin_token),
        ),
        (
            files.agent_kubeconfig(),
            kubeconfig(server_url, &files.ca_cert(), "vpcnet", &agent_token),
        ),
    ];
    for (path, contents) in writes {
        fs::write(&path, contents)
            .map_err(|source| KubeApiError::io(format!("writing {}", path.display()), source))?;
    }
    Ok(config)
}
