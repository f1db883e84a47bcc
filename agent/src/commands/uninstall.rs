//! `vpcnet-agent uninstall`: the node handed back to aws-node, with the
//! agent stopped.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use vpcnet_agent::{
    cloud::{Cloud, CloudOptions},
    datapath,
    env::Env,
    ipam::settings::{DEFAULT_BACKING_STORE, ENV_BACKING_STORE},
    netlink::{MacAddr, NetlinkHandle},
    pods,
    snat::SnatSettings,
    takeover,
};

pub fn uninstall(
    pin_dir: &Path,
    cni_conf_dir: Option<PathBuf>,
    cni_socket: &Path,
    network_policy_pins: &Path,
    env: &Env,
) -> Result<()> {
    if std::os::unix::net::UnixStream::connect(cni_socket).is_ok() {
        bail!(
            "the agent is running (it answers on {}): stop it first (delete vpcnet's DaemonSet); its programs stay attached until this command detaches them",
            cni_socket.display()
        );
    }
    let snat = SnatSettings::from_env(env)?;
    let cloud_opts = CloudOptions::from_env(env);
    let opts = takeover::HandBackOptions {
        pin_dir: pin_dir.to_owned(),
        checkpoint: PathBuf::from(env.get(ENV_BACKING_STORE).unwrap_or(DEFAULT_BACKING_STORE)),
        cni_conf_dir,
        connmark: snat.connmark,
        veth_prefix: pods::veth_prefix(env)?,
        network_policy_pins: network_policy_pins.to_owned(),
    };
    if !datapath::pins::datapath_pinned(pin_dir) {
        // Done before, or the node rebooted since: only the conflists.
        println!(
            "no vpcnet datapath is pinned in {}: no rules to write back",
            pin_dir.display()
        );
        if let Some(dir) = &opts.cni_conf_dir
            && takeover::hand_back_conflist(dir)?
        {
            println!("aws-node's conflist {} restored", takeover::AWS_CONFLIST);
        }
        return Ok(());
    }
    let runtime = super::runtime()?;
    let done = runtime.block_on(async {
        let netlink = NetlinkHandle::new()?;
        // IMDS only if a pod is on a secondary ENI (its table is the
        // ENI's device number + 1).
        let cloud = tokio::sync::OnceCell::new();
        let device_number = async |mac: MacAddr| {
            let failed = |message: String| takeover::TakeOverError::DeviceNumber { mac, message };
            let cloud = cloud
                .get_or_try_init(|| Cloud::connect(cloud_opts.clone()))
                .await
                .map_err(|e| failed(e.to_string()))?;
            Ok(cloud
                .imds_eni(&mac.to_string())
                .await
                .map_err(|e| failed(e.to_string()))?
                .device_number)
        };
        anyhow::Ok(takeover::hand_back(&opts, &netlink, device_number).await?)
    })?;
    println!(
        "aws-node's rules written back for the node and {} pods ({} ip rules added); {} translated connections handed to conntrack, {} stale entries of untranslated ones removed from it; datapath detached from {}",
        done.pods,
        done.ip_rules_added,
        done.flows_exported,
        done.stale_forgotten,
        pin_dir.display()
    );
    if done.policy.filters > 0 {
        println!(
            "aws-node's network policy programs put back on {} hooks, {} connections written into its tracker",
            done.policy.filters, done.policy.flows
        );
    }
    if done.conflist_restored {
        println!("aws-node's conflist {} restored", takeover::AWS_CONFLIST);
    }
    Ok(())
}
