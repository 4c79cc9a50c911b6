//! Turn a stopped sandbox's writable layer (`<sandbox>/upper`) into a stored layer: the
//! result of one build step, or a snapshot.
//!
//! The upper directory is already in overlayfs format (the kernel wrote it: 0/0
//! whiteouts, `user.overlay.opaque`), but owned by the sandbox's host uid range: root
//! inside is host uid `uid_base`. The copy shifts every owner back by `uid_base` (ids
//! outside the range become 65534), rewrites file capabilities that name the sandbox's
//! root (`security.capability` v3 with `rootid = uid_base`) into plain v2 ones, keeps
//! hard links as links, and drops the overlay's bookkeeping xattrs other than opacity.
//! Sockets are skipped. The sandbox must be stopped (its overlay unmounted) first.

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::unpack::OPAQUE_XATTR;

/// The owner id outside a sandbox's range maps to (the kernel's overflow id).
const NOBODY: u32 = 65534;

/// What was copied.
#[derive(Debug, Default, Clone)]
pub struct Committed {
    /// Entries copied.
    pub entries: u64,
    /// Bytes of file content copied.
    pub bytes: u64,
}

/// Copy `upper` (a stopped sandbox's writable layer, owned by `uid_base + n`) into the
/// empty directory `dest` as a layer owned by `n`. `skip` names top-level entries to leave
/// out (e.g. the build's scratch files).
pub fn commit_upper(upper: &Path, dest: &Path, uid_base: u32, skip: &[&str]) -> Result<Committed> {
    let mut c = Copier {
        uid_base,
        links: HashMap::new(),
        out: Committed::default(),
    };
    c.dir(upper, dest, skip)?;
    // The layer's root: what overlayfs shows as `/` comes from the topmost layer, and an
    // upper directory's own mode is the node's (0700), not the image's.
    fsutil::lchown(dest, 0, 0)?;
    fs::set_permissions(dest, fs::Permissions::from_mode(0o755)).ctx("chmod", dest)?;
    Ok(c.out)
}

struct Copier {
    uid_base: u32,
    /// (dev, ino) of multiply-linked files already copied → their copy.
    links: HashMap<(u64, u64), std::path::PathBuf>,
    out: Committed,
}

impl Copier {
    fn shift(&self, id: u32) -> u32 {
        match id.checked_sub(self.uid_base) {
            Some(n) if n < 65536 => n,
            _ => NOBODY,
        }
    }

    fn dir(&mut self, src: &Path, dest: &Path, skip: &[&str]) -> Result<()> {
        let mut entries: Vec<_> = fs::read_dir(src)
            .ctx("readdir", src)?
            .collect::<std::io::Result<_>>()
            .ctx("readdir", src)?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let name = e.file_name();
            if skip.iter().any(|s| name == **s) {
                continue;
            }
            let (s, d) = (e.path(), dest.join(&name));
            let m = fs::symlink_metadata(&s).ctx("stat", &s)?;
            let ft = m.file_type();
            self.out.entries += 1;
            if ft.is_dir() {
                fs::create_dir(&d).ctx("mkdir", &d)?;
                self.dir(&s, &d, &[])?;
                self.meta(&s, &d, &m)?;
                continue;
            }
            if m.nlink() > 1
                && !ft.is_dir()
                && let Some(first) = self.links.get(&(m.dev(), m.ino()))
            {
                fs::hard_link(first, &d).ctx("link", &d)?;
                continue;
            }
            if ft.is_file() {
                let mut from = fs::File::open(&s).ctx("open", &s)?;
                let mut to = fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .mode(0o600)
                    .open(&d)
                    .ctx("create", &d)?;
                self.out.bytes += std::io::copy(&mut from, &mut to).ctx("copy", &d)?;
            } else if ft.is_symlink() {
                let target = fs::read_link(&s).ctx("readlink", &s)?;
                std::os::unix::fs::symlink(&target, &d).ctx("symlink", &d)?;
            } else if ft.is_char_device() || ft.is_block_device() || ft.is_fifo() {
                let kind = if ft.is_char_device() {
                    libc::S_IFCHR
                } else if ft.is_block_device() {
                    libc::S_IFBLK
                } else {
                    libc::S_IFIFO
                };
                let rdev = m.rdev();
                fsutil::mknod(&d, kind, libc::major(rdev), libc::minor(rdev))?;
            } else {
                continue; // sockets: not part of a filesystem image
            }
            if m.nlink() > 1 {
                self.links.insert((m.dev(), m.ino()), d.clone());
            }
            self.meta(&s, &d, &m)?;
        }
        Ok(())
    }

    /// Owner, mode, xattrs and times of `src` onto `dest`.
    fn meta(&self, src: &Path, dest: &Path, m: &fs::Metadata) -> Result<()> {
        fsutil::lchown(dest, self.shift(m.uid()), self.shift(m.gid()))?;
        let symlink = m.file_type().is_symlink();
        if !symlink {
            fs::set_permissions(dest, fs::Permissions::from_mode(m.mode() & 0o7777))
                .ctx("chmod", dest)?;
        }
        for name in fsutil::list_xattrs(src) {
            if name.starts_with("user.overlay.") && name != OPAQUE_XATTR {
                continue;
            }
            let Some(mut value) = fsutil::get_xattr(src, &name) else {
                continue;
            };
            if name == "security.capability" {
                value = capability_v2(&value);
            }
            if let Err(e) = fsutil::set_xattr(dest, &name, &value) {
                tracing::debug!("{}: xattr {name}: {e}", dest.display());
            }
        }
        if !symlink {
            let _ = set_times(dest, m);
        }
        Ok(())
    }
}

/// A `security.capability` value without a namespace root: v3 (24 bytes, with `rootid`)
/// becomes v2 (20 bytes) so that it means "root of whichever sandbox mounts the layer".
fn capability_v2(v: &[u8]) -> Vec<u8> {
    const VFS_CAP_REVISION_MASK: u32 = 0xff00_0000;
    const VFS_CAP_REVISION_2: u32 = 0x0200_0000;
    if v.len() < 24 {
        return v.to_vec();
    }
    let magic = u32::from_le_bytes([v[0], v[1], v[2], v[3]]);
    let flags = magic & !VFS_CAP_REVISION_MASK;
    let mut out = (VFS_CAP_REVISION_2 | flags).to_le_bytes().to_vec();
    out.extend_from_slice(&v[4..20]);
    out
}

fn set_times(path: &Path, m: &fs::Metadata) -> std::io::Result<()> {
    let f = fs::File::options()
        .write(false)
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let mtime = std::time::UNIX_EPOCH
        + std::time::Duration::new(m.mtime().max(0) as u64, m.mtime_nsec().max(0) as u32);
    f.set_times(fs::FileTimes::new().set_modified(mtime))
}

/// Whether `path` holds anything a layer would contain (an empty upper commits nothing).
pub fn is_empty_dir(path: &Path) -> Result<bool> {
    Ok(fs::read_dir(path).ctx("readdir", path)?.next().is_none())
}

/// The error for a sandbox whose upper directory is gone.
pub fn missing_upper(path: &Path) -> Error {
    Error::io(
        "commit",
        path,
        std::io::Error::from(std::io::ErrorKind::NotFound),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn shifts_owners_keeps_whiteouts_links_and_opacity() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: committing sets owners and needs root");
            return;
        }
        let base = 700_000;
        let root = std::env::temp_dir().join(format!("cubicle-commit-{}", std::process::id()));
        let _ = fsutil::remove_tree(&root);
        let (up, dest) = (root.join("upper"), root.join("dest"));
        fs::create_dir_all(up.join("home/user")).unwrap();
        fs::create_dir_all(up.join("var/cache")).unwrap();
        fs::create_dir_all(&dest).unwrap();
        fs::write(up.join("home/user/f"), b"data").unwrap();
        fs::hard_link(up.join("home/user/f"), up.join("home/user/g")).unwrap();
        fsutil::lchown(&up.join("home/user/f"), base + 1000, base + 1000).unwrap();
        fsutil::lchown(&up.join("home/user"), base + 1000, base + 1000).unwrap();
        fsutil::lchown(&up.join("var"), 12, 12).unwrap(); // outside the range
        fsutil::mknod(&up.join("gone"), libc::S_IFCHR, 0, 0).unwrap();
        fsutil::set_xattr(&up.join("var/cache"), OPAQUE_XATTR, b"y").unwrap();
        fsutil::set_xattr(&up.join("var/cache"), "user.overlay.impure", b"y").unwrap();
        fs::write(up.join("scratch"), b"x").unwrap();

        let c = commit_upper(&up, &dest, base, &["scratch"]).unwrap();
        assert_eq!(c.bytes, 4);
        let f = fs::metadata(dest.join("home/user/f")).unwrap();
        assert_eq!((f.uid(), f.nlink()), (1000, 2));
        assert_eq!(fs::metadata(dest.join("home/user")).unwrap().uid(), 1000);
        assert_eq!(fs::metadata(dest.join("var")).unwrap().uid(), NOBODY);
        let w = fs::symlink_metadata(dest.join("gone")).unwrap();
        assert!(w.file_type().is_char_device() && w.rdev() == 0);
        assert_eq!(
            fsutil::get_xattr(&dest.join("var/cache"), OPAQUE_XATTR).unwrap(),
            b"y"
        );
        assert!(fsutil::get_xattr(&dest.join("var/cache"), "user.overlay.impure").is_none());
        assert!(!dest.join("scratch").exists());
        fsutil::remove_tree(&root).unwrap();
    }

    #[test]
    fn capability_v3_becomes_v2() {
        let mut v3 = 0x0300_0001u32.to_le_bytes().to_vec();
        v3.extend_from_slice(&[1u8; 16]);
        v3.extend_from_slice(&700_000u32.to_le_bytes());
        let v2 = capability_v2(&v3);
        assert_eq!(v2.len(), 20);
        assert_eq!(
            u32::from_le_bytes([v2[0], v2[1], v2[2], v2[3]]),
            0x0200_0001
        );
        assert_eq!(&v2[4..], &[1u8; 16]);
    }
}
