//! HTTP API on port 49999 (spec §4): `/execute` (NDJSON stream), `/contexts`, `/health`.
//!
//! `/execute` checks the caller's `X-Access-Token` the way E2B's server does, by asking
//! envd's `/envs` with it (envd answers 401 to a wrong one); the answer is also the
//! sandbox-global env, which a kernel gets in its process environment when it starts
//! after that, or as a silent execution before its next code when it started before
//! (a pooled sandbox's kernels start before the claim tells envd the env vars).
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
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::envd::{Envd, Envs};
use crate::kernel::{Kernel, Launcher};
use crate::output;

pub struct App {
    pub launcher: Launcher,
    pub default_cwd: String,
    envd: Envd,
    /// The interpreter's own environment (what envd gave the start command): the value
    /// a variable returns to after an execution's `env_vars` when the sandbox has none.
    base_env: BTreeMap<String, String>,
    auth: tokio::sync::Mutex<Auth>,
    /// Every context, in creation order.
    contexts: Mutex<Vec<Arc<Ctx>>>,
    defaults: tokio::sync::Mutex<HashMap<String, String>>,
}

/// The sandbox-global env vars as envd last gave them; `version` grows with every change.
#[derive(Debug, Default)]
pub struct GlobalEnv {
    version: u64,
    vars: BTreeMap<String, String>,
}

#[derive(Default)]
struct Auth {
    /// The token envd last accepted (`Some(None)`: envd wants none).
    accepted: Option<Option<String>>,
    global: Arc<GlobalEnv>,
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
    /// The kernel is started at the context's first execution (a default context of a
    /// language not used yet).
    pending: bool,
    /// Version of the global env the kernel has.
    env_version: u64,
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

/// Python run silently in every new Python kernel, as E2B's image does with its IPython
/// startup scripts: the `e2b/data` formatter (a pandas DataFrame as column → list of
/// values), the `e2b/chart` formatter (a matplotlib Figure through
/// `e2b_charts.chart_figure_to_dict`), `application/json` for lists and dicts, no
/// truncation of long sequences in `text/plain`, and PIL's `Image.save` to a path also
/// displays the image. Nothing heavy is imported: the formatters look at `sys.modules`.
const PYTHON_SETUP: &str = r#"
def __cubicle_setup():
    import sys, json
    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter, JSONFormatter
    from traitlets import ObjectName, Unicode
    ip = get_ipython()
    fm = ip.display_formatter

    class E2BData(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict, str)
        def __call__(self, obj):
            pd = sys.modules.get("pandas")
            if pd is None or not isinstance(obj, pd.DataFrame):
                return super().__call__(obj)
            out = obj.to_dict(orient="list")
            for k, col in out.items():
                out[k] = [v.isoformat() if isinstance(v, pd.Timestamp) else v for v in col]
            return out

    class E2BChart(BaseFormatter):
        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict, str)
        def __call__(self, obj):
            if sys.modules.get("matplotlib") is None:
                return super().__call__(obj)
            from matplotlib.figure import Figure
            if not isinstance(obj, Figure):
                return super().__call__(obj)
            try:
                from e2b_charts import chart_figure_to_dict
                return chart_figure_to_dict(obj)
            except Exception:
                return {}

    class E2BJSON(JSONFormatter):
        def __call__(self, obj):
            if isinstance(obj, (list, dict)):
                try:
                    np = sys.modules.get("numpy")
                    def conv(o):
                        if np is not None and isinstance(o, np.generic):
                            return o.item()
                        if np is not None and isinstance(o, np.ndarray):
                            return o.tolist()
                        raise TypeError(type(o).__name__)
                    return json.loads(json.dumps(obj, default=conv)), {"expanded": True}
                except (TypeError, ValueError):
                    pass
            return super().__call__(obj)

    fm.formatters["e2b/data"] = E2BData(parent=fm)
    fm.formatters["e2b/chart"] = E2BChart(parent=fm)
    fm.formatters["application/json"] = E2BJSON(parent=fm)
    fm.formatters["text/plain"].max_seq_length = 0

    def patch_pil(mod):
        from IPython.display import display
        try:
            from PIL.ImageShow import UnixViewer
            UnixViewer.show_file = lambda self, path, **options: 0
        except Exception:
            pass
        original = mod.Image.save
        def save(image, fp, format=None, **params):
            if isinstance(fp, str):
                display(image)
            return original(image, fp, format, **params)
        mod.Image.save = save

    class PilHook:
        # Patches PIL.Image once (and if) user code imports it.
        def find_spec(self, name, path=None, target=None):
            if name != "PIL.Image":
                return None
            sys.meta_path.remove(self)
            import importlib.util
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module
            def exec_and_patch(module):
                exec_module(module)
                patch_pil(module)
            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, PilHook())
__cubicle_setup()
del __cubicle_setup
1 + 1
"#;

fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// A double-quoted string literal valid in Python, JavaScript, R and Java.
fn str_lit(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// Code (in the kernel's language) setting `vars`.
fn set_env_code(lang: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    for (k, v) in vars {
        let (k_, v_) = (str_lit(k), str_lit(v));
        match lang {
            "python" => out.push_str(&format!("__import__('os').environ[{k_}] = {v_}\n")),
            "javascript" | "typescript" => out.push_str(&format!("Deno.env.set({k_}, {v_});\n")),
            "r" => out.push_str(&format!(
                "do.call(Sys.setenv, setNames(list({v_}), {k_}))\n"
            )),
            "java" => out.push_str(&format!("System.setProperty({k_}, {v_});\n")),
            "bash" if is_env_name(k) => out.push_str(&format!("export {k}={}\n", sh_quote(v))),
            _ => {}
        }
    }
    out
}

/// Code removing `keys`.
fn unset_env_code(lang: &str, keys: &[&String]) -> String {
    let mut out = String::new();
    for k in keys {
        let k_ = str_lit(k);
        match lang {
            "python" => out.push_str(&format!("__import__('os').environ.pop({k_}, None)\n")),
            "javascript" | "typescript" => out.push_str(&format!("Deno.env.delete({k_});\n")),
            "r" => out.push_str(&format!("Sys.unsetenv({k_})\n")),
            "java" => out.push_str(&format!("System.clearProperty({k_});\n")),
            "bash" if is_env_name(k) => out.push_str(&format!("unset {k}\n")),
            _ => {}
        }
    }
    out
}

/// Code giving `keys` back their sandbox value (`sandbox`), removing those without one.
fn restore_env_code(lang: &str, keys: &[&String], sandbox: &BTreeMap<String, String>) -> String {
    let set: BTreeMap<String, String> = keys
        .iter()
        .filter_map(|k| sandbox.get(*k).map(|v| ((*k).clone(), v.clone())))
        .collect();
    let unset: Vec<&String> = keys
        .iter()
        .copied()
        .filter(|k| !sandbox.contains_key(*k))
        .collect();
    set_env_code(lang, &set) + &unset_env_code(lang, &unset)
}

fn is_env_name(k: &str) -> bool {
    !k.is_empty()
        && k.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_')
        && !k.as_bytes()[0].is_ascii_digit()
}

/// A 401 in E2B's error shape.
fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        axum::Json(json!({"code": 401, "message": "invalid access token"})),
    )
        .into_response()
}

impl App {
    pub fn new(launcher: Launcher, default_cwd: String, envd: Envd) -> Arc<App> {
        Arc::new(App {
            launcher,
            default_cwd,
            envd,
            base_env: std::env::vars()
                .filter(|(k, _)| k != "CUBICLE_ENVD_ACCESS_TOKEN")
                .collect(),
            auth: Default::default(),
            contexts: Mutex::default(),
            defaults: tokio::sync::Mutex::default(),
        })
    }

    /// Checks `token` with envd (once per token) and returns the sandbox-global env.
    async fn authorize(&self, token: Option<&str>) -> Result<Arc<GlobalEnv>, Response> {
        let mut a = self.auth.lock().await;
        if let Some(acc) = &a.accepted {
            let same = match (acc.as_deref(), token) {
                (None, None) => true,
                (Some(x), Some(y)) => constant_time_eq(x.as_bytes(), y.as_bytes()),
                _ => false,
            };
            if same {
                return Ok(a.global.clone());
            }
        }
        match self.envd.envs(token).await {
            Envs::Vars(vars) => {
                a.accepted = Some(token.map(str::to_string));
                if vars != a.global.vars {
                    let version = a.global.version + 1;
                    a.global = Arc::new(GlobalEnv { version, vars });
                }
                Ok(a.global.clone())
            }
            Envs::Unauthorized => Err(unauthorized()),
            Envs::Unreachable(why) => {
                tracing::error!("cannot check the access token: {why}");
                Err((
                    StatusCode::SERVICE_UNAVAILABLE,
                    axum::Json(json!({"code": 503, "message": format!("cannot check the access token: envd is not reachable ({why})")})),
                )
                    .into_response())
            }
        }
    }

    /// The sandbox's value of every variable: the interpreter's own environment under
    /// the sandbox-global env.
    fn sandbox_env(&self, global: &GlobalEnv) -> BTreeMap<String, String> {
        let mut env = self.base_env.clone();
        env.extend(global.vars.iter().map(|(k, v)| (k.clone(), v.clone())));
        env
    }

    async fn start_kernel(
        &self,
        language: &str,
        cwd: &str,
        global: &GlobalEnv,
    ) -> Result<Arc<Kernel>, String> {
        let env: Vec<(String, String)> = global
            .vars
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let k = match Kernel::start(&self.launcher, language, cwd, &env).await {
            // Once more, on new ports: a kernel can lose a port picked for it to another
            // process between the pick and its bind.
            Err(e @ crate::error::Error::ExitedAtStart(_)) => {
                tracing::warn!("{e}; starting it again");
                Kernel::start(&self.launcher, language, cwd, &env).await
            }
            r => r,
        }
        .map_err(|e| e.to_string())?;
        if language == "python" {
            let _ = run_hidden(&k, PYTHON_SETUP).await;
        }
        if language == "java" && !global.vars.is_empty() {
            // E2B's Java contexts see the sandbox's variables as system properties too.
            let _ = run_hidden(&k, &set_env_code(language, &global.vars)).await;
        }
        Ok(k)
    }

    /// Create a context; its kernel starts now unless `lazy`.
    async fn create_context(
        &self,
        language: &str,
        cwd: Option<&str>,
        lazy: bool,
    ) -> Result<Arc<Ctx>, String> {
        let cwd = cwd
            .filter(|c| !c.is_empty())
            .unwrap_or(&self.default_cwd)
            .to_string();
        if !self.launcher.specs.contains_key(language) {
            return Err(format!(
                "language '{language}' is not supported in this sandbox (supported: {})",
                self.launcher.languages().join(", ")
            ));
        }
        if !std::path::Path::new(&cwd).is_dir() {
            return Err(format!("cwd '{cwd}' is not a directory"));
        }
        let global = self.auth.lock().await.global.clone();
        let kernel = if lazy {
            None
        } else {
            Some(self.start_kernel(language, &cwd, &global).await?)
        };
        let ctx = Arc::new(Ctx {
            id: jupyter_id(),
            language: language.to_string(),
            cwd,
            current: Mutex::new(kernel.clone()),
            run: tokio::sync::Mutex::new(RunState {
                pending: kernel.is_none(),
                kernel,
                env_version: global.version,
            }),
        });
        if let Ok(mut m) = self.contexts.lock() {
            m.push(ctx.clone());
        }
        Ok(ctx)
    }

    fn get(&self, id: &str) -> Option<Arc<Ctx>> {
        self.contexts
            .lock()
            .ok()
            .and_then(|m| m.iter().find(|c| c.id == id).cloned())
    }

    /// The default context of a language, created on first use (its kernel started now
    /// unless `lazy`).
    pub async fn default_context(&self, language: &str, lazy: bool) -> Result<Arc<Ctx>, String> {
        let mut d = self.defaults.lock().await;
        if let Some(c) = d.get(language).and_then(|id| self.get(id)) {
            return Ok(c);
        }
        let c = self.create_context(language, None, lazy).await?;
        d.insert(language.to_string(), c.id.clone());
        Ok(c)
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
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
    let v: Vec<Value> = app
        .contexts
        .lock()
        .map(|m| m.iter().map(|c| ctx_json(c)).collect())
        .unwrap_or_default();
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
    match app.create_context(&lang, req.cwd.as_deref(), false).await {
        Ok(c) => axum::Json(ctx_json(&c)).into_response(),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

async fn delete_context(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    let removed = app.contexts.lock().ok().and_then(|mut m| {
        let i = m.iter().position(|c| c.id == id)?;
        Some(m.remove(i))
    });
    match removed {
        Some(c) => {
            if let Some(k) = c.current.lock().ok().and_then(|mut k| k.take()) {
                k.kill();
            }
            let mut run = c.run.lock().await;
            run.kernel = None;
            run.pending = false;
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
    let global = app.auth.lock().await.global.clone();
    match app.start_kernel(&c.language, &c.cwd, &global).await {
        Ok(k) => {
            if let Ok(mut cur) = c.current.lock() {
                *cur = Some(k.clone());
            }
            run.kernel = Some(k);
            run.pending = false;
            run.env_version = global.version;
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

async fn execute(State(app): State<Arc<App>>, headers: HeaderMap, body: AxBytes) -> Response {
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
    let token = headers
        .get("x-access-token")
        .map(|v| v.to_str().unwrap_or("\n"));
    let global = match app.authorize(token).await {
        Ok(g) => g,
        Err(resp) => return resp,
    };
    let ctx = match &req.context_id {
        Some(id) => match app.get(id) {
            Some(c) => c,
            None => return text(StatusCode::NOT_FOUND, format!("Context {id} not found")),
        },
        None => {
            let lang = normalize_language(req.language.as_deref().unwrap_or("python"));
            // A language's first use starts its kernel in the execution (lazily), so
            // that the request does not wait for it before its stream starts.
            match app.default_context(&lang, true).await {
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
        global,
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
    global: Arc<GlobalEnv>,
    tx: mpsc::Sender<Value>,
) {
    let mut run = ctx.run.lock().await;
    if run.pending {
        run.pending = false;
        match app.start_kernel(&ctx.language, &ctx.cwd, &global).await {
            Ok(k) => {
                if let Ok(mut cur) = ctx.current.lock() {
                    *cur = Some(k.clone());
                }
                run.kernel = Some(k);
                run.env_version = global.version;
            }
            Err(e) => {
                run.pending = true;
                let _ = tx.send(output::error_line("KernelStartError", &e)).await;
                let _ = tx.send(output::simple("end_of_execution")).await;
                return;
            }
        }
    }
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
    // The sandbox's variables and this execution's in one silent execution.
    let mut vars = BTreeMap::new();
    if run.env_version != global.version {
        run.env_version = global.version;
        vars.extend(global.vars.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    vars.extend(env_vars.iter().map(|(k, v)| (k.clone(), v.clone())));
    if !vars.is_empty() {
        let _ = run_hidden(&kernel, &set_env_code(&ctx.language, &vars)).await;
    }
    run_code(&kernel, &code, &tx).await;
    // The caller has its answer before the variables are restored (the context stays
    // locked until they are).
    let _ = tx.send(output::simple("end_of_execution")).await;
    drop(tx);
    if !env_vars.is_empty() && !kernel.is_dead() {
        let keys: Vec<&String> = env_vars.keys().collect();
        let sandbox = app.sandbox_env(&global);
        let _ = run_hidden(&kernel, &restore_env_code(&ctx.language, &keys, &sandbox)).await;
    }
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
        assert_eq!(
            set_env_code("python", &v),
            "__import__('os').environ[\"A\"] = \"it's \\\"x\\\"\"\n"
        );
        assert_eq!(
            set_env_code("r", &v),
            "do.call(Sys.setenv, setNames(list(\"it's \\\"x\\\"\"), \"A\"))\n"
        );
        assert_eq!(
            set_env_code("java", &v),
            "System.setProperty(\"A\", \"it's \\\"x\\\"\");\n"
        );
        let k = "A".to_string();
        let none = BTreeMap::new();
        assert_eq!(restore_env_code("bash", &[&k], &none), "unset A\n");
        assert_eq!(
            restore_env_code("python", &[&k], &none),
            "__import__('os').environ.pop(\"A\", None)\n"
        );
        // Restored to the sandbox's value, not removed.
        let sandbox = BTreeMap::from([("A".to_string(), "g".to_string())]);
        assert_eq!(
            restore_env_code("r", &[&k], &sandbox),
            "do.call(Sys.setenv, setNames(list(\"g\"), \"A\"))\n"
        );
        assert_eq!(
            restore_env_code("java", &[&k], &sandbox),
            "System.setProperty(\"A\", \"g\");\n"
        );
        assert_eq!(
            restore_env_code("javascript", &[&k], &none),
            "Deno.env.delete(\"A\");\n"
        );
    }
}
