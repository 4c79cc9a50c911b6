//! Users and groups of the sandbox, read straight from `/etc/passwd` and `/etc/group`.
//!
//! envd is linked statically and runs in any root filesystem, so it never goes through
//! NSS: it parses the two files itself on every lookup (they are small, and an agent may
//! `useradd` at any time).

use std::path::PathBuf;

/// One account of the sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
    pub shell: String,
}

impl User {
    /// All group ids the user belongs to (primary first), for `setgroups`.
    pub fn groups(&self) -> Vec<u32> {
        let mut out = vec![self.gid];
        if let Ok(text) = std::fs::read_to_string(group_file()) {
            for g in text.lines().filter_map(parse_group) {
                if g.members.iter().any(|m| m == &self.name) && !out.contains(&g.gid) {
                    out.push(g.gid);
                }
            }
        }
        out
    }
}

struct Group {
    name: String,
    gid: u32,
    members: Vec<String>,
}

fn passwd_file() -> PathBuf {
    std::env::var_os("CUBICLE_ENVD_PASSWD")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/etc/passwd".into())
}

fn group_file() -> PathBuf {
    std::env::var_os("CUBICLE_ENVD_GROUP")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/etc/group".into())
}

fn parse_passwd(line: &str) -> Option<User> {
    if line.starts_with('#') {
        return None;
    }
    let f: Vec<&str> = line.split(':').collect();
    if f.len() < 7 {
        return None;
    }
    Some(User {
        name: f[0].to_string(),
        uid: f[2].parse().ok()?,
        gid: f[3].parse().ok()?,
        home: PathBuf::from(if f[5].is_empty() { "/" } else { f[5] }),
        shell: f[6].to_string(),
    })
}

fn parse_group(line: &str) -> Option<Group> {
    if line.starts_with('#') {
        return None;
    }
    let f: Vec<&str> = line.split(':').collect();
    if f.len() < 4 {
        return None;
    }
    Some(Group {
        name: f[0].to_string(),
        gid: f[2].parse().ok()?,
        members: f[3]
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect(),
    })
}

fn users() -> Vec<User> {
    std::fs::read_to_string(passwd_file())
        .map(|t| t.lines().filter_map(parse_passwd).collect())
        .unwrap_or_default()
}

/// Looks a user up by name.
pub fn by_name(name: &str) -> Option<User> {
    users().into_iter().find(|u| u.name == name)
}

/// Looks a user up by uid.
pub fn by_uid(uid: u32) -> Option<User> {
    users().into_iter().find(|u| u.uid == uid)
}

/// The name of a uid, or the number as text when unknown.
/// Gid of the group `name`.
pub fn group_by_name(name: &str) -> Option<u32> {
    let text = std::fs::read_to_string(group_file()).ok()?;
    text.lines()
        .filter_map(parse_group)
        .find(|g| g.name == name)
        .map(|g| g.gid)
}

pub fn user_name(uid: u32) -> String {
    by_uid(uid)
        .map(|u| u.name)
        .unwrap_or_else(|| uid.to_string())
}

/// The name of a gid, or the number as text when unknown.
pub fn group_name(gid: u32) -> String {
    std::fs::read_to_string(group_file())
        .ok()
        .and_then(|t| {
            t.lines()
                .filter_map(parse_group)
                .find(|g| g.gid == gid)
                .map(|g| g.name)
        })
        .unwrap_or_else(|| gid.to_string())
}

/// The user envd itself runs as (used as the default in development mode).
pub fn current() -> User {
    // SAFETY: getuid/getgid cannot fail.
    let uid = unsafe { libc::getuid() };
    by_uid(uid).unwrap_or_else(|| User {
        name: uid.to_string(),
        uid,
        // SAFETY: as above.
        gid: unsafe { libc::getgid() },
        home: PathBuf::from("/"),
        shell: "/bin/sh".into(),
    })
}

/// Makes envd dumpable again after a credential change of one of its threads (file
/// operations as a user) or of a child still sharing its memory (the `vfork`-style spawn):
/// the kernel then resets the process-wide flag and never sets it back. envd was dumpable
/// before, and its sandbox's root may inspect it either way; but a checkpoint of a
/// sandbox that was itself restored from one needs it: CRIU checks from inside the
/// sandbox's user namespace that it can enter each process's namespaces, and a restored
/// process (its memory set up by CRIU outside that namespace) refuses that while it is
/// not dumpable.
pub fn restore_dumpable() {
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_passwd_lines() {
        let u = parse_passwd("user:x:1000:1000:User,,,:/home/user:/bin/bash").unwrap();
        assert_eq!(u.name, "user");
        assert_eq!(u.uid, 1000);
        assert_eq!(u.home, PathBuf::from("/home/user"));
        assert!(parse_passwd("broken:x:abc:1::/:/bin/sh").is_none());
        assert!(parse_passwd("# comment").is_none());
        let g = parse_group("sudo:x:27:user,other").unwrap();
        assert_eq!(g.gid, 27);
        assert_eq!(g.members, vec!["user", "other"]);
        assert_eq!(g.name, "sudo");
    }

    #[test]
    fn root_exists_on_host() {
        assert_eq!(by_uid(0).map(|u| u.name), Some("root".to_string()));
        assert_eq!(user_name(0), "root");
    }
}
