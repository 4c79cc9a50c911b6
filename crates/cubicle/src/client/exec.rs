//! `cubicle sandbox exec ID CMD…`: `Process.Start` of `/bin/bash -l -c CMD` through
//! the router (exactly the SDK's `commands.run`), stdout/stderr streamed as they arrive,
//! the command's exit code returned. With `-i` the local stdin is streamed to the
//! command (`SendInput` with `stdin`, then `CloseStdin` at its end), as the SDK's
//! `commands.run(stdin=True)` + `send_stdin` do; without it the command's stdin is empty.
//! A command the sandbox refuses to start exits 126 (127: no such program), see
//! [`crate::exit`]. Ctrl-C sends SIGTERM to the command, a second
//! Ctrl-C SIGKILL (a dropped connection alone would leave it running, as envd keeps
//! processes whose client went away). A sandbox without bash (the busybox `tiny`
//! template) gets `/bin/sh -l -c CMD` instead.

use std::{collections::HashMap, time::Duration};

use cubicle_proto::process::{
    CloseStdinRequest, CloseStdinResponse, ProcessConfig, ProcessInput, ProcessSelector,
    SendInputRequest, SendInputResponse, SendSignalRequest, SendSignalResponse, Signal,
    StartRequest, StartResponse,
    process_event::{EndEvent, Event, data_event::Output},
    process_input, process_selector,
};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::exit;

use super::{
    ClientError,
    connect::{EnvdClient, ServerStream},
};

/// The shell commands run under (what the SDK uses).
pub const BASH: &str = "/bin/bash";
/// Used instead when the sandbox has no bash (e.g. the busybox `tiny` template).
pub const SH: &str = "/bin/sh";

/// Whether `e` is envd refusing to start `program` because it does not exist.
pub fn missing_program(e: &ClientError, program: &str) -> bool {
    matches!(e, ClientError::Rpc { code, message }
        if code == "invalid_argument"
            && message.contains(&format!("'{program}'"))
            && message.to_ascii_lowercase().contains("no such file"))
}

/// A started `Process.Start` stream whose first message was already read.
pub struct Started {
    stream: ServerStream<StartResponse>,
    first: Option<StartResponse>,
}

impl Started {
    /// The next event message (the peeked first one, then the stream's).
    pub async fn next(&mut self) -> Result<Option<StartResponse>, ClientError> {
        match self.first.take() {
            Some(m) => Ok(Some(m)),
            None => self.stream.next().await,
        }
    }
}

/// `Process.Start` of `req`; when `req` runs `/bin/bash` and the sandbox has none, the
/// same with `/bin/sh` (nothing ran: envd refuses before spawning).
pub async fn start_process(
    envd: &EnvdClient,
    mut req: StartRequest,
    timeout: Option<Duration>,
) -> Result<Started, ClientError> {
    let mut fallback_done = false;
    loop {
        let mut stream = envd
            .server_stream::<_, StartResponse>("/process.Process/Start", &req, timeout)
            .await?;
        match stream.next().await {
            Ok(first) => return Ok(Started { stream, first }),
            Err(e) if !fallback_done && missing_program(&e, BASH) => {
                fallback_done = true;
                match req.process.as_mut() {
                    Some(p) if p.cmd == BASH => p.cmd = SH.into(),
                    _ => return Err(e),
                }
                tracing::debug!("no {BASH} in the sandbox: using {SH}");
            }
            Err(e) => return Err(e),
        }
    }
}

/// What to run.
pub struct ExecSpec {
    /// Shell command line (`bash -l -c`).
    pub cmd: String,
    pub envs: HashMap<String, String>,
    pub cwd: Option<String>,
    /// Process lifetime (`Connect-Timeout-Ms`); `None`: unlimited.
    pub timeout: Option<Duration>,
    /// Keep the command's stdin open for input (`-i`).
    pub stdin: bool,
}

/// The `Process.Start` request for a command (same shape as the SDK's `commands.run`).
pub fn start_request(spec: &ExecSpec) -> StartRequest {
    StartRequest {
        process: Some(ProcessConfig {
            cmd: BASH.into(),
            args: vec!["-l".into(), "-c".into(), spec.cmd.clone()],
            envs: spec.envs.clone(),
            cwd: spec.cwd.clone(),
        }),
        pty: None,
        tag: None,
        stdin: Some(spec.stdin),
    }
}

/// Largest chunk of stdin sent in one `SendInput`.
const MAX_INPUT_BATCH: usize = 64 << 10;

/// Sends what arrives on `input` to the command's stdin, then closes it (end of the
/// local input). Runs until then or until the command is gone.
async fn forward_stdin(
    envd: EnvdClient,
    pid: u32,
    mut input: mpsc::Receiver<Vec<u8>>,
) -> Result<(), ClientError> {
    let mut conn = envd.connection().await?;
    let process = || {
        Some(ProcessSelector {
            selector: Some(process_selector::Selector::Pid(pid)),
        })
    };
    while let Some(mut data) = input.recv().await {
        while data.len() < MAX_INPUT_BATCH {
            match input.try_recv() {
                Ok(more) => data.extend_from_slice(&more),
                Err(_) => break,
            }
        }
        let req = SendInputRequest {
            process: process(),
            input: Some(ProcessInput {
                input: Some(process_input::Input::Stdin(data)),
            }),
        };
        envd.unary_on::<_, SendInputResponse>(&mut conn, "/process.Process/SendInput", &req)
            .await?;
    }
    let req = CloseStdinRequest { process: process() };
    envd.unary_on::<_, CloseStdinResponse>(&mut conn, "/process.Process/CloseStdin", &req)
        .await?;
    Ok(())
}

/// Reads the local stdin on a plain thread (a blocked read must not hold a runtime
/// thread); the channel closes at end of input.
pub fn stdin_channel() -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel(16);
    let _ = std::thread::Builder::new()
        .name("cubicle-stdin".into())
        .spawn(move || {
            use std::io::Read;
            let mut stdin = std::io::stdin().lock();
            let mut buf = vec![0u8; 32 << 10];
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) => return,
                    Ok(n) => {
                        if tx.blocking_send(buf[..n].to_vec()).is_err() {
                            return;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        eprintln!("cubicle: reading stdin: {e}");
                        return;
                    }
                }
            }
        });
    rx
}

/// The exit error for a command envd refused to start.
fn not_started(e: ClientError) -> anyhow::Error {
    match &e {
        ClientError::Rpc { message, .. } => {
            let lower = message.to_ascii_lowercase();
            let code = if lower.contains("no such file") && !lower.contains("cwd") {
                exit::NOT_FOUND
            } else {
                exit::CANNOT_INVOKE
            };
            exit::Exit {
                code,
                message: format!("the sandbox could not start the command: {message}"),
            }
            .into()
        }
        _ => e.into(),
    }
}

/// The local exit code for an `end` event: the command's code, or 128+signal when it
/// was killed by a signal (as a local shell reports it).
pub fn exit_code(end: &EndEvent) -> i32 {
    if end.exited {
        return end.exit_code & 0xff;
    }
    let sig = end
        .status
        .strip_prefix("signal: ")
        .and_then(signal_number)
        .unwrap_or(0);
    if sig > 0 {
        128 + sig
    } else if end.exit_code > 0 {
        end.exit_code & 0xff
    } else {
        255
    }
}

/// Go's signal names (`os.Signal.String()`), as upstream envd writes them in `status`.
fn signal_number(name: &str) -> Option<i32> {
    Some(match name.trim().trim_end_matches(" (core dumped)") {
        "hangup" => 1,
        "interrupt" => 2,
        "quit" => 3,
        "illegal instruction" => 4,
        "trace/breakpoint trap" => 5,
        "aborted" => 6,
        "bus error" => 7,
        "floating point exception" => 8,
        "killed" => 9,
        "user defined signal 1" => 10,
        "segmentation fault" => 11,
        "user defined signal 2" => 12,
        "broken pipe" => 13,
        "alarm clock" => 14,
        "terminated" => 15,
        other => other.strip_prefix("signal ")?.parse().ok()?,
    })
}

async fn signal(envd: &EnvdClient, pid: u32, sig: Signal) -> Result<(), ClientError> {
    let req = SendSignalRequest {
        process: Some(ProcessSelector {
            selector: Some(process_selector::Selector::Pid(pid)),
        }),
        signal: sig as i32,
    };
    envd.unary::<_, SendSignalResponse>("/process.Process/SendSignal", &req)
        .await
        .map(|_| ())
}

/// Runs the command, copying its output to `out`/`err`; returns the exit code (124 when
/// `spec.timeout` ran out, as `timeout(1)` does).
/// `ctrl_c` yields once per Ctrl-C; `input` (with `spec.stdin`) is the command's stdin.
pub async fn run<O, E>(
    envd: &EnvdClient,
    spec: &ExecSpec,
    out: &mut O,
    err: &mut E,
    mut ctrl_c: tokio::sync::mpsc::Receiver<()>,
    mut input: Option<mpsc::Receiver<Vec<u8>>>,
) -> anyhow::Result<i32>
where
    O: AsyncWrite + Unpin,
    E: AsyncWrite + Unpin,
{
    let mut stream = start_process(envd, start_request(spec), spec.timeout)
        .await
        .map_err(not_started)?;
    let mut pid: Option<u32> = None;
    let mut interrupts_seen = 0;
    // The stdin forwarder starts with the process; it must not outlive this call.
    let mut forwarder: Option<tokio::task::JoinHandle<()>> = None;
    let result = async {
        loop {
            let msg = tokio::select! {
                m = stream.next() => m,
                Some(()) = ctrl_c.recv() => {
                    interrupts_seen += 1;
                    if let Some(pid) = pid {
                        let sig = if interrupts_seen == 1 { Signal::Sigterm } else { Signal::Sigkill };
                        if let Err(e) = signal(envd, pid, sig).await {
                            eprintln!("cubicle: could not signal the command: {e}");
                        }
                    } else if interrupts_seen > 1 {
                        return Ok(130);
                    }
                    continue;
                }
            };
            let msg = match msg {
                Err(ClientError::Rpc { code, message }) if code == "deadline_exceeded" => {
                    eprintln!("cubicle: the command ran out of time ({message}); it was killed");
                    return Ok(124);
                }
                other => other,
            };
            let Some(resp) = msg? else {
                anyhow::bail!("the command's stream ended without an end event");
            };
            match resp.event.and_then(|e| e.event) {
                Some(Event::Start(s)) => {
                    pid = Some(s.pid);
                    if let Some(input) = input.take() {
                        let envd = envd.clone();
                        forwarder = Some(tokio::spawn(async move {
                            match forward_stdin(envd, s.pid, input).await {
                                // The command may end before reading all of its input.
                                Err(ClientError::Rpc { code, .. }) if code == "not_found" => {}
                                Err(e) => eprintln!("cubicle: sending stdin to the command: {e}"),
                                Ok(()) => {}
                            }
                        }));
                    }
                }
                Some(Event::Data(d)) => match d.output {
                    Some(Output::Stdout(b)) | Some(Output::Pty(b)) => {
                        out.write_all(&b).await?;
                        out.flush().await?;
                    }
                    Some(Output::Stderr(b)) => {
                        err.write_all(&b).await?;
                        err.flush().await?;
                    }
                    None => {}
                },
                Some(Event::End(end)) => {
                    // Drain to the end-of-stream so a trailing error is not lost.
                    while stream.next().await?.is_some() {}
                    if let Some(e) = end.error.as_deref().filter(|_| !end.exited) {
                        tracing::debug!("command ended: {e}");
                    }
                    return Ok(exit_code(&end));
                }
                Some(Event::Keepalive(_)) | None => {}
            }
        }
    }
    .await;
    if let Some(f) = forwarder {
        f.abort();
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::testserver::{FakeServer, Reply, env_bytes};
    use std::sync::{Arc, Mutex};

    fn end(exit_code: i32, exited: bool, status: &str) -> EndEvent {
        EndEvent {
            exit_code,
            exited,
            status: status.into(),
            error: None,
        }
    }

    #[test]
    fn exit_codes() {
        assert_eq!(exit_code(&end(0, true, "exit status 0")), 0);
        assert_eq!(exit_code(&end(42, true, "exit status 42")), 42);
        assert_eq!(exit_code(&end(-1, false, "signal: killed")), 137);
        assert_eq!(exit_code(&end(-1, false, "signal: terminated")), 143);
        assert_eq!(exit_code(&end(-1, false, "signal: signal 40")), 168);
        assert_eq!(
            exit_code(&end(-1, false, "signal: segmentation fault (core dumped)")),
            139
        );
        assert_eq!(exit_code(&end(-1, false, "weird")), 255);
    }

    #[test]
    fn request_shape_matches_the_sdk() {
        let spec = ExecSpec {
            cmd: "echo hi".into(),
            envs: HashMap::new(),
            cwd: None,
            timeout: None,
            stdin: false,
        };
        assert_eq!(
            serde_json::to_value(start_request(&spec)).unwrap(),
            serde_json::json!({"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"]},"stdin":false})
        );
    }

    fn no_interrupts() -> tokio::sync::mpsc::Receiver<()> {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        std::mem::forget(tx);
        rx
    }

    #[tokio::test]
    async fn streams_output_and_returns_the_exit_code() {
        let server = FakeServer::start(|_| {
            Reply::stream(vec![
                (0, r#"{"event":{"start":{"pid":9}}}"#),
                (0, r#"{"event":{"data":{"stdout":"b3V0Cg=="}}}"#),
                (0, r#"{"event":{"data":{"stderr":"ZXJyCg=="}}}"#),
                (0, r#"{"event":{"end":{"exitCode":42,"exited":true,"status":"exit status 42","error":"exit status 42"}}}"#),
                (2, "{}"),
            ])
        })
        .await;
        let envd = EnvdClient::new(server.base(), "s", Some("t".into()), None);
        let spec = ExecSpec {
            cmd: "x".into(),
            envs: HashMap::new(),
            cwd: None,
            timeout: None,
            stdin: false,
        };
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = run(&envd, &spec, &mut out, &mut err, no_interrupts(), None)
            .await
            .unwrap();
        assert_eq!(code, 42);
        assert_eq!(out, b"out\n");
        assert_eq!(err, b"err\n");

        // No end event: an error, not a silent 0.
        let server = FakeServer::start(|_| {
            Reply::stream(vec![(0, r#"{"event":{"start":{"pid":9}}}"#), (2, "{}")])
        })
        .await;
        let envd = EnvdClient::new(server.base(), "s", None, None);
        let e = run(&envd, &spec, &mut out, &mut err, no_interrupts(), None)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("without an end event"), "{e}");
    }

    #[tokio::test]
    async fn falls_back_to_sh_without_bash() {
        let cmds = Arc::new(Mutex::new(Vec::<String>::new()));
        let seen = cmds.clone();
        let server = FakeServer::start(move |req| {
            let mut d = cubicle_proto::connect::EnvelopeDecoder::new(1 << 20);
            d.push(&req.body);
            let v: serde_json::Value = serde_json::from_slice(&d.next_envelope().unwrap().unwrap().payload).unwrap();
            let cmd = v["process"]["cmd"].as_str().unwrap().to_string();
            seen.lock().unwrap().push(cmd.clone());
            if cmd == "/bin/bash" {
                return Reply::stream(vec![(2, r#"{"error":{"code":"invalid_argument","message":"error starting process '/bin/bash': No such file or directory (os error 2)"}}"#)]);
            }
            Reply::stream(vec![
                (0, r#"{"event":{"start":{"pid":1}}}"#),
                (0, r#"{"event":{"end":{"exited":true,"status":"exit status 0"}}}"#),
                (2, "{}"),
            ])
        })
        .await;
        let envd = EnvdClient::new(server.base(), "s", None, None);
        let spec = ExecSpec {
            cmd: "true".into(),
            envs: HashMap::new(),
            cwd: None,
            timeout: None,
            stdin: false,
        };
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert_eq!(
            run(&envd, &spec, &mut out, &mut err, no_interrupts(), None)
                .await
                .unwrap(),
            0
        );
        assert_eq!(*cmds.lock().unwrap(), ["/bin/bash", "/bin/sh"]);

        // Other start errors are reported as they are, without a retry.
        let e = ClientError::Rpc {
            code: "invalid_argument".into(),
            message: "cwd '/x' does not exist".into(),
        };
        assert!(!missing_program(&e, BASH));
    }

    #[tokio::test]
    async fn ctrl_c_sends_sigterm_to_the_command() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let rx = Arc::new(Mutex::new(Some(rx)));
        let signals = Arc::new(Mutex::new(Vec::<serde_json::Value>::new()));
        let (seen, feed) = (signals.clone(), tx.clone());
        let server = FakeServer::start(move |req| {
            if req.path == "/process.Process/SendSignal" {
                let v: serde_json::Value = serde_json::from_slice(&req.body).unwrap();
                seen.lock().unwrap().push(v);
                let _ = feed.send(env_bytes(
                    0,
                    r#"{"event":{"end":{"exitCode":-1,"status":"signal: terminated"}}}"#,
                ));
                let _ = feed.send(env_bytes(2, "{}"));
                return Reply::json(200, "{}");
            }
            Reply::channel(rx.lock().unwrap().take().unwrap())
        })
        .await;
        tx.send(env_bytes(0, r#"{"event":{"start":{"pid":77}}}"#))
            .unwrap();
        let envd = EnvdClient::new(server.base(), "s", None, None);
        let spec = ExecSpec {
            cmd: "sleep 100".into(),
            envs: HashMap::new(),
            cwd: None,
            timeout: None,
            stdin: false,
        };
        let (itx, irx) = tokio::sync::mpsc::channel(4);
        let sender = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            itx.send(()).await.unwrap();
            itx
        });
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = run(&envd, &spec, &mut out, &mut err, irx, None)
            .await
            .unwrap();
        let _ = sender.await;
        assert_eq!(code, 143);
        let s = signals.lock().unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(
            s[0],
            serde_json::json!({"process":{"pid":77},"signal":"SIGNAL_SIGTERM"})
        );
    }
}
