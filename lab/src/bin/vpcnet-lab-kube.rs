//! `vpcnet-lab-kube`: the lab's Kubernetes API server. See
//! `vpcnet_lab::kube`.
//!
//! Prints `READY` on standard output once its listeners are bound; logs to
//! standard error (`RUST_LOG`, default info).

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, sync::Arc};

use anyhow::Context;
use clap::Parser;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use tracing::{error, info};
use vpcnet_lab::{
    helper_process,
    kube::{KubeApi, resources, server::ServerConfig},
};

#[derive(Debug, Parser)]
#[command(name = "vpcnet-lab-kube", about = "The lab's Kubernetes API server")]
struct Args {
    /// The configuration (JSON): tokens, bookmark interval, history.
    #[arg(long)]
    config: PathBuf,
    /// The server's certificate chain (PEM).
    #[arg(long)]
    tls_cert: PathBuf,
    /// The server's private key (PEM).
    #[arg(long)]
    tls_key: PathBuf,
    /// Where HTTPS listens.
    #[arg(long)]
    listen: SocketAddr,
    /// The admin socket (replaced if it exists).
    #[arg(long)]
    admin_socket: PathBuf,
    /// Bind the listener inside this network namespace (a `vpcnet-` one).
    #[arg(long)]
    netns: Option<String>,
}

fn main() -> ExitCode {
    vpcnet_lab::helper_process::log_to_stderr("vpcnet_lab=info,vpcnet_lab_kube=info");
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            error!("the Kubernetes API server failed: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn tls_config(args: &Args) -> anyhow::Result<rustls::ServerConfig> {
    let certs = CertificateDer::pem_file_iter(&args.tls_cert)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .with_context(|| format!("reading {}", args.tls_cert.display()))?;
    let key = PrivateKeyDer::from_pem_file(&args.tls_key)
        .with_context(|| format!("reading {}", args.tls_key.display()))?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .context("choosing TLS versions")?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .context("loading the server's certificate")?;
    // HTTP/1.1 only: Go's client (kubectl) and hyper's (kube-rs) both fall
    // back to it when the server offers nothing else.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

fn run(args: &Args) -> anyhow::Result<()> {
    let config: ServerConfig = serde_json::from_slice(
        &std::fs::read(&args.config)
            .with_context(|| format!("reading {}", args.config.display()))?,
    )
    .with_context(|| format!("parsing {}", args.config.display()))?;
    let tls = Arc::new(tls_config(args)?);
    let listener = helper_process::bind_listeners(args.netns.as_deref(), &[args.listen])?
        .pop()
        .expect("one listener");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async {
        let listener =
            tokio::net::TcpListener::from_std(listener).context("registering the listener")?;
        match std::fs::remove_file(&args.admin_socket) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
                return Err(err)
                    .with_context(|| format!("removing {}", args.admin_socket.display()));
            }
            _ => {}
        }
        let admin = tokio::net::UnixListener::bind(&args.admin_socket)
            .with_context(|| format!("listening on {}", args.admin_socket.display()))?;
        resources::uninstall(config.uninstalled.clone());
        let server = KubeApi::new(config);
        info!(
            listen = %args.listen,
            admin = %args.admin_socket.display(),
            netns = args.netns.as_deref().unwrap_or("(own)"),
            "serving"
        );
        println!("READY");
        // Nothing else is written to standard output: whoever waits reads
        // this one line, then may close the pipe.
        drop(std::io::Write::flush(&mut std::io::stdout()));
        // The cluster's control plane comes with its API server, as on EKS.
        tokio::join!(
            server.serve_https(listener, tls),
            server.serve_admin(admin),
            server.run_policy_controller()
        );
        Ok(())
    })
}
