//! The node's egress layer: what a sandbox's DNS questions and TCP connections meet on
//! the host, beyond the kernel's address rules (`cubicle_runtime::network`).
//!
//! - [`resolver`](crate::resolver): every DNS query of every sandbox (the kernel
//!   redirects UDP/TCP port 53 here, whatever server it was sent to) is answered per the
//!   sandbox's policy, forwarded to its upstream servers, and recorded; the addresses it
//!   hands out are remembered per sandbox and name (`names.rs`).
//! - [`proxy`](crate::proxy): TCP connections the kernel steers here (sandboxes whose
//!   policy names domains, learn mode, an egress proxy) are matched by TLS SNI or HTTP
//!   Host against the policy and against the addresses handed out for that name, then
//!   relayed directly or through the user's SOCKS5 proxy (`socks5.rs`, optionally TLS).
//! - [`transform`] and `intercept.rs`: `network.rules` header transforms — the proxy sets
//!   the rule's headers (with `${e2b.secrets.NAME}` replaced by the secret's value, from
//!   the [`SecretSource`] the server installs) on every HTTP request to a domain with a
//!   rule, terminating TLS for those domains with the node's CA (which sandboxes trust).
//! - [`audit`]: the per-sandbox trail of both, and the allow list learn mode prints.
//! - [`policy`]: E2B's network options as a typed policy and the decisions made from it.
//!
//! Sandboxes are told apart by source address (a sandbox's address is its own: the
//! kernel drops spoofed ones). A source the layer does not know gets nothing: no answer,
//! no connection (fail closed).

pub mod audit;
pub mod dns;
mod http1;
mod intercept;
pub mod lab;
mod names;
pub mod policy;
mod proxy;
mod resolver;
pub mod sniff;
mod socks5;
pub mod transform;

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use cubicle_runtime::network::AddressGuard;
use cubicle_runtime::network::events::{KernelEvent, Watch};

pub use audit::{AuditLog, EventKind, NetEvent, allow_list};
pub use policy::{
    Destination, DomainPattern, EgressProxy, Ipv4Cidr4, NetworkPolicy, ProxyTls, Rule, Transform,
    Verdict,
};
pub use socks5::check_ca_pem;

use names::NameTable;

/// Errors of the egress layer.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// A policy that cannot be applied (the API answers 400 with this text).
    #[error("{0}")]
    Policy(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    /// A DNS exchange failed.
    #[error("DNS: {0}")]
    Dns(String),
    /// The SOCKS5 proxy refused or failed.
    #[error("SOCKS5 proxy: {0}")]
    Socks(String),
}

impl EgressError {
    pub(crate) fn io(what: impl Into<String>, source: io::Error) -> Self {
        EgressError::Io {
            what: what.into(),
            source,
        }
    }
}

/// How the egress layer runs.
#[derive(Debug, Clone)]
pub struct EgressConfig {
    /// Where the resolver listens (UDP and TCP); the kernel redirects port 53 here.
    pub dns_listen: SocketAddr,
    /// Where the proxy listens (TCP).
    pub proxy_listen: SocketAddr,
    /// Upstream DNS servers for sandboxes that name none (the operator's: exempt from
    /// the address guard).
    pub upstream_dns: Vec<Ipv4Addr>,
    /// The node's destination rules (never relaxed by a policy).
    pub guard: AddressGuard,
    /// Where audit trails are written (`<id>.net.jsonl`).
    pub log_dir: PathBuf,
    /// Rotation size of one trail file.
    pub log_max_bytes: u64,
    /// DNS questions per second per sandbox (sustained) and burst; excess is refused.
    pub dns_rate: (u32, u32),
    /// How long the proxy waits for a client's first bytes on ports other than 80 and
    /// 443 (server-first protocols send nothing) before deciding without a name.
    pub first_bytes_wait: Duration,
    /// Where the interception CA lives (`egress-ca.key`, 0600, and `egress-ca.pem`);
    /// made on first start. `None`: no interception (HTTPS requests to a domain with
    /// header rules are refused).
    pub ca_dir: Option<PathBuf>,
    /// Extra CA certificates (PEM file) trusted for destinations of intercepted
    /// connections, besides the system's roots.
    pub upstream_ca: Option<PathBuf>,
}

/// Where the proxy gets the values of `${e2b.secrets.NAME}` placeholders: the server's
/// secrets store, for the team that owns the sandbox. Called per request; the value is
/// dropped (zeroed) after the request head is sent.
pub trait SecretSource: Send + Sync {
    /// The value of the sandbox's team's secret `name` (lowercase), if it exists.
    fn secret(&self, sandbox_id: &str, name: &str) -> Option<zeroize::Zeroizing<Vec<u8>>>;
}

impl EgressConfig {
    /// Defaults around the given ports, guard and log directory: upstream DNS from the
    /// host's `/etc/resolv.conf` (non-loopback; else 8.8.8.8 and 1.1.1.1), 4 MiB trails,
    /// 200 DNS questions per second (burst 400), 300 ms first-bytes wait.
    pub fn new(dns_port: u16, proxy_port: u16, guard: AddressGuard, log_dir: PathBuf) -> Self {
        let mut upstream = std::fs::read_to_string("/etc/resolv.conf")
            .map(|t| cubicle_runtime::network::parse_resolv_conf(&t))
            .unwrap_or_default();
        if upstream.is_empty() {
            upstream = vec![Ipv4Addr::new(8, 8, 8, 8), Ipv4Addr::new(1, 1, 1, 1)];
        }
        EgressConfig {
            dns_listen: SocketAddr::from((Ipv4Addr::UNSPECIFIED, dns_port)),
            proxy_listen: SocketAddr::from((Ipv4Addr::UNSPECIFIED, proxy_port)),
            upstream_dns: upstream,
            guard,
            log_dir,
            log_max_bytes: 4 << 20,
            dns_rate: (200, 400),
            first_bytes_wait: Duration::from_millis(300),
            ca_dir: None,
            upstream_ca: None,
        }
    }
}

/// A token bucket (per-sandbox DNS rate).
#[derive(Debug)]
pub(crate) struct Bucket {
    tokens: f64,
    last: Instant,
}

impl Bucket {
    fn new(burst: u32) -> Self {
        Bucket {
            tokens: burst as f64,
            last: Instant::now(),
        }
    }
    pub(crate) fn take(&mut self, rate: u32, burst: u32) -> bool {
        let now = Instant::now();
        let dt = now.duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * rate as f64).min(burst as f64);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// What the layer knows about one sandbox.
pub(crate) struct SandboxState {
    pub id: String,
    policy: RwLock<Arc<NetworkPolicy>>,
    pub names: Mutex<NameTable>,
    pub dns_bucket: Mutex<Bucket>,
    /// Told of every policy change (the value: whether the sandbox is gone), so that the
    /// proxy's live connections are judged again (`proxy::cut_when_refused`).
    changes: tokio::sync::watch::Sender<bool>,
}

impl SandboxState {
    pub(crate) fn policy(&self) -> Arc<NetworkPolicy> {
        self.policy
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// A receiver of the changes after this call (take it before reading the policy a
    /// decision is made with, so that no change falls in between).
    pub(crate) fn changes(&self) -> tokio::sync::watch::Receiver<bool> {
        self.changes.subscribe()
    }
}

pub(crate) struct Shared {
    pub config: EgressConfig,
    sandboxes: RwLock<HashMap<Ipv4Addr, Arc<SandboxState>>>,
    pub audit: AuditLog,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// The kernel event threads, when watched.
    watch: Mutex<Option<Watch>>,
    /// When each direct connection (conntrack id) opened, for its duration.
    opened: Mutex<HashMap<u32, Instant>>,
    /// Where the resolver and proxy actually listen (ports resolved).
    pub dns_addr: SocketAddr,
    pub proxy_addr: SocketAddr,
    /// The interception CA, when `ca_dir` was given and it loaded.
    pub interceptor: Option<Arc<intercept::Interceptor>>,
    /// Secret values for header rules (installed by the server).
    secrets: RwLock<Option<Arc<dyn SecretSource>>>,
    /// Connections the proxy relays now.
    pub relayed: std::sync::atomic::AtomicUsize,
}

impl Shared {
    pub(crate) fn sandbox(&self, ip: Ipv4Addr) -> Option<Arc<SandboxState>> {
        self.sandboxes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ip)
            .cloned()
    }

    /// The value of `sandbox`'s secret `name`, if a source is installed and has it.
    pub(crate) fn secret(&self, sandbox: &str, name: &str) -> Option<zeroize::Zeroizing<Vec<u8>>> {
        let src = self
            .secrets
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()?;
        src.secret(sandbox, name)
    }

    /// Upstream servers for a sandbox's questions.
    pub(crate) fn upstreams(&self, policy: &NetworkPolicy) -> Vec<Ipv4Addr> {
        policy
            .dns_servers
            .clone()
            .unwrap_or_else(|| self.config.upstream_dns.clone())
    }
}

/// The running egress layer. Cheap to clone.
#[derive(Clone)]
pub struct Egress {
    shared: Arc<Shared>,
}

/// Binds, retrying for a second while the address is in use (a node that closed a
/// moment ago in this process may still be releasing it).
fn bind_retrying<T>(bind: impl Fn() -> io::Result<T>) -> io::Result<T> {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        match bind() {
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            r => return r,
        }
    }
}

/// The resolver's UDP socket and its TCP listener, on one port. With port 0 (any free
/// port) the number the kernel gives the UDP socket may be taken for TCP (by another
/// listener or a connection's local port): then another pair is tried, instead of
/// failing the node's start as a busy host once did.
fn bind_resolver(
    listen: SocketAddr,
) -> Result<(std::net::UdpSocket, std::net::TcpListener), EgressError> {
    let any_port = listen.port() == 0;
    let mut tries = 0;
    loop {
        let udp = bind_retrying(|| std::net::UdpSocket::bind(listen))
            .map_err(|e| bind_err("resolver (UDP)", listen, e))?;
        let addr = udp
            .local_addr()
            .map_err(|e| EgressError::io("resolver address", e))?;
        let tcp = if any_port {
            std::net::TcpListener::bind(addr)
        } else {
            bind_retrying(|| std::net::TcpListener::bind(addr))
        };
        match tcp {
            Ok(tcp) => return Ok((udp, tcp)),
            Err(e) if any_port && e.kind() == io::ErrorKind::AddrInUse && tries < 64 => {
                tries += 1;
            }
            Err(e) => return Err(bind_err("resolver (TCP)", addr, e)),
        }
    }
}

fn bind_err(what: &str, addr: SocketAddr, e: io::Error) -> EgressError {
    EgressError::io(
        format!("binding the egress {what} on {addr} (is another node running here?)"),
        e,
    )
}

impl Egress {
    /// Binds the resolver (UDP + TCP) and the proxy and starts serving them on `handle`.
    pub fn start(
        config: EgressConfig,
        handle: &tokio::runtime::Handle,
    ) -> Result<Egress, EgressError> {
        let (udp, dns_tcp) = bind_resolver(config.dns_listen)?;
        let dns_addr = udp
            .local_addr()
            .map_err(|e| EgressError::io("resolver address", e))?;
        let proxy = bind_retrying(|| std::net::TcpListener::bind(config.proxy_listen))
            .map_err(|e| bind_err("proxy", config.proxy_listen, e))?;
        let proxy_addr = proxy
            .local_addr()
            .map_err(|e| EgressError::io("proxy address", e))?;
        for r in [
            udp.set_nonblocking(true),
            dns_tcp.set_nonblocking(true),
            proxy.set_nonblocking(true),
        ] {
            r.map_err(|e| EgressError::io("making the egress sockets non-blocking", e))?;
        }
        let audit = AuditLog::new(config.log_dir.clone(), config.log_max_bytes);
        let interceptor = match &config.ca_dir {
            Some(dir) => {
                match intercept::Interceptor::load_or_create(dir, config.upstream_ca.clone()) {
                    Ok(i) => Some(Arc::new(i)),
                    Err(e) => {
                        tracing::warn!("egress: HTTPS header rules unavailable: {e}");
                        None
                    }
                }
            }
            None => None,
        };
        let shared = Arc::new(Shared {
            config,
            sandboxes: RwLock::new(HashMap::new()),
            audit,
            tasks: Mutex::new(Vec::new()),
            watch: Mutex::new(None),
            opened: Mutex::new(HashMap::new()),
            dns_addr,
            proxy_addr,
            interceptor,
            secrets: RwLock::new(None),
            relayed: std::sync::atomic::AtomicUsize::new(0),
        });
        let _guard = handle.enter();
        let udp = tokio::net::UdpSocket::from_std(udp)
            .map_err(|e| EgressError::io("resolver socket", e))?;
        let dns_tcp = tokio::net::TcpListener::from_std(dns_tcp)
            .map_err(|e| EgressError::io("resolver socket", e))?;
        let proxy = tokio::net::TcpListener::from_std(proxy)
            .map_err(|e| EgressError::io("proxy socket", e))?;
        let tasks = vec![
            handle.spawn(resolver::serve_udp(shared.clone(), udp)),
            handle.spawn(resolver::serve_tcp(shared.clone(), dns_tcp)),
            handle.spawn(proxy::serve(shared.clone(), proxy)),
        ];
        *shared.tasks.lock().unwrap_or_else(|p| p.into_inner()) = tasks;
        tracing::info!("egress: resolver on {dns_addr}, proxy on {proxy_addr}");
        Ok(Egress { shared })
    }

    /// Installs where `${e2b.secrets.NAME}` values come from.
    pub fn set_secret_source(&self, source: Arc<dyn SecretSource>) {
        *self
            .shared
            .secrets
            .write()
            .unwrap_or_else(|p| p.into_inner()) = Some(source);
    }

    /// The interception CA's certificate (PEM), which sandboxes must trust, when the
    /// node has one.
    pub fn ca_pem(&self) -> Option<String> {
        self.shared
            .interceptor
            .as_ref()
            .map(|i| i.ca_pem().to_string())
    }

    /// Where the resolver listens.
    pub fn dns_addr(&self) -> SocketAddr {
        self.shared.dns_addr
    }

    /// Where the proxy listens.
    pub fn proxy_addr(&self) -> SocketAddr {
        self.shared.proxy_addr
    }

    /// Sets (or replaces) the policy of sandbox `id` at address `ip`. Takes effect for
    /// the next question or connection; of the connections the proxy relays for it, those
    /// the new policy refuses are cut (reset), the others go on.
    pub fn register(&self, ip: Ipv4Addr, id: &str, policy: NetworkPolicy) {
        let mut map = self
            .shared
            .sandboxes
            .write()
            .unwrap_or_else(|p| p.into_inner());
        match map.get(&ip) {
            Some(s) if s.id == id => {
                *s.policy.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(policy);
                s.changes.send_modify(|_| ());
            }
            _ => {
                let old = map.insert(
                    ip,
                    Arc::new(SandboxState {
                        id: id.to_string(),
                        policy: RwLock::new(Arc::new(policy)),
                        names: Mutex::new(NameTable::default()),
                        dns_bucket: Mutex::new(Bucket::new(self.shared.config.dns_rate.1)),
                        changes: tokio::sync::watch::Sender::new(false),
                    }),
                );
                if let Some(old) = old {
                    old.changes.send_replace(true);
                }
            }
        }
    }

    /// Forgets the sandbox at `ip` (it died): its address gets nothing any more, and the
    /// connections the proxy still relays for it are cut.
    pub fn unregister(&self, ip: Ipv4Addr) {
        let gone = self
            .shared
            .sandboxes
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ip);
        if let Some(s) = gone {
            s.changes.send_replace(true);
            self.shared.audit.close(&s.id);
        }
    }

    /// How many connections the proxy relays now (opened and not yet closed or cut).
    pub fn relayed(&self) -> usize {
        self.shared
            .relayed
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Forgets the resolver's answers handed out to the sandbox at `ip` (as their expiry
    /// does, ten minutes at least after them): for the lab's tests.
    #[doc(hidden)]
    pub fn forget_names(&self, ip: Ipv4Addr) {
        if let Some(s) = self.shared.sandbox(ip) {
            *s.names.lock().unwrap_or_else(|p| p.into_inner()) = Default::default();
        }
    }

    /// The policy the layer holds for `ip`.
    pub fn policy_of(&self, ip: Ipv4Addr) -> Option<Arc<NetworkPolicy>> {
        self.shared.sandbox(ip).map(|s| s.policy())
    }

    /// The audit trails.
    pub fn audit(&self) -> &AuditLog {
        &self.shared.audit
    }

    /// The node's destination rules.
    pub fn guard(&self) -> &AddressGuard {
        &self.shared.config.guard
    }

    /// Resolves `host` (a name or an IPv4 literal) to IPv4 addresses through the node's
    /// upstream servers.
    pub async fn resolve(&self, host: &str) -> Result<Vec<Ipv4Addr>, EgressError> {
        if let Ok(ip) = host.parse::<Ipv4Addr>() {
            return Ok(vec![ip]);
        }
        resolver::lookup_a(&self.shared.config.upstream_dns, host).await
    }

    /// Keeps `w` (the kernel event threads feeding [`Egress::record_kernel`]) running
    /// until [`Egress::shutdown`].
    pub fn keep_watch(&self, w: Watch) {
        *self.shared.watch.lock().unwrap_or_else(|p| p.into_inner()) = Some(w);
    }

    /// Records a kernel event (a connection let through straight out, its end, or a
    /// refused attempt) in the trail of the sandbox it belongs to.
    pub fn record_kernel(&self, ev: KernelEvent) {
        let flow = match &ev {
            KernelEvent::Opened { flow, .. }
            | KernelEvent::Closed { flow, .. }
            | KernelEvent::Refused { flow, .. } => *flow,
        };
        let Some(sandbox) = self.shared.sandbox(flow.src) else {
            return;
        };
        let port = (flow.proto == 6 || flow.proto == 17).then_some(flow.port);
        let attempt = policy::Attempt {
            dst: flow.dst,
            port: port.unwrap_or(0),
            name: None,
            dst_is_names: false,
            resolved_as: None,
        };
        let what = match ev {
            KernelEvent::Opened { id, .. } => {
                let mut opened = self.shared.opened.lock().unwrap_or_else(|p| p.into_inner());
                if opened.len() > 100_000 {
                    opened.clear();
                }
                opened.insert(id, Instant::now());
                drop(opened);
                let d = sandbox.policy().decide(&self.shared.config.guard, &attempt);
                EventKind::Connect {
                    proto: flow.proto_name(),
                    dst: flow.dst,
                    port: flow.port,
                    name: None,
                    verdict: Verdict::Allowed,
                    reason: d.reason,
                    via: "direct".into(),
                }
            }
            KernelEvent::Closed {
                id,
                bytes_out,
                bytes_in,
                ..
            } => {
                let since = self
                    .shared
                    .opened
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&id);
                EventKind::Close {
                    proto: flow.proto_name(),
                    dst: flow.dst,
                    port: flow.port,
                    name: None,
                    bytes_out,
                    bytes_in,
                    duration_ms: since.map(|t| t.elapsed().as_millis() as u64).unwrap_or(0),
                    error: None,
                }
            }
            KernelEvent::Refused { chain, .. } => {
                let reason = match chain.as_str() {
                    "limit" => "limit: too many connections, or new connections per second".into(),
                    "node" => match self.shared.config.guard.check(flow.dst, port) {
                        Err(d) => format!("node rule: {}", d.as_str()),
                        Ok(()) => "node rule".into(),
                    },
                    _ => {
                        sandbox
                            .policy()
                            .decide(&self.shared.config.guard, &attempt)
                            .reason
                    }
                };
                EventKind::Connect {
                    proto: flow.proto_name(),
                    dst: flow.dst,
                    port: flow.port,
                    name: None,
                    verdict: Verdict::Denied,
                    reason,
                    via: "direct".into(),
                }
            }
        };
        self.shared.audit.record(&sandbox.id, what);
    }

    /// Stops serving (tests; a node process simply exits).
    pub fn shutdown(&self) {
        if let Some(w) = self
            .shared
            .watch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            w.stop();
        }
        for t in self
            .shared
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            t.abort();
        }
    }
}
