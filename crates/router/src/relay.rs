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
//! sandbox. Connections to nodes are HTTP/1.1, pooled per node: plain, or TLS when the
//! replica is given [`NodeTls`] (`https://` node addresses; `--node-ca`), then also with
//! a client certificate when the nodes require one (mutual TLS).

use std::sync::Arc;
use std::time::Duration;

use axum::{
    body::Body,
    extract::Request,
    http::{HeaderValue, header::HeaderName},
    response::Response,
};
use hyper_rustls::{FixedServerNameResolver, HttpsConnector, HttpsConnectorBuilder};
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

/// TLS from a replica to its nodes: the client configuration (trust anchors — the
/// cluster's CA — and the replica's client certificate when nodes require one), and the
/// name every node's certificate is checked against when not the host of its address
/// (one certificate shared by all nodes, e.g. `cubicle-node`, while they are reached by
/// IP address).
#[derive(Clone, Debug)]
pub struct NodeTls {
    /// The rustls client configuration (no ALPN: the connector sets HTTP/1.1).
    pub config: Arc<rustls::ClientConfig>,
    /// Checked against the nodes' certificates instead of the address's host.
    pub server_name: Option<rustls::pki_types::ServerName<'static>>,
}

/// The connector of a replica's connections to nodes: `https://` addresses through
/// `tls` (without it, no TLS configuration: `http://` only).
pub type NodeConnector = HttpsConnector<HttpConnector>;

/// Builds the connector for connections to nodes.
pub fn node_connector(
    tls: Option<&NodeTls>,
    connect_timeout: Duration,
) -> Result<NodeConnector, RouterError> {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    http.enforce_http(false);
    let config = match tls {
        Some(t) => (*t.config).clone(),
        // An https:// address without TLS set up fails the handshake (no trust anchors);
        // the replica refuses such addresses before it gets here.
        None => rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| RouterError::Internal(format!("TLS configuration: {e}")))?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth(),
    };
    let b = HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_or_http();
    let b = match tls.and_then(|t| t.server_name.clone()) {
        Some(name) => b.with_server_name_resolver(FixedServerNameResolver::new(name)),
        None => b,
    };
    Ok(b.enable_http1().wrap_connector(http))
}

/// Relays admitted data-plane requests to nodes. Cheap to clone.
#[derive(Clone)]
pub struct Relay {
    client: Client<NodeConnector, Body>,
    token: HeaderValue,
    tunnel_idle_timeout: Duration,
    /// `https` when the nodes are reached over TLS.
    scheme: &'static str,
}

impl Relay {
    /// A relay that authenticates to nodes with `token`, over plain HTTP.
    pub fn new(token: &str, config: &crate::RouterConfig) -> Result<Self, RouterError> {
        Self::with_tls(token, config, None)
    }

    /// A relay that authenticates to nodes with `token`, over TLS when `tls` is given.
    pub fn with_tls(
        token: &str,
        config: &crate::RouterConfig,
        tls: Option<&NodeTls>,
    ) -> Result<Self, RouterError> {
        let mut token = HeaderValue::from_str(token).map_err(|_| {
            RouterError::Internal("the node token is not a valid header value".into())
        })?;
        token.set_sensitive(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(config.pool_idle_timeout)
            .set_host(false)
            .build(node_connector(tls, config.connect_timeout)?);
        Ok(Relay {
            client,
            token,
            tunnel_idle_timeout: config.tunnel_idle_timeout,
            scheme: if tls.is_some() { "https" } else { "http" },
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
        if self.scheme != "http" {
            let mut parts = up.uri().clone().into_parts();
            parts.scheme = Some(axum::http::uri::Scheme::HTTPS);
            *up.uri_mut() = axum::http::Uri::from_parts(parts)
                .map_err(|e| RouterError::BadRequest(format!("invalid request target: {e}")))?;
        }
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
        let resp = self
            .client
            .request(up)
            .await
            .map_err(|e| RouterError::NodeUnreachable {
                node: node.to_owned(),
                id: a.target.id.clone(),
                detail: crate::error::error_chain(&e),
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
