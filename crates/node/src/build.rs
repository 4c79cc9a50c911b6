//! The node as a template builder's host ([`cubicle_template::build::BuildHost`]): build
//! steps run in ordinary sandboxes of this node (same isolation, limits, egress rules and
//! slots as any other, created cold, never from a pool), and a finished step's sandbox is
//! stopped and its writable layer committed as a layer before it is removed.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use cubicle_template::build::{BuildHost, BuildSandbox, Exec, ExecEnd};
use cubicle_template::{Template, TemplateConfig};

use crate::envd_client::{ProcessEvent, ProcessSpec};
use crate::error::{Error, Result};
use crate::node::Node;
use crate::node::inner::blocking;
use crate::procfs;
use crate::sandbox::{CreateRequest, DeathReason};

/// How long a build sandbox may live (a step that runs longer is killed).
const BUILD_SANDBOX_TIMEOUT: Duration = Duration::from_secs(3600);
/// Metadata key marking build sandboxes (`cubicle sandbox list` shows them as such).
pub const BUILD_METADATA_KEY: &str = "cubicle.build";

/// [`Node`] as a [`BuildHost`].
#[derive(Clone)]
pub struct NodeBuildHost {
    node: Node,
}

impl NodeBuildHost {
    /// Builds on `node`.
    pub fn new(node: Node) -> Self {
        NodeBuildHost { node }
    }
}

fn tpl_err(e: Error) -> cubicle_template::Error {
    cubicle_template::Error::TemplateBuild {
        name: "build".into(),
        message: e.to_string(),
    }
}

/// Split output into lines, keeping a partial last line for the next chunk.
struct Lines {
    buf: Vec<u8>,
}

impl Lines {
    fn feed(&mut self, data: &[u8], mut emit: impl FnMut(&str)) {
        self.buf.extend_from_slice(data);
        while let Some(i) = self.buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=i).collect();
            emit(String::from_utf8_lossy(&line[..line.len() - 1]).trim_end_matches('\r'));
        }
    }

    fn flush(&mut self, mut emit: impl FnMut(&str)) {
        if !self.buf.is_empty() {
            emit(&String::from_utf8_lossy(&self.buf));
            self.buf.clear();
        }
    }
}

impl BuildHost for NodeBuildHost {
    async fn start(&self, sb: BuildSandbox) -> cubicle_template::Result<String> {
        let mut config = TemplateConfig::with_defaults("build", cubicle_template::build::BUILDER);
        config.env = sb.env;
        config.default_user = "root".into();
        config.default_workdir = Some("/".into());
        let mut lowers = sb.lowers.into_iter();
        let rootfs = lowers.next().ok_or_else(|| {
            cubicle_template::Error::InvalidRequest(
                "a build sandbox needs at least one layer".into(),
            )
        })?;
        let template = Template {
            dir: PathBuf::new(),
            rootfs,
            layers: lowers.collect(),
            config,
            binds: sb.binds,
        };
        let mut metadata = BTreeMap::new();
        metadata.insert(BUILD_METADATA_KEY.to_string(), "1".to_string());
        let req = CreateRequest {
            template: "build".into(),
            memory_mb: Some(sb.memory_mb),
            cpus: Some(sb.cpus),
            disk_mb: Some(sb.disk_mb),
            internet: true,
            timeout: Some(BUILD_SANDBOX_TIMEOUT),
            metadata,
            ..Default::default()
        };
        let info = self
            .node
            .create_from(template, req)
            .await
            .map_err(tpl_err)?;
        Ok(info.id.to_string())
    }

    async fn exec(
        &self,
        id: &str,
        exec: Exec,
        line: &(dyn Fn(bool, &str) + Send + Sync),
    ) -> cubicle_template::Result<ExecEnd> {
        let client = self.node.envd(id).map_err(tpl_err)?;
        let spec = ProcessSpec {
            cmd: exec.cmd,
            args: exec.args,
            envs: exec.env,
            cwd: exec.cwd,
            user: Some(exec.user),
        };
        let (mut out, mut err) = (Lines { buf: Vec::new() }, Lines { buf: Vec::new() });
        let end = client
            .run(&spec, |ev| match ev {
                ProcessEvent::Stdout(d) => out.feed(&d, |l| line(false, l)),
                ProcessEvent::Stderr(d) => err.feed(&d, |l| line(true, l)),
                _ => {}
            })
            .await
            .map_err(tpl_err)?;
        out.flush(|l| line(false, l));
        err.flush(|l| line(true, l));
        Ok(ExecEnd {
            exit_code: if end.exited { end.exit_code } else { -1 },
            status: end.status,
        })
    }

    async fn spawn(&self, id: &str, exec: Exec) -> cubicle_template::Result<()> {
        let client = self.node.envd(id).map_err(tpl_err)?;
        let spec = ProcessSpec {
            cmd: exec.cmd,
            args: exec.args,
            envs: exec.env,
            cwd: exec.cwd,
            user: Some(exec.user),
        };
        client.start_detached(&spec).await.map_err(tpl_err)?;
        Ok(())
    }

    async fn commit(&self, id: &str, dest: PathBuf) -> cubicle_template::Result<()> {
        self.node.stop_and_commit(id, dest).await.map_err(tpl_err)
    }

    async fn discard(&self, id: &str) {
        if let Err(e) = self.node.kill(id).await {
            tracing::warn!(sandbox = %id, "removing a build sandbox: {e}");
        }
    }
}

/// SIGKILL the process behind `pidfd` and wait (up to `limit`) until it has exited.
fn kill_and_wait(pidfd: &std::os::fd::OwnedFd, limit: Duration) -> Result<()> {
    use cubicle_syscalls::pidfd;
    // An error means it is already gone (the wait below sees that).
    let _ = pidfd::pidfd_kill(pidfd);
    let deadline = Instant::now() + limit;
    while !pidfd::exited(pidfd) {
        if Instant::now() >= deadline {
            return Err(Error::Runtime(format!(
                "the build sandbox did not stop within {}s",
                limit.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

impl Node {
    /// Stop sandbox `id`, copy its writable layer into the empty directory `dest` as a
    /// layer (owners shifted back from the sandbox's uid range), then remove it.
    pub async fn stop_and_commit(&self, id: &str, dest: PathBuf) -> Result<()> {
        let inner = self.inner.clone();
        let record = inner
            .mark_dying(id, DeathReason::Killed, false)
            .ok_or_else(|| Error::SandboxNotFound(id.into()))?;
        let dir = inner.sandbox_dir(id);
        let (pid, start) = (record.pid, record.pid_start_time);
        let base = record.uid_base;
        // Kill its init and wait until it is gone (with it the sandbox's mount namespace
        // and overlay), keeping the directory; the teardown below removes the rest.
        let copied = blocking(move || {
            if let Some(pid) = pid.filter(|p| *p > 1)
                && let Ok(fd) = cubicle_syscalls::pidfd::pidfd_open(pid)
                && procfs::is_alive(pid, start)
            {
                kill_and_wait(&fd, Duration::from_secs(30))?;
            }
            let upper = dir.join("upper");
            if !upper.is_dir() {
                return Err(cubicle_template::commit::missing_upper(&upper).into());
            }
            Ok(cubicle_template::commit::commit_upper(
                &upper,
                &dest,
                base,
                &[],
            )?)
        })
        .await;
        inner.clone().teardown(id, record).await;
        copied.map(|c| {
            tracing::debug!(sandbox = %id, entries = c.entries, bytes = c.bytes, "build step committed");
        })
    }

    /// Layer ids of every sandbox of this node (running or paused) and of every snapshot
    /// (GC must keep them: a resume, fork or rollback restores onto exactly those).
    pub fn layers_in_use(&self) -> HashSet<String> {
        let mut used: HashSet<String> = self
            .inner
            .lock()
            .live()
            .values()
            .flat_map(|l| l.record.layers.iter().cloned())
            .collect();
        used.extend(
            self.inner
                .snapshots
                .list()
                .into_iter()
                .flat_map(|s| s.layers),
        );
        used
    }

    /// What keeps template `name` from being removed: its sandboxes that are not dying
    /// (running, paused, being created or paused), then its snapshots (`snapshot <id>`).
    pub fn template_users(&self, name: &str) -> Vec<String> {
        use crate::sandbox::SandboxState as S;
        let of = |t: &str| t == name || t.starts_with(&format!("{name}:"));
        let mut out: Vec<String> = self
            .inner
            .lock()
            .live()
            .values()
            .filter(|l| !matches!(l.record.state, S::Dying | S::Dead))
            .filter(|l| of(l.record.rootfs_template()))
            .map(|l| l.record.id.to_string())
            .collect();
        out.extend(
            self.inner
                .snapshots
                .list()
                .into_iter()
                .filter(|s| of(&s.base_template))
                .map(|s| format!("snapshot {}", s.id)),
        );
        out
    }
}
