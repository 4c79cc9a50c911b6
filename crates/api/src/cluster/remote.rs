//! [`RemoteBackend`]: the [`Backend`] of an API replica, calling `cubicle node`s over
//! their node-side API ([`super::node_api`]).
//!
//! The trait's synchronous reads (`get`, `peek`, `pool`, `host`, `snapshots`, …) are
//! answered from a cache of each node's `GET /node/v1/status`, polled every
//! `poll_interval` and updated by every call that changes a sandbox (create, kill,
//! timeout, pause, resume, …), so the data plane's hot path (`peek` per request) does no
//! I/O. A poll asks for what changed since the last one (`super::journal`): an idle
//! node's answer is a few hundred bytes however many sandboxes it holds. The synchronous
//! calls the trait documents as blocking (`set_timeout`, `stats`, `template_exists`) make their HTTP call in place (`block_in_place`: the replica runs
//! on tokio's multi-threaded runtime). The trait itself is unchanged.
//!
//! Placement (several nodes given with `--node`): among nodes that answered their last
//! poll, one with a ready warm-pool sandbox of the template first, then the most free
//! memory per sandbox slot left; the choice and its reason are logged. With the
//! cluster's database the node list, placement and ownership come from there instead
//! ([`super::coordination`]).
//!
//! With the cluster's database, template builds and volumes are relayed to nodes
//! ([`super::templates`], [`super::volumes`]); a `--node` replica refuses them
//! (`templates()` is `None`: "this server cannot build templates"). Not over the wire
//! yet: the sandboxes' envd logs (`log_path` names no file on the replica), and secrets
//! in egress header rules (the node has no store).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode, header};
use hyper_util::{
    client::legacy::Client,
    rt::{TokioExecutor, TokioTimer},
};
use serde::de::DeserializeOwned;

use cubicle_node::runtime::SandboxStats;
use cubicle_node::{
    CreateRequest, NetEvent, NetworkPolicy, PauseReport, PauseRequest, ResumeOutcome, SandboxInfo,
    SnapshotRecord, SnapshotReport, SnapshotRequest,
};

use super::{JournalMark, NodeStatus, WireError, WireResult, WireTimeout};
use crate::backend::{Backend, BoxFuture};

/// How a replica reaches its nodes.
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    /// Node addresses, `http://host:port` or `host:port` (`https://host:port` with
    /// `tls`).
    pub nodes: Vec<String>,
    /// The shared node token.
    pub token: String,
    /// TLS to the nodes (then every address is `https://`).
    pub tls: Option<cubicle_router::NodeTls>,
    /// How often each node's status is polled.
    pub poll_interval: Duration,
    /// Limit on one call to a node (creates and checkpoints get `long_timeout`).
    pub timeout: Duration,
    /// Limit on calls that may take long (create, pause, resume, snapshot, fork).
    pub long_timeout: Duration,
    /// Where this replica keeps its copies of the sandboxes' envd logs (relayed from
    /// their nodes, [`Backend::fetch_log`]); one directory per replica.
    pub log_dir: PathBuf,
}

impl RemoteConfig {
    /// Defaults: poll every 500 ms, 10 s per call, 10 min for slow ones.
    pub fn new(nodes: Vec<String>, token: String) -> Self {
        RemoteConfig {
            nodes,
            token,
            tls: None,
            poll_interval: Duration::from_millis(500),
            timeout: Duration::from_secs(10),
            long_timeout: Duration::from_secs(600),
            log_dir: std::env::temp_dir()
                .join(format!("cubicle-replica-{}-logs", std::process::id())),
        }
    }
}

/// The backend of an API replica. Cheap to clone.
#[derive(Clone)]
pub struct RemoteBackend {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    /// Every node this replica has known (indices are stable: links are only added;
    /// a node that left the cluster is retired, not removed).
    nodes: RwLock<Vec<Arc<NodeLink>>>,
    client: Client<cubicle_router::NodeConnector, Full<Bytes>>,
    auth: String,
    /// `http` or `https` (with `cfg.tls`).
    scheme: &'static str,
    cfg: RemoteConfig,
    pub(super) cache: Mutex<HashMap<String, Entry>>,
    /// Placement and ownership through the cluster's database (replicas started with
    /// `--database` and no `--node`).
    pub(super) cluster: OnceLock<Arc<super::coordination::ClusterDb>>,
    /// Sandboxes that moved to another node while the one they left still lists them
    /// (`super::migrate`).
    pub(super) moved: Mutex<HashMap<String, super::migrate::MovedAway>>,
    /// Held while a sandbox moves (moves are rare: one at a time).
    pub(super) move_lock: tokio::sync::Mutex<()>,
    /// Held while every node is polled; when the last such poll started (see
    /// [`RemoteBackend::poll_all_since`]).
    full_poll: tokio::sync::Mutex<Option<Instant>>,
}

/// Polls between two full ones (one every half minute at the default interval): what a
/// delta cannot bring back — a change this replica skipped because it had learnt
/// something newer, which the node lists again only when it changes again — is corrected
/// within this many polls.
const FULL_POLL_EVERY: u32 = 60;

/// Polls in a row that run out of time before a node counts as down (placement skips
/// it, creates fail over): under heavy load (a host filling to 10,000 sandboxes) a single
/// status can take longer than the call limit while the node still works.
const SLOW_POLLS_DOWN: u32 = 3;

/// A node's sandboxes as this replica's polls of its journal follow them.
#[derive(Debug, Default)]
pub(super) struct Listed {
    /// The mark of the last answer applied (`None`: the next poll asks for everything).
    mark: Option<JournalMark>,
    /// Polls since the last full one.
    since_full: u32,
    /// The ids the node lists.
    pub(super) ids: HashSet<String>,
}

impl Listed {
    /// Follows one status answer (its `sandboxes` and `removed` taken out of it).
    fn apply(&mut self, st: &NodeStatus, sandboxes: &[SandboxInfo], removed: &[String]) {
        if st.delta {
            self.since_full += 1;
            for id in removed {
                self.ids.remove(id);
            }
        } else {
            self.since_full = 0;
            self.ids.clear();
        }
        self.ids.extend(sandboxes.iter().map(|s| s.id.to_string()));
        self.mark = st.journal;
        if st.journal.is_some() && self.ids.len() != st.count {
            tracing::warn!(
                listed = self.ids.len(),
                node_lists = st.count,
                "this replica's view of a node's sandboxes counts otherwise than the node: asking for the full list"
            );
            self.mark = None;
        }
    }
}

pub(super) struct NodeLink {
    /// `host:port`.
    pub(super) addr: String,
    /// Its name in the cluster's database (`None` for a `--node` address).
    pub(super) name: Option<String>,
    /// Its last status (without its sandboxes: those are in `listed` and the cache);
    /// `None` until it first answered.
    pub(super) status: Mutex<Option<NodeStatus>>,
    /// The sandboxes it lists.
    pub(super) listed: Mutex<Listed>,
    /// Whether its last poll answered, and the error if not.
    pub(super) down: Mutex<Option<String>>,
    /// Polls in a row that ran out of time (`SLOW_POLLS_DOWN`).
    slow_polls: AtomicU32,
    /// Left the cluster (lost, or moved to another address): not polled, not placed on.
    pub(super) retired: AtomicBool,
}

pub(super) struct Entry {
    pub(super) node: usize,
    info: SandboxInfo,
    /// When this replica last learnt something about it (a poll that started earlier
    /// must not undo a create or kill that happened after).
    at: Instant,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `host:port` of a node address as the cluster's database has it (`http://host:port`,
/// `https://host:port` or `host:port`); the scheme this replica uses is its own (TLS to
/// every node, or to none).
pub(super) fn host_port(n: &str) -> cubicle_node::Result<String> {
    let t = n.trim();
    let a = t
        .strip_prefix("http://")
        .or_else(|| t.strip_prefix("https://"))
        .unwrap_or(t)
        .trim_end_matches('/');
    if a.is_empty() || a.contains('/') {
        return Err(cubicle_node::Error::InvalidRequest(format!(
            "node address '{n}' is not http(s)://HOST:PORT"
        )));
    }
    Ok(a.to_string())
}

impl NodeLink {
    pub(super) fn new(addr: String, name: Option<String>) -> Self {
        NodeLink {
            addr,
            name,
            status: Mutex::new(None),
            listed: Mutex::new(Listed::default()),
            down: Mutex::new(None),
            slow_polls: AtomicU32::new(0),
            retired: AtomicBool::new(false),
        }
    }

    pub(super) fn retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }
}

fn unreachable(addr: &str, why: impl std::fmt::Display) -> cubicle_node::Error {
    let why = why.to_string();
    if why.contains("certificate") {
        return cubicle_node::Error::Runtime(format!(
            "node {addr}: TLS handshake failed: {why}; the node's certificate must chain to the replica's --node-ca and name the node's address (or --node-server-name), and with --tls-client-ca on the node the replica needs --node-client-cert/--node-client-key"
        ));
    }
    cubicle_node::Error::Runtime(format!(
        "node {addr} is unreachable: {why}; check that `cubicle node` runs there and that this replica can reach it"
    ))
}

/// `host:port` of a node address given as `SCHEME://HOST:PORT` or `HOST:PORT`, whose
/// scheme must be the replica's (`https` exactly when TLS to the nodes is set up).
fn node_authority(n: &str, scheme: &str) -> Result<String, cubicle_node::Error> {
    let t = n.trim();
    let (given, rest) = match t.split_once("://") {
        Some((s, rest)) => (Some(s), rest),
        None => (None, t),
    };
    let a = rest.trim_end_matches('/');
    if a.is_empty() || a.contains('/') || given.is_some_and(|g| g != "http" && g != "https") {
        return Err(cubicle_node::Error::InvalidRequest(format!(
            "node address '{n}' is not {scheme}://HOST:PORT"
        )));
    }
    match given {
        Some("https") if scheme != "https" => Err(cubicle_node::Error::InvalidRequest(format!(
            "node address '{n}' is https:// but TLS to the nodes is not set up (all node addresses https://, with --node-ca for the cluster's CA)"
        ))),
        Some("http") if scheme == "https" => Err(cubicle_node::Error::InvalidRequest(format!(
            "node address '{n}' is http:// while other nodes are reached over TLS: give every node as https:// (or none)"
        ))),
        _ => Ok(a.to_string()),
    }
}

impl RemoteBackend {
    /// A backend over the nodes of `cfg`; polls each once (at least one must answer).
    pub async fn connect(cfg: RemoteConfig) -> Result<Self, cubicle_node::Error> {
        if cfg.nodes.is_empty() {
            return Err(cubicle_node::Error::InvalidRequest(
                "no node address given (--node http://HOST:PORT)".into(),
            ));
        }
        let scheme = if cfg.tls.is_some() { "https" } else { "http" };
        let nodes = cfg
            .nodes
            .iter()
            .map(|n| node_authority(n, scheme).map(|a| Arc::new(NodeLink::new(a, None))))
            .collect::<Result<Vec<_>, _>>()?;
        let rb = Self::with_links(cfg, nodes)?;
        rb.poll_all().await;
        let links = rb.links();
        let up = links.iter().filter(|n| lock(&n.down).is_none()).count();
        if up == 0 {
            let why: Vec<String> = links
                .iter()
                .map(|n| format!("{}: {}", n.addr, lock(&n.down).clone().unwrap_or_default()))
                .collect();
            return Err(cubicle_node::Error::Runtime(format!(
                "no node answered: {}",
                why.join("; ")
            )));
        }
        Ok(rb)
    }

    /// A backend over `links` (no call made yet).
    pub(super) fn with_links(
        cfg: RemoteConfig,
        links: Vec<Arc<NodeLink>>,
    ) -> Result<Self, cubicle_node::Error> {
        let scheme = if cfg.tls.is_some() { "https" } else { "http" };
        let connector = cubicle_router::node_connector(cfg.tls.as_ref(), Duration::from_secs(3))
            .map_err(|e| cubicle_node::Error::Runtime(e.to_string()))?;
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        Ok(RemoteBackend {
            inner: Arc::new(Inner {
                nodes: RwLock::new(links),
                client,
                auth: format!("Bearer {}", cfg.token),
                scheme,
                cfg,
                cache: Mutex::new(HashMap::new()),
                cluster: OnceLock::new(),
                moved: Mutex::new(HashMap::new()),
                move_lock: tokio::sync::Mutex::new(()),
                full_poll: tokio::sync::Mutex::new(None),
            }),
        })
    }

    /// Node `i`'s link.
    pub(super) fn link(&self, i: usize) -> Arc<NodeLink> {
        self.inner.nodes.read().unwrap_or_else(|p| p.into_inner())[i].clone()
    }

    /// Every link, by index.
    pub(super) fn links(&self) -> Vec<Arc<NodeLink>> {
        self.inner
            .nodes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Adds a link; returns its index.
    pub(super) fn add_link(&self, link: NodeLink) -> usize {
        let mut v = self.inner.nodes.write().unwrap_or_else(|p| p.into_inner());
        v.push(Arc::new(link));
        v.len() - 1
    }

    pub(super) fn inner(&self) -> &Inner {
        &self.inner
    }

    /// Keeps the cache current in the background (until the task is aborted).
    pub fn spawn_poller(&self) -> tokio::task::JoinHandle<()> {
        let rb = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(rb.inner.cfg.poll_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                rb.poll_all_since(Instant::now()).await;
            }
        })
    }

    /// The address (`host:port`) of the node that runs sandbox `id`.
    pub fn node_of(&self, id: &str) -> Option<String> {
        let i = self.owner(id).ok()?;
        Some(self.link(i).addr.clone())
    }

    /// The nodes and whether they answered their last poll (`None`) or why not.
    pub fn nodes(&self) -> Vec<(String, Option<String>)> {
        self.links()
            .iter()
            .filter(|n| !n.retired())
            .map(|n| (n.addr.clone(), lock(&n.down).clone()))
            .collect()
    }

    pub(super) async fn poll_all(&self) {
        let links = self.links();
        let polls = (0..links.len())
            .filter(|i| !links[*i].retired())
            .map(|i| self.poll(i));
        futures_util::future::join_all(polls).await;
    }

    /// Every node polled by a poll that started at `t` or later: one already done or
    /// under way is waited for and reused, so that listings that come together (and the
    /// background poller) share polls instead of each making its own.
    pub(super) async fn poll_all_since(&self, t: Instant) {
        let mut last = self.inner.full_poll.lock().await;
        if last.is_some_and(|started| started >= t) {
            return;
        }
        let started = Instant::now();
        self.poll_all().await;
        *last = Some(started);
    }

    /// Polls node `i`'s status into the cache: what changed since its last answer
    /// (`super::journal`), or everything when this replica has no mark of that node's
    /// journal, its view of the node counts otherwise than the node, or
    /// [`FULL_POLL_EVERY`] polls went by.
    pub(super) async fn poll(&self, i: usize) {
        let t0 = Instant::now();
        let link = self.link(i);
        let path = {
            let l = lock(&link.listed);
            match l.mark {
                Some(m) if l.since_full < FULL_POLL_EVERY => {
                    format!("/status?epoch={}&since={}", m.epoch, m.generation)
                }
                _ => "/status".to_string(),
            }
        };
        // The time limit is the poll's own: a poll that runs out of it is a slow node,
        // down only after `SLOW_POLLS_DOWN` in a row; any other failure is down at once.
        let limit = self.inner.cfg.timeout;
        let answer = tokio::time::timeout(
            limit,
            self.call::<NodeStatus>(i, Method::GET, &path, None, true),
        )
        .await;
        let answer = match answer {
            Ok(a) => a,
            Err(_) => {
                let n = link.slow_polls.fetch_add(1, Ordering::Relaxed) + 1;
                if n < SLOW_POLLS_DOWN {
                    tracing::warn!(node = %link.addr, "node is slow: its status took longer than {limit:?} ({n} poll(s) in a row; down after {SLOW_POLLS_DOWN})");
                    return;
                }
                Err(unreachable(
                    &link.addr,
                    format!("no status within {limit:?} in {n} polls in a row"),
                ))
            }
        };
        match answer {
            Ok(mut st) => {
                link.slow_polls.store(0, Ordering::Relaxed);
                let sandboxes = std::mem::take(&mut st.sandboxes);
                let removed = std::mem::take(&mut st.removed);
                let moved_away = {
                    let mut l = lock(&link.listed);
                    l.apply(&st, &sandboxes, &removed);
                    self.moved_away_from(i, &l.ids)
                };
                let mut recheck = Vec::new();
                {
                    let mut cache = lock(&self.inner.cache);
                    if st.delta {
                        for id in &removed {
                            match cache.get(id.as_str()) {
                                Some(e) if e.node == i && e.at > t0 => recheck.push(id.clone()),
                                Some(e) if e.node == i => {
                                    cache.remove(id.as_str());
                                }
                                _ => {}
                            }
                        }
                    } else {
                        let present: HashSet<&str> =
                            sandboxes.iter().map(|s| s.id.as_str()).collect();
                        cache.retain(|id, e| {
                            e.node != i || e.at > t0 || present.contains(id.as_str())
                        });
                    }
                    for s in sandboxes {
                        if moved_away.contains(s.id.as_str()) {
                            continue;
                        }
                        match cache.get_mut(s.id.as_str()) {
                            Some(e) if e.at > t0 => {}
                            _ => {
                                cache.insert(
                                    s.id.to_string(),
                                    Entry {
                                        node: i,
                                        info: s,
                                        at: t0,
                                    },
                                );
                            }
                        }
                    }
                }
                if !recheck.is_empty() {
                    // Gone on the node, but this replica learnt of them after the poll
                    // started (a create's or refresh's answer): the node's word on each
                    // decides (a full poll would have dropped them at the next one; a
                    // delta does not list them again).
                    let rb = self.clone();
                    tokio::spawn(async move {
                        for id in recheck {
                            rb.refresh(i, &id).await;
                        }
                    });
                }
                *lock(&link.status) = Some(st);
                if let Some(was) = lock(&link.down).take() {
                    tracing::info!(node = %link.addr, "node answers again (was: {was})");
                }
            }
            Err(e) => {
                let mut down = lock(&link.down);
                if down.is_none() {
                    tracing::warn!(node = %link.addr, "node does not answer: {e}");
                }
                *down = Some(e.to_string());
            }
        }
    }

    /// One call to node `i`: JSON in, JSON out, node errors turned back into theirs.
    pub(super) async fn call<T: DeserializeOwned>(
        &self,
        i: usize,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        long: bool,
    ) -> cubicle_node::Result<T> {
        let headers = match body {
            Some(_) => vec![(header::CONTENT_TYPE, "application/json".to_string())],
            None => Vec::new(),
        };
        let limit = if long {
            self.inner.cfg.long_timeout
        } else {
            self.inner.cfg.timeout
        };
        let body = Bytes::from(body.unwrap_or_default());
        let (status, _, bytes) = self
            .exchange(i, method, path, &headers, body, limit)
            .await?;
        let link = self.link(i);
        let addr = &link.addr;
        if !status.is_success() {
            return Err(match serde_json::from_slice::<WireError>(&bytes) {
                Ok(w) => w.into_node(),
                Err(_) => cubicle_node::Error::Runtime(format!(
                    "node {addr} answered {status}: {}",
                    String::from_utf8_lossy(&bytes[..bytes.len().min(512)])
                )),
            });
        }
        let bytes = if bytes.is_empty() {
            Bytes::from_static(b"null")
        } else {
            bytes
        };
        serde_json::from_slice(&bytes).map_err(|e| {
            cubicle_node::Error::Runtime(format!("node {addr} answered something unreadable: {e}"))
        })
    }

    /// Sends `method path` (under `/node/v1`, with its query) to node `i` as it is: the
    /// given headers and `body`, the answer's status, content type and body back
    /// unchanged (for relayed API requests, `super::templates`). Transport failures and a
    /// refused token are errors; any status the node answers is not.
    pub(super) async fn call_raw(
        &self,
        i: usize,
        method: Method,
        path: &str,
        headers: &[(header::HeaderName, String)],
        body: Bytes,
    ) -> cubicle_node::Result<(StatusCode, Option<String>, Bytes)> {
        let limit = self.inner.cfg.long_timeout;
        self.exchange(i, method, path, headers, body, limit).await
    }

    /// The one request/answer exchange with node `i` that [`Self::call`] and
    /// [`Self::call_raw`] share: the node token added, the answer read whole within
    /// `limit`; transport failures, the time limit and a refused token are errors.
    async fn exchange(
        &self,
        i: usize,
        method: Method,
        path: &str,
        headers: &[(header::HeaderName, String)],
        body: Bytes,
        limit: Duration,
    ) -> cubicle_node::Result<(StatusCode, Option<String>, Bytes)> {
        let link = self.link(i);
        let addr = &link.addr;
        let uri = format!("{}://{addr}{}{path}", self.inner.scheme, super::PREFIX);
        let mut req = Request::builder()
            .method(method)
            .uri(&uri)
            .header(header::AUTHORIZATION, &self.inner.auth);
        for (k, v) in headers {
            req = req.header(k, v);
        }
        let req = req
            .body(Full::new(body))
            .map_err(|e| cubicle_node::Error::Runtime(format!("request to node {addr}: {e}")))?;
        let exchange = async {
            let resp = self
                .inner
                .client
                .request(req)
                .await
                .map_err(|e| unreachable(addr, cubicle_router::error_chain(&e)))?;
            let status = resp.status();
            let ctype = resp
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .map(String::from);
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| unreachable(addr, format!("reading its answer: {e}")))?
                .to_bytes();
            Ok::<_, cubicle_node::Error>((status, ctype, bytes))
        };
        let r = tokio::time::timeout(limit, exchange)
            .await
            .map_err(|_| unreachable(addr, format!("no answer within {limit:?}")))??;
        if r.0 == StatusCode::UNAUTHORIZED {
            return Err(cubicle_node::Error::Runtime(format!(
                "node {addr} refused this replica's node token (401): give the replica and the node the same --node-token-file"
            )));
        }
        Ok(r)
    }

    /// The cluster's node token (the node-side keyring derives from it:
    /// `super::volumes::node_keyring`).
    pub(super) fn token(&self) -> &str {
        &self.inner.cfg.token
    }

    /// Node index of sandbox `id`, or not found. With the cluster's database, a sandbox
    /// this replica has not seen yet (created through another replica a moment ago) is
    /// looked up there: its owner's node.
    pub(super) fn owner(&self, id: &str) -> cubicle_node::Result<usize> {
        if let Some(e) = lock(&self.inner.cache).get(id) {
            return Ok(e.node);
        }
        match self.inner.cluster.get() {
            Some(db) => db.owner_link(self, id),
            None => Err(cubicle_node::Error::SandboxNotFound(id.to_string())),
        }
    }

    pub(super) fn remember(&self, node: usize, info: SandboxInfo) {
        lock(&self.inner.cache).insert(
            info.id.to_string(),
            Entry {
                node,
                info,
                at: Instant::now(),
            },
        );
    }

    /// Drops sandbox `id` from the cache (its node no longer has it).
    pub(super) fn forget(&self, id: &str) {
        lock(&self.inner.cache).remove(id);
    }

    /// Re-reads sandbox `id` from its node into the cache (gone: removed).
    pub(super) async fn refresh(&self, node: usize, id: &str) {
        match self
            .call::<SandboxInfo>(node, Method::GET, &format!("/sandboxes/{id}"), None, false)
            .await
        {
            Ok(info) => self.remember(node, info),
            Err(cubicle_node::Error::SandboxNotFound(_)) => self.forget(id),
            Err(_) => {}
        }
    }

    /// Where a sandbox of `template` goes, never on a node in `except`, and why.
    pub(super) fn place_except(
        &self,
        template: &str,
        except: &[usize],
    ) -> cubicle_node::Result<(usize, String)> {
        let links = self.links();
        let live: HashMap<usize, usize> = {
            let cache = lock(&self.inner.cache);
            let mut m = HashMap::new();
            for e in cache.values() {
                if e.info.state != cubicle_node::SandboxState::Dead {
                    *m.entry(e.node).or_insert(0) += 1;
                }
            }
            m
        };
        let mut best: Option<(usize, (bool, u64), String)> = None;
        let mut skipped = Vec::new();
        for (i, n) in links.iter().enumerate() {
            if n.retired() {
                continue;
            }
            if let Some(why) = lock(&n.down).clone() {
                skipped.push(format!("{} down ({why})", n.addr));
                continue;
            }
            if except.contains(&i) {
                continue;
            }
            let Some(st) = lock(&n.status).clone() else {
                continue;
            };
            if st.draining {
                skipped.push(format!("{} draining", n.addr));
                continue;
            }
            let used = live.get(&i).copied().unwrap_or(0);
            let slots = (st.max_sandboxes as usize).saturating_sub(used);
            if slots == 0 {
                skipped.push(format!("{} full ({used} sandboxes)", n.addr));
                continue;
            }
            let warm = st.pool.ready.get(template).copied().unwrap_or(0) > 0;
            let free = st.host.memory_available >> 20;
            let key = (warm, free);
            let why = format!(
                "{}: {} warm {template} sandbox(es), {free} MiB free, {used} of {} slots used",
                n.addr,
                st.pool.ready.get(template).copied().unwrap_or(0),
                st.max_sandboxes
            );
            if best.as_ref().is_none_or(|(_, k, _)| key > *k) {
                best = Some((i, key, why));
            }
        }
        match best {
            Some((i, _, why)) => {
                let why = if skipped.is_empty() {
                    why
                } else {
                    format!("{why}; skipped {}", skipped.join(", "))
                };
                Ok((i, why))
            }
            None => Err(cubicle_node::Error::Capacity(format!(
                "no node can take a sandbox now: {}",
                if skipped.is_empty() {
                    "none has answered yet".to_string()
                } else {
                    skipped.join(", ")
                }
            ))),
        }
    }

    /// Resumes sandbox `id` on node `node` (its owner).
    pub(super) async fn resume_on(
        &self,
        node: usize,
        id: &str,
        timeout: Duration,
        memory: bool,
    ) -> cubicle_node::Result<ResumeOutcome> {
        let body = WireTimeout {
            timeout_ms: timeout.as_millis() as u64,
            memory,
            count: 0,
        };
        let r: cubicle_node::Result<ResumeOutcome> = self
            .call(
                node,
                Method::POST,
                &format!("/sandboxes/{id}/resume"),
                Self::json(&body),
                true,
            )
            .await;
        match &r {
            Ok(out) => self.remember(node, out.info.clone()),
            Err(_) => self.refresh(node, id).await,
        }
        r
    }

    /// Runs a blocking trait method's call in place.
    pub(super) fn block<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
    }

    pub(super) fn json<T: serde::Serialize>(v: &T) -> Option<Vec<u8>> {
        serde_json::to_vec(v).ok()
    }

    pub(super) fn json_body<T: serde::Serialize>(v: &T) -> Option<Vec<u8>> {
        Self::json(v)
    }

    fn statuses(&self) -> Vec<NodeStatus> {
        self.links()
            .iter()
            .filter(|n| !n.retired())
            .filter_map(|n| lock(&n.status).clone())
            .collect()
    }

    /// `info` as cached, or — when it is running past its end time — as its node has it
    /// now: the node ends a sandbox at its timeout and this replica would learn it only
    /// at its next poll, answering "running" meanwhile for a sandbox already gone.
    fn unless_timed_out(
        &self,
        node: usize,
        info: SandboxInfo,
    ) -> cubicle_node::Result<SandboxInfo> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        if info.state != cubicle_node::SandboxState::Running || info.end_at_ms > now {
            return Ok(info);
        }
        let id = info.id.to_string();
        self.block(self.refresh(node, &id));
        lock(&self.inner.cache)
            .get(&id)
            .map(|e| e.info.clone())
            .ok_or(cubicle_node::Error::SandboxNotFound(id))
    }

    /// Appends to this replica's copy of sandbox `id`'s envd log ([`Backend::log_path`])
    /// what its node's log gained since (its length is the offset asked for). Failures
    /// are logged: the logs answer with what was copied before.
    async fn fetch_init_log(&self, id: &str) {
        let Ok(node) = self.owner(id) else {
            return;
        };
        let path = Backend::log_path(self, id);
        let offset = std::fs::metadata(&path).map_or(0, |m| m.len());
        let got: cubicle_node::Result<Vec<u8>> = self
            .call(
                node,
                Method::GET,
                &format!("/sandboxes/{id}/init-log?offset={offset}"),
                None,
                false,
            )
            .await;
        let appended = match got {
            Ok(data) if data.is_empty() => return,
            Ok(data) => std::fs::create_dir_all(&self.inner.cfg.log_dir).and_then(|()| {
                use std::io::Write;
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)?
                    .write_all(&data)
            }),
            Err(e) => {
                tracing::debug!(sandbox = %id, "envd log from its node: {e}");
                return;
            }
        };
        if let Err(e) = appended {
            tracing::warn!(sandbox = %id, path = %path.display(), "copying the envd log from its node: {e}");
        }
    }

    /// The sandboxes whose envd log grew on their node since `marks` (by node address),
    /// one call per node; a node that cannot tell (an error, or no mark of its own
    /// process yet) counts all it lists, and one that is down (its last poll failed)
    /// none: its logs are fetched again once it is back.
    async fn grown_init_logs(
        &self,
        marks: &mut crate::backend::LogMarks,
    ) -> Option<HashSet<String>> {
        let mut grown = HashSet::new();
        for (i, link) in self.links().iter().enumerate() {
            if link.retired() || lock(&link.down).is_some() {
                continue;
            }
            let path = match marks.get(&link.addr) {
                Some(m) => format!("/init-logs/grown?epoch={}&since={}", m.epoch, m.generation),
                None => "/init-logs/grown".to_string(),
            };
            let got: cubicle_node::Result<cubicle_node::init_log::GrownLogs> =
                self.call(i, Method::GET, &path, None, false).await;
            match got {
                Ok(g) => {
                    marks.insert(link.addr.clone(), g.mark);
                    match g.ids {
                        Some(ids) => grown.extend(ids),
                        None => grown.extend(lock(&link.listed).ids.iter().cloned()),
                    }
                }
                Err(e) => {
                    tracing::debug!(node = %link.addr, "which envd logs grew: {e}");
                    grown.extend(lock(&link.listed).ids.iter().cloned());
                }
            }
        }
        Some(grown)
    }

    /// The cluster name of the node that holds snapshot `name` (by id or name), as this
    /// replica last polled the nodes (a snapshot taken through it is polled right away).
    pub(super) fn snapshot_node(&self, name: &str) -> Option<String> {
        self.links().iter().filter(|n| !n.retired()).find_map(|n| {
            let holds = lock(&n.status)
                .as_ref()
                .is_some_and(|st| st.snapshots.iter().any(|s| s.answers_to(name)));
            if holds { n.name.clone() } else { None }
        })
    }
}

impl Backend for RemoteBackend {
    fn template_exists(&self, name: &str) -> cubicle_node::Result<bool> {
        if let Some(db) = self.inner.cluster.get()
            && db.has_template(name)
        {
            // A node reported it with its last lease renewal.
            return Ok(true);
        }
        if super::templates::recorded(self, name) {
            // Built through a replica: in the object store for every node.
            return Ok(true);
        }
        let path = format!("/templates/exists?name={}", percent_encode(name));
        self.block(async {
            let (mut answered, mut last) = (false, None);
            let links = self.links();
            for i in (0..links.len()).filter(|i| !links[*i].retired()) {
                match self.call::<bool>(i, Method::GET, &path, None, false).await {
                    Ok(true) => return Ok(true),
                    Ok(false) => answered = true,
                    Err(e) => last = Some(e),
                }
            }
            match last {
                // Malformed names are refused by every node alike; with no node
                // answering, "not found" would be a lie: say why.
                Some(e) if !answered || matches!(e, cubicle_node::Error::Template(_)) => Err(e),
                _ => Ok(false),
            }
        })
    }

    fn create(&self, req: CreateRequest) -> BoxFuture<'_, cubicle_node::Result<SandboxInfo>> {
        Box::pin(async move {
            if let Some(db) = self.inner.cluster.get() {
                return db.clone().create(self, req).await;
            }
            // The slot counts placement reads are this replica's cache, which misses the
            // creates still under way: a node that answers it is full (or out of memory)
            // is skipped and the next one tried, so a full node is never the end of a
            // create another node could take.
            let mut tried = Vec::new();
            let (node, why, t0, info) = loop {
                let (node, why) = match self.place_except(&req.template, &tried) {
                    Ok(p) => p,
                    Err(e) if tried.is_empty() => return Err(e),
                    Err(_) => {
                        return Err(cubicle_node::Error::Capacity(format!(
                            "every node that could take the sandbox is full (tried {})",
                            tried
                                .iter()
                                .map(|&i| self.link(i).addr.to_string())
                                .collect::<Vec<_>>()
                                .join(", ")
                        )));
                    }
                };
                let t0 = Instant::now();
                match self
                    .call::<SandboxInfo>(node, Method::POST, "/sandboxes", Self::json(&req), true)
                    .await
                {
                    Err(cubicle_node::Error::Capacity(m)) => {
                        tracing::info!(
                            node = %self.link(node).addr,
                            "node has no room ({m}): placing the sandbox elsewhere"
                        );
                        tried.push(node);
                    }
                    r => break (node, why, t0, r?),
                }
            };
            tracing::info!(
                sandbox = %info.id,
                template = %req.template,
                node = %self.link(node).addr,
                claimed = info.claimed,
                ms = t0.elapsed().as_secs_f64() * 1000.0,
                "placed on {why}"
            );
            self.remember(node, info.clone());
            Ok(info)
        })
    }

    fn kill<'a>(&'a self, id: &'a str) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(async move {
            let node = self.owner(id)?;
            self.call::<()>(
                node,
                Method::DELETE,
                &format!("/sandboxes/{id}"),
                None,
                true,
            )
            .await?;
            self.refresh(node, id).await;
            Ok(())
        })
    }

    fn get(&self, id: &str) -> cubicle_node::Result<SandboxInfo> {
        let cached = lock(&self.inner.cache)
            .get(id)
            .map(|e| (e.node, e.info.clone()));
        if let Some((node, info)) = cached {
            return self.unless_timed_out(node, info);
        }
        match self.inner.cluster.get() {
            // Not seen here yet: ask its owner (through the database).
            Some(db) => db.fetch(self, id),
            None => Err(cubicle_node::Error::SandboxNotFound(id.to_string())),
        }
    }

    fn current<'a>(&'a self, id: &'a str) -> BoxFuture<'a, cubicle_node::Result<SandboxInfo>> {
        Box::pin(async move {
            if let Some(db) = self.inner.cluster.get() {
                match db.fetch_fresh(self, id).await {
                    Ok(Some(info)) => return Ok(info),
                    Err(e @ cubicle_node::Error::SandboxNotFound(_)) => return Err(e),
                    // Not recorded yet, or its node or the database not answering: what
                    // this replica last knew.
                    Ok(None) | Err(_) => {}
                }
            }
            self.peek(id)
        })
    }

    fn refresh_all(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if self.is_coordinated() {
                self.poll_all_since(Instant::now()).await;
            }
        })
    }

    fn record_new(
        &self,
        store: &cubicle_store::Store,
        row: &cubicle_store::SandboxRow,
    ) -> cubicle_store::Result<()> {
        match self.inner.cluster.get() {
            Some(db) => db.commit(self, store, row),
            None => store.insert_sandbox(row),
        }
    }

    fn set_timeout(&self, id: &str, timeout: Duration) -> cubicle_node::Result<()> {
        let node = self.owner(id)?;
        let body = WireTimeout {
            timeout_ms: timeout.as_millis() as u64,
            ..Default::default()
        };
        let info: SandboxInfo = self.block(self.call(
            node,
            Method::POST,
            &format!("/sandboxes/{id}/timeout"),
            Self::json(&body),
            false,
        ))?;
        self.remember(node, info);
        Ok(())
    }

    fn stats(&self, id: &str) -> cubicle_node::Result<SandboxStats> {
        let node = self.owner(id)?;
        self.block(self.call(
            node,
            Method::GET,
            &format!("/sandboxes/{id}/stats"),
            None,
            false,
        ))
    }

    fn log_path(&self, id: &str) -> std::path::PathBuf {
        // A copy of the node's, brought up to date by `fetch_log`.
        self.inner.cfg.log_dir.join(id)
    }

    fn pool(&self) -> cubicle_node::PoolStats {
        let mut p = cubicle_node::PoolStats::default();
        for st in self.statuses() {
            for (k, v) in st.pool.ready {
                *p.ready.entry(k).or_insert(0) += v;
            }
            for (k, v) in st.pool.target {
                *p.target.entry(k).or_insert(0) += v;
            }
            p.claims += st.pool.claims;
            p.misses += st.pool.misses;
            p.waited += st.pool.waited;
            p.refills += st.pool.refills;
            p.teardowns += st.pool.teardowns;
        }
        p
    }

    fn host(&self) -> cubicle_node::host::HostStats {
        let mut h = cubicle_node::host::HostStats::default();
        for st in self.statuses() {
            h.cpus += st.host.cpus;
            h.memory_total += st.host.memory_total;
            h.memory_available += st.host.memory_available;
            h.disk_total += st.host.disk_total;
            h.disk_available += st.host.disk_available;
        }
        h
    }

    fn template_owner(&self, name: &str) -> Option<String> {
        super::templates::owner(self, name)
    }

    fn create_volume<'a>(
        &'a self,
        id: &'a str,
        size_mb: u64,
    ) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(super::volumes::create_volume(self, id, size_mb))
    }

    fn delete_volume<'a>(&'a self, id: &'a str) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(super::volumes::delete_volume(self, id))
    }

    fn volume_usage(&self, id: &str) -> cubicle_node::Result<(u64, u64)> {
        super::volumes::volume_usage(self, id)
    }

    fn reconcile_volumes(&self) -> BoxFuture<'_, cubicle_node::Result<Vec<String>>> {
        // The volumes' directories are on their nodes (each node checks its own).
        Box::pin(async {
            Err(cubicle_node::Error::Unsupported(
                "volumes live on the cluster's nodes".into(),
            ))
        })
    }

    fn cluster(&self) -> Option<&RemoteBackend> {
        Some(self)
    }

    fn sandboxes_of(&self, name: &str) -> Vec<String> {
        // As a node counts them (`Node::template_users`): a dying sandbox no longer uses
        // its template. (A kill through this replica leaves it cached as `Dying` while
        // its node tears it down in the background: counted, a template delete right
        // after the kill was refused.)
        let cache = lock(&self.inner.cache);
        let mut v: Vec<String> = cache
            .values()
            .filter(|e| {
                e.info.template == name
                    && !matches!(
                        e.info.state,
                        cubicle_node::SandboxState::Dead | cubicle_node::SandboxState::Dying
                    )
            })
            .map(|e| e.info.id.to_string())
            .collect();
        drop(cache);
        for st in self.statuses() {
            for s in st.snapshots {
                if s.template == name || s.base_template == name {
                    v.push(format!("snapshot {}", s.id));
                }
            }
        }
        v
    }

    fn layers_in_use(&self) -> HashSet<String> {
        self.statuses()
            .into_iter()
            .flat_map(|s| s.layers_in_use)
            .collect()
    }

    fn check_network<'a>(
        &'a self,
        policy: &'a NetworkPolicy,
    ) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(async move {
            // Only DNS servers and an egress proxy are checked (against rules every node
            // shares): nothing to ask a node about otherwise.
            if policy.dns_servers.is_none() && policy.egress_proxy.is_none() {
                return Ok(());
            }
            // Every node applies the same rules: ask one that answers.
            let links = self.links();
            if links.is_empty() {
                return Err(cubicle_node::Error::Capacity(
                    "no node has joined the cluster yet".into(),
                ));
            }
            let node = (0..links.len())
                .find(|i| !links[*i].retired() && lock(&links[*i].down).is_none())
                .unwrap_or(0);
            self.call(
                node,
                Method::POST,
                "/network/check",
                Self::json(policy),
                false,
            )
            .await
        })
    }

    fn update_network<'a>(
        &'a self,
        id: &'a str,
        policy: NetworkPolicy,
    ) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(async move {
            let node = self.owner(id)?;
            self.call::<()>(
                node,
                Method::POST,
                &format!("/sandboxes/{id}/network"),
                Self::json(&policy),
                false,
            )
            .await?;
            self.refresh(node, id).await;
            Ok(())
        })
    }

    fn network_log<'a>(
        &'a self,
        id: &'a str,
        after: u64,
        limit: usize,
    ) -> BoxFuture<'a, Vec<NetEvent>> {
        Box::pin(async move {
            let Ok(node) = self.owner(id) else {
                return Vec::new();
            };
            let path = format!("/sandboxes/{id}/network-log?after={after}&limit={limit}");
            self.call(node, Method::GET, &path, None, false)
                .await
                .unwrap_or_else(|e| {
                    tracing::warn!(sandbox = %id, "network log: {e}");
                    Vec::new()
                })
        })
    }

    fn fetch_log<'a>(&'a self, id: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(self.fetch_init_log(id))
    }

    fn grown_logs<'a>(
        &'a self,
        marks: &'a mut crate::backend::LogMarks,
    ) -> BoxFuture<'a, Option<HashSet<String>>> {
        Box::pin(self.grown_init_logs(marks))
    }

    fn forget_log(&self, id: &str) {
        let _ = std::fs::remove_file(Backend::log_path(self, id));
    }

    fn forget_network_log(&self, id: &str) {
        let Ok(node) = self.owner(id) else {
            return;
        };
        let (rb, id) = (self.clone(), id.to_string());
        tokio::spawn(async move {
            let path = format!("/sandboxes/{id}/network-log");
            if let Err(e) = rb
                .call::<()>(node, Method::DELETE, &path, None, false)
                .await
            {
                tracing::debug!(sandbox = %id, "forgetting the network log: {e}");
            }
        });
    }

    fn pause<'a>(
        &'a self,
        id: &'a str,
        req: PauseRequest,
    ) -> BoxFuture<'a, cubicle_node::Result<PauseReport>> {
        Box::pin(async move {
            let node = self.owner(id)?;
            let r = self
                .call(
                    node,
                    Method::POST,
                    &format!("/sandboxes/{id}/pause"),
                    Self::json(&req),
                    true,
                )
                .await;
            self.refresh(node, id).await;
            r
        })
    }

    fn resume<'a>(
        &'a self,
        id: &'a str,
        timeout: Duration,
        memory: bool,
    ) -> BoxFuture<'a, cubicle_node::Result<ResumeOutcome>> {
        // On its node, or on another one when that node is gone, draining or full.
        Box::pin(self.resume_or_move(id, timeout, memory))
    }

    fn snapshot<'a>(
        &'a self,
        id: &'a str,
        req: SnapshotRequest,
    ) -> BoxFuture<'a, cubicle_node::Result<SnapshotReport>> {
        Box::pin(async move {
            let node = self.owner(id)?;
            let r = self
                .call(
                    node,
                    Method::POST,
                    &format!("/sandboxes/{id}/snapshot"),
                    Self::json(&req),
                    true,
                )
                .await;
            self.poll(node).await;
            r
        })
    }

    fn fork<'a>(
        &'a self,
        id: &'a str,
        count: usize,
        timeout: Duration,
    ) -> BoxFuture<'a, cubicle_node::Result<Vec<cubicle_node::Result<SandboxInfo>>>> {
        Box::pin(async move {
            let node = self.owner(id)?;
            let body = WireTimeout {
                timeout_ms: timeout.as_millis() as u64,
                memory: false,
                count,
            };
            let v: Vec<WireResult<SandboxInfo>> = self
                .call(
                    node,
                    Method::POST,
                    &format!("/sandboxes/{id}/fork"),
                    Self::json(&body),
                    true,
                )
                .await?;
            let out = v
                .into_iter()
                .map(|r| match r {
                    WireResult::Ok(info) => {
                        self.remember(node, info.clone());
                        Ok(info)
                    }
                    WireResult::Err(e) => Err(e.into_node()),
                })
                .collect();
            self.refresh(node, id).await;
            Ok(out)
        })
    }

    fn rollback<'a>(
        &'a self,
        id: &'a str,
        snapshot: &'a str,
    ) -> BoxFuture<'a, cubicle_node::Result<Duration>> {
        Box::pin(async move {
            let node = self.owner(id)?;
            let body = serde_json::json!({ "snapshot": snapshot });
            let r = self
                .call(
                    node,
                    Method::POST,
                    &format!("/sandboxes/{id}/rollback"),
                    Self::json(&body),
                    true,
                )
                .await;
            self.refresh(node, id).await;
            r
        })
    }

    fn snapshots(&self) -> Vec<SnapshotRecord> {
        self.statuses()
            .into_iter()
            .flat_map(|s| s.snapshots)
            .collect()
    }

    fn find_snapshot(&self, name: &str) -> Option<SnapshotRecord> {
        self.snapshots().into_iter().find(|s| s.answers_to(name))
    }

    fn delete_snapshot<'a>(&'a self, id: &'a str) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(async move {
            let node = self
                .links()
                .iter()
                .position(|n| {
                    lock(&n.status)
                        .as_ref()
                        .is_some_and(|s| s.snapshots.iter().any(|r| r.id == id))
                })
                .ok_or_else(|| cubicle_node::Error::SnapshotNotFound(id.to_string()))?;
            self.call::<()>(
                node,
                Method::DELETE,
                &format!("/snapshots/{id}"),
                None,
                false,
            )
            .await?;
            self.poll(node).await;
            Ok(())
        })
    }
}

/// `name` for a query string (template names may hold `:` and `/`).
fn percent_encode(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
