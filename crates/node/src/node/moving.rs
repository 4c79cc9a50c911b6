//! Moving state between nodes through the object store (issue 19's "moving state";
//! `docs/cluster.md`): templates, snapshots and paused sandboxes pushed by one node and
//! pulled by another, so that a template built on one node is used on all, a snapshot
//! taken on one is a template everywhere, and a paused sandbox resumes on another node
//! with its memory.
//!
//! In the bucket (`cubicle_objstore`): each layer, snapshot or paused sandbox is one tar
//! blob (`cubicle_template::pack`, read back by the same unpacker OCI layers go through),
//! named by its SHA-256; a manifest names the blobs:
//!
//! - `templates/<name>.json`: the template's config and one blob per layer (layer ids
//!   are content-derived, so a layer already in the bucket is not packed again);
//! - `snapshots/<id>.json`: the snapshot's record and one blob of its data (the
//!   copy-on-write copy of the sandbox's directory: writable layer, work directory,
//!   CRIU images and the staging tmpfs archive), owners as they are (a restore on
//!   another uid range rewrites them, as it does for every sandbox made from a
//!   snapshot);
//! - `paused/<id>.json`: the paused sandbox's record and one blob of its directory.
//!
//! A pull downloads into the node's scratch directory, checks every blob against its
//! digest before anything is unpacked, unpacks into a staging place (a layer's staging
//! directory, a scratch sandbox directory) and only then makes the result visible (the
//! layer store's rename, the template config, the snapshot record, the sandbox in the
//! live table): a damaged blob or a failed step leaves nothing half-installed.
//!
//! Without an object store ([`Node::set_object_store`] never called) nothing here runs
//! and the node behaves as before.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cubicle_objstore::{Bucket, HashingWriter};
use cubicle_runtime::SandboxId;
use serde::{Deserialize, Serialize};

use super::Node;
use super::inner::{Inner, Live, blocking};
use super::stateful::{Busy, CHECKPOINT_DIR, DISCARDED_CHECKPOINT_PREFIX};
use crate::error::{Error, IoContext, Result};
use crate::sandbox::{PauseMode, SandboxInfo, SandboxRecord, SandboxState};
use crate::snapshot::SnapshotRecord;
use crate::template::{TemplateConfig, TemplateStore, layer};
use crate::{fsutil, ids};

/// Format of the manifests this version writes (and the only one it reads).
const FORMAT: u32 = 1;

/// Scratch directory for archives on their way (`<state>/objstore-tmp`).
const SCRATCH: &str = "objstore-tmp";

/// The object store a node uses, and what it publishes by itself.
#[derive(Debug, Clone)]
pub struct ObjectStoreConfig {
    /// The bucket.
    pub bucket: Bucket,
    /// Push every snapshot (not a fork's hidden one) once it is taken.
    pub publish_snapshots: bool,
    /// Push every sandbox once it is paused, so that another node can take it over
    /// (`cubicle node` does; `handover.rs`).
    pub publish_paused: bool,
}

/// What a push or pull moved.
#[derive(Debug, Clone, Default)]
pub struct MoveReport {
    /// Blobs uploaded or downloaded (those already there are not).
    pub blobs_moved: usize,
    /// Their bytes.
    pub bytes_moved: u64,
    /// Time spent uploading or downloading.
    pub transfer: Duration,
    /// The whole operation (packing or unpacking included).
    pub took: Duration,
}

/// One blob a manifest names.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BlobRef {
    /// SHA-256 of the tar archive, hex.
    pub digest: String,
    /// Its size in bytes.
    pub size: u64,
}

/// `templates/<name>.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateManifest {
    /// [`FORMAT`].
    pub format: u32,
    /// The template's config (`layers`: the layer ids, bottom first).
    pub config: TemplateConfig,
    /// One blob per layer, in the order of `config.layers`.
    pub layers: Vec<BlobRef>,
}

/// `snapshots/<id>.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotManifest {
    /// [`FORMAT`].
    pub format: u32,
    /// The snapshot's record.
    pub record: SnapshotRecord,
    /// Its data.
    pub data: BlobRef,
}

/// `paused/<id>.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PausedManifest {
    /// [`FORMAT`].
    pub format: u32,
    /// The paused sandbox's record on the node that pushed it.
    pub record: SandboxRecord,
    /// Its directory.
    pub data: BlobRef,
}

fn template_key(name: &str) -> String {
    format!("templates/{name}.json")
}
fn snapshot_key(id: &str) -> String {
    format!("snapshots/{id}.json")
}
fn paused_key(id: &str) -> String {
    format!("paused/{id}.json")
}

fn check_format(format: u32, key: &str) -> Result<()> {
    if format == FORMAT {
        return Ok(());
    }
    Err(Error::Unsupported(format!(
        "{key} in the object store has format {format}; this node reads format {FORMAT} (upgrade it)"
    )))
}

/// Top-level entries of a sandbox's (or snapshot's) directory that do not move: the
/// socket directory and FIFO (made again at every start), used-up checkpoints.
fn skip_in_sandbox_dir(name: &str) -> bool {
    name == "ctl"
        || name == "init.pipe"
        || name.starts_with(DISCARDED_CHECKPOINT_PREFIX)
        || name.starts_with(".")
}

/// A scratch file removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Packs, uploads, downloads and unpacks for one bucket, with a scratch directory for
/// the archives on their way. The node uses one; `cubicle template push|pull` uses one
/// on a state directory without a running node.
#[derive(Debug, Clone)]
pub struct Mover {
    bucket: Bucket,
    scratch_dir: PathBuf,
}

impl Mover {
    /// A mover for `bucket` whose scratch files go to `<state_dir>/objstore-tmp`.
    pub fn new(bucket: Bucket, state_dir: &std::path::Path) -> Self {
        Mover {
            bucket,
            scratch_dir: state_dir.join(SCRATCH),
        }
    }

    /// The bucket.
    pub fn bucket(&self) -> &Bucket {
        &self.bucket
    }

    fn scratch(&self, what: &str) -> Result<Scratch> {
        let dir = &self.scratch_dir;
        std::fs::create_dir_all(dir).ctx("mkdir", dir)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).ctx("chmod", dir)?;
        Ok(Scratch(
            dir.join(format!("{what}-{}.tar", ids::random_suffix(12))),
        ))
    }

    /// Packs `dir` into a new scratch file; returns it with its blob reference.
    async fn pack(
        &self,
        dir: PathBuf,
        what: &str,
        skip: fn(&str) -> bool,
    ) -> Result<(Scratch, BlobRef)> {
        let file = self.scratch(what)?;
        let path = file.0.clone();
        let blob = blocking(move || {
            let f = std::fs::File::create_new(&path).ctx("create", &path)?;
            let w = HashingWriter::new(std::io::BufWriter::with_capacity(1 << 20, f));
            let (w, _) = cubicle_template::pack::pack_tree(&dir, w, &skip)?;
            let (digest, size, mut buf) = w.finish();
            use std::io::Write;
            buf.flush().ctx("write", &path)?;
            Ok(BlobRef { digest, size })
        })
        .await?;
        Ok((file, blob))
    }

    /// Uploads `file` as `blob` unless the bucket has it; adds to `report`.
    async fn upload(&self, file: &Scratch, blob: &BlobRef, report: &mut MoveReport) -> Result<()> {
        let t = Instant::now();
        if self.bucket.put_blob(&blob.digest, &file.0).await? {
            report.blobs_moved += 1;
            report.bytes_moved += blob.size;
        }
        report.transfer += t.elapsed();
        Ok(())
    }

    /// Downloads `blob` into a scratch file, verified against its digest.
    async fn download(
        &self,
        blob: &BlobRef,
        what: &str,
        report: &mut MoveReport,
    ) -> Result<Scratch> {
        let file = self.scratch(what)?;
        let t = Instant::now();
        let n = self.bucket.get_blob(&blob.digest, &file.0).await?;
        report.transfer += t.elapsed();
        report.blobs_moved += 1;
        report.bytes_moved += n;
        Ok(file)
    }

    /// Publishes template `name` of `store`: its config and every layer the bucket lacks.
    pub async fn push_template(&self, store: &TemplateStore, name: &str) -> Result<MoveReport> {
        let t0 = Instant::now();
        let bucket = &self.bucket;
        // (a template of an older store is fitted at its first `get`: a walk of its files)
        let (s2, n2) = (store.clone(), name.to_string());
        let template = blocking(move || Ok(s2.get(&n2)?))
            .await?
            .ok_or_else(|| crate::template::Error::TemplateNotFound(name.into()))?;
        let mut config = template.config.clone();
        if config.layers.is_empty() {
            // The older one-directory layout: its root filesystem is its only layer, named
            // as the layer store names it when it adopts one.
            config.layers = vec![layer::digest_of(&[
                b"legacy",
                name.as_bytes(),
                config.builder.as_bytes(),
                &config.built_at.to_le_bytes(),
            ])];
        }
        let published: Option<TemplateManifest> = bucket.get_json(&template_key(name)).await?;
        let mut report = MoveReport::default();
        let mut blobs = Vec::new();
        for (id, path) in config.layers.iter().zip(template.lowers()) {
            // Layer ids say what a layer holds: one the bucket already has is not packed.
            if let Some(m) = &published
                && let Some(i) = m.config.layers.iter().position(|l| l == id)
                && let Some(b) = m.layers.get(i)
                && bucket.exists(&Bucket::blob_key(&b.digest)).await?
            {
                blobs.push(b.clone());
                continue;
            }
            let (file, blob) = self.pack(path, "layer", |_| false).await?;
            self.upload(&file, &blob, &mut report).await?;
            blobs.push(blob);
        }
        let manifest = TemplateManifest {
            format: FORMAT,
            config,
            layers: blobs,
        };
        bucket.put_json(&template_key(name), &manifest).await?;
        report.took = t0.elapsed();
        tracing::info!(template = %name, bucket = %bucket.url(), blobs = report.blobs_moved,
            bytes = report.bytes_moved, took_ms = report.took.as_millis() as u64, "template pushed");
        Ok(report)
    }

    /// Fetches template `name` into `store` (the layers it lacks) and installs it;
    /// `Ok(None)` when the bucket has no template of that name.
    pub async fn pull_template(
        &self,
        store: &TemplateStore,
        name: &str,
    ) -> Result<Option<MoveReport>> {
        let t0 = Instant::now();
        crate::template::validate_name(name)?;
        let bucket = &self.bucket;
        let key = template_key(name);
        let Some(m) = bucket.get_json::<TemplateManifest>(&key).await? else {
            return Ok(None);
        };
        check_format(m.format, &key)?;
        if m.config.name != name
            || m.config.layers.len() != m.layers.len()
            || m.config.layers.iter().any(|id| !layer::valid_id(id))
        {
            return Err(Error::InvalidRequest(format!(
                "{key} in the object store does not describe template '{name}' consistently"
            )));
        }
        let mut report = MoveReport::default();
        for (id, blob) in m.config.layers.iter().zip(&m.layers) {
            if store.layers().contains(id) {
                continue;
            }
            let file = self.download(blob, "layer", &mut report).await?;
            let (store, id, source) = (
                store.clone(),
                id.clone(),
                format!("object store {} sha256:{}", bucket.url(), blob.digest),
            );
            blocking(move || {
                let staging = store.layers().staging()?;
                let f = std::fs::File::open(&file.0).ctx("open", &file.0)?;
                cubicle_template::unpack::unpack_layer(std::io::BufReader::new(f), staging.path())?;
                store.layers().store(staging, &id, &source)?;
                Ok(())
            })
            .await?;
        }
        let store = store.clone();
        let config = m.config.clone();
        blocking(move || Ok(store.install(&config)?)).await?;
        report.took = t0.elapsed();
        tracing::info!(template = %name, bucket = %bucket.url(), blobs = report.blobs_moved,
            bytes = report.bytes_moved, took_ms = report.took.as_millis() as u64, "template pulled");
        Ok(Some(report))
    }
}

impl Inner {
    pub(crate) fn object_store(&self) -> Option<&ObjectStoreConfig> {
        self.object_store.get()
    }

    fn mover(&self) -> Result<Mover> {
        self.object_store()
            .map(|c| Mover::new(c.bucket.clone(), &self.config.state_dir))
            .ok_or_else(|| {
                Error::Unsupported(
                    "this node has no object store (start it with --object-store URL)".into(),
                )
            })
    }

    pub(crate) async fn push_template(&self, name: &str) -> Result<MoveReport> {
        self.mover()?.push_template(&self.templates, name).await
    }

    pub(crate) async fn pull_template(&self, name: &str) -> Result<Option<MoveReport>> {
        self.mover()?.pull_template(&self.templates, name).await
    }

    /// Makes sure template `name` with `layers` (empty: any build) is here, pulling it
    /// when it is not and the bucket has it.
    async fn ensure_template_here(&self, name: &str, layers: &[String]) -> Result<()> {
        let here = match self.templates.get(name)? {
            Some(_) if layers.is_empty() => true,
            Some(t) => {
                t.config.layers == layers
                    || layers.iter().all(|id| self.templates.layers().contains(id))
            }
            None => false,
        };
        if here {
            return Ok(());
        }
        match self.pull_template(name).await? {
            Some(_) => Ok(()),
            None => Err(Error::NotPublished(format!(
                "template '{name}' is neither on this node nor in the object store"
            ))),
        }
    }

    /// Pushes template `name` unless the bucket has it.
    async fn ensure_template_published(&self, bucket: &Bucket, name: &str) -> Result<()> {
        if bucket.exists(&template_key(name)).await? {
            return Ok(());
        }
        self.push_template(name).await.map(drop)
    }

    // ---- snapshots ----

    pub(crate) async fn push_snapshot(&self, name: &str) -> Result<MoveReport> {
        let t0 = Instant::now();
        let mover = self.mover()?;
        let bucket = mover.bucket().clone();
        let snap = self
            .snapshots
            .find(name)
            .ok_or_else(|| Error::SnapshotNotFound(name.into()))?;
        self.ensure_template_published(&bucket, &snap.base_template)
            .await?;
        let dir = self.runtime.snapshot_dir(&snap.storage_name())?;
        let mut report = MoveReport::default();
        let (file, blob) = mover.pack(dir, "snapshot", skip_in_sandbox_dir).await?;
        mover.upload(&file, &blob, &mut report).await?;
        let manifest = SnapshotManifest {
            format: FORMAT,
            record: snap.clone(),
            data: blob,
        };
        bucket.put_json(&snapshot_key(&snap.id), &manifest).await?;
        report.took = t0.elapsed();
        tracing::info!(snapshot = %snap.id, bucket = %bucket.url(), bytes = report.bytes_moved,
            took_ms = report.took.as_millis() as u64, "snapshot pushed");
        Ok(report)
    }

    /// Pulls snapshot `id` (and its template when missing); `Ok(None)` when the bucket
    /// has none of that id.
    pub(crate) async fn pull_snapshot(
        &self,
        id: &str,
    ) -> Result<Option<(SnapshotRecord, MoveReport)>> {
        let t0 = Instant::now();
        if !SandboxId::is_valid(id) {
            return Ok(None);
        }
        let mover = self.mover()?;
        let bucket = mover.bucket().clone();
        let key = snapshot_key(id);
        let Some(m) = bucket.get_json::<SnapshotManifest>(&key).await? else {
            return Ok(None);
        };
        check_format(m.format, &key)?;
        if m.record.id != id {
            return Err(Error::InvalidRequest(format!(
                "{key} in the object store holds snapshot '{}'",
                m.record.id
            )));
        }
        if let Some(s) = self.snapshots.get(id) {
            return Ok(Some((s, MoveReport::default())));
        }
        self.ensure_template_here(&m.record.base_template, &m.record.layers)
            .await?;
        let mut report = MoveReport::default();
        let file = mover.download(&m.data, "snapshot", &mut report).await?;
        // Unpacked into a scratch sandbox directory (quota, reconciled away after a
        // crash), then sealed as the snapshot and the scratch removed.
        let scratch_id = ids::new_sandbox_id();
        let dir = self.sandbox_dir(&scratch_id);
        let (rt, sid, d2, disk) = (
            self.runtime.clone(),
            scratch_id.to_string(),
            dir.clone(),
            m.record.disk_mb,
        );
        let name = m.record.storage_name();
        let res = blocking(move || {
            rt.create_dir(&sid, &d2, disk)?;
            let r = (|| {
                let f = std::fs::File::open(&file.0).ctx("open", &file.0)?;
                cubicle_template::unpack::unpack_layer(std::io::BufReader::new(f), &d2)?;
                rt.seal_snapshot(&sid, &name)
            })();
            let _ = rt.remove_dir(&sid, &d2);
            r
        })
        .await;
        if let Err(e) = res {
            let (rt, name) = (self.runtime.clone(), m.record.storage_name());
            let _ = blocking(move || rt.remove_snapshot(&name)).await;
            return Err(e);
        }
        if let Err(e) = self.snapshots.put(&m.record) {
            let (rt, name) = (self.runtime.clone(), m.record.storage_name());
            let _ = blocking(move || rt.remove_snapshot(&name)).await;
            return Err(e);
        }
        report.took = t0.elapsed();
        tracing::info!(snapshot = %id, bucket = %bucket.url(), bytes = report.bytes_moved,
            took_ms = report.took.as_millis() as u64, "snapshot pulled");
        Ok(Some((m.record, report)))
    }

    // ---- paused sandboxes ----

    pub(crate) async fn push_paused(&self, id: &str) -> Result<MoveReport> {
        let t0 = Instant::now();
        let mover = self.mover()?;
        let bucket = mover.bucket().clone();
        let record = self.begin(id, Busy::Moving, &[SandboxState::Paused])?;
        let packed = async {
            self.ensure_template_published(&bucket, record.rootfs_template())
                .await?;
            mover
                .pack(self.sandbox_dir(id), "paused", skip_in_sandbox_dir)
                .await
        }
        .await;
        let _ = self.end(id, None);
        let (file, blob) = packed?;
        let mut report = MoveReport::default();
        mover.upload(&file, &blob, &mut report).await?;
        let manifest = PausedManifest {
            format: FORMAT,
            record,
            data: blob,
        };
        bucket.put_json(&paused_key(id), &manifest).await?;
        report.took = t0.elapsed();
        tracing::info!(sandbox = %id, bucket = %bucket.url(), bytes = report.bytes_moved,
            took_ms = report.took.as_millis() as u64, "paused sandbox pushed");
        Ok(report)
    }

    /// The info of paused sandbox `id` as its manifest in the bucket records it.
    pub(crate) async fn published_info(&self, id: &str) -> Result<SandboxInfo> {
        let bucket = self.mover()?.bucket().clone();
        SandboxId::parse(id).map_err(|_| Error::SandboxNotFound(id.to_string()))?;
        let key = paused_key(id);
        let m = bucket
            .get_json::<PausedManifest>(&key)
            .await?
            .ok_or_else(|| Error::SandboxNotFound(id.to_string()))?;
        check_format(m.format, &key)?;
        if m.record.id.as_str() != id || m.record.state != SandboxState::Paused {
            return Err(Error::SandboxNotFound(id.to_string()));
        }
        Ok(SandboxInfo::from_record(&m.record, self.envd_socket(id), 0))
    }

    pub(crate) async fn pull_paused(&self, id: &str) -> Result<(SandboxInfo, MoveReport)> {
        let t0 = Instant::now();
        let mover = self.mover()?;
        let bucket = mover.bucket().clone();
        let sid = SandboxId::parse(id).map_err(|e| Error::InvalidRequest(e.to_string()))?;
        let key = paused_key(id);
        let m = bucket
            .get_json::<PausedManifest>(&key)
            .await?
            .ok_or_else(|| {
                Error::NotPublished(format!(
                    "no paused sandbox '{id}' in the object store {}",
                    bucket.url()
                ))
            })?;
        check_format(m.format, &key)?;
        if m.record.id.as_str() != id || m.record.state != SandboxState::Paused {
            return Err(Error::InvalidRequest(format!(
                "{key} in the object store does not hold paused sandbox '{id}'"
            )));
        }
        if !m.record.volumes.is_empty() {
            return Err(Error::Unsupported(format!(
                "sandbox {id} mounts volumes, which do not move between nodes"
            )));
        }
        self.ensure_template_here(m.record.rootfs_template(), &m.record.layers)
            .await?;
        let mut report = MoveReport::default();
        let file = mover.download(&m.data, "paused", &mut report).await?;
        // A slot of this node (its uid range and address), held busy until complete.
        let mut record = m.record.clone();
        {
            let mut st = self.lock();
            if st.live().contains_key(&sid) {
                return Err(Error::Conflict(format!(
                    "sandbox '{id}' is already on this node"
                )));
            }
            let slot = st.slots.allocate().ok_or_else(|| {
                Error::Capacity(format!(
                    "all {} sandbox slots are in use",
                    st.slots.in_use()
                ))
            })?;
            record.slot = slot;
            record.uid_base = st.slots.uid_base(slot);
            record.pid = None;
            record.pid_start_time = None;
            let mut live = Live::new(record.clone());
            live.busy = Some(Busy::Moving);
            st.live_mut().insert(sid.clone(), live);
        }
        let dir = self.sandbox_dir(id);
        let (rt, i2, d2, disk) = (
            self.runtime.clone(),
            id.to_string(),
            dir.clone(),
            record.disk_mb,
        );
        let (old_base, new_base, mode) = (m.record.uid_base, record.uid_base, record.pause_mode);
        let rec2 = record.clone();
        let res = blocking(move || {
            rt.create_dir(&i2, &d2, disk)?;
            let f = std::fs::File::open(&file.0).ctx("open", &file.0)?;
            cubicle_template::unpack::unpack_layer(std::io::BufReader::new(f), &d2)?;
            if mode != Some(PauseMode::Full) && old_base != new_base {
                // A disk-only pause boots again over its writable layer: give it this
                // node's uid range now (a full one's restore rewrites it itself).
                for sub in ["upper", "work"] {
                    let p = d2.join(sub);
                    if p.exists() {
                        cubicle_checkpoint::rebase_owners(
                            &p,
                            old_base,
                            new_base,
                            crate::slots::IDS_PER_SANDBOX,
                        )
                        .map_err(|e| Error::Checkpoint {
                            what: format!("moving the owners of {}", p.display()),
                            source: e,
                        })?;
                    }
                }
            }
            if mode == Some(PauseMode::Full) && !d2.join(CHECKPOINT_DIR).is_dir() {
                return Err(Error::InvalidRequest(format!(
                    "paused sandbox {i2} from the object store has no checkpoint"
                )));
            }
            fsutil::rewrite_json(&d2.join("sandbox.json"), &rec2)?;
            Ok(())
        })
        .await;
        if let Err(e) = res {
            let (rt, i2, d2) = (self.runtime.clone(), id.to_string(), dir.clone());
            let _ = blocking(move || rt.remove_dir(&i2, &d2)).await;
            let mut st = self.lock();
            st.live_mut().remove(&sid);
            st.slots.release(record.slot);
            return Err(e);
        }
        self.end(id, Some(&record))?;
        report.took = t0.elapsed();
        tracing::info!(sandbox = %id, bucket = %bucket.url(), bytes = report.bytes_moved,
            took_ms = report.took.as_millis() as u64, "paused sandbox pulled");
        Ok((
            SandboxInfo::from_record(&record, self.envd_socket(id), 0),
            report,
        ))
    }

    pub(crate) async fn release_moved(&self, id: &str) -> Result<()> {
        let record = self.begin(id, Busy::Moving, &[SandboxState::Paused])?;
        let (rt, i2, dir) = (self.runtime.clone(), id.to_string(), self.sandbox_dir(id));
        // A paused sandbox has no processes, cgroup or network interface: only its
        // directory and slot go. (No runtime teardown: on a shared host the node that
        // took the sandbox over has a cgroup of the same name.)
        if let Err(e) = blocking(move || rt.remove_dir(&i2, &dir)).await {
            let _ = self.end(id, None);
            return Err(e);
        }
        {
            let mut st = self.lock();
            st.live_mut().remove(id);
            st.slots.release(record.slot);
        }
        self.changed.notify_one();
        tracing::info!(sandbox = %id, "paused sandbox released: it moved to another node");
        Ok(())
    }

    /// After a snapshot: push it when the node publishes snapshots (in the background;
    /// a failure is logged, the snapshot stays local).
    pub(crate) fn publish_snapshot(self: &Arc<Self>, snap: &SnapshotRecord) {
        if snap.hidden || !self.object_store().is_some_and(|c| c.publish_snapshots) {
            return;
        }
        let (inner, id) = (self.clone(), snap.id.clone());
        tokio::spawn(async move {
            if let Err(e) = inner.push_snapshot(&id).await {
                tracing::warn!(snapshot = %id, "publishing the snapshot failed: {e}");
            }
        });
    }
}

impl Node {
    /// Use `config`'s object store from now on (once; later calls are ignored): missing
    /// templates and snapshots are looked up there, and the push and pull methods work.
    pub fn set_object_store(&self, config: ObjectStoreConfig) {
        let _ = self.inner.object_store.set(config);
    }

    /// The object store, when one is set.
    pub fn object_store(&self) -> Option<&ObjectStoreConfig> {
        self.inner.object_store()
    }

    /// Publishes template `name` (its config and every layer the bucket lacks).
    pub async fn push_template(&self, name: &str) -> Result<MoveReport> {
        let (inner, name) = (self.inner.clone(), name.to_string());
        spawn(async move { inner.push_template(&name).await }).await
    }

    /// Fetches template `name` (the layers this node lacks) and installs it.
    pub async fn pull_template(&self, name: &str) -> Result<MoveReport> {
        let (inner, name) = (self.inner.clone(), name.to_string());
        spawn(async move {
            inner.pull_template(&name).await?.ok_or_else(|| {
                Error::NotPublished(format!("no template '{name}' in the object store"))
            })
        })
        .await
    }

    /// Removes template `name`'s manifest from the object store (the template was
    /// deleted); `false` without an object store. Its blobs stay (blobs no manifest names
    /// are not collected yet).
    pub async fn unpublish_template(&self, name: &str) -> Result<bool> {
        crate::template::validate_name(name)?;
        let Some(c) = self.object_store() else {
            return Ok(false);
        };
        c.bucket.delete(&template_key(name)).await?;
        Ok(true)
    }

    /// Publishes snapshot `name` (an id or one of its names), and its template when the
    /// bucket lacks it.
    pub async fn push_snapshot(&self, name: &str) -> Result<MoveReport> {
        let (inner, name) = (self.inner.clone(), name.to_string());
        spawn(async move { inner.push_snapshot(&name).await }).await
    }

    /// Fetches snapshot `id` (and its template when missing); sandboxes can then be
    /// created from it. Creates name snapshots this node lacks fetch them by themselves.
    pub async fn pull_snapshot(&self, id: &str) -> Result<(SnapshotRecord, MoveReport)> {
        let (inner, id) = (self.inner.clone(), id.to_string());
        spawn(async move {
            inner.pull_snapshot(&id).await?.ok_or_else(|| {
                Error::NotPublished(format!("no snapshot '{id}' in the object store"))
            })
        })
        .await
    }

    /// Publishes paused sandbox `id` (its record and directory: disk and memory), and
    /// its template when the bucket lacks it. It stays paused here until
    /// [`Node::release_moved`] (once another node took it: one owner at a time).
    pub async fn push_paused(&self, id: &str) -> Result<MoveReport> {
        let (inner, id) = (self.inner.clone(), id.to_string());
        spawn(async move { inner.push_paused(&id).await }).await
    }

    /// Forgets paused sandbox `id` after another node took it over (its directory and
    /// slot are freed; nothing is killed and no death is recorded: it lives on there).
    pub async fn release_moved(&self, id: &str) -> Result<()> {
        let (inner, id) = (self.inner.clone(), id.to_string());
        spawn(async move { inner.release_moved(&id).await }).await
    }

    /// Takes paused sandbox `id` from the object store onto this node (a slot of its
    /// own; same id, token and metadata), paused: [`Node::resume`] brings it back with
    /// its memory.
    pub async fn pull_paused(&self, id: &str) -> Result<(SandboxInfo, MoveReport)> {
        let arriving = Arriving::mark(&self.inner, id);
        let (inner, id) = (self.inner.clone(), id.to_string());
        spawn(async move {
            let _arriving = arriving;
            inner.pull_paused(&id).await
        })
        .await
    }
}

/// Sandbox `id` marked as arriving on this node ([`Inner::arriving`]) while it is pulled
/// from the object store, until it is in the live table (or the pull failed): unmarked
/// when dropped, by the pull that marked it (a concurrent second pull of the same
/// sandbox fails, and leaves the mark to the first).
struct Arriving {
    inner: Arc<Inner>,
    id: Option<String>,
}

impl Arriving {
    fn mark(inner: &Arc<Inner>, id: &str) -> Self {
        let first = inner.arrivals().insert(id.to_string());
        Arriving {
            inner: inner.clone(),
            id: first.then(|| id.to_string()),
        }
    }
}

impl Drop for Arriving {
    fn drop(&mut self) {
        if let Some(id) = &self.id {
            self.inner.arrivals().remove(id);
        }
    }
}

/// Runs `f` in its own task (a caller that goes away never strands half a move).
async fn spawn<T: Send + 'static>(
    f: impl std::future::Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    tokio::spawn(f)
        .await
        .map_err(|e| Error::Runtime(format!("object store task failed: {e}")))?
}
