//! A template's root for a running shell ([`crate::SandboxSpec::shell`]): the step that
//! turns a sandbox made ahead of any request (namespaces, cgroup, `/proc`, `/sys`,
//! `/dev`, `/run`, its init already running) into a sandbox of one template, without a
//! new process in it.
//!
//! [`crate::Sandbox::attach_root`] has the zygote fork a helper (as for a spawn) that,
//! still host root:
//!
//! 1. pins the init with a pidfd, checks that it is in the sandbox's cgroup and opens its
//!    user namespace through it (the helper does not join that cgroup: a cgroup v1
//!    migration waits for RCU grace periods, 5–20 ms on a busy node; what it mounts is a
//!    few kernel objects, charged to the node's cgroup);
//! 2. makes the idmapped, read-only clones of the template's layers and of every bind
//!    source, as a spawn's helper does (`helper.rs`), and a detached bind of the
//!    sandbox's host directory (its `upper` and `work`);
//!
//! then enters the sandbox's user and mount namespaces (`setns` through the pidfd;
//! root there, nothing on the host) and runs [`plan`]: the overlay is mounted in a
//! scratch directory of the shell's root, the shell's `/proc`, `/sys`, `/dev` and `/run`
//! (with the masks, devices, devpts, the agent binary and the ctl directory below them)
//! move onto it, and `pivot_root` makes it the root of every process of the sandbox whose
//! root was the shell's: the init keeps running, in the template's root. The shell's
//! root (an empty directory of the staging tmpfs) is detached; the template's bind mounts
//! are attached last, at paths resolved inside the new root.
//!
//! No process of the shell has run user code when this runs (a shell is handed out only
//! by it), so nothing inside races with the mounts; the sandbox ends up with the mounts a
//! spawn from the same spec would give it.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use crate::helper::{bind_source, idmapped_layer, mark};
use crate::rootfs::{self, Step};
use crate::spec::SandboxSpec;
use crate::sys;

/// The scratch directory in the shell's root (its staging tmpfs), gone with that root.
const SCRATCH: &str = "/.cubicle-attach";

/// The mounts of a shell's root that move to the template's root, with what is below
/// them (every other path of the shell's root is an empty directory of its tmpfs).
const MOVED: [&str; 4] = ["/proc", "/sys", "/dev", "/run"];

/// The steps, in the sandbox's mount namespace (root: the shell's), that give it
/// `spec`'s root. Mounts: `lowers` = `spec`'s layers; bind 0 = the sandbox directory,
/// bind `i + 1` = `spec.binds[i]`.
pub(crate) fn plan(spec: &SandboxSpec) -> Vec<Step> {
    let scratch = Path::new(SCRATCH);
    let root = scratch.join("root");
    let dir = scratch.join("dir");
    let lowers: Vec<PathBuf> = (0..spec.lowers().len())
        .map(|i| scratch.join(format!("lower{i}")))
        .collect();
    let mut s = vec![Step::Dir {
        path: scratch.to_path_buf(),
        mode: 0o700,
    }];
    for p in lowers.iter().chain([&dir, &root]) {
        s.push(Step::Dir {
            path: p.clone(),
            mode: 0o700,
        });
    }
    rootfs::attach_lowers(&mut s, &lowers);
    s.push(Step::AttachBind {
        index: 0,
        target: dir.clone(),
    });
    // Upper and work through the bind of the sandbox's directory.
    let mut at_dir = spec.clone();
    at_dir.sandbox_dir = dir.clone();
    s.push(rootfs::overlay(&at_dir, &lowers, &root));
    // The overlay holds its layers: their mount points (and the sandbox's directory)
    // are not needed any more.
    for target in lowers.iter().chain([&dir]) {
        s.push(Step::Detach {
            target: target.clone(),
        });
    }
    s.push(Step::Mark("overlay_mounted"));
    rootfs::root_dirs(&mut s, &root);
    for m in MOVED {
        s.push(Step::Move {
            from: m.into(),
            to: root.join(m.trim_start_matches('/')),
        });
    }
    s.push(Step::Mark("pseudo_fs_moved"));
    s.push(Step::Pivot { root });
    for (i, b) in spec.binds.iter().enumerate() {
        s.push(Step::AttachBind {
            index: i + 1,
            target: b.target.clone(),
        });
    }
    s.push(Step::Mark("rootfs_ready"));
    s
}

/// The helper's side: gives the shell whose init is `pid` the root of `spec`.
pub(crate) fn run(spec: &SandboxSpec, pid: i32) -> Result<(), String> {
    if spec.shell {
        return Err("attach a root: the spec is a shell's, not a template's".into());
    }
    let pidfd = cubicle_syscalls::pidfd::pidfd_open(pid)
        .map_err(|e| format!("pidfd of sandbox init {pid}: {e}"))?;
    let userns = std::fs::File::open(format!("/proc/{pid}/ns/user"))
        .map_err(|e| format!("user namespace of sandbox init {pid}: {e}"))?;
    // Opened through a pid: make sure it still is the init the pidfd pins, and the
    // init of this spec's sandbox (its cgroup is the sandbox's, named by its id).
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .map_err(|e| format!("cgroups of sandbox init {pid}: {e}"))?;
    if cubicle_syscalls::pidfd::exited(&pidfd) {
        return Err(format!("sandbox init {pid} has exited"));
    }
    let own = format!("/{}", spec.id);
    if !cgroups.lines().any(|l| l.ends_with(&own)) {
        return Err(format!("process {pid} is not sandbox {}'s", spec.id));
    }
    let lowers = spec
        .lowers()
        .into_iter()
        .map(|layer| idmapped_layer(layer, userns.as_raw_fd()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut binds: Vec<OwnedFd> = vec![
        sys::open_tree_clone(&spec.sandbox_dir)
            .map_err(|e| format!("open_tree {}: {e}", spec.sandbox_dir.display()))?,
    ];
    let mut sources = vec![spec.sandbox_dir.clone()];
    for b in &spec.binds {
        binds.push(bind_source(b, userns.as_raw_fd()).map_err(|e| e.to_string())?);
        sources.push(b.source.clone());
    }
    mark("mounts_prepared");
    sys::setns(pidfd.as_raw_fd(), libc::CLONE_NEWUSER | libc::CLONE_NEWNS)
        .map_err(|e| format!("enter the sandbox's namespaces: {e}"))?;
    crate::child::become_root()?;
    rootfs::execute(
        &plan(spec),
        &rootfs::Mounts {
            lowers: &lowers,
            binds: &binds,
            bind_sources: &sources,
            sysfs: None,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rootfs::tests::position;
    use crate::spec::BindMount;

    fn spec() -> SandboxSpec {
        let mut s = SandboxSpec::new("abc", "/t/base", "/s/abc", 100_000, vec!["/x".into()]);
        s.layers.push("/t/top".into());
        s.binds.push(BindMount {
            source: "/data".into(),
            target: "/opt/data".into(),
            readonly: true,
            idmapped: false,
        });
        s
    }

    #[test]
    fn the_overlay_is_made_of_the_layers_and_the_sandbox_directory() {
        let steps = plan(&spec());
        let overlay = position(
            &steps,
            |s| matches!(s, Step::Mount { fstype, .. } if fstype == "overlay"),
        );
        let Step::Mount { target, data, .. } = &steps[overlay] else {
            unreachable!()
        };
        assert_eq!(target, Path::new("/.cubicle-attach/root"));
        let data = data.as_deref().unwrap_or_default();
        // Top layer first; upper and work through bind 0, the sandbox's directory.
        assert!(
            data.starts_with(
                "lowerdir=/.cubicle-attach/lower1:/.cubicle-attach/lower0,\
                 upperdir=/.cubicle-attach/dir/upper,workdir=/.cubicle-attach/dir/work"
            ),
            "{data}"
        );
        for (i, want) in [(0, "lower0"), (1, "lower1")] {
            let at = position(
                &steps,
                |s| matches!(s, Step::AttachLower { index, .. } if *index == i),
            );
            assert!(at < overlay);
            assert!(
                matches!(&steps[at], Step::AttachLower { target, .. } if target.ends_with(want))
            );
        }
        let dir = position(&steps, |s| matches!(s, Step::AttachBind { index: 0, .. }));
        assert!(dir < overlay);
        // Every scratch mount is detached once the overlay holds it.
        for want in ["lower0", "lower1", "dir"] {
            let at = position(
                &steps,
                |s| matches!(s, Step::Detach { target } if target.ends_with(want)),
            );
            assert!(at > overlay, "{want}");
        }
    }

    #[test]
    fn the_pseudo_filesystems_move_before_the_pivot_and_binds_come_after_it() {
        let steps = plan(&spec());
        let pivot = position(&steps, |s| matches!(s, Step::Pivot { .. }));
        assert!(
            matches!(&steps[pivot], Step::Pivot { root } if root == Path::new("/.cubicle-attach/root"))
        );
        for m in MOVED {
            let at = position(
                &steps,
                |s| matches!(s, Step::Move { from, .. } if from == Path::new(m)),
            );
            let Step::Move { to, .. } = &steps[at] else {
                unreachable!()
            };
            assert_eq!(to, &Path::new("/.cubicle-attach/root").join(&m[1..]));
            assert!(at < pivot);
            // Its mount point exists in the new root first.
            let dir = position(
                &steps,
                |s| matches!(s, Step::Dir { path, .. } if path == to),
            );
            assert!(dir < at);
        }
        let bind = position(&steps, |s| matches!(s, Step::AttachBind { index: 1, .. }));
        assert!(bind > pivot);
        assert!(
            matches!(&steps[bind], Step::AttachBind { target, .. } if target == Path::new("/opt/data"))
        );
        assert!(
            !steps
                .iter()
                .any(|s| matches!(s, Step::AttachBind { index: 2, .. }))
        );
    }
}
