//! Per-request observation, as the outermost layer of `cubicle serve` (REST and data
//! plane alike):
//! - a request id: the client's `X-Request-Id` when it is a sane token (1–128 of
//!   `A-Za-z0-9._:-`), else a new uuid; put on the request (so the sandbox sees it
//!   too) and returned in the response's `X-Request-Id`;
//! - one access-log line at `info` (target `cubicle::access`): request id, method,
//!   route, path (never the query: presigned URLs carry signatures there), status,
//!   duration to the response head, the sandbox for data-plane requests;
//! - the HTTP and sandbox-operation metrics.
//!
//! The route label is a template, never a raw path: REST responses carry the matched
//! route ([`tag_route`], e.g. `/sandboxes/{id}`), data-plane responses a fixed name
//! ([`dataplane_route`]); anything else is `unmatched`.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderName, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::Response;

use super::Telemetry;

/// The request id header (request and response).
pub static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The request's id (in the request's extensions).
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

/// The route template that answered (in the response's extensions).
#[derive(Debug, Clone)]
pub struct RouteLabel(pub std::borrow::Cow<'static, str>);

/// For the access log: the sandbox a data-plane request went to (response extensions).
#[derive(Debug, Clone)]
pub struct SandboxLabel(pub String);

fn sane_request_id(v: &HeaderValue) -> Option<String> {
    let s = v.to_str().ok()?;
    (!s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b':' | b'-')))
    .then(|| s.to_string())
}

/// The sandbox operation a REST route performs, for `cubicle_sandbox_operations_total`.
pub fn operation(method: &Method, route: &str) -> Option<&'static str> {
    Some(match (method.as_str(), route) {
        ("POST", "/sandboxes" | "/v2/sandboxes") => "create",
        ("DELETE", "/sandboxes/{id}") => "kill",
        ("POST", "/sandboxes/{id}/pause") => "pause",
        ("POST", "/sandboxes/{id}/resume") => "resume",
        ("POST", "/sandboxes/{id}/connect" | "/v2/sandboxes/{id}/connect") => "connect",
        ("POST", "/sandboxes/{id}/timeout") => "set_timeout",
        ("POST", "/sandboxes/{id}/refreshes") => "refresh",
        ("POST", "/sandboxes/{id}/snapshots") => "snapshot",
        ("POST", "/sandboxes/{id}/fork") => "fork",
        _ => return None,
    })
}

/// envd's routes as the SDKs use them (anything else on envd's port is `/other`).
const ENVD_ROUTES: &[&str] = &[
    "/health",
    "/files",
    "/envs",
    "/metrics",
    "/process.Process/Start",
    "/process.Process/Connect",
    "/process.Process/List",
    "/process.Process/SendInput",
    "/process.Process/StreamInput",
    "/process.Process/SendSignal",
    "/process.Process/Update",
    "/process.Process/CloseStdin",
    "/filesystem.Filesystem/Stat",
    "/filesystem.Filesystem/MakeDir",
    "/filesystem.Filesystem/Move",
    "/filesystem.Filesystem/ListDir",
    "/filesystem.Filesystem/Remove",
    "/filesystem.Filesystem/WatchDir",
    "/filesystem.Filesystem/CreateWatcher",
    "/filesystem.Filesystem/GetWatcherEvents",
    "/filesystem.Filesystem/RemoveWatcher",
];

/// The route label of a data-plane request to `port` with `path`: `sandbox:envd<route>`
/// for envd's known routes, `sandbox:envd/other`, or `sandbox:port` for user ports
/// (their paths are the sandbox's business and unbounded).
pub fn dataplane_route(port: Option<u16>, path: &str) -> &'static str {
    match port {
        Some(cubicle_router::ENVD_PORT) | None => {
            // Presigned /files URLs (no port in the request) go to envd too.
            match ENVD_ROUTES.iter().position(|r| *r == path) {
                Some(i) => ENVD_LABELS[i],
                None => "sandbox:envd/other",
            }
        }
        Some(_) => "sandbox:port",
    }
}

/// `sandbox:envd` + each of [`ENVD_ROUTES`], as static strings.
const ENVD_LABELS: &[&str] = &[
    "sandbox:envd/health",
    "sandbox:envd/files",
    "sandbox:envd/envs",
    "sandbox:envd/metrics",
    "sandbox:envd/process.Process/Start",
    "sandbox:envd/process.Process/Connect",
    "sandbox:envd/process.Process/List",
    "sandbox:envd/process.Process/SendInput",
    "sandbox:envd/process.Process/StreamInput",
    "sandbox:envd/process.Process/SendSignal",
    "sandbox:envd/process.Process/Update",
    "sandbox:envd/process.Process/CloseStdin",
    "sandbox:envd/filesystem.Filesystem/Stat",
    "sandbox:envd/filesystem.Filesystem/MakeDir",
    "sandbox:envd/filesystem.Filesystem/Move",
    "sandbox:envd/filesystem.Filesystem/ListDir",
    "sandbox:envd/filesystem.Filesystem/Remove",
    "sandbox:envd/filesystem.Filesystem/WatchDir",
    "sandbox:envd/filesystem.Filesystem/CreateWatcher",
    "sandbox:envd/filesystem.Filesystem/GetWatcherEvents",
    "sandbox:envd/filesystem.Filesystem/RemoveWatcher",
];

/// Route layer for the REST router: puts the matched route template on the response.
pub async fn tag_route(req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().cloned();
    let mut resp = next.run(req).await;
    if let Some(r) = route
        && resp.extensions().get::<RouteLabel>().is_none()
    {
        resp.extensions_mut()
            .insert(RouteLabel(r.as_str().to_string().into()));
    }
    resp
}

/// The outermost middleware of `cubicle serve`: request id, access log, metrics.
pub async fn observe(State(t): State<Arc<Telemetry>>, mut req: Request, next: Next) -> Response {
    let t0 = Instant::now();
    let id = req
        .headers()
        .get(&REQUEST_ID)
        .and_then(sane_request_id)
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    let id_value = HeaderValue::from_str(&id).ok();
    if let Some(v) = &id_value {
        req.headers_mut().insert(REQUEST_ID.clone(), v.clone());
    }
    req.extensions_mut().insert(RequestId(id.clone()));
    let client = req
        .extensions()
        .get::<cubicle_router::ClientAddr>()
        .map(|c| c.0.to_string())
        .unwrap_or_default();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let mut resp = next.run(req).await;
    let elapsed = t0.elapsed();
    if let Some(v) = id_value {
        resp.headers_mut().insert(REQUEST_ID.clone(), v);
    }
    let status = resp.status().as_u16();
    let route: &str = resp
        .extensions()
        .get::<RouteLabel>()
        .map(|r| r.0.as_ref())
        .unwrap_or("unmatched");
    t.http_request(route, method.as_str(), status, elapsed);
    if let Some(op) = operation(&method, route) {
        t.operation(op, status);
    }
    let sandbox = resp
        .extensions()
        .get::<SandboxLabel>()
        .map(|s| s.0.as_str())
        .unwrap_or("");
    tracing::info!(
        target: "cubicle::access",
        request_id = %id,
        method = %method,
        route,
        path = %path,
        status,
        duration_ms = (elapsed.as_secs_f64() * 1000.0 * 1000.0).round() / 1000.0,
        sandbox,
        client = %client,
        "{method} {path} {status}"
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_tokens() {
        assert_eq!(
            sane_request_id(&HeaderValue::from_static("abc-123_x.y:z")),
            Some("abc-123_x.y:z".into())
        );
        assert_eq!(sane_request_id(&HeaderValue::from_static("")), None);
        assert_eq!(sane_request_id(&HeaderValue::from_static("a b")), None);
        assert_eq!(
            sane_request_id(&HeaderValue::from_str(&"x".repeat(129)).unwrap()),
            None
        );
    }

    #[test]
    fn labels_are_bounded() {
        assert_eq!(ENVD_ROUTES.len(), ENVD_LABELS.len());
        for (r, l) in ENVD_ROUTES.iter().zip(ENVD_LABELS) {
            assert_eq!(format!("sandbox:envd{r}"), *l);
        }
        assert_eq!(
            dataplane_route(Some(49983), "/process.Process/Start"),
            "sandbox:envd/process.Process/Start"
        );
        assert_eq!(dataplane_route(Some(49983), "/x/y"), "sandbox:envd/other");
        assert_eq!(dataplane_route(Some(8000), "/anything"), "sandbox:port");
        assert_eq!(dataplane_route(None, "/files"), "sandbox:envd/files");
        assert_eq!(operation(&Method::DELETE, "/sandboxes/{id}"), Some("kill"));
        assert_eq!(operation(&Method::GET, "/sandboxes/{id}"), None);
    }
}
