//! Cubicle's own routes for the people who run it, used by `cubicle sandbox` and the web
//! dashboard ([`crate::dashboard`]):
//!
//! - `GET /cubicle/whoami`: the caller's team, whether it is the operator (team
//!   `admin`), and the node's limits a create may ask for;
//! - `GET|POST /cubicle/api-keys`, `DELETE /cubicle/api-keys/{prefix}`: API keys — a
//!   team sees, creates and revokes its own; the operator every team's;
//! - `GET /cubicle/sandboxes`, `DELETE /cubicle/sandboxes/{id}`: the operator's view
//!   across teams — every live sandbox on this node with its team, and killing any of
//!   them (as its own team would: the owner's webhooks hear of it).
//!
//! Every other route keeps E2B's rule that a team sees only its own sandboxes, the
//! operator's team included.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use cubicle_node::SandboxState;
use cubicle_store::{ApiKeyInfo, Team};
use serde::{Deserialize, Serialize};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::{ApiError, ApiResult, ErrorBody, read_body};
use crate::model::ListedSandbox;
use crate::query::format_time;
use crate::service::ControlPlane;

type Cp = State<Arc<ControlPlane>>;

/// The routes of this file (behind the API key check of [`crate::routes`]).
pub fn routes() -> OpenApiRouter<Arc<ControlPlane>> {
    OpenApiRouter::new()
        .routes(routes!(whoami))
        .routes(routes!(api_keys, api_key_create))
        .routes(routes!(api_key_revoke))
        .routes(routes!(all_sandboxes))
        .routes(routes!(any_sandbox_kill))
}

/// What a create may ask for on this node.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeLimits {
    /// Longest `timeout`, in seconds.
    pub max_timeout: u64,
    /// Most `cpuCount`.
    pub max_cpus: u32,
    /// Most `memoryMB`.
    #[serde(rename = "maxMemoryMB")]
    pub max_memory_mb: u64,
    /// Most `diskSizeMB`.
    #[serde(rename = "maxDiskSizeMB")]
    pub max_disk_mb: u64,
}

/// `GET /cubicle/whoami`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WhoAmI {
    /// The team the key belongs to.
    pub team: String,
    /// Whether the key is the operator's (team `admin`): it may see every team's
    /// sandboxes and keys.
    pub admin: bool,
    /// Cubicle's version.
    pub version: &'static str,
    /// The node's limits.
    pub limits: NodeLimits,
}

/// Who the key is, and what this node allows.
#[utoipa::path(get, path = "/cubicle/whoami", tag = "cubicle",
    responses((status = 200, body = WhoAmI), (status = 401, response = ErrorBody)))]
async fn whoami(State(cp): Cp, Extension(team): Extension<Team>) -> Json<WhoAmI> {
    let l = &cp.config().limits;
    Json(WhoAmI {
        admin: cp.is_admin(&team),
        team: team.name,
        version: env!("CARGO_PKG_VERSION"),
        limits: NodeLimits {
            max_timeout: l.max_timeout.as_secs(),
            max_cpus: l.max_cpus,
            max_memory_mb: l.max_memory_mb,
            max_disk_mb: l.max_disk_mb,
        },
    })
}

/// An API key as listed (never the key itself).
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApiKeyListed {
    /// The key's first characters (`e2b_` + 8), enough to revoke it.
    pub prefix: String,
    /// Its team.
    pub team: String,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339, to the minute; absent: never used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_used_at: Option<String>,
    /// RFC 3339; absent: active.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<String>,
}

impl From<ApiKeyInfo> for ApiKeyListed {
    fn from(k: ApiKeyInfo) -> Self {
        ApiKeyListed {
            prefix: k.prefix,
            team: k.team_name,
            created_at: format_time(k.created_at),
            last_used_at: k.last_used_at.map(format_time),
            revoked_at: k.revoked_at.map(format_time),
        }
    }
}

/// A new key: the only answer that carries it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApiKeyCreated {
    /// The key (shown once; only its hash is kept).
    pub key: String,
    /// Its listed facts.
    #[serde(flatten)]
    pub listed: ApiKeyListed,
}

/// `POST /cubicle/api-keys` body.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct ApiKeyCreate {
    /// Team of the new key (default: the caller's). Only the operator may name another
    /// team, which is created if missing.
    #[schema(pattern = "^[A-Za-z0-9._-]{1,64}$")]
    pub team: Option<String>,
}

/// The team's API keys (the operator: every team's), oldest first.
#[utoipa::path(get, path = "/cubicle/api-keys", tag = "cubicle",
    responses((status = 200, body = Vec<ApiKeyListed>), (status = 401, response = ErrorBody)))]
async fn api_keys(
    State(cp): Cp,
    Extension(team): Extension<Team>,
) -> ApiResult<Json<Vec<ApiKeyListed>>> {
    let all = cp.is_admin(&team);
    let keys = cp
        .store()
        .call(move |s| {
            if all {
                s.list_api_keys()
            } else {
                s.team_api_keys(team.id)
            }
        })
        .await?;
    Ok(Json(keys.into_iter().map(ApiKeyListed::from).collect()))
}

/// A new API key for the caller's team (the operator: for any team).
#[utoipa::path(post, path = "/cubicle/api-keys", tag = "cubicle",
    request_body(content = Option<ApiKeyCreate>, content_type = "application/json"),
    responses((status = 201, body = ApiKeyCreated), (status = 400, response = ErrorBody),
        (status = 401, response = ErrorBody), (status = 403, response = ErrorBody)))]
async fn api_key_create(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    body: Body,
) -> ApiResult<Response> {
    let body = read_body(body, crate::routes::MAX_BODY).await?;
    let req: ApiKeyCreate = if body.trim_ascii().is_empty() || body.trim_ascii() == b"null" {
        ApiKeyCreate::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::BadRequest(format!("invalid request body: {e}")))?
    };
    let wanted = req.team.unwrap_or_else(|| team.name.clone());
    if wanted != team.name && !cp.is_admin(&team) {
        return Err(ApiError::Forbidden(format!(
            "a key of team '{}' can only create keys for its own team",
            team.name
        )));
    }
    let key = cp
        .store()
        .call(move |s| {
            let t = s.ensure_team(&wanted)?;
            s.create_api_key(t.id)
        })
        .await?;
    tracing::info!(team = %key.info.team_name, prefix = %key.info.prefix, by = %team.name, "API key created");
    let created = ApiKeyCreated {
        key: key.plaintext,
        listed: key.info.into(),
    };
    Ok((StatusCode::CREATED, Json(created)).into_response())
}

/// Revoke the key starting with `prefix` (the team's own; the operator: any). The key
/// the request itself is made with cannot be revoked through the API (409): a client
/// would lock itself out mid-way (`cubicle apikey revoke` on the host can).
#[utoipa::path(delete, path = "/cubicle/api-keys/{prefix}", tag = "cubicle",
    params(("prefix" = String, Path, description = "The key's first characters (at least `e2b_` + 4)", pattern = "^e2b_[^/]{4,}$")),
    responses((status = 200, body = ApiKeyListed), (status = 400, response = ErrorBody),
        (status = 401, response = ErrorBody), (status = 404, response = ErrorBody), (status = 409, response = ErrorBody)))]
async fn api_key_revoke(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    headers: axum::http::HeaderMap,
    Path(prefix): Path<String>,
) -> ApiResult<Json<ApiKeyListed>> {
    if crate::routes::request_key(&headers).is_some_and(|k| k.starts_with(&prefix)) {
        return Err(ApiError::Conflict(format!(
            "'{prefix}' is the key this request is made with: revoke it with another key \
             (or `cubicle apikey revoke` on the host)"
        )));
    }
    let all = cp.is_admin(&team);
    let by = team.name.clone();
    let k = cp
        .store()
        .call(move |s| {
            if all {
                s.revoke_api_key(&prefix)
            } else {
                s.revoke_team_api_key(team.id, &prefix)
            }
        })
        .await?;
    cp.forget_keys();
    tracing::info!(team = %k.team_name, prefix = %k.prefix, by = %by, "API key revoked");
    Ok(Json(k.into()))
}

/// A sandbox in the operator's view: E2B's listed sandbox plus its team.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct HostSandbox {
    /// The team that created it.
    pub team: String,
    #[serde(flatten)]
    pub sandbox: ListedSandbox,
}

fn operator_only(cp: &ControlPlane, team: &Team) -> ApiResult<()> {
    if cp.is_admin(team) {
        Ok(())
    } else {
        Err(ApiError::Forbidden(format!(
            "the view across teams is the operator's: use a key of team '{}'",
            crate::ADMIN_TEAM
        )))
    }
}

/// Every live sandbox on this node (running or paused), of every team, oldest first
/// (operator only).
#[utoipa::path(get, path = "/cubicle/sandboxes", tag = "cubicle",
    responses((status = 200, body = Vec<HostSandbox>), (status = 401, response = ErrorBody), (status = 403, response = ErrorBody)))]
async fn all_sandboxes(
    State(cp): Cp,
    Extension(team): Extension<Team>,
) -> ApiResult<Json<Vec<HostSandbox>>> {
    operator_only(&cp, &team)?;
    let (rows, teams) = cp
        .store()
        .call(|s| {
            let rows = s.running_sandboxes(None)?;
            let mut teams = BTreeMap::new();
            for r in &rows {
                if let std::collections::btree_map::Entry::Vacant(e) = teams.entry(r.team_id)
                    && let Some(t) = s.team(r.team_id)?
                {
                    e.insert(t.name);
                }
            }
            Ok((rows, teams))
        })
        .await?;
    let mut out = Vec::new();
    for row in rows {
        let Ok(info) = cp.backend().peek(&row.id) else {
            continue;
        };
        // Paused ones too: they hold disk and a slot, and the operator kills them as well.
        if matches!(info.state, SandboxState::Dying | SandboxState::Dead) {
            continue;
        }
        out.push(HostSandbox {
            team: teams.get(&row.team_id).cloned().unwrap_or_default(),
            sandbox: cp.listed(row, &info),
        });
    }
    Ok(Json(out))
}

/// Kill any team's sandbox (operator only).
#[utoipa::path(delete, path = "/cubicle/sandboxes/{id}", tag = "cubicle",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 204, description = "Killed"), (status = 401, response = ErrorBody),
        (status = 403, response = ErrorBody), (status = 404, response = ErrorBody)))]
async fn any_sandbox_kill(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    operator_only(&cp, &team)?;
    if !cubicle_node::SandboxId::is_valid(&id) {
        return Err(ApiError::sandbox_not_found(&id));
    }
    let id2 = id.clone();
    let owner = cp
        .store()
        .call(move |s| match s.sandbox(&id2)? {
            Some(row) => s.team(row.team_id),
            None => Ok(None),
        })
        .await?
        .ok_or_else(|| ApiError::sandbox_not_found(&id))?;
    cp.kill(&owner, &id).await?;
    tracing::info!(sandbox = %id, team = %owner.name, by = %team.name, "sandbox killed by the operator");
    Ok(StatusCode::NO_CONTENT)
}
