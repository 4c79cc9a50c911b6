//! What checkpoint/restore (crate `cubicle-checkpoint`, which drives CRIU) needs from the
//! isolation layer: which of a sandbox's mounts come from outside its mount namespace, and
//! how to re-create their sources and its root for a restore.
//!
//! A sandbox's mount tree (`rootfs.rs`) is built from things CRIU cannot see from inside
//! the sandbox: directories of the staging tmpfs whose own root is mounted nowhere
//! (`/dev`, `/dev/shm`, `/run`, `/sys/fs/cgroup`, the masked directories), host device
//! nodes, `/dev/null` over masked files, and the bind mounts of the spec (envd, ctl
//! directory, `/etc/hosts`, …). [`external_mounts`] lists them, derived from the very plan
//! `rootfs.rs` executes, so the two cannot drift apart. A dump marks each of them
//! external (keyed by its mount point); a restore hands CRIU a source for each key.
//!
//! [`prepare_restore_root`] builds, in the caller's private mount namespace, what a
//! restore needs before CRIU runs:
//!
//! 1. the staging tmpfs, mounted by root of a throwaway user namespace with the
//!    sandbox's id map, with the template's idmapped layers attached where a fresh
//!    sandbox has them (`rootfs.rs`); the overlay over them comes later, from the
//!    restored sandbox's own user namespace ([`mount_restore_overlay`], at CRIU's
//!    `setup-namespaces`), so that setuid programs work in it;
//! 2. the staging tmpfs's contents (the caller fills them: they were saved at the dump);
//! 3. one source per external mount, carrying the mount flags the sandbox had (CRIU
//!    re-creates external bind mounts without their flags: a read-only mask would come
//!    back writable). A bind copies its source's flags, and in the sandbox's user
//!    namespace they are locked.

use std::collections::BTreeMap;
use std::fs;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt, chown, symlink};
use std::path::{Path, PathBuf};

use crate::cgroup::{Cgroup, InnerMounts};
use crate::error::{Error, Result};
use crate::rootfs::{Step, plan};
use crate::spec::{BindMount, SandboxSpec};
use crate::sys;

/// Where a mount of the sandbox comes from (outside its mount namespace).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExternalSource {
    /// A directory of the sandbox's staging tmpfs (`dev`, `shm`, `run`, `cgroup`,
    /// `empty`), bound with these `MS_*` flags.
    Staging {
        /// The directory's name in the staging tmpfs.
        dir: String,
        /// `MS_RDONLY`, `MS_NOSUID`, … of the bind.
        flags: u64,
    },
    /// A host device node bound read-write (`/dev/null`, `/dev/zero`, …).
    Device(PathBuf),
    /// `/dev/null` bound read-only over a masked file.
    NullMask,
    /// A bind mount of the spec (the agent binary, the ctl directory, extra binds,
    /// volumes).
    Bind {
        /// Host path.
        source: PathBuf,
        /// Read-only (always also nosuid, nodev).
        readonly: bool,
        /// Idmapped into the sandbox's user namespace (a volume): a restore maps it
        /// through its own user namespace, which has the sandbox's id map.
        idmapped: bool,
    },
}

impl ExternalSource {
    /// Whether the sandbox can write into this mount (its contents must be saved).
    pub fn is_writable_staging(&self) -> Option<&str> {
        match self {
            ExternalSource::Staging { dir, flags } if flags & libc::MS_RDONLY == 0 => {
                Some(dir.as_str())
            }
            _ => None,
        }
    }
}

/// A mount of the sandbox whose source lives outside its mount namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExternalMount {
    /// Mount point inside the sandbox (absolute).
    pub mountpoint: PathBuf,
    /// What is mounted there.
    pub source: ExternalSource,
}

/// Every external mount a sandbox made from `spec` can have on this host (masks of
/// paths the kernel does not have are listed too; a dump uses those present).
pub fn external_mounts(spec: &SandboxSpec) -> Result<Vec<ExternalMount>> {
    let cg = Cgroup::handle(&spec.id)?;
    Ok(external_mounts_for(spec, &cg.inner_mounts()))
}

/// [`external_mounts`] for a given cgroup layout (pure).
pub(crate) fn external_mounts_for(spec: &SandboxSpec, cgroups: &InnerMounts) -> Vec<ExternalMount> {
    let staging = spec.mount_dir();
    let root = staging.join("root");
    let inside = |p: &Path| -> Option<PathBuf> {
        p.strip_prefix(&root).ok().map(|r| Path::new("/").join(r))
    };
    let binds = spec.all_binds();
    let mut out = Vec::new();
    for step in plan(spec, cgroups) {
        let (target, source) = match step {
            Step::Bind {
                source,
                target,
                remount,
            } => {
                let Some(mp) = inside(&target) else { continue };
                let src = if let Ok(rel) = source.strip_prefix(&staging) {
                    ExternalSource::Staging {
                        dir: rel.to_string_lossy().into_owned(),
                        flags: remount,
                    }
                } else if source.starts_with("/dev") {
                    ExternalSource::Device(source)
                } else {
                    continue;
                };
                (mp, src)
            }
            Step::MaskFile { target } => match inside(&target) {
                Some(mp) => (mp, ExternalSource::NullMask),
                None => continue,
            },
            Step::MaskDir { empty, target } => {
                let (Some(mp), Ok(rel)) = (inside(&target), empty.strip_prefix(&staging)) else {
                    continue;
                };
                let flags = libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
                (
                    mp,
                    ExternalSource::Staging {
                        dir: rel.to_string_lossy().into_owned(),
                        flags,
                    },
                )
            }
            Step::AttachBind { index, target } => match binds.get(index) {
                Some(b) => (
                    target,
                    ExternalSource::Bind {
                        source: b.source.clone(),
                        readonly: b.readonly,
                        idmapped: b.idmapped,
                    },
                ),
                None => continue,
            },
            _ => continue,
        };
        out.push(ExternalMount {
            mountpoint: target,
            source,
        });
    }
    out
}

/// What [`prepare_restore_root`] made.
#[derive(Debug)]
pub struct RestoreRoot {
    /// The overlay to hand CRIU as `--root`.
    pub root: PathBuf,
    /// The staging tmpfs.
    pub staging: PathBuf,
    /// Mount point inside the sandbox → host path of its source.
    pub sources: BTreeMap<PathBuf, PathBuf>,
}

/// Builds the root and the external mounts' sources of a sandbox about to be restored
/// from a checkpoint that has the external mounts `mountpoints`; the sources are mounted
/// below `sources_dir` (an empty directory the caller owns, e.g. on a private tmpfs).
///
/// The caller must be single-threaded (it clones a child like `fork`), running as the
/// host's root, in a private mount namespace of its own (everything mounted here
/// disappears with it; CRIU copies what the sandbox needs). `fill_staging` re-creates the
/// staging tmpfs's saved contents (`dev/`, `shm/`, `run/`) below the path it is given; it
/// runs as root of the throwaway user namespace (the tmpfs belongs to it), so ids are the
/// sandbox's own (0 = its root) and files it reads must have been opened beforehand.
pub fn prepare_restore_root(
    spec: &SandboxSpec,
    mountpoints: &[PathBuf],
    sources_dir: &Path,
    fill_staging: &mut dyn FnMut(&Path) -> Result<()>,
) -> Result<RestoreRoot> {
    spec.validate()?;
    crate::rootfs::clear_volatile_marker(spec)?;
    let cg = Cgroup::handle(&spec.id)?;
    let known = external_mounts_for(spec, &cg.inner_mounts());
    let staging = spec.mount_dir();
    let userns = mount_staging_and_root(spec, &cg.inner_mounts(), fill_staging)?;

    // Searchable by all: CRIU binds these from inside the sandbox's user namespace. The
    // directory only exists in the caller's private mount namespace.
    let src_dir = sources_dir.to_path_buf();
    make_dir(&src_dir, 0o755)?;
    let mut sources = BTreeMap::new();
    let mut null_mask: Option<PathBuf> = None;
    for (i, mp) in mountpoints.iter().enumerate() {
        let ext = known.iter().find(|e| &e.mountpoint == mp).ok_or_else(|| {
            Error::Setup(format!(
                "the checkpoint has an external mount at {} that this sandbox does not have",
                mp.display()
            ))
        })?;
        let path = match &ext.source {
            ExternalSource::Device(p) => p.clone(),
            ExternalSource::NullMask => match &null_mask {
                Some(p) => p.clone(),
                None => {
                    let p = src_dir.join("null");
                    make_file(&p)?;
                    bind_with_flags(
                        Path::new("/dev/null"),
                        &p,
                        libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NOEXEC,
                    )?;
                    null_mask = Some(p.clone());
                    p
                }
            },
            ExternalSource::Staging { dir, flags } => {
                let p = src_dir.join(i.to_string());
                make_dir(&p, 0o755)?;
                bind_with_flags(&staging.join(dir), &p, *flags as libc::c_ulong)?;
                p
            }
            ExternalSource::Bind {
                source,
                readonly,
                idmapped,
            } => {
                let p = src_dir.join(i.to_string());
                let bind = BindMount {
                    source: source.clone(),
                    target: mp.clone(),
                    readonly: *readonly,
                    idmapped: *idmapped,
                };
                let fd = crate::helper::bind_source(&bind, userns.as_raw_fd())?;
                if source.is_dir() {
                    make_dir(&p, 0o755)?;
                } else {
                    make_file(&p)?;
                }
                sys::move_mount_to(fd.as_raw_fd(), &p)
                    .map_err(|e| Error::io(format!("attach {}", source.display()), e))?;
                p
            }
        };
        sources.insert(mp.clone(), path);
    }
    Ok(RestoreRoot {
        root: staging.join("root"),
        staging,
        sources,
    })
}

/// The staging tmpfs with the template's layers (idmapped) at `lower`, `lower1`, … and
/// an empty `root` for [`mount_restore_overlay`],
/// mounted by root of a throwaway user namespace with the sandbox's map, then
/// attached here. Returns that user namespace (the descriptor keeps it alive after its
/// process is gone): the volumes' sources are idmapped through it.
fn mount_staging_and_root(
    spec: &SandboxSpec,
    cgroups: &InnerMounts,
    fill_staging: &mut dyn FnMut(&Path) -> Result<()>,
) -> Result<fs::File> {
    let staging = spec.mount_dir();
    let (parent_sock, child_sock) =
        cubicle_syscalls::socket::seqpacket_pair().map_err(|e| Error::io("socketpair", e))?;
    // The child (root of a user namespace, an unprivileged host uid) reaches the sandbox
    // directory through its working directory, as a sandbox's child does: the state
    // directory above is root's alone (0700).
    std::env::set_current_dir(&spec.sandbox_dir)
        .map_err(|e| Error::io(format!("chdir {}", spec.sandbox_dir.display()), e))?;
    let flags = libc::CLONE_NEWUSER | libc::CLONE_NEWNS;
    // SAFETY: the caller is single-threaded (documented contract of prepare_restore_root),
    // so a fork-like clone (no new stack) is as safe as fork(); the child only makes
    // system calls and exits with _exit.
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
        return Err(Error::io(
            "clone a user namespace for the restore's root",
            std::io::Error::last_os_error(),
        ));
    }
    if pid == 0 {
        drop(parent_sock);
        let code = match root_child(spec, cgroups, fill_staging, &child_sock) {
            Ok(()) => 0,
            Err(msg) => {
                let _ = sys::send_with_fds(child_sock.as_raw_fd(), msg.as_bytes(), &[]);
                1
            }
        };
        // SAFETY: leave the child without running the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    let pid = pid as i32;
    drop(child_sock);
    let res = (|| -> Result<fs::File> {
        let map = format!("0 {} {}\n", spec.uid_base, spec.uid_count);
        for file in ["uid_map", "gid_map"] {
            let path = format!("/proc/{pid}/{file}");
            fs::write(&path, &map).map_err(|e| Error::io(format!("write {path}"), e))?;
        }
        let userns = fs::File::open(format!("/proc/{pid}/ns/user"))
            .map_err(|e| Error::io("open the restore's user namespace", e))?;
        let lowers = spec
            .lowers()
            .into_iter()
            .map(|layer| crate::helper::idmapped_layer(layer, userns.as_raw_fd()))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(Error::Setup)?;
        let raw: Vec<RawFd> = lowers.iter().map(|f| f.as_raw_fd()).collect();
        sys::send_with_fds(parent_sock.as_raw_fd(), b"go", &raw)
            .map_err(|e| Error::io("release the restore's root child", e))?;
        let (msg, fds) = sys::recv_with_fds(parent_sock.as_raw_fd(), 1)
            .map_err(|e| Error::io("receive the restore's root", e))?;
        let Some(tree) = fds.into_iter().next() else {
            return Err(Error::Setup(format!(
                "building the restore's root: {}",
                String::from_utf8_lossy(&msg)
            )));
        };
        sys::move_mount_to(tree.as_raw_fd(), &staging).map_err(|e| {
            Error::io(
                format!("attach the staging tmpfs at {}", staging.display()),
                e,
            )
        })?;
        Ok(userns)
    })();
    if res.is_err() {
        // SAFETY: kill with integer arguments.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let mut status = 0;
    // SAFETY: waitpid on our own child with a valid out pointer.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    let _ = std::env::set_current_dir("/");
    res
}

/// Mounts the overlay root of a sandbox being restored at `root` of its staging tmpfs,
/// from inside the user and mount namespaces CRIU made for it: `pid` is the restored
/// init's host pid at CRIU's `setup-namespaces` (namespaces made, nothing restored in them
/// yet, its mount namespace a copy of the one [`prepare_restore_root`] filled). CRIU binds
/// its `--root` from that mount namespace, so the sandbox's `/` is this overlay.
///
/// Why not earlier, with the rest of the root: the kernel honours setuid bits only on a
/// mount whose filesystem belongs to the caller's user namespace or an ancestor of it
/// (`mnt_may_suid`). An overlay mounted by root of the throwaway user namespace would make
/// `sudo` and every setuid program of the restored sandbox fail; one mounted by the host's
/// root cannot create its work directory through the idmapped layers. Mounted here it
/// belongs to the sandbox's user namespace, as a fresh sandbox's does.
///
/// The caller must be single-threaded (it enters a user namespace) and running as the
/// host's root; a throwaway process, as it stays in the sandbox's namespaces.
pub fn mount_restore_overlay(spec: &SandboxSpec, pid: i32) -> Result<()> {
    let open = |path: String, flags: libc::c_int| {
        let c = std::ffi::CString::new(path.clone())
            .map_err(|_| Error::Setup(format!("path with a NUL byte: {path}")))?;
        // SAFETY: open of a NUL-terminated path; the result is checked.
        let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(Error::io(
                format!("open {path}"),
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: a fresh descriptor we own.
        Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
    };
    // The sandbox directory as the init's mount namespace has it (the host root's view:
    // the state directory above is 0700), opened before leaving the host's user namespace.
    let dir = open(
        format!("/proc/{pid}/root{}", spec.sandbox_dir.display()),
        libc::O_PATH | libc::O_DIRECTORY,
    )?;
    let userns = open(format!("/proc/{pid}/ns/user"), libc::O_RDONLY)?;
    let mntns = open(format!("/proc/{pid}/ns/mnt"), libc::O_RDONLY)?;
    for (ns, flag, what) in [
        (&userns, libc::CLONE_NEWUSER, "user"),
        (&mntns, libc::CLONE_NEWNS, "mount"),
    ] {
        // SAFETY: setns on an open namespace descriptor (single-threaded caller).
        if unsafe { libc::setns(ns.as_raw_fd(), flag) } < 0 {
            return Err(Error::io(
                format!("enter the {what} namespace of the restored init {pid}"),
                std::io::Error::last_os_error(),
            ));
        }
    }
    // SAFETY: fchdir on an open directory descriptor.
    if unsafe { libc::fchdir(dir.as_raw_fd()) } < 0 {
        return Err(Error::io(
            format!("enter {}", spec.sandbox_dir.display()),
            std::io::Error::last_os_error(),
        ));
    }
    crate::child::become_root().map_err(Error::Setup)?;
    // Paths relative to the sandbox directory, our working directory.
    let mut here = spec.clone();
    here.sandbox_dir = PathBuf::from(".");
    let lowers = crate::rootfs::lower_mount_points(&here);
    let opts = crate::rootfs::overlay_options(&here, &lowers);
    sys::mount(
        Some(Path::new("overlay")),
        &here.mount_dir().join("root"),
        Some(c"overlay"),
        0,
        Some(&opts),
    )
    .map_err(|e| Error::io(format!("mount the restore's overlay ({opts})"), e))
}

/// In the throwaway user namespace: staging tmpfs and lower layers; the whole tree goes
/// back to the parent as one detached mount.
fn root_child(
    spec: &SandboxSpec,
    cgroups: &InnerMounts,
    fill_staging: &mut dyn FnMut(&Path) -> Result<()>,
    sock: &OwnedFd,
) -> std::result::Result<(), String> {
    let layers = spec.lowers().len();
    let (msg, lower_fds) =
        sys::recv_with_fds(sock.as_raw_fd(), layers).map_err(|e| format!("wait: {e}"))?;
    if msg != b"go" {
        return Err("parent gave up".into());
    }
    if lower_fds.len() != layers {
        return Err(format!(
            "got {} template layer mounts for {layers} layers",
            lower_fds.len()
        ));
    }
    crate::child::become_root()?;
    // Paths relative to the sandbox directory, our working directory (see the caller).
    let mut here = spec.clone();
    here.sandbox_dir = PathBuf::from(".");
    let spec = &here;
    let staging = spec.mount_dir();
    // NOSUID only (not NODEV as at spawn): this tmpfs reaches the sandbox through a mount
    // namespace copied into its user namespace, which locks every flag it has — a nodev
    // here would make `/dev` unusable (its bind is not nodev).
    sys::mount(
        Some(Path::new("tmpfs")),
        &staging,
        Some(c"tmpfs"),
        libc::MS_NOSUID,
        Some("mode=0755"),
    )
    .map_err(|e| format!("mount the staging tmpfs: {e}"))?;
    fill_staging(&staging).map_err(|e| format!("restore the staging tmpfs: {e}"))?;
    static_staging_dirs(&staging, cgroups).map_err(|e| e.to_string())?;
    let lowers = crate::rootfs::lower_mount_points(spec);
    let root = staging.join("root");
    for d in lowers.iter().chain([&root]) {
        fs::DirBuilder::new()
            .mode(0o755)
            .create(d)
            .map_err(|e| format!("mkdir {}: {e}", d.display()))?;
    }
    for (fd, target) in lower_fds.iter().zip(&lowers) {
        sys::move_mount_to(fd.as_raw_fd(), target)
            .map_err(|e| format!("attach idmapped template layer {}: {e}", target.display()))?;
    }
    // No overlay at `root` yet: [`mount_restore_overlay`] mounts it from the restored
    // sandbox's own user namespace once CRIU has made it.
    let tree = sys::open_tree_clone_recursive(&staging)
        .map_err(|e| format!("clone the staging tree: {e}"))?;
    sys::send_with_fds(sock.as_raw_fd(), b"root", &[tree.as_raw_fd() as RawFd])
        .map_err(|e| format!("send the root: {e}"))
}

/// The staging directories no checkpoint saves because the sandbox cannot write them:
/// the empty directory behind masks and the cgroup mount points.
/// Runs as root of the throwaway user namespace: owner 0 is the sandbox's root.
fn static_staging_dirs(staging: &Path, cgroups: &InnerMounts) -> Result<()> {
    let owner = 0;
    let empty = staging.join("empty");
    make_dir(&empty, 0o555)?;
    chown(&empty, Some(owner), Some(owner)).map_err(|e| Error::io("chown empty", e))?;
    if let InnerMounts::V1(hierarchies) = cgroups {
        let cg = staging.join("cgroup");
        make_dir(&cg, 0o755)?;
        chown(&cg, Some(owner), Some(owner)).map_err(|e| Error::io("chown cgroup", e))?;
        for h in hierarchies {
            let d = cg.join(h);
            make_dir(&d, 0o755)?;
            chown(&d, Some(owner), Some(owner)).map_err(|e| Error::io("chown cgroup", e))?;
            if h.contains(',') {
                for c in h.split(',') {
                    let link = cg.join(c);
                    if fs::symlink_metadata(&link).is_err() {
                        symlink(h, &link)
                            .map_err(|e| Error::io(format!("symlink {}", link.display()), e))?;
                    }
                }
            }
        }
    }
    Ok(())
}

fn make_dir(path: &Path, mode: u32) -> Result<()> {
    if !path.is_dir() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(mode)
            .create(path)
            .map_err(|e| Error::io(format!("mkdir {}", path.display()), e))?;
    }
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .map_err(|e| Error::io(format!("chmod {}", path.display()), e))
}

fn make_file(path: &Path) -> Result<()> {
    fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map(drop)
        .map_err(|e| Error::io(format!("create {}", path.display()), e))
}

fn bind_with_flags(source: &Path, target: &Path, flags: libc::c_ulong) -> Result<()> {
    sys::mount(Some(source), target, None, libc::MS_BIND, None).map_err(|e| {
        Error::io(
            format!("bind {} on {}", source.display(), target.display()),
            e,
        )
    })?;
    if flags != 0 {
        sys::mount(
            None,
            target,
            None,
            libc::MS_BIND | libc::MS_REMOUNT | flags,
            None,
        )
        .map_err(|e| {
            Error::io(
                format!("remount {} with flags {flags:#x}", target.display()),
                e,
            )
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{BindMount, CTL_DIR, ENVD_PATH};

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
        s.binds.push(BindMount {
            source: "/volumes/v1".into(),
            target: "/mnt/vol".into(),
            readonly: false,
            idmapped: true,
        });
        s
    }

    fn find(list: &[ExternalMount], mp: &str) -> ExternalSource {
        list.iter()
            .find(|e| e.mountpoint == Path::new(mp))
            .unwrap_or_else(|| panic!("{mp} is not listed"))
            .source
            .clone()
    }

    #[test]
    fn every_mount_from_outside_is_listed_with_its_source() {
        let l = external_mounts_for(
            &spec(),
            &InnerMounts::V1(vec!["memory".into(), "cpu,cpuacct".into()]),
        );
        let staging = |dir: &str, flags: libc::c_ulong| ExternalSource::Staging {
            dir: dir.into(),
            flags,
        };
        assert_eq!(
            find(&l, "/dev"),
            staging("dev", libc::MS_NOSUID | libc::MS_NOEXEC)
        );
        assert_eq!(
            find(&l, "/dev/shm"),
            staging("shm", libc::MS_NOSUID | libc::MS_NODEV)
        );
        assert_eq!(
            find(&l, "/run"),
            staging("run", libc::MS_NOSUID | libc::MS_NODEV)
        );
        let ro = libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
        assert_eq!(find(&l, "/sys/fs/cgroup"), staging("cgroup", ro));
        assert_eq!(find(&l, "/proc/acpi"), staging("empty", ro));
        assert_eq!(find(&l, "/proc/kcore"), ExternalSource::NullMask);
        assert_eq!(
            find(&l, "/dev/null"),
            ExternalSource::Device("/dev/null".into())
        );
        assert_eq!(
            find(&l, ENVD_PATH),
            ExternalSource::Bind {
                source: "/usr/bin/cubicle-envd".into(),
                readonly: true,
                idmapped: false
            }
        );
        assert_eq!(
            find(&l, CTL_DIR),
            ExternalSource::Bind {
                source: "/s/abc/ctl".into(),
                readonly: false,
                idmapped: false
            }
        );
        assert_eq!(
            find(&l, "/opt/data"),
            ExternalSource::Bind {
                source: "/data".into(),
                readonly: true,
                idmapped: false
            }
        );
        // A volume: idmapped again on restore (its owners are the sandbox's ids).
        assert_eq!(
            find(&l, "/mnt/vol"),
            ExternalSource::Bind {
                source: "/volumes/v1".into(),
                readonly: false,
                idmapped: true
            }
        );
        // Mounts of the sandbox's own filesystems (proc, sysfs, devpts, cgroup, the
        // read-only proc binds) are CRIU's to handle: not listed.
        for mp in [
            "/proc",
            "/sys",
            "/dev/pts",
            "/proc/sys",
            "/sys/fs/cgroup/memory",
        ] {
            assert!(!l.iter().any(|e| e.mountpoint == Path::new(mp)), "{mp}");
        }
        let writable: Vec<_> = l
            .iter()
            .filter_map(|e| e.source.is_writable_staging())
            .collect();
        assert_eq!(writable, ["dev", "shm", "run"]);
    }
}
