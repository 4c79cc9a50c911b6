//! The sandbox's root filesystem, built inside its own mount namespace, in this order:
//!
//! 1. make every mount private (nothing propagates to or from the host);
//! 2. a tmpfs on `<sandbox_dir>/rootfs` as a staging area; the helper's idmapped
//!    template clone is attached at `staging/lower`; the same tmpfs later backs `/dev`,
//!    `/dev/shm`, `/run`, the v1 `/sys/fs/cgroup` directory and every masked directory
//!    (read-only binds of its empty `staging/empty`), so that a sandbox holds one tmpfs
//!    superblock instead of a dozen (see "Superblocks" below);
//! 3. overlay `staging/root` = lower (template) + `<sandbox_dir>/upper` (+ `work`);
//! 4. fresh `/proc` with the masked and read-only paths of `masked_paths.rs`;
//! 5. read-only `/sys` (also masked): a clone of the one sysfs all sandboxes share
//!    (`shared_sysfs.rs`; a sysfs of its own without it), with the sandbox's own cgroups
//!    read-only at `/sys/fs/cgroup` (cgroup namespace: the sandbox's cgroup is the root);
//! 6. minimal `/dev`: a directory of the staging tmpfs with null, zero, full, random, urandom, tty bind-mounted from
//!    the host, a private devpts instance (`/dev/pts`, `/dev/ptmx`), `/dev/shm`, and the
//!    `/dev/fd`, `/dev/std*` symlinks;
//! 7. `/run`, another directory of the staging tmpfs;
//! 8. `pivot_root` into the overlay and detach the old root;
//! 9. the bind mounts (agent binary, ctl directory, extras), attached from the detached
//!    mounts the helper prepared, at paths resolved inside the new root.
//!
//! `/tmp` stays on the overlay (disk-backed, counted by the disk quota, not by memory).
//! All of this happens in the sandbox's mount namespace: none of these mounts is visible on
//! the host, and they disappear with the namespace when the sandbox's last process exits.
//!
//! Superblocks: every superblock on the host registers a memcg-aware shrinker, and the
//! kernel gives every memory cgroup a shrinker map sized by the highest shrinker id in use
//! (about 1 KiB per 64 superblocks, per cgroup, never shrunk). With N sandboxes of S
//! superblocks each, that is N·N·S/64 KiB host-wide: 16 superblocks per sandbox cost
//! 250 KiB per sandbox at 1,000 sandboxes. So a sandbox mounts only what cannot be shared:
//! overlay, proc, devpts, one tmpfs (plus the mqueue its IPC namespace implies); its sysfs
//! is the shared one.
//! Tmpfs size limits are per superblock and no longer separate; the sandbox's memory
//! cgroup bounds all of it.
//!
//! The sequence is first computed as data ([`plan`], a list of [`Step`]s) and then
//! executed ([`execute`]), so its order and targets are unit-tested without root.

use std::ffi::CString;
use std::fs;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};

use crate::cgroup::InnerMounts;
use crate::helper::mark;
use crate::masked_paths::{MASKED_DIRS, MASKED_FILES, READONLY_PATHS};
use crate::spec::SandboxSpec;
use crate::sys;

const NOSUID: libc::c_ulong = libc::MS_NOSUID;
const NODEV: libc::c_ulong = libc::MS_NODEV;
const NOEXEC: libc::c_ulong = libc::MS_NOEXEC;
const RDONLY: libc::c_ulong = libc::MS_RDONLY;

/// Host devices bind-mounted into the sandbox's /dev.
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

/// One step of building the root filesystem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// `mount --make-rprivate /`.
    MakeRootPrivate,
    /// `mkdir -p` with this mode (past the umask), if missing.
    Dir { path: PathBuf, mode: u32 },
    /// Create an empty regular file (and its parents), if missing.
    File { path: PathBuf },
    /// `mount(source, target, fstype, flags, data)`.
    Mount {
        source: String,
        target: PathBuf,
        fstype: String,
        flags: libc::c_ulong,
        data: Option<String>,
    },
    /// Attach the helper's idmapped clone of layer #`index` (0 = the bottom, `rootfs`).
    AttachLower { index: usize, target: PathBuf },
    /// Bind-mount `source` on `target`, then remount it with `remount` flags if non-zero.
    Bind {
        source: PathBuf,
        target: PathBuf,
        remount: libc::c_ulong,
    },
    /// Hide a file: read-only bind of /dev/null over it (skipped if it does not exist).
    MaskFile { target: PathBuf },
    /// Hide a directory: read-only bind of the empty `empty` over it (skipped if it does
    /// not exist).
    MaskDir { empty: PathBuf, target: PathBuf },
    /// Bind a subtree onto itself read-only (skipped if it does not exist).
    ReadOnly { target: PathBuf },
    /// sysfs read-only; an empty read-only tmpfs where the kernel refuses sysfs.
    Sysfs { target: PathBuf },
    /// Write `value` to sysctl file `path` (under the sandbox's own /proc, before it is
    /// made read-only); a missing file is skipped if `missing_ok` (IPv6 on a host
    /// without it).
    Sysctl {
        path: PathBuf,
        value: String,
        missing_ok: bool,
    },
    /// `symlink(to, link)`.
    Symlink { to: String, link: PathBuf },
    /// Queue a timing mark for the status pipe.
    Mark(&'static str),
    /// chdir(root); pivot_root(".", "."); umount2(".", MNT_DETACH); chdir("/").
    Pivot { root: PathBuf },
    /// Move the mount at `from` (with every mount below it) to `to`.
    Move { from: PathBuf, to: PathBuf },
    /// Detach the mount at `target` (`umount2(MNT_DETACH)`).
    Detach { target: PathBuf },
    /// Attach bind mount #`index` (the helper's detached mount of bind `index`) at
    /// `target` (a path inside the sandbox, after the pivot), creating a file or
    /// directory to match.
    AttachBind { index: usize, target: PathBuf },
}

fn tmpfs(target: PathBuf, flags: libc::c_ulong, data: &str) -> Step {
    Step::Mount {
        source: "tmpfs".into(),
        target,
        fstype: "tmpfs".into(),
        flags,
        data: Some(data.into()),
    }
}

/// `root` + an absolute in-sandbox path.
fn inside(root: &Path, p: impl AsRef<Path>) -> PathBuf {
    root.join(p.as_ref().strip_prefix("/").unwrap_or(p.as_ref()))
}

/// Where each read-only layer of `spec` is attached in the staging tmpfs, bottom first:
/// layer 0 (`rootfs`) at `lower`, layer i at `lower<i>`. A restore's root uses the same.
pub(crate) fn lower_mount_points(spec: &SandboxSpec) -> Vec<PathBuf> {
    let staging = spec.mount_dir();
    (0..spec.lowers().len())
        .map(|i| match i {
            0 => staging.join("lower"),
            i => staging.join(format!("lower{i}")),
        })
        .collect()
}

/// The overlay's mount options over the layers attached at `lowers` (bottom first, as
/// [`lower_mount_points`] gives them; overlayfs lists them top first).
///
/// `volatile`: the overlay never syncs its upper filesystem. Without it, the unmount that
/// comes with every sandbox's end (its mount namespace dying with its last process)
/// syncs the whole upper filesystem: on btrfs a transaction commit, host-wide, per
/// sandbox (a profile of a closed create-kill loop found it the largest single cost of
/// a sandbox's end). It also keeps a tenant's `fsync`/`syncfs` on its root from forcing
/// commits on the filesystem every sandbox shares (`sync(2)` still walks every
/// filesystem of the host: that one is not the overlay's to stop). What must be durable
/// is made so by the node (a pause syncs the filesystem once its checkpoint is written).
/// A volatile mount leaves a marker that refuses the next mount of the same work directory:
/// [`clear_volatile_marker`] removes it before a sandbox is booted or restored again.
pub(crate) fn overlay_options(spec: &SandboxSpec, lowers: &[PathBuf]) -> String {
    let lowerdir: Vec<String> = lowers
        .iter()
        .rev()
        .map(|p| p.display().to_string())
        .collect();
    format!(
        "lowerdir={},upperdir={},workdir={},userxattr,volatile",
        lowerdir.join(":"),
        spec.upper_dir().display(),
        spec.work_dir().display()
    )
}

/// Removes the marker an earlier `volatile` overlay left in `spec`'s work directory
/// (`work/incompat/volatile`), without which overlayfs refuses to mount over the same
/// work directory again ("overlay with incompat feature 'volatile' cannot be mounted").
/// Run by the host's root before a sandbox whose directories already exist is booted
/// again (a resume from a filesystem-only pause) or restored (resume, rollback, a
/// moved sandbox). The work directory is never visible inside a sandbox, and
/// `remove_dir_all` follows no symbolic link.
pub(crate) fn clear_volatile_marker(spec: &SandboxSpec) -> crate::error::Result<()> {
    let marker = spec.work_dir().join("work").join("incompat");
    match std::fs::remove_dir_all(&marker) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(crate::error::Error::io(
            format!("remove {}", marker.display()),
            e,
        )),
    }
}

/// The complete sequence for `spec` on a host whose cgroups are `cgroups`.
pub(crate) fn plan(spec: &SandboxSpec, cgroups: &InnerMounts) -> Vec<Step> {
    let staging = spec.mount_dir();
    let root = staging.join("root");
    let lowers = lower_mount_points(spec);
    let mut s = vec![
        Step::MakeRootPrivate,
        tmpfs(staging.clone(), NOSUID | NODEV, "mode=0755"),
    ];
    for path in &lowers {
        s.push(Step::Dir {
            path: path.clone(),
            mode: 0o755,
        });
    }
    s.push(Step::Dir {
        path: staging.join("empty"),
        mode: 0o555,
    });
    s.push(Step::Dir {
        path: root.clone(),
        mode: 0o755,
    });
    attach_lowers(&mut s, &lowers);
    if spec.shell {
        // A shell's root: its empty directory of the staging tmpfs, bound on itself (a
        // mount point to pivot into); a template's overlay replaces it (`reroot.rs`).
        s.push(Step::Bind {
            source: root.clone(),
            target: root.clone(),
            remount: 0,
        });
        s.push(Step::Mark("shell_root_mounted"));
    } else {
        s.push(overlay(spec, &lowers, &root));
        s.push(Step::Mark("overlay_mounted"));
    }
    root_dirs(&mut s, &root);

    // /proc
    s.push(Step::Mount {
        source: "proc".into(),
        target: root.join("proc"),
        fstype: "proc".into(),
        flags: NOSUID | NODEV | NOEXEC,
        data: None,
    });
    // ICMP echo ("ping") sockets for every group of the sandbox, in its own network
    // namespace: `ping` works without CAP_NET_RAW, which a sandbox does not get. Written
    // through this /proc, a superblock of the sandbox's own, not the host's: in the
    // host's, the entry of every live network namespace hangs in one dentry hash chain
    // (same parent, same name), so each write walked one entry per sandbox (5.7 % of all
    // CPU at 6,000 sandboxes).
    s.push(Step::Sysctl {
        path: root.join("proc/sys/net/ipv4/ping_group_range"),
        value: format!("0 {}\n", spec.uid_count.saturating_sub(1)),
        missing_ok: false,
    });
    // No IPv6 on the interfaces the node gives the namespace later (`eth0` is born with
    // this default; `lo`, there already, keeps `::1`): see `Network::attach_spawned`.
    s.push(Step::Sysctl {
        path: root.join("proc/sys/net/ipv6/conf/default/disable_ipv6"),
        value: "1\n".into(),
        missing_ok: true,
    });
    let empty = staging.join("empty");
    masks(&mut s, &root, &empty, "/proc/");

    // /sys and the sandbox's cgroups
    s.push(Step::Sysfs {
        target: root.join("sys"),
    });
    masks(&mut s, &root, &empty, "/sys/");
    cgroup_mounts(&mut s, &staging, &root.join("sys/fs/cgroup"), cgroups);

    // /dev
    let dev = root.join("dev");
    staging_dir(&mut s, &staging, "dev", 0o755, &dev, NOSUID | NOEXEC);
    for d in DEVICES {
        s.push(Step::File { path: dev.join(d) });
        s.push(Step::Bind {
            source: Path::new("/dev").join(d),
            target: dev.join(d),
            remount: 0,
        });
    }
    s.push(Step::Dir {
        path: dev.join("pts"),
        mode: 0o755,
    });
    s.push(Step::Mount {
        source: "devpts".into(),
        target: dev.join("pts"),
        fstype: "devpts".into(),
        flags: NOSUID | NOEXEC,
        data: Some("newinstance,ptmxmode=0666,mode=0620,gid=5".into()),
    });
    staging_dir(
        &mut s,
        &staging,
        "shm",
        0o1777,
        &dev.join("shm"),
        NOSUID | NODEV,
    );
    for (name, to) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        s.push(Step::Symlink {
            to: to.into(),
            link: dev.join(name),
        });
    }
    s.push(Step::Mark("pseudo_fs_mounted"));

    // /run
    staging_dir(
        &mut s,
        &staging,
        "run",
        0o755,
        &root.join("run"),
        NOSUID | NODEV,
    );
    s.push(Step::Dir {
        path: root.join("run/lock"),
        mode: 0o1777,
    });

    s.push(Step::Pivot { root });
    // After pivot_root, so that target paths (and any symlinks in them) resolve inside the
    // sandbox's root, never on the host. The detached mounts are held by fd.
    for (index, b) in spec.all_binds().into_iter().enumerate() {
        s.push(Step::AttachBind {
            index,
            target: b.target,
        });
    }
    s
}

/// Attaches the helper's clone of layer `i` at `lowers[i]`.
pub(crate) fn attach_lowers(s: &mut Vec<Step>, lowers: &[PathBuf]) {
    for (index, target) in lowers.iter().enumerate() {
        s.push(Step::AttachLower {
            index,
            target: target.clone(),
        });
    }
}

/// The overlay of `spec`'s layers (attached at `lowers`) and its upper directory, on
/// `root`.
pub(crate) fn overlay(spec: &SandboxSpec, lowers: &[PathBuf], root: &Path) -> Step {
    Step::Mount {
        source: "overlay".into(),
        target: root.to_path_buf(),
        fstype: "overlay".into(),
        flags: 0,
        data: Some(overlay_options(spec, lowers)),
    }
}

/// The mount points a root needs (made in the overlay's upper layer when the template
/// lacks them) and `/tmp` with its sticky mode.
pub(crate) fn root_dirs(s: &mut Vec<Step>, root: &Path) {
    for (d, mode) in [
        ("proc", 0o555),
        ("sys", 0o555),
        ("dev", 0o755),
        ("run", 0o755),
        ("tmp", 0o1777),
    ] {
        s.push(Step::Dir {
            path: root.join(d),
            mode,
        });
    }
}

/// `staging/name` (a directory of the staging tmpfs, `mode`) bound on `target` with `flags`.
fn staging_dir(
    s: &mut Vec<Step>,
    staging: &Path,
    name: &str,
    mode: u32,
    target: &Path,
    flags: libc::c_ulong,
) {
    s.push(Step::Dir {
        path: staging.join(name),
        mode,
    });
    s.push(Step::Dir {
        path: target.to_path_buf(),
        mode,
    });
    s.push(Step::Bind {
        source: staging.join(name),
        target: target.to_path_buf(),
        remount: flags,
    });
}

fn masks(s: &mut Vec<Step>, root: &Path, empty: &Path, prefix: &str) {
    for p in READONLY_PATHS.iter().filter(|p| p.starts_with(prefix)) {
        s.push(Step::ReadOnly {
            target: inside(root, p),
        });
    }
    for p in MASKED_FILES.iter().filter(|p| p.starts_with(prefix)) {
        s.push(Step::MaskFile {
            target: inside(root, p),
        });
    }
    for p in MASKED_DIRS.iter().filter(|p| p.starts_with(prefix)) {
        s.push(Step::MaskDir {
            empty: empty.to_path_buf(),
            target: inside(root, p),
        });
    }
}

/// Read-only cgroup filesystems at /sys/fs/cgroup. The sandbox's cgroup namespace is
/// rooted at its own cgroup, so it sees its limits and usage (envd's /metrics reads them)
/// as the root of each hierarchy, and nothing of the host's cgroup tree.
fn cgroup_mounts(s: &mut Vec<Step>, staging: &Path, target: &Path, cgroups: &InnerMounts) {
    let ro = RDONLY | NOSUID | NODEV | NOEXEC;
    match cgroups {
        InnerMounts::V2 => s.push(Step::Mount {
            source: "cgroup2".into(),
            target: target.to_path_buf(),
            fstype: "cgroup2".into(),
            flags: ro,
            data: None,
        }),
        InnerMounts::V1(hierarchies) => {
            // The directory tree is made in staging, then bound read-only, then the
            // hierarchies are mounted on its (read-only) directories.
            let cg = staging.join("cgroup");
            for h in hierarchies {
                s.push(Step::Dir {
                    path: cg.join(h),
                    mode: 0o755,
                });
                if h.contains(',') {
                    for c in h.split(',') {
                        s.push(Step::Symlink {
                            to: h.clone(),
                            link: cg.join(c),
                        });
                    }
                }
            }
            s.push(Step::Bind {
                source: cg,
                target: target.to_path_buf(),
                remount: ro,
            });
            for h in hierarchies {
                s.push(Step::Mount {
                    source: "cgroup".into(),
                    target: target.join(h),
                    fstype: "cgroup".into(),
                    flags: ro,
                    data: Some(h.clone()),
                });
            }
        }
    }
}

fn err(what: impl std::fmt::Display, e: std::io::Error) -> String {
    format!("{what}: {e}")
}

/// The helper's detached mounts: the idmapped clone of every layer (bottom first), of
/// every bind source, and the shared sysfs.
pub(crate) struct Mounts<'a> {
    /// `lowers[i]`: the idmapped clone of template layer `i`.
    pub lowers: &'a [OwnedFd],
    /// `binds[i]`: the detached mount of bind `i`.
    pub binds: &'a [OwnedFd],
    /// The binds' sources, only for messages.
    pub bind_sources: &'a [PathBuf],
    /// A clone of the shared sysfs (`shared_sysfs.rs`) for `/sys`; `None`: mount one.
    pub sysfs: Option<&'a OwnedFd>,
}

/// Executes `steps` with the detached mounts the helper sent.
pub(crate) fn execute(steps: &[Step], mounts: &Mounts<'_>) -> Result<(), String> {
    for step in steps {
        apply(step, mounts)?;
    }
    Ok(())
}

fn mount(
    source: &str,
    target: &Path,
    fstype: &str,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<(), String> {
    let fstype = CString::new(fstype).map_err(|_| "fstype contains NUL".to_string())?;
    sys::mount(Some(Path::new(source)), target, Some(&fstype), flags, data).map_err(|e| {
        err(
            format!("mount {source} on {} ({data:?})", target.display()),
            e,
        )
    })
}

fn apply(step: &Step, mounts: &Mounts) -> Result<(), String> {
    match step {
        Step::MakeRootPrivate => sys::mount(
            None,
            Path::new("/"),
            None,
            libc::MS_REC | libc::MS_PRIVATE,
            None,
        )
        .map_err(|e| err("make / private", e)),
        Step::Dir { path, mode } => ensure_dir(path, *mode),
        Step::File { path } => ensure_file(path),
        Step::Mount {
            source,
            target,
            fstype,
            flags,
            data,
        } => mount(source, target, fstype, *flags, data.as_deref()),
        Step::AttachLower { index, target } => {
            let fd = mounts
                .lowers
                .get(*index)
                .ok_or("helper sent too few template layers")?;
            sys::move_mount_to(fd.as_raw_fd(), target)
                .map_err(|e| err(format!("attach idmapped template layer {index}"), e))
        }
        Step::Bind {
            source,
            target,
            remount,
        } => bind(source, target, *remount),
        // No look before the bind: a missing target fails the bind itself (ENOENT), and a
        // directory's mask over a file (ENOTDIR), which is what "skipped if it does not
        // exist" means; one path walk instead of two.
        Step::MaskFile { target } => bind_unless(
            Path::new("/dev/null"),
            target,
            RDONLY | NOSUID | NOEXEC,
            &[libc::ENOENT],
        ),
        Step::MaskDir { empty, target } => bind_unless(
            empty,
            target,
            RDONLY | NOSUID | NODEV | NOEXEC,
            &[libc::ENOENT, libc::ENOTDIR],
        ),
        Step::ReadOnly { target } => bind_unless(
            target,
            target,
            RDONLY | NOSUID | NODEV | NOEXEC,
            &[libc::ENOENT],
        ),
        Step::Sysfs { target } => {
            if let Some(fd) = mounts.sysfs {
                return sys::move_mount_to(fd.as_raw_fd(), target)
                    .map_err(|e| err("attach the shared sysfs at /sys", e));
            }
            let flags = RDONLY | NOSUID | NODEV | NOEXEC;
            match sys::mount(
                Some(Path::new("sysfs")),
                target,
                Some(c"sysfs"),
                flags,
                None,
            ) {
                Ok(()) => Ok(()),
                // Some hosts refuse sysfs in a user namespace: the sandbox gets an empty /sys
                // (the masks and cgroup mounts below then find nothing to do or fail loudly).
                Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                    mount("tmpfs", target, "tmpfs", flags, Some("size=0"))
                }
                Err(e) => Err(err("mount /sys", e)),
            }
        }
        Step::Sysctl {
            path,
            value,
            missing_ok,
        } => match fs::write(path, value) {
            Err(e) if *missing_ok && e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            r => r.map_err(|e| err(format!("write {}", path.display()), e)),
        },
        Step::Symlink { to, link } => {
            symlink(to, link).map_err(|e| err(format!("symlink {} -> {to}", link.display()), e))
        }
        Step::Mark(name) => {
            mark(name);
            Ok(())
        }
        Step::Pivot { root } => pivot(root),
        Step::Move { from, to } => sys::move_mount_path(from, to)
            .map_err(|e| err(format!("move {} to {}", from.display(), to.display()), e)),
        Step::Detach { target } => cubicle_syscalls::fs::unmount_detach(target)
            .map_err(|e| err(format!("detach {}", target.display()), e)),
        Step::AttachBind { index, target } => {
            let fd = mounts
                .binds
                .get(*index)
                .ok_or("helper sent too few bind mounts")?;
            let source = mounts
                .bind_sources
                .get(*index)
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            attach_bind(fd, &source, target)
        }
    }
}

/// The process's umask (read once: this single-threaded child does not change it
/// before the root filesystem is built).
fn umask() -> u32 {
    static UMASK: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *UMASK.get_or_init(|| {
        // SAFETY: umask has no memory arguments; the old value is put back at once.
        unsafe {
            let m = libc::umask(0o022);
            libc::umask(m);
            m
        }
    })
}

/// A directory at `path` with `mode`, made with its parents if missing; an existing
/// directory is left as it is. Most of the plan's directories are new (in the fresh
/// staging tmpfs): one `mkdir` makes them, with a `chmod` only for the bits the umask
/// cleared (the sticky `/tmp`).
fn ensure_dir(path: &Path, mode: u32) -> Result<(), String> {
    match fs::DirBuilder::new().mode(mode).create(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            return if path.is_dir() {
                Ok(())
            } else {
                Err(err(format!("mkdir {}", path.display()), e))
            };
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(mode)
                .create(path)
                .map_err(|e| err(format!("mkdir {}", path.display()), e))?;
        }
        Err(e) => return Err(err(format!("mkdir {}", path.display()), e)),
    }
    if mode & umask() == 0 {
        return Ok(());
    }
    // The umask cleared bits (e.g. the sticky /tmp).
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .map_err(|e| err(format!("chmod {}", path.display()), e))
}

/// An empty regular file at `path` (and its parents) if nothing is there; whatever is
/// there is left as it is, never opened (it may be a tenant's FIFO).
fn ensure_file(path: &Path) -> Result<(), String> {
    let create = || {
        fs::OpenOptions::new()
            .create_new(true)
            .write(true)
            .open(path)
    };
    let made = match create() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match path.parent() {
            Some(parent) => {
                ensure_dir(parent, 0o755)?;
                create()
            }
            None => Err(e),
        },
        r => r,
    };
    match made {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(err(format!("create {}", path.display()), e)),
    }
}

fn bind(source: &Path, target: &Path, remount: libc::c_ulong) -> Result<(), String> {
    bind_unless(source, target, remount, &[])
}

/// [`bind`], or nothing when the bind fails with one of `skip` (a missing target).
fn bind_unless(
    source: &Path,
    target: &Path,
    remount: libc::c_ulong,
    skip: &[i32],
) -> Result<(), String> {
    match sys::mount(Some(source), target, None, libc::MS_BIND, None) {
        Err(e) if e.raw_os_error().is_some_and(|c| skip.contains(&c)) => return Ok(()),
        r => r.map_err(|e| {
            err(
                format!("bind {} on {}", source.display(), target.display()),
                e,
            )
        })?,
    }
    if remount != 0 {
        sys::mount(
            None,
            target,
            None,
            libc::MS_BIND | libc::MS_REMOUNT | remount,
            None,
        )
        .map_err(|e| {
            err(
                format!("remount {} with flags {remount:#x}", target.display()),
                e,
            )
        })?;
    }
    Ok(())
}

fn attach_bind(fd: &OwnedFd, source: &str, target: &Path) -> Result<(), String> {
    // SAFETY: zeroed stat is a valid out buffer; fd is a valid mount fd.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0 {
        return Err(err(
            format!("stat bind source {source}"),
            std::io::Error::last_os_error(),
        ));
    }
    if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
        ensure_dir(target, 0o755)?;
    } else {
        ensure_file(target)?;
    }
    sys::move_mount_to(fd.as_raw_fd(), target)
        .map_err(|e| err(format!("bind {source} at {}", target.display()), e))
}

fn pivot(root: &Path) -> Result<(), String> {
    std::env::set_current_dir(root).map_err(|e| err("chdir new root", e))?;
    let dot = Path::new(".");
    sys::pivot_root(dot, dot).map_err(|e| err("pivot_root", e))?;
    cubicle_syscalls::fs::unmount_detach(dot).map_err(|e| err("detach old root", e))?;
    std::env::set_current_dir("/").map_err(|e| err("chdir /", e))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::spec::BindMount;

    fn spec() -> SandboxSpec {
        let mut s = SandboxSpec::new(
            "abc",
            "/t/rootfs",
            "/s/abc",
            100_000,
            vec!["/bin/sh".into()],
        );
        s.envd_binary = Some("/usr/bin/cubicle-envd".into());
        s.binds.push(BindMount {
            source: "/data".into(),
            target: "/opt/data".into(),
            readonly: true,
            idmapped: false,
        });
        s
    }

    fn v1() -> InnerMounts {
        InnerMounts::V1(vec![
            "memory".into(),
            "cpu,cpuacct".into(),
            "pids".into(),
            "freezer".into(),
        ])
    }

    fn target(step: &Step) -> Option<&Path> {
        match step {
            Step::Dir { path, .. } | Step::File { path } => Some(path),
            Step::Mount { target, .. }
            | Step::AttachLower { target, .. }
            | Step::Bind { target, .. }
            | Step::MaskFile { target }
            | Step::MaskDir { target, .. }
            | Step::ReadOnly { target }
            | Step::Sysfs { target }
            | Step::AttachBind { target, .. }
            | Step::Detach { target }
            | Step::Move { to: target, .. } => Some(target),
            Step::Sysctl { path, .. } => Some(path),
            Step::Symlink { link, .. } => Some(link),
            Step::Pivot { root } => Some(root),
            Step::MakeRootPrivate | Step::Mark(_) => None,
        }
    }

    pub(crate) fn position(steps: &[Step], f: impl Fn(&Step) -> bool) -> usize {
        steps.iter().position(f).expect("step present")
    }

    #[test]
    fn starts_private_and_pivots_once() {
        let steps = plan(&spec(), &v1());
        assert_eq!(steps[0], Step::MakeRootPrivate);
        assert_eq!(
            steps
                .iter()
                .filter(|s| matches!(s, Step::Pivot { .. }))
                .count(),
            1
        );
        assert_eq!(
            steps.iter().find(|s| matches!(s, Step::Pivot { .. })),
            Some(&Step::Pivot {
                root: "/s/abc/rootfs/root".into()
            })
        );
    }

    /// Before the pivot, nothing is created or mounted outside the staging directory, so a
    /// mistake cannot touch host paths (in the sandbox's mount namespace or on disk).
    #[test]
    fn before_pivot_everything_stays_in_staging() {
        let steps = plan(&spec(), &v1());
        let pivot = position(&steps, |s| matches!(s, Step::Pivot { .. }));
        for s in &steps[1..pivot] {
            if let Step::Bind { source, .. } | Step::MaskDir { empty: source, .. } = s {
                assert!(
                    source.starts_with("/dev/") || source.starts_with("/s/abc/rootfs/"),
                    "only host devices and staging are bound: {s:?}"
                );
            }
            if let Some(t) = target(s) {
                assert!(
                    t.starts_with("/s/abc/rootfs"),
                    "{s:?} targets a path outside staging"
                );
            }
        }
    }

    #[test]
    fn a_shell_roots_in_its_tmpfs_with_no_layer() {
        let mut shell = spec();
        shell.shell = true;
        shell.binds.clear();
        let steps = plan(&shell, &v1());
        assert!(!steps.iter().any(|s| matches!(s, Step::AttachLower { .. })));
        assert!(
            !steps
                .iter()
                .any(|s| matches!(s, Step::Mount { fstype, .. } if fstype == "overlay"))
        );
        let root = Path::new("/s/abc/rootfs/root");
        let bound = position(
            &steps,
            |s| matches!(s, Step::Bind { source, target, .. } if source == root && target == root),
        );
        let proc = position(
            &steps,
            |s| matches!(s, Step::Mount { fstype, .. } if fstype == "proc"),
        );
        assert!(bound < proc);
        assert!(matches!(steps.last(), Some(Step::AttachBind { .. })));
        assert!(
            steps
                .iter()
                .any(|s| matches!(s, Step::Pivot { root: r } if r == root))
        );
    }

    #[test]
    fn overlay_uses_idmapped_lower_and_private_upper() {
        let steps = plan(&spec(), &v1());
        let attach = position(&steps, |s| matches!(s, Step::AttachLower { .. }));
        let overlay = position(
            &steps,
            |s| matches!(s, Step::Mount { fstype, .. } if fstype == "overlay"),
        );
        assert!(attach < overlay);
        let Step::Mount {
            data: Some(opts),
            target,
            ..
        } = &steps[overlay]
        else {
            unreachable!()
        };
        assert_eq!(target, Path::new("/s/abc/rootfs/root"));
        assert_eq!(
            opts,
            "lowerdir=/s/abc/rootfs/lower,upperdir=/s/abc/upper,workdir=/s/abc/work,userxattr,volatile"
        );
    }

    /// `ping_group_range` and IPv6's default are written through the sandbox's own
    /// /proc: after that proc is mounted, before /proc/sys is bound read-only.
    #[test]
    fn sysctls_go_through_the_sandboxs_own_proc() {
        let steps = plan(&spec(), &v1());
        let proc = position(
            &steps,
            |s| matches!(s, Step::Mount { fstype, .. } if fstype == "proc"),
        );
        let sysctl = position(&steps, |s| matches!(s, Step::Sysctl { .. }));
        let ipv6 = position(
            &steps,
            |s| matches!(s, Step::Sysctl { path, .. } if path.ends_with("default/disable_ipv6")),
        );
        let read_only = position(
            &steps,
            |s| matches!(s, Step::ReadOnly { target } if target.ends_with("proc/sys")),
        );
        assert!(proc < sysctl && sysctl < read_only);
        assert!(proc < ipv6 && ipv6 < read_only);
        assert_eq!(
            steps[sysctl],
            Step::Sysctl {
                path: "/s/abc/rootfs/root/proc/sys/net/ipv4/ping_group_range".into(),
                value: format!("0 {}\n", spec().uid_count - 1),
                missing_ok: false,
            }
        );
    }

    /// A template of several layers: every layer is attached (bottom = fd 0) before the
    /// overlay, which lists them top first.
    #[test]
    fn layers_stack_bottom_first_and_overlay_lists_them_top_first() {
        let mut sp = spec();
        sp.layers = vec!["/t/l1".into(), "/t/l2".into()];
        let steps = plan(&sp, &v1());
        let attached: Vec<_> = steps
            .iter()
            .filter_map(|s| match s {
                Step::AttachLower { index, target } => Some((*index, target.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(
            attached,
            vec![
                (0, PathBuf::from("/s/abc/rootfs/lower")),
                (1, PathBuf::from("/s/abc/rootfs/lower1")),
                (2, PathBuf::from("/s/abc/rootfs/lower2")),
            ]
        );
        let opts = steps
            .iter()
            .find_map(|s| match s {
                Step::Mount {
                    fstype,
                    data: Some(d),
                    ..
                } if fstype == "overlay" => Some(d.clone()),
                _ => None,
            })
            .unwrap();
        assert!(
            opts.starts_with(
                "lowerdir=/s/abc/rootfs/lower2:/s/abc/rootfs/lower1:/s/abc/rootfs/lower,"
            ),
            "{opts}"
        );
    }

    #[test]
    fn proc_is_masked_right_after_mounting() {
        let steps = plan(&spec(), &v1());
        let proc_at = position(
            &steps,
            |s| matches!(s, Step::Mount { fstype, .. } if fstype == "proc"),
        );
        let pivot = position(&steps, |s| matches!(s, Step::Pivot { .. }));
        for f in MASKED_FILES.iter().filter(|p| p.starts_with("/proc/")) {
            let want = Step::MaskFile {
                target: inside(Path::new("/s/abc/rootfs/root"), f),
            };
            let at = position(&steps, |s| *s == want);
            assert!(proc_at < at && at < pivot, "{f}");
        }
        for p in READONLY_PATHS {
            assert!(steps.contains(&Step::ReadOnly {
                target: inside(Path::new("/s/abc/rootfs/root"), p)
            }));
        }
    }

    #[test]
    fn sys_and_cgroups_read_only() {
        let steps = plan(&spec(), &v1());
        for s in &steps {
            if let Step::Mount { fstype, flags, .. } = s
                && (fstype == "cgroup" || fstype == "cgroup2")
            {
                assert_ne!(flags & RDONLY, 0, "{s:?}");
            }
        }
        let cg = Path::new("/s/abc/rootfs/root/sys/fs/cgroup");
        assert!(steps.contains(&Step::Symlink {
            to: "cpu,cpuacct".into(),
            link: "/s/abc/rootfs/cgroup/cpuacct".into()
        }));
        assert!(matches!(
            steps.iter().rev().find(|s| target(s) == Some(cg)),
            Some(Step::Bind { remount, .. }) if remount & RDONLY != 0
        ));
        let v2 = plan(&spec(), &InnerMounts::V2);
        assert!(v2.iter().any(|s| matches!(s, Step::Mount { fstype, target, .. } if fstype == "cgroup2" && target == cg)));
    }

    #[test]
    fn dev_has_devices_and_private_ptys() {
        let steps = plan(&spec(), &v1());
        let dev = Path::new("/s/abc/rootfs/root/dev");
        for d in DEVICES {
            assert!(steps.contains(&Step::Bind {
                source: Path::new("/dev").join(d),
                target: dev.join(d),
                remount: 0
            }));
        }
        assert!(
            steps
                .iter()
                .any(|s| matches!(s, Step::Mount { fstype, data: Some(d), .. }
            if fstype == "devpts" && d.contains("newinstance")))
        );
        assert!(steps.contains(&Step::Symlink {
            to: "pts/ptmx".into(),
            link: dev.join("ptmx")
        }));
    }

    #[test]
    fn binds_attach_after_pivot_inside_the_sandbox() {
        let s = spec();
        let steps = plan(&s, &v1());
        let pivot = position(&steps, |s| matches!(s, Step::Pivot { .. }));
        let binds: Vec<&Step> = steps[pivot + 1..].iter().collect();
        let want: Vec<Step> = s
            .all_binds()
            .into_iter()
            .enumerate()
            .map(|(index, b)| Step::AttachBind {
                index,
                target: b.target,
            })
            .collect();
        assert_eq!(binds, want.iter().collect::<Vec<_>>());
        assert!(want.contains(&Step::AttachBind {
            index: 1,
            target: crate::spec::ENVD_PATH.into()
        }));
        assert!(want.contains(&Step::AttachBind {
            index: 2,
            target: crate::spec::CTL_DIR.into()
        }));
    }
}
