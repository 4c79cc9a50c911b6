//! A Connect (JSON codec) client for envd, reached through `cubicle serve`'s router
//! exactly as the E2B SDKs do it: `POST <sandbox-url>/<package>.<Service>/<Method>` with
//! `E2b-Sandbox-Id`, `E2b-Sandbox-Port: 49983` and `X-Access-Token` headers.
//!
//! Server streams are read envelope by envelope (`flags:u8, len:u32be, json`), as they
//! arrive; the end-of-stream envelope (flag `0x02`) carries `{}` or
//! `{"error":{"code","message"}}`. Unary calls send and receive plain JSON.

use std::{marker::PhantomData, time::Duration};

use base64::Engine;
use bytes::{Buf, Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::{Method, body::Incoming, header::CONTENT_TYPE};
use serde::{Serialize, de::DeserializeOwned};

use super::{
    ClientError,
    http::{self, BaseUrl, Body, Connection},
};

/// envd's port inside every sandbox.
pub const ENVD_PORT: u16 = 49983;
/// Largest envelope we accept (envd sends 32 KiB chunks; anything huge is a bug).
const MAX_ENVELOPE: usize = 16 << 20;
/// Largest unary response body we read.
const MAX_UNARY: usize = 16 << 20;
/// Unary calls give up after this long.
const UNARY_TIMEOUT: Duration = Duration::from_secs(60);

const FLAG_COMPRESSED: u8 = 0x01;
const FLAG_END_STREAM: u8 = 0x02;

/// Encodes one data envelope.
pub fn envelope(payload: &[u8]) -> Bytes {
    let mut v = Vec::with_capacity(5 + payload.len());
    v.push(0);
    v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    v.extend_from_slice(payload);
    Bytes::from(v)
}

/// One decoded envelope.
#[derive(Debug, PartialEq, Eq)]
pub struct Envelope {
    pub flags: u8,
    pub payload: Bytes,
}

/// Splits a byte stream into envelopes (they may arrive split or coalesced).
#[derive(Default)]
pub struct EnvelopeDecoder {
    buf: BytesMut,
}

impl EnvelopeDecoder {
    /// Appends received bytes.
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next complete envelope, if one is buffered.
    pub fn next(&mut self) -> Result<Option<Envelope>, ClientError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > MAX_ENVELOPE {
            return Err(ClientError::Protocol(format!(
                "Connect envelope of {len} bytes is larger than the {MAX_ENVELOPE} accepted"
            )));
        }
        if flags & FLAG_COMPRESSED != 0 {
            return Err(ClientError::Protocol(
                "compressed Connect envelope (compression was not negotiated)".into(),
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

/// Where and as whom envd calls go.
#[derive(Clone)]
pub struct EnvdClient {
    base: BaseUrl,
    sandbox_id: String,
    access_token: Option<String>,
    /// `Authorization: Basic base64("<user>:")` when set (envd's acting user).
    user: Option<String>,
}

impl EnvdClient {
    pub fn new(
        base: BaseUrl,
        sandbox_id: &str,
        access_token: Option<String>,
        user: Option<String>,
    ) -> EnvdClient {
        EnvdClient {
            base,
            sandbox_id: sandbox_id.to_string(),
            access_token,
            user,
        }
    }

    fn request(&self, path: &str, content_type: &str) -> hyper::http::request::Builder {
        let mut b = self
            .base
            .request(Method::POST, path)
            .header(CONTENT_TYPE, content_type)
            .header("connect-protocol-version", "1")
            .header("e2b-sandbox-id", &self.sandbox_id)
            .header("e2b-sandbox-port", ENVD_PORT.to_string())
            .header(
                hyper::header::USER_AGENT,
                concat!("cubicle-cli/", env!("CARGO_PKG_VERSION")),
            );
        if let Some(t) = &self.access_token {
            b = b.header("x-access-token", t);
        }
        if let Some(u) = &self.user {
            let cred = base64::engine::general_purpose::STANDARD.encode(format!("{u}:"));
            b = b.header(hyper::header::AUTHORIZATION, format!("Basic {cred}"));
        }
        b
    }

    /// Opens a connection for a run of unary calls (`unary_on`).
    pub async fn connection(&self) -> Result<Connection, ClientError> {
        Connection::open(&self.base).await
    }

    /// Starts a server-streaming call. `timeout` becomes `Connect-Timeout-Ms` (for
    /// `Process.Start` envd kills the process at that deadline); `None` sends none.
    pub async fn server_stream<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        path: &str,
        msg: &Req,
        timeout: Option<Duration>,
    ) -> Result<ServerStream<Resp>, ClientError> {
        let payload = serde_json::to_vec(msg)
            .map_err(|e| ClientError::Protocol(format!("encoding the request: {e}")))?;
        let mut b = self
            .request(path, "application/connect+json")
            .header("connect-accept-encoding", "identity")
            .header("keepalive-ping-interval", "50");
        if let Some(t) = timeout {
            b = b.header("connect-timeout-ms", t.as_millis().to_string());
        }
        let req = b
            .body(http::full(envelope(&payload)))
            .map_err(|e| ClientError::Protocol(format!("building the request: {e}")))?;
        // The response head comes as soon as the call is accepted; only the body is long.
        let resp = tokio::time::timeout(UNARY_TIMEOUT, http::send(&self.base, req))
            .await
            .map_err(|_| ClientError::Timeout(path.to_string()))??;
        let status = resp.status().as_u16();
        if status != 200 {
            let body = http::read_body(resp.into_body(), 64 << 10)
                .await
                .unwrap_or_default();
            return Err(ClientError::from_error_body(status, &body));
        }
        Ok(ServerStream {
            body: resp.into_body(),
            decoder: EnvelopeDecoder::default(),
            finished: false,
            _t: PhantomData,
        })
    }

    /// One unary call on a fresh connection.
    pub async fn unary<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        path: &str,
        msg: &Req,
    ) -> Result<Resp, ClientError> {
        let mut conn = self.connection().await?;
        self.unary_on(&mut conn, path, msg).await
    }

    /// One unary call on `conn` (reopened first if the server closed it).
    pub async fn unary_on<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        conn: &mut Connection,
        path: &str,
        msg: &Req,
    ) -> Result<Resp, ClientError> {
        if !conn.is_open() {
            *conn = self.connection().await?;
        }
        let payload = serde_json::to_vec(msg)
            .map_err(|e| ClientError::Protocol(format!("encoding the request: {e}")))?;
        let req: hyper::Request<Body> = self
            .request(path, "application/json")
            .header("connect-timeout-ms", UNARY_TIMEOUT.as_millis().to_string())
            .body(http::full(payload))
            .map_err(|e| ClientError::Protocol(format!("building the request: {e}")))?;
        let call = async {
            let resp = conn.send(req).await?;
            let status = resp.status().as_u16();
            let body = http::read_body(resp.into_body(), MAX_UNARY).await?;
            Ok::<_, ClientError>((status, body))
        };
        let (status, body) = tokio::time::timeout(UNARY_TIMEOUT, call)
            .await
            .map_err(|_| ClientError::Timeout(path.to_string()))??;
        if status != 200 {
            return Err(rpc_error_from_body(status, &body));
        }
        serde_json::from_slice(&body)
            .map_err(|e| ClientError::Protocol(format!("{path}: decoding the response: {e}")))
    }
}

/// A unary error body: Connect `{"code":"<code>","message"}` → `Rpc`; anything else
/// (envd's or the router's plain JSON) → `Status`.
fn rpc_error_from_body(status: u16, body: &[u8]) -> ClientError {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body)
        && let Some(code) = v.get("code").and_then(|c| c.as_str())
    {
        return ClientError::Rpc {
            code: code.to_string(),
            message: v
                .get("message")
                .and_then(|m| m.as_str())
                .unwrap_or_default()
                .to_string(),
        };
    }
    ClientError::from_error_body(status, body)
}

/// The response messages of a server stream, read as they arrive.
pub struct ServerStream<T> {
    body: Incoming,
    decoder: EnvelopeDecoder,
    finished: bool,
    _t: PhantomData<fn() -> T>,
}

impl<T: DeserializeOwned> ServerStream<T> {
    /// The next message; `Ok(None)` after a successful end-of-stream (or when the body
    /// ends without one, which the Python SDK tolerates too); `Err` for an error in the
    /// end-of-stream message, a broken body or an undecodable message.
    pub async fn next(&mut self) -> Result<Option<T>, ClientError> {
        loop {
            if self.finished {
                return Ok(None);
            }
            if let Some(env) = self.decoder.next()? {
                if env.flags & FLAG_END_STREAM != 0 {
                    self.finished = true;
                    return end_of_stream(&env.payload).map(|()| None);
                }
                return serde_json::from_slice(&env.payload).map(Some).map_err(|e| {
                    ClientError::Protocol(format!(
                        "undecodable stream message {}: {e}",
                        String::from_utf8_lossy(&env.payload)
                    ))
                });
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.decoder.push(&data);
                    }
                }
                Some(Err(e)) => {
                    self.finished = true;
                    return Err(ClientError::Protocol(format!("the stream broke: {e}")));
                }
                None => {
                    self.finished = true;
                    if self.decoder.pending() > 0 {
                        return Err(ClientError::Protocol(
                            "the stream ended inside a message".into(),
                        ));
                    }
                    return Ok(None);
                }
            }
        }
    }
}

/// Interprets an end-of-stream payload.
fn end_of_stream(payload: &[u8]) -> Result<(), ClientError> {
    let v: serde_json::Value = serde_json::from_slice(payload)
        .map_err(|e| ClientError::Protocol(format!("undecodable end-of-stream message: {e}")))?;
    match v.get("error") {
        None | Some(serde_json::Value::Null) => Ok(()),
        Some(err) => Err(ClientError::Rpc {
            code: err
                .get("code")
                .and_then(|c| c.as_str())
                .unwrap_or("unknown")
                .to_string(),
            message: err
                .get("message")
                .and_then(|m| m.as_str())
                .unwrap_or_default()
                .to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::testserver::{FakeServer, Reply};
    use cubicle_proto::process::{
        ProcessInput, ProcessSelector, SendInputRequest, SendInputResponse, StartRequest,
        StartResponse, process_event::Event, process_input, process_selector,
    };

    #[test]
    fn decoder_handles_split_and_coalesced_envelopes() {
        let mut all = Vec::new();
        all.extend_from_slice(&envelope(b"{\"a\":1}"));
        all.extend_from_slice(&envelope(b"{}"));
        all.push(FLAG_END_STREAM);
        all.extend_from_slice(&2u32.to_be_bytes());
        all.extend_from_slice(b"{}");
        // Byte by byte.
        let mut d = EnvelopeDecoder::default();
        let mut got = Vec::new();
        for b in &all {
            d.push(&[*b]);
            while let Some(e) = d.next().unwrap() {
                got.push(e);
            }
        }
        assert_eq!(got.len(), 3);
        assert_eq!(&got[0].payload[..], b"{\"a\":1}");
        assert_eq!(got[2].flags, FLAG_END_STREAM);
        // All at once.
        let mut d = EnvelopeDecoder::default();
        d.push(&all);
        let mut n = 0;
        while d.next().unwrap().is_some() {
            n += 1;
        }
        assert_eq!((n, d.pending()), (3, 0));
        // Oversized and compressed envelopes are refused.
        let mut d = EnvelopeDecoder::default();
        d.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert!(d.next().is_err());
        let mut d = EnvelopeDecoder::default();
        d.push(&[1, 0, 0, 0, 0]);
        assert!(d.next().is_err());
    }

    #[test]
    fn end_of_stream_errors() {
        assert!(end_of_stream(b"{}").is_ok());
        let e = end_of_stream(br#"{"error":{"code":"deadline_exceeded","message":"too slow"}}"#)
            .unwrap_err();
        assert_eq!(e.to_string(), "deadline_exceeded: too slow");
        assert!(end_of_stream(b"nope").is_err());
    }

    fn start_request() -> StartRequest {
        StartRequest {
            process: Some(cubicle_proto::process::ProcessConfig {
                cmd: "/bin/bash".into(),
                args: vec!["-l".into(), "-c".into(), "echo hi".into()],
                ..Default::default()
            }),
            stdin: Some(false),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn server_stream_against_a_fake_envd() {
        let server = FakeServer::start(|req| {
            assert_eq!(req.path, "/process.Process/Start");
            assert_eq!(req.header("content-type"), Some("application/connect+json"));
            assert_eq!(req.header("connect-protocol-version"), Some("1"));
            assert_eq!(req.header("e2b-sandbox-id"), Some("sbx1"));
            assert_eq!(req.header("e2b-sandbox-port"), Some("49983"));
            assert_eq!(req.header("x-access-token"), Some("tok"));
            assert_eq!(req.header("authorization"), Some("Basic cm9vdDo="));
            assert_eq!(req.header("connect-timeout-ms"), Some("5000"));
            // The request is exactly one envelope holding the StartRequest.
            let mut d = EnvelopeDecoder::default();
            d.push(&req.body);
            let env = d.next().unwrap().unwrap();
            assert_eq!(env.flags, 0);
            let v: serde_json::Value = serde_json::from_slice(&env.payload).unwrap();
            assert_eq!(
                v,
                serde_json::json!({"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"]},"stdin":false})
            );
            assert_eq!(d.pending(), 0);
            Reply::stream(vec![
                (0, r#"{"event":{"start":{"pid":7}}}"#),
                (0, r#"{"event":{"data":{"stdout":"aGkK"}}}"#),
                (0, r#"{"event":{"keepalive":{}}}"#),
                (0, r#"{"event":{"end":{"exitCode":3,"exited":true,"status":"exit status 3"}}}"#),
                (2, "{}"),
            ])
        })
        .await;
        let c = EnvdClient::new(
            server.base(),
            "sbx1",
            Some("tok".into()),
            Some("root".into()),
        );
        let mut s = c
            .server_stream::<_, StartResponse>(
                "/process.Process/Start",
                &start_request(),
                Some(Duration::from_secs(5)),
            )
            .await
            .unwrap();
        let mut events = Vec::new();
        while let Some(m) = s.next().await.unwrap() {
            events.push(m.event.and_then(|e| e.event).unwrap());
        }
        assert_eq!(events.len(), 4);
        assert!(matches!(events[0], Event::Start(ref s) if s.pid == 7));
        match &events[1] {
            Event::Data(d) => assert_eq!(
                d.output,
                Some(
                    cubicle_proto::process::process_event::data_event::Output::Stdout(
                        b"hi\n".to_vec()
                    )
                )
            ),
            other => panic!("{other:?}"),
        }
        assert!(matches!(events[3], Event::End(ref e) if e.exit_code == 3 && e.exited));
        assert!(s.next().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn server_stream_errors() {
        // Error in the end-of-stream message (HTTP 200).
        let server = FakeServer::start(|_| {
            Reply::stream(vec![(
                2,
                r#"{"error":{"code":"invalid_argument","message":"cwd '/nope' does not exist"}}"#,
            )])
        })
        .await;
        let c = EnvdClient::new(server.base(), "sbx1", None, None);
        let mut s = c
            .server_stream::<_, StartResponse>("/process.Process/Start", &start_request(), None)
            .await
            .unwrap();
        let e = s.next().await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid_argument: cwd '/nope' does not exist"
        );

        // The router's 502 before any stream.
        let server = FakeServer::start(|req| {
            assert_eq!(req.header("x-access-token"), None);
            assert_eq!(req.header("connect-timeout-ms"), None);
            Reply::json(
                502,
                r#"{"sandboxId":"sbx1","message":"The sandbox was not found","code":502}"#,
            )
        })
        .await;
        let c = EnvdClient::new(server.base(), "sbx1", None, None);
        let e = c
            .server_stream::<_, StartResponse>("/process.Process/Start", &start_request(), None)
            .await
            .err()
            .unwrap();
        assert_eq!(
            e.to_string(),
            "server answered 502: The sandbox was not found"
        );

        // A body cut inside an envelope.
        let server = FakeServer::start(|_| {
            Reply::raw(200, "application/connect+json", vec![0, 0, 0, 0, 9, b'{'])
        })
        .await;
        let c = EnvdClient::new(server.base(), "sbx1", None, None);
        let mut s = c
            .server_stream::<_, StartResponse>("/process.Process/Start", &start_request(), None)
            .await
            .unwrap();
        assert!(s.next().await.is_err());
    }

    #[tokio::test]
    async fn unary_calls_reuse_one_connection() {
        let server = FakeServer::start(|req| {
            assert_eq!(req.path, "/process.Process/SendInput");
            assert_eq!(req.header("content-type"), Some("application/json"));
            let v: serde_json::Value = serde_json::from_slice(&req.body).unwrap();
            if v["process"]["pid"] == 404 {
                return Reply::json(
                    404,
                    r#"{"code":"not_found","message":"process 404 not found"}"#,
                );
            }
            assert_eq!(v["input"]["pty"], "aGkK");
            Reply::json(200, "{}")
        })
        .await;
        let c = EnvdClient::new(server.base(), "sbx1", Some("t".into()), None);
        let mut conn = c.connection().await.unwrap();
        let req = |pid| SendInputRequest {
            process: Some(ProcessSelector {
                selector: Some(process_selector::Selector::Pid(pid)),
            }),
            input: Some(ProcessInput {
                input: Some(process_input::Input::Pty(b"hi\n".to_vec())),
            }),
        };
        for _ in 0..3 {
            let _: SendInputResponse = c
                .unary_on(&mut conn, "/process.Process/SendInput", &req(5))
                .await
                .unwrap();
        }
        let e = c
            .unary_on::<_, SendInputResponse>(&mut conn, "/process.Process/SendInput", &req(404))
            .await
            .unwrap_err();
        assert!(
            matches!(e, ClientError::Rpc { ref code, .. } if code == "not_found"),
            "{e}"
        );
        assert_eq!(
            server.connections(),
            1,
            "unary calls opened more than one connection"
        );
    }
}
