//! Node lifecycle logic against a fake runtime (no namespaces, cgroups or root needed):
//! each "sandbox" is a `sleep` process plus a thread answering envd's HTTP on the
//! sandbox's socket with 204.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::*;
use crate::runtime::{SandboxStats, StartSpec, Started};

#[derive(Default)]
struct FakeRuntime {
    procs: Mutex<HashMap<String, std::process::Child>>,
    fail_start: AtomicBool,
    destroyed: Mutex<Vec<String>>,
    /// Where volumes live (`<state>/sandboxes/.volumes`, as the real storage's).
    volumes: Mutex<PathBuf>,
    /// While true, `start` waits (a sandbox being made, held halfway).
    hold_starts: (Mutex<bool>, std::sync::Condvar),
    /// Starts waiting there now.
    held_now: std::sync::atomic::AtomicUsize,
}

impl FakeRuntime {
    fn for_state(dir: &Path) -> Self {
        let rt = FakeRuntime::default();
        *rt.volumes.lock().unwrap() = dir
            .join("sandboxes")
            .join(cubicle_runtime::storage::VOLUMES);
        rt
    }
}

fn serve_204(listener: UnixListener) {
    std::thread::spawn(move || {
        for mut s in listener.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = s.write_all(b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n");
        }
    });
}

impl SandboxRuntime for FakeRuntime {
    fn start(&self, spec: &StartSpec) -> Result<Started> {
        let (held, cv) = &self.hold_starts;
        self.held_now.fetch_add(1, Ordering::SeqCst);
        let _released = cv.wait_while(held.lock().unwrap(), |held| *held).unwrap();
        self.held_now.fetch_sub(1, Ordering::SeqCst);
        if self.fail_start.load(Ordering::SeqCst) {
            return Err(Error::Runtime("injected start failure".into()));
        }
        let ctl = spec.sandbox_dir.join("ctl");
        std::fs::create_dir_all(&ctl).map_err(|e| Error::io("mkdir", &ctl, e))?;
        let sock = ctl.join("envd.sock");
        let l = UnixListener::bind(&sock).map_err(|e| Error::io("bind", &sock, e))?;
        serve_204(l);
        let child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .map_err(|e| Error::io("spawn", "sleep", e))?;
        let pid = child.id() as i32;
        self.procs
            .lock()
            .unwrap()
            .insert(spec.id.to_string(), child);
        Ok(Started {
            pid,
            state: serde_json::Value::Null,
        })
    }
    fn adopt(&self, _id: &str, _dir: &Path) -> Result<i32> {
        Err(Error::Runtime("fake runtime cannot adopt".into()))
    }
    fn create_dir(&self, _id: &str, dir: &Path, _disk_mb: u64) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("mkdir", dir, e))
    }
    fn remove_dir(&self, _id: &str, dir: &Path) -> Result<()> {
        Ok(fsutil::remove_tree(dir)?)
    }
    fn reconcile_storage(&self, _known: &[String]) -> Result<()> {
        Ok(())
    }
    fn destroy(&self, id: &str, _slot: Option<u32>, _dir: &Path) -> Result<()> {
        if let Some(mut c) = self.procs.lock().unwrap().remove(id) {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.destroyed.lock().unwrap().push(id.to_string());
        Ok(())
    }
    fn reconcile_network(&self, _owned: std::ops::Range<u32>, _known: &[u32]) -> Result<()> {
        Ok(())
    }
    fn limit_hit(&self, _id: &str, _dir: &Path) -> Option<DeathReason> {
        None
    }
    fn memory_usage(&self, _id: &str) -> Option<u64> {
        None
    }
    fn stats(&self, _id: &str) -> Option<SandboxStats> {
        None
    }
    fn set_limits(&self, _id: &str, _memory_mb: u64, _cpus: u32, _pids: u32) -> Result<()> {
        Ok(())
    }
    fn set_cpu_nice(&self, _id: &str, _nice: i32) {}
    fn max_slots(&self) -> u32 {
        8
    }
    fn volume_dir(&self, id: &str) -> Result<PathBuf> {
        Ok(self.volumes.lock().unwrap().join(id))
    }
    fn create_volume(
        &self,
        id: &str,
        _size_mb: u64,
        _uid: u32,
        _gid: u32,
        _mode: u32,
    ) -> Result<()> {
        let d = self.volume_dir(id)?;
        std::fs::create_dir_all(&d).map_err(|e| Error::io("mkdir", &d, e))
    }
    fn remove_volume(&self, id: &str) -> Result<()> {
        Ok(fsutil::remove_tree(&self.volume_dir(id)?)?)
    }
}

fn state(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("cbnu-{}-{name}", std::process::id()))
}

async fn open(name: &str) -> (Node, Arc<FakeRuntime>, PathBuf) {
    open_with(name, |_| {}).await
}

async fn open_with(
    name: &str,
    configure: impl FnOnce(&mut NodeConfig),
) -> (Node, Arc<FakeRuntime>, PathBuf) {
    let dir = state(name);
    let _ = fsutil::remove_tree(&dir);
    // A tiny template without building one: a config and an empty rootfs.
    let t = dir.join("templates/fake");
    std::fs::create_dir_all(t.join("rootfs")).unwrap();
    fsutil::write_json_atomic(
        &t.join("template.json"),
        &crate::template::TemplateConfig::with_defaults("fake", "test"),
    )
    .unwrap();
    let rt = Arc::new(FakeRuntime::for_state(&dir));
    let mut cfg = NodeConfig::new(&dir, "/nonexistent/envd");
    cfg.max_sandboxes = 2;
    configure(&mut cfg);
    let node = Node::open_with_runtime(cfg, rt.clone()).await.unwrap();
    (node, rt, dir)
}

fn req() -> CreateRequest {
    CreateRequest {
        template: "fake".into(),
        ..Default::default()
    }
}

/// Waits (up to 10 s) until the node's pool counters satisfy `ok`.
async fn wait_for(node: &Node, what: &str, ok: impl Fn(&crate::PoolStats) -> bool) {
    let t = std::time::Instant::now();
    loop {
        let s = node.pool_stats();
        if ok(&s) {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{what}: {s:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A create that finds its pool empty while a refill is under way, with no cold create's
/// turn free (the refill holds the only one), takes the sandbox that refill makes: it is
/// served from the pool, counted as a miss that waited, and nothing is made cold.
#[tokio::test]
async fn a_miss_takes_the_sandbox_a_refill_under_way_makes() {
    let (node, rt, dir) = open_with("miss-waits", |cfg| {
        cfg.max_sandboxes = 4;
        cfg.create_concurrency = 1;
        cfg.pool.insert("fake".into(), 1);
    })
    .await;
    let pooled = |r: &CreateRequest| CreateRequest {
        internet: true,
        ..r.clone()
    };
    wait_for(&node, "first refill", |s| s.ready.get("fake") == Some(&1)).await;
    // The next refill will stop halfway, holding the only turn.
    *rt.hold_starts.0.lock().unwrap() = true;
    let a = node.create(pooled(&req())).await.unwrap();
    assert!(a.claimed);
    // The refill holds the turn once its start is waiting.
    let t = std::time::Instant::now();
    while rt.held_now.load(Ordering::SeqCst) == 0 {
        assert!(t.elapsed() < Duration::from_secs(10), "no refill started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let node2 = node.clone();
    let b = tokio::spawn(async move { node2.create(pooled(&req())).await });
    wait_for(&node, "second create missed", |s| s.misses == 1).await;
    assert!(!b.is_finished(), "the miss waits for the refill or a turn");
    *rt.hold_starts.0.lock().unwrap() = false;
    rt.hold_starts.1.notify_all();
    let b = b.await.unwrap().unwrap();
    assert!(b.claimed, "served by the refill, not made cold");
    let s = node.pool_stats();
    assert_eq!((s.claims, s.misses, s.waited), (1, 1, 1), "{s:?}");
    node.kill(&a.id).await.unwrap();
    node.kill(&b.id).await.unwrap();
    node.close();
    // The refill under way and the teardowns end before the directory goes (they would
    // make its `sandboxes/` again: an empty directory was left in /tmp by every run).
    node.wait_refills(Duration::from_secs(10)).await;
    wait_for(&node, "teardowns", |s| s.teardowns == 0).await;
    let _ = fsutil::remove_tree(&dir);
}

/// While claims overlap (a burst of creates), the refill starts nothing: a sandbox it
/// made now would be ready only after the burst, and its making takes the burst's CPU.
/// Once they no longer overlap, it refills at once.
#[tokio::test]
async fn the_refill_holds_off_while_claims_overlap() {
    let (node, _rt, dir) = open_with("burst-hold", |cfg| {
        cfg.max_sandboxes = 8;
        cfg.pool.insert("fake".into(), 2);
        // Longer than the test's look (the default is 250 ms), so a slow machine cannot
        // end the hold before it.
        cfg.refill_burst_hold = Duration::from_secs(30);
    })
    .await;
    let pooled = CreateRequest {
        internet: true,
        ..req()
    };
    wait_for(&node, "first refill", |s| s.ready.get("fake") == Some(&2)).await;
    let made = node.pool_stats().refills;
    // Two other claims under way, as in a burst.
    let (one, two) = (node.inner.pool.claiming(), node.inner.pool.claiming());
    let a = node.create(pooled.clone()).await.unwrap();
    assert!(a.claimed);
    // Well past the pause after a claim (25 ms) and what a fake sandbox takes to make.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let s = node.pool_stats();
    assert_eq!((s.refills, s.ready.get("fake")), (made, Some(&1)), "{s:?}");
    drop((one, two));
    wait_for(&node, "the refill after the burst", |s| {
        s.ready.get("fake") == Some(&2)
    })
    .await;
    node.kill(&a.id).await.unwrap();
    node.close();
    let _ = fsutil::remove_tree(&dir);
}

#[tokio::test]
async fn create_list_kill_frees_everything() {
    let (node, rt, dir) = open("basic").await;
    let a = node.create(req()).await.unwrap();
    assert_eq!(a.state, SandboxState::Running);
    let rec: SandboxRecord =
        fsutil::read_json(&dir.join("sandboxes").join(&a.id).join("sandbox.json")).unwrap();
    assert_eq!(rec.state, SandboxState::Running);
    assert_eq!(rec.pid, a.pid);
    assert_eq!(rec.env_vars.get("E2B_SANDBOX_ID"), Some(&a.id.to_string()));
    let b = node.create(req()).await.unwrap();
    assert_ne!(a.uid_base, b.uid_base);
    // Capacity is 2 slots.
    assert!(matches!(node.create(req()).await, Err(Error::Capacity(_))));
    assert_eq!(node.list().len(), 2);
    node.kill(&a.id).await.unwrap();
    assert!(!dir.join("sandboxes").join(&a.id).exists());
    assert_eq!(
        node.get(&a.id).unwrap().death_reason,
        Some(DeathReason::Killed)
    );
    assert!(rt.destroyed.lock().unwrap().contains(&a.id.to_string()));
    // The freed slot is reused.
    let c = node.create(req()).await.unwrap();
    assert_eq!(c.uid_base, a.uid_base);
    assert!(matches!(
        node.create(CreateRequest {
            id: Some("Bad-Id".into()),
            ..req()
        })
        .await,
        Err(Error::InvalidRequest(_))
    ));
    assert!(matches!(
        node.create(CreateRequest {
            memory_mb: Some(1),
            ..req()
        })
        .await,
        Err(Error::InvalidRequest(_))
    ));
    node.kill_all().await;
    assert!(node.list().is_empty());
    node.close();
    fsutil::remove_tree(&dir).unwrap();
}

/// A status poll skips the listing while [`Node::listing_version`] stays: every change a
/// listing shows must move it, and reading must not.
#[tokio::test]
async fn the_listing_version_moves_with_what_a_listing_shows() {
    let (node, _rt, dir) = open("version").await;
    let v0 = node.listing_version();
    let a = node.create(req()).await.unwrap();
    let v1 = node.listing_version();
    assert!(v1 > v0);
    let _ = (node.list(), node.get(&a.id), node.peek(&a.id));
    assert_eq!(node.listing_version(), v1, "reading is no change");
    node.set_timeout(&a.id, std::time::Duration::from_secs(99))
        .unwrap();
    let v2 = node.listing_version();
    assert!(v2 > v1, "a new end time is a change");
    node.kill(&a.id).await.unwrap();
    assert!(node.listing_version() > v2, "a kill is a change");
    node.close();
    fsutil::remove_tree(&dir).unwrap();
}

#[tokio::test]
async fn failed_start_leaves_nothing() {
    let (node, rt, dir) = open("fail").await;
    rt.fail_start.store(true, Ordering::SeqCst);
    assert!(matches!(node.create(req()).await, Err(Error::Runtime(_))));
    assert!(node.list().is_empty());
    assert_eq!(std::fs::read_dir(dir.join("sandboxes")).unwrap().count(), 0);
    rt.fail_start.store(false, Ordering::SeqCst);
    // Both slots are still available.
    let a = node.create(req()).await.unwrap();
    let b = node.create(req()).await.unwrap();
    node.kill(&a.id).await.unwrap();
    node.kill(&b.id).await.unwrap();
    node.close();
    fsutil::remove_tree(&dir).unwrap();
}

#[tokio::test]
async fn timeouts_and_exits_name_the_death() {
    let (node, rt, dir) = open("timeout").await;
    let a = node
        .create(CreateRequest {
            timeout: Some(Duration::from_millis(300)),
            ..req()
        })
        .await
        .unwrap();
    let b = node.create(req()).await.unwrap();
    // b's "init" exits on its own.
    if let Some(c) = rt.procs.lock().unwrap().get_mut(b.id.as_str()) {
        c.kill().unwrap();
        let _ = c.wait();
    }
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(
        node.get(&a.id).unwrap().death_reason,
        Some(DeathReason::Timeout)
    );
    assert_eq!(
        node.get(&b.id).unwrap().death_reason,
        Some(DeathReason::Exited)
    );
    assert!(node.list().is_empty());
    node.close();
    fsutil::remove_tree(&dir).unwrap();
}

#[tokio::test]
async fn reopen_removes_unadoptable_records() {
    let (node, _rt, dir) = open("reopen").await;
    let a = node.create(req()).await.unwrap();
    node.close();
    drop(node);
    // A record left mid-create, and a stray file.
    let stale = dir.join("sandboxes/istale");
    std::fs::create_dir_all(&stale).unwrap();
    let mut rec: SandboxRecord =
        fsutil::read_json(&dir.join("sandboxes").join(&a.id).join("sandbox.json")).unwrap();
    rec.id = "istale".parse().unwrap();
    rec.state = SandboxState::Creating;
    fsutil::write_json_atomic(&stale.join("sandbox.json"), &rec).unwrap();
    std::fs::write(dir.join("sandboxes/.junk"), b"x").unwrap();
    // The storage's recycle bin, which the storage adopts or drops (not the node).
    for bin in [".recycled-3", ".recycling-iold"] {
        std::fs::create_dir_all(dir.join("sandboxes").join(bin)).unwrap();
    }
    let rt2 = Arc::new(FakeRuntime::default());
    let node = Node::open_with_runtime(NodeConfig::new(&dir, "/nonexistent/envd"), rt2.clone())
        .await
        .unwrap();
    let report = node.reconcile_report();
    // The fake runtime cannot adopt, so both go.
    assert!(report.adopted.is_empty());
    assert!(
        report.removed.contains(&"istale".to_string())
            && report.removed.contains(&a.id.to_string())
    );
    let mut left: Vec<String> = std::fs::read_dir(dir.join("sandboxes"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, [".recycled-3", ".recycling-iold"]);
    assert!(
        rt2.destroyed
            .lock()
            .unwrap()
            .contains(&"istale".to_string())
    );
    node.close();
    fsutil::remove_tree(&dir).unwrap();
}

/// A volume a live sandbox mounts cannot be deleted; a missing or deleted one cannot be
/// mounted; volumes and their data survive a node restart (reconciliation leaves the
/// volumes' directory alone).
#[tokio::test]
async fn volumes_in_use_stay_and_outlive_the_node() {
    let (node, rt, dir) = open("volumes").await;
    node.create_volume("vol-a", 64).await.unwrap();
    let vdir = rt.volume_dir("vol-a").unwrap();
    std::fs::write(vdir.join("data"), b"kept").unwrap();
    let vm = crate::VolumeMount {
        volume_id: "vol-a".into(),
        path: "/mnt/a".into(),
        read_only: true,
    };
    let a = node
        .create(CreateRequest {
            volumes: vec![vm.clone()],
            ..req()
        })
        .await
        .unwrap();
    assert_eq!(a.volumes, vec![vm.clone()]);
    let rec: SandboxRecord =
        fsutil::read_json(&dir.join("sandboxes").join(&a.id).join("sandbox.json")).unwrap();
    assert_eq!(rec.volumes, vec![vm.clone()]);
    assert_eq!(node.volume_users("vol-a"), vec![a.id.to_string()]);
    match node.delete_volume("vol-a").await {
        Err(Error::VolumeInUse { volume, sandboxes }) => {
            assert_eq!(
                (volume.as_str(), sandboxes),
                ("vol-a", vec![a.id.to_string()])
            );
        }
        other => panic!("delete of a mounted volume: {other:?}"),
    }
    let missing = crate::VolumeMount {
        volume_id: "nope".into(),
        ..vm.clone()
    };
    assert!(matches!(
        node.create(CreateRequest {
            volumes: vec![missing],
            ..req()
        })
        .await,
        Err(Error::VolumeNotFound(_))
    ));
    let bad_path = crate::VolumeMount {
        path: "/proc/x".into(),
        ..vm.clone()
    };
    assert!(matches!(
        node.create(CreateRequest {
            volumes: vec![bad_path],
            ..req()
        })
        .await,
        Err(Error::InvalidRequest(_))
    ));
    node.kill(&a.id).await.unwrap();
    assert!(node.volume_users("vol-a").is_empty());
    node.close();
    drop(node);
    let rt2 = Arc::new(FakeRuntime::for_state(&dir));
    let node = Node::open_with_runtime(NodeConfig::new(&dir, "/nonexistent/envd"), rt2.clone())
        .await
        .unwrap();
    assert_eq!(std::fs::read(vdir.join("data")).unwrap(), b"kept");
    node.delete_volume("vol-a").await.unwrap();
    assert!(!vdir.exists());
    assert!(matches!(
        node.create(CreateRequest {
            volumes: vec![vm],
            ..req()
        })
        .await,
        Err(Error::VolumeNotFound(_))
    ));
    node.close();
    fsutil::remove_tree(&dir).unwrap();
}

/// envd's socket path (defined in cubicle-proto, which the in-sandbox interpreter also
/// reads) is the socket the runtime creates in `<sandbox dir>/ctl`, seen where it is mounted.
#[test]
fn envd_socket_is_in_the_ctl_dir() {
    assert_eq!(
        Path::new(cubicle_proto::ENVD_SOCKET_IN_SANDBOX),
        Path::new(cubicle_runtime::CTL_DIR).join(ENVD_SOCKET)
    );
}
