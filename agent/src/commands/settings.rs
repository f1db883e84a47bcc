//! `vpcnet-agent settings`: the environment read as `run` reads it, the
//! settings in force printed by variable; refused as `run` refuses them,
//! the node's iptables rules' marks included.

use anyhow::Result;
use vpcnet_agent::{env::Env, settings::Settings, takeover::iptables::node_mark_uses};

/// `vpcnet-agent settings`.
pub fn print_settings(env: &Env, ipam: bool) -> Result<()> {
    let settings = Settings::read(env, ipam, None, None)?;
    println!("{}", serde_json::to_string_pretty(&settings.view(env)?)?);
    settings.snat.check_node_marks(&node_mark_uses())?;
    Ok(())
}
