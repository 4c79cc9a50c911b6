//! `cubicle sandbox netlog ID [--follow] [--json] [--allowlist]`: a sandbox's network
//! audit trail (`GET /cubicle/sandboxes/{id}/netlog`): every DNS question and answer and
//! every connection attempt with its verdict and reason, and the bytes of connections
//! that ended. `--follow` polls for new events until the sandbox is gone; `--allowlist`
//! prints the `allowOut` list learnt from the whole trail (learn mode).

use std::time::Duration;

use serde_json::Value;

use super::rest::ApiClient;

/// How often `--follow` asks for new events.
const POLL: Duration = Duration::from_millis(500);

/// `2026-01-02T03:04:05.678Z` for Unix ms.
fn time(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms.rem_euclid(1000)
    )
}

/// One event as a line of text.
pub fn line(e: &Value) -> String {
    let s = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    let n = |k: &str| e.get(k).and_then(Value::as_u64).unwrap_or(0);
    let at = time(e.get("atMs").and_then(Value::as_i64).unwrap_or(0));
    let name = e
        .get("name")
        .and_then(Value::as_str)
        .map(|n| format!(" ({n})"))
        .unwrap_or_default();
    match s("type").as_str() {
        "dns" => {
            let answers: Vec<&str> = e
                .get("answers")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let ans = if answers.is_empty() {
                s("rcode")
            } else {
                answers.join(", ")
            };
            format!(
                "{at} dns {:<7} {} {} → {ans}  [{}]",
                s("verdict"),
                s("qtype"),
                s("name"),
                s("reason")
            )
        }
        "connect" => format!(
            "{at} {} {:<7} {}:{}{name} via {}  [{}]",
            s("proto"),
            s("verdict"),
            s("dst"),
            n("port"),
            s("via"),
            s("reason")
        ),
        "close" => {
            let err = e
                .get("error")
                .and_then(Value::as_str)
                .map(|x| format!("  error: {x}"))
                .unwrap_or_default();
            format!(
                "{at} {} closed  {}:{}{name}  {} B out, {} B in, {} ms{err}",
                s("proto"),
                s("dst"),
                n("port"),
                n("bytesOut"),
                n("bytesIn"),
                n("durationMs")
            )
        }
        other => format!("{at} {other} {e}"),
    }
}

pub async fn run(
    api: &ApiClient,
    id: &str,
    follow: bool,
    json: bool,
    allowlist: bool,
) -> anyhow::Result<i32> {
    if allowlist {
        // Only the allow list: no events (after the highest number there can be).
        let v = api.netlog(id, i64::MAX as u64, true).await?;
        let out = serde_json::json!({
            "allowOut": v.get("allowOut").cloned().unwrap_or(Value::Array(vec![])),
            "denyOut": v.get("denyOut").cloned().unwrap_or(Value::Array(vec![])),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(0);
    }
    let mut after = 0u64;
    loop {
        let v = api.netlog(id, after, false).await?;
        let events = v
            .get("events")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        for e in &events {
            after = after.max(e.get("seq").and_then(Value::as_u64).unwrap_or(after));
            if json {
                println!("{e}");
            } else {
                println!("{}", line(e));
            }
        }
        if !follow {
            return Ok(0);
        }
        if events.is_empty() {
            // The trail outlives the sandbox: stop once it is gone and nothing is new.
            if let Err(e) = api.get(id).await
                && e.status() == Some(404)
            {
                return Ok(0);
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines() {
        assert_eq!(time(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(time(1_796_041_122_753), "2026-11-30T12:18:42.753Z");
        let e = serde_json::json!({"seq":1,"atMs":0,"type":"connect","proto":"tcp","dst":"1.2.3.4","port":443,"name":"a.test","verdict":"denied","reason":"r","via":"direct"});
        assert_eq!(
            line(&e),
            "1970-01-01T00:00:00.000Z tcp denied  1.2.3.4:443 (a.test) via direct  [r]"
        );
    }
}
