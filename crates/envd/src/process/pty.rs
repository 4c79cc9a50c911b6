//! Pseudo-terminals for `pty.create`: a master opened from `/dev/ptmx` (non-blocking,
//! close-on-exec, driven by tokio), its slave obtained with `TIOCGPTPEER` (falling back
//! to `/dev/pts/<n>`), and window-size changes with `TIOCSWINSZ` (the kernel then sends
//! `SIGWINCH` to the terminal's foreground process group).

use std::{
    ffi::CString,
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
};

use tokio::io::unix::AsyncFd;

/// Size used when a request names none (or zeros).
pub const DEFAULT_COLS: u16 = 80;
pub const DEFAULT_ROWS: u16 = 24;

/// The master side of a PTY, shared by the output reader and input writers.
#[derive(Debug)]
pub struct PtyMaster {
    fd: AsyncFd<OwnedFd>,
}

/// Opens a new PTY pair of the given size: `(master, slave)`. Both descriptors are
/// close-on-exec; the master is non-blocking.
pub fn open(cols: u16, rows: u16) -> io::Result<(OwnedFd, OwnedFd)> {
    let master = open_ptmx()?;
    // Unlock the slave (unlockpt).
    let unlock: libc::c_int = 0;
    // SAFETY: TIOCSPTLCK takes a pointer to an int; master is a valid fd.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSPTLCK, &unlock) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let slave = open_slave(&master)?;
    set_size(master.as_raw_fd(), cols, rows)?;
    Ok((master, slave))
}

fn open_ptmx() -> io::Result<OwnedFd> {
    let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC | libc::O_NONBLOCK;
    let mut last = io::Error::from(io::ErrorKind::NotFound);
    for path in [c"/dev/ptmx", c"/dev/pts/ptmx"] {
        // SAFETY: path is a valid C string.
        let fd = unsafe { libc::open(path.as_ptr(), flags) };
        if fd >= 0 {
            // SAFETY: fd was just returned by open and is owned by nobody else.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        last = io::Error::last_os_error();
    }
    Err(last)
}

fn open_slave(master: &OwnedFd) -> io::Result<OwnedFd> {
    let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC;
    // SAFETY: TIOCGPTPEER takes the open flags as its argument.
    let fd = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPTPEER, flags) };
    if fd >= 0 {
        // SAFETY: a fresh descriptor from the kernel.
        return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    // Older kernels: look the slave up by number.
    let mut n: libc::c_uint = 0;
    // SAFETY: TIOCGPTN writes an unsigned int.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPTN, &mut n) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let path = CString::new(format!("/dev/pts/{n}")).map_err(io::Error::other)?;
    // SAFETY: path is a valid C string.
    let fd = unsafe { libc::open(path.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor from open.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sets the window size of the terminal behind `fd`.
pub fn set_size(fd: RawFd, cols: u16, rows: u16) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: if rows == 0 { DEFAULT_ROWS } else { rows },
        ws_col: if cols == 0 { DEFAULT_COLS } else { cols },
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a struct winsize.
    if unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Clamps a protobuf `uint32` size to the `u16` a terminal takes.
pub fn clamp(v: u32) -> u16 {
    v.min(u16::MAX as u32) as u16
}

impl PtyMaster {
    /// Wraps a non-blocking master; must be called inside the tokio runtime.
    pub fn new(fd: OwnedFd) -> io::Result<Self> {
        // SAFETY: an OwnedFd stays open and unchanged for as long as the AsyncFd owns it.
        let fd = unsafe { AsyncFd::register(fd) }?;
        Ok(Self { fd })
    }

    /// Reads output; `Ok(0)` once every slave descriptor is closed (the kernel reports
    /// that as `EIO`).
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut guard = self.fd.readable().await?;
            let res = guard.try_io(|inner| {
                // SAFETY: buf is valid for writes of buf.len() bytes.
                let n = unsafe {
                    libc::read(
                        inner.get_ref().as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                    )
                };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match res {
                Ok(Ok(n)) => return Ok(n),
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }

    /// Writes all of `data` (terminal input).
    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let mut guard = self.fd.writable().await?;
            let res = guard.try_io(|inner| {
                // SAFETY: data is valid for reads of data.len() bytes.
                let n = unsafe {
                    libc::write(
                        inner.get_ref().as_raw_fd(),
                        data.as_ptr().cast(),
                        data.len(),
                    )
                };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match res {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => {}
            }
        }
        Ok(())
    }

    /// Resizes the terminal.
    pub fn resize(&self, cols: u16, rows: u16) -> io::Result<()> {
        set_size(self.fd.get_ref().as_raw_fd(), cols, rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_and_sizes() {
        let Ok((master, slave)) = open(100, 30) else {
            eprintln!("skipping: no /dev/ptmx here");
            return;
        };
        // SAFETY: an all-zero winsize is valid.
        let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
        // SAFETY: TIOCGWINSZ writes a struct winsize.
        let rc = unsafe { libc::ioctl(slave.as_raw_fd(), libc::TIOCGWINSZ, &mut ws) };
        assert_eq!(rc, 0);
        assert_eq!((ws.ws_col, ws.ws_row), (100, 30));
        // Both ends are close-on-exec.
        for fd in [master.as_raw_fd(), slave.as_raw_fd()] {
            // SAFETY: F_GETFD on a descriptor we own; no pointers.
            let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
            assert!(flags & libc::FD_CLOEXEC != 0);
        }
    }

    #[tokio::test]
    async fn echoes_through_the_line_discipline() {
        let Ok((master, slave)) = open(80, 24) else {
            eprintln!("skipping: no /dev/ptmx here");
            return;
        };
        let m = PtyMaster::new(master).unwrap();
        m.write_all(b"ping\n").await.unwrap();
        let mut buf = [0u8; 64];
        let n = m.read(&mut buf).await.unwrap();
        // Echo is on by default.
        assert!(String::from_utf8_lossy(&buf[..n]).contains("ping"));
        drop(slave);
        // With the slave closed, reads end (EIO → 0) once the echo is consumed.
        let mut total = 0;
        loop {
            let n = m.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            total += n;
            assert!(total < 1024);
        }
    }
}
