//! Builds and tags of custom templates, as E2B models them: a template (its name is its
//! id) has builds (UUIDs); tags name builds; the tag `default` is what a bare name means.
//!
//! ```text
//! <state>/templates/<name>/builds/<build>.json   BuildRecord: status, times, reason, config
//! <state>/templates/<name>/builds/<build>.log    its log, one JSON LogEntry per line
//! <state>/templates/<name>/tags.json             { "<tag>": "<build>" }
//! <state>/templates/<name>/template.json         the config of the `default` build
//! ```
//!
//! A build is written first (status `building`), and its template becomes visible only
//! when [`TemplateStore::publish`] points tags at it (one rename each), so a failed or
//! interrupted build never shows as a half template. Every record survives restarts; a
//! build that was `building` when the process died is reported as `error` ("interrupted")
//! by [`TemplateStore::build_record`].

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Error, IoContext, Result};
use crate::{Template, TemplateConfig, TemplateStore, fsutil, validate_name};

/// The tag a bare template name means.
pub const DEFAULT_TAG: &str = "default";

/// Where a build stands (E2B's `TemplateBuildStatus`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum BuildStatus {
    /// Created, not started yet (waiting for its steps).
    Waiting,
    /// Running.
    Building,
    /// Done; its template is published.
    Ready,
    /// Failed (see the reason).
    Error,
}

/// Why a build failed: the message and the step (`base`, `1`…`N`, `finalize`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BuildFailure {
    /// What went wrong, naming the step and its instruction.
    pub message: String,
    /// `base`, a 1-based step number, or `finalize`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
}

/// One build of a template.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BuildRecord {
    /// The build's id (a UUID).
    pub build_id: String,
    /// Template name.
    pub template: String,
    /// Where it stands.
    pub status: BuildStatus,
    /// Unix milliseconds: created, last changed, finished.
    pub created_at_ms: u64,
    /// Last change.
    pub updated_at_ms: u64,
    /// When it finished (ready or error).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<u64>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<BuildFailure>,
    /// The resulting config (with its layers) once ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<TemplateConfig>,
    /// Tags the build asked for (assigned when it is ready).
    #[serde(default)]
    pub tags: Vec<String>,
    /// vCPUs and memory the build asked for (also the template's defaults).
    #[serde(default)]
    pub cpus: Option<u32>,
    /// Memory in MiB.
    #[serde(default)]
    pub memory_mb: Option<u64>,
}

/// A log line of a build (E2B's `BuildLogEntry`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LogEntry {
    /// Unix milliseconds.
    pub timestamp_ms: u64,
    /// `debug`, `info`, `warn` or `error`.
    pub level: String,
    /// The line.
    pub message: String,
    /// `base`, `1`…`N`, `finalize`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
}

/// What a tag points at.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TagInfo {
    /// The tag.
    pub tag: String,
    /// The build it names.
    pub build_id: String,
    /// Unix milliseconds it was assigned.
    pub assigned_at_ms: u64,
}

/// Check a tag: `[a-z0-9._-]{1,128}`.
pub fn validate_tag(tag: &str) -> Result<()> {
    let ok = !tag.is_empty()
        && tag.len() <= 128
        && tag
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"._-".contains(&c));
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidRequest(format!(
            "tag '{tag}' must be 1-128 chars of [a-z0-9._-]"
        )))
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A build id must be a plain token (it names files).
fn validate_build_id(id: &str) -> Result<()> {
    if !id.is_empty()
        && id.len() <= 64
        && id.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
    {
        Ok(())
    } else {
        Err(Error::InvalidRequest(format!(
            "build id '{id}' is malformed"
        )))
    }
}

impl TemplateStore {
    fn builds_dir(&self, name: &str) -> PathBuf {
        self.root().join(name).join("builds")
    }

    /// Record a new build of `name` (status `waiting`). The template directory appears
    /// with it (without a `template.json`, so the name is not usable yet).
    pub fn new_build(&self, name: &str, build_id: &str, tags: Vec<String>) -> Result<BuildRecord> {
        validate_name(name)?;
        validate_build_id(build_id)?;
        let dir = self.builds_dir(name);
        fs::create_dir_all(&dir).ctx("mkdir", &dir)?;
        let now = now_ms();
        let rec = BuildRecord {
            build_id: build_id.into(),
            template: name.into(),
            status: BuildStatus::Waiting,
            created_at_ms: now,
            updated_at_ms: now,
            finished_at_ms: None,
            failure: None,
            config: None,
            tags,
            cpus: None,
            memory_mb: None,
        };
        self.save_build(&rec)?;
        Ok(rec)
    }

    /// Write a build record.
    pub fn save_build(&self, rec: &BuildRecord) -> Result<()> {
        validate_build_id(&rec.build_id)?;
        let dir = self.builds_dir(&rec.template);
        fs::create_dir_all(&dir).ctx("mkdir", &dir)?;
        fsutil::write_json_atomic(&dir.join(format!("{}.json", rec.build_id)), rec)
    }

    /// A build record. One left `waiting`/`building` by a process that is gone reads as
    /// `error` when `live` says no build of that id runs now.
    pub fn build_record(
        &self,
        name: &str,
        build_id: &str,
        live: bool,
    ) -> Result<Option<BuildRecord>> {
        validate_name(name)?;
        validate_build_id(build_id)?;
        let path = self.builds_dir(name).join(format!("{build_id}.json"));
        if !path.is_file() {
            return Ok(None);
        }
        let mut rec: BuildRecord = fsutil::read_json(&path)?;
        if !live && matches!(rec.status, BuildStatus::Waiting | BuildStatus::Building) {
            rec.status = BuildStatus::Error;
            rec.failure = Some(BuildFailure {
                message: "the build was interrupted (the server stopped); start it again".into(),
                step: None,
            });
        }
        Ok(Some(rec))
    }

    /// Every build record of `name`, oldest first.
    pub fn builds(&self, name: &str) -> Result<Vec<BuildRecord>> {
        validate_name(name)?;
        let dir = self.builds_dir(name);
        let Ok(rd) = fs::read_dir(&dir) else {
            return Ok(Vec::new());
        };
        let mut out: Vec<BuildRecord> = rd
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
            .filter_map(|e| fsutil::read_json(&e.path()).ok())
            .collect();
        out.sort_by_key(|r| r.created_at_ms);
        Ok(out)
    }

    /// Append log entries of a build.
    pub fn append_log(&self, name: &str, build_id: &str, entries: &[LogEntry]) -> Result<()> {
        validate_name(name)?;
        validate_build_id(build_id)?;
        let path = self.builds_dir(name).join(format!("{build_id}.log"));
        let mut f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .ctx("open", &path)?;
        let mut buf = Vec::new();
        for e in entries {
            serde_json::to_writer(&mut buf, e).map_err(|err| Error::Record {
                path: path.clone(),
                source: err,
            })?;
            buf.push(b'\n');
        }
        f.write_all(&buf).ctx("write", &path)
    }

    /// A build's log (empty if none).
    pub fn read_log(&self, name: &str, build_id: &str) -> Result<Vec<LogEntry>> {
        validate_name(name)?;
        validate_build_id(build_id)?;
        let path = self.builds_dir(name).join(format!("{build_id}.log"));
        let Ok(text) = fs::read_to_string(&path) else {
            return Ok(Vec::new());
        };
        Ok(text
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect())
    }

    /// The tags of `name` (the `default` tag included when there is a default build).
    pub fn tags(&self, name: &str) -> Result<Vec<TagInfo>> {
        validate_name(name)?;
        let mut map = self.read_tags(name);
        if !map.contains_key(DEFAULT_TAG)
            && let Some(t) = self.get(name)?
        {
            // A built-in: its one build is the default.
            map.insert(
                DEFAULT_TAG.into(),
                TagInfo {
                    tag: DEFAULT_TAG.into(),
                    build_id: t.config.build_id.clone().unwrap_or_default(),
                    assigned_at_ms: t.config.built_at * 1000,
                },
            );
        }
        Ok(map.into_values().collect())
    }

    fn read_tags(&self, name: &str) -> BTreeMap<String, TagInfo> {
        fsutil::read_json(&self.root().join(name).join("tags.json")).unwrap_or_default()
    }

    /// The template `name` at `tag` (`None`/`default`: its default build).
    pub fn get_tagged(&self, name: &str, tag: Option<&str>) -> Result<Option<Template>> {
        let tag = tag.unwrap_or(DEFAULT_TAG);
        if tag == DEFAULT_TAG {
            return self.get(name);
        }
        validate_name(name)?;
        validate_tag(tag)?;
        let Some(info) = self.read_tags(name).remove(tag) else {
            return Ok(None);
        };
        let Some(rec) = self.build_record(name, &info.build_id, true)? else {
            return Ok(None);
        };
        match rec.config {
            Some(c) => self.resolve(self.root().join(name), c).map(Some),
            None => Ok(None),
        }
    }

    /// Make a finished build visible: record its config, point `tags` at it (and
    /// `template.json` when one of them is `default`). Under the template's lock.
    pub fn publish(&self, mut rec: BuildRecord, mut config: TemplateConfig) -> Result<BuildRecord> {
        // Layers fitted when stored make a fitted template: its first `get` walks nothing.
        config.file_caps_fitted |= self.layers_caps_fitted(&config.layers);
        let name = rec.template.clone();
        let _lock = self.lock(&name)?;
        let now = now_ms();
        rec.status = BuildStatus::Ready;
        rec.updated_at_ms = now;
        rec.finished_at_ms = Some(now);
        rec.config = Some(config.clone());
        self.save_build(&rec)?;
        let tags = if rec.tags.is_empty() {
            vec![DEFAULT_TAG.to_string()]
        } else {
            rec.tags.clone()
        };
        self.point_tags(&name, &tags, &rec.build_id, Some(&config))?;
        Ok(rec)
    }

    /// Point `tags` of `name` at `build_id` (lock held by the caller). `config` is that
    /// build's config when known (needed when `default` moves).
    fn point_tags(
        &self,
        name: &str,
        tags: &[String],
        build_id: &str,
        config: Option<&TemplateConfig>,
    ) -> Result<()> {
        let mut map = self.read_tags(name);
        let now = now_ms();
        for t in tags {
            validate_tag(t)?;
            map.insert(
                t.clone(),
                TagInfo {
                    tag: t.clone(),
                    build_id: build_id.into(),
                    assigned_at_ms: now,
                },
            );
        }
        fsutil::write_json_atomic(&self.root().join(name).join("tags.json"), &map)?;
        if tags.iter().any(|t| t == DEFAULT_TAG) {
            let config = match config {
                Some(c) => c.clone(),
                None => self
                    .build_record(name, build_id, true)?
                    .and_then(|r| r.config)
                    .ok_or_else(|| {
                        Error::InvalidRequest(format!("build {build_id} of '{name}' is not ready"))
                    })?,
            };
            self.write_default(name, &config)?;
        }
        Ok(())
    }

    /// Assign `tags` to the build that `name:from_tag` names. Returns that build's id.
    pub fn assign_tags(&self, name: &str, from_tag: &str, tags: &[String]) -> Result<String> {
        validate_name(name)?;
        let _lock = self.lock(name)?;
        let build_id = self
            .read_tags(name)
            .remove(from_tag)
            .map(|t| t.build_id)
            .ok_or_else(|| Error::TemplateNotFound(format!("{name}:{from_tag}")))?;
        self.point_tags(name, tags, &build_id, None)?;
        Ok(build_id)
    }

    /// Remove `tags` of `name` (never `default`: remove the template instead).
    pub fn remove_tags(&self, name: &str, tags: &[String]) -> Result<()> {
        validate_name(name)?;
        if tags.iter().any(|t| t == DEFAULT_TAG) {
            return Err(Error::InvalidRequest(
                "the tag 'default' cannot be removed (remove the template instead)".into(),
            ));
        }
        let _lock = self.lock(name)?;
        let mut map = self.read_tags(name);
        for t in tags {
            if map.remove(t).is_none() {
                return Err(Error::TemplateNotFound(format!("{name}:{t}")));
            }
        }
        fsutil::write_json_atomic(&self.root().join(name).join("tags.json"), &map)
    }

    /// The opaque owner label of a custom template (the API stores its team's id there);
    /// `None` for built-ins and imports, which every caller may use.
    pub fn owner(&self, name: &str) -> Option<String> {
        validate_name(name).ok()?;
        fs::read_to_string(self.root().join(name).join("owner"))
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    }

    /// Record the owner label of `name` (its directory is created if needed).
    pub fn set_owner(&self, name: &str, owner: &str) -> Result<()> {
        validate_name(name)?;
        let dir = self.root().join(name);
        fs::create_dir_all(&dir).ctx("mkdir", &dir)?;
        let path = dir.join("owner");
        let tmp = dir.join(format!("owner.tmp{}", std::process::id()));
        fs::write(&tmp, owner).ctx("write", &tmp)?;
        fs::rename(&tmp, &path).ctx("rename", &path)
    }

    /// Layer ids that a tag of `name` reaches (what must not be collected).
    pub fn referenced_layers(&self, name: &str) -> Vec<String> {
        let mut out = Vec::new();
        if let Ok(Some(t)) = self.get(name) {
            out.extend(t.config.layers);
        }
        for info in self.read_tags(name).into_values() {
            if let Ok(Some(rec)) = self.build_record(name, &info.build_id, true)
                && let Some(c) = rec.config
            {
                out.extend(c.layers);
            }
        }
        out.sort();
        out.dedup();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_tags_and_records() {
        let state = std::env::temp_dir().join(format!("cubicle-builds-{}", std::process::id()));
        let store = TemplateStore::open(&state).unwrap();
        let id = crate::layer::digest_of(&[b"l"]);
        let s = store.layers().staging().unwrap();
        store.layers().store(s, &id, "test").unwrap();

        let rec = store.new_build("app", "b1", vec!["v1".into()]).unwrap();
        assert!(
            store.get("app").unwrap().is_none(),
            "not visible before publish"
        );
        let mut cfg = TemplateConfig::with_defaults("app", "build/1");
        cfg.layers = vec![id.clone()];
        store.publish(rec, cfg.clone()).unwrap();
        // Only v1 was asked for: no default yet.
        assert!(store.get("app").unwrap().is_none());
        let t = store.get_tagged("app", Some("v1")).unwrap().unwrap();
        assert_eq!(t.rootfs, store.layers().path(&id));
        // A second build without tags becomes the default.
        let rec2 = store.new_build("app", "b2", vec![]).unwrap();
        store.publish(rec2, cfg).unwrap();
        assert!(store.get("app").unwrap().is_some());
        let tags: Vec<_> = store
            .tags("app")
            .unwrap()
            .into_iter()
            .map(|t| t.tag)
            .collect();
        assert_eq!(tags, vec!["default", "v1"]);
        assert_eq!(
            store.assign_tags("app", "v1", &["stable".into()]).unwrap(),
            "b1"
        );
        store.remove_tags("app", &["stable".into()]).unwrap();
        assert!(store.remove_tags("app", &["default".into()]).is_err());
        assert_eq!(store.referenced_layers("app"), vec![id]);
        // An unfinished build whose process is gone reads as an error.
        store.new_build("app", "b3", vec![]).unwrap();
        let r = store.build_record("app", "b3", false).unwrap().unwrap();
        assert_eq!(r.status, BuildStatus::Error);
        store
            .append_log(
                "app",
                "b3",
                &[LogEntry {
                    timestamp_ms: 1,
                    level: "info".into(),
                    message: "hi".into(),
                    step: Some("1".into()),
                }],
            )
            .unwrap();
        assert_eq!(store.read_log("app", "b3").unwrap().len(), 1);
        fsutil::remove_tree(&state).unwrap();
    }
}
