//! The `cubicle` binary end to end (as root): `run -- id`, exit codes, `--keep` +
//! `local list` + `local kill`, a node killed with SIGKILL mid-create followed by a new
//! `Node::open` that reconciles everything (each kind of trace checked), a `run` killed
//! with SIGKILL whose sandbox dies with it, and `run` on a state directory another
//! process holds (fails at once, saying what to do).
//!
//! Skips (saying why) when not root, without busybox-static, or without a statically
//! linked cubicle-envd (scripts/build-envd.sh builds it).

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use cubicle_node::{Node, NodeConfig, SandboxRecord};

const BIN: &str = env!("CARGO_BIN_EXE_cubicle");

fn ready() -> Option<PathBuf> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root (namespaces, cgroups)");
        return None;
    }
    if !Path::new("/bin/busybox").exists() {
        eprintln!("skipped: /bin/busybox missing (busybox-static)");
        return None;
    }
    let exe_dir = Path::new(BIN).parent()?.to_path_buf();
    let envd = exe_dir
        .parent()?
        .join("x86_64-unknown-linux-gnu")
        .join(exe_dir.file_name()?)
        .join("cubicle-envd");
    if !cubicle_node::config::is_static_elf(&envd) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/build-envd.sh");
        let ok = Command::new("bash")
            .arg(&script)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(
            ok,
            "building the static envd with {} failed",
            script.display()
        );
    }
    Some(envd)
}

fn cubicle(state: &Path, slot: u32) -> Command {
    let mut c = Command::new(BIN);
    c.env("CUBICLE_STATE_DIR", state)
        .env("CUBICLE_FIRST_SLOT", slot.to_string())
        .env("CUBICLE_MAX_SANDBOXES", "16")
        .env("CUBICLE_ANY_FREE_SLOTS", "true")
        .env_remove("CUBICLE_LOG");
    c
}

fn state_dir(name: &str) -> PathBuf {
    PathBuf::from(format!("/tmp/cbct-{}-{name}", std::process::id()))
}

#[test]
fn run_id_exit_code_keep_list_kill() {
    let Some(_envd) = ready() else { return };
    let state = state_dir("run");
    let out = cubicle(&state, 3600)
        .args(["run", "--template", "tiny", "--", "id"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("uid=0(root) gid=0(root)"), "{stdout}");

    let out = cubicle(&state, 3600)
        .args([
            "run",
            "--template",
            "tiny",
            "--no-internet",
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 42",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(42));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\n");
    assert!(String::from_utf8_lossy(&out.stderr).contains("err\n"));

    let out = cubicle(&state, 3600)
        .args(["run", "--template", "tiny", "--keep", "--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(cubicle_node::SandboxId::is_valid(&id), "{id:?}");
    let list = cubicle(&state, 3600)
        .args(["local", "list"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&list.stdout).contains(&id),
        "kept sandbox not listed"
    );
    let kill = cubicle(&state, 3600)
        .args(["local", "kill", &id])
        .output()
        .unwrap();
    assert!(
        kill.status.success(),
        "{}",
        String::from_utf8_lossy(&kill.stderr)
    );
    let t = cubicle_node::traces::leftovers(&state, &id, None, None);
    assert!(t.is_empty(), "{t:?}");
    let list = cubicle(&state, 3600)
        .args(["local", "list"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&list.stdout).contains(&id));
    let _ = cubicle_node::fsutil::remove_tree(&state);
}

#[test]
fn sigkill_mid_create_then_reopen_leaves_nothing() {
    let Some(envd) = ready() else { return };
    let state = state_dir("crash");
    let slot = 3700;
    // Build the template first so the kills land in sandbox creation, not the build.
    let st = cubicle(&state, slot)
        .args(["template", "build", "tiny"])
        .output()
        .unwrap();
    assert!(st.status.success());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (mut adopted, mut removed) = (0, 0);
    // Kills at fixed times after the start (some land before the create begins), then
    // at times after the sandbox's directory appeared: how long `cubicle run` takes to
    // get there depends on the host's load (over 400 ms on a busy 2-core machine), so
    // only the second kind is sure to land inside the create.
    let after_start = [
        0u64, 5, 15, 30, 40, 50, 60, 70, 80, 90, 100, 120, 150, 250, 400,
    ];
    let after_dir = [0u64, 0, 2, 5, 10, 20, 40, 80];
    let delays = after_start
        .iter()
        .map(|d| (false, *d))
        .chain(after_dir.iter().map(|d| (true, *d)));
    for (from_dir, delay_ms) in delays {
        // --keep: no guardian (see `sigkill_of_run_kills_its_sandbox`): this is the
        // node's own crash recovery.
        let mut child = cubicle(&state, slot)
            .args(["run", "--template", "tiny", "--keep", "--", "sleep", "30"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        if from_dir {
            let t = std::time::Instant::now();
            while t.elapsed() < Duration::from_secs(10)
                && std::fs::read_dir(state.join("sandboxes"))
                    .map(|rd| {
                        !rd.flatten()
                            .any(|e| !e.file_name().to_string_lossy().starts_with(".creating-"))
                    })
                    .unwrap_or(true)
            {
                std::thread::sleep(Duration::from_micros(500));
            }
        }
        std::thread::sleep(Duration::from_millis(delay_ms));
        let _ = child.kill(); // SIGKILL
        let _ = child.wait();
        // A restart takes a moment; let an in-flight helper finish or die.
        std::thread::sleep(Duration::from_millis(200));
        let records: Vec<SandboxRecord> = cubicle_node::records_on_disk(&state);
        let ids: Vec<String> = std::fs::read_dir(state.join("sandboxes"))
            .map(|rd| {
                // A half-made quota directory (`.creating-<id>`) is the storage's to
                // remove at reopen, not a sandbox: the emptiness check below covers it.
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| !n.starts_with(".creating-"))
                    .collect()
            })
            .unwrap_or_default();
        rt.block_on(async {
            let mut cfg = NodeConfig::new(&state, &envd);
            cfg.first_slot = slot;
            cfg.max_sandboxes = 16;
            cfg.any_free_slots = true;
            let node = Node::open(cfg).await.unwrap();
            let report = node.reconcile_report();
            for id in &ids {
                assert!(
                    report.adopted.contains(id) || report.removed.contains(id),
                    "delay {delay_ms}: {id} neither adopted nor removed: {report:?}"
                );
            }
            adopted += report.adopted.len();
            removed += report.removed.len();
            for id in report.adopted.clone() {
                node.kill(&id).await.unwrap();
            }
            for id in &ids {
                let r = records.iter().find(|r| &r.id == id);
                let t = cubicle_node::traces::leftovers(
                    &state,
                    id,
                    r.map(|r| r.slot),
                    r.and_then(|r| r.pid),
                );
                assert!(t.is_empty(), "delay {delay_ms}: {id} left {t:?}");
            }
            assert!(node.list().is_empty());
            node.close();
        });
        // No mount below the state dir except the sandboxes' quota filesystem itself.
        let mounts: Vec<_> = cubicle_node::fsutil::mounts_under(&state)
            .into_iter()
            .filter(|m| m != &state.join("sandboxes"))
            .collect();
        assert!(
            mounts.is_empty(),
            "delay {delay_ms}: mounts left {mounts:?}"
        );
        let left: Vec<_> = std::fs::read_dir(state.join("sandboxes"))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .collect();
        assert!(left.is_empty(), "delay {delay_ms}: left {left:?}");
    }
    eprintln!("crash test: {adopted} sandboxes adopted (then killed), {removed} removed");
    assert!(removed > 0, "no kill landed mid-create");
    let _ = cubicle_node::fsutil::remove_tree(&state);
}

/// Issue 10, item 6: a `cubicle run` killed with SIGKILL — while it creates the
/// sandbox, or while its command runs — takes its sandbox with it: no process of it
/// survives the next second, and every trace (cgroup, directory, veth, mounts) is gone
/// soon after, without any later command reconciling.
#[test]
fn sigkill_of_run_kills_its_sandbox() {
    let Some(_envd) = ready() else { return };
    let state = state_dir("runkill");
    let slot = 3800;
    let st = cubicle(&state, slot)
        .args(["template", "build", "tiny"])
        .output()
        .unwrap();
    assert!(st.status.success());
    // None: kill once the command runs; Some(ms): that long after the start (mid-create).
    for delay in [None, Some(40u64), Some(90), None] {
        let mut child = cubicle(&state, slot)
            .args(["run", "--template", "tiny", "--", "sleep", "600"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut running = None;
        match delay {
            Some(ms) => std::thread::sleep(Duration::from_millis(ms)),
            None => {
                let t = std::time::Instant::now();
                while running.is_none() {
                    running = cubicle_node::records_on_disk(&state).into_iter().find(|r| {
                        r.state == cubicle_node::SandboxState::Running
                            && r.pid
                                .is_some_and(|p| cubicle_node::procfs::is_alive(p, None))
                    });
                    assert!(t.elapsed() < Duration::from_secs(20), "the run never ran");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        let ids: Vec<String> = std::fs::read_dir(state.join("sandboxes"))
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| cubicle_node::SandboxId::is_valid(n))
                    .collect()
            })
            .unwrap_or_default();
        let records = cubicle_node::records_on_disk(&state);
        child.kill().unwrap();
        let killed = std::time::Instant::now();
        let _ = child.wait();
        if let Some(r) = &running {
            // Its processes die at once.
            let pid = r.pid.unwrap();
            while cubicle_node::procfs::is_alive(pid, r.pid_start_time)
                || !cubicle_node::traces::pids(&r.id).is_empty()
            {
                assert!(
                    killed.elapsed() < Duration::from_secs(2),
                    "sandbox {} still runs {:?} after its run was killed",
                    r.id,
                    killed.elapsed()
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            eprintln!(
                "sandbox {} dead {:?} after its run was SIGKILLed",
                r.id,
                killed.elapsed()
            );
        }
        // Then everything else goes, without anyone but the guardian doing anything.
        wait_for_guardians(&state);
        let mut ids = ids;
        ids.extend(running.iter().map(|r| r.id.to_string()));
        for id in &ids {
            let r = records.iter().find(|r| &r.id == id);
            loop {
                let t = cubicle_node::traces::leftovers(
                    &state,
                    id,
                    r.map(|r| r.slot),
                    r.and_then(|r| r.pid),
                );
                if t.is_empty() {
                    break;
                }
                assert!(
                    killed.elapsed() < Duration::from_secs(15),
                    "delay {delay:?}: {id} left {t:?}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    let _ = cubicle_node::fsutil::remove_tree(&state);
}

/// Waits until no `cubicle __run-guard` of `state` runs any more (a guardian that starts
/// after the test removed the state directory would make it again).
fn wait_for_guardians(state: &Path) {
    let t = std::time::Instant::now();
    let mine = |cmdline: &[u8]| {
        let c = String::from_utf8_lossy(cmdline);
        c.contains("__run-guard") && c.contains(&*state.to_string_lossy())
    };
    while std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| std::fs::read(e.path().join("cmdline")).is_ok_and(|c| mine(&c)))
    {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "a guardian of {} still runs",
            state.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Issue 10, item 9: with a node (e.g. `cubicle serve`) on the state directory, `cubicle
/// run` fails at once, naming the holder and saying what to do, instead of waiting
/// forever; with a state directory of its own and an overlapping slot range it is
/// refused too, naming the other node; with its own slots it works.
#[test]
fn run_next_to_a_node_fails_at_once_or_uses_its_own_slots() {
    let Some(envd) = ready() else { return };
    let state = state_dir("busy");
    let other = state_dir("busy-own");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let node = rt.block_on(async {
        let mut cfg = NodeConfig::new(&state, &envd);
        cfg.first_slot = 3900;
        cfg.max_sandboxes = 16;
        cfg.any_free_slots = true;
        Node::open(cfg).await.unwrap()
    });
    // The node's slots (3900.., or the next free range if a colleague's test has those).
    let slot = node.config().first_slot;
    let t = std::time::Instant::now();
    let out = cubicle(&state, slot)
        .env_remove("CUBICLE_ANY_FREE_SLOTS")
        .args(["run", "--template", "tiny", "--", "id"])
        .output()
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("in use by process") && err.contains("cubicle sandbox exec"),
        "{err}"
    );
    // Its own state directory, the same slots: refused, naming the node that has them.
    let out = cubicle(&other, slot)
        .env_remove("CUBICLE_ANY_FREE_SLOTS")
        .args(["run", "--template", "tiny", "--", "id"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("overlap") && err.contains(&state.display().to_string()),
        "{err}"
    );
    // Its own slots: works.
    let out = cubicle(&other, slot + 16)
        .args(["run", "--template", "tiny", "--", "id"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("uid=0(root)"));
    node.close();
    drop(node);
    let _ = cubicle_node::fsutil::remove_tree(&state);
    let _ = cubicle_node::fsutil::remove_tree(&other);
}

/// `template build -f` is a client of the server: against no server it fails, and it
/// leaves the state directory it was given (by default the operator's) untouched.
#[test]
fn dockerfile_build_is_a_client_and_creates_no_store() {
    let state = state_dir("dfclient");
    let ctx = state_dir("dfclient-ctx");
    std::fs::create_dir_all(&ctx).unwrap();
    std::fs::write(ctx.join("Dockerfile"), "FROM e2bdev/base\nRUN true\n").unwrap();
    let out = Command::new(BIN)
        .args(["--state-dir"])
        .arg(&state)
        .args(["template", "build", "x", "-f"])
        .arg(ctx.join("Dockerfile"))
        .arg(&ctx)
        // A port nothing listens on: the request fails at once.
        .args(["--api-url", "http://127.0.0.1:9", "--api-key", "e2b_none"])
        .env_remove("E2B_API_URL")
        .env_remove("E2B_API_KEY")
        .output()
        .unwrap();
    std::fs::remove_dir_all(&ctx).unwrap();
    assert!(!out.status.success(), "no server, yet the build succeeded");
    assert!(
        !state.exists(),
        "`template build -f` created {} ({:?})",
        state.display(),
        std::fs::read_dir(&state).map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
    );
}
