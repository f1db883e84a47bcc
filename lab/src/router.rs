//! The VPC router (`vpcnet-vpc`): what AWS does between instances.
//!
//! - Delivery: a packet for an address goes to the ENI that owns it, through
//!   a /32 route on that ENI's link and a permanent neighbour entry with the
//!   ENI's MAC. The router never ARPs for an instance address, and addresses
//!   no ENI owns are black-holed (the VPC CIDRs are blackhole routes).
//! - Source/destination check: a packet coming from an ENI link whose source
//!   is not an address of that ENI is dropped and counted. The owned
//!   addresses live in one nftables set keyed by (link, address), a hash
//!   lookup whatever the number of addresses.
//! - Internet gateway: a packet leaves to `inet` only if its source is a
//!   node's primary address (the one with a public IP), and only such
//!   addresses are reachable from `inet`; everything else is dropped and
//!   counted.

use std::{fmt::Write, net::Ipv4Addr, process::Command};

use ipnet::Ipv4Net;

use crate::{
    addrs::{NS_VPC, VPC_IGW_LINK},
    error::{LabError, Result},
    netns::{exec_ok, netns_path, run_with_stdin},
};

/// The nftables table that holds the router's checks.
pub const NFT_TABLE: &str = "vpcnet_vpc";
/// Counts packets dropped by the source/destination check.
pub const SRCDST_CHECK_DROPS: &str = "srcdst_check_drops";
/// Counts packets the internet gateway refused to pass to `inet`.
pub const IGW_EGRESS_DROPS: &str = "igw_egress_drops";
/// Counts packets from `inet` to an address without a public IP.
pub const IGW_INGRESS_DROPS: &str = "igw_ingress_drops";

/// The router's ruleset, with no ENI yet.
pub fn base_ruleset() -> String {
    format!(
        r#"table ip {NFT_TABLE} {{
    counter {SRCDST_CHECK_DROPS} {{ }}
    counter {IGW_EGRESS_DROPS} {{ }}
    counter {IGW_INGRESS_DROPS} {{ }}

    # The router's side of every ENI: packets from these get checked.
    set eni_links {{ type ifname; }}
    # (ENI link, address) for every address assigned to an ENI.
    set eni_addresses {{ type ifname . ipv4_addr; }}
    # Addresses with a public IP: node primary addresses.
    set igw_addresses {{ type ipv4_addr; }}

    chain srcdst_check {{
        # Before anything else, routing and conntrack included, as in AWS
        # where the check happens before the packet reaches the VPC.
        type filter hook prerouting priority raw; policy accept;
        iifname @eni_links iifname . ip saddr != @eni_addresses counter name "{SRCDST_CHECK_DROPS}" drop
    }}

    chain internet_gateway {{
        type filter hook forward priority filter; policy accept;
        oifname "{VPC_IGW_LINK}" ip saddr != @igw_addresses counter name "{IGW_EGRESS_DROPS}" drop
        iifname "{VPC_IGW_LINK}" ip daddr != @igw_addresses counter name "{IGW_INGRESS_DROPS}" drop
    }}
}}
"#
    )
}

/// Loads an nftables script into the router.
pub fn nft_apply(script: &str) -> Result<()> {
    run_with_stdin(
        Command::new("nsenter")
            .arg(format!("--net={}", netns_path(NS_VPC).display()))
            .args(["--", "nft", "-f", "-"]),
        script,
    )?;
    Ok(())
}

/// The `ip` commands and nftables elements that make an ENI known to the
/// router: its link is checked, and each of `addrs` is delivered to `mac`
/// on `link` and accepted as a source from it.
#[derive(Debug, Default)]
pub struct Assignments {
    pub ip_lines: Vec<String>,
    pub nft_elements: Vec<String>,
}

impl Assignments {
    /// Adds `addrs` on the ENI whose router-side link is `link` and whose MAC
    /// is `mac`.
    pub fn add(&mut self, link: &str, mac: &str, addrs: &[Ipv4Addr]) {
        for addr in addrs {
            self.ip_lines
                .push(format!("route replace {addr}/32 dev {link} scope link"));
            self.ip_lines.push(format!(
                "neigh replace {addr} lladdr {mac} dev {link} nud permanent"
            ));
            self.nft_elements.push(format!("\"{link}\" . {addr}"));
        }
    }

    /// Adds a /28 (or any) prefix on the ENI: the router routes the whole
    /// prefix to the link, knows the ENI's MAC for each of its addresses
    /// (it never ARPs for instance addresses), and accepts each of them as
    /// a source from the link, as AWS does for an ENI's delegated prefix.
    pub fn add_prefix(&mut self, link: &str, mac: &str, prefix: Ipv4Net) {
        self.ip_lines
            .push(format!("route replace {prefix} dev {link} scope link"));
        for addr in prefix_addresses(prefix) {
            self.ip_lines.push(format!(
                "neigh replace {addr} lladdr {mac} dev {link} nud permanent"
            ));
            self.nft_elements.push(format!("\"{link}\" . {addr}"));
        }
    }

    /// Applies them to the router: routes and neighbours in one `ip` batch,
    /// set elements in one nftables transaction.
    pub fn apply(&self) -> Result<()> {
        crate::netns::ip_batch(Some(NS_VPC), &self.ip_lines)?;
        if !self.nft_elements.is_empty() {
            // nft takes large element lists in one go; chunk anyway so one
            // line never gets huge with thousands of addresses.
            let mut script = String::new();
            for chunk in self.nft_elements.chunks(512) {
                let _ = writeln!(
                    script,
                    "add element ip {NFT_TABLE} eni_addresses {{ {} }}",
                    chunk.join(", ")
                );
            }
            nft_apply(&script)?;
        }
        Ok(())
    }
}

/// The MAC of the ENI the router delivers `addr` to (its permanent
/// neighbour entry), if any ENI owns `addr`.
pub fn owner_mac(addr: Ipv4Addr) -> Result<Option<String>> {
    let addr = addr.to_string();
    let out = crate::netns::exec_ok(NS_VPC, &["ip", "-j", "neigh", "show", &addr])?;
    let entries: Vec<serde_json::Value> =
        serde_json::from_str(&out).map_err(|err| crate::error::LabError::BadOutput {
            command: format!("ip -j neigh show {addr}"),
            reason: err.to_string(),
        })?;
    Ok(entries
        .iter()
        .find_map(|entry| entry["lladdr"].as_str().map(str::to_owned)))
}

/// Every address of `prefix`, network and broadcast included (a delegated
/// prefix's addresses are all usable by pods).
pub fn prefix_addresses(prefix: Ipv4Net) -> impl Iterator<Item = Ipv4Addr> {
    (u32::from(prefix.network())..=u32::from(prefix.broadcast())).map(Ipv4Addr::from)
}

/// The reverse of [`Assignments`]: addresses and prefixes an ENI no longer
/// has (unassigned, or its ENI detached). The router stops delivering them
/// and drops them as sources from the link.
#[derive(Debug, Default)]
pub struct Removals {
    pub ip_lines: Vec<String>,
    pub nft_elements: Vec<String>,
}

impl Removals {
    /// Removes `addrs` from the ENI whose router-side link is `link`.
    pub fn remove(&mut self, link: &str, addrs: &[Ipv4Addr]) {
        for addr in addrs {
            self.ip_lines
                .push(format!("route del {addr}/32 dev {link}"));
            self.ip_lines.push(format!("neigh del {addr} dev {link}"));
            self.nft_elements.push(format!("\"{link}\" . {addr}"));
        }
    }

    /// Removes a prefix added with [`Assignments::add_prefix`].
    pub fn remove_prefix(&mut self, link: &str, prefix: Ipv4Net) {
        self.ip_lines.push(format!("route del {prefix} dev {link}"));
        for addr in prefix_addresses(prefix) {
            self.ip_lines.push(format!("neigh del {addr} dev {link}"));
            self.nft_elements.push(format!("\"{link}\" . {addr}"));
        }
    }

    /// Applies them. Routes and neighbours go in one `ip -force` batch: one
    /// that is already gone (its link deleted with it) must not keep the
    /// others. Set elements go in one nftables transaction.
    pub fn apply(&self) -> Result<()> {
        if !self.ip_lines.is_empty() {
            // `ip -force` still exits non-zero when a line failed; what
            // failed is gone already, which is what was wanted.
            let _ = run_with_stdin(
                Command::new("ip").args(["-n", NS_VPC, "-force", "-batch", "-"]),
                &self.ip_lines.join("\n"),
            );
        }
        if !self.nft_elements.is_empty() {
            let mut script = String::new();
            for chunk in self.nft_elements.chunks(512) {
                let _ = writeln!(
                    script,
                    "delete element ip {NFT_TABLE} eni_addresses {{ {} }}",
                    chunk.join(", ")
                );
            }
            nft_apply(&script)?;
        }
        Ok(())
    }
}

/// Stops checking `link` as an ENI link (its ENI is gone).
pub fn remove_eni_links(links: &[&str]) -> Result<()> {
    if links.is_empty() {
        return Ok(());
    }
    let quoted: Vec<String> = links.iter().map(|link| format!("\"{link}\"")).collect();
    nft_apply(&format!(
        "delete element ip {NFT_TABLE} eni_links {{ {} }}\n",
        quoted.join(", ")
    ))
}

/// Makes `link` an ENI link of the router: packets from it are checked.
pub fn add_eni_links(links: &[&str]) -> Result<()> {
    if links.is_empty() {
        return Ok(());
    }
    let quoted: Vec<String> = links.iter().map(|link| format!("\"{link}\"")).collect();
    nft_apply(&format!(
        "add element ip {NFT_TABLE} eni_links {{ {} }}\n",
        quoted.join(", ")
    ))
}

/// Gives `addrs` a public IP: the internet gateway passes them.
pub fn add_igw_addresses(addrs: &[Ipv4Addr]) -> Result<()> {
    if addrs.is_empty() {
        return Ok(());
    }
    let list: Vec<String> = addrs.iter().map(ToString::to_string).collect();
    nft_apply(&format!(
        "add element ip {NFT_TABLE} igw_addresses {{ {} }}\n",
        list.join(", ")
    ))
}

/// Packets the router has received on `link` (the router's side of an
/// ENI, e.g. `n0-eth1` or `n0-vlan1`): what left the node by that ENI.
pub fn link_rx_packets(link: &str) -> Result<u64> {
    let command = format!("ip -s -j link show dev {link}");
    let json = exec_ok(NS_VPC, &["ip", "-s", "-j", "link", "show", "dev", link])?;
    let value: serde_json::Value =
        serde_json::from_str(&json).map_err(|err| LabError::BadOutput {
            command: command.clone(),
            reason: err.to_string(),
        })?;
    value[0]["stats64"]["rx"]["packets"]
        .as_u64()
        .ok_or_else(|| LabError::BadOutput {
            command,
            reason: format!("no rx packet count in {json}"),
        })
}

/// Reads one of the router's drop counters (packets).
pub fn read_counter(name: &str) -> Result<u64> {
    let command = format!("nft -j list counter ip {NFT_TABLE} {name}");
    let json = exec_ok(
        NS_VPC,
        &["nft", "-j", "list", "counter", "ip", NFT_TABLE, name],
    )?;
    let value: serde_json::Value =
        serde_json::from_str(&json).map_err(|err| LabError::BadOutput {
            command: command.clone(),
            reason: err.to_string(),
        })?;
    value["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|item| item["counter"]["packets"].as_u64())
        .ok_or_else(|| LabError::BadOutput {
            command,
            reason: format!("no packet count in {json}"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assignments_route_neighbour_and_allow_each_address() {
        let mut assignments = Assignments::default();
        assignments.add(
            "n0-eth0",
            "02:ee:0a:14:0b:a2",
            &[Ipv4Addr::new(10, 20, 11, 20)],
        );
        assert_eq!(
            assignments.ip_lines,
            vec![
                "route replace 10.20.11.20/32 dev n0-eth0 scope link",
                "neigh replace 10.20.11.20 lladdr 02:ee:0a:14:0b:a2 dev n0-eth0 nud permanent",
            ]
        );
        assert_eq!(assignments.nft_elements, vec!["\"n0-eth0\" . 10.20.11.20"]);
    }

    #[test]
    fn prefixes_route_the_block_and_allow_each_address() {
        let mut assignments = Assignments::default();
        let prefix: Ipv4Net = "10.20.11.32/28".parse().unwrap();
        assignments.add_prefix("n0-eth1", "02:ee:0a:14:0b:0b", prefix);
        assert_eq!(
            assignments.ip_lines[0],
            "route replace 10.20.11.32/28 dev n0-eth1 scope link"
        );
        assert_eq!(assignments.ip_lines.len(), 17);
        assert_eq!(assignments.nft_elements.len(), 16);
        assert_eq!(assignments.nft_elements[15], "\"n0-eth1\" . 10.20.11.47");
        let mut removals = Removals::default();
        removals.remove_prefix("n0-eth1", prefix);
        removals.remove("n0-eth1", &[Ipv4Addr::new(10, 20, 11, 9)]);
        assert_eq!(removals.nft_elements.len(), 17);
        assert_eq!(removals.ip_lines[0], "route del 10.20.11.32/28 dev n0-eth1");
    }

    #[test]
    fn ruleset_names_every_counter() {
        let ruleset = base_ruleset();
        for counter in [SRCDST_CHECK_DROPS, IGW_EGRESS_DROPS, IGW_INGRESS_DROPS] {
            assert!(
                ruleset.contains(&format!("counter name \"{counter}\"")),
                "{counter}"
            );
        }
    }
}
