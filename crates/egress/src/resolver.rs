//! The node's DNS resolver. The kernel redirects every DNS query a sandbox sends (UDP or
//! TCP port 53, to any address) here. Each question is answered per the sandbox's
//! policy ([`NetworkPolicy::resolves`](crate::policy::NetworkPolicy::resolves)):
//! refused without being forwarded when the policy does not allow the name (so DNS
//! cannot carry data out of a sandbox whose traffic is otherwise denied), or forwarded
//! to the sandbox's upstream servers (its `dnsServers`, else the node's) with a fresh id
//! from a fresh port. The answer goes back unchanged; its addresses are remembered for
//! the proxy, and question, verdict and answer go to the audit trail. A per-sandbox
//! rate limit bounds how fast questions are taken.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

use crate::audit::EventKind;
use crate::dns::{self, Question};
use crate::policy::Verdict;
use crate::{EgressError, Shared};

/// How long one upstream server gets to answer.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a TCP client may sit idle between queries.
const TCP_IDLE: Duration = Duration::from_secs(10);

/// A random 16-bit query id.
fn random_id() -> u16 {
    let mut b = [0u8; 2];
    // SAFETY: b is a valid writable buffer of 2 bytes.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 2, 0) };
    if n != 2 {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        return (t ^ (t >> 16)) as u16;
    }
    u16::from_ne_bytes(b)
}

/// Serves queries over UDP.
pub(crate) async fn serve_udp(shared: Arc<Shared>, sock: UdpSocket) {
    let sock = Arc::new(sock);
    let mut buf = vec![0u8; 4096];
    loop {
        let (n, peer) = match sock.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!("resolver: recv: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let SocketAddr::V4(peer4) = peer else {
            continue;
        };
        let msg = buf[..n].to_vec();
        let (shared, sock) = (shared.clone(), sock.clone());
        tokio::spawn(async move {
            if let Some(reply) = answer(&shared, *peer4.ip(), &msg, false).await {
                let _ = sock.send_to(&reply, peer).await;
            }
        });
    }
}

/// Serves queries over TCP (two-byte length prefix, several per connection).
pub(crate) async fn serve_tcp(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        let (conn, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!("resolver: accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let SocketAddr::V4(peer4) = peer else {
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let _ = serve_tcp_conn(&shared, *peer4.ip(), conn).await;
        });
    }
}

async fn serve_tcp_conn(
    shared: &Shared,
    src: Ipv4Addr,
    mut conn: TcpStream,
) -> std::io::Result<()> {
    loop {
        let mut len = [0u8; 2];
        match tokio::time::timeout(TCP_IDLE, conn.read_exact(&mut len)).await {
            Ok(Ok(_)) => {}
            _ => return Ok(()),
        }
        let mut msg = vec![0u8; u16::from_be_bytes(len) as usize];
        tokio::time::timeout(TCP_IDLE, conn.read_exact(&mut msg))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
        let Some(reply) = answer(shared, src, &msg, true).await else {
            return Ok(());
        };
        let mut out = (reply.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(&reply);
        conn.write_all(&out).await?;
    }
}

/// The answer to one query from sandbox address `src` (None: no answer at all).
async fn answer(shared: &Shared, src: Ipv4Addr, msg: &[u8], tcp: bool) -> Option<Vec<u8>> {
    let sandbox = shared.sandbox(src)?;
    let q = dns::parse_query(msg).ok()?;
    let policy = sandbox.policy();
    let record = |verdict: Verdict, reason: String, rcode: u8, answers: Vec<String>| {
        shared.audit.record(
            &sandbox.id,
            EventKind::Dns {
                name: q.name.clone(),
                qtype: dns::type_name(q.qtype),
                verdict,
                reason,
                rcode: dns::rcode_name(rcode).to_string(),
                answers,
            },
        );
    };
    let refuse = |verdict: Verdict, reason: String| {
        record(verdict, reason, dns::RCODE_REFUSED, Vec::new());
        Some(dns::error_answer(msg, &q, dns::RCODE_REFUSED))
    };
    let (rate, burst) = shared.config.dns_rate;
    let within_rate = sandbox
        .dns_bucket
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take(rate, burst);
    if !within_rate {
        return refuse(
            Verdict::Denied,
            format!("rate limit: more than {rate} questions per second"),
        );
    }
    let d = policy.resolves(&q.name);
    if d.verdict == Verdict::Denied {
        return refuse(Verdict::Denied, d.reason);
    }
    let mut servers = shared.upstreams(&policy);
    if policy.dns_servers.is_some() {
        // The user's servers are reached from the host: the node's rules apply to them.
        servers.retain(|s| shared.config.guard.check(*s, None).is_ok());
    }
    if servers.is_empty() {
        return refuse(
            Verdict::Denied,
            "no DNS server to ask (network.dnsServers is empty or denied)".into(),
        );
    }
    match exchange(&servers, msg, tcp).await {
        Ok(reply) => {
            let (rcode, answers) = match dns::parse_answer(&reply) {
                Ok(a) => {
                    if !a.ipv4.is_empty() {
                        sandbox
                            .names
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .record(&q.name, &a.ipv4);
                    }
                    let mut shown: Vec<String> =
                        a.ipv4.iter().map(|(ip, _)| ip.to_string()).collect();
                    shown.extend(a.other);
                    (a.rcode, shown)
                }
                Err(_) => (dns::RCODE_SERVFAIL, Vec::new()),
            };
            record(d.verdict, d.reason, rcode, answers);
            Some(reply)
        }
        Err(e) => {
            record(
                d.verdict,
                format!("{}; {e}", d.reason),
                dns::RCODE_SERVFAIL,
                Vec::new(),
            );
            Some(dns::error_answer(msg, &q, dns::RCODE_SERVFAIL))
        }
    }
}

/// Sends `msg` to each server in turn until one answers; the answer carries `msg`'s id.
/// Over TCP when `tcp` (the client used TCP) or when the UDP answer was truncated.
pub(crate) async fn exchange(
    servers: &[Ipv4Addr],
    msg: &[u8],
    tcp: bool,
) -> Result<Vec<u8>, EgressError> {
    let orig_id = dns::id(msg).map_err(|e| EgressError::Dns(e.0.into()))?;
    let q = dns::parse_query(msg).map_err(|e| EgressError::Dns(e.0.into()))?;
    let mut last = EgressError::Dns("no server".into());
    for &server in servers {
        let id = random_id();
        let mut out = msg.to_vec();
        dns::set_id(&mut out, id);
        let r = if tcp {
            exchange_tcp(server, &out).await
        } else {
            match exchange_udp(server, &out).await {
                Ok(reply) if reply.get(2).is_some_and(|b| b & 0x02 != 0) => {
                    exchange_tcp(server, &out).await
                }
                other => other,
            }
        };
        match r {
            Ok(mut reply) if valid_reply(&reply, id, &q) => {
                dns::set_id(&mut reply, orig_id);
                return Ok(reply);
            }
            Ok(_) => last = EgressError::Dns(format!("{server} sent a mismatched answer")),
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn valid_reply(reply: &[u8], id: u16, q: &Question) -> bool {
    dns::id(reply).ok() == Some(id)
        && reply.get(2).is_some_and(|b| b & 0x80 != 0)
        && reply_question_matches(reply, q)
}

fn reply_question_matches(reply: &[u8], q: &Question) -> bool {
    // The reply's question, read as if it were a query.
    let mut as_query = reply.to_vec();
    as_query[2] &= 0x7f;
    matches!(dns::parse_query(&as_query), Ok(r) if r.name == q.name && r.qtype == q.qtype)
}

async fn exchange_udp(server: Ipv4Addr, msg: &[u8]) -> Result<Vec<u8>, EgressError> {
    let err = |e: std::io::Error| EgressError::Dns(format!("{server}: {e}"));
    let sock = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
        .await
        .map_err(err)?;
    sock.connect((server, 53)).await.map_err(err)?;
    sock.send(msg).await.map_err(err)?;
    let mut buf = vec![0u8; 4096];
    match tokio::time::timeout(UPSTREAM_TIMEOUT, sock.recv(&mut buf)).await {
        Ok(Ok(n)) => {
            buf.truncate(n);
            Ok(buf)
        }
        Ok(Err(e)) => Err(err(e)),
        Err(_) => Err(EgressError::Dns(format!("{server}: no answer within 2 s"))),
    }
}

async fn exchange_tcp(server: Ipv4Addr, msg: &[u8]) -> Result<Vec<u8>, EgressError> {
    let err = |e: std::io::Error| EgressError::Dns(format!("{server} (TCP): {e}"));
    let work = async {
        let mut s = TcpStream::connect((server, 53)).await.map_err(err)?;
        let mut out = (msg.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(msg);
        s.write_all(&out).await.map_err(err)?;
        let mut len = [0u8; 2];
        s.read_exact(&mut len).await.map_err(err)?;
        let mut buf = vec![0u8; u16::from_be_bytes(len) as usize];
        s.read_exact(&mut buf).await.map_err(err)?;
        Ok(buf)
    };
    tokio::time::timeout(UPSTREAM_TIMEOUT, work)
        .await
        .map_err(|_| EgressError::Dns(format!("{server} (TCP): no answer within 2 s")))?
}

/// The A records of `name` (address, TTL) per `servers`.
pub(crate) async fn lookup_a(
    servers: &[Ipv4Addr],
    name: &str,
) -> Result<Vec<Ipv4Addr>, EgressError> {
    Ok(lookup_a_ttl(servers, name)
        .await?
        .into_iter()
        .map(|(ip, _)| ip)
        .collect())
}

/// The A records of `name` with their TTLs.
pub(crate) async fn lookup_a_ttl(
    servers: &[Ipv4Addr],
    name: &str,
) -> Result<Vec<(Ipv4Addr, u32)>, EgressError> {
    let q = dns::build_query(random_id(), name, dns::TYPE_A);
    let reply = exchange(servers, &q, false).await?;
    let a = dns::parse_answer(&reply).map_err(|e| EgressError::Dns(e.0.into()))?;
    if a.rcode != dns::RCODE_NOERROR {
        return Err(EgressError::Dns(format!(
            "{name}: {}",
            dns::rcode_name(a.rcode)
        )));
    }
    Ok(a.ipv4)
}
