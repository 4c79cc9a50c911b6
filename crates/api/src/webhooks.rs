//! E2B's lifecycle webhooks: a team registers URLs (`/events/webhooks`), and every
//! lifecycle event of its sandboxes whose type a webhook subscribes to is POSTed there.
//!
//! A delivery is signed as E2B signs it: `e2b-signature` is the SHA-256 of the
//! webhook's secret followed by the raw body, base64 without padding, with
//! `e2b-signature-version: v1`, `e2b-webhook-id` and `e2b-delivery-id` (new for every
//! attempt). A delivery fails when the endpoint does not answer 2xx within the timeout;
//! it is retried [`WebhookConfig::retries`] times (E2B: 3), [`WebhookConfig::retry_interval`]
//! apart (E2B: 10 s). Deliveries live in memory: retries still pending when the server
//! stops are dropped (the event itself stays readable in the events API).
//!
//! Webhooks are read from the database once and kept in memory (updated on every
//! change), so an event costs no query to find its receivers. The secret is stored as
//! given (it must be, to sign) and never returned by the API.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use base64::Engine;
use bytes::Bytes;
use cubicle_store::{Store, Team, WebhookRow, now_ms};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{ApiError, ApiResult};
use crate::events::EventKind;
use crate::query::format_time;
use crate::telemetry::Telemetry;

/// Longest webhook name, URL and secret accepted.
const MAX_NAME: usize = 256;
const MAX_URL: usize = 2048;
const MAX_SECRET: usize = 1024;
/// Webhooks per team.
const MAX_PER_TEAM: usize = 50;

/// How deliveries are attempted.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// Attempts after the first one fails.
    pub retries: u32,
    /// Wait between attempts.
    pub retry_interval: Duration,
    /// How long one attempt may take (connect, send, answer).
    pub timeout: Duration,
}

impl Default for WebhookConfig {
    /// E2B's: 3 retries, 10 s apart; 10 s per attempt.
    fn default() -> Self {
        WebhookConfig {
            retries: 3,
            retry_interval: Duration::from_secs(10),
            timeout: Duration::from_secs(10),
        }
    }
}

/// `POST /events/webhooks` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WebhookCreate {
    /// A name for humans.
    #[schema(min_length = 1, max_length = 256)]
    pub name: String,
    /// Where events are POSTed (`http://` or `https://`).
    #[schema(
        min_length = 8,
        max_length = 2048,
        pattern = r"^https?://[A-Za-z0-9.\-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~!$&'()*+,;=:@%/?\-]*)?$"
    )]
    pub url: String,
    /// Whether events are delivered (default true).
    #[serde(default = "yes")]
    #[schema(default = true)]
    pub enabled: bool,
    /// Event types to deliver.
    #[schema(min_items = 1, value_type = Vec<EventType>)]
    pub events: Vec<String>,
    /// Signs every delivery (see the module docs).
    #[schema(min_length = 1, max_length = 1024)]
    pub signature_secret: String,
}

fn yes() -> bool {
    true
}

/// `PATCH /events/webhooks/{id}` body: the fields to change.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WebhookUpdate {
    /// A name for humans.
    #[schema(min_length = 1, max_length = 256)]
    pub name: Option<String>,
    /// Where events are POSTed.
    #[schema(
        min_length = 8,
        max_length = 2048,
        pattern = r"^https?://[A-Za-z0-9.\-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~!$&'()*+,;=:@%/?\-]*)?$"
    )]
    pub url: Option<String>,
    /// Whether events are delivered.
    pub enabled: Option<bool>,
    /// Event types to deliver.
    #[schema(min_items = 1, value_type = Option<Vec<EventType>>)]
    pub events: Option<Vec<String>>,
    /// A new signing secret.
    #[schema(min_length = 1, max_length = 1024)]
    pub signature_secret: Option<String>,
}

/// A lifecycle event type.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, utoipa::ToSchema)]
pub enum EventType {
    /// Created.
    #[serde(rename = "sandbox.lifecycle.created")]
    Created,
    /// End time changed.
    #[serde(rename = "sandbox.lifecycle.updated")]
    Updated,
    /// Paused.
    #[serde(rename = "sandbox.lifecycle.paused")]
    Paused,
    /// Resumed.
    #[serde(rename = "sandbox.lifecycle.resumed")]
    Resumed,
    /// Killed or ended.
    #[serde(rename = "sandbox.lifecycle.killed")]
    Killed,
}

/// A webhook as the API shows it (never its secret).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Webhook {
    /// Id (uuid).
    pub id: String,
    /// The owner team's name.
    pub team_id: String,
    /// A name for humans.
    pub name: String,
    /// When it was registered (RFC 3339).
    pub created_at: String,
    /// Whether events are delivered.
    pub enabled: bool,
    /// Where events are POSTed.
    pub url: String,
    /// Event types delivered.
    #[schema(value_type = Vec<EventType>)]
    pub events: Vec<String>,
}

fn view(w: &WebhookRow, team: &Team) -> Webhook {
    Webhook {
        id: w.id.clone(),
        team_id: team.name.clone(),
        name: w.name.clone(),
        created_at: format_time(w.created_at),
        enabled: w.enabled,
        url: w.url.clone(),
        events: w.events.clone(),
    }
}

/// The `e2b-signature` of `body` under `secret`.
pub fn signature(secret: &str, body: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(secret.as_bytes());
    h.update(body);
    base64::engine::general_purpose::STANDARD_NO_PAD.encode(h.finalize())
}

fn check_name(name: &str) -> ApiResult<()> {
    if name.trim().is_empty() || name.chars().count() > MAX_NAME {
        return Err(ApiError::BadRequest(format!(
            "name must have 1 to {MAX_NAME} characters"
        )));
    }
    Ok(())
}

fn check_url(url: &str) -> ApiResult<()> {
    let bad = |why: &str| ApiError::BadRequest(format!("url '{url}' {why}"));
    if url.len() > MAX_URL {
        return Err(bad("is too long"));
    }
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .ok_or_else(|| bad("must start with http:// or https://"))?;
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (authority, None),
    };
    if host.is_empty()
        || !host
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'.' || c == b'-')
    {
        return Err(bad("needs a host name or IPv4 address"));
    }
    if let Some(p) = port
        && (p.is_empty() || p.len() > 5 || !p.bytes().all(|c| c.is_ascii_digit()))
    {
        return Err(bad("has an invalid port"));
    }
    // The characters of a URI path and query (RFC 3986), as the description's pattern.
    if !path
        .bytes()
        .all(|c| c.is_ascii_alphanumeric() || b"._~!$&'()*+,;=:@%/?-".contains(&c))
    {
        return Err(bad(
            "has characters a URL path cannot have (spaces, <, >, #, non-ASCII, …)",
        ));
    }
    url.parse::<hyper::Uri>()
        .map_err(|e| bad(&format!("is not a URL: {e}")))?;
    Ok(())
}

fn check_events(events: &[String]) -> ApiResult<()> {
    if events.is_empty() {
        return Err(ApiError::BadRequest(
            "events must name at least one event type".into(),
        ));
    }
    for e in events {
        if EventKind::parse(e).is_none() {
            return Err(ApiError::BadRequest(format!(
                "events: '{e}' is not an event type (one of {})",
                EventKind::ALL.map(EventKind::type_name).join(", ")
            )));
        }
    }
    Ok(())
}

fn check_secret(secret: &str) -> ApiResult<()> {
    if secret.is_empty() || secret.chars().count() > MAX_SECRET {
        return Err(ApiError::BadRequest(format!(
            "signatureSecret must have 1 to {MAX_SECRET} characters"
        )));
    }
    Ok(())
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> ApiResult<T> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest(format!("invalid request body: {e}")))
}

type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// How often a webhook that keeps failing is logged again (with what failed meanwhile).
const FAILURE_REPORT_EVERY: Duration = Duration::from_secs(60);

/// Which webhooks are failing, so that an endpoint that is down is logged when it starts
/// failing, once a [`FAILURE_REPORT_EVERY`] while it goes on (with counts), and when it
/// answers again, rather than at every attempt: a team's busy sandboxes against a dead
/// endpoint made a log line per event and retry (thousands a minute).
#[derive(Default)]
struct DeliveryHealth {
    failing: HashMap<String, Failing>,
}

struct Failing {
    since: Instant,
    reported: Instant,
    /// Failed attempts and abandoned deliveries since `reported`, and since `since`.
    attempts: u64,
    dropped: u64,
    total_attempts: u64,
}

/// What to log about an attempt ([`DeliveryHealth`]).
#[derive(Debug, PartialEq)]
enum HealthNote {
    /// The webhook's first failure since it last delivered (or ever).
    StartedFailing,
    /// Failing for a while: attempts failed and deliveries abandoned since the last report.
    StillFailing {
        attempts: u64,
        dropped: u64,
        secs: u64,
    },
    /// Delivered again after `attempts` failed attempts over `secs`.
    Recovered { attempts: u64, secs: u64 },
    /// Nothing new to say.
    Quiet,
}

impl DeliveryHealth {
    /// An attempt of webhook `id` failed at `now` (`dropped`: it was the delivery's last).
    fn failed(&mut self, id: &str, dropped: bool, now: Instant) -> HealthNote {
        let Some(f) = self.failing.get_mut(id) else {
            self.failing.insert(
                id.to_string(),
                Failing {
                    since: now,
                    reported: now,
                    attempts: 0,
                    dropped: 0,
                    total_attempts: 1,
                },
            );
            return HealthNote::StartedFailing;
        };
        f.attempts += 1;
        f.dropped += u64::from(dropped);
        f.total_attempts += 1;
        if now.duration_since(f.reported) < FAILURE_REPORT_EVERY {
            return HealthNote::Quiet;
        }
        let note = HealthNote::StillFailing {
            attempts: f.attempts,
            dropped: f.dropped,
            secs: now.duration_since(f.reported).as_secs(),
        };
        (f.reported, f.attempts, f.dropped) = (now, 0, 0);
        note
    }

    /// An attempt of webhook `id` succeeded at `now`.
    fn delivered(&mut self, id: &str, now: Instant) -> HealthNote {
        match self.failing.remove(id) {
            Some(f) => HealthNote::Recovered {
                attempts: f.total_attempts,
                secs: now.duration_since(f.since).as_secs(),
            },
            None => HealthNote::Quiet,
        }
    }
}

/// The webhooks of every team, and their deliveries.
pub struct Webhooks {
    store: Store,
    config: WebhookConfig,
    telemetry: Arc<Telemetry>,
    client: HttpsClient,
    /// Team id → its webhooks (the database's content, kept in step).
    by_team: RwLock<HashMap<i64, Vec<WebhookRow>>>,
    health: std::sync::Mutex<DeliveryHealth>,
}

impl Webhooks {
    /// Loads the webhooks from `store`.
    pub async fn open(
        store: Store,
        config: WebhookConfig,
        telemetry: Arc<Telemetry>,
    ) -> ApiResult<Arc<Webhooks>> {
        let all = store.call(|s| s.webhooks(None)).await?;
        let mut by_team: HashMap<i64, Vec<WebhookRow>> = HashMap::new();
        for w in all {
            by_team.entry(w.team_id).or_default().push(w);
        }
        let tls = crate::tls::client_config(None)
            .map_err(|e| ApiError::Internal(format!("webhook client: {e}")))?;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(config.timeout));
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Ok(Arc::new(Webhooks {
            store,
            config,
            telemetry,
            client,
            by_team: RwLock::new(by_team),
            health: Default::default(),
        }))
    }

    fn health(&self) -> std::sync::MutexGuard<'_, DeliveryHealth> {
        self.health.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every team's webhooks (for the metrics).
    pub fn all(&self) -> Vec<WebhookRow> {
        self.by_team
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .flatten()
            .cloned()
            .collect()
    }

    fn cached(&self, team_id: i64) -> Vec<WebhookRow> {
        self.by_team
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&team_id)
            .cloned()
            .unwrap_or_default()
    }

    fn set_cached(&self, team_id: i64, hooks: Vec<WebhookRow>) {
        self.by_team
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(team_id, hooks);
    }

    async fn reload(&self, team_id: i64) -> ApiResult<()> {
        let hooks = self.store.call(move |s| s.webhooks(Some(team_id))).await?;
        self.set_cached(team_id, hooks);
        Ok(())
    }

    /// Sends `body` (an event of type `kind`) to every enabled webhook of `team_id`
    /// subscribed to it; returns at once.
    pub fn deliver(self: &Arc<Self>, team_id: i64, kind: &str, body: Bytes) {
        for hook in self.cached(team_id) {
            if hook.enabled && hook.events.iter().any(|e| e == kind) {
                let (me, body) = (self.clone(), body.clone());
                tokio::spawn(async move { me.deliver_one(hook, body).await });
            }
        }
    }

    async fn deliver_one(&self, hook: WebhookRow, body: Bytes) {
        let sig = signature(&hook.secret, &body);
        let attempts = self.config.retries.saturating_add(1);
        for attempt in 1..=attempts {
            let delivery = uuid::Uuid::new_v4().to_string();
            let outcome = self.attempt(&hook, &delivery, &sig, body.clone()).await;
            self.telemetry.webhook_attempt(outcome.is_ok());
            let now = Instant::now();
            match outcome {
                Ok(()) => {
                    tracing::debug!(webhook = %hook.id, delivery, attempt, "webhook delivered");
                    if let HealthNote::Recovered { attempts, secs } =
                        self.health().delivered(&hook.id, now)
                    {
                        tracing::info!(webhook = %hook.id, url = %hook.url, "webhook delivering again, after {attempts} failed attempts over {secs} s");
                    }
                    self.telemetry.webhook_delivery(true);
                    return;
                }
                Err(why) => {
                    let last = attempt == attempts;
                    let then = if last {
                        "giving up on this delivery".to_string()
                    } else {
                        format!("retrying in {:?}", self.config.retry_interval)
                    };
                    match self.health().failed(&hook.id, last, now) {
                        HealthNote::StartedFailing => {
                            tracing::warn!(webhook = %hook.id, url = %hook.url, attempt, "webhook delivery failed ({why}); {then}; while it keeps failing, it is reported once a minute")
                        }
                        HealthNote::StillFailing {
                            attempts,
                            dropped,
                            secs,
                        } => {
                            tracing::warn!(webhook = %hook.id, url = %hook.url, "webhook still failing: {attempts} more failed attempts and {dropped} deliveries given up in the last {secs} s (last: {why})")
                        }
                        _ => {
                            tracing::debug!(webhook = %hook.id, attempt, "webhook delivery failed ({why}); {then}")
                        }
                    }
                    if !last {
                        tokio::time::sleep(self.config.retry_interval).await;
                    }
                }
            }
        }
        self.telemetry.webhook_delivery(false);
    }

    async fn attempt(
        &self,
        hook: &WebhookRow,
        delivery: &str,
        sig: &str,
        body: Bytes,
    ) -> Result<(), String> {
        let req = hyper::Request::post(&hook.url)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(
                hyper::header::USER_AGENT,
                concat!("cubicle/", env!("CARGO_PKG_VERSION")),
            )
            .header("e2b-webhook-id", &hook.id)
            .header("e2b-delivery-id", delivery)
            .header("e2b-signature-version", "v1")
            .header("e2b-signature", sig)
            .body(Full::new(body))
            .map_err(|e| format!("bad request: {e}"))?;
        let resp = tokio::time::timeout(self.config.timeout, self.client.request(req))
            .await
            .map_err(|_| format!("no answer within {:?}", self.config.timeout))?
            .map_err(|e| format!("{e}"))?;
        let status = resp.status();
        // Drain (bounded) so the connection can be reused.
        let _ = tokio::time::timeout(
            self.config.timeout,
            http_body_util::BodyExt::collect(http_body_util::Limited::new(
                resp.into_body(),
                64 << 10,
            )),
        )
        .await;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("answered {status}"))
        }
    }

    // ---- the team's CRUD (`/events/webhooks`) ----

    /// `POST /events/webhooks`.
    pub async fn create(&self, team: &Team, body: &[u8]) -> ApiResult<Webhook> {
        let req: WebhookCreate = parse(body)?;
        check_name(&req.name)?;
        check_url(&req.url)?;
        check_events(&req.events)?;
        check_secret(&req.signature_secret)?;
        if self.cached(team.id).len() >= MAX_PER_TEAM {
            return Err(ApiError::Conflict(format!(
                "a team may have at most {MAX_PER_TEAM} webhooks"
            )));
        }
        let row = WebhookRow {
            id: uuid::Uuid::new_v4().to_string(),
            team_id: team.id,
            name: req.name,
            url: req.url,
            enabled: req.enabled,
            events: dedup(req.events),
            secret: req.signature_secret,
            created_at: now_ms(),
        };
        let r2 = row.clone();
        self.store.call(move |s| s.insert_webhook(&r2)).await?;
        self.reload(team.id).await?;
        Ok(view(&row, team))
    }

    /// `GET /events/webhooks`.
    pub fn list(&self, team: &Team) -> Vec<Webhook> {
        self.cached(team.id).iter().map(|w| view(w, team)).collect()
    }

    fn find(&self, team: &Team, id: &str) -> ApiResult<WebhookRow> {
        self.cached(team.id)
            .into_iter()
            .find(|w| w.id == id)
            .ok_or_else(|| ApiError::NotFound(format!("webhook '{id}' not found")))
    }

    /// `GET /events/webhooks/{id}`.
    pub fn get(&self, team: &Team, id: &str) -> ApiResult<Webhook> {
        Ok(view(&self.find(team, id)?, team))
    }

    /// `PATCH /events/webhooks/{id}`.
    pub async fn update(&self, team: &Team, id: &str, body: &[u8]) -> ApiResult<Webhook> {
        let mut row = self.find(team, id)?;
        let req: WebhookUpdate = parse(body)?;
        if let Some(n) = req.name {
            check_name(&n)?;
            row.name = n;
        }
        if let Some(u) = req.url {
            check_url(&u)?;
            row.url = u;
        }
        if let Some(e) = req.enabled {
            row.enabled = e;
        }
        if let Some(ev) = req.events {
            check_events(&ev)?;
            row.events = dedup(ev);
        }
        if let Some(s) = req.signature_secret {
            check_secret(&s)?;
            row.secret = s;
        }
        let r2 = row.clone();
        self.store.call(move |s| s.update_webhook(&r2)).await?;
        self.reload(team.id).await?;
        Ok(view(&row, team))
    }

    /// `DELETE /events/webhooks/{id}`.
    pub async fn delete(&self, team: &Team, id: &str) -> ApiResult<()> {
        self.find(team, id)?;
        let (team_id, id2) = (team.id, id.to_string());
        self.store
            .call(move |s| s.delete_webhook(team_id, &id2))
            .await?;
        self.health().failing.remove(id);
        self.reload(team.id).await
    }
}

fn dedup(mut v: Vec<String>) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    v.retain(|e| seen.insert(e.clone()));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_as_e2b_documents() {
        // base64(sha256("secret" + body)) without padding.
        let body = br#"{"a":1}"#;
        let sig = signature("secret", body);
        let mut h = Sha256::new();
        h.update(b"secret{\"a\":1}");
        let want = base64::engine::general_purpose::STANDARD.encode(h.finalize());
        assert_eq!(sig, want.trim_end_matches('='));
        assert!(!sig.ends_with('='));
    }

    #[test]
    fn validates_urls() {
        for ok in [
            "http://127.0.0.1:8080/hook",
            "https://hooks.example.com",
            "https://a.b/c?d=e",
        ] {
            assert!(check_url(ok).is_ok(), "{ok}");
        }
        for bad in [
            "ftp://x",
            "http://",
            "http://a b/",
            "https://x:99999999/",
            "http://ex ample.com",
            "http://x/ä",
            "http://x/a<b",
            "http://x/a#b",
            "not a url",
        ] {
            assert!(check_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_failing_webhook_is_reported_when_it_starts_once_a_minute_and_when_it_recovers() {
        let mut h = DeliveryHealth::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(h.delivered("a", at(0)), HealthNote::Quiet);
        assert_eq!(h.failed("a", false, at(1)), HealthNote::StartedFailing);
        // Another webhook is told apart.
        assert_eq!(h.failed("b", true, at(1)), HealthNote::StartedFailing);
        for s in 2..30 {
            assert_eq!(h.failed("a", s % 4 == 0, at(s)), HealthNote::Quiet);
        }
        assert_eq!(
            h.failed("a", true, at(61)),
            HealthNote::StillFailing {
                attempts: 29,
                dropped: 8,
                secs: 60
            }
        );
        assert_eq!(h.failed("a", false, at(70)), HealthNote::Quiet);
        assert_eq!(
            h.delivered("a", at(75)),
            HealthNote::Recovered {
                attempts: 31,
                secs: 74
            }
        );
        assert_eq!(h.delivered("a", at(76)), HealthNote::Quiet);
        assert_eq!(h.failed("a", false, at(77)), HealthNote::StartedFailing);
    }

    #[test]
    fn validates_events() {
        assert!(check_events(&[]).is_err());
        assert!(check_events(&["sandbox.lifecycle.nope".into()]).is_err());
        assert!(check_events(&["sandbox.lifecycle.killed".into()]).is_ok());
    }
}
