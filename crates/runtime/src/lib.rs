//! cubicle-runtime: the isolation of ONE sandbox on Linux (x86_64).
//!
//! A sandbox is a process tree in its own user (root ↦ an unprivileged host uid range),
//! pid, mount, network, ipc, uts and cgroup namespaces, on an overlay of a read-only
//! template rootfs, limited by a cgroup, confined by a seccomp filter and a reduced
//! capability bounding set. This crate creates one ([`spawn`]), observes it ([`Sandbox`]),
//! and removes every trace of it ([`Sandbox::destroy`], [`reap_orphans`]).
//!
//! # The helper contract (read this if you write a `main`)
//!
//! [`spawn`] must not `fork()` the calling process, which is typically a multi-threaded
//! tokio server (a forked copy of a multi-threaded process may deadlock on a lock some
//! other thread held). Instead the first [`spawn`] re-executes the current binary,
//! `/proc/self/exe`, once, with a hidden argv marker: that fresh, single-threaded process
//! (the *zygote*, `zygote.rs`) lives as long as the caller and forks one *helper* per
//! sandbox, which creates the sandbox with `clone(2)` and exits. Therefore **every binary
//! that calls [`spawn`] must call [`maybe_run_helper`] first thing in `main()`**, before
//! starting any runtime or thread:
//!
//! ```no_run
//! # #![allow(clippy::needless_doctest_main)]
//! fn main() {
//!     cubicle_runtime::maybe_run_helper(); // never returns in the zygote process
//!     // ... normal program, e.g. build the tokio runtime ...
//! }
//! ```
//!
//! Integration tests that spawn sandboxes need their own `main` (`harness = false`).
//! A fork of the zygote costs a fraction of a millisecond, an exec of the 43 MB `cubicle`
//! binary per sandbox cost 1.5 ms of CPU; both were chosen over `clone(CLONE_VFORK)` from
//! the server itself because the child has real work to do (mounts, path handling, error
//! reporting) that is not async-signal-safe.
//!
//! The sandbox's init becomes a child of the process that called [`spawn`] (the zygote
//! and the helper both use `CLONE_PARENT`), so that process receives `SIGCHLD` for it; [`Sandbox`] reaps it
//! (with `waitpid` on that one pid — do not reap with `waitpid(-1)` elsewhere).
//!
//! If the calling process dies mid-create, the helper and the half-built sandbox notice
//! the closed status pipe and exit; whatever already exists (cgroup, directories, or a
//! fully started sandbox) is found by [`list_sandboxes`] and removed by
//! [`remove_leftovers`] (or re-attached with [`Sandbox::adopt`]).
//!
//! # What a sandbox sees
//!
//! `/` = overlay(template, `<sandbox_dir>/upper`); fresh `/proc` with masked files
//! (`masked_paths.rs`); read-only `/sys` (one sysfs shared by all sandboxes:
//! `shared_sysfs.rs`) with its own cgroup (as the root, through the
//! cgroup namespace) read-only at `/sys/fs/cgroup`; a minimal `/dev` with private PTYs;
//! tmpfs `/run` holding [`ENVD_PATH`] and [`CTL_DIR`] (both read-only; the init finds
//! its listening socket on fd [`LISTEN_FD`]); `/tmp` on the overlay; only `lo` as
//! network interface until the network module adds a veth; root = host `uid_base`.
//!
//! # API
//!
//! - [`SandboxSpec`] + [`Limits`] + [`BindMount`]: what to create. The agent binary goes
//!   to [`ENVD_PATH`] (read-only), `<sandbox_dir>/ctl` to [`CTL_DIR`] (read-only, with
//!   the socket of [`SandboxSpec::ctl_socket`] in it).
//! - [`spawn`]`(&spec) -> Sandbox`: blocking, returns once the init program was exec'd.
//! - [`Sandbox`]: `pid()`, `pidfd()`, `netns_path()`, `is_alive()`, `exit_status()`,
//!   `wait_timeout()`, `stats()`, `oom_killed()`, `kill()`, `destroy()`, `stop()`,
//!   `timings()`, `take_init_log()`/`read_init_log()` (PID 1's output: a FIFO, never a
//!   host file; [`open_init_log`] reopens it after a restart).
//! - [`remove_tree`]: removes a directory tree whatever a sandbox left in it.
//! - [`connect_ctl_socket`]`(ctl_dir, "envd.sock")`: connect to the agent's socket
//!   WITHOUT following symlinks (a plain `connect("<dir>/ctl/envd.sock")` from the host
//!   could be redirected to any host socket by whoever wrote the ctl directory).
//! - Reconciliation after a crash: [`list_sandboxes`], [`Sandbox::adopt`],
//!   [`remove_leftovers`], [`reap_orphans`].
//! - [`bench::spawn_latency`], [`bench::idle_memory_per_sandbox`]: the create→init-running
//!   and idle-memory benchmarks for `cubicle bench` (`examples/spawn_bench.rs` runs both).
//!
//! Security policy lives in one file each: `seccomp.rs` (system calls),
//! `masked_paths.rs` (/proc and /sys), `capabilities.rs` (bounding set).
//! The rest reads in the order things happen: `sandbox.rs` (caller side) → `helper.rs`
//! (the helper the zygote forks) → `child.rs` (the sandbox's PID 1 before exec) → `rootfs.rs`.

mod attach;
pub mod bench;
pub mod capabilities;
pub mod cgroup;
mod child;
mod ctl;
mod error;
pub mod fd_limit;
mod helper;
mod id;
mod init_log;
pub mod masked_paths;
mod remove_tree;
mod reroot;
pub mod restore;
mod rootfs;
mod sandbox;
pub mod seccomp;
mod shared_sysfs;
mod spec;
mod sys;
mod zygote;

pub mod network;
pub mod storage;

pub use attach::attach_binds;
pub use cgroup::{Cgroup, CgroupStats, CgroupVersion};
pub use ctl::{
    connect_ctl_socket, connect_ctl_socket_async, ctl_socket_parts, open_ctl_socket,
    set_ctl_dir_readonly,
};
pub use error::{Error, Result};
pub use id::SandboxId;
pub use init_log::{create_init_log, open_init_log};
pub use remove_tree::remove_tree;
pub use sandbox::{Sandbox, attach_root, list_sandboxes, reap_orphans, remove_leftovers, spawn};
pub use spec::{
    BindMount, CTL_DIR, DEFAULT_UID_COUNT, ENVD_PATH, LISTEN_FD, Limits, MAX_BINDS, MIN_UID_BASE,
    SandboxSpec,
};

/// If this process was started as the sandbox zygote (`argv[1]` is the hidden marker),
/// runs it and exits; otherwise returns immediately. Call it first in `main()`.
pub fn maybe_run_helper() {
    let mut args = std::env::args_os();
    if args.nth(1).as_deref() == Some(std::ffi::OsStr::new(zygote::ZYGOTE_ARG)) {
        std::process::exit(zygote::main());
    }
}

#[doc(hidden)]
pub use zygote::zygote_pid;
