//! Attacks on sandboxes from the host's side (issue 10, items 3 and 4), with the `tiny`
//! template and the real `cubicle-envd` as PID 1. The attacker is an unprivileged local
//! user of the host (`setpriv --reuid nobody`), or anyone — even root — who reaches a
//! pooled sandbox before a claim hands it to its user. Each test performs the attack,
//! requires it to fail, and shows by a control that what it aimed at was really there.
//!
//! - `host_cannot_reach_envd_or_user_ports`: `curl http://<sandbox ip>:49983/health` and
//!   `:8000` (a server the tenant started) fail from the host, as `nobody` and as root;
//!   inside the sandbox envd answers on 127.0.0.1 only; the router's way in (a socket
//!   made in the sandbox's network namespace, entered through the init's pidfd) works.
//! - `local_user_reads_nothing`: the state directory, records, logs, lock and envd's
//!   socket are out of `nobody`'s reach; the modes are 0700/0600.
//! - `pooled_sandbox_needs_its_token`: a pooled (unclaimed) sandbox's envd refuses
//!   `/init` and process starts without the token it was born with; the claim hands that
//!   token (no answer showed it before) to the user, and afterwards no other works.
//!
//! Needs root, busybox-static, curl and setpriv. Run: `cargo test -p cubicle-node --test
//! host_attacks [-- FILTER]` (inside `unshare --net` on a shared machine). `harness =
//! false`: main() first hands over to the runtime's sandbox helper.

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt;
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use cubicle_node::{CreateRequest, EnvdClient, Node, NodeConfig, ProcessEvent, ProcessSpec};

type TestResult = anyhow::Result<()>;
type TestFn = common::TestFn<PathBuf>;

fn main() {
    let Some(h) = common::Harness::start(
        "host_attacks",
        "namespaces, cgroups, setpriv",
        &["/bin/busybox", "/usr/bin/curl", "/usr/bin/setpriv"],
    ) else {
        return;
    };
    let tests: Vec<(&str, TestFn)> = vec![
        ("host_cannot_reach_envd_or_user_ports", |e| {
            Box::pin(host_cannot_reach_envd_or_user_ports(e))
        }),
        ("local_user_reads_nothing", |e| {
            Box::pin(local_user_reads_nothing(e))
        }),
        ("pooled_sandbox_needs_its_token", |e| {
            Box::pin(pooled_sandbox_needs_its_token(e))
        }),
    ];
    h.run(h.envd.clone(), tests, |_| Ok(())).finish();
}

/// A node on a fresh state dir with a free slot range of its own.
async fn node(envd: &Path, name: &str, pool: usize) -> anyhow::Result<(Node, PathBuf)> {
    let state = PathBuf::from(format!("/tmp/cbha-{}-{name}", std::process::id()));
    let mut cfg = NodeConfig::new(&state, envd);
    cfg.first_slot = 4800;
    cfg.max_sandboxes = 16;
    cfg.any_free_slots = true;
    if pool > 0 {
        cfg.pool.insert("tiny".into(), pool);
    }
    let node = Node::open(cfg).await?;
    node.templates().ensure("tiny", false)?;
    Ok((node, state))
}

/// A `tiny` sandbox with internet (a veth and an address the host can route to; pools
/// are made with internet on too).
fn tiny() -> CreateRequest {
    CreateRequest {
        template: "tiny".into(),
        internet: true,
        ..Default::default()
    }
}

/// Runs a shell command in the sandbox as root; (stdout + stderr, exit code).
async fn sh(client: &EnvdClient, script: &str) -> anyhow::Result<(String, i32)> {
    let spec = ProcessSpec {
        cmd: "/bin/sh".into(),
        args: vec!["-c".into(), script.into()],
        user: Some("root".into()),
        ..Default::default()
    };
    let mut out = Vec::new();
    let end = client
        .run(&spec, |ev| match ev {
            ProcessEvent::Stdout(b) | ProcessEvent::Stderr(b) => out.extend(b),
            ProcessEvent::Start(_) => {}
        })
        .await?;
    Ok((String::from_utf8_lossy(&out).into_owned(), end.exit_code))
}

/// `setpriv` to the unprivileged `nobody`, then `args`: (success, stdout + stderr).
fn as_nobody(args: &[&str]) -> (bool, String) {
    let out = Command::new("setpriv")
        .args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"])
        .args(args)
        .output()
        .expect("running setpriv");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `curl` of `url` (3 s at most) as root: (success, output).
fn as_root_curl(url: &str) -> (bool, String) {
    let out = Command::new("curl")
        .args(["-sS", "-m", "3", url])
        .output()
        .expect("running curl");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The sandbox's address on its veth, from its record.
fn sandbox_ip(state: &Path, id: &str) -> anyhow::Result<String> {
    let rec: serde_json::Value = serde_json::from_slice(&std::fs::read(
        state.join("sandboxes").join(id).join("sandbox.json"),
    )?)?;
    rec["runtime"]["sandboxIp"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| anyhow::anyhow!("no sandboxIp in the record: {rec}"))
}

async fn host_cannot_reach_envd_or_user_ports(envd: PathBuf) -> TestResult {
    let (node, state) = node(&envd, "reach", 0).await?;
    let r = async {
        let sb = node.create(tiny()).await?;
        let client = node.envd(&sb.id)?;
        // The tenant serves something on port 8000.
        let (out, code) = sh(
            &client,
            "mkdir -p /tmp/www && echo from-the-sandbox > /tmp/www/index.html && httpd -p 8000 -h /tmp/www && sleep 0.2 && wget -q -O- http://127.0.0.1:8000/",
        )
        .await?;
        anyhow::ensure!(code == 0 && out.contains("from-the-sandbox"), "httpd: {code} {out}");
        let ip = sandbox_ip(&state, &sb.id)?;

        // The attack: a local user (and the host itself) at the sandbox's address.
        for port in [49983, 8000] {
            let url = format!("http://{ip}:{port}/health");
            let t = Instant::now();
            let (ok, out) = as_nobody(&["curl", "-sS", "-m", "3", &url]);
            anyhow::ensure!(!ok, "nobody reached {url}: {out}");
            anyhow::ensure!(
                t.elapsed() < Duration::from_secs(2),
                "refusal should be immediate (a rule answered), took {:?}: {out}",
                t.elapsed()
            );
            let (ok, out) = as_root_curl(&url);
            anyhow::ensure!(!ok, "the host reached {url}: {out}");
        }

        // Inside, envd answers on loopback only, not on the sandbox's own address.
        let (out, code) = sh(
            &client,
            &format!("wget -q -S -O- http://127.0.0.1:49983/health 2>&1; echo rc=$?; wget -q -O- http://{ip}:49983/health 2>&1; echo rc=$?"),
        )
        .await?;
        anyhow::ensure!(code == 0, "{out}");
        let rcs: Vec<&str> = out.lines().filter(|l| l.starts_with("rc=")).collect();
        anyhow::ensure!(
            rcs == ["rc=0", "rc=1"],
            "envd on 127.0.0.1 (must answer) and on {ip} (must not): {out}"
        );

        // The router's way in still works: a socket made inside the namespace, entered
        // through the init's pidfd.
        let pidfd = node
            .get(&sb.id)?
            .init_pidfd
            .ok_or_else(|| anyhow::anyhow!("no init pidfd"))?;
        let netns = cubicle_runtime::network::Netns::from_fd(pidfd.fd().try_clone()?);
        let mut s = cubicle_runtime::network::connect_in_netns(&netns, 8000)?;
        use std::io::{Read, Write};
        s.write_all(b"GET / HTTP/1.0\r\n\r\n")?;
        let mut got = String::new();
        s.read_to_string(&mut got)?;
        anyhow::ensure!(got.contains("from-the-sandbox"), "{got}");
        node.kill(&sb.id).await?;
        Ok(())
    }
    .await;
    node.kill_all().await;
    node.close();
    let _ = cubicle_node::fsutil::remove_tree(&state);
    r
}

async fn local_user_reads_nothing(envd: PathBuf) -> TestResult {
    let (node, state) = node(&envd, "read", 0).await?;
    let r = async {
        let sb = node.create(tiny()).await?;
        // Something secret-looking in the sandbox's log, and the token in its record.
        let client = node.envd(&sb.id)?;
        sh(&client, "echo hello").await?;
        let dir = state.join("sandboxes").join(&sb.id);
        let record = dir.join("sandbox.json");
        let text = std::fs::read_to_string(&record)?;
        anyhow::ensure!(
            text.contains(&sb.access_token),
            "the record holds the token"
        );

        // Modes: root's alone.
        let mode = |p: &Path| -> anyhow::Result<u32> {
            Ok(std::fs::metadata(p)?.permissions().mode() & 0o777)
        };
        for (p, want) in [
            (state.clone(), 0o700),
            (state.join("sandboxes"), 0o700),
            (record.clone(), 0o600),
            (dir.join("init.log"), 0o600),
            (dir.join("init.pipe"), 0o600),
            (state.join("node.lock"), 0o600),
        ] {
            let got = mode(&p)?;
            anyhow::ensure!(got == want, "{}: mode {got:o}, want {want:o}", p.display());
        }

        // The attack: a local user reads records and logs, lists sandboxes, talks to envd.
        let targets = [
            record.display().to_string(),
            dir.join("init.log").display().to_string(),
            state.join("node.lock").display().to_string(),
        ];
        for t in &targets {
            let (ok, out) = as_nobody(&["cat", t]);
            anyhow::ensure!(
                !ok && !out.contains(&sb.access_token),
                "nobody read {t}: {out}"
            );
        }
        let (ok, out) = as_nobody(&["ls", &state.join("sandboxes").display().to_string()]);
        anyhow::ensure!(
            !ok && !out.contains(sb.id.as_str()),
            "nobody listed the sandboxes: {out}"
        );
        let socket = dir.join("ctl/envd.sock");
        anyhow::ensure!(socket.exists(), "envd's socket is there");
        let (ok, out) = as_nobody(&[
            "curl",
            "-sS",
            "-m",
            "3",
            "--unix-socket",
            &socket.display().to_string(),
            "http://envd/health",
        ]);
        anyhow::ensure!(!ok, "nobody reached envd's socket: {out}");
        // Control: root (the node) can.
        anyhow::ensure!(EnvdClient::new(&socket, None).health().await?);
        node.kill(&sb.id).await?;
        Ok(())
    }
    .await;
    node.kill_all().await;
    node.close();
    let _ = cubicle_node::fsutil::remove_tree(&state);
    r
}

async fn pooled_sandbox_needs_its_token(envd: PathBuf) -> TestResult {
    let (node, state) = node(&envd, "pool", 1).await?;
    let r = async {
        // Wait for the pooled sandbox: a directory nobody has claimed.
        let t = Instant::now();
        let pooled = loop {
            let listed: Vec<String> = node.list().into_iter().map(|i| i.id.to_string()).collect();
            let found = cubicle_node::records_on_disk(&state)
                .into_iter()
                .find(|r| !listed.contains(&r.id.to_string()) && r.pid.is_some());
            if let Some(r) = found
                && node.pool_stats().ready.get("tiny") == Some(&1)
            {
                break r;
            }
            anyhow::ensure!(
                t.elapsed() < Duration::from_secs(30),
                "the pool never filled"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let socket = state
            .join("sandboxes")
            .join(&pooled.id)
            .join("ctl/envd.sock");
        // The attack, as root with the socket in hand: plant a process, or take the
        // sandbox over by setting a token of one's own.
        let intruder = EnvdClient::new(&socket, None);
        anyhow::ensure!(
            intruder.health().await?,
            "envd is up (health needs no token)"
        );
        let planted = intruder
            .run(
                &ProcessSpec {
                    cmd: "/bin/sh".into(),
                    args: vec!["-c".into(), "echo planted > /tmp/backdoor".into()],
                    user: Some("root".into()),
                    ..Default::default()
                },
                |_| {},
            )
            .await;
        anyhow::ensure!(
            planted
                .as_ref()
                .is_err_and(|e| e.to_string().contains("401")),
            "a pooled sandbox ran an unauthenticated command: {planted:?}"
        );
        let taken = intruder
            .init(&cubicle_node::envd_client::InitRequest {
                env_vars: Default::default(),
                access_token: "the-intruders-token".into(),
                default_user: "root".into(),
                default_workdir: Some("/".into()),
            })
            .await;
        anyhow::ensure!(
            taken.as_ref().is_err_and(|e| e.to_string().contains("401")),
            "a pooled sandbox accepted /init without its token: {taken:?}"
        );

        // The claim works. The token it hands out is the one envd was born with (no
        // `/init` then: docs/node.md): the node held it alone until now, as it holds the
        // user's token of any sandbox. Any other token is refused.
        let sb = node.create(tiny()).await?;
        anyhow::ensure!(sb.id == pooled.id, "the create claimed the pooled sandbox");
        let (out, code) = sh(&node.envd(&sb.id)?, "cat /tmp/backdoor 2>&1; true").await?;
        anyhow::ensure!(code == 0 && !out.contains("planted"), "{out}");
        anyhow::ensure!(
            sb.access_token == pooled.access_token,
            "the claim handed out another token than envd's"
        );
        for wrong in ["the-intruders-token", ""] {
            let other = EnvdClient::new(&socket, Some(wrong.into()));
            anyhow::ensure!(
                sh(&other, "true").await.is_err(),
                "token {wrong:?} works after the claim"
            );
        }
        node.kill(&sb.id).await?;
        Ok(())
    }
    .await;
    node.kill_all().await;
    node.close();
    // A refill under way when the node closed removes its sandbox itself: wait for it,
    // or the test process ends with that sandbox half made (its cgroup left behind).
    node.wait_refills(std::time::Duration::from_secs(60)).await;
    let _ = cubicle_node::fsutil::remove_tree(&state);
    r
}
