//! What an attack file works with: [`Ctx`] (the node, its state dir), [`Sandbox`] (a
//! fresh `base` sandbox: run bash, python or a C program in it as root or `user`), and
//! [`Out`] (what a program printed, with the `NAME=RET:ERRNO` result lines of the C
//! prelude parsed).
//!
//! C programs get [`C_PRELUDE`] prepended: the usual headers and `TRY(name, call)`, which
//! prints `name=<return value>:<errno>` (errno 0 when the call succeeded). They are
//! compiled once per run with the host's gcc (`-static`, so they run in any template),
//! uploaded through envd's `POST /files` and run from `/opt/escape/`.
#![allow(dead_code)] // the attacks' toolbox: not every attack uses every tool

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use cubicle_node::{CreateRequest, DeathReason, Node, SandboxInfo};

use crate::common;

pub type TestResult = anyhow::Result<()>;
/// What an attack's `run` returns.
pub type AttackFuture = Pin<Box<dyn Future<Output = TestResult>>>;

/// One attack: a name, what it tries and what must stop it, and the code that tries it.
pub struct Attack {
    /// Short name (the test filter matches it), e.g. `btrfs_subvolume`.
    pub name: &'static str,
    /// What the attack does and which defence contains it (printed with a failure).
    pub about: &'static str,
    /// Performs the attack in sandboxes it creates and asserts that it was contained.
    /// The harness then checks that the host is unchanged and that no sandbox is left.
    pub run: fn(Arc<Ctx>) -> AttackFuture,
}

/// The node and its state directory.
pub struct Ctx {
    pub node: Node,
    pub state: PathBuf,
    /// Host directory of compiled attack programs.
    pub bin: PathBuf,
    /// Shells kept by the node (`CUBICLE_ESCAPE_SHELLS`): every attack's sandbox is then
    /// a shell given the `base` root (`docs/node.md`, "Shells").
    pub shells: usize,
}

/// Who runs a program inside the sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum As {
    /// The sandbox's root (uid 0 inside; what every attack assumes a tenant has).
    Root,
    /// The template's default user (uid 1000).
    User,
}

impl As {
    fn name(self) -> &'static str {
        match self {
            As::Root => "root",
            As::User => "user",
        }
    }
}

/// How long one program may run.
pub const RUN_LIMIT: Duration = Duration::from_secs(60);

impl Ctx {
    /// A fresh `base` sandbox (internet off unless `internet`; always on with shells,
    /// which serve only creates with internet, so that the attack runs in a sandbox that
    /// was a shell).
    pub async fn sandbox(self: &Arc<Self>, internet: bool) -> anyhow::Result<Sandbox> {
        self.sandbox_with(CreateRequest {
            internet: internet || self.shells > 0,
            ..common::base()
        })
        .await
    }

    /// A fresh sandbox as `req` says (start from [`common::base`]).
    pub async fn sandbox_with(self: &Arc<Self>, req: CreateRequest) -> anyhow::Result<Sandbox> {
        let info = self.node.create(req).await?;
        Ok(Sandbox {
            ctx: self.clone(),
            info,
        })
    }

    /// The quota filesystem's mount point (`<state>/sandboxes`).
    pub fn sandboxes_dir(&self) -> PathBuf {
        self.state.join("sandboxes")
    }

    /// Compiles `source` (after [`C_PRELUDE`]) statically as `name`, once per run.
    pub fn compile(&self, name: &str, source: &str) -> anyhow::Result<PathBuf> {
        let exe = self.bin.join(name);
        if exe.exists() {
            return Ok(exe);
        }
        std::fs::create_dir_all(&self.bin)?;
        let src = self.bin.join(format!("{name}.c"));
        std::fs::write(&src, format!("{C_PRELUDE}\n#line 1 \"{name}.c\"\n{source}"))?;
        let out = std::process::Command::new("gcc")
            .args(["-static", "-O1", "-Wall", "-o"])
            .arg(&exe)
            .arg(&src)
            .output()
            .map_err(|e| anyhow::anyhow!("running gcc (apt-get install gcc libc6-dev): {e}"))?;
        anyhow::ensure!(
            out.status.success(),
            "gcc {name}.c failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(exe)
    }
}

/// A sandbox an attack runs in. Kill it with [`Sandbox::kill`] (the harness kills what
/// is left, and counts that as a failure).
pub struct Sandbox {
    ctx: Arc<Ctx>,
    pub info: SandboxInfo,
}

impl Sandbox {
    pub fn id(&self) -> &str {
        &self.info.id
    }

    /// The sandbox's directory on the host.
    pub fn dir(&self) -> PathBuf {
        self.ctx.node.sandbox_dir(&self.info.id)
    }

    /// `bash -c script`.
    pub async fn sh(&self, who: As, script: &str) -> anyhow::Result<Out> {
        self.sh_within(who, script, RUN_LIMIT).await
    }

    /// `bash -c script`, allowed to run for `limit`.
    pub async fn sh_within(&self, who: As, script: &str, limit: Duration) -> anyhow::Result<Out> {
        let o = common::bash(
            &self.ctx.node,
            &self.info.id,
            Some(who.name()),
            script,
            limit,
        )
        .await?;
        Ok(Out::from(o))
    }

    /// `python3 -c script args…`.
    pub async fn python(&self, who: As, script: &str, args: &[&str]) -> anyhow::Result<Out> {
        let mut a = vec!["-c", script];
        a.extend_from_slice(args);
        let o = common::run(
            &self.ctx.node,
            &self.info.id,
            Some(who.name()),
            "/usr/bin/python3",
            &a,
            RUN_LIMIT,
        )
        .await?;
        Ok(Out::from(o))
    }

    /// Puts the compiled program `name` at `/opt/escape/<name>` (mode 0755).
    pub async fn install_c(&self, name: &str, source: &str) -> anyhow::Result<String> {
        let exe = self.ctx.compile(name, source)?;
        let data = std::fs::read(&exe)?;
        let path = format!("/opt/escape/{name}");
        let client = self.ctx.node.envd(&self.info.id)?;
        client
            .write_file(&path, Some("root"), bytes::Bytes::from(data))
            .await?;
        let o = self.sh(As::Root, &format!("chmod 0755 {path}")).await?;
        anyhow::ensure!(o.code == 0, "chmod {path}: {}", o.all());
        Ok(path)
    }

    /// Compiles (once), uploads and runs the C program `name` with `args`.
    pub async fn c(&self, who: As, name: &str, source: &str, args: &[&str]) -> anyhow::Result<Out> {
        let path = self.install_c(name, source).await?;
        let o = common::run(
            &self.ctx.node,
            &self.info.id,
            Some(who.name()),
            &path,
            args,
            RUN_LIMIT,
        )
        .await?;
        Ok(Out::from(o))
    }

    /// Kills the sandbox and checks that nothing of it is left on the host.
    pub async fn kill(self) -> TestResult {
        common::kill_and_check(
            &self.ctx.node,
            &self.ctx.state,
            &self.info,
            DeathReason::Killed,
        )
        .await
        .map(drop)
    }
}

/// What a program printed and its exit code.
pub struct Out {
    pub out: String,
    pub err: String,
    pub code: i32,
}

impl From<common::Out> for Out {
    fn from(o: common::Out) -> Self {
        Out {
            out: o.out,
            err: o.err,
            code: o.code,
        }
    }
}

impl Out {
    /// stdout, stderr and exit code, for messages.
    pub fn all(&self) -> String {
        format!(
            "exit {}; stdout:\n{}stderr:\n{}",
            self.code, self.out, self.err
        )
    }

    /// The value of the first `key=value` line.
    pub fn field(&self, key: &str) -> Option<&str> {
        self.out
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
    }

    /// Every `name=RET:ERRNO` line of the C prelude's `TRY`.
    pub fn results(&self) -> HashMap<String, (i64, i32)> {
        self.out
            .lines()
            .filter_map(|l| {
                let (name, v) = l.split_once('=')?;
                let (ret, errno) = v.split_once(':')?;
                Some((name.to_string(), (ret.parse().ok()?, errno.parse().ok()?)))
            })
            .collect()
    }

    /// The `TRY` result `name` failed with one of `errnos`.
    pub fn expect_errno(&self, name: &str, errnos: &[i32]) -> TestResult {
        let r = self.results();
        let (ret, errno) = r
            .get(name)
            .copied()
            .ok_or_else(|| anyhow::anyhow!("no result for {name}: {}", self.all()))?;
        anyhow::ensure!(
            ret == -1 && errnos.contains(&errno),
            "{name} returned {ret} (errno {errno} = {}), want failure with {:?}: {}",
            std::io::Error::from_raw_os_error(errno),
            errnos
                .iter()
                .map(|e| std::io::Error::from_raw_os_error(*e).to_string())
                .collect::<Vec<_>>(),
            self.all()
        );
        Ok(())
    }

    /// The `TRY` result `name` succeeded.
    pub fn expect_ok(&self, name: &str) -> TestResult {
        let r = self.results();
        let (ret, errno) = r
            .get(name)
            .copied()
            .ok_or_else(|| anyhow::anyhow!("no result for {name}: {}", self.all()))?;
        anyhow::ensure!(
            ret >= 0,
            "{name} failed with errno {errno} ({}): {}",
            std::io::Error::from_raw_os_error(errno),
            self.all()
        );
        Ok(())
    }
}

/// Prepended to every C attack program.
pub const C_PRELUDE: &str = r#"
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>

/* One result line: NAME=RET:ERRNO (ERRNO is 0 when the call succeeded). */
static void report(const char *name, long ret, int err) {
    printf("%s=%ld:%d\n", name, ret < 0 ? -1L : ret, ret < 0 ? err : 0);
    fflush(stdout);
}
#define TRY(name, call) do { errno = 0; long r_ = (long)(call); report((name), r_, errno); } while (0)
"#;

/// The C program of a write-attempt attack: `head` (includes, helpers), then a `main`
/// that opens each of `writes` (`(name, path, data)`) for writing and reports the
/// write's result under `name`, then runs `tail` (more C statements).
pub fn write_attempts(head: &str, writes: &[(&str, &str, &str)], tail: &str) -> String {
    let mut src = format!(
        "{head}
static void try_write(const char *name, const char *path, const char *data) {{
    int fd = open(path, O_WRONLY);
    if (fd < 0) {{ report(name, -1, errno); return; }}
    long n = write(fd, data, strlen(data));
    report(name, n, errno);
}}
int main(void) {{
"
    );
    for (name, path, data) in writes {
        let data = data.replace('\n', "\\n");
        src.push_str(&format!(
            "    try_write(\"{name}\", \"{path}\", \"{data}\");\n"
        ));
    }
    src.push_str(tail);
    src.push_str("    return 0;\n}\n");
    src
}

/// Runs the program of [`write_attempts`] as root in `sb` (under the attack's `name`)
/// and expects every write to fail with one of `errnos`.
pub async fn expect_writes_refused(
    sb: &Sandbox,
    name: &str,
    program: &str,
    writes: &[(&str, &str, &str)],
    errnos: &[i32],
) -> anyhow::Result<Out> {
    let out = sb.c(As::Root, name, program, &[]).await?;
    for (w, _, _) in writes {
        out.expect_errno(w, errnos)?;
    }
    Ok(out)
}

/// Reads a whole host file, empty when missing (for before/after comparisons).
pub fn read_or_empty(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_default()
}

/// errno values attacks expect.
pub const EPERM: i32 = libc::EPERM;
pub const EACCES: i32 = libc::EACCES;
pub const ENOSYS: i32 = libc::ENOSYS;
pub const EROFS: i32 = libc::EROFS;
pub const EINVAL: i32 = libc::EINVAL;
pub const ENOENT: i32 = libc::ENOENT;
