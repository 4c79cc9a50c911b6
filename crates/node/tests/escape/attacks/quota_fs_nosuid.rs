//! Issue 10, item 8: the quota filesystem was mounted without `nosuid,nodev`. A sandbox
//! owns the files of its writable layer on the host (as its uid range), so a setuid
//! program it writes there runs with the sandbox root's host uid for anyone on the host
//! who executes it (a host user, a backup or scan job). Makes `/tmp/suid-id` (a copy of
//! `id`, setuid, owned by the sandbox's root), then the host runs it from the sandbox's
//! directory as `nobody`.
//!
//! Contained by: the quota filesystem mounted `nosuid,nodev` (`storage.rs`,
//! `harden_mount`): the program runs with nobody's uid. Sandboxes are unaffected: they
//! see their files through their own overlay mount (`sudo` keeps working inside). The
//! mount flags are also part of the host snapshot. Shown to fail on a mount without
//! `nosuid`: the program reported the sandbox root's host uid as its euid.

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "quota_fs_nosuid",
    about: "a setuid program written by a sandbox, run on the host; quota filesystem nosuid,nodev",
    run: |c| Box::pin(run(c)),
};

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let o = sb
        .sh(
            As::Root,
            "cp /usr/bin/id /tmp/suid-id && chmod 4755 /tmp/suid-id && /tmp/suid-id -u && sudo -n true && echo sudo-ok",
        )
        .await?;
    anyhow::ensure!(
        o.code == 0 && o.out.contains("sudo-ok"),
        "setup inside: {}",
        o.all()
    );
    let on_host = sb.dir().join("upper/tmp/suid-id");
    let meta = std::fs::metadata(&on_host)?;
    use std::os::unix::fs::MetadataExt;
    anyhow::ensure!(
        meta.mode() & 0o4000 != 0 && meta.uid() == sb.info.uid_base,
        "{} is not the sandbox root's setuid file: mode {:o} uid {}",
        on_host.display(),
        meta.mode(),
        meta.uid()
    );
    let out = std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
        ])
        .arg(&on_host)
        .arg("-u")
        .output()?;
    let euid = String::from_utf8_lossy(&out.stdout).trim().to_string();
    anyhow::ensure!(
        out.status.success() && euid == "65534",
        "the host ran the sandbox's setuid program as uid {euid:?} (want 65534): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    sb.kill().await
}
