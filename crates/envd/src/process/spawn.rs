//! Starting a process as the acting user: environment, working directory, credentials,
//! its own session, and its stdio (pipes, `/dev/null`, or a PTY).
//!
//! The child is made with `clone(CLONE_VM | CLONE_VFORK)`, as `posix_spawn` does, not
//! `fork`: it borrows envd's memory until it calls `execve`, so envd's page tables are
//! not copied and envd takes no copy-on-write faults afterwards. On this kind of VM a
//! fork of envd plus those faults cost as much as the exec itself, and it happens on
//! every command. Borrowing memory is also why the child's code ([`child_main`]) only
//! makes raw system calls on data prepared before the clone, on its own stack, and
//! allocates nothing: default signal dispositions (`rt_sigaction`), stdio (`dup2`),
//! close-on-exec for anything envd inherited (`close_range`), `setsid`,
//! `ioctl(TIOCSCTTY)`, `setgroups`/`setgid`/`setuid`, `chdir`, an empty signal mask, and
//! `execve`. The caller's thread is suspended until the exec (or the child's exit), so
//! spawning is short enough to run on envd's single runtime thread.

use std::{
    collections::HashMap,
    ffi::{CString, c_void},
    io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::{ffi::OsStrExt, process::ExitStatusExt},
    },
    path::{Path, PathBuf},
    process::ExitStatus,
};

use tokio::io::unix::AsyncFd;
use tokio::net::unix::pipe;

use super::pty;
use crate::users::User;

/// `PATH` for children when envd itself has none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// What the child's stdin is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StdinMode {
    /// A pipe envd writes `SendInput` data to.
    Pipe,
    /// `/dev/null`.
    Null,
}

/// Everything needed to start one process.
#[derive(Debug, Clone)]
pub struct SpawnSpec {
    pub cmd: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: PathBuf,
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub stdin: StdinMode,
    /// `Some((cols, rows))` for a PTY.
    pub pty: Option<(u16, u16)>,
}

/// The I/O ends envd keeps.
pub enum Io {
    Pipes {
        stdin: Option<pipe::Sender>,
        stdout: pipe::Receiver,
        stderr: pipe::Receiver,
    },
    Pty {
        master: OwnedFd,
    },
}

/// A started child.
pub struct Spawned {
    pub child: Child,
    pub io: Io,
}

/// Builds the child environment: PATH, HOME, USER, LOGNAME, SHELL of the user, then
/// the sandbox-global variables, then the per-call ones (later entries win).
pub fn environment(
    user: &User,
    global: &HashMap<String, String>,
    per_call: &HashMap<String, String>,
) -> Vec<(String, String)> {
    let path = std::env::var("PATH").ok().filter(|p| !p.is_empty());
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), path.unwrap_or_else(|| DEFAULT_PATH.into())),
        ("HOME".into(), user.home.to_string_lossy().into_owned()),
        ("USER".into(), user.name.clone()),
        ("LOGNAME".into(), user.name.clone()),
    ];
    if !user.shell.is_empty() {
        env.push(("SHELL".into(), user.shell.clone()));
    }
    let mut sorted_global: Vec<_> = global.iter().collect();
    sorted_global.sort();
    let mut sorted_call: Vec<_> = per_call.iter().collect();
    sorted_call.sort();
    for (k, v) in sorted_global.into_iter().chain(sorted_call) {
        env.retain(|(ek, _)| ek != k);
        env.push((k.clone(), v.clone()));
    }
    env
}

/// Checks that an environment variable name can be passed to `execve`.
pub fn valid_env_name(name: &str) -> bool {
    !name.is_empty() && !name.contains('=') && !name.contains('\0')
}

/// The highest descriptor number that may be open (for kernels without `close_range`).
fn open_fd_limit() -> libc::c_int {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes a struct rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } == 0 {
        rl.rlim_cur.min(65536) as libc::c_int
    } else {
        1024
    }
}

/// The kernel's `struct sigaction` (x86_64 / aarch64 layout, 64-bit signal mask).
#[repr(C)]
struct KernelSigaction {
    handler: libc::sighandler_t,
    flags: libc::c_ulong,
    restorer: usize,
    mask: u64,
}

/// A started child: its pid, and a pidfd that becomes readable when it exits.
pub struct Child {
    pid: u32,
    exited: AsyncFd<OwnedFd>,
    reaped: bool,
}

impl Child {
    pub fn id(&self) -> u32 {
        self.pid
    }

    /// Waits for the child to exit and reaps it. Cancel-safe; call it again after it
    /// returned and it fails. Only this reaps envd's own children (see `crate::init`).
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        if self.reaped {
            return Err(io::Error::other("the process was already reaped"));
        }
        loop {
            let mut ready = self.exited.readable().await?;
            let mut status = 0;
            // SAFETY: waitpid on our own (registered, unreaped) child; status is valid.
            let r = unsafe { libc::waitpid(self.pid as libc::pid_t, &mut status, libc::WNOHANG) };
            if r == self.pid as libc::pid_t {
                self.reaped = true;
                return Ok(ExitStatus::from_raw(status));
            }
            if r < 0 {
                return Err(io::Error::last_os_error());
            }
            ready.clear_ready();
        }
    }
}

/// The OOM score adjustment of every process envd starts (envd keeps the default, 0).
///
/// When the OOM killer picks envd (PID 1), the whole sandbox dies; a memory hog should die
/// instead. Lowering envd's own score needs CAP_SYS_RESOURCE on the host, which hosts may
/// not grant, so what envd starts is made the likelier victim instead: a raise is always
/// allowed, and descendants inherit it. The child sets it on itself before its exec, so
/// nothing it runs ever has the lower score; the kernel gives a vfork child its own score
/// even though it shares envd's memory (see `__set_oom_adj`).
pub const CHILD_OOM_SCORE_ADJ: &[u8] = b"500";
const OOM_SCORE_ADJ_PATH: &[u8] = b"/proc/self/oom_score_adj\0";

/// The child's stack while it borrows envd's memory (it only makes system calls).
const CHILD_STACK: usize = 64 << 10;

/// What [`child_main`] works from, all prepared before the clone.
#[repr(C)]
struct ChildArgs {
    program: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    cwd: *const libc::c_char,
    stdio: [libc::c_int; 3],
    groups: *const libc::gid_t,
    ngroups: usize,
    uid: libc::uid_t,
    gid: libc::gid_t,
    switch_user: bool,
    is_pty: bool,
    sig_max: libc::c_int,
    fd_limit: libc::c_int,
    /// Written by the child when a step fails: that step's errno.
    err: libc::c_int,
}

/// The child between clone and exec. Raw system calls only (see the module comment).
extern "C" fn child_main(arg: *mut c_void) -> libc::c_int {
    // SAFETY: `arg` is the parent's `ChildArgs`, alive until clone returns, which is after
    // this child has exec'd or exited (CLONE_VFORK).
    let a = unsafe { &mut *(arg as *mut ChildArgs) };
    // SAFETY: system calls on prepared, valid data; nothing here allocates or locks.
    unsafe {
        let fail = |a: &mut ChildArgs| -> libc::c_int {
            std::ptr::write_volatile(&mut a.err, (*libc::__errno_location()).max(1));
            libc::_exit(127)
        };
        for (target, &src) in a.stdio.iter().enumerate() {
            if libc::dup2(src, target as libc::c_int) < 0 {
                return fail(a);
            }
        }
        // Default dispositions: envd ignores SIGPIPE, and may have been started with
        // SIGINT/SIGQUIT ignored; ignored signals survive exec (Ctrl-C in a PTY would
        // then do nothing), and envd's handlers must not run in this borrowed memory.
        // Raw rt_sigaction: glibc's wrapper refuses its internal signals 32/33.
        for sig in 1..=a.sig_max {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                let dfl = KernelSigaction {
                    handler: libc::SIG_DFL,
                    flags: 0,
                    restorer: 0,
                    mask: 0,
                };
                libc::syscall(
                    libc::SYS_rt_sigaction,
                    sig,
                    &dfl as *const KernelSigaction,
                    std::ptr::null_mut::<KernelSigaction>(),
                    8usize,
                );
            }
        }
        // Descriptors envd itself inherited without close-on-exec (from whoever started
        // it) must not reach the child either (the fd table is the child's own copy).
        if libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        ) < 0
        {
            for fd in 3..a.fd_limit {
                libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
            }
        }
        if libc::setsid() < 0 {
            return fail(a);
        }
        // Best effort (a /proc-less root has no such file); see CHILD_OOM_SCORE_ADJ.
        let fd = libc::open(
            OOM_SCORE_ADJ_PATH.as_ptr() as *const libc::c_char,
            libc::O_WRONLY | libc::O_CLOEXEC,
        );
        if fd >= 0 {
            libc::write(
                fd,
                CHILD_OOM_SCORE_ADJ.as_ptr() as *const c_void,
                CHILD_OOM_SCORE_ADJ.len(),
            );
            libc::close(fd);
        }
        if a.is_pty && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
            return fail(a);
        }
        if a.switch_user
            && (libc::syscall(libc::SYS_setgroups, a.ngroups, a.groups) < 0
                || libc::syscall(libc::SYS_setgid, a.gid) < 0
                || libc::syscall(libc::SYS_setuid, a.uid) < 0)
        {
            return fail(a);
        }
        // After dropping privileges, so a directory the user may not enter fails.
        if libc::chdir(a.cwd) < 0 {
            return fail(a);
        }
        let empty: u64 = 0;
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK,
            &empty as *const u64,
            std::ptr::null_mut::<u64>(),
            8usize,
        );
        libc::execve(a.program, a.argv, a.envp);
        fail(a)
    }
}

fn c_string(s: &[u8], what: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what} contains a NUL byte"),
        )
    })
}

/// The file `execve` will run for `cmd`: itself when it has a `/`, else the first
/// executable `PATH` entry (the child's `PATH`, as `execvp` after `env_clear` would).
fn resolve_program(cmd: &str, env: &[(String, String)]) -> io::Result<PathBuf> {
    if cmd.is_empty() {
        return Err(io::Error::from_raw_os_error(libc::ENOENT));
    }
    if cmd.contains('/') {
        return Ok(PathBuf::from(cmd));
    }
    let path = env
        .iter()
        .rev()
        .find(|(k, _)| k == "PATH")
        .map_or(DEFAULT_PATH, |(_, v)| v.as_str());
    let mut denied = false;
    for dir in path.split(':') {
        let candidate = Path::new(if dir.is_empty() { "." } else { dir }).join(cmd);
        let Ok(c) = CString::new(candidate.as_os_str().as_bytes()) else {
            continue;
        };
        // SAFETY: access on a valid C string.
        if unsafe { libc::access(c.as_ptr(), libc::X_OK) } == 0 {
            if candidate.is_file() {
                return Ok(candidate);
            }
        } else if io::Error::last_os_error().raw_os_error() == Some(libc::EACCES) {
            denied = true;
        }
    }
    Err(io::Error::from_raw_os_error(if denied {
        libc::EACCES
    } else {
        libc::ENOENT
    }))
}

/// A descriptor numbered 3 or above (the child dup2s sources onto 0–2 in order, so no
/// source may be one of them).
fn above_stdio(fd: OwnedFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    // SAFETY: F_DUPFD_CLOEXEC on a valid descriptor returns a new one we own.
    let new = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
    if new < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just returned by fcntl.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

/// A close-on-exec pipe: (read end, write end).
fn pipe_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 writes two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both were just returned by pipe2 and are owned by nobody else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    Ok((above_stdio(r)?, above_stdio(w)?))
}

fn dev_null() -> io::Result<OwnedFd> {
    // SAFETY: open of a constant path.
    let fd = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just returned by open.
    above_stdio(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Starts the process. Must be called inside the tokio runtime (it registers the pipes
/// and the exit notification with the reactor).
pub fn spawn(spec: &SpawnSpec) -> io::Result<Spawned> {
    let program = c_string(
        resolve_program(&spec.cmd, &spec.env)?
            .as_os_str()
            .as_bytes(),
        "the command",
    )?;
    let mut argv_c = vec![c_string(spec.cmd.as_bytes(), "the command")?];
    for a in &spec.args {
        argv_c.push(c_string(a.as_bytes(), "an argument")?);
    }
    let envp_c = spec
        .env
        .iter()
        .map(|(k, v)| c_string(format!("{k}={v}").as_bytes(), "an environment variable"))
        .collect::<io::Result<Vec<_>>>()?;
    let argv: Vec<*const libc::c_char> = argv_c
        .iter()
        .map(|c| c.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let envp: Vec<*const libc::c_char> = envp_c
        .iter()
        .map(|c| c.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let cwd = c_string(spec.cwd.as_os_str().as_bytes(), "cwd")?;

    // SAFETY: geteuid/getuid cannot fail.
    let (euid, uid_now) = unsafe { (libc::geteuid(), libc::getuid()) };
    let switch_user = euid == 0;
    if !switch_user && spec.uid != uid_now {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "envd does not run as root and cannot start processes as uid {}",
                spec.uid
            ),
        ));
    }

    // The child's ends (closed here once it has exec'd) and the ends envd keeps.
    let (child_ends, kept): ([OwnedFd; 3], Kept) = match spec.pty {
        Some((cols, rows)) => {
            let (master, slave) = pty::open(cols, rows)?;
            let slave = above_stdio(slave)?;
            (
                [slave.try_clone()?, slave.try_clone()?, slave],
                Kept::Pty(master),
            )
        }
        None => {
            let (stdin_child, stdin_kept) = match spec.stdin {
                StdinMode::Pipe => {
                    let (r, w) = pipe_pair()?;
                    (r, Some(w))
                }
                StdinMode::Null => (dev_null()?, None),
            };
            let (out_r, out_w) = pipe_pair()?;
            let (err_r, err_w) = pipe_pair()?;
            (
                [stdin_child, out_w, err_w],
                Kept::Pipes(stdin_kept, out_r, err_r),
            )
        }
    };

    let groups: Vec<libc::gid_t> = spec.groups.clone();
    let mut args = ChildArgs {
        program: program.as_ptr(),
        argv: argv.as_ptr(),
        envp: envp.as_ptr(),
        cwd: cwd.as_ptr(),
        stdio: [
            child_ends[0].as_raw_fd(),
            child_ends[1].as_raw_fd(),
            child_ends[2].as_raw_fd(),
        ],
        groups: groups.as_ptr(),
        ngroups: groups.len(),
        uid: spec.uid,
        gid: spec.gid,
        switch_user,
        is_pty: spec.pty.is_some(),
        sig_max: libc::SIGRTMAX(),
        fd_limit: open_fd_limit(),
        err: 0,
    };
    let mut stack = vec![0u8; CHILD_STACK];
    let stack_top = (stack.as_mut_ptr() as usize + CHILD_STACK) & !15;

    // Registered as envd's own before anything can reap it (see `crate::init`).
    let mut own = crate::init::spawn_guard();
    // SAFETY: all-signals-blocked around the clone so no handler of envd's runs in the
    // child before it resets them (it unblocks just before exec); the child runs
    // `child_main` on `stack` with `args`, both alive until clone returns (CLONE_VFORK).
    let (pid, clone_err, child_err) = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let pid = libc::clone(
            child_main,
            stack_top as *mut c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            &mut args as *mut ChildArgs as *mut c_void,
        );
        let clone_err = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        (pid, clone_err, std::ptr::read_volatile(&args.err))
    };
    drop(stack);
    drop(child_ends);
    if switch_user {
        // The child changed credentials while it still shared envd's memory (CLONE_VM),
        // which made envd non-dumpable: see `users::restore_dumpable`.
        crate::users::restore_dumpable();
    }
    if pid < 0 {
        return Err(clone_err);
    }
    if child_err != 0 {
        // It has exited (that is when clone returned): reap it here, unregistered.
        let mut status = 0;
        // SAFETY: waitpid on our own exited child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        return Err(io::Error::from_raw_os_error(child_err));
    }
    own.register(pid as u32);
    drop(own);
    // Our unreaped child: its pid cannot name another process yet.
    let exited = cubicle_syscalls::pidfd::pidfd_open(pid).and_then(|pidfd| {
        // SAFETY: the OwnedFd moves into the AsyncFd, which keeps it open (and the same)
        // for the AsyncFd's whole life.
        unsafe { AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE) }
            .map_err(|e| e.into_parts().1)
    });
    let exited = match exited {
        Ok(e) => e,
        Err(e) => {
            // SAFETY: kill and reap our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
            crate::init::forget(pid as u32);
            return Err(e);
        }
    };
    let child = Child {
        pid: pid as u32,
        exited,
        reaped: false,
    };
    let io = match kept {
        Kept::Pty(master) => Io::Pty { master },
        Kept::Pipes(stdin, stdout, stderr) => Io::Pipes {
            stdin: stdin.map(pipe::Sender::from_owned_fd).transpose()?,
            stdout: pipe::Receiver::from_owned_fd(stdout)?,
            stderr: pipe::Receiver::from_owned_fd(stderr)?,
        },
    };
    Ok(Spawned { child, io })
}

/// The ends envd keeps, before they are registered with the reactor.
enum Kept {
    Pty(OwnedFd),
    Pipes(Option<OwnedFd>, OwnedFd, OwnedFd),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user() -> User {
        User {
            name: "u".into(),
            uid: 1000,
            gid: 1000,
            home: "/home/u".into(),
            shell: "/bin/bash".into(),
        }
    }

    #[test]
    fn env_order_last_wins() {
        let global = HashMap::from([
            ("A".to_string(), "g".to_string()),
            ("HOME".into(), "/g".into()),
        ]);
        let call = HashMap::from([("A".to_string(), "c".to_string())]);
        let env = environment(&user(), &global, &call);
        let get = |k: &str| {
            env.iter()
                .filter(|(ek, _)| ek == k)
                .map(|(_, v)| v.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(get("A"), vec!["c"]);
        assert_eq!(get("HOME"), vec!["/g"]);
        assert_eq!(get("USER"), vec!["u"]);
        assert_eq!(get("LOGNAME"), vec!["u"]);
        assert_eq!(get("SHELL"), vec!["/bin/bash"]);
        assert_eq!(get("PATH").len(), 1);
    }

    #[test]
    fn env_names() {
        assert!(valid_env_name("FOO"));
        assert!(!valid_env_name(""));
        assert!(!valid_env_name("A=B"));
        assert!(!valid_env_name("A\0"));
    }

    #[tokio::test]
    async fn runs_in_own_session_with_clean_env() {
        let me = crate::users::current();
        let spec = SpawnSpec {
            cmd: "/bin/sh".into(),
            args: vec![
                "-c".into(),
                "echo $FOO:$(pwd); ps -o sid= -p $$ 2>/dev/null || cat /proc/self/stat".into(),
            ],
            env: vec![
                ("FOO".into(), "bar".into()),
                ("PATH".into(), DEFAULT_PATH.into()),
            ],
            cwd: "/tmp".into(),
            uid: me.uid,
            gid: me.gid,
            groups: vec![me.gid],
            stdin: StdinMode::Null,
            pty: None,
        };
        let Spawned { mut child, io } = spawn(&spec).unwrap();
        let Io::Pipes { mut stdout, .. } = io else {
            panic!("pipes expected")
        };
        let pid = child.id();
        let mut out = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut stdout, &mut out)
            .await
            .unwrap();
        assert!(child.wait().await.unwrap().success());
        assert!(out.starts_with("bar:/tmp\n"), "{out}");
        // The shell is its own session leader: sid == pid.
        assert!(out.contains(&pid.to_string()), "{out}");
    }

    #[tokio::test]
    async fn missing_cwd_fails_spawn() {
        let me = crate::users::current();
        let spec = SpawnSpec {
            cmd: "/bin/true".into(),
            args: vec![],
            env: vec![],
            cwd: "/nonexistent-cubicle-dir".into(),
            uid: me.uid,
            gid: me.gid,
            groups: vec![me.gid],
            stdin: StdinMode::Null,
            pty: None,
        };
        assert!(spawn(&spec).is_err());
    }

    fn spec(cmd: &str, args: &[&str], stdin: StdinMode) -> SpawnSpec {
        let me = crate::users::current();
        SpawnSpec {
            cmd: cmd.into(),
            args: args.iter().map(|a| a.to_string()).collect(),
            env: vec![("PATH".into(), DEFAULT_PATH.into())],
            cwd: "/".into(),
            uid: me.uid,
            gid: me.gid,
            groups: vec![me.gid],
            stdin,
            pty: None,
        }
    }

    async fn output(spawned: Spawned) -> (String, ExitStatus) {
        let Spawned { mut child, io } = spawned;
        let Io::Pipes { mut stdout, .. } = io else {
            panic!("pipes expected")
        };
        let mut out = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut stdout, &mut out)
            .await
            .unwrap();
        (out, child.wait().await.unwrap())
    }

    /// A bare name is looked up in the child's PATH; an unknown one is ENOENT, as execvp.
    #[tokio::test]
    async fn path_lookup_and_missing_command() {
        let (out, st) =
            output(spawn(&spec("sh", &["-c", "echo ok"], StdinMode::Null)).unwrap()).await;
        assert_eq!((out.as_str(), st.code()), ("ok\n", Some(0)));
        let e = spawn(&spec("no-such-command-cubicle", &[], StdinMode::Null))
            .err()
            .unwrap();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "{e}");
        let e = spawn(&spec("/no/such/file", &[], StdinMode::Null))
            .err()
            .unwrap();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "{e}");
        // Not executable: execve's own error comes back from the child.
        let plain =
            std::env::temp_dir().join(format!("cubicle-spawn-noexec-{}", std::process::id()));
        std::fs::write(&plain, "#!/bin/sh\n").unwrap();
        let e = spawn(&spec(plain.to_str().unwrap(), &[], StdinMode::Null))
            .err()
            .unwrap();
        let _ = std::fs::remove_file(&plain);
        assert_eq!(e.raw_os_error(), Some(libc::EACCES), "{e}");
    }

    /// The child sees only its stdio, no ignored or blocked signal, and stdin data.
    #[tokio::test]
    async fn clean_fds_signals_and_stdin() {
        // A descriptor envd inherited without close-on-exec must not leak either.
        // SAFETY: dup of stdout-or-whatever fd 1 into a new plain descriptor.
        let leaked = unsafe { libc::fcntl(1, libc::F_DUPFD, 3) };
        let script = "ls /proc/self/fd | tr '\\n' ' '; grep -E '^Sig(Ign|Blk)' /proc/self/status | tr -s '\\t' ' '; cat";
        let Spawned { mut child, io } =
            spawn(&spec("/bin/sh", &["-c", script], StdinMode::Pipe)).unwrap();
        let Io::Pipes {
            stdin, mut stdout, ..
        } = io
        else {
            panic!("pipes expected")
        };
        let mut stdin = stdin.expect("a stdin pipe");
        tokio::io::AsyncWriteExt::write_all(&mut stdin, b"from stdin")
            .await
            .unwrap();
        drop(stdin);
        let mut out = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut stdout, &mut out)
            .await
            .unwrap();
        assert!(child.wait().await.unwrap().success());
        if leaked >= 0 {
            // SAFETY: closing the descriptor dup'd above.
            unsafe { libc::close(leaked) };
        }
        // ls itself opens one descriptor (3) to read the directory.
        assert!(out.starts_with("0 1 2 3 Sig"), "{out}");
        assert!(out.contains("SigBlk: 0000000000000000"), "{out}");
        assert!(out.contains("SigIgn: 0000000000000000"), "{out}");
        assert!(out.ends_with("from stdin"), "{out}");
    }

    /// Exit codes and deaths by signal come back as the kernel reports them.
    #[tokio::test]
    async fn exit_code_and_signal() {
        let (_, st) =
            output(spawn(&spec("/bin/sh", &["-c", "exit 7"], StdinMode::Null)).unwrap()).await;
        assert_eq!(st.code(), Some(7));
        let (_, st) =
            output(spawn(&spec("/bin/sh", &["-c", "kill -9 $$"], StdinMode::Null)).unwrap()).await;
        assert_eq!(st.signal(), Some(libc::SIGKILL));
    }
}
