//! `cubicle sandbox shell ID`: an interactive `/bin/bash -i -l` on a PTY in the sandbox,
//! through the router, the way the SDK's `pty.create` does it: `Process.Start` with
//! `pty:{size}` (output arrives as `data.pty`), keystrokes with
//! `SendInput{input:{pty}}`, window changes (SIGWINCH) with `Update`. The local terminal
//! is in raw mode meanwhile (restored on every way out); the command exits with the
//! shell's exit code. A sandbox without bash (the busybox `tiny` template) gets
//! `/bin/sh -i -l`.

use std::{collections::HashMap, io::Read, os::fd::RawFd};

use cubicle_proto::process::{
    ProcessConfig, ProcessInput, ProcessSelector, Pty, SendInputRequest, SendInputResponse,
    SendSignalRequest, SendSignalResponse, Signal, StartRequest, UpdateRequest, UpdateResponse,
    process_event::{Event, data_event::Output},
    process_input, process_selector, pty,
};
use tokio::{
    io::{AsyncWrite, AsyncWriteExt},
    sync::mpsc,
};

use super::{
    ClientError,
    connect::EnvdClient,
    exec::{BASH, exit_code, start_process},
    tty,
};

/// Size used when the local terminal does not report one.
const DEFAULT_SIZE: (u16, u16) = (80, 24);
/// Largest batch of keystrokes sent in one `SendInput`.
const MAX_INPUT_BATCH: usize = 64 << 10;

/// What to start.
pub struct ShellSpec {
    pub envs: HashMap<String, String>,
    pub cwd: Option<String>,
    /// `(cols, rows)`.
    pub size: (u16, u16),
}

/// Something the local side asks of the session besides keystrokes.
#[derive(Debug, PartialEq, Eq)]
pub enum Control {
    /// The local window changed to `(cols, rows)`.
    Resize(u16, u16),
}

/// The `Process.Start` request (same shape as the SDK's `pty.create`).
pub fn start_request(spec: &ShellSpec) -> StartRequest {
    let mut envs: HashMap<String, String> = [
        ("TERM", "xterm-256color"),
        ("LANG", "C.UTF-8"),
        ("LC_ALL", "C.UTF-8"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    envs.extend(spec.envs.clone());
    StartRequest {
        process: Some(ProcessConfig {
            cmd: BASH.into(),
            args: vec!["-i".into(), "-l".into()],
            envs,
            cwd: spec.cwd.clone(),
        }),
        pty: Some(size_msg(spec.size)),
        tag: None,
        stdin: None,
    }
}

fn size_msg((cols, rows): (u16, u16)) -> Pty {
    Pty {
        size: Some(pty::Size {
            cols: u32::from(cols.max(1)),
            rows: u32::from(rows.max(1)),
        }),
    }
}

fn selector(pid: u32) -> Option<ProcessSelector> {
    Some(ProcessSelector {
        selector: Some(process_selector::Selector::Pid(pid)),
    })
}

/// Sends keystrokes (batched while a call is in flight) and resizes, in order, on one
/// kept-open connection. Ends when both channels close or the process is gone.
async fn forward_input(
    envd: EnvdClient,
    pid: u32,
    mut input: mpsc::Receiver<Vec<u8>>,
    mut control: mpsc::Receiver<Control>,
) -> Result<(), ClientError> {
    let mut conn = envd.connection().await?;
    let (mut input_open, mut control_open) = (true, true);
    while input_open || control_open {
        tokio::select! {
            chunk = input.recv(), if input_open => {
                let Some(mut data) = chunk else { input_open = false; continue };
                while data.len() < MAX_INPUT_BATCH {
                    match input.try_recv() {
                        Ok(more) => data.extend_from_slice(&more),
                        Err(_) => break,
                    }
                }
                let req = SendInputRequest {
                    process: selector(pid),
                    input: Some(ProcessInput { input: Some(process_input::Input::Pty(data)) }),
                };
                envd.unary_on::<_, SendInputResponse>(&mut conn, "/process.Process/SendInput", &req).await?;
            }
            c = control.recv(), if control_open => {
                let Some(Control::Resize(cols, rows)) = c else { control_open = false; continue };
                let req = UpdateRequest { process: selector(pid), pty: Some(size_msg((cols, rows))) };
                envd.unary_on::<_, UpdateResponse>(&mut conn, "/process.Process/Update", &req).await?;
            }
        }
    }
    Ok(())
}

/// The session proper, with the local terminal abstracted away: keystrokes come from
/// `input`, resizes from `control`, remote output goes to `out`; a message on `stop`
/// (a termination signal number) kills the remote shell and ends the session with
/// 128+signal. Returns the shell's exit code.
pub async fn session<O: AsyncWrite + Unpin>(
    envd: &EnvdClient,
    spec: &ShellSpec,
    input: mpsc::Receiver<Vec<u8>>,
    control: mpsc::Receiver<Control>,
    out: &mut O,
    mut stop: mpsc::Receiver<i32>,
) -> anyhow::Result<i32> {
    // No Connect-Timeout-Ms: envd would kill the shell at that deadline.
    let mut stream = start_process(envd, start_request(spec), None).await?;
    let pid = loop {
        match stream.next().await? {
            Some(m) => match m.event.and_then(|e| e.event) {
                Some(Event::Start(s)) => break s.pid,
                Some(Event::Keepalive(_)) | None => continue,
                Some(other) => anyhow::bail!("expected a start event, got {other:?}"),
            },
            None => anyhow::bail!("the shell's stream ended before it started"),
        }
    };
    let mut forwarder = tokio::spawn(forward_input(envd.clone(), pid, input, control));
    let mut forwarder_done = false;
    let result = loop {
        tokio::select! {
            msg = stream.next() => {
                let Some(resp) = msg? else {
                    break Err(anyhow::anyhow!("the shell's stream ended without an end event"));
                };
                match resp.event.and_then(|e| e.event) {
                    Some(Event::Data(d)) => {
                        if let Some(Output::Pty(b) | Output::Stdout(b) | Output::Stderr(b)) = d.output {
                            out.write_all(&b).await?;
                            out.flush().await?;
                        }
                    }
                    Some(Event::End(end)) => break Ok(exit_code(&end)),
                    _ => {}
                }
            }
            r = &mut forwarder, if !forwarder_done => {
                forwarder_done = true;
                // Input failing because the shell already exited is normal: its end
                // event follows on the stream. Anything else is worth a note.
                match r {
                    Ok(Err(ClientError::Rpc { code, .. })) if code == "not_found" => {}
                    Ok(Err(e)) => tracing::debug!("sending input to the shell failed: {e}"),
                    _ => {}
                }
            }
            Some(sig) = stop.recv() => {
                let req = SendSignalRequest { process: selector(pid), signal: Signal::Sigkill as i32 };
                let _ = envd.unary::<_, SendSignalResponse>("/process.Process/SendSignal", &req).await;
                break Ok(128 + sig);
            }
        }
    };
    forwarder.abort();
    result
}

/// How often Ctrl-D is sent after a non-terminal stdin ends (until the session ends).
const EOF_REPEAT_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

/// Reads the local stdin on a plain thread (a blocked read must not hold a runtime
/// thread) into `tx`; at EOF of a non-terminal stdin sends Ctrl-D so the remote shell
/// ends too.
fn spawn_stdin_reader(fd: RawFd, tx: mpsc::Sender<Vec<u8>>, send_eof: bool) {
    let _ = std::thread::Builder::new()
        .name("cubicle-stdin".into())
        .spawn(move || {
            // SAFETY-free: `std::io::stdin()` is fd 0; `fd` is only checked to be that.
            debug_assert_eq!(fd, 0);
            let mut stdin = std::io::stdin().lock();
            let mut buf = vec![0u8; 16 << 10];
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) => {
                        if send_eof {
                            // A Ctrl-D typed while a command runs reaches the line
                            // editor as a literal character once the shell switches the
                            // terminal back (the kernel's canonical-mode EOF marker
                            // becomes a NUL in raw mode), leaving the shell waiting
                            // forever. So it is repeated until the session ends (the
                            // channel closes), however long the last command runs: the
                            // first one that finds the shell at an empty prompt ends it.
                            // A fixed number of repeats lost that race to a command (or
                            // a start) slower than the repeats. A line that is not empty
                            // (that NUL, shown as `?`, or a last line without its
                            // newline) makes a Ctrl-D only delete, so every repeat
                            // after the first clears the line first (Ctrl-U); the first
                            // is a plain Ctrl-D, which hands a shell still reading in
                            // canonical mode the unfinished last line.
                            let mut eof = vec![0x04];
                            while tx.blocking_send(eof).is_ok() {
                                std::thread::sleep(EOF_REPEAT_EVERY);
                                eof = vec![0x15, 0x04];
                            }
                        }
                        return;
                    }
                    Ok(n) => {
                        if tx.blocking_send(buf[..n].to_vec()).is_err() {
                            return;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => return,
                }
            }
        });
}

/// The whole command: local terminal setup, signals, the session.
pub async fn run(
    envd: &EnvdClient,
    envs: HashMap<String, String>,
    cwd: Option<String>,
) -> anyhow::Result<i32> {
    use tokio::signal::unix::{SignalKind, signal};
    const STDIN: RawFd = 0;
    const STDOUT: RawFd = 1;
    let stdin_tty = tty::is_tty(STDIN);
    let size = tty::window_size(STDOUT)
        .or_else(|| tty::window_size(STDIN))
        .unwrap_or(DEFAULT_SIZE);
    let mut envs = envs;
    if let Ok(term) = std::env::var("TERM")
        && !term.is_empty()
        && term != "dumb"
    {
        envs.entry("TERM".into()).or_insert(term);
    }
    let spec = ShellSpec { envs, cwd, size };

    let (stop_tx, stop_rx) = mpsc::channel(4);
    for (kind, num) in [
        (SignalKind::terminate(), libc::SIGTERM),
        (SignalKind::hangup(), libc::SIGHUP),
        (SignalKind::interrupt(), libc::SIGINT),
    ] {
        let mut s = signal(kind)?;
        let tx = stop_tx.clone();
        tokio::spawn(async move {
            while s.recv().await.is_some() {
                let _ = tx.send(num).await;
            }
        });
    }
    let (control_tx, control_rx) = mpsc::channel(8);
    let mut winch = signal(SignalKind::window_change())?;
    tokio::spawn(async move {
        while winch.recv().await.is_some() {
            if let Some((c, r)) = tty::window_size(STDOUT).or_else(|| tty::window_size(STDIN))
                && control_tx.send(Control::Resize(c, r)).await.is_err()
            {
                return;
            }
        }
    });

    // Raw mode for exactly the session's lifetime: the guard restores on return, on `?`
    // and on unwinding; the panic hook covers other threads.
    let guard = if stdin_tty {
        Some(tty::RawMode::enable(STDIN)?)
    } else {
        None
    };
    let (input_tx, input_rx) = mpsc::channel(64);
    spawn_stdin_reader(STDIN, input_tx, !stdin_tty);
    let mut stdout = tokio::io::stdout();
    let result = session(envd, &spec, input_rx, control_rx, &mut stdout, stop_rx).await;
    let _ = stdout.flush().await;
    drop(guard);
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::testserver::{FakeServer, Reply, env_bytes};
    use base64::Engine;
    use std::sync::{Arc, Mutex};

    #[test]
    fn start_request_matches_the_sdk_pty_create() {
        let spec = ShellSpec {
            envs: HashMap::from([("TERM".to_string(), "screen".to_string())]),
            cwd: None,
            size: (120, 40),
        };
        let v = serde_json::to_value(start_request(&spec)).unwrap();
        assert_eq!(v["process"]["cmd"], "/bin/bash");
        assert_eq!(v["process"]["args"], serde_json::json!(["-i", "-l"]));
        assert_eq!(v["process"]["envs"]["TERM"], "screen");
        assert_eq!(v["process"]["envs"]["LC_ALL"], "C.UTF-8");
        assert_eq!(v["pty"], serde_json::json!({"size":{"cols":120,"rows":40}}));
        assert!(v.get("stdin").is_none());
    }

    /// A fake envd PTY "shell": echoes input, answers `exit` with an end event, and
    /// records resizes.
    #[tokio::test]
    async fn session_round_trip_with_a_fake_pty() {
        let (tx, rx) = mpsc::unbounded_channel();
        let rx = Arc::new(Mutex::new(Some(rx)));
        let log = Arc::new(Mutex::new(Vec::<String>::new()));
        let (seen, feed) = (log.clone(), tx.clone());
        let server = FakeServer::start(move |req| {
            let b64 = base64::engine::general_purpose::STANDARD;
            match req.path.as_str() {
                "/process.Process/Start" => {
                    feed.send(env_bytes(0, r#"{"event":{"start":{"pid":5}}}"#)).unwrap();
                    Reply::channel(rx.lock().unwrap().take().unwrap())
                }
                "/process.Process/SendInput" => {
                    let v: serde_json::Value = serde_json::from_slice(&req.body).unwrap();
                    assert_eq!(v["process"]["pid"], 5);
                    let data = b64.decode(v["input"]["pty"].as_str().unwrap()).unwrap();
                    let text = String::from_utf8(data).unwrap();
                    seen.lock().unwrap().push(format!("in:{text}"));
                    let echo = format!(r#"{{"event":{{"data":{{"pty":"{}"}}}}}}"#, b64.encode(text.replace('\n', "\r\n")));
                    feed.send(env_bytes(0, &echo)).unwrap();
                    if text.contains("exit") {
                        feed.send(env_bytes(0, r#"{"event":{"end":{"exitCode":7,"exited":true,"status":"exit status 7"}}}"#)).unwrap();
                        feed.send(env_bytes(2, "{}")).unwrap();
                    }
                    Reply::json(200, "{}")
                }
                "/process.Process/Update" => {
                    let v: serde_json::Value = serde_json::from_slice(&req.body).unwrap();
                    seen.lock().unwrap().push(format!("resize:{}", v["pty"]["size"]));
                    Reply::json(200, "{}")
                }
                p => panic!("unexpected {p}"),
            }
        })
        .await;
        let envd = EnvdClient::new(server.base(), "s", Some("t".into()), None);
        let spec = ShellSpec {
            envs: HashMap::new(),
            cwd: None,
            size: (80, 24),
        };
        let (in_tx, in_rx) = mpsc::channel(8);
        let (ctl_tx, ctl_rx) = mpsc::channel(8);
        let (_stop_tx, stop_rx) = mpsc::channel(1);
        let driver = tokio::spawn(async move {
            ctl_tx.send(Control::Resize(100, 30)).await.unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            in_tx.send(b"echo hi\n".to_vec()).await.unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            in_tx.send(b"exit\n".to_vec()).await.unwrap();
            (in_tx, ctl_tx)
        });
        let mut out = Vec::new();
        let code = session(&envd, &spec, in_rx, ctl_rx, &mut out, stop_rx)
            .await
            .unwrap();
        let _ = driver.await;
        assert_eq!(code, 7);
        assert_eq!(String::from_utf8(out).unwrap(), "echo hi\r\nexit\r\n");
        let log = log.lock().unwrap();
        assert_eq!(
            *log,
            vec![
                r#"resize:{"cols":100,"rows":30}"#.to_string(),
                "in:echo hi\n".into(),
                "in:exit\n".into()
            ]
        );
    }

    #[tokio::test]
    async fn a_termination_signal_kills_the_remote_shell() {
        let (tx, rx) = mpsc::unbounded_channel();
        let rx = Arc::new(Mutex::new(Some(rx)));
        let killed = Arc::new(Mutex::new(None::<serde_json::Value>));
        let k = killed.clone();
        let server = FakeServer::start(move |req| match req.path.as_str() {
            "/process.Process/Start" => Reply::channel(rx.lock().unwrap().take().unwrap()),
            "/process.Process/SendSignal" => {
                *k.lock().unwrap() = serde_json::from_slice(&req.body).ok();
                Reply::json(200, "{}")
            }
            p => panic!("unexpected {p}"),
        })
        .await;
        tx.send(env_bytes(0, r#"{"event":{"start":{"pid":8}}}"#))
            .unwrap();
        let envd = EnvdClient::new(server.base(), "s", None, None);
        let spec = ShellSpec {
            envs: HashMap::new(),
            cwd: None,
            size: (80, 24),
        };
        let (_in_tx, in_rx) = mpsc::channel(1);
        let (_ctl_tx, ctl_rx) = mpsc::channel(1);
        let (stop_tx, stop_rx) = mpsc::channel(1);
        stop_tx.send(libc::SIGHUP).await.unwrap();
        let mut out = Vec::new();
        let code = session(&envd, &spec, in_rx, ctl_rx, &mut out, stop_rx)
            .await
            .unwrap();
        assert_eq!(code, 129);
        assert_eq!(
            killed.lock().unwrap().clone().unwrap(),
            serde_json::json!({"process":{"pid":8},"signal":"SIGNAL_SIGKILL"})
        );
        drop(tx);
    }
}
