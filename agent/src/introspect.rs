//! Introspection and Prometheus metrics over HTTP, where aws-node serves
//! them: introspection on `127.0.0.1:61679` (`INTROSPECTION_BIND_ADDRESS`,
//! `unix:` for a Unix socket; off with `DISABLE_INTROSPECTION`), metrics on
//! port 61678 of every interface (off with `DISABLE_METRICS`; the VPC CNI
//! has no variable for its address, `run --metrics-address` sets it).
//!
//! Introspection (JSON): `/v1/enis`, `/v1/pods`, `/v1/nat?limit=N`,
//! `/v1/config`, and aws-node's `/v1/eni-configs`,
//! `/v1/ipamd-env-settings`, `/v1/networkutils-env-settings`. Metrics: `/metrics`, the `awscni_` names that mean what
//! they mean with aws-node, `vpcnet_ipam_*` for the address manager's own
//! counters, `vpcnet_datapath_*` and `vpcnet_nat_*` for the datapath.
//!
//! The maps are read through handles of their own, opened from their pins,
//! on the blocking pool: a scrape walking a large NAT table neither holds
//! the datapath's lock (which pod ADDs take) nor stalls the runtime.

pub mod env_settings;
pub mod exposition;
pub mod recorder;
pub mod views;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    convert::Infallible,
    fmt,
    net::{Ipv4Addr, SocketAddr},
    path::PathBuf,
    str::FromStr,
    sync::{Arc, Mutex},
    time::Duration,
};

use aya::maps::IterableMap;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{
    Method, Request, Response, StatusCode,
    body::Incoming,
    header::{CONTENT_TYPE, HOST},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::Serialize;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::{TcpListener, TcpStream, UnixListener, UnixStream},
    sync::{Semaphore, watch},
    task::JoinSet,
};
use tracing::{debug, info, warn};
use vpcnet_common::{
    cidr::CidrKind,
    counters::Counter,
    endpoint::{ENDPOINT_BRANCH, ENI_BRANCH, ENI_PRIMARY, Endpoint, Eni},
    maps as names,
    nat::FlowKind,
    raw_to_addr, raw_to_port,
};

use self::{
    exposition::{Exposition, MetricType},
    views::{
        AddressView, CollectorView, ConfigView, DatapathConfigView, DatapathEniEntryView,
        DatapathEniView, EndpointEntryView, EndpointView, EniView, EnisView, ErrorView, FlowView,
        IndexView, LinkView, MapFillView, NatSummaryView, NatView, PodRef, PodView, PodsView,
        RemoteEndpointView,
    },
};
use crate::{
    datapath::{
        CollectorReport, Datapath, DatapathError, DatapathMaps, Flow, NatPressure, monotonic_now_ns,
    },
    env::{ConfigError, Env},
    ipam::{
        manager::{EniDetail, IpamStatus},
        settings::{EniConfig, IpamSettings},
    },
    netlink::{LinkInfo, MacAddr, NetlinkError, NetlinkHandle},
    pods::{PodError, Pods},
};

/// The VPC CNI's variables.
pub const ENV_INTROSPECTION_BIND_ADDRESS: &str = "INTROSPECTION_BIND_ADDRESS";
pub const ENV_DISABLE_INTROSPECTION: &str = "DISABLE_INTROSPECTION";
pub const ENV_DISABLE_METRICS: &str = "DISABLE_METRICS";
/// aws-node's addresses.
pub const DEFAULT_INTROSPECTION_ADDRESS: &str = "127.0.0.1:61679";
pub const DEFAULT_METRICS_ADDRESS: &str = "0.0.0.0:61678";
/// The label cni-metrics-helper finds aws-node's pods by (in
/// `kube-system`, not configurable): vpcnet's pods carry it only when the
/// operator asks (`deploy/README.md`, "cni-metrics-helper").
pub const METRICS_HELPER_POD_LABEL: (&str, &str) = ("k8s-app", "aws-node");
/// Flows `/v1/nat` returns unless `?limit=` says otherwise.
pub const DEFAULT_NAT_LIMIT: usize = 1000;

/// The introspection endpoints, in the order `GET /` lists them.
pub const PATHS: [&str; 8] = [
    "/v1/enis",
    "/v1/pods",
    "/v1/nat",
    "/v1/nat/summary",
    "/v1/config",
    PATH_ENI_CONFIGS,
    PATH_IPAMD_ENV_SETTINGS,
    PATH_NETWORKUTILS_ENV_SETTINGS,
];
/// aws-node's paths (see [`env_settings`]).
pub const PATH_ENI_CONFIGS: &str = "/v1/eni-configs";
pub const PATH_IPAMD_ENV_SETTINGS: &str = "/v1/ipamd-env-settings";
pub const PATH_NETWORKUTILS_ENV_SETTINGS: &str = "/v1/networkutils-env-settings";
pub const METRICS_PATH: &str = "/metrics";

/// Connections served at once per listener; more wait in the backlog.
const MAX_CONNECTIONS: usize = 64;
/// How long a client may take to send its request's head, and a whole
/// exchange may take (aws-node: 5 s read and write timeouts).
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(30);
/// Bind retries (another agent may still hold the port while it stops).
const BIND_RETRY_FIRST: Duration = Duration::from_secs(1);
const BIND_RETRY_MAX: Duration = Duration::from_mins(1);

/// Where to listen: `host:port` (`:port` for every interface, as Go
/// writes it) or `unix:/path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListenAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl FromStr for ListenAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a socket path".into());
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        let full = if s.starts_with(':') {
            format!("0.0.0.0{s}")
        } else {
            s.to_owned()
        };
        full.parse()
            .map(Self::Tcp)
            .map_err(|_| format!("{s:?} is neither address:port nor unix:/path"))
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tcp(addr) => write!(f, "{addr}"),
            Self::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// Where introspection and metrics are served; `None`: not served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoints {
    pub introspection: Option<ListenAddr>,
    pub metrics: Option<ListenAddr>,
}

impl Endpoints {
    /// From the VPC CNI's variables; a flag (`run --introspection-address`,
    /// `--metrics-address`) names the address and serves it whatever the
    /// variables say. An address aws-node cannot listen on leaves it
    /// without introspection (it retries forever, silently): here too,
    /// said at start.
    pub fn from_env(
        env: &Env,
        introspection_flag: Option<&str>,
        metrics_flag: Option<&str>,
    ) -> Result<Self, ConfigError> {
        let parse = |source: &'static str, value: &str| {
            value.parse::<ListenAddr>().map_err(|_| ConfigError {
                variable: source,
                value: value.to_owned(),
                allowed: "address:port (:port for every interface) or unix:/path/to/socket",
            })
        };
        let introspection = match introspection_flag {
            Some(flag) => Some(parse("--introspection-address", flag)?),
            None if env.bool_or(ENV_DISABLE_INTROSPECTION, false) => None,
            None => {
                let value = env
                    .get(ENV_INTROSPECTION_BIND_ADDRESS)
                    .unwrap_or(DEFAULT_INTROSPECTION_ADDRESS);
                parse(ENV_INTROSPECTION_BIND_ADDRESS, value)
                    .inspect_err(|_| {
                        env.tolerate(
                            ENV_INTROSPECTION_BIND_ADDRESS,
                            value,
                            "not address:port or unix:/path",
                            "no introspection endpoint",
                        );
                    })
                    .ok()
            }
        };
        let metrics = match metrics_flag {
            Some(flag) => Some(parse("--metrics-address", flag)?),
            None if env.bool_or(ENV_DISABLE_METRICS, false) => None,
            None => Some(parse("--metrics-address", DEFAULT_METRICS_ADDRESS)?),
        };
        Ok(Self {
            introspection,
            metrics,
        })
    }
}

/// What the endpoints show.
pub struct Sources {
    pub datapath: Arc<Mutex<Datapath>>,
    /// The pods and the address manager (`None` without `--ipam`).
    pub pods: Option<Pods>,
    pub ipam_settings: Option<IpamSettings>,
    pub primary_interface: String,
    /// The garbage collector's work so far.
    pub collector: Arc<Mutex<CollectorReport>>,
    /// Custom networking's ENIConfig in force, when followed from the
    /// Kubernetes API.
    pub eni_config_objects: Option<tokio::sync::watch::Receiver<Option<EniConfig>>>,
}

#[derive(Debug, thiserror::Error)]
pub enum IntrospectError {
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error(transparent)]
    Pods(#[from] PodError),
    #[error("reading the datapath: {0}")]
    Blocking(#[from] tokio::task::JoinError),
}

struct State {
    /// Handles of our own on the pinned maps.
    maps: DatapathMaps,
    datapath: Arc<Mutex<Datapath>>,
    pods: Option<Pods>,
    ipam_settings: Option<IpamSettings>,
    primary_interface: String,
    endpoints: Endpoints,
    netlink: NetlinkHandle,
    collector: Arc<Mutex<CollectorReport>>,
    /// aws-node's three settings paths, read once at start (the process's
    /// variables do not change); an error is the answer.
    env_answers: EnvAnswers,
    eni_config_objects: Option<tokio::sync::watch::Receiver<Option<EniConfig>>>,
}

/// The answers of aws-node's settings paths.
struct EnvAnswers {
    eni_configs: Result<views::EniConfigView, String>,
    ipamd: Result<BTreeMap<String, serde_json::Value>, String>,
    networkutils: Result<BTreeMap<String, serde_json::Value>, String>,
}

impl EnvAnswers {
    /// From the process's variables; the address manager's settings if it
    /// runs, else read from them too.
    fn read(ipam: Option<&IpamSettings>) -> Self {
        let env = Env::from_process();
        let ipam = match ipam {
            Some(settings) => Ok(settings.clone()),
            None => IpamSettings::from_env(&env).map_err(|e| e.to_string()),
        };
        Self {
            eni_configs: ipam
                .as_ref()
                .map(|ipam| {
                    env_settings::eni_config_in_force(
                        ipam,
                        env_settings::EniConfigSource::Variables,
                    )
                })
                .map_err(Clone::clone),
            ipamd: ipam
                .as_ref()
                .map(env_settings::ipamd_env_settings)
                .map_err(Clone::clone),
            networkutils: ipam.as_ref().map_err(Clone::clone).and_then(|s| {
                env_settings::networkutils_env_settings(s, &env).map_err(|e| e.to_string())
            }),
        }
    }
}

impl State {
    fn datapath(&self) -> std::sync::MutexGuard<'_, Datapath> {
        self.datapath
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn collector(&self) -> CollectorReport {
        *self
            .collector
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Runs `f` on the maps on the blocking pool.
async fn read_maps<T: Send + 'static>(
    state: &Arc<State>,
    f: impl FnOnce(&State) -> Result<T, DatapathError> + Send + 'static,
) -> Result<T, IntrospectError> {
    let state = Arc::clone(state);
    Ok(tokio::task::spawn_blocking(move || f(&state)).await??)
}

/// Starts serving `endpoints` (tasks in `tasks`, stopping when `shutdown`
/// turns true). An address that cannot be bound now (another agent still
/// holding it) is retried in the background, with backoff, as aws-node does.
/// Called from within the runtime.
pub fn start(
    endpoints: &Endpoints,
    sources: Sources,
    shutdown: &watch::Receiver<bool>,
    tasks: &mut JoinSet<()>,
) -> Result<(), IntrospectError> {
    if endpoints.introspection.is_none() && endpoints.metrics.is_none() {
        info!("introspection and metrics disabled");
        return Ok(());
    }
    let pin_dir = sources.datapath.lock().map_or_else(
        |poisoned| poisoned.into_inner().pin_dir().to_owned(),
        |d| d.pin_dir().to_owned(),
    );
    let env_answers = EnvAnswers::read(sources.ipam_settings.as_ref());
    let state = Arc::new(State {
        maps: DatapathMaps::open_pinned(&pin_dir)?,
        datapath: sources.datapath,
        pods: sources.pods,
        ipam_settings: sources.ipam_settings,
        primary_interface: sources.primary_interface,
        endpoints: endpoints.clone(),
        netlink: NetlinkHandle::new()?,
        collector: sources.collector,
        env_answers,
        eni_config_objects: sources.eni_config_objects,
    });
    for (addr, role) in [
        (&endpoints.introspection, Role::Introspection),
        (&endpoints.metrics, Role::Metrics),
    ] {
        let Some(addr) = addr.clone() else {
            info!(what = role.name(), "disabled");
            continue;
        };
        let listener = match Listener::bind(&addr) {
            Ok(listener) => {
                info!(what = role.name(), address = %addr, "serving");
                Some(listener)
            }
            Err(e) => {
                warn!(what = role.name(), address = %addr, error = %e, "cannot listen yet: retrying in the background");
                None
            }
        };
        tasks.spawn(serve(
            addr,
            listener,
            Arc::clone(&state),
            role,
            shutdown.clone(),
        ));
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Introspection,
    Metrics,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Self::Introspection => "introspection",
            Self::Metrics => "metrics",
        }
    }
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    fn bind(addr: &ListenAddr) -> std::io::Result<Self> {
        match addr {
            ListenAddr::Tcp(addr) => {
                let socket = std::net::TcpListener::bind(addr)?;
                socket.set_nonblocking(true)?;
                Ok(Self::Tcp(TcpListener::from_std(socket)?))
            }
            ListenAddr::Unix(path) => {
                // A socket file left by an earlier run is ours to replace.
                if std::fs::symlink_metadata(path)
                    .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
                {
                    std::fs::remove_file(path)?;
                }
                Ok(Self::Unix(UnixListener::bind(path)?))
            }
        }
    }
}

/// Binds (if not yet bound) and serves until `shutdown`.
async fn serve(
    addr: ListenAddr,
    listener: Option<Listener>,
    state: Arc<State>,
    role: Role,
    mut shutdown: watch::Receiver<bool>,
) {
    let listener = if let Some(listener) = listener {
        listener
    } else {
        let mut delay = BIND_RETRY_FIRST;
        loop {
            tokio::select! {
                _ = shutdown.wait_for(|stop| *stop) => return,
                () = tokio::time::sleep(delay) => {}
            }
            match Listener::bind(&addr) {
                Ok(listener) => {
                    info!(what = role.name(), address = %addr, "serving");
                    break listener;
                }
                Err(e) => {
                    debug!(what = role.name(), address = %addr, error = %e, "cannot listen yet");
                    delay = (delay * 2).min(BIND_RETRY_MAX);
                }
            }
        }
    };
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        // Waiting for a slot before accepting leaves the rest in the backlog.
        let permit = tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => break,
            permit = Arc::clone(&slots).acquire_owned() => permit.expect("never closed"),
        };
        let accepted = tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok(Accepted::Tcp(stream)) => spawn_connection(stream, &state, role, permit),
            Ok(Accepted::Unix(stream)) => spawn_connection(stream, &state, role, permit),
            Err(e) => {
                // Out of descriptors, mostly: let some close.
                warn!(what = role.name(), error = %e, "accepting a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    if let ListenAddr::Unix(path) = &addr {
        let _ = std::fs::remove_file(path);
    }
}

enum Accepted {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Listener {
    async fn accept(&self) -> std::io::Result<Accepted> {
        match self {
            Self::Tcp(l) => l.accept().await.map(|(s, _)| Accepted::Tcp(s)),
            Self::Unix(l) => l.accept().await.map(|(s, _)| Accepted::Unix(s)),
        }
    }
}

fn spawn_connection<S>(
    stream: S,
    state: &Arc<State>,
    role: Role,
    permit: tokio::sync::OwnedSemaphorePermit,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let state = Arc::clone(state);
    tokio::spawn(async move {
        let _permit = permit;
        let service = service_fn(move |request| {
            let state = Arc::clone(&state);
            async move { Ok::<_, Infallible>(route(&state, role, &request).await) }
        });
        // One request per connection: no idle connection to time out under
        // a client about to reuse it.
        let connection = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_TIMEOUT)
            .keep_alive(false)
            .serve_connection(TokioIo::new(stream), service);
        match tokio::time::timeout(EXCHANGE_TIMEOUT, connection).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => debug!(error = %e, "introspection connection"),
            Err(_) => debug!("introspection connection timed out"),
        }
    });
}

type Reply = Response<Full<Bytes>>;

fn reply(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Reply {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    if let Ok(value) = content_type.parse() {
        response.headers_mut().insert(CONTENT_TYPE, value);
    }
    response
}

fn json(status: StatusCode, value: &impl Serialize) -> Reply {
    match serde_json::to_vec_pretty(value) {
        Ok(mut body) => {
            body.push(b'\n');
            reply(status, "application/json", body)
        }
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}

fn error(status: StatusCode, message: &str) -> Reply {
    json(
        status,
        &ErrorView {
            error: message.to_owned(),
        },
    )
}

async fn route(state: &Arc<State>, role: Role, request: &Request<Incoming>) -> Reply {
    if !matches!(*request.method(), Method::GET | Method::HEAD) {
        let mut response = error(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("{} is not served: GET only", request.method()),
        );
        response.headers_mut().insert(
            hyper::header::ALLOW,
            hyper::header::HeaderValue::from_static("GET, HEAD"),
        );
        return response;
    }
    let path = request.uri().path();
    let query = request.uri().query().unwrap_or("");
    let result = match (role, path) {
        (Role::Metrics, METRICS_PATH) => {
            return match metrics(state).await {
                Ok(text) => reply(StatusCode::OK, exposition::CONTENT_TYPE, text),
                Err(e) => {
                    warn!(error = %e, "metrics");
                    error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string())
                }
            };
        }
        (Role::Introspection, "/" | "/v1") => Ok(json(
            StatusCode::OK,
            &IndexView {
                paths: PATHS.iter().map(|p| (*p).to_owned()).collect(),
            },
        )),
        (Role::Introspection, "/v1/enis") => {
            enis(state).await.map(|view| json(StatusCode::OK, &view))
        }
        (Role::Introspection, "/v1/pods") => {
            pods(state).await.map(|view| json(StatusCode::OK, &view))
        }
        (Role::Introspection, "/v1/nat") => match nat_limit(query) {
            Ok(limit) => nat(state, limit)
                .await
                .map(|view| json(StatusCode::OK, &view)),
            Err(message) => Ok(error(StatusCode::BAD_REQUEST, &message)),
        },
        (Role::Introspection, "/v1/nat/summary") => nat_summary(state)
            .await
            .map(|view| json(StatusCode::OK, &view)),
        (Role::Introspection, "/v1/config") => {
            config(state).await.map(|view| json(StatusCode::OK, &view))
        }
        (Role::Introspection, PATH_ENI_CONFIGS) => {
            Ok(match (&state.eni_config_objects, &state.ipam_settings) {
                (Some(followed), Some(ipam)) => json(
                    StatusCode::OK,
                    &env_settings::eni_config_in_force(
                        ipam,
                        env_settings::EniConfigSource::Objects(followed.borrow().as_ref()),
                    ),
                ),
                _ => env_answer(&state.env_answers.eni_configs),
            })
        }
        (Role::Introspection, PATH_IPAMD_ENV_SETTINGS) => Ok(env_answer(&state.env_answers.ipamd)),
        (Role::Introspection, PATH_NETWORKUTILS_ENV_SETTINGS) => {
            Ok(env_answer(&state.env_answers.networkutils))
        }
        (Role::Introspection, _) => Ok(error(
            StatusCode::NOT_FOUND,
            &format!("no endpoint {path}: try {}", PATHS.join(", ")),
        )),
        (Role::Metrics, _) => Ok(error(
            StatusCode::NOT_FOUND,
            &format!("no endpoint {path}: metrics are at {METRICS_PATH}"),
        )),
    };
    result.unwrap_or_else(|e| {
        warn!(path, error = %e, "introspection");
        error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string())
    })
}

fn env_answer(answer: &Result<impl Serialize, String>) -> Reply {
    match answer {
        Ok(view) => json(StatusCode::OK, view),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

/// `limit=N` in the query; none: the default.
fn nat_limit(query: &str) -> Result<usize, String> {
    for pair in query.split('&') {
        if let Some(value) = pair.strip_prefix("limit=") {
            return value
                .parse()
                .map_err(|_| format!("limit={value:?} is not a whole number"));
        }
    }
    Ok(DEFAULT_NAT_LIMIT)
}

fn mac_string(mac: [u8; 6]) -> String {
    MacAddr(mac).to_string()
}

fn link_names(links: &[LinkInfo]) -> HashMap<u32, String> {
    links.iter().map(|l| (l.index, l.name.clone())).collect()
}

fn endpoint_entry(
    entry: &Endpoint,
    names: &HashMap<u32, String>,
    attached: bool,
) -> EndpointEntryView {
    EndpointEntryView {
        ifindex: entry.ifindex,
        interface: names.get(&entry.ifindex).cloned(),
        eni_ifindex: entry.eni_ifindex,
        eni_interface: names.get(&entry.eni_ifindex).cloned(),
        mac: mac_string(entry.mac),
        host_mac: mac_string(entry.host_mac),
        branch: entry.flags & ENDPOINT_BRANCH != 0,
        strict: entry.strict(),
        programs_attached: attached,
    }
}

fn eni_entry(entry: Eni, attached: bool) -> DatapathEniEntryView {
    DatapathEniEntryView {
        gateway: Ipv4Addr::from(raw_to_addr(entry.gateway)),
        primary: entry.flags & ENI_PRIMARY != 0,
        branch: entry.flags & ENI_BRANCH != 0,
        programs_attached: attached,
    }
}

async fn pods(state: &Arc<State>) -> Result<PodsView, IntrospectError> {
    let (attachments, enis) = match &state.pods {
        Some(pods) => (pods.attachments().await?, pods.manager().enis().await),
        None => (Vec::new(), Vec::new()),
    };
    let names = link_names(&state.netlink.links().await?);
    // Every endpoint entry, and whether its veth has the programs.
    let endpoints = read_maps(state, |s| {
        let endpoints = s.maps.endpoints()?;
        let datapath = s.datapath();
        Ok(endpoints
            .into_iter()
            .map(|(addr, entry)| (addr, (entry, datapath.is_attached(entry.ifindex))))
            .collect::<BTreeMap<_, _>>())
    })
    .await?;
    let owner: HashMap<Ipv4Addr, (&str, u32)> = enis
        .iter()
        .flat_map(|eni| {
            eni.assigned
                .iter()
                .map(|a| (a.addr, (eni.id.as_str(), eni.device_number)))
        })
        .collect();
    let mut pods: Vec<PodView> = attachments
        .into_iter()
        .map(|a| PodView {
            eni: owner.get(&a.addr).map(|(id, _)| (*id).to_owned()),
            device_number: owner.get(&a.addr).map(|(_, device)| *device),
            endpoint: endpoints
                .get(&a.addr)
                .map(|(entry, attached)| endpoint_entry(entry, &names, *attached)),
            namespace: a.metadata.k8s_pod_namespace,
            name: a.metadata.k8s_pod_name,
            container_id: a.key.container_id,
            network: a.key.network_name,
            ifname: a.key.if_name,
            address: a.addr,
            host_veth: a.host_veth,
        })
        .collect();
    pods.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    let held: BTreeSet<Ipv4Addr> = pods.iter().map(|p| p.address).collect();
    let datapath_only = endpoints
        .iter()
        .filter(|(addr, _)| !held.contains(addr))
        .map(|(addr, (entry, attached))| EndpointView {
            address: *addr,
            entry: endpoint_entry(entry, &names, *attached),
        })
        .collect();
    Ok(PodsView {
        ipam: state.pods.is_some(),
        count: pods.len(),
        pods,
        datapath_only,
    })
}

/// An ENI's addresses for pods, secondary ones first, with their pods.
fn eni_addresses(eni: &EniDetail) -> Vec<AddressView> {
    let pod_of = |addr: Ipv4Addr| {
        eni.assigned
            .iter()
            .find(|a| a.addr == addr)
            .map(|a| PodRef {
                namespace: a.metadata.k8s_pod_namespace.clone(),
                name: a.metadata.k8s_pod_name.clone(),
                container_id: a.key.container_id.clone(),
            })
    };
    let secondary = eni.secondary_addrs.iter().map(|addr| AddressView {
        address: *addr,
        prefix: None,
        pod: pod_of(*addr),
    });
    let from_prefixes = eni.prefixes.iter().flat_map(|prefix| {
        let prefix = prefix.trunc();
        ipnet::Ipv4AddrRange::new(prefix.network(), prefix.broadcast()).map(move |addr| {
            AddressView {
                address: addr,
                prefix: Some(prefix.to_string()),
                pod: pod_of(addr),
            }
        })
    });
    secondary.chain(from_prefixes).collect()
}

async fn enis(state: &Arc<State>) -> Result<EnisView, IntrospectError> {
    let (details, status) = match &state.pods {
        Some(pods) => (
            pods.manager().enis().await,
            Some(pods.manager().status().await),
        ),
        None => (Vec::new(), None),
    };
    let links = state.netlink.links().await?;
    let names = link_names(&links);
    let entries = read_maps(state, |s| {
        let entries = s
            .maps
            .enis
            .iter()
            .collect::<Result<Vec<(u32, Eni)>, _>>()
            .map_err(DatapathError::map(names::ENIS))?;
        let datapath = s.datapath();
        Ok(entries
            .into_iter()
            .map(|(ifindex, entry)| (ifindex, (entry, datapath.is_attached(ifindex))))
            .collect::<BTreeMap<_, _>>())
    })
    .await?;
    let mut managed_links = BTreeSet::new();
    let enis: Vec<EniView> = details
        .iter()
        .map(|eni| {
            // A vlan inherits its parent's MAC: the ENI is the first link.
            let link = eni.mac.parse::<MacAddr>().ok().and_then(|mac| {
                links
                    .iter()
                    .filter(|l| l.mac == Some(mac))
                    .min_by_key(|l| l.index)
            });
            if let Some(link) = link {
                managed_links.insert(link.index);
            }
            let addresses = eni_addresses(eni);
            EniView {
                id: eni.id.clone(),
                device_number: eni.device_number,
                mac: eni.mac.clone(),
                attachment_id: eni.attachment_id.clone(),
                primary: eni.primary,
                no_manage: eni.no_manage,
                excluded_for_pods: eni.excluded_for_pods,
                subnet: eni.subnet.to_string(),
                gateway: crate::ipam::manager::gateway_of(eni.subnet),
                primary_address: eni.primary_addr,
                link: link.map(|l| LinkView {
                    name: l.name.clone(),
                    ifindex: l.index,
                }),
                datapath: link
                    .and_then(|l| entries.get(&l.index))
                    .map(|(entry, attached)| eni_entry(*entry, *attached)),
                total_addresses: addresses.len(),
                assigned_addresses: eni.assigned.len(),
                prefixes: eni.prefixes.iter().map(ToString::to_string).collect(),
                addresses,
            }
        })
        .collect();
    let datapath_only = entries
        .iter()
        .filter(|(ifindex, _)| !managed_links.contains(*ifindex))
        .map(|(ifindex, (entry, attached))| DatapathEniView {
            ifindex: *ifindex,
            interface: names.get(ifindex).cloned(),
            entry: eni_entry(*entry, *attached),
        })
        .collect();
    Ok(EnisView {
        ipam: state.pods.is_some(),
        count: enis.len(),
        max_enis: status.as_ref().map(|s| s.max_enis),
        total_addresses: status.as_ref().map_or(0, |s| s.stats.total_ips),
        assigned_addresses: status.as_ref().map_or(0, |s| s.stats.assigned_ips),
        enis,
        datapath_only,
    })
}

fn proto_name(proto: u8) -> String {
    match proto {
        1 => "icmp".into(),
        6 => "tcp".into(),
        17 => "udp".into(),
        other => other.to_string(),
    }
}

fn endpoint(addr: u32, port: u16) -> String {
    format!(
        "{}:{}",
        Ipv4Addr::from(raw_to_addr(addr)),
        raw_to_port(port)
    )
}

fn flow_view(flow: &Flow, now_ns: u64) -> FlowView {
    FlowView {
        proto: proto_name(flow.key.proto),
        kind: flow.kind().map_or("?", FlowKind::name).to_owned(),
        state: flow.state().name().to_owned(),
        original: endpoint(flow.key.saddr, flow.key.sport),
        remote: endpoint(flow.key.daddr, flow.key.dport),
        translated: endpoint(flow.fwd.addr, flow.fwd.port),
        idle_seconds: now_ns.saturating_sub(flow.last_seen_ns()) / 1_000_000_000,
    }
}

fn nat_table_size(maps: &DatapathMaps) -> Result<u32, DatapathError> {
    Ok(IterableMap::map(&maps.nat_fwd)
        .info()
        .map_err(DatapathError::map(names::NAT_FWD))?
        .max_entries())
}

/// The first `limit` flows with their claims, and how many there are.
async fn nat(state: &Arc<State>, limit: usize) -> Result<NatView, IntrospectError> {
    read_maps(state, move |s| {
        let now = monotonic_now_ns();
        let mut flows = Vec::new();
        let mut total = 0;
        for item in &s.maps.nat_fwd {
            let (key, fwd) = item.map_err(DatapathError::map(names::NAT_FWD))?;
            total += 1;
            if flows.len() >= limit {
                continue;
            }
            flows.push(flow_view(&Flow::read(&s.maps, key, fwd), now));
        }
        Ok(NatView {
            total,
            table_size: nat_table_size(&s.maps)?,
            limit,
            returned: flows.len(),
            truncated: flows.len() < total,
            flows,
        })
    })
    .await
}

/// The NAT pressure summary (see [`NatSummaryView`]).
async fn nat_summary(state: &Arc<State>) -> Result<NatSummaryView, IntrospectError> {
    read_maps(state, |s| {
        let config = s.maps.config()?;
        Ok(nat_summary_view(
            &s.maps.nat_pressure()?,
            &s.collector(),
            u32::from(config.port_max) - u32::from(config.port_min) + 1,
        ))
    })
    .await
}

/// What `/v1/nat/summary` and `vpcnet-agent nat --summary` show.
#[must_use]
pub fn nat_summary_view(
    pressure: &NatPressure,
    collector: &CollectorReport,
    port_range: u32,
) -> NatSummaryView {
    NatSummaryView {
        maps: [
            (names::NAT_FWD, pressure.nat_fwd),
            (names::NAT_REV, pressure.nat_rev),
            (names::STACK_FLOWS, pressure.stack_flows),
        ]
        .into_iter()
        .map(|(map, fill)| MapFillView {
            map: map.to_owned(),
            entries: fill.entries,
            capacity: fill.capacity,
        })
        .collect(),
        busiest_remote_endpoints: pressure
            .busiest
            .iter()
            .map(|e| RemoteEndpointView {
                proto: proto_name(e.proto),
                remote: endpoint(e.addr, e.port),
                ports: e.ports,
            })
            .collect(),
        port_range,
        collector: CollectorView {
            passes: collector.passes,
            last_pass_microseconds: u64::try_from(collector.last_pass.as_micros())
                .unwrap_or(u64::MAX),
            expired: collector.expired,
            orphans: collector.orphans,
        },
    }
}

fn cidr_kind_name(kind: Option<CidrKind>) -> &'static str {
    match kind {
        Some(CidrKind::Vpc) => "vpc",
        Some(CidrKind::Excluded) => "excluded",
        Some(CidrKind::Local) => "local",
        Some(CidrKind::Service) => "service",
        None => "unknown",
    }
}

async fn config(state: &Arc<State>) -> Result<ConfigView, IntrospectError> {
    let (cfg, cidrs, attached) = read_maps(state, |s| {
        let attached: Vec<String> = s.datapath().attached().map(str::to_owned).collect();
        Ok((s.maps.config()?, s.maps.cidrs()?, attached))
    })
    .await?;
    let mut by_kind: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (net, kind) in cidrs {
        by_kind
            .entry(cidr_kind_name(kind).to_owned())
            .or_default()
            .push(net.to_string());
    }
    Ok(ConfigView {
        datapath: DatapathConfigView {
            node_address: Ipv4Addr::from(raw_to_addr(cfg.node_addr)),
            external_snat: cfg.external_snat(),
            randomize_snat: cfg.randomize_mode().env_value().to_owned(),
            port_min: cfg.port_min,
            port_max: cfg.port_max,
            cidrs: by_kind,
        },
        primary_interface: state.primary_interface.clone(),
        attached_interfaces: attached,
        ipam: state.ipam_settings.as_ref().map(IpamSettings::env_view),
        introspection_address: state
            .endpoints
            .introspection
            .as_ref()
            .map(ToString::to_string),
        metrics_address: state.endpoints.metrics.as_ref().map(ToString::to_string),
    })
}

/// What one scrape reports, gathered.
#[derive(Clone, Debug)]
pub struct MetricsSnapshot {
    /// The address manager's pool and its ENIs' assigned counts (`None`
    /// without `--ipam`).
    pub ipam: Option<(IpamStatus, Vec<(String, usize)>)>,
    /// Every datapath counter summed over the CPUs.
    pub counters: Vec<(Counter, u64)>,
    pub endpoints: usize,
    pub attached_interfaces: usize,
    pub external_snat: bool,
    pub pressure: NatPressure,
    pub collector: CollectorReport,
    /// Addresses assigned to pods per pool CIDR: each secondary address
    /// (`/32`) and each prefix (`/28`).
    pub per_cidr: Vec<(String, usize)>,
    /// What the cloud client, the address manager and the CNI backend
    /// recorded.
    pub recorded: recorder::Recorded,
}

/// Addresses assigned per pool CIDR, as aws-node's datastore keeps them:
/// a secondary address is a `/32`, a prefix a `/28`.
#[must_use]
pub fn assigned_per_cidr(enis: &[EniDetail]) -> Vec<(String, usize)> {
    enis.iter()
        .filter(|eni| !eni.no_manage)
        .flat_map(|eni| {
            let singles = eni.secondary_addrs.iter().map(|addr| {
                let held = eni.assigned.iter().filter(|a| a.addr == *addr).count();
                (format!("{addr}/32"), held)
            });
            let prefixes = eni.prefixes.iter().map(|prefix| {
                let prefix = prefix.trunc();
                let held = eni
                    .assigned
                    .iter()
                    .filter(|a| prefix.contains(&a.addr))
                    .count();
                (prefix.to_string(), held)
            });
            singles.chain(prefixes)
        })
        .collect()
}

async fn metrics(state: &Arc<State>) -> Result<String, IntrospectError> {
    let (ipam, per_cidr) = match &state.pods {
        Some(pods) => {
            let manager = pods.manager();
            let status = manager.status().await;
            let enis = manager.enis().await;
            let per_cidr = assigned_per_cidr(&enis);
            let per_eni = enis
                .into_iter()
                .map(|eni| (eni.id, eni.assigned.len()))
                .collect();
            (Some((status, per_eni)), per_cidr)
        }
        None => (None, Vec::new()),
    };
    read_maps(state, move |s| {
        let maps = &s.maps;
        Ok(render_metrics(&MetricsSnapshot {
            ipam,
            counters: maps.counters()?,

            endpoints: maps.endpoints.keys().flatten().count(),
            attached_interfaces: s.datapath().attached().count(),
            external_snat: maps.config()?.external_snat(),
            pressure: maps.nat_pressure()?,
            collector: s.collector(),
            per_cidr,
            recorded: recorder::snapshot(),
        }))
    })
    .await
}

fn n(value: usize) -> u64 {
    u64::try_from(value).unwrap_or(u64::MAX)
}

/// The address manager's counters by name: their `vpcnet_ipam_<name>_total`
/// help, and the aws-node metric each feeds, if any.
fn ipam_counter_help(name: &str) -> &'static str {
    match name {
        "assigned" => "Addresses handed to pods (ADDs served, retried ADDs included).",
        "assign_failures" => "ADDs that found no address.",
        "released" => "Addresses pods gave back (DELs that released one).",
        "addrs_allocated" => "Secondary addresses assigned by EC2.",
        "addrs_freed" => "Secondary addresses given back to EC2.",
        "prefixes_allocated" => "/28 prefixes assigned by EC2.",
        "prefixes_freed" => "/28 prefixes given back to EC2.",
        "enis_created" => "ENIs created and attached.",
        "enis_deleted" => "ENIs detached and deleted.",
        "leaked_enis_deleted" => "Detached agent ENIs deleted by the leaked-ENI sweep.",
        "prefix_fallbacks" => {
            "Prefix delegation fell back to single addresses (InsufficientCidrBlocks)."
        }
        "ec2_errors" => "Pool reconcile passes that ended on an error.",
        "ec2_throttled" => "Pool reconcile passes refused by EC2 with RequestLimitExceeded.",
        "subnet_exhausted" => "Pool reconcile passes refused for lack of addresses in the subnet.",
        "cidrs_found" => {
            "Addresses and prefixes (one each) the node's reconcile found assigned by someone else."
        }
        "cidrs_lost" => {
            "Addresses and prefixes (one each) the node's reconcile found unassigned by someone else."
        }
        _ => "An address manager counter.",
    }
}

/// The scrape's text.
#[must_use]
pub fn render_metrics(snapshot: &MetricsSnapshot) -> String {
    let mut e = Exposition::new();
    e.family(
        "awscni_build_info",
        MetricType::Gauge,
        "A metric with a constant '1' value labeled by the version vpcnet-agent was built from.",
        [(vec![("version", env!("CARGO_PKG_VERSION").to_owned())], 1)],
    );
    if let Some((status, per_eni)) = &snapshot.ipam {
        render_ipam(&mut e, status, per_eni);
        render_ipam_actions(&mut e, status, snapshot);
    }
    render_recorded(&mut e, &snapshot.recorded);
    render_kubernetes(&mut e, &snapshot.recorded);
    render_datapath(&mut e, snapshot);
    e.finish()
}

/// The pool (aws-node's names where they mean the same) and the address
/// manager's counters.
#[allow(clippy::too_many_lines)] // one call per metric
fn render_ipam(e: &mut Exposition, status: &IpamStatus, per_eni: &[(String, usize)]) {
    use MetricType::{Counter as C, Gauge as G};
    let counter = |name: &str| {
        status
            .counters
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0, |(_, v)| *v)
    };
    let pool = &status.stats;
    e.single(
        "awscni_eni_allocated",
        G,
        "The number of ENIs allocated",
        n(status.enis),
    );
    e.single(
        "awscni_eni_max",
        G,
        "The maximum number of ENIs that can be attached to the instance",
        n(status.max_enis),
    );
    e.single(
        "awscni_ip_max",
        G,
        "The maximum number of IP addresses that can be allocated to the instance",
        n(status.max_ips),
    );
    e.single(
        "awscni_assigned_ip_addresses",
        G,
        "The number of IP addresses assigned to pods",
        n(pool.assigned_ips),
    );
    e.single(
        "awscni_total_ip_addresses",
        G,
        "The total number of IP addresses",
        n(pool.total_ips),
    );
    e.single(
        "awscni_total_ipv4_prefixes",
        G,
        "The total number of IPv4 prefixes",
        n(pool.total_prefixes),
    );
    e.family(
        "awscni_assigned_ip_per_eni",
        G,
        "The number of allocated ips partitioned by eni",
        per_eni
            .iter()
            .map(|(eni, assigned)| (vec![("eni", eni.clone())], n(*assigned))),
    );
    e.single(
        "awscni_add_ip_req_count",
        C,
        "The number of add IP address requests (ADDs served plus ADDs that found no address)",
        counter("assigned") + counter("assign_failures"),
    );
    e.single(
        "awscni_no_available_ip_addresses",
        C,
        "The number of pod IP assignments that fail due to no available IP addresses",
        counter("assign_failures"),
    );
    e.family(
        "awscni_ipamd_error_count",
        C,
        "The number of errors encountered in ipamd (fn=reconcile: pool passes that failed)",
        [(vec![("fn", "reconcile".to_owned())], counter("ec2_errors"))],
    );
    e.single(
        "awscni_force_removed_enis",
        C,
        "The number of ENIs force removed while they had assigned pods (always 0: vpcnet \
         never removes an ENI a pod uses)",
        0,
    );
    e.single(
        "awscni_force_removed_ips",
        C,
        "The number of IPs force removed while they had assigned pods (always 0: vpcnet \
         never removes an address a pod holds)",
        0,
    );
    e.single(
        "vpcnet_ipam_cooling_ip_addresses",
        G,
        "Free addresses still in their cooldown (IP_COOLDOWN_PERIOD).",
        n(pool.cooling_ips),
    );
    e.single(
        "vpcnet_ipam_free_ipv4_prefixes",
        G,
        "Prefixes with no address assigned.",
        n(pool.free_prefixes),
    );
    e.single(
        "vpcnet_ipam_max_pods",
        G,
        "The node's max pods: the pool never grows past it.",
        n(status.max_pods),
    );
    e.single(
        "vpcnet_ipam_prefix_fallback",
        G,
        "1 once prefix delegation fell back to single addresses.",
        u64::from(status.prefix_fallback),
    );
    for (name, value) in &status.counters {
        e.single(
            &format!("vpcnet_ipam_{name}_total"),
            C,
            ipam_counter_help(name),
            *value,
        );
    }
}

/// aws-node's reconcile counters by its function names, from the address
/// manager's counters: ENIs and addresses or prefixes someone else
/// attached, assigned, detached or unassigned.
const RECONCILE_COUNTS: [(&str, &str); 4] = [
    ("eniReconcileAdd", "enis_found"),
    ("eniReconcileDel", "enis_lost"),
    ("eniDataStorePoolReconcileAdd", "cidrs_found"),
    ("eniIPPoolReconcileDel", "cidrs_lost"),
];

/// What the address manager does (its actions, its reconcile's finds) and
/// where the pods' addresses are.
fn render_ipam_actions(e: &mut Exposition, status: &IpamStatus, snapshot: &MetricsSnapshot) {
    use MetricType::{Counter as C, Gauge as G};
    let counter = |name: &str| {
        status
            .counters
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0, |(_, v)| *v)
    };
    e.family(
        "awscni_ipamd_action_inprogress",
        G,
        "The number of ipamd actions in progress",
        recorder::ACTIONS.iter().map(|action| {
            let under_way = snapshot.recorded.actions.get(action).copied();
            (vec![("fn", (*action).to_owned())], under_way.unwrap_or(0))
        }),
    );
    e.family(
        "awscni_reconcile_count",
        C,
        "The number of times ipamd reconciles on ENIs and IP/Prefix addresses (what the node's \
         reconcile found attached, assigned, detached or unassigned by someone else)",
        RECONCILE_COUNTS
            .iter()
            .map(|(function, name)| (vec![("fn", (*function).to_owned())], counter(name))),
    );
    e.family(
        "awscni_assigned_ip_per_cidr",
        G,
        "The total number of IP addresses assigned per cidr",
        snapshot
            .per_cidr
            .iter()
            .map(|(cidr, held)| (vec![("cidr", cidr.clone())], n(*held))),
    );
}

/// The Kubernetes API's answers: a failing API server shows here while
/// the watchers retry.
fn render_kubernetes(e: &mut Exposition, recorded: &recorder::Recorded) {
    e.family(
        "vpcnet_kubernetes_api_answers_total",
        MetricType::Counter,
        "Kubernetes API requests by the HTTP status of the answer (none: no answer)",
        recorded.kubernetes_answers.iter().map(|(status, n)| {
            let code = status.map_or_else(|| "none".to_owned(), |s| s.to_string());
            (vec![("code", code)], *n)
        }),
    );
}

/// What was recorded as it happened: AWS calls, DEL requests, pod-ENI
/// errors, the start's durations.
fn render_recorded(e: &mut Exposition, recorded: &recorder::Recorded) {
    use MetricType::Counter as C;
    let by_fn = |map: &BTreeMap<&'static str, u64>| {
        map.iter()
            .map(|(function, n)| (vec![("fn", (*function).to_owned())], *n))
            .collect::<Vec<_>>()
    };
    e.family(
        "awscni_ec2api_req_count",
        C,
        "The number of requests made to EC2 APIs by CNI",
        by_fn(&recorded.ec2_requests),
    );
    e.family(
        "awscni_ec2api_error_count",
        C,
        "The number of failed EC2 APIs requests",
        by_fn(&recorded.ec2_errors),
    );
    e.family(
        "awscni_aws_api_error_count",
        C,
        "The number of times AWS API returns an error",
        recorded.api_errors.iter().map(|((api, code), n)| {
            (
                vec![("api", (*api).to_owned()), ("error", code.clone())],
                *n,
            )
        }),
    );
    e.summary(
        "awscni_aws_api_latency_ms",
        "AWS API call latency in ms",
        recorded.latency.iter().map(|(key, latency)| {
            (
                vec![
                    ("api", key.api.to_owned()),
                    ("error", key.error.to_string()),
                    ("status", key.status.clone()),
                ],
                latency.count,
                #[allow(clippy::cast_precision_loss)] // milliseconds
                {
                    latency.sum_ms as f64
                },
            )
        }),
    );
    e.family(
        "awscni_del_ip_req_count",
        C,
        "The number of delete IP address requests",
        recorded
            .del_requests
            .iter()
            .map(|(reason, n)| (vec![("reason", reason.clone())], *n)),
    );
    e.family(
        "awscni_pod_eni_error_count",
        C,
        "The number of errors encountered for pod ENIs",
        by_fn(&recorded.pod_eni_errors),
    );
    e.histogram(
        "awscni_ipamd_startup_duration_seconds",
        "The duration of IPAMD startup from process start to ready to serve CNI requests",
        &recorder::DURATION_BUCKETS,
        recorded.startup.iter().map(|(key, h)| {
            (
                vec![
                    ("success", key.success.to_string()),
                    ("with_api_server", key.with_api_server.to_string()),
                    ("failure_reason", key.failure_reason.to_owned()),
                ],
                &h.buckets[..],
                h.count,
                h.sum,
            )
        }),
    );
    e.histogram(
        "awscni_ipamd_node_initialization_duration_seconds",
        "The duration of node initialization during IPAMD startup",
        &recorder::DURATION_BUCKETS,
        recorded.node_init.iter().map(|(success, h)| {
            (
                vec![("success", success.to_string())],
                &h.buckets[..],
                h.count,
                h.sum,
            )
        }),
    );
}

/// The datapath's counters and tables.
fn render_datapath(e: &mut Exposition, snapshot: &MetricsSnapshot) {
    use MetricType::{Counter as C, Gauge as G};
    let alloc = [Counter::AllocRetry, Counter::AllocOldestClosed];
    e.family(
        "vpcnet_datapath_verdicts_total",
        C,
        "Packets by the datapath's verdict (vpcnet-agent counters --all says what each means).",
        snapshot
            .counters
            .iter()
            .filter(|(c, _)| !c.is_drop() && !alloc.contains(c))
            .map(|(c, v)| (vec![("verdict", c.name().to_owned())], *v)),
    );
    e.family(
        "vpcnet_datapath_drops_total",
        C,
        "Packets the datapath dropped, by reason.",
        snapshot
            .counters
            .iter()
            .filter(|(c, _)| c.is_drop())
            .map(|(c, v)| {
                let reason = c.name().strip_prefix("drop_").unwrap_or(c.name());
                (vec![("reason", reason.to_owned())], *v)
            }),
    );
    let counter = |which: Counter| {
        snapshot
            .counters
            .iter()
            .find(|(c, _)| *c == which)
            .map_or(0, |(_, v)| *v)
    };
    e.single(
        "vpcnet_nat_port_alloc_retries_total",
        C,
        "SNAT source port candidates tried beyond the first.",
        counter(Counter::AllocRetry),
    );
    e.single(
        "vpcnet_nat_port_alloc_oldest_closed_total",
        C,
        "New flows that found every candidate port held and took the port of the flow closed \
         longest ago (within its TIME_WAIT hold).",
        counter(Counter::AllocOldestClosed),
    );
    render_nat_pressure(e, snapshot);
    e.single(
        "vpcnet_datapath_endpoints",
        G,
        "Pods in the datapath's endpoint map.",
        n(snapshot.endpoints),
    );
    e.single(
        "vpcnet_datapath_attached_interfaces",
        G,
        "Interfaces the programs are attached to (ENIs and pods' host veths).",
        n(snapshot.attached_interfaces),
    );
    e.single(
        "vpcnet_datapath_external_snat",
        G,
        "1 when AWS_VPC_K8S_CNI_EXTERNALSNAT is in force (no SNAT on the node).",
        u64::from(snapshot.external_snat),
    );
}

/// The flow maps' fill, the busiest remote endpoints, the collector's work.
fn render_nat_pressure(e: &mut Exposition, snapshot: &MetricsSnapshot) {
    use MetricType::{Counter as C, Gauge as G};
    let pressure = &snapshot.pressure;
    e.single(
        "vpcnet_nat_flows",
        G,
        "Flows in the NAT table.",
        n(pressure.nat_fwd.entries),
    );
    e.single(
        "vpcnet_nat_table_size",
        G,
        "Flows the NAT table holds at most (when it is full, an unanswered flow makes room \
         or the new flow is dropped).",
        u64::from(pressure.nat_fwd.capacity),
    );
    let maps = [
        (names::NAT_FWD, pressure.nat_fwd),
        (names::NAT_REV, pressure.nat_rev),
        (names::STACK_FLOWS, pressure.stack_flows),
    ];
    e.family(
        "vpcnet_map_entries",
        G,
        "Entries in each flow map.",
        maps.iter()
            .map(|(map, fill)| (vec![("map", (*map).to_owned())], n(fill.entries))),
    );
    e.family(
        "vpcnet_map_capacity",
        G,
        "Entries each flow map holds at most.",
        maps.iter()
            .map(|(map, fill)| (vec![("map", (*map).to_owned())], u64::from(fill.capacity))),
    );
    e.family(
        "vpcnet_nat_remote_endpoint_ports",
        G,
        "Ports of the node address held toward each of the busiest remote endpoints (address, \
         port, protocol): SNAT ports are unique per remote endpoint, so the port range runs \
         out one remote endpoint at a time.",
        pressure.busiest.iter().map(|e| {
            (
                vec![
                    ("proto", proto_name(e.proto)),
                    ("remote", endpoint(e.addr, e.port)),
                ],
                n(e.ports),
            )
        }),
    );
    let collector = &snapshot.collector;
    e.single(
        "vpcnet_gc_passes_total",
        C,
        "Passes of the flow garbage collector.",
        collector.passes,
    );
    e.single(
        "vpcnet_gc_last_pass_microseconds",
        G,
        "How long the collector's last pass over the NAT and stack flow maps took.",
        u64::try_from(collector.last_pass.as_micros()).unwrap_or(u64::MAX),
    );
    e.family(
        "vpcnet_gc_removed_total",
        C,
        "Flows the collector removed: over by their timeouts (expired), or halves left alone \
         (orphan).",
        [
            (vec![("reason", "expired".to_owned())], collector.expired),
            (vec![("reason", "orphan".to_owned())], collector.orphans),
        ],
    );
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connecting to {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("talking to {addr}: {source}")]
    Http { addr: String, source: hyper::Error },
    #[error("{addr} did not answer within {timeout:?}")]
    Timeout { addr: String, timeout: Duration },
    #[error("bad request for {0}")]
    Request(String),
}

/// `GET path` from the agent at `addr`: the status and the body.
pub async fn get(addr: &ListenAddr, path: &str) -> Result<(StatusCode, Bytes), ClientError> {
    const TIMEOUT: Duration = Duration::from_secs(30);
    let shown = addr.to_string();
    let exchange =
        async {
            match addr {
                ListenAddr::Tcp(socket) => {
                    let stream = TcpStream::connect(socket).await.map_err(|source| {
                        ClientError::Connect {
                            addr: shown.clone(),
                            source,
                        }
                    })?;
                    exchange(stream, &socket.to_string(), path, &shown).await
                }
                ListenAddr::Unix(socket) => {
                    let stream = UnixStream::connect(socket).await.map_err(|source| {
                        ClientError::Connect {
                            addr: shown.clone(),
                            source,
                        }
                    })?;
                    exchange(stream, "localhost", path, &shown).await
                }
            }
        };
    tokio::time::timeout(TIMEOUT, exchange)
        .await
        .map_err(|_| ClientError::Timeout {
            addr: shown.clone(),
            timeout: TIMEOUT,
        })?
}

async fn exchange<S>(
    stream: S,
    host: &str,
    path: &str,
    shown: &str,
) -> Result<(StatusCode, Bytes), ClientError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let http = |source| ClientError::Http {
        addr: shown.to_owned(),
        source,
    };
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(http)?;
    let connection = tokio::spawn(connection);
    let request = Request::get(path)
        .header(HOST, host)
        .body(http_body_util::Empty::<Bytes>::new())
        .map_err(|_| ClientError::Request(path.to_owned()))?;
    let response = sender.send_request(request).await.map_err(http)?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(http)?
        .to_bytes();
    connection.abort();
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use vpcnet_common::{addr_to_raw, port_to_raw};

    use super::*;
    use crate::{
        datapath::{EndpointPorts, MapFill},
        ipam::pool::PoolStats,
    };

    #[test]
    fn listen_addresses() {
        assert_eq!(
            "127.0.0.1:61679".parse::<ListenAddr>(),
            Ok(ListenAddr::Tcp("127.0.0.1:61679".parse().unwrap()))
        );
        assert_eq!(
            ":61678".parse::<ListenAddr>(),
            Ok(ListenAddr::Tcp("0.0.0.0:61678".parse().unwrap()))
        );
        assert_eq!(
            "unix:/run/vpcnet/introspection.sock".parse::<ListenAddr>(),
            Ok(ListenAddr::Unix("/run/vpcnet/introspection.sock".into()))
        );
        assert_eq!(
            "[::1]:61679".parse::<ListenAddr>().unwrap().to_string(),
            "[::1]:61679"
        );
        for bad in ["localhost", "61679", "unix:", "1.2.3.4"] {
            assert!(bad.parse::<ListenAddr>().is_err(), "{bad}");
        }
    }

    fn endpoints(vars: &[(&str, &str)], intro: Option<&str>, metrics: Option<&str>) -> Endpoints {
        Endpoints::from_env(&Env::from_pairs(vars.iter().copied()), intro, metrics).unwrap()
    }

    #[test]
    fn endpoints_from_the_vpc_cni_variables_and_flags() {
        let defaults = endpoints(&[], None, None);
        assert_eq!(
            defaults.introspection.unwrap().to_string(),
            DEFAULT_INTROSPECTION_ADDRESS
        );
        assert_eq!(
            defaults.metrics.unwrap().to_string(),
            DEFAULT_METRICS_ADDRESS
        );

        let set = endpoints(
            &[(ENV_INTROSPECTION_BIND_ADDRESS, "0.0.0.0:9000")],
            None,
            None,
        );
        assert_eq!(set.introspection.unwrap().to_string(), "0.0.0.0:9000");

        let off = endpoints(
            &[
                (ENV_DISABLE_INTROSPECTION, "true"),
                (ENV_DISABLE_METRICS, "true"),
            ],
            None,
            None,
        );
        assert_eq!(off.introspection, None);
        assert_eq!(off.metrics, None);

        // The flags win over the variables, disabled or not.
        let flags = endpoints(
            &[
                (ENV_DISABLE_INTROSPECTION, "true"),
                (ENV_INTROSPECTION_BIND_ADDRESS, "127.0.0.1:1"),
            ],
            Some("127.0.0.1:2"),
            Some("127.0.0.1:3"),
        );
        assert_eq!(flags.introspection.unwrap().to_string(), "127.0.0.1:2");
        assert_eq!(flags.metrics.unwrap().to_string(), "127.0.0.1:3");

        // What aws-node tolerates: metrics stay on, introspection goes.
        let env = Env::from_pairs([
            (ENV_DISABLE_METRICS, "maybe"),
            (ENV_INTROSPECTION_BIND_ADDRESS, "localhost"),
        ]);
        let tolerant = Endpoints::from_env(&env, None, None).unwrap();
        assert!(tolerant.metrics.is_some() && tolerant.introspection.is_none());
        let said: Vec<&str> = env.tolerated().iter().map(|t| t.variable).collect();
        assert_eq!(said, [ENV_INTROSPECTION_BIND_ADDRESS, ENV_DISABLE_METRICS]);
        let none = Env::from_pairs(std::iter::empty::<(&str, &str)>());
        let err = Endpoints::from_env(&none, Some("nowhere"), None).unwrap_err();
        assert_eq!(err.variable, "--introspection-address");
    }

    #[test]
    fn nat_limit_from_the_query() {
        assert_eq!(nat_limit(""), Ok(DEFAULT_NAT_LIMIT));
        assert_eq!(nat_limit("limit=5"), Ok(5));
        assert_eq!(nat_limit("x=1&limit=0"), Ok(0));
        assert!(nat_limit("limit=lots").is_err());
    }

    fn snapshot(ipam: bool) -> MetricsSnapshot {
        let status = IpamStatus {
            stats: PoolStats {
                total_ips: 18,
                assigned_ips: 3,
                cooling_ips: 1,
                total_prefixes: 0,
                free_prefixes: 0,
            },
            enis: 2,
            max_enis: 3,
            max_pods: 29,
            max_ips: 27,
            prefix_fallback: false,
            counters: vec![
                ("assigned", 4),
                ("assign_failures", 1),
                ("released", 1),
                ("ec2_errors", 2),
                ("ec2_throttled", 1),
                ("enis_found", 1),
                ("cidrs_found", 3),
                ("cidrs_lost", 2),
            ],
            events: vec![],
        };
        MetricsSnapshot {
            ipam: ipam.then(|| {
                (
                    status,
                    vec![("eni-0".to_owned(), 2), ("eni-\"odd\"\n".to_owned(), 1)],
                )
            }),
            counters: Counter::ALL
                .iter()
                .enumerate()
                .map(|(i, c)| (*c, n(i)))
                .collect(),
            endpoints: 3,
            attached_interfaces: 5,
            external_snat: false,
            pressure: NatPressure {
                nat_fwd: MapFill {
                    entries: 5,
                    capacity: 262_144,
                },
                nat_rev: MapFill {
                    entries: 6,
                    capacity: 262_144,
                },
                stack_flows: MapFill {
                    entries: 4,
                    capacity: 262_144,
                },
                busiest: vec![
                    EndpointPorts {
                        proto: 6,
                        addr: addr_to_raw([203, 0, 113, 10]),
                        port: port_to_raw(443),
                        ports: 4,
                    },
                    EndpointPorts {
                        proto: 17,
                        addr: addr_to_raw([203, 0, 113, 53]),
                        port: port_to_raw(53),
                        ports: 2,
                    },
                ],
            },
            collector: CollectorReport {
                passes: 7,
                last_pass: Duration::from_micros(1500),
                expired: 9,
                orphans: 1,
            },
            per_cidr: vec![
                ("10.0.1.5/32".to_owned(), 1),
                ("10.0.2.16/28".to_owned(), 3),
            ],
            // Without the address manager nothing calls AWS or serves the
            // plugin.
            recorded: if ipam {
                recorded()
            } else {
                recorder::Recorded::default()
            },
        }
    }

    /// AWS calls, a DEL, a pod-ENI error, a start, as the recorder holds
    /// them.
    fn recorded() -> recorder::Recorded {
        use recorder::Outcome;
        let mut r = recorder::Recorded::default();
        r.ec2_call(
            "CreateNetworkInterface",
            Duration::from_millis(40),
            Outcome::Ok,
        );
        r.ec2_call(
            "CreateNetworkInterface",
            Duration::from_millis(7),
            Outcome::ApiError("RequestLimitExceeded"),
        );
        r.aws_call(recorder::IMDS_API, Duration::from_millis(2), Outcome::Ok);
        r.del_request("PodDeleted");
        r.pod_eni_errors
            .insert(recorder::POD_ENI_ENABLE_SECURITY_GROUPS, 2);
        r.kubernetes_answers.insert(Some(403), 3);
        r.kubernetes_answers.insert(None, 1);
        r.actions.insert(recorder::ACTION_INCREASE_POOL, 1);
        r.startup
            .entry(recorder::StartupKey {
                success: true,
                with_api_server: false,
                failure_reason: "",
            })
            .or_default()
            .observe(1.5);
        r.node_init.entry(true).or_default().observe(0.2);
        r
    }

    /// A sample line: name, labels (unescaped), value.
    type Parsed = (String, Vec<(String, String)>, f64);

    /// Reads an exposition as Prometheus would, strictly: every family
    /// has HELP then TYPE before its samples, names are valid, label
    /// values are quoted and escaped.
    fn parse(text: &str) -> (BTreeMap<String, String>, Vec<Parsed>) {
        let mut types = BTreeMap::new();
        let mut helped = BTreeSet::new();
        let mut samples = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, _) = rest.split_once(' ').expect("HELP name text");
                assert!(helped.insert(name.to_owned()), "HELP twice for {name}");
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("TYPE name kind");
                assert!(helped.contains(name), "TYPE before HELP for {name}");
                assert!(
                    ["counter", "gauge", "histogram", "summary"].contains(&kind),
                    "{line}"
                );
                assert!(
                    types.insert(name.to_owned(), kind.to_owned()).is_none(),
                    "TYPE twice for {name}"
                );
                continue;
            }
            assert!(!line.starts_with('#'), "{line}");
            let (series, value) = line.rsplit_once(' ').expect("series value");
            let value: f64 = value.parse().expect("a number");
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => {
                    let body = rest.strip_suffix('}').expect("closing brace");
                    (name, parse_labels(body))
                }
                None => (series, Vec::new()),
            };
            assert!(exposition::valid_metric_name(name), "{name}");
            // A histogram's or a summary's samples carry a suffix.
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| {
                    name.strip_suffix(suffix).filter(|f| {
                        types
                            .get(*f)
                            .is_some_and(|k| k != "counter" && k != "gauge")
                    })
                })
                .unwrap_or(name);
            assert!(
                types.contains_key(family),
                "sample of {name} before its TYPE"
            );
            samples.push((name.to_owned(), labels, value));
        }
        (types, samples)
    }

    fn parse_labels(body: &str) -> Vec<(String, String)> {
        let mut labels = Vec::new();
        let mut chars = body.chars().peekable();
        while chars.peek().is_some() {
            let name: String = chars.by_ref().take_while(|c| *c != '=').collect();
            assert!(exposition::valid_label_name(&name), "{name}");
            assert_eq!(chars.next(), Some('"'));
            let mut value = String::new();
            loop {
                match chars.next().expect("unterminated label value") {
                    '\\' => match chars.next() {
                        Some('\\') => value.push('\\'),
                        Some('"') => value.push('"'),
                        Some('n') => value.push('\n'),
                        other => panic!("bad escape {other:?}"),
                    },
                    '"' => break,
                    '\n' => panic!("raw line feed in a label value"),
                    c => value.push(c),
                }
            }
            labels.push((name, value));
            if chars.peek() == Some(&',') {
                chars.next();
            }
        }
        labels
    }

    fn value(samples: &[Parsed], name: &str, labels: &[(&str, &str)]) -> u64 {
        let value = float_value(samples, name, labels);
        assert!(value.fract() == 0.0 && value >= 0.0, "{name}: {value}");
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // checked
        {
            value as u64
        }
    }

    fn float_value(samples: &[Parsed], name: &str, labels: &[(&str, &str)]) -> f64 {
        samples
            .iter()
            .find(|(n, l, _)| {
                n == name
                    && l.len() == labels.len()
                    && labels
                        .iter()
                        .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .unwrap_or_else(|| panic!("no sample {name}{labels:?}"))
            .2
    }

    #[test]
    fn metrics_with_the_address_manager() {
        let text = render_metrics(&snapshot(true));
        let (types, samples) = parse(&text);
        assert_eq!(value(&samples, "awscni_eni_allocated", &[]), 2);
        assert_eq!(value(&samples, "awscni_eni_max", &[]), 3);
        assert_eq!(value(&samples, "awscni_ip_max", &[]), 27);
        assert_eq!(value(&samples, "awscni_total_ip_addresses", &[]), 18);
        assert_eq!(value(&samples, "awscni_assigned_ip_addresses", &[]), 3);
        assert_eq!(value(&samples, "awscni_add_ip_req_count", &[]), 5);
        assert_eq!(value(&samples, "awscni_no_available_ip_addresses", &[]), 1);
        assert_eq!(
            value(&samples, "awscni_ipamd_error_count", &[("fn", "reconcile")]),
            2
        );
        assert_eq!(
            value(&samples, "awscni_assigned_ip_per_eni", &[("eni", "eni-0")]),
            2
        );
        // A label value with a quote and a line feed comes back intact.
        assert_eq!(
            value(
                &samples,
                "awscni_assigned_ip_per_eni",
                &[("eni", "eni-\"odd\"\n")]
            ),
            1
        );
        assert_eq!(value(&samples, "vpcnet_ipam_released_total", &[]), 1);
        assert_eq!(value(&samples, "vpcnet_ipam_cooling_ip_addresses", &[]), 1);
        // NAT pressure: each map's fill, the busiest remote endpoints, the
        // collector's work.
        assert_eq!(value(&samples, "vpcnet_nat_flows", &[]), 5);
        assert_eq!(
            value(&samples, "vpcnet_map_entries", &[("map", "VPCNET_NAT_REV")]),
            6
        );
        assert_eq!(
            value(
                &samples,
                "vpcnet_map_capacity",
                &[("map", "VPCNET_STACK_PAIRS")]
            ),
            262_144
        );
        assert_eq!(
            value(
                &samples,
                "vpcnet_nat_remote_endpoint_ports",
                &[("proto", "tcp"), ("remote", "203.0.113.10:443")]
            ),
            4
        );
        assert_eq!(value(&samples, "vpcnet_gc_passes_total", &[]), 7);
        assert_eq!(
            value(&samples, "vpcnet_gc_last_pass_microseconds", &[]),
            1500
        );
        assert_eq!(
            value(
                &samples,
                "vpcnet_gc_removed_total",
                &[("reason", "expired")]
            ),
            9
        );
        // Counters are counters, pool figures gauges.
        for (name, kind) in [
            ("awscni_add_ip_req_count", "counter"),
            ("awscni_force_removed_ips", "counter"),
            ("vpcnet_ipam_assigned_total", "counter"),
            ("vpcnet_datapath_drops_total", "counter"),
            ("vpcnet_nat_port_alloc_retries_total", "counter"),
            ("awscni_total_ip_addresses", "gauge"),
            ("awscni_build_info", "gauge"),
            ("vpcnet_nat_flows", "gauge"),
            ("vpcnet_nat_table_size", "gauge"),
            ("vpcnet_map_entries", "gauge"),
            ("vpcnet_nat_remote_endpoint_ports", "gauge"),
            ("vpcnet_gc_removed_total", "counter"),
        ] {
            assert_eq!(types[name], kind, "{name}");
        }
        // Every counter family ends in _total except aws-node's own names.
        for (name, kind) in &types {
            if kind == "counter" && !name.starts_with("awscni_") {
                assert!(name.ends_with("_total"), "{name}");
            }
        }
    }

    #[test]
    #[allow(clippy::too_many_lines)] // one metric after another
    fn metrics_aws_node_serves_with_its_labels() {
        let text = render_metrics(&snapshot(true));
        let (types, samples) = parse(&text);
        let create = [("fn", "CreateNetworkInterface")];
        assert_eq!(value(&samples, "awscni_ec2api_req_count", &create), 2);
        assert_eq!(value(&samples, "awscni_ec2api_error_count", &create), 1);
        assert_eq!(
            value(
                &samples,
                "awscni_aws_api_error_count",
                &[
                    ("api", "CreateNetworkInterface"),
                    ("error", "RequestLimitExceeded")
                ]
            ),
            1
        );
        let ok = [
            ("api", "CreateNetworkInterface"),
            ("error", "false"),
            ("status", "200"),
        ];
        assert_eq!(value(&samples, "awscni_aws_api_latency_ms_count", &ok), 1);
        assert_eq!(value(&samples, "awscni_aws_api_latency_ms_sum", &ok), 40);
        let throttled = [
            ("api", "CreateNetworkInterface"),
            ("error", "true"),
            ("status", "RequestLimitExceeded"),
        ];
        assert_eq!(
            value(&samples, "awscni_aws_api_latency_ms_sum", &throttled),
            7
        );
        let imds = [
            ("api", "GetMetadata"),
            ("error", "false"),
            ("status", "200"),
        ];
        assert_eq!(value(&samples, "awscni_aws_api_latency_ms_count", &imds), 1);
        assert_eq!(
            value(
                &samples,
                "awscni_del_ip_req_count",
                &[("reason", "PodDeleted")]
            ),
            1
        );
        assert_eq!(
            value(
                &samples,
                "awscni_pod_eni_error_count",
                &[("fn", "tryEnableSecurityGroupsForPods")]
            ),
            2
        );
        for (code, answers) in [("403", 3), ("none", 1)] {
            assert_eq!(
                value(
                    &samples,
                    "vpcnet_kubernetes_api_answers_total",
                    &[("code", code)]
                ),
                answers
            );
        }
        for (action, under_way) in [
            ("nodeInit", 0),
            ("increaseDatastorePool", 1),
            ("decreaseDatastorePool", 0),
            ("nodeIPPoolReconcile", 0),
        ] {
            assert_eq!(
                value(
                    &samples,
                    "awscni_ipamd_action_inprogress",
                    &[("fn", action)]
                ),
                under_way,
                "{action}"
            );
        }
        for (function, n) in [
            ("eniReconcileAdd", 1),
            ("eniReconcileDel", 0),
            ("eniDataStorePoolReconcileAdd", 3),
            ("eniIPPoolReconcileDel", 2),
        ] {
            assert_eq!(
                value(&samples, "awscni_reconcile_count", &[("fn", function)]),
                n,
                "{function}"
            );
        }
        assert_eq!(
            value(
                &samples,
                "awscni_assigned_ip_per_cidr",
                &[("cidr", "10.0.2.16/28")]
            ),
            3
        );
        let started = [
            ("success", "true"),
            ("with_api_server", "false"),
            ("failure_reason", ""),
        ];
        assert_eq!(
            value(
                &samples,
                "awscni_ipamd_startup_duration_seconds_count",
                &started
            ),
            1
        );
        let le = |bound: &'static str| {
            let mut labels = started.to_vec();
            labels.push(("le", bound));
            value(
                &samples,
                "awscni_ipamd_startup_duration_seconds_bucket",
                &labels,
            )
        };
        assert_eq!((le("1"), le("2.5"), le("+Inf")), (0, 1, 1));
        assert!(
            (float_value(
                &samples,
                "awscni_ipamd_startup_duration_seconds_sum",
                &started
            ) - 1.5)
                .abs()
                < 1e-9
        );
        assert_eq!(
            value(
                &samples,
                "awscni_ipamd_node_initialization_duration_seconds_count",
                &[("success", "true")]
            ),
            1
        );
        for (name, kind) in [
            ("awscni_ec2api_req_count", "counter"),
            ("awscni_ec2api_error_count", "counter"),
            ("awscni_aws_api_error_count", "counter"),
            ("awscni_aws_api_latency_ms", "summary"),
            ("awscni_del_ip_req_count", "counter"),
            ("awscni_pod_eni_error_count", "counter"),
            ("vpcnet_kubernetes_api_answers_total", "counter"),
            ("awscni_ipamd_action_inprogress", "gauge"),
            ("awscni_reconcile_count", "counter"),
            ("awscni_assigned_ip_per_cidr", "gauge"),
            ("awscni_ipamd_startup_duration_seconds", "histogram"),
            (
                "awscni_ipamd_node_initialization_duration_seconds",
                "histogram",
            ),
        ] {
            assert_eq!(types.get(name).map(String::as_str), Some(kind), "{name}");
        }
    }

    #[test]
    fn metrics_of_the_datapath() {
        let snap = snapshot(false);
        let (types, samples) = parse(&render_metrics(&snap));
        assert!(
            !types
                .keys()
                .any(|n| n.starts_with("awscni_") && n != "awscni_build_info"),
            "no pool figures without the address manager: {types:?}"
        );
        // Every datapath counter is reported exactly once.
        let mut reported = 0;
        for (counter, v) in &snap.counters {
            let found: Vec<&Parsed> = samples
                .iter()
                .filter(|(name, labels, _)| match counter {
                    Counter::AllocRetry => name == "vpcnet_nat_port_alloc_retries_total",
                    Counter::AllocOldestClosed => {
                        name == "vpcnet_nat_port_alloc_oldest_closed_total"
                    }
                    c if c.is_drop() => {
                        name == "vpcnet_datapath_drops_total"
                            && labels[0].1 == c.name().trim_start_matches("drop_")
                    }
                    c => name == "vpcnet_datapath_verdicts_total" && labels[0].1 == c.name(),
                })
                .collect();
            assert_eq!(found.len(), 1, "{counter:?}");
            #[allow(clippy::cast_precision_loss)] // small test values
            let expected = *v as f64;
            assert!((found[0].2 - expected).abs() < f64::EPSILON, "{counter:?}");
            reported += 1;
        }
        assert_eq!(reported, Counter::ALL.len());
        assert_eq!(
            value(
                &samples,
                "vpcnet_datapath_drops_total",
                &[("reason", "nat_no_port")]
            ),
            n(Counter::ALL
                .iter()
                .position(|c| *c == Counter::DropNatNoPort)
                .unwrap())
        );
        assert_eq!(value(&samples, "vpcnet_nat_flows", &[]), 5);
        assert_eq!(value(&samples, "vpcnet_nat_table_size", &[]), 262_144);
    }
}
