//! Thin, typed wrappers around the raw Linux system calls the runtime needs and that `libc`
//! does not wrap (new mount API, capset, seccomp, fd passing) or wraps awkwardly, and that
//! only the sandbox setup makes. Calls other crates make too (pidfds, `statfs`, `flock`,
//! unmounting, the mount table) are `cubicle-syscalls`'.
//!
//! Every wrapper returns `std::io::Result` with the errno of the failing call; callers add
//! the context (which path, which step). Syscall numbers are x86_64's: the runtime only
//! supports x86_64 (see `seccomp.rs`).

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

#[cfg(not(target_arch = "x86_64"))]
compile_error!("cubicle-runtime supports x86_64 only (syscall numbers and seccomp policy)");

pub const SYS_OPEN_TREE: libc::c_long = 428;
pub const SYS_MOVE_MOUNT: libc::c_long = 429;
pub const SYS_CLOSE_RANGE: libc::c_long = 436;
pub const SYS_MOUNT_SETATTR: libc::c_long = 442;
pub const SYS_OPENAT2: libc::c_long = 437;
pub const SYS_FSOPEN: libc::c_long = 430;
pub const SYS_FSCONFIG: libc::c_long = 431;
pub const SYS_FSMOUNT: libc::c_long = 432;

pub const OPEN_TREE_CLONE: libc::c_uint = 1;
pub const OPEN_TREE_CLOEXEC: libc::c_uint = libc::O_CLOEXEC as libc::c_uint;
pub const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
pub const MOVE_MOUNT_T_EMPTY_PATH: libc::c_uint = 0x40;
/// `openat2` resolve flags.
pub const RESOLVE_NO_XDEV: u64 = 0x01;
pub const RESOLVE_NO_MAGICLINKS: u64 = 0x02;
pub const RESOLVE_NO_SYMLINKS: u64 = 0x04;
pub const RESOLVE_BENEATH: u64 = 0x08;
pub const RESOLVE_IN_ROOT: u64 = 0x10;
pub const MOUNT_ATTR_RDONLY: u64 = 0x1;
pub const MOUNT_ATTR_NOSUID: u64 = 0x2;
pub const MOUNT_ATTR_NODEV: u64 = 0x4;
pub const MOUNT_ATTR_NOEXEC: u64 = 0x8;
pub const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
pub const CLOSE_RANGE_CLOEXEC: libc::c_uint = 4;

/// `struct mount_attr` of `mount_setattr(2)`.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// Converts a path to a C string; paths with interior NUL bytes are rejected.
pub fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// `socket(domain, kind | SOCK_CLOEXEC, protocol)`.
pub fn socket(
    domain: libc::c_int,
    kind: libc::c_int,
    protocol: libc::c_int,
) -> io::Result<OwnedFd> {
    // SAFETY: no memory arguments.
    let fd = check_int(unsafe { libc::socket(domain, kind | libc::SOCK_CLOEXEC, protocol) })?;
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn check(rc: libc::c_long) -> io::Result<libc::c_long> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn check_int(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// `open_tree(dirfd, path, flags | OPEN_TREE_CLOEXEC)`.
fn open_tree(dirfd: RawFd, path: &CStr, flags: libc::c_uint) -> io::Result<OwnedFd> {
    // SAFETY: a NUL-terminated path and a descriptor (or AT_FDCWD) the caller owns; the
    // kernel returns a new fd we take ownership of.
    let fd = check(unsafe {
        libc::syscall(
            SYS_OPEN_TREE,
            dirfd,
            path.as_ptr(),
            flags | OPEN_TREE_CLOEXEC,
        )
    })?;
    // SAFETY: fd is a fresh descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// `open_tree(AT_FDCWD, path, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)`: a detached bind mount.
pub fn open_tree_clone(path: &Path) -> io::Result<OwnedFd> {
    open_tree(libc::AT_FDCWD, &cpath(path)?, OPEN_TREE_CLONE)
}

/// `open_tree(AT_FDCWD, path, OPEN_TREE_CLONE | AT_RECURSIVE | OPEN_TREE_CLOEXEC)`: a
/// detached copy of the mount at `path` with every mount below it.
pub fn open_tree_clone_recursive(path: &Path) -> io::Result<OwnedFd> {
    open_tree(
        libc::AT_FDCWD,
        &cpath(path)?,
        OPEN_TREE_CLONE | libc::AT_RECURSIVE as libc::c_uint,
    )
}

/// `open_tree(fd, "", OPEN_TREE_CLONE | AT_EMPTY_PATH | OPEN_TREE_CLOEXEC)`: a detached
/// bind of the mount `fd` is the root of (e.g. one that [`fsmount`] made, which can be
/// attached only once; each clone can be attached once more).
pub fn open_tree_clone_fd(fd: &OwnedFd) -> io::Result<OwnedFd> {
    open_tree(
        fd.as_raw_fd(),
        c"",
        OPEN_TREE_CLONE | libc::AT_EMPTY_PATH as libc::c_uint,
    )
}

/// A new, detached instance of filesystem `fstype` without options (`fsopen`,
/// `fsconfig(FSCONFIG_CMD_CREATE)`, `fsmount`) with the mount attributes `attrs`; made
/// in the caller's namespaces, whatever the filesystem ties to them (sysfs: the network
/// namespace).
pub fn fsmount(fstype: &CStr, attrs: u64) -> io::Result<OwnedFd> {
    const FSOPEN_CLOEXEC: libc::c_uint = 1;
    const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
    const FSMOUNT_CLOEXEC: libc::c_uint = 1;
    // SAFETY: a valid NUL-terminated name; the kernel returns a new fd we own.
    let fs = check(unsafe { libc::syscall(SYS_FSOPEN, fstype.as_ptr(), FSOPEN_CLOEXEC) })?;
    // SAFETY: fs is a fresh descriptor owned by nobody else.
    let fs = unsafe { OwnedFd::from_raw_fd(fs as RawFd) };
    // SAFETY: a valid descriptor; CMD_CREATE takes no key, value or aux.
    check(unsafe {
        libc::syscall(
            SYS_FSCONFIG,
            fs.as_raw_fd(),
            FSCONFIG_CMD_CREATE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_void>(),
            0,
        )
    })?;
    // SAFETY: a valid descriptor and integer flags; the kernel returns a new fd we own.
    let m = check(unsafe { libc::syscall(SYS_FSMOUNT, fs.as_raw_fd(), FSMOUNT_CLOEXEC, attrs) })?;
    // SAFETY: m is a fresh descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(m as RawFd) })
}

/// `mount_setattr(fd, "", AT_EMPTY_PATH, {attr_set, userns_fd})` on the mount `fd` is
/// the root of (a detached one, or an attached one opened at its mount point).
pub fn mount_setattr(fd: &OwnedFd, attr_set: u64, userns_fd: Option<RawFd>) -> io::Result<()> {
    mount_setattr_clr(fd, attr_set, 0, userns_fd)
}

/// [`mount_setattr`] that also clears the attributes `attr_clr`.
pub fn mount_setattr_clr(
    fd: &OwnedFd,
    attr_set: u64,
    attr_clr: u64,
    userns_fd: Option<RawFd>,
) -> io::Result<()> {
    let attr = MountAttr {
        attr_set,
        attr_clr,
        propagation: 0,
        userns_fd: userns_fd.map(|f| f as u64).unwrap_or(0),
    };
    // SAFETY: attr is a valid struct of the size we pass; the path is an empty C string.
    check(unsafe {
        libc::syscall(
            SYS_MOUNT_SETATTR,
            fd.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    })?;
    Ok(())
}

/// `move_mount(fd, "", AT_FDCWD, target, MOVE_MOUNT_F_EMPTY_PATH)`: attach a detached mount.
pub fn move_mount_to(fd: RawFd, target: &Path) -> io::Result<()> {
    let t = cpath(target)?;
    // SAFETY: valid fd and NUL-terminated paths.
    check(unsafe {
        libc::syscall(
            SYS_MOVE_MOUNT,
            fd,
            c"".as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    })?;
    Ok(())
}

/// `move_mount(AT_FDCWD, from, AT_FDCWD, to, 0)`: move an attached mount (and the
/// mounts below it) elsewhere in the same mount namespace.
pub fn move_mount_path(from: &Path, to: &Path) -> io::Result<()> {
    let (f, t) = (cpath(from)?, cpath(to)?);
    // SAFETY: NUL-terminated paths; no flags.
    check(unsafe {
        libc::syscall(
            SYS_MOVE_MOUNT,
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            0 as libc::c_uint,
        )
    })?;
    Ok(())
}

/// `move_mount(fd, "", target_dir, "", F_EMPTY_PATH | T_EMPTY_PATH)`: attach a detached
/// mount on the directory `target_dir` refers to (an `O_PATH` descriptor, typically from
/// [`openat2`], so that no path is resolved again).
pub fn move_mount_onto(fd: RawFd, target_dir: RawFd) -> io::Result<()> {
    // SAFETY: valid fds and empty NUL-terminated paths.
    check(unsafe {
        libc::syscall(
            SYS_MOVE_MOUNT,
            fd,
            c"".as_ptr(),
            target_dir,
            c"".as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH,
        )
    })?;
    Ok(())
}

/// `struct open_how` of `openat2(2)`.
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// `openat2(dirfd, path, {flags | O_CLOEXEC, mode, resolve})`.
pub fn openat2(
    dirfd: RawFd,
    path: &CStr,
    flags: libc::c_int,
    mode: u32,
    resolve: u64,
) -> io::Result<OwnedFd> {
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC) as u64,
        mode: u64::from(mode),
        resolve,
    };
    loop {
        // SAFETY: valid fd, NUL-terminated path and an open_how of the size passed.
        let rc = unsafe {
            libc::syscall(
                SYS_OPENAT2,
                dirfd,
                path.as_ptr(),
                &how as *const OpenHow,
                std::mem::size_of::<OpenHow>(),
            )
        };
        match check(rc) {
            // RESOLVE_IN_ROOT/BENEATH lookups may race with renames elsewhere: retry.
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => continue,
            Err(e) => return Err(e),
            // SAFETY: a fresh descriptor nobody else owns.
            Ok(fd) => return Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) }),
        }
    }
}

/// `setns(fd, nstype)` for the calling thread (`fd`: a namespace file or a pidfd).
pub fn setns(fd: RawFd, nstype: libc::c_int) -> io::Result<()> {
    // SAFETY: plain syscall with integer arguments.
    check_int(unsafe { libc::setns(fd, nstype) })?;
    Ok(())
}

/// `unshare(flags)` for the calling thread.
pub fn unshare(flags: libc::c_int) -> io::Result<()> {
    // SAFETY: plain syscall with an integer argument.
    check_int(unsafe { libc::unshare(flags) })?;
    Ok(())
}

/// `setfsuid` + `setfsgid` of the calling thread (the ids file operations act as).
pub fn set_fs_ids(uid: u32, gid: u32) {
    // SAFETY: plain syscalls with integer arguments; they cannot fail observably (they
    // return the previous id), and only this thread's credentials change.
    unsafe {
        libc::syscall(libc::SYS_setfsgid, gid);
        libc::syscall(libc::SYS_setfsuid, uid);
    }
}

/// `mount(2)` with optional source/fstype/data.
pub fn mount(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let src = source.map(cpath).transpose()?;
    let tgt = cpath(target)?;
    let data = data
        .map(|d| CString::new(d).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput)))
        .transpose()?;
    // SAFETY: all pointers are NUL-terminated strings or null.
    check_int(unsafe {
        libc::mount(
            src.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            tgt.as_ptr(),
            fstype.map_or(std::ptr::null(), |s| s.as_ptr()),
            flags,
            data.as_ref()
                .map_or(std::ptr::null(), |d| d.as_ptr().cast()),
        )
    })?;
    Ok(())
}

/// `pivot_root(new_root, put_old)`.
pub fn pivot_root(new_root: &Path, put_old: &Path) -> io::Result<()> {
    let n = cpath(new_root)?;
    let o = cpath(put_old)?;
    // SAFETY: valid C strings.
    check(unsafe { libc::syscall(libc::SYS_pivot_root, n.as_ptr(), o.as_ptr()) })?;
    Ok(())
}

/// `close_range(first, ~0, CLOSE_RANGE_CLOEXEC)`: mark every fd from `first` close-on-exec.
pub fn cloexec_from(first: u32) -> io::Result<()> {
    // SAFETY: plain syscall with integer arguments.
    check(unsafe { libc::syscall(SYS_CLOSE_RANGE, first, u32::MAX, CLOSE_RANGE_CLOEXEC) })?;
    Ok(())
}

/// Makes `fd` descriptor number `target`, inherited across `execve` (not close-on-exec),
/// and closes the original (unless it already was `target`).
pub fn move_fd_to(fd: OwnedFd, target: RawFd) -> io::Result<()> {
    let raw = fd.into_raw_fd();
    if raw == target {
        // SAFETY: fcntl with integer arguments on our descriptor.
        check_int(unsafe { libc::fcntl(raw, libc::F_SETFD, 0) })?;
        return Ok(());
    }
    // SAFETY: dup2 with two descriptor numbers; dup2 clears FD_CLOEXEC on the copy. The
    // original is ours to close.
    let rc = unsafe { libc::dup2(raw, target) };
    // SAFETY: as above.
    unsafe { libc::close(raw) };
    check_int(rc).map(drop)
}

/// Linux capability sets, version 3 (two 32-bit words per set).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}
const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// Reads (effective, permitted, inheritable) of the calling thread as 64-bit masks.
pub fn capget() -> io::Result<(u64, u64, u64)> {
    let mut hdr = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: header and a 2-element data array as the v3 ABI requires.
    check(unsafe { libc::syscall(libc::SYS_capget, &mut hdr, data.as_mut_ptr()) })?;
    let join = |f: fn(&CapData) -> u32| u64::from(f(&data[0])) | (u64::from(f(&data[1])) << 32);
    Ok((
        join(|d| d.effective),
        join(|d| d.permitted),
        join(|d| d.inheritable),
    ))
}

/// Sets (effective, permitted, inheritable) of the calling thread.
pub fn capset(effective: u64, permitted: u64, inheritable: u64) -> io::Result<()> {
    let mut hdr = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [
        CapData {
            effective: effective as u32,
            permitted: permitted as u32,
            inheritable: inheritable as u32,
        },
        CapData {
            effective: (effective >> 32) as u32,
            permitted: (permitted >> 32) as u32,
            inheritable: (inheritable >> 32) as u32,
        },
    ];
    // SAFETY: header and a 2-element data array as the v3 ABI requires.
    check(unsafe { libc::syscall(libc::SYS_capset, &mut hdr, data.as_ptr()) })?;
    Ok(())
}

/// Installs a classic BPF seccomp program on the calling thread WITHOUT setting
/// no_new_privs: the kernel allows that when the caller has CAP_SYS_ADMIN in its user
/// namespace, which the sandbox's root has at this point.
pub fn seccomp_install(prog: &[seccompiler::sock_filter]) -> io::Result<()> {
    #[repr(C)]
    struct SockFprog {
        len: libc::c_ushort,
        filter: *const seccompiler::sock_filter,
    }
    let len = u16::try_from(prog.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "seccomp program too long"))?;
    let fprog = SockFprog {
        len,
        filter: prog.as_ptr(),
    };
    // SAFETY: fprog points at `len` valid instructions; the kernel copies them.
    check(unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            0 as libc::c_ulong,
            &fprog as *const SockFprog,
        )
    })?;
    Ok(())
}

/// Sets the calling thread's name (`comm`, at most 15 bytes), which `ps`, `top` and
/// `perf` show: a process started from `/proc/self/exe` is otherwise called `exe`.
/// Allocates nothing: fine in a forked child.
pub fn set_comm(name: &std::ffi::CStr) {
    // SAFETY: PR_SET_NAME reads a NUL-terminated string (the kernel copies at most 16
    // bytes, truncating).
    unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr() as libc::c_ulong, 0, 0, 0) };
}

/// Monotonic clock in nanoseconds; the same clock in every process, so the helper and the
/// sandbox child can timestamp their steps for the caller's profile.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// Runs `call` (a system call that returns a byte count, or -1 with errno) again for as
/// long as a signal interrupts it (`EINTR`). Allocates nothing: fine in a cloned child.
pub fn retry_eintr(mut call: impl FnMut() -> isize) -> io::Result<usize> {
    loop {
        let n = call();
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Writes all of `buf` to a raw fd (retrying on EINTR / short writes).
pub fn write_all_fd(fd: RawFd, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: buf is a valid slice.
        let n = retry_eintr(|| unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) })?;
        buf = &buf[n..];
    }
    Ok(())
}

/// Waits until `fd` is readable (or at end of file), retrying interrupted polls; a
/// `TimedOut` error once `deadline` passes.
pub fn wait_readable(fd: RawFd, deadline: std::time::Instant) -> io::Result<()> {
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if rc > 0 {
            return Ok(());
        }
        if rc == 0 {
            if left.is_zero() {
                return Err(io::ErrorKind::TimedOut.into());
            }
            continue;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Sends `data` plus `fds` (SCM_RIGHTS) over a connected Unix socket.
pub fn send_with_fds(sock: RawFd, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let fd_bytes = std::mem::size_of_val(fds) as u32;
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: zeroed msghdr is a valid initial value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: msg_control points at a buffer of CMSG_SPACE(fd_bytes) bytes.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes) as usize;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(cmsg),
                fd_bytes as usize,
            );
        }
    }
    // SAFETY: msg is fully initialised and its buffers outlive the call.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Receives one message of at most 4 KiB and up to `max_fds` descriptors (SCM_RIGHTS,
/// made close-on-exec). Returns the payload (empty on EOF) and the received descriptors.
pub fn recv_with_fds(sock: RawFd, max_fds: usize) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    recv_with_fds_sized(sock, 4096, max_fds)
}

/// [`recv_with_fds`] for messages of up to `max_len` bytes; a longer one (cut by the
/// kernel) is an `EMSGSIZE` error, its descriptors closed.
pub fn recv_with_fds_sized(
    sock: RawFd,
    max_len: usize,
    max_fds: usize,
) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut data = vec![0u8; max_len];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    let fd_bytes = (max_fds * std::mem::size_of::<RawFd>()) as u32;
    // SAFETY: pure computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: zeroed msghdr is a valid initial value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: msg buffers are valid for the duration of the call.
    let n = retry_eintr(|| unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) })?;
    data.truncate(n);
    let mut fds = Vec::new();
    // SAFETY: walking the control buffer the kernel filled, with the libc CMSG macros.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let payload = (*cmsg).cmsg_len - libc::CMSG_LEN(0) as usize;
                let count = payload / std::mem::size_of::<RawFd>();
                let base = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(base.add(i))));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(io::Error::from_raw_os_error(libc::EMSGSIZE));
    }
    Ok((data, fds))
}

/// Sets `IFF_UP` on a network interface of the caller's network namespace.
pub fn interface_up(name: &str) -> io::Result<()> {
    let sock = socket(libc::AF_INET, libc::SOCK_DGRAM, 0)?;
    // SAFETY: zeroed ifreq is valid.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    let bytes = name.as_bytes();
    if bytes.len() >= ifr.ifr_name.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "interface name too long",
        ));
    }
    for (dst, src) in ifr.ifr_name.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    // SAFETY: valid ifreq for SIOCGIFFLAGS/SIOCSIFFLAGS.
    unsafe {
        check_int(libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut ifr))?;
        ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        check_int(libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &ifr))?;
    }
    Ok(())
}
