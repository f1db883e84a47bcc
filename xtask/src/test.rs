//! `cargo xtask test`: formatting, lints and every test, in that order,
//! stopping at the first step that fails. The tests share kernel state
//! (network namespaces, pinned maps), so they run as root, one at a time.

mod lint;
mod sizes;
mod steps;

use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context, Result, bail};
use vpcnet_lab::test_sizes::SUITE_IMAGE_VAR;

use self::{
    lint::{build_and_lint, lint_steps},
    sizes::{GUEST_SETTINGS, Sizes},
    steps::{Step, cargo, format_duration, run_step},
};
use crate::{
    build::workspace_root,
    kernels::{KERNELS, Kernel},
    setup::{self, shell_line},
    vm,
};

#[derive(clap::Args)]
pub struct Args {
    /// Only run the tests: no formatting or lint checks.
    #[arg(long)]
    skip_lint: bool,
    /// Test (and lint) only these packages instead of the whole workspace.
    #[arg(long = "package", short = 'p', value_name = "PACKAGE")]
    packages: Vec<String>,
    /// Only these integration test targets (cargo's `--test`), of the
    /// packages given with `-p`.
    #[arg(long = "test", value_name = "TARGET")]
    tests: Vec<String>,
    /// A named set of test targets: `matrix` (what CI runs on each kernel of
    /// the matrix) or `datapath` (the datapath's lab suite). A suite is a
    /// set of targets, so it cannot be narrowed with `--test`.
    #[arg(long, value_enum, conflicts_with = "tests")]
    suite: Option<Suite>,
    /// Where to run: `host` (this machine's kernel), `6.1` or `6.12` (a VM
    /// booting Debian's kernel), or `all`; comma-separated. Without it: every
    /// test here, then the `matrix` suite on each kernel of the matrix.
    #[arg(long = "kernel", value_delimiter = ',', value_name = "KERNEL")]
    kernels: Vec<String>,
    /// Packets per program the fuzz test feeds (`bpf-tests/tests/fuzz.rs`),
    /// here and in the VMs. Without it: as [`Sizes`] says. Its seed is
    /// `VPCNET_FUZZ_SEED` from the environment (passed into the VMs too),
    /// or a fixed one.
    #[arg(long, value_name = "N")]
    fuzz_packets: Option<u64>,
    /// The slowest tests at their full sizes (each test's own default)
    /// instead of CI's smaller ones: see [`Sizes`].
    #[arg(long)]
    full: bool,
    /// Show what the tests print as they run (libtest's `--nocapture`),
    /// here and in the VMs.
    #[arg(long)]
    nocapture: bool,
    /// Run only the tests whose name contains this (passed to cargo test).
    filter: Option<String>,
}

/// Named sets of test targets, all in [`SUITE_PACKAGE`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Suite {
    /// On every kernel: the programs load within their budgets, the
    /// `BPF_PROG_TEST_RUN` verdict tests, agent restarts under long-lived
    /// flows and an upgrade from the release nodes run; in a VM, the whole
    /// datapath suite (security groups for pods over 802.1Q, the network
    /// policy matrix, every lab of the packet path, the routing
    /// differential over 802.1Q, the image's agent).
    Matrix,
    /// The datapath's lab suite: routing, SNAT differential, EXTERNALSNAT,
    /// TIME_WAIT, anti-spoofing, GC, agent restarts, fragments, ICMP errors,
    /// protocols without ports, floods of unanswered flows, idle service
    /// connections, simulated days and packets bigger than an ENI, an
    /// upgrade, and in a VM the image's agent, with the above.
    Datapath,
}

/// The package the suites' test targets are in.
const SUITE_PACKAGE: &str = "vpcnet-bpf-tests";

/// Programs load (over whatever layout of maps is pinned) and decide
/// packets as they should.
const VERDICT_TARGETS: [&str; 7] = [
    "verifier",
    "pinned_layouts",
    "verdicts",
    "routing",
    "network_policy",
    "port_allocation",
    "fuzz",
];

/// The lab with traffic: SNAT, pod to pod and VPC steering, and long flows
/// through agent SIGKILL and SIGTERM restarts.
const TRAFFIC_TARGETS: [&str; 1] = ["node_restart"];

/// The same flows through an upgrade from the earlier release nodes run,
/// a downgrade and an upgrade again: on every kernel.
const UPGRADE_TARGETS: [&str; 1] = ["upgrade"];

/// Security groups for pods over real 802.1Q links: every VM kernel (the
/// host's has no 8021q module; there these tests are ignored).
const VLAN_TARGETS: [&str; 1] = ["security_groups"];

/// The image's agent as the DaemonSet's pod, not privileged (four
/// capabilities), through containerd: what a kernel lets such a container
/// do is the kernel's, so in every VM (under TCG containerd alone takes
/// three minutes to import the image); this machine's run of it is the
/// whole run's.
const IMAGE_TARGETS: [&str; 1] = ["agent_image"];

/// Network policy against its specification, in every VM (this machine
/// runs every test).
const POLICY_TARGETS: [&str; 1] = ["network_policy_matrix"];

/// Labs whose outcome is most the kernel's: fragments and their
/// reassembly, ICMP errors through conntrack, path MTU and `bpf_check_mtu`,
/// TCP states against conntrack's timeouts, the marks of the node's
/// iptables rules, the collector's batches.
const KERNEL_LAB_TARGETS: [&str; 6] = [
    "fragments",
    "icmp_errors",
    "oversize",
    "tcp_states",
    "marks",
    "gc",
];

/// The other labs of the packet path: the differential of every far end,
/// EXTERNALSNAT, excluded and service CIDRs, spoofed sources, protocols
/// other than TCP, UDP and ICMP, services through a full stack-flow table,
/// floods, the routing differential (branch pods on real VLANs in a VM),
/// TIME_WAIT's port reuse, containerd's restarts, simulated days. On 6.12
/// with the VM to itself, at CI's sizes, on a slow day of this machine:
/// 221 s (`time_wait`), 154 (`simulated_days`), 128 (`cri_restart`), 101
/// (`floods`), 27 (`external_service_cidrs`), the others between.
const LAB_TARGETS: [&str; 11] = [
    "differential",
    "external_snat",
    "external_service_cidrs",
    "anti_spoofing",
    "other_protocols",
    "floods",
    "service_connections",
    "routing_differential",
    "time_wait",
    "cri_restart",
    "simulated_days",
];

impl Suite {
    /// The suite's targets on `kernel` (`None`: this machine's).
    fn targets(self, kernel: Option<&Kernel>) -> Vec<&'static str> {
        let in_vm = kernel.is_some();
        let mut targets = VERDICT_TARGETS.to_vec();
        if in_vm {
            targets.extend(VLAN_TARGETS);
            targets.extend(POLICY_TARGETS);
        }
        if in_vm || self == Self::Datapath {
            targets.extend(KERNEL_LAB_TARGETS);
            targets.extend(LAB_TARGETS);
        }
        targets.extend(TRAFFIC_TARGETS);
        targets.extend(UPGRADE_TARGETS);
        if in_vm {
            targets.extend(IMAGE_TARGETS);
        }
        targets
    }
}

/// Where tests run.
#[derive(Clone, Copy)]
enum Place {
    Host,
    Vm(&'static Kernel),
}

impl Place {
    fn parse_all(names: &[String]) -> Result<Vec<Self>> {
        let mut places = Vec::new();
        for name in names {
            match name.as_str() {
                "host" => places.push(Self::Host),
                "all" => {
                    places.push(Self::Host);
                    places.extend(KERNELS.iter().map(Self::Vm));
                }
                other => places.push(Self::Vm(Kernel::by_name(other).with_context(|| {
                    let known: Vec<&str> = KERNELS.iter().map(|k| k.name).collect();
                    format!("--kernel {other}: not host, all or one of {known:?}")
                })?)),
            }
        }
        Ok(places)
    }

    fn label(self) -> String {
        match self {
            Self::Host => "host".to_owned(),
            Self::Vm(kernel) => kernel.name.to_owned(),
        }
    }
}

pub fn run(args: &Args) -> Result<()> {
    require_root()?;
    setup::ensure(setup::Scope::Tests)?;
    let started = Instant::now();
    let mut passed: Vec<&str> = Vec::new();
    if !args.skip_lint {
        for step in lint_steps()? {
            run_step(step, &mut passed)?;
        }
    }
    // The lab tests start the agent binary; `cargo test` builds a package's
    // binaries only for that package's own integration tests.
    if args.skip_lint {
        run_step(
            Step {
                name: "build binaries",
                command: cargo(&workspace_root(), &["build", "--workspace", "--bins"]),
            },
            &mut passed,
        )?;
    } else {
        build_and_lint(&mut passed)?;
    }
    let (images, results, total) = run_everywhere(build_guest_tests(plan(args)?)?, args)?;
    if images {
        passed.push("image");
    }
    passed.push("tests");
    println!(
        "xtask test: OK: {} passed in {}",
        passed.join(", "),
        format_duration(started.elapsed())
    );
    for line in &results {
        println!("  {line}");
    }
    println!("{}", total.summary_line());
    Ok(())
}

/// Runs the planned tests here and in their VMs, the VMs beside this
/// machine's tests; whether the images were built, a line for each place,
/// and the total.
fn run_everywhere(planned: Vec<PlannedRun>, args: &Args) -> Result<(bool, Vec<String>, TestTally)> {
    let sizes = Sizes::new(args.full, args.fuzz_packets);
    let mut host_runs = Vec::new();
    let mut vms = Vec::new();
    let mut guests_use_images = false;
    for (place, selection, binaries) in planned {
        match (place, binaries) {
            (Place::Vm(kernel), Some(binaries)) => {
                guests_use_images |= selection.uses_images();
                vms.push((kernel, binaries));
            }
            _ => host_runs.push((place, selection)),
        }
    }
    // The VMs run beside this machine's tests: the lab tests here leave
    // the cores idle for seven tenths of their twenty minutes, waiting on
    // timeouts, agents and servers, and the guests' TCG takes what is idle.
    // A guest that runs `agent_image` needs the images in its snapshot, so
    // they come first then (otherwise they are built beside the VMs).
    let images_first = if guests_use_images {
        Some(build_images()?)
    } else {
        None
    };
    let snapshot = if vms.is_empty() {
        None
    } else {
        Some(vm::BuildSnapshot::take()?)
    };
    let (host_outcome, vm_outcome) = std::thread::scope(|scope| {
        let running = snapshot
            .as_ref()
            .map(|snapshot| scope.spawn(move || run_in_vms(&vms, snapshot, args, sizes)));
        let prefix = if running.is_some() { "[host] " } else { "" };
        let host = run_here(&host_runs, images_first, args, sizes, prefix);
        let vms = running.map(|vms| {
            vms.join()
                .unwrap_or_else(|_| bail!("the VMs' thread panicked"))
        });
        (host, vms)
    });
    drop(snapshot);
    let mut results = Vec::new();
    let mut images = false;
    let mut total = TestTally::default();
    let mut failed = Vec::new();
    match host_outcome {
        Ok((built, tallies)) => {
            images = built;
            for (place, tally) in tallies {
                results.push(format!("{}: {}", place.label(), tally.summary_line()));
                total.add(&tally);
            }
        }
        Err(error) => failed.push(error),
    }
    match vm_outcome {
        Some(Ok(tallies)) => {
            for (kernel, tally) in tallies {
                results.push(format!("{}: {}", kernel.name, tally.summary_line()));
                total.add(&tally);
            }
        }
        Some(Err(error)) => failed.push(error),
        None => {}
    }
    match failed.len() {
        0 => {}
        1 => return Err(failed.remove(0)),
        _ => {
            for error in &failed {
                eprintln!("{error:?}");
            }
            bail!("xtask test: FAILED here and in the VMs (above)")
        }
    }
    Ok((images, results, total))
}

/// This machine's part of the run: the images if a test uses them (unless
/// they were `built` already), then its tests, each line after `prefix`.
/// Whether the images were built, and each place's tally.
fn run_here(
    runs: &[(Place, Selection)],
    built: Option<PathBuf>,
    args: &Args,
    sizes: Sizes,
    prefix: &str,
) -> Result<(bool, Vec<(Place, TestTally)>)> {
    let suite_image = if built.is_some() {
        built
    } else if runs.is_empty() {
        None
    } else if runs.iter().any(|(_, selection)| selection.uses_images()) {
        Some(build_images()?)
    } else {
        println!("==> image: no test of this run uses it");
        None
    };
    let mut tallies = Vec::new();
    for (place, selection) in runs {
        let mut command = test_command(selection, args.filter.as_deref(), args.nocapture);
        for test in sizes.skipped_on_host() {
            command.args(["--skip", test]);
        }
        command.envs(sizes.host_env());
        if let Some(image) = &suite_image {
            command.env(SUITE_IMAGE_VAR, image);
        }
        tallies.push((*place, run_tests(command, prefix)?));
    }
    Ok((suite_image.is_some(), tallies))
}

/// Builds the agent's image from the tests' binaries, and the previous
/// commit's unless it is there; returns the first's archive.
fn build_images() -> Result<PathBuf> {
    // The agent's image from those binaries: the lab runs it as the
    // DaemonSet's pod (`bpf-tests/tests/agent_image.rs`).
    let image_started = Instant::now();
    println!("==> image: cargo xtask image --bin-dir target/debug");
    let suite_image = crate::image::build(&crate::image::Args {
        release: false,
        arch: vec![crate::image::Arch::Amd64],
        out: None,
        bin_dir: Some(crate::build::target_dir()?.join("debug")),
        commit: None,
        tag: None,
    })
    .context("building the agent's image for the tests")?;
    println!(
        "==> image: done in {}",
        format_duration(image_started.elapsed())
    );
    // The previous commit's, which the rolling update starts from (built
    // once per commit: one commit gives one archive).
    let previous = crate::image::previous_commit_archive()?;
    if previous.is_file() {
        println!("==> image of HEAD~1: {} is there", previous.display());
    } else {
        let started = Instant::now();
        println!("==> image of HEAD~1: cargo xtask image --commit HEAD~1");
        crate::image::build(&crate::image::Args {
            release: false,
            arch: vec![crate::image::Arch::Amd64],
            out: None,
            bin_dir: None,
            commit: Some("HEAD~1".to_owned()),
            tag: None,
        })
        .context("building the previous commit's image for the rolling update")?;
        println!(
            "==> image of HEAD~1: done in {}",
            format_duration(started.elapsed())
        );
    }
    Ok(suite_image)
}

/// What to run at one place: cargo's package and target selection.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Selection {
    packages: Vec<String>,
    tests: Vec<String>,
}

impl Selection {
    fn of_suite(suite: Suite, kernel: Option<&Kernel>) -> Self {
        Self {
            packages: vec![SUITE_PACKAGE.to_owned()],
            tests: suite
                .targets(kernel)
                .into_iter()
                .map(String::from)
                .collect(),
        }
    }

    /// Whether a test it selects uses the images: the agent's image
    /// (`bpf-tests/tests/agent_image.rs`, `xtask/tests/image.rs`) and the
    /// previous commit's, which the rolling update starts from. A run
    /// narrowed to other targets or packages goes without their minutes.
    fn uses_images(&self) -> bool {
        const USERS: [(&str, &str); 2] = [(SUITE_PACKAGE, IMAGE_TARGETS[0]), ("xtask", "image")];
        if !self.tests.is_empty() {
            return self
                .tests
                .iter()
                .any(|test| USERS.iter().any(|(_, target)| target == test));
        }
        self.packages.is_empty()
            || self
                .packages
                .iter()
                .any(|package| USERS.iter().any(|(user, _)| user == package))
    }

    fn cargo_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if self.packages.is_empty() {
            args.push("--workspace".to_owned());
        }
        for package in &self.packages {
            args.extend(["--package".to_owned(), package.clone()]);
        }
        for test in &self.tests {
            args.extend(["--test".to_owned(), test.clone()]);
        }
        args
    }
}

/// Where each test runs. Without `--kernel`: everything (or what `-p`,
/// `--test`, `--suite` and the filter choose) on this machine's kernel,
/// then, unless the run was narrowed, the matrix suite on each kernel of
/// the matrix.
fn plan(args: &Args) -> Result<Vec<(Place, Selection)>> {
    let narrowed = !args.packages.is_empty()
        || !args.tests.is_empty()
        || args.suite.is_some()
        || args.filter.is_some();
    let places = if args.kernels.is_empty() {
        let mut places = vec![Place::Host];
        if !narrowed {
            places.extend(KERNELS.iter().map(Place::Vm));
        }
        places
    } else {
        Place::parse_all(&args.kernels)?
    };
    Ok(places
        .into_iter()
        .map(|place| {
            let kernel = match place {
                Place::Host => None,
                Place::Vm(kernel) => Some(kernel),
            };
            let selection = match args.suite {
                Some(suite) => Selection::of_suite(suite, kernel),
                None if !args.tests.is_empty() || !args.packages.is_empty() => Selection {
                    packages: if args.packages.is_empty() {
                        vec![SUITE_PACKAGE.to_owned()]
                    } else {
                        args.packages.clone()
                    },
                    tests: args.tests.clone(),
                },
                // A VM runs the matrix's suite unless told otherwise; the
                // host runs everything.
                None if kernel.is_some() => Selection::of_suite(Suite::Matrix, kernel),
                None => Selection::default(),
            };
            (place, selection)
        })
        .collect())
}

/// One place's run: its selection and, in a VM, the executables built for it.
type PlannedRun = (Place, Selection, Option<Vec<vm::TestBinary>>);

/// Every VM's test executables, built now, before anything runs: a later
/// kernel must run what an earlier one ran, not what the tree became
/// meanwhile. VMs with the same selection share one build.
fn build_guest_tests(plan: Vec<(Place, Selection)>) -> Result<Vec<PlannedRun>> {
    let mut planned = Vec::new();
    let mut built: Vec<(Selection, Vec<vm::TestBinary>)> = Vec::new();
    for (place, selection) in plan {
        let binaries = match place {
            Place::Host => None,
            Place::Vm(_) => Some(
                if let Some((_, binaries)) = built.iter().find(|(s, _)| *s == selection) {
                    binaries.clone()
                } else {
                    let binaries = vm::build_tests(&selection.tests, &selection.packages)?;
                    built.push((selection.clone(), binaries.clone()));
                    binaries
                },
            ),
        };
        planned.push((place, selection, binaries));
    }
    Ok(planned)
}

/// Runs each kernel's test executables in a VM booting it, the VMs at
/// once with the machine's cores shared among them: under TCG a guest's
/// second CPU buys little, and two guests of one CPU side by side took
/// two thirds of the time two of two CPUs took one after the other (197 s
/// against 300 s for the same three labs on 6.1 and 6.12). Every VM runs
/// to its end; the tallies in the order given, or what failed.
fn run_in_vms(
    vms: &[(&'static Kernel, Vec<vm::TestBinary>)],
    build: &vm::BuildSnapshot,
    args: &Args,
    sizes: Sizes,
) -> Result<Vec<(&'static Kernel, TestTally)>> {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let cpus = (cores / vms.len().max(1)).max(1);
    let outcomes: Vec<Result<TestTally>> = std::thread::scope(|scope| {
        let running: Vec<_> = vms
            .iter()
            .map(|(kernel, binaries)| {
                scope.spawn(move || run_in_vm(kernel, binaries, build, cpus, args, sizes))
            })
            .collect();
        running
            .into_iter()
            .map(|vm| {
                vm.join()
                    .unwrap_or_else(|_| bail!("a VM's thread panicked"))
            })
            .collect()
    });
    let mut tallies = Vec::new();
    let mut failed = Vec::new();
    for ((kernel, _), outcome) in vms.iter().zip(outcomes) {
        match outcome {
            Ok(tally) => tallies.push((*kernel, tally)),
            Err(error) => failed.push(error),
        }
    }
    match failed.len() {
        0 => Ok(tallies),
        1 => Err(failed.remove(0)),
        _ => {
            for error in &failed {
                eprintln!("{error:?}");
            }
            bail!("xtask test: FAILED on {} kernels (above)", failed.len())
        }
    }
}

/// Runs `binaries` of the `build` snapshot in a VM booting `kernel` with
/// `cpus` CPUs.
fn run_in_vm(
    kernel: &'static Kernel,
    binaries: &[vm::TestBinary],
    build: &vm::BuildSnapshot,
    cpus: usize,
    args: &Args,
    sizes: Sizes,
) -> Result<TestTally> {
    let installed = kernel.installed().with_context(|| {
        format!(
            "kernel {} is not installed: run `cargo xtask setup`",
            kernel.name
        )
    })?;
    // Tests ignored for want of 802.1Q run here.
    let mut test_args = vec![
        "--test-threads=1".to_owned(),
        "--include-ignored".to_owned(),
    ];
    if args.nocapture {
        test_args.push("--nocapture".to_owned());
    }
    for test in sizes.skipped_in(kernel) {
        test_args.extend(["--skip".to_owned(), test.to_owned()]);
    }
    test_args.extend(args.filter.clone());
    // The guest starts from a clean environment: the tests' settings go in
    // its script.
    let mut env = sizes.vm_env();
    for name in GUEST_SETTINGS {
        if let Ok(value) = std::env::var(name) {
            env.push((name, value));
        }
    }
    vm::run_in_guest(kernel, &installed, cpus, build, binaries, &test_args, &env)
        .with_context(|| format!("xtask test: FAILED on kernel {}", kernel.name))
}

fn require_root() -> Result<()> {
    let uid = setup::effective_uid()?;
    if uid != 0 {
        bail!(
            "cargo xtask test must run as root (effective uid is {uid}): the tests create \
             network namespaces, load BPF programs and pin maps under /sys/fs/bpf. \
             Run it as root, e.g. `sudo -E env PATH=\"$PATH\" cargo xtask test`"
        );
    }
    Ok(())
}

fn test_command(selection: &Selection, filter: Option<&str>, nocapture: bool) -> Command {
    let mut test = cargo(&workspace_root(), &["test"]);
    test.args(selection.cargo_args());
    test.args(["--no-fail-fast", "--", "--test-threads=1"]);
    if nocapture {
        test.arg("--nocapture");
    }
    if let Some(filter) = filter {
        test.arg(filter);
    }
    test
}

/// Runs cargo test, echoing its output (each line after `prefix`: VMs may
/// run meanwhile) and adding up libtest's `test result:` lines.
fn run_tests(mut cargo_test: Command, prefix: &str) -> Result<TestTally> {
    let line = shell_line(&cargo_test);
    println!("{prefix}==> tests: {line}");
    let mut child = cargo_test
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start `{line}`"))?;
    let stdout = child.stdout.take().context("cargo test's stdout")?;
    let stderr = child.stderr.take().context("cargo test's stderr")?;
    let stderr_prefix = prefix.to_owned();
    // cargo's own lines (`Running tests/…`) and the tests' panics.
    let forward_stderr = std::thread::spawn(move || {
        for text in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("{stderr_prefix}{text}");
        }
    });
    let mut tally = TestTally::default();
    let mut reader = BufReader::new(stdout);
    let mut buffer = Vec::new();
    while reader
        .read_until(b'\n', &mut buffer)
        .context("read cargo test's output")?
        > 0
    {
        let text = String::from_utf8_lossy(&buffer);
        print!("{prefix}{text}");
        tally.add_line(&text);
        buffer.clear();
    }
    let status = child.wait().context("wait for cargo test")?;
    let _ = forward_stderr.join();
    if !status.success() {
        bail!(
            "xtask test: FAILED at step `tests`: `{line}` failed ({status}); {}",
            tally.summary_line()
        );
    }
    Ok(tally)
}

/// The sum of the `test result:` lines of every test binary.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct TestTally {
    passed: u64,
    failed: u64,
    ignored: u64,
}

impl TestTally {
    /// Adds a libtest line such as
    /// `test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s`.
    pub fn add_line(&mut self, line: &str) {
        let Some(counts) = line.trim().strip_prefix("test result:") else {
            return;
        };
        for part in counts.split(';') {
            let words: Vec<&str> = part.split_whitespace().collect();
            let [.., count, kind] = words.as_slice() else {
                continue;
            };
            let Ok(count) = count.parse::<u64>() else {
                continue;
            };
            match *kind {
                "passed" => self.passed += count,
                "failed" => self.failed += count,
                "ignored" => self.ignored += count,
                _ => {}
            }
        }
    }

    pub fn add(&mut self, other: &Self) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.ignored += other.ignored;
    }

    pub fn summary_line(&self) -> String {
        format!(
            "tests: {} passed, {} failed, {} skipped",
            self.passed, self.failed, self.ignored
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tally_adds_up_every_test_result_line() {
        let mut tally = TestTally::default();
        for line in [
            "running 3 tests",
            "test a ... ok",
            "test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s",
            "test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 4 filtered out; finished in 1.20s\n",
            "test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s",
        ] {
            tally.add_line(line);
        }
        assert_eq!(
            tally,
            TestTally {
                passed: 5,
                failed: 1,
                ignored: 1
            }
        );
        assert_eq!(tally.summary_line(), "tests: 5 passed, 1 failed, 1 skipped");
    }

    #[test]
    fn tally_ignores_other_lines() {
        let mut tally = TestTally::default();
        tally.add_line("test result_parsing ... ok");
        tally.add_line("3 passed; 1 failed");
        assert_eq!(tally, TestTally::default());
    }

    fn args(kernels: &[&str], suite: Option<Suite>, packages: &[&str]) -> Args {
        Args {
            skip_lint: true,
            packages: packages.iter().map(|p| (*p).to_owned()).collect(),
            tests: Vec::new(),
            suite,
            kernels: kernels.iter().map(|k| (*k).to_owned()).collect(),
            fuzz_packets: None,
            full: false,
            nocapture: false,
            filter: None,
        }
    }

    fn planned(args: &Args) -> Vec<(String, Vec<String>)> {
        plan(args)
            .unwrap()
            .into_iter()
            .map(|(place, selection)| (place.label(), selection.cargo_args()))
            .collect()
    }

    #[test]
    fn test_command_passes_the_filter_after_the_libtest_options() {
        let selection = Selection {
            packages: vec!["vpcnet-common".into()],
            tests: Vec::new(),
        };
        let line = shell_line(&test_command(&selection, Some("nat"), false));
        assert!(
            line.ends_with(
                "cargo test --package vpcnet-common --no-fail-fast -- --test-threads=1 nat"
            ),
            "{line}"
        );
    }

    #[test]
    fn a_whole_run_tests_everything_here_then_the_matrix_suite_in_vms() {
        let plan = planned(&args(&[], None, &[]));
        let places: Vec<&str> = plan.iter().map(|(place, _)| place.as_str()).collect();
        assert_eq!(places, ["host", "6.1", "6.12"]);
        assert_eq!(plan[0].1, ["--workspace"]);
        let runs = |cargo_args: &[String], target: &str| {
            cargo_args.windows(2).any(|w| w == ["--test", target])
        };
        for (kernel, cargo_args) in &plan[1..] {
            let every = VERDICT_TARGETS
                .iter()
                .chain(&VLAN_TARGETS)
                .chain(&POLICY_TARGETS)
                .chain(&KERNEL_LAB_TARGETS)
                .chain(&LAB_TARGETS)
                .chain(&TRAFFIC_TARGETS)
                .chain(&UPGRADE_TARGETS)
                .chain(&IMAGE_TARGETS);
            for target in every {
                assert!(runs(cargo_args, target), "{kernel}: {target} missing");
            }
        }
    }

    #[test]
    fn images_are_built_for_a_run_that_may_use_them_only() {
        let with_tests = |tests: &[&str]| Args {
            tests: tests.iter().map(|t| (*t).to_owned()).collect(),
            ..args(&[], None, &[SUITE_PACKAGE])
        };
        // Whether each place of the run builds on the images.
        let images_used = |args: &Args| -> Vec<bool> {
            plan(args)
                .unwrap()
                .iter()
                .map(|(_, selection)| selection.uses_images())
                .collect()
        };
        assert_eq!(images_used(&args(&[], None, &[])), [true, true, true]);
        assert_eq!(images_used(&args(&[], None, &["xtask"])), [true]);
        assert_eq!(
            images_used(&args(&["6.1"], Some(Suite::Datapath), &[])),
            [true]
        );
        assert_eq!(
            images_used(&args(&["host"], Some(Suite::Matrix), &[])),
            [false]
        );
        assert_eq!(
            images_used(&args(&["all"], Some(Suite::Matrix), &[])),
            [false, true, true]
        );
        assert_eq!(
            images_used(&with_tests(&["routing", "agent_image"])),
            [true]
        );
        assert_eq!(
            images_used(&with_tests(&["routing", "security_groups"])),
            [false]
        );
        assert_eq!(images_used(&args(&[], None, &["vpcnet-common"])), [false]);
    }

    #[test]
    fn a_narrowed_run_stays_on_this_machine_unless_told() {
        let plan = planned(&args(&[], None, &["vpcnet-common"]));
        assert_eq!(plan.len(), 1);
        assert_eq!(plan[0].0, "host");
        let plan = planned(&args(&["6.1", "6.12"], Some(Suite::Datapath), &[]));
        assert_eq!(plan.len(), 2);
        for (_, cargo_args) in &plan {
            let line = cargo_args.join(" ");
            let every = LAB_TARGETS
                .iter()
                .chain(&TRAFFIC_TARGETS)
                .chain(&UPGRADE_TARGETS)
                .chain(&IMAGE_TARGETS)
                .chain(&KERNEL_LAB_TARGETS);
            for target in every {
                assert!(line.contains(&format!("--test {target}")), "{line}");
            }
        }
        assert!(Place::parse_all(&["5.4".into()]).is_err());
        assert_eq!(planned(&args(&["all"], None, &[])).len(), 3);
    }
}
