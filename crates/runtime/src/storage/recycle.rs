//! Recycled quota directories (btrfs): a sandbox's subvolume, emptied, is the next
//! sandbox's directory.
//!
//! Why: on kernels 6.10+ with qgroups, the btrfs cleaner **commits a transaction for every
//! subvolume it drops** (`btrfs_qgroup_cleanup_dropped_subvolume`), to settle the qgroup
//! before removing it. In a create/kill cycle that commit, on the cleaner thread, cost
//! about 2.2 ms of CPU per sandbox (a tenth of all the CPU a cycle uses on this VM) plus
//! the loop device's writes, and each commit stalls whatever waits on the transaction.
//! Emptying a small directory (a few files the node wrote, what the tenant left) and
//! renaming it costs a fraction of that, and the next create skips
//! `BTRFS_IOC_SUBVOL_CREATE` as well.
//!
//! The rules:
//! - Only sandbox directories in the storage root are recycled, only while the bin holds
//!   fewer than its capacity ([`StorageConfig::recycle`]), and only a small one (at most
//!   [`MAX_RECYCLED_BYTES`] referenced): a big tree is dropped whole (O(1) here, the
//!   cleaner does the rest).
//! - The directory is renamed away from its id first (`.recycling-<id>`), emptied with
//!   [`crate::remove_tree::remove_contents`] (which never follows a symlink or crosses a
//!   mount), checked (still a writable subvolume root, empty, no extended attributes),
//!   given the owner and mode of a new subvolume, and renamed `.recycled-<n>`. Anything
//!   unexpected on the way: it is dropped as before.
//! - A create takes the oldest entry, but only once the qgroup reads like a new
//!   subvolume's again ([`SETTLED_BYTES`]): the deletions are accounted at the next
//!   commit, and until then the limit would count the previous tenant's files. Not
//!   settled yet: the create makes a new subvolume (the node's writeback commits within
//!   a second of a sandbox's end, so under load the oldest entry has settled).
//! - The entries are names outside the id space (they start with a dot): a crash
//!   anywhere leaves nothing that looks like a sandbox. At open, [`Storage::reconcile`]
//!   adopts empty `.recycled-*` subvolumes and drops anything else;
//!   [`Storage::drop_recycled`] drops the whole bin (a node that stops with no sandbox).

use std::collections::VecDeque;
use std::fs::{self, File};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::Storage;
use super::btrfs::{btrfs_qgroup_limit, btrfs_subvol_id, btrfs_subvol_is_readonly};
use crate::error::Result;

/// Emptied subvolumes waiting for a create are named this, then a number.
pub(super) const RECYCLED: &str = ".recycled-";
/// A subvolume being emptied (renamed away from its id first).
pub(super) const RECYCLING: &str = ".recycling-";
/// A directory referencing more than this is dropped whole, not emptied.
pub const MAX_RECYCLED_BYTES: u64 = 16 << 20;
/// An emptied subvolume's qgroup reads at most this once its deletions are accounted (a
/// new subvolume's is one 16 KiB tree block).
pub const SETTLED_BYTES: u64 = 64 << 10;
/// Inode number of a btrfs subvolume's root directory.
const SUBVOL_ROOT_INO: u64 = 256;

/// The emptied subvolumes, oldest first: (name in the storage root, subvolume id).
#[derive(Default)]
pub(super) struct RecycleBin {
    capacity: usize,
    entries: Mutex<VecDeque<(String, u64)>>,
    next: AtomicU64,
}

impl RecycleBin {
    pub(super) fn new(capacity: usize) -> Self {
        RecycleBin {
            capacity,
            ..Default::default()
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(String, u64)>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn has_room(&self) -> bool {
        self.lock().len() < self.capacity
    }

    fn next_name(&self) -> String {
        // Unique: every `.recycled-<n>` found at open moves the counter past its number.
        format!("{RECYCLED}{}", self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// Keeps later names past entry `name`'s number (one a previous run left).
    fn skip_past(&self, name: &str) {
        if let Some(n) = name
            .strip_prefix(RECYCLED)
            .and_then(|n| n.parse::<u64>().ok())
        {
            self.next.fetch_max(n + 1, Ordering::Relaxed);
        }
    }
}

/// Whether `name` in the storage root is one of the bin's (an entry or one being
/// emptied): never a sandbox's, the storage's own to adopt or drop.
pub(super) fn is_bin_name(name: &str) -> bool {
    name.starts_with(RECYCLED) || name.starts_with(RECYCLING)
}

impl Storage {
    /// Empties sandbox directory `name` (in the storage root) into the bin instead of
    /// dropping it. `Ok(true)`: recycled (or already gone); `Ok(false)`: not recycled (no
    /// room, too big, not a subvolume, or the emptying failed), still at `name` for the
    /// caller to drop.
    pub(super) fn btrfs_recycle(&self, name: &str) -> io::Result<bool> {
        if !self.recycle.has_room() {
            return Ok(false);
        }
        let path = self.root.join(name);
        let meta = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(true),
            Err(e) => return Err(e),
        };
        if !meta.is_dir() || meta.ino() != SUBVOL_ROOT_INO {
            return Ok(false);
        }
        match self.btrfs_usage(&path) {
            Ok(u) if u.used_bytes <= MAX_RECYCLED_BYTES => {}
            _ => return Ok(false),
        }
        let recycling = format!("{RECYCLING}{name}");
        fs::rename(&path, self.root.join(&recycling))?;
        match self.empty_subvolume(&recycling) {
            Ok(subvol) => {
                let dest = self.recycle.next_name();
                if let Err(e) = fs::rename(self.root.join(&recycling), self.root.join(&dest)) {
                    // Not left half-recycled: it is empty, drop it.
                    self.remove_entry(&recycling).map_err(io::Error::other)?;
                    return Err(e);
                }
                self.recycle.lock().push_back((dest, subvol));
                Ok(true)
            }
            // Whatever stopped it (a mount inside, a flag it could not clear): back under
            // its id, for the caller to drop as it would have.
            Err(_) => {
                fs::rename(self.root.join(&recycling), &path)?;
                Ok(false)
            }
        }
    }

    /// Empties subvolume `root/name` and resets its root directory to what a new
    /// subvolume has; returns the subvolume id.
    fn empty_subvolume(&self, name: &str) -> io::Result<u64> {
        let file = open_dir_nofollow(&self.root.join(name))?;
        let subvol = btrfs_subvol_id(&file)?;
        let dir = OwnedFd::from(file);
        crate::remove_tree::remove_contents(&dir)?;
        let file = File::from(dir);
        if btrfs_subvol_is_readonly(&file)? {
            return Err(io::Error::other("the subvolume is read-only"));
        }
        // SAFETY: flistxattr with a null buffer only returns the list's size.
        let xattrs = unsafe { libc::flistxattr(file.as_raw_fd(), std::ptr::null_mut(), 0) };
        if xattrs != 0 {
            return Err(io::Error::other("the directory has extended attributes"));
        }
        std::os::unix::fs::fchown(&file, Some(0), Some(0))?;
        file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
        Ok(subvol)
    }

    /// Makes `root/tmp_name` from the oldest settled entry of the bin, limited to
    /// `quota_bytes`. `false`: none to take (empty, or not settled yet).
    pub(super) fn btrfs_take_recycled(&self, tmp_name: &str, quota_bytes: u64) -> bool {
        let Some((name, subvol)) = self.recycle.lock().pop_front() else {
            return false;
        };
        if !self.qgroup_settled(subvol) {
            self.recycle.lock().push_front((name, subvol));
            return false;
        }
        let taken = (|| -> io::Result<()> {
            fs::rename(self.root.join(&name), self.root.join(tmp_name))?;
            let root = File::open(&self.root)?;
            btrfs_qgroup_limit(&root, subvol, quota_bytes)
        })();
        match taken {
            Ok(()) => true,
            Err(_) => {
                let _ = self.remove_entry(&name);
                let _ = self.remove_entry(tmp_name);
                false
            }
        }
    }

    /// Whether subvolume `subvol`'s qgroup reads like a new subvolume's (its deletions
    /// committed and accounted).
    fn qgroup_settled(&self, subvol: u64) -> bool {
        let read = |name: &str| self.qgroup_counter(subvol, name).ok();
        read("referenced").is_some_and(|b| b <= SETTLED_BYTES) && read("rsv_data").unwrap_or(0) == 0
    }

    /// At reconcile: takes `.recycled-*` entry `name` into the bin if it is an empty,
    /// writable subvolume root and there is room. `false`: the caller drops it.
    pub(super) fn btrfs_adopt_recycled(&self, name: &str) -> bool {
        // Already in (recycled by this run before it reconciled).
        if self.recycle.lock().iter().any(|(n, _)| n == name) {
            return true;
        }
        if !self.recycle.has_room() {
            return false;
        }
        let path = self.root.join(name);
        let ok = (|| -> io::Result<u64> {
            let file = open_dir_nofollow(&path)?;
            if file.metadata()?.ino() != SUBVOL_ROOT_INO
                || btrfs_subvol_is_readonly(&file)?
                || fs::read_dir(&path)?.next().is_some()
            {
                return Err(io::Error::other("not an empty writable subvolume"));
            }
            btrfs_subvol_id(&file)
        })();
        match ok {
            Ok(subvol) => {
                self.recycle.skip_past(name);
                self.recycle.lock().push_back((name.to_string(), subvol));
                true
            }
            Err(_) => false,
        }
    }

    /// At open: numbers new entries past those a previous run left, which stay until
    /// [`Storage::reconcile`] adopts or drops them. (A node recycles the directories of
    /// its crash's leftovers before it reconciles the storage: without this, each one
    /// met a name still taken.)
    pub(super) fn btrfs_skip_recycled_names(&self, names: &[String]) {
        for name in names {
            self.recycle.skip_past(name);
        }
    }

    /// Drops every subvolume in the bin (a node that stops with no sandbox left); the
    /// first error, after trying them all.
    pub fn drop_recycled(&self) -> Result<()> {
        let entries: Vec<(String, u64)> = self.recycle.lock().drain(..).collect();
        let mut first = Ok(());
        for (name, _) in entries {
            if let Err(e) = self.remove_entry(&name) {
                first = first.and(Err(e));
            }
        }
        first
    }

    /// Entries in the bin (for tests and metrics).
    pub fn recycled(&self) -> usize {
        self.recycle.lock().len()
    }
}

/// Opens the directory `path`, refusing a symlink in its last component.
fn open_dir_nofollow(path: &std::path::Path) -> io::Result<File> {
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(path)
}
