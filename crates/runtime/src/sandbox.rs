//! [`spawn`] a sandbox from a [`SandboxSpec`], and the [`Sandbox`] handle to watch, kill and
//! destroy it; [`Sandbox::adopt`] and [`reap_orphans`] for reconciliation after a crash.

use std::fs;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt, chown};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::cgroup::{self, Cgroup, CgroupStats};
use crate::error::{Error, Result, io_ctx};
use crate::helper::{HelperRequest, Status};
use crate::spec::SandboxSpec;
use crate::sys;

/// How long [`Sandbox::kill`] waits for a killed init to exit before it freezes and
/// kills the whole cgroup (a frozen v1 cgroup holds its SIGKILLed tasks until thawed).
const INIT_EXIT_GRACE: Duration = Duration::from_millis(200);

/// How long `spawn` waits for the init program to be exec'd before giving up.
const SPAWN_TIMEOUT: Duration = Duration::from_secs(20);

/// A running (or exited, not yet destroyed) sandbox.
///
/// Dropping the handle does NOT stop the sandbox (so a caller can hand it over or crash
/// without killing workloads); call [`destroy`](Self::destroy).
#[derive(Debug)]
pub struct Sandbox {
    id: String,
    pid: i32,
    /// Shared with the node's record of the sandbox ([`Sandbox::shared_pidfd`]): one
    /// descriptor per sandbox, however many parts watch it.
    pidfd: Arc<OwnedFd>,
    cgroup: Cgroup,
    sandbox_dir: PathBuf,
    /// True when this process is the init's parent (spawned here, not adopted).
    is_parent: bool,
    /// `None`: running; `Some(status)`: exited (status `None` when not our child).
    exit: Mutex<Option<Option<ExitStatus>>>,
    timings: Vec<(String, Duration)>,
    /// Read end of the init log FIFO, until the caller takes it.
    init_log: Mutex<Option<OwnedFd>>,
}

/// Creates a sandbox and returns once its init program has been exec'd.
///
/// Blocking (tens of milliseconds): call it from `tokio::task::spawn_blocking` in async
/// code. Creates `<sandbox_dir>/{upper,work,ctl,rootfs}` and the cgroup `cubicle/<id>`,
/// then runs the helper (see the crate docs for the [`maybe_run_helper`](crate::maybe_run_helper)
/// contract). On error everything created here is removed again.
pub fn spawn(spec: &SandboxSpec) -> Result<Sandbox> {
    let start = Instant::now();
    let start_ns = sys::monotonic_ns();
    spec.validate()?;
    let mut timings = Vec::new();
    let existing = Cgroup::handle(&spec.id)?;
    if !existing.procs()?.is_empty() {
        return Err(Error::InvalidSpec(format!(
            "sandbox {} is already running",
            spec.id
        )));
    }
    let created = prepare_dirs(spec)?;
    let cgroup = match Cgroup::create(&spec.id, &spec.limits) {
        Ok(c) => c,
        Err(e) => {
            remove_dirs(&created);
            return Err(e);
        }
    };
    // A sandbox spawned from a thread at nice N weighs against other cgroups as a task
    // at N would: its cgroup's CPU weight is scaled by N (its tasks run at nice 0, see
    // the helper).
    let nice = thread_nice();
    if nice != 0
        && let Err(e) = cgroup.set_cpu_nice(nice)
    {
        let _ = cgroup.remove();
        remove_dirs(&created);
        return Err(e);
    }
    timings.push(("cgroup_created".to_string(), start.elapsed()));

    let (log_reader, log_writer) = match &spec.init_log {
        Some(p) => match crate::init_log::create_init_log(p) {
            Ok((r, w)) => (Some(r), Some(w)),
            Err(e) => {
                let _ = cgroup.remove();
                remove_dirs(&created);
                return Err(io_ctx(|| format!("init log FIFO {}", p.display()))(e));
            }
        },
        None => (None, None),
    };
    let mut pid = None;
    let request = HelperRequest {
        spec: spec.clone(),
        reroot: None,
    };
    let clone_into = cgroup.clone_target();
    let made = run_helper(
        &request,
        log_writer,
        clone_into.as_deref(),
        start_ns,
        &mut pid,
        &mut timings,
    )
    .and_then(|()| {
        pid.map(|_| ())
            .ok_or_else(|| Error::Setup("helper exited without creating the sandbox".into()))
    });
    match made {
        Ok(()) => {}
        Err(e) => {
            let _ = cgroup.kill_all();
            if let Some(p) = pid {
                reap_child(p);
            }
            let _ = cgroup.remove();
            // Only what this call created: an existing upper layer holds the user's data.
            remove_dirs(&created);
            return Err(e);
        }
    }
    let pid = pid.ok_or_else(|| Error::Setup("helper reported no pid".into()))?;
    let pidfd = match cubicle_syscalls::pidfd::pidfd_open(pid) {
        Ok(fd) => Arc::new(fd),
        Err(e) => {
            // A running sandbox nobody could watch or kill safely: remove it again.
            let _ = cgroup.kill_all();
            reap_child(pid);
            let _ = cgroup.remove();
            remove_dirs(&created);
            return Err(io_ctx(|| format!("pidfd_open({pid})"))(e));
        }
    };
    timings.push(("spawn_returned".to_string(), start.elapsed()));
    Ok(Sandbox {
        id: spec.id.clone(),
        pid,
        pidfd,
        cgroup,
        sandbox_dir: spec.sandbox_dir.clone(),
        is_parent: true,
        exit: Mutex::new(None),
        timings,
        init_log: Mutex::new(log_reader),
    })
}

/// Creates the sandbox's private directories with the right owners; returns those that
/// did not exist before.
fn prepare_dirs(spec: &SandboxSpec) -> Result<Vec<PathBuf>> {
    let mut created = Vec::new();
    let res = prepare_dirs_into(spec, &mut created);
    if res.is_err() {
        remove_dirs(&created);
    }
    res.map(|()| created)
}

fn remove_dirs(dirs: &[PathBuf]) {
    for d in dirs.iter().rev() {
        let _ = fs::remove_dir_all(d);
    }
}

fn prepare_dirs_into(spec: &SandboxSpec, created: &mut Vec<PathBuf>) -> Result<()> {
    // The directory itself is the caller's (it may hold the log): never in `created`.
    let dir = &spec.sandbox_dir;
    if !dir.exists() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o711)
            .create(dir)
            .map_err(io_ctx(|| format!("create {}", dir.display())))?;
    }
    fs::set_permissions(dir, fs::Permissions::from_mode(0o711))
        .map_err(io_ctx(|| format!("chmod 0711 {}", dir.display())))?;
    let owned = [
        (spec.upper_dir(), 0o755),
        (spec.work_dir(), 0o700),
        (spec.ctl_dir(), 0o700),
    ];
    for (d, mode) in owned {
        match fs::DirBuilder::new().mode(mode).create(&d) {
            Ok(()) => created.push(d.clone()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_ctx(|| format!("create {}", d.display()))(e)),
        }
        chown(&d, Some(spec.uid_base), Some(spec.uid_base)).map_err(io_ctx(|| {
            format!("chown {} to {}", d.display(), spec.uid_base)
        }))?;
    }
    if !created.contains(&spec.work_dir()) {
        // Booted again over its own directories (a filesystem-only pause's resume).
        crate::rootfs::clear_volatile_marker(spec)?;
    }
    let m = spec.mount_dir();
    match fs::DirBuilder::new().mode(0o755).create(&m) {
        Ok(()) => {
            created.push(m);
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io_ctx(|| format!("create {}", m.display()))(e)),
    }
}

/// Removes what `spawn` created inside the sandbox directory (not the directory itself,
/// which belongs to the caller and may hold logs), whatever the sandbox left in it
/// ([`crate::remove_tree`]).
fn remove_layers(dir: &Path) -> Result<()> {
    for sub in ["upper", "work", "ctl", "rootfs"] {
        let p = dir.join(sub);
        crate::remove_tree::remove_tree(&p)
            .map_err(io_ctx(|| format!("remove {}", p.display())))?;
    }
    Ok(())
}

/// Runs one helper for `request` through the zygote (cloned into the v2 cgroup directory
/// `clone_into`, if given) and reads its status lines to their end: the pid it reports
/// (a spawn's) into `pid_out`, its timings into `timings`.
fn run_helper(
    request: &HelperRequest,
    writer: Option<OwnedFd>,
    clone_into: Option<&Path>,
    start_ns: u64,
    pid_out: &mut Option<i32>,
    timings: &mut Vec<(String, Duration)>,
) -> Result<()> {
    // The helper's stderr, which the sandbox child makes PID 1's stdout and stderr.
    let log = match writer {
        Some(w) => w,
        None => fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .map_err(io_ctx(|| "open /dev/null".into()))?
            .into(),
    };
    let (out, status_writer) = std::io::pipe().map_err(io_ctx(|| "status pipe".into()))?;
    let request = serde_json::to_vec(request)
        .map_err(|e| Error::Setup(format!("encode helper request: {e}")))?;
    let cgroup_dir: Option<OwnedFd> = match clone_into {
        Some(d) => Some(
            fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
                .open(d)
                .map_err(io_ctx(|| format!("open cgroup {}", d.display())))?
                .into(),
        ),
        None => None,
    };
    let helper = crate::zygote::start_helper(
        &request,
        status_writer.as_fd(),
        log.as_fd(),
        cgroup_dir.as_ref().map(|d| d.as_fd()),
    )?;
    drop(cgroup_dir);
    // Only the helper (and the sandbox child) hold the write end now: end of file means
    // both are done.
    drop(status_writer);
    drop(log);

    let mut buf = Vec::new();
    let deadline = Instant::now() + SPAWN_TIMEOUT;
    let read_res = read_until_eof(out, &mut buf, deadline);
    if read_res.is_err() {
        // Timed out or broken pipe: don't block on a stuck helper (the sandbox child, if
        // any, is killed with the cgroup by the caller).
        // SAFETY: kill with integer arguments; the helper is our child, not yet reaped.
        unsafe { libc::kill(helper, libc::SIGKILL) };
    }
    let helper_status = reap_child(helper)
        .ok_or_else(|| Error::Setup(format!("wait for sandbox helper {helper}: not our child")))?;

    let mut errors = Vec::new();
    for line in String::from_utf8_lossy(&buf).lines() {
        match Status::parse(line) {
            Some(Status::Pid(p)) => *pid_out = Some(p),
            Some(Status::Time(step, ns)) => {
                timings.push((step, Duration::from_nanos(ns.saturating_sub(start_ns))))
            }
            Some(Status::Error(m)) => errors.push(m),
            None => {}
        }
    }
    // The helper's lines and its child's come in two writes, in either order.
    timings.sort_by_key(|(_, d)| *d);
    if !errors.is_empty() {
        return Err(Error::Setup(errors.join("; ")));
    }
    read_res?;
    if !helper_status.success() {
        return Err(Error::Setup(format!(
            "sandbox helper failed: {helper_status}"
        )));
    }
    Ok(())
}

/// The calling thread's nice value (Linux keeps one per thread).
fn thread_nice() -> i32 {
    // SAFETY: errno is thread-local; getpriority has no memory arguments. -1 is a valid
    // nice value, so errno tells an error apart (none is possible for who = 0).
    unsafe {
        *libc::__errno_location() = 0;
        let nice = libc::getpriority(libc::PRIO_PROCESS, 0);
        if nice == -1 && *libc::__errno_location() != 0 {
            0
        } else {
            nice
        }
    }
}

fn read_until_eof(
    mut out: std::io::PipeReader,
    buf: &mut Vec<u8>,
    deadline: Instant,
) -> Result<()> {
    let mut chunk = [0u8; 4096];
    loop {
        match sys::wait_readable(out.as_raw_fd(), deadline) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                return Err(Error::Setup(format!(
                    "sandbox did not start within {SPAWN_TIMEOUT:?}"
                )));
            }
            Err(e) => return Err(io_ctx(|| "poll helper status".into())(e)),
        }
        match out.read(&mut chunk) {
            Ok(0) => return Ok(()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_ctx(|| "read helper status".into())(e)),
        }
    }
}

/// Reaps `pid` if it is our child (blocking until it exits); ignores ECHILD.
fn reap_child(pid: i32) -> Option<ExitStatus> {
    let mut status = 0;
    loop {
        // SAFETY: waitpid with a valid out pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            return Some(ExitStatus::from_raw(status));
        }
        if r < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        return None;
    }
}

/// Gives the running [shell](crate::SandboxSpec::shell) whose init is `pid` (pinned by
/// `pidfd`) the root `spec` describes (its template's layers over the sandbox's upper
/// directory, and `spec.binds`), the init running on (see `reroot.rs`). `spec` is the
/// spec a spawn of that sandbox from the template would take: not a shell; the helper
/// refuses an init outside `spec`'s cgroup. Blocking (about a millisecond). Returns the
/// time from the call to each step (`mounts_prepared`, `overlay_mounted`,
/// `pseudo_fs_moved`, `rootfs_ready`, `attached`). On an error the sandbox may be half
/// changed: destroy it.
pub fn attach_root(
    pidfd: std::os::fd::BorrowedFd<'_>,
    pid: i32,
    spec: &SandboxSpec,
) -> Result<Vec<(String, Duration)>> {
    let start = Instant::now();
    let start_ns = sys::monotonic_ns();
    spec.validate()?;
    if spec.shell {
        return Err(Error::InvalidSpec(format!(
            "the root for sandbox {} must be a template's, not a shell's",
            spec.id
        )));
    }
    if cubicle_syscalls::pidfd::exited(pidfd) {
        return Err(Error::Setup(format!("sandbox {} has exited", spec.id)));
    }
    let request = HelperRequest {
        spec: spec.clone(),
        reroot: Some(pid),
    };
    let mut timings = Vec::new();
    run_helper(&request, None, None, start_ns, &mut None, &mut timings)?;
    timings.push(("attached".to_string(), start.elapsed()));
    Ok(timings)
}

/// Whether a pidfd reports its process as exited (waits up to `timeout_ms`).
fn pidfd_exited(fd: &OwnedFd, timeout_ms: i32) -> bool {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    rc > 0
}

impl Sandbox {
    /// Sandbox id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Host pid of the sandbox's init (PID 1 inside).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// A pidfd of the init process (poll it for readability to learn of its exit).
    pub fn pidfd(&self) -> &OwnedFd {
        &self.pidfd
    }

    /// The same pidfd, shared: for a caller that keeps it beyond this handle.
    pub fn shared_pidfd(&self) -> Arc<OwnedFd> {
        self.pidfd.clone()
    }

    /// `/proc/<pid>/ns/net`: the sandbox's network namespace, for the network module.
    pub fn netns_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/net", self.pid))
    }

    /// The sandbox's private host directory.
    pub fn sandbox_dir(&self) -> &Path {
        &self.sandbox_dir
    }

    /// `<sandbox_dir>/ctl`: where the agent's Unix socket appears on the host.
    pub fn ctl_dir(&self) -> PathBuf {
        self.sandbox_dir.join("ctl")
    }

    /// Connects to the Unix socket `name` in [`ctl_dir`](Self::ctl_dir) safely (see
    /// [`connect_ctl_socket`](crate::connect_ctl_socket)).
    pub fn connect_ctl(&self, name: &str) -> Result<std::os::unix::net::UnixStream> {
        crate::ctl::connect_ctl_socket(&self.ctl_dir(), name)
    }

    /// Gives this running [shell](crate::SandboxSpec::shell) the root `spec` describes:
    /// [`attach_root`] with this sandbox's init, once `spec` is checked to be this
    /// sandbox's (same id and directory).
    pub fn attach_root(&self, spec: &SandboxSpec) -> Result<Vec<(String, Duration)>> {
        if spec.id != self.id || spec.sandbox_dir != self.sandbox_dir {
            return Err(Error::InvalidSpec(format!(
                "a root for sandbox {} must have its id and directory",
                self.id
            )));
        }
        attach_root(self.pidfd.as_fd(), self.pid, spec)
    }

    /// The sandbox's cgroup.
    pub fn cgroup(&self) -> &Cgroup {
        &self.cgroup
    }

    /// Time from the start of `spawn` to each setup step (`cgroup_created`,
    /// `helper_started`, `cloned`, `id_maps_written`, `mounts_prepared`, `child_released`,
    /// `overlay_mounted`, `pseudo_fs_mounted`, `rootfs_ready`, `exec`, `spawn_returned`).
    /// Empty for adopted sandboxes.
    pub fn timings(&self) -> &[(String, Duration)] {
        &self.timings
    }

    /// The read end of the init log FIFO ([`SandboxSpec::init_log`]) opened by `spawn`,
    /// for the caller to drain (once: later calls return `None`; so does an adopted
    /// sandbox — use [`crate::open_init_log`]).
    pub fn take_init_log(&self) -> Option<OwnedFd> {
        self.init_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// Appends what PID 1 wrote since the last call to `out` without blocking (when the
    /// init log was not taken); true once every writer is gone (the sandbox ended).
    pub fn read_init_log(&self, out: &mut Vec<u8>) -> Result<bool> {
        let guard = self.init_log.lock().unwrap_or_else(|p| p.into_inner());
        match guard.as_ref() {
            Some(fd) => crate::init_log::read_available(fd, out)
                .map_err(io_ctx(|| "read the init log".into())),
            None => Ok(true),
        }
    }

    /// Whether the init process is still running.
    pub fn is_alive(&self) -> bool {
        self.poll_exit().is_none()
    }

    /// The init's exit status once it has exited (reaping it when it is our child).
    /// `None` while it runs, and also for an adopted sandbox (not our child: the status
    /// is not available) — use [`is_alive`](Self::is_alive) to tell.
    pub fn exit_status(&self) -> Option<ExitStatus> {
        self.poll_exit().flatten()
    }

    /// `None`: running. `Some(status)`: exited, with the status when known.
    fn poll_exit(&self) -> Option<Option<ExitStatus>> {
        let mut exit = self.exit.lock().unwrap_or_else(|p| p.into_inner());
        if exit.is_some() {
            return *exit;
        }
        if self.is_parent {
            let mut status = 0;
            // SAFETY: waitpid with a valid out pointer.
            let r = unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) };
            if r == self.pid {
                *exit = Some(Some(ExitStatus::from_raw(status)));
                return *exit;
            }
            if r == 0 {
                return None;
            }
        }
        if pidfd_exited(&self.pidfd, 0) {
            *exit = Some(None);
        }
        *exit
    }

    /// Blocks until the init exits, at most `timeout`; true if it exited.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.poll_exit().is_some() {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            pidfd_exited(&self.pidfd, left.as_millis().clamp(1, 50) as i32);
        }
    }

    /// Current usage counters of the sandbox's cgroup.
    pub fn stats(&self) -> Result<CgroupStats> {
        self.cgroup.stats()
    }

    /// Whether the kernel's OOM killer killed a process of this sandbox.
    pub fn oom_killed(&self) -> Result<bool> {
        Ok(self.cgroup.stats()?.oom_kills > 0)
    }

    /// Kills every process of the sandbox (the whole cgroup, and the init through its
    /// pidfd) and waits until they are gone. Idempotent.
    pub fn kill(&self) -> Result<()> {
        // Killing PID 1 of a pid namespace makes the kernel kill everything in it, and
        // PID 1's exit completes only once all the others have exited (and no new one
        // can be born in a dying namespace). So once the init is gone, the cgroup is
        // usually empty already: the freeze-and-kill below (a dozen cgroup file
        // operations, under locks that every cgroup creation and removal on the host
        // takes) is for what is in the cgroup but not in the namespace, e.g. a helper
        // still starting it.
        let _ = cubicle_syscalls::pidfd::pidfd_kill(&self.pidfd);
        if self.wait_timeout(INIT_EXIT_GRACE) && self.cgroup.procs()?.is_empty() {
            return Ok(());
        }
        self.cgroup.kill_all()?;
        if !self.wait_timeout(Duration::from_secs(5)) {
            return Err(Error::Setup(format!(
                "sandbox {} init {} survived SIGKILL",
                self.id, self.pid
            )));
        }
        Ok(())
    }

    /// Kills the sandbox, removes its cgroup and its `upper/`, `work/`, `ctl/` and `rootfs/`
    /// directories. Its mounts lived only in its own mount namespace, which is gone once
    /// its last process exited.
    pub fn destroy(self) -> Result<()> {
        let dir = self.sandbox_dir.clone();
        self.stop()?;
        remove_layers(&dir)
    }

    /// [`destroy`](Self::destroy) without removing the directories: for a caller that
    /// removes the whole sandbox directory itself (a btrfs subvolume goes in O(1),
    /// however many files the sandbox wrote).
    pub fn stop(self) -> Result<()> {
        self.kill()?;
        self.cgroup.remove()
    }

    /// Re-attaches to a sandbox left running by an earlier process (e.g. after a node
    /// restart): finds the init (the member of `cubicle/<id>` whose pid inside its pid
    /// namespace is 1). [`NotFound`](Error::NotFound) if there is no such cgroup or init;
    /// use [`reap_orphans`] or [`remove_leftovers`] for those.
    pub fn adopt(id: &str, sandbox_dir: &Path) -> Result<Sandbox> {
        let cgroup = Cgroup::handle(id)?;
        if !cgroup.exists() {
            return Err(Error::NotFound(id.to_string()));
        }
        let init = cgroup
            .procs()?
            .into_iter()
            .find(|p| is_namespace_init(*p))
            .ok_or_else(|| Error::NotFound(id.to_string()))?;
        let pidfd = Arc::new(
            cubicle_syscalls::pidfd::pidfd_open(init)
                .map_err(io_ctx(|| format!("pidfd_open({init})")))?,
        );
        let is_parent = parent_of(init) == Some(std::process::id() as i32);
        Ok(Sandbox {
            id: id.to_string(),
            pid: init,
            pidfd,
            cgroup,
            sandbox_dir: sandbox_dir.to_path_buf(),
            is_parent,
            exit: Mutex::new(None),
            timings: Vec::new(),
            init_log: Mutex::new(None),
        })
    }
}

/// Whether host pid `pid` is PID 1 of a nested pid namespace (`NSpid: <host> ... 1`).
fn is_namespace_init(pid: i32) -> bool {
    let Ok(status) = fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status.lines().any(|l| {
        l.strip_prefix("NSpid:").is_some_and(|rest| {
            let ids: Vec<&str> = rest.split_whitespace().collect();
            ids.len() >= 2 && ids.last() == Some(&"1")
        })
    })
}

fn parent_of(pid: i32) -> Option<i32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("PPid:").and_then(|v| v.trim().parse().ok()))
}

/// Kills and removes the sandbox `id` whether or not it still runs: every process in its
/// cgroup, the cgroup, and the layers in `sandbox_dir` when given.
pub fn remove_leftovers(id: &str, sandbox_dir: Option<&Path>) -> Result<()> {
    let cg = Cgroup::handle(id)?;
    // A helper orphaned mid-create may still be moving into the cgroup or cloning: kill
    // and retry until the cgroup is really gone.
    let mut attempt = 0;
    loop {
        let init = cg.procs()?.into_iter().find(|p| is_namespace_init(*p));
        cg.kill_all()?;
        if let Some(p) = init
            && parent_of(p) == Some(std::process::id() as i32)
        {
            reap_child(p);
        }
        match cg.remove_within(Duration::from_millis(200)) {
            Ok(()) => break,
            Err(e) if attempt >= 25 => return Err(e),
            Err(_) => attempt += 1,
        }
    }
    if let Some(dir) = sandbox_dir {
        remove_layers(dir)?;
    }
    Ok(())
}

/// Reconciliation: kills and removes every `cubicle/<id>` cgroup (and its processes) for
/// which `is_known(id)` is false. Returns the ids removed. Directories are the caller's
/// to remove (it knows where they live), e.g. with [`remove_leftovers`].
pub fn reap_orphans(is_known: impl Fn(&str) -> bool) -> Result<Vec<String>> {
    let mut removed = Vec::new();
    for id in cgroup::list()? {
        if is_known(&id) {
            continue;
        }
        remove_leftovers(&id, None)?;
        removed.push(id);
    }
    Ok(removed)
}

/// Ids of every sandbox cgroup on this host (`cubicle/*`).
pub fn list_sandboxes() -> Result<Vec<String>> {
    cgroup::list()
}
