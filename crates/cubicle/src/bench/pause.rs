//! `cubicle bench pause`: stateful sandboxes, measured the way an SDK sees them (REST
//! round trips through the server), with the server's own figures from its answer
//! headers (`X-Cubicle-Frozen-Us`: how long the sandbox was stopped; `X-Cubicle-Bytes`:
//! checkpoint size).
//!
//! Rows per template (`--pause-templates`, default `base` and `code-interpreter-v1`, whose
//! kernel first imports numpy and pandas):
//! - `pause` / `resume`: full pause (memory to disk) and connect of one sandbox, N times;
//!   after every resume a command (or, code-interpreter, a `run_code` of a variable set
//!   before the first pause) must succeed;
//! - `pause_fs` / `resume_fs`: filesystem-only pause and the boot that resumes it;
//! - `snapshot`: round trip, with `frozen_p50_ms` (the source's stop);
//! - `fork10`: one fork request for 10 sandboxes, until all 10 run;
//! - `rollback`: back to a snapshot in place.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail};
use bytes::Bytes;
use hyper::Method;
use serde_json::{Value, json};

use super::Ctx;
use super::api::{Api, Sbx, true_cmd};
use super::report::Row;
use crate::client::{ClientError, Connection};

struct Answer {
    status: u16,
    body: Bytes,
    frozen_us: Option<u64>,
    bytes: Option<u64>,
}

impl Api {
    /// `method path` with an optional JSON body on `c`; an error status is an answer
    /// (its message as the body), not an error.
    async fn call_raw(
        &self,
        c: &mut Connection,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Answer> {
        match self
            .rest()
            .json_call_on(c, method, path, body.as_ref())
            .await
        {
            Ok((status, headers, body)) => {
                let header = |k: &str| {
                    headers
                        .get(k)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse().ok())
                };
                Ok(Answer {
                    status,
                    frozen_us: header("x-cubicle-frozen-us"),
                    bytes: header("x-cubicle-bytes"),
                    body,
                })
            }
            Err(ClientError::Status { status, message }) => Ok(Answer {
                status,
                body: Bytes::from(message),
                frozen_us: None,
                bytes: None,
            }),
            Err(e) => Err(anyhow!("{path}: {e}")),
        }
    }

    async fn post(&self, c: &mut Connection, path: &str, body: Value) -> anyhow::Result<Answer> {
        self.call_raw(c, Method::POST, path, Some(body)).await
    }

    async fn delete(&self, c: &mut Connection, path: &str) -> anyhow::Result<u16> {
        Ok(self.call_raw(c, Method::DELETE, path, None).await?.status)
    }
}

fn expect(a: &Answer, want: u16, what: &str) -> anyhow::Result<()> {
    if a.status != want {
        bail!("{what}: {} {}", a.status, String::from_utf8_lossy(&a.body));
    }
    Ok(())
}

/// What proves a resumed sandbox works: a command, or the kernel still knowing `x`.
async fn check(cx: &Ctx, c: &mut Connection, s: &Sbx, template: &str) -> anyhow::Result<()> {
    if template.starts_with("code-interpreter") {
        let out = cx.api.run_code(c, s, "x + 1").await?;
        if out.as_deref() != Some("42") {
            bail!("the kernel lost its state: x + 1 gave {out:?}");
        }
        Ok(())
    } else {
        let (cmd, args) = true_cmd(template);
        cx.api.run(c, s, cmd, &args).await
    }
}

/// The rows for one template.
pub(super) async fn measure(cx: &Ctx, template: &str, n: usize) -> anyhow::Result<Vec<Row>> {
    let mut c = cx.api.conn();
    let s = cx.api.create(&mut c, template, cx.internet).await?;
    let ci = template.starts_with("code-interpreter");
    if ci {
        // Wait for the kernel, then give it the libraries and a variable to keep.
        let t = Instant::now();
        loop {
            match cx
                .api
                .run_code(&mut c, &s, "import numpy, pandas\nx = 41")
                .await
            {
                Ok(_) => break,
                Err(e) if t.elapsed() > Duration::from_secs(120) => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }
    let pause_path = format!("/sandboxes/{}/pause", s.id);
    let connect_path = format!("/v2/sandboxes/{}/connect", s.id);
    let mut pause = Row::new("pause", 1).with("template", template);
    let mut resume = Row::new("resume", 1).with("template", template);
    let (mut frozen, mut bytes) = (Vec::new(), 0u64);
    // One unmeasured round: page cache, CRIU's first run.
    for i in 0..=n {
        let t = Instant::now();
        let a = cx.api.post(&mut c, &pause_path, json!({})).await?;
        let dt = t.elapsed();
        if let Err(e) = expect(&a, 204, "pause") {
            pause.errors += 1;
            eprintln!("cubicle bench: {e}");
            continue;
        }
        let t = Instant::now();
        let r = cx.api.post(&mut c, &connect_path, json!({})).await?;
        let dr = t.elapsed();
        let ok = expect(&r, 201, "resume").is_ok() && check(cx, &mut c, &s, template).await.is_ok();
        if i == 0 {
            continue;
        }
        pause.samples.push(dt);
        frozen.extend(a.frozen_us);
        bytes = a.bytes.unwrap_or(bytes);
        if ok {
            resume.samples.push(dr);
        } else {
            resume.errors += 1;
        }
    }
    frozen.sort_unstable();
    let p50_frozen = frozen.get(frozen.len() / 2).copied().unwrap_or(0) as f64 / 1000.0;
    let mut rows = vec![
        pause
            .with("frozen_p50_ms", p50_frozen)
            .with("checkpoint_bytes", bytes),
        resume,
    ];

    // Filesystem-only pause: the resume boots the template again.
    let k = (n / 4).max(2);
    let mut pfs = Row::new("pause_fs", 1).with("template", template);
    let mut rfs = Row::new("resume_fs", 1).with("template", template);
    if !ci {
        for _ in 0..k {
            let t = Instant::now();
            let a = cx
                .api
                .post(&mut c, &pause_path, json!({"memory": false}))
                .await?;
            if expect(&a, 204, "pause_fs").is_err() {
                pfs.errors += 1;
                continue;
            }
            pfs.samples.push(t.elapsed());
            let t = Instant::now();
            let r = cx.api.post(&mut c, &connect_path, json!({})).await?;
            if expect(&r, 201, "resume_fs").is_ok() {
                rfs.samples.push(t.elapsed());
            } else {
                rfs.errors += 1;
            }
        }
        rows.push(pfs);
        rows.push(rfs);
    }

    // Snapshots (the source runs on) and rollback to one.
    let snap_path = format!("/sandboxes/{}/snapshots", s.id);
    let mut snap = Row::new("snapshot", 1).with("template", template);
    let mut frozen = Vec::new();
    let mut kept: Option<String> = None;
    for _ in 0..k {
        let t = Instant::now();
        let a = cx.api.post(&mut c, &snap_path, json!({})).await?;
        if expect(&a, 201, "snapshot").is_err() {
            snap.errors += 1;
            continue;
        }
        snap.samples.push(t.elapsed());
        frozen.extend(a.frozen_us);
        let v: Value = serde_json::from_slice(&a.body)?;
        let id = v["snapshotID"]
            .as_str()
            .ok_or_else(|| anyhow!("snapshot: no snapshotID"))?
            .to_string();
        if let Some(old) = kept.replace(id) {
            cx.api.delete(&mut c, &format!("/templates/{old}")).await?;
        }
    }
    frozen.sort_unstable();
    let p50_frozen = frozen.get(frozen.len() / 2).copied().unwrap_or(0) as f64 / 1000.0;
    rows.push(snap.with("frozen_p50_ms", p50_frozen));

    if let Some(snapshot) = &kept {
        let mut rb = Row::new("rollback", 1).with("template", template);
        let path = format!("/sandboxes/{}/rollback", s.id);
        for _ in 0..k {
            let t = Instant::now();
            let a = cx
                .api
                .post(&mut c, &path, json!({ "snapshotID": snapshot }))
                .await?;
            let d = t.elapsed();
            if expect(&a, 200, "rollback").is_ok() && check(cx, &mut c, &s, template).await.is_ok()
            {
                rb.samples.push(d);
            } else {
                rb.errors += 1;
            }
        }
        rows.push(rb);
        cx.api
            .delete(&mut c, &format!("/templates/{snapshot}"))
            .await?;
    }

    // One request for ten forks, until all ten run.
    let mut fork = Row::new("fork10", 1).with("template", template);
    let path = format!("/sandboxes/{}/fork", s.id);
    for _ in 0..(n / 10).clamp(2, 5) {
        let t = Instant::now();
        let a = cx
            .api
            .post(&mut c, &path, json!({"count": 10, "timeout": 60}))
            .await?;
        let d = t.elapsed();
        let v: Value = serde_json::from_slice(&a.body).unwrap_or(Value::Null);
        let made: Vec<String> = v
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e["sandbox"]["sandboxID"].as_str().map(str::to_string))
            .collect();
        if a.status == 201 && made.len() == 10 {
            fork.samples.push(d);
        } else {
            fork.errors += 1;
            eprintln!(
                "cubicle bench: fork: {} {}",
                a.status,
                String::from_utf8_lossy(&a.body)
            );
        }
        for id in made {
            cx.api.kill(&mut c, &id).await?;
        }
    }
    rows.push(fork);
    cx.api.kill(&mut c, &s.id).await?;
    Ok(rows)
}
