//! The sandbox helper: a short-lived, single-threaded process that creates the sandbox.
//!
//! `spawn` (in the caller, typically a multi-threaded tokio server) never forks itself.
//! The caller's zygote (`zygote.rs`, a single-threaded exec of the caller's own binary)
//! forks one helper per sandbox, with `CLONE_PARENT` (the helper is the caller's child),
//! the request in memory, the status pipe on stdout and the sandbox log on stderr. Being
//! a fork of a single-threaded process, the helper may use `clone(2)` like `fork(2)`
//! safely. The sequence:
//!
//! 1. parse the [`HelperRequest`] (JSON); the seccomp policy comes compiled from the
//!    zygote;
//! 2. join the sandbox cgroup (so the child is born in it, before any user code runs,
//!    and its cgroup namespace is rooted there); chdir into the sandbox directory (the
//!    child inherits it and builds its root filesystem relative to it, never through the
//!    root-only state directory);
//! 3. `clone(CLONE_NEWUSER|NEWPID|NEWNS|NEWNET|NEWIPC|NEWUTS|NEWCGROUP|CLONE_PARENT)`:
//!    CLONE_PARENT makes the sandbox's init a child of the *caller*, so the caller can
//!    `waitpid` it and read its exit status; the helper then just exits;
//! 4. write `uid_map`/`gid_map` (`0 uid_base uid_count`) for the child;
//! 5. create the idmapped, read-only clone of the template rootfs (`open_tree` +
//!    `mount_setattr(MOUNT_ATTR_IDMAP, child's userns)`) — this needs CAP_SYS_ADMIN in the
//!    host user namespace, so the helper does it, not the child — and detached clones of
//!    every bind-mount source;
//! 6. release the child by sending it those mount fds over a socketpair (SCM_RIGHTS).
//!
//! The child (see `child.rs`) then builds its root filesystem and execs the init program.
//!
//! Status protocol on the helper's stdout (a pipe read by `spawn`), one line each:
//! `pid <host pid>`, `t <step> <CLOCK_MONOTONIC ns>`, `error <message>`, each process's
//! lines written in one write when it is done ([`flush`]). The child keeps a
//! close-on-exec copy of that pipe: end-of-file without an `error` line means the init
//! program was exec'd.

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use serde::{Deserialize, Serialize};

use crate::cgroup::Cgroup;
use crate::seccomp::SeccompPolicy;
use crate::spec::{BindMount, SandboxSpec};
use crate::sys;

/// What `spawn` sends the helper (through the zygote, which forks it).
#[derive(Serialize, Deserialize)]
pub(crate) struct HelperRequest {
    pub spec: SandboxSpec,
    /// `Some(pid)`: not a new sandbox but `spec`'s root for the running shell whose init
    /// is `pid` (`reroot.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reroot: Option<i32>,
}

/// One line of the status protocol.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Status {
    Pid(i32),
    Time(String, u64),
    Error(String),
}

impl Status {
    pub(crate) fn parse(line: &str) -> Option<Status> {
        let (kind, rest) = line.split_once(' ')?;
        match kind {
            "pid" => rest.trim().parse().ok().map(Status::Pid),
            "t" => {
                let (step, ns) = rest.split_once(' ')?;
                ns.trim()
                    .parse()
                    .ok()
                    .map(|ns| Status::Time(step.to_string(), ns))
            }
            "error" => Some(Status::Error(rest.to_string())),
            _ => None,
        }
    }
}

/// Status lines not written yet. The caller reads the status pipe to its end before it
/// looks at any line, so a process writes its lines in one write when it is done
/// ([`flush`]): before its `execve` (the child) or its exit (the helper, the child on
/// an error). A line a write each woke the caller's reading thread ten times per sandbox.
static PENDING: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());

fn pending() -> std::sync::MutexGuard<'static, String> {
    // Single-threaded processes: a poisoned lock only means an earlier panic; the lines
    // are still whole.
    PENDING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Queues one status line for [`flush`].
pub(crate) fn report(status: &Status) {
    let line = match status {
        Status::Pid(p) => format!("pid {p}\n"),
        Status::Time(s, ns) => format!("t {s} {ns}\n"),
        Status::Error(m) => format!("error {}\n", m.replace('\n', " ")),
    };
    pending().push_str(&line);
}

pub(crate) fn mark(step: &str) {
    report(&Status::Time(step.to_string(), sys::monotonic_ns()));
}

/// Forgets the queued lines: the child's copy of its helper's (the helper writes those).
pub(crate) fn discard() {
    pending().clear();
}

/// Writes the queued lines to `fd` in one write (best effort: if the caller is gone
/// there is no one to tell).
pub(crate) fn flush(fd: RawFd) {
    let lines = std::mem::take(&mut *pending());
    if let Err(e) = sys::write_all_fd(fd, lines.as_bytes())
        && e.raw_os_error() == Some(libc::EPIPE)
    {
        // The caller is gone (e.g. the node was killed mid-create): stop here rather than
        // finish a sandbox nobody will track. Reconciliation removes what exists so far.
        // SAFETY: immediate exit of this single-threaded helper/child process.
        unsafe { libc::_exit(1) };
    }
}

/// Entry point of a helper the zygote forked (stdout: the status pipe); returns the exit
/// code.
pub(crate) fn main(request: &[u8], policy: &SeccompPolicy) -> i32 {
    let out = std::io::stdout().as_raw_fd();
    mark("helper_started");
    let code = match run(request, policy, out) {
        Ok(()) => 0,
        Err(msg) => {
            report(&Status::Error(msg));
            1
        }
    };
    flush(out);
    code
}

fn run(request: &[u8], policy: &SeccompPolicy, out: RawFd) -> Result<(), String> {
    let req: HelperRequest =
        serde_json::from_slice(request).map_err(|e| format!("helper: parse request: {e}"))?;
    // The sandbox's tasks run at nice 0 whatever the zygote's nice (it inherited the
    // nice of the thread that started it): a sandbox's priority against the others is its
    // cgroup's CPU weight (`spawn` scales it by the spawning thread's nice), since the
    // scheduler weighs cgroups against each other, not their tasks' nice. A task's nice
    // would only order it against its own sandbox's tasks, show in its `ps`, and pass to
    // every process the user starts, who could not lower it again; and a claim would
    // have to renice every task of the sandbox (round 25 of docs/bench.md).
    // SAFETY: no memory arguments; who 0 = this (single-threaded) process.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 0) } != 0 {
        return Err(format!(
            "helper: nice 0: {}",
            std::io::Error::last_os_error()
        ));
    }
    let spec = req.spec;
    spec.validate().map_err(|e| e.to_string())?;
    if let Some(pid) = req.reroot {
        return crate::reroot::run(&spec, pid);
    }

    if let Some(limit) = spec.open_files {
        crate::fd_limit::set(limit).map_err(|e| format!("open-files limit {limit:?}: {e}"))?;
    }
    let cg = Cgroup::handle(&spec.id).map_err(|e| e.to_string())?;
    // (The zygote cloned this helper into its cgroup's `clone_target`.)
    cg.join_single_threaded()
        .map_err(|e| format!("join cgroup: {e}"))?;
    mark("helper_in_cgroup");

    let (parent_sock, child_sock) =
        cubicle_syscalls::socket::seqpacket_pair().map_err(|e| format!("socketpair: {e}"))?;
    // The child inherits this working directory and reaches its upper/work/staging
    // directories relative to it: the state directory above stays root-only (0700).
    std::env::set_current_dir(&spec.sandbox_dir)
        .map_err(|e| format!("chdir {}: {e}", spec.sandbox_dir.display()))?;

    let flags = libc::CLONE_NEWUSER
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWNS
        | libc::CLONE_NEWNET
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWCGROUP
        | libc::CLONE_PARENT;
    // SAFETY: this process is single-threaded (a fork of the single-threaded zygote), so a fork-like
    // clone (no new stack: the child continues on a copy of ours) is as safe as fork().
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            (flags | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    if pid < 0 {
        return Err(format!(
            "clone with new namespaces: {}",
            std::io::Error::last_os_error()
        ));
    }
    if pid == 0 {
        drop(parent_sock);
        crate::child::main(&spec, &cg.inner_mounts(), policy, child_sock, out);
    }
    let pid = pid as i32;
    drop(child_sock);
    report(&Status::Pid(pid));
    mark("cloned");

    let res = release_child(&spec, pid, &parent_sock);
    if res.is_err() {
        // SAFETY: kill with integer arguments. The caller reaps it (it is the caller's child).
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    res
}

/// The message that releases the child with its mounts: template layers, binds, and
/// with [`GO_WITH_SYSFS`] the shared sysfs last.
pub(crate) const GO: &[u8] = b"go";
/// [`GO`], with the shared sysfs as the last descriptor.
pub(crate) const GO_WITH_SYSFS: &[u8] = b"go sysfs";

fn release_child(spec: &SandboxSpec, pid: i32, sock: &OwnedFd) -> Result<(), String> {
    let map = format!("0 {} {}\n", spec.uid_base, spec.uid_count);
    for file in ["uid_map", "gid_map"] {
        let path = format!("/proc/{pid}/{file}");
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|mut f| f.write_all(map.as_bytes()))
            .map_err(|e| format!("write {path} ({}): {e}", map.trim()))?;
    }
    mark("id_maps_written");

    let userns = std::fs::File::open(format!("/proc/{pid}/ns/user"))
        .map_err(|e| format!("open child user namespace: {e}"))?;
    // One idmapped, read-only clone per template layer (bottom first), then the bind
    // sources.
    let mut fds = spec
        .lowers()
        .into_iter()
        .map(|layer| idmapped_layer(layer, userns.as_raw_fd()))
        .collect::<Result<Vec<_>, _>>()?;
    for b in spec.all_binds() {
        fds.push(bind_source(&b, userns.as_raw_fd()).map_err(|e| e.to_string())?);
    }
    // Last, when there is one: the shared sysfs (`shared_sysfs.rs`) for its /sys.
    let go: &[u8] = match crate::shared_sysfs::clone() {
        Some(sysfs) => {
            fds.push(sysfs.map_err(|e| format!("clone the shared sysfs: {e}"))?);
            GO_WITH_SYSFS
        }
        None => GO,
    };
    mark("mounts_prepared");
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    sys::send_with_fds(sock.as_raw_fd(), go, &raw).map_err(|e| format!("release child: {e}"))?;
    Ok(())
}

/// A detached clone of bind `b`'s source, nosuid and nodev (read-only if `b` says so),
/// its owners mapped through the user namespace `userns` when `b.idmapped` (a volume: the
/// sandbox's uid N reads and writes the volume's uid N). The one way a bind mount of a
/// sandbox is made: at spawn (here), on a running sandbox (`attach.rs`) and for a restore
/// (`restore.rs`, with the restore's user namespace, which has the sandbox's id map).
pub(crate) fn bind_source(b: &BindMount, userns: RawFd) -> crate::error::Result<OwnedFd> {
    use crate::error::Error;
    let fd = sys::open_tree_clone(&b.source)
        .map_err(|e| Error::io(format!("bind source {}", b.source.display()), e))?;
    let mut attrs = sys::MOUNT_ATTR_NOSUID | sys::MOUNT_ATTR_NODEV;
    if b.readonly {
        attrs |= sys::MOUNT_ATTR_RDONLY;
    }
    let ns = if b.idmapped {
        attrs |= sys::MOUNT_ATTR_IDMAP;
        Some(userns)
    } else {
        None
    };
    sys::mount_setattr(&fd, attrs, ns)
        .map_err(|e| Error::io(format!("bind source {} attributes", b.source.display()), e))?;
    Ok(fd)
}

/// One template layer (the rootfs or a layer above it) as a detached, read-only, nodev
/// mount whose ids are mapped through the user namespace `userns` (host uid 0 appears as
/// the sandbox's root).
pub(crate) fn idmapped_layer(rootfs: &std::path::Path, userns: RawFd) -> Result<OwnedFd, String> {
    let lower =
        sys::open_tree_clone(rootfs).map_err(|e| format!("open_tree {}: {e}", rootfs.display()))?;
    sys::mount_setattr(
        &lower,
        sys::MOUNT_ATTR_IDMAP | sys::MOUNT_ATTR_RDONLY | sys::MOUNT_ATTR_NODEV,
        Some(userns),
    )
    .map_err(|e| {
        format!(
            "idmap {} into the sandbox's user namespace: {e}",
            rootfs.display()
        )
    })?;
    Ok(lower)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines() {
        assert_eq!(Status::parse("pid 42"), Some(Status::Pid(42)));
        assert_eq!(
            Status::parse("t cloned 123"),
            Some(Status::Time("cloned".into(), 123))
        );
        assert_eq!(
            Status::parse("error overlay: boom x"),
            Some(Status::Error("overlay: boom x".into()))
        );
        assert_eq!(Status::parse("junk"), None);
        assert_eq!(Status::parse("pid x"), None);
    }
}
