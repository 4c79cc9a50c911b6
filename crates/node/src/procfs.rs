//! Process facts from /proc and pidfds: start times (to tell a live init from a reused
//! pid after a node restart) and waiting for a process that is not our child.

use std::os::fd::{FromRawFd, OwnedFd};

/// Start time (clock ticks since boot, field 22 of `/proc/PID/stat`) of `pid`.
pub fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // comm (field 2) may contain spaces and parens: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    // rest starts at field 3 (state); field 22 is index 19 in rest.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// True if `pid` exists, is not a zombie, and (when given) started at `start`.
pub fn is_alive(pid: i32, start: Option<u64>) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let Some(close) = stat.rfind(')') else {
        return false;
    };
    let mut fields = stat[close + 1..].split_whitespace();
    if matches!(fields.next(), Some("Z") | Some("X") | None) {
        return false;
    }
    match start {
        Some(s) => start_time(pid) == Some(s),
        None => true,
    }
}

/// `pidfd_open(pid, 0)`: becomes readable when the process exits.
pub fn pidfd_open(pid: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: plain syscall; on success the kernel returns a new fd we own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, valid descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Whether the process a pidfd names has exited (a poll that does not wait).
pub fn pidfd_exited(fd: &OwnedFd) -> bool {
    use std::os::fd::AsRawFd;
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait.
    unsafe { libc::poll(&mut pfd, 1, 0) > 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_is_alive_with_its_start_time() {
        let me = std::process::id() as i32;
        let st = start_time(me).unwrap();
        assert!(is_alive(me, Some(st)));
        assert!(!is_alive(me, Some(st + 1)));
        assert!(!is_alive(i32::MAX, None));
    }
}
