//! The vpcnet node agent as a library: the datapath manager (load, pin,
//! attach, fill maps, garbage-collect NAT) and the configuration from the
//! VPC CNI's environment variables. The binary and the tests use it.

pub mod bring_up;
pub mod cloud;
pub mod cni_server;
pub mod cni_waiting;
pub mod crash_points;
pub mod datapath;
pub mod env;
pub mod install;
pub mod introspect;
pub mod ipam;
pub mod k8s;
pub mod layout;
pub mod link_owner;
pub mod logging;
pub mod node;
pub mod pods;
pub mod policy;
pub mod retry;
pub mod settings;
pub mod snat;
pub mod takeover;
pub mod telemetry;

/// Link setup through rtnetlink (its own crate: the CNI plugin uses it too).
pub use vpcnet_netlink as netlink;
