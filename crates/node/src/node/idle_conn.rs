//! One idle connection to each new sandbox's envd, kept between the node's requests and
//! the data plane's first one. Making a sandbox ends with envd's `/health` (the ready
//! check) and, when envd was not born knowing all of it, `/init`; the client's first
//! command follows. Each of those on its own connection costs a path walk to the socket,
//! a socket, envd's accept and a task on both sides — for a pooled sandbox, inside the
//! claim. So the `/health` connection stays open: an `/init` goes over it
//! ([`Inner::init_envd`]), and the data plane's connector
//! ([`crate::Node::take_envd_conn`]) adopts it for the sandbox's first request.
//!
//! The connection lives in the sandbox's [`Live`](super::inner::Live) entry, so it goes
//! with the sandbox. A pooled sandbox keeps its own until claimed; a claimed or
//! cold-created one for [`IDLE_CONN_TTL`] (a sandbox nobody talks to must not hold a
//! descriptor on each side: thousands of idle sandboxes are the point). A checkpoint
//! drops it first, as it closes the data plane's (CRIU cannot dump a connection to the
//! outside).

use std::time::{Duration, Instant};

use crate::envd_client::{EnvdClient, IdleConn, InitRequest};
use crate::node::inner::Inner;

/// How long a created sandbox keeps its idle connection for the data plane.
pub(crate) const IDLE_CONN_TTL: Duration = Duration::from_secs(30);

/// A kept connection, and until when (`None`: a pooled sandbox's, kept until claimed).
pub(crate) struct KeptConn {
    conn: IdleConn,
    until: Option<Instant>,
}

impl Inner {
    /// Keeps `conn` as sandbox `id`'s idle connection to envd (replacing any other), for
    /// `ttl` or, with `None`, until taken. Expired ones of other sandboxes go too, at
    /// most once a second.
    pub(crate) fn keep_envd_conn(&self, id: &str, conn: Option<IdleConn>, ttl: Option<Duration>) {
        let now = Instant::now();
        let mut st = self.lock();
        if let Some(live) = st.live_unlisted().get_mut(id) {
            live.envd_conn = conn.map(|conn| KeptConn {
                conn,
                until: ttl.map(|t| now + t),
            });
        }
        let mut last = self
            .idle_conn_sweep
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if last.is_none_or(|l| now.duration_since(l) >= Duration::from_secs(1)) {
            *last = Some(now);
            for live in st.live_unlisted().values_mut() {
                if live
                    .envd_conn
                    .as_ref()
                    .is_some_and(|k| k.until.is_some_and(|u| u <= now))
                {
                    live.envd_conn = None;
                }
            }
        }
    }

    /// Sends sandbox `record`'s envd `init`, if any, over its kept connection (with the
    /// token envd was born with), and keeps that connection again for `ttl` (see
    /// [`Inner::keep_envd_conn`]); without an `init`, envd is not woken.
    pub(crate) async fn init_envd(
        &self,
        record: &crate::sandbox::SandboxRecord,
        init: Option<InitRequest>,
        ttl: Option<Duration>,
    ) -> crate::error::Result<()> {
        let conn = self.take_envd_conn(&record.id);
        let conn = match init {
            None => conn,
            Some(init) => {
                EnvdClient::new(
                    self.envd_socket(&record.id),
                    Some(record.access_token.clone()),
                )
                .init_on(conn, &init)
                .await?
            }
        };
        self.keep_envd_conn(&record.id, conn, ttl);
        Ok(())
    }

    /// Takes sandbox `id`'s idle connection to envd, if it has one.
    pub(crate) fn take_envd_conn(&self, id: &str) -> Option<IdleConn> {
        let mut st = self.lock();
        let kept = st.live_unlisted().get_mut(id)?.envd_conn.take()?;
        kept.until
            .is_none_or(|u| u > Instant::now())
            .then_some(kept.conn)
    }
}
