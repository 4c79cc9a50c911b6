//! A build's log: entries kept in memory for the status endpoint's `logsOffset` paging and
//! appended to `<state>/templates/<name>/builds/<id>.log` so they outlive the process.

use std::sync::Mutex;

use crate::TemplateStore;
use crate::builds::LogEntry;

/// A function that sees every log entry as it is added.
type Tap = Box<dyn Fn(&LogEntry) + Send + Sync>;

/// The log of one running build.
pub struct BuildLog {
    store: TemplateStore,
    name: String,
    build_id: String,
    entries: Mutex<Vec<LogEntry>>,
    /// Called with each entry as it is added (the CLI's progress display).
    tap: Option<Tap>,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl BuildLog {
    /// The log of build `build_id` of `name`.
    pub fn new(store: TemplateStore, name: &str, build_id: &str) -> Self {
        BuildLog {
            store,
            name: name.into(),
            build_id: build_id.into(),
            entries: Mutex::new(Vec::new()),
            tap: None,
        }
    }

    /// Also hand every entry to `tap` as it is added.
    pub fn with_tap(mut self, tap: impl Fn(&LogEntry) + Send + Sync + 'static) -> Self {
        self.tap = Some(Box::new(tap));
        self
    }

    /// Add a line.
    pub fn push(&self, level: &str, step: Option<&str>, message: impl Into<String>) {
        let e = LogEntry {
            timestamp_ms: now_ms(),
            level: level.into(),
            message: message.into(),
            step: step.map(String::from),
        };
        if let Some(t) = &self.tap {
            t(&e);
        }
        if let Err(err) =
            self.store
                .append_log(&self.name, &self.build_id, std::slice::from_ref(&e))
        {
            tracing::warn!(template = %self.name, "build log: {err}");
        }
        if let Ok(mut v) = self.entries.lock() {
            v.push(e);
        }
    }

    /// `info` line.
    pub fn info(&self, step: Option<&str>, message: impl Into<String>) {
        self.push("info", step, message);
    }

    /// Entries from `offset`, at most `limit`.
    pub fn page(&self, offset: usize, limit: usize) -> Vec<LogEntry> {
        self.entries
            .lock()
            .map(|v| v.iter().skip(offset).take(limit).cloned().collect())
            .unwrap_or_default()
    }

    /// Entries of `step` at `warn` or above (E2B's `reason.logEntries`).
    pub fn problems_of(&self, step: &str) -> Vec<LogEntry> {
        self.entries
            .lock()
            .map(|v| {
                v.iter()
                    .filter(|e| e.step.as_deref() == Some(step))
                    .filter(|e| e.level == "warn" || e.level == "error")
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }
}
