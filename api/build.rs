//! Generates the CNI backend's gRPC code from `proto/cni.proto`. `protox`
//! parses the proto in Rust, so no `protoc` has to be installed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/cni.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
