//! `cubicle node list`: the cluster's nodes as the shared database records them (state,
//! fencing epoch, lease age, load, sandboxes), read straight from PostgreSQL — no
//! server needed. `cubicle node drain NAME`: no new placements on that node, and its
//! running sandboxes paused (through its node-side API). docs/cluster.md.

use anyhow::Context;
use clap::Subcommand;
use cubicle_store::{NodeRow, Store};

use crate::output::{self, FormatArg};

/// Node subcommands.
#[derive(Subcommand, Debug)]
pub enum NodeCommand {
    /// List the cluster's nodes: state, epoch, lease, load and sandboxes.
    List {
        /// The cluster's database (`postgres://USER@HOST/DATABASE`).
        #[arg(long, env = "CUBICLE_DATABASE", value_name = "URL")]
        database: String,
        #[command(flatten)]
        format: FormatArg,
    },
    /// Drain a node: no new sandboxes are placed on it, and its running sandboxes are
    /// paused (memory and processes kept; they stay listed, as paused).
    Drain {
        /// The node's name (as `cubicle node list` shows it).
        name: String,
        /// The cluster's database (`postgres://USER@HOST/DATABASE`).
        #[arg(long, env = "CUBICLE_DATABASE", value_name = "URL")]
        database: String,
        /// The cluster's node token (to ask the node to pause its sandboxes).
        #[arg(long, env = "CUBICLE_NODE_TOKEN_FILE", value_name = "FILE")]
        node_token_file: std::path::PathBuf,
        /// Undo a drain: the node takes new sandboxes again (paused ones stay paused).
        #[arg(long, conflicts_with = "migrate")]
        cancel: bool,
        /// Move the sandboxes away instead of pausing them in place: the node pauses each
        /// with its memory, publishes it to the object store and refuses resumes, so each
        /// resumes on another node at its next connect (the node needs `--object-store`;
        /// as `evacuate`, with the node found in the database).
        #[arg(long)]
        migrate: bool,
        /// How to reach a node that serves TLS (`--node-ca`, …), as the replicas do.
        #[command(flatten)]
        node_tls: crate::cluster_tls::NodeClientTls,
    },
    /// Drain a node with migration (by its address; `drain` marks it in the database):
    /// it pauses every sandbox with its memory and
    /// publishes it to the object store, and refuses resumes from then on, so each
    /// sandbox resumes on another node at its next connect (docs/cluster.md, "Moving
    /// sandboxes between nodes"). The node needs `--object-store`.
    Evacuate {
        /// The node's address (`http://HOST:PORT`, its `--listen`).
        #[arg(long, value_name = "URL")]
        node: String,
        /// File holding the cluster's node token.
        #[arg(long, env = "CUBICLE_NODE_TOKEN_FILE", value_name = "FILE")]
        node_token_file: std::path::PathBuf,
        /// How to reach a node that serves TLS (`--node-ca`, …), as the replicas do.
        #[command(flatten)]
        node_tls: crate::cluster_tls::NodeClientTls,
        #[command(flatten)]
        format: FormatArg,
    },
}

pub fn run(cmd: NodeCommand) -> anyhow::Result<i32> {
    match cmd {
        NodeCommand::List { database, format } => {
            let store = Store::open_url(&database).context("opening the cluster's database")?;
            let now = cubicle_store::now_ms();
            let nodes = store.nodes(now)?;
            if format.is_json() {
                let rows: Vec<serde_json::Value> = nodes.iter().map(|n| json(n, now)).collect();
                print!("{}", output::json(&rows)?);
            } else {
                print!("{}", table(&nodes, now));
            }
            Ok(0)
        }
        NodeCommand::Drain {
            name,
            database,
            node_token_file,
            cancel,
            migrate,
            node_tls,
        } => {
            let store = Store::open_url(&database).context("opening the cluster's database")?;
            if cancel {
                store.set_node_draining(&name, false)?;
                println!("node {name}: active (takes new sandboxes again)");
                return Ok(0);
            }
            let token = crate::node_serve::read_node_token(&node_token_file)?;
            if migrate {
                let report = tokio::runtime::Handle::current()
                    .block_on(cubicle_api::cluster::coordination::drain_migrating(
                        &store,
                        &name,
                        &token,
                        node_tls.config(&[])?,
                    ))
                    .map_err(|e| anyhow::anyhow!("draining node '{name}': {e}"))?;
                print_evacuation(&name, &report);
                return Ok(if report.failed.is_empty() { 0 } else { 1 });
            }
            // A blocking thread of the runtime (see main): the node calls run on it.
            let report = tokio::runtime::Handle::current()
                .block_on(cubicle_api::cluster::coordination::drain(
                    &store,
                    &name,
                    &token,
                    node_tls.config(&[])?,
                ))
                .map_err(|e| anyhow::anyhow!("draining node '{name}': {e}"))?;
            println!(
                "node {name}: draining (no new sandboxes); paused {}, already paused {}, failed {}",
                report.paused.len(),
                report.already_paused.len(),
                report.failed.len()
            );
            for (id, ms) in &report.paused {
                println!("  paused {id} ({ms} ms)");
            }
            for (id, why) in &report.failed {
                println!("  not paused {id}: {why}");
            }
            Ok(if report.failed.is_empty() { 0 } else { 1 })
        }
        NodeCommand::Evacuate {
            node,
            node_token_file,
            node_tls,
            format,
        } => {
            let token = crate::node_serve::read_node_token(&node_token_file)?;
            let tls = node_tls.config(std::slice::from_ref(&node))?;
            let report = tokio::runtime::Handle::current()
                .block_on(cubicle_api::cluster::moving_api::request_drain(
                    &node, &token, tls,
                ))
                .with_context(|| format!("draining node {node}"))?;
            if format.is_json() {
                print!("{}", output::json(&report)?);
            } else {
                print_evacuation(&node, &report);
            }
            Ok(if report.failed.is_empty() { 0 } else { 1 })
        }
    }
}

/// What a drain with migration did (`drain --migrate`, `evacuate`).
fn print_evacuation(node: &str, report: &cubicle_api::cluster::moving_api::DrainReport) {
    println!(
        "node {node} drains: {} paused, {} published, {} failed ({:.0} ms)",
        report.paused.len(),
        report.published.len(),
        report.failed.len(),
        report.took_ms
    );
    for (id, why) in &report.failed {
        println!("  {id}: {why}");
    }
}

fn json(n: &NodeRow, now: i64) -> serde_json::Value {
    serde_json::json!({
        "nodeID": n.id,
        "address": n.address,
        "state": n.state.as_str(),
        "epoch": n.epoch,
        "renewedMsAgo": now - n.renewed_at,
        "leaseExpiresInMs": n.lease_expires_at - now,
        "sandboxes": n.sandboxes,
        "maxSandboxes": n.capacity.max_sandboxes,
        "cpuUsed": n.cpu_used,
        "cpuCount": n.capacity.cpu_count,
        "memoryMBUsed": n.memory_mb_used,
        "memoryMB": n.capacity.memory_mb,
        "templates": n.templates,
        "poolState": n.pool_state,
    })
}

/// Seconds with one decimal (`2.5s`).
fn secs(ms: i64) -> String {
    format!("{:.1}s", ms as f64 / 1000.0)
}

fn table(nodes: &[NodeRow], now: i64) -> String {
    output::table(
        [
            "NODE",
            "STATE",
            "EPOCH",
            "RENEWED",
            "LEASE",
            "SANDBOXES",
            "CPU",
            "MEMORY MIB",
            "ADDRESS",
        ],
        nodes.iter().map(|n| {
            let left = n.lease_expires_at - now;
            [
                n.id.clone(),
                n.state.as_str().to_string(),
                n.epoch.to_string(),
                format!("{} ago", secs(now - n.renewed_at)),
                if left > 0 {
                    format!("{} left", secs(left))
                } else {
                    format!("expired {} ago", secs(-left))
                },
                format!("{}/{}", n.sandboxes, n.capacity.max_sandboxes),
                format!("{}/{}", n.cpu_used, n.capacity.cpu_count),
                format!("{}/{}", n.memory_mb_used, n.capacity.memory_mb),
                n.address.clone(),
            ]
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use cubicle_store::{NodeCapacity, NodeState};

    #[test]
    fn table_shows_state_lease_and_load() {
        let n = NodeRow {
            id: "n1".into(),
            address: "http://10.0.0.5:3001".into(),
            state: NodeState::Active,
            epoch: 3,
            capacity: NodeCapacity {
                cpu_count: 16,
                memory_mb: 32768,
                max_sandboxes: 100,
            },
            templates: vec!["base".into()],
            pool_state: serde_json::json!({}),
            registered_at: 0,
            renewed_at: 8_000,
            lease_expires_at: 18_000,
            lost_at: None,
            sandboxes: 4,
            cpu_used: 8,
            memory_mb_used: 2048,
        };
        let t = table(std::slice::from_ref(&n), 10_000);
        let line = t.lines().nth(1).unwrap();
        for want in [
            "n1",
            "active",
            "3",
            "2.0s ago",
            "8.0s left",
            "4/100",
            "8/16",
            "2048/32768",
        ] {
            assert!(line.contains(want), "{want} in {line}");
        }
        let t = table(&[n], 20_000);
        assert!(t.contains("expired 2.0s ago"), "{t}");
    }
}
