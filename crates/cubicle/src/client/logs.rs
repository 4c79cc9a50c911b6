//! `cubicle sandbox logs ID [--follow]`: the sandbox's log lines (envd and start-command
//! output) from the REST API; `--follow` polls for new lines (cursor = the last line's
//! timestamp, lines already printed at that instant skipped) until the sandbox is gone
//! (`GET /sandboxes/{id}` answers 404; the logs themselves outlive it).

use std::time::Duration;

use super::rest::{ApiClient, LogEntry, LogsApi};

/// How often `--follow` asks for new lines.
const POLL: Duration = Duration::from_secs(1);

/// RFC 3339 (`2026-01-02T03:04:05.123Z`, `…+02:00`) → Unix milliseconds.
pub fn rfc3339_ms(t: &str) -> Option<i64> {
    let b = t.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let s = t.get(r)?;
        if !s.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, s) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if b[13] != b':' || b[16] != b':' || !(1..=12).contains(&mo) || !(1..=31).contains(&d) {
        return None;
    }
    let mut i = 19;
    let mut ms = 0i64;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        let frac = t.get(start..i)?;
        if frac.is_empty() {
            return None;
        }
        let digits: String = frac.chars().chain("000".chars()).take(3).collect();
        ms = digits.parse().ok()?;
    }
    let offset_min = match t.get(i..)? {
        "Z" | "z" => 0,
        rest if rest.len() == 6 && (rest.starts_with('+') || rest.starts_with('-')) => {
            let oh = num(i + 1..i + 3)?;
            let om = num(i + 4..i + 6)?;
            let sign = if rest.starts_with('-') { -1 } else { 1 };
            sign * (oh * 60 + om)
        }
        _ => return None,
    };
    // Days from civil (Howard Hinnant's algorithm).
    let y2 = if mo <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 86_400 + h * 3600 + mi * 60 + s - offset_min * 60) * 1000) + ms)
}

/// Remembers what was printed so repeated polls print each line once.
#[derive(Default)]
pub struct Follower {
    /// Timestamp (ms) of the newest line printed.
    last_ms: Option<i64>,
    /// Lines printed at exactly `last_ms` (the next poll starts there again).
    at_last: Vec<LogEntry>,
}

impl Follower {
    /// The cursor for the next request.
    pub fn cursor(&self) -> Option<i64> {
        self.last_ms
    }

    /// The entries of a poll that were not printed before.
    pub fn fresh(&mut self, entries: Vec<LogEntry>) -> Vec<LogEntry> {
        // Lines printed at the newest instant come back (the cursor is inclusive): each
        // may be matched once per poll; a true repeat beyond that prints.
        let mut printed = self.at_last.clone();
        let mut out = Vec::new();
        for e in entries {
            if let (Some(m), Some(last)) = (rfc3339_ms(&e.timestamp), self.last_ms) {
                if m < last {
                    continue;
                }
                if m == last
                    && let Some(pos) = printed.iter().position(|p| p == &e)
                {
                    printed.remove(pos);
                    continue;
                }
            }
            out.push(e);
        }
        for e in &out {
            if let Some(m) = rfc3339_ms(&e.timestamp) {
                if Some(m) != self.last_ms {
                    self.last_ms = Some(m);
                    self.at_last.clear();
                }
                self.at_last.push(e.clone());
            }
        }
        out
    }
}

fn print(entries: &[LogEntry], timestamps: bool) {
    for e in entries {
        let line = e.message.strip_suffix('\n').unwrap_or(&e.message);
        if timestamps {
            println!("{} {line}", e.timestamp);
        } else {
            println!("{line}");
        }
    }
}

pub async fn run(api: &ApiClient, id: &str, follow: bool, timestamps: bool) -> anyhow::Result<i32> {
    let mut which: Option<LogsApi> = None;
    let mut f = Follower::default();
    let mut last_round = !follow;
    loop {
        let entries = match api.logs(id, f.cursor(), &mut which).await {
            Ok(e) => e,
            Err(e) if follow && f.cursor().is_some() && e.status() == Some(404) => {
                eprintln!("cubicle: sandbox {id} is gone");
                return Ok(0);
            }
            Err(e) => return Err(e.into()),
        };
        print(&f.fresh(entries), timestamps);
        if last_round {
            if follow {
                eprintln!("cubicle: sandbox {id} has ended");
            }
            return Ok(0);
        }
        tokio::time::sleep(POLL).await;
        // Logs outlive their sandbox (the server keeps them a while): follow until the
        // sandbox itself is gone, then print what came last.
        match api.get(id).await {
            Ok(_) => {}
            Err(e) if e.status() == Some(404) => last_round = true,
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rfc3339() {
        assert_eq!(rfc3339_ms("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(rfc3339_ms("1970-01-01T00:00:01.5Z"), Some(1500));
        assert_eq!(
            rfc3339_ms("2026-11-30T12:09:26.123456789Z"),
            Some(1_796_040_566_123)
        );
        assert_eq!(
            rfc3339_ms("2026-11-30T14:09:26.123+02:00"),
            Some(1_796_040_566_123)
        );
        assert_eq!(rfc3339_ms("2000-02-29T00:00:00Z"), Some(951_782_400_000));
        assert_eq!(rfc3339_ms("2026-11-30"), None);
        assert_eq!(rfc3339_ms("2026-13-30T12:09:26Z"), None);
        assert_eq!(rfc3339_ms("2026-11-30T12:09:26"), None);
        assert_eq!(rfc3339_ms("2026-11-30T12:09:26.Z"), None);
        assert_eq!(rfc3339_ms("2026-11-30T12:09:26Zjunk"), None);
    }

    fn e(ts: &str, m: &str) -> LogEntry {
        LogEntry {
            timestamp: ts.into(),
            message: m.into(),
            level: None,
        }
    }

    #[test]
    fn follower_prints_each_line_once() {
        let mut f = Follower::default();
        let t1 = "2026-01-01T00:00:01Z";
        let t2 = "2026-01-01T00:00:02Z";
        let p = f.fresh(vec![e(t1, "a"), e(t2, "b"), e(t2, "c")]);
        assert_eq!(p.len(), 3);
        assert_eq!(f.cursor(), rfc3339_ms(t2));
        // The next poll starts at t2 (inclusive): b and c come back, d is new.
        let p = f.fresh(vec![e(t2, "b"), e(t2, "c"), e(t2, "d")]);
        assert_eq!(p, vec![e(t2, "d")]);
        let p = f.fresh(vec![
            e(t2, "b"),
            e(t2, "c"),
            e(t2, "d"),
            e("2026-01-01T00:00:03Z", "x"),
        ]);
        assert_eq!(p, vec![e("2026-01-01T00:00:03Z", "x")]);
        // Older lines (a server ignoring the cursor) are skipped.
        assert!(f.fresh(vec![e(t1, "a")]).is_empty());
    }
}
