//! `POST /init` (the node configures the sandbox) and `GET /envs`.
//!
//! `/init` takes `{envVars, accessToken, timestamp, defaultUser, defaultWorkdir,
//! volumeMounts, lifecycleID, hyperloopIP, caBundle}` — every field optional, unknown
//! fields ignored — and answers `204` with `X-Envd-Version`. It may be called again
//! (resume): env vars are merged, other settings replaced when given. The access-token
//! middleware guards it like every route, so once a token is set a re-init needs it.
//!
//! * `envVars` → the sandbox-global environment of every process (`E2B_SANDBOX=true` is
//!   always added).
//! * `accessToken` → the token every request needs from now on (`""` removes it). It
//!   must be a valid header value without `\` (what upstream accepts).
//! * `defaultUser`, `defaultWorkdir` → defaults for processes and paths.
//! * Outside development mode, the identity files (`crate::identity`) of the env vars
//!   `E2B_SANDBOX_ID` and `E2B_TEMPLATE_ID`, as upstream envd writes them.
//! * `timestamp`, `volumeMounts`, `lifecycleID`, `hyperloopIP`, `caBundle` are accepted
//!   and ignored: a Cubicle sandbox shares the host clock, and the node does mounts,
//!   networking and certificates itself.

use std::{collections::HashMap, path::PathBuf, sync::Arc};

use axum::{
    body::Body,
    extract::State,
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use http_body_util::BodyExt;
use serde::Deserialize;

use super::HttpError;
use crate::{
    server::AppState,
    state::{Context, ENVD_VERSION},
    users,
};

/// Largest `/init` body (a CA bundle can be sizeable).
const MAX_INIT_BODY: usize = 8 << 20;

/// The `/init` request.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct InitRequest {
    pub env_vars: Option<HashMap<String, String>>,
    pub access_token: Option<String>,
    #[allow(dead_code)]
    pub timestamp: Option<serde_json::Value>,
    pub default_user: Option<String>,
    pub default_workdir: Option<String>,
    pub volume_mounts: Option<serde_json::Value>,
    #[allow(dead_code)]
    #[serde(rename = "lifecycleID")]
    pub lifecycle_id: Option<serde_json::Value>,
    #[allow(dead_code)]
    #[serde(rename = "hyperloopIP")]
    pub hyperloop_ip: Option<serde_json::Value>,
    pub ca_bundle: Option<serde_json::Value>,
}

/// `POST /init`.
pub(crate) async fn post_init(State(state): State<Arc<AppState>>, body: Body) -> Response {
    match init(&state.ctx, body).await {
        Ok(()) => {
            let mut resp = StatusCode::NO_CONTENT.into_response();
            resp.headers_mut()
                .insert("x-envd-version", HeaderValue::from_static(ENVD_VERSION));
            resp
        }
        Err(e) => e.into_response(),
    }
}

async fn init(ctx: &Context, body: Body) -> Result<(), HttpError> {
    let bytes = http_body_util::Limited::new(body, MAX_INIT_BODY)
        .collect()
        .await
        .map_err(|e| HttpError::bad_request(format!("reading the request body: {e}")))?
        .to_bytes();
    let req: InitRequest = if bytes.iter().all(u8::is_ascii_whitespace) {
        InitRequest::default()
    } else {
        serde_json::from_slice(&bytes)
            .map_err(|e| HttpError::bad_request(format!("invalid init request: {e}")))?
    };
    apply(ctx, req)
}

/// Validates and applies an init request.
pub(crate) fn apply(ctx: &Context, req: InitRequest) -> Result<(), HttpError> {
    let env = req.env_vars.unwrap_or_default();
    for (k, v) in &env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(HttpError::bad_request(format!(
                "invalid environment variable '{}'",
                k.escape_debug()
            )));
        }
    }
    if let Some(token) = &req.access_token
        && (token.contains('\\') || HeaderValue::from_str(token).is_err())
    {
        return Err(HttpError::bad_request("invalid access token"));
    }
    let workdir = match req.default_workdir.as_deref() {
        Some(w) if !w.is_empty() => {
            if !w.starts_with('/') || w.contains('\0') {
                return Err(HttpError::bad_request(format!(
                    "defaultWorkdir must be an absolute path: '{w}'"
                )));
            }
            Some(PathBuf::from(w))
        }
        _ => None,
    };
    let user = req.default_user.filter(|u| !u.is_empty());
    if let Some(u) = &user
        && users::by_name(u).is_none()
    {
        tracing::warn!(user = %u, "init: the default user does not exist (yet)");
    }
    if req
        .volume_mounts
        .as_ref()
        .is_some_and(|v| !v.is_null() && v.as_array().is_none_or(|a| !a.is_empty()))
    {
        tracing::warn!("init: volumeMounts are not supported by cubicle-envd; ignored");
    }
    if req
        .ca_bundle
        .as_ref()
        .is_some_and(|v| !v.is_null() && v.as_str() != Some(""))
    {
        tracing::info!("init: caBundle ignored (certificates are the node's business)");
    }

    let sandbox_id = env.get("E2B_SANDBOX_ID").cloned();
    let template_id = env.get("E2B_TEMPLATE_ID").cloned();
    ctx.update(|s| {
        s.env_vars.extend(env);
        s.env_vars.insert("E2B_SANDBOX".into(), "true".into());
        if let Some(token) = req.access_token {
            s.access_token = (!token.is_empty()).then_some(token);
        }
        if let Some(u) = user {
            s.default_user = Some(u);
        }
        if let Some(w) = workdir {
            s.default_workdir = Some(w);
        }
    });
    if !ctx.config.dev {
        crate::identity::write(sandbox_id.as_deref(), template_id.as_deref());
    }
    Ok(())
}

/// The sandbox-global environment envd was born with (`CUBICLE_ENVD_ENV_VARS`, a JSON
/// object of strings), applied as an `/init` naming only `envVars` would apply it: a
/// create that asks envd for nothing else then needs no `/init` at all, so a claim from a
/// pool does not wake the pooled sandbox's envd (docs/bench.md, round 33).
pub fn apply_birth_env(ctx: &Context, json: &str) -> Result<(), String> {
    let env: HashMap<String, String> =
        serde_json::from_str(json).map_err(|e| format!("CUBICLE_ENVD_ENV_VARS: {e}"))?;
    let req = InitRequest {
        env_vars: Some(env),
        ..Default::default()
    };
    apply(ctx, req).map_err(|e| format!("CUBICLE_ENVD_ENV_VARS: {}", e.message))
}

/// `GET /envs`: the sandbox-global environment.
pub(crate) async fn get_envs(State(state): State<Arc<AppState>>) -> Response {
    let envs = state.ctx.env_vars();
    let mut resp = axum::Json(envs).into_response();
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Config;

    fn ctx() -> Context {
        Context::new(Config {
            dev: true,
            default_user: None,
            default_workdir: None,
            access_token: None,
        })
    }

    /// The environment envd is born with is what an `/init` of it sets (a later one
    /// merges into it: `applies_and_merges`); what is not a JSON object of strings, or
    /// names an invalid variable, is refused with the variable's name in the message.
    #[test]
    fn birth_env_is_an_init_of_it() {
        let c = ctx();
        apply_birth_env(&c, r#"{"E2B_SANDBOX_ID":"i1","A":"1"}"#).unwrap();
        let s = c.settings();
        assert_eq!(s.env_vars["E2B_SANDBOX_ID"], "i1");
        assert_eq!(s.env_vars["A"], "1");
        assert_eq!(s.env_vars["E2B_SANDBOX"], "true");
        assert_eq!(s.access_token, None);
        for bad in [r#"["A"]"#, r#"{"A":1}"#, "{", r#"{"A=B":"1"}"#] {
            let e = apply_birth_env(&ctx(), bad).unwrap_err();
            assert!(e.starts_with("CUBICLE_ENVD_ENV_VARS: "), "{bad}: {e}");
        }
    }

    #[test]
    fn applies_and_merges() {
        let c = ctx();
        let req: InitRequest = serde_json::from_str(
            r#"{"envVars":{"A":"1"},"accessToken":"tok","defaultUser":"root","defaultWorkdir":"/tmp",
                "volumeMounts":[{"nfs_target":"x","path":"/mnt"}],"lifecycleID":"l","hyperloopIP":"1.2.3.4",
                "caBundle":"","timestamp":"2026-01-01T00:00:00Z","unknown":{"x":1}}"#,
        )
        .unwrap();
        apply(&c, req).unwrap();
        let s = c.settings();
        assert_eq!(s.env_vars["A"], "1");
        assert_eq!(s.env_vars["E2B_SANDBOX"], "true");
        assert_eq!(s.access_token.as_deref(), Some("tok"));
        assert_eq!(s.default_user.as_deref(), Some("root"));
        assert_eq!(s.default_workdir, Some(PathBuf::from("/tmp")));
        // A second init merges env vars and keeps what it does not mention.
        apply(
            &c,
            serde_json::from_str(r#"{"envVars":{"B":"2"}}"#).unwrap(),
        )
        .unwrap();
        let s = c.settings();
        assert_eq!(
            (s.env_vars["A"].as_str(), s.env_vars["B"].as_str()),
            ("1", "2")
        );
        assert_eq!(s.access_token.as_deref(), Some("tok"));
        // "" removes the token.
        apply(&c, serde_json::from_str(r#"{"accessToken":""}"#).unwrap()).unwrap();
        assert_eq!(c.access_token(), None);
    }

    #[test]
    fn refuses_bad_values() {
        let c = ctx();
        for body in [
            r#"{"accessToken":"a\\b"}"#,
            r#"{"accessToken":"a\nb"}"#,
            r#"{"envVars":{"A=B":"1"}}"#,
            r#"{"envVars":{"":"1"}}"#,
            r#"{"defaultWorkdir":"relative"}"#,
        ] {
            let req: InitRequest = serde_json::from_str(body).unwrap();
            assert_eq!(
                apply(&c, req).unwrap_err().status,
                StatusCode::BAD_REQUEST,
                "{body}"
            );
        }
        assert!(serde_json::from_str::<InitRequest>(r#"{"envVars":{"A":1}}"#).is_err());
    }
}
