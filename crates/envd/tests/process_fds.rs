//! No descriptor leaks per process: after 200 short processes (and a few killed,
//! disconnected, PTY and stdin ones) envd's descriptor count returns to its baseline.
//! Runs alone in its own test binary so nothing else opens descriptors meanwhile.

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod process_client;

use std::time::Duration;

use process_client::*;
use serde_json::json;

fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_fd_leak_after_many_processes() {
    let envd = serve().await;
    // Warm up lazily created runtime resources (signal pipe, pidfd/epoll, …).
    let (mut s, _) = start(&envd, sh("true"), &[]).await;
    s.collect().await;
    let (mut s, _) = start(
        &envd,
        json!({"process": {"cmd": "/bin/sh", "args": ["-c", "exit 0"]},
        "pty": {"size": {"cols": 80, "rows": 24}}}),
        &[],
    )
    .await;
    s.collect().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let baseline = fd_count();

    for i in 0..200 {
        let req = match i % 4 {
            0 => sh("true"),
            1 => json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo x"]}, "stdin": true}),
            2 => {
                json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo x"]}, "pty": {"size": {"cols": 80, "rows": 24}}})
            }
            _ => sh("echo $$"),
        };
        let (mut s, _) = start(&envd, req, &[]).await;
        s.collect().await;
    }
    // A few that are disconnected from, killed, or timed out.
    for _ in 0..5 {
        let (s, pid) = start(
            &envd,
            json!({"process": {"cmd": "sleep", "args": ["10"]}, "stdin": true}),
            &[],
        )
        .await;
        s.disconnect();
        unary(
            &envd,
            "SendSignal",
            json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
        )
        .await;
        let (mut s, _) = start(&envd, sh("sleep 10"), &[("connect-timeout-ms", "50")]).await;
        s.collect().await;
    }
    let ok = eventually(Duration::from_secs(5), || fd_count() <= baseline).await;
    assert!(ok, "fd count {} > baseline {baseline}", fd_count());
    assert!(
        envd.state.process.table_len() >= 200,
        "finished processes are retained for Connect"
    );
}
