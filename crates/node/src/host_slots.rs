//! The slot ranges of the Cubicle nodes on this host, so that no two overlap.
//!
//! A slot is host-wide: slot `s` means host uids `uid_base + s * 65536 ..` and the veth
//! `cbs<s>` with its address pair. Two nodes (state directories) sharing a slot would
//! give two tenants' roots the same host uid, and one node's reconciliation would take
//! the other's veth for its own leftover. So every node registers its range, and opening
//! a node whose range overlaps another live node's fails, saying which node has it.
//!
//! The registry is a directory, [`REGISTRY`] (on the host's `/run`: it describes running
//! processes and sandboxes, which a reboot ends). Each node has one entry,
//! `<hash of its state directory>.json` = `{stateDir, first, end, pid}`, on which it
//! holds an exclusive `flock` for its life. An entry is live while its node holds that
//! lock, and also while its state directory still has sandbox records (sandboxes outlive
//! a stopped `cubicle serve`; the next start adopts them, in the same slots). Other
//! entries are stale and are removed. Registration runs under an exclusive lock on the
//! registry's `.lock` file.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::ops::Range;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, IoContext, Result};

/// Where the registry lives.
pub const REGISTRY: &str = "/run/cubicle/nodes";

/// One node's entry.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
struct Entry {
    state_dir: PathBuf,
    first: u32,
    end: u32,
    pid: u32,
}

/// A node's registration: its slot range is its own while this lives.
#[derive(Debug)]
pub struct SlotLease {
    /// The entry, locked.
    _entry: File,
    range: Range<u32>,
}

impl SlotLease {
    /// The slots this node may use.
    pub fn range(&self) -> Range<u32> {
        self.range.clone()
    }
}

/// Registers `wanted` for the node on `state_dir` in the registry at `registry`. When it
/// overlaps another live node's range: with `any_free`, the first free range of the same
/// size at or above it (below `limit`) is taken instead; else it fails with
/// [`Error::SlotsTaken`], naming the other node.
pub fn lease(
    registry: &Path,
    state_dir: &Path,
    wanted: Range<u32>,
    any_free: bool,
    limit: u32,
) -> Result<SlotLease> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(registry)
        .ctx("mkdir", registry)?;
    let lock_path = registry.join(".lock");
    let lock = open_rw(&lock_path)?;
    flock(&lock, true, &lock_path)?;

    let state_dir = std::fs::canonicalize(state_dir).ctx("resolve", state_dir)?;
    let own_path = registry.join(format!("{}.json", key(&state_dir)));
    let mut others = Vec::new();
    for e in std::fs::read_dir(registry)
        .ctx("readdir", registry)?
        .flatten()
    {
        let path = e.path();
        if path == own_path || path.extension().is_none_or(|x| x != "json") {
            continue;
        }
        match live_entry(&path)? {
            // An entry for this state directory under another name: superseded.
            Some(entry) if entry.state_dir == state_dir => {
                let _ = std::fs::remove_file(&path);
            }
            Some(entry) => others.push(entry),
            None => {}
        }
    }

    let len = wanted.end.saturating_sub(wanted.start);
    let mut range = wanted.clone();
    while let Some(other) = others
        .iter()
        .find(|o| o.first < range.end && range.start < o.end)
    {
        if !any_free {
            return Err(Error::SlotsTaken(format!(
                "slots {}..{} overlap slots {}..{} of the Cubicle node on {} (pid {}): nodes on one host need disjoint ranges (their sandboxes would share host uids); pass another --first-slot (e.g. {}) or stop that node",
                wanted.start,
                wanted.end,
                other.first,
                other.end,
                other.state_dir.display(),
                other.pid,
                others
                    .iter()
                    .map(|o| o.end)
                    .max()
                    .unwrap_or(0)
                    .max(wanted.end)
            )));
        }
        range = other.end..other.end.saturating_add(len);
        if range.end > limit {
            return Err(Error::SlotsTaken(format!(
                "no free range of {len} slots at or above {} below {limit}: the other nodes on this host hold {}",
                wanted.start,
                others
                    .iter()
                    .map(|o| format!("{}..{} ({})", o.first, o.end, o.state_dir.display()))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    }

    let own = open_rw(&own_path)?;
    flock(&own, false, &own_path).map_err(|_| {
        Error::StateDirBusy(format!(
            "another process holds the slot registration of {} ({})",
            state_dir.display(),
            own_path.display()
        ))
    })?;
    let entry = Entry {
        state_dir,
        first: range.start,
        end: range.end,
        pid: std::process::id(),
    };
    let text = serde_json::to_vec(&entry).map_err(|e| Error::Record {
        path: own_path.clone(),
        source: e,
    })?;
    own.set_len(0).ctx("truncate", &own_path)?;
    (&own).write_all(&text).ctx("write", &own_path)?;
    drop(lock);
    Ok(SlotLease { _entry: own, range })
}

/// The entry at `path` if its node is live (holds the entry's lock, or has sandbox
/// records); a stale entry is removed.
fn live_entry(path: &Path) -> Result<Option<Entry>> {
    let Ok(file) = File::open(path) else {
        return Ok(None);
    };
    let entry: Option<Entry> = std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let held = cubicle_syscalls::fs::lock_exclusive(&file, false).is_err();
    let Some(entry) = entry else {
        if !held {
            let _ = std::fs::remove_file(path);
        }
        return Ok(None);
    };
    if held || has_sandbox_records(&entry.state_dir) {
        return Ok(Some(entry));
    }
    let _ = std::fs::remove_file(path);
    Ok(None)
}

/// Whether `<state>/sandboxes/` holds any sandbox record.
fn has_sandbox_records(state_dir: &Path) -> bool {
    let Ok(rd) = std::fs::read_dir(state_dir.join("sandboxes")) else {
        return false;
    };
    rd.flatten()
        .any(|e| e.path().join("sandbox.json").is_file())
}

/// A stable name for a state directory (FNV-1a of its path: the same in every build).
fn key(state_dir: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in state_dir.as_os_str().as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn open_rw(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .ctx("open", path)
}

/// An exclusive lock on `file`, waiting for it when `wait`.
fn flock(file: &File, wait: bool, path: &Path) -> Result<()> {
    cubicle_syscalls::fs::lock_exclusive(file, wait).map_err(|e| Error::io("flock", path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dirs(name: &str) -> (PathBuf, PathBuf, PathBuf) {
        let base = std::env::temp_dir().join(format!("cbslots-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let (reg, a, b) = (base.join("reg"), base.join("a"), base.join("b"));
        for d in [&a, &b] {
            std::fs::create_dir_all(d).unwrap();
        }
        (reg, a, b)
    }

    /// Two nodes with overlapping ranges: the second is refused (naming the first),
    /// or moved above it when it asked for any free range; disjoint ranges coexist;
    /// a stopped node's range is free again unless its sandboxes still run.
    #[test]
    fn overlapping_ranges_are_refused() {
        let (reg, a, b) = dirs("overlap");
        let la = lease(&reg, &a, 0..100, false, 1000).unwrap();
        let err = lease(&reg, &b, 50..150, false, 1000)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("0..100") && err.contains(&a.display().to_string()),
            "{err}"
        );
        let lb = lease(&reg, &b, 50..150, true, 1000).unwrap();
        assert_eq!(lb.range(), 100..200);
        drop(lb);
        let lb = lease(&reg, &b, 100..120, false, 1000).unwrap();
        assert_eq!(lb.range(), 100..120);
        drop(lb);
        assert!(
            lease(&reg, &b, 0..10, true, 5).is_err(),
            "nothing free below the limit"
        );
        // The same state directory may register again (a restart) with another range.
        drop(la);
        let la = lease(&reg, &a, 500..600, false, 1000).unwrap();
        assert_eq!(la.range(), 500..600);
        drop(la);
        // Stopped, but with a sandbox record: still taken.
        std::fs::create_dir_all(a.join("sandboxes/i1")).unwrap();
        std::fs::write(a.join("sandboxes/i1/sandbox.json"), "{}").unwrap();
        assert!(lease(&reg, &b, 550..560, false, 1000).is_err());
        std::fs::remove_dir_all(a.join("sandboxes")).unwrap();
        let lb = lease(&reg, &b, 550..560, false, 1000).unwrap();
        assert_eq!(lb.range(), 550..560);
        let _ = std::fs::remove_dir_all(reg.parent().unwrap());
    }
}
