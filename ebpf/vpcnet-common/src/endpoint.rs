//! Local pods and the node's ENIs, as the routing replacement needs them:
//! where a pod's packets come from, where its replies go, and which ENI and
//! gateway its address must leave by.

/// The pod has a branch ENI (security groups for pods).
pub const ENDPOINT_BRANCH: u32 = 1 << 0;
/// With `POD_SECURITY_GROUP_ENFORCING_MODE=strict`: every packet of the pod
/// goes out and comes in by its branch ENI.
pub const ENDPOINT_STRICT: u32 = 1 << 1;

/// `ENDPOINTS[pod address]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Endpoint {
    /// The host side of the pod's veth (in the node's namespace).
    pub ifindex: u32,
    /// The link of the ENI that owns the pod's address (its branch ENI's
    /// link for a pod with security groups): its packets leave by it.
    pub eni_ifindex: u32,
    /// The pod's `eth0` MAC: the only source MAC its packets may carry, and
    /// the destination of frames delivered to it.
    pub mac: [u8; 6],
    /// The host veth's MAC: the source of frames delivered to the pod (its
    /// gateway 169.254.1.1 resolves to it).
    pub host_mac: [u8; 6],
    /// `ENDPOINT_*` bits.
    pub flags: u32,
}

impl Endpoint {
    #[must_use]
    pub const fn strict(&self) -> bool {
        self.flags & ENDPOINT_STRICT != 0
    }
}

/// This ENI is the primary one (SNAT leaves by it).
pub const ENI_PRIMARY: u32 = 1 << 0;
/// This link is a branch ENI (a trunk's vlan).
pub const ENI_BRANCH: u32 = 1 << 1;

/// `ENIS[link ifindex]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Eni {
    /// The subnet's router (network order): packets leaving by this ENI are
    /// sent to it, whatever their destination, as the VPC CNI's per-ENI
    /// route table does.
    pub gateway: u32,
    /// `ENI_*` bits.
    pub flags: u32,
}

crate::impl_pod!(Endpoint, Eni);
