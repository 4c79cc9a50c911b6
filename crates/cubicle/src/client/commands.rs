//! The REST-only commands: `create`, `list`, `info`, `kill` (also `kill --all` with
//! filters, and the operator's `--all-teams` view), and their output formats.

use std::collections::BTreeMap;

use serde_json::Value;

use super::ClientError;
use super::args::Filter;
use super::rest::{ApiClient, ListFilter, NewSandbox};
use crate::output::{self, FormatArg};

/// What `sandbox create` asks for.
pub struct CreateArgs {
    pub template: String,
    pub timeout: Option<u64>,
    pub metadata: Vec<(String, String)>,
    pub env: Vec<(String, String)>,
    /// `volumeMounts` items.
    pub volume_mounts: Vec<Value>,
    pub cpus: Option<u32>,
    pub memory_mb: Option<u64>,
    pub disk_mb: Option<u64>,
    /// E2B `network` options.
    pub network: super::args::NetworkFlags,
    pub json: bool,
}

pub async fn create(api: &ApiClient, a: CreateArgs) -> anyhow::Result<i32> {
    let req = NewSandbox {
        template_id: a.template,
        timeout: a.timeout,
        metadata: a.metadata.into_iter().collect(),
        env_vars: a.env.into_iter().collect(),
        volume_mounts: a.volume_mounts,
        network: a.network.any().then(|| a.network.body()),
        cpu_count: a.cpus,
        memory_mb: a.memory_mb,
        disk_mb: a.disk_mb,
        allow_internet_access: None,
    };
    let (sbx, raw) = api.create(&req).await?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&raw)?);
    } else {
        println!("{}", sbx.sandbox_id);
    }
    Ok(0)
}

fn list_filter(f: &Filter) -> ListFilter {
    ListFilter {
        metadata: f.metadata.clone(),
        states: f.states.clone(),
        template: f.template.clone(),
    }
}

/// Every team's sandboxes (`GET /cubicle/sandboxes`), with the filters applied here.
async fn all_teams(api: &ApiClient, f: &Filter) -> anyhow::Result<Vec<Value>> {
    let items = api
        .list_all_teams()
        .await
        .map_err(|e| operator_hint(e, "--all-teams"))?;
    Ok(items
        .into_iter()
        .filter(|v| {
            f.metadata.iter().all(|(k, want)| {
                v.get("metadata")
                    .and_then(|m| m.get(k))
                    .and_then(Value::as_str)
                    == Some(want.as_str())
            }) && (f.states.is_empty() || f.states.iter().any(|st| st == s(v, "state")))
                && f.template
                    .as_ref()
                    .is_none_or(|t| s(v, "templateID") == t || s(v, "alias") == t)
        })
        .collect())
}

/// A 403 from an operator route, said plainly.
fn operator_hint(e: ClientError, flag: &str) -> anyhow::Error {
    if e.status() == Some(403) {
        anyhow::anyhow!(
            "{flag} needs the operator's API key (team admin; `cubicle apikey` prints it): {e}"
        )
    } else {
        e.into()
    }
}

pub async fn list(
    api: &ApiClient,
    filter: &Filter,
    all: bool,
    format: &FormatArg,
) -> anyhow::Result<i32> {
    let items = if all {
        all_teams(api, filter).await?
    } else {
        api.list(&list_filter(filter)).await?
    };
    if format.is_json() {
        print!("{}", output::json(&items)?);
    } else {
        print!("{}", list_table(&items, all));
    }
    Ok(0)
}

fn s<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or("")
}

fn n(v: &Value, key: &str) -> String {
    match v.get(key) {
        Some(Value::Number(x)) => x.to_string(),
        Some(Value::String(x)) => x.clone(),
        _ => String::new(),
    }
}

/// `2026-01-02T03:04:05.123456Z` → `2026-01-02 03:04:05` (display only).
fn short_time(t: &str) -> String {
    if t.len() >= 19 && t.is_char_boundary(19) && t.as_bytes().get(10) == Some(&b'T') {
        format!("{} {}", &t[..10], &t[11..19])
    } else {
        t.to_string()
    }
}

fn metadata_text(v: &Value) -> String {
    match v.get("metadata") {
        Some(Value::Object(m)) => {
            let sorted: BTreeMap<_, _> = m.iter().collect();
            sorted
                .into_iter()
                .map(|(k, v)| {
                    format!(
                        "{k}={}",
                        v.as_str()
                            .map(str::to_string)
                            .unwrap_or_else(|| v.to_string())
                    )
                })
                .collect::<Vec<_>>()
                .join(",")
        }
        _ => String::new(),
    }
}

/// The `list` table (one header line, one line per sandbox; `teams`: a TEAM column).
pub fn list_table(items: &[Value], teams: bool) -> String {
    let rows = items.iter().map(|v| {
        let template = match (s(v, "alias"), s(v, "templateID")) {
            ("", t) => t.to_string(),
            (a, _) => a.to_string(),
        };
        [
            s(v, "team").to_string(),
            s(v, "sandboxID").to_string(),
            template,
            s(v, "state").to_string(),
            short_time(s(v, "startedAt")),
            short_time(s(v, "endAt")),
            n(v, "cpuCount"),
            n(v, "memoryMB"),
            metadata_text(v),
        ]
    });
    let header = [
        "TEAM",
        "SANDBOX ID",
        "TEMPLATE",
        "STATE",
        "STARTED (UTC)",
        "ENDS (UTC)",
        "CPU",
        "MEM MB",
        "METADATA",
    ];
    if teams {
        return output::table(header, rows);
    }
    let header: [&str; 8] = std::array::from_fn(|i| header[i + 1]);
    output::table(
        header,
        rows.map(|mut r| std::array::from_fn::<String, 8, _>(|i| std::mem::take(&mut r[i + 1]))),
    )
}

pub async fn info(api: &ApiClient, id: &str, json: bool) -> anyhow::Result<i32> {
    let v = api.get(id).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", info_text(&v));
    }
    Ok(0)
}

/// `info` as `Key: value` lines.
pub fn info_text(v: &Value) -> String {
    let mut lines: Vec<(&str, String)> = vec![
        ("Sandbox ID", s(v, "sandboxID").into()),
        ("Template", s(v, "templateID").into()),
    ];
    if !s(v, "alias").is_empty() {
        lines.push(("Alias", s(v, "alias").into()));
    }
    lines.extend([
        ("State", s(v, "state").to_string()),
        ("Started", s(v, "startedAt").to_string()),
        ("Ends", s(v, "endAt").to_string()),
        ("CPUs", n(v, "cpuCount")),
        ("Memory", format!("{} MB", n(v, "memoryMB"))),
        ("Disk", format!("{} MB", n(v, "diskSizeMB"))),
        ("envd version", s(v, "envdVersion").to_string()),
    ]);
    if let Some(b) = v.get("allowInternetAccess").and_then(Value::as_bool) {
        lines.push(("Internet access", if b { "yes" } else { "no" }.into()));
    }
    if !s(v, "domain").is_empty() {
        lines.push(("Domain", s(v, "domain").into()));
    }
    lines.push(("Metadata", metadata_text(v)));
    let mut out = String::new();
    for (k, val) in lines {
        out.push_str(&format!("{:<18}{}\n", format!("{k}:"), val));
    }
    out
}

pub async fn kill(api: &ApiClient, ids: &[String]) -> anyhow::Result<i32> {
    let mut code = 0;
    for id in ids {
        match api.kill(id).await {
            Ok(()) => println!("killed {id}"),
            Err(e) if e.status() == Some(404) => {
                eprintln!("cubicle: sandbox {id}: {e}");
                code = 1;
            }
            Err(e) => return Err(anyhow::Error::new(e).context(format!("killing {id}"))),
        }
    }
    Ok(code)
}

/// Pauses, resumes, snapshots and forks can take a while on a loaded host.
const STATEFUL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

pub async fn pause(api: &ApiClient, id: &str, memory: bool) -> anyhow::Result<i32> {
    let path = format!("/sandboxes/{}/pause", super::rest::seg(id));
    let t = std::time::Instant::now();
    match api
        .post_json(
            &path,
            &serde_json::json!({ "memory": memory }),
            STATEFUL_TIMEOUT,
        )
        .await
    {
        Ok(_) => {
            println!("paused {id} ({:.0} ms)", t.elapsed().as_secs_f64() * 1000.0);
            Ok(0)
        }
        Err(e) if e.status() == Some(409) => {
            eprintln!("cubicle: {id}: {e}");
            Ok(1)
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!("pausing {id}"))),
    }
}

pub async fn resume(
    api: &ApiClient,
    id: &str,
    timeout: Option<u64>,
    memory: bool,
) -> anyhow::Result<i32> {
    let path = format!("/v2/sandboxes/{}/connect", super::rest::seg(id));
    let mut body = serde_json::json!({});
    if let Some(t) = timeout {
        body["timeout"] = t.into();
    }
    if !memory {
        body["memory"] = false.into();
    }
    let t = std::time::Instant::now();
    let (status, _) = api
        .post_json(&path, &body, STATEFUL_TIMEOUT)
        .await
        .map_err(|e| anyhow::Error::new(e).context(format!("resuming {id}")))?;
    let took = t.elapsed().as_secs_f64() * 1000.0;
    if status == 201 {
        println!("resumed {id} ({took:.0} ms)");
    } else {
        println!("{id} was running; its end time is extended");
    }
    Ok(0)
}

pub async fn snapshot(
    api: &ApiClient,
    id: &str,
    name: Option<String>,
    memory: bool,
    json: bool,
) -> anyhow::Result<i32> {
    let path = format!("/sandboxes/{}/snapshots", super::rest::seg(id));
    let mut body = serde_json::json!({ "memory": memory });
    if let Some(n) = name {
        body["name"] = n.into();
    }
    let (_, v) = api
        .post_json(&path, &body, STATEFUL_TIMEOUT)
        .await
        .map_err(|e| anyhow::Error::new(e).context(format!("snapshotting {id}")))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("{}", s(&v, "snapshotID"));
    }
    Ok(0)
}

pub async fn snapshots(api: &ApiClient, sandbox: Option<&str>, json: bool) -> anyhow::Result<i32> {
    let items = api.snapshots(sandbox).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&Value::Array(items))?);
    } else {
        println!("{:<40} NAMES", "SNAPSHOT ID");
        for v in &items {
            let names: Vec<&str> = v
                .get("names")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            println!("{:<40} {}", s(v, "snapshotID"), names.join(", "));
        }
    }
    Ok(0)
}

pub async fn delete_snapshot(api: &ApiClient, id: &str) -> anyhow::Result<i32> {
    match api.delete_template(id).await {
        Ok(()) => {
            println!("deleted {id}");
            Ok(0)
        }
        Err(e) if e.status() == Some(404) => {
            eprintln!("cubicle: snapshot {id}: {e}");
            Ok(1)
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!("deleting snapshot {id}"))),
    }
}

pub async fn fork(
    api: &ApiClient,
    id: &str,
    count: u32,
    timeout: Option<u64>,
    json: bool,
) -> anyhow::Result<i32> {
    let path = format!("/sandboxes/{}/fork", super::rest::seg(id));
    let mut body = serde_json::json!({ "count": count });
    if let Some(t) = timeout {
        body["timeout"] = t.into();
    }
    let (_, v) = api
        .post_json(&path, &body, STATEFUL_TIMEOUT)
        .await
        .map_err(|e| anyhow::Error::new(e).context(format!("forking {id}")))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    let mut code = 0;
    for item in v.as_array().into_iter().flatten() {
        match (item.get("sandbox"), item.get("error")) {
            (Some(sbx), _) => println!("{}", s(sbx, "sandboxID")),
            (_, Some(err)) => {
                eprintln!(
                    "cubicle: a fork failed: {} ({})",
                    s(err, "message"),
                    n(err, "code")
                );
                code = 1;
            }
            _ => {
                eprintln!(
                    "cubicle: the server answered a fork with neither a sandbox nor an error"
                );
                code = 1;
            }
        }
    }
    Ok(code)
}

/// `kill --all`: every sandbox the filter selects (of every team with `all_teams`).
pub async fn kill_all(
    api: &ApiClient,
    filter: &Filter,
    all_teams_too: bool,
) -> anyhow::Result<i32> {
    let items = if all_teams_too {
        all_teams(api, filter).await?
    } else {
        api.list(&list_filter(filter)).await?
    };
    if items.is_empty() {
        eprintln!("cubicle: no sandbox matches");
        return Ok(0);
    }
    let mut code = 0;
    for v in &items {
        let id = s(v, "sandboxID");
        let r = if all_teams_too {
            api.kill_any_team(id).await
        } else {
            api.kill(id).await
        };
        match r {
            Ok(()) => println!("killed {id}"),
            // Gone meanwhile: what was asked for is true.
            Err(e) if e.status() == Some(404) => println!("killed {id} (already gone)"),
            Err(e) => {
                eprintln!("cubicle: killing {id}: {e}");
                code = 1;
            }
        }
    }
    Ok(code)
}

pub async fn rollback(api: &ApiClient, id: &str, snapshot: &str) -> anyhow::Result<i32> {
    let path = format!("/sandboxes/{}/rollback", super::rest::seg(id));
    let t = std::time::Instant::now();
    api.post_json(
        &path,
        &serde_json::json!({ "snapshotID": snapshot }),
        STATEFUL_TIMEOUT,
    )
    .await
    .map_err(|e| anyhow::Error::new(e).context(format!("rolling {id} back to {snapshot}")))?;
    println!(
        "rolled {id} back to {snapshot} ({:.0} ms)",
        t.elapsed().as_secs_f64() * 1000.0
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn table_and_info_render() {
        let items = vec![
            json!({"sandboxID":"abc","templateID":"tiny","state":"running",
                   "startedAt":"2026-11-30T12:00:00.123Z","endAt":"2026-11-30T12:05:00Z",
                   "cpuCount":2,"memoryMB":512,"metadata":{"b":"2","a":"1"}}),
            json!({"sandboxID":"longerid0","templateID":"t","alias":"base","state":"paused"}),
        ];
        let t = list_table(&items, false);
        let lines: Vec<_> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("SANDBOX ID  TEMPLATE  STATE"), "{t}");
        assert!(lines[1].starts_with("abc         tiny      running  2026-11-30 12:00:00  2026-11-30 12:05:00  2    512     a=1,b=2"), "{t}");
        assert!(lines[2].starts_with("longerid0   base      paused"), "{t}");

        let i = info_text(&items[0]);
        assert!(i.contains("Sandbox ID:       abc\n"), "{i}");
        assert!(i.contains("Memory:           512 MB\n"), "{i}");
        assert!(i.contains("Metadata:         a=1,b=2\n"), "{i}");
        assert_eq!(list_table(&[], false).lines().count(), 1);
        let mut with_team = items[0].clone();
        with_team["team"] = json!("other");
        let t = list_table(&[with_team], true);
        assert!(t.starts_with("TEAM   SANDBOX ID  TEMPLATE"), "{t}");
        assert!(t.lines().nth(1).unwrap().starts_with("other  abc "), "{t}");
    }
}
