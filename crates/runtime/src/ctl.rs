//! Reaching the agent's Unix socket in `<sandbox_dir>/ctl` from the host, safely.
//!
//! The ctl directory is writable by the sandbox's root. A sandbox can therefore replace
//! `envd.sock` with a symlink to any Unix socket of the host (another sandbox's agent, a
//! system daemon), and a plain `connect("<dir>/ctl/envd.sock")` by the (root) host process
//! would follow it. [`connect_ctl_socket`] opens the name without following symlinks,
//! checks that it is a socket, and connects through `/proc/self/fd/N`, which refers to
//! exactly that inode — no race between the check and the connect.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;

use crate::error::{Error, Result, io_ctx};
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

/// Opens (`O_PATH`) the Unix socket `name` (a plain file name, e.g. `envd.sock`) in the
/// host directory `ctl_dir`, refusing symlinks and anything that is not a socket. Connect
/// through `/proc/self/fd/N` of the result.
pub fn open_ctl_socket(ctl_dir: &Path, name: &str) -> Result<OwnedFd> {
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(Error::InvalidSpec(format!(
            "ctl socket name {name:?} must be a plain file name"
        )));
    }
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
