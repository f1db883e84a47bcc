//! TIME_WAIT safety through the eBPF SNAT: a server in `inet` that closes
//! first (so it holds every connection in TIME_WAIT for 60 s) and pods
//! opening short connections to it. A port handed to another pod while the
//! server still holds the old connection makes the server refuse the SYN
//! (`TcpExtPAWSTimewait`) and costs the client a 1 s SYN retransmit; the
//! VPC CNI's `--random-fully` does that for about 3 % of connections.
//!
//! Zero of both, in the server's namespace and in every pod's, is the bar.

use std::{
    collections::HashMap,
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use vpcnet_bpf_tests::{agent_binary, lab_counter};
use vpcnet_common::counters::Counter;
use vpcnet_lab::{Lab, LabOptions, RandomizeSnat, addrs, run_in, spawn_in, test_sizes};

const SERVER_PORT: u16 = 8080;
const REQUEST: &[u8] = b"GET / HTTP/1.0\r\n\r\n";
const RESPONSE: &[u8] = b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok";
const IO_TIMEOUT: Duration = Duration::from_secs(3);
/// The burst's connections, unless [`test_sizes::TIME_WAIT_CONNECTIONS_VAR`]
/// says: a third of the SNAT range held in TIME_WAIT by the server.
const BURST: u64 = 20_000;
/// Each pod of the paced run makes an eighth of the burst's connections.
const PACED_PER_BURST: u64 = 8;
/// The paced run's interval between one pod's connections: four pods make
/// 500 a second together.
const PACED_INTERVAL: Duration = Duration::from_millis(8);

fn server_addr() -> SocketAddr {
    SocketAddr::from((addrs::INET_ADDR, SERVER_PORT))
}

/// The `TcpExt` counters of a namespace (`/proc/net/netstat` read there).
fn tcp_ext(ns: &str) -> HashMap<String, u64> {
    let text = vpcnet_lab::exec_ok(ns, &["cat", "/proc/net/netstat"]).unwrap();
    let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let names = lines.next().expect("TcpExt names");
    let values = lines.next().expect("TcpExt values");
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .skip(1)
        .map(|(n, v)| (n.to_owned(), v.parse().unwrap()))
        .collect()
}

/// What the test watches in one namespace: (PAWS refusals, SYN retransmits).
/// Some kernels (Debian's 6.12) count no `PAWSTimewait`: there the SYN
/// retransmit each refusal costs the client is what the test sees.
fn watched(ns: &str) -> (u64, u64) {
    let c = tcp_ext(ns);
    (
        c.get("PAWSTimewait").copied().unwrap_or(0),
        c["TCPSynRetrans"],
    )
}

/// An HTTP/1.0-like server that answers and closes first, on one thread in
/// `inet`, until `stop` is set and one more connection wakes it.
struct Server {
    stop: Arc<AtomicBool>,
    served: Arc<AtomicU64>,
    thread: Option<vpcnet_lab::NetnsThread<()>>,
}

impl Server {
    fn start() -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicU64::new(0));
        let (stop2, served2) = (Arc::clone(&stop), Arc::clone(&served));
        let listener = run_in(addrs::NS_INET, || TcpListener::bind(server_addr()))
            .unwrap()
            .unwrap();
        let thread = spawn_in(addrs::NS_INET, move || {
            for stream in listener.incoming() {
                if stop2.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(mut stream) = stream else { continue };
                let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
                let mut buf = [0u8; 256];
                let mut got = 0;
                while got < REQUEST.len() {
                    match stream.read(&mut buf[got..]) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got += n,
                    }
                }
                if stream.write_all(RESPONSE).is_ok() {
                    served2.fetch_add(1, Ordering::Relaxed);
                }
                // Dropping closes first: the server side goes to TIME_WAIT.
            }
        })
        .unwrap();
        Self {
            stop,
            served,
            thread: Some(thread),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop from inside its namespace.
        let _ = run_in(addrs::NS_INET, || {
            TcpStream::connect_timeout(&server_addr(), IO_TIMEOUT)
        });
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One short connection: request, response, the server's close.
fn one_request() -> Result<(), String> {
    let mut stream = TcpStream::connect_timeout(&server_addr(), IO_TIMEOUT)
        .map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(IO_TIMEOUT))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(REQUEST)
        .map_err(|e| format!("write: {e}"))?;
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .map_err(|e| format!("read: {e}"))?;
    if response.starts_with(b"HTTP/1.0 200") {
        Ok(())
    } else {
        Err(format!(
            "bad response {:?}",
            String::from_utf8_lossy(&response)
        ))
    }
}

/// What a client in a pod did.
#[derive(Debug, Default)]
struct ClientRun {
    ok: u64,
    failed: u64,
    first_error: Option<String>,
    slow: u64,
}

/// `count` connections from pod `ns`, one every `interval` (or back to
/// back when `None`), within `deadline`.
fn client(
    ns: &str,
    count: u64,
    interval: Option<Duration>,
    deadline: Duration,
) -> vpcnet_lab::NetnsThread<ClientRun> {
    spawn_in(ns, move || {
        let start = Instant::now();
        let mut run = ClientRun::default();
        for i in 0..count {
            if start.elapsed() > deadline {
                break;
            }
            if let Some(interval) = interval {
                // Pacing: the i-th connection starts at i * interval.
                let due = interval * u32::try_from(i).unwrap();
                if let Some(wait) = due.checked_sub(start.elapsed()) {
                    std::thread::sleep(wait);
                }
            }
            let began = Instant::now();
            match one_request() {
                Ok(()) => run.ok += 1,
                Err(e) => {
                    run.failed += 1;
                    run.first_error.get_or_insert(e);
                }
            }
            // A connection that took a second waited for a SYN retransmit.
            if began.elapsed() >= Duration::from_millis(900) {
                run.slow += 1;
            }
        }
        run
    })
    .unwrap()
}

#[test]
fn prng_ports_never_make_the_server_refuse_a_syn() {
    server_never_refuses_a_syn(RandomizeSnat::Prng);
}

#[test]
fn hashrandom_ports_never_make_the_server_refuse_a_syn() {
    server_never_refuses_a_syn(RandomizeSnat::HashRandom);
}

#[test]
fn sequential_ports_never_make_the_server_refuse_a_syn() {
    server_never_refuses_a_syn(RandomizeSnat::Sequential);
}

fn server_never_refuses_a_syn(randomize_snat: RandomizeSnat) {
    let _serial = vpcnet_lab::serial();
    let lab = Lab::up(&LabOptions {
        randomize_snat,
        ..LabOptions::ebpf(4, agent_binary())
    })
    .unwrap();
    println!(
        "AWS_VPC_K8S_CNI_RANDOMIZESNAT={}",
        randomize_snat.env_value()
    );
    let pods: Vec<String> = lab.pods().iter().map(|p| p.netns.clone()).collect();
    let server = Server::start();
    let watched_ns: Vec<&str> = std::iter::once(addrs::NS_INET)
        .chain(pods.iter().map(String::as_str))
        .collect();
    let before: Vec<(u64, u64)> = watched_ns.iter().map(|ns| watched(ns)).collect();

    let burst_count = test_sizes::size_or(test_sizes::TIME_WAIT_CONNECTIONS_VAR, BURST);
    let paced_count = burst_count / PACED_PER_BURST;
    // The burst from one pod, as fast as it goes.
    let started = Instant::now();
    let burst = client(&pods[0], burst_count, None, Duration::from_mins(2))
        .join()
        .unwrap();
    let burst_secs = started.elapsed().as_secs_f64();
    #[allow(clippy::cast_precision_loss)]
    let rate = burst.ok as f64 / burst_secs;
    println!("one pod, back to back: {burst:?} in {burst_secs:.1} s ({rate:.0} connections/s)");
    for ns in &watched_ns {
        println!("after burst {ns}: {:?}", watched(ns));
    }
    println!(
        "reopen {} takeover {} snat_new {}",
        lab_counter(Counter::EgressReopen),
        lab_counter(Counter::EgressTakeover),
        lab_counter(Counter::EgressSnatNew)
    );

    // Then four pods together at 500 per second, while the server still
    // holds the first pod's connections in TIME_WAIT.
    let paced: Vec<_> = pods
        .iter()
        .map(|ns| {
            client(
                ns,
                paced_count,
                Some(PACED_INTERVAL),
                Duration::from_mins(1),
            )
        })
        .collect();
    let paced: Vec<ClientRun> = paced.into_iter().map(|t| t.join().unwrap()).collect();
    println!("four pods, 500/s together: {paced:?}");

    let after: Vec<(u64, u64)> = watched_ns.iter().map(|ns| watched(ns)).collect();
    for ((ns, b), a) in watched_ns.iter().zip(&before).zip(&after) {
        println!(
            "{ns:<14} PAWSTimewait +{} TCPSynRetrans +{}",
            a.0 - b.0,
            a.1 - b.1
        );
    }
    let connections_served = server.served.load(Ordering::Relaxed);
    drop(server);
    println!(
        "served {connections_served}; datapath: snat_new {}, reopened {}, port takeovers {}, alloc retries {}, no-port drops {}, table-full drops {}",
        lab_counter(Counter::EgressSnatNew),
        lab_counter(Counter::EgressReopen),
        lab_counter(Counter::EgressTakeover),
        lab_counter(Counter::AllocRetry),
        lab_counter(Counter::DropNatNoPort),
        lab_counter(Counter::DropNatTableFull),
    );

    assert_eq!(
        burst.ok, burst_count,
        "every connection of the burst succeeded: {burst:?}"
    );
    for run in &paced {
        assert_eq!(
            (run.ok, run.failed),
            (paced_count, 0),
            "every paced connection succeeded: {run:?}"
        );
    }
    for ((ns, b), a) in watched_ns.iter().zip(&before).zip(&after) {
        assert_eq!(a.0 - b.0, 0, "{ns}: SYNs refused by TIME_WAIT (PAWS)");
        assert_eq!(a.1 - b.1, 0, "{ns}: SYN retransmits");
    }
    assert_eq!(lab_counter(Counter::DropNatNoPort), 0);
    assert_eq!(
        lab_counter(Counter::AllocOldestClosed),
        0,
        "no port had to be reused within its TIME_WAIT hold"
    );
    assert_eq!(lab_counter(Counter::DropNatTableFull), 0);
    drop(lab);
}
