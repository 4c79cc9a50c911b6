//! Upgraded connections (WebSocket and other `101 Switching Protocols` tunnels to user
//! ports): bytes copied both ways until either side closes, or until nothing moved in
//! either direction for the idle timeout — a tunnel nobody uses must not hold a client
//! connection, an upstream connection and a task forever.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Copies between `a` and `b` until one side closes, an error, or `idle` passes without
/// a byte in either direction. Returns why it ended.
pub(crate) async fn copy_until_idle<A, B>(
    a: &mut A,
    b: &mut B,
    idle: Duration,
) -> std::io::Result<()>
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let start = Instant::now();
    let last = Arc::new(AtomicU64::new(0));
    let mut a = Watched {
        inner: a,
        start,
        last: last.clone(),
    };
    let mut b = Watched {
        inner: b,
        start,
        last: last.clone(),
    };
    let copy = tokio::io::copy_bidirectional(&mut a, &mut b);
    let mut copy = std::pin::pin!(copy);
    let mut deadline = start + idle;
    loop {
        tokio::select! {
            r = copy.as_mut() => return r.map(drop),
            () = tokio::time::sleep_until(deadline.into()) => {
                let seen = start + Duration::from_millis(last.load(Ordering::Relaxed));
                if seen + idle <= Instant::now() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no traffic for {idle:?}"),
                    ));
                }
                deadline = seen + idle;
            }
        }
    }
}

/// A stream that notes when bytes last moved through it.
struct Watched<'a, S> {
    inner: &'a mut S,
    start: Instant,
    last: Arc<AtomicU64>,
}

impl<S> Watched<'_, S> {
    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last.fetch_max(ms, Ordering::Relaxed);
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<'_, S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut *this.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.touch();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<'_, S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut *this.inner).poll_write(cx, data);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            this.touch();
        }
        r
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Traffic keeps the tunnel open past the idle time; silence ends it.
    #[tokio::test]
    async fn silence_ends_the_tunnel_traffic_keeps_it() {
        let (mut client, mut a) = tokio::io::duplex(1024);
        let (mut b, mut upstream) = tokio::io::duplex(1024);
        let idle = Duration::from_millis(300);
        let tunnel = tokio::spawn(async move { copy_until_idle(&mut a, &mut b, idle).await });
        let t0 = Instant::now();
        for _ in 0..6 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            client.write_all(b"ping").await.unwrap();
            let mut got = [0u8; 4];
            upstream.read_exact(&mut got).await.unwrap();
            assert_eq!(&got, b"ping");
        }
        assert!(!tunnel.is_finished(), "a busy tunnel stays open");
        let r = tunnel.await.unwrap();
        assert_eq!(r.unwrap_err().kind(), std::io::ErrorKind::TimedOut);
        let lived = t0.elapsed();
        assert!(
            lived >= Duration::from_millis(900) && lived < Duration::from_secs(3),
            "{lived:?}"
        );
    }
}
