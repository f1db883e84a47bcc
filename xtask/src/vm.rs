//! Tests inside a VM: virtme-ng boots one of the matrix's kernels with this
//! machine's root filesystem (read-only, with /tmp, /var and /run writable
//! in the guest; /usr and the build output through shares of their own
//! that the guest caches) and runs test executables built here, one after
//! the other. Their output comes back on the VM's standard output and is added
//! up like a run on this machine; the VM's exit code is the tests'.
//!
//! qemu runs under TCG: guests hang on this machine's KVM.

mod shares;

use std::{
    fmt::Write as _,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use vpcnet_lab::moto::MOTO_VENV;

pub use self::shares::BuildSnapshot;
use self::shares::{
    CachedTree, cached_tree_options, cached_trees, mount_cached_trees, private_lab_state,
};
use crate::{
    build::workspace_root,
    kernels::{Installed, Kernel},
    setup::shell_line,
    test::TestTally,
};

/// virtme-ng, from `PyPI`, in the project's virtualenv.
pub const VIRTME_NG_REQUIREMENT: &str = "virtme-ng==1.42";

/// Guest memory: enough for a lab with containerd, and for every VM of a
/// run at once.
const GUEST_MEMORY: &str = "4G";

/// Modules the datapath and the lab need, loaded before the tests (8021q
/// for branch ENIs as real VLAN devices).
const GUEST_MODULES: [&str; 4] = ["veth", "sch_ingress", "cls_bpf", "8021q"];

/// No VM run may take longer than this: a hung guest fails the run.
const GUEST_TIMEOUT: Duration = Duration::from_mins(50);

/// No test executable may run longer than this in the guest (the slowest,
/// `routing_differential`, takes 19 minutes on 6.12 under TCG).
const TEST_BINARY_TIMEOUT: Duration = Duration::from_mins(25);

/// virtme-ng's command.
fn vng() -> PathBuf {
    Path::new(MOTO_VENV).join("bin").join("vng")
}

/// A test executable cargo built, and the package directory cargo would
/// run it in.
#[derive(Clone, Debug)]
pub struct TestBinary {
    /// The test target's name (`verdicts`), or the package's for unit tests.
    pub name: String,
    /// The package it belongs to (`vpcnet-bpf-tests`).
    pub package: String,
    pub package_dir: PathBuf,
    pub executable: PathBuf,
}

/// Builds the integration test targets `tests` (every test executable when
/// empty) of `packages` (every package when empty) without running them,
/// and returns their executables.
///
/// The build selects the whole workspace, as the run on this machine does,
/// and picks the packages' executables afterwards: with `--package` alone,
/// cargo resolves the dependencies' features for that package only and
/// builds a second copy of most of them (in CI that second copy ran the
/// disk full).
pub fn build_tests(tests: &[String], packages: &[String]) -> Result<Vec<TestBinary>> {
    let mut build = crate::build::linting_cargo();
    build
        .args([
            "test",
            "--no-run",
            "--message-format=json-render-diagnostics",
            "--workspace",
        ])
        .args(tests.iter().flat_map(|test| ["--test", test.as_str()]))
        .current_dir(workspace_root())
        .stdin(Stdio::null())
        .stderr(Stdio::inherit());
    let line = shell_line(&build);
    println!("==> build tests: {line}");
    let output = build
        .output()
        .with_context(|| format!("cannot start `{line}`"))?;
    if !output.status.success() {
        bail!("`{line}` failed ({})", output.status);
    }
    let binaries: Vec<TestBinary> = test_binaries(&String::from_utf8_lossy(&output.stdout))
        .into_iter()
        .filter(|binary| packages.is_empty() || packages.contains(&binary.package))
        .collect();
    if binaries.is_empty() {
        bail!("`{line}` built no test executable of {packages:?}");
    }
    Ok(binaries)
}

/// The test executables of cargo's JSON messages.
fn test_binaries(messages: &str) -> Vec<TestBinary> {
    messages
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["profile"]["test"] == true)
        .filter_map(|m| {
            let executable = PathBuf::from(m["executable"].as_str()?);
            let manifest = PathBuf::from(m["manifest_path"].as_str()?);
            Some(TestBinary {
                name: m["target"]["name"].as_str()?.to_owned(),
                package: package_name(m["package_id"].as_str()?)?.to_owned(),
                package_dir: manifest.parent()?.to_owned(),
                executable,
            })
        })
        .collect()
}

/// The package's name in a package id cargo prints:
/// `path+file:///w/bpf-tests#vpcnet-bpf-tests@0.1.0`, or
/// `path+file:///w/lab#0.1.0` when the directory has the package's name.
fn package_name(package_id: &str) -> Option<&str> {
    let (url, fragment) = package_id.rsplit_once('#')?;
    match fragment.split_once('@') {
        Some((name, _version)) => Some(name),
        None => url.rsplit('/').next(),
    }
}

/// The script the guest runs: mounts and modules the host has and a fresh
/// guest lacks, then every test executable, each in its package directory
/// as cargo runs it, with libtest's options; exits 1 when one fails.
fn guest_script(
    kernel: &Kernel,
    tests: &[TestBinary],
    test_args: &[String],
    env: &[(&str, String)],
    trees: &[CachedTree],
) -> String {
    let mut script = String::from(
        "#!/bin/bash\n\
         # Written by `cargo xtask test --kernel`; runs inside the VM.\n\
         set -u\n\
         export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root\n\
         mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf\n",
    );
    let _ = writeln!(
        script,
        "for module in {}; do modprobe -q \"$module\" || echo \"vm: module $module missing\"; done",
        GUEST_MODULES.join(" ")
    );
    script.push_str(&mount_cached_trees(trees));
    script.push_str(&private_lab_state());
    let _ = writeln!(
        script,
        "echo \"vm: kernel {} is $(uname -r)\"\nstatus=0",
        kernel.name
    );
    for (name, value) in env {
        let _ = writeln!(script, "export {name}={}", shell_word(value));
    }
    let args: Vec<String> = test_args.iter().map(|a| shell_word(a)).collect();
    let _ = writeln!(script, "TEST_ARGS=({})", args.join(" "));
    script.push_str(&watchdog_function());
    // Each target's seconds in the guest: what CI's hour is spent on.
    for test in tests {
        let _ = writeln!(
            script,
            "echo \"==> vm {kernel}: {name}\"\nstarted=$SECONDS\n\
             run_bounded {word} {dir} {exe} || status=1\n\
             echo \"==> vm {kernel}: {name} took $((SECONDS - started)) s\"",
            kernel = kernel.name,
            name = test.name,
            word = shell_word(&test.name),
            dir = shell_word(&test.package_dir.to_string_lossy()),
            exe = shell_word(&test.executable.to_string_lossy()),
        );
    }
    script.push_str("exit $status\n");
    script
}

/// The guest's `run_bounded NAME DIR EXECUTABLE`: runs one test executable
/// in its package directory with libtest's options (`$TEST_ARGS`), and if
/// it is still running after [`TEST_BINARY_TIMEOUT`], prints what every
/// process of the test, the lab and containerd is waiting in (kernel stacks
/// of each thread) and the agent's last log lines, then kills it: a hang
/// fails the run with the place it hung, instead of running into
/// [`GUEST_TIMEOUT`] with no word.
fn watchdog_function() -> String {
    format!(
        r#"run_bounded() {{
    local name=$1 dir=$2 exe=$3
    (cd "$dir" && exec "$exe" "${{TEST_ARGS[@]}}") &
    local test_pid=$!
    (
        sleep {limit}
        # Finished meanwhile (this watchdog outlived its kill): nothing to say.
        kill -0 "$test_pid" 2>/dev/null || exit 0
        echo "vm: $name still running after {limit} s: where each process waits"
        ps -eo pid,ppid,stat,etimes,wchan:28,args --forest
        for proc in /proc/[0-9]*; do
            case "$(tr '\0' ' ' <"$proc/cmdline" 2>/dev/null)" in
            *vpcnet*|*containerd*|*"$exe"*)
                for task in "$proc"/task/*; do
                    echo "--- ${{proc#/proc/}}/${{task##*/}} $(cat "$task/comm" 2>/dev/null)"
                    cat "$task/stack" 2>/dev/null
                done ;;
            esac
        done
        echo "--- the agent's last log lines"
        tail -n 40 {agent_log} 2>/dev/null
        kill -KILL "$test_pid" 2>/dev/null
    ) &
    local watchdog=$!
    wait "$test_pid"
    local status=$?
    kill -KILL "$watchdog" 2>/dev/null
    wait "$watchdog" 2>/dev/null
    return "$status"
}}
"#,
        limit = TEST_BINARY_TIMEOUT.as_secs(),
        agent_log = shell_word(&vpcnet_lab::agent_log_file().to_string_lossy()),
    )
}

fn shell_word(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

/// Boots `kernel` with `cpus` virtual CPUs and runs `tests` of the `build`
/// snapshot in it with libtest's `test_args` and the variables `env`,
/// echoing their output
/// (each line after the kernel's name: VMs may run at once); the tally of
/// their `test result:` lines.
pub fn run_in_guest(
    kernel: &Kernel,
    installed: &Installed,
    cpus: usize,
    build: &BuildSnapshot,
    tests: &[TestBinary],
    test_args: &[String],
    env: &[(&str, String)],
) -> Result<TestTally> {
    let dir = workspace_root().join("target").join("vm").join(kernel.name);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let script = dir.join("run.sh");
    let trees = cached_trees(build);
    std::fs::write(&script, guest_script(kernel, tests, test_args, env, &trees))
        .with_context(|| format!("write {}", script.display()))?;
    let qemu_options = cached_tree_options(&trees)?;
    let mut run = boot(kernel, installed, cpus, &script, &qemu_options)?;
    if run.guest_release.is_none() {
        // qemu failed before the guest ran anything (no test ran): once
        // more, as a boot failure is not a test result.
        println!(
            "<== kernel {}: the VM did not boot ({}); once more",
            kernel.name, run.status
        );
        run = boot(kernel, installed, cpus, &script, &qemu_options)?;
    }
    let Run {
        tally,
        guest_release,
        status,
        line,
        unfinished,
    } = run;
    if guest_release.as_deref() != Some(installed.release.as_str()) {
        bail!(
            "kernel {}: the guest did not report booting {} (it said {guest_release:?}); \
             `{line}` exited with {status}",
            kernel.name,
            installed.release
        );
    }
    if let Some(target) = unfinished {
        bail!(
            "kernel {}: the guest stopped while {target} ran ({status}): what its kernel \
             said (warnings and worse) is above; {}",
            kernel.name,
            tally.summary_line()
        );
    }
    if !status.success() {
        bail!(
            "kernel {}: tests failed ({status}); {}",
            kernel.name,
            tally.summary_line()
        );
    }
    Ok(tally)
}

/// One boot of the guest and what came back.
struct Run {
    tally: TestTally,
    /// The release the guest said it booted; `None` if it never ran the
    /// script.
    guest_release: Option<String>,
    status: std::process::ExitStatus,
    /// The command, to run by hand.
    line: String,
    /// The test target the guest had started and not finished when it
    /// stopped (a guest that died: its kernel panicked, or qemu ended).
    unfinished: Option<String>,
}

/// Boots `kernel` with `cpus` CPUs, `script` as the guest's command and
/// qemu's extra `qemu_options`, echoing its output.
fn boot(
    kernel: &Kernel,
    installed: &Installed,
    cpus: usize,
    script: &Path,
    qemu_options: &str,
) -> Result<Run> {
    let mut boot = Command::new(vng());
    // vng runs its siblings (virtme-run) from PATH.
    let venv_bin = Path::new(MOTO_VENV).join("bin");
    let path = std::env::var_os("PATH").unwrap_or_default();
    let path = std::env::join_paths(std::iter::once(venv_bin).chain(std::env::split_paths(&path)))
        .context("PATH with the virtualenv's bin")?;
    boot.env("PATH", path)
        .args(["--disable-kvm", "--force-9p", "--cpus", &cpus.to_string()])
        // The guest kernel's console on the VM's stderr, warnings and worse
        // only: a panic, an oops or the OOM killer that ends a run is told.
        .args(["--verbose", "--append", GUEST_CONSOLE_LOGLEVEL])
        .args(["--memory", GUEST_MEMORY])
        .arg(format!("--qemu-opts={qemu_options}"))
        .arg("-r")
        .arg(&installed.vmlinuz)
        .arg("--exec")
        .arg(format!("bash {}", script.display()))
        .current_dir(workspace_root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        // A pipe, not ours: qemu reopens the guest's stderr by path
        // (`/proc/self/fd/2`) with O_TRUNC, which would empty a log file
        // this run writes to.
        .stderr(Stdio::piped());
    let line = shell_line(&boot);
    println!("==> kernel {} ({}): {line}", kernel.name, installed.release);
    let started = Instant::now();
    let mut child = boot
        .spawn()
        .with_context(|| format!("cannot start `{line}`"))?;
    let stdout = child.stdout.take().context("the VM's stdout")?;
    let prefix = format!("[{}] ", kernel.name);
    let mut stderr = child.stderr.take().context("the VM's stderr")?;
    let stderr_prefix = prefix.clone();
    let forward_stderr = std::thread::spawn(move || {
        for text in BufReader::new(&mut stderr).lines().map_while(Result::ok) {
            eprintln!("{stderr_prefix}{text}");
        }
    });
    let (lines, received) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        let mut buffer = Vec::new();
        while reader.read_until(b'\n', &mut buffer).is_ok_and(|n| n > 0) {
            let text = String::from_utf8_lossy(&buffer).into_owned();
            if lines.send(text).is_err() {
                break;
            }
            buffer.clear();
        }
    });
    let mut tally = TestTally::default();
    let mut guest_release = None;
    let mut unfinished = None;
    loop {
        match received.recv_timeout(Duration::from_secs(1)) {
            Ok(text) => {
                print!("{prefix}{text}");
                if let Some(release) = text
                    .trim()
                    .strip_prefix(&format!("vm: kernel {} is ", kernel.name))
                {
                    guest_release = Some(release.to_owned());
                }
                tally.add_line(&text);
                match target_line(kernel, &text) {
                    Some(TargetLine::Started(name)) => unfinished = Some(name.to_owned()),
                    Some(TargetLine::Finished) => unfinished = None,
                    None => {}
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if started.elapsed() > GUEST_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "kernel {}: the VM ran past {GUEST_TIMEOUT:?} and was stopped; {}",
                kernel.name,
                tally.summary_line()
            );
        }
    }
    let _ = reader.join();
    let _ = forward_stderr.join();
    let status = child.wait().context("wait for the VM")?;
    println!(
        "<== kernel {}: {} in {:.0}s",
        kernel.name,
        tally.summary_line(),
        started.elapsed().as_secs_f64()
    );
    Ok(Run {
        tally,
        guest_release,
        status,
        line,
        unfinished,
    })
}

/// The guest's console prints messages below this level: up to
/// `KERN_WARNING`.
const GUEST_CONSOLE_LOGLEVEL: &str = "loglevel=5";

/// What a line of the guest script says of its test targets.
#[derive(Debug, PartialEq, Eq)]
enum TargetLine<'a> {
    /// `==> vm KERNEL: NAME`
    Started(&'a str),
    /// `==> vm KERNEL: NAME took N s`
    Finished,
}

fn target_line<'a>(kernel: &Kernel, line: &'a str) -> Option<TargetLine<'a>> {
    let prefix = format!("==> vm {}: ", kernel.name);
    let rest = line.trim().strip_prefix(&prefix)?;
    Some(if rest.ends_with(" s") && rest.contains(" took ") {
        TargetLine::Finished
    } else {
        TargetLine::Started(rest)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_executables_come_from_cargos_messages() {
        let messages = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/bpf-tests#vpcnet-bpf-tests@0.1.0","target":{"name":"vpcnet_bpf_tests","kind":["lib"]},"profile":{"test":false},"executable":null,"manifest_path":"/w/bpf-tests/Cargo.toml"}
{"reason":"compiler-artifact","package_id":"path+file:///w/bpf-tests#vpcnet-bpf-tests@0.1.0","target":{"name":"verdicts","kind":["test"]},"profile":{"test":true},"executable":"/w/target/debug/deps/verdicts-1a2b","manifest_path":"/w/bpf-tests/Cargo.toml"}
{"reason":"build-finished","success":true}"#;
        let binaries = test_binaries(messages);
        assert_eq!(binaries.len(), 1);
        assert_eq!(binaries[0].name, "verdicts");
        assert_eq!(binaries[0].package, "vpcnet-bpf-tests");
        assert_eq!(binaries[0].package_dir, Path::new("/w/bpf-tests"));
        assert_eq!(
            binaries[0].executable,
            Path::new("/w/target/debug/deps/verdicts-1a2b")
        );
    }

    #[test]
    fn a_target_the_guest_started_is_unfinished_until_its_time_is_told() {
        let kernel = Kernel::by_name("6.12").unwrap();
        assert_eq!(
            target_line(kernel, "==> vm 6.12: security_groups\n"),
            Some(TargetLine::Started("security_groups"))
        );
        assert_eq!(
            target_line(kernel, "==> vm 6.12: security_groups took 343 s\n"),
            Some(TargetLine::Finished)
        );
        assert_eq!(target_line(kernel, "==> vm 6.1: fuzz\n"), None);
        assert_eq!(target_line(kernel, "test a ... ok\n"), None);
    }

    #[test]
    fn package_names_come_from_both_forms_of_package_ids() {
        assert_eq!(
            package_name("path+file:///w/bpf-tests#vpcnet-bpf-tests@0.1.0"),
            Some("vpcnet-bpf-tests")
        );
        assert_eq!(
            package_name("path+file:///w/ebpf/vpcnet-common#0.1.0"),
            Some("vpcnet-common")
        );
    }

    #[test]
    fn the_guest_runs_each_test_in_its_package_and_fails_if_one_does() {
        let kernel = Kernel::by_name("6.1").unwrap();
        let tests = [TestBinary {
            name: "verdicts".into(),
            package: "vpcnet-bpf-tests".into(),
            package_dir: "/w/bpf-tests".into(),
            executable: "/w/target/debug/deps/verdicts-1a2b".into(),
        }];
        let script = guest_script(
            kernel,
            &tests,
            &["--test-threads=1".into(), "it's".into()],
            &[("SOME_SETTING", "a b".into())],
            &cached_trees(&BuildSnapshot::at("/w/target/vm/tree".into())),
        );
        assert!(script.contains("export SOME_SETTING='a b'"), "{script}");
        assert!(script.contains("mount -t bpf bpf /sys/fs/bpf"), "{script}");
        assert!(script.contains("modprobe -q \"$module\""), "{script}");
        assert!(
            script
                .contains("cache=loose,msize=512000,ro vpcnet_usr /run/vpcnet-vm/vpcnet_usr/lower"),
            "{script}"
        );
        assert!(
            script.contains("TEST_ARGS=('--test-threads=1' 'it'\\''s')"),
            "{script}"
        );
        assert!(
            script.contains(
                "run_bounded 'verdicts' '/w/bpf-tests' '/w/target/debug/deps/verdicts-1a2b' \
                 || status=1"
            ),
            "{script}"
        );
        assert!(
            script.contains("==> vm 6.1: verdicts took $((SECONDS - started)) s"),
            "{script}"
        );
        assert!(script.contains("sleep 1500"), "{script}");
        assert!(script.ends_with("exit $status\n"), "{script}");
    }
}
