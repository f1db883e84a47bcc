//! Protocols without ports (GRE here; ESP and SCTP alike) from a pod to
//! outside the VPC: the SNAT chain translates them by address, and so does
//! vpcnet. What `inet` sees of a pod's GRE packet, and whether its answer
//! comes back to the pod, in both datapaths. The same for the ICMP queries
//! conntrack tracks besides echo (timestamp, information, address mask):
//! translated as echo is, their identifier the port.

use std::{
    net::Ipv4Addr,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::Duration,
};

use vpcnet_bpf_tests::{
    agent_binary,
    differential::{self, lab_drops},
    packets::internet_checksum,
};
use vpcnet_lab::{Datapath, Lab, LabOptions, addrs, run_in, serial};

const IPPROTO_GRE: i32 = 47;
/// A GRE header (no checksum, key or sequence; protocol IPv4) and a word of
/// payload.
const GRE_PACKET: [u8; 8] = [0, 0, 0x08, 0x00, 0xde, 0xad, 0xbe, 0xef];
const TIMEOUT: Duration = Duration::from_secs(2);
/// The ICMP queries besides echo, each request's type and its reply's.
const ICMP_QUERIES: [(u8, u8); 3] = [(13, 14), (15, 16), (17, 18)];

/// A raw socket of protocol `proto` in namespace `ns`: it sends payloads
/// (the kernel adds the IP header) and receives whole datagrams.
fn raw_socket(ns: &str, proto: i32) -> OwnedFd {
    run_in(ns, || {
        // SAFETY: plain socket(2); the descriptor is owned from here on.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, proto) };
        assert!(
            fd >= 0,
            "raw socket of protocol {proto} in {ns}: {}",
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

fn send_raw(socket: &OwnedFd, to: Ipv4Addr, payload: &[u8]) {
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
            payload.as_ptr().cast(),
            payload.len(),
            0,
            (&raw const addr).cast(),
            libc::socklen_t::try_from(size_of::<libc::sockaddr_in>()).unwrap_or(16),
        )
    };
    assert_eq!(
        usize::try_from(sent).ok(),
        Some(payload.len()),
        "send to {to}: {}",
        std::io::Error::last_os_error()
    );
}

/// The source and the payload of the next datagram whose payload
/// `wanted` accepts, `None` if none came within the timeout.
fn receive(socket: &OwnedFd, wanted: impl Fn(&[u8]) -> bool) -> Option<(Ipv4Addr, Vec<u8>)> {
    let mut buf = [0u8; 2048];
    for _ in 0..16 {
        // SAFETY: a valid socket and buffer.
        let len = unsafe { libc::recv(socket.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        let len = usize::try_from(len).ok()?;
        let header = usize::from(buf[0] & 0x0f) * 4;
        let payload = buf.get(header..len)?;
        if wanted(payload) {
            let source = Ipv4Addr::new(buf[12], buf[13], buf[14], buf[15]);
            return Some((source, payload.to_vec()));
        }
    }
    None
}

/// An ICMP query message of `icmp_type` with identifier `id`.
fn icmp_query(icmp_type: u8, id: u16) -> Vec<u8> {
    let mut message = vec![icmp_type, 0, 0, 0];
    message.extend_from_slice(&id.to_be_bytes());
    message.extend_from_slice(&[0, 1]);
    // Room for the timestamps and the address mask.
    message.resize(20, 0);
    let csum = internet_checksum(&[&message]);
    message[2..4].copy_from_slice(&csum.to_be_bytes());
    message
}

/// The identifier of `message` when it is ICMP of `icmp_type`.
fn icmp_id(message: &[u8], icmp_type: u8) -> Option<u16> {
    (message.len() >= 8 && message[0] == icmp_type)
        .then(|| u16::from_be_bytes([message[4], message[5]]))
}

/// What `inet` saw as the source of a pod's packet, and who the pod's
/// answer came from.
type Exchange = (Option<Ipv4Addr>, Option<Ipv4Addr>);

/// GRE's exchange, and each ICMP query's (request type, exchange).
fn run(options: &LabOptions) -> (Exchange, Vec<(u8, Exchange)>) {
    let lab = Lab::up(options).unwrap_or_else(|e| panic!("bringing the lab up: {e}"));
    let inet = raw_socket(addrs::NS_INET, IPPROTO_GRE);
    let pod = raw_socket(&lab.pod(0).netns, IPPROTO_GRE);
    send_raw(&pod, addrs::INET_ADDR, &GRE_PACKET);
    let is_ours = |payload: &[u8]| payload.starts_with(&GRE_PACKET);
    let seen = receive(&inet, is_ours).map(|(source, _)| source);
    let answered = seen.and_then(|source| {
        send_raw(&inet, source, &GRE_PACKET);
        receive(&pod, is_ours).map(|(source, _)| source)
    });
    let gre = (seen, answered);
    let inet = raw_socket(addrs::NS_INET, libc::IPPROTO_ICMP);
    let pod = raw_socket(&lab.pod(0).netns, libc::IPPROTO_ICMP);
    let mut icmp = Vec::new();
    for (id, (request, reply)) in (4242..).zip(ICMP_QUERIES) {
        send_raw(&pod, addrs::INET_ADDR, &icmp_query(request, id));
        // Its identifier as it arrived: the port the NAT chose.
        let arrived = receive(&inet, |message| icmp_id(message, request).is_some());
        let seen = arrived.as_ref().map(|(source, _)| *source);
        let answered = arrived.and_then(|(source, message)| {
            let nat_id = icmp_id(&message, request)?;
            send_raw(&inet, source, &icmp_query(reply, nat_id));
            receive(&pod, |message| icmp_id(message, reply) == Some(id)).map(|(source, _)| source)
        });
        icmp.push((request, (seen, answered)));
    }
    if options.datapath == Datapath::Ebpf {
        assert_eq!(lab_drops(), Vec::<String>::new(), "vpcnet dropped packets");
    }
    drop((inet, pod));
    drop(lab);
    (gre, icmp)
}

#[test]
fn a_pods_gre_and_icmp_queries_reach_inet_from_the_node_address_and_are_answered() {
    let _lab_slot = serial();
    let reference = differential::reference_half(|| run(&LabOptions::iptables(1)));
    let ebpf = run(&LabOptions::ebpf(1, agent_binary()));
    println!("from pod-0 to inet: (source inet saw, answer came from)");
    if let Some((gre, icmp)) = &reference {
        println!("iptables: GRE {gre:?}, ICMP queries {icmp:?}");
    }
    println!("vpcnet:   GRE {:?}, ICMP queries {:?}", ebpf.0, ebpf.1);
    let expected = (Some(addrs::NODE_PRIMARY_ADDR), Some(addrs::INET_ADDR));
    let queries: Vec<(u8, Exchange)> = ICMP_QUERIES
        .iter()
        .map(|(request, _)| (*request, expected))
        .collect();
    if let Some(reference) = reference {
        assert_eq!(
            reference,
            (expected, queries.clone()),
            "the iptables reference"
        );
    }
    assert_eq!(ebpf, (expected, queries), "vpcnet");
}
