//! `process.Process` end to end over raw Connect (JSON) against an in-process envd:
//! Start/Connect/List/SendInput/StreamInput/SendSignal/CloseStdin/Update, PTYs,
//! lifetimes, disconnects, and bad input.

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod process_client;

use std::time::{Duration, Instant};

use process_client::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_hi_events_in_order() {
    let envd = serve().await;
    let mut s = stream(
        &envd,
        "Start",
        sh("echo hi"),
        &[("keepalive-ping-interval", "50")],
    )
    .await;
    let (flags, first) = s.next().await.unwrap();
    assert_eq!(flags, 0);
    assert!(
        first["event"]["start"]["pid"].as_u64().unwrap() > 0,
        "{first}"
    );
    let (_, data) = s.next().await.unwrap();
    assert_eq!(data, json!({"event": {"data": {"stdout": "aGkK"}}}));
    let (_, end) = s.next().await.unwrap();
    assert_eq!(
        end,
        json!({"event": {"end": {"exited": true, "status": "exit status 0"}}})
    );
    let (flags, trailer) = s.next().await.unwrap();
    assert_eq!((flags, trailer), (2, json!({})));
    assert!(s.next().await.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_code_and_stderr() {
    let envd = serve().await;
    let (mut s, _) = start(&envd, sh("echo oops >&2; exit 3"), &[]).await;
    let c = s.collect().await;
    assert_eq!(c.stderr, b"oops\n");
    assert!(c.stdout.is_empty());
    assert_eq!(
        c.end.unwrap(),
        json!({"exitCode": 3, "exited": true, "status": "exit status 3", "error": "exit status 3"})
    );
    assert_eq!(c.trailer.unwrap(), json!({}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn env_cwd_and_user() {
    let envd = serve().await;
    let req = json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo $FOO:$(pwd):$USER:$LOGNAME:${HOME:+home}"],
        "envs": {"FOO": "bar"}, "cwd": "/tmp"}, "stdin": false});
    let (mut s, _) = start(&envd, req, &[]).await;
    let c = s.collect().await;
    let me = cubicle_envd::users::current();
    assert_eq!(
        c.stdout(),
        format!("bar:/tmp:{}:{}:home\n", me.name, me.name)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_output_is_complete_and_ordered() {
    let envd = serve().await;
    let (mut s, _) = start(&envd, sh("seq 1 200000"), &[]).await;
    let c = s.collect().await;
    let expected: String = (1..=200000).map(|i| format!("{i}\n")).collect();
    assert_eq!(c.stdout.len(), expected.len());
    assert!(c.stdout() == expected);
    assert!(c.events > 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_false_is_dev_null() {
    let envd = serve().await;
    let (mut s, _) = start(&envd, sh("cat; echo done"), &[]).await;
    let c = s.collect().await;
    assert_eq!(c.stdout(), "done\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_pipe_send_input_and_close() {
    let envd = serve().await;
    let req = json!({"process": {"cmd": "cat"}, "stdin": true});
    let (mut s, pid) = start(&envd, req, &[]).await;
    let (st, body) = unary(
        &envd,
        "SendInput",
        json!({"process": {"pid": pid}, "input": {"stdin": b64(b"hello\n")}}),
    )
    .await;
    assert_eq!((st, body), (200, json!({})));
    let ev = s.event().await;
    assert_eq!(ev["data"]["stdout"], b64(b"hello\n"));
    // Wrong kind of input.
    let (st, body) = unary(
        &envd,
        "SendInput",
        json!({"process": {"pid": pid}, "input": {"pty": b64(b"x")}}),
    )
    .await;
    assert_eq!(st, 400, "{body}");
    assert_eq!(body["code"], "invalid_argument");
    let (st, _) = unary(&envd, "CloseStdin", json!({"process": {"pid": pid}})).await;
    assert_eq!(st, 200);
    let c = s.collect().await;
    assert_eq!(c.end.unwrap()["status"], "exit status 0");
    // Finished: input is refused as not_found.
    let (st, body) = unary(
        &envd,
        "SendInput",
        json!({"process": {"pid": pid}, "input": {"stdin": b64(b"x")}}),
    )
    .await;
    assert_eq!((st, body["code"].as_str()), (404, Some("not_found")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_absent_means_pipe_and_disabled_refuses_input() {
    let envd = serve().await;
    let (mut s, pid) = start(&envd, json!({"process": {"cmd": "cat"}}), &[]).await;
    unary(
        &envd,
        "SendInput",
        json!({"process": {"pid": pid}, "input": {"stdin": b64(b"x\n")}}),
    )
    .await;
    assert_eq!(s.event().await["data"]["stdout"], b64(b"x\n"));
    unary(&envd, "CloseStdin", json!({"process": {"pid": pid}})).await;
    s.collect().await;

    let (mut s, pid) = start(&envd, sh("sleep 0.5"), &[]).await;
    let (st, body) = unary(
        &envd,
        "SendInput",
        json!({"process": {"pid": pid}, "input": {"stdin": b64(b"x")}}),
    )
    .await;
    assert_eq!(
        (st, body["code"].as_str()),
        (400, Some("failed_precondition"))
    );
    s.collect().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_kills_the_process_group() {
    let envd = serve().await;
    let t0 = Instant::now();
    let (mut s, pid) = start(
        &envd,
        sh("sleep 30 & echo $!; wait"),
        &[("connect-timeout-ms", "700")],
    )
    .await;
    let ev = s.event().await;
    let child: u32 = String::from_utf8(unb64(ev["data"]["stdout"].as_str().unwrap()))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(alive(child));
    let (flags, trailer) = s.next().await.unwrap();
    assert_eq!(flags, 2);
    assert_eq!(trailer["error"]["code"], "deadline_exceeded", "{trailer}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(eventually(Duration::from_secs(3), || !alive(pid) && !alive(child)).await);
    // The retained end says it was killed.
    let mut c = stream(&envd, "Connect", json!({"process": {"pid": pid}}), &[]).await;
    assert_eq!(c.event().await["start"]["pid"], pid);
    let end = c.collect().await.end.unwrap();
    assert_eq!(
        end,
        json!({"exitCode": -1, "status": "signal: killed", "error": "signal: killed"})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_keeps_running_and_connect_reattaches() {
    let envd = serve().await;
    let (mut s, pid) = start(
        &envd,
        sh("for i in $(seq 1 15); do echo $i; sleep 0.1; done"),
        &[],
    )
    .await;
    assert_eq!(s.event().await["data"]["stdout"], b64(b"1\n"));
    s.disconnect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(alive(pid));
    let mut c = stream(&envd, "Connect", json!({"process": {"pid": pid}}), &[]).await;
    assert_eq!(c.event().await, json!({"start": {"pid": pid}}));
    let got = c.collect().await;
    let out = got.stdout();
    assert!(out.ends_with("14\n15\n"), "{out}");
    assert!(!out.starts_with("1\n"), "no replay expected: {out}");
    assert_eq!(got.end.unwrap()["status"], "exit status 0");
    // Exited: start + retained end.
    let mut c = stream(&envd, "Connect", json!({"process": {"pid": pid}}), &[]).await;
    assert_eq!(c.event().await, json!({"start": {"pid": pid}}));
    assert_eq!(
        c.event().await,
        json!({"end": {"exited": true, "status": "exit status 0"}})
    );
    assert_eq!(c.next().await.unwrap(), (2, json!({})));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detached_process_output_is_drained() {
    let envd = serve().await;
    // 8 MB of output with nobody attached must not block the process.
    let (s, pid) = start(&envd, sh("head -c 8000000 /dev/zero; echo done"), &[]).await;
    s.disconnect();
    assert!(eventually(Duration::from_secs(10), || !alive(pid)).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut c = stream(&envd, "Connect", json!({"process": {"pid": pid}}), &[]).await;
    c.event().await;
    assert_eq!(c.collect().await.end.unwrap()["status"], "exit status 0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_unknown_pid_is_not_found() {
    let envd = serve().await;
    let mut c = stream(&envd, "Connect", json!({"process": {"pid": 999999}}), &[]).await;
    let (flags, v) = c.next().await.unwrap();
    assert_eq!(flags, 2);
    assert_eq!(v["error"]["code"], "not_found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_and_send_signal() {
    let envd = serve().await;
    let req = json!({"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 30"], "envs": {"A": "b"}, "cwd": "/tmp"},
        "tag": "t1", "stdin": false});
    let (mut s, pid) = start(&envd, req, &[]).await;
    let (st, list) = unary(&envd, "List", json!({})).await;
    assert_eq!(st, 200);
    let me = list["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == pid)
        .cloned()
        .unwrap();
    assert_eq!(
        me,
        json!({"pid": pid, "tag": "t1", "config": {"cmd": "/bin/sh", "args": ["-c", "sleep 30"], "envs": {"A": "b"}, "cwd": "/tmp"}})
    );
    let (st, body) = unary(
        &envd,
        "SendSignal",
        json!({"process": {"pid": pid}, "signal": "SIGNAL_UNSPECIFIED"}),
    )
    .await;
    assert_eq!((st, body["code"].as_str()), (501, Some("unimplemented")));
    let (st, _) = unary(
        &envd,
        "SendSignal",
        json!({"process": {"tag": "t1"}, "signal": "SIGNAL_SIGTERM"}),
    )
    .await;
    assert_eq!(st, 200);
    let c = s.collect().await;
    assert_eq!(
        c.end.unwrap(),
        json!({"exitCode": -1, "status": "signal: terminated", "error": "signal: terminated"})
    );
    let (_, list) = unary(&envd, "List", json!({})).await;
    // An empty list is `{}` (proto3 JSON omits empty repeated fields).
    let listed = list["processes"]
        .as_array()
        .is_some_and(|a| a.iter().any(|p| p["pid"] == pid));
    assert!(!listed);
    let (st, body) = unary(
        &envd,
        "SendSignal",
        json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
    )
    .await;
    assert_eq!((st, body["code"].as_str()), (404, Some("not_found")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_kills_bash_children() {
    let envd = serve().await;
    let (mut s, pid) = start(&envd, sh("sleep 30 & echo $!; sleep 30"), &[]).await;
    let child: u32 = String::from_utf8(unb64(s.event().await["data"]["stdout"].as_str().unwrap()))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let (st, _) = unary(
        &envd,
        "SendSignal",
        json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
    )
    .await;
    assert_eq!(st, 200);
    let c = s.collect().await;
    assert_eq!(c.end.unwrap()["status"], "signal: killed");
    assert!(eventually(Duration::from_secs(3), || !alive(child)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_grandchild_does_not_hold_the_end() {
    let envd = serve().await;
    let t0 = Instant::now();
    let (mut s, _) = start(&envd, sh("sleep 5 & echo $!"), &[]).await;
    let c = s.collect().await;
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "end took {:?}",
        t0.elapsed()
    );
    assert_eq!(c.end.as_ref().unwrap()["status"], "exit status 0");
    let child: u32 = c.stdout().trim().parse().unwrap();
    // SAFETY: kill(2) has no memory arguments.
    unsafe { libc::kill(child as i32, libc::SIGKILL) };
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalives_when_silent() {
    let envd = serve().await;
    let (mut s, _) = start(&envd, sh("sleep 2.3"), &[("keepalive-ping-interval", "1")]).await;
    let c = s.collect().await;
    assert!(c.keepalives >= 1 && c.keepalives <= 3, "{}", c.keepalives);
    assert!(c.end.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pty_input_and_resize() {
    let envd = serve().await;
    let home = std::env::temp_dir().join(format!("cb-envd-pty-{}", std::process::id()));
    std::fs::create_dir_all(&home).unwrap();
    let req = json!({"process": {"cmd": "/bin/bash", "args": ["--norc", "--noprofile", "-i"],
        "envs": {"TERM": "xterm-256color", "HOME": home.to_str().unwrap(), "PS1": "$ "}},
        "pty": {"size": {"cols": 80, "rows": 24}}});
    let (mut s, pid) = start(&envd, req, &[]).await;
    // A PTY takes pty bytes, not stdin.
    let (st, _) = unary(
        &envd,
        "SendInput",
        json!({"process": {"pid": pid}, "input": {"stdin": b64(b"x")}}),
    )
    .await;
    assert_eq!(st, 400);
    let (st, _) = unary(
        &envd,
        "SendInput",
        json!({"process": {"pid": pid}, "input": {"pty": b64(b"echo $((6*7))\n")}}),
    )
    .await;
    assert_eq!(st, 200);
    let mut out = Vec::new();
    while !String::from_utf8_lossy(&out).contains("42") {
        let ev = s.event().await;
        if let Some(p) = ev["data"]["pty"].as_str() {
            out.extend_from_slice(&unb64(p));
        }
    }
    let (st, _) = unary(
        &envd,
        "Update",
        json!({"process": {"pid": pid}, "pty": {"size": {"cols": 100, "rows": 50}}}),
    )
    .await;
    assert_eq!(st, 200);
    unary(
        &envd,
        "SendInput",
        json!({"process": {"pid": pid}, "input": {"pty": b64(b"stty size\n")}}),
    )
    .await;
    let mut out = Vec::new();
    while !String::from_utf8_lossy(&out).contains("50 100") {
        let ev = s.event().await;
        if let Some(p) = ev["data"]["pty"].as_str() {
            out.extend_from_slice(&unb64(p));
        }
    }
    let (_, list) = unary(&envd, "List", json!({})).await;
    assert!(
        list["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["pid"] == pid)
    );
    unary(
        &envd,
        "SendInput",
        json!({"process": {"pid": pid}, "input": {"pty": b64(b"exit 5\n")}}),
    )
    .await;
    let c = s.collect().await;
    assert_eq!(c.end.unwrap()["exitCode"], 5);
    let _ = std::fs::remove_dir_all(&home);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_on_pipe_process_is_an_error() {
    let envd = serve().await;
    let (mut s, pid) = start(&envd, sh("sleep 0.5"), &[]).await;
    let (st, body) = unary(
        &envd,
        "Update",
        json!({"process": {"pid": pid}, "pty": {"size": {"cols": 1, "rows": 1}}}),
    )
    .await;
    assert_eq!(
        (st, body["code"].as_str()),
        (400, Some("failed_precondition"))
    );
    s.collect().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_input_is_ordered() {
    let envd = serve().await;
    let (mut s, pid) = start(
        &envd,
        json!({"process": {"cmd": "cat"}, "stdin": true}),
        &[],
    )
    .await;
    let (tx, resp) = client_stream(&envd, "StreamInput").await;
    tx.send(json!({"start": {"process": {"pid": pid}}}))
        .await
        .unwrap();
    for part in ["a", "b", "c", "\n"] {
        tx.send(json!({"data": {"input": {"stdin": b64(part.as_bytes())}}}))
            .await
            .unwrap();
    }
    tx.send(json!({"keepalive": {}})).await.unwrap();
    drop(tx);
    let mut resp = resp.await.unwrap();
    assert_eq!(resp.next().await.unwrap(), (0, json!({})));
    assert_eq!(resp.next().await.unwrap(), (2, json!({})));
    unary(&envd, "CloseStdin", json!({"process": {"pid": pid}})).await;
    assert_eq!(s.collect().await.stdout(), "abc\n");

    // Unknown pid.
    let (tx, resp) = client_stream(&envd, "StreamInput").await;
    tx.send(json!({"start": {"process": {"pid": 999999}}}))
        .await
        .unwrap();
    drop(tx);
    let (flags, v) = resp.await.unwrap().next().await.unwrap();
    assert_eq!((flags, v["error"]["code"].as_str()), (2, Some("not_found")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_cleanly() {
    let envd = serve().await;
    for payload in [
        &b"{not json"[..],
        br#"{}"#,
        br#"{"process":{"cmd":""}}"#,
        br#"{"process":{"cmd":5}}"#,
    ] {
        let mut s = stream_raw(&envd, "Start", payload, &[]).await;
        let (flags, v) = s.next().await.unwrap();
        assert_eq!(flags, 2);
        assert_eq!(v["error"]["code"], "invalid_argument", "{v}");
    }
    let mut s = stream(
        &envd,
        "Start",
        json!({"process": {"cmd": "true", "cwd": "/nonexistent-cb"}}),
        &[],
    )
    .await;
    let (_, v) = s.next().await.unwrap();
    assert_eq!(v["error"]["code"], "invalid_argument");
    assert_eq!(
        v["error"]["message"],
        "cwd '/nonexistent-cb' does not exist"
    );
    let mut s = stream(
        &envd,
        "Start",
        json!({"process": {"cmd": "/nonexistent-cb-binary"}}),
        &[],
    )
    .await;
    let (_, v) = s.next().await.unwrap();
    assert_eq!(v["error"]["code"], "invalid_argument");
    let mut s = stream(
        &envd,
        "Start",
        json!({"process": {"cmd": "true", "envs": {"A=B": "c"}}}),
        &[],
    )
    .await;
    assert_eq!(
        s.next().await.unwrap().1["error"]["code"],
        "invalid_argument"
    );
    let mut s = stream(
        &envd,
        "Start",
        sh("true"),
        &[("authorization", "Basic bm9zdWNodXNlcjo=")],
    )
    .await;
    assert_eq!(
        s.next().await.unwrap().1["error"]["code"],
        "unauthenticated"
    );

    let (st, v) = unary_raw(&envd, "List", b"{oops", &[]).await;
    assert_eq!((st, v["code"].as_str()), (400, Some("invalid_argument")));
    let (st, v) = unary(
        &envd,
        "SendInput",
        json!({"process": {"pid": 999999}, "input": {"stdin": "eA=="}}),
    )
    .await;
    assert_eq!((st, v["code"].as_str()), (404, Some("not_found")));
    let (st, v) = unary(&envd, "SendInput", json!({"input": {"stdin": "eA=="}})).await;
    assert_eq!((st, v["code"].as_str()), (400, Some("invalid_argument")));
    let (st, v) = unary(&envd, "CloseStdin", json!({"process": {"pid": 999999}})).await;
    assert_eq!((st, v["code"].as_str()), (404, Some("not_found")));
    let (st, v) = unary(&envd, "Update", json!({"process": {"pid": 999999}})).await;
    assert_eq!((st, v["code"].as_str()), (404, Some("not_found")));
    let (st, v) = unary(
        &envd,
        "SendSignal",
        json!({"process": {"pid": 1}, "signal": "SIGNAL_BOGUS"}),
    )
    .await;
    assert_eq!((st, v["code"].as_str()), (400, Some("invalid_argument")));
    // The service still works.
    let (mut s, _) = start(&envd, sh("echo ok"), &[]).await;
    assert_eq!(s.collect().await.stdout(), "ok\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_stdin_input() {
    let envd = serve().await;
    let (mut s, pid) = start(
        &envd,
        json!({"process": {"cmd": "/bin/sh", "args": ["-c", "wc -c"]}, "stdin": true}),
        &[],
    )
    .await;
    let data = vec![b'x'; 4 << 20];
    let (st, _) = unary(
        &envd,
        "SendInput",
        json!({"process": {"pid": pid}, "input": {"stdin": b64(&data)}}),
    )
    .await;
    assert_eq!(st, 200);
    unary(&envd, "CloseStdin", json!({"process": {"pid": pid}})).await;
    assert_eq!(s.collect().await.stdout().trim(), (4 << 20).to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_get_default_signal_dispositions() {
    // As when envd runs as a background job of a script: SIGINT/SIGQUIT ignored.
    // SAFETY: SIG_IGN dispositions; no handler runs.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGQUIT, libc::SIG_IGN);
    }
    let envd = serve().await;
    let (mut s, _) = start(
        &envd,
        json!({"process": {"cmd": "cat", "args": ["/proc/self/status"]}, "stdin": false}),
        &[],
    )
    .await;
    let out = s.collect().await.stdout();
    let ign = out.lines().find(|l| l.starts_with("SigIgn:")).unwrap();
    assert_eq!(
        ign.split_whitespace().nth(1),
        Some("0000000000000000"),
        "{ign}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_json_content_types_are_415() {
    let envd = serve().await;
    let (st, _) = unary_raw(
        &envd,
        "List",
        b"{}",
        &[("content-type", "application/proto")],
    )
    .await;
    assert_eq!(st, 415);
    let (st, v) = unary_raw(
        &envd,
        "List",
        b"{}",
        &[("content-type", "application/json; charset=utf-8")],
    )
    .await;
    assert_eq!(st, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_inherit_only_stdio() {
    let envd = serve().await;
    for req in [
        json!({"process": {"cmd": "ls", "args": ["/proc/self/fd"]}, "stdin": true}),
        json!({"process": {"cmd": "ls", "args": ["/proc/self/fd"]}, "pty": {"size": {"cols": 80, "rows": 24}}}),
    ] {
        let (mut s, _) = start(&envd, req, &[]).await;
        let c = s.collect().await;
        let out =
            String::from_utf8_lossy(if c.pty.is_empty() { &c.stdout } else { &c.pty }).into_owned();
        // 0, 1, 2 and the directory ls itself opened.
        let fds: Vec<&str> = out.split_whitespace().collect();
        assert_eq!(fds, ["0", "1", "2", "3"], "{out:?}");
    }
}

/// Round-trip timing of Start→end (`cargo test --release --test process -- --ignored
/// --nocapture start_round_trip`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn start_round_trip() {
    let envd = serve().await;
    for (name, req) in [
        (
            "/bin/true",
            json!({"process": {"cmd": "/bin/true"}, "stdin": false}),
        ),
        (
            "bash -l -c true",
            json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "true"],
            "envs": {"HOME": "/nonexistent-cb"}}, "stdin": false}),
        ),
    ] {
        let mut times = Vec::new();
        for _ in 0..300 {
            let t = Instant::now();
            let (mut s, _) = start(&envd, req.clone(), &[]).await;
            s.collect().await;
            times.push(t.elapsed());
        }
        times.sort();
        println!("{name}: p50 {:?} p99 {:?}", times[150], times[296]);
    }
}
