//! Mounting: the classic `mount(2)` (a tmpfs, a bind of `/`, a remount of `/proc/sys`
//! read-write), `umount2` of a mask over `/proc/kcore` (unmasking it), `pivot_root`, and
//! the new mount API (`fsopen`, `fsmount`, `fspick`, `open_tree`, `move_mount`,
//! `mount_setattr`, `open_tree_attr`).
//!
//! Contained by: the seccomp policy (EPERM on every mount call: a sandbox's filesystem
//! tree is fixed at creation) and the missing CAP_SYS_ADMIN. Afterwards `/proc/kcore`
//! must still be masked (an empty file).

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "mount_api",
    about: "mount/unmount (old and new API) to unmask /proc or remount read-only paths; seccomp denies all",
    run: |c| Box::pin(run(c)),
};

const PROGRAM: &str = r#"
#include <linux/mount.h>
int main(void) {
    TRY("mount_tmpfs", mount("none", "/mnt", "tmpfs", 0, NULL));
    TRY("mount_bind_root", mount("/", "/mnt", NULL, MS_BIND | MS_REC, NULL));
    TRY("remount_proc_sys_rw", mount(NULL, "/proc/sys", NULL, MS_REMOUNT | MS_BIND, NULL));
    TRY("umount_kcore_mask", umount2("/proc/kcore", MNT_DETACH));
    TRY("pivot_root", syscall(SYS_pivot_root, "/tmp", "/tmp"));
    TRY("fsopen", syscall(__NR_fsopen, "tmpfs", 0));
    TRY("fspick", syscall(__NR_fspick, AT_FDCWD, "/", 0));
    TRY("open_tree", syscall(__NR_open_tree, AT_FDCWD, "/", 1 /* OPEN_TREE_CLONE */));
    TRY("move_mount", syscall(__NR_move_mount, AT_FDCWD, "/tmp", AT_FDCWD, "/mnt", 0));
    TRY("fsmount", syscall(__NR_fsmount, 0, 0, 0));
    struct mount_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.attr_clr = MOUNT_ATTR_RDONLY;
    TRY("mount_setattr", syscall(__NR_mount_setattr, AT_FDCWD, "/proc/sys", 0, &attr, sizeof attr));
    TRY("open_tree_attr", syscall(467, AT_FDCWD, "/", 1, &attr, sizeof attr));
    char buf[64];
    int fd = open("/proc/kcore", O_RDONLY);
    long n = fd < 0 ? -1 : read(fd, buf, sizeof buf);
    printf("kcore_bytes=%ld\n", n);
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let out = sb.c(As::Root, "mount_api", PROGRAM, &[]).await?;
    for name in [
        "mount_tmpfs",
        "mount_bind_root",
        "remount_proc_sys_rw",
        "umount_kcore_mask",
        "pivot_root",
        "fsopen",
        "fspick",
        "open_tree",
        "move_mount",
        "fsmount",
        "mount_setattr",
        "open_tree_attr",
    ] {
        out.expect_errno(name, &[EPERM])?;
    }
    anyhow::ensure!(
        matches!(out.field("kcore_bytes"), Some("0") | Some("-1")),
        "/proc/kcore is readable: {}",
        out.all()
    );
    let o = sb
        .sh(As::Root, "grep -c ' /mnt ' /proc/self/mounts")
        .await?;
    anyhow::ensure!(o.out.trim() == "0", "something got mounted: {}", o.all());
    sb.kill().await
}
