//! Moving a checkpoint to another uid range (a fork, a sandbox made from a snapshot, a
//! resume on another slot): the user namespace's map in CRIU's images, and the owners of
//! the files in the sandbox's writable layer.
//!
//! Everything else in the images is relative to the sandbox's user namespace (CRIU
//! records task credentials as seen inside it), so it moves as is.

use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, lchown};
use std::path::Path;

use prost::Message;

use crate::error::{Error, Result};

/// Magic numbers at the head of every CRIU image (`IMG_COMMON_MAGIC`, then the type's).
const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
const USERNS_MAGIC: u32 = 0x5547_4906;

/// `uid_gid_extent` of CRIU's `userns.proto`.
#[derive(Clone, PartialEq, prost::Message)]
struct Extent {
    #[prost(uint32, required, tag = "1")]
    first: u32,
    #[prost(uint32, required, tag = "2")]
    lower_first: u32,
    #[prost(uint32, required, tag = "3")]
    count: u32,
}

/// `userns_entry`.
#[derive(Clone, PartialEq, prost::Message)]
struct UsernsEntry {
    #[prost(message, repeated, tag = "1")]
    uid_map: Vec<Extent>,
    #[prost(message, repeated, tag = "2")]
    gid_map: Vec<Extent>,
}

const UTSNS_MAGIC: u32 = 0x5447_3203;

/// `utsns_entry` of CRIU's `utsns.proto`.
#[derive(Clone, PartialEq, prost::Message)]
struct UtsnsEntry {
    #[prost(string, required, tag = "1")]
    nodename: String,
    #[prost(string, required, tag = "2")]
    domainname: String,
}

/// Sets the host name in every `utsns-*.img` of `dir` (a sandbox's host name is its id:
/// a copy under another id gets its own).
pub fn rewrite_hostname(dir: &Path, hostname: &str) -> Result<usize> {
    rewrite_images(dir, "utsns-", UTSNS_MAGIC, |body, bad| {
        let mut e = UtsnsEntry::decode(body).map_err(|e| bad(format!("undecodable entry: {e}")))?;
        e.nodename = hostname.to_string();
        Ok(e.encode_to_vec())
    })
}

/// Rewrites every `userns-*.img` in `dir` so that host ids `from..from+count` become
/// `to..to+count`.
pub fn rewrite_userns_images(dir: &Path, from: u32, to: u32, count: u32) -> Result<usize> {
    rewrite_images(dir, "userns-", USERNS_MAGIC, |body, bad| {
        let mut entry =
            UsernsEntry::decode(body).map_err(|e| bad(format!("undecodable entry: {e}")))?;
        for ext in entry.uid_map.iter_mut().chain(entry.gid_map.iter_mut()) {
            if ext.lower_first >= from && ext.lower_first - from < count {
                ext.lower_first = ext.lower_first - from + to;
            } else {
                return Err(bad(format!(
                    "map extent {} {} {} is outside the range at {from}",
                    ext.first, ext.lower_first, ext.count
                )));
            }
        }
        Ok(entry.encode_to_vec())
    })
}

type Bad<'a> = &'a dyn Fn(String) -> Error;

/// Rewrites each entry of every `<prefix>*.img` of type `magic` in `dir` with `edit`.
fn rewrite_images(
    dir: &Path,
    prefix: &str,
    magic: u32,
    edit: impl Fn(&[u8], Bad<'_>) -> Result<Vec<u8>>,
) -> Result<usize> {
    let mut n = 0;
    let rd = fs::read_dir(dir).map_err(|e| Error::io(format!("readdir {}", dir.display()), e))?;
    for e in rd {
        let e = e.map_err(|e| Error::io(format!("readdir {}", dir.display()), e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(prefix) && name.ends_with(".img") {
            rewrite_one(&e.path(), magic, &edit)?;
            n += 1;
        }
    }
    Ok(n)
}

/// Rewrites one protobuf entry of an image, given a way to report a bad one.
type EntryEdit<'a> = dyn Fn(&[u8], Bad<'_>) -> Result<Vec<u8>> + 'a;

fn rewrite_one(path: &Path, magic: u32, edit: &EntryEdit<'_>) -> Result<()> {
    let bad = |m: String| Error::Image {
        dir: path.to_path_buf(),
        message: m,
    };
    let data = fs::read(path).map_err(|e| Error::io(format!("read {}", path.display()), e))?;
    if data.len() < 8 {
        return Err(bad("image too short".into()));
    }
    let word = |i: usize| u32::from_le_bytes([data[i], data[i + 1], data[i + 2], data[i + 3]]);
    if word(0) != IMG_COMMON_MAGIC || word(4) != magic {
        return Err(bad(format!("not a CRIU image of type {magic:#x}")));
    }
    let mut out = data[..8].to_vec();
    let mut pos = 8;
    while pos < data.len() {
        if pos + 4 > data.len() {
            return Err(bad("truncated entry".into()));
        }
        let len = word(pos) as usize;
        pos += 4;
        let body = data
            .get(pos..pos + len)
            .ok_or_else(|| bad("truncated entry".into()))?;
        pos += len;
        let body = edit(body, &bad)?;
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
    }
    let tmp = path.with_extension("img.tmp");
    fs::write(&tmp, &out).map_err(|e| Error::io(format!("write {}", tmp.display()), e))?;
    fs::rename(&tmp, path).map_err(|e| Error::io(format!("rename {}", path.display()), e))
}

/// Gives every file below `dir` (itself included) whose owner or group is in
/// `from..from+count` the same id in `to..to+count`, keeping setuid/setgid bits (which a
/// chown clears). Returns how many entries changed.
pub fn rebase_owners(dir: &Path, from: u32, to: u32, count: u32) -> Result<u64> {
    let mut changed = 0;
    rebase_walk(dir, from, to, count, &mut changed)
        .map_err(|e| Error::io(format!("moving {} to uid range {to}", dir.display()), e))?;
    Ok(changed)
}

fn rebase_walk(p: &Path, from: u32, to: u32, count: u32, changed: &mut u64) -> io::Result<()> {
    let md = fs::symlink_metadata(p)?;
    let map = |id: u32| {
        if id >= from && id - from < count {
            Some(id - from + to)
        } else {
            None
        }
    };
    let (uid, gid) = (map(md.uid()), map(md.gid()));
    if uid.is_some() || gid.is_some() {
        lchown(p, uid, gid)?;
        *changed += 1;
        let special = md.mode() & 0o6000;
        if special != 0 && !md.file_type().is_symlink() {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(p, fs::Permissions::from_mode(md.mode() & 0o7777))?;
        }
    }
    if md.is_dir() {
        for e in fs::read_dir(p)? {
            rebase_walk(&e?.path(), from, to, count, changed)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(base: u32) -> Vec<u8> {
        let ext = Extent {
            first: 0,
            lower_first: base,
            count: 65536,
        };
        let e = UsernsEntry {
            uid_map: vec![ext.clone()],
            gid_map: vec![ext],
        };
        let body = e.encode_to_vec();
        let mut v = Vec::new();
        v.extend_from_slice(&IMG_COMMON_MAGIC.to_le_bytes());
        v.extend_from_slice(&USERNS_MAGIC.to_le_bytes());
        v.extend_from_slice(&(body.len() as u32).to_le_bytes());
        v.extend_from_slice(&body);
        v
    }

    #[test]
    fn userns_map_moves_to_the_new_range() {
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join("userns-13.img"), image(1_704_136_000)).unwrap();
        fs::write(d.path().join("core-1.img"), b"untouched").unwrap();
        assert_eq!(
            rewrite_userns_images(d.path(), 1_704_136_000, 1_710_689_600, 65536).unwrap(),
            1
        );
        assert_eq!(
            fs::read(d.path().join("userns-13.img")).unwrap(),
            image(1_710_689_600)
        );
        assert_eq!(fs::read(d.path().join("core-1.img")).unwrap(), b"untouched");
    }

    #[test]
    fn a_map_outside_the_range_is_refused() {
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join("userns-1.img"), image(500_000)).unwrap();
        assert!(rewrite_userns_images(d.path(), 1_000_000, 2_000_000, 65536).is_err());
    }
}
