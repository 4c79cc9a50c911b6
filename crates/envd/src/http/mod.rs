//! envd's plain HTTP endpoints: `/health`, `/files`, `/init`, `/envs`, `/metrics`.
//!
//! * `GET /health` — 204, no authentication.
//! * `GET /files` / `POST /files` — download and upload (see [`download`], [`upload`]);
//!   they accept the access token header **or** a URL signature ([`signature`]).
//! * `POST /init`, `GET /envs` — the node configures the sandbox ([`init`]).
//! * `GET /metrics` — CPU, memory and disk use of the sandbox ([`metrics`]).
//!
//! Every error of these routes is JSON `{"code":N,"message":…}` (what the SDKs parse).
//! See shared/spec/e2b-compat.md §1.5, §3.1, §3.6.

mod body;
mod download;
mod init;
pub use init::apply_birth_env;
mod metadata;
mod metrics;
mod multipart;
pub mod signature;
mod upload;

use std::{borrow::Cow, io, sync::Arc};

use axum::{
    Router,
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::{get, post},
};

use crate::{auth, server::AppState};

/// Routes of the HTTP endpoints.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/health", get(|| async { StatusCode::NO_CONTENT }))
        .route("/files", get(download::get_files).post(upload::post_files))
        .route("/init", post(init::post_init))
        .route("/envs", get(init::get_envs))
        .route("/metrics", get(metrics::get_metrics))
}

/// A failed plain-HTTP request: a status and a message, answered as
/// `{"code":N,"message":…}` (the shape upstream envd uses and the SDKs parse).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HttpError {
    pub status: StatusCode,
    pub message: String,
}

impl HttpError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// Maps an I/O error to the status the SDKs expect: no space → 507 (the SDK's
    /// `NotEnoughSpaceException`), bad paths → 400, missing → 404, denied → 403.
    pub fn from_io(err: &io::Error, what: &str) -> Self {
        let status = match err.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => StatusCode::INSUFFICIENT_STORAGE,
            Some(libc::ENOENT) | Some(libc::ENOTDIR) => StatusCode::NOT_FOUND,
            Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => StatusCode::FORBIDDEN,
            Some(libc::EISDIR)
            | Some(libc::ENAMETOOLONG)
            | Some(libc::ELOOP)
            | Some(libc::EINVAL)
            | Some(libc::EEXIST) => StatusCode::BAD_REQUEST,
            _ => match err.kind() {
                io::ErrorKind::InvalidData | io::ErrorKind::InvalidInput => StatusCode::BAD_REQUEST,
                io::ErrorKind::TimedOut => StatusCode::REQUEST_TIMEOUT,
                io::ErrorKind::UnexpectedEof => StatusCode::BAD_REQUEST,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            },
        };
        let message = if status == StatusCode::INSUFFICIENT_STORAGE {
            format!("{what}: not enough disk space available ({err})")
        } else {
            format!("{what}: {err}")
        };
        Self::new(status, message)
    }
}

impl std::fmt::Display for HttpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        auth::http_error(self.status, self.message)
    }
}

/// The query parameters of `/files`, percent-decoded (`+` is a space, as in every form
/// decoder and in upstream envd). The first occurrence of a parameter wins.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct FilesQuery {
    pub path: Option<String>,
    pub username: Option<String>,
    pub signature: Option<String>,
    pub signature_expiration: Option<String>,
}

impl FilesQuery {
    /// Parses a raw query string. Invalid UTF-8 after decoding is refused (a lossy
    /// decoding would silently name another file).
    pub fn parse(raw: Option<&str>) -> Result<Self, HttpError> {
        let mut q = FilesQuery::default();
        for pair in raw.unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let key = decode_component(k)?;
            let slot = match key.as_ref() {
                "path" => &mut q.path,
                "username" => &mut q.username,
                "signature" => &mut q.signature,
                "signature_expiration" => &mut q.signature_expiration,
                _ => continue,
            };
            if slot.is_none() {
                *slot = Some(decode_component(v)?.into_owned());
            }
        }
        Ok(q)
    }

    /// The user named in the query (an empty `username=` means the default user).
    pub fn user(&self) -> Option<&str> {
        self.username.as_deref().filter(|u| !u.is_empty())
    }
}

fn decode_component(s: &str) -> Result<Cow<'_, str>, HttpError> {
    let plus_decoded: Cow<'_, str> = if s.contains('+') {
        Cow::Owned(s.replace('+', " "))
    } else {
        Cow::Borrowed(s)
    };
    let decoded = percent_encoding::percent_decode_str(&plus_decoded)
        .decode_utf8()
        .map_err(|_| HttpError::bad_request("query parameter is not valid UTF-8"))?;
    Ok(Cow::Owned(decoded.into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_query() {
        let q = FilesQuery::parse(Some(
            "path=%2Fhome%2Fuser%2Fa%20b+c.txt&username=root&signature=v1_x%2By&signature_expiration=17&path=ignored",
        ))
        .unwrap();
        assert_eq!(q.path.as_deref(), Some("/home/user/a b c.txt"));
        assert_eq!(q.user(), Some("root"));
        assert_eq!(q.signature.as_deref(), Some("v1_x+y"));
        assert_eq!(q.signature_expiration.as_deref(), Some("17"));
        let q = FilesQuery::parse(Some("username=&path")).unwrap();
        assert_eq!(q.user(), None);
        assert_eq!(q.path.as_deref(), Some(""));
        assert_eq!(FilesQuery::parse(None).unwrap(), FilesQuery::default());
        // Bad percent-encoding is kept literally; invalid UTF-8 is refused.
        assert_eq!(
            FilesQuery::parse(Some("path=%zz")).unwrap().path.as_deref(),
            Some("%zz")
        );
        assert_eq!(
            FilesQuery::parse(Some("path=%ff")).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
    }

    #[test]
    fn io_errors_map_to_statuses() {
        let st = |e| HttpError::from_io(&io::Error::from_raw_os_error(e), "x").status;
        assert_eq!(st(libc::ENOSPC), StatusCode::INSUFFICIENT_STORAGE);
        assert_eq!(st(libc::EDQUOT), StatusCode::INSUFFICIENT_STORAGE);
        assert_eq!(st(libc::ENOENT), StatusCode::NOT_FOUND);
        assert_eq!(st(libc::EISDIR), StatusCode::BAD_REQUEST);
        assert_eq!(st(libc::EACCES), StatusCode::FORBIDDEN);
        assert_eq!(st(libc::EIO), StatusCode::INTERNAL_SERVER_ERROR);
    }
}
