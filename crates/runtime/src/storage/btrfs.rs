//! btrfs qgroups (the fallback for kernels without XFS quota, e.g. the development
//! machines): a sandbox directory is a subvolume (`BTRFS_IOC_SUBVOL_CREATE`) whose level-0
//! qgroup gets a `max_rfer` limit (`BTRFS_IOC_QGROUP_LIMIT`); writers past it see EDQUOT.
//! Usage is read from `/sys/fs/btrfs/<fsid>/qgroups/0_<subvol>/`. Constants and layouts
//! from linux/btrfs.h.

use std::collections::HashSet;
use std::ffi::CStr;
use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::{DiskUsage, Storage, ioctl};
use crate::error::{Error, Result, io_err};

impl Storage {
    /// Makes `parent/tmp_name` a subvolume whose qgroup is limited to `quota_bytes`.
    pub(super) fn btrfs_create(
        &self,
        parent: &Path,
        tmp_name: &str,
        quota_bytes: u64,
    ) -> Result<()> {
        let root = File::open(parent).map_err(io_err(format!("opening {}", parent.display())))?;
        btrfs_subvol_create(&root, tmp_name)
            .map_err(io_err(format!("creating subvolume {tmp_name}")))?;
        let dir =
            File::open(parent.join(tmp_name)).map_err(io_err(format!("opening {tmp_name}")))?;
        let id =
            btrfs_subvol_id(&dir).map_err(io_err(format!("looking up subvolume {tmp_name}")))?;
        btrfs_qgroup_limit(&root, id, quota_bytes)
            .map_err(io_err(format!("limiting qgroup 0/{id}")))
    }

    /// Snapshot of subvolume `root/src` as `root/dest` (read-only or writable).
    pub(super) fn btrfs_snapshot(&self, src: &str, dest: &str, readonly: bool) -> Result<()> {
        let root =
            File::open(&self.root).map_err(io_err(format!("opening {}", self.root.display())))?;
        let source = File::open(self.root.join(src)).map_err(io_err(format!("opening {src}")))?;
        btrfs_snap_create(&root, &source, dest, readonly)
            .map_err(io_err(format!("snapshot of {src} as {dest}")))
    }

    /// Limits the qgroup of subvolume `root/name` to `quota_bytes`.
    pub(super) fn btrfs_limit(&self, name: &str, quota_bytes: u64) -> Result<()> {
        let root =
            File::open(&self.root).map_err(io_err(format!("opening {}", self.root.display())))?;
        let dir = File::open(self.root.join(name)).map_err(io_err(format!("opening {name}")))?;
        let id = btrfs_subvol_id(&dir).map_err(io_err(format!("looking up subvolume {name}")))?;
        btrfs_qgroup_limit(&root, id, quota_bytes)
            .map_err(io_err(format!("limiting qgroup 0/{id}")))
    }

    /// Bytes used (including data reserved for writes not yet committed) and the limit
    /// of the subvolume `dir`.
    pub(super) fn btrfs_usage(&self, dir: &Path) -> Result<DiskUsage> {
        let f = File::open(dir).map_err(io_err(format!("opening {}", dir.display())))?;
        let subvol = btrfs_subvol_id(&f)
            .map_err(io_err(format!("looking up subvolume of {}", dir.display())))?;
        let read = |name: &str| self.qgroup_counter(subvol, name);
        let used = read("referenced")? + read("rsv_data").unwrap_or(0);
        Ok(DiskUsage {
            used_bytes: used,
            limit_bytes: read("max_referenced")?,
        })
    }

    /// Counter `name` (`referenced`, `rsv_data`, `max_referenced`, …) of subvolume
    /// `subvol`'s level-0 qgroup.
    pub(super) fn qgroup_counter(&self, subvol: u64, name: &str) -> Result<u64> {
        let p = self.qgroups_dir.join(format!("0_{subvol}")).join(name);
        let s = fs::read_to_string(&p).map_err(io_err(format!("reading {}", p.display())))?;
        s.trim().parse::<u64>().map_err(|_| Error::Io {
            context: format!("parsing {}", p.display()),
            source: io::Error::from(io::ErrorKind::InvalidData),
        })
    }

    /// Destroys the level-0 qgroups no subvolume uses.
    pub(super) fn btrfs_reconcile(&self) -> Result<()> {
        let mut live = HashSet::new();
        for path in self.quota_dirs()? {
            if let Ok(f) = File::open(path)
                && let Ok(id) = btrfs_subvol_id(&f)
            {
                live.insert(id);
            }
        }
        let root =
            File::open(&self.root).map_err(io_err(format!("opening {}", self.root.display())))?;
        let top = btrfs_subvol_id(&root).unwrap_or(5);
        for entry in fs::read_dir(&self.qgroups_dir)
            .map_err(io_err("listing qgroups"))?
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(id) = name.strip_prefix("0_").and_then(|s| s.parse::<u64>().ok())
                && id != 5
                && id != top
                && !live.contains(&id)
            {
                self.destroy_unused_qgroup(&root, id);
            }
        }
        Ok(())
    }

    /// Destroys the level-0 qgroup of a removed subvolume once the kernel has accounted
    /// the removal (its counters read zero). Destroying it earlier (the subvolume's tree
    /// dropped, the transaction that subtracts its extents not yet committed) makes the
    /// kernel mark the whole filesystem's accounting inconsistent, and from then on no
    /// limit holds (see [`Storage::btrfs_keep_accounting`]). Newer kernels (6.10+) remove
    /// the qgroup of a dropped subvolume themselves; for older ones `reconcile` retries.
    fn destroy_unused_qgroup(&self, root: &File, id: u64) {
        let q = self.qgroups_dir.join(format!("0_{id}"));
        let zero = |name: &str| fs::read_to_string(q.join(name)).is_ok_and(|s| s.trim() == "0");
        if zero("referenced") && zero("exclusive") {
            // Fails (harmlessly, EBUSY) while the subvolume still exists.
            let _ = btrfs_qgroup_destroy(root, id);
        }
    }

    /// Keeps the limits enforced: once the kernel marks the qgroup accounting
    /// inconsistent (on a qgroup removed with non-zero counters, or on dropping a big
    /// shared subtree) it stops accounting, so writes committed from then on count
    /// against no limit. A rescan restores the accounting and clears the mark. Returns
    /// whether this call started one (`false` when consistent or already rescanning).
    pub(super) fn btrfs_keep_accounting(&self) -> Result<bool> {
        let flag = self.qgroups_dir.join("inconsistent");
        match fs::read_to_string(&flag) {
            Ok(s) if s.trim() == "1" => {}
            // Consistent, or a kernel without the flag (older than 6.9).
            _ => return Ok(false),
        }
        let root =
            File::open(&self.root).map_err(io_err(format!("opening {}", self.root.display())))?;
        match btrfs_quota_rescan(&root) {
            Ok(()) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => Ok(false),
            Err(e) => Err(io_err("starting a qgroup rescan")(e)),
        }
    }

    /// Makes the kernel account a dropped subvolume's shared subtrees however deep they
    /// are, instead of marking the accounting inconsistent past level 3 (the default
    /// `drop_subtree_threshold`): a slower background drop, against a full rescan with
    /// limits unenforced until it ends. Kernels without the knob (older than 6.1) keep
    /// their behaviour.
    pub(super) fn btrfs_account_deep_drops(&self) {
        let _ = fs::write(self.qgroups_dir.join("drop_subtree_threshold"), "8");
    }

    /// Removes directory `parent/name` (`meta`: its metadata): a subvolume with its
    /// qgroup, or a plain directory.
    pub(super) fn btrfs_remove(
        &self,
        parent: &Path,
        name: &str,
        meta: &fs::Metadata,
    ) -> Result<()> {
        let path = parent.join(name);
        let root = File::open(parent).map_err(io_err(format!("opening {}", parent.display())))?;
        if meta.ino() == 256 {
            // A subvolume: destroying it is O(1), the kernel cleans up in the background.
            // It fails if the sandbox left subvolumes inside (the seccomp policy and the
            // read-only ctl directory prevent that, but teardown must not depend on it)
            // or made it read-only: then the walk that handles those.
            let subvol = File::open(&path)
                .ok()
                .and_then(|f| btrfs_subvol_id(&f).ok());
            let cname = crate::sys::cpath(Path::new(name))
                .map_err(io_err(format!("subvolume name {name:?}")))?;
            if let Err(e) = btrfs_subvol_destroy_at(&root, &cname) {
                crate::remove_tree::remove_tree(&path).map_err(io_err(format!(
                    "deleting subvolume {} ({e}), then removing it entry by entry",
                    path.display()
                )))?;
            }
            if let Some(id) = subvol {
                self.destroy_unused_qgroup(&root, id); // else `reconcile` retries
            }
        } else {
            crate::remove_tree::remove_tree(&path)
                .map_err(io_err(format!("removing {}", path.display())))?;
        }
        Ok(())
    }
}

const BTRFS_IOC_SUBVOL_CREATE: u64 = 0x5000_940e;
const BTRFS_IOC_SNAP_CREATE_V2: u64 = 0x5000_9417;
const BTRFS_IOC_SNAP_DESTROY: u64 = 0x5000_940f;
const BTRFS_IOC_SUBVOL_GETFLAGS: u64 = 0x8008_9419;
pub(super) const BTRFS_IOC_SUBVOL_SETFLAGS: u64 = 0x4008_941a;
pub(super) const BTRFS_SUBVOL_RDONLY: u64 = 1 << 1;
const BTRFS_IOC_INO_LOOKUP: u64 = 0xd000_9412;
const BTRFS_IOC_QGROUP_CREATE: u64 = 0x4010_942a;
const BTRFS_IOC_QGROUP_LIMIT: u64 = 0x8030_942b;
const BTRFS_IOC_QUOTA_RESCAN: u64 = 0x4040_942c;
const BTRFS_IOC_FS_INFO: u64 = 0x8400_941f;
const BTRFS_QGROUP_LIMIT_MAX_RFER: u64 = 1;

#[repr(C)]
struct BtrfsVolArgs {
    fd: i64,
    name: [u8; 4088],
}

#[repr(C)]
struct BtrfsInoLookupArgs {
    treeid: u64,
    objectid: u64,
    name: [u8; 4080],
}

#[repr(C)]
struct BtrfsQgroupLimitArgs {
    qgroupid: u64,
    flags: u64,
    max_rfer: u64,
    max_excl: u64,
    rsv_rfer: u64,
    rsv_excl: u64,
}

/// `struct btrfs_ioctl_quota_rescan_args`.
#[repr(C)]
struct BtrfsQuotaRescanArgs {
    flags: u64,
    progress: u64,
    reserved: [u64; 6],
}

#[repr(C)]
struct BtrfsQgroupCreateArgs {
    create: u64,
    qgroupid: u64,
}

/// `struct btrfs_ioctl_vol_args_v2` (the union of unused words / qgroup inheritance
/// left zero).
#[repr(C)]
struct BtrfsVolArgsV2 {
    fd: i64,
    transid: u64,
    flags: u64,
    unused: [u64; 4],
    name: [u8; 4040],
}

const _: () = assert!(std::mem::size_of::<BtrfsVolArgs>() == 4096);
const _: () = assert!(std::mem::size_of::<BtrfsVolArgsV2>() == 4096);
const _: () = assert!(std::mem::size_of::<BtrfsInoLookupArgs>() == 4096);

fn vol_args(name: &[u8]) -> io::Result<Box<BtrfsVolArgs>> {
    let mut a = Box::new(BtrfsVolArgs {
        fd: 0,
        name: [0; 4088],
    });
    let b = name;
    if b.len() >= a.name.len() || b.contains(&0) || b.contains(&b'/') {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    a.name[..b.len()].copy_from_slice(b);
    Ok(a)
}

pub(super) fn btrfs_subvol_create(parent: &File, name: &str) -> io::Result<()> {
    let mut a = vol_args(name.as_bytes())?;
    ioctl(
        parent,
        BTRFS_IOC_SUBVOL_CREATE,
        &mut *a as *mut BtrfsVolArgs as *mut libc::c_void,
    )
}

fn btrfs_snap_create(parent: &File, source: &File, name: &str, readonly: bool) -> io::Result<()> {
    let mut a = Box::new(BtrfsVolArgsV2 {
        fd: source.as_raw_fd() as i64,
        transid: 0,
        flags: if readonly { BTRFS_SUBVOL_RDONLY } else { 0 },
        unused: [0; 4],
        name: [0; 4040],
    });
    let b = name.as_bytes();
    if b.len() >= a.name.len() || b.contains(&0) || b.contains(&b'/') {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    a.name[..b.len()].copy_from_slice(b);
    ioctl(
        parent,
        BTRFS_IOC_SNAP_CREATE_V2,
        &mut *a as *mut BtrfsVolArgsV2 as *mut libc::c_void,
    )
}

/// Destroys the subvolume `name` in the directory `parent` (`BTRFS_IOC_SNAP_DESTROY`):
/// fails with ENOTEMPTY while it holds subvolumes, and on a read-only parent.
pub(crate) fn btrfs_subvol_destroy_at(parent: &impl AsRawFd, name: &CStr) -> io::Result<()> {
    let mut a = vol_args(name.to_bytes())?;
    ioctl(
        parent,
        BTRFS_IOC_SNAP_DESTROY,
        &mut *a as *mut BtrfsVolArgs as *mut libc::c_void,
    )
}

fn btrfs_subvol_flags(root: &impl AsRawFd) -> io::Result<u64> {
    let mut flags: u64 = 0;
    ioctl(
        root,
        BTRFS_IOC_SUBVOL_GETFLAGS,
        &mut flags as *mut u64 as *mut libc::c_void,
    )?;
    Ok(flags)
}

/// Whether the subvolume whose root directory `root` is, is read-only.
pub(super) fn btrfs_subvol_is_readonly(root: &impl AsRawFd) -> io::Result<bool> {
    Ok(btrfs_subvol_flags(root)? & BTRFS_SUBVOL_RDONLY != 0)
}

/// Clears the read-only flag of the subvolume whose root directory `root` is (a no-op
/// when it is writable).
pub(crate) fn btrfs_subvol_make_writable(root: &impl AsRawFd) -> io::Result<()> {
    let mut flags = btrfs_subvol_flags(root)?;
    if flags & BTRFS_SUBVOL_RDONLY == 0 {
        return Ok(());
    }
    flags &= !BTRFS_SUBVOL_RDONLY;
    ioctl(
        root,
        BTRFS_IOC_SUBVOL_SETFLAGS,
        &mut flags as *mut u64 as *mut libc::c_void,
    )
}

/// The id of the subvolume `f` is in.
pub(super) fn btrfs_subvol_id(f: &File) -> io::Result<u64> {
    let mut a = Box::new(BtrfsInoLookupArgs {
        treeid: 0,
        objectid: 256,
        name: [0; 4080],
    });
    ioctl(
        f,
        BTRFS_IOC_INO_LOOKUP,
        &mut *a as *mut BtrfsInoLookupArgs as *mut libc::c_void,
    )?;
    Ok(a.treeid)
}

pub(super) fn btrfs_qgroup_limit(f: &File, subvol: u64, bytes: u64) -> io::Result<()> {
    let mut a = BtrfsQgroupLimitArgs {
        qgroupid: subvol, // level 0
        flags: BTRFS_QGROUP_LIMIT_MAX_RFER,
        max_rfer: bytes,
        max_excl: 0,
        rsv_rfer: 0,
        rsv_excl: 0,
    };
    ioctl(
        f,
        BTRFS_IOC_QGROUP_LIMIT,
        &mut a as *mut BtrfsQgroupLimitArgs as *mut libc::c_void,
    )
}

/// Starts a rescan of the filesystem's qgroup accounting (`BTRFS_IOC_QUOTA_RESCAN`);
/// EINPROGRESS while one runs.
fn btrfs_quota_rescan(f: &File) -> io::Result<()> {
    let mut a = BtrfsQuotaRescanArgs {
        flags: 0,
        progress: 0,
        reserved: [0; 6],
    };
    ioctl(
        f,
        BTRFS_IOC_QUOTA_RESCAN,
        &mut a as *mut BtrfsQuotaRescanArgs as *mut libc::c_void,
    )
}

fn btrfs_qgroup_destroy(f: &File, subvol: u64) -> io::Result<()> {
    let mut a = BtrfsQgroupCreateArgs {
        create: 0,
        qgroupid: subvol,
    };
    ioctl(
        f,
        BTRFS_IOC_QGROUP_CREATE,
        &mut a as *mut BtrfsQgroupCreateArgs as *mut libc::c_void,
    )
}

/// `/sys/fs/btrfs/<fsid>/qgroups` of the filesystem holding `path`.
pub(super) fn btrfs_qgroups_dir(path: &Path) -> Result<PathBuf> {
    let f = File::open(path).map_err(io_err(format!("opening {}", path.display())))?;
    let mut info = [0u8; 1024];
    ioctl(
        &f,
        BTRFS_IOC_FS_INFO,
        info.as_mut_ptr() as *mut libc::c_void,
    )
    .map_err(io_err(format!("BTRFS_IOC_FS_INFO on {}", path.display())))?;
    let id = &info[16..32];
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    let uuid = format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    );
    Ok(PathBuf::from(format!("/sys/fs/btrfs/{uuid}/qgroups")))
}
