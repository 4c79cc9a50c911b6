//! Filesystem-specific ioctls that create, freeze or pin filesystem objects, on every
//! kind of file a sandbox can reach on the quota filesystem: a directory and a file of
//! its overlay (`/tmp`), the bind-mounted `/etc/hosts` (a file of the sandbox's quota
//! directory) and `/run/cubicle/ctl`. btrfs subvolume and snapshot creation (a new
//! subvolume has its own, unlimited quota group: issue 10's quota escape), read-only
//! subvolumes, defragmentation and device ioctls; inode flags (`FS_IOC_SETFLAGS`, which
//! also carries immutable/append-only), `FS_IOC_FSSETXATTR` (flags, quota project ids),
//! `FIFREEZE` (freezes the whole filesystem), fs-verity (a permanently read-only file).
//! As a control, reflink copies (`FICLONE`, a generic ioctl of the same type byte as
//! btrfs') are not refused.
//!
//! Contained by: the ioctl rules of `seccomp.rs` (EPERM; checked with flags the file's
//! owner could otherwise set, `NOATIME` and an unchanged `FSSETXATTR`, so the kernel's
//! own checks would not stop them). Shown to fail without those rules: `setflags_noatime`
//! and `fssetxattr_same` succeeded on `/tmp/f`.

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "fs_ioctls",
    about: "btrfs subvolume/snapshot/ro-flag, inode flags, fsxattr, freeze, verity ioctls; seccomp ioctl rules",
    run: |c| Box::pin(run(c)),
};

const PROGRAM: &str = r#"
#include <linux/fs.h>
#include <linux/btrfs.h>
#include <linux/fsverity.h>
static void on(const char *tag, const char *path) {
    char name[128];
    int fd = open(path, O_RDONLY | O_NONBLOCK);
    if (fd < 0) { snprintf(name, sizeof name, "open_%s", tag); report(name, -1, errno); return; }
    struct btrfs_ioctl_vol_args va;
    memset(&va, 0, sizeof va);
    strcpy(va.name, "escape-subvol");
    snprintf(name, sizeof name, "subvol_create_%s", tag);
    TRY(name, ioctl(fd, BTRFS_IOC_SUBVOL_CREATE, &va));
    struct btrfs_ioctl_vol_args_v2 v2;
    memset(&v2, 0, sizeof v2);
    strcpy(v2.name, "escape-subvol2");
    snprintf(name, sizeof name, "subvol_create_v2_%s", tag);
    TRY(name, ioctl(fd, BTRFS_IOC_SUBVOL_CREATE_V2, &v2));
    va.fd = fd;
    strcpy(va.name, "escape-snap");
    snprintf(name, sizeof name, "snap_create_%s", tag);
    TRY(name, ioctl(fd, BTRFS_IOC_SNAP_CREATE, &va));
    uint64_t ro = BTRFS_SUBVOL_RDONLY;
    snprintf(name, sizeof name, "subvol_setflags_%s", tag);
    TRY(name, ioctl(fd, BTRFS_IOC_SUBVOL_SETFLAGS, &ro));
    snprintf(name, sizeof name, "defrag_%s", tag);
    TRY(name, ioctl(fd, BTRFS_IOC_DEFRAG, NULL));
    long flags = FS_NOATIME_FL;
    snprintf(name, sizeof name, "setflags_noatime_%s", tag);
    TRY(name, ioctl(fd, FS_IOC_SETFLAGS, &flags));
    flags = FS_IMMUTABLE_FL;
    snprintf(name, sizeof name, "setflags_immutable_%s", tag);
    TRY(name, ioctl(fd, FS_IOC_SETFLAGS, &flags));
    flags = FS_APPEND_FL;
    snprintf(name, sizeof name, "setflags_append_%s", tag);
    TRY(name, ioctl(fd, FS_IOC_SETFLAGS, &flags));
    struct fsxattr fx;
    memset(&fx, 0, sizeof fx);
    ioctl(fd, FS_IOC_FSGETXATTR, &fx);
    snprintf(name, sizeof name, "fssetxattr_same_%s", tag);
    TRY(name, ioctl(fd, FS_IOC_FSSETXATTR, &fx));
    fx.fsx_projid = 4242;
    snprintf(name, sizeof name, "fssetxattr_projid_%s", tag);
    TRY(name, ioctl(fd, FS_IOC_FSSETXATTR, &fx));
    int zero = 0;
    snprintf(name, sizeof name, "freeze_%s", tag);
    TRY(name, ioctl(fd, FIFREEZE, &zero));
    struct fsverity_enable_arg ve;
    memset(&ve, 0, sizeof ve);
    ve.version = 1;
    ve.hash_algorithm = FS_VERITY_HASH_ALG_SHA256;
    ve.block_size = 4096;
    snprintf(name, sizeof name, "enable_verity_%s", tag);
    TRY(name, ioctl(fd, FS_IOC_ENABLE_VERITY, &ve));
    close(fd);
}
int main(void) {
    int f = open("/tmp/f", O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (write(f, "data\n", 5) != 5) return 2;
    close(f);
    on("tmpdir", "/tmp");
    on("tmpfile", "/tmp/f");
    on("hosts", "/etc/hosts");
    on("ctl", "/run/cubicle/ctl");
    /* Control: a reflink copy is not refused by the policy. */
    int src = open("/tmp/f", O_RDONLY), dst = open("/tmp/g", O_RDWR | O_CREAT | O_TRUNC, 0644);
    TRY("ficlone", ioctl(dst, FICLONE, src));
    return 0;
}
"#;

const TAGS: &[&str] = &["tmpdir", "tmpfile", "hosts", "ctl"];
const CALLS: &[&str] = &[
    "subvol_create",
    "subvol_create_v2",
    "snap_create",
    "subvol_setflags",
    "defrag",
    "setflags_noatime",
    "setflags_immutable",
    "setflags_append",
    "fssetxattr_same",
    "fssetxattr_projid",
    "freeze",
    "enable_verity",
];

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let out = sb.c(As::Root, "fs_ioctls", PROGRAM, &[]).await?;
    for tag in TAGS {
        for call in CALLS {
            out.expect_errno(&format!("{call}_{tag}"), &[EPERM])?;
        }
    }
    let r = out.results();
    let ficlone = r.get("ficlone").copied().unwrap_or((-1, -1));
    anyhow::ensure!(
        ficlone.1 != EPERM,
        "the policy refuses FICLONE (reflink copies): {}",
        out.all()
    );
    // Nothing of the attempts is left on the host: no subvolume in the quota directory.
    let made = std::process::Command::new("btrfs")
        .args(["subvolume", "list", "-o"])
        .arg(sb.dir())
        .output();
    if let Ok(o) = made
        && o.status.success()
    {
        let list = String::from_utf8_lossy(&o.stdout);
        anyhow::ensure!(
            list.trim().is_empty(),
            "subvolumes were created below {}: {list}",
            sb.dir().display()
        );
    }
    sb.kill().await
}
