//! `cubicle-envd`: the agent binary. See the crate documentation.

use std::{net::SocketAddr, path::PathBuf, sync::Arc};

use anyhow::Context as _;
use clap::Parser;
use cubicle_envd::{
    server::{self, AppState},
    state::{Config, Context},
};

/// The Cubicle sandbox agent (E2B envd compatible).
#[derive(Debug, Parser)]
#[command(name = "cubicle-envd", version)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0")]
    listen: std::net::IpAddr,
    /// TCP port to listen on (E2B's envd port).
    #[arg(long, default_value_t = cubicle_proto::ENVD_PORT)]
    port: u16,
    /// Also listen on this Unix socket (the node's way in).
    #[arg(long)]
    unix_socket: Option<PathBuf>,
    /// Also serve on this inherited, already listening Unix socket (in a sandbox the
    /// runtime creates it in the read-only ctl directory and passes it as fd 3).
    #[arg(long)]
    unix_socket_fd: Option<i32>,
    /// Do not listen on TCP at all (only on --unix-socket).
    #[arg(long)]
    no_tcp: bool,
    /// Development mode: run directly on a host for testing (the default user is the
    /// user envd runs as, unless --default-user is given).
    #[arg(long)]
    dev: bool,
    /// Act as PID 1 of a sandbox: reap orphaned zombies, end on SIGTERM/SIGINT/SIGHUP.
    #[arg(long)]
    init: bool,
    /// Default user for processes and files.
    #[arg(long)]
    default_user: Option<String>,
    /// Default working directory.
    #[arg(long)]
    default_workdir: Option<PathBuf>,
    /// Require this access token (normally set through POST /init).
    #[arg(long, env = "CUBICLE_ENVD_ACCESS_TOKEN", hide_env_values = true)]
    access_token: Option<String>,
    /// The sandbox's id, for its identity files (`identity.rs`), written at the start
    /// (normally by `POST /init`).
    #[arg(long, env = "CUBICLE_ENVD_SANDBOX_ID", hide = true)]
    sandbox_id: Option<String>,
    /// The sandbox's template, with --sandbox-id.
    #[arg(long, env = "CUBICLE_ENVD_TEMPLATE_ID", hide = true)]
    template_id: Option<String>,
    /// The sandbox-global environment (a JSON object), as `POST /init` sets it: given at
    /// the start, a create that asks for nothing else needs no `/init`.
    #[arg(
        long,
        env = "CUBICLE_ENVD_ENV_VARS",
        hide = true,
        hide_env_values = true
    )]
    env_vars: Option<String>,
    /// Run one file operation of a template build (JSON, see build_op.rs) and exit.
    #[arg(long, hide = true)]
    build_op: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(op) = &args.build_op {
        return cubicle_envd::build_op::run(op).map_err(anyhow::Error::msg);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CUBICLE_ENVD_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        // In a sandbox stderr is a pipe the node drains into the log the API serves: no
        // colour codes there.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        // That pipe is non-blocking and throttled by the node: a write it refuses loses
        // the line (reporting that on stderr would fail again, and panic).
        .log_internal_errors(false)
        .init();
    // Taken before anything else can open descriptors (and close-on-exec from here on,
    // so the processes envd starts do not inherit it).
    let inherited = args
        .unix_socket_fd
        .map(server::inherited_unix_listener)
        .transpose()
        .context("--unix-socket-fd")?;
    if !args.dev && args.sandbox_id.is_some() {
        cubicle_envd::identity::write(args.sandbox_id.as_deref(), args.template_id.as_deref());
    }
    let ctx = Arc::new(Context::new(Config {
        dev: args.dev,
        default_user: args.default_user.clone(),
        default_workdir: args.default_workdir.clone(),
        access_token: args.access_token.clone(),
    }));
    if let Some(json) = &args.env_vars {
        cubicle_envd::http::apply_birth_env(&ctx, json).map_err(anyhow::Error::msg)?;
    }
    // One thread: an idle sandbox's envd then costs one kernel stack and task, not three
    // (density); its work is I/O, and blocking file work goes to the blocking pool, whose
    // threads leave soon after use.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .thread_keep_alive(std::time::Duration::from_secs(2))
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let state = AppState::new(ctx);
        if args.init {
            // PID 1 of a sandbox: reap orphans, end on SIGTERM/SIGINT/SIGHUP.
            tokio::spawn(cubicle_envd::init::run());
        }
        let mut tasks = tokio::task::JoinSet::new();
        if let Some(listener) = inherited {
            let st = state.clone();
            tasks.spawn(async move { server::serve_unix_listener(st, listener).await });
        }
        if let Some(path) = args.unix_socket.clone() {
            let st = state.clone();
            tasks.spawn(async move { server::serve_unix(st, &path).await });
        }
        if !args.no_tcp {
            let addr = SocketAddr::new(args.listen, args.port);
            let st = state.clone();
            tasks.spawn(async move { server::serve_tcp(st, addr).await });
        }
        match tasks.join_next().await {
            Some(Ok(Err(e))) => Err(anyhow::Error::from(e).context("serving")),
            Some(Err(e)) => Err(anyhow::anyhow!("server task failed: {e}")),
            _ => Ok(()),
        }
    })
}
