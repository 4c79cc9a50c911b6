//! The open-files limit (`RLIMIT_NOFILE`) of the node and of its sandboxes.
//!
//! A node holds two descriptors per sandbox for as long as it lives (its init's pidfd,
//! shared by everything that watches it, and the init log's FIFO), a connection or two
//! to envd while the sandbox is used, plus one per client connection: 10,000 sandboxes
//! need far more than a login shell's limit (1,024
//! soft on a stock Debian; an earlier density run here stopped at 3,276 sandboxes with
//! `EMFILE` everywhere at a limit of 20,000). [`raise_for_node`], called once at start,
//! raises the process's own limit as far as the kernel allows (`fs.nr_open`, at most
//! 2^20) and remembers the limit it was started with; [`for_sandboxes`] gives that
//! original limit back, which [`crate::SandboxSpec::new`] puts into every spec so that a
//! sandbox's processes see what they saw before (the node's raise is the node's
//! business, not something a tenant inherits).

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

/// An `RLIMIT_NOFILE` pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FdLimit {
    /// The soft limit (what `open` is held to).
    pub soft: u64,
    /// The hard limit (the most an unprivileged process may raise its soft limit to).
    pub hard: u64,
}

/// The most the node raises its own limit to.
const NODE_MAX: u64 = 1 << 20;

static STARTED_WITH: OnceLock<FdLimit> = OnceLock::new();

/// The calling process's limit.
pub fn current() -> std::io::Result<FdLimit> {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes a struct rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(FdLimit {
        soft: rl.rlim_cur,
        hard: rl.rlim_max,
    })
}

/// Sets the calling process's limit.
pub fn set(limit: FdLimit) -> std::io::Result<()> {
    let rl = libc::rlimit {
        rlim_cur: limit.soft,
        rlim_max: limit.hard,
    };
    // SAFETY: setrlimit reads a struct rlimit.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &rl) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Raises this process's limit: soft and hard to `min(fs.nr_open, 2^20)` when it may
/// (root), else the soft limit to the hard one. Remembers the limit it started with for
/// [`for_sandboxes`] (only the first call does). Returns the limit now in force.
pub fn raise_for_node() -> std::io::Result<FdLimit> {
    let start = current()?;
    let _ = STARTED_WITH.set(start);
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(NODE_MAX);
    let want = nr_open.min(NODE_MAX).max(start.soft);
    let raised = FdLimit {
        soft: want,
        hard: want.max(start.hard),
    };
    if raised != start && set(raised).is_err() {
        // Not privileged: as far as the hard limit goes.
        set(FdLimit {
            soft: start.hard,
            hard: start.hard,
        })?;
    }
    current()
}

/// Grows this process's descriptor table to hold at least `slots` descriptors now
/// (capped by the soft limit). Call it while the process has one thread.
///
/// The kernel grows the table by doubling as descriptors are opened, and in a process
/// with several threads every growth waits for an RCU grace period while each thread
/// that opens a descriptor waits behind it (`expand_files` → `synchronize_rcu`, about
/// 12 ms on the development VM): in a burst of 50 creates the server's tokio workers
/// and its accept loop all stalled together once the table outgrew its size. Grown
/// while single-threaded, it needs no grace period, and it never shrinks. A slot costs
/// about 8 bytes. Returns the slots asked for after the cap.
pub fn presize_table(slots: u64) -> std::io::Result<u64> {
    let soft = current()?.soft;
    let want = slots.min(soft).min(libc::c_int::MAX as u64);
    if want < 2 {
        return Ok(want);
    }
    let probe = std::fs::File::open("/dev/null")?;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: F_DUPFD_CLOEXEC on a descriptor we own; the result is a new descriptor (the
    // lowest free one at or above `want - 1`), owned and closed below.
    let fd = unsafe {
        libc::fcntl(
            probe.as_raw_fd(),
            libc::F_DUPFD_CLOEXEC,
            (want - 1) as libc::c_int,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by fcntl and nothing else owns it.
    drop(unsafe { OwnedFd::from_raw_fd(fd) });
    Ok(want)
}

/// The limit this process started with, before [`raise_for_node`] (`None` if it was not
/// called: the sandboxes then inherit the process's own).
pub fn for_sandboxes() -> Option<FdLimit> {
    STARTED_WITH.get().copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raises_and_remembers_the_original() {
        let before = current().unwrap();
        let now = raise_for_node().unwrap();
        assert!(now.soft >= before.soft, "{now:?} < {before:?}");
        assert_eq!(now.soft, now.hard.min(now.soft));
        assert_eq!(for_sandboxes(), Some(before));
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            assert!(now.soft >= before.hard.min(NODE_MAX), "{now:?}");
        }
        set(before).unwrap();
    }

    /// The table size of this process (`/proc/self/status`'s FDSize).
    fn table_size() -> Option<u64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("FDSize:"))
            .and_then(|v| v.trim().parse().ok())
    }

    #[test]
    fn presizes_the_table() {
        let soft = current().unwrap().soft;
        let want = 4096.min(soft);
        assert_eq!(presize_table(want).unwrap(), want);
        let size = table_size().unwrap();
        assert!(size >= want, "FDSize {size} < {want}");
        // The probe descriptors are closed again: a new one gets a low number.
        let f = std::fs::File::open("/dev/null").unwrap();
        use std::os::fd::AsRawFd;
        assert!((f.as_raw_fd() as u64) < want / 2, "{}", f.as_raw_fd());
    }
}
