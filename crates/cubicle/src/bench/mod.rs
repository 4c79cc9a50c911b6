//! `cubicle bench`: latency and density measures against a `cubicle serve`, printed as a
//! table or (`--json`) one JSON object per line per measure.
//!
//! The server is either one the bench starts itself (a child `cubicle serve` on its own
//! state directory, default `/var/lib/cubicle-bench`, listening on a free loopback port,
//! slots from 8000 (or the next free range); its `export …` lines and `cubicle: ready`
//! are read from its stdout)
//! or the one given by `--url`/`--api-key`. Everything the bench creates it kills again.
//!
//! Measures (all through the public REST API and the data-plane router, as an SDK does):
//! - `create`: `POST /v2/sandboxes` → 201 (the sandbox is ready when the answer comes);
//!   the kill afterwards is not timed.
//! - `cycle`: create + `Process.Start` of `true` through envd + `DELETE`, all timed.
//! - `exec`: `Process.Start` of `true` in one running sandbox (what `commands.run("true")`
//!   sends), on a kept-alive connection.
//! - `density`: N idle sandboxes; host memory per sandbox = Δ(MemTotal − MemAvailable)/N;
//!   envd's RSS/PSS per sandbox; p99 of `GET /health` round trips to all of them.
//! - `peer`: the same cycle done with `runc run` on the template's rootfs and with
//!   `bwrap --unshare-all`, next to Cubicle's c=1 cycle of the same run, with ratios.
//! - `interp`: the code interpreter (`code-interpreter-v1`): create + first `run_code`
//!   result, and `run_code("1+1")` through the router (see [`interp`]).
//! - `egress`: the egress layer in a private lab, no server (see [`egress`]).
//! - `pause`: pause/resume (with memory and filesystem-only), snapshot, rollback and fork
//!   per template (see [`pause`]).
//!
//! Files: `api.rs` (how the bench calls the server: the command line's client library,
//! one kept-alive connection per worker), `server.rs` (the server it starts), one file per
//! measure (`create.rs`, `cycle.rs` with `exec`, `density.rs`, `peer.rs`, `interp.rs`, `egress.rs`, `pause.rs`),
//! `report.rs`
//! (rows, percentiles, output).

mod api;
mod create;
mod cycle;
mod density;
mod egress;
mod interp;
mod pause;
mod peer;
mod report;
mod server;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail};

use crate::client::Connection;
use api::Api;
use create::measure_create;
use cycle::{measure_cycle, measure_exec};
use density::measure_density;
use egress::measure_egress;
use peer::{measure_peer, template_rootfs};
use report::{Row, print_header, print_row};
use server::{Server, release_quota_mount};

/// Default state directory of the server the bench starts (templates built once).
pub const DEFAULT_BENCH_STATE_DIR: &str = "/var/lib/cubicle-bench";
const ALL_MEASURES: &[&str] = &[
    "create", "cycle", "exec", "density", "peer", "interp", "egress", "pause",
];

/// `cubicle bench` options.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Measures to run: create, cycle, exec, density, peer, interp, egress, pause (default: create,
    /// cycle, exec, peer).
    #[arg(value_name = "MEASURE")]
    pub measures: Vec<String>,
    /// Use this server instead of starting one (with --api-key).
    #[arg(long, env = "CUBICLE_BENCH_URL")]
    pub url: Option<String>,
    /// API key for --url.
    #[arg(long, env = "CUBICLE_BENCH_API_KEY")]
    pub api_key: Option<String>,
    /// State directory of the server the bench starts.
    #[arg(long, default_value = DEFAULT_BENCH_STATE_DIR)]
    pub server_state_dir: PathBuf,
    /// Template for create/cycle/exec/density/peer.
    #[arg(long, default_value = "tiny")]
    pub template: String,
    /// Also run create and cycle on these templates (comma-separated), e.g. `base`.
    #[arg(long, value_delimiter = ',', default_value = "base")]
    pub also: Vec<String>,
    /// Iterations per latency measure and concurrency.
    #[arg(long, default_value_t = 200)]
    pub iterations: usize,
    /// Concurrencies of create and cycle (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,50")]
    pub concurrency: Vec<usize>,
    /// Sandboxes held by `density`.
    #[arg(long, default_value_t = 1000)]
    pub n: usize,
    /// `density`: keep the N sandboxes this many seconds after the `/health` rounds,
    /// before killing them, to probe or profile a host at N.
    #[arg(long, value_name = "SECS", default_value_t = 0)]
    pub hold: u64,
    /// Sandboxes without internet (no veth / NAT).
    #[arg(long)]
    pub no_internet: bool,
    /// E2B `network` options (JSON) for every sandbox the bench creates, e.g.
    /// `{"allowOut":["pypi.org"],"denyOut":["0.0.0.0/0"]}` (what a policy costs a create).
    #[arg(long, value_name = "JSON", value_parser = parse_network)]
    pub network: Option<serde_json::Value>,
    /// Rootfs for `peer` (default: the template's in the server state directory).
    #[arg(long)]
    pub rootfs: Option<PathBuf>,
    /// Server configurations to measure create/cycle in: `off` (no warm pool), `on`
    /// (`--pool <template>=--pool-size` for each template) and/or `shells` (no pool of
    /// any template, `--shells --pool-size`: sandboxes made ahead of their template), one
    /// server start each.
    #[arg(long, value_delimiter = ',', default_value = "off,on,shells")]
    pub pool_modes: Vec<String>,
    /// Warm-pool size per template in the `on` mode, shells in the `shells` mode.
    #[arg(long, default_value_t = 64)]
    pub pool_size: usize,
    /// Pool mode `on`, c=1: also a create row with this pause between iterations.
    #[arg(long, default_value_t = 50)]
    pub pace_ms: u64,
    /// Templates of the `pause` measure (pause/resume, snapshot, fork, rollback).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "base,code-interpreter-v1"
    )]
    pub pause_templates: Vec<String>,
    /// One JSON object per line per measure instead of a table.
    #[arg(long)]
    pub json: bool,
    /// `interp`: warm-pool size of code-interpreter-v1 in pool mode `on`.
    #[arg(long, default_value_t = 4)]
    pub interp_pool_size: usize,
    /// `interp`: pause between two creates of `interp-first` (a pool refills meanwhile).
    #[arg(long, default_value_t = 2000)]
    pub interp_pace_ms: u64,
    /// Timeout of every sandbox the bench creates, seconds (default: an hour on the
    /// server it starts, ten minutes, E2B's limit, on another one). A density run of
    /// thousands against `--url` needs more than ten minutes.
    #[arg(long, value_name = "SECS")]
    pub sandbox_timeout: Option<u64>,
}

#[derive(Clone)]
struct Ctx {
    api: Api,
    pool: String,
    /// Ready sandboxes per template the pool-on server is configured for.
    pool_size: usize,
    internet: bool,
    iterations: usize,
}

/// Before a row: with the pool on, waits (up to a minute) until `template`'s pool (with
/// shells, the shells) is full again and the previous rows' sandboxes are removed, so
/// every row starts from the same warm state whatever the previous row drained or left
/// to remove; then the pool counters, to compare with those after the row.
async fn before_row(cx: &Ctx, c: &mut Connection, template: &str) -> Option<(u64, u64, u64)> {
    let pool = match cx.pool.as_str() {
        "on" => Some(template),
        "shells" => Some(cubicle_node::SHELL_POOL),
        _ => None,
    };
    if let Some(pool) = pool {
        pool_filled(cx, c, pool, |_| Some(cx.pool_size as u64)).await;
    }
    cx.api.pool_counts(c).await
}

/// Waits (up to a minute) until `template`'s pool holds the number `level` reads from the
/// server's pool counters (`GET /cubicle/pool`) and no teardown is under way in the
/// background; returns that number.
async fn pool_filled(
    cx: &Ctx,
    c: &mut Connection,
    template: &str,
    level: impl Fn(&serde_json::Value) -> Option<u64>,
) -> Option<u64> {
    let t = Instant::now();
    loop {
        let v = cx.api.pool_json(c).await;
        let want = v.as_ref().and_then(&level);
        // An older server counts no teardowns.
        let teardowns = v
            .as_ref()
            .and_then(|v| v["teardowns"].as_u64())
            .unwrap_or(0);
        let ready = v.and_then(|v| v["ready"][template].as_u64());
        let filling = matches!((ready, want), (Some(r), Some(w)) if r < w);
        if !filling && teardowns == 0 {
            return want;
        }
        if t.elapsed() > Duration::from_secs(60) {
            eprintln!(
                "cubicle bench: after 60 s the {template} pool is at {ready:?} of {want:?}, \
                 {teardowns} teardown(s) under way"
            );
            return want;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn parse_network(s: &str) -> Result<serde_json::Value, String> {
    match serde_json::from_str::<serde_json::Value>(s) {
        Ok(v) if v.is_object() => Ok(v),
        _ => Err(format!("--network {s:?}: expected a JSON object")),
    }
}

pub async fn run(args: BenchArgs, envd: Option<&PathBuf>) -> anyhow::Result<i32> {
    // `egress` needs no server: run it first, alone if it is the only measure.
    if args.measures.iter().any(|m| m == "egress") {
        measure_egress(&args)?;
        if args.measures.len() == 1 {
            return Ok(0);
        }
    }
    let measures: Vec<String> = if args.measures.is_empty() {
        ["create", "cycle", "exec", "peer"]
            .map(String::from)
            .to_vec()
    } else {
        args.measures.clone()
    };
    let measures: Vec<String> = measures.into_iter().filter(|m| m != "egress").collect();
    for m in &measures {
        if !ALL_MEASURES.contains(&m.as_str()) {
            bail!("unknown measure {m:?} (known: {})", ALL_MEASURES.join(", "));
        }
    }
    let has = |m: &str| measures.iter().any(|x| x == m);
    let mut templates = vec![args.template.clone()];
    if has("create") || has("cycle") {
        for t in &args.also {
            if !t.is_empty() && !templates.contains(t) {
                templates.push(t.clone());
            }
        }
    }
    // The server the bench starts gets a statically linked envd, found the way `serve`
    // finds it, or refused: a dynamic one (what a plain `cargo build` makes) would run
    // in glibc templates with other memory figures, or not at all in busybox ones.
    let envd = match &args.url {
        Some(_) => None,
        None => Some(static_envd(envd)?),
    };
    let modes: Vec<String> = if args.url.is_some() {
        vec!["server".into()]
    } else {
        let mut m: Vec<String> = args
            .pool_modes
            .iter()
            .filter(|m| ["off", "on", "shells"].contains(&m.as_str()))
            .cloned()
            .collect();
        if m.is_empty() {
            bail!("--pool-modes takes off, on and/or shells");
        }
        // Only create/cycle/interp differ between modes.
        if !(has("create") || has("cycle") || has("interp")) {
            m.truncate(1);
        }
        m
    };
    if !args.json {
        print_header();
    }
    let mut cycle_c1: BTreeMap<String, f64> = BTreeMap::new();
    for (k, mode) in modes.iter().enumerate() {
        let (server, url, key) = match &args.url {
            Some(u) => {
                let key = args
                    .api_key
                    .clone()
                    .or_else(|| std::env::var("E2B_API_KEY").ok())
                    .ok_or_else(|| anyhow!("--url needs --api-key (or E2B_API_KEY)"))?;
                (None, u.clone(), key)
            }
            None => {
                let pool = (mode == "on").then_some(args.pool_size);
                let shells = (mode == "shells").then_some(args.pool_size);
                eprintln!(
                    "cubicle bench: starting `cubicle serve` on {} (warm pool {mode})",
                    args.server_state_dir.display()
                );
                let interp_pool = pool
                    .filter(|_| has("interp"))
                    .map(|_| args.interp_pool_size);
                // Room for what `density` holds next to the pools: a node's default of
                // 4,096 made `--n 6000` fail a third of its creates.
                let most = has("density").then(|| {
                    let pooled = pool.unwrap_or(0) * templates.len() + interp_pool.unwrap_or(0);
                    args.n + pooled + 64
                });
                let (s, u, k) = Server::start(
                    &args.server_state_dir,
                    envd.as_ref(),
                    &templates,
                    pool,
                    interp_pool,
                    shells,
                    most,
                )
                .await?;
                if let Some(n) = pool.or(shells) {
                    // Let the pool fill (about 20-40 ms per sandbox on 2 cores).
                    let wait = Duration::from_millis((n * templates.len()) as u64 * 60 + 1000);
                    tokio::time::sleep(wait).await;
                }
                (Some(s), u, k)
            }
        };
        let cx = Ctx {
            // Its own server allows an hour; another server ten minutes, E2B's limit
            // (`--sandbox-timeout` overrides both).
            api: Api::new(
                &url,
                key,
                args.network.clone(),
                args.sandbox_timeout.unwrap_or(if server.is_some() {
                    server::MAX_TIMEOUT_S
                } else {
                    600
                }),
            )?,
            pool: mode.clone(),
            pool_size: args.pool_size,
            internet: !args.no_internet,
            iterations: args.iterations.max(1),
        };
        eprintln!(
            "cubicle bench: server {url}, {} iterations per measure, internet {}; a 2-core shared machine is noisy",
            cx.iterations,
            if cx.internet { "on" } else { "off" }
        );
        let result = run_measures(&cx, &args, &measures, &templates, k == 0, &mut cycle_c1).await;

        // Whatever happened: kill what the bench left (it tags its sandboxes).
        let mut c = cx.api.conn();
        if let Ok(ids) = cx.api.list_ids(&mut c).await {
            for id in ids {
                let _ = cx.api.kill(&mut c, &id).await;
            }
        }
        if let Some(s) = server {
            s.stop().await;
        }
        result?;
    }
    if args.url.is_none() {
        release_quota_mount(&args.server_state_dir.join("sandboxes"));
    }
    if has("peer") {
        let rootfs = match &args.rootfs {
            Some(p) => p.clone(),
            None if args.url.is_none() => template_rootfs(&args.server_state_dir, &args.template)?,
            None => bail!("peer with --url needs --rootfs (the template's rootfs)"),
        };
        // Against Cubicle's c=1 closed-loop cycle (fastest pool mode) of this run, and
        // against the warm one (pool on, paced: the pool keeps up) when measured.
        let cub = cycle_c1
            .iter()
            .filter(|(k, _)| k.as_str() != "warm")
            .map(|(_, v)| *v)
            .fold(f64::INFINITY, f64::min);
        let cub = if cub.is_finite() { cub } else { 0.0 };
        let warm = cycle_c1.get("warm").copied();
        for r in measure_peer(&rootfs, args.iterations.max(1)).await? {
            let p50 = r.p50();
            let ratio = |c: f64| {
                if c > 0.0 {
                    (p50 / c * 100.0).round() / 100.0
                } else {
                    0.0
                }
            };
            let mut r = r
                .with("template", args.template.as_str())
                .with("cubicle_cycle_p50_ms", cub)
                .with("peer_over_cubicle", ratio(cub));
            if let Some(w) = warm {
                r = r
                    .with("cubicle_warm_cycle_p50_ms", w)
                    .with("peer_over_cubicle_warm", ratio(w));
            }
            print_row(&r, args.json);
        }
    }
    Ok(0)
}

/// The envd for the bench's server: `explicit` (`--envd-binary`, `CUBICLE_ENVD_BIN`) or the
/// one `serve` would find, if it is statically linked.
fn static_envd(explicit: Option<&PathBuf>) -> anyhow::Result<PathBuf> {
    let envd = cubicle_node::config::find_envd_binary(explicit.cloned())?;
    if !cubicle_node::config::is_static_elf(&envd) {
        bail!(
            "{} is not statically linked (a plain `cargo build` makes such a cubicle-envd); \
             build the agent with scripts/build-envd.sh --release and pass \
             target/x86_64-unknown-linux-gnu/release/cubicle-envd as --envd-binary",
            envd.display()
        );
    }
    Ok(envd)
}

async fn run_measures(
    cx: &Ctx,
    args: &BenchArgs,
    measures: &[String],
    templates: &[String],
    first_mode: bool,
    cycle_c1: &mut BTreeMap<String, f64>,
) -> anyhow::Result<()> {
    let emit = |r: &Row| print_row(r, args.json);
    // With a pool: how many of a row's creates were claims and how many found the pool
    // empty; of those, how many a refill under way served (the rest were made cold).
    let pool_counted =
        |r: Row, before: Option<(u64, u64, u64)>, after: Option<(u64, u64, u64)>| match (
            before, after,
        ) {
            (Some(b), Some(a)) if cx.pool != "off" => r
                .with("pool_claims", a.0.saturating_sub(b.0))
                .with("pool_misses", a.1.saturating_sub(b.1))
                .with("pool_waited", a.2.saturating_sub(b.2)),
            _ => r,
        };
    let mut pc = cx.api.conn();
    // Warm-up: first creates pay for page cache and lazy setup.
    {
        let mut c = cx.api.conn();
        for t in templates {
            for _ in 0..3 {
                let s = cx.api.create(&mut c, t, cx.internet).await?;
                cx.api.kill(&mut c, &s.id).await?;
            }
        }
    }
    let has = |m: &str| measures.iter().any(|x| x == m);
    if has("create") {
        for t in templates {
            for &conc in &args.concurrency {
                let b = before_row(cx, &mut pc, t).await;
                let r = measure_create(cx, t, conc, Duration::ZERO).await;
                emit(&pool_counted(r, b, cx.api.pool_counts(&mut pc).await));
                if conc == 1 && cx.pool == "on" {
                    // The same closed loop again once the pool adapted: the misses above
                    // raised the pool's target (the server's rule; for a minute without
                    // misses), and the refill fills it to that target first. A load the pool has seen
                    // is the one it is sized for; the row above is a fresh pool's.
                    let target =
                        pool_filled(cx, &mut pc, t, |v| v["target"][t.as_str()].as_u64()).await;
                    let b = cx.api.pool_counts(&mut pc).await;
                    let r = measure_create(cx, t, conc, Duration::ZERO).await;
                    let r = r.with("pool_adapted", true);
                    let r = match target {
                        Some(n) => r.with("pool_target", n),
                        None => r,
                    };
                    emit(&pool_counted(r, b, cx.api.pool_counts(&mut pc).await));
                }
                if conc == 1 && cx.pool == "on" && args.pace_ms > 0 {
                    // The closed loop above outruns the refill; this is the warm case.
                    let pace = Duration::from_millis(args.pace_ms);
                    let b = before_row(cx, &mut pc, t).await;
                    let r = measure_create(cx, t, conc, pace).await;
                    emit(&pool_counted(r, b, cx.api.pool_counts(&mut pc).await));
                }
            }
        }
    }
    if has("cycle") || (has("peer") && first_mode) {
        let ts: &[String] = if has("cycle") {
            templates
        } else {
            &templates[..1]
        };
        let concs: Vec<usize> = if has("cycle") {
            args.concurrency.clone()
        } else {
            vec![1]
        };
        for t in ts {
            for &conc in &concs {
                let b = before_row(cx, &mut pc, t).await;
                let r = measure_cycle(cx, t, conc, cx.iterations, Duration::ZERO).await;
                let r = pool_counted(r, b, cx.api.pool_counts(&mut pc).await);
                if conc == 1 && *t == args.template {
                    cycle_c1.insert(cx.pool.clone(), r.p50());
                }
                emit(&r);
                if conc == 1 && cx.pool == "on" && args.pace_ms > 0 {
                    let pace = Duration::from_millis(args.pace_ms);
                    let b = before_row(cx, &mut pc, t).await;
                    let r = measure_cycle(cx, t, conc, cx.iterations, pace).await;
                    let r = pool_counted(r, b, cx.api.pool_counts(&mut pc).await);
                    if *t == args.template {
                        cycle_c1.insert("warm".into(), r.p50());
                    }
                    emit(&r);
                }
            }
        }
    }
    if has("exec") && first_mode {
        emit(&measure_exec(cx, &args.template, 1).await?);
    }
    if has("density") && first_mode {
        for r in measure_density(cx, &args.template, args.n, Duration::from_secs(args.hold)).await?
        {
            emit(&r);
        }
    }
    if has("interp") {
        let pace = Duration::from_millis(args.interp_pace_ms);
        let pool_size = if cx.pool == "on" {
            args.interp_pool_size
        } else {
            cx.pool_size
        };
        let icx = Ctx {
            pool_size,
            ..cx.clone()
        };
        let b = before_row(&icx, &mut pc, interp::TEMPLATE).await;
        let r = interp::measure_first(&icx, pace).await;
        emit(&pool_counted(r, b, cx.api.pool_counts(&mut pc).await));
        if first_mode {
            emit(&interp::measure_run(cx).await?);
        }
    }
    if has("pause") && first_mode {
        for t in &args.pause_templates {
            for r in pause::measure(cx, t, cx.iterations).await? {
                emit(&r);
            }
        }
    }
    Ok(())
}
