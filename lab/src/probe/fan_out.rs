//! Many whoami probes from one namespace at once: every socket opened
//! non-blocking, then one wait for all of them. A matrix of probes costs one
//! timeout per source rather than one per probe, and one thread and
//! namespace switch per source rather than per probe.

use std::{
    io::{ErrorKind, Read},
    net::{Ipv4Addr, SocketAddrV4, TcpStream, UdpSocket},
    os::fd::{AsFd, BorrowedFd},
    time::{Duration, Instant},
};

use nix::{
    errno::Errno,
    poll::{PollFd, PollFlags, PollTimeout, poll},
};
use socket2::{Domain, Socket, Type};

use super::{Proto, UDP_QUERY, parse_whoami_line};
use crate::{
    error::{Context, LabError, Result},
    netns::run_in,
};

/// One probe: a [`super::WhoamiServer`]'s address and the transport to ask
/// it over (TCP or UDP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WhoamiTarget {
    pub proto: Proto,
    pub server: SocketAddrV4,
}

/// A probe still waiting for its answer.
enum Waiting {
    /// Connecting or connected; what the server sent so far.
    Tcp(TcpStream, Vec<u8>),
    Udp(UdpSocket),
}

impl Waiting {
    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Self::Tcp(stream, _) => stream.as_fd(),
            Self::Udp(socket) => socket.as_fd(),
        }
    }
}

/// Probes every one of `targets` from namespace `ns` at once: a TCP
/// connection that reads the server's line, or one UDP datagram and its
/// reply. Each answer is the source address the server saw, in `targets`'
/// order; `None` where nothing came back within `timeout` (dropped on the
/// way). Refused, unreachable or a connection closed without a line is an
/// error, as with [`super::tcp_whoami`] and [`super::udp_whoami`].
pub fn whoami_each(
    ns: &str,
    targets: &[WhoamiTarget],
    timeout: Duration,
) -> Result<Vec<Option<SocketAddrV4>>> {
    run_in(ns, || whoami_each_here(ns, targets, timeout))?
}

fn whoami_each_here(
    ns: &str,
    targets: &[WhoamiTarget],
    timeout: Duration,
) -> Result<Vec<Option<SocketAddrV4>>> {
    let deadline = Instant::now() + timeout;
    let mut answers = vec![None; targets.len()];
    let mut waiting: Vec<(usize, Waiting)> = targets
        .iter()
        .enumerate()
        .map(|(index, target)| Ok((index, open(ns, *target)?)))
        .collect::<Result<_>>()?;
    while !waiting.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let ready: Vec<bool> = {
            let mut fds: Vec<PollFd> = waiting
                .iter()
                .map(|(_, probe)| PollFd::new(probe.fd(), PollFlags::POLLIN))
                .collect();
            match poll(
                &mut fds,
                PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX),
            ) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(source) => {
                    return Err(LabError::Sys {
                        context: format!("waiting for probes' answers in {ns}"),
                        source,
                    });
                }
            }
            fds.iter()
                .map(|fd| fd.revents().is_some_and(|events| !events.is_empty()))
                .collect()
        };
        // From the back, so removing one leaves the indices before it.
        for at in (0..waiting.len()).rev() {
            if !ready[at] {
                continue;
            }
            let index = waiting[at].0;
            if let Some(seen) = read_answer(ns, targets[index], &mut waiting[at].1)? {
                answers[index] = Some(seen);
                waiting.swap_remove(at);
            }
        }
    }
    Ok(answers)
}

/// A socket in the calling thread's namespace, its probe sent (a UDP
/// datagram) or under way (a TCP connect).
fn open(ns: &str, target: WhoamiTarget) -> Result<Waiting> {
    let server = target.server;
    match target.proto {
        Proto::Tcp => {
            let socket = Socket::new(Domain::IPV4, Type::STREAM, None)
                .context(|| format!("TCP socket in {ns}"))?;
            socket
                .set_nonblocking(true)
                .context(|| "making a socket non-blocking".into())?;
            match socket.connect(&server.into()) {
                Ok(()) => {}
                Err(err) if err.raw_os_error() == Some(libc::EINPROGRESS) => {}
                Err(err) => {
                    return Err(err).context(|| format!("TCP connect from {ns} to {server}"));
                }
            }
            Ok(Waiting::Tcp(socket.into(), Vec::new()))
        }
        Proto::Udp => {
            let socket = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))
                .context(|| format!("UDP bind in {ns}"))?;
            socket
                .connect(server)
                .context(|| format!("UDP connect to {server} in {ns}"))?;
            socket
                .set_nonblocking(true)
                .context(|| "making a socket non-blocking".into())?;
            socket
                .send(UDP_QUERY)
                .context(|| format!("UDP send from {ns} to {server}"))?;
            Ok(Waiting::Udp(socket))
        }
        Proto::Icmp => Err(LabError::BadOutput {
            command: format!("whoami probe from {ns} to {server}"),
            reason: "whoami servers answer TCP and UDP only".into(),
        }),
    }
}

/// Reads what a ready probe's socket holds: the address the server saw
/// once its line is whole, `None` while it is not.
fn read_answer(
    ns: &str,
    target: WhoamiTarget,
    probe: &mut Waiting,
) -> Result<Option<SocketAddrV4>> {
    let server = target.server;
    let mut buf = [0u8; 512];
    match probe {
        Waiting::Tcp(stream, line) => match stream.read(&mut buf) {
            Ok(0) => Err(LabError::BadOutput {
                command: format!("TCP whoami from {ns} to {server}"),
                reason: "the connection closed without a reply".into(),
            }),
            Ok(n) => {
                line.extend_from_slice(&buf[..n]);
                if !line.contains(&b'\n') {
                    return Ok(None);
                }
                parse_whoami_line(&String::from_utf8_lossy(line)).map(Some)
            }
            Err(err) if err.kind() == ErrorKind::WouldBlock => Ok(None),
            Err(err) => Err(err).context(|| format!("TCP whoami from {ns} to {server}")),
        },
        Waiting::Udp(socket) => match socket.recv(&mut buf) {
            Ok(n) => parse_whoami_line(&String::from_utf8_lossy(&buf[..n])).map(Some),
            Err(err) if err.kind() == ErrorKind::WouldBlock => Ok(None),
            Err(err) => Err(err).context(|| format!("UDP whoami from {ns} to {server}")),
        },
    }
}
