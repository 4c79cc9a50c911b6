//! PID-1 duties (`--init`): envd is the first process of its sandbox's pid namespace, so
//! orphaned processes are re-parented to it and it must reap them, and a termination
//! signal from the host must end it (PID 1 ignores signals it has no handler for).
//!
//! envd does this itself rather than from a forked reaper process: one process per idle
//! sandbox instead of two (a forked reaper held about 160 KiB: its copies of the pages the
//! server later wrote, its page tables, kernel stack and task).
//!
//! The difficulty is that envd's own children are reaped by tokio (`Child::wait`), and a
//! reaper that took their exit statuses first would lose them. So every child envd starts
//! is registered in [`OWN`] before anything can reap it: [`spawn_guard`] is held across
//! the fork and the registration, and the reaper holds the same lock while it scans.
//! The reaper reaps only children that are not registered, by pid, never `waitpid(-1)`.
//! The supervisor [`forget`]s a child once tokio has reaped it.

use std::collections::HashSet;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Children started by envd and reaped by tokio (see the module comment).
static OWN: Mutex<Option<HashSet<u32>>> = Mutex::new(None);

/// The registry of envd's own children, locked: hold it across `Command::spawn` and
/// [`SpawnGuard::register`] so the reaper never sees an unregistered child of envd.
pub struct SpawnGuard(MutexGuard<'static, Option<HashSet<u32>>>);

impl SpawnGuard {
    /// Records `pid` as envd's own child (tokio reaps it).
    pub fn register(&mut self, pid: u32) {
        self.0.get_or_insert_with(HashSet::new).insert(pid);
    }
}

/// Locks the registry (see [`SpawnGuard`]).
pub fn spawn_guard() -> SpawnGuard {
    SpawnGuard(OWN.lock().unwrap_or_else(|p| p.into_inner()))
}

/// `pid` has been reaped by its supervisor: it is no longer envd's.
pub fn forget(pid: u32) {
    if let Some(set) = OWN.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
        set.remove(&pid);
    }
}

/// Reaps zombie children that envd did not start itself (re-parented orphans). Returns
/// how many it reaped.
pub fn reap_orphans() -> usize {
    let own = OWN.lock().unwrap_or_else(|p| p.into_inner());
    let mut reaped = 0;
    for pid in children() {
        if own.as_ref().is_some_and(|s| s.contains(&pid)) {
            continue;
        }
        let mut status = 0;
        // SAFETY: plain waitpid on one pid with WNOHANG; status is a valid out pointer.
        if unsafe { libc::waitpid(pid as libc::pid_t, &mut status, libc::WNOHANG) } > 0 {
            reaped += 1;
        }
    }
    reaped
}

/// The current children of this process (of all its threads).
fn children() -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for t in tasks.flatten() {
        if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
            out.extend(s.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
        }
    }
    out
}

/// How often the reaper looks without a SIGCHLD. Merged signals lose nothing (each
/// SIGCHLD scans every child, and an orphan re-parented as a zombie signals its new
/// parent), so this is only a backstop, and a rare one: an idle sandbox's envd must not
/// wake up. Once a second, it made thousands of idle envds the host's largest CPU user
/// (53% of all samples with 5,000 idle sandboxes, docs/bench.md). Once a minute, 10,000
/// idle envds still woke 170 times a second, each opening `/proc` files, and on a host
/// whose memory is fragmented every such open can enter direct reclaim (round 21).
const REAP_BACKSTOP: Duration = Duration::from_secs(600);

/// Runs PID 1's duties until the process exits: reap orphans on every SIGCHLD (and every
/// [`REAP_BACKSTOP`]), and exit with 128+N on SIGTERM, SIGINT or SIGHUP. Must run inside
/// the tokio runtime.
pub async fn run() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut chld), Ok(mut term), Ok(mut int), Ok(mut hup)) = (
        signal(SignalKind::child()),
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        tracing::error!("cannot install PID-1 signal handlers; orphans are reaped once a second");
        loop {
            reap_orphans();
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    };
    loop {
        tokio::select! {
            _ = chld.recv() => {}
            _ = tokio::time::sleep(REAP_BACKSTOP) => {}
            _ = term.recv() => std::process::exit(128 + libc::SIGTERM),
            _ = int.recv() => std::process::exit(128 + libc::SIGINT),
            _ = hup.recv() => std::process::exit(128 + libc::SIGHUP),
        }
        reap_orphans();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A registered child is left alone; an unregistered zombie child is reaped.
    #[test]
    fn reaps_only_unregistered_children() {
        let own = std::process::Command::new("true").spawn().unwrap();
        let own_pid = own.id();
        spawn_guard().register(own_pid);
        let other = std::process::Command::new("true").spawn().unwrap();
        let other_pid = other.id();
        std::mem::forget(other); // never waited by std: the reaper's job
        // Both exit at once; give them a moment to become zombies.
        let t = std::time::Instant::now();
        let zombie = |pid: u32| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                s.rsplit_once(')')
                    .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
            })
        };
        while !(zombie(own_pid) && zombie(other_pid)) && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(reap_orphans() >= 1);
        assert!(
            !std::path::Path::new(&format!("/proc/{other_pid}")).exists(),
            "orphan not reaped"
        );
        assert!(zombie(own_pid), "a registered child was reaped");
        let mut own = own;
        assert!(
            own.wait().unwrap().success(),
            "its owner still gets the status"
        );
        forget(own_pid);
    }
}
