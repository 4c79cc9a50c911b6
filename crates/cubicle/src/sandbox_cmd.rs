//! `cubicle local list|kill`: sandboxes of the local state directory, without a server
//! (opening the node reconciles first, so the list shows only live sandboxes). The
//! server client is `cubicle sandbox …` (module `client`).

use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;
use cubicle_node::{Node, NodeConfig};

use crate::template_cmd::format_utc;

/// Sandbox subcommands.
#[derive(Subcommand)]
pub enum SandboxCommand {
    /// List live sandboxes.
    List,
    /// Kill a sandbox and remove every trace of it.
    Kill {
        /// Sandbox id.
        id: String,
    },
}

/// Where and how the CLI opens its node (global options).
pub struct NodeOpts {
    pub state_dir: PathBuf,
    pub envd_binary: Option<PathBuf>,
    pub first_slot: u32,
    pub max_sandboxes: u32,
    pub any_free_slots: bool,
}

impl NodeOpts {
    /// The node configuration these options describe, with `envd`.
    pub fn config(&self, envd: PathBuf) -> NodeConfig {
        let mut config = NodeConfig::new(&self.state_dir, envd);
        config.first_slot = self.first_slot;
        config.max_sandboxes = self.max_sandboxes;
        config.any_free_slots = self.any_free_slots;
        config
    }
}

pub async fn open_node(opts: &NodeOpts, need_envd: bool) -> anyhow::Result<Node> {
    let state_dir = &opts.state_dir;
    let envd = match cubicle_node::config::find_envd_binary(opts.envd_binary.clone()) {
        Ok(p) => p,
        Err(e) if need_envd => return Err(e.into()),
        Err(_) => PathBuf::from("/nonexistent/cubicle-envd"),
    };
    let mut config = opts.config(envd);
    config.template_progress = true;
    Node::open(config)
        .await
        .with_context(|| format!("opening the node on {}", state_dir.display()))
}

pub async fn run(opts: &NodeOpts, cmd: SandboxCommand) -> anyhow::Result<i32> {
    let node = open_node(opts, false).await?;
    match cmd {
        SandboxCommand::List => {
            println!(
                "{:<22} {:<12} {:<9} {:>8} {:>10}  {:<19}  END (UTC)",
                "ID", "TEMPLATE", "STATE", "PID", "UID_BASE", "CREATED (UTC)"
            );
            for s in node.list() {
                println!(
                    "{:<22} {:<12} {:<9} {:>8} {:>10}  {:<19}  {}",
                    s.id,
                    s.template,
                    format!("{:?}", s.state).to_lowercase(),
                    s.pid.map(|p| p.to_string()).unwrap_or_default(),
                    s.uid_base,
                    format_utc(s.created_at_ms / 1000),
                    format_utc(s.end_at_ms / 1000)
                );
            }
        }
        SandboxCommand::Kill { id } => {
            node.kill(&id).await?;
            println!("killed {id}");
        }
    }
    node.stop().await;
    Ok(0)
}
