//! A private network lab for the egress layer's tests and `cubicle bench egress`: three
//! fresh network namespaces built on a dedicated thread, never touching the caller's.
//!
//! ```text
//!  "sandbox" namespaces ── veth lbs<slot> ──  "host" namespace  ── veth lbinet0 ── "internet"
//!   (10.203.0.x, like a     (Network::init with the real egress    198.51.100.2 (ok.test, DNS)
//!    sandbox's eth0)          rules, the Egress resolver + proxy)   198.51.100.3 (evil.test)
//! ```
//!
//! The "internet" namespace answers DNS for its names (its own tiny responder, which also
//! records every question it gets), serves HTTP on port 80 (`200 <its address>`) and
//! counts bytes on port 443 (replying with the count when the client half-closes);
//! `ok.test` also answers HTTPS on [`HTTPS_ECHO_PORT`] with a certificate from the lab's
//! own CA ([`Lab::internet_ca`]); `GET /echo` answers with the request head received.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cubicle_runtime::network::{NetInfo, Netns, Network, NetworkConfig, run_in_netns};

use crate::{Egress, EgressConfig, EgressError, NetworkPolicy};

/// The lab's "internet" hosts.
pub const OK_HOST: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
pub const EVIL_HOST: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 3);
/// Port of the lab internet's HTTPS server (on `OK_HOST`, certificate for `ok.test`).
pub const HTTPS_ECHO_PORT: u16 = 8443;
const HOST_SIDE: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const INET_IF: &str = "lbinet0";

/// The lab, from inside its "host" namespace.
pub struct Lab {
    pub rt: tokio::runtime::Runtime,
    pub net: Network,
    pub egress: Egress,
    pub inet: Netns,
    /// DNS questions the "internet" DNS server received (name, in order).
    pub upstream_questions: Arc<Mutex<Vec<String>>>,
    sandboxes: HashMap<u32, (Netns, NetInfo)>,
    /// The CA of the lab internet's HTTPS server (trusted by the proxy as a "public" root).
    pub internet_ca: String,
    /// The lab's scratch directory (trails and CAs), removed on drop.
    dir: std::path::PathBuf,
}

fn lab_err(what: &str, e: impl std::fmt::Display) -> EgressError {
    EgressError::io(what, std::io::Error::other(e.to_string()))
}

fn sh(args: &[&str]) -> Result<(), EgressError> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| EgressError::io(format!("running {}", args[0]), e))?;
    if !out.status.success() {
        return Err(lab_err(
            &args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim(),
        ));
    }
    Ok(())
}

/// A fresh, empty network namespace (with `lo` up).
fn new_netns() -> Result<Netns, EgressError> {
    let ns = std::thread::spawn(|| -> Result<Netns, EgressError> {
        // SAFETY: unshare affects only this short-lived thread.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return Err(EgressError::io(
                "unshare(CLONE_NEWNET) (the lab needs root)",
                std::io::Error::last_os_error(),
            ));
        }
        Netns::current().map_err(|e| lab_err("opening the new namespace", e))
    })
    .join()
    .map_err(|_| lab_err("lab thread", "panicked"))??;
    cubicle_runtime::network::loopback_up(&ns).map_err(|e| lab_err("lo up", e))?;
    Ok(ns)
}

impl Lab {
    /// Builds the lab on a new thread whose namespace is the lab's "host", runs `f` there,
    /// and tears everything down (the namespaces vanish with their last handle).
    pub fn run<R: Send>(f: impl FnOnce(&mut Lab) -> R + Send) -> Result<R, EgressError> {
        Self::run_with(|_| {}, f)
    }

    /// [`Lab::run`] with the lab's network configuration adjusted by `tune` first.
    pub fn run_with<R: Send>(
        tune: impl FnOnce(&mut NetworkConfig) + Send,
        f: impl FnOnce(&mut Lab) -> R + Send,
    ) -> Result<R, EgressError> {
        std::thread::scope(|s| {
            s.spawn(move || {
                // SAFETY: unshare affects only this thread (and threads it creates later).
                if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                    return Err(EgressError::io(
                        "unshare(CLONE_NEWNET) (the lab needs root)",
                        std::io::Error::last_os_error(),
                    ));
                }
                let mut lab = Lab::build(tune)?;
                let r = f(&mut lab);
                lab.egress.shutdown();
                Ok(r)
            })
            .join()
            .map_err(|_| lab_err("lab thread", "panicked"))?
        })
    }

    fn build(tune: impl FnOnce(&mut NetworkConfig)) -> Result<Lab, EgressError> {
        let host = Netns::current().map_err(|e| lab_err("host namespace", e))?;
        cubicle_runtime::network::loopback_up(&host).map_err(|e| lab_err("lo up", e))?;
        let mut config = NetworkConfig {
            table: "cubicle_lab".into(),
            ifname_prefix: "lbs".into(),
            pool: "10.203.0.0/24".parse().map_err(|e| lab_err("pool", e))?,
            // The lab's internet sits on a subnet of its host.
            deny_host_subnets: false,
            ..NetworkConfig::default()
        };
        tune(&mut config);
        let net = Network::init(config).map_err(|e| lab_err("network init", e))?;
        // The "internet": a veth to a third namespace, which is also the default route.
        let inet = new_netns()?;
        // (`ip` does not inherit our descriptors: name the namespace through our /proc.)
        let inet_path = format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            std::os::fd::AsRawFd::as_raw_fd(&inet)
        );
        sh(&[
            "ip", "link", "add", INET_IF, "type", "veth", "peer", "name", "eth0", "netns",
            &inet_path,
        ])?;
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("{HOST_SIDE}/24"),
            "dev",
            INET_IF,
        ])?;
        sh(&["ip", "link", "set", INET_IF, "up"])?;
        sh(&[
            "ip",
            "route",
            "add",
            "default",
            "via",
            &OK_HOST.to_string(),
            "dev",
            INET_IF,
        ])?;
        run_in_netns(&inet, || -> Result<(), EgressError> {
            for a in [OK_HOST, EVIL_HOST] {
                sh(&["ip", "addr", "add", &format!("{a}/24"), "dev", "eth0"])?;
            }
            sh(&["ip", "link", "set", "eth0", "up"])?;
            sh(&[
                "ip",
                "route",
                "add",
                "default",
                "via",
                &HOST_SIDE.to_string(),
            ])
        })
        .map_err(|e| lab_err("internet namespace", e))??;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| EgressError::io("lab runtime", e))?;
        // One scratch directory per lab (several run at once in a test binary): the
        // egress trails in `trails/`, the CAs beside them. Removed when the lab drops.
        static RUN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "cubicle-lab-{}-{}",
            std::process::id(),
            RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let mut ec = EgressConfig::new(0, 0, net.address_guard(), dir.join("trails"));
        ec.upstream_dns = vec![OK_HOST];
        // The node's interception CA, and the lab internet's CA as the "public" roots.
        std::fs::create_dir_all(&dir).map_err(|e| EgressError::io("lab dir", e))?;
        let (internet_ca, internet_tls) = internet_tls()?;
        std::fs::write(dir.join("internet-ca.pem"), &internet_ca)
            .map_err(|e| EgressError::io("lab CA file", e))?;
        ec.upstream_ca = Some(dir.join("internet-ca.pem"));
        ec.ca_dir = Some(dir.clone());
        let egress = Egress::start(ec, rt.handle())?;
        net.serve_slots(
            0..net.max_slots(),
            egress.dns_addr().port(),
            egress.proxy_addr().port(),
        )
        .map_err(|e| lab_err("redirect table", e))?;
        let eg = egress.clone();
        let watch = net
            .watch_events(move |ev| eg.record_kernel(ev))
            .map_err(|e| lab_err("kernel events", e))?;
        egress.keep_watch(watch);
        let questions = Arc::new(Mutex::new(Vec::new()));
        start_internet(&inet, questions.clone(), internet_tls)?;
        Ok(Lab {
            rt,
            net,
            egress,
            inet,
            upstream_questions: questions,
            sandboxes: HashMap::new(),
            internet_ca,
            dir,
        })
    }

    /// A new "sandbox" on `slot` with `policy` (kernel share and egress registration, as
    /// the node does on create). Returns its address.
    pub fn add_sandbox(
        &mut self,
        slot: u32,
        policy: &NetworkPolicy,
    ) -> Result<Ipv4Addr, EgressError> {
        let ns = new_netns()?;
        let info = self
            .net
            .attach(&ns, slot)
            .map_err(|e| lab_err("attach", e))?;
        let ip = info.sandbox_ip;
        self.sandboxes.insert(slot, (ns, info));
        self.set_policy(slot, policy)?;
        Ok(ip)
    }

    /// Replaces the policy of the sandbox on `slot` (as `PUT /sandboxes/{id}/network`).
    pub fn set_policy(&self, slot: u32, policy: &NetworkPolicy) -> Result<(), EgressError> {
        let (_, info) = self
            .sandboxes
            .get(&slot)
            .ok_or_else(|| lab_err("set_policy", format!("no sandbox on slot {slot}")))?;
        self.net
            .set_policy(slot, &policy.kernel())
            .map_err(|e| lab_err("set_policy", e))?;
        self.egress
            .register(info.sandbox_ip, &format!("lab{slot}"), policy.clone());
        Ok(())
    }

    /// Forgets the resolver's answers to the sandbox on `slot`, as their expiry does.
    pub fn forget_names(&self, slot: u32) {
        if let Some((_, info)) = self.sandboxes.get(&slot) {
            self.egress.forget_names(info.sandbox_ip);
        }
    }

    /// Removes the sandbox on `slot` (as its death does).
    pub fn remove_sandbox(&mut self, slot: u32) -> Result<(), EgressError> {
        if let Some((_, info)) = self.sandboxes.remove(&slot) {
            self.egress.unregister(info.sandbox_ip);
            self.net.detach(slot).map_err(|e| lab_err("detach", e))?;
        }
        Ok(())
    }

    /// The audit trail id of the sandbox on `slot`.
    pub fn id(slot: u32) -> String {
        format!("lab{slot}")
    }

    /// The file the egress writes the trail of the sandbox on `slot` to.
    pub fn trail_file(&self, slot: u32) -> std::path::PathBuf {
        crate::audit::AuditLog::path(&self.dir.join("trails"), &Lab::id(slot))
    }

    /// Runs `f` inside the sandbox on `slot` (on a helper thread in its namespace).
    pub fn in_sandbox<R: Send>(
        &self,
        slot: u32,
        f: impl FnOnce() -> R + Send,
    ) -> Result<R, EgressError> {
        let (ns, _) = self
            .sandboxes
            .get(&slot)
            .ok_or_else(|| lab_err("in_sandbox", format!("no sandbox on slot {slot}")))?;
        run_in_netns(ns, f).map_err(|e| lab_err("in_sandbox", e))
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let _ = self.net.teardown_all();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A DNS query for `name` (A) sent to `server:53` from the calling thread's namespace;
/// the answer's addresses, or the response code's name.
pub fn query_a(server: Ipv4Addr, name: &str) -> Result<Vec<Ipv4Addr>, String> {
    let sock = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).map_err(|e| e.to_string())?;
    sock.set_read_timeout(Some(Duration::from_secs(3)))
        .map_err(|e| e.to_string())?;
    sock.send_to(
        &crate::dns::build_query(7, name, crate::dns::TYPE_A),
        (server, 53),
    )
    .map_err(|e| e.to_string())?;
    let mut buf = [0u8; 1500];
    let n = sock.recv(&mut buf).map_err(|e| e.to_string())?;
    let a = crate::dns::parse_answer(&buf[..n]).map_err(|e| e.0.to_string())?;
    if a.rcode != 0 {
        return Err(crate::dns::rcode_name(a.rcode).to_string());
    }
    Ok(a.ipv4.into_iter().map(|(ip, _)| ip).collect())
}

/// The "internet" servers, each on its own thread inside `inet`.
fn start_internet(
    inet: &Netns,
    questions: Arc<Mutex<Vec<String>>>,
    tls: Arc<rustls::ServerConfig>,
) -> Result<(), EgressError> {
    let https = run_in_netns(inet, || TcpListener::bind((OK_HOST, HTTPS_ECHO_PORT)))
        .map_err(|e| lab_err("https socket", e))?
        .map_err(|e| EgressError::io("binding the lab HTTPS server", e))?;
    std::thread::spawn(move || {
        for c in https.incoming() {
            let Ok(c) = c else { break };
            let _ = c.set_nodelay(true);
            let tls = tls.clone();
            std::thread::spawn(move || {
                if let Ok(conn) = rustls::ServerConnection::new(tls) {
                    serve_http(rustls::StreamOwned::new(conn, c), OK_HOST);
                }
            });
        }
    });
    let names: HashMap<&str, Ipv4Addr> = [
        ("ok.test", OK_HOST),
        ("www.ok.test", OK_HOST),
        ("evil.test", EVIL_HOST),
    ]
    .into_iter()
    .collect();
    let dns = run_in_netns(inet, || UdpSocket::bind((OK_HOST, 53)))
        .map_err(|e| lab_err("dns socket", e))?
        .map_err(|e| EgressError::io("binding the lab DNS server", e))?;
    std::thread::spawn(move || {
        let mut buf = [0u8; 1500];
        while let Ok((n, peer)) = dns.recv_from(&mut buf) {
            let Ok(q) = crate::dns::parse_query(&buf[..n]) else {
                continue;
            };
            questions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(q.name.clone());
            let reply = match names.get(q.name.as_str()) {
                Some(ip) if q.qtype == crate::dns::TYPE_A => a_answer(&buf[..n], *ip),
                _ => crate::dns::error_answer(&buf[..n], &q, crate::dns::RCODE_NXDOMAIN),
            };
            let _ = dns.send_to(&reply, peer);
        }
    });
    for addr in [OK_HOST, EVIL_HOST] {
        let http = run_in_netns(inet, move || TcpListener::bind((addr, 80)))
            .map_err(|e| lab_err("http socket", e))?
            .map_err(|e| EgressError::io("binding the lab HTTP server", e))?;
        std::thread::spawn(move || {
            for c in http.incoming() {
                let Ok(c) = c else { break };
                let _ = c.set_nodelay(true);
                std::thread::spawn(move || serve_http(c, addr));
            }
        });
        let sink = run_in_netns(inet, move || TcpListener::bind((addr, 443)))
            .map_err(|e| lab_err("sink socket", e))?
            .map_err(|e| EgressError::io("binding the lab sink", e))?;
        std::thread::spawn(move || {
            for c in sink.incoming() {
                let Ok(mut c) = c else { break };
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 256 * 1024];
                    let mut total = 0u64;
                    loop {
                        match c.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => total += n as u64,
                        }
                    }
                    let _ = c.write_all(format!("{total}").as_bytes());
                });
            }
        });
    }
    Ok(())
}

/// The lab's web server on one connection: requests without bodies, kept alive until
/// the client closes or asks for `Connection: close`; the body is the server's address,
/// or for `/echo` the request head as received.
fn serve_http<S: Read + Write>(mut c: S, addr: Ipv4Addr) {
    let mut buf = [0u8; 4096];
    let mut got = Vec::new();
    loop {
        let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
            match c.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
            continue;
        };
        let raw = String::from_utf8_lossy(&got[..end]).to_string();
        let head = raw.to_ascii_lowercase();
        got.drain(..end + 4);
        let body = if raw.starts_with("GET /echo") {
            raw
        } else {
            addr.to_string()
        };
        let close = head.contains("connection: close");
        let _ = write!(
            c,
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n{}\r\n{body}",
            body.len(),
            if close { "Connection: close\r\n" } else { "" }
        );
        let _ = c.flush();
        if close {
            return;
        }
    }
}

/// The lab's own CA (the "public" roots of its internet) and a server config for
/// `ok.test` signed by it.
fn internet_tls() -> Result<(String, Arc<rustls::ServerConfig>), EgressError> {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let e = |e: &dyn std::fmt::Display| lab_err("lab CA", e);
    let ca_key = KeyPair::generate().map_err(|x| e(&x))?;
    let mut ca = CertificateParams::default();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "cubicle lab internet CA");
    let ca_cert = ca.self_signed(&ca_key).map_err(|x| e(&x))?;
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().map_err(|x| e(&x))?;
    let mut leaf = CertificateParams::new(vec!["ok.test".to_string(), "www.ok.test".to_string()])
        .map_err(|x| e(&x))?;
    leaf.use_authority_key_identifier_extension = true;
    let cert = leaf.signed_by(&key, &issuer).map_err(|x| e(&x))?;
    let der = rustls_pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into());
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|x| e(&x))?
    .with_no_client_auth()
    .with_single_cert(vec![cert.der().clone(), ca_cert.der().clone()], der)
    .map_err(|x| e(&x))?;
    Ok((ca_cert.pem(), Arc::new(config)))
}

/// An answer to `query` with one A record.
fn a_answer(query: &[u8], ip: Ipv4Addr) -> Vec<u8> {
    let Ok(q) = crate::dns::parse_query(query) else {
        return Vec::new();
    };
    let mut m = crate::dns::error_answer(query, &q, crate::dns::RCODE_NOERROR);
    m[6..8].copy_from_slice(&1u16.to_be_bytes());
    m.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
    m.extend_from_slice(&ip.octets());
    m
}

/// Connects to `addr` (from the calling thread's namespace), sends an HTTP GET with
/// `Host: host`, returns the body or the error.
pub fn http_get(addr: SocketAddr, host: &str) -> Result<String, std::io::Error> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(3)))?;
    write!(
        s,
        "GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    match out.split_once("\r\n\r\n") {
        Some((_, body)) => Ok(body.to_string()),
        None => Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            format!("no HTTP answer (got {} bytes)", out.len()),
        )),
    }
}

/// A minimal TLS ClientHello record naming `sni` (enough for the proxy to read it).
pub fn client_hello(sni: &str) -> Vec<u8> {
    let mut body = vec![3, 3];
    body.extend_from_slice(&[7; 32]);
    body.push(0);
    body.extend_from_slice(&[0, 2, 0x13, 0x01, 1, 0]);
    let name = sni.as_bytes();
    let list_len = 3 + name.len();
    let mut ext = vec![0, 0];
    ext.extend_from_slice(&((list_len + 2) as u16).to_be_bytes());
    ext.extend_from_slice(&(list_len as u16).to_be_bytes());
    ext.push(0);
    ext.extend_from_slice(&(name.len() as u16).to_be_bytes());
    ext.extend_from_slice(name);
    body.extend_from_slice(&(ext.len() as u16).to_be_bytes());
    body.extend_from_slice(&ext);
    let mut hs = vec![1];
    hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    hs.extend_from_slice(&body);
    let mut rec = vec![0x16, 3, 1];
    rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
    rec.extend_from_slice(&hs);
    rec
}

/// Sends a ClientHello naming `sni` to `addr:443`, then `bytes` more, half-closes and
/// returns what the sink counted (its reply), or the error.
pub fn tls_stream(addr: Ipv4Addr, sni: &str, bytes: u64) -> Result<u64, std::io::Error> {
    tls_finish(tls_open(addr, sni)?, bytes)
}

/// A connection to the sink at `addr:443` that has sent a ClientHello naming `sni`
/// (what the proxy decides on); [`tls_finish`] ends it.
pub fn tls_open(addr: Ipv4Addr, sni: &str) -> Result<TcpStream, std::io::Error> {
    let mut s = TcpStream::connect_timeout(&SocketAddr::from((addr, 443)), Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.write_all(&client_hello(sni))?;
    Ok(s)
}

/// Sends `bytes` more on a [`tls_open`] connection, half-closes it and returns what the
/// sink counted (the ClientHello included), or the error.
pub fn tls_finish(mut s: TcpStream, bytes: u64) -> Result<u64, std::io::Error> {
    let chunk = vec![0x5au8; 256 * 1024];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        s.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    s.shutdown(std::net::Shutdown::Write)?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    out.trim().parse().map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            format!("no count from the sink (got {out:?})"),
        )
    })
}

/// What `cubicle bench egress` measures.
#[derive(Debug, Clone)]
pub struct BenchReport {
    /// Bytes streamed through one connection.
    pub bytes: u64,
    /// One connection through the proxy (TLS ClientHello, then raw bytes), Gbit/s.
    pub proxied_gbit_s: f64,
    /// The same, not steered (a sandbox without a policy), Gbit/s.
    pub direct_gbit_s: f64,
    /// New connection + HTTP request + answer, through the proxy: p50, p99 (µs).
    pub proxied_request_us: (u64, u64),
    /// The same, direct.
    pub direct_request_us: (u64, u64),
    /// Applying a domain policy to a fresh sandbox (what a create with a policy adds):
    /// kernel set elements + proxy registration, p50, p99 (µs).
    pub apply_policy_us: (u64, u64),
    /// Removing it again (what a sandbox's death does), p50, p99 (µs).
    pub clear_policy_us: (u64, u64),
    /// Replacing a running sandbox's policy (a live update), p50, p99 (µs).
    pub update_policy_us: (u64, u64),
}

fn percentiles(mut v: Vec<std::time::Duration>) -> (u64, u64) {
    if v.is_empty() {
        return (0, 0);
    }
    v.sort();
    let at = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize].as_micros() as u64;
    (at(0.5), at(0.99))
}

/// Measures the proxy in the lab: one connection streaming `bytes`, `requests` new
/// connections each way, and policy application. The lab's per-sandbox bandwidth limit
/// is lifted so that the proxy itself is measured.
pub fn bench(bytes: u64, requests: usize) -> Result<BenchReport, EgressError> {
    use std::time::Instant;
    Lab::run_with(
        |c| {
            c.limits.bytes_per_sec = 10_000_000_000;
            c.limits.bytes_burst = 1 << 30;
            c.limits.new_connections_per_sec = 100_000;
            c.limits.new_connections_burst = 100_000;
        },
        |lab| -> Result<BenchReport, EgressError> {
            let domain = NetworkPolicy {
                allow_out: vec![
                    "ok.test".parse()?,
                    "*.ok.test".parse()?,
                    "203.0.113.0/24".parse()?,
                ],
                deny_out: vec!["0.0.0.0/0".parse()?],
                ..Default::default()
            };
            lab.add_sandbox(1, &domain)?;
            lab.add_sandbox(2, &NetworkPolicy::default())?;
            let resolved = lab.in_sandbox(1, || query_a(OK_HOST, "ok.test"))?;
            if resolved != Ok(vec![OK_HOST]) {
                return Err(lab_err(
                    "bench",
                    format!("ok.test resolved to {resolved:?}"),
                ));
            }
            let stream = |slot: u32| -> Result<f64, EgressError> {
                let r = lab.in_sandbox(slot, || {
                    let t = Instant::now();
                    tls_stream(OK_HOST, "ok.test", bytes).map(|n| (n, t.elapsed()))
                })?;
                let (n, took) = r.map_err(|e| EgressError::io("streaming through the lab", e))?;
                Ok(n as f64 * 8.0 / took.as_secs_f64() / 1e9)
            };
            let proxied_gbit_s = stream(1)?;
            let direct_gbit_s = stream(2)?;
            let requests_from = |slot: u32| -> Result<(u64, u64), EgressError> {
                let times = lab.in_sandbox(slot, || {
                    let mut v = Vec::with_capacity(requests);
                    for _ in 0..requests {
                        let t = Instant::now();
                        http_get(SocketAddr::from((OK_HOST, 80)), "ok.test")?;
                        v.push(t.elapsed());
                    }
                    Ok::<_, std::io::Error>(v)
                })?;
                Ok(percentiles(times.map_err(|e| {
                    EgressError::io("requests through the lab", e)
                })?))
            };
            // Interleave a warm-up of each before measuring.
            requests_from(1)?;
            requests_from(2)?;
            let proxied_request_us = requests_from(1)?;
            let direct_request_us = requests_from(2)?;
            // Policy application: a fresh sandbox on slot 3 (attached once), its policy
            // added and cleared repeatedly; then updates between two policies.
            lab.add_sandbox(3, &NetworkPolicy::default())?;
            let (mut apply, mut clear) = (Vec::new(), Vec::new());
            for _ in 0..200 {
                let t = Instant::now();
                lab.set_policy(3, &domain)?;
                apply.push(t.elapsed());
                let t = Instant::now();
                lab.set_policy(3, &NetworkPolicy::default())?;
                clear.push(t.elapsed());
            }
            let other = NetworkPolicy {
                allow_out: vec!["evil.test".parse()?, "198.51.100.0/24".parse()?],
                deny_out: vec!["0.0.0.0/0".parse()?],
                ..Default::default()
            };
            let mut update = Vec::new();
            for i in 0..200 {
                let p = if i % 2 == 0 { &other } else { &domain };
                let t = Instant::now();
                lab.set_policy(3, p)?;
                update.push(t.elapsed());
            }
            for slot in [1, 2, 3] {
                lab.remove_sandbox(slot)?;
            }
            Ok(BenchReport {
                bytes,
                proxied_gbit_s,
                direct_gbit_s,
                proxied_request_us,
                direct_request_us,
                apply_policy_us: percentiles(apply),
                clear_policy_us: percentiles(clear),
                update_policy_us: percentiles(update),
            })
        },
    )?
}

/// Sends `hosts.len()` requests on one kept-alive connection to `addr`, one per `Host`;
/// returns the bodies that came back (fewer when the connection was cut).
pub fn keep_alive(addr: SocketAddr, hosts: &[&str]) -> Result<Vec<String>, std::io::Error> {
    let reqs: Vec<(&str, &str)> = hosts.iter().map(|h| (*h, "/")).collect();
    keep_alive_paths(addr, &reqs)
}

/// [`keep_alive`] with a path per request (`/echo` answers with the request head the
/// server received).
pub fn keep_alive_paths(
    addr: SocketAddr,
    reqs: &[(&str, &str)],
) -> Result<Vec<String>, std::io::Error> {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(3)))?;
    s.set_nodelay(true)?;
    Ok(exchange(s, reqs))
}

/// The same over TLS to `addr`, as `sni`, trusting only the CA certificates in
/// `ca_pem` (the node's egress CA for an intercepted connection).
pub fn https_keep_alive(
    addr: SocketAddr,
    sni: &str,
    ca_pem: &str,
    reqs: &[(&str, &str)],
) -> Result<Vec<String>, std::io::Error> {
    use rustls_pki_types::pem::PemObject;
    let other = |e: &dyn std::fmt::Display| std::io::Error::other(e.to_string());
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots
            .add(c.map_err(|e| other(&e))?)
            .map_err(|e| other(&e))?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| other(&e))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = rustls_pki_types::ServerName::try_from(sni.to_string()).map_err(|e| other(&e))?;
    let conn = rustls::ClientConnection::new(Arc::new(config), name).map_err(|e| other(&e))?;
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(3)))?;
    s.set_nodelay(true)?;
    let mut tls = rustls::StreamOwned::new(conn, s);
    // Complete the handshake here so that a certificate error is this call's error.
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock)?;
    }
    Ok(exchange(tls, reqs))
}

/// Sends `reqs` (host, path) one after the other on `s`, each after the answer to the
/// one before; the answers' bodies, as far as they came.
pub fn exchange<S: Read + Write>(mut s: S, reqs: &[(&str, &str)]) -> Vec<String> {
    let mut bodies = Vec::new();
    for (host, path) in reqs {
        if write!(s, "GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n").is_err() {
            break;
        }
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        let body = loop {
            if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                if got.len() >= end + 4 + len {
                    break Some(String::from_utf8_lossy(&got[end + 4..end + 4 + len]).to_string());
                }
            }
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break None,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        };
        match body {
            Some(b) => bodies.push(b),
            None => break,
        }
    }
    bodies
}
