//! The interpreter's client for envd's `GET /envs`, which is both how it learns the
//! sandbox's env vars (envd's from its start, or set by the node's `/init` at create or
//! claim time, possibly after the interpreter started) and how it checks a caller's
//! access token: envd answers 401 to a wrong one, as E2B's code-interpreter server
//! relies on.
//!
//! envd is reached on its Unix socket (Cubicle's node talks to it there; the interpreter
//! runs as root, which may open it) or, failing that, on TCP (E2B's port 49983).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// What `GET /envs` said.
#[derive(Debug, Clone, PartialEq)]
pub enum Envs {
    /// 200: the sandbox-global env vars.
    Vars(BTreeMap<String, String>),
    /// 401: the token is wrong (or missing while envd has one).
    Unauthorized,
    /// envd is not reachable or answered something else.
    Unreachable(String),
}

/// Where envd listens.
#[derive(Debug, Clone)]
pub struct Envd {
    pub socket: Option<PathBuf>,
    pub tcp: Option<String>,
}

impl Envd {
    /// `GET /envs` with `token` (if any) in `X-Access-Token`.
    pub async fn envs(&self, token: Option<&str>) -> Envs {
        let mut req = String::from("GET /envs HTTP/1.0\r\nHost: localhost\r\n");
        if let Some(t) = token {
            if t.contains(['\r', '\n']) {
                return Envs::Unauthorized;
            }
            req.push_str(&format!("X-Access-Token: {t}\r\n"));
        }
        req.push_str("\r\n");
        let mut why = String::from("no envd address");
        if let Some(p) = self.socket.as_ref().filter(|p| p.exists()) {
            match tokio::net::UnixStream::connect(p).await {
                Ok(s) => return exchange(s, &req).await,
                Err(e) => why = format!("{}: {e}", p.display()),
            }
        }
        if let Some(addr) = &self.tcp {
            match tokio::net::TcpStream::connect(addr.as_str()).await {
                Ok(s) => return exchange(s, &req).await,
                Err(e) => why = format!("{addr}: {e}"),
            }
        }
        Envs::Unreachable(why)
    }
}

async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, req: &str) -> Envs {
    let fut = async {
        s.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        Ok::<_, std::io::Error>(buf)
    };
    let buf = match tokio::time::timeout(Duration::from_secs(5), fut).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return Envs::Unreachable(format!("envd /envs: {e}")),
        Err(_) => return Envs::Unreachable("envd /envs: no answer within 5 s".into()),
    };
    parse(&buf)
}

/// Parses an HTTP/1.x response to `GET /envs`.
fn parse(buf: &[u8]) -> Envs {
    let text = String::from_utf8_lossy(buf);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return Envs::Unreachable("envd /envs: truncated answer".into());
    };
    let status = head.split_whitespace().nth(1).unwrap_or("");
    match status {
        "200" => match serde_json::from_str(body) {
            Ok(m) => Envs::Vars(m),
            Err(e) => Envs::Unreachable(format!("envd /envs: bad JSON: {e}")),
        },
        "401" | "403" => Envs::Unauthorized,
        other => Envs::Unreachable(format!("envd /envs answered {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_answers() {
        assert_eq!(
            parse(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{\"A\":\"1\"}"),
            Envs::Vars(BTreeMap::from([("A".to_string(), "1".to_string())]))
        );
        assert_eq!(
            parse(b"HTTP/1.1 401 Unauthorized\r\n\r\n{\"code\":401}"),
            Envs::Unauthorized
        );
        assert!(matches!(
            parse(b"HTTP/1.1 500 x\r\n\r\n"),
            Envs::Unreachable(_)
        ));
        assert!(matches!(parse(b"garbage"), Envs::Unreachable(_)));
    }
}
