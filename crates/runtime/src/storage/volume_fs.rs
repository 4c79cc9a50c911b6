//! [`VolumeFs`]: file operations on a volume's tree from the host (the volume content
//! API), safe against whatever the sandboxes that mount the volume left in it.
//!
//! The host acts as root on a tree that tenants write, so no path is ever resolved
//! naively: every lookup is an `openat2` below the volume's root with
//! `RESOLVE_IN_ROOT` (an absolute symlink, or `..`, resolves as it would inside a sandbox
//! that mounts the volume: never above the volume), `RESOLVE_NO_MAGICLINKS` and
//! `RESOLVE_NO_XDEV` (no `/proc` tricks, no other filesystem). Entries are examined and
//! changed relative to a descriptor of their parent, never by a second path lookup, and
//! the final component is not followed where the operation is about the entry itself
//! (stat, metadata, removal). Trees are removed iteratively, one descriptor per level.
//!
//! Owners are the ones sandboxes see (volumes are mounted idmapped): a new entry belongs
//! to the owner of its parent directory unless the caller names one, and only ids a
//! sandbox can have (0–65535) are accepted.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::sys;

/// The highest uid/gid a volume entry may be given (the ids every sandbox maps).
pub const MAX_VOLUME_ID: u32 = 65_535;
/// The most entries one listing returns.
pub const MAX_LIST_ENTRIES: usize = 100_000;
/// The deepest directory tree a recursive removal descends into.
const MAX_DEPTH: usize = 4096;

const RESOLVE: u64 = sys::RESOLVE_IN_ROOT | sys::RESOLVE_NO_MAGICLINKS | sys::RESOLVE_NO_XDEV;

/// What kind of entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// A regular file.
    File,
    /// A directory.
    Directory,
    /// A symbolic link (not followed).
    Symlink,
    /// Anything else (fifo, socket, device node).
    Unknown,
}

/// A timestamp: seconds and nanoseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timestamp {
    /// Seconds.
    pub secs: i64,
    /// Nanoseconds.
    pub nanos: u32,
}

/// One entry of a volume, as the content API describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeEntry {
    /// Last path component (`/` for the root).
    pub name: String,
    /// Kind.
    pub kind: EntryKind,
    /// Absolute path inside the volume (`/a/b`).
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits (`0o7777` at most).
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Access time.
    pub atime: Timestamp,
    /// Modification time.
    pub mtime: Timestamp,
    /// Change time.
    pub ctime: Timestamp,
    /// Where a symlink points.
    pub target: Option<String>,
}

/// Owner and mode asked for a new or changed entry (`None`: keep / default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Attrs {
    /// Owner.
    pub uid: Option<u32>,
    /// Group.
    pub gid: Option<u32>,
    /// Permission bits.
    pub mode: Option<u32>,
}

/// A volume's tree, opened at its root.
pub struct VolumeFs {
    root: OwnedFd,
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg.into())
}

fn cstr(b: &[u8]) -> io::Result<CString> {
    CString::new(b).map_err(|_| invalid("the path contains a NUL byte"))
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// The components of a volume path (`/a/b`, `a/b`, `/`): no `..`, `.` dropped, no NUL.
fn components(path: &str) -> io::Result<Vec<&str>> {
    if path.is_empty() {
        return Err(invalid("the path is empty"));
    }
    if path.contains('\0') {
        return Err(invalid("the path contains a NUL byte"));
    }
    let mut out = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => return Err(invalid(format!("the path {path:?} contains '..'"))),
            c if c.len() > 255 => return Err(invalid("a path component is longer than 255 bytes")),
            c => out.push(c),
        }
    }
    Ok(out)
}

fn join(parts: &[&str]) -> String {
    format!("/{}", parts.join("/"))
}

fn check_ids(a: &Attrs) -> io::Result<()> {
    for (what, id) in [("uid", a.uid), ("gid", a.gid)] {
        if id.is_some_and(|i| i > MAX_VOLUME_ID) {
            return Err(invalid(format!(
                "{what} must be between 0 and {MAX_VOLUME_ID} (the ids sandboxes have)"
            )));
        }
    }
    if a.mode.is_some_and(|m| m > 0o7777) {
        return Err(invalid("mode must be permission bits (at most 0o7777)"));
    }
    Ok(())
}

fn lstat_at(dir: RawFd, name: &CString) -> io::Result<libc::stat> {
    // SAFETY: zeroed stat is a valid out buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd, NUL-terminated name, valid out pointer.
    check(unsafe { libc::fstatat(dir, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) })?;
    Ok(st)
}

fn fstat(fd: RawFd) -> io::Result<libc::stat> {
    // SAFETY: zeroed stat is a valid out buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and out pointer.
    check(unsafe { libc::fstat(fd, &mut st) })?;
    Ok(st)
}

fn kind_of(mode: u32) -> EntryKind {
    match mode & libc::S_IFMT {
        libc::S_IFREG => EntryKind::File,
        libc::S_IFDIR => EntryKind::Directory,
        libc::S_IFLNK => EntryKind::Symlink,
        _ => EntryKind::Unknown,
    }
}

fn readlink_at(dir: RawFd, name: &CString) -> Option<String> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: valid fd, name and buffer of the given length.
    let n = unsafe { libc::readlinkat(dir, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (n >= 0).then(|| {
        buf.truncate(n as usize);
        String::from_utf8_lossy(&buf).into_owned()
    })
}

fn entry(name: &str, path: String, st: &libc::stat, target: Option<String>) -> VolumeEntry {
    let ts = |secs: i64, nanos: i64| Timestamp {
        secs,
        nanos: nanos.clamp(0, 999_999_999) as u32,
    };
    VolumeEntry {
        name: name.to_string(),
        kind: kind_of(st.st_mode),
        path,
        size: st.st_size.max(0) as u64,
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
        atime: ts(st.st_atime, st.st_atime_nsec),
        mtime: ts(st.st_mtime, st.st_mtime_nsec),
        ctime: ts(st.st_ctime, st.st_ctime_nsec),
        target,
    }
}

/// The names in the directory `dir` (without `.` and `..`).
fn names_in(dir: RawFd) -> io::Result<Vec<CString>> {
    // A fresh descriptor of the same directory: reading through /proc/self/fd reopens
    // exactly that inode, whatever happens to paths meanwhile.
    let rd = std::fs::read_dir(format!("/proc/self/fd/{dir}"))?;
    let mut out = Vec::new();
    for e in rd {
        out.push(cstr(e?.file_name().as_bytes())?);
    }
    Ok(out)
}

impl VolumeFs {
    /// Opens the volume whose root directory is `dir` (a trusted host path).
    pub fn open(dir: &Path) -> io::Result<VolumeFs> {
        let c = sys::cpath(dir)?;
        let root = sys::openat2(
            libc::AT_FDCWD,
            &c,
            libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW,
            0,
            0,
        )?;
        Ok(VolumeFs { root })
    }

    /// `openat2` of `parts` below the root (following symlinks inside the volume).
    fn open_at(&self, parts: &[&str], flags: libc::c_int, mode: u32) -> io::Result<OwnedFd> {
        let rel = if parts.is_empty() {
            ".".to_string()
        } else {
            parts.join("/")
        };
        sys::openat2(
            self.root.as_raw_fd(),
            &cstr(rel.as_bytes())?,
            flags,
            mode,
            RESOLVE,
        )
    }

    /// The parent directory of `parts` (which must not be the root) and the last name.
    fn parent<'a>(&self, parts: &[&'a str]) -> io::Result<(OwnedFd, &'a str, CString)> {
        let (last, dir) = parts
            .split_last()
            .ok_or_else(|| invalid("this operation needs a path below the volume's root"))?;
        let fd = self.open_at(dir, libc::O_PATH | libc::O_DIRECTORY, 0)?;
        Ok((fd, last, cstr(last.as_bytes())?))
    }

    /// The entry at `path` (a symlink itself, not its target).
    pub fn stat(&self, path: &str) -> io::Result<VolumeEntry> {
        let parts = components(path)?;
        if parts.is_empty() {
            let st = fstat(self.root.as_raw_fd())?;
            return Ok(entry("/", "/".into(), &st, None));
        }
        let (dir, last, c) = self.parent(&parts)?;
        let st = lstat_at(dir.as_raw_fd(), &c)?;
        let target = (kind_of(st.st_mode) == EntryKind::Symlink)
            .then(|| readlink_at(dir.as_raw_fd(), &c))
            .flatten();
        Ok(entry(last, join(&parts), &st, target))
    }

    /// The entries below the directory `path`, `depth` levels deep (1: its children).
    /// Symlinks to directories are listed, not entered.
    pub fn list(&self, path: &str, depth: u32) -> io::Result<Vec<VolumeEntry>> {
        let parts = components(path)?;
        let dir = self.open_at(&parts, libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        let base = if parts.is_empty() {
            String::new()
        } else {
            join(&parts)
        };
        let mut out = Vec::new();
        let mut todo: Vec<(OwnedFd, String, u32)> = vec![(dir, base, 1)];
        while let Some((dir, prefix, level)) = todo.pop() {
            let mut names = names_in(dir.as_raw_fd())?;
            names.sort();
            for c in names {
                let st = match lstat_at(dir.as_raw_fd(), &c) {
                    Ok(st) => st,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(e),
                };
                let name = String::from_utf8_lossy(c.as_bytes()).into_owned();
                let path = format!("{prefix}/{name}");
                let kind = kind_of(st.st_mode);
                let target = (kind == EntryKind::Symlink)
                    .then(|| readlink_at(dir.as_raw_fd(), &c))
                    .flatten();
                if out.len() >= MAX_LIST_ENTRIES {
                    return Err(invalid(format!(
                        "the listing has more than {MAX_LIST_ENTRIES} entries; list a smaller depth or a subdirectory"
                    )));
                }
                out.push(entry(&name, path.clone(), &st, target));
                if kind == EntryKind::Directory && level < depth {
                    let sub = sys::openat2(
                        dir.as_raw_fd(),
                        &c,
                        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                        0,
                        sys::RESOLVE_BENEATH | sys::RESOLVE_NO_SYMLINKS | sys::RESOLVE_NO_XDEV,
                    );
                    match sub {
                        Ok(fd) => todo.push((fd, path, level + 1)),
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        Ok(out)
    }

    /// Creates the directory `path`. `force`: create missing parents too and accept an
    /// existing directory; otherwise a missing parent is `NotFound` and an existing
    /// entry `AlreadyExists`.
    pub fn make_dir(&self, path: &str, attrs: Attrs, force: bool) -> io::Result<VolumeEntry> {
        check_ids(&attrs)?;
        let parts = components(path)?;
        if parts.is_empty() {
            return if force {
                self.stat("/")
            } else {
                Err(io::Error::from(io::ErrorKind::AlreadyExists))
            };
        }
        if force {
            for i in 1..parts.len() {
                self.mkdir_one(&parts[..i], attrs, true)?;
            }
        }
        self.mkdir_one(&parts, attrs, force)?;
        self.stat(path)
    }

    /// `mkdir parts` with `attrs` (owner defaulting to the parent's); `exist_ok`: an
    /// existing directory is fine.
    fn mkdir_one(&self, parts: &[&str], attrs: Attrs, exist_ok: bool) -> io::Result<()> {
        let (dir, _, c) = self.parent(parts)?;
        let mode = attrs.mode.unwrap_or(0o755);
        // SAFETY: valid fd and name.
        if let Err(e) = check(unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), mode) }) {
            if e.kind() == io::ErrorKind::AlreadyExists && exist_ok {
                // A directory, or a symlink to one inside the volume.
                return self
                    .open_at(parts, libc::O_PATH | libc::O_DIRECTORY, 0)
                    .map(drop)
                    .map_err(|_| {
                        invalid(format!("{} exists and is not a directory", join(parts)))
                    });
            }
            return Err(e);
        }
        let new = sys::openat2(
            dir.as_raw_fd(),
            &c,
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
            0,
            sys::RESOLVE_BENEATH | sys::RESOLVE_NO_SYMLINKS | sys::RESOLVE_NO_XDEV,
        )?;
        self.set_owner_mode(new.as_raw_fd(), dir.as_raw_fd(), attrs, Some(mode))
    }

    /// fchown/fchmod of a new entry `fd`: the given owner, else `parent`'s.
    fn set_owner_mode(
        &self,
        fd: RawFd,
        parent: RawFd,
        attrs: Attrs,
        mode: Option<u32>,
    ) -> io::Result<()> {
        let pst = fstat(parent)?;
        let uid = attrs.uid.unwrap_or(pst.st_uid);
        let gid = attrs.gid.unwrap_or(pst.st_gid);
        // SAFETY: valid fd.
        check(unsafe { libc::fchown(fd, uid, gid) })?;
        if let Some(m) = mode {
            // SAFETY: valid fd (the umask may have cleared bits at creation).
            check(unsafe { libc::fchmod(fd, m) })?;
        }
        Ok(())
    }

    /// Opens the regular file `path` for reading (symlinks inside the volume followed).
    pub fn open_read(&self, path: &str) -> io::Result<File> {
        let parts = components(path)?;
        // O_NONBLOCK: a fifo a tenant left must not block the server.
        let fd = self.open_at(&parts, libc::O_RDONLY | libc::O_NONBLOCK, 0)?;
        regular_blocking(fd, path)
    }

    /// Opens `path` for writing, creating it (owner: `attrs`, else the parent's; mode:
    /// `attrs`, else 0644) or truncating it. `force`: create missing parent directories
    /// (with the same owner). Returns the file and the path the entry can be found at.
    pub fn open_write(&self, path: &str, attrs: Attrs, force: bool) -> io::Result<File> {
        check_ids(&attrs)?;
        let parts = components(path)?;
        if parts.is_empty() {
            return Err(invalid("the volume's root is a directory"));
        }
        if force {
            let dir_attrs = Attrs {
                mode: None,
                ..attrs
            };
            for i in 1..parts.len() {
                self.mkdir_one(&parts[..i], dir_attrs, true)?;
            }
        }
        let (dir, _, _) = self.parent(&parts)?;
        let mode = attrs.mode.unwrap_or(0o644);
        match self.open_at(&parts, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL, mode) {
            Ok(fd) => {
                self.set_owner_mode(fd.as_raw_fd(), dir.as_raw_fd(), attrs, Some(mode))?;
                Ok(File::from(fd))
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let fd =
                    self.open_at(&parts, libc::O_WRONLY | libc::O_TRUNC | libc::O_NONBLOCK, 0)?;
                let st = fstat(fd.as_raw_fd())?;
                let file = regular_blocking(fd, path)?;
                if attrs != Attrs::default() {
                    self.change(file.as_raw_fd(), &st, attrs)?;
                }
                Ok(file)
            }
            Err(e) => Err(e),
        }
    }

    /// fchown/fchmod of an existing entry to what `attrs` names.
    fn change(&self, fd: RawFd, st: &libc::stat, attrs: Attrs) -> io::Result<()> {
        if attrs.uid.is_some() || attrs.gid.is_some() {
            let uid = attrs.uid.unwrap_or(st.st_uid);
            let gid = attrs.gid.unwrap_or(st.st_gid);
            // SAFETY: valid fd.
            check(unsafe { libc::fchown(fd, uid, gid) })?;
        }
        if let Some(m) = attrs.mode {
            // SAFETY: valid fd.
            check(unsafe { libc::fchmod(fd, m) })?;
        }
        Ok(())
    }

    /// Changes the owner and/or mode of the entry at `path` (a symlink's own owner; a
    /// symlink has no mode of its own).
    pub fn set_attrs(&self, path: &str, attrs: Attrs) -> io::Result<VolumeEntry> {
        check_ids(&attrs)?;
        let parts = components(path)?;
        if parts.is_empty() {
            let fd = self.open_at(&[], libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
            let st = fstat(fd.as_raw_fd())?;
            self.change(fd.as_raw_fd(), &st, attrs)?;
            return self.stat(path);
        }
        let (dir, _, c) = self.parent(&parts)?;
        let st = lstat_at(dir.as_raw_fd(), &c)?;
        if kind_of(st.st_mode) == EntryKind::Symlink {
            if attrs.mode.is_some() {
                return Err(invalid(format!(
                    "{path} is a symlink: it has no mode of its own"
                )));
            }
            let uid = attrs.uid.unwrap_or(st.st_uid);
            let gid = attrs.gid.unwrap_or(st.st_gid);
            // SAFETY: valid fd and name.
            check(unsafe {
                libc::fchownat(
                    dir.as_raw_fd(),
                    c.as_ptr(),
                    uid,
                    gid,
                    libc::AT_SYMLINK_NOFOLLOW,
                )
            })?;
        } else {
            // O_PATH descriptors cannot be fchmod'ed: open the entry itself (never
            // following a symlink swapped in meanwhile).
            let flags = if kind_of(st.st_mode) == EntryKind::Directory {
                libc::O_RDONLY | libc::O_DIRECTORY
            } else {
                libc::O_PATH
            };
            let fd = sys::openat2(
                dir.as_raw_fd(),
                &c,
                flags | libc::O_NOFOLLOW,
                0,
                sys::RESOLVE_BENEATH | sys::RESOLVE_NO_SYMLINKS | sys::RESOLVE_NO_XDEV,
            )?;
            if flags == libc::O_PATH {
                // fchownat/fchmodat through the O_PATH descriptor (AT_EMPTY_PATH), or
                // /proc/self/fd for the mode (fchmodat has no AT_EMPTY_PATH before 6.6).
                let uid = attrs.uid.unwrap_or(st.st_uid);
                let gid = attrs.gid.unwrap_or(st.st_gid);
                if attrs.uid.is_some() || attrs.gid.is_some() {
                    // SAFETY: valid fd and empty path.
                    check(unsafe {
                        libc::fchownat(fd.as_raw_fd(), c"".as_ptr(), uid, gid, libc::AT_EMPTY_PATH)
                    })?;
                }
                if let Some(m) = attrs.mode {
                    let p = cstr(format!("/proc/self/fd/{}", fd.as_raw_fd()).as_bytes())?;
                    // SAFETY: valid path.
                    check(unsafe { libc::chmod(p.as_ptr(), m) })?;
                }
            } else {
                self.change(fd.as_raw_fd(), &st, attrs)?;
            }
        }
        self.stat(path)
    }

    /// Removes the entry at `path`: a file or symlink, or a directory with everything
    /// below it. The volume's root cannot be removed.
    pub fn remove(&self, path: &str) -> io::Result<()> {
        let parts = components(path)?;
        if parts.is_empty() {
            return Err(invalid("the volume's root cannot be removed"));
        }
        let (dir, _, c) = self.parent(&parts)?;
        let st = lstat_at(dir.as_raw_fd(), &c)?;
        if kind_of(st.st_mode) == EntryKind::Directory {
            remove_tree_at(dir.as_raw_fd(), &c)
        } else {
            // SAFETY: valid fd and name.
            check(unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), 0) })
        }
    }
}

/// `fd` as a blocking [`File`] if it is a regular file (opened `O_NONBLOCK`, so that a
/// fifo or device cannot block the open itself).
fn regular_blocking(fd: OwnedFd, path: &str) -> io::Result<File> {
    let st = fstat(fd.as_raw_fd())?;
    if kind_of(st.st_mode) != EntryKind::File {
        return Err(invalid(format!("{path} is not a regular file")));
    }
    // SAFETY: valid fd; F_GETFL/F_SETFL take integer arguments.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags >= 0 {
        // SAFETY: as above.
        unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) };
    }
    Ok(File::from(fd))
}

/// Removes the directory `name` in `parent` with its contents, iteratively (one open
/// directory per level), never following symlinks or leaving the filesystem.
fn remove_tree_at(parent: RawFd, name: &CString) -> io::Result<()> {
    let open = |dir: RawFd, n: &CString| {
        sys::openat2(
            dir,
            n,
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
            0,
            sys::RESOLVE_BENEATH | sys::RESOLVE_NO_SYMLINKS | sys::RESOLVE_NO_XDEV,
        )
    };
    // (directory, its name in the directory below it on the stack)
    let mut stack: Vec<(OwnedFd, CString)> = vec![(open(parent, name)?, name.clone())];
    while let Some((dir, _)) = stack.last() {
        let dfd = dir.as_raw_fd();
        let mut descend = None;
        for n in names_in(dfd)? {
            // SAFETY: valid fd and name.
            let rc = unsafe { libc::unlinkat(dfd, n.as_ptr(), 0) };
            if rc == 0 {
                continue;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EISDIR) | Some(libc::EPERM) if is_dir_at(dfd, &n) => {
                    // SAFETY: valid fd and name.
                    if unsafe { libc::unlinkat(dfd, n.as_ptr(), libc::AT_REMOVEDIR) } == 0 {
                        continue;
                    }
                    descend = Some(n);
                    break;
                }
                Some(libc::ENOENT) => {}
                _ => return Err(e),
            }
        }
        match descend {
            Some(n) => {
                if stack.len() >= MAX_DEPTH {
                    return Err(invalid(format!(
                        "the tree is deeper than {MAX_DEPTH} levels"
                    )));
                }
                let fd = open(dfd, &n)?;
                stack.push((fd, n));
            }
            None => {
                let (done, n) = stack.pop().unwrap_or_else(|| unreachable!());
                drop(done);
                let up = stack.last().map_or(parent, |(d, _)| d.as_raw_fd());
                // SAFETY: valid fd and name.
                check(unsafe { libc::unlinkat(up, n.as_ptr(), libc::AT_REMOVEDIR) })?;
            }
        }
    }
    Ok(())
}

fn is_dir_at(dir: RawFd, name: &CString) -> bool {
    lstat_at(dir, name).is_ok_and(|st| kind_of(st.st_mode) == EntryKind::Directory)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn tmp(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("cubicle-volfs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn paths_are_checked() {
        assert_eq!(components("/").unwrap(), Vec::<&str>::new());
        assert_eq!(components("/a//b/./c").unwrap(), vec!["a", "b", "c"]);
        assert_eq!(components("a/b").unwrap(), vec!["a", "b"]);
        for bad in ["", "/a/../b", "..", "a\0b"] {
            assert!(components(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn files_dirs_and_listing() {
        let d = tmp("ops");
        let v = VolumeFs::open(&d).unwrap();
        let e = v.make_dir("/a/b", Attrs::default(), true).unwrap();
        assert_eq!(
            (e.kind, e.path.as_str(), e.name.as_str()),
            (EntryKind::Directory, "/a/b", "b")
        );
        assert!(v.make_dir("/a/b", Attrs::default(), false).is_err());
        assert_eq!(
            v.make_dir("/x/y", Attrs::default(), false)
                .unwrap_err()
                .kind(),
            io::ErrorKind::NotFound
        );
        let mut f = v
            .open_write(
                "/a/b/f.txt",
                Attrs {
                    mode: Some(0o600),
                    ..Default::default()
                },
                false,
            )
            .unwrap();
        f.write_all(b"hello").unwrap();
        drop(f);
        let e = v.stat("/a/b/f.txt").unwrap();
        assert_eq!((e.kind, e.size, e.mode), (EntryKind::File, 5, 0o600));
        let mut s = String::new();
        v.open_read("a/b/f.txt")
            .unwrap()
            .read_to_string(&mut s)
            .unwrap();
        assert_eq!(s, "hello");
        // overwrite keeps the mode, truncates
        let mut f = v.open_write("/a/b/f.txt", Attrs::default(), false).unwrap();
        f.write_all(b"hi").unwrap();
        drop(f);
        let e = v.stat("/a/b/f.txt").unwrap();
        assert_eq!((e.size, e.mode), (2, 0o600));
        // force makes parents
        assert!(v.open_write("/p/q/r", Attrs::default(), false).is_err());
        v.open_write("/p/q/r", Attrs::default(), true).unwrap();
        let names: Vec<String> = v
            .list("/", 1)
            .unwrap()
            .into_iter()
            .map(|e| e.path)
            .collect();
        assert_eq!(names, vec!["/a", "/p"]);
        let deep: Vec<String> = v
            .list("/", 3)
            .unwrap()
            .into_iter()
            .map(|e| e.path)
            .collect();
        for p in ["/a", "/a/b", "/a/b/f.txt", "/p", "/p/q", "/p/q/r"] {
            assert!(deep.contains(&p.to_string()), "{p} in {deep:?}");
        }
        let e = v
            .set_attrs(
                "/a/b/f.txt",
                Attrs {
                    mode: Some(0o640),
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(e.mode, 0o640);
        v.remove("/a").unwrap();
        assert_eq!(v.stat("/a").unwrap_err().kind(), io::ErrorKind::NotFound);
        assert!(v.remove("/").is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// What a tenant plants in a volume cannot make the host act outside it.
    #[test]
    fn symlinks_stay_inside_the_volume() {
        let d = tmp("links");
        let outside = tmp("outside");
        std::fs::write(outside.join("secret"), "host data").unwrap();
        std::os::unix::fs::symlink(outside.join("secret"), d.join("abs")).unwrap();
        std::os::unix::fs::symlink("../../../../../..", d.join("up")).unwrap();
        std::os::unix::fs::symlink(&outside, d.join("dir")).unwrap();
        std::os::unix::fs::symlink("/proc/self/root/etc", d.join("magic")).unwrap();
        let v = VolumeFs::open(&d).unwrap();
        // Absolute targets resolve inside the volume, where they do not exist.
        assert!(v.open_read("/abs").is_err());
        assert!(v.open_read("/dir/secret").is_err());
        assert!(v.list("/up/etc", 1).is_err());
        assert!(v.open_read("/magic/passwd").is_err());
        // Writing through a link creates the file inside the volume, never outside.
        let _ = v.open_write("/dir/secret", Attrs::default(), false);
        let _ = v.open_write("/abs", Attrs::default(), false);
        assert_eq!(
            std::fs::read_to_string(outside.join("secret")).unwrap(),
            "host data"
        );
        // Removing a link to a directory removes the link only.
        v.remove("/dir").unwrap();
        assert!(outside.join("secret").exists());
        // stat reports the link itself.
        let e = v.stat("/abs").unwrap();
        assert_eq!(e.kind, EntryKind::Symlink);
        assert_eq!(
            e.target.as_deref(),
            Some(outside.join("secret").to_str().unwrap())
        );
        // metadata changes of a link never reach its target
        let before = std::fs::metadata(outside.join("secret")).unwrap();
        let _ = v.set_attrs(
            "/abs",
            Attrs {
                uid: Some(1234),
                ..Default::default()
            },
        );
        let after = std::fs::metadata(outside.join("secret")).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!(before.uid(), after.uid());
        std::fs::remove_dir_all(&d).unwrap();
        std::fs::remove_dir_all(&outside).unwrap();
    }

    #[test]
    fn ids_out_of_range_are_refused() {
        let d = tmp("ids");
        let v = VolumeFs::open(&d).unwrap();
        let bad = Attrs {
            uid: Some(70_000),
            ..Default::default()
        };
        assert!(v.make_dir("/x", bad, false).is_err());
        assert!(v.open_write("/f", bad, false).is_err());
        assert!(
            v.open_write(
                "/f",
                Attrs {
                    mode: Some(0o17777),
                    ..Default::default()
                },
                false
            )
            .is_err()
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
}
