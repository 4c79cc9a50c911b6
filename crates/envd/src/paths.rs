//! Paths as clients give them, resolved as E2B's envd does: `~` and `~/x` expand to the
//! acting user's home; any other relative path resolves against the acting user's home
//! too (`files.write("a.txt", user="root")` is `/root/a.txt`); only an empty path (a
//! command without `cwd`, a listing of "") means the default workdir, else that home.
//! The result is cleaned lexically (`.`/`..`). NUL bytes are refused. Parent
//! directories created on a user's behalf belong to that user.

use std::{
    io,
    os::unix::fs::{DirBuilderExt, chown},
    path::{Component, Path, PathBuf},
};

use crate::{connect::ConnectError, state::Context, users::User};

/// Resolves a client path to an absolute, cleaned path.
pub fn resolve(ctx: &Context, user: &User, path: &str) -> Result<PathBuf, ConnectError> {
    if path.contains('\0') {
        return Err(ConnectError::invalid_argument("path contains a NUL byte"));
    }
    let expanded: PathBuf = if path.is_empty() {
        ctx.default_workdir().unwrap_or_else(|| user.home.clone())
    } else if path == "~" {
        user.home.clone()
    } else if let Some(rest) = path.strip_prefix("~/") {
        user.home.join(rest)
    } else if path.starts_with('/') {
        PathBuf::from(path)
    } else {
        user.home.join(path)
    };
    Ok(clean(&expanded))
}

/// Lexically cleans an absolute path: removes `.`, resolves `..` (never above `/`).
pub fn clean(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// `mkdir -p` that hands every directory it creates to `user`.
pub fn create_dirs_as(dir: &Path, user: &User) -> io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent() {
        create_dirs_as(parent, user)?;
    }
    match std::fs::DirBuilder::new().mode(0o755).create(dir) {
        Ok(()) => chown(dir, Some(user.uid), Some(user.gid)),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Config;

    fn ctx(workdir: Option<&str>) -> Context {
        Context::new(Config {
            dev: true,
            default_user: None,
            default_workdir: workdir.map(PathBuf::from),
            access_token: None,
        })
    }

    fn user() -> User {
        User {
            name: "u".into(),
            uid: 1000,
            gid: 1000,
            home: "/home/u".into(),
            shell: "/bin/sh".into(),
        }
    }

    #[test]
    fn resolves() {
        let c = ctx(None);
        assert_eq!(resolve(&c, &user(), "~").unwrap(), PathBuf::from("/home/u"));
        assert_eq!(
            resolve(&c, &user(), "~/a/b").unwrap(),
            PathBuf::from("/home/u/a/b")
        );
        assert_eq!(
            resolve(&c, &user(), "x").unwrap(),
            PathBuf::from("/home/u/x")
        );
        assert_eq!(
            resolve(&c, &user(), "/a/../../etc/./p").unwrap(),
            PathBuf::from("/etc/p")
        );
        assert!(resolve(&c, &user(), "/a\0b").is_err());
        assert_eq!(resolve(&c, &user(), "").unwrap(), PathBuf::from("/home/u"));
        // A default workdir is where an empty path (a command without cwd) points;
        // relative paths still follow the acting user's home, as in E2B's envd.
        let c = ctx(Some("/work"));
        assert_eq!(resolve(&c, &user(), "").unwrap(), PathBuf::from("/work"));
        assert_eq!(
            resolve(&c, &user(), "x/../y").unwrap(),
            PathBuf::from("/home/u/y")
        );
        let root = User {
            name: "root".into(),
            uid: 0,
            gid: 0,
            home: "/root".into(),
            shell: "/bin/sh".into(),
        };
        assert_eq!(
            resolve(&c, &root, "hello.txt").unwrap(),
            PathBuf::from("/root/hello.txt")
        );
    }
}
