//! The replica's half of the data plane in a cluster: a request the replica's
//! [`DataPlane::admit`](crate::DataPlane::admit) let through is relayed, as it is (body
//! streamed both ways, WebSocket upgrades tunnelled), to the node-side API of the node
//! that runs the sandbox (`cubicle node`). There the node's own [`DataPlane`](crate::DataPlane)
//! enters the sandbox exactly as `cubicle serve` does: one implementation of entering a
//! sandbox, used on both sides.
//!
//! What the relayed request carries besides the client's: `E2b-Sandbox-Id` and
//! `E2b-Sandbox-Port` naming the admitted target (so the node routes by header whatever
//! the client used: a `<port>-<id>.<domain>` host or a presigned URL; the client's `Host`
//! passes through unchanged), and [`NODE_TOKEN_HEADER`] with the shared secret between
//! replicas and nodes, which the node checks and removes before anything reaches the
//! sandbox. Connections to nodes are plain HTTP/1.1, pooled per node.

use std::time::Duration;

use axum::{
    body::Body,
    extract::Request,
    http::{HeaderValue, header::HeaderName},
    response::Response,
};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::{TokioExecutor, TokioTimer},
};

use crate::dataplane::{Admitted, relay_response, upstream_request};
use crate::error::RouterError;
use crate::routing::{SANDBOX_ID_HEADER, SANDBOX_PORT_HEADER};

/// The header a replica puts the node token in on relayed data-plane requests (not
/// `Authorization`, which belongs to the client's request to the sandbox's port).
pub const NODE_TOKEN_HEADER: &str = "cubicle-node-token";

/// Relays admitted data-plane requests to nodes. Cheap to clone.
#[derive(Clone)]
pub struct Relay {
    client: Client<HttpConnector, Body>,
    token: HeaderValue,
    tunnel_idle_timeout: Duration,
}

impl Relay {
    /// A relay that authenticates to nodes with `token`.
    pub fn new(token: &str, config: &crate::RouterConfig) -> Result<Self, RouterError> {
        let mut token = HeaderValue::from_str(token).map_err(|_| {
            RouterError::Internal("the node token is not a valid header value".into())
        })?;
        token.set_sensitive(true);
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(config.connect_timeout));
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(config.pool_idle_timeout)
            .set_host(false)
            .build(http);
        Ok(Relay {
            client,
            token,
            tunnel_idle_timeout: config.tunnel_idle_timeout,
        })
    }

    /// Sends `req`, admitted as `a`, to the node at `node` (`host:port`) and streams its
    /// answer back; a node that cannot be reached is answered 502 in E2B's error shape.
    pub async fn forward(&self, req: Request, a: &Admitted, node: &str) -> Response {
        match self.send(req, a, node).await {
            Ok(r) => r,
            Err(e) => e.into_response(),
        }
    }

    async fn send(&self, req: Request, a: &Admitted, node: &str) -> Result<Response, RouterError> {
        let (mut up, client_upgrade) = upstream_request(req, node, None)?;
        let h = up.headers_mut();
        let id = HeaderValue::from_str(&a.target.id)
            .map_err(|_| RouterError::Internal("sandbox id is not a header value".into()))?;
        h.insert(HeaderName::from_static(SANDBOX_ID_HEADER), id);
        h.insert(
            HeaderName::from_static(SANDBOX_PORT_HEADER),
            HeaderValue::from(a.port),
        );
        h.insert(
            HeaderName::from_static(NODE_TOKEN_HEADER),
            self.token.clone(),
        );
        let resp = self.client.request(up).await.map_err(|e| {
            let mut detail = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                detail.push_str(": ");
                detail.push_str(&s.to_string());
                src = s.source();
            }
            RouterError::NodeUnreachable {
                node: node.to_owned(),
                id: a.target.id.clone(),
                detail,
            }
        })?;
        relay_response(
            resp,
            client_upgrade,
            self.tunnel_idle_timeout,
            &a.target.id,
            a.port,
        )
    }
}
