//! The front door of `cubicle serve`: accepts TCP connections and serves HTTP/1.1 on them
//! (REST and data plane share it), with limits a hostile client cannot get around:
//!
//! * at most [`ServerLimits::max_connections_per_client`] open connections per client
//!   address, and [`ServerLimits::max_connections`] in all; a connection over either
//!   limit is answered `429`/`503` in E2B's error shape and closed at once;
//! * a request's head must arrive within [`ServerLimits::header_read_timeout`], counted
//!   from the moment the connection waits for it — also between requests on a kept-alive
//!   connection, so an idle or trickling (slowloris) connection is closed;
//! * TCP_NODELAY on every connection (Connect streams are many small writes; with Nagle
//!   each one after the first waits for the client's delayed ACK);
//! * TLS when given an acceptor (`cubicle serve --tls-cert/--tls-key`): the handshake
//!   runs on the connection's own task and must finish within the header-read timeout;
//! * every request carries its client's address ([`ClientAddr`], for the access log);
//! * an error answered to a request whose body was not read to its end (refused before
//!   reading it: bad credentials, a paused or unknown sandbox) says `Connection: close`:
//!   hyper closes such a connection after the answer, and a client that put it back in
//!   its pool would send its next request into a closed socket;
//! * graceful shutdown: stop accepting, let open requests finish.
//!
//! Upgraded connections (WebSocket tunnels to user ports) leave hyper's hands; the data
//! plane bounds their idle time itself (`tunnel.rs`).

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

/// The address of the client a request came from (in the request's extensions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientAddr(pub SocketAddr);

/// What one client, and all clients together, may hold open.
#[derive(Debug, Clone)]
pub struct ServerLimits {
    /// Open connections per client address.
    pub max_connections_per_client: usize,
    /// Open connections in all.
    pub max_connections: usize,
    /// Longest wait for a request's head (first byte to last header), also for the next
    /// request on an idle kept-alive connection.
    pub header_read_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_connections_per_client: 512,
            max_connections: 8192,
            header_read_timeout: Duration::from_secs(30),
        }
    }
}

/// Open connections per client address, and in all.
#[derive(Default)]
struct Counts {
    per_client: HashMap<IpAddr, usize>,
    total: usize,
}

/// One admitted connection; gives its place back when dropped.
struct Admitted {
    counts: Arc<Mutex<Counts>>,
    client: IpAddr,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut c = lock(&self.counts);
        c.total = c.total.saturating_sub(1);
        if let Some(n) = c.per_client.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                c.per_client.remove(&self.client);
            }
        }
    }
}

fn lock(m: &Mutex<Counts>) -> std::sync::MutexGuard<'_, Counts> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why a connection was turned away.
enum Refusal {
    Client(usize),
    Total(usize),
}

fn admit(
    counts: &Arc<Mutex<Counts>>,
    limits: &ServerLimits,
    client: IpAddr,
) -> Result<Admitted, Refusal> {
    let mut c = lock(counts);
    if c.total >= limits.max_connections {
        return Err(Refusal::Total(limits.max_connections));
    }
    let n = c.per_client.entry(client).or_insert(0);
    if *n >= limits.max_connections_per_client {
        return Err(Refusal::Client(limits.max_connections_per_client));
    }
    *n += 1;
    c.total += 1;
    Ok(Admitted {
        counts: counts.clone(),
        client,
    })
}

/// Serves `app` on `listener` until `shutdown` completes, then stops accepting and
/// returns once every open connection has finished its requests (the caller bounds that
/// wait). With `tls`, every connection is TLS (no plain HTTP on the same port).
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: ServerLimits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shutdown: impl Future<Output = ()>,
) {
    let counts = Arc::new(Mutex::new(Counts::default()));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors or similar: do not spin; connections that
                    // end free what new ones need.
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = tcp.set_nodelay(true);
        match admit(&counts, &limits, peer.ip()) {
            Ok(admitted) => {
                let (app, stop_rx, tls) = (app.clone(), stop_rx.clone(), tls.clone());
                let timeout = limits.header_read_timeout;
                tokio::spawn(async move {
                    match tls {
                        None => serve_connection(tcp, peer, app, timeout, stop_rx).await,
                        Some(acceptor) => {
                            match tokio::time::timeout(timeout, acceptor.accept(tcp)).await {
                                Ok(Ok(tls)) => {
                                    serve_connection(tls, peer, app, timeout, stop_rx).await
                                }
                                Ok(Err(e)) => {
                                    tracing::debug!(client = %peer, "TLS handshake failed: {e}")
                                }
                                Err(_) => {
                                    tracing::debug!(client = %peer, "TLS handshake timed out")
                                }
                            }
                        }
                    }
                    drop(admitted);
                });
            }
            Err(refusal) => {
                tokio::spawn(refuse(tcp, peer, refusal));
            }
        }
    }
    drop((listener, stop_rx));
    let _ = stop_tx.send(true);
    // Every connection task holds a receiver: they are all done when none is left.
    stop_tx.closed().await;
}

async fn serve_connection<Io>(
    io: Io,
    peer: SocketAddr,
    app: axum::Router,
    header_read_timeout: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) where
    Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        let mut app = app.clone();
        req.extensions_mut().insert(ClientAddr(peer));
        async move {
            let read = Arc::new(AtomicBool::new(false));
            let has_body = !hyper::body::Body::is_end_stream(req.body());
            let req = req.map(|inner| {
                Body::new(Tracked {
                    inner,
                    read: read.clone(),
                })
            });
            let mut resp = tower_service::Service::call(&mut app, req).await?;
            if has_body
                && (resp.status().is_client_error() || resp.status().is_server_error())
                && !read.load(Ordering::Acquire)
            {
                resp.headers_mut().insert(
                    axum::http::header::CONNECTION,
                    axum::http::HeaderValue::from_static("close"),
                );
            }
            Ok::<_, std::convert::Infallible>(resp)
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout)
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    let mut conn = std::pin::pin!(conn);
    let mut stopping = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!("connection ended: {e}");
                }
                return;
            }
            changed = stop.changed(), if !stopping => {
                stopping = true;
                if changed.is_ok() {
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// A request body that records whether it was read to its end.
struct Tracked {
    inner: Incoming,
    read: Arc<AtomicBool>,
}

impl hyper::body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, hyper::Error>>> {
        let frame = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(frame, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.read.store(true, Ordering::Release);
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Answers a connection over a limit with E2B's error shape, then closes it (without
/// reading its request: the answer is the same whatever it asked).
async fn refuse(mut tcp: TcpStream, peer: SocketAddr, refusal: Refusal) {
    let (status, message) = match refusal {
        Refusal::Client(n) => (
            "429 Too Many Requests",
            format!(
                "too many open connections from {} (at most {n}); close some or reuse them",
                peer.ip()
            ),
        ),
        Refusal::Total(n) => (
            "503 Service Unavailable",
            format!("the server holds its maximum of {n} connections; try again shortly"),
        ),
    };
    tracing::debug!(client = %peer, "{message}");
    let code: u16 = status[..3].parse().unwrap_or(503);
    let body = serde_json::json!({ "code": code, "message": message }).to_string();
    let answer = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let _ = tcp.write_all(answer.as_bytes()).await;
        let _ = tcp.shutdown().await;
        // Read (and drop) a little of what the client still sends, so that closing does
        // not reset the connection before it read the answer.
        let mut buf = [0u8; 4096];
        let mut left: usize = 64 * 1024;
        while left > 0 {
            match tokio::io::AsyncReadExt::read(&mut tcp, &mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    })
    .await;
}
