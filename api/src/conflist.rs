//! The conflist the project ships (`deploy/10-vpcnet.conflist`): one file,
//! which the agent writes onto a node and the lab gives its containerd,
//! each with the plugin's fields set for where it runs.

use serde_json::Value;

/// The shipped conflist, as text.
pub const TEMPLATE: &str = include_str!("../../deploy/10-vpcnet.conflist");

/// The plugin's `type` in it.
pub const PLUGIN_TYPE: &str = "vpcnet-cni";

/// The template, parsed; its plugin's fields are set through
/// [`plugin_mut`].
pub fn template() -> Result<Value, String> {
    serde_json::from_str(TEMPLATE)
        .map_err(|e| format!("deploy/10-vpcnet.conflist is not JSON: {e}"))
}

/// The `vpcnet-cni` plugin of `conflist`.
pub fn plugin_mut(conflist: &mut Value) -> Result<&mut Value, String> {
    conflist["plugins"]
        .as_array_mut()
        .and_then(|plugins| plugins.iter_mut().find(|p| p["type"] == PLUGIN_TYPE))
        .ok_or_else(|| format!("deploy/10-vpcnet.conflist has no {PLUGIN_TYPE} plugin"))
}
