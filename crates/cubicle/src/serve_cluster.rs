//! `cubicle serve --database URL --node-token-file FILE` without `--node`: an API replica
//! coordinated through the cluster's database (`cubicle_api::cluster::coordination`):
//! the nodes registered there, placement by reservation, routing by ownership, lost
//! nodes expired and reported. docs/cluster.md, "Leases, placement and drain".

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use cubicle_api::ControlPlane;
use cubicle_api::cluster::{RemoteBackend, RemoteConfig};
use cubicle_router::RouterConfig;
use cubicle_store::Store;

use crate::serve::ServeArgs;

/// Opens the cluster's database and links the nodes registered there.
pub async fn connect(
    args: &ServeArgs,
    state_dir: &Path,
) -> anyhow::Result<(RemoteBackend, cubicle_router::Relay, Store)> {
    let Some(url) = args.database.clone() else {
        anyhow::bail!(
            "--node-token-file without --node makes an API replica that finds its nodes in the cluster's database: give --database postgres://… (or --node http://HOST:PORT,…)"
        );
    };
    let token_file = args
        .node_token_file
        .as_ref()
        .context("--node-token-file is needed")?;
    let token = crate::node_serve::read_node_token(token_file)?;
    crate::serve::create_state_dir(state_dir)?;
    let store = {
        let u = url.clone();
        tokio::task::spawn_blocking(move || Store::open_url(&u))
            .await
            .context("store task")?
            .with_context(|| {
                format!(
                    "opening the database {}",
                    crate::serve::redact_password(&url)
                )
            })?
    };
    // TLS to the nodes when --node-ca (or a client certificate) is given: the nodes'
    // addresses come from the database, so the options decide the scheme.
    let node_tls = args.node_tls.config(&[])?;
    let mut cfg = RemoteConfig::new(Vec::new(), token.clone());
    cfg.tls = node_tls.clone();
    cfg.log_dir = state_dir.join("node-logs");
    let remote = RemoteBackend::connect_cluster(cfg, store.clone())
        .await
        .map_err(|e| anyhow::anyhow!("reading the cluster's nodes: {e}"))?;
    let nodes = remote.cluster_nodes();
    if nodes.is_empty() {
        tracing::warn!(
            "no node has registered in the cluster's database yet: creates fail until one does (`cubicle node --database …`)"
        );
    }
    for n in nodes {
        tracing::info!(node = %n.id, address = %n.address, state = n.state.as_str(), epoch = n.epoch, "cluster node");
    }
    let relay =
        cubicle_router::Relay::with_tls(&token, &RouterConfig::default(), node_tls.as_ref())
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok((remote, relay, store))
}

/// Starts the coordination of a replica over the cluster's database (`None` for a
/// replica with `--node` addresses).
pub fn start(
    remote: &RemoteBackend,
    cp: &Arc<ControlPlane>,
) -> Option<tokio::task::JoinHandle<()>> {
    if !remote.is_coordinated() {
        return None;
    }
    cp.set_shared();
    Some(cubicle_api::cluster::coordination::spawn(
        remote.clone(),
        Arc::downgrade(cp),
    ))
}
