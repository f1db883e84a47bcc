//! The instance types the emulator knows, with EC2's published networking
//! limits ("IP addresses per network interface per instance type" in the EC2
//! user guide, and `DescribeInstanceTypes`' `NetworkInfo`). These limits are
//! what the agent's warm-pool arithmetic depends on, so they are real
//! numbers, not round ones. Every type here is a Nitro type.

/// One instance type's networking limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstanceType {
    /// `m5.large`.
    pub name: &'static str,
    /// Virtual CPUs (`VCpuInfo.DefaultVCpus`).
    pub vcpus: u32,
    /// Memory in MiB (`MemoryInfo.SizeInMiB`).
    pub memory_mib: u64,
    /// `NetworkInfo.MaximumNetworkInterfaces`: ENIs over all network cards.
    pub max_enis: u32,
    /// `NetworkInfo.Ipv4AddressesPerInterface`: the primary address counts
    /// as one, each /28 prefix as one.
    pub ipv4_per_eni: u32,
    /// `NetworkInfo.NetworkCards[i].MaximumNetworkInterfaces`, per card.
    pub network_cards: &'static [u32],
    /// `NetworkInfo.NetworkPerformance`.
    pub network_performance: &'static str,
}

impl InstanceType {
    /// `NetworkInfo.DefaultNetworkCardIndex`: the primary ENI's card.
    pub const DEFAULT_NETWORK_CARD_INDEX: u32 = 0;

    /// The largest number of ENIs one card of this type takes.
    pub fn max_enis_on_card(&self, card: u32) -> Option<u32> {
        self.network_cards.get(usize::try_from(card).ok()?).copied()
    }
}

const fn t(
    name: &'static str,
    vcpus: u32,
    memory_mib: u64,
    max_enis: u32,
    ipv4_per_eni: u32,
    network_performance: &'static str,
) -> InstanceType {
    InstanceType {
        name,
        vcpus,
        memory_mib,
        max_enis,
        ipv4_per_eni,
        network_cards: single_card(max_enis),
        network_performance,
    }
}

/// One network card that takes all of the type's ENIs.
const fn single_card(max_enis: u32) -> &'static [u32] {
    match max_enis {
        2 => &[2],
        3 => &[3],
        4 => &[4],
        8 => &[8],
        15 => &[15],
        _ => panic!("add the card layout"),
    }
}

/// Every known type. The largest `ipv4_per_eni` here (50) is also the limit
/// of an ENI that is attached to nothing.
pub const INSTANCE_TYPES: &[InstanceType] = &[
    t("t3.nano", 2, 512, 2, 2, "Up to 5 Gigabit"),
    t("t3.micro", 2, 1024, 2, 2, "Up to 5 Gigabit"),
    t("t3.small", 2, 2048, 3, 4, "Up to 5 Gigabit"),
    t("t3.medium", 2, 4096, 3, 6, "Up to 5 Gigabit"),
    t("t3.large", 2, 8192, 3, 12, "Up to 5 Gigabit"),
    t("t3.xlarge", 4, 16384, 4, 15, "Up to 5 Gigabit"),
    t("t3.2xlarge", 8, 32768, 4, 15, "Up to 5 Gigabit"),
    t("m5.large", 2, 8192, 3, 10, "Up to 10 Gigabit"),
    t("m5.xlarge", 4, 16384, 4, 15, "Up to 10 Gigabit"),
    t("m5.2xlarge", 8, 32768, 4, 15, "Up to 10 Gigabit"),
    t("m5.4xlarge", 16, 65536, 8, 30, "Up to 10 Gigabit"),
    t("m5.8xlarge", 32, 131_072, 8, 30, "10 Gigabit"),
    t("m5.12xlarge", 48, 196_608, 8, 30, "12 Gigabit"),
    t("m5.16xlarge", 64, 262_144, 15, 50, "20 Gigabit"),
    t("m5.24xlarge", 96, 393_216, 15, 50, "25 Gigabit"),
    t("c5.large", 2, 4096, 3, 10, "Up to 10 Gigabit"),
    t("c5.xlarge", 4, 8192, 4, 15, "Up to 10 Gigabit"),
    t("c5.2xlarge", 8, 16384, 4, 15, "Up to 10 Gigabit"),
    t("c5.4xlarge", 16, 32768, 8, 30, "Up to 10 Gigabit"),
    t("c5.9xlarge", 36, 73728, 8, 30, "12 Gigabit"),
    t("c5.12xlarge", 48, 98304, 8, 30, "12 Gigabit"),
    t("c5.18xlarge", 72, 147_456, 15, 50, "25 Gigabit"),
    t("c5.24xlarge", 96, 196_608, 15, 50, "25 Gigabit"),
    // Four network cards of 15 ENIs each: the multi-card case.
    InstanceType {
        name: "p4d.24xlarge",
        vcpus: 96,
        memory_mib: 1_179_648,
        max_enis: 60,
        ipv4_per_eni: 50,
        network_cards: &[15, 15, 15, 15],
        network_performance: "4x 100 Gigabit",
    },
];

/// The most IPv4 slots any ENI can have (an unattached ENI's limit).
pub const MAX_IPV4_PER_ENI: u32 = 50;

/// The type named `name`.
pub fn lookup(name: &str) -> Option<&'static InstanceType> {
    INSTANCE_TYPES.iter().find(|ty| ty.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_published_limits() {
        for (name, enis, ips) in [
            ("m5.large", 3, 10),
            ("t3.medium", 3, 6),
            ("c5.18xlarge", 15, 50),
            ("m5.xlarge", 4, 15),
            ("m5.4xlarge", 8, 30),
            ("t3.small", 3, 4),
        ] {
            let ty = lookup(name).unwrap();
            assert_eq!((ty.max_enis, ty.ipv4_per_eni), (enis, ips), "{name}");
        }
        assert!(lookup("m5.huge").is_none());
    }

    #[test]
    fn cards_add_up_and_nothing_exceeds_the_unattached_limit() {
        for ty in INSTANCE_TYPES {
            assert_eq!(
                ty.network_cards.iter().sum::<u32>(),
                ty.max_enis,
                "{}",
                ty.name
            );
            assert!(ty.ipv4_per_eni <= MAX_IPV4_PER_ENI, "{}", ty.name);
        }
        assert_eq!(
            lookup("p4d.24xlarge").unwrap().max_enis_on_card(3),
            Some(15)
        );
        assert_eq!(lookup("p4d.24xlarge").unwrap().max_enis_on_card(4), None);
    }
}
