//! Pack a directory tree in overlayfs format (a layer, or a sandbox's directory with its
//! writable layer) into a tar stream that [`crate::unpack::unpack_layer`] turns back
//! into the same tree: what nodes exchange through the object store.
//!
//! Kept exactly: names, types (files, directories, symbolic and hard links, FIFOs,
//! character and block devices — overlay whiteouts are 0/0 character devices), modes
//! with their setuid/setgid/sticky bits, numeric owners (host ids as they are: a
//! sandbox's directory keeps its uid range, which a restore on another range rewrites),
//! modification times and extended attributes. overlayfs' own attributes are not
//! carried as such (the unpacker refuses them from archives): an opaque directory is
//! written with OCI's `.wh..wh..opq` marker, which the unpacker turns back into
//! `user.overlay.opaque=y`. Sockets are left out (nothing listens on a packed tree).
//!
//! Never follows a symbolic link; entries are written in a stable order (sorted by
//! name), so packing the same tree twice gives the same bytes.

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::fsutil;
use crate::unpack::OPAQUE_XATTR;

/// What packing wrote.
#[derive(Debug, Clone, Default)]
pub struct Packed {
    /// Entries written.
    pub entries: u64,
    /// Bytes of file content.
    pub bytes: u64,
}

/// Packs `root` into `out`, leaving out every top-level entry whose name `skip` accepts
/// (e.g. a sandbox directory's sockets and logs). Returns `out` with what was written.
pub fn pack_tree<W: Write>(
    root: &Path,
    out: W,
    skip: &dyn Fn(&str) -> bool,
) -> Result<(W, Packed)> {
    let mut b = tar::Builder::new(out);
    let mut st = State {
        links: HashMap::new(),
        packed: Packed::default(),
    };
    walk(&mut b, root, Path::new(""), Some(skip), &mut st)?;
    let out = b
        .into_inner()
        .map_err(|e| Error::io("write archive of", root, e))?;
    Ok((out, st.packed))
}

struct State {
    /// (device, inode) of files with several links → the first name written.
    links: HashMap<(u64, u64), PathBuf>,
    packed: Packed,
}

fn walk<W: Write>(
    b: &mut tar::Builder<W>,
    root: &Path,
    rel: &Path,
    skip: Option<&dyn Fn(&str) -> bool>,
    st: &mut State,
) -> Result<()> {
    let dir = root.join(rel);
    let mut names: Vec<_> = fs::read_dir(&dir)
        .map_err(|e| Error::io("readdir", &dir, e))?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<std::io::Result<_>>()
        .map_err(|e| Error::io("readdir", &dir, e))?;
    names.sort();
    for name in names {
        if let Some(skip) = skip
            && skip(&name.to_string_lossy())
        {
            continue;
        }
        let child_rel = rel.join(&name);
        let path = root.join(&child_rel);
        let m = fs::symlink_metadata(&path).map_err(|e| Error::io("lstat", &path, e))?;
        let ft = m.file_type();
        if ft.is_socket() {
            continue;
        }
        let mut h = tar::Header::new_gnu();
        h.set_mode(m.mode() & 0o7777);
        h.set_uid(u64::from(m.uid()));
        h.set_gid(u64::from(m.gid()));
        h.set_mtime(m.mtime().max(0) as u64);
        h.set_size(0);
        let werr = |e: std::io::Error| Error::io("write archive entry for", &path, e);
        if !ft.is_symlink() {
            let xattrs: Vec<(String, Vec<u8>)> = fsutil::list_xattrs(&path)
                .into_iter()
                .filter(|k| !k.starts_with("user.overlay.") && !k.starts_with("trusted."))
                .filter_map(|k| fsutil::get_xattr(&path, &k).map(|v| (k, v)))
                .collect();
            if !xattrs.is_empty() {
                let keys: Vec<(String, &[u8])> = xattrs
                    .iter()
                    .map(|(k, v)| (format!("SCHILY.xattr.{k}"), v.as_slice()))
                    .collect();
                b.append_pax_extensions(keys.iter().map(|(k, v)| (k.as_str(), *v)))
                    .map_err(werr)?;
            }
        }
        st.packed.entries += 1;
        if ft.is_dir() {
            h.set_entry_type(tar::EntryType::Directory);
            b.append_data(&mut h, &child_rel, std::io::empty())
                .map_err(werr)?;
            if fsutil::get_xattr(&path, OPAQUE_XATTR).as_deref() == Some(b"y") {
                let mut o = tar::Header::new_gnu();
                o.set_entry_type(tar::EntryType::Regular);
                o.set_mode(0o600);
                o.set_size(0);
                b.append_data(
                    &mut o,
                    child_rel.join(crate::unpack::OPAQUE_MARKER),
                    std::io::empty(),
                )
                .map_err(werr)?;
            }
            walk(b, root, &child_rel, None, st)?;
        } else if ft.is_symlink() {
            let target = fs::read_link(&path).map_err(|e| Error::io("readlink", &path, e))?;
            h.set_entry_type(tar::EntryType::Symlink);
            b.append_link(&mut h, &child_rel, &target).map_err(werr)?;
        } else if ft.is_file() {
            if m.nlink() > 1 {
                let key = (m.dev(), m.ino());
                if let Some(first) = st.links.get(&key) {
                    h.set_entry_type(tar::EntryType::Link);
                    b.append_link(&mut h, &child_rel, first).map_err(werr)?;
                    continue;
                }
                st.links.insert(key, child_rel.clone());
            }
            let f = fs::File::open(&path).map_err(|e| Error::io("open", &path, e))?;
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(m.len());
            b.append_data(&mut h, &child_rel, f).map_err(werr)?;
            st.packed.bytes += m.len();
        } else {
            let (ty, major, minor) = if ft.is_fifo() {
                (tar::EntryType::Fifo, 0, 0)
            } else {
                let dev = m.rdev();
                let kind = if ft.is_char_device() {
                    tar::EntryType::Char
                } else {
                    tar::EntryType::Block
                };
                (kind, libc::major(dev), libc::minor(dev))
            };
            h.set_entry_type(ty);
            h.set_device_major(major).map_err(werr)?;
            h.set_device_minor(minor).map_err(werr)?;
            b.append_data(&mut h, &child_rel, std::io::empty())
                .map_err(werr)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        if !cubicle_syscalls::is_root() {
            eprintln!("skipped: needs root (owners, device nodes)");
            return;
        }
        let base = std::env::temp_dir().join(format!("cubicle-pack-{}", std::process::id()));
        let src = base.join("src");
        let _ = fsutil::remove_tree(&base);
        fs::create_dir_all(src.join("d/e")).unwrap();
        fs::write(src.join("d/f"), b"data").unwrap();
        fs::hard_link(src.join("d/f"), src.join("d/g")).unwrap();
        std::os::unix::fs::symlink("../x", src.join("d/l")).unwrap();
        fsutil::mknod(&src.join("wh"), libc::S_IFCHR, 0, 0).unwrap();
        fsutil::set_xattr(&src.join("d/e"), OPAQUE_XATTR, b"y").unwrap();
        fsutil::set_xattr(&src.join("d/f"), "user.note", b"hi").unwrap();
        fsutil::lchown(&src.join("d/f"), 1_000_123, 1_000_124).unwrap();
        std::os::unix::net::UnixListener::bind(src.join("sock")).unwrap();
        fs::write(src.join("skipme"), b"x").unwrap();
        let (tar, packed) = pack_tree(&src, Vec::new(), &|n| n == "skipme").unwrap();
        assert!(packed.entries >= 6);
        let dst = base.join("dst");
        fs::create_dir_all(&dst).unwrap();
        crate::unpack::unpack_layer(&tar[..], &dst).unwrap();
        assert_eq!(fs::read(dst.join("d/f")).unwrap(), b"data");
        let (mf, mg) = (
            fs::metadata(dst.join("d/f")).unwrap(),
            fs::metadata(dst.join("d/g")).unwrap(),
        );
        assert_eq!(mf.ino(), mg.ino(), "hard link kept");
        assert_eq!((mf.uid(), mf.gid()), (1_000_123, 1_000_124));
        assert_eq!(
            fs::read_link(dst.join("d/l")).unwrap(),
            PathBuf::from("../x")
        );
        let wh = fs::symlink_metadata(dst.join("wh")).unwrap();
        assert!(wh.file_type().is_char_device() && wh.rdev() == 0);
        assert_eq!(
            fsutil::get_xattr(&dst.join("d/e"), OPAQUE_XATTR).as_deref(),
            Some(&b"y"[..])
        );
        assert_eq!(
            fsutil::get_xattr(&dst.join("d/f"), "user.note").as_deref(),
            Some(&b"hi"[..])
        );
        assert!(!dst.join("sock").exists() && !dst.join("skipme").exists());
        assert!(!dst.join("d/e").join(crate::unpack::OPAQUE_MARKER).exists());
        // Same tree, same bytes.
        let (again, _) = pack_tree(&src, Vec::new(), &|n| n == "skipme").unwrap();
        assert_eq!(tar, again);
        fsutil::remove_tree(&base).unwrap();
    }
}
