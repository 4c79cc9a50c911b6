//! Filesystem calls: which filesystem a path is on and its space, whole-file locks,
//! unmounting.

use std::io;
use std::os::fd::AsFd;
use std::path::Path;

use rustix::fs::FlockOperation;
use rustix::mount::UnmountFlags;

/// XFS's `statfs` magic.
pub const XFS_SUPER_MAGIC: i64 = 0x5846_5342;
/// btrfs's `statfs` magic.
pub const BTRFS_SUPER_MAGIC: i64 = 0x9123_683e;

/// The filesystem type (`statfs(2)`'s `f_type`, a `*_SUPER_MAGIC`) of the filesystem
/// holding `path`.
pub fn fs_type(path: &Path) -> io::Result<i64> {
    let st = rustix::fs::statfs(path)?;
    // f_type is a 32-bit magic in a signed field; keep its bits.
    #[allow(clippy::unnecessary_cast)]
    Ok((st.f_type as i64) & 0xFFFF_FFFF)
}

/// Writes the filesystem holding `path` to its disk (`syncfs(2)`; on btrfs, a
/// transaction commit).
pub fn sync_filesystem(path: &Path) -> io::Result<()> {
    let dir = rustix::fs::open(
        path,
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    Ok(rustix::fs::syncfs(&dir)?)
}

/// (total, available to unprivileged users) bytes of the filesystem holding `path`
/// (`statvfs(2)`).
pub fn disk_space(path: &Path) -> io::Result<(u64, u64)> {
    let st = rustix::fs::statvfs(path)?;
    let frag = st.f_frsize;
    Ok((st.f_blocks * frag, st.f_bavail * frag))
}

/// Takes an exclusive `flock(2)` lock on `file`, waiting for it when `wait`; without
/// `wait`, a lock held elsewhere fails with `WouldBlock`.
pub fn lock_exclusive(file: impl AsFd, wait: bool) -> io::Result<()> {
    let op = if wait {
        FlockOperation::LockExclusive
    } else {
        FlockOperation::NonBlockingLockExclusive
    };
    Ok(rustix::fs::flock(file, op)?)
}

/// `umount2(path, 0)`.
pub fn unmount(path: &Path) -> io::Result<()> {
    Ok(rustix::mount::unmount(path, UnmountFlags::empty())?)
}

/// `umount2(path, MNT_DETACH)`: detaches now, cleans up once nothing uses it.
pub fn unmount_detach(path: &Path) -> io::Result<()> {
    Ok(rustix::mount::unmount(path, UnmountFlags::DETACH)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fs_type_of_proc_and_a_missing_path() {
        const PROC_SUPER_MAGIC: i64 = 0x9fa0;
        assert_eq!(fs_type(Path::new("/proc")).unwrap(), PROC_SUPER_MAGIC);
        assert!(fs_type(Path::new("/nonexistent/x")).is_err());
    }

    #[test]
    fn a_second_lock_waits() {
        let p = std::env::temp_dir().join(format!("cubicle-syscalls-lock-{}", std::process::id()));
        let a = std::fs::File::create(&p).unwrap();
        let b = std::fs::File::open(&p).unwrap();
        lock_exclusive(&a, false).unwrap();
        let e = lock_exclusive(&b, false).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        drop(a);
        // Waiting, not trying once: a test on another thread of this process that
        // spawns a child may have forked while `a` was open, and the child's copy of the
        // descriptor holds the lock until its exec closes it.
        lock_exclusive(&b, true).unwrap();
        let _ = std::fs::remove_file(&p);
    }
}
