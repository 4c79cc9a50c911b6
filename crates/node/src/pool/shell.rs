//! Shells: sandboxes made before anyone asked for one, of no template yet
//! (`cubicle_runtime::SandboxSpec::shell`). A shell has everything of a sandbox that
//! does not depend on its template (slot and uid range, directory and disk quota, cgroup,
//! namespaces, veth and address, `/proc`, `/sys`, `/dev`, `/run`, envd started and
//! answering) and is kept, like a pooled sandbox, in the warm pool under the name
//! [`SHELL_POOL`] (`cubicle serve --shells N`). A create that no pooled sandbox of its
//! template serves claims a shell before it goes cold: the runtime gives the shell the
//! template's root under its running envd (`SandboxRuntime::attach_root`: the overlay,
//! its files, binds and volumes), then the claim goes on as a pooled sandbox's does
//! (limits, CPU weight, network policy, `/init`). What a cold create spends on
//! namespaces, cgroup, veth, pseudo filesystems and envd's start is then spent ahead.
//!
//! Who may claim one: what may claim a pooled sandbox (no caller-chosen id, internet on
//! or refused everywhere by its policy, the shells' disk quota, which is the built-in
//! templates' default), for a template
//! without a start command (a cold create runs that). The shell's record becomes the
//! template's (name, layers, default user and workdir) when it is claimed.

use std::sync::Arc;
use std::time::Instant;

use crate::node::create::CreatePlan;
use crate::node::inner::{Inner, now_ms};
use crate::sandbox::{CreateRequest, DeathReason, SandboxInfo, SandboxState};
use crate::template::{Template, TemplateConfig};

/// The shells' name in the pool (`NodeConfig::pool`, `GET /cubicle/pool`): not a
/// template name a create can ask for.
pub const SHELL_POOL: &str = "(shell)";

/// Whether `t` is the shells' template value ([`shell_template`]).
pub(crate) fn is_shell(t: &Template) -> bool {
    t.config.name == SHELL_POOL
}

/// What shells are made from: no layer, the built-in templates' limits and user.
pub(crate) fn shell_template() -> Template {
    Template {
        dir: std::path::PathBuf::new(),
        rootfs: "/".into(),
        layers: Vec::new(),
        config: TemplateConfig::with_defaults(SHELL_POOL, "shell"),
        binds: Vec::new(),
    }
}

/// Whether a shell (made from `shell`) may serve `req` for `template` with disk quota
/// `disk_mb`: what a pooled sandbox of `shell` could serve, for a template with neither a
/// start command nor binds of its own.
fn claimable(shell: &Template, template: &Template, req: &CreateRequest, disk_mb: u64) -> bool {
    super::claimable(shell, req, disk_mb)
        && !super::has_start(template)
        && template.binds.is_empty()
}

impl Inner {
    /// Serves `req` from a shell if one is ready and may ([`claimable`]); `None`: create
    /// it otherwise. A shell that fails its claim is removed (the create goes on without).
    pub(crate) async fn try_claim_shell(
        self: &Arc<Self>,
        req: &CreateRequest,
        plan: &CreatePlan,
    ) -> Option<crate::error::Result<SandboxInfo>> {
        let template = &plan.template;
        let configured = self.config.pool.get(SHELL_POOL).copied()?;
        let shell = shell_template();
        if !claimable(&shell, template, req, plan.limits.2) {
            return None;
        }
        let _under_way = self.pool.claiming();
        let t0 = Instant::now();
        let (record, born, init) = loop {
            let id = {
                let mut ps = self.pool.lock();
                match ps.take(SHELL_POOL, false) {
                    Some(id) => id,
                    None => {
                        ps.missed(SHELL_POOL, configured, Instant::now());
                        drop(ps);
                        self.pool.wake.notify_one();
                        return None;
                    }
                }
            };
            let mut st = self.lock();
            if let Err(e) = st.check_volumes_usable(&req.volumes) {
                drop(st);
                self.pool.lock().put_back(SHELL_POOL, id);
                return Some(Err(e));
            }
            let Some(live) = st.live_mut().get_mut(&id) else {
                continue;
            };
            if live.record.state != SandboxState::Running {
                continue;
            }
            let init = live.init.clone();
            // Born without an environment (`born_init`: none): the claim's `/init` tells it.
            let born = crate::node::inner::born_init(&live.record);
            let r = &mut live.record;
            let c = &template.config;
            r.template = c.name.clone();
            r.layers = c.layers.clone();
            r.default_user = c.default_user.clone();
            r.default_workdir = c.default_workdir.clone();
            super::claim_record(r, req, plan, now_ms());
            break (live.record.clone(), born, init);
        };
        self.pool.wake.notify_one();
        let id = record.id.clone();
        let claimed = self
            .complete_claim(
                &record,
                born,
                init,
                plan,
                (shell.config.memory_mb, shell.config.cpus),
                Some(template),
            )
            .await;
        if let Err(e) = claimed {
            tracing::warn!(sandbox = %id, "shell failed its claim: {e}; creating cold");
            self.clone().finish(&id, DeathReason::Exited, false).await;
            return None;
        }
        Some(Ok(self.claimed_info(&record, t0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(start: Option<&str>) -> Template {
        let mut t = shell_template();
        t.config.name = "tiny".into();
        t.config.start_command = start.map(String::from);
        t
    }

    #[test]
    fn shells_serve_plain_creates_of_templates_without_a_start_command() {
        let req = CreateRequest {
            internet: true,
            ..Default::default()
        };
        let shell = shell_template();
        let disk = shell.config.disk_mb;
        assert!(claimable(&shell, &template(None), &req, disk));
        assert!(!claimable(&shell, &template(Some("serve")), &req, disk));
        assert!(!claimable(&shell, &template(None), &req, disk + 1));
        // No network at all (the node's own request) is made cold; internet off by a
        // policy that refuses everything (the API's `allow_internet_access: false`)
        // takes a shell and that policy; an allow list keeps internet on.
        let mut offline = CreateRequest {
            internet: false,
            ..Default::default()
        };
        assert!(!claimable(&shell, &template(None), &offline, disk));
        offline.network.deny_out = vec!["0.0.0.0/0".parse().unwrap()];
        assert!(claimable(&shell, &template(None), &offline, disk));
        offline.network.deny_out = vec!["10.0.0.0/8".parse().unwrap()];
        assert!(!claimable(&shell, &template(None), &offline, disk));
        offline.network.deny_out = vec!["0.0.0.0/0".parse().unwrap()];
        offline.network.allow_out = vec!["1.1.1.1".parse().unwrap()];
        assert!(!claimable(&shell, &template(None), &offline, disk));
        offline.network.allow_out.clear();
        offline.network.learn = true;
        assert!(!claimable(&shell, &template(None), &offline, disk));
        let named = CreateRequest {
            id: Some("mine".into()),
            internet: true,
            ..Default::default()
        };
        assert!(!claimable(&shell, &template(None), &named, disk));
        assert!(is_shell(&shell_template()) && !is_shell(&template(None)));
    }
}
