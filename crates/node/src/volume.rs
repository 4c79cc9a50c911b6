//! Volumes on a node: directories on the quota filesystem that outlive sandboxes, with a
//! size limit each, mounted into any number of sandboxes at once (idmapped, so that
//! `user` and root inside own what they write: owners on disk are the owners inside).
//!
//! The node knows volumes by id only (names and teams are the control plane's). A volume
//! is *in use* while a live sandbox's record lists it (creating, running or dying: its
//! mounts exist until the sandbox is torn down; after a restart the adopted records say
//! the same); deleting one in use fails with [`Error::VolumeInUse`]. A delete and a
//! create that mounts the same volume cannot interleave: both decide under the node's
//! state lock (`deleting_volumes`).
//!
//! A new volume's root directory belongs to uid/gid [`VOLUME_ROOT_OWNER`] (E2B's `user`)
//! with mode 0755, so that the default user can write at the top and root can anyway.

use std::path::{Component, Path, PathBuf};

pub use cubicle_runtime::storage::{
    Attrs, EntryKind, MAX_VOLUME_ID, Timestamp, VolumeEntry, VolumeFs,
};

use crate::error::{Error, Result};
use crate::node::Node;
use crate::node::inner::{State, blocking};
use crate::sandbox::VolumeMount;

/// Owner (uid and gid, as sandboxes see them) of a new volume's root directory.
pub const VOLUME_ROOT_OWNER: u32 = 1000;
/// Most volumes one sandbox may mount.
pub const MAX_VOLUME_MOUNTS: usize = 8;
/// How long deleting a volume waits for sandboxes that mount it to finish dying.
const DYING_WAIT: std::time::Duration = std::time::Duration::from_secs(30);
/// Smallest and largest volume size, MiB.
pub const VOLUME_SIZE_MB: std::ops::RangeInclusive<u64> = 16..=(1 << 24);

/// Whether `id` can name a volume (the storage's rule: 1–64 of `[A-Za-z0-9_-]`).
pub fn is_valid_volume_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Checks mount points: absolute, clean, not `/`, not where the sandbox's own mounts
/// live, none used twice, at most [`MAX_VOLUME_MOUNTS`].
pub fn check_mounts(mounts: &[VolumeMount]) -> Result<()> {
    if mounts.len() > MAX_VOLUME_MOUNTS {
        return Err(Error::InvalidRequest(format!(
            "at most {MAX_VOLUME_MOUNTS} volumes can be mounted in one sandbox"
        )));
    }
    let mut seen = std::collections::HashSet::new();
    for m in mounts {
        let p = Path::new(&m.path);
        let clean = p.is_absolute()
            && p.components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
            && !m.path.contains("/./")
            && !m.path.ends_with("/.")
            && !m.path.contains('\0');
        if !clean || p == Path::new("/") {
            return Err(Error::InvalidRequest(format!(
                "volume mount path '{}' must be an absolute path without '.' or '..' components, other than /",
                m.path
            )));
        }
        for reserved in ["/proc", "/sys", "/dev", "/run/cubicle"] {
            if p.starts_with(reserved) {
                return Err(Error::InvalidRequest(format!(
                    "volume mount path '{}' is inside {reserved}, which the sandbox's own mounts use",
                    m.path
                )));
            }
        }
        let normal: PathBuf = p.components().collect();
        if !seen.insert(normal) {
            return Err(Error::InvalidRequest(format!(
                "volume mount path '{}' is used twice",
                m.path
            )));
        }
        if !is_valid_volume_id(&m.volume_id) {
            return Err(Error::InvalidRequest(format!(
                "volume id '{}' is malformed",
                m.volume_id
            )));
        }
    }
    Ok(())
}

impl State {
    /// Fails if a volume of `mounts` is being deleted.
    pub(crate) fn check_volumes_usable(&self, mounts: &[VolumeMount]) -> Result<()> {
        match mounts
            .iter()
            .find(|m| self.deleting_volumes.contains(&m.volume_id))
        {
            Some(m) => Err(Error::VolumeNotFound(m.volume_id.clone())),
            None => Ok(()),
        }
    }

    /// Live sandboxes that mount volume `id`.
    pub(crate) fn volume_users(&self, id: &str) -> Vec<String> {
        let mut users: Vec<String> = self
            .live()
            .values()
            .filter(|l| l.record.volumes.iter().any(|v| v.volume_id == id))
            .map(|l| l.record.id.to_string())
            .collect();
        users.sort();
        users
    }
}

impl Node {
    /// Creates volume `id` with a limit of `size_mb` MiB.
    pub async fn create_volume(&self, id: &str, size_mb: u64) -> Result<()> {
        if !is_valid_volume_id(id) {
            return Err(Error::InvalidRequest(format!(
                "volume id '{id}' is malformed"
            )));
        }
        if !VOLUME_SIZE_MB.contains(&size_mb) {
            return Err(Error::InvalidRequest(format!(
                "volume size {size_mb} MiB must be between {} and {} MiB",
                VOLUME_SIZE_MB.start(),
                VOLUME_SIZE_MB.end()
            )));
        }
        let rt = self.inner.runtime.clone();
        let id = id.to_string();
        blocking(move || {
            rt.create_volume(&id, size_mb, VOLUME_ROOT_OWNER, VOLUME_ROOT_OWNER, 0o755)
        })
        .await
    }

    /// Deletes volume `id` and everything in it. Fails with [`Error::VolumeInUse`] while
    /// a live sandbox mounts it; a missing volume is fine (idempotent).
    pub async fn delete_volume(&self, id: &str) -> Result<()> {
        if !is_valid_volume_id(id) {
            return Err(Error::VolumeNotFound(id.to_string()));
        }
        // Sandboxes killed a moment ago are still being torn down (a kill answers once
        // they are dead; their mounts go with their teardown): wait for those, but not
        // for a running one.
        let deadline = std::time::Instant::now() + DYING_WAIT;
        loop {
            let wait = {
                let mut st = self.inner.lock();
                let users = st.volume_users(id);
                let running: Vec<String> = users
                    .iter()
                    .filter(|u| {
                        st.live()
                            .get(u.as_str())
                            .is_some_and(|l| l.record.state != crate::SandboxState::Dying)
                    })
                    .cloned()
                    .collect();
                if !running.is_empty()
                    || (!users.is_empty() && std::time::Instant::now() >= deadline)
                {
                    return Err(Error::VolumeInUse {
                        volume: id.to_string(),
                        sandboxes: if running.is_empty() { users } else { running },
                    });
                }
                if users.is_empty() {
                    if !st.deleting_volumes.insert(id.to_string()) {
                        return Err(Error::VolumeInUse {
                            volume: id.to_string(),
                            sandboxes: Vec::new(),
                        });
                    }
                    false
                } else {
                    true
                }
            };
            if !wait {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let rt = self.inner.runtime.clone();
        let id2 = id.to_string();
        let r = blocking(move || rt.remove_volume(&id2)).await;
        self.inner.lock().deleting_volumes.remove(id);
        r
    }

    /// Live sandboxes that mount volume `id` (sorted).
    pub fn volume_users(&self, id: &str) -> Vec<String> {
        self.inner.lock().volume_users(id)
    }

    /// The tree of volume `id`, for file operations (blocking: call from the blocking
    /// pool).
    pub fn volume_fs(&self, id: &str) -> Result<VolumeFs> {
        let dir = self.volume_dir(id)?;
        VolumeFs::open(&dir).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::VolumeNotFound(id.to_string()),
            _ => Error::io("open", dir, e),
        })
    }

    /// Bytes used and the limit of volume `id` (blocking).
    pub fn volume_usage(&self, id: &str) -> Result<(u64, u64)> {
        self.volume_dir(id)?;
        self.inner.runtime.volume_usage(id)
    }

    /// The host directory of an existing volume `id`.
    fn volume_dir(&self, id: &str) -> Result<PathBuf> {
        self.inner.volume_dir(id)
    }

    /// The volumes on disk (removing half-created ones): what the control plane
    /// compares with its records at start.
    pub async fn reconcile_volumes(&self) -> Result<Vec<String>> {
        let rt = self.inner.runtime.clone();
        blocking(move || rt.reconcile_volumes()).await
    }
}

impl crate::node::inner::Inner {
    /// The host directory of an existing volume `id`.
    pub(crate) fn volume_dir(&self, id: &str) -> Result<PathBuf> {
        if !is_valid_volume_id(id) {
            return Err(Error::VolumeNotFound(id.to_string()));
        }
        let dir = self.runtime.volume_dir(id)?;
        if !dir.is_dir() || self.lock().deleting_volumes.contains(id) {
            return Err(Error::VolumeNotFound(id.to_string()));
        }
        Ok(dir)
    }

    /// (host directory, mount point, read-only) of each mount, for the runtime.
    pub(crate) fn volume_binds(
        &self,
        mounts: &[VolumeMount],
    ) -> Result<Vec<(PathBuf, PathBuf, bool)>> {
        mounts
            .iter()
            .map(|m| {
                Ok((
                    self.volume_dir(&m.volume_id)?,
                    PathBuf::from(&m.path),
                    m.read_only,
                ))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(id: &str, path: &str) -> VolumeMount {
        VolumeMount {
            volume_id: id.into(),
            path: path.into(),
            read_only: false,
        }
    }

    #[test]
    fn mount_points_are_checked() {
        check_mounts(&[m("a", "/mnt/a"), m("b", "/home/user/b")]).unwrap();
        for bad in [
            vec![m("a", "relative")],
            vec![m("a", "/")],
            vec![m("a", "/mnt/../etc")],
            vec![m("a", "/mnt/./x")],
            vec![m("a", "/proc/x")],
            vec![m("a", "/run/cubicle/ctl")],
            vec![m("a", "/dev")],
            vec![m("a", "/mnt/a"), m("b", "/mnt/a/")],
            vec![m("../x", "/mnt/a")],
            (0..9).map(|i| m("a", &format!("/m{i}"))).collect(),
        ] {
            assert!(check_mounts(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn volume_ids() {
        assert!(is_valid_volume_id("0b5c9e1e-6a1c-4a7e-9d55-0a3f1c2b7e11"));
        for bad in ["", ".volumes", ".creating-x", "a/b", "a b", &"x".repeat(65)] {
            assert!(!is_valid_volume_id(bad), "{bad:?}");
        }
    }
}
