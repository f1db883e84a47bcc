//! `vpcnet-agent settings`: the environment read as `run` reads it, the
//! settings in force printed by variable.

use anyhow::Result;
use vpcnet_agent::{env::Env, settings::Settings};

/// `vpcnet-agent settings`.
pub fn print_settings(env: &Env, ipam: bool) -> Result<()> {
    let settings = Settings::read(env, ipam, None, None)?;
    println!("{}", serde_json::to_string_pretty(&settings.view(env)?)?);
    Ok(())
}
