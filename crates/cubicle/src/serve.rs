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
//! export E2B_API_URL=http://HOST:PORT
//! export E2B_SANDBOX_URL=http://HOST:PORT
//! export E2B_VOLUME_API_URL=http://HOST:PORT
//! export E2B_API_KEY=e2b_…
//! cubicle: ready
//! ```
//!
//! The admin key's plaintext is kept in `<state>/admin-api-key` (mode 0600) so that every
//! start can print it again (the database holds only its hash). Whoever can read that
//! file is admin — the same trust as root on the state directory, which can do anything
//! to the sandboxes anyway. Revoke it with `cubicle apikey revoke`; the next start makes
//! a new one.
//!
//! Connections (`cubicle_router::server`): at most `--max-connections-per-client` per
//! client address and half the open-file limit in all, request heads within 30 s.
//!
//! SIGTERM/SIGINT: stop accepting, give open requests 5 s, stop the node's background
//! work and exit. Sandboxes keep running (their end times still hold: the next start
//! adopts them and enforces them).

use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::extract::Request;
use axum::middleware::Next;
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
pub const ADMIN_TEAM: &str = "admin";
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
    /// the template's limits and internet on are served from them).
    #[arg(long, env = "CUBICLE_POOL", default_value = "", value_name = "TEMPLATE=N,…",
          value_parser = cubicle_node::parse_pool_spec)]
    pub pool: std::collections::BTreeMap<String, usize>,
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
    /// Registry mirror for template builds, `REGISTRY=MIRROR` (repeatable), e.g.
    /// `docker.io=http://localhost:5000` (an `http://` mirror is spoken to in plain HTTP).
    #[arg(
        long = "registry-mirror",
        env = "CUBICLE_REGISTRY_MIRROR",
        value_delimiter = ',',
        value_name = "REGISTRY=MIRROR"
    )]
    pub registry_mirrors: Vec<String>,
    /// Registry (`host:port`) template builds speak to over plain HTTP (repeatable;
    /// `localhost` and `127.0.0.1` always are).
    #[arg(
        long = "insecure-registry",
        env = "CUBICLE_INSECURE_REGISTRY",
        value_delimiter = ',',
        value_name = "HOST:PORT"
    )]
    pub insecure_registries: Vec<String>,
    #[command(flatten)]
    pub network: NetworkArgs,
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

pub async fn run(env: crate::sandbox_cmd::NodeOpts, args: ServeArgs) -> anyhow::Result<i32> {
    if args.max_timeout == 0 || args.default_timeout == 0 || args.default_timeout > args.max_timeout
    {
        anyhow::bail!(
            "--default-timeout ({}) must be between 1 and --max-timeout ({})",
            args.default_timeout,
            args.max_timeout
        );
    }
    // A bad --domain is refused before anything slow happens.
    SandboxDomain::new(args.domain.as_deref(), args.listen.port())?;
    let state_dir = &env.state_dir;
    let envd = cubicle_node::config::find_envd_binary(env.envd_binary.clone())?;
    let mut config = env.config(envd);
    config.template_progress = true;
    config.default_timeout = Duration::from_secs(args.default_timeout);
    config.pool = args.pool.clone();
    config.pool_memory_mb = args.pool_memory_mb;
    config.network = args.network.options();
    // DELETE answers once the sandbox is dead; cgroups/veth/quota go in the background.
    config.async_teardown = true;
    let node = Node::open(config)
        .await
        .with_context(|| format!("opening the node on {}", state_dir.display()))?;
    let report = node.reconcile_report();
    tracing::info!(?report, "node reconciled");

    if !args.no_build_templates {
        for name in DEFAULT_TEMPLATES {
            let store = node.templates().clone();
            let built = store.get(name)?.is_some();
            if !built {
                eprintln!("cubicle: building template '{name}' (first start only)…");
                let name = name.to_string();
                tokio::task::spawn_blocking(move || store.ensure(&name, true))
                    .await
                    .context("template build task")??;
            }
        }
    }

    let db = state_dir.join("cubicle.db");
    let store = {
        let db2 = db.clone();
        tokio::task::spawn_blocking(move || Store::open(&db2))
            .await
            .context("store task")?
            .with_context(|| format!("opening {}", db.display()))?
    };
    let key = {
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
    api_config.domain = Some(domain.advertised.clone());
    api_config.registry = cubicle_node::template::oci::pull::RegistryOptions::with_mirrors(
        &args.registry_mirrors,
        &args.insecure_registries,
    )?;
    let cp = ControlPlane::open(Arc::new(node.clone()), store, api_config)
        .await
        .map_err(|e| anyhow::anyhow!("starting the control plane: {e}"))?;
    let upkeep = cp.spawn_upkeep(Duration::from_secs(1));

    let data_plane = DataPlane::new(
        Arc::new(ApiResolver::new(cp.clone())),
        RouterConfig {
            domain: Some(domain.routing.clone()),
            ..Default::default()
        },
    );
    {
        // The first command in a new sandbox should not pay for the router's connection.
        let dp = data_plane.clone();
        cp.on_created(Box::new(move |id: &str| {
            let (dp, id) = (dp.clone(), id.to_string());
            tokio::spawn(async move { dp.prewarm(&id).await });
        }));
    }
    let app = cubicle_api::router(cp.clone()).layer(axum::middleware::from_fn(
        move |req: Request, next: Next| {
            let dp = data_plane.clone();
            async move {
                if dp.wants(&req) {
                    dp.handle(req).await
                } else {
                    next.run(req).await
                }
            }
        },
    ));

    let host = if addr.ip().is_unspecified() {
        "127.0.0.1".to_string()
    } else if addr.is_ipv6() {
        format!("[{}]", addr.ip())
    } else {
        addr.ip().to_string()
    };
    let url = format!("http://{host}:{}", addr.port());
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "export E2B_API_URL={url}")?;
        writeln!(out, "export E2B_SANDBOX_URL={url}")?;
        // The volume content API is served on the same listener.
        writeln!(out, "export E2B_VOLUME_API_URL={url}")?;
        writeln!(out, "export E2B_API_KEY={key}")?;
        writeln!(out, "cubicle: ready")?;
        out.flush()?;
    }
    eprintln!(
        "cubicle: serving API and router on {addr}, sandbox ports at http://<port>-<id>.{} (state {}); adopted {} running sandbox(es)",
        domain.advertised,
        state_dir.display(),
        report.adopted.len()
    );

    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let limits = cubicle_router::ServerLimits {
        max_connections_per_client: args.max_connections_per_client,
        max_connections: max_connections(),
        ..Default::default()
    };
    let server = cubicle_router::server::serve(listener, app, limits, async move {
        let _ = stop_rx.changed().await;
    });
    let mut server = std::pin::pin!(server);
    tokio::select! {
        () = &mut server => {}
        sig = shutdown_signal() => {
            eprintln!("cubicle: {sig}: stopping (sandboxes keep running; the next start adopts them)");
            let _ = stop_tx.send(true);
            if tokio::time::timeout(Duration::from_secs(5), &mut server).await.is_err() {
                eprintln!("cubicle: open connections did not finish within 5 s; closing them");
            }
        }
    }
    upkeep.abort();
    node.settle(Duration::from_secs(10)).await;
    node.close();
    node.wait_refills(Duration::from_secs(60)).await;
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

async fn shutdown_signal() -> &'static str {
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
/// new one for team `admin` (written there, mode 0600).
fn admin_key(store: &Store, state_dir: &Path) -> anyhow::Result<String> {
    let path = state_dir.join(ADMIN_KEY_FILE);
    if let Ok(text) = std::fs::read_to_string(&path) {
        let key = text.trim();
        if store.authenticate(key)?.is_some() {
            return Ok(key.to_string());
        }
        eprintln!(
            "cubicle: the key in {} is revoked or unknown; creating a new admin key",
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
    eprintln!(
        "cubicle: created admin API key {}… (team '{ADMIN_TEAM}'); its plaintext is kept in {} (mode 0600)",
        key.info.prefix,
        path.display()
    );
    Ok(key.plaintext)
}

#[cfg(test)]
mod tests {
    use super::SandboxDomain;

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
