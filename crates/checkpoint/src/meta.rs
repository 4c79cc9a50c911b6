//! `cubicle-checkpoint.json`: what Cubicle itself records next to CRIU's images — which
//! mounts were external, how envd's output was connected, the uid range and the format.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// File name of the record inside a checkpoint directory.
pub const META_FILE: &str = "cubicle-checkpoint.json";
/// File name of the staging tmpfs's saved contents.
pub const TMPFS_FILE: &str = "cubicle-tmpfs.bin";
/// Current format; older or newer checkpoints are refused with a clear message.
pub const FORMAT: u32 = 1;

/// How envd's stdout/stderr (its log) was connected when the checkpoint was taken.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "kind")]
pub enum Stdio {
    /// A pipe; a restore hands the new log pipe to CRIU under this key.
    Pipe { key: String },
    /// A host file outside the sandbox (marked external under this key); `mode` is the
    /// file's mode, which CRIU checks on restore.
    File { key: String, mode: u32 },
}

/// The record of one checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Meta {
    /// [`FORMAT`].
    pub format: u32,
    /// The sandbox that was checkpointed.
    pub sandbox_id: String,
    /// Its uid range's base (images and the tmpfs archive are relative to it).
    pub uid_base: u32,
    /// Mount points CRIU was told are external (each gets a source on restore).
    pub externals: Vec<PathBuf>,
    /// envd's output.
    pub stdio: Option<Stdio>,
    /// Unix ms when it was taken.
    pub created_at_ms: u64,
    /// Bytes of CRIU images (memory and process state); 0 if not recorded.
    pub image_bytes: u64,
}

impl Meta {
    /// Reads `<dir>/cubicle-checkpoint.json`.
    pub fn read(dir: &Path) -> Result<Meta> {
        let p = dir.join(META_FILE);
        let text = std::fs::read(&p).map_err(|e| Error::Image {
            dir: dir.to_path_buf(),
            message: format!("cannot read {META_FILE}: {e}"),
        })?;
        let m: Meta = serde_json::from_slice(&text).map_err(|e| Error::Image {
            dir: dir.to_path_buf(),
            message: format!("{META_FILE} is damaged: {e}"),
        })?;
        if m.format != FORMAT {
            return Err(Error::Image {
                dir: dir.to_path_buf(),
                message: format!("format {} (this Cubicle reads format {FORMAT})", m.format),
            });
        }
        Ok(m)
    }

    /// Writes it and renames it into place: a crash leaves the old one or none. (Not
    /// synced: see `archive::save`.)
    pub fn write(&self, dir: &Path) -> Result<()> {
        use std::io::Write;
        let p = dir.join(META_FILE);
        let tmp = dir.join(format!("{META_FILE}.tmp"));
        let body = serde_json::to_vec_pretty(self).map_err(|e| Error::Image {
            dir: dir.to_path_buf(),
            message: format!("encode {META_FILE}: {e}"),
        })?;
        let mut f = std::fs::File::create(&tmp)
            .map_err(|e| Error::io(format!("create {}", tmp.display()), e))?;
        f.write_all(&body)
            .map_err(|e| Error::io(format!("write {}", tmp.display()), e))?;
        std::fs::rename(&tmp, &p).map_err(|e| Error::io(format!("rename {}", p.display()), e))
    }
}
