//! Building a template from steps: E2B's build steps (`Template().from_image(…).copy(…)
//! .run_cmd(…)`) and Dockerfiles (`dockerfile.rs` turns one into the same steps).
//!
//! A build starts from a base — an image (pulled into the layer store, then the E2B
//! additions of `provision.rs` as one layer) or another template (its layers) — and runs
//! the steps in order:
//!
//! - `RUN cmd [user]`: `/bin/sh -c cmd` in a fresh build sandbox over the layers so far,
//!   as the user, in the workdir, with the env; the sandbox's writable layer becomes the
//!   step's layer;
//! - `COPY src dest [owner] [mode]`: the uploaded context archive is bind-mounted
//!   read-only into a build sandbox and unpacked there by envd's build helper (so
//!   symlinks and owners resolve as the image defines them, and a hostile archive only
//!   ever touches the sandbox); its writable layer becomes the step's layer;
//! - `ENV`, `USER`, `WORKDIR`: change what later steps and the template's sandboxes get
//!   (`WORKDIR` also creates the directory when the image lacks it, like `RUN mkdir -p`).
//!
//! Every layer-making step has a cache key — the digest of the key before it, the step,
//! the uploaded files' hash, user, workdir and env — which is also its layer's id: a step
//! whose layer exists is skipped. `force` on a step (or `skip_cache` on the build) gives it
//! and everything after it new keys. Then `finalize`: with a start command, one more
//! sandbox starts it and runs the ready command until it succeeds (so a template whose
//! server never comes up fails its build, not its first sandbox). The result is a
//! [`TemplateConfig`] listing the layers; [`TemplateStore::publish`] makes it visible.
//!
//! Logs go to [`BuildLog`] with the step they belong to (`base`, `1`…`N`, `finalize`);
//! a failure names its step and why.

pub mod dockerfile;
pub mod host;
pub mod log;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub use host::{BuildHost, BuildSandbox, Exec, ExecEnd};
pub use log::BuildLog;

use crate::builds::BuildFailure;
use crate::error::Error;
use crate::layer::digest_of;
use crate::oci::pull::{Credentials, RegistryOptions};
use crate::view::LayerView;
use crate::{TemplateConfig, TemplateStore, provision};

/// Builder tag of templates made here (`TemplateConfig::builder`).
pub const BUILDER: &str = "build/1";
/// Where envd is inside every sandbox (its build helper runs from there).
const ENVD: &str = "/run/cubicle/envd";
/// Where a COPY step's archive is bind-mounted in its build sandbox.
const ARCHIVE_IN_SANDBOX: &str = "/run/cubicle/build-context";
/// Most layers a template may have (the runtime's limit).
pub const MAX_LAYERS: usize = 48;
/// How long the ready command may take to succeed at the end of a build.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// Default PATH when the image sets none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// One build step (E2B's `TemplateStep`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    /// `RUN`, `COPY`, `ENV`, `WORKDIR`, `USER`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Its arguments (see the module docs).
    #[serde(default)]
    pub args: Vec<String>,
    /// Rebuild this step and all after it.
    #[serde(default)]
    pub force: bool,
    /// COPY: the SHA-256 of the uploaded files (names the archive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files_hash: Option<String>,
}

/// What a build starts from.
#[derive(Debug, Clone)]
pub enum Source {
    /// An image from a registry.
    Image {
        /// Reference (`python:3`, `localhost:5000/app:1`).
        reference: String,
        /// Registry credentials.
        credentials: Option<Credentials>,
    },
    /// An image already in the layer store (imported).
    Stored(crate::oci::Image),
    /// Another template (name, optionally `name:tag`).
    Template(String),
}

/// A build to run.
#[derive(Debug, Clone)]
pub struct BuildRequest {
    /// Template name.
    pub name: String,
    /// Build id.
    pub build_id: String,
    /// Base.
    pub from: Source,
    /// Steps.
    pub steps: Vec<Step>,
    /// Start command.
    pub start_cmd: Option<String>,
    /// Ready command.
    pub ready_cmd: Option<String>,
    /// Ignore the cache for every step.
    pub force: bool,
    /// vCPUs of the template's sandboxes (and of the build's).
    pub cpus: Option<u32>,
    /// Memory in MiB.
    pub memory_mb: Option<u64>,
    /// How to reach registries.
    pub registry: RegistryOptions,
}

/// Finds an uploaded COPY archive by its files hash.
pub type FileResolver = dyn Fn(&str) -> Option<PathBuf> + Send + Sync;

/// The build's state between steps.
struct State {
    layers: Vec<String>,
    key: String,
    env: BTreeMap<String, String>,
    user: String,
    workdir: String,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
    cpus: u32,
    memory_mb: u64,
    disk_mb: u64,
}

fn fail(step: &str, message: impl Into<String>) -> BuildFailure {
    BuildFailure {
        message: message.into(),
        step: Some(step.to_string()),
    }
}

/// Shorten a command for messages.
fn short(s: &str) -> String {
    let one: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if one.chars().count() > 80 {
        format!("{}…", one.chars().take(79).collect::<String>())
    } else {
        one
    }
}

/// `path` made absolute against `cwd`.
fn absolute(path: &str, cwd: &str) -> String {
    if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{}/{}", cwd.trim_end_matches('/'), path)
    }
}

/// Cancellation of a running build.
pub type Cancel = tokio::sync::watch::Receiver<bool>;

fn cancelled(c: &Cancel) -> bool {
    *c.borrow()
}

/// Run `req`. On success: the template's config (not published yet).
pub async fn build<H: BuildHost>(
    host: &H,
    store: &TemplateStore,
    req: &BuildRequest,
    files: &FileResolver,
    log: &BuildLog,
    cancel: Cancel,
) -> Result<TemplateConfig, BuildFailure> {
    let t0 = Instant::now();
    let mut st = base(store, req, log).await?;
    let lease = store.lease(&st.layers);
    let mut forced = req.force;
    let n = req.steps.len();
    for (i, step) in req.steps.iter().enumerate() {
        let name = (i + 1).to_string();
        if cancelled(&cancel) {
            return Err(fail(&name, "the build was cancelled"));
        }
        forced |= step.force;
        let made = run_step(
            host, store, req, &mut st, step, &name, n, forced, files, log, &cancel,
        )
        .await?;
        if let Some(id) = made {
            lease.add(std::slice::from_ref(&id));
        }
    }
    if st.layers.len() > MAX_LAYERS {
        return Err(fail(
            "finalize",
            format!(
                "the template would have {} layers (at most {MAX_LAYERS}): combine RUN steps",
                st.layers.len()
            ),
        ));
    }
    if let Some(cmd) = st.start_cmd.clone() {
        finalize(host, store, &st, &cmd, log, &cancel).await?;
    }
    let mut config = TemplateConfig::with_defaults(&req.name, BUILDER);
    config.default_user = st.user.clone();
    config.default_workdir = Some(st.workdir.clone());
    config.env = st.env.clone();
    config.start_command = st.start_cmd.clone();
    config.ready_command = st.ready_cmd.clone();
    config.cpus = st.cpus;
    config.memory_mb = st.memory_mb;
    config.disk_mb = st.disk_mb;
    config.layers = st.layers.clone();
    config.build_id = Some(req.build_id.clone());
    config.built_at = crate::unix_now();
    config.size_bytes = st
        .layers
        .iter()
        .filter_map(|l| store.layers().info(l))
        .map(|l| l.size_bytes)
        .sum();
    config.source = Some(match &req.from {
        Source::Image { reference, .. } => format!("image {reference}"),
        Source::Stored(img) => format!("image {}", img.reference),
        Source::Template(t) => format!("template {t}"),
    });
    log.info(
        Some("finalize"),
        format!(
            "template '{}' built: {} layers, {} ({:.1}s)",
            req.name,
            config.layers.len(),
            crate::human_size(config.size_bytes),
            t0.elapsed().as_secs_f64()
        ),
    );
    drop(lease);
    Ok(config)
}

/// The `base` step: the layers and settings the steps start from.
async fn base(
    store: &TemplateStore,
    req: &BuildRequest,
    log: &BuildLog,
) -> Result<State, BuildFailure> {
    let step = Some("base");
    let err = |e: Error| fail("base", e.to_string());
    let (layers, env, user, workdir, start, ready, cpus, mem, disk) = match &req.from {
        Source::Template(t) => {
            let (name, tag) = match t.split_once(':') {
                Some((n, t)) => (n, Some(t)),
                None => (t.as_str(), None),
            };
            log.info(step, format!("FROM template {t}"));
            let s2 = store.clone();
            let n2 = name.to_string();
            let parent = match tag {
                None => tokio::task::spawn_blocking(move || {
                    s2.ensure(&n2, false)?;
                    s2.adopt_legacy(&n2)
                })
                .await
                .map_err(|e| fail("base", format!("template task: {e}")))?
                .map_err(err)?,
                Some(tag) => store
                    .get_tagged(name, Some(tag))
                    .map_err(err)?
                    .ok_or_else(|| fail("base", format!("template '{t}' not found")))?,
            };
            let c = parent.config;
            (
                c.layers.clone(),
                c.env.clone(),
                c.default_user.clone(),
                c.default_workdir
                    .clone()
                    .unwrap_or_else(|| match c.default_user.as_str() {
                        "root" => "/root".to_string(),
                        u => format!("/home/{u}"),
                    }),
                c.start_command.clone(),
                c.ready_command.clone(),
                c.cpus,
                c.memory_mb,
                c.disk_mb,
            )
        }
        Source::Image {
            reference,
            credentials,
        } => {
            log.info(step, format!("FROM {reference}"));
            let l = |m: String| log.info(Some("base"), m);
            let img =
                crate::oci::pull::pull(store, reference, credentials.as_ref(), &req.registry, &l)
                    .await
                    .map_err(err)?;
            image_base(store, &img, log)?
        }
        Source::Stored(img) => {
            log.info(step, format!("FROM {} (imported)", img.reference));
            image_base(store, img, log)?
        }
    };
    let missing: Vec<&String> = layers
        .iter()
        .filter(|l| !store.layers().contains(l))
        .collect();
    if let Some(m) = missing.first() {
        return Err(fail("base", Error::LayerMissing((*m).clone()).to_string()));
    }
    let mut key_parts: Vec<&[u8]> = vec![b"base"];
    key_parts.extend(layers.iter().map(|l| l.as_bytes()));
    Ok(State {
        key: digest_of(&key_parts),
        layers,
        env,
        user,
        workdir,
        start_cmd: req.start_cmd.clone().or(start),
        ready_cmd: if req.start_cmd.is_some() {
            req.ready_cmd.clone()
        } else {
            req.ready_cmd.clone().or(ready)
        },
        cpus: req.cpus.unwrap_or(cpus),
        memory_mb: req.memory_mb.unwrap_or(mem),
        disk_mb: disk,
    })
}

type BaseParts = (
    Vec<String>,
    BTreeMap<String, String>,
    String,
    String,
    Option<String>,
    Option<String>,
    u32,
    u64,
    u64,
);

/// A template made of an image alone (its layers plus the E2B additions, E2B's settings),
/// recorded as a build of `name` and published: what `cubicle template import` makes.
/// No sandbox is needed: the additions are written on the host (see `provision.rs`).
pub fn image_template(
    store: &TemplateStore,
    name: &str,
    img: &crate::oci::Image,
    start_cmd: Option<String>,
) -> crate::Result<TemplateConfig> {
    let build_id = format!("import-{}", crate::unique_suffix());
    let rec = store.new_build(name, &build_id, Vec::new())?;
    let log = BuildLog::new(store.clone(), name, &build_id);
    let (layers, env, user, workdir, _, _, cpus, memory_mb, disk_mb) = image_base(store, img, &log)
        .map_err(|f| Error::TemplateBuild {
            name: name.into(),
            message: f.message,
        })?;
    let mut config = TemplateConfig::with_defaults(name, "import/1");
    config.layers = layers;
    config.env = env;
    config.default_user = user;
    config.default_workdir = Some(workdir);
    config.start_command = start_cmd;
    (config.cpus, config.memory_mb, config.disk_mb) = (cpus, memory_mb, disk_mb);
    config.build_id = Some(build_id);
    config.built_at = crate::unix_now();
    config.size_bytes = config
        .layers
        .iter()
        .filter_map(|l| store.layers().info(l))
        .map(|l| l.size_bytes)
        .sum();
    config.source = Some(format!("image {}", img.reference));
    store.publish(rec, config.clone())?;
    Ok(config)
}

/// An image's layers plus the provisioning layer, and the settings E2B gives it.
fn image_base(
    store: &TemplateStore,
    img: &crate::oci::Image,
    log: &BuildLog,
) -> Result<BaseParts, BuildFailure> {
    let err = |e: Error| fail("base", e.to_string());
    let mut layers = img.layers.clone();
    let mut parts: Vec<&[u8]> = vec![b"provision", provision::VERSION.as_bytes()];
    parts.extend(img.layers.iter().map(|l| l.as_bytes()));
    let pid = digest_of(&parts);
    if store.layers().contains(&pid) {
        layers.push(pid);
    } else {
        let view = LayerView::new(img.layers.iter().map(|l| store.layers().path(l)).collect());
        let staging = store.layers().staging().map_err(err)?;
        let p = provision::provision(&view, staging.path()).map_err(err)?;
        for n in &p.notes {
            log.info(Some("base"), n.clone());
        }
        if p.changed {
            store
                .layers()
                .store(
                    staging,
                    &pid,
                    &format!("E2B additions for {}", img.reference),
                )
                .map_err(err)?;
            layers.push(pid);
        }
    }
    let mut env = img.config.env.clone();
    env.entry("PATH".into())
        .or_insert_with(|| DEFAULT_PATH.into());
    let d = TemplateConfig::with_defaults("x", BUILDER);
    Ok((
        layers,
        env,
        provision::USER.into(),
        provision::HOME.into(),
        None,
        None,
        d.cpus,
        1024,
        d.disk_mb,
    ))
}

#[allow(clippy::too_many_arguments)]
async fn run_step<H: BuildHost>(
    host: &H,
    store: &TemplateStore,
    req: &BuildRequest,
    st: &mut State,
    step: &Step,
    name: &str,
    total: usize,
    forced: bool,
    files: &FileResolver,
    log: &BuildLog,
    cancel: &Cancel,
) -> Result<Option<String>, BuildFailure> {
    let kind = step.kind.to_ascii_uppercase();
    let args = &step.args;
    let label = format!("[{name}/{total}] {kind} {}", short(&args.join(" ")));
    let key_of = |extra: &[&[u8]]| {
        let env = serde_json::to_string(&st.env).unwrap_or_default();
        let mut parts: Vec<&[u8]> = vec![
            st.key.as_bytes(),
            kind.as_bytes(),
            st.user.as_bytes(),
            st.workdir.as_bytes(),
            env.as_bytes(),
        ];
        for a in args {
            parts.push(a.as_bytes());
        }
        parts.extend_from_slice(extra);
        if forced {
            parts.push(b"force");
            parts.push(req.build_id.as_bytes());
        }
        digest_of(&parts)
    };
    match kind.as_str() {
        "ENV" => {
            if !args.len().is_multiple_of(2) {
                return Err(fail(name, format!("{label}: ENV takes key/value pairs")));
            }
            st.key = key_of(&[]);
            for kv in args.chunks(2) {
                st.env.insert(kv[0].clone(), kv[1].clone());
            }
            log.info(Some(name), label);
            Ok(None)
        }
        "USER" => {
            let u = args
                .first()
                .filter(|u| !u.is_empty())
                .ok_or_else(|| fail(name, format!("{label}: USER needs a user")))?;
            st.key = key_of(&[]);
            st.user = u.clone();
            log.info(Some(name), label);
            Ok(None)
        }
        "WORKDIR" => {
            let p = args
                .first()
                .filter(|p| !p.is_empty())
                .ok_or_else(|| fail(name, format!("{label}: WORKDIR needs a path")))?;
            let dir = absolute(p, &st.workdir);
            let id = key_of(&[]);
            st.key = id.clone();
            st.workdir = dir.clone();
            let view = LayerView::new(st.layers.iter().map(|l| store.layers().path(l)).collect());
            if view.is_dir(&dir) {
                log.info(Some(name), label);
                return Ok(None);
            }
            let exec = Exec {
                cmd: ENVD.into(),
                args: vec![
                    "--build-op".into(),
                    serde_json::json!({"op": "mkdir", "path": dir, "owner": st.user}).to_string(),
                ],
                user: "root".into(),
                cwd: Some("/".into()),
                env: BTreeMap::new(),
            };
            layer_step(
                host,
                store,
                st,
                id,
                exec,
                Vec::new(),
                &label,
                name,
                log,
                cancel,
            )
            .await
        }
        "RUN" => {
            let cmd = args
                .first()
                .ok_or_else(|| fail(name, format!("{label}: RUN needs a command")))?;
            let user = args
                .get(1)
                .filter(|u| !u.is_empty())
                .unwrap_or(&st.user)
                .clone();
            let view = LayerView::new(st.layers.iter().map(|l| store.layers().path(l)).collect());
            if !view.exists("/bin/sh") {
                return Err(fail(
                    name,
                    format!(
                        "{label}: the image has no /bin/sh, so RUN cannot run (COPY, ENV, WORKDIR and USER still work)"
                    ),
                ));
            }
            let id = key_of(&[]);
            let exec = Exec {
                cmd: "/bin/sh".into(),
                args: vec!["-c".into(), cmd.clone()],
                user,
                cwd: Some(st.workdir.clone()),
                env: BTreeMap::new(),
            };
            layer_step(
                host,
                store,
                st,
                id,
                exec,
                Vec::new(),
                &label,
                name,
                log,
                cancel,
            )
            .await
        }
        "COPY" => {
            let (src, dest) = match (args.first(), args.get(1)) {
                (Some(s), Some(d)) if !s.is_empty() && !d.is_empty() => (s, d),
                _ => {
                    return Err(fail(
                        name,
                        format!("{label}: COPY needs a source and a destination"),
                    ));
                }
            };
            let hash = step
                .files_hash
                .as_deref()
                .ok_or_else(|| fail(name, format!("{label}: COPY without filesHash")))?;
            let archive = files(hash).ok_or_else(|| {
                fail(
                    name,
                    format!("{label}: the files of this step (hash {hash}) were never uploaded"),
                )
            })?;
            let owner = args
                .get(2)
                .filter(|o| !o.is_empty())
                .cloned()
                .unwrap_or_else(|| st.user.clone());
            let mode = args.get(3).cloned().unwrap_or_default();
            let id = key_of(&[hash.as_bytes()]);
            let exec = Exec {
                cmd: ENVD.into(),
                args: vec![
                    "--build-op".into(),
                    serde_json::json!({
                        "op": "copy",
                        "archive": ARCHIVE_IN_SANDBOX,
                        "src": src,
                        "dest": dest,
                        "owner": owner,
                        "mode": mode,
                        "workdir": st.workdir,
                    })
                    .to_string(),
                ],
                user: "root".into(),
                cwd: Some("/".into()),
                env: BTreeMap::new(),
            };
            let binds = vec![(archive, PathBuf::from(ARCHIVE_IN_SANDBOX))];
            layer_step(host, store, st, id, exec, binds, &label, name, log, cancel).await
        }
        other => Err(fail(
            name,
            format!("{label}: unknown step type '{other}' (RUN, COPY, ENV, WORKDIR, USER)"),
        )),
    }
}

/// A step that makes a layer: cached by `id`, else run `exec` in a build sandbox and
/// commit its writable layer as layer `id`.
#[allow(clippy::too_many_arguments)]
async fn layer_step<H: BuildHost>(
    host: &H,
    store: &TemplateStore,
    st: &mut State,
    id: String,
    exec: Exec,
    binds: Vec<(PathBuf, PathBuf)>,
    label: &str,
    name: &str,
    log: &BuildLog,
    cancel: &Cancel,
) -> Result<Option<String>, BuildFailure> {
    st.key = id.clone();
    if store.layers().contains(&id) {
        log.info(Some(name), format!("CACHED {label}"));
        push_layer(store, st, &id);
        return Ok(Some(id));
    }
    log.info(Some(name), label.to_string());
    let t0 = Instant::now();
    let sb = BuildSandbox {
        lowers: st.layers.iter().map(|l| store.layers().path(l)).collect(),
        binds,
        cpus: st.cpus,
        memory_mb: st.memory_mb.max(512),
        disk_mb: st.disk_mb.max(10 * 1024),
        env: st.env.clone(),
    };
    let sid = host
        .start(sb)
        .await
        .map_err(|e| fail(name, format!("{label}: starting the build sandbox: {e}")))?;
    let tail = std::sync::Mutex::new(std::collections::VecDeque::<String>::new());
    let on_line = |_err: bool, l: &str| {
        log.push("info", Some(name), l.to_string());
        if let Ok(mut t) = tail.lock() {
            t.push_back(l.to_string());
            if t.len() > 5 {
                t.pop_front();
            }
        }
    };
    let mut cancel = cancel.clone();
    let ran = tokio::select! {
        r = host.exec(&sid, exec, &on_line) => Some(r),
        _ = cancel.wait_for(|c| *c) => None,
    };
    let end = match ran {
        None => {
            host.discard(&sid).await;
            return Err(fail(name, format!("{label}: the build was cancelled")));
        }
        Some(Err(e)) => {
            host.discard(&sid).await;
            return Err(fail(name, format!("{label}: {e}")));
        }
        Some(Ok(end)) => end,
    };
    if end.exit_code != 0 {
        host.discard(&sid).await;
        let last: Vec<String> = tail
            .lock()
            .map(|t| t.iter().cloned().collect())
            .unwrap_or_default();
        let why = if end.exit_code < 0 {
            format!("the command was killed ({})", end.status)
        } else {
            format!("the command exited with code {}", end.exit_code)
        };
        let out = if last.is_empty() {
            String::new()
        } else {
            format!("; last output: {}", last.join(" | "))
        };
        return Err(fail(
            name,
            format!("step {name} {label} failed: {why}{out}"),
        ));
    }
    let staging = store
        .layers()
        .staging()
        .map_err(|e| fail(name, format!("{label}: {e}")))?;
    host.commit(&sid, staging.path().to_path_buf())
        .await
        .map_err(|e| fail(name, format!("{label}: saving the step's layer: {e}")))?;
    let info = store
        .layers()
        .store(staging, &id, &format!("{} {label}", st_label(&st.workdir)))
        .map_err(|e| fail(name, format!("{label}: {e}")))?;
    log.info(
        Some(name),
        format!(
            "done in {:.2}s, layer {} ({})",
            t0.elapsed().as_secs_f64(),
            &id[..12],
            crate::human_size(info.size_bytes)
        ),
    );
    push_layer(store, st, &id);
    Ok(Some(id))
}

fn st_label(workdir: &str) -> String {
    format!("build step (workdir {workdir}):")
}

/// Add a step's layer unless it is empty (nothing changed: no overlay layer needed).
fn push_layer(store: &TemplateStore, st: &mut State, id: &str) {
    let empty = std::fs::read_dir(store.layers().path(id))
        .map(|mut d| d.next().is_none())
        .unwrap_or(false);
    if !empty {
        st.layers.push(id.to_string());
    }
}

/// Start the start command in a sandbox of the finished template and wait for the ready
/// command to succeed.
async fn finalize<H: BuildHost>(
    host: &H,
    store: &TemplateStore,
    st: &State,
    start: &str,
    log: &BuildLog,
    cancel: &Cancel,
) -> Result<(), BuildFailure> {
    let step = "finalize";
    let view = LayerView::new(st.layers.iter().map(|l| store.layers().path(l)).collect());
    if !view.exists("/bin/sh") {
        return Err(fail(
            step,
            "the image has no /bin/sh to run the start command with",
        ));
    }
    log.info(Some(step), format!("start command: {}", short(start)));
    let sb = BuildSandbox {
        lowers: st.layers.iter().map(|l| store.layers().path(l)).collect(),
        binds: Vec::new(),
        cpus: st.cpus,
        memory_mb: st.memory_mb,
        disk_mb: st.disk_mb,
        env: st.env.clone(),
    };
    let sid = host
        .start(sb)
        .await
        .map_err(|e| fail(step, format!("starting a sandbox of the template: {e}")))?;
    let shell = |cmd: &str| Exec {
        cmd: "/bin/sh".into(),
        args: vec!["-c".into(), cmd.to_string()],
        user: st.user.clone(),
        cwd: Some(st.workdir.clone()),
        env: BTreeMap::new(),
    };
    let result = async {
        host.spawn(&sid, shell(start))
            .await
            .map_err(|e| fail(step, format!("start command: {e}")))?;
        let Some(ready) = st.ready_cmd.clone() else {
            return Ok(());
        };
        log.info(
            Some(step),
            format!("waiting for the ready command: {}", short(&ready)),
        );
        let t0 = Instant::now();
        let quiet = |_: bool, _: &str| {};
        loop {
            if cancelled(cancel) {
                return Err(fail(step, "the build was cancelled"));
            }
            match host.exec(&sid, shell(&ready), &quiet).await {
                Ok(e) if e.exit_code == 0 => {
                    log.info(
                        Some(step),
                        format!("ready after {:.1}s", t0.elapsed().as_secs_f64()),
                    );
                    return Ok(());
                }
                Ok(_) | Err(_) if t0.elapsed() < READY_TIMEOUT => {
                    tokio::time::sleep(Duration::from_millis(250)).await
                }
                Ok(e) => {
                    return Err(fail(
                        step,
                        format!(
                            "the ready command `{}` did not succeed within {}s (last exit code {})",
                            short(&ready),
                            READY_TIMEOUT.as_secs(),
                            e.exit_code
                        ),
                    ));
                }
                Err(e) => return Err(fail(step, format!("ready command: {e}"))),
            }
        }
    }
    .await;
    host.discard(&sid).await;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_labels() {
        assert_eq!(absolute("app", "/home/user"), "/home/user/app");
        assert_eq!(absolute("/x", "/home/user"), "/x");
        assert_eq!(short("echo   a\n b"), "echo a b");
        assert_eq!(short(&"x".repeat(100)).chars().count(), 80);
        let s: Step = serde_json::from_str(
            r#"{"type":"COPY","args":["a","/b","",""],"force":false,"filesHash":"ab","forceUpload":true}"#,
        )
        .unwrap();
        assert_eq!(s.files_hash.as_deref(), Some("ab"));
    }
}
