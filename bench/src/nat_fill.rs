//! A NAT table filled with established SNAT flows, written straight into
//! the lab agent's pinned maps (as the datapath writes them: the claim,
//! then the forward entry), and the agent's garbage collector's figures
//! from its introspection endpoint in the node.

use std::{
    net::Ipv4Addr,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use vpcnet_agent::{
    datapath::{DatapathMaps, monotonic_now_ns},
    introspect::{self, ListenAddr, views::CollectorView},
};
use vpcnet_common::{
    addr_to_raw, maps,
    nat::{FlowKey, FlowKind, FlowState, NatEntry, PROTO_TCP, reply_key},
    port_to_raw,
};
use vpcnet_lab::addrs::{NODE_PRIMARY_ADDR, NS_NODE};

/// Where the lab agent serves introspection, in the node.
const INTROSPECTION: &str = "127.0.0.1:61679";
/// How long the collector may take to make its passes over a full table.
const PASSES_TIMEOUT: Duration = Duration::from_mins(2);

/// Writes `flows` established TCP flows from made-up pods (100.64.0.0/16,
/// never the lab's) to made-up remotes in 203.0.113.0/24, each translated
/// to a port of its own toward its remote.
pub fn fill(flows: u32) -> Result<()> {
    let mut table = DatapathMaps::open_pinned(Path::new(maps::PIN_DIR))?;
    let now = monotonic_now_ns();
    let node = addr_to_raw(NODE_PRIMARY_ADDR.octets());
    let seen = FlowState::Established.halves(PROTO_TCP).0.seen;
    for i in 0..flows {
        let [_, b, c, d] = i.to_be_bytes();
        let pod = addr_to_raw(Ipv4Addr::new(100, 64, b, c).octets());
        let remote = addr_to_raw(Ipv4Addr::new(203, 0, 113, d).octets());
        // Ports from 2048, one per flow toward each remote.
        let port = port_to_raw(2048 + u16::from(b) * 256 + u16::from(c));
        let key = FlowKey::new(pod, remote, port, port_to_raw(443), PROTO_TCP);
        let fwd = NatEntry {
            addr: node,
            port,
            kind: FlowKind::Snat as u8,
            seen,
            last_seen_ns: now,
            created_ns: now,
            ..NatEntry::default()
        };
        let claim = NatEntry {
            addr: pod,
            port,
            ..fwd
        };
        table
            .nat_rev
            .insert(reply_key(&key, node, port), claim, 0)
            .context("writing a claim")?;
        table
            .nat_fwd
            .insert(key, fwd, 0)
            .context("writing a forward entry")?;
    }
    Ok(())
}

/// The lab agent's collector figures now.
pub fn collector() -> Result<CollectorView> {
    let addr: ListenAddr = INTROSPECTION
        .parse()
        .map_err(|e| anyhow::anyhow!("the introspection address: {e}"))?;
    let (status, body) = vpcnet_lab::run_in(NS_NODE, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("a runtime")?
            .block_on(introspect::get(&addr, "/v1/nat/summary"))
            .context("GET /v1/nat/summary")
    })??;
    if !status.is_success() {
        bail!(
            "/v1/nat/summary answered {status}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    let summary: introspect::views::NatSummaryView =
        serde_json::from_slice(&body).context("the summary's JSON")?;
    Ok(summary.collector)
}

/// Waits until the collector has made `passes` passes.
pub fn wait_passes(passes: u64) -> Result<()> {
    let deadline = Instant::now() + PASSES_TIMEOUT;
    loop {
        let now = collector()?;
        if now.passes >= passes {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "the collector made {} passes in {PASSES_TIMEOUT:?}, {passes} wanted",
                now.passes
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
