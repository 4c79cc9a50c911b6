//! What E2B's builder adds to an image so that the SDKs work in any template, written as
//! one small layer on top of the image's:
//!
//! - a user `user` (uid and gid 1000 when free, else the next free id ≥ 1000) with home
//!   `/home/user` (created, owned by it) and an empty password, in the group `sudo` when
//!   the image has one, with passwordless sudo (`/etc/sudoers.d/cubicle-user`) when the
//!   image has `/etc/sudoers.d`;
//! - nothing else: envd is not copied in (the node bind-mounts the host's static envd into
//!   every sandbox, so images without a shell or a libc still run it), and `PATH`, the
//!   default user and workdir are the template's config (see `build/`).
//!
//! The image's own files are read through a [`LayerView`]; files that change
//! (`/etc/passwd`, `/etc/group`, `/etc/shadow`) are written whole into the new layer with
//! the image's mode and owner, and every directory the layer holds copies the mode and
//! owner the image gives it (an overlay shows the topmost copy of a directory's
//! attributes). When `/etc` or `/home` is not a plain directory in the image (a symlink,
//! say), that part is skipped and said in the returned notes.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use crate::error::{IoContext, Result};
use crate::fsutil;
use crate::view::LayerView;

/// Version of what this module adds (part of every build cache key built on it).
pub const VERSION: &str = "provision/1";
/// The user E2B's SDKs run as by default.
pub const USER: &str = "user";
/// Its home.
pub const HOME: &str = "/home/user";

/// What provisioning did (for the build log).
#[derive(Debug, Default, Clone)]
pub struct Provisioned {
    /// One line per change or skipped part.
    pub notes: Vec<String>,
    /// The user's uid and gid.
    pub uid: u32,
    /// Gid of its group.
    pub gid: u32,
    /// Whether the layer holds anything (an image that has everything needs nothing).
    pub changed: bool,
}

/// A line of a colon-separated database (`/etc/passwd`, `/etc/group`).
fn fields(line: &str) -> Vec<&str> {
    line.split(':').collect()
}

fn ids_in_use(text: &str, col: usize) -> Vec<u32> {
    text.lines()
        .filter_map(|l| fields(l).get(col).and_then(|f| f.parse().ok()))
        .collect()
}

fn free_id(used: &[u32], want: u32) -> u32 {
    (want..60000).find(|i| !used.contains(i)).unwrap_or(want)
}

/// Make `dir` (absolute in the image, e.g. `/etc`) exist in `layer` as a copy of the
/// image's directory attributes; `false` if the image has it as something else.
fn mirror_dir(view: &LayerView, layer: &Path, dir: &str) -> Result<bool> {
    let mut cur = String::new();
    for c in dir.split('/').filter(|c| !c.is_empty()) {
        cur.push('/');
        cur.push_str(c);
        let target = layer.join(cur.trim_start_matches('/'));
        match view.resolve(&cur, false) {
            Some((real, f)) if f.meta.is_dir() && real == cur => {
                if !target.is_dir() {
                    fs::create_dir(&target).ctx("mkdir", &target)?;
                    fsutil::lchown(&target, f.meta.uid(), f.meta.gid())?;
                    fs::set_permissions(
                        &target,
                        fs::Permissions::from_mode(f.meta.mode() & 0o7777),
                    )
                    .ctx("chmod", &target)?;
                }
            }
            Some(_) => return Ok(false), // a symlink or a file where a directory should be
            None => {
                if !target.is_dir() {
                    fs::create_dir(&target).ctx("mkdir", &target)?;
                    fs::set_permissions(&target, fs::Permissions::from_mode(0o755))
                        .ctx("chmod", &target)?;
                }
            }
        }
    }
    Ok(true)
}

/// Write `/etc/<name>` into the layer with `text`, keeping the image's mode and owner.
fn write_etc(
    view: &LayerView,
    layer: &Path,
    name: &str,
    text: &str,
    default_mode: u32,
) -> Result<()> {
    let path = layer.join("etc").join(name);
    fs::write(&path, text).ctx("write", &path)?;
    let (mode, uid, gid) = match view.resolve(&format!("/etc/{name}"), true) {
        Some((_, f)) => (f.meta.mode() & 0o7777, f.meta.uid(), f.meta.gid()),
        None => (default_mode, 0, 0),
    };
    fsutil::lchown(&path, uid, gid)?;
    fs::set_permissions(&path, fs::Permissions::from_mode(mode)).ctx("chmod", &path)
}

/// Write the additions for the image `view` into the empty layer directory `layer`.
pub fn provision(view: &LayerView, layer: &Path) -> Result<Provisioned> {
    let mut out = Provisioned::default();
    let passwd = view.read_to_string("/etc/passwd").unwrap_or_default();
    let group = view.read_to_string("/etc/group").unwrap_or_default();
    let existing = passwd
        .lines()
        .map(fields)
        .find(|f| f.first() == Some(&USER) && f.len() >= 7);
    let shell = ["/bin/bash", "/bin/sh"]
        .into_iter()
        .find(|s| view.exists(s))
        .unwrap_or("/bin/sh");

    let etc_ok = mirror_dir(view, layer, "/etc")?;
    if let Some(f) = existing {
        out.uid = f[2].parse().unwrap_or(1000);
        out.gid = f[3].parse().unwrap_or(out.uid);
        out.notes
            .push(format!("user '{USER}' exists (uid {})", out.uid));
    } else if !etc_ok {
        out.notes.push(format!(
            "/etc is not a directory in the image: no user '{USER}' added"
        ));
        out.uid = 1000;
        out.gid = 1000;
    } else {
        let group_line = group
            .lines()
            .map(fields)
            .find(|f| f.first() == Some(&USER) && f.len() >= 3);
        let uid = free_id(&ids_in_use(&passwd, 2), 1000);
        let gid = match &group_line {
            Some(f) => f[2].parse().unwrap_or(uid),
            None => free_id(&ids_in_use(&group, 2), uid),
        };
        (out.uid, out.gid) = (uid, gid);
        let mut p = passwd.clone();
        if !p.is_empty() && !p.ends_with('\n') {
            p.push('\n');
        }
        p.push_str(&format!("{USER}:x:{uid}:{gid}::{HOME}:{shell}\n"));
        write_etc(view, layer, "passwd", &p, 0o644)?;

        let mut g = String::new();
        let mut has_sudo = false;
        for line in group.lines() {
            let f = fields(line);
            if f.first() == Some(&"sudo") && f.len() >= 4 {
                has_sudo = true;
                let members = f[3];
                if members.split(',').any(|m| m == USER) {
                    g.push_str(line);
                } else if members.is_empty() {
                    g.push_str(&format!("{line}{USER}"));
                } else {
                    g.push_str(&format!("{line},{USER}"));
                }
            } else {
                g.push_str(line);
            }
            g.push('\n');
        }
        if group_line.is_none() {
            g.push_str(&format!("{USER}:x:{gid}:\n"));
        }
        write_etc(view, layer, "group", &g, 0o644)?;
        if let Some(shadow) = view.read_to_string("/etc/shadow") {
            let mut s = shadow;
            if !s.is_empty() && !s.ends_with('\n') {
                s.push('\n');
            }
            // An empty password field: `passwd -d`, as E2B's builder does.
            s.push_str(&format!("{USER}::19000:0:99999:7:::\n"));
            write_etc(view, layer, "shadow", &s, 0o640)?;
        }
        out.notes.push(format!(
            "added user '{USER}' (uid {uid}, gid {gid}, shell {shell}{})",
            if has_sudo { ", group sudo" } else { "" }
        ));
        out.changed = true;
    }

    if etc_ok && view.is_dir("/etc/sudoers.d") && !view.exists("/etc/sudoers.d/cubicle-user") {
        mirror_dir(view, layer, "/etc/sudoers.d")?;
        let path = layer.join("etc/sudoers.d/cubicle-user");
        fs::write(&path, format!("{USER} ALL=(ALL:ALL) NOPASSWD: ALL\n")).ctx("write", &path)?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o440)).ctx("chmod", &path)?;
        out.notes.push(format!("passwordless sudo for '{USER}'"));
        out.changed = true;
    }

    if !view.exists(HOME) {
        if mirror_dir(view, layer, "/home")? {
            let home = layer.join("home/user");
            fs::create_dir(&home).ctx("mkdir", &home)?;
            fsutil::lchown(&home, out.uid, out.gid)?;
            fs::set_permissions(&home, fs::Permissions::from_mode(0o755)).ctx("chmod", &home)?;
            out.notes.push(format!("created {HOME}"));
            out.changed = true;
        } else {
            out.notes
                .push(format!("/home is not a directory in the image: no {HOME}"));
        }
    }
    if !out.changed {
        // Nothing added: drop the directories mirrored on the way.
        for e in fs::read_dir(layer).ctx("readdir", layer)?.flatten() {
            fsutil::remove_tree(&e.path())?;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_user_sudo_and_home_to_a_bare_image() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: provisioning sets owners and needs root");
            return;
        }
        let root = std::env::temp_dir().join(format!("cubicle-prov-{}", std::process::id()));
        let _ = fsutil::remove_tree(&root);
        let (img, layer) = (root.join("img"), root.join("layer"));
        fs::create_dir_all(img.join("etc/sudoers.d")).unwrap();
        fs::create_dir_all(img.join("bin")).unwrap();
        fs::create_dir_all(&layer).unwrap();
        fs::set_permissions(img.join("etc"), fs::Permissions::from_mode(0o751)).unwrap();
        fs::write(
            img.join("etc/passwd"),
            "root:x:0:0::/root:/bin/sh\nbob:x:1000:1000::/home/bob:/bin/sh\n",
        )
        .unwrap();
        fs::write(
            img.join("etc/group"),
            "root:x:0:\nsudo:x:27:\nbob:x:1000:\n",
        )
        .unwrap();
        fs::write(img.join("bin/sh"), "").unwrap();
        let view = LayerView::new(vec![img.clone()]);
        let p = provision(&view, &layer).unwrap();
        assert_eq!((p.uid, p.gid), (1001, 1001));
        let passwd = fs::read_to_string(layer.join("etc/passwd")).unwrap();
        assert!(
            passwd.ends_with("user:x:1001:1001::/home/user:/bin/sh\n"),
            "{passwd}"
        );
        let group = fs::read_to_string(layer.join("etc/group")).unwrap();
        assert!(
            group.contains("sudo:x:27:user\n") && group.contains("user:x:1001:\n"),
            "{group}"
        );
        assert!(layer.join("etc/sudoers.d/cubicle-user").is_file());
        assert_eq!(fs::metadata(layer.join("home/user")).unwrap().uid(), 1001);
        // /etc in the layer keeps the image's mode (the overlay shows the top copy).
        assert_eq!(
            fs::metadata(layer.join("etc")).unwrap().mode() & 0o7777,
            0o751
        );

        // An image that has all of it gets an empty layer.
        let layer2 = root.join("layer2");
        fs::create_dir_all(&layer2).unwrap();
        let view2 = LayerView::new(vec![img, layer.clone()]);
        let p2 = provision(&view2, &layer2).unwrap();
        assert!(!p2.changed);
        assert!(fs::read_dir(&layer2).unwrap().next().is_none());
        fsutil::remove_tree(&root).unwrap();
    }
}
