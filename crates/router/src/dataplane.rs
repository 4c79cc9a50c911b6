//! The data plane: forwards one request to one sandbox port and streams the answer back.
//!
//! Bodies are never buffered: the client's request body is handed to the upstream
//! connection as a stream (hyper polls it only as fast as the sandbox reads, so uploads
//! have backpressure), and the upstream response body is handed back to our server the
//! same way (each Connect message reaches the client as soon as envd writes it).
//! Upstream connections are HTTP/1.1, pooled per (sandbox, port) by `hyper_util`'s client
//! (see `connector.rs`). When the client goes away, our server drops the response body,
//! which drops (closes) the upstream connection; envd keeps started processes running
//! by design.
//!
//! Headers pass through except hop-by-hop ones; `Content-Type` is untouched (Connect
//! streams need `application/connect+json` exactly), `X-Access-Token` goes to envd (which
//! checks it), and the `E2b-Sandbox-*` headers are kept (harmless, as upstream E2B does).
//! `Connection: upgrade` requests (WebSocket) to user ports are forwarded with their
//! upgrade headers; on `101` both sides are upgraded and bytes are copied both ways until
//! either side closes or nothing moves for `RouterConfig::tunnel_idle_timeout`.
//! Upgrades to envd's port are refused (envd has none; it is an internal surface).

use std::sync::Arc;

use crate::drain::Drains;

use axum::{
    body::Body,
    extract::Request,
    http::{HeaderValue, StatusCode, Uri, Version, header},
    response::Response,
};
use hyper_util::{
    client::legacy::Client,
    rt::{TokioExecutor, TokioIo, TokioTimer},
};

use crate::{
    Resolver, RouterConfig, SandboxTarget,
    connector::{SandboxConnector, upstream_authority},
    error::RouterError,
    presign,
    routing::{self, ENVD_PORT, Route, TRAFFIC_TOKEN_HEADER},
};

/// The data plane of `cubicle serve`. Cheap to clone.
#[derive(Clone)]
pub struct DataPlane {
    inner: Arc<Inner>,
}

struct Inner {
    resolver: Resolver,
    domain: Option<String>,
    client: Client<SandboxConnector, Body>,
    tunnel_idle_timeout: std::time::Duration,
    drains: Drains,
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl DataPlane {
    /// A data plane over `resolver`.
    pub fn new(resolver: Resolver, config: RouterConfig) -> Self {
        let drains = Drains::default();
        let connector = SandboxConnector {
            resolver: resolver.clone(),
            timeout: config.connect_timeout,
            drains: drains.clone(),
        };
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(config.pool_idle_timeout)
            .pool_max_idle_per_host(config.pool_max_idle_per_port)
            .set_host(false)
            .build(connector);
        let domain = config
            .domain
            .map(|d| d.trim().trim_matches('.').to_ascii_lowercase())
            .filter(|d| !d.is_empty());
        DataPlane {
            inner: Arc::new(Inner {
                resolver,
                domain,
                client,
                tunnel_idle_timeout: config.tunnel_idle_timeout,
                drains,
            }),
        }
    }

    /// Whether `req` is for a sandbox (routing headers, a `<port>-<id>.<domain>` host, or a
    /// presigned `/files` URL) rather than for the REST API.
    pub fn wants<B>(&self, req: &axum::http::Request<B>) -> bool {
        routing::wants(req, self.inner.domain.as_deref())
    }

    /// The sandbox and port `req` names (routing headers or host), for observers such as
    /// the access log and metrics; `None` for presigned `/files` URLs and bad requests.
    pub fn target_of<B>(
        &self,
        req: &axum::http::Request<B>,
    ) -> Option<(cubicle_runtime::SandboxId, u16)> {
        match routing::route(req, self.inner.domain.as_deref()) {
            Ok(Route::Port { id, port }) => Some((id, port)),
            _ => None,
        }
    }

    /// Forwards `req` to its sandbox port; every failure is answered in E2B's shapes.
    pub async fn handle(&self, req: Request) -> Response {
        match self.forward(req).await {
            Ok(resp) => resp,
            Err(e) => e.into_response(),
        }
    }

    async fn forward(&self, req: Request) -> Result<Response, RouterError> {
        let (a, req) = self.admit(req).await?;
        self.send(req, &a.target.id, a.port, a.host).await
    }

    /// Where `req` goes and whether it may: the sandbox (resumed first when it is paused
    /// with auto-resume) and port it names, after the checks that need the control
    /// plane's knowledge (internal envd routes, upgrades to envd, the traffic token).
    /// `cubicle serve` sends the request on itself; an API replica of a cluster relays it
    /// to the node that runs the sandbox ([`crate::Relay`]), whose own data plane enters
    /// the sandbox.
    /// Returns the request back for sending.
    pub async fn admit(&self, req: Request) -> Result<(Admitted, Request), RouterError> {
        // Only the head is looked at (and held across the resume of a paused sandbox,
        // which a request with its body could not be: the body is not `Sync`).
        let (parts, body) = req.into_parts();
        let head = Request::from_parts(parts, ());
        let a = self.admit_head(&head).await?;
        let (parts, ()) = head.into_parts();
        Ok((a, Request::from_parts(parts, body)))
    }

    async fn admit_head(&self, req: &axum::http::Request<()>) -> Result<Admitted, RouterError> {
        let (target, port) = match routing::route(req, self.inner.domain.as_deref())? {
            Route::Port { id, port } => {
                let target = match self.inner.resolver.resolve(&id) {
                    Some(t) => t,
                    None => match self.inner.resolver.recheck(&id).await {
                        Some(t) => t,
                        None => self.wake(&id, port, req.headers()).await?,
                    },
                };
                (target, port)
            }
            Route::Presigned => (self.presigned_target(req)?, ENVD_PORT),
        };
        if port == ENVD_PORT {
            if routing::is_envd_internal(req.uri().path()) {
                return Err(RouterError::Forbidden(format!(
                    "{} is an internal envd route and cannot be reached through the sandbox proxy",
                    req.uri().path()
                )));
            }
            // envd speaks no upgraded protocol the SDKs use; refuse rather than hand a
            // raw byte pipe to envd's socket.
            if routing::is_upgrade(req.headers()) {
                return Err(RouterError::Forbidden(
                    "protocol upgrades to envd are internal and cannot be made through the sandbox proxy"
                        .into(),
                ));
            }
            Ok(Admitted {
                target,
                port,
                host: None,
            })
        } else {
            check_traffic_token(&target, req.headers())?;
            let host = target
                .mask_request_host
                .as_deref()
                .map(|m| m.replace("${PORT}", &port.to_string()));
            Ok(Admitted { target, port, host })
        }
    }

    /// A paused sandbox with auto-resume: check the request's token first (a mismatch
    /// resumes nothing), then resume it; its first byte is delayed by the resume.
    async fn wake(
        &self,
        id: &str,
        port: u16,
        headers: &axum::http::HeaderMap,
    ) -> Result<SandboxTarget, RouterError> {
        let not_found = || RouterError::SandboxNotFound { id: id.to_owned() };
        let paused = self.inner.resolver.resumable(id).ok_or_else(not_found)?;
        if port == ENVD_PORT {
            if let (Some(expected), Some(given)) = (
                paused.envd_access_token.as_deref(),
                headers.get("x-access-token").and_then(|v| v.to_str().ok()),
            ) && !constant_time_eq(expected.as_bytes(), given.as_bytes())
            {
                return Err(RouterError::Forbidden(format!(
                    "invalid access token for sandbox {id}"
                )));
            }
        } else {
            check_traffic_token(&paused, headers)?;
        }
        self.inner.resolver.wake(id).await.ok_or_else(not_found)
    }

    /// Closes every connection to sandbox `id` (pooled, busy or upgraded): call it
    /// before the sandbox is checkpointed. Returns how many were open.
    pub fn disconnect(&self, id: &str) -> usize {
        self.inner.drains.drain(id)
    }

    /// The one running sandbox whose envd token signed this `/files` URL.
    fn presigned_target<B>(
        &self,
        req: &axum::http::Request<B>,
    ) -> Result<SandboxTarget, RouterError> {
        let op = presign::operation(req.method()).ok_or_else(|| {
            RouterError::Unauthorized("presigned file URLs allow only GET and POST".into())
        })?;
        let q = presign::SignedQuery::parse(req.uri().query().unwrap_or(""));
        let mut found = presign::matching(&q, op, self.inner.resolver.running());
        match found.len() {
            1 => Ok(found.remove(0)),
            0 => Err(RouterError::Unauthorized(
                "invalid signature: no running sandbox issued this file URL".into(),
            )),
            _ => Err(RouterError::Unauthorized("ambiguous signature".into())),
        }
    }

    /// Streams `req` to `port` of sandbox `id`, with `Host: host` when given.
    async fn send(
        &self,
        req: Request,
        id: &str,
        port: u16,
        host: Option<String>,
    ) -> Result<Response, RouterError> {
        let authority = upstream_authority(id, port);
        let (up, client_upgrade) = upstream_request(req, &authority, host)?;
        let resp = match self.inner.client.request(up).await {
            Ok(resp) => resp,
            Err(e) => return Err(self.classify(e, id, port)),
        };
        relay_response(
            resp,
            client_upgrade,
            self.inner.tunnel_idle_timeout,
            id,
            port,
        )
    }
}

/// The request to send upstream: `req` re-targeted at `http://<authority>` over
/// HTTP/1.1, hop-by-hop headers removed (upgrade headers kept for an upgrade), with
/// `Host: host` when given (else the client's, else `localhost`). Also returns the
/// client side of an upgrade, when `req` asks for one.
pub(crate) fn upstream_request(
    req: Request,
    authority: &str,
    host: Option<String>,
) -> Result<(Request, Option<hyper::upgrade::OnUpgrade>), RouterError> {
    let (mut parts, body) = req.into_parts();
    let upgrade = routing::is_upgrade(&parts.headers);
    let client_upgrade = if upgrade {
        parts.extensions.remove::<hyper::upgrade::OnUpgrade>()
    } else {
        None
    };
    let path_and_query = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    let uri: Uri = format!("http://{authority}{path_and_query}")
        .parse()
        .map_err(|e| RouterError::BadRequest(format!("invalid request target: {e}")))?;
    let mut headers = std::mem::take(&mut parts.headers);
    routing::strip_hop_by_hop(&mut headers, upgrade);
    if let Some(h) = host.and_then(|h| HeaderValue::from_str(&h).ok()) {
        headers.insert(header::HOST, h);
    }
    if !headers.contains_key(header::HOST) {
        headers.insert(header::HOST, HeaderValue::from_static("localhost"));
    }
    let mut up = axum::http::Request::new(body);
    *up.method_mut() = parts.method;
    *up.uri_mut() = uri;
    *up.version_mut() = Version::HTTP_11;
    *up.headers_mut() = headers;
    Ok((up, client_upgrade))
}

/// The upstream answer, handed back to the client: streamed, or on `101` both sides
/// upgraded and bytes copied both ways until either closes or nothing moves for `idle`.
pub(crate) fn relay_response(
    mut resp: hyper::Response<hyper::body::Incoming>,
    client_upgrade: Option<hyper::upgrade::OnUpgrade>,
    idle: std::time::Duration,
    id: &str,
    port: u16,
) -> Result<Response, RouterError> {
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(client_upgrade) = client_upgrade else {
            return Err(RouterError::Upstream {
                id: id.to_owned(),
                port,
                detail: "the sandbox switched protocols without being asked to".into(),
            });
        };
        let upstream_upgrade = hyper::upgrade::on(&mut resp);
        let (mut parts, _) = resp.into_parts();
        routing::strip_hop_by_hop(&mut parts.headers, true);
        let (id, port_) = (id.to_owned(), port);
        tokio::spawn(async move {
            let (client, upstream) = match tokio::try_join!(client_upgrade, upstream_upgrade) {
                Ok(pair) => pair,
                Err(e) => {
                    tracing::debug!(sandbox = %id, port = port_, "upgrade failed: {e}");
                    return;
                }
            };
            let mut client = TokioIo::new(client);
            let mut upstream = TokioIo::new(upstream);
            if let Err(e) = crate::tunnel::copy_until_idle(&mut client, &mut upstream, idle).await {
                tracing::debug!(sandbox = %id, port = port_, "upgraded connection ended: {e}");
            }
        });
        return Ok(Response::from_parts(parts, Body::empty()));
    }
    let (mut parts, body) = resp.into_parts();
    routing::strip_hop_by_hop(&mut parts.headers, false);
    parts.version = Version::HTTP_11;
    Ok(Response::from_parts(parts, Body::new(body)))
}

/// A request the data plane let through ([`DataPlane::admit`]).
#[derive(Debug, Clone)]
pub struct Admitted {
    /// The sandbox (running).
    pub target: SandboxTarget,
    /// The port inside it.
    pub port: u16,
    /// `Host` to send to that port (`maskRequestHost`), when not the client's.
    pub host: Option<String>,
}

impl DataPlane {
    /// A failed exchange: our connector's verdict if it failed to connect; "not found"
    /// if the sandbox was killed meanwhile; else a failed upstream exchange.
    fn classify(&self, err: hyper_util::client::legacy::Error, id: &str, port: u16) -> RouterError {
        match upstream_error(err, id, port) {
            RouterError::Upstream { .. } if self.inner.resolver.resolve(id).is_none() => {
                RouterError::SandboxNotFound { id: id.to_owned() }
            }
            other => other,
        }
    }
}

/// Non-envd ports of a sandbox with a traffic token need `e2b-traffic-access-token`.
fn check_traffic_token(
    target: &SandboxTarget,
    headers: &axum::http::HeaderMap,
) -> Result<(), RouterError> {
    let Some(expected) = target.traffic_access_token.as_deref() else {
        return Ok(());
    };
    match headers.get(TRAFFIC_TOKEN_HEADER) {
        None => Err(RouterError::Unauthorized(format!(
            "sandbox {} requires the e2b-traffic-access-token header on this port",
            target.id
        ))),
        Some(given) if constant_time_eq(given.as_bytes(), expected.as_bytes()) => Ok(()),
        Some(_) => Err(RouterError::Forbidden(format!(
            "invalid e2b-traffic-access-token for sandbox {}",
            target.id
        ))),
    }
}

/// Maps a client error to the proxy answer: our connector's own errors (not found, port
/// not open) are found in the source chain; anything else is a failed upstream exchange.
fn upstream_error(err: hyper_util::client::legacy::Error, id: &str, port: u16) -> RouterError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = cur {
        if let Some(ours) = e.downcast_ref::<RouterError>() {
            return match ours {
                RouterError::SandboxNotFound { id } => {
                    RouterError::SandboxNotFound { id: id.clone() }
                }
                RouterError::PortNotOpen { id, port, detail } => RouterError::PortNotOpen {
                    id: id.clone(),
                    port: *port,
                    detail: detail.clone(),
                },
                RouterError::Upstream { id, port, detail } => RouterError::Upstream {
                    id: id.clone(),
                    port: *port,
                    detail: detail.clone(),
                },
                other => RouterError::Internal(other.to_string()),
            };
        }
        cur = e.source();
    }
    let detail = crate::error::error_chain(&err);
    RouterError::Upstream {
        id: id.to_owned(),
        port,
        detail,
    }
}
