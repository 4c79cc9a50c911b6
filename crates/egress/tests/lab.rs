//! The egress layer end to end in a private lab (three fresh network namespaces, the
//! real rules file, the real resolver and proxy): what a sandbox's DNS questions and
//! connections meet, including the bypass attempts. Needs root; says so and passes
//! otherwise (CI runs as root).

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use cubicle_egress::lab::{EVIL_HOST, Lab, OK_HOST, http_get, keep_alive, query_a, tls_stream};
use cubicle_egress::{EventKind, NetworkPolicy, Verdict};

fn is_root() -> bool {
    cubicle_syscalls::is_root()
}

fn policy(allow: &[&str], deny: &[&str]) -> NetworkPolicy {
    NetworkPolicy {
        allow_out: allow.iter().map(|s| s.parse().unwrap()).collect(),
        deny_out: deny.iter().map(|s| s.parse().unwrap()).collect(),
        ..Default::default()
    }
}

/// A refusal by the rules: an error that arrives at once (not a timeout).
fn assert_refused<T: std::fmt::Debug>(
    what: &str,
    t: Instant,
    r: Result<T, impl std::fmt::Display>,
) {
    match r {
        Ok(v) => panic!("{what}: expected a refusal, got {v:?}"),
        Err(e) => assert!(
            t.elapsed() < Duration::from_millis(1500),
            "{what}: refused only after {:?} ({e}): a timeout is not the rule answering",
            t.elapsed()
        ),
    }
}

#[test]
fn domains_dns_and_bypasses() {
    if !is_root() {
        eprintln!("SKIPPED: needs root (creates network namespaces and nftables tables)");
        return;
    }
    Lab::run(|lab| {
        let p = policy(&["ok.test", "*.ok.test"], &["0.0.0.0/0"]);
        lab.add_sandbox(1, &p).unwrap();
        let open = lab.add_sandbox(2, &NetworkPolicy::default()).unwrap();
        let _ = open;
        let web = |ip| SocketAddr::from((ip, 80));

        // DNS: allowed names resolve through the sandbox's upstream, whatever server it asks.
        let r = lab
            .in_sandbox(1, || query_a("9.9.9.9".parse().unwrap(), "ok.test"))
            .unwrap();
        assert_eq!(r, Ok(vec![OK_HOST]));
        // A name outside the policy is refused without being forwarded (no DNS tunnel).
        let r = lab
            .in_sandbox(1, || query_a(OK_HOST, "c2VjcmV0.evil.test"))
            .unwrap();
        assert_eq!(r, Err("REFUSED".to_string()));
        let asked = lab.upstream_questions.lock().unwrap().clone();
        assert!(asked.iter().any(|q| q == "ok.test"), "{asked:?}");
        assert!(
            !asked.iter().any(|q| q.contains("c2vjcmv0")),
            "the refused question reached the upstream server: {asked:?}"
        );

        // HTTP to an allowed name at its address: through.
        let body = lab
            .in_sandbox(1, || http_get(web(OK_HOST), "ok.test"))
            .unwrap();
        assert_eq!(body.unwrap(), OK_HOST.to_string());
        // An allowed name at another address (hard-coded IP, mismatched Host): reset.
        let t = Instant::now();
        let r = lab
            .in_sandbox(1, || http_get(web(EVIL_HOST), "ok.test"))
            .unwrap();
        assert_refused("Host ok.test at evil's address", t, r);
        // A denied name at the allowed address (domain fronting by Host): reset.
        let t = Instant::now();
        let r = lab
            .in_sandbox(1, || http_get(web(OK_HOST), "evil.test"))
            .unwrap();
        assert_refused("Host evil.test at ok's address", t, r);
        // Every request of a kept-alive plain-HTTP connection is checked: a second
        // request for another name on the allowed address cuts the connection.
        let bodies = lab
            .in_sandbox(1, || keep_alive(web(OK_HOST), &["ok.test", "www.ok.test", "evil.test", "ok.test"]))
            .unwrap()
            .unwrap();
        assert_eq!(bodies, vec![OK_HOST.to_string(), OK_HOST.to_string()]);
        // TLS: SNI checked the same way.
        let n = lab
            .in_sandbox(1, || tls_stream(OK_HOST, "www.ok.test", 1000))
            .unwrap();
        assert!(n.unwrap() >= 1000);
        let t = Instant::now();
        let r = lab
            .in_sandbox(1, || tls_stream(EVIL_HOST, "www.ok.test", 10))
            .unwrap();
        assert_refused("SNI www.ok.test at evil's address", t, r);
        // Another port, no name at all, to a hard-coded address: denied by the kernel
        // (UDP) or reset by the proxy (TCP).
        let t = Instant::now();
        let r = lab
            .in_sandbox(1, || {
                std::net::TcpStream::connect_timeout(
                    &SocketAddr::from((EVIL_HOST, 22)),
                    Duration::from_secs(3),
                )
                .and_then(|mut s| {
                    use std::io::Read;
                    let mut b = [0u8; 1];
                    s.set_read_timeout(Some(Duration::from_secs(3)))?;
                    s.read(&mut b).map(|n| n as u64)
                })
            })
            .unwrap();
        match r {
            Ok(0) | Err(_) => assert!(
                t.elapsed() < Duration::from_millis(1500),
                "took {:?}",
                t.elapsed()
            ),
            Ok(n) => panic!("read {n} bytes from a denied destination"),
        }

        // The sandbox without a policy reaches everything public.
        let body = lab
            .in_sandbox(2, || http_get(web(EVIL_HOST), "evil.test"))
            .unwrap();
        assert_eq!(body.unwrap(), EVIL_HOST.to_string());
        // ...but not a private range (refused by the kernel's node rules).
        let t = Instant::now();
        let r = lab
            .in_sandbox(2, || {
                std::net::TcpStream::connect_timeout(
                    &SocketAddr::from(([10, 1, 2, 3], 80)),
                    Duration::from_secs(3),
                )
            })
            .unwrap();
        assert_refused("a private address", t, r);
        // UDP from the domain-policy sandbox to a hard-coded address: the kernel refuses.
        let _ = lab.in_sandbox(1, || {
            let s = std::net::UdpSocket::bind("0.0.0.0:0")?;
            s.send_to(b"x", (EVIL_HOST, 443))
        });
        // Connections the kernel let through or refused are in the trail too.
        let wait_for = |slot: u32, want: &dyn Fn(&cubicle_egress::NetEvent) -> bool| {
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let events = lab.egress.audit().read(&Lab::id(slot), 0, 10_000);
                if events.iter().any(want) || Instant::now() > deadline {
                    return events.iter().map(|e| e.summary()).collect::<Vec<_>>();
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        };
        let s = wait_for(2, &|e| {
            matches!(&e.what, EventKind::Close { dst, bytes_in, .. } if *dst == EVIL_HOST && *bytes_in > 0)
        });
        assert!(
            s.iter()
                .any(|l| l.contains("tcp 198.51.100.3:80 allowed via direct")),
            "{s:#?}"
        );
        assert!(s.iter().any(|l| l.contains("198.51.100.3:80 closed")), "{s:#?}");
        let s = wait_for(2, &|e| e.summary().contains("10.1.2.3:80"));
        assert!(
            s.iter()
                .any(|l| l.contains("10.1.2.3:80 denied") && l.contains("private range")),
            "{s:#?}"
        );
        let s = wait_for(1, &|e| e.summary().contains("udp 198.51.100.3:443"));
        assert!(
            s.iter().any(|l| l.contains("udp 198.51.100.3:443 denied")
                && l.contains("denyOut 0.0.0.0/0")),
            "{s:#?}"
        );

        // The audit trail saw it all.
        let events = lab.egress.audit().read(&Lab::id(1), 0, 1000);
        let denied: Vec<String> = events
            .iter()
            .filter(|e| {
                matches!(
                    e.what,
                    EventKind::Connect {
                        verdict: Verdict::Denied,
                        ..
                    } | EventKind::Dns {
                        verdict: Verdict::Denied,
                        ..
                    }
                )
            })
            .map(|e| e.summary())
            .collect();
        assert!(
            denied.iter().any(|s| s.contains("c2vjcmv0.evil.test")),
            "{denied:#?}"
        );
        assert!(
            denied
                .iter()
                .any(|s| s.contains("198.51.100.3:80 (ok.test)")),
            "{denied:#?}"
        );
        assert!(
            events.iter().any(
                |e| matches!(&e.what, EventKind::Close { bytes_out, .. } if *bytes_out >= 1000)
            ),
            "no close event with bytes"
        );

        // A live update: now evil.test too, without touching the first connection.
        lab.set_policy(1, &policy(&["ok.test", "evil.test"], &["0.0.0.0/0"]))
            .unwrap();
        let body = lab
            .in_sandbox(1, || http_get(web(EVIL_HOST), "evil.test"))
            .unwrap();
        assert_eq!(body.unwrap(), EVIL_HOST.to_string());
        lab.remove_sandbox(1).unwrap();
        lab.remove_sandbox(2).unwrap();
    })
    .unwrap();
}

/// The bench runs (small sizes; `cubicle bench egress` prints the real figures).
#[test]
fn bench_runs() {
    if !is_root() {
        eprintln!("SKIPPED: needs root");
        return;
    }
    let r = cubicle_egress::lab::bench(8 << 20, 20).unwrap();
    assert!(r.proxied_gbit_s > 0.0 && r.direct_gbit_s > 0.0, "{r:?}");
    assert!(
        r.proxied_request_us.0 > 0 && r.apply_policy_us.0 > 0,
        "{r:?}"
    );
    eprintln!("{r:?}");
}

/// The per-sandbox bandwidth limit holds (direct and proxied traffic).
#[test]
fn bandwidth_limit_holds() {
    if !is_root() {
        eprintln!("SKIPPED: needs root");
        return;
    }
    let rate = 12_500_000u64; // 100 Mbit/s
    Lab::run_with(
        |c| {
            c.limits.bytes_per_sec = rate;
            c.limits.bytes_burst = 1 << 20;
        },
        |lab| {
            lab.add_sandbox(1, &NetworkPolicy::default()).unwrap();
            let bytes = 3 * rate;
            let (n, took) = lab
                .in_sandbox(1, || {
                    let t = Instant::now();
                    tls_stream(OK_HOST, "ok.test", bytes).map(|n| (n, t.elapsed()))
                })
                .unwrap()
                .unwrap();
            let got = n as f64 / took.as_secs_f64();
            eprintln!(
                "{:.1} MB/s with a limit of {:.1} MB/s",
                got / 1e6,
                rate as f64 / 1e6
            );
            // The kernel's bucket holds one second at the rate plus the burst.
            let most = rate as f64 * (took.as_secs_f64() + 1.0) + (1 << 20) as f64;
            assert!(
                (n as f64) < most * 1.05,
                "{n} bytes in {took:?} over a limit of {rate} B/s"
            );
            assert!(got > rate as f64 * 0.5, "{got} B/s: far below the limit");
        },
    )
    .unwrap();
}
