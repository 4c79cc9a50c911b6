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
//! - NET_RAW: `ping` and raw sockets, confined to the sandbox's netns; egress filtering
//!   happens on the host side of the veth, which raw packets cannot bypass.
//! - SYS_CHROOT: debootstrap/chroot-based build tools.
//! - AUDIT_WRITE: `sudo`/PAM write audit records (fails harmlessly otherwise).
//! - SETFCAP: dpkg sets file capabilities (e.g. on `ping`); namespaced (v3) fcaps only.
//! - MKNOD is NOT kept: device nodes cannot be opened from a user namespace anyway.
//!
//! Dropped notably: SYS_ADMIN (mounts, namespaces), NET_ADMIN (changing addresses/routes
//! inside the netns), SYS_PTRACE (ptrace across uids), SYS_MODULE, SYS_RAWIO, SYS_TIME,
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
    cap::NET_RAW,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_matches_policy() {
        let m = kept_mask();
        assert_eq!(m.count_ones() as usize, KEPT.len());
        assert_eq!(m & (1 << cap::SYS_ADMIN), 0, "SYS_ADMIN must never be kept");
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
