//! Templates: a stack of read-only layers plus a config. On disk:
//!
//! ```text
//! <state>/layers/<sha256>/            a layer, stored once, shared by every template (layer.rs)
//! <state>/templates/<name>/template.json   the config of the build tagged `default`,
//!                                          with its layers (bottom first)
//! <state>/templates/<name>/tags.json       tag -> build id
//! <state>/templates/<name>/builds/<id>.json  one build: status, reason, config (builds.rs)
//! ```
//!
//! A template made before layers existed keeps its root filesystem in
//! `<state>/templates/<name>/rootfs/` and no `layers` in its config; it still works as a
//! one-layer template, and moves into the layer store the first time another template is
//! built on it (so that rebuilding it never changes what is built on it).
//!
//! Built-ins are built on first use and cached: `tiny` (busybox-static, built in
//! milliseconds, for tests — see [`tiny`]), `base` (Debian 12 minbase plus the usual
//! tools, like E2B's base image — see [`base`]) and `code-interpreter-v1`. Custom
//! templates come from images (`oci/`), from E2B's build steps and from Dockerfiles
//! (`build/`). Every build writes its layers in temporary directories and publishes the
//! template with one rename, so an interrupted build never leaves a half template; a
//! per-name lock file keeps two builds of one name apart.

pub mod base;
pub mod build;
pub mod builds;
pub mod code_interpreter;
pub mod commit;
mod config_cache;
pub mod error;
pub mod fsutil;
pub mod gc;
pub mod layer;
pub mod oci;
pub mod pack;
mod progress;
pub mod provision;
pub mod tiny;
pub mod unpack;
pub mod view;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

pub use error::{Error, Result};
pub use layer::{LayerInfo, LayerStore};
pub use progress::Progress;

use crate::error::IoContext;

/// Names of the templates this crate can build by itself.
pub const BUILTINS: &[&str] = &["tiny", "base", code_interpreter::NAME];

/// Whether a built template is what this version's builder makes: a built-in made by an
/// older builder (another `builder` tag) is rebuilt on its next `ensure` or `build`.
fn is_current(t: &Template) -> bool {
    t.config.name != code_interpreter::NAME || t.config.builder == code_interpreter::BUILDER
}

/// Called after every template build with its name, whether it succeeded and how long it
/// took (see [`observe_builds`]).
pub type BuildObserver = Box<dyn Fn(&str, bool, std::time::Duration) + Send + Sync>;

static BUILD_OBSERVER: std::sync::OnceLock<BuildObserver> = std::sync::OnceLock::new();

/// Sets the function told about every template build of this process (`cubicle serve`
/// counts them for its metrics). Only the first call takes effect.
pub fn observe_builds(observer: BuildObserver) {
    let _ = BUILD_OBSERVER.set(observer);
}

/// Mount point inside every rootfs where the runtime bind-mounts the envd binary.
pub const ENVD_MOUNT_POINT: &str = "run/cubicle/envd";
/// Directory inside every rootfs where the runtime bind-mounts the host-visible control dir.
pub const CTL_MOUNT_POINT: &str = "run/cubicle/ctl";

/// A template's config, stored as `template.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TemplateConfig {
    /// Template name (`[a-z0-9][a-z0-9._-]*`).
    pub name: String,
    /// User processes run as when the caller names none.
    pub default_user: String,
    /// Working directory of processes whose caller names none; `None` (E2B's base
    /// image sets none): the acting user's home. Relative paths always resolve against
    /// the acting user's home, whatever this says.
    #[serde(
        default,
        deserialize_with = "workdir_or_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub default_workdir: Option<String>,
    /// Environment every process in the sandbox gets.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Command started (through envd) after the sandbox is ready, if any.
    #[serde(default)]
    pub start_command: Option<String>,
    /// User the start command runs as (the default user when `None`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_user: Option<String>,
    /// The start command's program takes the sandbox's env vars from envd when it needs
    /// them (the code interpreter does, at a context's first execution) rather than from
    /// its own environment: a pooled sandbox, whose start command was started before the
    /// claim, may then serve creates that set env vars. Otherwise only creates without
    /// env vars claim pooled sandboxes of a template with a start command.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub late_env: bool,
    /// TCP port inside the sandbox that must answer `GET /health` with 200 (after the
    /// start command) before the sandbox counts as ready, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_port: Option<u16>,
    /// Default vCPU count.
    pub cpus: u32,
    /// Default memory limit in MiB.
    pub memory_mb: u64,
    /// Default writable-layer quota in MiB.
    pub disk_mb: u64,
    /// Unix time (seconds) the build finished.
    #[serde(default)]
    pub built_at: u64,
    /// Apparent size of the rootfs in bytes at build time.
    #[serde(default)]
    pub size_bytes: u64,
    /// Which builder made it (e.g. `tiny/1`).
    #[serde(default)]
    pub builder: String,
    /// Its layers (ids in `<state>/layers`), bottom first. Empty: a template of the
    /// older layout, whose only layer is `<state>/templates/<name>/rootfs`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<String>,
    /// Shell command run (as the default user, repeatedly, up to 120 s) after the start
    /// command until it exits 0; the sandbox counts as ready only then (E2B's
    /// `readyCmd`). `ready_port` is the older, HTTP form of the same wait.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_command: Option<String>,
    /// Id of the build that made this config (custom templates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build_id: Option<String>,
    /// Where it came from, for people (`image docker.io/library/alpine:3`, `template
    /// base`, `built-in`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Its files carry no capability a sandbox cannot hold
    /// (`cubicle_runtime::capabilities::fit_file_capabilities`; templates built before
    /// that existed are fitted when first used).
    #[serde(default)]
    pub file_caps_fitted: bool,
}

impl TemplateConfig {
    /// Defaults shared by the built-ins: user `user`, no workdir (commands start in the
    /// acting user's home), 2 vCPU, 512 MiB memory, 5 GiB disk.
    pub fn with_defaults(name: &str, builder: &str) -> Self {
        TemplateConfig {
            name: name.to_string(),
            default_user: "user".into(),
            default_workdir: None,
            env: BTreeMap::new(),
            start_command: None,
            start_user: None,
            late_env: false,
            ready_port: None,
            cpus: 2,
            memory_mb: 512,
            disk_mb: 5 * 1024,
            built_at: 0,
            size_bytes: 0,
            builder: builder.to_string(),
            layers: Vec::new(),
            ready_command: None,
            build_id: None,
            source: None,
            file_caps_fitted: false,
        }
    }
}

/// Reads a workdir where an empty string (or `null`) means none.
pub fn workdir_or_none<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<String>, D::Error> {
    let w: Option<String> = Option::deserialize(d)?;
    Ok(w.filter(|w| !w.is_empty()))
}

/// A built template on disk.
#[derive(Debug, Clone)]
pub struct Template {
    /// `<state>/templates/<name>`.
    pub dir: PathBuf,
    /// Its bottom layer (read-only): `<state>/layers/<id>`, or `<dir>/rootfs` for a
    /// template of the older layout.
    pub rootfs: PathBuf,
    /// The layers above `rootfs`, bottom first (empty for a one-layer template).
    pub layers: Vec<PathBuf>,
    /// Its config.
    pub config: TemplateConfig,
    /// Host files bind-mounted read-only into sandboxes of this value (host path, path
    /// inside): a build step's uploaded files. Never stored; empty for stored templates.
    pub binds: Vec<(PathBuf, PathBuf)>,
}

impl Template {
    /// Every layer, bottom first (`rootfs`, then `layers`).
    pub fn lowers(&self) -> Vec<PathBuf> {
        std::iter::once(self.rootfs.clone())
            .chain(self.layers.iter().cloned())
            .collect()
    }
}

/// The template store of one state directory.
#[derive(Debug, Clone)]
pub struct TemplateStore {
    root: PathBuf,
    layers: LayerStore,
    leases: std::sync::Arc<gc::Leases>,
    configs: std::sync::Arc<config_cache::ConfigCache>,
}

/// Check a template name: lowercase alphanumerics plus `.`, `_`, `-`, not starting with
/// a dot (dot-names are the store's temporary directories).
pub fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"._-".contains(&c))
        && name.as_bytes()[0].is_ascii_alphanumeric();
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidRequest(format!(
            "template name '{name}' must be 1-64 chars of [a-z0-9._-], starting with a letter or digit"
        )))
    }
}

impl TemplateStore {
    /// Open (and create) `<state>/templates` and `<state>/layers`.
    pub fn open(state_dir: &Path) -> Result<Self> {
        let root = state_dir.join("templates");
        fs::create_dir_all(&root).ctx("mkdir", &root)?;
        let layers = LayerStore::open(state_dir)?;
        Ok(TemplateStore {
            root,
            layers,
            leases: Default::default(),
            configs: Default::default(),
        })
    }

    /// The layer store.
    pub fn layers(&self) -> &LayerStore {
        &self.layers
    }

    /// A template value for `config` (its layers resolved to paths; errors if one is
    /// missing). `dir` is the template's directory (for the older layout's `rootfs/`).
    pub fn resolve(&self, dir: PathBuf, config: TemplateConfig) -> Result<Template> {
        if config.layers.is_empty() {
            return Ok(Template {
                rootfs: dir.join("rootfs"),
                layers: Vec::new(),
                dir,
                config,
                binds: Vec::new(),
            });
        }
        let mut paths = Vec::with_capacity(config.layers.len());
        for id in &config.layers {
            if !layer::valid_id(id) {
                return Err(Error::LayerMissing(id.clone()));
            }
            paths.push(self.layers.path(id));
        }
        let rootfs = paths.remove(0);
        Ok(Template {
            rootfs,
            layers: paths,
            dir,
            config,
            binds: Vec::new(),
        })
    }

    /// Fit the file capabilities of `template`'s lower layers where their store did not
    /// (layers of an older store; a template of the older layout's `rootfs/`). Whether
    /// all of them are fitted now.
    fn fit_caps(&self, template: &Template) -> bool {
        if template.config.layers.is_empty() {
            return layer::fit_caps(
                &template.rootfs,
                &format!("template {}", template.config.name),
            );
        }
        // (every layer is tried, so that one failure does not leave the others unfitted)
        let fitted: Vec<bool> = template
            .config
            .layers
            .iter()
            .map(|id| self.layers.ensure_caps_fitted(id))
            .collect();
        fitted.into_iter().all(|f| f)
    }

    /// Whether every one of `layers` had its file capabilities fitted when stored (a
    /// config made of them needs no walk at its first use).
    pub fn layers_caps_fitted(&self, layers: &[String]) -> bool {
        !layers.is_empty()
            && layers
                .iter()
                .all(|id| self.layers.info(id).is_some_and(|i| i.caps_fitted))
    }

    /// `<state>/templates`.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A built template, or `None`.
    pub fn get(&self, name: &str) -> Result<Option<Template>> {
        validate_name(name)?;
        let dir = self.root.join(name);
        let cfg_path = dir.join("template.json");
        let Ok(meta) = fs::metadata(&cfg_path) else {
            self.configs.forget(name);
            return Ok(None);
        };
        let stamp = config_cache::FileStamp::of(&meta);
        if let Some(t) = self.configs.get(name, stamp) {
            return Ok(Some(t));
        }
        let mut config: TemplateConfig = fsutil::read_json(&cfg_path)?;
        let template = self.resolve(dir, config.clone())?;
        if config.file_caps_fitted {
            self.configs.put(name, stamp, &template);
        } else {
            // Layers record whether they were fitted when stored, so this walks only
            // those of an older store (a walk of a Debian root takes seconds when the
            // disk is busy, and every caller of `get` would wait for it).
            config.file_caps_fitted = self.fit_caps(&template);
            if config.file_caps_fitted {
                fsutil::write_json_atomic(&cfg_path, &config)?;
            }
        }
        Ok(Some(Template { config, ..template }))
    }

    /// The template, building it first if it is a built-in that is not built yet.
    pub fn ensure(&self, name: &str, progress: bool) -> Result<Template> {
        if let Some(t) = self.get(name)?
            && is_current(&t)
        {
            return Ok(t);
        }
        if !BUILTINS.contains(&name) {
            return Err(Error::TemplateNotFound(name.to_string()));
        }
        self.build(name, false, progress)
    }

    /// All built templates, sorted by name.
    pub fn list(&self) -> Result<Vec<Template>> {
        let mut out = Vec::new();
        for e in fs::read_dir(&self.root)
            .ctx("readdir", &self.root)?
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || validate_name(&name).is_err() {
                continue;
            }
            if let Ok(Some(t)) = self.get(&name) {
                out.push(t);
            }
        }
        out.sort_by(|a, b| a.config.name.cmp(&b.config.name));
        Ok(out)
    }

    /// Remove a template (the caller checks that no sandbox uses it).
    pub fn remove(&self, name: &str) -> Result<()> {
        validate_name(name)?;
        let _lock = self.lock(name)?;
        let dir = self.root.join(name);
        if !dir.exists() {
            return Err(Error::TemplateNotFound(name.to_string()));
        }
        // Rename first so that the name disappears atomically, then delete.
        let trash = self.root.join(format!(".trash-{name}-{}", unique_suffix()));
        fs::rename(&dir, &trash).ctx("rename", &dir)?;
        fsutil::remove_tree(&trash)
    }

    /// Build a built-in template (`tiny`, `base`, `code-interpreter-v1`). With `force`,
    /// rebuild even if it exists and is current (the old one is replaced atomically).
    pub fn build(&self, name: &str, force: bool, progress: bool) -> Result<Template> {
        validate_name(name)?;
        if !BUILTINS.contains(&name) {
            return Err(Error::TemplateBuild {
                name: name.into(),
                message: format!(
                    "no builder for '{name}' (built-ins: {})",
                    BUILTINS.join(", ")
                ),
            });
        }
        let _lock = self.lock(name)?;
        if !force
            && let Some(t) = self.get(name)?
            && is_current(&t)
        {
            return Ok(t);
        }
        let t0 = std::time::Instant::now();
        let built = self.build_locked(name, progress);
        if let Some(observe) = BUILD_OBSERVER.get() {
            observe(name, built.is_ok(), t0.elapsed());
        }
        built
    }

    /// The build itself (the caller holds the name's lock).
    fn build_locked(&self, name: &str, progress: bool) -> Result<Template> {
        self.remove_stale_builds(name);
        // A template of the older layout being replaced: its root filesystem moves into
        // the layer store first (a running sandbox may still use it; GC decides later).
        self.adopt_legacy_locked(name)?;
        let staging = self.layers.staging()?;
        let rootfs = staging.path().to_path_buf();
        let p = Progress::new(progress, name);
        let mut config = match name {
            "tiny" => tiny::build(&rootfs, &p)?,
            code_interpreter::NAME => {
                let base = self.ensure("base", progress)?;
                code_interpreter::build(&rootfs, &base, &p)?
            }
            _ => base::build(&rootfs, &p)?,
        };
        config.built_at = unix_now();
        config.size_bytes = fsutil::tree_size(&rootfs);
        let id = layer::digest_of(&[
            b"built-in",
            name.as_bytes(),
            config.builder.as_bytes(),
            unique_suffix().as_bytes(),
        ]);
        // (storing fits the layer's file capabilities)
        let info = self.layers.store(
            staging,
            &id,
            &format!("built-in {name} ({})", config.builder),
        )?;
        config.file_caps_fitted = info.caps_fitted;
        config.layers = vec![id];
        config.source = Some("built-in".into());
        self.write_default(name, &config)?;
        p.finish(&format!(
            "template '{name}' built ({})",
            human_size(config.size_bytes)
        ));
        self.get(name)?
            .ok_or_else(|| Error::TemplateNotFound(name.to_string()))
    }

    /// Installs `config` (a template another node built, whose layers are all in this
    /// store now) as the `default` build of its name, replacing what was there.
    pub fn install(&self, config: &TemplateConfig) -> Result<Template> {
        let name = config.name.as_str();
        validate_name(name)?;
        if config.layers.is_empty() {
            return Err(Error::InvalidRequest(format!(
                "template '{name}' names no layers"
            )));
        }
        for id in &config.layers {
            if !self.layers.contains(id) {
                return Err(Error::LayerMissing(id.clone()));
            }
        }
        let _lock = self.lock(name)?;
        self.write_default(name, config)?;
        self.get(name)?
            .ok_or_else(|| Error::TemplateNotFound(name.to_string()))
    }

    /// Write `config` as the `default` build of `name` (`template.json`, atomically).
    pub(crate) fn write_default(&self, name: &str, config: &TemplateConfig) -> Result<()> {
        let dir = self.root.join(name);
        fs::create_dir_all(&dir).ctx("mkdir", &dir)?;
        fsutil::write_json_atomic(&dir.join("template.json"), config)
    }

    /// The template, moved into the layer store first if it has the older layout (its
    /// `rootfs/` becomes a layer). Call before building on it, so that rebuilding it later
    /// never changes a template built on top.
    pub fn adopt_legacy(&self, name: &str) -> Result<Template> {
        validate_name(name)?;
        let _lock = self.lock(name)?;
        self.adopt_legacy_locked(name)?;
        self.get(name)?
            .ok_or_else(|| Error::TemplateNotFound(name.to_string()))
    }

    fn adopt_legacy_locked(&self, name: &str) -> Result<()> {
        let Some(t) = self.get(name)? else {
            return Ok(());
        };
        if !t.config.layers.is_empty() || !t.rootfs.is_dir() {
            return Ok(());
        }
        let mut config = t.config.clone();
        let id = layer::digest_of(&[
            b"legacy",
            name.as_bytes(),
            config.builder.as_bytes(),
            &config.built_at.to_le_bytes(),
        ]);
        self.layers.adopt(
            &t.rootfs,
            &id,
            &format!("built-in {name} ({})", config.builder),
        )?;
        config.layers = vec![id];
        self.write_default(name, &config)
    }

    /// Remove leftovers of interrupted builds/removals of `name` (lock held by caller).
    fn remove_stale_builds(&self, name: &str) {
        let Ok(rd) = fs::read_dir(&self.root) else {
            return;
        };
        for e in rd.flatten() {
            let f = e.file_name().to_string_lossy().into_owned();
            let stale = [format!(".build-{name}-"), format!(".trash-{name}-")];
            if stale.iter().any(|p| f.starts_with(p.as_str()))
                && let Err(err) = fsutil::remove_tree(&e.path())
            {
                tracing::warn!(
                    "could not remove stale template build {}: {err}",
                    e.path().display()
                );
            }
        }
    }

    /// Exclusive per-name lock, released on drop.
    pub(crate) fn lock(&self, name: &str) -> Result<fs::File> {
        let path = self.root.join(format!(".{name}.lock"));
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .ctx("open", &path)?;
        cubicle_syscalls::fs::lock_exclusive(&f, true).map_err(|e| Error::io("flock", &path, e))?;
        Ok(f)
    }
}

/// A suffix unique on this host (pid and clock), for staging and trash directory names.
pub(crate) fn unique_suffix() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{}-{nanos:x}", std::process::id())
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// `1.5 MiB`-style size.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Create the directories and empty files the runtime mounts over (`/run/cubicle/envd`,
/// `/run/cubicle/ctl`), so a read-only lower layer already has the mount points.
pub(crate) fn add_cubicle_mount_points(rootfs: &Path) -> Result<()> {
    let ctl = rootfs.join(CTL_MOUNT_POINT);
    fs::create_dir_all(&ctl).ctx("mkdir", &ctl)?;
    let envd = rootfs.join(ENVD_MOUNT_POINT);
    fs::write(&envd, b"").ctx("create", &envd)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names() {
        assert!(validate_name("base").is_ok());
        assert!(validate_name("code-interpreter-v1").is_ok());
        assert!(validate_name(".build").is_err());
        assert!(validate_name("../x").is_err());
        assert!(validate_name("A").is_err());
        assert!(validate_name("").is_err());
    }

    #[test]
    fn workdir_is_optional() {
        let mut c = TemplateConfig::with_defaults("t", "t/1");
        let json = serde_json::to_value(&c).unwrap();
        assert!(json.get("defaultWorkdir").is_none(), "{json}");
        c.default_workdir = Some("/app".into());
        let back: TemplateConfig =
            serde_json::from_value(serde_json::to_value(&c).unwrap()).unwrap();
        assert_eq!(back.default_workdir.as_deref(), Some("/app"));
        // configs written before it was optional, and an empty one
        for (w, want) in [(json!("/home/user"), Some("/home/user")), (json!(""), None)] {
            let mut j = serde_json::to_value(&c).unwrap();
            j["defaultWorkdir"] = w;
            let t: TemplateConfig = serde_json::from_value(j).unwrap();
            assert_eq!(t.default_workdir.as_deref(), want);
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(human_size(10), "10 B");
        assert_eq!(human_size(1536), "1.5 KiB");
    }

    #[test]
    fn builds_lists_and_removes_tiny() {
        if !Path::new(tiny::BUSYBOX).exists() {
            eprintln!(
                "skipped: {} missing (apt-get install busybox-static)",
                tiny::BUSYBOX
            );
            return;
        }
        if !cubicle_syscalls::is_root() {
            eprintln!("skipped: building a template chowns files and needs root");
            return;
        }
        let state = std::env::temp_dir().join(format!("cubicle-tpl-{}", std::process::id()));
        let store = TemplateStore::open(&state).unwrap();
        assert!(store.get("tiny").unwrap().is_none());
        let t = store.ensure("tiny", false).unwrap();
        assert!(t.rootfs.join("bin/busybox").is_file());
        assert!(t.rootfs.join("bin/sh").is_symlink());
        assert_eq!(t.config.default_user, "user");
        assert!(t.config.size_bytes > 1_000_000);
        let names: Vec<_> = store
            .list()
            .unwrap()
            .into_iter()
            .map(|t| t.config.name)
            .collect();
        assert_eq!(names, vec!["tiny".to_string()]);
        let t2 = store.build("tiny", true, false).unwrap();
        assert!(t2.config.built_at >= t.config.built_at);
        store.remove("tiny").unwrap();
        assert!(store.get("tiny").unwrap().is_none());
        assert!(matches!(
            store.remove("tiny"),
            Err(Error::TemplateNotFound(_))
        ));
        fsutil::remove_tree(&state).unwrap();
    }

    /// A template made of layers fitted when stored is fitted without a walk (so its
    /// first use is cheap); a layer of an older store is walked once and recorded.
    #[test]
    fn only_layers_not_fitted_when_stored_are_walked() {
        const XATTR_CAPS: &str = "security.capability";
        if !cubicle_syscalls::is_root() {
            eprintln!("skipped: setting security.capability needs root");
            return;
        }
        let state = std::env::temp_dir().join(format!("cubicle-tpl-caps-{}", std::process::id()));
        let store = TemplateStore::open(&state).unwrap();
        // ping's cap_net_raw=ep (v2), which no sandbox can hold.
        let mut ping = vec![0u8; 20];
        ping[0..4].copy_from_slice(&0x0200_0001u32.to_le_bytes());
        ping[4..8].copy_from_slice(&(1u32 << 13).to_le_bytes());
        let layer = |name: &[u8]| {
            let s = store.layers().staging().unwrap();
            fs::write(s.path().join("ping"), b"x").unwrap();
            let id = layer::digest_of(&[name]);
            let info = store.layers().store(s, &id, "test").unwrap();
            assert!(info.caps_fitted, "fitted when stored");
            let ping_path = store.layers().path(&id).join("ping");
            assert!(fsutil::get_xattr(&ping_path, XATTR_CAPS).is_none());
            // What a file gets after the store fitted it (a tenant cannot, but it shows
            // whether a later walk happens).
            fsutil::set_xattr(&ping_path, XATTR_CAPS, &ping).unwrap();
            (id, ping_path)
        };
        let (fitted, fitted_ping) = layer(b"fitted");
        let (older, older_ping) = layer(b"older");
        // `older` as an older store wrote it: no record of a fitting.
        let meta = store.layers().root().join(format!("{older}.json"));
        let mut v: serde_json::Value = serde_json::from_slice(&fs::read(&meta).unwrap()).unwrap();
        v.as_object_mut().unwrap().remove("capsFitted");
        fs::write(&meta, v.to_string()).unwrap();
        assert!(!store.layers().info(&older).unwrap().caps_fitted);
        assert!(store.layers_caps_fitted(std::slice::from_ref(&fitted)));
        assert!(!store.layers_caps_fitted(&[fitted.clone(), older.clone()]));

        let mut config = TemplateConfig::with_defaults("t", "t/1");
        config.layers = vec![fitted.clone(), older.clone()];
        store.write_default("t", &config).unwrap();
        let t = store.get("t").unwrap().unwrap();
        assert!(t.config.file_caps_fitted);
        assert!(
            fsutil::get_xattr(&fitted_ping, XATTR_CAPS).is_some(),
            "a layer fitted when stored is not walked again"
        );
        assert!(
            fsutil::get_xattr(&older_ping, XATTR_CAPS).is_none(),
            "the older layer was walked and fitted"
        );
        assert!(
            store.layers().info(&older).unwrap().caps_fitted,
            "and recorded"
        );
        // A build published from fitted layers needs no walk at all.
        let mut c2 = TemplateConfig::with_defaults("u", "t/1");
        c2.layers = vec![fitted.clone(), older.clone()];
        let rec = store.new_build("u", "b1", Vec::new()).unwrap();
        store.publish(rec, c2).unwrap();
        let raw: serde_json::Value =
            serde_json::from_slice(&fs::read(state.join("templates/u/template.json")).unwrap())
                .unwrap();
        assert_eq!(raw["fileCapsFitted"], true, "{raw}");
        fsutil::remove_tree(&state).unwrap();
    }

    #[test]
    fn a_changed_config_is_read_again() {
        let state = std::env::temp_dir().join(format!("cubicle-tpl-cache-{}", std::process::id()));
        let store = TemplateStore::open(&state).unwrap();
        let mut config = TemplateConfig::with_defaults("t", "t/1");
        config.file_caps_fitted = true;
        config.memory_mb = 512;
        store.write_default("t", &config).unwrap();
        assert_eq!(store.get("t").unwrap().unwrap().config.memory_mb, 512);
        // Kept: a copy of the store (every clone shares it) answers from it while the
        // file is unchanged.
        let copy = store.clone();
        assert_eq!(copy.get("t").unwrap().unwrap().config.memory_mb, 512);
        // Rewritten by the store (a rename over it), and edited in place to the same
        // size: both are read again.
        config.memory_mb = 768;
        store.write_default("t", &config).unwrap();
        assert_eq!(copy.get("t").unwrap().unwrap().config.memory_mb, 768);
        let path = state.join("templates/t/template.json");
        let text = fs::read_to_string(&path).unwrap().replace("768", "640");
        std::thread::sleep(std::time::Duration::from_millis(20));
        fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, text.as_bytes()))
            .unwrap();
        assert_eq!(store.get("t").unwrap().unwrap().config.memory_mb, 640);
        // Gone: none, also after it was kept.
        fs::remove_file(&path).unwrap();
        assert!(store.get("t").unwrap().is_none());
        fsutil::remove_tree(&state).unwrap();
    }
}
