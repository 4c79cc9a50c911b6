//! The process table: one entry per started process, its output fan-out to attached
//! streams, its input ends, and the supervisor task that reads its output, reaps it,
//! enforces its lifetime and publishes its `end` event.
//!
//! Output flows from the supervisor to each attached stream through a bounded channel.
//! The supervisor always reads (so a process never blocks on a full pipe when nobody is
//! attached); an attached but slow client applies back-pressure; a detached client's
//! channel is dropped on the next send. A finished process keeps its entry (without any
//! descriptor) for [`RETENTION`] so `Connect` can still answer its `end`.

use std::{
    collections::HashMap,
    io,
    os::unix::process::ExitStatusExt,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use cubicle_proto::process::{
    ProcessConfig, ProcessInfo,
    process_event::{DataEvent, EndEvent, Event, data_event::Output},
};
use tokio::{
    io::AsyncReadExt,
    net::unix::pipe,
    sync::mpsc,
    time::{Instant, sleep, sleep_until},
};

use super::pty::PtyMaster;
use super::spawn::Child;

/// How long a finished process stays answerable by `Connect` (up to [`PURGE_EVERY`]
/// longer).
pub const RETENTION: Duration = Duration::from_secs(30);
/// How often the table looks for finished processes past [`RETENTION`]. Looking at every
/// request scanned every command of the last 30 s (locking each): a sandbox running
/// commands back to back spent half of envd's own CPU time in that scan.
const PURGE_EVERY: Duration = Duration::from_secs(1);
/// Read chunk for pipes (as upstream envd).
pub const PIPE_CHUNK: usize = 32 << 10;
/// Read chunk for PTYs (as upstream envd).
pub const PTY_CHUNK: usize = 16 << 10;
/// Messages buffered per attached stream.
pub const SUBSCRIBER_BUFFER: usize = 64;
/// After the process exits, output is drained until EOF, but a descendant that keeps the
/// pipe open does not hold the `end` back longer than this idle gap…
pub const DRAIN_IDLE: Duration = Duration::from_millis(100);
/// …or this long in total.
pub const DRAIN_MAX: Duration = Duration::from_secs(3);

/// A sender of events to one attached stream.
pub type Subscriber = mpsc::Sender<Event>;

/// Kind of process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Pipes,
    Pty,
}

struct Live {
    subscribers: Vec<Subscriber>,
    end: Option<EndEvent>,
    finished_at: Option<Instant>,
}

/// One started process.
pub struct Proc {
    pub pid: u32,
    pub config: ProcessConfig,
    pub tag: Option<String>,
    pub kind: Kind,
    /// Set once the child has been reaped (its pid may then be reused).
    reaped: AtomicBool,
    stdin: tokio::sync::Mutex<StdinState>,
    pty: Mutex<Option<Arc<PtyMaster>>>,
    live: Mutex<Live>,
}

/// The stdin end of a pipe process.
pub enum StdinState {
    Open(pipe::Sender),
    /// `stdin: false`: the child's stdin is /dev/null.
    Disabled,
    Closed,
}

/// Why input could not be delivered.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("process has no stdin (it was started with stdin disabled)")]
    Disabled,
    #[error("stdin of the process is closed")]
    Closed,
    #[error("process is a PTY; send input as pty bytes")]
    IsPty,
    #[error("process is not a PTY; send input as stdin bytes")]
    NotPty,
    #[error("writing input: {0}")]
    Io(#[from] io::Error),
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Proc {
    pub fn new(
        pid: u32,
        config: ProcessConfig,
        tag: Option<String>,
        stdin: StdinState,
        pty: Option<Arc<PtyMaster>>,
        first: Option<Subscriber>,
    ) -> Self {
        Self {
            pid,
            config,
            tag,
            kind: if pty.is_some() {
                Kind::Pty
            } else {
                Kind::Pipes
            },
            reaped: AtomicBool::new(false),
            stdin: tokio::sync::Mutex::new(stdin),
            pty: Mutex::new(pty),
            live: Mutex::new(Live {
                subscribers: first.into_iter().collect(),
                end: None,
                finished_at: None,
            }),
        }
    }

    /// The `ProcessInfo` of `List`.
    pub fn info(&self) -> ProcessInfo {
        ProcessInfo {
            config: Some(self.config.clone()),
            pid: self.pid,
            tag: self.tag.clone(),
        }
    }

    /// Whether the process is still running (its `end` not yet published).
    pub fn running(&self) -> bool {
        lock(&self.live).end.is_none()
    }

    /// When the `end` was published.
    pub fn finished_at(&self) -> Option<Instant> {
        lock(&self.live).finished_at
    }

    /// Attaches a stream: `Ok(())` if it will receive live output and the `end`, or
    /// `Err(end)` when the process already finished.
    pub fn subscribe(&self, tx: Subscriber) -> Result<(), EndEvent> {
        let mut live = lock(&self.live);
        match &live.end {
            Some(end) => Err(end.clone()),
            None => {
                live.subscribers.push(tx);
                Ok(())
            }
        }
    }

    /// Sends an event to every attached stream, dropping detached ones.
    async fn publish(&self, event: Event) {
        let subs = lock(&self.live).subscribers.clone();
        let mut gone = Vec::new();
        for s in subs {
            if s.send(event.clone()).await.is_err() {
                gone.push(s);
            }
        }
        if !gone.is_empty() {
            lock(&self.live)
                .subscribers
                .retain(|s| !gone.iter().any(|g| g.same_channel(s)));
        }
    }

    /// Records and publishes the `end`; detaches every stream.
    async fn finish(&self, end: EndEvent) {
        let subs = {
            let mut live = lock(&self.live);
            live.end = Some(end.clone());
            live.finished_at = Some(Instant::now());
            std::mem::take(&mut live.subscribers)
        };
        for s in subs {
            let _ = s.send(Event::End(end.clone())).await;
        }
    }

    /// Writes stdin bytes (pipe processes).
    pub async fn write_stdin(&self, data: &[u8]) -> Result<(), InputError> {
        if self.kind == Kind::Pty {
            return Err(InputError::IsPty);
        }
        let mut st = self.stdin.lock().await;
        match &mut *st {
            StdinState::Open(pipe) => {
                use tokio::io::AsyncWriteExt;
                pipe.write_all(data).await?;
                pipe.flush().await?;
                Ok(())
            }
            StdinState::Disabled => Err(InputError::Disabled),
            StdinState::Closed => Err(InputError::Closed),
        }
    }

    /// Writes terminal input (PTY processes).
    pub async fn write_pty(&self, data: &[u8]) -> Result<(), InputError> {
        if self.kind != Kind::Pty {
            return Err(InputError::NotPty);
        }
        let master = lock(&self.pty).clone().ok_or(InputError::Closed)?;
        master.write_all(data).await?;
        Ok(())
    }

    /// Closes stdin (EOF for the process).
    pub async fn close_stdin(&self) -> Result<(), InputError> {
        if self.kind == Kind::Pty {
            return Err(InputError::IsPty);
        }
        let mut st = self.stdin.lock().await;
        match &*st {
            StdinState::Disabled => Err(InputError::Disabled),
            // Closing twice is harmless.
            _ => {
                *st = StdinState::Closed;
                Ok(())
            }
        }
    }

    /// Resizes the PTY.
    pub fn resize(&self, cols: u16, rows: u16) -> Result<(), InputError> {
        if self.kind != Kind::Pty {
            return Err(InputError::NotPty);
        }
        let master = lock(&self.pty).clone().ok_or(InputError::Closed)?;
        master.resize(cols, rows)?;
        Ok(())
    }

    /// Sends `sig` to the process's group and session (the process is its own session
    /// leader, so `bash -c` children and interactive-shell jobs get it too). Does
    /// nothing once the process has been reaped: its pid may belong to someone else.
    pub fn signal(&self, sig: libc::c_int) -> io::Result<()> {
        if self.reaped.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        signal_session(self.pid, sig)
    }
}

/// Sends `sig` to process group `pid` and to every process of session `pid`.
pub fn signal_session(pid: u32, sig: libc::c_int) -> io::Result<()> {
    let Ok(pgid) = libc::pid_t::try_from(pid) else {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    };
    // SAFETY: plain system calls.
    let group = unsafe { libc::killpg(pgid, sig) };
    let group_err = io::Error::last_os_error();
    // Members that moved to other process groups of the same session (job control).
    let mut others = 0;
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let Some(p) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<libc::pid_t>().ok())
            else {
                continue;
            };
            if p == pgid {
                continue;
            }
            if session_of(p) == Some(pgid) {
                // SAFETY: plain system call.
                if unsafe { libc::kill(p, sig) } == 0 {
                    others += 1;
                }
            }
        }
    }
    if group == 0 || others > 0 {
        return Ok(());
    }
    // The group may be gone while the leader is a zombie not yet reaped.
    // SAFETY: plain system call.
    if unsafe { libc::kill(pgid, sig) } == 0 {
        Ok(())
    } else {
        Err(group_err)
    }
}

/// The session id of a process, from `/proc/<pid>/stat`.
fn session_of(pid: libc::pid_t) -> Option<libc::pid_t> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    // state ppid pgrp session
    rest.split_whitespace().nth(3)?.parse().ok()
}

/// Go's `syscall.Signal.String()` on Linux, used in `status`/`error` of the `end`.
pub fn signal_name(sig: i32) -> String {
    let name = match sig {
        1 => "hangup",
        2 => "interrupt",
        3 => "quit",
        4 => "illegal instruction",
        5 => "trace/breakpoint trap",
        6 => "aborted",
        7 => "bus error",
        8 => "floating point exception",
        9 => "killed",
        10 => "user defined signal 1",
        11 => "segmentation fault",
        12 => "user defined signal 2",
        13 => "broken pipe",
        14 => "alarm clock",
        15 => "terminated",
        16 => "stack fault",
        17 => "child exited",
        18 => "continued",
        19 => "stopped (signal)",
        20 => "stopped",
        21 => "stopped (tty input)",
        22 => "stopped (tty output)",
        23 => "urgent I/O condition",
        24 => "CPU time limit exceeded",
        25 => "file size limit exceeded",
        26 => "virtual timer expired",
        27 => "profiling timer expired",
        28 => "window changed",
        29 => "I/O possible",
        30 => "power failure",
        31 => "bad system call",
        n => return format!("signal {n}"),
    };
    name.to_string()
}

/// The `end` event for a wait result, following Go's `ProcessState` conventions.
pub fn end_event(status: &io::Result<std::process::ExitStatus>) -> EndEvent {
    match status {
        Ok(st) => {
            if let Some(code) = st.code() {
                let text = format!("exit status {code}");
                EndEvent {
                    exit_code: code,
                    exited: true,
                    status: text.clone(),
                    error: (code != 0).then_some(text),
                }
            } else if let Some(sig) = st.signal() {
                let mut text = format!("signal: {}", signal_name(sig));
                if st.core_dumped() {
                    text.push_str(" (core dumped)");
                }
                EndEvent {
                    exit_code: -1,
                    exited: false,
                    status: text.clone(),
                    error: Some(text),
                }
            } else {
                let text = format!("{st}");
                EndEvent {
                    exit_code: -1,
                    exited: false,
                    status: text.clone(),
                    error: Some(text),
                }
            }
        }
        Err(e) => EndEvent {
            exit_code: -1,
            exited: false,
            status: "unknown".into(),
            error: Some(format!("waiting for the process: {e}")),
        },
    }
}

/// The output ends the supervisor reads.
pub enum Sources {
    Pipes {
        stdout: pipe::Receiver,
        stderr: pipe::Receiver,
    },
    Pty(Arc<PtyMaster>),
}

/// Runs one process to completion: reads its output, kills it at `kill_at`, reaps it,
/// drains what is left, publishes the `end`, and releases every descriptor.
pub async fn supervise(
    proc: Arc<Proc>,
    mut child: Child,
    output: Sources,
    kill_at: Option<Instant>,
) {
    let (mut stdout, mut stderr, pty) = match output {
        Sources::Pipes { stdout, stderr } => (Some(stdout), Some(stderr), None),
        Sources::Pty(m) => (None, None, Some(m)),
    };
    let mut buf_out = vec![0u8; if stdout.is_some() { PIPE_CHUNK } else { 0 }];
    let mut buf_err = vec![0u8; if stderr.is_some() { PIPE_CHUNK } else { 0 }];
    let mut buf_pty = vec![0u8; if pty.is_some() { PTY_CHUNK } else { 0 }];
    let mut pty_open = pty.is_some();
    let mut status: Option<io::Result<std::process::ExitStatus>> = None;
    let mut exited_at: Option<Instant> = None;
    let mut killed = false;

    loop {
        let outputs_open = stdout.is_some() || stderr.is_some() || pty_open;
        if status.is_some() && !outputs_open {
            break;
        }
        let drain_deadline = exited_at.map(|t| t + DRAIN_MAX);
        tokio::select! {
            biased;
            _ = async { sleep_until(kill_at.unwrap_or_else(Instant::now)).await }, if kill_at.is_some() && !killed && status.is_none() => {
                killed = true;
                let _ = proc.signal(libc::SIGKILL);
            }
            st = child.wait(), if status.is_none() => {
                proc.reaped.store(true, Ordering::SeqCst);
                crate::init::forget(proc.pid);
                status = Some(st);
                exited_at = Some(Instant::now());
            }
            r = read_opt(stdout.as_mut(), &mut buf_out), if stdout.is_some() => match r {
                Ok(n) if n > 0 => proc.publish(data(Output::Stdout(buf_out[..n].to_vec()))).await,
                _ => stdout = None,
            },
            r = read_opt(stderr.as_mut(), &mut buf_err), if stderr.is_some() => match r {
                Ok(n) if n > 0 => proc.publish(data(Output::Stderr(buf_err[..n].to_vec()))).await,
                _ => stderr = None,
            },
            r = read_pty(pty.as_deref(), &mut buf_pty), if pty_open => match r {
                Ok(n) if n > 0 => proc.publish(data(Output::Pty(buf_pty[..n].to_vec()))).await,
                _ => pty_open = false,
            },
            _ = sleep(DRAIN_IDLE), if status.is_some() => break,
            _ = async { sleep_until(drain_deadline.unwrap_or_else(Instant::now)).await }, if drain_deadline.is_some() => break,
        }
    }
    drop(stdout);
    drop(stderr);
    drop(pty);
    // Release the input ends before announcing the end.
    *lock(&proc.pty) = None;
    {
        let p = proc.clone();
        // A writer blocked on a full pipe holds the lock; it fails with EPIPE soon
        // (the reader is gone), and then stdin is released.
        tokio::spawn(async move {
            let mut st = p.stdin.lock().await;
            if matches!(*st, StdinState::Open(_)) {
                *st = StdinState::Closed;
            }
        });
    }
    let status = status.unwrap_or_else(|| Err(io::Error::other("process was not reaped")));
    proc.finish(end_event(&status)).await;
}

fn data(output: Output) -> Event {
    Event::Data(DataEvent {
        output: Some(output),
    })
}

async fn read_opt<R: tokio::io::AsyncRead + Unpin>(
    r: Option<&mut R>,
    buf: &mut [u8],
) -> io::Result<usize> {
    match r {
        Some(r) => r.read(buf).await,
        None => std::future::pending().await,
    }
}

async fn read_pty(m: Option<&PtyMaster>, buf: &mut [u8]) -> io::Result<usize> {
    match m {
        Some(m) => m.read(buf).await,
        None => std::future::pending().await,
    }
}

/// All processes, by pid.
#[derive(Default)]
pub struct Table {
    procs: Mutex<Procs>,
}

#[derive(Default)]
struct Procs {
    map: HashMap<u32, Arc<Proc>>,
    /// When finished entries past [`RETENTION`] were last dropped.
    purged_at: Option<Instant>,
}

impl Procs {
    /// The entries, without those finished more than [`RETENTION`] ago (looked for at
    /// most every [`PURGE_EVERY`]).
    fn current(&mut self) -> &mut HashMap<u32, Arc<Proc>> {
        let now = Instant::now();
        if self
            .purged_at
            .is_none_or(|t| now.duration_since(t) >= PURGE_EVERY)
        {
            self.purged_at = Some(now);
            self.map.retain(|_, p| {
                p.finished_at()
                    .is_none_or(|t| now.duration_since(t) < RETENTION)
            });
        }
        &mut self.map
    }
}

impl Table {
    /// Adds a process (replacing a retained entry with the same pid).
    pub fn insert(&self, proc: Arc<Proc>) {
        lock(&self.procs).current().insert(proc.pid, proc);
    }

    /// A process by pid, running or retained.
    pub fn get(&self, pid: u32) -> Option<Arc<Proc>> {
        lock(&self.procs).current().get(&pid).cloned()
    }

    /// A running process by tag (the lowest pid when several match).
    pub fn by_tag(&self, tag: &str) -> Option<Arc<Proc>> {
        lock(&self.procs)
            .current()
            .values()
            .filter(|p| p.tag.as_deref() == Some(tag))
            .min_by_key(|p| (!p.running(), p.pid))
            .cloned()
    }

    /// Running processes, ordered by pid.
    pub fn running(&self) -> Vec<Arc<Proc>> {
        let mut m = lock(&self.procs);
        let mut v: Vec<_> = m
            .current()
            .values()
            .filter(|p| p.running())
            .cloned()
            .collect();
        v.sort_by_key(|p| p.pid);
        v
    }

    /// Number of entries (running and retained).
    pub fn len(&self) -> usize {
        lock(&self.procs).map.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;
    use std::process::ExitStatus;

    #[test]
    fn end_conventions() {
        let ok = end_event(&Ok(ExitStatus::from_raw(0)));
        assert_eq!(
            (ok.exit_code, ok.exited, ok.status.as_str(), ok.error),
            (0, true, "exit status 0", None)
        );
        let three = end_event(&Ok(ExitStatus::from_raw(3 << 8)));
        assert_eq!(three.exit_code, 3);
        assert_eq!(three.error.as_deref(), Some("exit status 3"));
        let killed = end_event(&Ok(ExitStatus::from_raw(9)));
        assert_eq!((killed.exit_code, killed.exited), (-1, false));
        assert_eq!(killed.status, "signal: killed");
        assert_eq!(killed.error.as_deref(), Some("signal: killed"));
        let term = end_event(&Ok(ExitStatus::from_raw(15)));
        assert_eq!(term.status, "signal: terminated");
        let core = end_event(&Ok(ExitStatus::from_raw(11 | 0x80)));
        assert_eq!(core.status, "signal: segmentation fault (core dumped)");
        assert_eq!(signal_name(2), "interrupt");
        assert_eq!(signal_name(40), "signal 40");
    }

    #[test]
    fn session_of_self() {
        // SAFETY: getsid(0) cannot fail for the calling process.
        let sid = unsafe { libc::getsid(0) };
        assert_eq!(session_of(std::process::id() as i32), Some(sid));
    }

    #[tokio::test]
    async fn subscribe_after_finish_gets_end() {
        let p = Proc::new(
            1,
            ProcessConfig::default(),
            None,
            StdinState::Disabled,
            None,
            None,
        );
        assert!(p.running());
        let (tx, mut rx) = mpsc::channel(4);
        p.subscribe(tx).unwrap();
        p.publish(data(Output::Stdout(b"x".to_vec()))).await;
        p.finish(end_event(&Ok(std::process::ExitStatus::from_raw(0))))
            .await;
        assert!(matches!(rx.recv().await, Some(Event::Data(_))));
        assert!(matches!(rx.recv().await, Some(Event::End(_))));
        assert!(rx.recv().await.is_none());
        let (tx2, _rx2) = mpsc::channel(4);
        let end = p.subscribe(tx2).unwrap_err();
        assert!(end.exited);
        assert!(!p.running());
    }

    /// Finished processes stay answerable for RETENTION (up to PURGE_EVERY more), and
    /// the table looks for expired ones at most every PURGE_EVERY.
    #[tokio::test(start_paused = true)]
    async fn finished_processes_are_retained_then_dropped() {
        let finished = |pid| async move {
            let p = Arc::new(Proc::new(
                pid,
                ProcessConfig::default(),
                None,
                StdinState::Disabled,
                None,
                None,
            ));
            p.finish(end_event(&Ok(std::process::ExitStatus::from_raw(0))))
                .await;
            p
        };
        let t = Table::default();
        t.insert(finished(1).await);
        tokio::time::advance(RETENTION - Duration::from_millis(1)).await;
        assert!(t.get(1).is_some(), "dropped before its retention");
        tokio::time::advance(Duration::from_millis(2)).await;
        // Past its retention, but the last look was under PURGE_EVERY ago.
        t.insert(finished(2).await);
        assert_eq!(t.len(), 2);
        tokio::time::advance(PURGE_EVERY).await;
        assert!(t.get(1).is_none(), "kept past its retention");
        assert!(t.get(2).is_some());
        assert_eq!(t.len(), 1);
    }

    #[tokio::test]
    async fn detached_subscribers_are_dropped() {
        let p = Proc::new(
            1,
            ProcessConfig::default(),
            None,
            StdinState::Disabled,
            None,
            None,
        );
        let (tx, rx) = mpsc::channel(1);
        p.subscribe(tx).unwrap();
        drop(rx);
        p.publish(data(Output::Stdout(b"x".to_vec()))).await;
        assert!(lock(&p.live).subscribers.is_empty());
    }
}
