//! `cubicle-interpreter`: E2B's code-interpreter API (port 49999) inside a sandbox, on
//! real Jupyter kernels: every kernelspec installed (ipykernel, bash_kernel, IRkernel,
//! jjava, …) plus Deno's built-in kernel for JavaScript and TypeScript.
//!
//! Default contexts for Python and JavaScript exist from the start; the kernels of the
//! languages in `--start-kernels` are started (and warmed) before the server listens,
//! the others at their context's first execution. The sandbox's env vars and the
//! caller's access token are checked with envd's `GET /envs` (see `server.rs`).
//!
//! Memory: with `--merge-memory` the interpreter asks the kernel (`PR_SET_MEMORY_MERGE`)
//! to let KSM merge identical pages of itself and of every kernel it starts (inherited
//! across fork and exec); the host decides whether KSM runs. Off by default: measured at
//! 200 idle sandboxes it saved about 0.5 MiB each (docs/bench.md), not worth ksmd's CPU.

mod envd;
mod error;
mod jupyter;
mod kernel;
mod output;
mod server;

use std::path::PathBuf;

use clap::Parser;

#[derive(Parser, Debug)]
#[command(version, about = "E2B-compatible code interpreter on Jupyter kernels")]
struct Args {
    /// Port to listen on.
    #[arg(long, default_value_t = 49999)]
    port: u16,
    /// Listen address.
    #[arg(long, default_value = "0.0.0.0")]
    listen: std::net::IpAddr,
    /// Python of the kernels' virtualenv: its `share/jupyter/kernels` is searched first.
    #[arg(long, default_value = "/opt/cubicle/venv/bin/python")]
    python: String,
    /// More kernelspec directories, searched after the virtualenv's.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "/usr/local/share/jupyter/kernels,/usr/share/jupyter/kernels"
    )]
    kernel_dirs: Vec<PathBuf>,
    /// Kernelspec names (directory names) that win their language over the others, e.g.
    /// `python3-ipykernel` for ipykernel instead of the template's `cubicle_kernel`.
    #[arg(long = "kernel", value_delimiter = ',')]
    kernels: Vec<String>,
    /// Deno binary for JavaScript/TypeScript kernels (ignored if missing).
    #[arg(long, default_value = "/usr/local/bin/deno")]
    deno: String,
    /// Default working directory of contexts.
    #[arg(long, default_value = "/home/user")]
    cwd: String,
    /// Languages whose default context's kernel starts before the server listens.
    #[arg(long, value_delimiter = ',', default_value = "python")]
    start_kernels: Vec<String>,
    /// envd's Unix socket (for `GET /envs`).
    #[arg(long, default_value = cubicle_proto::ENVD_SOCKET_IN_SANDBOX)]
    envd_socket: PathBuf,
    /// envd's TCP address, used when the socket is missing.
    #[arg(long, default_value_t = format!("127.0.0.1:{}", cubicle_proto::ENVD_PORT))]
    envd_addr: String,
    /// Let KSM merge identical pages of the interpreter and its kernels.
    #[arg(long)]
    merge_memory: bool,
}

/// `prctl(PR_SET_MEMORY_MERGE, 1)`: this process and its descendants' anonymous pages
/// become candidates for KSM.
fn enable_memory_merge() {
    const PR_SET_MEMORY_MERGE: libc::c_int = 67;
    // SAFETY: prctl with integer arguments only.
    let r = unsafe { libc::prctl(PR_SET_MEMORY_MERGE, 1 as libc::c_ulong, 0, 0, 0) };
    if r != 0 {
        tracing::warn!(
            "PR_SET_MEMORY_MERGE: {}; kernels' memory is not merged",
            std::io::Error::last_os_error()
        );
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    if args.merge_memory {
        enable_memory_merge();
    }
    let runtime_dir =
        std::env::temp_dir().join(format!("cubicle-interpreter-{}", std::process::id()));
    let mut dirs = Vec::new();
    if let Some(venv) = std::path::Path::new(&args.python)
        .parent()
        .and_then(|b| b.parent())
    {
        dirs.push(venv.join("share/jupyter/kernels"));
    }
    dirs.extend(args.kernel_dirs.iter().cloned());
    let deno = std::path::Path::new(&args.deno)
        .is_file()
        .then_some(args.deno.as_str());
    let launcher = kernel::Launcher::discover(&dirs, &args.kernels, deno, runtime_dir.clone());
    tracing::info!("kernels: {}", launcher.languages().join(", "));
    let cwd = if std::path::Path::new(&args.cwd).is_dir() {
        args.cwd.clone()
    } else {
        std::env::current_dir()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| "/".into())
    };
    let envd = envd::Envd {
        socket: Some(args.envd_socket.clone()),
        tcp: Some(args.envd_addr.clone()),
    };
    let app = server::App::new(launcher, cwd, envd);
    // E2B's default contexts, Python first, exist before we listen; /health then means
    // "ready to run".
    for lang in ["python", "javascript"] {
        if !app.launcher.specs.contains_key(lang) {
            continue;
        }
        let lazy = !args.start_kernels.iter().any(|l| l == lang);
        if let Err(e) = app.default_context(lang, lazy).await {
            tracing::error!("default {lang} context: {e}");
        }
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
