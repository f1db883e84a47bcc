//! What the agent is told, one definition for whoever writes it and the agent
//! that reads it: the node layout (the lab's static nodes) and the CNI
//! plugin's gRPC API (`proto/cni.proto`).

pub mod layout;

/// The CNI backend service (generated from `proto/cni.proto`).
pub mod cni {
    #![allow(clippy::pedantic, missing_docs)]
    tonic::include_proto!("vpcnet.cni.v1");
}
