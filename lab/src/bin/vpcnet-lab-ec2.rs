//! `vpcnet-lab-ec2`: the lab's EC2 emulator (EC2 Query API, IMDSv2, admin
//! socket). See `vpcnet_lab::ec2`.
//!
//! Prints `READY` on standard output once every listener is bound; logs to
//! standard error (`RUST_LOG`, default info).

use std::{net::SocketAddr, path::PathBuf, process::ExitCode};

use clap::Parser;
use tracing::{error, info};
use vpcnet_lab::ec2::{Config, Emulator, EmulatorError, fabric::FabricMode};

#[derive(Debug, Parser)]
#[command(name = "vpcnet-lab-ec2", about = "The lab's EC2 emulator")]
struct Args {
    /// The configuration (JSON); see `vpcnet_lab::ec2::Config`.
    #[arg(long)]
    config: PathBuf,
    /// Where the EC2 Query API listens.
    #[arg(long)]
    ec2_listen: SocketAddr,
    /// Where IMDS listens.
    #[arg(long)]
    imds_listen: SocketAddr,
    /// The admin API's Unix socket (replaced if it exists).
    #[arg(long)]
    admin_socket: PathBuf,
    /// Bind the listeners inside this network namespace (a `vpcnet-` one).
    #[arg(long)]
    netns: Option<String>,
    /// `lab`: attachments make links in the lab; `none`: API only.
    #[arg(long, default_value = "none")]
    fabric: FabricMode,
}

fn main() -> ExitCode {
    vpcnet_lab::helper_process::log_to_stderr("vpcnet_lab=info,vpcnet_lab_ec2=info");
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            error!(%err, "the EC2 emulator failed");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), EmulatorError> {
    let config = Config::load(&args.config)?;
    let listeners = vpcnet_lab::helper_process::bind_listeners(
        args.netns.as_deref(),
        &[args.ec2_listen, args.imds_listen],
    )?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| EmulatorError::Io {
            context: "starting the runtime".into(),
            source,
        })?;
    runtime.block_on(async {
        let io = |context: String| move |source| EmulatorError::Io { context, source };
        let mut listeners = listeners.into_iter();
        let ec2_listener = tokio::net::TcpListener::from_std(listeners.next().expect("two"))
            .map_err(io("registering the EC2 listener".into()))?;
        let imds_listener = tokio::net::TcpListener::from_std(listeners.next().expect("two"))
            .map_err(io("registering the IMDS listener".into()))?;
        match std::fs::remove_file(&args.admin_socket) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
                return Err(io(format!("removing {}", args.admin_socket.display()))(err));
            }
            _ => {}
        }
        let admin = tokio::net::UnixListener::bind(&args.admin_socket)
            .map_err(io(format!("listening on {}", args.admin_socket.display())))?;
        let emulator = Emulator::new(&config, args.fabric.build());
        info!(
            ec2 = %args.ec2_listen,
            imds = %args.imds_listen,
            admin = %args.admin_socket.display(),
            netns = args.netns.as_deref().unwrap_or("(own)"),
            fabric = ?args.fabric,
            "serving"
        );
        println!("READY");
        // Nothing else is written to standard output: whoever waits reads
        // this one line, then may close the pipe.
        drop(std::io::Write::flush(&mut std::io::stdout()));
        tokio::join!(
            emulator.serve_ec2(ec2_listener),
            emulator.serve_imds(imds_listener),
            emulator.serve_admin(admin),
        );
        Ok(())
    })
}
