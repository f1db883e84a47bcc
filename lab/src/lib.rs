//! The lab: a node in a box made of network namespaces.
