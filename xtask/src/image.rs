//! `cargo xtask image`: vpcnet's container image from the repository and
//! the machine's Debian mirror alone, as an OCI image archive (no
//! registry, no container engine): a Debian root filesystem
//! ([`rootfs`]), the project's binaries in a layer of their own, the
//! entrypoint and labels ([`oci`]). One commit gives one digest: times come
//! from the commit (`SOURCE_DATE_EPOCH`), nothing of the machine goes in.

mod binfmt;
mod commit;
mod oci;
mod rootfs;

use std::{
    collections::BTreeMap,
    fs::{self, File},
    io::BufWriter,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use oci_spec::image::{
    Arch as OciArch, ConfigBuilder, Descriptor, DescriptorBuilder, ImageConfigurationBuilder,
    ImageIndexBuilder, ImageManifestBuilder, MediaType, Os, PlatformBuilder, RootFsBuilder,
    SCHEMA_VERSION,
};
use time::{OffsetDateTime, format_description::well_known::Rfc3339};

use crate::{
    build::{cargo_build, profile_name, target_dir, workspace_root},
    setup::{self, ebpf_toolchain, run_checked, stdout_of},
};

#[derive(clap::Args)]
pub struct Args {
    /// The release profile's binaries (what ships); without it, the debug
    /// profile's (what the lab's tests run).
    #[arg(long)]
    pub release: bool,
    /// The architectures, comma-separated: amd64, arm64. Both make a
    /// multi-architecture index.
    #[arg(long, value_delimiter = ',', default_value = "amd64")]
    pub arch: Vec<Arch>,
    /// Where to write the archive (default:
    /// `target/image/vpcnet-<version>-<profile>.oci.tar`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Take the amd64 binaries from this directory, built already (the
    /// test suite's), instead of building them.
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// The image of this commit (`HEAD~1`, a tag, an id) instead of the
    /// working tree's: its binaries built from a git worktree of it (amd64;
    /// tagged `git-<commit>` unless `--tag` says otherwise).
    #[arg(long, value_name = "REV", conflicts_with = "bin_dir")]
    pub commit: Option<String>,
    /// The image's tag (`vpcnet:<tag>`; default: the version).
    #[arg(long)]
    pub tag: Option<String>,
}

/// An architecture the image is made for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Arch {
    Amd64,
    Arm64,
}

impl Arch {
    /// Debian's and OCI's name.
    pub const fn debian(self) -> &'static str {
        match self {
            Self::Amd64 => "amd64",
            Self::Arm64 => "arm64",
        }
    }

    const fn oci(self) -> OciArch {
        match self {
            Self::Amd64 => OciArch::Amd64,
            Self::Arm64 => OciArch::ARM64,
        }
    }

    /// Rust's target triple; `None`: the machine's own (amd64).
    const fn rust_target(self) -> Option<&'static str> {
        match self {
            Self::Amd64 => None,
            Self::Arm64 => Some("aarch64-unknown-linux-gnu"),
        }
    }
}

/// The image's name, as the manifests name it (`image: vpcnet`).
const NAME: &str = "vpcnet";

/// The agent in the image: its entrypoint.
const AGENT_PLACE: &str = "usr/local/bin/vpcnet-agent";

/// Where the binaries go in the image, by the name cargo gives them (the
/// plugin beside the chained ones, in [`rootfs::PLUGIN_DIR`]).
const BINARIES: [(&str, &str); 2] = [
    ("vpcnet-agent", AGENT_PLACE),
    ("vpcnet-cni", "opt/vpcnet/cni/vpcnet-cni"),
];

pub fn run(args: &Args) -> Result<()> {
    let archive = build(args)?;
    println!("{}", archive.display());
    Ok(())
}

/// Where `cargo xtask image --commit HEAD~1` writes the previous commit's
/// debug image.
pub fn previous_commit_archive() -> Result<PathBuf> {
    let previous = commit::Commit::resolve("HEAD~1")?;
    Ok(commit::default_archive(&target_dir()?, &previous, false))
}

/// Builds the image archive `args` ask for; returns its path.
pub fn build(args: &Args) -> Result<PathBuf> {
    let mut arches = args.arch.clone();
    arches.sort();
    arches.dedup();
    if arches.is_empty() {
        bail!("--arch: name at least one of amd64, arm64");
    }
    if (args.bin_dir.is_some() || args.commit.is_some()) && arches != [Arch::Amd64] {
        bail!("--bin-dir and --commit give one architecture's binaries: only with --arch amd64");
    }
    setup::ensure_image_tools(arches.contains(&Arch::Arm64))?;
    let source = match &args.commit {
        Some(rev) => commit::Commit::resolve(rev)?,
        None => commit::Commit::resolve("HEAD")?,
    };
    let epoch = match std::env::var("SOURCE_DATE_EPOCH") {
        Ok(epoch) => epoch
            .trim()
            .parse()
            .with_context(|| format!("SOURCE_DATE_EPOCH={epoch}: not seconds since 1970"))?,
        Err(_) => source.epoch,
    };
    let revision = source.id.clone();
    let tag = match (&args.tag, &args.commit) {
        (Some(tag), _) => tag.clone(),
        (None, Some(_)) => format!("git-{}", source.short()),
        (None, None) => env!("CARGO_PKG_VERSION").to_owned(),
    };
    let bin_dir = match &args.commit {
        Some(_) => {
            println!("image: commit {}: building its binaries", source.short());
            Some(source.build_binaries(args.release)?)
        }
        None => args.bin_dir.clone(),
    };
    let toolchains = toolchains()?;
    let profile = profile_name(args.release);
    let work = target_dir()?.join("image").join(format!("work-{profile}"));
    let _ = fs::remove_dir_all(&work);
    let mut layout = oci::Layout::new(&work.join("blobs"))?;
    let mut manifests = Vec::new();
    for &arch in &arches {
        let binaries = bin_dir.as_ref().map(|dir| {
            BINARIES
                .iter()
                .map(|(name, _)| (*name, dir.join(name)))
                .collect()
        });
        let piece = Piece {
            arch,
            epoch,
            revision: &revision,
            toolchains: &toolchains,
            release: args.release,
            work: &work,
        };
        manifests.push(piece.manifest(&mut layout, binaries)?);
    }
    let index = layout_index(&mut layout, manifests, &tag)?;
    let archive = match (&args.out, &args.commit) {
        (Some(out), _) => out.clone(),
        (None, Some(_)) => commit::default_archive(&target_dir()?, &source, args.release),
        (None, None) => target_dir()?.join("image").join(format!(
            "vpcnet-{}-{profile}.oci.tar",
            env!("CARGO_PKG_VERSION")
        )),
    };
    layout.write_archive(&index, &archive, epoch)?;
    let _ = fs::remove_dir_all(&work);
    Ok(archive)
}

/// One architecture's image in the making.
struct Piece<'a> {
    arch: Arch,
    epoch: u64,
    revision: &'a str,
    toolchains: &'a str,
    release: bool,
    work: &'a Path,
}

impl Piece<'_> {
    /// Makes the root filesystem and the binaries' layer, adds them, the
    /// configuration and the manifest to `layout`; returns the manifest's
    /// descriptor with its platform. `binaries`: built already.
    fn manifest(
        &self,
        layout: &mut oci::Layout,
        binaries: Option<BTreeMap<&'static str, PathBuf>>,
    ) -> Result<Descriptor> {
        let arch = self.arch;
        let dir = rootfs::work_dir(self.work, arch)?;
        println!("image: {}: the root filesystem (mmdebstrap)", arch.debian());
        let rootfs_tar = dir.join("rootfs.tar");
        let packages = rootfs::make(arch, self.epoch, &rootfs_tar)?;
        let profile = profile_name(self.release);
        println!("image: {}: vpcnet's binaries ({profile})", arch.debian());
        let binaries = match binaries {
            Some(binaries) => binaries,
            None => self::binaries(arch, self.release)?,
        };
        if arch == Arch::Arm64 {
            smoke_under_qemu(&binaries)?;
        }
        let binaries_tar = dir.join("vpcnet.tar");
        binaries_layer(&binaries, &binaries_tar, self.epoch)?;
        let layers = [
            layout.add_layer(&rootfs_tar)?,
            layout.add_layer(&binaries_tar)?,
        ];
        let config = image_config(
            arch,
            self.epoch,
            Labels {
                revision: self.revision,
                toolchains: self.toolchains,
                packages: &packages,
            },
            &layers,
        )?;
        let config = layout.add_json(
            &format!("config-{}.json", arch.debian()),
            &config,
            MediaType::ImageConfig,
        )?;
        let manifest = ImageManifestBuilder::default()
            .schema_version(SCHEMA_VERSION)
            .media_type(MediaType::ImageManifest)
            .config(config)
            .layers(
                layers
                    .iter()
                    .map(|layer| layer.descriptor.clone())
                    .collect::<Vec<_>>(),
            )
            .build()
            .context("the image manifest")?;
        let manifest = layout.add_json(
            &format!("manifest-{}.json", arch.debian()),
            &manifest,
            MediaType::ImageManifest,
        )?;
        with_platform(&manifest, arch)
    }
}

/// The layout's `index.json`: one architecture's manifest, or an image
/// index of several (as a registry's multi-arch tag), named as the
/// manifests name the image.
fn layout_index(
    layout: &mut oci::Layout,
    manifests: Vec<Descriptor>,
    tag: &str,
) -> Result<oci_spec::image::ImageIndex> {
    let mut top = if let [manifest] = manifests.as_slice() {
        manifest.clone()
    } else {
        let index = ImageIndexBuilder::default()
            .schema_version(SCHEMA_VERSION)
            .media_type(MediaType::ImageIndex)
            .manifests(manifests)
            .build()
            .context("the image index")?;
        layout.add_json("index-arches.json", &index, MediaType::ImageIndex)?
    };
    let mut annotations = top.annotations().clone().unwrap_or_default();
    annotations.insert("org.opencontainers.image.ref.name".into(), tag.into());
    // The name containerd gives it on import (`ctr images import`).
    annotations.insert(
        "io.containerd.image.name".into(),
        format!("docker.io/library/{NAME}:{tag}"),
    );
    top.set_annotations(Some(annotations));
    ImageIndexBuilder::default()
        .schema_version(SCHEMA_VERSION)
        .media_type(MediaType::ImageIndex)
        .manifests(vec![top])
        .build()
        .context("the layout's index")
}

/// What built the binaries: the workspace's rustc, the programs' pinned
/// nightly and bpf-linker (recorded in the image, as its packages are).
fn toolchains() -> Result<String> {
    let rustc = stdout_of(
        Command::new("rustc")
            .arg("--version")
            .current_dir(workspace_root()),
    )?;
    let nightly = ebpf_toolchain::pinned()?.channel;
    Ok(format!(
        "{}; eBPF: {nightly}, bpf-linker {}",
        rustc.trim(),
        ebpf_toolchain::BPF_LINKER_VERSION
    ))
}

fn with_platform(manifest: &Descriptor, arch: Arch) -> Result<Descriptor> {
    let platform = PlatformBuilder::default()
        .architecture(arch.oci())
        .os(Os::Linux)
        .build()
        .context("a platform")?;
    Ok(DescriptorBuilder::default()
        .media_type(manifest.media_type().clone())
        .digest(manifest.digest().clone())
        .size(manifest.size())
        .platform(platform)
        .build()?)
}

/// Builds the agent and the plugin for `arch`; their paths by name.
fn binaries(arch: Arch, release: bool) -> Result<BTreeMap<&'static str, PathBuf>> {
    let mut build = cargo_build(release);
    build.args([
        "--locked",
        "-p",
        "vpcnet-agent",
        "-p",
        "vpcnet-cni",
        "--bins",
    ]);
    let mut dir = target_dir()?;
    if let Some(target) = arch.rust_target() {
        build.args(["--target", target]);
        // Debian's cross toolchain links, and compiles the C inside some
        // dependencies.
        build
            .env("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER", CROSS_GCC)
            .env("CC_aarch64_unknown_linux_gnu", CROSS_GCC)
            .env("AR_aarch64_unknown_linux_gnu", "aarch64-linux-gnu-ar");
        dir = dir.join(target);
    }
    run_checked(&mut build).with_context(|| format!("building for {}", arch.debian()))?;
    let dir = dir.join(profile_name(release));
    Ok(BINARIES
        .iter()
        .map(|(name, _)| (*name, dir.join(name)))
        .collect())
}

/// Debian's cross compiler for arm64.
const CROSS_GCC: &str = "aarch64-linux-gnu-gcc";

/// Runs the arm64 binaries under `qemu-aarch64-static`: the agent's
/// version, and its embedded object parsed (`verifier --dry-run` loads
/// nothing into the kernel).
fn smoke_under_qemu(binaries: &BTreeMap<&'static str, PathBuf>) -> Result<()> {
    let agent = &binaries["vpcnet-agent"];
    for args in [&["--version"][..], &["verifier", "--dry-run"][..]] {
        let out = stdout_of(
            Command::new(binfmt::QEMU_AARCH64)
                .args(["-L", "/usr/aarch64-linux-gnu"])
                .arg(agent)
                .args(args),
        )
        .with_context(|| format!("running the arm64 agent with {args:?} under qemu"))?;
        println!(
            "image: arm64: vpcnet-agent {}: {}",
            args.join(" "),
            out.trim()
        );
    }
    Ok(())
}

/// The layer of vpcnet's own files: the binaries at their places.
fn binaries_layer(
    binaries: &BTreeMap<&'static str, PathBuf>,
    out: &Path,
    epoch: u64,
) -> Result<()> {
    let file = File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut tar = oci::DeterministicTar::new(BufWriter::new(file), epoch);
    let mut dirs: Vec<String> = Vec::new();
    for (name, place) in BINARIES {
        let path = &binaries[name];
        let mut parent = String::new();
        for part in place.split('/').take(place.matches('/').count()) {
            parent = if parent.is_empty() {
                part.to_owned()
            } else {
                format!("{parent}/{part}")
            };
            if !dirs.contains(&parent) {
                tar.dir(&parent)?;
                dirs.push(parent.clone());
            }
        }
        let size = fs::metadata(path)
            .with_context(|| format!("{}: not built", path.display()))?
            .len();
        let data = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        tar.file(place, 0o755, data, size)?;
    }
    tar.finish()?;
    Ok(())
}

/// What the image's labels record of its making.
#[derive(Clone, Copy)]
struct Labels<'a> {
    revision: &'a str,
    toolchains: &'a str,
    packages: &'a str,
}

/// The image's configuration: what runs, its labels, its layers.
fn image_config(
    arch: Arch,
    epoch: u64,
    made: Labels<'_>,
    layers: &[oci::Layer],
) -> Result<oci_spec::image::ImageConfiguration> {
    let created = OffsetDateTime::from_unix_timestamp(i64::try_from(epoch)?)
        .context("the commit's time")?
        .format(&Rfc3339)
        .context("formatting the commit's time")?;
    let labels = [
        ("org.opencontainers.image.title", "vpcnet".to_owned()),
        (
            "org.opencontainers.image.description",
            "An eBPF datapath for the AWS VPC CNI: agent, eBPF programs and CNI plugin".to_owned(),
        ),
        (
            "org.opencontainers.image.version",
            env!("CARGO_PKG_VERSION").to_owned(),
        ),
        (
            "org.opencontainers.image.revision",
            made.revision.to_owned(),
        ),
        ("org.opencontainers.image.created", created.clone()),
        (
            "org.opencontainers.image.licenses",
            env!("CARGO_PKG_LICENSE").to_owned(),
        ),
        (
            "org.opencontainers.image.base.name",
            format!("debian:{}", rootfs::SUITE),
        ),
        (
            "dev.vpcnet.image.debian-packages",
            made.packages.lines().collect::<Vec<_>>().join(", "),
        ),
        ("dev.vpcnet.image.toolchains", made.toolchains.to_owned()),
    ]
    .into_iter()
    .map(|(key, value)| (key.to_owned(), value))
    .collect();
    let config = ConfigBuilder::default()
        .entrypoint(vec![format!("/{AGENT_PLACE}")])
        .cmd(vec!["run".to_owned(), "--ipam".to_owned()])
        .env(vec![
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_owned(),
        ])
        .labels::<std::collections::HashMap<String, String>>(labels)
        .build()
        .context("the image's run configuration")?;
    let rootfs = RootFsBuilder::default()
        .typ("layers")
        .diff_ids(
            layers
                .iter()
                .map(|layer| layer.diff_id.to_string())
                .collect::<Vec<_>>(),
        )
        .build()
        .context("the image's rootfs")?;
    ImageConfigurationBuilder::default()
        .created(created)
        .architecture(arch.oci())
        .os(Os::Linux)
        .config(config)
        .rootfs(rootfs)
        .build()
        .context("the image's configuration")
}
