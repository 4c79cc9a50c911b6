//! A test "internet" for the node's network tests: a namespace holding `<net>.2` behind a
//! veth whose host side is `<net>.1`, reached by the sandboxes through the host (their
//! default route), plus a guard table that counts and drops any forwarded packet of the
//! listed sandbox interfaces that would leave through another interface. Each suite
//! names its documentation network (`abuse` 203.0.113.0/24, `pool` 198.51.100.0/24,
//! as the runtime's own tests; never 192.0.2.0/24, the development VM's own subnet).
//! Two suites on one network must not run at once (cargo runs test binaries one after
//! the other).

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use cubicle_runtime::network::{Netns, run_in_netns};

/// What a [`Server`] does with a connection.
#[derive(Clone, Copy, PartialEq)]
pub enum Serve {
    /// Writes the peer's address and closes.
    Peer,
    /// Keeps it open and echoes what it reads, until the peer closes.
    Echo,
}

/// A TCP server counting its connections; stops accepting on drop.
pub struct Server {
    pub addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl Server {
    /// Answers each connection with the peer's address.
    pub fn start(listener: TcpListener) -> anyhow::Result<Server> {
        Server::serving(listener, Serve::Peer)
    }

    pub fn serving(listener: TcpListener, how: Serve) -> anyhow::Result<Server> {
        use std::io::{Read as _, Write as _};
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let hits = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (h, s) = (hits.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((mut c, peer)) => {
                        h.fetch_add(1, Ordering::SeqCst);
                        if how == Serve::Peer {
                            let _ = c.write_all(peer.to_string().as_bytes());
                            continue;
                        }
                        std::thread::spawn(move || {
                            let _ = c.set_nonblocking(false);
                            let mut buf = [0u8; 512];
                            while let Ok(n @ 1..) = c.read(&mut buf) {
                                if c.write_all(&buf[..n]).is_err() {
                                    break;
                                }
                            }
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        Ok(Server { addr, hits, stop })
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

pub fn ip(args: &[&str]) -> anyhow::Result<()> {
    let o = Command::new("ip").args(args).output()?;
    anyhow::ensure!(
        o.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(())
}

pub fn nft(script: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .ok_or_else(|| anyhow::anyhow!("nft stdin"))?
        .write_all(script.as_bytes())?;
    let o = child.wait_with_output()?;
    anyhow::ensure!(
        o.status.success(),
        "nft: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(())
}

/// The lab (see the module comment). Removed on drop.
pub struct TestInternet {
    netns: String,
    host_if: String,
    guard_table: String,
    pub ns: Netns,
    /// The internet host's address (`<net>.2`) and the host's side (`<net>.1`).
    pub host_ip: Ipv4Addr,
    pub gateway: Ipv4Addr,
}

impl TestInternet {
    /// A lab called `name` (its namespace, interface and guard table carry it) on the
    /// /24 `net` (its first three octets), guarding the host interfaces `guarded_ifs`.
    pub fn new(name: &str, net: [u8; 3], guarded_ifs: &[String]) -> anyhow::Result<TestInternet> {
        let pid = std::process::id();
        let netns = format!("cubicle-{name}-inet-{pid}");
        // Not "cbs…": that prefix is the sandboxes'. At most 15 bytes.
        let host_if: String = format!("cbl{name}")
            .chars()
            .take(8)
            .chain(format!("{}", pid % 10_000_000).chars())
            .take(15)
            .collect();
        let guard_table = format!("cubicle_{name}_guard");
        let _ = Command::new("ip").args(["link", "del", &host_if]).output();
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", &guard_table])
            .output();
        ip(&["netns", "add", &netns])?;
        let ns = match Netns::open(format!("/run/netns/{netns}")) {
            Ok(ns) => ns,
            Err(e) => {
                let _ = Command::new("ip").args(["netns", "del", &netns]).output();
                return Err(e.into());
            }
        };
        let [a, b, c] = net;
        let me = TestInternet {
            netns,
            host_if,
            guard_table,
            ns,
            host_ip: Ipv4Addr::new(a, b, c, 2),
            gateway: Ipv4Addr::new(a, b, c, 1),
        };
        let (n, h) = (me.netns.as_str(), me.host_if.as_str());
        ip(&[
            "link", "add", h, "type", "veth", "peer", "name", "eth0", "netns", n,
        ])?;
        ip(&["addr", "add", &format!("{}/24", me.gateway), "dev", h])?;
        ip(&["link", "set", h, "up"])?;
        let inet = format!("{}/24", me.host_ip);
        ip(&["-n", n, "addr", "add", &inet, "dev", "eth0"])?;
        ip(&["-n", n, "link", "set", "eth0", "up"])?;
        ip(&["-n", n, "link", "set", "lo", "up"])?;
        ip(&[
            "-n",
            n,
            "route",
            "add",
            "default",
            "via",
            &me.gateway.to_string(),
        ])?;
        let ifs = guarded_ifs
            .iter()
            .map(|i| format!("\"{i}\""))
            .collect::<Vec<_>>()
            .join(", ");
        if !ifs.is_empty() {
            nft(&format!(
                "table inet {} {{
                    chain forward {{
                        type filter hook forward priority filter + 20; policy accept;
                        iifname {{ {ifs} }} oifname != \"{h}\" counter drop
                    }}
                }}\n",
                me.guard_table
            ))?;
        }
        Ok(me)
    }

    /// A server on the internet host (any free port).
    pub fn server(&self, how: Serve) -> anyhow::Result<Server> {
        let at = SocketAddrV4::new(self.host_ip, 0);
        Server::serving(run_in_netns(&self.ns, || TcpListener::bind(at))??, how)
    }

    /// Packets the guard dropped.
    pub fn guard_count(&self) -> anyhow::Result<u64> {
        let o = Command::new("nft")
            .args(["list", "chain", "inet", &self.guard_table, "forward"])
            .output()?;
        let text = String::from_utf8_lossy(&o.stdout);
        Ok(text
            .split("packets ")
            .skip(1)
            .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .sum())
    }
}

impl Drop for TestInternet {
    fn drop(&mut self) {
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", &self.guard_table])
            .output();
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .output();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.netns])
            .output();
    }
}
