//! E2B's template builder API (`../shared/spec/e2b-templates.md`), over the template
//! crate's builder and store:
//!
//! | route | what |
//! |---|---|
//! | `POST /v3/templates` | a build of template `name` (created if new): 202 ids |
//! | `GET /templates/{id}/files/{hash}` | 201 `{present, url}`: is a COPY's archive here; where to `PUT` it |
//! | `PUT /cubicle/uploads/{token}` | the archive (presigned: no API key; our own listener) |
//! | `POST /v2/templates/{id}/builds/{buildID}` | start it with its steps: 202 |
//! | `GET /templates/{id}/builds/{buildID}/status` | status, log entries from `logsOffset`, failure reason |
//! | `POST /cubicle/templates/{id}/builds/{buildID}/cancel` | Cubicle's own: stop a build |
//! | `GET /templates`, `GET /templates/{id}`, `DELETE /templates/{id}`, `GET /default-templates` | list, detail, remove (refused while sandboxes use it), built-ins |
//! | `GET /templates/aliases/{name}`, `POST`/`DELETE /templates/tags`, `GET /templates/{id}/tags` | names and tags |
//!
//! A template's id is its name; it belongs to the team that first built it (others get
//! 404, or 403 when they try to build under the same name). Built-ins are public and
//! cannot be rebuilt through the API. Uploaded archives are kept per team
//! (`<state>/build-files/<team>/<hash>`), written to a temporary file and renamed only
//! once the whole body (its `Content-Length`) arrived, so an interrupted upload leaves
//! nothing and the next `files` check asks for it again.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::body::Body;
use axum::extract::{Extension, Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use cubicle_node::template::build::{BuildLog, BuildRequest, Source, Step};
use cubicle_node::template::builds::{BuildFailure, BuildRecord, BuildStatus, LogEntry, TagInfo};
use cubicle_node::template::oci::pull::Credentials;
use cubicle_node::template::{BUILTINS, TemplateStore};
use cubicle_store::Team;
use serde::Deserialize;
use serde_json::{Value, json};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::{ApiError, ApiResult, ErrorBody, read_body};
use crate::model::ENVD_VERSION;
use crate::query::{Query, format_time};
use crate::service::ControlPlane;

type Cp = State<Arc<ControlPlane>>;

/// How long an upload URL stays valid.
const UPLOAD_TTL: Duration = Duration::from_secs(3600);
/// Largest upload accepted (a build context archive).
const MAX_UPLOAD: u64 = 20 << 30;

/// A running build.
pub(crate) struct Running {
    log: Arc<BuildLog>,
    cancel: tokio::sync::watch::Sender<bool>,
}

/// A presigned upload: whose archive, which hash.
struct Upload {
    team: i64,
    hash: String,
    expires: Instant,
}

/// Builds in progress and pending uploads of this process.
#[derive(Default)]
pub struct Builds {
    running: Mutex<HashMap<String, Arc<Running>>>,
    uploads: Mutex<HashMap<String, Upload>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The template routes (reading templates, their tags and aliases; builds, tags, GC;
/// `DELETE /templates/{id}` is `routes::delete_template`, shared with snapshots), all
/// described in `GET /openapi.json`. The caller puts them behind the API key check.
pub fn documented_routes() -> OpenApiRouter<Arc<ControlPlane>> {
    OpenApiRouter::new()
        .routes(routes!(list_templates))
        .routes(routes!(list_templates_v2))
        .routes(routes!(template_detail))
        .routes(routes!(default_templates))
        .routes(routes!(alias))
        .routes(routes!(list_tags))
        .routes(routes!(request_build))
        .routes(routes!(file_link))
        .routes(routes!(start_build))
        .routes(routes!(build_status))
        .routes(routes!(cancel_build))
        .routes(routes!(assign_tags, remove_tags))
        .routes(routes!(gc))
}

/// The presigned upload route (no API key: the token is the permission).
pub fn upload_routes() -> OpenApiRouter<Arc<ControlPlane>> {
    OpenApiRouter::new().routes(routes!(upload))
}

fn store(cp: &ControlPlane) -> ApiResult<TemplateStore> {
    cp.backend()
        .templates()
        .ok_or_else(|| ApiError::NotImplemented("this server cannot build templates".into()))
}

fn tpl_err(e: cubicle_node::template::Error) -> ApiError {
    use cubicle_node::template::Error as T;
    match e {
        T::TemplateNotFound(n) => ApiError::NotFound(format!("template '{n}' not found")),
        T::InvalidRequest(m) => ApiError::BadRequest(m),
        other => ApiError::Internal(other.to_string()),
    }
}

/// Percent-decoded template id → template name (`namespace/` dropped, lowercase).
fn template_name(raw: &str) -> ApiResult<String> {
    let r = crate::templates::parse(raw)?;
    Ok(r.name)
}

/// The template `name` as `team` may see it: 404 if it is another team's.
fn visible(cp: &ControlPlane, team: &Team, name: &str) -> ApiResult<TemplateStore> {
    let st = store(cp)?;
    match st.owner(name) {
        Some(o) if o != team.id.to_string() => {
            Err(ApiError::NotFound(format!("template '{name}' not found")))
        }
        _ => Ok(st),
    }
}

fn new_uuid() -> String {
    use rand::RngCore;
    let mut b = [0u8; 16];
    rand::rng().fill_bytes(&mut b);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

fn parse_json<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> ApiResult<T> {
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::BadRequest(format!("invalid JSON body: {e}")))
}

// ---- POST /v3/templates ----

/// `POST /v3/templates` body.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
struct RequestV3 {
    name: Option<String>,
    alias: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
    #[schema(minimum = 1, maximum = 64)]
    cpu_count: Option<u32>,
    #[serde(rename = "memoryMB")]
    #[schema(rename = "memoryMB", minimum = 128, maximum = 1048576)]
    memory_mb: Option<u64>,
}

/// Register a build of template `name` (created if new; 403 if it is another team's or a built-in).
#[utoipa::path(post, path = "/v3/templates", tag = "templates",
    request_body(content = RequestV3),
    responses((status = 202, body = Object, description = "templateID, buildID, names, tags"),
        (status = 400, response = ErrorBody), (status = 401, response = ErrorBody), (status = 403, response = ErrorBody),
        (status = 413, response = ErrorBody), (status = 501, response = ErrorBody)))]
async fn request_build(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    body: Body,
) -> ApiResult<Response> {
    let b: RequestV3 = parse_json(&read_body(body, crate::routes::MAX_BODY).await?)?;
    let raw = b
        .name
        .or(b.alias)
        .ok_or_else(|| ApiError::BadRequest("name is required".into()))?
        .to_ascii_lowercase();
    let r = crate::templates::parse(&raw)?;
    let name = r.name.clone();
    let mut tags: Vec<String> = r.tag.into_iter().collect();
    for t in b.tags {
        let t = t.to_ascii_lowercase();
        cubicle_node::template::builds::validate_tag(&t).map_err(tpl_err)?;
        if !tags.contains(&t) {
            tags.push(t);
        }
    }
    if tags.is_empty() {
        tags.push("default".into());
    }
    if BUILTINS.contains(&name.as_str()) {
        return Err(ApiError::Forbidden(format!(
            "'{name}' is a built-in template; build yours under another name"
        )));
    }
    if let Some(cpus) = b.cpu_count
        && !(1..=64).contains(&cpus)
    {
        return Err(ApiError::BadRequest(format!(
            "cpuCount {cpus} must be 1-64"
        )));
    }
    if let Some(m) = b.memory_mb
        && !(128..=1 << 20).contains(&m)
    {
        return Err(ApiError::BadRequest(format!(
            "memoryMB {m} must be 128-1048576"
        )));
    }
    let st = store(&cp)?;
    match st.owner(&name) {
        Some(o) if o != team.id.to_string() => {
            return Err(ApiError::Forbidden(format!(
                "template name '{name}' belongs to another team"
            )));
        }
        Some(_) => {}
        None if st.get(&name).map_err(tpl_err)?.is_some() => {
            return Err(ApiError::Forbidden(format!(
                "template '{name}' was made on the server (built-in or imported) and cannot be rebuilt through the API"
            )));
        }
        None => st.set_owner(&name, &team.id.to_string()).map_err(tpl_err)?,
    }
    let build_id = new_uuid();
    let mut rec = st
        .new_build(&name, &build_id, tags.clone())
        .map_err(tpl_err)?;
    rec.cpus = b.cpu_count;
    rec.memory_mb = b.memory_mb;
    st.save_build(&rec).map_err(tpl_err)?;
    tracing::info!(template = %name, build = %build_id, team = %team.name, "template build requested");
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({
            "templateID": name,
            "buildID": build_id,
            "public": false,
            "names": [name],
            "tags": tags,
            "aliases": [name],
        })),
    )
        .into_response())
}

// ---- files and uploads ----

fn files_dir(st: &TemplateStore, team: i64) -> PathBuf {
    st.root()
        .parent()
        .unwrap_or(st.root())
        .join("build-files")
        .join(team.to_string())
}

fn valid_hash(h: &str) -> bool {
    h.len() == 64
        && h.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Whether a COPY step's archive is here, and where to `PUT` it.
#[utoipa::path(get, path = "/templates/{id}/files/{hash}", tag = "templates",
    params(("id" = String, Path, description = "Template name", pattern = "^([A-Za-z0-9][A-Za-z0-9._-]*/)?[a-z0-9][a-z0-9._-]{0,63}(:[^/%]*)?$"),
        ("hash" = String, Path, description = "sha256 of the archive", pattern = "^[0-9a-f]{64}$")),
    responses((status = 201, body = Object, description = "present, url"),
        (status = 400, response = ErrorBody), (status = 401, response = ErrorBody), (status = 404, response = ErrorBody), (status = 501, response = ErrorBody)))]
async fn file_link(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path((id, hash)): Path<(String, String)>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let name = template_name(&id)?;
    let st = visible(&cp, &team, &name)?;
    if st.owner(&name).is_none() {
        return Err(ApiError::NotFound(format!("template '{name}' not found")));
    }
    if !valid_hash(&hash) {
        return Err(ApiError::BadRequest(format!(
            "files hash '{hash}' must be 64 lowercase hex digits"
        )));
    }
    let present = files_dir(&st, team.id).join(&hash).is_file();
    // Always hand out a URL: the SDK uploads only when `present` is false, or when the
    // step forces an upload.
    let token = cubicle_node::ids::random_suffix(40);
    {
        let mut u = lock(&cp.builds.uploads);
        let now = Instant::now();
        u.retain(|_, up| up.expires > now);
        u.insert(
            token.clone(),
            Upload {
                team: team.id,
                hash: hash.clone(),
                expires: now + UPLOAD_TTL,
            },
        );
    }
    let host = headers
        .get("host")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost");
    let scheme = headers
        .get("x-forwarded-proto")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("http");
    let url = format!("{scheme}://{host}/cubicle/uploads/{token}");
    Ok((
        StatusCode::CREATED,
        Json(json!({ "present": present, "url": url })),
    )
        .into_response())
}

/// A COPY step's archive, to the URL `GET /templates/{id}/files/{hash}` handed out
/// (the token is the permission: no API key).
#[utoipa::path(put, path = "/cubicle/uploads/{token}", tag = "templates", security(()),
    params(("token" = String, Path, description = "Upload token from the files check")),
    request_body(content = inline(crate::volume_content::FileBytes), content_type = "application/octet-stream"),
    responses((status = 200, description = "Stored"), (status = 400, response = ErrorBody),
        (status = 404, response = ErrorBody), (status = 413, response = ErrorBody),
        (status = 501, response = ErrorBody)))]
async fn upload(
    State(cp): Cp,
    Path(token): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let up = {
        let mut u = lock(&cp.builds.uploads);
        match u.remove(&token) {
            Some(up) if up.expires > Instant::now() => up,
            _ => return Err(ApiError::NotFound("upload URL unknown or expired".into())),
        }
    };
    let st = store(&cp)?;
    let want: Option<u64> = headers
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let dir = files_dir(&st, up.team);
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(|e| ApiError::Internal(format!("mkdir {}: {e}", dir.display())))?;
    let tmp = dir.join(format!(".part-{}", cubicle_node::ids::random_suffix(12)));
    let written = write_body(&tmp, body).await;
    let ok = match (&written, want) {
        (Ok(n), Some(w)) => *n == w,
        (Ok(n), None) => *n > 0,
        (Err(_), _) => false,
    };
    if !ok {
        let _ = tokio::fs::remove_file(&tmp).await;
        return Err(match written {
            Err(e) => e,
            Ok(n) => ApiError::BadRequest(format!(
                "upload incomplete: {n} of {} bytes arrived; upload again",
                want.map(|w| w.to_string()).unwrap_or_else(|| "?".into())
            )),
        });
    }
    let dest = dir.join(&up.hash);
    tokio::fs::rename(&tmp, &dest)
        .await
        .map_err(|e| ApiError::Internal(format!("store upload: {e}")))?;
    Ok(StatusCode::OK.into_response())
}

async fn write_body(path: &std::path::Path, body: Body) -> ApiResult<u64> {
    use http_body_util::BodyExt;
    use tokio::io::AsyncWriteExt;
    let mut f = tokio::fs::File::create(path)
        .await
        .map_err(|e| ApiError::Internal(format!("create {}: {e}", path.display())))?;
    let mut body = body;
    let mut n = 0u64;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ApiError::BadRequest(format!("upload interrupted: {e}")))?;
        if let Ok(data) = frame.into_data() {
            n += data.len() as u64;
            if n > MAX_UPLOAD {
                return Err(ApiError::PayloadTooLarge(MAX_UPLOAD as usize));
            }
            f.write_all(&data)
                .await
                .map_err(|e| ApiError::Internal(format!("write upload: {e}")))?;
        }
    }
    f.flush()
        .await
        .map_err(|e| ApiError::Internal(format!("write upload: {e}")))?;
    Ok(n)
}

// ---- POST /v2/templates/{id}/builds/{build} ----

/// `POST /v2/templates/{id}/builds/{build}` body.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
struct StartV2 {
    from_image: Option<String>,
    from_template: Option<String>,
    #[schema(value_type = Option<Object>)]
    from_image_registry: Option<Value>,
    #[serde(default)]
    force: bool,
    #[serde(default)]
    #[schema(value_type = Vec<Object>)]
    steps: Vec<Step>,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
}

/// `fromImage`/`fromTemplate`/registry → where the build starts.
fn source(b: &StartV2) -> ApiResult<Source> {
    if let Some(t) = &b.from_template {
        return Ok(Source::Template(template_name(t).map(
            |n| match t.split_once(':') {
                Some((_, tag)) if tag != "default" && tag != "latest" => format!("{n}:{tag}"),
                _ => n,
            },
        )?));
    }
    let image = b
        .from_image
        .clone()
        .ok_or_else(|| ApiError::BadRequest("fromImage or fromTemplate is required".into()))?;
    // The SDK's from_base_image(): Cubicle's own base template.
    if image == "e2bdev/base" || image.starts_with("e2bdev/base:") {
        return Ok(Source::Template("base".into()));
    }
    let credentials = match &b.from_image_registry {
        None | Some(Value::Null) => None,
        Some(r) => match r.get("type").and_then(Value::as_str) {
            Some("registry") => {
                let s = |k: &str| {
                    r.get(k)
                        .and_then(Value::as_str)
                        .map(String::from)
                        .ok_or_else(|| {
                            ApiError::BadRequest(format!("fromImageRegistry.{k} is required"))
                        })
                };
                Some(Credentials {
                    username: s("username")?,
                    password: s("password")?,
                })
            }
            Some(other) => {
                return Err(ApiError::BadRequest(format!(
                    "fromImageRegistry of type '{other}' is not supported (use type 'registry' with username and password)"
                )));
            }
            None => {
                return Err(ApiError::BadRequest(
                    "fromImageRegistry.type is required".into(),
                ));
            }
        },
    };
    Ok(Source::Image {
        reference: image,
        credentials,
    })
}

/// Start a registered build with its source and steps.
#[utoipa::path(post, path = "/v2/templates/{id}/builds/{build}", tag = "templates",
    params(("id" = String, Path, description = "Template name", pattern = "^([A-Za-z0-9][A-Za-z0-9._-]*/)?[a-z0-9][a-z0-9._-]{0,63}(:[^/%]*)?$"), ("build" = String, Path, description = "Build id")),
    request_body(content = StartV2),
    responses((status = 202, description = "Started"),
        (status = 400, response = ErrorBody), (status = 401, response = ErrorBody), (status = 404, response = ErrorBody),
        (status = 413, response = ErrorBody), (status = 501, response = ErrorBody)))]
async fn start_build(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path((id, build_id)): Path<(String, String)>,
    body: Body,
) -> ApiResult<Response> {
    let name = template_name(&id)?;
    let st = visible(&cp, &team, &name)?;
    let b: StartV2 = parse_json(&read_body(body, crate::routes::MAX_BODY).await?)?;
    let mut rec = st
        .build_record(&name, &build_id, true)
        .map_err(|_| ApiError::BadRequest(format!("Build '{build_id}' not found")))?
        .ok_or_else(|| ApiError::BadRequest(format!("Build '{build_id}' not found")))?;
    if rec.status != BuildStatus::Waiting || lock(&cp.builds.running).contains_key(&build_id) {
        return Err(ApiError::BadRequest("build is not in waiting state".into()));
    }
    let from = source(&b)?;
    for (i, s) in b.steps.iter().enumerate() {
        let k = s.kind.to_ascii_uppercase();
        if !["RUN", "COPY", "ENV", "WORKDIR", "USER"].contains(&k.as_str()) {
            return Err(ApiError::BadRequest(format!(
                "step {}: unknown type '{}' (RUN, COPY, ENV, WORKDIR, USER)",
                i + 1,
                s.kind
            )));
        }
    }
    let req = BuildRequest {
        name: name.clone(),
        build_id: build_id.clone(),
        from,
        steps: b.steps,
        start_cmd: b.start_cmd.filter(|s| !s.is_empty()),
        ready_cmd: b.ready_cmd.filter(|s| !s.is_empty()),
        force: b.force,
        cpus: rec.cpus,
        memory_mb: rec.memory_mb,
        registry: cp.config().registry.clone(),
    };
    rec.status = BuildStatus::Building;
    st.save_build(&rec).map_err(tpl_err)?;
    let log = Arc::new(BuildLog::new(st.clone(), &name, &build_id));
    let (cancel_tx, cancel_rx) = tokio::sync::watch::channel(false);
    let running = Arc::new(Running {
        log: log.clone(),
        cancel: cancel_tx,
    });
    lock(&cp.builds.running).insert(build_id.clone(), running);
    let dir = files_dir(&st, team.id);
    let files: Arc<cubicle_node::template::build::FileResolver> = Arc::new(move |h: &str| {
        let p = dir.join(h);
        (valid_hash(h) && p.is_file()).then_some(p)
    });
    let fut = cp.backend().run_build(req, files, log.clone(), cancel_rx);
    let cp2 = cp.clone();
    tokio::spawn(async move {
        let t0 = Instant::now();
        let result = fut.await;
        let st = match store(&cp2) {
            Ok(s) => s,
            Err(_) => return,
        };
        match result {
            Ok(config) => {
                if let Err(e) = st.publish(rec, config) {
                    log.push(
                        "error",
                        Some("finalize"),
                        format!("publishing the template: {e}"),
                    );
                    fail_record(
                        &st,
                        &name,
                        &build_id,
                        &format!("publishing the template: {e}"),
                        Some("finalize"),
                    );
                } else {
                    tracing::info!(template = %name, build = %build_id, secs = t0.elapsed().as_secs_f64(), "template built");
                    // Still "building" to the SDK until this is done (see `build_status`).
                    match cp2.backend().template_built(&name).await {
                        Ok(Some(what)) => log.push("info", Some("finalize"), what),
                        Ok(None) => {}
                        Err(e) => {
                            tracing::warn!(template = %name, "publishing the built template: {e}");
                            log.push(
                                "warn",
                                Some("finalize"),
                                format!("the template was built but not published to the object store (only this node can create from it): {e}"),
                            );
                        }
                    }
                }
            }
            Err(f) => {
                log.push("error", f.step.as_deref(), f.message.clone());
                tracing::warn!(template = %name, build = %build_id, "template build failed: {}", f.message);
                fail_record(&st, &name, &build_id, &f.message, f.step.as_deref());
            }
        }
        lock(&cp2.builds.running).remove(&build_id);
    });
    Ok(StatusCode::ACCEPTED.into_response())
}

fn fail_record(st: &TemplateStore, name: &str, build_id: &str, message: &str, step: Option<&str>) {
    if let Ok(Some(mut rec)) = st.build_record(name, build_id, true) {
        let now = cubicle_store::now_ms() as u64;
        rec.status = BuildStatus::Error;
        rec.failure = Some(BuildFailure {
            message: message.into(),
            step: step.map(String::from),
        });
        rec.updated_at_ms = now;
        rec.finished_at_ms = Some(now);
        let _ = st.save_build(&rec);
    }
}

// ---- status ----

fn entry_json(e: &LogEntry) -> Value {
    let mut v = json!({
        "timestamp": format_time(e.timestamp_ms as i64),
        "message": e.message,
        "level": e.level,
    });
    if let Some(s) = &e.step {
        v["step"] = json!(s);
    }
    v
}

/// A build's status, its log entries from `logsOffset`, and why it failed.
#[utoipa::path(get, path = "/templates/{id}/builds/{build}/status", tag = "templates",
    params(("id" = String, Path, description = "Template name", pattern = "^([A-Za-z0-9][A-Za-z0-9._-]*/)?[a-z0-9][a-z0-9._-]{0,63}(:[^/%]*)?$"), ("build" = String, Path, description = "Build id"),
        ("logsOffset" = Option<i64>, Query, minimum = 0, description = "First log entry"),
        ("limit" = Option<i64>, Query, minimum = 1, maximum = 100, description = "Log entries at most")),
    responses((status = 200, body = Object, description = "status, logEntries, reason"),
        (status = 400, response = ErrorBody), (status = 401, response = ErrorBody), (status = 404, response = ErrorBody), (status = 501, response = ErrorBody)))]
async fn build_status(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path((id, build_id)): Path<(String, String)>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let name = template_name(&id)?;
    let st = visible(&cp, &team, &name)?;
    let q = Query::parse(q.as_deref())?;
    let offset: usize = q
        .get("logsOffset")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let limit: usize = q
        .get("limit")
        .and_then(|v| v.parse().ok())
        .unwrap_or(100)
        .clamp(1, 100);
    let running = lock(&cp.builds.running).get(&build_id).cloned();
    let rec = st
        .build_record(&name, &build_id, running.is_some())
        .map_err(|_| ApiError::BadRequest(format!("Build '{build_id}' not found")))?
        .ok_or_else(|| ApiError::BadRequest(format!("Build '{build_id}' not found")))?;
    let entries = match &running {
        Some(r) => r.log.page(offset, limit),
        None => st
            .read_log(&name, &build_id)
            .map_err(tpl_err)?
            .into_iter()
            .skip(offset)
            .take(limit)
            .collect(),
    };
    let status = match rec.status {
        BuildStatus::Waiting => "waiting",
        BuildStatus::Building => "building",
        // Published here but still being published elsewhere (`Backend::template_built`).
        BuildStatus::Ready if running.is_some() => "building",
        BuildStatus::Ready => "ready",
        BuildStatus::Error => "error",
    };
    let mut body = json!({
        "logs": [],
        "logEntries": entries.iter().map(entry_json).collect::<Vec<_>>(),
        "templateID": name,
        "buildID": build_id,
        "status": status,
    });
    if let Some(f) = &rec.failure {
        let problems: Vec<Value> = match (&running, &f.step) {
            (Some(r), Some(s)) => r.log.problems_of(s).iter().map(entry_json).collect(),
            _ => Vec::new(),
        };
        let mut reason = json!({ "message": f.message, "logEntries": problems });
        if let Some(s) = &f.step {
            reason["step"] = json!(s);
        }
        body["reason"] = reason;
    }
    Ok(Json(body).into_response())
}

/// Cubicle's own: stop a running build.
#[utoipa::path(post, path = "/cubicle/templates/{id}/builds/{build}/cancel", tag = "templates",
    params(("id" = String, Path, description = "Template name", pattern = "^([A-Za-z0-9][A-Za-z0-9._-]*/)?[a-z0-9][a-z0-9._-]{0,63}(:[^/%]*)?$"), ("build" = String, Path, description = "Build id")),
    responses((status = 202, description = "Cancelling"),
        (status = 400, response = ErrorBody), (status = 401, response = ErrorBody), (status = 404, response = ErrorBody), (status = 501, response = ErrorBody)))]
async fn cancel_build(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path((id, build_id)): Path<(String, String)>,
) -> ApiResult<Response> {
    let name = template_name(&id)?;
    visible(&cp, &team, &name)?;
    let r = lock(&cp.builds.running).get(&build_id).cloned();
    match r {
        Some(r) => {
            let _ = r.cancel.send(true);
            Ok(StatusCode::ACCEPTED.into_response())
        }
        None => Err(ApiError::NotFound(format!(
            "build '{build_id}' is not running"
        ))),
    }
}

// ---- listing, detail, delete ----

fn template_json(st: &TemplateStore, name: &str, team_visible: bool) -> Option<Value> {
    let builds = st.builds(name).unwrap_or_default();
    let t = st.get(name).ok().flatten();
    let last = builds.last();
    let (cfg, build_id, status, created, updated) = match (&t, last) {
        (Some(t), _) => (
            Some(t.config.clone()),
            t.config.build_id.clone().unwrap_or_default(),
            "ready",
            t.config.built_at as i64 * 1000,
            t.config.built_at as i64 * 1000,
        ),
        (None, Some(b)) => (
            b.config.clone(),
            b.build_id.clone(),
            match b.status {
                BuildStatus::Waiting => "waiting",
                BuildStatus::Building => "building",
                BuildStatus::Ready => "ready",
                BuildStatus::Error => "error",
            },
            b.created_at_ms as i64,
            b.updated_at_ms as i64,
        ),
        (None, None) => return None,
    };
    let d = cubicle_node::template::TemplateConfig::with_defaults(name, "");
    let c = cfg.unwrap_or(d);
    let built_in = BUILTINS.contains(&name);
    Some(json!({
        "templateID": name,
        "buildID": if build_id.is_empty() { format!("{name}-default") } else { build_id },
        "cpuCount": c.cpus,
        "memoryMB": c.memory_mb,
        "diskSizeMB": c.disk_mb,
        "public": built_in || !team_visible,
        "aliases": [name],
        "names": [name],
        "createdAt": format_time(created),
        "updatedAt": format_time(updated),
        "createdBy": Value::Null,
        "lastSpawnedAt": Value::Null,
        "spawnCount": 0,
        "buildCount": builds.len().max(1),
        "envdVersion": ENVD_VERSION,
        "buildStatus": status,
        "isDefault": built_in,
        // Cubicle's own (the dashboard shows them): the root filesystem's size at build
        // time and what built it.
        "sizeBytes": c.size_bytes,
        "builder": c.builder,
    }))
}

fn template_names(st: &TemplateStore) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(st.root()) else {
        return Vec::new();
    };
    let mut v: Vec<String> = rd
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| cubicle_node::template::validate_name(n).is_ok())
        .collect();
    v.sort();
    v
}

/// The team's own templates (built or imported by it).
#[utoipa::path(get, path = "/templates", tag = "templates",
    responses((status = 200, body = Vec<Object>), (status = 401, response = ErrorBody)))]
async fn list_templates(State(cp): Cp, Extension(team): Extension<Team>) -> ApiResult<Response> {
    let st = store(&cp)?;
    let me = team.id.to_string();
    let out: Vec<Value> = template_names(&st)
        .iter()
        .filter(|n| st.owner(n).is_some_and(|o| o == me))
        .filter_map(|n| template_json(&st, n, true))
        .collect();
    Ok(Json(out).into_response())
}

/// [`list_templates`] under E2B's v2 path.
#[utoipa::path(get, path = "/v2/templates", tag = "templates",
    responses((status = 200, body = Vec<Object>), (status = 401, response = ErrorBody)))]
async fn list_templates_v2(cp: Cp, team: Extension<Team>) -> ApiResult<Response> {
    list_templates(cp, team).await
}

/// The templates every team may use (built-ins and imports).
#[utoipa::path(get, path = "/default-templates", tag = "templates",
    responses((status = 200, body = Vec<Object>), (status = 401, response = ErrorBody)))]
async fn default_templates(State(cp): Cp) -> ApiResult<Response> {
    let st = store(&cp)?;
    let out: Vec<Value> = template_names(&st)
        .iter()
        .filter(|n| st.owner(n).is_none())
        .filter_map(|n| template_json(&st, n, false))
        .collect();
    Ok(Json(out).into_response())
}

fn build_json(b: &BuildRecord) -> Value {
    let c = b
        .config
        .clone()
        .unwrap_or_else(|| cubicle_node::template::TemplateConfig::with_defaults(&b.template, ""));
    let mut v = json!({
        "buildID": b.build_id,
        "status": match b.status {
            BuildStatus::Waiting => "waiting",
            BuildStatus::Building => "building",
            BuildStatus::Ready => "ready",
            BuildStatus::Error => "error",
        },
        "createdAt": format_time(b.created_at_ms as i64),
        "updatedAt": format_time(b.updated_at_ms as i64),
        "cpuCount": b.cpus.unwrap_or(c.cpus),
        "memoryMB": b.memory_mb.unwrap_or(c.memory_mb),
        "diskSizeMB": c.disk_mb,
        "envdVersion": ENVD_VERSION,
    });
    if let Some(f) = b.finished_at_ms {
        v["finishedAt"] = json!(format_time(f as i64));
    }
    v
}

/// A template the team may use, with its builds.
#[utoipa::path(get, path = "/templates/{id}", tag = "templates",
    params(("id" = String, Path, description = "Template name (`NAME`, `NAME:TAG`, `NAMESPACE/NAME`)", pattern = "^([A-Za-z0-9][A-Za-z0-9._-]*/)?[a-z0-9][a-z0-9._-]{0,63}(:[^/%]*)?$")),
    responses((status = 200, body = Object), (status = 400, response = ErrorBody),
        (status = 401, response = ErrorBody), (status = 404, response = ErrorBody)))]
async fn template_detail(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let name = template_name(&id)?;
    let st = visible(&cp, &team, &name)?;
    let mut t = template_json(&st, &name, st.owner(&name).is_some())
        .ok_or_else(|| ApiError::NotFound(format!("template '{name}' not found")))?;
    t["builds"] = json!(
        st.builds(&name)
            .unwrap_or_default()
            .iter()
            .map(build_json)
            .collect::<Vec<_>>()
    );
    Ok(Json(t).into_response())
}

pub(crate) async fn delete_template(
    cp: &Arc<ControlPlane>,
    team: &Team,
    id: &str,
) -> ApiResult<()> {
    let name = template_name(id)?;
    if let Some(rb) = cp.backend().cluster().filter(|rb| rb.is_coordinated()) {
        return crate::cluster::templates::delete_everywhere(rb, cp, team, &name).await;
    }
    let st = visible(cp, team, &name)?;
    if st.owner(&name).is_none() {
        return Err(ApiError::NotFound(format!(
            "template '{name}' not found (built-ins cannot be removed through the API)"
        )));
    }
    let users = cp.backend().sandboxes_of(&name);
    if !users.is_empty() {
        return Err(ApiError::BadRequest(format!(
            "template '{name}' is used by {} sandbox(es) or snapshot(s) ({}); kill them (or delete the snapshots) first",
            users.len(),
            users.join(", ")
        )));
    }
    let running: Vec<String> = st
        .builds(&name)
        .unwrap_or_default()
        .into_iter()
        .filter(|b| lock(&cp.builds.running).contains_key(&b.build_id))
        .map(|b| b.build_id)
        .collect();
    if !running.is_empty() {
        return Err(ApiError::BadRequest(format!(
            "template '{name}' is being built ({}); cancel the build first",
            running.join(", ")
        )));
    }
    let st2 = st.clone();
    let n2 = name.clone();
    tokio::task::spawn_blocking(move || st2.remove(&n2))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .map_err(tpl_err)?;
    tracing::info!(template = %name, team = %team.name, "template removed");
    Ok(())
}

/// Whether a template name exists and whether it is public (another team's: 403).
#[utoipa::path(get, path = "/templates/aliases/{name}", tag = "templates",
    params(("name" = String, Path, description = "Template name", pattern = "^([A-Za-z0-9][A-Za-z0-9._-]*/)?[a-z0-9][a-z0-9._-]{0,63}(:[^/%]*)?$")),
    responses((status = 200, body = Object), (status = 400, response = ErrorBody),
        (status = 401, response = ErrorBody), (status = 403, response = ErrorBody),
        (status = 404, response = ErrorBody)))]
async fn alias(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(raw): Path<String>,
) -> ApiResult<Response> {
    let name = template_name(&raw)?;
    let st = store(&cp)?;
    let exists = st.get(&name).map_err(tpl_err)?.is_some()
        || !st.builds(&name).unwrap_or_default().is_empty();
    if !exists {
        return Err(ApiError::NotFound(format!("template '{name}' not found")));
    }
    match st.owner(&name) {
        Some(o) if o != team.id.to_string() => Err(ApiError::Forbidden(format!(
            "template '{name}' belongs to another team"
        ))),
        o => Ok(Json(json!({ "templateID": name, "public": o.is_none() })).into_response()),
    }
}

// ---- tags ----

/// `POST /templates/tags` body.
#[derive(Deserialize, utoipa::ToSchema)]
struct AssignTags {
    target: String,
    tags: Vec<String>,
}

/// Give the build that `target` names (`name:tag`) more tags.
#[utoipa::path(post, path = "/templates/tags", tag = "templates",
    request_body(content = AssignTags),
    responses((status = 201, body = Object, description = "tags, buildID"),
        (status = 400, response = ErrorBody), (status = 401, response = ErrorBody), (status = 403, response = ErrorBody), (status = 404, response = ErrorBody),
        (status = 413, response = ErrorBody), (status = 501, response = ErrorBody)))]
async fn assign_tags(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    body: Body,
) -> ApiResult<Response> {
    let b: AssignTags = parse_json(&read_body(body, crate::routes::MAX_BODY).await?)?;
    let r = crate::templates::parse(&b.target)?;
    let st = visible(&cp, &team, &r.name)?;
    if st.owner(&r.name).is_none() {
        return Err(ApiError::NotFound(format!(
            "template '{}' not found",
            r.name
        )));
    }
    if b.tags.is_empty() {
        return Err(ApiError::BadRequest("tags must not be empty".into()));
    }
    let tags: Vec<String> = b.tags.iter().map(|t| t.to_ascii_lowercase()).collect();
    for t in &tags {
        cubicle_node::template::builds::validate_tag(t).map_err(tpl_err)?;
    }
    let from = r.tag.clone().unwrap_or_else(|| "default".into());
    let build_id = st.assign_tags(&r.name, &from, &tags).map_err(tpl_err)?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "tags": tags, "buildID": build_id })),
    )
        .into_response())
}

/// `DELETE /templates/tags` body.
#[derive(Deserialize, utoipa::ToSchema)]
struct RemoveTags {
    name: String,
    tags: Vec<String>,
}

/// Take tags off a template.
#[utoipa::path(delete, path = "/templates/tags", tag = "templates",
    request_body(content = RemoveTags),
    responses((status = 204, description = "Removed"),
        (status = 400, response = ErrorBody), (status = 401, response = ErrorBody), (status = 403, response = ErrorBody), (status = 404, response = ErrorBody),
        (status = 413, response = ErrorBody), (status = 501, response = ErrorBody)))]
async fn remove_tags(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    body: Body,
) -> ApiResult<Response> {
    let b: RemoveTags = parse_json(&read_body(body, crate::routes::MAX_BODY).await?)?;
    if b.name.contains(':') {
        return Err(ApiError::BadRequest("name must not carry a tag".into()));
    }
    let name = template_name(&b.name)?;
    let st = visible(&cp, &team, &name)?;
    if st.owner(&name).is_none() {
        return Err(ApiError::NotFound(format!("template '{name}' not found")));
    }
    st.remove_tags(&name, &b.tags).map_err(tpl_err)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// A template's tags and the builds they name.
#[utoipa::path(get, path = "/templates/{id}/tags", tag = "templates",
    params(("id" = String, Path, description = "Template name", pattern = "^([A-Za-z0-9][A-Za-z0-9._-]*/)?[a-z0-9][a-z0-9._-]{0,63}(:[^/%]*)?$")),
    responses((status = 200, body = Vec<Object>), (status = 400, response = ErrorBody),
        (status = 401, response = ErrorBody), (status = 404, response = ErrorBody)))]
async fn list_tags(
    State(cp): Cp,
    Extension(team): Extension<Team>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let name = template_name(&id)?;
    let st = visible(&cp, &team, &name)?;
    let tags: Vec<TagInfo> = st.tags(&name).map_err(tpl_err)?;
    if tags.is_empty() {
        return Err(ApiError::NotFound(format!("template '{name}' not found")));
    }
    let out: Vec<Value> = tags
        .iter()
        .map(|t| json!({ "tag": t.tag, "buildID": t.build_id, "createdAt": format_time(t.assigned_at_ms as i64) }))
        .collect();
    Ok(Json(out).into_response())
}

// ---- GC (Cubicle's own) ----

/// Cubicle's own: remove layers no template, build, sandbox or snapshot uses.
#[utoipa::path(post, path = "/cubicle/templates/gc", tag = "templates",
    responses((status = 200, body = Object, description = "removed, freedBytes, kept"),
        (status = 401, response = ErrorBody), (status = 501, response = ErrorBody)))]
async fn gc(State(cp): Cp) -> ApiResult<Response> {
    let st = store(&cp)?;
    let in_use = cp.backend().layers_in_use();
    let report = tokio::task::spawn_blocking(move || st.gc(&in_use, Duration::from_secs(600)))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .map_err(tpl_err)?;
    let removed: BTreeMap<String, u64> = report
        .removed
        .iter()
        .map(|l| (l.id.clone(), l.size_bytes))
        .collect();
    Ok(
        Json(json!({ "removed": removed, "freedBytes": report.freed_bytes, "kept": report.kept }))
            .into_response(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_and_hashes() {
        let u = new_uuid();
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
        assert!(valid_hash(&"a".repeat(64)));
        assert!(!valid_hash("../../etc/passwd"));
    }

    #[test]
    fn sources() {
        let b: StartV2 =
            serde_json::from_str(r#"{"fromImage":"e2bdev/base","force":false,"steps":[]}"#)
                .unwrap();
        assert!(matches!(source(&b).unwrap(), Source::Template(t) if t == "base"));
        let b: StartV2 = serde_json::from_str(
            r#"{"fromImage":"localhost:5000/x:1","fromImageRegistry":{"type":"registry","username":"u","password":"p"},"steps":[]}"#,
        )
        .unwrap();
        assert!(
            matches!(source(&b).unwrap(), Source::Image { credentials: Some(c), .. } if c.username == "u")
        );
        let b: StartV2 = serde_json::from_str(
            r#"{"fromImage":"x","fromImageRegistry":{"type":"aws"},"steps":[]}"#,
        )
        .unwrap();
        assert!(source(&b).is_err());
        let b: StartV2 = serde_json::from_str(r#"{"fromTemplate":"app:v1","steps":[]}"#).unwrap();
        assert!(matches!(source(&b).unwrap(), Source::Template(t) if t == "app:v1"));
    }
}
