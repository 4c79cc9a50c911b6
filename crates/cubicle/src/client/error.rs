//! The client's error type: what went wrong talking to `cubicle serve` (REST) or to a
//! sandbox's envd through the router (Connect), phrased for the person at the terminal.

/// Errors of the `cubicle sandbox …` client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Bad configuration (URL, missing API key, bad argument).
    #[error("{0}")]
    Config(String),
    /// The TCP connection could not be established.
    #[error(
        "cannot reach {url}: {detail} (is `cubicle serve` running there? set --api-url / E2B_API_URL)"
    )]
    Unreachable { url: String, detail: String },
    /// The HTTP exchange failed (connection reset, malformed response…).
    #[error("HTTP request to {url} failed: {detail}")]
    Http { url: String, detail: String },
    /// The server (REST API, router or envd) answered with an error status.
    #[error("server answered {status}: {message}")]
    Status { status: u16, message: String },
    /// A Connect RPC ended with an error (`code` is the Connect code, e.g. `not_found`).
    #[error("{code}: {message}")]
    Rpc { code: String, message: String },
    /// The response did not follow the protocol.
    #[error("unexpected response: {0}")]
    Protocol(String),
    /// No answer in time.
    #[error("{0} timed out")]
    Timeout(String),
}

/// An error and its sources as one line (`a: b: c`), for messages that carry the detail.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

impl ClientError {
    /// The HTTP status of a `Status` error.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Builds a `Status` error from an error response body: E2B's `{"code":N,"message":…}`,
    /// Connect's `{"code":"not_found","message":…}`, the router's
    /// `{"sandboxId":…,"message":…,"code":502}`, or plain text.
    pub fn from_error_body(status: u16, body: &[u8]) -> ClientError {
        let message = match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(v) => {
                let msg = v
                    .get("message")
                    .and_then(|m| m.as_str())
                    .map(str::to_string);
                let code = v.get("code").and_then(|c| c.as_str()).map(str::to_string);
                match (msg, code) {
                    (Some(m), Some(c)) if !m.is_empty() => format!("{m} ({c})"),
                    (Some(m), _) if !m.is_empty() => m,
                    (_, Some(c)) => c,
                    _ => v.to_string(),
                }
            }
            Err(_) => {
                let text = String::from_utf8_lossy(body);
                let text = text.trim();
                if text.is_empty() {
                    hyper::StatusCode::from_u16(status)
                        .ok()
                        .and_then(|s| s.canonical_reason())
                        .unwrap_or("no details")
                        .to_string()
                } else {
                    text.chars().take(500).collect()
                }
            }
        };
        ClientError::Status { status, message }
    }
}

#[cfg(test)]
mod tests {
    use super::ClientError;

    #[test]
    fn error_bodies_become_messages() {
        let e =
            ClientError::from_error_body(404, br#"{"code":404,"message":"sandbox abc not found"}"#);
        assert_eq!(e.to_string(), "server answered 404: sandbox abc not found");
        assert_eq!(e.status(), Some(404));
        let e =
            ClientError::from_error_body(404, br#"{"code":"not_found","message":"no process"}"#);
        assert_eq!(e.to_string(), "server answered 404: no process (not_found)");
        let e = ClientError::from_error_body(
            502,
            br#"{"sandboxId":"x","message":"The sandbox was not found","code":502}"#,
        );
        assert_eq!(
            e.to_string(),
            "server answered 502: The sandbox was not found"
        );
        let e = ClientError::from_error_body(500, b"");
        assert_eq!(e.to_string(), "server answered 500: Internal Server Error");
        let e = ClientError::from_error_body(400, b"bad thing\n");
        assert_eq!(e.to_string(), "server answered 400: bad thing");
    }
}
