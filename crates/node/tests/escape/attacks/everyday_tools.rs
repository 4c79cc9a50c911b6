//! The control of the suite: a policy that breaks everything contains everything, so
//! the tools a sandbox is for must keep working under the same policy — as `user`:
//! `sudo`, `ping`, a Python venv and a `pip install` into it (offline, from the wheels
//! Debian ships), Node and an `npm install` of a packed local package (offline), `git`, `curl`,
//! `tar`/`gzip`, `ps`; a debugger's calls are in `seccomp_default_deny`.
//!
//! Guards against: a seccomp allowlist, a capability or a mount flag that is too strict
//! (e.g. `ping` failed with EPERM once NET_RAW was dropped, until templates lost the
//! file capability).

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "everyday_tools",
    about: "control: sudo, ping, pip/npm installs, git, curl must still work under the policy",
    run: |c| Box::pin(run(c)),
};

/// (name, command) run in order as `user` in `/tmp`.
const CHECKS: &[(&str, &str)] = &[
    ("sudo", "sudo -n true"),
    ("sudo_root_only_dir", "sudo -n ls /root"),
    ("ping", "ping -c 1 -W 2 127.0.0.1"),
    ("venv", "python3 -m venv --without-pip /tmp/venv"),
    (
        "pip_install",
        "pip3 --python /tmp/venv/bin/python install --no-index --find-links /usr/share/python-wheels setuptools",
    ),
    (
        "python_modules",
        "/tmp/venv/bin/python -c 'import setuptools, ssl, sqlite3, multiprocessing, ctypes'",
    ),
    (
        "npm_pack",
        "mkdir -p /tmp/pkg && cd /tmp/pkg && printf '{\"name\":\"escape-probe\",\"version\":\"1.0.0\",\"main\":\"index.js\"}' > package.json && echo 'module.exports = () => 42;' > index.js && npm pack --silent",
    ),
    (
        "npm_install",
        "mkdir -p /tmp/app && cd /tmp/app && printf '{\"name\":\"app\",\"version\":\"1.0.0\"}' > package.json && npm install --offline --no-audit --no-fund /tmp/pkg/escape-probe-1.0.0.tgz",
    ),
    (
        "node_require",
        "node -e 'process.exit(require(\"/tmp/app/node_modules/escape-probe\")() === 42 ? 0 : 1)'",
    ),
    (
        "git",
        "git init -q /tmp/repo && cd /tmp/repo && echo x > f && git add f && git -c user.email=a@b -c user.name=n commit -qm m",
    ),
    ("curl", "curl -fsS file:///etc/hostname"),
    (
        "tar",
        "tar czf /tmp/a.tgz -C /tmp repo && tar tzf /tmp/a.tgz",
    ),
    ("ps", "ps -e"),
];

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let mut failed = Vec::new();
    for (name, cmd) in CHECKS {
        let t = std::time::Instant::now();
        let o = sb
            .sh_within(
                As::User,
                &format!("cd /tmp && {cmd} </dev/null"),
                std::time::Duration::from_secs(180),
            )
            .await?;
        if o.code != 0 {
            failed.push(format!("{name}: {}", o.all()));
        } else {
            println!("  {name} ok ({:.1}s)", t.elapsed().as_secs_f64());
        }
    }
    anyhow::ensure!(
        failed.is_empty(),
        "tools broken under the policy:\n{}",
        failed.join("\n")
    );
    sb.kill().await
}
