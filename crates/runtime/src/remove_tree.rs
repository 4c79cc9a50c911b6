//! Removing a directory tree, whatever a sandbox left in it.
//!
//! A sandbox's writable layer is written by a hostile tenant, and its teardown must
//! succeed anyway, without ever acting outside the tree:
//! - **depth**: the walk is iterative and holds one open directory (two while moving
//!   up), so neither the stack nor the descriptor table grows with depth, and no path
//!   longer than one name is ever used (a tree deeper than `PATH_MAX` is fine);
//! - **breadth**: each directory is emptied in one pass, however many entries it has;
//! - **symlinks** are removed, never followed; **other mounts** are never entered
//!   (`openat2` with `RESOLVE_NO_XDEV`): a mount inside the tree is an error, the caller
//!   unmounts first;
//! - **btrfs subvolumes** (they look like other filesystems: their own `st_dev`) are
//!   destroyed whole (`BTRFS_IOC_SNAP_DESTROY`), a read-only one made writable first —
//!   also the tree's root when it is one;
//! - **immutable and append-only** inode flags are cleared before an unlink is retried.
//!
//! Moving up uses `..` and checks that it leads to the directory it came from: the
//! tree must not change while it is removed (its sandbox is dead). Entries that cannot
//! be removed are skipped so that everything else goes; the first error is returned.

use std::collections::HashSet;
use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::storage::btrfs::{btrfs_subvol_destroy_at, btrfs_subvol_make_writable};

const BTRFS_SUPER_MAGIC: i64 = 0x9123_683e;
/// Inode number of every btrfs subvolume's root directory.
const BTRFS_FIRST_FREE_OBJECTID: u64 = 256;
const FS_IOC_GETFLAGS: libc::c_ulong = 0x8008_6601;
const FS_IOC_SETFLAGS: libc::c_ulong = 0x4008_6602;
const FS_IMMUTABLE_FL: libc::c_long = 0x10;
const FS_APPEND_FL: libc::c_long = 0x20;
const RESOLVE_NO_XDEV: u64 = 0x01;
const RESOLVE_NO_MAGICLINKS: u64 = 0x02;
const RESOLVE_NO_SYMLINKS: u64 = 0x04;
const RESOLVE_BENEATH: u64 = 0x08;

/// Removes `path` (a directory tree, a file or a symlink; missing is fine), as the module
/// doc describes.
pub fn remove_tree(path: &Path) -> io::Result<()> {
    let (parent, name) = match (path.parent(), path.file_name()) {
        (Some(p), Some(n)) => (p, n),
        _ => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("refusing to remove {}", path.display()),
            ));
        }
    };
    let parent_path = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let parent = match open_dir(None, parent_path, false) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let name =
        CString::new(name.as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let st = match fstatat(&parent, &name) {
        Ok(st) => st,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if is_dir(&st) {
        remove_dir_at(&parent, &name)
    } else {
        unlink_at(&parent, &name, &st)
    }
}

/// Removes everything below the directory `dir` as [`remove_tree`] does, and keeps `dir`
/// itself (its immutable/append-only flags cleared). Fails unless `dir` ends up empty.
pub fn remove_contents(dir: &OwnedFd) -> io::Result<()> {
    make_writable(dir);
    let mut first_err: Option<io::Error> = None;
    for name in read_names(dir)? {
        let Some(st) = entry_stat(dir, &name, &mut first_err) else {
            continue;
        };
        let r = if is_dir(&st) {
            remove_dir_at(dir, &name)
        } else {
            unlink_at(dir, &name, &st)
        };
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    if !read_names(dir)?.is_empty() {
        return Err(io::Error::other(
            "entries appeared while the directory was emptied",
        ));
    }
    Ok(())
}

/// Identity of a directory: (device, inode).
type Id = (u64, u64);

/// Removes the directory `name` in `parent` with everything below it.
fn remove_dir_at(parent: &OwnedFd, name: &CStr) -> io::Result<()> {
    // The common cases first: empty, or a whole btrfs subvolume.
    if rmdir_at(parent, name).is_ok() || destroy_subvolume(parent, name).is_ok() {
        return Ok(());
    }
    let mut cur = open_dir(Some(parent), Path::new(osstr(name)), true)?;
    make_writable(&cur);
    let mut levels: Vec<(CString, Id)> = vec![(name.to_owned(), id_of(&fstat(&cur)?))];
    let mut skip: HashSet<Id> = HashSet::new();
    let mut first_err: Option<io::Error> = None;
    loop {
        if let Some((child_name, child)) = empty_dir(&cur, &mut skip, &mut first_err)? {
            make_writable(&child);
            levels.push((child_name, id_of(&fstat(&child)?)));
            cur = child;
            continue;
        }
        let Some((name, id)) = levels.pop() else {
            unreachable!("levels holds the current directory");
        };
        let parent_dir = match levels.last() {
            None => {
                drop(cur);
                let r = rmdir_at(parent, &name)
                    .or_else(|e| destroy_subvolume(parent, &name).map_err(|_| e));
                return match (first_err, r) {
                    (Some(e), _) | (None, Err(e)) => Err(e),
                    (None, Ok(())) => Ok(()),
                };
            }
            Some((_, parent_id)) => {
                let up = open_dir(Some(&cur), Path::new(".."), false)?;
                if id_of(&fstat(&up)?) != *parent_id {
                    return Err(io::Error::other(
                        "the tree changed while it was being removed ('..' moved)",
                    ));
                }
                up
            }
        };
        drop(cur);
        if let Err(e) = rmdir_at(&parent_dir, &name)
            .or_else(|e| destroy_subvolume(&parent_dir, &name).map_err(|_| e))
        {
            skip.insert(id);
            first_err.get_or_insert(e);
        }
        cur = parent_dir;
    }
}

/// Removes every entry of `dir` it can. Returns a subdirectory to descend into first
/// (it was not empty), or `None` when `dir` holds nothing more this walk can remove.
fn empty_dir(
    dir: &OwnedFd,
    skip: &mut HashSet<Id>,
    first_err: &mut Option<io::Error>,
) -> io::Result<Option<(CString, OwnedFd)>> {
    for name in read_names(dir)? {
        let Some(st) = entry_stat(dir, &name, first_err) else {
            continue;
        };
        let id = id_of(&st);
        if skip.contains(&id) {
            continue;
        }
        if !is_dir(&st) {
            if let Err(e) = unlink_at(dir, &name, &st) {
                skip.insert(id);
                first_err.get_or_insert(e);
            }
            continue;
        }
        if rmdir_at(dir, &name).is_ok() || destroy_subvolume(dir, &name).is_ok() {
            continue;
        }
        match open_dir(Some(dir), Path::new(osstr(&name)), true) {
            Ok(child) => return Ok(Some((name, child))),
            Err(e) => {
                skip.insert(id);
                first_err.get_or_insert(e);
            }
        }
    }
    Ok(None)
}

/// `name`'s stat in `dir` (not following a symlink); `None` when it is gone, or on an
/// error, kept in `first_err` if it is the first.
fn entry_stat(dir: &OwnedFd, name: &CStr, first_err: &mut Option<io::Error>) -> Option<libc::stat> {
    match fstatat(dir, name) {
        Ok(st) => Some(st),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => {
            first_err.get_or_insert(e);
            None
        }
    }
}

/// Unlinks a non-directory, clearing immutable/append-only flags if that is what stops it.
fn unlink_at(dir: &OwnedFd, name: &CStr, st: &libc::stat) -> io::Result<()> {
    let unlink = || {
        // SAFETY: valid dirfd and C string.
        cvt(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) })
    };
    match unlink() {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EPERM) && is_reg(st) => {
            let f = open_at(
                dir,
                name,
                libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY,
            )?;
            clear_pinning_flags(&f)?;
            unlink()
        }
        Err(e) => Err(e),
    }
}

fn rmdir_at(dir: &OwnedFd, name: &CStr) -> io::Result<()> {
    // SAFETY: valid dirfd and C string.
    match cvt(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), libc::AT_REMOVEDIR) }) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Destroys `name` in `dir` if it is the root of a btrfs subvolume (read-only ones made
/// writable first). Fails for anything else, and for a subvolume holding subvolumes.
fn destroy_subvolume(dir: &OwnedFd, name: &CStr) -> io::Result<()> {
    let st = fstatat(dir, name)?;
    if st.st_ino != BTRFS_FIRST_FREE_OBJECTID || !is_dir(&st) || !on_btrfs(dir) {
        return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
    }
    let sub = open_dir(Some(dir), Path::new(osstr(name)), true)?;
    make_writable(&sub);
    drop(sub);
    make_writable(dir);
    btrfs_subvol_destroy_at(dir, name)
}

/// Clears what would stop entries of `dir` from being removed: the read-only flag of a
/// btrfs subvolume, immutable/append-only flags of the directory. Best effort.
fn make_writable(dir: &OwnedFd) {
    if on_btrfs(dir) && fstat(dir).is_ok_and(|st| st.st_ino == BTRFS_FIRST_FREE_OBJECTID) {
        let _ = btrfs_subvol_make_writable(dir);
    }
    let _ = clear_pinning_flags(dir);
}

/// Clears FS_IMMUTABLE_FL and FS_APPEND_FL (no-op when neither is set).
fn clear_pinning_flags(f: &OwnedFd) -> io::Result<()> {
    let mut flags: libc::c_long = 0;
    // SAFETY: FS_IOC_GETFLAGS writes one long.
    cvt(unsafe { libc::ioctl(f.as_raw_fd(), FS_IOC_GETFLAGS, &mut flags) })?;
    if flags & (FS_IMMUTABLE_FL | FS_APPEND_FL) == 0 {
        return Ok(());
    }
    flags &= !(FS_IMMUTABLE_FL | FS_APPEND_FL);
    // SAFETY: FS_IOC_SETFLAGS reads one long.
    cvt(unsafe { libc::ioctl(f.as_raw_fd(), FS_IOC_SETFLAGS, &flags) })
}

fn on_btrfs(dir: &OwnedFd) -> bool {
    // SAFETY: zeroed statfs is a valid out buffer.
    let mut sfs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and out pointer.
    unsafe {
        libc::fstatfs(dir.as_raw_fd(), &mut sfs) == 0 && sfs.f_type as i64 == BTRFS_SUPER_MAGIC
    }
}

/// Opens a directory below `base` (or `path` itself when `base` is `None`) without
/// following symlinks; with `beneath`, also without leaving `base` or crossing a mount.
fn open_dir(base: Option<&OwnedFd>, path: &Path, beneath: bool) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    #[repr(C)]
    struct OpenHow {
        flags: u64,
        mode: u64,
        resolve: u64,
    }
    let how = OpenHow {
        flags: (libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC) as u64,
        mode: 0,
        resolve: if beneath {
            RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH
        } else {
            RESOLVE_NO_MAGICLINKS
        },
    };
    // `..` is not beneath; it must still not cross a mount.
    let how = if path == Path::new("..") {
        OpenHow {
            resolve: RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS,
            ..how
        }
    } else {
        how
    };
    let dirfd = base.map_or(libc::AT_FDCWD, |b| b.as_raw_fd());
    // SAFETY: openat2 with a valid dirfd, C string and open_how of the given size.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dirfd,
            c.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn open_at(dir: &OwnedFd, name: &CStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: valid dirfd and C string.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The names in `dir` (without `.` and `..`), read from its start.
fn read_names(dir: &OwnedFd) -> io::Result<Vec<CString>> {
    // fdopendir takes ownership of its descriptor: give it a duplicate.
    // SAFETY: fcntl with integer arguments.
    let dup = unsafe { libc::fcntl(dir.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `dup` is ours; on failure we close it.
    let d = unsafe { libc::fdopendir(dup) };
    if d.is_null() {
        let e = io::Error::last_os_error();
        // SAFETY: closing our own descriptor.
        unsafe { libc::close(dup) };
        return Err(e);
    }
    // SAFETY: rewind to the start (the duplicate shares the offset with `dir`).
    unsafe { libc::rewinddir(d) };
    let mut names = Vec::new();
    loop {
        // SAFETY: d is a valid DIR*; errno distinguishes end from error.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: as above.
        let e = unsafe { libc::readdir64(d) };
        if e.is_null() {
            // SAFETY: reading errno.
            let errno = unsafe { *libc::__errno_location() };
            // SAFETY: closing the DIR* we opened (and its descriptor).
            unsafe { libc::closedir(d) };
            if errno != 0 {
                return Err(io::Error::from_raw_os_error(errno));
            }
            return Ok(names);
        }
        // SAFETY: d_name is a NUL-terminated string inside the entry.
        let name = unsafe { CStr::from_ptr((*e).d_name.as_ptr()) };
        if name.to_bytes() != b"." && name.to_bytes() != b".." {
            names.push(name.to_owned());
        }
    }
}

fn fstatat(dir: &OwnedFd, name: &CStr) -> io::Result<libc::stat> {
    // SAFETY: zeroed stat is a valid out buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid dirfd, C string and out pointer.
    cvt(unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })?;
    Ok(st)
}

fn fstat(f: &OwnedFd) -> io::Result<libc::stat> {
    // SAFETY: zeroed stat is a valid out buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and out pointer.
    cvt(unsafe { libc::fstat(f.as_raw_fd(), &mut st) })?;
    Ok(st)
}

fn id_of(st: &libc::stat) -> Id {
    (st.st_dev, st.st_ino)
}

fn is_dir(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFDIR
}

fn is_reg(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFREG
}

fn osstr(c: &CStr) -> &std::ffi::OsStr {
    std::ffi::OsStr::from_bytes(c.to_bytes())
}

fn cvt(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn scratch(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("cubicle-rmtree-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    /// In `d`: `outside/keep`, and `tree/` with nested directories, files and symlinks
    /// to `outside` and to `outside/keep`. Returns (outside, tree).
    fn littered(d: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
        let outside = d.join("outside");
        fs::create_dir_all(&outside).unwrap();
        fs::write(outside.join("keep"), "x").unwrap();
        let t = d.join("tree");
        fs::create_dir_all(t.join("a/b/c")).unwrap();
        fs::write(t.join("a/b/c/f"), "x").unwrap();
        fs::write(t.join("a/g"), "y").unwrap();
        std::os::unix::fs::symlink(&outside, t.join("a/link-dir")).unwrap();
        std::os::unix::fs::symlink(outside.join("keep"), t.join("link-file")).unwrap();
        (outside, t)
    }

    #[test]
    fn removes_files_symlinks_and_nested_dirs_without_following_links() {
        let d = scratch("basic");
        let (outside, t) = littered(&d);
        remove_tree(&t).unwrap();
        assert!(!t.exists());
        assert!(
            outside.join("keep").exists(),
            "a symlink target was removed"
        );
        remove_tree(&t).unwrap(); // missing is fine
        remove_tree(&d).unwrap();
        assert!(!d.exists());
    }

    #[test]
    fn remove_contents_empties_a_directory_and_keeps_it() {
        let d = scratch("contents");
        let (outside, t) = littered(&d);
        let dir = open_dir(None, &t, false).unwrap();
        remove_contents(&dir).unwrap();
        assert!(t.is_dir(), "the directory itself went");
        assert_eq!(fs::read_dir(&t).unwrap().count(), 0, "entries left");
        assert!(
            outside.join("keep").exists(),
            "a symlink target was removed"
        );
        remove_contents(&dir).unwrap(); // already empty is fine
        remove_tree(&d).unwrap();
    }

    #[test]
    fn removes_a_tree_deeper_than_path_max_and_the_fd_limit() {
        let d = scratch("deep");
        // 1200 levels of 8-byte names: 9.6 KB of path (PATH_MAX is 4096), and more
        // levels than the descriptor limit (1024) a recursive walk would need.
        let mut fd = open_dir(None, &d, false).unwrap();
        let name = CString::new("deepdir").unwrap();
        for _ in 0..1200 {
            // SAFETY: valid dirfd and C string.
            cvt(unsafe { libc::mkdirat(fd.as_raw_fd(), name.as_ptr(), 0o755) }).unwrap();
            fd = open_dir(Some(&fd), Path::new("deepdir"), true).unwrap();
        }
        fs::write(format!("/proc/self/fd/{}/leaf", fd.as_raw_fd()), "x").unwrap();
        drop(fd);
        remove_tree(&d.join("deepdir")).unwrap();
        assert!(!d.join("deepdir").exists());
        fs::remove_dir(&d).unwrap();
    }

    #[test]
    fn refuses_to_cross_into_a_mount() {
        // SAFETY: no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: needs root (mounts a tmpfs)");
            return;
        }
        let d = scratch("mount");
        let m = d.join("t/mnt");
        fs::create_dir_all(&m).unwrap();
        let c = CString::new(m.as_os_str().as_bytes()).unwrap();
        // SAFETY: valid C strings.
        let rc = unsafe {
            libc::mount(
                c"tmpfs".as_ptr(),
                c.as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        assert_eq!(rc, 0, "mount tmpfs: {}", io::Error::last_os_error());
        fs::write(m.join("on-the-mount"), "x").unwrap();
        assert!(remove_tree(&d.join("t")).is_err());
        assert!(m.join("on-the-mount").exists(), "it emptied another mount");
        // SAFETY: valid C string.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        remove_tree(&d).unwrap();
    }
}
