#!/usr/bin/env bash
# Builds vpcnet's binaries and stages the image's files under OUT:
#   OUT/usr/local/bin/vpcnet-agent       the agent, eBPF programs embedded
#   OUT/opt/vpcnet/cni/vpcnet-cni        the CNI plugin, for /opt/cni/bin
# The Containerfile's build stage runs it; the tests run it as is.
#
# usage: build.sh [--install-toolchain] OUT
#   --install-toolchain  install the nightly toolchain, rust-src and
#                        bpf-linker first (a fresh build image); without it
#                        they must be there (`cargo xtask setup`).
# VPCNET_BUILD_PROFILE: cargo profile, `release` (default) or `dev`.
# VPCNET_BUILD_PACKAGES: what cargo builds, `-p vpcnet-agent -p vpcnet-cni`
#   by default; the tests pass `--workspace`, as their suite built it, so
#   cargo finds it built with the same features.
set -euo pipefail

install_toolchain=false
if [[ "${1:-}" == "--install-toolchain" ]]; then
    install_toolchain=true
    shift
fi
out=${1:?usage: build.sh [--install-toolchain] OUT}
profile=${VPCNET_BUILD_PROFILE:-release}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# The LLVM bpf-linker links to: the nightly toolchain's own.
llvm_major=22

fail() {
    echo "build.sh: $*" >&2
    exit 1
}

if $install_toolchain; then
    rustup toolchain install nightly --profile minimal --component rust-src
    if ! bpf-linker --version >/dev/null 2>&1; then
        lib=$(rustc +nightly --print sysroot)/lib
        llvm=$(basename "$(ls "$lib"/libLLVM-${llvm_major}-*.so 2>/dev/null | head -n1)")
        [[ -n "$llvm" ]] || fail "no libLLVM-${llvm_major} in the nightly toolchain ($lib)"
        RUSTFLAGS="-C link-arg=-L$lib -C link-arg=-l:$llvm -C link-arg=-Wl,-rpath,$lib" \
            cargo +nightly install bpf-linker --no-default-features \
            --features "llvm-${llvm_major},no-llvm-linking"
    fi
fi
# Without bpf-linker the agent would embed an empty object and refuse to
# load: never ship that.
bpf-linker --version >/dev/null 2>&1 \
    || fail "bpf-linker is missing: run with --install-toolchain, or \`cargo xtask setup\`"
rustup component list --installed --toolchain nightly 2>/dev/null | grep -q '^rust-src' \
    || fail "the nightly toolchain's rust-src is missing: run with --install-toolchain"

cd "$repo"
read -r -a packages <<<"${VPCNET_BUILD_PACKAGES:--p vpcnet-agent -p vpcnet-cni}"
cargo build --locked --profile "$profile" "${packages[@]}" --bins
target_dir=$(cargo metadata --format-version 1 --no-deps \
    | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
case "$profile" in
    dev) bin_dir=$target_dir/debug ;;
    *) bin_dir=$target_dir/$profile ;;
esac

install -d "$out/usr/local/bin" "$out/opt/vpcnet/cni"
install -m 0755 "$bin_dir/vpcnet-agent" "$out/usr/local/bin/vpcnet-agent"
install -m 0755 "$bin_dir/vpcnet-cni" "$out/opt/vpcnet/cni/vpcnet-cni"
echo "build.sh: staged in $out ($profile)"
