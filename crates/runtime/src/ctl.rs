//! The agent's Unix socket in `<sandbox_dir>/ctl`: created for the sandbox
//! ([`listen_ctl_socket`]) and reached from the host, safely ([`connect_ctl_socket`]).
//!
//! The sandbox never writes its ctl directory: the runtime creates the listening socket
//! before the sandbox's init runs and hands it over as fd [`crate::LISTEN_FD`], and the
//! directory is bind-mounted read-only at [`crate::CTL_DIR`]. (A writable one let a
//! sandbox create btrfs subvolumes outside its quota, and plant symlinks.) The host side
//! still distrusts the directory's content — it belongs to the sandbox's root, and a
//! sandbox adopted from an older version may have written it: a plain
//! `connect("<dir>/ctl/envd.sock")` by the (root) host process would follow a symlink to
//! any Unix socket of the host (another sandbox's agent, a system daemon).
//! [`connect_ctl_socket`] opens the name without following symlinks, checks that it is a
//! socket, and connects through `/proc/self/fd/N`, which refers to exactly that inode — no
//! race between the check and the connect.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;

use crate::error::{Error, Result, io_ctx};
use crate::spec::SandboxSpec;
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

/// Creates the listening Unix socket `name` in the host directory `ctl_dir` (replacing
/// whatever has that name) and returns it, close-on-exec and non-blocking (the init
/// serves it with an event loop; a restored one is handed it as is, see
/// [`listen_ctl_socket_for_restore`]). Called by the sandbox child
/// before `pivot_root`, so that the socket belongs to the sandbox's network namespace
/// and its file to the sandbox's root, while the directory is still writable in the
/// child's mount namespace (the sandbox's own view of it is read-only).
/// `owner`: the uid (and gid) to give the socket's file, when the caller is not the
/// sandbox's root already.
pub(crate) fn listen_ctl_socket(
    ctl_dir: &Path,
    name: &str,
    owner: Option<u32>,
) -> Result<OwnedFd> {
    check_name(name)?;
    let ctx = |what: &str| {
        let what = format!("{what} {}/{name}", ctl_dir.display());
        io_ctx(move || what)
    };
    let dir = open_nofollow(None, ctl_dir, libc::O_DIRECTORY).map_err(io_ctx(|| {
        format!("open ctl directory {}", ctl_dir.display())
    }))?;
    let cname = cpath(Path::new(name)).map_err(ctx("name"))?;
    // SAFETY: valid dirfd and C string.
    if unsafe { libc::unlinkat(dir.as_raw_fd(), cname.as_ptr(), 0) } < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ENOENT) {
            return Err(ctx("remove stale")(e));
        }
    }
    // SAFETY: plain socket(2).
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if fd < 0 {
        return Err(ctx("socket for")(std::io::Error::last_os_error()));
    }
    // SAFETY: fresh descriptor.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // Bound through the directory's descriptor: no path component is looked up again.
    let path = format!("/proc/self/fd/{}/{name}", dir.as_raw_fd());
    // SAFETY: an all-zero sockaddr_un is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    if path.len() >= addr.sun_path.len() {
        return Err(Error::InvalidSpec(format!("socket path {path} too long")));
    }
    for (d, s) in addr.sun_path.iter_mut().zip(path.bytes()) {
        *d = s as libc::c_char;
    }
    let len = (std::mem::size_of::<libc::sa_family_t>() + path.len() + 1) as libc::socklen_t;
    // SAFETY: addr is a valid sockaddr_un of `len` bytes; listen on the bound socket.
    let rc = unsafe {
        libc::bind(
            sock.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            len,
        )
    };
    if rc < 0 {
        return Err(ctx("bind")(std::io::Error::last_os_error()));
    }
    // SAFETY: listen on our bound socket.
    if unsafe { libc::listen(sock.as_raw_fd(), 4096) } < 0 {
        return Err(ctx("listen on")(std::io::Error::last_os_error()));
    }
    if let Some(uid) = owner {
        // SAFETY: valid dirfd and C string; no symlink is followed.
        let rc = unsafe {
            libc::fchownat(
                dir.as_raw_fd(),
                cname.as_ptr(),
                uid,
                uid,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        if rc < 0 {
            return Err(ctx("chown")(std::io::Error::last_os_error()));
        }
    }
    Ok(sock)
}

/// A new listening socket at the ctl socket of `spec` (`None` when it has none), owned
/// by the sandbox's root like the one the sandbox child made: for a restore, which hands
/// it to the restored init in place of the one it had. The original's file is on the
/// host, outside every mount of the sandbox, so CRIU cannot bind it again itself.
pub fn listen_ctl_socket_for_restore(spec: &SandboxSpec) -> Result<Option<OwnedFd>> {
    match &spec.ctl_socket {
        Some(name) => listen_ctl_socket(&spec.ctl_dir(), name, Some(spec.uid_base)).map(Some),
        None => Ok(None),
    }
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

    #[test]
    fn listens_and_replaces_stale_entries() {
        let dir = std::env::temp_dir().join(format!("cubicle-ctl-listen-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.join("envd.sock")).unwrap();
        let l = listen_ctl_socket(&dir, "envd.sock", None).unwrap();
        connect_ctl_socket(&dir, "envd.sock").unwrap();
        // SAFETY: borrowing our own descriptor for a moment.
        let listener = unsafe { std::os::unix::net::UnixListener::from_raw_fd(l.as_raw_fd()) };
        assert!(listener.accept().is_ok());
        std::mem::forget(listener); // `l` owns the descriptor
        assert!(listen_ctl_socket(&dir, "../x.sock", None).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
