//! Process file descriptors: a handle on one process that stays valid (and does not
//! name another process) after it exits, readable once it has exited.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use rustix::process::{Pid, PidfdFlags, Signal};

/// `pidfd_open(pid, 0)`. Fails with `ESRCH` when no such process exists.
pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    let pid = Pid::from_raw(pid).ok_or_else(|| io::Error::from_raw_os_error(esrch()))?;
    Ok(rustix::process::pidfd_open(pid, PidfdFlags::empty())?)
}

/// `pidfd_send_signal(pidfd, SIGKILL, NULL, 0)`: kills the process the pidfd names,
/// never a later process that reused its pid.
pub fn pidfd_kill(pidfd: impl AsFd) -> io::Result<()> {
    Ok(rustix::process::pidfd_send_signal(pidfd, Signal::KILL)?)
}

/// Whether the process `pidfd` names has exited (a `poll` that does not wait).
pub fn exited(pidfd: impl AsFd) -> bool {
    let mut fds = [rustix::event::PollFd::new(
        &pidfd,
        rustix::event::PollFlags::IN,
    )];
    let now = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    rustix::event::poll(&mut fds, Some(&now)).is_ok_and(|n| n > 0)
}

/// `ESRCH` (no such process), for a pid that cannot name one (0 or negative).
fn esrch() -> i32 {
    rustix::io::Errno::SRCH.raw_os_error()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pidfd_kills_its_process() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let fd = pidfd_open(child.id() as i32).expect("pidfd_open");
        assert!(!exited(&fd));
        pidfd_kill(&fd).expect("pidfd_send_signal");
        let status = child.wait().expect("wait");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(9));
        assert!(exited(&fd));
        // The process is reaped: its pidfd still names it, and signalling it fails.
        assert!(pidfd_kill(&fd).is_err());
        assert!(pidfd_open(0).is_err());
    }
}
