//! Bounded writeback of the sandboxes' filesystem.
//!
//! Sandbox overlays are mounted `volatile` (runtime `rootfs.rs`): their unmount, which
//! comes with every sandbox's end, no longer syncs the filesystem all sandboxes share
//! (on btrfs, a transaction commit per sandbox, the largest single cost of a sandbox's
//! end), and a tenant's `fsync`/`syncfs` no longer reaches it either. Nothing then
//! commits that filesystem but its own timer (btrfs: every 30 s) and whatever forces a
//! commit (a template layer's snapshot): the dirty metadata of 30 s of sandboxes made
//! and removed piled up, and the commit that wrote it stalled every writer behind it for
//! seconds (a cluster test saw its nodes miss their lease renewals for 8 s).
//!
//! [`Writeback`] bounds that backlog: the runtime [`note`](Writeback::note)s every
//! sandbox made or ended, and a thread syncs the filesystem at most once per
//! [`INTERVAL`] when something was noted. One commit a second replaces one per sandbox
//! (70 a second in a closed create-and-kill loop).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How often, at most, the sandboxes' filesystem is synced.
pub const INTERVAL: Duration = Duration::from_secs(1);

/// A sync that took longer than this is logged (a sign of a large backlog or a slow disk).
const SLOW: Duration = Duration::from_millis(500);

/// The writeback of one filesystem; its thread ends when the last handle is dropped.
pub struct Writeback {
    root: PathBuf,
    dirty: AtomicBool,
}

impl Writeback {
    /// Starts the writeback of the filesystem holding `root`.
    pub fn start(root: PathBuf) -> std::io::Result<Arc<Writeback>> {
        let wb = Arc::new(Writeback {
            root,
            dirty: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&wb);
        std::thread::Builder::new()
            .name("cubicle-sync".into())
            .spawn(move || run(weak))?;
        Ok(wb)
    }

    /// Something changed on the filesystem (a sandbox made or ended): sync within
    /// [`INTERVAL`].
    pub fn note(&self) {
        self.dirty.store(true, Ordering::Relaxed);
    }

    /// Syncs now if something was noted; returns whether it synced.
    pub fn sync_if_noted(&self) -> bool {
        if !self.dirty.swap(false, Ordering::Relaxed) {
            return false;
        }
        let t = Instant::now();
        match cubicle_syscalls::fs::sync_filesystem(&self.root) {
            Ok(()) if t.elapsed() > SLOW => tracing::warn!(
                ms = t.elapsed().as_millis() as u64,
                "syncing {} took long",
                self.root.display()
            ),
            Ok(()) => tracing::debug!(us = t.elapsed().as_micros() as u64, "synced"),
            Err(e) => tracing::warn!("sync {}: {e}", self.root.display()),
        }
        true
    }
}

fn run(wb: Weak<Writeback>) {
    loop {
        std::thread::sleep(INTERVAL);
        let Some(wb) = wb.upgrade() else {
            return;
        };
        wb.sync_if_noted();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syncs_only_what_was_noted_and_stops_with_its_owner() {
        let dir = std::env::temp_dir().join(format!("cubicle-wb-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let wb = Writeback::start(dir.clone()).unwrap();
        assert!(!wb.sync_if_noted(), "nothing noted");
        wb.note();
        assert!(wb.sync_if_noted(), "noted once");
        assert!(!wb.sync_if_noted(), "synced already");
        // The thread syncs what is noted by itself within the interval.
        wb.note();
        std::thread::sleep(INTERVAL * 2 + Duration::from_millis(200));
        assert!(!wb.sync_if_noted(), "the thread synced it");
        assert_eq!(sync_threads(), 1);
        drop(wb);
        std::thread::sleep(INTERVAL + Duration::from_millis(500));
        assert_eq!(sync_threads(), 0, "the thread ends with its last handle");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// This process's writeback threads (no other unit test starts one).
    fn sync_threads() -> usize {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .flatten()
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .is_ok_and(|c| c.trim() == "cubicle-sync")
            })
            .count()
    }
}
