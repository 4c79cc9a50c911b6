//! Signed file URLs (`download_url` / `upload_url`) and the `/files` access check.
//!
//! ```text
//! raw = path ":" op ":" user ":" token [":" expiration]     op = "read" | "write"
//! sig = "v1_" + base64_std_no_padding(sha256(raw))
//! ```
//! `path` is the `path` query value exactly as the client sent it (before `~`/relative
//! resolution), `user` the `username` query value or "" when absent, `expiration` absolute
//! unix seconds. Same as the SDKs' `get_signature` (e2b 2.63.0, `sandbox/signature.py`)
//! and upstream envd: a token in `X-Access-Token` takes precedence — if present it must be
//! right (a signature does not rescue a wrong header).

use axum::http::HeaderMap;
use base64::Engine;
use sha2::{Digest, Sha256};

use super::{FilesQuery, HttpError};
use crate::{
    auth::{ACCESS_TOKEN_HEADER, constant_time_eq},
    state::Context,
};

/// What a signature allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Read,
    Write,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Read => "read",
            Operation::Write => "write",
        }
    }
}

/// The v1 signature of a file URL.
pub fn sign(path: &str, op: Operation, user: &str, token: &str, expiration: Option<i64>) -> String {
    let mut raw = format!("{path}:{}:{user}:{token}", op.as_str());
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

fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Checks that a `/files` request may proceed: no token set, or the right
/// `X-Access-Token`, or (without that header) a valid, unexpired signature.
pub(crate) fn authorize(
    ctx: &Context,
    headers: &HeaderMap,
    query: &FilesQuery,
    op: Operation,
) -> Result<(), HttpError> {
    let Some(token) = ctx.access_token() else {
        return Ok(());
    };
    if let Some(given) = headers.get(ACCESS_TOKEN_HEADER) {
        return if constant_time_eq(given.as_bytes(), token.as_bytes()) {
            Ok(())
        } else {
            Err(HttpError::unauthorized(
                "access token present in header but does not match",
            ))
        };
    }
    let Some(signature) = query.signature.as_deref() else {
        return Err(HttpError::unauthorized(
            "unauthorized access, please provide a valid access token or a signature",
        ));
    };
    let expiration = match query.signature_expiration.as_deref() {
        None => None,
        Some(text) => Some(
            text.trim()
                .parse::<i64>()
                .map_err(|_| HttpError::unauthorized("invalid signature expiration"))?,
        ),
    };
    let expected = sign(
        query.path.as_deref().unwrap_or(""),
        op,
        query.username.as_deref().unwrap_or(""),
        &token,
        expiration,
    );
    if !constant_time_eq(expected.as_bytes(), signature.as_bytes()) {
        return Err(HttpError::unauthorized("invalid signature"));
    }
    if let Some(exp) = expiration
        && now_unix() > exp
    {
        return Err(HttpError::unauthorized("signature is already expired"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Config;

    /// Known answers computed with the SDK's own code (e2b 2.63.0
    /// `e2b/sandbox/signature.py::get_signature`, time pinned at 1700000000 for the
    /// third one).
    #[test]
    fn matches_the_python_sdk() {
        assert_eq!(
            sign("/home/user/a.txt", Operation::Read, "", "abc", None),
            "v1_+oUuSuDwZH607yeEMzKYH5g8Lm4NXH3iGDZ0mZif/S8"
        );
        assert_eq!(
            sign(
                "~/dir/file name.txt",
                Operation::Write,
                "root",
                "0123456789abcdef",
                None
            ),
            "v1_icVl++1OBQ0gSpVit1mKXpUxrpe5RJR6S9QN9Sork1w"
        );
        assert_eq!(
            sign(
                "/tmp/x",
                Operation::Read,
                "user",
                "tok",
                Some(1_700_000_060)
            ),
            "v1_dR7ozUBQR+V9Qq7xUvArHTi5gTd8QYyRO6kJEi0iZhA"
        );
    }

    fn ctx(token: Option<&str>) -> Context {
        Context::new(Config {
            dev: true,
            default_user: None,
            default_workdir: None,
            access_token: token.map(str::to_string),
        })
    }

    fn query(path: &str, user: Option<&str>, sig: Option<String>, exp: Option<i64>) -> FilesQuery {
        FilesQuery {
            path: Some(path.into()),
            username: user.map(str::to_string),
            signature: sig,
            signature_expiration: exp.map(|e| e.to_string()),
        }
    }

    #[test]
    fn authorizes() {
        let h = HeaderMap::new();
        // No token set: anything goes.
        assert!(
            authorize(
                &ctx(None),
                &h,
                &query("/a", None, None, None),
                Operation::Read
            )
            .is_ok()
        );
        let c = ctx(Some("tok"));
        assert_eq!(
            authorize(&c, &h, &query("/a", None, None, None), Operation::Read)
                .unwrap_err()
                .status,
            401
        );
        let mut good = HeaderMap::new();
        good.insert(ACCESS_TOKEN_HEADER, "tok".parse().unwrap());
        assert!(authorize(&c, &good, &query("/a", None, None, None), Operation::Read).is_ok());
        // A wrong header is not rescued by a valid signature.
        let mut bad = HeaderMap::new();
        bad.insert(ACCESS_TOKEN_HEADER, "nope".parse().unwrap());
        let sig = sign("/a", Operation::Read, "", "tok", None);
        assert!(
            authorize(
                &c,
                &bad,
                &query("/a", None, Some(sig.clone()), None),
                Operation::Read
            )
            .is_err()
        );
        assert!(
            authorize(
                &c,
                &h,
                &query("/a", None, Some(sig.clone()), None),
                Operation::Read
            )
            .is_ok()
        );
        // Wrong operation, path or user.
        assert!(
            authorize(
                &c,
                &h,
                &query("/a", None, Some(sig.clone()), None),
                Operation::Write
            )
            .is_err()
        );
        assert!(
            authorize(
                &c,
                &h,
                &query("/b", None, Some(sig.clone()), None),
                Operation::Read
            )
            .is_err()
        );
        assert!(
            authorize(
                &c,
                &h,
                &query("/a", Some("root"), Some(sig), None),
                Operation::Read
            )
            .is_err()
        );
        // Expiration: in the future ok, in the past refused, tampered refused.
        let future = now_unix() + 60;
        let sig = sign("/a", Operation::Write, "root", "tok", Some(future));
        assert!(
            authorize(
                &c,
                &h,
                &query("/a", Some("root"), Some(sig.clone()), Some(future)),
                Operation::Write
            )
            .is_ok()
        );
        assert!(
            authorize(
                &c,
                &h,
                &query("/a", Some("root"), Some(sig), Some(future + 1)),
                Operation::Write
            )
            .is_err()
        );
        let past = now_unix() - 1;
        let sig = sign("/a", Operation::Read, "", "tok", Some(past));
        let err = authorize(
            &c,
            &h,
            &query("/a", None, Some(sig), Some(past)),
            Operation::Read,
        )
        .unwrap_err();
        assert!(err.message.contains("expired"), "{err}");
    }
}
