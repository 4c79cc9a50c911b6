//! Every attack of the escape suite, one per file.
//!
//! To add one:
//! 1. create `attacks/<name>.rs` with a module doc saying what the attack tries, which
//!    defence stops it and how you showed the test fails without that defence, and a
//!    `pub const ATTACK: Attack` (see any file here; `kit.rs` has what you need:
//!    `ctx.sandbox()`, `sb.sh/python/c(As::Root, …)`, `out.expect_errno(…)`);
//! 2. add `mod <name>;` and `<name>::ATTACK` below.
//!
//! The harness checks after every attack that the host snapshot (`host.rs`) is
//! unchanged and that the attack's sandboxes are gone; the attack itself asserts that
//! it failed inside. Run one: `cargo test -p cubicle-node --test escape -- <name>`.

use crate::kit::Attack;

mod bpf;
mod btrfs_subvolume;
mod cgroup_release_agent;
mod device_nodes;
mod everyday_tools;
mod fs_ioctls;
mod host_sync;
mod init_log_pipe;
mod io_uring;
mod kernel_modules;
mod keyrings;
mod leaked_fds;
mod mount_api;
mod net_raw;
mod open_by_handle_at;
mod perf_event_open;
mod proc_sys_writes;
mod quota_fs_nosuid;
mod recycled_directory;
mod runc_proc_self_exe;
mod seccomp_default_deny;
mod sys_writes;
mod teardown_leftovers;
mod user_namespaces;

/// All attacks, in the order they run.
pub const ALL: &[Attack] = &[
    // First: on a fresh node the recycle bin holds only what this attack puts there.
    recycled_directory::ATTACK,
    btrfs_subvolume::ATTACK,
    kernel_modules::ATTACK,
    bpf::ATTACK,
    perf_event_open::ATTACK,
    keyrings::ATTACK,
    io_uring::ATTACK,
    user_namespaces::ATTACK,
    mount_api::ATTACK,
    open_by_handle_at::ATTACK,
    runc_proc_self_exe::ATTACK,
    cgroup_release_agent::ATTACK,
    proc_sys_writes::ATTACK,
    sys_writes::ATTACK,
    device_nodes::ATTACK,
    seccomp_default_deny::ATTACK,
    fs_ioctls::ATTACK,
    host_sync::ATTACK,
    quota_fs_nosuid::ATTACK,
    teardown_leftovers::ATTACK,
    init_log_pipe::ATTACK,
    leaked_fds::ATTACK,
    net_raw::ATTACK,
    everyday_tools::ATTACK,
];
