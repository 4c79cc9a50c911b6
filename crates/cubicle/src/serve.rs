//! `cubicle serve`: the whole service in one process on one listener — the E2B REST
//! control plane (`cubicle-api`) and the data plane (`cubicle-router`), dispatched per
//! request (`DataPlane::wants`: routing headers, `<port>-<id>.<domain>` hosts, presigned
//! `/files` URLs go to sandboxes; everything else is REST).
//!
//! Start-up, in order: open the node (reconciling sandboxes a previous run left: live
//! ones are adopted), build missing default templates (`tiny`, `base`) with a progress
//! bar, open the store, make sure an admin team and key exist, then print (stdout,
//! nothing else goes there):
//!
//! ```text
//! export E2B_API_URL=http://HOST:PORT        (https:// with --tls-cert/--tls-key)
//! export E2B_SANDBOX_URL=http://HOST:PORT
//! export E2B_VOLUME_API_URL=http://HOST:PORT
//! export E2B_API_KEY=e2b_…                   (only when just created, or to a terminal)
//! cubicle: ready
//! ```
//!
//! and tell systemd it is ready (`READY=1`, when started as a `Type=notify` unit).
//!
//! The admin key's plaintext is kept in `<state>/admin-api-key` (mode 0600): `cubicle
//! apikey` prints it. The server prints it itself only on the start that created it, or
//! when stdout is a terminal — never into a log or journal on later starts. Whoever can
//! read that file is admin — the same trust as root on the state directory, which can do
//! anything to the sandboxes anyway. Revoke it with `cubicle apikey revoke`; the next
//! start makes a new one.
//!
//! Every request (REST and data plane) passes the observation layer first
//! (`cubicle_api::telemetry::http`): a request id, an access-log line, the metrics. The
//! metrics are at `GET /metrics` for admin keys, and without a key on `--metrics-listen`
//! (a separate address, e.g. loopback for a local Prometheus).
//!
//! Connections (`cubicle_router::server`): at most `--max-connections-per-client` per
//! client address and half the open-file limit in all, request heads within 30 s; TLS
//! (rustls) when `--tls-cert`/`--tls-key` are given.
//!
//! SIGTERM/SIGINT: stop accepting, give open requests 5 s, stop the node's background
//! work and exit. Sandboxes keep running (their end times still hold: the next start
//! adopts them and enforces them).

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::extract::Request;
use axum::middleware::Next;
use cubicle_api::telemetry::http::{RouteLabel, SandboxLabel, dataplane_route};
use cubicle_api::{ApiConfig, ApiResolver, ControlPlane};
use cubicle_node::Node;
use cubicle_router::{DataPlane, RouterConfig};
use cubicle_store::Store;

/// File (in the state directory) holding the admin API key's plaintext.
pub const ADMIN_KEY_FILE: &str = "admin-api-key";
/// File (in the state directory) holding the server's key when `--secrets-key-file`
/// names none.
pub const SECRETS_KEY_FILE: &str = "secrets.key";
/// Team of the key created on first start.
pub const ADMIN_TEAM: &str = cubicle_api::ADMIN_TEAM;
/// Templates built before the server reports ready.
pub const DEFAULT_TEMPLATES: &[&str] = &["tiny", "base"];

/// `cubicle serve` options.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on (REST API and data plane share it).
    #[arg(
        long,
        env = "CUBICLE_LISTEN",
        default_value = "127.0.0.1:3000",
        value_name = "ADDR:PORT"
    )]
    pub listen: SocketAddr,
    /// Domain for host-based routing (`<port>-<id>.<domain>`; `DOMAIN[:PORT]`, the port
    /// being the one clients connect to), returned to SDKs as the sandboxes' `domain`, so
    /// that `get_host(port)` names it. Default: `localhost:<listen port>` (names under
    /// `localhost` resolve to this machine's loopback).
    #[arg(long, env = "CUBICLE_DOMAIN", value_name = "DOMAIN[:PORT]")]
    pub domain: Option<String>,
    /// Longest sandbox timeout a request may ask for, in seconds.
    #[arg(long, env = "CUBICLE_MAX_TIMEOUT", default_value_t = 24 * 3600, value_name = "SECS")]
    pub max_timeout: u64,
    /// Timeout of sandboxes whose create names none, in seconds.
    #[arg(long, default_value_t = 300, value_name = "SECS")]
    pub default_timeout: u64,
    /// Do not build the default templates (tiny, base) before reporting ready; they are
    /// then built on first use.
    #[arg(long)]
    pub no_build_templates: bool,
    /// Accepted and ignored: reconciliation only ever touches what this state directory
    /// and its slot range own (older scripts pass it).
    #[arg(long, env = "CUBICLE_NO_REAP_FOREIGN", hide = true)]
    pub no_reap_foreign: bool,
    /// Warm pools: sandboxes kept ready per template, e.g. `tiny=4,base=8` (creates with
    /// the template's limits and internet on are served from them). Default: `base`,
    /// one per 4 GiB of host memory (1 to 8), so creates take milliseconds; `''` for none.
    #[arg(long, env = "CUBICLE_POOL", value_name = "TEMPLATE=N,…",
          value_parser = cubicle_node::parse_pool_spec)]
    pub pool: Option<BTreeMap<String, usize>>,
    /// Shells kept ready: sandboxes of no template yet, made ahead (namespaces, cgroup,
    /// network, envd running); a create that finds no pooled sandbox of its template
    /// takes one and only gets its template's root (see `docs/node.md`). Default: one
    /// per 2 GiB of host memory (1 to 16); 0: none.
    #[arg(long, env = "CUBICLE_SHELLS", value_name = "N")]
    pub shells: Option<usize>,
    /// Open connections one client address may hold (REST and data plane together);
    /// more are answered 429 and closed.
    #[arg(
        long,
        env = "CUBICLE_MAX_CONNECTIONS_PER_CLIENT",
        default_value_t = 512,
        value_name = "N"
    )]
    pub max_connections_per_client: usize,
    /// The server's key (64 hex digits, mode 0600): seals secret values, derives volume
    /// tokens. Default: `<state>/secrets.key`, made on first start.
    #[arg(long, env = "CUBICLE_SECRETS_KEY_FILE", value_name = "FILE")]
    pub secrets_key_file: Option<std::path::PathBuf>,
    /// Where the control plane keeps its records: `postgres://USER@HOST/DATABASE` (a
    /// PostgreSQL server, the shared state of a cluster: docs/cluster.md), or
    /// `sqlite://PATH` / a path. Default: the SQLite file `<state>/cubicle.db`.
    #[arg(long, env = "CUBICLE_DATABASE", value_name = "URL")]
    pub database: Option<String>,
    /// Size of a volume whose create names none, in MiB.
    #[arg(
        long,
        env = "CUBICLE_VOLUME_SIZE_MB",
        default_value_t = 10240,
        value_name = "MIB"
    )]
    pub volume_size_mb: u64,
    /// Most volumes one team may have.
    #[arg(
        long,
        env = "CUBICLE_MAX_VOLUMES_PER_TEAM",
        default_value_t = 100,
        value_name = "N"
    )]
    pub max_volumes_per_team: usize,
    /// Host memory all pooled sandboxes together may use, in MiB.
    #[arg(
        long,
        env = "CUBICLE_POOL_MEMORY_MB",
        default_value_t = 1024,
        value_name = "MIB"
    )]
    pub pool_memory_mb: u64,
    /// TLS certificate chain (PEM) for the listener: the API, the data plane and
    /// `<port>-<id>.<domain>` hosts (use a certificate for `DOMAIN` and `*.DOMAIN`).
    /// Needs --tls-key.
    #[arg(
        long,
        env = "CUBICLE_TLS_CERT",
        value_name = "PEM",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1). Needs --tls-cert.
    #[arg(
        long,
        env = "CUBICLE_TLS_KEY",
        value_name = "PEM",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// Also serve `GET /metrics` here, without an API key (for a Prometheus on a trusted
    /// network, e.g. 127.0.0.1:9464). On the main listener `/metrics` needs an admin key.
    #[arg(long, env = "CUBICLE_METRICS_LISTEN", value_name = "ADDR:PORT")]
    pub metrics_listen: Option<SocketAddr>,
    /// Object store that templates, snapshots and paused sandboxes move through between
    /// nodes (docs/cluster.md, "Moving state"): `s3://bucket/prefix` (endpoint, region,
    /// credentials from the AWS_* environment variables) or `file:///dir`. A create
    /// naming a template or snapshot this node lacks fetches it from there. Unset: none.
    #[arg(long, env = "CUBICLE_OBJECT_STORE", value_name = "URL")]
    pub object_store: Option<String>,
    /// Push every snapshot to the object store once it is taken.
    #[arg(long, env = "CUBICLE_PUBLISH_SNAPSHOTS", requires = "object_store")]
    pub publish_snapshots: bool,
    /// Webhook deliveries: attempts after a failed one (E2B: 3).
    #[arg(
        long,
        env = "CUBICLE_WEBHOOK_RETRIES",
        default_value_t = 3,
        value_name = "N"
    )]
    pub webhook_retries: u32,
    /// Webhook deliveries: seconds between attempts (E2B: 10).
    #[arg(
        long,
        env = "CUBICLE_WEBHOOK_RETRY_INTERVAL",
        default_value_t = 10.0,
        value_name = "SECS"
    )]
    pub webhook_retry_interval: f64,
    /// Webhook deliveries: seconds one attempt may take.
    #[arg(
        long,
        env = "CUBICLE_WEBHOOK_TIMEOUT",
        default_value_t = 10.0,
        value_name = "SECS"
    )]
    pub webhook_timeout: f64,
    #[command(flatten)]
    pub registries: RegistryArgs,
    /// Run as an API replica of a cluster: no node in this process; sandboxes are
    /// created on these `cubicle node`s (comma-separated or repeated), and the data plane
    /// relays to the node that runs each sandbox. Needs --node-token-file. The node
    /// options of this command (pools, network, slots) then do not apply.
    #[arg(
        long = "node",
        env = "CUBICLE_NODES",
        value_delimiter = ',',
        value_name = "http://HOST:PORT"
    )]
    pub nodes: Vec<String>,
    /// The cluster's node token (the file `cubicle node --node-token-file` reads). With
    /// --database and no --node: an API replica coordinated through the cluster's
    /// database (nodes, placement and ownership from there; docs/cluster.md).
    #[arg(long, env = "CUBICLE_NODE_TOKEN_FILE", value_name = "FILE")]
    pub node_token_file: Option<PathBuf>,
    // TLS to the nodes (boxed: keeps `Command`'s variants of similar size).
    #[command(flatten)]
    pub node_tls: Box<crate::cluster_tls::NodeClientTls>,
    #[command(flatten)]
    pub network: NetworkArgs,
}

/// How template builds reach image registries (`cubicle serve`, and `cubicle node`,
/// which runs the builds a replica sends it).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct RegistryArgs {
    /// Registry mirror for template builds, `REGISTRY=MIRROR` (repeatable), e.g.
    /// `docker.io=http://localhost:5000` (an `http://` mirror is spoken to in plain HTTP).
    #[arg(
        long = "registry-mirror",
        env = "CUBICLE_REGISTRY_MIRROR",
        value_delimiter = ',',
        value_name = "REGISTRY=MIRROR"
    )]
    pub registry_mirrors: Vec<String>,
    /// Registry (`host:port`, or `host` for any of its ports) template builds speak to
    /// over plain HTTP (repeatable; `localhost` and `127.0.0.1` always are).
    #[arg(
        long = "insecure-registry",
        env = "CUBICLE_INSECURE_REGISTRY",
        value_delimiter = ',',
        value_name = "HOST[:PORT]"
    )]
    pub insecure_registries: Vec<String>,
}

impl RegistryArgs {
    /// The builder's registry options.
    pub fn options(&self) -> anyhow::Result<cubicle_node::template::oci::pull::RegistryOptions> {
        Ok(
            cubicle_node::template::oci::pull::RegistryOptions::with_mirrors(
                &self.registry_mirrors,
                &self.insecure_registries,
            )?,
        )
    }
}

/// Sandbox networking options of `cubicle serve` (see docs/network.md).
#[derive(clap::Args, Debug)]
pub struct NetworkArgs {
    /// Upstream DNS servers for sandboxes whose policy names none (default: the host's
    /// /etc/resolv.conf; comma-separated IPv4 addresses).
    #[arg(
        long,
        env = "CUBICLE_DNS_UPSTREAM",
        value_delimiter = ',',
        value_name = "IP,…"
    )]
    pub dns_upstream: Vec<std::net::Ipv4Addr>,
    /// Port of the node's DNS resolver for sandboxes (all their DNS goes there; 0: any
    /// free port).
    #[arg(
        long,
        env = "CUBICLE_EGRESS_DNS_PORT",
        default_value_t = 0,
        value_name = "PORT"
    )]
    pub egress_dns_port: u16,
    /// Port of the node's egress proxy (domain rules, learn mode, egress proxies; 0: any
    /// free port).
    #[arg(
        long,
        env = "CUBICLE_EGRESS_PROXY_PORT",
        default_value_t = 0,
        value_name = "PORT"
    )]
    pub egress_proxy_port: u16,
    /// Extra CA certificates (PEM file) the egress proxy trusts, besides the system's,
    /// for the servers behind domains with header rules (`network.rules`), whose TLS it
    /// terminates and opens again.
    #[arg(long, env = "CUBICLE_EGRESS_UPSTREAM_CA", value_name = "FILE")]
    pub egress_upstream_ca: Option<std::path::PathBuf>,
    /// Connections a sandbox may have open at once.
    #[arg(
        long,
        env = "CUBICLE_SANDBOX_MAX_CONNECTIONS",
        default_value_t = 4096,
        value_name = "N"
    )]
    pub sandbox_max_connections: u32,
    /// New connections per second a sandbox may open (bursts of twice that).
    #[arg(
        long,
        env = "CUBICLE_SANDBOX_NEW_CONNECTIONS",
        default_value_t = 200,
        value_name = "N"
    )]
    pub sandbox_new_connections: u32,
    /// Outbound bandwidth per sandbox, in Mbit/s.
    #[arg(
        long,
        env = "CUBICLE_SANDBOX_BANDWIDTH_MBIT",
        default_value_t = 1000,
        value_name = "MBIT"
    )]
    pub sandbox_bandwidth_mbit: u64,
    /// Let sandboxes send outbound SMTP (TCP port 25).
    #[arg(long, env = "CUBICLE_ALLOW_SMTP")]
    pub allow_smtp: bool,
}

impl NetworkArgs {
    /// The node's network options.
    pub fn options(&self) -> cubicle_node::NetworkOptions {
        let mut o = cubicle_node::NetworkOptions {
            dns_port: self.egress_dns_port,
            proxy_port: self.egress_proxy_port,
            upstream_dns: self.dns_upstream.clone(),
            upstream_ca: self.egress_upstream_ca.clone(),
            allow_smtp: self.allow_smtp,
            ..Default::default()
        };
        o.limits.max_connections = self.sandbox_max_connections.max(1);
        o.limits.new_connections_per_sec = self.sandbox_new_connections.max(1);
        o.limits.new_connections_burst = self.sandbox_new_connections.max(1).saturating_mul(2);
        let bytes = self.sandbox_bandwidth_mbit.max(1) * 125_000;
        o.limits.bytes_per_sec = bytes;
        // The kernel's bucket already holds one second at the rate; add little to it.
        o.limits.bytes_burst = 64 << 10;
        o
    }
}

/// The warm pools of a server (`serve`, `node`): `--pool` if given, else
/// [`default_pool`] when `base` will be there at ready time (built now, or already: a
/// pool must not make a `--no-build-templates` start build it in the background), else
/// none; and under [`cubicle_node::SHELL_POOL`] `--shells` shells, [`default_shells`]
/// if not given, none for 0.
pub fn warm_pools(
    pool: Option<&BTreeMap<String, usize>>,
    shells: Option<usize>,
    no_build_templates: bool,
    state_dir: &std::path::Path,
) -> BTreeMap<String, usize> {
    let memory = cubicle_node::host::memory_total();
    let mut pools = match pool {
        Some(p) => p.clone(),
        None if !no_build_templates || state_dir.join("templates/base/template.json").exists() => {
            default_pool(memory)
        }
        None => BTreeMap::new(),
    };
    let shells = shells.unwrap_or_else(|| default_shells(memory));
    if shells > 0 {
        pools.insert(cubicle_node::SHELL_POOL.to_string(), shells);
    }
    pools
}

/// Shells kept when `--shells` is not given: one per 2 GiB of host memory, at least 1
/// and at most 16. A shell idles at about 1 MiB of host memory (its namespaces, cgroup,
/// veth and envd) and turns a cold create (internet on, the default disk, a template
/// without a start command) into a re-root of a running sandbox (docs/bench.md, rounds
/// 27 and 28); the pool adapts the number to the misses (up to four times this), so
/// bursts larger than it are served by the next ones.
pub fn default_shells(memory_total: u64) -> usize {
    (memory_total >> 31).clamp(1, 16) as usize
}

/// The warm pool when `--pool` is not given: `base`, one sandbox per 4 GiB of host
/// memory, at least 1 and at most 8 (a pooled sandbox idles at a few MiB; the pool's
/// own memory budget is --pool-memory-mb).
pub fn default_pool(memory_total: u64) -> BTreeMap<String, usize> {
    let n = (memory_total >> 32).clamp(1, 8) as usize;
    BTreeMap::from([("base".to_string(), n)])
}

/// Where template builds are counted: kept until the metrics exist, then counted there.
enum BuildSink {
    Early(Vec<(bool, Duration)>),
    Ready(Arc<cubicle_api::telemetry::Telemetry>),
}

/// Seconds from a flag, refused when not finite and positive.
fn seconds(flag: &str, v: f64) -> anyhow::Result<Duration> {
    if !(v.is_finite() && v > 0.0 && v < 86_400.0) {
        anyhow::bail!("{flag} must be a number of seconds above 0, got {v}");
    }
    Ok(Duration::from_secs_f64(v))
}

pub async fn run(
    env: crate::sandbox_cmd::NodeOpts,
    args: ServeArgs,
    log_format: crate::LogFormat,
) -> anyhow::Result<i32> {
    if args.max_timeout == 0 || args.default_timeout == 0 || args.default_timeout > args.max_timeout
    {
        anyhow::bail!(
            "--default-timeout ({}) must be between 1 and --max-timeout ({})",
            args.default_timeout,
            args.max_timeout
        );
    }
    // Bad flags are refused before anything slow happens.
    SandboxDomain::new(args.domain.as_deref(), args.listen.port())?;
    let webhooks = cubicle_api::webhooks::WebhookConfig {
        retries: args.webhook_retries,
        retry_interval: seconds("--webhook-retry-interval", args.webhook_retry_interval)?,
        timeout: seconds("--webhook-timeout", args.webhook_timeout)?,
    };
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(cubicle_api::tls::server_config(cert, key)?),
        _ => None,
    };
    let state_dir = &env.state_dir;
    // An API replica of a cluster: the sandboxes live on `cubicle node`s.
    let mut early_store = None;
    let remote = if args.nodes.is_empty() && args.node_token_file.is_some() {
        // Coordinated through the cluster's database.
        let (remote, relay, store) = crate::serve_cluster::connect(&args, state_dir).await?;
        early_store = Some(store);
        Some((remote, relay))
    } else if args.nodes.is_empty() {
        None
    } else {
        let Some(token_file) = &args.node_token_file else {
            anyhow::bail!(
                "--node needs --node-token-file (the file the nodes read the cluster's node token from)"
            );
        };
        let token = crate::node_serve::read_node_token(token_file)?;
        create_state_dir(state_dir)?;
        let node_tls = args.node_tls.config(&args.nodes)?;
        let mut cfg = cubicle_api::cluster::RemoteConfig::new(args.nodes.clone(), token.clone());
        cfg.tls = node_tls.clone();
        cfg.log_dir = state_dir.join("node-logs");
        let remote = cubicle_api::cluster::RemoteBackend::connect(cfg)
            .await
            .map_err(|e| anyhow::anyhow!("connecting to the nodes: {e}"))?;
        for (node, down) in remote.nodes() {
            match down {
                None => tracing::info!(%node, "node answers"),
                Some(why) => tracing::warn!(%node, "node does not answer yet: {why}"),
            }
        }
        let relay =
            cubicle_router::Relay::with_tls(&token, &RouterConfig::default(), node_tls.as_ref())
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        Some((remote, relay))
    };
    let (node, builds, adopted) = if remote.is_some() {
        (None, None, 0)
    } else {
        let envd = cubicle_node::config::find_envd_binary(env.envd_binary.clone())?;
        let mut config = env.config(envd);
        config.template_progress = log_format == crate::LogFormat::Text;
        config.default_timeout = Duration::from_secs(args.default_timeout);
        config.pool = warm_pools(
            args.pool.as_ref(),
            args.shells,
            args.no_build_templates,
            state_dir,
        );
        config.pool_memory_mb = args.pool_memory_mb;
        config.network = args.network.options();
        if !config.pool.is_empty() {
            tracing::info!(pool = ?config.pool, "warm pools");
        }
        // Template builds are counted from the first one on (the default templates below
        // are built before the metrics exist: they are kept until then).
        let builds = Arc::new(std::sync::Mutex::new(BuildSink::Early(Vec::new())));
        {
            let builds = builds.clone();
            cubicle_node::template::observe_builds(Box::new(move |name, ok, took| {
                tracing::info!(
                    template = name,
                    ok,
                    seconds = took.as_secs_f64(),
                    "template build finished"
                );
                match &mut *builds.lock().unwrap_or_else(|p| p.into_inner()) {
                    BuildSink::Early(v) => v.push((ok, took)),
                    BuildSink::Ready(t) => t.template_build(ok, took),
                }
            }));
        }
        // DELETE answers once the sandbox is dead; cgroups/veth/quota go in the background.
        config.async_teardown = true;
        config.recycle_quota_dirs = cubicle_node::config::SERVE_RECYCLED_QUOTA_DIRS;
        let node = Node::open(config)
            .await
            .with_context(|| format!("opening the node on {}", state_dir.display()))?;
        let report = node.reconcile_report();
        tracing::info!(?report, "node reconciled");
        if let Some(url) = &args.object_store {
            let bucket = cubicle_node::objstore::Bucket::open(url)?;
            node.set_object_store(cubicle_node::ObjectStoreConfig {
                bucket,
                publish_snapshots: args.publish_snapshots,
                publish_paused: false,
            });
            tracing::info!(object_store = %url, "object store set");
        }

        if !args.no_build_templates {
            for name in DEFAULT_TEMPLATES {
                let store = node.templates().clone();
                let built = store.get(name)?.is_some();
                if !built {
                    tracing::info!("building template '{name}' (first start only)…");
                    let name = name.to_string();
                    tokio::task::spawn_blocking(move || store.ensure(&name, true))
                        .await
                        .context("template build task")??;
                }
            }
        }
        (Some(node), Some(builds), report.adopted.len())
    };

    let db = match &args.database {
        Some(url) => url.clone(),
        None => state_dir.join("cubicle.db").display().to_string(),
    };
    let store = if let Some(store) = early_store.take() {
        store
    } else {
        let db2 = db.clone();
        tokio::task::spawn_blocking(move || Store::open_url(&db2))
            .await
            .context("store task")?
            .with_context(|| format!("opening the database {}", redact_password(&db)))?
    };
    let (key, key_created) = {
        let (store, dir) = (store.clone(), state_dir.clone());
        tokio::task::spawn_blocking(move || admin_key(&store, &dir))
            .await
            .context("admin key task")??
    };

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let addr = listener.local_addr()?;
    let domain = SandboxDomain::new(args.domain.as_deref(), addr.port())?;
    let metrics_listener = match args.metrics_listen {
        Some(a) => Some(
            tokio::net::TcpListener::bind(a)
                .await
                .with_context(|| format!("listening on {a} (--metrics-listen)"))?,
        ),
        None => None,
    };

    let keyring = {
        let (path, create) = match &args.secrets_key_file {
            Some(p) => (p.clone(), false),
            None => (state_dir.join(SECRETS_KEY_FILE), true),
        };
        tokio::task::spawn_blocking(move || cubicle_api::keyring::Keyring::load(&path, create))
            .await
            .context("key task")??
    };
    let mut api_config = ApiConfig::new(state_dir.join("logs"));
    api_config.keyring = Arc::new(keyring);
    api_config.volumes.default_size_mb = args.volume_size_mb;
    api_config.volumes.max_per_team = args.max_volumes_per_team;
    api_config.limits.default_timeout = Duration::from_secs(args.default_timeout);
    api_config.limits.max_timeout = Duration::from_secs(args.max_timeout);
    // A create's `diskSizeMB` is capped by the filesystem the writable layers live on.
    let disk = cubicle_node::host::stats(&state_dir.join("sandboxes")).disk_total >> 20;
    if disk > 0 && remote.is_none() {
        api_config.limits.max_disk_mb = disk;
    }
    api_config.domain = Some(domain.advertised.clone());
    api_config.registry = args.registries.options()?;
    api_config.webhooks = webhooks;
    let backend: Arc<dyn cubicle_api::Backend> = match (&node, &remote) {
        (Some(node), _) => Arc::new(node.clone()),
        (None, Some((remote, _))) => Arc::new(remote.clone()),
        (None, None) => anyhow::bail!("neither a node nor --node"),
    };
    let cp = ControlPlane::open(backend, store, api_config)
        .await
        .map_err(|e| anyhow::anyhow!("starting the control plane: {e}"))?;
    // Header rules' `${e2b.secrets.NAME}`: the egress proxy reads values from the store.
    if let Some(node) = &node {
        node.set_secret_source(Arc::new(cubicle_api::secrets::StoreSecrets(
            Arc::downgrade(&cp),
        )));
    }
    let telemetry = cp.telemetry().clone();
    if let Some(builds) = &builds {
        let mut sink = builds.lock().unwrap_or_else(|p| p.into_inner());
        if let BuildSink::Early(v) = &*sink {
            for (ok, took) in v {
                telemetry.template_build(*ok, *took);
            }
        }
        *sink = BuildSink::Ready(telemetry.clone());
    }
    let upkeep = cp.spawn_upkeep(Duration::from_secs(1));
    let poller = remote.as_ref().map(|(r, _)| r.spawn_poller());
    let coordination = remote
        .as_ref()
        .and_then(|(r, _)| crate::serve_cluster::start(r, &cp));

    let data_plane = DataPlane::new(
        Arc::new(ApiResolver::new(cp.clone())),
        RouterConfig {
            domain: Some(domain.routing.clone()),
            ..Default::default()
        },
    );
    if let Some(node) = &node {
        // A checkpoint (pause, snapshot, fork) cannot hold connections from outside the
        // sandbox: the router closes its own before the sandbox is frozen.
        let dp = data_plane.clone();
        node.on_checkpoint(Box::new(move |id: &str| {
            let n = dp.disconnect(id);
            tracing::debug!(sandbox = %id, connections = n, "closed the router's connections");
        }));
    }
    let app = cubicle_api::router(cp.clone())
        .layer(axum::middleware::from_fn(
            move |req: Request, next: Next| {
                let (dp, t) = (data_plane.clone(), telemetry.clone());
                let remote = remote.clone();
                async move {
                    if dp.wants(&req) {
                        dataplane(&dp, remote.as_ref(), &t, req).await
                    } else {
                        next.run(req).await
                    }
                }
            },
        ))
        .layer(axum::middleware::from_fn_with_state(
            cp.telemetry().clone(),
            cubicle_api::telemetry::http::observe,
        ));

    let scheme = if tls.is_some() { "https" } else { "http" };
    let host = if addr.ip().is_unspecified() {
        "127.0.0.1".to_string()
    } else if addr.is_ipv6() {
        format!("[{}]", addr.ip())
    } else {
        addr.ip().to_string()
    };
    let url = format!("{scheme}://{host}:{}", addr.port());
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "export E2B_API_URL={url}")?;
        writeln!(out, "export E2B_SANDBOX_URL={url}")?;
        // The volume content API is served on the same listener.
        writeln!(out, "export E2B_VOLUME_API_URL={url}")?;
        if key_created || out.is_terminal() {
            writeln!(out, "export E2B_API_KEY={key}")?;
        } else {
            // Not into logs and journals again: `cubicle apikey` prints it.
            writeln!(
                out,
                "# E2B_API_KEY: printed when it was created; `cubicle apikey --state-dir {}` prints it",
                state_dir.display()
            )?;
        }
        writeln!(out, "cubicle: ready")?;
        out.flush()?;
    }
    tracing::info!(
        listen = %addr,
        tls = tls.is_some(),
        domain = %domain.advertised,
        state_dir = %state_dir.display(),
        adopted,
        nodes = args.nodes.len(),
        "serving the API and the router on {url}, sandbox ports at {scheme}://<port>-<id>.{}",
        domain.advertised
    );

    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    if let Some(l) = metrics_listener {
        let (cp2, mut stop) = (cp.clone(), stop_rx.clone());
        tracing::info!(listen = %l.local_addr()?, "serving /metrics without a key");
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let cp = cp2.clone();
                async move { cubicle_api::routes::prometheus_response(&cp) }
            }),
        );
        tokio::spawn(async move {
            let _ = axum::serve(l, app)
                .with_graceful_shutdown(async move {
                    let _ = stop.changed().await;
                })
                .await;
        });
    }
    let limits = cubicle_router::ServerLimits {
        max_connections_per_client: args.max_connections_per_client,
        max_connections: max_connections(),
        ..Default::default()
    };
    let tls = tls.map(|c| tokio_rustls::TlsAcceptor::from(Arc::new(c)));
    let server = cubicle_router::server::serve(listener, app, limits, tls, async move {
        let _ = stop_rx.changed().await;
    });
    let mut server = std::pin::pin!(server);
    crate::sd_notify::notify("READY=1\nSTATUS=serving");
    tokio::select! {
        () = &mut server => {}
        sig = shutdown_signal() => {
            crate::sd_notify::notify("STOPPING=1");
            tracing::info!("{sig}: stopping (sandboxes keep running; the next start adopts them)");
            let _ = stop_tx.send(true);
            if tokio::time::timeout(Duration::from_secs(5), &mut server).await.is_err() {
                tracing::warn!("open connections did not finish within 5 s; closing them");
            }
        }
    }
    upkeep.abort();
    if let Some(p) = poller {
        p.abort();
    }
    if let Some(c) = coordination {
        c.abort();
    }
    // The lifecycle events of the last requests, which the event writer may still be
    // gathering: stored before the runtime ends it.
    cp.events().flush().await;
    if let Some(node) = node {
        node.stop().await;
    }
    Ok(0)
}

/// The sandboxes' domain: what SDKs are told (`get_host(port)` is
/// `<port>-<id>.<advertised>`) and what the router matches `Host` names against.
#[derive(Debug, Clone, PartialEq)]
struct SandboxDomain {
    /// `DOMAIN[:PORT]` as returned to SDKs.
    advertised: String,
    /// `DOMAIN` without the port, lowercase.
    routing: String,
}

impl SandboxDomain {
    /// From `--domain` (`DOMAIN[:PORT]`), else `localhost:<listen_port>`: a browser, curl,
    /// systemd-resolved or nss-myhostname resolve every name under `localhost` to the
    /// loopback address, so `get_host()` works on this machine without DNS set-up.
    fn new(flag: Option<&str>, listen_port: u16) -> anyhow::Result<Self> {
        let Some(flag) = flag else {
            return Ok(SandboxDomain {
                advertised: if listen_port == 80 {
                    "localhost".into()
                } else {
                    format!("localhost:{listen_port}")
                },
                routing: "localhost".into(),
            });
        };
        let flag = flag.trim().trim_end_matches('.');
        let (host, port) = match flag.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (flag, None),
        };
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
        };
        if host.is_empty() || host.len() > 253 || !host.split('.').all(label_ok) {
            anyhow::bail!(
                "--domain '{flag}' is not a DNS name (DOMAIN or DOMAIN:PORT, e.g. sandbox.example.com)"
            );
        }
        if let Some(p) = port
            && p.parse::<u16>().map_or(true, |p| p == 0)
        {
            anyhow::bail!("--domain '{flag}': '{p}' is not a port (1-65535)");
        }
        Ok(SandboxDomain {
            advertised: flag.to_ascii_lowercase(),
            routing: host.to_ascii_lowercase(),
        })
    }
}

/// A data-plane request: forwarded by the router, labelled for the access log and the
/// metrics; the first `process.Process/Start` of each sandbox is timed.
async fn dataplane(
    dp: &DataPlane,
    remote: Option<&(cubicle_api::cluster::RemoteBackend, cubicle_router::Relay)>,
    t: &cubicle_api::telemetry::Telemetry,
    req: Request,
) -> axum::response::Response {
    let t0 = Instant::now();
    let target = dp.target_of(&req);
    let route = dataplane_route(target.as_ref().map(|(_, p)| *p), req.uri().path());
    let mut resp = match remote {
        None => dp.handle(req).await,
        // A replica: admitted here (routes, tokens, auto-resume through the control
        // plane), entered on the node that runs the sandbox.
        Some((remote, relay)) => match dp.admit(req).await {
            Ok((a, req)) => match remote.node_of(&a.target.id) {
                Some(node) => relay.forward(req, &a, &node).await,
                None => cubicle_router::RouterError::SandboxNotFound {
                    id: a.target.id.clone(),
                }
                .into_response(),
            },
            Err(e) => e.into_response(),
        },
    };
    if let Some((id, _)) = target {
        let id = id.to_string();
        if route == "sandbox:envd/process.Process/Start" && resp.status().is_success() {
            t.command_started(&id, t0.elapsed());
        }
        resp.extensions_mut().insert(SandboxLabel(id));
    }
    resp.extensions_mut().insert(RouteLabel(route.into()));
    resp
}

/// Makes the state directory of a replica (its database and keys), mode 0700.
pub(crate) fn create_state_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))
}

/// How many connections the server may hold in all: half the limit on open files (the
/// other half is for sandboxes, the database and logs).
fn max_connections() -> usize {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes a struct rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } != 0 {
        return cubicle_router::ServerLimits::default().max_connections;
    }
    usize::try_from(rl.rlim_cur / 2)
        .unwrap_or(usize::MAX)
        .max(64)
}

pub(crate) async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("cannot watch SIGTERM: {e}");
            let _ = tokio::signal::ctrl_c().await;
            return "SIGINT";
        }
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = tokio::signal::ctrl_c() => "SIGINT",
    }
}

/// The admin key: the one in `<state>/admin-api-key` if it still authenticates, else a
/// new one for team `admin` (written there, mode 0600); `true` when it is new.
/// A database URL as it may be logged: without the password (`postgres://u:***@h/db`).
pub(crate) fn redact_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    match rest.split_once('@') {
        Some((auth, host)) if auth.contains(':') => {
            let user = auth.split_once(':').map_or(auth, |(u, _)| u);
            format!("{scheme}://{user}:***@{host}")
        }
        _ => url.to_string(),
    }
}

fn admin_key(store: &Store, state_dir: &Path) -> anyhow::Result<(String, bool)> {
    let path = state_dir.join(ADMIN_KEY_FILE);
    if let Ok(text) = std::fs::read_to_string(&path) {
        let key = text.trim();
        if store.authenticate(key)?.is_some() {
            return Ok((key.to_string(), false));
        }
        tracing::warn!(
            "the key in {} is revoked or unknown; creating a new admin key",
            path.display()
        );
    }
    let team = store.ensure_team(ADMIN_TEAM)?;
    let key = store.create_api_key(team.id)?;
    let tmp = state_dir.join(format!(".{ADMIN_KEY_FILE}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    writeln!(f, "{}", key.plaintext)?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    tracing::info!(
        "created admin API key {}… (team '{ADMIN_TEAM}'); printed once; `cubicle apikey` prints it again (kept in {}, mode 0600)",
        key.info.prefix,
        path.display()
    );
    Ok((key.plaintext, true))
}

/// The admin key in `state_dir` (for programs that start a server and need its key
/// when the server did not print it: it prints it only when it creates it).
pub fn read_admin_key(state_dir: &Path) -> anyhow::Result<String> {
    let path = state_dir.join(ADMIN_KEY_FILE);
    Ok(std::fs::read_to_string(&path)
        .with_context(|| format!("reading {}", path.display()))?
        .trim()
        .to_string())
}

#[cfg(test)]
mod tests {
    use super::{SandboxDomain, default_shells, redact_password, warm_pools};
    use std::collections::BTreeMap;

    /// Shells unless `--shells 0`, whatever `--pool` says; their default follows the
    /// host's memory.
    #[test]
    fn shells_are_kept_unless_turned_off() {
        assert_eq!(default_shells(1 << 30), 1);
        assert_eq!(default_shells(24 << 30), 12);
        assert_eq!(default_shells(256 << 30), 16);
        let none = BTreeMap::new();
        let dir = std::path::Path::new("/nonexistent");
        let shells = |p: Option<&BTreeMap<String, usize>>, n| {
            warm_pools(p, n, true, dir)
                .get(cubicle_node::SHELL_POOL)
                .copied()
        };
        let default = default_shells(cubicle_node::host::memory_total());
        assert_eq!(shells(None, None), Some(default));
        assert_eq!(shells(Some(&none), None), Some(default));
        assert_eq!(shells(Some(&none), Some(3)), Some(3));
        assert_eq!(shells(None, Some(0)), None);
        let tiny = BTreeMap::from([("tiny".to_string(), 2)]);
        let both = warm_pools(Some(&tiny), Some(0), true, dir);
        assert_eq!(both, tiny, "--shells 0 leaves the pools as given");
    }

    #[test]
    fn database_urls_are_logged_without_password() {
        assert_eq!(
            redact_password("postgres://cubicle:s3cret@db:5432/cubicle"),
            "postgres://cubicle:***@db:5432/cubicle"
        );
        assert_eq!(redact_password("postgres://u@db/x"), "postgres://u@db/x");
        assert_eq!(
            redact_password("/var/lib/cubicle/cubicle.db"),
            "/var/lib/cubicle/cubicle.db"
        );
    }

    #[test]
    fn sandbox_domain() {
        let d = SandboxDomain::new(None, 3000).unwrap();
        assert_eq!(
            (d.advertised.as_str(), d.routing.as_str()),
            ("localhost:3000", "localhost")
        );
        let d = SandboxDomain::new(None, 80).unwrap();
        assert_eq!(d.advertised, "localhost");
        let d = SandboxDomain::new(Some("Sandbox.Example.com"), 3000).unwrap();
        assert_eq!(
            (d.advertised.as_str(), d.routing.as_str()),
            ("sandbox.example.com", "sandbox.example.com")
        );
        let d = SandboxDomain::new(Some("cubicle.test:8443"), 3000).unwrap();
        assert_eq!(
            (d.advertised.as_str(), d.routing.as_str()),
            ("cubicle.test:8443", "cubicle.test")
        );
        for bad in ["", "a..b", "x:0", "x:http", "under_score.test", "http://x"] {
            assert!(SandboxDomain::new(Some(bad), 3000).is_err(), "{bad}");
        }
    }
}
