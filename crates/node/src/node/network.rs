//! A running sandbox's network policy and audit trail, as the node exposes them: live
//! policy replacement (`PUT /sandboxes/{id}/network`) and reading the trail (logs API,
//! `cubicle sandbox netlog`). The policy itself lives in the sandbox's record, so it
//! survives node restarts (re-applied on adoption) and is what a pause or fork carries.

use std::time::Instant;

use crate::error::{Error, Result};
use crate::node::Node;
use crate::node::inner::blocking;
use crate::sandbox::{NetEvent, NetworkPolicy, SandboxState};

impl Node {
    /// Installs where the egress proxy gets the values of `${e2b.secrets.NAME}` in
    /// header rules (the server's secrets store). Without networking: nothing to do.
    pub fn set_secret_source(&self, source: std::sync::Arc<dyn cubicle_egress::SecretSource>) {
        if let Some(eg) = self.inner.runtime.egress() {
            eg.set_secret_source(source);
        }
    }

    /// Checks what only the node can check about a policy before it is used: that its
    /// DNS servers and egress proxy are addresses sandboxes may reach (the proxy's name
    /// must resolve). The errors are the API's 400 messages.
    pub async fn check_network(&self, policy: &NetworkPolicy) -> Result<()> {
        let Some(eg) = self.inner.runtime.egress() else {
            return if policy.needs_network() && !policy.is_default() {
                Err(Error::Runtime(
                    "sandbox networking is unavailable on this node".into(),
                ))
            } else {
                Ok(())
            };
        };
        for ip in policy.dns_servers.iter().flatten() {
            if let Err(d) = eg.guard().check(*ip, None) {
                return Err(Error::InvalidRequest(format!(
                    "network.dnsServers: {ip} is not reachable from sandboxes ({})",
                    d.as_str()
                )));
            }
        }
        if let Some(p) = &policy.egress_proxy {
            let bad =
                |m: String| Error::InvalidRequest(format!("Invalid egress proxy config: {m}"));
            let (host, port) = p.host_port().map_err(|e| bad(e.to_string()))?;
            let addrs = eg
                .resolve(&host)
                .await
                .map_err(|e| bad(format!("{host} does not resolve ({e})")))?;
            if addrs.is_empty() {
                return Err(bad(format!("{host} has no IPv4 address")));
            }
            if !addrs
                .iter()
                .any(|a| eg.guard().check(*a, Some(port)).is_ok())
            {
                let list: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
                return Err(bad(format!(
                    "{host} resolves to {}, which sandboxes may not reach (private, host or reserved)",
                    list.join(", ")
                )));
            }
        }
        Ok(())
    }

    /// Replaces the egress policy of running sandbox `id` (E2B replace semantics: the
    /// new policy is the whole policy). Connections it refuses are cut, others are
    /// kept: direct ones here (`SandboxRuntime::cut_refused`), those the egress proxy
    /// relays by the proxy (told through `set_network`); new ones and new DNS questions
    /// follow the new policy as soon as this returns.
    pub async fn update_network(&self, id: &str, policy: NetworkPolicy) -> Result<()> {
        let t0 = Instant::now();
        let inner = &self.inner;
        let (slot, pid) = {
            let st = inner.lock();
            let live = st
                .live()
                .get(id)
                .filter(|_| !inner.pool.contains(id))
                .ok_or_else(|| Error::SandboxNotFound(id.into()))?;
            if live.record.state != SandboxState::Running || live.kill_requested.is_some() {
                return Err(Error::Conflict(format!(
                    "sandbox '{id}' is not running; its network can only be changed while it runs"
                )));
            }
            (live.record.slot, live.record.pid.unwrap_or(0))
        };
        let rt = inner.runtime.clone();
        let (id2, p2) = (id.to_string(), policy.clone());
        // The cut's own failure is reported once the record says what the kernel has.
        let (attached, cut) = blocking(move || {
            let attached = rt.set_network(&id2, slot, pid, &p2)?;
            Ok((attached, rt.cut_refused(&id2, slot, &p2)))
        })
        .await?;
        let record = {
            let mut st = inner.lock();
            let live = st
                .live_mut()
                .get_mut(id)
                .ok_or_else(|| Error::SandboxNotFound(id.into()))?;
            live.record.network = policy;
            live.record.internet = attached;
            live.record.clone()
        };
        crate::fsutil::rewrite_json(&inner.sandbox_dir(id).join("sandbox.json"), &record)?;
        tracing::info!(sandbox = %id, us = t0.elapsed().as_micros() as u64, "network policy replaced");
        cut
    }

    /// How many connections the egress proxy relays now (`None`: the node has no
    /// egress layer).
    pub fn egress_relayed(&self) -> Option<usize> {
        self.inner.runtime.egress_relayed()
    }

    /// Sandbox `id`'s network audit trail (also after it ended, until its logs are
    /// purged): events numbered above `after`, oldest first, at most `limit`.
    pub async fn network_log(&self, id: &str, after: u64, limit: usize) -> Vec<NetEvent> {
        let rt = self.inner.runtime.clone();
        let id = id.to_string();
        blocking(move || Ok(rt.network_log(&id, after, limit)))
            .await
            .unwrap_or_default()
    }

    /// Deletes sandbox `id`'s network audit trail.
    pub fn forget_network_log(&self, id: &str) {
        self.inner.runtime.forget_network_log(id);
    }
}
