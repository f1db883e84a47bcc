//! `vpcnet-cni`: the CNI plugin (spec 1.1) a container runtime executes for
//! every pod: ADD, DEL, CHECK, STATUS, GC and VERSION. It creates the pod's
//! veth pair, asks the vpcnet agent (gRPC on a Unix socket) for the pod's
//! address and datapath entry, and configures both ends.
//!
//! The config's fields are in [`config`], the error codes in [`error`].
//! One thread, one current-thread runtime; work inside the pod's namespace
//! runs on a short-lived thread of its own (`vpcnet_netlink::netns`), so the
//! main thread never leaves the node's namespace.

mod add;
mod agent;
mod check;
mod config;
mod del;
mod env;
mod error;
mod gc;
mod logging;
mod plugin;
mod result;

use std::{
    io::{Read, Write},
    time::Instant,
};

use serde_json::{Value, json};
use tracing::{info, warn};

use crate::{
    config::{NetConf, OWN_VERSION, SUPPORTED_VERSIONS},
    env::{Command, Env},
    error::{CniError, code},
    plugin::Ctx,
};

fn main() {
    let started = Instant::now();
    let (version, outcome) = match Command::from_env(std::env::var("CNI_COMMAND").ok().as_deref()) {
        Err(err) => (OWN_VERSION.to_owned(), Err(err)),
        Ok(Command::Version) => (
            OWN_VERSION.to_owned(),
            Ok(Some(json!({
                "cniVersion": OWN_VERSION,
                "supportedVersions": SUPPORTED_VERSIONS,
            }))),
        ),
        Ok(command) => run(command, started),
    };
    let (output, status) = match outcome {
        Ok(output) => (output, 0),
        Err(err) => (Some(err.to_json(&version)), 1),
    };
    if let Some(output) = output {
        let mut stdout = std::io::stdout().lock();
        // Nothing useful can be done if stdout is gone: the runtime reads
        // the exit status.
        let _ = writeln!(stdout, "{output}");
        let _ = stdout.flush();
    }
    std::process::exit(status);
}

/// Runs a command other than VERSION: reads the config, logs, and answers
/// in the config's version.
fn run(command: Command, started: Instant) -> (String, Result<Option<Value>, CniError>) {
    let mut stdin = Vec::new();
    let decoded = std::io::stdin()
        .read_to_end(&mut stdin)
        .map_err(|err| {
            CniError::new(
                code::IO_FAILURE,
                "reading the network config from stdin",
                err.to_string(),
            )
        })
        .and_then(|_| config::decode(&stdin));
    let version = config::answer_version(decoded.as_ref().ok());
    logging::init(&config::logging_of(decoded.as_ref().ok()));

    let ctx = decoded.and_then(|value| {
        let env = Env::from_lookup(command, |name| std::env::var(name).ok())?;
        let conf = NetConf::from_value(&value)?;
        Ok(Ctx { conf, env })
    });
    let outcome = match &ctx {
        Ok(ctx) => dispatch(command, ctx),
        Err(err) => Err(err.clone()),
    };

    let elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
    let (container, netns, ifname, pod) = match &ctx {
        Ok(ctx) => (
            ctx.env.container_id.as_str(),
            ctx.env.netns.as_str(),
            ctx.env.ifname.as_str(),
            ctx.env.pod_label(),
        ),
        Err(_) => ("", "", "", String::new()),
    };
    let command = command.name();
    match &outcome {
        Ok(_) => info!(
            command,
            container,
            netns,
            ifname,
            pod,
            elapsed_ms = format!("{elapsed_ms:.1}"),
            "ok"
        ),
        Err(err) => warn!(
            command,
            container,
            netns,
            ifname,
            pod,
            elapsed_ms = format!("{elapsed_ms:.1}"),
            error = %err,
            "failed"
        ),
    }
    (version, outcome)
}

/// Runs `command` on a current-thread runtime.
fn dispatch(command: Command, ctx: &Ctx) -> Result<Option<Value>, CniError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|err| CniError::new(code::IO_FAILURE, "starting the runtime", err.to_string()))?;
    runtime.block_on(async {
        match command {
            Command::Add => add::add(ctx).await.map(Some),
            Command::Del => del::del(ctx).await.map(|()| None),
            Command::Check => check::check(ctx).await.map(|()| None),
            Command::Status => gc::status(&ctx.conf).await.map(|()| None),
            Command::Gc => gc::gc(&ctx.conf).await.map(|()| None),
            Command::Version => unreachable!("VERSION is answered before the config is read"),
        }
    })
}
