//! Generates the CRI client (`cri` module) from `proto/cri.proto`, a subset
//! of Kubernetes' `runtime.v1`. `protox` parses the proto in Rust, so no
//! `protoc` has to be installed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/cri.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    // The lab is only ever a client of containerd.
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(descriptors)?;
    Ok(())
}
