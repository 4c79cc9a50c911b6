//! The layer store: `<state>/layers/<id>/`, read-only directory trees that templates
//! stack (bottom first) as the lower layers of every sandbox's overlay. A layer is stored
//! once and shared by every template that lists it.
//!
//! Ids are 64 lowercase hex digits (a SHA-256), so a layer's name says what it holds:
//!
//! - an image layer: its OCI *diff id* (the digest of the uncompressed tar), checked while
//!   it is unpacked — the same layer pulled for two images is one directory;
//! - a build step's result: the digest of everything that determines it (the layers
//!   below, the step, the uploaded files' hash, user/workdir/env) — which is also the
//!   build cache's key (see `build/cache.rs`);
//! - a built-in's root filesystem: the digest of its name, builder and build time.
//!
//! Format: overlayfs layers as a sandbox mounts them (`userxattr`): a deleted path is a
//! 0/0 character device ("whiteout"), a directory that hides what lies below carries the
//! xattr `user.overlay.opaque=y`. Files are owned by host uid/gid 0..65535 (the ids inside
//! the sandbox): the runtime idmaps every layer into each sandbox's range.
//!
//! A layer appears atomically: it is written in `layers/.tmp-*` and renamed into place
//! once complete, with its metadata (`<id>.json`: size, what made it, when). Leftover
//! temporary directories (a killed process) are removed by [`LayerStore::open`].

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, IoContext, Result};
use crate::fsutil;

/// What one stored layer is.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LayerInfo {
    /// 64 hex digits.
    pub id: String,
    /// Apparent size of its files in bytes.
    pub size_bytes: u64,
    /// What made it (`image docker.io/library/alpine:3 sha256:…`, `step 2 RUN …`, `tiny/1`).
    pub source: String,
    /// Unix seconds it was stored.
    pub created_at: u64,
    /// Its files were fitted when it was stored: none carries a capability a sandbox
    /// cannot hold (`cubicle_runtime::capabilities::fit_file_capabilities`). False for
    /// layers stored before this was recorded, and when the fitting failed.
    #[serde(default)]
    pub caps_fitted: bool,
}

/// The layers of one state directory.
#[derive(Debug, Clone)]
pub struct LayerStore {
    root: PathBuf,
}

/// Whether `id` is a layer id (64 lowercase hex digits).
pub fn valid_id(id: &str) -> bool {
    id.len() == 64
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A layer being written (`layers/.tmp-*`); removed on drop unless stored.
pub struct Staging {
    dir: PathBuf,
    stored: bool,
}

impl Staging {
    /// The directory to fill.
    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.stored {
            let _ = fsutil::remove_tree(&self.dir);
        }
    }
}

impl LayerStore {
    /// Open (and create) `<state>/layers`, removing leftovers of interrupted writes.
    pub fn open(state_dir: &Path) -> Result<Self> {
        let root = state_dir.join("layers");
        fs::create_dir_all(&root).ctx("mkdir", &root)?;
        let store = LayerStore { root };
        store.remove_stale();
        Ok(store)
    }

    /// `<state>/layers`.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where layer `id` lives (whether or not it exists).
    pub fn path(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }

    /// Whether layer `id` is stored (complete).
    pub fn contains(&self, id: &str) -> bool {
        valid_id(id) && self.root.join(format!("{id}.json")).is_file() && self.path(id).is_dir()
    }

    /// Metadata of layer `id`.
    pub fn info(&self, id: &str) -> Option<LayerInfo> {
        if !valid_id(id) {
            return None;
        }
        fsutil::read_json(&self.root.join(format!("{id}.json"))).ok()
    }

    /// Every stored layer.
    pub fn list(&self) -> Vec<LayerInfo> {
        let Ok(rd) = fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut out: Vec<LayerInfo> = rd
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let id = name.strip_suffix(".json")?;
                self.info(id)
            })
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// A fresh, empty directory to write a layer in.
    pub fn staging(&self) -> Result<Staging> {
        let dir = self.root.join(format!(".tmp-{}", crate::unique_suffix()));
        fs::create_dir(&dir).ctx("mkdir", &dir)?;
        // A layer's root is the sandbox's `/` when it is the topmost: 0755, whatever the umask.
        fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .ctx("chmod", &dir)?;
        Ok(Staging { dir, stored: false })
    }

    /// Store a filled staging directory as layer `id`. If another writer stored the same
    /// id meanwhile, that copy is kept and this one discarded (same id, same content).
    pub fn store(&self, mut staging: Staging, id: &str, source: &str) -> Result<LayerInfo> {
        if !valid_id(id) {
            return Err(Error::InvalidRequest(format!(
                "layer id '{id}' is not 64 hex digits"
            )));
        }
        if self.contains(id) {
            return self.info(id).ok_or_else(|| Error::LayerMissing(id.into()));
        }
        // No file in a layer carries a capability a sandbox cannot hold (the kernel
        // refuses to run such a file: Debian's `ping` has cap_net_raw).
        let caps_fitted = fit_caps(staging.path(), &format!("layer {id}"));
        let info = LayerInfo {
            id: id.to_string(),
            size_bytes: fsutil::tree_size(staging.path()),
            source: source.to_string(),
            created_at: crate::unix_now(),
            caps_fitted,
        };
        let dest = self.path(id);
        if dest.exists() {
            // A directory without metadata: a crash between the two renames below.
            fsutil::remove_tree(&dest)?;
        }
        fs::rename(staging.path(), &dest).ctx("rename", &dest)?;
        staging.stored = true;
        fsutil::write_json_atomic(&self.root.join(format!("{id}.json")), &info)?;
        Ok(info)
    }

    /// Fit the files of stored layer `id` if they were not when it was stored (a layer
    /// of an older store), and record it. Whether they are fitted now.
    pub fn ensure_caps_fitted(&self, id: &str) -> bool {
        let Some(mut info) = self.info(id) else {
            return false;
        };
        if info.caps_fitted {
            return true;
        }
        if !fit_caps(&self.path(id), &format!("layer {id}")) {
            return false;
        }
        info.caps_fitted = true;
        if let Err(e) = fsutil::write_json_atomic(&self.root.join(format!("{id}.json")), &info) {
            tracing::warn!(layer = %id, "recording that its file capabilities are fitted: {e}");
        }
        true
    }

    /// Move an existing directory (on the same filesystem) into the store as layer `id`.
    pub fn adopt(&self, dir: &Path, id: &str, source: &str) -> Result<LayerInfo> {
        let staging = self.staging()?;
        fs::remove_dir(staging.path()).ctx("rmdir", staging.path())?;
        fs::rename(dir, staging.path()).ctx("rename", dir)?;
        self.store(staging, id, source)
    }

    /// Remove layer `id` (the caller knows no template or sandbox uses it).
    pub fn remove(&self, id: &str) -> Result<()> {
        if !valid_id(id) {
            return Err(Error::InvalidRequest(format!(
                "layer id '{id}' is not 64 hex digits"
            )));
        }
        // Metadata first: a half-removed layer is then "not stored" and never used.
        let meta = self.root.join(format!("{id}.json"));
        match fs::remove_file(&meta) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("remove", &meta, e)),
        }
        let trash = self
            .root
            .join(format!(".tmp-rm-{}", crate::unique_suffix()));
        match fs::rename(self.path(id), &trash) {
            Ok(()) => fsutil::remove_tree(&trash),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("rename", self.path(id), e)),
        }
    }

    fn remove_stale(&self) {
        let Ok(rd) = fs::read_dir(&self.root) else {
            return;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            // `.tmp-<pid>-…`: only when that process is gone (a build may run for minutes).
            let Some(rest) = name.strip_prefix(".tmp-") else {
                continue;
            };
            let rest = rest.strip_prefix("rm-").unwrap_or(rest);
            let owner_alive = rest
                .split('-')
                .next()
                .and_then(|p| p.parse::<u32>().ok())
                .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
            if !owner_alive {
                let _ = fsutil::remove_tree(&e.path());
            }
        }
    }
}

/// SHA-256 of `parts` (each length-prefixed, so that boundaries count) as 64 hex digits.
pub fn digest_of(parts: &[&[u8]]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    hex(&h.finalize())
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Remove from the files under `dir` every capability a sandbox cannot hold (the kernel
/// refuses to run such a file: Debian's `ping` has cap_net_raw). `what` names `dir` in
/// the log (`layer <id>`). Whether it succeeded.
pub(crate) fn fit_caps(dir: &Path, what: &str) -> bool {
    match cubicle_runtime::capabilities::fit_file_capabilities(dir) {
        Ok(changed) => {
            for f in &changed {
                tracing::info!(
                    "{what}: file capabilities beyond what a sandbox can hold removed from {}",
                    f.display()
                );
            }
            true
        }
        Err(e) => {
            tracing::warn!(
                "{what}: cannot fit file capabilities in {} ({e}): programs with capabilities a sandbox cannot hold will not run",
                dir.display()
            );
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        assert!(valid_id(&"a".repeat(64)));
        assert!(!valid_id(&"A".repeat(64)));
        assert!(!valid_id("../x"));
        assert_eq!(digest_of(&[b"a", b"bc"]).len(), 64);
        assert_ne!(digest_of(&[b"a", b"bc"]), digest_of(&[b"ab", b"c"]));
    }

    #[test]
    fn stores_once_and_removes() {
        let state = std::env::temp_dir().join(format!("cubicle-layers-{}", std::process::id()));
        let store = LayerStore::open(&state).unwrap();
        let id = digest_of(&[b"x"]);
        let s = store.staging().unwrap();
        fs::write(s.path().join("f"), b"hello").unwrap();
        let info = store.store(s, &id, "test").unwrap();
        assert_eq!(info.size_bytes, 5);
        assert!(store.contains(&id));
        // The same id again: the stored one is kept.
        let s2 = store.staging().unwrap();
        let p2 = s2.path().to_path_buf();
        store.store(s2, &id, "test").unwrap();
        assert!(!p2.exists());
        assert_eq!(store.list().len(), 1);
        // A staging dir dropped without storing disappears.
        let s3 = store.staging().unwrap();
        let p3 = s3.path().to_path_buf();
        drop(s3);
        assert!(!p3.exists());
        store.remove(&id).unwrap();
        assert!(!store.contains(&id));
        fsutil::remove_tree(&state).unwrap();
    }
}
