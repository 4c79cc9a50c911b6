//! The agent's Unix socket in `<sandbox_dir>/ctl`: created for the sandbox
//! ([`listen_in_sandbox`]) and reached from the host, safely ([`connect_ctl_socket`]).
//!
//! The sandbox never writes its ctl directory: the runtime creates the listening socket
//! before the sandbox's init runs and hands it over as fd [`crate::LISTEN_FD`], and the
//! directory, bind-mounted at [`crate::CTL_DIR`], is read-only from then on (after a
//! restore too: [`set_ctl_dir_readonly`]). (A writable one let a
//! sandbox create btrfs subvolumes outside its quota, and plant symlinks.) The host side
//! still distrusts the directory's content — it belongs to the sandbox's root, and a
//! sandbox adopted from an older version may have written it: a plain
//! `connect("<dir>/ctl/envd.sock")` by the (root) host process would follow a symlink to
//! any Unix socket of the host (another sandbox's agent, a system daemon).
//! [`connect_ctl_socket`] opens the name without following symlinks, checks that it is a
//! socket, and connects through `/proc/self/fd/N`, which refers to exactly that inode — no
//! race between the check and the connect.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use crate::error::{Error, Result, io_ctx};
use crate::spec::CTL_DIR;
use crate::sys::cpath;

fn open_nofollow(
    dir: Option<&OwnedFd>,
    path: &Path,
    flags: libc::c_int,
) -> std::io::Result<OwnedFd> {
    let c = cpath(path)?;
    let base = dir.map_or(libc::AT_FDCWD, |d| d.as_raw_fd());
    // SAFETY: valid dirfd and C string.
    let fd = unsafe {
        libc::openat(
            base,
            c.as_ptr(),
            flags | libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fresh descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `name` must be a plain file name.
fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(Error::InvalidSpec(format!(
            "ctl socket name {name:?} must be a plain file name"
        )));
    }
    Ok(())
}

/// Creates the init's listening Unix socket `name` in [`CTL_DIR`] (the caller then makes
/// that mount read-only: `seal_in_sandbox`); returns the socket, close-on-exec and non-blocking (the init serves it with
/// an event loop). Called by the sandbox child after `pivot_root`, while the ctl bind is
/// still writable and before anything of the tenant runs: the socket belongs to the
/// sandbox's network namespace, its file to the sandbox's root, and its name is the path
/// inside the sandbox — so CRIU finds it on the ctl mount at a dump and binds it there
/// again at a restore (see [`set_ctl_dir_readonly`]).
pub(crate) fn listen_in_sandbox(name: &str) -> Result<OwnedFd> {
    check_name(name)?;
    let path = format!("{CTL_DIR}/{name}");
    let ctx = |what: &str| {
        let what = format!("{what} {path}");
        io_ctx(move || what)
    };
    let dir = open_nofollow(None, Path::new(CTL_DIR), libc::O_DIRECTORY)
        .map_err(io_ctx(|| format!("open {CTL_DIR}")))?;
    let cname = cpath(Path::new(name)).map_err(ctx("name"))?;
    // Whatever has that name goes (a stale socket of an earlier run of this sandbox).
    // SAFETY: valid dirfd and C string.
    if unsafe { libc::unlinkat(dir.as_raw_fd(), cname.as_ptr(), 0) } < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ENOENT) {
            return Err(ctx("remove stale")(e));
        }
    }
    let sock = UnixListener::bind(&path).map_err(ctx("bind"))?;
    sock.set_nonblocking(true).map_err(ctx("O_NONBLOCK on"))?;
    Ok(OwnedFd::from(sock))
}

/// Makes the mount at [`CTL_DIR`] (of the calling thread's mount namespace) read-only.
pub(crate) fn seal_in_sandbox() -> Result<()> {
    set_readonly_here(true)
}

fn set_readonly_here(readonly: bool) -> Result<()> {
    let dir = open_nofollow(None, Path::new(CTL_DIR), libc::O_DIRECTORY)
        .map_err(io_ctx(|| format!("open {CTL_DIR}")))?;
    let (set, clr) = match readonly {
        true => (crate::sys::MOUNT_ATTR_RDONLY, 0),
        false => (0, crate::sys::MOUNT_ATTR_RDONLY),
    };
    crate::sys::mount_setattr_clr(&dir, set, clr, None).map_err(io_ctx(|| {
        format!(
            "making {CTL_DIR} {}",
            if readonly { "read-only" } else { "writable" }
        )
    }))
}

/// Makes the ctl directory of the sandbox whose init is `pid` read-only (`true`) or
/// writable, for checkpoint/restore only and only while none of its processes runs:
/// CRIU records the mount's flags at a dump and re-creates the mount with them at a
/// restore, where it must bind the init's socket in it again. So a dump makes it writable
/// while the sandbox is frozen (read-only again before a thaw), and a restore makes it
/// read-only before the restored tasks resume (CRIU's `pre-resume`). From a throwaway
/// thread that enters the sandbox's mount namespace (the host's root may change its
/// mounts: the flag was set inside it, so it is not locked).
pub fn set_ctl_dir_readonly(pid: i32, readonly: bool) -> Result<()> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/mnt"))
        .map_err(io_ctx(|| format!("open /proc/{pid}/ns/mnt")))?;
    std::thread::spawn(move || -> Result<()> {
        // SAFETY: unshare of this thread's filesystem attributes (root, cwd), so that
        // entering another mount namespace affects this thread alone.
        if unsafe { libc::unshare(libc::CLONE_FS) } < 0 {
            return Err(io_ctx(|| "unshare(CLONE_FS)".to_string())(
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: setns on an open namespace descriptor.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNS) } < 0 {
            return Err(io_ctx(|| format!("entering the mount namespace of {pid}"))(
                std::io::Error::last_os_error(),
            ));
        }
        set_readonly_here(readonly)
    })
    .join()
    .map_err(|_| Error::Setup("the thread changing the ctl mount panicked".into()))?
}

/// Opens (`O_PATH`) the Unix socket `name` (a plain file name, e.g. `envd.sock`) in the
/// host directory `ctl_dir`, refusing symlinks and anything that is not a socket. Connect
/// through `/proc/self/fd/N` of the result.
pub fn open_ctl_socket(ctl_dir: &Path, name: &str) -> Result<OwnedFd> {
    check_name(name)?;
    let dir = open_nofollow(None, ctl_dir, libc::O_DIRECTORY).map_err(io_ctx(|| {
        format!("open ctl directory {}", ctl_dir.display())
    }))?;
    let sock = open_nofollow(Some(&dir), Path::new(name), 0)
        .map_err(io_ctx(|| format!("open {}/{name}", ctl_dir.display())))?;
    // SAFETY: zeroed stat is a valid out buffer for fstat on a valid fd.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(sock.as_raw_fd(), &mut st) } < 0 {
        return Err(io_ctx(|| format!("stat {}/{name}", ctl_dir.display()))(
            std::io::Error::last_os_error(),
        ));
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(Error::Setup(format!(
            "{}/{name} is not a socket (mode {:o}): refusing to follow what the sandbox put there",
            ctl_dir.display(),
            st.st_mode
        )));
    }
    Ok(sock)
}

/// Connects to the Unix socket `name` in the host directory `ctl_dir` (see
/// [`open_ctl_socket`]). Blocking: a listener whose backlog is full (a sandbox that stops
/// accepting) makes it wait.
pub fn connect_ctl_socket(ctl_dir: &Path, name: &str) -> Result<UnixStream> {
    let sock = open_ctl_socket(ctl_dir, name)?;
    UnixStream::connect(format!("/proc/self/fd/{}", sock.as_raw_fd()))
        .map_err(io_ctx(|| format!("connect {}/{name}", ctl_dir.display())))
}

/// A ctl socket's path as its directory and file name (what [`open_ctl_socket`] takes).
pub fn ctl_socket_parts(socket: &Path) -> Result<(&Path, &str)> {
    match (socket.parent(), socket.file_name().and_then(|n| n.to_str())) {
        (Some(d), Some(n)) => Ok((d, n)),
        _ => Err(Error::InvalidSpec(format!(
            "bad ctl socket path {}",
            socket.display()
        ))),
    }
}

/// [`connect_ctl_socket`] of the socket at `socket` for async callers, without a hop to
/// the blocking pool: the opens are quick, and the connect is non-blocking (a full
/// backlog is an error here, never a wait).
pub async fn connect_ctl_socket_async(socket: &Path) -> Result<tokio::net::UnixStream> {
    let (ctl_dir, name) = ctl_socket_parts(socket)?;
    let sock = open_ctl_socket(ctl_dir, name)?;
    tokio::net::UnixStream::connect(format!("/proc/self/fd/{}", sock.as_raw_fd()))
        .await
        .map_err(io_ctx(|| format!("connect {}/{name}", ctl_dir.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn connects_to_real_socket_and_refuses_symlinks() {
        let dir = std::env::temp_dir().join(format!("cubicle-ctl-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("ctl")).unwrap();
        let target = dir.join("host.sock");
        let _host = UnixListener::bind(&target).unwrap();
        let _good = UnixListener::bind(dir.join("ctl/envd.sock")).unwrap();
        std::os::unix::fs::symlink(&target, dir.join("ctl/evil.sock")).unwrap();
        std::fs::write(dir.join("ctl/file"), "x").unwrap();

        connect_ctl_socket(&dir.join("ctl"), "envd.sock").unwrap();
        // A plain connect follows the planted symlink to the host's socket...
        assert!(UnixStream::connect(dir.join("ctl/evil.sock")).is_ok());
        // ...connect_ctl_socket does not.
        assert!(connect_ctl_socket(&dir.join("ctl"), "evil.sock").is_err());
        assert!(connect_ctl_socket(&dir.join("ctl"), "file").is_err());
        assert!(connect_ctl_socket(&dir.join("ctl"), "../host.sock").is_err());
        assert!(connect_ctl_socket(&dir.join("ctl"), "missing.sock").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
