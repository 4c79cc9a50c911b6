//! Handler tests through the real router with an in-memory fake node: every route's
//! success and error shapes, team isolation, pagination, metadata-filter decoding,
//! idempotency, deaths noticed by the node, and garbage input (never a 5xx).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use cubicle_node::runtime::SandboxStats;
use cubicle_node::{CreateRequest, DeathReason, SandboxInfo, SandboxState};
use cubicle_router::SandboxResolver;
use cubicle_store::Store;
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::backend::{Backend, BoxFuture};
use crate::{ApiConfig, ApiResolver, ControlPlane, router};

/// A node in memory.
struct FakeNode {
    live: Mutex<HashMap<String, SandboxInfo>>,
    dead: Mutex<HashMap<String, SandboxInfo>>,
    seq: AtomicU64,
    dir: PathBuf,
    /// What `grown_logs` answers next (taken): `None` → "cannot tell".
    grown: Mutex<Option<Vec<String>>>,
}

impl FakeNode {
    fn new(dir: PathBuf) -> Self {
        FakeNode {
            live: Mutex::new(HashMap::new()),
            dead: Mutex::new(HashMap::new()),
            seq: AtomicU64::new(0),
            dir,
            grown: Mutex::new(None),
        }
    }

    /// The node noticed a death by itself (timeout, OOM, …).
    fn die(&self, id: &str, reason: DeathReason) {
        if let Some(mut i) = self.live.lock().unwrap().remove(id) {
            i.state = SandboxState::Dead;
            i.death_reason = Some(reason);
            self.dead.lock().unwrap().insert(id.into(), i);
        }
    }
}

impl Backend for FakeNode {
    fn update_network<'a>(
        &'a self,
        id: &'a str,
        policy: cubicle_node::NetworkPolicy,
    ) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(async move {
            match self.live.lock().unwrap().get_mut(id) {
                Some(i) => {
                    i.network = policy;
                    Ok(())
                }
                None => Err(cubicle_node::Error::SandboxNotFound(id.into())),
            }
        })
    }

    fn pool(&self) -> cubicle_node::PoolStats {
        cubicle_node::PoolStats {
            ready: [("tiny".to_string(), 2)].into(),
            target: [("tiny".to_string(), 4)].into(),
            claims: 3,
            misses: 1,
            waited: 0,
            refills: 5,
            teardowns: 2,
        }
    }

    fn template_exists(&self, name: &str) -> cubicle_node::Result<bool> {
        if name.contains(':') {
            return Ok(false); // no tags besides the default one here
        }
        cubicle_node::template::validate_name(name)?;
        Ok(["base", "tiny"].contains(&name))
    }

    fn create(&self, req: CreateRequest) -> BoxFuture<'_, cubicle_node::Result<SandboxInfo>> {
        Box::pin(async move {
            let n = self.seq.fetch_add(1, Ordering::SeqCst);
            let now = cubicle_store::now_ms() as u64 + n; // distinct start times
            let id = format!("i{n:04}{}", cubicle_node::ids::random_suffix(8));
            let info = SandboxInfo {
                id: cubicle_node::SandboxId::parse(&id).expect("a valid id"),
                template: req.template,
                state: SandboxState::Running,
                death_reason: None,
                created_at_ms: now,
                end_at_ms: now + req.timeout.unwrap_or(Duration::from_secs(300)).as_millis() as u64,
                memory_mb: req.memory_mb.unwrap_or(512),
                cpus: req.cpus.unwrap_or(2),
                disk_mb: req.disk_mb.unwrap_or(5120),
                internet: req.internet,
                network: req.network,
                mask_request_host: req.mask_request_host,
                metadata: req.metadata,
                access_token: cubicle_node::ids::new_access_token(),
                uid_base: 200_000,
                pid: Some(4242),
                init_pidfd: None,
                envd_socket: self.dir.join(&id).join("ctl/envd.sock"),
                ready_us: 1,
                lifecycle: req.lifecycle,
                busy: false,
                pause_mode: None,
                paused_at_ms: None,
                envd_unresponsive_at_pause: false,
                timeout_ms: req.timeout.unwrap_or(Duration::from_secs(300)).as_millis() as u64,
                oom_kills: 0,
                volumes: req.volumes,
                claimed: false,
            };
            std::fs::create_dir_all(self.dir.join(&id)).unwrap();
            std::fs::write(self.log_path(&id), "envd starting\nWARN something odd\n").unwrap();
            self.live.lock().unwrap().insert(id, info.clone());
            Ok(info)
        })
    }

    fn kill<'a>(&'a self, id: &'a str) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(async move {
            if !self.live.lock().unwrap().contains_key(id) {
                return Err(cubicle_node::Error::SandboxNotFound(id.into()));
            }
            self.die(id, DeathReason::Killed);
            let _ = std::fs::remove_dir_all(self.dir.join(id));
            Ok(())
        })
    }

    fn get(&self, id: &str) -> cubicle_node::Result<SandboxInfo> {
        if let Some(i) = self.live.lock().unwrap().get(id) {
            return Ok(i.clone());
        }
        self.dead
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .ok_or_else(|| cubicle_node::Error::SandboxNotFound(id.into()))
    }

    fn set_timeout(&self, id: &str, timeout: Duration) -> cubicle_node::Result<()> {
        let mut live = self.live.lock().unwrap();
        let i = live
            .get_mut(id)
            .ok_or_else(|| cubicle_node::Error::SandboxNotFound(id.into()))?;
        i.end_at_ms = cubicle_store::now_ms() as u64 + timeout.as_millis() as u64;
        Ok(())
    }

    fn stats(&self, id: &str) -> cubicle_node::Result<SandboxStats> {
        self.get(id)?;
        Ok(SandboxStats {
            memory_bytes: 10 << 20,
            oom_kills: 0,
            cpu_usage_ns: 1_000_000,
            pids: 3,
            disk_used_bytes: Some(4096),
            disk_limit_bytes: Some(5120 << 20),
            ..Default::default()
        })
    }

    fn log_path(&self, id: &str) -> PathBuf {
        self.dir.join(id).join("init.log")
    }

    fn grown_logs<'a>(
        &'a self,
        _marks: &'a mut crate::backend::LogMarks,
    ) -> BoxFuture<'a, Option<std::collections::HashSet<String>>> {
        let g = self.grown.lock().unwrap().take();
        Box::pin(async move { g.map(|v| v.into_iter().collect()) })
    }

    fn create_volume<'a>(
        &'a self,
        id: &'a str,
        _size_mb: u64,
    ) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(async move {
            std::fs::create_dir_all(self.dir.join(".volumes").join(id)).unwrap();
            Ok(())
        })
    }

    fn delete_volume<'a>(&'a self, id: &'a str) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(async move {
            let users: Vec<String> = self
                .live
                .lock()
                .unwrap()
                .values()
                .filter(|i| i.volumes.iter().any(|v| v.volume_id == id))
                .map(|i| i.id.to_string())
                .collect();
            if !users.is_empty() {
                return Err(cubicle_node::Error::VolumeInUse {
                    volume: id.into(),
                    sandboxes: users,
                });
            }
            let _ = std::fs::remove_dir_all(self.dir.join(".volumes").join(id));
            Ok(())
        })
    }

    fn volume_fs(&self, id: &str) -> cubicle_node::Result<cubicle_node::volume::VolumeFs> {
        cubicle_node::volume::VolumeFs::open(&self.dir.join(".volumes").join(id))
            .map_err(|_| cubicle_node::Error::VolumeNotFound(id.into()))
    }

    fn volume_usage(&self, _id: &str) -> cubicle_node::Result<(u64, u64)> {
        Ok((4096, 1 << 30))
    }
}

struct Harness {
    app: axum::Router,
    cp: Arc<ControlPlane>,
    node: Arc<FakeNode>,
    key_a: String,
    key_b: String,
    dir: PathBuf,
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

static HARNESS_SEQ: AtomicU64 = AtomicU64::new(0);

async fn harness() -> Harness {
    harness_with(|_| {}).await
}

async fn harness_with(tune: impl FnOnce(&mut ApiConfig)) -> Harness {
    let dir = std::env::temp_dir().join(format!(
        "cubicle-api-test-{}-{}",
        std::process::id(),
        HARNESS_SEQ.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let store = Store::open_in_memory().unwrap();
    let a = store.ensure_team("a").unwrap();
    let b = store.ensure_team("b").unwrap();
    let key_a = store.create_api_key(a.id).unwrap().plaintext;
    let key_b = store.create_api_key(b.id).unwrap().plaintext;
    let node = Arc::new(FakeNode::new(dir.join("sandboxes")));
    let mut config = ApiConfig::new(dir.join("logs"));
    config.limits.max_timeout = Duration::from_secs(3600);
    tune(&mut config);
    let cp = ControlPlane::open(node.clone(), store, config)
        .await
        .unwrap();
    Harness {
        app: router(cp.clone()),
        cp,
        node,
        key_a,
        key_b,
        dir,
    }
}

struct Reply {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    json: Value,
}

impl Harness {
    async fn call(&self, method: Method, uri: &str, key: Option<&str>, body: Body) -> Reply {
        self.call_h(method, uri, key, body, &[]).await
    }

    async fn call_h(
        &self,
        method: Method,
        uri: &str,
        key: Option<&str>,
        body: Body,
        extra: &[(&str, &str)],
    ) -> Reply {
        let mut req = Request::builder().method(method).uri(uri);
        if let Some(k) = key {
            req = req.header("x-api-key", k);
        }
        for (k, v) in extra {
            req = req.header(*k, *v);
        }
        let resp = self
            .app
            .clone()
            .oneshot(req.body(body).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 24)
            .await
            .unwrap();
        let json = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or_else(|_| {
                panic!("{uri}: non-JSON body {:?}", String::from_utf8_lossy(&bytes))
            })
        };
        if status.as_u16() >= 400 {
            assert_eq!(json["code"], status.as_u16(), "{uri}: {json}");
            assert!(json["message"].is_string(), "{uri}: {json}");
        }
        Reply {
            status,
            headers,
            json,
        }
    }

    async fn a(&self, method: Method, uri: &str, body: Value) -> Reply {
        let body = if body.is_null() {
            Body::empty()
        } else {
            Body::from(body.to_string())
        };
        let key = self.key_a.clone();
        self.call(method, uri, Some(&key), body).await
    }

    async fn create_a(&self, body: Value) -> String {
        let r = self.a(Method::POST, "/v2/sandboxes", body).await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
        r.json["sandboxID"].as_str().unwrap().to_string()
    }
}

#[tokio::test]
async fn create_returns_the_sdk_sandbox_shape() {
    let h = harness().await;
    let r = h
        .a(
            Method::POST,
            "/v2/sandboxes",
            json!({"templateID":"base","metadata":{"k":"v"},"envVars":{"A":"1"}}),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let j = &r.json;
    let id = j["sandboxID"].as_str().unwrap();
    assert!(
        id.bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
    );
    assert_eq!(j["templateID"], "base");
    assert_eq!(j["clientID"], "6532622b");
    assert_eq!(j["envdVersion"], cubicle_envd::state::ENVD_VERSION);
    assert!(j["envdAccessToken"].as_str().is_some_and(|t| t.len() >= 32));
    assert!(j["domain"].is_null());
    assert!(j["trafficAccessToken"].is_null());
    // Env values are never stored; names are.
    let row = h.cp.store().sandbox(id).unwrap().unwrap();
    assert_eq!(row.env_var_names, ["A"]);
    // v1 create works too.
    let r = h
        .a(Method::POST, "/sandboxes", json!({"templateID":"tiny"}))
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    let d = h
        .a(
            Method::GET,
            &format!("/sandboxes/{}", r.json["sandboxID"].as_str().unwrap()),
            Value::Null,
        )
        .await;
    assert_eq!(d.status, StatusCode::OK);
}

#[tokio::test]
async fn create_errors() {
    let h = harness().await;
    for (body, status, needle) in [
        (
            json!({"templateID":"nope"}),
            404,
            "template 'nope' not found",
        ),
        (json!({"templateID":"base:v9"}), 404, "not found"),
        (json!({"templateID":"Bad Name"}), 400, "malformed"),
        (
            json!({"templateID":"base","timeout":0}),
            400,
            "greater than 0",
        ),
        (
            json!({"templateID":"base","timeout":3601}),
            400,
            "cannot be greater than 1 hours",
        ),
        (
            json!({"templateID":"base","timeout":"x"}),
            400,
            "invalid request body",
        ),
        (json!({"timeout":5}), 400, "templateID"),
    ] {
        let r = h.a(Method::POST, "/v2/sandboxes", body.clone()).await;
        assert_eq!(r.status.as_u16(), status, "{body}: {}", r.json);
        assert!(
            r.json["message"].as_str().unwrap().contains(needle),
            "{body}: {}",
            r.json
        );
    }
    let key = h.key_a.clone();
    let r = h
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some(&key),
            Body::from("{not json"),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let huge = format!(
        r#"{{"templateID":"base","metadata":{{"k":"{}"}}}}"#,
        "x".repeat(2 << 20)
    );
    let r = h
        .call(Method::POST, "/v2/sandboxes", Some(&key), Body::from(huge))
        .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        h.node.live.lock().unwrap().is_empty(),
        "no sandbox from bad requests"
    );
}

#[tokio::test]
async fn auth_is_required_and_json() {
    let h = harness().await;
    let r = h
        .call(Method::GET, "/v2/sandboxes", None, Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = h
        .call(
            Method::GET,
            "/v2/sandboxes",
            Some("e2b_0000000000000000000000000000000000000000"),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = h
        .call(
            Method::DELETE,
            "/sandboxes/abc",
            Some("garbage"),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = h.call(Method::GET, "/health", None, Body::empty()).await;
    assert_eq!(r.status, StatusCode::OK);
}

#[tokio::test]
async fn pool_counters_need_a_key() {
    let h = harness().await;
    let r = h
        .call(Method::GET, "/cubicle/pool", None, Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = h.a(Method::GET, "/cubicle/pool", Value::Null).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json["claims"], 3);
    assert_eq!(r.json["misses"], 1);
    assert_eq!(r.json["ready"]["tiny"], 2);
    assert_eq!(r.json["teardowns"], 2);
}

#[tokio::test]
async fn detail_timeout_connect_kill() {
    let h = harness().await;
    let id = h
        .create_a(json!({"templateID":"base","timeout":60,"metadata":{"m":"1"}}))
        .await;
    let r = h
        .a(Method::GET, &format!("/sandboxes/{id}"), Value::Null)
        .await;
    assert_eq!(r.status, StatusCode::OK);
    for k in [
        "templateID",
        "sandboxID",
        "clientID",
        "startedAt",
        "endAt",
        "envdVersion",
        "cpuCount",
        "memoryMB",
        "diskSizeMB",
        "state",
        "envdAccessToken",
    ] {
        assert!(!r.json[k].is_null(), "missing {k}: {}", r.json);
    }
    assert_eq!(r.json["state"], "running");
    assert_eq!(r.json["metadata"]["m"], "1");
    assert_eq!(r.json["lifecycle"]["onTimeout"], "kill");
    let end1 = r.json["endAt"].as_str().unwrap().to_string();

    // set_timeout: 204, end moves; can shorten.
    let r = h
        .a(
            Method::POST,
            &format!("/sandboxes/{id}/timeout"),
            json!({"timeout": 1200}),
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "{}", r.json);
    let end2 = h
        .a(Method::GET, &format!("/sandboxes/{id}"), Value::Null)
        .await
        .json["endAt"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(end2 > end1, "{end1} -> {end2}");
    assert_eq!(
        h.cp.store().sandbox(&id).unwrap().unwrap().end_at as u64,
        h.node.get(&id).unwrap().end_at_ms
    );
    for bad in [
        json!({}),
        json!({"timeout":-1}),
        json!({"timeout":"1"}),
        json!({"timeout":99999}),
    ] {
        let r = h
            .a(
                Method::POST,
                &format!("/sandboxes/{id}/timeout"),
                bad.clone(),
            )
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}");
    }
    // connect: 200, extends only.
    let r = h
        .a(
            Method::POST,
            &format!("/v2/sandboxes/{id}/connect"),
            json!({"timeout": 10}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["sandboxID"], id.as_str());
    let end3 = h
        .a(Method::GET, &format!("/sandboxes/{id}"), Value::Null)
        .await
        .json["endAt"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(end3, end2, "connect never shortens");
    let r = h
        .a(
            Method::POST,
            &format!("/v2/sandboxes/{id}/connect"),
            json!({"timeout": 3000}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let end4 = h
        .a(Method::GET, &format!("/sandboxes/{id}"), Value::Null)
        .await
        .json["endAt"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(end4 > end3);
    let r = h
        .a(Method::POST, &format!("/sandboxes/{id}/connect"), json!({}))
        .await;
    assert_eq!(
        r.status,
        StatusCode::BAD_REQUEST,
        "v1 connect needs timeout"
    );
    let r = h
        .a(
            Method::POST,
            &format!("/sandboxes/{id}/connect"),
            json!({"timeout": 5}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = h
        .a(
            Method::POST,
            &format!("/sandboxes/{id}/refreshes"),
            json!({"duration": 3000}),
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = h
        .a(
            Method::POST,
            &format!("/sandboxes/{id}/refreshes"),
            json!({"duration": 5000}),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);

    // kill: 204, then 404 everywhere, gone from lists, reason recorded.
    let r = h
        .a(Method::DELETE, &format!("/sandboxes/{id}"), Value::Null)
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    for (m, p) in [
        (Method::DELETE, format!("/sandboxes/{id}")),
        (Method::GET, format!("/sandboxes/{id}")),
        (Method::POST, format!("/sandboxes/{id}/timeout")),
        (Method::POST, format!("/v2/sandboxes/{id}/connect")),
        (Method::GET, format!("/sandboxes/{id}/metrics")),
    ] {
        let r = h.a(m, &p, json!({"timeout":5})).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{p}");
    }
    assert_eq!(
        h.a(Method::GET, "/v2/sandboxes", Value::Null).await.json,
        json!([])
    );
    let row = h.cp.store().sandbox(&id).unwrap().unwrap();
    assert_eq!(row.death_reason.as_deref(), Some("killed"));
    // Logs outlive the sandbox.
    let r = h
        .a(Method::GET, &format!("/sandboxes/{id}/logs"), Value::Null)
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json["logs"][0]["line"], "envd starting");
    assert_eq!(r.json["logEntries"][1]["level"], "warn");
}

#[tokio::test]
async fn unknown_and_malformed_ids_are_404() {
    let h = harness().await;
    for id in ["inope", "UPPER", "a-b", "%2e%2e", "x".repeat(200).as_str()] {
        for (m, p) in [
            (Method::GET, format!("/sandboxes/{id}")),
            (Method::DELETE, format!("/sandboxes/{id}")),
            (Method::POST, format!("/sandboxes/{id}/pause")),
            (Method::GET, format!("/v2/sandboxes/{id}/logs")),
        ] {
            let r = h.a(m, &p, Value::Null).await;
            assert_eq!(r.status, StatusCode::NOT_FOUND, "{p}: {}", r.json);
        }
    }
}

#[tokio::test]
async fn teams_are_isolated() {
    let h = harness().await;
    let id = h.create_a(json!({"templateID":"base"})).await;
    let kb = h.key_b.clone();
    for (m, p, body) in [
        (Method::GET, format!("/sandboxes/{id}"), ""),
        (Method::DELETE, format!("/sandboxes/{id}"), ""),
        (
            Method::POST,
            format!("/sandboxes/{id}/timeout"),
            r#"{"timeout":5}"#,
        ),
        (Method::POST, format!("/v2/sandboxes/{id}/connect"), "{}"),
        (Method::GET, format!("/sandboxes/{id}/logs"), ""),
        (Method::GET, format!("/sandboxes/{id}/metrics"), ""),
        (Method::POST, format!("/sandboxes/{id}/pause"), ""),
    ] {
        let r = h.call(m, &p, Some(&kb), Body::from(body)).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{p}");
    }
    let r = h
        .call(Method::GET, "/v2/sandboxes", Some(&kb), Body::empty())
        .await;
    assert_eq!(r.json, json!([]));
    let r = h
        .call(
            Method::GET,
            &format!("/sandboxes/metrics?sandbox_ids={id}"),
            Some(&kb),
            Body::empty(),
        )
        .await;
    assert_eq!(r.json, json!({"sandboxes": {}}));
    // Still alive for its owner.
    assert_eq!(
        h.a(Method::GET, &format!("/sandboxes/{id}"), Value::Null)
            .await
            .status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn list_filters_and_pagination() {
    let h = harness().await;
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(
            h.create_a(json!({"templateID": if i % 2 == 0 {"base"} else {"tiny"},
                "metadata": {"i": i.to_string(), "a b": if i == 3 {"c&d"} else {"x"}}}))
                .await,
        );
    }
    // Pages of 2, newest first, opaque token.
    let mut seen = Vec::new();
    let mut token: Option<String> = None;
    for _ in 0..4 {
        let uri = match &token {
            Some(t) => format!("/v2/sandboxes?limit=2&nextToken={t}"),
            None => "/v2/sandboxes?limit=2".into(),
        };
        let r = h.a(Method::GET, &uri, Value::Null).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.json);
        for s in r.json.as_array().unwrap() {
            for k in [
                "templateID",
                "sandboxID",
                "clientID",
                "startedAt",
                "endAt",
                "cpuCount",
                "memoryMB",
                "diskSizeMB",
                "state",
                "envdVersion",
            ] {
                assert!(!s[k].is_null(), "{k}");
            }
            seen.push(s["sandboxID"].as_str().unwrap().to_string());
        }
        token = r
            .headers
            .get("x-next-token")
            .map(|v| v.to_str().unwrap().to_string());
        if token.is_none() {
            break;
        }
    }
    let mut newest_first = ids.clone();
    newest_first.reverse();
    assert_eq!(seen, newest_first);
    // asc
    let r = h
        .a(Method::GET, "/v2/sandboxes?order=asc&limit=1", Value::Null)
        .await;
    assert_eq!(r.json[0]["sandboxID"], ids[0].as_str());
    // metadata exactly as the SDK encodes {"a b": "c&d"}
    let r = h
        .a(
            Method::GET,
            "/v2/sandboxes?metadata=a%252520b%3Dc%252526d",
            Value::Null,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let got: Vec<&str> = r
        .json
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["sandboxID"].as_str().unwrap())
        .collect();
    assert_eq!(got, [ids[3].as_str()]);
    let r = h
        .a(
            Method::GET,
            "/v2/sandboxes?metadata=i%3D1%26a%252520b%3Dx",
            Value::Null,
        )
        .await;
    assert_eq!(r.json.as_array().unwrap().len(), 1);
    // state and template filters
    assert_eq!(
        h.a(Method::GET, "/v2/sandboxes?state=paused", Value::Null)
            .await
            .json,
        json!([])
    );
    assert_eq!(
        h.a(
            Method::GET,
            "/v2/sandboxes?state=running,paused",
            Value::Null
        )
        .await
        .json
        .as_array()
        .unwrap()
        .len(),
        5
    );
    assert_eq!(
        h.a(Method::GET, "/v2/sandboxes?template=tiny", Value::Null)
            .await
            .json
            .as_array()
            .unwrap()
            .len(),
        2
    );
    // startedAfter (inclusive), with an unencoded '+' offset too
    assert_eq!(
        h.a(
            Method::GET,
            "/v2/sandboxes?startedAfter=2000-01-01T00:00:00%2B00:00",
            Value::Null
        )
        .await
        .json
        .as_array()
        .unwrap()
        .len(),
        5
    );
    assert_eq!(
        h.a(
            Method::GET,
            "/v2/sandboxes?startedAfter=2999-01-01T00:00:00+00:00",
            Value::Null
        )
        .await
        .json,
        json!([])
    );
    // v1 list: running only, all at once
    let r = h
        .a(Method::GET, "/sandboxes?metadata=i%3D2", Value::Null)
        .await;
    assert_eq!(r.json.as_array().unwrap().len(), 1);
    // bad input → 400 in the E2B shape
    for q in [
        "state=dead",
        "order=up",
        "limit=0",
        "limit=101",
        "limit=x",
        "nextToken=%%%",
        "nextToken=abc",
        "startedAfter=yesterday",
        "metadata=%zz",
        "metadata=novalue",
        "a=%E0%A4%A",
    ] {
        let r = h
            .a(Method::GET, &format!("/v2/sandboxes?{q}"), Value::Null)
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{q}: {}", r.json);
    }
}

#[tokio::test]
async fn idempotency_key_on_create() {
    let h = harness().await;
    let key = h.key_a.clone();
    let body = r#"{"templateID":"base","metadata":{"x":"1"}}"#;
    let send = |b: &'static str, k: &'static str| {
        let key = key.clone();
        let h = &h;
        async move {
            h.call_h(
                Method::POST,
                "/v2/sandboxes",
                Some(&key),
                Body::from(b),
                &[("idempotency-key", k)],
            )
            .await
        }
    };
    let r1 = send(body, "k-1").await;
    assert_eq!(r1.status, StatusCode::CREATED);
    // Same body (other whitespace / key order) → the same sandbox, 201 again.
    let r2 = send(r#"{ "metadata": {"x":"1"}, "templateID": "base" }"#, "k-1").await;
    assert_eq!(r2.status, StatusCode::CREATED);
    assert_eq!(r1.json["sandboxID"], r2.json["sandboxID"]);
    assert_eq!(r1.json["envdAccessToken"], r2.json["envdAccessToken"]);
    // Different body → 409.
    let r3 = send(r#"{"templateID":"tiny"}"#, "k-1").await;
    assert_eq!(r3.status, StatusCode::CONFLICT);
    // Another key → another sandbox; a bad key → 400.
    let r4 = send(body, "k-2").await;
    assert_ne!(r4.json["sandboxID"], r1.json["sandboxID"]);
    assert_eq!(send(body, "bad key!").await.status, StatusCode::BAD_REQUEST);
    assert_eq!(h.node.live.lock().unwrap().len(), 2);
    // A failed create releases the key.
    assert_eq!(
        send(r#"{"templateID":"nope"}"#, "k-3").await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(send(body, "k-3").await.status, StatusCode::CREATED);
}

/// The upkeep copies the logs the node says grew, and no other; one that grew while its
/// sandbox was paused is copied once it runs again.
#[tokio::test]
async fn the_upkeep_copies_the_logs_that_grew() {
    let h = harness().await;
    let (a, b) = (
        h.create_a(json!({"templateID":"base"})).await,
        h.create_a(json!({"templateID":"base"})).await,
    );
    let mirrored = |id: &str| {
        std::fs::read_to_string(h.dir.join("logs").join(format!("{id}.log"))).unwrap_or_default()
    };
    let write = |id: &str, line: &str| {
        let p = h.node.log_path(id);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .unwrap();
        std::io::Write::write_all(&mut f, format!("{line}\n").as_bytes()).unwrap();
    };
    let set_state = |id: &str, st: SandboxState| {
        h.node.live.lock().unwrap().get_mut(id).unwrap().state = st;
    };
    write(&a, "line of a");
    write(&b, "line of b");
    *h.node.grown.lock().unwrap() = Some(vec![b.clone()]);
    h.cp.upkeep(false).await;
    assert!(mirrored(&b).contains("line of b"), "{}", mirrored(&b));
    assert!(!mirrored(&a).contains("line of a"), "a's log did not grow");

    // a's log grows while a is paused: not copied then, copied once it runs again,
    // although the node no longer names it.
    set_state(&a, SandboxState::Paused);
    *h.node.grown.lock().unwrap() = Some(vec![a.clone()]);
    h.cp.upkeep(false).await;
    assert!(!mirrored(&a).contains("line of a"));
    set_state(&a, SandboxState::Running);
    *h.node.grown.lock().unwrap() = Some(vec![]);
    h.cp.upkeep(false).await;
    assert!(mirrored(&a).contains("line of a"), "{}", mirrored(&a));

    // A backend that cannot tell: every running sandbox's log.
    write(&a, "second of a");
    write(&b, "second of b");
    h.cp.upkeep(false).await;
    assert!(mirrored(&a).contains("second of a") && mirrored(&b).contains("second of b"));
}

#[tokio::test]
async fn deaths_noticed_by_the_node_are_recorded() {
    let h = harness().await;
    let id = h.create_a(json!({"templateID":"base"})).await;
    let id2 = h.create_a(json!({"templateID":"base"})).await;
    h.cp.upkeep(false).await; // mirrors logs while alive
    h.node.die(&id, DeathReason::Timeout);
    let _ = std::fs::remove_dir_all(h.node.dir.join(&id));
    h.cp.upkeep(true).await;
    assert_eq!(
        h.cp.store()
            .sandbox(&id)
            .unwrap()
            .unwrap()
            .death_reason
            .as_deref(),
        Some("timeout")
    );
    assert_eq!(
        h.a(Method::GET, &format!("/sandboxes/{id}"), Value::Null)
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    // Noticed lazily too (get before upkeep).
    h.node.die(&id2, DeathReason::Oom);
    assert_eq!(
        h.a(Method::GET, &format!("/sandboxes/{id2}"), Value::Null)
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        h.cp.store()
            .sandbox(&id2)
            .unwrap()
            .unwrap()
            .death_reason
            .as_deref(),
        Some("oom")
    );
    // The mirrored log is still there.
    let r = h
        .a(
            Method::GET,
            &format!("/v2/sandboxes/{id}/logs"),
            Value::Null,
        )
        .await;
    assert_eq!(r.json["logs"].as_array().unwrap().len(), 2, "{}", r.json);
}

#[tokio::test]
async fn logs_v2_filters() {
    let h = harness().await;
    let id = h.create_a(json!({"templateID":"base"})).await;
    let r = h
        .a(
            Method::GET,
            &format!("/v2/sandboxes/{id}/logs?level=warn"),
            Value::Null,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let logs = r.json["logs"].as_array().unwrap();
    assert_eq!(logs.len(), 1);
    assert_eq!(logs[0]["level"], "warn");
    assert!(logs[0]["fields"].is_object() && logs[0]["timestamp"].is_string());
    let r = h
        .a(
            Method::GET,
            &format!("/v2/sandboxes/{id}/logs?search=starting&direction=backward&limit=5"),
            Value::Null,
        )
        .await;
    assert_eq!(r.json["logs"][0]["message"], "envd starting");
    for q in ["level=loud", "direction=sideways", "limit=-1", "cursor=x"] {
        let r = h
            .a(
                Method::GET,
                &format!("/v2/sandboxes/{id}/logs?{q}"),
                Value::Null,
            )
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{q}");
    }
}

#[tokio::test]
async fn metrics_shapes() {
    let h = harness().await;
    let id = h.create_a(json!({"templateID":"base"})).await;
    // No sample yet: an empty list, and the batch route leaves the sandbox out.
    let r = h
        .a(
            Method::GET,
            &format!("/sandboxes/{id}/metrics"),
            Value::Null,
        )
        .await;
    assert_eq!((r.status, r.json.clone()), (StatusCode::OK, json!([])));
    h.cp.sample_metrics().await;
    // Sampled once per step: a second pass right away takes nothing.
    h.cp.sample_metrics().await;
    let r = h
        .a(
            Method::GET,
            &format!("/sandboxes/{id}/metrics"),
            Value::Null,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let m = &r.json[0];
    for k in [
        "timestamp",
        "timestampUnix",
        "cpuCount",
        "cpuUsedPct",
        "memUsed",
        "memTotal",
        "memCache",
        "diskUsed",
        "diskTotal",
    ] {
        assert!(!m[k].is_null(), "{k}: {m}");
    }
    assert_eq!(r.json.as_array().unwrap().len(), 1, "{}", r.json);
    assert_eq!(m["memUsed"], 10 << 20);
    assert_eq!(m["memTotal"], 512u64 << 20);
    assert_eq!(m["diskUsed"], 4096);
    let t = m["timestampUnix"].as_i64().unwrap();
    for (q, n) in [
        (format!("start={t}&end={t}"), 1),
        (format!("start={t}"), 1),
        (format!("end={}", t - 1), 0),
        ("start=0&end=1000".to_string(), 0),
        (format!("start={}", t + 1), 0),
    ] {
        let r = h
            .a(
                Method::GET,
                &format!("/sandboxes/{id}/metrics?{q}"),
                Value::Null,
            )
            .await;
        assert_eq!(r.status, StatusCode::OK, "{q}");
        assert_eq!(r.json.as_array().unwrap().len(), n, "{q}: {}", r.json);
    }
    let r = h
        .a(
            Method::GET,
            &format!("/sandboxes/metrics?sandbox_ids={id}&end={}", t - 1),
            Value::Null,
        )
        .await;
    assert_eq!(
        r.json,
        json!({"sandboxes": {}}),
        "a range before the sample"
    );
    let r = h
        .a(
            Method::GET,
            &format!("/sandboxes/metrics?sandbox_ids={id},inope"),
            Value::Null,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.json["sandboxes"][&id].is_object());
    assert!(r.json["sandboxes"]["inope"].is_null());
    assert_eq!(
        h.a(Method::GET, "/sandboxes/metrics", Value::Null)
            .await
            .status,
        StatusCode::BAD_REQUEST
    );
    // start after end: an empty range, not an error (the OpenAPI description cannot
    // express a relation between two parameters, so the server must not refuse it).
    let r = h
        .a(
            Method::GET,
            &format!("/sandboxes/{id}/metrics?start=10&end=5"),
            Value::Null,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json, json!([]));
}

#[tokio::test]
async fn unsupported_features_answer_clearly() {
    let h = harness().await;
    let id = h.create_a(json!({"templateID":"base"})).await;
    // (The fake node has no checkpoints: pause, snapshots and fork say so, as a node
    // without CRIU does.)
    for (m, p) in [
        (Method::POST, format!("/sandboxes/{id}/pause")),
        (Method::POST, format!("/sandboxes/{id}/snapshots")),
        (Method::POST, format!("/sandboxes/{id}/fork")),
    ] {
        let r = h.a(m, &p, json!({})).await;
        assert_eq!(r.status, StatusCode::NOT_IMPLEMENTED, "{p}");
        let message = r.json["message"].as_str().unwrap();
        assert!(message.contains("not supported"), "{p}: {message}");
        assert_eq!(r.headers.get("should-retry").unwrap(), "false");
    }
}

#[tokio::test]
async fn network_policy_is_echoed_and_replaced() {
    let h = harness().await;
    // A junk caCert is refused by name before anything is created.
    let r = h
        .a(
            Method::POST,
            "/v2/sandboxes",
            json!({"templateID":"base","network":{"egressProxy":{"address":"p:1","tls":{"enabled":true,"caCert":"x"}}}}),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(
        r.json["message"]
            .as_str()
            .unwrap()
            .contains("Invalid egress proxy config"),
        "{}",
        r.json
    );
    let id = h
        .create_a(json!({"templateID":"base","network":{
            "allowOut":["1.2.3.4","*.ok.test"],"denyOut":["0.0.0.0/0"],"dnsServers":["9.9.9.9"],
            "egressProxy":{"address":"198.51.100.9:1080","username":"u","password":"secret","tls":{"enabled":true,"serverName":"p"}},
            "maskRequestHost":"${PORT}-x.test","rules":{"api.ok.test":[{}]}}}))
        .await;
    let d = h
        .a(Method::GET, &format!("/sandboxes/{id}"), Value::Null)
        .await;
    let n = &d.json["network"];
    assert_eq!(n["allowOut"], json!(["1.2.3.4", "*.ok.test"]), "{n}");
    assert_eq!(n["denyOut"], json!(["0.0.0.0/0"]));
    assert_eq!(n["dnsServers"], json!(["9.9.9.9"]));
    assert_eq!(
        n["egressProxy"],
        json!({"address":"198.51.100.9:1080","username":"u","tls":{"enabled":true,"serverName":"p"}})
    );
    assert_eq!(n["maskRequestHost"], "${PORT}-x.test");
    assert_eq!(n["rules"], json!({"api.ok.test":[{}]}));
    assert_eq!(d.json["allowInternetAccess"], false);
    assert!(
        !d.json.to_string().contains("secret"),
        "the proxy password is never returned"
    );
    // Replace: fields left out are cleared.
    let p = format!("/sandboxes/{id}/network");
    let r = h
        .a(
            Method::PUT,
            &p,
            json!({"allowOut":["5.6.7.8"],"allow_internet_access":false}),
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "{}", r.json);
    let n = h
        .a(Method::GET, &format!("/sandboxes/{id}"), Value::Null)
        .await
        .json["network"]
        .clone();
    assert_eq!(n["allowOut"], json!(["5.6.7.8"]));
    assert_eq!(n["denyOut"], json!(["0.0.0.0/0"]));
    assert!(n.get("dnsServers").is_none() && n.get("egressProxy").is_none());
    // Bad updates name the option.
    for (body, needle) in [
        (json!({"allowOut":["x.test"]}), "ALL_TRAFFIC"),
        (json!({"denyOut":["x.test"]}), "network.denyOut"),
        (
            json!({"rules":{"a.test":[{"transform":{"headers":{"A":"${e2b.secrets.k}"}}}]}}),
            "network.rules",
        ),
    ] {
        let r = h.a(Method::PUT, &p, body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST);
        assert!(
            r.json["message"].as_str().unwrap().contains(needle),
            "{}",
            r.json
        );
    }
    // Header rules naming an existing secret are accepted and echoed as given (the
    // placeholder, never the value); another team's secret of that name does not count.
    let r = h
        .a(
            Method::POST,
            "/secrets",
            json!({"name":"K","value":"s3cr3t-in-store"}),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    let rules =
        json!({"a.test":[{"transform":{"headers":{"Authorization":"Bearer ${e2b.secrets.k}"}}}]});
    let r = h.a(Method::PUT, &p, json!({"rules": rules})).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "{}", r.json);
    let d = h
        .a(Method::GET, &format!("/sandboxes/{id}"), Value::Null)
        .await;
    assert_eq!(d.json["network"]["rules"], rules);
    assert!(!d.json.to_string().contains("s3cr3t-in-store"));
    // Another team cannot touch it.
    let kb = h.key_b.clone();
    let r = h.call(Method::PUT, &p, Some(&kb), Body::from("{}")).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn unknown_routes_methods_and_garbage_are_json_4xx() {
    let h = harness().await;
    let id = h.create_a(json!({"templateID":"base"})).await;
    let r = h.a(Method::GET, "/nope", Value::Null).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = h.call(Method::GET, "/nope", None, Body::empty()).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = h.a(Method::PUT, "/v2/sandboxes", Value::Null).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    let r = h
        .a(Method::PATCH, &format!("/sandboxes/{id}"), Value::Null)
        .await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    // Fuzz-ish: every route × garbage bodies and paths: always a JSON 4xx/2xx, never 5xx.
    let bodies: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"null".to_vec(),
        b"[]".to_vec(),
        b"{\"timeout\":null}".to_vec(),
        b"{\"timeout\":1e400}".to_vec(),
        b"{\"templateID\":{\"a\":1}}".to_vec(),
        b"{\"templateID\":\"base\",\"network\":[]}".to_vec(),
        vec![0xff, 0xfe, 0x00],
        b"{\"duration\":-9223372036854775808}".to_vec(),
        "{\"templateID\":\"\u{0}\"}".as_bytes().to_vec(),
    ];
    let paths = [
        (Method::POST, "/v2/sandboxes".to_string()),
        (Method::POST, "/sandboxes".to_string()),
        (Method::POST, format!("/sandboxes/{id}/timeout")),
        (Method::POST, format!("/sandboxes/{id}/refreshes")),
        (Method::POST, format!("/v2/sandboxes/{id}/connect")),
        (Method::POST, format!("/sandboxes/{id}/connect")),
        (Method::POST, "/sandboxes/%ff%fe/timeout".to_string()),
        (Method::GET, "/sandboxes/%zz".to_string()),
        (
            Method::GET,
            "/v2/sandboxes?limit=99999999999999999999999".to_string(),
        ),
    ];
    let key = h.key_a.clone();
    for (m, p) in &paths {
        for b in &bodies {
            let r = h
                .call(m.clone(), p, Some(&key), Body::from(b.clone()))
                .await;
            assert!(
                r.status.is_success() || r.status.is_client_error(),
                "{m} {p} {:?} → {}",
                String::from_utf8_lossy(b),
                r.status
            );
        }
    }
}

#[tokio::test]
async fn resolver_sees_live_api_sandboxes_only() {
    let h = harness().await;
    let id = h
        .create_a(json!({"templateID":"base","network":{"allowPublicTraffic":false}}))
        .await;
    let open = h.create_a(json!({"templateID":"base"})).await;
    let resolver = ApiResolver::new(h.cp.clone());
    let t = resolver.resolve(&id).unwrap();
    assert!(
        t.init_pidfd.is_none(),
        "the fake backend has no init process"
    );
    assert!(t.envd_socket.ends_with(format!("{id}/ctl/envd.sock")));
    let row = h.cp.store().sandbox(&id).unwrap().unwrap();
    let info = h.cp.backend().peek(&id).unwrap();
    assert_eq!(
        t.envd_access_token.as_deref(),
        Some(info.access_token.as_str())
    );
    assert!(t.traffic_access_token.is_some());
    assert_eq!(t.traffic_access_token, row.traffic_access_token);
    assert!(
        resolver
            .resolve(&open)
            .unwrap()
            .traffic_access_token
            .is_none()
    );
    assert!(resolver.resolve("inope").is_none());
    assert_eq!(resolver.running().len(), 2);
    let r = h
        .a(Method::GET, &format!("/sandboxes/{id}"), Value::Null)
        .await;
    assert_eq!(r.json["network"]["allowPublicTraffic"], false);
    h.a(Method::DELETE, &format!("/sandboxes/{id}"), Value::Null)
        .await;
    assert!(resolver.resolve(&id).is_none());
    assert_eq!(resolver.running().len(), 1);
}

#[tokio::test]
async fn reopening_adopts_live_and_records_lost_sandboxes() {
    let h = harness().await;
    let alive = h.create_a(json!({"templateID":"base"})).await;
    let lost = h.create_a(json!({"templateID":"base"})).await;
    h.node.live.lock().unwrap().remove(&lost); // vanished while the server was down
    let cp2 = ControlPlane::open(h.node.clone(), h.cp.store().clone(), h.cp.config().clone())
        .await
        .unwrap();
    assert!(cp2.route(&alive).is_some());
    assert!(cp2.route(&lost).is_none());
    assert_eq!(
        h.cp.store()
            .sandbox(&lost)
            .unwrap()
            .unwrap()
            .death_reason
            .as_deref(),
        Some("lost")
    );
}

impl Harness {
    /// A content-API request with a bearer token (`None`: no Authorization header).
    async fn content(&self, method: Method, uri: &str, token: Option<&str>, body: Body) -> Reply {
        let mut req = Request::builder().method(method).uri(uri);
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let resp = self
            .app
            .clone()
            .oneshot(req.body(body).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 24)
            .await
            .unwrap();
        let json = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        if status.as_u16() >= 400 {
            // The content API's error shape: `code` is a string.
            assert_eq!(json["code"], status.as_u16().to_string(), "{uri}: {json}");
            assert!(json["message"].is_string(), "{uri}: {json}");
        }
        Reply {
            status,
            headers,
            json,
        }
    }
}

#[tokio::test]
async fn volumes_control_routes() {
    let h = harness().await;
    let r = h.a(Method::POST, "/volumes", json!({"name": "data"})).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    let id = r.json["volumeID"].as_str().unwrap().to_string();
    assert_eq!(r.json["name"], "data");
    assert!(r.json["token"].as_str().unwrap().starts_with("cvt_"));
    assert!(r.json["domain"].is_null());
    // The same name again: 400 (upstream's answer); a bad name: 400.
    let r = h.a(Method::POST, "/volumes", json!({"name": "data"})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(
        r.json["message"]
            .as_str()
            .unwrap()
            .contains("already exists")
    );
    for bad in [
        json!({"name": "a b"}),
        json!({"name": ""}),
        json!({}),
        json!({"name": "x", "sizeMB": 1}),
    ] {
        let r = h.a(Method::POST, "/volumes", bad.clone()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}");
    }
    let r = h.a(Method::GET, "/volumes", Value::Null).await;
    assert_eq!(r.json, json!([{"volumeID": id, "name": "data"}]));
    let r = h
        .a(Method::GET, &format!("/volumes/{id}"), Value::Null)
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json["token"], h.cp.config().keyring.volume_token(&id));
    assert_eq!(r.json["usedBytes"], 4096);
    // Another team sees nothing; a malformed id is a 400.
    let kb = h.key_b.clone();
    let r = h
        .call(
            Method::GET,
            &format!("/volumes/{id}"),
            Some(&kb),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = h
        .call(Method::GET, "/volumes", Some(&kb), Body::empty())
        .await;
    assert_eq!(r.json, json!([]));
    let r = h
        .call(
            Method::DELETE,
            &format!("/volumes/{id}"),
            Some(&kb),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = h.a(Method::GET, "/volumes/not-a-uuid", Value::Null).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    // Team b may use the same name.
    let r = h
        .call(
            Method::POST,
            "/volumes",
            Some(&kb),
            Body::from(r#"{"name":"data"}"#),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);

    // Mounted by name; echoed; in use → 409; unknown name → 404; bad path → 400.
    let sid = h
        .create_a(
            json!({"templateID": "base", "volumeMounts": [{"name": "data", "path": "/mnt/data"}]}),
        )
        .await;
    let d = h
        .a(Method::GET, &format!("/sandboxes/{sid}"), Value::Null)
        .await;
    assert_eq!(
        d.json["volumeMounts"],
        json!([{"name": "data", "path": "/mnt/data"}])
    );
    let l = h.a(Method::GET, "/v2/sandboxes", Value::Null).await;
    assert_eq!(
        l.json[0]["volumeMounts"],
        json!([{"name": "data", "path": "/mnt/data"}])
    );
    for (mounts, status, needle) in [
        (
            json!([{"name": "nope", "path": "/mnt/x"}]),
            StatusCode::NOT_FOUND,
            "not found",
        ),
        (
            json!([{"name": "data", "path": "relative"}]),
            StatusCode::BAD_REQUEST,
            "absolute",
        ),
        (
            json!([{"name": "data", "path": "/mnt/a"}, {"name": "data", "path": "/mnt/a"}]),
            StatusCode::BAD_REQUEST,
            "twice",
        ),
        (
            json!([{"name": "data", "path": "/proc/x"}]),
            StatusCode::BAD_REQUEST,
            "/proc",
        ),
    ] {
        let r = h
            .a(
                Method::POST,
                "/v2/sandboxes",
                json!({"templateID": "base", "volumeMounts": mounts}),
            )
            .await;
        assert_eq!(r.status, status, "{mounts}: {}", r.json);
        assert!(
            r.json["message"].as_str().unwrap().contains(needle),
            "{}",
            r.json
        );
    }
    let r = h
        .a(Method::DELETE, &format!("/volumes/{id}"), Value::Null)
        .await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.json);
    assert!(r.json["message"].as_str().unwrap().contains(&sid));
    let r = h
        .a(Method::DELETE, &format!("/sandboxes/{sid}"), Value::Null)
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = h
        .a(Method::DELETE, &format!("/volumes/{id}"), Value::Null)
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = h
        .a(Method::DELETE, &format!("/volumes/{id}"), Value::Null)
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn volume_content_routes() {
    let h = harness().await;
    let r = h
        .a(Method::POST, "/volumes", json!({"name": "files"}))
        .await;
    let id = r.json["volumeID"].as_str().unwrap().to_string();
    let token = r.json["token"].as_str().unwrap().to_string();
    let t = Some(token.as_str());
    let base = format!("/volumecontent/{id}");
    // Auth: none, wrong, another volume's.
    let r = h
        .content(
            Method::GET,
            &format!("{base}/dir?path=/"),
            None,
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = h
        .content(
            Method::GET,
            &format!("{base}/dir?path=/"),
            Some("cvt_nope"),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let other =
        h.cp.config()
            .keyring
            .volume_token("0b5c9e1e-6a1c-4a7e-9d55-0a3f1c2b7e11");
    let r = h
        .content(
            Method::GET,
            &format!("{base}/dir?path=/"),
            Some(&other),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    // An API key is not a volume token.
    let ka = h.key_a.clone();
    let r = h
        .content(
            Method::GET,
            &format!("{base}/dir?path=/"),
            Some(&ka),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);

    let r = h
        .content(
            Method::POST,
            &format!("{base}/dir?path=%2Fd%2Fe&uid=1000&gid=1000&mode=493&force=true"),
            t,
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    assert_eq!(
        (
            r.json["type"].as_str(),
            r.json["path"].as_str(),
            r.json["mode"].as_u64()
        ),
        (Some("directory"), Some("/d/e"), Some(493))
    );
    assert_eq!(
        (r.json["uid"].as_u64(), r.json["gid"].as_u64()),
        (Some(1000), Some(1000))
    );
    assert!(r.json["mtime"].as_str().unwrap().ends_with('Z'));
    let r = h
        .content(
            Method::POST,
            &format!("{base}/dir?path=/x/y"),
            t,
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = h
        .content(
            Method::POST,
            &format!("{base}/dir?path=/d"),
            t,
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    let r = h
        .content(
            Method::PUT,
            &format!("{base}/file?path=%2Fd%2Fe%2Ff.txt&mode=420"),
            t,
            Body::from("hello volume"),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    assert_eq!(
        (
            r.json["size"].as_u64(),
            r.json["name"].as_str(),
            r.json["uid"].as_u64()
        ),
        (Some(12), Some("f.txt"), Some(1000))
    );
    let r = h
        .content(
            Method::GET,
            &format!("{base}/file?path=/d/e/f.txt"),
            t,
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json, Value::String("hello volume".into()));
    assert_eq!(r.headers["content-length"], "12");
    // overwrite; parents with force; missing parent without
    let r = h
        .content(
            Method::PUT,
            &format!("{base}/file?path=/d/e/f.txt"),
            t,
            Body::from("v2"),
        )
        .await;
    assert_eq!(
        (r.status, r.json["size"].as_u64()),
        (StatusCode::CREATED, Some(2))
    );
    let r = h
        .content(
            Method::PUT,
            &format!("{base}/file?path=/n/m/g"),
            t,
            Body::from("x"),
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = h
        .content(
            Method::PUT,
            &format!("{base}/file?path=/n/m/g&force=true"),
            t,
            Body::from("x"),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let r = h
        .content(Method::GET, &format!("{base}/dir?path=/"), t, Body::empty())
        .await;
    let paths: Vec<&str> = r
        .json
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    assert_eq!(paths, ["/d", "/n"]);
    let r = h
        .content(
            Method::GET,
            &format!("{base}/dir?path=/&depth=3"),
            t,
            Body::empty(),
        )
        .await;
    assert_eq!(r.json.as_array().unwrap().len(), 6, "{}", r.json);
    let r = h
        .content(
            Method::GET,
            &format!("{base}/path?path=/d/e/f.txt"),
            t,
            Body::empty(),
        )
        .await;
    assert_eq!(r.json["type"], "file");
    let r = h
        .content(
            Method::PATCH,
            &format!("{base}/path?path=/d/e/f.txt"),
            t,
            Body::from(r#"{"mode":384,"uid":0}"#),
        )
        .await;
    assert_eq!(
        (r.status, r.json["mode"].as_u64(), r.json["uid"].as_u64()),
        (StatusCode::OK, Some(384), Some(0))
    );
    let r = h
        .content(
            Method::PATCH,
            &format!("{base}/path?path=/d/e/f.txt"),
            t,
            Body::from(r#"{"uid":70000}"#),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = h
        .content(
            Method::GET,
            &format!("{base}/path?path=/nope"),
            t,
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = h
        .content(Method::GET, &format!("{base}/path"), t, Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = h
        .content(
            Method::GET,
            &format!("{base}/file?path=/../../etc/passwd"),
            t,
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = h
        .content(
            Method::DELETE,
            &format!("{base}/path?path=/d"),
            t,
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = h
        .content(
            Method::DELETE,
            &format!("{base}/path?path=/d"),
            t,
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = h
        .content(
            Method::DELETE,
            &format!("{base}/path?path=/"),
            t,
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    // A deleted volume's token opens nothing.
    let r = h
        .a(Method::DELETE, &format!("/volumes/{id}"), Value::Null)
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = h
        .content(Method::GET, &format!("{base}/dir?path=/"), t, Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

// ---- operators: OpenAPI, metrics, lifecycle events and webhooks ----

/// Every path and method the description names is served (not the unknown-route 404,
/// not a 405), the public ones without a key; and the description carries the limits.
#[tokio::test]
async fn openapi_describes_what_is_served() {
    let h = harness().await;
    let id = h.create_a(json!({"templateID":"base"})).await;
    let r = h
        .call(Method::GET, "/openapi.json", None, Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let spec = r.json;
    assert_eq!(spec["openapi"].as_str().map(|v| &v[..2]), Some("3."));
    let paths = spec["paths"].as_object().unwrap();
    for want in [
        "/v2/sandboxes",
        "/sandboxes/{id}",
        "/sandboxes/{id}/timeout",
        "/v2/sandboxes/{id}/connect",
        "/events/sandboxes",
        "/events/webhooks/{webhookID}",
        "/metrics",
        "/health",
        "/cubicle/pool",
        "/templates",
        "/templates/{id}",
        "/templates/{id}/tags",
        "/default-templates",
    ] {
        assert!(paths.contains_key(want), "{want} not described");
    }
    for want in [
        "/sandboxes/{id}/pause",
        "/sandboxes/{id}/resume",
        "/sandboxes/{id}/snapshots",
        "/sandboxes/{id}/fork",
        "/sandboxes/{id}/rollback",
        "/volumes",
        "/volumes/{volumeID}",
        "/volumecontent/{volumeID}/file",
        "/secrets",
        "/secrets/{s}",
    ] {
        assert!(paths.contains_key(want), "{want} not described");
    }
    assert_eq!(
        spec["components"]["schemas"]["ForkBody"]["properties"]["timeout"]["maximum"], 3600,
        "the server's --max-timeout"
    );
    assert_eq!(
        spec["components"]["schemas"]["NewSandbox"]["properties"]["timeout"]["maximum"], 3600,
        "the server's --max-timeout"
    );
    // Bodies the server validates are described with its rules, not as free strings.
    let schemas = &spec["components"]["schemas"];
    let mounts = &schemas["NewSandbox"]["properties"]["volumeMounts"];
    assert_eq!(
        mounts["items"]["required"],
        json!(["name", "path"]),
        "{mounts}"
    );
    assert_eq!(mounts["maxItems"], 8, "{mounts}");
    // `network` (SandboxNetwork) flattens the egress fields (EgressBody, also the body
    // of PUT /sandboxes/{id}/network).
    let net = &schemas["SandboxNetwork"];
    let egress = &schemas["EgressBody"]["properties"];
    for field in ["allowOut", "denyOut", "dnsServers"] {
        assert!(
            egress[field]["items"]["pattern"].is_string(),
            "{field}: {}",
            egress[field]
        );
    }
    assert_eq!(egress["rules"]["maxProperties"], 10);
    assert_eq!(egress["egressProxy"]["type"], "null");
    let own = net["allOf"]
        .as_array()
        .and_then(|all| all.iter().find(|s| s["properties"].is_object()))
        .map_or(&net["properties"], |s| &s["properties"]);
    assert!(own["maskRequestHost"]["pattern"].is_string(), "{net}");
    assert_eq!(own["httpsPorts"]["maxItems"], 0, "{net}");
    let mut n = 0;
    for (path, ops) in paths {
        for (method, op) in ops.as_object().unwrap() {
            let Ok(m) = method.to_uppercase().parse::<Method>() else {
                continue;
            };
            let uri = path
                .replace("{id}", &id)
                .replace("{webhookID}", "nope")
                .replace("{s}", "nope")
                .replace("{volumeID}", "00000000-0000-4000-8000-000000000000");
            let uri = if path == "/sandboxes/metrics" {
                format!("{uri}?sandbox_ids={id}")
            } else {
                uri
            };
            let public = op["security"] == json!([{}]);
            let key = h.key_a.clone();
            let resp = h
                .app
                .clone()
                .oneshot(
                    Request::builder()
                        .method(m.clone())
                        .uri(&uri)
                        .header("x-api-key", key)
                        .body(Body::empty())
                        .unwrap(),
                )
                .await
                .unwrap();
            let status = resp.status();
            let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
                .await
                .unwrap();
            let text = String::from_utf8_lossy(&body);
            assert!(
                !text.contains("no such route") && status != StatusCode::METHOD_NOT_ALLOWED,
                "{method} {path}: {status} {text}"
            );
            if public && path.contains("{token}") {
                // The token in the path is the permission (a template build's upload):
                // without a key, an unknown one is 404, not 401.
                let r = h.call(m, &uri, None, Body::empty()).await;
                assert_eq!(
                    r.status,
                    StatusCode::NOT_FOUND,
                    "{method} {path} without a key"
                );
            } else if public {
                let r = h.call(m, &uri, None, Body::empty()).await;
                assert!(
                    r.status.is_success(),
                    "{method} {path} without a key: {}",
                    r.status
                );
            }
            n += 1;
        }
    }
    assert!(n >= 20, "{n} operations");
    // Operation ids are unique (links name operations by id: a second `detail` made
    // schemathesis follow the create's GetSandbox link to a volume).
    let mut ids = std::collections::BTreeSet::new();
    for op in paths
        .values()
        .flat_map(|ops| ops.as_object().unwrap().values())
    {
        if let Some(id) = op["operationId"].as_str() {
            assert!(ids.insert(id.to_string()), "operationId {id} twice");
        }
    }
    assert!(ids.len() >= n, "{} ids for {n} operations", ids.len());
}

/// Every route the server serves is in the description, so that it cannot drift again:
/// a route registered with `routes!(handler)` is described by construction (the handler
/// needs its `#[utoipa::path]`), so what must not exist is a plain axum `.route("…")`
/// in this crate other than the web dashboard's static files, which are not API (and
/// the node-side API of a cluster, `cluster/`, served on `cubicle node`'s own listener).
/// `openapi_describes_what_is_served` checks the other direction (every described
/// operation is routed).
#[test]
fn openapi_covers_every_served_route() {
    const NOT_API: &[&str] = &["/", "/dashboard", "/dashboard/", "/dashboard/{*path}"];
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src");
    let mut files = vec![PathBuf::from(dir)];
    let mut plain = Vec::new();
    let mut scanned = 0;
    while let Some(p) = files.pop() {
        // The node-side API of a cluster (`cluster/`) is served by `cubicle node` on its
        // own listener to API replicas only: not part of the API this describes.
        if p.ends_with("cluster") {
            continue;
        }
        if p.is_dir() {
            files.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
            continue;
        }
        if p.extension().is_none_or(|e| e != "rs") || p.ends_with("tests.rs") {
            continue;
        }
        scanned += 1;
        let text = std::fs::read_to_string(&p).unwrap();
        for (at, _) in text.match_indices(".route(") {
            let rest = text[at + ".route(".len()..].trim_start();
            // `.route(id)` on the control plane is a method, not axum's.
            let Some(lit) = rest.strip_prefix('"') else {
                continue;
            };
            let path = &lit[..lit.find('"').unwrap()];
            plain.push((p.display().to_string(), path.to_string()));
        }
        for needle in [".nest(", ".route_service(", ".nest_service("] {
            assert!(
                !text.contains(needle),
                "{}: {needle} adds routes the description cannot see",
                p.display()
            );
        }
    }
    assert!(scanned > 10, "{scanned} files");
    let undescribed: Vec<_> = plain
        .iter()
        .filter(|(_, path)| !NOT_API.contains(&path.as_str()))
        .collect();
    assert!(
        undescribed.is_empty(),
        "routes served but not in /openapi.json (register them with routes!(handler) and a \
         #[utoipa::path]): {undescribed:?}"
    );
    assert_eq!(
        plain.len(),
        NOT_API.len(),
        "the dashboard's routes: {plain:?}"
    );
}

/// Raw GET (for non-JSON answers).
async fn get_text(h: &Harness, uri: &str, headers: &[(&str, &str)]) -> (StatusCode, String) {
    let mut req = Request::builder().method(Method::GET).uri(uri);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = h
        .app
        .clone()
        .oneshot(req.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let body = axum::body::to_bytes(resp.into_body(), 1 << 24)
        .await
        .unwrap();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn metrics_are_for_the_admin_team() {
    let h = harness().await;
    let admin = h.cp.store().ensure_team(crate::ADMIN_TEAM).unwrap();
    let admin_key = h.cp.store().create_api_key(admin.id).unwrap().plaintext;
    let id = h.create_a(json!({"templateID":"base"})).await;
    h.cp.sample_metrics().await;
    assert_eq!(
        get_text(&h, "/metrics", &[]).await.0,
        StatusCode::UNAUTHORIZED
    );
    let (st, body) = get_text(&h, "/metrics", &[("x-api-key", &h.key_a)]).await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{body}");
    let bearer = format!("Bearer {admin_key}");
    let (st, text) = get_text(&h, "/metrics", &[("authorization", &bearer)]).await;
    assert_eq!(st, StatusCode::OK, "{text}");
    for want in [
        r#"cubicle_sandboxes{state="running",template="base"} 1"#,
        r#"cubicle_sandbox_create_duration_seconds_count{source="cold"} 1"#,
        r#"cubicle_sandbox_lifecycle_events_total{type="sandbox.lifecycle.created"} 1"#,
        &format!(r#"cubicle_sandbox_memory_bytes{{sandbox_id="{id}",template="base"}} 10485760"#),
        "cubicle_pool_claims_total 3",
        "# EOF",
    ] {
        assert!(text.contains(want), "missing {want} in\n{text}");
    }
    let (st, _) = get_text(&h, "/metrics", &[("x-api-key", &admin_key)]).await;
    assert_eq!(st, StatusCode::OK);
}

/// What a webhook receiver saw.
#[derive(Clone, Debug)]
struct Delivery {
    headers: axum::http::HeaderMap,
    body: String,
}

/// A receiver on 127.0.0.1 that answers 500 to the first `fail_first` deliveries.
async fn receiver(fail_first: usize) -> (String, Arc<Mutex<Vec<Delivery>>>) {
    let seen: Arc<Mutex<Vec<Delivery>>> = Arc::default();
    let s2 = seen.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |headers: axum::http::HeaderMap, body: String| {
            let seen = s2.clone();
            async move {
                let mut v = seen.lock().unwrap();
                v.push(Delivery { headers, body });
                if v.len() <= fail_first {
                    StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    StatusCode::NO_CONTENT
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/hook"), seen)
}

async fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    for _ in 0..200 {
        if let Some(v) = f() {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out waiting for {what}")
}

#[tokio::test]
async fn lifecycle_events_and_signed_webhooks() {
    let h = harness_with(|c| {
        c.webhooks.retry_interval = Duration::from_millis(50);
        c.webhooks.timeout = Duration::from_secs(2);
    })
    .await;
    let (url, seen) = receiver(1).await;
    let r = h
        .a(
            Method::POST,
            "/events/webhooks",
            json!({"name": "hook", "url": url, "events": [
                "sandbox.lifecycle.created", "sandbox.lifecycle.updated", "sandbox.lifecycle.killed"],
                "signatureSecret": "s3cret"}),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    let hook = r.json.clone();
    assert_eq!(hook["enabled"], true);
    assert_eq!(hook["teamId"], "a");
    assert!(
        hook.get("signatureSecret").is_none(),
        "the secret is never shown"
    );
    let hook_id = hook["id"].as_str().unwrap().to_string();

    let id = h
        .create_a(json!({"templateID":"base","metadata":{"who":"test"}}))
        .await;
    let r = h
        .a(
            Method::POST,
            &format!("/sandboxes/{id}/timeout"),
            json!({"timeout": 120}),
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = h
        .a(Method::DELETE, &format!("/sandboxes/{id}"), Value::Null)
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);

    // Deliveries: the first attempt fails (500) and is retried with a new delivery id.
    let got = wait_for("4 deliveries", || {
        let v = seen.lock().unwrap().clone();
        (v.len() >= 4).then_some(v)
    })
    .await;
    let mut by_event: Vec<(String, Vec<&Delivery>)> = Vec::new();
    for d in &got {
        let sig = d.headers["e2b-signature"].to_str().unwrap();
        assert_eq!(sig, crate::webhooks::signature("s3cret", d.body.as_bytes()));
        assert_eq!(d.headers["e2b-signature-version"], "v1");
        assert_eq!(d.headers["e2b-webhook-id"], hook_id.as_str());
        let ev: Value = serde_json::from_str(&d.body).unwrap();
        assert_eq!(ev["sandboxId"], id.as_str());
        assert_eq!(ev["sandboxTeamId"], "a");
        assert_eq!(ev["version"], "v1");
        let key = format!(
            "{} {}",
            ev["timestamp"].as_str().unwrap(),
            ev["type"].as_str().unwrap()
        );
        match by_event.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(d),
            None => by_event.push((key, vec![d])),
        }
    }
    // Deliveries of different events run side by side (a failing one does not hold
    // up the others): compare by the events' time.
    // (Same millisecond: the lifecycle's own order.)
    let rank = |k: &str| {
        ["created", "updated", "killed"]
            .iter()
            .position(|t| k.ends_with(t))
    };
    by_event.sort_by(|a, b| (&a.0[..24], rank(&a.0)).cmp(&(&b.0[..24], rank(&b.0))));
    let types: Vec<&str> = by_event
        .iter()
        .map(|(k, _)| k.split(' ').nth(1).unwrap())
        .collect();
    assert_eq!(
        types,
        [
            "sandbox.lifecycle.created",
            "sandbox.lifecycle.updated",
            "sandbox.lifecycle.killed"
        ]
    );
    let created = &by_event[0].1;
    assert_eq!(
        created.len(),
        2,
        "the failed first attempt was retried once"
    );
    assert_eq!(
        created[0].body, created[1].body,
        "a retry sends the same event"
    );
    assert_ne!(
        created[0].headers["e2b-delivery-id"], created[1].headers["e2b-delivery-id"],
        "each attempt has its own delivery id"
    );

    // The events API: oldest first with orderAsc, filters, paging, team isolation.
    let r = h
        .a(
            Method::GET,
            &format!("/events/sandboxes/{id}?orderAsc=true"),
            Value::Null,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let evs = r.json.as_array().unwrap();
    assert_eq!(evs.len(), 3, "{}", r.json);
    assert_eq!(evs[0]["eventData"]["sandbox_metadata"]["who"], "test");
    assert!(evs[1]["eventData"]["set_timeout"].is_string());
    assert_eq!(evs[2]["eventData"]["death_reason"], "killed");
    assert_eq!(evs[2]["eventData"]["execution"]["vcpu_count"], 2);
    let r = h
        .a(
            Method::GET,
            "/events/sandboxes?types=sandbox.lifecycle.killed&limit=1",
            Value::Null,
        )
        .await;
    assert_eq!(r.json.as_array().unwrap().len(), 1);
    assert_eq!(r.json[0]["type"], "sandbox.lifecycle.killed");
    let key_b = h.key_b.clone();
    let r = h
        .call(
            Method::GET,
            "/events/sandboxes",
            Some(&key_b),
            Body::empty(),
        )
        .await;
    assert_eq!(r.json, json!([]), "team b sees none of a's events");
    let r = h
        .call(
            Method::GET,
            &format!("/events/webhooks/{hook_id}"),
            Some(&key_b),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    for bad in [
        "limit=0",
        "limit=101",
        "orderAsc=yes",
        "types=sandbox.lifecycle.nope",
        "offset=-1",
    ] {
        let r = h
            .a(
                Method::GET,
                &format!("/events/sandboxes?{bad}"),
                Value::Null,
            )
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}");
    }

    // Disabled: nothing more is delivered; deleted: gone.
    let r = h
        .a(
            Method::PATCH,
            &format!("/events/webhooks/{hook_id}"),
            json!({"enabled": false}),
        )
        .await;
    assert_eq!(
        (r.status, &r.json["enabled"]),
        (StatusCode::OK, &json!(false))
    );
    let before = seen.lock().unwrap().len();
    let id2 = h.create_a(json!({"templateID":"base"})).await;
    let _ = wait_for("the created event", || {
        h.cp.store()
            .events(&cubicle_store::EventQuery {
                team_id: 1,
                sandbox_id: Some(id2.clone()),
                limit: 10,
                ..Default::default()
            })
            .ok()
            .filter(|e| !e.is_empty())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        seen.lock().unwrap().len(),
        before,
        "a disabled webhook gets nothing"
    );
    let r = h.a(Method::GET, "/events/webhooks", Value::Null).await;
    assert_eq!(r.json.as_array().unwrap().len(), 1);
    let r = h
        .a(
            Method::DELETE,
            &format!("/events/webhooks/{hook_id}"),
            Value::Null,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = h
        .a(
            Method::GET,
            &format!("/events/webhooks/{hook_id}"),
            Value::Null,
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    for bad in [
        json!({"name":"x","url":"ftp://x","events":["sandbox.lifecycle.created"],"signatureSecret":"s"}),
        json!({"name":"x","url":"http://x","events":["sandbox.lifecycle.nope"],"signatureSecret":"s"}),
        json!({"name":"x","url":"http://x","events":[],"signatureSecret":"s"}),
        json!({"name":"","url":"http://x","events":["sandbox.lifecycle.created"],"signatureSecret":"s"}),
        json!({"name":"x","url":"http://x","events":["sandbox.lifecycle.created"]}),
    ] {
        let r = h.a(Method::POST, "/events/webhooks", bad.clone()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}");
    }
}

#[tokio::test]
async fn deaths_become_killed_events_with_their_reason() {
    let h = harness().await;
    let id = h.create_a(json!({"templateID":"base"})).await;
    h.node.die(&id, DeathReason::Timeout);
    h.cp.upkeep(false).await;
    let r = wait_for("the killed event", || {
        let ev =
            h.cp.store()
                .events(&cubicle_store::EventQuery {
                    team_id: 1,
                    sandbox_id: Some(id.clone()),
                    kinds: vec!["sandbox.lifecycle.killed".into()],
                    limit: 10,
                    ..Default::default()
                })
                .ok()?;
        ev.into_iter().next()
    })
    .await;
    let ev: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(ev["eventData"]["death_reason"], "timeout");
    // Noticed once: a second pass records nothing more.
    h.cp.upkeep(false).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let all =
        h.cp.store()
            .events(&cubicle_store::EventQuery {
                team_id: 1,
                sandbox_id: Some(id.clone()),
                limit: 10,
                ..Default::default()
            })
            .unwrap();
    assert_eq!(all.len(), 2, "created + killed");
}

#[tokio::test]
async fn create_honours_resources_within_the_node_limits() {
    let h = harness_with(|c| {
        c.limits.max_cpus = 4;
        c.limits.max_memory_mb = 4096;
        c.limits.max_disk_mb = 8192;
    })
    .await;
    let id = h
        .create_a(json!({"templateID":"base","cpuCount":3,"memoryMB":1024,"diskSizeMB":2048}))
        .await;
    let d = h
        .a(Method::GET, &format!("/sandboxes/{id}"), Value::Null)
        .await;
    assert_eq!(
        (
            &d.json["cpuCount"],
            &d.json["memoryMB"],
            &d.json["diskSizeMB"]
        ),
        (&json!(3), &json!(1024), &json!(2048)),
        "{}",
        d.json
    );
    let listed = h.a(Method::GET, "/v2/sandboxes", Value::Null).await;
    assert_eq!(listed.json[0]["memoryMB"], 1024);
    // Beyond the node: a 400 that says the limit, never a silent default.
    for body in [
        json!({"templateID":"base","cpuCount":5}),
        json!({"templateID":"base","memoryMB":4097}),
        json!({"templateID":"base","diskSizeMB":9000}),
        json!({"templateID":"base","memoryMB":1}),
    ] {
        let r = h.a(Method::POST, "/v2/sandboxes", body.clone()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {}", r.json);
        assert!(
            r.json["message"].as_str().unwrap().contains("on this node"),
            "{}",
            r.json
        );
    }
    // The description states the same limits.
    let spec = h
        .call(Method::GET, "/openapi.json", None, Body::empty())
        .await
        .json;
    let props = &spec["components"]["schemas"]["NewSandbox"]["properties"];
    assert_eq!(props["cpuCount"]["maximum"], 4, "{props}");
    assert_eq!(props["memoryMB"]["maximum"], 4096);
    assert_eq!(props["diskSizeMB"]["maximum"], 8192);
}

#[tokio::test]
async fn operator_sees_and_kills_across_teams() {
    let h = harness().await;
    let admin = h.cp.store().ensure_team(crate::ADMIN_TEAM).unwrap();
    let admin_key = h.cp.store().create_api_key(admin.id).unwrap().plaintext;
    let a = h
        .create_a(json!({"templateID":"base","metadata":{"who":"a"}}))
        .await;
    let r = h
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some(&h.key_b.clone()),
            Body::from(json!({"templateID":"tiny"}).to_string()),
        )
        .await;
    let b = r.json["sandboxID"].as_str().unwrap().to_string();

    // whoami
    let me = h
        .call(
            Method::GET,
            "/cubicle/whoami",
            Some(&admin_key),
            Body::empty(),
        )
        .await;
    assert_eq!(
        (&me.json["team"], &me.json["admin"]),
        (&json!("admin"), &json!(true))
    );
    assert!(
        me.json["limits"]["maxCpus"].as_u64().unwrap() >= 1,
        "{}",
        me.json
    );
    let me = h.a(Method::GET, "/cubicle/whoami", Value::Null).await;
    assert_eq!(
        (&me.json["team"], &me.json["admin"]),
        (&json!("a"), &json!(false))
    );

    // The view across teams is the operator's only.
    let r = h.a(Method::GET, "/cubicle/sandboxes", Value::Null).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let r = h
        .a(
            Method::DELETE,
            &format!("/cubicle/sandboxes/{b}"),
            Value::Null,
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let all = h
        .call(
            Method::GET,
            "/cubicle/sandboxes",
            Some(&admin_key),
            Body::empty(),
        )
        .await;
    assert_eq!(all.status, StatusCode::OK);
    let teams: HashMap<String, String> = all
        .json
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["sandboxID"].as_str().unwrap().into(),
                s["team"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(teams.get(&a).map(String::as_str), Some("a"));
    assert_eq!(teams.get(&b).map(String::as_str), Some("b"));
    // ...while the operator's own E2B list stays its team's (none).
    let own = h
        .call(
            Method::GET,
            "/v2/sandboxes",
            Some(&admin_key),
            Body::empty(),
        )
        .await;
    assert_eq!(own.json, json!([]));

    let r = h
        .call(
            Method::DELETE,
            &format!("/cubicle/sandboxes/{b}"),
            Some(&admin_key),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = h
        .call(
            Method::GET,
            &format!("/sandboxes/{b}"),
            Some(&h.key_b.clone()),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "team b's sandbox is gone");
    let r = h
        .call(
            Method::DELETE,
            "/cubicle/sandboxes/nosuch1",
            Some(&admin_key),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let d = h
        .a(Method::GET, &format!("/sandboxes/{a}"), Value::Null)
        .await;
    assert_eq!(d.status, StatusCode::OK, "team a's sandbox lives on");
}

#[tokio::test]
async fn api_keys_per_team_and_for_the_operator() {
    let h = harness().await;
    let admin = h.cp.store().ensure_team(crate::ADMIN_TEAM).unwrap();
    let admin_key = h.cp.store().create_api_key(admin.id).unwrap().plaintext;
    let mine = h.a(Method::GET, "/cubicle/api-keys", Value::Null).await;
    let prefixes: Vec<&str> = mine
        .json
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["prefix"].as_str().unwrap())
        .collect();
    assert_eq!(
        prefixes,
        [&h.key_a[..12]],
        "team a sees only its key: {}",
        mine.json
    );
    assert!(mine.json[0].get("key").is_none(), "never the key itself");

    // A team makes keys for itself only.
    let r = h
        .a(Method::POST, "/cubicle/api-keys", json!({"team":"b"}))
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let r = h.a(Method::POST, "/cubicle/api-keys", Value::Null).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    let new_key = r.json["key"].as_str().unwrap().to_string();
    assert_eq!(r.json["team"], "a");
    let who = h
        .call(
            Method::GET,
            "/cubicle/whoami",
            Some(&new_key),
            Body::empty(),
        )
        .await;
    assert_eq!(who.json["team"], "a");
    // ...and revokes only its own.
    let r = h
        .a(
            Method::DELETE,
            &format!("/cubicle/api-keys/{}", &h.key_b[..12]),
            Value::Null,
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    // Not the key the request is made with (a client would lock itself out).
    let r = h
        .call(
            Method::DELETE,
            &format!("/cubicle/api-keys/{}", &new_key[..12]),
            Some(&new_key),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.json);
    let r = h
        .a(
            Method::DELETE,
            &format!("/cubicle/api-keys/{}", &new_key[..12]),
            Value::Null,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert!(r.json["revokedAt"].is_string());
    let who = h
        .call(
            Method::GET,
            "/cubicle/whoami",
            Some(&new_key),
            Body::empty(),
        )
        .await;
    assert_eq!(who.status, StatusCode::UNAUTHORIZED);

    // The operator sees every team's keys, makes keys for new teams and revokes any.
    let all = h
        .call(
            Method::GET,
            "/cubicle/api-keys",
            Some(&admin_key),
            Body::empty(),
        )
        .await;
    let teams: Vec<&str> = all
        .json
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["team"].as_str().unwrap())
        .collect();
    assert!(
        teams.contains(&"a") && teams.contains(&"b") && teams.contains(&"admin"),
        "{teams:?}"
    );
    let body = Body::from(json!({"team":"newteam"}).to_string());
    let r = h
        .call(Method::POST, "/cubicle/api-keys", Some(&admin_key), body)
        .await;
    assert_eq!(
        (r.status, &r.json["team"]),
        (StatusCode::CREATED, &json!("newteam"))
    );
    let r = h
        .call(
            Method::DELETE,
            &format!("/cubicle/api-keys/{}", &h.key_b[..12]),
            Some(&admin_key),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let body = Body::from("{\"team\": \"bad name\"}");
    let r = h
        .call(Method::POST, "/cubicle/api-keys", Some(&admin_key), body)
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn dashboard_is_served_without_a_key() {
    let h = harness().await;
    for (uri, status) in [
        ("/", 303),
        ("/dashboard", 303),
        ("/dashboard/", 200),
        ("/dashboard/app.js", 200),
    ] {
        let resp = h
            .app
            .clone()
            .oneshot(Request::builder().uri(uri).body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), status, "{uri}");
        if status == 303 {
            assert_eq!(resp.headers()["location"], "/dashboard/");
        }
    }
    let r = h
        .call(Method::GET, "/dashboard/nope.js", None, Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}
