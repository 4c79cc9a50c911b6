//! Template builds on the real kernel: E2B-style steps (RUN, COPY from an uploaded
//! archive, ENV, WORKDIR, USER) run in build sandboxes of a real node on top of `tiny`;
//! the result runs as a template; the same build again is all cache hits; a failing
//! step names itself; shared layers are stored once; GC removes what nothing reaches;
//! `template build tiny --force` under a running sandbox leaves that sandbox's layers.
//!
//! Needs root, busybox-static and a static cubicle-envd (like `lifecycle`). Run:
//! `cargo test -p cubicle-node --test build [-- FILTER]`. `harness = false`: main() first
//! hands over to the runtime's sandbox helper (spawn re-executes this binary).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cubicle_node::build::NodeBuildHost;
use cubicle_node::template::build::{self, BuildLog, BuildRequest, Source, Step};
use cubicle_node::template::oci::pull::RegistryOptions;
use cubicle_node::{CreateRequest, Node, NodeConfig, ProcessEvent, ProcessSpec};

type TestResult = anyhow::Result<()>;
type TestFn = common::TestFn<PathBuf>;

fn main() {
    let Some(h) = common::Harness::start(
        "build",
        "user namespaces, cgroups, mounts",
        &["/bin/busybox"],
    ) else {
        return;
    };
    let tests: Vec<(&str, TestFn)> = vec![
        ("steps_build_a_template_that_runs_and_cache", |e| {
            Box::pin(steps_build_a_template_that_runs_and_cache(e))
        }),
        ("failing_step_names_itself", |e| {
            Box::pin(failing_step_names_itself(e))
        }),
        ("pools_serve_custom_templates_and_drop_stale_builds", |e| {
            Box::pin(pools_serve_custom_templates_and_drop_stale_builds(e))
        }),
        ("forced_rebuild_keeps_a_running_sandboxs_layers", |e| {
            Box::pin(forced_rebuild_keeps_a_running_sandboxs_layers(e))
        }),
    ];
    h.run(h.envd.clone(), tests, |_| Ok(())).finish();
}

async fn node(envd: &Path, name: &str, first_slot: u32) -> anyhow::Result<(Node, PathBuf)> {
    node_with_pool(envd, name, first_slot, Default::default()).await
}

async fn node_with_pool(
    envd: &Path,
    name: &str,
    first_slot: u32,
    pool: std::collections::BTreeMap<String, usize>,
) -> anyhow::Result<(Node, PathBuf)> {
    let state = PathBuf::from(format!("/tmp/cbbt-{}-{name}", std::process::id()));
    let mut cfg = NodeConfig::new(&state, envd);
    cfg.pool = pool;
    cfg.first_slot = first_slot;
    cfg.max_sandboxes = 16;
    cfg.any_free_slots = true;
    Ok((Node::open(cfg).await?, state))
}

fn step(kind: &str, args: &[&str]) -> Step {
    Step {
        kind: kind.into(),
        args: args.iter().map(|s| s.to_string()).collect(),
        force: false,
        files_hash: None,
    }
}

/// A gzipped tar of `files` (name, content, mode), as the SDK uploads a COPY's context.
fn archive(dir: &Path, files: &[(&str, &str, u32)]) -> anyhow::Result<PathBuf> {
    let path = dir.join("ctx.tar.gz");
    let f = std::fs::File::create(&path)?;
    let gz = flate2::write::GzEncoder::new(f, flate2::Compression::fast());
    let mut b = tar::Builder::new(gz);
    for (name, data, mode) in files {
        let mut h = tar::Header::new_ustar();
        h.set_size(data.len() as u64);
        h.set_mode(*mode);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, name, data.as_bytes())?;
    }
    b.into_inner()?.finish()?;
    Ok(path)
}

/// Run `cmd` with `sh -c` as `user`; (stdout, exit code).
async fn sh(node: &Node, id: &str, user: &str, cmd: &str) -> anyhow::Result<(String, i32)> {
    let spec = ProcessSpec {
        cmd: "/bin/sh".into(),
        args: vec!["-c".into(), cmd.into()],
        user: Some(user.into()),
        ..Default::default()
    };
    let mut out = Vec::new();
    let end = node
        .envd(id)?
        .run(&spec, |e| {
            if let ProcessEvent::Stdout(d) = e {
                out.extend(d);
            }
        })
        .await?;
    Ok((String::from_utf8_lossy(&out).into_owned(), end.exit_code))
}

fn request(name: &str, build_id: &str, steps: Vec<Step>) -> BuildRequest {
    BuildRequest {
        name: name.into(),
        build_id: build_id.into(),
        from: Source::Template("tiny".into()),
        steps,
        start_cmd: None,
        ready_cmd: None,
        force: false,
        cpus: None,
        memory_mb: None,
        registry: RegistryOptions::default(),
    }
}

async fn steps_build_a_template_that_runs_and_cache(envd: PathBuf) -> TestResult {
    let (node, state) = node(&envd, "steps", 27100).await?;
    let r = async {
        let ctx = archive(&state, &[("d/a.txt", "from the context\n", 0o644), ("d/run.sh", "echo ran\n", 0o755)])?;
        let ctx2 = ctx.clone();
        let files = move |h: &str| (h == "abc").then(|| ctx2.clone());
        let mut copy = step("COPY", &["d", "/srv/app/", "user", "0640"]);
        copy.files_hash = Some("abc".into());
        let steps = vec![
            step("USER", &["root"]),
            step("RUN", &["echo hi > /hello && mkdir -p /opt/x && rm /etc/hostname"]),
            step("ENV", &["FOO", "bar baz"]),
            step("WORKDIR", &["/srv/app"]),
            copy,
            step("USER", &["user"]),
        ];
        let host = NodeBuildHost::new(node.clone());
        let store = node.templates().clone();
        let (_tx, cancel) = tokio::sync::watch::channel(false);
        let t0 = Instant::now();
        let rec = store.new_build("app", "b1", vec![])?;
        let log = BuildLog::new(store.clone(), "app", "b1");
        let cfg = build::build(&host, &store, &request("app", "b1", steps.clone()), &files, &log, cancel.clone())
            .await
            .map_err(|f| anyhow::anyhow!("build failed at step {:?}: {}", f.step, f.message))?;
        let first = t0.elapsed();
        store.publish(rec, cfg.clone())?;
        println!("  first build {:.2}s, {} layers", first.as_secs_f64(), cfg.layers.len());
        anyhow::ensure!(cfg.default_user == "user" && cfg.default_workdir.as_deref() == Some("/srv/app"), "{cfg:?}");
        anyhow::ensure!(cfg.env.get("FOO").map(String::as_str) == Some("bar baz"));

        let sb = node
            .create(CreateRequest {
                template: "app".into(),
                ..Default::default()
            })
            .await?;
        let (out, code) = sh(
            &node,
            &sb.id,
            "user",
            "cat /hello /srv/app/a.txt; sh /srv/app/run.sh; id -u; stat -c '%a %U' /srv/app/a.txt; echo \"$FOO\"; pwd; test -e /etc/hostname-gone || echo ok",
        )
        .await?;
        node.kill(&sb.id).await?;
        anyhow::ensure!(code == 0, "exit {code}: {out}");
        let want = "hi\nfrom the context\nran\n1000\n640 user\nbar baz\n/srv/app\nok\n";
        anyhow::ensure!(out == want, "sandbox of the built template saw:\n{out}\nwanted:\n{want}");

        // Again: every step cached.
        let t1 = Instant::now();
        let rec2 = store.new_build("app", "b2", vec![])?;
        let log2 = BuildLog::new(store.clone(), "app", "b2");
        let cfg2 = build::build(&host, &store, &request("app", "b2", steps.clone()), &files, &log2, cancel.clone())
            .await
            .map_err(|f| anyhow::anyhow!("{}", f.message))?;
        let cached = t1.elapsed();
        store.publish(rec2, cfg2.clone())?;
        println!("  cached build {:.3}s", cached.as_secs_f64());
        anyhow::ensure!(cfg2.layers == cfg.layers, "a cached build gives the same layers");
        anyhow::ensure!(
            log2.page(0, 1000).iter().filter(|e| e.message.starts_with("CACHED")).count() == 3,
            "three cached layer steps: {:?}",
            log2.page(0, 1000)
        );
        anyhow::ensure!(cached < Duration::from_secs(1), "cached build took {cached:?}");

        // A second template on the same base shares its layers: stored once.
        let mut other = steps.clone();
        other.push(step("RUN", &["echo second > /tmp/second"]));
        let rec3 = store.new_build("app2", "b3", vec![])?;
        let log3 = BuildLog::new(store.clone(), "app2", "b3");
        let cfg3 = build::build(&host, &store, &request("app2", "b3", other), &files, &log3, cancel)
            .await
            .map_err(|f| anyhow::anyhow!("{}", f.message))?;
        store.publish(rec3, cfg3.clone())?;
        anyhow::ensure!(cfg3.layers.starts_with(&cfg.layers) && cfg3.layers.len() == cfg.layers.len() + 1);
        let usage = store.disk_usage();
        let u = |n: &str| usage.iter().find(|u| u.name == n).cloned();
        let (a, b) = (u("app").unwrap(), u("app2").unwrap());
        println!(
            "  disk: app {} B ({} unique), app2 {} B ({} unique)",
            a.total_bytes, a.unique_bytes, b.total_bytes, b.unique_bytes
        );
        anyhow::ensure!(a.unique_bytes == 0, "app's layers are all shared with app2");

        // Removing app2 and collecting frees only its own layer.
        store.remove("app2")?;
        let gc = store.gc(&node.layers_in_use(), Duration::ZERO)?;
        anyhow::ensure!(gc.removed.len() == 1, "gc removed {:?}", gc.removed);
        for l in &cfg.layers {
            anyhow::ensure!(store.layers().contains(l), "layer {l} of app was collected");
        }
        anyhow::Ok(())
    }
    .await;
    node.kill_all().await;
    node.close();
    let _ = cubicle_node::fsutil::remove_tree(&state);
    r
}

async fn failing_step_names_itself(envd: PathBuf) -> TestResult {
    let (node, state) = node(&envd, "fail", 27120).await?;
    let r = async {
        let host = NodeBuildHost::new(node.clone());
        let store = node.templates().clone();
        let (_tx, cancel) = tokio::sync::watch::channel(false);
        let files = |_: &str| None;
        let steps = vec![
            step("RUN", &["echo before"]),
            step("RUN", &["echo oops >&2; exit 3"]),
            step("RUN", &["echo never"]),
        ];
        store.new_build("bad", "b1", vec![])?;
        let log = BuildLog::new(store.clone(), "bad", "b1");
        let f = build::build(
            &host,
            &store,
            &request("bad", "b1", steps),
            &files,
            &log,
            cancel,
        )
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("the build succeeded"))?;
        anyhow::ensure!(f.step.as_deref() == Some("2"), "{f:?}");
        anyhow::ensure!(
            f.message.contains("exited with code 3") && f.message.contains("oops"),
            "{}",
            f.message
        );
        anyhow::ensure!(
            store.get("bad")?.is_none(),
            "a failed build publishes nothing"
        );
        anyhow::ensure!(
            node.list().is_empty(),
            "build sandboxes left: {:?}",
            node.list()
        );
        anyhow::Ok(())
    }
    .await;
    node.kill_all().await;
    node.close();
    let _ = cubicle_node::fsutil::remove_tree(&state);
    r
}

/// `--pool app=1` for a template that does not exist yet: once built, the pool fills and
/// a create is a claim; after a rebuild, the pooled sandbox of the old build is not
/// handed out (a create gets the new build's files).
async fn pools_serve_custom_templates_and_drop_stale_builds(envd: PathBuf) -> TestResult {
    let pool = std::collections::BTreeMap::from([("app".to_string(), 1usize)]);
    let (node, state) = node_with_pool(&envd, "pool", 27140, pool).await?;
    let r = async {
        let host = NodeBuildHost::new(node.clone());
        let store = node.templates().clone();
        let files = |_: &str| None;
        let mut built = Vec::new();
        for (i, word) in ["one", "two"].iter().enumerate() {
            let (_tx, cancel) = tokio::sync::watch::channel(false);
            let bid = format!("b{i}");
            let rec = store.new_build("app", &bid, vec![])?;
            let log = BuildLog::new(store.clone(), "app", &bid);
            let steps = vec![step("RUN", &[&format!("echo {word} > /tmp/build")])];
            let cfg = build::build(
                &host,
                &store,
                &request("app", &bid, steps),
                &files,
                &log,
                cancel,
            )
            .await
            .map_err(|f| anyhow::anyhow!("{}", f.message))?;
            store.publish(rec, cfg)?;
            built.push(*word);
            // Wait for the pool to hold one sandbox of this build.
            let t0 = Instant::now();
            while node.pool_stats().ready.get("app").copied().unwrap_or(0) < 1 {
                anyhow::ensure!(
                    t0.elapsed() < Duration::from_secs(30),
                    "the pool never filled: {:?}",
                    node.pool_stats()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            if i == 1 {
                break;
            }
            let before = node.pool_stats().claims;
            let sb = node
                .create(CreateRequest {
                    template: "app".into(),
                    internet: true,
                    ..Default::default()
                })
                .await?;
            anyhow::ensure!(
                node.pool_stats().claims == before + 1,
                "the create was not a claim"
            );
            let (out, _) = sh(&node, &sb.id, "root", "cat /tmp/build").await?;
            anyhow::ensure!(out == "one\n", "{out}");
            node.kill(&sb.id).await?;
        }
        // The pool may still hold a sandbox of build one (refilled before the rebuild):
        // a create must get build two.
        let sb = node
            .create(CreateRequest {
                template: "app".into(),
                internet: true,
                ..Default::default()
            })
            .await?;
        let (out, _) = sh(&node, &sb.id, "root", "cat /tmp/build").await?;
        node.kill(&sb.id).await?;
        anyhow::ensure!(out == "two\n", "a create after the rebuild got {out:?}");
        anyhow::Ok(())
    }
    .await;
    node.kill_all().await;
    node.close();
    // A refill under way when the node closed removes its sandbox itself: wait for it,
    // or the test process ends with that sandbox half made (its cgroup left behind).
    node.wait_refills(std::time::Duration::from_secs(60)).await;
    let _ = cubicle_node::fsutil::remove_tree(&state);
    r
}

/// `cubicle template build tiny --force` while a sandbox of `tiny` runs: the sandbox keeps
/// its (old) layer, readable, and GC keeps it until the sandbox is gone.
async fn forced_rebuild_keeps_a_running_sandboxs_layers(envd: PathBuf) -> TestResult {
    let (node, state) = node(&envd, "force", 27160).await?;
    let r = async {
        let store = node.templates().clone();
        let sb = node
            .create(CreateRequest {
                template: "tiny".into(),
                internet: true,
                ..Default::default()
            })
            .await?;
        let old = store
            .get("tiny")?
            .ok_or_else(|| anyhow::anyhow!("tiny is missing after a create"))?
            .config
            .layers;
        anyhow::ensure!(!old.is_empty(), "tiny has no layers");
        let s2 = store.clone();
        let new = tokio::task::spawn_blocking(move || s2.build("tiny", true, false))
            .await??
            .config
            .layers;
        anyhow::ensure!(new != old, "a forced rebuild kept the same layers {old:?}");
        let check = "cat /bin/busybox > /dev/null && ls /etc > /dev/null && echo fine";
        let (out, code) = sh(&node, &sb.id, "root", check).await?;
        anyhow::ensure!(
            code == 0 && out == "fine\n",
            "the sandbox lost its root filesystem to the rebuild: exit {code}, {out:?}"
        );
        let in_use: std::collections::HashSet<String> = cubicle_node::records_on_disk(&state)
            .into_iter()
            .flat_map(|r| r.layers)
            .collect();
        store.gc(&in_use, Duration::ZERO)?;
        for id in &old {
            anyhow::ensure!(
                store.layers().contains(id),
                "GC removed layer {id} of a running sandbox"
            );
        }
        let (out, code) = sh(&node, &sb.id, "root", check).await?;
        anyhow::ensure!(
            code == 0 && out == "fine\n",
            "after GC: exit {code}, {out:?}"
        );
        node.kill(&sb.id).await?;
        let in_use: std::collections::HashSet<String> = cubicle_node::records_on_disk(&state)
            .into_iter()
            .flat_map(|r| r.layers)
            .collect();
        let report = store.gc(&in_use, Duration::ZERO)?;
        for id in &old {
            anyhow::ensure!(
                !store.layers().contains(id),
                "GC kept {id} after its sandbox died ({} removed)",
                report.removed.len()
            );
        }
        for id in &new {
            anyhow::ensure!(
                store.layers().contains(id),
                "GC removed the current layer {id}"
            );
        }
        anyhow::Ok(())
    }
    .await;
    node.kill_all().await;
    node.close();
    let _ = cubicle_node::fsutil::remove_tree(&state);
    r
}
