//! An OCI image layout written as one archive (`oci-archive:`), with no
//! registry and nothing of the build's time or place in it: blobs named by
//! their digests, tar entries sorted and dated by `SOURCE_DATE_EPOCH`,
//! gzip headers without a time, so one commit gives one digest.

use std::{
    fs::{self, File},
    io::{self, BufReader, BufWriter, Read, Write},
    path::{Path, PathBuf},
    str::FromStr,
};

use anyhow::{Context, Result};
use flate2::{Compression, GzBuilder};
use oci_spec::image::{Descriptor, DescriptorBuilder, Digest, MediaType, Sha256Digest};
use sha2::{Digest as _, Sha256};

/// A blob kept on disk until the archive is written.
pub struct Blob {
    pub descriptor: Descriptor,
    path: PathBuf,
}

/// The blobs of a layout being made, in `dir`.
pub struct Layout {
    dir: PathBuf,
    blobs: Vec<Blob>,
}

/// What a layer is: its blob (compressed) and its diff ID (the digest of
/// the tar itself), which the image's configuration lists.
pub struct Layer {
    pub descriptor: Descriptor,
    pub diff_id: Digest,
}

/// `value` as JSON with every object's keys sorted: the spec types hold
/// hash maps, whose order changes from run to run.
fn canonical_json(value: &impl serde::Serialize) -> serde_json::Result<Vec<u8>> {
    fn sorted(value: serde_json::Value) -> serde_json::Value {
        match value {
            serde_json::Value::Object(object) => {
                let mut entries: Vec<_> = object.into_iter().collect();
                entries.sort_by(|a, b| a.0.cmp(&b.0));
                serde_json::Value::Object(
                    entries
                        .into_iter()
                        .map(|(key, value)| (key, sorted(value)))
                        .collect(),
                )
            }
            serde_json::Value::Array(items) => {
                serde_json::Value::Array(items.into_iter().map(sorted).collect())
            }
            other => other,
        }
    }
    serde_json::to_vec(&sorted(serde_json::to_value(value)?))
}

/// The SHA-256 of everything `reader` gives, and how many bytes.
fn sha256_of(mut reader: impl Read) -> io::Result<(Sha256Digest, u64)> {
    let mut hasher = Sha256::new();
    let mut buffer = vec![0; 1 << 16];
    let mut size = 0;
    loop {
        let read = reader.read(&mut buffer)?;
        if read == 0 {
            break;
        }
        hasher.update(&buffer[..read]);
        size += read as u64;
    }
    let hex = hex::encode(hasher.finalize());
    let digest = Sha256Digest::from_str(&hex).map_err(io::Error::other)?;
    Ok((digest, size))
}

impl Layout {
    pub fn new(dir: &Path) -> Result<Self> {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            blobs: Vec::new(),
        })
    }

    /// Adds the file at `path` as a blob of `media_type`.
    fn add_file(&mut self, path: &Path, media_type: MediaType) -> Result<Descriptor> {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let (digest, size) = sha256_of(BufReader::new(file))
            .with_context(|| format!("reading {}", path.display()))?;
        let descriptor = DescriptorBuilder::default()
            .media_type(media_type)
            .digest(digest)
            .size(size)
            .build()
            .context("a blob's descriptor")?;
        if !self
            .blobs
            .iter()
            .any(|blob| blob.descriptor.digest() == descriptor.digest())
        {
            self.blobs.push(Blob {
                descriptor: descriptor.clone(),
                path: path.to_path_buf(),
            });
        }
        Ok(descriptor)
    }

    /// Adds `value` as a JSON blob of `media_type`, named `name` in the
    /// work directory.
    pub fn add_json(
        &mut self,
        name: &str,
        value: &impl serde::Serialize,
        media_type: MediaType,
    ) -> Result<Descriptor> {
        let path = self.dir.join(name);
        let json = canonical_json(value).context("serializing a blob")?;
        fs::write(&path, json).with_context(|| format!("writing {}", path.display()))?;
        self.add_file(&path, media_type)
    }

    /// Adds the tar at `tar` as a gzip-compressed layer.
    pub fn add_layer(&mut self, tar: &Path) -> Result<Layer> {
        let file = File::open(tar).with_context(|| format!("opening {}", tar.display()))?;
        let (diff_id, _) = sha256_of(BufReader::new(file))
            .with_context(|| format!("reading {}", tar.display()))?;
        let gz = tar.with_extension("tar.gz");
        {
            let mut input = BufReader::new(File::open(tar)?);
            let output = File::create(&gz).with_context(|| format!("creating {}", gz.display()))?;
            // No name and no time in the gzip header.
            let mut encoder = GzBuilder::new()
                .mtime(0)
                .write(BufWriter::new(output), Compression::default());
            io::copy(&mut input, &mut encoder)
                .with_context(|| format!("compressing {}", tar.display()))?;
            encoder.finish()?.flush()?;
        }
        let descriptor = self.add_file(&gz, MediaType::ImageLayerGzip)?;
        Ok(Layer {
            descriptor,
            diff_id: diff_id.into(),
        })
    }

    /// Writes the layout, with `index` as its `index.json`, as a tar at
    /// `archive`, its entries dated `epoch`.
    pub fn write_archive(
        &self,
        index: &impl serde::Serialize,
        archive: &Path,
        epoch: u64,
    ) -> Result<()> {
        let file =
            File::create(archive).with_context(|| format!("creating {}", archive.display()))?;
        let mut tar = DeterministicTar::new(BufWriter::new(file), epoch);
        let layout = br#"{"imageLayoutVersion":"1.0.0"}"#;
        tar.file("oci-layout", 0o644, layout.as_slice(), layout.len() as u64)?;
        let index = canonical_json(index).context("serializing index.json")?;
        tar.file("index.json", 0o644, index.as_slice(), index.len() as u64)?;
        tar.dir("blobs")?;
        tar.dir("blobs/sha256")?;
        let mut blobs: Vec<&Blob> = self.blobs.iter().collect();
        blobs.sort_by(|a, b| {
            a.descriptor
                .digest()
                .digest()
                .cmp(b.descriptor.digest().digest())
        });
        for blob in blobs {
            let reader = File::open(&blob.path)
                .with_context(|| format!("opening {}", blob.path.display()))?;
            tar.file(
                &format!("blobs/sha256/{}", blob.descriptor.digest().digest()),
                0o644,
                BufReader::new(reader),
                blob.descriptor.size(),
            )?;
        }
        tar.finish()?.flush()?;
        Ok(())
    }
}

/// A tar whose entries say nothing of who made them or when: owner root,
/// time `epoch`, modes as given.
pub struct DeterministicTar<W: Write> {
    builder: tar::Builder<W>,
    epoch: u64,
}

impl<W: Write> DeterministicTar<W> {
    pub fn new(writer: W, epoch: u64) -> Self {
        Self {
            builder: tar::Builder::new(writer),
            epoch,
        }
    }

    fn header(&self, kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut header = tar::Header::new_ustar();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_size(size);
        header.set_mtime(self.epoch);
        header.set_uid(0);
        header.set_gid(0);
        header
    }

    /// A directory entry.
    pub fn dir(&mut self, path: &str) -> Result<()> {
        let mut header = self.header(tar::EntryType::Directory, 0o755, 0);
        self.builder
            .append_data(&mut header, format!("{path}/"), io::empty())
            .with_context(|| format!("adding {path}/ to a tar"))
    }

    /// A file entry of `size` bytes read from `data`.
    pub fn file(&mut self, path: &str, mode: u32, data: impl Read, size: u64) -> Result<()> {
        let mut header = self.header(tar::EntryType::Regular, mode, size);
        self.builder
            .append_data(&mut header, path, data)
            .with_context(|| format!("adding {path} to a tar"))
    }

    pub fn finish(self) -> Result<W> {
        self.builder.into_inner().context("finishing a tar")
    }
}
