//! Floods of TCP SYNs nobody completes, written as raw IP packets from a
//! namespace (the way a SYN flood or a client retrying a black-holed
//! endpoint looks to the node), and the NAT table's occupancy meanwhile.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    ops::Range,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use vpcnet_agent::datapath::DatapathMaps;
use vpcnet_common::maps;
use vpcnet_lab::run_in;

use crate::packets::{self, TCP_SYN};

/// Bytes of the Ethernet header `packets` builds in front of the IP packet.
const ETHERNET_HEADER: usize = 14;

/// A raw IPv4 socket (`IPPROTO_RAW`: the packets carry their own header)
/// in one namespace.
pub struct RawSender {
    socket: OwnedFd,
}

impl RawSender {
    /// Opens the socket in namespace `ns`; it keeps sending from there
    /// whichever thread uses it.
    pub fn open(ns: &str) -> Result<Self> {
        let socket = run_in(ns, || {
            // SAFETY: plain arguments; the result is checked.
            let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: a descriptor just opened, owned by nobody else.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        })?
        .with_context(|| format!("a raw socket in {ns}"))?;
        Ok(Self { socket })
    }

    /// Sends a SYN from `source` to `destination`.
    pub fn syn(&self, source: SocketAddrV4, destination: SocketAddrV4) -> Result<()> {
        let frame = packets::tcp(
            *source.ip(),
            source.port(),
            *destination.ip(),
            destination.port(),
            TCP_SYN,
            b"",
        );
        let packet = &frame[ETHERNET_HEADER..];
        let to = libc::sockaddr_in {
            sin_family: libc::sa_family_t::try_from(libc::AF_INET).expect("AF_INET fits"),
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from_ne_bytes(destination.ip().octets()),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: the buffer and the address live across the call, their
        // lengths are passed along.
        let sent = unsafe {
            libc::sendto(
                self.socket.as_raw_fd(),
                packet.as_ptr().cast(),
                packet.len(),
                0,
                (&raw const to).cast(),
                u32::try_from(size_of::<libc::sockaddr_in>()).expect("a small struct"),
            )
        };
        if sent < 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("sending a SYN {source} -> {destination}"));
        }
        Ok(())
    }
}

/// Makes on-prem drop what answers a flood: TCP from `answered_port` to
/// `flood_ports` (the flood's source ports). A flood's sources never
/// complete a handshake, as spoofed ones would not.
///
/// # Errors
/// The rule could not be written.
pub fn drop_answers_on_prem(answered_port: u16, flood_ports: Range<u16>) -> Result<()> {
    let ports = format!("{}:{}", flood_ports.start, flood_ports.end);
    vpcnet_lab::exec_ok(
        vpcnet_lab::addrs::NS_ONPREM,
        &[
            "iptables",
            "-A",
            "INPUT",
            "-p",
            "tcp",
            "--sport",
            &answered_port.to_string(),
            "--dport",
            &ports,
            "-j",
            "DROP",
        ],
    )?;
    Ok(())
}

/// What a flood did to the table it watched.
#[derive(Clone, Copy, Debug, Default)]
pub struct FloodReport {
    pub sent: usize,
    pub elapsed: Duration,
    /// The most entries the table held at one sample (every 100 SYNs).
    pub max_flows: usize,
}

/// Sends a SYN from `source_addr` with each source port of `ports` to
/// `destination` through `sender`, at most `per_second` of them (`None`:
/// as fast as they go), sampling the lab agent's NAT table as it goes.
pub fn syn_flood(
    sender: &RawSender,
    source_addr: Ipv4Addr,
    ports: Range<u16>,
    destination: SocketAddrV4,
    per_second: Option<u32>,
) -> Result<FloodReport> {
    syn_flood_watching(
        sender,
        source_addr,
        ports,
        destination,
        per_second,
        nat_flows,
    )
}

/// [`syn_flood`] sampling the table `entries` counts (none: the iptables
/// reference's node has no vpcnet table).
pub fn syn_flood_watching(
    sender: &RawSender,
    source_addr: Ipv4Addr,
    ports: Range<u16>,
    destination: SocketAddrV4,
    per_second: Option<u32>,
    entries: fn() -> Result<usize>,
) -> Result<FloodReport> {
    let started = Instant::now();
    let mut report = FloodReport::default();
    let rate = per_second.map(|rate| Duration::from_secs(1) / rate);
    for (sent, port) in (0_u32..).zip(ports) {
        if sent % 100 == 0 {
            report.max_flows = report.max_flows.max(entries()?);
        }
        if let Some(interval) = rate {
            // Pacing, not synchronisation: the flood's own rate.
            std::thread::sleep((interval * sent).saturating_sub(started.elapsed()));
        }
        sender.syn(SocketAddrV4::new(source_addr, port), destination)?;
        report.sent += 1;
    }
    report.max_flows = report.max_flows.max(entries()?);
    report.elapsed = started.elapsed();
    Ok(report)
}

/// A flood that goes on while something else happens.
pub struct OngoingFlood {
    pub source_addr: Ipv4Addr,
    /// Source ports it cycles through: a range wider than the table, so
    /// each port's earlier flow is gone when it comes round again.
    pub ports: Range<u16>,
    pub destination: SocketAddrV4,
    pub per_second: u32,
    /// The longest it lasts if nothing stops it.
    pub longest: Duration,
}

/// Runs `work` while `flood`'s SYNs go out through `sender` from another
/// thread, and stops the flood when `work` returns (or panics). `work`
/// gets a function that waits until `every` more SYNs have been sent,
/// so that each of its steps happens in the flood.
///
/// # Errors
/// A SYN could not be sent.
///
/// # Panics
/// When the flood sends no `every` SYNs within `flood.longest`.
pub fn while_flooding(
    sender: &RawSender,
    flood: &OngoingFlood,
    every: usize,
    work: impl FnOnce(&dyn Fn()),
) -> Result<FloodReport> {
    let stop = AtomicBool::new(false);
    let (progress, more_sent) = mpsc::channel();
    std::thread::scope(|scope| {
        let flooding = scope.spawn(|| {
            syn_flood_until(sender, flood, &stop, |sent| {
                if sent % every == 0 {
                    // The receiver is gone once `work` has returned.
                    let _ = progress.send(());
                }
            })
        });
        let stop_flood = StopOnDrop(&stop);
        work(&|| {
            more_sent
                .recv_timeout(flood.longest)
                .expect("the flood sent no more SYNs");
        });
        drop(stop_flood);
        flooding.join().expect("the flood's thread")
    })
}

/// Sends `flood`'s SYNs through `sender` until `stop` is set or
/// `flood.longest` has passed, calling `sent` with the count after each.
/// Whether it was stopped, not timed out, is `elapsed < longest`.
fn syn_flood_until(
    sender: &RawSender,
    flood: &OngoingFlood,
    stop: &AtomicBool,
    sent: impl Fn(usize),
) -> Result<FloodReport> {
    let started = Instant::now();
    let mut report = FloodReport::default();
    let interval = Duration::from_secs(1) / flood.per_second;
    for (count, port) in (0_u32..).zip(flood.ports.clone().cycle()) {
        if stop.load(Ordering::Relaxed) || started.elapsed() >= flood.longest {
            break;
        }
        // Pacing, not synchronisation: the flood's own rate.
        std::thread::sleep((interval * count).saturating_sub(started.elapsed()));
        sender.syn(
            SocketAddrV4::new(flood.source_addr, port),
            flood.destination,
        )?;
        report.sent += 1;
        sent(report.sent);
    }
    report.elapsed = started.elapsed();
    Ok(report)
}

/// Sets its flag when dropped: stops a flood however its work ends.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// How many flows the lab agent's NAT table holds now (forward entries).
pub fn nat_flows() -> Result<usize> {
    let maps = DatapathMaps::open_pinned(Path::new(maps::PIN_DIR))?;
    Ok(maps.nat_fwd.keys().flatten().count())
}

/// How many entries the lab agent's stack flows map holds now (two per
/// flow: one keyed by each direction's tuple).
pub fn stack_flow_entries() -> Result<usize> {
    let maps = DatapathMaps::open_pinned(Path::new(maps::PIN_DIR))?;
    Ok(maps.stack_flows.keys().flatten().count())
}

/// The lab agent's stack flow entries, one line each (tuple, kind, the
/// `SEEN_*` bits, time since its last packet), for a failure's message.
pub fn stack_flow_lines() -> Result<Vec<String>> {
    let maps = DatapathMaps::open_pinned(Path::new(maps::PIN_DIR))?;
    let now = vpcnet_agent::datapath::monotonic_now_ns();
    let addr = |raw: u32| std::net::Ipv4Addr::from(raw.to_ne_bytes());
    Ok(maps
        .stack_flows
        .iter()
        .flatten()
        .map(|(k, e)| {
            format!(
                "{}:{} -> {}:{} proto {} kind {} seen {:#04x} idle {:.1?}",
                addr(k.saddr),
                u16::from_be(k.sport),
                addr(k.daddr),
                u16::from_be(k.dport),
                k.proto,
                e.kind,
                e.seen,
                std::time::Duration::from_nanos(now.saturating_sub(e.last_seen_ns)),
            )
        })
        .collect())
}

/// Waits until the lab agent's datapath uses `timeouts` (it reads the
/// node's conntrack settings on every garbage collection).
pub fn wait_for_timeouts(timeouts: &vpcnet_common::nat::Timeouts, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let maps = DatapathMaps::open_pinned(Path::new(maps::PIN_DIR))?;
        let now = maps.timeouts()?;
        if now == *timeouts {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the datapath's timeouts are still {now:?} after {within:?}, not {timeouts:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
