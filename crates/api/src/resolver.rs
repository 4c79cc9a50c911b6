//! The router's view of sandboxes ([`cubicle_router::SandboxResolver`]): only sandboxes
//! created through this API and still running on the node; everything comes from memory
//! (the node's table and the control plane's route map), never from the database, so
//! the data plane's hot path does no I/O.

use std::sync::Arc;

use cubicle_node::SandboxState;
use cubicle_router::{SandboxResolver, SandboxTarget};

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
        if info.state != SandboxState::Running {
            return None;
        }
        Some(SandboxTarget {
            id: info.id.clone(),
            envd_socket: info.envd_socket.clone(),
            init_pidfd: info.init_pidfd.as_ref().map(|p| p.fd().clone()),
            envd_access_token: Some(info.access_token.clone()),
            traffic_access_token: traffic,
            mask_request_host: info.mask_request_host.clone(),
        })
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
}
