//! `cubicle`: the command-line interface.
//!
//! `cubicle run -- CMD…` runs one command in a fresh sandbox without a server;
//! `cubicle template …` builds, lists and removes templates; `cubicle sandbox …` drives
//! sandboxes of a running `cubicle serve` (module `client`); `cubicle local list|kill`
//! lists and kills sandboxes of the local state directory without a server. (`cubicle serve` and `cubicle bench`
//! come with their own issues.)
//!
//! The binary doubles as the runtime's sandbox helper: `cubicle-runtime` re-executes the
//! current binary to create a sandbox, so `main` hands over to it before anything else.

mod apikey_cmd;
mod bench;
mod client;
mod context;
mod run;
mod sandbox_cmd;
mod serve;
mod template_cmd;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// Cubicle: E2B-compatible sandboxes on your own machine.
#[derive(Parser)]
#[command(name = "cubicle", version, about)]
struct Cli {
    /// State directory (templates, sandboxes).
    #[arg(long, global = true, env = "CUBICLE_STATE_DIR", default_value = cubicle_node::config::DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    /// The `cubicle-envd` binary mounted into sandboxes (default: next to this binary).
    #[arg(long, global = true, env = "CUBICLE_ENVD_BIN")]
    envd_binary: Option<PathBuf>,
    /// First uid/network slot of this state directory's node: its sandboxes use slots
    /// FIRST..FIRST+MAX (host uids 200000 + slot*65536, veth cbs<slot>). Nodes on one
    /// host need disjoint ranges; an overlapping one is refused.
    #[arg(long, global = true, env = "CUBICLE_FIRST_SLOT", default_value_t = 0)]
    first_slot: u32,
    /// Most sandboxes of this node at once (the size of its slot range).
    #[arg(
        long,
        global = true,
        env = "CUBICLE_MAX_SANDBOXES",
        default_value_t = 4096
    )]
    max_sandboxes: u32,
    /// When the slot range overlaps another node's, take the next free one instead of
    /// failing (test harnesses that run side by side).
    #[arg(long, global = true, env = "CUBICLE_ANY_FREE_SLOTS", hide = true)]
    any_free_slots: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create a sandbox, run CMD in it (as root), stream its output, exit with its code.
    Run(run::RunArgs),
    /// Build, list and remove templates.
    Template {
        #[command(subcommand)]
        command: template_cmd::TemplateCommand,
    },
    /// Sandboxes of a running `cubicle serve` (REST API + router, as an E2B SDK uses them).
    Sandbox(client::SandboxArgs),
    /// Volumes of a running `cubicle serve`: create, list, delete, and their files.
    Volume(client::VolumeArgs),
    /// List and kill sandboxes of this state directory directly (no server).
    Local {
        #[command(subcommand)]
        command: sandbox_cmd::SandboxCommand,
    },
    /// Run the E2B-compatible server: REST API and data plane on one listener.
    Serve(serve::ServeArgs),
    /// Create, list and revoke API keys (in the state directory's database).
    Apikey {
        #[command(subcommand)]
        command: apikey_cmd::ApikeyCommand,
    },
    /// Measure create/cycle/exec latency, density and peers (runc, bwrap) against a
    /// server it starts (or `--url`).
    Bench(bench::BenchArgs),
    /// The guardian of a `cubicle run`'s sandbox (started by `run` itself).
    #[command(name = "__run-guard", hide = true)]
    RunGuard,
}

fn main() {
    // The runtime re-executes this binary as its sandbox helper: this must run before
    // anything else (no threads, no tokio yet).
    cubicle_runtime::maybe_run_helper();

    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CUBICLE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cubicle: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let code = rt.block_on(async {
        match dispatch(cli).await {
            Ok(code) => code,
            Err(e) => {
                eprintln!("cubicle: {e:#}");
                1
            }
        }
    });
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    std::process::exit(code);
}

fn node_opts(cli: &Cli) -> sandbox_cmd::NodeOpts {
    sandbox_cmd::NodeOpts {
        state_dir: cli.state_dir.clone(),
        envd_binary: cli.envd_binary.clone(),
        first_slot: cli.first_slot,
        max_sandboxes: cli.max_sandboxes,
        any_free_slots: cli.any_free_slots,
    }
}

async fn dispatch(cli: Cli) -> anyhow::Result<i32> {
    let opts = node_opts(&cli);
    match cli.command {
        Command::Run(args) => run::run(&opts, args).await,
        Command::RunGuard => run::guard(&opts).await,
        Command::Template { command } => template_cmd::run(&cli.state_dir, command).await,
        Command::Sandbox(args) => client::run(args, &cli.state_dir).await,
        Command::Volume(args) => client::run_volume(args, &cli.state_dir).await,
        Command::Local { command } => sandbox_cmd::run(&opts, command).await,
        Command::Serve(args) => serve::run(opts, args).await,
        Command::Bench(args) => bench::run(args, cli.envd_binary.as_ref()).await,
        Command::Apikey { command } => {
            let dir = cli.state_dir.clone();
            tokio::task::spawn_blocking(move || apikey_cmd::run(&dir, command)).await?
        }
    }
}
