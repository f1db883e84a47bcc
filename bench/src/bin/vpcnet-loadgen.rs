//! `vpcnet-loadgen`: the benchmarks' load generator, run inside the lab's
//! namespaces. `serve` prints `listening ADDR` once it listens; the clients
//! print `ready` once connected (RR) or about to start, then one line of
//! JSON, their [`LoadResult`].

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use vpcnet_bench::loadgen::{self, ClientOptions, Exchange, LoadResult};

#[derive(Parser)]
#[command(about = "Request/response load for the vpcnet benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Answer every request with a response, until killed.
    Serve {
        #[arg(long)]
        listen: SocketAddr,
        #[command(flatten)]
        exchange: ExchangeArgs,
    },
    /// One connection, one request at a time: latency.
    Rr(ClientArgs),
    /// A new connection per request: connections per second.
    Crr(ClientArgs),
    /// Open connections and keep them: how a NAT fills.
    Hold(ClientArgs),
}

#[derive(clap::Args)]
struct ExchangeArgs {
    /// Request bytes.
    #[arg(long, default_value_t = Exchange::default().request)]
    request: usize,
    /// Response bytes.
    #[arg(long, default_value_t = Exchange::default().response)]
    response: usize,
}

impl ExchangeArgs {
    fn exchange(&self) -> Exchange {
        Exchange {
            request: self.request,
            response: self.response,
        }
    }
}

#[derive(clap::Args)]
struct ClientArgs {
    #[arg(long)]
    to: SocketAddr,
    #[command(flatten)]
    exchange: ExchangeArgs,
    /// Seconds to run.
    #[arg(long, default_value_t = 5.0)]
    duration: f64,
    /// Connect and per-exchange timeout, milliseconds.
    #[arg(long, default_value_t = 1000)]
    timeout_ms: u64,
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Hold: stop after this many connections.
    #[arg(long, default_value_t = u64::MAX)]
    max_connections: u64,
    /// RR: milliseconds between two exchanges.
    #[arg(long, default_value_t = 0)]
    pace_ms: u64,
    /// CRR: the server closes each connection first.
    #[arg(long)]
    server_closes: bool,
}

impl ClientArgs {
    fn options(&self) -> Result<ClientOptions> {
        Ok(ClientOptions {
            to: self.to,
            exchange: self.exchange.exchange(),
            duration: Duration::try_from_secs_f64(self.duration).context("--duration")?,
            timeout: Duration::from_millis(self.timeout_ms),
            threads: self.threads,
            max_connections: self.max_connections,
            pace: Duration::from_millis(self.pace_ms),
            server_closes: self.server_closes,
        })
    }
}

fn ready() {
    println!("ready");
}

fn print(result: &LoadResult) -> Result<()> {
    println!("{}", serde_json::to_string(result)?);
    Ok(())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    loadgen::raise_nofile_limit();
    match cli.command {
        Command::Serve { listen, exchange } => {
            loadgen::serve(listen, exchange.exchange(), |addr| {
                println!("listening {addr}");
            })
            .with_context(|| format!("serving on {listen}"))?;
        }
        Command::Rr(args) => {
            let result = loadgen::request_response(&args.options()?, ready)
                .with_context(|| format!("connecting to {}", args.to))?;
            print(&result)?;
        }
        Command::Crr(args) => print(&loadgen::connect_request_response(&args.options()?, ready))?,
        Command::Hold(args) => print(&loadgen::hold(&args.options()?, ready))?,
    }
    Ok(())
}
