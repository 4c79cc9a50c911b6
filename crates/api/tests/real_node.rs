//! The control plane over a real node (real sandboxes of the `tiny` template): create
//! through the REST router, detail, real cgroup metrics, envd's log, the router's
//! resolver, expiry by timeout recorded with its reason, kill leaves nothing.
//!
//! Needs root (user namespaces, cgroups, mounts) and a static `cubicle-envd`
//! (`scripts/build-envd.sh`); without root it says so and skips. `harness = false`: the
//! runtime re-executes this binary as its sandbox helper, so `main` must hand over first.

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use cubicle_api::{ApiConfig, ApiResolver, ControlPlane};
use cubicle_node::{Node, NodeConfig};
use cubicle_router::SandboxResolver;
use serde_json::{Value, json};
use tower::ServiceExt;

fn main() {
    cubicle_runtime::maybe_run_helper();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!(
            "real_node: SKIPPED — needs root (user namespaces with uid ranges, cgroups, mounts)"
        );
        return;
    }
    if !std::path::Path::new("/bin/busybox").exists() {
        println!("real_node: SKIPPED — /bin/busybox missing (apt-get install busybox-static)");
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(run()) {
        Ok(()) => println!("real_node: ok"),
        Err(e) => {
            eprintln!("real_node: FAILED — {e:#}");
            std::process::exit(1);
        }
    }
}

async fn call(
    app: &axum::Router,
    m: Method,
    uri: &str,
    key: &str,
    body: Value,
) -> anyhow::Result<(StatusCode, Value)> {
    let body = if body.is_null() {
        Body::empty()
    } else {
        Body::from(body.to_string())
    };
    let req = Request::builder()
        .method(m)
        .uri(uri)
        .header("x-api-key", key)
        .body(body)?;
    let resp = app.clone().oneshot(req).await?;
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 24).await?;
    let v = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)?
    };
    Ok((status, v))
}

async fn run() -> anyhow::Result<()> {
    let envd = cubicle_node::config::find_envd_binary(None)
        .context("no static cubicle-envd: run scripts/build-envd.sh first")?;
    let state = PathBuf::from(format!("/tmp/cbapi-rt-{}", std::process::id()));
    let mut cfg = NodeConfig::new(&state, envd);
    cfg.first_slot = 3600; // disjoint from other tests' slot ranges
    cfg.max_sandboxes = 16;
    cfg.any_free_slots = true;
    let node = Node::open(cfg).await?;
    let result = scenario(&node, &state).await;
    node.kill_all().await;
    node.close();
    drop(node);
    let _ = cubicle_node::fsutil::remove_tree(&state);
    result
}

async fn scenario(node: &Node, state: &std::path::Path) -> anyhow::Result<()> {
    let store = cubicle_store::Store::open(&state.join("cubicle.db"))?;
    let team = store.ensure_team("t")?;
    let key = store.create_api_key(team.id)?.plaintext;
    let cp = ControlPlane::open(
        Arc::new(node.clone()),
        store.clone(),
        ApiConfig::new(state.join("logs")),
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let app = cubicle_api::router(cp.clone());

    let (s, v) = call(
        &app,
        Method::POST,
        "/v2/sandboxes",
        &key,
        json!({"templateID":"tiny","metadata":{"k":"v"},"envVars":{"FOO":"bar"}}),
    )
    .await?;
    ensure!(s == StatusCode::CREATED, "create: {s} {v}");
    let id = v["sandboxID"].as_str().context("sandboxID")?.to_string();
    ensure!(v["envdAccessToken"].is_string(), "{v}");

    let (s, d) = call(
        &app,
        Method::GET,
        &format!("/sandboxes/{id}"),
        &key,
        Value::Null,
    )
    .await?;
    ensure!(
        s == StatusCode::OK && d["state"] == "running" && d["metadata"]["k"] == "v",
        "detail: {s} {d}"
    );

    // One sample of the real counters (serve's upkeep takes one every 5 s).
    cp.sample_metrics().await;
    // What a sample reads (cgroup counters, the disk quota), for docs/serve.md.
    let t = Instant::now();
    for _ in 0..200 {
        node.stats(&id)?;
    }
    println!(
        "real_node: one metrics sample (Node::stats) takes {:?}",
        t.elapsed() / 200
    );
    let (s, m) = call(
        &app,
        Method::GET,
        &format!("/sandboxes/{id}/metrics"),
        &key,
        Value::Null,
    )
    .await?;
    ensure!(s == StatusCode::OK, "metrics: {s} {m}");
    ensure!(
        m[0]["memUsed"].as_u64().unwrap_or(0) > 0,
        "memory from the cgroup: {m}"
    );
    ensure!(
        m[0]["memTotal"].as_u64().unwrap_or(0) > 0 && m[0]["diskTotal"].as_u64().unwrap_or(0) > 0,
        "{m}"
    );

    let (s, l) = call(
        &app,
        Method::GET,
        &format!("/v2/sandboxes/{id}/logs"),
        &key,
        Value::Null,
    )
    .await?;
    ensure!(s == StatusCode::OK, "logs: {s} {l}");
    ensure!(
        l["logs"].as_array().is_some_and(|a| a
            .iter()
            .any(|e| e["message"].as_str().unwrap_or("").contains("envd"))),
        "envd's own log lines: {l}"
    );

    let target = ApiResolver::new(cp.clone())
        .resolve(&id)
        .context("resolver knows the sandbox")?;
    ensure!(
        target.envd_socket.exists(),
        "{}",
        target.envd_socket.display()
    );
    // The router reaches user ports through a pidfd of the sandbox's init.
    let pidfd = target
        .init_pidfd
        .as_ref()
        .context("the target has the init's pidfd")?;
    let fdinfo = std::fs::read_to_string(format!(
        "/proc/self/fdinfo/{}",
        std::os::fd::AsRawFd::as_raw_fd(&**pidfd)
    ))?;
    let init = node.get(&id)?.pid.context("the sandbox has an init pid")?;
    ensure!(
        fdinfo.lines().any(|l| l == format!("Pid:\t{init}")),
        "the pidfd names pid {init}: {fdinfo}"
    );
    ensure!(target.envd_access_token.as_deref() == v["envdAccessToken"].as_str());

    // Expiry is enforced by the node; the API notices and records why.
    let (s, _) = call(
        &app,
        Method::POST,
        &format!("/sandboxes/{id}/timeout"),
        &key,
        json!({"timeout": 1}),
    )
    .await?;
    ensure!(s == StatusCode::NO_CONTENT, "timeout: {s}");
    let t0 = Instant::now();
    loop {
        let (s, _) = call(
            &app,
            Method::GET,
            &format!("/sandboxes/{id}"),
            &key,
            Value::Null,
        )
        .await?;
        if s == StatusCode::NOT_FOUND {
            break;
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(10),
            "sandbox outlived its timeout"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let row = store.sandbox(&id)?.context("record kept")?;
    ensure!(row.death_reason.as_deref() == Some("timeout"), "{row:?}");

    // Kill leaves nothing on the node.
    let (s, v) = call(
        &app,
        Method::POST,
        "/v2/sandboxes",
        &key,
        json!({"templateID":"tiny"}),
    )
    .await?;
    ensure!(s == StatusCode::CREATED, "{v}");
    let id2 = v["sandboxID"].as_str().context("id")?.to_string();
    let (s, _) = call(
        &app,
        Method::DELETE,
        &format!("/sandboxes/{id2}"),
        &key,
        Value::Null,
    )
    .await?;
    ensure!(s == StatusCode::NO_CONTENT);
    ensure!(
        node.list().is_empty(),
        "node still has {:?}",
        node.list().iter().map(|s| &s.id).collect::<Vec<_>>()
    );
    ensure!(
        !state.join("sandboxes").join(&id2).exists(),
        "sandbox dir left"
    );
    Ok(())
}
