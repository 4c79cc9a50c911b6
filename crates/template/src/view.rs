//! A read-only view of a stack of layers as the overlay shows it, without mounting: which
//! layer holds a path (whiteouts and opaque directories respected) and what a file says.
//! Symlinks are followed inside the view (never out of it), as a process in the sandbox
//! would see them. Used on the host to read an image's `/etc/passwd` and friends.

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

use crate::unpack::OPAQUE_XATTR;

/// Layers, bottom first.
pub struct LayerView {
    layers: Vec<PathBuf>,
}

/// Where a path lives in the view.
#[derive(Debug, Clone)]
pub struct Found {
    /// The host path of the entry (in the topmost layer that has it).
    pub host: PathBuf,
    /// Its metadata (not following a final symlink).
    pub meta: fs::Metadata,
}

fn is_whiteout(m: &fs::Metadata) -> bool {
    m.file_type().is_char_device() && m.rdev() == 0
}

fn is_opaque(p: &Path) -> bool {
    crate::fsutil::get_xattr(p, OPAQUE_XATTR).as_deref() == Some(b"y")
}

impl LayerView {
    /// A view of `layers` (bottom first).
    pub fn new(layers: Vec<PathBuf>) -> Self {
        LayerView { layers }
    }

    /// The entry at the clean absolute path `rel` (components only, no symlink resolution
    /// of the last one; parents must be directories in the view).
    fn lookup_exact(&self, comps: &[String]) -> Option<Found> {
        // Walk top-down; a whiteout hides everything below; an opaque directory on the way
        // stops the search at its layer.
        'layers: for (i, layer) in self.layers.iter().enumerate().rev() {
            let mut p = layer.clone();
            for (k, c) in comps.iter().enumerate() {
                p.push(c);
                let Ok(m) = fs::symlink_metadata(&p) else {
                    continue 'layers;
                };
                if is_whiteout(&m) {
                    return None;
                }
                let last = k + 1 == comps.len();
                if last {
                    return Some(Found { host: p, meta: m });
                }
                if !m.is_dir() {
                    // A non-directory on the way hides the lower layers' directory.
                    return None;
                }
                if is_opaque(&p) && i > 0 {
                    // Nothing below this layer shows through here: finish in this layer.
                    let mut q = p.clone();
                    for c in &comps[k + 1..] {
                        q.push(c);
                    }
                    return match fs::symlink_metadata(&q) {
                        Ok(m) if !is_whiteout(&m) => Some(Found { host: q, meta: m }),
                        _ => None,
                    };
                }
            }
        }
        None
    }

    /// Resolve `path` (absolute inside the view), following symlinks inside the view.
    /// `follow_last`: also follow a final symlink.
    pub fn resolve(&self, path: &str, follow_last: bool) -> Option<(String, Found)> {
        let mut pending: Vec<String> = split(path);
        pending.reverse();
        let mut done: Vec<String> = Vec::new();
        let mut hops = 0;
        let mut last_found: Option<Found> = None;
        if pending.is_empty() {
            let root = self.layers.last()?.clone();
            let meta = fs::symlink_metadata(&root).ok()?;
            return Some(("/".into(), Found { host: root, meta }));
        }
        while let Some(c) = pending.pop() {
            if c == ".." {
                done.pop();
                continue;
            }
            done.push(c);
            let found = self.lookup_exact(&done)?;
            let is_last = pending.is_empty();
            if found.meta.file_type().is_symlink() && (!is_last || follow_last) {
                hops += 1;
                if hops > 40 {
                    return None;
                }
                let target = fs::read_link(&found.host).ok()?;
                let t = target.to_string_lossy().into_owned();
                done.pop();
                if t.starts_with('/') {
                    done.clear();
                }
                let mut more = split(&t);
                more.reverse();
                pending.extend(more);
                continue;
            }
            last_found = Some(found);
        }
        let found = last_found?;
        Some((format!("/{}", done.join("/")), found))
    }

    /// The text of the file at `path` (following symlinks), if it is a regular file.
    pub fn read_to_string(&self, path: &str) -> Option<String> {
        let (_, f) = self.resolve(path, true)?;
        if !f.meta.is_file() {
            return None;
        }
        fs::read_to_string(&f.host).ok()
    }

    /// Whether `path` exists (following symlinks).
    pub fn exists(&self, path: &str) -> bool {
        self.resolve(path, true).is_some()
    }

    /// Whether `path` is a directory (following symlinks).
    pub fn is_dir(&self, path: &str) -> bool {
        self.resolve(path, true)
            .is_some_and(|(_, f)| f.meta.is_dir())
    }
}

/// The normal components of `path` (`.` dropped, `..` kept for the resolver).
fn split(path: &str) -> Vec<String> {
    Path::new(path)
        .components()
        .filter_map(|c| match c {
            Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
            Component::ParentDir => Some("..".into()),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fsutil;

    #[test]
    fn whiteouts_opaque_and_symlinks() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: whiteouts are character devices and need root");
            return;
        }
        let root = std::env::temp_dir().join(format!("cubicle-view-{}", std::process::id()));
        let _ = fsutil::remove_tree(&root);
        let (l0, l1) = (root.join("l0"), root.join("l1"));
        for d in ["etc", "usr/lib", "var/cache"] {
            fs::create_dir_all(l0.join(d)).unwrap();
        }
        fs::write(l0.join("etc/passwd"), "root\n").unwrap();
        fs::write(l0.join("etc/motd"), "hi\n").unwrap();
        fs::write(l0.join("usr/lib/x"), "x\n").unwrap();
        fs::write(l0.join("var/cache/old"), "o\n").unwrap();
        std::os::unix::fs::symlink("usr/lib", l0.join("lib")).unwrap();
        fs::create_dir_all(l1.join("etc")).unwrap();
        fs::create_dir_all(l1.join("var/cache")).unwrap();
        fs::write(l1.join("etc/passwd"), "root\nuser\n").unwrap();
        fsutil::mknod(&l1.join("etc/motd"), libc::S_IFCHR, 0, 0).unwrap();
        fsutil::set_xattr(&l1.join("var/cache"), OPAQUE_XATTR, b"y").unwrap();
        fs::write(l1.join("var/cache/new"), "n\n").unwrap();

        let v = LayerView::new(vec![l0.clone(), l1.clone()]);
        assert_eq!(v.read_to_string("/etc/passwd").unwrap(), "root\nuser\n");
        assert!(!v.exists("/etc/motd"));
        assert_eq!(v.read_to_string("/lib/x").unwrap(), "x\n");
        assert_eq!(v.resolve("/lib/x", true).unwrap().0, "/usr/lib/x");
        assert!(!v.exists("/var/cache/old"));
        assert!(v.exists("/var/cache/new"));
        // Symlinks cannot lead out of the view.
        std::os::unix::fs::symlink("/../../../../etc/hostname", l1.join("esc")).unwrap();
        assert!(!v.exists("/esc"));
        fsutil::remove_tree(&root).unwrap();
    }
}
