//! `cubicle sandbox metrics ID [-f]`: a sandbox's CPU, memory and disk use from
//! `GET /sandboxes/{id}/metrics` (the server samples every 5 s and keeps 30 minutes), as
//! `e2b sandbox metrics` prints it; `-f` keeps printing new samples until the sandbox
//! is gone.

use std::time::Duration;

use serde_json::Value;

use super::rest::ApiClient;
use crate::output;

/// How often `-f` asks for new samples (the server's sampling step).
const FOLLOW_EVERY: Duration = Duration::from_secs(5);

fn num(v: &Value, key: &str) -> f64 {
    v.get(key).and_then(Value::as_f64).unwrap_or(0.0)
}

fn mib(bytes: f64) -> String {
    format!("{:.1}", bytes / 1048576.0)
}

/// One sample as table cells.
pub fn row(v: &Value) -> [String; 5] {
    let time = v
        .get("timestamp")
        .and_then(Value::as_str)
        .map(|t| t.get(..19).unwrap_or(t).replace('T', " "))
        .unwrap_or_default();
    [
        time,
        format!("{:.1}%", num(v, "cpuUsedPct")),
        format!("{}", num(v, "cpuCount")),
        format!("{} / {}", mib(num(v, "memUsed")), mib(num(v, "memTotal"))),
        format!("{} / {}", mib(num(v, "diskUsed")), mib(num(v, "diskTotal"))),
    ]
}

const HEADER: [&str; 5] = ["TIME (UTC)", "CPU", "VCPUS", "MEMORY MIB", "DISK MIB"];

pub async fn run(api: &ApiClient, id: &str, follow: bool, json: bool) -> anyhow::Result<i32> {
    let samples = api.metrics(id, None).await?;
    let mut last = samples
        .last()
        .map(|s| num(s, "timestampUnix") as i64)
        .unwrap_or(0);
    if json && !follow {
        print!("{}", output::json(&samples)?);
        return Ok(0);
    }
    let print = |rows: &[Value], header: bool| {
        if json {
            for s in rows {
                println!("{s}");
            }
            return;
        }
        let t = output::table(HEADER, rows.iter().map(row));
        let skip = if header { 0 } else { 1 };
        for line in t.lines().skip(skip) {
            println!("{line}");
        }
    };
    print(&samples, true);
    if !follow {
        return Ok(0);
    }
    loop {
        tokio::select! {
            _ = tokio::time::sleep(FOLLOW_EVERY) => {}
            _ = tokio::signal::ctrl_c() => return Ok(0),
        }
        let fresh = match api.metrics(id, Some(last + 1)).await {
            Ok(f) => f,
            Err(e) if e.status() == Some(404) => {
                eprintln!("cubicle: sandbox {id} is gone");
                return Ok(0);
            }
            Err(e) => return Err(e.into()),
        };
        let fresh: Vec<Value> = fresh
            .into_iter()
            .filter(|s| num(s, "timestampUnix") as i64 > last)
            .collect();
        if let Some(s) = fresh.last() {
            last = num(s, "timestampUnix") as i64;
        }
        print(&fresh, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_as_a_row() {
        let v = serde_json::json!({"timestamp":"2026-12-01T10:00:05.123Z","timestampUnix":1,
            "cpuCount":2,"cpuUsedPct":12.345,"memUsed":10485760,"memTotal":536870912,
            "diskUsed":1048576,"diskTotal":5368709120u64});
        assert_eq!(
            row(&v),
            [
                "2026-12-01 10:00:05",
                "12.3%",
                "2",
                "10.0 / 512.0",
                "1.0 / 5120.0"
            ]
        );
    }
}
