//! End-to-end tests of envd's plain HTTP endpoints (`/files`, `/init`, `/envs`,
//! `/metrics`, `/health`) over real HTTP/1.1: the router is served in-process on
//! 127.0.0.1:<ephemeral> (the memory test runs the `cubicle-envd` binary on a Unix
//! socket instead, to measure its own RSS) and driven with a bare hyper client, in a
//! temporary directory. envd runs in development mode: the default user is the user
//! running the tests.

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    io::{Read, Write},
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use axum::body::Body;
use bytes::Bytes;
use cubicle_envd::{
    http::signature::{Operation, sign},
    server::{self, AppState},
    state::{Config, Context, ENVD_VERSION},
};
use http_body_util::BodyExt;
use hyper::{HeaderMap, Request, StatusCode, client::conn::http1};
use hyper_util::rt::TokioIo;
use serde_json::Value;

struct Server {
    addr: SocketAddr,
    ctx: Arc<Context>,
}

async fn server(token: Option<&str>) -> Server {
    let ctx = Arc::new(Context::new(Config {
        dev: true,
        default_user: None,
        default_workdir: None,
        access_token: token.map(str::to_string),
    }));
    let state = AppState::new(ctx.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = server::router(state);
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Server { addr, ctx }
}

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        let p = std::env::temp_dir().join(format!(
            "cubicle-envd-http-test-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(std::fs::canonicalize(&p).unwrap())
    }
    fn join(&self, p: &str) -> PathBuf {
        self.0.join(p)
    }
    fn s(&self, p: &str) -> String {
        self.join(p).to_string_lossy().into_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Resp {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

async fn send(addr: SocketAddr, req: Request<Body>) -> Resp {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let resp = sender.send_request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Resp {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

fn q(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

fn req(method: &str, uri: &str) -> hyper::http::request::Builder {
    Request::builder()
        .method(method)
        .uri(uri)
        .header("host", "localhost")
}

fn multipart(boundary: &str, parts: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (filename, data) in parts {
        out.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
            )
            .as_bytes(),
        );
        out.extend_from_slice(data);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    out
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn xattr(path: &Path, name: &str) -> Option<String> {
    cubicle_envd::filesystem::read_metadata(path)
        .get(name)
        .cloned()
}

async fn upload_octet(addr: SocketAddr, path: &str, data: Vec<u8>) -> Resp {
    send(
        addr,
        req("POST", &format!("/files?path={}", q(path)))
            .header("content-type", "application/octet-stream")
            .body(Body::from(data))
            .unwrap(),
    )
    .await
}

async fn download(addr: SocketAddr, path: &str) -> Resp {
    send(
        addr,
        req("GET", &format!("/files?path={}", q(path)))
            .body(Body::empty())
            .unwrap(),
    )
    .await
}

#[tokio::test]
async fn health_is_204_without_auth() {
    let s = server(Some("secret")).await;
    let r = send(s.addr, req("GET", "/health").body(Body::empty()).unwrap()).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
}

#[tokio::test]
async fn multipart_uploads() {
    let s = server(None).await;
    let dir = TempDir::new();

    // Single file with ?path: the query wins over the part's filename.
    let body = multipart("XyZ", &[(&dir.s("ignored.txt"), b"abc")]);
    let r = send(
        s.addr,
        req("POST", &format!("/files?path={}", q(&dir.s("sub/a.txt"))))
            .header("content-type", "multipart/form-data; boundary=XyZ")
            .body(Body::from(body))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let j = r.json();
    assert_eq!(
        j,
        serde_json::json!([{"path": dir.s("sub/a.txt"), "name": "a.txt", "type": "file"}])
    );
    assert_eq!(std::fs::read(dir.join("sub/a.txt")).unwrap(), b"abc");
    assert!(!dir.join("ignored.txt").exists());

    // Several files without ?path: full paths (never basenamed), HTML5-encoded quote,
    // nested new directories, one overwrite of an existing file keeping its mode.
    std::fs::write(dir.join("exists.txt"), b"old content that is longer").unwrap();
    std::fs::set_permissions(
        dir.join("exists.txt"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let quoted = format!("{}/q%22uote.txt", dir.s("deep/er"));
    let body = multipart(
        "b0undary",
        &[
            (&dir.s("one.bin"), &[0u8, 1, 2, 255]),
            (&quoted, b"q"),
            (&dir.s("exists.txt"), b"new"),
        ],
    );
    let r = send(
        s.addr,
        req("POST", "/files")
            .header("content-type", "multipart/form-data; boundary=\"b0undary\"")
            .body(Body::from(body))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let j = r.json();
    let paths: Vec<&str> = j
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        paths,
        [
            dir.s("one.bin"),
            dir.s("deep/er/q\"uote.txt"),
            dir.s("exists.txt")
        ]
    );
    assert_eq!(
        std::fs::read(dir.join("one.bin")).unwrap(),
        [0u8, 1, 2, 255]
    );
    assert_eq!(
        std::fs::read(dir.join("deep/er/q\"uote.txt")).unwrap(),
        b"q"
    );
    assert_eq!(std::fs::read(dir.join("exists.txt")).unwrap(), b"new");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(dir.join("exists.txt"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );

    // The same path twice in one request → 400.
    let body = multipart("b", &[(&dir.s("dup"), b"1"), (&dir.s("dup"), b"2")]);
    let r = send(
        s.addr,
        req("POST", "/files")
            .header("content-type", "multipart/form-data; boundary=b")
            .body(Body::from(body))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["code"], 400);

    // A directory as the target → 400.
    std::fs::create_dir(dir.join("adir")).unwrap();
    let r = upload_octet(s.addr, &dir.s("adir"), b"x".to_vec()).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.json()["message"].as_str().unwrap().contains("directory"));
}

#[tokio::test]
async fn octet_stream_gzip_and_metadata() {
    let s = server(None).await;
    let dir = TempDir::new();

    let r = upload_octet(s.addr, &dir.s("o.bin"), b"hello octet".to_vec()).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()[0]["name"], "o.bin");
    assert_eq!(std::fs::read(dir.join("o.bin")).unwrap(), b"hello octet");

    // Octet-stream needs ?path.
    let r = send(
        s.addr,
        req("POST", "/files")
            .header("content-type", "application/octet-stream")
            .body(Body::from("x"))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);

    // gzip body + metadata.
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 13) as u8).collect();
    let r = send(
        s.addr,
        req("POST", &format!("/files?path={}", q(&dir.s("z/g.bin"))))
            .header("content-type", "application/octet-stream")
            .header("content-encoding", "gzip")
            .header("x-metadata-Owner", "me")
            .header("X-Metadata-purpose", "a test")
            .body(Body::from(gzip(&data)))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(
        r.json()[0]["metadata"],
        serde_json::json!({"owner": "me", "purpose": "a test"})
    );
    assert_eq!(std::fs::read(dir.join("z/g.bin")).unwrap(), data);
    assert_eq!(xattr(&dir.join("z/g.bin"), "owner").as_deref(), Some("me"));
    assert_eq!(
        xattr(&dir.join("z/g.bin"), "purpose").as_deref(),
        Some("a test")
    );

    // gzip multipart.
    let body = gzip(&multipart(
        "bb",
        &[(&dir.s("gm.txt"), b"gzipped multipart")],
    ));
    let r = send(
        s.addr,
        req("POST", "/files")
            .header("content-type", "multipart/form-data; boundary=bb")
            .header("content-encoding", "gzip")
            .header("x-metadata-k", "v")
            .body(Body::from(body))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(
        std::fs::read(dir.join("gm.txt")).unwrap(),
        b"gzipped multipart"
    );

    // Overwrite without metadata headers: previous metadata cleared, no "metadata" key.
    let r = upload_octet(s.addr, &dir.s("z/g.bin"), b"plain".to_vec()).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.json()[0].get("metadata").is_none());
    assert!(cubicle_envd::filesystem::read_metadata(&dir.join("z/g.bin")).is_empty());

    // Bad metadata → 400, nothing written.
    let r = send(
        s.addr,
        req("POST", &format!("/files?path={}", q(&dir.s("badmeta"))))
            .header("content-type", "application/octet-stream")
            .header(
                "x-metadata-k",
                hyper::header::HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
            )
            .body(Body::from("x"))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(!dir.join("badmeta").exists());

    // Invalid gzip → 400 and no file left behind.
    let r = send(
        s.addr,
        req("POST", &format!("/files?path={}", q(&dir.s("badgz"))))
            .header("content-type", "application/octet-stream")
            .header("content-encoding", "gzip")
            .body(Body::from("definitely not gzip"))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.body);
    assert!(!dir.join("badgz").exists());
}

#[tokio::test]
async fn bad_uploads_are_clear_errors() {
    let s = server(None).await;
    let dir = TempDir::new();
    let post = |ct: &'static str, uri: String, body: Vec<u8>| {
        req("POST", &uri)
            .header("content-type", ct)
            .body(Body::from(body))
            .unwrap()
    };
    let cases: Vec<(Request<Body>, StatusCode)> = vec![
        (
            post(
                "text/plain",
                format!("/files?path={}", q(&dir.s("t"))),
                b"x".to_vec(),
            ),
            StatusCode::BAD_REQUEST,
        ),
        (
            post("multipart/form-data", "/files".into(), b"x".to_vec()),
            StatusCode::BAD_REQUEST,
        ),
        (
            post(
                "multipart/form-data; boundary=zz",
                "/files".into(),
                b"--zz\r\ngarbage".to_vec(),
            ),
            StatusCode::BAD_REQUEST,
        ),
        (
            // A part header that never ends (2 MiB, no CRLFCRLF): refused, not buffered.
            post("multipart/form-data; boundary=zz", "/files".into(), {
                let mut b = b"--zz\r\nX-Huge: ".to_vec();
                b.extend(std::iter::repeat_n(b'a', 2 << 20));
                b
            }),
            StatusCode::BAD_REQUEST,
        ),
        (
            post(
                "multipart/form-data; boundary=zz",
                "/files".into(),
                multipart("zz", &[("", b"no name")]),
            ),
            StatusCode::BAD_REQUEST,
        ),
        (
            post(
                "application/octet-stream",
                "/files?path=%2Ftmp%2Fa%00b".into(),
                b"x".to_vec(),
            ),
            StatusCode::BAD_REQUEST,
        ),
        (
            post(
                "application/octet-stream",
                "/files?path=%ff".into(),
                b"x".to_vec(),
            ),
            StatusCode::BAD_REQUEST,
        ),
        (
            post(
                "application/octet-stream",
                format!("/files?path={}&username=nosuchuser", q(&dir.s("u"))),
                vec![],
            ),
            StatusCode::UNAUTHORIZED,
        ),
    ];
    for (i, (request, want)) in cases.into_iter().enumerate() {
        let r = send(s.addr, request).await;
        assert_eq!(r.status, want, "case {i}: {:?}", r.body);
        assert_eq!(r.json()["code"], want.as_u16(), "case {i}");
    }
    // A parent that is a file → 400, nothing created.
    std::fs::write(dir.join("plainfile"), b"f").unwrap();
    let r = upload_octet(s.addr, &dir.s("plainfile/child.txt"), b"c".to_vec()).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.body);
    std::fs::remove_file(dir.join("plainfile")).unwrap();
    // `..` is resolved lexically and stays an absolute path.
    let r = upload_octet(
        s.addr,
        &format!("{}/x/../dotdot.txt", dir.s("")),
        b"d".to_vec(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()[0]["path"], dir.s("dotdot.txt"));
    // Nothing stray was created.
    let mut names: Vec<String> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["dotdot.txt"]);
}

#[tokio::test]
async fn downloads() {
    let s = server(None).await;
    let dir = TempDir::new();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 256) as u8).collect();
    std::fs::write(dir.join("d.bin"), &data).unwrap();
    std::fs::write(dir.join("empty"), b"").unwrap();
    std::fs::write(dir.join("we\"ird name.txt"), b"w").unwrap();

    let r = download(s.addr, &dir.s("d.bin")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body, data);
    assert_eq!(r.header("content-type"), Some("application/octet-stream"));
    assert_eq!(r.header("content-length"), Some("300000"));
    assert_eq!(
        r.header("content-disposition"),
        Some("inline; filename=\"d.bin\"")
    );
    assert_eq!(r.header("content-encoding"), None);

    let r = download(s.addr, &dir.s("we\"ird name.txt")).await;
    assert_eq!(
        r.header("content-disposition"),
        Some("inline; filename=\"we\\\"ird name.txt\"")
    );

    // Empty file: Content-Length 0 (the JS SDK relies on it).
    let r = download(s.addr, &dir.s("empty")).await;
    assert_eq!(
        (r.status, r.header("content-length"), r.body.len()),
        (StatusCode::OK, Some("0"), 0)
    );

    // The generic Accept-Encoding gets identity; an explicit gzip request gets gzip.
    let r = send(
        s.addr,
        req("GET", &format!("/files?path={}", q(&dir.s("d.bin"))))
            .header("accept-encoding", "gzip, deflate")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(
        (r.header("content-encoding"), r.body.len()),
        (None, data.len())
    );
    let r = send(
        s.addr,
        req("GET", &format!("/files?path={}", q(&dir.s("d.bin"))))
            .header("accept-encoding", "gzip")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(r.header("content-encoding"), Some("gzip"));
    let mut plain = Vec::new();
    flate2::read::GzDecoder::new(&r.body[..])
        .read_to_end(&mut plain)
        .unwrap();
    assert_eq!(plain, data);
    // Nothing acceptable → 406.
    let r = send(
        s.addr,
        req("GET", &format!("/files?path={}", q(&dir.s("d.bin"))))
            .header("accept-encoding", "br, identity;q=0")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_ACCEPTABLE);

    // Ranges.
    let r = send(
        s.addr,
        req("GET", &format!("/files?path={}", q(&dir.s("d.bin"))))
            .header("range", "bytes=10-19")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::PARTIAL_CONTENT);
    assert_eq!(r.body, data[10..20]);
    assert_eq!(r.header("content-range"), Some("bytes 10-19/300000"));
    let r = send(
        s.addr,
        req("GET", &format!("/files?path={}", q(&dir.s("d.bin"))))
            .header("range", "bytes=999999-")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::RANGE_NOT_SATISFIABLE);

    // Errors.
    let r = download(s.addr, &dir.s("missing")).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(
        r.json()["message"],
        format!("path '{}' does not exist", dir.s("missing"))
    );
    let r = download(s.addr, &dir.s("")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["code"], 400);
    let r = send(
        s.addr,
        req("GET", "/files?path=%2Fa%00b")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = send(
        s.addr,
        req(
            "GET",
            &format!("/files?path={}&username=nosuchuser", q(&dir.s("d.bin"))),
        )
        .body(Body::empty())
        .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn downloads_respect_the_users_permissions() {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root (to read as another user)");
        return;
    }
    let Some(nobody) = cubicle_envd::users::by_name("nobody") else {
        eprintln!("skipped: no user 'nobody' in /etc/passwd");
        return;
    };
    let s = server(None).await;
    let dir = TempDir::new();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(dir.join("secret"), b"s").unwrap();
    std::fs::set_permissions(dir.join("secret"), std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(dir.join("public"), b"p").unwrap();
    std::fs::set_permissions(dir.join("public"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let as_nobody = |p: &str| format!("/files?path={}&username={}", q(&dir.s(p)), nobody.name);
    let r = send(
        s.addr,
        req("GET", &as_nobody("secret"))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{:?}", r.body);
    let r = send(
        s.addr,
        req("GET", &as_nobody("public"))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!((r.status, &r.body[..]), (StatusCode::OK, &b"p"[..]));
    // Root reads anything; the worker threads kept root's credentials.
    let r = download(s.addr, &dir.s("secret")).await;
    assert_eq!((r.status, &r.body[..]), (StatusCode::OK, &b"s"[..]));

    // Uploads as nobody: owned by nobody.
    let r = send(
        s.addr,
        req("POST", &as_nobody("n/owned"))
            .header("content-type", "application/octet-stream")
            .body(Body::from("o"))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        std::fs::metadata(dir.join("n/owned")).unwrap().uid(),
        nobody.uid
    );
    assert_eq!(std::fs::metadata(dir.join("n")).unwrap().uid(), nobody.uid);
}

#[tokio::test]
async fn token_and_signatures() {
    let s = server(Some("tok3n")).await;
    let dir = TempDir::new();
    std::fs::write(dir.join("f"), b"content").unwrap();
    let path = dir.s("f");

    // No token → 401 on /files, /envs, /metrics, /init.
    let r = download(s.addr, &path).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.json()["code"], 401);
    let r = upload_octet(s.addr, &dir.s("w"), b"x".to_vec()).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert!(!dir.join("w").exists());
    for (m, p) in [("GET", "/envs"), ("GET", "/metrics"), ("POST", "/init")] {
        let r = send(s.addr, req(m, p).body(Body::empty()).unwrap()).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{m} {p}");
    }
    // Header token.
    let r = send(
        s.addr,
        req("GET", &format!("/files?path={}", q(&path)))
            .header("x-access-token", "tok3n")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!((r.status, &r.body[..]), (StatusCode::OK, &b"content"[..]));
    // A wrong header is refused even with a good signature.
    let sig = sign(&path, Operation::Read, "", "tok3n", None);
    let r = send(
        s.addr,
        req(
            "GET",
            &format!("/files?path={}&signature={}", q(&path), q(&sig)),
        )
        .header("x-access-token", "wrong")
        .body(Body::empty())
        .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    // Signed download, no expiration.
    let r = send(
        s.addr,
        req(
            "GET",
            &format!("/files?path={}&signature={}", q(&path), q(&sig)),
        )
        .body(Body::empty())
        .unwrap(),
    )
    .await;
    assert_eq!((r.status, &r.body[..]), (StatusCode::OK, &b"content"[..]));
    // Signed with user and expiration in the future.
    let me = cubicle_envd::users::current().name;
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
        + 60;
    let sig = sign(&path, Operation::Read, &me, "tok3n", Some(exp));
    let uri = format!(
        "/files?path={}&username={}&signature={}&signature_expiration={exp}",
        q(&path),
        q(&me),
        q(&sig)
    );
    let r = send(s.addr, req("GET", &uri).body(Body::empty()).unwrap()).await;
    assert_eq!(r.status, StatusCode::OK);
    // Tampered expiration, expired, wrong op.
    let uri = format!(
        "/files?path={}&username={}&signature={}&signature_expiration={}",
        q(&path),
        q(&me),
        q(&sig),
        exp + 1
    );
    assert_eq!(
        send(s.addr, req("GET", &uri).body(Body::empty()).unwrap())
            .await
            .status,
        StatusCode::UNAUTHORIZED
    );
    let past = exp - 120;
    let old = sign(&path, Operation::Read, "", "tok3n", Some(past));
    let uri = format!(
        "/files?path={}&signature={}&signature_expiration={past}",
        q(&path),
        q(&old)
    );
    let r = send(s.addr, req("GET", &uri).body(Body::empty()).unwrap()).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert!(r.json()["message"].as_str().unwrap().contains("expired"));
    let uri = format!("/files?path={}&signature=v1_bogus", q(&path));
    assert_eq!(
        send(s.addr, req("GET", &uri).body(Body::empty()).unwrap())
            .await
            .status,
        StatusCode::UNAUTHORIZED
    );
    // Signed upload (write op).
    let target = dir.s("up.txt");
    let wsig = sign(&target, Operation::Write, "", "tok3n", None);
    let r = send(
        s.addr,
        req(
            "POST",
            &format!("/files?path={}&signature={}", q(&target), q(&wsig)),
        )
        .header("content-type", "application/octet-stream")
        .body(Body::from("signed"))
        .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(std::fs::read(&target).unwrap(), b"signed");
    // A read signature does not allow writing.
    let rsig = sign(&target, Operation::Read, "", "tok3n", None);
    let r = send(
        s.addr,
        req(
            "POST",
            &format!("/files?path={}&signature={}", q(&target), q(&rsig)),
        )
        .header("content-type", "application/octet-stream")
        .body(Body::from("nope"))
        .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(std::fs::read(&target).unwrap(), b"signed");
    let _ = &s.ctx;
}

#[tokio::test]
async fn init_envs_and_metrics() {
    let s = server(None).await;
    let body = r#"{"envVars":{"FOO":"bar","E2B_SANDBOX_ID":"sbx1"},"accessToken":"newtok","defaultUser":"root",
                  "timestamp":"2026-11-30T12:00:00Z","volumeMounts":[],"unknownField":true}"#;
    let r = send(
        s.addr,
        req("POST", "/init")
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "{:?}", r.body);
    assert_eq!(r.header("x-envd-version"), Some(ENVD_VERSION));
    assert_eq!(s.ctx.access_token().as_deref(), Some("newtok"));

    // The token now guards /envs and a second /init (resume with the same token works).
    let r = send(s.addr, req("GET", "/envs").body(Body::empty()).unwrap()).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = send(
        s.addr,
        req("GET", "/envs")
            .header("x-access-token", "newtok")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("cache-control"), Some("no-store"));
    let envs = r.json();
    assert_eq!(envs["FOO"], "bar");
    assert_eq!(envs["E2B_SANDBOX"], "true");
    let r = send(
        s.addr,
        req("POST", "/init")
            .header("x-access-token", "newtok")
            .body(Body::from(r#"{"envVars":{"B":"2"}}"#))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_eq!(s.ctx.env_vars()["B"], "2");
    assert_eq!(s.ctx.env_vars()["FOO"], "bar");
    // Malformed JSON → 400 JSON.
    let r = send(
        s.addr,
        req("POST", "/init")
            .header("x-access-token", "newtok")
            .body(Body::from("{nope"))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["code"], 400);

    let r = send(
        s.addr,
        req("GET", "/metrics")
            .header("x-access-token", "newtok")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let m = r.json();
    for key in [
        "ts",
        "cpu_count",
        "cpu_used_pct",
        "mem_total",
        "mem_used",
        "mem_cache",
        "mem_total_mib",
        "mem_used_mib",
        "disk_used",
        "disk_total",
    ] {
        assert!(m[key].is_number(), "{key} in {m}");
    }
    assert!(m["mem_total"].as_u64().unwrap() >= m["mem_used"].as_u64().unwrap());
    assert!(m["cpu_count"].as_u64().unwrap() >= 1);
}

#[tokio::test]
async fn dropped_upload_leaves_nothing_behind() {
    let s = server(None).await;
    let dir = TempDir::new();
    let target = dir.s("partial.bin");
    let stream = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let (mut sender, conn) = http1::handshake(TokioIo::new(stream)).await.unwrap();
    let conn_task = tokio::spawn(conn);
    let chunks = futures_util::stream::unfold(0u32, |i| async move {
        if i < 16 {
            Some((
                Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; 64 * 1024])),
                i + 1,
            ))
        } else {
            // Then stall forever: the client will go away.
            std::future::pending::<()>().await;
            None
        }
    });
    let request = req("POST", &format!("/files?path={}", q(&target)))
        .header("content-type", "application/octet-stream")
        .header("content-length", (64u64 << 20).to_string())
        .body(Body::from_stream(chunks))
        .unwrap();
    let pending = tokio::spawn(async move { sender.send_request(request).await });
    // Wait until the file exists and has data, then drop the connection.
    let start = Instant::now();
    while std::fs::metadata(&target).map(|m| m.len()).unwrap_or(0) < 1 << 20 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "upload never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    pending.abort();
    conn_task.abort();
    let start = Instant::now();
    while Path::new(&target).exists() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "partial file was not removed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(std::fs::read_dir(&dir.0).unwrap().count(), 0);
    // envd still serves.
    let r = send(s.addr, req("GET", "/health").body(Body::empty()).unwrap()).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
}

fn vm_hwm_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// The real binary on a Unix socket: a 512 MiB streamed multipart upload, its download,
/// and a 256 MiB gzip octet-stream upload keep envd's peak RSS bounded.
#[tokio::test]
async fn big_streamed_upload_keeps_memory_bounded() {
    let dir = TempDir::new();
    let sock = dir.join("envd.sock");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_cubicle-envd"))
        .args(["--dev", "--no-tcp", "--unix-socket"])
        .arg(&sock)
        .env("CUBICLE_ENVD_LOG", "warn")
        .spawn()
        .unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let pid = child.id();
    let start = Instant::now();
    // The socket's file appears at bind(), a moment before listen(): wait until it
    // accepts a connection, not merely until it exists.
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        if let Ok(Some(st)) = child.try_wait() {
            panic!("envd exited: {st}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "envd did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let _guard = Kill(child);
    let baseline = vm_hwm_kib(pid);

    const SIZE: u64 = 512 << 20;
    const CHUNK: usize = 256 * 1024;
    let unix = |sock: PathBuf| async move {
        let stream = tokio::net::UnixStream::connect(sock).await.unwrap();
        let (sender, conn) = http1::handshake(TokioIo::new(stream)).await.unwrap();
        tokio::spawn(conn);
        sender
    };
    let boundary = "bigboundary";
    let head = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{}\"\r\n\r\n",
        dir.s("big.bin")
    );
    let tail = format!("\r\n--{boundary}--\r\n");
    let total = head.len() as u64 + SIZE + tail.len() as u64;
    let body = futures_util::stream::iter(
        std::iter::once(Bytes::from(head))
            .chain((0..SIZE / CHUNK as u64).map(|i| Bytes::from(vec![(i % 251) as u8; CHUNK])))
            .chain(std::iter::once(Bytes::from(tail)))
            .map(Ok::<_, std::io::Error>),
    );
    let mut sender = unix(sock.clone()).await;
    let resp = sender
        .send_request(
            req("POST", "/files")
                .header(
                    "content-type",
                    format!("multipart/form-data; boundary={boundary}"),
                )
                .header("content-length", total.to_string())
                .body(Body::from_stream(body))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(std::fs::metadata(dir.join("big.bin")).unwrap().len(), SIZE);
    let after_upload = vm_hwm_kib(pid);

    // Download it back, counting bytes without keeping them.
    let mut sender = unix(sock.clone()).await;
    let resp = sender
        .send_request(
            req("GET", &format!("/files?path={}", q(&dir.s("big.bin"))))
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut got = 0u64;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            got += data.len() as u64;
        }
    }
    assert_eq!(got, SIZE);

    // A gzip octet-stream upload that expands 1000-fold (256 MiB of zeros).
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..256 {
        enc.write_all(&zeros).unwrap();
    }
    let compressed = enc.finish().unwrap();
    let mut sender = unix(sock.clone()).await;
    let resp = sender
        .send_request(
            req("POST", &format!("/files?path={}", q(&dir.s("zeros.bin"))))
                .header("content-type", "application/octet-stream")
                .header("content-encoding", "gzip")
                .body(Body::from(compressed))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        std::fs::metadata(dir.join("zeros.bin")).unwrap().len(),
        256 << 20
    );
    let _ = std::fs::remove_file(dir.join("zeros.bin"));
    let after_download = vm_hwm_kib(pid);
    let _ = std::fs::remove_file(dir.join("big.bin"));
    eprintln!(
        "envd VmHWM: baseline {baseline} KiB, after 512 MiB upload {after_upload} KiB, after download + gzip upload {after_download} KiB"
    );
    assert!(
        after_download < baseline + 64 * 1024,
        "envd peak RSS grew by more than 64 MiB"
    );
}

/// A full filesystem answers 507 (the SDK's `NotEnoughSpaceException`) and leaves no
/// partial file. Needs root for a small tmpfs.
#[tokio::test]
async fn no_space_is_507() {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root (mounts a 1 MiB tmpfs)");
        return;
    }
    let dir = TempDir::new();
    let mnt = dir.join("tiny");
    std::fs::create_dir(&mnt).unwrap();
    let status = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "cubicle-test-tiny"])
        .arg(&mnt)
        .status();
    if !status.is_ok_and(|s| s.success()) {
        eprintln!("skipped: cannot mount a tmpfs here");
        return;
    }
    struct Umount(PathBuf);
    impl Drop for Umount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _umount = Umount(mnt.clone());
    let s = server(None).await;
    let target = mnt.join("big.bin").to_string_lossy().into_owned();
    let r = upload_octet(s.addr, &target, vec![7u8; 4 << 20]).await;
    assert_eq!(r.status, StatusCode::INSUFFICIENT_STORAGE, "{:?}", r.body);
    assert_eq!(r.json()["code"], 507);
    assert!(!Path::new(&target).exists());
    let body = multipart("nb", &[(&target, &vec![1u8; 4 << 20])]);
    let r = send(
        s.addr,
        req("POST", "/files")
            .header("content-type", "multipart/form-data; boundary=nb")
            .body(Body::from(body))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::INSUFFICIENT_STORAGE);
    assert!(!Path::new(&target).exists());
}
