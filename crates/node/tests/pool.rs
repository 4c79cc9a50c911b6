//! Warm pools on the real kernel (`tiny` template, real envd): a claim gives a ready
//! sandbox whose processes see the requested env vars and whose envd accepts the new
//! token only; the pool refills; pooled sandboxes are hidden from `list`; requests that
//! do not match go cold; `close` and a crash (drop + reopen) leave no pooled sandbox.
//!
//! Needs root, busybox-static, the network module (pools are made with internet on) and
//! a static cubicle-envd. Run: `cargo test -p cubicle-node --test pool`. `harness =
//! false`: main() first hands over to the runtime's sandbox helper.

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cubicle_node::{CreateRequest, EnvdClient, Node, NodeConfig, ProcessEvent, ProcessSpec};

const FIRST_SLOT: u32 = 5800;

fn main() {
    let Some(h) = common::Harness::start("pool", "namespaces, cgroups, mounts", &["/bin/busybox"])
    else {
        return;
    };
    if cubicle_runtime::network::Network::new(Default::default()).is_err() {
        println!("pool: SKIPPED — no network module (pooled sandboxes have internet on)");
        return;
    }
    let tests: Vec<(&str, common::TestFn<PathBuf>)> = vec![
        ("claim_refill_close", |e| Box::pin(claim_refill_close(e))),
        ("crash_leaves_no_pooled_sandbox", |e| {
            Box::pin(crash_leaves_no_pooled_sandbox(e))
        }),
        ("start_command_pooled", |e| {
            Box::pin(start_command_pooled(e))
        }),
        ("policies_cut_the_connections_they_refuse", |e| {
            Box::pin(policies_cut_the_connections_they_refuse(e))
        }),
        ("shells_serve_creates_of_any_template", |e| {
            Box::pin(shells_serve_creates_of_any_template(e))
        }),
        ("a_full_node_makes_room_from_its_pool", |e| {
            Box::pin(a_full_node_makes_room_from_its_pool(e))
        }),
    ];
    h.run(h.envd.clone(), tests, |_| Ok(())).finish();
}

/// This suite's node config: its slots, room for 32 sandboxes, no pool.
fn config(envd: &Path, state: &Path) -> NodeConfig {
    let mut cfg = NodeConfig::new(state, envd);
    cfg.first_slot = FIRST_SLOT;
    cfg.max_sandboxes = 32;
    cfg.any_free_slots = true;
    cfg
}

async fn open(envd: &Path, state: &Path, pool: usize) -> anyhow::Result<Node> {
    let mut cfg = config(envd, state);
    if pool > 0 {
        cfg.pool.insert("tiny".into(), pool);
    }
    open_with(cfg).await
}

async fn open_with(cfg: NodeConfig) -> anyhow::Result<Node> {
    let node = Node::open(cfg).await?;
    // Pools use built templates only (building is the server's job).
    node.templates().ensure("tiny", false)?;
    Ok(node)
}

async fn wait_ready(node: &Node, n: usize) -> anyhow::Result<()> {
    wait_ready_in(node, "tiny", n).await
}

async fn wait_ready_in(node: &Node, pool: &str, n: usize) -> anyhow::Result<()> {
    let t = Instant::now();
    while node.pool_stats().ready.get(pool).copied().unwrap_or(0) < n {
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(30),
            "pool not refilled to {n}: {:?}",
            node.pool_stats()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

fn sandbox_dirs(state: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(state.join("sandboxes"))
        .map(|d| {
            d.flatten()
                .filter(|e| e.path().join("sandbox.json").exists())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The CPU weight of sandbox `id`'s cgroup (`cpu.shares` on v1, `cpu.weight` on v2).
fn cpu_weight(id: &str) -> u64 {
    let cg = cubicle_runtime::cgroup::Cgroup::handle(id).unwrap();
    cg.dirs()
        .into_iter()
        .find_map(|d| {
            ["cpu.shares", "cpu.weight"]
                .iter()
                .find_map(|f| std::fs::read_to_string(d.join(f)).ok())
        })
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no CPU weight for {id}"))
}

/// File `name` of every task (thread) of sandbox `id`'s processes (its cgroup, v1 or
/// v2), read from `/proc`; tasks gone meanwhile are skipped.
fn task_files(id: &str, name: &str) -> Vec<String> {
    let mut out = Vec::new();
    for pid in cubicle_node::traces::pids(id) {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            if let Ok(text) = std::fs::read_to_string(t.path().join(name)) {
                out.push(text);
            }
        }
    }
    out
}

/// Nice values of every task of sandbox `id`.
fn task_nices(id: &str) -> Vec<i64> {
    task_files(id, "stat")
        .iter()
        .filter_map(|stat| {
            // Fields after the command (which ends with ')'): nice is field 19 overall.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(16))
                .and_then(|v| v.parse().ok())
        })
        .collect()
}

/// How many times the tasks of sandbox `id` were given a CPU (`schedstat`'s third field,
/// summed over its processes' threads): unchanged over an operation, nothing in the
/// sandbox was woken by it.
fn times_run(id: &str) -> u64 {
    task_files(id, "schedstat")
        .iter()
        .filter_map(|st| st.split_whitespace().nth(2)?.parse::<u64>().ok())
        .sum()
}

/// Closes `node` and waits for its refills: no sandbox directory is left in `state`, and
/// none of the cgroups of `ids` (its pooled sandboxes or shells).
async fn closed_empty(node: &Node, state: &Path, ids: &[String]) -> anyhow::Result<()> {
    node.close();
    node.wait_refills(Duration::from_secs(60)).await;
    let left = sandbox_dirs(state);
    anyhow::ensure!(left.is_empty(), "after close: {left:?}");
    for id in ids {
        anyhow::ensure!(
            !Path::new(&format!("/sys/fs/cgroup/pids/cubicle/{id}")).exists(),
            "cgroup of {id} left"
        );
    }
    Ok(())
}

/// Closes `node` once its sandboxes ended and its refills finished (a refill under way
/// at close removes its sandbox once made, start command included), then removes
/// `state`: no sandbox directory may have been left.
async fn closed_and_removed(node: &Node, state: &Path) -> anyhow::Result<()> {
    node.close();
    node.settle(Duration::from_secs(30)).await;
    node.wait_refills(Duration::from_secs(60)).await;
    let left = sandbox_dirs(state);
    // remove_tree unmounts the quota filesystem first (remove_dir_all cannot).
    let _ = cubicle_node::fsutil::remove_tree(state);
    anyhow::ensure!(left.is_empty(), "left: {left:?}");
    Ok(())
}

async fn sh(client: &EnvdClient, script: &str) -> anyhow::Result<String> {
    let spec = ProcessSpec {
        cmd: "/bin/sh".into(),
        args: vec!["-c".into(), script.into()],
        ..Default::default()
    };
    let mut out = Vec::new();
    let end = client
        .run(&spec, |ev| {
            if let ProcessEvent::Stdout(b) = ev {
                out.extend(b)
            }
        })
        .await?;
    anyhow::ensure!(end.exit_code == 0, "exit {}", end.exit_code);
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn info_token(node: &Node, id: &str) -> anyhow::Result<String> {
    Ok(node.get(id)?.access_token)
}

/// One `GET path` over `conn` (a kept envd connection, non-blocking): the answer's text.
fn get_over(
    conn: std::os::unix::net::UnixStream,
    path: &str,
    token: &str,
) -> anyhow::Result<String> {
    use std::io::{Read, Write};
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut conn = conn;
    write!(
        conn,
        "GET {path} HTTP/1.1\r\nhost: envd\r\nx-access-token: {token}\r\nconnection: close\r\n\r\n"
    )?;
    let mut out = String::new();
    conn.read_to_string(&mut out)?;
    anyhow::ensure!(out.starts_with("HTTP/1.1 200"), "{out}");
    Ok(out)
}

async fn claim_refill_close(envd: PathBuf) -> anyhow::Result<()> {
    let envd = envd.as_path();
    let state = PathBuf::from(format!("/tmp/cbpool-{}-a", std::process::id()));
    let node = open(envd, &state, 2).await?;
    let r = async {
        wait_ready(&node, 2).await?;
        anyhow::ensure!(node.list().is_empty(), "pooled sandboxes are listed");
        let pooled = sandbox_dirs(&state);
        anyhow::ensure!(pooled.len() == 2, "pool dirs {pooled:?}");

        // Pooled sandboxes wait at low priority (made by the nice-19 refill thread): their
        // cgroup's CPU weight (about 1/68 of the full one, checked after the claim); their
        // tasks run at nice 0.
        let mut pooled_weight = BTreeMap::new();
        for id in &pooled {
            let n = task_nices(id);
            anyhow::ensure!(!n.is_empty() && n.iter().all(|n| *n == 0), "pooled {id} nice {n:?}");
            pooled_weight.insert(id.clone(), cpu_weight(id));
        }

        let env = BTreeMap::from([("CB_POOL_VAR".to_string(), "hello pool".to_string())]);
        let t = Instant::now();
        let s = node
            .create(CreateRequest {
                template: "tiny".into(),
                internet: true,
                env_vars: env,
                lifecycle: cubicle_node::Lifecycle {
                    auto_pause: true,
                    auto_pause_memory: false,
                    auto_resume: true,
                },
                ..Default::default()
            })
            .await?;
        println!("  claim: {:.2} ms", t.elapsed().as_secs_f64() * 1e3);
        let st = node.pool_stats();
        anyhow::ensure!(st.claims == 1, "not claimed from the pool: {st:?}");
        anyhow::ensure!(
            pooled.contains(&s.id.to_string()),
            "claimed id {} is not a pooled one",
            s.id
        );
        anyhow::ensure!(node.list().len() == 1 && node.get(&s.id).is_ok());

        // The requested env vars reach a command (told by the claim's `/init`); the
        // node's token works.
        let info = node.get(&s.id)?;
        // What happens at its end is the request's, as for a cold create.
        anyhow::ensure!(
            info.lifecycle.auto_pause && info.lifecycle.auto_resume && !info.lifecycle.auto_pause_memory,
            "claimed sandbox lost its lifecycle: {:?}",
            info.lifecycle
        );
        // The claim's /init went over the connection the refill's ready check opened;
        // it is kept, idle, for the first request (the data plane's), once.
        let other = pooled.iter().find(|p| p.as_str() != s.id.as_str()).unwrap();
        anyhow::ensure!(node.take_envd_conn(other).is_none(), "a pooled sandbox's connection was handed out");
        let conn = node.take_envd_conn(&s.id).ok_or_else(|| anyhow::anyhow!("no kept connection"))?;
        anyhow::ensure!(node.take_envd_conn(&s.id).is_none(), "the kept connection was handed out twice");
        let envs = get_over(conn, "/envs", &info_token(&node, &s.id)?)?;
        anyhow::ensure!(envs.contains("hello pool"), "/envs over the kept connection: {envs}");
        let good = node.envd(&s.id)?;
        let out = sh(&good, "echo \"$CB_POOL_VAR|$E2B_SANDBOX_ID\"").await?;
        anyhow::ensure!(out.trim() == format!("hello pool|{}", s.id), "env: {out:?}");
        // Claimed: the full CPU weight again; its tasks and the user's processes at 0.
        let (w, was) = (cpu_weight(&s.id), pooled_weight[s.id.as_str()]);
        anyhow::ensure!(w > 40 * was, "claimed CPU weight {w}, pooled {was}");
        let n = task_nices(&s.id);
        anyhow::ensure!(!n.is_empty() && n.iter().all(|n| *n == 0), "claimed nice {n:?}");
        let out = sh(&good, "cut -d' ' -f19 /proc/self/stat").await?;
        anyhow::ensure!(out.trim() == "0", "a command's nice: {out:?}");
        // Any other token (e.g. one a pooled sandbox might have had) is refused.
        let bad = EnvdClient::new(info.envd_socket.clone(), Some("not-the-token".into()));
        anyhow::ensure!(
            sh(&bad, "true").await.is_err(),
            "a wrong token was accepted"
        );

        // Refill. While the pool makes its replacement, `list` shows only the claimed one
        // (a sandbox being made for the pool is never a user's).
        let t = Instant::now();
        while node.pool_stats().ready.get("tiny").copied().unwrap_or(0) < 2 {
            let ids: Vec<cubicle_node::SandboxId> = node.list().into_iter().map(|i| i.id).collect();
            anyhow::ensure!(ids == [s.id.clone()], "list during refill: {ids:?}");
            anyhow::ensure!(t.elapsed() < Duration::from_secs(30), "pool not refilled");
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        anyhow::ensure!(node.pool_stats().refills >= 3);

        // Other memory and CPU limits, no variables: still from the pool, with the limits
        // applied; and envd, born knowing all a create without variables tells it, is not
        // woken by the claim (no `/init`): its threads were not run once.
        let ready: Vec<String> = sandbox_dirs(&state).into_iter().filter(|d| d != s.id.as_str()).collect();
        let before: BTreeMap<String, u64> = ready.iter().map(|id| (id.clone(), times_run(id))).collect();
        anyhow::ensure!(before.values().all(|n| *n > 0), "no schedstat for {before:?}");
        let m = node
            .create(CreateRequest {
                template: "tiny".into(),
                internet: true,
                memory_mb: Some(200),
                cpus: Some(1),
                ..Default::default()
            })
            .await?;
        anyhow::ensure!(
            node.pool_stats().claims == 2,
            "a create with other memory/CPU limits did not use the pool: {:?}",
            node.pool_stats()
        );
        let (was, now) = (before.get(m.id.as_str()).copied(), times_run(&m.id));
        anyhow::ensure!(was == Some(now), "the claim woke envd: run {was:?} times before, {now} after");
        let mt = node.envd(&m.id)?;
        let out = sh(&mt, "echo \"$E2B_SANDBOX|$E2B_SANDBOX_ID|$E2B_TEMPLATE_ID\"").await?;
        anyhow::ensure!(out.trim() == format!("true|{}|tiny", m.id), "env without /init: {out:?}");
        anyhow::ensure!(times_run(&m.id) > now, "a command did not count as a run of envd");
        anyhow::ensure!(
            sh(&EnvdClient::new(node.get(&m.id)?.envd_socket, Some("not-the-token".into())), "true").await.is_err(),
            "a wrong token was accepted by a sandbox claimed without /init"
        );
        anyhow::ensure!(node.get(&m.id)?.memory_mb == 200, "record keeps the old limit");
        let out = sh(
            &node.envd(&m.id)?,
            "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max",
        )
        .await?;
        anyhow::ensure!(out.trim() == (200u64 << 20).to_string(), "memory limit inside: {out:?}");
        node.kill(&m.id).await?;

        // Internet off: cold, not from the pool.
        let c = node
            .create(CreateRequest {
                template: "tiny".into(),
                internet: false,
                ..Default::default()
            })
            .await?;
        anyhow::ensure!(
            node.pool_stats().claims == 2,
            "internet-off create used the pool"
        );
        node.kill(&c.id).await?;

        // Internet off by a policy that refuses everything (the API's
        // `allow_internet_access: false`): from the pool, its interface kept and that
        // policy in the kernel's "deny all" set before the create answers.
        let deny = cubicle_node::NetworkPolicy {
            deny_out: vec!["0.0.0.0/0".parse()?],
            ..Default::default()
        };
        wait_ready(&node, 2).await?;
        let d = node
            .create(CreateRequest {
                template: "tiny".into(),
                internet: false,
                network: deny.clone(),
                ..Default::default()
            })
            .await?;
        anyhow::ensure!(
            node.pool_stats().claims == 3,
            "an internet-off create with a deny-all policy was not served by the pool: {:?}",
            node.pool_stats()
        );
        anyhow::ensure!(node.get(&d.id)?.network == deny, "claimed without its policy");
        let ip = cubicle_runtime::network::Network::new(Default::default())?
            .slot_info(common::slot_of(d.uid_base))?
            .sandbox_ip;
        let set = std::process::Command::new("nft")
            .args(["list", "set", "inet", "cubicle_policy", "deny_all"])
            .output()?;
        let set = String::from_utf8_lossy(&set.stdout);
        anyhow::ensure!(
            set.contains(&ip.to_string()),
            "{ip} is not in the deny-all set: {set}"
        );
        node.kill(&d.id).await?;
        node.kill(&s.id).await?;

        // close: the pool's sandboxes go, the ready ones at once and one a refill was
        // making (for the claim above) once that refill sees the close, as `Node::stop`
        // waits for.
        closed_empty(&node, &state, &pooled).await
    }
    .await;
    node.kill_all().await;
    drop(node);
    let _ = cubicle_node::fsutil::remove_tree(&state);
    r
}

async fn crash_leaves_no_pooled_sandbox(envd: PathBuf) -> anyhow::Result<()> {
    let envd = envd.as_path();
    let state = PathBuf::from(format!("/tmp/cbpool-{}-b", std::process::id()));
    let r = async {
        let node = open(envd, &state, 2).await?;
        wait_ready(&node, 2).await?;
        let pooled = sandbox_dirs(&state);
        anyhow::ensure!(pooled.len() == 2);
        // A crash: no close, the node object just goes away (its sandboxes keep running).
        drop(node);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let node = open(envd, &state, 0).await?;
        let report = node.reconcile_report();
        for id in &pooled {
            anyhow::ensure!(
                report.removed.contains(id) && !report.adopted.contains(id),
                "pooled {id} not removed after a crash: {report:?}"
            );
        }
        anyhow::ensure!(sandbox_dirs(&state).is_empty());
        node.close();
        Ok(())
    }
    .await;
    let _ = cubicle_node::fsutil::remove_tree(&state);
    r
}

/// A node whose every slot holds a pooled sandbox still makes a create its pool cannot
/// serve (internet off): one pooled sandbox makes room, and the refill does not take the
/// slot back while the node is full; it refills once the sandbox is gone.
async fn a_full_node_makes_room_from_its_pool(envd: PathBuf) -> anyhow::Result<()> {
    let envd = envd.as_path();
    let state = PathBuf::from(format!("/tmp/cbpool-{}-full", std::process::id()));
    let mut cfg = config(envd, &state);
    cfg.max_sandboxes = 3;
    cfg.pool.insert("tiny".into(), 3);
    let node = open_with(cfg).await?;
    let r = async {
        wait_ready(&node, 3).await?;
        let s = node
            .create(CreateRequest {
                template: "tiny".into(),
                internet: false,
                ..Default::default()
            })
            .await?;
        let stats = node.pool_stats();
        anyhow::ensure!(
            stats.claims == 0 && stats.ready.get("tiny") == Some(&2),
            "the create was not made in the room of a pooled sandbox: {stats:?}"
        );
        let dirs = sandbox_dirs(&state);
        anyhow::ensure!(
            dirs.len() == 3 && dirs.iter().any(|d| d.as_str() == s.id.as_str()),
            "{dirs:?}"
        );
        // Full: no refill while the sandbox lives.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        anyhow::ensure!(node.pool_stats().ready.get("tiny") == Some(&2));
        node.kill(&s.id).await?;
        wait_ready(&node, 3).await?;
        Ok(())
    }
    .await;
    let closed = closed_empty(&node, &state, &[]).await;
    let _ = cubicle_node::fsutil::remove_tree(&state);
    r.and(closed)
}

/// A template with a start command is pooled with the command running (as its start
/// user, seeing the sandbox's own id); a create with env vars claims one only when the
/// template has `late_env`, else it is created cold and its start command sees them.
async fn start_command_pooled(envd: PathBuf) -> anyhow::Result<()> {
    let envd = envd.as_path();
    let state = PathBuf::from(format!("/tmp/cbpool-{}-s", std::process::id()));
    let mut cfg = NodeConfig::new(&state, envd);
    cfg.first_slot = FIRST_SLOT + 40;
    cfg.max_sandboxes = 16;
    cfg.pool.insert("tinystart".into(), 1);
    let node = Node::open(cfg).await?;
    let r = async {
        let (mut tc, dir) = common::derived_template(
            &node,
            &state,
            "tinystart",
            "echo \"$(id -u)|$E2B_SANDBOX_ID|$CB_S\" > /tmp/started; exec sleep 1000",
            Some("root"),
        )?;
        let ready = |node: &Node| {
            node.pool_stats()
                .ready
                .get("tinystart")
                .copied()
                .unwrap_or(0)
        };
        let wait = |node: Node| async move {
            let t = Instant::now();
            while ready(&node) < 1 {
                anyhow::ensure!(
                    t.elapsed() < Duration::from_secs(60),
                    "pool: {:?}",
                    node.pool_stats()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok(())
        };
        let create = |env: &[(&str, &str)]| CreateRequest {
            template: "tinystart".into(),
            internet: true,
            env_vars: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        };
        let started = |id: cubicle_node::SandboxId| {
            let node = node.clone();
            async move { sh(&node.envd(&id)?, "cat /tmp/started").await }
        };

        // No env vars: claimed; the start command ran as root and saw its sandbox's id.
        wait(node.clone()).await?;
        let s = node.create(create(&[])).await?;
        anyhow::ensure!(node.pool_stats().claims == 1, "{:?}", node.pool_stats());
        let out = started(s.id.clone()).await?;
        anyhow::ensure!(
            out.trim() == format!("0|{}|", s.id),
            "start command saw {out:?}"
        );
        node.kill(&s.id).await?;

        // Env vars, template without late_env: cold, and the start command sees them.
        wait(node.clone()).await?;
        let s = node.create(create(&[("CB_S", "cold")])).await?;
        anyhow::ensure!(node.pool_stats().claims == 1, "{:?}", node.pool_stats());
        let out = started(s.id.clone()).await?;
        anyhow::ensure!(
            out.trim() == format!("0|{}|cold", s.id),
            "start command saw {out:?}"
        );
        node.kill(&s.id).await?;

        // With late_env: claimed; envd has the env vars for what runs from now on.
        tc.late_env = true;
        cubicle_node::fsutil::write_json_atomic(&dir.join("template.json"), &tc)?;
        let s = node.create(create(&[("CB_S", "late")])).await?;
        anyhow::ensure!(node.pool_stats().claims == 2, "{:?}", node.pool_stats());
        let out = sh(&node.envd(&s.id)?, "echo \"$CB_S|$E2B_SANDBOX_ID\"").await?;
        anyhow::ensure!(out.trim() == format!("late|{}", s.id), "env: {out:?}");
        node.kill(&s.id).await?;
        Ok(())
    }
    .await;
    closed_and_removed(&node, &state).await?;
    r
}

/// A pooled sandbox's start command ran under the default policy and holds a connection
/// to a host of the test internet (`common::lab`). A create that claims it with a policy
/// that refuses that host (internet off; or on, with the host's network denied) does not
/// inherit the connection: it ends at once in the sandbox (its socket destroyed), and
/// its packets would be refused as a new connection's. A policy that allows the host
/// keeps it, and so does the default policy,
/// until `update_network` refuses the host. Internet off is served warm, with an
/// interface that reaches nothing.
async fn policies_cut_the_connections_they_refuse(envd: PathBuf) -> anyhow::Result<()> {
    let state = PathBuf::from(format!("/tmp/cbpool-{}-c", std::process::id()));
    let mut cfg = NodeConfig::new(&state, &envd);
    cfg.first_slot = FIRST_SLOT + 60;
    cfg.max_sandboxes = 8;
    cfg.pool.insert("tinyconn".into(), 1);
    // The template only exists once the lab does: the node counts the host's subnets
    // as denied when it opens, and the start command connects as soon as it is pooled.
    let node = Node::open(cfg).await?;
    let r = async {
        let lab = common::lab::TestInternet::new("pool", [198, 51, 100], &[])?;
        let srv = lab.server(common::lab::Serve::Echo)?;
        let target = srv.addr;
        common::derived_template(
            &node,
            &state,
            "tinyconn",
            &format!(
                "mkfifo -m 666 /tmp/in; \
                 (nc {} {} </tmp/in >/tmp/reply 2>/tmp/nc.err; echo $? >/tmp/nc.done) & \
                 exec 3>/tmp/in; exec sleep 1000",
                target.ip(),
                target.port()
            ),
            Some("root"),
        )?;
        // Claims a sandbox whose start command's connection is the server's `hits`-th.
        let claim = |network: cubicle_node::NetworkPolicy, internet: bool, hits: usize| {
            let node = node.clone();
            let srv = &srv;
            async move {
                let t = Instant::now();
                while srv.hits() < hits
                    || node
                        .pool_stats()
                        .ready
                        .get("tinyconn")
                        .is_none_or(|n| *n < 1)
                {
                    anyhow::ensure!(
                        t.elapsed() < Duration::from_secs(30),
                        "no pooled sandbox connected: {} connections, {:?}",
                        srv.hits(),
                        node.pool_stats()
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let claims = node.pool_stats().claims;
                let s = node
                    .create(CreateRequest {
                        template: "tinyconn".into(),
                        internet,
                        network,
                        ..Default::default()
                    })
                    .await?;
                if node.pool_stats().claims != claims + 1 {
                    node.kill(&s.id).await?;
                    anyhow::bail!("not claimed: {:?}", node.pool_stats());
                }
                Ok(s.id)
            }
        };
        // `ended` if the start command's connection ended by itself (its socket was
        // destroyed by the cut: nc ends with 0 or 1); else sends `word` over it: `echoed`
        // (it came back) or `reset` (nc ended when it sent). Then whether the sandbox has
        // an eth0.
        let ping = |id: cubicle_node::SandboxId, word: &'static str| {
            let node = node.clone();
            async move {
                let out = sh(
                    &node.envd(&id)?,
                    &format!(
                        "for i in $(seq 10); do [ -e /tmp/nc.done ] && break; sleep 0.1; done; \
                         if [ -e /tmp/nc.done ]; then echo ended; else \
                         echo {word} > /tmp/in; \
                         for i in $(seq 50); do \
                           grep -q {word} /tmp/reply 2>/dev/null && break; \
                           [ -e /tmp/nc.done ] && break; sleep 0.1; done; \
                         if grep -q {word} /tmp/reply; then echo echoed; \
                         elif [ -e /tmp/nc.done ]; then echo reset; else echo silent; fi; fi; \
                         grep -c eth0 /proc/net/dev"
                    ),
                )
                .await?;
                Ok::<_, anyhow::Error>(out.split_whitespace().collect::<Vec<_>>().join(" "))
            }
        };
        let deny = |cidr: &str| -> anyhow::Result<cubicle_node::NetworkPolicy> {
            Ok(cubicle_node::NetworkPolicy {
                deny_out: vec![cidr.parse()?],
                ..Default::default()
            })
        };

        // Control: the default policy keeps the connection; the echo comes back. Then
        // `update_network` denies the lab: the same connection ends at once.
        let id = claim(Default::default(), true, 1).await?;
        let r = async {
            let out = ping(id.clone(), "first").await?;
            anyhow::ensure!(out == "echoed 1", "with the default policy: {out:?}");
            node.update_network(&id, deny("198.51.100.0/24")?).await?;
            let out = ping(id.clone(), "second").await?;
            anyhow::ensure!(out == "ended 1", "after update_network: {out:?}");
            Ok(())
        }
        .await;
        node.kill(&id).await?;
        r?;
        // Internet off: claimed, with an eth0; the connection ends at once, without a
        // packet from the sandbox. Internet on with the lab's network denied: the same. Everything denied
        // but the lab's host: that connection is allowed, and kept.
        let only_lab = cubicle_node::NetworkPolicy {
            allow_out: vec![target.ip().to_string().parse()?],
            ..deny("0.0.0.0/0")?
        };
        for (hits, network, internet, word, want) in [
            (2, deny("0.0.0.0/0")?, false, "third", "ended 1"),
            (3, deny("198.51.100.0/24")?, true, "fourth", "ended 1"),
            (4, only_lab, true, "fifth", "echoed 1"),
        ] {
            let what = format!("{network:?}, internet {internet}");
            let id = claim(network, internet, hits).await?;
            let out = ping(id.clone(), word).await;
            node.kill(&id).await?;
            let out = out?;
            anyhow::ensure!(out == want, "{what}: {out:?}, want {want:?}");
        }
        // No claimed sandbox reached the server again (nc does not reconnect).
        anyhow::ensure!(srv.hits() <= 5, "{} connections", srv.hits());
        Ok(())
    }
    .await;
    closed_and_removed(&node, &state).await?;
    r
}

/// Sandbox `id`'s mounts as its init sees them: mount point, options, type and
/// superblock options, without what names its own directory or layers (ids, paths).
fn mounts_of(id: &str) -> Vec<String> {
    let pid = cubicle_node::traces::pids(id)
        .into_iter()
        .min()
        .unwrap_or_else(|| panic!("no process of {id}"));
    let text = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    let mut v: Vec<String> = text
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (_, after) = l.split_once(" - ").unwrap();
            let a: Vec<&str> = after.split_whitespace().collect();
            let opts: Vec<&str> = a[2]
                .split(',')
                .filter(|o| {
                    ![
                        "lowerdir=",
                        "upperdir=",
                        "workdir=",
                        "subvolid=",
                        "subvol=",
                        "uid=",
                        "gid=",
                    ]
                    .iter()
                    .any(|p| o.starts_with(p))
                })
                .collect();
            format!("{} {} {} {}", f[4], f[5], a[0], opts.join(","))
        })
        .collect();
    v.sort();
    v
}

/// Shells (`--shells`): made ahead without a template, not listed; a create of a
/// template with no pool of its own takes one and gets the template's root, variables,
/// limits and identity, with exactly the mounts a cold create of it has; the shell pool
/// refills, and closing leaves nothing.
async fn shells_serve_creates_of_any_template(envd: PathBuf) -> anyhow::Result<()> {
    let state = PathBuf::from(format!("/tmp/cbpool-{}-h", std::process::id()));
    let mut cfg = config(&envd, &state);
    cfg.pool.insert(cubicle_node::SHELL_POOL.into(), 2);
    let node = open_with(cfg).await?;
    let r = async {
        wait_ready_in(&node, cubicle_node::SHELL_POOL, 2).await?;
        anyhow::ensure!(node.list().is_empty(), "shells are listed");
        let shells = sandbox_dirs(&state);
        anyhow::ensure!(shells.len() == 2, "shell dirs {shells:?}");

        let env = BTreeMap::from([("CB_SHELL_VAR".to_string(), "from a shell".to_string())]);
        let t = Instant::now();
        let s = node
            .create(CreateRequest {
                template: "tiny".into(),
                internet: true,
                env_vars: env,
                memory_mb: Some(200),
                ..Default::default()
            })
            .await?;
        println!("  claim of a shell: {:.2} ms", t.elapsed().as_secs_f64() * 1e3);
        anyhow::ensure!(node.pool_stats().claims == 1, "no shell claimed: {:?}", node.pool_stats());
        anyhow::ensure!(shells.contains(&s.id.to_string()), "{} is not a shell's id", s.id);
        let info = node.get(&s.id)?;
        anyhow::ensure!(info.template == "tiny", "template {}", info.template);
        let good = node.envd(&s.id)?;
        let out = sh(
            &good,
            "echo \"$CB_SHELL_VAR|$E2B_SANDBOX_ID|$(cat /run/e2b/.E2B_TEMPLATE_ID)|$(hostname)\"; \
             test -x /bin/busybox && echo template-root; \
             cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max",
        )
        .await?;
        let want = format!("from a shell|{0}|tiny|{0}\ntemplate-root\n{1}\n", s.id, 200u64 << 20);
        anyhow::ensure!(out == want, "inside: {out:?}, want {want:?}");

        // The same mounts as a sandbox of the template made cold (internet off: no shell).
        let c = node
            .create(CreateRequest {
                template: "tiny".into(),
                internet: false,
                ..Default::default()
            })
            .await?;
        anyhow::ensure!(node.pool_stats().claims == 1, "an internet-off create took a shell");
        let (from_shell, cold) = (mounts_of(&s.id), mounts_of(&c.id));
        anyhow::ensure!(
            from_shell == cold,
            "mounts differ:\nshell: {from_shell:#?}\ncold: {cold:#?}"
        );
        node.kill(&c.id).await?;
        node.kill(&s.id).await?;
        wait_ready_in(&node, cubicle_node::SHELL_POOL, 2).await?;
        closed_empty(&node, &state, &shells).await
    }
    .await;
    node.kill_all().await;
    drop(node);
    let _ = cubicle_node::fsutil::remove_tree(&state);
    r
}
