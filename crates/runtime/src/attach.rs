//! Bind mounts added to a sandbox that is already running: a pooled sandbox claimed by a
//! create that mounts volumes (its namespaces exist before anyone asked for them).
//!
//! The sources are cloned and idmapped here (`open_tree` + `mount_setattr`, as the helper
//! does at spawn), then a short-lived thread enters the sandbox's mount namespace
//! (`unshare(CLONE_FS)` first, so that only that thread moves; `setns` through a pidfd of
//! the sandbox's init, so a reused pid leads nowhere), creates each mount point as the
//! sandbox's root would (file system ids = the sandbox's root, owner of what it creates,
//! with the thread's capabilities kept so that directories of other users can be entered),
//! resolving every path with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)` (absolute
//! symlinks a template holds stay inside the sandbox), and attaches the mounts with
//! `move_mount` onto the descriptors it resolved. The thread then ends; the calling
//! thread never changes namespace.
//!
//! No process of the sandbox has run user code yet when this is used (a pooled sandbox
//! is handed out only after it), so nothing inside races with the mount points.

use std::ffi::CString;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

use crate::error::{Error, Result};
use crate::spec::BindMount;
use crate::sys;

/// Attaches `binds` inside the running sandbox whose init is `pid` (`pidfd` pins it),
/// whose root is host uid/gid `uid_base`.
pub fn attach_binds(
    pidfd: BorrowedFd<'_>,
    pid: i32,
    uid_base: u32,
    binds: &[BindMount],
) -> Result<()> {
    if binds.is_empty() {
        return Ok(());
    }
    for b in binds {
        check_target(&b.target)?;
    }
    let userns = std::fs::File::open(format!("/proc/{pid}/ns/user")).map_err(|e| {
        Error::io(
            format!("opening the user namespace of sandbox init {pid}"),
            e,
        )
    })?;
    // The namespace file was opened through a pid: make sure that pid still is the init
    // the pidfd names (its pid is not reused before it is reaped, and it has not exited).
    if cubicle_syscalls::pidfd::exited(pidfd) {
        return Err(Error::io(
            format!("sandbox init {pid}"),
            std::io::Error::from_raw_os_error(libc::ESRCH),
        ));
    }
    let mut mounts: Vec<OwnedFd> = Vec::with_capacity(binds.len());
    for b in binds {
        mounts.push(crate::helper::bind_source(b, userns.as_raw_fd())?);
    }
    let pidfd_raw = pidfd.as_raw_fd();
    std::thread::scope(|s| {
        s.spawn(|| attach_in_namespace(pidfd_raw, uid_base, binds, &mounts))
            .join()
            .unwrap_or_else(|_| Err(Error::Setup("the mount thread panicked".into())))
    })
}

/// Absolute, without `.`/`..`, not `/`, and not where the sandbox's own mounts live.
fn check_target(target: &Path) -> Result<()> {
    let clean = target.is_absolute()
        && target
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
        && target != Path::new("/");
    let reserved = ["/proc", "/sys", "/dev", "/run/cubicle"]
        .iter()
        .any(|r| target.starts_with(r));
    if !clean || reserved {
        return Err(Error::InvalidSpec(format!(
            "mount point {} must be an absolute path without '..', not / and not under /proc, /sys, /dev or /run/cubicle",
            target.display()
        )));
    }
    Ok(())
}

/// Runs on its own thread: enters the mount namespace and attaches every mount.
fn attach_in_namespace(
    pidfd: RawFd,
    uid_base: u32,
    binds: &[BindMount],
    mounts: &[OwnedFd],
) -> Result<()> {
    sys::unshare(libc::CLONE_FS).map_err(|e| Error::io("unshare(CLONE_FS)", e))?;
    sys::setns(pidfd, libc::CLONE_NEWNS)
        .map_err(|e| Error::io("entering the sandbox's mount namespace", e))?;
    let root = sys::openat2(libc::AT_FDCWD, c"/", libc::O_PATH | libc::O_DIRECTORY, 0, 0)
        .map_err(|e| Error::io("opening the sandbox's root", e))?;
    // Directories are made as the sandbox's root (their owner then is root inside; a
    // host uid 0 would not even be representable in the sandbox's overlay); the
    // capabilities setfsuid drops are raised again so that any directory can be entered.
    sys::set_fs_ids(uid_base, uid_base);
    let (_, permitted, inheritable) =
        sys::capget().map_err(|e| Error::io("reading capabilities", e))?;
    sys::capset(permitted, permitted, inheritable)
        .map_err(|e| Error::io("raising capabilities", e))?;
    let mut targets = Vec::with_capacity(binds.len());
    let made: Result<()> = binds.iter().try_for_each(|b| {
        targets.push(make_mount_point(root.as_raw_fd(), &b.target)?);
        Ok(())
    });
    sys::set_fs_ids(0, 0);
    made?;
    for ((b, fd), target) in binds.iter().zip(mounts).zip(&targets) {
        sys::move_mount_onto(fd.as_raw_fd(), target.as_raw_fd()).map_err(|e| {
            Error::io(
                format!("mounting {} at {}", b.source.display(), b.target.display()),
                e,
            )
        })?;
    }
    Ok(())
}

/// `mkdir -p target` below `root` (mode 0755), every step resolved inside it; returns an
/// `O_PATH` descriptor of the directory.
fn make_mount_point(root: RawFd, target: &Path) -> Result<OwnedFd> {
    const RESOLVE: u64 = sys::RESOLVE_IN_ROOT | sys::RESOLVE_NO_MAGICLINKS;
    let rel = target.strip_prefix("/").unwrap_or(target);
    let mut so_far = std::path::PathBuf::new();
    let mut dir = sys::openat2(root, c".", libc::O_PATH | libc::O_DIRECTORY, 0, RESOLVE)
        .map_err(|e| Error::io("opening the sandbox's root", e))?;
    for comp in rel.components() {
        let Component::Normal(name) = comp else {
            continue;
        };
        so_far.push(name);
        let path = cstring(&so_far)?;
        let open = || sys::openat2(root, &path, libc::O_PATH | libc::O_DIRECTORY, 0, RESOLVE);
        dir = match open() {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                let cname = CString::new(name.as_bytes())
                    .map_err(|_| Error::InvalidSpec("mount point contains NUL".into()))?;
                // SAFETY: valid directory fd and NUL-terminated name.
                let rc = unsafe { libc::mkdirat(dir.as_raw_fd(), cname.as_ptr(), 0o755) };
                if rc != 0 {
                    let e = std::io::Error::last_os_error();
                    if e.raw_os_error() != Some(libc::EEXIST) {
                        return Err(Error::io(format!("mkdir {}", target.display()), e));
                    }
                }
                open().map_err(|e| Error::io(format!("opening {}", target.display()), e))?
            }
            Err(e) => return Err(Error::io(format!("opening {}", target.display()), e)),
        };
    }
    Ok(dir)
}

fn cstring(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| Error::InvalidSpec(format!("path {} contains NUL", p.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_checked() {
        for ok in ["/mnt/data", "/home/user/vol", "/data", "/run/other"] {
            assert!(check_target(Path::new(ok)).is_ok(), "{ok}");
        }
        for bad in [
            "/",
            "relative",
            "/mnt/../etc",
            "/proc/x",
            "/sys",
            "/dev/shm/x",
            "/run/cubicle/ctl",
        ] {
            assert!(check_target(Path::new(bad)).is_err(), "{bad}");
        }
    }
}
