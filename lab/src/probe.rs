//! Traffic probes: a "who am I" server that tells each client the source
//! address it saw (TCP and UDP) and records ICMP echo requests, and the
//! clients that go with it. The differential tests use them to compare what
//! the far end sees (source address), whether it is reached, and whether the
//! reply makes it back, for both datapaths.
//!
//! Beside them: what ICMP errors tell a UDP socket (`icmp_errors`), and
//! packets a raw socket writes whole (`crafted`).
//!
//! Servers and clients open their sockets inside a namespace (on a thread
//! that entered it); a socket stays in its namespace whichever thread uses it.

use std::{
    io::{self, BufRead, BufReader, ErrorKind, PipeReader, PipeWriter, Read, Write},
    mem::MaybeUninit,
    net::{Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket},
    os::fd::{AsFd, BorrowedFd},
    sync::{
        Arc, Condvar, Mutex,
        atomic::{AtomicU16, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use nix::{
    errno::Errno,
    poll::{PollFd, PollFlags, PollTimeout, poll},
};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use tracing::{debug, warn};

mod crafted;
mod fan_out;
mod icmp_errors;

pub use self::{
    crafted::{FragmentOrder, send_spoofed_udp, send_udp_fragments},
    fan_out::{WhoamiTarget, whoami_each},
    icmp_errors::{
        DontFragmentOutcome, IcmpErrorReport, set_int_option, udp_dont_fragment, udp_icmp_error,
        udp_to_closed_port,
    },
};
use crate::{
    addrs::NS_VPC,
    error::{Context, LabError, Result},
    netns::{exec_ok, run_in},
    router,
};

/// Open connections of a server: a handle to shut each down, its thread.
type Connections = Mutex<Vec<(TcpStream, JoinHandle<()>)>>;

/// How long a TCP connection to the server may sit idle before it is
/// closed: longer than any test keeps one idle (`service_connections` idles
/// through hundreds of probes, a minute under emulation). The server's drop
/// shuts every connection down anyway.
const CONNECTION_IDLE: Duration = Duration::from_mins(5);
/// The datagram the UDP client sends.
const UDP_QUERY: &[u8] = b"whoami\n";
const ICMP_ECHO_REQUEST: u8 = 8;
const ICMP_ECHO_REPLY: u8 = 0;

/// A transport the probes speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Proto {
    Tcp,
    Udp,
    Icmp,
}

/// What the server saw: one TCP connection, UDP datagram or ICMP echo request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observation {
    pub proto: Proto,
    /// The source as it arrived (for ICMP the port is the echo identifier).
    pub source: SocketAddrV4,
    /// Where it was sent to.
    pub destination: SocketAddrV4,
}

#[derive(Default)]
struct Seen {
    list: Mutex<Vec<Observation>>,
    changed: Condvar,
}

impl Seen {
    fn record(&self, observation: Observation) {
        debug!(?observation, "probe server saw");
        self.list
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(observation);
        self.changed.notify_all();
    }
}

/// A server in a namespace that answers TCP and UDP with the source address
/// it saw (`"10.20.11.162:40000\n"`), echoes what a TCP client sends after
/// that, and records ICMP echo requests (the kernel answers them). Stopped
/// when dropped.
pub struct WhoamiServer {
    ns: String,
    addr: SocketAddrV4,
    seen: Arc<Seen>,
    /// Dropping the write end wakes every serving thread up to stop.
    stop: Option<PipeWriter>,
    threads: Vec<JoinHandle<()>>,
    connections: Arc<Connections>,
}

impl std::fmt::Debug for WhoamiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WhoamiServer")
            .field("ns", &self.ns)
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl WhoamiServer {
    /// Listens on `addr` (TCP and UDP, same port) inside namespace `ns`, and
    /// watches ICMP echo requests to `addr`'s address.
    pub fn start(ns: &str, addr: SocketAddrV4) -> Result<Self> {
        let (tcp, udp, icmp) = run_in(ns, || -> Result<_> {
            let tcp =
                TcpListener::bind(addr).context(|| format!("TCP listen on {addr} in {ns}"))?;
            // Port 0 means "any": UDP takes the port TCP got.
            let port = tcp
                .local_addr()
                .context(|| "TCP listener address".into())?
                .port();
            let udp_addr = SocketAddrV4::new(*addr.ip(), port);
            let udp =
                UdpSocket::bind(udp_addr).context(|| format!("UDP bind to {udp_addr} in {ns}"))?;
            let icmp = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::ICMPV4))
                .context(|| format!("raw ICMP socket in {ns}"))?;
            Ok((tcp, udp, icmp))
        })??;
        let addr = match tcp.local_addr().context(|| "TCP listener address".into())? {
            SocketAddr::V4(addr) => addr,
            SocketAddr::V6(_) => unreachable!("bound to an IPv4 address"),
        };
        // Non-blocking: a readiness that turns out spurious must not hang a
        // serving thread past its stop signal.
        tcp.set_nonblocking(true)
            .context(|| "making the TCP listener non-blocking".into())?;
        udp.set_nonblocking(true)
            .context(|| "making the UDP socket non-blocking".into())?;
        icmp.set_nonblocking(true)
            .context(|| "making the ICMP socket non-blocking".into())?;
        let (stop_reader, stop_writer) = io::pipe().context(|| "making a stop pipe".into())?;
        let seen = Arc::new(Seen::default());
        let connections = Arc::new(Mutex::new(Vec::new()));
        let mut server = Self {
            ns: ns.to_owned(),
            addr,
            seen: Arc::clone(&seen),
            stop: Some(stop_writer),
            threads: Vec::new(),
            connections: Arc::clone(&connections),
        };
        let stop = stop_reader
            .try_clone()
            .context(|| "cloning the stop pipe".into())?;
        server.spawn("tcp", {
            let seen = Arc::clone(&seen);
            move || serve_tcp(&tcp, &stop, &seen, &connections)
        })?;
        let stop = stop_reader
            .try_clone()
            .context(|| "cloning the stop pipe".into())?;
        server.spawn("udp", {
            let seen = Arc::clone(&seen);
            move || serve_udp(&udp, &stop, &seen)
        })?;
        server.spawn("icmp", move || serve_icmp(&icmp, &stop_reader, &seen, addr))?;
        Ok(server)
    }

    fn spawn(&mut self, proto: &str, serve: impl FnOnce() + Send + 'static) -> Result<()> {
        let handle = thread::Builder::new()
            .name(format!("whoami-{proto}"))
            .spawn(serve)
            .context(|| format!("starting the {proto} server thread"))?;
        self.threads.push(handle);
        Ok(())
    }

    /// The address it listens on (with the real port if 0 was asked for).
    pub fn addr(&self) -> SocketAddrV4 {
        self.addr
    }

    /// Everything seen so far.
    pub fn observations(&self) -> Vec<Observation> {
        self.seen
            .list
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Forgets what was seen.
    pub fn clear(&self) {
        self.seen
            .list
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clear();
    }

    /// Waits (on a condition variable, up to `timeout`) for an observation
    /// that matches `matches`; `None` if none came.
    pub fn wait_for(
        &self,
        timeout: Duration,
        matches: impl Fn(&Observation) -> bool,
    ) -> Option<Observation> {
        let deadline = Instant::now() + timeout;
        let mut list = self
            .seen
            .list
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            if let Some(found) = list.iter().find(|o| matches(o)) {
                return Some(*found);
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return None;
            }
            list = self
                .seen
                .changed
                .wait_timeout(list, remaining)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Stops the server and waits for its threads.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        drop(self.stop.take());
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        let connections = std::mem::take(
            &mut *self
                .connections
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for (stream, thread) in connections {
            let _ = stream.shutdown(Shutdown::Both);
            let _ = thread.join();
        }
    }
}

impl Drop for WhoamiServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Waits until `socket` is readable; false once the stop pipe is closed.
fn readable(socket: BorrowedFd<'_>, stop: &PipeReader) -> bool {
    // Bounded: each round ends in an event, and the stop pipe always comes.
    loop {
        let mut fds = [
            PollFd::new(socket, PollFlags::POLLIN),
            PollFd::new(stop.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {
                let stopped = fds[1].any().unwrap_or(true);
                if stopped {
                    return false;
                }
                if fds[0].any().unwrap_or(false) {
                    return true;
                }
            }
            Err(Errno::EINTR) => {}
            Err(err) => {
                warn!(%err, "probe server poll failed");
                return false;
            }
        }
    }
}

fn v4(addr: SocketAddr) -> SocketAddrV4 {
    match addr {
        SocketAddr::V4(addr) => addr,
        SocketAddr::V6(addr) => SocketAddrV4::new(
            addr.ip().to_ipv4_mapped().unwrap_or(Ipv4Addr::UNSPECIFIED),
            addr.port(),
        ),
    }
}

fn serve_tcp(listener: &TcpListener, stop: &PipeReader, seen: &Seen, connections: &Connections) {
    while readable(listener.as_fd(), stop) {
        let (stream, peer) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(err) if err.kind() == ErrorKind::WouldBlock => continue,
            Err(err) => {
                warn!(%err, "probe server accept failed");
                continue;
            }
        };
        let local = stream
            .local_addr()
            .map_or(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0), v4);
        seen.record(Observation {
            proto: Proto::Tcp,
            source: v4(peer),
            destination: local,
        });
        let Ok(for_shutdown) = stream.try_clone() else {
            continue;
        };
        let Ok(handle) = thread::Builder::new()
            .name("whoami-conn".into())
            .spawn(move || serve_connection(stream, v4(peer)))
        else {
            continue;
        };
        let mut list = connections
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Forget connections that are over, so a long run does not pile them up.
        list.retain(|(_, thread)| !thread.is_finished());
        list.push((for_shutdown, handle));
    }
}

fn serve_connection(mut stream: TcpStream, peer: SocketAddrV4) {
    // Accepted sockets do not inherit O_NONBLOCK on Linux.
    let _ = stream.set_read_timeout(Some(CONNECTION_IDLE));
    let _ = stream.set_write_timeout(Some(CONNECTION_IDLE));
    if stream.write_all(format!("{peer}\n").as_bytes()).is_err() {
        return;
    }
    let mut buf = [0u8; 16 * 1024];
    // Echo until the client closes, goes idle, or the server stops.
    while let Ok(n) = stream.read(&mut buf) {
        if n == 0 || stream.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    // Close our side now: the clone kept for `stop` would otherwise hold the
    // connection open, and a client that half-closed would wait for a FIN.
    let _ = stream.shutdown(Shutdown::Both);
}

fn serve_udp(socket: &UdpSocket, stop: &PipeReader, seen: &Seen) {
    let local = socket
        .local_addr()
        .map_or(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0), v4);
    let mut buf = vec![0u8; 64 * 1024];
    while readable(socket.as_fd(), stop) {
        let (_, peer) = match socket.recv_from(&mut buf) {
            Ok(received) => received,
            Err(err) if err.kind() == ErrorKind::WouldBlock => continue,
            Err(err) => {
                warn!(%err, "probe server recv failed");
                continue;
            }
        };
        seen.record(Observation {
            proto: Proto::Udp,
            source: v4(peer),
            destination: local,
        });
        if let Err(err) = socket.send_to(format!("{peer}\n").as_bytes(), peer) {
            debug!(%err, %peer, "probe server reply failed");
        }
    }
}

fn serve_icmp(socket: &Socket, stop: &PipeReader, seen: &Seen, addr: SocketAddrV4) {
    let mut buf = vec![MaybeUninit::<u8>::uninit(); 64 * 1024];
    while readable(socket.as_fd(), stop) {
        let len = match socket.recv(&mut buf) {
            Ok(len) => len,
            Err(err) if err.kind() == ErrorKind::WouldBlock => continue,
            Err(err) => {
                warn!(%err, "probe server ICMP recv failed");
                continue;
            }
        };
        // SAFETY: recv initialised the first `len` bytes.
        let packet: &[u8] = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), len) };
        let Some(echo) = parse_icmp_echo(packet) else {
            continue;
        };
        let wanted = addr.ip().is_unspecified() || echo.destination == *addr.ip();
        if echo.kind == ICMP_ECHO_REQUEST && wanted {
            seen.record(Observation {
                proto: Proto::Icmp,
                source: SocketAddrV4::new(echo.source, echo.id),
                destination: SocketAddrV4::new(echo.destination, 0),
            });
        }
    }
}

/// An ICMP echo request or reply, from its IPv4 packet.
#[derive(Debug, PartialEq, Eq)]
struct IcmpEcho {
    source: Ipv4Addr,
    destination: Ipv4Addr,
    kind: u8,
    id: u16,
    seq: u16,
}

fn parse_icmp_echo(packet: &[u8]) -> Option<IcmpEcho> {
    let header_len = usize::from(packet.first()? & 0x0f) * 4;
    if packet.first()? >> 4 != 4 || header_len < 20 || packet.get(9) != Some(&1) {
        return None;
    }
    let icmp = packet.get(header_len..)?;
    let kind = *icmp.first()?;
    if icmp.len() < 8 || (kind != ICMP_ECHO_REQUEST && kind != ICMP_ECHO_REPLY) || icmp[1] != 0 {
        return None;
    }
    let octets =
        |at: usize| Ipv4Addr::new(packet[at], packet[at + 1], packet[at + 2], packet[at + 3]);
    Some(IcmpEcho {
        source: octets(12),
        destination: octets(16),
        kind,
        id: u16::from_be_bytes([icmp[4], icmp[5]]),
        seq: u16::from_be_bytes([icmp[6], icmp[7]]),
    })
}

/// The Internet checksum (RFC 1071).
fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|pair| {
            u32::from(u16::from_be_bytes([
                pair[0],
                pair.get(1).copied().unwrap_or(0),
            ]))
        })
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !u16::try_from(sum).expect("folded to 16 bits")
}

fn timed_out(err: &io::Error) -> bool {
    matches!(err.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock)
}

fn parse_whoami_line(line: &str) -> Result<SocketAddrV4> {
    line.trim().parse().map_err(|err| LabError::BadOutput {
        command: "whoami reply".into(),
        reason: format!("{line:?}: {err}"),
    })
}

/// Connects from namespace `ns` to a [`WhoamiServer`] at `server` and returns
/// the source address the server saw; `None` if nothing came back within
/// `timeout` (the packets were dropped somewhere). Refused or unreachable is
/// an error.
pub fn tcp_whoami(
    ns: &str,
    server: SocketAddrV4,
    timeout: Duration,
) -> Result<Option<SocketAddrV4>> {
    run_in(ns, || tcp_whoami_here(ns, server, timeout, false))?
}

/// Like [`tcp_whoami`], then closes the connection in order and returns
/// only once the server's FIN has arrived (not within `timeout`: an error):
/// by then every packet of the connection has been sent, the last ACK
/// included, so counters read afterwards (the VPC router's per-link ones)
/// hold the whole connection and nothing of it spills into the next probe.
pub fn tcp_whoami_closed(
    ns: &str,
    server: SocketAddrV4,
    timeout: Duration,
) -> Result<Option<SocketAddrV4>> {
    run_in(ns, || tcp_whoami_here(ns, server, timeout, true))?
}

/// [`tcp_whoami`] from the calling thread's namespace `ns`; with
/// `close_in_order`, [`tcp_whoami_closed`].
fn tcp_whoami_here(
    ns: &str,
    server: SocketAddrV4,
    timeout: Duration,
    close_in_order: bool,
) -> Result<Option<SocketAddrV4>> {
    let deadline = Instant::now() + timeout;
    let remaining = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    let stream = match TcpStream::connect_timeout(&server.into(), timeout) {
        Ok(stream) => stream,
        Err(err) if timed_out(&err) => return Ok(None),
        Err(err) => return Err(err).context(|| format!("TCP connect from {ns} to {server}")),
    };
    stream
        .set_read_timeout(Some(remaining()))
        .context(|| "setting a read timeout".into())?;
    let mut reader = BufReader::new(&stream);
    let mut line = String::new();
    let seen = match reader.read_line(&mut line) {
        Ok(0) => {
            return Err(LabError::BadOutput {
                command: format!("TCP whoami from {ns} to {server}"),
                reason: "the connection closed without a reply".into(),
            });
        }
        Ok(_) => parse_whoami_line(&line)?,
        Err(err) if timed_out(&err) => return Ok(None),
        Err(err) => return Err(err).context(|| format!("TCP read from {server} in {ns}")),
    };
    if !close_in_order {
        return Ok(Some(seen));
    }
    // Our FIN; the server answers with its own once it reads the end.
    stream
        .shutdown(Shutdown::Write)
        .context(|| format!("TCP shutdown towards {server} in {ns}"))?;
    stream
        .set_read_timeout(Some(remaining()))
        .context(|| "setting a read timeout".into())?;
    let mut rest = Vec::new();
    match reader.read_to_end(&mut rest) {
        // The server's FIN: the kernel acknowledged it before waking us.
        Ok(_) => Ok(Some(seen)),
        Err(err) if timed_out(&err) => Err(LabError::BadOutput {
            command: format!("TCP whoami from {ns} to {server}"),
            reason: format!("the server's FIN did not come within {timeout:?}"),
        }),
        Err(err) => Err(err).context(|| format!("TCP read to the end from {server} in {ns}")),
    }
}

/// Sends one UDP datagram from namespace `ns` to a [`WhoamiServer`] and
/// returns the source address the server saw; `None` if no reply came
/// within `timeout`.
pub fn udp_whoami(
    ns: &str,
    server: SocketAddrV4,
    timeout: Duration,
) -> Result<Option<SocketAddrV4>> {
    run_in(ns, || {
        let socket = connected_udp(ns, server, timeout, false, None)?;
        let mut buf = [0u8; 512];
        match socket.recv(&mut buf) {
            Ok(len) => parse_whoami_line(&String::from_utf8_lossy(&buf[..len])).map(Some),
            Err(err) if timed_out(&err) => Ok(None),
            Err(err) => Err(err).context(|| format!("UDP receive from {server} in {ns}")),
        }
    })?
}

/// Sends one ICMP echo request from namespace `ns` to `target` and waits
/// for the matching reply; returns who replied, `None` if nobody did within
/// `timeout`. The identifier is unique per call, so concurrent probes do not
/// take each other's replies.
pub fn icmp_echo(ns: &str, target: Ipv4Addr, timeout: Duration) -> Result<Option<Ipv4Addr>> {
    static NEXT_ID: AtomicU16 = AtomicU16::new(0x7e00);
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let seq = 1u16;
    run_in(ns, || {
        let socket = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::ICMPV4))
            .context(|| format!("raw ICMP socket in {ns}"))?;
        let mut request = vec![ICMP_ECHO_REQUEST, 0, 0, 0];
        request.extend_from_slice(&id.to_be_bytes());
        request.extend_from_slice(&seq.to_be_bytes());
        request.extend_from_slice(b"vpcnet-lab probe");
        let sum = checksum(&request);
        request[2..4].copy_from_slice(&sum.to_be_bytes());
        socket
            .send_to(&request, &SockAddr::from(SocketAddrV4::new(target, 0)))
            .context(|| format!("ICMP echo from {ns} to {target}"))?;
        let deadline = Instant::now() + timeout;
        let mut buf = [MaybeUninit::<u8>::uninit(); 2048];
        // Bounded by the deadline; each round waits for a packet.
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Ok(None);
            }
            socket
                .set_read_timeout(Some(remaining))
                .context(|| "setting a read timeout".into())?;
            let len = match socket.recv(&mut buf) {
                Ok(len) => len,
                Err(err) if timed_out(&err) => return Ok(None),
                Err(err) => return Err(err).context(|| format!("ICMP receive in {ns}")),
            };
            // SAFETY: recv initialised the first `len` bytes.
            let packet = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), len) };
            if let Some(echo) = parse_icmp_echo(packet)
                && echo.kind == ICMP_ECHO_REPLY
                && echo.id == id
                && echo.seq == seq
            {
                return Ok(Some(echo.source));
            }
        }
    })?
}

/// One request-and-answer of the kinds a [`WhoamiServer`] takes, as one
/// probe: for tests that run every kind to every end and tabulate them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WhoamiFlow {
    /// [`tcp_whoami_closed`]: every packet of the connection is sent when it
    /// returns.
    Tcp,
    /// [`udp_whoami`].
    Udp,
    /// [`icmp_echo`].
    IcmpEcho,
}

impl WhoamiFlow {
    pub const ALL: [Self; 3] = [Self::Tcp, Self::Udp, Self::IcmpEcho];

    pub fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
            Self::IcmpEcho => "icmp echo",
        }
    }

    /// What the server records it as.
    pub fn proto(self) -> Proto {
        match self {
            Self::Tcp => Proto::Tcp,
            Self::Udp => Proto::Udp,
            Self::IcmpEcho => Proto::Icmp,
        }
    }

    /// Runs it from namespace `ns` to `target` (ICMP: its address) and
    /// returns who answered: the target's address for TCP and UDP (their
    /// sockets are connected: no one else's answer gets in), the echo
    /// reply's source for ICMP; `None` if no answer came within `timeout`.
    pub fn run(
        self,
        ns: &str,
        target: SocketAddrV4,
        timeout: Duration,
    ) -> Result<Option<Ipv4Addr>> {
        Ok(match self {
            Self::Tcp => tcp_whoami_closed(ns, target, timeout)?.map(|_| *target.ip()),
            Self::Udp => udp_whoami(ns, target, timeout)?.map(|_| *target.ip()),
            Self::IcmpEcho => icmp_echo(ns, *target.ip(), timeout)?,
        })
    }
}

/// A UDP socket in the calling thread's namespace `ns`, connected to
/// `target`, with a receive timeout, that has sent one query. With
/// `queue_errors`, ICMP errors are queued with their details (sender, type,
/// code) besides failing the next receive.
fn connected_udp(
    ns: &str,
    target: SocketAddrV4,
    timeout: Duration,
    queue_errors: bool,
    ttl: Option<u32>,
) -> Result<UdpSocket> {
    let socket = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))
        .context(|| format!("UDP bind in {ns}"))?;
    socket
        .connect(target)
        .context(|| format!("UDP connect to {target} in {ns}"))?;
    if queue_errors {
        nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::Ipv4RecvErr, &true)
            .context(|| "setting IP_RECVERR".into())?;
    }
    if let Some(ttl) = ttl {
        socket
            .set_ttl(ttl)
            .context(|| "setting the time to live".into())?;
    }
    socket
        .set_read_timeout(Some(timeout))
        .context(|| "setting a read timeout".into())?;
    socket
        .send(UDP_QUERY)
        .context(|| format!("UDP send from {ns} to {target}"))?;
    Ok(socket)
}

/// A raw UDP socket in a namespace: it sees every UDP datagram delivered
/// there, for whatever port, including ports nobody listens on (the kernel
/// still answers those with port unreachable). It tells what a far end saw
/// of a datagram that provoked an ICMP error.
pub struct UdpTap {
    ns: String,
    socket: Socket,
}

impl std::fmt::Debug for UdpTap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdpTap")
            .field("ns", &self.ns)
            .finish_non_exhaustive()
    }
}

impl UdpTap {
    /// Starts seeing UDP datagrams delivered in namespace `ns`.
    pub fn open(ns: &str) -> Result<Self> {
        let socket = run_in(ns, || {
            Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::UDP))
                .context(|| format!("raw UDP socket in {ns}"))
        })??;
        Ok(Self {
            ns: ns.to_owned(),
            socket,
        })
    }

    /// The source of the first datagram for `destination` delivered since
    /// the tap was opened (or since the last one this returned), waiting up
    /// to `timeout` for it; `None` if none came.
    pub fn wait_for(
        &self,
        destination: SocketAddrV4,
        timeout: Duration,
    ) -> Result<Option<SocketAddrV4>> {
        let deadline = Instant::now() + timeout;
        let mut buf = [MaybeUninit::<u8>::uninit(); 2048];
        // Bounded by the deadline; each round waits for a datagram.
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Ok(None);
            }
            self.socket
                .set_read_timeout(Some(remaining))
                .context(|| "setting a read timeout".into())?;
            let len = match self.socket.recv(&mut buf) {
                Ok(len) => len,
                Err(err) if timed_out(&err) => return Ok(None),
                Err(err) => return Err(err).context(|| format!("raw UDP receive in {}", self.ns)),
            };
            // SAFETY: recv initialised the first `len` bytes.
            let packet = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), len) };
            if let Some((source, to)) = parse_udp_endpoints(packet)
                && to == destination
            {
                return Ok(Some(source));
            }
        }
    }
}

/// Source and destination of a UDP datagram, from its IPv4 packet.
fn parse_udp_endpoints(packet: &[u8]) -> Option<(SocketAddrV4, SocketAddrV4)> {
    let header_len = usize::from(packet.first()? & 0x0f) * 4;
    if packet.first()? >> 4 != 4 || header_len < 20 || packet.get(9) != Some(&17) {
        return None;
    }
    let udp = packet.get(header_len..header_len + 8)?;
    let octets =
        |at: usize| Ipv4Addr::new(packet[at], packet[at + 1], packet[at + 2], packet[at + 3]);
    Some((
        SocketAddrV4::new(octets(12), u16::from_be_bytes([udp[0], udp[1]])),
        SocketAddrV4::new(octets(16), u16::from_be_bytes([udp[2], udp[3]])),
    ))
}

/// Counts, in the VPC router, the IPv4 packets it receives on some of its
/// links (the router's side of ENIs: which ENI a node's packets left by).
/// Unlike the links' own statistics ([`router::link_rx_packets`]) it leaves
/// out ARP, so a gateway's neighbour refresh, which comes on its own timer,
/// never shows up as traffic. It counts before the source/destination
/// check, so what that drops is counted on the link it came by. Its nftables
/// table goes when dropped (or with the router's namespace).
pub struct RouterLinkTap {
    links: Vec<String>,
}

impl std::fmt::Debug for RouterLinkTap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterLinkTap")
            .field("links", &self.links)
            .finish()
    }
}

/// The tap's nftables table and chain in the router.
const LINK_TAP_TABLE: &str = "vpcnet_link_tap";
const LINK_TAP_CHAIN: &str = "from_links";

impl RouterLinkTap {
    /// Starts counting on `links` (router-side names, e.g. `n0-eth1`).
    pub fn install(links: &[String]) -> Result<Self> {
        use std::fmt::Write as _;

        let rules = links.iter().fold(String::new(), |mut rules, link| {
            let _ = writeln!(rules, "        iifname \"{link}\" counter");
            rules
        });
        // Priority raw is -300: the source/destination check's.
        router::nft_apply(&format!(
            "table ip {LINK_TAP_TABLE} {{\n    chain {LINK_TAP_CHAIN} {{\n        \
             type filter hook prerouting priority -350; policy accept;\n{rules}    }}\n}}\n"
        ))?;
        Ok(Self {
            links: links.to_vec(),
        })
    }

    /// IPv4 packets received so far on each link, in `install`'s order.
    pub fn read(&self) -> Result<Vec<u64>> {
        let argv = ["nft", "list", "chain", "ip", LINK_TAP_TABLE, LINK_TAP_CHAIN];
        let listing = exec_ok(NS_VPC, &argv)?;
        self.links
            .iter()
            .map(|link| {
                let rule = format!("iifname \"{link}\" ");
                listing
                    .lines()
                    .find(|line| line.trim_start().starts_with(&rule))
                    .and_then(|line| {
                        let mut words = line.split_whitespace();
                        words.find(|word| *word == "packets")?;
                        words.next()?.parse().ok()
                    })
                    .ok_or_else(|| LabError::BadOutput {
                        command: argv.join(" "),
                        reason: format!("no packet count for {link} in {listing:?}"),
                    })
            })
            .collect()
    }
}

impl Drop for RouterLinkTap {
    fn drop(&mut self) {
        let _ = exec_ok(NS_VPC, &["nft", "delete", "table", "ip", LINK_TAP_TABLE]);
    }
}

#[cfg(test)]
mod tests {
    use super::{crafted::udp_packet, *};

    #[test]
    fn checksum_of_a_known_header() {
        // The IPv4 header example from RFC 1071's discussion (checksum 0xb861).
        let header = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(checksum(&header), 0xb861);
    }

    #[test]
    fn parses_an_echo_request() {
        let mut packet = vec![
            0x45, 0, 0, 28, 0, 0, 0, 0, 64, 1, 0, 0, 10, 20, 11, 20, 10, 20, 12, 50,
        ];
        packet.extend_from_slice(&[8, 0, 0, 0, 0x12, 0x34, 0, 7]);
        assert_eq!(
            parse_icmp_echo(&packet),
            Some(IcmpEcho {
                source: Ipv4Addr::new(10, 20, 11, 20),
                destination: Ipv4Addr::new(10, 20, 12, 50),
                kind: ICMP_ECHO_REQUEST,
                id: 0x1234,
                seq: 7,
            })
        );
        packet[9] = 17;
        assert_eq!(parse_icmp_echo(&packet), None);
    }

    #[test]
    fn parses_udp_endpoints() {
        let packet = udp_packet(
            "10.20.11.162:40000".parse().unwrap(),
            "203.0.113.10:8081".parse().unwrap(),
            b"x",
        )
        .unwrap();
        assert_eq!(
            parse_udp_endpoints(&packet),
            Some((
                "10.20.11.162:40000".parse().unwrap(),
                "203.0.113.10:8081".parse().unwrap()
            ))
        );
        assert_eq!(parse_udp_endpoints(&packet[..24]), None, "truncated");
    }
}

/// `tcpdump` on one link of a lab namespace, link-layer headers shown
/// (`-e`: an 802.1Q tag prints as `vlan <id>`), until `count` packets
/// matched its filter. Killed when dropped.
#[derive(Debug)]
pub struct PacketCapture {
    child: std::process::Child,
    what: String,
    count: usize,
    /// Its output, a line per packet, as `tcpdump` prints it.
    lines: std::sync::mpsc::Receiver<String>,
}

/// How long `tcpdump` may take to start listening.
const CAPTURE_START_TIMEOUT: Duration = Duration::from_secs(20);

impl PacketCapture {
    /// Starts capturing on `link` of `ns` and returns once `tcpdump` says
    /// it listens: nothing sent afterwards is missed.
    pub fn start(ns: &str, link: &str, filter: &[&str], count: usize) -> Result<Self> {
        crate::netns::check_lab_name(ns)?;
        let what = format!("tcpdump -i {link} in {ns}");
        let mut child = std::process::Command::new("nsenter")
            .arg(format!("--net={}", crate::netns::netns_path(ns).display()))
            .args(["--", "tcpdump", "-e", "-nn", "-l", "-c", &count.to_string()])
            .args(["-i", link])
            .args(filter)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .context(|| format!("starting {what}"))?;
        let (listening, said) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().expect("piped");
        thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(io::Result::ok) {
                if line.starts_with("listening on") {
                    let _ = listening.send(());
                }
            }
        });
        let (sender, lines) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().expect("piped");
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(io::Result::ok) {
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        let capture = Self {
            child,
            what,
            count,
            lines,
        };
        said.recv_timeout(CAPTURE_START_TIMEOUT)
            .map_err(|_| LabError::Timeout {
                what: format!("{} to listen", capture.what),
                waited: CAPTURE_START_TIMEOUT,
            })?;
        Ok(capture)
    }

    /// The packets' lines, once `count` of them came or `timeout` passed
    /// (then fewer).
    pub fn finish(self, timeout: Duration) -> Vec<String> {
        let deadline = Instant::now() + timeout;
        let mut lines = Vec::new();
        while lines.len() < self.count {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(line) = self.lines.recv_timeout(left) else {
                debug!(what = %self.what, got = lines.len(), "capture ended short");
                break;
            };
            lines.push(line);
        }
        lines
    }
}

impl Drop for PacketCapture {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
