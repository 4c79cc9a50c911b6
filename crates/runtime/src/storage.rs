//! Disk quotas on each sandbox's writable layer.
//!
//! Every sandbox gets one directory, `<state_dir>/sandboxes/<id>/`, holding its overlay
//! upper and work dirs (and anything else the node keeps per sandbox); everything written
//! below it counts against one hard limit. Two kernel mechanisms are supported:
//!
//! - **XFS project quotas** (the production choice): the directory gets a fresh project
//!   id with `FS_XFLAG_PROJINHERIT` (`FS_IOC_FSSETXATTR`), the limit is set with
//!   `quotactl_fd(Q_XSETQLIM)`. A writer past the limit sees **ENOSPC**.
//!   Needs a kernel with `CONFIG_XFS_QUOTA` and a `prjquota` mount.
//! - **btrfs qgroups** (fallback for kernels without XFS quota, e.g. the development
//!   machines, whose kernel lacks both CONFIG_XFS_QUOTA and CONFIG_QFMT_V2): the
//!   directory is a subvolume (`BTRFS_IOC_SUBVOL_CREATE`) whose level-0 qgroup gets a
//!   `max_rfer` limit (`BTRFS_IOC_QGROUP_LIMIT`). A writer past the limit sees
//!   **EDQUOT** ("Disk quota exceeded"). Usage is read from
//!   `/sys/fs/btrfs/<fsid>/qgroups/0_<subvol>/`.
//!
//! Both keep reflink copies (for snapshots later). Callers that classify a sandbox's
//! death as `disk_full` should accept both ENOSPC and EDQUOT, or compare
//! [`Storage::usage`] with the limit.
//!
//! Where the filesystem comes from ([`Storage::open`]):
//! 1. `<state_dir>/sandboxes` already lives on a suitable filesystem (XFS mounted with
//!    `prjquota`, or btrfs with quotas enabled): use it as is.
//! 2. Otherwise a sparse image `<state_dir>/storage.img` (default 64 GiB, sparse) is
//!    loop-mounted at `<state_dir>/sandboxes`: created once (XFS with `reflink=1` if the
//!    kernel accepts `prjquota`, else btrfs with quotas), re-mounted by `open` after a
//!    reboot or [`Storage::unmount`]. The loop device is set up by `mount -o loop`, which
//!    sets autoclear: unmounting releases it, nothing leaks.
//!
//! Crash safety: a directory is prepared under `.creating-<id>` (quota id + limit set)
//! and renamed to `<id>` only when complete; XFS project ids live on the directories
//! themselves and are re-read at `open`; [`Storage::reconcile`] removes leftovers and
//! clears limits of quota ids no directory uses.

use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// Errors of the storage module.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("{command} failed: {stderr}")]
    Command { command: String, stderr: String },
    #[error("invalid sandbox id {0:?} (1-64 characters of [A-Za-z0-9_-])")]
    InvalidId(String),
    #[error("no disk quota support: {0}")]
    Unsupported(String),
    #[error("no project ids left")]
    NoFreeId,
}

type Result<T, E = StorageError> = std::result::Result<T, E>;

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> StorageError {
    let what = what.into();
    move |source| StorageError::Io { what, source }
}

/// Which kernel mechanism enforces the quotas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaBackend {
    /// XFS project quotas (writers see ENOSPC).
    XfsProject,
    /// btrfs subvolume + qgroup (writers see EDQUOT).
    BtrfsQgroup,
}

/// Storage configuration.
#[derive(Debug, Clone)]
pub struct StorageConfig {
    /// The node's state directory (e.g. `/var/lib/cubicle`, or a temp dir in tests).
    pub state_dir: PathBuf,
    /// Size of the sparse image created when the state dir's filesystem has no quotas.
    pub image_size: u64,
}

impl StorageConfig {
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        StorageConfig {
            state_dir: state_dir.into(),
            image_size: 64 << 30,
        }
    }
}

/// Bytes used by a sandbox's directory and its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskUsage {
    pub used_bytes: u64,
    pub limit_bytes: u64,
}

/// The sandboxes' quota-enforcing filesystem.
pub struct Storage {
    root: PathBuf,
    image: PathBuf,
    backend: QuotaBackend,
    /// Our image is what is mounted at `root` (so `unmount` may unmount it).
    image_mounted: bool,
    /// btrfs: `/sys/fs/btrfs/<fsid>/qgroups`.
    qgroups_dir: PathBuf,
    /// XFS: project ids in use (id → directory name).
    projects: Mutex<HashMap<u32, String>>,
}

const SANDBOXES: &str = "sandboxes";
const IMAGE: &str = "storage.img";
const CREATING: &str = ".creating-";

const XFS_SUPER_MAGIC: i64 = 0x5846_5342;
const BTRFS_SUPER_MAGIC: i64 = 0x9123_683e;

impl Storage {
    /// Opens (setting up on first use) the storage under `state_dir`, with defaults.
    pub fn open(state_dir: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(StorageConfig::new(state_dir.as_ref()))
    }

    /// Opens (setting up on first use) the storage described by `config`. Idempotent.
    pub fn open_with(config: StorageConfig) -> Result<Self> {
        fs::create_dir_all(&config.state_dir)
            .map_err(io_err(format!("creating {}", config.state_dir.display())))?;
        let state_dir = fs::canonicalize(&config.state_dir)
            .map_err(io_err(format!("resolving {}", config.state_dir.display())))?;
        let root = state_dir.join(SANDBOXES);
        let image = state_dir.join(IMAGE);
        fs::create_dir_all(&root).map_err(io_err(format!("creating {}", root.display())))?;

        let mut image_mounted = mount_source_is_loop_of(&root, &image);
        let backend = match detect(&root)? {
            Some(b) => b,
            None => {
                if is_mount_point(&root)? {
                    return Err(StorageError::Unsupported(format!(
                        "{} is a mount without project quotas / qgroups; unmount it or mount with prjquota",
                        root.display()
                    )));
                }
                if image.exists() {
                    mount_image(&image, &root)?;
                } else {
                    create_image(&image, &root, config.image_size)?;
                }
                image_mounted = true;
                detect(&root)?.ok_or_else(|| {
                    StorageError::Unsupported(format!(
                        "{} mounted at {} has no quotas",
                        image.display(),
                        root.display()
                    ))
                })?
            }
        };
        let qgroups_dir = match backend {
            QuotaBackend::BtrfsQgroup => btrfs_qgroups_dir(&root)?,
            QuotaBackend::XfsProject => PathBuf::new(),
        };
        let storage = Storage {
            root,
            image,
            backend,
            image_mounted,
            qgroups_dir,
            projects: Mutex::new(HashMap::new()),
        };
        if backend == QuotaBackend::XfsProject {
            storage.load_projects()?;
        }
        Ok(storage)
    }

    /// `<state_dir>/sandboxes`.
    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn backend(&self) -> QuotaBackend {
        self.backend
    }

    /// The directory of sandbox `id` (whether or not it exists).
    pub fn sandbox_dir(&self, id: &str) -> Result<PathBuf> {
        check_id(id)?;
        Ok(self.root.join(id))
    }

    /// Creates sandbox `id`'s directory with a hard limit of `quota_bytes` on everything
    /// written below it. Fails if it exists.
    pub fn create_sandbox_dir(&self, id: &str, quota_bytes: u64) -> Result<PathBuf> {
        let dest = self.sandbox_dir(id)?;
        if dest.exists() {
            return Err(StorageError::Io {
                what: format!("creating {}", dest.display()),
                source: io::Error::from_raw_os_error(libc::EEXIST),
            });
        }
        let tmp_name = format!("{CREATING}{id}");
        let tmp = self.root.join(&tmp_name);
        let _ = self.remove_entry(&tmp_name);
        let result = match self.backend {
            QuotaBackend::XfsProject => self.xfs_create(&tmp, id, quota_bytes),
            QuotaBackend::BtrfsQgroup => self.btrfs_create(&tmp_name, quota_bytes),
        };
        if let Err(e) = result {
            let _ = self.remove_entry(&tmp_name);
            return Err(e);
        }
        fs::rename(&tmp, &dest).map_err(io_err(format!(
            "renaming {} to {}",
            tmp.display(),
            dest.display()
        )))?;
        Ok(dest)
    }

    /// Deletes sandbox `id`'s directory and clears its quota (idempotent). Anything
    /// mounted below it must be unmounted first.
    pub fn remove_sandbox_dir(&self, id: &str) -> Result<()> {
        check_id(id)?;
        self.remove_entry(id)
    }

    /// Bytes used and the limit of sandbox `id`. On btrfs, `used` includes data
    /// reserved for writes not yet committed.
    pub fn usage(&self, id: &str) -> Result<DiskUsage> {
        let dir = self.sandbox_dir(id)?;
        match self.backend {
            QuotaBackend::XfsProject => {
                let f = File::open(&dir).map_err(io_err(format!("opening {}", dir.display())))?;
                let projid = fsxattr_get(&f)
                    .map_err(io_err(format!("reading project id of {}", dir.display())))?
                    .fsx_projid;
                let q = xfs_get_quota(&f, projid)
                    .map_err(io_err(format!("reading quota of project {projid}")))?;
                Ok(DiskUsage {
                    used_bytes: q.d_bcount * 512,
                    limit_bytes: q.d_blk_hardlimit * 512,
                })
            }
            QuotaBackend::BtrfsQgroup => {
                let f = File::open(&dir).map_err(io_err(format!("opening {}", dir.display())))?;
                let subvol = btrfs_subvol_id(&f)
                    .map_err(io_err(format!("looking up subvolume of {}", dir.display())))?;
                let q = self.qgroups_dir.join(format!("0_{subvol}"));
                let read = |name: &str| -> Result<u64> {
                    let p = q.join(name);
                    let s = fs::read_to_string(&p)
                        .map_err(io_err(format!("reading {}", p.display())))?;
                    s.trim().parse::<u64>().map_err(|_| StorageError::Io {
                        what: format!("parsing {}", p.display()),
                        source: io::Error::from(io::ErrorKind::InvalidData),
                    })
                };
                let used = read("referenced")? + read("rsv_data").unwrap_or(0);
                Ok(DiskUsage {
                    used_bytes: used,
                    limit_bytes: read("max_referenced")?,
                })
            }
        }
    }

    /// Removes every sandbox directory whose id is not in `known` (and half-created
    /// ones), and clears quota limits no directory uses.
    pub fn reconcile(&self, known: &[&str]) -> Result<()> {
        let known: HashSet<&str> = known.iter().copied().collect();
        for name in self.entries()? {
            if !known.contains(name.as_str()) {
                self.remove_entry(&name)?;
            }
        }
        match self.backend {
            QuotaBackend::XfsProject => {
                self.load_projects()?;
                let used: HashSet<u32> = self.lock_projects().keys().copied().collect();
                let f = File::open(&self.root)
                    .map_err(io_err(format!("opening {}", self.root.display())))?;
                let mut id = 1u32;
                while let Some(q) =
                    xfs_next_quota(&f, id).map_err(io_err("listing project quotas"))?
                {
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
            }
            QuotaBackend::BtrfsQgroup => {
                let mut live = HashSet::new();
                for name in self.entries()? {
                    if let Ok(f) = File::open(self.root.join(&name))
                        && let Ok(id) = btrfs_subvol_id(&f)
                    {
                        live.insert(id);
                    }
                }
                let root = File::open(&self.root)
                    .map_err(io_err(format!("opening {}", self.root.display())))?;
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
                        // Fails (harmlessly) while a deleted subvolume is still being cleaned.
                        let _ = btrfs_qgroup_destroy(&root, id);
                    }
                }
            }
        }
        Ok(())
    }

    /// Unmounts the image this storage mounted (for tests and uninstall). Every sandbox
    /// directory must be unused. The loop device is released by the kernel (autoclear).
    pub fn unmount(self) -> Result<()> {
        if !self.image_mounted {
            return Ok(());
        }
        unmount_path(&self.root)
    }

    /// The image file backing the storage (whether or not it is used).
    pub fn image_path(&self) -> &Path {
        &self.image
    }

    fn entries(&self) -> Result<Vec<String>> {
        let mut out = Vec::new();
        for entry in
            fs::read_dir(&self.root).map_err(io_err(format!("listing {}", self.root.display())))?
        {
            let entry = entry.map_err(io_err(format!("listing {}", self.root.display())))?;
            out.push(entry.file_name().to_string_lossy().into_owned());
        }
        Ok(out)
    }

    /// Removes `root/name` (a sandbox dir or a half-created one) and its quota.
    fn remove_entry(&self, name: &str) -> Result<()> {
        let path = self.root.join(name);
        let meta = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_err(format!("inspecting {}", path.display()))(e)),
        };
        if !meta.is_dir() {
            return fs::remove_file(&path).map_err(io_err(format!("removing {}", path.display())));
        }
        match self.backend {
            QuotaBackend::XfsProject => {
                let projid = File::open(&path)
                    .ok()
                    .and_then(|f| fsxattr_get(&f).ok())
                    .map(|x| x.fsx_projid);
                fs::remove_dir_all(&path)
                    .map_err(io_err(format!("removing {}", path.display())))?;
                if let Some(projid) = projid.filter(|&p| p != 0) {
                    let root = File::open(&self.root)
                        .map_err(io_err(format!("opening {}", self.root.display())))?;
                    xfs_set_limits(&root, projid, 0, 0)
                        .map_err(io_err(format!("clearing quota of project {projid}")))?;
                    self.lock_projects().remove(&projid);
                }
            }
            QuotaBackend::BtrfsQgroup => {
                let root = File::open(&self.root)
                    .map_err(io_err(format!("opening {}", self.root.display())))?;
                if meta.ino() == 256 {
                    // A subvolume: destroying it is O(1), the kernel cleans up in the background.
                    let subvol = File::open(&path)
                        .ok()
                        .and_then(|f| btrfs_subvol_id(&f).ok());
                    btrfs_subvol_destroy(&root, name)
                        .map_err(io_err(format!("deleting subvolume {}", path.display())))?;
                    if let Some(id) = subvol {
                        let _ = btrfs_qgroup_destroy(&root, id); // else `reconcile` retries
                    }
                } else {
                    fs::remove_dir_all(&path)
                        .map_err(io_err(format!("removing {}", path.display())))?;
                }
            }
        }
        Ok(())
    }

    fn lock_projects(&self) -> std::sync::MutexGuard<'_, HashMap<u32, String>> {
        self.projects.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// XFS: reads the project id of every directory.
    fn load_projects(&self) -> Result<()> {
        let mut map = HashMap::new();
        for name in self.entries()? {
            if let Ok(f) = File::open(self.root.join(&name))
                && let Ok(x) = fsxattr_get(&f)
                && x.fsx_projid != 0
            {
                map.insert(x.fsx_projid, name);
            }
        }
        *self.lock_projects() = map;
        Ok(())
    }

    fn xfs_create(&self, tmp: &Path, id: &str, quota_bytes: u64) -> Result<()> {
        fs::create_dir(tmp).map_err(io_err(format!("creating {}", tmp.display())))?;
        let projid = {
            let mut projects = self.lock_projects();
            let projid = (1..u32::MAX)
                .find(|p| !projects.contains_key(p))
                .ok_or(StorageError::NoFreeId)?;
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

    fn btrfs_create(&self, tmp_name: &str, quota_bytes: u64) -> Result<()> {
        let root =
            File::open(&self.root).map_err(io_err(format!("opening {}", self.root.display())))?;
        btrfs_subvol_create(&root, tmp_name)
            .map_err(io_err(format!("creating subvolume {tmp_name}")))?;
        let dir =
            File::open(self.root.join(tmp_name)).map_err(io_err(format!("opening {tmp_name}")))?;
        let id =
            btrfs_subvol_id(&dir).map_err(io_err(format!("looking up subvolume {tmp_name}")))?;
        btrfs_qgroup_limit(&root, id, quota_bytes)
            .map_err(io_err(format!("limiting qgroup 0/{id}")))
    }
}

fn check_id(id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(StorageError::InvalidId(id.to_string()))
    }
}

/// Unmounts the filesystem mounted at `path` (the quota image of a state directory,
/// `<state>/sandboxes`, which a node leaves mounted across restarts).
///
/// EBUSY can be transient: a child forked by another thread of this process holds copies
/// of our descriptors (some inside this filesystem) until it execs and its close-on-exec
/// descriptors go. Retries for up to about a second.
pub fn unmount_path(path: &Path) -> Result<()> {
    let c = cpath(path)?;
    let mut attempts = 0;
    loop {
        // SAFETY: c is a valid NUL-terminated path.
        if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        attempts += 1;
        if err.raw_os_error() != Some(libc::EBUSY) || attempts >= 50 {
            return Err(StorageError::Io {
                what: format!("unmounting {}", path.display()),
                source: err,
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn cpath(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| StorageError::Io {
        what: format!("path {}", p.display()),
        source: io::Error::from(io::ErrorKind::InvalidInput),
    })
}

// ---------------------------------------------------------------------------------------
// Mounts and setup (one-time; spawning tools is fine here).

/// One line of /proc/self/mountinfo.
struct MountEntry {
    mount_point: PathBuf,
    fstype: String,
    source: String,
    super_options: String,
}

fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn mounts() -> Result<Vec<MountEntry>> {
    let text = fs::read_to_string("/proc/self/mountinfo")
        .map_err(io_err("reading /proc/self/mountinfo"))?;
    let mut out = Vec::new();
    for line in text.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let l: Vec<&str> = left.split(' ').collect();
        let r: Vec<&str> = right.split(' ').collect();
        if l.len() < 5 || r.len() < 3 {
            continue;
        }
        out.push(MountEntry {
            mount_point: PathBuf::from(unescape_mountinfo(l[4])),
            fstype: r[0].to_string(),
            source: unescape_mountinfo(r[1]),
            super_options: r[2].to_string(),
        });
    }
    Ok(out)
}

/// The mount `path` lives on (the last-mounted one whose mount point is a prefix).
fn mount_of(path: &Path) -> Result<Option<MountEntry>> {
    Ok(mounts()?
        .into_iter()
        .filter(|m| path.starts_with(&m.mount_point))
        .max_by_key(|m| m.mount_point.components().count()))
}

fn is_mount_point(path: &Path) -> Result<bool> {
    Ok(mounts()?.iter().any(|m| m.mount_point == path))
}

fn mount_source_is_loop_of(root: &Path, image: &Path) -> bool {
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

/// The quota mechanism usable at `root`, if any.
fn detect(root: &Path) -> Result<Option<QuotaBackend>> {
    let c = cpath(root)?;
    // SAFETY: zeroed statfs is valid; c is a valid path.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io_err(format!("statfs {}", root.display()))(
            io::Error::last_os_error(),
        ));
    }
    match st.f_type as i64 {
        XFS_SUPER_MAGIC => {
            let enforced = mount_of(root)?.is_some_and(|m| {
                m.fstype == "xfs" && m.super_options.split(',').any(|o| o == "prjquota")
            });
            Ok(enforced.then_some(QuotaBackend::XfsProject))
        }
        BTRFS_SUPER_MAGIC => Ok(btrfs_qgroups_dir(root)
            .is_ok_and(|d| d.exists())
            .then_some(QuotaBackend::BtrfsQgroup)),
        _ => Ok(None),
    }
}

fn run(cmd: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(io_err(format!(
            "running {cmd} (see scripts/install-deps.sh)"
        )))?;
    if !out.status.success() {
        return Err(StorageError::Command {
            command: format!("{cmd} {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

fn path_str(p: &Path) -> Result<&str> {
    p.to_str().ok_or_else(|| StorageError::Io {
        what: format!("non-UTF-8 path {}", p.display()),
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

fn mount_image(image: &Path, root: &Path) -> Result<()> {
    let (img, dir) = (path_str(image)?, path_str(root)?);
    match image_fstype(image)? {
        Some("xfs") => run(
            "mount",
            &["-t", "xfs", "-o", "loop,prjquota,noatime", img, dir],
        ),
        Some("btrfs") => {
            run("mount", &["-t", "btrfs", "-o", "loop,noatime", img, dir])?;
            if !btrfs_qgroups_dir(root).is_ok_and(|d| d.exists()) {
                run("btrfs", &["quota", "enable", dir])?;
            }
            Ok(())
        }
        _ => Err(StorageError::Unsupported(format!(
            "{} holds neither XFS nor btrfs; move it away to let Cubicle create a new one",
            image.display()
        ))),
    }
}

/// Creates the sparse image (XFS if the kernel enforces XFS project quotas, else btrfs)
/// and mounts it. Built under a temporary name so a crash never leaves a half-made image.
fn create_image(image: &Path, root: &Path, size: u64) -> Result<()> {
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
        &["-t", "xfs", "-o", "loop,prjquota,noatime", &t, &dir],
    )
    .is_ok();
    if !xfs_ok {
        // The kernel refuses `prjquota` (no CONFIG_XFS_QUOTA): use btrfs qgroups instead.
        fs::remove_file(&tmp).map_err(io_err(format!("removing {}", tmp.display())))?;
        make(size)?;
        run("mkfs.btrfs", &["-q", "-f", &t])?;
        run("mount", &["-t", "btrfs", "-o", "loop,noatime", &t, &dir])?;
        if let Err(e) = run("btrfs", &["quota", "enable", &dir]) {
            let _ = run("umount", &[&dir]);
            return Err(e);
        }
    }
    fs::set_permissions(root, std::os::unix::fs::PermissionsExt::from_mode(0o711))
        .map_err(io_err(format!("chmod {}", root.display())))?;
    fs::rename(&tmp, image).map_err(io_err(format!(
        "renaming {} to {}",
        tmp.display(),
        image.display()
    )))
}

// ---------------------------------------------------------------------------------------
// XFS project quota syscalls (linux/fs.h, linux/dqblk_xfs.h, linux/quota.h).

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

fn ioctl(f: &impl AsRawFd, req: u64, arg: *mut libc::c_void) -> io::Result<()> {
    // SAFETY: callers pass a request number matching the pointed-to struct.
    if unsafe { libc::ioctl(f.as_raw_fd(), req as _, arg) } < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

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

// ---------------------------------------------------------------------------------------
// btrfs ioctls (linux/btrfs.h).

const BTRFS_IOC_SUBVOL_CREATE: u64 = 0x5000_940e;
const BTRFS_IOC_SNAP_DESTROY: u64 = 0x5000_940f;
const BTRFS_IOC_INO_LOOKUP: u64 = 0xd000_9412;
const BTRFS_IOC_QGROUP_CREATE: u64 = 0x4010_942a;
const BTRFS_IOC_QGROUP_LIMIT: u64 = 0x8030_942b;
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

#[repr(C)]
struct BtrfsQgroupCreateArgs {
    create: u64,
    qgroupid: u64,
}

const _: () = assert!(std::mem::size_of::<BtrfsVolArgs>() == 4096);
const _: () = assert!(std::mem::size_of::<BtrfsInoLookupArgs>() == 4096);

fn vol_args(name: &str) -> io::Result<Box<BtrfsVolArgs>> {
    let mut a = Box::new(BtrfsVolArgs {
        fd: 0,
        name: [0; 4088],
    });
    let b = name.as_bytes();
    if b.len() >= a.name.len() || b.contains(&0) || b.contains(&b'/') {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    a.name[..b.len()].copy_from_slice(b);
    Ok(a)
}

fn btrfs_subvol_create(parent: &File, name: &str) -> io::Result<()> {
    let mut a = vol_args(name)?;
    ioctl(
        parent,
        BTRFS_IOC_SUBVOL_CREATE,
        &mut *a as *mut BtrfsVolArgs as *mut libc::c_void,
    )
}

fn btrfs_subvol_destroy(parent: &File, name: &str) -> io::Result<()> {
    let mut a = vol_args(name)?;
    ioctl(
        parent,
        BTRFS_IOC_SNAP_DESTROY,
        &mut *a as *mut BtrfsVolArgs as *mut libc::c_void,
    )
}

/// The id of the subvolume `f` is in.
fn btrfs_subvol_id(f: &File) -> io::Result<u64> {
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

fn btrfs_qgroup_limit(f: &File, subvol: u64, bytes: u64) -> io::Result<()> {
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
fn btrfs_qgroups_dir(path: &Path) -> Result<PathBuf> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn ids_are_validated() {
        assert!(check_id("abc-123_X").is_ok());
        for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(65), ".creating-x"] {
            assert!(check_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn mountinfo_unescapes_octal() {
        assert_eq!(unescape_mountinfo(r"/a\040b"), "/a b");
        assert_eq!(unescape_mountinfo(r"/plain"), "/plain");
    }

    fn is_root() -> bool {
        // SAFETY: no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    fn loop_devices_backed_by(image: &Path) -> Vec<String> {
        let mut out = Vec::new();
        for e in fs::read_dir("/sys/block").into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Ok(b) = fs::read_to_string(e.path().join("loop/backing_file"))
                && b.trim().starts_with(image.to_string_lossy().as_ref())
            {
                out.push(name);
            }
        }
        out
    }

    /// Writes 1 MiB chunks until an error; returns (bytes written, error).
    fn fill(path: &Path, max: u64) -> (u64, Option<io::Error>) {
        let mut f = File::create(path).unwrap();
        let chunk = vec![0xabu8; 1 << 20];
        let mut n = 0;
        while n < max {
            if let Err(e) = f.write_all(&chunk) {
                return (n, Some(e));
            }
            n += chunk.len() as u64;
        }
        if let Err(e) = f.sync_all() {
            return (n, Some(e));
        }
        (n, None)
    }

    #[test]
    fn quota_is_enforced_and_nothing_leaks() {
        if !is_root() {
            eprintln!("SKIPPED: needs root (loop-mounts a filesystem image, sets quotas)");
            return;
        }
        let state =
            std::env::temp_dir().join(format!("cubicle-test-storage-{}", std::process::id()));
        let _ = fs::remove_dir_all(&state);
        let config = StorageConfig {
            state_dir: state.clone(),
            image_size: 2 << 30,
        };
        let storage = match Storage::open_with(config.clone()) {
            Ok(s) => s,
            Err(e @ StorageError::Io { .. }) | Err(e @ StorageError::Command { .. })
                if which("mkfs.btrfs").is_none() || which("mkfs.xfs").is_none() =>
            {
                eprintln!("SKIPPED: xfsprogs / btrfs-progs missing (scripts/install-deps.sh): {e}");
                let _ = fs::remove_dir_all(&state);
                return;
            }
            Err(e) => panic!("open: {e}"),
        };
        let image = storage.image_path().to_path_buf();
        eprintln!("storage backend: {:?}", storage.backend());
        let guard = Cleanup {
            state: state.clone(),
        };

        let quota = 10u64 << 20;
        let dir = storage.create_sandbox_dir("sb-one", quota).unwrap();
        assert!(
            storage.create_sandbox_dir("sb-one", quota).is_err(),
            "duplicate ids are refused"
        );
        let other = storage.create_sandbox_dir("sb-two", quota).unwrap();
        fs::create_dir_all(dir.join("upper/nested")).unwrap();

        // Writing past the quota fails: ENOSPC on XFS, EDQUOT on btrfs.
        let (written, err) = fill(&dir.join("upper/nested/big"), 64 << 20);
        let err = err.expect("writing 64 MiB into a 10 MiB quota must fail");
        let code = err.raw_os_error();
        eprintln!(
            "writer stopped after {} MiB with {err} ({code:?})",
            written >> 20
        );
        assert!(
            code == Some(libc::ENOSPC) || code == Some(libc::EDQUOT),
            "{err}"
        );
        assert!(
            written <= quota,
            "wrote {written} bytes past a {quota} quota"
        );
        let expected = match storage.backend() {
            QuotaBackend::XfsProject => libc::ENOSPC,
            QuotaBackend::BtrfsQgroup => libc::EDQUOT,
        };
        assert_eq!(code, Some(expected));

        // The other sandbox is unaffected.
        let (_, err) = fill(&other.join("small"), 2 << 20);
        assert!(err.is_none(), "the neighbour's quota is its own: {err:?}");

        let u = storage.usage("sb-one").unwrap();
        eprintln!("usage: {u:?}");
        assert_eq!(u.limit_bytes, quota);
        assert!(
            u.used_bytes >= quota * 8 / 10,
            "usage {u:?} should be near the limit"
        );

        // Removal frees it; a new sandbox with the same id starts empty.
        storage.remove_sandbox_dir("sb-one").unwrap();
        storage.remove_sandbox_dir("sb-one").unwrap(); // idempotent
        assert!(!dir.exists());
        let dir = storage.create_sandbox_dir("sb-one", quota).unwrap();
        let (_, err) = fill(&dir.join("again"), 5 << 20);
        assert!(
            err.is_none(),
            "after removal the quota is free again: {err:?}"
        );

        // Reconcile: a half-created entry and an unknown sandbox go; known ones stay.
        fs::create_dir(storage.root().join(".creating-zombie")).unwrap();
        storage.reconcile(&["sb-one"]).unwrap();
        let mut left = storage.entries().unwrap();
        left.sort();
        assert_eq!(left, vec!["sb-one".to_string()]);

        // Restart: open again finds the mounted fs; then unmount and re-open re-mounts.
        drop(storage);
        let storage = Storage::open_with(config.clone()).unwrap();
        assert!(
            storage
                .sandbox_dir("sb-one")
                .unwrap()
                .join("again")
                .exists()
        );
        storage.unmount().unwrap();
        assert!(
            loop_devices_backed_by(&image).is_empty(),
            "loop device leaked"
        );
        let storage = Storage::open_with(config.clone()).unwrap();
        assert!(
            storage
                .sandbox_dir("sb-one")
                .unwrap()
                .join("again")
                .exists(),
            "data survives a re-mount"
        );
        assert_eq!(
            storage.usage("sb-one").unwrap().limit_bytes,
            quota,
            "quota survives a re-mount"
        );
        storage.remove_sandbox_dir("sb-one").unwrap();
        storage.unmount().unwrap();
        drop(guard);
        assert!(
            loop_devices_backed_by(&image).is_empty(),
            "loop device leaked"
        );
        assert!(
            !mounts()
                .unwrap()
                .iter()
                .any(|m| m.mount_point.starts_with(&state)),
            "mount leaked"
        );
        assert!(!state.exists());
    }

    /// `cargo test -p cubicle-runtime --lib storage::tests::create_remove_latency -- --ignored --nocapture`
    #[test]
    #[ignore = "benchmark: prints create/remove latency percentiles"]
    fn create_remove_latency() {
        if !is_root() {
            eprintln!("SKIPPED: needs root");
            return;
        }
        let state =
            std::env::temp_dir().join(format!("cubicle-bench-storage-{}", std::process::id()));
        let guard = Cleanup {
            state: state.clone(),
        };
        let storage = Storage::open_with(StorageConfig {
            state_dir: state.clone(),
            image_size: 8 << 30,
        })
        .unwrap();
        let (mut c, mut r) = (Vec::new(), Vec::new());
        for i in 0..200 {
            let id = format!("bench-{i}");
            let t = std::time::Instant::now();
            let dir = storage.create_sandbox_dir(&id, 5 << 30).unwrap();
            c.push(t.elapsed());
            fs::write(dir.join("f"), b"hello").unwrap();
            let t = std::time::Instant::now();
            storage.remove_sandbox_dir(&id).unwrap();
            r.push(t.elapsed());
        }
        for (name, v) in [
            ("create_sandbox_dir", &mut c),
            ("remove_sandbox_dir", &mut r),
        ] {
            v.sort();
            println!(
                "{name:>18} ({:?}): p50 {:>8.1?}  p99 {:>8.1?}  max {:>8.1?}  (n={})",
                storage.backend(),
                v[v.len() / 2],
                v[(v.len() * 99) / 100],
                v[v.len() - 1],
                v.len()
            );
        }
        storage.reconcile(&[]).unwrap();
        storage.unmount().unwrap();
        drop(guard);
    }

    fn which(bin: &str) -> Option<PathBuf> {
        std::env::var_os("PATH").and_then(|p| {
            std::env::split_paths(&p)
                .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
                .map(|d| d.join(bin))
                .find(|p| p.exists())
        })
    }

    /// Unmounts anything under the test state dir and removes it, even on panic.
    struct Cleanup {
        state: PathBuf,
    }

    impl Drop for Cleanup {
        fn drop(&mut self) {
            if let Ok(ms) = mounts() {
                for m in ms
                    .iter()
                    .rev()
                    .filter(|m| m.mount_point.starts_with(&self.state))
                {
                    if let Ok(c) = cpath(&m.mount_point) {
                        // SAFETY: valid path.
                        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
                    }
                }
            }
            let _ = fs::remove_dir_all(&self.state);
        }
    }
}
