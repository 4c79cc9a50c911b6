//! `process.Process`: start, attach to, feed, signal and list processes (and PTYs).
//!
//! * `Start` spawns the process (see [`spawn`]) and streams `start{pid}`, its output,
//!   keepalives, and one `end`. `Connect-Timeout-Ms` is the process lifetime: at the
//!   deadline the process (its whole session) is killed and the stream ends with
//!   `deadline_exceeded`. A client that goes away does not kill the process.
//! * `Connect` re-attaches to live output (no replay); a process that finished in the
//!   last [`table::RETENTION`] is answered with `start` and its retained `end`.
//! * `List`, `SendInput`, `StreamInput`, `SendSignal`, `CloseStdin`, `Update` act on
//!   running processes only (finished ones are `not_found`, as upstream).
//!
//! See shared/spec/e2b-compat.md §3.4.

pub mod pty;
pub mod spawn;
pub mod table;

use std::{path::PathBuf, sync::Arc, time::Duration};

use axum::{
    Router,
    body::Body,
    extract::State,
    http::HeaderMap,
    response::{IntoResponse, Response},
    routing::post,
};
use cubicle_proto::process::{
    CloseStdinRequest, CloseStdinResponse, ConnectRequest, ConnectResponse, ListRequest,
    ListResponse, ProcessEvent, ProcessSelector, SendInputRequest, SendInputResponse,
    SendSignalRequest, SendSignalResponse, Signal, StartRequest, StartResponse, StreamInputRequest,
    StreamInputResponse, UpdateRequest, UpdateResponse,
    process_event::{Event, KeepAlive, StartEvent},
    process_input::Input,
    process_selector::Selector,
    stream_input_request,
};
use futures_util::{Stream, StreamExt};
use tokio::{
    sync::mpsc,
    time::{Instant, sleep, sleep_until},
};

use crate::{
    auth,
    connect::{self, Code, ConnectError, EnvelopeReader},
    paths,
    server::AppState,
    state::Context,
};
use table::{InputError, Proc, Sources, StdinState, Table};

/// The process table and its RPCs.
pub struct ProcessService {
    ctx: Arc<Context>,
    table: Arc<Table>,
}

/// Routes of `process.Process`.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/process.Process/Start", post(start))
        .route("/process.Process/Connect", post(connect_rpc))
        .route("/process.Process/List", post(list))
        .route("/process.Process/SendInput", post(send_input))
        .route("/process.Process/StreamInput", post(stream_input))
        .route("/process.Process/SendSignal", post(send_signal))
        .route("/process.Process/CloseStdin", post(close_stdin))
        .route("/process.Process/Update", post(update))
        .route_layer(axum::middleware::from_fn(require_json_content_type))
}

/// Connect content-type negotiation: only the JSON codec exists; unary calls take
/// `application/json`, streams `application/connect+json`. Anything else (e.g. the
/// binary `application/proto`) is `415 Unsupported Media Type`. A missing header is
/// tolerated.
async fn require_json_content_type(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let streaming = matches!(
        req.uri().path().rsplit('/').next(),
        Some("Start" | "Connect" | "StreamInput")
    );
    let expected = if streaming {
        connect::STREAM_CONTENT_TYPE
    } else {
        "application/json"
    };
    let given = req
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .map(|v| {
            let s = String::from_utf8_lossy(v.as_bytes()).to_string();
            s.split(';')
                .next()
                .unwrap_or_default()
                .trim()
                .to_ascii_lowercase()
        });
    match given {
        Some(ct) if ct != expected => {
            let msg = format!("unsupported content type {ct:?}: expected {expected}");
            let mut resp = ConnectError::invalid_argument(msg).into_response();
            *resp.status_mut() = axum::http::StatusCode::UNSUPPORTED_MEDIA_TYPE;
            if let Ok(v) = axum::http::HeaderValue::from_str(expected) {
                resp.headers_mut().insert("accept-post", v);
            }
            resp
        }
        _ => next.run(req).await,
    }
}

type EventStream = std::pin::Pin<Box<dyn Stream<Item = Result<Event, ConnectError>> + Send>>;

async fn start(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let req = match connect::read_stream_request::<StartRequest>(body).await {
        Ok(r) => r,
        Err(e) => return connect::stream_error(e),
    };
    match st.process.start(&headers, req).await {
        Ok(events) => connect::stream_response(events.map(|e| {
            e.map(|ev| StartResponse {
                event: Some(ProcessEvent { event: Some(ev) }),
            })
        })),
        Err(e) => connect::stream_error(e),
    }
}

async fn connect_rpc(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let req = match connect::read_stream_request::<ConnectRequest>(body).await {
        Ok(r) => r,
        Err(e) => return connect::stream_error(e),
    };
    match st.process.attach(&headers, req) {
        Ok(events) => connect::stream_response(events.map(|e| {
            e.map(|ev| ConnectResponse {
                event: Some(ProcessEvent { event: Some(ev) }),
            })
        })),
        Err(e) => connect::stream_error(e),
    }
}

async fn list(State(st): State<Arc<AppState>>, body: Body) -> Response {
    let result = async {
        let _req: ListRequest = connect::read_unary(body).await?;
        Ok(st.process.list())
    }
    .await;
    connect::unary(result)
}

async fn send_input(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let result = async {
        let req: SendInputRequest = connect::read_unary(body).await?;
        with_deadline(&headers, st.process.send_input(req)).await
    }
    .await;
    connect::unary(result)
}

async fn stream_input(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let result = with_deadline(&headers, st.process.stream_input(body)).await;
    connect::client_stream_response(result)
}

async fn send_signal(State(st): State<Arc<AppState>>, body: Body) -> Response {
    let result = async {
        let req: SendSignalRequest = connect::read_unary(body).await?;
        st.process.send_signal(req)
    }
    .await;
    connect::unary(result)
}

async fn close_stdin(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let result = async {
        let req: CloseStdinRequest = connect::read_unary(body).await?;
        with_deadline(&headers, st.process.close_stdin(req)).await
    }
    .await;
    connect::unary(result)
}

async fn update(State(st): State<Arc<AppState>>, body: Body) -> Response {
    let result = async {
        let req: UpdateRequest = connect::read_unary(body).await?;
        st.process.update(req)
    }
    .await;
    connect::unary(result)
}

/// Bounds a call by its `Connect-Timeout-Ms`.
async fn with_deadline<T>(
    headers: &HeaderMap,
    fut: impl Future<Output = Result<T, ConnectError>>,
) -> Result<T, ConnectError> {
    match connect::timeout(headers).filter(|d| !d.is_zero()) {
        Some(d) => tokio::time::timeout(d, fut)
            .await
            .unwrap_or_else(|_| Err(deadline_exceeded())),
        None => fut.await,
    }
}

fn deadline_exceeded() -> ConnectError {
    ConnectError::new(Code::DeadlineExceeded, "context deadline exceeded")
}

fn input_error(e: InputError) -> ConnectError {
    match e {
        InputError::Disabled | InputError::Closed => {
            ConnectError::failed_precondition(e.to_string())
        }
        InputError::IsPty | InputError::NotPty => ConnectError::invalid_argument(e.to_string()),
        InputError::Io(ref io) if io.raw_os_error() == Some(libc::EPIPE) => {
            ConnectError::failed_precondition("stdin of the process is closed (broken pipe)")
        }
        InputError::Io(_) => ConnectError::internal(e.to_string()),
    }
}

impl ProcessService {
    pub fn new(ctx: Arc<Context>) -> Self {
        Self {
            ctx,
            table: Arc::new(Table::default()),
        }
    }

    /// Number of table entries (running and retained); for tests and metrics.
    pub fn table_len(&self) -> usize {
        self.table.len()
    }

    async fn start(
        &self,
        headers: &HeaderMap,
        req: StartRequest,
    ) -> Result<EventStream, ConnectError> {
        let config = req
            .process
            .ok_or_else(|| ConnectError::invalid_argument("missing process config"))?;
        if config.cmd.is_empty() {
            return Err(ConnectError::invalid_argument("missing command"));
        }
        let user = auth::acting_user(&self.ctx, headers)?;
        let cwd = self.working_dir(&user, config.cwd.as_deref())?;
        if let Some(bad) = config.envs.keys().find(|k| !spawn::valid_env_name(k)) {
            return Err(ConnectError::invalid_argument(format!(
                "invalid environment variable name {bad:?}"
            )));
        }
        let env = spawn::environment(&user, &self.ctx.env_vars(), &config.envs);
        let pty_size = req.pty.map(|p| {
            let size = p.size.unwrap_or_default();
            (pty::clamp(size.cols), pty::clamp(size.rows))
        });
        let stdin_mode = if req.stdin == Some(false) {
            spawn::StdinMode::Null
        } else {
            spawn::StdinMode::Pipe
        };
        let spec = spawn::SpawnSpec {
            cmd: config.cmd.clone(),
            args: config.args.clone(),
            env,
            cwd,
            uid: user.uid,
            gid: user.gid,
            groups: user.groups(),
            stdin: stdin_mode,
            pty: pty_size,
        };
        let deadline = connect::timeout(headers)
            .filter(|d| !d.is_zero())
            .map(|d| Instant::now() + d);
        let keepalive = connect::keepalive_interval(headers);
        let table = self.table.clone();
        let tag = req.tag;
        // Spawning (a vfork-style clone, see `spawn`) suspends this thread only until the
        // child execs; spawn and registration happen together, so a request cancelled
        // afterwards still leaves a registered (and drained) process, never an orphan.
        let spawned = spawn::spawn(&spec).map_err(|e| {
            ConnectError::invalid_argument(format!("error starting process '{}': {e}", config.cmd))
        })?;
        let (pid, rx) = register(&table, spawned, config, tag, deadline)?;
        Ok(live_events(pid, rx, deadline, keepalive))
    }

    /// The working directory of a new process: the requested one (which must exist), else
    /// the default workdir or home (else `/`).
    fn working_dir(
        &self,
        user: &crate::users::User,
        cwd: Option<&str>,
    ) -> Result<PathBuf, ConnectError> {
        match cwd.filter(|c| !c.is_empty()) {
            Some(c) => {
                let path = paths::resolve(&self.ctx, user, c)?;
                if !path.is_dir() {
                    return Err(ConnectError::invalid_argument(format!(
                        "cwd '{}' does not exist",
                        path.display()
                    )));
                }
                Ok(path)
            }
            None => {
                let path = paths::resolve(&self.ctx, user, "")?;
                Ok(if path.is_dir() {
                    path
                } else {
                    PathBuf::from("/")
                })
            }
        }
    }

    fn find(&self, selector: Option<&ProcessSelector>) -> Result<Arc<Proc>, ConnectError> {
        match selector.and_then(|s| s.selector.as_ref()) {
            Some(Selector::Pid(pid)) => self.table.get(*pid).ok_or_else(|| {
                ConnectError::not_found(format!("process with pid {pid} not found"))
            }),
            Some(Selector::Tag(tag)) => self.table.by_tag(tag).ok_or_else(|| {
                ConnectError::not_found(format!("process with tag {tag} not found"))
            }),
            None => Err(ConnectError::invalid_argument("missing process selector")),
        }
    }

    fn find_running(&self, selector: Option<&ProcessSelector>) -> Result<Arc<Proc>, ConnectError> {
        let p = self.find(selector)?;
        if p.running() {
            Ok(p)
        } else {
            Err(ConnectError::not_found(format!(
                "process with pid {} not found",
                p.pid
            )))
        }
    }

    fn attach(
        &self,
        headers: &HeaderMap,
        req: ConnectRequest,
    ) -> Result<EventStream, ConnectError> {
        let proc = self.find(req.process.as_ref())?;
        let pid = proc.pid;
        let (tx, rx) = mpsc::channel(table::SUBSCRIBER_BUFFER);
        match proc.subscribe(tx) {
            Ok(()) => {
                let deadline = connect::timeout(headers)
                    .filter(|d| !d.is_zero())
                    .map(|d| Instant::now() + d);
                Ok(live_events(
                    pid,
                    rx,
                    deadline,
                    connect::keepalive_interval(headers),
                ))
            }
            Err(end) => Ok(Box::pin(futures_util::stream::iter([
                Ok(Event::Start(StartEvent { pid })),
                Ok(Event::End(end)),
            ]))),
        }
    }

    fn list(&self) -> ListResponse {
        ListResponse {
            processes: self.table.running().iter().map(|p| p.info()).collect(),
        }
    }

    async fn send_input(&self, req: SendInputRequest) -> Result<SendInputResponse, ConnectError> {
        let proc = self.find_running(req.process.as_ref())?;
        match req.input.and_then(|i| i.input) {
            Some(Input::Stdin(data)) => proc.write_stdin(&data).await.map_err(input_error)?,
            Some(Input::Pty(data)) => proc.write_pty(&data).await.map_err(input_error)?,
            None => return Err(ConnectError::invalid_argument("missing input")),
        }
        Ok(SendInputResponse {})
    }

    async fn stream_input(&self, body: Body) -> Result<StreamInputResponse, ConnectError> {
        let mut reader = EnvelopeReader::new(body);
        let result = self.feed_input(&mut reader).await;
        if result.is_err() {
            // Let the client finish sending so the connection stays usable.
            tokio::spawn(reader.drain());
        }
        result
    }

    async fn feed_input(
        &self,
        reader: &mut EnvelopeReader,
    ) -> Result<StreamInputResponse, ConnectError> {
        let first: Option<StreamInputRequest> = reader.next().await?;
        let proc = match first.and_then(|m| m.event) {
            Some(stream_input_request::Event::Start(s)) => self.find_running(s.process.as_ref())?,
            _ => {
                return Err(ConnectError::invalid_argument(
                    "the first message must be a start event",
                ));
            }
        };
        while let Some(msg) = reader.next::<StreamInputRequest>().await? {
            match msg.event {
                Some(stream_input_request::Event::Data(d)) => match d.input.and_then(|i| i.input) {
                    Some(Input::Stdin(data)) => {
                        proc.write_stdin(&data).await.map_err(input_error)?
                    }
                    Some(Input::Pty(data)) => proc.write_pty(&data).await.map_err(input_error)?,
                    None => {}
                },
                Some(stream_input_request::Event::Start(_)) => {
                    return Err(ConnectError::invalid_argument("start event sent twice"));
                }
                Some(stream_input_request::Event::Keepalive(_)) | None => {}
            }
        }
        Ok(StreamInputResponse {})
    }

    fn send_signal(&self, req: SendSignalRequest) -> Result<SendSignalResponse, ConnectError> {
        let sig = match Signal::try_from(req.signal) {
            Ok(Signal::Sigkill) => libc::SIGKILL,
            Ok(Signal::Sigterm) => libc::SIGTERM,
            _ => {
                return Err(ConnectError::unimplemented(format!(
                    "invalid signal: {}",
                    req.signal
                )));
            }
        };
        let proc = self.find_running(req.process.as_ref())?;
        proc.signal(sig).map_err(|e| {
            if e.raw_os_error() == Some(libc::ESRCH) {
                ConnectError::not_found(format!("process with pid {} not found", proc.pid))
            } else {
                ConnectError::internal(format!("error sending signal: {e}"))
            }
        })?;
        Ok(SendSignalResponse {})
    }

    async fn close_stdin(
        &self,
        req: CloseStdinRequest,
    ) -> Result<CloseStdinResponse, ConnectError> {
        let proc = self.find_running(req.process.as_ref())?;
        proc.close_stdin().await.map_err(input_error)?;
        Ok(CloseStdinResponse {})
    }

    fn update(&self, req: UpdateRequest) -> Result<UpdateResponse, ConnectError> {
        let proc = self.find_running(req.process.as_ref())?;
        if let Some(p) = req.pty {
            let size = p.size.unwrap_or_default();
            proc.resize(pty::clamp(size.cols), pty::clamp(size.rows))
                .map_err(|e| match e {
                    InputError::NotPty => ConnectError::failed_precondition("process is not a PTY"),
                    other => input_error(other),
                })?;
        }
        Ok(UpdateResponse {})
    }
}

/// Enters a freshly spawned process in the table and starts its supervisor. Runs in
/// the runtime's context (it registers the PTY with the reactor and spawns a task).
fn register(
    table: &Table,
    spawned: spawn::Spawned,
    config: cubicle_proto::process::ProcessConfig,
    tag: Option<String>,
    deadline: Option<Instant>,
) -> Result<(u32, mpsc::Receiver<Event>), ConnectError> {
    let mut child = spawned.child;
    let pid = child.id();
    let (stdin, sources, master) = match spawned.io {
        spawn::Io::Pipes {
            stdin,
            stdout,
            stderr,
        } => (
            match stdin {
                Some(s) => StdinState::Open(s),
                None => StdinState::Disabled,
            },
            Sources::Pipes { stdout, stderr },
            None,
        ),
        spawn::Io::Pty { master } => match pty::PtyMaster::new(master) {
            Ok(m) => {
                let m = Arc::new(m);
                (StdinState::Disabled, Sources::Pty(m.clone()), Some(m))
            }
            Err(e) => {
                let _ = table::signal_session(pid, libc::SIGKILL);
                tokio::spawn(async move {
                    let _ = child.wait().await;
                    crate::init::forget(pid);
                });
                return Err(ConnectError::internal(format!("registering the PTY: {e}")));
            }
        },
    };
    let (tx, rx) = mpsc::channel(table::SUBSCRIBER_BUFFER);
    let proc = Arc::new(Proc::new(pid, config, tag, stdin, master, Some(tx)));
    table.insert(proc.clone());
    tracing::debug!(pid, cmd = %proc.config.cmd, "process started");
    tokio::spawn(table::supervise(proc, child, sources, deadline));
    Ok((pid, rx))
}

/// The events of one attached stream: `start{pid}`, then whatever the supervisor sends
/// (data, then `end`), with keepalives after `keepalive` of silence, ended early with
/// `deadline_exceeded` at `deadline`.
fn live_events(
    pid: u32,
    rx: mpsc::Receiver<Event>,
    deadline: Option<Instant>,
    keepalive: Duration,
) -> EventStream {
    struct S {
        rx: mpsc::Receiver<Event>,
        started: bool,
        done: bool,
    }
    let state = S {
        rx,
        started: false,
        done: false,
    };
    Box::pin(futures_util::stream::unfold(
        state,
        move |mut s| async move {
            if s.done {
                return None;
            }
            if !s.started {
                s.started = true;
                return Some((Ok(Event::Start(StartEvent { pid })), s));
            }
            tokio::select! {
                biased;
                _ = async { sleep_until(deadline.unwrap_or_else(Instant::now)).await }, if deadline.is_some() => {
                    s.done = true;
                    Some((Err(deadline_exceeded()), s))
                }
                ev = s.rx.recv() => match ev {
                    Some(ev @ Event::End(_)) => {
                        s.done = true;
                        Some((Ok(ev), s))
                    }
                    Some(ev) => Some((Ok(ev), s)),
                    None => {
                        s.done = true;
                        Some((Err(ConnectError::new(Code::Unavailable, "process stream ended without an end event")), s))
                    }
                },
                _ = sleep(keepalive) => Some((Ok(Event::Keepalive(KeepAlive {})), s)),
            }
        },
    ))
}
