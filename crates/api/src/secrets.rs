//! E2B's secrets (`X-API-KEY`): `POST/GET /secrets`, `GET/POST/DELETE /secrets/{s}`.
//!
//! Values are write-only: create and update take one, nothing ever returns it. It is
//! sealed (`keyring.rs`: XChaCha20-Poly1305 under the server's key, bound to the
//! secret's id) before it reaches the store, so the database never holds it in clear,
//! and it is never logged (a malformed body is refused without echoing it). The one
//! reader is [`ControlPlane::secret_value`], for the egress layer that adds it to the
//! outbound requests a sandbox's network rules name (`${e2b.secrets.<name>}`) — the
//! value never enters a sandbox.
//!
//! `{s}` is a secret's id (`sec_` prefix, any case) or its name; names are stored
//! lowercase (`^[a-zA-Z0-9_-]{1,128}$`, the `sec_` prefix reserved), unique per team
//! (409 for a taken one). A value must be usable in an HTTP header (no CR, LF or NUL;
//! at most [`MAX_VALUE`] bytes). Metadata: at most 32 entries, keys ≤ 128 bytes, values
//! ≤ 1024, 8192 in all. Lists are ordered by name, `limit` (1–100, default 100) per page,
//! `X-Next-Token` while more remain.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use base64::Engine;
use cubicle_store::{SecretRow, Team, now_ms};
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::{ApiError, ApiResult, ErrorBody, read_body};
use crate::query::{Query, format_time};
use crate::service::ControlPlane;

/// Longest secret value, bytes.
pub const MAX_VALUE: usize = 8192;
/// Largest request body of the secret routes.
const MAX_SECRET_BODY: usize = 64 << 10;

/// `Secret` (never with its value).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[schema(as = Secret)]
#[serde(rename_all = "camelCase")]
pub struct SecretBody {
    #[serde(rename = "secretID")]
    pub secret_id: String,
    pub name: String,
    pub current_version: i64,
    pub metadata: BTreeMap<String, String>,
    pub created_at: String,
    pub updated_at: String,
}

impl From<SecretRow> for SecretBody {
    fn from(r: SecretRow) -> Self {
        SecretBody {
            secret_id: r.id,
            name: r.name,
            current_version: r.version,
            metadata: r.metadata,
            created_at: format_time(r.created_at),
            updated_at: format_time(r.updated_at),
        }
    }
}

/// `NewSecret` (create).
#[derive(Deserialize, utoipa::ToSchema)]
#[schema(as = NewSecret)]
pub struct NewSecretBody {
    /// Unique in the team, case-insensitive; `sec_` is reserved (ids).
    #[schema(pattern = "^(?![sS][eE][cC]_)[a-zA-Z0-9_-]{1,128}$")]
    name: String,
    /// The value (write-only): 1 to 8192 bytes, usable in an HTTP header.
    #[schema(pattern = "^[^\\r\\n\\x00]+$", max_length = 8192)]
    value: String,
    /// At most 32 entries, keys of 1-128 bytes, values up to 1024, 8192 bytes in all.
    #[schema(schema_with = secret_metadata)]
    metadata: Option<BTreeMap<String, String>>,
}

/// `SecretUpdate` (a new version).
#[derive(Deserialize, utoipa::ToSchema)]
#[schema(as = SecretUpdate)]
pub struct SecretUpdateBody {
    /// The new value (write-only): 1 to 8192 bytes, usable in an HTTP header.
    #[schema(pattern = "^[^\\r\\n\\x00]+$", max_length = 8192)]
    value: String,
    /// Replaces the metadata when given.
    #[schema(schema_with = secret_metadata)]
    metadata: Option<BTreeMap<String, String>>,
}

/// `metadata` of a secret as [`check_metadata`] accepts it (lengths are bytes there,
/// characters here; the 8192-byte total is not expressible).
fn secret_metadata() -> utoipa::openapi::schema::Schema {
    serde_json::from_value(serde_json::json!({
        "type": ["object", "null"],
        "maxProperties": 32,
        "propertyNames": {"type": "string", "minLength": 1, "maxLength": 128},
        "additionalProperties": {"type": "string", "maxLength": 1024},
        "description": "At most 32 entries, keys of 1-128 bytes, values up to 1024 bytes, 8192 \
            bytes in all.",
    }))
    .unwrap_or_else(|_| utoipa::openapi::schema::Schema::Object(Default::default()))
}

/// The secret routes (mounted behind the API-key check).
pub fn routes() -> OpenApiRouter<Arc<ControlPlane>> {
    OpenApiRouter::new()
        .routes(routes!(create, list))
        .routes(routes!(detail, update, destroy))
}

type Cp = State<Arc<ControlPlane>>;

/// Whether `s` names a secret by id (`sec_` prefix, any case).
fn is_id(s: &str) -> bool {
    // `get`: a path segment may be any UTF-8, and byte 4 need not be a char boundary.
    s.len() > 4 && s.get(..4).is_some_and(|p| p.eq_ignore_ascii_case("sec_"))
}

/// The canonical (lowercase) form of a valid name.
pub fn canonical_name(name: &str) -> ApiResult<String> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if !ok {
        return Err(ApiError::BadRequest(format!(
            "invalid secret name '{}': use 1-128 of [a-zA-Z0-9_-]",
            name.escape_debug()
        )));
    }
    if is_id(name) {
        return Err(ApiError::BadRequest(
            "secret names must not start with 'sec_' (the prefix of secret ids)".into(),
        ));
    }
    Ok(name.to_ascii_lowercase())
}

fn check_value(value: &str) -> ApiResult<()> {
    if value.is_empty() || value.len() > MAX_VALUE {
        return Err(ApiError::BadRequest(format!(
            "a secret value must have 1 to {MAX_VALUE} bytes"
        )));
    }
    if value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
        return Err(ApiError::BadRequest(
            "a secret value must be usable in an HTTP header: no CR, LF or NUL".into(),
        ));
    }
    Ok(())
}

fn check_metadata(m: &BTreeMap<String, String>) -> ApiResult<()> {
    let total: usize = m.iter().map(|(k, v)| k.len() + v.len()).sum();
    if m.len() > 32
        || total > 8192
        || m.iter()
            .any(|(k, v)| k.is_empty() || k.len() > 128 || v.len() > 1024)
    {
        return Err(ApiError::BadRequest(
            "secret metadata: at most 32 entries, keys of 1-128 bytes, values up to 1024, 8192 bytes in all"
                .into(),
        ));
    }
    Ok(())
}

/// Parses a secret body without ever echoing it (it holds a value).
fn parse<T: serde::de::DeserializeOwned>(body: &[u8], shape: &str) -> ApiResult<T> {
    let bad = || ApiError::BadRequest(format!("invalid secret body: expected {shape}"));
    // serde would also fill a struct from an array.
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err(bad());
    }
    serde_json::from_slice(body).map_err(|_| bad())
}

fn new_secret_id() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    let tail: String = (0..24)
        .map(|_| ALPHABET[rand::Rng::random_range(&mut rng, 0..ALPHABET.len())] as char)
        .collect();
    format!("sec_{tail}")
}

fn not_found(s: &str) -> ApiError {
    ApiError::NotFound(format!("secret '{s}' not found"))
}

impl ControlPlane {
    /// A team's secret by id or name.
    fn find_secret(&self, team: &Team, s: &str) -> ApiResult<SecretRow> {
        let key = if is_id(s) {
            s.to_ascii_lowercase()
        } else {
            canonical_name(s).map_err(|_| not_found(s))?
        };
        self.store()
            .read(|st| st.secret(team.id, &key))?
            .ok_or_else(|| not_found(s))
    }

    /// The value of `team`'s secret `name` (canonical), unsealed: for the egress layer
    /// only. `None`: no such secret, or its value does not open (another key).
    pub fn secret_value(&self, team_id: i64, name: &str) -> Option<Zeroizing<Vec<u8>>> {
        let name = name.to_ascii_lowercase();
        let (id, _, sealed) = self
            .store()
            .read(|s| s.sealed_secret(team_id, &name))
            .ok()
            .flatten()?;
        let value = self.config().keyring.unseal(&id, &sealed);
        if value.is_none() {
            tracing::warn!(secret = %id, "a secret's value does not open with this server's key");
        }
        value
    }
}

impl ControlPlane {
    /// Every `${e2b.secrets.NAME}` the policy's header rules use names one of the team's
    /// secrets (400 naming the first that does not). A secret deleted later fails the
    /// requests that need it in the egress proxy instead (docs/network.md).
    pub(crate) fn check_rule_secrets(
        &self,
        team: &Team,
        policy: &cubicle_node::NetworkPolicy,
    ) -> ApiResult<()> {
        for name in cubicle_node::network_policy::secret_names(&policy.rules) {
            if self.store().read(|s| s.secret(team.id, &name))?.is_none() {
                return Err(ApiError::BadRequest(format!(
                    "network.rules: secret '{name}' does not exist (create it with POST /secrets first)"
                )));
            }
        }
        Ok(())
    }
}

/// The egress proxy's source of secret values: the team that owns the sandbox (from the
/// store) and its sealed secret, opened with the server's key. Holds the control plane
/// weakly (the node outlives nothing it points to).
pub struct StoreSecrets(pub std::sync::Weak<ControlPlane>);

impl cubicle_node::SecretSource for StoreSecrets {
    fn secret(&self, sandbox_id: &str, name: &str) -> Option<Zeroizing<Vec<u8>>> {
        let cp = self.0.upgrade()?;
        let team_id = cp
            .store()
            .read(|s| s.sandbox(sandbox_id))
            .ok()
            .flatten()?
            .team_id;
        cp.secret_value(team_id, name)
    }
}

/// Create a secret of the team.
#[utoipa::path(post, operation_id = "secret_create", path = "/secrets", tag = "secrets",
    request_body = NewSecretBody,
    responses((status = 201, body = SecretBody), (status = 400, response = ErrorBody),
        (status = 401, response = ErrorBody), (status = 409, response = ErrorBody),
        (status = 413, response = ErrorBody)))]
async fn create(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    body: Body,
) -> ApiResult<Response> {
    let raw = Zeroizing::new(read_body(body, MAX_SECRET_BODY).await?.to_vec());
    let b: NewSecretBody = parse(&raw, "{name, value, metadata?}")?;
    let value = Zeroizing::new(b.value);
    let name = canonical_name(&b.name)?;
    check_value(&value)?;
    let metadata = b.metadata.unwrap_or_default();
    check_metadata(&metadata)?;
    let now = now_ms();
    let mut id = new_secret_id();
    while cp.store().read(|s| s.secret_id_taken(&id))? {
        id = new_secret_id();
    }
    let sealed = cp.config().keyring.seal(&id, value.as_bytes());
    let row = SecretRow {
        id,
        team_id: team.id,
        name,
        version: 1,
        metadata,
        created_at: now,
        updated_at: now,
    };
    let r2 = row.clone();
    cp.store()
        .call(move |s| s.insert_secret(&r2, &sealed))
        .await?;
    tracing::info!(secret = %row.id, name = %row.name, team = %team.name, "secret created");
    Ok((StatusCode::CREATED, Json(SecretBody::from(row))).into_response())
}

/// The team's secrets by name, one page (`X-Next-Token` names the next).
#[utoipa::path(get, operation_id = "secret_list", path = "/secrets", tag = "secrets",
    params(("limit" = Option<i64>, Query, minimum = 1, maximum = 100, description = "Page size (default 100)")),
    responses((status = 200, body = Vec<SecretBody>, headers(("x-next-token" = String, description = "The next page's token, when there is one"))),
        (status = 400, response = ErrorBody), (status = 401, response = ErrorBody)))]
async fn list(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let q = Query::parse(q.as_deref())?;
    let limit = q.int("limit", 1..=100)?.unwrap_or(100) as usize;
    let after = match q.get("nextToken").filter(|t| !t.is_empty()) {
        Some(t) => Some(
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(t)
                .ok()
                .and_then(|b| String::from_utf8(b).ok())
                .ok_or_else(|| ApiError::BadRequest("invalid nextToken".into()))?,
        ),
        None => None,
    };
    let team_id = team.id;
    let mut rows = cp
        .store()
        .call(move |s| s.secrets(team_id, after.as_deref(), limit + 1))
        .await?;
    let more = rows.len() > limit;
    rows.truncate(limit);
    let next = more
        .then(|| rows.last())
        .flatten()
        .map(|r| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&r.name));
    let items: Vec<SecretBody> = rows.into_iter().map(SecretBody::from).collect();
    let mut resp = Json(items).into_response();
    if let Some(t) = next
        && let Ok(v) = HeaderValue::from_str(&t)
    {
        resp.headers_mut().insert("x-next-token", v);
    }
    Ok(resp)
}

/// One secret of the team (without its value).
#[utoipa::path(get, operation_id = "secret_detail", path = "/secrets/{s}", tag = "secrets",
    params(("s" = String, Path, description = "Secret id (`sec_…`) or name")),
    responses((status = 200, body = SecretBody), (status = 401, response = ErrorBody), (status = 404, response = ErrorBody)))]
async fn detail(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(s): Path<String>,
) -> ApiResult<Response> {
    Ok(Json(SecretBody::from(cp.find_secret(&team, &s)?)).into_response())
}

/// A new value (and metadata) for a secret of the team.
#[utoipa::path(post, operation_id = "secret_update", path = "/secrets/{s}", tag = "secrets",
    params(("s" = String, Path, description = "Secret id (`sec_…`) or name")),
    request_body = SecretUpdateBody,
    responses((status = 200, body = SecretBody), (status = 400, response = ErrorBody),
        (status = 401, response = ErrorBody), (status = 404, response = ErrorBody), (status = 413, response = ErrorBody)))]
async fn update(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(s): Path<String>,
    body: Body,
) -> ApiResult<Response> {
    let raw = Zeroizing::new(read_body(body, MAX_SECRET_BODY).await?.to_vec());
    let row = cp.find_secret(&team, &s)?;
    let b: SecretUpdateBody = parse(&raw, "{value, metadata?}")?;
    let value = Zeroizing::new(b.value);
    check_value(&value)?;
    if let Some(m) = &b.metadata {
        check_metadata(m)?;
    }
    let sealed = cp.config().keyring.seal(&row.id, value.as_bytes());
    let (team_id, id, metadata) = (team.id, row.id.clone(), b.metadata);
    let updated = cp
        .store()
        .call(move |st| st.update_secret(team_id, &id, &sealed, metadata.as_ref(), now_ms()))
        .await?
        .ok_or_else(|| not_found(&s))?;
    tracing::info!(secret = %updated.id, version = updated.version, team = %team.name, "secret updated");
    Ok(Json(SecretBody::from(updated)).into_response())
}

/// Delete a secret of the team.
#[utoipa::path(delete, operation_id = "secret_destroy", path = "/secrets/{s}", tag = "secrets",
    params(("s" = String, Path, description = "Secret id (`sec_…`) or name")),
    responses((status = 204, description = "Deleted"), (status = 401, response = ErrorBody), (status = 404, response = ErrorBody)))]
async fn destroy(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(s): Path<String>,
) -> ApiResult<StatusCode> {
    let row = cp.find_secret(&team, &s)?;
    let (team_id, id) = (team.id, row.id.clone());
    if !cp
        .store()
        .call(move |st| st.delete_secret(team_id, &id))
        .await?
    {
        return Err(not_found(&s));
    }
    tracing::info!(secret = %row.id, team = %team.name, "secret deleted");
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_values_metadata() {
        assert_eq!(canonical_name("My-Key_1").unwrap(), "my-key_1");
        for bad in ["", "a b", "a.b", "sec_x", "SEC_x", &"x".repeat(129), "ä"] {
            assert!(canonical_name(bad).is_err(), "{bad:?}");
        }
        check_value("Bearer abc").unwrap();
        for bad in [
            "",
            "a\r\nX-Evil: 1",
            "a\nb",
            "a\0b",
            &"x".repeat(MAX_VALUE + 1),
        ] {
            assert!(check_value(bad).is_err(), "{bad:?}");
        }
        let many: BTreeMap<String, String> = (0..33).map(|i| (i.to_string(), "v".into())).collect();
        assert!(check_metadata(&many).is_err());
        assert!(check_metadata(&[("k".into(), "x".repeat(1025))].into()).is_err());
        check_metadata(&[("k".into(), "v".into())].into()).unwrap();
        let id = new_secret_id();
        assert!(is_id(&id) && id.len() == 28);
        assert!(is_id("SEC_abc") && !is_id("sec_") && !is_id("secret"));
        // Not a panic on a multi-byte character across byte 4 (schemathesis found it:
        // the connection was dropped).
        assert!(!is_id("0\u{80}\u{80}") && !is_id("\u{80}\u{800}"));
    }

    #[test]
    fn bodies_are_not_echoed() {
        let e = parse::<NewSecretBody>(br#"{"name": "x", "value": 12345678}"#, "{name, value}")
            .err()
            .unwrap();
        assert!(!e.to_string().contains("12345678"), "{e}");
    }
}
