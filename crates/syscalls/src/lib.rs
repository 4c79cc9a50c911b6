//! cubicle-syscalls: the system calls and kernel files that more than one Cubicle crate
//! uses, written once: pidfds ([`pidfd`]), filesystem types, locks and unmounting
//! ([`fs`]), the mount table ([`mountinfo`]), and [`is_root`].
//!
//! Every call goes through [`rustix`] (no `unsafe` here; its `linux_raw` backend works in
//! envd's static build). Calls only one place makes stay with it: the sandbox setup's in
//! `cubicle-runtime` (`sys.rs`: the new mount API, capabilities, seccomp, descriptor
//! passing), envd's process start (`process/spawn.rs`: the `clone` child's raw calls).

#![forbid(unsafe_code)]

pub mod fs;
pub mod mountinfo;
pub mod pidfd;

/// Whether this process runs with effective uid 0.
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}
