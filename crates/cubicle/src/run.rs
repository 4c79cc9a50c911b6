//! `cubicle run`: create a sandbox, run one command in it through envd (as root),
//! stream stdout/stderr live, exit with the command's exit code, destroy the sandbox
//! (unless `--keep`, which prints its id instead).

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
    };
    let info = node.create(req).await.context("creating the sandbox")?;
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
    node.close();
    if let Err(e) = result
        && code != 130
    {
        eprintln!("cubicle: running {:?}: {e:#}", args.command);
    }
    Ok(code)
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
