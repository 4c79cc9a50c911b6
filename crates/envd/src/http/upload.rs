//! `POST /files`: uploads, streamed to disk with bounded memory.
//!
//! * `Content-Type: application/octet-stream` — the body is the file; `?path=` required.
//! * `Content-Type: multipart/form-data` — every part named `file` is a file; its
//!   `filename` is the full destination path (never basenamed, HTML5-form decoded, see
//!   [`super::multipart`]); `?path=`, when given, wins (the SDKs send it only for a
//!   single file). Two parts resolving to the same path → 400 (the first stays written).
//! * `Content-Encoding: gzip` applies to the whole body and is decoded while streaming.
//! * `X-Metadata-*` headers → `user.e2b.*` xattrs on every file ([`super::metadata`]).
//!
//! Files are written in place, like upstream envd: parent directories are created for
//! (and owned by) the acting user, the file is opened (created `0644` or truncated —
//! an existing file keeps its mode, inode, hard links and foreign xattrs) and handed to
//! the acting user. Writing in place also gives directory watchers the events they
//! expect (create, attrib, modify on the real name — no temporary names or renames).
//! If the upload fails (client gone, bad gzip, malformed multipart, no space), a file
//! this request created is removed again; a pre-existing file stays truncated/partial.
//! As in upstream envd, envd writes with its own (root) rights: the acting user decides
//! ownership and `~`/relative paths, not write permission.
//!
//! Answer: `200 [{"path":"/abs","name":"base","type":"file","metadata"?:{…}}]`.

use std::{
    fs::{File, OpenOptions},
    io::{self, Write},
    os::{
        fd::AsFd,
        unix::fs::{MetadataExt, OpenOptionsExt, fchown},
    },
    path::{Path, PathBuf},
    sync::Arc,
};

use axum::{
    Json,
    body::{Body, Bytes},
    extract::State,
    http::{HeaderMap, StatusCode, Uri, header},
    response::{IntoResponse, Response},
};
use futures_util::{Stream, StreamExt};
use serde::Serialize;

use super::{
    FilesQuery, HttpError,
    body::{self, HeaderGuard},
    metadata::{self, Metadata},
    multipart,
    signature::{self, Operation},
};
use crate::{auth, paths, server::AppState, state::Context, users::User};

/// Chunks queued between the network and the disk writer (each ≤ 64 KiB).
const WRITE_QUEUE: usize = 16;

/// One written file, as the SDKs expect it.
#[derive(Debug, Serialize)]
pub(crate) struct WriteEntry {
    pub path: String,
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Metadata>,
}

/// `POST /files`.
pub(crate) async fn post_files(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    uri: Uri,
    body: Body,
) -> Response {
    let result = match admit(&state.ctx, &headers, uri.query()) {
        Ok((q, user, meta)) => upload(&state.ctx, &headers, q, user, meta, body).await,
        Err(e) => {
            // Refused before reading the body: keep reading what the client is still
            // sending (bounded) while the error goes out. hyper closes a connection whose
            // body was left unread, and a browser still writing its form would see a
            // broken pipe instead of the 401.
            tokio::spawn(async move {
                let _ = tokio::time::timeout(
                    std::time::Duration::from_secs(10),
                    axum::body::to_bytes(body, 1 << 20),
                )
                .await;
            });
            Err(e)
        }
    };
    match result {
        Ok(entries) => (StatusCode::OK, Json(entries)).into_response(),
        Err(e) => {
            tracing::debug!(status = %e.status, message = %e.message, "upload failed");
            e.into_response()
        }
    }
}

/// Checks that need no body: the query, the token or signature, the user, the metadata.
fn admit(
    ctx: &Context,
    headers: &HeaderMap,
    query: Option<&str>,
) -> Result<(FilesQuery, User, Metadata), HttpError> {
    let q = FilesQuery::parse(query)?;
    signature::authorize(ctx, headers, &q, Operation::Write)?;
    let user = auth::resolve_user(ctx, q.user()).map_err(|e| HttpError::unauthorized(e.message))?;
    let meta = metadata::from_headers(headers)?;
    Ok((q, user, meta))
}

async fn upload(
    ctx: &Context,
    headers: &HeaderMap,
    q: FilesQuery,
    user: User,
    meta: Metadata,
    body: Body,
) -> Result<Vec<WriteEntry>, HttpError> {
    let content_type = match headers.get(header::CONTENT_TYPE) {
        Some(v) => v
            .to_str()
            .map_err(|_| HttpError::bad_request("invalid Content-Type header"))?,
        None => "",
    };
    let media = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();

    let mut stream = body::from_body(body, body::IDLE_TIMEOUT);
    if request_is_gzipped(headers)? {
        stream = body::gunzip(stream);
    }

    if media == "application/octet-stream" {
        let raw = q.path.as_deref().ok_or_else(|| {
            HttpError::bad_request(
                "the path query parameter is required for application/octet-stream uploads",
            )
        })?;
        let target = resolve(ctx, &user, raw)?;
        let data = body::paced(stream, None)
            .map(|r| r.map_err(|e| HttpError::from_io(&e, "reading the request body")));
        return Ok(vec![write_file(target, &user, data, &meta).await?]);
    }
    if !media.starts_with("multipart/") {
        return Err(HttpError::bad_request(format!(
            "unsupported content type: '{content_type}', expected multipart/form-data or application/octet-stream"
        )));
    }
    let boundary = boundary(content_type)
        .ok_or_else(|| HttpError::bad_request("the multipart Content-Type has no boundary"))?;

    let guard = Arc::new(HeaderGuard::default());
    let mut form = multer::Multipart::new(body::paced(stream, Some(guard.clone())), boundary);
    let mut written: Vec<WriteEntry> = Vec::new();
    loop {
        guard.arm();
        let next = form.next_field().await;
        guard.disarm();
        let Some(mut field) = next.map_err(multipart_error)? else {
            break;
        };
        if field.name() != Some("file") {
            // Not a file: skip its content (outside the header budget).
            while field.chunk().await.map_err(multipart_error)?.is_some() {}
            continue;
        }
        // An empty `path=` means "not given" here (the part names its destination).
        let raw = match q.path.as_deref().filter(|p| !p.is_empty()) {
            Some(p) => p.to_string(),
            None => field
                .headers()
                .get(header::CONTENT_DISPOSITION)
                .and_then(|v| multipart::filename(v.as_bytes()))
                .filter(|name| !name.is_empty())
                .ok_or_else(|| {
                    HttpError::bad_request(
                        "a multipart part has no filename (the destination path) and no path query parameter was given",
                    )
                })?,
        };
        let target = resolve(ctx, &user, &raw)?;
        if written.iter().any(|w| Path::new(&w.path) == target) {
            return Err(HttpError::bad_request(format!(
                "you cannot upload multiple files to the same path '{}' in one upload request",
                target.display()
            )));
        }
        let data = field.map(|r| r.map_err(multipart_error));
        written.push(write_file(target, &user, data, &meta).await?);
    }
    if written.is_empty() {
        return Err(HttpError::bad_request(
            "the multipart body has no part named 'file'",
        ));
    }
    Ok(written)
}

fn resolve(ctx: &Context, user: &User, raw: &str) -> Result<PathBuf, HttpError> {
    paths::resolve(ctx, user, raw).map_err(|e| {
        HttpError::bad_request(format!(
            "invalid path '{}': {}",
            raw.escape_debug(),
            e.message
        ))
    })
}

/// Whether the body is gzip-encoded; other encodings are refused.
fn request_is_gzipped(headers: &HeaderMap) -> Result<bool, HttpError> {
    let Some(value) = headers.get(header::CONTENT_ENCODING) else {
        return Ok(false);
    };
    let text = value
        .to_str()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    match text.as_str() {
        "" | "identity" => Ok(false),
        "gzip" | "x-gzip" => Ok(true),
        _ => Err(HttpError::bad_request(format!(
            "unsupported Content-Encoding: '{}', supported: gzip",
            String::from_utf8_lossy(value.as_bytes())
        ))),
    }
}

/// The `boundary` parameter of a multipart content type.
fn boundary(content_type: &str) -> Option<String> {
    content_type.split(';').skip(1).find_map(|param| {
        let (k, v) = param.split_once('=')?;
        if !k.trim().eq_ignore_ascii_case("boundary") {
            return None;
        }
        let v = v.trim();
        let v = v
            .strip_prefix('"')
            .and_then(|s| s.strip_suffix('"'))
            .unwrap_or(v);
        (!v.is_empty() && v.len() <= 200).then(|| v.to_string())
    })
}

fn multipart_error(err: multer::Error) -> HttpError {
    if let multer::Error::StreamReadFailed(inner) = &err
        && let Some(io) = inner.downcast_ref::<io::Error>()
    {
        return HttpError::from_io(io, "reading the request body");
    }
    HttpError::bad_request(format!("malformed multipart body: {err}"))
}

/// Removes a file this request created unless disarmed (runs also when the request
/// future is dropped because the client went away).
struct RemoveOnDrop {
    created: Option<(PathBuf, u64, u64)>,
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some((path, dev, ino)) = self.created.take() {
            // Only if it is still the file we created.
            if let Ok(m) = std::fs::symlink_metadata(&path)
                && m.dev() == dev
                && m.ino() == ino
            {
                let _ = std::fs::remove_file(&path);
            }
        }
    }
}

/// Streams `data` into `target` (see the module documentation).
async fn write_file<S>(
    target: PathBuf,
    user: &User,
    data: S,
    meta: &Metadata,
) -> Result<WriteEntry, HttpError>
where
    S: Stream<Item = Result<Bytes, HttpError>>,
{
    let (file, created) = {
        let (target, user) = (target.clone(), user.clone());
        tokio::task::spawn_blocking(move || open_target(&target, &user))
            .await
            .map_err(|e| HttpError::internal(format!("upload task failed: {e}")))??
    };
    let mut cleanup = RemoveOnDrop {
        created: created.map(|(dev, ino)| (target.clone(), dev, ino)),
    };

    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(WRITE_QUEUE);
    let writer = tokio::task::spawn_blocking(move || -> io::Result<File> {
        let mut file = file;
        while let Some(chunk) = rx.blocking_recv() {
            file.write_all(&chunk)?;
        }
        Ok(file)
    });
    let mut data = std::pin::pin!(data);
    let mut read_error = None;
    while let Some(item) = data.next().await {
        match item {
            Ok(bytes) => {
                if tx.send(bytes).await.is_err() {
                    break; // the writer failed; its error is reported below
                }
            }
            Err(e) => {
                read_error = Some(e);
                break;
            }
        }
    }
    drop(tx);
    let written = writer
        .await
        .map_err(|e| HttpError::internal(format!("upload writer failed: {e}")))?;
    if let Some(e) = read_error {
        return Err(e);
    }
    let file =
        written.map_err(|e| HttpError::from_io(&e, &format!("writing '{}'", target.display())))?;
    let meta_owned = meta.clone();
    tokio::task::spawn_blocking(move || metadata::apply(file.as_fd(), &meta_owned))
        .await
        .map_err(|e| HttpError::internal(format!("upload task failed: {e}")))?
        .map_err(|e| {
            HttpError::from_io(&e, &format!("setting metadata on '{}'", target.display()))
        })?;
    cleanup.created = None;

    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "/".into());
    Ok(WriteEntry {
        path: target.to_string_lossy().into_owned(),
        name,
        kind: "file",
        metadata: (!meta.is_empty()).then(|| meta.clone()),
    })
}

/// Creates the parents and opens the destination for writing: `(file, Some((dev, ino)))`
/// when this call created it.
fn open_target(path: &Path, user: &User) -> Result<(File, Option<(u64, u64)>), HttpError> {
    let shown = path.display();
    if let Some(parent) = path.parent() {
        paths::create_dirs_as(parent, user).map_err(|e| match e.kind() {
            io::ErrorKind::AlreadyExists | io::ErrorKind::NotADirectory => {
                HttpError::bad_request(format!(
                    "cannot create the directory '{}': a path component is not a directory",
                    parent.display()
                ))
            }
            _ => HttpError::from_io(
                &e,
                &format!("creating the directory '{}'", parent.display()),
            ),
        })?;
    }
    let hand_over = |f: &File| {
        fchown(f, Some(user.uid), Some(user.gid))
            .map_err(|e| HttpError::from_io(&e, &format!("changing the owner of '{shown}'")))
    };
    let not_regular = || HttpError::bad_request(format!("path '{shown}' is not a regular file"));
    let is_dir = || HttpError::bad_request(format!("path '{shown}' is a directory"));
    let open_err = |e: io::Error| match e.raw_os_error() {
        Some(libc::EISDIR) => is_dir(),
        Some(libc::ENXIO) | Some(libc::ETXTBSY) => not_regular(),
        _ => HttpError::from_io(&e, &format!("opening '{shown}'")),
    };

    // 1. A new file.
    match OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOCTTY)
        .open(path)
    {
        Ok(f) => {
            let m = f.metadata().map_err(open_err)?;
            let guard = RemoveOnDrop {
                created: Some((path.to_path_buf(), m.dev(), m.ino())),
            };
            hand_over(&f)?;
            std::mem::forget(guard);
            return Ok((f, Some((m.dev(), m.ino()))));
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(open_err(e)),
    }
    // 2. An existing file (or a symlink to one). Non-blocking so a FIFO cannot hang us.
    let file = match OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        // A dangling symlink: create its target, as open(O_CREAT) does.
        Err(e) if e.kind() == io::ErrorKind::NotFound => OpenOptions::new()
            .write(true)
            .create(true)
            .mode(0o644)
            .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK)
            .open(path)
            .map_err(open_err)?,
        Err(e) => return Err(open_err(e)),
    };
    let m = file.metadata().map_err(open_err)?;
    if m.is_dir() {
        return Err(is_dir());
    }
    if !m.file_type().is_file() {
        return Err(not_regular());
    }
    file.set_len(0)
        .map_err(|e| HttpError::from_io(&e, &format!("truncating '{shown}'")))?;
    hand_over(&file)?;
    Ok((file, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boundaries() {
        assert_eq!(
            boundary("multipart/form-data; boundary=abc").as_deref(),
            Some("abc")
        );
        assert_eq!(
            boundary("multipart/form-data; charset=x; BOUNDARY=\"a b\"").as_deref(),
            Some("a b")
        );
        assert_eq!(boundary("multipart/form-data"), None);
        assert_eq!(boundary("multipart/form-data; boundary="), None);
    }

    #[test]
    fn content_encodings() {
        let mut h = HeaderMap::new();
        assert!(!request_is_gzipped(&h).unwrap());
        h.insert(header::CONTENT_ENCODING, "GZIP".parse().unwrap());
        assert!(request_is_gzipped(&h).unwrap());
        h.insert(header::CONTENT_ENCODING, "br".parse().unwrap());
        assert_eq!(
            request_is_gzipped(&h).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
    }
}
