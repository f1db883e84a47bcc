//! The API server's HTTP side: HTTPS with bearer tokens for clients (the
//! agent, kubectl), plain HTTP on a Unix socket for the lab itself (as the
//! cluster's administrator: kubelet, the VPC resource controller), both on
//! one store.
//!
//! What it speaks, as the real server does: legacy discovery, `/version`,
//! the OpenAPI v3 index kubectl's validation asks for, list, get, create,
//! update, merge/strategic/apply patches, delete, and watches (newline
//! separated events, bookmarks, `ERROR 410` for a resourceVersion the
//! history no longer holds). Requests are authorised by RBAC from the
//! stored roles and bindings, and counted; faults (an HTTP status, a delay,
//! a dropped connection) can be injected per verb and resource, and every
//! open watch ended at once, as a restart of the server ends them.

use std::{
    collections::BTreeMap,
    convert::Infallible,
    net::SocketAddr,
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{
    Method, Request, Response, StatusCode,
    body::{Body, Frame, Incoming},
    header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::{TcpListener, UnixListener},
    sync::{broadcast::error::RecvError, mpsc, watch},
};
use tokio_rustls::TlsAcceptor;
use tracing::{debug, info, warn};

use super::{
    rbac::{self, Identity},
    resources::{self, Resource},
    selector::Selector,
    store::{ApiError, Change, ChangeType, PatchKind, Store, Subscription},
};

/// The largest request body the real server takes.
const MAX_BODY: usize = 3 * 1024 * 1024;
/// The version `/version` reports: the Kubernetes minor the lab's kinds
/// follow (k8s-openapi's `v1_33`).
pub const SERVED_VERSION: (&str, &str) = ("1", "33");

/// The admin socket's own paths.
pub mod admin_paths {
    /// `GET`: [`super::CallsView`].
    pub const CALLS: &str = "/lab/calls";
    /// `PUT` a list of [`super::FaultRule`]s: replaces them.
    pub const FAULTS: &str = "/lab/faults";
    /// `POST`: every open watch ends, as when the API server restarts.
    pub const END_WATCHES: &str = "/lab/end-watches";
}

/// How the server runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServerConfig {
    /// Bearer tokens and whom they authenticate.
    pub tokens: Vec<TokenEntry>,
    /// How often a watch that asked for bookmarks gets one.
    #[serde(default = "default_bookmark_ms")]
    pub bookmark_interval_ms: u64,
    /// A watch's length when the client names none (the real server picks
    /// 30 to 60 minutes).
    #[serde(default = "default_watch_timeout")]
    pub default_watch_timeout_secs: u64,
    /// How many changes watches can replay.
    #[serde(default = "default_history")]
    pub history: usize,
    /// Custom resources (by plural) the cluster has not installed.
    #[serde(default)]
    pub uninstalled: Vec<String>,
}

fn default_bookmark_ms() -> u64 {
    60_000
}

fn default_watch_timeout() -> u64 {
    1800
}

fn default_history() -> usize {
    super::store::DEFAULT_HISTORY
}

/// One bearer token.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenEntry {
    pub token: String,
    pub user: String,
    #[serde(default)]
    pub groups: Vec<String>,
}

/// An injected fault: requests that match get it, `count` times (forever
/// if `None`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct FaultRule {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`; any if `None`.
    #[serde(default)]
    pub verb: Option<String>,
    /// A resource's plural; any if `None`.
    #[serde(default)]
    pub resource: Option<String>,
    /// The authenticated user; any if `None`.
    #[serde(default)]
    pub user: Option<String>,
    /// Answer with this status (a `Status` body) instead of serving.
    #[serde(default)]
    pub status: Option<u16>,
    /// Wait this long first.
    #[serde(default)]
    pub delay_ms: Option<u64>,
    /// Close the connection without an answer.
    #[serde(default)]
    pub drop_connection: bool,
    #[serde(default)]
    pub count: Option<u64>,
}

impl FaultRule {
    fn matches(&self, call: &CallKey) -> bool {
        self.verb.as_ref().is_none_or(|v| *v == call.verb)
            && self.resource.as_ref().is_none_or(|r| *r == call.resource)
            && self.user.as_ref().is_none_or(|u| *u == call.user)
            && self.count != Some(0)
    }
}

/// Requests by user, verb and resource, and their answers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallsView {
    pub calls: Vec<CallCount>,
}

impl CallsView {
    /// The answers `user` got to `verb` on `resource`, by status.
    pub fn answers(&self, user: &str, verb: &str, resource: &str) -> BTreeMap<u16, u64> {
        self.calls
            .iter()
            .filter(|c| c.user == user && c.verb == verb && c.resource == resource)
            .map(|c| (c.status, c.count))
            .collect()
    }

    /// How many requests `user` made, whatever they were.
    pub fn total(&self, user: &str) -> u64 {
        self.calls
            .iter()
            .filter(|c| c.user == user)
            .map(|c| c.count)
            .sum()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallCount {
    pub user: String,
    pub verb: String,
    pub resource: String,
    pub status: u16,
    pub count: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct CallKey {
    user: String,
    verb: String,
    resource: String,
}

type ApiBody = http_body_util::Either<Full<Bytes>, WatchBody>;

/// A watch's body: event lines from the watch's task.
#[derive(Debug)]
pub struct WatchBody {
    lines: mpsc::Receiver<Bytes>,
}

impl Body for WatchBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.lines
            .poll_recv(cx)
            .map(|line| line.map(|l| Ok(Frame::data(l))))
    }
}

/// The server: one store behind its listeners.
#[derive(Clone)]
pub struct KubeApi {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for KubeApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeApi").finish_non_exhaustive()
    }
}

struct Shared {
    store: Mutex<Store>,
    config: ServerConfig,
    faults: Mutex<Vec<FaultRule>>,
    calls: Mutex<BTreeMap<(CallKey, u16), u64>>,
    /// Bumped to end every open watch.
    watches_ended: watch::Sender<u64>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Who asks: a client over TLS (its token says who) or the lab itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Channel {
    Tls,
    Admin,
}

/// The connection is closed without an answer (an injected fault).
#[derive(Debug)]
struct Dropped;

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection dropped (injected fault)")
    }
}

impl std::error::Error for Dropped {}

impl KubeApi {
    pub fn new(config: ServerConfig) -> Self {
        Self {
            shared: Arc::new(Shared {
                store: Mutex::new(Store::new(config.history)),
                config,
                faults: Mutex::new(Vec::new()),
                calls: Mutex::new(BTreeMap::new()),
                watches_ended: watch::Sender::new(0),
            }),
        }
    }

    /// Serves HTTPS on `listener` until the process ends.
    pub async fn serve_https(&self, listener: TcpListener, tls: Arc<rustls::ServerConfig>) {
        let acceptor = TlsAcceptor::from(tls);
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(err) => {
                    warn!(%err, "accept failed");
                    continue;
                }
            };
            let acceptor = acceptor.clone();
            let shared = self.shared.clone();
            tokio::spawn(async move {
                match acceptor.accept(stream).await {
                    Ok(tls) => serve_connection(tls, shared, Channel::Tls, Some(peer)).await,
                    Err(err) => debug!(%err, %peer, "TLS handshake failed"),
                }
            });
        }
    }

    /// Runs the lab's network policy controller on this server's store
    /// until the process ends; in a cluster without its CRD, none (on EKS
    /// the controller comes with it).
    pub async fn run_policy_controller(&self) {
        use vpcnet_api::policy_endpoint as pe;
        if resources::find(pe::GROUP, pe::VERSION, pe::PLURAL).is_none() {
            info!("no PolicyEndpoint CRD: no network policy controller");
            return std::future::pending().await;
        }
        super::policy_controller::run(&self.shared.store).await;
    }

    /// Serves the lab's admin socket until the process ends.
    pub async fn serve_admin(&self, listener: UnixListener) {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    let shared = self.shared.clone();
                    tokio::spawn(serve_connection(stream, shared, Channel::Admin, None));
                }
                Err(err) => warn!(%err, "admin accept failed"),
            }
        }
    }
}

async fn serve_connection<IO>(
    io: IO,
    shared: Arc<Shared>,
    channel: Channel,
    peer: Option<SocketAddr>,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(move |req| {
        let shared = shared.clone();
        async move { handle(&shared, channel, req).await }
    });
    if let Err(err) = http1::Builder::new()
        .serve_connection(TokioIo::new(io), service)
        .await
    {
        debug!(%err, ?peer, "connection ended with an error");
    }
}

fn json_response(status: u16, value: &Value) -> Response<ApiBody> {
    let mut response = Response::new(http_body_util::Either::Left(Full::new(Bytes::from(
        serde_json::to_vec(value).expect("values serialize"),
    ))));
    *response.status_mut() =
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn error_response(err: &ApiError) -> Response<ApiBody> {
    json_response(err.code, &err.status())
}

/// What a request asks of a resource.
#[derive(Debug, Clone)]
struct ResourceRequest {
    resource: &'static Resource,
    namespace: Option<String>,
    name: Option<String>,
}

/// `/api/v1/...` or `/apis/g/v/...` to a resource, a namespace and a name.
fn parse_resource_path(path: &str) -> Option<ResourceRequest> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segments.as_slice() {
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return None,
    };
    let (namespace, plural, name) = match rest {
        ["namespaces", ns, plural, name] => (Some(*ns), *plural, Some(*name)),
        ["namespaces", ns, plural] => (Some(*ns), *plural, None),
        // The namespace object itself.
        ["namespaces", name] => (None, "namespaces", Some(*name)),
        [plural, name] => (None, *plural, Some(*name)),
        [plural] => (None, *plural, None),
        _ => return None,
    };
    let resource = resources::find(group, version, plural)?;
    if namespace.is_some() && !resource.namespaced {
        return None;
    }
    Some(ResourceRequest {
        resource,
        namespace: namespace.map(str::to_owned),
        name: name.map(str::to_owned),
    })
}

fn verb_of(method: &Method, named: bool, watch: bool) -> &'static str {
    match (method.as_str(), named) {
        ("GET", _) if watch => "watch",
        ("GET", true) => "get",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => "unknown",
    }
}

async fn handle(
    shared: &Arc<Shared>,
    channel: Channel,
    req: Request<Incoming>,
) -> Result<Response<ApiBody>, Dropped> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let query: BTreeMap<String, String> = req
        .uri()
        .query()
        .map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
        .unwrap_or_default();
    debug!(%method, %path, ?query, ?channel, "request");
    if channel == Channel::Admin && path.starts_with("/lab/") {
        return Ok(admin(shared, &method, &path, req).await);
    }
    let identity = match channel {
        Channel::Admin => Identity::lab_admin(),
        Channel::Tls => match authenticate(&shared.config, &req) {
            Some(identity) => identity,
            None if is_public(&path) => Identity::anonymous(),
            None => {
                return Ok(error_response(&ApiError::new(
                    401,
                    "Unauthorized",
                    "Unauthorized",
                )));
            }
        },
    };
    let Some(target) = parse_resource_path(&path) else {
        return Ok(non_resource(&method, &path));
    };
    let watch = query.get("watch").is_some_and(|w| w == "true" || w == "1");
    let verb = verb_of(&method, target.name.is_some(), watch);
    let call = CallKey {
        user: identity.user.clone(),
        verb: verb.to_owned(),
        resource: target.resource.plural.to_owned(),
    };
    if let Some(answer) = inject_fault(shared, &call).await? {
        count(shared, &call, answer.code);
        return Ok(error_response(&answer));
    }
    let allowed = {
        let store = lock(&shared.store);
        rbac::authorize(
            &store,
            &identity,
            verb,
            target.resource,
            target.namespace.as_deref(),
            target.name.as_deref(),
        )
    };
    if let Err(denied) = allowed {
        count(shared, &call, 403);
        return Ok(error_response(&denied));
    }
    let content_type = req
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned();
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(body) => body.to_bytes(),
        Err(err) => {
            let err = ApiError::new(413, "RequestEntityTooLarge", err.to_string());
            count(shared, &call, err.code);
            return Ok(error_response(&err));
        }
    };
    let response = if watch {
        start_watch(shared, &target, &query)
    } else {
        serve_resource(shared, &target, verb, &query, &content_type, &body)
    };
    count(shared, &call, response.status().as_u16());
    Ok(response)
}

fn authenticate(config: &ServerConfig, req: &Request<Incoming>) -> Option<Identity> {
    let header = req.headers().get(AUTHORIZATION)?.to_str().ok()?;
    let token = header.strip_prefix("Bearer ")?.trim();
    config
        .tokens
        .iter()
        .find(|entry| entry.token == token)
        .map(|entry| Identity {
            user: entry.user.clone(),
            groups: entry.groups.clone(),
        })
}

/// What the real server lets anyone read (`system:public-info-viewer`).
fn is_public(path: &str) -> bool {
    matches!(path, "/healthz" | "/livez" | "/readyz" | "/version")
}

async fn inject_fault(shared: &Shared, call: &CallKey) -> Result<Option<ApiError>, Dropped> {
    let fault = {
        let mut faults = lock(&shared.faults);
        faults
            .iter_mut()
            .find(|rule| rule.matches(call))
            .map(|rule| {
                if let Some(count) = rule.count.as_mut() {
                    *count -= 1;
                }
                rule.clone()
            })
    };
    let Some(fault) = fault else {
        return Ok(None);
    };
    if let Some(ms) = fault.delay_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if fault.drop_connection {
        count(shared, call, 0);
        return Err(Dropped);
    }
    Ok(fault.status.map(|code| {
        let reason = match code {
            401 => "Unauthorized",
            403 => "Forbidden",
            404 => "NotFound",
            409 => "Conflict",
            410 => "Expired",
            429 => "TooManyRequests",
            503 => "ServiceUnavailable",
            504 => "Timeout",
            _ => "InternalError",
        };
        ApiError::new(
            code,
            reason,
            format!("injected by the lab: {code} {reason}"),
        )
    }))
}

fn count(shared: &Shared, call: &CallKey, status: u16) {
    *lock(&shared.calls)
        .entry((call.clone(), status))
        .or_default() += 1;
}

fn calls_view(shared: &Shared) -> CallsView {
    CallsView {
        calls: lock(&shared.calls)
            .iter()
            .map(|((key, status), count)| CallCount {
                user: key.user.clone(),
                verb: key.verb.clone(),
                resource: key.resource.clone(),
                status: *status,
                count: *count,
            })
            .collect(),
    }
}

async fn admin(
    shared: &Shared,
    method: &Method,
    path: &str,
    req: Request<Incoming>,
) -> Response<ApiBody> {
    let body = match req.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(err) => return error_response(&ApiError::bad_request(err.to_string())),
    };
    match (method.as_str(), path) {
        ("GET", admin_paths::CALLS) => json_response(
            200,
            &serde_json::to_value(calls_view(shared)).expect("serializes"),
        ),
        ("PUT", admin_paths::FAULTS) => match serde_json::from_slice::<Vec<FaultRule>>(&body) {
            Ok(rules) => {
                info!(?rules, "faults set");
                *lock(&shared.faults) = rules;
                json_response(200, &json!({"ok": true}))
            }
            Err(err) => error_response(&ApiError::bad_request(err.to_string())),
        },
        ("POST", admin_paths::END_WATCHES) => {
            let open = shared.watches_ended.receiver_count();
            shared.watches_ended.send_modify(|ended| *ended += 1);
            info!(open, "every open watch ended");
            json_response(200, &json!({"ended": open}))
        }
        _ => error_response(&ApiError::new(
            404,
            "NotFound",
            format!("no admin path {method} {path}"),
        )),
    }
}

/// Discovery, `/version`, OpenAPI and health: every authenticated user may
/// read them (the real server's `system:discovery` binding).
fn non_resource(method: &Method, path: &str) -> Response<ApiBody> {
    if method != Method::GET {
        return error_response(&ApiError::new(
            405,
            "MethodNotAllowed",
            format!("{method} is not served on {path}"),
        ));
    }
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let document = match segments.as_slice() {
        ["healthz" | "livez" | "readyz"] => {
            let mut response = Response::new(http_body_util::Either::Left(Full::new(
                Bytes::from_static(b"ok"),
            )));
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
            return response;
        }
        ["version"] => Some(json!({
            "major": SERVED_VERSION.0,
            "minor": SERVED_VERSION.1,
            "gitVersion": format!("v{}.{}.0-vpcnet-lab", SERVED_VERSION.0, SERVED_VERSION.1),
            "platform": "linux/amd64",
        })),
        ["api"] => Some(json!({
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [],
        })),
        ["apis"] => Some(super::discovery::group_list()),
        ["apis", group] => super::discovery::group(group),
        ["api", version] => super::discovery::resource_list("", version),
        ["apis", group, version] => super::discovery::resource_list(group, version),
        ["openapi", "v3"] => Some(super::discovery::openapi_index()),
        ["openapi", "v3", rest @ ..] => super::discovery::openapi_group_version(&rest.join("/")),
        _ => None,
    };
    match document {
        Some(document) => json_response(200, &document),
        None => error_response(&ApiError::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
        )),
    }
}

fn serve_resource(
    shared: &Shared,
    target: &ResourceRequest,
    verb: &str,
    query: &BTreeMap<String, String>,
    content_type: &str,
    body: &[u8],
) -> Response<ApiBody> {
    let resource = target.resource;
    let namespace = target.namespace.as_deref();
    let name = target.name.as_deref().unwrap_or_default();
    let parse_body = || -> Result<Value, ApiError> {
        serde_json::from_slice(body).map_err(|err| {
            ApiError::bad_request(format!(
                "the lab's server reads JSON bodies (YAML's JSON subset): {err}"
            ))
        })
    };
    let result: Result<(u16, Value), ApiError> = (|| {
        let mut store = lock(&shared.store);
        match verb {
            "list" => {
                let labels =
                    Selector::labels(query.get("labelSelector").map_or("", String::as_str))
                        .map_err(|e| ApiError::bad_request(e.to_string()))?;
                let fields =
                    Selector::fields(query.get("fieldSelector").map_or("", String::as_str))
                        .map_err(|e| ApiError::bad_request(e.to_string()))?;
                let items = store.list(resource, namespace, &labels, &fields);
                Ok((
                    200,
                    json!({
                        "kind": resource.list_kind(),
                        "apiVersion": resource.group_version(),
                        "metadata": {"resourceVersion": store.revision().to_string()},
                        "items": items,
                    }),
                ))
            }
            "get" => store.get(resource, namespace, name).map(|o| (200, o)),
            "create" => {
                if target.name.is_some() {
                    return Err(ApiError::new(
                        405,
                        "MethodNotAllowed",
                        "POST goes to the collection",
                    ));
                }
                store
                    .create(resource, namespace, parse_body()?)
                    .map(|o| (201, o))
            }
            "update" => store
                .update(resource, namespace, name, parse_body()?)
                .map(|o| (200, o)),
            "patch" => {
                let kind = match content_type {
                    "application/merge-patch+json" => PatchKind::Merge,
                    "application/strategic-merge-patch+json"
                        if resource.group.contains('.') && !resource.group.ends_with("k8s.io") =>
                    {
                        return Err(ApiError::new(
                            415,
                            "UnsupportedMediaType",
                            "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
                        ));
                    }
                    "application/strategic-merge-patch+json" => PatchKind::Strategic,
                    "application/apply-patch+yaml" => {
                        if query.get("fieldManager").is_none_or(String::is_empty) {
                            return Err(ApiError::bad_request(
                                "PATCH, application/apply-patch+yaml requires fieldManager to be set",
                            ));
                        }
                        PatchKind::Apply {
                            force: query.get("force").is_some_and(|f| f == "true"),
                        }
                    }
                    other => {
                        return Err(ApiError::new(
                            415,
                            "UnsupportedMediaType",
                            format!("the lab's server does not apply {other:?} patches"),
                        ));
                    }
                };
                store
                    .patch(resource, namespace, name, kind, &parse_body()?)
                    .map(|(object, created)| (if created { 201 } else { 200 }, object))
            }
            "delete" => store.delete(resource, namespace, name).map(|o| (200, o)),
            other => Err(ApiError::new(
                405,
                "MethodNotAllowed",
                format!("{other} is not served by the lab"),
            )),
        }
    })();
    match result {
        Ok((status, value)) => json_response(status, &value),
        Err(err) => error_response(&err),
    }
}

/// Whether `change` is seen by a watch with these selectors, and as what:
/// an object that stops matching is `DELETED` for it, one that starts
/// matching `ADDED`, as the real server's watch cache does.
fn as_seen(
    change: &Change,
    namespace: Option<&str>,
    labels: &Selector,
    fields: &Selector,
) -> Option<ChangeType> {
    let matches = |object: &Value| labels.matches_labels(object) && fields.matches_fields(object);
    if namespace.is_some_and(|ns| ns != change.namespace()) {
        return None;
    }
    let now = matches(&change.object);
    match (change.change, change.previous.as_ref().map(matches)) {
        (ChangeType::Modified, Some(before)) => match (before, now) {
            (true, true) => Some(ChangeType::Modified),
            (false, true) => Some(ChangeType::Added),
            (true, false) => Some(ChangeType::Deleted),
            (false, false) => None,
        },
        (kind, _) => now.then_some(kind),
    }
}

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line =
        serde_json::to_vec(&json!({"type": kind, "object": object})).expect("serializes");
    line.push(b'\n');
    Bytes::from(line)
}

fn bookmark(resource: &Resource, revision: u64, initial_events_end: bool) -> Bytes {
    let mut metadata = json!({"resourceVersion": revision.to_string()});
    if initial_events_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    event_line(
        "BOOKMARK",
        &json!({"kind": resource.kind, "apiVersion": resource.group_version(), "metadata": metadata}),
    )
}

/// What one watch follows and how.
struct WatchSpec {
    resource: &'static Resource,
    namespace: Option<String>,
    labels: Selector,
    fields: Selector,
    bookmarks: bool,
    send_initial: bool,
    timeout: Duration,
    bookmark_interval: Duration,
}

/// Where a watch starts.
enum WatchStart {
    /// The current objects as `ADDED`, then the changes after `revision`.
    Fresh {
        initial: Vec<Value>,
        subscription: Subscription,
        revision: u64,
    },
    /// The changes after `revision`.
    Since {
        subscription: Subscription,
        revision: u64,
    },
    /// `revision` is older than the history (`oldest`).
    TooOld { revision: u64, oldest: u64 },
}

fn start_watch(
    shared: &Arc<Shared>,
    target: &ResourceRequest,
    query: &BTreeMap<String, String>,
) -> Response<ApiBody> {
    let parse = |key: &str| query.get(key).map_or("", String::as_str);
    let (labels, fields) = match (
        Selector::labels(parse("labelSelector")),
        Selector::fields(parse("fieldSelector")),
    ) {
        (Ok(labels), Ok(fields)) => (labels, fields),
        (Err(err), _) | (_, Err(err)) => {
            return error_response(&ApiError::bad_request(err.to_string()));
        }
    };
    let fields = match &target.name {
        // A watch on one object (`.../nodes/n1?watch=true`).
        Some(name) => Selector::fields(&format!("metadata.name={name}")).expect("well formed"),
        None => fields,
    };
    let since: Option<u64> = match parse("resourceVersion") {
        "" | "0" => None,
        rv => match rv.parse() {
            Ok(rv) => Some(rv),
            Err(_) => {
                return error_response(&ApiError::bad_request(format!(
                    "invalid resourceVersion {rv:?}"
                )));
            }
        },
    };
    let spec = WatchSpec {
        resource: target.resource,
        namespace: target.namespace.clone(),
        labels,
        fields,
        bookmarks: parse("allowWatchBookmarks") == "true",
        send_initial: parse("sendInitialEvents") == "true",
        timeout: Duration::from_secs(
            parse("timeoutSeconds")
                .parse()
                .unwrap_or(shared.config.default_watch_timeout_secs),
        ),
        bookmark_interval: Duration::from_millis(shared.config.bookmark_interval_ms.max(10)),
    };
    let start = {
        let store = lock(&shared.store);
        let now = store.revision();
        match since {
            None => WatchStart::Fresh {
                initial: store.list(
                    spec.resource,
                    spec.namespace.as_deref(),
                    &spec.labels,
                    &spec.fields,
                ),
                subscription: store
                    .subscribe(now)
                    .expect("the current revision is in the history"),
                revision: now,
            },
            Some(revision) => match store.subscribe(revision) {
                Some(subscription) => WatchStart::Since {
                    subscription,
                    revision,
                },
                None => WatchStart::TooOld {
                    revision,
                    oldest: store.compacted(),
                },
            },
        }
    };
    let (tx, lines) = mpsc::channel::<Bytes>(64);
    let ended = shared.watches_ended.subscribe();
    tokio::spawn(async move {
        // The client went away: nothing to do.
        let _ = stream_watch(&tx, &spec, start, ended).await;
    });
    let mut response = Response::new(http_body_util::Either::Right(WatchBody { lines }));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// The watch's events until its timeout, a reader too slow, the lab
/// ending every watch, or the client leaving (`Err`).
async fn stream_watch(
    tx: &mpsc::Sender<Bytes>,
    spec: &WatchSpec,
    start: WatchStart,
    mut ended: watch::Receiver<u64>,
) -> Result<(), mpsc::error::SendError<Bytes>> {
    let (subscription, mut last) = match start {
        WatchStart::TooOld { revision, oldest } => {
            // A watch that can no longer start is answered inside the
            // stream, as the real server does after authorisation.
            let status = ApiError::new(
                410,
                "Expired",
                format!("too old resource version: {revision} ({oldest})"),
            );
            return tx.send(event_line("ERROR", &status.status())).await;
        }
        WatchStart::Fresh {
            initial,
            subscription,
            revision,
        } => {
            for object in &initial {
                tx.send(event_line("ADDED", object)).await?;
            }
            if spec.send_initial && spec.bookmarks {
                tx.send(bookmark(spec.resource, revision, true)).await?;
            }
            (subscription, revision)
        }
        WatchStart::Since {
            subscription,
            revision,
        } => (subscription, revision),
    };
    let mut live = subscription.live;
    let deadline = tokio::time::sleep(spec.timeout);
    tokio::pin!(deadline);
    let interval = spec.bookmark_interval;
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    let mut backlog = subscription.backlog.into_iter();
    loop {
        let change = if let Some(change) = backlog.next() {
            change
        } else {
            tokio::select! {
                received = live.recv() => match received {
                    Ok(change) => change,
                    // Too slow a reader: the stream ends, the client
                    // watches again from what it has.
                    Err(RecvError::Lagged(_) | RecvError::Closed) => return Ok(()),
                },
                _ = ticker.tick(), if spec.bookmarks => {
                    tx.send(bookmark(spec.resource, last, false)).await?;
                    continue;
                }
                () = &mut deadline => return Ok(()),
                _ = ended.changed() => return Ok(()),
                () = tx.closed() => return Ok(()),
            }
        };
        if change.revision <= last || change.resource != spec.resource {
            continue;
        }
        last = change.revision;
        if let Some(kind) = as_seen(
            &change,
            spec.namespace.as_deref(),
            &spec.labels,
            &spec.fields,
        ) {
            tx.send(event_line(kind.as_str(), &change.object)).await?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_name_resources_namespaces_and_objects() {
        let r = parse_resource_path("/api/v1/namespaces/kube-system/pods/p1").unwrap();
        assert_eq!(
            (r.resource.plural, r.namespace.as_deref(), r.name.as_deref()),
            ("pods", Some("kube-system"), Some("p1"))
        );
        let r = parse_resource_path("/api/v1/namespaces/kube-system").unwrap();
        assert_eq!(
            (r.resource.plural, r.namespace.as_deref(), r.name.as_deref()),
            ("namespaces", None, Some("kube-system"))
        );
        let r = parse_resource_path("/apis/vpcresources.k8s.aws/v1alpha1/cninodes").unwrap();
        assert_eq!((r.resource.kind, r.name), ("CNINode", None));
        assert!(parse_resource_path("/api/v1/namespaces/default/nodes/n1").is_none());
        assert!(parse_resource_path("/apis/nothing/v1/things").is_none());
        assert_eq!(verb_of(&Method::GET, false, true), "watch");
        assert_eq!(verb_of(&Method::GET, false, false), "list");
    }
}
