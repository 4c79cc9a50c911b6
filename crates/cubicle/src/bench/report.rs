//! The bench's result rows: samples and extra columns, nearest-rank percentiles, and the
//! two outputs (a table, or one JSON object per line).

use std::time::Duration;

use serde_json::{Value, json};

/// One result line.
#[derive(Debug, Clone)]
pub(super) struct Row {
    pub(super) name: String,
    pub(super) concurrency: usize,
    pub(super) samples: Vec<Duration>,
    pub(super) errors: usize,
    pub(super) extra: serde_json::Map<String, Value>,
}

pub(super) fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// Nearest-rank percentile of sorted samples.
pub(super) fn pct(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

impl Row {
    pub(super) fn new(name: &str, concurrency: usize) -> Row {
        Row {
            name: name.into(),
            concurrency,
            samples: Vec::new(),
            errors: 0,
            extra: Default::default(),
        }
    }

    pub(super) fn with(mut self, k: &str, v: impl Into<Value>) -> Row {
        self.extra.insert(k.into(), v.into());
        self
    }

    pub(super) fn p50(&self) -> f64 {
        let mut s = self.samples.clone();
        s.sort();
        ms(pct(&s, 0.5))
    }

    pub(super) fn to_json(&self) -> Value {
        let mut s = self.samples.clone();
        s.sort();
        let mut m = serde_json::Map::new();
        m.insert("name".into(), json!(self.name));
        m.insert("concurrency".into(), json!(self.concurrency));
        m.insert("n".into(), json!(s.len()));
        m.insert("p50_ms".into(), json!(ms(pct(&s, 0.50))));
        m.insert("p95_ms".into(), json!(ms(pct(&s, 0.95))));
        m.insert("p99_ms".into(), json!(ms(pct(&s, 0.99))));
        m.insert(
            "max_ms".into(),
            json!(ms(s.last().copied().unwrap_or_default())),
        );
        m.insert("errors".into(), json!(self.errors));
        for (k, v) in &self.extra {
            m.insert(k.clone(), v.clone());
        }
        Value::Object(m)
    }
}

pub(super) fn print_header() {
    println!(
        "{:<8} {:<10} {:>4} {:>6} {:>9} {:>9} {:>9} {:>9} {:>6}  details",
        "MEASURE", "TEMPLATE", "C", "N", "P50 ms", "P95 ms", "P99 ms", "MAX ms", "ERR"
    );
}

pub(super) fn print_row(r: &Row, as_json: bool) {
    if as_json {
        println!("{}", r.to_json());
        return;
    }
    let v = r.to_json();
    let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
    let details: Vec<String> = r
        .extra
        .iter()
        .filter(|(k, _)| k.as_str() != "template")
        .map(|(k, v)| match v {
            Value::String(s) => format!("{k}={s}"),
            other => format!("{k}={other}"),
        })
        .collect();
    println!(
        "{:<8} {:<10} {:>4} {:>6} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>6}  {}",
        r.name,
        r.extra
            .get("template")
            .and_then(Value::as_str)
            .unwrap_or("-"),
        r.concurrency,
        r.samples.len(),
        f("p50_ms"),
        f("p95_ms"),
        f("p99_ms"),
        f("max_ms"),
        r.errors,
        details.join(" ")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let s: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(pct(&s, 0.5), Duration::from_millis(50));
        assert_eq!(pct(&s, 0.99), Duration::from_millis(99));
        assert_eq!(pct(&s, 1.0), Duration::from_millis(100));
        assert_eq!(pct(&[], 0.5), Duration::ZERO);
    }

    #[test]
    fn json_row_has_the_required_fields() {
        let mut r = Row::new("create", 50).with("pool", "off");
        r.samples = vec![Duration::from_millis(3), Duration::from_millis(5)];
        r.errors = 1;
        let v = r.to_json();
        for k in [
            "name",
            "concurrency",
            "n",
            "p50_ms",
            "p95_ms",
            "p99_ms",
            "max_ms",
            "errors",
            "pool",
        ] {
            assert!(v.get(k).is_some(), "missing {k}");
        }
        assert_eq!(v["n"], 2);
        assert_eq!(v["p50_ms"], 3.0);
        assert_eq!(v["max_ms"], 5.0);
    }
}
