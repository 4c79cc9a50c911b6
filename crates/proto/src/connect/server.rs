//! The server half of Connect (on axum), as envd serves it: unary answers, request
//! envelopes, stream responses flushed per message and always closed by an end-of-stream
//! envelope, client-stream answers, and the `Connect-Timeout-Ms` and
//! `Keepalive-Ping-Interval` headers.

use std::{convert::Infallible, time::Duration};

use axum::{
    body::{Body, Bytes},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use futures_util::{Stream, StreamExt};
use http_body_util::BodyExt;
use serde::{Serialize, de::DeserializeOwned};

use super::body::{EnvelopeBody, ReadError};
use super::{
    Code, ConnectError, KEEPALIVE_HEADER, MAX_MESSAGE_BYTES, STREAM_CONTENT_TYPE, TIMEOUT_HEADER,
    UNARY_CONTENT_TYPE, decode_json, end_stream_envelope, envelope,
};

impl IntoResponse for ConnectError {
    /// The unary error form.
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        typed(
            (status, self.json().to_string()).into_response(),
            UNARY_CONTENT_TYPE,
        )
    }
}

/// Reads a whole unary request body (bounded) and decodes it.
pub async fn read_unary<T: DeserializeOwned>(body: Body) -> Result<T, ConnectError> {
    let bytes = axum::body::to_bytes(body, MAX_MESSAGE_BYTES)
        .await
        .map_err(|e| ConnectError::invalid_argument(format!("reading request body: {e}")))?;
    decode_json(&bytes)
}

/// A successful unary answer.
pub fn unary_ok<T: Serialize>(msg: &T) -> Response {
    match serde_json::to_vec(msg) {
        Ok(body) => typed((StatusCode::OK, body).into_response(), UNARY_CONTENT_TYPE),
        Err(e) => ConnectError::internal(format!("encoding response: {e}")).into_response(),
    }
}

/// A unary result as a response.
pub fn unary<T: Serialize>(result: Result<T, ConnectError>) -> Response {
    match result {
        Ok(msg) => unary_ok(&msg),
        Err(e) => e.into_response(),
    }
}

/// Incremental reader of request envelopes (client streams, and the single envelope of a
/// server-stream request).
pub struct EnvelopeReader {
    body: EnvelopeBody<Body>,
    done: bool,
}

impl EnvelopeReader {
    pub fn new(body: Body) -> Self {
        Self {
            body: EnvelopeBody::new(body, MAX_MESSAGE_BYTES),
            done: false,
        }
    }

    /// The next data message; `Ok(None)` at the end of the body or at an end-of-stream
    /// envelope.
    pub async fn next<T: DeserializeOwned>(&mut self) -> Result<Option<T>, ConnectError> {
        if self.done {
            return Ok(None);
        }
        match self.body.next().await {
            Ok(Some(env)) if env.is_end_of_stream() => {
                self.done = true;
                Ok(None)
            }
            Ok(Some(env)) => decode_json(&env.payload).map(Some),
            Ok(None) => {
                self.done = true;
                Ok(None)
            }
            Err(ReadError::Decode(e)) => Err(e),
            Err(ReadError::Body(e)) => Err(ConnectError::new(
                Code::Canceled,
                format!("reading request stream: {e}"),
            )),
            Err(ReadError::Truncated) => Err(ConnectError::invalid_argument(
                "request body ended inside a message envelope",
            )),
        }
    }

    /// Reads and discards the rest of the body (at most [`MAX_MESSAGE_BYTES`]), so the
    /// connection can be reused.
    pub async fn drain(self) {
        let mut body = self.body.body;
        let mut left = MAX_MESSAGE_BYTES;
        while let Some(Ok(frame)) = body.frame().await {
            let n = frame.data_ref().map(|d| d.len()).unwrap_or(0);
            if n > left {
                return;
            }
            left -= n;
        }
    }
}

/// Reads the single request message of a server-streaming call.
///
/// The rest of the body (normally just the terminating chunk of a chunked body, which
/// the Python SDK may send a moment after the message) is read to its end in the
/// background: hyper only keeps a connection alive when the request body was read to
/// the end, and a client that pooled the connection would see its next request fail
/// with "connection closed before message completed".
pub async fn read_stream_request<T: DeserializeOwned>(body: Body) -> Result<T, ConnectError> {
    let mut reader = EnvelopeReader::new(body);
    let msg = reader.next().await;
    tokio::spawn(reader.drain());
    match msg? {
        Some(msg) => Ok(msg),
        None => Err(ConnectError::invalid_argument("missing request message")),
    }
}

/// Builds a server-stream response from a stream of messages. Each message is flushed
/// as produced; the first `Err` ends the stream with an error end-of-stream envelope;
/// a stream that simply ends gets `{}`.
pub fn stream_response<T, S>(messages: S) -> Response
where
    T: Serialize + Send + 'static,
    S: Stream<Item = Result<T, ConnectError>> + Send + 'static,
{
    typed(
        Response::new(Body::from_stream(stream_body(messages))),
        STREAM_CONTENT_TYPE,
    )
}

/// `resp` with `Content-Type: content_type` (exactly: the Python SDK refuses parameters).
fn typed(mut resp: Response, content_type: &'static str) -> Response {
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

fn stream_body<T, S>(messages: S) -> impl Stream<Item = Result<Bytes, Infallible>> + Send
where
    T: Serialize + Send + 'static,
    S: Stream<Item = Result<T, ConnectError>> + Send + 'static,
{
    // State: the message stream, or None once the end-of-stream envelope was sent.
    futures_util::stream::unfold(Some(Box::pin(messages)), |state| async move {
        let mut messages = state?;
        match messages.next().await {
            Some(Ok(msg)) => match serde_json::to_vec(&msg) {
                Ok(payload) => Some((Ok(envelope(0, &payload)), Some(messages))),
                Err(e) => {
                    let err = ConnectError::internal(format!("encoding message: {e}"));
                    Some((Ok(end_stream_envelope(Err(&err))), None))
                }
            },
            Some(Err(err)) => Some((Ok(end_stream_envelope(Err(&err))), None)),
            None => Some((Ok(end_stream_envelope(Ok(()))), None)),
        }
    })
}

/// A server-stream response that carries only an error (Connect answers stream errors
/// with HTTP 200 and the error in the end-of-stream envelope).
pub fn stream_error(err: ConnectError) -> Response {
    stream_response(futures_util::stream::once(async move { Err::<(), _>(err) }))
}

/// A client-stream answer: one data envelope with `msg`, then end-of-stream; or an
/// error end-of-stream.
pub fn client_stream_response<T: Serialize>(result: Result<T, ConnectError>) -> Response {
    let body = match result.and_then(|m| {
        serde_json::to_vec(&m).map_err(|e| ConnectError::internal(format!("encoding: {e}")))
    }) {
        Ok(payload) => {
            let mut b = envelope(0, &payload).to_vec();
            b.extend_from_slice(&end_stream_envelope(Ok(())));
            b
        }
        Err(e) => end_stream_envelope(Err(&e)).to_vec(),
    };
    typed(Response::new(Body::from(body)), STREAM_CONTENT_TYPE)
}

/// `Connect-Timeout-Ms`, if present and valid.
pub fn timeout(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get(TIMEOUT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_millis)
}

/// `Keepalive-Ping-Interval` (seconds), default 90 s as upstream envd.
pub fn keepalive_interval(headers: &HeaderMap) -> Duration {
    headers
        .get(KEEPALIVE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(90))
}

#[cfg(test)]
mod tests {
    use super::super::FLAG_END_STREAM;
    use super::*;

    #[tokio::test]
    async fn reads_split_envelopes() {
        let mut bytes = envelope(0, br#"{"a":1}"#).to_vec();
        bytes.extend_from_slice(&envelope(0, br#"{"a":2}"#));
        bytes.extend_from_slice(&envelope(FLAG_END_STREAM, b"{}"));
        let chunks: Vec<Result<Bytes, Infallible>> = bytes
            .chunks(3)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let body = Body::from_stream(futures_util::stream::iter(chunks));
        let mut r = EnvelopeReader::new(body);
        let a: serde_json::Value = r.next().await.unwrap().unwrap();
        let b: serde_json::Value = r.next().await.unwrap().unwrap();
        assert_eq!(a["a"], 1);
        assert_eq!(b["a"], 2);
        assert!(r.next::<serde_json::Value>().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn truncated_envelope_is_an_error() {
        let bytes = envelope(0, br#"{"a":1}"#);
        let body = Body::from(bytes.slice(..6));
        let mut r = EnvelopeReader::new(body);
        let err = r.next::<serde_json::Value>().await.unwrap_err();
        assert_eq!(err.code, Code::InvalidArgument);
    }

    #[tokio::test]
    async fn stream_ends_with_end_of_stream() {
        let msgs = futures_util::stream::iter(vec![Ok(serde_json::json!({"x":1}))]);
        let resp = stream_response(msgs);
        assert_eq!(resp.headers()[header::CONTENT_TYPE], STREAM_CONTENT_TYPE);
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        let first_len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        assert_eq!(body[0], 0);
        assert_eq!(&body[5..5 + first_len], br#"{"x":1}"#);
        let rest = &body[5 + first_len..];
        assert_eq!(rest[0], FLAG_END_STREAM);
        assert_eq!(&rest[5..], b"{}");
    }

    #[tokio::test]
    async fn stream_error_is_in_trailer() {
        let resp = stream_error(ConnectError::not_found("no such process"));
        assert_eq!(resp.status(), StatusCode::OK);
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        assert_eq!(body[0], FLAG_END_STREAM);
        let v: serde_json::Value = serde_json::from_slice(&body[5..]).unwrap();
        assert_eq!(v["error"]["code"], "not_found");
    }

    #[test]
    fn unary_error_status() {
        let resp = ConnectError::unauthenticated("no token").into_response();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(resp.headers()[header::CONTENT_TYPE], UNARY_CONTENT_TYPE);
    }
}
