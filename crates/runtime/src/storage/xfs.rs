//! XFS project quotas: a sandbox directory gets a fresh project id with
//! `FS_XFLAG_PROJINHERIT` (`FS_IOC_FSSETXATTR`) and a hard limit (`quotactl_fd(Q_XSETQLIM)`);
//! writers past it see ENOSPC. Project ids live on the directories themselves and are
//! re-read at open. Constants and layouts from linux/fs.h, linux/dqblk_xfs.h, linux/quota.h.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

use super::{Storage, ioctl};
use crate::error::{Error, Result, io_err};

impl Storage {
    pub(super) fn lock_projects(&self) -> std::sync::MutexGuard<'_, HashMap<u32, String>> {
        self.projects.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the project id of every directory.
    pub(super) fn load_projects(&self) -> Result<()> {
        let mut map = HashMap::new();
        for path in self.quota_dirs()? {
            if let Ok(f) = File::open(&path)
                && let Ok(x) = fsxattr_get(&f)
                && x.fsx_projid != 0
            {
                let name = path.file_name().unwrap_or_default();
                map.insert(x.fsx_projid, name.to_string_lossy().into_owned());
            }
        }
        *self.lock_projects() = map;
        Ok(())
    }

    /// Makes `tmp` a directory with a fresh project id limited to `quota_bytes`.
    pub(super) fn xfs_create(&self, tmp: &Path, id: &str, quota_bytes: u64) -> Result<()> {
        fs::create_dir(tmp).map_err(io_err(format!("creating {}", tmp.display())))?;
        let projid = {
            let mut projects = self.lock_projects();
            let projid = (1..u32::MAX)
                .find(|p| !projects.contains_key(p))
                .ok_or(Error::NoFreeProjectId)?;
            projects.insert(projid, id.to_string());
            projid
        };
        let result = (|| {
            let dir = File::open(tmp).map_err(io_err(format!("opening {}", tmp.display())))?;
            let mut x = fsxattr_get(&dir)
                .map_err(io_err(format!("reading attributes of {}", tmp.display())))?;
            x.fsx_projid = projid;
            x.fsx_xflags |= FS_XFLAG_PROJINHERIT;
            fsxattr_set(&dir, &x).map_err(io_err(format!(
                "setting project id {projid} on {}",
                tmp.display()
            )))?;
            let blocks = quota_bytes.div_ceil(512);
            let inodes = (quota_bytes / 4096).max(65_536);
            xfs_set_limits(&dir, projid, blocks, inodes)
                .map_err(io_err(format!("setting quota of project {projid}")))
        })();
        if result.is_err() {
            self.lock_projects().remove(&projid);
        }
        result
    }

    /// Bytes used and the limit of the project of `dir`.
    pub(super) fn xfs_usage(&self, dir: &Path) -> Result<super::DiskUsage> {
        let f = File::open(dir).map_err(io_err(format!("opening {}", dir.display())))?;
        let projid = fsxattr_get(&f)
            .map_err(io_err(format!("reading project id of {}", dir.display())))?
            .fsx_projid;
        let q = xfs_get_quota(&f, projid)
            .map_err(io_err(format!("reading quota of project {projid}")))?;
        Ok(super::DiskUsage {
            used_bytes: q.d_bcount * 512,
            limit_bytes: q.d_blk_hardlimit * 512,
        })
    }

    /// Clears the limits of every project id no directory uses.
    pub(super) fn xfs_reconcile(&self) -> Result<()> {
        self.load_projects()?;
        let used: HashSet<u32> = self.lock_projects().keys().copied().collect();
        let f =
            File::open(&self.root).map_err(io_err(format!("opening {}", self.root.display())))?;
        let mut id = 1u32;
        while let Some(q) = xfs_next_quota(&f, id).map_err(io_err("listing project quotas"))? {
            if q.d_id != 0
                && !used.contains(&q.d_id)
                && (q.d_blk_hardlimit != 0 || q.d_ino_hardlimit != 0)
            {
                xfs_set_limits(&f, q.d_id, 0, 0)
                    .map_err(io_err(format!("clearing quota of project {}", q.d_id)))?;
            }
            match q.d_id.checked_add(1) {
                Some(n) => id = n,
                None => break,
            }
        }
        Ok(())
    }

    /// Removes directory `path` and clears its project's limits.
    pub(super) fn xfs_remove(&self, path: &Path) -> Result<()> {
        let projid = File::open(path)
            .ok()
            .and_then(|f| fsxattr_get(&f).ok())
            .map(|x| x.fsx_projid);
        crate::remove_tree::remove_tree(path)
            .map_err(io_err(format!("removing {}", path.display())))?;
        if let Some(projid) = projid.filter(|&p| p != 0) {
            let root = File::open(&self.root)
                .map_err(io_err(format!("opening {}", self.root.display())))?;
            xfs_set_limits(&root, projid, 0, 0)
                .map_err(io_err(format!("clearing quota of project {projid}")))?;
            self.lock_projects().remove(&projid);
        }
        Ok(())
    }
}

const FS_XFLAG_PROJINHERIT: u32 = 0x200;
const FS_IOC_FSGETXATTR: u64 = 0x801c_581f;
const FS_IOC_FSSETXATTR: u64 = 0x401c_5820;
const PRJQUOTA: u32 = 2;
const Q_XGETQUOTA: u32 = 0x5803;
const Q_XSETQLIM: u32 = 0x5804;
const Q_XGETNEXTQUOTA: u32 = 0x5809;
const FS_DQUOT_VERSION: i8 = 1;
const FS_PROJ_QUOTA: i8 = 2;
const FS_DQ_ISOFT: u16 = 1 << 0;
const FS_DQ_IHARD: u16 = 1 << 1;
const FS_DQ_BSOFT: u16 = 1 << 2;
const FS_DQ_BHARD: u16 = 1 << 3;

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct FsXattr {
    fsx_xflags: u32,
    fsx_extsize: u32,
    fsx_nextents: u32,
    fsx_projid: u32,
    fsx_cowextsize: u32,
    fsx_pad: [u8; 8],
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct FsDiskQuota {
    d_version: i8,
    d_flags: i8,
    d_fieldmask: u16,
    d_id: u32,
    d_blk_hardlimit: u64,
    d_blk_softlimit: u64,
    d_ino_hardlimit: u64,
    d_ino_softlimit: u64,
    d_bcount: u64,
    d_icount: u64,
    d_itimer: i32,
    d_btimer: i32,
    d_iwarns: u16,
    d_bwarns: u16,
    d_itimer_hi: i8,
    d_btimer_hi: i8,
    d_rtbtimer_hi: i8,
    d_padding2: i8,
    d_rtb_hardlimit: u64,
    d_rtb_softlimit: u64,
    d_rtbcount: u64,
    d_rtbtimer: i32,
    d_rtbwarns: u16,
    d_padding3: i16,
    d_padding4: [u8; 8],
}

const _: () = assert!(std::mem::size_of::<FsXattr>() == 28);
const _: () = assert!(std::mem::size_of::<FsDiskQuota>() == 112);

fn fsxattr_get(f: &File) -> io::Result<FsXattr> {
    let mut x = FsXattr::default();
    ioctl(
        f,
        FS_IOC_FSGETXATTR,
        &mut x as *mut FsXattr as *mut libc::c_void,
    )?;
    Ok(x)
}

fn fsxattr_set(f: &File, x: &FsXattr) -> io::Result<()> {
    let mut x = *x;
    ioctl(
        f,
        FS_IOC_FSSETXATTR,
        &mut x as *mut FsXattr as *mut libc::c_void,
    )
}

fn quotactl_fd(f: &File, cmd: u32, id: u32, q: &mut FsDiskQuota) -> io::Result<()> {
    let qcmd = (cmd << 8) | (PRJQUOTA & 0xff);
    // SAFETY: quotactl_fd(2) with a valid fd and a pointer to a fs_disk_quota.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_quotactl_fd,
            f.as_raw_fd(),
            qcmd as libc::c_uint,
            id as libc::c_uint,
            q as *mut FsDiskQuota,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Sets project `id`'s hard (and soft) block and inode limits; 0 clears them.
fn xfs_set_limits(f: &File, id: u32, blocks: u64, inodes: u64) -> io::Result<()> {
    let mut q = FsDiskQuota {
        d_version: FS_DQUOT_VERSION,
        d_flags: FS_PROJ_QUOTA,
        d_fieldmask: FS_DQ_BHARD | FS_DQ_BSOFT | FS_DQ_IHARD | FS_DQ_ISOFT,
        d_id: id,
        d_blk_hardlimit: blocks,
        d_blk_softlimit: blocks,
        d_ino_hardlimit: inodes,
        d_ino_softlimit: inodes,
        ..Default::default()
    };
    quotactl_fd(f, Q_XSETQLIM, id, &mut q)
}

fn xfs_get_quota(f: &File, id: u32) -> io::Result<FsDiskQuota> {
    let mut q = FsDiskQuota::default();
    quotactl_fd(f, Q_XGETQUOTA, id, &mut q)?;
    Ok(q)
}

/// The first project quota with id ≥ `id`, if any.
fn xfs_next_quota(f: &File, id: u32) -> io::Result<Option<FsDiskQuota>> {
    let mut q = FsDiskQuota::default();
    match quotactl_fd(f, Q_XGETNEXTQUOTA, id, &mut q) {
        Ok(()) => Ok(Some(q)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}
