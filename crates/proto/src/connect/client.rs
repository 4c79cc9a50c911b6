//! The client half of Connect: reading a server stream's response body envelope by
//! envelope as it arrives, typed, up to its end-of-stream message. Building requests is
//! left to each client (they reach envd differently: the node over its Unix socket, the
//! command line and the bench through `cubicle serve`'s router); they share
//! [`request_envelope`](super::request_envelope), [`unary_error`](super::unary_error) and
//! the header names.

use std::fmt::Display;
use std::marker::PhantomData;

use bytes::Bytes;
use http_body::Body;
use serde::de::DeserializeOwned;

use super::body::{EnvelopeBody, ReadError};
use super::{ConnectError, parse_end_of_stream};

/// Why a server stream could not be read to a good end.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// The server ended the stream with an error (its end-of-stream message).
    #[error("{0}")]
    Rpc(ConnectError),
    /// The bytes do not follow the protocol, or the body broke.
    #[error("{0}")]
    Protocol(String),
}

/// How long a stream waits for its body's end after the end-of-stream message.
const BODY_END_WAIT: std::time::Duration = std::time::Duration::from_millis(250);

/// The response messages of a server stream, read as they arrive.
pub struct ServerStream<B, T> {
    body: EnvelopeBody<B>,
    finished: bool,
    _t: PhantomData<fn() -> T>,
}

impl<B, T> ServerStream<B, T>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Display,
    T: DeserializeOwned,
{
    /// Reads `body` (a `200 application/connect+json` response's), refusing envelopes
    /// larger than `max_envelope` bytes.
    pub fn new(body: B, max_envelope: usize) -> Self {
        ServerStream {
            body: EnvelopeBody::new(body, max_envelope),
            finished: false,
            _t: PhantomData,
        }
    }

    /// The next message; `Ok(None)` after a successful end-of-stream (or when the body
    /// ends without one, which the Python SDK tolerates too); `Err` for an error in the
    /// end-of-stream message, a broken body or an undecodable message.
    pub async fn next(&mut self) -> Result<Option<T>, StreamError> {
        if self.finished {
            return Ok(None);
        }
        let env = match self.body.next().await {
            Ok(Some(env)) => env,
            Ok(None) => {
                self.finished = true;
                return Ok(None);
            }
            Err(e) => {
                self.finished = true;
                return Err(StreamError::Protocol(match e {
                    ReadError::Decode(e) => format!("bad Connect envelope: {}", e.message),
                    ReadError::Body(e) => format!("the stream broke: {e}"),
                    ReadError::Truncated => "the stream ended inside a message".into(),
                }));
            }
        };
        if env.is_end_of_stream() {
            self.finished = true;
            // On to the body's own end (a chunked body's last chunk follows the
            // end-of-stream message): an HTTP/1.1 client reuses a connection only once its
            // response body was read to the end, and closes it when it is dropped before.
            // Not for long, nor past one more envelope: a server that keeps the body open
            // after its end-of-stream only costs the connection.
            let _ = tokio::time::timeout(BODY_END_WAIT, self.body.next()).await;
            return match parse_end_of_stream(&env.payload) {
                Ok(()) => Ok(None),
                Err(Some(e)) => Err(StreamError::Rpc(e)),
                Err(None) => Err(StreamError::Protocol(format!(
                    "undecodable end-of-stream message {}",
                    String::from_utf8_lossy(&env.payload)
                ))),
            };
        }
        serde_json::from_slice(&env.payload).map(Some).map_err(|e| {
            StreamError::Protocol(format!(
                "undecodable stream message {}: {e}",
                String::from_utf8_lossy(&env.payload)
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Code, end_stream_envelope, envelope};
    use super::*;
    use http_body_util::{Full, StreamBody};
    use hyper::body::Frame;

    fn body_of(
        chunks: Vec<Bytes>,
    ) -> StreamBody<impl futures_util::Stream<Item = Result<Frame<Bytes>, std::io::Error>> + Unpin>
    {
        StreamBody::new(futures_util::stream::iter(
            chunks.into_iter().map(|c| Ok(Frame::data(c))),
        ))
    }

    #[tokio::test]
    async fn reads_messages_to_the_end_of_stream() {
        let mut all = envelope(0, br#"{"a":1}"#).to_vec();
        all.extend_from_slice(&envelope(0, br#"{"a":2}"#));
        all.extend_from_slice(&end_stream_envelope(Ok(())));
        let chunks = all.chunks(3).map(Bytes::copy_from_slice).collect();
        let mut s = ServerStream::<_, serde_json::Value>::new(body_of(chunks), 1 << 20);
        assert_eq!(s.next().await.unwrap().unwrap()["a"], 1);
        assert_eq!(s.next().await.unwrap().unwrap()["a"], 2);
        assert_eq!(s.next().await.unwrap(), None);
        assert_eq!(s.next().await.unwrap(), None);
    }

    #[tokio::test]
    async fn the_body_is_read_to_its_end_after_the_end_of_stream() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        let ended = Arc::new(AtomicBool::new(false));
        let flag = ended.clone();
        let mut all = envelope(0, br#"{"a":1}"#).to_vec();
        all.extend_from_slice(&end_stream_envelope(Ok(())));
        let frames = futures_util::stream::iter(vec![Ok(Frame::data(Bytes::from(all)))]);
        // The body's end is a poll of its own, after the last data frame.
        let end = futures_util::stream::poll_fn(move |_| {
            flag.store(true, Ordering::SeqCst);
            std::task::Poll::<Option<Result<Frame<Bytes>, std::io::Error>>>::Ready(None)
        });
        use futures_util::StreamExt;
        let body = StreamBody::new(frames.chain(end));
        let mut s = ServerStream::<_, serde_json::Value>::new(body, 1 << 20);
        assert_eq!(s.next().await.unwrap().unwrap()["a"], 1);
        assert!(!ended.load(Ordering::SeqCst));
        assert_eq!(s.next().await.unwrap(), None);
        assert!(
            ended.load(Ordering::SeqCst),
            "the stream ended without reading its body to the end"
        );
    }

    #[tokio::test]
    async fn errors_in_the_end_of_stream_and_in_the_bytes() {
        let err = ConnectError::new(Code::InvalidArgument, "cwd '/nope' does not exist");
        let body = Full::new(end_stream_envelope(Err(&err)));
        let mut s = ServerStream::<_, serde_json::Value>::new(body, 1 << 20);
        let e = s.next().await.unwrap_err();
        assert_eq!(e, StreamError::Rpc(err));
        assert_eq!(
            e.to_string(),
            "invalid_argument: cwd '/nope' does not exist"
        );

        let cut = Full::new(Bytes::from_static(&[0, 0, 0, 0, 9, b'{']));
        let mut s = ServerStream::<_, serde_json::Value>::new(cut, 1 << 20);
        assert!(matches!(s.next().await, Err(StreamError::Protocol(_))));

        // A body that ends without an end-of-stream message ends the stream quietly.
        let body = Full::new(envelope(0, b"{}"));
        let mut s = ServerStream::<_, serde_json::Value>::new(body, 1 << 20);
        assert!(s.next().await.unwrap().is_some());
        assert_eq!(s.next().await.unwrap(), None);
    }
}
