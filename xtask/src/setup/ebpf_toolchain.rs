//! The eBPF programs' toolchain, pinned: the nightly that
//! `ebpf/vpcnet-ebpf/rust-toolchain.toml` names (its one definition), and
//! bpf-linker at [`BPF_LINKER_VERSION`] built against that nightly's own
//! LLVM, whose major version is read from the toolchain, not assumed.

use std::{
    fs,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use super::{Reporter, install_failed, run_checked, say, shell_line, stdout_of};
use crate::build::workspace_root;

/// The toolchain file, relative to the repository.
const TOOLCHAIN_FILE: &str = "ebpf/vpcnet-ebpf/rust-toolchain.toml";

/// The bpf-linker release the programs are linked with, built with
/// `--locked` (its own dependencies as released).
pub const BPF_LINKER_VERSION: &str = "0.13.0";

#[derive(Deserialize)]
struct ToolchainFile {
    toolchain: Pinned,
}

/// What the toolchain file pins.
#[derive(Deserialize)]
pub struct Pinned {
    /// `nightly-YYYY-MM-DD`.
    pub channel: String,
    #[serde(default)]
    components: Vec<String>,
}

impl Pinned {
    /// `+<channel>`, for a `cargo` or `rustc` run outside the programs'
    /// directory (or with `RUSTUP_TOOLCHAIN` set, which beats the file).
    pub fn plus(&self) -> String {
        format!("+{}", self.channel)
    }

    /// The nightly's date, `YYYY-MM-DD`.
    fn date(&self) -> Option<&str> {
        self.channel.strip_prefix("nightly-")
    }
}

/// The pinned toolchain, read from the toolchain file.
pub fn pinned() -> Result<Pinned> {
    let path = workspace_root().join(TOOLCHAIN_FILE);
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    parse(&text).with_context(|| format!("reading {}", path.display()))
}

fn parse(text: &str) -> Result<Pinned> {
    let file: ToolchainFile = toml::from_str(text)?;
    if file.toolchain.date().is_none() {
        bail!(
            "channel `{}`: the eBPF toolchain is pinned to a dated nightly (nightly-YYYY-MM-DD)",
            file.toolchain.channel
        );
    }
    Ok(file.toolchain)
}

/// Setup's step: the pinned nightly with its components.
pub(super) fn ensure_toolchain(reporter: Reporter) -> Result<()> {
    let pinned = pinned()?;
    let what = format!(
        "{} toolchain with {}",
        pinned.channel,
        pinned.components.join(", ")
    );
    if runs(&pinned.channel) {
        let missing = missing_components(&pinned)?;
        if missing.is_empty() {
            reporter.present(&what);
            return Ok(());
        }
        let mut add = Command::new("rustup");
        add.args(["component", "add"])
            .args(&missing)
            .args(["--toolchain", &pinned.channel]);
        say(&what, "adding its missing components");
        return run_checked(&mut add).with_context(|| install_failed(&what, &shell_line(&add)));
    }
    if let Some(nightly) = installed_nightly_of(&pinned)? {
        // rustup keeps a dated nightly under its dated name; the machine's
        // `nightly` of that very date is the same toolchain (no download).
        let dated = nightly.with_file_name(format!("{}-{}", pinned.channel, host_triple()?));
        symlink(&nightly, &dated)
            .with_context(|| format!("naming {} as {}", nightly.display(), dated.display()))?;
        say(
            &what,
            &format!(
                "the installed nightly is of that date: named {}",
                pinned.channel
            ),
        );
        return ensure_toolchain(reporter);
    }
    let mut install = Command::new("rustup");
    install
        .args([
            "toolchain",
            "install",
            &pinned.channel,
            "--profile",
            "minimal",
        ])
        .arg("--component")
        .arg(pinned.components.join(","));
    say(&what, "installing");
    run_checked(&mut install).with_context(|| install_failed(&what, &shell_line(&install)))?;
    say(&what, "installed");
    Ok(())
}

fn runs(channel: &str) -> bool {
    Command::new("rustc")
        .arg(format!("+{channel}"))
        .arg("--version")
        .env_remove("RUSTUP_TOOLCHAIN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

fn missing_components(pinned: &Pinned) -> Result<Vec<String>> {
    let installed = stdout_of(Command::new("rustup").args([
        "component",
        "list",
        "--toolchain",
        &pinned.channel,
        "--installed",
    ]))?;
    Ok(pinned
        .components
        .iter()
        .filter(|component| !super::has_component(&installed, component))
        .cloned()
        .collect())
}

/// The directory of rustup's `nightly` toolchain when its channel
/// manifest is of the pinned date.
fn installed_nightly_of(pinned: &Pinned) -> Result<Option<PathBuf>> {
    let Ok(sysroot) = stdout_of(
        Command::new("rustc")
            .args(["+nightly", "--print", "sysroot"])
            .env_remove("RUSTUP_TOOLCHAIN"),
    ) else {
        return Ok(None);
    };
    let sysroot = PathBuf::from(sysroot.trim());
    let manifest = sysroot.join("lib/rustlib/multirust-channel-manifest.toml");
    let Ok(text) = fs::read_to_string(&manifest) else {
        return Ok(None);
    };
    let date = manifest_date(&text)
        .with_context(|| format!("reading the date of {}", manifest.display()))?;
    Ok((Some(date.as_str()) == pinned.date()).then_some(sysroot))
}

/// A rustup channel manifest's `date`.
fn manifest_date(text: &str) -> Result<String> {
    #[derive(Deserialize)]
    struct Manifest {
        date: String,
    }
    Ok(toml::from_str::<Manifest>(text)?.date)
}

fn host_triple() -> Result<String> {
    let verbose = stdout_of(Command::new("rustc").arg("-vV"))?;
    verbose_field(&verbose, "host").context("`rustc -vV` names no host")
}

/// A `rustc -vV` field's value.
fn verbose_field(verbose: &str, field: &str) -> Option<String> {
    verbose
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(": "))
        .map(|value| value.trim().to_owned())
}

/// The major version of the LLVM the pinned nightly is built with.
fn llvm_major(pinned: &Pinned) -> Result<u32> {
    let verbose = stdout_of(
        Command::new("rustc")
            .args([&pinned.plus(), "-vV"])
            .env_remove("RUSTUP_TOOLCHAIN"),
    )?;
    let version = verbose_field(&verbose, "LLVM version")
        .with_context(|| format!("`rustc {} -vV` names no LLVM version", pinned.plus()))?;
    version
        .split('.')
        .next()
        .and_then(|major| major.parse().ok())
        .with_context(|| format!("LLVM version `{version}`"))
}

// ---- bpf-linker ------------------------------------------------------------

/// Setup's step: bpf-linker at the pinned version.
pub(super) fn ensure_bpf_linker(reporter: Reporter) -> Result<()> {
    let what = format!("bpf-linker {BPF_LINKER_VERSION}");
    let installed = stdout_of(Command::new("bpf-linker").arg("--version")).ok();
    if installed.as_deref().map(str::trim) == Some(&format!("bpf-linker {BPF_LINKER_VERSION}")) {
        reporter.present(&what);
        return Ok(());
    }
    let pinned = pinned()?;
    let major = llvm_major(&pinned)?;
    let mut install = install_command(&pinned, major)?;
    say(
        &what,
        &format!(
            "installing for {}'s LLVM {major} (about a minute)",
            pinned.channel
        ),
    );
    run_checked(&mut install).with_context(|| install_failed(&what, &by_hand(&pinned, major)))?;
    if !stdout_of(Command::new("bpf-linker").arg("--version"))
        .is_ok_and(|out| out.contains(BPF_LINKER_VERSION))
    {
        bail!(
            "bpf-linker {BPF_LINKER_VERSION} was installed but `bpf-linker --version` does not \
             name it: is cargo's bin directory (~/.cargo/bin) on PATH, ahead of another one?"
        );
    }
    say(&what, "installed");
    Ok(())
}

/// `cargo install bpf-linker` linked to the pinned nightly's own libLLVM
/// shared library, so no system LLVM is needed.
fn install_command(pinned: &Pinned, major: u32) -> Result<Command> {
    let sysroot = stdout_of(
        Command::new("rustc")
            .args([&pinned.plus(), "--print", "sysroot"])
            .env_remove("RUSTUP_TOOLCHAIN"),
    )?;
    let lib_dir = Path::new(sysroot.trim()).join("lib");
    let libllvm = find_libllvm(&lib_dir, major)?;
    let lib = lib_dir.display();
    let rustflags =
        format!("-C link-arg=-L{lib} -C link-arg=-l:{libllvm} -C link-arg=-Wl,-rpath,{lib}");
    let mut install = Command::new("cargo");
    install
        .arg(pinned.plus())
        .args(["install", "bpf-linker", "--locked", "--force"])
        .args(["--version", BPF_LINKER_VERSION, "--no-default-features"])
        .arg("--features")
        .arg(format!("llvm-{major},no-llvm-linking"))
        .env("RUSTFLAGS", rustflags)
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_BUILD_RUSTFLAGS")
        .stdin(Stdio::null());
    Ok(install)
}

fn by_hand(pinned: &Pinned, major: u32) -> String {
    let plus = pinned.plus();
    format!(
        r#"L=$(rustc {plus} --print sysroot)/lib; RUSTFLAGS="-C link-arg=-L$L -C link-arg=-l:$(basename $L/libLLVM-{major}-*.so) -C link-arg=-Wl,-rpath,$L" cargo {plus} install bpf-linker --locked --force --version {BPF_LINKER_VERSION} --no-default-features --features llvm-{major},no-llvm-linking"#
    )
}

/// The file name of `libLLVM-<major>-*.so` in `lib_dir`.
fn find_libllvm(lib_dir: &Path, major: u32) -> Result<String> {
    let names: Vec<String> = fs::read_dir(lib_dir)
        .with_context(|| format!("list {}", lib_dir.display()))?
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .collect();
    pick_libllvm(&names, major).with_context(|| {
        let llvm: Vec<&String> = names.iter().filter(|n| n.starts_with("libLLVM")).collect();
        format!(
            "no libLLVM-{major}-*.so in {} (found: {llvm:?}); bpf-linker's llvm-{major} \
             feature needs the toolchain's LLVM {major}",
            lib_dir.display()
        )
    })
}

fn pick_libllvm(names: &[String], major: u32) -> Option<String> {
    let prefix = format!("libLLVM-{major}-");
    let mut matching: Vec<&String> = names
        .iter()
        .filter(|name| name.starts_with(&prefix))
        .filter(|name| Path::new(name).extension().is_some_and(|ext| ext == "so"))
        .collect();
    matching.sort();
    matching.first().map(|name| (*name).clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_repositorys_toolchain_file_pins_a_dated_nightly_with_its_components() {
        let pinned = pinned().unwrap();
        assert!(pinned.date().is_some_and(|date| date.len() == 10));
        for component in ["rust-src", "rustfmt", "clippy"] {
            assert!(
                pinned.components.iter().any(|c| c == component),
                "{component}"
            );
        }
        assert!(parse("[toolchain]\nchannel = \"nightly\"\n").is_err());
    }

    #[test]
    fn the_llvm_version_and_host_are_read_from_rustc() {
        let verbose = "rustc 1.97.0-nightly (e50aa6fba 2026-05-19)\nbinary: rustc\n\
                       host: x86_64-unknown-linux-gnu\nLLVM version: 22.1.4\n";
        assert_eq!(
            verbose_field(verbose, "LLVM version").as_deref(),
            Some("22.1.4")
        );
        assert_eq!(
            verbose_field(verbose, "host").as_deref(),
            Some("x86_64-unknown-linux-gnu")
        );
        assert_eq!(
            manifest_date("date = \"2026-05-20\"\n[pkg.rustc]\nversion = \"1\"\n").unwrap(),
            "2026-05-20"
        );
    }

    #[test]
    fn libllvm_of_the_wanted_major_is_picked() {
        let names: Vec<String> = [
            "libLLVM.so.22.1-rust-1.97.0-nightly",
            "librustc_driver-b5a965480ee51f9a.so",
            "libLLVM-22-rust-1.97.0-nightly.so",
            "rustlib",
        ]
        .map(String::from)
        .into();
        assert_eq!(
            pick_libllvm(&names, 22).as_deref(),
            Some("libLLVM-22-rust-1.97.0-nightly.so")
        );
        assert_eq!(pick_libllvm(&names, 21), None);
    }

    #[test]
    fn libllvm_lookup_reads_the_directory() {
        let dir = std::env::temp_dir().join(format!("xtask-libllvm-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("libLLVM-22-rust-1.97.0-nightly.so"), b"").unwrap();
        let found = find_libllvm(&dir, 22).unwrap();
        let missing = find_libllvm(&dir, 23).unwrap_err();
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(found, "libLLVM-22-rust-1.97.0-nightly.so");
        assert!(format!("{missing:#}").contains("libLLVM-22-rust-1.97.0-nightly.so"));
    }
}
