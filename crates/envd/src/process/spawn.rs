//! Starting a process as the acting user: environment, working directory, credentials,
//! its own session, and its stdio (pipes, `/dev/null`, or a PTY).
//!
//! envd is a multi-threaded program, so the code between `fork` and `exec` (the
//! `pre_exec` hook) only makes async-signal-safe system calls on data prepared before
//! the fork: `rt_sigaction` (default dispositions), `close_range` (close-on-exec for
//! anything envd itself inherited), `setsid`, `ioctl(TIOCSCTTY)`, raw
//! `setgroups`/`setgid`/`setuid`, and `chdir`. The child inherits only its stdio.

use std::{
    collections::HashMap,
    ffi::CString,
    io,
    os::{fd::OwnedFd, unix::ffi::OsStrExt},
    path::PathBuf,
    process::Stdio,
};

use tokio::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command};

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
    Pipes { stdin: Option<ChildStdin>, stdout: ChildStdout, stderr: ChildStderr },
    Pty { master: OwnedFd },
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
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
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

/// Starts the process. Must be called inside the tokio runtime.
pub fn spawn(spec: &SpawnSpec) -> io::Result<Spawned> {
    let mut cmd = Command::new(&spec.cmd);
    cmd.args(&spec.args).env_clear().envs(spec.env.iter().map(|(k, v)| (k, v)));

    let pty_master = match spec.pty {
        Some((cols, rows)) => {
            let (master, slave) = pty::open(cols, rows)?;
            cmd.stdin(Stdio::from(slave.try_clone()?))
                .stdout(Stdio::from(slave.try_clone()?))
                .stderr(Stdio::from(slave));
            Some(master)
        }
        None => {
            cmd.stdin(match spec.stdin {
                StdinMode::Pipe => Stdio::piped(),
                StdinMode::Null => Stdio::null(),
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
            None
        }
    };

    let cwd = CString::new(spec.cwd.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "cwd contains a NUL byte"))?;
    // SAFETY: geteuid/getuid cannot fail.
    let (euid, uid_now) = unsafe { (libc::geteuid(), libc::getuid()) };
    let switch_user = euid == 0;
    if !switch_user && spec.uid != uid_now {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("envd does not run as root and cannot start processes as uid {}", spec.uid),
        ));
    }
    let groups: Vec<libc::gid_t> = spec.groups.clone();
    let (uid, gid) = (spec.uid, spec.gid);
    let is_pty = spec.pty.is_some();
    let sig_max = libc::SIGRTMAX();
    let fd_limit = open_fd_limit();

    // SAFETY: the hook only calls async-signal-safe functions (raw system calls) on data
    // prepared before the fork, and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            // Default signal dispositions: envd may itself have been started with
            // SIGINT/SIGQUIT ignored (e.g. as a background job of a script), and ignored
            // signals survive exec — Ctrl-C in a PTY would then do nothing.
            // Raw rt_sigaction: glibc's wrapper refuses its internal signals 32/33.
            for sig in 1..=sig_max {
                if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                    let dfl = KernelSigaction { handler: libc::SIG_DFL, flags: 0, restorer: 0, mask: 0 };
                    libc::syscall(
                        libc::SYS_rt_sigaction,
                        sig,
                        &dfl as *const KernelSigaction,
                        std::ptr::null_mut::<KernelSigaction>(),
                        8usize,
                    );
                }
            }
            // Descriptors envd itself inherited without close-on-exec (from whoever
            // started it) must not reach the child either. CLOEXEC rather than close:
            // std reports exec failures through a pipe that must stay open until exec.
            if libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC) < 0 {
                for fd in 3..fd_limit {
                    libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
                }
            }
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            if is_pty && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
            if switch_user {
                if libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) < 0 {
                    return Err(io::Error::last_os_error());
                }
                if libc::syscall(libc::SYS_setgid, gid) < 0 {
                    return Err(io::Error::last_os_error());
                }
                if libc::syscall(libc::SYS_setuid, uid) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            // After dropping privileges, so a directory the user may not enter fails.
            if libc::chdir(cwd.as_ptr()) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.kill_on_drop(false);

    // Registered as envd's own before anything can reap it (see `crate::init`).
    let mut child = {
        let mut own = crate::init::spawn_guard();
        let child = cmd.spawn()?;
        if let Some(pid) = child.id() {
            own.register(pid);
        }
        child
    };
    // The slave ends were moved into `cmd`; drop it so only the child holds them.
    drop(cmd);
    let io = match pty_master {
        Some(master) => Io::Pty { master },
        None => {
            let stdout = child.stdout.take().ok_or_else(|| io::Error::other("no stdout pipe"))?;
            let stderr = child.stderr.take().ok_or_else(|| io::Error::other("no stderr pipe"))?;
            Io::Pipes { stdin: child.stdin.take(), stdout, stderr }
        }
    };
    Ok(Spawned { child, io })
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
        let global = HashMap::from([("A".to_string(), "g".to_string()), ("HOME".into(), "/g".into())]);
        let call = HashMap::from([("A".to_string(), "c".to_string())]);
        let env = environment(&user(), &global, &call);
        let get = |k: &str| env.iter().filter(|(ek, _)| ek == k).map(|(_, v)| v.clone()).collect::<Vec<_>>();
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
            args: vec!["-c".into(), "echo $FOO:$(pwd); ps -o sid= -p $$ 2>/dev/null || cat /proc/self/stat".into()],
            env: vec![("FOO".into(), "bar".into()), ("PATH".into(), DEFAULT_PATH.into())],
            cwd: "/tmp".into(),
            uid: me.uid,
            gid: me.gid,
            groups: vec![me.gid],
            stdin: StdinMode::Null,
            pty: None,
        };
        let Spawned { mut child, io } = spawn(&spec).unwrap();
        let Io::Pipes { mut stdout, .. } = io else { panic!("pipes expected") };
        let pid = child.id().unwrap();
        let mut out = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut stdout, &mut out).await.unwrap();
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
}
