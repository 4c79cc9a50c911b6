//! A Connect (JSON codec) client for envd, reached through `cubicle serve`'s router
//! exactly as the E2B SDKs do it: `POST <sandbox-url>/<package>.<Service>/<Method>` with
//! `E2b-Sandbox-Id`, `E2b-Sandbox-Port: 49983` and `X-Access-Token` headers.
//!
//! The framing (envelopes, end-of-stream, error bodies) is `cubicle_proto::connect`'s;
//! this file builds the requests and turns the codec's errors into [`ClientError`]s.

use std::time::Duration;

use base64::Engine;
use cubicle_proto::ENVD_PORT;
use cubicle_proto::connect::{
    self as codec, PROTOCOL_VERSION_HEADER, STREAM_CONTENT_TYPE, TIMEOUT_HEADER,
    UNARY_CONTENT_TYPE, client::StreamError,
};
use hyper::{Method, body::Incoming, header::CONTENT_TYPE};
use serde::{Serialize, de::DeserializeOwned};

use super::{
    ClientError,
    http::{self, BaseUrl, Body, Connection},
};

/// Largest envelope we accept (envd sends 32 KiB chunks; anything huge is a bug).
const MAX_ENVELOPE: usize = 16 << 20;
/// Largest unary response body we read.
const MAX_UNARY: usize = 16 << 20;
/// Unary calls give up after this long.
const UNARY_TIMEOUT: Duration = Duration::from_secs(60);

impl From<StreamError> for ClientError {
    fn from(e: StreamError) -> ClientError {
        match e {
            StreamError::Rpc(e) => ClientError::Rpc {
                code: e.code.as_str().to_string(),
                message: e.message,
            },
            StreamError::Protocol(m) => ClientError::Protocol(m),
        }
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
        self.http_request(Method::POST, path)
            .header(CONTENT_TYPE, content_type)
            .header(PROTOCOL_VERSION_HEADER, "1")
    }

    /// A request to envd's HTTP API (`/files…`) through the router, with the routing,
    /// token and user headers (`cubicle sandbox cp`).
    pub fn http_request(&self, method: Method, path: &str) -> hyper::http::request::Builder {
        let mut b = self
            .base
            .request(method, path)
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

    /// The user calls act as (`None`: the sandbox's default user).
    pub fn user(&self) -> Option<&str> {
        self.user.as_deref()
    }

    /// The data-plane URL calls go to.
    pub fn base(&self) -> &BaseUrl {
        &self.base
    }

    /// Opens a connection for a run of unary calls (`unary_on`).
    pub async fn connection(&self) -> Result<Connection, ClientError> {
        Connection::open(&self.base).await
    }

    /// Starts a server-streaming call on a fresh connection. `timeout` becomes
    /// `Connect-Timeout-Ms` (for `Process.Start` envd kills the process at that
    /// deadline); `None` sends none.
    pub async fn server_stream<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        path: &str,
        msg: &Req,
        timeout: Option<Duration>,
    ) -> Result<ServerStream<Resp>, ClientError> {
        let mut conn = Connection::lazy(&self.base);
        self.server_stream_on(&mut conn, path, msg, timeout).await
    }

    /// [`EnvdClient::server_stream`] on `conn` (which carries nothing else until the
    /// stream has been read to its end).
    pub async fn server_stream_on<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        conn: &mut Connection,
        path: &str,
        msg: &Req,
        timeout: Option<Duration>,
    ) -> Result<ServerStream<Resp>, ClientError> {
        let body = codec::request_envelope(msg)
            .map_err(|e| ClientError::Protocol(format!("encoding the request: {e}")))?;
        let mut b = self
            .request(path, STREAM_CONTENT_TYPE)
            .header("connect-accept-encoding", "identity")
            .header("keepalive-ping-interval", "50");
        if let Some(t) = timeout {
            b = b.header(TIMEOUT_HEADER, t.as_millis().to_string());
        }
        let req = b
            .body(http::full(body))
            .map_err(|e| ClientError::Protocol(format!("building the request: {e}")))?;
        // The response head comes as soon as the call is accepted; only the body is long.
        let resp = tokio::time::timeout(UNARY_TIMEOUT, conn.send(req))
            .await
            .map_err(|_| ClientError::Timeout(path.to_string()))??;
        let status = resp.status().as_u16();
        if status != 200 {
            let body = http::read_body(resp.into_body(), 64 << 10)
                .await
                .unwrap_or_default();
            return Err(ClientError::from_error_body(status, &body));
        }
        Ok(ServerStream(codec::client::ServerStream::new(
            resp.into_body(),
            MAX_ENVELOPE,
        )))
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

    /// One unary call on `conn` (reopened if the server closed it).
    pub async fn unary_on<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        conn: &mut Connection,
        path: &str,
        msg: &Req,
    ) -> Result<Resp, ClientError> {
        let payload = serde_json::to_vec(msg)
            .map_err(|e| ClientError::Protocol(format!("encoding the request: {e}")))?;
        let req: hyper::Request<Body> = self
            .request(path, UNARY_CONTENT_TYPE)
            .header(TIMEOUT_HEADER, UNARY_TIMEOUT.as_millis().to_string())
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

impl EnvdClient {
    /// envd's `GET /health` through the router on `conn` (no access token: envd answers
    /// it without one).
    pub async fn health_on(&self, conn: &mut Connection) -> Result<(), ClientError> {
        let req = self
            .base
            .request(Method::GET, "/health")
            .header("e2b-sandbox-id", &self.sandbox_id)
            .header("e2b-sandbox-port", ENVD_PORT.to_string())
            .body(http::full(bytes::Bytes::new()))
            .map_err(|e| ClientError::Protocol(format!("building the request: {e}")))?;
        let resp = tokio::time::timeout(UNARY_TIMEOUT, conn.send(req))
            .await
            .map_err(|_| ClientError::Timeout("GET /health".into()))??;
        let status = resp.status().as_u16();
        let body = http::read_body(resp.into_body(), 64 << 10).await?;
        if !(200..300).contains(&status) {
            return Err(ClientError::from_error_body(status, &body));
        }
        Ok(())
    }
}

/// A unary error body: Connect `{"code":"<code>","message"}` → `Rpc`; anything else
/// (envd's or the router's plain JSON) → `Status`.
fn rpc_error_from_body(status: u16, body: &[u8]) -> ClientError {
    match codec::unary_error(body) {
        Some(e) => ClientError::Rpc {
            code: e.code.as_str().to_string(),
            message: e.message,
        },
        None => ClientError::from_error_body(status, body),
    }
}

/// The response messages of a server stream, read as they arrive.
pub struct ServerStream<T>(codec::client::ServerStream<Incoming, T>);

impl<T: DeserializeOwned> ServerStream<T> {
    /// The next message; `Ok(None)` after a successful end-of-stream (or when the body
    /// ends without one, which the Python SDK tolerates too); `Err` for an error in the
    /// end-of-stream message, a broken body or an undecodable message.
    pub async fn next(&mut self) -> Result<Option<T>, ClientError> {
        Ok(self.0.next().await?)
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

    use cubicle_proto::connect::EnvelopeDecoder;

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
            let mut d = EnvelopeDecoder::new(1 << 20);
            d.push(&req.body);
            let env = d.next_envelope().unwrap().unwrap();
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

    /// A stream read to its end-of-stream leaves its connection to the next call, as an
    /// SDK's connection pool does: a chunked body's last chunk comes after that message.
    #[tokio::test]
    async fn server_streams_read_to_their_end_keep_the_connection() {
        use crate::client::testserver::env_bytes;
        let server = FakeServer::start(|_req| {
            // Chunked: each envelope its own chunk, the body's end a chunk of its own.
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            tx.send(env_bytes(0, r#"{"event":{"start":{"pid":7}}}"#))
                .unwrap();
            tx.send(env_bytes(0, r#"{"event":{"end":{"exited":true}}}"#))
                .unwrap();
            tx.send(env_bytes(2, "{}")).unwrap();
            // The body's end comes a moment later (through the router, it is often a
            // packet of its own).
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                drop(tx);
            });
            Reply::channel(rx)
        })
        .await;
        let c = EnvdClient::new(server.base(), "sbx1", None, None);
        let mut conn = c.connection().await.unwrap();
        for _ in 0..3 {
            let mut s = c
                .server_stream_on::<_, StartResponse>(
                    &mut conn,
                    "/process.Process/Start",
                    &start_request(),
                    None,
                )
                .await
                .unwrap();
            let mut n = 0;
            while s.next().await.unwrap().is_some() {
                n += 1;
            }
            assert_eq!(n, 2);
        }
        assert_eq!(
            server.connections(),
            1,
            "each stream read to its end-of-stream cost a new connection"
        );
    }
}
