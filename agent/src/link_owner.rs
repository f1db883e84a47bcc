//! Which network manager claims an interface, for the agent's log: on
//! nodes where systemd-networkd runs (Amazon Linux 2023), a `.network` file
//! that matches an ENI vpcnet owns makes networkd configure it too (DHCP:
//! an address and routes in `main`), racing with the agent. The agent then
//! says so, and puts its own configuration back on every pass.
//!
//! Read from the state networkd and udev keep under `/run`: networkd's
//! per-link file (`ADMIN_STATE`, `NETWORK_FILE`) and udev's database
//! (`ID_NET_MANAGED_BY`, systemd 255 and later).

use std::{
    fmt,
    path::{Path, PathBuf},
};

/// udev's value of `ID_NET_MANAGED_BY` for networkd.
const NETWORKD_ID: &str = "io.systemd.Network";

/// Who configures an interface besides vpcnet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkOwner {
    /// systemd-networkd, with the `.network` file that matched it.
    Networkd { network_file: Option<String> },
    /// Another manager, named by udev's `ID_NET_MANAGED_BY`.
    Other(String),
    /// Nothing: networkd does not run or leaves it unmanaged.
    Unclaimed,
}

impl fmt::Display for LinkOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Networkd {
                network_file: Some(file),
            } => write!(f, "systemd-networkd ({file})"),
            Self::Networkd { network_file: None } => write!(f, "systemd-networkd"),
            Self::Other(name) => write!(f, "{name} (udev ID_NET_MANAGED_BY)"),
            Self::Unclaimed => write!(f, "no network manager"),
        }
    }
}

/// Where networkd's and udev's state are read from.
#[derive(Clone, Debug)]
pub struct LinkOwners {
    /// networkd's per-link state files, named by ifindex.
    networkd_links: PathBuf,
    /// udev's database, `n<ifindex>` for network interfaces.
    udev_data: PathBuf,
}

impl Default for LinkOwners {
    fn default() -> Self {
        Self::under(Path::new("/"))
    }
}

impl LinkOwners {
    /// The state files under `root` (`/` on a node).
    pub fn under(root: &Path) -> Self {
        Self {
            networkd_links: root.join("run/systemd/netif/links"),
            udev_data: root.join("run/udev/data"),
        }
    }

    /// Who claims interface `ifindex`.
    pub fn owner(&self, ifindex: u32) -> LinkOwner {
        let udev =
            std::fs::read_to_string(self.udev_data.join(format!("n{ifindex}"))).unwrap_or_default();
        let managed_by = udev
            .lines()
            .find_map(|line| line.strip_prefix("E:ID_NET_MANAGED_BY="));
        if let Some(name) = managed_by.filter(|name| *name != NETWORKD_ID) {
            return LinkOwner::Other(name.to_owned());
        }
        let Ok(state) = std::fs::read_to_string(self.networkd_links.join(ifindex.to_string()))
        else {
            return LinkOwner::Unclaimed;
        };
        let value = |key: &str| {
            state
                .lines()
                .find_map(|line| line.strip_prefix(key)?.strip_prefix('='))
                .map(str::trim)
        };
        match value("ADMIN_STATE") {
            Some("unmanaged") | None => LinkOwner::Unclaimed,
            Some(_) => LinkOwner::Networkd {
                network_file: value("NETWORK_FILE").map(ToOwned::to_owned),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(files: &[(&str, &str)]) -> (vpcnet_lab::ScratchDir, LinkOwners) {
        let root = vpcnet_lab::ScratchDir::new("vpcnet-link-owner").unwrap();
        for (path, text) in files {
            let path = root.path().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        let owners = LinkOwners::under(root.path());
        (root, owners)
    }

    #[test]
    fn networkd_claims_what_a_network_file_matched() {
        let (_root, owners) = node(&[
            (
                "run/systemd/netif/links/2",
                "# This is private data. Do not parse.\nADMIN_STATE=configured\nOPER_STATE=routable\nNETWORK_FILE=/run/systemd/network/80-ec2.network\n",
            ),
            (
                "run/systemd/netif/links/3",
                "ADMIN_STATE=unmanaged\nOPER_STATE=off\n",
            ),
            (
                "run/udev/data/n4",
                "I:123\nE:ID_NET_MANAGED_BY=io.example.Other\n",
            ),
        ]);
        assert_eq!(
            owners.owner(2).to_string(),
            "systemd-networkd (/run/systemd/network/80-ec2.network)"
        );
        assert_eq!(owners.owner(3), LinkOwner::Unclaimed);
        assert_eq!(owners.owner(4), LinkOwner::Other("io.example.Other".into()));
        assert_eq!(owners.owner(5), LinkOwner::Unclaimed, "no state at all");
    }
}
