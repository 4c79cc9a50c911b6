//! Security policy: the seccomp filter of every sandbox (x86_64 only).
//!
//! Read this file top to bottom to know which system calls a sandbox cannot make.
//! The policy is a deny list: everything is allowed except the calls below, which widen
//! the kernel's attack surface or reach host-wide state. Denied calls fail with `EPERM`
//! (programs handle that like a missing privilege) except `clone3`, which fails with
//! `ENOSYS` so that libc falls back to `clone`, whose flags the filter can inspect.
//!
//! Three programs are stacked (the kernel applies the strictest verdict):
//! 1. `abi_guard`: kills any non-x86_64 syscall ABI (i386 via `int 0x80`) and returns
//!    ENOSYS for x32 syscall numbers (bit 30), which would bypass per-number rules.
//! 2. `deny_eperm`: the EPERM list.
//! 3. `deny_enosys`: `clone3`.
//!
//! The filter is installed without `no_new_privs` (so `sudo` keeps working): the kernel
//! permits that because the sandbox's root holds CAP_SYS_ADMIN in its own user namespace
//! at installation time; the capability is then dropped by `execve` (see
//! `capabilities.rs`). A filter cannot be removed, and every descendant inherits it.
//!
//! Allowed on purpose:
//! - `ptrace`, `process_vm_readv/writev`: debuggers and `strace` inside the sandbox. The
//!   pid namespace makes processes outside the sandbox unaddressable, they live in
//!   another user namespace (ptrace would need capabilities there), and CAP_SYS_PTRACE is
//!   not in the bounding set.
//! - `chroot` (build tools), `setns` (useless without CAP_SYS_ADMIN), `sethostname`
//!   (the sandbox's own uts namespace), `unshare`/`clone` without CLONE_NEWUSER (other
//!   namespaces need CAP_SYS_ADMIN, which is not in the bounding set).

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch, sock_filter,
};

use crate::error::{Error, Result};

/// CLONE_NEWUSER flag of clone(2)/unshare(2).
const CLONE_NEWUSER: u64 = 0x1000_0000;
/// TIOCSTI / TIOCLINUX: inject input into a terminal.
const TIOCSTI: u64 = 0x5412;
const TIOCLINUX: u64 = 0x541C;
/// The ioctl type of btrfs (`0x94`): subvolumes and snapshots, each its own quota group
/// outside the limit of the sandbox or volume they are made in (the quota escape of
/// issue 10), read-only subvolumes that block teardown, devices, balance, scrub.
const BTRFS_IOCTL_TYPE: u64 = 0x94;
/// The generic ioctls of that type that stay allowed: FICLONE, FICLONERANGE,
/// FIDEDUPERANGE (reflink copies such as `cp --reflink`; shared extents count in full
/// in every quota group).
const BTRFS_IOCTLS_ALLOWED: [u64; 3] = [0x4004_9409, 0x4020_940d, 0xc018_9436];

/// Syscalls denied outright with EPERM, with the reason.
pub const DENIED: &[(&str, i64, &str)] = &[
    // Kernel modules and replacing the kernel.
    ("init_module", libc::SYS_init_module, "load kernel code"),
    ("finit_module", libc::SYS_finit_module, "load kernel code"),
    (
        "delete_module",
        libc::SYS_delete_module,
        "unload kernel code",
    ),
    ("kexec_load", libc::SYS_kexec_load, "boot another kernel"),
    (
        "kexec_file_load",
        libc::SYS_kexec_file_load,
        "boot another kernel",
    ),
    ("reboot", libc::SYS_reboot, "reboot/halt"),
    // Host-wide resources.
    ("swapon", libc::SYS_swapon, "host swap"),
    ("swapoff", libc::SYS_swapoff, "host swap"),
    ("acct", libc::SYS_acct, "process accounting"),
    ("quotactl", libc::SYS_quotactl, "disk quotas"),
    ("quotactl_fd", 443, "disk quotas"),
    ("syslog", libc::SYS_syslog, "kernel log"),
    ("vhangup", libc::SYS_vhangup, "terminal hangup"),
    (
        "nfsservctl",
        libc::SYS_nfsservctl,
        "legacy NFS server control",
    ),
    (
        "lookup_dcookie",
        libc::SYS_lookup_dcookie,
        "legacy profiling",
    ),
    ("iopl", libc::SYS_iopl, "raw I/O ports"),
    ("ioperm", libc::SYS_ioperm, "raw I/O ports"),
    ("uselib", libc::SYS_uselib, "legacy"),
    // Keyrings are not namespaced.
    ("keyctl", libc::SYS_keyctl, "kernel keyrings"),
    ("add_key", libc::SYS_add_key, "kernel keyrings"),
    ("request_key", libc::SYS_request_key, "kernel keyrings"),
    // Large kernel attack surface.
    ("bpf", libc::SYS_bpf, "eBPF"),
    (
        "perf_event_open",
        libc::SYS_perf_event_open,
        "perf events (side channels, kernel bugs)",
    ),
    (
        "userfaultfd",
        libc::SYS_userfaultfd,
        "race amplification in kernel exploits",
    ),
    (
        "io_uring_setup",
        425,
        "io_uring (libuv and others fall back to threads)",
    ),
    ("io_uring_enter", 426, "io_uring"),
    ("io_uring_register", 427, "io_uring"),
    // A sandbox never mounts: its filesystem tree is fixed at creation.
    ("mount", libc::SYS_mount, "mount"),
    (
        "umount2",
        libc::SYS_umount2,
        "unmount (could reveal masked paths)",
    ),
    ("pivot_root", libc::SYS_pivot_root, "change root mount"),
    ("open_tree", 428, "new mount API"),
    ("move_mount", 429, "new mount API"),
    ("fsopen", 430, "new mount API"),
    ("fsconfig", 431, "new mount API"),
    ("fsmount", 432, "new mount API"),
    ("fspick", 433, "new mount API"),
    ("mount_setattr", 442, "new mount API"),
    ("open_tree_attr", 467, "new mount API"),
    // Clocks are host-wide.
    ("settimeofday", libc::SYS_settimeofday, "set the host clock"),
    (
        "clock_settime",
        libc::SYS_clock_settime,
        "set the host clock",
    ),
    (
        "clock_adjtime",
        libc::SYS_clock_adjtime,
        "adjust the host clock",
    ),
    ("adjtimex", libc::SYS_adjtimex, "adjust the host clock"),
    // File handles bypass path-based confinement.
    (
        "open_by_handle_at",
        libc::SYS_open_by_handle_at,
        "open files by handle",
    ),
    (
        "name_to_handle_at",
        libc::SYS_name_to_handle_at,
        "file handles",
    ),
];

/// Builds the EPERM filter: [`DENIED`] plus argument-dependent rules.
fn deny_eperm_rules() -> Result<BTreeMap<i64, Vec<SeccompRule>>> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for (_, nr, _) in DENIED {
        rules.insert(*nr, Vec::new());
    }
    let cond = |arg: u8, len: SeccompCmpArgLen, op: SeccompCmpOp, val: u64| {
        SeccompCondition::new(arg, len, op, val).map_err(|e| Error::Seccomp(e.to_string()))
    };
    let rule =
        |c: Vec<SeccompCondition>| SeccompRule::new(c).map_err(|e| Error::Seccomp(e.to_string()));

    // New user namespaces would give back every capability dropped here (in the nested
    // namespace) and re-expose mount & co. x86_64 clone(flags, ...): flags is arg 0.
    let newuser = || {
        cond(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(CLONE_NEWUSER),
            CLONE_NEWUSER,
        )
    };
    rules.insert(libc::SYS_clone, vec![rule(vec![newuser()?])?]);
    rules.insert(libc::SYS_unshare, vec![rule(vec![newuser()?])?]);

    // personality(): allow only the harmless personas (query, PER_LINUX, UNAME26,
    // ADDR_NO_RANDOMIZE as used by setarch/gdb); deny anything else (e.g. READ_IMPLIES_EXEC).
    let allowed_personas = [0u64, 0x0008, 0x20000, 0x20008, 0xffff_ffff];
    let mut persona = Vec::new();
    for p in allowed_personas {
        persona.push(cond(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, p)?);
    }
    rules.insert(libc::SYS_personality, vec![rule(persona)?]);

    // ioctl(fd, TIOCSTI/TIOCLINUX): typing into a terminal someone else reads;
    // ioctl(fd, btrfs type except reflinks): see BTRFS_IOCTL_TYPE.
    let mut btrfs = vec![cond(
        1,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::MaskedEq(0xff00),
        BTRFS_IOCTL_TYPE << 8,
    )?];
    for allowed in BTRFS_IOCTLS_ALLOWED {
        btrfs.push(cond(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, allowed)?);
    }
    rules.insert(
        libc::SYS_ioctl,
        vec![
            rule(btrfs)?,
            rule(vec![cond(
                1,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Eq,
                TIOCSTI,
            )?])?,
            rule(vec![cond(
                1,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Eq,
                TIOCLINUX,
            )?])?,
        ],
    );
    Ok(rules)
}

/// Hand-written guard against other syscall ABIs (see the module doc).
fn abi_guard() -> Vec<sock_filter> {
    const BPF_LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
    const BPF_JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
    const BPF_JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
    const BPF_RET_K: u16 = 0x06; // BPF_RET | BPF_K
    const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
    const X32_SYSCALL_BIT: u32 = 0x4000_0000;
    const RET_KILL_PROCESS: u32 = 0x8000_0000;
    const RET_ERRNO_ENOSYS: u32 = 0x0005_0000 | libc::ENOSYS as u32;
    const RET_ALLOW: u32 = 0x7fff_0000;
    let ins = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    vec![
        ins(BPF_LD_W_ABS, 0, 0, 4), // seccomp_data.arch
        ins(BPF_JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        ins(BPF_RET_K, 0, 0, RET_KILL_PROCESS),
        ins(BPF_LD_W_ABS, 0, 0, 0), // seccomp_data.nr
        ins(BPF_JGE_K, 0, 1, X32_SYSCALL_BIT),
        ins(BPF_RET_K, 0, 0, RET_ERRNO_ENOSYS),
        ins(BPF_RET_K, 0, 0, RET_ALLOW),
    ]
}

/// The compiled programs, in installation order.
pub struct SeccompPolicy {
    pub programs: Vec<BpfProgram>,
}

/// Compiles the policy. Done in the helper before the sandbox child exists, so a policy
/// error is reported before any namespace is created.
pub fn compile() -> Result<SeccompPolicy> {
    let arch = TargetArch::x86_64;
    let to_err = |e: seccompiler::BackendError| Error::Seccomp(e.to_string());
    let eperm = SeccompFilter::new(
        deny_eperm_rules()?,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(to_err)?;
    let mut enosys_rules = BTreeMap::new();
    enosys_rules.insert(libc::SYS_clone3, Vec::new());
    let enosys = SeccompFilter::new(
        enosys_rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .map_err(to_err)?;
    let eperm: BpfProgram = eperm.try_into().map_err(to_err)?;
    let enosys: BpfProgram = enosys.try_into().map_err(to_err)?;
    Ok(SeccompPolicy {
        programs: vec![abi_guard(), eperm, enosys],
    })
}

impl SeccompPolicy {
    /// Installs every program on the calling thread (no `no_new_privs`; see module doc).
    pub fn install(&self) -> std::io::Result<()> {
        for p in &self.programs {
            crate::sys::seccomp_install(p)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compiles() {
        let p = compile().unwrap();
        assert_eq!(p.programs.len(), 3);
        assert!(
            p.programs
                .iter()
                .all(|p| !p.is_empty() && p.len() < u16::MAX as usize)
        );
    }

    #[test]
    fn required_denials_present() {
        let names: Vec<&str> = DENIED.iter().map(|(n, _, _)| *n).collect();
        for n in [
            "init_module",
            "finit_module",
            "delete_module",
            "kexec_load",
            "kexec_file_load",
            "reboot",
            "swapon",
            "swapoff",
            "keyctl",
            "add_key",
            "request_key",
            "bpf",
            "perf_event_open",
            "userfaultfd",
            "mount",
            "umount2",
            "fsopen",
            "fsmount",
            "fsconfig",
            "move_mount",
            "open_tree",
            "mount_setattr",
            "pivot_root",
            "settimeofday",
            "clock_settime",
            "clock_adjtime",
            "adjtimex",
            "open_by_handle_at",
            "name_to_handle_at",
            "acct",
            "quotactl",
            "lookup_dcookie",
            "iopl",
            "ioperm",
            "vhangup",
            "nfsservctl",
        ] {
            assert!(names.contains(&n), "{n} must be denied");
        }
        let mut nrs: Vec<i64> = DENIED.iter().map(|(_, nr, _)| *nr).collect();
        nrs.sort();
        nrs.dedup();
        assert_eq!(nrs.len(), DENIED.len(), "duplicate syscall numbers");
    }

    #[test]
    fn syscall_numbers_match_x86_64() {
        // Spot-check the numbers not taken from libc.
        assert_eq!(libc::SYS_mount, 165);
        assert_eq!(libc::SYS_clone3, 435);
        let find = |n: &str| {
            DENIED
                .iter()
                .find(|(x, _, _)| *x == n)
                .map(|(_, nr, _)| *nr)
        };
        assert_eq!(find("open_tree"), Some(428));
        assert_eq!(find("mount_setattr"), Some(442));
        assert_eq!(find("io_uring_setup"), Some(425));
    }
}
