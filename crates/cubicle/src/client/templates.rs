//! E2B's template builder API from the client side (what the SDKs' `Template.build()`
//! does): request a build, check and upload each COPY's files, start the build, poll its
//! status and log entries until it ends.

use std::time::Duration;

use hyper::Method;
use serde_json::{Value, json};

use super::ClientError;
use super::http::{self, BaseUrl};
use super::rest::ApiClient;

/// How long one call may take.
const CALL: Duration = Duration::from_secs(60);
/// How long an upload may take.
const UPLOAD: Duration = Duration::from_secs(3600);

fn seg(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

impl ApiClient {
    /// `POST /v3/templates` → `(templateID, buildID)`.
    pub async fn request_build(
        &self,
        name: &str,
        tags: &[String],
        cpus: Option<u32>,
        memory_mb: Option<u64>,
    ) -> Result<(String, String), ClientError> {
        let mut b = json!({ "name": name });
        if !tags.is_empty() {
            b["tags"] = json!(tags);
        }
        if let Some(c) = cpus {
            b["cpuCount"] = json!(c);
        }
        if let Some(m) = memory_mb {
            b["memoryMB"] = json!(m);
        }
        let (_, _, body) = self
            .call(
                Method::POST,
                "/v3/templates",
                Some(b.to_string().into_bytes()),
                CALL,
            )
            .await?;
        let v: Value = serde_json::from_slice(&body)
            .map_err(|e| ClientError::Protocol(format!("/v3/templates: {e}")))?;
        let s = |k: &str| {
            v.get(k)
                .and_then(Value::as_str)
                .map(String::from)
                .ok_or_else(|| ClientError::Protocol(format!("/v3/templates: no {k}")))
        };
        Ok((s("templateID")?, s("buildID")?))
    }

    /// `GET /templates/{id}/files/{hash}` → `(present, upload url)`.
    pub async fn file_link(
        &self,
        id: &str,
        hash: &str,
    ) -> Result<(bool, Option<String>), ClientError> {
        let path = format!("/templates/{}/files/{hash}", seg(id));
        let (_, _, body) = self.call(Method::GET, &path, None, CALL).await?;
        let v: Value = serde_json::from_slice(&body)
            .map_err(|e| ClientError::Protocol(format!("{path}: {e}")))?;
        Ok((
            v.get("present").and_then(Value::as_bool).unwrap_or(false),
            v.get("url").and_then(Value::as_str).map(String::from),
        ))
    }

    /// `POST /v2/templates/{id}/builds/{build}` with the build's body.
    pub async fn start_build(
        &self,
        id: &str,
        build: &str,
        body: &Value,
    ) -> Result<(), ClientError> {
        let path = format!("/v2/templates/{}/builds/{}", seg(id), seg(build));
        self.call(
            Method::POST,
            &path,
            Some(body.to_string().into_bytes()),
            CALL,
        )
        .await?;
        Ok(())
    }

    /// `GET /templates/{id}/builds/{build}/status?logsOffset=N`.
    pub async fn build_status(
        &self,
        id: &str,
        build: &str,
        offset: usize,
    ) -> Result<Value, ClientError> {
        let path = format!(
            "/templates/{}/builds/{}/status?logsOffset={offset}&limit=100",
            seg(id),
            seg(build)
        );
        let (_, _, body) = self.call(Method::GET, &path, None, CALL).await?;
        serde_json::from_slice(&body).map_err(|e| ClientError::Protocol(format!("{path}: {e}")))
    }

    /// `POST /cubicle/templates/{id}/builds/{build}/cancel`.
    pub async fn cancel_build(&self, id: &str, build: &str) -> Result<(), ClientError> {
        let path = format!(
            "/cubicle/templates/{}/builds/{}/cancel",
            seg(id),
            seg(build)
        );
        self.call(Method::POST, &path, None, CALL).await?;
        Ok(())
    }
}

/// `PUT url` with `data` (a presigned upload: no API key).
pub async fn upload(url: &str, data: Vec<u8>) -> Result<(), ClientError> {
    let (base_str, path) = match url
        .find("://")
        .and_then(|i| url[i + 3..].find('/').map(|j| i + 3 + j))
    {
        Some(p) => (&url[..p], &url[p..]),
        None => (url, "/"),
    };
    let base = BaseUrl::parse(base_str)?;
    let len = data.len();
    let req = base
        .request(Method::PUT, path)
        .header(hyper::header::CONTENT_LENGTH, len)
        .body(http::full(data))
        .map_err(|e| ClientError::Config(format!("bad upload request: {e}")))?;
    let fut = async {
        let resp = http::send(&base, req).await?;
        let status = resp.status().as_u16();
        let body = http::read_body(resp.into_body(), 1 << 20).await?;
        Ok::<_, ClientError>((status, body))
    };
    let (status, body) = tokio::time::timeout(UPLOAD, fut)
        .await
        .map_err(|_| ClientError::Timeout(format!("upload to {url}")))??;
    if !(200..300).contains(&status) {
        return Err(ClientError::from_error_body(status, &body));
    }
    Ok(())
}
