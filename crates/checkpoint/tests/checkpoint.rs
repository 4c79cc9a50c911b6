//! End-to-end tests of cubicle-checkpoint on the real kernel, as root, with CRIU.
//!
//! `harness = false`: `restore()` and `spawn()` re-execute this binary as helpers, so
//! `main()` calls `maybe_run_helper()` first. Pass substrings to run only matching tests.
//! Skipped (with a message) without root or without CRIU (`scripts/install-criu.sh`).
//!
//! The sandboxes run busybox scripts on a busybox-static template; each test checks what a
//! user would: processes and their memory carry on, files and tmpfs contents are back,
//! a copy on another uid range runs as that range, a volume (idmapped bind) is mounted
//! again with its open files, nothing is left behind.

// Tests: a failed unwrap or expect is a failed test (harness = false: no #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use cubicle_checkpoint::{Criu, DumpRequest, RestoreRequest, dump, restore};
use cubicle_runtime::network::{Netns, loopback_up};
use cubicle_runtime::{Cgroup, Sandbox, SandboxSpec, spawn};

struct Env {
    root: PathBuf,
    template: PathBuf,
    uid_base: u32,
    counter: AtomicU32,
    criu: Criu,
}

impl Env {
    fn spec(&self, script: &str) -> SandboxSpec {
        let n = self.counter.fetch_add(1, Ordering::SeqCst);
        self.spec_named(&format!("ckt{}x{n}", std::process::id()), n, script)
    }

    fn spec_named(&self, id: &str, n: u32, script: &str) -> SandboxSpec {
        let mut spec = SandboxSpec::new(
            id.to_string(),
            &self.template,
            self.root.join("sandboxes").join(id),
            self.uid_base + n * 65536,
            vec![
                "/bin/busybox".into(),
                "sh".into(),
                "-c".into(),
                script.into(),
            ],
        );
        spec.limits.memory_bytes = 128 << 20;
        spec
    }
}

fn build_rootfs(t: &Path) {
    for d in ["bin", "etc", "root", "tmp", "proc", "sys", "dev", "run"] {
        fs::create_dir_all(t.join(d)).unwrap();
    }
    fs::set_permissions(t.join("tmp"), fs::Permissions::from_mode(0o1777)).unwrap();
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("busybox-static is not installed");
    fs::copy(busybox, t.join("bin/busybox")).unwrap();
    for applet in ["sh", "cat", "sleep", "echo", "ls", "mv"] {
        symlink("busybox", t.join("bin").join(applet)).unwrap();
    }
    fs::write(t.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    compile_static(t, VFORK_HOLD, "bin/vfork-hold");
}

/// `vfork-hold MS`: vfork()s a child that sleeps MS milliseconds before it exits, the
/// parent waiting inside vfork() meanwhile, as a shell or `posix_spawn` does for the
/// instant between its vfork and the child's exec.
const VFORK_HOLD: &str = r#"
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int ms = argc > 1 ? atoi(argv[1]) : 0;
    pid_t p = vfork();
    if (p == 0) {
        usleep(ms * 1000);
        _exit(0);
    }
    waitpid(p, 0, 0);
    return 0;
}
"#;

/// Compiles C `source` into `rel` under rootfs `t`, statically linked.
fn compile_static(t: &Path, source: &str, rel: &str) {
    let src = t.join(format!("{rel}.c"));
    fs::write(&src, source).unwrap();
    let ok = Command::new("cc")
        .args(["-static", "-O1", "-o"])
        .arg(t.join(rel))
        .arg(&src)
        .status()
        .is_ok_and(|s| s.success());
    fs::remove_file(&src).unwrap();
    assert!(
        ok,
        "cc -static {rel} failed (gcc and libc6-dev: scripts/install-deps.sh)"
    );
}

/// Waits until `path` (a host path) exists and holds something, up to 10 s.
fn wait_for(path: &Path) -> String {
    let t = Instant::now();
    loop {
        if let Ok(s) = fs::read_to_string(path)
            && !s.is_empty()
        {
            return s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn lo_up(pid: i32) -> cubicle_checkpoint::Result<()> {
    let ns = Netns::from_pid(pid).map_err(cubicle_checkpoint::Error::from)?;
    loopback_up(&ns).map_err(cubicle_checkpoint::Error::from)
}

/// The counter script: a shell variable counts in memory (only a restored process has
/// it), the count goes to `/tmp/count` (overlay) and `/run/count` (tmpfs) every 50 ms,
/// each written aside and renamed (a pause between `>`'s truncation and the write would
/// leave the file empty).
const COUNTER: &str = "i=0; echo tmpfs-data > /run/kept; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; echo $i > /run/count.new; mv /run/count.new /run/count; sleep 0.05; done";

/// The count in `file` of the sandbox (retrying: the script rewrites it every 50 ms).
fn read_count(sb_pid: i32, file: &str) -> u64 {
    for _ in 0..50 {
        if let Ok(n) = fs::read_to_string(format!("/proc/{sb_pid}/root{file}"))
            .unwrap_or_default()
            .trim()
            .parse()
        {
            return n;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    0
}

fn pause_and_resume_keeps_memory_and_files(env: &Env) {
    let spec = env.spec(COUNTER);
    let sb = spawn(&spec).unwrap();
    let upper_count = spec.upper_dir().join("tmp/count");
    wait_for(&upper_count);
    std::thread::sleep(Duration::from_millis(300));
    let before = read_count(sb.pid(), "/tmp/count");
    assert!(before > 0);
    let dir = spec.sandbox_dir.join("checkpoint");
    let report = dump(
        &env.criu,
        DumpRequest {
            spec: &spec,
            init_pid: sb.pid(),
            dir: &dir,
            leave_running: false,
            while_frozen: None,
        },
    )
    .unwrap_or_else(|e| panic!("dump: {e}"));
    println!(
        "  pause: frozen {:?}, total {:?}, {} bytes",
        report.frozen, report.total, report.bytes
    );
    assert!(!sb.wait_timeout(Duration::from_secs(0)) || !sb.is_alive());
    assert!(
        sb.wait_timeout(Duration::from_secs(5)),
        "the paused sandbox still runs"
    );
    let paused_count: u64 = fs::read_to_string(&upper_count)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let cg = Cgroup::handle(&spec.id).unwrap();
    assert!(
        cg.procs().unwrap().is_empty(),
        "processes left after a pause"
    );
    std::thread::sleep(Duration::from_millis(300));
    // Nothing ran while paused.
    assert_eq!(
        fs::read_to_string(&upper_count)
            .unwrap()
            .trim()
            .parse::<u64>()
            .unwrap(),
        paused_count
    );

    let mut net = lo_up;
    let r = restore(
        &env.criu,
        RestoreRequest {
            spec: &spec,
            dir: &dir,
            stdio: None,
            on_namespaces: &mut net,
        },
    )
    .unwrap_or_else(|e| panic!("restore: {e}"));
    println!("  resume: {:?}", r.timings);
    let sb2 = Sandbox::adopt(&spec.id, &spec.sandbox_dir).unwrap();
    assert_eq!(sb2.pid(), r.pid);
    std::thread::sleep(Duration::from_millis(400));
    let after = read_count(r.pid, "/tmp/count");
    // The in-memory counter continued from where it was: no restart from 1.
    assert!(
        after > paused_count && after < paused_count + 100,
        "count after resume {after}, at pause {paused_count}"
    );
    assert!(read_count(r.pid, "/run/count") > paused_count);
    assert_eq!(
        fs::read_to_string(format!("/proc/{}/root/run/kept", r.pid)).unwrap(),
        "tmpfs-data\n"
    );
    // Masks keep their flags (CRIU alone would bring them back writable).
    let mi = fs::read_to_string(format!("/proc/{}/mountinfo", r.pid)).unwrap();
    for mp in ["/proc/kmsg", "/proc/acpi", "/sys/fs/cgroup"] {
        let line = mi
            .lines()
            .find(|l| l.split(' ').nth(4) == Some(mp))
            .unwrap_or_else(|| panic!("{mp} not mounted after restore:\n{mi}"));
        let opts = line.split(' ').nth(5).unwrap();
        assert!(
            opts.split(',').any(|o| o == "ro"),
            "{mp} is not read-only: {line}"
        );
    }
    sb2.destroy().unwrap();
}

/// A process caught inside vfork() by the freeze (its child neither exec'd nor exited)
/// would hang CRIU until its timeout (CRIU stops the child before its exec, then waits
/// for the parent, which cannot stop until then) and fail the pause after 10 s. A vfork
/// that ends soon is waited out; one held on fails the dump at once, clearly, and the
/// sandbox runs on.
fn a_process_inside_vfork(env: &Env) {
    // A sandbox whose shell runs `vfork-hold ms` beside the counter, and its dump
    // (leaving it running), timed.
    let dump_with_vfork = |ms: u32| {
        let spec = env.spec(&format!("/bin/vfork-hold {ms} & {COUNTER}"));
        let sb = spawn(&spec).unwrap();
        wait_for(&spec.upper_dir().join("tmp/count"));
        let dir = spec.sandbox_dir.join("checkpoint");
        let t = Instant::now();
        let r = dump(
            &env.criu,
            DumpRequest {
                spec: &spec,
                init_pid: sb.pid(),
                dir: &dir,
                leave_running: true,
                while_frozen: None,
            },
        );
        (sb, dir, r, t.elapsed())
    };
    // Held 300 ms: the dump waits it out.
    let (sb, _, r, took) = dump_with_vfork(300);
    let report = r.unwrap_or_else(|e| panic!("dump with a vfork of 300 ms: {e}"));
    println!(
        "  vfork of 300 ms: dumped in {took:?} ({:?})",
        report.phases
    );
    sb.destroy().unwrap();

    // Held for good: the dump fails within a second or so, saying why.
    let (sb, dir, r, took) = dump_with_vfork(600_000);
    let err = r.expect_err("a dump with a process held inside vfork() succeeded");
    println!("  vfork held: failed in {took:?}: {err}");
    assert!(err.to_string().contains("vfork"), "unclear error: {err}");
    assert!(
        took < Duration::from_secs(3),
        "the failed dump took {took:?}"
    );
    assert!(!dir.exists(), "a failed dump left {}", dir.display());
    // It runs on, thawed.
    let before = read_count(sb.pid(), "/tmp/count");
    std::thread::sleep(Duration::from_millis(300));
    let after = read_count(sb.pid(), "/tmp/count");
    assert!(
        after > before,
        "the sandbox does not run on: {before} then {after}"
    );
    sb.destroy().unwrap();
}

fn fork_to_another_uid_range(env: &Env) {
    let spec = env.spec(COUNTER);
    let sb = spawn(&spec).unwrap();
    wait_for(&spec.upper_dir().join("tmp/count"));
    let dir = env.root.join("fork-src");
    dump(
        &env.criu,
        DumpRequest {
            spec: &spec,
            init_pid: sb.pid(),
            dir: &dir,
            leave_running: true,
            while_frozen: None,
        },
    )
    .unwrap_or_else(|e| panic!("dump: {e}"));
    assert!(sb.is_alive(), "a snapshot must leave the sandbox running");
    let mut child = env.spec(COUNTER);
    // The fork's disk: a copy of the source's writable layer.
    fs::create_dir_all(&child.sandbox_dir).unwrap();
    let st = Command::new("cp")
        .args(["-a", "--reflink=auto"])
        .arg(spec.upper_dir())
        .arg(child.upper_dir())
        .status()
        .unwrap();
    assert!(st.success());
    for d in ["work", "ctl", "rootfs"] {
        fs::create_dir_all(child.sandbox_dir.join(d)).unwrap();
    }
    std::os::unix::fs::chown(child.ctl_dir(), Some(child.uid_base), Some(child.uid_base)).unwrap();
    std::os::unix::fs::chown(child.work_dir(), Some(spec.uid_base), Some(spec.uid_base)).unwrap();
    let fork_dir = child.sandbox_dir.join("checkpoint");
    let st = Command::new("cp")
        .arg("-a")
        .arg(&dir)
        .arg(&fork_dir)
        .status()
        .unwrap();
    assert!(st.success());
    child.limits.memory_bytes = 96 << 20;
    let mut net = lo_up;
    let r = restore(
        &env.criu,
        RestoreRequest {
            spec: &child,
            dir: &fork_dir,
            stdio: None,
            on_namespaces: &mut net,
        },
    )
    .unwrap_or_else(|e| panic!("restore of the fork: {e}"));
    let status = fs::read_to_string(format!("/proc/{}/status", r.pid)).unwrap();
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert!(
        uid_line.contains(&child.uid_base.to_string()),
        "fork runs as {uid_line}, expected {}",
        child.uid_base
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(read_count(r.pid, "/tmp/count") > 0);
    let owner = fs::metadata(child.upper_dir().join("tmp/count"))
        .unwrap()
        .uid();
    assert_eq!(owner, child.uid_base, "the fork's files are on its range");
    let sb_child = Sandbox::adopt(&child.id, &child.sandbox_dir).unwrap();
    // Both run independently.
    assert!(sb.is_alive() && sb_child.is_alive());
    sb_child.destroy().unwrap();
    sb.destroy().unwrap();
}

/// A volume (a host directory bind-mounted idmapped, as the node mounts volumes) across a
/// pause: the script holds a file of the volume open for appending and counts into it.
/// While paused the host adds a file to the volume; after the resume the same process
/// goes on appending through its restored descriptor, sees the new file, and what the
/// sandbox's root creates then is stored as uid 0 in the volume (the mount is idmapped
/// again; unmapped, the sandbox's root could not even write the root-owned directory).
fn volume_across_pause(env: &Env) {
    let vol = env.root.join("volume");
    fs::create_dir_all(&vol).unwrap();
    fs::set_permissions(&vol, fs::Permissions::from_mode(0o755)).unwrap();
    let script = "exec 3>>/mnt/vol/log; i=0; while true; do i=$((i+1)); echo $i >&3; \
                  echo $i > /tmp/count; [ -e /mnt/vol/go ] && echo $i > /mnt/vol/made-after; \
                  sleep 0.05; done";
    let mut spec = env.spec(script);
    spec.binds.push(cubicle_runtime::BindMount {
        source: vol.clone(),
        target: "/mnt/vol".into(),
        readonly: false,
        idmapped: true,
    });
    let sb = spawn(&spec).unwrap();
    let log = vol.join("log");
    wait_for(&log);
    assert_eq!(fs::metadata(&log).unwrap().uid(), 0, "idmapped at spawn");
    let dir = spec.sandbox_dir.join("checkpoint");
    dump(
        &env.criu,
        DumpRequest {
            spec: &spec,
            init_pid: sb.pid(),
            dir: &dir,
            leave_running: false,
            while_frozen: None,
        },
    )
    .unwrap_or_else(|e| panic!("dump: {e}"));
    assert!(
        sb.wait_timeout(Duration::from_secs(5)),
        "the paused sandbox still runs"
    );
    let at_pause = fs::read_to_string(&log).unwrap().lines().count();
    // Not in the checkpoint: the resume sees the volume as it is then.
    fs::write(vol.join("go"), "").unwrap();
    let mut net = lo_up;
    let r = restore(
        &env.criu,
        RestoreRequest {
            spec: &spec,
            dir: &dir,
            stdio: None,
            on_namespaces: &mut net,
        },
    )
    .unwrap_or_else(|e| panic!("restore: {e}"));
    let sb2 = Sandbox::adopt(&spec.id, &spec.sandbox_dir).unwrap();
    let made = wait_for(&vol.join("made-after"));
    assert_eq!(
        fs::metadata(vol.join("made-after")).unwrap().uid(),
        0,
        "the volume is idmapped again after the restore"
    );
    let text = fs::read_to_string(&log).unwrap();
    let counts: Vec<u64> = text.lines().map(|l| l.parse().unwrap()).collect();
    // One process counting on through one descriptor: 1, 2, 3, … without a restart.
    assert!(counts.len() > at_pause, "nothing appended after the resume");
    assert!(
        counts.iter().enumerate().all(|(i, n)| *n == i as u64 + 1),
        "the log is not one continued count: {text}"
    );
    assert!(made.trim().parse::<usize>().unwrap() > at_pause);
    let mi = fs::read_to_string(format!("/proc/{}/mountinfo", r.pid)).unwrap();
    let line = mi
        .lines()
        .find(|l| l.split(' ').nth(4) == Some("/mnt/vol"))
        .unwrap_or_else(|| panic!("/mnt/vol not mounted after restore:\n{mi}"));
    assert!(line.contains("idmapped"), "{line}");
    sb2.destroy().unwrap();
}

type Test = (&'static str, fn(&Env));
const TESTS: &[Test] = &[
    (
        "pause_and_resume_keeps_memory_and_files",
        pause_and_resume_keeps_memory_and_files,
    ),
    ("fork_to_another_uid_range", fork_to_another_uid_range),
    ("volume_across_pause", volume_across_pause),
    ("a_process_inside_vfork", a_process_inside_vfork),
];

fn main() {
    cubicle_checkpoint::maybe_run_helper();
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    if std::env::args().any(|a| a == "--list") {
        for (name, _) in TESTS {
            println!("{name}: test");
        }
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipping cubicle-checkpoint tests: they need root");
        return;
    }
    let pid = std::process::id();
    let root = PathBuf::from(format!("/tmp/cubicle-ckpt-test-{pid}"));
    let _ = fs::remove_dir_all(&root);
    fs::create_dir_all(root.join("sandboxes")).unwrap();
    fs::set_permissions(&root, fs::Permissions::from_mode(0o755)).unwrap();
    fs::set_permissions(root.join("sandboxes"), fs::Permissions::from_mode(0o711)).unwrap();
    let criu = match Criu::open(&root.join("state")) {
        Ok(c) => c,
        Err(e) => {
            println!("skipping cubicle-checkpoint tests: {e}");
            return;
        }
    };
    let template = root.join("template");
    build_rootfs(&template);
    let env = Env {
        uid_base: 2_100_000_000 + (pid % 500) * 65536 * 8,
        root: root.clone(),
        template,
        counter: AtomicU32::new(0),
        criu,
    };
    let mut failed = Vec::new();
    for (name, test) in TESTS
        .iter()
        .filter(|(n, _)| filters.is_empty() || filters.iter().any(|f| n.contains(f.as_str())))
    {
        let t = Instant::now();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| test(&env))) {
            Ok(()) => println!("test {name} ... ok ({:?})", t.elapsed()),
            Err(_) => {
                println!("test {name} ... FAILED");
                failed.push(*name);
            }
        }
    }
    for id in cubicle_runtime::list_sandboxes().unwrap_or_default() {
        if id.starts_with(&format!("ckt{pid}x")) {
            let _ = cubicle_runtime::remove_leftovers(&id, None);
        }
    }
    if failed.is_empty() || std::env::var_os("CUBICLE_KEEP_TEST_DIR").is_none() {
        let _ = fs::remove_dir_all(&root);
    }
    if !failed.is_empty() {
        println!("failed: {failed:?}");
        std::process::exit(1);
    }
}
