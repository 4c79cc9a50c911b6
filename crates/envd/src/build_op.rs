//! `cubicle-envd --build-op JSON`: the file operations of template builds, run by the
//! node as root inside a build sandbox (envd is there already, static, so this works in
//! images without a shell or a libc). Running them inside the sandbox means paths,
//! symlinks and user names resolve exactly as the image defines them, and a hostile build
//! context can only ever touch the sandbox.
//!
//! - `{"op":"mkdir","path":P,"owner":U}`: `mkdir -p P`, the directories it creates owned
//!   by U (a `WORKDIR` the image lacks).
//! - `{"op":"copy","archive":A,"src":S,"dest":D,"owner":O,"mode":M,"workdir":W}`: E2B's
//!   COPY. A is the uploaded context (a tar, gzipped or not); S the source as the SDK
//!   wrote it (its entries are named relative to the context; a glob's fixed prefix
//!   names what to take). A directory's contents are merged into D; a file or symlink
//!   goes to D (or into D when D ends with `/` or is a directory). Everything copied is
//!   owned by O (`user`, `user:group`, numeric ids; default the build's user) and, with
//!   M (octal), gets that mode. A relative D is relative to W (or the owner's home).

use std::fs;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;

use crate::users;

#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
enum Op {
    Mkdir {
        path: String,
        #[serde(default)]
        owner: String,
    },
    Copy {
        archive: PathBuf,
        src: String,
        dest: String,
        #[serde(default)]
        owner: String,
        #[serde(default)]
        mode: String,
        #[serde(default)]
        workdir: String,
    },
}

/// Run the operation described by `json`; the error says what failed.
pub fn run(json: &str) -> Result<(), String> {
    let op: Op = serde_json::from_str(json).map_err(|e| format!("bad build operation: {e}"))?;
    match op {
        Op::Mkdir { path, owner } => {
            let (uid, gid) = owner_ids(&owner)?;
            mkdir_p(Path::new(&path), Some((uid, gid)))
        }
        Op::Copy {
            archive,
            src,
            dest,
            owner,
            mode,
            workdir,
        } => copy(&archive, &src, &dest, &owner, &mode, &workdir),
    }
}

/// `user`, `user:group`, `1000`, `1000:1000` → ids (empty: root).
fn owner_ids(owner: &str) -> Result<(u32, u32), String> {
    if owner.is_empty() {
        return Ok((0, 0));
    }
    let (u, g) = match owner.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (owner, None),
    };
    let user = users::by_name(u);
    let uid = match (u.parse::<u32>(), &user) {
        (Ok(n), _) => n,
        (_, Some(usr)) => usr.uid,
        _ => {
            return Err(format!(
                "unknown user '{u}' (not in the image's /etc/passwd)"
            ));
        }
    };
    let gid = match g {
        None => user.map(|u| u.gid).unwrap_or(uid),
        Some(g) => match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => users::group_by_name(g)
                .ok_or_else(|| format!("unknown group '{g}' (not in the image's /etc/group)"))?,
        },
    };
    Ok((uid, gid))
}

/// `mkdir -p`; directories it creates get `owner`.
fn mkdir_p(path: &Path, owner: Option<(u32, u32)>) -> Result<(), String> {
    let mut cur = PathBuf::from("/");
    for c in path.components() {
        if let Component::Normal(n) = c {
            cur.push(n);
            if fs::metadata(&cur).is_ok_and(|m| m.is_dir()) {
                continue;
            }
            fs::create_dir(&cur).map_err(|e| format!("mkdir {}: {e}", cur.display()))?;
            if let Some((u, g)) = owner {
                std::os::unix::fs::lchown(&cur, Some(u), Some(g))
                    .map_err(|e| format!("chown {}: {e}", cur.display()))?;
            }
        }
    }
    Ok(())
}

/// The fixed part of a source pattern: the components before the first with a glob
/// character (`*?[`), `.` and empty ones dropped.
fn fixed_prefix(src: &str) -> Result<PathBuf, String> {
    let mut out = PathBuf::new();
    for c in Path::new(src).components() {
        match c {
            Component::Normal(n) => {
                let s = n.to_string_lossy();
                if s.contains(['*', '?', '[']) {
                    break;
                }
                out.push(n);
            }
            Component::CurDir => {}
            _ => return Err(format!("source '{src}' must be relative to the context")),
        }
    }
    Ok(out)
}

fn chown_chmod_tree(path: &Path, ids: (u32, u32), mode: Option<u32>) -> Result<(), String> {
    let m = fs::symlink_metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    std::os::unix::fs::lchown(path, Some(ids.0), Some(ids.1))
        .map_err(|e| format!("chown {}: {e}", path.display()))?;
    if m.file_type().is_symlink() {
        return Ok(());
    }
    if let Some(mode) = mode {
        fs::set_permissions(path, fs::Permissions::from_mode(mode))
            .map_err(|e| format!("chmod {}: {e}", path.display()))?;
    }
    if m.is_dir() {
        for e in fs::read_dir(path).map_err(|e| format!("{}: {e}", path.display()))? {
            let e = e.map_err(|e| format!("{}: {e}", path.display()))?;
            chown_chmod_tree(&e.path(), ids, mode)?;
        }
    }
    Ok(())
}

/// Move `src` to `dst`, merging directories into existing ones.
fn merge(src: &Path, dst: &Path) -> Result<(), String> {
    let s_dir = fs::symlink_metadata(src)
        .map(|m| m.is_dir())
        .unwrap_or(false);
    match fs::metadata(dst) {
        Ok(m) if m.is_dir() && s_dir => {
            for e in fs::read_dir(src).map_err(|e| format!("{}: {e}", src.display()))? {
                let e = e.map_err(|e| format!("{}: {e}", src.display()))?;
                merge(&e.path(), &dst.join(e.file_name()))?;
            }
            Ok(())
        }
        Ok(m) => {
            if m.is_dir() {
                fs::remove_dir_all(dst).map_err(|e| format!("replace {}: {e}", dst.display()))?;
            } else {
                fs::remove_file(dst).map_err(|e| format!("replace {}: {e}", dst.display()))?;
            }
            fs::rename(src, dst).map_err(|e| format!("move to {}: {e}", dst.display()))
        }
        Err(_) => {
            if let Ok(m) = fs::symlink_metadata(dst)
                && m.file_type().is_symlink()
            {
                fs::remove_file(dst).map_err(|e| format!("replace {}: {e}", dst.display()))?;
            }
            fs::rename(src, dst).map_err(|e| format!("move to {}: {e}", dst.display()))
        }
    }
}

fn copy(
    archive: &Path,
    src: &str,
    dest: &str,
    owner: &str,
    mode: &str,
    workdir: &str,
) -> Result<(), String> {
    let ids = owner_ids(owner)?;
    let mode = if mode.is_empty() {
        None
    } else {
        Some(u32::from_str_radix(mode, 8).map_err(|_| format!("mode '{mode}' is not octal"))?)
    };
    let base = if dest.starts_with('/') {
        PathBuf::new()
    } else if !workdir.is_empty() {
        PathBuf::from(workdir)
    } else {
        let user = owner.split(':').next().unwrap_or("");
        users::by_name(user)
            .map(|u| u.home)
            .unwrap_or_else(|| PathBuf::from("/"))
    };
    let target = base.join(dest);
    let into_dir = dest.ends_with('/') || fs::metadata(&target).is_ok_and(|m| m.is_dir());

    // Unpack next to where the files go (same filesystem: moves are renames).
    let scratch = PathBuf::from(format!("/.cubicle-copy-{}", std::process::id()));
    let _ = fs::remove_dir_all(&scratch);
    fs::create_dir(&scratch).map_err(|e| format!("mkdir {}: {e}", scratch.display()))?;
    let result = (|| {
        let f = fs::File::open(archive).map_err(|e| format!("open the uploaded files: {e}"))?;
        let mut r = BufReader::with_capacity(1 << 20, f);
        let gz = r
            .fill_buf()
            .map(|b| b.starts_with(&[0x1f, 0x8b]))
            .unwrap_or(false);
        let reader: Box<dyn Read> = if gz {
            Box::new(flate2::read::MultiGzDecoder::new(r))
        } else {
            Box::new(r)
        };
        let mut ar = tar::Archive::new(reader);
        ar.set_preserve_permissions(true);
        ar.set_preserve_mtime(true);
        ar.set_overwrite(true);
        ar.unpack(&scratch)
            .map_err(|e| format!("unpacking the uploaded files: {e}"))?;
        let prefix = fixed_prefix(src)?;
        let entry = scratch.join(&prefix);
        let m = fs::symlink_metadata(&entry).map_err(|_| {
            format!(
                "'{src}' is not in the uploaded files (were they uploaded from another context?)"
            )
        })?;
        if m.is_dir() {
            mkdir_p(&target, None)?;
            for e in fs::read_dir(&entry).map_err(|e| format!("{}: {e}", entry.display()))? {
                let e = e.map_err(|e| format!("{}: {e}", entry.display()))?;
                chown_chmod_tree(&e.path(), ids, mode)?;
                merge(&e.path(), &target.join(e.file_name()))?;
            }
        } else {
            let to = if into_dir {
                target.join(entry.file_name().unwrap_or_default())
            } else {
                target.clone()
            };
            if let Some(parent) = to.parent() {
                mkdir_p(parent, None)?;
            }
            chown_chmod_tree(&entry, ids, mode)?;
            merge(&entry, &to)?;
        }
        Ok(())
    })();
    let _ = fs::remove_dir_all(&scratch);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes() {
        assert_eq!(fixed_prefix("d").unwrap(), PathBuf::from("d"));
        assert_eq!(fixed_prefix("./src/*.js").unwrap(), PathBuf::from("src"));
        assert_eq!(fixed_prefix("*.txt").unwrap(), PathBuf::from(""));
        assert!(fixed_prefix("../x").is_err());
        assert!(fixed_prefix("/etc").is_err());
        assert_eq!(owner_ids("12:34").unwrap(), (12, 34));
        assert_eq!(owner_ids("").unwrap(), (0, 0));
        assert!(owner_ids("no-such-user-here").is_err());
    }
}
