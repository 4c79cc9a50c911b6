//! What a sandbox is made of: [`SandboxSpec`] (rootfs, private directory, uid range,
//! hostname, limits, init program, bind mounts) and its validation.
//!
//! The spec is plain data. It travels as JSON from the caller to the re-executed helper
//! process (see `helper.rs`), so every field is serialisable.

use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::SandboxId;
use crate::error::{Error, Result};

/// Where the agent binary is bind-mounted (read-only) inside every sandbox.
pub const ENVD_PATH: &str = "/run/cubicle/envd";
/// Where `<sandbox_dir>/ctl` is bind-mounted (read-only once the init's socket is in it)
/// inside every sandbox. The agent's Unix socket ([`SandboxSpec::ctl_socket`]) is there;
/// the host reaches it through `<sandbox_dir>/ctl`. Read-only so that nothing a sandbox writes lives outside its
/// overlay (on btrfs, a writable directory of the quota filesystem let it create
/// subvolumes, each with its own unlimited quota).
pub const CTL_DIR: &str = "/run/cubicle/ctl";
/// The descriptor the init program finds [`SandboxSpec::ctl_socket`]'s listening socket
/// on (systemd's `SD_LISTEN_FDS_START`).
pub const LISTEN_FD: i32 = 3;
/// Size of every sandbox's uid/gid range (root inside = `uid_base`, 65535 = `uid_base+65535`).
pub const DEFAULT_UID_COUNT: u32 = 65536;
/// Lowest acceptable `uid_base`: host uids below this belong to host users and services.
pub const MIN_UID_BASE: u32 = 65536;
/// Default `PATH` of the init program.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Most extra bind mounts a spec may carry (they travel as fds in one message).
pub const MAX_BINDS: usize = 16;
/// Most read-only layers a sandbox's root may stack (`rootfs` plus [`SandboxSpec::layers`]):
/// each is one idmapped mount per sandbox, and they travel as fds in one message.
pub const MAX_LAYERS: usize = 48;

/// Resource limits of one sandbox, enforced by its cgroup.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Memory limit in bytes (RAM; no swap is allowed). Default 512 MiB.
    pub memory_bytes: u64,
    /// CPU in millicores: 2000 = two full CPUs of quota per period. Also sets the
    /// proportional weight (shares) so that contending sandboxes split CPU by size.
    pub cpu_millis: u32,
    /// Maximum number of tasks (processes + threads). Default 1024.
    pub pids: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory_bytes: 512 << 20,
            cpu_millis: 2000,
            pids: 1024,
        }
    }
}

/// A host path bind-mounted into the sandbox.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BindMount {
    /// Absolute host path (file or directory). Opened by the privileged helper, so it need
    /// not be readable by the sandbox's uid range.
    pub source: PathBuf,
    /// Absolute path inside the sandbox. Created if missing (in the `/run` tmpfs when under
    /// `/run`, otherwise in the sandbox's writable layer).
    pub target: PathBuf,
    /// Mount read-only (always also nosuid and nodev).
    pub readonly: bool,
    /// Map the source's owners into the sandbox's user namespace (an idmapped mount, as
    /// the template's lower layer): a file owned by uid N on disk is owned by uid N
    /// inside, and what the sandbox's uid N creates is stored as N. Used for volumes,
    /// whose files several sandboxes (each with its own host uid range) share.
    #[serde(default)]
    pub idmapped: bool,
}

/// Everything needed to start one sandbox. Build with [`SandboxSpec::new`] and adjust fields.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxSpec {
    /// Sandbox id, `^[a-z0-9]{1,32}$`; names the cgroup `cubicle/<id>`.
    pub id: String,
    /// Template root filesystem: the overlay's read-only lower layer. Owned by host uid 0;
    /// an idmapped mount makes it appear owned by the sandbox's root.
    pub rootfs: PathBuf,
    /// Further read-only layers stacked on `rootfs`, bottom first (a template made of
    /// several content-addressed layers; empty for a single-directory template). Same
    /// format as overlayfs layers mounted with `userxattr`: whiteouts are 0/0 character
    /// devices, opaque directories carry `user.overlay.opaque=y`. Each is idmapped like
    /// `rootfs`; at most [`MAX_LAYERS`] in all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<PathBuf>,
    /// Private host directory of this sandbox; `spawn` creates `upper/`, `work/`, `ctl/` and
    /// `rootfs/` (an empty mount point) in it. It and its ancestors must be searchable by
    /// others (mode o+x, e.g. 0711): the sandbox's root (host uid `uid_base`) resolves
    /// `upper/` and `work/` when it mounts the overlay.
    pub sandbox_dir: PathBuf,
    /// Host uid (and gid) that root inside the sandbox maps to. Must be >= 65536 and unique
    /// to this sandbox among running sandboxes (the node allocates ranges).
    pub uid_base: u32,
    /// Number of uids/gids mapped (default 65536).
    pub uid_count: u32,
    /// Hostname inside the sandbox.
    pub hostname: String,
    /// cgroup limits.
    pub limits: Limits,
    /// Whether the network module will attach a veth to this sandbox's netns. The runtime
    /// itself only brings `lo` up; this flag is carried for the caller's bookkeeping.
    pub internet: bool,
    /// argv of PID 1 inside the sandbox; `init[0]` is an absolute path inside the rootfs
    /// (no PATH search), e.g. `["/run/cubicle/envd", "--init", ...]`.
    pub init: Vec<String>,
    /// Environment of the init program (nothing is inherited from the host). `PATH` and
    /// `HOME` get defaults when absent.
    pub env: Vec<(String, String)>,
    /// The agent binary bind-mounted read-only at [`ENVD_PATH`], if any.
    pub envd_binary: Option<PathBuf>,
    /// Extra bind mounts (at most [`MAX_BINDS`]). `<sandbox_dir>/ctl` → [`CTL_DIR`]
    /// (read-only before the init runs) is always added and need not be listed.
    pub binds: Vec<BindMount>,
    /// A Unix socket the init program serves on: created (listening) as `CTL_DIR/<name>`
    /// (`<sandbox_dir>/ctl/<name>` on the host) in the sandbox's namespaces before the
    /// init runs, and passed to it as descriptor [`LISTEN_FD`]. `None`: no socket.
    pub ctl_socket: Option<String>,
    /// Host path of a FIFO that receives the init program's stdout and stderr (see
    /// `init_log.rs`): created (mode 0600) if missing; [`crate::spawn`] returns its read
    /// end in the [`crate::Sandbox`] ([`crate::Sandbox::take_init_log`]), and
    /// [`crate::open_init_log`] opens it again later. Never a plain file: the sandbox's
    /// root can take PID 1's descriptors. `None`: /dev/null.
    pub init_log: Option<PathBuf>,
    /// The init's open-files limit (`RLIMIT_NOFILE`), set by the helper before the
    /// clone. `None`: the caller's own. [`SandboxSpec::new`] takes the limit the node
    /// was started with ([`crate::fd_limit::for_sandboxes`]), not the node's raised one.
    #[serde(default)]
    pub open_files: Option<crate::fd_limit::FdLimit>,
    /// A shell: a sandbox without a template, whose root is an empty directory of its
    /// staging tmpfs with `/proc`, `/sys`, `/dev` and `/run` (agent binary and ctl
    /// directory included) mounted as for any sandbox, and its init started there.
    /// [`crate::Sandbox::attach_root`] later gives it a template's root while the init
    /// runs. `rootfs` and `layers` are ignored (no layer is mounted), and every bind must
    /// target a path under `/run/`, whose mount moves to the template's root with it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shell: bool,
}

impl SandboxSpec {
    /// A spec with default limits (512 MiB, 2 CPUs, 1024 pids), `uid_count` 65536, the id
    /// as hostname, internet off, no extra mounts and no init log.
    pub fn new(
        id: impl Into<String>,
        rootfs: impl Into<PathBuf>,
        sandbox_dir: impl Into<PathBuf>,
        uid_base: u32,
        init: Vec<String>,
    ) -> Self {
        let id = id.into();
        SandboxSpec {
            hostname: id.clone(),
            id,
            rootfs: rootfs.into(),
            layers: Vec::new(),
            sandbox_dir: sandbox_dir.into(),
            uid_base,
            uid_count: DEFAULT_UID_COUNT,
            limits: Limits::default(),
            internet: false,
            init,
            env: Vec::new(),
            envd_binary: None,
            binds: Vec::new(),
            ctl_socket: None,
            init_log: None,
            open_files: crate::fd_limit::for_sandboxes(),
            shell: false,
        }
    }

    /// `<sandbox_dir>/upper`: the sandbox's writable layer.
    pub fn upper_dir(&self) -> PathBuf {
        self.sandbox_dir.join("upper")
    }
    /// `<sandbox_dir>/work`: overlayfs work directory.
    pub fn work_dir(&self) -> PathBuf {
        self.sandbox_dir.join("work")
    }
    /// `<sandbox_dir>/ctl`: host side of [`CTL_DIR`].
    pub fn ctl_dir(&self) -> PathBuf {
        self.sandbox_dir.join("ctl")
    }
    /// Every read-only layer of the root, bottom first: `rootfs`, then `layers` (none for
    /// a [shell](Self::shell)).
    pub fn lowers(&self) -> Vec<&Path> {
        if self.shell {
            return Vec::new();
        }
        std::iter::once(self.rootfs.as_path())
            .chain(self.layers.iter().map(PathBuf::as_path))
            .collect()
    }

    /// `<sandbox_dir>/rootfs`: empty directory the sandbox mounts its root on (visible only
    /// inside the sandbox's mount namespace).
    pub fn mount_dir(&self) -> PathBuf {
        self.sandbox_dir.join("rootfs")
    }

    /// All bind mounts the sandbox gets: the caller's, the agent binary and the ctl dir.
    pub fn all_binds(&self) -> Vec<BindMount> {
        let mut binds = self.binds.clone();
        if let Some(envd) = &self.envd_binary {
            binds.push(BindMount {
                source: envd.clone(),
                target: PathBuf::from(ENVD_PATH),
                readonly: true,
                idmapped: false,
            });
        }
        // Attached writable: the sandbox child binds the init's socket in it, then makes
        // it read-only before anything of the tenant runs (`ctl.rs`).
        binds.push(BindMount {
            source: self.ctl_dir(),
            target: PathBuf::from(CTL_DIR),
            readonly: false,
            idmapped: false,
        });
        binds
    }

    /// The init program's environment with defaults filled in.
    pub fn init_env(&self) -> Vec<(String, String)> {
        let mut env = self.env.clone();
        if !env.iter().any(|(k, _)| k == "PATH") {
            env.push(("PATH".into(), DEFAULT_PATH.into()));
        }
        if !env.iter().any(|(k, _)| k == "HOME") {
            env.push(("HOME".into(), "/root".into()));
        }
        env
    }

    /// Checks every field; the error names the offending one.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidSpec(m));
        if !SandboxId::is_valid(&self.id) {
            return bad(format!("id {:?} must match ^[a-z0-9]{{1,32}}$", self.id));
        }
        let layers = self.layers.iter().map(|p| ("layer", p));
        for (name, p) in [("rootfs", &self.rootfs), ("sandbox_dir", &self.sandbox_dir)]
            .into_iter()
            .chain(layers)
        {
            if !is_clean_absolute(p) {
                return bad(format!(
                    "{name} {} must be an absolute path without '..'",
                    p.display()
                ));
            }
        }
        if self.lowers().len() > MAX_LAYERS {
            return bad(format!(
                "{} layers: at most {MAX_LAYERS} (rootfs included)",
                self.lowers().len()
            ));
        }
        // The overlay mount options list these paths: no separators or escapes.
        let dir = self.sandbox_dir.to_string_lossy();
        if dir.contains([',', ':', '\\', '\n']) || dir.chars().any(char::is_whitespace) {
            return bad(format!(
                "sandbox_dir {dir:?} must not contain ',', ':', '\\' or whitespace"
            ));
        }
        if self.uid_base < MIN_UID_BASE {
            return bad(format!(
                "uid_base {} must be >= {MIN_UID_BASE}",
                self.uid_base
            ));
        }
        if self.uid_count == 0 || self.uid_base.checked_add(self.uid_count).is_none() {
            return bad(format!(
                "uid range {}+{} must be non-empty and fit in 32 bits",
                self.uid_base, self.uid_count
            ));
        }
        if self.hostname.is_empty()
            || self.hostname.len() > 64
            || !self
                .hostname
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        {
            return bad(format!(
                "hostname {:?} must be 1-64 of [A-Za-z0-9.-]",
                self.hostname
            ));
        }
        let l = &self.limits;
        if l.memory_bytes < (8 << 20) {
            return bad(format!(
                "limits.memory_bytes {} must be at least 8 MiB",
                l.memory_bytes
            ));
        }
        if l.cpu_millis < 10 {
            return bad(format!(
                "limits.cpu_millis {} must be at least 10",
                l.cpu_millis
            ));
        }
        if l.pids < 8 {
            return bad(format!("limits.pids {} must be at least 8", l.pids));
        }
        match self.init.first() {
            Some(p) if p.starts_with('/') => {}
            _ => return bad("init must be non-empty and init[0] an absolute path".into()),
        }
        if self.init.iter().any(|a| a.contains('\0')) {
            return bad("init arguments must not contain NUL".into());
        }
        for (k, v) in &self.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return bad(format!("environment variable {k:?} is malformed"));
            }
        }
        let binds = self.all_binds();
        if binds.len() > MAX_BINDS {
            return bad(format!("at most {MAX_BINDS} bind mounts are supported"));
        }
        for b in &binds {
            if !is_clean_absolute(&b.source)
                || !is_clean_absolute(&b.target)
                || b.target == Path::new("/")
            {
                return bad(format!(
                    "bind {} -> {} must use absolute paths without '..' and not target /",
                    b.source.display(),
                    b.target.display()
                ));
            }
            let reserved = ["/proc", "/dev", "/sys"];
            if reserved.iter().any(|r| b.target.starts_with(r)) {
                return bad(format!("bind target {} is reserved", b.target.display()));
            }
            if self.shell && !b.target.starts_with("/run") {
                return bad(format!(
                    "a shell's bind target {} must be under /run",
                    b.target.display()
                ));
            }
        }
        if self.shell && !self.layers.is_empty() {
            return bad("a shell has no layers".into());
        }
        if let Some(name) = &self.ctl_socket
            && (name.is_empty() || name.contains(['/', '\0']) || name == "." || name == "..")
        {
            return bad(format!("ctl_socket {name:?} must be a plain file name"));
        }
        if let Some(log) = &self.init_log
            && !log.is_absolute()
        {
            return bad(format!("init_log {} must be absolute", log.display()));
        }
        Ok(())
    }
}

fn is_clean_absolute(p: &Path) -> bool {
    p.is_absolute()
        && p.components()
            .all(|c| !matches!(c, Component::ParentDir | Component::CurDir))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> SandboxSpec {
        SandboxSpec::new(
            "abc123",
            "/t/rootfs",
            "/s/abc123",
            100_000,
            vec!["/bin/sh".into()],
        )
    }

    #[test]
    fn a_shell_has_no_layer_and_binds_only_under_run() {
        let mut s = spec();
        s.shell = true;
        assert!(s.lowers().is_empty());
        s.validate().unwrap();
        let bind = |target: &str| BindMount {
            source: "/data".into(),
            target: target.into(),
            readonly: true,
            idmapped: false,
        };
        s.binds.push(bind("/run/tools"));
        s.validate().unwrap();
        s.binds.push(bind("/opt/tools"));
        assert!(s.validate().is_err());
        s.binds.pop();
        s.layers.push("/t/top".into());
        assert!(s.validate().is_err());
    }

    #[test]
    fn default_spec_is_valid() {
        spec().validate().unwrap();
        assert_eq!(
            spec().limits,
            Limits {
                memory_bytes: 512 << 20,
                cpu_millis: 2000,
                pids: 1024
            }
        );
    }

    #[test]
    fn rejects_bad_fields() {
        let mut s = spec();
        s.id = "../x".into();
        assert!(s.validate().is_err());
        let mut s = spec();
        s.uid_base = 1000;
        assert!(s.validate().is_err());
        let mut s = spec();
        s.uid_base = u32::MAX - 10;
        assert!(s.validate().is_err());
        let mut s = spec();
        s.init = vec!["sh".into()];
        assert!(s.validate().is_err());
        let mut s = spec();
        s.rootfs = "/t/../etc".into();
        assert!(s.validate().is_err());
        let mut s = spec();
        s.binds.push(BindMount {
            source: "/x".into(),
            target: "/proc/x".into(),
            readonly: true,
            idmapped: false,
        });
        assert!(s.validate().is_err());
        let mut s = spec();
        s.sandbox_dir = "/s/a,b".into();
        assert!(s.validate().is_err());
        let mut s = spec();
        s.hostname = "a b".into();
        assert!(s.validate().is_err());
    }

    #[test]
    fn binds_include_envd_and_ctl() {
        let mut s = spec();
        s.envd_binary = Some("/usr/bin/cubicle-envd".into());
        let b = s.all_binds();
        assert!(
            b.iter()
                .any(|b| b.target == Path::new(ENVD_PATH) && b.readonly)
        );
        // Attached writable; the child seals it once the init's socket is in it.
        assert!(b.iter().any(|b| b.target == Path::new(CTL_DIR)
            && !b.readonly
            && b.source == Path::new("/s/abc123/ctl")));
    }

    #[test]
    fn env_defaults() {
        let mut s = spec();
        s.env.push(("PATH".into(), "/bin".into()));
        let env = s.init_env();
        assert_eq!(env.iter().filter(|(k, _)| k == "PATH").count(), 1);
        assert!(env.iter().any(|(k, v)| k == "HOME" && v == "/root"));
    }

    #[test]
    fn json_roundtrip() {
        let s = spec();
        let j = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<SandboxSpec>(&j).unwrap(), s);
    }
}
