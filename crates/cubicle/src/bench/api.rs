//! How the bench calls the server: through the command line's client library (the REST
//! client and envd's Connect client, `crate::client`), as an SDK does, with one kept-alive
//! HTTP/1.1 connection per worker (an SDK's connection pool); and [`drive`], which runs a
//! measure's iterations over its workers.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{anyhow, bail};
use cubicle_proto::process::{ProcessConfig, StartRequest, StartResponse, process_event::Event};
use serde_json::Value;

use crate::client::{ApiClient, BaseUrl, Connection, EnvdClient, ListFilter, NewSandbox};

/// `Connect-Timeout-Ms` of the bench's `Process.Start` calls.
const RUN_TIMEOUT: Duration = Duration::from_secs(60);

/// The server under measure.
#[derive(Clone)]
pub(super) struct Api {
    rest: ApiClient,
    /// E2B `network` options of every create (`--network`).
    network: Option<Value>,
    /// Every create's timeout, seconds: long enough that the first of a density run's
    /// thousands of sandboxes is still alive when the last is made.
    timeout_s: u64,
}

/// A sandbox the bench created.
#[derive(Clone)]
pub(super) struct Sbx {
    pub(super) id: String,
    pub(super) token: Option<String>,
}

impl Api {
    /// The server at `url` (`http://host:port`), called with API key `key`; every create
    /// sends `network`.
    pub(super) fn new(
        url: &str,
        key: String,
        network: Option<Value>,
        timeout_s: u64,
    ) -> anyhow::Result<Api> {
        Ok(Api {
            rest: ApiClient::new(BaseUrl::parse(url)?, key),
            network,
            timeout_s,
        })
    }

    /// The REST client (calls the bench has no method for).
    pub(super) fn rest(&self) -> &ApiClient {
        &self.rest
    }

    /// The server's base URL.
    pub(super) fn base(&self) -> &BaseUrl {
        self.rest.base()
    }

    /// A worker's connection (opened on first use, reopened when the server closes it).
    pub(super) fn conn(&self) -> Connection {
        Connection::lazy(self.rest.base())
    }

    /// `POST /v2/sandboxes` (tagged `cubicle-bench=1`, for the bench's timeout), ready
    /// when answered.
    pub(super) async fn create(
        &self,
        c: &mut Connection,
        template: &str,
        internet: bool,
    ) -> anyhow::Result<Sbx> {
        let req = NewSandbox {
            template_id: template.to_string(),
            timeout: Some(self.timeout_s),
            metadata: [("cubicle-bench".to_string(), "1".to_string())].into(),
            env_vars: Default::default(),
            allow_internet_access: Some(internet),
            network: self.network.clone(),
            volume_mounts: Vec::new(),
            cpu_count: None,
            memory_mb: None,
            disk_mb: None,
        };
        let (sbx, _) = self
            .rest
            .create_on(c, &req)
            .await
            .map_err(|e| anyhow!("create: {e}"))?;
        Ok(Sbx {
            id: sbx.sandbox_id,
            token: sbx.envd_access_token,
        })
    }

    /// `DELETE /sandboxes/{id}`; a sandbox that is already gone is fine.
    pub(super) async fn kill(&self, c: &mut Connection, id: &str) -> anyhow::Result<()> {
        match self.rest.kill_on(c, id).await {
            Err(e) if e.status() != Some(404) => bail!("kill {id}: {e}"),
            _ => Ok(()),
        }
    }

    /// The server's warm-pool counters (`GET /cubicle/pool`) as JSON, or `None` from a
    /// server without that route.
    pub(super) async fn pool_json(&self, c: &mut Connection) -> Option<Value> {
        self.rest.pool_stats_on(c).await.ok()
    }

    /// (claims, misses, of those misses the ones a refill served) of the server's warm
    /// pools, or `None`.
    pub(super) async fn pool_counts(&self, c: &mut Connection) -> Option<(u64, u64, u64)> {
        let v = self.pool_json(c).await?;
        // An older server counts no waits.
        let waited = v["waited"].as_u64().unwrap_or(0);
        Some((v["claims"].as_u64()?, v["misses"].as_u64()?, waited))
    }

    /// Ids of the running sandboxes the bench created (tagged `cubicle-bench=1`).
    pub(super) async fn list_ids(&self, c: &mut Connection) -> anyhow::Result<Vec<String>> {
        let filter = ListFilter {
            metadata: vec![("cubicle-bench".into(), "1".into())],
            states: vec!["running".into(), "paused".into()],
            template: None,
        };
        let all = self.rest.list_on(c, &filter).await?;
        Ok(all
            .iter()
            .filter(|s| s["metadata"]["cubicle-bench"] == "1")
            .filter_map(|s| s["sandboxID"].as_str().map(str::to_string))
            .collect())
    }

    /// `Process.Start` of `cmd args…` through the router, read to its end-of-stream; Ok
    /// when the process exited with code 0.
    pub(super) async fn run(
        &self,
        c: &mut Connection,
        s: &Sbx,
        cmd: &str,
        args: &[&str],
    ) -> anyhow::Result<()> {
        let envd = EnvdClient::new(self.rest.base().clone(), &s.id, s.token.clone(), None);
        let req = StartRequest {
            process: Some(ProcessConfig {
                cmd: cmd.to_string(),
                args: args.iter().map(|a| a.to_string()).collect(),
                ..Default::default()
            }),
            stdin: Some(false),
            ..Default::default()
        };
        let mut stream = envd
            .server_stream_on::<_, StartResponse>(
                c,
                "/process.Process/Start",
                &req,
                Some(RUN_TIMEOUT),
            )
            .await
            .map_err(|e| anyhow!("Process.Start: {e}"))?;
        let mut ended = None;
        // To the end of the stream, so that the connection can carry the next request.
        while let Some(msg) = stream
            .next()
            .await
            .map_err(|e| anyhow!("Process.Start: {e}"))?
        {
            if let Some(Event::End(end)) = msg.event.and_then(|e| e.event) {
                ended = Some(end);
            }
        }
        match ended {
            Some(end) if end.exit_code == 0 && end.exited => Ok(()),
            Some(end) => bail!("`{cmd}` ended: exit code {}, {}", end.exit_code, end.status),
            None => bail!("Process.Start: stream ended without an end event"),
        }
    }

    /// envd's `GET /health` of sandbox `id` through the router.
    pub(super) async fn health(&self, c: &mut Connection, id: &str) -> anyhow::Result<()> {
        EnvdClient::new(self.rest.base().clone(), id, None, None)
            .health_on(c)
            .await
            .map_err(|e| anyhow!("/health of {id}: {e}"))
    }
}

/// The command `commands.run("true")` amounts to in `template` (the SDK sends
/// `/bin/bash -l -c true`; busybox `tiny` has no bash, so `/bin/sh -c true` there).
pub(super) fn true_cmd(template: &str) -> (&'static str, Vec<&'static str>) {
    if template == "tiny" {
        ("/bin/sh", vec!["-c", "true"])
    } else {
        ("/bin/bash", vec!["-l", "-c", "true"])
    }
}

/// Runs `total` iterations of `op` over `conc` workers; each worker has its own API
/// connection. `op` returns the timed duration (it may exclude untimed cleanup).
pub(super) async fn drive<F, Fut>(
    api: &Api,
    conc: usize,
    total: usize,
    op: F,
) -> (Vec<Duration>, usize, Vec<String>)
where
    F: Fn(Api, Connection) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = (Connection, anyhow::Result<Duration>)> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..conc.max(1) {
        let (api, next, op) = (api.clone(), next.clone(), op.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = api.conn();
            let (mut ok, mut errs) = (Vec::new(), Vec::new());
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let (c, r) = op(api.clone(), conn).await;
                conn = c;
                match r {
                    Ok(d) => ok.push(d),
                    Err(e) => errs.push(format!("{e:#}")),
                }
            }
            (ok, errs)
        }));
    }
    let (mut samples, mut errors) = (Vec::new(), Vec::new());
    for t in tasks {
        if let Ok((ok, errs)) = t.await {
            samples.extend(ok);
            errors.extend(errs);
        }
    }
    let n = errors.len();
    (samples, n, errors)
}

/// Prints how many of a measure's iterations failed, and the first error.
pub(super) fn note_errors(errors: &[String]) {
    if let Some(first) = errors.first() {
        eprintln!("cubicle bench: {} error(s), first: {first}", errors.len());
    }
}
