//! `cubicle sandbox cp SRC DST`: files and directories into or out of a sandbox, as
//! `docker cp` copies them, over envd's own APIs through the router (what the SDKs'
//! `files.write`/`files.read`/`files.list` use):
//!
//! - a file: `POST /files?path=…` with the bytes streamed (`application/octet-stream`),
//!   or `GET /files?path=…` streamed to disk;
//! - a directory: `Filesystem.ListDir` (any depth) or a local walk, then one request per
//!   file and `Filesystem.MakeDir` for empty directories;
//! - modes: executable bits survive both ways (envd writes new files `0644`, so
//!   uploaded executables get one `chmod +x` afterwards; downloads keep each entry's
//!   mode).
//!
//! `DST` names the copy itself, unless it is an existing directory (or ends with `/`):
//! then the copy goes inside it under the source's name. `-` is stdin (as the source of
//! one file) or stdout (for one file).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use cubicle_proto::filesystem::{
    EntryInfo, FileType, ListDirRequest, ListDirResponse, MakeDirRequest, MakeDirResponse,
    RemoveRequest, RemoveResponse, StatRequest, StatResponse,
};
use cubicle_proto::process::{ProcessConfig, StartRequest, process_event::Event};
use futures_util::StreamExt;
use http_body_util::{BodyExt, StreamBody};
use hyper::Method;
use hyper::body::Frame;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{ClientError, connect::EnvdClient, exec, http};

/// One side of a copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A path on this machine.
    Local(PathBuf),
    /// Stdin or stdout.
    Std,
    /// `ID:PATH`.
    Sandbox { id: String, path: String },
}

impl Location {
    /// `ID:PATH` when the part before the first `:` is a sandbox id, `-`, else a local
    /// path (write `./a:b` for a local file with a colon).
    pub fn parse(s: &str) -> Location {
        if s == "-" {
            return Location::Std;
        }
        if let Some((id, path)) = s.split_once(':')
            && !id.is_empty()
            && id.len() <= 32
            && id
                .bytes()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        {
            let path = if path.is_empty() { "." } else { path };
            return Location::Sandbox {
                id: id.to_string(),
                path: path.to_string(),
            };
        }
        Location::Local(PathBuf::from(s))
    }
}

/// What the copy moved.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Copied {
    pub files: u64,
    pub dirs: u64,
    pub bytes: u64,
}

impl std::fmt::Display for Copied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} file{}, {} bytes",
            self.files,
            if self.files == 1 { "" } else { "s" },
            self.bytes
        )?;
        if self.dirs > 0 {
            write!(
                f,
                ", {} director{}",
                self.dirs,
                if self.dirs == 1 { "y" } else { "ies" }
            )?;
        }
        Ok(())
    }
}

fn query_path(envd: &EnvdClient, path: &str) -> String {
    let enc = |s: &str| {
        percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    let mut q = format!("/files?path={}", enc(path));
    if let Some(u) = envd.user() {
        q.push_str(&format!("&username={}", enc(u)));
    }
    q
}

/// `Filesystem.Stat`; `None` when nothing is there.
async fn stat(envd: &EnvdClient, path: &str) -> Result<Option<EntryInfo>, ClientError> {
    let req = StatRequest { path: path.into() };
    match envd
        .unary::<_, StatResponse>("/filesystem.Filesystem/Stat", &req)
        .await
    {
        Ok(r) => Ok(r.entry),
        Err(ClientError::Rpc { code, .. }) if code == "not_found" => Ok(None),
        Err(e) => Err(e),
    }
}

fn is_dir(e: &EntryInfo) -> bool {
    e.r#type == FileType::Directory as i32
}

/// `a/b` + `c` in the sandbox (POSIX paths, whatever this machine uses).
fn join_remote(dir: &str, name: &str) -> String {
    if dir.ends_with('/') {
        format!("{dir}{name}")
    } else {
        format!("{dir}/{name}")
    }
}

fn base_name_remote(path: &str) -> Option<&str> {
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .filter(|n| !n.is_empty() && *n != "." && *n != "..")
}

/// Uploads `reader`'s bytes as the file `path` (streamed; `len` when known).
async fn upload<R: AsyncRead + Unpin + Send + Sync + 'static>(
    envd: &EnvdClient,
    path: &str,
    reader: R,
    len: Option<u64>,
) -> Result<u64, anyhow::Error> {
    // A read error cannot travel in the body's error type: it ends the body early and
    // is reported after the answer (and the partial file removed).
    let failed: Arc<Mutex<Option<std::io::Error>>> = Arc::default();
    let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (f2, s2) = (failed.clone(), sent.clone());
    let stream = futures_util::stream::unfold(Some(reader), move |r| {
        let (failed, sent) = (f2.clone(), s2.clone());
        async move {
            let mut r = r?;
            let mut buf = vec![0u8; 256 << 10];
            match r.read(&mut buf).await {
                Ok(0) => None,
                Ok(n) => {
                    buf.truncate(n);
                    sent.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
                    Some((
                        Ok::<_, hyper::Error>(Frame::data(Bytes::from(buf))),
                        Some(r),
                    ))
                }
                Err(e) => {
                    *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    None
                }
            }
        }
    });
    let body: http::Body = BodyExt::boxed(StreamBody::new(stream));
    let mut b = envd
        .http_request(Method::POST, &query_path(envd, path))
        .header(hyper::header::CONTENT_TYPE, "application/octet-stream");
    if let Some(n) = len {
        b = b.header(hyper::header::CONTENT_LENGTH, n);
    }
    let req = b
        .body(body)
        .map_err(|e| ClientError::Protocol(format!("building the upload: {e}")))?;
    let resp = http::send(envd.base(), req).await?;
    let status = resp.status().as_u16();
    let answer = http::read_body(resp.into_body(), 1 << 20).await?;
    let read_error = failed.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(e) = read_error {
        let _ = envd
            .unary::<_, RemoveResponse>(
                "/filesystem.Filesystem/Remove",
                &RemoveRequest { path: path.into() },
            )
            .await;
        anyhow::bail!("reading the local file for {path}: {e}");
    }
    if status != 200 {
        return Err(ClientError::from_error_body(status, &answer).into());
    }
    Ok(sent.load(std::sync::atomic::Ordering::Relaxed))
}

/// Downloads the file `path` into `out`.
async fn download<W: AsyncWrite + Unpin>(
    envd: &EnvdClient,
    path: &str,
    out: &mut W,
) -> Result<u64, anyhow::Error> {
    let req = envd
        .http_request(Method::GET, &query_path(envd, path))
        .body(http::full(Bytes::new()))
        .map_err(|e| ClientError::Protocol(format!("building the download: {e}")))?;
    let resp = http::send(envd.base(), req).await?;
    let status = resp.status().as_u16();
    if status != 200 {
        let body = http::read_body(resp.into_body(), 64 << 10).await?;
        return Err(ClientError::from_error_body(status, &body).into());
    }
    let mut body = resp.into_body().into_data_stream();
    let mut n = 0u64;
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| ClientError::Http {
            url: path.to_string(),
            detail: e.to_string(),
        })?;
        out.write_all(&chunk).await?;
        n += chunk.len() as u64;
    }
    out.flush().await?;
    Ok(n)
}

/// `chmod +x` on these sandbox paths (one process for all of them).
async fn make_executable(envd: &EnvdClient, paths: Vec<String>) -> anyhow::Result<()> {
    for chunk in paths.chunks(200) {
        let mut args = vec!["+x".to_string(), "--".to_string()];
        args.extend(chunk.iter().cloned());
        let req = StartRequest {
            process: Some(ProcessConfig {
                cmd: "/bin/chmod".into(),
                args,
                envs: Default::default(),
                cwd: None,
            }),
            pty: None,
            tag: None,
            stdin: Some(false),
        };
        let mut started = exec::start_process(envd, req, None).await?;
        while let Some(m) = started.next().await? {
            if let Some(Event::End(end)) = m.event.and_then(|e| e.event)
                && exec::exit_code(&end) != 0
            {
                anyhow::bail!("chmod +x in the sandbox failed ({})", end.status);
            }
        }
    }
    Ok(())
}

/// Copies `src` into the sandbox at `dst` (see the module doc for `dst`).
pub async fn copy_in(envd: &EnvdClient, src: &Location, dst: &str) -> anyhow::Result<Copied> {
    let mut done = Copied::default();
    let local = match src {
        Location::Std => {
            let target = match stat(envd, dst).await? {
                Some(e) if is_dir(&e) => {
                    anyhow::bail!("{dst} is a directory in the sandbox: name the file to write")
                }
                _ => dst.to_string(),
            };
            done.bytes = upload(envd, &target, tokio::io::stdin(), None).await?;
            done.files = 1;
            return Ok(done);
        }
        Location::Local(p) => p.clone(),
        Location::Sandbox { .. } => anyhow::bail!("copy between two sandboxes is not supported"),
    };
    let meta = std::fs::metadata(&local)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", local.display()))?;
    let name = local
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| ".".into());
    let target = match stat(envd, dst).await? {
        Some(e) if is_dir(&e) => join_remote(dst, &name),
        None if dst.ends_with('/') => join_remote(dst, &name),
        Some(_) if meta.is_dir() => {
            anyhow::bail!("{dst} exists in the sandbox and is not a directory")
        }
        _ => dst.to_string(),
    };
    let mut executables = Vec::new();
    if meta.is_dir() {
        let mut stack = vec![(local.clone(), target.clone())];
        while let Some((dir, remote)) = stack.pop() {
            let mut entries: Vec<_> = std::fs::read_dir(&dir)
                .map_err(|e| anyhow::anyhow!("cannot list {}: {e}", dir.display()))?
                .collect::<Result<_, _>>()?;
            entries.sort_by_key(|e| e.file_name());
            if entries.is_empty() {
                envd.unary::<_, MakeDirResponse>(
                    "/filesystem.Filesystem/MakeDir",
                    &MakeDirRequest {
                        path: remote.clone(),
                    },
                )
                .await
                .or_else(|e| match e {
                    ClientError::Rpc { code, .. } if code == "already_exists" => {
                        Ok(MakeDirResponse::default())
                    }
                    e => Err(e),
                })?;
            }
            done.dirs += 1;
            for e in entries {
                let path = e.path();
                let r = join_remote(&remote, &e.file_name().to_string_lossy());
                let ft = e.file_type()?;
                if ft.is_symlink() && path.is_dir() {
                    eprintln!(
                        "cubicle: skipping {} (a link to a directory)",
                        path.display()
                    );
                } else if ft.is_dir() {
                    stack.push((path, r));
                } else if path.is_file() {
                    put_file(envd, &path, &r, &mut done, &mut executables).await?;
                } else {
                    eprintln!(
                        "cubicle: skipping {} (not a file or directory)",
                        path.display()
                    );
                }
            }
        }
    } else {
        put_file(envd, &local, &target, &mut done, &mut executables).await?;
    }
    if !executables.is_empty() {
        make_executable(envd, executables).await?;
    }
    Ok(done)
}

async fn put_file(
    envd: &EnvdClient,
    local: &Path,
    remote: &str,
    done: &mut Copied,
    executables: &mut Vec<String>,
) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let f = tokio::fs::File::open(local)
        .await
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", local.display()))?;
    let meta = f.metadata().await?;
    done.bytes += upload(envd, remote, f, Some(meta.len())).await?;
    done.files += 1;
    if meta.permissions().mode() & 0o111 != 0 {
        executables.push(remote.to_string());
    }
    Ok(())
}

/// Copies the sandbox's `src` to `dst` here (see the module doc for `dst`).
pub async fn copy_out(envd: &EnvdClient, src: &str, dst: &Location) -> anyhow::Result<Copied> {
    use std::os::unix::fs::PermissionsExt;
    let mut done = Copied::default();
    let entry = stat(envd, src)
        .await?
        .ok_or_else(|| anyhow::anyhow!("{src}: no such file or directory in the sandbox"))?;
    let local = match dst {
        Location::Std if is_dir(&entry) => {
            anyhow::bail!("{src} is a directory: copy it to a local path, not to stdout")
        }
        Location::Std => {
            done.bytes = download(envd, &entry.path, &mut tokio::io::stdout()).await?;
            done.files = 1;
            return Ok(done);
        }
        Location::Local(p) => p.clone(),
        Location::Sandbox { .. } => anyhow::bail!("copy between two sandboxes is not supported"),
    };
    let name = base_name_remote(&entry.path).unwrap_or("copy").to_string();
    let target = if local.is_dir() {
        local.join(&name)
    } else if local.to_string_lossy().ends_with('/') {
        anyhow::bail!("{} is not a directory", local.display());
    } else {
        local
    };
    let mut files = Vec::new();
    if is_dir(&entry) {
        std::fs::create_dir_all(&target)
            .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", target.display()))?;
        done.dirs += 1;
        let list: ListDirResponse = envd
            .unary(
                "/filesystem.Filesystem/ListDir",
                &ListDirRequest {
                    path: entry.path.clone(),
                    depth: 1_000,
                },
            )
            .await?;
        let root = entry.path.trim_end_matches('/').to_string();
        let mut entries = list.entries;
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        for e in entries {
            let Some(rel) = e
                .path
                .strip_prefix(&root)
                .map(|r| r.trim_start_matches('/'))
                .filter(|r| !r.is_empty() && !r.split('/').any(|c| c == ".." || c == "."))
            else {
                continue;
            };
            let here = target.join(rel);
            if is_dir(&e) {
                std::fs::create_dir_all(&here)
                    .map_err(|err| anyhow::anyhow!("cannot create {}: {err}", here.display()))?;
                done.dirs += 1;
            } else if e.r#type == FileType::File as i32 {
                files.push((e.path.clone(), here, e.mode));
            } else {
                eprintln!("cubicle: skipping {} (a link)", e.path);
            }
        }
    } else {
        files.push((entry.path.clone(), target, entry.mode));
    }
    for (remote, here, mode) in files {
        if let Some(parent) = here.parent() {
            std::fs::create_dir_all(parent).ok();
        }
        let mut f = tokio::fs::File::create(&here)
            .await
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", here.display()))?;
        done.bytes += download(envd, &remote, &mut f).await?;
        done.files += 1;
        let perm = mode & 0o7777;
        if perm != 0 {
            std::fs::set_permissions(&here, std::fs::Permissions::from_mode(perm)).ok();
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_parse_like_docker_cp() {
        assert_eq!(
            Location::parse("abc123:/tmp/x"),
            Location::Sandbox {
                id: "abc123".into(),
                path: "/tmp/x".into()
            }
        );
        assert_eq!(
            Location::parse("abc:"),
            Location::Sandbox {
                id: "abc".into(),
                path: ".".into()
            }
        );
        assert_eq!(Location::parse("-"), Location::Std);
        assert_eq!(
            Location::parse("./abc:x"),
            Location::Local("./abc:x".into())
        );
        assert_eq!(Location::parse("Big:x"), Location::Local("Big:x".into()));
        assert_eq!(Location::parse("/tmp/f"), Location::Local("/tmp/f".into()));
        assert_eq!(base_name_remote("/a/b/"), Some("b"));
        assert_eq!(base_name_remote("/"), None);
        assert_eq!(join_remote("/a/", "b"), "/a/b");
        assert_eq!(join_remote("x", "b"), "x/b");
        let c = Copied {
            files: 1,
            dirs: 2,
            bytes: 5,
        };
        assert_eq!(c.to_string(), "1 file, 5 bytes, 2 directories");
    }
}
