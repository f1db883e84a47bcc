//! The kernels of the test matrix: Debian's builds of the kernels EKS nodes
//! run, fetched from the machine's own Debian mirror with a private apt
//! configuration (the machine's sources are never changed), the image
//! cached under [`KERNELS_DIR`] and the modules installed where the guest,
//! which boots with this machine's root filesystem, looks for them.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

use crate::setup::{run_checked, shell_line, stdout_of};

/// A kernel of the matrix.
pub struct Kernel {
    /// What `cargo xtask test --kernel` calls it.
    pub name: &'static str,
    /// The Debian suite whose `linux-image-amd64` brings it.
    pub suite: &'static str,
    /// Which EKS nodes run it.
    pub runs_on: &'static str,
    /// Whether it has TCX links (6.6 and later): without them the agent's
    /// own choice of attach mode is clsact.
    pub tcx: bool,
}

/// The kernels EKS nodes run that this machine (6.18) does not.
pub const KERNELS: [Kernel; 2] = [
    Kernel {
        name: "6.1",
        suite: "bookworm",
        runs_on: "Amazon Linux 2023 for Kubernetes 1.30-1.32",
        tcx: false,
    },
    Kernel {
        name: "6.12",
        suite: "bookworm-backports",
        runs_on: "Amazon Linux 2023 and Bottlerocket for Kubernetes 1.33-1.35",
        tcx: true,
    },
];

/// Where the kernels and the private apt configuration live.
pub const KERNELS_DIR: &str = "/var/lib/vpcnet-lab/kernels";

/// Where the guest's modprobe finds modules: the host's root is the
/// guest's.
const MODULES_DIR: &str = "/usr/lib/modules";

/// The package that depends on a suite's current kernel image.
const META_PACKAGE: &str = "linux-image-amd64";

/// A kernel fetched and ready to boot.
#[derive(Clone, Debug)]
pub struct Installed {
    /// `uname -r` in the guest.
    pub release: String,
    pub vmlinuz: PathBuf,
}

impl Kernel {
    pub fn by_name(name: &str) -> Option<&'static Self> {
        KERNELS.iter().find(|kernel| kernel.name == name)
    }

    fn dir(&self) -> PathBuf {
        Path::new(KERNELS_DIR).join(self.name)
    }

    /// The kernel, when it is cached and its modules are installed.
    pub fn installed(&self) -> Option<Installed> {
        let dir = self.dir();
        let release = fs::read_to_string(dir.join("release")).ok()?;
        let release = release.trim().to_owned();
        let vmlinuz = dir.join("vmlinuz");
        let modules_ready = Path::new(MODULES_DIR)
            .join(&release)
            .join("modules.dep")
            .is_file();
        (vmlinuz.is_file() && modules_ready).then_some(Installed { release, vmlinuz })
    }

    /// Fetches the suite's current kernel image, caches it and installs its
    /// modules. The release file is written last: a run cut short leaves a
    /// kernel that [`Kernel::installed`] does not count.
    pub fn install(&self) -> Result<Installed> {
        let apt = PrivateApt::new(self.suite)?;
        apt.update()?;
        let package = apt.image_package()?;
        let staging = Path::new(KERNELS_DIR).join(format!("{}.new", self.name));
        let _ = fs::remove_dir_all(&staging);
        fs::create_dir_all(&staging).with_context(|| format!("create {}", staging.display()))?;
        let installed = apt
            .download(&package, &staging)
            .and_then(|deb| self.unpack(&deb, &staging));
        let _ = fs::remove_dir_all(&staging);
        installed.with_context(|| format!("installing {package} (kernel {})", self.name))
    }

    fn unpack(&self, deb: &Path, staging: &Path) -> Result<Installed> {
        let root = staging.join("root");
        run_checked(Command::new("dpkg-deb").arg("-x").arg(deb).arg(&root))?;
        let modules = ["lib/modules", "usr/lib/modules"]
            .iter()
            .map(|dir| root.join(dir))
            .find(|dir| dir.is_dir())
            .with_context(|| format!("no lib/modules in {}", deb.display()))?;
        let release = single_entry(&modules)?;
        let image = root.join("boot").join(format!("vmlinuz-{release}"));
        anyhow::ensure!(
            image.is_file(),
            "no {} in {}",
            image.display(),
            deb.display()
        );

        let target = Path::new(MODULES_DIR).join(&release);
        let partial = Path::new(MODULES_DIR).join(format!("{release}.partial"));
        let _ = fs::remove_dir_all(&partial);
        let _ = fs::remove_dir_all(&target);
        fs::create_dir_all(MODULES_DIR).with_context(|| format!("create {MODULES_DIR}"))?;
        run_checked(
            Command::new("cp")
                .arg("-a")
                .arg(modules.join(&release))
                .arg(&partial),
        )?;
        fs::rename(&partial, &target)
            .with_context(|| format!("rename {} to {}", partial.display(), target.display()))?;
        run_checked(Command::new("depmod").arg(&release))?;

        let dir = self.dir();
        fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let vmlinuz = dir.join("vmlinuz");
        fs::copy(&image, &vmlinuz)
            .with_context(|| format!("copy {} to {}", image.display(), vmlinuz.display()))?;
        fs::write(dir.join("release"), format!("{release}\n"))
            .with_context(|| format!("write {}", dir.join("release").display()))?;
        Ok(Installed { release, vmlinuz })
    }
}

/// The one directory in `dir`, by name.
fn single_entry(dir: &Path) -> Result<String> {
    let names: Vec<String> = fs::read_dir(dir)
        .with_context(|| format!("list {}", dir.display()))?
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .collect();
    match names.as_slice() {
        [name] => Ok(name.clone()),
        _ => bail!(
            "expected one kernel release in {}: {names:?}",
            dir.display()
        ),
    }
}

/// apt with a configuration of its own: one suite of the machine's Debian
/// mirror, lists and downloads under [`KERNELS_DIR`]/apt/<suite>.
struct PrivateApt {
    dir: PathBuf,
}

impl PrivateApt {
    fn new(suite: &str) -> Result<Self> {
        let mirror = machine_mirror()?;
        let dir = Path::new(KERNELS_DIR).join("apt").join(suite);
        for sub in ["lists/partial", "archives/partial", "sources.list.d"] {
            fs::create_dir_all(dir.join(sub))
                .with_context(|| format!("create {}", dir.join(sub).display()))?;
        }
        fs::write(dir.join("sources.list"), mirror.source_line(suite))
            .with_context(|| format!("write {}", dir.join("sources.list").display()))?;
        Ok(Self { dir })
    }

    fn command(&self, program: &str) -> Command {
        let dir = self.dir.display();
        let mut command = Command::new(program);
        command
            .args([
                "-q",
                "-o",
                &format!("Dir::Etc::SourceList={dir}/sources.list"),
                "-o",
                &format!("Dir::Etc::SourceParts={dir}/sources.list.d"),
                "-o",
                &format!("Dir::State::Lists={dir}/lists"),
                "-o",
                &format!("Dir::Cache::Archives={dir}/archives"),
                "-o",
                "Dir::Cache::pkgcache=",
                "-o",
                "Dir::Cache::srcpkgcache=",
                // Downloads land in a directory of root's.
                "-o",
                "APT::Sandbox::User=root",
            ])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null());
        command
    }

    fn update(&self) -> Result<()> {
        let mut update = self.command("apt-get");
        update.arg("update");
        stdout_of(&mut update).map(drop)
    }

    /// The versioned image package the suite's meta package depends on.
    fn image_package(&self) -> Result<String> {
        let mut depends = self.command("apt-cache");
        depends.args(["depends", META_PACKAGE]);
        let listing = stdout_of(&mut depends)?;
        depends_on_image(&listing).with_context(|| {
            format!(
                "`{}` names no linux-image package:\n{listing}",
                shell_line(&depends)
            )
        })
    }

    /// Downloads `package` into `dir`; returns the .deb.
    fn download(&self, package: &str, dir: &Path) -> Result<PathBuf> {
        let mut download = self.command("apt-get");
        download.args(["download", package]).current_dir(dir);
        stdout_of(&mut download)?;
        fs::read_dir(dir)
            .with_context(|| format!("list {}", dir.display()))?
            .filter_map(Result::ok)
            .map(|entry| entry.path())
            .find(|path| path.extension().is_some_and(|ext| ext == "deb"))
            .with_context(|| format!("`{}` left no .deb", shell_line(&download)))
    }
}

/// The first `Depends: linux-image-...` of an `apt-cache depends` listing.
fn depends_on_image(listing: &str) -> Option<String> {
    listing.lines().find_map(|line| {
        let package = line.trim().strip_prefix("Depends:")?.trim();
        package
            .starts_with("linux-image-")
            .then(|| package.to_owned())
    })
}

/// A Debian mirror as the machine's apt sources name it.
#[derive(Debug, PartialEq, Eq)]
struct Mirror {
    uri: String,
    signed_by: Option<String>,
}

impl Mirror {
    fn source_line(&self, suite: &str) -> String {
        let options = self
            .signed_by
            .as_ref()
            .map_or_else(String::new, |keyring| format!("[signed-by={keyring}] "));
        format!("deb {options}{} {suite} main\n", self.uri)
    }
}

/// The mirror the machine's apt takes its own release from.
fn machine_mirror() -> Result<Mirror> {
    let os_release = fs::read_to_string("/etc/os-release").context("read /etc/os-release")?;
    let codename = os_release
        .lines()
        .find_map(|line| line.strip_prefix("VERSION_CODENAME="))
        .map(|value| value.trim_matches('"').to_owned())
        .context("no VERSION_CODENAME in /etc/os-release (is this Debian?)")?;
    let mut files: Vec<PathBuf> = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(entries) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut parts: Vec<PathBuf> = entries.filter_map(|e| Some(e.ok()?.path())).collect();
        parts.sort();
        files.extend(parts);
    }
    for file in &files {
        let Ok(text) = fs::read_to_string(file) else {
            continue;
        };
        let found = match file.extension().and_then(|e| e.to_str()) {
            Some("sources") => mirror_in_deb822(&text, &codename),
            Some("list") => mirror_in_one_line(&text, &codename),
            _ => None,
        };
        if let Some(mirror) = found {
            return Ok(mirror);
        }
    }
    bail!(
        "no apt source of this machine serves its release `{codename}` (looked in /etc/apt/sources.list \
         and /etc/apt/sources.list.d): the kernels of the test matrix come from that mirror"
    )
}

/// The first deb822 stanza (`.sources`) of type `deb` serving `suite`.
fn mirror_in_deb822(text: &str, suite: &str) -> Option<Mirror> {
    text.split("\n\n").find_map(|stanza| {
        let field = |name: &str| {
            stanza.lines().find_map(|line| {
                let (key, value) = line.split_once(':')?;
                key.trim()
                    .eq_ignore_ascii_case(name)
                    .then(|| value.trim().to_owned())
            })
        };
        let enabled = field("Enabled").is_none_or(|v| !v.eq_ignore_ascii_case("no"));
        let is_deb = field("Types").is_some_and(|t| t.split_whitespace().any(|t| t == "deb"));
        let serves = field("Suites").is_some_and(|s| s.split_whitespace().any(|s| s == suite));
        if !(enabled && is_deb && serves) {
            return None;
        }
        Some(Mirror {
            uri: field("URIs")?.split_whitespace().next()?.to_owned(),
            signed_by: field("Signed-By").filter(|k| k.starts_with('/')),
        })
    })
}

/// The first one-line source (`.list`) of type `deb` serving `suite`.
fn mirror_in_one_line(text: &str, suite: &str) -> Option<Mirror> {
    text.lines().find_map(|line| {
        let line = line.split('#').next()?.trim();
        let rest = line.strip_prefix("deb ")?.trim_start();
        let (options, rest) = match rest.strip_prefix('[') {
            Some(bracketed) => bracketed.split_once(']')?,
            None => ("", rest),
        };
        let mut words = rest.split_whitespace();
        let uri = words.next()?;
        (words.next()? == suite).then(|| Mirror {
            uri: uri.to_owned(),
            signed_by: options
                .split_whitespace()
                .find_map(|o| o.strip_prefix("signed-by="))
                .map(str::to_owned),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mirror_is_the_deb822_stanza_of_the_machines_release() {
        let sources = "Types: deb\n\
                       URIs: http://deb.debian.org/debian-security\n\
                       Suites: bookworm-security\n\
                       Components: main\n\
                       \n\
                       Types: deb-src deb\n\
                       # a comment\n\
                       URIs: http://mirror.example/debian http://other.example/debian\n\
                       Suites: bookworm bookworm-updates\n\
                       Components: main\n\
                       Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n";
        let mirror = mirror_in_deb822(sources, "bookworm").unwrap();
        assert_eq!(
            mirror,
            Mirror {
                uri: "http://mirror.example/debian".into(),
                signed_by: Some("/usr/share/keyrings/debian-archive-keyring.gpg".into()),
            }
        );
        assert_eq!(
            mirror.source_line("bookworm-backports"),
            "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] \
             http://mirror.example/debian bookworm-backports main\n"
        );
        assert_eq!(mirror_in_deb822(sources, "trixie"), None);
        let disabled = "Enabled: no\nTypes: deb\nURIs: http://x/debian\nSuites: bookworm\n";
        assert_eq!(mirror_in_deb822(disabled, "bookworm"), None);
    }

    #[test]
    fn the_mirror_is_the_one_line_source_of_the_machines_release() {
        let list = "# deb http://commented.example/debian bookworm main\n\
                    deb-src http://src.example/debian bookworm main\n\
                    deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main contrib\n";
        assert_eq!(
            mirror_in_one_line(list, "bookworm"),
            Some(Mirror {
                uri: "http://mirror.example/debian".into(),
                signed_by: Some("/k.gpg".into()),
            })
        );
        assert_eq!(
            mirror_in_one_line("deb http://m/debian bookworm main\n", "bookworm")
                .unwrap()
                .source_line("bookworm"),
            "deb http://m/debian bookworm main\n"
        );
    }

    #[test]
    fn the_image_package_is_what_the_meta_package_depends_on() {
        let listing = "linux-image-amd64\n  Depends: linux-image-6.12.95+deb12-amd64\n";
        assert_eq!(
            depends_on_image(listing).as_deref(),
            Some("linux-image-6.12.95+deb12-amd64")
        );
        assert_eq!(depends_on_image("linux-image-amd64\n"), None);
    }

    #[test]
    fn kernels_are_found_by_name() {
        assert_eq!(Kernel::by_name("6.1").unwrap().suite, "bookworm");
        assert_eq!(Kernel::by_name("6.12").unwrap().suite, "bookworm-backports");
        assert!(Kernel::by_name("5.10").is_none());
    }
}
