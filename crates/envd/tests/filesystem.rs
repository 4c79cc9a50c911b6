//! End-to-end tests of `filesystem.Filesystem` over real HTTP/1.1 with raw Connect JSON:
//! the router is served in-process on 127.0.0.1:<ephemeral> and driven with a bare hyper
//! client, in a temporary directory. envd's default user here is the user running the
//! tests (development mode).

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use bytes::Bytes;
use cubicle_envd::{
    server::{self, AppState},
    state::{Config, Context},
};
use http_body_util::{BodyExt, Full};
use hyper::{Request, body::Incoming, client::conn::http1};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpStream;

/// Watch tests count this process's inotify descriptors; they must not overlap.
static WATCH_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Server {
    addr: SocketAddr,
    state: Arc<AppState>,
}

async fn server() -> Server {
    let ctx = Arc::new(Context::new(Config {
        dev: true,
        default_user: None,
        default_workdir: None,
        access_token: None,
    }));
    let state = AppState::new(ctx);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = server::router(state.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Server { addr, state }
}

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        let p = std::env::temp_dir().join(format!(
            "cubicle-envd-fs-test-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&p).unwrap();
        // Canonical, so reported paths compare equal even if the temp dir is a symlink.
        TempDir(std::fs::canonicalize(&p).unwrap())
    }
    fn join(&self, p: &str) -> PathBuf {
        self.0.join(p)
    }
    fn s(&self, p: &str) -> String {
        self.join(p).to_string_lossy().into_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn send(
    addr: SocketAddr,
    method: &str,
    content_type: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> hyper::Response<Incoming> {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = Request::post(format!("http://{addr}/filesystem.Filesystem/{method}"))
        .header("content-type", content_type)
        .header("connect-protocol-version", "1")
        .header("host", addr.to_string());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    sender
        .send_request(req.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .unwrap()
}

/// A unary call: (HTTP status, JSON body).
async fn unary_raw(
    addr: SocketAddr,
    method: &str,
    body: &[u8],
    headers: &[(&str, &str)],
) -> (u16, Value) {
    let resp = send(addr, method, "application/json", body.to_vec(), headers).await;
    let status = resp.status().as_u16();
    let ct = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string());
    assert_eq!(ct.as_deref(), Some("application/json"), "{method}");
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

async fn unary(addr: SocketAddr, method: &str, body: Value) -> (u16, Value) {
    unary_raw(addr, method, body.to_string().as_bytes(), &[]).await
}

use cubicle_proto::connect::{EnvelopeDecoder, envelope};

/// A server stream being read envelope by envelope.
struct StreamReader {
    body: Incoming,
    decoder: EnvelopeDecoder,
}

impl StreamReader {
    async fn open(addr: SocketAddr, method: &str, msg: Value, headers: &[(&str, &str)]) -> Self {
        let resp = send(
            addr,
            method,
            "application/connect+json",
            envelope(0, msg.to_string().as_bytes()).to_vec(),
            headers,
        )
        .await;
        assert_eq!(resp.status().as_u16(), 200);
        assert_eq!(resp.headers()["content-type"], "application/connect+json");
        StreamReader {
            body: resp.into_body(),
            decoder: EnvelopeDecoder::new(64 << 20),
        }
    }

    /// The next envelope: (flags, JSON), or None on timeout / end of body.
    async fn next(&mut self, wait: Duration) -> Option<(u8, Value)> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(e) = self.decoder.next_envelope().unwrap() {
                return Some((e.flags, serde_json::from_slice(&e.payload).unwrap()));
            }
            match tokio::time::timeout_at(deadline, self.body.frame()).await {
                Ok(Some(Ok(f))) => {
                    if let Ok(d) = f.into_data() {
                        self.decoder.push(&d);
                    }
                }
                _ => return None,
            }
        }
    }

    /// Filesystem events until every `(name, type)` of `want` was seen (or 10 s passed),
    /// then until 200 ms pass without one (keepalives skipped).
    async fn events(&mut self, want: &[(&str, &str)]) -> Vec<Value> {
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let all = want.iter().all(|(n, t)| has_event(&out, n, t));
            let wait = if all {
                Duration::from_millis(200)
            } else {
                deadline.saturating_duration_since(tokio::time::Instant::now())
            };
            let Some((flags, v)) = self.next(wait).await else {
                break;
            };
            assert_eq!(flags, 0, "unexpected end of stream: {v}");
            if let Some(ev) = v.get("filesystem") {
                out.push(ev.clone());
            }
        }
        out
    }
}

fn has_event(events: &[Value], name: &str, ty: &str) -> bool {
    events.iter().any(|e| e["name"] == name && e["type"] == ty)
}

fn names(entries: &Value) -> Vec<String> {
    entries["entries"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|e| e["path"].as_str().unwrap().to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn inotify_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            std::fs::read_link(e.path())
                .map(|t| t.to_string_lossy().contains("inotify"))
                .unwrap_or(false)
        })
        .count()
}

#[tokio::test]
async fn list_dir_depths_symlinks_and_errors() {
    let srv = server().await;
    let d = TempDir::new();
    std::fs::create_dir_all(d.join("a/b/c")).unwrap();
    std::fs::write(d.join("a/f.txt"), b"hello").unwrap();
    std::os::unix::fs::symlink(d.join("a"), d.join("link")).unwrap();
    std::os::unix::fs::symlink(d.join("loop"), d.join("loop")).unwrap();

    let (st, v) = unary(srv.addr, "ListDir", json!({"path": d.s(""), "depth": 1})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(names(&v), vec![d.s("a"), d.s("link"), d.s("loop")]);
    let link = &v["entries"][1];
    assert_eq!(link["type"], "FILE_TYPE_DIRECTORY");
    assert_eq!(link["isSymlink"], true);
    assert_eq!(link["symlinkTarget"], d.s("a"));
    let lp = &v["entries"][2];
    assert_eq!(lp["type"], "FILE_TYPE_SYMLINK");

    // depth 0 means 1.
    let (_, v0) = unary(srv.addr, "ListDir", json!({"path": d.s("")})).await;
    assert_eq!(names(&v0), names(&v));

    let (st, v) = unary(srv.addr, "ListDir", json!({"path": d.s(""), "depth": 2})).await;
    assert_eq!(st, 200);
    assert_eq!(
        names(&v),
        vec![
            d.s("a"),
            d.s("a/b"),
            d.s("a/f.txt"),
            d.s("link"),
            d.s("loop")
        ]
    );
    let f = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "f.txt")
        .unwrap();
    assert_eq!(f["type"], "FILE_TYPE_FILE");
    assert_eq!(f["size"], "5"); // int64 as a JSON string
    assert_eq!(f["permissions"].as_str().unwrap().len(), 10);
    let mtime = f["modifiedTime"].as_str().unwrap();
    assert!(mtime.starts_with("20") && mtime.contains('T'), "{mtime}");
    assert!(f["owner"].as_str().is_some_and(|s| !s.is_empty()));

    // Huge depth terminates (symlinks are not descended into).
    let (st, v) = unary(
        srv.addr,
        "ListDir",
        json!({"path": d.s(""), "depth": 4294967295u32}),
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(names(&v).len(), 6);

    // A symlinked directory is followed; paths keep the requested prefix.
    let (st, v) = unary(
        srv.addr,
        "ListDir",
        json!({"path": d.s("link"), "depth": 2}),
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(
        names(&v),
        vec![d.s("link/b"), d.s("link/b/c"), d.s("link/f.txt")]
    );

    let (st, v) = unary(srv.addr, "ListDir", json!({"path": d.s("loop")})).await;
    assert_eq!(
        (st, v["code"].as_str()),
        (400, Some("failed_precondition")),
        "{v}"
    );
    let (st, v) = unary(srv.addr, "ListDir", json!({"path": d.s("a/f.txt")})).await;
    assert_eq!((st, v["code"].as_str()), (400, Some("invalid_argument")));
    let (st, v) = unary(srv.addr, "ListDir", json!({"path": d.s("missing")})).await;
    assert_eq!((st, v["code"].as_str()), (404, Some("not_found")));
    assert!(v["message"].as_str().is_some());
    // `..` is cleaned lexically.
    let (st, v) = unary(
        srv.addr,
        "ListDir",
        json!({"path": format!("{}/a/b/../..", d.s(""))}),
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(names(&v).len(), 3);
}

#[tokio::test]
async fn stat_make_dir_move_remove() {
    let srv = server().await;
    let d = TempDir::new();

    let (st, v) = unary(srv.addr, "MakeDir", json!({"path": d.s("x/y/z")})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["entry"]["name"], "z");
    assert_eq!(v["entry"]["type"], "FILE_TYPE_DIRECTORY");
    assert!(d.join("x/y/z").is_dir());
    let (st, v) = unary(srv.addr, "MakeDir", json!({"path": d.s("x/y/z")})).await;
    assert_eq!((st, v["code"].as_str()), (409, Some("already_exists")));
    std::fs::write(d.join("file"), b"abc").unwrap();
    let (st, v) = unary(srv.addr, "MakeDir", json!({"path": d.s("file")})).await;
    assert_eq!((st, v["code"].as_str()), (400, Some("invalid_argument")));

    let (st, v) = unary(srv.addr, "Stat", json!({"path": d.s("file")})).await;
    assert_eq!(st, 200);
    assert_eq!(v["entry"]["path"], d.s("file"));
    assert_eq!(v["entry"]["size"], "3");
    assert!(v["entry"].get("isSymlink").is_none());
    assert!(v["entry"].get("symlinkTarget").is_none());
    std::os::unix::fs::symlink("file", d.join("lnk")).unwrap();
    let (st, v) = unary(srv.addr, "Stat", json!({"path": d.s("lnk")})).await;
    assert_eq!(st, 200);
    assert_eq!(v["entry"]["name"], "lnk");
    assert_eq!(v["entry"]["type"], "FILE_TYPE_FILE");
    assert_eq!(v["entry"]["isSymlink"], true);
    assert_eq!(v["entry"]["symlinkTarget"], d.s("file"));
    assert!(v["entry"]["permissions"].as_str().unwrap().starts_with('L'));
    let (st, v) = unary(srv.addr, "Stat", json!({"path": d.s("nope")})).await;
    assert_eq!((st, v["code"].as_str()), (404, Some("not_found")));

    let (st, v) = unary(
        srv.addr,
        "Move",
        json!({"source": d.s("file"), "destination": d.s("p/q/moved")}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["entry"]["path"], d.s("p/q/moved"));
    assert_eq!(std::fs::read(d.join("p/q/moved")).unwrap(), b"abc");
    assert!(!d.join("file").exists());
    let (st, v) = unary(
        srv.addr,
        "Move",
        json!({"source": d.s("file"), "destination": d.s("other")}),
    )
    .await;
    assert_eq!((st, v["code"].as_str()), (404, Some("not_found")));

    let (st, v) = unary(srv.addr, "Remove", json!({"path": d.s("x")})).await;
    assert_eq!((st, &v), (200, &json!({})));
    assert!(!d.join("x").exists());
    let (st, _) = unary(srv.addr, "Remove", json!({"path": d.s("x")})).await;
    assert_eq!(st, 200, "a missing path is not an error");
    let (st, v) = unary(srv.addr, "Remove", json!({"path": ""})).await;
    assert_eq!((st, v["code"].as_str()), (400, Some("invalid_argument")));
}

#[tokio::test]
async fn bad_input_is_a_clean_error() {
    let _g = WATCH_LOCK.lock().await; // creates a (polling) watcher
    let srv = server().await;
    let d = TempDir::new();
    for body in [
        &b"{not json"[..],
        b"[]",
        b"{\"path\": 5}",
        b"{\"depth\": -1}",
        b"\xff\xfe",
    ] {
        let (st, v) = unary_raw(srv.addr, "ListDir", body, &[]).await;
        assert_eq!(
            (st, v["code"].as_str()),
            (400, Some("invalid_argument")),
            "{body:?}"
        );
    }
    let (st, v) = unary(srv.addr, "Stat", json!({"path": "/tmp/a\u{0}b"})).await;
    assert_eq!((st, v["code"].as_str()), (400, Some("invalid_argument")));
    // Unknown fields are ignored; snake_case accepted.
    let (st, _) = unary(
        srv.addr,
        "Stat",
        json!({"path": d.s(""), "someNewField": 1}),
    )
    .await;
    assert_eq!(st, 200);
    let (st, v) = unary(
        srv.addr,
        "CreateWatcher",
        json!({"path": d.s(""), "include_entry": true}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let id = v["watcherId"].as_str().unwrap().to_string();
    let (st, _) = unary(srv.addr, "RemoveWatcher", json!({"watcherId": id})).await;
    assert_eq!(st, 200);
    // Unknown user.
    let (st, v) = unary_raw(
        srv.addr,
        "Stat",
        json!({"path": "/"}).to_string().as_bytes(),
        &[("authorization", "Basic bm9ib2R5LWhlcmUteHl6Og==")],
    )
    .await;
    assert_eq!((st, v["code"].as_str()), (401, Some("unauthenticated")));
    // A bad stream request ends the stream with an error, HTTP 200.
    let resp = send(
        srv.addr,
        "WatchDir",
        "application/connect+json",
        b"\x00\x00\x00".to_vec(),
        &[],
    )
    .await;
    assert_eq!(resp.status().as_u16(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body[0], 2);
    let v: Value = serde_json::from_slice(&body[5..]).unwrap();
    assert_eq!(v["error"]["code"], "invalid_argument");
}

#[tokio::test]
async fn watch_dir_stream_events() {
    let _g = WATCH_LOCK.lock().await;
    let srv = server().await;
    let d = TempDir::new();
    std::fs::create_dir(d.join("sub")).unwrap();

    // Errors are reported in the end-of-stream envelope.
    let mut s =
        StreamReader::open(srv.addr, "WatchDir", json!({"path": d.s("missing")}), &[]).await;
    let (flags, v) = s.next(Duration::from_secs(5)).await.unwrap();
    assert_eq!((flags, v["error"]["code"].as_str()), (2, Some("not_found")));
    std::fs::write(d.join("plain"), b"").unwrap();
    let mut s = StreamReader::open(srv.addr, "WatchDir", json!({"path": d.s("plain")}), &[]).await;
    let (flags, v) = s.next(Duration::from_secs(5)).await.unwrap();
    assert_eq!(
        (flags, v["error"]["code"].as_str()),
        (2, Some("invalid_argument"))
    );

    let mut s = StreamReader::open(
        srv.addr,
        "WatchDir",
        json!({"path": d.s(""), "recursive": true, "includeEntry": true}),
        &[("keepalive-ping-interval", "1")],
    )
    .await;
    let (flags, v) = s.next(Duration::from_secs(5)).await.unwrap();
    assert_eq!((flags, &v), (0, &json!({"start": {}})));

    std::fs::write(d.join("new.txt"), b"hi").unwrap();
    std::fs::write(d.join("sub/inner.txt"), b"x").unwrap();
    std::fs::create_dir_all(d.join("deep/er")).unwrap();
    std::fs::write(d.join("deep/er/f"), b"x").unwrap();
    let ev = s
        .events(&[
            ("new.txt", "EVENT_TYPE_CREATE"),
            ("new.txt", "EVENT_TYPE_WRITE"),
            ("sub/inner.txt", "EVENT_TYPE_CREATE"),
            ("deep/er/f", "EVENT_TYPE_CREATE"),
        ])
        .await;
    assert!(has_event(&ev, "new.txt", "EVENT_TYPE_CREATE"), "{ev:?}");
    assert!(has_event(&ev, "new.txt", "EVENT_TYPE_WRITE"), "{ev:?}");
    assert!(
        has_event(&ev, "sub/inner.txt", "EVENT_TYPE_CREATE"),
        "{ev:?}"
    );
    assert!(has_event(&ev, "deep/er", "EVENT_TYPE_CREATE"), "{ev:?}");
    assert!(has_event(&ev, "deep/er/f", "EVENT_TYPE_CREATE"), "{ev:?}");
    let created = ev
        .iter()
        .find(|e| e["name"] == "new.txt" && e["type"] == "EVENT_TYPE_WRITE")
        .unwrap();
    assert_eq!(created["entry"]["name"], "new.txt");
    assert_eq!(created["entry"]["path"], d.s("new.txt"));

    std::fs::rename(d.join("new.txt"), d.join("renamed.txt")).unwrap();
    std::fs::remove_file(d.join("renamed.txt")).unwrap();
    let ev = s
        .events(&[
            ("new.txt", "EVENT_TYPE_RENAME"),
            ("renamed.txt", "EVENT_TYPE_CREATE"),
            ("renamed.txt", "EVENT_TYPE_REMOVE"),
        ])
        .await;
    assert!(has_event(&ev, "new.txt", "EVENT_TYPE_RENAME"), "{ev:?}");
    assert!(has_event(&ev, "renamed.txt", "EVENT_TYPE_CREATE"), "{ev:?}");
    assert!(has_event(&ev, "renamed.txt", "EVENT_TYPE_REMOVE"), "{ev:?}");
    assert!(
        ev.iter()
            .filter(|e| e["type"] == "EVENT_TYPE_REMOVE")
            .all(|e| e.get("entry").is_none())
    );

    // Keepalives flow when idle.
    let (flags, v) = s.next(Duration::from_secs(3)).await.unwrap();
    assert_eq!((flags, &v), (0, &json!({"keepalive": {}})));
}

#[tokio::test]
async fn watch_dir_deadline_ends_stream() {
    let _g = WATCH_LOCK.lock().await;
    let srv = server().await;
    let d = TempDir::new();
    let before = inotify_fds();
    let mut s = StreamReader::open(
        srv.addr,
        "WatchDir",
        json!({"path": d.s("")}),
        &[("connect-timeout-ms", "300")],
    )
    .await;
    assert_eq!(
        s.next(Duration::from_secs(5)).await.unwrap().1,
        json!({"start": {}})
    );
    let (flags, v) = s.next(Duration::from_secs(5)).await.unwrap();
    assert_eq!(
        (flags, v["error"]["code"].as_str()),
        (2, Some("deadline_exceeded"))
    );
    drop(s);
    wait_for_fds(before).await;
}

async fn wait_for_fds(expected: usize) {
    for _ in 0..100 {
        if inotify_fds() == expected {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "inotify descriptors: {} (expected {expected})",
        inotify_fds()
    );
}

#[tokio::test]
async fn dropped_watch_stream_frees_its_inotify_instance() {
    let _g = WATCH_LOCK.lock().await;
    let srv = server().await;
    let d = TempDir::new();
    let before = inotify_fds();
    // A long keepalive: the release must not wait for a failed write.
    let mut s = StreamReader::open(
        srv.addr,
        "WatchDir",
        json!({"path": d.s(""), "recursive": true}),
        &[("keepalive-ping-interval", "3600")],
    )
    .await;
    assert_eq!(
        s.next(Duration::from_secs(5)).await.unwrap().1,
        json!({"start": {}})
    );
    assert_eq!(inotify_fds(), before + 1);
    drop(s); // closes the client connection
    wait_for_fds(before).await;
}

#[tokio::test]
async fn polling_watcher_lifecycle() {
    let _g = WATCH_LOCK.lock().await;
    let srv = server().await;
    let d = TempDir::new();
    let before = inotify_fds();

    let (st, v) = unary(srv.addr, "CreateWatcher", json!({"path": d.s("missing")})).await;
    assert_eq!((st, v["code"].as_str()), (404, Some("not_found")));

    let (st, v) = unary(
        srv.addr,
        "CreateWatcher",
        json!({"path": d.s(""), "recursive": true, "includeEntry": true}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let id = v["watcherId"].as_str().unwrap().to_string();
    assert_eq!(srv.state.filesystem.polling_watchers(), 1);
    assert_eq!(inotify_fds(), before + 1);

    std::fs::create_dir(d.join("dir")).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    std::fs::write(d.join("dir/file"), b"x").unwrap();
    let mut ev: Vec<Value> = Vec::new();
    for _ in 0..100 {
        let (st, v) = unary(srv.addr, "GetWatcherEvents", json!({"watcherId": id})).await;
        assert_eq!(st, 200, "{v}");
        ev.extend(v["events"].as_array().cloned().unwrap_or_default());
        if has_event(&ev, "dir/file", "EVENT_TYPE_WRITE") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(has_event(&ev, "dir", "EVENT_TYPE_CREATE"), "{ev:?}");
    assert!(has_event(&ev, "dir/file", "EVENT_TYPE_CREATE"), "{ev:?}");
    assert!(has_event(&ev, "dir/file", "EVENT_TYPE_WRITE"), "{ev:?}");
    // Drained: the next poll has nothing new.
    let (st, v) = unary(srv.addr, "GetWatcherEvents", json!({"watcherId": id})).await;
    assert_eq!((st, &v), (200, &json!({})));

    let (st, v) = unary(srv.addr, "RemoveWatcher", json!({"watcherId": id})).await;
    assert_eq!((st, &v), (200, &json!({})));
    assert_eq!(srv.state.filesystem.polling_watchers(), 0);
    wait_for_fds(before).await;
    let (st, v) = unary(srv.addr, "GetWatcherEvents", json!({"watcherId": id})).await;
    assert_eq!((st, v["code"].as_str()), (404, Some("not_found")));
    let (st, v) = unary(srv.addr, "RemoveWatcher", json!({"watcherId": id})).await;
    assert_eq!((st, v["code"].as_str()), (404, Some("not_found")));
}

#[tokio::test]
async fn relative_and_home_paths_resolve_for_the_user() {
    let srv = server().await;
    let home = cubicle_envd::users::current().home;
    if !Path::new(&home).is_dir() {
        eprintln!(
            "skipping: the current user's home {} does not exist",
            home.display()
        );
        return;
    }
    let (st, v) = unary(srv.addr, "Stat", json!({"path": "~"})).await;
    assert_eq!(st, 200);
    assert_eq!(v["entry"]["path"], home.to_string_lossy().as_ref());
}
