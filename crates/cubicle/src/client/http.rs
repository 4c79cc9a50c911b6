//! HTTP/1.1 transport for the client commands and the bench: base-URL parsing and a
//! hyper connection per request, or one kept open for a run of requests (the
//! interactive shell's keystrokes; each bench worker, as an SDK's connection pool).
//!
//! `http://` and `https://` (rustls, no OpenSSL: `cubicle_api::tls`). Servers are
//! verified against the system's certificate store; `SSL_CERT_FILE` names another
//! bundle (e.g. the CA of a self-signed `cubicle serve --tls-cert`).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::{Request, Response, Uri, body::Incoming, client::conn::http1};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::ClientError;

/// A request body: a full buffer or a stream, boxed.
pub type Body = BoxBody<Bytes, hyper::Error>;

/// How long establishing a TCP connection may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A full (non-streaming) request body.
pub fn full(data: impl Into<Bytes>) -> Body {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed()
}

/// A parsed `http[s]://host[:port][/prefix]` base URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseUrl {
    /// `https://`.
    tls: bool,
    /// `host:port` as written in the `Host` header.
    authority: String,
    /// Host name or IP literal, without IPv6 brackets (what we connect to).
    host: String,
    port: u16,
    /// Path prefix without a trailing slash (usually empty).
    prefix: String,
}

impl BaseUrl {
    /// Parses a base URL (`http://` or `https://`).
    pub fn parse(url: &str) -> Result<BaseUrl, ClientError> {
        let bad = |why: &str| ClientError::Config(format!("invalid URL {url:?}: {why}"));
        let uri: Uri = url.trim().parse().map_err(|_| bad("not a URL"))?;
        let tls = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err(bad("expected http[s]://HOST[:PORT]")),
        };
        if uri.query().is_some() {
            return Err(bad("a base URL takes no query"));
        }
        let auth = uri.authority().ok_or_else(|| bad("no host"))?;
        let host = auth.host().trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(bad("no host"));
        }
        let port = auth.port_u16().unwrap_or(if tls { 443 } else { 80 });
        Ok(BaseUrl {
            tls,
            authority: auth.as_str().to_string(),
            host: host.to_string(),
            port,
            prefix: uri.path().trim_end_matches('/').to_string(),
        })
    }

    /// The full URL of `path` (which starts with `/` and may carry a query).
    pub fn url(&self, path: &str) -> String {
        format!(
            "{}://{}{}{}",
            self.scheme(),
            self.authority,
            self.prefix,
            path
        )
    }

    fn scheme(&self) -> &'static str {
        if self.tls { "https" } else { "http" }
    }

    /// The request target (origin form) for `path`.
    fn target(&self, path: &str) -> String {
        format!("{}{}", self.prefix, path)
    }

    /// A request builder for `method path` with `Host` set.
    pub fn request(&self, method: hyper::Method, path: &str) -> hyper::http::request::Builder {
        Request::builder()
            .method(method)
            .uri(self.target(path))
            .header(hyper::header::HOST, &self.authority)
    }
}

impl std::fmt::Display for BaseUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}://{}{}", self.scheme(), self.authority, self.prefix)
    }
}

/// One HTTP/1.1 connection; requests on it are sent one after another. Opened on first
/// use (or at once by [`Connection::open`]) and opened again when the server closed it
/// or a request on it failed.
pub struct Connection {
    sender: Option<http1::SendRequest<Body>>,
    base: BaseUrl,
}

impl Connection {
    /// A connection to `base` that connects when the first request is sent.
    pub fn lazy(base: &BaseUrl) -> Connection {
        Connection {
            sender: None,
            base: base.clone(),
        }
    }

    /// Opens a connection to `base` now (so that an unreachable server shows at once).
    pub async fn open(base: &BaseUrl) -> Result<Connection, ClientError> {
        let mut c = Connection::lazy(base);
        c.sender = Some(c.handshake().await?);
        Ok(c)
    }

    async fn handshake(&self) -> Result<http1::SendRequest<Body>, ClientError> {
        let base = &self.base;
        let unreachable = |e: std::io::Error| ClientError::Unreachable {
            url: base.to_string(),
            detail: super::error::chain(&e),
        };
        let stream = tokio::time::timeout(
            CONNECT_TIMEOUT,
            TcpStream::connect((base.host.as_str(), base.port)),
        )
        .await
        .map_err(|_| {
            unreachable(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "connection timed out",
            ))
        })?
        .map_err(unreachable)?;
        let _ = stream.set_nodelay(true);
        let http_err = |e: hyper::Error| ClientError::Http {
            url: base.to_string(),
            detail: super::error::chain(&e),
        };
        let sender = if base.tls {
            let stream = tls_connect(base, stream).await?;
            let (sender, conn) = http1::handshake(TokioIo::new(stream))
                .await
                .map_err(http_err)?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            sender
        } else {
            let (sender, conn) = http1::handshake(TokioIo::new(stream))
                .await
                .map_err(http_err)?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            sender
        };
        Ok(sender)
    }

    /// Sends one request and returns the response head (the body streams).
    pub async fn send(&mut self, req: Request<Body>) -> Result<Response<Incoming>, ClientError> {
        let url = self.base.url(
            req.uri()
                .path_and_query()
                .map(|p| p.as_str())
                .unwrap_or("/"),
        );
        let (mut sender, reused) = match self.sender.take() {
            Some(s) if !s.is_closed() => (s, true),
            _ => (self.handshake().await?, false),
        };
        let http_err = |e: hyper::Error| ClientError::Http {
            url: url.clone(),
            detail: super::error::chain(&e),
        };
        // A server may close a kept-alive connection at any moment (after a streamed
        // answer, an idle timeout): a request that was not sent on it goes on a new one.
        // One that was sent is never repeated (it may not be idempotent).
        if sender.ready().await.is_err() && reused {
            sender = self.handshake().await?;
        }
        sender.ready().await.map_err(http_err)?;
        let resp = match sender.try_send_request(req).await {
            Ok(resp) => resp,
            Err(mut e) => match e.take_message() {
                Some(req) if reused => {
                    sender = self.handshake().await?;
                    sender.ready().await.map_err(http_err)?;
                    sender.send_request(req).await.map_err(http_err)?
                }
                _ => return Err(http_err(e.into_error())),
            },
        };
        // Only a connection whose request went through is used again.
        self.sender = Some(sender);
        Ok(resp)
    }
}

/// The TLS handshake with `base`'s host (verified against the system's roots or
/// `SSL_CERT_FILE`).
async fn tls_connect(
    base: &BaseUrl,
    tcp: TcpStream,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, ClientError> {
    static CONFIG: std::sync::OnceLock<Result<std::sync::Arc<rustls::ClientConfig>, String>> =
        std::sync::OnceLock::new();
    let config = CONFIG
        .get_or_init(|| {
            cubicle_api::tls::client_config(None)
                .map(|mut c| {
                    c.alpn_protocols = vec![b"http/1.1".to_vec()];
                    std::sync::Arc::new(c)
                })
                .map_err(|e| e.to_string())
        })
        .clone()
        .map_err(ClientError::Config)?;
    let name = rustls::pki_types::ServerName::try_from(base.host.clone())
        .map_err(|e| ClientError::Config(format!("{}: not a TLS server name: {e}", base.host)))?;
    tokio::time::timeout(
        CONNECT_TIMEOUT,
        tokio_rustls::TlsConnector::from(config).connect(name, tcp),
    )
    .await
    .map_err(|_| ClientError::Unreachable {
        url: base.to_string(),
        detail: "TLS handshake timed out".into(),
    })?
    .map_err(|e| ClientError::Unreachable {
        url: base.to_string(),
        detail: format!("TLS: {}", super::error::chain(&e)),
    })
}

/// Sends one request on a fresh connection.
pub async fn send(base: &BaseUrl, req: Request<Body>) -> Result<Response<Incoming>, ClientError> {
    Connection::open(base).await?.send(req).await
}

/// Reads a whole response body (bounded: a client never needs more than `limit` bytes).
pub async fn read_body(body: Incoming, limit: usize) -> Result<Bytes, ClientError> {
    let limited = http_body_util::Limited::new(body, limit);
    match limited.collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) => Err(ClientError::Protocol(format!(
            "reading the response body: {e}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_base_urls() {
        let b = BaseUrl::parse("http://127.0.0.1:3000").unwrap();
        assert_eq!((b.host.as_str(), b.port), ("127.0.0.1", 3000));
        assert_eq!(b.url("/v2/sandboxes"), "http://127.0.0.1:3000/v2/sandboxes");
        assert_eq!(b.target("/health"), "/health");

        let b = BaseUrl::parse("http://example.test/").unwrap();
        assert_eq!((b.host.as_str(), b.port), ("example.test", 80));
        assert_eq!(b.target("/x"), "/x");

        let b = BaseUrl::parse("http://[::1]:8080/api/").unwrap();
        assert_eq!((b.host.as_str(), b.port), ("::1", 8080));
        assert_eq!(b.target("/x"), "/api/x");
        assert_eq!(b.authority, "[::1]:8080");

        let b = BaseUrl::parse("https://api.example.test").unwrap();
        assert_eq!(
            (b.host.as_str(), b.port, b.tls),
            ("api.example.test", 443, true)
        );
        assert_eq!(b.url("/health"), "https://api.example.test/health");
        assert!(BaseUrl::parse("127.0.0.1:3000").is_err());
        assert!(BaseUrl::parse("ftp://x").is_err());
        assert!(BaseUrl::parse("http://x:3000/?a=b").is_err());
    }
}
