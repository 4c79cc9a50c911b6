//! End-to-end node lifecycle on the real kernel, with the `tiny` template and the real
//! `cubicle-envd` as PID 1: create → envd ready → run `id` through envd → uid=0 → kill →
//! nothing left; 50 create/destroy cycles leave nothing; end-time enforcement; a node
//! reopened on the same state adopts a live sandbox.
//!
//! Needs root (namespaces, cgroups), busybox-static and a statically linked cubicle-envd
//! (built with scripts/build-envd.sh if missing). Run: `cargo test -p cubicle-node --test
//! lifecycle [-- FILTER]`. `harness = false`: main() first hands over to the runtime's
//! sandbox helper (spawn re-executes this binary).

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cubicle_node::{
    CreateRequest, DeathReason, Node, NodeConfig, ProcessEvent, ProcessSpec, SandboxState,
};

type TestResult = anyhow::Result<()>;
type TestFn = common::TestFn<PathBuf>;

fn main() {
    let Some(h) = common::Harness::start(
        "lifecycle",
        "user namespaces with uid ranges, cgroups, mounts",
        &["/bin/busybox"],
    ) else {
        return;
    };
    let tests: Vec<(&str, TestFn)> = vec![
        ("create_run_id_kill_leaves_nothing", |e| {
            Box::pin(create_run_id_kill_leaves_nothing(e))
        }),
        ("fifty_cycles_leave_nothing", |e| {
            Box::pin(fifty_cycles_leave_nothing(e))
        }),
        ("end_time_is_enforced", |e| {
            Box::pin(end_time_is_enforced(e))
        }),
        ("init_exit_is_noticed", |e| {
            Box::pin(init_exit_is_noticed(e))
        }),
        ("pid1_reaps_orphans_keeps_exit_codes", |e| {
            Box::pin(pid1_reaps_orphans_keeps_exit_codes(e))
        }),
        ("reopen_adopts_live_and_removes_dead", |e| {
            Box::pin(reopen_adopts_live_and_removes_dead(e))
        }),
        ("limits_are_counted_and_name_the_death", |e| {
            Box::pin(limits_are_counted_and_name_the_death(e))
        }),
        ("template_start_command_runs", |e| {
            Box::pin(template_start_command_runs(e))
        }),
    ];
    // A failed test returns early, before its own cleanup: kill what it left.
    h.run(h.envd.clone(), tests, |rt| {
        rt.block_on(sweep(&h.envd));
        Ok(())
    })
    .finish();
}

/// A node on a fresh state dir, with its own slot range (so it never collides with
/// another node or test on this host) and no reaping of foreign cgroups.
async fn node(envd: &Path, name: &str, first_slot: u32) -> anyhow::Result<(Node, PathBuf)> {
    let state = PathBuf::from(format!("/tmp/cbnt-{}-{name}", std::process::id()));
    OPENED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((state.clone(), first_slot));
    Ok((
        Node::open(node_config(envd, &state, first_slot)).await?,
        state,
    ))
}

fn node_config(envd: &Path, state: &Path, first_slot: u32) -> NodeConfig {
    let mut cfg = NodeConfig::new(state, envd);
    cfg.first_slot = first_slot;
    cfg.max_sandboxes = 64;
    cfg.any_free_slots = true;
    // These tests check that a slot is free again right after cleanup; the rest a freed
    // slot gets in normal runs (so addresses are not reused at once) is tested in
    // slots.rs and the network e2e suite.
    cfg.network.address_quarantine = std::time::Duration::ZERO;
    cfg
}

/// The state dirs [`node`] opened (with their first slot), for [`sweep`].
static OPENED: std::sync::Mutex<Vec<(PathBuf, u32)>> = std::sync::Mutex::new(Vec::new());

/// Reopens every state dir a test left behind, kills its sandboxes and removes it
/// (unmounting its quota filesystem), so a failing test leaks nothing either.
async fn sweep(envd: &Path) {
    let opened = std::mem::take(&mut *OPENED.lock().unwrap_or_else(|e| e.into_inner()));
    for (state, first_slot) in opened {
        if !state.exists() {
            continue;
        }
        match Node::open(node_config(envd, &state, first_slot)).await {
            Ok(node) => {
                node.kill_all().await;
                node.close();
            }
            Err(e) => eprintln!("  sweep: reopen {}: {e:#}", state.display()),
        }
        cleanup_state(&state);
    }
}

fn cleanup_state(state: &Path) {
    let _ = cubicle_node::fsutil::remove_tree(state);
}

fn tiny() -> CreateRequest {
    CreateRequest {
        template: "tiny".into(),
        ..Default::default()
    }
}

/// Run a command as root through envd; (stdout, stderr, exit code).
async fn sh(node: &Node, id: &str, script: &str) -> anyhow::Result<(String, String, i32)> {
    let client = node.envd(id)?;
    let spec = ProcessSpec {
        cmd: "/bin/sh".into(),
        args: vec!["-c".into(), script.into()],
        user: Some("root".into()),
        ..Default::default()
    };
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let end = client
        .run(&spec, |ev| match ev {
            ProcessEvent::Stdout(b) => out.extend(b),
            ProcessEvent::Stderr(b) => err.extend(b),
            ProcessEvent::Start(_) => {}
        })
        .await?;
    Ok((
        String::from_utf8_lossy(&out).into(),
        String::from_utf8_lossy(&err).into(),
        end.exit_code,
    ))
}

fn assert_no_traces(state: &Path, id: &str, slot: Option<u32>, pid: Option<i32>) -> TestResult {
    let t = cubicle_node::traces::leftovers(state, id, slot, pid);
    anyhow::ensure!(t.is_empty(), "sandbox {id} left traces: {t:?}");
    Ok(())
}

fn slot_of(uid_base: u32) -> u32 {
    (uid_base - 200_000) / 65536
}

async fn create_run_id_kill_leaves_nothing(envd: PathBuf) -> TestResult {
    let (node, state) = node(&envd, "basic", 3000).await?;
    let internet = cubicle_runtime::network::Network::new(Default::default()).is_ok();
    // `a`'s variables are too large to be given to envd at its birth (an `/init` tells
    // it); `b`'s are given there (no `/init`).
    let big = "x".repeat(40 << 10);
    let a = node
        .create(CreateRequest {
            internet,
            env_vars: [("CB_BIG".to_string(), big.clone())].into(),
            ..tiny()
        })
        .await?;
    let b = node
        .create(CreateRequest {
            env_vars: [("CB_COLD".to_string(), "cold".to_string())].into(),
            ..tiny()
        })
        .await?;
    println!(
        "  create->envd ready: {:.2} ms / {:.2} ms",
        a.ready_us as f64 / 1e3,
        b.ready_us as f64 / 1e3
    );
    anyhow::ensure!(a.state == SandboxState::Running);
    // A cold create keeps the connection its ready check (and `/init`, if any) went
    // over, for the first request (the data plane's), once; `a` keeps its own until it
    // is killed.
    let kept = node.take_envd_conn(&b.id);
    anyhow::ensure!(
        kept.as_ref()
            .is_some_and(cubicle_node::envd_client::is_idle_open),
        "no open kept connection to envd"
    );
    anyhow::ensure!(node.take_envd_conn(&b.id).is_none(), "handed out twice");
    anyhow::ensure!(
        a.uid_base != b.uid_base,
        "two sandboxes share uid range {}",
        a.uid_base
    );
    anyhow::ensure!(a.uid_base >= 200_000 && (a.uid_base - 200_000) % 65536 == 0);

    let (out, err, code) = sh(
        &node,
        &a.id,
        "id; hostname; touch /tmp/made-by-root; ps | wc -l",
    )
    .await?;
    anyhow::ensure!(code == 0, "exit {code}, stderr {err}");
    anyhow::ensure!(out.contains("uid=0(root)"), "id printed {out:?}");
    anyhow::ensure!(
        out.contains(a.id.as_str()),
        "hostname is not the sandbox id: {out:?}"
    );
    // A file root creates is owned on the host by the sandbox's unprivileged range.
    let upper_file = node.sandbox_dir(&a.id).join("upper/tmp/made-by-root");
    let meta = std::fs::metadata(&upper_file)?;
    use std::os::unix::fs::MetadataExt;
    anyhow::ensure!(
        meta.uid() == a.uid_base,
        "file owned by host uid {} not {}",
        meta.uid(),
        a.uid_base
    );
    // Non-zero exit codes come through.
    let (_, _, code) = sh(&node, &b.id, "exit 7").await?;
    anyhow::ensure!(code == 7, "exit code {code}");
    // Env vars from create reach processes, by either way.
    let (out, _, _) = sh(&node, &b.id, "echo \"$E2B_SANDBOX_ID|$CB_COLD\"").await?;
    anyhow::ensure!(out.trim() == format!("{}|cold", b.id), "born with: {out:?}");
    let (out, _, _) = sh(&node, &a.id, "echo \"$E2B_SANDBOX_ID|${#CB_BIG}\"").await?;
    anyhow::ensure!(
        out.trim() == format!("{}|{}", a.id, big.len()),
        "told by /init: {out:?}"
    );

    anyhow::ensure!(node.list().len() == 2);
    for s in [&a, &b] {
        node.kill(&s.id).await?;
        let dead = node.get(&s.id)?;
        anyhow::ensure!(
            dead.state == SandboxState::Dead && dead.death_reason == Some(DeathReason::Killed)
        );
        assert_no_traces(&state, &s.id, Some(slot_of(s.uid_base)), s.pid)?;
    }
    anyhow::ensure!(node.list().is_empty());
    anyhow::ensure!(matches!(
        node.kill(&a.id).await,
        Err(cubicle_node::Error::SandboxNotFound(_))
    ));
    node.close();
    cleanup_state(&state);
    Ok(())
}

async fn fifty_cycles_leave_nothing(envd: PathBuf) -> TestResult {
    let (node, state) = node(&envd, "cycles", 3100).await?;
    // CUBICLE_TEST_CYCLES=500 for the longer run.
    let n: usize = std::env::var("CUBICLE_TEST_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50)
        .max(2);
    let mut seen = Vec::new();
    let mut lat = Vec::new();
    for i in 0..n {
        let s = node.create(tiny()).await?;
        lat.push(s.ready_us);
        if i % 10 == 0 {
            let (out, _, _) = sh(&node, &s.id, "id -u").await?;
            anyhow::ensure!(out.trim() == "0");
        }
        node.kill(&s.id).await?;
        seen.push((s.id, s.uid_base, s.pid));
    }
    lat.sort();
    println!(
        "  {n} cycles: create->ready p50 {:.2} ms, max {:.2} ms",
        lat[n / 2] as f64 / 1e3,
        lat[n - 1] as f64 / 1e3
    );
    for (id, uid_base, pid) in &seen {
        assert_no_traces(&state, id, Some(slot_of(*uid_base)), *pid)?;
    }
    // Slots are reused after cleanup: every cycle got the same (first) slot.
    anyhow::ensure!(
        seen.iter().all(|(_, u, _)| *u == seen[0].1),
        "slots not reused"
    );
    let left: Vec<_> = std::fs::read_dir(state.join("sandboxes"))?
        .flatten()
        .map(|e| e.file_name())
        .collect();
    anyhow::ensure!(left.is_empty(), "sandboxes dir not empty: {left:?}");
    node.close();
    cleanup_state(&state);
    Ok(())
}

async fn end_time_is_enforced(envd: PathBuf) -> TestResult {
    let (node, state) = node(&envd, "timeout", 3200).await?;
    let s = node
        .create(CreateRequest {
            timeout: Some(Duration::from_millis(1500)),
            ..tiny()
        })
        .await?;
    let keep = node
        .create(CreateRequest {
            timeout: Some(Duration::from_secs(60)),
            ..tiny()
        })
        .await?;
    let t = Instant::now();
    loop {
        let info = node.get(&s.id)?;
        if info.state == SandboxState::Dead {
            anyhow::ensure!(
                info.death_reason == Some(DeathReason::Timeout),
                "reason {:?}",
                info.death_reason
            );
            break;
        }
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(6),
            "sandbox outlived its end time"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "  killed {:.2}s after create (timeout 1.5s)",
        t.elapsed().as_secs_f64()
    );
    assert_no_traces(&state, &s.id, Some(slot_of(s.uid_base)), s.pid)?;
    anyhow::ensure!(
        node.get(&keep.id)?.state == SandboxState::Running,
        "the other sandbox died too"
    );
    // set_timeout extends/shortens.
    node.set_timeout(&keep.id, Duration::from_millis(200))?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    anyhow::ensure!(node.get(&keep.id)?.death_reason == Some(DeathReason::Timeout));
    assert_no_traces(&state, &keep.id, Some(slot_of(keep.uid_base)), keep.pid)?;
    node.close();
    cleanup_state(&state);
    Ok(())
}

async fn init_exit_is_noticed(envd: PathBuf) -> TestResult {
    let (node, state) = node(&envd, "exit", 3300).await?;
    let s = node.create(tiny()).await?;
    // Kill the sandbox's init from the host: the node notices through its pidfd.
    let pid = s.pid.ok_or_else(|| anyhow::anyhow!("no pid"))?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    let t = Instant::now();
    loop {
        if let Ok(i) = node.get(&s.id)
            && i.state == SandboxState::Dead
        {
            anyhow::ensure!(
                i.death_reason == Some(DeathReason::Exited),
                "reason {:?}",
                i.death_reason
            );
            break;
        }
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(5),
            "init exit not noticed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_no_traces(&state, &s.id, Some(slot_of(s.uid_base)), s.pid)?;
    node.close();
    cleanup_state(&state);
    Ok(())
}

/// States (`R`, `S`, `Z`, …) of every process in sandbox `id`'s cgroup.
fn sandbox_proc_states(id: &str) -> Vec<(i32, char)> {
    cubicle_node::traces::pids(id)
        .into_iter()
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let state = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
            Some((pid, state))
        })
        .collect()
}

/// envd is PID 1 itself: orphans re-parented to it are reaped, while the exit codes of
/// the processes it started (reaped by its process supervisor) are never taken from it;
/// SIGTERM from the host ends the sandbox.
async fn pid1_reaps_orphans_keeps_exit_codes(envd: PathBuf) -> TestResult {
    let (node, state) = node(&envd, "orphans", 3600).await?;
    let s = node.create(tiny()).await?;
    let r = async {
        // Concurrent commands, each leaving orphans that exit at once or a bit later.
        let mut set = tokio::task::JoinSet::new();
        for i in 0..40 {
            let (node, id) = (node.clone(), s.id.clone());
            set.spawn(async move {
                let code = i % 50 + 1;
                let script = format!("(sleep 0.0$((RANDOM % 9)); exit 9) & (exit 0) & exit {code}");
                let (_, err, got) = sh(&node, &id, &script).await?;
                anyhow::ensure!(
                    got == code,
                    "command {i}: exit {got}, wanted {code} ({err})"
                );
                Ok(())
            });
        }
        while let Some(r) = set.join_next().await {
            r??;
        }
        // Every orphan gets reaped: only envd is left, and no zombie.
        let t = Instant::now();
        loop {
            let st = sandbox_proc_states(&s.id);
            if st.len() == 1 && st.iter().all(|(_, c)| *c != 'Z') {
                break;
            }
            anyhow::ensure!(
                t.elapsed() < Duration::from_secs(3),
                "left in the sandbox: {st:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // SIGTERM to PID 1 (which has a handler: PID 1 ignores others) ends the sandbox.
        let pid = s.pid.ok_or_else(|| anyhow::anyhow!("no pid"))?;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        let t = Instant::now();
        while node.get(&s.id).is_ok_and(|i| i.state != SandboxState::Dead) {
            anyhow::ensure!(
                t.elapsed() < Duration::from_secs(5),
                "SIGTERM did not end the sandbox"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_no_traces(&state, &s.id, Some(slot_of(s.uid_base)), s.pid)
    }
    .await;
    node.kill_all().await;
    node.close();
    cleanup_state(&state);
    r
}

async fn reopen_adopts_live_and_removes_dead(envd: PathBuf) -> TestResult {
    let (node, state) = node(&envd, "reopen", 3400).await?;
    let first_slot = node.config().first_slot;
    let live = node.create(tiny()).await?;
    let doomed = node.create(tiny()).await?;
    // Simulate a crash: the node goes away without cleaning (with `live` frozen, as a crash
    // mid-snapshot or mid-kill leaves it); `doomed`'s init dies meanwhile.
    cubicle_runtime::Cgroup::handle(&live.id)?.freeze(Duration::from_secs(2))?;
    node.close();
    drop(node);
    let pid = doomed.pid.ok_or_else(|| anyhow::anyhow!("no pid"))?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    // Give the kernel a moment; the zombie is ours (CLONE_PARENT) and reaped by destroy.
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The same slots: the sandboxes' (a stopped node with live sandboxes keeps them).
    let mut cfg = NodeConfig::new(&state, &envd);
    cfg.first_slot = first_slot;
    cfg.max_sandboxes = 64;
    let node = Node::open(cfg).await?;
    let report = node.reconcile_report();
    anyhow::ensure!(
        report.adopted == vec![live.id.to_string()],
        "adopted {:?}",
        report.adopted
    );
    anyhow::ensure!(
        report.removed.contains(&doomed.id.to_string()),
        "removed {:?}",
        report.removed
    );
    assert_no_traces(
        &state,
        &doomed.id,
        Some(slot_of(doomed.uid_base)),
        doomed.pid,
    )?;
    // Adopted and thawed: it answers (a frozen envd would hang this request).
    let (out, _, _) = tokio::time::timeout(Duration::from_secs(5), sh(&node, &live.id, "id -u"))
        .await
        .map_err(|_| anyhow::anyhow!("adopted sandbox still frozen: no answer in 5 s"))??;
    anyhow::ensure!(
        out.trim() == "0",
        "adopted sandbox does not answer: {out:?}"
    );
    // A new sandbox does not get the adopted one's uid range.
    let fresh = node.create(tiny()).await?;
    anyhow::ensure!(fresh.uid_base != live.uid_base);
    node.kill(&live.id).await?;
    node.kill(&fresh.id).await?;
    assert_no_traces(&state, &live.id, Some(slot_of(live.uid_base)), live.pid)?;
    assert_no_traces(&state, &fresh.id, Some(slot_of(fresh.uid_base)), fresh.pid)?;
    node.close();
    cleanup_state(&state);
    Ok(())
}

/// Wait until `id` is dead; its reason.
async fn death_of(node: &Node, id: &str) -> anyhow::Result<Option<DeathReason>> {
    let t = Instant::now();
    loop {
        if let Ok(i) = node.get(id)
            && i.state == SandboxState::Dead
        {
            return Ok(i.death_reason);
        }
        anyhow::ensure!(t.elapsed() < Duration::from_secs(5), "{id} did not die");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn limits_are_counted_and_name_the_death(envd: PathBuf) -> TestResult {
    let (node, state) = node(&envd, "limits", 3500).await?;
    // Memory: a 64 MiB string in a 32 MiB sandbox gets the shell OOM-killed; the sandbox
    // lives on and counts it; when its init dies afterwards, the reason is `oom`.
    let m = node
        .create(CreateRequest {
            memory_mb: Some(32),
            ..tiny()
        })
        .await?;
    // What envd (PID 1) starts is the OOM killer's likelier victim, not envd.
    let (scores, _, _) = sh(
        &node,
        &m.id,
        "cat /proc/1/oom_score_adj /proc/self/oom_score_adj",
    )
    .await?;
    anyhow::ensure!(
        scores.split_whitespace().collect::<Vec<_>>() == ["0", "500"],
        "OOM scores of envd and of a command: {scores:?}"
    );
    let (_, _, code) = sh(
        &node,
        &m.id,
        "x=$(head -c 67108864 /dev/zero | tr '\\0' a); echo survived",
    )
    .await?;
    anyhow::ensure!(code != 0, "the memory hog was not killed");
    let st = node.stats(&m.id)?;
    anyhow::ensure!(st.oom_kills >= 1, "no OOM kill counted: {st:?}");
    let (out, _, _) = sh(&node, &m.id, "echo alive").await?;
    anyhow::ensure!(out.trim() == "alive");
    let pid = m.pid.ok_or_else(|| anyhow::anyhow!("no pid"))?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    anyhow::ensure!(death_of(&node, &m.id).await? == Some(DeathReason::Oom));
    assert_no_traces(&state, &m.id, Some(slot_of(m.uid_base)), m.pid)?;

    // Disk: writing past the quota fails; an init death with a full disk is `disk_full`.
    let d = node
        .create(CreateRequest {
            disk_mb: Some(20),
            ..tiny()
        })
        .await?;
    let st = node.stats(&d.id)?;
    if st.disk_limit_bytes.is_none() {
        println!("  disk quota part SKIPPED: no quota filesystem on this host");
    } else {
        let (_, err, code) =
            sh(&node, &d.id, "dd if=/dev/zero of=/tmp/fill bs=1M count=40").await?;
        anyhow::ensure!(code != 0, "wrote 40 MiB into a 20 MiB quota");
        anyhow::ensure!(
            err.contains("quota") || err.contains("space"),
            "dd said {err:?}"
        );
        let pid = d.pid.ok_or_else(|| anyhow::anyhow!("no pid"))?;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        )?;
        anyhow::ensure!(death_of(&node, &d.id).await? == Some(DeathReason::DiskFull));
        assert_no_traces(&state, &d.id, Some(slot_of(d.uid_base)), d.pid)?;
    }
    node.close();
    cleanup_state(&state);
    Ok(())
}

async fn template_start_command_runs(envd: PathBuf) -> TestResult {
    let (node, state) = node(&envd, "start", 3550).await?;
    // A template derived from tiny, with a start command.
    let (mut cfg, dir) = common::derived_template(
        &node,
        &state,
        "tinystart",
        "echo started > /tmp/started; exec sleep 1000",
        None,
    )?;
    let s = node
        .create(CreateRequest {
            template: "tinystart".into(),
            ..Default::default()
        })
        .await?;
    let t = Instant::now();
    loop {
        let (out, _, _) = sh(
            &node,
            &s.id,
            "cat /tmp/started 2>/dev/null; ps -o args | grep -c '^sleep 1000'",
        )
        .await?;
        if out.starts_with("started\n") && out.trim_end().ends_with('1') {
            break;
        }
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(5),
            "start command did not run: {out:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    node.kill(&s.id).await?;
    assert_no_traces(&state, &s.id, Some(slot_of(s.uid_base)), s.pid)?;

    // A start command that fails before its ready port answers: the create fails at
    // once (not after the 120 s readiness timeout), saying how it ended and what it
    // printed, and leaves nothing.
    cfg.start_command = Some("echo cb-start-marker >&2; exit 3".into());
    cfg.ready_port = Some(8080);
    cubicle_node::fsutil::write_json_atomic(&dir.join("template.json"), &cfg)?;
    let t = Instant::now();
    let e = node
        .create(CreateRequest {
            template: "tinystart".into(),
            ..Default::default()
        })
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("a failing start command made a ready sandbox"))?
        .to_string();
    anyhow::ensure!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    anyhow::ensure!(
        e.contains("start command failed") && e.contains("code 3") && e.contains("cb-start-marker"),
        "error: {e}"
    );
    anyhow::ensure!(node.list().is_empty(), "left: {:?}", node.list());
    node.close();
    cleanup_state(&state);
    Ok(())
}
