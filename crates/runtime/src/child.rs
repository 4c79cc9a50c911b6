//! The sandbox child: the process that becomes the sandbox's PID 1.
//!
//! It starts as a clone of the helper inside fresh user, pid, mount, net, ipc, uts and
//! cgroup namespaces, already in the sandbox cgroup. In order:
//!
//! 1. wait for the helper's "go" (uid/gid maps written) and receive the prepared mount fds;
//! 2. become root of its user namespace (`setresgid/setgroups/setresuid` to 0);
//! 3. new session (detached from the caller's terminal), stdout → the log (stderr);
//! 4. allow ICMP echo sockets for the sandbox's groups (`ping` without CAP_NET_RAW), then
//!    build the root filesystem and `pivot_root` into it (`rootfs.rs`), with paths
//!    relative to the sandbox directory (the working directory the helper gave it); create
//!    the init's listening socket in the ctl directory and make that read-only (`ctl.rs`);
//! 5. hostname, loopback up, stdin ← /dev/null;
//! 6. reset signal dispositions, mask and umask; drop capabilities from the bounding set (`capabilities.rs`), install the seccomp
//!    filter (`seccomp.rs`), put the listening socket on fd 3 ([`crate::LISTEN_FD`]) and
//!    mark every other fd close-on-exec;
//! 7. `execve` the init program.
//!
//! Any failure is reported on the status pipe as `error <step>: <reason>` and the child
//! exits; the caller then tears the cgroup down.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use crate::cgroup::InnerMounts;
use crate::helper::{Status, discard, flush, mark, report};
use crate::seccomp::SeccompPolicy;
use crate::spec::{LISTEN_FD, SandboxSpec};
use crate::{capabilities, ctl, rootfs, sys};

/// Runs the child; never returns.
pub(crate) fn main(
    spec: &SandboxSpec,
    cgroup: &InnerMounts,
    policy: &SeccompPolicy,
    sock: OwnedFd,
    out: RawFd,
) -> ! {
    // A close-on-exec copy of the status pipe: it closes by itself when execve succeeds.
    // Above LISTEN_FD, which the init's socket takes just before execve.
    // SAFETY: fcntl with integer arguments.
    let status = unsafe { libc::fcntl(out, libc::F_DUPFD_CLOEXEC, LISTEN_FD + 1) };
    let status = if status < 0 { out } else { status };
    // The helper's lines queued before the clone are the helper's to write.
    discard();
    if let Err(msg) = run(spec, cgroup, policy, sock, status) {
        report(&Status::Error(msg));
        flush(status);
    }
    // SAFETY: terminate without running atexit handlers or destructors of the helper.
    unsafe { libc::_exit(1) }
}

fn step<T>(name: &str, r: std::io::Result<T>) -> Result<T, String> {
    r.map_err(|e| format!("{name}: {e}"))
}

fn run(
    spec: &SandboxSpec,
    cgroup: &InnerMounts,
    policy: &SeccompPolicy,
    sock: OwnedFd,
    status: RawFd,
) -> Result<(), String> {
    let (msg, fds) = step(
        "wait for helper",
        sys::recv_with_fds(
            sock.as_raw_fd(),
            crate::spec::MAX_BINDS + 2 + crate::spec::MAX_LAYERS,
        ),
    )?;
    let shared_sysfs = match msg.as_slice() {
        crate::helper::GO => false,
        crate::helper::GO_WITH_SYSFS => true,
        _ => return Err("helper exited before releasing the sandbox".into()),
    };
    drop(sock);
    mark("child_released");

    become_root()?;
    // SAFETY: setsid and dup2 with integer arguments.
    unsafe {
        libc::setsid();
        libc::dup2(2, 1);
    }

    let binds = spec.all_binds();
    let lowers = spec.lowers().len();
    let expected = binds.len() + lowers + usize::from(shared_sysfs);
    if fds.len() != expected {
        return Err(format!(
            "helper sent {} mounts, expected {expected}",
            fds.len(),
        ));
    }
    let sources: Vec<_> = binds.into_iter().map(|b| b.source).collect();
    // The helper made the sandbox directory our working directory: its upper, work,
    // staging and ctl directories are reached relative to it, so this process (an
    // unprivileged host uid) needs no search permission on the state directory above
    // (root's, 0700).
    let mut here = spec.clone();
    here.sandbox_dir = std::path::PathBuf::from(".");
    let (lower_fds, rest) = fds.split_at(lowers);
    let (bind_fds, sysfs) = rest.split_at(sources.len());
    rootfs::execute(
        &rootfs::plan(&here, cgroup),
        &rootfs::Mounts {
            lowers: lower_fds,
            binds: bind_fds,
            bind_sources: &sources,
            sysfs: sysfs.first(),
        },
    )?;
    drop(fds);
    // Inside the new root, at the path the sandbox sees, then the ctl mount goes read-only.
    let listener = match &spec.ctl_socket {
        Some(name) => Some(ctl::listen_in_sandbox(name).map_err(|e| format!("ctl socket: {e}"))?),
        None => None,
    };
    ctl::seal_in_sandbox().map_err(|e| format!("ctl directory: {e}"))?;
    mark("rootfs_ready");

    step("sethostname", {
        // SAFETY: valid buffer and length.
        let rc = unsafe { libc::sethostname(spec.hostname.as_ptr().cast(), spec.hostname.len()) };
        if rc < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    })?;
    step("bring lo up", sys::interface_up("lo"))?;
    stdin_null()?;

    let argv: Vec<CString> = spec
        .init
        .iter()
        .map(|a| CString::new(a.as_str()).map_err(|_| "init argument contains NUL".to_string()))
        .collect::<Result<_, _>>()?;
    let envp: Vec<CString> = spec
        .init_env()
        .iter()
        .map(|(k, v)| CString::new(format!("{k}={v}")).map_err(|_| "env contains NUL".to_string()))
        .collect::<Result<_, _>>()?;
    let mut argv_p: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    argv_p.push(std::ptr::null());
    let mut envp_p: Vec<*const libc::c_char> = envp.iter().map(|a| a.as_ptr()).collect();
    envp_p.push(std::ptr::null());

    reset_signals_and_umask();
    step(
        "restrict capabilities",
        capabilities::restrict_bounding_set(),
    )?;
    if let Some(l) = listener {
        step("pass the ctl socket", sys::move_fd_to(l, LISTEN_FD))?;
    }
    step(
        "close inherited fds",
        sys::cloexec_from(LISTEN_FD as u32 + 1),
    )?;
    mark("exec");
    flush(status);
    step("install seccomp filter", policy.install())?;
    // SAFETY: argv/envp are NULL-terminated arrays of valid C strings that outlive the call.
    unsafe { libc::execve(argv_p[0], argv_p.as_ptr(), envp_p.as_ptr()) };
    Err(format!(
        "execve {}: {}",
        spec.init[0],
        std::io::Error::last_os_error()
    ))
}

/// Switches to uid/gid 0 of the new user namespace (host `uid_base`), no supplementary groups.
pub(crate) fn become_root() -> Result<(), String> {
    // SAFETY: plain id-setting syscalls.
    unsafe {
        if libc::setresgid(0, 0, 0) < 0 {
            return Err(format!("setresgid(0): {}", std::io::Error::last_os_error()));
        }
        if libc::setgroups(0, std::ptr::null()) < 0 {
            return Err(format!(
                "setgroups([]): {}",
                std::io::Error::last_os_error()
            ));
        }
        if libc::setresuid(0, 0, 0) < 0 {
            return Err(format!("setresuid(0): {}", std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// Signal dispositions set to SIG_IGN and the signal mask survive `execve`: give the init
/// a clean slate rather than whatever the caller (a server) had. Also umask 022.
fn reset_signals_and_umask() {
    // SAFETY: plain signal/umask calls; SIGKILL/SIGSTOP failures (EINVAL) are ignored.
    unsafe {
        for sig in 1..=libc::SIGRTMAX() {
            libc::signal(sig, libc::SIG_DFL);
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        libc::umask(0o022);
    }
}

fn stdin_null() -> Result<(), String> {
    // SAFETY: open/dup2/close with valid arguments.
    unsafe {
        let fd = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY);
        if fd < 0 {
            return Err(format!(
                "open /dev/null: {}",
                std::io::Error::last_os_error()
            ));
        }
        libc::dup2(fd, 0);
        if fd != 0 {
            libc::close(fd);
        }
    }
    Ok(())
}
