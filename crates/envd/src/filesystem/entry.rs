//! `EntryInfo`: how envd describes one filesystem object, and the metadata (xattr)
//! reader. Shared with the `/files` HTTP endpoints.
//!
//! Field semantics (matching upstream envd, which the SDKs were written against):
//!
//! * `name`: the last component of the *reported* path (`/` for the root).
//! * `path`: the reported path — the path as the client asked for it (absolute, `~` and
//!   relative paths already resolved), not the symlink-resolved one.
//! * `type`: `FILE_TYPE_FILE` / `FILE_TYPE_DIRECTORY`. For a symlink it is the type of
//!   its (fully resolved) target and `isSymlink` is set — newer envd behaviour; the Python
//!   SDK then shows `SYMLINK`, the JS SDK the target type. A dangling or looping symlink
//!   has no target type, so it is reported as `FILE_TYPE_SYMLINK` (+ `isSymlink`), which
//!   both SDKs display as a symlink. Other objects (devices, fifos, sockets) are
//!   `FILE_TYPE_UNSPECIFIED`, which the SDKs skip in `files.list`.
//! * `size`: `st_size` of the object itself (`lstat`; for a symlink the target length).
//! * `mode`: permission bits only (`st_mode & 0o777`, Go's `FileMode.Perm()`), of the
//!   target for a resolvable symlink. The SDK shows it as a number next to
//!   `permissions`.
//! * `permissions`: Go's `fs.FileMode.String()` of the object itself, e.g. `-rw-r--r--`,
//!   `drwxr-xr-x`, `Lrwxrwxrwx` (symlink), `dtrwxrwxrwx` (sticky dir such as `/tmp`),
//!   `Dcrw-rw-rw-` (character device) — exactly what upstream envd reports.
//! * `owner`/`group`: names from the sandbox's `/etc/passwd`/`/etc/group`, the numeric
//!   id as text when unknown.
//! * `modifiedTime`: `st_mtime` (of the object itself).
//! * `symlinkTarget`: only for symlinks: the canonical absolute path of the final
//!   target, or — when it cannot be resolved (dangling, loop) — the raw link text.
//! * `metadata`: extended attributes `user.e2b.<key>`, prefix stripped (see
//!   [`read_metadata`]).

use std::{
    collections::HashMap,
    ffi::CString,
    io,
    os::unix::{ffi::OsStrExt, fs::MetadataExt},
    path::Path,
};

use cubicle_proto::{
    Timestamp,
    filesystem::{EntryInfo, FileType},
};

use crate::users;

/// Prefix of the extended attributes that carry user metadata.
pub const METADATA_XATTR_PREFIX: &str = "user.e2b.";

/// Largest attribute list / value we read (the kernel's own limit is 64 KiB).
const XATTR_MAX: usize = 64 * 1024;

/// Describes the object at `path` (not following a final symlink), reporting it under
/// `reported` (the path as the client named it; used for `name` and `path`).
///
/// Fails only when the object itself cannot be `lstat`ed (missing: `ErrorKind::NotFound`,
/// a parent that is not a directory: `NotADirectory`, …).
pub fn entry_info(path: &Path, reported: &Path) -> io::Result<EntryInfo> {
    EntryBuilder::default().build(path, reported)
}

/// User metadata of the object at `path`: every extended attribute `user.e2b.<key>`
/// as `<key> → value` (values decoded as UTF-8, lossily). Follows symlinks. Returns an
/// empty map when there are none or the filesystem has no xattr support; never fails.
pub fn read_metadata(path: &Path) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let Ok(cpath) = CString::new(path.as_os_str().as_bytes()) else {
        return out;
    };
    let Some(names) = xattr_list(&cpath) else {
        return out;
    };
    for raw in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let Ok(name) = std::str::from_utf8(raw) else {
            continue;
        };
        let Some(key) = name.strip_prefix(METADATA_XATTR_PREFIX) else {
            continue;
        };
        if key.is_empty() {
            continue;
        }
        let Ok(cname) = CString::new(raw) else {
            continue;
        };
        if let Some(value) = xattr_get(&cpath, &cname) {
            out.insert(
                key.to_string(),
                String::from_utf8_lossy(&value).into_owned(),
            );
        }
    }
    out
}

/// `listxattr(2)` with a growing buffer; `None` on any error.
fn xattr_list(path: &CString) -> Option<Vec<u8>> {
    // SAFETY: a null buffer with size 0 asks for the needed size.
    let size = unsafe { libc::listxattr(path.as_ptr(), std::ptr::null_mut(), 0) };
    if size <= 0 {
        return None;
    }
    let mut buf = vec![0u8; (size as usize).min(XATTR_MAX)];
    // SAFETY: buf is valid for buf.len() bytes.
    let got = unsafe { libc::listxattr(path.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if got < 0 {
        return None;
    }
    buf.truncate(got as usize);
    Some(buf)
}

/// `getxattr(2)`; `None` on any error.
fn xattr_get(path: &CString, name: &CString) -> Option<Vec<u8>> {
    // SAFETY: a null buffer with size 0 asks for the needed size.
    let size = unsafe { libc::getxattr(path.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) };
    if size < 0 {
        return None;
    }
    let mut buf = vec![0u8; (size as usize).min(XATTR_MAX)];
    if buf.is_empty() {
        return Some(buf);
    }
    // SAFETY: buf is valid for buf.len() bytes.
    let got = unsafe {
        libc::getxattr(
            path.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if got < 0 {
        return None;
    }
    buf.truncate(got as usize);
    Some(buf)
}

/// Builds many entries, caching uid/gid → name look-ups (each one otherwise re-reads
/// `/etc/passwd` or `/etc/group`).
#[derive(Default)]
pub(crate) struct EntryBuilder {
    users: HashMap<u32, String>,
    groups: HashMap<u32, String>,
}

impl EntryBuilder {
    pub(crate) fn build(&mut self, path: &Path, reported: &Path) -> io::Result<EntryInfo> {
        let meta = std::fs::symlink_metadata(path)?;
        let ft = meta.file_type();
        let mut entry = EntryInfo {
            name: display_name(reported),
            path: reported.to_string_lossy().into_owned(),
            size: meta.size() as i64,
            permissions: go_mode_string(meta.mode()),
            owner: self.user(meta.uid()),
            group: self.group(meta.gid()),
            modified_time: Some(Timestamp {
                seconds: meta.mtime(),
                nanos: meta.mtime_nsec() as i32,
            }),
            ..Default::default()
        };
        if ft.is_symlink() {
            entry.is_symlink = true;
            match std::fs::canonicalize(path).and_then(|t| std::fs::metadata(&t).map(|m| (t, m))) {
                Ok((target, tmeta)) => {
                    entry.r#type = file_type(&tmeta.file_type()) as i32;
                    entry.mode = tmeta.mode() & 0o777;
                    entry.symlink_target = Some(target.to_string_lossy().into_owned());
                }
                Err(_) => {
                    entry.r#type = FileType::Symlink as i32;
                    entry.mode = meta.mode() & 0o777;
                    entry.symlink_target = Some(
                        std::fs::read_link(path)
                            .map(|t| t.to_string_lossy().into_owned())
                            .unwrap_or_else(|_| entry.path.clone()),
                    );
                }
            }
        } else {
            entry.r#type = file_type(&ft) as i32;
            entry.mode = meta.mode() & 0o777;
        }
        entry.metadata = read_metadata(path);
        Ok(entry)
    }

    fn user(&mut self, uid: u32) -> String {
        self.users
            .entry(uid)
            .or_insert_with(|| users::user_name(uid))
            .clone()
    }

    fn group(&mut self, gid: u32) -> String {
        self.groups
            .entry(gid)
            .or_insert_with(|| users::group_name(gid))
            .clone()
    }
}

/// The wire type of a (non-symlink) object.
fn file_type(ft: &std::fs::FileType) -> FileType {
    if ft.is_file() {
        FileType::File
    } else if ft.is_dir() {
        FileType::Directory
    } else {
        FileType::Unspecified
    }
}

/// The last component of `p`, or `/` for the root.
fn display_name(p: &Path) -> String {
    match p.file_name() {
        Some(n) => n.to_string_lossy().into_owned(),
        None => "/".to_string(),
    }
}

/// Go's `fs.FileMode.String()` for a Unix `st_mode`: type/special letters from
/// `dalTLDpSugct?` (or `-` when none), then `rwxrwxrwx`.
pub fn go_mode_string(st_mode: u32) -> String {
    let fmt = st_mode & libc::S_IFMT;
    let mut letters = String::new();
    // Go's order: d a l T L D p S u g c t ?
    if fmt == libc::S_IFDIR {
        letters.push('d');
    }
    if fmt == libc::S_IFLNK {
        letters.push('L');
    }
    if fmt == libc::S_IFBLK || fmt == libc::S_IFCHR {
        letters.push('D');
    }
    if fmt == libc::S_IFIFO {
        letters.push('p');
    }
    if fmt == libc::S_IFSOCK {
        letters.push('S');
    }
    if st_mode & libc::S_ISUID != 0 {
        letters.push('u');
    }
    if st_mode & libc::S_ISGID != 0 {
        letters.push('g');
    }
    if fmt == libc::S_IFCHR {
        letters.push('c');
    }
    if st_mode & libc::S_ISVTX != 0 {
        letters.push('t');
    }
    if letters.is_empty() {
        letters.push('-');
    }
    const RWX: &[u8; 9] = b"rwxrwxrwx";
    for (i, c) in RWX.iter().enumerate() {
        let bit = 1 << (8 - i);
        letters.push(if st_mode & bit != 0 { *c as char } else { '-' });
    }
    letters
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{PermissionsExt, symlink};

    fn tmp() -> super::super::test_util::TempDir {
        super::super::test_util::TempDir::new("entry")
    }

    #[test]
    fn mode_strings_match_go() {
        assert_eq!(go_mode_string(libc::S_IFREG | 0o644), "-rw-r--r--");
        assert_eq!(go_mode_string(libc::S_IFDIR | 0o755), "drwxr-xr-x");
        assert_eq!(go_mode_string(libc::S_IFLNK | 0o777), "Lrwxrwxrwx");
        assert_eq!(
            go_mode_string(libc::S_IFDIR | libc::S_ISVTX | 0o777),
            "dtrwxrwxrwx"
        );
        assert_eq!(go_mode_string(libc::S_IFCHR | 0o666), "Dcrw-rw-rw-");
        assert_eq!(
            go_mode_string(libc::S_IFREG | libc::S_ISUID | 0o755),
            "urwxr-xr-x"
        );
        assert_eq!(go_mode_string(libc::S_IFREG), "----------");
    }

    #[test]
    fn describes_files_dirs_and_symlinks() {
        let d = tmp();
        let f = d.join("f.txt");
        std::fs::write(&f, b"hello").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = entry_info(&f, &f).unwrap();
        assert_eq!(e.name, "f.txt");
        assert_eq!(e.r#type, FileType::File as i32);
        assert_eq!(e.size, 5);
        assert_eq!(e.mode, 0o640);
        assert_eq!(e.permissions, "-rw-r-----");
        assert!(!e.is_symlink);
        assert!(e.symlink_target.is_none());
        assert!(e.modified_time.is_some());

        let sub = d.join("sub");
        std::fs::create_dir(&sub).unwrap();
        let link = d.join("link");
        symlink(&sub, &link).unwrap();
        let reported = Path::new("/reported/link");
        let e = entry_info(&link, reported).unwrap();
        assert_eq!(e.name, "link");
        assert_eq!(e.path, "/reported/link");
        assert_eq!(e.r#type, FileType::Directory as i32);
        assert!(e.is_symlink);
        assert!(e.permissions.starts_with('L'));
        let canon = std::fs::canonicalize(&sub).unwrap();
        assert_eq!(e.symlink_target.as_deref(), Some(canon.to_str().unwrap()));

        let dangling = d.join("dangling");
        symlink("nowhere", &dangling).unwrap();
        let e = entry_info(&dangling, &dangling).unwrap();
        assert_eq!(e.r#type, FileType::Symlink as i32);
        assert_eq!(e.symlink_target.as_deref(), Some("nowhere"));

        let looped = d.join("loop");
        symlink(&looped, &looped).unwrap();
        let e = entry_info(&looped, &looped).unwrap();
        assert_eq!(e.r#type, FileType::Symlink as i32);
        assert!(e.is_symlink);

        let err = entry_info(&d.join("missing"), Path::new("/x")).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        assert_eq!(
            entry_info(Path::new("/"), Path::new("/")).unwrap().name,
            "/"
        );
    }

    #[test]
    fn reads_e2b_xattrs_only() {
        let d = tmp();
        let f = d.join("m");
        std::fs::write(&f, b"").unwrap();
        let cpath = CString::new(f.as_os_str().as_bytes()).unwrap();
        let set = |name: &str, value: &[u8]| {
            let n = CString::new(name).unwrap();
            // SAFETY: valid pointers and lengths.
            unsafe {
                libc::setxattr(
                    cpath.as_ptr(),
                    n.as_ptr(),
                    value.as_ptr().cast(),
                    value.len(),
                    0,
                )
            }
        };
        if set("user.e2b.owner", b"alice") != 0 {
            eprintln!("skipping: the temp filesystem does not support user xattrs");
            return;
        }
        assert_eq!(set("user.other", b"x"), 0);
        assert_eq!(set("user.e2b.empty", b""), 0);
        let m = read_metadata(&f);
        assert_eq!(m.get("owner").map(String::as_str), Some("alice"));
        assert_eq!(m.get("empty").map(String::as_str), Some(""));
        assert!(!m.contains_key("other"));
        assert_eq!(m.len(), 2);
        assert_eq!(entry_info(&f, &f).unwrap().metadata, m);
        assert!(read_metadata(&d.join("missing")).is_empty());
    }
}
