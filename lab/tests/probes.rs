//! The probes themselves, against servers in a namespace of the test's own:
//! many probes from one namespace at once tell answered from unanswered
//! and fail on a refusal.

mod common;

use std::{
    net::{Ipv4Addr, SocketAddrV4, TcpListener, UdpSocket},
    time::{Duration, Instant},
};

use vpcnet_lab::{Proto, WhoamiServer, WhoamiTarget, netns, whoami_each};

/// A namespace with its loopback up, deleted on drop.
struct Namespace(String);

impl Namespace {
    fn create(name: &str) -> Self {
        netns::create_namespaces(&[name.to_owned()]).unwrap();
        let ns = Self(name.to_owned());
        netns::exec_ok(name, &["ip", "link", "set", "lo", "up"]).unwrap();
        ns
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = netns::delete_namespaces(std::slice::from_ref(&self.0));
    }
}

#[test]
fn probes_fanned_out_from_one_namespace_wait_once_and_tell_answered_from_silent() {
    let _lock = common::lab_session();
    let ns = Namespace::create("vpcnet-probes");
    let answering = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 8080);
    let silent = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 8081);
    let _server = WhoamiServer::start(&ns.0, answering).unwrap();
    // Sockets that take what comes and never answer: a TCP connection is
    // made (the backlog) but no line comes, a datagram is swallowed.
    let _silent = netns::run_in(&ns.0, || {
        (
            TcpListener::bind(silent).unwrap(),
            UdpSocket::bind(silent).unwrap(),
        )
    })
    .unwrap();
    let rounds = 10;
    let targets: Vec<WhoamiTarget> = (0..rounds)
        .flat_map(|_| {
            [answering, silent].into_iter().flat_map(|server| {
                [Proto::Tcp, Proto::Udp].map(|proto| WhoamiTarget { proto, server })
            })
        })
        .collect();
    let timeout = Duration::from_millis(500);
    let started = Instant::now();
    let answers = whoami_each(&ns.0, &targets, timeout).unwrap();
    let took = started.elapsed();
    for (target, answer) in targets.iter().zip(&answers) {
        if target.server == answering {
            let seen = answer.unwrap_or_else(|| panic!("{target:?} unanswered"));
            assert_eq!(*seen.ip(), Ipv4Addr::LOCALHOST, "{target:?}");
        } else {
            assert_eq!(*answer, None, "{target:?}");
        }
    }
    // 20 silent probes one after the other would wait 10 s.
    assert!(
        took < timeout * 4,
        "{} probes took {took:?}: they did not wait together",
        targets.len()
    );

    let closed = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 8082);
    let refused = whoami_each(
        &ns.0,
        &[WhoamiTarget {
            proto: Proto::Tcp,
            server: closed,
        }],
        timeout,
    );
    assert!(refused.is_err(), "a refused connection: {refused:?}");
}
