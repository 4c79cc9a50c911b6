//! Recycled quota directories: what a tenant leaves must never reach the sandbox that
//! gets its directory next. The suite's node runs like `cubicle serve`, keeping emptied
//! btrfs subvolumes for later creates (`recycle_quota_dirs`). Sandbox A, root inside,
//! plants a marker everywhere it can write (`/`, `/etc`, `/root`, `/tmp`, `/var`,
//! `/usr/local`, `/home`), a setuid copy of a shell, a FIFO, a hard link, a directory
//! tree under a mode-000 directory, a user extended attribute, and tries the immutable
//! flag; it is killed. The host commits the filesystem (the emptied directory may be
//! reused once its deletions are accounted), takes the older entries of the bin with
//! fillers, and creates B, which must get A's directory (the bin shrinks by one). Inside
//! B: no file in the directories a tenant writes holds the marker, none of A's paths exists,
//! and B's quota counts only B's files and holds at B's limit.
//!
//! Contained by: `Storage::remove_sandbox_dir` renames the directory away from its id,
//! empties it with `remove_tree::remove_contents` (no symlink followed, no mount
//! crossed, flags cleared), checks that it is empty, writable and without extended
//! attributes, and resets its owner and mode; a directory it cannot empty is dropped
//! whole; and a directory is reused only once its quota group reads like a new one's,
//! which a directory still holding A's files never does. Shown to fail with both
//! layers removed (`remove_contents` doing nothing, the settled check skipped): B's
//! `grep` found A's marker. With only the emptying removed, the settled check kept A's
//! directory out of use and the attack failed on "B did not get a recycled directory".

use std::sync::Arc;

use cubicle_node::CreateRequest;

use crate::common;
use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "recycled_directory",
    about: "files left for the sandbox that gets a recycled quota directory; emptied, checked and reset before reuse",
    run: |c| Box::pin(run(c)),
};

const QUOTA_MB: u64 = 64;
const MARKER: &str = "cubicle-recycled-marker-7f3a";

/// Paths A writes and B must not see.
const PLANTED: [&str; 11] = [
    "/.planted",
    "/etc/.planted",
    "/root/.planted",
    "/tmp/.planted",
    "/var/.planted",
    "/usr/local/.planted",
    "/home/.planted",
    "/tmp/suid-sh",
    "/tmp/fifo",
    "/tmp/hardlink",
    "/tmp/locked/a/b/f",
];

fn req() -> CreateRequest {
    CreateRequest {
        disk_mb: Some(QUOTA_MB),
        ..common::base()
    }
}

fn bin_entries(ctx: &Ctx) -> anyhow::Result<usize> {
    Ok(std::fs::read_dir(ctx.sandboxes_dir())?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".recycled-"))
        .count())
}

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let a = ctx.sandbox_with(req()).await?;
    let plant = format!(
        r#"n=0
for d in / /etc /root /tmp /var /usr/local /home; do
  mkdir -p "$d" && echo {MARKER} > "$d/.planted" && n=$((n+1))
done
cp /bin/sh /tmp/suid-sh && chmod 4755 /tmp/suid-sh && n=$((n+1))
mkfifo /tmp/fifo && n=$((n+1))
ln /etc/.planted /tmp/hardlink && n=$((n+1))
mkdir -p /tmp/locked/a/b && echo {MARKER} > /tmp/locked/a/b/f && chmod 000 /tmp/locked && n=$((n+1))
python3 -c 'import os; os.setxattr("/tmp/.planted", "user.tenant", b"{MARKER}")' && n=$((n+1))
chattr +i /etc/.planted 2>/dev/null && echo immutable=set
echo planted=$n"#
    );
    let out = a.sh(As::Root, &plant).await?;
    anyhow::ensure!(
        out.field("planted") == Some("12"),
        "could not plant everything: {}",
        out.all()
    );
    anyhow::ensure!(
        out.field("immutable").is_none(),
        "a tenant set the immutable flag: {}",
        out.all()
    );
    a.kill().await?;

    // The emptied directory is reused once its deletions are committed and accounted.
    cubicle_syscalls::fs::sync_filesystem(&ctx.sandboxes_dir())?;
    let queued = bin_entries(&ctx)?;
    anyhow::ensure!(
        queued >= 1,
        "A's directory was not recycled (the bin is empty): this attack needs recycling on"
    );
    // The bin is oldest first: fillers take the entries queued before A's.
    let mut fillers = Vec::new();
    for _ in 1..queued {
        fillers.push(ctx.sandbox_with(req()).await?);
    }
    let b = ctx.sandbox_with(req()).await?;
    let left = bin_entries(&ctx)?;
    let kill_all = |fillers: Vec<Sandbox>| async move {
        for f in fillers {
            f.kill().await?;
        }
        anyhow::Ok(())
    };
    if left != 0 {
        b.kill().await?;
        kill_all(fillers).await?;
        anyhow::bail!("B did not get a recycled directory ({queued} queued, {left} left)");
    }

    let look = format!(
        r#"found=$(grep -rlsa {MARKER} /etc /root /tmp /var /usr/local /home /opt /srv | tr '\n' ' ')
echo "found=$found"
for p in {paths}; do [ -e "$p" ] || [ -L "$p" ] && echo "exists=$p"; done
echo checked=1"#,
        paths = PLANTED.join(" ")
    );
    let out = b.sh(As::Root, &look).await?;
    let result = (|| {
        anyhow::ensure!(out.field("checked") == Some("1"), "{}", out.all());
        anyhow::ensure!(
            out.field("found").is_none_or(|f| f.trim().is_empty()),
            "B reads A's files: {}",
            out.all()
        );
        anyhow::ensure!(
            out.field("exists").is_none(),
            "A's paths exist in B: {}",
            out.all()
        );
        anyhow::Ok(())
    })();
    if let Err(e) = result {
        b.kill().await?;
        kill_all(fillers).await?;
        return Err(e);
    }
    // B's quota is its own: small now, and it holds at B's limit.
    let used = ctx.node.stats(b.id())?.disk_used_bytes.unwrap_or(0);
    let fill = b
        .sh(
            As::Root,
            "dd if=/dev/zero of=/tmp/fill bs=1M count=100 conv=fsync 2>&1; echo rc=$?",
        )
        .await?;
    let after = ctx.node.stats(b.id())?.disk_used_bytes.unwrap_or(u64::MAX);
    b.kill().await?;
    kill_all(fillers).await?;
    anyhow::ensure!(
        used <= 8 << 20,
        "B's quota counts {} MiB before B wrote anything",
        used >> 20
    );
    anyhow::ensure!(
        fill.field("rc") != Some("0") && after <= (QUOTA_MB + 4) << 20,
        "B wrote past its {QUOTA_MB} MiB limit ({} MiB counted): {}",
        after >> 20,
        fill.all()
    );
    Ok(())
}
