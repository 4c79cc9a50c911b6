//! E2B's volume content API: files and directories of a volume without a sandbox
//! (`/volumecontent/{id}/{dir,path,file}`, `path` a required query parameter).
//!
//! - Auth: `Authorization: Bearer <token>` where the token is the one `/volumes` gave
//!   for that volume (derived from its id with the server's key, `keyring.rs`); no API
//!   key. A deleted volume's token opens nothing (404).
//! - Errors are `{"code": "<status>", "message": …}`: **`code` is a string here** (the
//!   control plane's is an integer), and every error carries both keys.
//! - The files are the node's ([`cubicle_node::volume::VolumeFs`]: every path resolved
//!   inside the volume, whatever symlinks sandboxes left). Owners are the ones sandboxes
//!   see (0–65535); a new entry belongs to its parent directory's owner unless `uid`/
//!   `gid` say otherwise; `mode` is decimal (`493` = 0o755).
//! - `POST …/dir` (201): `force` also makes missing parents and accepts an existing
//!   directory; without it a missing parent is 404 and an existing entry 409.
//! - `PUT …/file` (201, raw body streamed to disk): creates or overwrites the file;
//!   `force` also makes missing parent directories. A full volume answers 507.
//! - `GET …/file`: the bytes, streamed. `GET …/dir?depth=N` (default 1) lists N levels.
//! - `PATCH …/path` (JSON `{uid?, gid?, mode?}`), `DELETE …/path` (204; a directory with
//!   everything in it; not the root).

use std::io;
use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use cubicle_node::volume::{Attrs, EntryKind, Timestamp, VolumeEntry, VolumeFs};
use http_body_util::BodyExt;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::query::Query;
use crate::service::ControlPlane;

/// An error of the content API: its own body shape (string `code`).
#[derive(Debug)]
pub struct ContentError {
    status: StatusCode,
    message: String,
}

impl ContentError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ContentError {
            status,
            message: message.into(),
        }
    }
}

/// The content API's error body: `code` is the status as a string.
#[derive(Serialize, utoipa::ToSchema)]
pub struct ContentErrorBody {
    /// The HTTP status, as a string.
    #[schema(pattern = "^[0-9]{3}$")]
    code: String,
    /// What went wrong.
    message: String,
}

impl IntoResponse for ContentError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!("volume content request failed: {}", self.message);
        }
        let body = serde_json::json!({
            "code": self.status.as_u16().to_string(),
            "message": self.message,
        });
        (self.status, Json(body)).into_response()
    }
}

impl From<crate::error::ApiError> for ContentError {
    fn from(e: crate::error::ApiError) -> Self {
        ContentError::new(e.status(), e.to_string())
    }
}

impl From<cubicle_store::Error> for ContentError {
    fn from(e: cubicle_store::Error) -> Self {
        crate::error::ApiError::from(e).into()
    }
}

type CResult<T> = Result<T, ContentError>;

/// A file-operation error, with the path, as the status that fits it.
fn io_error(path: &str, e: io::Error) -> ContentError {
    use io::ErrorKind as K;
    let status = match e.raw_os_error() {
        Some(libc::EDQUOT) | Some(libc::ENOSPC) => StatusCode::INSUFFICIENT_STORAGE,
        Some(libc::ELOOP)
        | Some(libc::ENOTDIR)
        | Some(libc::EISDIR)
        | Some(libc::ENOTEMPTY)
        | Some(libc::EXDEV)
        | Some(libc::ENAMETOOLONG)
        | Some(libc::ENXIO) => StatusCode::BAD_REQUEST,
        _ => match e.kind() {
            K::NotFound => StatusCode::NOT_FOUND,
            K::AlreadyExists => StatusCode::CONFLICT,
            K::InvalidInput | K::InvalidData => StatusCode::BAD_REQUEST,
            K::PermissionDenied => StatusCode::FORBIDDEN,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        },
    };
    let what = match status {
        StatusCode::NOT_FOUND => "not found".to_string(),
        StatusCode::CONFLICT => "already exists".to_string(),
        StatusCode::INSUFFICIENT_STORAGE => {
            "the volume is full (its size limit is reached); delete files or use a larger volume"
                .to_string()
        }
        _ => e.to_string(),
    };
    ContentError::new(status, format!("{path}: {what}"))
}

/// A file's bytes as the description names them (`string`, `format: binary`).
pub(crate) struct FileBytes;

impl utoipa::PartialSchema for FileBytes {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .format(Some(utoipa::openapi::SchemaFormat::KnownFormat(
                utoipa::openapi::KnownFormat::Binary,
            )))
            .into()
    }
}

impl utoipa::ToSchema for FileBytes {}

/// `VolumeEntryStat`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = VolumeEntryStat)]
struct EntryBody {
    name: String,
    /// `file`, `directory`, `symlink` or `unknown`.
    #[serde(rename = "type")]
    #[schema(value_type = String)]
    kind: &'static str,
    path: String,
    size: u64,
    mode: u32,
    uid: u32,
    gid: u32,
    atime: String,
    mtime: String,
    ctime: String,
    /// A symlink's target.
    #[serde(skip_serializing_if = "Option::is_none")]
    target: Option<String>,
}

fn rfc3339(t: Timestamp) -> String {
    chrono::DateTime::from_timestamp(t.secs, t.nanos)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Nanos, true)
}

fn entry_body(e: VolumeEntry) -> EntryBody {
    EntryBody {
        name: e.name,
        kind: match e.kind {
            EntryKind::File => "file",
            EntryKind::Directory => "directory",
            EntryKind::Symlink => "symlink",
            EntryKind::Unknown => "unknown",
        },
        path: e.path,
        size: e.size,
        mode: e.mode,
        uid: e.uid,
        gid: e.gid,
        atime: rfc3339(e.atime),
        mtime: rfc3339(e.mtime),
        ctime: rfc3339(e.ctime),
        target: e.target,
    }
}

/// The content routes (no API key: each handler checks the volume's token).
pub fn routes() -> OpenApiRouter<Arc<ControlPlane>> {
    OpenApiRouter::new()
        .routes(routes!(list_dir, make_dir))
        .routes(routes!(stat, set_attrs, remove))
        .routes(routes!(read_file, write_file))
}

type Cp = State<Arc<ControlPlane>>;

/// The volume `id` if `headers` carry its token.
pub(crate) fn authorize(cp: &ControlPlane, id: &str, headers: &HeaderMap) -> CResult<()> {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim)
        .ok_or_else(|| {
            ContentError::new(
                StatusCode::UNAUTHORIZED,
                "missing volume token: send `Authorization: Bearer <token>` (the token GET /volumes/{id} returns)",
            )
        })?;
    if !cp.config().keyring.check_volume_token(id, token) {
        return Err(ContentError::new(
            StatusCode::UNAUTHORIZED,
            "invalid volume token for this volume",
        ));
    }
    let exists = cp.store().read(|s| s.volume(id))?.is_some();
    if !exists {
        return Err(ContentError::new(
            StatusCode::NOT_FOUND,
            format!("volume '{id}' not found"),
        ));
    }
    Ok(())
}

/// The parsed query: `path` (required) and the optional fields.
struct Params {
    path: String,
    depth: Option<u32>,
    attrs: Attrs,
    force: bool,
}

fn params(raw: Option<&str>) -> CResult<Params> {
    let q = Query::parse(raw)?;
    let path = q
        .get("path")
        .filter(|p| !p.is_empty())
        .ok_or_else(|| {
            ContentError::new(
                StatusCode::BAD_REQUEST,
                "the path query parameter is required",
            )
        })?
        .to_string();
    let int = |name: &str| -> CResult<Option<u32>> {
        Ok(q.int(name, 0..=i64::from(u32::MAX))?.map(|v| v as u32))
    };
    let force = match q.get("force") {
        None | Some("false") => false,
        Some("true") => true,
        Some(v) => {
            return Err(ContentError::new(
                StatusCode::BAD_REQUEST,
                format!("force must be true or false, got '{v}'"),
            ));
        }
    };
    Ok(Params {
        path,
        depth: int("depth")?,
        attrs: Attrs {
            uid: int("uid")?,
            gid: int("gid")?,
            mode: int("mode")?,
        },
        force,
    })
}

/// Runs `f` on the volume's tree on the blocking pool.
async fn with_fs<T: Send + 'static>(
    cp: &ControlPlane,
    id: &str,
    path: &str,
    f: impl FnOnce(VolumeFs) -> io::Result<T> + Send + 'static,
) -> CResult<T> {
    let backend = cp.backend().clone();
    let (id, p) = (id.to_string(), path.to_string());
    tokio::task::spawn_blocking(move || {
        let fs = backend.volume_fs(&id).map_err(|e| match e {
            cubicle_node::Error::VolumeNotFound(_) => {
                ContentError::new(StatusCode::NOT_FOUND, format!("volume '{id}' not found"))
            }
            e => ContentError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        })?;
        f(fs).map_err(|e| io_error(&p, e))
    })
    .await
    .map_err(|e| {
        ContentError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("volume task: {e}"),
        )
    })?
}

/// The entries below a directory of the volume.
#[utoipa::path(get, path = "/volumecontent/{volumeID}/dir", tag = "volumes", security(("VolumeToken" = [])),
    params(("volumeID" = String, Path, description = "Volume id"),
        ("path" = String, Query, min_length = 1, description = "Path inside the volume"),
        ("depth" = Option<i64>, Query, minimum = 0, maximum = 4294967295.0, description = "Levels to list (default 1)")),
    responses((status = 200, body = Vec<EntryBody>), (status = 400, body = ContentErrorBody), (status = 401, body = ContentErrorBody), (status = 403, body = ContentErrorBody),
        (status = 404, body = ContentErrorBody)))]
async fn list_dir(
    State(cp): Cp,
    Path(id): Path<String>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> CResult<Response> {
    authorize(&cp, &id, &headers)?;
    let p = params(q.as_deref())?;
    let depth = p.depth.unwrap_or(1).max(1);
    let path = p.path.clone();
    let entries = with_fs(&cp, &id, &p.path, move |fs| fs.list(&path, depth)).await?;
    let body: Vec<EntryBody> = entries.into_iter().map(entry_body).collect();
    Ok(Json(body).into_response())
}

/// Make a directory in the volume.
#[utoipa::path(post, path = "/volumecontent/{volumeID}/dir", tag = "volumes", security(("VolumeToken" = [])),
    params(("volumeID" = String, Path, description = "Volume id"),
        ("path" = String, Query, min_length = 1, description = "Path inside the volume"),
        ("uid" = Option<i64>, Query, minimum = 0, maximum = 4294967295.0, description = "Owner of a new entry"),
        ("gid" = Option<i64>, Query, minimum = 0, maximum = 4294967295.0, description = "Group of a new entry"),
        ("mode" = Option<i64>, Query, minimum = 0, maximum = 4294967295.0, description = "Mode of a new entry, decimal (493 = 0o755)"),
        ("force" = Option<bool>, Query, description = "Also make missing parents")),
    responses((status = 201, body = EntryBody), (status = 400, body = ContentErrorBody), (status = 401, body = ContentErrorBody), (status = 403, body = ContentErrorBody),
        (status = 404, body = ContentErrorBody),
        (status = 409, body = ContentErrorBody), (status = 507, body = ContentErrorBody)))]
async fn make_dir(
    State(cp): Cp,
    Path(id): Path<String>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> CResult<Response> {
    authorize(&cp, &id, &headers)?;
    let p = params(q.as_deref())?;
    let (path, attrs, force) = (p.path.clone(), p.attrs, p.force);
    let e = with_fs(&cp, &id, &p.path, move |fs| {
        fs.make_dir(&path, attrs, force)
    })
    .await?;
    Ok((StatusCode::CREATED, Json(entry_body(e))).into_response())
}

/// An entry of the volume.
#[utoipa::path(get, path = "/volumecontent/{volumeID}/path", tag = "volumes", security(("VolumeToken" = [])),
    params(("volumeID" = String, Path, description = "Volume id"),
        ("path" = String, Query, min_length = 1, description = "Path inside the volume")),
    responses((status = 200, body = EntryBody), (status = 400, body = ContentErrorBody), (status = 401, body = ContentErrorBody), (status = 403, body = ContentErrorBody),
        (status = 404, body = ContentErrorBody)))]
async fn stat(
    State(cp): Cp,
    Path(id): Path<String>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> CResult<Response> {
    authorize(&cp, &id, &headers)?;
    let p = params(q.as_deref())?;
    let path = p.path.clone();
    let e = with_fs(&cp, &id, &p.path, move |fs| fs.stat(&path)).await?;
    Ok(Json(entry_body(e)).into_response())
}

/// `PATCH …/path` body: what to change (all optional).
#[derive(Deserialize, Default, utoipa::ToSchema)]
struct AttrsBody {
    #[schema(minimum = 0, maximum = 4294967295.0)]
    #[serde(default, deserialize_with = "crate::commands::opt_int_like")]
    uid: Option<i64>,
    #[schema(minimum = 0, maximum = 4294967295.0)]
    #[serde(default, deserialize_with = "crate::commands::opt_int_like")]
    gid: Option<i64>,
    /// Decimal (493 = 0o755).
    #[schema(minimum = 0, maximum = 4294967295.0)]
    #[serde(default, deserialize_with = "crate::commands::opt_int_like")]
    mode: Option<i64>,
}

/// An attribute of [`AttrsBody`] as the file system takes it.
fn attr(name: &str, v: Option<i64>) -> CResult<Option<u32>> {
    v.map(|v| {
        u32::try_from(v).map_err(|_| {
            ContentError::new(
                StatusCode::BAD_REQUEST,
                format!("{name} must be between 0 and {}, got {v}", u32::MAX),
            )
        })
    })
    .transpose()
}

/// Change an entry's owner, group or mode.
#[utoipa::path(patch, path = "/volumecontent/{volumeID}/path", tag = "volumes", security(("VolumeToken" = [])),
    params(("volumeID" = String, Path, description = "Volume id"),
        ("path" = String, Query, min_length = 1, description = "Path inside the volume")),
    request_body(content = Option<AttrsBody>, description = "Empty: nothing changes"),
    responses((status = 200, body = EntryBody), (status = 400, body = ContentErrorBody), (status = 401, body = ContentErrorBody), (status = 403, body = ContentErrorBody),
        (status = 404, body = ContentErrorBody), (status = 413, body = ContentErrorBody)))]
async fn set_attrs(
    State(cp): Cp,
    Path(id): Path<String>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
    body: Body,
) -> CResult<Response> {
    authorize(&cp, &id, &headers)?;
    let p = params(q.as_deref())?;
    let raw = crate::error::read_body(body, 64 << 10).await?;
    let b: AttrsBody = crate::commands::json(&raw, Some("{}"))?;
    let attrs = Attrs {
        uid: attr("uid", b.uid)?,
        gid: attr("gid", b.gid)?,
        mode: attr("mode", b.mode)?,
    };
    let path = p.path.clone();
    let e = with_fs(&cp, &id, &p.path, move |fs| fs.set_attrs(&path, attrs)).await?;
    Ok(Json(entry_body(e)).into_response())
}

/// Delete an entry (a directory with everything in it; not the root).
#[utoipa::path(delete, path = "/volumecontent/{volumeID}/path", tag = "volumes", security(("VolumeToken" = [])),
    params(("volumeID" = String, Path, description = "Volume id"),
        ("path" = String, Query, min_length = 1, description = "Path inside the volume")),
    responses((status = 204, description = "Deleted"), (status = 400, body = ContentErrorBody), (status = 401, body = ContentErrorBody), (status = 403, body = ContentErrorBody),
        (status = 404, body = ContentErrorBody)))]
async fn remove(
    State(cp): Cp,
    Path(id): Path<String>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> CResult<StatusCode> {
    authorize(&cp, &id, &headers)?;
    let p = params(q.as_deref())?;
    let path = p.path.clone();
    with_fs(&cp, &id, &p.path, move |fs| fs.remove(&path)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A file's bytes.
#[utoipa::path(get, path = "/volumecontent/{volumeID}/file", tag = "volumes", security(("VolumeToken" = [])),
    params(("volumeID" = String, Path, description = "Volume id"),
        ("path" = String, Query, min_length = 1, description = "Path inside the volume")),
    responses((status = 200, description = "The file's bytes", content_type = "application/octet-stream", body = inline(FileBytes)), (status = 400, body = ContentErrorBody), (status = 401, body = ContentErrorBody), (status = 403, body = ContentErrorBody),
        (status = 404, body = ContentErrorBody)))]
async fn read_file(
    State(cp): Cp,
    Path(id): Path<String>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> CResult<Response> {
    authorize(&cp, &id, &headers)?;
    let p = params(q.as_deref())?;
    let path = p.path.clone();
    let (file, len) = with_fs(&cp, &id, &p.path, move |fs| {
        let f = fs.open_read(&path)?;
        let len = f.metadata()?.len();
        Ok((f, len))
    })
    .await?;
    let file = tokio::fs::File::from_std(file);
    let stream = futures_util::stream::unfold(Some(file), |state| async move {
        let mut f = state?;
        let mut buf = bytes::BytesMut::with_capacity(64 << 10);
        match f.read_buf(&mut buf).await {
            Ok(0) => None,
            Ok(_) => Some((Ok::<_, io::Error>(buf.freeze()), Some(f))),
            Err(e) => Some((Err(e), None)),
        }
    });
    let mut resp = Body::from_stream(stream).into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    Ok(resp)
}

/// Create or overwrite a file with the request's bytes.
#[utoipa::path(put, path = "/volumecontent/{volumeID}/file", tag = "volumes", security(("VolumeToken" = [])),
    params(("volumeID" = String, Path, description = "Volume id"),
        ("path" = String, Query, min_length = 1, description = "Path inside the volume"),
        ("uid" = Option<i64>, Query, minimum = 0, maximum = 4294967295.0, description = "Owner of a new entry"),
        ("gid" = Option<i64>, Query, minimum = 0, maximum = 4294967295.0, description = "Group of a new entry"),
        ("mode" = Option<i64>, Query, minimum = 0, maximum = 4294967295.0, description = "Mode of a new entry, decimal (493 = 0o755)"),
        ("force" = Option<bool>, Query, description = "Also make missing parents")),
    request_body(content = inline(FileBytes), content_type = "application/octet-stream"),
    responses((status = 201, body = EntryBody), (status = 400, body = ContentErrorBody), (status = 401, body = ContentErrorBody), (status = 403, body = ContentErrorBody),
        (status = 404, body = ContentErrorBody),
        (status = 409, body = ContentErrorBody), (status = 507, body = ContentErrorBody)))]
async fn write_file(
    State(cp): Cp,
    Path(id): Path<String>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
    body: Body,
) -> CResult<Response> {
    authorize(&cp, &id, &headers)?;
    let p = params(q.as_deref())?;
    let (path, attrs, force) = (p.path.clone(), p.attrs, p.force);
    let file = with_fs(&cp, &id, &p.path, move |fs| {
        fs.open_write(&path, attrs, force)
    })
    .await?;
    let mut file = tokio::fs::File::from_std(file);
    let mut body = body;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            ContentError::new(StatusCode::BAD_REQUEST, format!("reading the upload: {e}"))
        })?;
        if let Ok(data) = frame.into_data() {
            file.write_all(&data)
                .await
                .map_err(|e| io_error(&p.path, e))?;
        }
    }
    file.flush().await.map_err(|e| io_error(&p.path, e))?;
    // Quota errors of delayed allocation surface at the latest here.
    file.sync_data().await.map_err(|e| io_error(&p.path, e))?;
    drop(file);
    let path = p.path.clone();
    let e = with_fs(&cp, &id, &p.path, move |fs| fs.stat(&path)).await?;
    Ok((StatusCode::CREATED, Json(entry_body(e))).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_statuses() {
        let s = |e: io::Error| io_error("/p", e).status;
        assert_eq!(
            s(io::Error::from_raw_os_error(libc::ENOENT)),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            s(io::Error::from_raw_os_error(libc::EEXIST)),
            StatusCode::CONFLICT
        );
        assert_eq!(
            s(io::Error::from_raw_os_error(libc::EDQUOT)),
            StatusCode::INSUFFICIENT_STORAGE
        );
        assert_eq!(
            s(io::Error::from_raw_os_error(libc::ELOOP)),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            s(io::Error::from_raw_os_error(libc::EIO)),
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }

    #[test]
    fn query_parsing() {
        let p = params(Some("path=%2Fd%2Fe&uid=1000&gid=1000&mode=493&force=true")).unwrap();
        assert_eq!(p.path, "/d/e");
        assert_eq!(
            p.attrs,
            Attrs {
                uid: Some(1000),
                gid: Some(1000),
                mode: Some(493)
            }
        );
        assert!(p.force);
        assert!(params(Some("uid=1")).is_err());
        assert!(params(Some("path=/x&force=yes")).is_err());
        assert!(params(Some("path=/x&mode=-1")).is_err());
    }
}
