//! The packet and connection mark bits the node's iptables rules use, and
//! whose they are: vpcnet's own mark bits must be none of them. Another
//! rule that sets, clears or tests one of vpcnet's bits between two of its
//! programs would make a packet look decided (and leave as it is) or erase
//! what a program told the next: Calico's default mask (`0xffff0000`)
//! covers vpcnet's default bits, kube-proxy uses `0x4000` and `0x8000`,
//! aws-node its connmark (`0x80`), Cilium `0x0f00` and the upper half.
//!
//! A rule's bits are the mask of what it does with a mark, as
//! `iptables-save` prints it: `MARK`/`CONNMARK --set-xmark VALUE/MASK`
//! (`--set-mark`, `--or-mark`, `--and-mark` and `--xor-mark` are saved
//! so), `-m mark --mark VALUE/MASK`, `-m connmark --mark VALUE/MASK`, and
//! `CONNMARK --save-mark`/`--restore-mark` with `--nfmask`/`--ctmask` (or
//! `--mask`). A value without a mask is the whole mark.

/// One rule's use of mark bits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkUse {
    /// The bits it sets, clears or tests.
    pub bits: u32,
    /// Whose rule it is, told by its chain.
    pub owner: &'static str,
    /// The rule, as `iptables-save` printed it.
    pub rule: String,
}

/// Owners of rules by their chains' (or their targets') prefixes, and by
/// their comments' for rules in built-in chains.
const OWNERS: [(&str, &str, &str); 5] = [
    ("KUBE-", "kubernetes", "kube-proxy"),
    ("AWS-", "AWS", "aws-node"),
    ("cali-", "cali:", "Calico"),
    ("CILIUM", "cilium", "Cilium"),
    ("FLANNEL", "flanneld", "flannel"),
];

/// Every rule of `save` (`iptables-save`'s output) that uses mark bits.
#[must_use]
pub fn mark_uses(save: &str) -> Vec<MarkUse> {
    save.lines()
        .filter_map(|line| {
            let rule = line.strip_prefix("-A ")?;
            let bits = rule_bits(rule);
            (bits != 0).then(|| MarkUse {
                bits,
                owner: owner(rule),
                rule: line.to_owned(),
            })
        })
        .collect()
}

/// The rules of `uses` that touch any of `bits`.
#[must_use]
pub fn overlapping(uses: &[MarkUse], bits: u32) -> Vec<&MarkUse> {
    uses.iter().filter(|u| u.bits & bits != 0).collect()
}

fn owner(rule: &str) -> &'static str {
    let chain = rule.split_whitespace().next().unwrap_or_default();
    // A rule jumping to an owner's chain from a built-in one is theirs too.
    let target = rule
        .split_whitespace()
        .skip_while(|word| *word != "-j")
        .nth(1)
        .unwrap_or_default();
    let comment = rule
        .split_once("--comment ")
        .map(|(_, rest)| rest.trim_start_matches('"'))
        .unwrap_or_default();
    OWNERS
        .iter()
        .find(|(prefix, said, _)| {
            chain.starts_with(prefix) || target.starts_with(prefix) || comment.starts_with(said)
        })
        .map_or("another component", |(_, _, owner)| owner)
}

/// The mark bits one rule (after `-A `) uses.
fn rule_bits(rule: &str) -> u32 {
    let words: Vec<&str> = rule.split_whitespace().collect();
    let mut bits = 0;
    for (i, word) in words.iter().enumerate() {
        let value = words.get(i + 1).copied().unwrap_or_default();
        bits |= match *word {
            // `-m mark --mark` and `-m connmark --mark`; a `--mark` after
            // `-j` is a target's own option, with the same meaning.
            "--mark" | "--set-xmark" | "--set-mark" => masked(value),
            "--or-mark" | "--and-mark" | "--xor-mark" | "--nfmask" | "--ctmask" | "--mask" => {
                number(value)
            }
            _ => 0,
        };
    }
    bits
}

/// The mask of `VALUE/MASK`, or the whole mark for `VALUE` alone.
fn masked(value: &str) -> u32 {
    match value.split_once('/') {
        Some((_, mask)) => number(mask),
        None if parse(value).is_some() => u32::MAX,
        None => 0,
    }
}

fn number(value: &str) -> u32 {
    parse(value).unwrap_or_default()
}

fn parse(value: &str) -> Option<u32> {
    match value.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => value.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kube_proxy_aws_node_calico_and_cilium_rules_say_their_bits() {
        let save = "\
*mangle
:PREROUTING ACCEPT [0:0]
-A PREROUTING -i eth0 -m comment --comment \"AWS, primary ENI\" -m addrtype --dst-type LOCAL --limit-iface-in -j CONNMARK --set-xmark 0x80/0x80
-A PREROUTING -i eni+ -m comment --comment \"AWS, primary ENI\" -j CONNMARK --restore-mark --nfmask 0x80 --ctmask 0x80
-A cali-PREROUTING -m comment --comment \"cali:6gwbT8clXdHdC1b1\" -j MARK --set-xmark 0x0/0xf0000
-A cali-from-host-endpoint -m mark --mark 0x10000/0x10000 -j ACCEPT
-A cali-fw-eni1234 -m comment --comment \"cali:x\" -j MARK --set-xmark 0x0/0xffff0000
COMMIT
*nat
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0
-A KUBE-FIREWALL -m mark --mark 0x8000/0x8000 -j DROP
-A CILIUM_PRE_mangle -m socket --transparent -j MARK --set-xmark 0x200/0xffffffff
-A CILIUM_OUTPUT_raw -m mark --mark 0xa00/0xfffffeff -j CT --notrack
-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING
COMMIT
";
        let uses = mark_uses(save);
        let of = |owner: &str| -> u32 {
            uses.iter()
                .filter(|u| u.owner == owner)
                .fold(0, |bits, u| bits | u.bits)
        };
        assert_eq!(of("aws-node"), 0x80, "its connmark, told by its comments");
        assert_eq!(of("another component"), 0);
        assert_eq!(of("kube-proxy"), 0xc000);
        assert_eq!(of("Calico"), 0xffff_0000);
        assert_eq!(of("Cilium"), u32::MAX);
        // vpcnet's default bits: Calico's and Cilium's.
        let defaults = 0x0020_0000 | 0x0040_0000;
        let owners: Vec<&str> = overlapping(&uses, defaults)
            .iter()
            .map(|u| u.owner)
            .collect();
        assert!(
            owners.contains(&"Calico") && owners.contains(&"Cilium"),
            "{owners:?}"
        );
        assert!(
            overlapping(&uses, 0x0100_0000)
                .iter()
                .all(|u| u.owner != "kube-proxy")
        );
    }

    #[test]
    fn a_rule_without_marks_uses_none_and_plain_values_are_the_whole_mark() {
        assert!(mark_uses("-A FORWARD -p tcp --dport 80 -j ACCEPT\n").is_empty());
        let uses = mark_uses("-A OUTPUT -j MARK --set-mark 5\n");
        assert_eq!(uses[0].bits, u32::MAX);
        assert_eq!(mark_uses("-A X -m mark --mark 0x1\n")[0].bits, u32::MAX);
        assert_eq!(mark_uses("-A X -j MARK --or-mark 0x100\n")[0].bits, 0x100);
    }
}
