//! Volumes: directories on the quota filesystem that outlive sandboxes, each with its own
//! hard limit, bind-mounted (idmapped) into any number of sandboxes at once.
//!
//! A volume is `<root>/.volumes/<id>/` ([`VOLUMES`]), made like a sandbox directory (a
//! btrfs subvolume with a limited qgroup, or an XFS directory with its own project id):
//! everything written below it, by any sandbox that mounts it or through the content
//! API, counts against that one limit. Its files are stored with the owners sandboxes
//! see (uid 1000 inside is 1000 on disk), since every sandbox mounts it idmapped.
//!
//! What a tenant could try against the limit, and why it holds:
//! - a nested subvolume or a snapshot inside the volume (on btrfs they get qgroups of
//!   their own, outside the limit): the sandbox's seccomp policy refuses btrfs ioctls,
//!   and the host side never creates one below a volume;
//! - reflinks (`FICLONE`, allowed) from another volume or the sandbox's own layer: btrfs
//!   counts shared extents in full in every qgroup that references them (`max_rfer`), so
//!   a clone costs the volume its whole size;
//! - hard links and renames across mounts fail with EXDEV; the XFS project id of a
//!   directory cannot be changed from a user namespace;
//! - many sandboxes writing at once share the one limit.
//!
//! Limits are not reservations: the volumes' limits together (and the sandboxes') may
//! exceed the filesystem, whose own size (the image) is the final bound.

use std::fs;
use std::path::{Path, PathBuf};

use super::{CREATING, DiskUsage, QuotaBackend, Storage, VOLUMES, check_id};
use crate::error::{Result, io_err};

impl Storage {
    /// `<root>/.volumes` (created on first use).
    fn volumes_root(&self) -> Result<PathBuf> {
        let dir = self.root.join(VOLUMES);
        if !dir.is_dir() {
            fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        }
        Ok(dir)
    }

    /// The directory of volume `id` (whether or not it exists).
    pub fn volume_dir(&self, id: &str) -> Result<PathBuf> {
        check_id(id)?;
        Ok(self.root.join(VOLUMES).join(id))
    }

    /// Creates volume `id`'s directory with a hard limit of `quota_bytes` on everything
    /// written below it; its root directory gets owner `uid:gid` and mode `mode`. Fails
    /// if it exists.
    pub fn create_volume_dir(
        &self,
        id: &str,
        quota_bytes: u64,
        uid: u32,
        gid: u32,
        mode: u32,
    ) -> Result<PathBuf> {
        check_id(id)?;
        let parent = self.volumes_root()?;
        let dir = self.create_quota_dir(&parent, id, quota_bytes)?;
        let own = std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).and_then(|()| {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&dir, fs::Permissions::from_mode(mode))
        });
        if let Err(e) = own {
            let _ = self.remove_in(&parent, id);
            return Err(io_err(format!("setting the owner of {}", dir.display()))(e));
        }
        Ok(dir)
    }

    /// Deletes volume `id`'s directory with everything in it and clears its quota
    /// (idempotent). No sandbox may have it mounted.
    pub fn remove_volume_dir(&self, id: &str) -> Result<()> {
        check_id(id)?;
        self.remove_in(&self.root.join(VOLUMES), id)
    }

    /// Bytes used and the limit of volume `id`.
    pub fn volume_usage(&self, id: &str) -> Result<DiskUsage> {
        let dir = self.volume_dir(id)?;
        match self.backend {
            QuotaBackend::XfsProject => self.xfs_usage(&dir),
            QuotaBackend::BtrfsQgroup => self.btrfs_usage(&dir),
        }
    }

    /// The ids of the volumes on disk (half-created ones excluded).
    pub fn volume_ids(&self) -> Result<Vec<String>> {
        let dir = self.root.join(VOLUMES);
        let mut out = Vec::new();
        let Ok(rd) = fs::read_dir(&dir) else {
            return Ok(out);
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with(CREATING) && check_id(&name).is_ok() {
                out.push(name);
            }
        }
        out.sort();
        Ok(out)
    }

    /// Removes half-created volumes (a crash between making the directory and naming
    /// it). Volumes the caller does not know are left alone: they hold user data, and
    /// the caller decides (it logs them).
    pub fn reconcile_volumes(&self) -> Result<()> {
        let dir = self.root.join(VOLUMES);
        let Ok(rd) = fs::read_dir(&dir) else {
            return Ok(());
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(CREATING) {
                self.remove_in(&dir, &name)?;
            }
        }
        Ok(())
    }

    /// Every directory with a quota of its own: the sandboxes' and the volumes'.
    pub(super) fn quota_dirs(&self) -> Result<Vec<PathBuf>> {
        let mut out: Vec<PathBuf> = self
            .entries()?
            .into_iter()
            .filter(|n| n != VOLUMES)
            .map(|n| self.root.join(n))
            .collect();
        let vols = self.root.join(VOLUMES);
        if let Ok(rd) = fs::read_dir(&vols) {
            out.extend(rd.flatten().map(|e| e.path()));
        }
        Ok(out)
    }

    /// Whether `path` is (inside) the volumes' directory.
    pub fn is_volume_path(&self, path: &Path) -> bool {
        path.starts_with(self.root.join(VOLUMES))
    }
}
