//! Fixtures for the router's integration tests: a fake resolver, a real `cubicle-envd
//! --dev` on a Unix socket in a temp dir, the data plane served on 127.0.0.1:0 (REST
//! requests get a 418 so dispatch mistakes show), a network namespace standing in for a
//! sandbox (`unshare --net sleep`), servers inside it, and a small HTTP/1 client.

#![allow(dead_code)]

use std::{
    collections::HashMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    body::Body as AxumBody, extract::Request as AxumRequest, http::StatusCode,
    response::IntoResponse,
};
use bytes::Bytes;
use cubicle_router::{DataPlane, RouterConfig, SandboxResolver, SandboxTarget, ServerLimits};
use cubicle_runtime::network::{Netns, loopback_up, run_in_netns};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::{Request, Response, body::Incoming};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpStream;

// ---------------------------------------------------------------- resolver

/// A resolver over a map the test fills.
#[derive(Default)]
pub struct FakeResolver {
    pub map: Mutex<HashMap<String, SandboxTarget>>,
    /// Idle envd connections to hand over ([`SandboxResolver::take_envd_conn`]).
    pub conns: Mutex<HashMap<String, std::os::unix::net::UnixStream>>,
}

impl FakeResolver {
    pub fn insert(&self, t: SandboxTarget) {
        self.map.lock().unwrap().insert(t.id.clone(), t);
    }
}

impl SandboxResolver for FakeResolver {
    fn resolve(&self, id: &str) -> Option<SandboxTarget> {
        self.map.lock().unwrap().get(id).cloned()
    }
    fn running(&self) -> Vec<SandboxTarget> {
        self.map.lock().unwrap().values().cloned().collect()
    }
    fn take_envd_conn(&self, id: &str) -> Option<std::os::unix::net::UnixStream> {
        self.conns.lock().unwrap().remove(id)
    }
}

/// A pidfd of `pid` (`None` when there is no such process), as the node hands them out.
pub fn pidfd(pid: u32) -> Option<Arc<std::os::fd::OwnedFd>> {
    cubicle_syscalls::pidfd::pidfd_open(pid as i32)
        .ok()
        .map(Arc::new)
}

/// A target whose init is process `init_pid` (reached through a pidfd opened now).
pub fn target(
    id: &str,
    socket: &Path,
    init_pid: u32,
    token: Option<&str>,
    traffic: Option<&str>,
) -> SandboxTarget {
    SandboxTarget {
        id: id.into(),
        envd_socket: socket.to_owned(),
        init_pidfd: pidfd(init_pid),
        envd_access_token: token.map(Into::into),
        traffic_access_token: traffic.map(Into::into),
        mask_request_host: None,
    }
}

// ---------------------------------------------------------------- envd

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `target/debug/cubicle-envd`, built if missing.
pub fn envd_binary() -> PathBuf {
    let root = workspace_root();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let bin = target.join("debug/cubicle-envd");
    if !bin.exists() {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "-p", "cubicle-envd"])
            .current_dir(&root)
            .status()
            .expect("running cargo build -p cubicle-envd");
        assert!(status.success(), "cargo build -p cubicle-envd failed");
    }
    bin
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A fresh temp dir (removed on drop).
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "cubicle-router-test-{tag}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A real `cubicle-envd --dev --no-tcp --unix-socket <dir>/ctl/envd.sock`.
pub struct Envd {
    child: Child,
    pub dir: TempDir,
    pub socket: PathBuf,
    pub token: String,
}

impl Envd {
    pub fn start(token: &str) -> Envd {
        let dir = TempDir::new("envd");
        let socket = dir.path().join("ctl/envd.sock");
        let child = Command::new(envd_binary())
            .args(["--dev", "--no-tcp", "--unix-socket"])
            .arg(&socket)
            .env("CUBICLE_ENVD_ACCESS_TOKEN", token)
            .env("CUBICLE_ENVD_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .expect("spawning cubicle-envd");
        let deadline = Instant::now() + Duration::from_secs(20);
        // The socket's file appears at bind(), a moment before listen(): wait until it
        // accepts a connection (a request in that gap was refused: CI saw it).
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(
                Instant::now() < deadline,
                "envd did not listen on {}",
                socket.display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Envd {
            child,
            dir,
            socket,
            token: token.into(),
        }
    }

    /// A scratch directory for files.
    pub fn files_dir(&self) -> PathBuf {
        let p = self.dir.path().join("files");
        std::fs::create_dir_all(&p).unwrap();
        p
    }
}

impl Drop for Envd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------- router

/// Serves the data plane (and a stand-in REST API answering 418) on 127.0.0.1:0, with
/// `cubicle serve`'s front door and its default limits.
pub async fn start_router(resolver: Arc<FakeResolver>, config: RouterConfig) -> SocketAddr {
    start_router_with_limits(resolver, config, ServerLimits::default()).await
}

/// [`start_router`] with the given connection limits.
pub async fn start_router_with_limits(
    resolver: Arc<FakeResolver>,
    config: RouterConfig,
    limits: ServerLimits,
) -> SocketAddr {
    let dp = DataPlane::new(resolver, config);
    let app = axum::Router::new().fallback(move |req: AxumRequest| {
        let dp = dp.clone();
        async move {
            if dp.wants(&req) {
                dp.handle(req).await
            } else {
                (StatusCode::IM_A_TEAPOT, "rest api").into_response()
            }
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(cubicle_router::server::serve(
        listener,
        app,
        limits,
        None,
        std::future::pending(),
    ));
    addr
}

// ---------------------------------------------------------------- client

pub type TestBody = BoxBody<Bytes, std::io::Error>;

pub fn full(data: impl Into<Bytes>) -> TestBody {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed()
}

pub fn empty() -> TestBody {
    full(Bytes::new())
}

/// A request with `Host: 127.0.0.1` and the given headers.
pub fn request(
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: TestBody,
) -> Request<TestBody> {
    let mut b = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "127.0.0.1");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(body).unwrap()
}

/// One HTTP/1.1 connection per call (upgrades enabled).
pub async fn send(addr: SocketAddr, req: Request<TestBody>) -> Response<Incoming> {
    let stream = TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    sender.send_request(req).await.unwrap()
}

pub async fn body_bytes(resp: Response<Incoming>) -> Bytes {
    resp.into_body().collect().await.unwrap().to_bytes()
}

pub async fn body_text(resp: Response<Incoming>) -> String {
    String::from_utf8_lossy(&body_bytes(resp).await).into_owned()
}

/// Routing headers for sandbox `id`, port `port`.
pub fn route(id: &str, port: u16) -> Vec<(String, String)> {
    vec![
        ("E2b-Sandbox-Id".into(), id.into()),
        ("E2b-Sandbox-Port".into(), port.to_string()),
    ]
}

pub fn hdrs(v: &[(String, String)]) -> Vec<(&str, &str)> {
    v.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect()
}

// ---------------------------------------------------------------- connect framing

#[allow(unused_imports)] // not every test binary sends envelopes
pub use cubicle_proto::connect::envelope;

pub fn parse_envelopes(data: &[u8]) -> Vec<(u8, Value)> {
    let mut d = cubicle_proto::connect::EnvelopeDecoder::new(64 << 20);
    d.push(data);
    let mut out = Vec::new();
    while let Some(e) = d.next_envelope().unwrap() {
        out.push((e.flags, serde_json::from_slice(&e.payload).unwrap()));
    }
    assert_eq!(d.pending(), 0, "trailing partial envelope");
    out
}

// ---------------------------------------------------------------- network namespace

pub fn is_root() -> bool {
    // SAFETY: plain getter.
    unsafe { libc::geteuid() == 0 }
}

/// A network namespace held by `unshare --net sleep 1000`, with `lo` up: its pid plays a
/// sandbox's init pid.
pub struct NetnsBox {
    child: Child,
    pub pid: u32,
    pub netns: Netns,
}

impl NetnsBox {
    /// `None` (with a message) when not root.
    pub fn new(test: &str) -> Option<NetnsBox> {
        if !is_root() {
            eprintln!("skipping {test}: needs root to create a network namespace");
            return None;
        }
        let mut child = Command::new("unshare")
            .args(["--net", "sleep", "1000"])
            .stdin(Stdio::null())
            .spawn()
            .expect("spawning unshare --net");
        let pid = child.id();
        let ours = std::fs::read_link("/proc/self/ns/net").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match std::fs::read_link(format!("/proc/{pid}/ns/net")) {
                Ok(ns) if ns != ours => break,
                _ => {}
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("unshare --net did not enter a new namespace");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let netns = Netns::from_pid(pid as i32).unwrap();
        loopback_up(&netns).unwrap();
        Some(NetnsBox { child, pid, netns })
    }

    /// Like [`NetnsBox::new`], but the namespace's process gets pid `wanted` (a pid that
    /// was just freed), set up through `/proc/sys/kernel/ns_last_pid`; other processes of
    /// the host may take it first, so this retries. `None` when it did not succeed.
    pub fn with_pid(test: &str, wanted: u32) -> Option<NetnsBox> {
        for _ in 0..200 {
            std::fs::write("/proc/sys/kernel/ns_last_pid", (wanted - 1).to_string()).ok()?;
            let b = NetnsBox::new(test)?;
            if b.pid == wanted {
                return Some(b);
            }
        }
        None
    }

    /// A listener on 127.0.0.1:0 inside the namespace.
    pub fn listen(&self) -> tokio::net::TcpListener {
        let l = run_in_netns(&self.netns, || std::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap()
            .unwrap();
        l.set_nonblocking(true).unwrap();
        tokio::net::TcpListener::from_std(l).unwrap()
    }
}

impl Drop for NetnsBox {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Server-side TCP connections on `port` in the ESTABLISHED state inside the network
/// namespace of `pid` (from `/proc/<pid>/net/tcp`).
pub fn established_on(pid: u32, port: u16) -> usize {
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3
                && f[1]
                    .rsplit(':')
                    .next()
                    .and_then(|p| u16::from_str_radix(p, 16).ok())
                    == Some(port)
                && f[3] == "01"
        })
        .count()
}

/// A user web server inside the namespace: `GET /hello`, `GET /slow` (answers after 60 s), `GET /headers` (the request
/// headers as JSON), `POST /echo` (streams the body back), `GET /endless` (never ends;
/// `dropped` counts bodies dropped by the peer going away).
pub async fn serve_web(listener: tokio::net::TcpListener, dropped: Arc<AtomicUsize>) {
    use axum::routing::{get, post};
    let app = axum::Router::new()
        .route("/hello", get(|| async { "hello from the sandbox" }))
        .route(
            "/headers",
            get(|headers: axum::http::HeaderMap| async move {
                let map: serde_json::Map<String, Value> = headers
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.as_str().to_owned(),
                            Value::String(v.to_str().unwrap_or("").to_owned()),
                        )
                    })
                    .collect();
                axum::Json(Value::Object(map))
            }),
        )
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(60)).await;
                "late"
            }),
        )
        .route(
            "/echo",
            post(|body: AxumBody| async move { AxumBody::new(body) }),
        )
        .route(
            "/endless",
            get(move || {
                let dropped = dropped.clone();
                async move {
                    struct Guard(Arc<AtomicUsize>);
                    impl Drop for Guard {
                        fn drop(&mut self) {
                            self.0.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    let guard = Guard(dropped);
                    let stream = futures_util::stream::unfold(guard, |g| async move {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        Some((Ok::<_, std::io::Error>(Bytes::from_static(b"tick\n")), g))
                    });
                    AxumBody::from_stream(stream)
                }
            }),
        );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
}

// ---------------------------------------------------------------- websocket

pub const WS_GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

pub fn ws_accept(key: &str) -> String {
    use base64::Engine;
    use sha1::{Digest, Sha1};
    let digest = Sha1::digest(format!("{key}{WS_GUID}").as_bytes());
    base64::engine::general_purpose::STANDARD.encode(digest)
}

/// Reads one WebSocket frame: (opcode, unmasked payload).
pub async fn ws_read_frame<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
) -> std::io::Result<(u8, Vec<u8>)> {
    use tokio::io::AsyncReadExt;
    let mut h = [0u8; 2];
    r.read_exact(&mut h).await?;
    let opcode = h[0] & 0x0f;
    let masked = h[1] & 0x80 != 0;
    let mut len = (h[1] & 0x7f) as u64;
    if len == 126 {
        len = r.read_u16().await? as u64;
    } else if len == 127 {
        len = r.read_u64().await?;
    }
    let mut mask = [0u8; 4];
    if masked {
        r.read_exact(&mut mask).await?;
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload).await?;
    if masked {
        for (i, b) in payload.iter_mut().enumerate() {
            *b ^= mask[i % 4];
        }
    }
    Ok((opcode, payload))
}

/// Encodes one final frame, masked when `mask` is given (client → server).
pub fn ws_frame(opcode: u8, payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
    let mut f = vec![0x80 | opcode];
    let m = if mask.is_some() { 0x80 } else { 0 };
    if payload.len() < 126 {
        f.push(m | payload.len() as u8);
    } else if payload.len() <= u16::MAX as usize {
        f.push(m | 126);
        f.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    } else {
        f.push(m | 127);
        f.extend_from_slice(&(payload.len() as u64).to_be_bytes());
    }
    match mask {
        Some(k) => {
            f.extend_from_slice(&k);
            f.extend(payload.iter().enumerate().map(|(i, b)| b ^ k[i % 4]));
        }
        None => f.extend_from_slice(payload),
    }
    f
}

/// A tiny WebSocket echo server (RFC 6455 handshake, echoes text/binary frames, answers
/// close) on `listener`.
pub async fn serve_ws_echo(listener: tokio::net::TcpListener) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if s.read_exact(&mut byte).await.is_err() || head.len() > 16 * 1024 {
                        return;
                    }
                    head.push(byte[0]);
                }
                let text = String::from_utf8_lossy(&head).into_owned();
                let key = text
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.trim()
                            .eq_ignore_ascii_case("sec-websocket-key")
                            .then(|| v.trim().to_owned())
                    })
                    .unwrap_or_default();
                let resp = format!(
                    "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {}\r\n\r\n",
                    ws_accept(&key)
                );
                if s.write_all(resp.as_bytes()).await.is_err() {
                    return;
                }
                loop {
                    let Ok((op, payload)) = ws_read_frame(&mut s).await else {
                        return;
                    };
                    let out = ws_frame(op, &payload, None);
                    if s.write_all(&out).await.is_err() || op == 0x8 {
                        return;
                    }
                }
            });
        }
    });
}

/// Max RSS growth sampler: call `stop()` to get the peak VmRSS (bytes) seen.
pub struct RssSampler {
    stop: Arc<std::sync::atomic::AtomicBool>,
    handle: Option<std::thread::JoinHandle<u64>>,
}

pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

impl RssSampler {
    pub fn start() -> RssSampler {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut peak = 0;
            while !s.load(Ordering::SeqCst) {
                peak = peak.max(rss_bytes());
                std::thread::sleep(Duration::from_millis(10));
            }
            peak.max(rss_bytes())
        });
        RssSampler {
            stop,
            handle: Some(handle),
        }
    }

    pub fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        self.handle.take().unwrap().join().unwrap()
    }
}
