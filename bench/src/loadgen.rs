//! The load generator (`vpcnet-loadgen`): a request/response server and
//! three clients, each measuring every transaction.
//!
//! - RR: one connection, one request in flight, back to back: latency.
//! - CRR: a fresh connection per request on several threads (connect,
//!   request, response, close): connections per second. Either the server
//!   closes first, as an HTTP server answering `Connection: close` does (its
//!   side keeps the TIME_WAIT), or the client does, as netperf's `TCP_CRR`.
//! - Hold: open connections as fast as possible and keep them, until a
//!   deadline or a count: how a NAT fills its port range, second by second.

use std::{
    collections::BTreeMap,
    io::{self, ErrorKind, Read, Write},
    net::{SocketAddr, TcpStream},
    sync::Mutex,
    thread,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::stats::{Latency, nanos};

/// The first byte of a request after which the server closes the
/// connection (all other requests are filled with `b'q'`).
const CLOSE_AFTER: u8 = b'c';

/// The width of a [`LoadResult::timeline`] tick.
pub const TICK: Duration = Duration::from_millis(100);

/// Request and response sizes, shared by the server and its clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exchange {
    pub request: usize,
    pub response: usize,
}

impl Default for Exchange {
    /// A small RPC: 64 bytes up, 256 down.
    fn default() -> Self {
        Self {
            request: 64,
            response: 256,
        }
    }
}

/// What one client run measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadResult {
    /// Completed transactions (RR, CRR) or connections opened (hold).
    pub transactions: u64,
    pub elapsed_s: f64,
    /// `transactions` per second of `elapsed_s`.
    pub rate: f64,
    /// Failed attempts by kind (`timeout`, `refused`, `reset`, ...).
    pub errors: BTreeMap<String, u64>,
    /// Of every completed transaction.
    pub latency: Latency,
    /// Per [`TICK`]: `(completed, failed)`.
    pub timeline: Vec<(u64, u64)>,
}

impl LoadResult {
    pub fn failures(&self) -> u64 {
        self.errors.values().sum()
    }
}

/// Raises this process's open-file limit as far as it goes: a hold run
/// keeps tens of thousands of sockets.
pub fn raise_nofile_limit() {
    let wanted = libc::rlimit {
        rlim_cur: 1 << 20,
        rlim_max: 1 << 20,
    };
    // SAFETY: setrlimit and getrlimit only read or fill the struct passed.
    unsafe {
        if libc::setrlimit(libc::RLIMIT_NOFILE, &raw const wanted) != 0 {
            let mut current = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            if libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut current) == 0 {
                current.rlim_cur = current.rlim_max;
                libc::setrlimit(libc::RLIMIT_NOFILE, &raw const current);
            }
        }
    }
}

/// Serves `exchange` on `listen` until the process ends: for every request
/// of `exchange.request` bytes, a response of `exchange.response` bytes.
/// Calls `ready` once the socket listens.
pub fn serve(
    listen: SocketAddr,
    exchange: Exchange,
    ready: impl FnOnce(SocketAddr),
) -> io::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
        socket.set_reuse_address(true)?;
        // Several servers may share the port: one process holds at most
        // RLIMIT_NOFILE connections (20000 on some machines, for root too).
        socket.set_reuse_port(true)?;
        socket.set_nonblocking(true)?;
        socket.bind(&listen.into())?;
        // Deep enough for the connection bursts of CRR and hold runs.
        socket.listen(4096)?;
        let listener = tokio::net::TcpListener::from_std(socket.into())?;
        ready(listener.local_addr()?);
        loop {
            // Out of file descriptors or a connection reset before it was
            // accepted: the next one may do.
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            };
            tokio::spawn(async move {
                let _ = answer(stream, exchange).await;
            });
        }
    })
}

async fn answer(mut stream: tokio::net::TcpStream, exchange: Exchange) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let mut request = vec![0; exchange.request];
    let response = vec![b'r'; exchange.response];
    loop {
        match stream.read_exact(&mut request).await {
            Ok(_) => {
                stream.write_all(&response).await?;
                if request.first() == Some(&CLOSE_AFTER) {
                    // Dropping the stream closes it: the server's FIN first.
                    return Ok(());
                }
            }
            // The client closed: close too.
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
    }
}

/// How a client run goes.
#[derive(Debug, Clone, Copy)]
pub struct ClientOptions {
    pub to: SocketAddr,
    pub exchange: Exchange,
    pub duration: Duration,
    /// Connect and per-transaction timeout: a failed attempt after this.
    pub timeout: Duration,
    /// Threads, each with its own connection(s) (CRR, hold).
    pub threads: usize,
    /// Hold: stop after this many connections in all.
    pub max_connections: u64,
    /// RR: the pause between two exchanges (zero: back to back).
    pub pace: Duration,
    /// CRR: the server closes each connection after its response.
    pub server_closes: bool,
}

/// One request and its response on `stream`.
fn transact(stream: &mut TcpStream, request: &[u8], response: &mut [u8]) -> io::Result<()> {
    stream.write_all(request)?;
    stream.read_exact(response)
}

fn connect(opts: &ClientOptions) -> io::Result<TcpStream> {
    let stream = TcpStream::connect_timeout(&opts.to, opts.timeout)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(opts.timeout))?;
    stream.set_write_timeout(Some(opts.timeout))?;
    Ok(stream)
}

/// A failed attempt's kind, as counted in [`LoadResult::errors`].
fn error_kind(e: &io::Error) -> String {
    match e.kind() {
        ErrorKind::TimedOut | ErrorKind::WouldBlock => "timeout".into(),
        ErrorKind::ConnectionRefused => "refused".into(),
        ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted => "reset".into(),
        ErrorKind::UnexpectedEof => "closed by the server".into(),
        ErrorKind::AddrNotAvailable => "no local port".into(),
        _ if e.raw_os_error() == Some(libc::EMFILE) => "no file descriptor".into(),
        _ => e.to_string(),
    }
}

/// What one client thread saw.
#[derive(Default)]
struct ThreadTally {
    latencies: Vec<u64>,
    errors: BTreeMap<String, u64>,
    timeline: Vec<(u64, u64)>,
}

impl ThreadTally {
    fn tick(&mut self, started: Instant) -> &mut (u64, u64) {
        let tick = usize::try_from(started.elapsed().as_millis() / TICK.as_millis()).unwrap_or(0);
        if self.timeline.len() <= tick {
            self.timeline.resize(tick + 1, (0, 0));
        }
        &mut self.timeline[tick]
    }

    fn ok(&mut self, started: Instant, latency: Duration) {
        self.latencies.push(nanos(latency));
        self.tick(started).0 += 1;
    }

    fn failed(&mut self, started: Instant, e: &io::Error) {
        *self.errors.entry(error_kind(e)).or_default() += 1;
        self.tick(started).1 += 1;
    }
}

fn merge(tallies: Vec<ThreadTally>, elapsed: Duration) -> LoadResult {
    let mut latencies = Vec::new();
    let mut errors = BTreeMap::new();
    let mut timeline: Vec<(u64, u64)> = Vec::new();
    for tally in tallies {
        latencies.extend(tally.latencies);
        for (kind, n) in tally.errors {
            *errors.entry(kind).or_default() += n;
        }
        if timeline.len() < tally.timeline.len() {
            timeline.resize(tally.timeline.len(), (0, 0));
        }
        for (total, (ok, failed)) in timeline.iter_mut().zip(tally.timeline) {
            total.0 += ok;
            total.1 += failed;
        }
    }
    let transactions = latencies.len() as u64;
    let elapsed_s = elapsed.as_secs_f64();
    LoadResult {
        transactions,
        elapsed_s,
        rate: transactions as f64 / elapsed_s,
        errors,
        latency: Latency::of(&mut latencies),
        timeline,
    }
}

/// RR: one connection, `exchange` back to back for `duration`. Calls
/// `ready` once connected. A failed transaction ends the run (the flow is
/// broken) and is counted.
pub fn request_response(opts: &ClientOptions, ready: impl FnOnce()) -> io::Result<LoadResult> {
    let mut stream = connect(opts)?;
    let request = vec![b'q'; opts.exchange.request];
    let mut response = vec![0; opts.exchange.response];
    // One exchange before the clock starts: the server's task and the
    // path's caches are warm.
    transact(&mut stream, &request, &mut response)?;
    ready();
    let mut tally = ThreadTally::default();
    let started = Instant::now();
    while started.elapsed() < opts.duration {
        let sent = Instant::now();
        match transact(&mut stream, &request, &mut response) {
            Ok(()) => tally.ok(started, sent.elapsed()),
            Err(e) => {
                tally.failed(started, &e);
                break;
            }
        }
        if !opts.pace.is_zero() {
            thread::sleep(opts.pace);
        }
    }
    Ok(merge(vec![tally], started.elapsed()))
}

/// CRR: on each of `threads` threads, connect, one exchange, close, again,
/// for `duration`; the latency is the whole connection's.
pub fn connect_request_response(opts: &ClientOptions, ready: impl FnOnce()) -> LoadResult {
    ready();
    let started = Instant::now();
    let tallies = run_threads(opts.threads, |_| {
        let mut request = vec![b'q'; opts.exchange.request];
        if opts.server_closes
            && let Some(first) = request.first_mut()
        {
            *first = CLOSE_AFTER;
        }
        let mut response = vec![0; opts.exchange.response];
        let mut tally = ThreadTally::default();
        while started.elapsed() < opts.duration {
            let begun = Instant::now();
            let outcome = connect(opts).and_then(|mut stream| {
                transact(&mut stream, &request, &mut response)?;
                if opts.server_closes {
                    // The server's FIN, before the client closes.
                    let mut rest = [0; 1];
                    if stream.read(&mut rest)? != 0 {
                        return Err(io::Error::new(
                            ErrorKind::InvalidData,
                            "more than the response",
                        ));
                    }
                }
                Ok(())
                // Dropping the stream closes it (first, unless the server did).
            });
            match outcome {
                Ok(()) => tally.ok(started, begun.elapsed()),
                Err(e) => tally.failed(started, &e),
            }
        }
        tally
    });
    merge(tallies, started.elapsed())
}

/// Hold: on each of `threads` threads, open connections (each proven by
/// one exchange) and keep them, until `duration` is over or
/// `max_connections` are open. A thread whose host has no local port left
/// stops. The connections close when the result is returned.
pub fn hold(opts: &ClientOptions, ready: impl FnOnce()) -> LoadResult {
    let open = Mutex::new(0_u64);
    ready();
    let started = Instant::now();
    let kept = Mutex::new(Vec::new());
    let tallies = run_threads(opts.threads, |_| {
        let request = vec![b'q'; opts.exchange.request];
        let mut response = vec![0; opts.exchange.response];
        let mut tally = ThreadTally::default();
        let mut streams = Vec::new();
        while started.elapsed() < opts.duration {
            {
                let mut open = open
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if *open >= opts.max_connections {
                    break;
                }
                *open += 1;
            }
            let begun = Instant::now();
            let outcome = connect(opts).and_then(|mut stream| {
                transact(&mut stream, &request, &mut response).map(|()| stream)
            });
            match outcome {
                Ok(stream) => {
                    tally.ok(started, begun.elapsed());
                    streams.push(stream);
                }
                Err(e) => {
                    *open
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) -= 1;
                    tally.failed(started, &e);
                    // Out of local ports, or of file descriptors: no more
                    // connections from this process.
                    if e.kind() == ErrorKind::AddrNotAvailable
                        || e.raw_os_error() == Some(libc::EMFILE)
                    {
                        break;
                    }
                }
            }
        }
        kept.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(streams);
        tally
    });
    let result = merge(tallies, started.elapsed());
    drop(kept);
    result
}

fn run_threads<F>(threads: usize, f: F) -> Vec<ThreadTally>
where
    F: Fn(usize) -> ThreadTally + Sync,
{
    thread::scope(|scope| {
        let handles: Vec<_> = (0..threads.max(1))
            .map(|index| {
                let f = &f;
                scope.spawn(move || f(index))
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().expect("a load generator thread panicked"))
            .collect()
    })
}
