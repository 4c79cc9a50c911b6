//! E2B's volume routes (`X-API-KEY`): `POST/GET /volumes`, `GET/DELETE /volumes/{id}`,
//! and what sandbox creates need of volumes (names → ids, ids → names).
//!
//! A volume belongs to the team that made it; another team's is indistinguishable from
//! a missing one (404). Names are unique per team (`^[a-zA-Z0-9_-]+$`; a taken one is a
//! 400, as upstream). The record (store) is written before the directory (node), and
//! [`ControlPlane::reconcile_volumes`] recreates a directory a crash lost in between. A
//! volume is deleted directory first: a volume a sandbox mounts is refused with 409 and
//! keeps its record.
//!
//! Each volume's `token` (for the content API, `volume_content.rs`) is derived from its id
//! with the server's key (`keyring.rs`), so it is stable and never stored; `domain` is
//! `null` (SDKs then find the content API through `E2B_VOLUME_API_URL`, which `cubicle
//! serve` prints: the API listener itself). `sizeMB` (create: optional, default
//! [`VolumeLimits::default_size_mb`]) and `usedBytes` (detail) are Cubicle's own fields.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use cubicle_node::VolumeMount;
use cubicle_store::{Team, VolumeRow, now_ms};
use serde::{Deserialize, Serialize};

use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::{ApiError, ApiResult, ErrorBody, read_body};
use crate::routes::MAX_BODY;
use crate::service::ControlPlane;

/// Volume sizes and counts.
#[derive(Debug, Clone)]
pub struct VolumeLimits {
    /// Size of a volume whose create names none, MiB.
    pub default_size_mb: u64,
    /// Largest size a create may ask for, MiB.
    pub max_size_mb: u64,
    /// Most volumes one team may have.
    pub max_per_team: usize,
}

impl Default for VolumeLimits {
    /// 10 GiB each (at most 1 TiB), 100 per team.
    fn default() -> Self {
        VolumeLimits {
            default_size_mb: 10 << 10,
            max_size_mb: 1 << 20,
            max_per_team: 100,
        }
    }
}

/// A volume mount as a create asks for it (by name).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeMountRequest {
    /// Volume name (the caller's team's).
    pub name: String,
    /// Mount point inside the sandbox.
    pub path: String,
    /// Cubicle's own: mount read-only.
    #[serde(default)]
    pub read_only: bool,
}

/// `volumeMounts` items of a sandbox detail or list item.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeMountBody {
    /// Volume name.
    pub name: String,
    /// Mount point.
    pub path: String,
    /// Cubicle's own, only when true.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
}

/// `NewVolume` (create).
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = NewVolume)]
pub struct NewVolumeBody {
    /// Unique in the team (a taken name: 400, as upstream).
    #[schema(pattern = "^[a-zA-Z0-9_-]{1,128}$")]
    name: String,
    /// Cubicle's own: the size limit in MiB (default 10240; the maximum is the
    /// server's).
    #[serde(
        rename = "sizeMB",
        default,
        deserialize_with = "crate::commands::opt_int_like"
    )]
    #[schema(minimum = 16, maximum = 1048576)]
    size_mb: Option<i64>,
}

/// `VolumeAndToken` (create, detail).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct VolumeAndToken {
    #[serde(rename = "volumeID")]
    pub volume_id: String,
    pub name: String,
    pub token: String,
    pub domain: Option<String>,
    #[serde(rename = "sizeMB")]
    pub size_mb: u64,
    #[serde(rename = "usedBytes", skip_serializing_if = "Option::is_none")]
    pub used_bytes: Option<u64>,
}

/// `Volume` (list items).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ListedVolume {
    #[serde(rename = "volumeID")]
    pub volume_id: String,
    pub name: String,
}

/// The `/volumes` routes (mounted behind the API-key check).
pub fn routes() -> OpenApiRouter<Arc<ControlPlane>> {
    OpenApiRouter::new()
        .routes(routes!(create, list))
        .routes(routes!(detail, destroy))
}

type Cp = State<Arc<ControlPlane>>;

/// `^[a-zA-Z0-9_-]{1,128}$`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Volume ids are UUIDs (upstream answers 400 for anything else).
fn check_id(id: &str) -> ApiResult<()> {
    let b = id.as_bytes();
    let ok = b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_hexdigit(),
        });
    if ok {
        Ok(())
    } else {
        Err(ApiError::BadRequest(format!(
            "invalid volume ID '{id}': expected a UUID"
        )))
    }
}

fn new_uuid() -> String {
    let mut b = [0u8; 16];
    rand::Rng::fill(&mut rand::rng(), &mut b[..]);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound(format!("volume '{id}' not found"))
}

impl ControlPlane {
    /// A volume of `team` by id, or 404.
    pub fn team_volume(&self, team: &Team, id: &str) -> ApiResult<VolumeRow> {
        check_id(id)?;
        self.store()
            .read(|s| s.volume(id))?
            .filter(|v| v.team_id == team.id)
            .ok_or_else(|| not_found(id))
    }

    /// `POST /volumes`.
    pub async fn create_volume(
        &self,
        team: &Team,
        name: &str,
        size_mb: Option<u64>,
    ) -> ApiResult<VolumeRow> {
        if !valid_name(name) {
            return Err(ApiError::BadRequest(format!(
                "invalid volume name '{name}': use 1-128 of [a-zA-Z0-9_-]"
            )));
        }
        let limits = &self.config().volumes;
        let size_mb = size_mb.unwrap_or(limits.default_size_mb);
        let range = cubicle_node::volume::VOLUME_SIZE_MB;
        if !range.contains(&size_mb) || size_mb > limits.max_size_mb {
            return Err(ApiError::BadRequest(format!(
                "sizeMB {size_mb} must be between {} and {}",
                range.start(),
                limits.max_size_mb.min(*range.end())
            )));
        }
        let team_id = team.id;
        let count = self
            .store()
            .call(move |s| s.volumes(Some(team_id)))
            .await?
            .len();
        if count >= limits.max_per_team {
            return Err(ApiError::BadRequest(format!(
                "the team has {count} volumes, the most allowed; delete one first"
            )));
        }
        let row = VolumeRow {
            id: new_uuid(),
            team_id,
            name: name.to_string(),
            size_mb,
            created_at: now_ms(),
        };
        let r2 = row.clone();
        self.store()
            .call(move |s| s.insert_volume(&r2))
            .await
            .map_err(|e| match e {
                // Upstream answers a taken name with 400.
                cubicle_store::Error::Conflict(m) => ApiError::BadRequest(m),
                e => e.into(),
            })?;
        if let Err(e) = self.backend().create_volume(&row.id, size_mb).await {
            let id = row.id.clone();
            let _ = self.store().call(move |s| s.delete_volume(&id)).await;
            return Err(e.into());
        }
        tracing::info!(volume = %row.id, name = %row.name, team = %team.name, size_mb, "volume created");
        Ok(row)
    }

    /// `DELETE /volumes/{id}`: refused (409) while a sandbox mounts it.
    pub async fn delete_volume(&self, team: &Team, id: &str) -> ApiResult<()> {
        let row = self.team_volume(team, id)?;
        self.backend().delete_volume(&row.id).await?;
        let id2 = row.id.clone();
        self.store().call(move |s| s.delete_volume(&id2)).await?;
        tracing::info!(volume = %row.id, name = %row.name, team = %team.name, "volume deleted");
        Ok(())
    }

    /// The body of a volume with its token (and its use, when `usage`).
    fn volume_body(&self, row: &VolumeRow, usage: bool) -> VolumeAndToken {
        VolumeAndToken {
            volume_id: row.id.clone(),
            name: row.name.clone(),
            token: self.config().keyring.volume_token(&row.id),
            domain: None,
            size_mb: row.size_mb,
            used_bytes: usage
                .then(|| self.backend().volume_usage(&row.id).ok().map(|u| u.0))
                .flatten(),
        }
    }

    /// The volume mounts of a create, resolved for `team`: unknown names are a 404 (as
    /// an unknown template), bad paths a 400.
    pub fn resolve_mounts(
        &self,
        team: &Team,
        mounts: &[VolumeMountRequest],
    ) -> ApiResult<Vec<VolumeMount>> {
        let mut out = Vec::with_capacity(mounts.len());
        for m in mounts {
            let row = self
                .store()
                .read(|s| s.volume_by_name(team.id, &m.name))?
                .ok_or_else(|| {
                    ApiError::NotFound(format!(
                        "volume '{}' not found (create it with Volume.create first)",
                        m.name
                    ))
                })?;
            out.push(VolumeMount {
                volume_id: row.id,
                path: m.path.clone(),
                read_only: m.read_only,
            });
        }
        cubicle_node::volume::check_mounts(&out)?;
        Ok(out)
    }

    /// `volumeMounts` of a sandbox: names from the store (a volume deleted meanwhile
    /// shows its id).
    pub fn mount_bodies(&self, mounts: &[VolumeMount]) -> Vec<VolumeMountBody> {
        mounts
            .iter()
            .map(|m| VolumeMountBody {
                name: self
                    .store()
                    .read(|s| s.volume(&m.volume_id))
                    .ok()
                    .flatten()
                    .map_or_else(|| m.volume_id.clone(), |v| v.name),
                path: m.path.clone(),
                read_only: m.read_only,
            })
            .collect()
    }

    /// At start: every recorded volume has its directory (one a crash lost between the
    /// record and the directory is made again, empty), and directories without a record
    /// are reported (never deleted: they hold data).
    pub async fn reconcile_volumes(&self) -> ApiResult<()> {
        let on_disk = match self.backend().reconcile_volumes().await {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!("volumes unavailable: {e}");
                return Ok(());
            }
        };
        let rows = self.store().call(|s| s.volumes(None)).await?;
        for row in &rows {
            if !on_disk.contains(&row.id) {
                tracing::warn!(volume = %row.id, name = %row.name, "volume directory missing; making it again (empty)");
                if let Err(e) = self.backend().create_volume(&row.id, row.size_mb).await {
                    tracing::error!(volume = %row.id, "cannot make the volume's directory: {e}");
                }
            }
        }
        for id in on_disk {
            if !rows.iter().any(|r| r.id == id) {
                tracing::warn!(volume = %id, "a volume directory no record knows (left in place)");
            }
        }
        Ok(())
    }
}

/// Create a volume of the team.
#[utoipa::path(post, operation_id = "volume_create", path = "/volumes", tag = "volumes",
    request_body = NewVolumeBody,
    responses((status = 201, body = VolumeAndToken), (status = 400, response = ErrorBody),
        (status = 401, response = ErrorBody), (status = 413, response = ErrorBody),
        (status = 503, response = ErrorBody)))]
async fn create(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    body: Body,
) -> ApiResult<Response> {
    let body = read_body(body, MAX_BODY).await?;
    let b: NewVolumeBody = crate::commands::json(&body, None)?;
    let size_mb = match b.size_mb {
        Some(n) if n < 0 => {
            return Err(ApiError::BadRequest(format!(
                "sizeMB must be positive, got {n}"
            )));
        }
        n => n.map(|n| n as u64),
    };
    let row = cp.create_volume(&team, &b.name, size_mb).await?;
    Ok((StatusCode::CREATED, Json(cp.volume_body(&row, false))).into_response())
}

/// The team's volumes.
#[utoipa::path(get, operation_id = "volume_list", path = "/volumes", tag = "volumes",
    responses((status = 200, body = Vec<ListedVolume>), (status = 401, response = ErrorBody)))]
async fn list(State(cp): Cp, Extension(team): Extension<Team>) -> ApiResult<Response> {
    let team_id = team.id;
    let rows = cp.store().call(move |s| s.volumes(Some(team_id))).await?;
    let items: Vec<ListedVolume> = rows
        .into_iter()
        .map(|r| ListedVolume {
            volume_id: r.id,
            name: r.name,
        })
        .collect();
    Ok(Json(items).into_response())
}

/// One volume of the team, with its content token and its use.
#[utoipa::path(get, operation_id = "volume_detail", path = "/volumes/{volumeID}", tag = "volumes",
    params(("volumeID" = String, Path, description = "Volume id (a UUID)", pattern = "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")),
    responses((status = 200, body = VolumeAndToken), (status = 400, response = ErrorBody),
        (status = 401, response = ErrorBody), (status = 404, response = ErrorBody)))]
async fn detail(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let row = cp.team_volume(&team, &id)?;
    let cp2 = cp.clone();
    let body = tokio::task::spawn_blocking(move || cp2.volume_body(&row, true))
        .await
        .map_err(|e| ApiError::Internal(format!("volume task: {e}")))?;
    Ok(Json(body).into_response())
}

/// Delete a volume of the team and its files.
#[utoipa::path(delete, operation_id = "volume_destroy", path = "/volumes/{volumeID}", tag = "volumes",
    params(("volumeID" = String, Path, description = "Volume id (a UUID)", pattern = "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")),
    responses((status = 204, description = "Deleted"), (status = 400, response = ErrorBody),
        (status = 401, response = ErrorBody), (status = 404, response = ErrorBody),
        (status = 409, response = ErrorBody)))]
async fn destroy(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    cp.delete_volume(&team, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_ids() {
        assert!(valid_name("vol_A-1"));
        for bad in ["", "a b", "a/b", "ä", &"x".repeat(129)] {
            assert!(!valid_name(bad), "{bad:?}");
        }
        let id = new_uuid();
        check_id(&id).unwrap();
        assert_eq!(&id[14..15], "4");
        assert!(check_id("not-a-uuid").is_err());
        assert!(check_id("../../../../etc/passwd-000000000000000").is_err());
    }
}
