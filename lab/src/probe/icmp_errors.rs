//! What ICMP errors tell a UDP socket: the error a closed port or an
//! expiring time to live provokes, and path MTU discovery's "fragmentation
//! needed" for a datagram sent with "don't fragment".

use std::{
    io,
    net::{Ipv4Addr, SocketAddrV4, UdpSocket},
    time::Duration,
};

use super::{connected_udp, timed_out};
use crate::{
    error::{Context, LabError, Result},
    netns::run_in,
};

/// What a connected UDP socket was told by the ICMP error that came back
/// for a datagram nobody received (from `IP_RECVERR`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcmpErrorReport {
    /// The error's sender (the "offender" address): the host that refused.
    pub from: Ipv4Addr,
    pub icmp_type: u8,
    pub icmp_code: u8,
    /// The error's extra word (`ee_info`): for "fragmentation needed", the
    /// MTU of the hop that refused.
    pub info: u32,
}

impl IcmpErrorReport {
    /// Destination unreachable, port unreachable.
    pub fn is_port_unreachable(&self) -> bool {
        self.icmp_type == ICMP_DEST_UNREACH && self.icmp_code == ICMP_PORT_UNREACH
    }

    /// Time exceeded in transit.
    pub fn is_time_exceeded(&self) -> bool {
        self.icmp_type == ICMP_TIME_EXCEEDED && self.icmp_code == 0
    }

    /// Destination unreachable, fragmentation needed and "don't fragment"
    /// set: path MTU discovery's message.
    pub fn is_fragmentation_needed(&self) -> bool {
        self.icmp_type == ICMP_DEST_UNREACH && self.icmp_code == ICMP_FRAG_NEEDED
    }
}

/// What came of one datagram sent with "don't fragment" set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DontFragmentOutcome {
    /// An answer came back: the datagram crossed whole.
    Answered,
    /// The socket failed with `EMSGSIZE`: an ICMP error said the datagram
    /// was too big; `path_mtu` is what the socket then knows (`IP_MTU`).
    TooBig {
        error: IcmpErrorReport,
        path_mtu: u32,
    },
    /// Nothing came back within the timeout: dropped without a word.
    Lost,
}

const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
const ICMP_FRAG_NEEDED: u8 = 4;
const ICMP_TIME_EXCEEDED: u8 = 11;
/// `SO_EE_ORIGIN_ICMP`: the queued error came from an ICMP message.
const SO_EE_ORIGIN_ICMP: u8 = 2;

/// Sends one UDP datagram from namespace `ns`, on a connected socket, to
/// `target` where nothing listens, and waits for the ICMP error a closed
/// port provokes: `Some` once the socket fails with `ECONNREFUSED` (which
/// only happens if the error reached this very socket, so its quoted
/// datagram was translated back right), with who sent it and its type and
/// code; `None` if nothing came back within `timeout`. A datagram in reply
/// is an error (something listens there).
pub fn udp_to_closed_port(
    ns: &str,
    target: SocketAddrV4,
    timeout: Duration,
) -> Result<Option<IcmpErrorReport>> {
    udp_icmp_error(ns, target, None, timeout)
}

/// Sends one UDP datagram from namespace `ns` to `target`, with time to
/// live `ttl` if given, and waits for an ICMP error about it to reach the
/// socket (port unreachable, time exceeded, ...): `Some` with who sent it
/// and its type and code, `None` if nothing came back within `timeout`.
pub fn udp_icmp_error(
    ns: &str,
    target: SocketAddrV4,
    ttl: Option<u32>,
    timeout: Duration,
) -> Result<Option<IcmpErrorReport>> {
    run_in(ns, || {
        let socket = connected_udp(ns, target, timeout, true, ttl)?;
        let mut buf = [0u8; 512];
        match socket.recv(&mut buf) {
            Ok(len) => Err(LabError::BadOutput {
                command: format!("UDP to {target} from {ns}, expecting an ICMP error"),
                reason: format!("a {len}-byte reply came back"),
            }),
            Err(err) if timed_out(&err) => Ok(None),
            // Port unreachable fails the socket with ECONNREFUSED, time
            // exceeded and the other errors with EHOSTUNREACH & co.
            Err(err) if err.raw_os_error().is_some() => {
                queued_icmp_error(&socket, target).map(Some)
            }
            Err(err) => Err(err).context(|| format!("UDP receive from {target} in {ns}")),
        }
    })?
}

/// Sends one `size`-byte UDP datagram with "don't fragment" set
/// (`IP_PMTUDISC_DO`) from namespace `ns` to `target`, an echo server, and
/// waits for its answer or for the socket to fail with `EMSGSIZE`, as
/// path MTU discovery makes it when a hop answers "fragmentation needed".
pub fn udp_dont_fragment(
    ns: &str,
    target: SocketAddrV4,
    size: usize,
    timeout: Duration,
) -> Result<DontFragmentOutcome> {
    run_in(ns, || {
        let socket = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))
            .context(|| format!("UDP bind in {ns}"))?;
        socket
            .connect(target)
            .context(|| format!("UDP connect to {target} in {ns}"))?;
        nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::Ipv4RecvErr, &true)
            .context(|| "setting IP_RECVERR".into())?;
        set_int_option(&socket, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DO)
            .context(|| "setting IP_MTU_DISCOVER".into())?;
        socket
            .set_read_timeout(Some(timeout))
            .context(|| "setting a read timeout".into())?;
        socket
            .send(&vec![0x5a; size])
            .context(|| format!("UDP send of {size} bytes from {ns} to {target}"))?;
        let mut buf = vec![0u8; size + 1];
        match socket.recv(&mut buf) {
            Ok(_) => Ok(DontFragmentOutcome::Answered),
            Err(err) if timed_out(&err) => Ok(DontFragmentOutcome::Lost),
            Err(err) if err.raw_os_error() == Some(libc::EMSGSIZE) => {
                let error = queued_icmp_error(&socket, target)?;
                let path_mtu =
                    int_option(&socket, libc::IP_MTU).context(|| "reading IP_MTU".into())?;
                Ok(DontFragmentOutcome::TooBig { error, path_mtu })
            }
            Err(err) => Err(err).context(|| format!("UDP receive from {target} in {ns}")),
        }
    })?
}

/// Sets an `int` socket option of `IPPROTO_IP` (`IP_MTU_DISCOVER`, ...).
///
/// # Errors
/// The kernel refused it.
pub fn set_int_option(
    socket: &UdpSocket,
    option: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid socket and an int option of the right size.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_IP,
            option,
            (&raw const value).cast(),
            INT_LEN,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reads an `int` socket option of `IPPROTO_IP`, as a count.
fn int_option(socket: &UdpSocket, option: libc::c_int) -> io::Result<u32> {
    use std::os::fd::AsRawFd;
    let mut value: libc::c_int = 0;
    let mut len = INT_LEN;
    // SAFETY: a valid socket, an int and its size.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_IP,
            option,
            (&raw mut value).cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    u32::try_from(value).map_err(|_| io::Error::other(format!("a negative value {value}")))
}

/// The size of an `int` option.
#[allow(clippy::cast_possible_truncation)] // 4
const INT_LEN: libc::socklen_t = size_of::<libc::c_int>() as libc::socklen_t;

/// Reads the ICMP error `IP_RECVERR` queued on `socket`.
fn queued_icmp_error(socket: &UdpSocket, target: SocketAddrV4) -> Result<IcmpErrorReport> {
    use std::os::fd::AsRawFd;

    use nix::sys::socket::{ControlMessageOwned, MsgFlags, SockaddrIn, recvmsg};

    let bad = |reason: String| LabError::BadOutput {
        command: format!("reading the error queue of a UDP socket connected to {target}"),
        reason,
    };
    // The quoted datagram's payload comes along; it is not needed.
    let mut payload = [0u8; 512];
    let mut iov = [io::IoSliceMut::new(&mut payload)];
    let mut control = nix::cmsg_space!(libc::sock_extended_err, libc::sockaddr_in);
    // The error was queued before the receive failed: no waiting.
    let message = recvmsg::<SockaddrIn>(
        socket.as_raw_fd(),
        &mut iov,
        Some(&mut control),
        MsgFlags::MSG_ERRQUEUE | MsgFlags::MSG_DONTWAIT,
    )
    .context(|| format!("reading the error queue of a UDP socket connected to {target}"))?;
    let cmsgs = message
        .cmsgs()
        .map_err(|err| bad(format!("control messages: {err}")))?;
    for cmsg in cmsgs {
        if let ControlMessageOwned::Ipv4RecvErr(err, offender) = cmsg {
            if err.ee_origin != SO_EE_ORIGIN_ICMP {
                return Err(bad(format!(
                    "an error of origin {}, not ICMP",
                    err.ee_origin
                )));
            }
            let from = offender
                .map(|addr| Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)))
                .ok_or_else(|| bad("an ICMP error without its sender".into()))?;
            return Ok(IcmpErrorReport {
                from,
                icmp_type: err.ee_type,
                icmp_code: err.ee_code,
                info: err.ee_info,
            });
        }
    }
    Err(bad("no IP_RECVERR control message".into()))
}
