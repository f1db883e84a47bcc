//! The datapath's configuration: one entry of the `CONFIG` array map, read
//! per packet, so flipping a flag takes effect on the next packet.

/// `AWS_VPC_K8S_CNI_EXTERNALSNAT=true`: new flows to non-VPC destinations
/// leave un-NATed (a NAT gateway translates them).
pub const FLAG_EXTERNAL_SNAT: u32 = 1 << 0;

/// Network policy is enforced (`ENABLE_NETWORK_POLICY=true`): local pods'
/// packets are judged by their identities in `POLICY_PODS`. Off, the
/// programs never look at the policy maps.
pub const FLAG_NETWORK_POLICY: u32 = 1 << 1;

/// `ENABLE_POLICY_EVENT_LOGS`: policy's verdicts go to the `POLICY_EVENTS`
/// ring buffer, for the agent's event log.
pub const FLAG_POLICY_EVENTS: u32 = 1 << 2;

/// The skb mark bit `pod_egress` sets on a pod's packet to a service CIDR
/// before handing it to the stack, so that `eni_egress`, after kube-proxy's
/// DNAT, knows the flow's replies must go back through the stack to be
/// un-DNATed; cleared before the packet leaves the node. By default this
/// bit (`VPCNET_MARK_VIA_SERVICE` sets another, [`Config::mark_via_service`]):
/// one no kube-proxy (0x4000, 0x8000) or VPC CNI (0x80) mark uses.
pub const MARK_VIA_SERVICE: u32 = 0x0040_0000;

/// The skb mark bit a vpcnet program sets on a packet whose fate it has
/// already decided (translated, or left un-NATed) before it leaves by an
/// ENI: `eni_egress` clears it and passes the packet, so no packet is
/// decided twice (a translated source would look like a node socket's).
/// By default this bit (`VPCNET_MARK_DECIDED` sets another,
/// [`Config::mark_decided`]).
pub const MARK_DECIDED: u32 = 0x0020_0000;

/// `AWS_VPC_K8S_CNI_RANDOMIZESNAT`: how the NAT picks a source port.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RandomizeMode {
    /// `none`: keep the pod's port when free, else the next free one.
    None = 0,
    /// `hashrandom`: start from a keyed hash of the flow's endpoints.
    HashRandom = 1,
    /// `prng`: random ports, retried (the VPC CNI's default, `--random-fully`).
    Prng = 2,
}

impl RandomizeMode {
    #[must_use]
    pub const fn from_raw(raw: u32) -> Self {
        match raw {
            0 => Self::None,
            1 => Self::HashRandom,
            _ => Self::Prng,
        }
    }

    /// The value of `AWS_VPC_K8S_CNI_RANDOMIZESNAT` that selects this mode.
    #[must_use]
    pub const fn env_value(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::HashRandom => "hashrandom",
            Self::Prng => "prng",
        }
    }

    #[must_use]
    pub fn from_env_value(value: &str) -> Option<Self> {
        match value {
            "none" => Some(Self::None),
            "hashrandom" => Some(Self::HashRandom),
            "prng" => Some(Self::Prng),
            _ => None,
        }
    }
}

/// Default SNAT source port range (host order, inclusive): what netfilter's
/// SNAT uses for ports above 1023.
pub const DEFAULT_PORT_MIN: u16 = 1024;
pub const DEFAULT_PORT_MAX: u16 = 65535;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// The primary ENI's address, SNAT's source (network order). Zero means
    /// not configured yet: the programs then pass every packet untouched.
    pub node_addr: u32,
    /// `FLAG_*` bits.
    pub flags: u32,
    /// A [`RandomizeMode`] as `u32`.
    pub randomize: u32,
    /// SNAT source port range, host order, inclusive.
    pub port_min: u16,
    pub port_max: u16,
    /// Key of the `hashrandom` port hash, chosen by the agent at start.
    pub hash_seed: u32,
    /// The primary ENI's link: `pod_egress` sends a pod's SNATed packets
    /// out of it, past the stack. Zero until that ENI is in the `ENIS` map:
    /// the packets then go through the stack to `eni_egress`, which makes
    /// the same decision.
    pub primary_ifindex: u32,
    /// The mark bits of [`MARK_DECIDED`] and [`MARK_VIA_SERVICE`]'s roles;
    /// zero: those defaults. Appended: layout 1's fields are a prefix.
    pub mark_decided_bit: u32,
    pub mark_via_service_bit: u32,
}

/// Size of [`Config`] in layout 1 (before the mark bits).
pub const CONFIG_LAYOUT1_SIZE: usize = 24;

impl Config {
    #[must_use]
    pub const fn external_snat(&self) -> bool {
        self.flags & FLAG_EXTERNAL_SNAT != 0
    }

    #[must_use]
    pub const fn network_policy(&self) -> bool {
        self.flags & FLAG_NETWORK_POLICY != 0
    }

    #[must_use]
    pub const fn policy_events(&self) -> bool {
        self.flags & FLAG_POLICY_EVENTS != 0
    }

    #[must_use]
    pub const fn randomize_mode(&self) -> RandomizeMode {
        RandomizeMode::from_raw(self.randomize)
    }

    /// The mark bit of a packet a vpcnet program decided.
    #[must_use]
    pub const fn mark_decided(&self) -> u32 {
        if self.mark_decided_bit == 0 {
            MARK_DECIDED
        } else {
            self.mark_decided_bit
        }
    }

    /// The mark bit of a pod's packet to a service.
    #[must_use]
    pub const fn mark_via_service(&self) -> u32 {
        if self.mark_via_service_bit == 0 {
            MARK_VIA_SERVICE
        } else {
            self.mark_via_service_bit
        }
    }
}

crate::impl_pod!(Config);
