//! The audit trail: what each sandbox asked the resolver and which connections it tried
//! through the proxy, with the verdict, the reason and (when a connection ends) the bytes
//! each way. One JSON line per event in `<log dir>/<id>.net.jsonl`, numbered per sandbox;
//! bounded (the file rotates to `.1` at [`AuditLog::max_bytes`], so at most twice that is
//! kept) and kept after the sandbox ends, like its other logs, until the node forgets it.
//!
//! [`allow_list`] turns a trail into the `allowOut` list that would have permitted what
//! it shows (learn mode).

use std::collections::{BTreeSet, HashMap};
use std::io::{BufRead, Write};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::policy::Verdict;

/// One event of a sandbox's trail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetEvent {
    /// 1, 2, 3, … per sandbox.
    pub seq: u64,
    /// Unix time, ms.
    pub at_ms: i64,
    #[serde(flatten)]
    pub what: EventKind,
}

/// What happened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum EventKind {
    /// A DNS question and its answer (or why there was none).
    #[serde(rename_all = "camelCase")]
    Dns {
        name: String,
        qtype: String,
        verdict: Verdict,
        reason: String,
        /// The answer's response code (`NOERROR`, `NXDOMAIN`, `REFUSED`, …).
        rcode: String,
        /// `1.2.3.4`, `AAAA …`, `CNAME …`.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        answers: Vec<String>,
    },
    /// A connection attempt and the verdict on it.
    #[serde(rename_all = "camelCase")]
    Connect {
        proto: String,
        dst: Ipv4Addr,
        port: u16,
        /// TLS SNI or HTTP Host, when seen.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        verdict: Verdict,
        reason: String,
        /// `direct`, `socks5 <proxy>`.
        via: String,
    },
    /// An allowed connection ended.
    #[serde(rename_all = "camelCase")]
    Close {
        proto: String,
        dst: Ipv4Addr,
        port: u16,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        /// Bytes the sandbox sent / received.
        bytes_out: u64,
        bytes_in: u64,
        duration_ms: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
}

impl NetEvent {
    /// `warn` for denials, `info` otherwise (for the logs API).
    pub fn level(&self) -> &'static str {
        match &self.what {
            EventKind::Dns { verdict, .. } | EventKind::Connect { verdict, .. }
                if *verdict == Verdict::Denied =>
            {
                "warn"
            }
            _ => "info",
        }
    }

    /// One human-readable line.
    pub fn summary(&self) -> String {
        match &self.what {
            EventKind::Dns {
                name,
                qtype,
                verdict,
                reason,
                rcode,
                answers,
            } => {
                let ans = if answers.is_empty() {
                    rcode.clone()
                } else {
                    answers.join(", ")
                };
                format!(
                    "dns {qtype} {name} → {ans} [{}: {reason}]",
                    verdict.as_str()
                )
            }
            EventKind::Connect {
                proto,
                dst,
                port,
                name,
                verdict,
                reason,
                via,
            } => {
                let n = name
                    .as_deref()
                    .map(|n| format!(" ({n})"))
                    .unwrap_or_default();
                format!(
                    "{proto} {dst}:{port}{n} {} via {via} [{reason}]",
                    verdict.as_str()
                )
            }
            EventKind::Close {
                proto,
                dst,
                port,
                name,
                bytes_out,
                bytes_in,
                duration_ms,
                error,
            } => {
                let n = name
                    .as_deref()
                    .map(|n| format!(" ({n})"))
                    .unwrap_or_default();
                let e = error
                    .as_deref()
                    .map(|e| format!(" error: {e}"))
                    .unwrap_or_default();
                format!(
                    "{proto} {dst}:{port}{n} closed: {bytes_out} B out, {bytes_in} B in, {duration_ms} ms{e}"
                )
            }
        }
    }
}

struct Writer {
    file: std::fs::File,
    bytes: u64,
    next_seq: u64,
}

/// Every sandbox's trail, on disk.
pub struct AuditLog {
    dir: PathBuf,
    max_bytes: u64,
    open: Mutex<HashMap<String, Writer>>,
}

impl AuditLog {
    /// Trails in `dir`, each rotated at `max_bytes`.
    pub fn new(dir: PathBuf, max_bytes: u64) -> Self {
        AuditLog {
            dir,
            max_bytes: max_bytes.max(4096),
            open: Mutex::new(HashMap::new()),
        }
    }

    /// The rotation size.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// `<dir>/<id>.net.jsonl`.
    pub fn path(dir: &Path, id: &str) -> PathBuf {
        dir.join(format!("{id}.net.jsonl"))
    }

    fn rotated(dir: &Path, id: &str) -> PathBuf {
        dir.join(format!("{id}.net.jsonl.1"))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Writer>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends an event to sandbox `id`'s trail. Failures are logged, never fatal.
    pub fn record(&self, id: &str, what: EventKind) {
        if let Err(e) = self.record_inner(id, what) {
            tracing::warn!(sandbox = %id, "audit trail: {e}");
        }
    }

    fn record_inner(&self, id: &str, what: EventKind) -> std::io::Result<()> {
        let mut open = self.lock();
        if !open.contains_key(id) {
            let w = self.open_writer(id)?;
            open.insert(id.to_string(), w);
        }
        let Some(w) = open.get_mut(id) else {
            return Ok(());
        };
        let ev = NetEvent {
            seq: w.next_seq,
            at_ms: now_ms(),
            what,
        };
        let mut line = serde_json::to_vec(&ev).map_err(std::io::Error::other)?;
        line.push(b'\n');
        if w.bytes + line.len() as u64 > self.max_bytes {
            let cur = Self::path(&self.dir, id);
            std::fs::rename(&cur, Self::rotated(&self.dir, id))?;
            w.file = append(&cur)?;
            w.bytes = 0;
        }
        w.file.write_all(&line)?;
        w.bytes += line.len() as u64;
        w.next_seq += 1;
        Ok(())
    }

    fn open_writer(&self, id: &str) -> std::io::Result<Writer> {
        std::fs::create_dir_all(&self.dir)?;
        let cur = Self::path(&self.dir, id);
        // Continue the numbering of an earlier run.
        let last = read_events(&cur)
            .last()
            .map(|e| e.seq)
            .or_else(|| {
                read_events(&Self::rotated(&self.dir, id))
                    .last()
                    .map(|e| e.seq)
            })
            .unwrap_or(0);
        let file = append(&cur)?;
        let bytes = file.metadata()?.len();
        Ok(Writer {
            file,
            bytes,
            next_seq: last + 1,
        })
    }

    /// Events of `id` with `seq > after`, oldest first, at most `limit`. Blocking.
    pub fn read(&self, id: &str, after: u64, limit: usize) -> Vec<NetEvent> {
        let mut v = read_events(&Self::rotated(&self.dir, id));
        v.extend(read_events(&Self::path(&self.dir, id)));
        v.into_iter()
            .filter(|e| e.seq > after)
            .take(limit)
            .collect()
    }

    /// Stops writing `id`'s trail (the sandbox is gone); the files stay.
    pub fn close(&self, id: &str) {
        self.lock().remove(id);
    }

    /// Deletes `id`'s trail.
    pub fn remove(&self, id: &str) {
        self.close(id);
        let _ = std::fs::remove_file(Self::path(&self.dir, id));
        let _ = std::fs::remove_file(Self::rotated(&self.dir, id));
    }
}

fn append(p: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(p)
}

fn read_events(p: &Path) -> Vec<NetEvent> {
    let Ok(f) = std::fs::File::open(p) else {
        return Vec::new();
    };
    std::io::BufReader::new(f)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str(&l).ok())
        .collect()
}

/// Unix time in ms.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The `allowOut` entries that would have let through every connection in `events`
/// (allowed, denied or learned): the name it asked for when it said one, else a name
/// the resolver had answered with its address, else the address itself.
pub fn allow_list(events: &[NetEvent]) -> Vec<String> {
    let mut names_of: HashMap<Ipv4Addr, String> = HashMap::new();
    for e in events {
        if let EventKind::Dns { name, answers, .. } = &e.what {
            for a in answers {
                if let Ok(ip) = a.parse::<Ipv4Addr>() {
                    names_of.insert(ip, name.clone());
                }
            }
        }
    }
    let mut domains = BTreeSet::new();
    let mut addrs = BTreeSet::new();
    for e in events {
        if let EventKind::Connect {
            dst, name, reason, ..
        } = &e.what
        {
            if reason.starts_with("node rule") {
                continue; // nothing a policy could open
            }
            match name.clone().or_else(|| names_of.get(dst).cloned()) {
                Some(n) if n.parse::<Ipv4Addr>().is_err() => {
                    domains.insert(n);
                }
                _ => {
                    addrs.insert(*dst);
                }
            }
        }
    }
    domains
        .into_iter()
        .chain(addrs.into_iter().map(|a| a.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connect(dst: &str, name: Option<&str>, verdict: Verdict) -> EventKind {
        EventKind::Connect {
            proto: "tcp".into(),
            dst: dst.parse().unwrap(),
            port: 443,
            name: name.map(str::to_string),
            verdict,
            reason: "r".into(),
            via: "direct".into(),
        }
    }

    #[test]
    fn records_rotates_and_reads() {
        let dir = std::env::temp_dir().join(format!("cubicle-audit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let log = AuditLog::new(dir.clone(), 4096);
        for i in 0..100 {
            log.record(
                "sb1",
                connect(&format!("1.2.3.{i}"), Some("a.test"), Verdict::Allowed),
            );
        }
        let all = log.read("sb1", 0, usize::MAX);
        assert!(
            !all.is_empty() && all.len() < 100,
            "rotation keeps a bounded tail"
        );
        assert_eq!(all.last().unwrap().seq, 100);
        assert!(all.windows(2).all(|w| w[0].seq + 1 == w[1].seq));
        assert_eq!(log.read("sb1", 99, 10).len(), 1);
        let on_disk: u64 = [AuditLog::path(&dir, "sb1"), AuditLog::rotated(&dir, "sb1")]
            .iter()
            .map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
            .sum();
        assert!(on_disk <= 2 * 4096);
        // A new run continues the numbering.
        log.close("sb1");
        let log2 = AuditLog::new(dir.clone(), 4096);
        log2.record("sb1", connect("9.9.9.9", None, Verdict::Denied));
        assert_eq!(log2.read("sb1", 100, 10)[0].seq, 101);
        assert_eq!(log2.read("sb1", 100, 10)[0].level(), "warn");
        log2.remove("sb1");
        assert!(log2.read("sb1", 0, 10).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn learns_an_allow_list() {
        let ev = |what| NetEvent {
            seq: 0,
            at_ms: 0,
            what,
        };
        let events = vec![
            ev(EventKind::Dns {
                name: "git.test".into(),
                qtype: "A".into(),
                verdict: Verdict::Allowed,
                reason: String::new(),
                rcode: "NOERROR".into(),
                answers: vec!["5.5.5.5".into()],
            }),
            ev(connect("1.1.1.1", Some("api.test"), Verdict::Learned)),
            ev(connect("5.5.5.5", None, Verdict::Learned)),
            ev(connect("7.7.7.7", None, Verdict::Denied)),
            ev(connect("1.1.1.2", Some("api.test"), Verdict::Allowed)),
        ];
        assert_eq!(allow_list(&events), vec!["api.test", "git.test", "7.7.7.7"]);
        assert!(events[1].summary().contains("api.test"));
    }
}
