//! Request bodies as bounded-memory byte streams.
//!
//! * [`from_body`]: the raw request body, with a per-read idle timeout (a stalled client
//!   cannot hold an upload open forever; the SDKs count on envd doing this).
//! * [`gunzip`]: streaming `Content-Encoding: gzip` decoding. Input is fed in small
//!   slices so a single chunk can never expand to more than a few MiB (gzip bombs).
//! * [`paced`]: re-chunks to at most 64 KiB and returns `Pending` (after waking itself)
//!   every 256 KiB. The multipart parser pulls from its stream until `Pending`, so without
//!   this an always-ready source (a fast socket, a decompressor) would be buffered whole.
//!   An optional [`HeaderGuard`] limits how much may be read while the parser looks for
//!   a part's headers (a never-ending header block would otherwise grow without bound).

use std::{
    io::{self, Write},
    mem,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    task::{Context, Poll, ready},
    time::Duration,
};

use axum::body::{Body, Bytes};
use flate2::write::MultiGzDecoder;
use futures_util::{Stream, StreamExt};

/// A boxed stream of body bytes.
pub(crate) type ByteStream = Pin<Box<dyn Stream<Item = io::Result<Bytes>> + Send>>;

/// How long an upload may go without receiving a byte.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// Largest chunk handed on by [`paced`].
const MAX_CHUNK: usize = 64 * 1024;
/// Bytes handed on by [`paced`] between two forced `Pending`s.
const YIELD_EVERY: usize = 256 * 1024;
/// Input slice fed to the gzip decoder at once (output ≤ ~1032× input).
const GZIP_SLICE: usize = 2 * 1024;
/// Most bytes the multipart parser may consume while looking for one part's headers.
pub(crate) const MAX_PART_HEADER_BYTES: u64 = 1024 * 1024;

/// The request body with a per-read idle timeout.
pub(crate) fn from_body(body: Body, idle: Duration) -> ByteStream {
    Box::pin(DrainOnDrop {
        inner: Some(Box::pin(IdleTimeout {
            inner: body
                .into_data_stream()
                .map(|r| r.map_err(io::Error::other))
                .boxed(),
            idle,
            sleep: Box::pin(tokio::time::sleep(idle)),
        })),
        ended: false,
    })
}

/// Most bytes read (and discarded) after a consumer stopped reading a body.
const DRAIN_LIMIT: usize = 1 << 20;
/// How long such a drain may take.
const DRAIN_TIME: Duration = Duration::from_secs(10);

/// Reads what is left of a body once its consumer drops it early — the multipart parser
/// stops at the closing boundary, before a chunked body's terminator; an error stops
/// reading anywhere. hyper closes a keep-alive connection whose request body was not read
/// to its end, and a pooled client (the router) still writing the rest would then see a
/// broken pipe. The rest is read in the background (bounded) while the answer goes out.
struct DrainOnDrop {
    inner: Option<ByteStream>,
    ended: bool,
}

impl Stream for DrainOnDrop {
    type Item = io::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let item = ready!(inner.as_mut().poll_next(cx));
        if item.is_none() {
            self.ended = true;
        }
        Poll::Ready(item)
    }
}

impl Drop for DrainOnDrop {
    fn drop(&mut self) {
        let (Some(mut rest), false) = (self.inner.take(), self.ended) else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            let _ = tokio::time::timeout(DRAIN_TIME, async move {
                let mut left = DRAIN_LIMIT;
                while let Some(Ok(chunk)) = rest.next().await {
                    if chunk.len() > left {
                        return;
                    }
                    left -= chunk.len();
                }
            })
            .await;
        });
    }
}

struct IdleTimeout {
    inner: Pin<Box<dyn Stream<Item = io::Result<Bytes>> + Send>>,
    idle: Duration,
    sleep: Pin<Box<tokio::time::Sleep>>,
}

impl Stream for IdleTimeout {
    type Item = io::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match self.inner.as_mut().poll_next(cx) {
            Poll::Ready(item) => {
                let deadline = tokio::time::Instant::now() + self.idle;
                self.sleep.as_mut().reset(deadline);
                Poll::Ready(item)
            }
            Poll::Pending => {
                ready!(self.sleep.as_mut().poll(cx));
                Poll::Ready(Some(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no data received for {} s", self.idle.as_secs()),
                ))))
            }
        }
    }
}

use std::future::Future as _;

/// Decodes a gzip (possibly multi-member) stream.
pub(crate) fn gunzip(inner: ByteStream) -> ByteStream {
    Box::pin(Gunzip {
        inner,
        dec: MultiGzDecoder::new(Vec::new()),
        pending: Bytes::new(),
        done: false,
    })
}

struct Gunzip {
    inner: ByteStream,
    dec: MultiGzDecoder<Vec<u8>>,
    pending: Bytes,
    done: bool,
}

fn invalid_gzip(detail: impl std::fmt::Display) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("invalid gzip body: {detail}"),
    )
}

impl Stream for Gunzip {
    type Item = io::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            while !this.pending.is_empty() {
                let slice = this.pending.split_to(this.pending.len().min(GZIP_SLICE));
                let mut off = 0;
                while off < slice.len() {
                    match this.dec.write(&slice[off..]) {
                        Ok(0) => {
                            this.done = true;
                            return Poll::Ready(Some(Err(invalid_gzip("trailing data"))));
                        }
                        Ok(n) => off += n,
                        Err(e) => {
                            this.done = true;
                            return Poll::Ready(Some(Err(invalid_gzip(e))));
                        }
                    }
                }
                let out = mem::take(this.dec.get_mut());
                if !out.is_empty() {
                    return Poll::Ready(Some(Ok(Bytes::from(out))));
                }
            }
            match ready!(this.inner.as_mut().poll_next(cx)) {
                Some(Ok(bytes)) => this.pending = bytes,
                Some(Err(e)) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(e)));
                }
                None => {
                    this.done = true;
                    if let Err(e) = this.dec.try_finish() {
                        return Poll::Ready(Some(Err(invalid_gzip(e))));
                    }
                    let out = mem::take(this.dec.get_mut());
                    return Poll::Ready(if out.is_empty() {
                        None
                    } else {
                        Some(Ok(Bytes::from(out)))
                    });
                }
            }
        }
    }
}

/// Limits the bytes consumed while a multipart parser looks for a part's headers.
#[derive(Debug, Default)]
pub(crate) struct HeaderGuard {
    armed: AtomicBool,
    used: AtomicU64,
}

impl HeaderGuard {
    /// Starts counting (call before asking the parser for the next part).
    pub fn arm(&self) {
        self.used.store(0, Ordering::Relaxed);
        self.armed.store(true, Ordering::Relaxed);
    }
    /// Stops counting (the parser returned a part).
    pub fn disarm(&self) {
        self.armed.store(false, Ordering::Relaxed);
    }
    fn charge(&self, n: usize) -> io::Result<()> {
        if self.armed.load(Ordering::Relaxed)
            && self.used.fetch_add(n as u64, Ordering::Relaxed) + n as u64 > MAX_PART_HEADER_BYTES
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "multipart part headers are too large or the boundary is missing",
            ));
        }
        Ok(())
    }
}

/// Re-chunks and paces a stream (see the module documentation).
pub(crate) fn paced(inner: ByteStream, guard: Option<Arc<HeaderGuard>>) -> ByteStream {
    Box::pin(Paced {
        inner,
        pending: Bytes::new(),
        since_yield: 0,
        guard,
        failed: false,
    })
}

struct Paced {
    inner: ByteStream,
    pending: Bytes,
    since_yield: usize,
    guard: Option<Arc<HeaderGuard>>,
    failed: bool,
}

impl Stream for Paced {
    type Item = io::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.failed {
            return Poll::Ready(None);
        }
        if this.since_yield >= YIELD_EVERY {
            this.since_yield = 0;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        if this.pending.is_empty() {
            match ready!(this.inner.as_mut().poll_next(cx)) {
                Some(Ok(bytes)) => this.pending = bytes,
                Some(Err(e)) => {
                    this.failed = true;
                    return Poll::Ready(Some(Err(e)));
                }
                None => return Poll::Ready(None),
            }
            if this.pending.is_empty() {
                // An empty chunk: ask again later rather than loop here.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
        }
        let chunk = this.pending.split_to(this.pending.len().min(MAX_CHUNK));
        if let Some(guard) = &this.guard
            && let Err(e) = guard.charge(chunk.len())
        {
            this.failed = true;
            return Poll::Ready(Some(Err(e)));
        }
        this.since_yield += chunk.len();
        Poll::Ready(Some(Ok(chunk)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::{Compression, write::GzEncoder};
    use futures_util::stream;

    fn gz(data: &[u8]) -> Vec<u8> {
        let mut e = GzEncoder::new(Vec::new(), Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn source(chunks: Vec<Vec<u8>>) -> ByteStream {
        stream::iter(chunks.into_iter().map(|c| Ok(Bytes::from(c)))).boxed()
    }

    async fn collect(mut s: ByteStream) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        while let Some(c) = s.next().await {
            out.extend_from_slice(&c?);
        }
        Ok(out)
    }

    #[tokio::test]
    async fn gunzips_in_bounded_chunks() {
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let z = gz(&data);
        let chunks: Vec<Vec<u8>> = z.chunks(7777).map(<[u8]>::to_vec).collect();
        assert_eq!(collect(gunzip(source(chunks))).await.unwrap(), data);
        // A bomb: 64 MiB of zeros in one input chunk never yields a huge chunk.
        let zeros = gz(&vec![0u8; 64 << 20]);
        let mut s = gunzip(source(vec![zeros]));
        let (mut total, mut biggest) = (0usize, 0usize);
        while let Some(c) = s.next().await {
            let c = c.unwrap();
            total += c.len();
            biggest = biggest.max(c.len());
        }
        assert_eq!(total, 64 << 20);
        assert!(biggest <= 4 << 20, "chunk of {biggest} bytes");
        // Two members concatenated.
        let mut two = gz(b"ab");
        two.extend(gz(b"cd"));
        assert_eq!(collect(gunzip(source(vec![two]))).await.unwrap(), b"abcd");
    }

    #[tokio::test]
    async fn rejects_bad_gzip() {
        let err = collect(gunzip(source(vec![b"not gzip at all".to_vec()])))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        let z = gz(&vec![7u8; 100_000]);
        let truncated = z[..z.len() / 2].to_vec();
        let err = collect(gunzip(source(vec![truncated]))).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[tokio::test]
    async fn paces_and_guards() {
        let s = paced(source(vec![vec![1u8; 1 << 20]]), None);
        let chunks: Vec<_> = s.collect().await;
        assert_eq!(chunks.len(), 16);
        assert!(
            chunks
                .iter()
                .all(|c| c.as_ref().unwrap().len() == MAX_CHUNK)
        );
        let guard = Arc::new(HeaderGuard::default());
        guard.arm();
        let err = collect(paced(source(vec![vec![0u8; 2 << 20]]), Some(guard.clone()))).await;
        assert!(err.is_err());
        guard.disarm();
        assert_eq!(
            collect(paced(source(vec![vec![0u8; 2 << 20]]), Some(guard)))
                .await
                .unwrap()
                .len(),
            2 << 20
        );
    }

    #[tokio::test]
    async fn idle_timeout_fires() {
        let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Bytes>>(1);
        let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        }));
        let mut s = from_body(body, Duration::from_millis(200));
        tx.send(Ok(Bytes::from_static(b"x"))).await.unwrap();
        assert_eq!(s.next().await.unwrap().unwrap(), Bytes::from_static(b"x"));
        let err = s.next().await.unwrap().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        drop(tx);
    }
}
