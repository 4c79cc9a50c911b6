//! The router's view of sandboxes ([`cubicle_router::SandboxResolver`]): only sandboxes
//! created through this API and still running on the node. A request to a running
//! sandbox is resolved from memory (the node's table, or a replica's cache of its nodes,
//! and the control plane's route map), so the data plane's hot path does no I/O. Only a
//! miss looks further: a replica of a cluster reads, from the database, sandboxes created
//! through the other replicas, and asks a sandbox's owner when its cache does not show it
//! running ([`SandboxResolver::recheck`]): another replica's create, resume or fork
//! outruns this one's polls.

use std::sync::Arc;

use cubicle_node::SandboxState;
use cubicle_router::{SandboxResolver, SandboxTarget, WakeFuture};

use crate::service::ControlPlane;

/// Resolves sandbox ids for the data plane.
pub struct ApiResolver {
    cp: Arc<ControlPlane>,
}

impl ApiResolver {
    /// Over a control plane.
    pub fn new(cp: Arc<ControlPlane>) -> Self {
        ApiResolver { cp }
    }

    fn target(&self, id: &str, traffic: Option<String>) -> Option<SandboxTarget> {
        let info = self.cp.backend().peek(id).ok()?;
        // Not while it is being paused, snapshotted or rolled back: its connections are
        // being closed (a checkpoint cannot hold connections from outside).
        if info.state != SandboxState::Running || info.busy {
            return None;
        }
        let mut t = target_of(&info, traffic);
        t.init_pidfd = info.init_pidfd.as_ref().map(|p| p.fd().clone());
        Some(t)
    }
}

/// The data plane's view of a sandbox (without its init's pidfd: a paused sandbox has
/// no init).
fn target_of(info: &cubicle_node::SandboxInfo, traffic: Option<String>) -> SandboxTarget {
    SandboxTarget {
        id: info.id.to_string(),
        envd_socket: info.envd_socket.clone(),
        init_pidfd: None,
        envd_access_token: Some(info.access_token.clone()),
        traffic_access_token: traffic,
        mask_request_host: info.mask_request_host.clone(),
    }
}

impl SandboxResolver for ApiResolver {
    fn resolve(&self, id: &str) -> Option<SandboxTarget> {
        let traffic = self.cp.route(id)?;
        self.target(id, traffic)
    }

    fn running(&self) -> Vec<SandboxTarget> {
        self.cp
            .routes()
            .into_iter()
            .filter_map(|(id, traffic)| self.target(&id, traffic))
            .collect()
    }

    fn take_envd_conn(&self, id: &str) -> Option<std::os::unix::net::UnixStream> {
        self.cp.backend().take_envd_conn(id)
    }

    fn resumable(&self, id: &str) -> Option<SandboxTarget> {
        let traffic = self.cp.route(id)?;
        let info = self.cp.backend().peek(id).ok()?;
        let paused = matches!(info.state, SandboxState::Paused | SandboxState::Pausing)
            || (info.state == SandboxState::Running && info.busy);
        if !paused || !info.lifecycle.auto_resume {
            return None;
        }
        Some(target_of(&info, traffic))
    }

    fn recheck(&self, id: &str) -> WakeFuture {
        let (cp, id) = (self.cp.clone(), id.to_string());
        Box::pin(async move {
            // One host's memory is the node's own: nothing to look at again.
            if !cp.is_shared() {
                return None;
            }
            let traffic = cp.route(&id)?;
            // Reads the owner's view into the replica's cache, which `target` then uses.
            cp.backend().current(&id).await.ok()?;
            ApiResolver { cp: cp.clone() }.target(&id, traffic)
        })
    }

    fn wake(&self, id: &str) -> WakeFuture {
        let (cp, id) = (self.cp.clone(), id.to_string());
        Box::pin(async move {
            // A pause in progress finishes first; then resume (once: concurrent requests
            // find it running, or busy resuming, and wait for that).
            for _ in 0..200 {
                match cp.backend().peek(&id) {
                    Ok(info) if info.state == SandboxState::Running && !info.busy => break,
                    Ok(info) if info.busy => {
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await
                    }
                    Ok(info) if info.state == SandboxState::Paused => {
                        if cp.auto_resume(&id).await.is_none() {
                            // Someone else may be resuming it: look again.
                            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        }
                    }
                    _ => return None,
                }
            }
            let traffic = cp.route(&id)?;
            ApiResolver { cp: cp.clone() }.target(&id, traffic)
        })
    }
}
