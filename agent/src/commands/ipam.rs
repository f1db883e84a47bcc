//! `vpcnet-agent ipam`: the address manager's pool, counters and recent
//! events, asked of the running agent on its CNI socket.

use std::path::Path;

use anyhow::{Context, Result};

pub fn print_ipam(socket: &Path) -> Result<()> {
    let runtime = super::runtime()?;
    let status = runtime.block_on(async {
        let mut client = vpcnet_api::connect_cni(socket).await.with_context(|| {
            format!(
                "is the agent running with --ipam? no answer on {}",
                socket.display()
            )
        })?;
        anyhow::Ok(
            client
                .ipam_status(vpcnet_api::cni::IpamStatusRequest {})
                .await?
                .into_inner(),
        )
    })?;
    println!(
        "addresses {} ({} assigned), prefixes {}, ENIs {}/{}, max pods {}{}",
        status.total_addrs,
        status.assigned_addrs,
        status.total_prefixes,
        status.enis,
        status.max_enis,
        status.max_pods,
        if status.prefix_fallback {
            ", prefix delegation fell back to addresses"
        } else {
            ""
        }
    );
    let mut counters: Vec<_> = status.counters.into_iter().collect();
    counters.sort();
    for (name, value) in counters {
        println!("{name:<44} {value:>10}");
    }
    for event in status.events {
        println!("event {} {}: {}", event.time, event.reason, event.message);
    }
    Ok(())
}
