//! cubicle-checkpoint: checkpoint and restore of Cubicle sandboxes with CRIU — what
//! pause/resume, snapshots, forks and rollbacks are made of.
//!
//! A *checkpoint* is a directory: CRIU's images of the sandbox's process tree (memory,
//! open files, pipes, sockets incl. established TCP connections, PTYs, namespaces,
//! seccomp filters), the saved contents of its staging tmpfs (`/dev`, `/dev/shm`, `/run`:
//! CRIU sees those mounts as external) and `cubicle-checkpoint.json`. The sandbox's disk
//! (its overlay's writable layer) is not in it: the caller keeps the layer that belongs
//! with the checkpoint (in place for a pause; a copy-on-write snapshot for the others).
//!
//! - [`Criu::open`]: finds CRIU (`scripts/install-criu.sh` installs 4.2+ in a private
//!   prefix; 4.1 cannot dump TCP sockets on kernels ≥ 6.16) and its kernel-feature cache.
//! - [`dump`]: freeze the sandbox's cgroup, save its tmpfs, let CRIU write the images;
//!   the sandbox then runs on ([`DumpRequest::leave_running`]) or is gone (a pause). A
//!   failed dump (e.g. the disk quota filled: [`Error::NoSpace`]) leaves nothing behind
//!   and the sandbox running.
//! - [`restore`]: rebuild the root and the external mounts' sources in a private mount
//!   namespace (a re-executed helper, see [`maybe_run_helper`]) and have CRIU restore the
//!   tree into new namespaces and the sandbox's cgroup. The restored sandbox may have
//!   another id, uid range, limits and network slot than the dumped one (fork, sandbox
//!   from a snapshot): the user namespace image and the writable layer's owners are moved
//!   to the new range.
//!
//! Design notes and measurements: `docs/checkpoint.md`.
//!
//! # The helper contract
//!
//! Like `cubicle_runtime::spawn` (whose zygote is an exec of `/proc/self/exe`),
//! [`restore`] re-executes `/proc/self/exe`; every binary that calls it must call
//! [`maybe_run_helper`] first thing in `main()` (it also runs the runtime's sandbox
//! zygote, so it replaces `cubicle_runtime::maybe_run_helper`).

mod archive;
mod criu;
mod dump;
mod error;
mod meta;
mod rebase;
mod restore;
mod rpc;

pub use criu::{Criu, DEFAULT_CRIU};
pub use dump::{DUMP_LOG, DumpReport, DumpRequest, dump};
pub use error::{Error, Result};
pub use meta::{META_FILE, Meta, Stdio};
pub use rebase::rebase_owners;
pub use restore::{RESTORE_LOG, RestoreRequest, Restored, restore};

/// If this process was started as a helper of this crate or of `cubicle-runtime`
/// (`argv[1]` is a hidden marker), runs it and exits; otherwise returns at once. Call it
/// first in `main()`, before any thread is started.
pub fn maybe_run_helper() {
    let arg = std::env::args_os().nth(1);
    if arg.as_deref() == Some(std::ffi::OsStr::new(restore::HELPER_ARG)) {
        restore::helper_main();
    }
    if arg.as_deref() == Some(std::ffi::OsStr::new(restore::MOUNTER_ARG)) {
        restore::mounter_main();
    }
    cubicle_runtime::maybe_run_helper();
}
