//! The load generator binary in a namespace of its own: its server answers
//! RR, CRR and hold clients, every exchange is counted, and failures are
//! counted by kind.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    path::PathBuf,
    time::Duration,
};

use vpcnet_bench::measure::{Client, ClientRun, Load, Server, Tools};
use vpcnet_lab::netns::{create_namespaces, delete_namespaces, ip_batch};

const NS: &str = "vpcnet-loadgen";

/// The test's namespace with `lo` up, deleted when dropped.
struct Namespace;

impl Namespace {
    fn create() -> Self {
        let _ = delete_namespaces(&[NS.to_owned()]);
        create_namespaces(&[NS.to_owned()]).expect("creating the namespace");
        let ns = Self;
        ip_batch(Some(NS), &["link set lo up".to_owned()]).expect("lo up");
        ns
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = delete_namespaces(&[NS.to_owned()]);
    }
}

fn tools() -> Tools {
    Tools {
        loadgen: PathBuf::from(env!("CARGO_BIN_EXE_vpcnet-loadgen")),
    }
}

fn run(load: Load, threads: usize) -> ClientRun {
    ClientRun {
        load,
        duration: Duration::from_millis(300),
        threads,
        timeout: Duration::from_millis(500),
        pace: Duration::ZERO,
    }
}

#[test]
fn clients_measure_every_exchange_and_count_failures() {
    let _lock = vpcnet_lab::serial();
    let _ns = Namespace::create();
    let tools = tools();
    let server = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9000);
    let _server = Server::start(&tools, NS, server).expect("the server");

    let rr = Client::run(&tools, NS, server, run(Load::Rr, 1)).expect("rr");
    println!(
        "rr: {:.0}/s, p50 {:.1} µs, p99 {:.1} µs",
        rr.rate, rr.latency.p50_us, rr.latency.p99_us
    );
    assert!(rr.transactions > 100, "{rr:?}");
    assert_eq!(rr.failures(), 0);
    assert_eq!(rr.latency.samples, rr.transactions);
    assert!(0.0 < rr.latency.p50_us && rr.latency.p50_us <= rr.latency.p99_us);
    let counted: u64 = rr.timeline.iter().map(|tick| tick.0).sum();
    assert_eq!(
        counted, rr.transactions,
        "the timeline counts every exchange"
    );

    let closing = Client::run(&tools, NS, server, run(Load::CrrServerCloses, 2)).expect("crr");
    println!("crr, the server closing: {:.0}/s", closing.rate);
    assert!(closing.transactions > 20, "{closing:?}");
    assert_eq!(closing.failures(), 0, "{closing:?}");

    let crr = Client::run(&tools, NS, server, run(Load::Crr, 2)).expect("crr");
    println!("crr: {:.0}/s, p50 {:.1} µs", crr.rate, crr.latency.p50_us);
    assert!(crr.transactions > 20, "{crr:?}");
    assert_eq!(crr.failures(), 0, "{crr:?}");

    let held = Client::run(&tools, NS, server, run(Load::Hold, 2)).expect("hold");
    println!("hold: {} connections", held.transactions);
    assert!(held.transactions > 20, "{held:?}");
    assert_eq!(held.failures(), 0, "{held:?}");

    // Nothing listens on 9001: every attempt is refused, and an RR client
    // cannot even start.
    let closed = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9001);
    let refused = Client::run(&tools, NS, closed, run(Load::Crr, 1)).expect("crr");
    assert_eq!(refused.transactions, 0);
    assert!(
        refused.errors.get("refused").copied().unwrap_or(0) > 0,
        "{refused:?}"
    );
    assert_eq!(
        refused.failures(),
        refused.timeline.iter().map(|t| t.1).sum::<u64>()
    );
    assert!(Client::run(&tools, NS, closed, run(Load::Rr, 1)).is_err());
}
