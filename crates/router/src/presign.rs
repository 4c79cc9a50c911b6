//! Presigned `/files` URLs opened without routing headers (curl, a browser).
//!
//! The SDKs' `download_url()`/`upload_url()` with `E2B_SANDBOX_URL` produce
//! `<sandbox_url>/files?path=…[&username=…]&signature=…[&signature_expiration=…]` with no
//! sandbox id. The signature binds the sandbox's envd token (e2b 2.63.0
//! `e2b/sandbox/signature.py`, same as envd's check):
//! ```text
//! raw = path ":" op ":" user ":" token [":" expiration]     op = read (GET) | write (POST)
//! sig = "v1_" + base64_std_no_padding(sha256(raw))
//! ```
//! so the router finds the one running sandbox whose token produces the given signature.
//! envd then re-checks the signature and its expiry itself.

use axum::http::Method;
use base64::Engine;
use sha2::{Digest, Sha256};

use crate::SandboxTarget;

/// The query fields that take part in the signature (first occurrence of each, decoded
/// like envd's query extractor: `+` is a space).
#[derive(Debug, Default)]
pub struct SignedQuery {
    pub path: String,
    pub username: String,
    pub signature: String,
    pub expiration: Option<String>,
}

impl SignedQuery {
    pub fn parse(query: &str) -> Self {
        let mut q = SignedQuery::default();
        let (mut path, mut user, mut sig) = (None, None, None);
        for (k, v) in form_urlencoded::parse(query.as_bytes()) {
            match &*k {
                "path" if path.is_none() => path = Some(v.into_owned()),
                "username" if user.is_none() => user = Some(v.into_owned()),
                "signature" if sig.is_none() => sig = Some(v.into_owned()),
                "signature_expiration" if q.expiration.is_none() => {
                    q.expiration = Some(v.into_owned())
                }
                _ => {}
            }
        }
        q.path = path.unwrap_or_default();
        q.username = user.unwrap_or_default();
        q.signature = sig.unwrap_or_default();
        q
    }
}

/// `v1_` signature of a file URL.
pub fn sign(path: &str, op: &str, user: &str, token: &str, expiration: Option<i64>) -> String {
    let mut raw = format!("{path}:{op}:{user}:{token}");
    if let Some(exp) = expiration {
        raw.push(':');
        raw.push_str(&exp.to_string());
    }
    let digest = Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The operation a method needs a signature for.
pub fn operation(method: &Method) -> Option<&'static str> {
    if method == Method::GET || method == Method::HEAD {
        Some("read")
    } else if method == Method::POST {
        Some("write")
    } else {
        None
    }
}

/// The sandboxes among `candidates` whose envd token produced `q.signature` for `op`.
pub fn matching(q: &SignedQuery, op: &str, candidates: Vec<SandboxTarget>) -> Vec<SandboxTarget> {
    let expiration = match &q.expiration {
        None => None,
        Some(text) => match text.trim().parse::<i64>() {
            Ok(v) => Some(v),
            Err(_) => return Vec::new(),
        },
    };
    if !q.signature.starts_with("v1_") {
        return Vec::new();
    }
    candidates
        .into_iter()
        .filter(|t| {
            t.envd_access_token.as_deref().is_some_and(|token| {
                let expected = sign(&q.path, op, &q.username, token, expiration);
                constant_time_eq(expected.as_bytes(), q.signature.as_bytes())
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known answer computed with the Python SDK's `get_signature` (same vector as envd's
    /// own test).
    #[test]
    fn matches_the_python_sdk() {
        assert_eq!(
            sign("/home/user/a.txt", "read", "", "abc", None),
            "v1_+oUuSuDwZH607yeEMzKYH5g8Lm4NXH3iGDZ0mZif/S8"
        );
    }

    fn target(id: &str, token: Option<&str>) -> SandboxTarget {
        SandboxTarget {
            id: id.into(),
            envd_socket: "/nonexistent".into(),
            init_pidfd: None,
            envd_access_token: token.map(Into::into),
            traffic_access_token: None,
            mask_request_host: None,
        }
    }

    #[test]
    fn picks_the_sandbox_whose_token_signed() {
        let sig = sign("/tmp/a b", "write", "root", "tok2", Some(1_900_000_000));
        let query = format!(
            "path=%2Ftmp%2Fa%20b&username=root&signature={}&signature_expiration=1900000000",
            percent_encoding::utf8_percent_encode(&sig, percent_encoding::NON_ALPHANUMERIC)
        );
        let q = SignedQuery::parse(&query);
        let all = vec![
            target("a", Some("tok1")),
            target("b", Some("tok2")),
            target("c", None),
        ];
        let m = matching(&q, "write", all.clone());
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].id, "b");
        assert!(matching(&q, "read", all).is_empty());
    }
}
