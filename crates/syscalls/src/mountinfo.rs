//! The mount table of this process's mount namespace (`/proc/self/mountinfo`).

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// One mount (one line of `/proc/self/mountinfo`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// The superblock's device number, `major:minor`: equal for two mounts of one
    /// filesystem instance.
    pub dev: String,
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// Per-mount options (`ro,nosuid,…`).
    pub options: String,
    /// Filesystem type (`xfs`, `cgroup2`, …).
    pub fstype: String,
    /// The mount source (a device, or what the filesystem says).
    pub source: String,
    /// Per-superblock options (`rw,prjquota`, a cgroup v1 hierarchy's controllers, …).
    pub super_options: String,
}

impl Mount {
    /// Whether `option` is one of the per-mount options.
    pub fn has_option(&self, option: &str) -> bool {
        self.options.split(',').any(|o| o == option)
    }

    /// Whether `option` is one of the per-superblock options.
    pub fn has_super_option(&self, option: &str) -> bool {
        self.super_options.split(',').any(|o| o == option)
    }
}

/// The mounts of this process's mount namespace, in mount order.
pub fn mounts() -> io::Result<Vec<Mount>> {
    Ok(parse(&std::fs::read_to_string("/proc/self/mountinfo")?))
}

/// Parses mountinfo text (malformed lines are skipped).
pub fn parse(text: &str) -> Vec<Mount> {
    text.lines().filter_map(parse_line).collect()
}

/// `<id> <parent> <maj:min> <root> <mount point> <options> [optional…] - <type> <source> <super options>`
fn parse_line(line: &str) -> Option<Mount> {
    let (left, right) = line.split_once(" - ")?;
    let mut left = left.split(' ').skip(2);
    let (dev, mount_point, options) = (left.next()?, left.nth(1)?, left.next()?);
    let mut right = right.split(' ');
    let (fstype, source, super_options) = (right.next()?, right.next()?, right.next()?);
    Some(Mount {
        dev: dev.to_string(),
        mount_point: PathBuf::from(OsStr::from_bytes(&unescape(mount_point))),
        options: options.to_string(),
        fstype: fstype.to_string(),
        source: String::from_utf8_lossy(&unescape(source)).into_owned(),
        super_options: super_options.to_string(),
    })
}

/// Decodes the octal escapes (`\040` for a space) mountinfo uses in paths.
fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 4 <= b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

/// The mount `path` lives on: the last-mounted one whose mount point is its deepest
/// prefix.
pub fn mount_of(path: &Path) -> io::Result<Option<Mount>> {
    Ok(mounts()?
        .into_iter()
        .filter(|m| path.starts_with(&m.mount_point))
        .max_by_key(|m| m.mount_point.components().count()))
}

/// Whether something is mounted at `path`.
pub fn is_mount_point(path: &Path) -> io::Result<bool> {
    Ok(mounts()?.iter().any(|m| m.mount_point == path))
}

/// Mount points at or below `dir`, deepest first (each once).
pub fn mounts_under(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut out: Vec<PathBuf> = mounts()?
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(dir))
        .collect();
    out.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    out.dedup();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 1 0:21 / /proc rw,nosuid - proc proc rw
30 25 0:26 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
41 1 7:0 / /var/lib/a\\040b rw,noatime shared:1 - xfs /dev/loop0 rw,prjquota
garbage line
";

    #[test]
    fn parses_lines_and_escapes() {
        let m = parse(SAMPLE);
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].mount_point, Path::new("/proc"));
        assert_eq!(m[0].dev, "0:21");
        assert!(m[0].has_option("nosuid") && !m[0].has_option("nosu"));
        assert_eq!(m[2].options, "rw,noatime");
        assert_eq!(m[1].fstype, "cgroup");
        assert!(m[1].has_super_option("memory"));
        assert_eq!(m[2].mount_point, Path::new("/var/lib/a b"));
        assert_eq!(m[2].source, "/dev/loop0");
        assert!(m[2].has_super_option("prjquota") && !m[2].has_super_option("prj"));
        assert_eq!(unescape(r"/plain\04"), b"/plain\\04");
    }

    #[test]
    fn this_process_has_a_root_mount() {
        let m = mount_of(Path::new("/proc/self")).unwrap().unwrap();
        assert_eq!(m.mount_point, Path::new("/proc"));
        assert!(is_mount_point(Path::new("/")).unwrap());
        assert!(!mounts_under(Path::new("/proc")).unwrap().is_empty());
    }
}
