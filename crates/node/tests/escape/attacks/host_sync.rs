//! A noisy neighbour through `sync(2)`: the call writes back and commits every
//! filesystem of the host, not only the caller's. A tenant that dirties a page and calls
//! `sync` in a loop forces a transaction commit of the shared btrfs every time, and each
//! commit stalls every other sandbox's writes, creates and teardowns behind it.
//! `syncfs(2)` on a bind-mounted volume does the same to that filesystem. Writes a file
//! in `/tmp` and calls `sync` 30 times (then `syncfs` on `/tmp` and the `sync` tool),
//! while the host counts the commits of its quota filesystem.
//!
//! Contained by: seccomp answers `sync` and `syncfs` with success without running them
//! (`seccomp.rs`, `ANSWERED`); the sandbox's root is a volatile overlay, which neither
//! call would write anyway. The host checks that the calls succeeded and that its btrfs
//! committed at most a few times (its own writeback and timer) instead of once per call.
//! Shown to fail with `sync` allowed: 31 commits in the loop.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "host_sync",
    about: "sync(2)/syncfs(2) in a loop to commit the host's shared btrfs; seccomp answers them unrun",
    run: |c| Box::pin(run(c)),
};

const ROUNDS: usize = 30;

const PROGRAM: &str = r#"
int main(int argc, char **argv) {
    int rounds = atoi(argv[1]), failed = 0;
    static char page[4096];
    memset(page, 0x5a, sizeof page);
    char path[64];
    for (int i = 0; i < rounds; i++) {
        snprintf(path, sizeof path, "/tmp/dirty-%d", i);
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0 || write(fd, page, sizeof page) != sizeof page) failed++;
        close(fd);
        if (syscall(SYS_sync) != 0) failed++;
    }
    printf("failed=%d\n", failed);
    TRY("sync", syscall(SYS_sync));
    int dir = open("/tmp", O_RDONLY | O_DIRECTORY);
    TRY("syncfs", syncfs(dir));
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let commits = commit_stats(&ctx.sandboxes_dir())?;
    let sb = ctx.sandbox(false).await?;
    let exe = sb.install_c("host_sync", PROGRAM).await?;
    // The node's writeback commits within a second of a create: let it pass first.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let before = commits.as_deref().map(read_commits).transpose()?;
    let out = sb
        .sh(As::Root, &format!("{exe} {ROUNDS} && sync && echo tool=$?"))
        .await?;
    let after = commits.as_deref().map(read_commits).transpose()?;
    anyhow::ensure!(out.code == 0, "the program failed: {}", out.all());
    anyhow::ensure!(out.field("failed") == Some("0"), "{}", out.all());
    out.expect_ok("sync")?;
    out.expect_ok("syncfs")?;
    anyhow::ensure!(out.field("tool") == Some("0"), "`sync`: {}", out.all());
    match (before, after) {
        (Some(b), Some(a)) => {
            let commits = a - b;
            eprintln!("  host_sync: {commits} commits of the host's btrfs during {ROUNDS} syncs");
            anyhow::ensure!(
                commits <= 3,
                "the host's btrfs committed {commits} times while the sandbox called sync {ROUNDS} times"
            );
        }
        _ => eprintln!("  host_sync: the quota filesystem is not btrfs, commits not counted"),
    }
    sb.kill().await
}

/// `/sys/fs/btrfs/<fsid>/commit_stats` of the filesystem mounted at `mount`; `None`
/// if that is not btrfs.
fn commit_stats(mount: &Path) -> anyhow::Result<Option<PathBuf>> {
    let mount = std::fs::canonicalize(mount)?;
    let Some(m) = cubicle_syscalls::mountinfo::mounts()?
        .into_iter()
        .rev()
        .find(|m| m.mount_point == mount)
    else {
        anyhow::bail!("{} is not a mount point", mount.display());
    };
    if m.fstype != "btrfs" {
        return Ok(None);
    }
    let dev = Path::new(&m.source)
        .file_name()
        .ok_or_else(|| anyhow::anyhow!("btrfs on {}", m.source))?;
    std::fs::read_dir("/sys/fs/btrfs")?
        .flatten()
        .find(|e| e.path().join("devices").join(dev).exists())
        .map(|e| Some(e.path().join("commit_stats")))
        .ok_or_else(|| anyhow::anyhow!("no /sys/fs/btrfs entry has device {}", m.source))
}

fn read_commits(stats: &Path) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string(stats)?;
    text.lines()
        .find_map(|l| l.strip_prefix("commits ")?.trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no commit count in {}: {text}", stats.display()))
}
