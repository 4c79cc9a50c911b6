//! `cubicle run`: create a sandbox, run one command in it through envd (as root),
//! stream stdout/stderr live, exit with the command's exit code, destroy the sandbox
//! (unless `--keep`, which prints its id instead).
//!
//! The sandbox of a run without `--keep` dies with the run, however the run ends: a
//! guardian process (this binary again, `__run-guard`, in its own process group so a
//! terminal's Ctrl-C or hang-up does not reach it) holds the read end of a pipe whose
//! write end only the run has. The run tells it the sandbox's id once created and `done`
//! once it removed the sandbox itself. When the pipe closes without `done` — the run was
//! killed (SIGKILL included), crashed or lost its terminal — the guardian kills every
//! process of the sandbox at once, then opens the node on the state directory, whose
//! reconciliation removes what is left (directory, quota, network, a half-made sandbox).

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use cubicle_node::{CreateRequest, ProcessEvent, ProcessSpec};

/// Arguments of `cubicle run`.
#[derive(Args)]
pub struct RunArgs {
    /// Template (`base` is built on first use).
    #[arg(long, short, default_value = "base")]
    template: String,
    /// Memory limit in MiB (default: the template's, 512).
    #[arg(long)]
    memory_mb: Option<u64>,
    /// vCPUs (default: the template's, 2).
    #[arg(long)]
    cpus: Option<u32>,
    /// Disk quota of the writable layer in MiB (default: the template's, 5120).
    #[arg(long)]
    disk_mb: Option<u64>,
    /// Loopback only: no veth, no route out.
    #[arg(long)]
    no_internet: bool,
    /// Keep the sandbox after the command and print its id (on stdout, last line).
    #[arg(long)]
    keep: bool,
    /// Sandbox lifetime in seconds (enforced by any node running on this state dir).
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// User to run CMD as inside the sandbox.
    #[arg(long, default_value = "root")]
    user: String,
    /// Environment variable for the sandbox (KEY=VALUE), repeatable.
    #[arg(long = "env", short = 'e', value_name = "KEY=VALUE")]
    env: Vec<String>,
    /// Print create-to-ready timing on stderr.
    #[arg(long)]
    verbose: bool,
    /// The command and its arguments (PATH is searched inside the sandbox).
    #[arg(last = true, required = true, num_args = 1..)]
    command: Vec<String>,
}

pub async fn run(opts: &crate::sandbox_cmd::NodeOpts, args: RunArgs) -> anyhow::Result<i32> {
    let mut env_vars = BTreeMap::new();
    for kv in &args.env {
        let Some((k, v)) = kv.split_once('=') else {
            bail!("--env {kv:?}: expected KEY=VALUE")
        };
        env_vars.insert(k.to_string(), v.to_string());
    }
    let node = crate::sandbox_cmd::open_node(opts, true).await?;
    // Before the create: a run killed while creating leaves no sandbox either.
    let mut guard = if args.keep {
        None
    } else {
        Some(Guardian::start(opts).context("starting the sandbox's guardian")?)
    };
    let req = CreateRequest {
        template: args.template.clone(),
        id: None,
        env_vars,
        memory_mb: args.memory_mb,
        cpus: args.cpus,
        disk_mb: args.disk_mb,
        internet: !args.no_internet,
        timeout: Some(Duration::from_secs(args.timeout)),
        metadata: BTreeMap::new(),
        ..Default::default()
    };
    let info = node.create(req).await.context("creating the sandbox")?;
    if let Some(g) = &mut guard {
        g.tell(&format!("sandbox {}", info.id));
    }
    if args.verbose {
        eprintln!(
            "sandbox {} ready in {:.2} ms",
            info.id,
            info.ready_us as f64 / 1000.0
        );
    }
    let client = node.envd(&info.id)?;
    // `sh -c 'exec "$@"'` gives PATH lookup inside the sandbox and keeps argv intact.
    let mut sh_args = vec![
        "-c".to_string(),
        "exec \"$@\"".to_string(),
        "sh".to_string(),
    ];
    sh_args.extend(args.command.iter().cloned());
    let spec = ProcessSpec {
        cmd: "/bin/sh".into(),
        args: sh_args,
        user: Some(args.user.clone()),
        ..Default::default()
    };
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let mut stdout = std::io::stdout();
    let mut stderr = std::io::stderr();
    let result = tokio::select! {
        r = client.run(&spec, |ev| match ev {
            ProcessEvent::Stdout(b) => { let _ = stdout.write_all(&b); let _ = stdout.flush(); }
            ProcessEvent::Stderr(b) => { let _ = stderr.write_all(&b); let _ = stderr.flush(); }
            ProcessEvent::Start(_) => {}
        }) => r.map_err(anyhow::Error::from),
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
        _ = sigterm.recv() => Err(anyhow::anyhow!("interrupted")),
    };
    let code = match &result {
        Ok(end) if end.exited => end.exit_code,
        Ok(end) => 128 + signal_number(&end.status),
        Err(e) if e.to_string() == "interrupted" => 130,
        Err(_) => 1,
    };
    if args.keep {
        println!("{}", info.id);
    } else if let Err(e) = node.kill(&info.id).await {
        eprintln!("cubicle: removing sandbox {}: {e}", info.id);
    }
    node.stop().await;
    if let Some(g) = &mut guard {
        g.tell("done");
    }
    if let Err(e) = result
        && code != 130
    {
        eprintln!("cubicle: running {:?}: {e:#}", args.command);
    }
    Ok(code)
}

/// The run's end of the pipe to its sandbox's guardian (see the module docs).
struct Guardian {
    pipe: std::process::ChildStdin,
}

impl Guardian {
    /// Starts the guardian for a node with these options.
    fn start(opts: &crate::sandbox_cmd::NodeOpts) -> anyhow::Result<Guardian> {
        use std::os::unix::process::CommandExt;
        let mut cmd = std::process::Command::new("/proc/self/exe");
        cmd.arg("--state-dir")
            .arg(&opts.state_dir)
            .args(["--first-slot", &opts.first_slot.to_string()])
            .args(["--max-sandboxes", &opts.max_sandboxes.to_string()]);
        if opts.any_free_slots {
            cmd.arg("--any-free-slots");
        }
        if let Some(e) = &opts.envd_binary {
            cmd.arg("--envd-binary").arg(e);
        }
        let mut child = cmd
            .arg(GUARD_COMMAND)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .process_group(0)
            .spawn()?;
        let pipe = child
            .stdin
            .take()
            .ok_or_else(|| anyhow::anyhow!("the guardian has no stdin"))?;
        Ok(Guardian { pipe })
    }

    /// One line to the guardian (best effort: it is only needed if this process dies).
    fn tell(&mut self, line: &str) {
        let _ = writeln!(self.pipe, "{line}");
    }
}

/// The hidden subcommand the guardian runs as.
pub const GUARD_COMMAND: &str = "__run-guard";

/// The guardian (see the module docs): waits for its run; if the run ends without
/// saying `done`, kills the run's sandbox and reconciles the state directory.
pub async fn guard(opts: &crate::sandbox_cmd::NodeOpts) -> anyhow::Result<i32> {
    let lines = tokio::task::spawn_blocking(|| {
        let mut lines = Vec::new();
        for line in std::io::stdin().lines() {
            match line {
                Ok(l) => lines.push(l),
                Err(_) => break,
            }
        }
        lines
    })
    .await?;
    if lines.iter().any(|l| l == "done") {
        return Ok(0);
    }
    let id = lines
        .iter()
        .find_map(|l| l.strip_prefix("sandbox "))
        .filter(|id| cubicle_node::SandboxId::is_valid(id));
    if let Some(id) = id {
        // Dead now: every process of its cgroup (the init first, so the pid namespace
        // ends); the rest is reconciliation's.
        let id2 = id.to_string();
        let _ = tokio::task::spawn_blocking(move || cubicle_runtime::remove_leftovers(&id2, None))
            .await;
    }
    let envd = cubicle_node::config::find_envd_binary(opts.envd_binary.clone())
        .unwrap_or_else(|_| std::path::PathBuf::from("/nonexistent/cubicle-envd"));
    let mut config = opts.config(envd);
    // The run that held the state directory is gone; another command may hold it now.
    config.wait_for_lock = true;
    let node = cubicle_node::Node::open(config).await?;
    if let Some(id) = id
        && node
            .get(id)
            .is_ok_and(|i| i.state != cubicle_node::SandboxState::Dead)
    {
        let _ = node.kill(id).await;
    }
    node.stop().await;
    Ok(0)
}

/// Signal number from Go-style status strings (`signal: killed`).
fn signal_number(status: &str) -> i32 {
    match status.trim_start_matches("signal: ") {
        "hangup" => 1,
        "interrupt" => 2,
        "quit" => 3,
        "aborted" => 6,
        "killed" => 9,
        "segmentation fault" => 11,
        "broken pipe" => 13,
        "terminated" => 15,
        _ => 9,
    }
}
