//! The zygote: a long-lived, single-threaded fork server that starts sandbox helpers.
//!
//! [`crate::spawn`] must not fork the calling process (typically a multi-threaded tokio
//! server), so a sandbox's helper used to be a fresh exec of the calling binary per
//! sandbox. For the 43 MB `cubicle` binary that exec, its dynamic loading and relocation
//! cost about 1.5 ms of CPU and 2–3 ms of latency per create, more under load. Instead
//! the first spawn of a process execs the binary once as the *zygote* ([`ZYGOTE_ARG`]);
//! for every sandbox the zygote forks a helper, which is the same fresh, single-threaded
//! process the exec gave, with the seccomp policy already compiled and the cgroup layout
//! already read.
//!
//! The zygote forks each helper with `CLONE_PARENT`: the helper, and through its own
//! `CLONE_PARENT` the sandbox's init, are children of the process that called `spawn`,
//! exactly as before, so that process reaps both and receives `SIGCHLD` for the init.
//! The zygote itself has no children and holds nothing but its socket.
//!
//! Where the host has a v2 hierarchy, the zygote clones each helper straight into a v2
//! cgroup (`clone3(CLONE_INTO_CGROUP)`, Linux 5.7, older than the idmapped mounts the
//! runtime needs): the sandbox's own on a v2 host, the shared `cubicle` of the unified
//! tracking hierarchy on a hybrid one. That spares the helper a migration (see
//! [`crate::cgroup::Cgroup::join_single_threaded`]).
//!
//! Protocol (a `SOCK_SEQPACKET` pair; the zygote's end is its stdin): the caller sends one
//! message per helper, the request's JSON with two or three descriptors, the status pipe
//! (the helper's stdout), the log (its stderr) and optionally the v2 cgroup directory to
//! clone it into; the zygote answers `pid <pid>` or `error <message>`. End of file on the
//! socket (the caller closed it or died) ends the zygote. A zygote that died or stopped
//! answering is replaced by the next spawn.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::sys;

/// argv[1] that turns the current binary into the zygote.
pub const ZYGOTE_ARG: &str = "__cubicle-runtime-zygote__";

/// Largest request (a sandbox spec's JSON) the zygote accepts.
pub(crate) const MAX_REQUEST: usize = 256 * 1024;

/// `clone3`'s flag (libc's constant is an `int` that cannot hold it).
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// How long the zygote may take to answer a request (a fork): beyond it, it is replaced.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// The calling process's zygote, started by the first spawn.
static ZYGOTE: Mutex<Option<Zygote>> = Mutex::new(None);

struct Zygote {
    child: Child,
    sock: OwnedFd,
    /// The process that started it: a forked copy of that process must not use it
    /// (the helpers would become the original's children).
    owner: u32,
}

impl Zygote {
    fn start() -> Result<Zygote> {
        let (ours, theirs) = cubicle_syscalls::socket::seqpacket_pair()
            .map_err(|e| Error::io("zygote socket pair", e))?;
        let child = Command::new("/proc/self/exe")
            .arg0("cubicle-sandbox-zygote")
            .arg(ZYGOTE_ARG)
            .env_clear()
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| Error::io("start the sandbox zygote (/proc/self/exe)", e))?;
        Ok(Zygote {
            child,
            sock: ours,
            owner: std::process::id(),
        })
    }

    /// One request: the helper's pid, or why not.
    fn ask(&self, request: &[u8], fds: &[RawFd]) -> std::result::Result<i32, Failure> {
        let sock = self.sock.as_raw_fd();
        sys::send_with_fds(sock, request, fds)
            .map_err(|e| Failure::NotSent(Error::io("send a request to the sandbox zygote", e)))?;
        let broken = |e| Failure::Broken(Error::io("read the sandbox zygote's answer", e));
        sys::wait_readable(sock, std::time::Instant::now() + ANSWER_TIMEOUT).map_err(broken)?;
        let (answer, _) = sys::recv_with_fds(sock, 0).map_err(broken)?;
        let answer = String::from_utf8_lossy(&answer);
        if answer.is_empty() {
            return Err(broken(std::io::ErrorKind::UnexpectedEof.into()));
        }
        let bad = || Failure::Broken(Error::Setup(format!("zygote: bad answer {answer:?}")));
        match answer.split_once(' ') {
            Some(("pid", p)) => p.parse().ok().filter(|&p: &i32| p > 0).ok_or_else(bad),
            Some(("error", m)) => Err(Failure::Refused(Error::Setup(format!("zygote: {m}")))),
            _ => Err(bad()),
        }
    }

    fn stop(mut self) {
        drop(self.sock);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Why a request to the zygote failed.
enum Failure {
    /// It never got the request (it is gone): a new zygote may take it.
    NotSent(Error),
    /// It answered with an error; it is still fine.
    Refused(Error),
    /// It got the request but gave no answer: a helper may or may not exist, using the
    /// request's status pipe, so the request must not be sent again.
    Broken(Error),
}

/// Starts a sandbox helper for `request` (a [`crate::helper::HelperRequest`]'s JSON)
/// with `stdout` as its status pipe and `stderr` as its log, cloned into the v2 cgroup
/// directory `cgroup` if given; returns its pid, a child of this process that the caller
/// must reap. Starts (or replaces) the zygote as needed.
pub(crate) fn start_helper(
    request: &[u8],
    stdout: BorrowedFd<'_>,
    stderr: BorrowedFd<'_>,
    cgroup: Option<BorrowedFd<'_>>,
) -> Result<i32> {
    if request.len() > MAX_REQUEST {
        return Err(Error::InvalidSpec(format!(
            "sandbox spec of {} bytes (at most {MAX_REQUEST})",
            request.len()
        )));
    }
    let mut slot = ZYGOTE.lock().unwrap_or_else(|e| e.into_inner());
    if slot.as_ref().is_some_and(|z| z.owner != std::process::id()) {
        // Inherited through a fork: not ours to use, stop or wait for.
        std::mem::forget(slot.take());
    }
    let mut fds = vec![stdout.as_raw_fd(), stderr.as_raw_fd()];
    fds.extend(cgroup.map(|c| c.as_raw_fd()));
    let mut last = None;
    for _ in 0..2 {
        let zygote = match slot.take() {
            Some(z) => z,
            None => Zygote::start()?,
        };
        match zygote.ask(request, &fds) {
            Ok(pid) => {
                *slot = Some(zygote);
                return Ok(pid);
            }
            Err(Failure::Refused(e)) => {
                *slot = Some(zygote);
                return Err(e);
            }
            Err(Failure::Broken(e)) => {
                // The next spawn starts a new zygote; this one's request is lost (the
                // caller removes whatever a helper made of it, with the cgroup).
                zygote.stop();
                return Err(e);
            }
            Err(Failure::NotSent(e)) => {
                // Gone (e.g. killed): a new zygote takes the request.
                zygote.stop();
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or_else(|| Error::Setup("zygote: no answer".into())))
}

/// The zygote's pid, if this process has one running (tests).
#[doc(hidden)]
pub fn zygote_pid() -> Option<u32> {
    let slot = ZYGOTE.lock().unwrap_or_else(|e| e.into_inner());
    slot.as_ref().map(|z| z.child.id())
}

/// Entry point of the zygote process (a fresh exec; its stdin is the socket); returns
/// the exit code.
pub(crate) fn main() -> i32 {
    sys::set_comm(c"cubicle-zygote");
    let policy = match crate::seccomp::compile() {
        Ok(p) => p,
        Err(e) => return serve_errors(&format!("seccomp policy: {e}")),
    };
    // Read once here, inherited by every helper.
    let _ = crate::cgroup::Layout::detect();
    if let Err(e) = crate::shared_sysfs::init() {
        eprintln!("cubicle-zygote: no shared sysfs, each sandbox mounts its own: {e}");
    }
    // SAFETY: opening a constant path.
    let devnull = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if devnull < 0 {
        return serve_errors(&format!(
            "open /dev/null: {}",
            std::io::Error::last_os_error()
        ));
    }
    loop {
        let (request, mut fds) = match sys::recv_with_fds_sized(0, MAX_REQUEST, 3) {
            Ok((r, _)) if r.is_empty() => return 0,
            Ok(m) => m,
            Err(e) if e.raw_os_error() == Some(libc::EMSGSIZE) => {
                answer("error request too large or with too many descriptors");
                continue;
            }
            Err(_) => return 1,
        };
        if !(2..=3).contains(&fds.len()) {
            answer(&format!(
                "error expected 2 or 3 descriptors, got {}",
                fds.len()
            ));
            continue;
        }
        let cgroup = if fds.len() == 3 { fds.pop() } else { None };
        let pid = clone_helper(cgroup.as_ref().map(|c| c.as_raw_fd()));
        let failed = (pid < 0).then(|| {
            let into = if cgroup.is_some() {
                " into its cgroup"
            } else {
                ""
            };
            format!("{into}: {}", std::io::Error::last_os_error())
        });
        drop(cgroup);
        if pid == 0 {
            // (its sandbox's init is called so too until it execs envd)
            sys::set_comm(c"cubicle-helper");
            // The helper: status pipe on 1, log on 2, /dev/null on 0 (which closes our
            // copy of the socket).
            // SAFETY: dup2 with descriptors this process owns.
            let ok = unsafe {
                libc::dup2(fds[0].as_raw_fd(), 1) >= 0
                    && libc::dup2(fds[1].as_raw_fd(), 2) >= 0
                    && libc::dup2(devnull, 0) >= 0
            };
            drop(fds);
            // SAFETY: closing our own descriptor.
            unsafe { libc::close(devnull) };
            let code = if ok {
                crate::helper::main(&request, &policy)
            } else {
                1
            };
            // SAFETY: the helper ends here, without unwinding into the zygote's loop.
            unsafe { libc::_exit(code) };
        }
        drop(fds);
        match failed {
            Some(why) => answer(&format!("error clone a sandbox helper{why}")),
            None => answer(&format!("pid {pid}")),
        }
    }
}

/// Clones a helper (`CLONE_PARENT`: a child of the zygote's parent), into the v2 cgroup
/// directory `cgroup` if given; returns what `clone` returns (0 in the helper, -1 on
/// failure with errno set).
fn clone_helper(cgroup: Option<RawFd>) -> libc::c_long {
    match cgroup {
        Some(fd) => {
            // SAFETY: clone_args is plain integers, for which zero is valid (the default).
            let mut args: libc::clone_args = unsafe { std::mem::zeroed() };
            // No exit signal: clone3 refuses one with CLONE_PARENT, where the helper gets
            // the zygote's own (SIGCHLD, as `Command` started it), as with `clone`.
            args.flags = (libc::CLONE_PARENT as u64) | CLONE_INTO_CGROUP;
            args.cgroup = fd as u64;
            // SAFETY: this process is single-threaded, so a fork-like clone is as safe as
            // fork(); `args` is a complete `clone_args` of the size given.
            unsafe {
                libc::syscall(
                    libc::SYS_clone3,
                    &args as *const libc::clone_args,
                    std::mem::size_of::<libc::clone_args>(),
                )
            }
        }
        // SAFETY: as above.
        None => unsafe {
            libc::syscall(
                libc::SYS_clone,
                (libc::CLONE_PARENT | libc::SIGCHLD) as libc::c_ulong,
                0usize,
                0usize,
                0usize,
                0usize,
            )
        },
    }
}

/// Sends one answer to the caller (best effort: if it is gone, the next read ends us).
fn answer(text: &str) {
    let _ = sys::send_with_fds(0, text.as_bytes(), &[]);
}

/// A zygote that cannot make helpers answers every request with `message` until its
/// caller gives up on it.
fn serve_errors(message: &str) -> i32 {
    loop {
        match sys::recv_with_fds_sized(0, MAX_REQUEST, 2) {
            Ok((r, _)) if r.is_empty() => return 1,
            Ok(_) => answer(&format!("error {message}")),
            Err(_) => return 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn oversized_requests_are_refused_before_any_zygote_starts() {
        let (a, b) = cubicle_syscalls::socket::seqpacket_pair().unwrap();
        let big = vec![b'x'; MAX_REQUEST + 1];
        let err = start_helper(&big, a.as_fd(), b.as_fd(), None).unwrap_err();
        assert!(matches!(err, Error::InvalidSpec(_)), "{err}");
        assert!(zygote_pid().is_none());
    }
}
