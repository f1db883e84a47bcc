//! A long-lived TCP connection that proves it never broke: numbered
//! messages echoed in order by a [`vpcnet_lab::WhoamiServer`], on a thread
//! of its own, closed cleanly at the end.

use std::{
    io::{BufRead, BufReader, ErrorKind, Read, Write},
    net::{Shutdown, SocketAddrV4, TcpStream},
    sync::{
        Arc, Condvar, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use vpcnet_lab::{PodInfo, WhoamiServer, addrs, run_in};

/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one message may take to come back: far more than a
/// retransmission or two, so only a broken flow trips it.
const ECHO_TIMEOUT: Duration = Duration::from_secs(3);
/// The pause between two messages: packets keep flowing through whatever
/// the test does meanwhile, without flooding the lab.
const MESSAGE_PACE: Duration = Duration::from_millis(2);
/// How long waiting for more echoes may take (50 echoes at a 2 ms pace
/// take ~0.1 s).
const PHASE_TIMEOUT: Duration = Duration::from_secs(10);

/// The far ends of a node's three kinds of long connections, each a
/// [`WhoamiServer`]: in `inet` (reached through SNAT), on `peer` (in the
/// VPC, unNATed) and in a pod (pod to pod).
pub struct FarEnds {
    pub inet: WhoamiServer,
    pub peer: WhoamiServer,
    pub pod: WhoamiServer,
}

impl FarEnds {
    /// Starts the three servers on `port`, the pod's in `pod`.
    #[must_use]
    pub fn start(pod: &PodInfo, port: u16) -> Self {
        let start = |ns: &str, addr, what: &str| {
            WhoamiServer::start(ns, SocketAddrV4::new(addr, port))
                .unwrap_or_else(|e| panic!("whoami in {what}: {e}"))
        };
        Self {
            inet: start(addrs::NS_INET, addrs::INET_ADDR, "inet"),
            peer: start(addrs::NS_PEER, addrs::PEER_ADDR, "peer"),
            pod: start(&pod.netns, pod.addr, &pod.netns),
        }
    }
}

/// A node's three kinds of long connections, open: SNAT (`pods[0]` to
/// `inet`), to the VPC (`pods[1]` to `peer`) and pod to pod (`pods[2]` to
/// `pods[0]`). The streams stop before their far ends.
pub struct NodeConnections {
    pub snat: EchoStream,
    pub vpc: EchoStream,
    pub pod_to_pod: EchoStream,
    _far_ends: FarEnds,
}

impl NodeConnections {
    /// Opens them from `pods` (three at least), the far ends serving on
    /// `port`.
    #[must_use]
    pub fn open(pods: &[PodInfo], port: u16) -> Self {
        let far_ends = FarEnds::start(&pods[0], port);
        Self {
            snat: EchoStream::open(&pods[0].netns, far_ends.inet.addr()),
            vpc: EchoStream::open(&pods[1].netns, far_ends.peer.addr()),
            pod_to_pod: EchoStream::open(&pods[2].netns, far_ends.pod.addr()),
            _far_ends: far_ends,
        }
    }

    /// Each connection, with its name.
    #[must_use]
    pub fn named(&self) -> [(&'static str, &EchoStream); 3] {
        [
            ("SNAT", &self.snat),
            ("VPC", &self.vpc),
            ("pod to pod", &self.pod_to_pod),
        ]
    }

    /// Waits until each has `more` further echoes; panics, naming it and
    /// `phase`, if one broke or stalled.
    pub fn wait_for_more_echoes(&self, more: u64, phase: &str) {
        for (name, stream) in self.named() {
            stream.wait_for_more_echoes(more, &format!("({name}) {phase}"));
        }
    }

    /// Closes each cleanly; how many messages each echoed.
    pub fn close(self) -> [u64; 3] {
        [self.snat, self.vpc, self.pod_to_pod].map(EchoStream::close)
    }
}

/// A TCP connection from a pod to a [`WhoamiServer`] (which echoes what it
/// gets after its first line) that sends a numbered message every few
/// milliseconds on its own thread and checks each comes back whole and in
/// order.
pub struct EchoStream {
    /// The source the server saw when the connection opened.
    pub seen_as: SocketAddrV4,
    progress: Arc<Progress>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct Progress {
    state: Mutex<StreamState>,
    changed: Condvar,
}

#[derive(Default)]
struct StreamState {
    echoed: u64,
    /// Why the connection stopped working, if it did.
    failure: Option<String>,
    /// Set once the connection has been closed cleanly.
    closed: bool,
}

impl Progress {
    fn update(&self, f: impl FnOnce(&mut StreamState)) {
        f(&mut self.state.lock().unwrap_or_else(PoisonError::into_inner));
        self.changed.notify_all();
    }
}

impl EchoStream {
    /// Connects from namespace `ns` and starts the exchange.
    #[must_use]
    pub fn open(ns: &str, server: SocketAddrV4) -> Self {
        // The socket belongs to the pod's namespace whichever thread uses it.
        let stream = run_in(ns, || {
            TcpStream::connect_timeout(&server.into(), CONNECT_TIMEOUT)
        })
        .expect("entering the pod")
        .unwrap_or_else(|e| panic!("connecting from {ns} to {server}: {e}"));
        stream
            .set_read_timeout(Some(ECHO_TIMEOUT))
            .expect("read timeout");
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        reader
            .read_line(&mut line)
            .unwrap_or_else(|e| panic!("reading the whoami line from {server}: {e}"));
        let seen_as: SocketAddrV4 = line
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("whoami line {line:?}: {e}"));
        let progress = Arc::new(Progress::default());
        let stop = Arc::new(AtomicBool::new(false));
        let thread = thread::Builder::new()
            .name("echo-stream".into())
            .spawn({
                let progress = Arc::clone(&progress);
                let stop = Arc::clone(&stop);
                move || exchange(reader, &progress, &stop)
            })
            .expect("starting the stream thread");
        Self {
            seen_as,
            progress,
            stop,
            thread: Some(thread),
        }
    }

    /// Waits until `more` further messages have come back; panics, saying
    /// during `phase`, if the connection broke or stalled.
    pub fn wait_for_more_echoes(&self, more: u64, phase: &str) {
        if let Err(why) = self.more_echoes(more, PHASE_TIMEOUT) {
            panic!("the long-lived connection {why} {phase}");
        }
    }

    /// Waits until `more` further messages have come back within
    /// `timeout`; says how the connection failed if they did not.
    ///
    /// # Errors
    /// The connection broke (why), or stalled (how far it got).
    pub fn more_echoes(&self, more: u64, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        let mut state = self
            .progress
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let target = state.echoed + more;
        while state.echoed < target {
            if let Some(failure) = &state.failure {
                return Err(format!("broke: {failure};"));
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(format!("stalled: {} of {target} echoes;", state.echoed));
            }
            state = self
                .progress
                .changed
                .wait_timeout(state, remaining)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        Ok(())
    }

    /// Stops sending, closes the connection cleanly (the server must close
    /// its side in turn, with no reset) and returns how many messages were
    /// echoed.
    pub fn close(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.join().expect("the stream thread panicked");
        }
        let state = self
            .progress
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(failure) = &state.failure {
            panic!("the long-lived connection broke: {failure}");
        }
        assert!(state.closed, "the long-lived connection did not close");
        state.echoed
    }
}

impl Drop for EchoStream {
    fn drop(&mut self) {
        // On a failed assertion: stop the thread before the lab goes.
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The stream thread: message, echo, pause, until told to stop; then a
/// clean close.
fn exchange(mut reader: BufReader<TcpStream>, progress: &Progress, stop: &AtomicBool) {
    let mut sequence: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        let message = format!("message {sequence:010}\n");
        let mut echo = vec![0u8; message.len()];
        let exchanged = reader
            .get_mut()
            .write_all(message.as_bytes())
            .and_then(|()| reader.read_exact(&mut echo));
        if let Err(err) = exchanged {
            let failure = format!("message {sequence}: {err} ({:?})", err.kind());
            progress.update(|state| state.failure = Some(failure));
            return;
        }
        if echo != message.as_bytes() {
            let failure = format!(
                "message {sequence}: sent {message:?}, got back {:?}",
                String::from_utf8_lossy(&echo)
            );
            progress.update(|state| state.failure = Some(failure));
            return;
        }
        sequence += 1;
        progress.update(|state| state.echoed = sequence);
        // Pacing, not synchronisation: the next message waits for this
        // one's echo already.
        thread::sleep(MESSAGE_PACE);
    }
    // Half-close: the server sees end of file and closes too. A reset or
    // stray bytes here would mean the connection was not what it seemed.
    let ending = reader.get_ref().shutdown(Shutdown::Write).and_then(|()| {
        let mut rest = Vec::new();
        reader.read_to_end(&mut rest).map(|_| rest)
    });
    progress.update(|state| match ending {
        Ok(rest) if rest.is_empty() => state.closed = true,
        Ok(rest) => state.failure = Some(format!("{} stray bytes after the last echo", rest.len())),
        Err(err) if err.kind() == ErrorKind::ConnectionReset => {
            state.failure = Some("reset when closing".into());
        }
        Err(err) => state.failure = Some(format!("closing: {err}")),
    });
}
