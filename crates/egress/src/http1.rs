//! Plain HTTP/1 through the proxy, request by request: the client's byte stream is
//! split into request heads (parsed, checked and — the hook for per-rule rewriting,
//! e.g. header injection — possibly changed before they are sent on) and bodies
//! (`Content-Length` or chunked, passed through untouched). So every request of a
//! kept-alive connection is checked, not only the first. After `CONNECT` or an
//! `Upgrade` (WebSocket) the rest of the stream is passed through as it is.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::sniff::{MAX_SNIFF, RequestHead};

/// Where the client's stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Expecting a request head.
    Head,
    /// This many body bytes left.
    Body(u64),
    /// A chunk-size line is next.
    ChunkSize,
    /// This many chunk bytes left, then CRLF.
    ChunkData(u64),
    /// The CRLF after a chunk's data.
    ChunkEnd,
    /// Trailer lines until the empty one.
    Trailer,
    /// Anything (after CONNECT or an upgrade).
    Raw,
}

/// What the hook says about a request head.
pub(crate) type Verdict = Result<(), String>;

fn body_state(h: &RequestHead) -> State {
    if h.method.eq_ignore_ascii_case("CONNECT") || h.header("upgrade").is_some() {
        return State::Raw;
    }
    if h.header("transfer-encoding")
        .is_some_and(|te| te.to_ascii_lowercase().contains("chunked"))
    {
        return State::ChunkSize;
    }
    match h
        .header("content-length")
        .and_then(|v| v.trim().parse::<u64>().ok())
    {
        Some(0) | None => State::Head,
        Some(n) => State::Body(n),
    }
}

fn line_end(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\r\n").map(|p| p + 2)
}

/// Relays the client's requests to `upstream`, starting with the bytes already read
/// (`pending`), calling `check` on every request head (it may change the head; an error
/// ends the relay). Returns the bytes sent upstream, or why it stopped.
pub(crate) async fn relay_requests<R, W, C, F>(
    client: &mut R,
    upstream: &mut W,
    mut pending: Vec<u8>,
    mut check: C,
    sent: &std::sync::atomic::AtomicU64,
) -> Result<(), String>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
    C: FnMut(RequestHead) -> F,
    F: std::future::Future<Output = (RequestHead, Verdict)>,
{
    let mut state = State::Head;
    let mut chunk = vec![0u8; 64 * 1024];
    let io = |e: std::io::Error| e.to_string();
    let count = |n: usize| sent.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    loop {
        // Forward what the current state allows from `pending`.
        let progressed = match state {
            State::Head => match pending.windows(4).position(|w| w == b"\r\n\r\n") {
                Some(_) => {
                    let Ok(original) = RequestHead::parse_complete(&pending) else {
                        return Err("a malformed HTTP request".into());
                    };
                    let (head, verdict) = check(original.clone()).await;
                    verdict?;
                    let bytes = if head == original {
                        pending[..head.len].to_vec()
                    } else {
                        head.to_bytes()
                    };
                    upstream.write_all(&bytes).await.map_err(io)?;
                    count(bytes.len());
                    pending.drain(..original.len);
                    state = body_state(&head);
                    true
                }
                None if pending.len() > MAX_SNIFF * 4 => {
                    return Err("an HTTP request head over 64 KiB".into());
                }
                None => false,
            },
            State::Body(n) if !pending.is_empty() => {
                let k = (n.min(pending.len() as u64)) as usize;
                upstream.write_all(&pending[..k]).await.map_err(io)?;
                count(k);
                pending.drain(..k);
                state = if n - k as u64 == 0 {
                    State::Head
                } else {
                    State::Body(n - k as u64)
                };
                true
            }
            State::ChunkSize => match line_end(&pending) {
                Some(end) => {
                    let line = String::from_utf8_lossy(&pending[..end - 2]).to_string();
                    let size = u64::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
                        .map_err(|_| format!("a bad chunk size line {line:?}"))?;
                    upstream.write_all(&pending[..end]).await.map_err(io)?;
                    count(end);
                    pending.drain(..end);
                    state = if size == 0 {
                        State::Trailer
                    } else {
                        State::ChunkData(size)
                    };
                    true
                }
                None => false,
            },
            State::ChunkData(n) if !pending.is_empty() => {
                let k = (n.min(pending.len() as u64)) as usize;
                upstream.write_all(&pending[..k]).await.map_err(io)?;
                count(k);
                pending.drain(..k);
                state = if n - k as u64 == 0 {
                    State::ChunkEnd
                } else {
                    State::ChunkData(n - k as u64)
                };
                true
            }
            State::ChunkEnd if pending.len() >= 2 => {
                upstream.write_all(&pending[..2]).await.map_err(io)?;
                count(2);
                pending.drain(..2);
                state = State::ChunkSize;
                true
            }
            State::Trailer => match line_end(&pending) {
                Some(end) => {
                    upstream.write_all(&pending[..end]).await.map_err(io)?;
                    count(end);
                    pending.drain(..end);
                    if end == 2 {
                        state = State::Head;
                    }
                    true
                }
                None => false,
            },
            State::Raw if !pending.is_empty() => {
                upstream.write_all(&pending).await.map_err(io)?;
                count(pending.len());
                pending.clear();
                true
            }
            State::Body(0) => {
                state = State::Head;
                true
            }
            _ => false,
        };
        if progressed {
            continue;
        }
        let n = client.read(&mut chunk).await.map_err(io)?;
        if n == 0 {
            let _ = upstream.shutdown().await;
            return Ok(());
        }
        pending.extend_from_slice(&chunk[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    async fn run(
        input: &[u8],
        mut check: impl FnMut(&mut RequestHead) -> Verdict,
    ) -> (Vec<u8>, Result<(), String>) {
        let mut client = input;
        let mut out = Vec::new();
        let sent = AtomicU64::new(0);
        let check = |mut h: RequestHead| {
            let v = check(&mut h);
            std::future::ready((h, v))
        };
        let r = relay_requests(&mut client, &mut out, Vec::new(), check, &sent).await;
        assert_eq!(sent.into_inner(), out.len() as u64);
        (out, r)
    }

    #[tokio::test]
    async fn every_request_of_a_connection_is_checked() {
        let input = b"POST /a HTTP/1.1\r\nHost: ok.test\r\nContent-Length: 5\r\n\r\nhello\
GET /b HTTP/1.1\r\nHost: ok.test\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n0\r\nT: 1\r\n\r\n\
GET /c HTTP/1.1\r\nHost: evil.test\r\n\r\n";
        let mut seen = Vec::new();
        let (out, r) = run(input, |h| {
            seen.push(h.host().unwrap_or_default());
            if h.host().as_deref() == Some("ok.test") {
                Ok(())
            } else {
                Err("Host changed".into())
            }
        })
        .await;
        assert_eq!(seen, ["ok.test", "ok.test", "evil.test"]);
        assert_eq!(r, Err("Host changed".into()));
        // The first two went through byte for byte; the third did not.
        let first_two = &input[..input.len() - b"GET /c HTTP/1.1\r\nHost: evil.test\r\n\r\n".len()];
        assert_eq!(out, first_two);
    }

    #[tokio::test]
    async fn heads_can_be_rewritten_and_upgrades_pass_through() {
        let input =
            b"GET /ws HTTP/1.1\r\nHost: ok.test\r\nUpgrade: websocket\r\n\r\nGET /not-a-request";
        let (out, r) = run(input, |h| {
            h.set_header("X-Injected", "1");
            Ok(())
        })
        .await;
        assert_eq!(r, Ok(()));
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.starts_with(
                "GET /ws HTTP/1.1\r\nHost: ok.test\r\nUpgrade: websocket\r\nX-Injected: 1\r\n\r\n"
            ),
            "{text}"
        );
        assert!(
            text.ends_with("GET /not-a-request"),
            "after the upgrade the stream is raw"
        );
        let (_, r) = run(
            b"GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            |_| Ok(()),
        )
        .await;
        assert!(r.is_err());
    }
}
