//! EnvdClient: the node's HTTP/1 client for the envd inside a sandbox, over the Unix
//! socket envd listens on in the sandbox's host-visible control directory.
//!
//! It covers what the node needs: `GET /health` (204 = ready), `POST /init`, writing a
//! file (`POST /files`), and running one process through Connect's server-stream
//! `POST /process.Process/Start` (framing: `cubicle_proto::connect`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tokio::net::UnixStream;

use cubicle_proto::connect::{self as codec, client::StreamError};

use crate::error::{Error, Result};

/// Largest stream envelope accepted from envd.
const MAX_ENVELOPE: usize = 64 << 20;

/// The `/init` body (E2B's envd shape).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InitRequest {
    /// Sandbox-global environment.
    pub env_vars: BTreeMap<String, String>,
    /// Token every later request must carry in `X-Access-Token`.
    pub access_token: String,
    /// Default user.
    pub default_user: String,
    /// Default workdir (left out when the template sets none: the user's home).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_workdir: Option<String>,
}

impl InitRequest {
    /// What envd must be told about the sandbox `record` describes.
    pub fn for_record(record: &crate::sandbox::SandboxRecord) -> Self {
        InitRequest {
            env_vars: record.env_vars.clone(),
            access_token: record.access_token.clone(),
            default_user: record.default_user.clone(),
            default_workdir: record.default_workdir.clone(),
        }
    }
}

/// A process to run through `process.Process/Start`.
#[derive(Debug, Clone, Default)]
pub struct ProcessSpec {
    /// Executable.
    pub cmd: String,
    /// Arguments.
    pub args: Vec<String>,
    /// Extra environment.
    pub envs: BTreeMap<String, String>,
    /// Working directory (envd default when `None`).
    pub cwd: Option<String>,
    /// Acting user (HTTP Basic auth), envd's default user when `None`.
    pub user: Option<String>,
}

/// A process started by [`EnvdClient::start_watched`]: its output is collected until
/// this is dropped (the process itself keeps running).
pub struct Watched {
    /// Its pid inside the sandbox.
    pub pid: u32,
    /// The last bytes of its output and, once it ended, its exit code.
    seen: std::sync::Arc<std::sync::Mutex<(Vec<u8>, Option<i32>)>>,
    task: tokio::task::JoinHandle<()>,
}

impl Watched {
    /// A check, usable from any thread: its exit code once it has ended.
    pub fn exit_code(&self) -> impl Fn() -> Option<i32> + Send + 'static {
        let seen = self.seen.clone();
        move || seen.lock().unwrap_or_else(|p| p.into_inner()).1
    }

    /// What is known of it so far, for an error message: its exit code if it ended and
    /// the last lines of its output.
    pub fn describe(&self) -> String {
        let s = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let out = String::from_utf8_lossy(&s.0);
        let out = out.trim();
        let ended = match s.1 {
            Some(code) => format!("it exited with code {code}"),
            None => "it is still running".to_string(),
        };
        if out.is_empty() {
            format!("{ended}, no output")
        } else {
            format!("{ended}; its last output: {out}")
        }
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One piece of a running process's life.
#[derive(Debug, Clone, PartialEq)]
pub enum ProcessEvent {
    /// It started with this pid (inside the sandbox).
    Start(u32),
    /// Bytes on stdout.
    Stdout(Vec<u8>),
    /// Bytes on stderr.
    Stderr(Vec<u8>),
}

/// How a process ended.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessEnd {
    /// Exit code (-1 when killed by a signal).
    pub exit_code: i32,
    /// Whether it exited normally.
    pub exited: bool,
    /// `exit status N` / `signal: killed`.
    pub status: String,
}

#[derive(Deserialize)]
struct StartResponse {
    event: Option<Event>,
}

#[derive(Deserialize)]
struct Event {
    start: Option<StartEv>,
    data: Option<DataEv>,
    end: Option<EndEv>,
}

#[derive(Deserialize)]
struct StartEv {
    #[serde(default)]
    pid: u32,
}

#[derive(Deserialize)]
struct DataEv {
    stdout: Option<String>,
    stderr: Option<String>,
    pty: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct EndEv {
    #[serde(default)]
    exit_code: i32,
    #[serde(default)]
    exited: bool,
    #[serde(default)]
    status: String,
}

/// Connects to envd's socket without following anything the sandbox may have put in
/// its place: the socket's directory is writable by the sandbox's root, which could
/// replace the socket with a symlink to some host socket. `connect_ctl_socket` refuses
/// symlinks and non-sockets.
fn connect_socket_std(socket: &Path) -> Result<std::os::unix::net::UnixStream> {
    let (dir, name) = cubicle_runtime::ctl_socket_parts(socket)
        .map_err(|_| Error::Envd(format!("bad envd socket path {}", socket.display())))?;
    cubicle_runtime::connect_ctl_socket(dir, name)
        .map_err(|e| Error::Envd(format!("connect {}: {e}", socket.display())))
}

async fn connect_socket(socket: &Path) -> Result<UnixStream> {
    cubicle_runtime::ctl_socket_parts(socket)
        .map_err(|_| Error::Envd(format!("bad envd socket path {}", socket.display())))?;
    cubicle_runtime::connect_ctl_socket_async(socket)
        .await
        .map_err(|e| Error::Envd(format!("connect {}: {e}", socket.display())))
}

/// An idle HTTP/1 connection to a sandbox's envd, kept for the next request to it (the
/// node's `/init`, then the router's first request): a new connection costs a path walk,
/// a socket, envd's accept and a task on both sides. Blocking-mode agnostic (a std
/// stream, in non-blocking mode), so it can move between runtimes.
pub type IdleConn = std::os::unix::net::UnixStream;

/// Whether `conn` is still open with nothing unread: envd has not closed it (end of file)
/// and sent nothing unasked. Checked before a kept connection carries a request.
pub fn is_idle_open(conn: &IdleConn) -> bool {
    cubicle_syscalls::socket::is_idle_open(conn)
}

/// Client of one sandbox's envd.
#[derive(Debug, Clone)]
pub struct EnvdClient {
    socket: PathBuf,
    token: Option<String>,
}

impl EnvdClient {
    /// A client for the envd listening on `socket`; `token` goes in `X-Access-Token`.
    pub fn new(socket: impl Into<PathBuf>, token: Option<String>) -> Self {
        EnvdClient {
            socket: socket.into(),
            token,
        }
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    async fn send(&self, req: Request<Full<Bytes>>) -> Result<Response<Incoming>> {
        let stream = connect_socket(&self.socket).await?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| Error::Envd(format!("handshake: {e}")))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        sender
            .send_request(req)
            .await
            .map_err(|e| Error::Envd(format!("request: {e}")))
    }

    /// Sends `req` over `conn` when it is still open and idle (else over a new
    /// connection), reads the whole answer (small ones only: health, init), and gives the
    /// connection back when it can carry another request.
    async fn exchange(
        &self,
        conn: Option<IdleConn>,
        req: Request<Full<Bytes>>,
    ) -> Result<(StatusCode, Bytes, Option<IdleConn>)> {
        let stream = match conn.filter(is_idle_open) {
            Some(c) => UnixStream::from_std(c)
                .map_err(|e| Error::Envd(format!("adopting a connection: {e}")))?,
            None => connect_socket(&self.socket).await?,
        };
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| Error::Envd(format!("handshake: {e}")))?;
        let ask = async move {
            let resp = sender
                .send_request(req)
                .await
                .map_err(|e| Error::Envd(format!("request: {e}")))?;
            let status = resp.status();
            if !status.is_success() {
                // Not kept: its body is read only in part.
                let body = error_body(resp.into_body()).await;
                return Ok((status, Bytes::from(body), true));
            }
            let close = resp
                .headers()
                .get(hyper::header::CONNECTION)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
            // Bounded in size and time: the sandbox's root can put anything on envd's socket.
            let read = http_body_util::Limited::new(resp.into_body(), MAX_ERROR_BODY).collect();
            let body = tokio::time::timeout(ERROR_BODY_TIME, read)
                .await
                .map_err(|_| Error::Envd("the answer's body did not arrive".into()))?
                .map_err(|e| Error::Envd(format!("reading the answer: {e}")))?
                .to_bytes();
            // `sender` goes here: the connection's task then ends and hands the socket back.
            Ok::<_, Error>((status, body, close))
        };
        let (answer, parts) = tokio::join!(ask, conn.without_shutdown());
        let (status, body, close) = answer?;
        let conn = match parts {
            Ok(p) if !close && p.read_buf.is_empty() => p.io.into_inner().into_std().ok(),
            _ => None,
        };
        Ok((status, body, conn))
    }

    fn builder(&self, method: &str, path: &str) -> hyper::http::request::Builder {
        let mut b = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "envd");
        if let Some(t) = &self.token {
            b = b.header("x-access-token", t);
        }
        b
    }

    /// `GET /health`: Ok(true) on 204 (or any 2xx).
    pub async fn health(&self) -> Result<bool> {
        let (status, _, _) = self.exchange(None, self.health_request()?).await?;
        Ok(status.is_success())
    }

    fn health_request(&self) -> Result<Request<Full<Bytes>>> {
        self.builder("GET", "/health")
            .body(Full::new(Bytes::new()))
            .map_err(|e| Error::Envd(e.to_string()))
    }

    /// Wait until `/health` answers 2xx, `alive()` turns false (the sandbox died), or
    /// `timeout` passes. First waits (on a blocking thread, with 200 µs steps: tokio's
    /// timer has 1 ms granularity) until the socket accepts connections, which is usually a
    /// few milliseconds after the sandbox's init started; then asks `/health`.
    /// Returns the connection the successful `/health` went over, idle, for the next
    /// request (see [`EnvdClient::init_on`]).
    pub async fn wait_ready(
        &self,
        timeout: Duration,
        alive: impl Fn() -> bool + Send + Sync + 'static,
    ) -> Result<Option<IdleConn>> {
        let start = Instant::now();
        let socket = self.socket.clone();
        let alive = std::sync::Arc::new(alive);
        let alive2 = alive.clone();
        let accepted = tokio::task::spawn_blocking(move || {
            let mut n = 0u32;
            loop {
                if let Ok(conn) = connect_socket_std(&socket) {
                    // Non-blocking, as a kept connection is (the first /health's).
                    return Ok(conn.set_nonblocking(true).is_ok().then_some(conn));
                }
                n += 1;
                if n.is_multiple_of(16) && !alive2() {
                    return Err(Error::Envd(format!(
                        "sandbox init exited before envd listened on {}",
                        socket.display()
                    )));
                }
                if start.elapsed() > timeout {
                    return Err(Error::Envd(format!(
                        "{} not accepting after {timeout:?}",
                        socket.display()
                    )));
                }
                std::thread::sleep(Duration::from_micros(
                    if start.elapsed() < Duration::from_millis(200) {
                        200
                    } else {
                        5000
                    },
                ));
            }
        })
        .await
        .map_err(|e| Error::Envd(format!("wait task: {e}")))??;
        // The first /health goes over the connection that was just accepted.
        let mut first = accepted;
        let mut last_err;
        loop {
            match self.exchange(first.take(), self.health_request()?).await {
                Ok((status, _, conn)) if status.is_success() => return Ok(conn),
                Ok(_) => last_err = "health answered non-2xx".to_string(),
                Err(e) => last_err = e.to_string(),
            }
            if !alive() {
                return Err(Error::Envd(format!(
                    "sandbox init exited before envd was ready ({last_err})"
                )));
            }
            if start.elapsed() > timeout {
                return Err(Error::Envd(format!(
                    "not ready after {timeout:?}: {last_err}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// `POST /init`; expects 204 (any 2xx accepted).
    pub async fn init(&self, body: &InitRequest) -> Result<()> {
        self.init_on(None, body).await.map(drop)
    }

    /// [`EnvdClient::init`] over `conn` (an idle connection to this envd, from
    /// [`EnvdClient::wait_ready`] or an earlier init) when it is still open; gives the
    /// connection back for the next request.
    pub async fn init_on(
        &self,
        conn: Option<IdleConn>,
        body: &InitRequest,
    ) -> Result<Option<IdleConn>> {
        let json = serde_json::to_vec(body).map_err(|e| Error::Envd(e.to_string()))?;
        let req = self
            .builder("POST", "/init")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(json)))
            .map_err(|e| Error::Envd(e.to_string()))?;
        let (status, body, conn) = self.exchange(conn, req).await?;
        if !status.is_success() {
            let body = String::from_utf8_lossy(&body);
            return Err(Error::Envd(format!("/init answered {status}: {body}")));
        }
        Ok(conn)
    }

    /// `POST /files?path=…` (octet-stream): writes `data` to `path` inside the sandbox as
    /// `user` (envd's default user when `None`), like the SDKs' `files.write`.
    pub async fn write_file(&self, path: &str, user: Option<&str>, data: Bytes) -> Result<()> {
        let mut query = form_urlencoded::Serializer::new(String::new());
        query.append_pair("path", path);
        if let Some(u) = user {
            query.append_pair("username", u);
        }
        let query = query.finish();
        let req = self
            .builder("POST", &format!("/files?{query}"))
            .header("content-type", "application/octet-stream")
            .body(Full::new(data))
            .map_err(|e| Error::Envd(e.to_string()))?;
        let resp = self.send(req).await?;
        let status = resp.status();
        if !status.is_success() {
            let body = resp
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            return Err(Error::Envd(format!(
                "writing {path}: /files answered {status}: {}",
                String::from_utf8_lossy(&body)
            )));
        }
        Ok(())
    }

    /// Start a process and return its pid (inside the sandbox) as soon as envd reports it
    /// started, without waiting for its end: envd keeps a process running when its
    /// client goes away.
    pub async fn start_detached(&self, spec: &ProcessSpec) -> Result<u32> {
        Ok(self.start_watched(spec, 0).await?.pid)
    }

    /// Start a process like [`EnvdClient::start_detached`], but keep its last `keep`
    /// bytes of output (and its exit code, if it ends) until the returned [`Watched`]
    /// is dropped; the process keeps running after that.
    pub async fn start_watched(&self, spec: &ProcessSpec, keep: usize) -> Result<Watched> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut tx = Some(tx);
        let client = self.clone();
        let spec = spec.clone();
        let seen: std::sync::Arc<std::sync::Mutex<(Vec<u8>, Option<i32>)>> = Default::default();
        let s2 = seen.clone();
        let task = tokio::spawn(async move {
            let r = client
                .run(&spec, |ev| match ev {
                    ProcessEvent::Start(pid) => {
                        if let Some(tx) = tx.take() {
                            let _ = tx.send(pid);
                        }
                    }
                    ProcessEvent::Stdout(b) | ProcessEvent::Stderr(b) if keep > 0 => {
                        let mut s = s2.lock().unwrap_or_else(|p| p.into_inner());
                        s.0.extend_from_slice(&b);
                        let over = s.0.len().saturating_sub(keep);
                        s.0.drain(..over);
                    }
                    _ => {}
                })
                .await;
            match r {
                Ok(end) => s2.lock().unwrap_or_else(|p| p.into_inner()).1 = Some(end.exit_code),
                Err(e) => tracing::debug!("watched process stream ended: {e}"),
            }
        });
        match rx.await {
            Ok(pid) => Ok(Watched { pid, seen, task }),
            Err(_) => {
                let _ = task.await;
                Err(Error::Envd("the process did not start".into()))
            }
        }
    }

    /// Run a process to its end, handing each start/output event to `on_event` as it
    /// arrives. Returns how it ended.
    pub async fn run(
        &self,
        spec: &ProcessSpec,
        mut on_event: impl FnMut(ProcessEvent),
    ) -> Result<ProcessEnd> {
        let mut process = serde_json::json!({ "cmd": spec.cmd, "args": spec.args });
        if !spec.envs.is_empty() {
            process["envs"] =
                serde_json::to_value(&spec.envs).map_err(|e| Error::Envd(e.to_string()))?;
        }
        if let Some(cwd) = &spec.cwd {
            process["cwd"] = serde_json::Value::String(cwd.clone());
        }
        let body =
            codec::request_envelope(&serde_json::json!({ "process": process, "stdin": false }))
                .map_err(|e| Error::Envd(e.to_string()))?;
        let mut b = self
            .builder("POST", "/process.Process/Start")
            .header("content-type", codec::STREAM_CONTENT_TYPE)
            .header(codec::PROTOCOL_VERSION_HEADER, "1");
        if let Some(user) = &spec.user {
            b = b.header(
                "authorization",
                format!("Basic {}", B64.encode(format!("{user}:"))),
            );
        }
        let req = b
            .body(Full::new(body))
            .map_err(|e| Error::Envd(e.to_string()))?;
        let resp = self.send(req).await?;
        if resp.status() != StatusCode::OK {
            let status = resp.status();
            let body = error_body(resp.into_body()).await;
            return Err(Error::Envd(format!("Start answered {status}: {body}")));
        }
        let mut stream =
            codec::client::ServerStream::<_, StartResponse>::new(resp.into_body(), MAX_ENVELOPE);
        let mut end: Option<ProcessEnd> = None;
        loop {
            let msg = match stream.next().await {
                Ok(Some(msg)) => msg,
                Ok(None) => {
                    return end
                        .ok_or_else(|| Error::Envd("command ended without an end event".into()));
                }
                Err(StreamError::Rpc(e)) => {
                    return Err(Error::Envd(format!(
                        "process stream: [{}] {}",
                        e.code.as_str(),
                        e.message
                    )));
                }
                Err(StreamError::Protocol(m)) => return Err(Error::Envd(format!("stream: {m}"))),
            };
            let Some(ev) = msg.event else { continue };
            if let Some(s) = ev.start {
                on_event(ProcessEvent::Start(s.pid));
            }
            if let Some(d) = ev.data {
                if let Some(s) = d.stdout.or(d.pty) {
                    on_event(ProcessEvent::Stdout(decode_b64(&s)?));
                }
                if let Some(s) = d.stderr {
                    on_event(ProcessEvent::Stderr(decode_b64(&s)?));
                }
            }
            if let Some(e) = ev.end {
                end = Some(ProcessEnd {
                    exit_code: e.exit_code,
                    exited: e.exited,
                    status: e.status,
                });
            }
        }
    }
}

fn decode_b64(s: &str) -> Result<Vec<u8>> {
    B64.decode(s)
        .map_err(|e| Error::Envd(format!("bad base64 in output: {e}")))
}

/// The start of an error answer's body, for a message: at most [`MAX_ERROR_BODY`] bytes,
/// read for at most [`ERROR_BODY_TIME`]. The other end is a socket the sandbox's root can
/// replace with its own server, which may answer an endless body, or none.
async fn error_body(mut body: Incoming) -> String {
    let mut got = Vec::new();
    let read = async {
        while got.len() < MAX_ERROR_BODY {
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        let room = MAX_ERROR_BODY - got.len();
                        got.extend_from_slice(&data[..data.len().min(room)]);
                    }
                }
                _ => break,
            }
        }
    };
    let _ = tokio::time::timeout(ERROR_BODY_TIME, read).await;
    String::from_utf8_lossy(&got).into_owned()
}

/// How much of an error body [`error_body`] keeps, and the most a small answer read
/// whole (`EnvdClient::exchange`: health, init) may hold.
const MAX_ERROR_BODY: usize = 4096;
/// How long [`error_body`] and `EnvdClient::exchange` wait for a body.
const ERROR_BODY_TIME: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::*;

    /// An envd (or whatever the sandbox's root put on its socket) answering an error
    /// with an endless body: the client reads a bounded prefix and returns.
    #[tokio::test]
    async fn endless_error_body_is_cut_short() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = std::env::temp_dir().join(format!("cubicle-envdc-err-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("envd.sock");
        let _ = std::fs::remove_file(&sock);
        let listener = tokio::net::UnixListener::bind(&sock).unwrap();
        let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let sent2 = sent.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let sent = sent2.clone();
                tokio::spawn(async move {
                    let mut tmp = [0u8; 4096];
                    let _ = s.read(&mut tmp).await;
                    let head =
                        b"HTTP/1.1 500 Internal Server Error\r\ntransfer-encoding: chunked\r\n\r\n";
                    if s.write_all(head).await.is_err() {
                        return;
                    }
                    let chunk = format!("10000\r\n{}\r\n", "x".repeat(0x10000));
                    while s.write_all(chunk.as_bytes()).await.is_ok() {
                        sent.fetch_add(0x10000, std::sync::atomic::Ordering::SeqCst);
                    }
                });
            }
        });
        let c = EnvdClient::new(&sock, Some("tok".into()));
        let t = std::time::Instant::now();
        let req = InitRequest {
            env_vars: BTreeMap::new(),
            access_token: "tok".into(),
            default_user: "user".into(),
            default_workdir: Some("/home/user".into()),
        };
        let err = tokio::time::timeout(Duration::from_secs(10), c.init(&req))
            .await
            .expect("init must not read an endless error body to its end")
            .unwrap_err()
            .to_string();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(
            err.contains("500") && err.len() < 2 * MAX_ERROR_BODY,
            "{}",
            err.len()
        );
        let err = c
            .run(
                &ProcessSpec {
                    cmd: "id".into(),
                    ..Default::default()
                },
                |_| {},
            )
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("500") && err.len() < 2 * MAX_ERROR_BODY,
            "{}",
            err.len()
        );
        assert!(
            sent.load(std::sync::atomic::Ordering::SeqCst) < 64 << 20,
            "the client stopped reading"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A fake envd answering every request on a connection with 204 until the client
    /// closes it; counts connections and requests.
    fn keep_alive_envd(
        sock: &Path,
    ) -> (
        std::sync::Arc<std::sync::atomic::AtomicUsize>,
        std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) {
        use std::sync::atomic::Ordering::SeqCst;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let _ = std::fs::remove_file(sock);
        let listener = tokio::net::UnixListener::bind(sock).unwrap();
        let (conns, reqs) = (
            std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0)),
        );
        let (c2, r2) = (conns.clone(), reqs.clone());
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                c2.fetch_add(1, SeqCst);
                let reqs = r2.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut tmp = [0u8; 4096];
                    loop {
                        // One request: its head, then a body of content-length bytes.
                        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                            match s.read(&mut tmp).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&tmp[..n]),
                            }
                            continue;
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                        let len: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .map_or(0, |v| v.trim().parse().unwrap());
                        while buf.len() < end + 4 + len {
                            match s.read(&mut tmp).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&tmp[..n]),
                            }
                        }
                        buf.drain(..end + 4 + len);
                        reqs.fetch_add(1, SeqCst);
                        if s.write_all(b"HTTP/1.1 204 No Content\r\n\r\n")
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                });
            }
        });
        (conns, reqs)
    }

    /// The ready check's connection carries `/init` and comes back idle for the next
    /// request; a kept connection the other side closed is replaced by a new one.
    #[tokio::test]
    async fn a_kept_connection_carries_the_next_request() {
        use std::sync::atomic::Ordering::SeqCst;
        let dir = std::env::temp_dir().join(format!("cubicle-envdc-keep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("envd.sock");
        let (conns, reqs) = keep_alive_envd(&sock);
        let c = EnvdClient::new(&sock, Some("tok".into()));
        let conn = c.wait_ready(Duration::from_secs(5), || true).await.unwrap();
        let conn = conn.expect("the ready check's connection is kept");
        assert!(is_idle_open(&conn));
        // The connection the ready check probed the socket with carried its /health.
        let opened = conns.load(SeqCst);
        assert_eq!(opened, 1);
        assert_eq!(reqs.load(SeqCst), 1);
        let req = InitRequest {
            env_vars: BTreeMap::new(),
            access_token: "tok2".into(),
            default_user: "user".into(),
            default_workdir: None,
        };
        let conn = c
            .init_on(Some(conn), &req)
            .await
            .unwrap()
            .expect("kept again");
        assert_eq!(reqs.load(SeqCst), 2);
        assert_eq!(
            conns.load(SeqCst),
            opened,
            "/init went over the kept connection"
        );
        assert!(is_idle_open(&conn));
        drop(conn);
        // One whose other end is gone: /init connects anew.
        let (dead, peer) = std::os::unix::net::UnixStream::pair().unwrap();
        dead.set_nonblocking(true).unwrap();
        drop(peer);
        assert!(!is_idle_open(&dead));
        let conn = c.init_on(Some(dead), &req).await.unwrap();
        assert!(conn.is_some());
        assert_eq!(reqs.load(SeqCst), 3);
        assert_eq!(conns.load(SeqCst), opened + 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A fake envd on a Unix socket answering /health, /init and a Start stream.
    #[tokio::test]
    async fn talks_to_a_fake_envd() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = std::env::temp_dir().join(format!("cubicle-envdc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("envd.sock");
        let _ = std::fs::remove_file(&sock);
        let listener = tokio::net::UnixListener::bind(&sock).unwrap();
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    break;
                };
                tokio::spawn(async move {
                    let mut req = Vec::new();
                    let mut tmp = [0u8; 4096];
                    // read until headers end (+ body for POST; tiny bodies arrive with them)
                    loop {
                        let n = s.read(&mut tmp).await.unwrap_or(0);
                        if n == 0 {
                            break;
                        }
                        req.extend_from_slice(&tmp[..n]);
                        if req.windows(4).any(|w| w == b"\r\n\r\n") {
                            break;
                        }
                    }
                    let head = String::from_utf8_lossy(&req).to_string();
                    if head.starts_with("GET /health") || head.starts_with("POST /init") {
                        let _ = s.write_all(b"HTTP/1.1 204 No Content\r\n\r\n").await;
                    } else if head.starts_with("POST /process.Process/Start") {
                        assert!(
                            head.to_ascii_lowercase().contains("authorization: basic ")
                                && head.contains("cm9vdDo=")
                        );
                        let mut body = Vec::new();
                        for m in [
                            &br#"{"event":{"start":{"pid":42}}}"#[..],
                            br#"{"event":{"data":{"stdout":"aGkK"}}}"#,
                            br#"{"event":{"data":{"stderr":"ZXJy"}}}"#,
                            br#"{"event":{"end":{"exitCode":3,"exited":true,"status":"exit status 3"}}}"#,
                        ] {
                            body.extend_from_slice(&codec::envelope(0, m));
                        }
                        body.extend_from_slice(&codec::end_stream_envelope(Ok(())));
                        let head = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/connect+json\r\ncontent-length: {}\r\n\r\n",
                            body.len()
                        );
                        let _ = s.write_all(head.as_bytes()).await;
                        let _ = s.write_all(&body).await;
                    }
                    let _ = s.shutdown().await;
                });
            }
        });
        let c = EnvdClient::new(&sock, Some("tok".into()));
        c.wait_ready(Duration::from_secs(2), || true).await.unwrap();
        c.init(&InitRequest {
            env_vars: BTreeMap::new(),
            access_token: "tok".into(),
            default_user: "user".into(),
            default_workdir: Some("/home/user".into()),
        })
        .await
        .unwrap();
        let mut events = Vec::new();
        let end = c
            .run(
                &ProcessSpec {
                    cmd: "id".into(),
                    user: Some("root".into()),
                    ..Default::default()
                },
                |e| events.push(e),
            )
            .await
            .unwrap();
        assert_eq!(end.exit_code, 3);
        assert_eq!(
            events,
            vec![
                ProcessEvent::Start(42),
                ProcessEvent::Stdout(b"hi\n".to_vec()),
                ProcessEvent::Stderr(b"err".to_vec())
            ]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
