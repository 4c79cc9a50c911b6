//! `cubicle bench`: latency and density measures against a `cubicle serve`, printed as a
//! table or (`--json`) one JSON object per line per measure.
//!
//! The server is either one the bench starts itself (a child `cubicle serve` on its own
//! state directory, default `/var/lib/cubicle-bench`, listening on a free loopback port,
//! slots from 8000 (or the next free range); its `export …` lines and `cubicle: ready`
//! are read from its stdout)
//! or the one given by `--url`/`--api-key`. Everything the bench creates it kills again.
//!
//! Measures (all through the public REST API and the data-plane router, as an SDK does):
//! - `create`: `POST /v2/sandboxes` → 201 (the sandbox is ready when the answer comes);
//!   the kill afterwards is not timed.
//! - `cycle`: create + `Process.Start` of `true` through envd + `DELETE`, all timed.
//! - `exec`: `Process.Start` of `true` in one running sandbox (what `commands.run("true")`
//!   sends), on a kept-alive connection.
//! - `density`: N idle sandboxes; host memory per sandbox = Δ(MemTotal − MemAvailable)/N;
//!   envd's RSS/PSS per sandbox; p99 of `GET /health` round trips to all of them.
//! - `peer`: the same cycle done with `runc run` on the template's rootfs and with
//!   `bwrap --unshare-all`, next to Cubicle's c=1 cycle of the same run, with ratios.
//! - `interp`: the code interpreter (`code-interpreter-v1`): create + first `run_code`
//!   result, and `run_code("1+1")` through the router (see [`interp`]).

mod interp;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt;
use tokio::net::TcpStream;

/// Default state directory of the server the bench starts (templates built once).
pub const DEFAULT_BENCH_STATE_DIR: &str = "/var/lib/cubicle-bench";
/// Slots of the bench's own server (disjoint from other nodes on a shared host).
const BENCH_FIRST_SLOT: u32 = 8000;
const ENVD_PORT: u16 = 49983;
const ALL_MEASURES: &[&str] = &[
    "create", "cycle", "exec", "density", "peer", "interp", "egress",
];

/// `cubicle bench` options.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Measures to run: create, cycle, exec, density, peer, interp (default: create,
    /// cycle, exec, peer).
    #[arg(value_name = "MEASURE")]
    pub measures: Vec<String>,
    /// Use this server instead of starting one (with --api-key).
    #[arg(long, env = "CUBICLE_BENCH_URL")]
    pub url: Option<String>,
    /// API key for --url.
    #[arg(long, env = "CUBICLE_BENCH_API_KEY")]
    pub api_key: Option<String>,
    /// State directory of the server the bench starts.
    #[arg(long, default_value = DEFAULT_BENCH_STATE_DIR)]
    pub server_state_dir: PathBuf,
    /// Template for create/cycle/exec/density/peer.
    #[arg(long, default_value = "tiny")]
    pub template: String,
    /// Also run create and cycle on these templates (comma-separated), e.g. `base`.
    #[arg(long, value_delimiter = ',', default_value = "base")]
    pub also: Vec<String>,
    /// Iterations per latency measure and concurrency.
    #[arg(long, default_value_t = 200)]
    pub iterations: usize,
    /// Concurrencies of create and cycle (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,50")]
    pub concurrency: Vec<usize>,
    /// Sandboxes held by `density`.
    #[arg(long, default_value_t = 1000)]
    pub n: usize,
    /// Sandboxes without internet (no veth / NAT).
    #[arg(long)]
    pub no_internet: bool,
    /// E2B `network` options (JSON) for every sandbox the bench creates, e.g.
    /// `{"allowOut":["pypi.org"],"denyOut":["0.0.0.0/0"]}` (what a policy costs a create).
    #[arg(long, value_name = "JSON", value_parser = parse_network)]
    pub network: Option<Value>,
    /// Rootfs for `peer` (default: the template's in the server state directory).
    #[arg(long)]
    pub rootfs: Option<PathBuf>,
    /// Server configurations to measure create/cycle in: `off` (no warm pool) and/or `on`
    /// (`--pool <template>=--pool-size` for each template), one server start each.
    #[arg(long, value_delimiter = ',', default_value = "off,on")]
    pub pool_modes: Vec<String>,
    /// Warm-pool size per template in the `on` mode.
    #[arg(long, default_value_t = 64)]
    pub pool_size: usize,
    /// Pool mode `on`, c=1: also a create row with this pause between iterations.
    #[arg(long, default_value_t = 50)]
    pub pace_ms: u64,
    /// One JSON object per line per measure instead of a table.
    #[arg(long)]
    pub json: bool,
    /// `interp`: warm-pool size of code-interpreter-v1 in pool mode `on`.
    #[arg(long, default_value_t = 4)]
    pub interp_pool_size: usize,
    /// `interp`: pause between two creates of `interp-first` (a pool refills meanwhile).
    #[arg(long, default_value_t = 2000)]
    pub interp_pace_ms: u64,
}

/// One result line.
#[derive(Debug, Clone)]
struct Row {
    name: String,
    concurrency: usize,
    samples: Vec<Duration>,
    errors: usize,
    extra: serde_json::Map<String, Value>,
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// Nearest-rank percentile of sorted samples.
fn pct(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

impl Row {
    fn new(name: &str, concurrency: usize) -> Row {
        Row {
            name: name.into(),
            concurrency,
            samples: Vec::new(),
            errors: 0,
            extra: Default::default(),
        }
    }

    fn with(mut self, k: &str, v: impl Into<Value>) -> Row {
        self.extra.insert(k.into(), v.into());
        self
    }

    fn p50(&self) -> f64 {
        let mut s = self.samples.clone();
        s.sort();
        ms(pct(&s, 0.5))
    }

    fn to_json(&self) -> Value {
        let mut s = self.samples.clone();
        s.sort();
        let mut m = serde_json::Map::new();
        m.insert("name".into(), json!(self.name));
        m.insert("concurrency".into(), json!(self.concurrency));
        m.insert("n".into(), json!(s.len()));
        m.insert("p50_ms".into(), json!(ms(pct(&s, 0.50))));
        m.insert("p95_ms".into(), json!(ms(pct(&s, 0.95))));
        m.insert("p99_ms".into(), json!(ms(pct(&s, 0.99))));
        m.insert(
            "max_ms".into(),
            json!(ms(s.last().copied().unwrap_or_default())),
        );
        m.insert("errors".into(), json!(self.errors));
        for (k, v) in &self.extra {
            m.insert(k.clone(), v.clone());
        }
        Value::Object(m)
    }
}

fn print_header() {
    println!(
        "{:<8} {:<10} {:>4} {:>6} {:>9} {:>9} {:>9} {:>9} {:>6}  details",
        "MEASURE", "TEMPLATE", "C", "N", "P50 ms", "P95 ms", "P99 ms", "MAX ms", "ERR"
    );
}

fn print_row(r: &Row, as_json: bool) {
    if as_json {
        println!("{}", r.to_json());
        return;
    }
    let v = r.to_json();
    let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
    let details: Vec<String> = r
        .extra
        .iter()
        .filter(|(k, _)| k.as_str() != "template")
        .map(|(k, v)| match v {
            Value::String(s) => format!("{k}={s}"),
            other => format!("{k}={other}"),
        })
        .collect();
    println!(
        "{:<8} {:<10} {:>4} {:>6} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>6}  {}",
        r.name,
        r.extra
            .get("template")
            .and_then(Value::as_str)
            .unwrap_or("-"),
        r.concurrency,
        r.samples.len(),
        f("p50_ms"),
        f("p95_ms"),
        f("p99_ms"),
        f("max_ms"),
        r.errors,
        details.join(" ")
    );
}

// ---------------------------------------------------------------------------------------
// HTTP: one kept-alive HTTP/1.1 connection per worker (as an SDK's connection pool).

struct Conn {
    addr: String,
    sender: Option<http1::SendRequest<Full<Bytes>>>,
}

impl Conn {
    fn new(addr: &str) -> Conn {
        Conn {
            addr: addr.into(),
            sender: None,
        }
    }

    async fn open(&mut self) -> anyhow::Result<&mut http1::SendRequest<Full<Bytes>>> {
        let usable = matches!(&self.sender, Some(s) if !s.is_closed());
        if !usable {
            let tcp = TcpStream::connect(&self.addr)
                .await
                .with_context(|| format!("connecting to {}", self.addr))?;
            let _ = tcp.set_nodelay(true);
            let (sender, conn) = http1::handshake(TokioIo::new(tcp)).await?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            self.sender = Some(sender);
        }
        self.sender.as_mut().ok_or_else(|| anyhow!("no connection"))
    }

    /// Sends a request and reads the whole answer.
    async fn call(&mut self, req: Request<Full<Bytes>>) -> anyhow::Result<(u16, Bytes)> {
        let sender = self.open().await?;
        sender.ready().await?;
        let resp = match sender.send_request(req).await {
            Ok(r) => r,
            Err(e) => {
                self.sender = None;
                return Err(e.into());
            }
        };
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok((status, body))
    }
}

#[derive(Clone)]
struct Api {
    addr: String,
    key: String,
    /// `network` of every create.
    network: Option<Value>,
}

fn parse_network(s: &str) -> Result<Value, String> {
    match serde_json::from_str::<Value>(s) {
        Ok(v) if v.is_object() => Ok(v),
        _ => Err(format!("--network {s:?}: expected a JSON object")),
    }
}

#[derive(Clone)]
struct Sbx {
    id: String,
    token: Option<String>,
}

/// `host:port` of an `http://host:port[/]` URL.
fn authority(url: &str) -> anyhow::Result<String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow!("only http:// URLs are supported: {url}"))?;
    let a = rest.split('/').next().unwrap_or_default();
    if a.is_empty() {
        bail!("no host in {url}");
    }
    Ok(if a.contains(':') {
        a.to_string()
    } else {
        format!("{a}:80")
    })
}

impl Api {
    fn req(&self, method: Method, path: &str) -> hyper::http::request::Builder {
        Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.addr)
            .header("x-api-key", &self.key)
    }

    async fn create(&self, c: &mut Conn, template: &str, internet: bool) -> anyhow::Result<Sbx> {
        let mut body = json!({
            "templateID": template, "timeout": 600, "metadata": {"cubicle-bench": "1"},
            "envVars": {}, "allow_internet_access": internet,
        });
        if let Some(n) = &self.network {
            body["network"] = n.clone();
        }
        let req = self
            .req(Method::POST, "/v2/sandboxes")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))?;
        let (status, body) = c.call(req).await?;
        if status != 201 {
            bail!("create: {status} {}", String::from_utf8_lossy(&body));
        }
        let v: Value = serde_json::from_slice(&body)?;
        Ok(Sbx {
            id: v["sandboxID"]
                .as_str()
                .ok_or_else(|| anyhow!("create: no sandboxID"))?
                .to_string(),
            token: v["envdAccessToken"].as_str().map(str::to_string),
        })
    }

    async fn kill(&self, c: &mut Conn, id: &str) -> anyhow::Result<()> {
        let req = self
            .req(Method::DELETE, &format!("/sandboxes/{id}"))
            .body(Full::new(Bytes::new()))?;
        let (status, body) = c.call(req).await?;
        if status != 204 && status != 404 {
            bail!("kill {id}: {status} {}", String::from_utf8_lossy(&body));
        }
        Ok(())
    }

    /// The server's warm-pool counters (`GET /cubicle/pool`): (claims, misses), or
    /// `None` from a server without that route.
    async fn pool_counts(&self, c: &mut Conn) -> Option<(u64, u64)> {
        let v = self.pool_json(c).await?;
        Some((v["claims"].as_u64()?, v["misses"].as_u64()?))
    }

    /// `GET /cubicle/pool` as JSON, or `None` from a server without that route.
    async fn pool_json(&self, c: &mut Conn) -> Option<Value> {
        let sender = c.open().await.ok()?;
        sender.ready().await.ok()?;
        let req = self
            .req(Method::GET, "/cubicle/pool")
            .body(Full::new(Bytes::new()))
            .ok()?;
        let resp = sender.send_request(req).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body = resp.into_body().collect().await.ok()?.to_bytes();
        serde_json::from_slice(&body).ok()
    }

    async fn list_ids(&self, c: &mut Conn) -> anyhow::Result<Vec<String>> {
        let mut ids = Vec::new();
        let mut token: Option<String> = None;
        for _ in 0..1000 {
            let mut path = "/v2/sandboxes?limit=100&state=running".to_string();
            if let Some(t) = &token {
                path.push_str(&format!("&nextToken={t}"));
            }
            let sender = c.open().await?;
            sender.ready().await?;
            let resp = sender
                .send_request(self.req(Method::GET, &path).body(Full::new(Bytes::new()))?)
                .await?;
            token = resp
                .headers()
                .get("x-next-token")
                .and_then(|v| v.to_str().ok())
                .filter(|s| !s.is_empty())
                .map(str::to_string);
            let body = resp.into_body().collect().await?.to_bytes();
            let v: Value = serde_json::from_slice(&body)?;
            for s in v.as_array().into_iter().flatten() {
                if s["metadata"]["cubicle-bench"] == "1"
                    && let Some(id) = s["sandboxID"].as_str()
                {
                    ids.push(id.to_string());
                }
            }
            if token.is_none() {
                break;
            }
        }
        Ok(ids)
    }

    /// `Process.Start` of `cmd args…` through the router; Ok when it ended with code 0.
    async fn run(&self, c: &mut Conn, s: &Sbx, cmd: &str, args: &[&str]) -> anyhow::Result<()> {
        let msg = json!({"process": {"cmd": cmd, "args": args, "envs": {}}, "stdin": false});
        let payload = msg.to_string().into_bytes();
        let mut env = Vec::with_capacity(5 + payload.len());
        env.push(0u8);
        env.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        env.extend_from_slice(&payload);
        let mut b = Request::builder()
            .method(Method::POST)
            .uri("/process.Process/Start")
            .header("host", &self.addr)
            .header("content-type", "application/connect+json")
            .header("connect-protocol-version", "1")
            .header("e2b-sandbox-id", &s.id)
            .header("e2b-sandbox-port", ENVD_PORT.to_string())
            .header("connect-timeout-ms", "60000");
        if let Some(t) = &s.token {
            b = b.header("x-access-token", t);
        }
        let (status, body) = c.call(b.body(Full::new(Bytes::from(env)))?).await?;
        if status != 200 {
            bail!("Process.Start: {status} {}", String::from_utf8_lossy(&body));
        }
        let mut rest = &body[..];
        while rest.len() >= 5 {
            let flags = rest[0];
            let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
            let Some(msg) = rest.get(5..5 + len) else {
                bail!("Process.Start: truncated envelope");
            };
            rest = &rest[5 + len..];
            let v: Value = serde_json::from_slice(msg)?;
            if flags & 2 != 0 {
                if !v["error"].is_null() {
                    bail!("Process.Start: {}", v["error"]);
                }
                continue;
            }
            let end = &v["event"]["end"];
            if !end.is_null() {
                let code = end["exitCode"].as_i64().unwrap_or(0);
                if code != 0 || end["exited"] != json!(true) {
                    bail!("`{cmd}` ended: {end}");
                }
                return Ok(());
            }
        }
        bail!("Process.Start: stream ended without an end event")
    }

    async fn health(&self, c: &mut Conn, id: &str) -> anyhow::Result<()> {
        let req = Request::builder()
            .method(Method::GET)
            .uri("/health")
            .header("host", &self.addr)
            .header("e2b-sandbox-id", id)
            .header("e2b-sandbox-port", ENVD_PORT.to_string())
            .body(Full::new(Bytes::new()))?;
        let (status, _) = c.call(req).await?;
        if !(200..300).contains(&status) {
            bail!("/health of {id}: {status}");
        }
        Ok(())
    }
}

/// The command `commands.run("true")` amounts to in `template` (the SDK sends
/// `/bin/bash -l -c true`; busybox `tiny` has no bash, so `/bin/sh -c true` there).
fn true_cmd(template: &str) -> (&'static str, Vec<&'static str>) {
    if template == "tiny" {
        ("/bin/sh", vec!["-c", "true"])
    } else {
        ("/bin/bash", vec!["-l", "-c", "true"])
    }
}

// ---------------------------------------------------------------------------------------
// The server the bench starts.

struct Server {
    child: tokio::process::Child,
}

impl Server {
    async fn start(
        state_dir: &Path,
        envd: Option<&PathBuf>,
        templates: &[String],
        pool: Option<usize>,
        interp_pool: Option<usize>,
    ) -> anyhow::Result<(Server, String, String)> {
        let exe = std::env::current_exe().context("finding the cubicle binary")?;
        let mut cmd = tokio::process::Command::new(exe);
        cmd.arg("--state-dir").arg(state_dir);
        if let Some(e) = envd {
            cmd.arg("--envd-binary").arg(e);
        }
        // A shared machine: CUBICLE_BENCH_FIRST_SLOT keeps two benches' uid ranges apart.
        let first_slot = std::env::var("CUBICLE_BENCH_FIRST_SLOT")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(BENCH_FIRST_SLOT);
        cmd.args(["--first-slot", &first_slot.to_string(), "--any-free-slots"])
            .args(["serve", "--listen", "127.0.0.1:0"])
            .arg("--max-timeout")
            .arg("3600");
        // Build only what the bench uses (base takes a minute the first time).
        if !templates.iter().any(|t| t == "base") {
            cmd.arg("--no-build-templates");
        }
        let mut spec: Vec<String> = match pool {
            Some(n) => templates.iter().map(|t| format!("{t}={n}")).collect(),
            None => Vec::new(),
        };
        if let Some(n) = interp_pool {
            spec.push(format!("{}={n}", interp::TEMPLATE));
        }
        if !spec.is_empty() {
            cmd.arg("--pool").arg(spec.join(","));
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = cmd.spawn().context("starting `cubicle serve`")?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let (mut url, mut key) = (None, None);
        let wait = async {
            while let Some(line) = lines.next_line().await? {
                if let Some(v) = line.strip_prefix("export E2B_API_URL=") {
                    url = Some(v.to_string());
                } else if let Some(v) = line.strip_prefix("export E2B_API_KEY=") {
                    key = Some(v.to_string());
                } else if line.trim() == "cubicle: ready" {
                    return Ok(());
                }
            }
            bail!("`cubicle serve` exited before it was ready")
        };
        tokio::time::timeout(Duration::from_secs(900), wait)
            .await
            .map_err(|_| anyhow!("`cubicle serve` not ready after 900 s"))??;
        // Keep draining stdout so the server never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let url = url.ok_or_else(|| anyhow!("no E2B_API_URL line"))?;
        let key = key.ok_or_else(|| anyhow!("no E2B_API_KEY line"))?;
        Ok((Server { child }, url, key))
    }

    async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            // SAFETY: plain kill(2) of our own child's pid.
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        }
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

// ---------------------------------------------------------------------------------------
// Measures.

#[derive(Clone)]
struct Ctx {
    api: Api,
    pool: String,
    /// Ready sandboxes per template the pool-on server is configured for.
    pool_size: usize,
    internet: bool,
    iterations: usize,
}

/// Before a row: with the pool on, waits (up to a minute) until `template`'s pool is
/// full again, so every row starts from the same warm state whatever the previous row
/// drained; then the pool counters, to compare with those after the row.
async fn before_row(cx: &Ctx, c: &mut Conn, template: &str) -> Option<(u64, u64)> {
    if cx.pool == "on" {
        let t = Instant::now();
        loop {
            let ready = cx
                .api
                .pool_json(c)
                .await
                .and_then(|v| v["ready"][template].as_u64());
            if ready.is_none_or(|r| r >= cx.pool_size as u64) {
                break;
            }
            if t.elapsed() > Duration::from_secs(60) {
                eprintln!(
                    "cubicle bench: the {template} pool is still at {ready:?} of {} after 60 s",
                    cx.pool_size
                );
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    cx.api.pool_counts(c).await
}

/// Runs `total` iterations of `op` over `conc` workers; each worker has its own API
/// connection. `op` returns the timed duration (it may exclude untimed cleanup).
async fn drive<F, Fut>(
    api: &Api,
    conc: usize,
    total: usize,
    op: F,
) -> (Vec<Duration>, usize, Vec<String>)
where
    F: Fn(Api, Conn) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = (Conn, anyhow::Result<Duration>)> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..conc.max(1) {
        let (api, next, op) = (api.clone(), next.clone(), op.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = Conn::new(&api.addr);
            let (mut ok, mut errs) = (Vec::new(), Vec::new());
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let (c, r) = op(api.clone(), conn).await;
                conn = c;
                match r {
                    Ok(d) => ok.push(d),
                    Err(e) => errs.push(format!("{e:#}")),
                }
            }
            (ok, errs)
        }));
    }
    let (mut samples, mut errors) = (Vec::new(), Vec::new());
    for t in tasks {
        if let Ok((ok, errs)) = t.await {
            samples.extend(ok);
            errors.extend(errs);
        }
    }
    let n = errors.len();
    (samples, n, errors)
}

fn note_errors(errors: &[String]) {
    if let Some(first) = errors.first() {
        eprintln!("cubicle bench: {} error(s), first: {first}", errors.len());
    }
}

async fn measure_create(cx: &Ctx, template: &str, conc: usize, pace: Duration) -> Row {
    let internet = cx.internet;
    let mut row = Row::new("create", conc);
    if conc <= 1 {
        let t = template.to_string();
        let (samples, errors, msgs) = drive(&cx.api, 1, cx.iterations, move |api, mut c| {
            let t = t.clone();
            async move {
                let t0 = Instant::now();
                let r = api.create(&mut c, &t, internet).await;
                let d = t0.elapsed();
                let r = match r {
                    Ok(s) => api.kill(&mut c, &s.id).await.map(|_| d),
                    Err(e) => Err(e),
                };
                // Untimed think time (an agent works between creates; a pool refills).
                tokio::time::sleep(pace).await;
                (c, r)
            }
        })
        .await;
        note_errors(&msgs);
        row.samples = samples;
        row.errors = errors;
        if !pace.is_zero() {
            row = row.with("pace_ms", pace.as_millis() as u64);
        }
    } else {
        // Bursts: `conc` creates at once (timed), then all killed (untimed), then a pause
        // for teardowns (and pool refills) to settle before the next burst.
        let rounds = cx.iterations.div_ceil(conc);
        for _ in 0..rounds {
            let mut tasks = Vec::new();
            for _ in 0..conc {
                let (api, t) = (cx.api.clone(), template.to_string());
                tasks.push(tokio::spawn(async move {
                    let mut c = Conn::new(&api.addr);
                    let t0 = Instant::now();
                    let r = api.create(&mut c, &t, internet).await;
                    (t0.elapsed(), r)
                }));
            }
            let mut made = Vec::new();
            for t in tasks {
                match t.await {
                    Ok((d, Ok(s))) => {
                        row.samples.push(d);
                        made.push(s);
                    }
                    Ok((_, Err(e))) => {
                        if row.errors == 0 {
                            eprintln!("cubicle bench: {e:#}");
                        }
                        row.errors += 1;
                    }
                    Err(_) => row.errors += 1,
                }
            }
            let mut c = Conn::new(&cx.api.addr);
            for s in made {
                let _ = cx.api.kill(&mut c, &s.id).await;
            }
            tokio::time::sleep(Duration::from_millis(conc as u64 * 100)).await;
        }
    }
    row.with("template", template)
        .with("pool", cx.pool.as_str())
        .with("internet", internet)
}

async fn measure_cycle(cx: &Ctx, template: &str, conc: usize, total: usize, pace: Duration) -> Row {
    let (t, internet) = (template.to_string(), cx.internet);
    // Each successful cycle's three phases, for the breakdown columns.
    let phases = Arc::new(std::sync::Mutex::new([Vec::new(), Vec::new(), Vec::new()]));
    let ph = phases.clone();
    let (samples, errors, msgs) = drive(&cx.api, conc, total, move |api, mut c| {
        let (t, ph) = (t.clone(), ph.clone());
        async move {
            let (cmd, args) = true_cmd(&t);
            let t0 = Instant::now();
            let r = async {
                let s = api.create(&mut c, &t, internet).await?;
                let t1 = Instant::now();
                let ran = api.run(&mut c, &s, cmd, &args).await;
                let t2 = Instant::now();
                let killed = api.kill(&mut c, &s.id).await;
                let t3 = Instant::now();
                ran?;
                killed?;
                if let Ok(mut p) = ph.lock() {
                    p[0].push(t1 - t0);
                    p[1].push(t2 - t1);
                    p[2].push(t3 - t2);
                }
                Ok(t0.elapsed())
            }
            .await;
            tokio::time::sleep(pace).await;
            (c, r)
        }
    })
    .await;
    note_errors(&msgs);
    let mut row = Row {
        samples,
        errors,
        ..Row::new("cycle", conc)
    };
    if !pace.is_zero() {
        row = row.with("pace_ms", pace.as_millis() as u64);
    }
    let mut phases = phases.lock().map(|p| p.clone()).unwrap_or_default();
    for (name, v) in ["create", "run", "kill"].iter().zip(phases.iter_mut()) {
        v.sort();
        row = row.with(&format!("{name}_p50_ms"), ms(pct(v, 0.5)));
    }
    row.with("template", template)
        .with("pool", cx.pool.as_str())
        .with("internet", internet)
}

async fn measure_exec(cx: &Ctx, template: &str, conc: usize) -> anyhow::Result<Row> {
    let mut c = Conn::new(&cx.api.addr);
    let s = cx.api.create(&mut c, template, cx.internet).await?;
    let (cmd, args) = true_cmd(template);
    let shown = format!("{cmd} {}", args.join(" "));
    let sb = s.clone();
    let (samples, errors, msgs) = drive(&cx.api, conc, cx.iterations, move |api, mut c| {
        let (sb, args) = (sb.clone(), args.clone());
        async move {
            let t0 = Instant::now();
            let r = api.run(&mut c, &sb, cmd, &args).await.map(|_| t0.elapsed());
            (c, r)
        }
    })
    .await;
    note_errors(&msgs);
    cx.api.kill(&mut c, &s.id).await?;
    Ok(Row {
        samples,
        errors,
        ..Row::new("exec", conc)
    }
    .with("template", template)
    .with("cmd", shown))
}

/// Kernel-side /proc/meminfo fields (KiB) whose growth explains a sandbox's cost.
const KERNEL_FIELDS: &[&str] = &["Slab:", "Percpu:", "KernelStack:", "PageTables:", "Shmem:"];

fn meminfo_fields() -> BTreeMap<String, u64> {
    let s = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    s.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            let v = v.split_whitespace().next()?.parse().ok()?;
            Some((format!("{k}:"), v))
        })
        .filter(|(k, _)| KERNEL_FIELDS.contains(&k.as_str()))
        .collect()
}

/// Bytes held by each slab cache (`/proc/slabinfo`: objects × object size).
fn slab_bytes() -> BTreeMap<String, u64> {
    let s = std::fs::read_to_string("/proc/slabinfo").unwrap_or_default();
    s.lines()
        .skip(2)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let objs: u64 = f.get(2)?.parse().ok()?;
            let size: u64 = f.get(3)?.parse().ok()?;
            Some((f[0].to_string(), objs * size))
        })
        .collect()
}

/// The `top` slab caches by growth from `before` to `after`, KiB per sandbox.
fn slab_growth(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
    held: usize,
    top: usize,
) -> Value {
    let mut d: Vec<(String, u64)> = after
        .iter()
        .map(|(k, a)| {
            (
                k.clone(),
                a.saturating_sub(before.get(k).copied().unwrap_or(0)),
            )
        })
        .filter(|(_, d)| *d > 0)
        .collect();
    d.sort_by_key(|e| std::cmp::Reverse(e.1));
    let held = held.max(1) as f64;
    Value::Object(
        d.into_iter()
            .take(top)
            .map(|(k, v)| (k, json!((v as f64 / held / 1024.0 * 10.0).round() / 10.0)))
            .collect(),
    )
}

/// `MemTotal - MemAvailable` in KiB.
fn used_kib() -> anyhow::Result<u64> {
    let s = std::fs::read_to_string("/proc/meminfo")?;
    let field = |name: &str| -> anyhow::Result<u64> {
        s.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| anyhow!("/proc/meminfo has no {name}"))
    };
    Ok(field("MemTotal:")? - field("MemAvailable:")?)
}

/// Sum of RSS and PSS (KiB) and count of the processes whose cgroup path names one of
/// `ids` (the envd init parent and server of each sandbox, plus anything else in it).
fn sandbox_process_memory(ids: &std::collections::HashSet<String>) -> (u64, u64, usize) {
    let (mut rss, mut pss, mut n) = (0, 0, 0);
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return (0, 0, 0);
    };
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(cg) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
            continue;
        };
        let in_ours = cg.lines().any(|l| {
            l.rsplit('/').next().is_some_and(|last| ids.contains(last))
                || l.split('/').any(|seg| ids.contains(seg))
        });
        if !in_ours {
            continue;
        }
        let Ok(sm) = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")) else {
            continue;
        };
        let kib = |k: &str| {
            sm.lines()
                .find_map(|l| l.strip_prefix(k))
                .and_then(|r| r.split_whitespace().next())
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        rss += kib("Rss:");
        pss += kib("Pss:");
        n += 1;
    }
    (rss, pss, n)
}

async fn measure_density(cx: &Ctx, template: &str, n: usize) -> anyhow::Result<Vec<Row>> {
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = used_kib()?;
    let kernel_before = meminfo_fields();
    let slab_before = slab_bytes();
    let t0 = Instant::now();
    let made = Arc::new(tokio::sync::Mutex::new(Vec::<Sbx>::new()));
    let m2 = made.clone();
    let (t, internet) = (template.to_string(), cx.internet);
    let (create_samples, create_errors, msgs) = drive(&cx.api, 8, n, move |api, mut c| {
        let (t, made) = (t.clone(), m2.clone());
        async move {
            let t0 = Instant::now();
            let r = match api.create(&mut c, &t, internet).await {
                Ok(s) => {
                    made.lock().await.push(s);
                    Ok(t0.elapsed())
                }
                Err(e) => Err(e),
            };
            (c, r)
        }
    })
    .await;
    note_errors(&msgs);
    let fill = t0.elapsed();
    let sandboxes = made.lock().await.clone();
    let held = sandboxes.len();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = used_kib()?;
    let kernel_after = meminfo_fields();
    let slab_after = slab_bytes();
    let ids: std::collections::HashSet<String> = sandboxes.iter().map(|s| s.id.clone()).collect();
    let (rss, pss, procs) = sandbox_process_memory(&ids);

    // /health round trips to every sandbox, twice around, one kept-alive connection.
    let mut health = Vec::new();
    let mut health_errors = 0;
    let mut c = Conn::new(&cx.api.addr);
    for _ in 0..2 {
        for s in &sandboxes {
            let t = Instant::now();
            match cx.api.health(&mut c, &s.id).await {
                Ok(()) => health.push(t.elapsed()),
                Err(e) => {
                    if health_errors == 0 {
                        eprintln!("cubicle bench: {e:#}");
                    }
                    health_errors += 1;
                }
            }
        }
    }

    // Kill them all again.
    let list = Arc::new(tokio::sync::Mutex::new(sandboxes));
    let l2 = list.clone();
    let (kill_samples, kill_errors, msgs) = drive(&cx.api, 8, held, move |api, mut c| {
        let list = l2.clone();
        async move {
            let s = list.lock().await.pop();
            let t0 = Instant::now();
            let r = match s {
                Some(s) => api.kill(&mut c, &s.id).await.map(|_| t0.elapsed()),
                None => Ok(Duration::ZERO),
            };
            (c, r)
        }
    })
    .await;
    note_errors(&msgs);

    let per = |kib: u64| {
        if held == 0 {
            0.0
        } else {
            (kib as f64 / held as f64 / 1024.0 * 1000.0).round() / 1000.0
        }
    };
    let delta = after.saturating_sub(before);
    let mem = Row {
        samples: health,
        errors: health_errors + create_errors,
        ..Row::new("density", 1)
    }
    .with("template", template)
    .with("asked", n)
    .with("held", held)
    .with("mib_per_sandbox", per(delta))
    .with("host_delta_mib", (delta as f64 / 1024.0).round())
    .with(
        "procs_per_sandbox",
        if held > 0 {
            procs as f64 / held as f64
        } else {
            0.0
        },
    )
    .with("rss_mib_per_sandbox", per(rss))
    .with("pss_mib_per_sandbox", per(pss))
    .with(
        "kernel_kib_per_sandbox",
        Value::Object(
            kernel_after
                .iter()
                .map(|(k, a)| {
                    let d = a.saturating_sub(kernel_before.get(k).copied().unwrap_or(0));
                    let per = if held > 0 { d / held as u64 } else { 0 };
                    (k.trim_end_matches(':').to_string(), json!(per))
                })
                .collect(),
        ),
    )
    .with(
        "slab_kib_per_sandbox",
        slab_growth(&slab_before, &slab_after, held, 10),
    )
    .with("fill_s", (fill.as_secs_f64() * 10.0).round() / 10.0)
    .with("latency_of", "GET /health");
    let creates = Row {
        samples: create_samples,
        errors: create_errors,
        ..Row::new("dens-new", 8)
    }
    .with("template", template)
    .with("latency_of", "create while filling");
    let kills = Row {
        samples: kill_samples,
        errors: kill_errors,
        ..Row::new("dens-kill", 8)
    }
    .with("template", template)
    .with("latency_of", "DELETE");
    Ok(vec![mem, creates, kills])
}

/// The servers the bench started left their quota filesystem mounted at `dir` (a node
/// keeps it across restarts): unmount it, so that a bench run leaves no mount behind.
fn release_quota_mount(dir: &Path) {
    let mounted = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(&*dir.to_string_lossy()));
    if mounted && let Err(e) = cubicle_runtime::storage::unmount_path(dir) {
        eprintln!("cubicle bench: {e}");
    }
}

/// `runc run` and `bwrap` cycles of `true` on `rootfs`.
async fn measure_peer(rootfs: &Path, n: usize) -> anyhow::Result<Vec<Row>> {
    let rootfs = rootfs
        .canonicalize()
        .with_context(|| format!("rootfs {}", rootfs.display()))?;
    let bundle = std::env::temp_dir().join(format!("cb-bench-runc-{}", std::process::id()));
    std::fs::create_dir_all(&bundle)?;
    let spec = match runc_spec(&bundle, &rootfs) {
        Ok(s) => s,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&bundle);
            return Err(e);
        }
    };
    std::fs::write(
        bundle.join("config.json"),
        serde_json::to_vec_pretty(&spec)?,
    )?;
    let mut rows = Vec::new();

    let pid = std::process::id();
    let mut i = 0usize;
    let runc = time_peer("runc run", "runc", n, || {
        let id = format!("cb-bench-{pid}-{i}");
        i += 1;
        let mut cmd = tokio::process::Command::new("runc");
        cmd.args(["run", "--bundle"]).arg(&bundle).arg(&id);
        let cleanup = move || {
            let _ = std::process::Command::new("runc")
                .args(["delete", "--force", &id])
                .output();
        };
        (cmd, Some(Box::new(cleanup) as Box<dyn FnOnce()>))
    })
    .await;
    let _ = std::fs::remove_dir_all(&bundle);
    rows.push(runc);

    let bwrap = time_peer("bwrap --unshare-all", "bwrap", n, || {
        let mut cmd = tokio::process::Command::new("bwrap");
        cmd.arg("--unshare-all")
            .arg("--ro-bind")
            .arg(&rootfs)
            .args(["/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"])
            .args(["/bin/sh", "-c", "true"]);
        (cmd, None)
    })
    .await;
    rows.push(bwrap);
    Ok(rows)
}

/// Times `n` runs of a peer runtime's command. `next` gives each run's command and what
/// to do after it fails (if anything); the first failure's stderr is printed; a command
/// that cannot be started ends the series.
async fn time_peer(
    runtime: &str,
    program: &str,
    n: usize,
    mut next: impl FnMut() -> (tokio::process::Command, Option<Box<dyn FnOnce()>>),
) -> Row {
    let mut row = Row::new("peer", 1).with("runtime", runtime);
    for _ in 0..n {
        let (mut cmd, on_failure) = next();
        let t0 = Instant::now();
        let st = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .await;
        match st {
            Ok(o) if o.status.success() => row.samples.push(t0.elapsed()),
            Ok(o) => {
                if row.errors == 0 {
                    eprintln!(
                        "cubicle bench: {program}: {}",
                        String::from_utf8_lossy(&o.stderr).trim()
                    );
                }
                row.errors += 1;
                if let Some(f) = on_failure {
                    f();
                }
            }
            Err(e) => {
                row.errors += 1;
                eprintln!("cubicle bench: {program}: {e}");
                break;
            }
        }
    }
    row
}

/// runc's own default OCI spec (`runc spec`: the mounts, masked paths, capabilities and
/// namespaces runc gives any container) with only what the measure needs changed:
/// `/bin/sh -c true`, no terminal, the template's rootfs read-only as root.
fn runc_spec(bundle: &Path, rootfs: &Path) -> anyhow::Result<Value> {
    let out = std::process::Command::new("runc")
        .arg("spec")
        .arg("--bundle")
        .arg(bundle)
        .output()
        .context("running `runc spec`")?;
    if !out.status.success() {
        bail!("runc spec: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let path = bundle.join("config.json");
    let mut spec: Value = serde_json::from_slice(&std::fs::read(&path)?)
        .with_context(|| format!("parsing {}", path.display()))?;
    spec["process"]["terminal"] = json!(false);
    spec["process"]["args"] = json!(["/bin/sh", "-c", "true"]);
    spec["root"] = json!({"path": rootfs, "readonly": true});
    Ok(spec)
}

// ---------------------------------------------------------------------------------------

pub async fn run(args: BenchArgs, envd: Option<&PathBuf>) -> anyhow::Result<i32> {
    if args.measures.iter().any(|m| m == "egress") {
        egress(&args)?;
        if args.measures.len() == 1 {
            return Ok(0);
        }
    }
    let measures: Vec<String> = if args.measures.is_empty() {
        ["create", "cycle", "exec", "peer"]
            .map(String::from)
            .to_vec()
    } else {
        args.measures.clone()
    };
    let measures: Vec<String> = measures.into_iter().filter(|m| m != "egress").collect();
    for m in &measures {
        if !ALL_MEASURES.contains(&m.as_str()) {
            bail!("unknown measure {m:?} (known: {})", ALL_MEASURES.join(", "));
        }
    }
    let has = |m: &str| measures.iter().any(|x| x == m);
    let mut templates = vec![args.template.clone()];
    if has("create") || has("cycle") {
        for t in &args.also {
            if !t.is_empty() && !templates.contains(t) {
                templates.push(t.clone());
            }
        }
    }
    let modes: Vec<String> = if args.url.is_some() {
        vec!["server".into()]
    } else {
        let mut m: Vec<String> = args
            .pool_modes
            .iter()
            .filter(|m| *m == "off" || *m == "on")
            .cloned()
            .collect();
        if m.is_empty() {
            bail!("--pool-modes takes off and/or on");
        }
        // Only create/cycle/interp differ between modes.
        if !(has("create") || has("cycle") || has("interp")) {
            m.truncate(1);
        }
        m
    };
    if !args.json {
        print_header();
    }
    let mut cycle_c1: BTreeMap<String, f64> = BTreeMap::new();
    for (k, mode) in modes.iter().enumerate() {
        let (server, url, key) = match &args.url {
            Some(u) => {
                let key = args
                    .api_key
                    .clone()
                    .or_else(|| std::env::var("E2B_API_KEY").ok())
                    .ok_or_else(|| anyhow!("--url needs --api-key (or E2B_API_KEY)"))?;
                (None, u.clone(), key)
            }
            None => {
                let pool = (mode == "on").then_some(args.pool_size);
                eprintln!(
                    "cubicle bench: starting `cubicle serve` on {} (warm pool {mode})",
                    args.server_state_dir.display()
                );
                let interp_pool = pool
                    .filter(|_| has("interp"))
                    .map(|_| args.interp_pool_size);
                let (s, u, k) =
                    Server::start(&args.server_state_dir, envd, &templates, pool, interp_pool)
                        .await?;
                if let Some(n) = pool {
                    // Let the pool fill (about 20-40 ms per sandbox on 2 cores).
                    let wait = Duration::from_millis((n * templates.len()) as u64 * 60 + 1000);
                    tokio::time::sleep(wait).await;
                }
                (Some(s), u, k)
            }
        };
        let cx = Ctx {
            api: Api {
                addr: authority(&url)?,
                key,
                network: args.network.clone(),
            },
            pool: mode.clone(),
            pool_size: args.pool_size,
            internet: !args.no_internet,
            iterations: args.iterations.max(1),
        };
        eprintln!(
            "cubicle bench: server {url}, {} iterations per measure, internet {}; a 2-core shared machine is noisy",
            cx.iterations,
            if cx.internet { "on" } else { "off" }
        );
        let result = run_measures(&cx, &args, &measures, &templates, k == 0, &mut cycle_c1).await;

        // Whatever happened: kill what the bench left (it tags its sandboxes).
        let mut c = Conn::new(&cx.api.addr);
        if let Ok(ids) = cx.api.list_ids(&mut c).await {
            for id in ids {
                let _ = cx.api.kill(&mut c, &id).await;
            }
        }
        if let Some(s) = server {
            s.stop().await;
        }
        result?;
    }
    if args.url.is_none() {
        release_quota_mount(&args.server_state_dir.join("sandboxes"));
    }
    if has("peer") {
        let rootfs = match &args.rootfs {
            Some(p) => p.clone(),
            None if args.url.is_none() => args
                .server_state_dir
                .join("templates")
                .join(&args.template)
                .join("rootfs"),
            None => bail!("peer with --url needs --rootfs (the template's rootfs)"),
        };
        // Against Cubicle's c=1 closed-loop cycle (fastest pool mode) of this run, and
        // against the warm one (pool on, paced: the pool keeps up) when measured.
        let cub = cycle_c1
            .iter()
            .filter(|(k, _)| k.as_str() != "warm")
            .map(|(_, v)| *v)
            .fold(f64::INFINITY, f64::min);
        let cub = if cub.is_finite() { cub } else { 0.0 };
        let warm = cycle_c1.get("warm").copied();
        for r in measure_peer(&rootfs, args.iterations.max(1)).await? {
            let p50 = r.p50();
            let ratio = |c: f64| {
                if c > 0.0 {
                    (p50 / c * 100.0).round() / 100.0
                } else {
                    0.0
                }
            };
            let mut r = r
                .with("template", args.template.as_str())
                .with("cubicle_cycle_p50_ms", cub)
                .with("peer_over_cubicle", ratio(cub));
            if let Some(w) = warm {
                r = r
                    .with("cubicle_warm_cycle_p50_ms", w)
                    .with("peer_over_cubicle_warm", ratio(w));
            }
            print_row(&r, args.json);
        }
    }
    Ok(0)
}

async fn run_measures(
    cx: &Ctx,
    args: &BenchArgs,
    measures: &[String],
    templates: &[String],
    first_mode: bool,
    cycle_c1: &mut BTreeMap<String, f64>,
) -> anyhow::Result<()> {
    let emit = |r: &Row| print_row(r, args.json);
    // With a pool: how many of a row's creates were claims and how many missed (cold).
    let pool_counted =
        |r: Row, before: Option<(u64, u64)>, after: Option<(u64, u64)>| match (before, after) {
            (Some(b), Some(a)) if cx.pool != "off" => r
                .with("pool_claims", a.0.saturating_sub(b.0))
                .with("pool_misses", a.1.saturating_sub(b.1)),
            _ => r,
        };
    let mut pc = Conn::new(&cx.api.addr);
    // Warm-up: first creates pay for page cache and lazy setup.
    {
        let mut c = Conn::new(&cx.api.addr);
        for t in templates {
            for _ in 0..3 {
                let s = cx.api.create(&mut c, t, cx.internet).await?;
                cx.api.kill(&mut c, &s.id).await?;
            }
        }
    }
    let has = |m: &str| measures.iter().any(|x| x == m);
    if has("create") {
        for t in templates {
            for &conc in &args.concurrency {
                let b = before_row(cx, &mut pc, t).await;
                let r = measure_create(cx, t, conc, Duration::ZERO).await;
                emit(&pool_counted(r, b, cx.api.pool_counts(&mut pc).await));
                if conc == 1 && cx.pool == "on" && args.pace_ms > 0 {
                    // The closed loop above outruns the refill; this is the warm case.
                    let pace = Duration::from_millis(args.pace_ms);
                    let b = before_row(cx, &mut pc, t).await;
                    let r = measure_create(cx, t, conc, pace).await;
                    emit(&pool_counted(r, b, cx.api.pool_counts(&mut pc).await));
                }
            }
        }
    }
    if has("cycle") || (has("peer") && first_mode) {
        let ts: &[String] = if has("cycle") {
            templates
        } else {
            &templates[..1]
        };
        let concs: Vec<usize> = if has("cycle") {
            args.concurrency.clone()
        } else {
            vec![1]
        };
        for t in ts {
            for &conc in &concs {
                let b = before_row(cx, &mut pc, t).await;
                let r = measure_cycle(cx, t, conc, cx.iterations, Duration::ZERO).await;
                let r = pool_counted(r, b, cx.api.pool_counts(&mut pc).await);
                if conc == 1 && *t == args.template {
                    cycle_c1.insert(cx.pool.clone(), r.p50());
                }
                emit(&r);
                if conc == 1 && cx.pool == "on" && args.pace_ms > 0 {
                    let pace = Duration::from_millis(args.pace_ms);
                    let b = before_row(cx, &mut pc, t).await;
                    let r = measure_cycle(cx, t, conc, cx.iterations, pace).await;
                    let r = pool_counted(r, b, cx.api.pool_counts(&mut pc).await);
                    if *t == args.template {
                        cycle_c1.insert("warm".into(), r.p50());
                    }
                    emit(&r);
                }
            }
        }
    }
    if has("exec") && first_mode {
        emit(&measure_exec(cx, &args.template, 1).await?);
    }
    if has("density") && first_mode {
        for r in measure_density(cx, &args.template, args.n).await? {
            emit(&r);
        }
    }
    if has("interp") {
        let pace = Duration::from_millis(args.interp_pace_ms);
        let pool_size = if cx.pool == "on" {
            args.interp_pool_size
        } else {
            cx.pool_size
        };
        let icx = Ctx {
            pool_size,
            ..cx.clone()
        };
        let b = before_row(&icx, &mut pc, interp::TEMPLATE).await;
        let r = interp::measure_first(&icx, pace).await;
        emit(&pool_counted(r, b, cx.api.pool_counts(&mut pc).await));
        if first_mode {
            emit(&interp::measure_run(cx).await?);
        }
    }
    Ok(())
}

/// `cubicle bench egress`: the egress layer in a private lab of network namespaces (no
/// server; see `cubicle_egress::lab`): one connection's throughput through the proxy and
/// direct, new connections with an HTTP request each way, policy application.
fn egress(args: &BenchArgs) -> anyhow::Result<()> {
    let bytes: u64 = 1 << 30;
    let r = cubicle_egress::lab::bench(bytes, args.iterations.max(20))?;
    let rows = [
        (
            "egress proxy, 1 connection (Gbit/s)",
            format!("{:.2}", r.proxied_gbit_s),
        ),
        (
            "direct, 1 connection (Gbit/s)",
            format!("{:.2}", r.direct_gbit_s),
        ),
        (
            "new connection + request via proxy p50/p99 (µs)",
            format!("{} / {}", r.proxied_request_us.0, r.proxied_request_us.1),
        ),
        (
            "new connection + request direct p50/p99 (µs)",
            format!("{} / {}", r.direct_request_us.0, r.direct_request_us.1),
        ),
        (
            "added per new connection p50 (µs)",
            format!(
                "{}",
                r.proxied_request_us.0 as i64 - r.direct_request_us.0 as i64
            ),
        ),
        (
            "apply a policy to a new sandbox p50/p99 (µs)",
            format!("{} / {}", r.apply_policy_us.0, r.apply_policy_us.1),
        ),
        (
            "replace a running sandbox's policy p50/p99 (µs)",
            format!("{} / {}", r.update_policy_us.0, r.update_policy_us.1),
        ),
        (
            "remove a policy (sandbox death) p50/p99 (µs)",
            format!("{} / {}", r.clear_policy_us.0, r.clear_policy_us.1),
        ),
    ];
    if args.json {
        println!(
            "{}",
            json!({
                "measure": "egress", "bytes": r.bytes,
                "proxiedGbitS": r.proxied_gbit_s, "directGbitS": r.direct_gbit_s,
                "proxiedRequestUs": [r.proxied_request_us.0, r.proxied_request_us.1],
                "directRequestUs": [r.direct_request_us.0, r.direct_request_us.1],
                "applyPolicyUs": [r.apply_policy_us.0, r.apply_policy_us.1],
                "updatePolicyUs": [r.update_policy_us.0, r.update_policy_us.1],
                "clearPolicyUs": [r.clear_policy_us.0, r.clear_policy_us.1],
            })
        );
    } else {
        println!(
            "egress (private lab, {} MiB streamed, {} requests each way)",
            r.bytes >> 20,
            args.iterations.max(20)
        );
        for (k, v) in rows {
            println!("  {k:<52} {v}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let s: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(pct(&s, 0.5), Duration::from_millis(50));
        assert_eq!(pct(&s, 0.99), Duration::from_millis(99));
        assert_eq!(pct(&s, 1.0), Duration::from_millis(100));
        assert_eq!(pct(&[], 0.5), Duration::ZERO);
    }

    #[test]
    fn json_row_has_the_required_fields() {
        let mut r = Row::new("create", 50).with("pool", "off");
        r.samples = vec![Duration::from_millis(3), Duration::from_millis(5)];
        r.errors = 1;
        let v = r.to_json();
        for k in [
            "name",
            "concurrency",
            "n",
            "p50_ms",
            "p95_ms",
            "p99_ms",
            "max_ms",
            "errors",
            "pool",
        ] {
            assert!(v.get(k).is_some(), "missing {k}");
        }
        assert_eq!(v["n"], 2);
        assert_eq!(v["p50_ms"], 3.0);
        assert_eq!(v["max_ms"], 5.0);
    }

    #[test]
    fn authority_of_urls() {
        assert_eq!(
            authority("http://127.0.0.1:3000").unwrap(),
            "127.0.0.1:3000"
        );
        assert_eq!(authority("http://h/x").unwrap(), "h:80");
        assert!(authority("https://h").is_err());
    }

    #[test]
    fn runc_spec_is_runc_default_read_only_on_the_rootfs() {
        let bundle = std::env::temp_dir().join(format!("cb-runc-spec-test-{}", std::process::id()));
        std::fs::create_dir_all(&bundle).unwrap();
        let v = runc_spec(&bundle, Path::new("/r"));
        std::fs::remove_dir_all(&bundle).unwrap();
        let v = v.expect("runc spec (runc is installed by scripts/install-deps.sh)");
        // runc's defaults stay: its masked paths and its mounts.
        assert!(
            v["linux"]["maskedPaths"]
                .as_array()
                .is_some_and(|a| a.len() > 3)
        );
        assert!(
            v["mounts"]
                .as_array()
                .is_some_and(|a| a.iter().any(|m| m["destination"] == "/dev/pts"))
        );
        assert_eq!(v["process"]["terminal"], false);
        assert_eq!(v["root"]["path"], "/r");
        assert_eq!(v["root"]["readonly"], true);
        assert_eq!(v["process"]["args"][2], "true");
    }
}
