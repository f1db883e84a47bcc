//! `vpcnet-cni`: the CNI plugin. This first version answers VERSION; the
//! commands that need the agent's gRPC API report that it is not there yet,
//! with the spec's JSON error, so a runtime never mistakes it for success.

use std::io::Write;

use serde_json::json;

/// CNI spec versions this plugin accepts configurations of.
const SUPPORTED_VERSIONS: [&str; 4] = ["0.3.1", "0.4.0", "1.0.0", "1.1.0"];
const OWN_VERSION: &str = "1.1.0";

/// The spec's error code for "plugin not available".
const ERR_NOT_AVAILABLE: u32 = 50;
/// The spec's error code for invalid environment variables.
const ERR_INVALID_ENV: u32 = 4;

fn error(code: u32, msg: &str, details: &str) -> serde_json::Value {
    json!({ "cniVersion": OWN_VERSION, "code": code, "msg": msg, "details": details })
}

fn main() {
    let command = std::env::var("CNI_COMMAND").unwrap_or_default();
    let (output, ok) = match command.as_str() {
        "VERSION" => (
            json!({ "cniVersion": OWN_VERSION, "supportedVersions": SUPPORTED_VERSIONS }),
            true,
        ),
        "ADD" | "DEL" | "CHECK" | "STATUS" | "GC" => (
            error(
                ERR_NOT_AVAILABLE,
                "vpcnet agent API not available",
                "this build of vpcnet-cni only answers VERSION",
            ),
            false,
        ),
        other => (error(ERR_INVALID_ENV, "unknown CNI_COMMAND", other), false),
    };
    let mut stdout = std::io::stdout().lock();
    // Nothing useful can be done if stdout is gone: the runtime reads the exit code.
    let _ = writeln!(stdout, "{output}");
    std::process::exit(i32::from(!ok));
}
