//! The HTTP layer: E2B routes (spec §2.3 and §2.8) → typed commands → [`ControlPlane`].
//! Handlers only read the request (raw body with a size limit, raw query) and shape
//! the response; every failure is an [`ApiError`].
//!
//! Every route is registered with `routes!(handler)`, whose `#[utoipa::path]` names its
//! path, parameters, body and answers: that one declaration both routes the request and
//! describes it in `GET /openapi.json` (see [`crate::openapi`]), so the description
//! cannot drift from what is served. The one exception is the web dashboard's static
//! files (`crate::dashboard`), which are not API (`openapi_covers_every_served_route` in
//! `tests.rs` holds both to this).

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use cubicle_store::Team;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::commands::{
    Connect, CreateSandbox, CreateSnapshot, CreateVersion, Fork, Idempotency, ListFilter,
    ListSnapshots, Pause, Refresh, Resume, Rollback, SetTimeout, UpdateNetwork,
};
use crate::commands::{ConnectBody, NewSandboxBody as NewSandbox, RefreshBody, TimeoutBody};
use crate::error::{ApiError, ApiResult, ErrorBody, json_errors, read_body, unknown_route};
use crate::events::SandboxEvent;
use crate::model::{
    ForkResult, ListedSandbox, PoolCounters, Sandbox, SandboxDetail, SandboxLog, SandboxLogEntry,
    SandboxLogs, SandboxLogsV2, SandboxMetric, SandboxMetrics, SnapshotInfo,
};
use crate::query::{Query, format_time};
use crate::service::ControlPlane;
use crate::webhooks::{Webhook, WebhookCreate, WebhookUpdate};

/// Largest request body accepted.
pub const MAX_BODY: usize = 1 << 20;

type Cp = State<Arc<ControlPlane>>;

/// Every documented route (the API key check on all but the public ones).
fn documented(cp: &Arc<ControlPlane>) -> OpenApiRouter<Arc<ControlPlane>> {
    let authed = OpenApiRouter::new()
        .routes(routes!(create_v2, list_v2))
        .routes(routes!(create_v1, list_v1))
        .routes(routes!(metrics_many))
        .routes(routes!(detail, kill))
        .routes(routes!(set_timeout))
        .routes(routes!(refresh))
        .routes(routes!(connect_v1))
        .routes(routes!(connect_v2))
        .routes(routes!(logs_v1))
        .routes(routes!(logs_v2))
        .routes(routes!(metrics))
        .routes(routes!(events_team))
        .routes(routes!(events_sandbox))
        .routes(routes!(webhook_create, webhook_list))
        .routes(routes!(webhook_get, webhook_update, webhook_delete))
        // Cubicle's own: warm-pool counters for operators and `cubicle bench`.
        .routes(routes!(pool_stats))
        .routes(routes!(network))
        .routes(routes!(netlog))
        .routes(routes!(list_snapshots))
        .routes(routes!(delete_template))
        .merge(crate::template_builds::documented_routes().route_layer(
            middleware::from_fn_with_state(cp.clone(), crate::cluster::templates::relayed),
        ))
        .routes(routes!(pause))
        .routes(routes!(resume))
        .routes(routes!(snapshot))
        .routes(routes!(fork))
        .routes(routes!(rollback))
        .merge(crate::operator::routes())
        .merge(crate::volumes::routes())
        .merge(crate::secrets::routes())
        .route_layer(middleware::from_fn_with_state(cp.clone(), auth));
    OpenApiRouter::with_openapi(crate::openapi::base())
        .routes(routes!(health))
        .routes(routes!(openapi_json))
        .routes(routes!(prometheus))
        .merge(authed)
        // Authenticated by the volume's token, not an API key.
        .merge(
            crate::volume_content::routes().route_layer(middleware::from_fn_with_state(
                cp.clone(),
                crate::cluster::volumes::relayed,
            )),
        )
        // Authenticated by the upload's signed URL, not an API key.
        .merge(
            crate::template_builds::upload_routes().route_layer(middleware::from_fn_with_state(
                cp.clone(),
                crate::cluster::templates::relayed,
            )),
        )
}

/// The OpenAPI description of the routes [`router`] serves, as `GET /openapi.json`
/// answers it (with this server's limits).
pub fn openapi(cp: &Arc<ControlPlane>) -> serde_json::Value {
    let (_, api) = documented(cp).split_for_parts();
    crate::openapi::finish(api, &cp.config().limits)
}

/// The REST router (no data plane): every route, auth, JSON errors everywhere; each
/// response carries its route template for the access log and metrics
/// ([`crate::telemetry::http`]).
pub fn router(cp: Arc<ControlPlane>) -> Router {
    let (documented, api) = documented(&cp).split_for_parts();
    let spec = Arc::new(crate::openapi::finish(api, &cp.config().limits));
    documented
        .merge(crate::dashboard::routes())
        .route_layer(middleware::from_fn(crate::telemetry::http::tag_route))
        .layer(Extension(OpenApiDoc(spec)))
        .fallback(unknown_route)
        .layer(middleware::map_response(json_errors))
        .with_state(cp)
}

/// The finished description, shared with its handler.
#[derive(Clone)]
struct OpenApiDoc(Arc<serde_json::Value>);

/// The server is up.
#[utoipa::path(get, path = "/health", tag = "cubicle", security(()),
    responses((status = 200, description = "The server is up (empty body)")))]
async fn health() -> StatusCode {
    StatusCode::OK
}

/// This description (OpenAPI 3.1), generated from the route definitions.
#[utoipa::path(get, path = "/openapi.json", tag = "cubicle", security(()),
    responses((status = 200, description = "The OpenAPI description", content_type = "application/json", body = Object)))]
async fn openapi_json(Extension(doc): Extension<OpenApiDoc>) -> Response {
    Json(doc.0.as_ref().clone()).into_response()
}

/// The node's warm-pool counters.
#[utoipa::path(get, path = "/cubicle/pool", tag = "cubicle",
    responses((status = 200, body = PoolCounters), (status = 401, response = ErrorBody)))]
async fn pool_stats(State(cp): Cp) -> Json<serde_json::Value> {
    Json(cp.backend().pool_stats())
}

/// The API key of a request: `X-API-KEY`, or `Authorization: Bearer KEY` (what
/// Prometheus sends for `/metrics`).
pub(crate) fn request_key(headers: &HeaderMap) -> Option<String> {
    if let Some(k) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        return Some(k.trim().to_string());
    }
    let auth = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, key) = auth.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| key.trim().to_string())
}

/// Prometheus metrics of this server (OpenMetrics text; see `docs/operations.md`).
/// Only the admin team's keys may read them (`X-API-KEY` or `Authorization: Bearer`);
/// `cubicle serve --metrics-listen` serves them without a key on a separate address.
#[utoipa::path(get, path = "/metrics", tag = "cubicle",
    security(("ApiKeyAuth" = []), ("BearerAuth" = [])),
    responses(
        (status = 200, description = "OpenMetrics text", content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8", body = String),
        (status = 401, response = ErrorBody),
        (status = 403, response = ErrorBody)))]
async fn prometheus(State(cp): Cp, headers: HeaderMap) -> ApiResult<Response> {
    let team = cp.authenticate(request_key(&headers).as_deref()).await?;
    if !cp.is_admin(&team) {
        return Err(ApiError::Forbidden(format!(
            "the metrics are for the operator: use a key of team '{}'",
            crate::ADMIN_TEAM
        )));
    }
    Ok(prometheus_response(&cp))
}

/// The metrics as an HTTP response (also served by `--metrics-listen` without a key).
pub fn prometheus_response(cp: &ControlPlane) -> Response {
    let text = cp.telemetry().render(&cp.metrics_snapshot());
    (
        [(header::CONTENT_TYPE, crate::telemetry::CONTENT_TYPE)],
        text,
    )
        .into_response()
}

/// `X-API-KEY` → the caller's [`Team`] (in the request extensions), or 401.
async fn auth(State(cp): Cp, mut req: Request, next: Next) -> Response {
    let key = request_key(req.headers());
    match cp.authenticate(key.as_deref()).await {
        Ok(team) => {
            req.extensions_mut().insert(team);
            next.run(req).await
        }
        Err(e) => e.into_response(),
    }
}

async fn create(
    cp: Arc<ControlPlane>,
    team: Team,
    headers: HeaderMap,
    body: Body,
    version: CreateVersion,
) -> ApiResult<Response> {
    let body = read_body(body, MAX_BODY).await?;
    let cmd = CreateSandbox::parse(&body, version, &cp.config().limits)?;
    let idem = match headers.get("idempotency-key") {
        Some(v) => Some(Idempotency::new(
            v.to_str()
                .map_err(|_| ApiError::BadRequest("Idempotency-Key is not ASCII".into()))?,
            version,
            &body,
        )?),
        None => None,
    };
    let sandbox = cp.create(&team, cmd, idem).await?;
    Ok((StatusCode::CREATED, Json(sandbox)).into_response())
}

/// Create a sandbox (the SDKs' create).
#[utoipa::path(post, path = "/v2/sandboxes", tag = "sandboxes",
    params(("Idempotency-Key" = Option<String>, Header, description = "Same key and body within 24 h: the same sandbox; another body: 409", pattern = "^[A-Za-z0-9._:-]{1,255}$")),
    request_body = NewSandbox,
    responses((status = 201, body = Sandbox, links(
            ("GetSandbox" = (operation_id = "detail", parameters(("id" = "$response.body#/sandboxID")))),
            ("SetTimeout" = (operation_id = "set_timeout", parameters(("id" = "$response.body#/sandboxID")))),
            ("Refresh" = (operation_id = "refresh", parameters(("id" = "$response.body#/sandboxID")))),
            ("Metrics" = (operation_id = "metrics", parameters(("id" = "$response.body#/sandboxID")))),
            ("Connect" = (operation_id = "connect_v2", parameters(("id" = "$response.body#/sandboxID")))),
            ("Logs" = (operation_id = "logs_v2", parameters(("id" = "$response.body#/sandboxID")))),
            ("Events" = (operation_id = "events_sandbox", parameters(("id" = "$response.body#/sandboxID")))),
            ("Kill" = (operation_id = "kill", parameters(("id" = "$response.body#/sandboxID")))))), (status = 400, response = ErrorBody), (status = 401, response = ErrorBody),
        (status = 404, response = ErrorBody), (status = 409, response = ErrorBody), (status = 413, response = ErrorBody),
        (status = 503, response = ErrorBody)))]
async fn create_v2(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    create(cp, team, headers, body, CreateVersion::V2).await
}

/// Create a sandbox (legacy route: default timeout 15 s).
#[utoipa::path(post, path = "/sandboxes", tag = "sandboxes",
    params(("Idempotency-Key" = Option<String>, Header, description = "Same key and body within 24 h: the same sandbox; another body: 409", pattern = "^[A-Za-z0-9._:-]{1,255}$")),
    request_body = NewSandbox,
    responses((status = 201, body = Sandbox, links(
            ("GetSandbox" = (operation_id = "detail", parameters(("id" = "$response.body#/sandboxID")))),
            ("SetTimeout" = (operation_id = "set_timeout", parameters(("id" = "$response.body#/sandboxID")))),
            ("Refresh" = (operation_id = "refresh", parameters(("id" = "$response.body#/sandboxID")))),
            ("Metrics" = (operation_id = "metrics", parameters(("id" = "$response.body#/sandboxID")))),
            ("Connect" = (operation_id = "connect_v2", parameters(("id" = "$response.body#/sandboxID")))),
            ("Logs" = (operation_id = "logs_v2", parameters(("id" = "$response.body#/sandboxID")))),
            ("Events" = (operation_id = "events_sandbox", parameters(("id" = "$response.body#/sandboxID")))),
            ("Kill" = (operation_id = "kill", parameters(("id" = "$response.body#/sandboxID")))))), (status = 400, response = ErrorBody), (status = 401, response = ErrorBody),
        (status = 404, response = ErrorBody), (status = 409, response = ErrorBody), (status = 413, response = ErrorBody),
        (status = 503, response = ErrorBody)))]
async fn create_v1(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    create(cp, team, headers, body, CreateVersion::V1).await
}

/// The team's sandboxes, one page (`X-Next-Token` names the next).
#[utoipa::path(get, path = "/v2/sandboxes", tag = "sandboxes",
    params(
        ("state" = Option<String>, Query, description = "Comma-separated states: running, paused", pattern = "^\\s*(running|paused)?\\s*(,\\s*(running|paused)?\\s*)*$"),
        ("metadata" = Option<String>, Query, description = "URL-encoded key=value pairs joined by & (each key and value URL-encoded again)", pattern = "^(?:[^&=%]*=[^&%]*|&)*$"),
        ("template" = Option<String>, Query, description = "Template id or alias"),
        ("startedAfter" = Option<String>, Query, format = DateTime, description = "RFC 3339 time"),
        ("order" = Option<String>, Query, pattern = "^(asc|desc)$", description = "By start time (default desc)"),
        ("limit" = Option<i32>, Query, minimum = 1, maximum = 100, description = "Page size (default 100)"),
        ("nextToken" = Option<String>, Query, pattern = "^[0-9]{1,15}_[a-z0-9]{1,32}$", description = "From X-Next-Token")),
    responses((status = 200, body = Vec<ListedSandbox>, headers(("x-next-token" = String, description = "The next page's token, when there is one"))),
        (status = 400, response = ErrorBody), (status = 401, response = ErrorBody)))]
async fn list_v2(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let filter = ListFilter::v2(&Query::parse(q.as_deref())?)?;
    let (items, next) = cp.list(&team, &filter).await?;
    let mut resp = Json(items).into_response();
    if let Some(next) = next
        && let Ok(v) = HeaderValue::from_str(&next)
    {
        resp.headers_mut().insert("x-next-token", v);
    }
    Ok(resp)
}

/// The team's running sandboxes (legacy route).
#[utoipa::path(get, path = "/sandboxes", tag = "sandboxes",
    params(("metadata" = Option<String>, Query, description = "URL-encoded key=value pairs joined by &", pattern = "^(?:[^&=%]*=[^&%]*|&)*$")),
    responses((status = 200, body = Vec<ListedSandbox>), (status = 400, response = ErrorBody), (status = 401, response = ErrorBody)))]
async fn list_v1(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let filter = ListFilter::v1(&Query::parse(q.as_deref())?)?;
    let (items, _) = cp.list(&team, &filter).await?;
    Ok(Json(items).into_response())
}

/// One sandbox of the team.
#[utoipa::path(get, path = "/sandboxes/{id}", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = SandboxDetail), (status = 401, response = ErrorBody), (status = 404, response = ErrorBody)))]
async fn detail(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    Ok(Json(cp.detail(&team, &id).await?).into_response())
}

/// Kill a sandbox.
#[utoipa::path(delete, path = "/sandboxes/{id}", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 204, description = "Killed"), (status = 401, response = ErrorBody), (status = 404, response = ErrorBody)))]
async fn kill(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    cp.kill(&team, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// End the sandbox `timeout` seconds from now (may shorten; 0 ends it now).
#[utoipa::path(post, path = "/sandboxes/{id}/timeout", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = TimeoutBody,
    responses((status = 204, description = "Set"), (status = 400, response = ErrorBody), (status = 401, response = ErrorBody),
        (status = 404, response = ErrorBody), (status = 413, response = ErrorBody)))]
async fn set_timeout(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<StatusCode> {
    let body = read_body(body, MAX_BODY).await?;
    // 404 before 400: an unknown sandbox is the more useful answer.
    cp.owned(&team, &id).await?;
    let cmd = SetTimeout::parse(&body, &cp.config().limits)?;
    cp.set_timeout(&team, &id, cmd).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Keep the sandbox alive at least `duration` seconds from now.
#[utoipa::path(post, path = "/sandboxes/{id}/refreshes", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body(content = Option<RefreshBody>, description = "Empty: the default timeout"),
    responses((status = 204, description = "Refreshed"), (status = 400, response = ErrorBody), (status = 401, response = ErrorBody),
        (status = 404, response = ErrorBody), (status = 413, response = ErrorBody)))]
async fn refresh(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<StatusCode> {
    let body = read_body(body, MAX_BODY).await?;
    cp.owned(&team, &id).await?;
    let cmd = Refresh::parse(&body, &cp.config().limits)?;
    cp.refresh(&team, &id, cmd).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn connect(
    cp: Arc<ControlPlane>,
    team: Team,
    id: String,
    body: Body,
    version: CreateVersion,
) -> ApiResult<Response> {
    let body = read_body(body, MAX_BODY).await?;
    cp.owned_live(&team, &id).await?;
    let cmd = Connect::parse(&body, version, &cp.config().limits)?;
    let (sandbox, resumed) = cp.connect(&team, &id, cmd).await?;
    // 200: it was running; 201: it was paused and is resumed.
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(sandbox)).into_response())
}

/// Connect to a sandbox: its end moves to at least `timeout` seconds from now.
#[utoipa::path(post, path = "/v2/sandboxes/{id}/connect", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body(content = Option<ConnectBody>, description = "Empty: the default timeout"),
    responses((status = 200, body = Sandbox), (status = 201, body = Sandbox, description = "It was paused and is resumed"), (status = 400, response = ErrorBody), (status = 401, response = ErrorBody),
        (status = 404, response = ErrorBody), (status = 409, response = ErrorBody), (status = 413, response = ErrorBody)))]
async fn connect_v2(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<Response> {
    connect(cp, team, id, body, CreateVersion::V2).await
}

/// Connect to a sandbox (legacy route: `timeout` required).
#[utoipa::path(post, path = "/sandboxes/{id}/connect", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = crate::commands::ConnectBodyV1,
    responses((status = 200, body = Sandbox), (status = 201, body = Sandbox, description = "It was paused and is resumed"), (status = 400, response = ErrorBody), (status = 401, response = ErrorBody),
        (status = 404, response = ErrorBody), (status = 409, response = ErrorBody), (status = 413, response = ErrorBody)))]
async fn connect_v1(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<Response> {
    connect(cp, team, id, body, CreateVersion::V1).await
}

/// The sandbox's log (legacy shape), kept 24 h after it ended.
#[utoipa::path(get, path = "/sandboxes/{id}/logs", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id"),
        ("start" = Option<i64>, Query, minimum = 0, description = "Unix ms: lines from then on"),
        ("limit" = Option<i32>, Query, minimum = 0, maximum = 10000, description = "At most (default 1000)")),
    responses((status = 200, body = SandboxLogs), (status = 400, response = ErrorBody), (status = 401, response = ErrorBody), (status = 404, response = ErrorBody)))]
async fn logs_v1(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let q = Query::parse(q.as_deref())?;
    let start = q.int("start", 0..=i64::MAX)?.unwrap_or(0);
    let limit = q.int("limit", 0..=10_000)?.unwrap_or(1000) as usize;
    let lines = cp.logs(&team, &id).await?;
    let picked: Vec<_> = lines
        .into_iter()
        .filter(|l| l.at_ms >= start)
        .take(limit)
        .collect();
    Ok(Json(SandboxLogs {
        logs: picked
            .iter()
            .map(|l| SandboxLog {
                timestamp: format_time(l.at_ms),
                line: l.line.clone(),
            })
            .collect(),
        log_entries: picked
            .iter()
            .map(|l| SandboxLogEntry {
                timestamp: format_time(l.at_ms),
                message: l.line.clone(),
                level: level_name(&l.level),
                fields: l.fields.clone(),
            })
            .collect(),
    })
    .into_response())
}

/// The static name of a stored level (unknown → `info`).
fn level_name(l: &str) -> &'static str {
    match l {
        "debug" => "debug",
        "warn" => "warn",
        "error" => "error",
        _ => "info",
    }
}

fn level_rank(l: &str) -> Option<u8> {
    ["debug", "info", "warn", "error"]
        .iter()
        .position(|x| *x == l)
        .map(|p| p as u8)
}

/// The sandbox's log, kept 24 h after it ended.
#[utoipa::path(get, path = "/v2/sandboxes/{id}/logs", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id"),
        ("cursor" = Option<i64>, Query, minimum = 0, description = "Unix ms to start from"),
        ("limit" = Option<i32>, Query, minimum = 0, maximum = 10000, description = "At most (default 1000)"),
        ("direction" = Option<String>, Query, pattern = "^(forward|backward)$"),
        ("level" = Option<String>, Query, pattern = "^(debug|info|warn|error)$", description = "Minimum level"),
        ("search" = Option<String>, Query, description = "Only lines containing it")),
    responses((status = 200, body = SandboxLogsV2), (status = 400, response = ErrorBody), (status = 401, response = ErrorBody), (status = 404, response = ErrorBody)))]
async fn logs_v2(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let q = Query::parse(q.as_deref())?;
    let cursor = q.int("cursor", 0..=i64::MAX)?;
    let limit = q.int("limit", 0..=10_000)?.unwrap_or(1000) as usize;
    let backward = match q.get("direction") {
        None | Some("forward") => false,
        Some("backward") => true,
        Some(d) => {
            return Err(ApiError::BadRequest(format!(
                "direction must be forward or backward, got '{d}'"
            )));
        }
    };
    let min_level = match q.get("level") {
        None => 0,
        Some(l) => level_rank(l).ok_or_else(|| {
            ApiError::BadRequest(format!(
                "level must be debug, info, warn or error, got '{l}'"
            ))
        })?,
    };
    let search = q.get("search").map(str::to_string);
    let mut lines = cp.logs(&team, &id).await?;
    if backward {
        lines.reverse();
    }
    let logs = lines
        .into_iter()
        .filter(|l| match cursor {
            Some(c) if backward => l.at_ms <= c,
            Some(c) => l.at_ms >= c,
            None => true,
        })
        .filter(|l| level_rank(&l.level).unwrap_or(1) >= min_level)
        .filter(|l| search.as_ref().is_none_or(|s| l.line.contains(s.as_str())))
        .take(limit)
        .map(|l| SandboxLogEntry {
            timestamp: format_time(l.at_ms),
            level: level_name(&l.level),
            message: l.line,
            fields: l.fields,
        })
        .collect();
    Ok(Json(SandboxLogsV2 { logs }).into_response())
}

/// The sandbox's usage samples (one every 5 s, the last 30 minutes).
#[utoipa::path(get, path = "/sandboxes/{id}/metrics", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id"),
        ("start" = Option<i64>, Query, minimum = 0, description = "Unix seconds"),
        ("end" = Option<i64>, Query, minimum = 0, description = "Unix seconds (not before start)")),
    responses((status = 200, body = Vec<SandboxMetric>), (status = 400, response = ErrorBody), (status = 401, response = ErrorBody), (status = 404, response = ErrorBody)))]
async fn metrics(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let q = Query::parse(q.as_deref())?;
    let start = q.int("start", 0..=i64::MAX)?;
    let end = q.int("end", 0..=i64::MAX)?;
    // start > end is an empty range: no samples (not an error the description
    // could express).
    Ok(Json(cp.metrics(&team, &id, start, end).await?).into_response())
}

/// The latest usage sample of each named sandbox of the team.
#[utoipa::path(get, path = "/sandboxes/metrics", tag = "sandboxes",
    params(("sandbox_ids" = String, Query, description = "1 to 100 comma-separated sandbox ids", pattern = "^ *[^, ]+ *(, *[^, ]+ *){0,99},?$"),
        ("start" = Option<i64>, Query, minimum = 0, description = "Unix seconds"),
        ("end" = Option<i64>, Query, minimum = 0, description = "Unix seconds (not before start)")),
    responses((status = 200, body = SandboxMetrics), (status = 400, response = ErrorBody), (status = 401, response = ErrorBody)))]
async fn metrics_many(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let q = Query::parse(q.as_deref())?;
    // `start`/`end` (unix seconds) are Cubicle's addition: E2B's batch route answers
    // with the latest sample only.
    let start = q.int("start", 0..=i64::MAX)?;
    let end = q.int("end", 0..=i64::MAX)?;
    // start > end is an empty range: no samples (not an error the description
    // could express).
    let ids: Vec<String> = q
        .get("sandbox_ids")
        .ok_or_else(|| ApiError::BadRequest("sandbox_ids is required".into()))?
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    if ids.is_empty() || ids.len() > 100 {
        return Err(ApiError::BadRequest(
            "sandbox_ids must name 1 to 100 sandboxes".into(),
        ));
    }
    let sandboxes = cp.metrics_many(&team, &ids, start, end).await?;
    Ok(Json(serde_json::json!({ "sandboxes": sandboxes })).into_response())
}

/// Cubicle's own answer headers of a checkpoint (SDKs ignore them; `cubicle bench` reads
/// them): how long the sandbox was stopped, and the checkpoint's size.
fn checkpoint_headers(resp: &mut Response, frozen: std::time::Duration, bytes: u64) {
    let h = resp.headers_mut();
    h.insert(
        "x-cubicle-frozen-us",
        HeaderValue::from(frozen.as_micros() as u64),
    );
    h.insert("x-cubicle-bytes", HeaderValue::from(bytes));
}

/// Pause a sandbox: its processes, memory and open files are checkpointed to its disk
/// (or, with `memory: false`, only its disk is kept) and it stops using CPU and memory.
#[utoipa::path(post, path = "/sandboxes/{id}/pause", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body(content = Option<crate::commands::PauseBody>, description = "Empty: a full pause"),
    responses((status = 204, description = "Paused", headers(("x-cubicle-frozen-us" = u64, description = "Microseconds the sandbox's processes were stopped (Cubicle's own)"), ("x-cubicle-bytes" = u64, description = "Size of the checkpoint in bytes (Cubicle's own)"))),
        (status = 400, response = ErrorBody), (status = 401, response = ErrorBody),
        (status = 404, response = ErrorBody), (status = 409, response = ErrorBody),
        (status = 413, response = ErrorBody), (status = 501, response = ErrorBody),
        (status = 503, response = ErrorBody),
        (status = 507, response = ErrorBody)))]
async fn pause(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<Response> {
    let body = read_body(body, MAX_BODY).await?;
    cp.owned_live(&team, &id).await?;
    let cmd = Pause::parse(&body)?;
    let (frozen, bytes) = cp.pause(&team, &id, cmd).await?;
    let mut resp = StatusCode::NO_CONTENT.into_response();
    checkpoint_headers(&mut resp, frozen, bytes);
    Ok(resp)
}

/// Resume a paused sandbox (upstream's deprecated route; the SDKs resume with connect).
#[utoipa::path(post, path = "/sandboxes/{id}/resume", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body(content = Option<crate::commands::ResumeBody>, description = "Empty: 15 s"),
    responses((status = 201, body = Sandbox, description = "Resumed"),
        (status = 400, response = ErrorBody), (status = 401, response = ErrorBody),
        (status = 404, response = ErrorBody), (status = 409, response = ErrorBody),
        (status = 413, response = ErrorBody), (status = 501, response = ErrorBody)))]
async fn resume(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<Response> {
    let body = read_body(body, MAX_BODY).await?;
    cp.owned_live(&team, &id).await?;
    let cmd = Resume::parse(&body, &cp.config().limits)?;
    let sandbox = cp.resume(&team, &id, cmd).await?;
    Ok((StatusCode::CREATED, Json(sandbox)).into_response())
}

/// Replace the sandbox's whole egress policy (fields left out are cleared; `{}` clears
/// the policy).
#[utoipa::path(put, path = "/sandboxes/{id}/network", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = crate::commands::UpdateNetworkBody,
    responses((status = 204, description = "Replaced"), (status = 400, response = ErrorBody),
        (status = 401, response = ErrorBody), (status = 404, response = ErrorBody),
        (status = 409, response = ErrorBody)))]
async fn network(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<StatusCode> {
    let body = read_body(body, MAX_BODY).await?;
    let cmd = UpdateNetwork::parse(&body)?;
    cp.update_network(&team, &id, cmd).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /cubicle/sandboxes/{id}/netlog?after=N&limit=M[&allowlist=true]`: the network
/// audit trail (Cubicle's own route, for `cubicle sandbox netlog`). With `allowlist`,
/// also the `allowOut` list that would have permitted every connection in the whole
/// trail (learn mode).
#[utoipa::path(get, path = "/cubicle/sandboxes/{id}/netlog", tag = "cubicle",
    params(("id" = String, Path, description = "Sandbox id"),
        ("after" = Option<i64>, Query, minimum = 0, description = "Events after this sequence number"),
        ("limit" = Option<i64>, Query, minimum = 1, maximum = 100000, description = "Events to return (default 1000)"),
        ("allowlist" = Option<bool>, Query, description = "Also the allowOut/denyOut that would have let the whole trail through")),
    responses((status = 200, description = "`{events: [...]}` (with `allowlist`: also `allowOut`, `denyOut`)", body = Object),
        (status = 400, response = ErrorBody), (status = 401, response = ErrorBody), (status = 404, response = ErrorBody)))]
async fn netlog(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let q = Query::parse(q.as_deref())?;
    let after = q.int("after", 0..=i64::MAX)?.unwrap_or(0) as u64;
    let limit = q.int("limit", 1..=100_000)?.unwrap_or(1000) as usize;
    let events = cp.network_log(&team, &id, after, limit).await?;
    let mut body = serde_json::json!({ "events": events });
    if q.bool("allowlist")? == Some(true) {
        let all = cp.network_log(&team, &id, 0, usize::MAX).await?;
        let allow = cubicle_node::allow_list(&all);
        let needs_deny_all = allow
            .iter()
            .any(|a| a.parse::<std::net::Ipv4Addr>().is_err());
        body["allowOut"] = serde_json::json!(allow);
        body["denyOut"] = serde_json::json!(if needs_deny_all || !allow.is_empty() {
            vec!["0.0.0.0/0"]
        } else {
            Vec::<&str>::new()
        });
    }
    Ok(Json(body).into_response())
}

/// Take a snapshot of a sandbox (it runs on); new sandboxes can start from it.
#[utoipa::path(post, path = "/sandboxes/{id}/snapshots", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body(content = Option<crate::commands::SnapshotBody>, description = "Empty: unnamed, with memory"),
    responses((status = 201, body = SnapshotInfo, headers(("x-cubicle-frozen-us" = u64, description = "Microseconds the sandbox's processes were stopped (Cubicle's own)"), ("x-cubicle-bytes" = u64, description = "Size of the checkpoint in bytes (Cubicle's own)"))),
        (status = 400, response = ErrorBody), (status = 401, response = ErrorBody),
        (status = 404, response = ErrorBody), (status = 409, response = ErrorBody),
        (status = 413, response = ErrorBody), (status = 501, response = ErrorBody),
        (status = 507, response = ErrorBody)))]
async fn snapshot(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<Response> {
    let body = read_body(body, MAX_BODY).await?;
    cp.owned(&team, &id).await?;
    let cmd = CreateSnapshot::parse(&body, &team.name)?;
    let (info, frozen, bytes) = cp.snapshot(&team, &id, cmd).await?;
    let mut resp = (StatusCode::CREATED, Json(info)).into_response();
    checkpoint_headers(&mut resp, frozen, bytes);
    Ok(resp)
}

/// The team's snapshots, newest first; a further page's cursor is the `X-Next-Token`
/// answer header (sent back as `?nextToken=`, not described here: only the server's own
/// cursors are valid).
#[utoipa::path(get, path = "/snapshots", tag = "sandboxes",
    params(("sandboxID" = Option<String>, Query, description = "Only snapshots of this sandbox"),
        ("name" = Option<String>, Query, description = "Only snapshots with this name"),
        ("limit" = Option<i64>, Query, minimum = 1, maximum = 100, description = "Snapshots per page (default 100)")),
    responses((status = 200, body = Vec<Object>), (status = 400, response = ErrorBody), (status = 401, response = ErrorBody)))]
async fn list_snapshots(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let q = ListSnapshots::parse(&Query::parse(q.as_deref())?)?;
    let (items, next) = cp.list_snapshots(&team, &q)?;
    let mut resp = (StatusCode::OK, Json(items)).into_response();
    if let Some(next) = next
        && let Ok(v) = HeaderValue::from_str(&next)
    {
        resp.headers_mut().insert("x-next-token", v);
    }
    Ok(resp)
}

/// Delete a snapshot or a template of the team (snapshots are usable as templates; a
/// template still used by a sandbox, paused ones included, or a snapshot: 400).
#[utoipa::path(delete, path = "/templates/{id}", tag = "templates",
    params(("id" = String, Path, description = "Snapshot id or name, or template name")),
    responses((status = 204, description = "Deleted"), (status = 400, response = ErrorBody),
        (status = 401, response = ErrorBody), (status = 404, response = ErrorBody),
        (status = 409, response = ErrorBody)))]
async fn delete_template(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    if cp.team_snapshot(&team, &id).is_some() {
        cp.delete_snapshot(&team, &id).await?;
    } else if crate::templates::parse(&id).is_err() || absent_on_nodes(&cp, &id) {
        // Neither a snapshot nor a well-formed template name (or one no node has):
        // nothing by that name.
        return Err(ApiError::NotFound(format!("template '{id}' not found")));
    } else {
        crate::template_builds::delete_template(&cp, &team, &id).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

/// On a replica (a backend without a template store of its own), whether no node has
/// template `id`: its delete is a 404 as on a single host (another team's snapshot, a
/// name nobody has), not "cannot build templates".
fn absent_on_nodes(cp: &ControlPlane, id: &str) -> bool {
    cp.backend().templates().is_none() && !cp.backend().template_exists(id).unwrap_or(true)
}

/// Fork a running sandbox into `count` new ones with its memory and disk.
#[utoipa::path(post, path = "/sandboxes/{id}/fork", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body(content = Option<crate::commands::ForkBody>, description = "Empty: one fork living 15 s"),
    responses((status = 201, body = Vec<ForkResult>, description = "One entry per fork: its sandbox or its error"),
        (status = 400, response = ErrorBody), (status = 401, response = ErrorBody),
        (status = 404, response = ErrorBody), (status = 409, response = ErrorBody),
        (status = 413, response = ErrorBody), (status = 501, response = ErrorBody),
        (status = 503, response = ErrorBody),
        (status = 507, response = ErrorBody)))]
async fn fork(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<Response> {
    let body = read_body(body, MAX_BODY).await?;
    cp.owned_live(&team, &id).await?;
    let cmd = Fork::parse(&body, &cp.config().limits)?;
    let results = cp.fork(&team, &id, cmd).await?;
    Ok((StatusCode::CREATED, Json(results)).into_response())
}

/// Put a sandbox (running or paused) back to one of its own snapshots, in place
/// (Cubicle's own).
#[utoipa::path(post, path = "/sandboxes/{id}/rollback", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = crate::commands::RollbackBody,
    responses((status = 200, body = Sandbox, description = "Rolled back"),
        (status = 400, response = ErrorBody),
        (status = 401, response = ErrorBody), (status = 404, response = ErrorBody),
        (status = 409, response = ErrorBody),
        (status = 413, response = ErrorBody), (status = 501, response = ErrorBody)))]
async fn rollback(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<Response> {
    let body = read_body(body, MAX_BODY).await?;
    cp.owned_live(&team, &id).await?;
    let cmd = Rollback::parse(&body)?;
    let sandbox = cp.rollback(&team, &id, cmd).await?;
    Ok((StatusCode::OK, Json(sandbox)).into_response())
}

// ---- lifecycle events and webhooks (E2B's events API) ----

/// The team's sandbox lifecycle events, newest first unless `orderAsc`.
#[utoipa::path(get, path = "/events/sandboxes", tag = "events",
    params(
        ("offset" = Option<i64>, Query, minimum = 0, description = "Events to skip"),
        ("limit" = Option<i32>, Query, minimum = 1, maximum = 100, description = "Events to return (default 10)"),
        ("orderAsc" = Option<bool>, Query, description = "Oldest first"),
        ("types" = Option<Vec<crate::webhooks::EventType>>, Query, style = Form, explode, description = "Only these types (repeatable)")),
    responses((status = 200, body = Vec<SandboxEvent>), (status = 400, response = ErrorBody), (status = 401, response = ErrorBody)))]
async fn events_team(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let q = Query::parse(q.as_deref())?;
    Ok(Json(cp.events().list(team.id, None, &q).await?).into_response())
}

/// One sandbox's lifecycle events (also after it ended, for 7 days).
#[utoipa::path(get, path = "/events/sandboxes/{id}", tag = "events",
    params(("id" = String, Path, description = "Sandbox id"),
        ("offset" = Option<i64>, Query, minimum = 0, description = "Events to skip"),
        ("limit" = Option<i32>, Query, minimum = 1, maximum = 100, description = "Events to return (default 10)"),
        ("orderAsc" = Option<bool>, Query, description = "Oldest first"),
        ("types" = Option<Vec<crate::webhooks::EventType>>, Query, style = Form, explode, description = "Only these types (repeatable)")),
    responses((status = 200, body = Vec<SandboxEvent>), (status = 400, response = ErrorBody), (status = 401, response = ErrorBody)))]
async fn events_sandbox(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let q = Query::parse(q.as_deref())?;
    Ok(Json(cp.events().list(team.id, Some(&id), &q).await?).into_response())
}

/// Register a webhook: the team's lifecycle events of the chosen types are POSTed to
/// its URL, signed with its secret.
#[utoipa::path(post, path = "/events/webhooks", tag = "events",
    request_body = WebhookCreate,
    responses((status = 201, body = Webhook, links(
            ("GetWebhook" = (operation_id = "webhook_get", parameters(("webhookID" = "$response.body#/id")))),
            ("UpdateWebhook" = (operation_id = "webhook_update", parameters(("webhookID" = "$response.body#/id")))),
            ("DeleteWebhook" = (operation_id = "webhook_delete", parameters(("webhookID" = "$response.body#/id")))))), (status = 400, response = ErrorBody), (status = 401, response = ErrorBody),
        (status = 409, response = ErrorBody), (status = 413, response = ErrorBody)))]
async fn webhook_create(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    body: Body,
) -> ApiResult<Response> {
    let body = read_body(body, MAX_BODY).await?;
    let w = cp.webhooks().create(&team, &body).await?;
    Ok((StatusCode::CREATED, Json(w)).into_response())
}

/// The team's webhooks.
#[utoipa::path(get, path = "/events/webhooks", tag = "events",
    responses((status = 200, body = Vec<Webhook>), (status = 401, response = ErrorBody)))]
async fn webhook_list(State(cp): Cp, Extension(team): Extension<Team>) -> Json<Vec<Webhook>> {
    Json(cp.webhooks().list(&team))
}

/// One webhook of the team.
#[utoipa::path(get, path = "/events/webhooks/{webhookID}", tag = "events",
    params(("webhookID" = String, Path, description = "Webhook id")),
    responses((status = 200, body = Webhook), (status = 401, response = ErrorBody), (status = 404, response = ErrorBody)))]
async fn webhook_get(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
) -> ApiResult<Json<Webhook>> {
    Ok(Json(cp.webhooks().get(&team, &id)?))
}

/// Change a webhook (the fields given).
#[utoipa::path(patch, path = "/events/webhooks/{webhookID}", tag = "events",
    params(("webhookID" = String, Path, description = "Webhook id")),
    request_body = WebhookUpdate,
    responses((status = 200, body = Webhook), (status = 400, response = ErrorBody), (status = 401, response = ErrorBody),
        (status = 404, response = ErrorBody), (status = 413, response = ErrorBody)))]
async fn webhook_update(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<Json<Webhook>> {
    let body = read_body(body, MAX_BODY).await?;
    Ok(Json(cp.webhooks().update(&team, &id, &body).await?))
}

/// Remove a webhook.
#[utoipa::path(delete, path = "/events/webhooks/{webhookID}", tag = "events",
    params(("webhookID" = String, Path, description = "Webhook id")),
    responses((status = 200, description = "Removed"), (status = 401, response = ErrorBody), (status = 404, response = ErrorBody)))]
async fn webhook_delete(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    cp.webhooks().delete(&team, &id).await?;
    Ok(StatusCode::OK)
}
