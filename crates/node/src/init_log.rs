//! Each sandbox's PID 1 output, drained by the node into the node's own log file,
//! bounded in rate and size.
//!
//! PID 1 (envd) writes its stdout and stderr into a FIFO, `<sandbox dir>/init.pipe`
//! (`cubicle_runtime::open_init_log`): the sandbox's root can take any descriptor of its
//! own processes, so none of them may be a host file. One thread of the node ([`InitLogs`])
//! reads every sandbox's FIFO and appends to `<sandbox dir>/init.log` (mode 0600), which
//! only the node ever opens; the API's log mirror reads it.
//!
//! Bounds, per sandbox:
//! - rate: on average [`RATE`] bytes per second, in bursts of up to [`BURST`]. Past that
//!   the node stops reading the FIFO for a while: the pipe fills and PID 1's writes fail
//!   with EAGAIN (the write end is non-blocking) — the sandbox that writes too much
//!   loses its own log lines, and the node spends nothing on them;
//! - size: [`MAX_FILE`] bytes of log file. Past it one marker line is written and the
//!   rest is read (still at the rate above) and dropped.
//!
//! Who mirrors the logs (the API's upkeep, once a second) asks which of them grew since
//! it last asked ([`InitLogs::grown_since`]): at 10,000 idle sandboxes, looking at every
//! log each second was 10,000 `stat`s a second on a node, and 10,000 HTTP calls a
//! second from a replica to its nodes.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// File name of the FIFO in the sandbox directory.
pub const INIT_PIPE: &str = "init.pipe";
/// File name of the node's log file of PID 1's output in the sandbox directory.
pub const INIT_LOG: &str = "init.log";
/// Sustained bytes per second read from one sandbox.
pub const RATE: u64 = 256 << 10;
/// Bytes one sandbox may write at once before [`RATE`] applies.
pub const BURST: u64 = 4 << 20;
/// Largest log file per sandbox.
pub const MAX_FILE: u64 = 16 << 20;

/// The bounds of one sandbox's log (defaults: [`RATE`], [`BURST`], [`MAX_FILE`]).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub rate: u64,
    pub burst: u64,
    pub max_file: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            rate: RATE,
            burst: BURST,
            max_file: MAX_FILE,
        }
    }
}

/// The epoll token of the wake-up eventfd.
const WAKE: u64 = u64::MAX;
/// Read size, and the budget a throttled source needs before it is read again.
const CHUNK: usize = 64 << 10;

/// How far a reader of the logs got: [`InitLogs::grown_since`] answers with the logs
/// that grew after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LogMark {
    /// The drainer (a new one per node process).
    pub epoch: u64,
    /// How many appends it had made.
    pub generation: u64,
}

/// What [`InitLogs::grown_since`] answers.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GrownLogs {
    /// What to ask next time.
    pub mark: LogMark,
    /// The sandboxes whose log grew after the mark asked for. `None` when that mark is
    /// not this drainer's (none given, or another node process's): any log may have.
    pub ids: Option<Vec<String>>,
}

/// The node's drainer of every sandbox's init log FIFO.
pub struct InitLogs {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

struct Shared {
    limits: Limits,
    epoll: OwnedFd,
    wake: OwnedFd,
    stop: AtomicBool,
    sources: Mutex<Sources>,
    /// This drainer's [`LogMark::epoch`].
    epoch: u64,
}

#[derive(Default)]
struct Sources {
    by_token: HashMap<u64, Source>,
    by_id: HashMap<String, u64>,
    next: u64,
    /// Drains that appended to a log file, ever ([`LogMark::generation`]).
    generation: u64,
}

/// One sandbox's FIFO and log file.
struct Source {
    limits: Limits,
    fifo: OwnedFd,
    out: PathBuf,
    file: Option<File>,
    /// Bytes in the log file.
    written: u64,
    /// Bytes that may be read now (token bucket).
    budget: f64,
    refilled: Instant,
    /// Not read until the budget allows (removed from the epoll interest set).
    paused: bool,
    /// The size limit was reached (the marker line is written).
    full: bool,
    /// The [`Sources::generation`] of its last append.
    grew_at: u64,
}

impl InitLogs {
    /// Starts the drainer thread with the default [`Limits`].
    pub fn start() -> io::Result<InitLogs> {
        Self::start_with(Limits::default())
    }

    /// Starts the drainer thread.
    pub fn start_with(limits: Limits) -> io::Result<InitLogs> {
        // SAFETY: plain syscalls returning fresh descriptors (checked below).
        let (ep, ev) = unsafe {
            (
                libc::epoll_create1(libc::EPOLL_CLOEXEC),
                libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK),
            )
        };
        if ep < 0 || ev < 0 {
            let e = io::Error::last_os_error();
            // SAFETY: closing whichever of our descriptors was opened.
            unsafe {
                if ep >= 0 {
                    libc::close(ep);
                }
                if ev >= 0 {
                    libc::close(ev);
                }
            }
            return Err(e);
        }
        // SAFETY: fresh descriptors we own.
        let (epoll, wake) = unsafe { (OwnedFd::from_raw_fd(ep), OwnedFd::from_raw_fd(ev)) };
        epoll_ctl(
            &epoll,
            libc::EPOLL_CTL_ADD,
            wake.as_raw_fd(),
            libc::EPOLLIN as u32,
            WAKE,
        )?;
        let shared = Arc::new(Shared {
            limits,
            epoll,
            wake,
            stop: AtomicBool::new(false),
            sources: Mutex::new(Sources::default()),
            epoch: rand::random::<u64>() | 1,
        });
        let s2 = shared.clone();
        let thread = std::thread::Builder::new()
            .name("init-logs".into())
            .spawn(move || s2.run())?;
        Ok(InitLogs {
            shared,
            thread: Some(thread),
        })
    }

    /// Drains `fifo` (a read end of sandbox `id`'s init log FIFO) into `out` from now on,
    /// instead of any FIFO registered for `id` before.
    pub fn add(&self, id: &str, fifo: OwnedFd, out: PathBuf) {
        let written = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
        let mut s = self.shared.lock();
        if let Some(old) = s.by_id.remove(id) {
            self.shared.forget(&mut s, old);
        }
        let token = s.next;
        s.next += 1;
        if let Err(e) = epoll_ctl(
            &self.shared.epoll,
            libc::EPOLL_CTL_ADD,
            fifo.as_raw_fd(),
            libc::EPOLLIN as u32,
            token,
        ) {
            tracing::warn!(sandbox = %id, "cannot watch the init log: {e}");
            return;
        }
        s.by_id.insert(id.to_string(), token);
        let limits = self.shared.limits;
        s.by_token.insert(
            token,
            Source {
                limits,
                fifo,
                out,
                file: None,
                written,
                budget: limits.burst as f64,
                refilled: Instant::now(),
                paused: false,
                full: written >= limits.max_file,
                grew_at: 0,
            },
        );
    }

    /// Stops draining `id` after reading what its FIFO holds now (within its budget).
    pub fn remove(&self, id: &str) {
        let mut s = self.shared.lock();
        if let Some(token) = s.by_id.remove(id) {
            if let Some(src) = s.by_token.get_mut(&token) {
                let before = src.written;
                src.refill();
                src.drain();
                s.note_growth(token, before);
            }
            self.shared.forget(&mut s, token);
        }
    }

    /// The sandboxes whose log grew after `since`, and the mark to ask next time.
    pub fn grown_since(&self, since: Option<LogMark>) -> GrownLogs {
        let s = self.shared.lock();
        let mark = LogMark {
            epoch: self.shared.epoch,
            generation: s.generation,
        };
        let ids = since
            .filter(|m| m.epoch == mark.epoch && m.generation <= mark.generation)
            .map(|m| {
                s.by_id
                    .iter()
                    .filter(|(_, t)| {
                        s.by_token
                            .get(t)
                            .is_some_and(|src| src.grew_at > m.generation)
                    })
                    .map(|(id, _)| id.clone())
                    .collect()
            });
        GrownLogs { mark, ids }
    }

    /// Ids being drained (for tests).
    pub fn ids(&self) -> Vec<String> {
        self.shared.lock().by_id.keys().cloned().collect()
    }
}

impl Drop for InitLogs {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Sources> {
        self.sources.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Drops source `token` (its FIFO leaves the epoll set when closed).
    fn forget(&self, s: &mut Sources, token: u64) {
        if let Some(src) = s.by_token.remove(&token) {
            let _ = epoll_ctl(&self.epoll, libc::EPOLL_CTL_DEL, src.fifo.as_raw_fd(), 0, 0);
        }
        s.by_id.retain(|_, t| *t != token);
    }

    fn run(&self) {
        // SAFETY: zeroed epoll_event values are valid.
        let mut events: [libc::epoll_event; 64] = unsafe { std::mem::zeroed() };
        while !self.stop.load(Ordering::SeqCst) {
            let paused = self.lock().by_token.values().any(|s| s.paused);
            let timeout = if paused { 100 } else { -1 };
            // SAFETY: valid epoll descriptor and event buffer.
            let n = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    events.as_mut_ptr(),
                    events.len() as i32,
                    timeout,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!("init log drainer stopped: {e}");
                    return;
                }
                continue;
            }
            let mut s = self.lock();
            for ev in &events[..n as usize] {
                let token = ev.u64;
                if token == WAKE {
                    let mut v = 0u64;
                    // SAFETY: reading 8 bytes from our non-blocking eventfd.
                    unsafe { libc::read(self.wake.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
                    continue;
                }
                let Some(src) = s.by_token.get_mut(&token) else {
                    continue;
                };
                let before = src.written;
                src.refill();
                let drained = src.drain();
                s.note_growth(token, before);
                match drained {
                    Drained::Eof => self.forget(&mut s, token),
                    Drained::Throttled => {
                        let Some(src) = s.by_token.get_mut(&token) else {
                            continue;
                        };
                        src.paused = true;
                        let _ = epoll_ctl(
                            &self.epoll,
                            libc::EPOLL_CTL_MOD,
                            src.fifo.as_raw_fd(),
                            0,
                            token,
                        );
                    }
                    Drained::Empty => {}
                }
            }
            let fd_tokens: Vec<(u64, i32)> = s
                .by_token
                .iter_mut()
                .filter(|(_, src)| src.paused)
                .filter_map(|(t, src)| {
                    src.refill();
                    (src.budget >= CHUNK as f64).then(|| {
                        src.paused = false;
                        (*t, src.fifo.as_raw_fd())
                    })
                })
                .collect();
            for (token, fd) in fd_tokens {
                let _ = epoll_ctl(
                    &self.epoll,
                    libc::EPOLL_CTL_MOD,
                    fd,
                    libc::EPOLLIN as u32,
                    token,
                );
            }
        }
    }
}

impl Sources {
    /// Counts an append if source `token`'s log grew past `before` bytes in the drain
    /// just made.
    fn note_growth(&mut self, token: u64, before: u64) {
        let Some(src) = self.by_token.get_mut(&token) else {
            return;
        };
        if src.written != before {
            self.generation += 1;
            src.grew_at = self.generation;
        }
    }
}

/// How a drain pass ended.
enum Drained {
    /// Nothing more to read now.
    Empty,
    /// The budget is spent: stop reading for a while.
    Throttled,
    /// Every writer is gone (the sandbox ended), or the FIFO failed.
    Eof,
}

impl Source {
    fn refill(&mut self) {
        let now = Instant::now();
        let dt = now.duration_since(self.refilled).as_secs_f64();
        self.budget = (self.budget + dt * self.limits.rate as f64).min(self.limits.burst as f64);
        self.refilled = now;
    }

    /// Reads what the FIFO holds (within the budget) into the log file, which is open
    /// only meanwhile: PID 1 writes little after its start, and a node holding 10,000
    /// sandboxes would otherwise keep 10,000 log files open.
    fn drain(&mut self) -> Drained {
        let drained = self.drain_open();
        self.file = None;
        drained
    }

    fn drain_open(&mut self) -> Drained {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let want = (self.budget as usize).min(CHUNK);
            if want == 0 {
                return Drained::Throttled;
            }
            // SAFETY: valid descriptor and buffer of at least `want` bytes.
            let n = unsafe { libc::read(self.fifo.as_raw_fd(), buf.as_mut_ptr().cast(), want) };
            if n == 0 {
                return Drained::Eof;
            }
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.kind() {
                    io::ErrorKind::WouldBlock => Drained::Empty,
                    io::ErrorKind::Interrupted => continue,
                    _ => Drained::Eof,
                };
            }
            self.budget -= n as f64;
            self.append(&buf[..n as usize]);
        }
    }

    /// Appends to the log file up to its size limit; drops the rest after a marker line.
    fn append(&mut self, data: &[u8]) {
        if self.full {
            return;
        }
        if self.file.is_none() {
            match OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&self.out)
            {
                Ok(f) => self.file = Some(f),
                Err(e) => {
                    tracing::debug!(path = %self.out.display(), "init log: {e}");
                    // Out of descriptors for now: this chunk is lost, later ones may
                    // not be. Anything else (the directory is gone) is for good.
                    if !matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) {
                        self.full = true;
                    }
                    return;
                }
            }
        }
        let Some(f) = self.file.as_mut() else {
            return;
        };
        let room = self.limits.max_file.saturating_sub(self.written) as usize;
        let take = data.len().min(room);
        let mut ok = f.write_all(&data[..take]).is_ok();
        self.written += take as u64;
        if take < data.len() {
            let marker = format!(
                "\n[cubicle: this sandbox's log reached {} KiB; later output is dropped]\n",
                self.limits.max_file >> 10
            );
            ok &= f.write_all(marker.as_bytes()).is_ok();
            self.written += marker.len() as u64;
            self.full = true;
        }
        if !ok {
            // A full quota, most likely: stop trying; the sandbox's output is dropped.
            self.full = true;
        }
    }
}

fn epoll_ctl(epoll: &OwnedFd, op: i32, fd: i32, events: u32, token: u64) -> io::Result<()> {
    let mut ev = libc::epoll_event { events, u64: token };
    // SAFETY: valid epoll descriptor, target descriptor and event.
    if unsafe { libc::epoll_ctl(epoll.as_raw_fd(), op, fd, &mut ev) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn fifo(dir: &std::path::Path) -> (OwnedFd, File) {
        let p = dir.join(INIT_PIPE);
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let r = cubicle_runtime::open_init_log(&p).unwrap();
        let w = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&p)
            .unwrap();
        (r, w)
    }

    fn wait_for(what: &str, f: impl Fn() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(t.elapsed() < Duration::from_secs(10), "timed out: {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn drains_into_the_log_file_and_forgets_ended_sandboxes() {
        let dir = std::env::temp_dir().join(format!("cubicle-initlogs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let logs = InitLogs::start().unwrap();
        let (r, mut w) = fifo(&dir);
        let out = dir.join(INIT_LOG);
        logs.add("a", r, out.clone());
        w.write_all(b"hello\n").unwrap();
        wait_for("the line", || {
            std::fs::read_to_string(&out).is_ok_and(|s| s == "hello\n")
        });
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&out).unwrap().permissions().mode() & 0o777,
            0o600
        );
        drop(w); // the sandbox ended
        wait_for("forgotten", || logs.ids().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tells_which_logs_grew_since_a_mark() {
        let base =
            std::env::temp_dir().join(format!("cubicle-initlogs-grown-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let logs = InitLogs::start().unwrap();
        let mut writers = Vec::new();
        for id in ["a", "b"] {
            let dir = base.join(id);
            std::fs::create_dir_all(&dir).unwrap();
            let (r, w) = fifo(&dir);
            logs.add(id, r, dir.join(INIT_LOG));
            writers.push(w);
        }
        let size =
            |id: &str| std::fs::metadata(base.join(id).join(INIT_LOG)).map_or(0, |m| m.len());
        // Without a mark of this drainer: any log may have grown.
        let first = logs.grown_since(None);
        assert_eq!(first.ids, None);
        // Nothing written since: nothing grew.
        assert_eq!(logs.grown_since(Some(first.mark)).ids, Some(vec![]));
        writers[1].write_all(b"from b\n").unwrap();
        wait_for("b's line", || size("b") == 7);
        let g = logs.grown_since(Some(first.mark));
        assert_eq!(g.ids, Some(vec!["b".to_string()]));
        assert!(g.mark.generation > first.mark.generation);
        // Asked again from the new mark: nothing; from the old one: still b.
        assert_eq!(logs.grown_since(Some(g.mark)).ids, Some(vec![]));
        writers[0].write_all(b"from a\n").unwrap();
        wait_for("a's line", || size("a") == 7);
        assert_eq!(
            logs.grown_since(Some(g.mark)).ids,
            Some(vec!["a".to_string()])
        );
        let mut both = logs.grown_since(Some(first.mark)).ids.unwrap();
        both.sort();
        assert_eq!(both, ["a", "b"]);
        // A mark of another drainer (a node process before a restart), or from its
        // future: any log may have grown.
        let other = LogMark {
            epoch: first.mark.epoch ^ 2,
            generation: 0,
        };
        assert_eq!(logs.grown_since(Some(other)).ids, None);
        let ahead = LogMark {
            generation: g.mark.generation + 100,
            ..g.mark
        };
        assert_eq!(logs.grown_since(Some(ahead)).ids, None);
        drop(writers);
        wait_for("forgotten", || logs.ids().is_empty());
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn a_flood_is_throttled_and_the_file_capped() {
        let dir =
            std::env::temp_dir().join(format!("cubicle-initlogs-flood-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let limits = Limits {
            rate: 64 << 10,
            burst: 256 << 10,
            max_file: 200 << 10,
        };
        let logs = InitLogs::start_with(limits).unwrap();
        let (r, mut w) = fifo(&dir);
        let out = dir.join(INIT_LOG);
        logs.add("a", r, out.clone());
        // Write as fast as the pipe takes it for 2 s.
        let chunk = vec![b'x'; 4096];
        let (mut accepted, mut refused) = (0u64, 0u64);
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(2) {
            match w.write(&chunk) {
                Ok(n) => accepted += n as u64,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    refused += 1;
                    std::thread::sleep(Duration::from_micros(200));
                }
                Err(e) => panic!("{e}"),
            }
        }
        let secs = t.elapsed().as_secs_f64();
        // Burst + rate, plus what the pipe buffer (64 KiB) and one read in flight hold.
        let allowed = (limits.burst + limits.rate * 3 + (128 << 10)) as f64;
        assert!(
            (accepted as f64) <= allowed,
            "{accepted} bytes accepted in {secs:.1}s, more than {allowed}"
        );
        assert!(refused > 0, "the writer was never refused");
        drop(w);
        logs.remove("a");
        let log = std::fs::read(&out).unwrap();
        assert!(
            log.len() as u64 <= limits.max_file + 200,
            "log file of {} bytes",
            log.len()
        );
        assert!(
            String::from_utf8_lossy(&log).contains("later output is dropped"),
            "no marker line"
        );
        println!("flood: {accepted} bytes accepted in {secs:.1}s, {refused} writes refused");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
