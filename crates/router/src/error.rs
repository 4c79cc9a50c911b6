//! The router's one error type and the one place that turns errors into HTTP answers.
//!
//! Proxy errors about the sandbox itself keep upstream E2B's exact bodies, because the
//! Python SDK classifies them by substring (`"was not found"` → sandbox not running,
//! `"port is not open"` → unreachable):
//! `{"sandboxId":"…","message":"The sandbox was not found","code":502}` and
//! `{"sandboxId":"…","message":"The sandbox is running but port is not open","port":N,"code":502}`.
//! Everything else uses the project's `{"code":N,"message":"…"}` shape. All of them carry
//! `Should-Retry: false`: none of these answers improves by blindly repeating the request
//! (the SDKs do not retry data-plane calls today; this keeps it that way).

use axum::{
    body::Body,
    http::{HeaderValue, StatusCode, header},
    response::Response,
};

/// An error and all its sources as one line (`a: b: c`): hyper's client errors say only
/// "client error (Connect)" at the top, the reason is further down the chain.
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut detail = err.to_string();
    let mut src = err.source();
    while let Some(s) = src {
        detail.push_str(": ");
        detail.push_str(&s.to_string());
        src = s.source();
    }
    detail
}

/// Everything that can go wrong between the client and a sandbox port.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// A routing header is missing or malformed.
    #[error("{0}")]
    BadRequest(String),
    /// The sandbox is unknown, killed or not running.
    #[error("sandbox {id:?} was not found")]
    SandboxNotFound { id: String },
    /// The sandbox runs, but nothing accepts connections on that port.
    #[error("sandbox {id} is running but port {port} is not open: {detail}")]
    PortNotOpen {
        id: String,
        port: u16,
        detail: String,
    },
    /// The connection to the sandbox failed after it was established.
    #[error("sandbox {id} port {port}: {detail}")]
    Upstream {
        id: String,
        port: u16,
        detail: String,
    },
    /// A route that only the node may use (envd's `/init`, …).
    #[error("{0}")]
    Forbidden(String),
    /// The traffic token is missing, or no sandbox matches a presigned URL.
    #[error("{0}")]
    Unauthorized(String),
    /// A bug or an impossible state on our side.
    #[error("{0}")]
    Internal(String),
    /// A cluster's API replica could not reach the node that runs the sandbox.
    #[error(
        "node {node} (which runs sandbox {id}) is unreachable: {detail}; check that `cubicle node` runs there and that this replica can reach it"
    )]
    NodeUnreachable {
        node: String,
        id: String,
        detail: String,
    },
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned())
}

impl RouterError {
    /// The HTTP status of this error.
    pub fn status(&self) -> StatusCode {
        match self {
            RouterError::BadRequest(_) => StatusCode::BAD_REQUEST,
            RouterError::SandboxNotFound { .. }
            | RouterError::PortNotOpen { .. }
            | RouterError::Upstream { .. }
            | RouterError::NodeUnreachable { .. } => StatusCode::BAD_GATEWAY,
            RouterError::Forbidden(_) => StatusCode::FORBIDDEN,
            RouterError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            RouterError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The JSON body (field order as upstream E2B's proxy writes it).
    pub fn body(&self) -> String {
        match self {
            RouterError::SandboxNotFound { id } => format!(
                r#"{{"sandboxId":{},"message":"The sandbox was not found","code":502}}"#,
                json_string(id)
            ),
            RouterError::PortNotOpen { id, port, .. } => format!(
                r#"{{"sandboxId":{},"message":"The sandbox is running but port is not open","port":{port},"code":502}}"#,
                json_string(id)
            ),
            RouterError::Upstream { id, port, detail } => format!(
                r#"{{"sandboxId":{},"message":{},"port":{port},"code":502}}"#,
                json_string(id),
                json_string(&format!("The connection to the sandbox failed: {detail}"))
            ),
            other => format!(
                r#"{{"code":{},"message":{}}}"#,
                other.status().as_u16(),
                json_string(&other.to_string())
            ),
        }
    }

    /// The complete HTTP answer.
    pub fn into_response(self) -> Response {
        match &self {
            RouterError::PortNotOpen { .. }
            | RouterError::Upstream { .. }
            | RouterError::NodeUnreachable { .. }
            | RouterError::Internal(_) => {
                tracing::debug!(error = %self, "data plane error")
            }
            _ => tracing::trace!(error = %self, "data plane refusal"),
        }
        let mut resp = Response::new(Body::from(self.body()));
        *resp.status_mut() = self.status();
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.insert("should-retry", HeaderValue::from_static("false"));
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_upstream_bodies() {
        assert_eq!(
            RouterError::SandboxNotFound { id: "abc".into() }.body(),
            r#"{"sandboxId":"abc","message":"The sandbox was not found","code":502}"#
        );
        assert_eq!(
            RouterError::PortNotOpen {
                id: "abc".into(),
                port: 8000,
                detail: "x".into()
            }
            .body(),
            r#"{"sandboxId":"abc","message":"The sandbox is running but port is not open","port":8000,"code":502}"#
        );
        let v: serde_json::Value =
            serde_json::from_str(&RouterError::BadRequest("a \"b\"".into()).body()).unwrap();
        assert_eq!(v["code"], 400);
        assert_eq!(v["message"], "a \"b\"");
    }
}
