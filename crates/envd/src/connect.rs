//! The Connect protocol (JSON codec only) as the E2B SDKs speak it.
//!
//! * Unary calls: the request body is one JSON message; the answer is `200
//!   application/json` with a JSON message, or an error status with
//!   `{"code":"<connect code>","message":"…"}`.
//! * Streams (server- and client-streaming): bodies are sequences of envelopes — one flag
//!   byte (`0x00` data, `0x02` end-of-stream), a big-endian `u32` length, the JSON payload.
//!   Responses use `Content-Type: application/connect+json` with no parameters (the
//!   Python SDK rejects any), are flushed per message, and always end with an
//!   end-of-stream envelope (`{}` or `{"error":{…}}`) — the JS SDK fails without it.
//!
//! See `shared/spec/e2b-compat.md` §3.2–3.3.

use std::{convert::Infallible, time::Duration};

use axum::{
    body::{Body, Bytes},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use futures_util::{Stream, StreamExt};
use http_body_util::BodyExt;
use serde::{Serialize, de::DeserializeOwned};

/// Content type of every Connect stream response, exactly (no parameters).
pub const STREAM_CONTENT_TYPE: &str = "application/connect+json";
/// Largest unary request or single stream envelope we accept.
pub const MAX_MESSAGE_BYTES: usize = 32 << 20;

const FLAG_END_STREAM: u8 = 0x02;
const FLAG_COMPRESSED: u8 = 0x01;

/// Connect error codes (https://connectrpc.com/docs/protocol#error-codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    /// The wire name of the code.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// HTTP status used for this code on unary calls.
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
                StatusCode::BAD_REQUEST
            }
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// An error answered to a Connect client.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}: {message}", code.as_str())]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }
    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(Code::Unauthenticated, message)
    }
    pub fn failed_precondition(message: impl Into<String>) -> Self {
        Self::new(Code::FailedPrecondition, message)
    }
    pub fn already_exists(message: impl Into<String>) -> Self {
        Self::new(Code::AlreadyExists, message)
    }
    pub fn unimplemented(message: impl Into<String>) -> Self {
        Self::new(Code::Unimplemented, message)
    }

    /// Maps an I/O error on `path` to the code the SDKs expect.
    pub fn from_io(err: &std::io::Error, what: &str) -> Self {
        use std::io::ErrorKind as K;
        let code = match err.kind() {
            K::NotFound => Code::NotFound,
            K::PermissionDenied => Code::PermissionDenied,
            K::AlreadyExists => Code::AlreadyExists,
            K::InvalidInput | K::NotADirectory | K::IsADirectory | K::InvalidFilename => {
                Code::InvalidArgument
            }
            K::StorageFull | K::QuotaExceeded => Code::ResourceExhausted,
            _ => Code::Internal,
        };
        Self::new(code, format!("{what}: {err}"))
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({ "code": self.code.as_str(), "message": self.message })
    }
}

impl IntoResponse for ConnectError {
    /// The unary error form.
    fn into_response(self) -> Response {
        let mut resp = (self.code.http_status(), self.json().to_string()).into_response();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        resp
    }
}

/// Parses a JSON message, mapping failures to `invalid_argument`.
pub fn decode_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ConnectError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        // An empty body is the empty message.
        return serde_json::from_slice(b"{}")
            .map_err(|e| ConnectError::invalid_argument(format!("invalid request: {e}")));
    }
    serde_json::from_slice(bytes)
        .map_err(|e| ConnectError::invalid_argument(format!("invalid request message: {e}")))
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
        Ok(body) => {
            let mut resp = (StatusCode::OK, body).into_response();
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            resp
        }
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

/// Encodes one envelope.
pub fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(flags);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    Bytes::from(out)
}

/// The end-of-stream envelope for a stream that ended with `result`.
pub fn end_stream_envelope(result: Result<(), &ConnectError>) -> Bytes {
    let payload = match result {
        Ok(()) => b"{}".to_vec(),
        Err(e) => serde_json::json!({ "error": e.json() })
            .to_string()
            .into_bytes(),
    };
    envelope(FLAG_END_STREAM, &payload)
}

/// Incremental reader of request envelopes (client streams, and the single envelope of a
/// server-stream request).
pub struct EnvelopeReader {
    body: Body,
    buf: Vec<u8>,
    done: bool,
}

impl EnvelopeReader {
    pub fn new(body: Body) -> Self {
        Self {
            body,
            buf: Vec::new(),
            done: false,
        }
    }

    /// The next data message; `Ok(None)` at the end of the body or at an end-of-stream
    /// envelope.
    pub async fn next<T: DeserializeOwned>(&mut self) -> Result<Option<T>, ConnectError> {
        loop {
            if self.buf.len() >= 5 {
                let flags = self.buf[0];
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]])
                    as usize;
                if len > MAX_MESSAGE_BYTES {
                    return Err(ConnectError::new(
                        Code::ResourceExhausted,
                        format!(
                            "message of {len} bytes exceeds the {MAX_MESSAGE_BYTES} byte limit"
                        ),
                    ));
                }
                if self.buf.len() >= 5 + len {
                    let payload: Vec<u8> = self.buf.drain(..5 + len).skip(5).collect();
                    if flags & FLAG_COMPRESSED != 0 {
                        return Err(ConnectError::unimplemented(
                            "compressed messages are not supported",
                        ));
                    }
                    if flags & FLAG_END_STREAM != 0 {
                        self.done = true;
                        return Ok(None);
                    }
                    return decode_json(&payload).map(Some);
                }
            }
            if self.done {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                return Err(ConnectError::invalid_argument(
                    "request body ended inside a message envelope",
                ));
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => {
                    return Err(ConnectError::new(
                        Code::Canceled,
                        format!("reading request stream: {e}"),
                    ));
                }
                None => self.done = true,
            }
        }
    }
}

impl EnvelopeReader {
    /// Reads and discards the rest of the body (at most [`MAX_MESSAGE_BYTES`]), so the
    /// connection can be reused.
    pub async fn drain(mut self) {
        let mut left = MAX_MESSAGE_BYTES;
        loop {
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    let n = frame.data_ref().map(|d| d.len()).unwrap_or(0);
                    if n > left {
                        return;
                    }
                    left -= n;
                }
                _ => return,
            }
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
    let body = async_stream_body(messages);
    let mut resp = Response::new(Body::from_stream(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(STREAM_CONTENT_TYPE),
    );
    resp
}

fn async_stream_body<T, S>(messages: S) -> impl Stream<Item = Result<Bytes, Infallible>> + Send
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
    let mut resp = Response::new(Body::from(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(STREAM_CONTENT_TYPE),
    );
    resp
}

/// `Connect-Timeout-Ms`, if present and valid.
pub fn timeout(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_millis)
}

/// `Keepalive-Ping-Interval` (seconds), default 90 s as upstream envd.
pub fn keepalive_interval(headers: &HeaderMap) -> Duration {
    headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(90))
}

#[cfg(test)]
mod tests {
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
    fn error_statuses() {
        assert_eq!(Code::NotFound.http_status(), StatusCode::NOT_FOUND);
        assert_eq!(
            Code::Unauthenticated.http_status(),
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(Code::Canceled.http_status().as_u16(), 499);
    }
}
