//! Small filesystem helpers the node needs: atomic JSON records, mount discovery,
//! unmounting everything below a directory, and removing a tree without ever crossing
//! into a mounted filesystem (a stale bind mount of `/dev` must never be emptied).

use std::ffi::CString;
use std::fs;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, IoContext, Result};

/// Write `value` as pretty JSON to `path` atomically (temp file + rename), mode 0600.
/// No fsync: the records describe kernel state (processes, mounts, cgroups) that a power
/// loss erases anyway; what they must survive is a crash of the node process, and the
/// page cache does.
pub fn write_json_atomic<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    write_atomic(path, &to_json(path, value)?)
}

/// The size of a record [`rewrite_json`] writes in place: one page.
const RECORD_PAGE: usize = 4096;

/// Write `value` as pretty JSON to `path`, mode 0600, as [`write_json_atomic`] does, but
/// over the file in place when it can, for records rewritten on a hot path (a sandbox's,
/// at every claim and kill). A record of at most one page is padded with spaces to one
/// page (JSON allows trailing whitespace) and written by one `pwrite` at offset 0 over
/// an existing regular file of at most that size: the kernel copies a write in page by
/// page and stops between pages only, so a crash of the process leaves the old record or
/// the new one, as the rename does; two writers at once each write the whole page. One
/// open and one write instead of a new inode and a rename: about 7 µs instead of 58 on
/// btrfs, and a tenth of a warm burst's CPU (docs/bench.md, round 25). A larger record,
/// or no such file yet, is written whole by [`write_json_atomic`]'s rename (a record of
/// at most a page then as a padded page, ready for the next rewrite).
pub fn rewrite_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let mut data = to_json(path, value)?;
    if data.len() > RECORD_PAGE {
        return write_atomic(path, &data);
    }
    data.resize(RECORD_PAGE, b' ');
    data[RECORD_PAGE - 1] = b'\n';
    let Some(f) = open_record_page(path) else {
        return write_atomic(path, &data);
    };
    use std::os::unix::fs::FileExt;
    match f.write_at(&data, 0).ctx("write", path)? {
        n if n == data.len() => Ok(()),
        n => Err(Error::io(
            "write",
            path,
            std::io::Error::other(format!("{n} of {} bytes written", data.len())),
        )),
    }
}

/// `path` opened for writing if it is a regular file of at most one page (never through
/// a symbolic link, never blocking on a FIFO).
fn open_record_page(path: &Path) -> Option<fs::File> {
    let f = fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let m = f.metadata().ok()?;
    (m.file_type().is_file() && m.len() <= RECORD_PAGE as u64).then_some(f)
}

fn to_json<T: Serialize>(path: &Path, value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec_pretty(value).map_err(|e| Error::Record {
        path: path.into(),
        source: e,
    })
}

/// `data` to `path` by a new file (mode 0600) renamed over it.
fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    // One temporary file per call: two threads writing the same record at once must not
    // share one (the second rename would find it gone).
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}-{seq}", std::process::id()));
    {
        // 0600: records hold secrets (a sandbox's envd token).
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .ctx("create", &tmp)?;
        // A leftover temporary file keeps its old mode: set it.
        f.set_permissions(fs::Permissions::from_mode(0o600))
            .ctx("chmod", &tmp)?;
        f.write_all(data).ctx("write", &tmp)?;
    }
    fs::rename(&tmp, path).ctx("rename", path)?;
    Ok(())
}

/// Read a JSON record.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> Result<T> {
    let data = fs::read(path).ctx("read", path)?;
    serde_json::from_slice(&data).map_err(|e| Error::Record {
        path: path.into(),
        source: e,
    })
}

/// Mount points (in this process's mount namespace) at or below `dir`, deepest first.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    cubicle_syscalls::mountinfo::mounts_under(dir).unwrap_or_default()
}

/// Lazily unmount every mount at or below `dir` (deepest first). Returns how many.
pub fn unmount_all_under(dir: &Path) -> usize {
    let mut n = 0;
    // A path can be stacked several times; loop until nothing is left or no progress.
    for _ in 0..8 {
        let mounts = mounts_under(dir);
        if mounts.is_empty() {
            break;
        }
        let mut progressed = false;
        for m in mounts {
            if umount_detach(&m).is_ok() {
                n += 1;
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }
    n
}

/// `umount2(path, MNT_DETACH)`.
pub fn umount_detach(path: &Path) -> std::io::Result<()> {
    cubicle_syscalls::fs::unmount_detach(path)
}

/// Remove `dir` recursively, first unmounting anything mounted below it, and never
/// descending into another mount (such a directory is reported as an error instead).
/// Whatever a sandbox left in it goes: nested btrfs subvolumes, read-only or not,
/// immutable files, trees deeper than PATH_MAX (`cubicle_runtime::remove_tree`). Missing
/// `dir` is not an error.
pub fn remove_tree(dir: &Path) -> Result<()> {
    unmount_all_under(dir);
    cubicle_runtime::remove_tree(dir).ctx("remove", dir)
}

/// Total apparent size in bytes of the regular files below `dir` (hard links counted
/// once per link; symlinks not followed, mounts not crossed).
pub fn tree_size(dir: &Path) -> u64 {
    let Ok(root) = fs::symlink_metadata(dir) else {
        return 0;
    };
    let dev = root.dev();
    let mut total = 0u64;
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                if m.dev() == dev {
                    stack.push(e.path());
                }
            } else if m.is_file() && (m.nlink() == 1 || seen.insert((m.dev(), m.ino()))) {
                total += m.len();
            }
        }
    }
    total
}

fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Error::InvalidRequest(format!("path {} contains a NUL byte", path.display())))
}

/// `lsetxattr(path, name, value)` (never follows a final symlink).
pub fn set_xattr(path: &Path, name: &str, value: &[u8]) -> Result<()> {
    let p = c_path(path)?;
    let n =
        CString::new(name).map_err(|_| Error::InvalidRequest(format!("xattr name {name:?}")))?;
    // SAFETY: valid NUL-terminated strings and a buffer of the given length.
    let r = unsafe {
        libc::lsetxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(Error::io("setxattr", path, std::io::Error::last_os_error()))
    }
}

/// `lgetxattr(path, name)`: the value, or `None` if the attribute is absent.
pub fn get_xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let p = c_path(path).ok()?;
    let n = CString::new(name).ok()?;
    let mut buf = vec![0u8; 4096];
    // SAFETY: valid NUL-terminated strings and a writable buffer of the given length.
    let r = unsafe { libc::lgetxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        return None;
    }
    buf.truncate(r as usize);
    Some(buf)
}

/// Names of the extended attributes of `path` (not following a final symlink).
pub fn list_xattrs(path: &Path) -> Vec<String> {
    let Ok(p) = c_path(path) else {
        return Vec::new();
    };
    let mut buf = vec![0u8; 8192];
    // SAFETY: valid NUL-terminated path and a writable buffer of the given length.
    let r = unsafe { libc::llistxattr(p.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r <= 0 {
        return Vec::new();
    }
    buf[..r as usize]
        .split(|b| *b == 0)
        .filter(|n| !n.is_empty())
        .map(|n| String::from_utf8_lossy(n).into_owned())
        .collect()
}

/// `mknod(path, kind | 0644, makedev(major, minor))` (`kind`: `S_IFCHR`, `S_IFBLK`,
/// `S_IFIFO`). A 0/0 character device is an overlayfs whiteout.
pub fn mknod(path: &Path, kind: libc::mode_t, major: u32, minor: u32) -> Result<()> {
    let p = c_path(path)?;
    // SAFETY: valid NUL-terminated path; integer arguments.
    let r = unsafe { libc::mknod(p.as_ptr(), kind | 0o644, libc::makedev(major, minor)) };
    if r == 0 {
        Ok(())
    } else {
        Err(Error::io("mknod", path, std::io::Error::last_os_error()))
    }
}

/// `lchown(path, uid, gid)` (never follows a final symlink).
pub fn lchown(path: &Path, uid: u32, gid: u32) -> Result<()> {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid)).map_err(|e| Error::io("chown", path, e))
}

/// Whether `path` is an ELF64 executable without a program interpreter (static).
pub fn is_static_elf(path: &Path) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    let mut h = [0u8; 64];
    if f.read_exact(&mut h).is_err() || &h[..4] != b"\x7fELF" || h[4] != 2 {
        return false;
    }
    let phoff = u64::from_le_bytes([h[32], h[33], h[34], h[35], h[36], h[37], h[38], h[39]]);
    let phentsize = u16::from_le_bytes([h[54], h[55]]) as usize;
    let phnum = u16::from_le_bytes([h[56], h[57]]) as usize;
    if phentsize < 4 || phnum > 4096 || f.seek(SeekFrom::Start(phoff)).is_err() {
        return false;
    }
    let mut ph = vec![0u8; phentsize * phnum];
    if f.read_exact(&mut ph).is_err() {
        return false;
    }
    const PT_INTERP: u32 = 3;
    !ph.chunks(phentsize)
        .any(|p| u32::from_le_bytes([p[0], p[1], p[2], p[3]]) == PT_INTERP)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Threads writing the same record at once all succeed (each through a temporary
    /// file of its own), and the record is one of the values written, whole.
    #[test]
    fn concurrent_writes_of_one_record_all_succeed() {
        let dir = std::env::temp_dir().join(format!("cubicle-fsutil-race-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("template.json");
        let threads: Vec<_> = (0..8u32)
            .map(|t| {
                let path = path.clone();
                std::thread::spawn(move || {
                    (0..200u32)
                        .map(|i| write_json_atomic(&path, &vec![t; 64 + i as usize]))
                        .filter(|r| r.is_err())
                        .count()
                })
            })
            .collect();
        let failed: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
        let v: Vec<u32> = read_json(&path).unwrap();
        let left = fs::read_dir(&dir).unwrap().count();
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(failed, 0, "writes failed");
        assert!(
            v.len() >= 64 && v.iter().all(|x| *x == v[0]),
            "a torn record"
        );
        assert_eq!(left, 1, "temporary files left");
    }

    /// A record of at most a page is rewritten in place (the same inode, one page, the
    /// value read back whole); concurrent rewriters leave one of their values, whole; a
    /// record larger than a page, and a path that is a symbolic link, are replaced by a
    /// rename (the link itself, never its target).
    #[test]
    fn small_records_are_rewritten_in_place() {
        use std::os::unix::fs::MetadataExt;
        let dir = std::env::temp_dir().join(format!("cubicle-fsutil-page-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("sandbox.json");
        rewrite_json(&path, &vec![1u32; 8]).unwrap();
        let first = fs::metadata(&path).unwrap();
        assert_eq!(
            first.len(),
            RECORD_PAGE as u64,
            "a first write is a padded page"
        );
        assert_eq!(first.mode() & 0o777, 0o600);
        rewrite_json(&path, &vec![2u32; 4]).unwrap();
        let again = fs::metadata(&path).unwrap();
        assert_eq!(again.ino(), first.ino(), "rewritten in place");
        assert_eq!(read_json::<Vec<u32>>(&path).unwrap(), vec![2u32; 4]);

        let threads: Vec<_> = (0..8u32)
            .map(|t| {
                let path = path.clone();
                std::thread::spawn(move || {
                    (0..200u32)
                        .filter(|i| rewrite_json(&path, &vec![t; 1 + *i as usize % 100]).is_err())
                        .count()
                })
            })
            .collect();
        let failed: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(failed, 0, "rewrites failed");
        let v: Vec<u32> = read_json(&path).unwrap();
        assert!(
            !v.is_empty() && v.iter().all(|x| *x == v[0]),
            "a torn record"
        );
        assert_eq!(fs::metadata(&path).unwrap().ino(), first.ino());

        // Larger than a page: a new file, exactly the JSON.
        let big = vec![7u32; RECORD_PAGE];
        rewrite_json(&path, &big).unwrap();
        let m = fs::metadata(&path).unwrap();
        assert_ne!(m.ino(), first.ino());
        assert!(m.len() > RECORD_PAGE as u64);
        assert_eq!(read_json::<Vec<u32>>(&path).unwrap(), big);
        // Over a record larger than a page, a small one is not written in place either
        // (the old record's tail would follow it).
        rewrite_json(&path, &vec![3u32; 2]).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().len(), RECORD_PAGE as u64);
        assert_eq!(read_json::<Vec<u32>>(&path).unwrap(), vec![3u32; 2]);

        // A symbolic link is replaced, its target untouched.
        let target = dir.join("target");
        fs::write(&target, b"keep").unwrap();
        let link = dir.join("link.json");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        rewrite_json(&link, &vec![4u32]).unwrap();
        assert_eq!(fs::read(&target).unwrap(), b"keep");
        assert!(
            !fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(read_json::<Vec<u32>>(&link).unwrap(), vec![4u32]);
        let left = fs::read_dir(&dir).unwrap().count();
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(left, 3, "temporary files left");
    }

    #[test]
    fn removes_tree_and_measures_size() {
        let base = std::env::temp_dir().join(format!("cubicle-fsutil-{}", std::process::id()));
        fs::create_dir_all(base.join("a/b")).unwrap();
        fs::write(base.join("a/b/f"), b"hello").unwrap();
        std::os::unix::fs::symlink("/etc", base.join("a/link")).unwrap();
        assert_eq!(tree_size(&base), 5);
        remove_tree(&base).unwrap();
        assert!(!base.exists());
        // the symlink target is untouched
        assert!(Path::new("/etc/hostname").exists() || Path::new("/etc").exists());
        remove_tree(&base).unwrap();
    }

    #[test]
    fn json_roundtrip() {
        let p = std::env::temp_dir().join(format!("cubicle-json-{}.json", std::process::id()));
        write_json_atomic(&p, &vec![1, 2, 3]).unwrap();
        let v: Vec<i32> = read_json(&p).unwrap();
        assert_eq!(v, vec![1, 2, 3]);
        fs::remove_file(&p).unwrap();
    }
}
