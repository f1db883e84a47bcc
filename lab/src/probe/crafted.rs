//! Packets written whole by a raw socket: a UDP datagram with a source of
//! the caller's choosing, and one cut into fragments sent in any order.

use std::net::SocketAddrV4;

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use super::checksum;
use crate::{
    error::{Context, LabError, Result},
    netns::run_in,
};

/// Sends one UDP datagram from namespace `ns` with a source address of the
/// caller's choosing (a raw socket writes the IP header), e.g. to check that
/// the VPC router drops a spoofed source.
pub fn send_spoofed_udp(
    ns: &str,
    source: SocketAddrV4,
    destination: SocketAddrV4,
    payload: &[u8],
) -> Result<()> {
    let packet = udp_packet(source, destination, payload)?;
    run_in(ns, || {
        raw_udp_socket(ns)?
            .send_to(&packet, &SockAddr::from(destination))
            .context(|| format!("sending {source} -> {destination} from {ns}"))?;
        Ok(())
    })?
}

/// A raw UDP socket whose writes carry their own IP header, opened in the
/// current namespace (`ns` names it for errors).
fn raw_udp_socket(ns: &str) -> Result<Socket> {
    let socket = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::UDP))
        .context(|| format!("raw socket in {ns}"))?;
    socket
        .set_header_included_v4(true)
        .context(|| "IP_HDRINCL".into())?;
    Ok(socket)
}

/// In what order, and how, [`send_udp_fragments`] sends a datagram's
/// fragments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FragmentOrder {
    /// First to last.
    InOrder,
    /// Last to first: the first fragment, with the UDP header, comes last.
    Reversed,
    /// Last to first, each later fragment starting 8 bytes into the one
    /// before it (same bytes): receivers discard such datagrams.
    ReversedOverlapping,
}

/// Sends one UDP datagram (with its checksum) from `source`, an address of
/// namespace `ns`, to `destination`, cut into fragments carrying
/// `fragment_len` bytes of the UDP datagram each (a multiple of 8), in
/// `order`, with IP identification `id`.
pub fn send_udp_fragments(
    ns: &str,
    source: SocketAddrV4,
    destination: SocketAddrV4,
    payload: &[u8],
    fragment_len: usize,
    order: FragmentOrder,
    id: u16,
) -> Result<()> {
    let fragments = udp_fragments(source, destination, payload, fragment_len, order, id)?;
    run_in(ns, || {
        let socket = raw_udp_socket(ns)?;
        for fragment in &fragments {
            socket
                .send_to(fragment, &SockAddr::from(destination))
                .context(|| format!("a fragment {source} -> {destination} from {ns}"))?;
        }
        Ok(())
    })?
}

/// The fragments [`send_udp_fragments`] sends, in the order it sends them.
fn udp_fragments(
    source: SocketAddrV4,
    destination: SocketAddrV4,
    payload: &[u8],
    fragment_len: usize,
    order: FragmentOrder,
    id: u16,
) -> Result<Vec<Vec<u8>>> {
    let invalid = |what: String| LabError::InvalidOption(what);
    if fragment_len == 0 || !fragment_len.is_multiple_of(8) {
        return Err(invalid(format!("fragments of {fragment_len} bytes")));
    }
    let udp_len = u16::try_from(8 + payload.len())
        .map_err(|_| invalid(format!("a {}-byte payload", payload.len())))?;
    let mut datagram = Vec::with_capacity(usize::from(udp_len));
    datagram.extend_from_slice(&source.port().to_be_bytes());
    datagram.extend_from_slice(&destination.port().to_be_bytes());
    datagram.extend_from_slice(&udp_len.to_be_bytes());
    datagram.extend_from_slice(&[0, 0]);
    datagram.extend_from_slice(payload);
    let mut pseudo = Vec::with_capacity(12 + datagram.len());
    pseudo.extend_from_slice(&source.ip().octets());
    pseudo.extend_from_slice(&destination.ip().octets());
    pseudo.extend_from_slice(&[0, 17]);
    pseudo.extend_from_slice(&udp_len.to_be_bytes());
    pseudo.extend_from_slice(&datagram);
    // 0 means "no checksum": its one's complement twin stands for it.
    let sum = match checksum(&pseudo) {
        0 => 0xffff,
        sum => sum,
    };
    datagram[6..8].copy_from_slice(&sum.to_be_bytes());
    let overlap = if order == FragmentOrder::ReversedOverlapping {
        8
    } else {
        0
    };
    let mut fragments = Vec::new();
    let mut offset = 0;
    while offset < datagram.len() {
        // Each later fragment starts `overlap` bytes back into the one
        // before it.
        let start = if offset == 0 { 0 } else { offset - overlap };
        let end = (start + fragment_len).min(datagram.len());
        let more = end < datagram.len();
        let total = u16::try_from(20 + end - start).map_err(|_| invalid("a fragment".into()))?;
        let units = u16::try_from(start / 8).map_err(|_| invalid("an offset".into()))?;
        let flags_offset = units | if more { 0x2000 } else { 0 };
        let mut packet = vec![0x45, 0];
        packet.extend_from_slice(&total.to_be_bytes());
        packet.extend_from_slice(&id.to_be_bytes());
        packet.extend_from_slice(&flags_offset.to_be_bytes());
        // Checksum 0: the kernel fills it in.
        packet.extend_from_slice(&[64, 17, 0, 0]);
        packet.extend_from_slice(&source.ip().octets());
        packet.extend_from_slice(&destination.ip().octets());
        packet.extend_from_slice(&datagram[start..end]);
        fragments.push(packet);
        offset = end;
    }
    if order != FragmentOrder::InOrder {
        fragments.reverse();
    }
    Ok(fragments)
}

pub(super) fn udp_packet(
    source: SocketAddrV4,
    destination: SocketAddrV4,
    payload: &[u8],
) -> Result<Vec<u8>> {
    let too_big = || LabError::InvalidOption(format!("a {}-byte payload", payload.len()));
    let udp_len = u16::try_from(8 + payload.len()).map_err(|_| too_big())?;
    let total_len = udp_len.checked_add(20).ok_or_else(too_big)?;
    let mut packet = Vec::with_capacity(usize::from(total_len));
    packet.extend_from_slice(&[0x45, 0]);
    packet.extend_from_slice(&total_len.to_be_bytes());
    // Identification 0 and checksum 0: the kernel fills both in.
    packet.extend_from_slice(&[0, 0, 0, 0, 64, 17, 0, 0]);
    packet.extend_from_slice(&source.ip().octets());
    packet.extend_from_slice(&destination.ip().octets());
    packet.extend_from_slice(&source.port().to_be_bytes());
    packet.extend_from_slice(&destination.port().to_be_bytes());
    packet.extend_from_slice(&udp_len.to_be_bytes());
    // A zero UDP checksum means "none" in IPv4.
    packet.extend_from_slice(&[0, 0]);
    packet.extend_from_slice(payload);
    Ok(packet)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_a_udp_packet() {
        let packet = udp_packet(
            "10.20.11.99:1234".parse().unwrap(),
            "10.20.12.50:53".parse().unwrap(),
            b"hi",
        )
        .unwrap();
        assert_eq!(packet.len(), 30);
        assert_eq!(&packet[12..16], &[10, 20, 11, 99]);
        assert_eq!(u16::from_be_bytes([packet[22], packet[23]]), 53);
    }
}
