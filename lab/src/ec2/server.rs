//! The emulator's servers: the EC2 Query API and IMDS over TCP, the admin
//! API over a Unix socket, all HTTP/1.1 (hyper) on one tokio runtime and
//! one state.
//!
//! The state lives behind a plain mutex held only for the length of one
//! action (never across an await); changes that touch the lab's network
//! are reconciled on a blocking thread under the fabric's own lock, so two
//! reconciliations never interleave. An attachment's link exists before
//! EC2 says `attached`, so whoever sees `attached` (the agent, through the
//! API or IMDS) finds the link in the node.

use std::{
    convert::Infallible,
    future::Future,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{
    Method, Request, Response, StatusCode,
    body::Incoming,
    header::{CONTENT_TYPE, HeaderValue},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::TokioIo;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::{TcpListener, UnixListener},
};
use tracing::{debug, info, warn};
use vpcnet_api::pod::BranchEni;

use super::{
    admin::{self, AdminErrorBody, CallsView, RunInstanceRequest},
    branches,
    config::{Config, FaultRule},
    fabric::{Desired, Fabric},
    faults::Faults,
    imds::{self, TOKEN_HEADER, TOKEN_TTL_HEADER, Tokens},
    model::{Ec2Error, Ec2Result, Ec2State, StateSnapshot},
    query::{self, Effect, Params},
    resource_controller::{self, ControllerOptions, TrunkProvider},
    xml::error_document,
};
use crate::addrs::NODE_PRIMARY_ADDR;

type Body = Full<Bytes>;

/// The emulator: one state, its servers, its fabric.
#[derive(Clone)]
pub struct Emulator {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Emulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Emulator").finish_non_exhaustive()
    }
}

struct Shared {
    state: Mutex<Ec2State>,
    faults: Mutex<Faults>,
    tokens: Mutex<Tokens>,
    fabric: Mutex<Box<dyn Fabric>>,
    fabric_errors: AtomicU64,
    attach_delay_ms: AtomicU64,
    next_request: AtomicU64,
    /// The lab node's primary address: its instance has a network.
    node_addr: Ipv4Addr,
    /// Whether the resource controller runs (it is started once).
    controller_started: std::sync::atomic::AtomicBool,
}

fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking handler must not take the emulator down with it.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn now_ms() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
}

impl Emulator {
    /// An emulator in the state `config` describes, driving `fabric`.
    pub fn new(config: &Config, fabric: Box<dyn Fabric>) -> Self {
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new(Ec2State::new(config)),
                faults: Mutex::new(Faults::new(config.faults.clone(), config.seed)),
                tokens: Mutex::new(Tokens::new(config.seed)),
                fabric: Mutex::new(fabric),
                fabric_errors: AtomicU64::new(0),
                attach_delay_ms: AtomicU64::new(config.attach_delay_ms),
                next_request: AtomicU64::new(1),
                node_addr: NODE_PRIMARY_ADDR,
                controller_started: std::sync::atomic::AtomicBool::new(false),
            }),
        }
    }

    /// Serves the EC2 Query API on `listener` until the runtime stops.
    pub async fn serve_ec2(&self, listener: TcpListener) {
        let shared = self.shared.clone();
        accept_tcp(listener, "ec2", move |req, _peer| {
            let shared = shared.clone();
            async move { ec2(&shared, req).await }
        })
        .await;
    }

    /// Serves IMDS on `listener` until the runtime stops.
    pub async fn serve_imds(&self, listener: TcpListener) {
        let shared = self.shared.clone();
        accept_tcp(listener, "imds", move |req, peer| {
            let shared = shared.clone();
            async move { imds_request(&shared, &req, peer) }
        })
        .await;
    }

    /// Serves the admin API on `listener` until the runtime stops.
    pub async fn serve_admin(&self, listener: UnixListener) {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(err) => {
                    warn!(%err, "admin: accept failed");
                    continue;
                }
            };
            let shared = self.shared.clone();
            serve_connection(stream, move |req| {
                let shared = shared.clone();
                async move { admin_request(shared, req).await }
            });
        }
    }

    /// The whole state.
    pub fn snapshot(&self) -> StateSnapshot {
        lock(&self.shared.state).snapshot()
    }

    /// Runs `f` on the state (in-process tests and set-up); the network is
    /// reconciled afterwards. Blocking: not from inside the runtime.
    pub fn with_state<R>(&self, f: impl FnOnce(&mut Ec2State) -> R) -> R {
        let result = f(&mut lock(&self.shared.state));
        self.shared.reconcile(None);
        result
    }

    /// `RunInstances` for one instance, as the lab's set-up does it.
    pub fn run_instance(&self, request: &RunInstanceRequest) -> Result<String, Ec2Error> {
        self.shared.run_instance(request)
    }

    /// Replaces the fault rules.
    pub fn set_faults(&self, rules: Vec<FaultRule>) {
        lock(&self.shared.faults).set_rules(rules);
    }

    /// Changes the attachment delay for attachments started from now on.
    pub fn set_attach_delay(&self, delay: Duration) {
        self.shared.attach_delay_ms.store(
            u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Calls and faults per action.
    pub fn calls(&self) -> CallsView {
        self.shared.calls()
    }
}

impl Shared {
    fn request_id(&self) -> String {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        format!("5a1ab0ec-0000-4000-8000-{n:012x}")
    }

    /// Makes the network match the state.
    fn reconcile(&self, attaching: Option<&str>) {
        self.reconcile_with(attaching, None);
    }

    /// Makes the network match the state, with an attachment completing:
    /// `attaching`'s link is made before EC2 says `attached`, `detaching`'s
    /// is removed before EC2 says `available`, so whoever sees the new
    /// state finds the network already there.
    fn reconcile_with(&self, attaching: Option<&str>, detaching: Option<&str>) {
        let mut fabric = lock(&self.fabric);
        let desired = Desired::from_state(&lock(&self.state), self.node_addr, attaching, detaching);
        if let Err(err) = fabric.apply(&desired) {
            self.fabric_errors.fetch_add(1, Ordering::Relaxed);
            warn!(%err, "the lab's network could not follow EC2's state");
        }
        if let Some(attachment) = attaching {
            let eni = lock(&self.state).complete_attach(attachment);
            info!(attachment, ?eni, "attached");
        }
        if let Some(attachment) = detaching {
            let eni = lock(&self.state).complete_detach(attachment);
            info!(attachment, ?eni, "detached");
        }
    }

    fn complete_detach(&self, attachment: &str) {
        self.reconcile_with(None, Some(attachment));
    }

    fn run_instance(&self, request: &RunInstanceRequest) -> Result<String, Ec2Error> {
        let id = lock(&self.state).run_instance(
            &request.instance_type,
            request
                .image_id
                .as_deref()
                .unwrap_or("ami-0a5e1ab0000000001"),
            &request.subnet_id,
            request.private_ip,
            Vec::new(),
            now_ms(),
        )?;
        info!(instance = %id, instance_type = %request.instance_type, "instance running");
        self.reconcile(None);
        Ok(id)
    }

    fn calls(&self) -> CallsView {
        let faults = lock(&self.faults);
        CallsView {
            actions: faults.counters().clone(),
            faults: faults.rules().to_vec(),
            fabric_errors: self.fabric_errors.load(Ordering::Relaxed),
            attach_delay_ms: self.attach_delay_ms.load(Ordering::Relaxed),
        }
    }
}

impl Shared {
    /// The lab node's instance.
    fn node_instance(&self, state: &Ec2State) -> Ec2Result<String> {
        state
            .instance_by_address(self.node_addr)
            .map(|instance| instance.id.clone())
            .ok_or_else(|| {
                Ec2Error::new(
                    "InvalidInstanceID.NotFound",
                    format!("no running instance has {}", self.node_addr),
                )
            })
    }
}

impl TrunkProvider for Shared {
    fn node_trunk(&self) -> Ec2Result<String> {
        let (trunk, attaching) = {
            let mut state = lock(&self.state);
            let instance = self.node_instance(&state)?;
            branches::ensure_trunk(&mut state, &instance, now_ms())?
        };
        // The controller waits for `attached`; the lab's attachment completes
        // at once, its link made first.
        if let Some(attachment) = attaching {
            self.reconcile(Some(&attachment));
        }
        Ok(trunk)
    }

    fn create_branch(&self, trunk: &str, private_ip: Option<Ipv4Addr>) -> Ec2Result<BranchEni> {
        let branch = branches::create_branch(&mut lock(&self.state), trunk, private_ip)?;
        self.reconcile(None);
        Ok(branch)
    }

    fn delete_branch(&self, branch: &BranchEni) -> Ec2Result<()> {
        branches::delete_branch(&mut lock(&self.state), branch)?;
        self.reconcile(None);
        Ok(())
    }
}

/// Accepts TCP connections and serves each with `handler`.
async fn accept_tcp<F, Fut>(listener: TcpListener, what: &'static str, handler: F)
where
    F: Fn(Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                warn!(%err, what, "accept failed");
                continue;
            }
        };
        let handler = handler.clone();
        serve_connection(stream, move |req| handler(req, peer));
    }
}

/// Serves one HTTP/1.1 connection on its own task.
fn serve_connection<IO, F, Fut>(io: IO, handler: F)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    tokio::spawn(async move {
        let service = service_fn(move |req| {
            let reply = handler(req);
            async move { Ok::<_, Infallible>(reply.await) }
        });
        if let Err(err) = http1::Builder::new()
            .serve_connection(TokioIo::new(io), service)
            .await
        {
            debug!(%err, "connection ended with an error");
        }
    });
}

fn response(status: u16, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut reply = Response::new(Full::new(body.into()));
    *reply.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    reply
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    reply
}

fn ec2_error(err: &Ec2Error, request_id: &str) -> Response<Body> {
    let mut reply = response(
        err.http_status(),
        "text/xml;charset=UTF-8",
        error_document(&err.code, &err.message, request_id),
    );
    if let Ok(value) = HeaderValue::from_str(request_id) {
        reply.headers_mut().insert("x-amzn-requestid", value);
    }
    reply
}

async fn ec2(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let request_id = shared.request_id();
    let query = req.uri().query().unwrap_or_default().to_owned();
    let method = req.method().clone();
    let body = match req.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(err) => {
            warn!(%err, "ec2: reading the request body failed");
            return ec2_error(
                &Ec2Error::new("MalformedQueryString", err.to_string()),
                &request_id,
            );
        }
    };
    // The SDK POSTs a form; EC2 takes a query string too.
    let params = if method == Method::POST {
        Params::parse(&body)
    } else {
        Params::parse(query.as_bytes())
    };
    let Some(action) = params.get("Action").map(str::to_owned) else {
        return ec2_error(
            &Ec2Error::new(
                "MissingAction",
                "The request must contain the parameter Action",
            ),
            &request_id,
        );
    };
    let injected = lock(&shared.faults).on_call(&action);
    if let Some(fault) = injected {
        lock(&shared.faults).on_error(&action);
        info!(%action, code = %fault.code, "injected fault");
        return ec2_error(&fault, &request_id);
    }
    let result = query::dispatch(
        &mut lock(&shared.state),
        &action,
        &params,
        &request_id,
        now_ms(),
    );
    match result {
        Ok((xml, effect)) => {
            debug!(%action, ?effect, "ec2 call");
            apply_effect(shared, effect).await;
            let mut reply = response(200, "text/xml;charset=UTF-8", xml);
            if let Ok(value) = HeaderValue::from_str(&request_id) {
                reply.headers_mut().insert("x-amzn-requestid", value);
            }
            reply
        }
        Err(err) => {
            lock(&shared.faults).on_error(&action);
            info!(%action, code = %err.code, message = %err.message, "ec2 error");
            ec2_error(&err, &request_id)
        }
    }
}

async fn apply_effect(shared: &Arc<Shared>, effect: Effect) {
    let delay = Duration::from_millis(shared.attach_delay_ms.load(Ordering::Relaxed));
    match effect {
        Effect::None => {}
        Effect::Changed => blocking(shared, |s| s.reconcile(None)).await,
        Effect::Attaching(attachment) => {
            let shared = shared.clone();
            let complete = async move {
                tokio::time::sleep(delay).await;
                blocking(&shared, move |s| s.reconcile(Some(&attachment))).await;
            };
            if delay.is_zero() {
                complete.await;
            } else {
                tokio::spawn(complete);
            }
        }
        Effect::Detaching(attachment) => {
            let shared = shared.clone();
            let complete = async move {
                tokio::time::sleep(delay).await;
                blocking(&shared, move |s| s.complete_detach(&attachment)).await;
            };
            if delay.is_zero() {
                complete.await;
            } else {
                tokio::spawn(complete);
            }
        }
    }
}

/// Runs `f` on a blocking thread (the fabric runs `ip` and `nft`).
async fn blocking<R: Send + 'static>(
    shared: &Arc<Shared>,
    f: impl FnOnce(&Shared) -> R + Send + 'static,
) -> R {
    let shared = shared.clone();
    tokio::task::spawn_blocking(move || f(&shared))
        .await
        .expect("the emulator's blocking task panicked")
}

fn imds_request(shared: &Shared, req: &Request<Incoming>, peer: SocketAddr) -> Response<Body> {
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
    let source = match peer.ip() {
        IpAddr::V4(addr) => addr,
        IpAddr::V6(addr) => addr.to_ipv4_mapped().unwrap_or(Ipv4Addr::UNSPECIFIED),
    };
    let request = imds::Request {
        method: req.method().as_str(),
        path: req.uri().path(),
        token: header(TOKEN_HEADER),
        ttl: header(TOKEN_TTL_HEADER),
        source,
    };
    let reply = imds::handle(
        &lock(&shared.state),
        &mut lock(&shared.tokens),
        &request,
        Instant::now(),
        now_ms(),
    );
    debug!(path = request.path, method = request.method, status = reply.status, %source, "imds");
    let mut response = response(reply.status, reply.content_type, reply.body);
    if let Some(ttl) = reply.ttl {
        response
            .headers_mut()
            .insert(TOKEN_TTL_HEADER, HeaderValue::from(ttl));
    }
    response
}

fn json_response(status: u16, value: &impl serde::Serialize) -> Response<Body> {
    let body = serde_json::to_vec(value).expect("serializable");
    response(status, "application/json", body)
}

fn admin_error(status: u16, code: &str, message: impl Into<String>) -> Response<Body> {
    json_response(
        status,
        &AdminErrorBody {
            code: code.to_owned(),
            message: message.into(),
        },
    )
}

async fn admin_request(shared: Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let body = match req.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(err) => return admin_error(400, "BadRequest", err.to_string()),
    };
    debug!(%method, %path, "admin");
    let handle = shared.clone();
    blocking(&shared, move |_| {
        admin_route(&handle, &method, &path, &body)
    })
    .await
}

/// An admin answer that is an error (boxed: a response is large).
type AdminFailure = Box<Response<Body>>;

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, AdminFailure> {
    serde_json::from_slice(body)
        .map_err(|err| Box::new(admin_error(400, "BadRequest", err.to_string())))
}

fn admin_route(shared: &Arc<Shared>, method: &Method, path: &str, body: &[u8]) -> Response<Body> {
    let ec2 = |err: Ec2Error| Box::new(admin_error(400, &err.code, err.message));
    let result: Result<Response<Body>, AdminFailure> = (|| match (method.as_str(), path) {
        ("GET", admin::HEALTH) => Ok(json_response(200, &serde_json::json!({"ok": true}))),
        ("GET", admin::STATE) => Ok(json_response(200, &lock(&shared.state).snapshot())),
        ("GET", admin::CALLS) => Ok(json_response(200, &shared.calls())),
        ("PUT", admin::FAULTS) => {
            let rules: Vec<FaultRule> = parse(body)?;
            for rule in &rules {
                rule.validate()
                    .map_err(|reason| Box::new(admin_error(400, "BadRequest", reason)))?;
            }
            info!(?rules, "faults set");
            lock(&shared.faults).set_rules(rules);
            Ok(json_response(200, &shared.calls()))
        }
        ("PUT", admin::ATTACH_DELAY) => {
            let request: admin::AttachDelayRequest = parse(body)?;
            shared.attach_delay_ms.store(request.ms, Ordering::Relaxed);
            info!(ms = request.ms, "attach delay set");
            Ok(json_response(200, &shared.calls()))
        }
        ("POST", admin::OCCUPY) => {
            let request: admin::OccupyRequest = parse(body)?;
            lock(&shared.state)
                .occupy(&request.subnet_id, &request.addresses, &request.prefixes)
                .map_err(ec2)?;
            Ok(json_response(200, &lock(&shared.state).snapshot()))
        }
        ("POST", admin::ASSIGN) => {
            let request: admin::AssignRequest = parse(body)?;
            let assign = crate::ec2::model::Assign {
                addresses: request.addresses,
                ..crate::ec2::model::Assign::default()
            };
            lock(&shared.state)
                .assign(&request.network_interface_id, &assign)
                .map_err(ec2)?;
            Ok(json_response(200, &lock(&shared.state).snapshot()))
        }
        ("POST", admin::LEAKED_ENI) => {
            let request: admin::LeakedEniRequest = parse(body)?;
            let id = lock(&shared.state)
                .create_leaked_eni(&request.subnet_id, request.tags, request.secondary_count)
                .map_err(ec2)?;
            Ok(json_response(
                200,
                &admin::LeakedEniResponse {
                    network_interface_id: id,
                },
            ))
        }
        ("POST", admin::VPC_CIDR) => {
            let request: admin::VpcCidrRequest = parse(body)?;
            let mut state = lock(&shared.state);
            if !state.vpc.cidrs.contains(&request.cidr) {
                state.vpc.cidrs.push(request.cidr);
                info!(cidr = %request.cidr, "CIDR associated with the VPC");
            }
            Ok(json_response(200, &state.snapshot()))
        }
        ("POST", admin::RUN_INSTANCE) => {
            let request: RunInstanceRequest = parse(body)?;
            let id = shared.run_instance(&request).map_err(ec2)?;
            Ok(json_response(
                200,
                &admin::RunInstanceResponse { instance_id: id },
            ))
        }
        ("POST", admin::BRANCH_ENI) => {
            let request: admin::BranchEniRequest = parse(body)?;
            let branch = shared
                .node_trunk()
                .and_then(|trunk| shared.create_branch(&trunk, request.private_ip))
                .map_err(ec2)?;
            Ok(json_response(200, &branch))
        }
        ("POST", admin::RESOURCE_CONTROLLER) => {
            let opts: ControllerOptions = parse(body)?;
            if shared.controller_started.swap(true, Ordering::SeqCst) {
                return Err(Box::new(admin_error(
                    409,
                    "Conflict",
                    "the resource controller runs already".to_owned(),
                )));
            }
            info!(?opts, "resource controller started");
            resource_controller::spawn(opts, shared.clone());
            Ok(json_response(200, &serde_json::json!({"ok": true})))
        }
        _ => Err(Box::new(admin_error(
            404,
            "NotFound",
            format!("no admin endpoint {method} {path}"),
        ))),
    })();
    result.unwrap_or_else(|err| *err)
}
