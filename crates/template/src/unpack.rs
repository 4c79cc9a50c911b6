//! Unpack one OCI image layer (a tar stream, uncompressed by the caller) into a layer
//! directory in overlayfs format, computing its diff id on the way.
//!
//! OCI whiteouts become overlayfs ones: `.wh.NAME` → a 0/0 character device `NAME`,
//! `.wh..wh..opq` → the xattr `user.overlay.opaque=y` on its directory. Ownership comes
//! from the tar headers (uids inside the sandbox, idmapped per sandbox at mount time);
//! modes keep their setuid/setgid/sticky bits; extended attributes carried in PAX headers
//! (`SCHILY.xattr.*`) are kept except overlayfs' own (`user.overlay.*`, `trusted.*`),
//! which would let an image steer the overlay.
//!
//! The archive is untrusted and this runs as root on the host, so nothing is ever written
//! through a symbolic link: every parent of an entry must be a real directory inside the
//! layer (checked with `lstat`, missing ones are created), files are created with
//! `O_NOFOLLOW | O_EXCL`, hard links must name a path inside the layer that is not
//! reached through a symlink, and `..` or absolute names are refused.

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr};
use std::fs;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::fsutil;

/// Prefix of an OCI whiteout file name.
const WHITEOUT_PREFIX: &str = ".wh.";
/// Name of the OCI opaque-directory marker.
pub const OPAQUE_MARKER: &str = ".wh..wh..opq";
/// The overlayfs xattr (userxattr mode) that makes a directory opaque.
pub const OPAQUE_XATTR: &str = "user.overlay.opaque";

/// What unpacking a layer found.
#[derive(Debug, Clone, Default)]
pub struct Unpacked {
    /// SHA-256 of the uncompressed tar (the OCI diff id), 64 hex digits.
    pub diff_id: String,
    /// Entries written (files, directories, links, whiteouts).
    pub entries: u64,
    /// Bytes of file content written.
    pub bytes: u64,
}

fn broken(what: impl std::fmt::Display) -> Error {
    Error::BrokenImage(what.to_string())
}

/// A reader that hashes what passes through.
struct Hashing<R> {
    inner: R,
    hash: Sha256,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
}

/// Unpack the tar stream `tar` into the (empty) directory `dest`.
pub fn unpack_layer(tar: impl Read, dest: &Path) -> Result<Unpacked> {
    let mut reader = Hashing {
        inner: tar,
        hash: Sha256::new(),
    };
    let mut out = Unpacked::default();
    let mut dir_times: BTreeMap<PathBuf, u64> = BTreeMap::new();
    {
        let mut archive = tar::Archive::new(&mut reader);
        let entries = archive
            .entries()
            .map_err(|e| broken(format!("not a tar archive: {e}")))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| broken(format!("reading the archive: {e}")))?;
            let raw = entry
                .path()
                .map_err(|e| broken(format!("bad entry name: {e}")))?
                .into_owned();
            let Some(rel) = clean_relative(&raw)? else {
                continue; // the root itself ("./")
            };
            out.entries += 1;
            apply_entry(&mut entry, &rel, dest, &mut out, &mut dir_times)?;
        }
    }
    // Drain what follows the end-of-archive blocks, so the digest covers the whole blob.
    std::io::copy(&mut reader, &mut std::io::sink())
        .map_err(|e| broken(format!("reading the archive: {e}")))?;
    // Directory times last: creating their children changed them.
    for (dir, mtime) in dir_times.iter().rev() {
        let _ = set_mtime(&dest.join(dir), *mtime);
    }
    out.diff_id = crate::layer::hex(&reader.hash.finalize());
    Ok(out)
}

/// `path` as a clean relative path (no `.`, no `..`, no root). `None` for the archive's
/// root directory itself.
fn clean_relative(path: &Path) -> Result<Option<PathBuf>> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => {
                return Err(broken(format!(
                    "entry '{}' leaves the layer ('..')",
                    path.display()
                )));
            }
        }
    }
    Ok((!out.as_os_str().is_empty()).then_some(out))
}

/// Make sure every parent of `rel` is a real directory below `root` (create missing ones,
/// 0755 root-owned as OCI implies). Errors if one is a symlink or not a directory.
fn ensure_parents(root: &Path, rel: &Path) -> Result<PathBuf> {
    let mut cur = root.to_path_buf();
    let Some(parent) = rel.parent() else {
        return Ok(cur);
    };
    for c in parent.components() {
        cur.push(c);
        match fs::symlink_metadata(&cur) {
            Ok(m) if m.is_dir() => {}
            Ok(m) if m.file_type().is_symlink() => {
                return Err(broken(format!(
                    "entry '{}' is reached through the symlink '{}'",
                    rel.display(),
                    cur.strip_prefix(root).unwrap_or(&cur).display()
                )));
            }
            Ok(_) => {
                // A file (or whiteout) where a directory is needed: the later entry wins.
                fs::remove_file(&cur).map_err(|e| Error::io("remove", &cur, e))?;
                fs::create_dir(&cur).map_err(|e| Error::io("mkdir", &cur, e))?;
            }
            Err(_) => fs::create_dir(&cur).map_err(|e| Error::io("mkdir", &cur, e))?,
        }
    }
    Ok(cur)
}

/// Remove whatever is at `path` unless it is a directory and `keep_dir`.
fn clear(path: &Path, keep_dir: bool) -> Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() && keep_dir => Ok(()),
        Ok(m) if m.is_dir() => fsutil::remove_tree(path),
        Ok(_) => fs::remove_file(path).map_err(|e| Error::io("remove", path, e)),
        Err(_) => Ok(()),
    }
}

fn apply_entry<R: Read>(
    entry: &mut tar::Entry<R>,
    rel: &Path,
    root: &Path,
    out: &mut Unpacked,
    dir_times: &mut BTreeMap<PathBuf, u64>,
) -> Result<()> {
    let name = rel
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    let parent = ensure_parents(root, rel)?;
    if name == OPAQUE_MARKER {
        return fsutil::set_xattr(&parent, OPAQUE_XATTR, b"y");
    }
    if let Some(hidden) = name.strip_prefix(WHITEOUT_PREFIX) {
        if hidden.is_empty() || hidden == "." || hidden == ".." || hidden.contains('/') {
            return Err(broken(format!("bad whiteout '{}'", rel.display())));
        }
        let target = parent.join(hidden);
        clear(&target, false)?;
        return fsutil::mknod(&target, libc::S_IFCHR, 0, 0);
    }
    let path = root.join(rel);
    let h = entry.header().clone();
    let mode = h
        .mode()
        .map_err(|e| broken(format!("{}: mode: {e}", rel.display())))?
        & 0o7777;
    let uid = h.uid().unwrap_or(0) as u32;
    let gid = h.gid().unwrap_or(0) as u32;
    let mtime = h.mtime().unwrap_or(0);
    let kind = h.entry_type();
    let xattrs = pax_xattrs(entry);
    use tar::EntryType as T;
    match kind {
        T::Directory => {
            clear(&path, true)?;
            if !path.is_dir() {
                fs::create_dir(&path).map_err(|e| Error::io("mkdir", &path, e))?;
            }
            dir_times.insert(rel.to_path_buf(), mtime);
        }
        T::Regular | T::Continuous | T::GNUSparse => {
            clear(&path, false)?;
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_NOFOLLOW)
                .mode(0o600)
                .open(&path)
                .map_err(|e| Error::io("create", &path, e))?;
            let n = std::io::copy(entry, &mut f)
                .map_err(|e| broken(format!("{}: {e}", rel.display())))?;
            f.flush().map_err(|e| Error::io("write", &path, e))?;
            out.bytes += n;
        }
        T::Symlink => {
            let target = entry
                .link_name()
                .map_err(|e| broken(format!("{}: link target: {e}", rel.display())))?
                .ok_or_else(|| broken(format!("{}: symlink without a target", rel.display())))?;
            clear(&path, false)?;
            std::os::unix::fs::symlink(&target, &path)
                .map_err(|e| Error::io("symlink", &path, e))?;
        }
        T::Link => {
            let target = entry
                .link_name()
                .map_err(|e| broken(format!("{}: link target: {e}", rel.display())))?
                .ok_or_else(|| broken(format!("{}: hard link without a target", rel.display())))?;
            let target_rel = clean_relative(&target)?
                .ok_or_else(|| broken(format!("{}: hard link to the root", rel.display())))?;
            // The target's parents must be real directories too (no escape through links).
            ensure_parents(root, &target_rel)?;
            let src = root.join(&target_rel);
            match fs::symlink_metadata(&src) {
                Ok(m) if !m.is_dir() => {}
                _ => {
                    return Err(broken(format!(
                        "{}: hard link to '{}', which is not a file of this layer",
                        rel.display(),
                        target_rel.display()
                    )));
                }
            }
            clear(&path, false)?;
            fs::hard_link(&src, &path).map_err(|e| Error::io("link", &path, e))?;
            return Ok(()); // shares the target's inode: no metadata of its own
        }
        T::Char | T::Block | T::Fifo => {
            let ty = match kind {
                T::Char => libc::S_IFCHR,
                T::Block => libc::S_IFBLK,
                _ => libc::S_IFIFO,
            };
            let major = h.device_major().ok().flatten().unwrap_or(0);
            let minor = h.device_minor().ok().flatten().unwrap_or(0);
            clear(&path, false)?;
            fsutil::mknod(&path, ty, major, minor)?;
        }
        // PAX/GNU metadata records are consumed by the tar reader; anything else is
        // unusual but harmless to skip.
        other => {
            tracing::debug!("layer entry {} of type {other:?} skipped", rel.display());
            return Ok(());
        }
    }
    fsutil::lchown(&path, uid, gid)?;
    if kind != T::Symlink {
        fs::set_permissions(&path, fs::Permissions::from_mode(mode))
            .map_err(|e| Error::io("chmod", &path, e))?;
    }
    for (k, v) in xattrs {
        // Unsupported attributes (e.g. security.selinux here) are not fatal.
        if let Err(e) = fsutil::set_xattr(&path, &k, &v) {
            tracing::debug!("{}: xattr {k}: {e}", rel.display());
        }
    }
    if kind != T::Directory && kind != T::Symlink {
        let _ = set_mtime(&path, mtime);
    }
    Ok(())
}

/// The extended attributes a PAX header carries, minus the overlay's own.
fn pax_xattrs<R: Read>(entry: &mut tar::Entry<R>) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let Ok(Some(exts)) = entry.pax_extensions() else {
        return out;
    };
    for ext in exts.flatten() {
        let Ok(key) = ext.key() else { continue };
        let Some(name) = key.strip_prefix("SCHILY.xattr.") else {
            continue;
        };
        if name.starts_with("user.overlay.") || name.starts_with("trusted.") {
            continue;
        }
        out.push((name.to_string(), ext.value_bytes().to_vec()));
    }
    out
}

fn set_mtime(path: &Path, secs: u64) -> Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Error::InvalidRequest(format!("path {} has a NUL", path.display())))?;
    let t = libc::timespec {
        tv_sec: secs as libc::time_t,
        tv_nsec: 0,
    };
    let times = [t, t];
    // SAFETY: valid NUL-terminated path and a 2-element timespec array.
    let r = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(Error::io(
            "utimensat",
            path,
            std::io::Error::last_os_error(),
        ))
    }
}

/// Decompress `blob` by its magic bytes (gzip, zstd or plain tar) and unpack it into `dest`.
pub fn unpack_blob(blob: impl Read, dest: &Path) -> Result<Unpacked> {
    let mut r = std::io::BufReader::with_capacity(1 << 20, blob);
    let magic = {
        use std::io::BufRead;
        r.fill_buf()
            .map_err(|e| broken(format!("reading the layer: {e}")))?
            .get(..4)
            .map(<[u8]>::to_vec)
    };
    match magic.as_deref() {
        Some([0x1f, 0x8b, ..]) => unpack_layer(flate2::read::MultiGzDecoder::new(r), dest),
        Some([0x28, 0xb5, 0x2f, 0xfd]) => {
            let z = ruzstd::decoding::StreamingDecoder::new(r)
                .map_err(|e| broken(format!("zstd: {e}")))?;
            unpack_layer(z, dest)
        }
        _ => unpack_layer(r, dest),
    }
}

/// Whether `name` is an OCI whiteout file name (used by tests and diagnostics).
pub fn is_whiteout_name(name: &OsStr) -> bool {
    name.as_bytes().starts_with(WHITEOUT_PREFIX.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    fn tar_of(build: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        build(&mut b);
        b.into_inner().unwrap()
    }

    fn file(b: &mut tar::Builder<Vec<u8>>, path: &str, data: &[u8], mode: u32, uid: u64) {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(mode);
        h.set_uid(uid);
        h.set_gid(uid);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, path, data).unwrap();
    }

    fn link(b: &mut tar::Builder<Vec<u8>>, kind: tar::EntryType, path: &str, target: &str) {
        let mut h = tar::Header::new_gnu();
        h.set_size(0);
        h.set_mode(0o777);
        h.set_entry_type(kind);
        b.append_link(&mut h, path, target).unwrap();
    }

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cubicle-unpack-{name}-{}", std::process::id()));
        let _ = fsutil::remove_tree(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn files_modes_owners_links_and_diff_id() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: unpacking sets owners and needs root");
            return;
        }
        let data = tar_of(|b| {
            file(b, "./etc/passwd", b"root:x:0:0::/root:/bin/sh\n", 0o644, 0);
            file(b, "usr/bin/tool", b"#!/bin/sh\n", 0o4755, 0);
            file(b, "home/user/.profile", b"x", 0o600, 1000);
            link(b, tar::EntryType::Symlink, "bin", "usr/bin");
            link(b, tar::EntryType::Link, "usr/bin/tool2", "usr/bin/tool");
        });
        let d = tmp("ok");
        let u = unpack_layer(&data[..], &d).unwrap();
        assert_eq!(u.diff_id, crate::layer::hex(&Sha256::digest(&data)));
        let m = fs::metadata(d.join("usr/bin/tool")).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o4755);
        assert_eq!(m.nlink(), 2);
        assert_eq!(
            fs::metadata(d.join("home/user/.profile")).unwrap().uid(),
            1000
        );
        assert_eq!(
            fs::read_link(d.join("bin")).unwrap(),
            PathBuf::from("usr/bin")
        );
        fsutil::remove_tree(&d).unwrap();
    }

    #[test]
    fn whiteouts_become_overlay_whiteouts() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: whiteouts are character devices and need root");
            return;
        }
        let data = tar_of(|b| {
            file(b, "etc/.wh.motd", b"", 0o644, 0);
            file(b, "var/cache/.wh..wh..opq", b"", 0o644, 0);
            file(b, "var/cache/new", b"n", 0o644, 0);
        });
        let d = tmp("wh");
        unpack_layer(&data[..], &d).unwrap();
        let m = fs::symlink_metadata(d.join("etc/motd")).unwrap();
        assert!(m.file_type().is_char_device());
        assert_eq!(m.rdev(), 0);
        assert_eq!(
            fsutil::get_xattr(&d.join("var/cache"), OPAQUE_XATTR).unwrap(),
            b"y"
        );
        assert!(d.join("var/cache/new").is_file());
        assert!(!d.join("var/cache/.wh..wh..opq").exists());
        fsutil::remove_tree(&d).unwrap();
    }

    #[test]
    fn refuses_escapes() {
        let d = tmp("esc");
        // Through a symlink to the host.
        let data = tar_of(|b| {
            link(b, tar::EntryType::Symlink, "evil", "/tmp");
            file(b, "evil/pwned", b"x", 0o644, 0);
        });
        let e = unpack_layer(&data[..], &d).unwrap_err();
        assert!(e.to_string().contains("symlink"), "{e}");
        assert!(!Path::new("/tmp/pwned").exists());
        // A hard link to a host file.
        let d2 = tmp("esc2");
        let data = tar_of(|b| link(b, tar::EntryType::Link, "passwd", "../../../etc/passwd"));
        assert!(unpack_layer(&data[..], &d2).is_err());
        fsutil::remove_tree(&d).unwrap();
        fsutil::remove_tree(&d2).unwrap();
    }

    #[test]
    fn gzip_and_garbage() {
        let data = tar_of(|b| file(b, "a", b"1", 0o644, 0));
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&data).unwrap();
        let gz = gz.finish().unwrap();
        let d = tmp("gz");
        let u = unpack_blob(&gz[..], &d).unwrap();
        assert_eq!(u.diff_id, crate::layer::hex(&Sha256::digest(&data)));
        assert!(d.join("a").is_file());
        let d2 = tmp("junk");
        let e = unpack_blob(&b"\x1f\x8bnot really gzip"[..], &d2).unwrap_err();
        assert!(matches!(e, Error::BrokenImage(_)), "{e}");
        fsutil::remove_tree(&d).unwrap();
        fsutil::remove_tree(&d2).unwrap();
    }
}
