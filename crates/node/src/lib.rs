//! cubicle-node: the sandboxes of one host — templates, create/kill/list, reconciliation
//! after a crash, and end-time enforcement.
//!
//! ```no_run
//! # async fn demo() -> cubicle_node::Result<()> {
//! use cubicle_node::{CreateRequest, Node, NodeConfig};
//! let envd = cubicle_node::config::find_envd_binary(None)?;
//! let node = Node::open(NodeConfig::new("/var/lib/cubicle", envd)).await?;
//! let sb = node.create(CreateRequest { template: "tiny".into(), ..Default::default() }).await?;
//! node.kill(&sb.id).await?;
//! # Ok(()) }
//! ```

pub mod bench;
pub mod build;
pub mod config;
pub mod envd_client;
pub mod error;
pub mod held_netns;
pub mod host;
pub mod host_slots;
pub mod ids;
pub mod init_log;
pub mod linux;
mod node;
mod pool;
pub mod procfs;
pub mod ready;
mod reaper;
pub mod reconcile;
pub mod runtime;
pub mod sandbox;
pub mod slots;
pub mod snapshot;
pub mod traces;
pub mod volume;
pub mod writeback;

pub use config::{NetworkOptions, NodeConfig, default_state_dir};
pub use cubicle_egress::policy as network_policy;
pub use cubicle_egress::{NetEvent, NetworkPolicy, SecretSource, allow_list, check_ca_pem};
pub use cubicle_objstore as objstore;
pub use cubicle_runtime::SandboxId;
pub use cubicle_template as template;
pub use cubicle_template::fsutil;
pub use envd_client::{EnvdClient, ProcessEnd, ProcessEvent, ProcessSpec};
pub use error::{Error, Result};
pub use node::{
    BlobRef, CHECKPOINT_DIR, MoveReport, Mover, Node, ObjectStoreConfig, OwnerRecord, PauseReport,
    PauseRequest, PausedManifest, PublishedCopies, ResumeOutcome, SnapshotManifest, SnapshotReport,
    SnapshotRequest, TakeoverReport, TemplateManifest, identity_of, layers_in_use_on_disk,
    records_on_disk, sandboxes_using_template,
};
pub use pool::shell::SHELL_POOL;
pub use pool::{PoolStats, parse_pool_spec};
pub use sandbox::{
    CreateRequest, DeathReason, InitPidfd, Lifecycle, PauseMode, SandboxInfo, SandboxRecord,
    SandboxState, VolumeMount,
};
pub use snapshot::SnapshotRecord;

impl Node {
    /// Open the node with the Linux runtime (`cubicle-runtime`): see
    /// [`Node::open_with_runtime`].
    ///
    /// Fails at once when another process uses the state directory (unless
    /// [`NodeConfig::wait_for_lock`]), and when the slot range overlaps another node's on
    /// this host (unless [`NodeConfig::any_free_slots`]; see [`host_slots`]).
    pub async fn open(mut config: NodeConfig) -> Result<Node> {
        // Lock first: runtime init mounts the state's storage.
        let lock = Node::lock_state_dir(&config.state_dir, config.wait_for_lock).await?;
        let c = config.clone();
        let runtime = tokio::task::spawn_blocking(move || linux::LinuxRuntime::init(&c))
            .await
            .map_err(|e| Error::Runtime(format!("runtime init task: {e}")))??;
        let limit = runtime::SandboxRuntime::max_slots(&runtime);
        if config.first_slot >= limit {
            // (else the node would start with no slot at all, and every create would
            // answer "all 0 sandbox slots are in use")
            runtime::SandboxRuntime::release_storage(&runtime);
            return Err(Error::InvalidRequest(format!(
                "first slot {} is past this host's last sandbox slot, {} (the sandbox network's address pool has room for {limit}): choose a first slot below {}",
                config.first_slot,
                limit.saturating_sub(1),
                limit.saturating_sub(config.max_sandboxes.min(limit))
            )));
        }
        let wanted = config.first_slot
            ..config
                .first_slot
                .saturating_add(config.max_sandboxes)
                .min(limit);
        let (dir, any_free) = (config.state_dir.clone(), config.any_free_slots);
        let lease = tokio::task::spawn_blocking(move || {
            host_slots::lease(
                std::path::Path::new(host_slots::REGISTRY),
                &dir,
                wanted,
                any_free,
                limit,
            )
        })
        .await
        .map_err(|e| Error::Runtime(format!("slot registration task: {e}")))
        .and_then(|r| r);
        let lease = match lease {
            Ok(l) => l,
            Err(e) => {
                // No node after all: the quota filesystem the runtime mounted goes too.
                runtime::SandboxRuntime::release_storage(&runtime);
                return Err(e);
            }
        };
        if lease.range().start != config.first_slot {
            tracing::info!(
                "slots {}.. are another node's: this node uses {:?}",
                config.first_slot,
                lease.range()
            );
            config.first_slot = lease.range().start;
        }
        if let Err(e) = runtime.serve_slots(lease.range()) {
            tracing::warn!("sandboxes of this node will have no DNS and no domain rules: {e}");
        }
        let runtime = std::sync::Arc::new(runtime);
        let node = Node::open_locked(config, runtime.clone(), lock, Some(lease)).await;
        if node.is_err() {
            runtime::SandboxRuntime::release_storage(runtime.as_ref());
        }
        node
    }
}
