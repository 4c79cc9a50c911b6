//! Issue 10, item 1: the quota bypass. On btrfs every subvolume has its own quota
//! group, so a subvolume created inside a sandbox's directory is not limited by the
//! sandbox's quota: `BTRFS_IOC_SUBVOL_CREATE` in the (then writable) `/run/cubicle/ctl`
//! bind let a sandbox with a 64 MiB quota write 150 MiB, and a read-only subvolume
//! (`BTRFS_IOC_SUBVOL_SETFLAGS`) made its teardown fail for good. Tries subvolume
//! creation in every directory a sandbox can write or reach on the quota filesystem,
//! fills what it gets, marks it read-only, writes into the ctl directory, and writes
//! past the quota in `/tmp`.
//!
//! Contained by: the ctl directory is bind-mounted read-only (EROFS; the runtime creates
//! envd's socket there beforehand), every other path of the quota filesystem is reached
//! through the overlay (which passes no btrfs ioctl on), and the seccomp ioctl rules
//! (EPERM) — two independent layers. The host checks: no subvolume below the sandbox's
//! directory, its usage within the quota, free space of the quota filesystem not lower
//! by more than the quota, and a teardown that leaves nothing. Shown to fail with the
//! ctl bind writable and the btrfs ioctl rule removed: `subvol_create_ctl` succeeded and
//! 150 MiB landed outside the quota.

use std::path::Path;
use std::sync::Arc;

use cubicle_node::CreateRequest;

use crate::common;
use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "btrfs_subvolume",
    about: "nested btrfs subvolume outside the quota, read-only subvolume blocking teardown; read-only ctl bind, seccomp ioctl rules",
    run: |c| Box::pin(run(c)),
};

const QUOTA_MB: u64 = 64;
const WRITE_MB: u64 = 150;

const PROGRAM: &str = r#"
#include <linux/btrfs.h>
/* Writes up to mb MiB to path; prints how much and how it ended. */
static void fill(const char *tag, const char *path, long mb) {
    static char chunk[1 << 20];
    memset(chunk, 0xab, sizeof chunk);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    long written = 0; int err = 0;
    if (fd < 0) err = errno;
    for (long i = 0; fd >= 0 && i < mb; i++) {
        long n = write(fd, chunk, sizeof chunk);
        if (n < 0) { err = errno; break; }
        written += n;
        if (n < (long)sizeof chunk) { err = ENOSPC; break; }
    }
    if (fd >= 0 && !err && fsync(fd) < 0) err = errno;
    printf("%s_written=%ld\n%s_errno=%d\n", tag, written, tag, err);
    fflush(stdout);
    if (fd >= 0) close(fd);
}
int main(int argc, char **argv) {
    long mb = atol(argv[1]);
    const char *dirs[] = { "/run/cubicle/ctl", "/", "/tmp", "/root", "/etc", "/run", "/dev/shm", NULL };
    const char *tags[] = { "ctl", "root", "tmp", "roothome", "etc", "run", "shm", NULL };
    char name[96], path[256];
    for (int i = 0; dirs[i]; i++) {
        int fd = open(dirs[i], O_RDONLY | O_DIRECTORY);
        struct btrfs_ioctl_vol_args va;
        memset(&va, 0, sizeof va);
        strcpy(va.name, "escape-subvol");
        snprintf(name, sizeof name, "subvol_create_%s", tags[i]);
        long r = ioctl(fd, BTRFS_IOC_SUBVOL_CREATE, &va);
        report(name, r, errno);
        if (r == 0) {
            snprintf(path, sizeof path, "%s/escape-subvol/big", dirs[i]);
            snprintf(name, sizeof name, "fill_%s", tags[i]);
            fill(name, path, mb);
            snprintf(path, sizeof path, "%s/escape-subvol", dirs[i]);
            int sfd = open(path, O_RDONLY | O_DIRECTORY);
            uint64_t ro = BTRFS_SUBVOL_RDONLY;
            snprintf(name, sizeof name, "subvol_ro_%s", tags[i]);
            TRY(name, ioctl(sfd, BTRFS_IOC_SUBVOL_SETFLAGS, &ro));
        }
        close(fd);
    }
    TRY("ctl_create_file", open("/run/cubicle/ctl/planted", O_WRONLY | O_CREAT, 0644));
    TRY("ctl_mkdir", mkdir("/run/cubicle/ctl/planted-dir", 0755));
    fill("tmp", "/tmp/big", mb);
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sandboxes = ctx.state.join("sandboxes");
    let free_before = synced_free_bytes(&sandboxes)?;
    let sb = ctx
        .sandbox_with(CreateRequest {
            disk_mb: Some(QUOTA_MB),
            ..common::base()
        })
        .await?;
    let out = sb
        .c(
            As::Root,
            "btrfs_subvolume",
            PROGRAM,
            &[&WRITE_MB.to_string()],
        )
        .await?;
    for tag in ["ctl", "root", "tmp", "roothome", "etc", "run", "shm"] {
        let r = out.results();
        let (ret, errno) = r
            .get(&format!("subvol_create_{tag}"))
            .copied()
            .ok_or_else(|| anyhow::anyhow!("no result for {tag}: {}", out.all()))?;
        anyhow::ensure!(
            ret < 0,
            "a subvolume was created in {tag} (then filled: {:?} bytes): {}",
            out.field(&format!("fill_{tag}_written")),
            out.all()
        );
        // EPERM from seccomp; without it EROFS (ctl) or ENOTTY (overlay, tmpfs).
        anyhow::ensure!(
            [EPERM, EROFS, libc::ENOTTY].contains(&errno),
            "{tag}: unexpected errno {errno}: {}",
            out.all()
        );
    }
    out.expect_errno("ctl_create_file", &[EROFS])?;
    out.expect_errno("ctl_mkdir", &[EROFS])?;
    let written: u64 = out
        .field("tmp_written")
        .and_then(|v| v.parse().ok())
        .unwrap_or(u64::MAX);
    anyhow::ensure!(
        written <= QUOTA_MB << 20,
        "wrote {} MiB into /tmp under a {QUOTA_MB} MiB quota: {}",
        written >> 20,
        out.all()
    );
    anyhow::ensure!(
        matches!(
            out.field("tmp_errno"),
            Some(e) if e == libc::EDQUOT.to_string() || e == libc::ENOSPC.to_string()
        ),
        "the write past the quota did not fail with EDQUOT/ENOSPC: {}",
        out.all()
    );
    // Host view: nothing below the sandbox's directory escapes its quota group.
    let list = std::process::Command::new("btrfs")
        .args(["subvolume", "list", "-o"])
        .arg(sb.dir())
        .output();
    if let Ok(o) = list
        && o.status.success()
    {
        let l = String::from_utf8_lossy(&o.stdout);
        anyhow::ensure!(
            l.trim().is_empty(),
            "subvolumes below {}: {l}",
            sb.dir().display()
        );
    }
    let stats = ctx.node.stats(sb.id())?;
    if let Some(used) = stats.disk_used_bytes {
        anyhow::ensure!(
            used <= (QUOTA_MB + 4) << 20,
            "the sandbox's quota group counts {} MiB, over its {QUOTA_MB} MiB",
            used >> 20
        );
    }
    let free_during = synced_free_bytes(&sandboxes)?;
    anyhow::ensure!(
        free_before.saturating_sub(free_during) <= (QUOTA_MB + 16) << 20,
        "the quota filesystem lost {} MiB for a {QUOTA_MB} MiB sandbox",
        free_before.saturating_sub(free_during) >> 20
    );
    sb.kill().await
}

/// Free bytes of the filesystem holding `p` after committing it (`syncfs`).
fn synced_free_bytes(p: &Path) -> anyhow::Result<u64> {
    cubicle_syscalls::fs::sync_filesystem(p)?;
    let s = nix::sys::statvfs::statvfs(p)?;
    Ok(s.blocks_available() as u64 * s.fragment_size() as u64)
}
