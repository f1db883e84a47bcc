//! `ENABLE_POLICY_EVENT_LOGS`: policy's verdicts, read from the programs'
//! ring buffer, written as aws-node's node agent writes them: one JSON line
//! each (its logger's `level`, `ts`, `msg`), `Flow Info: Src IP: ... Verdict
//! DENY Direction ingress, Tier NETWORK_POLICY`, DENY at info and ACCEPT at
//! debug, into `/var/log/aws-routed-eni/network-policy-agent.log`. The file
//! is bounded: past its size it moves to `.1` and starts again.

use std::{
    fs,
    io::{self, Write},
    net::Ipv4Addr,
    path::{Path, PathBuf},
};

use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;
use tracing::warn;
use vpcnet_common::{
    nat::{PROTO_ICMP, PROTO_TCP, PROTO_UDP},
    policy::{
        DIRECTION_EGRESS, PolicyEvent, TIER_ADMIN, TIER_BASELINE, TIER_DEFAULT, VERDICT_DENY,
    },
    raw_to_addr, raw_to_port,
};

/// How large the log grows before it moves aside.
const MAX_BYTES: u64 = 100 * 1024 * 1024;

/// Where and how much the event log says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventLog {
    pub path: PathBuf,
    /// ACCEPT lines too (the level is debug), not only DENY.
    pub accepts: bool,
}

/// The line for `event` at time `ts`; `None` for an ACCEPT the level
/// leaves out.
#[must_use]
pub fn line(event: &PolicyEvent, accepts: bool, ts: jiff::Timestamp) -> Option<String> {
    let deny = event.verdict == VERDICT_DENY;
    if !deny && !accepts {
        return None;
    }
    let proto = match event.proto {
        PROTO_TCP => "TCP",
        PROTO_UDP => "UDP",
        132 => "SCTP",
        PROTO_ICMP => "ICMP",
        _ => "UNKNOWN",
    };
    let msg = format!(
        "Flow Info: Src IP: {} Src Port: {} Dest IP: {} Dest Port: {} Proto {proto} Verdict {} Direction {}, Tier {}",
        Ipv4Addr::from(raw_to_addr(event.saddr)),
        raw_to_port(event.sport),
        Ipv4Addr::from(raw_to_addr(event.daddr)),
        raw_to_port(event.dport),
        if deny { "DENY" } else { "ACCEPT" },
        if event.direction == DIRECTION_EGRESS {
            "egress"
        } else {
            "ingress"
        },
        tier_name(event.tier),
    );
    let record = serde_json::json!({
        "level": if deny { "info" } else { "debug" },
        "ts": format!("{ts:.3}"),
        "logger": "vpcnet-agent.policy",
        "msg": msg,
    });
    Some(record.to_string())
}

/// A tier as aws-node's agent names it in its lines.
fn tier_name(tier: u8) -> &'static str {
    match tier {
        TIER_DEFAULT => "DEFAULT",
        TIER_ADMIN => "ADMIN",
        TIER_BASELINE => "BASELINE",
        _ => "NETWORK_POLICY",
    }
}

/// Appends to the log, moving it aside past [`MAX_BYTES`].
struct Writer {
    path: PathBuf,
    file: fs::File,
    written: u64,
}

impl Writer {
    fn open(path: &Path) -> io::Result<Self> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir)?;
        }
        let file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        let written = file.metadata()?.len();
        Ok(Self {
            path: path.to_owned(),
            file,
            written,
        })
    }

    fn write_line(&mut self, line: &str) -> io::Result<()> {
        if self.written > MAX_BYTES {
            let mut aside = self.path.clone().into_os_string();
            aside.push(".1");
            fs::rename(&self.path, aside)?;
            *self = Self::open(&self.path)?;
        }
        self.file.write_all(line.as_bytes())?;
        self.file.write_all(b"\n")?;
        self.written += line.len() as u64 + 1;
        Ok(())
    }
}

/// Writes every event of `ring` into the log, as they come, until the
/// task is dropped.
pub async fn write_events(ring: RingBuf<MapData>, log: EventLog) {
    let mut writer = match Writer::open(&log.path) {
        Ok(writer) => writer,
        Err(error) => {
            warn!(path = %log.path.display(), %error, "the policy event log cannot be written: no events are logged");
            return;
        }
    };
    // SAFETY: the ring buffer owns its descriptor and keeps it open for as
    // long as the `AsyncFd` holds it.
    let mut ring = match unsafe { AsyncFd::register(ring) } {
        Ok(ring) => ring,
        Err(error) => {
            warn!(error = %io::Error::from(error), "polling the policy event ring buffer");
            return;
        }
    };
    let mut failing = false;
    loop {
        let Ok(mut ready) = ring.readable_mut().await else {
            return;
        };
        let ring = ready.get_inner_mut();
        while let Some(item) = ring.next() {
            let Some(event) = read_event(&item) else {
                continue;
            };
            let Some(line) = line(&event, log.accepts, jiff::Timestamp::now()) else {
                continue;
            };
            match writer.write_line(&line) {
                Ok(()) => failing = false,
                Err(error) if !failing => {
                    failing = true;
                    warn!(path = %log.path.display(), %error, "writing the policy event log");
                }
                Err(_) => {}
            }
        }
        ready.clear_ready();
    }
}

fn read_event(bytes: &[u8]) -> Option<PolicyEvent> {
    if bytes.len() < std::mem::size_of::<PolicyEvent>() {
        return None;
    }
    // SAFETY: `PolicyEvent` is plain data of this size; the ring buffer's
    // records are 8-byte aligned, but the read makes no assumption.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<PolicyEvent>()) })
}

#[cfg(test)]
mod tests {
    use vpcnet_common::{
        addr_to_raw,
        policy::{DIRECTION_INGRESS, TIER_NETWORK_POLICY, VERDICT_ACCEPT},
        port_to_raw,
    };

    use super::*;

    #[test]
    fn lines_as_aws_nodes_agent_writes_them() {
        let event = PolicyEvent {
            saddr: addr_to_raw([10, 0, 1, 23]),
            daddr: addr_to_raw([10, 0, 2, 45]),
            sport: port_to_raw(43512),
            dport: port_to_raw(8080),
            proto: PROTO_TCP,
            verdict: VERDICT_DENY,
            direction: DIRECTION_INGRESS,
            tier: TIER_NETWORK_POLICY,
        };
        let ts: jiff::Timestamp = "2026-11-27T10:00:00.123456Z".parse().unwrap();
        let deny: serde_json::Value =
            serde_json::from_str(&line(&event, false, ts).unwrap()).unwrap();
        assert_eq!(deny["level"], "info");
        assert_eq!(deny["ts"], "2026-11-27T10:00:00.123Z");
        assert_eq!(
            deny["msg"],
            "Flow Info: Src IP: 10.0.1.23 Src Port: 43512 Dest IP: 10.0.2.45 Dest Port: 8080 Proto TCP Verdict DENY Direction ingress, Tier NETWORK_POLICY"
        );
        let accept = PolicyEvent {
            verdict: VERDICT_ACCEPT,
            direction: DIRECTION_EGRESS,
            tier: TIER_DEFAULT,
            proto: PROTO_UDP,
            ..event
        };
        assert_eq!(line(&accept, false, ts), None, "ACCEPT is debug");
        let accept: serde_json::Value =
            serde_json::from_str(&line(&accept, true, ts).unwrap()).unwrap();
        assert_eq!(accept["level"], "debug");
        assert!(
            accept["msg"]
                .as_str()
                .unwrap()
                .ends_with("Proto UDP Verdict ACCEPT Direction egress, Tier DEFAULT")
        );
        let admin = PolicyEvent {
            tier: TIER_ADMIN,
            ..event
        };
        assert!(
            line(&admin, false, ts)
                .unwrap()
                .contains("Verdict DENY Direction ingress, Tier ADMIN")
        );
    }

    #[test]
    fn the_log_moves_aside_past_its_size() {
        let dir = std::env::temp_dir().join(format!("vpcnet-events-{}", std::process::id()));
        let path = dir.join("network-policy-agent.log");
        let mut writer = Writer::open(&path).unwrap();
        writer.written = MAX_BYTES + 1;
        writer.write_line("after").unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "after\n");
        assert!(dir.join("network-policy-agent.log.1").exists());
        fs::remove_dir_all(&dir).unwrap();
    }
}
