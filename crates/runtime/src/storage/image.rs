//! Where the quota filesystem comes from: `<state>/sandboxes` as it is, or a sparse image
//! `<state>/storage.img` loop-mounted there (created once: XFS with `prjquota` if the
//! kernel enforces it, else btrfs with quotas). Also the mount table reading this needs
//! and [`unmount_path`]. One-time setup: spawning `mkfs`/`mount` is fine here.

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::process::Command;

use super::QuotaBackend;
use super::btrfs::btrfs_qgroups_dir;
use crate::error::{Error, Result, io_err};

use crate::sys::cpath;
use cubicle_syscalls::fs::{BTRFS_SUPER_MAGIC, XFS_SUPER_MAGIC};
use cubicle_syscalls::mountinfo::{is_mount_point, mount_of};

/// Unmounts the filesystem mounted at `path` (the quota image of a state directory,
/// `<state>/sandboxes`, which a node leaves mounted across restarts).
///
/// EBUSY can be transient: a child forked by another thread of this process holds copies
/// of our descriptors (some inside this filesystem) until it execs and its close-on-exec
/// descriptors go. Retries for up to about a second.
pub fn unmount_path(path: &Path) -> Result<()> {
    let mut attempts = 0;
    loop {
        let err = match cubicle_syscalls::fs::unmount(path) {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        attempts += 1;
        if err.raw_os_error() != Some(libc::EBUSY) || attempts >= 50 {
            return Err(Error::Io {
                context: format!("unmounting {}", path.display()),
                source: err,
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

pub(super) fn mount_source_is_loop_of(root: &Path, image: &Path) -> bool {
    let Ok(Some(m)) = mount_of(root) else {
        return false;
    };
    if m.mount_point != root {
        return false;
    }
    let Some(dev) = m.source.strip_prefix("/dev/") else {
        return false;
    };
    let backing =
        fs::read_to_string(format!("/sys/block/{dev}/loop/backing_file")).unwrap_or_default();
    Path::new(backing.trim()) == image
}

/// Makes the mount at `root` `nosuid,nodev`, first bind-mounting `root` onto itself when
/// it is not a mount point (a state dir on a host filesystem with project quotas): a
/// file a sandbox wrote must never be a setuid program or a device node for the host.
/// Sandboxes see their files through their own mounts (the overlay), which this does not
/// change. Also applies to images mounted by an older version without these options.
pub(super) fn harden_mount(root: &Path) -> Result<()> {
    let c = cpath(root).map_err(io_err(format!("path {}", root.display())))?;
    // SAFETY: zeroed statvfs is a valid out buffer; c is a valid path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io_err(format!("statvfs {}", root.display()))(
            io::Error::last_os_error(),
        ));
    }
    let want = libc::ST_NOSUID | libc::ST_NODEV;
    if st.f_flag & want == want {
        return Ok(());
    }
    if !is_mount_point(root).map_err(io_err(format!("reading the mounts of {}", root.display())))? {
        let fd = crate::sys::open_tree_clone(root)
            .map_err(io_err(format!("cloning the mount of {}", root.display())))?;
        crate::sys::move_mount_to(std::os::fd::AsRawFd::as_raw_fd(&fd), root).map_err(io_err(
            format!("bind-mounting {} onto itself", root.display()),
        ))?;
    }
    let dir = File::open(root).map_err(io_err(format!("opening {}", root.display())))?;
    crate::sys::mount_setattr(
        &std::os::fd::OwnedFd::from(dir),
        crate::sys::MOUNT_ATTR_NOSUID | crate::sys::MOUNT_ATTR_NODEV,
        None,
    )
    .map_err(io_err(format!("making {} nosuid,nodev", root.display())))
}

/// The quota mechanism usable at `root`, if any.
pub(super) fn detect(root: &Path) -> Result<Option<QuotaBackend>> {
    let fs_type = cubicle_syscalls::fs::fs_type(root)
        .map_err(io_err(format!("statfs {}", root.display())))?;
    match fs_type {
        XFS_SUPER_MAGIC => {
            let enforced = mount_of(root)
                .map_err(io_err("reading /proc/self/mountinfo"))?
                .is_some_and(|m| m.fstype == "xfs" && m.has_super_option("prjquota"));
            Ok(enforced.then_some(QuotaBackend::XfsProject))
        }
        BTRFS_SUPER_MAGIC => Ok(btrfs_qgroups_dir(root)
            .is_ok_and(|d| d.exists())
            .then_some(QuotaBackend::BtrfsQgroup)),
        _ => Ok(None),
    }
}

pub(super) fn run(cmd: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(io_err(format!(
            "running {cmd} (see scripts/install-deps.sh)"
        )))?;
    if !out.status.success() {
        return Err(Error::Command {
            command: format!("{cmd} {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

pub(super) fn path_str(p: &Path) -> Result<&str> {
    p.to_str().ok_or_else(|| Error::Io {
        context: format!("non-UTF-8 path {}", p.display()),
        source: io::Error::from(io::ErrorKind::InvalidInput),
    })
}

/// Which filesystem an image holds, from its superblock magic.
fn image_fstype(image: &Path) -> Result<Option<&'static str>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = File::open(image).map_err(io_err(format!("opening {}", image.display())))?;
    let mut magic = [0u8; 8];
    f.read_exact(&mut magic[..4])
        .map_err(io_err(format!("reading {}", image.display())))?;
    if &magic[..4] == b"XFSB" {
        return Ok(Some("xfs"));
    }
    if f.seek(SeekFrom::Start(0x10040)).is_ok()
        && f.read_exact(&mut magic).is_ok()
        && &magic == b"_BHRfS_M"
    {
        return Ok(Some("btrfs"));
    }
    Ok(None)
}

pub(super) fn mount_image(image: &Path, root: &Path) -> Result<()> {
    let (img, dir) = (path_str(image)?, path_str(root)?);
    match image_fstype(image)? {
        Some("xfs") => run(
            "mount",
            &[
                "-t",
                "xfs",
                "-o",
                "loop,prjquota,noatime,nosuid,nodev",
                img,
                dir,
            ],
        ),
        Some("btrfs") => {
            run(
                "mount",
                &["-t", "btrfs", "-o", "loop,noatime,nosuid,nodev", img, dir],
            )?;
            if !btrfs_qgroups_dir(root).is_ok_and(|d| d.exists()) {
                run("btrfs", &["quota", "enable", dir])?;
            }
            Ok(())
        }
        _ => Err(Error::QuotaUnsupported(format!(
            "{} holds neither XFS nor btrfs; move it away to let Cubicle create a new one",
            image.display()
        ))),
    }
}

/// Creates the sparse image (XFS if the kernel enforces XFS project quotas, else btrfs)
/// and mounts it. Built under a temporary name so a crash never leaves a half-made image.
pub(super) fn create_image(image: &Path, root: &Path, size: u64) -> Result<()> {
    let tmp = image.with_extension("img.tmp");
    let _ = fs::remove_file(&tmp);
    let make = |size: u64| -> Result<()> {
        let f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io_err(format!("creating {}", tmp.display())))?;
        f.set_len(size)
            .map_err(io_err(format!("sizing {}", tmp.display())))
    };
    let (t, dir) = (path_str(&tmp)?.to_string(), path_str(root)?.to_string());
    make(size)?;
    run("mkfs.xfs", &["-q", "-f", "-m", "reflink=1", &t])?;
    let xfs_ok = run(
        "mount",
        &[
            "-t",
            "xfs",
            "-o",
            "loop,prjquota,noatime,nosuid,nodev",
            &t,
            &dir,
        ],
    )
    .is_ok();
    if !xfs_ok {
        // The kernel refuses `prjquota` (no CONFIG_XFS_QUOTA): use btrfs qgroups instead.
        fs::remove_file(&tmp).map_err(io_err(format!("removing {}", tmp.display())))?;
        make(size)?;
        run("mkfs.btrfs", &["-q", "-f", &t])?;
        run(
            "mount",
            &["-t", "btrfs", "-o", "loop,noatime,nosuid,nodev", &t, &dir],
        )?;
        if let Err(e) = run("btrfs", &["quota", "enable", &dir]) {
            let _ = run("umount", &[&dir]);
            return Err(e);
        }
    }
    fs::set_permissions(root, std::os::unix::fs::PermissionsExt::from_mode(0o700))
        .map_err(io_err(format!("chmod {}", root.display())))?;
    fs::rename(&tmp, image).map_err(io_err(format!(
        "renaming {} to {}",
        tmp.display(),
        image.display()
    )))
}
