//! PID 1's output: a FIFO the caller drains, never a host file.
//!
//! The sandbox's root can take any descriptor of its own processes (`ptrace`,
//! `pidfd_getfd`), PID 1's stdout and stderr included. Were those a host file, it could
//! append to it, truncate it, or forge what the host reads. So they are the write end of
//! a FIFO ([`SandboxSpec::init_log`](crate::SandboxSpec::init_log)), and the caller owns
//! the read end and whatever it does with the bytes (the node writes its log file,
//! bounded in rate and size). A FIFO rather than an anonymous pipe so that a restarted
//! caller can open the read end again ([`open_init_log`]) while the sandbox runs on.
//!
//! The write end is non-blocking: when nobody drains the pipe (the caller is down, or
//! throttles a sandbox that writes too much), writes fail with EAGAIN instead of
//! stopping PID 1. The descriptor a sandbox can take is a pipe: writing to it only ever
//! produces output the caller reads; it cannot seek, truncate or change anything else.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Creates the FIFO at `path` (mode 0600) if it does not exist (an existing FIFO is
/// reused; anything else there is an error), and opens both ends, non-blocking and
/// close-on-exec: (read end, write end).
pub fn create_init_log(path: &Path) -> io::Result<(OwnedFd, OwnedFd)> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: valid C string.
    if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::AlreadyExists {
            return Err(e);
        }
    }
    // The reader first: opening the write end of a FIFO without one fails (ENXIO).
    let reader = open_init_log(path)?;
    let writer = open(&c, libc::O_WRONLY)?;
    Ok((reader, writer))
}

/// Opens the read end of the init log FIFO at `path` (non-blocking, close-on-exec),
/// e.g. after the process that started the sandbox restarted. Refuses symlinks and
/// anything that is not a FIFO. Reads return what the sandbox wrote since the last
/// reader went away (as far as the pipe buffer held it), then end of file once every
/// process of the sandbox is gone.
pub fn open_init_log(path: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    open(&c, libc::O_RDONLY)
}

fn open(c: &CString, mode: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: valid C string.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            mode | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOFOLLOW,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let meta = File::from(fd.try_clone()?).metadata()?;
    if !std::os::unix::fs::FileTypeExt::is_fifo(&meta.file_type()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the init log is not a FIFO",
        ));
    }
    Ok(fd)
}

/// Reads what is available on the (non-blocking) read end `fd` into `out`; true at end
/// of file (no writer left).
pub fn read_available(fd: &OwnedFd, out: &mut Vec<u8>) -> io::Result<bool> {
    let mut buf = [0u8; 16 << 10];
    loop {
        // SAFETY: valid descriptor and buffer.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        match n {
            0 => return Ok(true),
            n if n > 0 => out.extend_from_slice(&buf[..n as usize]),
            _ => {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock => return Ok(false),
                    io::ErrorKind::Interrupted => {}
                    _ => return Err(e),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_fifo_the_reader_drains_and_reopens() {
        let dir = std::env::temp_dir().join(format!("cubicle-initlog-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("init.pipe");
        let (reader, writer) = create_init_log(&path).unwrap();
        let mut w = File::from(writer);
        w.write_all(b"one\n").unwrap();
        let mut got = Vec::new();
        assert!(!read_available(&reader, &mut got).unwrap());
        assert_eq!(got, b"one\n");
        // The reader goes away (a restart) and comes back: the pipe is the same.
        drop(reader);
        let reader = open_init_log(&path).unwrap();
        w.write_all(b"two\n").unwrap();
        got.clear();
        read_available(&reader, &mut got).unwrap();
        assert_eq!(got, b"two\n");
        // Nobody drains: the writer is refused (EAGAIN), never blocked.
        let big = vec![b'x'; 1 << 20];
        let e = w.write_all(&big).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        drop(w);
        got.clear();
        // End of file once no writer is left. Not at once, perhaps: a test on another
        // thread of this process that spawns a child may have forked while `w` was
        // open, and the child's copy of it stays open until its exec closes it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !read_available(&reader, &mut got).unwrap() {
            assert!(std::time::Instant::now() < deadline, "end of file");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // Not a FIFO: refused.
        std::fs::write(dir.join("file"), "x").unwrap();
        assert!(open_init_log(&dir.join("file")).is_err());
        std::os::unix::fs::symlink(&path, dir.join("link")).unwrap();
        assert!(open_init_log(&dir.join("link")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
