//! Log files as aws-node keeps its own (`pkg/utils/logger`, lumberjack's
//! settings): past 100 MB a file is rotated, and the 5 newest rotated
//! files are kept, compressed. One definition for the agent's log and the
//! plugin's.

use std::{fs, io, path::Path};

use file_rotate::{ContentLimit, FileRotate, compression::Compression, suffix::AppendCount};

/// Bytes past which a log file is rotated (after the write that crossed
/// the line: a log line is never cut).
pub const ROTATE_PAST_BYTES: usize = 100 << 20;
/// Rotated files kept: `<file>.1.gz` (the newest) to `<file>.5.gz`.
pub const ROTATED_FILES: usize = 5;

/// A log file at `path`, appended to and rotated as aws-node rotates;
/// its directory made. An error if the file cannot be opened for
/// appending.
pub fn open(path: &Path) -> io::Result<FileRotate<AppendCount>> {
    open_rotating_past(path, ROTATE_PAST_BYTES)
}

/// [`open`], rotating past `bytes`.
fn open_rotating_past(path: &Path, bytes: usize) -> io::Result<FileRotate<AppendCount>> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    // The rotating writer drops an open error; it is seen here.
    drop(
        fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?,
    );
    Ok(FileRotate::new(
        path,
        AppendCount::new(ROTATED_FILES),
        ContentLimit::BytesSurpassed(bytes.max(1)),
        Compression::OnRotate(0),
        None,
    ))
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    #[test]
    fn a_full_file_is_rotated_and_five_compressed_ones_are_kept() {
        let dir = std::env::temp_dir().join(format!("vpcnet-log-files-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let path = dir.join("sub").join("ipamd.log");
        let mut log = open_rotating_past(&path, 100).unwrap();
        let line = [b'x'; 99];
        for _ in 0..8 {
            log.write_all(&line).unwrap();
            log.write_all(b"\n").unwrap();
        }
        drop(log);
        let mut names: Vec<String> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "ipamd.log",
                "ipamd.log.1.gz",
                "ipamd.log.2.gz",
                "ipamd.log.3.gz",
                "ipamd.log.4.gz",
                "ipamd.log.5.gz"
            ]
        );
        // Every line whole, in one file or another.
        assert!(fs::metadata(&path).unwrap().len() <= 100);
        assert!(
            open(&dir.join("sub")).is_err(),
            "a directory is no log file"
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
