//! `cubicle sandbox create|list|info|exec|logs|kill|shell` end to end, through the real
//! binary:
//!
//! - `against_a_stand_in_server`: a stand-in for `cubicle serve` written here (the E2B
//!   REST routes the client uses, answering like the spec says, plus a router that
//!   checks `E2b-Sandbox-Id`/`E2b-Sandbox-Port` and streams Connect requests to a REAL
//!   `cubicle-envd` running in development mode with an access token). Needs no root.
//! - `against_cubicle_serve` (as root): the real `cubicle serve` on a temporary state
//!   directory, `tiny` template. Skips, saying why, when not root, when busybox-static is
//!   missing, or when this build has no `serve` subcommand yet.

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "sandbox_client/harness.rs"]
mod harness;

use std::{
    convert::Infallible,
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use bytes::Bytes;
use harness::*;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::{Request, Response, body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

type Body = BoxBody<Bytes, hyper::Error>;

const KEY: &str = "e2b_test_key";
const TOKEN: &str = "0123456789abcdef0123456789abcdef";
const ID: &str = "itest0sandbox1";

/// What the stand-in server knows.
struct Fake {
    envd_port: u16,
    killed: Mutex<bool>,
    created: Mutex<Option<Value>>,
    /// Requests seen by the router side: (path, x-access-token).
    routed: Mutex<Vec<(String, Option<String>)>>,
}

fn json_resp(status: u16, v: Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(
            Full::new(Bytes::from(v.to_string()))
                .map_err(|n| match n {})
                .boxed(),
        )
        .unwrap()
}

fn empty(status: u16) -> Response<Body> {
    Response::builder()
        .status(status)
        .body(Full::new(Bytes::new()).map_err(|n| match n {}).boxed())
        .unwrap()
}

fn not_found() -> Response<Body> {
    json_resp(
        404,
        json!({"code":404,"message":format!("sandbox \"{ID}\" doesn't exist or you don't have access to it")}),
    )
}

fn detail(fake: &Fake) -> Value {
    let c = fake.created.lock().unwrap().clone().unwrap_or(json!({}));
    json!({
        "templateID": c["templateID"], "sandboxID": ID, "clientID": "6532622b",
        "startedAt": "2026-11-30T12:00:00Z", "endAt": "2026-11-30T12:05:00Z",
        "envdVersion": "0.2.0", "cpuCount": 2, "memoryMB": 512, "diskSizeMB": 5120,
        "state": "running", "metadata": c["metadata"],
    })
}

/// Streams a data-plane request to envd (request and response bodies both stream).
async fn proxy(fake: &Fake, req: Request<Incoming>) -> Response<Body> {
    let stream = match tokio::net::TcpStream::connect(("127.0.0.1", fake.envd_port)).await {
        Ok(s) => s,
        Err(e) => return json_resp(502, json!({"code":502,"message":format!("envd: {e}")})),
    };
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let (parts, body) = req.into_parts();
    let req = Request::from_parts(parts, body);
    match send.send_request(req).await {
        Ok(resp) => resp.map(|b| b.boxed()),
        Err(e) => json_resp(502, json!({"code":502,"message":format!("envd: {e}")})),
    }
}

async fn handle(fake: Arc<Fake>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let h = |n: &str| {
        req.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    // Data plane first: dispatch on the routing headers, as the real router does.
    if let Some(id) = h("e2b-sandbox-id") {
        fake.routed
            .lock()
            .unwrap()
            .push((req.uri().path().to_string(), h("x-access-token")));
        if id != ID || *fake.killed.lock().unwrap() {
            return Ok(json_resp(
                502,
                json!({"sandboxId": id, "message": "The sandbox was not found", "code": 502}),
            ));
        }
        if h("e2b-sandbox-port").as_deref() != Some("49983") {
            return Ok(json_resp(
                502,
                json!({"sandboxId": id, "message": "The sandbox is running but port is not open", "port": 0, "code": 502}),
            ));
        }
        return Ok(proxy(&fake, req).await);
    }
    if h("x-api-key").as_deref() != Some(KEY) {
        return Ok(json_resp(
            401,
            json!({"code":401,"message":"Invalid API key"}),
        ));
    }
    let method = req.method().to_string();
    let path = req.uri().path().to_string();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let killed = *fake.killed.lock().unwrap();
    let created = fake.created.lock().unwrap().is_some();
    let alive = created && !killed;
    let sbx = json!({"templateID":"tiny","sandboxID":ID,"clientID":"6532622b","envdVersion":"0.2.0","envdAccessToken":TOKEN});
    let resp = match (method.as_str(), path.as_str()) {
        ("POST", "/v2/sandboxes") => {
            let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            if v["templateID"] != "tiny" {
                json_resp(
                    404,
                    json!({"code":404,"message":format!("template '{}' not found", v["templateID"].as_str().unwrap_or(""))}),
                )
            } else {
                *fake.created.lock().unwrap() = Some(v);
                json_resp(201, sbx)
            }
        }
        ("GET", "/v2/sandboxes") => json_resp(
            200,
            if alive {
                json!([detail(&fake)])
            } else {
                json!([])
            },
        ),
        ("GET", p) if p == format!("/sandboxes/{ID}") && alive => json_resp(200, detail(&fake)),
        ("DELETE", p) if p == format!("/sandboxes/{ID}") && alive => {
            *fake.killed.lock().unwrap() = true;
            empty(204)
        }
        ("POST", p) if p == format!("/v2/sandboxes/{ID}/connect") && alive => {
            // exec/shell must not stretch the sandbox's life: timeout 1 (end = max(end, now+1)).
            assert_eq!(&body[..], br#"{"timeout":1}"#);
            json_resp(200, sbx)
        }
        // Logs outlive the sandbox, as in the real server.
        ("GET", p) if p == format!("/v2/sandboxes/{ID}/logs") && created => json_resp(
            200,
            json!({"logs":[
                {"timestamp":"2026-11-30T12:00:00.000Z","message":"envd started","level":"info","fields":{}},
                {"timestamp":"2026-11-30T12:00:01.000Z","message":"hello from the start command","level":"info","fields":{}},
            ]}),
        ),
        _ => not_found(),
    };
    Ok(resp)
}

/// Serves the stand-in on 127.0.0.1:0; returns its URL.
fn start_fake(rt: &tokio::runtime::Runtime, fake: Arc<Fake>) -> String {
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else {
                return;
            };
            let fake = fake.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |r| handle(fake.clone(), r));
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    format!("http://{addr}")
}

#[test]
fn against_a_stand_in_server() {
    let envd_port = free_port();
    let mut envd = KillOnDrop(
        Command::new(envd_binary())
            .args(["--dev", "--listen", "127.0.0.1", "--port"])
            .arg(envd_port.to_string())
            .args(["--access-token", TOKEN])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting cubicle-envd"),
    );
    wait_port(envd_port, &mut envd.0, "cubicle-envd");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let fake = Arc::new(Fake {
        envd_port,
        killed: Mutex::new(false),
        created: Mutex::new(None),
        routed: Mutex::new(Vec::new()),
    });
    let api = start_fake(&rt, fake.clone());

    // Errors carry the server's message and status; exit code non-zero.
    let o = run(&api, "wrong", &["list"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("401: Invalid API key"),
        "{}",
        stderr(&o)
    );
    let o = run(&api, KEY, &["create", "--template", "nope"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("404: template 'nope' not found"),
        "{}",
        stderr(&o)
    );

    // create / list / info.
    let id = ok(
        run(
            &api,
            KEY,
            &[
                "create",
                "--template",
                "tiny",
                "--timeout",
                "60",
                "--metadata",
                "owner=me",
                "--env",
                "GREETING=hi",
            ],
        ),
        "create",
    );
    assert_eq!(id.trim(), ID);
    let body = fake.created.lock().unwrap().clone().unwrap();
    assert_eq!(
        body,
        json!({"templateID":"tiny","timeout":60,"metadata":{"owner":"me"},"envVars":{"GREETING":"hi"}})
    );
    let list = ok(run(&api, KEY, &["list"]), "list");
    assert!(
        list.lines().next().unwrap().starts_with("SANDBOX ID"),
        "{list}"
    );
    assert!(list.contains(ID) && list.contains("owner=me"), "{list}");
    let listed: Value =
        serde_json::from_str(&ok(run(&api, KEY, &["list", "--json"]), "list --json")).unwrap();
    assert_eq!(listed[0]["sandboxID"], ID);
    let info = ok(run(&api, KEY, &["info", ID]), "info");
    assert!(info.contains("State:            running"), "{info}");

    // exec: output streams, exit code, env, cwd, word joining, token forwarded.
    let o = run(
        &api,
        KEY,
        &["exec", ID, "--", "echo out; echo err >&2; exit 3"],
    );
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert_eq!(stdout(&o), "out\n");
    assert!(stderr(&o).contains("err\n"), "{}", stderr(&o));
    let o = ok(
        run(
            &api,
            KEY,
            &[
                "exec", ID, "--env", "A=b c", "--cwd", "/tmp", "--", "echo", "\"$A\"", "$(pwd)",
            ],
        ),
        "exec env",
    );
    assert_eq!(o, "b c /tmp\n");
    assert!(
        fake.routed
            .lock()
            .unwrap()
            .iter()
            .all(|(p, t)| p == "/process.Process/Start" && t.as_deref() == Some(TOKEN)),
        "{:?}",
        fake.routed.lock().unwrap()
    );
    // Output arrives while the command still runs (streamed, not buffered).
    let mut child = sandbox_cmd(
        &api,
        KEY,
        &["exec", ID, "--", "echo first; sleep 3; echo second"],
    )
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let t0 = Instant::now();
    let mut first = [0u8; 6];
    std::io::Read::read_exact(child.stdout.as_mut().unwrap(), &mut first).unwrap();
    assert_eq!(&first, b"first\n");
    assert!(
        t0.elapsed() < Duration::from_millis(2500),
        "first line came late: {:?}",
        t0.elapsed()
    );
    assert!(child.wait().unwrap().success());
    // --timeout: envd kills the command at the deadline; exit code 124.
    let t0 = Instant::now();
    let o = run(&api, KEY, &["exec", ID, "--timeout", "1", "--", "sleep 20"]);
    assert_eq!(o.status.code(), Some(124), "{}", stderr(&o));
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    // A command killed by a signal: 128 + signal.
    let o = run(&api, KEY, &["exec", ID, "--", "kill -TERM $$"]);
    assert_eq!(o.status.code(), Some(143), "{}", stderr(&o));

    // shell on a PTY: arithmetic, then exit with a code; the terminal is restored.
    let r = shell_on_pty(&api, KEY, &[ID], &["echo $((6*7))\n", "exit 5\n"]);
    eprintln!("shell output: {:?}", r.output);
    assert!(r.output.contains("42\r\n"), "no 42 in {:?}", r.output);
    assert_eq!(r.code, Some(5), "output: {:?}", r.output);
    assert!(r.termios_restored, "terminal left in raw mode");
    // The PTY size reached the remote side, and so does a resize (SIGWINCH → Update).
    let r = shell_on_pty(&api, KEY, &[ID], &["stty size\n", "exit\n"]);
    assert!(r.output.contains("30 100\r\n"), "{:?}", r.output);
    assert_eq!(r.code, Some(0));
    let r = shell_on_pty_with(
        std::path::Path::new(BIN),
        &api,
        KEY,
        &[ID],
        &["stty size\n", "exit\n"],
        Some((132, 43)),
    );
    assert!(r.output.contains("43 132\r\n"), "{:?}", r.output);
    assert_eq!(r.code, Some(0));

    // logs, and logs --follow ending when the sandbox is killed.
    let logs = ok(run(&api, KEY, &["logs", ID]), "logs");
    assert_eq!(logs, "envd started\nhello from the start command\n");
    let mut follow = KillOnDrop(
        sandbox_cmd(&api, KEY, &["logs", "--follow", ID])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    std::thread::sleep(Duration::from_millis(1500));

    // kill, then everything says it is gone.
    let o = ok(run(&api, KEY, &["kill", ID]), "kill");
    assert_eq!(o, format!("killed {ID}\n"));
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(st) = follow.0.try_wait().unwrap() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "logs --follow did not end after kill"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success());
    let mut followed = String::new();
    std::io::Read::read_to_string(follow.0.stdout.as_mut().unwrap(), &mut followed).unwrap();
    assert_eq!(
        followed, "envd started\nhello from the start command\n",
        "each line once"
    );
    let o = run(&api, KEY, &["kill", ID]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("404"), "{}", stderr(&o));
    let o = run(&api, KEY, &["info", ID]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("404: sandbox"), "{}", stderr(&o));
    // exec passes on its command's exit code, so its own failures are 125 (as Docker's).
    let o = run(&api, KEY, &["exec", ID, "--", "true"]);
    assert_eq!(o.status.code(), Some(125));
    assert!(
        stderr(&o).contains("connecting to sandbox"),
        "{}",
        stderr(&o)
    );
    assert!(!ok(run(&api, KEY, &["list"]), "list").contains(ID));
}

// ---------------------------------------------------------------------------------------
// Against the real `cubicle serve`.

/// First uid/network slot of this test's node (disjoint from the other tests' nodes).
const SERVE_FIRST_SLOT: u32 = 5200;

/// A `cubicle serve` in its own network namespace (its port and the sandboxes' veths live
/// there), with a temporary state directory; CLI commands reach it through `nsenter`.
struct Serve {
    child: std::process::Child,
    state: std::path::PathBuf,
    api: String,
    key: String,
}

impl Serve {
    fn start() -> Serve {
        let state = std::path::PathBuf::from(format!("/tmp/cbsc-{}-serve", std::process::id()));
        let mut child = Command::new("unshare")
            .args([
                "--net",
                "--",
                "sh",
                "-c",
                "ip link set lo up && exec \"$0\" \"$@\"",
            ])
            .arg(BIN)
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--no-build-templates",
                "--pool",
                "",
            ])
            .env("CUBICLE_STATE_DIR", &state)
            .env("CUBICLE_FIRST_SLOT", SERVE_FIRST_SLOT.to_string())
            .env("CUBICLE_MAX_SANDBOXES", "16")
            .env("CUBICLE_ANY_FREE_SLOTS", "true")
            .env("CUBICLE_ENVD_BIN", envd_binary())
            .env_remove("CUBICLE_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting cubicle serve");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let (mut api, mut key) = (String::new(), String::new());
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(l) if l == "cubicle: ready" => break,
                Ok(l) => {
                    if let Some(v) = l.strip_prefix("export E2B_API_URL=") {
                        api = v.to_string();
                    } else if let Some(v) = l.strip_prefix("export E2B_API_KEY=") {
                        key = v.to_string();
                    }
                }
                Err(_) => {
                    let _ = child.kill();
                    panic!("cubicle serve did not report ready: {:?}", child.wait());
                }
            }
        }
        if key.is_empty() {
            // The server prints the admin key only when it creates it.
            key = std::fs::read_to_string(state.join("admin-api-key"))
                .expect("the admin key file")
                .trim()
                .to_string();
        }
        assert!(
            api.starts_with("http://127.0.0.1:") && !key.is_empty(),
            "{api:?} {key:?}"
        );
        Serve {
            child,
            state,
            api,
            key,
        }
    }

    /// `cubicle sandbox shell ID` with `input` as its whole stdin (a pipe, then EOF).
    fn piped_shell(&self, id: &str, input: &[u8]) -> std::process::Child {
        let mut child = self
            .cmd(&["shell", id])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(child.stdin.as_mut().unwrap(), input).unwrap();
        drop(child.stdin.take());
        child
    }

    /// `cubicle sandbox ARGS…` inside the server's network namespace.
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new("nsenter");
        c.arg("-t")
            .arg(self.child.id().to_string())
            .args(["-n", "--", BIN, "sandbox"])
            .args(args)
            .env("E2B_API_URL", &self.api)
            .env("E2B_API_KEY", &self.key)
            .env_remove("E2B_SANDBOX_URL")
            .env_remove("CUBICLE_LOG");
        c
    }

    fn run(&self, args: &[&str]) -> std::process::Output {
        self.cmd(args).stdin(Stdio::null()).output().unwrap()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        // SIGTERM (graceful), then whatever sandboxes a failed test left are killed
        // through the node directly, then the state directory goes.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let local = |args: &[&str]| {
            Command::new(BIN)
                .args(args)
                .env("CUBICLE_STATE_DIR", &self.state)
                .env("CUBICLE_FIRST_SLOT", SERVE_FIRST_SLOT.to_string())
                .env("CUBICLE_MAX_SANDBOXES", "16")
                .env("CUBICLE_ANY_FREE_SLOTS", "true")
                .env_remove("CUBICLE_LOG")
                .output()
        };
        if let Ok(o) = local(&["local", "list"]) {
            for line in String::from_utf8_lossy(&o.stdout).lines().skip(1) {
                if let Some(id) = line.split_whitespace().next() {
                    eprintln!("cleanup: killing leftover sandbox {id}");
                    let _ = local(&["local", "kill", id]);
                }
            }
        }
        let _ = cubicle_node::fsutil::remove_tree(&self.state);
    }
}

fn serve_ready() -> bool {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root (cubicle serve creates sandboxes)");
        return false;
    }
    if !std::path::Path::new("/bin/busybox").exists() {
        eprintln!("skipped: /bin/busybox missing (busybox-static, for the tiny template)");
        return false;
    }
    let help = Command::new(BIN).args(["serve", "--help"]).output();
    if !help.is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: this build has no `cubicle serve`");
        return false;
    }
    true
}

#[test]
fn against_cubicle_serve() {
    if !serve_ready() {
        return;
    }
    let serve = Serve::start();
    let ok = |args: &[&str]| harness::ok(serve.run(args), &args.join(" "));

    // create / list / info
    let id = ok(&[
        "create",
        "--template",
        "tiny",
        "--timeout",
        "120",
        "--metadata",
        "purpose=cli-test",
        "--metadata",
        "odd key=a&b=c%20",
        "--env",
        "GREETING=hello there",
    ]);
    let id = id.trim().to_string();
    assert!(
        !id.is_empty()
            && id
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()),
        "{id:?}"
    );
    let list = ok(&["list"]);
    let row = list
        .lines()
        .find(|l| l.starts_with(&id))
        .unwrap_or_else(|| panic!("{id} not in {list}"));
    assert!(
        row.contains("tiny") && row.contains("running") && row.contains("purpose=cli-test"),
        "{row}"
    );
    let listed: Value = serde_json::from_str(&ok(&[
        "list",
        "--json",
        "--metadata",
        "purpose=cli-test",
        "--metadata",
        "odd key=a&b=c%20",
    ]))
    .unwrap();
    assert_eq!(listed.as_array().map(|a| a.len()), Some(1), "{listed}");
    assert_eq!(listed[0]["sandboxID"], id.as_str());
    let other: Value =
        serde_json::from_str(&ok(&["list", "--json", "--metadata", "purpose=other"])).unwrap();
    assert_eq!(other, json!([]));
    let info = ok(&["info", &id]);
    assert!(
        info.contains(&format!("Sandbox ID:       {id}"))
            && info.contains("State:            running"),
        "{info}"
    );

    // Issue 10, item 4: what serve keeps is root's alone (a local user reads no token).
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &std::path::Path| {
            std::fs::metadata(p)
                .map(|m| m.permissions().mode() & 0o777)
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        };
        let st = &serve.state;
        for (p, want) in [
            (st.clone(), 0o700),
            (st.join("cubicle.db"), 0o600),
            (st.join("admin-api-key"), 0o600),
            (st.join("sandboxes").join(&id).join("sandbox.json"), 0o600),
        ] {
            assert_eq!(mode(&p), want, "{}", p.display());
        }
        for aux in ["cubicle.db-wal", "cubicle.db-shm"] {
            let p = st.join(aux);
            if p.exists() {
                assert_eq!(mode(&p), 0o600, "{}", p.display());
            }
        }
    }

    let end_at = |serve: &Serve| -> Value {
        let v: Value = serde_json::from_str(&harness::ok(
            serve.run(&["info", "--json", &id]),
            "info --json",
        ))
        .unwrap();
        v["endAt"].clone()
    };
    let end_before = end_at(&serve);
    assert!(end_before.is_string(), "{end_before}");

    // exec through the router (tiny has no bash: /bin/sh is used)
    let o = serve.run(&["exec", &id, "--", "echo out; echo err >&2; exit 3"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert_eq!(stdout(&o), "out\n");
    assert!(stderr(&o).contains("err"), "{}", stderr(&o));
    assert_eq!(
        ok(&["exec", &id, "--", "echo", "\"$GREETING\""]),
        "hello there\n"
    );
    assert_eq!(ok(&["exec", &id, "--", "id -un"]), "user\n");
    assert_eq!(
        ok(&[
            "exec",
            &id,
            "--user",
            "root",
            "--cwd",
            "/tmp",
            "--",
            "id -un; pwd"
        ]),
        "root\n/tmp\n"
    );
    let o = serve.run(&["exec", &id, "--", "kill -KILL $$"]);
    assert_eq!(o.status.code(), Some(137), "{}", stderr(&o));

    // Running commands did not stretch the sandbox's life.
    assert_eq!(end_at(&serve), end_before);

    // Issue 16, CLI parity: `exec` without `--`, `exec -i` with stdin streamed, Cubicle's
    // own failures as 125, `cp` both ways, `set-timeout`, `--format json`.
    assert_eq!(ok(&["exec", &id, "echo", "no-dashes"]), "no-dashes\n");
    let piped = |args: &[&str], input: &[u8]| {
        use std::io::Write;
        let mut c = serve
            .cmd(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(input).unwrap();
        c.wait_with_output().unwrap()
    };
    let o = piped(&["exec", "-i", &id, "wc -c; echo done"], b"twelve bytes");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(
        stdout(&o).split_whitespace().collect::<Vec<_>>(),
        ["12", "done"]
    );
    let o = piped(&["exec", &id, "wc -c"], b"dropped without -i");
    assert_eq!(stdout(&o).trim(), "0", "{}", stderr(&o));
    let o = serve.run(&["exec", "nosuchsandbox00000000", "true"]);
    assert_eq!(o.status.code(), Some(125), "{}", stderr(&o));
    let o = serve.run(&["exec", &id, "--cwd", "/no/such/dir", "true"]);
    assert_eq!(o.status.code(), Some(126), "{}", stderr(&o));

    let local = serve.state.join("cp-in.txt");
    std::fs::write(&local, "copied in\n").unwrap();
    ok(&["cp", local.to_str().unwrap(), &format!("{id}:/tmp/")]);
    assert_eq!(ok(&["exec", &id, "cat /tmp/cp-in.txt"]), "copied in\n");
    ok(&["exec", &id, "echo from the sandbox > /tmp/out.txt"]);
    assert_eq!(
        ok(&["cp", &format!("{id}:/tmp/out.txt"), "-"]),
        "from the sandbox\n"
    );
    let back = serve.state.join("cp-out.txt");
    ok(&["cp", &format!("{id}:/tmp/out.txt"), back.to_str().unwrap()]);
    assert_eq!(
        std::fs::read_to_string(&back).unwrap(),
        "from the sandbox\n"
    );

    ok(&["set-timeout", &id, "600"]);
    assert_ne!(end_at(&serve), end_before, "set-timeout moves the end");
    let listed: Value = serde_json::from_str(&ok(&["list", "--format", "json"])).unwrap();
    assert!(
        listed
            .as_array()
            .is_some_and(|a| a.iter().any(|s| s["sandboxID"] == id.as_str())),
        "{listed}"
    );

    // shell on a PTY
    let api = serve.api.clone();
    let r = {
        // The PTY helper runs `cubicle sandbox shell`; run it inside the namespace by
        // pointing it at an nsenter wrapper script.
        let wrapper = serve.state.join("nsenter-cubicle");
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\nexec nsenter -t {} -n -- {BIN} \"$@\"\n",
                serve.child.id()
            ),
        )
        .unwrap();
        std::fs::set_permissions(
            &wrapper,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        harness::shell_on_pty_with(
            &wrapper,
            &api,
            &serve.key,
            &[&id],
            &["echo $((6*7))\n", "exit 4\n"],
            None,
        )
    };
    eprintln!("shell output: {:?}", r.output);
    assert!(r.output.contains("42\r\n"), "no 42 in {:?}", r.output);
    assert_eq!(r.code, Some(4), "{:?}", r.output);
    assert!(r.termios_restored);

    // shell with piped stdin (no terminal): no raw mode, EOF ends the remote shell.
    let o = serve
        .piped_shell(&id, b"echo $((6*7))\n")
        .wait_with_output()
        .unwrap();
    assert!(o.status.success(), "{:?} {}", o.status, stderr(&o));
    assert!(stdout(&o).contains("42\r\n"), "{:?}", stdout(&o));

    // ... also when the last command outlasts the first ten seconds of Ctrl-Ds (those
    // typed while it runs reach the shell as literal characters): EOF still ends it.
    let o = serve
        .piped_shell(&id, b"sleep 11; echo after-$((6*7))\n")
        .wait_with_output()
        .unwrap();
    assert!(o.status.success(), "{:?} {}", o.status, stderr(&o));
    assert!(stdout(&o).contains("after-42\r\n"), "{:?}", stdout(&o));

    // ... and when the line is not empty at the end: a last line without its newline
    // (or a Ctrl-D turned into a NUL) made every Ctrl-D only delete, forever.
    let mut child = serve.piped_shell(&id, b"echo $((6*7))\nfoo");
    let t0 = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > std::time::Duration::from_secs(30) {
            let _ = child.kill();
            panic!("the shell with an unfinished last line did not end in 30 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let o = child.wait_with_output().unwrap();
    assert!(stdout(&o).contains("42\r\n"), "{:?}", stdout(&o));

    // logs
    let logs = serve.run(&["logs", &id]);
    assert!(logs.status.success(), "{}", stderr(&logs));

    // kill --all with a filter kills only what it selects.
    let doomed = ok(&["create", "--template", "tiny", "-m", "purpose=kill-all"]);
    let doomed = doomed.trim();
    let o = ok(&["kill", "--all", "-m", "purpose=kill-all"]);
    assert!(o.contains(doomed) && !o.contains(&id), "{o}");
    let left: Value = serde_json::from_str(&ok(&["list", "--json"])).unwrap();
    let left: Vec<&str> = left
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["sandboxID"].as_str())
        .collect();
    assert!(
        left.contains(&id.as_str()) && !left.contains(&doomed),
        "{left:?}"
    );

    // kill
    assert_eq!(ok(&["kill", &id]), format!("killed {id}\n"));
    let o = serve.run(&["info", &id]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("404"), "{}", stderr(&o));
    let o = serve.run(&["kill", &id]);
    assert_eq!(o.status.code(), Some(1));
    assert!(!ok(&["list"]).contains(&id));
    // A wrong key is refused with the server's message.
    let o = serve
        .cmd(&["list"])
        .env("E2B_API_KEY", "e2b_wrong")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("401"), "{}", stderr(&o));
}
