//! What the four programs should do with a packet, written again in plain
//! user-space Rust from the design, not from the programs' code: its own
//! header parsing, its own prefix match, checksums recomputed over whole
//! regions rather than patched field by field, the flow tables as plain
//! hash maps, network policy judged from the rules' own form rather than
//! the tries they are compiled into. The fuzz test runs both on every
//! packet and compares.
//!
//! One module per program (`eni_egress`, `eni_ingress`, `pod`) and per
//! unit they share (`forward`, `frag`, `stack`, `policy`), over the
//! model's own parsing (`headers`) and rewriting (`rewrite`).
//!
//! The model predicts everything but one choice: the port a new translated
//! flow gets, which is random by design. It reads that port from the
//! program's output and checks it instead (in the configured range, free
//! for the remote endpoint, the pod's or node socket's own when that one
//! was free and is to be tried first).

mod eni_egress;
mod eni_ingress;
mod forward;
mod frag;
mod headers;
mod lifetime;
mod pod;
mod policy;
mod rewrite;
mod stack;
mod tables;

use std::collections::{BTreeMap, HashMap};

use vpcnet_agent::policy::rules::PodRules;
use vpcnet_common::{
    cidr::CidrKind,
    config::Config,
    counters::Counter,
    endpoint::{Endpoint, Eni},
    nat::{
        FRAG_VIA_PASS, FlowKey, FlowKind, RecentFlows, SEEN_ANY, TCP_ACK_KNOWN, TCP_END_KNOWN,
        TCP_OWES_FIN_ACK, TCP_ZERO_WINDOW, Timeouts,
    },
};

pub use self::{
    lifetime::Collected,
    policy::{Connection, End, PolicyTrack, show_end},
};
use super::Program;
use crate::{
    TC_ACT_SHOT, TC_ACT_UNSPEC,
    packets::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
};

const ETH_P_IP: u16 = 0x0800;
const IP: usize = 14;

/// A moment on the model's clock: whole seconds (`tick`), and within a
/// second the packet's number (`seq`), which orders what happened in it.
/// The fuzz's clock keeps the entries' real times so that a program's
/// comparison of two times comes out as the model's of the whole seconds
/// (see `fuzz::clock`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Stamp {
    pub tick: u64,
    pub seq: u64,
}

impl Stamp {
    /// Whole seconds from `earlier` to `self`.
    pub fn seconds_since(self, earlier: Self) -> u64 {
        self.tick.saturating_sub(earlier.tick)
    }
}

/// One half of a flow: its behaviour, and its two times.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Half {
    pub addr: u32,
    pub port: u16,
    pub kind: u8,
    pub seen: u8,
    /// TCP: the sequence number after what this direction sent, the
    /// highest acknowledgement it sent, the `TCP_*` bits, and segments in
    /// a row sent again.
    pub seq_end: u32,
    pub ack: u32,
    pub tcp: u8,
    pub retrans: u8,
    /// When this direction's last packet was recorded (a packet within a
    /// second of the one before and changing no flag leaves it as it was)
    /// and when the flow began.
    pub last: Stamp,
    pub created: Stamp,
}

impl Half {
    fn new(addr: u32, port: u16, kind: FlowKind, now: Stamp) -> Self {
        Self {
            addr,
            port,
            kind: kind as u8,
            last: now,
            created: now,
            ..Self::default()
        }
    }

    /// The half without its times, which the clock checks on its own.
    #[must_use]
    pub fn behaviour(self) -> Self {
        Self {
            last: Stamp::default(),
            created: Stamp::default(),
            ..self
        }
    }

    /// The packet `l4` sent in this half's direction at `now`.
    fn record(&mut self, l4: Ports, now: Stamp) {
        let seen = self.seen | l4.seen();
        if seen != self.seen || now.seconds_since(self.last) >= 1 {
            self.last = now;
        }
        self.seen = seen;
        if !l4.is_tcp {
            return;
        }
        let later = |a: u32, b: u32| (1..1 << 31).contains(&a.wrapping_sub(b));
        if self.tcp & TCP_END_KNOWN == 0 || later(l4.seq_end, self.seq_end) {
            self.seq_end = l4.seq_end;
            self.tcp |= TCP_END_KNOWN;
            self.retrans = 0;
        } else if l4.carries_seq {
            self.retrans = self.retrans.saturating_add(1);
        }
        if l4.flags & TCP_ACK != 0 {
            if self.tcp & TCP_ACK_KNOWN == 0 || later(l4.ack, self.ack) {
                self.ack = l4.ack;
            }
            self.tcp = (self.tcp | TCP_ACK_KNOWN) & !TCP_OWES_FIN_ACK;
        }
        if l4.flags & TCP_RST == 0 {
            self.tcp = if l4.zero_window {
                self.tcp | TCP_ZERO_WINDOW
            } else {
                self.tcp & !TCP_ZERO_WINDOW
            };
        }
    }

    /// The half of a connection that starts afresh on its tuple at `now`:
    /// nothing seen, its numbers forgotten (`l4`: the packet that starts
    /// it, in this half's direction).
    fn restart(&mut self, l4: Option<Ports>, now: Stamp) {
        self.seen = 0;
        self.seq_end = 0;
        self.ack = 0;
        self.tcp = 0;
        self.retrans = 0;
        self.last = now;
        self.created = now;
        if let Some(l4) = l4 {
            self.record(l4, now);
        }
    }
}

/// A datagram as a program saw it arrive: addresses, IP id, protocol, and
/// which program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Datagram {
    pub saddr: u32,
    pub daddr: u32,
    pub id: u16,
    pub proto: u8,
    pub hook: u8,
}

/// Where a first fragment went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FirstWent {
    pub addr: u32,
    pub ifindex: u32,
    pub via: u8,
}

/// The node as the programs are configured for it.
#[derive(Clone, Debug)]
pub struct World {
    pub config: Config,
    /// Prefixes (network order address, length) and what they are.
    pub prefixes: Vec<(u32, u8, CidrKind)>,
    pub endpoints: HashMap<u32, Endpoint>,
    pub enis: HashMap<u32, Eni>,
    /// The link `BPF_PROG_TEST_RUN`'s packets arrive on.
    pub ifindex: u32,
    /// The rules of the local pods policy judges (by address, network
    /// order), when the configuration turns policy on.
    pub policy: BTreeMap<u32, PodRules>,
    /// The flow timeouts the programs are given.
    pub timeouts: Timeouts,
    /// Entries each NAT map holds, and the stack flows map.
    pub nat_capacity: usize,
    pub stack_capacity: usize,
}

impl World {
    fn prefix_kind(&self, addr: u32) -> Option<CidrKind> {
        let host = u32::from_be(addr);
        self.prefixes
            .iter()
            .filter(|(net, len, _)| {
                let mask = if *len == 0 { 0 } else { u32::MAX << (32 - len) };
                host & mask == u32::from_be(*net) & mask
            })
            .max_by_key(|(_, len, _)| *len)
            .map(|(_, _, kind)| *kind)
    }

    fn port_range(&self) -> (u16, u16) {
        let c = &self.config;
        if c.port_min != 0 && c.port_min <= c.port_max {
            (c.port_min, c.port_max)
        } else {
            (1024, 65535)
        }
    }
}

/// Every table the programs keep, as the model keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tables {
    pub nat_fwd: HashMap<FlowKey, Half>,
    pub nat_rev: HashMap<FlowKey, Half>,
    pub stack: HashMap<FlowKey, Half>,
    pub frags: HashMap<Datagram, FirstWent>,
    /// The connections policy let through: the end that opened each, and
    /// when it was last refreshed.
    pub policy_flows: HashMap<Connection, PolicyTrack>,
    /// The NAT flows' claims and the stack flows' pod-side tuples, in the
    /// order they were made, for a full table's early drop.
    pub recent: RecentFlows,
    pub recent_stack: RecentFlows,
}

impl Default for Tables {
    fn default() -> Self {
        Self {
            nat_fwd: HashMap::new(),
            nat_rev: HashMap::new(),
            stack: HashMap::new(),
            frags: HashMap::new(),
            policy_flows: HashMap::new(),
            recent: RecentFlows::EMPTY,
            recent_stack: RecentFlows::EMPTY,
        }
    }
}

/// What a program should have done with one packet.
#[derive(Debug)]
pub struct Expected {
    pub action: i32,
    pub packet: Vec<u8>,
    pub mark: u32,
    /// Offsets of the checksums the programs patch: ones' complement sums,
    /// where `0x0000` and `0xffff` are the same value (UDP's aside, whose
    /// zero means "none").
    pub checksums: Vec<usize>,
    /// The packet's verdict counter and any other counter it moves.
    pub counted: Vec<Counter>,
    /// A port the program chose that breaks a rule.
    pub bad_choice: Option<String>,
}

/// The model: the node and its tables.
pub struct Model {
    pub world: World,
    pub tables: Tables,
    /// Flows made, in order, for the generator to continue (may name
    /// flows that are gone): each as its replies arrive (a claim's key, an
    /// inbound flow's remote side) and as its opener sends (the forward
    /// key).
    pub answerable: Vec<FlowKey>,
    pub ongoing: Vec<FlowKey>,
    /// The model's clock: the packet being run, in the current second.
    pub now: Stamp,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Frag {
    Whole,
    First,
    Later,
}

#[derive(Clone, Copy)]
struct Ip {
    off: usize,
    saddr: u32,
    daddr: u32,
    proto: u8,
    id: u16,
    frag: Frag,
    l4: usize,
    /// Bytes from the L4 header to the datagram's end.
    l4_len: usize,
}

#[derive(Clone, Copy)]
struct Ports {
    sport: u16,
    dport: u16,
    flags: u8,
    icmp_type: u8,
    /// TCP: the segment, as its direction's half tracks it.
    is_tcp: bool,
    carries_seq: bool,
    zero_window: bool,
    seq_end: u32,
    ack: u32,
}

impl Ports {
    const NONE: Self = Self::of(0, 0, 0);

    const fn of(sport: u16, dport: u16, icmp_type: u8) -> Self {
        Self {
            sport,
            dport,
            flags: 0,
            icmp_type,
            is_tcp: false,
            carries_seq: false,
            zero_window: false,
            seq_end: 0,
            ack: 0,
        }
    }

    fn seen(self) -> u8 {
        (self.flags & (TCP_FIN | TCP_SYN | TCP_RST | TCP_ACK)) | SEEN_ANY
    }

    fn syn_only(self) -> bool {
        self.flags & (TCP_FIN | TCP_SYN | TCP_RST | TCP_ACK) == TCP_SYN
    }
}

/// What a program decided.
#[derive(Clone, Copy)]
struct Out {
    counter: Counter,
    action: i32,
    via: u8,
    ifindex: u32,
}

impl Out {
    fn pass(counter: Counter) -> Self {
        Self {
            counter,
            action: TC_ACT_UNSPEC,
            via: FRAG_VIA_PASS,
            ifindex: 0,
        }
    }
}

type Decided = Result<Out, Counter>;

/// One packet through the model: the frame as it is rewritten, the mark,
/// the counters moved.
struct Run<'a> {
    p: Vec<u8>,
    mark: u32,
    checksums: Vec<usize>,
    counted: Vec<Counter>,
    /// The program's output, to read the port it chose.
    actual: &'a [u8],
    bad_choice: Option<String>,
}

impl Model {
    pub fn new(world: World) -> Self {
        Self {
            world,
            tables: Tables::default(),
            answerable: Vec::new(),
            ongoing: Vec::new(),
            now: Stamp::default(),
        }
    }

    /// Runs `program` on `packet`, the packet numbered `seq` of the
    /// current second, arriving with skb mark `mark`; `actual` is what the
    /// real program left, read only for a port it chose.
    pub fn run(
        &mut self,
        program: Program,
        packet: &[u8],
        mark: u32,
        actual: &[u8],
        seq: u64,
    ) -> Expected {
        self.now.seq = seq;
        let mut run = Run {
            p: packet.to_vec(),
            mark,
            checksums: Vec::new(),
            counted: Vec::new(),
            actual,
            bad_choice: None,
        };
        let decided = match program {
            Program::EniEgress => self.eni_egress(&mut run),
            Program::EniIngress => self.eni_ingress(&mut run),
            Program::PodEgress => self.pod_egress(&mut run),
            Program::PodIngress => self.pod_ingress(&mut run),
        };
        let action = match decided {
            Ok(out) => {
                run.count(out.counter);
                out.action
            }
            Err(reason) => {
                run.count(reason);
                TC_ACT_SHOT
            }
        };
        Expected {
            action,
            packet: run.p,
            mark: run.mark,
            checksums: run.checksums,
            counted: run.counted,
            bad_choice: run.bad_choice,
        }
    }

    fn configured(&self) -> bool {
        self.world.config.node_addr != 0
    }

    fn ipv4(p: &[u8]) -> bool {
        p.len() >= 14 && u16::from_be_bytes([p[12], p[13]]) == ETH_P_IP
    }
}
