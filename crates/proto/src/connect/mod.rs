//! The Connect protocol (JSON codec only) as envd and the E2B SDKs speak it: the one
//! implementation of its framing, used by envd (the server half, `server` feature) and
//! by every client of envd — the node, the command line and the bench (the client half,
//! `client` feature).
//!
//! * Unary calls: the request body is one JSON message (`application/json`); the answer
//!   is `200 application/json` with a JSON message, or an error status with
//!   `{"code":"<connect code>","message":"…"}`.
//! * Streams (server- and client-streaming): bodies are sequences of envelopes — one flag
//!   byte (`0x00` data, `0x02` end-of-stream, `0x01` compressed, which we never
//!   negotiate), a big-endian `u32` length, the JSON payload. Stream responses use
//!   `Content-Type: application/connect+json` with no parameters (the Python SDK rejects
//!   any), are flushed per message, and always end with an end-of-stream envelope (`{}` or
//!   `{"error":{…}}`) — the JS SDK fails without it.
//!
//! See `shared/spec/e2b-compat.md` §3.2–3.3. This file holds what both halves share:
//! codes and errors, the envelope encoder and decoder, the end-of-stream message.

use bytes::{Buf, Bytes, BytesMut};
use serde::de::DeserializeOwned;

#[cfg(any(feature = "client", feature = "server"))]
mod body;
#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "server")]
pub mod server;

/// Content type of every Connect stream request and response, exactly (no parameters).
pub const STREAM_CONTENT_TYPE: &str = "application/connect+json";
/// Content type of unary requests and answers.
pub const UNARY_CONTENT_TYPE: &str = "application/json";
/// Largest unary request or single stream envelope envd accepts.
pub const MAX_MESSAGE_BYTES: usize = 32 << 20;
/// Header: the call's deadline in milliseconds (for `Process.Start`, the process's lifetime).
pub const TIMEOUT_HEADER: &str = "connect-timeout-ms";
/// Header: seconds between keepalive messages on a server stream (envd's extension).
pub const KEEPALIVE_HEADER: &str = "keepalive-ping-interval";
/// Header: the Connect protocol version (`1`).
pub const PROTOCOL_VERSION_HEADER: &str = "connect-protocol-version";

/// Envelope flag: the payload is compressed (never negotiated here; refused).
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: the end-of-stream message.
pub const FLAG_END_STREAM: u8 = 0x02;

/// Connect error codes (<https://connectrpc.com/docs/protocol#error-codes>).
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

const CODES: [Code; 16] = [
    Code::Canceled,
    Code::Unknown,
    Code::InvalidArgument,
    Code::DeadlineExceeded,
    Code::NotFound,
    Code::AlreadyExists,
    Code::PermissionDenied,
    Code::ResourceExhausted,
    Code::FailedPrecondition,
    Code::Aborted,
    Code::OutOfRange,
    Code::Unimplemented,
    Code::Internal,
    Code::Unavailable,
    Code::DataLoss,
    Code::Unauthenticated,
];

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

    /// The code with wire name `name`; an unknown name is [`Code::Unknown`].
    pub fn from_name(name: &str) -> Code {
        CODES
            .into_iter()
            .find(|c| c.as_str() == name)
            .unwrap_or(Code::Unknown)
    }

    /// HTTP status used for this code on unary calls.
    pub fn http_status(self) -> u16 {
        match self {
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => 400,
            Code::Unauthenticated => 401,
            Code::PermissionDenied => 403,
            Code::NotFound => 404,
            Code::AlreadyExists | Code::Aborted => 409,
            Code::ResourceExhausted => 429,
            Code::Canceled => 499,
            Code::Unimplemented => 501,
            Code::Unavailable => 503,
            Code::DeadlineExceeded => 504,
            Code::Unknown | Code::Internal | Code::DataLoss => 500,
        }
    }
}

/// A Connect error: what a server answers, and what a client reads back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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

    /// Maps an I/O error on `what` to the code the SDKs expect.
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

    /// The error's JSON form (a unary error body, or `error` of an end-of-stream message).
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({ "code": self.code.as_str(), "message": self.message })
    }

    /// The error in a JSON value of that form, if it is one (`{"code": "<name>", …}`).
    pub fn from_json(v: &serde_json::Value) -> Option<ConnectError> {
        let code = v.get("code")?.as_str()?;
        let message = v.get("message").and_then(|m| m.as_str()).unwrap_or("");
        Some(ConnectError::new(Code::from_name(code), message))
    }
}

/// Parses a JSON message, mapping failures to `invalid_argument`. An empty body is the
/// empty message.
pub fn decode_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ConnectError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return serde_json::from_slice(b"{}")
            .map_err(|e| ConnectError::invalid_argument(format!("invalid request: {e}")));
    }
    serde_json::from_slice(bytes)
        .map_err(|e| ConnectError::invalid_argument(format!("invalid request message: {e}")))
}

/// Encodes one envelope.
pub fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(flags);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    Bytes::from(out)
}

/// The one data envelope of a server-stream request carrying `msg`.
pub fn request_envelope<T: serde::Serialize>(msg: &T) -> Result<Bytes, serde_json::Error> {
    Ok(envelope(0, &serde_json::to_vec(msg)?))
}

/// The Connect error in a unary error body (`{"code":"<name>","message":…}`), if it is
/// one; the REST and router error bodies (`{"code": <int>, …}`) are not.
pub fn unary_error(body: &[u8]) -> Option<ConnectError> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    ConnectError::from_json(&v)
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

/// How a stream ended, from its end-of-stream payload: `{}` (or no `error`) is `Ok`,
/// `{"error":{"code","message"}}` the error. `Err(None)`: the payload is not JSON.
pub fn parse_end_of_stream(payload: &[u8]) -> Result<(), Option<ConnectError>> {
    let v: serde_json::Value = serde_json::from_slice(payload).map_err(|_| None)?;
    match v.get("error") {
        None | Some(serde_json::Value::Null) => Ok(()),
        Some(err) => Err(Some(
            ConnectError::from_json(err).unwrap_or_else(|| ConnectError::new(Code::Unknown, "")),
        )),
    }
}

/// One decoded envelope.
#[derive(Debug, PartialEq, Eq)]
pub struct Envelope {
    pub flags: u8,
    pub payload: Bytes,
}

impl Envelope {
    /// Whether this is the end-of-stream message.
    pub fn is_end_of_stream(&self) -> bool {
        self.flags & FLAG_END_STREAM != 0
    }
}

/// Splits a byte stream into envelopes (they may arrive split or coalesced).
pub struct EnvelopeDecoder {
    buf: BytesMut,
    max: usize,
}

impl EnvelopeDecoder {
    /// A decoder that refuses envelopes larger than `max` bytes.
    pub fn new(max: usize) -> Self {
        EnvelopeDecoder {
            buf: BytesMut::new(),
            max,
        }
    }

    /// Appends received bytes.
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next complete envelope, if one is buffered. Errors: an envelope larger than
    /// the limit (`resource_exhausted`), a compressed one (`unimplemented`).
    pub fn next_envelope(&mut self) -> Result<Option<Envelope>, ConnectError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > self.max {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!("message of {len} bytes exceeds the {} byte limit", self.max),
            ));
        }
        if flags & FLAG_COMPRESSED != 0 {
            return Err(ConnectError::unimplemented(
                "compressed messages are not supported (compression was not negotiated)",
            ));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        self.buf.advance(5);
        let payload = self.buf.split_to(len).freeze();
        Ok(Some(Envelope { flags, payload }))
    }

    /// Bytes left over that do not form a whole envelope.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoder_handles_split_and_coalesced_envelopes() {
        let mut all = Vec::new();
        all.extend_from_slice(&envelope(0, b"{\"a\":1}"));
        all.extend_from_slice(&envelope(0, b"{}"));
        all.extend_from_slice(&end_stream_envelope(Ok(())));
        // Byte by byte.
        let mut d = EnvelopeDecoder::new(1 << 20);
        let mut got = Vec::new();
        for b in &all {
            d.push(&[*b]);
            while let Some(e) = d.next_envelope().unwrap() {
                got.push(e);
            }
        }
        assert_eq!(got.len(), 3);
        assert_eq!(&got[0].payload[..], b"{\"a\":1}");
        assert!(!got[0].is_end_of_stream() && got[2].is_end_of_stream());
        // All at once.
        let mut d = EnvelopeDecoder::new(1 << 20);
        d.push(&all);
        let mut n = 0;
        while d.next_envelope().unwrap().is_some() {
            n += 1;
        }
        assert_eq!((n, d.pending()), (3, 0));
        // Oversized and compressed envelopes are refused.
        let mut d = EnvelopeDecoder::new(1 << 20);
        d.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(d.next_envelope().unwrap_err().code, Code::ResourceExhausted);
        let mut d = EnvelopeDecoder::new(1 << 20);
        d.push(&[1, 0, 0, 0, 0]);
        assert_eq!(d.next_envelope().unwrap_err().code, Code::Unimplemented);
    }

    #[test]
    fn end_of_stream_round_trips() {
        assert_eq!(parse_end_of_stream(b"{}"), Ok(()));
        let err = ConnectError::new(Code::DeadlineExceeded, "too slow");
        let eos = end_stream_envelope(Err(&err));
        assert_eq!(eos[0], FLAG_END_STREAM);
        assert_eq!(parse_end_of_stream(&eos[5..]), Err(Some(err)));
        assert_eq!(parse_end_of_stream(b"nope"), Err(None));
        assert_eq!(
            unary_error(br#"{"code":"not_found","message":"no"}"#),
            Some(ConnectError::not_found("no"))
        );
        assert_eq!(unary_error(br#"{"code":404,"message":"no"}"#), None);
        assert_eq!(
            ConnectError::new(Code::DeadlineExceeded, "too slow").to_string(),
            "deadline_exceeded: too slow"
        );
    }

    #[test]
    fn codes_by_name_and_status() {
        for c in CODES {
            assert_eq!(Code::from_name(c.as_str()), c);
        }
        assert_eq!(Code::from_name("bogus"), Code::Unknown);
        assert_eq!(Code::NotFound.http_status(), 404);
        assert_eq!(Code::Unauthenticated.http_status(), 401);
        assert_eq!(Code::Canceled.http_status(), 499);
    }
}
