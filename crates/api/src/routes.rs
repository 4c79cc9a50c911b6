//! The HTTP layer: E2B routes (spec §2.3 and §2.8) → typed commands → [`ControlPlane`].
//! Handlers only read the request (raw body with a size limit, raw query) and shape
//! the response; every failure is an [`ApiError`].

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Extension, Json};
use cubicle_store::Team;

use crate::commands::{
    Connect, CreateSandbox, CreateVersion, Idempotency, ListFilter, Refresh, SetTimeout,
    UpdateNetwork,
};
use crate::error::{ApiError, ApiResult, json_errors, read_body, unknown_route};

use crate::model::{SandboxLog, SandboxLogEntry, SandboxLogs, SandboxLogsV2};
use crate::query::{Query, format_time};
use crate::service::ControlPlane;

/// Largest request body accepted.
pub const MAX_BODY: usize = 1 << 20;

type Cp = State<Arc<ControlPlane>>;

/// The REST router (no data plane): every route, auth, JSON errors everywhere.
pub fn router(cp: Arc<ControlPlane>) -> Router {
    let authed = Router::new()
        .route("/v2/sandboxes", post(create_v2).get(list_v2))
        .route("/sandboxes", post(create_v1).get(list_v1))
        .route("/sandboxes/metrics", get(metrics_many))
        .route("/sandboxes/{id}", get(detail).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/sandboxes/{id}/connect", post(connect_v1))
        .route("/v2/sandboxes/{id}/connect", post(connect_v2))
        .route("/sandboxes/{id}/logs", get(logs_v1))
        .route("/v2/sandboxes/{id}/logs", get(logs_v2))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/sandboxes/{id}/network", put(network))
        .route("/cubicle/sandboxes/{id}/netlog", get(netlog))
        .route("/sandboxes/{id}/snapshots", post(snapshot))
        .route("/sandboxes/{id}/fork", post(fork))
        // Cubicle's own: warm-pool counters for operators and `cubicle bench`.
        .route("/cubicle/pool", get(pool_stats))
        .merge(crate::volumes::routes())
        .merge(crate::secrets::routes())
        .merge(crate::template_builds::authed_routes())
        .route_layer(middleware::from_fn_with_state(cp.clone(), auth));
    Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .merge(crate::template_builds::upload_routes())
        .merge(authed)
        // Authenticated by the volume's token, not an API key.
        .merge(crate::volume_content::routes())
        .fallback(unknown_route)
        .layer(middleware::map_response(json_errors))
        .with_state(cp)
}

/// `GET /cubicle/pool`: the node's warm-pool counters.
async fn pool_stats(State(cp): Cp) -> Json<serde_json::Value> {
    Json(cp.backend().pool_stats())
}

/// `X-API-KEY` → the caller's [`Team`] (in the request extensions), or 401.
async fn auth(State(cp): Cp, mut req: Request, next: Next) -> Response {
    let key = req
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .map(str::to_string);
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

async fn create_v2(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    create(cp, team, headers, body, CreateVersion::V2).await
}

async fn create_v1(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    create(cp, team, headers, body, CreateVersion::V1).await
}

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

async fn list_v1(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let filter = ListFilter::v1(&Query::parse(q.as_deref())?)?;
    let (items, _) = cp.list(&team, &filter).await?;
    Ok(Json(items).into_response())
}

async fn detail(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    Ok(Json(cp.detail(&team, &id).await?).into_response())
}

async fn kill(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    cp.kill(&team, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

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
    cp.owned(&team, &id).await?;
    let cmd = Connect::parse(&body, version, &cp.config().limits)?;
    let sandbox = cp.connect(&team, &id, cmd).await?;
    // 200: it was running (201 would mean "resumed").
    Ok((StatusCode::OK, Json(sandbox)).into_response())
}

async fn connect_v2(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<Response> {
    connect(cp, team, id, body, CreateVersion::V2).await
}

async fn connect_v1(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<Response> {
    connect(cp, team, id, body, CreateVersion::V1).await
}

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

async fn metrics(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let q = Query::parse(q.as_deref())?;
    let start = q.int("start", 0..=i64::MAX)?;
    let end = q.int("end", 0..=i64::MAX)?;
    if let (Some(s), Some(e)) = (start, end)
        && s > e
    {
        return Err(ApiError::BadRequest("start must not be after end".into()));
    }
    Ok(Json(cp.metrics(&team, &id, start, end).await?).into_response())
}

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
    if let (Some(s), Some(e)) = (start, end)
        && s > e
    {
        return Err(ApiError::BadRequest("start must not be after end".into()));
    }
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

async fn not_yet(cp: &ControlPlane, team: &Team, id: &str, what: &str) -> ApiResult<StatusCode> {
    cp.owned(team, id).await?;
    Err(ApiError::NotImplemented(format!(
        "{what} is not supported by Cubicle yet"
    )))
}

async fn pause(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    not_yet(&cp, &team, &id, "Pausing a sandbox").await
}

async fn resume(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    not_yet(&cp, &team, &id, "Resuming a sandbox").await
}

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
    if q.get("allowlist") == Some("true") {
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

async fn snapshot(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    not_yet(&cp, &team, &id, "Snapshotting a sandbox").await
}

async fn fork(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    not_yet(&cp, &team, &id, "Forking a sandbox").await
}
