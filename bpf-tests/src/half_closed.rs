//! A connection a pod half-closes toward the internet, answered late: the
//! pod sends a request and its FIN, the server acknowledges and answers
//! only when told. netfilter has such a connection in `CLOSE_WAIT` (its FIN
//! acknowledged, the other side still open), whose timeout kube-proxy
//! raises to an hour; the answer must reach the pod whatever carries the
//! connection meanwhile.

use std::{
    io::{Read, Write},
    net::{Shutdown, SocketAddrV4, TcpListener, TcpStream},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use vpcnet_lab::{Datapath, addrs, exec_ok, run_in};

use crate::agent_binary;

pub const REQUEST: &[u8] = b"request";
pub const ANSWER: &[u8] = b"the answer, late";
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// The pod's side of the connection, and the server's waiting to answer.
pub struct HalfClosed {
    client: TcpStream,
    answer_now: mpsc::Sender<()>,
    server: thread::JoinHandle<std::io::Result<Vec<u8>>>,
}

/// What each side got once the server answered.
#[derive(Debug)]
pub struct Answered {
    /// What the pod read, to the server's FIN.
    pub read: std::io::Result<String>,
    /// What the server read, to the pod's FIN.
    pub served: std::io::Result<String>,
}

impl Answered {
    /// Both sides got all the other sent.
    pub fn whole(&self) -> bool {
        matches!(&self.read, Ok(answer) if answer.as_bytes() == ANSWER)
            && matches!(&self.served, Ok(request) if request.as_bytes() == REQUEST)
    }
}

fn text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

impl HalfClosed {
    /// The pod in `pod_ns` connects to `server` (a port of the lab's
    /// internet host), sends [`REQUEST`] and its FIN; returns once the
    /// server read them.
    pub fn open(pod_ns: &str, server_addr: SocketAddrV4) -> Self {
        let listener = run_in(addrs::NS_INET, || TcpListener::bind(server_addr))
            .expect("entering inet")
            .expect("listening in inet");
        let (got_fin, fin_seen) = mpsc::channel();
        let (answer_now, told) = mpsc::channel::<()>();
        let server = thread::spawn(move || -> std::io::Result<Vec<u8>> {
            let (mut conn, _) = listener.accept()?;
            conn.set_read_timeout(Some(IO_TIMEOUT))?;
            let mut request = Vec::new();
            // To the pod's FIN (read returns 0).
            conn.read_to_end(&mut request)?;
            let _ = got_fin.send(());
            // Answers when told, or when the test is gone.
            let _ = told.recv();
            conn.write_all(ANSWER)?;
            conn.shutdown(Shutdown::Write)?;
            Ok(request)
        });
        let mut client = run_in(pod_ns, || {
            TcpStream::connect_timeout(&server_addr.into(), IO_TIMEOUT)
        })
        .expect("entering the pod")
        .expect("connecting to the internet");
        client.write_all(REQUEST).expect("sending the request");
        client.shutdown(Shutdown::Write).expect("the pod's FIN");
        fin_seen
            .recv_timeout(IO_TIMEOUT)
            .expect("the server saw the pod's FIN");
        Self {
            client,
            answer_now,
            server,
        }
    }

    /// The pod's end, `address:port`.
    pub fn pod_end(&self) -> String {
        self.client.local_addr().expect("the pod's end").to_string()
    }

    /// Tells the server to answer and close; reads the answer in the pod.
    pub fn answer(mut self) -> Answered {
        let _ = self.answer_now.send(());
        self.client
            .set_read_timeout(Some(IO_TIMEOUT))
            .expect("read timeout");
        let mut answer = Vec::new();
        let read = self.client.read_to_end(&mut answer).map(|_| text(answer));
        let served = self.server.join().expect("the server thread").map(text);
        Answered { read, served }
    }
}

/// Waits until the node's table (conntrack's for the iptables datapath,
/// vpcnet's as `vpcnet-agent nat` prints it otherwise) has the TCP
/// connection from `pod_end` (`address:port`) in `state` (conntrack's
/// name); returns its line.
///
/// # Panics
/// When it does not within a few seconds, with the table.
pub fn await_node_state(datapath: Datapath, pod_end: &str, state: &str) -> String {
    let (pod_addr, pod_port) = pod_end.split_once(':').expect("address:port");
    let conntrack = datapath == Datapath::Iptables;
    let agent = agent_binary();
    let args: Vec<&str> = if conntrack {
        vec!["conntrack", "-L", "-p", "tcp"]
    } else {
        vec![agent.to_str().expect("a UTF-8 path"), "nat"]
    };
    let of_the_pod = |line: &str| {
        if conntrack {
            line.contains(&format!("src={pod_addr} "))
                && line.contains(&format!("sport={pod_port} "))
        } else {
            line.starts_with("tcp") && line.contains(&format!(" {pod_end} "))
        }
    };
    let in_state = |line: &str| {
        if conntrack {
            line.contains(&format!(" {state} "))
        } else {
            line.contains(&format!(" {} ", state.to_lowercase()))
        }
    };
    let deadline = Instant::now() + IO_TIMEOUT;
    loop {
        let table = exec_ok(addrs::NS_NODE, &args).expect("listing the node's table");
        match table.lines().find(|line| of_the_pod(line)) {
            Some(line) if in_state(line) => return line.to_owned(),
            line if Instant::now() > deadline => {
                panic!("the pod's connection is not {state}: {line:?} in\n{table}")
            }
            _ => thread::sleep(Duration::from_millis(100)),
        }
    }
}
