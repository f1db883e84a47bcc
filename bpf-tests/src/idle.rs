//! Idle TCP connections whose both ends a test holds: the client's, opened
//! from one namespace, and the server's, accepted from the test's own
//! listener in another (after whatever NAT lies between). A test leaves
//! one idle, then has both ends speak and checks each line arrives whole.

use std::{
    io::{BufRead, BufReader, Write},
    net::{SocketAddrV4, TcpListener, TcpStream},
    time::{Duration, Instant},
};

use vpcnet_lab::run_in;

/// How long connecting, accepting and each line may take.
const TIMEOUT: Duration = Duration::from_secs(3);

/// A listener of the test's own in namespace `ns`.
///
/// # Panics
/// When it cannot listen there.
#[must_use]
pub fn listen(ns: &str, addr: SocketAddrV4) -> TcpListener {
    run_in(ns, || TcpListener::bind(addr))
        .expect("entering the namespace")
        .unwrap_or_else(|e| panic!("listening on {addr} in {ns}: {e}"))
}

/// One connection, both ends.
pub struct IdleConnection {
    pub name: &'static str,
    /// The client's source as the server saw it (after any NAT).
    pub seen_as: SocketAddrV4,
    client: BufReader<TcpStream>,
    server: BufReader<TcpStream>,
    /// When its last exchange (or its opening) ended.
    last_used: Instant,
}

impl IdleConnection {
    /// Connects from namespace `client_ns` to `to` and accepts the
    /// connection on `backend`, where it arrives.
    ///
    /// # Panics
    /// When the connection cannot be made.
    #[must_use]
    pub fn open(
        name: &'static str,
        client_ns: &str,
        to: SocketAddrV4,
        backend: &TcpListener,
    ) -> Self {
        let client = run_in(client_ns, || {
            TcpStream::connect_timeout(&to.into(), TIMEOUT)
        })
        .expect("entering the namespace")
        .unwrap_or_else(|e| panic!("{name}: connecting from {client_ns} to {to}: {e}"));
        let (server, seen_as) = backend
            .accept()
            .unwrap_or_else(|e| panic!("{name}: the backend accepting: {e}"));
        let std::net::SocketAddr::V4(seen_as) = seen_as else {
            panic!("{name}: an IPv6 peer {seen_as}");
        };
        for stream in [&client, &server] {
            stream
                .set_read_timeout(Some(TIMEOUT))
                .expect("read timeout");
        }
        Self {
            name,
            seen_as,
            client: BufReader::new(client),
            server: BufReader::new(server),
            last_used: Instant::now(),
        }
    }

    /// The client's own address and port (before any NAT).
    ///
    /// # Panics
    /// When the socket has no IPv4 address.
    #[must_use]
    pub fn client_addr(&self) -> SocketAddrV4 {
        match self.client.get_ref().local_addr() {
            Ok(std::net::SocketAddr::V4(addr)) => addr,
            other => panic!("{}: the client's address: {other:?}", self.name),
        }
    }

    /// The server speaks first (so the first packet after the idle time is
    /// the server's, which must find its way back through whatever
    /// translated the connection), then the client answers.
    ///
    /// # Errors
    /// Which side's line did not arrive whole, and why.
    pub fn exchange(&mut self, line: &str) -> Result<(), String> {
        send_and_receive(&mut self.server, &mut self.client, line)
            .map_err(|e| format!("server to client: {e}"))?;
        send_and_receive(&mut self.client, &mut self.server, line)
            .map_err(|e| format!("client to server: {e}"))?;
        self.last_used = Instant::now();
        Ok(())
    }

    /// How long it has been idle, in real time.
    #[must_use]
    pub fn idle_for(&self) -> Duration {
        self.last_used.elapsed()
    }
}

fn send_and_receive(
    from: &mut BufReader<TcpStream>,
    to: &mut BufReader<TcpStream>,
    line: &str,
) -> Result<(), String> {
    from.get_mut()
        .write_all(format!("{line}\n").as_bytes())
        .map_err(|e| format!("sending: {e}"))?;
    let mut got = String::new();
    to.read_line(&mut got)
        .map_err(|e| format!("receiving: {e} ({:?})", e.kind()))?;
    if got.trim_end() == line {
        Ok(())
    } else {
        Err(format!("sent {line:?}, got {got:?}"))
    }
}
