//! Restoring a sandbox from a checkpoint directory.
//!
//! The caller (a node, multi-threaded) never forks itself: like `spawn`, a restore
//! re-executes the current binary as a single-threaded *restore helper*
//! ([`HELPER_ARG`]), which
//!
//! 1. enters a private mount namespace with the kernel-feature cache on `/run` and
//!    reports `ns`: the caller starts `criu swrk` in that namespace at once (its exec and
//!    start-up overlap the next step);
//! 2. builds the root and the external mounts' sources (`cubicle_runtime::restore`),
//!    writing the saved staging tmpfs back;
//! 3. reports `ok <sources as JSON>` on its status pipe (or `error <message>`) and exits
//!    (the namespace lives on with CRIU in it).
//!
//! Beside it the caller starts a *mounter* ([`MOUNTER_ARG`], the current binary again,
//! single-threaded, its child), which waits on its stdin for the restored init's pid.
//! The caller then sends the restore request and answers CRIU's notifications: at
//! `setup-namespaces` (the sandbox's namespaces exist, nothing is restored in them yet)
//! it has the mounter mount the overlay root from the sandbox's own user namespace
//! (`cubicle_runtime::restore::mount_restore_overlay`: setuid programs work only then),
//! then connects the new network namespace ([`RestoreRequest::on_namespaces`]); at
//! `pre-resume` (everything restored, nothing running yet) it makes the ctl directory
//! read-only again (`cubicle_runtime::set_ctl_dir_readonly`: CRIU needs it writable to bind the
//! init's socket there again). CRIU
//! restores the init as a sibling of itself (`rst_sibling`), i.e. as a child of the
//! caller, like `spawn` does; the helper's mount namespace goes away with CRIU.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio as ProcStdio};
use std::time::{Duration, Instant};

use cubicle_runtime::{Cgroup, SandboxSpec};
use serde::{Deserialize, Serialize};

use crate::criu::{self, Criu, FD_STDIO};
use crate::error::{Error, Result};
use crate::meta::{Meta, Stdio, TMPFS_FILE};
use crate::rpc;

/// argv[1] that turns the current binary into the restore helper.
pub const HELPER_ARG: &str = "__cubicle-checkpoint-restore-helper__";

/// CRIU's log of a restore, inside the checkpoint directory.
pub const RESTORE_LOG: &str = "criu-restore.log";

/// Where the helper mounts the external mounts' sources (on its private `/run` tmpfs).
const SOURCES_DIR: &str = "/run/cubicle-restore";

/// argv[1] that turns the current binary into the restore's mounter.
pub const MOUNTER_ARG: &str = "__cubicle-checkpoint-restore-mounter__";

/// How long a restore may take before it is given up.
const RESTORE_TIMEOUT: Duration = Duration::from_secs(60);

/// What to restore.
pub struct RestoreRequest<'a> {
    /// The sandbox to be: id, uid range, directories, limits, binds (the checkpoint's
    /// sandbox, or a new one for a fork or a sandbox made from a snapshot).
    pub spec: &'a SandboxSpec,
    /// The checkpoint directory (this restore's own: a restore on another uid range
    /// rewrites the user namespace image in it).
    pub dir: &'a Path,
    /// Where envd's stdout and stderr go (its log).
    pub stdio: Option<OwnedFd>,
    /// Called with the init's host pid once its namespaces exist and before anything is
    /// restored in them: connect the network namespace (loopback up, veth).
    pub on_namespaces: &'a mut dyn FnMut(i32) -> Result<()>,
}

/// A restored sandbox.
#[derive(Clone, Debug)]
pub struct Restored {
    /// Host pid of its init (a child of the caller).
    pub pid: i32,
    /// Time spent in each phase (`helper`, `criu`, `total`).
    pub timings: Vec<(String, Duration)>,
}

/// What the caller sends the helper on stdin.
#[derive(Serialize, Deserialize)]
struct HelperRequest {
    spec: SandboxSpec,
    dir: PathBuf,
    externals: Vec<PathBuf>,
    kdat: PathBuf,
}

/// The error of a restore helper that answered `line` instead of what it should have
/// (its `error <message>`, or what it wrote on stderr); kills and reaps it.
fn helper_failed(child: &mut std::process::Child, line: &str) -> Error {
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = child.kill();
        let _ = e.read_to_string(&mut err);
    }
    let _ = child.kill();
    let _ = child.wait();
    let msg = match line.trim_end().split_once(' ') {
        Some(("error", m)) => m.to_string(),
        _ => format!("restore helper failed: {}", err.trim()),
    };
    Error::Criu {
        action: "restore",
        message: msg,
        log: String::new(),
    }
}

/// Restores the sandbox. Its writable layer (`spec.upper_dir()`) must be the state that
/// belongs with the checkpoint. On failure the sandbox's processes are gone; its cgroup
/// and directories are the caller's to remove.
pub fn restore(criu: &Criu, req: RestoreRequest<'_>) -> Result<Restored> {
    let t0 = Instant::now();
    let spec = req.spec;
    let meta = Meta::read(req.dir)?;
    if meta.sandbox_id != spec.id {
        crate::rebase::rewrite_hostname(req.dir, &spec.hostname)?;
    }
    if meta.uid_base != spec.uid_base {
        crate::rebase::rewrite_userns_images(
            req.dir,
            meta.uid_base,
            spec.uid_base,
            spec.uid_count,
        )?;
        crate::rebase::rebase_owners(
            &spec.upper_dir(),
            meta.uid_base,
            spec.uid_base,
            spec.uid_count,
        )?;
        crate::rebase::rebase_owners(
            &spec.work_dir(),
            meta.uid_base,
            spec.uid_base,
            spec.uid_count,
        )?;
        // What the restore reads from now on is on the new range.
    }
    if meta.uid_base != spec.uid_base || meta.sandbox_id != spec.id {
        let mut m = meta.clone();
        m.uid_base = spec.uid_base;
        m.sandbox_id = spec.id.clone();
        m.write(req.dir)?;
    }
    // The restored sandbox's root task reads some images itself, through the directory's
    // descriptor, first with the host root's uid (before it switches credentials), later
    // with the sandbox root's: owner root, group the sandbox's root, 0750.
    std::os::unix::fs::chown(req.dir, Some(0), Some(spec.uid_base))
        .and_then(|()| {
            std::fs::set_permissions(req.dir, std::os::unix::fs::PermissionsExt::from_mode(0o750))
        })
        .map_err(|e| Error::io(format!("chown {}", req.dir.display()), e))?;
    let cg = Cgroup::create(&spec.id, &spec.limits)?;
    let res = restore_in(criu, req, &meta, &cg, t0);
    if res.is_err() {
        let _ = cg.kill_all();
    }
    res
}

fn restore_in(
    criu: &Criu,
    req: RestoreRequest<'_>,
    meta: &Meta,
    cg: &Cgroup,
    t0: Instant,
) -> Result<Restored> {
    let spec = req.spec;
    let dir = req.dir;
    let helper_req = HelperRequest {
        spec: spec.clone(),
        dir: dir.to_path_buf(),
        externals: meta.externals.clone(),
        kdat: criu.kdat_cache().to_path_buf(),
    };
    let mut cmd = Command::new("/proc/self/exe");
    cmd.arg0("cubicle-restore-helper")
        .arg(HELPER_ARG)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(ProcStdio::piped())
        .stdout(ProcStdio::piped())
        .stderr(ProcStdio::piped());
    let mut mounter = Mounter::start(spec)?;
    let mut child = cmd
        .spawn()
        .map_err(|e| Error::io("start the restore helper (/proc/self/exe)", e))?;
    let body = serde_json::to_vec(&helper_req).map_err(|e| Error::Image {
        dir: dir.to_path_buf(),
        message: format!("encode the helper request: {e}"),
    })?;
    // The request is one line; stdin then stays open until CRIU has started in the
    // helper's mount namespace: the helper waits for its end before it exits, so the
    // namespace (and the root it builds there) outlives the helper's own work however
    // late this process gets to open it (a loaded host once let the helper finish first:
    // "open /proc/PID/ns/mnt: No such file or directory").
    let mut stdin = child.stdin.take();
    if let Some(w) = stdin.as_mut() {
        let _ = w.write_all(&body);
        let _ = w.write_all(b"\n");
        let _ = w.flush();
    }
    let mut out = child.stdout.take().map(BufReader::new);
    let mut read_line = || {
        let mut line = String::new();
        if let Some(o) = out.as_mut() {
            let _ = o.read_line(&mut line);
        }
        line
    };
    // `ns`: the helper's private mount namespace exists; CRIU starts in it now and loads
    // while the helper builds the root.
    let first = read_line();
    let swrk = match first.trim_end() {
        "ns" => {
            let path = format!("/proc/{}/ns/mnt", child.id());
            let ns = std::fs::File::open(&path)
                .map(OwnedFd::from)
                .map_err(|e| Error::io(format!("open {path}"), e));
            ns.and_then(|ns| criu.start_swrk_in(&ns, req.stdio.as_ref().map(|s| s.as_raw_fd())))
        }
        _ => Err(helper_failed(&mut child, &first)),
    };
    drop(stdin);
    let swrk = match swrk {
        Ok(s) => s,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
    };
    let status_line = read_line();
    let t_helper = t0.elapsed();
    let sources: BTreeMap<PathBuf, PathBuf> = match status_line.trim_end().split_once(' ') {
        Some(("ok", json)) => {
            let _ = child.wait();
            serde_json::from_str(json).map_err(|e| Error::Image {
                dir: dir.to_path_buf(),
                message: format!("restore helper answered nonsense: {e}"),
            })?
        }
        _ => return Err(helper_failed(&mut child, &status_line)),
    };

    let mut external: Vec<String> = sources
        .iter()
        .map(|(mp, src)| format!("mnt[{}]:{}", mp.display(), src.display()))
        .collect();
    let mut inherit_fd = Vec::new();
    match (&meta.stdio, &req.stdio) {
        (Some(Stdio::Pipe { key }), Some(_)) => inherit_fd.push(rpc::InheritFd {
            key: key.clone(),
            fd: FD_STDIO,
        }),
        // An external file is named `file[mnt:ino]` in the images, and CRIU hands an
        // inherited descriptor to a regular file whose *path* matches the key — a file's
        // path being its name without the leading character (the `/`, for a real path;
        // CRIU's `--inherit-fd fd[N]:path/to/file` form). Keyed by the `file[…]` form
        // itself, CRIU would re-open the file through /proc as the restored task, which
        // may not open the host's log.
        (Some(Stdio::File { key, .. }), Some(_)) => inherit_fd.push(rpc::InheritFd {
            key: key.get(1..).unwrap_or_default().to_string(),
            fd: FD_STDIO,
        }),
        _ => {}
    }
    let root = spec.mount_dir().join("root");
    let mut cg_root: Vec<rpc::CgroupRoot> = cg
        .controllers()
        .into_iter()
        .map(|c| rpc::CgroupRoot {
            ctrl: Some(c.to_string()),
            path: format!("/{}/{}", cubicle_runtime::cgroup::PARENT, spec.id),
        })
        .collect();
    if cg_root.is_empty() {
        cg_root.push(rpc::CgroupRoot {
            ctrl: None,
            path: format!("/{}/{}", cubicle_runtime::cgroup::PARENT, spec.id),
        });
    }
    external.sort();
    let opts = rpc::Opts {
        images_dir_fd: -1,
        images_dir: Some(dir.display().to_string()),
        tcp_established: Some(true),
        file_locks: Some(true),
        log_level: Some(criu.log_level()),
        log_file: Some(RESTORE_LOG.into()),
        notify_scripts: Some(true),
        root: Some(root.display().to_string()),
        cg_root,
        rst_sibling: Some(true),
        inherit_fd,
        manage_cgroups_mode: Some(rpc::CgMode::Soft as i32),
        // The host's mounts, rather than CRIU mounting every hierarchy per restore.
        cgroup_yard: cg.criu_yard().map(|p| p.display().to_string()),
        external,
        empty_ns: Some(libc::CLONE_NEWNET as u32),
        timeout: Some(RESTORE_TIMEOUT.as_secs() as u32),
        orphan_pts_master: Some(true),
        ..Default::default()
    };
    let rq = rpc::Req {
        r#type: rpc::ReqType::Restore as i32,
        opts: Some(opts),
        notify_success: None,
    };
    let on_ns = req.on_namespaces;
    let mut init_pid = None;
    let (res, detail) = swrk.run(&rq, &mut |script, pid| match script {
        "setup-namespaces" => {
            init_pid = Some(pid);
            mounter.mount(pid)?;
            on_ns(pid)
        }
        // CRIU re-bound the init's socket in the ctl directory, which it was given
        // writable: read-only again before anything of the sandbox runs.
        "pre-resume" => match init_pid {
            Some(pid) => cubicle_runtime::set_ctl_dir_readonly(pid, true).map_err(Error::from),
            None => Ok(()),
        },
        _ => Ok(()),
    });
    drop(mounter);
    let t_criu = t0.elapsed();
    let log = criu::log_tail(dir, RESTORE_LOG, 6);
    let resp = res.map_err(|e| Error::Criu {
        action: "restore",
        message: format!("{e} {detail}"),
        log: log.clone(),
    })?;
    if !resp.success {
        return Err(Error::Criu {
            action: "restore",
            message: criu_message(resp.cr_errmsg, resp.cr_errno),
            log,
        });
    }
    let pid = resp.restore.map(|r| r.pid).ok_or_else(|| Error::Criu {
        action: "restore",
        message: "criu reported success without a pid".into(),
        log: String::new(),
    })?;
    // CRIU's view of the pid is the host's (it runs in the host's pid namespace).
    Ok(Restored {
        pid,
        timings: vec![
            ("helper".into(), t_helper),
            ("criu".into(), t_criu - t_helper),
            ("total".into(), t0.elapsed()),
        ],
    })
}

/// The restore's mounter, seen from the caller: a child that gets the spec (a JSON line)
/// at once and the restored init's pid (a line) at `setup-namespaces`, and answers `ok`
/// or `error <message>`. A separate process because entering a user namespace takes a
/// single-threaded one; the caller's child, so that the caller reaps it.
struct Mounter {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    stdout: Option<BufReader<std::process::ChildStdout>>,
}

impl Mounter {
    fn start(spec: &SandboxSpec) -> Result<Mounter> {
        let mut child = Command::new("/proc/self/exe")
            .arg0("cubicle-restore-mounter")
            .arg(MOUNTER_ARG)
            .env_clear()
            .stdin(ProcStdio::piped())
            .stdout(ProcStdio::piped())
            .stderr(ProcStdio::null())
            .spawn()
            .map_err(|e| Error::io("start the restore's mounter (/proc/self/exe)", e))?;
        let mut stdin = child.stdin.take();
        let stdout = child.stdout.take().map(BufReader::new);
        let mut line = serde_json::to_vec(spec).map_err(|e| Error::Image {
            dir: spec.sandbox_dir.clone(),
            message: format!("encode the mounter's spec: {e}"),
        })?;
        line.push(b'\n');
        if let Some(s) = stdin.as_mut() {
            // A mounter gone already fails at `mount`, with its own message.
            let _ = s.write_all(&line);
        }
        Ok(Mounter {
            child,
            stdin,
            stdout,
        })
    }

    /// Mounts the overlay root from the namespaces of the restored init `pid`.
    fn mount(&mut self, pid: i32) -> Result<()> {
        let gone = || Error::Criu {
            action: "restore",
            message: "the restore's mounter exited without mounting the root".into(),
            log: String::new(),
        };
        let (Some(stdin), Some(stdout)) = (self.stdin.as_mut(), self.stdout.as_mut()) else {
            return Err(gone());
        };
        stdin
            .write_all(format!("{pid}\n").as_bytes())
            .map_err(|_| gone())?;
        let mut reply = String::new();
        stdout.read_line(&mut reply).map_err(|_| gone())?;
        match reply.trim_end() {
            "ok" => Ok(()),
            r => match r.strip_prefix("error ") {
                Some(m) => Err(Error::Criu {
                    action: "restore",
                    message: m.to_string(),
                    log: String::new(),
                }),
                None => Err(gone()),
            },
        }
    }
}

impl Drop for Mounter {
    /// Ends it (asked or not, it exits on the end of its input) and reaps it.
    fn drop(&mut self) {
        drop(self.stdin.take());
        drop(self.stdout.take());
        let _ = self.child.wait();
    }
}

/// Entry point of the mounter (see [`Mounter`]); never returns.
pub(crate) fn mounter_main() -> ! {
    let mut lines = std::io::stdin().lock().lines();
    let spec: Option<SandboxSpec> = lines
        .next()
        .and_then(|l| l.ok())
        .and_then(|l| serde_json::from_str(&l).ok());
    let pid: Option<i32> = lines
        .next()
        .and_then(|l| l.ok())
        .and_then(|l| l.trim().parse().ok());
    let (Some(spec), Some(pid)) = (spec, pid) else {
        // Not needed (the restore failed before its namespaces existed).
        std::process::exit(0);
    };
    let reply = match cubicle_runtime::restore::mount_restore_overlay(&spec, pid) {
        Ok(()) => "ok".to_string(),
        Err(e) => format!("error {}", e.to_string().replace('\n', " ")),
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{reply}");
    let _ = out.flush();
    std::process::exit(0);
}

/// Entry point of the restore helper process; never returns.
pub(crate) fn helper_main() -> ! {
    let out = std::io::stdout();
    let mut out = out.lock();
    let code = match helper_run() {
        Ok(never) => match never {},
        Err(msg) => {
            let _ = writeln!(out, "error {}", msg.replace('\n', " "));
            1
        }
    };
    let _ = out.flush();
    std::process::exit(code);
}

enum Never {}

fn helper_run() -> std::result::Result<Never, String> {
    let mut input = String::new();
    std::io::stdin()
        .read_line(&mut input)
        .map_err(|e| format!("read request: {e}"))?;
    let req: HelperRequest =
        serde_json::from_str(&input).map_err(|e| format!("parse request: {e}"))?;
    criu::enter_private_run(&req.kdat).map_err(|e| e.to_string())?;
    // The caller starts CRIU in this mount namespace now (working in its `/run`, where
    // CRIU makes its scratch directories, e.g. a cgroup yard).
    {
        let stdout = std::io::stdout();
        let mut o = stdout.lock();
        writeln!(o, "ns").map_err(|e| format!("report: {e}"))?;
        o.flush().map_err(|e| format!("report: {e}"))?;
    }
    // Opened here: the staging tmpfs is filled by root of the sandbox's user namespace,
    // which may not open the (root-only) checkpoint directory.
    let archive_path = req.dir.join(TMPFS_FILE);
    let mut archive = Some(
        std::fs::File::open(&archive_path)
            .map_err(|e| format!("open {}: {e}", archive_path.display()))?,
    );
    let mut fill = |staging: &Path| -> cubicle_runtime::Result<()> {
        let f = archive
            .take()
            .ok_or_else(|| cubicle_runtime::Error::Setup("staging filled twice".into()))?;
        crate::archive::restore(f, &archive_path, staging, 0)
            .map_err(|e| cubicle_runtime::Error::Setup(e.to_string()))
    };
    let root = cubicle_runtime::restore::prepare_restore_root(
        &req.spec,
        &req.externals,
        Path::new(SOURCES_DIR),
        &mut fill,
    )
    .map_err(|e| e.to_string())?;
    let json = serde_json::to_string(&root.sources).map_err(|e| e.to_string())?;
    {
        let stdout = std::io::stdout();
        let mut o = stdout.lock();
        writeln!(o, "ok {json}").map_err(|e| format!("report: {e}"))?;
        o.flush().map_err(|e| format!("report: {e}"))?;
    }
    // Not before the caller has CRIU in this mount namespace (it closes stdin then).
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    std::process::exit(0);
}

/// CRIU's own message for a failure (it reports its first error, which can be a harmless
/// one: then the errno and the log say more).
pub(crate) fn criu_message(msg: Option<String>, errno: Option<i32>) -> String {
    match msg {
        Some(m) if !m.contains("RLIMIT_NOFILE") && !m.trim().is_empty() => m.trim().to_string(),
        _ => match errno.filter(|e| *e != 0) {
            Some(e) => format!("{} (errno {e})", std::io::Error::from_raw_os_error(e)),
            None => "see its log".to_string(),
        },
    }
}
