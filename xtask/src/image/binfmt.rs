//! Running a command that executes arm64 binaries (mmdebstrap's
//! maintainer scripts in a foreign root filesystem) on an amd64 machine,
//! without touching the machine: the command runs in a user namespace of
//! its own whose own `binfmt_misc` (Linux 6.7 and later) hands arm64 ELF
//! files to `qemu-aarch64-static`. The machine's `binfmt_misc` is never
//! mounted nor written, and the registration dies with the namespace.

use std::{
    fs,
    io::{self, BufRead, BufReader, Write},
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

use crate::setup::shell_line;

/// The emulator, statically linked: opened once at registration (flag
/// `F`), so it need not exist inside the root filesystem being made.
pub const QEMU_AARCH64: &str = "/usr/bin/qemu-aarch64-static";

/// The registration of arm64 ELF executables, as Debian's qemu-user
/// package writes it (magic and mask of the ELF header's class, data,
/// version and machine fields), in `binfmt_misc`'s `register` syntax.
fn aarch64_registration() -> String {
    let magic = r"\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00";
    let mask = r"\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff";
    format!(":qemu-aarch64:M::{magic}:{mask}:{QEMU_AARCH64}:F")
}

/// What the namespace's first process does: says it is in the namespace,
/// waits for its identity map, registers qemu in a `binfmt_misc` of its
/// own and becomes the command (`"$@"`).
const INSIDE: &str = r#"echo in-namespace
read -r mapped
mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc || {
    echo "binfmt_misc cannot be mounted in a user namespace: arm64 needs Linux 6.7 or later" >&2
    exit 97
}
printf '%s\n' "$VPCNET_BINFMT" > /proc/sys/fs/binfmt_misc/register
exec "$@" </dev/null"#;

/// Runs `command` where arm64 executables run under qemu; fails as
/// `run_checked` does.
pub fn run_checked_with_arm64(command: &Command) -> Result<()> {
    let line = shell_line(command);
    let mut sandbox = Command::new("unshare");
    // A user namespace whose root is the machine's root (its map is
    // written below), with a mount namespace for binfmt_misc and a PID
    // namespace with its own /proc, where binfmt_misc lives.
    sandbox
        .args(["--user", "--mount", "--pid", "--fork", "--mount-proc", "--"])
        .args(["sh", "-c", INSIDE, "sh"])
        .arg(command.get_program())
        .args(command.get_args())
        .env("VPCNET_BINFMT", aarch64_registration())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    for (key, value) in command.get_envs() {
        match value {
            Some(value) => sandbox.env(key, value),
            None => sandbox.env_remove(key),
        };
    }
    let mut child = sandbox
        .spawn()
        .with_context(|| format!("cannot start `{line}` in a user namespace (unshare)"))?;
    let stdout = child.stdout.take().context("the namespace's stdout")?;
    let mut stdout = BufReader::new(stdout);
    let mut first = String::new();
    stdout.read_line(&mut first)?;
    if first.trim() != "in-namespace" {
        let status = child.wait()?;
        bail!("`unshare` did not make the namespace for `{line}` ({status})");
    }
    // The machine's root maps to the namespace's, every other user to
    // itself: files in the root filesystem get their real owners.
    let pid = child.id();
    for map in ["uid_map", "gid_map"] {
        fs::write(format!("/proc/{pid}/{map}"), "0 0 4294967295\n")
            .with_context(|| format!("writing the namespace's {map}"))?;
    }
    let mut stdin = child.stdin.take().context("the namespace's stdin")?;
    stdin.write_all(b"mapped\n")?;
    drop(stdin);
    io::copy(&mut stdout, &mut io::stdout())?;
    let status = child.wait()?;
    if !status.success() {
        bail!("`{line}` failed ({status}) in a user namespace with qemu for arm64");
    }
    Ok(())
}
