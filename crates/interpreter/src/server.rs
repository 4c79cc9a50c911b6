//! HTTP API on port 49999 (spec §4): `/execute` (NDJSON stream), `/contexts`, `/health`.
//!
//! Each context owns one kernel behind an async mutex, so executions in a context run
//! one at a time. An execution runs in its own task writing lines into a channel that
//! backs the response body: when the client goes away (disconnect or SDK timeout) the
//! channel closes, the kernel gets SIGINT and the task still drains the execution to
//! `idle`, so the next execution in the context starts clean. Kernel death ends the
//! running execution with an `error` line (`DeadKernelError`); `restart` gives a fresh one.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes as AxBytes};
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::kernel::{Kernel, Launcher};
use crate::output;

pub struct App {
    pub launcher: Launcher,
    pub default_cwd: String,
    /// Sandbox-global env (from envd `/envs`), injected on a context's first execution.
    pub global_env: BTreeMap<String, String>,
    contexts: Mutex<HashMap<String, Arc<Ctx>>>,
    defaults: tokio::sync::Mutex<HashMap<String, String>>,
}

pub struct Ctx {
    id: String,
    language: String,
    cwd: String,
    current: Mutex<Option<Arc<Kernel>>>,
    run: tokio::sync::Mutex<RunState>,
}

struct RunState {
    kernel: Option<Arc<Kernel>>,
    env_injected: bool,
}

fn text(status: StatusCode, msg: impl Into<String>) -> Response {
    (status, [(header::CONTENT_TYPE, "text/plain")], msg.into()).into_response()
}

pub fn normalize_language(l: &str) -> String {
    match l.trim().to_ascii_lowercase().as_str() {
        "js" => "javascript".into(),
        "ts" => "typescript".into(),
        "sh" => "bash".into(),
        "" => "python".into(),
        other => other.into(),
    }
}

/// Python code that registers the `e2b/data` (pandas) and `e2b/chart` (matplotlib via
/// e2b-charts) display formatters, lazily by type name so nothing is imported up front.
const PYTHON_SETUP: &str = r#"
def __cubicle_setup():
    import json
    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode
    ip = get_ipython()
    fm = ip.display_formatter
    class _Data(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict, list)
    class _Chart(BaseFormatter):
        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict, list)
    fm.formatters["e2b/data"] = _Data(parent=fm)
    fm.formatters["e2b/chart"] = _Chart(parent=fm)
    fm.active_types = list(fm.active_types) + ["e2b/data", "e2b/chart"]
    def _df(df):
        return json.loads(df.to_json(date_format="iso"))
    def _chart(fig):
        # Registered for `object` (a by-name registration for matplotlib's Figure does
        # not survive the inline backend's set-up): anything but a Figure is skipped.
        if type(fig).__name__ != "Figure" or not type(fig).__module__.startswith("matplotlib"):
            return None
        try:
            from e2b_charts import chart_figure_to_dict
            d = chart_figure_to_dict(fig)
            return d or None
        except Exception:
            return None
    for mod in ("pandas", "pandas.core.frame"):
        fm.formatters["e2b/data"].for_type_by_name(mod, "DataFrame", _df)
    fm.formatters["e2b/chart"].for_type(object, _chart)
__cubicle_setup()
del __cubicle_setup
"#;

fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

fn py_str(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// Code (in the kernel's language) setting `vars`.
fn set_env_code(lang: &str, vars: &BTreeMap<String, String>) -> String {
    if is_js(lang) {
        vars.iter()
            .map(|(k, v)| format!("Deno.env.set({}, {});\n", py_str(k), py_str(v)))
            .collect()
    } else if lang == "bash" {
        vars.iter()
            .filter(|(k, _)| is_env_name(k))
            .map(|(k, v)| format!("export {k}={}\n", sh_quote(v)))
            .collect()
    } else {
        let m: serde_json::Map<String, Value> = vars
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        format!(
            "import os as __cb_os\n__cb_os.environ.update(__import__('json').loads({}))\ndel __cb_os\n",
            py_str(&Value::Object(m).to_string())
        )
    }
}

/// Code restoring `keys` to their global value (or removing them).
fn restore_env_code(lang: &str, keys: &[&String], global: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    if is_js(lang) {
        for k in keys {
            match global.get(*k) {
                Some(v) => out.push_str(&format!("Deno.env.set({}, {});\n", py_str(k), py_str(v))),
                None => out.push_str(&format!("Deno.env.delete({});\n", py_str(k))),
            }
        }
    } else if lang == "bash" {
        for k in keys.iter().filter(|k| is_env_name(k)) {
            match global.get(*k) {
                Some(v) => out.push_str(&format!("export {k}={}\n", sh_quote(v))),
                None => out.push_str(&format!("unset {k}\n")),
            }
        }
    } else {
        out.push_str("import os as __cb_os\n");
        for k in keys {
            match global.get(*k) {
                Some(v) => {
                    out.push_str(&format!("__cb_os.environ[{}] = {}\n", py_str(k), py_str(v)))
                }
                None => out.push_str(&format!("__cb_os.environ.pop({}, None)\n", py_str(k))),
            }
        }
        out.push_str("del __cb_os\n");
    }
    out
}

fn is_js(lang: &str) -> bool {
    lang == "javascript" || lang == "typescript"
}

fn is_env_name(k: &str) -> bool {
    !k.is_empty()
        && k.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_')
        && !k.as_bytes()[0].is_ascii_digit()
}

impl App {
    pub fn new(
        launcher: Launcher,
        default_cwd: String,
        global_env: BTreeMap<String, String>,
    ) -> Arc<App> {
        Arc::new(App {
            launcher,
            default_cwd,
            global_env,
            contexts: Mutex::default(),
            defaults: tokio::sync::Mutex::default(),
        })
    }

    async fn start_kernel(&self, language: &str, cwd: &str) -> Result<Arc<Kernel>, String> {
        let k = Kernel::start(&self.launcher, language, cwd, &[])
            .await
            .map_err(|e| e.to_string())?;
        if language == "python" {
            let _ = run_hidden(&k, PYTHON_SETUP).await;
        }
        Ok(k)
    }

    /// Create a context with a fresh kernel.
    async fn create_context(&self, language: &str, cwd: Option<&str>) -> Result<Arc<Ctx>, String> {
        let cwd = cwd
            .filter(|c| !c.is_empty())
            .unwrap_or(&self.default_cwd)
            .to_string();
        let k = self.start_kernel(language, &cwd).await?;
        let ctx = Arc::new(Ctx {
            id: jupyter_id(),
            language: language.to_string(),
            cwd,
            current: Mutex::new(Some(k.clone())),
            run: tokio::sync::Mutex::new(RunState {
                kernel: Some(k),
                env_injected: false,
            }),
        });
        if let Ok(mut m) = self.contexts.lock() {
            m.insert(ctx.id.clone(), ctx.clone());
        }
        Ok(ctx)
    }

    fn get(&self, id: &str) -> Option<Arc<Ctx>> {
        self.contexts.lock().ok().and_then(|m| m.get(id).cloned())
    }

    /// The default context of a language, created on first use.
    pub async fn default_context(&self, language: &str) -> Result<Arc<Ctx>, String> {
        let mut d = self.defaults.lock().await;
        if let Some(c) = d.get(language).and_then(|id| self.get(id)) {
            return Ok(c);
        }
        let c = self.create_context(language, None).await?;
        d.insert(language.to_string(), c.id.clone());
        Ok(c)
    }
}

fn jupyter_id() -> String {
    crate::jupyter::random_id()
}

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route(
            "/health",
            get(|| async { (StatusCode::OK, axum::Json("OK")) }),
        )
        .route("/execute", post(execute))
        .route("/contexts", get(list_contexts).post(create_context))
        .route("/contexts/{id}", delete(delete_context))
        .route("/contexts/{id}/restart", post(restart_context))
        .with_state(app)
}

fn ctx_json(c: &Ctx) -> Value {
    json!({"id": c.id, "language": c.language, "cwd": c.cwd})
}

async fn list_contexts(State(app): State<Arc<App>>) -> Response {
    let mut v: Vec<Value> = app
        .contexts
        .lock()
        .map(|m| m.values().map(|c| ctx_json(c)).collect())
        .unwrap_or_default();
    v.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    axum::Json(Value::Array(v)).into_response()
}

#[derive(Deserialize, Default)]
struct CreateReq {
    language: Option<String>,
    cwd: Option<String>,
}

async fn create_context(State(app): State<Arc<App>>, body: AxBytes) -> Response {
    let req: CreateReq = if body.is_empty() {
        CreateReq::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => return text(StatusCode::BAD_REQUEST, format!("invalid request: {e}")),
        }
    };
    let lang = normalize_language(req.language.as_deref().unwrap_or("python"));
    match app.create_context(&lang, req.cwd.as_deref()).await {
        Ok(c) => axum::Json(ctx_json(&c)).into_response(),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

async fn delete_context(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    let removed = app.contexts.lock().ok().and_then(|mut m| m.remove(&id));
    match removed {
        Some(c) => {
            if let Some(k) = c.current.lock().ok().and_then(|mut k| k.take()) {
                k.kill();
            }
            let mut run = c.run.lock().await;
            run.kernel = None;
            StatusCode::OK.into_response()
        }
        None => text(StatusCode::NOT_FOUND, format!("Context {id} not found")),
    }
}

async fn restart_context(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    let Some(c) = app.get(&id) else {
        return text(StatusCode::NOT_FOUND, format!("Context {id} not found"));
    };
    // Kill first: a running execution sees the death and releases the context.
    if let Some(k) = c.current.lock().ok().and_then(|k| k.clone()) {
        k.kill();
    }
    let mut run = c.run.lock().await;
    run.kernel = None;
    match app.start_kernel(&c.language, &c.cwd).await {
        Ok(k) => {
            if let Ok(mut cur) = c.current.lock() {
                *cur = Some(k.clone());
            }
            run.kernel = Some(k);
            run.env_injected = false;
            StatusCode::OK.into_response()
        }
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

#[derive(Deserialize)]
struct ExecReq {
    code: String,
    context_id: Option<String>,
    language: Option<String>,
    env_vars: Option<BTreeMap<String, String>>,
}

async fn execute(State(app): State<Arc<App>>, body: AxBytes) -> Response {
    let req: ExecReq = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return text(StatusCode::BAD_REQUEST, format!("invalid request: {e}")),
    };
    if req.context_id.is_some() && req.language.is_some() {
        return text(
            StatusCode::BAD_REQUEST,
            "context_id and language are mutually exclusive",
        );
    }
    let ctx = match &req.context_id {
        Some(id) => match app.get(id) {
            Some(c) => c,
            None => return text(StatusCode::NOT_FOUND, format!("Context {id} not found")),
        },
        None => {
            let lang = normalize_language(req.language.as_deref().unwrap_or("python"));
            match app.default_context(&lang).await {
                Ok(c) => c,
                Err(e) => return text(StatusCode::INTERNAL_SERVER_ERROR, e),
            }
        }
    };
    let (tx, rx) = mpsc::channel::<Value>(64);
    tokio::spawn(run_execution(
        app.clone(),
        ctx,
        req.code,
        req.env_vars.unwrap_or_default(),
        tx,
    ));
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|v| (Ok::<_, Infallible>(output::ndjson(&v)), rx))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn run_execution(
    app: Arc<App>,
    ctx: Arc<Ctx>,
    code: String,
    env_vars: BTreeMap<String, String>,
    tx: mpsc::Sender<Value>,
) {
    let mut run = ctx.run.lock().await;
    let Some(kernel) = run.kernel.clone().filter(|k| !k.is_dead()) else {
        let _ = tx
            .send(output::error_line(
                "DeadKernelError",
                "the kernel of this context is not running; restart the context",
            ))
            .await;
        let _ = tx.send(output::simple("end_of_execution")).await;
        return;
    };
    if !run.env_injected {
        run.env_injected = true;
        if !app.global_env.is_empty() {
            let _ = run_hidden(&kernel, &set_env_code(&ctx.language, &app.global_env)).await;
        }
    }
    if !env_vars.is_empty() {
        let _ = run_hidden(&kernel, &set_env_code(&ctx.language, &env_vars)).await;
    }
    run_code(&kernel, &code, &tx).await;
    if !env_vars.is_empty() && !kernel.is_dead() {
        let keys: Vec<&String> = env_vars.keys().collect();
        let _ = run_hidden(
            &kernel,
            &restore_env_code(&ctx.language, &keys, &app.global_env),
        )
        .await;
    }
    let _ = tx.send(output::simple("end_of_execution")).await;
}

/// Run code silently (no history, outputs ignored) and wait until the kernel is idle.
async fn run_hidden(kernel: &Kernel, code: &str) -> bool {
    let Ok((id, mut rx)) = kernel.request(
        "execute_request",
        json!({"code": code, "silent": true, "store_history": false, "user_expressions": {}, "allow_stdin": false, "stop_on_error": false}),
    ) else {
        return false;
    };
    let mut dead = kernel.dead_watch();
    let (mut idle, mut reply) = (false, false);
    let ok = loop {
        tokio::select! {
            m = rx.recv() => match m {
                Some(m) => {
                    match m.msg_type() {
                        "status" if m.content["execution_state"] == "idle" => idle = true,
                        "execute_reply" => reply = true,
                        _ => {}
                    }
                    if idle && reply { break true; }
                }
                None => break false,
            },
            _ = dead.changed() => break false,
            _ = tokio::time::sleep(Duration::from_secs(60)) => break false,
        }
    };
    kernel.unregister(&id);
    ok
}

/// Run user code, streaming its output lines into `tx`.
async fn run_code(kernel: &Kernel, code: &str, tx: &mpsc::Sender<Value>) {
    let Ok((id, mut rx)) = kernel.request(
        "execute_request",
        json!({"code": code, "silent": false, "store_history": true, "user_expressions": {}, "allow_stdin": false, "stop_on_error": true}),
    ) else {
        let _ = tx.send(output::error_line("DeadKernelError", "the kernel is not reachable")).await;
        return;
    };
    let mut dead = kernel.dead_watch();
    let mut keepalive = tokio::time::interval(Duration::from_secs(5));
    keepalive.tick().await;
    let (mut idle, mut reply, mut errored, mut gone) = (false, false, false, false);
    loop {
        let line = tokio::select! {
            m = rx.recv() => match m {
                None => None,
                Some(m) => {
                    let c = &m.content;
                    match m.msg_type() {
                        "execute_input" => c["execution_count"].as_i64().map(output::count_line),
                        "stream" | "execute_result" | "display_data" => data_line(&m),
                        "error" if !errored => { errored = true; Some(output::error_from_content(c)) }
                        "status" => { if c["execution_state"] == "idle" { idle = true; } None }
                        "execute_reply" => {
                            reply = true;
                            if c["status"] == "error" && !errored {
                                errored = true;
                                Some(output::error_from_content(c))
                            } else { None }
                        }
                        _ => None,
                    }
                }
            },
            _ = dead.changed() => {
                if kernel.is_dead() {
                    if !gone {
                        let _ = tx.send(output::error_line("DeadKernelError", "the kernel died during execution; restart the context")).await;
                    }
                    break;
                }
                None
            }
            _ = keepalive.tick() => Some(output::simple("keepalive")),
            _ = tx.closed(), if !gone => {
                gone = true;
                tracing::info!("client went away; interrupting the kernel");
                kernel.interrupt();
                None
            }
        };
        if let Some(l) = line
            && !gone
            && tx.send(l).await.is_err()
        {
            gone = true;
            kernel.interrupt();
        }
        if idle && reply {
            break;
        }
    }
    if kernel.late_outputs() && !gone {
        // Deno's kernel can publish a request's last outputs just after its `idle`
        // status: keep taking this request's messages until it has been quiet briefly.
        while let Ok(Some(m)) = tokio::time::timeout(LATE_OUTPUT_QUIET, rx.recv()).await {
            if let Some(l) = data_line(&m)
                && tx.send(l).await.is_err()
            {
                break;
            }
        }
    }
    kernel.unregister(&id);
}

/// The output line of a kernel's `stream`, `execute_result` or `display_data` message
/// (`None` for any other message).
fn data_line(m: &crate::jupyter::Message) -> Option<Value> {
    let c = &m.content;
    match m.msg_type() {
        "stream" => Some(output::stream_line(
            c["name"].as_str().unwrap_or("stdout"),
            c["text"].as_str().unwrap_or(""),
            m.date(),
        )),
        "execute_result" => Some(output::result_line(&c["data"], true)),
        "display_data" => Some(output::result_line(&c["data"], false)),
        _ => None,
    }
}

/// How long a kernel with late outputs must stay quiet after `idle` (see [`run_code`]).
const LATE_OUTPUT_QUIET: Duration = Duration::from_millis(30);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn languages() {
        assert_eq!(normalize_language(" JS "), "javascript");
        assert_eq!(normalize_language("Python"), "python");
        assert_eq!(normalize_language("ts"), "typescript");
    }

    #[test]
    fn env_code() {
        let mut v = BTreeMap::new();
        v.insert("A".to_string(), "it's \"x\"".to_string());
        assert_eq!(set_env_code("bash", &v), "export A='it'\\''s \"x\"'\n");
        let py = set_env_code("python", &v);
        assert!(py.contains("environ.update"));
        let g = BTreeMap::new();
        let k = "A".to_string();
        assert_eq!(restore_env_code("bash", &[&k], &g), "unset A\n");
        assert!(restore_env_code("python", &[&k], &g).contains("environ.pop(\"A\", None)"));
    }
}
