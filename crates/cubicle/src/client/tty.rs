//! The local terminal for `cubicle sandbox shell`: raw mode with a guard that restores
//! the saved settings when dropped (normal exit, error, unwinding panic), from a panic
//! hook (a panic on another thread), and on request from signal handling; plus the
//! window size (`TIOCGWINSZ`).

use std::{
    io,
    os::fd::RawFd,
    sync::{Mutex, Once},
};

/// The settings to restore: one terminal at a time is in raw mode.
static SAVED: Mutex<Option<(RawFd, libc::termios)>> = Mutex::new(None);
static PANIC_HOOK: Once = Once::new();

/// Whether `fd` is a terminal.
pub fn is_tty(fd: RawFd) -> bool {
    // SAFETY: isatty only inspects the descriptor.
    unsafe { libc::isatty(fd) == 1 }
}

fn get_attr(fd: RawFd) -> io::Result<libc::termios> {
    // SAFETY: termios is plain data; tcgetattr fills it or fails.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: `t` is a valid, writable termios.
    if unsafe { libc::tcgetattr(fd, &mut t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(t)
}

fn set_attr(fd: RawFd, t: &libc::termios) -> io::Result<()> {
    // TCSANOW: keystrokes already typed (e.g. pasted ahead) are kept, not flushed.
    // SAFETY: `t` points to a valid termios.
    if unsafe { libc::tcsetattr(fd, libc::TCSANOW, t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Restores the saved terminal settings, if raw mode is on (idempotent; safe from a
/// panic hook).
pub fn restore() {
    let saved = match SAVED.lock() {
        Ok(mut g) => g.take(),
        Err(poisoned) => poisoned.into_inner().take(),
    };
    if let Some((fd, t)) = saved {
        let _ = set_attr(fd, &t);
    }
}

/// Raw mode on a terminal for as long as the guard lives.
pub struct RawMode {
    _private: (),
}

impl RawMode {
    /// Saves `fd`'s settings and switches it to raw mode (no echo, no line editing, no
    /// signal keys: Ctrl-C and Ctrl-D go to the remote shell). Output post-processing
    /// stays as the remote pty already produces `\r\n`.
    pub fn enable(fd: RawFd) -> io::Result<RawMode> {
        let original = get_attr(fd)?;
        let mut raw = original;
        // SAFETY: cfmakeraw edits the struct in place.
        unsafe { libc::cfmakeraw(&mut raw) };
        {
            let mut g = SAVED.lock().unwrap_or_else(|p| p.into_inner());
            if g.is_some() {
                return Err(io::Error::other("a terminal is already in raw mode"));
            }
            *g = Some((fd, original));
        }
        PANIC_HOOK.call_once(|| {
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                restore();
                previous(info);
            }));
        });
        if let Err(e) = set_attr(fd, &raw) {
            restore();
            return Err(e);
        }
        Ok(RawMode { _private: () })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        restore();
    }
}

/// The window size of `fd` as `(cols, rows)`; `None` when not a terminal or unknown.
pub fn window_size(fd: RawFd) -> Option<(u16, u16)> {
    // SAFETY: winsize is plain data.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ writes a winsize into the valid pointer.
    if unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) } != 0 {
        return None;
    }
    (ws.ws_col > 0 && ws.ws_row > 0).then_some((ws.ws_col, ws.ws_row))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// Tests that put a terminal in raw mode share one global: run them one at a time.
    static SERIAL: Mutex<()> = Mutex::new(());

    fn pty() -> (std::os::fd::OwnedFd, std::os::fd::OwnedFd) {
        let ws = nix::pty::Winsize {
            ws_row: 33,
            ws_col: 111,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        let p = nix::pty::openpty(Some(&ws), None).expect("openpty");
        (p.master, p.slave)
    }

    fn flags(fd: RawFd) -> (libc::tcflag_t, libc::tcflag_t) {
        let t = get_attr(fd).unwrap();
        (t.c_lflag, t.c_iflag)
    }

    #[test]
    fn raw_mode_is_restored_on_drop() {
        let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let (_m, slave) = pty();
        let fd = slave.as_raw_fd();
        assert!(is_tty(fd));
        let before = flags(fd);
        assert_ne!(before.0 & libc::ICANON, 0);
        assert_ne!(before.0 & libc::ECHO, 0);
        {
            let _g = RawMode::enable(fd).unwrap();
            let (l, i) = flags(fd);
            assert_eq!(l & (libc::ICANON | libc::ECHO | libc::ISIG), 0, "not raw");
            assert_eq!(i & libc::ICRNL, 0);
            // A second terminal cannot be put in raw mode over the first.
            assert!(RawMode::enable(fd).is_err());
        }
        assert_eq!(flags(fd), before, "settings not restored");
        assert_eq!(window_size(fd), Some((111, 33)));
    }

    #[test]
    fn raw_mode_is_restored_when_panicking() {
        let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let (_m, slave) = pty();
        let fd = slave.as_raw_fd();
        let before = flags(fd);
        let r = std::panic::catch_unwind(|| {
            let _g = RawMode::enable(fd).unwrap();
            assert_eq!(flags(fd).0 & libc::ICANON, 0);
            panic!("boom");
        });
        assert!(r.is_err());
        assert_eq!(flags(fd), before);
        // A panic on another thread (the guard's owner never unwinds): the hook restores.
        let _g = RawMode::enable(fd).unwrap();
        let _ = std::thread::spawn(|| panic!("other thread")).join();
        assert_eq!(flags(fd), before, "the panic hook did not restore");
        drop(_g); // nothing left to restore: harmless
        assert_eq!(flags(fd), before);
    }

    #[test]
    fn not_a_terminal() {
        let f = std::fs::File::open("/dev/null").unwrap();
        assert!(!is_tty(f.as_raw_fd()));
        assert!(RawMode::enable(f.as_raw_fd()).is_err());
        assert_eq!(window_size(f.as_raw_fd()), None);
    }
}
