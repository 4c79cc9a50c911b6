//! The server the bench starts: a child `cubicle serve` on its own state directory,
//! slots from 8000 (or the next free range), listening on a free loopback port; its
//! `export …` lines and `cubicle: ready` are read from its stdout.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use tokio::io::AsyncBufReadExt;

/// Slots of the bench's own server (disjoint from other nodes on a shared host).
const BENCH_FIRST_SLOT: u32 = 8000;
/// The bench server's longest sandbox timeout, seconds (its `--max-timeout`).
pub(super) const MAX_TIMEOUT_S: u64 = 3600;

pub(super) struct Server {
    child: tokio::process::Child,
}

impl Server {
    pub(super) async fn start(
        state_dir: &Path,
        envd: Option<&PathBuf>,
        templates: &[String],
        pool: Option<usize>,
        interp_pool: Option<usize>,
        shells: Option<usize>,
        max_sandboxes: Option<usize>,
    ) -> anyhow::Result<(Server, String, String)> {
        let exe = std::env::current_exe().context("finding the cubicle binary")?;
        let mut cmd = tokio::process::Command::new(exe);
        cmd.arg("--state-dir").arg(state_dir);
        if let Some(e) = envd {
            cmd.arg("--envd-binary").arg(e);
        }
        // A shared machine: CUBICLE_BENCH_FIRST_SLOT keeps two benches' uid ranges apart.
        let first_slot = std::env::var("CUBICLE_BENCH_FIRST_SLOT")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(BENCH_FIRST_SLOT);
        cmd.args(["--first-slot", &first_slot.to_string(), "--any-free-slots"]);
        // Only ever raised: the node's own default otherwise.
        let default = cubicle_node::config::DEFAULT_MAX_SANDBOXES as usize;
        if let Some(n) = max_sandboxes.filter(|&n| n > default) {
            cmd.arg("--max-sandboxes").arg(n.to_string());
        }
        cmd.args(["serve", "--listen", "127.0.0.1:0"])
            .arg("--max-timeout")
            .arg(MAX_TIMEOUT_S.to_string());
        // Build only what the bench uses (base takes a minute the first time).
        if !templates.iter().any(|t| t == "base") {
            cmd.arg("--no-build-templates");
        }
        let mut spec: Vec<String> = match pool {
            Some(n) => templates.iter().map(|t| format!("{t}={n}")).collect(),
            None => Vec::new(),
        };
        if let Some(n) = interp_pool {
            spec.push(format!("{}={n}", super::interp::TEMPLATE));
        }
        // Always explicit: an empty spec is no pool at all (serve's default would size
        // one from host memory).
        cmd.arg("--pool").arg(spec.join(","));
        // Explicit too: none unless the mode keeps shells.
        cmd.arg("--shells").arg(shells.unwrap_or(0).to_string());
        // The server's access log and lifecycle lines (serve logs at `info`) would bury the
        // bench's table and cost time on every request: warnings only, unless asked.
        if std::env::var_os("CUBICLE_LOG").is_none() {
            cmd.env("CUBICLE_LOG", "warn");
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = cmd.spawn().context("starting `cubicle serve`")?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let (mut url, mut key) = (None, None);
        let wait = async {
            while let Some(line) = lines.next_line().await? {
                if let Some(v) = line.strip_prefix("export E2B_API_URL=") {
                    url = Some(v.to_string());
                } else if let Some(v) = line.strip_prefix("export E2B_API_KEY=") {
                    key = Some(v.to_string());
                } else if line.trim() == "cubicle: ready" {
                    return Ok(());
                }
            }
            bail!("`cubicle serve` exited before it was ready")
        };
        tokio::time::timeout(Duration::from_secs(900), wait)
            .await
            .map_err(|_| anyhow!("`cubicle serve` not ready after 900 s"))??;
        // Keep draining stdout so the server never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let url = url.ok_or_else(|| anyhow!("no E2B_API_URL line"))?;
        // The server prints the key only when it creates it.
        let key = match key {
            Some(k) => k,
            None => crate::serve::read_admin_key(state_dir)?,
        };
        Ok((Server { child }, url, key))
    }

    /// SIGTERM, then as long as systemd gives the unit (`TimeoutStopSec=90`) before a
    /// SIGKILL. A server stops by finishing the teardowns of killed sandboxes first (up
    /// to a minute), then a refill under way: killed sooner, right after a density run's
    /// thousands of kills, it left hundreds of them for the next run's start to clean.
    pub(super) async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            // SAFETY: plain kill(2) of our own child's pid.
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        }
        if tokio::time::timeout(Duration::from_secs(90), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// The servers the bench started left their quota filesystem mounted at `dir` (a node
/// keeps it across restarts): unmount it, so that a bench run leaves no mount behind.
pub(super) fn release_quota_mount(dir: &Path) {
    let mounted = cubicle_syscalls::mountinfo::is_mount_point(dir).unwrap_or(false);
    if mounted && let Err(e) = cubicle_runtime::storage::unmount_path(dir) {
        eprintln!("cubicle bench: {e}");
    }
}
