//! Dumping a running sandbox: freeze it, save its staging tmpfs, have CRIU write its
//! process tree (memory, files, sockets, namespaces) into a directory, then either let it
//! run on (a snapshot, a fork) or let CRIU kill it (a pause).
//!
//! The order matters for consistency: everything is captured while the cgroup is frozen,
//! so the tmpfs contents, the processes' memory and — captured by the caller inside
//! [`DumpRequest::while_frozen`] — the writable layer all show the same instant.

use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cubicle_runtime::restore::external_mounts;
use cubicle_runtime::{Cgroup, SandboxSpec};

use crate::criu::{self, Criu};
use crate::error::{Error, Result, is_no_space_errno};
use crate::meta::{FORMAT, Meta, Stdio, TMPFS_FILE};
use crate::rpc;

/// CRIU's log of a dump, inside the checkpoint directory.
pub const DUMP_LOG: &str = "criu-dump.log";

/// How long the sandbox may take to freeze.
const FREEZE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a dump waits for the vforks the freeze caught to end.
const VFORK_WAIT: Duration = Duration::from_secs(1);

/// What to dump.
pub struct DumpRequest<'a> {
    /// The sandbox as it was made (its mounts decide what is external).
    pub spec: &'a SandboxSpec,
    /// Host pid of its init.
    pub init_pid: i32,
    /// The checkpoint directory to create (must not exist; its parent must).
    pub dir: &'a Path,
    /// Keep the sandbox running afterwards (snapshot, fork); else CRIU kills it (pause).
    pub leave_running: bool,
    /// Called while the sandbox is frozen, after CRIU wrote the images (e.g. to snapshot
    /// its writable layer at the same instant). An error fails the dump.
    pub while_frozen: Option<&'a mut dyn FnMut() -> Result<()>>,
}

/// How a dump went.
#[derive(Clone, Debug, Default)]
pub struct DumpReport {
    /// How long the sandbox was frozen (stopped).
    pub frozen: Duration,
    /// Wall time of the whole dump.
    pub total: Duration,
    /// Bytes written (images and tmpfs contents).
    pub bytes: u64,
    /// Time from the start to the end of each step (`frozen`, `tmpfs_saved`, `criu_done`,
    /// `thawed`).
    pub phases: Vec<(String, Duration)>,
}

/// Dumps the sandbox. On failure nothing is left in `dir` and the sandbox runs on.
pub fn dump(criu: &Criu, req: DumpRequest<'_>) -> Result<DumpReport> {
    let t0 = Instant::now();
    let spec = req.spec;
    let cg = Cgroup::handle(&spec.id)?;
    fs::DirBuilder::new()
        .mode(0o700)
        .create(req.dir)
        .map_err(|e| Error::io(format!("create {}", req.dir.display()), e))?;
    dump_in(criu, &cg, req, t0)
}

fn dump_in(criu: &Criu, cg: &Cgroup, mut req: DumpRequest<'_>, t0: Instant) -> Result<DumpReport> {
    let spec = req.spec;
    let dir = req.dir;
    let cleanup = |e: Error| {
        let _ = fs::remove_dir_all(dir);
        e
    };
    let present = mount_points(req.init_pid).map_err(cleanup)?;
    let externals: Vec<_> = external_mounts(spec)
        .map_err(|e| cleanup(e.into()))?
        .into_iter()
        .filter(|e| present.contains(&e.mountpoint))
        .collect();
    let stdio = stdio_of(req.init_pid).map_err(cleanup)?;
    // CRIU starts now and waits for its request: its start-up overlaps the wait for the
    // outside connections instead of lengthening the freeze.
    let swrk = criu.start_swrk().map_err(cleanup)?;
    let mut phases = vec![("inspected".to_string(), t0.elapsed())];
    let outside = wait_outside_connections(cg, req.init_pid, OUTSIDE_WAIT);
    if !outside.is_empty() {
        tracing::warn!(sandbox = %spec.id, ?outside, "connections from outside the sandbox are still open; dumping anyway");
    }
    phases.push(("outside_closed".to_string(), t0.elapsed()));
    freeze_outside_vfork(cg, &spec.id).map_err(cleanup)?;
    let t_frozen = Instant::now();
    phases.push(("frozen".to_string(), t0.elapsed()));
    let writable_ctl = std::cell::Cell::new(false);
    let mut swrk = Some(swrk);
    let res = (|| -> Result<(u64, Option<Instant>)> {
        // Recorded writable, so that a restore can bind envd's socket in it again (the
        // restore seals it before anything runs); nothing runs while it is.
        cubicle_runtime::set_ctl_dir_readonly(req.init_pid, false)?;
        writable_ctl.set(true);
        let root = PathBuf::from(format!("/proc/{}/root", req.init_pid));
        let sections: Vec<(PathBuf, String)> = externals
            .iter()
            .filter_map(|e| {
                e.source.is_writable_staging().map(|d| {
                    (
                        root.join(e.mountpoint.strip_prefix("/").unwrap_or(&e.mountpoint)),
                        d.to_string(),
                    )
                })
            })
            .collect();
        let tmpfs_bytes = crate::archive::save(&sections, spec.uid_base, &dir.join(TMPFS_FILE))
            .map_err(|e| no_space(&spec.id, e))?;

        let mut external: Vec<String> = externals
            .iter()
            .map(|e| {
                let mp = e.mountpoint.display();
                format!("mnt[{mp}]:{mp}")
            })
            .collect();
        if let Some(Stdio::File { key, .. }) = &stdio {
            external.push(key.clone());
        }
        let opts = rpc::Opts {
            images_dir_fd: -1,
            images_dir: Some(dir.display().to_string()),
            pid: Some(req.init_pid),
            leave_running: Some(req.leave_running),
            tcp_established: Some(true),
            file_locks: Some(true),
            log_level: Some(criu.log_level()),
            log_file: Some(DUMP_LOG.into()),
            external,
            // The network namespace is re-created empty and configured by Cubicle.
            empty_ns: Some(libc::CLONE_NEWNET as u32),
            freeze_cgroup: Some(cg.freezer_dir().display().to_string()),
            manage_cgroups_mode: Some(rpc::CgMode::Soft as i32),
            // The sandbox's own controllers only (the others are the host's, inherited).
            cgroup_dump_controller: cg.controllers().iter().map(|c| c.to_string()).collect(),
            // Frozen and about to be killed or left as is: nothing to lock (and this
            // host has no iptables).
            network_lock: Some(rpc::NetworkLock::Skip as i32),
            orphan_pts_master: Some(true),
            ..Default::default()
        };
        // The record goes first: a pause's CRIU kills the sandbox when it is done (with
        // its TCP sockets still in repair mode, so peers see nothing), and from then on
        // nothing may fail for want of disk, nor may a crash of the node leave complete
        // images without their record (reconciliation keeps a sandbox whose processes are
        // gone as paused when this file is there). A failed dump removes it with the rest.
        let mut meta = Meta {
            format: FORMAT,
            sandbox_id: spec.id.clone(),
            uid_base: spec.uid_base,
            externals: externals.iter().map(|e| e.mountpoint.clone()).collect(),
            stdio: stdio.clone(),
            created_at_ms: now_ms(),
            image_bytes: 0,
        };
        meta.write(dir).map_err(|e| no_space(&spec.id, e))?;
        let swrk = swrk
            .take()
            .ok_or_else(|| Error::io("criu", std::io::ErrorKind::NotConnected.into()))?;
        run_dump(swrk, opts, &spec.id, dir)?;
        phases.push(("criu_done".to_string(), t0.elapsed()));
        // Informational; the record above is already complete.
        meta.image_bytes = dir_size(dir);
        let _ = meta.write(dir);
        if let Some(f) = req.while_frozen.as_mut() {
            f()?;
        }
        let thawed = if req.leave_running {
            cubicle_runtime::set_ctl_dir_readonly(req.init_pid, true)?;
            cg.thaw()?;
            Some(Instant::now())
        } else {
            None
        };
        Ok((tmpfs_bytes, thawed))
    })();
    let (tmpfs_bytes, thawed) = match res {
        Ok(v) => v,
        Err(e) => {
            // Never thawed with a writable ctl directory: left frozen if that fails.
            match writable_ctl.get() {
                true => match cubicle_runtime::set_ctl_dir_readonly(req.init_pid, true) {
                    Ok(()) => drop(cg.thaw()),
                    Err(e) => {
                        tracing::error!(sandbox = %spec.id, "left frozen: its ctl directory stays writable: {e}")
                    }
                },
                false => drop(cg.thaw()),
            }
            // Keep CRIU's log for the operator next to the failed checkpoint's name.
            let log = dir.join(DUMP_LOG);
            if log.exists() {
                let _ = fs::copy(&log, dir.with_extension("failed-dump.log"));
            }
            return Err(cleanup(e));
        }
    };
    let image_bytes = dir_size(dir);
    let end = Instant::now();
    if let Some(t) = thawed {
        phases.push(("thawed".to_string(), t - t0));
    }
    Ok(DumpReport {
        frozen: thawed.unwrap_or(end) - t_frozen,
        total: end - t0,
        bytes: image_bytes + tmpfs_bytes,
        phases,
    })
}

/// Freezes the sandbox with none of its threads inside vfork(). CRIU stops a vfork's
/// child before its exec and then waits for the parent to stop, which it cannot until
/// the child execs or exits: the dump would hang until CRIU's timeout and fail. A vfork
/// lasts the instant between a shell's or `posix_spawn`'s vfork and the child's exec, so
/// the freeze catching one is let go on (thawed, a moment, frozen again) until none is
/// caught; one held longer than [`VFORK_WAIT`] fails the dump, thawed.
fn freeze_outside_vfork(cg: &Cgroup, id: &str) -> Result<()> {
    let t0 = Instant::now();
    loop {
        cg.freeze(FREEZE_TIMEOUT)?;
        let tids = in_vfork(cg);
        if tids.is_empty() {
            return Ok(());
        }
        cg.thaw()?;
        if t0.elapsed() >= VFORK_WAIT {
            return Err(Error::InVfork {
                id: id.to_string(),
                tids,
                waited: t0.elapsed(),
            });
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The host thread ids of the sandbox's threads waiting inside vfork() for their child
/// (asleep in `wait_for_vfork_done`, which the kernel may inline into `kernel_clone`).
/// A thread that cannot be read (gone meanwhile) is none.
fn in_vfork(cg: &Cgroup) -> Vec<i32> {
    let mut tids = Vec::new();
    for pid in cg.procs().unwrap_or_default() {
        let Ok(threads) = fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for t in threads.flatten() {
            let Ok(wchan) = fs::read_to_string(t.path().join("wchan")) else {
                continue;
            };
            if matches!(wchan.trim(), "wait_for_vfork_done" | "kernel_clone")
                && let Some(tid) = t.file_name().to_str().and_then(|n| n.parse().ok())
            {
                tids.push(tid);
            }
        }
    }
    tids
}

fn run_dump(swrk: criu::Swrk, opts: rpc::Opts, id: &str, dir: &Path) -> Result<()> {
    let req = rpc::Req {
        r#type: rpc::ReqType::Dump as i32,
        opts: Some(opts),
        notify_success: None,
    };
    let (res, detail) = swrk.run(&req, &mut |_, _| Ok(()));
    let log = criu::log_tail(dir, DUMP_LOG, 6);
    let resp = res.map_err(|e| Error::Criu {
        action: "dump",
        message: format!("{e} {detail}"),
        log: log.clone(),
    })?;
    if !resp.success {
        let errno = resp.cr_errno.unwrap_or(0);
        let message = crate::restore::criu_message(resp.cr_errmsg.clone(), resp.cr_errno);
        let io = std::io::Error::from_raw_os_error(errno);
        if is_no_space_errno(&io) || log.contains("No space left") || log.contains("quota exceeded")
        {
            return Err(Error::NoSpace {
                id: id.to_string(),
                detail: format!("{message}{log}"),
            });
        }
        return Err(Error::Criu {
            action: "dump",
            message,
            log,
        });
    }
    Ok(())
}

fn no_space(id: &str, e: Error) -> Error {
    if e.is_no_space() {
        Error::NoSpace {
            id: id.to_string(),
            detail: e.to_string(),
        }
    } else {
        e
    }
}

/// How long a dump waits for connections from outside to close.
const OUTSIDE_WAIT: Duration = Duration::from_secs(5);

/// Waits (up to `limit`) until no process of the sandbox holds a socket of another network
/// namespace — the far end of a connection from the host (a Unix socket accepted from a
/// client outside belongs to the client's namespace). CRIU cannot dump those; the caller
/// closes its side first (the router drains the sandbox's connections) and the sandbox's
/// side goes as soon as its owner reads the end. Returns those left, as
/// `<command>[<pid>] fd <n>`.
fn wait_outside_connections(cg: &Cgroup, init: i32, limit: Duration) -> Vec<String> {
    let deadline = Instant::now() + limit;
    loop {
        let left = outside_sockets(cg, init);
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn outside_sockets(cg: &Cgroup, init: i32) -> Vec<String> {
    // (file, column of the inode) in /proc/<pid>/net: the sockets of the sandbox's netns.
    const TABLES: &[(&str, usize)] = &[
        ("unix", 6),
        ("tcp", 9),
        ("tcp6", 9),
        ("udp", 9),
        ("udp6", 9),
        ("raw", 9),
        ("raw6", 9),
        ("udplite", 9),
        ("udplite6", 9),
        ("netlink", 9),
        ("packet", 8),
    ];
    let mut inside = std::collections::HashSet::new();
    for (name, col) in TABLES {
        if let Ok(text) = fs::read_to_string(format!("/proc/{init}/net/{name}")) {
            for line in text.lines().skip(1) {
                if let Some(ino) = line
                    .split_whitespace()
                    .nth(*col)
                    .and_then(|v| v.parse::<u64>().ok())
                {
                    inside.insert(ino);
                }
            }
        }
    }
    let mut outside = Vec::new();
    for pid in cg.procs().unwrap_or_default() {
        let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(t) = fs::read_link(fd.path()) else {
                continue;
            };
            let t = t.to_string_lossy();
            if let Some(ino) = t
                .strip_prefix("socket:[")
                .and_then(|r| r.strip_suffix(']'))
                .and_then(|v| v.parse::<u64>().ok())
                && !inside.contains(&ino)
            {
                let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                outside.push(format!(
                    "{}[{pid}] fd {}",
                    comm.trim(),
                    fd.file_name().to_string_lossy()
                ));
            }
        }
    }
    outside
}

/// Mount points of the sandbox as its init sees them.
fn mount_points(pid: i32) -> Result<Vec<PathBuf>> {
    let p = format!("/proc/{pid}/mountinfo");
    let text = fs::read_to_string(&p).map_err(|e| Error::io(format!("read {p}"), e))?;
    Ok(cubicle_syscalls::mountinfo::parse(&text)
        .into_iter()
        .map(|m| m.mount_point)
        .collect())
}

/// How the init's stdout is connected: a pipe, or a host file outside the sandbox.
fn stdio_of(pid: i32) -> Result<Option<Stdio>> {
    let link = format!("/proc/{pid}/fd/1");
    let target = match fs::read_link(&link) {
        Ok(t) => t,
        Err(_) => return Ok(None),
    };
    let t = target.to_string_lossy();
    if let Some(ino) = t.strip_prefix("pipe:[") {
        return Ok(Some(Stdio::Pipe {
            key: format!("pipe:[{}", ino),
        }));
    }
    if !t.starts_with('/') {
        return Ok(None);
    }
    let md = fs::metadata(&link).map_err(|e| Error::io(format!("stat {link}"), e))?;
    let fdinfo = fs::read_to_string(format!("/proc/{pid}/fdinfo/1"))
        .map_err(|e| Error::io(format!("read /proc/{pid}/fdinfo/1"), e))?;
    let mnt_id: u64 = fdinfo
        .lines()
        .find_map(|l| l.strip_prefix("mnt_id:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| {
            Error::io(
                "fdinfo without mnt_id",
                std::io::ErrorKind::InvalidData.into(),
            )
        })?;
    Ok(Some(Stdio::File {
        key: format!("file[{mnt_id:x}:{:x}]", md.ino()),
        mode: md.mode(),
    }))
}

pub(crate) fn dir_size(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.blocks() * 512)
        .sum()
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_stdio_is_described() {
        // This test process's stdout is a pipe, a file or a tty; whatever it is, the
        // description is consistent with it.
        let me = std::process::id() as i32;
        match stdio_of(me).unwrap() {
            Some(Stdio::Pipe { key }) => assert!(key.starts_with("pipe:[") && key.ends_with(']')),
            Some(Stdio::File { key, .. }) => assert!(key.starts_with("file[")),
            None => {}
        }
    }
}
