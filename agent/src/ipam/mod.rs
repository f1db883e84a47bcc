//! The IP address manager: what the VPC CNI's ipamd does, with its
//! variables and formulas.

pub mod checkpoint;
pub mod datastore;
pub mod manager;
pub mod metrics;
pub mod pool;
pub mod settings;
pub mod subnets;
