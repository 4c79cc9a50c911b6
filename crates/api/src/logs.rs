//! Sandbox logs: envd's output (and anything the sandbox's init writes) goes into a pipe
//! the node drains into `<state>/sandboxes/<id>/init.log` (bounded; see
//! `cubicle_node::init_log`), which the node deletes with the sandbox. The
//! mirror copies new complete lines into `<logs dir>/<id>.log` as
//! `<unix ms>\t<level>\t<message>`, so logs stay readable after the sandbox is gone,
//! until its record is purged. Lines are cleaned on the way: terminal colour codes are
//! removed, and envd's own `<RFC 3339 time> <LEVEL> <message>` prefix becomes the
//! entry's timestamp and level (other lines get the time they were first seen — about a
//! second of precision — and a level guessed from their text).

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::Mutex;

/// Most bytes copied per sandbox and sync (the rest waits for the next sync).
const MAX_CHUNK: u64 = 1 << 20;
/// A mirror stops growing past this size.
const MAX_MIRROR: u64 = 16 << 20;

/// One log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    /// Unix ms it was written (or first seen).
    pub at_ms: i64,
    /// `debug`, `info`, `warn` or `error`.
    pub level: String,
    /// The text.
    pub line: String,
    /// Structured fields (`logger`, and for network events their type and verdict).
    pub fields: std::collections::BTreeMap<String, String>,
}

impl LogLine {
    /// A network audit event as a log line (`logger: network`).
    pub fn network(e: &cubicle_node::NetEvent) -> Self {
        let v = serde_json::to_value(e).unwrap_or_default();
        let mut fields = std::collections::BTreeMap::new();
        fields.insert("logger".to_string(), "network".to_string());
        for k in ["type", "verdict", "name", "dst", "port"] {
            match &v[k] {
                serde_json::Value::String(s) => {
                    fields.insert(k.to_string(), s.clone());
                }
                serde_json::Value::Number(n) => {
                    fields.insert(k.to_string(), n.to_string());
                }
                _ => {}
            }
        }
        LogLine {
            at_ms: e.at_ms,
            level: e.level().to_string(),
            line: format!("network: {}", e.summary()),
            fields,
        }
    }
}

/// Remove ANSI escape sequences (`ESC [ … letter`) and other control characters.
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for n in chars.by_ref() {
                    if n.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
        } else if c == '\t' || !c.is_control() {
            out.push(c);
        }
    }
    out
}

/// Split a cleaned line into (time, level, message).
pub fn parse_line(line: &str, seen_ms: i64) -> (i64, &'static str, String) {
    let mut rest = line.trim_start();
    let mut at = seen_ms;
    if let Some((first, after)) = rest.split_once(' ')
        && let Ok(t) = chrono::DateTime::parse_from_rfc3339(first)
    {
        at = t.timestamp_millis();
        rest = after.trim_start();
    }
    let level = match rest.split_once(' ').map(|(l, _)| l).unwrap_or(rest) {
        "ERROR" => Some("error"),
        "WARN" => Some("warn"),
        "INFO" => Some("info"),
        "DEBUG" | "TRACE" => Some("debug"),
        _ => None,
    };
    match level {
        Some(l) => (
            at,
            l,
            rest.split_once(' ')
                .map(|(_, m)| m.trim_start())
                .unwrap_or("")
                .to_string(),
        ),
        None => (at, level_of(rest), rest.to_string()),
    }
}

/// Copies init logs into the logs directory.
pub struct LogMirror {
    dir: PathBuf,
    /// Bytes of each source already copied.
    offsets: Mutex<HashMap<String, u64>>,
}

impl LogMirror {
    /// Mirror into `dir` (created on first write).
    pub fn new(dir: PathBuf) -> Self {
        LogMirror {
            dir,
            offsets: Mutex::new(HashMap::new()),
        }
    }

    fn mirror_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.log"))
    }

    /// How many bytes `sync` may have to copy (one `stat`; cheap enough to ask inline
    /// before deciding whether a sync is worth a hop to the blocking pool).
    pub fn pending(&self, id: &str, source: &std::path::Path) -> u64 {
        let Ok(meta) = std::fs::metadata(source) else {
            return 0;
        };
        let offsets = self.offsets.lock().unwrap_or_else(|p| p.into_inner());
        meta.len()
            .saturating_sub(offsets.get(id).copied().unwrap_or(0))
    }

    /// Copy what `source` gained since the last sync. Blocking. Missing source: no-op.
    pub fn sync(&self, id: &str, source: &std::path::Path) {
        if let Err(e) = self.sync_inner(id, source) {
            tracing::debug!(sandbox = %id, "log mirror: {e}");
        }
    }

    fn sync_inner(&self, id: &str, source: &std::path::Path) -> std::io::Result<()> {
        let mut src = match std::fs::File::open(source) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        let len = src.metadata()?.len();
        let mirror = self.mirror_path(id);
        let mut offsets = self.offsets.lock().unwrap_or_else(|p| p.into_inner());
        let offset = match offsets.get(id) {
            Some(o) => *o,
            // After a server restart: do not copy again what an earlier run mirrored.
            None if mirror.exists() => len,
            None => 0,
        };
        if len <= offset {
            offsets.insert(id.to_string(), offset.min(len));
            return Ok(());
        }
        src.seek(SeekFrom::Start(offset))?;
        // Sized up front: an empty Vec would be filled by small growing reads.
        let mut buf = Vec::with_capacity((len - offset).min(MAX_CHUNK) as usize);
        src.take(MAX_CHUNK).read_to_end(&mut buf)?;
        // Only complete lines; a partial last line waits (unless the chunk is full).
        let upto = match buf.iter().rposition(|&b| b == b'\n') {
            Some(p) => p + 1,
            None if buf.len() as u64 >= MAX_CHUNK => buf.len(),
            None => return Ok(()),
        };
        offsets.insert(id.to_string(), offset + upto as u64);
        drop(offsets);
        // Root's alone, like the state directory: what sandboxes print may be secret.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)?;
        if std::fs::metadata(&mirror).map(|m| m.len()).unwrap_or(0) > MAX_MIRROR {
            return Ok(());
        }
        let now = cubicle_store::now_ms();
        let mut out = String::new();
        for line in String::from_utf8_lossy(&buf[..upto]).lines() {
            let clean = strip_ansi(line).replace('\t', " ");
            let (at, level, msg) = parse_line(&clean, now);
            out.push_str(&format!("{at}\t{level}\t{msg}\n"));
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&mirror)?;
        f.write_all(out.as_bytes())
    }

    /// All mirrored lines of `id`. Blocking.
    pub fn read(&self, id: &str) -> Vec<LogLine> {
        let Ok(text) = std::fs::read_to_string(self.mirror_path(id)) else {
            return Vec::new();
        };
        text.lines()
            .filter_map(|l| {
                let (t, rest) = l.split_once('\t')?;
                let (level, line) = rest.split_once('\t')?;
                Some(LogLine {
                    at_ms: t.parse().ok()?,
                    level: level.to_string(),
                    line: line.to_string(),
                    fields: Default::default(),
                })
            })
            .collect()
    }

    /// Forget `id` (its record was purged).
    pub fn remove(&self, id: &str) {
        self.offsets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        let _ = std::fs::remove_file(self.mirror_path(id));
    }
}

/// A log level guessed from the line (envd logs `ERROR`/`WARN`/`DEBUG` markers).
pub fn level_of(line: &str) -> &'static str {
    let up = line.get(..line.len().min(120)).unwrap_or(line);
    if up.contains("ERROR") || up.contains("error:") {
        "error"
    } else if up.contains("WARN") {
        "warn"
    } else if up.contains("DEBUG") || up.contains("TRACE") {
        "debug"
    } else {
        "info"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirrors_complete_lines_and_survives_source_removal() {
        let dir = std::env::temp_dir().join(format!("cubicle-api-logs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("init.log");
        let m = LogMirror::new(dir.join("logs"));
        m.sync("a", &src); // missing source: nothing
        assert!(m.read("a").is_empty());
        std::fs::write(&src, "one\ntwo\npart").unwrap();
        m.sync("a", &src);
        let lines: Vec<String> = m.read("a").into_iter().map(|l| l.line).collect();
        assert_eq!(lines, ["one", "two"]);
        std::fs::write(&src, "one\ntwo\npartial done\nWARN three\n").unwrap();
        m.sync("a", &src);
        std::fs::remove_file(&src).unwrap();
        let lines: Vec<String> = m.read("a").into_iter().map(|l| l.line).collect();
        assert_eq!(lines, ["one", "two", "partial done", "three"]);
        assert_eq!(lines[3], "three");
        assert_eq!(m.read("a")[3].level, "warn");
        assert_eq!(level_of("x ERROR y"), "error");
        assert_eq!(level_of("hello"), "info");
        // envd's tracing output: colours stripped, its timestamp and level used.
        let envd = "\u{1b}[2m2026-11-30T12:18:42.753162Z\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m \u{1b}[2mcubicle_envd::server\u{1b}[0m\u{1b}[2m:\u{1b}[0m envd listening";
        let clean = strip_ansi(envd);
        assert_eq!(
            clean,
            "2026-11-30T12:18:42.753162Z  INFO cubicle_envd::server: envd listening"
        );
        let (at, level, msg) = parse_line(&clean, 0);
        assert_eq!(
            (at, level, msg.as_str()),
            (
                1796041122753,
                "info",
                "cubicle_envd::server: envd listening"
            )
        );
        assert_eq!(
            parse_line("plain text", 5),
            (5, "info", "plain text".to_string())
        );
        m.remove("a");
        assert!(m.read("a").is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
