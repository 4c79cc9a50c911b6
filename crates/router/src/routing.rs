//! Which sandbox port a request is for, and what of it may be forwarded.
//!
//! Mirrors upstream E2B's proxy (`packages/shared/pkg/proxy/host.go`, spec §1.3):
//! * `Host: <port>-<id>.<domain>` (when a domain is configured) routes by host;
//! * otherwise, when either `E2b-Sandbox-Id` or `E2b-Sandbox-Port` is present, both are
//!   required and the port must parse as an unsigned integer;
//! * otherwise a `GET`/`POST /files?…&signature=…` (a presigned URL opened by curl or a
//!   browser, which sends no routing headers) is matched against each running sandbox's
//!   envd token (see `presign.rs`).
//!
//! Sandbox ids are `^[a-z0-9]+$`; anything else cannot exist, so it is "not found".

use axum::http::{HeaderMap, HeaderName, Request, header};

use cubicle_runtime::SandboxId;

use crate::error::RouterError;

/// envd's port: the SDKs' RPC and `/files` traffic. Reached over envd's Unix socket.
pub use cubicle_proto::ENVD_PORT;

/// Routing header: the sandbox id.
pub const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";
/// Routing header: the port inside the sandbox.
pub const SANDBOX_PORT_HEADER: &str = "e2b-sandbox-port";
/// Required on non-envd ports of sandboxes that have a traffic token.
pub const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

/// How much of an invalid sandbox id an error message repeats.
const MAX_ID_LEN: usize = 64;

/// envd routes only the node may call (spec §1.3/§3.6): never forwarded from outside.
const ENVD_INTERNAL_ROUTES: &[&str] = &[
    "/init",
    "/freeze",
    "/unfreeze",
    "/fsfreeze",
    "/fsthaw",
    "/collapse",
    "/upgrade",
];

/// How a request names its sandbox port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// By the `E2b-Sandbox-*` headers or by `Host`.
    Port { id: SandboxId, port: u16 },
    /// A presigned `/files` URL without routing headers: the sandbox is found by signature.
    Presigned,
}

/// The host the request was sent to, without port, lower-cased.
fn request_host<B>(req: &Request<B>) -> Option<String> {
    let raw = match req.uri().host() {
        Some(h) => h.to_owned(),
        None => {
            let value = req.headers().get(header::HOST)?.to_str().ok()?;
            let value = value.trim();
            if let Some(rest) = value.strip_prefix('[') {
                // IPv6 literal: never a sandbox host.
                rest.split(']').next()?.to_owned()
            } else {
                value.split(':').next()?.to_owned()
            }
        }
    };
    Some(raw.to_ascii_lowercase())
}

/// `<port>-<id>.<domain>` → (id, port).
pub fn parse_sandbox_host(host: &str, domain: &str) -> Option<(SandboxId, u16)> {
    let domain = domain.trim_matches('.').to_ascii_lowercase();
    if domain.is_empty() {
        return None;
    }
    let label = host.strip_suffix(&domain)?.strip_suffix('.')?;
    if label.contains('.') {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    let port: u16 = port.parse().ok()?;
    Some((SandboxId::parse(id).ok()?, port))
}

fn has_routing_headers(headers: &HeaderMap) -> bool {
    headers.contains_key(SANDBOX_ID_HEADER) || headers.contains_key(SANDBOX_PORT_HEADER)
}

/// A `/files` request carrying a `signature` query parameter.
fn is_presigned_files<B>(req: &Request<B>) -> bool {
    req.uri().path() == "/files"
        && req
            .uri()
            .query()
            .is_some_and(|q| form_urlencoded::parse(q.as_bytes()).any(|(k, _)| k == "signature"))
}

/// Whether the request belongs to the data plane (see the module docs).
pub fn wants<B>(req: &Request<B>, domain: Option<&str>) -> bool {
    if has_routing_headers(req.headers()) {
        return true;
    }
    if let (Some(domain), Some(host)) = (domain, request_host(req))
        && parse_sandbox_host(&host, domain).is_some()
    {
        return true;
    }
    is_presigned_files(req)
}

/// Decides where the request goes.
pub fn route<B>(req: &Request<B>, domain: Option<&str>) -> Result<Route, RouterError> {
    if let (Some(domain), Some(host)) = (domain, request_host(req))
        && let Some((id, port)) = parse_sandbox_host(&host, domain)
    {
        return Ok(Route::Port { id, port });
    }
    let headers = req.headers();
    if has_routing_headers(headers) {
        let id = headers
            .get(SANDBOX_ID_HEADER)
            .ok_or_else(|| RouterError::BadRequest("missing header E2b-Sandbox-Id".into()))?;
        let port = headers
            .get(SANDBOX_PORT_HEADER)
            .ok_or_else(|| RouterError::BadRequest("missing header E2b-Sandbox-Port".into()))?;
        let id = String::from_utf8_lossy(id.as_bytes()).trim().to_owned();
        let port_text = String::from_utf8_lossy(port.as_bytes());
        let port: u16 = port_text.trim().parse().map_err(|_| {
            RouterError::BadRequest(format!(
                "invalid E2b-Sandbox-Port header {:?}: expected a port number",
                port_text.chars().take(32).collect::<String>()
            ))
        })?;
        let Ok(id) = SandboxId::parse(&id) else {
            return Err(RouterError::SandboxNotFound {
                id: id.chars().take(MAX_ID_LEN).collect(),
            });
        };
        return Ok(Route::Port { id, port });
    }
    if is_presigned_files(req) {
        return Ok(Route::Presigned);
    }
    Err(RouterError::BadRequest(
        "not a data-plane request: E2b-Sandbox-Id and E2b-Sandbox-Port headers are required".into(),
    ))
}

/// The path as envd's router could understand it: percent-decoded, `//` collapsed, no
/// trailing slash, lower-cased. Used only to refuse internal routes robustly.
fn normalized_path(path: &str) -> String {
    let decoded = percent_encoding::percent_decode_str(path).decode_utf8_lossy();
    let mut out = String::with_capacity(decoded.len());
    for seg in decoded.split('/').filter(|s| !s.is_empty() && *s != ".") {
        out.push('/');
        out.push_str(&seg.to_ascii_lowercase());
    }
    if out.is_empty() {
        out.push('/');
    }
    out
}

/// Whether `path` is one of envd's internal routes (or below one).
pub fn is_envd_internal(path: &str) -> bool {
    let p = normalized_path(path);
    ENVD_INTERNAL_ROUTES
        .iter()
        .any(|r| p == *r || p.strip_prefix(r).is_some_and(|rest| rest.starts_with('/')))
}

/// Whether the request asks for a protocol upgrade (WebSocket, …).
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) plus `Expect` (our server already answered it).
const HOP_BY_HOP: &[HeaderName] = &[
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::EXPECT,
];

/// Removes hop-by-hop headers (and those named in `Connection`). With `upgrade`, keeps
/// `Upgrade` and sets `Connection: upgrade` so the upgrade handshake passes through.
pub fn strip_hop_by_hop(headers: &mut HeaderMap, upgrade: bool) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    let upgrade_value = if upgrade {
        headers.get(header::UPGRADE).cloned()
    } else {
        None
    };
    for name in named.iter().chain(HOP_BY_HOP) {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
    if let Some(up) = upgrade_value {
        headers.insert(header::UPGRADE, up);
        headers.insert(
            header::CONNECTION,
            header::HeaderValue::from_static("upgrade"),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn req(uri: &str, headers: &[(&str, &str)]) -> Request<()> {
        let mut b = Request::builder().uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn header_routing() {
        let r = req(
            "/process.Process/Start",
            &[("E2b-Sandbox-Id", "abc1"), ("E2b-Sandbox-Port", "49983")],
        );
        assert!(wants(&r, None));
        assert_eq!(
            route(&r, None).unwrap(),
            Route::Port {
                id: "abc1".parse().unwrap(),
                port: 49983
            }
        );
        let only_id = req("/", &[("E2b-Sandbox-Id", "abc1")]);
        assert!(wants(&only_id, None));
        assert!(matches!(
            route(&only_id, None),
            Err(RouterError::BadRequest(_))
        ));
        let bad_port = req(
            "/",
            &[("E2b-Sandbox-Id", "abc1"), ("E2b-Sandbox-Port", "70000")],
        );
        assert!(matches!(
            route(&bad_port, None),
            Err(RouterError::BadRequest(_))
        ));
        let bad_id = req(
            "/",
            &[("E2b-Sandbox-Id", "ABC-1"), ("E2b-Sandbox-Port", "1")],
        );
        assert!(matches!(
            route(&bad_id, None),
            Err(RouterError::SandboxNotFound { .. })
        ));
        assert!(!wants(
            &req("/sandboxes", &[("Host", "localhost:3000")]),
            None
        ));
        assert!(!wants(&req("/health", &[]), None));
    }

    #[test]
    fn host_routing() {
        assert_eq!(
            parse_sandbox_host("8000-abc1.sb.example.com", "sb.example.com"),
            Some(("abc1".parse().unwrap(), 8000))
        );
        assert_eq!(
            parse_sandbox_host("sandbox.sb.example.com", "sb.example.com"),
            None
        );
        assert_eq!(
            parse_sandbox_host("8000-ab-c.sb.example.com", "sb.example.com"),
            None
        );
        assert_eq!(
            parse_sandbox_host("x.8000-abc.sb.example.com", "sb.example.com"),
            None
        );
        assert_eq!(
            parse_sandbox_host("8000-abc.evil.com", "sb.example.com"),
            None
        );
        let r = req("/", &[("Host", "49999-abc1.SB.example.com:3000")]);
        assert!(wants(&r, Some("sb.example.com")));
        assert!(!wants(&r, None));
        assert_eq!(
            route(&r, Some("sb.example.com")).unwrap(),
            Route::Port {
                id: "abc1".parse().unwrap(),
                port: 49999
            }
        );
        let api = req("/sandboxes", &[("Host", "api.sb.example.com")]);
        assert!(!wants(&api, Some("sb.example.com")));
    }

    #[test]
    fn presigned() {
        let r = req("/files?path=%2Fa&signature=v1_x", &[]);
        assert!(wants(&r, None));
        assert_eq!(route(&r, None).unwrap(), Route::Presigned);
        assert!(!wants(&req("/files?path=/a", &[]), None));
        assert!(!wants(&req("/filesx?signature=1", &[]), None));
    }

    #[test]
    fn internal_routes() {
        for p in [
            "/init",
            "/init/",
            "//init",
            "/%69nit",
            "/INIT",
            "/fsfreeze",
            "/collapse/x",
            "/./init",
            "/upgrade",
        ] {
            assert!(is_envd_internal(p), "{p}");
        }
        for p in ["/files", "/health", "/initx", "/process.Process/Start", "/"] {
            assert!(!is_envd_internal(p), "{p}");
        }
    }

    #[test]
    fn hop_by_hop() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/connect+json"),
        );
        h.insert("x-access-token", HeaderValue::from_static("t"));
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h.len(), 2);
        assert_eq!(h[header::CONTENT_TYPE], "application/connect+json");
        let mut u = HeaderMap::new();
        u.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        u.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(is_upgrade(&u));
        strip_hop_by_hop(&mut u, true);
        assert_eq!(u[header::UPGRADE], "websocket");
        assert_eq!(u[header::CONNECTION], "upgrade");
    }
}
