//! Exchanges bigger than one packet: a UDP datagram of several kilobytes
//! echoed whole (fragmented on the way), and a TCP upload whose byte count
//! comes back. Both ends leave fragmentation to the path: UDP datagrams go
//! without "don't fragment" (`IP_PMTUDISC_DONT`), so a 1500-byte hop
//! fragments them and the receiver must reassemble every piece.

use std::{
    io::{ErrorKind, Read, Write},
    net::{Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use vpcnet_lab::run_in;

/// How often a server looks at its stop flag.
const POLL: Duration = Duration::from_millis(100);
/// No server outlives this, whatever its owner does.
const SERVER_LIFETIME: Duration = Duration::from_mins(10);

/// Lets datagrams leave without "don't fragment": the path fragments them.
fn allow_fragmentation(socket: &UdpSocket) -> std::io::Result<()> {
    vpcnet_lab::probe::set_int_option(socket, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DONT)
}

/// A server thread that stops when its owner drops it.
struct Served {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Served {
    fn spawn(name: &str, serve: impl FnOnce(&AtomicBool) + Send + 'static) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = thread::Builder::new()
            .name(name.into())
            .spawn({
                let stop = Arc::clone(&stop);
                move || serve(&stop)
            })
            .expect("starting a server thread");
        Self {
            stop,
            thread: Some(thread),
        }
    }

    fn serving(stop: &AtomicBool, started: Instant) -> bool {
        !stop.load(Ordering::Relaxed) && started.elapsed() < SERVER_LIFETIME
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Echoes every UDP datagram back to its sender, whole.
pub struct UdpEcho {
    pub addr: SocketAddrV4,
    _served: Served,
}

impl UdpEcho {
    /// Serves on `addr` in namespace `ns`.
    #[must_use]
    pub fn start(ns: &str, addr: SocketAddrV4) -> Self {
        let socket = run_in(ns, || UdpSocket::bind(addr))
            .expect("entering the namespace")
            .unwrap_or_else(|e| panic!("UDP bind to {addr} in {ns}: {e}"));
        allow_fragmentation(&socket).expect("IP_MTU_DISCOVER");
        socket.set_read_timeout(Some(POLL)).expect("read timeout");
        let served = Served::spawn("udp-echo", move |stop| {
            let started = Instant::now();
            let mut buf = vec![0u8; 65536];
            while Served::serving(stop, started) {
                match socket.recv_from(&mut buf) {
                    Ok((len, from)) => {
                        let _ = socket.send_to(&buf[..len], from);
                    }
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                    Err(_) => {}
                }
            }
        });
        Self {
            addr,
            _served: served,
        }
    }
}

/// What came back of one exchange with a [`UdpEcho`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UdpOutcome {
    /// The whole datagram came back unchanged.
    Whole,
    /// Something came back, but not what was sent.
    Damaged(usize),
    /// Nothing within the timeout.
    Lost,
}

/// Sends one datagram of `size` bytes from namespace `ns` to `server`
/// (connected, so only the server's answer counts) and waits for it to come
/// back.
#[must_use]
pub fn udp_exchange(ns: &str, server: SocketAddrV4, size: usize, timeout: Duration) -> UdpOutcome {
    let socket = run_in(ns, || -> std::io::Result<UdpSocket> {
        let socket = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))?;
        socket.connect(server)?;
        Ok(socket)
    })
    .expect("entering the namespace")
    .unwrap_or_else(|e| panic!("UDP socket to {server} in {ns}: {e}"));
    allow_fragmentation(&socket).expect("IP_MTU_DISCOVER");
    socket
        .set_read_timeout(Some(timeout))
        .expect("read timeout");
    #[allow(clippy::cast_possible_truncation)] // a pattern, wrapping on purpose
    let payload: Vec<u8> = (0..size).map(|i| (i * 7 + 3) as u8).collect();
    socket
        .send(&payload)
        .unwrap_or_else(|e| panic!("UDP send of {size} bytes from {ns} to {server}: {e}"));
    let mut buf = vec![0u8; size + 1];
    match socket.recv(&mut buf) {
        Ok(len) if buf[..len] == payload[..] => UdpOutcome::Whole,
        Ok(len) => UdpOutcome::Damaged(len),
        Err(_) => UdpOutcome::Lost,
    }
}

/// Reads each connection to its end and answers with the number of bytes
/// it got (8 bytes, big-endian).
pub struct TcpSink {
    pub addr: SocketAddrV4,
    _served: Served,
}

impl TcpSink {
    /// Serves on `addr` in namespace `ns`.
    #[must_use]
    pub fn start(ns: &str, addr: SocketAddrV4) -> Self {
        let listener = run_in(ns, || TcpListener::bind(addr))
            .expect("entering the namespace")
            .unwrap_or_else(|e| panic!("TCP listen on {addr} in {ns}: {e}"));
        listener.set_nonblocking(true).expect("non-blocking");
        let served = Served::spawn("tcp-sink", move |stop| {
            let started = Instant::now();
            while Served::serving(stop, started) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        thread::spawn(move || drain(stream));
                    }
                    Err(_) => thread::sleep(POLL),
                }
            }
        });
        Self {
            addr,
            _served: served,
        }
    }
}

fn drain(mut stream: TcpStream) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_mins(1)));
    let mut total: u64 = 0;
    let mut buf = vec![0u8; 65536];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(len) => total += len as u64,
            Err(_) => return,
        }
    }
    let _ = stream.write_all(&total.to_be_bytes());
}

/// Uploads `bytes` from namespace `ns` to a [`TcpSink`] and returns how many
/// it says it got; `Err` says what failed (connect, a stalled write, no
/// answer) within `timeout`.
pub fn tcp_upload(
    ns: &str,
    sink: SocketAddrV4,
    bytes: usize,
    timeout: Duration,
) -> Result<u64, String> {
    let mut stream = run_in(ns, || {
        TcpStream::connect_timeout(&SocketAddr::V4(sink), timeout)
    })
    .expect("entering the namespace")
    .map_err(|e| format!("connect from {ns} to {sink}: {e}"))?;
    stream.set_write_timeout(Some(timeout)).expect("timeout");
    stream.set_read_timeout(Some(timeout)).expect("timeout");
    let chunk = vec![0x5au8; 65536];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len());
        stream.write_all(&chunk[..n]).map_err(|e| {
            format!(
                "upload stalled with {} of {bytes} bytes sent: {e}",
                bytes - left
            )
        })?;
        left -= n;
    }
    stream
        .shutdown(Shutdown::Write)
        .map_err(|e| format!("closing the upload: {e}"))?;
    let mut count = [0u8; 8];
    stream
        .read_exact(&mut count)
        .map_err(|e| format!("the sink's count did not come: {e}"))?;
    Ok(u64::from_be_bytes(count))
}
