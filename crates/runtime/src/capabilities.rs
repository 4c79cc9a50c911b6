//! Security policy: the capabilities a sandbox's root keeps.
//!
//! Root inside a sandbox is an unprivileged host uid with capabilities that only count
//! inside the sandbox's own user namespace. Even so, each capability is kernel attack
//! surface, so the bounding set is cut down to what package managers, `sudo` and ordinary
//! services need (close to Docker's default set). Everything else is dropped from the
//! bounding set before the init program is executed, so no process in the sandbox — not
//! even a setuid-root binary run by `user` — can ever hold it.
//!
//! Kept, and why:
//! - CHOWN, DAC_OVERRIDE, FOWNER, FSETID: root owning and fixing files (apt, dpkg, tar).
//! - KILL: root signalling other users' processes inside the sandbox.
//! - SETUID, SETGID: `sudo`, `su`, daemons dropping privileges; SETPCAP: drop own caps.
//! - NET_BIND_SERVICE: listening on ports < 1024 (the sandbox has its own netns).
//! - SYS_CHROOT: debootstrap/chroot-based build tools.
//! - AUDIT_WRITE: `sudo`/PAM write audit records (fails harmlessly otherwise).
//! - SETFCAP: dpkg sets file capabilities (e.g. on `ping`); namespaced (v3) fcaps only.
//! - MKNOD is NOT kept: device nodes cannot be opened from a user namespace anyway.
//! - NET_RAW is NOT kept: raw and packet sockets forge frames (ARP with any sender
//!   address filled the host's neighbour table). `ping` uses ICMP echo sockets instead,
//!   which the runtime allows for every group of the sandbox
//!   (`net.ipv4.ping_group_range` of its network namespace, set in `child.rs`), and
//!   templates lose file capabilities no process of a sandbox can hold
//!   ([`fit_file_capabilities`]: `ping`'s `cap_net_raw=ep` would make its `execve`
//!   fail).
//!
//! Dropped notably: NET_RAW (above), SYS_ADMIN (mounts, namespaces), NET_ADMIN (changing
//! addresses/routes inside the netns), SYS_PTRACE (ptrace across uids), SYS_MODULE, SYS_RAWIO, SYS_TIME,
//! SYS_BOOT, BPF, PERFMON, SYSLOG, DAC_READ_SEARCH (open_by_handle_at), MAC_*, IPC_LOCK,
//! SYS_RESOURCE (raising rlimits/cgroup-independent limits), SYS_NICE, LEASE, WAKE_ALARM,
//! BLOCK_SUSPEND, CHECKPOINT_RESTORE, LINUX_IMMUTABLE, SYS_PACCT, SYS_TTY_CONFIG.

/// Capability numbers (see `linux/capability.h`).
pub mod cap {
    pub const CHOWN: u32 = 0;
    pub const DAC_OVERRIDE: u32 = 1;
    pub const FOWNER: u32 = 3;
    pub const FSETID: u32 = 4;
    pub const KILL: u32 = 5;
    pub const SETGID: u32 = 6;
    pub const SETUID: u32 = 7;
    pub const SETPCAP: u32 = 8;
    pub const NET_BIND_SERVICE: u32 = 10;
    pub const NET_RAW: u32 = 13;
    pub const SYS_CHROOT: u32 = 18;
    pub const SYS_ADMIN: u32 = 21;
    pub const AUDIT_WRITE: u32 = 29;
    pub const SETFCAP: u32 = 31;
}

/// The bounding set of every process in a sandbox.
pub const KEPT: &[u32] = &[
    cap::CHOWN,
    cap::DAC_OVERRIDE,
    cap::FOWNER,
    cap::FSETID,
    cap::KILL,
    cap::SETGID,
    cap::SETUID,
    cap::SETPCAP,
    cap::NET_BIND_SERVICE,
    cap::SYS_CHROOT,
    cap::AUDIT_WRITE,
    cap::SETFCAP,
];

/// `KEPT` as a bit mask.
pub fn kept_mask() -> u64 {
    KEPT.iter().fold(0u64, |m, c| m | (1u64 << c))
}

/// Highest capability number this kernel knows (`/proc/sys/kernel/cap_last_cap`).
pub fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40)
}

/// Applies the policy to the calling (sandbox child) process: drops every capability not
/// in [`KEPT`] from the bounding set, clears the ambient and inheritable sets. The current
/// effective set is left alone, because installing the seccomp filter still needs
/// CAP_SYS_ADMIN; `execve` then recomputes the sets from the bounding set.
pub fn restrict_bounding_set() -> std::io::Result<()> {
    let keep = kept_mask();
    for c in 0..=last_cap().min(63) {
        if keep & (1u64 << c) != 0 {
            continue;
        }
        // SAFETY: prctl with integer arguments.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, c as libc::c_ulong, 0, 0, 0) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            // EINVAL: capability unknown to this kernel.
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(e);
            }
        }
    }
    // SAFETY: prctl with integer arguments.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    let (eff, perm, _inh) = crate::sys::capget()?;
    crate::sys::capset(eff, perm, 0)
}

/// The extended attribute holding a file's capabilities.
const XATTR_CAPS: &std::ffi::CStr = c"security.capability";
const VFS_CAP_REVISION_MASK: u32 = 0xFF00_0000;
const VFS_CAP_REVISION_1: u32 = 0x0100_0000;

/// Removes from the file capabilities (`security.capability`) of every regular file
/// below `rootfs` what no process of a sandbox can hold (capabilities outside
/// [`KEPT`]); a file left with none loses the attribute. The kernel refuses to `execve`
/// a file whose effective file capabilities exceed the bounding set (Debian's `ping`
/// has `cap_net_raw=ep`), so this only ever makes files usable; without the capability
/// `ping` runs unprivileged and uses ICMP echo sockets. Symlinks are not followed, other
/// filesystems not entered. Returns the files changed.
pub fn fit_file_capabilities(rootfs: &std::path::Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::symlink_metadata(rootfs)?.dev();
    let keep = kept_mask();
    let mut changed = Vec::new();
    let mut dirs = vec![rootfs.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let meta = entry.metadata()?; // of the entry itself: no symlink is followed
            if meta.dev() != dev {
                continue;
            }
            if meta.is_dir() {
                dirs.push(entry.path());
                continue;
            }
            if !meta.is_file() {
                continue;
            }
            let path = entry.path();
            let c = std::ffi::CString::new(path.as_os_str().as_bytes())
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
            let mut buf = [0u8; 32];
            // SAFETY: valid C strings and buffer.
            let n = unsafe {
                libc::lgetxattr(
                    c.as_ptr(),
                    XATTR_CAPS.as_ptr(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::ENODATA) | Some(libc::ENOTSUP) => continue,
                    _ => return Err(e),
                }
            }
            let Some(fitted) = fit_caps(&buf[..n as usize], keep) else {
                continue;
            };
            // SAFETY: valid C strings and buffer.
            let rc = unsafe {
                match &fitted {
                    None => libc::lremovexattr(c.as_ptr(), XATTR_CAPS.as_ptr()),
                    Some(v) => libc::lsetxattr(
                        c.as_ptr(),
                        XATTR_CAPS.as_ptr(),
                        v.as_ptr().cast(),
                        v.len(),
                        0,
                    ),
                }
            };
            if rc < 0 {
                return Err(std::io::Error::last_os_error());
            }
            changed.push(path);
        }
    }
    Ok(changed)
}

/// The `security.capability` value `raw` restricted to the capabilities in `keep`:
/// `None` if nothing changes, `Some(None)` if nothing is left (remove the attribute),
/// `Some(Some(value))` otherwise. Unknown layouts are left alone.
fn fit_caps(raw: &[u8], keep: u64) -> Option<Option<Vec<u8>>> {
    let word = |i: usize| -> Option<u32> {
        raw.get(i * 4..i * 4 + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let magic = word(0)?;
    // v1: one word each; v2 and v3 (namespaced: a root uid follows): two.
    let words = if magic & VFS_CAP_REVISION_MASK == VFS_CAP_REVISION_1 {
        1
    } else {
        2
    };
    let (mut perm, mut inh) = (0u64, 0u64);
    for i in 0..words {
        perm |= u64::from(word(1 + 2 * i)?) << (32 * i);
        inh |= u64::from(word(2 + 2 * i)?) << (32 * i);
    }
    let (p2, i2) = (perm & keep, inh & keep);
    if (p2, i2) == (perm, inh) {
        return None;
    }
    if p2 == 0 && i2 == 0 {
        return Some(None);
    }
    let mut out = raw.to_vec();
    for i in 0..words {
        out[(1 + 2 * i) * 4..(2 + 2 * i) * 4]
            .copy_from_slice(&((p2 >> (32 * i)) as u32).to_le_bytes());
        out[(2 + 2 * i) * 4..(3 + 2 * i) * 4]
            .copy_from_slice(&((i2 >> (32 * i)) as u32).to_le_bytes());
    }
    Some(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_capabilities_are_fitted_to_the_bounding_set() {
        // ping: cap_net_raw=ep, v2 (magic 0x02000001: revision 2, effective).
        let mut ping = vec![0u8; 20];
        ping[0..4].copy_from_slice(&0x0200_0001u32.to_le_bytes());
        ping[4..8].copy_from_slice(&(1u32 << cap::NET_RAW).to_le_bytes());
        assert_eq!(
            fit_caps(&ping, kept_mask()),
            Some(None),
            "nothing left: removed"
        );
        // cap_net_raw,cap_chown=ep: only chown stays.
        let mut two = ping.clone();
        two[4..8].copy_from_slice(&((1u32 << cap::NET_RAW) | (1 << cap::CHOWN)).to_le_bytes());
        let fitted = fit_caps(&two, kept_mask()).unwrap().unwrap();
        assert_eq!(
            u32::from_le_bytes(fitted[4..8].try_into().unwrap()),
            1 << cap::CHOWN
        );
        assert_eq!(
            &fitted[0..4],
            &two[0..4],
            "revision and effective flag kept"
        );
        // Already within the set: untouched.
        let mut ok = ping.clone();
        ok[4..8].copy_from_slice(&(1u32 << cap::SETUID).to_le_bytes());
        assert_eq!(fit_caps(&ok, kept_mask()), None);
        assert_eq!(
            fit_caps(&[1, 2], kept_mask()),
            None,
            "garbage is left alone"
        );
    }

    #[test]
    fn mask_matches_policy() {
        let m = kept_mask();
        assert_eq!(m.count_ones() as usize, KEPT.len());
        assert_eq!(m & (1 << cap::SYS_ADMIN), 0, "SYS_ADMIN must never be kept");
        assert_eq!(m & (1 << cap::NET_RAW), 0, "NET_RAW forges frames");
        for c in [
            cap::SETUID,
            cap::SETGID,
            cap::CHOWN,
            cap::DAC_OVERRIDE,
            cap::AUDIT_WRITE,
        ] {
            assert_ne!(m & (1 << c), 0, "sudo needs capability {c}");
        }
    }
}
