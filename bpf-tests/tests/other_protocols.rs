//! Protocols without ports (GRE here; ESP and SCTP alike) from a pod to
//! outside the VPC: the SNAT chain translates them by address, and so does
//! vpcnet. What `inet` sees of a pod's GRE packet, and whether its answer
//! comes back to the pod, in both datapaths.

use std::{
    net::Ipv4Addr,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::Duration,
};

use vpcnet_bpf_tests::{agent_binary, differential::lab_drops};
use vpcnet_lab::{Datapath, Lab, LabOptions, addrs, run_in, serial};

const IPPROTO_GRE: i32 = 47;
/// A GRE header (no checksum, key or sequence; protocol IPv4) and a word of
/// payload.
const GRE_PACKET: [u8; 8] = [0, 0, 0x08, 0x00, 0xde, 0xad, 0xbe, 0xef];
const TIMEOUT: Duration = Duration::from_secs(2);

/// A raw GRE socket in namespace `ns`: it sends GRE payloads (the kernel
/// adds the IP header) and receives whole GRE datagrams.
fn gre_socket(ns: &str) -> OwnedFd {
    run_in(ns, || {
        // SAFETY: plain socket(2); the descriptor is owned from here on.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, IPPROTO_GRE) };
        assert!(
            fd >= 0,
            "raw GRE socket in {ns}: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let timeout = libc::timeval {
            tv_sec: libc::time_t::try_from(TIMEOUT.as_secs()).unwrap_or(2),
            tv_usec: 0,
        };
        // SAFETY: a valid socket and a timeval of the right size.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const timeout).cast(),
                libc::socklen_t::try_from(size_of::<libc::timeval>()).unwrap_or(16),
            )
        };
        assert_eq!(rc, 0, "SO_RCVTIMEO");
        fd
    })
    .expect("entering the namespace")
}

fn send_gre(socket: &OwnedFd, to: Ipv4Addr) {
    let addr = libc::sockaddr_in {
        sin_family: libc::sa_family_t::try_from(libc::AF_INET).unwrap_or(2),
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(to.octets()),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: a valid socket, buffer and address of the sizes given.
    let sent = unsafe {
        libc::sendto(
            socket.as_raw_fd(),
            GRE_PACKET.as_ptr().cast(),
            GRE_PACKET.len(),
            0,
            (&raw const addr).cast(),
            libc::socklen_t::try_from(size_of::<libc::sockaddr_in>()).unwrap_or(16),
        )
    };
    assert_eq!(
        usize::try_from(sent).ok(),
        Some(GRE_PACKET.len()),
        "GRE send to {to}: {}",
        std::io::Error::last_os_error()
    );
}

/// The source of the next GRE datagram carrying [`GRE_PACKET`], `None`
/// if none came within the timeout.
fn receive_gre(socket: &OwnedFd) -> Option<Ipv4Addr> {
    let mut buf = [0u8; 2048];
    for _ in 0..16 {
        // SAFETY: a valid socket and buffer.
        let len = unsafe { libc::recv(socket.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        let len = usize::try_from(len).ok()?;
        let header = usize::from(buf[0] & 0x0f) * 4;
        if len >= header + GRE_PACKET.len() && buf[header..header + GRE_PACKET.len()] == GRE_PACKET
        {
            return Some(Ipv4Addr::new(buf[12], buf[13], buf[14], buf[15]));
        }
    }
    None
}

/// What `inet` saw as the source of the pod's GRE packet, and who the
/// pod's answer came from.
fn run(options: &LabOptions) -> (Option<Ipv4Addr>, Option<Ipv4Addr>) {
    let lab = Lab::up(options).unwrap_or_else(|e| panic!("bringing the lab up: {e}"));
    let inet = gre_socket(addrs::NS_INET);
    let pod = gre_socket(&lab.pod(0).netns);
    send_gre(&pod, addrs::INET_ADDR);
    let seen = receive_gre(&inet);
    let answered = seen.and_then(|source| {
        send_gre(&inet, source);
        receive_gre(&pod)
    });
    if options.datapath == Datapath::Ebpf {
        assert_eq!(lab_drops(), Vec::<String>::new(), "vpcnet dropped packets");
    }
    drop((inet, pod));
    drop(lab);
    (seen, answered)
}

#[test]
fn a_pods_gre_reaches_inet_from_the_node_address_and_is_answered() {
    let _lab_slot = serial();
    let reference = run(&LabOptions::iptables(1));
    let ebpf = run(&LabOptions::ebpf(1, agent_binary()));
    println!("GRE from pod-0 to inet: (source inet saw, answer came from)");
    println!("iptables: {reference:?}");
    println!("vpcnet:   {ebpf:?}");
    let expected = (Some(addrs::NODE_PRIMARY_ADDR), Some(addrs::INET_ADDR));
    assert_eq!(reference, expected, "the iptables reference");
    assert_eq!(ebpf, expected, "vpcnet");
}
