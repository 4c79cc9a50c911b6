//! Template readiness probe: after a template's start command is launched, a sandbox of
//! a template with `ready_port` counts as ready only once `GET /health` on
//! `127.0.0.1:<port>` inside the sandbox's network namespace answers 200.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// One probe: `true` if `GET /health` answered with a 2xx status.
fn probe(pid: i32, port: u16) -> bool {
    let Ok(netns) = cubicle_runtime::network::Netns::from_pid(pid) else {
        return false;
    };
    let Ok(mut s) = cubicle_runtime::network::connect_in_netns(&netns, port) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut buf = [0u8; 32];
    let mut n = 0;
    while n < 12 {
        match s.read(&mut buf[n..]) {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
    status_is_2xx(&buf[..n])
}

fn status_is_2xx(head: &[u8]) -> bool {
    head.starts_with(b"HTTP/1.") && head.len() >= 10 && head[9] == b'2'
}

/// Wait (blocking) until the probe succeeds, `give_up` names a reason to stop (the
/// sandbox died, the start command ended) or `timeout` passes.
pub fn wait_http_health(
    pid: i32,
    port: u16,
    timeout: Duration,
    give_up: impl Fn() -> Option<String>,
) -> Result<()> {
    let t0 = Instant::now();
    loop {
        if probe(pid, port) {
            return Ok(());
        }
        if let Some(why) = give_up() {
            return Err(Error::Runtime(format!(
                "{why} before port {port} answered /health"
            )));
        }
        if t0.elapsed() > timeout {
            return Err(Error::Runtime(format!(
                "port {port} did not answer /health within {timeout:?} (template start command)"
            )));
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Run `cmd` (`/bin/sh -c`, as the sandbox's default user) until it exits 0, `give_up`
/// names a reason to stop, or `timeout` passes (E2B's `readyCmd`).
pub async fn wait_ready_command(
    envd: &crate::envd_client::EnvdClient,
    cmd: &str,
    timeout: Duration,
    give_up: impl Fn() -> Option<String>,
) -> Result<()> {
    let t0 = Instant::now();
    let spec = crate::envd_client::ProcessSpec {
        cmd: "/bin/sh".into(),
        args: vec!["-c".into(), cmd.to_string()],
        ..Default::default()
    };
    loop {
        let last = match envd.run(&spec, |_| {}).await {
            Ok(end) if end.exit_code == 0 && end.exited => return Ok(()),
            Ok(end) => format!("exit code {}", end.exit_code),
            Err(e) => e.to_string(),
        };
        if let Some(why) = give_up() {
            return Err(Error::Runtime(format!(
                "{why} before the ready command `{cmd}` succeeded"
            )));
        }
        if t0.elapsed() > timeout {
            return Err(Error::Runtime(format!(
                "the ready command `{cmd}` did not succeed within {timeout:?} (last: {last})"
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_line() {
        assert!(status_is_2xx(b"HTTP/1.1 200 OK\r\n"));
        assert!(!status_is_2xx(b"HTTP/1.1 503 Service"));
        assert!(!status_is_2xx(b"garbage"));
    }
}
