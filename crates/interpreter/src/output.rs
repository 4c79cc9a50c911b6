//! NDJSON output lines of `POST /execute` (spec §4.1) and the Jupyter MIME bundle →
//! `result` mapping.

use serde_json::{Map, Value, json};

/// MIME type → `result` field.
const MIME_FIELDS: &[(&str, &str)] = &[
    ("text/plain", "text"),
    ("text/html", "html"),
    ("text/markdown", "markdown"),
    ("image/svg+xml", "svg"),
    ("image/png", "png"),
    ("image/jpeg", "jpeg"),
    ("application/pdf", "pdf"),
    ("text/latex", "latex"),
    ("application/json", "json"),
    ("application/javascript", "javascript"),
    ("e2b/data", "data"),
    ("e2b/chart", "chart"),
];

/// Jupyter bundles may carry multi-line strings as lists of lines.
fn joined(v: &Value) -> Value {
    match v {
        Value::Array(a) if a.iter().all(Value::is_string) => {
            Value::String(a.iter().filter_map(Value::as_str).collect::<String>())
        }
        other => other.clone(),
    }
}

/// One pair of surrounding quotes stripped (as upstream does for `text/plain`).
fn strip_quotes(s: &str) -> &str {
    for q in ['\'', '"'] {
        if s.len() >= 2 && s.starts_with(q) && s.ends_with(q) {
            return &s[1..s.len() - 1];
        }
    }
    s
}

/// A `result` line from a `display_data`/`execute_result` content's `data` bundle.
pub fn result_line(bundle: &Value, is_main_result: bool) -> Value {
    let mut out = Map::new();
    out.insert("type".into(), "result".into());
    let mut extra = Map::new();
    if let Some(data) = bundle.as_object() {
        for (mime, v) in data {
            let v = joined(v);
            match MIME_FIELDS.iter().find(|(m, _)| m == mime) {
                Some((_, "text")) => {
                    let t = v.as_str().map(strip_quotes).unwrap_or_default();
                    out.insert("text".into(), t.into());
                }
                Some((_, field)) => {
                    out.insert((*field).into(), v);
                }
                None => {
                    extra.insert(mime.clone(), v);
                }
            }
        }
    }
    out.insert("extra".into(), Value::Object(extra));
    out.insert("is_main_result".into(), is_main_result.into());
    Value::Object(out)
}

pub fn stream_line(name: &str, text: &str, timestamp: Value) -> Value {
    let kind = if name == "stderr" { "stderr" } else { "stdout" };
    json!({"type": kind, "text": text, "timestamp": timestamp})
}

/// An `error` line from Jupyter `error` content (traceback joined with newlines).
pub fn error_from_content(c: &Value) -> Value {
    let tb = match c.get("traceback") {
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    };
    json!({
        "type": "error",
        "name": c.get("ename").and_then(Value::as_str).unwrap_or("Error"),
        "value": c.get("evalue").and_then(Value::as_str).unwrap_or(""),
        "traceback": tb,
    })
}

pub fn error_line(name: &str, value: &str) -> Value {
    json!({"type": "error", "name": name, "value": value, "traceback": ""})
}

pub fn count_line(n: i64) -> Value {
    json!({"type": "number_of_executions", "execution_count": n})
}

pub fn simple(kind: &str) -> Value {
    json!({ "type": kind })
}

/// Serialize a line with its trailing newline.
pub fn ndjson(v: &Value) -> bytes::Bytes {
    let mut b = serde_json::to_vec(v).unwrap_or_default();
    b.push(b'\n');
    b.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_mime_bundle() {
        let b = json!({
            "text/plain": "'hi'",
            "text/html": ["<b>", "x</b>"],
            "image/png": "iVBOR",
            "application/json": {"a": 1},
            "e2b/data": {"col": {"0": 1}},
            "application/vnd.custom": "z",
        });
        let r = result_line(&b, true);
        assert_eq!(r["type"], "result");
        assert_eq!(r["text"], "hi");
        assert_eq!(r["html"], "<b>x</b>");
        assert_eq!(r["png"], "iVBOR");
        assert_eq!(r["json"]["a"], 1);
        assert_eq!(r["data"]["col"]["0"], 1);
        assert_eq!(r["extra"]["application/vnd.custom"], "z");
        assert_eq!(r["is_main_result"], true);
        assert!(r.get("svg").is_none());
        let r = result_line(&json!({"text/plain": "2"}), false);
        assert_eq!(r["text"], "2");
        assert_eq!(r["extra"], json!({}));
        assert_eq!(r["is_main_result"], false);
    }

    #[test]
    fn error_and_stream_lines() {
        let e = error_from_content(
            &json!({"ename": "ZeroDivisionError", "evalue": "division by zero", "traceback": ["a", "b"]}),
        );
        assert_eq!(
            e,
            json!({"type": "error", "name": "ZeroDivisionError", "value": "division by zero", "traceback": "a\nb"})
        );
        let s = stream_line("stderr", "x\n", json!("2026-01-01T00:00:00Z"));
        assert_eq!(s["type"], "stderr");
        assert_eq!(s["timestamp"], "2026-01-01T00:00:00Z");
        assert_eq!(
            ndjson(&count_line(3)).as_ref(),
            b"{\"execution_count\":3,\"type\":\"number_of_executions\"}\n"
        );
        assert_eq!(strip_quotes("\"a\""), "a");
        assert_eq!(strip_quotes("'"), "'");
    }
}
