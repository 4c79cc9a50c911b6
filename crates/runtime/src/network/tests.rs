//! Network tests. Pure ones run everywhere; the others need root and build real network
//! namespaces (`ip netns add cubicle-test-…`) standing in for sandboxes, plus a test
//! "internet" host in its own namespace on 198.51.100.0/24 (TEST-NET-2). All traffic
//! stays on this machine: a guard table counts (and drops) any forwarded sandbox packet
//! that would leave through an interface the test did not make, and the test asserts
//! that counter stays zero.
//!
//! The root tests share one nft table/prefix (`cubicle_t`/`cbt`) and run one at a time.

use super::*;
use std::io::{Read, Write as _};
use std::net::{SocketAddr, SocketAddrV4, TcpListener};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

/// Serializes the root tests within this process (mutex) and across processes (an
/// abstract Unix socket name, released by the kernel when the holder exits), since they
/// share one table and interface prefix and colleagues may run the suite concurrently.
fn serial() -> (
    std::sync::MutexGuard<'static, ()>,
    std::os::unix::net::UnixListener,
) {
    use std::os::linux::net::SocketAddrExt;
    let guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(b"cubicle-network-tests")
        .expect("abstract name");
    loop {
        match std::os::unix::net::UnixListener::bind_addr(&addr) {
            Ok(l) => return (guard, l),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => panic!("test lock: {e}"),
        }
    }
}

#[test]
fn cidr_parse_and_normalize() {
    let c: Ipv4Cidr = "10.200.3.7/16".parse().unwrap();
    assert_eq!(c.to_string(), "10.200.0.0/16");
    assert_eq!(c.size(), 65536);
    assert!(c.contains("10.200.255.1".parse().unwrap()));
    assert!(!c.contains("10.201.0.1".parse().unwrap()));
    assert_eq!(
        "1.2.3.4".parse::<Ipv4Cidr>().unwrap().to_string(),
        "1.2.3.4/32"
    );
    assert!("1.2.3.4/33".parse::<Ipv4Cidr>().is_err());
    assert!("::1/128".parse::<Ipv4Cidr>().is_err());
}

#[test]
fn a_policy_refuses_what_it_denies_and_does_not_allow() {
    let ip = |s: &str| s.parse::<Ipv4Addr>().unwrap();
    let cidr = |s: &str| s.parse::<Ipv4Cidr>().unwrap();
    assert!(!EgressPolicy::default().refuses(ip("1.2.3.4")));
    let some = EgressPolicy {
        deny: vec![cidr("1.2.3.0/24")],
        allow: vec![cidr("1.2.3.4")],
        ..Default::default()
    };
    assert!(some.refuses(ip("1.2.3.5")));
    assert!(!some.refuses(ip("1.2.3.4")), "allow wins");
    assert!(!some.refuses(ip("5.6.7.8")));
    let all = EgressPolicy {
        deny_all: true,
        allow: vec![cidr("5.6.7.0/24")],
        ..Default::default()
    };
    assert!(all.refuses(ip("1.2.3.4")));
    assert!(!all.refuses(ip("5.6.7.8")));
}

#[test]
fn slots_are_deterministic() {
    let net = Network::new(NetworkConfig::default()).unwrap();
    assert_eq!(net.max_slots(), 32768);
    let i = net.slot_info(0).unwrap();
    assert_eq!(
        (i.gateway, i.sandbox_ip),
        ("10.200.0.0".parse().unwrap(), "10.200.0.1".parse().unwrap())
    );
    let i = net.slot_info(300).unwrap();
    assert_eq!(i.host_ifname, "cbs300");
    assert_eq!(i.sandbox_ip, "10.200.2.89".parse::<Ipv4Addr>().unwrap());
    assert_eq!(net.slot_of_ifname("cbs300"), Some(300));
    assert_eq!(net.slot_of_ip(i.sandbox_ip), Some(300));
    assert_eq!(net.slot_of_ip(i.gateway), Some(300));
    assert_eq!(net.slot_of_ifname("cbr0"), None);
    assert!(net.slot_info(32768).is_err());
    let longest = net.slot_info(net.max_slots() - 1).unwrap();
    assert!(longest.host_ifname.len() <= 15);
}

#[test]
fn rules_render_without_placeholders() {
    let net = Network::new(NetworkConfig {
        deny_private: vec![],
        ..NetworkConfig::default()
    })
    .unwrap();
    let (a, b, n) = net.render_rules().unwrap();
    assert!(n.contains("@NODE_TABLE@") && n.contains("@DNS_PORT@"));
    for ph in [
        "@TABLE@",
        "@IFPREFIX@",
        "@POOL@",
        "@CONTROL@",
        "@HOST_NETS@",
        "@PRIVATE@",
        "@NODE_ALLOW@",
        "@SMTP@",
        "@MAX_CONNS@",
        "@NEW_CONNS@",
        "@NEW_BURST@",
        "@BYTES@",
        "@BYTES_BURST@",
        "@LOG_GROUP@",
    ] {
        assert!(!a.contains(ph) && !b.contains(ph), "{ph} left in the rules");
    }
    assert!(a.contains("iifname \"cbs*\""));
    assert!(a.contains("10.200.0.0/16"));
    assert!(b.contains("table inet cubicle_policy"));
    assert!(!a.contains("table inet cubicle_policy"));
}

#[test]
fn resolv_conf_skips_loopback_and_ipv6() {
    let text = "# x\nnameserver 127.0.0.53\nnameserver 10.255.255.53\nnameserver ::1\nsearch a\nnameserver 1.1.1.1\n";
    assert_eq!(
        parse_resolv_conf(text),
        vec![
            "10.255.255.53".parse::<Ipv4Addr>().unwrap(),
            "1.1.1.1".parse().unwrap()
        ]
    );
}

#[test]
fn bad_config_is_rejected() {
    let bad = NetworkConfig {
        ifname_prefix: "toolongprefix".into(),
        ..NetworkConfig::default()
    };
    assert!(Network::new(bad).is_err());
    let bad = NetworkConfig {
        table: "x; flush ruleset".into(),
        ..NetworkConfig::default()
    };
    assert!(Network::new(bad).is_err());
}

// ---------------------------------------------------------------------------------------
// Root tests.

fn is_root() -> bool {
    cubicle_syscalls::is_root()
}

macro_rules! require_root {
    () => {
        if !is_root() {
            eprintln!(
                "SKIPPED: needs root (creates network namespaces, veths and nftables tables)"
            );
            return;
        }
        if Command::new(nft_binary())
            .arg("--version")
            .output()
            .is_err()
        {
            eprintln!("SKIPPED: the `nft` binary (nftables package) is not installed");
            return;
        }
    };
}

const TEST_TABLE: &str = "cubicle_t";
const TEST_PREFIX: &str = "cbt";
const GUARD_TABLE: &str = "cubicle_t_guard";
const INET_IF: &str = "cubinet0"; // must NOT start with TEST_PREFIX

fn test_config() -> NetworkConfig {
    NetworkConfig {
        table: TEST_TABLE.into(),
        ifname_prefix: TEST_PREFIX.into(),
        pool: "10.201.0.0/24".parse().unwrap(),
        // The test "internet" is on a subnet of this host (INET_IF); the test of the
        // host-subnet denial turns this on.
        deny_host_subnets: false,
        ..NetworkConfig::default()
    }
}

/// A `sleep` in a network namespace of its own (as a sandbox's init is), and its pid.
fn process_in_new_netns() -> (std::process::Child, i32) {
    let ours = std::fs::read_link("/proc/self/ns/net").unwrap();
    let child = Command::new("unshare")
        .args(["--net", "sleep", "60"])
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let t = Instant::now();
    while std::fs::read_link(format!("/proc/{pid}/ns/net"))
        .ok()
        .as_ref()
        == Some(&ours)
    {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "unshare --net did not unshare"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    (child, pid)
}

fn sh(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().expect("spawn");
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A named netns that is deleted on drop.
struct TestNs {
    name: String,
    ns: Netns,
}

impl TestNs {
    fn new(tag: &str) -> TestNs {
        let name = format!("cubicle-test-{tag}-{}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        sh("ip", &["netns", "add", &name]);
        let ns = Netns::open(format!("/run/netns/{name}")).unwrap();
        loopback_up(&ns).unwrap();
        TestNs { name, ns }
    }
}

impl Drop for TestNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Everything a root test builds, torn down on drop (also when the test panics).
struct World {
    net: Network,
    internet: TestNs,
}

impl World {
    fn new() -> World {
        cleanup_leftovers();
        let net = Network::init(test_config()).unwrap();
        // The test "internet": a namespace with 198.51.100.2, reached via the host.
        let internet = TestNs::new("inet");
        sh(
            "ip",
            &[
                "link",
                "add",
                INET_IF,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                &internet.name,
            ],
        );
        sh("ip", &["addr", "add", "198.51.100.1/24", "dev", INET_IF]);
        sh("ip", &["link", "set", INET_IF, "up"]);
        sh(
            "ip",
            &[
                "-n",
                &internet.name,
                "addr",
                "add",
                "198.51.100.2/24",
                "dev",
                "eth0",
            ],
        );
        sh("ip", &["-n", &internet.name, "link", "set", "eth0", "up"]);
        sh(
            "ip",
            &[
                "-n",
                &internet.name,
                "route",
                "add",
                "default",
                "via",
                "198.51.100.1",
            ],
        );
        // In a private namespace (`unshare --net`, as the test instructions ask) there is
        // no default route, and a packet to an unrouted address would fail for lack of a
        // route instead of by the rules: route everything to the test internet then.
        if sh("ip", &["-4", "route", "show", "default"])
            .trim()
            .is_empty()
        {
            sh(
                "ip",
                &[
                    "route",
                    "add",
                    "default",
                    "via",
                    "198.51.100.2",
                    "dev",
                    INET_IF,
                ],
            );
        }
        // Guard: a forwarded packet from a test sandbox may only leave towards the test
        // internet or back into test sandboxes; anything else is counted and dropped.
        nft_apply(
            &format!(
                "table inet {GUARD_TABLE} {{
                    chain forward {{
                        type filter hook forward priority filter + 20; policy accept;
                        iifname \"{TEST_PREFIX}*\" oifname != {{ \"{INET_IF}\", \"{TEST_PREFIX}*\" }} counter drop
                        iifname \"{TEST_PREFIX}*\" oifname \"{TEST_PREFIX}*\" counter drop
                    }}
                }}\n"
            ),
            "test guard",
        )
        .unwrap();
        World { net, internet }
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = self.net.teardown_all();
        let _ = Command::new("ip").args(["link", "del", INET_IF]).output();
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", GUARD_TABLE])
            .output();
    }
}

fn cleanup_leftovers() {
    if let Ok(net) = Network::new(test_config()) {
        let _ = net.teardown_all();
    }
    let _ = Command::new("ip").args(["link", "del", INET_IF]).output();
    let _ = Command::new("nft")
        .args(["delete", "table", "inet", GUARD_TABLE])
        .output();
}

fn guard_counters() -> u64 {
    let out = sh("nft", &["list", "chain", "inet", GUARD_TABLE, "forward"]);
    out.split("packets ")
        .skip(1)
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// A TCP listener bound in `ns` at `addr` that answers each connection with the peer's
/// address (so the test can see NAT) and records it.
fn listen_in(ns: &Netns, addr: SocketAddr) -> (SocketAddr, std::sync::mpsc::Receiver<SocketAddr>) {
    let listener = run_in_netns(ns, move || TcpListener::bind(addr))
        .unwrap()
        .unwrap();
    let local = listener.local_addr().unwrap();
    listener.set_nonblocking(false).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { break };
            let peer = conn.peer_addr().unwrap();
            let _ = conn.write_all(peer.to_string().as_bytes());
            if tx.send(peer).is_err() {
                break;
            }
        }
    });
    (local, rx)
}

/// Tries a TCP connect from inside `ns` with a timeout; Ok(reply) or Err(error).
fn try_connect(ns: &Netns, addr: SocketAddr) -> Result<String, io::Error> {
    run_in_netns(ns, move || -> io::Result<String> {
        let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        let mut buf = String::new();
        s.read_to_string(&mut buf)?;
        Ok(buf)
    })
    .unwrap()
}

fn v4(s: &str, port: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(s.parse().unwrap(), port))
}

fn host_primary_ipv4() -> Option<Ipv4Addr> {
    let out = sh("ip", &["-4", "-o", "addr", "show", "scope", "global"]);
    out.lines()
        .filter(|l| !l.contains(TEST_PREFIX) && !l.contains(INET_IF))
        .filter_map(|l| l.split_whitespace().nth(3)?.split('/').next()?.parse().ok())
        .next()
}

#[test]
fn egress_isolation_end_to_end() {
    require_root!();
    let _serial = serial();
    let world = World::new();
    let a = TestNs::new("a");
    let b = TestNs::new("b");
    let c = TestNs::new("c"); // no internet: no veth
    let ia = world.net.attach(&a.ns, 1).unwrap();
    let ib = world.net.attach(&b.ns, 2).unwrap();
    assert_eq!(ia.host_ifname, "cbt1");
    assert_eq!(ib.host_ifname, "cbt2");
    assert_ne!(ia.sandbox_ip, ib.sandbox_ip);
    // IPv6 is off on the host sides: no per-interface routes in the host's IPv6 tables.
    if std::path::Path::new("/proc/sys/net/ipv6").exists() {
        let v = std::fs::read_to_string("/proc/sys/net/ipv6/conf/cbt1/disable_ipv6").unwrap();
        assert_eq!(v.trim(), "1");
        let out = Command::new("ip")
            .args(["-6", "route", "show", "table", "all", "dev", "cbt1"])
            .output()
            .unwrap();
        let routes = String::from_utf8_lossy(&out.stdout);
        assert!(routes.trim().is_empty(), "IPv6 routes on cbt1: {routes}");
    }

    // 1. Internet: sandbox A reaches the test internet host, NATed to the host address.
    let (inet_addr, inet_rx) = listen_in(&world.internet.ns, v4("198.51.100.2", 0));
    let reply = try_connect(&a.ns, inet_addr).expect("sandbox should reach the internet host");
    assert_eq!(
        reply.split(':').next(),
        Some("198.51.100.1"),
        "egress must be masqueraded"
    );
    assert!(inet_rx.recv_timeout(Duration::from_secs(1)).is_ok());
    assert!(try_connect(&b.ns, inet_addr).is_ok());

    // 2. Sandbox B cannot reach sandbox A.
    let (a_addr, a_rx) = listen_in(&a.ns, SocketAddr::V4(SocketAddrV4::new(ia.sandbox_ip, 0)));
    let t = Instant::now();
    let err = try_connect(&b.ns, a_addr).expect_err("sandbox B must not reach sandbox A");
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "denial should be immediate, got {err} after {:?}",
        t.elapsed()
    );
    // ...nor A's host-side (gateway) address.
    let err2 = try_connect(
        &b.ns,
        SocketAddr::V4(SocketAddrV4::new(ia.gateway, a_addr.port())),
    );
    assert!(err2.is_err());
    // ...but the host itself can, via the namespace (the router's path).
    let mut s = connect_addr_in_netns(&a.ns, a_addr).unwrap();
    let mut got = String::new();
    s.read_to_string(&mut got).unwrap();
    assert!(got.starts_with(&ia.sandbox_ip.to_string()));
    assert!(a_rx.recv_timeout(Duration::from_secs(1)).is_ok());
    assert!(
        a_rx.try_recv().is_err(),
        "sandbox B's attempt must not have arrived"
    );
    // ...and not through A's address: the host's own connections into a sandbox (any
    // local user's `curl <sandbox ip>:<port>`) are refused at once.
    let t = Instant::now();
    let err = std::net::TcpStream::connect_timeout(&a_addr, Duration::from_secs(3))
        .expect_err("the host must not open a connection to a sandbox's address");
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "refusal should be immediate, got {err} after {:?}",
        t.elapsed()
    );
    assert!(
        a_rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "the host's attempt must not have arrived"
    );

    // 3. The host: its veth address, its loopback, its primary address.
    let host_ns = Netns::current().unwrap();
    let (gw_addr, gw_rx) = listen_in(&host_ns, SocketAddr::V4(SocketAddrV4::new(ia.gateway, 0)));
    assert!(
        try_connect(&a.ns, gw_addr).is_err(),
        "sandbox must not reach the host's veth address"
    );
    let (lo_addr, lo_rx) = listen_in(&host_ns, v4("127.0.0.1", 0));
    assert!(
        try_connect(&a.ns, lo_addr).is_err(),
        "sandbox must not reach host loopback services"
    );
    if let Some(ip) = host_primary_ipv4() {
        let (p_addr, p_rx) = listen_in(&host_ns, SocketAddr::V4(SocketAddrV4::new(ip, 0)));
        assert!(
            try_connect(&a.ns, p_addr).is_err(),
            "sandbox must not reach the host at {ip}"
        );
        assert!(p_rx.try_recv().is_err());
    }
    assert!(gw_rx.try_recv().is_err() && lo_rx.try_recv().is_err());

    // 4. Link-local / metadata (and a private range) are refused at once.
    for target in [
        v4("169.254.169.254", 80),
        v4("10.1.2.3", 80),
        v4("192.168.1.1", 80),
    ] {
        let t = Instant::now();
        let err = try_connect(&a.ns, target).expect_err("must be denied");
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "{target}: {err} after {:?}",
            t.elapsed()
        );
    }

    // 5. No internet: only loopback exists; but the host can still reach inside.
    assert!(try_connect(&c.ns, inet_addr).is_err());
    let (c_addr, _c_rx) = listen_in(&c.ns, v4("127.0.0.1", 0));
    let mut s = connect_in_netns(&c.ns, c_addr.port()).unwrap();
    let mut got = String::new();
    s.read_to_string(&mut got).unwrap();
    assert!(got.starts_with("127.0.0.1:"));

    // DNS is for the node's resolver: with no node serving these slots (no redirect
    // table), a query is refused, never let out to the server it named.
    let (dns_addr, dns_rx) = listen_in(&world.internet.ns, v4("198.51.100.2", 53));
    let t = Instant::now();
    assert!(
        try_connect(&a.ns, dns_addr).is_err(),
        "DNS must not go out uninspected"
    );
    assert!(t.elapsed() < Duration::from_secs(1));
    assert!(dns_rx.try_recv().is_err());

    // Outbound SMTP is closed (while another port of the same host works).
    let (smtp_ok, _rx) = listen_in(&world.internet.ns, v4("198.51.100.2", 0));
    assert!(try_connect(&a.ns, smtp_ok).is_ok());
    let (_l, _rx) = {
        let l = run_in_netns(&world.internet.ns, || TcpListener::bind("198.51.100.2:25"))
            .unwrap()
            .unwrap();
        (l, ())
    };
    let t = Instant::now();
    assert!(try_connect(&a.ns, v4("198.51.100.2", 25)).is_err());
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "port 25: {:?}",
        t.elapsed()
    );

    // The host's own subnets: the test internet sits on one (cubinet0); a node that
    // denies host subnets refuses it, at once.
    let deny_host = Network::init(NetworkConfig {
        deny_host_subnets: true,
        ..test_config()
    })
    .unwrap();
    let t = Instant::now();
    assert!(
        try_connect(&a.ns, inet_addr).is_err(),
        "the host's own subnet must be denied"
    );
    assert!(t.elapsed() < Duration::from_secs(1));
    assert_eq!(
        deny_host
            .address_guard()
            .check("198.51.100.2".parse().unwrap(), Some(80)),
        Err(NodeDenial::HostSubnet)
    );
    Network::init(test_config()).unwrap();
    assert!(try_connect(&a.ns, inet_addr).is_ok());

    // Nothing tried to leave through an interface the test did not make.
    assert_eq!(guard_counters(), 0, "a sandbox packet reached the guard");

    // 6. Detach forgets the sandbox's connections (conntrack), then leaves nothing.
    let (held, _rx) = listen_in(&world.internet.ns, v4("198.51.100.2", 0));
    let _kept = run_in_netns(&a.ns, move || std::net::TcpStream::connect(held))
        .unwrap()
        .unwrap();
    assert!(conntrack::count_source(ia.sandbox_ip).unwrap() > 0);
    // As the node does it: whether it sent is read while it lives.
    assert!(!world.net.never_sent(1), "a sent packets");
    world.net.detach_with(1, world.net.never_sent(1)).unwrap();
    assert_eq!(conntrack::count_source(ia.sandbox_ip).unwrap(), 0);
    world.net.detach(1).unwrap(); // idempotent
    // A sandbox that never sent a packet (IPv6 is off on its eth0, so it does not even
    // announce itself) is seen as such; a detached slot (veth gone) never is.
    let quiet = TestNs::new("q");
    world.net.attach(&quiet.ns, 3).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(world.net.never_sent(3), "a quiet sandbox sent packets");
    assert_eq!(world.net.sent(3), super::Sent::Packets(0));
    world.net.detach_with(3, true).unwrap();
    assert!(!world.net.never_sent(3));
    // Without a veth there is nothing to cut (a live sandbox made without internet).
    assert_eq!(world.net.sent(3), super::Sent::NoVeth);
    drop(quiet);
    // As the node kills a sandbox: its namespace is held (Netns::of_process) before the
    // kill, so its veth outlives its processes and the counter read once they are gone
    // is final — for one that sent and for one that did not. Without the hold, the veth
    // dies with the namespace (then the answer is "sent": its connections are looked for).
    for (slot, sends) in [(4, true), (5, false)] {
        let (mut child, pid) = process_in_new_netns();
        let pidfd = cubicle_syscalls::pidfd::pidfd_open(pid).unwrap();
        let ns = Netns::of_process(pid, &pidfd).unwrap();
        world.net.attach(&ns, slot).unwrap();
        if sends {
            let probe = v4("198.51.100.2", 9);
            run_in_netns(&ns, move || {
                let s = std::net::UdpSocket::bind("0.0.0.0:0")?;
                s.send_to(b"before the kill", probe)
            })
            .unwrap()
            .unwrap();
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            Netns::of_process(pid, &pidfd).is_err(),
            "an exited process has no namespace to hold"
        );
        assert!(
            world.net.is_attached(slot).unwrap(),
            "the held namespace lost its veth"
        );
        assert_eq!(world.net.never_sent(slot), !sends, "slot {slot}");
        if sends {
            // Unheld, the namespace dies and takes the veth (and its counter) along.
            drop(ns);
            let t = Instant::now();
            while world.net.is_attached(slot).unwrap() {
                assert!(
                    t.elapsed() < Duration::from_secs(5),
                    "the veth outlived its namespace"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            assert!(
                !world.net.never_sent(slot),
                "a vanished veth is never quiet"
            );
            world.net.detach_with(slot, false).unwrap();
        } else {
            world.net.detach_with(slot, true).unwrap();
            drop(ns);
        }
    }
    assert!(!sh("ip", &["-o", "link"]).contains(": cbt1@"));
    assert!(try_connect(&a.ns, inet_addr).is_err());
    drop(c);
    drop(b);
    drop(a);
    drop(world);
    let links = sh("ip", &["-o", "link"]);
    assert!(
        !links.contains(": cbt") && !links.contains(INET_IF),
        "leftover links:\n{links}"
    );
    let ruleset = sh("nft", &["list", "tables"]);
    assert!(!ruleset.contains(TEST_TABLE), "leftover tables:\n{ruleset}");
    assert!(!sh("ip", &["netns", "list"]).contains(&format!("-{}", std::process::id())));
}

#[test]
fn policies_allow_deny_and_reconcile() {
    require_root!();
    let _serial = serial();
    let world = World::new();
    let a = TestNs::new("pa");
    let b = TestNs::new("pb");
    let ia = world.net.attach(&a.ns, 5).unwrap();
    let ib = world.net.attach(&b.ns, 6).unwrap();
    let (inet_addr, _rx) = listen_in(&world.internet.ns, v4("198.51.100.2", 0));
    assert!(try_connect(&a.ns, inet_addr).is_ok());

    // denyOut the test internet host.
    let deny = EgressPolicy {
        deny: vec!["198.51.100.0/24".parse().unwrap()],
        ..Default::default()
    };
    world.net.set_policy(5, &deny).unwrap();
    assert!(try_connect(&a.ns, inet_addr).is_err(), "denyOut must block");
    assert!(
        try_connect(&b.ns, inet_addr).is_ok(),
        "another sandbox is unaffected"
    );

    // Anti-spoofing: A (denied) takes B's address to escape its policy; the host drops
    // those packets before routing. Counters in the guard table (after the raw-priority
    // anti-spoofing chain) see A's genuine packets but never the spoofed ones.
    nft_apply(
        &format!(
            "table inet {GUARD_TABLE} {{
                chain spoof {{
                    type filter hook prerouting priority -200; policy accept;
                    iifname \"{}\" ip saddr {} counter comment \"genuine\"
                    iifname \"{}\" ip saddr {} counter comment \"spoofed\"
                }}
            }}\n",
            ia.host_ifname, ia.sandbox_ip, ia.host_ifname, ib.sandbox_ip
        ),
        "test spoof counters",
    )
    .unwrap();
    let (gw, spoofed) = (ia.gateway.to_string(), ib.sandbox_ip.to_string());
    assert!(try_connect(&a.ns, inet_addr).is_err());
    sh(
        "ip",
        &[
            "-n",
            &a.name,
            "addr",
            "add",
            &format!("{spoofed}/32"),
            "dev",
            "eth0",
        ],
    );
    sh(
        "ip",
        &[
            "-n", &a.name, "route", "replace", "default", "via", &gw, "dev", "eth0", "src",
            &spoofed, "onlink",
        ],
    );
    let _ = try_connect(&a.ns, inet_addr);
    sh(
        "ip",
        &[
            "-n", &a.name, "route", "replace", "default", "via", &gw, "dev", "eth0", "onlink",
        ],
    );
    sh(
        "ip",
        &[
            "-n",
            &a.name,
            "addr",
            "del",
            &format!("{spoofed}/32"),
            "dev",
            "eth0",
        ],
    );
    let chain = sh("nft", &["list", "chain", "inet", GUARD_TABLE, "spoof"]);
    let count = |tag: &str| -> u64 {
        let line = chain.lines().find(|l| l.contains(tag)).unwrap_or_default();
        line.split("packets ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    assert!(
        count("\"genuine\"") > 0,
        "control counter saw nothing:\n{chain}"
    );
    assert_eq!(
        count("\"spoofed\""),
        0,
        "spoofed packets got past prerouting:\n{chain}"
    );

    // Internet off, allowOut the host: allowed. Other destinations: denied.
    let allow = EgressPolicy {
        deny_all: true,
        allow: vec![
            "198.51.100.2".parse().unwrap(),
            "198.51.100.0/31".parse().unwrap(), // overlaps: merged
        ],
        deny: vec!["198.51.100.0/24".parse().unwrap()],
        ..Default::default()
    };
    world.net.set_policy(5, &allow).unwrap();
    assert!(
        try_connect(&a.ns, inet_addr).is_ok(),
        "allowOut wins over denyOut"
    );
    assert!(try_connect(&a.ns, v4("198.51.100.9", inet_addr.port())).is_err());

    // A user allowOut cannot open the metadata range or the host.
    let sneaky = EgressPolicy {
        allow: vec!["169.254.0.0/16".parse().unwrap()],
        ..Default::default()
    };
    world.net.set_policy(6, &sneaky).unwrap();
    assert!(try_connect(&b.ns, v4("169.254.169.254", 80)).is_err());

    // Back to default removes the entry.
    world.net.set_policy(5, &EgressPolicy::default()).unwrap();
    assert!(try_connect(&a.ns, inet_addr).is_ok());
    world.net.set_policy(5, &deny).unwrap();

    // A "restart": init again keeps policies. A node owning slots 0..6 leaves slot 6
    // alone (another node's); owning 0..7, it drops slot 6 (unknown).
    let net2 = Network::init(test_config()).unwrap();
    assert!(
        try_connect(&a.ns, inet_addr).is_err(),
        "policy survives re-init"
    );
    net2.reconcile(0..6, &[5]).unwrap();
    let links = sh("ip", &["-o", "link"]);
    assert!(
        links.contains(": cbt5@") && links.contains(": cbt6@"),
        "{links}"
    );
    let policy = sh(
        "nft",
        &["list", "table", "inet", &format!("{TEST_TABLE}_policy")],
    );
    assert!(
        policy.contains(&ia.sandbox_ip.to_string()) && policy.contains(&ib.sandbox_ip.to_string()),
        "another node's slot must stay: {policy}"
    );
    net2.reconcile(0..7, &[5]).unwrap();
    let links = sh("ip", &["-o", "link"]);
    assert!(
        links.contains(": cbt5@") && !links.contains(": cbt6@"),
        "{links}"
    );
    assert_eq!(net2.slots_with_policy(), vec![5]);
    let policy = sh(
        "nft",
        &["list", "table", "inet", &format!("{TEST_TABLE}_policy")],
    );
    assert!(
        policy.contains(&ia.sandbox_ip.to_string()) && !policy.contains(&ib.sandbox_ip.to_string()),
        "{policy}"
    );
    net2.detach(5).unwrap();
    let policy = sh(
        "nft",
        &["list", "table", "inet", &format!("{TEST_TABLE}_policy")],
    );
    assert!(!policy.contains(&ia.sandbox_ip.to_string()), "{policy}");
    assert!(net2.slots_with_policy().is_empty());
    assert_eq!(guard_counters(), 0);
}

/// eth0 comes up without IPv6 both ways: `attach` turns it off itself; `attach_spawned`
/// relies on the namespace's default, which a spawned sandbox's init set (as the test
/// does here), and the veth's end is born with it. `lo`, there before, keeps IPv6.
#[test]
fn eth0_has_no_ipv6_either_way() {
    require_root!();
    if !std::path::Path::new("/proc/sys/net/ipv6").exists() {
        return;
    }
    let _serial = serial();
    let world = World::new();
    let read_inside = |ns: &Netns, dev: &'static str| {
        run_in_netns(ns, move || {
            std::fs::read_to_string(format!("/proc/sys/net/ipv6/conf/{dev}/disable_ipv6"))
        })
        .unwrap()
        .unwrap()
        .trim()
        .to_string()
    };
    let plain = TestNs::new("v6a");
    world.net.attach(&plain.ns, 7).unwrap();
    assert_eq!(read_inside(&plain.ns, "eth0"), "1");
    let spawned = TestNs::new("v6b");
    run_in_netns(&spawned.ns, || {
        std::fs::write("/proc/sys/net/ipv6/conf/default/disable_ipv6", "1")
    })
    .unwrap()
    .unwrap();
    world.net.attach_spawned(&spawned.ns, 8).unwrap();
    assert_eq!(read_inside(&spawned.ns, "eth0"), "1");
    assert_eq!(read_inside(&spawned.ns, "lo"), "0");
    // Without the default, attach_spawned leaves eth0 as the kernel made it: the
    // default is what turned it off above, not anything attach_spawned did.
    let bare = TestNs::new("v6c");
    world.net.attach_spawned(&bare.ns, 9).unwrap();
    assert_eq!(read_inside(&bare.ns, "eth0"), "0");
    for slot in [7, 8, 9] {
        world.net.detach(slot).unwrap();
    }
}

#[test]
fn async_connect_in_netns() {
    require_root!();
    let ns = TestNs::new("async");
    let (addr, _rx) = listen_in(&ns.ns, v4("127.0.0.1", 0));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let got = rt.block_on(async {
        use tokio::io::AsyncReadExt;
        let mut s = connect_in_netns_async(&ns.ns, addr.port()).await.unwrap();
        let mut buf = String::new();
        s.read_to_string(&mut buf).await.unwrap();
        buf
    });
    assert!(got.starts_with("127.0.0.1:"));
    // A closed port is an error, not a hang.
    let err = connect_in_netns(&ns.ns, 1).unwrap_err();
    assert!(err.to_string().contains("refused"), "{err}");
}

/// Veths have one queue each way. Detaches at once, from many threads (a kill storm's
/// teardowns), share group deletes: every slot's veth is gone when its detach returns,
/// and nothing outside the doomed group is touched (a bystander link in another group
/// survives).
#[test]
fn concurrent_detaches_remove_every_veth_and_nothing_else() {
    require_root!();
    let _serial = serial();
    let world = World::new();
    let bystander = format!("{TEST_PREFIX}by{}", std::process::id() % 1000);
    sh(
        "ip",
        &[
            "link", "add", &bystander, "group", "7", "type", "veth", "peer", "name", "cbtbyp",
        ],
    );
    let spaces: Vec<TestNs> = (0..8).map(|i| TestNs::new(&format!("storm{i}"))).collect();
    for (slot, ns) in spaces.iter().enumerate() {
        world.net.attach(&ns.ns, slot as u32).unwrap();
    }
    // One queue each way on both sides (not one per possible CPU).
    let host_if = world.net.slot_info(0).unwrap().host_ifname;
    for shown in [
        sh("ip", &["-d", "link", "show", &host_if]),
        sh("ip", &["-n", &spaces[0].name, "-d", "link", "show", "eth0"]),
    ] {
        assert!(shown.contains("numtxqueues 1 numrxqueues 1"), "{shown}");
    }
    let gone = |slot: u32| {
        let name = world.net.slot_info(slot).unwrap().host_ifname;
        !std::path::Path::new("/sys/class/net").join(name).exists()
    };
    std::thread::scope(|s| {
        for slot in 0..8u32 {
            let (net, gone) = (&world.net, &gone);
            s.spawn(move || {
                net.detach_with(slot, true).unwrap();
                assert!(gone(slot), "slot {slot}'s veth outlived its detach");
            });
        }
    });
    assert!(
        std::path::Path::new("/sys/class/net")
            .join(&bystander)
            .exists()
    );
    let doomed = sh(
        "ip",
        &[
            "-o",
            "link",
            "show",
            "group",
            &super::link_reaper::DOOMED_GROUP.to_string(),
        ],
    );
    assert!(doomed.trim().is_empty(), "doomed links left: {doomed}");
    sh("ip", &["link", "del", &bystander]);
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// `cargo test -p cubicle-runtime --lib network::tests::attach_detach_latency -- --ignored --nocapture`
#[test]
#[ignore = "benchmark: prints attach/detach latency percentiles"]
fn attach_detach_latency() {
    require_root!();
    let _serial = serial();
    let world = World::new();
    let spaces: Vec<TestNs> = (0..10).map(|i| TestNs::new(&format!("bench{i}"))).collect();
    let (mut att, mut det, mut conn) = (Vec::new(), Vec::new(), Vec::new());
    let (addr, _rx) = listen_in(&spaces[0].ns, v4("127.0.0.1", 0));
    for i in 0..200u32 {
        let ns = &spaces[(i % 10) as usize].ns;
        let t = Instant::now();
        world.net.attach(ns, i % 10).unwrap();
        att.push(t.elapsed());
        let t = Instant::now();
        world.net.detach(i % 10).unwrap();
        det.push(t.elapsed());
        let t = Instant::now();
        drop(connect_in_netns(&spaces[0].ns, addr.port()).unwrap());
        conn.push(t.elapsed());
    }
    for (name, v) in [
        ("attach", &mut att),
        ("detach", &mut det),
        ("connect_in_netns", &mut conn),
    ] {
        v.sort();
        println!(
            "{name:>17}: p50 {:>8.1?}  p99 {:>8.1?}  max {:>8.1?}  (n={})",
            percentile(v, 0.5),
            percentile(v, 0.99),
            v[v.len() - 1],
            v.len()
        );
    }
}

/// A policy change cuts the direct TCP connections it refuses on both sides: their
/// conntrack entries go and the sandbox's own sockets are destroyed, so a read waiting
/// for the far end (which would speak next) fails at once instead of hanging; a
/// connection the policy allows stays, and the far end is still heard.
#[test]
fn refused_connections_end_at_once_in_the_sandbox() {
    require_root!();
    let _serial = serial();
    let world = World::new();
    // A second address for the test internet: one destination refused, one allowed.
    sh(
        "ip",
        &[
            "-n",
            &world.internet.name,
            "addr",
            "add",
            "198.51.100.3/24",
            "dev",
            "eth0",
        ],
    );
    let a = TestNs::new("cut");
    let ia = world.net.attach(&a.ns, 7).unwrap();
    let listener = run_in_netns(&world.internet.ns, || TcpListener::bind(v4("0.0.0.0", 0)))
        .unwrap()
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let connect = |to: &str| {
        let to = v4(to, port);
        let s = run_in_netns(&a.ns, move || {
            std::net::TcpStream::connect_timeout(&to, Duration::from_secs(3))
        })
        .unwrap()
        .unwrap();
        // The far end of it (held open, silent until told).
        let (far, _) = listener.accept().unwrap();
        (s, far)
    };
    let (mut kept, mut kept_far) = connect("198.51.100.2");
    let (mut cut, _cut_far) = connect("198.51.100.3");
    assert_eq!(conntrack::count_source(ia.sandbox_ip).unwrap(), 2);

    let policy = EgressPolicy {
        deny: vec!["198.51.100.3/32".parse().unwrap()],
        ..Default::default()
    };
    world.net.set_policy(7, &policy).unwrap();
    assert_eq!(
        world
            .net
            .forget_refused(7, &policy, || a.ns.try_clone().ok())
            .unwrap(),
        1
    );
    cut.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let t = Instant::now();
    let e = cut.read(&mut [0u8; 1]).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::ConnectionAborted, "{e}");
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    // The allowed one: its entry and socket are untouched, the far end is heard.
    assert_eq!(conntrack::count_source(ia.sandbox_ip).unwrap(), 1);
    kept_far.write_all(b"still here").unwrap();
    kept.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut got = [0u8; 10];
    kept.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"still here");
    drop((kept, cut));
    world.net.detach(7).unwrap();
}
