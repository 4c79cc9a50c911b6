//! Test-only in-process HTTP/1.1 server on 127.0.0.1:0 that plays `cubicle serve` (REST)
//! or envd behind the router (Connect): each request is read whole and handed to a
//! closure that returns the reply (a full body, or a channel whose chunks are sent as
//! they come, for streams that stay open).

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::{Response, body::Frame, header::HeaderMap, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::sync::mpsc;

use cubicle_proto::connect::envelope;

use super::http::BaseUrl;

/// A request as the handler sees it.
pub struct FakeRequest {
    pub method: String,
    /// Path and query.
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl FakeRequest {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// What the handler answers.
pub struct Reply {
    status: u16,
    content_type: String,
    headers: Vec<(String, String)>,
    body: ReplyBody,
}

enum ReplyBody {
    Full(Vec<u8>),
    Channel(mpsc::UnboundedReceiver<Bytes>),
}

impl Reply {
    pub fn json(status: u16, body: &str) -> Reply {
        Reply::raw(status, "application/json", body.as_bytes().to_vec())
    }
    pub fn raw(status: u16, content_type: &str, body: Vec<u8>) -> Reply {
        Reply {
            status,
            content_type: content_type.into(),
            headers: Vec::new(),
            body: ReplyBody::Full(body),
        }
    }
    /// A complete Connect stream: `(flags, json)` envelopes.
    pub fn stream(envs: Vec<(u8, &str)>) -> Reply {
        let mut body = Vec::new();
        for (flags, json) in envs {
            body.extend_from_slice(&envelope(flags, json.as_bytes()));
        }
        Reply::raw(200, "application/connect+json", body)
    }
    /// A Connect stream fed through a channel (send already-encoded envelopes; drop the
    /// sender to end the body).
    pub fn channel(rx: mpsc::UnboundedReceiver<Bytes>) -> Reply {
        Reply {
            status: 200,
            content_type: "application/connect+json".into(),
            headers: Vec::new(),
            body: ReplyBody::Channel(rx),
        }
    }
    pub fn header(mut self, name: &str, value: &str) -> Reply {
        self.headers.push((name.into(), value.into()));
        self
    }
}

/// Envelope bytes with `flags`.
pub fn env_bytes(flags: u8, json: &str) -> Bytes {
    envelope(flags, json.as_bytes())
}

pub struct FakeServer {
    addr: std::net::SocketAddr,
    connections: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeServer {
    pub async fn start<F>(handler: F) -> FakeServer
    where
        F: Fn(FakeRequest) -> Reply + Send + Sync + 'static,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let handler = Arc::new(handler);
        let connections = Arc::new(AtomicUsize::new(0));
        let counter = connections.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                counter.fetch_add(1, Ordering::SeqCst);
                let handler = handler.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                        let handler = handler.clone();
                        async move {
                            let (parts, body) = req.into_parts();
                            let body = body
                                .collect()
                                .await
                                .map(|c| c.to_bytes())
                                .unwrap_or_default();
                            let reply = handler(FakeRequest {
                                method: parts.method.to_string(),
                                path: parts
                                    .uri
                                    .path_and_query()
                                    .map(|p| p.as_str().to_string())
                                    .unwrap_or_default(),
                                headers: parts.headers,
                                body,
                            });
                            let body: BoxBody<Bytes, Infallible> = match reply.body {
                                ReplyBody::Full(b) => Full::new(Bytes::from(b)).boxed(),
                                ReplyBody::Channel(rx) => {
                                    let s = tokio_stream_from(rx)
                                        .map(|b| Ok::<_, Infallible>(Frame::data(b)));
                                    BodyExt::boxed(StreamBody::new(s))
                                }
                            };
                            let mut resp = Response::builder()
                                .status(reply.status)
                                .header("content-type", reply.content_type);
                            for (k, v) in reply.headers {
                                resp = resp.header(k, v);
                            }
                            Ok::<_, Infallible>(resp.body(body).unwrap())
                        }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        FakeServer {
            addr,
            connections,
            task,
        }
    }

    pub fn base(&self) -> BaseUrl {
        BaseUrl::parse(&format!("http://{}", self.addr)).unwrap()
    }

    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn tokio_stream_from(
    mut rx: mpsc::UnboundedReceiver<Bytes>,
) -> impl futures_util::Stream<Item = Bytes> + Send {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}
