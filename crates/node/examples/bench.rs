//! Node benchmark (a command that prints numbers, for `cubicle bench` later):
//! cold create-to-envd-ready p50/p99 over N creates per template, and idle host memory
//! per sandbox with M sandboxes alive.
//!
//! `cargo run --release -p cubicle-node --example bench -- [--templates tiny,base]
//!  [--creates 200] [--idle 100] [--internet] [--state-dir DIR]` (as root; templates are
//!  built first).

use std::path::PathBuf;

use cubicle_node::{Node, NodeConfig, bench};

fn main() -> anyhow::Result<()> {
    cubicle_runtime::maybe_run_helper();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CUBICLE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut templates = vec!["tiny".to_string(), "base".to_string()];
    let mut creates = 200usize;
    let mut idle = 100usize;
    let mut internet = false;
    let mut state = cubicle_node::default_state_dir();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || {
            args.next()
                .ok_or_else(|| anyhow::anyhow!("{a} needs a value"))
        };
        match a.as_str() {
            "--templates" => templates = val()?.split(',').map(str::to_string).collect(),
            "--creates" => creates = val()?.parse()?,
            "--idle" => idle = val()?.parse()?,
            "--internet" => internet = true,
            "--state-dir" => state = PathBuf::from(val()?),
            other => anyhow::bail!("unknown argument {other}"),
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let envd = cubicle_node::config::find_envd_binary(None)?;
        let mut cfg = NodeConfig::new(&state, envd);
        cfg.template_progress = true;
        cfg.first_slot = 2000;
        cfg.any_free_slots = true;
        let node = Node::open(cfg).await?;
        for t in &templates {
            node.templates().ensure(t, true)?;
        }
        for t in &templates {
            if creates > 0 {
                let r = bench::create_latency(&node, t, creates, internet).await?;
                println!("{r}");
            }
        }
        for t in &templates {
            if idle > 0 {
                let r = bench::idle_memory(&node, t, idle).await?;
                println!("{r}");
            }
        }
        node.close();
        anyhow::Ok(())
    })
}
