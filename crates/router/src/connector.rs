//! Opening a connection to one port of one sandbox, for the pooled HTTP/1 client.
//!
//! The client's pool key is the request URI's authority, which the data plane sets to
//! `http://<sandbox id>:<port>`; this connector turns it back into a connection:
//! * envd's port → the idle connection the node kept from the sandbox's create, when the
//!   resolver hands one over (`SandboxResolver::take_envd_conn`: a new sandbox's first
//!   request pays for no connect); else envd's Unix socket in the sandbox's host-visible
//!   ctl directory, via `cubicle_runtime::connect_ctl_socket_async` (the directory is
//!   writable by the sandbox, which could plant a symlink to a host socket there; that
//!   function refuses anything but a real socket, and connects without blocking).
//! * any other port → `127.0.0.1:<port>` inside the sandbox's network namespace, entered
//!   through a pidfd of its init (never `/proc/<pid>/ns/net`, which a reused pid would
//!   turn into another process's namespace), whether or not the sandbox has a veth.
//!
//! The sandbox is re-resolved for every new connection, so a killed sandbox is never
//! reconnected to.

use std::{
    future::Future,
    io,
    path::Path,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use axum::http::Uri;
use hyper_util::{
    client::legacy::connect::{Connected, Connection},
    rt::TokioIo,
};
use tokio::net::{TcpStream, UnixStream};

use std::sync::Arc;

use crate::drain::{Drains, Link};
use crate::{Resolver, SandboxTarget, error::RouterError, routing::ENVD_PORT};

/// Connector for `hyper_util`'s pooled client.
#[derive(Clone)]
pub struct SandboxConnector {
    pub resolver: Resolver,
    pub timeout: Duration,
    /// Every connection gets a link here, so that a sandbox's can all be closed at once.
    pub drains: Drains,
}

/// A connection to a sandbox port.
pub struct Upstream {
    stream: Stream,
    link: Arc<Link>,
}

enum Stream {
    Unix(TokioIo<UnixStream>),
    Tcp(TokioIo<TcpStream>),
}

/// Fails the call when the connection was drained (see `drain.rs`).
macro_rules! check_link {
    ($self:ident, $cx:ident) => {
        if let Err(e) = $self.link.check($cx) {
            return Poll::Ready(Err(e));
        }
    };
}

impl hyper::rt::Read for Upstream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        check_link!(this, cx);
        match &mut this.stream {
            Stream::Unix(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl hyper::rt::Write for Upstream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        check_link!(this, cx);
        match &mut this.stream {
            Stream::Unix(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        check_link!(this, cx);
        match &mut this.stream {
            Stream::Unix(s) => Pin::new(s).poll_flush(cx),
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().stream {
            Stream::Unix(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.stream {
            Stream::Unix(s) => s.is_write_vectored(),
            Stream::Tcp(s) => s.is_write_vectored(),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        check_link!(this, cx);
        match &mut this.stream {
            Stream::Unix(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }
}

impl Connection for Upstream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

/// The pool key URI for a sandbox port.
pub fn upstream_authority(id: &str, port: u16) -> String {
    format!("{id}:{port}")
}

fn is_refused(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(io) = e.downcast_ref::<io::Error>()
            && matches!(
                io.kind(),
                io::ErrorKind::ConnectionRefused
                    | io::ErrorKind::NotFound
                    | io::ErrorKind::ConnectionReset
            )
        {
            return true;
        }
        cur = e.source();
    }
    false
}

async fn connect_envd(id: &str, socket: &Path) -> Result<Stream, RouterError> {
    let not_open = |detail: String| RouterError::PortNotOpen {
        id: id.to_owned(),
        port: ENVD_PORT,
        detail,
    };
    if cubicle_runtime::ctl_socket_parts(socket).is_err() {
        return Err(RouterError::Internal(format!(
            "bad envd socket path {}",
            socket.display()
        )));
    }
    // Inline (no hop to the blocking pool): two O_PATH opens and a non-blocking connect.
    let stream = cubicle_runtime::connect_ctl_socket_async(socket)
        .await
        .map_err(|e| not_open(e.to_string()))?;
    Ok(Stream::Unix(TokioIo::new(stream)))
}

/// Whether an error chain holds ESRCH: `setns` through a pidfd whose process exited.
fn is_gone(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(io) = e.downcast_ref::<io::Error>()
            && io.raw_os_error() == Some(libc::ESRCH)
        {
            return true;
        }
        cur = e.source();
    }
    false
}

async fn connect_tcp(target: &SandboxTarget, port: u16) -> Result<Stream, RouterError> {
    let id = target.id.clone();
    let gone = || RouterError::SandboxNotFound { id: id.clone() };
    let pidfd = target.init_pidfd.as_ref().ok_or_else(gone)?;
    let netns = cubicle_runtime::network::Netns::from_fd(pidfd.try_clone().map_err(|e| {
        RouterError::Internal(format!("sandbox {id}: duplicating the init's pidfd: {e}"))
    })?);
    let stream = cubicle_runtime::network::connect_in_netns_async(&netns, port)
        .await
        .map_err(|e| {
            if is_gone(&e) {
                // The init has exited: the sandbox is gone.
                gone()
            } else if is_refused(&e) {
                RouterError::PortNotOpen {
                    id: id.clone(),
                    port,
                    detail: e.to_string(),
                }
            } else {
                RouterError::Upstream {
                    id: id.clone(),
                    port,
                    detail: e.to_string(),
                }
            }
        })?;
    let _ = stream.set_nodelay(true);
    Ok(Stream::Tcp(TokioIo::new(stream)))
}

impl tower_service::Service<Uri> for SandboxConnector {
    type Response = Upstream;
    type Error = RouterError;
    type Future = Pin<Box<dyn Future<Output = Result<Upstream, RouterError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), RouterError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let resolver = self.resolver.clone();
        let timeout = self.timeout;
        let drains = self.drains.clone();
        Box::pin(async move {
            let (Some(id), Some(port)) = (uri.host(), uri.port_u16()) else {
                return Err(RouterError::Internal(format!("bad upstream uri {uri}")));
            };
            let target = resolver
                .resolve(id)
                .ok_or_else(|| RouterError::SandboxNotFound { id: id.to_owned() })?;
            let connect = async {
                if port == ENVD_PORT {
                    if let Some(conn) = resolver.take_envd_conn(&target.id) {
                        // Made by the node for its own requests, handed over idle.
                        return UnixStream::from_std(conn)
                            .map(|s| Stream::Unix(TokioIo::new(s)))
                            .map_err(|e| RouterError::Internal(format!("adopting: {e}")));
                    }
                    connect_envd(&target.id, &target.envd_socket).await
                } else {
                    connect_tcp(&target, port).await
                }
            };
            match tokio::time::timeout(timeout, connect).await {
                Ok(result) => result.map(|stream| Upstream {
                    stream,
                    link: drains.link(&target.id),
                }),
                Err(_) => Err(RouterError::PortNotOpen {
                    id: target.id.clone(),
                    port,
                    detail: format!("connect timed out after {timeout:?}"),
                }),
            }
        })
    }
}
