//! The E2B REST control plane, as the SDKs call it: `X-API-KEY` on every request,
//! JSON bodies, errors as `{"code":N,"message":…}` (spec §2.1–2.3).

use std::time::Duration;

use hyper::{Method, header};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{
    ClientError,
    http::{self, BaseUrl, Connection},
};

/// Largest REST response we read.
const MAX_BODY: usize = 32 << 20;
/// REST calls other than create give up after this long.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Create may build a template first (about a minute for `base` on a fresh server).
const CREATE_TIMEOUT: Duration = Duration::from_secs(900);

/// `POST /v2/sandboxes` body (NewSandboxV2; unset fields are omitted).
#[derive(Debug, Serialize, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
    pub metadata: std::collections::BTreeMap<String, String>,
    pub env_vars: std::collections::BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<serde_json::Value>,
    /// E2B `network` options (as `NetworkFlags::body` builds them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<Value>,
    /// Unset: the server's default (internet on).
    #[serde(
        rename = "allow_internet_access",
        skip_serializing_if = "Option::is_none"
    )]
    pub allow_internet_access: Option<bool>,
    /// vCPUs instead of the template's (a Cubicle field).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_count: Option<u32>,
    /// Memory limit in MiB instead of the template's (a Cubicle field).
    #[serde(rename = "memoryMB", skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    /// Writable-layer quota in MiB instead of the template's (a Cubicle field).
    #[serde(rename = "diskSizeMB", skip_serializing_if = "Option::is_none")]
    pub disk_mb: Option<u64>,
}

/// The `Sandbox` answer of create/connect (only what the client needs; the rest is kept
/// in the raw JSON).
#[derive(Debug, Deserialize, Clone)]
pub struct Sandbox {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "envdAccessToken", default)]
    pub envd_access_token: Option<String>,
}

/// One log line (`GET /v2/sandboxes/{id}/logs` entry, or a v1 `{timestamp, line}`).
#[derive(Debug, Deserialize, Clone, PartialEq)]
pub struct LogEntry {
    #[serde(default)]
    pub timestamp: String,
    #[serde(default, alias = "line")]
    pub message: String,
    #[serde(default)]
    pub level: Option<String>,
}

#[derive(Deserialize)]
struct LogsV2 {
    #[serde(default)]
    logs: Vec<LogEntry>,
}

#[derive(Deserialize)]
struct LogsV1 {
    #[serde(default)]
    logs: Vec<LogEntry>,
}

/// Which logs route the server answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogsApi {
    V2,
    V1,
}

/// List filters (`GET /v2/sandboxes`).
#[derive(Debug, Default, Clone)]
pub struct ListFilter {
    pub metadata: Vec<(String, String)>,
    /// `running`, `paused` (comma-joined on the wire); empty = server default (both).
    pub states: Vec<String>,
    /// Template id or alias (a Cubicle filter); `None`: any.
    pub template: Option<String>,
}

/// Client of the REST API.
#[derive(Clone)]
pub struct ApiClient {
    base: BaseUrl,
    /// The API key, or the bearer token when `bearer`.
    api_key: String,
    bearer: bool,
}

/// `encodeURIComponent`: everything but `A-Za-z0-9-_.!~*'()` is escaped.
const COMPONENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'!')
    .remove(b'~')
    .remove(b'*')
    .remove(b'\'')
    .remove(b'(')
    .remove(b')');

/// Query-value encoding (form style, but spaces as `%20`).
pub(super) const QUERY_VALUE: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

pub(super) fn enc(s: &str, set: &'static percent_encoding::AsciiSet) -> String {
    percent_encoding::utf8_percent_encode(s, set).to_string()
}

/// Percent-encodes one path segment (sandbox ids are `[a-z0-9]+`, but never trust input).
pub(super) fn seg(s: &str) -> String {
    enc(s, COMPONENT)
}

/// The `GET /v2/sandboxes` query for a filter and page (metadata double-encoded as the
/// SDKs do it, spec §2.3 S5).
pub fn list_query(filter: &ListFilter, next_token: Option<&str>, limit: u32) -> String {
    let mut q = vec![format!("limit={limit}")];
    if !filter.metadata.is_empty() {
        let inner: Vec<String> = filter
            .metadata
            .iter()
            .map(|(k, v)| {
                // encodeURIComponent, then form-encoded (URLSearchParams) as the SDKs do;
                // the query layer below adds the third.
                let twice = |s: &str| enc(&enc(s, COMPONENT), QUERY_VALUE);
                format!("{}={}", twice(k), twice(v))
            })
            .collect();
        q.push(format!("metadata={}", enc(&inner.join("&"), QUERY_VALUE)));
    }
    if !filter.states.is_empty() {
        q.push(format!(
            "state={}",
            enc(&filter.states.join(","), COMPONENT).replace("%2C", ",")
        ));
    }
    if let Some(t) = &filter.template {
        q.push(format!("template={}", enc(t, QUERY_VALUE)));
    }
    if let Some(t) = next_token {
        q.push(format!("nextToken={}", enc(t, QUERY_VALUE)));
    }
    q.join("&")
}

impl ApiClient {
    pub fn new(base: BaseUrl, api_key: String) -> ApiClient {
        ApiClient {
            base,
            api_key,
            bearer: false,
        }
    }

    /// A client that authenticates with `Authorization: Bearer <token>` (the volume
    /// content API) instead of an API key.
    pub fn with_bearer(base: BaseUrl, token: String) -> ApiClient {
        ApiClient {
            base,
            api_key: token,
            bearer: true,
        }
    }

    /// Sends a request on a fresh connection; returns `(status, headers, body)`; error
    /// statuses become `ClientError::Status`.
    pub(crate) async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<(u16, header::HeaderMap, bytes::Bytes), ClientError> {
        self.call_typed(method, path, body.map(|b| (b, "application/json")), timeout)
            .await
    }

    /// [`ApiClient::call`] with a body of any content type.
    pub(super) async fn call_typed(
        &self,
        method: Method,
        path: &str,
        body: Option<(Vec<u8>, &str)>,
        timeout: Duration,
    ) -> Result<(u16, header::HeaderMap, bytes::Bytes), ClientError> {
        self.call_on(None, method, path, body, timeout).await
    }

    /// Sends a request (on `conn`, else on a fresh connection); returns `(status,
    /// headers, body)`; error statuses become `ClientError::Status`.
    async fn call_on(
        &self,
        conn: Option<&mut Connection>,
        method: Method,
        path: &str,
        body: Option<(Vec<u8>, &str)>,
        timeout: Duration,
    ) -> Result<(u16, header::HeaderMap, bytes::Bytes), ClientError> {
        let mut b = self
            .base
            .request(method.clone(), path)
            .header(header::ACCEPT, "application/json")
            .header(
                header::USER_AGENT,
                concat!("cubicle-cli/", env!("CARGO_PKG_VERSION")),
            );
        b = if self.bearer {
            b.header(header::AUTHORIZATION, format!("Bearer {}", self.api_key))
        } else {
            b.header("x-api-key", &self.api_key)
        };
        let body = match body {
            Some((b0, ctype)) => {
                b = b.header(header::CONTENT_TYPE, ctype);
                http::full(b0)
            }
            None => http::full(bytes::Bytes::new()),
        };
        let req = b
            .body(body)
            .map_err(|e| ClientError::Config(format!("bad request {path}: {e}")))?;
        let what = format!("{method} {}", self.base.url(path));
        let fut = async {
            let resp = match conn {
                Some(c) => c.send(req).await?,
                None => http::send(&self.base, req).await?,
            };
            let status = resp.status().as_u16();
            let headers = resp.headers().clone();
            let body = http::read_body(resp.into_body(), MAX_BODY).await?;
            Ok::<_, ClientError>((status, headers, body))
        };
        let (status, headers, body) = tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| ClientError::Timeout(what))??;
        if !(200..300).contains(&status) {
            return Err(ClientError::from_error_body(status, &body));
        }
        Ok((status, headers, body))
    }

    /// A call on `conn` with an optional JSON body (for the bench's stateful measures):
    /// `(status, headers, body)`; error statuses become `ClientError::Status`.
    pub async fn json_call_on(
        &self,
        conn: &mut Connection,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, header::HeaderMap, bytes::Bytes), ClientError> {
        let body = body.map(|b| (b.to_string().into_bytes(), "application/json"));
        self.call_on(Some(conn), method, path, body, CREATE_TIMEOUT)
            .await
    }

    pub(super) fn json<T: serde::de::DeserializeOwned>(
        path: &str,
        body: &[u8],
    ) -> Result<T, ClientError> {
        serde_json::from_slice(body).map_err(|e| {
            ClientError::Protocol(format!(
                "{path}: {e} in {}",
                String::from_utf8_lossy(&body[..body.len().min(300)])
            ))
        })
    }

    /// `POST /v2/sandboxes` → the new sandbox (raw JSON too).
    pub async fn create(&self, req: &NewSandbox) -> Result<(Sandbox, Value), ClientError> {
        self.create_via(None, req).await
    }

    /// [`ApiClient::create`] on `conn`.
    pub async fn create_on(
        &self,
        conn: &mut Connection,
        req: &NewSandbox,
    ) -> Result<(Sandbox, Value), ClientError> {
        self.create_via(Some(conn), req).await
    }

    async fn create_via(
        &self,
        conn: Option<&mut Connection>,
        req: &NewSandbox,
    ) -> Result<(Sandbox, Value), ClientError> {
        let body = serde_json::to_vec(req)
            .map_err(|e| ClientError::Protocol(format!("encoding the request: {e}")))?;
        let (_, _, body) = self
            .call_on(
                conn,
                Method::POST,
                "/v2/sandboxes",
                Some((body, "application/json")),
                CREATE_TIMEOUT,
            )
            .await?;
        let raw: Value = Self::json("/v2/sandboxes", &body)?;
        let sbx: Sandbox = Self::json("/v2/sandboxes", &body)?;
        Ok((sbx, raw))
    }

    /// `GET /v2/sandboxes`, following `X-Next-Token` to the last page.
    pub async fn list(&self, filter: &ListFilter) -> Result<Vec<Value>, ClientError> {
        self.list_on(&mut Connection::lazy(&self.base), filter)
            .await
    }

    /// [`ApiClient::list`] on `conn`.
    pub async fn list_on(
        &self,
        conn: &mut Connection,
        filter: &ListFilter,
    ) -> Result<Vec<Value>, ClientError> {
        let mut all = Vec::new();
        let mut token: Option<String> = None;
        // A server that keeps returning tokens must not loop us forever.
        for _ in 0..10_000 {
            let path = format!(
                "/v2/sandboxes?{}",
                list_query(filter, token.as_deref(), 100)
            );
            let (_, headers, body) = self
                .call_on(Some(&mut *conn), Method::GET, &path, None, CALL_TIMEOUT)
                .await?;
            let page: Vec<Value> = Self::json("/v2/sandboxes", &body)?;
            all.extend(page);
            token = headers
                .get("x-next-token")
                .and_then(|v| v.to_str().ok())
                .filter(|t| !t.is_empty())
                .map(str::to_string);
            if token.is_none() {
                return Ok(all);
            }
        }
        Err(ClientError::Protocol(
            "GET /v2/sandboxes: pagination never ended".into(),
        ))
    }

    /// `GET /sandboxes/{id}` → SandboxDetail.
    pub async fn get(&self, id: &str) -> Result<Value, ClientError> {
        let path = format!("/sandboxes/{}", seg(id));
        let (_, _, body) = self.call(Method::GET, &path, None, CALL_TIMEOUT).await?;
        Self::json(&path, &body)
    }

    /// `DELETE /sandboxes/{id}`.
    pub async fn kill(&self, id: &str) -> Result<(), ClientError> {
        let path = format!("/sandboxes/{}", seg(id));
        self.call(Method::DELETE, &path, None, CALL_TIMEOUT).await?;
        Ok(())
    }

    /// `POST` of a JSON body to `path`; the status and the decoded answer (`Null` for
    /// an empty one).
    pub async fn post_json(
        &self,
        path: &str,
        body: &Value,
        timeout: Duration,
    ) -> Result<(u16, Value), ClientError> {
        let (status, _, resp) = self
            .call(
                Method::POST,
                path,
                Some(body.to_string().into_bytes()),
                timeout,
            )
            .await?;
        if resp.is_empty() {
            return Ok((status, Value::Null));
        }
        Ok((status, Self::json(path, &resp)?))
    }

    /// `GET /snapshots` (all pages).
    pub async fn snapshots(&self, sandbox: Option<&str>) -> Result<Vec<Value>, ClientError> {
        let mut all = Vec::new();
        let mut token: Option<String> = None;
        for _ in 0..10_000 {
            let mut q = vec!["limit=100".to_string()];
            if let Some(s) = sandbox {
                q.push(format!("sandboxID={}", enc(s, QUERY_VALUE)));
            }
            if let Some(t) = &token {
                q.push(format!("nextToken={}", enc(t, QUERY_VALUE)));
            }
            let path = format!("/snapshots?{}", q.join("&"));
            let (_, headers, body) = self.call(Method::GET, &path, None, CALL_TIMEOUT).await?;
            let page: Vec<Value> = Self::json("/snapshots", &body)?;
            all.extend(page);
            token = headers
                .get("x-next-token")
                .and_then(|v| v.to_str().ok())
                .filter(|t| !t.is_empty())
                .map(str::to_string);
            if token.is_none() {
                return Ok(all);
            }
        }
        Err(ClientError::Protocol(
            "GET /snapshots: pagination never ended".into(),
        ))
    }

    /// `DELETE /templates/{id}` (a snapshot).
    pub async fn delete_template(&self, id: &str) -> Result<(), ClientError> {
        let path = format!("/templates/{}", seg(id));
        self.call(Method::DELETE, &path, None, CALL_TIMEOUT).await?;
        Ok(())
    }

    /// [`ApiClient::kill`] on `conn`.
    pub async fn kill_on(&self, conn: &mut Connection, id: &str) -> Result<(), ClientError> {
        let path = format!("/sandboxes/{}", seg(id));
        self.call_on(Some(conn), Method::DELETE, &path, None, CALL_TIMEOUT)
            .await?;
        Ok(())
    }

    /// `GET /cubicle/pool` on `conn`: the server's warm-pool counters (a Cubicle route,
    /// not E2B's).
    pub async fn pool_stats_on(&self, conn: &mut Connection) -> Result<Value, ClientError> {
        let path = "/cubicle/pool";
        let (_, _, body) = self
            .call_on(Some(conn), Method::GET, path, None, CALL_TIMEOUT)
            .await?;
        Self::json(path, &body)
    }

    /// The server's base URL.
    pub fn base(&self) -> &BaseUrl {
        &self.base
    }

    /// `POST /v2/sandboxes/{id}/connect` (how the SDK gets the envd access token).
    pub async fn connect(&self, id: &str, timeout: Option<u64>) -> Result<Sandbox, ClientError> {
        let path = format!("/v2/sandboxes/{}/connect", seg(id));
        let body = match timeout {
            Some(t) => serde_json::json!({ "timeout": t }),
            None => serde_json::json!({}),
        };
        let (_, _, body) = self
            .call(
                Method::POST,
                &path,
                Some(body.to_string().into_bytes()),
                CALL_TIMEOUT,
            )
            .await?;
        Self::json(&path, &body)
    }

    /// `PUT /sandboxes/{id}/network` (replaces the sandbox's egress policy).
    pub async fn update_network(&self, id: &str, body: &Value) -> Result<(), ClientError> {
        let path = format!("/sandboxes/{}/network", seg(id));
        self.call(
            Method::PUT,
            &path,
            Some(body.to_string().into_bytes()),
            CALL_TIMEOUT,
        )
        .await?;
        Ok(())
    }

    /// `GET /cubicle/sandboxes/{id}/netlog`: audit events numbered above `after`, and
    /// with `allowlist` the allow list learnt from the whole trail.
    pub async fn netlog(
        &self,
        id: &str,
        after: u64,
        allowlist: bool,
    ) -> Result<Value, ClientError> {
        let mut path = format!(
            "/cubicle/sandboxes/{}/netlog?after={after}&limit=1000",
            seg(id)
        );
        if allowlist {
            path.push_str("&allowlist=true");
        }
        let (_, _, body) = self.call(Method::GET, &path, None, CALL_TIMEOUT).await?;
        Self::json(&path, &body)
    }

    /// Log entries from `cursor_ms` on (oldest first). Tries
    /// `GET /v2/sandboxes/{id}/logs` first; `api` remembers which route answered (a
    /// server without v2 logs gets `GET /sandboxes/{id}/logs`).
    pub async fn logs(
        &self,
        id: &str,
        cursor_ms: Option<i64>,
        api: &mut Option<LogsApi>,
    ) -> Result<Vec<LogEntry>, ClientError> {
        if *api != Some(LogsApi::V1) {
            let mut path = format!(
                "/v2/sandboxes/{}/logs?direction=forward&limit=1000",
                seg(id)
            );
            if let Some(c) = cursor_ms {
                path.push_str(&format!("&cursor={c}"));
            }
            match self.call(Method::GET, &path, None, CALL_TIMEOUT).await {
                Ok((_, _, body)) => {
                    *api = Some(LogsApi::V2);
                    return Ok(Self::json::<LogsV2>(&path, &body)?.logs);
                }
                // 404 may be "no such route" as well as "no such sandbox": try v1 once.
                Err(e) if api.is_none() && matches!(e.status(), Some(404 | 405)) => {
                    match self.logs_v1(id, cursor_ms).await {
                        Ok(l) => {
                            *api = Some(LogsApi::V1);
                            return Ok(l);
                        }
                        Err(_) => return Err(e),
                    }
                }
                Err(e) => return Err(e),
            }
        }
        self.logs_v1(id, cursor_ms).await
    }

    /// `POST /sandboxes/{id}/timeout`: the sandbox ends `secs` from now.
    pub async fn set_timeout(&self, id: &str, secs: u64) -> Result<(), ClientError> {
        let path = format!("/sandboxes/{}/timeout", seg(id));
        let body = serde_json::json!({ "timeout": secs })
            .to_string()
            .into_bytes();
        self.call(Method::POST, &path, Some(body), CALL_TIMEOUT)
            .await?;
        Ok(())
    }

    /// `GET /sandboxes/{id}/metrics` (samples since `start`, unix seconds, when given).
    pub async fn metrics(&self, id: &str, start: Option<i64>) -> Result<Vec<Value>, ClientError> {
        let mut path = format!("/sandboxes/{}/metrics", seg(id));
        if let Some(s) = start {
            path.push_str(&format!("?start={s}"));
        }
        let (_, _, body) = self.call(Method::GET, &path, None, CALL_TIMEOUT).await?;
        Self::json(&path, &body)
    }

    /// `GET /cubicle/sandboxes`: every team's live sandboxes (the operator's key only).
    pub async fn list_all_teams(&self) -> Result<Vec<Value>, ClientError> {
        let path = "/cubicle/sandboxes";
        let (_, _, body) = self.call(Method::GET, path, None, CALL_TIMEOUT).await?;
        Self::json(path, &body)
    }

    /// `DELETE /cubicle/sandboxes/{id}`: kills any team's sandbox (the operator's key).
    pub async fn kill_any_team(&self, id: &str) -> Result<(), ClientError> {
        let path = format!("/cubicle/sandboxes/{}", seg(id));
        self.call(Method::DELETE, &path, None, CALL_TIMEOUT).await?;
        Ok(())
    }

    async fn logs_v1(&self, id: &str, start_ms: Option<i64>) -> Result<Vec<LogEntry>, ClientError> {
        let mut path = format!("/sandboxes/{}/logs?limit=1000", seg(id));
        if let Some(c) = start_ms {
            path.push_str(&format!("&start={c}"));
        }
        let (_, _, body) = self.call(Method::GET, &path, None, CALL_TIMEOUT).await?;
        Ok(Self::json::<LogsV1>(&path, &body)?.logs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::testserver::{FakeServer, Reply};
    use std::sync::{Arc, Mutex};

    #[test]
    fn list_query_encodes_like_the_sdks() {
        let f = ListFilter {
            metadata: vec![("a b".into(), "c&d".into())],
            states: vec!["running".into(), "paused".into()],
            template: None,
        };
        let q = list_query(&f, Some("tok=="), 100);
        // `a b` → `a%20b` → `a%2520b` → (whole string query-encoded) `a%252520b`; after
        // the server's query decode: `a%2520b=c%2526d`, the spec's example.
        assert_eq!(
            q,
            "limit=100&metadata=a%252520b%3Dc%252526d&state=running,paused&nextToken=tok%3D%3D"
        );
        assert_eq!(list_query(&ListFilter::default(), None, 5), "limit=5");
    }

    #[test]
    fn create_body_matches_the_sdk_shape() {
        let mut req = NewSandbox {
            template_id: "base".into(),
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value(&req).unwrap(),
            serde_json::json!({"templateID":"base","metadata":{},"envVars":{}})
        );
        req.timeout = Some(120);
        req.metadata.insert("k".into(), "v".into());
        req.env_vars.insert("A".into(), "1".into());
        assert_eq!(
            serde_json::to_value(&req).unwrap(),
            serde_json::json!({"templateID":"base","timeout":120,"metadata":{"k":"v"},"envVars":{"A":"1"}})
        );
    }

    #[tokio::test]
    async fn rest_calls_against_a_fake_server() {
        let seen = Arc::new(Mutex::new(Vec::<String>::new()));
        let log = seen.clone();
        let server = FakeServer::start(move |req| {
            log.lock().unwrap().push(format!("{} {}", req.method, req.path));
            if req.header("x-api-key") != Some("key1") {
                return Reply::json(401, r#"{"code":401,"message":"Invalid API key"}"#);
            }
            match (req.method.as_str(), req.path.as_str()) {
                ("POST", "/v2/sandboxes") => {
                    assert_eq!(req.header("content-type"), Some("application/json"));
                    let v: Value = serde_json::from_slice(&req.body).unwrap();
                    assert_eq!(v["templateID"], "tiny");
                    Reply::json(
                        201,
                        r#"{"templateID":"tiny","sandboxID":"abc1","clientID":"x","envdVersion":"0.2.0","envdAccessToken":"tok"}"#,
                    )
                }
                ("GET", "/v2/sandboxes?limit=100") => {
                    Reply::json(200, r#"[{"sandboxID":"a"},{"sandboxID":"b"}]"#).header("x-next-token", "p2")
                }
                ("GET", "/v2/sandboxes?limit=100&nextToken=p2") => {
                    Reply::json(200, r#"[{"sandboxID":"c"}]"#).header("x-next-token", "")
                }
                ("GET", "/sandboxes/abc1") => Reply::json(200, r#"{"sandboxID":"abc1","state":"running"}"#),
                ("DELETE", "/sandboxes/abc1") => Reply::raw(204, "text/plain", vec![]),
                ("DELETE", _) => Reply::json(404, r#"{"code":404,"message":"sandbox \"zzz\" not found"}"#),
                ("POST", "/v2/sandboxes/abc1/connect") => {
                    assert_eq!(&req.body[..], b"{}");
                    Reply::json(
                        200,
                        r#"{"templateID":"tiny","sandboxID":"abc1","clientID":"x","envdVersion":"0.2.0","envdAccessToken":"tok"}"#,
                    )
                }
                ("GET", p) if p.starts_with("/v2/sandboxes/abc1/logs") => {
                    Reply::json(404, r#"{"code":404,"message":"not found"}"#)
                }
                ("GET", "/sandboxes/abc1/logs?limit=1000&start=5") => Reply::json(
                    200,
                    r#"{"logs":[{"timestamp":"2026-01-01T00:00:00Z","line":"hello"}],"logEntries":[]}"#,
                ),
                _ => Reply::json(404, r#"{"code":404,"message":"no route"}"#),
            }
        })
        .await;
        let api = ApiClient::new(server.base(), "key1".into());
        let (sbx, raw) = api
            .create(&NewSandbox {
                template_id: "tiny".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(sbx.sandbox_id, "abc1");
        assert_eq!(sbx.envd_access_token.as_deref(), Some("tok"));
        assert_eq!(raw["envdVersion"], "0.2.0");
        let list = api.list(&ListFilter::default()).await.unwrap();
        let ids: Vec<_> = list
            .iter()
            .map(|v| v["sandboxID"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["a", "b", "c"]);
        assert_eq!(api.get("abc1").await.unwrap()["state"], "running");
        api.kill("abc1").await.unwrap();
        let e = api.kill("zzz").await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "server answered 404: sandbox \"zzz\" not found"
        );
        let c = api.connect("abc1", None).await.unwrap();
        assert_eq!(c.envd_access_token.as_deref(), Some("tok"));
        let mut which = None;
        let logs = api.logs("abc1", Some(5), &mut which).await.unwrap();
        assert_eq!(which, Some(LogsApi::V1));
        assert_eq!(logs[0].message, "hello");

        let bad = ApiClient::new(server.base(), "wrong".into());
        let e = bad.get("abc1").await.unwrap_err();
        assert_eq!(e.to_string(), "server answered 401: Invalid API key");
        // Ids are path-encoded, never spliced raw.
        let _ = api.get("../x").await;
        assert!(
            seen.lock()
                .unwrap()
                .iter()
                .any(|l| l == "GET /sandboxes/..%2Fx")
        );
    }
}
