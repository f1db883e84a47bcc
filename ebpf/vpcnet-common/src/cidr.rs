//! The prefix trie that decides whether a destination is SNATed.

/// What a prefix in the `CIDRS` trie is. The longest match wins, so a node
/// address inside the VPC CIDR reads as `Local`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CidrKind {
    /// A VPC CIDR block (primary or secondary): never SNATed.
    Vpc = 1,
    /// `AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS`: never SNATed.
    Excluded = 2,
    /// An address of the node itself (`addrtype --dst-type LOCAL`).
    Local = 3,
    /// A Kubernetes service CIDR: pods' packets to it go through the node's
    /// stack, where kube-proxy translates them. Not a SNAT exemption.
    Service = 4,
}

impl CidrKind {
    #[must_use]
    pub const fn from_raw(raw: u32) -> Option<Self> {
        match raw {
            1 => Some(Self::Vpc),
            2 => Some(Self::Excluded),
            3 => Some(Self::Local),
            4 => Some(Self::Service),
            _ => None,
        }
    }
}

/// Value stored in the trie.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CidrValue {
    /// A [`CidrKind`] as `u32`.
    pub kind: u32,
}

/// Value of the external service trie
/// ([`crate::maps::EXTERNAL_SERVICE_CIDRS`]): a prefix there is one of
/// `AWS_EXTERNAL_SERVICE_CIDRS`; the trie needs a value, this is it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExternalServiceCidr {
    /// Always [`EXTERNAL_SERVICE_CIDR`].
    pub marker: u32,
}

/// The one value of [`ExternalServiceCidr::marker`].
pub const EXTERNAL_SERVICE_CIDR: u32 = 1;

crate::impl_pod!(CidrValue, ExternalServiceCidr);
