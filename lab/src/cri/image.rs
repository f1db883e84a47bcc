//! The sandbox ("pause") image, built here: the lab has no registry, so the
//! image containerd's CRI runs as every pod's sandbox is made from Debian's
//! static busybox and imported with `ctr`.
//!
//! It is an OCI image layout in a tar (what `ctr images import` reads):
//! `oci-layout`, `index.json` and three blobs under `blobs/sha256/`, the
//! image config, the manifest and one uncompressed layer holding
//! `/bin/busybox`. Every byte is fixed (no timestamps), so the digests are
//! the same on every build.
//!
//! The sandbox runs a shell that exits on SIGTERM or SIGINT (as the real
//! pause does: a process that is pid 1 of its namespace ignores signals it
//! has no handler for) and otherwise waits forever; containerd 1.6 stops a
//! sandbox with SIGKILL anyway.

use std::{
    fmt::Write as _,
    fs,
    path::Path,
    process::{Command, Stdio},
};

use sha2::{Digest, Sha256};
use tracing::info;

use super::{Context, CriError, Result, sweep::check_output};

/// The image's name; the CRI's `sandbox_image`.
pub const PAUSE_IMAGE: &str = "vpcnet.lab/pause:1";
/// The repository part of [`PAUSE_IMAGE`] (`ctr import --base-name`).
const PAUSE_IMAGE_REPOSITORY: &str = "vpcnet.lab/pause";
/// The tag part of [`PAUSE_IMAGE`] (the OCI `ref.name` annotation).
const PAUSE_IMAGE_TAG: &str = "1";
/// Debian's `busybox-static` package puts a static busybox here.
pub const STATIC_BUSYBOX: &str = "/bin/busybox";
/// The containerd namespace the CRI plugin keeps its images in.
pub const CRI_CONTAINERD_NAMESPACE: &str = "k8s.io";

/// The sandbox's command: wait forever, exit 0 on SIGTERM or SIGINT.
const PAUSE_ENTRYPOINT: [&str; 4] = [
    "/bin/busybox",
    "sh",
    "-c",
    "trap 'exit 0' TERM INT; while :; do /bin/busybox sleep 2147483647 & wait $!; done",
];

const MEDIA_TYPE_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const MEDIA_TYPE_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MEDIA_TYPE_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const MEDIA_TYPE_LAYER: &str = "application/vnd.oci.image.layer.v1.tar";

/// A built image: the OCI layout tar and what it holds.
#[derive(Debug, Clone)]
pub struct PauseImage {
    /// The OCI image layout, as a tar.
    pub archive: Vec<u8>,
    /// `sha256:<hex>` of the manifest (the image's digest).
    pub manifest_digest: String,
    /// `sha256:<hex>` of the config (the image id containerd shows).
    pub config_digest: String,
    /// `sha256:<hex>` of the layer (its diff id too: it is uncompressed).
    pub layer_digest: String,
}

impl PauseImage {
    /// Builds the image around the static busybox at `busybox`.
    pub fn build(busybox: &Path) -> Result<Self> {
        let binary = fs::read(busybox).context(|| {
            format!(
                "reading {} for the pause image (Debian's busybox-static package has it)",
                busybox.display()
            )
        })?;
        if !is_static_elf(&binary) {
            return Err(CriError::InvalidOption(format!(
                "{} is not a statically linked ELF program; the pause image needs one \
                 (install Debian's busybox-static)",
                busybox.display()
            )));
        }

        let mut layer = TarWriter::default();
        layer.directory("bin/");
        layer.file("bin/busybox", 0o755, &binary);
        let layer = layer.finish();
        let layer_digest = sha256_digest(&layer);

        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": oci_architecture(),
            "os": "linux",
            "config": {
                "Entrypoint": PAUSE_ENTRYPOINT,
                "Env": ["PATH=/bin"],
                "WorkingDir": "/",
            },
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
            "history": [{"created_by": "vpcnet-lab: the static busybox as a pause image"}],
        }))
        .expect("a JSON value serializes");
        let config_digest = sha256_digest(&config);

        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_MANIFEST,
            "config": descriptor(MEDIA_TYPE_CONFIG, &config_digest, config.len()),
            "layers": [descriptor(MEDIA_TYPE_LAYER, &layer_digest, layer.len())],
        }))
        .expect("a JSON value serializes");
        let manifest_digest = sha256_digest(&manifest);

        let mut manifest_descriptor =
            descriptor(MEDIA_TYPE_MANIFEST, &manifest_digest, manifest.len());
        manifest_descriptor["platform"] =
            serde_json::json!({"architecture": oci_architecture(), "os": "linux"});
        manifest_descriptor["annotations"] = serde_json::json!({
            "io.containerd.image.name": PAUSE_IMAGE,
            "org.opencontainers.image.ref.name": PAUSE_IMAGE_TAG,
        });
        let index = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_INDEX,
            "manifests": [manifest_descriptor],
        }))
        .expect("a JSON value serializes");

        let mut archive = TarWriter::default();
        archive.file("oci-layout", 0o644, br#"{"imageLayoutVersion":"1.0.0"}"#);
        archive.file("index.json", 0o644, &index);
        archive.directory("blobs/");
        archive.directory("blobs/sha256/");
        for (digest, blob) in [
            (&config_digest, &config),
            (&manifest_digest, &manifest),
            (&layer_digest, &layer),
        ] {
            archive.file(&blob_path(digest), 0o644, blob);
        }
        Ok(Self {
            archive: archive.finish(),
            manifest_digest,
            config_digest,
            layer_digest,
        })
    }
}

/// Imports [`PAUSE_IMAGE`] into the containerd on `socket` (unpacked for
/// `snapshotter`, as the CRI needs it) unless it is there. `work_dir` holds
/// the archive while `ctr` reads it.
pub fn ensure_pause_image(socket: &Path, snapshotter: &str, work_dir: &Path) -> Result<()> {
    if image_present(socket, PAUSE_IMAGE)? {
        return Ok(());
    }
    let image = PauseImage::build(Path::new(STATIC_BUSYBOX))?;
    let archive_path = work_dir.join("pause-image.tar");
    fs::write(&archive_path, &image.archive)
        .context(|| format!("writing {}", archive_path.display()))?;
    let imported = import_archive(
        socket,
        snapshotter,
        &archive_path,
        Some(PAUSE_IMAGE_REPOSITORY),
    );
    let _ = fs::remove_file(&archive_path);
    let output = imported?;
    if !image_present(socket, PAUSE_IMAGE)? {
        return Err(CriError::BadResponse {
            call: "ctr images import",
            reason: format!(
                "{PAUSE_IMAGE} is not listed after the import; ctr said: {}",
                String::from_utf8_lossy(&output.stdout).trim()
            ),
        });
    }
    info!(image = PAUSE_IMAGE, digest = %image.manifest_digest, "pause image imported");
    Ok(())
}

/// Imports the OCI or Docker archive at `archive` into the CRI's namespace
/// of the containerd on `socket`, unpacked for `snapshotter`; `base_name`
/// names an image whose archive does not. Returns `ctr`'s output.
pub fn import_archive(
    socket: &Path,
    snapshotter: &str,
    archive: &Path,
    base_name: Option<&str>,
) -> Result<std::process::Output> {
    let mut import = ctr(socket);
    import.args(["images", "import"]);
    if let Some(base_name) = base_name {
        import.args(["--base-name", base_name]);
    }
    let output = import
        .args(["--snapshotter", snapshotter])
        .arg(archive)
        .output()
        .map_err(|err| super::sweep::spawn_error("ctr", &err))?;
    check_output("ctr images import", &output)?;
    Ok(output)
}

/// Whether containerd on `socket` has image `name` in the CRI's namespace.
fn image_present(socket: &Path, name: &str) -> Result<bool> {
    let output = ctr(socket)
        .args(["images", "list", "--quiet"])
        .output()
        .map_err(|err| super::sweep::spawn_error("ctr", &err))?;
    check_output("ctr images list", &output)?;
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .any(|line| line.trim() == name))
}

fn ctr(socket: &Path) -> Command {
    let mut command = Command::new("ctr");
    command
        .arg("--address")
        .arg(socket)
        .args(["--namespace", CRI_CONTAINERD_NAMESPACE])
        .stdin(Stdio::null());
    command
}

fn descriptor(media_type: &str, digest: &str, size: usize) -> serde_json::Value {
    serde_json::json!({"mediaType": media_type, "digest": digest, "size": size})
}

fn sha256_digest(bytes: &[u8]) -> String {
    let hash = Sha256::digest(bytes);
    let mut digest = String::with_capacity(7 + 64);
    digest.push_str("sha256:");
    for byte in hash {
        let _ = write!(digest, "{byte:02x}");
    }
    digest
}

/// `sha256:<hex>` to `blobs/sha256/<hex>`.
fn blob_path(digest: &str) -> String {
    let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
    format!("blobs/sha256/{hex}")
}

/// The OCI name of the machine's architecture.
fn oci_architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// Whether `binary` is an ELF program without an interpreter (`PT_INTERP`),
/// that is, one that runs in an image holding nothing else.
fn is_static_elf(binary: &[u8]) -> bool {
    const PT_INTERP: u32 = 3;
    let u16_at = |at: usize| Some(u16::from_le_bytes(binary.get(at..at + 2)?.try_into().ok()?));
    let u32_at = |at: usize| Some(u32::from_le_bytes(binary.get(at..at + 4)?.try_into().ok()?));
    let u64_at = |at: usize| Some(u64::from_le_bytes(binary.get(at..at + 8)?.try_into().ok()?));
    // 64-bit little-endian ELF only: what Debian ships for amd64 and arm64.
    if binary.get(..6) != Some(b"\x7fELF\x02\x01".as_slice()) {
        return false;
    }
    let program_headers = (|| {
        let offset = usize::try_from(u64_at(0x20)?).ok()?;
        let entry_size = usize::from(u16_at(0x36)?);
        let count = usize::from(u16_at(0x38)?);
        (0..count)
            .map(|i| u32_at(offset + i * entry_size))
            .collect::<Option<Vec<u32>>>()
    })();
    program_headers.is_some_and(|types| !types.contains(&PT_INTERP))
}

/// Writes a ustar archive of regular files and directories, owned by root,
/// with modification time 0.
#[derive(Default)]
struct TarWriter {
    bytes: Vec<u8>,
}

impl TarWriter {
    const BLOCK: usize = 512;

    fn directory(&mut self, path: &str) {
        self.header(path, 0o755, 0, b'5');
    }

    fn file(&mut self, path: &str, mode: u32, contents: &[u8]) {
        self.header(path, mode, contents.len(), b'0');
        self.bytes.extend_from_slice(contents);
        self.pad();
    }

    /// The archive, with its end marker (two zero blocks).
    fn finish(mut self) -> Vec<u8> {
        self.bytes.resize(self.bytes.len() + 2 * Self::BLOCK, 0);
        self.bytes
    }

    fn header(&mut self, path: &str, mode: u32, size: usize, kind: u8) {
        // The lab's paths are short: no ustar prefix field, no GNU long names.
        assert!(path.len() < 100, "tar path {path:?} is too long");
        let mut header = [0u8; Self::BLOCK];
        header[..path.len()].copy_from_slice(path.as_bytes());
        write_octal(&mut header[100..108], u64::from(mode)); // mode
        write_octal(&mut header[108..116], 0); // uid
        write_octal(&mut header[116..124], 0); // gid
        write_octal(&mut header[124..136], size as u64); // size
        write_octal(&mut header[136..148], 0); // mtime
        header[156] = kind;
        header[257..263].copy_from_slice(b"ustar\0");
        header[263..265].copy_from_slice(b"00");
        header[265..269].copy_from_slice(b"root");
        header[297..301].copy_from_slice(b"root");
        // The checksum counts its own field as eight spaces.
        header[148..156].copy_from_slice(b"        ");
        let checksum: u32 = header.iter().map(|&b| u32::from(b)).sum();
        header[148..155].copy_from_slice(format!("{checksum:06o}\0").as_bytes());
        self.bytes.extend_from_slice(&header);
    }

    fn pad(&mut self) {
        let rem = self.bytes.len() % Self::BLOCK;
        if rem != 0 {
            self.bytes.resize(self.bytes.len() + Self::BLOCK - rem, 0);
        }
    }
}

/// Fills `field` with `value` in octal, zero-padded, NUL-terminated.
fn write_octal(field: &mut [u8], value: u64) {
    let digits = field.len() - 1;
    let text = format!("{value:0digits$o}");
    assert!(
        text.len() == digits,
        "{value} does not fit a {digits}-digit tar field"
    );
    field[..digits].copy_from_slice(text.as_bytes());
    field[digits] = 0;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The contents of archive member `name`.
    fn member<'a>(archive: &'a [u8], name: &str) -> Option<&'a [u8]> {
        let mut at = 0;
        while at + 512 <= archive.len() && archive[at] != 0 {
            let header = &archive[at..at + 512];
            let end = header[..100].iter().position(|&b| b == 0).unwrap_or(100);
            let size_text = std::str::from_utf8(&header[124..135]).ok()?;
            let size = usize::from_str_radix(size_text, 8).ok()?;
            let body = at + 512;
            if &header[..end] == name.as_bytes() {
                return archive.get(body..body + size);
            }
            at = body + size.div_ceil(512) * 512;
        }
        None
    }

    fn fake_static_elf() -> Vec<u8> {
        // An ELF64 header with one PT_LOAD program header at 0x40.
        let mut elf = vec![0u8; 0x40 + 0x38];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[0x20..0x28].copy_from_slice(&0x40u64.to_le_bytes());
        elf[0x36..0x38].copy_from_slice(&0x38u16.to_le_bytes());
        elf[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        elf[0x40..0x44].copy_from_slice(&1u32.to_le_bytes());
        elf
    }

    #[test]
    fn interpreter_makes_an_elf_dynamic() {
        let mut elf = fake_static_elf();
        assert!(is_static_elf(&elf));
        elf[0x40..0x44].copy_from_slice(&3u32.to_le_bytes());
        assert!(!is_static_elf(&elf));
        assert!(!is_static_elf(b"#!/bin/sh\n"));
    }

    #[test]
    fn archive_blobs_match_their_digests_and_sizes() {
        let dir = std::env::temp_dir().join(format!("vpcnet-pause-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let busybox = dir.join("busybox");
        fs::write(&busybox, fake_static_elf()).unwrap();
        let image = PauseImage::build(&busybox);
        fs::remove_dir_all(&dir).unwrap();
        let image = image.unwrap();

        let index: serde_json::Value =
            serde_json::from_slice(member(&image.archive, "index.json").unwrap()).unwrap();
        let entry = &index["manifests"][0];
        assert_eq!(entry["digest"], image.manifest_digest.as_str());
        assert_eq!(
            entry["annotations"]["io.containerd.image.name"],
            PAUSE_IMAGE
        );
        let manifest = member(&image.archive, &blob_path(&image.manifest_digest)).unwrap();
        assert_eq!(sha256_digest(manifest), image.manifest_digest);
        assert_eq!(entry["size"], manifest.len());
        let manifest: serde_json::Value = serde_json::from_slice(manifest).unwrap();
        for descriptor in [&manifest["config"], &manifest["layers"][0]] {
            let digest = descriptor["digest"].as_str().unwrap();
            let blob = member(&image.archive, &blob_path(digest)).unwrap();
            assert_eq!(sha256_digest(blob), digest);
            assert_eq!(descriptor["size"], blob.len());
        }
        let layer = member(&image.archive, &blob_path(&image.layer_digest)).unwrap();
        assert_eq!(member(layer, "bin/busybox").unwrap(), fake_static_elf());
        assert!(member(&image.archive, "oci-layout").is_some());
    }

    #[test]
    fn the_same_input_gives_the_same_digests() {
        let dir = std::env::temp_dir().join(format!("vpcnet-pause-same-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let busybox = dir.join("busybox");
        fs::write(&busybox, fake_static_elf()).unwrap();
        let first = PauseImage::build(&busybox).unwrap();
        let second = PauseImage::build(&busybox).unwrap();
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(first.manifest_digest, second.manifest_digest);
        assert_eq!(first.archive, second.archive);
    }

    #[test]
    fn tar_header_checksum_is_what_tar_computes() {
        let mut tar = TarWriter::default();
        tar.file("a", 0o644, b"x");
        let archive = tar.finish();
        let stored = std::str::from_utf8(&archive[148..154]).unwrap();
        let mut header = archive[..512].to_vec();
        header[148..156].copy_from_slice(b"        ");
        let sum: u32 = header.iter().map(|&b| u32::from(b)).sum();
        assert_eq!(u32::from_str_radix(stored, 8).unwrap(), sum);
        assert_eq!(archive.len(), 512 * 4);
    }
}
