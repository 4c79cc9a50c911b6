//! Security policy: the seccomp filter of every sandbox (x86_64 only).
//!
//! Read this file top to bottom to know which system calls a sandbox can make.
//!
//! The policy is an allowlist in the spirit of Docker's default profile: a sandbox may
//! make the calls in [`ALLOWED`] (what ordinary programs, package managers, language
//! runtimes, `sudo`, `ping` and debuggers use), subject to the argument rules of
//! [`argument_rules`]. Every other call fails:
//! - with `EPERM` if it is in [`DENIED`]: calls we know and refuse, each with its reason
//!   (a permission error is what programs expect from a missing privilege, and says
//!   what happened);
//! - with `ENOSYS` otherwise: retired calls and every call a future kernel adds, until
//!   this file allows it. `ENOSYS` is what a kernel without the call answers, so libc
//!   and runtimes fall back to older calls (as they do for `clone3`, below).
//!
//! The calls in [`ANSWERED`] (`sync`, `syncfs`) succeed without running: they act on
//! whole filesystems the host shares, and the sandbox's own root needs neither.
//!
//! Two programs are stacked; the kernel runs both and the strictest action wins (among
//! two errno results, the later-installed program's errno):
//! 1. the number program ([`number_program`]): kills any non-x86_64 syscall ABI (i386
//!    via `int 0x80`), then looks the call's number up by binary search over ranges:
//!    [`ALLOWED`] → allow, [`DENIED`] → EPERM, [`ANSWERED`] → 0 unrun, anything else →
//!    ENOSYS (x32 numbers, bit 30 set, included: they would bypass per-number rules).
//!    About 200 instructions
//!    instead of a linear chain of 900: the kernel checks, translates and JIT-compiles
//!    it at every sandbox's start, and emulates it for every number to fill its verdict
//!    cache, so its size is paid at every create.
//! 2. the argument program: the argument rules of [`argument_rules`] → EPERM, anything
//!    else → allow.
//!
//! Calls without argument rules are allowed or denied by number alone, so the kernel
//! caches their verdict (since Linux 5.11) and runs no filter for them at all.
//!
//! The filter is installed without `no_new_privs` (so `sudo` keeps working): the kernel
//! permits that because the sandbox's root holds CAP_SYS_ADMIN in its own user namespace
//! at installation time; the capability is then dropped by `execve` (see
//! `capabilities.rs`). A filter cannot be removed, and every descendant inherits it.
//!
//! Allowed on purpose (and why it is safe here):
//! - `ptrace`, `process_vm_readv/writev`, `pidfd_getfd`, `kcmp`, `process_madvise`:
//!   debuggers, `strace`, CRIU-like tools inside the sandbox. The kernel allows them only
//!   on processes of the same user (or with CAP_SYS_PTRACE, which is not in the bounding
//!   set), the pid namespace makes every process outside the sandbox unaddressable, and
//!   those live in other user namespaces anyway. Nothing a sandbox's process holds
//!   reaches the host: PID 1's output is a pipe the node drains (`spec.rs`, `init_log`).
//! - `chroot` (build tools; CAP_SYS_CHROOT is kept), `unshare`/`clone` without
//!   namespace flags, `mknod` (FIFOs; device nodes need CAP_MKNOD, which is not kept),
//!   `mlock*` (bounded by RLIMIT_MEMLOCK and the memory cgroup), `seccomp` (programs
//!   add their own filters), `landlock_*`.
//! - `ioctl`, `socket`, `personality`, `clone`, `unshare`: allowed except the argument
//!   combinations of [`argument_rules`].
//!
//! Denied although Docker allows it: `io_uring_*` (operations never pass seccomp;
//! libuv and others fall back to threads), `userfaultfd`, `name_to_handle_at`,
//! `adjtimex`/`clock_adjtime` (even read-only), filesystem ioctls that create, freeze or
//! lock filesystem objects (see [`argument_rules`]).

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch, sock_filter,
};

use crate::error::{Error, Result};

/// System calls a sandbox may make (x86_64 numbers), by purpose.
pub const ALLOWED: &[(&str, i64)] = &[
    // Files and directories.
    ("read", libc::SYS_read),
    ("write", libc::SYS_write),
    ("open", libc::SYS_open),
    ("close", libc::SYS_close),
    ("stat", libc::SYS_stat),
    ("fstat", libc::SYS_fstat),
    ("lstat", libc::SYS_lstat),
    ("lseek", libc::SYS_lseek),
    ("pread64", libc::SYS_pread64),
    ("pwrite64", libc::SYS_pwrite64),
    ("readv", libc::SYS_readv),
    ("writev", libc::SYS_writev),
    ("preadv", libc::SYS_preadv),
    ("pwritev", libc::SYS_pwritev),
    ("preadv2", libc::SYS_preadv2),
    ("pwritev2", libc::SYS_pwritev2),
    ("access", libc::SYS_access),
    ("faccessat", libc::SYS_faccessat),
    ("faccessat2", libc::SYS_faccessat2),
    ("openat", libc::SYS_openat),
    ("openat2", libc::SYS_openat2),
    ("creat", libc::SYS_creat),
    ("newfstatat", libc::SYS_newfstatat),
    ("statx", libc::SYS_statx),
    ("statfs", libc::SYS_statfs),
    ("fstatfs", libc::SYS_fstatfs),
    ("getdents", libc::SYS_getdents),
    ("getdents64", libc::SYS_getdents64),
    ("getcwd", libc::SYS_getcwd),
    ("chdir", libc::SYS_chdir),
    ("fchdir", libc::SYS_fchdir),
    ("rename", libc::SYS_rename),
    ("renameat", libc::SYS_renameat),
    ("renameat2", libc::SYS_renameat2),
    ("mkdir", libc::SYS_mkdir),
    ("mkdirat", libc::SYS_mkdirat),
    ("rmdir", libc::SYS_rmdir),
    ("link", libc::SYS_link),
    ("linkat", libc::SYS_linkat),
    ("unlink", libc::SYS_unlink),
    ("unlinkat", libc::SYS_unlinkat),
    ("symlink", libc::SYS_symlink),
    ("symlinkat", libc::SYS_symlinkat),
    ("readlink", libc::SYS_readlink),
    ("readlinkat", libc::SYS_readlinkat),
    ("mknod", libc::SYS_mknod),
    ("mknodat", libc::SYS_mknodat),
    ("chmod", libc::SYS_chmod),
    ("fchmod", libc::SYS_fchmod),
    ("fchmodat", libc::SYS_fchmodat),
    ("fchmodat2", libc::SYS_fchmodat2),
    ("chown", libc::SYS_chown),
    ("fchown", libc::SYS_fchown),
    ("lchown", libc::SYS_lchown),
    ("fchownat", libc::SYS_fchownat),
    ("umask", libc::SYS_umask),
    ("truncate", libc::SYS_truncate),
    ("ftruncate", libc::SYS_ftruncate),
    ("fallocate", libc::SYS_fallocate),
    ("fadvise64", libc::SYS_fadvise64),
    ("readahead", libc::SYS_readahead),
    ("fsync", libc::SYS_fsync),
    ("fdatasync", libc::SYS_fdatasync),
    ("sync_file_range", libc::SYS_sync_file_range),
    ("flock", libc::SYS_flock),
    ("utime", libc::SYS_utime),
    ("utimes", libc::SYS_utimes),
    ("futimesat", libc::SYS_futimesat),
    ("utimensat", libc::SYS_utimensat),
    ("copy_file_range", libc::SYS_copy_file_range),
    ("sendfile", libc::SYS_sendfile),
    ("splice", libc::SYS_splice),
    ("tee", libc::SYS_tee),
    ("vmsplice", libc::SYS_vmsplice),
    ("chroot", libc::SYS_chroot),
    ("cachestat", 451),
    ("file_getattr", 468),
    // Extended attributes.
    ("setxattr", libc::SYS_setxattr),
    ("lsetxattr", libc::SYS_lsetxattr),
    ("fsetxattr", libc::SYS_fsetxattr),
    ("getxattr", libc::SYS_getxattr),
    ("lgetxattr", libc::SYS_lgetxattr),
    ("fgetxattr", libc::SYS_fgetxattr),
    ("listxattr", libc::SYS_listxattr),
    ("llistxattr", libc::SYS_llistxattr),
    ("flistxattr", libc::SYS_flistxattr),
    ("removexattr", libc::SYS_removexattr),
    ("lremovexattr", libc::SYS_lremovexattr),
    ("fremovexattr", libc::SYS_fremovexattr),
    ("setxattrat", 463),
    ("getxattrat", 464),
    ("listxattrat", 465),
    ("removexattrat", 466),
    // Descriptors, polling, events.
    ("dup", libc::SYS_dup),
    ("dup2", libc::SYS_dup2),
    ("dup3", libc::SYS_dup3),
    ("fcntl", libc::SYS_fcntl),
    ("ioctl", libc::SYS_ioctl),
    ("close_range", libc::SYS_close_range),
    ("pipe", libc::SYS_pipe),
    ("pipe2", libc::SYS_pipe2),
    ("poll", libc::SYS_poll),
    ("ppoll", libc::SYS_ppoll),
    ("select", libc::SYS_select),
    ("pselect6", libc::SYS_pselect6),
    ("epoll_create", libc::SYS_epoll_create),
    ("epoll_create1", libc::SYS_epoll_create1),
    ("epoll_ctl", libc::SYS_epoll_ctl),
    ("epoll_wait", libc::SYS_epoll_wait),
    ("epoll_pwait", libc::SYS_epoll_pwait),
    ("epoll_pwait2", libc::SYS_epoll_pwait2),
    ("eventfd", libc::SYS_eventfd),
    ("eventfd2", libc::SYS_eventfd2),
    ("signalfd", libc::SYS_signalfd),
    ("signalfd4", libc::SYS_signalfd4),
    ("timerfd_create", libc::SYS_timerfd_create),
    ("timerfd_settime", libc::SYS_timerfd_settime),
    ("timerfd_gettime", libc::SYS_timerfd_gettime),
    ("inotify_init", libc::SYS_inotify_init),
    ("inotify_init1", libc::SYS_inotify_init1),
    ("inotify_add_watch", libc::SYS_inotify_add_watch),
    ("inotify_rm_watch", libc::SYS_inotify_rm_watch),
    ("fanotify_mark", libc::SYS_fanotify_mark),
    ("memfd_create", libc::SYS_memfd_create),
    ("memfd_secret", libc::SYS_memfd_secret),
    // Asynchronous I/O (the old AIO interface; not io_uring).
    ("io_setup", libc::SYS_io_setup),
    ("io_destroy", libc::SYS_io_destroy),
    ("io_submit", libc::SYS_io_submit),
    ("io_cancel", libc::SYS_io_cancel),
    ("io_getevents", libc::SYS_io_getevents),
    ("io_pgetevents", 333),
    // Memory.
    ("brk", libc::SYS_brk),
    ("mmap", libc::SYS_mmap),
    ("munmap", libc::SYS_munmap),
    ("mremap", libc::SYS_mremap),
    ("mprotect", libc::SYS_mprotect),
    ("madvise", libc::SYS_madvise),
    ("msync", libc::SYS_msync),
    ("mincore", libc::SYS_mincore),
    ("mlock", libc::SYS_mlock),
    ("mlock2", libc::SYS_mlock2),
    ("munlock", libc::SYS_munlock),
    ("mlockall", libc::SYS_mlockall),
    ("munlockall", libc::SYS_munlockall),
    ("remap_file_pages", libc::SYS_remap_file_pages),
    ("pkey_mprotect", libc::SYS_pkey_mprotect),
    ("pkey_alloc", libc::SYS_pkey_alloc),
    ("pkey_free", libc::SYS_pkey_free),
    ("membarrier", libc::SYS_membarrier),
    ("mseal", libc::SYS_mseal),
    ("map_shadow_stack", 453),
    // Processes and threads.
    ("clone", libc::SYS_clone),
    ("fork", libc::SYS_fork),
    ("vfork", libc::SYS_vfork),
    ("execve", libc::SYS_execve),
    ("execveat", libc::SYS_execveat),
    ("exit", libc::SYS_exit),
    ("exit_group", libc::SYS_exit_group),
    ("wait4", libc::SYS_wait4),
    ("waitid", libc::SYS_waitid),
    ("unshare", libc::SYS_unshare),
    ("getpid", libc::SYS_getpid),
    ("getppid", libc::SYS_getppid),
    ("gettid", libc::SYS_gettid),
    ("set_tid_address", libc::SYS_set_tid_address),
    ("set_robust_list", libc::SYS_set_robust_list),
    ("get_robust_list", libc::SYS_get_robust_list),
    ("rseq", libc::SYS_rseq),
    ("arch_prctl", libc::SYS_arch_prctl),
    ("prctl", libc::SYS_prctl),
    ("personality", libc::SYS_personality),
    ("set_thread_area", libc::SYS_set_thread_area),
    ("get_thread_area", libc::SYS_get_thread_area),
    ("modify_ldt", libc::SYS_modify_ldt),
    ("futex", libc::SYS_futex),
    ("futex_waitv", libc::SYS_futex_waitv),
    ("futex_wake", 454),
    ("futex_wait", 455),
    ("futex_requeue", 456),
    ("pidfd_open", libc::SYS_pidfd_open),
    ("pidfd_send_signal", libc::SYS_pidfd_send_signal),
    ("pidfd_getfd", libc::SYS_pidfd_getfd),
    ("process_mrelease", libc::SYS_process_mrelease),
    ("process_madvise", libc::SYS_process_madvise),
    ("ptrace", libc::SYS_ptrace),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("kcmp", libc::SYS_kcmp),
    ("seccomp", libc::SYS_seccomp),
    ("landlock_create_ruleset", libc::SYS_landlock_create_ruleset),
    ("landlock_add_rule", libc::SYS_landlock_add_rule),
    ("landlock_restrict_self", libc::SYS_landlock_restrict_self),
    ("lsm_get_self_attr", 459),
    ("lsm_set_self_attr", 460),
    ("lsm_list_modules", 461),
    // Scheduling, priorities, limits, accounting.
    ("sched_yield", libc::SYS_sched_yield),
    ("sched_setparam", libc::SYS_sched_setparam),
    ("sched_getparam", libc::SYS_sched_getparam),
    ("sched_setscheduler", libc::SYS_sched_setscheduler),
    ("sched_getscheduler", libc::SYS_sched_getscheduler),
    ("sched_get_priority_max", libc::SYS_sched_get_priority_max),
    ("sched_get_priority_min", libc::SYS_sched_get_priority_min),
    ("sched_rr_get_interval", libc::SYS_sched_rr_get_interval),
    ("sched_setaffinity", libc::SYS_sched_setaffinity),
    ("sched_getaffinity", libc::SYS_sched_getaffinity),
    ("sched_setattr", libc::SYS_sched_setattr),
    ("sched_getattr", libc::SYS_sched_getattr),
    ("getpriority", libc::SYS_getpriority),
    ("setpriority", libc::SYS_setpriority),
    ("ioprio_set", libc::SYS_ioprio_set),
    ("ioprio_get", libc::SYS_ioprio_get),
    ("getrlimit", libc::SYS_getrlimit),
    ("setrlimit", libc::SYS_setrlimit),
    ("prlimit64", libc::SYS_prlimit64),
    ("getrusage", libc::SYS_getrusage),
    ("times", libc::SYS_times),
    ("sysinfo", libc::SYS_sysinfo),
    ("uname", libc::SYS_uname),
    ("getcpu", libc::SYS_getcpu),
    ("getrandom", libc::SYS_getrandom),
    // Users, groups, sessions, capabilities (of the sandbox's own user namespace).
    ("getuid", libc::SYS_getuid),
    ("geteuid", libc::SYS_geteuid),
    ("getgid", libc::SYS_getgid),
    ("getegid", libc::SYS_getegid),
    ("getresuid", libc::SYS_getresuid),
    ("getresgid", libc::SYS_getresgid),
    ("getgroups", libc::SYS_getgroups),
    ("setuid", libc::SYS_setuid),
    ("setgid", libc::SYS_setgid),
    ("setreuid", libc::SYS_setreuid),
    ("setregid", libc::SYS_setregid),
    ("setresuid", libc::SYS_setresuid),
    ("setresgid", libc::SYS_setresgid),
    ("setfsuid", libc::SYS_setfsuid),
    ("setfsgid", libc::SYS_setfsgid),
    ("setgroups", libc::SYS_setgroups),
    ("getpgid", libc::SYS_getpgid),
    ("setpgid", libc::SYS_setpgid),
    ("getpgrp", libc::SYS_getpgrp),
    ("getsid", libc::SYS_getsid),
    ("setsid", libc::SYS_setsid),
    ("capget", libc::SYS_capget),
    ("capset", libc::SYS_capset),
    // Signals and timers.
    ("rt_sigaction", libc::SYS_rt_sigaction),
    ("rt_sigprocmask", libc::SYS_rt_sigprocmask),
    ("rt_sigreturn", libc::SYS_rt_sigreturn),
    ("rt_sigpending", libc::SYS_rt_sigpending),
    ("rt_sigtimedwait", libc::SYS_rt_sigtimedwait),
    ("rt_sigqueueinfo", libc::SYS_rt_sigqueueinfo),
    ("rt_tgsigqueueinfo", libc::SYS_rt_tgsigqueueinfo),
    ("rt_sigsuspend", libc::SYS_rt_sigsuspend),
    ("sigaltstack", libc::SYS_sigaltstack),
    ("kill", libc::SYS_kill),
    ("tkill", libc::SYS_tkill),
    ("tgkill", libc::SYS_tgkill),
    ("pause", libc::SYS_pause),
    ("restart_syscall", libc::SYS_restart_syscall),
    ("alarm", libc::SYS_alarm),
    ("getitimer", libc::SYS_getitimer),
    ("setitimer", libc::SYS_setitimer),
    ("timer_create", libc::SYS_timer_create),
    ("timer_settime", libc::SYS_timer_settime),
    ("timer_gettime", libc::SYS_timer_gettime),
    ("timer_getoverrun", libc::SYS_timer_getoverrun),
    ("timer_delete", libc::SYS_timer_delete),
    ("nanosleep", libc::SYS_nanosleep),
    ("clock_nanosleep", libc::SYS_clock_nanosleep),
    ("clock_gettime", libc::SYS_clock_gettime),
    ("clock_getres", libc::SYS_clock_getres),
    ("gettimeofday", libc::SYS_gettimeofday),
    ("time", libc::SYS_time),
    // Sockets (in the sandbox's own network namespace).
    ("socket", libc::SYS_socket),
    ("socketpair", libc::SYS_socketpair),
    ("bind", libc::SYS_bind),
    ("listen", libc::SYS_listen),
    ("accept", libc::SYS_accept),
    ("accept4", libc::SYS_accept4),
    ("connect", libc::SYS_connect),
    ("getsockname", libc::SYS_getsockname),
    ("getpeername", libc::SYS_getpeername),
    ("sendto", libc::SYS_sendto),
    ("recvfrom", libc::SYS_recvfrom),
    ("sendmsg", libc::SYS_sendmsg),
    ("recvmsg", libc::SYS_recvmsg),
    ("sendmmsg", libc::SYS_sendmmsg),
    ("recvmmsg", libc::SYS_recvmmsg),
    ("shutdown", libc::SYS_shutdown),
    ("setsockopt", libc::SYS_setsockopt),
    ("getsockopt", libc::SYS_getsockopt),
    // System V and POSIX IPC (the sandbox's own IPC namespace).
    ("shmget", libc::SYS_shmget),
    ("shmat", libc::SYS_shmat),
    ("shmctl", libc::SYS_shmctl),
    ("shmdt", libc::SYS_shmdt),
    ("semget", libc::SYS_semget),
    ("semop", libc::SYS_semop),
    ("semctl", libc::SYS_semctl),
    ("semtimedop", libc::SYS_semtimedop),
    ("msgget", libc::SYS_msgget),
    ("msgsnd", libc::SYS_msgsnd),
    ("msgrcv", libc::SYS_msgrcv),
    ("msgctl", libc::SYS_msgctl),
    ("mq_open", libc::SYS_mq_open),
    ("mq_unlink", libc::SYS_mq_unlink),
    ("mq_timedsend", libc::SYS_mq_timedsend),
    ("mq_timedreceive", libc::SYS_mq_timedreceive),
    ("mq_notify", libc::SYS_mq_notify),
    ("mq_getsetattr", libc::SYS_mq_getsetattr),
    // Mount information of the sandbox's own mount namespace (read-only).
    ("statmount", 457),
    ("listmount", 458),
];

/// System calls answered with success without running: what they would do reaches
/// beyond the sandbox, and a machine of its own would do it for itself only. Each with
/// its reason.
pub const ANSWERED: &[(&str, i64, &str)] = &[
    (
        "sync",
        libc::SYS_sync,
        "writes back and commits every filesystem of the host (a loop of it stalled \
         every other sandbox's writes behind a commit of the shared btrfs); the sandbox's \
         own root is a volatile overlay, which a sync leaves as it is anyway",
    ),
    (
        "syncfs",
        libc::SYS_syncfs,
        "commits the whole filesystem under a bind mount (a volume: the shared btrfs); \
         on the volatile root it does nothing anyway. `fsync` and `fdatasync` of a file \
         still work",
    ),
];

/// System calls a sandbox must not make: they fail with EPERM. Each with its reason.
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
    ("quotactl_fd", libc::SYS_quotactl_fd, "disk quotas"),
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
        libc::SYS_io_uring_setup,
        "io_uring (its operations bypass seccomp; libuv and others fall back to threads)",
    ),
    ("io_uring_enter", libc::SYS_io_uring_enter, "io_uring"),
    ("io_uring_register", libc::SYS_io_uring_register, "io_uring"),
    (
        "fanotify_init",
        libc::SYS_fanotify_init,
        "filesystem-wide event monitoring (inotify is allowed)",
    ),
    // A sandbox never mounts: its filesystem tree is fixed at creation.
    ("mount", libc::SYS_mount, "mount"),
    (
        "umount2",
        libc::SYS_umount2,
        "unmount (could reveal masked paths)",
    ),
    ("pivot_root", libc::SYS_pivot_root, "change root mount"),
    ("open_tree", libc::SYS_open_tree, "new mount API"),
    ("move_mount", libc::SYS_move_mount, "new mount API"),
    ("fsopen", libc::SYS_fsopen, "new mount API"),
    ("fsconfig", libc::SYS_fsconfig, "new mount API"),
    ("fsmount", libc::SYS_fsmount, "new mount API"),
    ("fspick", libc::SYS_fspick, "new mount API"),
    ("mount_setattr", libc::SYS_mount_setattr, "new mount API"),
    ("open_tree_attr", 467, "new mount API"),
    // Namespaces other than the sandbox's own need CAP_SYS_ADMIN, which is not kept.
    ("setns", libc::SYS_setns, "join another namespace"),
    (
        "sethostname",
        libc::SYS_sethostname,
        "the hostname is the node's choice (the sandbox id)",
    ),
    ("setdomainname", libc::SYS_setdomainname, "as sethostname"),
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
    // Inode attributes that freeze files or move them between quota projects (the
    // syscall form of FS_IOC_FSSETXATTR, denied in the ioctl rules below).
    ("file_setattr", 469, "inode flags and quota project ids"),
    // NUMA placement: host topology; Docker requires CAP_SYS_NICE.
    ("mbind", libc::SYS_mbind, "NUMA memory policy"),
    (
        "set_mempolicy",
        libc::SYS_set_mempolicy,
        "NUMA memory policy",
    ),
    (
        "get_mempolicy",
        libc::SYS_get_mempolicy,
        "NUMA memory policy",
    ),
    (
        "set_mempolicy_home_node",
        libc::SYS_set_mempolicy_home_node,
        "NUMA memory policy",
    ),
    (
        "migrate_pages",
        libc::SYS_migrate_pages,
        "NUMA page placement",
    ),
    ("move_pages", libc::SYS_move_pages, "NUMA page placement"),
];

/// Retired x86_64 system calls: neither allowed nor worth a reason (ENOSYS, as on a
/// kernel without them). Listed so that the tests can check every number up to
/// [`HIGHEST_KNOWN`] is classified.
pub const RETIRED: &[(&str, i64)] = &[
    ("ustat", libc::SYS_ustat),
    ("sysfs", libc::SYS_sysfs),
    ("_sysctl", libc::SYS__sysctl),
    ("create_module", 174),
    ("get_kernel_syms", 177),
    ("query_module", 178),
    ("getpmsg", libc::SYS_getpmsg),
    ("putpmsg", libc::SYS_putpmsg),
    ("afs_syscall", libc::SYS_afs_syscall),
    ("tuxcall", libc::SYS_tuxcall),
    ("security", libc::SYS_security),
    ("epoll_ctl_old", libc::SYS_epoll_ctl_old),
    ("epoll_wait_old", libc::SYS_epoll_wait_old),
    ("vserver", libc::SYS_vserver),
    // Called only by the kernel's own uretprobe trampoline.
    ("uretprobe", 335),
    // Its flags are in memory seccomp cannot read: libc falls back to clone, whose
    // flags the argument program checks.
    ("clone3", libc::SYS_clone3),
];

/// The highest x86_64 system call number this file classifies (Linux 6.18).
pub const HIGHEST_KNOWN: i64 = 469;

/// CLONE_NEW* flags (clone(2), unshare(2)): mount, cgroup, uts, ipc, user, pid, net.
const CLONE_NEW_ANY: u64 = 0x7E02_0000;
/// CLONE_NEWTIME: only unshare(2) takes it (in clone(2) it is part of the exit signal).
const CLONE_NEWTIME: u64 = 0x80;
/// AF_VSOCK: talks to the hypervisor and the host, not namespaced (Docker denies it too).
const AF_VSOCK: u64 = 40;

/// ioctl commands denied (EPERM), with the reason.
pub const DENIED_IOCTLS: &[(&str, u64, &str)] = &[
    ("TIOCSTI", 0x5412, "type into a terminal someone else reads"),
    ("TIOCLINUX", 0x541C, "type into a virtual console"),
    (
        "FS_IOC_SETFLAGS",
        0x4008_6602,
        "immutable/append-only flags block teardown",
    ),
    ("FS_IOC32_SETFLAGS", 0x4004_6602, "as FS_IOC_SETFLAGS"),
    ("FS_IOC_SETVERSION", 0x4008_7602, "inode generation"),
    ("FS_IOC32_SETVERSION", 0x4004_7602, "inode generation"),
    (
        "FS_IOC_ENABLE_VERITY",
        0x4080_6685,
        "makes a file permanently read-only",
    ),
];

/// ioctl command families denied except the listed commands: the `type` byte
/// (bits 8..16 of the command) and the allowed commands of that type.
pub const DENIED_IOCTL_TYPES: &[(&str, u64, &[u64], &str)] = &[
    (
        "btrfs (0x94)",
        0x94,
        // FICLONE, FICLONERANGE, FIDEDUPERANGE: reflink copies (`cp --reflink`), generic.
        &[0x4004_9409, 0x4020_940d, 0xc018_9436],
        "subvolumes and snapshots (each its own unlimited quota group: the quota escape \
         of issue 10), read-only subvolumes (block teardown), devices, balance, scrub",
    ),
    (
        "XFS and freeze ('X', 0x58)",
        0x58,
        // FS_IOC_FSGETXATTR: read an inode's flags and project id.
        &[0x801c_581f],
        "FIFREEZE/FITHAW (freeze the filesystem), FS_IOC_FSSETXATTR (flags, project \
         quota ids), XFS-specific extent and metadata operations",
    ),
];

/// Builds the argument program's rules (a match fails with EPERM). Only calls in
/// [`ALLOWED`]: the number program already refuses every other.
fn argument_rules() -> Result<BTreeMap<i64, Vec<SeccompRule>>> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    let cond = |arg: u8, len: SeccompCmpArgLen, op: SeccompCmpOp, val: u64| {
        SeccompCondition::new(arg, len, op, val).map_err(|e| Error::Seccomp(e.to_string()))
    };
    let rule =
        |c: Vec<SeccompCondition>| SeccompRule::new(c).map_err(|e| Error::Seccomp(e.to_string()));
    use SeccompCmpArgLen::Dword;

    // New namespaces: a new user namespace would give back every capability dropped
    // here (in the nested namespace) and re-expose mount & co; the others need
    // CAP_SYS_ADMIN, which is not kept. x86_64 clone(flags, ...): flags is arg 0.
    rules.insert(
        libc::SYS_clone,
        clone_new_flag_rules(CLONE_NEW_ANY, &cond, &rule)?,
    );
    rules.insert(
        libc::SYS_unshare,
        clone_new_flag_rules(CLONE_NEW_ANY | CLONE_NEWTIME, &cond, &rule)?,
    );

    // personality(): allow only the harmless personas (query, PER_LINUX, UNAME26,
    // ADDR_NO_RANDOMIZE as used by setarch/gdb); deny anything else (e.g. READ_IMPLIES_EXEC).
    let allowed_personas = [0u64, 0x0008, 0x20000, 0x20008, 0xffff_ffff];
    let mut persona = Vec::new();
    for p in allowed_personas {
        persona.push(cond(0, Dword, SeccompCmpOp::Ne, p)?);
    }
    rules.insert(libc::SYS_personality, vec![rule(persona)?]);

    // ioctl(fd, cmd): the kernel reads cmd as 32 bits, so compare the low word only (a
    // caller could set the high one to dodge a 64-bit comparison).
    let mut ioctl = Vec::new();
    for (_, cmd, _) in DENIED_IOCTLS {
        ioctl.push(rule(vec![cond(1, Dword, SeccompCmpOp::Eq, *cmd)?])?);
    }
    for (_, ty, allowed, _) in DENIED_IOCTL_TYPES {
        let mut c = vec![cond(1, Dword, SeccompCmpOp::MaskedEq(0xff00), ty << 8)?];
        for a in *allowed {
            c.push(cond(1, Dword, SeccompCmpOp::Ne, *a)?);
        }
        ioctl.push(rule(c)?);
    }
    rules.insert(libc::SYS_ioctl, ioctl);

    // socket(AF_VSOCK, …).
    rules.insert(
        libc::SYS_socket,
        vec![rule(vec![cond(0, Dword, SeccompCmpOp::Eq, AF_VSOCK)?])?],
    );
    Ok(rules)
}

/// One rule per CLONE_NEW* bit of `mask`: "this bit is set" (seccomp rules cannot say
/// "any bit of a mask is set" in one comparison).
fn clone_new_flag_rules(
    mask: u64,
    cond: &impl Fn(u8, SeccompCmpArgLen, SeccompCmpOp, u64) -> Result<SeccompCondition>,
    rule: &impl Fn(Vec<SeccompCondition>) -> Result<SeccompRule>,
) -> Result<Vec<SeccompRule>> {
    (0..64)
        .map(|b| 1u64 << b)
        .filter(|bit| mask & bit != 0)
        .map(|bit| {
            rule(vec![cond(
                0,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(bit),
                bit,
            )?])
        })
        .collect()
}

const BPF_LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
const BPF_JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
const BPF_JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
const BPF_RET_K: u16 = 0x06; // BPF_RET | BPF_K
const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
const RET_KILL_PROCESS: u32 = 0x8000_0000;
const RET_ERRNO: u32 = 0x0005_0000;
const RET_ALLOW: u32 = 0x7fff_0000;

/// The verdict of the number program for system call number `nr`.
fn number_verdict(nr: u32) -> u32 {
    let nr = i64::from(nr);
    if ALLOWED.iter().any(|(_, n)| *n == nr) {
        RET_ALLOW
    } else if DENIED.iter().any(|(_, n, _)| *n == nr) {
        RET_ERRNO | libc::EPERM as u32
    } else if ANSWERED.iter().any(|(_, n, _)| *n == nr) {
        // Errno 0: the kernel skips the call and returns 0.
        RET_ERRNO
    } else {
        RET_ERRNO | libc::ENOSYS as u32
    }
}

/// The number program (see the module doc): the architecture check, then a balanced
/// binary search over the ranges of numbers that share a verdict.
fn number_program() -> Result<Vec<sock_filter>> {
    let ins = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    // (first number, verdict) of each range; the last range runs to u32::MAX.
    let highest = u32::try_from(HIGHEST_KNOWN).unwrap_or(u32::MAX);
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for nr in 0..=highest.saturating_add(1) {
        let v = number_verdict(nr);
        if ranges.last().is_none_or(|(_, last)| *last != v) {
            ranges.push((nr, v));
        }
    }
    let mut prog = vec![
        ins(BPF_LD_W_ABS, 0, 0, 4), // seccomp_data.arch
        ins(BPF_JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        ins(BPF_RET_K, 0, 0, RET_KILL_PROCESS),
        ins(BPF_LD_W_ABS, 0, 0, 0), // seccomp_data.nr
    ];
    prog.extend(search(&ranges)?);
    Ok(prog)
}

/// Instructions that return the verdict of the range holding the number in the
/// accumulator: `if nr >= middle range's start { right half } else { left half }`.
fn search(ranges: &[(u32, u32)]) -> Result<Vec<sock_filter>> {
    let ins = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    match ranges {
        [] => Err(Error::Seccomp("empty range table".into())),
        [(_, verdict)] => Ok(vec![ins(BPF_RET_K, 0, 0, *verdict)]),
        _ => {
            let mid = ranges.len() / 2;
            let left = search(&ranges[..mid])?;
            let right = search(&ranges[mid..])?;
            let skip = u8::try_from(left.len())
                .map_err(|_| Error::Seccomp("number program: jump too long".into()))?;
            let mut out = vec![ins(BPF_JGE_K, skip, 0, ranges[mid].0)];
            out.extend(left);
            out.extend(right);
            Ok(out)
        }
    }
}

/// The compiled programs, in installation order.
pub struct SeccompPolicy {
    pub programs: Vec<BpfProgram>,
}

/// Compiles the policy. Done in the helper before the sandbox child exists, so a policy
/// error is reported before any namespace is created.
pub fn compile() -> Result<SeccompPolicy> {
    let to_err = |e: seccompiler::BackendError| Error::Seccomp(e.to_string());
    let arguments = SeccompFilter::new(
        argument_rules()?,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        TargetArch::x86_64,
    )
    .map_err(to_err)?;
    let arguments: BpfProgram = arguments.try_into().map_err(to_err)?;
    Ok(SeccompPolicy {
        programs: vec![number_program()?, arguments],
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
    use std::collections::HashMap;

    #[test]
    fn compiles() {
        let p = compile().unwrap();
        assert_eq!(p.programs.len(), 2);
        assert!(p.programs.iter().all(|p| !p.is_empty() && p.len() < 4096));
        // The point of the binary search: a short program (a linear chain was ~900).
        assert!(p.programs[0].len() < 300, "{}", p.programs[0].len());
    }

    /// Runs the number program as the kernel would (only the instructions it uses).
    fn run_number_program(prog: &[sock_filter], arch: u32, nr: u32) -> u32 {
        let (mut pc, mut acc) = (0usize, 0u32);
        loop {
            let i = &prog[pc];
            pc += 1;
            match i.code {
                BPF_LD_W_ABS => {
                    acc = match i.k {
                        0 => nr,
                        4 => arch,
                        k => panic!("load of offset {k}"),
                    }
                }
                BPF_JEQ_K | BPF_JGE_K => {
                    let taken = if i.code == BPF_JEQ_K {
                        acc == i.k
                    } else {
                        acc >= i.k
                    };
                    pc += usize::from(if taken { i.jt } else { i.jf });
                }
                BPF_RET_K => return i.k,
                c => panic!("unexpected instruction {c:#x}"),
            }
        }
    }

    /// Every number gets its list's verdict: allowed, EPERM for the denied ones,
    /// ENOSYS for the rest (retired, unknown, x32, huge); other ABIs are killed.
    #[test]
    fn number_program_gives_each_list_its_verdict() {
        let prog = number_program().unwrap();
        let eperm = RET_ERRNO | libc::EPERM as u32;
        let enosys = RET_ERRNO | libc::ENOSYS as u32;
        let run = |nr: u32| run_number_program(&prog, AUDIT_ARCH_X86_64, nr);
        for (name, nr) in ALLOWED {
            assert_eq!(run(*nr as u32), RET_ALLOW, "{name}");
            // The same call through the x32 ABI.
            assert_eq!(run(*nr as u32 | 0x4000_0000), enosys, "x32 {name}");
        }
        for (name, nr, _) in DENIED {
            assert_eq!(run(*nr as u32), eperm, "{name}");
        }
        for (name, nr, _) in ANSWERED {
            assert_eq!(run(*nr as u32), RET_ERRNO, "{name} returns 0 unrun");
        }
        for (name, nr) in RETIRED {
            assert_eq!(run(*nr as u32), enosys, "{name}");
        }
        for nr in (0..=4096u32).chain([0x3fff_ffff, 0x4000_0000, 0x8000_0000, u32::MAX]) {
            let listed = ALLOWED.iter().any(|(_, n)| *n == i64::from(nr))
                || DENIED.iter().any(|(_, n, _)| *n == i64::from(nr))
                || ANSWERED.iter().any(|(_, n, _)| *n == i64::from(nr));
            if !listed {
                assert_eq!(run(nr), enosys, "unlisted {nr}");
            }
        }
        const AUDIT_ARCH_I386: u32 = 0x4000_0003;
        assert_eq!(
            run_number_program(&prog, AUDIT_ARCH_I386, libc::SYS_read as u32),
            RET_KILL_PROCESS
        );
    }

    /// Every number up to the highest this kernel generation has is in exactly one of
    /// the lists, or is one of the numbers x86_64 never used (335..=423).
    #[test]
    fn every_syscall_is_classified_once() {
        let mut seen: HashMap<i64, &str> = HashMap::new();
        let all = ALLOWED
            .iter()
            .map(|(n, nr)| (*n, *nr))
            .chain(DENIED.iter().map(|(n, nr, _)| (*n, *nr)))
            .chain(ANSWERED.iter().map(|(n, nr, _)| (*n, *nr)))
            .chain(RETIRED.iter().copied());
        for (name, nr) in all {
            if let Some(other) = seen.insert(nr, name) {
                panic!("syscall {nr} listed twice: {other} and {name}");
            }
        }
        for nr in 0..=HIGHEST_KNOWN {
            if (336..424).contains(&nr) {
                assert!(!seen.contains_key(&nr), "{nr} is not an x86_64 syscall");
                continue;
            }
            assert!(seen.contains_key(&nr), "syscall {nr} is not classified");
        }
        assert!(seen.keys().all(|nr| *nr <= HIGHEST_KNOWN));
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
            "io_uring_setup",
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
            "setns",
        ] {
            assert!(names.contains(&n), "{n} must be denied");
        }
    }

    /// What ordinary programs need (glibc start-up, Python, Node, sudo, ping, gdb).
    #[test]
    fn everyday_calls_allowed() {
        let names: Vec<&str> = ALLOWED.iter().map(|(n, _)| *n).collect();
        for n in [
            "execve",
            "clone",
            "vfork",
            "rseq",
            "statx",
            "getrandom",
            "openat2",
            "faccessat2",
            "close_range",
            "epoll_pwait2",
            "pidfd_open",
            "ptrace",
            "process_vm_readv",
            "setresuid",
            "setgroups",
            "capset",
            "chroot",
            "socket",
            "fchmodat2",
            "copy_file_range",
            "memfd_create",
            "membarrier",
            "seccomp",
        ] {
            assert!(names.contains(&n), "{n} must be allowed");
        }
    }

    #[test]
    fn numbers_not_from_libc_match_x86_64() {
        let find = |n: &str| {
            ALLOWED
                .iter()
                .map(|(x, nr)| (*x, *nr))
                .chain(DENIED.iter().map(|(x, nr, _)| (*x, *nr)))
                .chain(RETIRED.iter().copied())
                .find(|(x, _)| *x == n)
                .map(|(_, nr)| nr)
        };
        assert_eq!(libc::SYS_set_mempolicy_home_node, 450);
        assert_eq!(libc::SYS_fchmodat2, 452);
        assert_eq!(libc::SYS_mseal, 462);
        assert_eq!(find("cachestat"), Some(451));
        assert_eq!(find("futex_requeue"), Some(456));
        assert_eq!(find("open_tree_attr"), Some(467));
        assert_eq!(find("file_setattr"), Some(469));
    }

    #[test]
    fn ioctl_numbers() {
        // _IOW('f', 2, long), _IOW(0x94, 9, int), _IOWR('X', 119, int), _IOR('X', 31, fsxattr)
        let iow = |ty: u64, nr: u64, size: u64| (1 << 30) | (size << 16) | (ty << 8) | nr;
        let ior = |ty: u64, nr: u64, size: u64| (2 << 30) | (size << 16) | (ty << 8) | nr;
        assert_eq!(iow(b'f' as u64, 2, 8), 0x4008_6602);
        assert_eq!(iow(0x94, 9, 4), 0x4004_9409);
        assert_eq!(ior(b'X' as u64, 31, 28), 0x801c_581f);
        let btrfs = DENIED_IOCTL_TYPES.iter().find(|t| t.1 == 0x94).unwrap();
        assert!(btrfs.2.contains(&0x4004_9409), "FICLONE stays allowed");
        // BTRFS_IOC_SUBVOL_CREATE and BTRFS_IOC_SUBVOL_SETFLAGS are of type 0x94.
        for cmd in [0x5000_940eu64, 0x4008_941a] {
            assert_eq!((cmd >> 8) & 0xff, 0x94);
            assert!(!btrfs.2.contains(&cmd));
        }
        // FIFREEZE/FITHAW are of type 'X'.
        assert_eq!((0xc004_5877u64 >> 8) & 0xff, b'X' as u64);
    }
}
