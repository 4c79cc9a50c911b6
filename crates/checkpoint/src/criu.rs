//! Running CRIU: where it is, its kernel-feature cache, and one `criu swrk` process per
//! dump or restore, spoken to over RPC (`rpc.rs`).
//!
//! CRIU probes the kernel on every start (30–80 ms here) unless `/run/criu.kdat` holds
//! the results, and it only writes that cache on a tmpfs — this host's `/run` is not one.
//! So every CRIU runs in a private mount namespace with a fresh tmpfs on `/run` holding a
//! copy of the cache, which lives at `<state>/criu/kdat-<boot id>` (root-only; per boot,
//! since a new kernel may have other features). The cache is made once per boot by a
//! `criu check` whose `/run` is such a tmpfs.

use std::ffi::CString;
use std::fs;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::error::{Error, Result};
use crate::rpc;

/// Where `scripts/install-criu.sh` puts the wrapper.
pub const DEFAULT_CRIU: &str = "/usr/local/lib/cubicle/criu/criu";

/// CRIU's log level unless `$CUBICLE_CRIU_LOG_LEVEL` says otherwise: errors and warnings.
/// Its debug log (4) writes a line per mapping, page run and file — about 400 KB for a
/// code-interpreter sandbox — and made that sandbox's resume twice as slow (0.45 → 0.25 s)
/// and its pause 30 % slower on the development machine; set 4 to debug CRIU itself.
const DEFAULT_LOG_LEVEL: i32 = 2;

/// The fd numbers a `criu swrk` child gets: its RPC socket and (restore) the descriptor
/// envd's output goes to.
pub(crate) const FD_RPC: RawFd = 3;
pub(crate) const FD_STDIO: RawFd = 4;

/// A CRIU installation and its kernel-feature cache.
#[derive(Clone, Debug)]
pub struct Criu {
    binary: PathBuf,
    kdat: PathBuf,
    log_level: i32,
}

impl Criu {
    /// CRIU from `$CUBICLE_CRIU` or [`DEFAULT_CRIU`], with its cache in `<state_dir>/criu`.
    /// Makes the cache now if this boot has none (one `criu check`, ~0.1 s).
    pub fn open(state_dir: &Path) -> Result<Criu> {
        let binary = std::env::var_os("CUBICLE_CRIU")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_CRIU));
        if !binary.is_file() {
            return Err(Error::NotInstalled(binary));
        }
        let dir = state_dir.join("criu");
        if !dir.is_dir() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
                .map_err(|e| Error::io(format!("mkdir {}", dir.display()), e))?;
        }
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| Error::io(format!("chmod {}", dir.display()), e))?;
        let boot = fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map_err(|e| Error::io("read the boot id", e))?;
        let kdat = dir.join(format!("kdat-{}", boot.trim()));
        let log_level = std::env::var("CUBICLE_CRIU_LOG_LEVEL")
            .ok()
            .and_then(|v| v.trim().parse::<i32>().ok())
            .map_or(DEFAULT_LOG_LEVEL, |l| l.clamp(0, 4));
        let criu = Criu {
            binary,
            kdat,
            log_level,
        };
        if !criu.kdat.is_file() {
            criu.make_kdat_cache(&dir)?;
        }
        Ok(criu)
    }

    /// The CRIU binary (or wrapper).
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// CRIU's log level for dumps and restores (`$CUBICLE_CRIU_LOG_LEVEL`, 0–4).
    pub fn log_level(&self) -> i32 {
        self.log_level
    }

    /// The kernel-feature cache file of this boot.
    pub fn kdat_cache(&self) -> &Path {
        &self.kdat
    }

    fn make_kdat_cache(&self, dir: &Path) -> Result<()> {
        for e in fs::read_dir(dir).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with("kdat-") {
                let _ = fs::remove_file(e.path());
            }
        }
        let tmp = dir.join("kdat.tmp");
        let out = fs::File::create(&tmp)
            .map_err(|e| Error::io(format!("create {}", tmp.display()), e))?;
        // `criu check` with a tmpfs on /run saves the cache there; cat copies it out
        // before the private mount namespace (and that tmpfs) goes away.
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(r#""$0" check >/dev/null 2>&1 && cat /run/criu.kdat"#)
            .arg(&self.binary)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(Stdio::null());
        let hooks = MountHooks::new(None)?;
        // SAFETY: the closure only makes system calls on data prepared before the fork
        // (no allocation, no locks): it is async-signal-safe.
        unsafe { cmd.pre_exec(move || hooks.enter()) };
        let status = cmd
            .status()
            .map_err(|e| Error::io(format!("run {} check", self.binary.display()), e))?;
        let len = fs::metadata(&tmp).map(|m| m.len()).unwrap_or(0);
        if !status.success() || len == 0 {
            let _ = fs::remove_file(&tmp);
            let detail = Command::new(&self.binary)
                .arg("check")
                .output()
                .map(|o| {
                    String::from_utf8_lossy(&o.stdout).into_owned()
                        + &String::from_utf8_lossy(&o.stderr)
                })
                .unwrap_or_default();
            return Err(Error::Criu {
                action: "check",
                message: format!("criu check failed on this kernel ({status})"),
                log: format!("\n{}", detail.trim()),
            });
        }
        fs::rename(&tmp, &self.kdat).map_err(|e| Error::io(format!("rename {}", tmp.display()), e))
    }

    /// Starts `criu swrk` for a dump: private mount namespace with the cache on `/run`,
    /// the RPC socket as fd 3. CRIU then waits for its request, so a dump starts it
    /// before it freezes the sandbox: its exec, dynamic loading and start-up (5–20 ms
    /// here) are then not part of the time the sandbox stands still.
    pub(crate) fn start_swrk(&self) -> Result<Swrk> {
        let hooks = MountHooks::new(Some(&self.kdat))?;
        self.spawn_swrk(None, move || hooks.enter())
    }

    /// Starts `criu swrk` for a restore in the mount namespace `mnt_ns` (the restore
    /// helper's, where it builds the root and has the cache on `/run`), working in `/run`,
    /// with `stdio` as fd 4. Started while the helper still builds: CRIU's exec and
    /// start-up overlap that work.
    pub(crate) fn start_swrk_in(&self, mnt_ns: &OwnedFd, stdio: Option<RawFd>) -> Result<Swrk> {
        let ns = mnt_ns.as_raw_fd();
        self.spawn_swrk(stdio, move || {
            // SAFETY: setns/chdir with a descriptor and a static string.
            unsafe {
                if libc::setns(ns, libc::CLONE_NEWNS) < 0 || libc::chdir(c"/run".as_ptr()) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        })
    }

    /// `criu swrk` with the RPC socket as fd 3 (and `stdio` as fd 4), `enter` run in the
    /// child before the exec (it must be async-signal-safe).
    fn spawn_swrk(
        &self,
        stdio: Option<RawFd>,
        enter: impl Fn() -> std::io::Result<()> + Send + Sync + 'static,
    ) -> Result<Swrk> {
        let (ours, theirs) =
            cubicle_syscalls::socket::seqpacket_pair().map_err(|e| Error::io("socketpair", e))?;
        let mut cmd = Command::new(&self.binary);
        cmd.arg("swrk")
            .arg(FD_RPC.to_string())
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut fds = [(theirs.as_raw_fd(), FD_RPC), (-1, FD_STDIO)];
        let n = match stdio {
            Some(fd) => {
                fds[1].0 = fd;
                2
            }
            None => 1,
        };
        // SAFETY: only system calls on data prepared before the fork (async-signal-safe).
        unsafe {
            cmd.pre_exec(move || {
                enter()?;
                place_fds(&fds[..n])
            })
        };
        let child = cmd
            .spawn()
            .map_err(|e| Error::io(format!("start {} swrk", self.binary.display()), e))?;
        Ok(Swrk {
            sock: Some(ours),
            child: Some(child),
        })
    }
}

/// A started `criu swrk` and the caller's end of its RPC socket. Dropped unused, CRIU
/// reads the end of its socket and exits; it is reaped either way.
pub(crate) struct Swrk {
    sock: Option<OwnedFd>,
    child: Option<Child>,
}

impl Swrk {
    /// Sends `req`, answers CRIU's notifications with `on_notify` (see [`converse`]),
    /// then waits for CRIU to exit: the answer, and what went wrong (CRIU's exit status
    /// and standard error) if there is none.
    pub(crate) fn run(
        mut self,
        req: &rpc::Req,
        on_notify: &mut dyn FnMut(&str, i32) -> Result<()>,
    ) -> (Result<rpc::Resp>, String) {
        let res = match &self.sock {
            Some(s) => converse(s, req, on_notify),
            None => Err(Error::io("criu", std::io::ErrorKind::NotConnected.into())),
        };
        drop(self.sock.take());
        let (status, stderr) = match self.child.take() {
            Some(c) => finish(c),
            None => (None, String::new()),
        };
        let detail = match &res {
            Ok(_) => String::new(),
            Err(_) => format!("(criu exited: {status:?}) {}", stderr.trim()),
        };
        (res, detail)
    }
}

impl Drop for Swrk {
    fn drop(&mut self) {
        drop(self.sock.take());
        if let Some(c) = self.child.take() {
            let _ = finish(c);
        }
    }
}

/// Moves `(from, to)` descriptors to their numbers in a child before exec, without
/// close-on-exec. Async-signal-safe.
pub(crate) fn place_fds(fds: &[(RawFd, RawFd)]) -> std::io::Result<()> {
    // First out of the way (a source may sit on another's target number), then in place.
    let mut tmp = [0 as RawFd; 8];
    for (i, (from, _)) in fds.iter().enumerate() {
        // SAFETY: fcntl with integer arguments.
        let t = unsafe { libc::fcntl(*from, libc::F_DUPFD, 100) };
        if t < 0 {
            return Err(std::io::Error::last_os_error());
        }
        tmp[i] = t;
    }
    for (i, (_, to)) in fds.iter().enumerate() {
        // SAFETY: dup2/close with integer arguments; dup2 clears close-on-exec.
        if unsafe { libc::dup2(tmp[i], *to) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: as above.
        unsafe { libc::close(tmp[i]) };
    }
    Ok(())
}

/// What a CRIU child does between fork and exec: a private mount namespace with a
/// tmpfs on `/run` holding a copy of the kernel-feature cache (bound over the file).
struct MountHooks {
    kdat: Option<CString>,
}

impl MountHooks {
    fn new(kdat: Option<&Path>) -> Result<MountHooks> {
        let kdat = kdat
            .map(|p| CString::new(p.as_os_str().as_bytes()))
            .transpose()
            .map_err(|_| Error::io("kdat path", std::io::ErrorKind::InvalidInput.into()))?;
        Ok(MountHooks { kdat })
    }

    /// Async-signal-safe: system calls only, on memory allocated before the fork.
    fn enter(&self) -> std::io::Result<()> {
        let check = |rc: libc::c_int| {
            if rc < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(())
            }
        };
        // SAFETY: plain system calls with NUL-terminated static strings or CStrings made
        // before the fork.
        unsafe {
            check(libc::unshare(libc::CLONE_NEWNS))?;
            check(libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            check(libc::mount(
                c"tmpfs".as_ptr(),
                c"/run".as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                c"mode=0755,size=1m".as_ptr().cast(),
            ))?;
            if let Some(k) = &self.kdat {
                let fd = libc::open(
                    c"/run/criu.kdat".as_ptr(),
                    libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                    0o600,
                );
                check(fd)?;
                libc::close(fd);
                check(libc::mount(
                    k.as_ptr(),
                    c"/run/criu.kdat".as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND,
                    std::ptr::null(),
                ))?;
            }
        }
        Ok(())
    }
}

/// Enters the same environment in the current (single-threaded) process: used by the
/// restore helper, whose mount namespace CRIU then joins ([`Criu::start_swrk_in`]).
pub(crate) fn enter_private_run(kdat: &Path) -> Result<()> {
    MountHooks::new(Some(kdat))?
        .enter()
        .map_err(|e| Error::io("private mount namespace for criu", e))
}

/// The last `lines` lines of CRIU's log in `dir` (for error messages), led by a newline.
pub(crate) fn log_tail(dir: &Path, name: &str, lines: usize) -> String {
    let Ok(text) = fs::read_to_string(dir.join(name)) else {
        return String::new();
    };
    // Errors are what matters; fall back to the last lines.
    let errors: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("Error") && !l.contains("RLIMIT_NOFILE"))
        .collect();
    let pick: Vec<&str> = if errors.is_empty() {
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].to_vec()
    } else {
        errors[errors.len().saturating_sub(lines)..].to_vec()
    };
    if pick.is_empty() {
        String::new()
    } else {
        format!("\n{}", pick.join("\n"))
    }
}

/// Waits for a CRIU child, collecting what it wrote on stderr.
pub(crate) fn finish(mut child: Child) -> (Option<std::process::ExitStatus>, String) {
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    (child.wait().ok(), err)
}

/// One request/answer exchange; `on_notify(script, pid)` answers CRIU's notifications
/// (returning `Err` makes CRIU abort).
pub(crate) fn converse(
    sock: &OwnedFd,
    req: &rpc::Req,
    on_notify: &mut dyn FnMut(&str, i32) -> Result<()>,
) -> Result<rpc::Resp> {
    rpc::send(sock, req).map_err(|e| Error::io("send the request to criu", e))?;
    loop {
        let resp = rpc::recv(sock).map_err(|e| Error::io("read criu's answer", e))?;
        if resp.r#type == rpc::ReqType::Notify as i32 {
            let n = resp.notify.clone().unwrap_or_default();
            let script = n.script.unwrap_or_default();
            let res = on_notify(&script, n.pid.unwrap_or(0));
            let ok = res.is_ok();
            rpc::send(
                sock,
                &rpc::Req {
                    r#type: rpc::ReqType::Notify as i32,
                    opts: None,
                    notify_success: Some(ok),
                },
            )
            .map_err(|e| Error::io("answer criu's notification", e))?;
            res?;
            continue;
        }
        return Ok(resp);
    }
}
