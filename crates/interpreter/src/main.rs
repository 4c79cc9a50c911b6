//! `cubicle-interpreter`: E2B's code-interpreter API (port 49999) inside a sandbox, on
//! real Jupyter kernels (ipykernel for Python, bash_kernel for bash).
//!
//! The sandbox-global environment: at start it asks envd `GET /envs` on
//! `--envd-url` (token from `$CUBICLE_ENVD_ACCESS_TOKEN` if set); if envd is not
//! reachable there (Cubicle's node talks to envd over a Unix socket only) the
//! interpreter's own environment is used, which envd built from the same `/init` env
//! vars when it started the template's start command.

mod error;
mod jupyter;
mod kernel;
mod output;
mod server;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Parser, Debug)]
#[command(version, about = "E2B-compatible code interpreter on Jupyter kernels")]
struct Args {
    /// Port to listen on.
    #[arg(long, default_value_t = 49999)]
    port: u16,
    /// Listen address.
    #[arg(long, default_value = "0.0.0.0")]
    listen: std::net::IpAddr,
    /// Python with ipykernel (and bash_kernel).
    #[arg(long, default_value = "/opt/cubicle/venv/bin/python")]
    python: String,
    /// Deno binary for JavaScript/TypeScript kernels (ignored if missing).
    #[arg(long, default_value = "/usr/local/bin/deno")]
    deno: String,
    /// Default working directory of contexts.
    #[arg(long, default_value = "/home/user")]
    cwd: String,
    /// envd base URL for `GET /envs` (plain http on loopback).
    #[arg(long, default_value = "127.0.0.1:49983")]
    envd_addr: String,
}

/// `GET /envs` from envd, or `None`.
async fn fetch_envs(addr: &str) -> Option<BTreeMap<String, String>> {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        let mut req = format!("GET /envs HTTP/1.0\r\nHost: {addr}\r\n");
        if let Ok(t) = std::env::var("CUBICLE_ENVD_ACCESS_TOKEN") {
            req.push_str(&format!("X-Access-Token: {t}\r\n"));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf);
        let (head, body) = text.split_once("\r\n\r\n")?;
        if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
            return None;
        }
        serde_json::from_str(body).ok()
    };
    tokio::time::timeout(Duration::from_secs(2), fut)
        .await
        .ok()
        .flatten()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let global_env = match fetch_envs(&args.envd_addr).await {
        Some(e) => e,
        None => {
            tracing::info!("envd /envs not reachable; using the inherited environment");
            BTreeMap::new()
        }
    };
    let runtime_dir =
        std::env::temp_dir().join(format!("cubicle-interpreter-{}", std::process::id()));
    let launcher = kernel::Launcher {
        python: args.python.clone(),
        deno: std::path::Path::new(&args.deno)
            .is_file()
            .then(|| args.deno.clone()),
        runtime_dir: runtime_dir.clone(),
    };
    let cwd = if std::path::Path::new(&args.cwd).is_dir() {
        args.cwd.clone()
    } else {
        std::env::current_dir()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| "/".into())
    };
    let app = server::App::new(launcher, cwd, global_env);
    // The default Python context exists before we listen: /health means "ready to run".
    if let Err(e) = app.default_context("python").await {
        tracing::error!("default python context: {e}");
    }
    let listener = tokio::net::TcpListener::bind((args.listen, args.port)).await?;
    tracing::info!("listening on {}", listener.local_addr()?);
    // No Nagle: NDJSON lines are small writes that must not wait for delayed ACKs.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let serve = axum::serve(listener, server::router(app));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = serve => r?,
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    let _ = std::fs::remove_dir_all::<PathBuf>(runtime_dir);
    Ok(())
}
