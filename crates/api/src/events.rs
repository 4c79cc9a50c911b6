//! Sandbox lifecycle events: E2B's events API (`GET /events/sandboxes[/{id}]`) and the
//! source of webhook deliveries.
//!
//! Every lifecycle change goes through [`Events::emit`] (the control plane's
//! [`crate::ControlPlane::lifecycle`] hook: create, timeout changes, kill and natural
//! ends here; pause and resume from the stateful-sandbox code), which
//! - logs it at `info` (target `cubicle::lifecycle`),
//! - counts it in the metrics,
//! - and hands it to one background task that stores it (`sandbox_events`, kept
//!   [`RETENTION`]) and then passes it to the team's webhooks — one task, so a sandbox's
//!   events are stored and delivered in the order they happened.
//!
//! The event's shape is E2B's (camelCase, `version: "v1"`, `type:
//! "sandbox.lifecycle.<kind>"`, `eventData` with `sandbox_metadata`, `set_timeout` on
//! updates and `execution` on kills and pauses). `sandboxTeamId` is the team's name (a
//! Cubicle team has no uuid); `sandboxExecutionId` is stable for one run of a sandbox
//! (derived from its id and start time) and `sandboxBuildId` from its template.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cubicle_store::{EventQuery, EventRow, SandboxRow, Store, now_ms};
use serde::Serialize;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot};

use crate::error::{ApiError, ApiResult};
use crate::query::{Query, format_time};
use crate::telemetry::Telemetry;
use crate::webhooks::Webhooks;

/// How long events are kept (E2B's default retention).
pub const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// Events per page by default, and at most.
pub const DEFAULT_LIMIT: i64 = 10;
/// Largest `limit`.
pub const MAX_LIMIT: i64 = 100;
/// At most this many queued events are stored in one transaction.
const EVENT_BATCH: usize = 256;
/// How long the writer gathers events after the first before storing them: a burst's
/// creates emit theirs over tens of milliseconds, and each commit cost about as much as
/// the sandbox's own row (docs/bench.md, round 25); a paced create's and kill's events
/// are stored after the request's answer rather than while its client's next request
/// runs. What a reader of `/events` or a webhook waits for, at most.
const EVENT_GATHER: Duration = Duration::from_millis(20);

/// What happened to a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// Created (cold or from a warm pool).
    Created,
    /// Its end time changed (`set_timeout`, refresh, connect).
    Updated,
    /// Paused.
    Paused,
    /// Resumed.
    Resumed,
    /// Gone: killed, timed out, crashed.
    Killed,
}

impl EventKind {
    /// Every kind, in E2B's order.
    pub const ALL: [EventKind; 5] = [
        EventKind::Created,
        EventKind::Killed,
        EventKind::Updated,
        EventKind::Paused,
        EventKind::Resumed,
    ];

    /// The event's `type` (`sandbox.lifecycle.created`, …).
    pub fn type_name(self) -> &'static str {
        match self {
            EventKind::Created => "sandbox.lifecycle.created",
            EventKind::Updated => "sandbox.lifecycle.updated",
            EventKind::Paused => "sandbox.lifecycle.paused",
            EventKind::Resumed => "sandbox.lifecycle.resumed",
            EventKind::Killed => "sandbox.lifecycle.killed",
        }
    }

    /// E2B's older `eventLabel` (still sent).
    fn label(self) -> &'static str {
        match self {
            EventKind::Created => "create",
            EventKind::Updated => "update",
            EventKind::Paused => "pause",
            EventKind::Resumed => "resume",
            EventKind::Killed => "kill",
        }
    }

    /// The kind named by a `type` string.
    pub fn parse(s: &str) -> Option<EventKind> {
        EventKind::ALL.into_iter().find(|k| k.type_name() == s)
    }
}

/// One lifecycle event, as served by the events API and POSTed to webhooks.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxEvent {
    /// Event schema version (`v1`).
    pub version: &'static str,
    /// Unique id (uuid).
    pub id: String,
    /// `sandbox.lifecycle.created|updated|paused|resumed|killed`.
    #[serde(rename = "type")]
    #[schema(example = "sandbox.lifecycle.created")]
    pub kind: String,
    /// Always `lifecycle` (E2B's older field).
    pub event_category: &'static str,
    /// `create`, `update`, `pause`, `resume`, `kill` (E2B's older field).
    pub event_label: &'static str,
    /// `sandbox_metadata`; `set_timeout` (RFC 3339) on updates; `execution`
    /// (`started_at`, `vcpu_count`, `memory_mb`, `execution_time` in ms) and
    /// `death_reason` on kills; `execution` on pauses.
    #[schema(value_type = Option<Object>)]
    pub event_data: Option<Value>,
    /// Derived from the template (stable per template).
    pub sandbox_build_id: String,
    /// Stable for one run of the sandbox.
    pub sandbox_execution_id: String,
    /// The sandbox.
    pub sandbox_id: String,
    /// The owner team's name.
    pub sandbox_team_id: String,
    /// The sandbox's template.
    pub sandbox_template_id: String,
    /// When it happened (RFC 3339, UTC).
    pub timestamp: String,
}

/// A uuid-shaped id derived from `parts` (stable across restarts).
fn derived_uuid(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0]);
    }
    let d = h.finalize();
    let hex: String = d[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// `eventData.execution` of a sandbox's current run, as of `now_ms`.
pub fn execution(row: &SandboxRow, now_ms: i64) -> Value {
    serde_json::json!({
        "started_at": format_time(row.started_at),
        "vcpu_count": row.cpu_count,
        "memory_mb": row.memory_mb,
        "execution_time": (now_ms - row.started_at).max(0),
    })
}

struct Pending {
    team_id: i64,
    event: SandboxEvent,
}

/// What the writer receives: an event, or a caller waiting until everything queued
/// before it is stored ([`Events::flush`]).
#[expect(
    clippy::large_enum_variant,
    reason = "nearly every value is an event; a box would cost each one an allocation"
)]
enum Queued {
    Event(Pending),
    Flush(oneshot::Sender<()>),
}

/// The lifecycle events of one control plane.
pub struct Events {
    store: Store,
    telemetry: Arc<Telemetry>,
    queue: mpsc::UnboundedSender<Queued>,
    /// Team id → name (teams are never renamed).
    teams: Mutex<HashMap<i64, String>>,
}

impl Events {
    /// Starts the background task that stores events and hands them to `webhooks`
    /// (it ends when the `Events` is dropped).
    pub fn start(store: Store, telemetry: Arc<Telemetry>, webhooks: Arc<Webhooks>) -> Events {
        let (queue, mut rx) = mpsc::unbounded_channel::<Queued>();
        let st = store.clone();
        tokio::spawn(async move {
            let mut batch = Vec::new();
            while rx.recv_many(&mut batch, EVENT_BATCH).await > 0 {
                let until = tokio::time::Instant::now() + EVENT_GATHER;
                let flushing = |b: &[Queued]| b.iter().any(|q| matches!(q, Queued::Flush(_)));
                while batch.len() < EVENT_BATCH && !flushing(&batch) {
                    let room = EVENT_BATCH - batch.len();
                    match tokio::time::timeout_at(until, rx.recv_many(&mut batch, room)).await {
                        // More came; or the window ended, or the sender is gone (stored
                        // at once, then the loop ends).
                        Ok(n) if n > 0 => {}
                        _ => break,
                    }
                }
                let mut rows = Vec::with_capacity(batch.len());
                let mut deliveries = Vec::with_capacity(batch.len());
                let mut flushed = Vec::new();
                for q in batch.drain(..) {
                    let p = match q {
                        Queued::Event(p) => p,
                        Queued::Flush(done) => {
                            flushed.push(done);
                            continue;
                        }
                    };
                    let body = match serde_json::to_string(&p.event) {
                        Ok(b) => b,
                        Err(e) => {
                            tracing::warn!("encoding a lifecycle event: {e}");
                            continue;
                        }
                    };
                    rows.push(EventRow {
                        id: p.event.id.clone(),
                        team_id: p.team_id,
                        sandbox_id: p.event.sandbox_id.clone(),
                        kind: p.event.kind.clone(),
                        at: now_ms(),
                        body: body.clone(),
                    });
                    deliveries.push((p.team_id, p.event.kind, body));
                }
                // What was gathered (a burst of creates) goes in one commit; if that
                // fails, one by one, so that one bad row loses only itself.
                let stored = st
                    .call(move |s| {
                        Ok(match s.insert_events(&rows) {
                            Ok(()) => Vec::new(),
                            Err(e) if rows.len() == 1 => vec![e.to_string()],
                            Err(_) => rows
                                .iter()
                                .filter_map(|r| s.insert_event(r).err())
                                .map(|e| e.to_string())
                                .collect(),
                        })
                    })
                    .await;
                match stored {
                    Ok(errors) => {
                        for e in errors {
                            tracing::warn!("storing a lifecycle event: {e}");
                        }
                    }
                    Err(e) => tracing::warn!("storing lifecycle events: {e}"),
                }
                for (team, kind, body) in deliveries {
                    webhooks.deliver(team, &kind, body.into());
                }
                for done in flushed {
                    let _ = done.send(());
                }
            }
        });
        Events {
            store,
            telemetry,
            queue,
            teams: Mutex::new(HashMap::new()),
        }
    }

    fn team_name(&self, team_id: i64) -> String {
        if let Some(n) = self
            .teams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&team_id)
        {
            return n.clone();
        }
        // One indexed read per team per process (inline: it is tiny and cached).
        let name = match self.store.read(|s| s.team(team_id)) {
            Ok(Some(t)) => t.name,
            _ => return team_id.to_string(),
        };
        self.teams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(team_id, name.clone());
        name
    }

    /// Records that `kind` happened to the sandbox of `row`; `data` adds to the event's
    /// `eventData` (which always carries `sandbox_metadata`, and `execution` for kills
    /// and pauses). Returns at once: storing and delivering happen in the background.
    pub fn emit(&self, kind: EventKind, row: &SandboxRow, data: Map<String, Value>) {
        let now = now_ms();
        let mut event_data = Map::new();
        if !row.metadata.is_empty() {
            event_data.insert(
                "sandbox_metadata".into(),
                serde_json::to_value(&row.metadata).unwrap_or_default(),
            );
        }
        if matches!(kind, EventKind::Killed | EventKind::Paused) {
            event_data.insert("execution".into(), execution(row, now));
        }
        event_data.extend(data);
        let team = self.team_name(row.team_id);
        let event = SandboxEvent {
            version: "v1",
            id: uuid::Uuid::new_v4().to_string(),
            kind: kind.type_name().to_string(),
            event_category: "lifecycle",
            event_label: kind.label(),
            event_data: (!event_data.is_empty()).then_some(Value::Object(event_data)),
            sandbox_build_id: derived_uuid(&["build", &row.template_id]),
            sandbox_execution_id: derived_uuid(&[
                "execution",
                &row.id,
                &row.started_at.to_string(),
            ]),
            sandbox_id: row.id.clone(),
            sandbox_team_id: team.clone(),
            sandbox_template_id: row.template_id.clone(),
            timestamp: format_time(now),
        };
        tracing::info!(
            target: "cubicle::lifecycle",
            sandbox = %row.id,
            team = %team,
            template = %row.template_id,
            event = kind.type_name(),
            data = %event.event_data.as_ref().map(|v| v.to_string()).unwrap_or_default(),
            "sandbox {}",
            match kind {
                EventKind::Created => "created",
                EventKind::Updated => "updated",
                EventKind::Paused => "paused",
                EventKind::Resumed => "resumed",
                EventKind::Killed => "ended",
            }
        );
        self.telemetry.lifecycle_event(kind);
        let _ = self.queue.send(Queued::Event(Pending {
            team_id: row.team_id,
            event,
        }));
    }

    /// Returns when every event emitted before the call is stored (and handed to the
    /// webhooks), without waiting out the gathering window: for a server that stops,
    /// whose runtime would otherwise end the writer with the last events unstored.
    pub async fn flush(&self) {
        let (done, stored) = oneshot::channel();
        if self.queue.send(Queued::Flush(done)).is_ok() {
            let _ = stored.await;
        }
    }

    /// `GET /events/sandboxes[/{id}]`: the team's events (of one sandbox when given).
    pub async fn list(
        &self,
        team_id: i64,
        sandbox_id: Option<&str>,
        q: &Query,
    ) -> ApiResult<Vec<Value>> {
        let kinds = q
            .all("types")
            .into_iter()
            .map(|t| {
                EventKind::parse(t)
                    .map(|k| k.type_name().to_string())
                    .ok_or_else(|| {
                        ApiError::BadRequest(format!(
                            "types: '{t}' is not an event type (one of {})",
                            EventKind::ALL.map(EventKind::type_name).join(", ")
                        ))
                    })
            })
            .collect::<ApiResult<Vec<_>>>()?;
        let query = EventQuery {
            team_id,
            sandbox_id: sandbox_id.map(str::to_string),
            kinds,
            offset: q.int("offset", 0..=i64::MAX)?.unwrap_or(0) as u64,
            limit: q.int("limit", 1..=MAX_LIMIT)?.unwrap_or(DEFAULT_LIMIT) as u64,
            ascending: q.bool("orderAsc")?.unwrap_or(false),
        };
        let rows = self.store.call(move |s| s.events(&query)).await?;
        Ok(rows
            .into_iter()
            .filter_map(|r| serde_json::from_str(&r.body).ok())
            .collect())
    }

    /// Deletes events older than [`RETENTION`].
    pub async fn purge(&self) {
        let before = now_ms() - RETENTION.as_millis() as i64;
        if let Err(e) = self.store.call(move |s| s.purge_events(before)).await {
            tracing::warn!("purging old lifecycle events: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_roundtrip() {
        for k in EventKind::ALL {
            assert_eq!(EventKind::parse(k.type_name()), Some(k));
        }
        assert_eq!(EventKind::parse("sandbox.lifecycle.exploded"), None);
    }

    fn test_row(team_id: i64) -> SandboxRow {
        SandboxRow {
            id: "i1".into(),
            team_id,
            template_id: "base".into(),
            alias: None,
            metadata: Default::default(),
            env_var_names: Vec::new(),
            traffic_access_token: None,
            allow_internet: true,
            cpu_count: 1,
            memory_mb: 512,
            disk_mb: 1024,
            started_at: now_ms(),
            end_at: now_ms() + 60_000,
            state: cubicle_store::SandboxRowState::Running,
            death_reason: None,
            ended_at: None,
        }
    }

    /// An event writer over a new in-memory store with one team; and how many events
    /// that team has stored.
    async fn writer() -> (
        Events,
        SandboxRow,
        impl Fn() -> usize + Clone + Send + 'static,
    ) {
        let store = Store::open_in_memory().unwrap();
        let team = store.ensure_team("t").unwrap();
        let telemetry = Arc::new(Telemetry::new());
        let hooks =
            crate::webhooks::Webhooks::open(store.clone(), Default::default(), telemetry.clone())
                .await
                .unwrap();
        let events = Events::start(store.clone(), telemetry, hooks);
        let stored = move || {
            let q = EventQuery {
                team_id: team.id,
                sandbox_id: None,
                kinds: Vec::new(),
                offset: 0,
                limit: 100,
                ascending: true,
            };
            store.events(&q).unwrap().len()
        };
        (events, test_row(team.id), stored)
    }

    /// Events emitted a few milliseconds apart are stored in one commit: a reader
    /// polling the store sees none of them, then all of them (one commit each showed
    /// them one by one, two milliseconds apart).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn events_a_few_milliseconds_apart_are_stored_together() {
        let (events, row, stored) = writer().await;
        let watcher = {
            let stored = stored.clone();
            std::thread::spawn(move || {
                let t0 = std::time::Instant::now();
                let mut seen = vec![stored()];
                while *seen.last().unwrap() < 3 && t0.elapsed() < Duration::from_secs(5) {
                    let n = stored();
                    if n != *seen.last().unwrap() {
                        seen.push(n);
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
                seen
            })
        };
        for kind in [EventKind::Created, EventKind::Paused, EventKind::Resumed] {
            events.emit(kind, &row, Map::new());
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let seen = tokio::task::spawn_blocking(move || watcher.join().unwrap())
            .await
            .unwrap();
        assert_eq!(seen, [0, 3], "the stored count as a reader saw it change");
    }

    /// A stopping server flushes: what was emitted is stored when `flush` returns, not
    /// at the end of the gathering window (which a stopping runtime would cut short).
    #[tokio::test]
    async fn a_flush_stores_what_was_emitted() {
        let (events, row, stored) = writer().await;
        // Nothing queued: returns at once.
        events.flush().await;
        assert_eq!(stored(), 0);
        events.emit(EventKind::Created, &row, Map::new());
        events.emit(EventKind::Killed, &row, Map::new());
        assert_eq!(stored(), 0, "still in the gathering window");
        events.flush().await;
        assert_eq!(stored(), 2);
    }

    #[test]
    fn derived_ids_are_uuid_shaped_and_stable() {
        let a = derived_uuid(&["execution", "abc", "1"]);
        assert_eq!(a, derived_uuid(&["execution", "abc", "1"]));
        assert_ne!(a, derived_uuid(&["execution", "abc", "2"]));
        assert_eq!(a.len(), 36);
        assert_eq!(a.matches('-').count(), 4);
    }
}
