//! Waiting for links to come up, on rtnetlink events rather than by polling.
//!
//! A veth's carrier comes on when both ends are up, but the kernel finishes
//! the job (operational state UP, queueing discipline attached) later, in its
//! link-watch work; until then packets sent on the link are dropped. So
//! "ready" means the kernel has reported operstate UP for every link.

use std::{
    collections::BTreeSet,
    os::fd::{AsFd, AsRawFd},
    time::{Duration, Instant},
};

use nix::{
    errno::Errno,
    poll::{PollFd, PollFlags, PollTimeout, poll},
    sys::socket::{
        AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, send,
        socket,
    },
};

use crate::{
    error::{Context, LabError, Result},
    netns::run_in,
};

const NLMSG_HDRLEN: usize = 16;
const IFINFOMSG_LEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
const RTMGRP_LINK: u32 = 0x1;
const IFLA_IFNAME: u16 = 3;
const IFLA_OPERSTATE: u16 = 16;
const IF_OPER_UP: u8 = 6;

/// Waits until every link in `names` of namespace `ns` is operationally up.
pub fn wait_links_up(ns: &str, names: &[String], timeout: Duration) -> Result<()> {
    if names.is_empty() {
        return Ok(());
    }
    let deadline = Instant::now() + timeout;
    run_in(ns, || wait_here(ns, names, deadline, timeout))?
}

/// Whether namespace `ns` has a link named `name`.
pub fn link_exists(ns: &str, name: &str) -> Result<bool> {
    run_in(ns, || nix::net::if_::if_nametoindex(name).is_ok())
}

fn wait_here(ns: &str, names: &[String], deadline: Instant, timeout: Duration) -> Result<()> {
    let mut pending: BTreeSet<&str> = names.iter().map(String::as_str).collect();
    let sock = socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkRoute,
    )
    .context(|| format!("opening an rtnetlink socket in {ns}"))?;
    // Subscribe before dumping: a change between the dump and the
    // subscription would otherwise be missed.
    bind(sock.as_raw_fd(), &NetlinkAddr::new(0, RTMGRP_LINK))
        .context(|| format!("subscribing to link events in {ns}"))?;
    request_link_dump(&sock, ns)?;

    let mut buf = vec![0u8; 64 * 1024];
    while !pending.is_empty() {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(LabError::Timeout {
                what: format!(
                    "links {} in {ns} to come up",
                    pending.iter().copied().collect::<Vec<_>>().join(", ")
                ),
                waited: timeout,
            });
        }
        let millis = u16::try_from(remaining.as_millis().max(1)).unwrap_or(u16::MAX);
        let mut fds = [PollFd::new(sock.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(millis)) {
            Ok(0) | Err(Errno::EINTR) => continue,
            Ok(_) => {}
            Err(err) => return Err(err).context(|| format!("waiting for link events in {ns}")),
        }
        let len = match recv(sock.as_raw_fd(), &mut buf, MsgFlags::empty()) {
            Ok(len) => len,
            Err(Errno::EINTR | Errno::EAGAIN) => continue,
            // Events came faster than they were read: the kernel dropped some,
            // so ask for the whole state again.
            Err(Errno::ENOBUFS) => {
                request_link_dump(&sock, ns)?;
                continue;
            }
            Err(err) => return Err(err).context(|| format!("reading link events in {ns}")),
        };
        for (name, up) in parse_links(&buf[..len]).map_err(|reason| LabError::BadOutput {
            command: format!("rtnetlink link dump in {ns}"),
            reason,
        })? {
            if up {
                pending.remove(name.as_str());
            }
        }
    }
    Ok(())
}

fn request_link_dump(sock: &impl AsRawFd, ns: &str) -> Result<()> {
    let total = u32::try_from(NLMSG_HDRLEN + IFINFOMSG_LEN).expect("small");
    let mut request = Vec::with_capacity(NLMSG_HDRLEN + IFINFOMSG_LEN);
    request.extend_from_slice(&total.to_ne_bytes());
    request.extend_from_slice(&RTM_GETLINK.to_ne_bytes());
    request.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    request.extend_from_slice(&1u32.to_ne_bytes()); // sequence number
    request.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel fills it
    request.extend_from_slice(&[0u8; IFINFOMSG_LEN]); // AF_UNSPEC, all links
    send(sock.as_raw_fd(), &request, MsgFlags::empty())
        .context(|| format!("asking for the links of {ns}"))?;
    Ok(())
}

/// The (name, operationally up) of every link message in one datagram.
fn parse_links(mut data: &[u8]) -> Result<Vec<(String, bool)>, String> {
    let mut links = Vec::new();
    while data.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes(data[0..4].try_into().expect("4 bytes")) as usize;
        let kind = u16::from_ne_bytes(data[4..6].try_into().expect("2 bytes"));
        if len < NLMSG_HDRLEN || len > data.len() {
            return Err(format!(
                "netlink message of length {len} in {} bytes",
                data.len()
            ));
        }
        let payload = &data[NLMSG_HDRLEN..len];
        match kind {
            NLMSG_ERROR => {
                let code = payload
                    .get(0..4)
                    .map_or(0, |b| i32::from_ne_bytes(b.try_into().expect("4 bytes")));
                if code != 0 {
                    return Err(format!(
                        "the kernel answered error {}",
                        Errno::from_raw(-code)
                    ));
                }
            }
            RTM_NEWLINK if payload.len() >= IFINFOMSG_LEN => {
                let mut name = None;
                let mut up = false;
                let mut attrs = &payload[IFINFOMSG_LEN..];
                while attrs.len() >= 4 {
                    let attr_len = usize::from(u16::from_ne_bytes([attrs[0], attrs[1]]));
                    let attr_kind = u16::from_ne_bytes([attrs[2], attrs[3]]) & 0x3fff;
                    if attr_len < 4 || attr_len > attrs.len() {
                        break;
                    }
                    let value = &attrs[4..attr_len];
                    match attr_kind {
                        IFLA_IFNAME => {
                            let bytes = value.split(|b| *b == 0).next().unwrap_or_default();
                            name = Some(String::from_utf8_lossy(bytes).into_owned());
                        }
                        IFLA_OPERSTATE => up = value.first() == Some(&IF_OPER_UP),
                        _ => {}
                    }
                    attrs = &attrs[align4(attr_len).min(attrs.len())..];
                }
                if let Some(name) = name {
                    links.push((name, up));
                }
            }
            // NLMSG_DONE, NLMSG_NOOP, and other messages: nothing to learn.
            _ => {}
        }
        data = &data[align4(len).min(data.len())..];
    }
    Ok(links)
}

fn align4(len: usize) -> usize {
    (len + 3) & !3
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
        let len = u16::try_from(4 + value.len()).unwrap();
        let mut out = Vec::new();
        out.extend_from_slice(&len.to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(value);
        out.resize(align4(out.len()), 0);
        out
    }

    fn link_message(name: &str, operstate: u8) -> Vec<u8> {
        let mut payload = vec![0u8; IFINFOMSG_LEN];
        payload.extend(attr(IFLA_IFNAME, format!("{name}\0").as_bytes()));
        payload.extend(attr(IFLA_OPERSTATE, &[operstate]));
        let len = u32::try_from(NLMSG_HDRLEN + payload.len()).unwrap();
        let mut out = Vec::new();
        out.extend_from_slice(&len.to_ne_bytes());
        out.extend_from_slice(&RTM_NEWLINK.to_ne_bytes());
        out.extend_from_slice(&[0; 10]);
        out.extend(payload);
        out
    }

    #[test]
    fn parses_names_and_operstate() {
        let mut data = link_message("eth0", IF_OPER_UP);
        data.extend(link_message("enic220f2ba281", 2));
        let links = parse_links(&data).unwrap();
        assert_eq!(
            links,
            vec![("eth0".into(), true), ("enic220f2ba281".into(), false)]
        );
    }

    #[test]
    fn rejects_a_truncated_message() {
        let data = link_message("eth0", IF_OPER_UP);
        assert!(parse_links(&data[..20]).is_err());
    }
}
