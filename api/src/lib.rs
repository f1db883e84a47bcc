//! What the agent is told about the node, one definition for whoever writes
//! it (the lab today, the CNI plugin's gRPC calls later) and the agent that
//! reads it.

pub mod layout;
