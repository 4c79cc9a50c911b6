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
mod cluster_tls;
mod config;
mod context;
mod exit;
mod node_cmd;
mod node_lease;
mod node_serve;
mod output;
mod run;
mod sandbox_cmd;
mod sd_notify;
mod serve;
mod serve_cluster;
mod service_cmd;
mod template_cmd;

use std::path::PathBuf;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// Cubicle: E2B-compatible sandboxes on your own machine.
#[derive(Parser)]
#[command(name = "cubicle", version, about)]
struct Cli {
    /// Config file (TOML; flags and environment override it). Default:
    /// /etc/cubicle/config.toml when it exists.
    #[arg(long, global = true, env = "CUBICLE_CONFIG", value_name = "PATH")]
    config: Option<PathBuf>,
    /// Log lines as `text` (for people) or `json` (one object per line, for collectors).
    #[arg(long, global = true, env = "CUBICLE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// What to log (`info`, `warn`, `cubicle::access=warn,info`, …; tracing's filter
    /// syntax). Default: `info` for `serve`, `warn` otherwise.
    #[arg(long, global = true, env = "CUBICLE_LOG", value_name = "FILTER")]
    log_level: Option<String>,
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
        default_value_t = cubicle_node::config::DEFAULT_MAX_SANDBOXES
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
    /// Run one sandbox host of a cluster (no subcommand): a node serving the node-side
    /// API that API replicas (`cubicle serve --node http://HOST:PORT`) call; `list`: the
    /// cluster's nodes, from its database (docs/cluster.md).
    #[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
    Node(node_serve::NodeCli),
    /// Print the admin API key (no subcommand); create, list and revoke keys (in the
    /// state directory's database).
    Apikey {
        /// The database `cubicle serve --database` uses (default: `<state>/cubicle.db`).
        #[arg(long, env = "CUBICLE_DATABASE", value_name = "URL", global = true)]
        database: Option<String>,
        #[command(subcommand)]
        command: Option<apikey_cmd::ApikeyCommand>,
    },
    /// Install `cubicle serve` as a systemd service (sandboxes survive its restarts).
    Service {
        #[command(subcommand)]
        command: service_cmd::ServiceCommand,
    },
    /// Measure create/cycle/exec latency, density and peers (runc, bwrap) against a
    /// server it starts (or `--url`).
    Bench(bench::BenchArgs),
    /// The guardian of a `cubicle run`'s sandbox (started by `run` itself).
    #[command(name = "__run-guard", hide = true)]
    RunGuard,
    /// Print a shell completion script: `source <(cubicle completion bash)`, or save it
    /// (bash: /etc/bash_completion.d/cubicle; zsh: a `_cubicle` file on $fpath; fish:
    /// ~/.config/fish/completions/cubicle.fish).
    Completion {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

impl Command {
    /// Whether it passes on another program's exit code (so its own failures are 125).
    fn passes_on_exit_codes(&self) -> bool {
        match self {
            Command::Run(_) => true,
            Command::Sandbox(a) => matches!(
                a.command,
                client::SandboxCommand::Exec { .. } | client::SandboxCommand::Shell { .. }
            ),
            _ => false,
        }
    }

    /// Whether it works on the state directory itself (root's) rather than through a
    /// server.
    fn needs_root(&self) -> bool {
        match self {
            Command::Run(_)
            | Command::RunGuard
            | Command::Local { .. }
            | Command::Serve(_)
            | Command::Service { .. } => true,
            // Running a node does; `cubicle node list` reads the database.
            Command::Node(cli) => cli.command.is_none(),
            Command::Template { command } => {
                !matches!(command, template_cmd::TemplateCommand::List)
            }
            _ => false,
        }
    }
}

/// How log lines are written.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// `2026-01-01T00:00:00.000Z  INFO target: message key=value` (for people).
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `message` and the
    /// event's fields (for journald/Loki/Elasticsearch).
    Json,
}

/// Parses the command line merged with the config file (`config.rs`).
fn parse_cli() -> Cli {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let argv = match config::merge(Cli::command(), argv) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("cubicle: {e:#}");
            std::process::exit(2);
        }
    };
    // Bad arguments to a command that passes on exit codes are Cubicle's failure (125),
    // not a code the command could have returned (clap's is 2).
    let passes_on = argv
        .iter()
        .skip(1)
        .take_while(|a| *a != "--")
        .any(|a| a == "run" || a == "exec" || a == "shell");
    let parsed = Cli::command()
        .try_get_matches_from(argv)
        .and_then(|m| Cli::from_arg_matches(&m));
    match parsed {
        Ok(cli) => cli,
        Err(e) if e.use_stderr() && passes_on => {
            let _ = e.print();
            std::process::exit(exit::FAILED);
        }
        Err(e) => e.exit(),
    }
}

fn init_logging(cli: &Cli) {
    let default = if matches!(cli.command, Command::Serve(_) | Command::Node(_)) {
        "info"
    } else {
        "warn"
    };
    let filter = match &cli.log_level {
        Some(f) => tracing_subscriber::EnvFilter::try_new(f).unwrap_or_else(|e| {
            eprintln!("cubicle: --log-level/CUBICLE_LOG {f:?}: {e}; using {default}");
            tracing_subscriber::EnvFilter::new(default)
        }),
        None => tracing_subscriber::EnvFilter::new(default),
    };
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only for a terminal: not into a log file or the journal (where they
        // were escape codes in every line, and formatting them cost a share of a
        // request's CPU).
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match cli.log_format {
        LogFormat::Text => fmt.init(),
        LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .init(),
    }
}

fn main() {
    // The runtime (sandbox helper) and the checkpoint crate (restore helper) re-execute
    // this binary: this must run before anything else (no threads, no tokio yet).
    cubicle_checkpoint::maybe_run_helper();

    // Before any thread: a node holds descriptors per sandbox (see fd_limit.rs).
    let fd_limit = cubicle_runtime::fd_limit::raise_for_node();
    let cli = parse_cli();
    init_logging(&cli);
    check_fd_limit(&cli, fd_limit);
    check_pid_max(&cli);
    if matches!(
        cli.command,
        Command::Serve(_) | Command::Node(_) | Command::Bench(_)
    ) {
        // Still single-threaded: the table a server grows into, grown without the RCU
        // grace period each growth costs once threads share it (see presize_table).
        let slots = u64::from(cli.max_sandboxes) * 3 + 1024;
        if let Err(e) = cubicle_runtime::fd_limit::presize_table(slots) {
            tracing::debug!("cannot presize the descriptor table: {e}");
        }
    }
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
    let passes_on = cli.command.passes_on_exit_codes();
    let needs_root = cli.command.needs_root();
    let state_dir = cli.state_dir.clone();
    let code = rt.block_on(async {
        match dispatch(cli).await {
            Ok(code) => code,
            Err(e) => {
                eprintln!("cubicle: {}", exit::one_line(&e));
                if exit::is_permission_denied(&e) && !nix_is_root() {
                    eprintln!("{}", root_hint(needs_root, &state_dir));
                }
                exit::code_for(&e, passes_on)
            }
        }
    });
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    std::process::exit(code);
}

/// Says when the open-files limit is too low for this node's most sandboxes: each holds
/// two descriptors for its life (its init's pidfd, its init log's FIFO) and, while
/// used, a connection or two; plus the server's own.
fn check_fd_limit(cli: &Cli, limit: std::io::Result<cubicle_runtime::fd_limit::FdLimit>) {
    let needed = u64::from(cli.max_sandboxes) * 3 + 1024;
    match limit {
        Ok(l) if l.soft < needed && cli.command.needs_root() => tracing::warn!(
            "the open-files limit is {} (hard {}): fewer than the {needed} descriptors {} sandboxes need; raise it (ulimit -n, LimitNOFILE=) or lower --max-sandboxes",
            l.soft,
            l.hard,
            cli.max_sandboxes
        ),
        Ok(l) => tracing::debug!(soft = l.soft, hard = l.hard, "open-files limit"),
        Err(e) => tracing::warn!("cannot read or raise the open-files limit: {e}"),
    }
}

/// Says when the kernel's `pid_max` leaves too few process ids for this node's most
/// sandboxes: each holds at least one task (its envd) for its life, every process and
/// thread it starts takes another, and the host's own share the same space (32,768 by
/// default on small machines; 10,000 idle sandboxes then leave a host little headroom).
fn check_pid_max(cli: &Cli) {
    if !matches!(cli.command, Command::Serve(_) | Command::Node(_)) || !cli.command.needs_root() {
        return;
    }
    let needed = u64::from(cli.max_sandboxes) * 2 + 4096;
    match std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
    {
        Some(max) if max < needed => tracing::warn!(
            "kernel.pid_max is {max}: fewer than the {needed} process ids {} sandboxes and their commands need; raise it (sysctl -w kernel.pid_max=4194304) or lower --max-sandboxes",
            cli.max_sandboxes
        ),
        _ => {}
    }
}

fn nix_is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// What to do about a "permission denied" as another user than root.
fn root_hint(needs_root: bool, state_dir: &std::path::Path) -> String {
    let cmd: Vec<String> = std::env::args().skip(1).collect();
    if needs_root {
        format!(
            "cubicle: this needs root (sandboxes use namespaces and cgroups, and {} is root's): run it as root: sudo cubicle {}",
            state_dir.display(),
            cmd.join(" ")
        )
    } else {
        format!(
            "cubicle: {} is root's: run as root (sudo cubicle {}), or give the server's API key in E2B_API_KEY",
            state_dir.display(),
            cmd.join(" ")
        )
    }
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
    if cli.command.needs_root() && !nix_is_root() {
        anyhow::bail!(
            "{}",
            root_hint(true, &cli.state_dir).trim_start_matches("cubicle: ")
        );
    }
    match cli.command {
        Command::Completion { shell } => {
            // Into a buffer first: clap_complete panics on a write error (`| head`).
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "cubicle", &mut script);
            match std::io::Write::write_all(&mut std::io::stdout(), &script) {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    Err(anyhow::anyhow!("writing the completion script: {e}"))
                }
                _ => Ok(0),
            }
        }
        Command::Run(args) => run::run(&opts, args).await,
        Command::RunGuard => run::guard(&opts).await,
        Command::Template { command } => template_cmd::run(&cli.state_dir, command).await,
        Command::Sandbox(args) => client::run(args, &cli.state_dir).await,
        Command::Volume(args) => client::run_volume(args, &cli.state_dir).await,
        Command::Local { command } => sandbox_cmd::run(&opts, command).await,
        Command::Serve(args) => serve::run(opts, args, cli.log_format).await,
        Command::Node(cli) => match cli.command {
            None => node_serve::run(opts, cli.run).await,
            Some(command) => tokio::task::spawn_blocking(move || node_cmd::run(command)).await?,
        },
        Command::Service { command } => service_cmd::run(&cli.state_dir, command),
        Command::Bench(args) => bench::run(args, cli.envd_binary.as_ref()).await,
        Command::Apikey { database, command } => {
            let dir = cli.state_dir.clone();
            tokio::task::spawn_blocking(move || apikey_cmd::run(&dir, database.as_deref(), command))
                .await?
        }
    }
}
