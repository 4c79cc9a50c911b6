//! Moving state between two nodes through a real object store (issue 19, "moving
//! state"): moto's S3-compatible server, started here on a free port (from
//! `tests/e2e/.venv-s3`, made by `scripts/install-test-deps.sh`) and stopped after, and
//! the local `file://` backend. Two nodes (two state directories, disjoint slots) in
//! one process stand for two hosts:
//!
//! - a template pushed by A is fetched by B on its first create (a second push moves
//!   nothing);
//! - a snapshot taken (with memory) in A is fetched by B on a create naming it;
//! - a sandbox paused in A is pulled and resumed in B with its memory: the same process
//!   goes on counting from where it was (latency measured, download reported apart);
//! - a corrupted blob is refused with a clear error and nothing is installed;
//! - with `base` (S3 only): resume latency of an idle base sandbox on the other node.
//!
//! Needs root, busybox-static, CRIU (`scripts/install-criu.sh`) and the static envd.
//! Run in a private network namespace: `unshare --net bash -c 'ip link set lo up;
//! cargo test -p cubicle-node --test moving'`. `harness = false`: the runtime re-executes
//! this binary as its sandbox helper.

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use cubicle_node::objstore::Bucket;
use cubicle_node::{
    CreateRequest, Node, NodeConfig, ObjectStoreConfig, PauseRequest, ProcessSpec, SandboxState,
    SnapshotRequest,
};

const BUCKET: &str = "cubicle-moving-test";

fn main() {
    cubicle_runtime::maybe_run_helper();
    cubicle_checkpoint::maybe_run_helper();
    if !nix::unistd::geteuid().is_root() {
        println!("moving: SKIPPED — needs root (user namespaces, cgroups, mounts)");
        return;
    }
    if !Path::new("/bin/busybox").exists() {
        println!("moving: SKIPPED — /bin/busybox missing (apt-get install busybox-static)");
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let moto = std::env::var_os("CUBICLE_MOTO_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("tests/e2e/.venv-s3/bin/moto_server"));
    if !moto.exists() {
        eprintln!(
            "moving: FAILED — no S3 test server at {} (run scripts/install-test-deps.sh)",
            moto.display()
        );
        std::process::exit(1);
    }
    let envd = match common::static_envd() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("moving: FAILED — no static cubicle-envd: {e}");
            std::process::exit(1);
        }
    };
    let _lock = common::host_lock("moving");
    let server = match S3Server::start(&moto) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("moving: FAILED — starting {}: {e:#}", moto.display());
            std::process::exit(1);
        }
    };
    // SAFETY: no other thread runs yet (the tokio runtime is built below); the object
    // store's S3 client reads these as the operator's environment would provide them.
    unsafe {
        std::env::set_var("AWS_ACCESS_KEY_ID", "test");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "test");
        std::env::set_var("AWS_DEFAULT_REGION", "us-east-1");
        std::env::set_var(
            "AWS_ENDPOINT_URL",
            format!("http://127.0.0.1:{}", server.port),
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let pid = std::process::id();
    let mut failed = 0;
    let runs: Vec<(&str, String, bool)> = vec![
        ("s3", format!("s3://{BUCKET}/run-{pid}"), true),
        ("file", format!("file:///tmp/cbmv-{pid}-bucket"), false),
    ];
    for (name, url, with_base) in runs {
        if filter.as_deref().is_some_and(|f| !name.contains(f)) {
            continue;
        }
        println!("moving/{name}: {url}");
        let t = Instant::now();
        match rt.block_on(scenario(&envd, name, &url, with_base)) {
            Ok(()) => println!("moving/{name}: ok ({:.1}s)", t.elapsed().as_secs_f64()),
            Err(e) => {
                failed += 1;
                eprintln!("moving/{name}: FAILED — {e:#}");
            }
        }
    }
    let _ = cubicle_node::fsutil::remove_tree(Path::new(&format!("/tmp/cbmv-{pid}-bucket")));
    drop(server);
    if failed > 0 {
        std::process::exit(1);
    }
}

/// moto's server on a free port of 127.0.0.1, with the test bucket; killed on drop.
struct S3Server {
    child: Child,
    port: u16,
}

impl S3Server {
    fn start(moto: &Path) -> anyhow::Result<S3Server> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = Command::new(moto)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let server = S3Server { child, port };
        let t = Instant::now();
        loop {
            // moto checks no signatures: a plain PUT creates the bucket.
            if let Ok(code) = server.request("PUT", &format!("/{BUCKET}"))
                && code == 200
            {
                break;
            }
            ensure!(
                t.elapsed() < Duration::from_secs(30),
                "moto did not answer on port {port} within 30 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        println!(
            "  S3 server (moto) on 127.0.0.1:{port}, up in {:?}",
            t.elapsed()
        );
        Ok(server)
    }

    fn request(&self, method: &str, path: &str) -> anyhow::Result<u16> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.port
        )?;
        let mut head = [0u8; 12];
        s.read_exact(&mut head)?;
        Ok(std::str::from_utf8(&head[9..12])?.parse()?)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn open_node(envd: &Path, state: &Path, first_slot: u32, url: &str) -> anyhow::Result<Node> {
    let mut cfg = NodeConfig::new(state, envd);
    cfg.first_slot = first_slot;
    cfg.max_sandboxes = 16;
    cfg.any_free_slots = true;
    let node = Node::open(cfg).await?;
    node.set_object_store(ObjectStoreConfig {
        bucket: Bucket::open(url)?,
        publish_snapshots: false,
        publish_paused: false,
    });
    Ok(node)
}

fn tiny() -> CreateRequest {
    CreateRequest {
        template: "tiny".into(),
        timeout: Some(Duration::from_secs(300)),
        ..Default::default()
    }
}

async fn sh(node: &Node, id: &str, script: &str) -> anyhow::Result<String> {
    let out = common::run(
        node,
        id,
        Some("root"),
        "/bin/sh",
        &["-c", script],
        Duration::from_secs(20),
    )
    .await?;
    ensure!(
        out.code == 0,
        "`{script}` in {id}: exit {} {}",
        out.code,
        out.err
    );
    Ok(out.out.trim().to_string())
}

/// Starts the counter (a shell loop whose count lives in its memory, written to
/// `/tmp/count` every 50 ms, by rename: a checkpoint can freeze it between the
/// truncation and the write of a plain `>`, and a read then finds the file empty) and
/// waits until it counted a little. Returns its pid.
async fn start_counter(node: &Node, id: &str) -> anyhow::Result<String> {
    let spec = ProcessSpec {
        cmd: "/bin/sh".into(),
        args: vec![
            "-c".into(),
            "echo $$ > /tmp/counter.pid; i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done".into(),
        ],
        user: Some("root".into()),
        ..Default::default()
    };
    node.envd(id)?.start_detached(&spec).await?;
    let t = Instant::now();
    loop {
        if let Ok(n) = sh(node, id, "cat /tmp/count 2>/dev/null || echo 0").await
            && n.parse::<u64>().unwrap_or(0) >= 5
        {
            break;
        }
        ensure!(
            t.elapsed() < Duration::from_secs(10),
            "the counter does not count"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sh(node, id, "cat /tmp/counter.pid").await
}

/// The counter is the same process (same pid, still running) and its count went on
/// from at least `from` (a restarted loop would start again at 1).
async fn counter_went_on(node: &Node, id: &str, pid: &str, from: u64) -> anyhow::Result<u64> {
    let alive = sh(node, id, &format!("kill -0 {pid} && echo alive")).await?;
    ensure!(alive == "alive", "the counter (pid {pid}) is gone in {id}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let n: u64 = sh(node, id, "cat /tmp/count").await?.parse()?;
    ensure!(
        n > from,
        "count {n} did not go on from {from}: memory was not kept"
    );
    Ok(n)
}

async fn scenario(envd: &Path, name: &str, url: &str, with_base: bool) -> anyhow::Result<()> {
    let pid = std::process::id();
    let (sa, sb) = (
        PathBuf::from(format!("/tmp/cbmv-{pid}-{name}-a")),
        PathBuf::from(format!("/tmp/cbmv-{pid}-{name}-b")),
    );
    if with_base {
        common::prepare_base_template(&sa).await?;
        common::prepare_base_template(&sb).await?;
    }
    let a = open_node(envd, &sa, 27000, url).await?;
    let b = open_node(envd, &sb, 27100, url).await?;
    let res = steps(&a, &b, &sb, url, with_base).await;
    for (n, s) in [(&a, &sa), (&b, &sb)] {
        n.kill_all().await;
        for snap in n.snapshots() {
            let _ = n.delete_snapshot(&snap.id).await;
        }
        n.close();
        if let Some(e) = common::remove_state_dir(s) {
            eprintln!("  {e}");
        }
    }
    res
}

async fn steps(a: &Node, b: &Node, sb: &Path, url: &str, with_base: bool) -> anyhow::Result<()> {
    // --- a template pushed by A, used by B on its first create ---
    let store = a.templates().clone();
    tokio::task::spawn_blocking(move || store.ensure("tiny", false)).await??;
    let r = a.push_template("tiny").await?;
    println!(
        "  push template tiny: {} blob(s), {} bytes, {:?}",
        r.blobs_moved, r.bytes_moved, r.took
    );
    ensure!(r.blobs_moved == 1, "tiny is one layer: {r:?}");
    let again = a.push_template("tiny").await?;
    ensure!(
        again.blobs_moved == 0,
        "a second push moved blobs: {again:?}"
    );
    ensure!(b.templates().get("tiny")?.is_none());
    let t = Instant::now();
    let s = b.create(tiny()).await?;
    println!(
        "  B: create from a template it did not have: {:?} (download included)",
        t.elapsed()
    );
    ensure!(sh(b, &s.id, "echo moved").await? == "moved");
    let tb = b.templates().get("tiny")?.context("B has tiny now")?;
    let ta = a.templates().get("tiny")?.context("A has tiny")?;
    ensure!(tb.config.layers == ta.config.layers, "same layers");
    b.kill(&s.id).await?;

    // --- a snapshot of A, a sandbox of it in B ---
    let src = a.create(tiny()).await?;
    let counter = start_counter(a, &src.id).await?;
    sh(a, &src.id, "echo on-disk > /root/mark").await?;
    let snap = a
        .snapshot(
            &src.id,
            SnapshotRequest {
                memory: true,
                ..Default::default()
            },
        )
        .await?
        .snapshot;
    let at_snap: u64 = sh(a, &src.id, "cat /tmp/count").await?.parse()?;
    let r = a.push_snapshot(&snap.id).await?;
    println!("  push snapshot: {} bytes, {:?}", r.bytes_moved, r.took);
    let t = Instant::now();
    let from_snap = b
        .create(CreateRequest {
            template: snap.id.clone(),
            ..tiny()
        })
        .await?;
    println!(
        "  B: create from A's snapshot: {:?} (download included)",
        t.elapsed()
    );
    ensure!(sh(b, &from_snap.id, "cat /root/mark").await? == "on-disk");
    // The snapshot's counter process, restored: same pid in its pid namespace.
    counter_went_on(b, &from_snap.id, &counter, 1).await?;
    let _ = at_snap;
    b.kill(&from_snap.id).await?;

    // --- a corrupted blob: refused, nothing installed ---
    b.delete_snapshot(&snap.id).await?;
    let bucket = Bucket::open(url)?;
    let m: cubicle_node::SnapshotManifest = bucket
        .get_json(&format!("snapshots/{}.json", snap.id))
        .await?
        .context("snapshot manifest")?;
    bucket
        .put_raw(
            &Bucket::blob_key(&m.data.digest),
            b"not a snapshot".to_vec(),
        )
        .await?;
    b.settle(Duration::from_secs(10)).await;
    let dirs_before = sandbox_dirs(sb);
    let err = b
        .create(CreateRequest {
            template: snap.id.clone(),
            ..tiny()
        })
        .await
        .err()
        .context("a create from a corrupted snapshot succeeded")?;
    let msg = err.to_string();
    println!("  corrupted blob: {msg}");
    ensure!(msg.contains("corrupt"), "unclear error: {msg}");
    ensure!(
        b.find_snapshot(&snap.id).is_none(),
        "a snapshot record was installed"
    );
    ensure!(
        sandbox_dirs(sb) == dirs_before,
        "sandbox directories left: {:?}",
        sandbox_dirs(sb)
    );
    ensure!(
        std::fs::read_dir(sb.join("objstore-tmp"))?.count() == 0,
        "scratch files left"
    );
    // Pushing again repairs it (same content, same digest: the blob is written anew).
    bucket.delete(&Bucket::blob_key(&m.data.digest)).await?;
    a.push_snapshot(&snap.id).await?;
    let (again, _) = b.pull_snapshot(&snap.id).await?;
    ensure!(again.id == snap.id);

    // --- a paused sandbox of A resumed in B with its memory ---
    let before = sh(a, &src.id, "cat /tmp/count").await?.parse::<u64>()?;
    a.pause(
        &src.id,
        PauseRequest {
            memory: true,
            require_healthy_guest: true,
        },
    )
    .await?;
    let r = a.push_paused(&src.id).await?;
    println!(
        "  push paused sandbox: {} bytes, {:?}",
        r.bytes_moved, r.took
    );
    // While B pulls it, B answers for it as paused and busy, never "not found": in a
    // cluster a replica names B its owner before B has it, and another replica that
    // asks B meanwhile would record the sandbox as ended.
    let pull = b.pull_paused(&src.id);
    tokio::pin!(pull);
    let mut probes = 0;
    let (info, pulled) = loop {
        tokio::select! {
            biased;
            r = &mut pull => break r?,
            _ = tokio::task::yield_now() => {
                let seen = b.info(&src.id).await.context("B's answer while it pulls the sandbox")?;
                ensure!(seen.state == SandboxState::Paused,
                    "B answered {:?} while it pulled the sandbox", seen.state);
                probes += 1;
            }
        }
    };
    ensure!(probes > 0, "the pull ended before B was asked");
    println!("  B: asked {probes} time(s) while it pulled the paused sandbox: paused each time");
    ensure!(info.access_token == src.access_token, "same token");
    println!(
        "  B: pull paused sandbox: download {:?} ({} bytes), install {:?}",
        pulled.transfer,
        pulled.bytes_moved,
        pulled.took - pulled.transfer
    );
    let resumed = b.resume(&src.id, Duration::from_secs(120), true).await?;
    println!("  B: resume of A's paused tiny sandbox: {:?}", resumed.took);
    counter_went_on(b, &src.id, &counter, before)
        .await
        .context("the counter after the move")?;
    ensure!(sh(b, &src.id, "cat /root/mark").await? == "on-disk");
    // One owner: A lets its copy go.
    a.release_moved(&src.id)
        .await
        .context("release A's paused copy")?;
    ensure!(a.get(&src.id).is_err(), "A still knows the moved sandbox");
    counter_went_on(b, &src.id, &counter, before).await?;
    b.kill(&src.id).await.context("kill B's")?;

    if with_base {
        base_resume_latency(a, b).await?;
    }
    Ok(())
}

/// Issue 19's target: an idle `base` sandbox paused on A resumes on B within 500 ms
/// (the download, reported apart, excluded).
async fn base_resume_latency(a: &Node, b: &Node) -> anyhow::Result<()> {
    let s = a.create(common::base()).await?;
    sh(a, &s.id, "echo base > /root/mark").await?;
    // For comparison: the same sandbox paused and resumed on its own node.
    let full = PauseRequest {
        memory: true,
        require_healthy_guest: true,
    };
    a.pause(&s.id, full).await?;
    let local = a.resume(&s.id, Duration::from_secs(120), true).await?;
    println!("  base: resume on the same node: {:?}", local.took);
    a.pause(
        &s.id,
        PauseRequest {
            memory: true,
            require_healthy_guest: true,
        },
    )
    .await?;
    let r = a.push_paused(&s.id).await?;
    println!(
        "  base: push paused (template base published first): {} blob(s), {} bytes, {:?}",
        r.blobs_moved, r.bytes_moved, r.took
    );
    let (_, pulled) = b.pull_paused(&s.id).await?;
    println!(
        "  base: pull paused on B: download {:?} ({} bytes), install {:?}",
        pulled.transfer,
        pulled.bytes_moved,
        pulled.took - pulled.transfer
    );
    let resumed = b.resume(&s.id, Duration::from_secs(120), true).await?;
    println!(
        "  base: RESUME ON THE OTHER NODE: {:?} (target 500 ms)",
        resumed.took
    );
    ensure!(sh(b, &s.id, "cat /root/mark").await? == "base");
    ensure!(
        resumed.took < Duration::from_secs(3),
        "resume on the other node took {:?}",
        resumed.took
    );
    a.release_moved(&s.id).await?;
    b.kill(&s.id).await?;
    Ok(())
}

fn sandbox_dirs(state: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(state.join("sandboxes"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}
