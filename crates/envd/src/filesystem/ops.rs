//! The unary filesystem operations (Stat, MakeDir, Move, ListDir, Remove) on resolved
//! absolute paths. Blocking: callers run them on the blocking thread pool.
//!
//! envd acts with its own (root) privileges on behalf of the acting user, like upstream;
//! what it creates (directories, moved-to parents) is handed to that user.

use std::{
    collections::HashSet,
    io,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use cubicle_proto::filesystem::EntryInfo;

use super::entry::EntryBuilder;
use crate::{
    connect::{Code, ConnectError},
    paths,
    users::User,
};

/// Most entries one ListDir answer may hold (a depth-N listing of `/` would otherwise
/// walk the whole machine into memory).
pub const MAX_LIST_ENTRIES: usize = 100_000;

/// Maps an I/O error on `what` to the Connect error the SDKs expect.
pub fn io_error(err: &io::Error, what: &str) -> ConnectError {
    let code = match err.raw_os_error() {
        Some(libc::ELOOP) => Code::FailedPrecondition,
        Some(libc::ENOTEMPTY) | Some(libc::EEXIST) => Code::AlreadyExists,
        Some(libc::EINVAL)
        | Some(libc::ENAMETOOLONG)
        | Some(libc::EISDIR)
        | Some(libc::ENOTDIR) => Code::InvalidArgument,
        Some(libc::EROFS) | Some(libc::EPERM) | Some(libc::EACCES) => Code::PermissionDenied,
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => Code::ResourceExhausted,
        _ => return ConnectError::from_io(err, what),
    };
    ConnectError::new(code, format!("{what}: {err}"))
}

/// Whether an `lstat` error means "there is nothing at this path".
fn is_missing(err: &io::Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR))
}

/// `Stat`: the entry at `path` (a final symlink is described, not followed).
pub fn stat(path: &Path) -> Result<EntryInfo, ConnectError> {
    EntryBuilder::default().build(path, path).map_err(|e| {
        if is_missing(&e) {
            ConnectError::not_found(format!("path '{}' does not exist", path.display()))
        } else {
            io_error(&e, &format!("stat '{}'", path.display()))
        }
    })
}

/// `MakeDir`: `mkdir -p`, new directories owned by `user`. An existing directory is
/// `already_exists`, an existing non-directory `invalid_argument`.
pub fn make_dir(path: &Path, user: &User) -> Result<EntryInfo, ConnectError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => {
            return Err(ConnectError::already_exists(format!(
                "directory '{}' already exists",
                path.display()
            )));
        }
        Ok(_) => {
            return Err(ConnectError::invalid_argument(format!(
                "path '{}' already exists and is not a directory",
                path.display()
            )));
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
            return Err(ConnectError::invalid_argument(format!(
                "a parent of '{}' is not a directory",
                path.display()
            )));
        }
        Err(e) => return Err(io_error(&e, &format!("stat '{}'", path.display()))),
    }
    create_dirs(path, user)?;
    stat(path)
}

/// `mkdir -p` as `user`; a component that exists but is no directory (a file, a
/// dangling symlink) is `invalid_argument`.
fn create_dirs(path: &Path, user: &User) -> Result<(), ConnectError> {
    paths::create_dirs_as(path, user).map_err(|e| match e.raw_os_error() {
        Some(libc::EEXIST) | Some(libc::ENOTDIR) => ConnectError::invalid_argument(format!(
            "cannot create directory '{}': a component exists and is not a directory",
            path.display()
        )),
        _ => io_error(&e, &format!("creating directory '{}'", path.display())),
    })
}

/// `Move`: renames `source` to `destination`, creating the destination's parents (owned
/// by `user`). Across filesystems the object is copied and the source removed.
pub fn move_entry(
    source: &Path,
    destination: &Path,
    user: &User,
) -> Result<EntryInfo, ConnectError> {
    if let Err(e) = std::fs::symlink_metadata(source) {
        return Err(if is_missing(&e) {
            ConnectError::not_found(format!("source '{}' does not exist", source.display()))
        } else {
            io_error(&e, &format!("stat '{}'", source.display()))
        });
    }
    if source == Path::new("/") || destination == Path::new("/") {
        return Err(ConnectError::invalid_argument(
            "cannot move the root directory",
        ));
    }
    if source != destination && destination.starts_with(source) {
        return Err(ConnectError::invalid_argument(format!(
            "cannot move '{}' into itself",
            source.display()
        )));
    }
    if let Some(parent) = destination.parent() {
        create_dirs(parent, user)?;
    }
    match std::fs::rename(source, destination) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
            copy_tree(source, destination).map_err(|e| {
                let _ = remove_path(destination);
                io_error(
                    &e,
                    &format!("moving '{}' across filesystems", source.display()),
                )
            })?;
            remove_path(source).map_err(|e| {
                io_error(
                    &e,
                    &format!("removing '{}' after copying it", source.display()),
                )
            })?;
        }
        Err(e) => {
            return Err(io_error(
                &e,
                &format!(
                    "moving '{}' to '{}'",
                    source.display(),
                    destination.display()
                ),
            ));
        }
    }
    stat(destination)
}

/// Copies a tree without following symlinks, keeping modes, owners and mtimes.
fn copy_tree(src: &Path, dst: &Path) -> io::Result<()> {
    let meta = std::fs::symlink_metadata(src)?;
    let ft = meta.file_type();
    if ft.is_symlink() {
        std::os::unix::fs::symlink(std::fs::read_link(src)?, dst)?;
    } else if ft.is_dir() {
        std::fs::create_dir(dst)?;
        for child in std::fs::read_dir(src)? {
            let child = child?;
            copy_tree(&child.path(), &dst.join(child.file_name()))?;
        }
        std::fs::set_permissions(dst, meta.permissions())?;
    } else if ft.is_file() {
        std::fs::copy(src, dst)?;
    } else {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "special files cannot be moved across filesystems",
        ));
    }
    std::os::unix::fs::lchown(dst, Some(meta.uid()), Some(meta.gid()))?;
    Ok(())
}

/// Removes a file, symlink or whole directory tree (never following symlinks).
fn remove_path(path: &Path) -> io::Result<()> {
    let meta = std::fs::symlink_metadata(path)?;
    if meta.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    }
}

/// `Remove`: deletes `path` recursively; a missing path is fine. `/` is refused.
pub fn remove(path: &Path) -> Result<(), ConnectError> {
    if path == Path::new("/") {
        return Err(ConnectError::invalid_argument("refusing to remove '/'"));
    }
    match remove_path(path) {
        Ok(()) => Ok(()),
        Err(e) if is_missing(&e) => Ok(()),
        Err(e) => Err(io_error(&e, &format!("removing '{}'", path.display()))),
    }
}

/// `ListDir`: entries below `path` up to `depth` levels (0 means 1), depth-first in name
/// order. A symlink named by `path` itself is followed; symlinks met while walking are
/// listed but not descended into (so loops cannot recurse). Reported paths keep the
/// requested prefix.
pub fn list_dir(path: &Path, depth: u32) -> Result<Vec<EntryInfo>, ConnectError> {
    let depth = depth.max(1);
    let resolved = std::fs::canonicalize(path).map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP) => ConnectError::failed_precondition(format!(
            "cyclic symlink or chain of too many links at '{}'",
            path.display()
        )),
        _ if is_missing(&e) => {
            ConnectError::not_found(format!("directory '{}' does not exist", path.display()))
        }
        _ => io_error(&e, &format!("resolving '{}'", path.display())),
    })?;
    let meta = std::fs::metadata(&resolved)
        .map_err(|e| io_error(&e, &format!("stat '{}'", path.display())))?;
    if !meta.is_dir() {
        return Err(ConnectError::invalid_argument(format!(
            "path '{}' is not a directory",
            path.display()
        )));
    }
    let mut walker = Walker {
        builder: EntryBuilder::default(),
        entries: Vec::new(),
        ancestors: HashSet::from([(meta.dev(), meta.ino())]),
        max_depth: depth,
    };
    // The top directory must be readable; deeper failures (races, permissions) only
    // leave that subtree out.
    let children = read_sorted(&resolved)
        .map_err(|e| io_error(&e, &format!("reading directory '{}'", path.display())))?;
    walker.walk_children(&resolved, path, children, 1)?;
    Ok(walker.entries)
}

struct Walker {
    builder: EntryBuilder,
    entries: Vec<EntryInfo>,
    /// (dev, ino) of the directories on the current path, to refuse cycles (e.g. bind
    /// mounts) even though symlinks are never followed.
    ancestors: HashSet<(u64, u64)>,
    max_depth: u32,
}

impl Walker {
    fn walk_children(
        &mut self,
        real_dir: &Path,
        reported_dir: &Path,
        children: Vec<std::ffi::OsString>,
        level: u32,
    ) -> Result<(), ConnectError> {
        for name in children {
            let real = real_dir.join(&name);
            let reported = reported_dir.join(&name);
            let entry = match self.builder.build(&real, &reported) {
                Ok(e) => e,
                Err(_) => continue, // vanished meanwhile
            };
            if self.entries.len() >= MAX_LIST_ENTRIES {
                return Err(ConnectError::new(
                    Code::ResourceExhausted,
                    format!(
                        "more than {MAX_LIST_ENTRIES} entries below '{}'; list with a smaller depth",
                        reported_dir.display()
                    ),
                ));
            }
            self.entries.push(entry);
            if level >= self.max_depth {
                continue;
            }
            let Ok(meta) = std::fs::symlink_metadata(&real) else {
                continue;
            };
            if !meta.is_dir() {
                continue; // files, and symlinks (never descended into)
            }
            let key = (meta.dev(), meta.ino());
            if !self.ancestors.insert(key) {
                continue;
            }
            if let Ok(grandchildren) = read_sorted(&real) {
                self.walk_children(&real, &reported, grandchildren, level + 1)?;
            }
            self.ancestors.remove(&key);
        }
        Ok(())
    }
}

/// The names in a directory, sorted bytewise (like Go's `filepath.WalkDir`).
fn read_sorted(dir: &Path) -> io::Result<Vec<std::ffi::OsString>> {
    let mut names = Vec::new();
    for child in std::fs::read_dir(dir)? {
        match child {
            Ok(c) => names.push(c.file_name()),
            Err(_) => continue,
        }
    }
    names.sort();
    Ok(names)
}

/// Resolves `path` for `user` (see [`crate::paths::resolve`]); an empty path is refused
/// for operations where "the home directory" would be a surprising target.
pub fn resolve_nonempty(
    ctx: &crate::state::Context,
    user: &User,
    path: &str,
    what: &str,
) -> Result<PathBuf, ConnectError> {
    if path.is_empty() {
        return Err(ConnectError::invalid_argument(format!(
            "{what}: path must not be empty"
        )));
    }
    paths::resolve(ctx, user, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn tmp() -> super::super::test_util::TempDir {
        super::super::test_util::TempDir::new("ops")
    }

    fn me() -> User {
        crate::users::current()
    }

    fn paths_of(entries: &[EntryInfo]) -> Vec<String> {
        entries.iter().map(|e| e.path.clone()).collect()
    }

    #[test]
    fn list_depths_and_symlinks() {
        let d = tmp();
        std::fs::create_dir_all(d.join("a/b/c")).unwrap();
        std::fs::write(d.join("a/f"), b"x").unwrap();
        std::fs::write(d.join("z"), b"x").unwrap();
        symlink(d.join("a"), d.join("la")).unwrap();
        symlink(d.join("loop"), d.join("loop")).unwrap();
        let s = |p: &str| d.join(p).to_string_lossy().into_owned();

        assert_eq!(
            paths_of(&list_dir(&d, 0).unwrap()),
            vec![s("a"), s("la"), s("loop"), s("z")]
        );
        assert_eq!(
            paths_of(&list_dir(&d, 2).unwrap()),
            vec![s("a"), s("a/b"), s("a/f"), s("la"), s("loop"), s("z")]
        );
        // Huge depth: the symlinked directory and the loop are not descended into.
        assert_eq!(
            paths_of(&list_dir(&d, u32::MAX).unwrap()),
            vec![
                s("a"),
                s("a/b"),
                s("a/b/c"),
                s("a/f"),
                s("la"),
                s("loop"),
                s("z")
            ]
        );
        // A symlink as the listed path is followed; paths keep the requested prefix.
        assert_eq!(
            paths_of(&list_dir(&d.join("la"), 1).unwrap()),
            vec![s("la/b"), s("la/f")]
        );
        assert_eq!(
            list_dir(&d.join("loop"), 1).unwrap_err().code,
            Code::FailedPrecondition
        );
        assert_eq!(
            list_dir(&d.join("z"), 1).unwrap_err().code,
            Code::InvalidArgument
        );
        assert_eq!(
            list_dir(&d.join("missing"), 1).unwrap_err().code,
            Code::NotFound
        );
        assert_eq!(
            list_dir(&d.join("z/under-file"), 1).unwrap_err().code,
            Code::NotFound
        );
    }

    #[test]
    fn make_move_remove() {
        let d = tmp();
        let user = me();
        let e = make_dir(&d.join("x/y"), &user).unwrap();
        assert_eq!(e.name, "y");
        assert_eq!(
            make_dir(&d.join("x/y"), &user).unwrap_err().code,
            Code::AlreadyExists
        );
        std::fs::write(d.join("file"), b"1").unwrap();
        assert_eq!(
            make_dir(&d.join("file"), &user).unwrap_err().code,
            Code::InvalidArgument
        );
        assert_eq!(
            make_dir(&d.join("file/sub"), &user).unwrap_err().code,
            Code::InvalidArgument
        );
        symlink(d.join("nowhere"), d.join("dangling")).unwrap();
        assert_eq!(
            make_dir(&d.join("dangling"), &user).unwrap_err().code,
            Code::InvalidArgument
        );
        assert_eq!(
            make_dir(&d.join("dangling/sub"), &user).unwrap_err().code,
            Code::InvalidArgument
        );
        assert_eq!(
            move_entry(&d.join("x"), &d.join("file/x"), &user)
                .unwrap_err()
                .code,
            Code::InvalidArgument
        );

        let e = move_entry(&d.join("file"), &d.join("new/parent/file2"), &user).unwrap();
        assert_eq!(e.name, "file2");
        assert_eq!(std::fs::read(d.join("new/parent/file2")).unwrap(), b"1");
        assert!(!d.join("file").exists());
        assert_eq!(
            move_entry(&d.join("file"), &d.join("other"), &user)
                .unwrap_err()
                .code,
            Code::NotFound
        );
        assert_eq!(
            move_entry(&d.join("x"), &d.join("x/y/inside"), &user)
                .unwrap_err()
                .code,
            Code::InvalidArgument
        );

        remove(&d.join("x")).unwrap();
        assert!(!d.join("x").exists());
        remove(&d.join("x")).unwrap(); // missing is fine
        remove(&d.join("new/parent/file2/below-a-file")).unwrap();
        assert_eq!(
            remove(Path::new("/")).unwrap_err().code,
            Code::InvalidArgument
        );
        assert_eq!(stat(&d.join("x")).unwrap_err().code, Code::NotFound);
    }

    #[test]
    fn copy_tree_keeps_links_and_content() {
        let d = tmp();
        std::fs::create_dir_all(d.join("src/sub")).unwrap();
        std::fs::write(d.join("src/sub/f"), b"data").unwrap();
        symlink("sub/f", d.join("src/l")).unwrap();
        copy_tree(&d.join("src"), &d.join("dst")).unwrap();
        assert_eq!(std::fs::read(d.join("dst/sub/f")).unwrap(), b"data");
        assert_eq!(
            std::fs::read_link(d.join("dst/l")).unwrap(),
            PathBuf::from("sub/f")
        );
    }
}
