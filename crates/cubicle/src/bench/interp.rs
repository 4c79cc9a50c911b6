//! The `interp` measure: the code interpreter as the `e2b-code-interpreter` SDK uses it,
//! on `code-interpreter-v1`.
//!
//! - `interp-first`: `POST /v2/sandboxes` + the first `POST /execute` of `1+1` through the
//!   router (port 49999) until its `end_of_execution` line, all timed (the kill is not);
//!   paced by `--interp-pace-ms` so that a pool can refill between creates, as an agent
//!   works between sandboxes.
//! - `interp-run`: `POST /execute` of `1+1` in one running sandbox, each on a new
//!   connection (the SDK opens one per `run_code`).
//!
//! Both check the answer (`"text":"2"`).

use std::time::{Duration, Instant};

use anyhow::bail;
use hyper::Method;
use serde_json::json;

use super::Ctx;
use super::api::{Api, Sbx, drive, note_errors};
use super::report::Row;
use crate::client::{Connection, full_body, read_body};

/// The code interpreter's template (the SDK's default).
pub const TEMPLATE: &str = "code-interpreter-v1";
/// The interpreter's port.
const PORT: u16 = 49999;
/// Largest `/execute` answer read (`1+1` streams a few hundred bytes).
const BODY_LIMIT: usize = 1 << 20;

impl Api {
    /// `POST /execute` of `code` through the router on connection `c`, as the SDK's
    /// `run_code`: the main result's text (`None`: no result) once the stream ended;
    /// an error status or an error line in the stream is an error.
    pub(super) async fn run_code(
        &self,
        c: &mut Connection,
        s: &Sbx,
        code: &str,
    ) -> anyhow::Result<Option<String>> {
        let body = json!({"code": code, "context_id": null, "language": null, "env_vars": null});
        let mut b = self
            .base()
            .request(Method::POST, "/execute")
            .header("content-type", "application/json")
            .header("e2b-sandbox-id", &s.id)
            .header("e2b-sandbox-port", PORT.to_string());
        if let Some(t) = &s.token {
            b = b.header("x-access-token", t);
        }
        let resp = c.send(b.body(full_body(body.to_string()))?).await?;
        let status = resp.status().as_u16();
        let body = read_body(resp.into_body(), BODY_LIMIT).await?;
        if status != 200 {
            bail!("/execute: {status} {}", String::from_utf8_lossy(&body));
        }
        let mut text = None;
        let mut ended = false;
        for line in body.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            let v: serde_json::Value = serde_json::from_slice(line)?;
            match v["type"].as_str() {
                Some("result") if v["is_main_result"] == true => {
                    text = v["text"].as_str().map(str::to_string)
                }
                Some("error") => bail!("/execute: {v}"),
                Some("end_of_execution") => ended = true,
                _ => {}
            }
        }
        if !ended {
            bail!("/execute: the stream ended without end_of_execution");
        }
        Ok(text)
    }

    /// [`Api::run_code`] on a new connection (the SDK opens one per `run_code`); Ok once
    /// its main result's text is `want`.
    async fn execute(&self, s: &Sbx, code: &str, want: &str) -> anyhow::Result<()> {
        let mut c = Connection::lazy(self.base());
        let text = self.run_code(&mut c, s, code).await?;
        if text.as_deref() != Some(want) {
            bail!("/execute: no result {want:?} (got {text:?})");
        }
        Ok(())
    }
}

/// `interp-first`: create + first result, `iterations` times, `pace` apart.
pub(super) async fn measure_first(cx: &Ctx, pace: Duration) -> Row {
    let internet = cx.internet;
    let (samples, errors, msgs) = drive(&cx.api, 1, cx.iterations, move |api, mut c| async move {
        let t0 = Instant::now();
        let r = async {
            let s = api.create(&mut c, TEMPLATE, internet).await?;
            let ran = api.execute(&s, "1+1", "2").await;
            let d = t0.elapsed();
            api.kill(&mut c, &s.id).await?;
            ran.map(|_| d)
        }
        .await;
        tokio::time::sleep(pace).await;
        (c, r)
    })
    .await;
    note_errors(&msgs);
    Row {
        samples,
        errors,
        ..Row::new("interp-first", 1)
    }
    .with("template", TEMPLATE)
    .with("pool", cx.pool.as_str())
    .with("pace_ms", pace.as_millis() as u64)
}

/// `interp-run`: `run_code("1+1")` in one sandbox, `iterations` times.
pub(super) async fn measure_run(cx: &Ctx) -> anyhow::Result<Row> {
    let mut c = cx.api.conn();
    let s = cx.api.create(&mut c, TEMPLATE, cx.internet).await?;
    // Warm-up: the first executions load what the kernel still lacks.
    for _ in 0..5 {
        cx.api.execute(&s, "1+1", "2").await?;
    }
    let sb = s.clone();
    let (samples, errors, msgs) = drive(&cx.api, 1, cx.iterations, move |api, c| {
        let sb = sb.clone();
        async move {
            let t0 = Instant::now();
            let r = api.execute(&sb, "1+1", "2").await.map(|_| t0.elapsed());
            (c, r)
        }
    })
    .await;
    note_errors(&msgs);
    cx.api.kill(&mut c, &s.id).await?;
    Ok(Row {
        samples,
        errors,
        ..Row::new("interp-run", 1)
    }
    .with("template", TEMPLATE)
    .with("connection", "new"))
}
