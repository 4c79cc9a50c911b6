//! Snapshots: a sandbox's disk and (usually) memory at one instant, usable as a template
//! (a sandbox made from it starts where the snapshot was taken).
//!
//! The data is a copy-on-write copy of the sandbox's whole directory held by the
//! runtime's storage (`snapshot-<id>` next to the sandbox directories; a btrfs snapshot
//! or reflinked copy, so its disk cost is what changes afterwards), with the checkpoint
//! (CRIU images) inside it. The record, `<state>/snapshots/<id>.json`, says what the
//! sandbox was made of and who owns it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::error::{IoContext, Result};
use crate::fsutil;

/// One snapshot.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotRecord {
    /// Id (`[a-z0-9]+`): also the name creates use as a template.
    pub id: String,
    /// Names it is known by (e.g. `team/name:tag`), besides its id.
    #[serde(default)]
    pub names: Vec<String>,
    /// Who may see and use it (opaque to the node; the API stores the team).
    #[serde(default)]
    pub owner: String,
    /// The sandbox it was taken of.
    pub source: String,
    /// The source's template name (a snapshot id when the source was made from one).
    pub template: String,
    /// The template providing the root filesystem.
    pub base_template: String,
    /// The layer ids of `base_template` the source ran on (kept out of GC while this
    /// snapshot exists; a rebuild of the template does not change what it restores on).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<String>,
    /// Memory and processes included (`false`: disk only; a sandbox made from it boots).
    pub memory: bool,
    /// Hidden (a fork's intermediate snapshot): not listed.
    #[serde(default)]
    pub hidden: bool,
    /// Unix ms it was taken at.
    pub created_at_ms: u64,
    /// Its sandbox's limits and settings, the defaults of sandboxes made from it.
    pub memory_mb: u64,
    /// vCPUs.
    pub cpus: u32,
    /// Disk quota, MiB.
    pub disk_mb: u64,
    /// Internet access.
    pub internet: bool,
    /// Environment given to envd.
    #[serde(default)]
    pub env_vars: BTreeMap<String, String>,
    /// envd's defaults.
    pub default_user: String,
    /// envd's defaults.
    #[serde(default)]
    pub default_workdir: Option<String>,
    /// The token envd had at the snapshot (a restored envd answers it until told a new
    /// one).
    pub access_token: String,
    /// The source's uid range base when taken.
    pub uid_base: u32,
    /// Bytes the checkpoint wrote.
    #[serde(default)]
    pub bytes: u64,
    /// The source's volumes when taken: a sandbox made from the snapshot mounts them
    /// (their content is not in the snapshot; it sees them as they are then).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<crate::sandbox::VolumeMount>,
}

impl SnapshotRecord {
    /// Name of its data in the runtime's storage.
    pub fn storage_name(&self) -> String {
        storage_name(&self.id)
    }

    /// Whether `name` is one of its names or its id (`id` or `id:default`).
    pub fn answers_to(&self, name: &str) -> bool {
        name == self.id
            || name.strip_suffix(":default") == Some(self.id.as_str())
            || self.names.iter().any(|n| n == name)
    }
}

/// The storage name of snapshot `id`.
pub fn storage_name(id: &str) -> String {
    format!("{}{id}", cubicle_runtime::storage::SNAPSHOT_PREFIX)
}

/// The snapshot records of a state directory.
///
/// Every create asks it whether its template name is a snapshot, several times (the
/// name as given, with the team's prefix, with `:default`): the listing is kept in
/// memory and read again only when the directory changed (its mtime moved, or this
/// process wrote a record), so a create costs one `stat`, not a read and parse of every
/// record.
#[derive(Debug, Clone)]
pub struct SnapshotStore {
    dir: PathBuf,
    listing: Arc<Mutex<Option<Listing>>>,
}

/// A listing of the records directory and the directory mtime it was read at.
#[derive(Debug)]
struct Listing {
    mtime: SystemTime,
    records: Vec<SnapshotRecord>,
}

/// A listing is kept only when the directory's mtime is at least this old when it is
/// read: file timestamps come from a coarse clock, so a change made in the same tick as
/// a newer one could leave the mtime where it was.
const LISTING_SETTLED: Duration = Duration::from_millis(50);

impl SnapshotStore {
    /// `<state>/snapshots` (created, root-only).
    pub fn open(state_dir: &Path) -> Result<Self> {
        let dir = state_dir.join("snapshots");
        std::fs::create_dir_all(&dir).ctx("mkdir", &dir)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .ctx("chmod", &dir)?;
        Ok(SnapshotStore {
            dir,
            listing: Arc::default(),
        })
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Records a snapshot.
    pub fn put(&self, r: &SnapshotRecord) -> Result<()> {
        let res = fsutil::write_json_atomic(&self.path(&r.id), r);
        self.forget_listing();
        Ok(res?)
    }

    /// The snapshot with this id, if any.
    pub fn get(&self, id: &str) -> Option<SnapshotRecord> {
        if !cubicle_runtime::SandboxId::is_valid(id) {
            return None;
        }
        fsutil::read_json(&self.path(id)).ok()
    }

    /// The snapshot `name` refers to (an id, `id:default`, or one of its names). From
    /// the kept listing: one `stat` of the directory, no copy of the other records.
    pub fn find(&self, name: &str) -> Option<SnapshotRecord> {
        self.with_listing(|rs| rs.iter().find(|r| r.answers_to(name)).cloned())
    }

    /// Every snapshot (hidden ones too), oldest first.
    pub fn list(&self) -> Vec<SnapshotRecord> {
        self.with_listing(<[SnapshotRecord]>::to_vec)
    }

    /// `f` of every record, from the kept listing when the directory has not changed
    /// since it was read.
    fn with_listing<R>(&self, f: impl FnOnce(&[SnapshotRecord]) -> R) -> R {
        let mtime = std::fs::metadata(&self.dir).and_then(|m| m.modified()).ok();
        let mut kept = self.listing.lock().unwrap_or_else(|e| e.into_inner());
        if let (Some(l), Some(m)) = (kept.as_ref(), mtime)
            && l.mtime == m
        {
            return f(&l.records);
        }
        let records = self.read_all();
        let r = f(&records);
        *kept = mtime
            .filter(|m| m.elapsed().is_ok_and(|age| age >= LISTING_SETTLED))
            .map(|mtime| Listing { mtime, records });
        r
    }

    fn forget_listing(&self) {
        *self.listing.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    fn read_all(&self) -> Vec<SnapshotRecord> {
        let mut v: Vec<SnapshotRecord> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
            .filter_map(|e| fsutil::read_json(&e.path()).ok())
            .collect();
        v.sort_by(|a: &SnapshotRecord, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        v
    }

    /// Forgets a snapshot's record (its data is the runtime's to delete).
    pub fn remove(&self, id: &str) -> Result<()> {
        let res = std::fs::remove_file(self.path(id));
        self.forget_listing();
        match res {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(crate::error::Error::io("remove", self.path(id), e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, name: &str) -> SnapshotRecord {
        serde_json::from_value(serde_json::json!({
            "id": id, "names": [name], "owner": "team", "source": "isrc",
            "template": "tiny", "baseTemplate": "tiny", "memory": false,
            "createdAtMs": 1, "memoryMb": 64, "cpus": 1, "diskMb": 64,
            "internet": true, "defaultUser": "user", "accessToken": "", "uidBase": 0
        }))
        .unwrap_or_else(|e| panic!("record: {e}"))
    }

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "cubicle-snapshot-store-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// The kept listing follows changes made through another handle (another process's
    /// writes look the same: only the directory tells), and this handle's own at once.
    #[test]
    fn the_kept_listing_follows_every_change() -> Result<()> {
        let state = dir();
        let a = SnapshotStore::open(&state)?;
        let b = SnapshotStore::open(&state)?;
        assert!(a.find("team/one:default").is_none());
        std::thread::sleep(LISTING_SETTLED * 2);
        assert!(a.list().is_empty());
        assert!(
            a.listing.lock().is_ok_and(|l| l.is_some()),
            "a settled listing is kept"
        );

        b.put(&record("s1", "team/one:default"))?;
        assert_eq!(a.find("team/one:default").map(|r| r.id), Some("s1".into()));
        a.put(&record("s2", "team/two:default"))?;
        assert_eq!(a.list().len(), 2);
        std::thread::sleep(LISTING_SETTLED * 2);
        assert_eq!(a.list().len(), 2);
        b.remove("s1")?;
        assert!(a.find("team/one:default").is_none());
        assert_eq!(b.find("team/two:default").map(|r| r.id), Some("s2".into()));
        let _ = std::fs::remove_dir_all(&state);
        Ok(())
    }
}
