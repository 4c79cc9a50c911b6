//! The node's egress proxy. The kernel redirects here the TCP connections of sandboxes
//! whose policy needs more than addresses (domain rules, learn mode, an egress proxy);
//! the original destination comes from conntrack (`SO_ORIGINAL_DST`).
//!
//! For each connection: read the client's first bytes (a TLS ClientHello or an HTTP
//! request head; on ports other than 80 and 443 a short wait, for protocols where the
//! server speaks first), take the name it asks for (SNI or `Host`), and decide with the
//! sandbox's policy ([`NetworkPolicy::decide`](crate::policy::NetworkPolicy::decide)):
//! a name matching a domain rule passes only if the destination is one of that name's
//! addresses (handed out by the resolver, or found by resolving the name now), so
//! neither a hard-coded address nor a name that does not belong to the address gets
//! through. Then connect (directly, or through the sandbox's SOCKS5 proxy: fail closed)
//! and relay both ways, counting bytes. Denied connections are reset. While it is
//! relayed, a connection is judged again at every change of its sandbox's policy, and
//! reset when the new policy refuses it (or changes its egress proxy) or the sandbox is
//! gone ([`cut_when_refused`]).

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

use crate::audit::EventKind;
use crate::policy::{Attempt, Decision, EgressProxy, NetworkPolicy, Verdict, normalize_name};
use crate::sniff::{self, Sniffed};
use crate::{EgressError, SandboxState, Shared, resolver, socks5};

/// How long a client on port 80 or 443 (which must speak first) may take to send its
/// first request bytes.
const FIRST_BYTES_WEB: Duration = Duration::from_secs(5);
/// How long connecting to the destination may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Relay buffer size per direction.
const RELAY_BUF: usize = 64 * 1024;

/// A byte stream to the destination (plain TCP, or a SOCKS5 tunnel, maybe over TLS).
pub(crate) trait Upstream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Upstream for T {}

/// Accepts connections until the task is aborted.
pub(crate) async fn serve(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        let (conn, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!("proxy: accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let SocketAddr::V4(peer) = peer else {
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move { handle(shared, conn, peer).await });
    }
}

/// Closes `s` with a TCP reset (the client sees "connection reset", at once).
fn reset(s: TcpStream) {
    reset_on_close(s.as_raw_fd());
    drop(s);
}

/// Makes the socket `fd` send a TCP reset when it is closed, not a FIN.
fn reset_on_close(fd: std::os::fd::RawFd) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: `fd` is an open socket (its owner is alive); valid option struct and length.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

/// The destination a redirected connection was addressed to.
fn original_dst(s: &TcpStream) -> std::io::Result<SocketAddrV4> {
    const SO_ORIGINAL_DST: libc::c_int = 80;
    // SAFETY: zeroed sockaddr_in is valid; getsockopt writes at most `len` bytes.
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: valid fd, pointer and length.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_IP,
            SO_ORIGINAL_DST,
            (&mut addr as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
        u16::from_be(addr.sin_port),
    ))
}

/// Reads until the first bytes say what they are (or the client stops sending).
async fn first_bytes(
    client: &mut TcpStream,
    port: u16,
    wait_other: Duration,
) -> (Vec<u8>, Sniffed) {
    let wait_first = if port == 80 || port == 443 {
        FIRST_BYTES_WEB
    } else {
        wait_other
    };
    let deadline = Instant::now() + FIRST_BYTES_WEB;
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; sniff::MAX_SNIFF];
    loop {
        let wait = if buf.is_empty() {
            wait_first
        } else {
            deadline.saturating_duration_since(Instant::now())
        };
        match tokio::time::timeout(wait, client.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => {
                buf.extend_from_slice(&chunk[..n]);
                match sniff::sniff(&buf) {
                    Sniffed::NeedMore => continue,
                    s => return (buf, s),
                }
            }
            _ => {
                let s = if buf.is_empty() {
                    Sniffed::Other
                } else {
                    match sniff::sniff(&buf) {
                        Sniffed::NeedMore => Sniffed::Other,
                        s => s,
                    }
                };
                return (buf, s);
            }
        }
    }
}

/// Whether `dst` is an address of `name`: handed out to this sandbox before, or found
/// by asking the sandbox's (or else the node's) DNS servers now.
async fn is_address_of(shared: &Shared, sandbox: &SandboxState, name: &str, dst: Ipv4Addr) -> bool {
    if sandbox
        .names
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .has(dst, name)
    {
        return true;
    }
    let policy = sandbox.policy();
    let mut servers: Vec<Ipv4Addr> = policy
        .dns_servers
        .clone()
        .unwrap_or_default()
        .into_iter()
        .filter(|s| shared.config.guard.check(*s, None).is_ok())
        .collect();
    if servers.is_empty() {
        servers = shared.config.upstream_dns.clone();
    }
    match resolver::lookup_a_ttl(&servers, name).await {
        Ok(answers) => {
            sandbox
                .names
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .record(name, &answers);
            answers.iter().any(|(ip, _)| *ip == dst)
        }
        Err(_) => false,
    }
}

/// What judging a connection learned about its destination, kept for the connection's
/// life: the name table forgets answers (after their TTL, at least ten minutes), while a
/// connection's destination never changes, so a later policy change must not cut it
/// for want of an answer the table has dropped since.
#[derive(Debug, Default)]
struct Known {
    /// The destination is an address of the name the client asked for.
    is_named: bool,
    /// Names the resolver handed the destination out for, oldest first.
    resolved: Vec<String>,
}

/// Judges a connection to `dst:port` whose client named `name` (SNI or `Host`) with
/// `policy`: the decision at its open, and again at each policy change while it lasts
/// (with what the earlier judgements learned, `known`).
async fn judge(
    shared: &Shared,
    sandbox: &SandboxState,
    policy: &NetworkPolicy,
    dst: Ipv4Addr,
    port: u16,
    name: Option<&str>,
    known: &mut Known,
) -> Decision {
    if let Some(n) = name
        && !known.is_named
        && policy.domain_rule(n).is_some()
    {
        known.is_named = is_address_of(shared, sandbox, n, dst).await;
    }
    for n in sandbox
        .names
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .names_of(dst)
    {
        if !known.resolved.contains(&n) {
            known.resolved.push(n);
        }
    }
    let resolved_as = known
        .resolved
        .iter()
        .rev()
        .find(|n| policy.domain_rule(n).is_some());
    policy.decide(
        &shared.config.guard,
        &Attempt {
            dst,
            port,
            name,
            dst_is_names: known.is_named,
            resolved_as: resolved_as.map(String::as_str),
        },
    )
}

/// How a connection leaves the node, for the trail.
fn via(policy: &NetworkPolicy) -> String {
    match &policy.egress_proxy {
        Some(p) => format!("socks5 {}", p.address),
        None => "direct".to_string(),
    }
}

/// A connection the proxy relays, counted in `Shared::relayed` while it lives.
struct Relaying<'a>(&'a AtomicUsize);

impl<'a> Relaying<'a> {
    fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::Relaxed);
        Relaying(n)
    }
}

impl Drop for Relaying<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Returns (why) when a policy change refuses the connection `conn` (that left through
/// `route`, the egress proxy it was opened with), or when the sandbox is gone; until
/// then, waits. `known`: what its open's judgement learned. The rules accept established
/// connections before they look at a policy, so a connection the proxy relays is the
/// proxy's to end.
async fn cut_when_refused(
    conn: Conn<'_>,
    mut changes: tokio::sync::watch::Receiver<bool>,
    route: Option<EgressProxy>,
    mut known: Known,
) -> String {
    let (shared, sandbox, name) = (conn.shared, conn.sandbox, conn.name);
    let (dst, port) = (*conn.dst.ip(), conn.dst.port());
    loop {
        if changes.changed().await.is_err() || *changes.borrow_and_update() {
            return "the sandbox is gone".to_string();
        }
        let policy = sandbox.policy();
        let why = if policy.egress_proxy != route {
            Some("the connection's egress proxy changed".to_string())
        } else {
            let d = judge(shared, sandbox, &policy, dst, port, name, &mut known).await;
            (d.verdict == Verdict::Denied).then_some(d.reason)
        };
        if let Some(why) = why {
            let reason = format!("cut by a policy change: {why}");
            shared.audit.record(
                &sandbox.id,
                EventKind::Connect {
                    proto: "tcp".into(),
                    dst,
                    port,
                    name: name.map(str::to_string),
                    verdict: Verdict::Denied,
                    reason: reason.clone(),
                    via: via(&policy),
                },
            );
            return reason;
        }
    }
}

async fn handle(shared: Arc<Shared>, mut client: TcpStream, peer: SocketAddrV4) {
    let t0 = Instant::now();
    let Some(sandbox) = shared.sandbox(*peer.ip()) else {
        return reset(client);
    };
    let Ok(dst) = original_dst(&client) else {
        return reset(client);
    };
    let _ = client.set_nodelay(true);
    let (dst_ip, port) = (*dst.ip(), dst.port());
    let (head, sniffed) = first_bytes(&mut client, port, shared.config.first_bytes_wait).await;
    let seen = match &sniffed {
        Sniffed::Tls { sni } => sni.clone(),
        Sniffed::Http(h) => h.host(),
        _ => None,
    };
    let name = seen.as_deref().and_then(normalize_name);
    // Subscribed before the policy is read: a change after this point is judged again.
    let changes = sandbox.changes();
    let policy = sandbox.policy();
    let mut known = Known::default();
    let d = judge(
        &shared,
        &sandbox,
        &policy,
        dst_ip,
        port,
        name.as_deref(),
        &mut known,
    )
    .await;
    shared.audit.record(
        &sandbox.id,
        EventKind::Connect {
            proto: "tcp".into(),
            dst: dst_ip,
            port,
            name: seen.clone(),
            verdict: d.verdict,
            reason: d.reason,
            via: via(&policy),
        },
    );
    if d.verdict == Verdict::Denied {
        return reset(client);
    }
    // Counted from here (allowed, and watching for policy changes) until its close is
    // recorded: a count the lab tests wait on before they change a policy.
    let _relaying = Relaying::new(&shared.relayed);
    let upstream: Result<Box<dyn Upstream>, EgressError> = match &policy.egress_proxy {
        Some(p) => socks5::connect(&shared, p, dst).await,
        None => match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(dst)).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                Ok(Box::new(s) as Box<dyn Upstream>)
            }
            Ok(Err(e)) => Err(EgressError::io(format!("connecting to {dst}"), e)),
            Err(_) => Err(EgressError::Io {
                what: format!("connecting to {dst}"),
                source: std::io::ErrorKind::TimedOut.into(),
            }),
        },
    };
    let close = |out: u64, inn: u64, error: Option<String>| {
        shared.audit.record(
            &sandbox.id,
            EventKind::Close {
                proto: "tcp".into(),
                dst: dst_ip,
                port,
                name: seen.clone(),
                bytes_out: out,
                bytes_in: inn,
                duration_ms: t0.elapsed().as_millis() as u64,
                error,
            },
        );
    };
    let upstream = match upstream {
        Ok(u) => u,
        Err(e) => {
            close(0, 0, Some(e.to_string()));
            return reset(client);
        }
    };
    let (out, inn) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let client_fd = client.as_raw_fd();
    let err = {
        let conn = Conn {
            shared: &shared,
            sandbox: &sandbox,
            dst,
            name: name.as_deref(),
            named: known.is_named,
            out: &out,
            inn: &inn,
        };
        let relay = relay(conn, client, upstream, head, &sniffed);
        let cut = cut_when_refused(conn, changes, policy.egress_proxy.clone(), known);
        tokio::pin!(relay, cut);
        tokio::select! {
            e = &mut relay => e,
            why = &mut cut => {
                // The relay still holds the client's socket: it is reset when the relay
                // is dropped, below.
                reset_on_close(client_fd);
                Some(why)
            }
        }
    };
    close(
        out.load(Ordering::Relaxed),
        inn.load(Ordering::Relaxed),
        err,
    );
}

/// An allowed connection, as [`relay`] and [`cut_when_refused`] need it.
#[derive(Clone, Copy)]
struct Conn<'a> {
    shared: &'a Arc<Shared>,
    sandbox: &'a Arc<SandboxState>,
    dst: SocketAddrV4,
    /// The name the client asked for (SNI or `Host`).
    name: Option<&'a str>,
    /// Its open found the destination to be an address of `name`.
    named: bool,
    /// Bytes relayed each way.
    out: &'a Arc<AtomicU64>,
    inn: &'a Arc<AtomicU64>,
}

/// Relays an allowed connection until either side ends it; why it ended badly, if so.
/// Plain HTTP and intercepted TLS go request by request (each request checked, the
/// name's header rule applied), anything else as bytes.
async fn relay(
    conn: Conn<'_>,
    client: TcpStream,
    mut upstream: Box<dyn Upstream>,
    head: Vec<u8>,
    sniffed: &Sniffed,
) -> Option<String> {
    let Conn {
        shared,
        sandbox,
        dst,
        name,
        named,
        out,
        inn,
    } = conn;
    // Each request is checked against the policy of the moment. One to the connection's
    // own name (decided when it opened, and again at every policy change) gets that
    // name's current header rule. Plain HTTP: only when the destination is an address of
    // the name (else a sandbox could send the secret to any address with a forged Host).
    // TLS: intercepted only when the name had a rule at the open; the destination's
    // certificate is verified for the name.
    let recheck = |intercepted: bool| {
        let (shared, sandbox, first) = (shared.clone(), sandbox.clone(), name.map(str::to_string));
        let (dst_ip, port) = (*dst.ip(), dst.port());
        move |h: crate::sniff::RequestHead| {
            let (shared, sandbox, first) = (shared.clone(), sandbox.clone(), first.clone());
            async move {
                let policy = sandbox.policy();
                let host = h.host().as_deref().and_then(normalize_name);
                if host == first {
                    let t = match first.as_deref().map(|n| (n, policy.transform_for(n))) {
                        Some((n, Some(t)))
                            if intercepted
                                || named
                                || is_address_of(&shared, &sandbox, n, dst_ip).await =>
                        {
                            Some(t)
                        }
                        Some((n, Some(_))) => {
                            tracing::warn!(sandbox = %sandbox.id, "egress: {dst_ip} is not an address of {n}: its header rule is not applied");
                            None
                        }
                        _ => None,
                    };
                    return inject(&shared, &sandbox.id, h, t, dst_ip, port);
                }
                let d = judge(
                    &shared,
                    &sandbox,
                    &policy,
                    dst_ip,
                    port,
                    host.as_deref(),
                    &mut Known::default(),
                )
                .await;
                if d.verdict != Verdict::Denied {
                    return (h, Ok(()));
                }
                shared.audit.record(
                    &sandbox.id,
                    EventKind::Connect {
                        proto: "tcp".into(),
                        dst: dst_ip,
                        port,
                        name: h.host(),
                        verdict: d.verdict,
                        reason: format!("a later request on the connection: {}", d.reason),
                        via: via(&policy),
                    },
                );
                (h, Err(d.reason))
            }
        }
    };
    let transform_at_open =
        name.and_then(|n| sandbox.policy().transform_for(n).is_some().then_some(n));
    if let Sniffed::Http(_) = sniffed {
        // Plain HTTP: every request of the connection is checked (and can be rewritten).
        return match relay_http(client, upstream, head, recheck(false), out, inn).await {
            Ok(()) => None,
            Err((e, client)) => {
                if let Some(c) = client {
                    reset(c);
                }
                Some(e)
            }
        };
    }
    if let (Sniffed::Tls { .. }, Some(n)) = (sniffed, transform_at_open) {
        // A domain with header rules over TLS: terminate it with the node's CA, open TLS
        // to the destination (verified), and rewrite every request.
        return match intercept(shared, client, upstream, head, n).await {
            Ok((c, u)) => relay_http(c, Box::new(u), Vec::new(), recheck(true), out, inn)
                .await
                .err()
                .map(|(e, _)| e),
            Err(e) => {
                tracing::warn!(sandbox = %sandbox.id, "egress: intercepting TLS to {n}: {e}");
                Some(e.to_string())
            }
        };
    }
    if let Err(e) = upstream.write_all(&head).await {
        return Some(e.to_string());
    }
    out.fetch_add(head.len() as u64, Ordering::Relaxed);
    let mut c = Counted {
        inner: client,
        n: out.clone(),
    };
    let mut u = Counted {
        inner: upstream,
        n: inn.clone(),
    };
    tokio::io::copy_bidirectional_with_sizes(&mut c, &mut u, RELAY_BUF, RELAY_BUF)
        .await
        .err()
        .map(|e| e.to_string())
}

/// A stream that counts the bytes read from it.
struct Counted<T> {
    inner: T,
    n: Arc<AtomicU64>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let got = buf.filled().len() - before;
        if got > 0 {
            self.n.fetch_add(got as u64, Ordering::Relaxed);
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Sets `transform`'s headers on a request head (the hook's rewrite). A secret that
/// cannot be had fails the request: the relay stops, the reason goes to the trail and
/// the log (never a value).
fn inject(
    shared: &Shared,
    sandbox: &str,
    mut h: crate::sniff::RequestHead,
    transform: Option<&crate::policy::Transform>,
    dst: Ipv4Addr,
    port: u16,
) -> (crate::sniff::RequestHead, crate::http1::Verdict) {
    let Some(t) = transform else {
        return (h, Ok(()));
    };
    let lookup = |name: &str| shared.secret(sandbox, name);
    match crate::transform::apply(&mut h, t, &lookup) {
        Ok(()) => (h, Ok(())),
        Err(e) => {
            let reason = format!("header rule not applied: {e}");
            tracing::warn!(sandbox = %sandbox, "egress: request to {dst}:{port} refused: {reason}");
            shared.audit.record(
                sandbox,
                EventKind::Connect {
                    proto: "tcp".into(),
                    dst,
                    port,
                    name: h.host(),
                    verdict: Verdict::Denied,
                    reason: reason.clone(),
                    via: "direct".into(),
                },
            );
            (h, Err(reason))
        }
    }
}

/// Terminates the client's TLS (replaying the ClientHello already read) with a leaf for
/// `name`, and opens TLS to the destination over `upstream`, verified as `name`.
async fn intercept(
    shared: &Shared,
    client: TcpStream,
    upstream: Box<dyn Upstream>,
    head: Vec<u8>,
    name: &str,
) -> Result<
    (
        tokio_rustls::server::TlsStream<Prefixed<TcpStream>>,
        tokio_rustls::client::TlsStream<Box<dyn Upstream>>,
    ),
    EgressError,
> {
    let Some(i) = &shared.interceptor else {
        return Err(EgressError::Policy(
            "the node has no interception CA (see the log at startup)".into(),
        ));
    };
    let config = i.server_config(name)?;
    let prefixed = Prefixed {
        prefix: head,
        pos: 0,
        inner: client,
    };
    let accept = tokio_rustls::TlsAcceptor::from(config).accept(prefixed);
    let c = tokio::time::timeout(FIRST_BYTES_WEB, accept)
        .await
        .map_err(|_| EgressError::io("TLS from the sandbox", std::io::ErrorKind::TimedOut.into()))?
        .map_err(|e| EgressError::io("TLS from the sandbox", e))?;
    let u = tokio::time::timeout(CONNECT_TIMEOUT, i.connect(upstream, name))
        .await
        .map_err(|_| {
            EgressError::io(
                format!("TLS to {name}"),
                std::io::ErrorKind::TimedOut.into(),
            )
        })??;
    Ok((c, u))
}

/// A stream whose first reads return `prefix` (bytes already read from `inner`).
pub(crate) struct Prefixed<T> {
    prefix: Vec<u8>,
    pos: usize,
    inner: T,
}

impl<T: AsyncRead + Unpin> AsyncRead for Prefixed<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.pos < self.prefix.len() {
            let n = (self.prefix.len() - self.pos).min(buf.remaining());
            let start = self.pos;
            buf.put_slice(&self.prefix[start..start + n]);
            self.pos += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Prefixed<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Relays an HTTP/1 connection (plain, or decrypted by [`intercept`]): the client's
/// requests one by one through `check` (`http1.rs`), the server's answers as they come.
/// On a refused request the relay stops and the client stream is handed back (to be
/// reset).
async fn relay_http<
    C: AsyncRead + AsyncWrite + Unpin,
    F: std::future::Future<Output = (crate::sniff::RequestHead, crate::http1::Verdict)>,
>(
    client: C,
    upstream: Box<dyn Upstream>,
    head: Vec<u8>,
    check: impl FnMut(crate::sniff::RequestHead) -> F,
    out: &AtomicU64,
    inn: &Arc<AtomicU64>,
) -> Result<(), (String, Option<C>)> {
    let (mut cr, mut cw) = tokio::io::split(client);
    let (ur, mut uw) = tokio::io::split(upstream);
    let mut ur = Counted {
        inner: ur,
        n: inn.clone(),
    };
    let result = {
        let requests = crate::http1::relay_requests(&mut cr, &mut uw, head, check, out);
        let answers = async {
            let r = tokio::io::copy(&mut ur, &mut cw).await;
            let _ = cw.shutdown().await;
            r
        };
        tokio::pin!(requests, answers);
        tokio::select! {
            r = &mut requests => match r {
                // The client is done sending: the answers finish on their own.
                Ok(()) => answers.await.map(drop).map_err(|e| e.to_string()),
                Err(e) => Err(e),
            },
            r = &mut answers => r.map(drop).map_err(|e| e.to_string()),
        }
    };
    result.map_err(|e| (e, Some(cr.unsplit(cw))))
}
