//! One Jupyter kernel process and its ZeroMQ channels (shell DEALER, iopub SUB, and a
//! control DEALER for kernels interrupted by message), and the kernelspecs that say how
//! to start each language's kernel.
//!
//! The kernel is spawned from a connection file (random loopback ports, random HMAC
//! key) in its own process group. A task per channel decodes incoming messages and routes
//! them by `parent_header.msg_id` to whoever registered that request id; a third task
//! waits for the process and flips `dead`. Interrupts are SIGINT to the kernel (the default
//! `interrupt_mode`, `signal`: ipykernel, IRkernel) or an `interrupt_request` on control
//! (`message`: jjava, Deno). Dropping the `Kernel` kills its process group.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::error::Error;
use crate::jupyter::{self, Message};

type Routes = Arc<Mutex<HashMap<String, mpsc::UnboundedSender<Message>>>>;

/// How to start one language's kernel: a Jupyter kernelspec (`kernel.json`) or Deno.
#[derive(Debug, Clone, PartialEq)]
pub struct Spec {
    /// argv with `{connection_file}` still in it (and `{resource_dir}` replaced).
    pub argv: Vec<String>,
    /// Extra environment of the kernel (the spec's `env`).
    pub env: BTreeMap<String, String>,
    /// Interrupted with `interrupt_request` on the control channel (`interrupt_mode:
    /// message`) rather than SIGINT.
    pub interrupt_message: bool,
    /// May publish a request's last outputs after its `idle` status (Deno does).
    pub late_outputs: bool,
}

/// How to launch kernels: one [`Spec`] per language.
#[derive(Debug, Clone, Default)]
pub struct Launcher {
    /// Language (lower case: `python`, `bash`, `r`, `java`, `javascript`, `typescript`)
    /// → its kernel.
    pub specs: BTreeMap<String, Spec>,
    /// Directory for connection files.
    pub runtime_dir: PathBuf,
}

impl Launcher {
    /// Kernels found in the kernelspec directories `dirs` (each holding `<name>/kernel.json`;
    /// a spec named in `prefer` wins its language, else the first one in search order and
    /// name order), plus Deno's built-in kernel for JavaScript and TypeScript when `deno`
    /// is given.
    pub fn discover(
        dirs: &[PathBuf],
        prefer: &[String],
        deno: Option<&str>,
        runtime_dir: PathBuf,
    ) -> Launcher {
        let mut specs = BTreeMap::new();
        let mut preferred = std::collections::BTreeSet::new();
        for dir in dirs {
            let Ok(rd) = std::fs::read_dir(dir) else {
                continue;
            };
            let mut entries: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
            entries.sort();
            for d in entries {
                let Some((lang, spec)) = read_spec(&d) else {
                    continue;
                };
                let named = d
                    .file_name()
                    .is_some_and(|n| prefer.iter().any(|p| n == p.as_str()));
                if named && preferred.insert(lang.clone()) {
                    specs.insert(lang, spec);
                } else {
                    specs.entry(lang).or_insert(spec);
                }
            }
        }
        if let Some(deno) = deno {
            let spec = Spec {
                argv: vec![
                    deno.to_string(),
                    "jupyter".into(),
                    "--kernel".into(),
                    "--conn".into(),
                    "{connection_file}".into(),
                ],
                env: BTreeMap::from([("NO_COLOR".to_string(), "1".to_string())]),
                interrupt_message: true,
                late_outputs: true,
            };
            specs.insert("javascript".into(), spec.clone());
            specs.insert("typescript".into(), spec);
        }
        Launcher { specs, runtime_dir }
    }

    /// The languages this sandbox can run.
    pub fn languages(&self) -> Vec<&str> {
        self.specs.keys().map(String::as_str).collect()
    }
}

/// A kernelspec directory's language and [`Spec`], if its `kernel.json` is usable.
fn read_spec(dir: &std::path::Path) -> Option<(String, Spec)> {
    let text = std::fs::read_to_string(dir.join("kernel.json")).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    let lang = v.get("language")?.as_str()?.trim().to_ascii_lowercase();
    let resource_dir = dir.to_string_lossy();
    let argv: Vec<String> = v
        .get("argv")?
        .as_array()?
        .iter()
        .map(|a| {
            a.as_str()
                .map(|a| a.replace("{resource_dir}", &resource_dir))
        })
        .collect::<Option<_>>()?;
    if argv.is_empty() || !argv.iter().any(|a| a.contains("{connection_file}")) {
        return None;
    }
    let env = v
        .get("env")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default();
    let interrupt_message = v.get("interrupt_mode").and_then(Value::as_str) == Some("message");
    Some((
        lang,
        Spec {
            argv,
            env,
            interrupt_message,
            late_outputs: false,
        },
    ))
}

pub struct Kernel {
    key: Vec<u8>,
    session: String,
    shell_tx: mpsc::UnboundedSender<Vec<Bytes>>,
    /// Control channel, for kernels interrupted by `interrupt_request` (Deno: SIGINT
    /// would end it) rather than by SIGINT.
    control_tx: Option<mpsc::UnboundedSender<Vec<Bytes>>>,
    late_outputs: bool,
    routes: Routes,
    pid: i32,
    dead: watch::Receiver<bool>,
    conn_file: PathBuf,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// How long a kernel may take from its spawn to its first `kernel_info_reply`.
const STARTUP: Duration = Duration::from_secs(60);

/// A kernel between its spawn and the moment it is ready: dropped before then (a failed
/// start, or a caller that gave up), it kills the kernel's process group, stops its tasks
/// and removes its connection file, as dropping a [`Kernel`] does.
struct Starting {
    pid: i32,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    conn_file: Option<PathBuf>,
}

impl Starting {
    /// The tasks and connection file, handed to the [`Kernel`] that owns them from now.
    fn into_kernel_parts(mut self) -> (Vec<tokio::task::JoinHandle<()>>, PathBuf) {
        self.pid = 0;
        let tasks = std::mem::take(&mut self.tasks);
        (tasks, self.conn_file.take().unwrap_or_default())
    }
}

impl Drop for Starting {
    fn drop(&mut self) {
        kill_group(self.pid);
        for t in &self.tasks {
            t.abort();
        }
        if let Some(f) = &self.conn_file {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// One step of a kernel's start, bounded: it fails when the kernel dies or the start's
/// deadline passes first.
struct Step<'a> {
    language: &'a str,
    what: &'static str,
    dead: watch::Receiver<bool>,
    deadline: Instant,
}

impl Step<'_> {
    async fn run<T>(mut self, step: impl std::future::Future<Output = T>) -> Result<T, Error> {
        tokio::select! {
            v = step => Ok(v),
            // Also an error when the sender is gone: the process watcher ended.
            _ = self.dead.wait_for(|d| *d) => Err(Error::ExitedAtStart(self.language.to_string())),
            _ = tokio::time::sleep_until(self.deadline.into()) => Err(Error::Kernel(format!(
                "{} kernel did not start within {}s (waiting for {})",
                self.language,
                STARTUP.as_secs(),
                self.what
            ))),
        }
    }
}

impl Step<'_> {
    /// `socket` connected to the kernel's loopback `port`. The kernel binds its ports as
    /// it starts, and zeromq's `connect` retries a refused connection forever, backing
    /// off a second and more between tries: the port is waited for with plain connects
    /// first, 20 ms apart, then connected to once.
    async fn connect(self, socket: &mut impl Socket, port: u16) -> Result<(), Error> {
        let what = self.what;
        self.run(async {
            listening(port).await;
            socket.connect(&format!("tcp://127.0.0.1:{port}")).await
        })
        .await?
        .map_err(|e| Error::Kernel(format!("{what}: {e}")))
    }
}

/// Returns once something accepts TCP connections on loopback `port`.
async fn listening(port: u16) {
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// SIGKILL to process group `pid` (nothing for 0).
fn kill_group(pid: i32) {
    if pid > 0 {
        // SAFETY: plain kill(2) on a process group the interpreter created.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
    }
}

fn free_port() -> Result<u16, Error> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| Error::io("bind", e))?;
    Ok(l.local_addr()
        .map_err(|e| Error::io("local_addr", e))?
        .port())
}

impl Kernel {
    /// Spawn a kernel and wait until it answers `kernel_info_request` and its iopub
    /// channel delivers.
    pub async fn start(
        launcher: &Launcher,
        language: &str,
        cwd: &str,
        env: &[(String, String)],
    ) -> Result<Arc<Kernel>, Error> {
        let spec = launcher.specs.get(language).ok_or_else(|| {
            Error::Kernel(format!(
                "language '{language}' is not supported in this sandbox (supported: {})",
                launcher.languages().join(", ")
            ))
        })?;
        let argv = spec.argv.clone();
        let key = jupyter::random_id();
        let (shell, iopub, control) = (free_port()?, free_port()?, free_port()?);
        let by_message = spec.interrupt_message;
        let conn = json!({
            "shell_port": shell, "iopub_port": iopub, "stdin_port": free_port()?,
            "control_port": control, "hb_port": free_port()?,
            "ip": "127.0.0.1", "key": key, "transport": "tcp",
            "signature_scheme": "hmac-sha256", "kernel_name": language,
        });
        std::fs::create_dir_all(&launcher.runtime_dir)
            .map_err(|e| Error::io("mkdir runtime dir", e))?;
        let conn_file = launcher
            .runtime_dir
            .join(format!("kernel-{}.json", jupyter::random_id()));
        {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&conn_file)
                .map_err(|e| Error::io("write connection file", e))?;
            f.write_all(conn.to_string().as_bytes())
                .map_err(|e| Error::io("write connection file", e))?;
        }
        let cf = conn_file.to_string_lossy().into_owned();
        let mut argv: Vec<String> = argv
            .into_iter()
            .map(|a| a.replace("{connection_file}", &cf))
            .collect();
        if language == "python" {
            // IPython's input history in memory, not in a SQLite file written after every
            // execution: that write was 2-3 ms of the kernel's ~6 ms of CPU per
            // `run_code("1+1")`. `In`, `Out`, `_i`, `%history` work as before, within the
            // kernel's life.
            argv.push("--HistoryManager.hist_file=:memory:".into());
        }
        let mut cmd = tokio::process::Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .current_dir(cwd)
            .env_remove("CUBICLE_ENVD_ACCESS_TOKEN")
            .envs(spec.env.iter())
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(std::process::Stdio::null())
            .process_group(0)
            .kill_on_drop(true);
        if language == "python" {
            cmd.env("MPLBACKEND", "module://matplotlib_inline.backend_inline");
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| Error::io(format!("spawn {}", argv[0]), e))?;
        let pid = child.id().map(|p| p as i32).unwrap_or(0);
        let (dead_tx, dead) = watch::channel(false);
        // Until the kernel is ready, a failure (or a caller that gives up) kills its
        // process group, stops its tasks and removes its connection file.
        let mut starting = Starting {
            pid,
            tasks: Vec::new(),
            conn_file: Some(conn_file),
        };
        starting.tasks.push(tokio::spawn(async move {
            let st = child.wait().await;
            tracing::warn!(pid, "kernel exited: {st:?}");
            let _ = dead_tx.send(true);
        }));

        let deadline = Instant::now() + STARTUP;
        let step = |what: &'static str| Step {
            language,
            what,
            dead: dead.clone(),
            deadline,
        };
        let routes: Routes = Arc::default();
        let mut sub = SubSocket::new();
        step("iopub").connect(&mut sub, iopub).await?;
        step("subscribe")
            .run(sub.subscribe(""))
            .await?
            .map_err(|e| Error::Kernel(format!("subscribe: {e}")))?;
        let mut dealer = DealerSocket::new();
        step("shell").connect(&mut dealer, shell).await?;
        let (shell_tx, mut shell_rx) = mpsc::unbounded_channel::<Vec<Bytes>>();
        let kb = key.clone().into_bytes();
        let r = routes.clone();
        starting.tasks.push(tokio::spawn(async move {
            loop {
                tokio::select! {
                    out = shell_rx.recv() => {
                        let Some(frames) = out else { break };
                        let Ok(m) = ZmqMessage::try_from(frames) else { continue };
                        if let Err(e) = dealer.send(m).await {
                            tracing::warn!("shell send: {e}");
                        }
                    }
                    inc = dealer.recv() => match inc {
                        Ok(m) => dispatch(&kb, &r, m),
                        Err(e) => { tracing::warn!("shell recv: {e}"); break }
                    }
                }
            }
        }));
        let mut control_tx = None;
        if by_message {
            let mut ctl = DealerSocket::new();
            step("control").connect(&mut ctl, control).await?;
            let (tx, mut rx) = mpsc::unbounded_channel::<Vec<Bytes>>();
            control_tx = Some(tx);
            starting.tasks.push(tokio::spawn(async move {
                loop {
                    tokio::select! {
                        out = rx.recv() => {
                            let Some(frames) = out else { break };
                            let Ok(m) = ZmqMessage::try_from(frames) else { continue };
                            let _ = ctl.send(m).await;
                        }
                        inc = ctl.recv() => if inc.is_err() { break },
                    }
                }
            }));
        }
        let kb = key.clone().into_bytes();
        let r = routes.clone();
        starting.tasks.push(tokio::spawn(async move {
            loop {
                match sub.recv().await {
                    Ok(m) => dispatch(&kb, &r, m),
                    Err(e) => {
                        tracing::warn!("iopub recv: {e}");
                        break;
                    }
                }
            }
        }));
        let (tasks, conn_file) = starting.into_kernel_parts();
        let k = Arc::new(Kernel {
            key: key.into_bytes(),
            session: jupyter::random_id(),
            shell_tx,
            control_tx,
            late_outputs: spec.late_outputs,
            routes,
            pid,
            dead,
            conn_file,
            tasks,
        });
        // Ready when kernel_info is answered on shell AND a status arrives on iopub (the
        // SUB subscription is live).
        loop {
            if k.is_dead() {
                return Err(Error::ExitedAtStart(language.to_string()));
            }
            if Instant::now() > deadline {
                return Err(Error::Kernel(format!(
                    "{language} kernel did not answer within {}s",
                    STARTUP.as_secs()
                )));
            }
            let (id, mut rx) = k.request("kernel_info_request", json!({}))?;
            let (mut reply, mut iopub) = (false, false);
            let until = tokio::time::sleep(Duration::from_millis(1000));
            tokio::pin!(until);
            while !(reply && iopub) {
                tokio::select! {
                    m = rx.recv() => match m {
                        Some(m) if m.msg_type() == "kernel_info_reply" => reply = true,
                        Some(m) if m.msg_type() == "status" => iopub = true,
                        Some(_) => {}
                        None => break,
                    },
                    _ = &mut until => break,
                }
            }
            k.unregister(&id);
            if reply && iopub {
                return Ok(k);
            }
        }
    }

    pub fn is_dead(&self) -> bool {
        *self.dead.borrow()
    }

    /// A receiver that changes when the kernel dies.
    pub fn dead_watch(&self) -> watch::Receiver<bool> {
        self.dead.clone()
    }

    /// Send a shell request; replies and iopub messages with it as parent arrive on the
    /// returned receiver until [`Kernel::unregister`].
    pub fn request(
        &self,
        msg_type: &str,
        content: Value,
    ) -> Result<(String, mpsc::UnboundedReceiver<Message>), Error> {
        let msg = Message::new(msg_type, &self.session, content);
        let id = msg.msg_id().to_string();
        let (tx, rx) = mpsc::unbounded_channel();
        if let Ok(mut r) = self.routes.lock() {
            r.insert(id.clone(), tx);
        }
        self.shell_tx
            .send(jupyter::encode(&self.key, &msg))
            .map_err(|_| Error::Kernel("kernel shell channel closed".into()))?;
        Ok((id, rx))
    }

    /// Whether the kernel may publish outputs after its `idle` status (Deno's does).
    pub fn late_outputs(&self) -> bool {
        self.late_outputs
    }

    pub fn unregister(&self, id: &str) {
        if let Ok(mut r) = self.routes.lock() {
            r.remove(id);
        }
    }

    /// Interrupt the running execution: `interrupt_request` on control for kernels that
    /// want it, else SIGINT (KeyboardInterrupt in ipykernel).
    pub fn interrupt(&self) {
        if let Some(tx) = &self.control_tx {
            let msg = Message::new("interrupt_request", &self.session, json!({}));
            let _ = tx.send(jupyter::encode(&self.key, &msg));
        } else if self.pid > 0 {
            // SAFETY: plain kill(2) on the kernel we spawned.
            unsafe { libc::kill(self.pid, libc::SIGINT) };
        }
    }

    /// SIGKILL the kernel's process group.
    pub fn kill(&self) {
        kill_group(self.pid);
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        self.kill();
        for t in &self.tasks {
            t.abort();
        }
        let _ = std::fs::remove_file(&self.conn_file);
    }
}

fn dispatch(key: &[u8], routes: &Routes, m: ZmqMessage) {
    let frames = m.into_vec();
    match jupyter::decode(key, &frames) {
        Ok(msg) => {
            let parent = msg.parent_id().to_string();
            if let Ok(r) = routes.lock()
                && let Some(tx) = r.get(&parent)
            {
                let _ = tx.send(msg);
            }
        }
        Err(e) => tracing::warn!("dropping kernel message: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovers_kernelspecs() {
        let root = std::env::temp_dir().join(format!("cb-kspec-{}", std::process::id()));
        let (venv, system) = (root.join("venv"), root.join("system"));
        let write = |dir: &std::path::Path, name: &str, json: &str| {
            std::fs::create_dir_all(dir.join(name)).unwrap();
            std::fs::write(dir.join(name).join("kernel.json"), json).unwrap();
        };
        write(
            &venv,
            "python3",
            r#"{"argv": ["/v/python", "-m", "ipykernel_launcher", "-f", "{connection_file}"], "language": "python"}"#,
        );
        write(
            &venv,
            "java",
            r#"{"argv": ["java", "-jar", "{resource_dir}/l.jar", "{connection_file}"], "language": "java", "interrupt_mode": "message", "env": {"A": "1"}}"#,
        );
        write(
            &system,
            "ir",
            r#"{"argv": ["R", "--slave", "-e", "IRkernel::main()", "--args", "{connection_file}"], "language": "R"}"#,
        );
        // A second Python spec later in the search path loses; a spec without a
        // connection file placeholder is ignored.
        write(
            &system,
            "python-other",
            r#"{"argv": ["/other/python", "{connection_file}"], "language": "python"}"#,
        );
        write(
            &system,
            "broken",
            r#"{"argv": ["x"], "language": "broken"}"#,
        );
        let l = Launcher::discover(
            &[venv.clone(), system.clone()],
            &[],
            Some("/d/deno"),
            root.clone(),
        );
        assert_eq!(
            l.languages(),
            ["java", "javascript", "python", "r", "typescript"]
        );
        assert_eq!(l.specs["python"].argv[0], "/v/python");
        let java = &l.specs["java"];
        assert_eq!(
            java.argv[2],
            format!("{}/l.jar", venv.join("java").display())
        );
        assert!(java.interrupt_message && !java.late_outputs);
        assert_eq!(java.env["A"], "1");
        assert!(!l.specs["r"].interrupt_message);
        assert!(l.specs["javascript"].late_outputs && l.specs["typescript"].interrupt_message);
        // A preferred spec wins its language wherever it is found.
        let l = Launcher::discover(
            &[venv.clone(), system],
            &["python-other".to_string()],
            None,
            root.clone(),
        );
        assert_eq!(l.specs["python"].argv[0], "/other/python");
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// A launcher whose only language, `fake`, runs `sh -c SCRIPT` (with the connection
    /// file as `$1`), connection files under `dir`.
    fn fake(dir: &std::path::Path, script: &str) -> Launcher {
        let mut l = Launcher {
            runtime_dir: dir.to_path_buf(),
            ..Default::default()
        };
        l.specs.insert(
            "fake".into(),
            Spec {
                argv: ["sh", "-c", script, "sh", "{connection_file}"]
                    .map(String::from)
                    .to_vec(),
                env: BTreeMap::new(),
                interrupt_message: false,
                late_outputs: false,
            },
        );
        l
    }

    /// Whether process `pid` runs (a zombie, killed but not yet reaped, does not).
    fn alive(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| Some(s.rsplit_once(") ")?.1.starts_with(|c| c != 'Z')))
            .unwrap_or(false)
    }

    /// A kernel that dies before it listens is an error at once. zeromq's `connect`
    /// retries a refused port forever: before the start's steps were bounded, this
    /// start never returned (seen in CI: a JavaScript context that hung for 15 minutes,
    /// until its sandbox's end).
    #[tokio::test]
    async fn a_kernel_that_dies_before_listening_fails_its_start() {
        let dir = std::env::temp_dir().join(format!("cb-kdie-{}", std::process::id()));
        let l = fake(&dir, "sleep 0.2");
        let t0 = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(20), Kernel::start(&l, "fake", "/", &[]))
            .await
            .expect("the start returns");
        let e = r.err().expect("an error").to_string();
        assert!(e.contains("fake kernel exited during startup"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert!(left.is_empty(), "connection files left: {left:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A start given up on (its caller's future dropped) kills the kernel's process
    /// group and removes its connection file.
    #[tokio::test]
    async fn a_start_given_up_on_leaves_no_kernel() {
        let dir = std::env::temp_dir().join(format!("cb-kgone-{}", std::process::id()));
        let pidfile = dir.join("pid");
        let l = fake(
            &dir,
            &format!("echo $$ > {}; exec sleep 1000", pidfile.display()),
        );
        let r =
            tokio::time::timeout(Duration::from_secs(1), Kernel::start(&l, "fake", "/", &[])).await;
        assert!(
            r.is_err(),
            "the kernel never listens: the start is still waiting"
        );
        let pid: i32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let t0 = Instant::now();
        while alive(pid) {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "kernel {pid} still running"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        std::fs::remove_file(&pidfile).unwrap();
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert!(left.is_empty(), "connection files left: {left:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
