//! One sysfs for every sandbox.
//!
//! A sysfs instance belongs to the network namespace it was made in (its `class/net`), so
//! a sandbox that mounts sysfs in its own namespace gets a superblock of its own. That
//! costs twice over as sandboxes add up: every superblock registers a memcg-aware shrinker,
//! which grows every memory cgroup's shrinker map (see "Superblocks" in `rootfs.rs`), and
//! every new sysfs mount is compared with every live sysfs superblock
//! (`kernfs_test_super`), O(N) per create.
//!
//! Instead the zygote makes one read-only sysfs, once, in a network namespace of its own
//! that holds nothing but a loopback interface (kept alive by a descriptor), and each
//! helper hands its sandbox a clone of that mount for `/sys`. What a sandbox sees there
//! differs from a sysfs of its own only under `class/net` (and `devices/virtual/net`),
//! which show that namespace's `lo` instead of the sandbox's own interfaces; those stay
//! visible where tools look for them (`ip link`, `/proc/net`). Nothing in it is the
//! sandbox's to write: the mount is read-only, and every file belongs to host root, where
//! the sandbox's own instance had its interfaces' files owned by the sandbox's root.
//!
//! A sandbox restored by CRIU gets a sysfs of its own again (CRIU mounts sysfs in the
//! restored network namespace). Without the shared instance (the zygote could not make
//! it), helpers fall back to a sysfs per sandbox.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::OnceLock;

use crate::network::Netns;
use crate::sys;

/// The shared instance and what keeps its network namespace alive.
struct Shared {
    mount: OwnedFd,
    _netns: Netns,
}

static SHARED: OnceLock<Shared> = OnceLock::new();

/// Makes the shared sysfs. Called once by the zygote while single-threaded (it enters a
/// new network namespace for the moment of the mount and returns to its own). An error
/// says why sandboxes will mount a sysfs each instead; the caller's namespaces are as
/// they were unless the error says otherwise.
pub(crate) fn init() -> Result<(), String> {
    if SHARED.get().is_some() {
        return Ok(());
    }
    let own = Netns::current().map_err(|e| format!("own netns: {e}"))?;
    sys::unshare(libc::CLONE_NEWNET).map_err(|e| format!("new network namespace: {e}"))?;
    let made = (|| {
        let attrs = sys::MOUNT_ATTR_RDONLY
            | sys::MOUNT_ATTR_NOSUID
            | sys::MOUNT_ATTR_NODEV
            | sys::MOUNT_ATTR_NOEXEC;
        let mount = sys::fsmount(c"sysfs", attrs).map_err(|e| format!("mount sysfs: {e}"))?;
        let netns = Netns::current().map_err(|e| format!("the new netns: {e}"))?;
        Ok::<_, String>(Shared {
            mount,
            _netns: netns,
        })
    })();
    sys::setns(own.as_raw_fd(), libc::CLONE_NEWNET).map_err(|e| {
        format!("return to the zygote's network namespace (it stays in a new one): {e}")
    })?;
    let _ = SHARED.set(made?);
    Ok(())
}

/// A detached clone of the shared sysfs for one sandbox's `/sys` (each mount can be
/// attached once), or `None` when there is no shared instance.
pub(crate) fn clone() -> Option<std::io::Result<OwnedFd>> {
    SHARED.get().map(|s| sys::open_tree_clone_fd(&s.mount))
}
