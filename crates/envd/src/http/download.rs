//! `GET /files`: downloads, streamed from disk.
//!
//! * The file is opened **as the acting user** (on a short-lived thread whose
//!   filesystem uid/gid and supplementary groups are the user's, so the kernel applies
//!   the usual permission checks, ACLs included); root reads anything. Denied → 403.
//! * `200`, `Content-Type: application/octet-stream`, `Content-Disposition: inline;
//!   filename="…"` (+ `filename*` for non-ASCII names), `Content-Length` whenever the
//!   body is not compressed. An empty file is `Content-Length: 0` (the JS SDK relies on
//!   it). Files whose size is unknown (`/proc`, `/sys`) are streamed without a length.
//! * `Range: bytes=…` (one range) → `206`/`416`, identity only.
//! * Compression: identity unless the client asks for gzip specifically
//!   (`Accept-Encoding: gzip`, what the SDKs send for `read(..., gzip=True)`) or forbids
//!   identity. The generic `gzip, deflate` every HTTP client sends gets identity: on the
//!   sandbox's link compression costs more CPU than it saves, and identity keeps
//!   `Content-Length` and ranges. Neither gzip nor identity acceptable → 406.
//! * Errors: 400 directory / not a regular file / bad path, 401, 403, 404
//!   `path '…' does not exist`, 406, 500.

use std::{
    fs::File,
    io::{self, Read, Write},
    os::unix::fs::{FileExt, OpenOptionsExt},
    path::Path,
    sync::Arc,
};

use axum::{
    body::{Body, Bytes},
    extract::State,
    http::{HeaderMap, HeaderValue, StatusCode, Uri, header},
    response::{IntoResponse, Response},
};
use flate2::{Compression, write::GzEncoder};
use futures_util::stream;

use super::{
    FilesQuery, HttpError,
    signature::{self, Operation},
};
use crate::{auth, paths, server::AppState, state::Context, users::User};

/// Size of one read from disk.
const CHUNK: usize = 64 * 1024;
/// Chunks queued between the disk reader and the network.
const QUEUE: usize = 4;

/// `GET /files` (and `HEAD`).
pub(crate) async fn get_files(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    match download(&state.ctx, &headers, uri.query()).await {
        Ok(resp) => resp,
        Err(e) => {
            tracing::debug!(status = %e.status, message = %e.message, "download failed");
            e.into_response()
        }
    }
}

async fn download(
    ctx: &Context,
    headers: &HeaderMap,
    query: Option<&str>,
) -> Result<Response, HttpError> {
    let q = FilesQuery::parse(query)?;
    signature::authorize(ctx, headers, &q, Operation::Read)?;
    let user = auth::resolve_user(ctx, q.user()).map_err(|e| HttpError::unauthorized(e.message))?;
    let raw = q.path.as_deref().unwrap_or("");
    let path = paths::resolve(ctx, &user, raw).map_err(|e| {
        HttpError::bad_request(format!(
            "invalid path '{}': {}",
            raw.escape_debug(),
            e.message
        ))
    })?;
    let accept = AcceptEncoding::parse(headers.get(header::ACCEPT_ENCODING));
    let range_header = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);

    let opened = {
        let path = path.clone();
        tokio::task::spawn_blocking(move || open_for_reading(&path, &user))
            .await
            .map_err(|e| HttpError::internal(format!("download task failed: {e}")))??
    };
    let Opened { file, size } = opened;

    let mut builder = Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_DISPOSITION, content_disposition(&path))
        .header(header::VARY, "Accept-Encoding");

    // Files that report size 0 may still have content (procfs, sysfs): peek.
    if size == 0 {
        let (file, first) = tokio::task::spawn_blocking(move || {
            let mut buf = vec![0u8; CHUNK];
            let mut file = file;
            let n = read_retrying(&mut file, &mut buf)?;
            buf.truncate(n);
            Ok::<_, io::Error>((file, buf))
        })
        .await
        .map_err(|e| HttpError::internal(format!("download task failed: {e}")))?
        .map_err(|e| HttpError::from_io(&e, &format!("reading '{}'", path.display())))?;
        if !accept.identity_ok() && !accept.gzip_ok() {
            return Err(not_acceptable());
        }
        if first.is_empty() {
            return builder
                .header(header::CONTENT_LENGTH, 0)
                .body(Body::empty())
                .map_err(|e| HttpError::internal(e.to_string()));
        }
        let gzip = accept.use_gzip();
        if gzip {
            builder = builder.header(header::CONTENT_ENCODING, "gzip");
        }
        let body = stream_file(file, 0, None, Some(first), gzip);
        return builder
            .body(body)
            .map_err(|e| HttpError::internal(e.to_string()));
    }

    let range = range_header.as_deref().and_then(|r| parse_range(r, size));
    if range_header.is_some() && accept.identity_ok() {
        match range {
            Some(Ok((start, end))) => {
                let len = end - start + 1;
                return builder
                    .status(StatusCode::PARTIAL_CONTENT)
                    .header(header::ACCEPT_RANGES, "bytes")
                    .header(header::CONTENT_RANGE, format!("bytes {start}-{end}/{size}"))
                    .header(header::CONTENT_LENGTH, len)
                    .body(stream_file(file, start, Some(len), None, false))
                    .map_err(|e| HttpError::internal(e.to_string()));
            }
            Some(Err(())) => {
                let mut resp = HttpError::new(
                    StatusCode::RANGE_NOT_SATISFIABLE,
                    "requested range not satisfiable",
                )
                .into_response();
                if let Ok(v) = HeaderValue::from_str(&format!("bytes */{size}")) {
                    resp.headers_mut().insert(header::CONTENT_RANGE, v);
                }
                return Ok(resp);
            }
            None => {} // unsupported form (several ranges…): the whole file
        }
    }
    if !accept.identity_ok() && !accept.gzip_ok() {
        return Err(not_acceptable());
    }
    if accept.use_gzip() {
        return builder
            .header(header::CONTENT_ENCODING, "gzip")
            .body(stream_file(file, 0, None, None, true))
            .map_err(|e| HttpError::internal(e.to_string()));
    }
    builder
        .header(header::ACCEPT_RANGES, "bytes")
        .header(header::CONTENT_LENGTH, size)
        .body(stream_file(file, 0, Some(size), None, false))
        .map_err(|e| HttpError::internal(e.to_string()))
}

fn not_acceptable() -> HttpError {
    HttpError::new(
        StatusCode::NOT_ACCEPTABLE,
        "no acceptable content encoding, supported: gzip, identity",
    )
}

struct Opened {
    file: File,
    size: u64,
}

/// Opens `path` for reading with the user's filesystem credentials.
fn open_for_reading(path: &Path, user: &User) -> Result<Opened, HttpError> {
    let shown = path.display();
    let file = as_user(user, || {
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK)
            .open(path)
    })
    .map_err(|e| match e.raw_os_error() {
        Some(libc::ENOENT) | Some(libc::ENOTDIR) => HttpError::new(
            StatusCode::NOT_FOUND,
            format!("path '{shown}' does not exist"),
        ),
        Some(libc::EACCES) | Some(libc::EPERM) => HttpError::new(
            StatusCode::FORBIDDEN,
            format!(
                "permission denied: user '{}' cannot read '{shown}'",
                user.name
            ),
        ),
        _ => HttpError::from_io(&e, &format!("opening '{shown}'")),
    })?;
    let meta = file
        .metadata()
        .map_err(|e| HttpError::from_io(&e, &format!("reading '{shown}'")))?;
    if meta.is_dir() {
        return Err(HttpError::bad_request(format!(
            "path '{shown}' is a directory"
        )));
    }
    if !meta.file_type().is_file() {
        return Err(HttpError::bad_request(format!(
            "path '{shown}' is not a regular file"
        )));
    }
    // Back to blocking reads (O_NONBLOCK only kept a FIFO from hanging the open).
    // SAFETY: plain fcntl on an fd we own.
    unsafe {
        use std::os::fd::AsRawFd;
        let fd = file.as_raw_fd();
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
    Ok(Opened {
        file,
        size: meta.len(),
    })
}

/// Runs `f` with the filesystem credentials of `user` (uid, gid, groups) when envd runs
/// as root and the user is not root — on a dedicated thread, since those credentials
/// are per thread and must never leak into a shared worker.
fn as_user<T: Send>(user: &User, f: impl FnOnce() -> io::Result<T> + Send) -> io::Result<T> {
    if !cubicle_syscalls::is_root() || user.uid == 0 {
        return f();
    }
    let groups: Vec<libc::gid_t> = user.groups();
    let (uid, gid) = (user.uid, user.gid);
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("envd-as-user".into())
            .spawn_scoped(scope, move || {
                // Raw syscalls: per-thread (glibc's wrappers would change every thread).
                // SAFETY: plain credential syscalls on this thread only.
                unsafe {
                    if libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) != 0 {
                        // A user namespace with setgroups denied: go on with the user's
                        // uid/gid only; if even an empty group list is refused, this
                        // thread keeps root's supplementary groups (normally just 0).
                        let e = io::Error::last_os_error();
                        if e.raw_os_error() != Some(libc::EPERM) {
                            return Err(e);
                        }
                        tracing::debug!("setgroups refused; reading with uid/gid only");
                        libc::syscall(libc::SYS_setgroups, 0usize, std::ptr::null::<libc::gid_t>());
                    }
                    libc::syscall(libc::SYS_setfsgid, gid);
                    libc::syscall(libc::SYS_setfsuid, uid);
                    // setfs[ug]id report the previous value: ask again to verify.
                    if libc::syscall(libc::SYS_setfsuid, uid) as u32 != uid
                        || libc::syscall(libc::SYS_setfsgid, gid) as u32 != gid
                    {
                        return Err(io::Error::other(
                            "could not switch to the user's credentials",
                        ));
                    }
                }
                f()
            })
            .map_err(io::Error::other)?
            .join()
            .map_err(|_| io::Error::other("credential thread panicked"))?
    })
    .inspect(|_| crate::users::restore_dumpable())
    .inspect_err(|_| crate::users::restore_dumpable())
}

fn read_retrying(file: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match file.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// A body streaming `file` from `offset` (`len` bytes, or to EOF), optionally gzip
/// compressed, read on a blocking thread through a small bounded queue.
fn stream_file(
    file: File,
    offset: u64,
    len: Option<u64>,
    first: Option<Vec<u8>>,
    gzip: bool,
) -> Body {
    let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Bytes>>(QUEUE);
    tokio::task::spawn_blocking(move || {
        let result = pump(&file, offset, len, first, gzip, &tx);
        if let Err(e) = result
            && e.kind() != io::ErrorKind::BrokenPipe
        {
            tracing::debug!(error = %e, "download aborted");
            let _ = tx.blocking_send(Err(e));
        }
    });
    Body::from_stream(stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    }))
}

/// Sink for the compressor: hands out what it produced.
struct Out(Vec<u8>);

impl Write for Out {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn pump(
    file: &File,
    mut offset: u64,
    len: Option<u64>,
    first: Option<Vec<u8>>,
    gzip: bool,
    tx: &tokio::sync::mpsc::Sender<io::Result<Bytes>>,
) -> io::Result<()> {
    let gone = || io::Error::new(io::ErrorKind::BrokenPipe, "client went away");
    let send = |b: Vec<u8>| tx.blocking_send(Ok(Bytes::from(b))).map_err(|_| gone());
    let mut encoder = gzip.then(|| GzEncoder::new(Out(Vec::new()), Compression::fast()));
    let emit = |data: Vec<u8>, encoder: &mut Option<GzEncoder<Out>>| -> io::Result<()> {
        match encoder {
            None => send(data),
            Some(enc) => {
                enc.write_all(&data)?;
                let out = std::mem::take(&mut enc.get_mut().0);
                if out.is_empty() { Ok(()) } else { send(out) }
            }
        }
    };
    let mut remaining = len;
    if let Some(first) = first {
        offset += first.len() as u64;
        emit(first, &mut encoder)?;
    }
    loop {
        let want = match remaining {
            Some(0) => break,
            Some(r) => r.min(CHUNK as u64) as usize,
            None => CHUNK,
        };
        let mut buf = vec![0u8; want];
        let n = loop {
            match file.read_at(&mut buf, offset) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => break r?,
            }
        };
        if n == 0 {
            if remaining.is_some_and(|r| r > 0) {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the file shrank while being read",
                ));
            }
            break;
        }
        buf.truncate(n);
        offset += n as u64;
        if let Some(r) = remaining.as_mut() {
            *r -= n as u64;
        }
        emit(buf, &mut encoder)?;
    }
    if let Some(enc) = encoder {
        let out = enc.finish()?.0;
        if !out.is_empty() {
            send(out)?;
        }
    }
    Ok(())
}

/// `inline; filename="…"` with `"`/`\` escaped and non-printable or non-ASCII
/// characters replaced by `_`, plus RFC 5987 `filename*` when the name needed that.
fn content_disposition(path: &Path) -> HeaderValue {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "file".into());
    let mut ascii = String::with_capacity(name.len());
    let mut exact = true;
    for c in name.chars() {
        match c {
            '"' | '\\' => {
                ascii.push('\\');
                ascii.push(c);
            }
            ' '..='~' => ascii.push(c),
            _ => {
                ascii.push('_');
                exact = false;
            }
        }
    }
    let mut value = format!("inline; filename=\"{ascii}\"");
    if !exact {
        const ATTR: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
            .remove(b'!')
            .remove(b'#')
            .remove(b'$')
            .remove(b'&')
            .remove(b'+')
            .remove(b'-')
            .remove(b'.')
            .remove(b'^')
            .remove(b'_')
            .remove(b'`')
            .remove(b'|')
            .remove(b'~');
        value.push_str("; filename*=UTF-8''");
        value.push_str(&percent_encoding::utf8_percent_encode(&name, ATTR).to_string());
    }
    HeaderValue::from_str(&value).unwrap_or_else(|_| HeaderValue::from_static("inline"))
}

/// A single `bytes=` range: `Some(Ok((start, end_inclusive)))`, `Some(Err(()))` when
/// unsatisfiable, `None` when absent, malformed or several ranges (serve everything).
fn parse_range(value: &str, size: u64) -> Option<Result<(u64, u64), ()>> {
    let spec = value.trim().strip_prefix("bytes=")?.trim();
    if spec.contains(',') {
        return None;
    }
    let (a, b) = spec.split_once('-')?;
    let (a, b) = (a.trim(), b.trim());
    if a.is_empty() {
        let n: u64 = b.parse().ok()?;
        if n == 0 || size == 0 {
            return Some(Err(()));
        }
        return Some(Ok((size.saturating_sub(n), size - 1)));
    }
    let start: u64 = a.parse().ok()?;
    let end: u64 = if b.is_empty() {
        size.saturating_sub(1)
    } else {
        b.parse().ok()?
    };
    if start >= size {
        return Some(Err(()));
    }
    if end < start {
        return None;
    }
    Some(Ok((start, end.min(size - 1))))
}

/// What `Accept-Encoding` allows.
#[derive(Debug, Default)]
struct AcceptEncoding {
    /// (coding, q) as listed, codings lower-cased.
    entries: Vec<(String, f32)>,
}

impl AcceptEncoding {
    fn parse(value: Option<&HeaderValue>) -> Self {
        let text = value.and_then(|v| v.to_str().ok()).unwrap_or_default();
        let entries = text
            .split(',')
            .filter_map(|item| {
                let mut parts = item.split(';');
                let coding = parts.next()?.trim().to_ascii_lowercase();
                if coding.is_empty() {
                    return None;
                }
                let mut q = 1.0f32;
                for p in parts {
                    if let Some(v) = p
                        .trim()
                        .strip_prefix("q=")
                        .or_else(|| p.trim().strip_prefix("Q="))
                    {
                        q = v.trim().parse().unwrap_or(0.0);
                    }
                }
                Some((coding, q))
            })
            .collect();
        Self { entries }
    }

    fn q(&self, coding: &str) -> Option<f32> {
        self.entries
            .iter()
            .find(|(c, _)| c == coding)
            .map(|(_, q)| *q)
    }

    fn identity_ok(&self) -> bool {
        match self.q("identity") {
            Some(q) => q > 0.0,
            None => self.q("*").is_none_or(|q| q > 0.0),
        }
    }

    fn gzip_ok(&self) -> bool {
        match self.q("gzip").or_else(|| self.q("x-gzip")) {
            Some(q) => q > 0.0,
            None => self.q("*").is_some_and(|q| q > 0.0),
        }
    }

    /// gzip when identity is refused, or when gzip is the only coding asked for.
    fn use_gzip(&self) -> bool {
        if !self.gzip_ok() {
            return false;
        }
        if !self.identity_ok() {
            return true;
        }
        let wanted: Vec<&str> = self
            .entries
            .iter()
            .filter(|(c, q)| *q > 0.0 && c != "identity")
            .map(|(c, _)| c.as_str())
            .collect();
        let gzip_q = self.q("gzip").or_else(|| self.q("x-gzip")).unwrap_or(0.0);
        !wanted.is_empty()
            && wanted.iter().all(|c| *c == "gzip" || *c == "x-gzip")
            && self.q("identity").is_none_or(|q| q <= gzip_q)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ae(s: &str) -> AcceptEncoding {
        AcceptEncoding::parse(Some(&HeaderValue::from_str(s).unwrap()))
    }

    #[test]
    fn negotiates() {
        let none = AcceptEncoding::parse(None);
        assert!(none.identity_ok() && !none.use_gzip());
        assert!(ae("gzip").use_gzip());
        assert!(!ae("gzip, deflate").use_gzip());
        assert!(!ae("gzip, deflate, br, zstd").use_gzip());
        assert!(!ae("identity").use_gzip());
        assert!(ae("gzip;q=1, identity;q=0.5").use_gzip());
        assert!(ae("identity;q=0, gzip, br").use_gzip());
        assert!(ae("*;q=0, gzip").use_gzip());
        let bad = ae("identity;q=0, br");
        assert!(!bad.identity_ok() && !bad.gzip_ok());
        let bad = ae("*;q=0");
        assert!(!bad.identity_ok() && !bad.gzip_ok());
        assert!(ae("*").identity_ok());
    }

    #[test]
    fn ranges() {
        assert_eq!(parse_range("bytes=0-9", 100), Some(Ok((0, 9))));
        assert_eq!(parse_range("bytes=90-", 100), Some(Ok((90, 99))));
        assert_eq!(parse_range("bytes=-10", 100), Some(Ok((90, 99))));
        assert_eq!(parse_range("bytes=-1000", 100), Some(Ok((0, 99))));
        assert_eq!(parse_range("bytes=50-1000", 100), Some(Ok((50, 99))));
        assert_eq!(parse_range("bytes=100-", 100), Some(Err(())));
        assert_eq!(parse_range("bytes=0-1,5-6", 100), None);
        assert_eq!(parse_range("items=0-1", 100), None);
        assert_eq!(parse_range("bytes=5-1", 100), None);
        assert_eq!(parse_range("bytes=x-1", 100), None);
    }

    #[test]
    fn dispositions() {
        assert_eq!(
            content_disposition(Path::new("/a/b.txt")),
            "inline; filename=\"b.txt\""
        );
        assert_eq!(
            content_disposition(Path::new("/a/q\"\\.txt")),
            "inline; filename=\"q\\\"\\\\.txt\""
        );
        assert_eq!(
            content_disposition(Path::new("/a/你\n.txt")),
            "inline; filename=\"__.txt\"; filename*=UTF-8''%E4%BD%A0%0A.txt"
        );
        assert_eq!(
            content_disposition(Path::new("/")),
            "inline; filename=\"file\""
        );
    }
}
