//! The official Python SDK (tests/e2e/.venv, e2b 2.63.0) against the router alone: a
//! `Sandbox` object built directly (no control plane) with `sandbox_url` pointing at the
//! router, envd behind it. Skips with a message when the venv is not installed.

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{path::Path, sync::Arc};

use common::*;
use cubicle_router::RouterConfig;

const SCRIPT: &str = r#"
import os, sys, httpx
from packaging.version import Version
from e2b import Sandbox, ConnectionConfig
from e2b.exceptions import SandboxNotRunningException, SandboxException

url = os.environ["ROUTER_URL"]
token = os.environ["ENVD_TOKEN"]
scratch = os.environ["SCRATCH"]

def sandbox(sid, tok=token):
    # What Sandbox.create()/connect() put in the config (sandbox_sync/main.py).
    headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", "X-Access-Token": tok}
    cfg = ConnectionConfig(api_key="unused", sandbox_url=url, extra_sandbox_headers=headers)
    return Sandbox(sandbox_id=sid, envd_version=Version("0.6.13"), envd_access_token=tok,
                   sandbox_domain=None, connection_config=cfg)

sb = sandbox("sbpy")
assert sb.is_running()
r = sb.commands.run("echo hi")
assert r.stdout == "hi\n" and r.exit_code == 0, r
out = []
h = sb.commands.run("for i in 1 2 3; do echo line$i; done", background=True)
res = h.wait(on_stdout=lambda s: out.append(s))
assert "".join(out) == "line1\nline2\nline3\n", out

path = scratch + "/hello world.txt"
sb.files.write(path, "content through the router")
assert sb.files.read(path) == "content through the router"
entries = [e.name for e in sb.files.list(scratch)]
assert "hello world.txt" in entries, entries
blob = os.urandom(5 << 20)
sb.files.write(scratch + "/blob.bin", blob)
assert sb.files.read(scratch + "/blob.bin", format="bytes") == blob

# Presigned URLs opened by a plain client (no routing headers).
dl = sb.download_url(path)
assert "signature=" in dl, dl
resp = httpx.get(dl)
assert resp.status_code == 200 and resp.text == "content through the router", (resp.status_code, resp.text)
ul = sb.upload_url(scratch + "/uploaded.txt")
resp = httpx.post(ul, files={"file": ("uploaded.txt", b"via upload url")})
assert resp.status_code == 200, (resp.status_code, resp.text)
assert open(scratch + "/uploaded.txt", "rb").read() == b"via upload url"

# Unknown sandbox: the router's 502 "was not found" → not running.
gone = sandbox("sbgone")
assert gone.is_running() is False
try:
    gone.commands.run("true")
    raise AssertionError("expected SandboxNotRunningException")
except SandboxNotRunningException:
    pass
try:
    gone.files.read("/etc/hostname")
    raise AssertionError("expected SandboxNotRunningException")
except SandboxNotRunningException:
    pass
print("PYTHON-SDK-OK")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_through_the_router() {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/e2e/.venv/bin/python3");
    if !python.exists() {
        eprintln!(
            "skipping python_sdk_through_the_router: {} not installed",
            python.display()
        );
        return;
    }
    let envd = Envd::start("0123456789abcdef0123456789abcdef");
    let resolver = Arc::new(FakeResolver::default());
    resolver.insert(target(
        "sbpy",
        &envd.socket,
        std::process::id(),
        Some(&envd.token),
        None,
    ));
    let addr = start_router(resolver, RouterConfig::default()).await;
    let scratch = envd.files_dir();
    let out = tokio::process::Command::new(&python)
        .arg("-c")
        .arg(SCRIPT)
        .env("ROUTER_URL", format!("http://{addr}"))
        .env("ENVD_TOKEN", &envd.token)
        .env("SCRATCH", &scratch)
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_SANDBOX_URL")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("PYTHON-SDK-OK"),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
}
