//! Abuse and containment at the node level, with the real `base` template (Debian 12,
//! python3, sudo) and the real `cubicle-envd` as PID 1 — the "Abuse" and "Inside" checks
//! of issue 6. Every check runs hostile code in sandbox A and then shows that the host
//! (it can still fork; its disk and services are untouched) and an idle sandbox B (it
//! still answers a command quickly) are unaffected, and that killing A leaves nothing.
//!
//! - `fork_bomb`: `:(){ :|:& };:` under bash is held at pids.max; killing A ends it.
//! - `memory_hog`: `bytearray(4<<30)` with 256 MiB → the process is OOM-killed (137), the
//!   sandbox survives and reports the kill (stats, `SandboxInfo::oom_kills`), a later
//!   user kill is `killed`; a sandbox whose PID 1 is the OOM victim dies `oom`.
//! - `disk_quota`: `dd` of 200 MiB into a 64 MiB quota fails with ENOSPC/EDQUOT; the
//!   quota filesystem's image did not grow past the quota; the space is freed on kill.
//! - `cpu_hog`: two busy loops in a 1-vCPU A; B's calibrated CPU task stays within 3× its
//!   idle time, and A used about one core.
//! - `privileged_ops`: mount, insmod/modprobe, reboot, swapoff, keyctl/add_key, user
//!   namespace nesting, bpf, perf_event_open, … as root, as `user` via `sudo -n`, and as
//!   `user` → each fails (EPERM/ENOSYS) and the sandbox lives on.
//! - `network`: host 127.0.0.1 and host veth servers, the host's primary address and
//!   another sandbox are unreachable; a test "internet" host in a namespace this test
//!   builds (203.0.113.0/24, TEST-NET-3) is reachable with internet on, not with it off.
//!   A guard nft table drops and counts any forwarded packet of these sandboxes leaving
//!   through an interface the test did not make; the count must stay 0.
//! - `inside_view`: `ps -e`, `/` is Debian 12, no host path, hostname, `sudo -n`, and
//!   file ownership on the host by the sandbox's uid range.
//!
//! State: a private temp state dir (`/tmp/cbabuse-<pid>`) with the `base` template of
//! `/var/lib/cubicle` (or `/var/lib/cubicle-e2e`, or this test's own cache
//! `/var/lib/cubicle-test-abuse`, where it is built when no one has it: one to a few
//! minutes once per machine, e.g. on a fresh CI machine), its rootfs bind-mounted
//! read-only (else copied with `cp -a --reflink=auto`). Slots 4600..4616 (no
//! other test uses them). Runs one at a time per host (an abstract-socket lock).
//!
//! Needs root. Run: `cargo test -p cubicle-node --test abuse [-- FILTER]`.
//! `harness = false`: main() first hands over to the runtime's sandbox helper.

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cubicle_node::{CreateRequest, DeathReason, Node, NodeConfig, SandboxInfo, SandboxState};
use cubicle_runtime::network::{Network, NetworkConfig};

mod common;
use common::lab::{Serve, Server, TestInternet};
use common::{base, bash, host_can_fork, q, slot_of};

type TestResult = anyhow::Result<()>;
type TestFn = common::TestFn<Arc<Ctx>>;

const FIRST_SLOT: u32 = 4600;
const MAX_SANDBOXES: u32 = 16;
/// How fast the idle sandbox must answer `echo` while its neighbour misbehaves.
const RESPONSIVE: Duration = Duration::from_secs(5);

struct Ctx {
    node: Node,
    state: PathBuf,
}

fn main() {
    let Some(h) = common::Harness::start(
        "abuse",
        "user namespaces with uid ranges, cgroups, mounts, netns",
        &[],
    ) else {
        return;
    };
    let tests: Vec<(&str, TestFn)> = vec![
        ("inside_view", |c| Box::pin(inside_view(c))),
        ("privileged_ops", |c| Box::pin(privileged_ops(c))),
        ("fork_bomb", |c| Box::pin(fork_bomb(c))),
        ("memory_hog", |c| Box::pin(memory_hog(c))),
        ("disk_quota", |c| Box::pin(disk_quota(c))),
        ("cpu_hog", |c| Box::pin(cpu_hog(c))),
        ("network", |c| Box::pin(network(c))),
    ];
    if !tests.iter().any(|(n, _)| h.selects(n)) {
        println!("abuse: 0 tests match {:?}", h.filters);
        return;
    }
    let _lock = common::host_lock("abuse");
    let state = PathBuf::from(format!("/tmp/cbabuse-{}", std::process::id()));
    let ctx = match h.rt.block_on(setup(&h.envd, &state)) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            println!("abuse: FAILED — setup: {e:#}");
            let _ = cubicle_node::fsutil::remove_tree(&state);
            std::process::exit(1);
        }
    };
    let node = ctx.node.clone();
    let mut verdict = h.run(ctx, tests, |rt| {
        // Whatever happened, the test's sandboxes must be gone before the next one.
        let left = node.list();
        if left.is_empty() {
            return Ok(());
        }
        rt.block_on(node.kill_all());
        anyhow::bail!(
            "sandboxes left running: {:?}",
            left.iter().map(|i| &i.id).collect::<Vec<_>>()
        )
    });
    node.close();
    drop(node);
    h.rt.shutdown_timeout(Duration::from_secs(2));
    // Unmount first (the shared template's read-only bind, the quota filesystem) and
    // only delete when nothing is mounted any more.
    if let Some(e) = common::remove_state_dir(&state) {
        verdict.fail(&format!("abuse: {e}"));
    }
    verdict.finish();
}

/// A node on a fresh state dir holding the `base` template (copied from the operator's
/// cache when there is one, else built).
async fn setup(envd: &Path, state: &Path) -> anyhow::Result<Ctx> {
    common::prepare_base_template(state).await?;
    let mut cfg = NodeConfig::new(state, envd);
    cfg.first_slot = FIRST_SLOT;
    cfg.max_sandboxes = MAX_SANDBOXES;
    cfg.any_free_slots = true;
    let node = Node::open(cfg).await?;
    common::ensure_base(&node).await?;
    Ok(Ctx {
        node,
        state: state.to_path_buf(),
    })
}

// ---------------------------------------------------------------------------------------
// Helpers.

/// The sandbox answers `echo` within [`RESPONSIVE`]; how long it took.
async fn responsive(node: &Node, id: &str) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let o = bash(node, id, Some("root"), "echo ok", RESPONSIVE).await?;
    anyhow::ensure!(
        o.out.trim() == "ok",
        "{id} answered {:?} / {:?}",
        o.out,
        o.err
    );
    Ok(t.elapsed())
}

/// The neighbour and the host are fine.
async fn unaffected(ctx: &Ctx, b: &SandboxInfo, during: &str) -> TestResult {
    host_can_fork()?;
    let d = responsive(&ctx.node, &b.id)
        .await
        .map_err(|e| anyhow::anyhow!("sandbox B during {during}: {e:#}"))?;
    println!(
        "  B answered in {:.0} ms during {during}",
        d.as_secs_f64() * 1e3
    );
    Ok(())
}

/// Kill `s` (if still alive), check it is recorded as `want` and that nothing is left.
async fn kill_and_check(
    ctx: &Ctx,
    s: &SandboxInfo,
    want: DeathReason,
) -> anyhow::Result<SandboxInfo> {
    common::kill_and_check(&ctx.node, &ctx.state, s, want).await
}

/// Wait until `id` is dead; its info.
async fn death_of(node: &Node, id: &str, limit: Duration) -> anyhow::Result<SandboxInfo> {
    let t = Instant::now();
    loop {
        if let Ok(i) = node.get(id)
            && i.state == SandboxState::Dead
        {
            return Ok(i);
        }
        anyhow::ensure!(t.elapsed() < limit, "{id} did not die within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `statvfs` free bytes (for unprivileged writers).
fn free_bytes(p: &Path) -> anyhow::Result<u64> {
    let s = nix::sys::statvfs::statvfs(p)?;
    Ok(s.blocks_available() as u64 * s.fragment_size() as u64)
}

/// Free bytes of the filesystem holding `p` after committing it (`syncfs`): delayed
/// allocations land, and btrfs's cleaner drops deleted subvolumes' extents (otherwise it
/// waits for the next periodic commit, up to 30 s).
fn synced_free_bytes(p: &Path) -> anyhow::Result<u64> {
    cubicle_syscalls::fs::sync_filesystem(p)?;
    free_bytes(p)
}

// ---------------------------------------------------------------------------------------
// Inside: what a sandbox sees.

async fn inside_view(ctx: Arc<Ctx>) -> TestResult {
    let node = &ctx.node;
    let a = node.create(base()).await?;
    let b = node.create(base()).await?;
    // A process in B that A must not see.
    bash(
        node,
        &b.id,
        None,
        "nohup sleep 4321 >/dev/null 2>&1 & echo started",
        Duration::from_secs(10),
    )
    .await?;
    let marker = ctx.state.join("host-marker");
    std::fs::write(&marker, "host only\n")?;
    let script = format!(
        "echo user=$(id -un); echo hostname=$(hostname); . /etc/os-release; echo os=$ID:$VERSION_ID; \
         for p in /work /work/main {marker} /var/lib/cubicle /root/.cargo; do test -e \"$p\" && echo VISIBLE:$p; done; \
         ps -e -o pid=,comm= | sed 's/^ */ps /'; \
         sudo -n true && echo sudo-ok; echo sudo-uid=$(sudo -n id -u); \
         echo shadow=$(sudo -n sha256sum /etc/shadow | cut -c1-64); \
         sudo -n touch /home/user/root-made && touch /home/user/user-made && echo touched",
        marker = q(&marker.to_string_lossy())
    );
    let o = bash(node, &a.id, None, &script, Duration::from_secs(20)).await?;
    anyhow::ensure!(o.code == 0, "exit {}: {}{}", o.code, o.out, o.err);
    let out = &o.out;
    let field = |k: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(k))
            .unwrap_or("")
            .trim()
            .to_string()
    };
    anyhow::ensure!(field("user=") == "user", "default user: {out}");
    anyhow::ensure!(field("hostname=") == a.id, "hostname: {out}");
    anyhow::ensure!(
        field("os=") == "debian:12",
        "/ is not the Debian 12 template: {out}"
    );
    anyhow::ensure!(!out.contains("VISIBLE:"), "host paths visible: {out}");
    anyhow::ensure!(
        out.contains("sudo-ok") && field("sudo-uid=") == "0",
        "sudo -n: {out}{}",
        o.err
    );
    let ps: Vec<(u32, String)> = out
        .lines()
        .filter_map(|l| l.strip_prefix("ps "))
        .filter_map(|l| {
            let (pid, comm) = l.trim().split_once(' ')?;
            Some((pid.parse().ok()?, comm.trim().to_string()))
        })
        .collect();
    println!("  ps -e in A: {ps:?}");
    anyhow::ensure!(
        ps.iter().any(|(p, c)| *p == 1 && c.contains("envd")),
        "PID 1 is not envd: {ps:?}"
    );
    anyhow::ensure!(ps.len() <= 8, "ps shows {} processes: {ps:?}", ps.len());
    anyhow::ensure!(
        !ps.iter().any(|(_, c)| c == "sleep"),
        "A sees B's sleep: {ps:?}"
    );
    let host_shadow = Command::new("sha256sum").arg("/etc/shadow").output()?;
    let host_sum = String::from_utf8_lossy(&host_shadow.stdout);
    let host_sum = host_sum.split_whitespace().next().unwrap_or("");
    anyhow::ensure!(
        field("shadow=").len() == 64 && field("shadow=") != host_sum,
        "sandbox /etc/shadow is the host's ({host_sum})"
    );
    // Ownership on the host: root inside = uid_base, user (1000) inside = uid_base+1000.
    let upper = node.sandbox_dir(&a.id).join("upper/home/user");
    let root_made = std::fs::metadata(upper.join("root-made"))?;
    let user_made = std::fs::metadata(upper.join("user-made"))?;
    anyhow::ensure!(
        (root_made.uid(), root_made.gid()) == (a.uid_base, a.uid_base),
        "root's file owned by {}:{} on the host, want {}",
        root_made.uid(),
        root_made.gid(),
        a.uid_base
    );
    anyhow::ensure!(
        user_made.uid() == a.uid_base + 1000,
        "user's file owned by {} on the host, want {}",
        user_made.uid(),
        a.uid_base + 1000
    );
    anyhow::ensure!(a.uid_base.abs_diff(b.uid_base) >= 65536, "ranges overlap");
    kill_and_check(&ctx, &a, DeathReason::Killed).await?;
    kill_and_check(&ctx, &b, DeathReason::Killed).await?;
    std::fs::remove_file(&marker)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Privileged operations.

/// Syscall probe (python ctypes). Each line `sys.NAME=RET:ERRNO`. Arguments are chosen
/// so that even a wrongly allowed call does nothing to the host (NULL/invalid pointers,
/// reboot's harmless CAD_OFF command, nonexistent paths).
const SYSCALL_PROBE: &str = r#"
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sc(name, nr, *args):
    conv = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *conv)
    print("sys.%s=%d:%d" % (name, r, ctypes.get_errno() if r == -1 else 0), flush=True)
sc("init_module", 175, 0, 0, b"")
sc("finit_module", 313, -1, b"", 0)
sc("delete_module", 176, b"cubicle_nonexistent", 0)
sc("kexec_load", 246, 0, 0, 0, 0)
sc("reboot", 169, 0xfee1dead, 672274793, 0)
sc("swapoff", 168, b"/nonexistent-swap")
sc("swapon", 167, b"/nonexistent-swap", 0)
sc("add_key", 248, b"user", b"cubicle", b"x", 1, -2)
sc("keyctl", 250, 0, -1, 0)
sc("request_key", 249, b"user", b"cubicle", 0, 0)
sc("bpf", 321, 0, 0, 0)
sc("perf_event_open", 298, 0, 0, -1, -1, 0)
sc("userfaultfd", 323, 0)
sc("unshare_newuser", 272, 0x10000000)
sc("mount", 165, b"x", b"/mnt", b"tmpfs", 0, 0)
sc("open_by_handle_at", 304, -100, 0, 0)
sc("clock_settime", 227, 0, 0)
"#;

/// Command probe: `cmd.NAME=RC` or `cmd.NAME=missing`.
const COMMAND_PROBE: &str = r#"
t() { local n=$1; shift
  if ! command -v "$1" >/dev/null 2>&1; then echo "cmd.$n=missing"; return; fi
  out=$("$@" 2>&1 </dev/null); rc=$?
  echo "cmd.$n=$rc"; echo "why.$n=$(echo $out | head -c 160)"; }
echo uid=$(id -u)
t mount mount -t tmpfs x /mnt
head -c 256 /dev/zero > /tmp/cubicle-fake.ko
t insmod insmod /tmp/cubicle-fake.ko
t modprobe modprobe dummy
t reboot reboot -f
t swapoff swapoff -a
echo swaps=$(($(wc -l < /proc/swaps) - 1))
t keyctl keyctl show
t unshare_user unshare --user --map-root-user true
t unshare_U unshare -U true
t unshare_U_mount unshare -U -r -m true
echo mounted=$(grep -c ' /mnt ' /proc/self/mounts)
python3 /tmp/cubicle-syscalls.py
"#;

async fn privileged_ops(ctx: Arc<Ctx>) -> TestResult {
    let node = &ctx.node;
    let a = node.create(base()).await?;
    let b = node.create(base()).await?;
    let setup = format!(
        "printf '%s' {} > /tmp/cubicle-syscalls.py && printf '%s' {} > /tmp/cubicle-probe.sh && chmod 0755 /tmp/cubicle-probe.sh /tmp/cubicle-syscalls.py && echo ready",
        q(SYSCALL_PROBE),
        q(COMMAND_PROBE)
    );
    let o = bash(node, &a.id, Some("root"), &setup, Duration::from_secs(10)).await?;
    anyhow::ensure!(o.out.trim() == "ready", "setup: {}{}", o.out, o.err);
    for (who, user, script, uid) in [
        ("root", Some("root"), "bash /tmp/cubicle-probe.sh", "0"),
        (
            "user via sudo -n",
            None,
            "sudo -n bash /tmp/cubicle-probe.sh",
            "0",
        ),
        ("user", None, "bash /tmp/cubicle-probe.sh", "1000"),
    ] {
        let o = bash(node, &a.id, user, script, Duration::from_secs(30)).await?;
        let out = &o.out;
        anyhow::ensure!(
            out.lines().any(|l| l == format!("uid={uid}")),
            "{who}: probe did not run as uid {uid}: {out}{}",
            o.err
        );
        let swaps: i64 = out
            .lines()
            .find_map(|l| l.strip_prefix("swaps="))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(-1);
        let mut summary = Vec::new();
        for l in out.lines() {
            if let Some(rest) = l.strip_prefix("cmd.") {
                let (name, rc) = rest.split_once('=').unwrap_or((rest, ""));
                let why = out
                    .lines()
                    .find_map(|l| l.strip_prefix(&format!("why.{name}=")))
                    .unwrap_or("");
                summary.push(format!("{name}={rc}"));
                // `swapoff -a` with no swap configured has nothing to do and succeeds.
                if name == "swapoff" && rc == "0" && swaps == 0 {
                    continue;
                }
                anyhow::ensure!(
                    rc == "missing" || rc != "0",
                    "{who}: `{name}` succeeded inside the sandbox ({why})"
                );
            } else if let Some(rest) = l.strip_prefix("sys.") {
                let (name, v) = rest.split_once('=').unwrap_or((rest, ""));
                let (ret, errno) = v.split_once(':').unwrap_or((v, ""));
                summary.push(format!("{name}:{errno}"));
                anyhow::ensure!(
                    ret == "-1" && (errno == "1" || errno == "38"),
                    "{who}: syscall {name} returned {ret} errno {errno}, want EPERM/ENOSYS"
                );
            }
        }
        anyhow::ensure!(
            summary.iter().filter(|s| s.contains(':')).count() == 17,
            "{who}: syscall probe incomplete: {out}{}",
            o.err
        );
        anyhow::ensure!(
            out.lines().any(|l| l == "mounted=0"),
            "{who}: something got mounted on /mnt: {out}"
        );
        println!("  {who}: {}", summary.join(" "));
        // Still alive and well.
        responsive(node, &a.id).await?;
        anyhow::ensure!(node.get(&a.id)?.state == SandboxState::Running);
    }
    unaffected(&ctx, &b, "privileged ops").await?;
    kill_and_check(&ctx, &a, DeathReason::Killed).await?;
    kill_and_check(&ctx, &b, DeathReason::Killed).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Fork bomb.

async fn fork_bomb(ctx: Arc<Ctx>) -> TestResult {
    let node = &ctx.node;
    let limit = node.config().pids_limit as u64;
    let a = node.create(base()).await?;
    let b = node.create(base()).await?;
    // Detached from envd's pipes, so the call returns while the bomb goes on.
    let o = bash(
        node,
        &a.id,
        None,
        "bash -c ':(){ :|:& };:' >/dev/null 2>&1 </dev/null; echo launched",
        Duration::from_secs(20),
    )
    .await?;
    anyhow::ensure!(o.out.contains("launched"), "{}{}", o.out, o.err);
    let t = Instant::now();
    let mut max_pids = 0;
    let st = loop {
        let st = node.stats(&a.id)?;
        max_pids = max_pids.max(st.pids);
        anyhow::ensure!(
            st.pids <= limit,
            "{} tasks above the limit {limit}",
            st.pids
        );
        if st.pids_limit_hits > 0 && t.elapsed() > Duration::from_secs(2) {
            break st;
        }
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(15),
            "the bomb never hit pids.max: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!(
        "  bomb: {} tasks now (max seen {max_pids}, limit {limit}), {} forks refused, {} OOM kills",
        st.pids, st.pids_limit_hits, st.oom_kills
    );
    unaffected(&ctx, &b, "the fork bomb").await?;
    kill_and_check(&ctx, &a, DeathReason::Killed).await?;
    unaffected(&ctx, &b, "after the fork bomb").await?;
    kill_and_check(&ctx, &b, DeathReason::Killed).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Memory.

async fn memory_hog(ctx: Arc<Ctx>) -> TestResult {
    let node = &ctx.node;
    let a = node
        .create(CreateRequest {
            memory_mb: Some(256),
            ..base()
        })
        .await?;
    let b = node.create(base()).await?;
    let o = bash(
        node,
        &a.id,
        None,
        "python3 -c 'b=bytearray(4<<30)'; echo rc=$?",
        Duration::from_secs(60),
    )
    .await?;
    anyhow::ensure!(
        o.out.lines().any(|l| l == "rc=137"),
        "the 4 GiB allocation was not SIGKILLed: {}{}",
        o.out,
        o.err
    );
    let st = node.stats(&a.id)?;
    anyhow::ensure!(st.oom_kills >= 1, "no OOM kill counted: {st:?}");
    anyhow::ensure!(
        st.memory_bytes <= 256 << 20,
        "memory above the limit: {st:?}"
    );
    let info = node.get(&a.id)?;
    anyhow::ensure!(
        info.state == SandboxState::Running && info.oom_kills == st.oom_kills,
        "A after its OOM: {:?} oom_kills {}",
        info.state,
        info.oom_kills
    );
    responsive(node, &a.id).await?;
    unaffected(&ctx, &b, "the memory hog").await?;
    // The user kills a sandbox that lost a process to OOM: `killed`, OOM count kept.
    let dead = kill_and_check(&ctx, &a, DeathReason::Killed).await?;
    anyhow::ensure!(
        dead.oom_kills >= 1,
        "dead A forgot its OOM kills: {}",
        dead.oom_kills
    );
    println!(
        "  A: python OOM-killed ({} OOM kills), sandbox survived, later `killed`",
        dead.oom_kills
    );

    // When PID 1 (envd) is the OOM killer's victim, the sandbox dies `oom`.
    let c = node
        .create(CreateRequest {
            memory_mb: Some(128),
            ..base()
        })
        .await?;
    // Only checks that envd's score can be raised (what envd starts gets a higher score
    // than envd); it is raised for real below, once the hogs run.
    let o = bash(
        node,
        &c.id,
        Some("root"),
        "echo 0 > /proc/1/oom_score_adj && echo raised",
        Duration::from_secs(10),
    )
    .await?;
    if o.out.trim() != "raised" {
        println!(
            "  PID-1 OOM part SKIPPED: cannot raise envd's oom_score_adj ({})",
            o.err.trim()
        );
        kill_and_check(&ctx, &c, DeathReason::Killed).await?;
    } else {
        // Many small hogs, so that envd (score = its RSS + the whole limit) outranks each
        // of them; one big hog would tie with it (its RSS is about the limit). They wait
        // for /tmp/go, so that envd's score is raised after they started (else they would
        // inherit it). The call's connection dies with envd.
        let r = bash(
            node,
            &c.id,
            Some("root"),
            "rm -f /tmp/go; for i in $(seq 12); do python3 -c 'import os,time\nwhile not os.path.exists(\"/tmp/go\"): time.sleep(0.02)\nb=bytearray(24<<20); time.sleep(30)' & done; sleep 0.5; echo 1000 > /proc/1/oom_score_adj; touch /tmp/go; wait; echo done",
            Duration::from_secs(40),
        )
        .await;
        let dead = match death_of(node, &c.id, Duration::from_secs(10)).await {
            Ok(d) => d,
            Err(e) => {
                let st = node.stats(&c.id);
                let r = r.map(|o| format!("{} {} {}", o.code, o.out, o.err));
                anyhow::bail!("{e}: call {r:?}; stats {st:?}");
            }
        };
        anyhow::ensure!(
            dead.death_reason == Some(DeathReason::Oom),
            "PID 1 OOM-killed, reason {:?}",
            dead.death_reason
        );
        anyhow::ensure!(dead.oom_kills >= 1, "{}", dead.oom_kills);
        let left =
            cubicle_node::traces::leftovers(&ctx.state, &c.id, Some(slot_of(c.uid_base)), c.pid);
        anyhow::ensure!(left.is_empty(), "{} left traces: {left:?}", c.id);
        println!("  C: envd (PID 1) OOM-killed → death reason `oom`");
    }
    unaffected(&ctx, &b, "after the memory hogs").await?;
    kill_and_check(&ctx, &b, DeathReason::Killed).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Disk.

async fn disk_quota(ctx: Arc<Ctx>) -> TestResult {
    let node = &ctx.node;
    let a = node
        .create(CreateRequest {
            disk_mb: Some(64),
            ..base()
        })
        .await?;
    let b = node.create(base()).await?;
    let st = node.stats(&a.id)?;
    let Some(limit) = st.disk_limit_bytes else {
        println!("  SKIPPED: no quota filesystem on this host (see docs/node.md)");
        kill_and_check(&ctx, &a, DeathReason::Killed).await?;
        kill_and_check(&ctx, &b, DeathReason::Killed).await?;
        return Ok(());
    };
    anyhow::ensure!(limit == 64 << 20, "quota {limit}");
    let sandboxes = ctx.state.join("sandboxes");
    let img = ctx.state.join("storage.img");
    let img_blocks = || {
        std::fs::metadata(&img)
            .map(|m| m.blocks() * 512)
            .unwrap_or(0)
    };
    let (img_before, fs_free_before, host_free_before) = (
        img_blocks(),
        synced_free_bytes(&sandboxes)?,
        free_bytes(Path::new("/"))?,
    );
    let o = bash(
        node,
        &a.id,
        None,
        "dd if=/dev/zero of=/home/user/big bs=1M count=200; echo rc=$?; sync; echo size=$(stat -c %s /home/user/big)",
        Duration::from_secs(60),
    )
    .await?;
    anyhow::ensure!(
        o.out.lines().any(|l| l.starts_with("rc=") && l != "rc=0"),
        "dd past the quota succeeded: {}{}",
        o.out,
        o.err
    );
    anyhow::ensure!(
        o.err.contains("No space left on device") || o.err.contains("Disk quota exceeded"),
        "dd said {:?}",
        o.err
    );
    let size: u64 = o
        .out
        .lines()
        .find_map(|l| l.strip_prefix("size="))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(u64::MAX);
    anyhow::ensure!(size <= limit, "file of {size} bytes in a {limit} quota");
    let st = node.stats(&a.id)?;
    let used = st.disk_used_bytes.unwrap_or(0);
    anyhow::ensure!(used <= limit + (1 << 20), "quota usage {used} > {limit}");
    let (img_after, host_free_after) = (img_blocks(), free_bytes(Path::new("/"))?);
    let grew = img_after.saturating_sub(img_before);
    let host_drop = host_free_before.saturating_sub(host_free_after);
    println!(
        "  dd stopped at {} MiB: {}; quota usage {} MiB; storage image grew {} MiB; host free space -{} MiB",
        size >> 20,
        o.err
            .lines()
            .find(|l| l.contains("space") || l.contains("quota"))
            .unwrap_or("")
            .trim(),
        used >> 20,
        grew >> 20,
        host_drop >> 20
    );
    if img_before > 0 {
        anyhow::ensure!(
            grew <= limit + (64 << 20),
            "storage image grew {grew} bytes"
        );
    }
    // Loose: other work on this host may write meanwhile; 200 MiB did not land.
    anyhow::ensure!(
        host_drop < 1 << 30,
        "host lost {host_drop} bytes of free space"
    );
    let fs_free_after = synced_free_bytes(&sandboxes)?;
    anyhow::ensure!(
        fs_free_after + used + (4 << 20) >= fs_free_before,
        "the filler took more than its quota: free {fs_free_before} -> {fs_free_after}"
    );
    responsive(node, &a.id).await?;
    // B can still write.
    let o = bash(
        node,
        &b.id,
        None,
        "dd if=/dev/zero of=/home/user/ok bs=1M count=16 2>&1 && echo wrote",
        Duration::from_secs(30),
    )
    .await?;
    anyhow::ensure!(
        o.out.contains("wrote"),
        "B cannot write: {}{}",
        o.out,
        o.err
    );
    unaffected(&ctx, &b, "the disk filler").await?;
    let fs_free_full = synced_free_bytes(&sandboxes)?;
    kill_and_check(&ctx, &a, DeathReason::Killed).await?;
    // A's space comes back (btrfs frees a deleted subvolume's extents asynchronously).
    let t = Instant::now();
    loop {
        let free = synced_free_bytes(&sandboxes)?;
        if free + (8 << 20) >= fs_free_full + used {
            println!(
                "  {} MiB freed {:.1}s after kill",
                free.saturating_sub(fs_free_full) >> 20,
                t.elapsed().as_secs_f64()
            );
            break;
        }
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(30),
            "space not freed: {} MiB free, {} MiB before the kill, A used {} MiB",
            free >> 20,
            fs_free_full >> 20,
            used >> 20
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    kill_and_check(&ctx, &b, DeathReason::Killed).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// CPU.

/// Seconds a `for` loop of `n` iterations takes in B (python, startup excluded).
async fn cpu_task(node: &Node, id: &str, n: u64) -> anyhow::Result<f64> {
    let o = bash(
        node,
        id,
        None,
        &format!(
            "python3 -c 'import time\nt=time.perf_counter()\nfor _ in range({n}): pass\nprint(time.perf_counter()-t)'"
        ),
        Duration::from_secs(60),
    )
    .await?;
    o.out
        .trim()
        .parse()
        .map_err(|_| anyhow::anyhow!("cpu task said {:?} {:?}", o.out, o.err))
}

async fn cpu_hog(ctx: Arc<Ctx>) -> TestResult {
    let node = &ctx.node;
    let a = node
        .create(CreateRequest {
            cpus: Some(1),
            ..base()
        })
        .await?;
    let b = node.create(base()).await?;
    // Calibrate: ~0.5 s of work.
    let probe = 2_000_000;
    let t = cpu_task(node, &b.id, probe).await?;
    let n = ((probe as f64) * 0.5 / t.max(0.01)) as u64;
    let o = bash(
        node,
        &a.id,
        None,
        "for i in 1 2; do nohup python3 -c 'while 1: pass' >/dev/null 2>&1 </dev/null & echo $!; done",
        Duration::from_secs(10),
    )
    .await?;
    let hogs = o.out.split_whitespace().collect::<Vec<_>>().join(" ");
    anyhow::ensure!(hogs.split(' ').count() == 2, "{}{}", o.out, o.err);
    // Idle and busy turns alternate (the hogs stopped, then running), so that a change
    // of the host's own load between them (other tests, builds) weighs on both alike.
    let signal = |sig: &'static str| {
        let script = format!("kill -{sig} {hogs}");
        let id = a.id.clone();
        async move {
            let o = bash(node, &id, None, &script, Duration::from_secs(10)).await?;
            anyhow::ensure!(o.code == 0, "kill -{sig}: {}{}", o.out, o.err);
            Ok(())
        }
    };
    let (mut idle, mut busy, mut a_ns, mut busy_wall) = (Vec::new(), Vec::new(), 0u64, 0f64);
    for _ in 0..3 {
        signal("STOP").await?;
        idle.push(cpu_task(node, &b.id, n).await?);
        signal("CONT").await?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (c0, t0) = (node.stats(&a.id)?.cpu_usage_ns, Instant::now());
        busy.push(cpu_task(node, &b.id, n).await?);
        a_ns += node.stats(&a.id)?.cpu_usage_ns - c0;
        busy_wall += t0.elapsed().as_secs_f64();
    }
    let a_cores = a_ns as f64 / 1e9 / busy_wall;
    idle.sort_by(f64::total_cmp);
    busy.sort_by(f64::total_cmp);
    let (idle_median, median) = (idle[1], busy[1]);
    println!(
        "  B's task ({n} iterations): idle {:?} ms, next to A's hogs {:?} ms; A used {a_cores:.2} cores (limit 1)",
        idle.iter().map(|s| (s * 1e3).round()).collect::<Vec<_>>(),
        busy.iter().map(|s| (s * 1e3).round()).collect::<Vec<_>>()
    );
    anyhow::ensure!(
        median <= 3.0 * idle_median,
        "B's task took {median:.2}s next to the hog, {idle_median:.2}s idle"
    );
    // Only a sign of life: on cgroup v1 every busy host process weighs as much as A's
    // whole group, so a loaded host leaves A far less than its limit.
    anyhow::ensure!(a_cores >= 0.05, "the hogs did not run ({a_cores:.2} cores)");
    anyhow::ensure!(
        a_cores <= 1.2,
        "A used {a_cores:.2} cores with a 1-vCPU limit"
    );
    unaffected(&ctx, &b, "the CPU hog").await?;
    kill_and_check(&ctx, &a, DeathReason::Killed).await?;
    kill_and_check(&ctx, &b, DeathReason::Killed).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Network.

/// The test internet's network (`common::lab`).
const INET_NET: [u8; 3] = [203, 0, 113];

/// Connect probe run inside a sandbox: one `HOST:PORT OPEN <reply>` or `HOST:PORT FAIL
/// <error>` line per target, 2 s timeout each.
const CONNECT_PROBE: &str = r#"
import socket, sys
for t in sys.argv[1:]:
    h, p = t.rsplit(":", 1)
    s = socket.socket(); s.settimeout(2)
    try:
        s.connect((h, int(p))); s.settimeout(1)
        try: d = s.recv(100).decode()
        except Exception: d = ""
        print(t, "OPEN", d, flush=True)
    except Exception as e:
        print(t, "FAIL", type(e).__name__, e, flush=True)
    finally:
        s.close()
"#;

async fn probe(
    node: &Node,
    id: &str,
    targets: &[SocketAddr],
) -> anyhow::Result<Vec<(SocketAddr, bool, String)>> {
    let args: Vec<String> = targets.iter().map(|t| q(&t.to_string())).collect();
    let o = bash(
        node,
        id,
        None,
        &format!("python3 -c {} {}", q(CONNECT_PROBE), args.join(" ")),
        Duration::from_secs(5 + 4 * targets.len() as u64),
    )
    .await?;
    let mut res = Vec::new();
    for t in targets {
        let line = o
            .out
            .lines()
            .find(|l| l.starts_with(&format!("{t} ")))
            .ok_or_else(|| anyhow::anyhow!("no result for {t}: {}{}", o.out, o.err))?;
        let rest = line[t.to_string().len()..].trim().to_string();
        res.push((*t, rest.starts_with("OPEN"), rest));
    }
    Ok(res)
}

fn host_primary_ipv4() -> Option<Ipv4Addr> {
    let o = Command::new("ip")
        .args(["-4", "-o", "addr", "show", "scope", "global"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter(|l| !l.contains(" cbs") && !l.contains(" cbl") && !l.contains(" cbt"))
        .filter_map(|l| l.split_whitespace().nth(3)?.split('/').next()?.parse().ok())
        .next()
}

async fn network(ctx: Arc<Ctx>) -> TestResult {
    let node = &ctx.node;
    let net = match Network::new(NetworkConfig::default()) {
        Ok(n) => n,
        Err(e) => {
            println!("  SKIPPED: no sandbox networking: {e}");
            return Ok(());
        }
    };
    if Command::new("nft").arg("--version").output().is_err() {
        println!("  SKIPPED: the `nft` binary (nftables package) is not installed");
        return Ok(());
    }
    let a = node
        .create(CreateRequest {
            internet: true,
            ..base()
        })
        .await?;
    let b = node
        .create(CreateRequest {
            internet: true,
            ..base()
        })
        .await?;
    let c = node
        .create(CreateRequest {
            internet: false,
            ..base()
        })
        .await?;
    let res = network_checks(&ctx, &net, &a, &b, &c).await;
    for s in [&a, &b, &c] {
        let r = kill_and_check(&ctx, s, DeathReason::Killed).await;
        if res.is_ok() {
            r?;
        }
    }
    res
}

async fn network_checks(
    ctx: &Ctx,
    net: &Network,
    a: &SandboxInfo,
    b: &SandboxInfo,
    c: &SandboxInfo,
) -> TestResult {
    let node = &ctx.node;
    let ia = net.slot_info(slot_of(a.uid_base))?;
    let ib = net.slot_info(slot_of(b.uid_base))?;
    let inet = TestInternet::new(
        "abuse",
        INET_NET,
        &[ia.host_ifname.clone(), ib.host_ifname.clone()],
    )?;
    let inet_srv = inet.server(Serve::Peer)?;
    let lo_srv = Server::start(TcpListener::bind("127.0.0.1:0")?)?;
    let gw_srv = Server::start(TcpListener::bind(SocketAddrV4::new(ia.gateway, 0))?)?;
    let primary_srv = match host_primary_ipv4() {
        Some(ip) => Some(Server::start(TcpListener::bind(SocketAddrV4::new(ip, 0))?)?),
        None => None,
    };
    // A server in B, on all its addresses.
    let o = bash(
        node,
        &b.id,
        None,
        "nohup python3 -c 'import socket\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind((\"0.0.0.0\", 8080))\ns.listen()\nwhile 1:\n c,a=s.accept(); c.send(b\"from-B\"); c.close()' >/dev/null 2>&1 </dev/null & sleep 0.5; echo started",
        Duration::from_secs(10),
    )
    .await?;
    anyhow::ensure!(o.out.contains("started"), "{}{}", o.out, o.err);
    let b_srv = SocketAddr::V4(SocketAddrV4::new(ib.sandbox_ip, 8080));
    // B's server really listens (from inside B).
    let own = probe(
        node,
        &b.id,
        &[SocketAddr::from(([127, 0, 0, 1], 8080)), b_srv],
    )
    .await?;
    anyhow::ensure!(
        own.iter().all(|r| r.1 && r.2.contains("from-B")),
        "B's server: {own:?}"
    );

    // From A (internet on).
    let mut targets = vec![
        inet_srv.addr,
        SocketAddr::from(([127, 0, 0, 1], lo_srv.addr.port())),
        gw_srv.addr,
        SocketAddr::V4(SocketAddrV4::new(ib.gateway, gw_srv.addr.port())),
        b_srv,
    ];
    if let Some(p) = &primary_srv {
        targets.push(p.addr);
    }
    let from_a = probe(node, &a.id, &targets).await?;
    for (t, open, text) in &from_a {
        println!("  A -> {t}: {text}");
        if *t == inet_srv.addr {
            anyhow::ensure!(
                *open,
                "A (internet on) cannot reach the test internet host: {text}"
            );
            anyhow::ensure!(
                text.contains(&format!("{}:", inet.gateway)),
                "egress not masqueraded: {text}"
            );
        } else {
            anyhow::ensure!(!open, "A reached {t}: {text}");
        }
    }
    // B with internet on reaches the internet too; C (internet off) does not.
    let from_b = probe(node, &b.id, &[inet_srv.addr]).await?;
    anyhow::ensure!(
        from_b[0].1,
        "B cannot reach the internet host: {}",
        from_b[0].2
    );
    let from_c = probe(
        node,
        &c.id,
        &[
            inet_srv.addr,
            b_srv,
            SocketAddr::from(([127, 0, 0, 1], lo_srv.addr.port())),
        ],
    )
    .await?;
    for (t, open, text) in &from_c {
        println!("  C (no internet) -> {t}: {text}");
        anyhow::ensure!(!open, "C (internet off) reached {t}: {text}");
    }
    // C was made without an interface: a policy that allows the internet host gives it
    // one (netlink takes only a namespace file as the new link's peer, never a pidfd:
    // EINVAL once) and reaches only that host.
    anyhow::ensure!(
        !bash(node, &c.id, None, "ip -o link", Duration::from_secs(10))
            .await?
            .out
            .contains("eth0"),
        "C (internet off, made cold) has an interface"
    );
    let only_inet = cubicle_node::NetworkPolicy {
        allow_out: vec![inet.host_ip.to_string().parse()?],
        deny_out: vec!["0.0.0.0/0".parse()?],
        ..Default::default()
    };
    node.update_network(&c.id, only_inet).await?;
    let from_c = probe(node, &c.id, &[inet_srv.addr, b_srv]).await?;
    anyhow::ensure!(
        from_c[0].1 && !from_c[1].1,
        "C after the update: {from_c:?}"
    );
    anyhow::ensure!(
        inet_srv.hits() == 3,
        "internet host saw {} connections, want 3",
        inet_srv.hits()
    );
    anyhow::ensure!(
        lo_srv.hits() == 0
            && gw_srv.hits() == 0
            && primary_srv.as_ref().is_none_or(|p| p.hits() == 0),
        "a host server was reached: lo {} veth {} primary {:?}",
        lo_srv.hits(),
        gw_srv.hits(),
        primary_srv.as_ref().map(Server::hits)
    );
    let guard = inet.guard_count()?;
    anyhow::ensure!(
        guard == 0,
        "{guard} sandbox packets tried to leave the machine"
    );
    unaffected(ctx, b, "the network probes").await?;
    Ok(())
}
