//! `cubicle node`: one sandbox host of a cluster. Runs a node (runtime, warm pools,
//! templates, network) and serves the node-side API (`cubicle_api::cluster::node_api`)
//! that API replicas (`cubicle serve --node http://HOST:PORT`) call: the `Backend`
//! operations under `/node/v1/`, and the node's end of the data plane (relayed SDK
//! requests enter the sandbox through the same router as in `cubicle serve`).
//!
//! Every caller must present the cluster's node token (`--node-token-file`, the same file
//! on replicas and nodes): `Authorization: Bearer` on the API, `cubicle-node-token` on
//! relayed data-plane requests. Plain HTTP/1.1 on a private network, or TLS (optionally
//! mutual) with `--tls-cert/--tls-key[/--tls-client-ca]` (`crate::cluster_tls`). See
//! docs/cluster.md, "Roles" and "Deploying".
//!
//! Prints `cubicle node: ready on http://ADDR` (`https://` with TLS) to stdout when it
//! serves.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use cubicle_node::Node;
use cubicle_router::{DataPlane, RouterConfig};

use crate::serve::{DEFAULT_TEMPLATES, NetworkArgs, warm_pools};

/// `cubicle node`: run the node (no subcommand), or a subcommand about the cluster's
/// nodes (`crate::node_cmd`: `list`).
#[derive(clap::Args, Debug)]
pub struct NodeCli {
    #[command(subcommand)]
    pub command: Option<crate::node_cmd::NodeCommand>,
    #[command(flatten)]
    pub run: NodeArgs,
}

/// `cubicle node` options.
#[derive(clap::Args, Debug)]
pub struct NodeArgs {
    /// Address of the node-side API (replicas connect here; keep it on a private network).
    #[arg(
        long,
        env = "CUBICLE_NODE_LISTEN",
        default_value = "127.0.0.1:3100",
        value_name = "ADDR:PORT"
    )]
    pub listen: SocketAddr,
    /// File holding the cluster's node token (at least 32 characters; the same file on
    /// every replica and node), e.g. made with `head -c 32 /dev/urandom | base64`.
    #[arg(long, env = "CUBICLE_NODE_TOKEN_FILE", value_name = "FILE")]
    pub node_token_file: PathBuf,
    /// Timeout of sandboxes whose create names none, in seconds.
    #[arg(long, default_value_t = 300, value_name = "SECS")]
    pub default_timeout: u64,
    /// Do not build the default templates (tiny, base) before reporting ready.
    #[arg(long)]
    pub no_build_templates: bool,
    /// Warm pools, e.g. `tiny=4,base=8` (as `cubicle serve --pool`).
    #[arg(long, env = "CUBICLE_POOL", value_name = "TEMPLATE=N,…",
          value_parser = cubicle_node::parse_pool_spec)]
    pub pool: Option<BTreeMap<String, usize>>,
    /// Shells kept ready: sandboxes of no template yet, made ahead (namespaces, cgroup,
    /// network, envd running); a create that finds no pooled sandbox of its template
    /// takes one and only gets its template's root (see `docs/node.md`). Default: one
    /// per 2 GiB of host memory (1 to 16); 0: none.
    #[arg(long, env = "CUBICLE_SHELLS", value_name = "N")]
    pub shells: Option<usize>,
    /// Host memory all pooled sandboxes together may use, in MiB.
    #[arg(
        long,
        env = "CUBICLE_POOL_MEMORY_MB",
        default_value_t = 1024,
        value_name = "MIB"
    )]
    pub pool_memory_mb: u64,
    /// Object store shared by the cluster's nodes (`s3://bucket/prefix` with the AWS_*
    /// environment variables, or `file:///dir`): templates and snapshots this node lacks
    /// come from there, and every sandbox it pauses is published there so that another
    /// node can resume it (docs/cluster.md, "Moving sandboxes between nodes").
    #[arg(long, env = "CUBICLE_OBJECT_STORE", value_name = "URL")]
    pub object_store: Option<String>,
    /// Registries of the template builds replicas send here (`FROM` an image).
    #[command(flatten)]
    pub registries: crate::serve::RegistryArgs,
    #[command(flatten)]
    pub network: NetworkArgs,
    #[command(flatten)]
    pub tls: crate::cluster_tls::NodeListenTls,
    /// Membership of a cluster through its database (`--database`, `--advertise`, …).
    #[command(flatten)]
    pub cluster: crate::node_lease::LeaseArgs,
}

/// Reads the node token from `path` (trimmed; refused when short).
pub fn read_node_token(path: &Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the node token from {}", path.display()))?;
    let token = text.trim().to_string();
    if token.len() < 32 || token.bytes().any(|b| !b.is_ascii_graphic()) {
        anyhow::bail!(
            "the node token in {} must be at least 32 printable characters without spaces (e.g. `head -c 32 /dev/urandom | base64 > {}`)",
            path.display(),
            path.display()
        );
    }
    Ok(token)
}

pub async fn run(env: crate::sandbox_cmd::NodeOpts, args: NodeArgs) -> anyhow::Result<i32> {
    let token = read_node_token(&args.node_token_file)?;
    let tls = args.tls.acceptor()?;
    let state_dir = &env.state_dir;
    let envd = cubicle_node::config::find_envd_binary(env.envd_binary.clone())?;
    let mut config = env.config(envd);
    config.default_timeout = Duration::from_secs(args.default_timeout.max(1));
    config.pool = warm_pools(
        args.pool.as_ref(),
        args.shells,
        args.no_build_templates,
        state_dir,
    );
    config.pool_memory_mb = args.pool_memory_mb;
    config.network = args.network.options();
    config.async_teardown = true;
    config.recycle_quota_dirs = cubicle_node::config::SERVE_RECYCLED_QUOTA_DIRS;
    let node = Node::open(config)
        .await
        .with_context(|| format!("opening the node on {}", state_dir.display()))?;
    tracing::info!(report = ?node.reconcile_report(), "node reconciled");
    if let Some(url) = &args.object_store {
        set_object_store(&node, url).await?;
    }
    if !args.no_build_templates {
        for name in DEFAULT_TEMPLATES {
            let store = node.templates().clone();
            if store.get(name)?.is_none() && !pulled_from_object_store(&node, name).await {
                tracing::info!("building template '{name}' (first start only)…");
                let n = name.to_string();
                tokio::task::spawn_blocking(move || store.ensure(&n, true))
                    .await
                    .context("template build task")??;
                publish_in_background(&node, name);
            }
        }
    }

    let dp = DataPlane::new(
        Arc::new(cubicle_api::cluster::NodeResolver::new(node.clone())),
        RouterConfig::default(),
    );
    {
        let dp = dp.clone();
        node.on_checkpoint(Box::new(move |id: &str| {
            let n = dp.disconnect(id);
            tracing::debug!(sandbox = %id, connections = n, "closed the router's connections");
        }));
    }
    // The builder API for replicas (templates built through a replica run here).
    let builder = cubicle_api::cluster::templates::node_control_plane(
        &node,
        &token,
        args.registries.options()?,
    )
    .await
    .map_err(|e| anyhow::anyhow!("the node's builder API: {e}"))?;
    let app = cubicle_api::cluster::node_router_with(
        node.clone(),
        dp,
        &token,
        cubicle_api::cluster::templates::node_routes(builder, node.clone()),
    );
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let addr = listener.local_addr()?;
    // With --database: registered (and its own sandboxes adopted) before it says ready.
    let lease = crate::node_lease::join(&node, &args.cluster, addr).await?;
    {
        let mut out = std::io::stdout().lock();
        let scheme = if tls.is_some() { "https" } else { "http" };
        writeln!(out, "cubicle node: ready on {scheme}://{addr}")?;
        out.flush()?;
    }
    tracing::info!(listen = %addr, tls = tls.is_some(), state_dir = %state_dir.display(), "serving the node-side API");
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let server = cubicle_router::server::serve(
        listener,
        app,
        cubicle_router::ServerLimits {
            // Replicas multiplex many clients over their connections to a node.
            max_connections_per_client: 1 << 16,
            ..Default::default()
        },
        tls,
        async move {
            let _ = stop_rx.changed().await;
        },
    );
    let mut server = std::pin::pin!(server);
    crate::sd_notify::notify("READY=1\nSTATUS=serving");
    tokio::select! {
        () = &mut server => {}
        sig = crate::serve::shutdown_signal() => {
            tracing::info!("{sig}: stopping (sandboxes keep running; the next start adopts them)");
            let _ = stop_tx.send(true);
            let _ = tokio::time::timeout(Duration::from_secs(5), &mut server).await;
        }
    }
    if let Some(lease) = lease {
        // The lease runs out by itself: the cluster declares the node lost unless it
        // comes back (and adopts its sandboxes) first.
        lease.stop(Duration::from_secs(10)).await;
    }
    node.stop().await;
    Ok(0)
}

/// Uses the object store at `url` (paused sandboxes are published at pause), and
/// releases the paused sandboxes that moved to other nodes while this one was away.
async fn set_object_store(node: &Node, url: &str) -> anyhow::Result<()> {
    let bucket = cubicle_node::objstore::Bucket::open(url)?;
    node.set_object_store(cubicle_node::ObjectStoreConfig {
        bucket,
        publish_snapshots: false,
        publish_paused: true,
    });
    let released = node.release_moved_away().await;
    tracing::info!(object_store = %url, identity = %node.identity()?, released = ?released,
        "object store set");
    Ok(())
}

/// With an object store: a default template the bucket has is pulled rather than built
/// (the cluster's nodes then share its layers, and paused sandboxes move without it).
async fn pulled_from_object_store(node: &Node, name: &str) -> bool {
    if node.object_store().is_none() {
        return false;
    }
    match node.pull_template(name).await {
        Ok(r) => {
            tracing::info!(
                template = name,
                bytes = r.bytes_moved,
                took_ms = r.took.as_millis() as u64,
                "template pulled from the object store"
            );
            true
        }
        Err(cubicle_node::Error::NotPublished(_)) => false,
        Err(e) => {
            tracing::warn!(
                template = name,
                "pulling the template failed (building it): {e}"
            );
            false
        }
    }
}

/// With an object store: a template this node built is published for the other nodes, in
/// the background (a failure is logged; they build their own).
fn publish_in_background(node: &Node, name: &str) {
    if node.object_store().is_none() {
        return;
    }
    let (node, name) = (node.clone(), name.to_string());
    tokio::spawn(async move {
        match node.push_template(&name).await {
            Ok(r) => tracing::info!(template = %name, bytes = r.bytes_moved,
                took_ms = r.took.as_millis() as u64, "template published to the object store"),
            Err(e) => tracing::warn!(template = %name, "publishing the template failed: {e}"),
        }
    });
}
