//! End-to-end tests of cubicle-runtime, as root, on the real kernel.
//!
//! `harness = false`: `spawn()` re-executes this binary as the sandbox helper, so `main()`
//! must call `maybe_run_helper()` first — libtest's generated main cannot. Tests run one
//! after the other; pass substrings as arguments to run only matching tests
//! (`cargo test -p cubicle-runtime --test sandbox -- oom`).
//!
//! The template is a busybox-static rootfs built in a temporary directory. Init programs are
//! `/bin/busybox sh -c SCRIPT` whose output the test reads from the init log FIFO.

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::os::fd::AsFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt, chown, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use cubicle_runtime::{BindMount, Cgroup, CgroupVersion, Sandbox, SandboxSpec, spawn};

struct Env {
    root: PathBuf,
    template: PathBuf,
    uid_base: u32,
    counter: AtomicU32,
    has_suid_probe: bool,
    has_syscall_probe: bool,
    /// What each sandbox's PID 1 wrote, by id (read from its init log FIFO).
    logs: std::sync::Mutex<std::collections::HashMap<String, Vec<u8>>>,
}

impl Env {
    fn new() -> Env {
        let pid = std::process::id();
        let root = PathBuf::from(format!("/tmp/cubicle-rt-test-{pid}"));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).unwrap();
        fs::set_permissions(&root, fs::Permissions::from_mode(0o755)).unwrap();
        let template = root.join("template");
        let has_suid_probe = build_busybox_rootfs(&template, &root);
        let has_syscall_probe = compile_c(&root, SYSCALL_PROBE, &template.join("bin/syscallprobe"));
        // A uid range far from host users and, per test process, from other test runs.
        let uid_base = 2_000_000_000 + (pid % 1000) * 65536 * 32;
        Env {
            root,
            template,
            uid_base,
            counter: AtomicU32::new(0),
            has_suid_probe,
            has_syscall_probe,
            logs: Default::default(),
        }
    }

    /// A spec for a fresh sandbox running `script` with busybox sh; its log file is
    /// `<root>/<id>.log`.
    fn spec(&self, script: &str) -> SandboxSpec {
        let n = self.counter.fetch_add(1, Ordering::SeqCst);
        let id = format!("rtt{}x{n}", std::process::id());
        let mut spec = SandboxSpec::new(
            id.clone(),
            &self.template,
            self.root.join("sandboxes").join(&id),
            self.uid_base + n * 65536,
            vec![
                "/bin/busybox".into(),
                "sh".into(),
                "-c".into(),
                script.into(),
            ],
        );
        spec.init_log = Some(self.root.join(format!("{id}.pipe")));
        spec.limits.memory_bytes = 128 << 20;
        spec
    }

    /// Everything PID 1 wrote so far (its init log FIFO, drained here); once the sandbox
    /// has ended, waits (up to 5 s) for the last writer to go.
    fn log(&self, sb: &Sandbox) -> String {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut logs = self.logs.lock().unwrap();
        let buf = logs.entry(sb.id().to_string()).or_default();
        loop {
            let eof = sb.read_init_log(buf).unwrap();
            if eof || sb.is_alive() || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        String::from_utf8_lossy(buf).into_owned()
    }

    /// Spawns, waits for init to exit (10 s max), returns the sandbox and its output.
    fn run(&self, spec: &SandboxSpec) -> (Sandbox, String) {
        let sb = spawn(spec).unwrap_or_else(|e| panic!("spawn {}: {e}", spec.id));
        assert!(
            sb.wait_timeout(Duration::from_secs(10)),
            "init did not exit; log: {}",
            self.log(&sb)
        );
        let log = self.log(&sb);
        (sb, log)
    }
}

fn build_busybox_rootfs(t: &Path, scratch: &Path) -> bool {
    for d in [
        "bin",
        "etc",
        "root",
        "home/user",
        "tmp",
        "proc",
        "sys",
        "dev",
        "run",
        "mnt",
        "usr/bin",
    ] {
        fs::create_dir_all(t.join(d)).unwrap();
    }
    fs::set_permissions(t.join("tmp"), fs::Permissions::from_mode(0o1777)).unwrap();
    fs::set_permissions(t.join("root"), fs::Permissions::from_mode(0o700)).unwrap();
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("busybox-static is not installed (apt-get install busybox-static)");
    fs::copy(busybox, t.join("bin/busybox")).unwrap();
    let list = Command::new(busybox).arg("--list").output().unwrap();
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        if applet != "busybox" {
            let _ = symlink("busybox", t.join("bin").join(applet));
        }
    }
    fs::write(
        t.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n",
    )
    .unwrap();
    fs::write(t.join("etc/group"), "root:x:0:\ntty:x:5:\nuser:x:1000:\n").unwrap();
    fs::write(t.join("etc/secret-of-template"), "root only\n").unwrap();
    fs::set_permissions(
        t.join("etc/secret-of-template"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    chown(t.join("home/user"), Some(1000), Some(1000)).unwrap();
    // A setuid-root probe, to show setuid (hence sudo) works: no no_new_privs.
    let probe = t.join("bin/suidprobe");
    let ok = compile_c(scratch, SUID_PROBE, &probe);
    if ok {
        fs::set_permissions(&probe, fs::Permissions::from_mode(0o4755)).unwrap();
    }
    ok
}

const SUID_PROBE: &str = r#"
#include <stdio.h>
#include <unistd.h>
int main(void) { printf("ruid=%d euid=%d\n", (int)getuid(), (int)geteuid()); return 0; }
"#;

/// Calls each system call the seccomp policy denies (with harmless arguments) and prints
/// `name=errno`.
const SYSCALL_PROBE: &str = r#"
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <sched.h>
#include <unistd.h>
#include <sys/syscall.h>
#define TRY(name, ...) do { errno = 0; long r = syscall(__VA_ARGS__); \
    printf("%s=%d\n", name, r < 0 ? errno : 0); } while (0)
int main(void) {
    TRY("init_module", SYS_init_module, 0, 0, "");
    TRY("finit_module", SYS_finit_module, -1, "", 0);
    TRY("delete_module", SYS_delete_module, "x", 0);
    TRY("kexec_load", SYS_kexec_load, 0, 0, 0, 0);
    TRY("reboot", SYS_reboot, 0, 0, 0, 0);
    TRY("swapoff", SYS_swapoff, "/nonexistent");
    TRY("keyctl", SYS_keyctl, 0, 0, 0, 0, 0);
    TRY("add_key", SYS_add_key, "user", "x", "y", 1, 0);
    TRY("bpf", SYS_bpf, 0, 0, 0);
    TRY("perf_event_open", SYS_perf_event_open, 0, 0, -1, -1, 0);
    TRY("userfaultfd", SYS_userfaultfd, 0);
    TRY("mount", SYS_mount, "none", "/mnt", "tmpfs", 0, 0);
    TRY("fsopen", 430, "tmpfs", 0);
    TRY("open_tree", 428, -100, "/", 1);
    TRY("pivot_root", SYS_pivot_root, "/", "/");
    TRY("clock_settime", SYS_clock_settime, 0, 0);
    TRY("settimeofday", SYS_settimeofday, 0, 0);
    TRY("open_by_handle_at", SYS_open_by_handle_at, -1, 0, 0);
    TRY("io_uring_setup", 425, 1, 0);
    TRY("acct", SYS_acct, 0);
    TRY("unshare_newuser", SYS_unshare, CLONE_NEWUSER);
    TRY("clone_newuser", SYS_clone, CLONE_NEWUSER | 17, 0, 0, 0, 0);
    TRY("clone3", 435, 0, 0);
    TRY("personality_bad", SYS_personality, 0x0400000);
    TRY("personality_query", SYS_personality, 0xffffffff);
    TRY("getpid", SYS_getpid);
    return 0;
}
"#;

fn compile_c(scratch: &Path, source: &str, out: &Path) -> bool {
    let src = scratch.join(format!("{}.c", out.file_name().unwrap().to_string_lossy()));
    fs::write(&src, source).unwrap();
    Command::new("cc")
        .args(["-static", "-O1", "-o"])
        .arg(out)
        .arg(&src)
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// The host's mounts whose mount point, source or options name a path under `dir`
/// (an overlay mounted elsewhere with its upper layer there counts too).
fn mounts_mentioning(dir: &Path) -> Vec<cubicle_syscalls::mountinfo::Mount> {
    let d = dir.to_string_lossy();
    cubicle_syscalls::mountinfo::mounts()
        .unwrap()
        .into_iter()
        .filter(|m| {
            m.mount_point.starts_with(dir)
                || m.source.contains(&*d)
                || m.super_options.contains(&*d)
        })
        .collect()
}

/// Asserts that nothing of the sandbox remains on the host.
fn assert_clean(spec: &SandboxSpec, pid: i32) {
    let left = mounts_mentioning(&spec.sandbox_dir);
    assert!(
        left.is_empty(),
        "host mounts still mention the sandbox: {left:?}"
    );
    let cg = Cgroup::handle(&spec.id).unwrap();
    assert!(!cg.exists(), "cgroup dirs remain: {:?}", cg.dirs());
    // An adopted init (not our child) is a zombie until the host's init reaps it.
    let deadline = Instant::now() + Duration::from_secs(2);
    while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "init {pid} still exists"
    );
    for sub in ["upper", "work", "ctl", "rootfs"] {
        assert!(!spec.sandbox_dir.join(sub).exists(), "{sub} remains");
    }
}

fn destroy_and_check(sb: Sandbox, spec: &SandboxSpec) {
    let pid = sb.pid();
    sb.destroy().unwrap();
    assert_clean(spec, pid);
}

// ---------------------------------------------------------------------------------------

fn uid_zero_inside_maps_to_uid_base(env: &Env) {
    let spec = env.spec("id -u; touch /root/made-by-root; mkdir /home/user/sub; chown user /home/user/sub; echo done");
    let (sb, log) = env.run(&spec);
    assert_eq!(log.lines().next(), Some("0"), "log: {log}");
    assert!(log.contains("done"), "log: {log}");
    let meta = fs::metadata(spec.upper_dir().join("root/made-by-root")).unwrap();
    assert_eq!(
        meta.uid(),
        spec.uid_base,
        "file made by root inside is owned by uid_base on the host"
    );
    assert_eq!(meta.gid(), spec.uid_base);
    let sub = fs::metadata(spec.upper_dir().join("home/user/sub")).unwrap();
    assert_eq!(sub.uid(), spec.uid_base + 1000);
    assert_eq!(sb.exit_status().map(|s| s.success()), Some(true));
    destroy_and_check(sb, &spec);
}

fn two_sandboxes_get_distinct_ranges(env: &Env) {
    let a = env.spec("sleep 30");
    let b = env.spec("sleep 30");
    let sa = spawn(&a).unwrap();
    let sb = spawn(&b).unwrap();
    let map = |s: &Sandbox| fs::read_to_string(format!("/proc/{}/uid_map", s.pid())).unwrap();
    let (ma, mb) = (map(&sa), map(&sb));
    assert_eq!(
        ma.split_whitespace().collect::<Vec<_>>(),
        ["0", &a.uid_base.to_string(), "65536"]
    );
    assert_eq!(
        mb.split_whitespace().collect::<Vec<_>>(),
        ["0", &b.uid_base.to_string(), "65536"]
    );
    assert!(a.uid_base.abs_diff(b.uid_base) >= 65536);
    let again = spawn(&a).map(|_| ()).unwrap_err().to_string();
    assert!(again.contains("already running"), "{again}");
    let host_uid = |s: &Sandbox| fs::metadata(format!("/proc/{}", s.pid())).unwrap().uid();
    assert_eq!(host_uid(&sa), a.uid_base);
    assert_eq!(host_uid(&sb), b.uid_base);
    destroy_and_check(sa, &a);
    destroy_and_check(sb, &b);
}

/// Where a sandbox sits in each hierarchy (`/proc/<init>/cgroup`): `cubicle/<id>` in the
/// controllers' (v2: the one hierarchy), and on a hybrid v1 host the shared `cubicle` of
/// the hierarchies systemd tracks services by (outside the starting service's cgroup,
/// without a cgroup per sandbox there). After the kill, no `cubicle/<id>` is left in
/// any hierarchy.
fn cgroup_membership_per_hierarchy(env: &Env) {
    let spec = env.spec("sleep 30");
    let sb = spawn(&spec).unwrap();
    let own = format!("/cubicle/{}", spec.id);
    let table = fs::read_to_string(format!("/proc/{}/cgroup", sb.pid())).unwrap();
    let mut tracking = 0;
    for line in table.lines() {
        // hierarchy-id:controllers:path
        let mut f = line.splitn(3, ':');
        let (_, ctrl, path) = (f.next().unwrap(), f.next().unwrap(), f.next().unwrap());
        let is_controller = ["memory", "cpu", "pids", "freezer"]
            .iter()
            .any(|c| ctrl.split(',').any(|x| x == *c));
        if sb.cgroup().version() == CgroupVersion::V2 || is_controller {
            assert_eq!(path, own, "{line}");
        } else if ctrl.is_empty() || ctrl == "name=systemd" {
            assert_eq!(path, "/cubicle", "{line}");
            tracking += 1;
        }
    }
    if sb.cgroup().version() == CgroupVersion::V1 {
        assert!(tracking > 0, "no tracking hierarchy in {table}");
    }
    destroy_and_check(sb, &spec);
    let left: Vec<_> = cgroup_dirs_named(&spec.id)
        .into_iter()
        .filter(|d| d.exists())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// `cubicle/<id>` under every mounted hierarchy of `/sys/fs/cgroup`.
fn cgroup_dirs_named(id: &str) -> Vec<PathBuf> {
    let mut v = vec![Path::new("/sys/fs/cgroup/cubicle").join(id)];
    for e in fs::read_dir("/sys/fs/cgroup").unwrap().flatten() {
        v.push(e.path().join("cubicle").join(id));
    }
    v
}

/// The sandbox's open-files limit is the spec's, not the (raised) one of the caller:
/// a node raises its own to hold thousands of sandboxes, and its tenants do not inherit it.
fn open_files_limit_is_the_specs(env: &Env) {
    let node = cubicle_runtime::fd_limit::current().unwrap();
    let mut spec = env.spec("grep 'open files' /proc/self/limits; echo limits-done");
    // `new` takes the limit the process started with (main() raised it first).
    assert_eq!(spec.open_files, cubicle_runtime::fd_limit::for_sandboxes());
    let asked = cubicle_runtime::fd_limit::FdLimit {
        soft: 777,
        hard: 4321,
    };
    assert_ne!(node, asked);
    spec.open_files = Some(asked);
    let (sb, log) = env.run(&spec);
    assert!(log.contains("limits-done"), "log: {log}");
    let line = log
        .lines()
        .find(|l| l.contains("open files"))
        .unwrap_or_default();
    let nums: Vec<&str> = line
        .split_whitespace()
        .filter(|w| w.parse::<u64>().is_ok())
        .collect();
    assert_eq!(nums, ["777", "4321"], "{line}");
    destroy_and_check(sb, &spec);
}

fn ps_shows_only_sandbox_processes(env: &Env) {
    let spec = env.spec("sleep 30 & ps -o pid,comm; echo ps-done");
    let (sb, log) = env.run(&spec);
    assert!(log.contains("ps-done"), "log: {log}");
    let pids: Vec<u32> = log
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    assert!(pids.contains(&1), "init is pid 1 inside: {log}");
    assert!(pids.len() <= 4, "only the sandbox's processes: {log}");
    assert!(pids.iter().all(|p| *p < 10), "{log}");
    destroy_and_check(sb, &spec);
}

fn hostname_and_host_paths(env: &Env) {
    let mut spec = env.spec(
        "hostname; cat /etc/shadow && echo SHADOW-READABLE; ls /work >/dev/null 2>&1 && echo WORK-VISIBLE; \
         test -e /tmp/cubicle-rt-test-* && echo HOST-TMP-VISIBLE; ls /root /etc/secret-of-template; \
         echo links=$(ls /sys/class/net | tr '\\n' ' '); ip -o link | grep -c -v ': lo:'; \
         ip -o link | grep -q 'lo:.*UP' && echo lo-up; echo end",
    );
    spec.hostname = "cubicle-test-host".into();
    let (sb, log) = env.run(&spec);
    assert_eq!(log.lines().next(), Some("cubicle-test-host"), "log: {log}");
    for bad in ["SHADOW-READABLE", "WORK-VISIBLE", "HOST-TMP-VISIBLE"] {
        assert!(!log.contains(bad), "{bad}: {log}");
    }
    assert!(
        log.contains("/etc/secret-of-template"),
        "template files visible: {log}"
    );
    assert!(
        log.lines().any(|l| l.trim() == "links=lo"),
        "only loopback: {log}"
    );
    assert!(log.contains("lo-up"), "loopback is up: {log}");
    assert!(log.trim_end().ends_with("end"), "log: {log}");
    destroy_and_check(sb, &spec);
}

/// The mount at `/sys` in `pid`'s mount namespace.
fn sys_mount_of(pid: u32) -> cubicle_syscalls::mountinfo::Mount {
    let table = fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    cubicle_syscalls::mountinfo::parse(&table)
        .into_iter()
        .find(|m| m.mount_point == Path::new("/sys"))
        .unwrap_or_else(|| panic!("no /sys in {pid}'s mountinfo: {table}"))
}

/// `shared_sysfs.rs`: every sandbox's `/sys` is one read-only sysfs, not the host's (whose
/// `class/net` lists the host's interfaces, other sandboxes' veths among them) and not
/// one per sandbox. Inside, `class/net` shows the loopback of the instance's own network
/// namespace, and nothing can be written.
fn sandboxes_share_one_sysfs(env: &Env) {
    let a = env.spec(
        "echo net=$(ls /sys/class/net | tr '\\n' ' '); \
         echo 1 > /sys/class/net/lo/mtu 2>/dev/null || echo mtu-refused; \
         test -r /sys/kernel/mm/transparent_hugepage/enabled && echo thp-readable; \
         for f in /proc/1/fd/*; do echo fd $f $(readlink $f); done; \
         echo ready; sleep 30",
    );
    let b = env.spec("sleep 30");
    let sa = spawn(&a).unwrap();
    let sb = spawn(&b).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut log = env.log(&sa);
    while !log.contains("ready") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        log = env.log(&sa);
    }
    let (sys_a, sys_b) = (sys_mount_of(sa.pid() as u32), sys_mount_of(sb.pid() as u32));
    let sys_host = sys_mount_of(std::process::id());
    assert_eq!(
        sys_a.dev, sys_b.dev,
        "one sysfs superblock for both sandboxes"
    );
    assert_ne!(sys_a.dev, sys_host.dev, "not the host's sysfs");
    for m in [&sys_a, &sys_b] {
        assert!(m.has_option("ro"), "read-only: {m:?}");
    }
    assert!(log.lines().any(|l| l.trim() == "net=lo"), "log: {log}");
    assert!(log.contains("mtu-refused"), "log: {log}");
    assert!(
        log.contains("thp-readable"),
        "the rest of sysfs is there: {log}"
    );
    // Neither the zygote's sysfs mount nor its network namespace reached the sandbox.
    let fds: Vec<&str> = log.lines().filter(|l| l.starts_with("fd ")).collect();
    assert!(!fds.is_empty(), "log: {log}");
    for fd in &fds {
        let target = fd.rsplit(' ').next().unwrap_or("");
        assert!(
            target != "/" && !target.starts_with("net:"),
            "inherited descriptor {fd}: {log}"
        );
    }
    destroy_and_check(sa, &a);
    destroy_and_check(sb, &b);
}

fn mount_and_privileged_calls_fail(env: &Env) {
    let spec = env.spec(
        "mount -t tmpfs x /mnt && echo MOUNT-OK; unshare -U true && echo UNSHARE-USER-OK; \
         unshare -m true && echo UNSHARE-MNT-OK; \
         grep -E '^(Seccomp|NoNewPrivs|CapBnd|CapEff):' /proc/self/status; \
         swapoff /nonexistent && echo SWAPOFF-OK; reboot -f && echo REBOOT-OK; \
         echo 1 > /proc/sys/kernel/panic && echo SYSCTL-OK; echo x > /proc/sysrq-trigger; \
         echo timer_list=$(wc -c < /proc/timer_list); echo keys=$(wc -c < /proc/keys); \
         echo x > /proc/timer_list; echo timer_list_after_write=$(wc -c < /proc/timer_list); echo end",
    );
    let (sb, log) = env.run(&spec);
    for bad in [
        "MOUNT-OK",
        "UNSHARE-USER-OK",
        "UNSHARE-MNT-OK",
        "SWAPOFF-OK",
        "REBOOT-OK",
        "SYSCTL-OK",
    ] {
        assert!(!log.contains(bad), "{bad}: {log}");
    }
    let field = |k: &str| {
        log.lines()
            .find_map(|l| l.strip_prefix(k))
            .map(str::trim)
            .unwrap_or("")
    };
    assert_eq!(field("Seccomp:"), "2", "seccomp filter active: {log}");
    assert_eq!(
        field("NoNewPrivs:"),
        "0",
        "no_new_privs must stay off for sudo: {log}"
    );
    let bnd = u64::from_str_radix(field("CapBnd:"), 16).unwrap();
    assert_eq!(
        bnd,
        cubicle_runtime::capabilities::kept_mask(),
        "bounding set: {log}"
    );
    assert!(
        log.contains("timer_list=0"),
        "/proc/timer_list is masked: {log}"
    );
    assert!(log.contains("keys=0"), "/proc/keys is masked: {log}");
    assert!(
        log.contains("timer_list_after_write=0"),
        "writes to a masked file go nowhere: {log}"
    );
    assert!(log.contains("end"), "{log}");
    assert!(!sb.is_alive());
    destroy_and_check(sb, &spec);
}

fn seccomp_denies_dangerous_syscalls(env: &Env) {
    if !env.has_syscall_probe {
        println!("    (skipped: no C compiler with static libc to build the syscall probe)");
        return;
    }
    let spec = env.spec("/bin/syscallprobe; echo end");
    let (sb, log) = env.run(&spec);
    let errno = |name: &str| -> i32 {
        log.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}=")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} not in output: {log}"))
    };
    for name in [
        "init_module",
        "finit_module",
        "delete_module",
        "kexec_load",
        "reboot",
        "swapoff",
        "keyctl",
        "add_key",
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "mount",
        "fsopen",
        "open_tree",
        "pivot_root",
        "clock_settime",
        "settimeofday",
        "open_by_handle_at",
        "io_uring_setup",
        "acct",
        "unshare_newuser",
        "clone_newuser",
        "personality_bad",
    ] {
        assert_eq!(errno(name), 1, "{name} must fail with EPERM: {log}");
    }
    assert_eq!(errno("clone3"), 38, "clone3 must fail with ENOSYS: {log}");
    assert_eq!(errno("personality_query"), 0, "{log}");
    assert_eq!(errno("getpid"), 0, "{log}");
    destroy_and_check(sb, &spec);
}

fn devices_and_ctl_bind(env: &Env) {
    let envd = env.root.join("fake-envd");
    fs::write(&envd, "#!/bin/sh\necho fake envd\n").unwrap();
    fs::set_permissions(&envd, fs::Permissions::from_mode(0o755)).unwrap();
    let extra = env.root.join("extra-ro");
    fs::create_dir_all(&extra).unwrap();
    fs::write(extra.join("file"), "extra\n").unwrap();
    let mut spec = env.spec(
        "head -c 16 /dev/urandom | wc -c; echo x > /dev/null && echo null-ok; \
         exec 4<>/dev/ptmx && echo ptmx-ok; ls /dev/pts; \
         cat /run/cubicle/envd | head -1; echo x > /run/cubicle/envd || echo envd-ro; \
         echo from-inside > /run/cubicle/ctl/hello || echo ctl-ro; \
         ln -s /tmp /run/cubicle/ctl/link || echo ctl-ro-link; \
         test -S /run/cubicle/ctl/envd.sock && echo sock-visible; \
         readlink /proc/$$/fd/3 | cut -c1-7; \
         cat /opt/extra/file; touch /opt/extra/new || echo extra-ro; \
         touch /sys/x 2>/dev/null || echo sys-ro; sleep 2; echo end",
    );
    spec.envd_binary = Some(envd);
    spec.ctl_socket = Some("envd.sock".into());
    spec.binds.push(BindMount {
        source: extra,
        target: "/opt/extra".into(),
        readonly: true,
        idmapped: false,
    });
    let sb = spawn(&spec).unwrap_or_else(|e| panic!("spawn {}: {e}", spec.id));
    // The init's listening socket answers from the host while it runs (nobody accepts:
    // the backlog takes the connection).
    assert!(sb.connect_ctl("envd.sock").is_ok());
    assert!(
        sb.wait_timeout(Duration::from_secs(10)),
        "init did not exit"
    );
    let log = env.log(&sb);
    for want in [
        "16",
        "null-ok",
        "ptmx-ok",
        "ptmx",
        "#!/bin/sh",
        "envd-ro",
        "ctl-ro",
        "ctl-ro-link",
        "sock-visible",
        "socket:",
        "extra",
        "extra-ro",
        "sys-ro",
        "end",
    ] {
        assert!(
            log.lines().any(|l| l.trim() == want),
            "missing {want:?}: {log}"
        );
    }
    assert!(!spec.ctl_dir().join("hello").exists());
    // A symlink in the ctl directory (written by whoever could) would take a naive host
    // connect to the host's socket; the runtime's connect refuses it.
    let host_sock = env.root.join("host-only.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&host_sock).unwrap();
    fs::remove_file(spec.ctl_dir().join("envd.sock")).unwrap();
    symlink(&host_sock, spec.ctl_dir().join("envd.sock")).unwrap();
    assert!(std::os::unix::net::UnixStream::connect(spec.ctl_dir().join("envd.sock")).is_ok());
    let e = sb.connect_ctl("envd.sock").unwrap_err().to_string();
    assert!(e.contains("not a socket"), "{e}");
    destroy_and_check(sb, &spec);
}

/// Volumes' mounts: idmapped at spawn (owners on disk are owners inside, what root and
/// `user` create inside is stored as 0 and 1000), and attached later to a running
/// sandbox (`attach_binds`, as for a pooled sandbox), read-only, below a directory only
/// `user` may write.
fn idmapped_binds_at_spawn_and_while_running(env: &Env) {
    let vol = env.root.join("vol-early");
    let late = env.root.join("vol-late");
    for d in [&vol, &late] {
        let _ = fs::remove_dir_all(d);
        fs::create_dir_all(d).unwrap();
        chown(d, Some(1000), Some(1000)).unwrap();
    }
    fs::write(vol.join("owned1000"), "x").unwrap();
    chown(vol.join("owned1000"), Some(1000), Some(1000)).unwrap();
    fs::write(late.join("marker"), "late-marker\n").unwrap();
    let mut spec = env.spec(
        "stat -c %u:%g /mnt/vol/owned1000; echo x > /mnt/vol/byroot && echo root-wrote; \
         su user -c 'echo y > /mnt/vol/byuser' && echo user-wrote; \
         i=0; while [ ! -e /home/user/late/marker ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; \
         cat /home/user/late/marker; stat -c %u /home/user/late; \
         touch /home/user/late/new 2>/dev/null || echo late-ro; echo end",
    );
    spec.binds.push(BindMount {
        source: vol.clone(),
        target: "/mnt/vol".into(),
        readonly: false,
        idmapped: true,
    });
    let sb = spawn(&spec).unwrap_or_else(|e| panic!("spawn: {e}"));
    let late_bind = BindMount {
        source: late.clone(),
        target: "/home/user/late".into(),
        readonly: true,
        idmapped: true,
    };
    cubicle_runtime::attach_binds(sb.pidfd().as_fd(), sb.pid(), spec.uid_base, &[late_bind])
        .unwrap_or_else(|e| panic!("attach: {e}"));
    assert!(
        sb.wait_timeout(Duration::from_secs(20)),
        "log: {}",
        env.log(&sb)
    );
    let log = env.log(&sb);
    for want in [
        "1000:1000",
        "root-wrote",
        "user-wrote",
        "late-marker",
        "late-ro",
        "end",
    ] {
        assert!(
            log.lines().any(|l| l == want),
            "{want:?} missing; log: {log}"
        );
    }
    // The late volume's root (uid 1000 on disk) is uid 1000 inside: idmapped too.
    assert!(log.lines().any(|l| l == "1000"), "log: {log}");
    let owner = |p: PathBuf| {
        let m = fs::metadata(p).unwrap();
        (m.uid(), m.gid())
    };
    assert_eq!(owner(vol.join("byroot")), (0, 0));
    assert_eq!(owner(vol.join("byuser")), (1000, 1000));
    assert!(!late.join("new").exists());
    // The mount point the attach made is the sandbox root's (host uid_base).
    let mp = fs::metadata(spec.upper_dir().join("home/user/late")).unwrap();
    assert_eq!(mp.uid(), spec.uid_base);
    destroy_and_check(sb, &spec);
}

fn setuid_works_without_no_new_privs(env: &Env) {
    if !env.has_suid_probe {
        println!("    (skipped: no C compiler with static libc to build the setuid probe)");
        return;
    }
    let spec = env.spec("su -s /bin/sh user -c 'id -u; /bin/suidprobe'; echo end");
    let (sb, log) = env.run(&spec);
    assert!(log.contains("1000"), "runs as user: {log}");
    assert!(
        log.contains("ruid=1000 euid=0"),
        "setuid root works for uid 1000 (sudo needs it): {log}"
    );
    destroy_and_check(sb, &spec);
}

fn fork_bomb_is_contained(env: &Env) {
    let mut spec = env.spec("f() { f | f & }; f; sleep 30");
    spec.limits.pids = 64;
    let sb = spawn(&spec).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let stats = sb.stats().unwrap();
    assert!(stats.pids <= 64, "pids {} above the limit", stats.pids);
    assert!(
        stats.pids_limit_hits > 0,
        "the bomb hit pids.max: {stats:?}"
    );
    assert!(
        Command::new("true").status().unwrap().success(),
        "host can still fork"
    );
    let t = Instant::now();
    destroy_and_check(sb, &spec);
    println!("    destroyed a fork bomb in {:?}", t.elapsed());
}

/// Starts `/bin/true` over and over as a shell does (`vfork`, `execve`, `waitpid`).
const SPAWN_LOOP: &str = r#"
#include <sys/wait.h>
#include <unistd.h>
int main(void) {
    char *argv[] = {"true", 0};
    for (;;) {
        pid_t p = vfork();
        if (p == 0) {
            execv("/bin/true", argv);
            _exit(127);
        }
        waitpid(p, 0, 0);
    }
}
"#;

/// A sandbox whose shell runs commands in a loop (tasks forked all the time) freezes,
/// every time: cgroup v1's freezer, told once, stayed `FREEZING` for good when a task
/// forked during its walk escaped it (20 of 300 freezes here, each one a pause that
/// failed after 5 s).
fn a_forking_sandbox_freezes(env: &Env) {
    assert!(
        compile_c(&env.root, SPAWN_LOOP, &env.template.join("bin/spawnloop")),
        "cc -static spawnloop failed (gcc and libc6-dev: scripts/install-deps.sh)"
    );
    let spec = env.spec("/bin/spawnloop & /bin/spawnloop");
    let sb = spawn(&spec).unwrap();
    let cg = cubicle_runtime::Cgroup::handle(&spec.id).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let mut slowest = Duration::ZERO;
    for i in 0..300 {
        let t = Instant::now();
        cg.freeze(Duration::from_secs(1))
            .unwrap_or_else(|e| panic!("freeze {i}: {e}"));
        slowest = slowest.max(t.elapsed());
        cg.thaw().unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    println!("    300 freezes of a forking sandbox, the slowest {slowest:?}");
    destroy_and_check(sb, &spec);
}

fn memory_limit_oom_kills(env: &Env) {
    let mut spec = env.spec("dd if=/dev/zero of=/dev/null bs=64M count=1; echo dd-exit=$?");
    spec.limits.memory_bytes = 32 << 20;
    let (sb, log) = env.run(&spec);
    assert!(log.contains("dd-exit=137"), "dd was SIGKILLed: {log}");
    assert!(
        sb.oom_killed().unwrap(),
        "oom_killed() reports the kill: {:?}",
        sb.stats()
    );
    destroy_and_check(sb, &spec);
}

fn no_oom_without_pressure(env: &Env) {
    let spec = env.spec(
        "dd if=/dev/zero of=/dev/null bs=1M count=4; echo dd-exit=$?; cat /proc/self/cgroup; \
         echo limit=$(cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/memory.max 2>/dev/null); \
         echo 1 > /sys/fs/cgroup/pids/pids.max 2>/dev/null && echo CGROUP-WRITABLE; \
         ls /sys/fs/cgroup/memory | grep -c cubicle; echo end",
    );
    let (sb, log) = env.run(&spec);
    assert!(log.contains("dd-exit=0"), "{log}");
    // Its own cgroup, seen as the root through the cgroup namespace, read-only.
    assert!(
        log.contains("limit=134217728"),
        "sandbox sees its memory limit: {log}"
    );
    assert!(!log.contains("CGROUP-WRITABLE"), "{log}");
    assert!(!log.contains("cubicle/"), "host cgroup paths hidden: {log}");
    assert!(!sb.oom_killed().unwrap());
    let st = sb.stats().unwrap();
    assert!(st.cpu_usage_ns > 0, "{st:?}");
    // The limits are in the kernel (v1 file names on this host, v2 in production).
    let files: Vec<(String, String)> = sb
        .cgroup()
        .dirs()
        .iter()
        .flat_map(|d| fs::read_dir(d).unwrap().flatten())
        .filter_map(|e| {
            Some((
                e.file_name().into_string().ok()?,
                fs::read_to_string(e.path()).ok()?.trim().to_string(),
            ))
        })
        .collect();
    let get = |k: &str| files.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    if sb.cgroup().version() == cubicle_runtime::CgroupVersion::V1 {
        assert_eq!(get("memory.limit_in_bytes"), Some("134217728"));
        assert_eq!(
            get("memory.memsw.limit_in_bytes"),
            Some("134217728"),
            "no swap"
        );
        assert_eq!(get("cpu.cfs_quota_us"), Some("200000"));
        assert_eq!(get("cpu.cfs_period_us"), Some("100000"));
        assert_eq!(get("pids.max"), Some("1024"));
    } else {
        assert_eq!(get("memory.max"), Some("134217728"));
        assert_eq!(get("cpu.max"), Some("200000 100000"));
        assert_eq!(get("pids.max"), Some("1024"));
    }
    destroy_and_check(sb, &spec);
}

fn adopt_and_reap_after_crash(env: &Env) {
    let spec = env.spec("sleep 60 & sleep 60");
    let sb = spawn(&spec).unwrap();
    let pid = sb.pid();
    drop(sb); // the "node" forgets it, as after a crash
    assert!(
        cubicle_runtime::list_sandboxes()
            .unwrap()
            .contains(&spec.id)
    );
    let adopted = Sandbox::adopt(&spec.id, &spec.sandbox_dir).unwrap();
    assert_eq!(adopted.pid(), pid);
    assert!(adopted.is_alive());
    assert_eq!(
        adopted.netns_path(),
        PathBuf::from(format!("/proc/{pid}/ns/net"))
    );
    destroy_and_check(adopted, &spec);

    // And an orphan nobody adopts: reap_orphans removes it (only ours: others are "known").
    let spec2 = env.spec("sleep 60");
    let sb2 = spawn(&spec2).unwrap();
    let pid2 = sb2.pid();
    drop(sb2);
    let removed = cubicle_runtime::reap_orphans(|id| id != spec2.id).unwrap();
    assert_eq!(removed, vec![spec2.id.clone()]);
    cubicle_runtime::remove_leftovers(&spec2.id, Some(&spec2.sandbox_dir)).unwrap();
    assert_clean(&spec2, pid2);
}

fn setup_failure_cleans_up(env: &Env) {
    let mut spec = env.spec("true");
    spec.init = vec!["/does/not/exist".into()];
    let err = spawn(&spec).unwrap_err().to_string();
    assert!(err.contains("execve /does/not/exist"), "{err}");
    let cg = Cgroup::handle(&spec.id).unwrap();
    assert!(!cg.exists(), "cgroup removed after a failed spawn");
    assert!(!spec.upper_dir().exists());
    let left = mounts_mentioning(&spec.sandbox_dir);
    assert!(left.is_empty(), "{left:?}");
}

fn open_fds() -> usize {
    fs::read_dir("/proc/self/fd").unwrap().count()
}

/// The fields of /proc/<pid>/stat after the command (state, ppid, …: field 3 is [0]);
/// `None` once the process is gone.
fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, after) = stat.rsplit_once(')')?;
    Some(after.split_whitespace().map(str::to_string).collect())
}

/// Children of this process that are zombies (an init nobody reaped).
fn zombie_children() -> Vec<i32> {
    let me = std::process::id().to_string();
    fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|&pid| stat_fields(pid).is_some_and(|f| f.len() > 1 && f[0] == "Z" && f[1] == me))
        .collect()
}

/// Parallel creates (as the node does from several threads) and many create/destroy
/// cycles leave no fd, zombie, mount or cgroup behind.
fn concurrent_cycles_leak_nothing(env: &Env) {
    // The first spawn of a process starts its zygote, which keeps one socket open.
    let spec = env.spec("true");
    destroy_and_check(spawn(&spec).unwrap(), &spec);
    let fds_before = open_fds();
    for _round in 0..5 {
        let specs: Vec<SandboxSpec> = (0..4).map(|_| env.spec("sleep 30")).collect();
        let handles: Vec<_> = specs
            .iter()
            .cloned()
            .map(|s| std::thread::spawn(move || spawn(&s).map_err(|e| e.to_string())))
            .collect();
        let sandboxes: Vec<Sandbox> = handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect();
        for sb in &sandboxes {
            assert!(sb.is_alive());
        }
        for (sb, spec) in sandboxes.into_iter().zip(&specs) {
            destroy_and_check(sb, spec);
        }
    }
    // A sandbox whose init exits by itself is reaped by destroy too.
    for _ in 0..10 {
        let spec = env.spec("true");
        let sb = spawn(&spec).unwrap();
        destroy_and_check(sb, &spec);
    }
    assert_eq!(open_fds(), fds_before, "fd leak in the caller");
    assert_eq!(
        zombie_children(),
        Vec::<i32>::new(),
        "unreaped sandbox inits"
    );
    // (Other engineers' tests may mount things concurrently: look only for our paths.)
    let left = mounts_mentioning(&env.root);
    assert!(
        left.is_empty(),
        "host mounts under {}: {left:?}",
        env.root.display()
    );
    let prefix = format!("rtt{}x", std::process::id());
    let ours: Vec<String> = cubicle_runtime::list_sandboxes()
        .unwrap()
        .into_iter()
        .filter(|i| i.starts_with(&prefix))
        .collect();
    assert!(ours.is_empty(), "cgroups left: {ours:?}");
}

/// The parent pid of `pid`, `None` once it is gone.
fn ppid_of(pid: i32) -> Option<i32> {
    stat_fields(pid)?.get(1)?.parse().ok()
}

/// Whether `pid` is gone or a zombie (it exited).
fn exited(pid: i32) -> bool {
    stat_fields(pid).is_none_or(|f| f.first().is_some_and(|s| s == "Z"))
}

/// The helpers come from a zygote that outlives them: sandboxes stay the caller's
/// children, and a zygote that died is replaced by the next spawn (and reaped).
fn a_dead_zygote_is_replaced(env: &Env) {
    let me = std::process::id() as i32;
    let spec = env.spec("sleep 30");
    let first = spawn(&spec).unwrap();
    assert_eq!(
        ppid_of(first.pid()),
        Some(me),
        "the init is the caller's child"
    );
    let zygote = cubicle_runtime::zygote_pid().expect("a zygote after a spawn") as i32;
    assert_eq!(
        ppid_of(zygote),
        Some(me),
        "the zygote is the caller's child"
    );
    assert_eq!(
        std::fs::read_to_string(format!("/proc/{zygote}/comm"))
            .ok()
            .as_deref(),
        Some("cubicle-zygote\n"),
        "named for ps and perf (not `exe`)"
    );
    // SAFETY: kill with integer arguments.
    assert_eq!(unsafe { libc::kill(zygote, libc::SIGKILL) }, 0);
    // Dead before the next request: a zygote killed after it took a request fails that
    // spawn instead (it may have forked a helper), which is not what this tests.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !exited(zygote) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let spec2 = env.spec("sleep 30");
    let second = spawn(&spec2).unwrap();
    assert!(second.is_alive());
    assert_eq!(ppid_of(second.pid()), Some(me));
    let replaced = cubicle_runtime::zygote_pid().expect("a new zygote") as i32;
    assert_ne!(replaced, zygote, "a new zygote");
    assert!(
        !zombie_children().contains(&zygote),
        "the dead zygote was reaped"
    );
    destroy_and_check(first, &spec);
    destroy_and_check(second, &spec2);
    assert_eq!(zombie_children(), Vec::<i32>::new(), "helpers reaped");
}

/// The nice value of `pid` (field 19 of /proc/<pid>/stat).
fn nice_of(pid: i32) -> i32 {
    stat_fields(pid).unwrap()[16].parse().unwrap()
}

/// A sandbox weighs as much as the nice value of the thread that spawned it says, whatever
/// thread started the zygote (the node makes pooled sandboxes at nice 19, requests' at
/// 0): its cgroup's CPU weight is scaled by that nice, its tasks run at nice 0.
fn sandbox_weighs_as_the_spawning_threads_nice(env: &Env) {
    for nice in [10, 0, 10] {
        let spec = env.spec("sleep 30");
        let s = spec.clone();
        let sb = std::thread::spawn(move || {
            // SAFETY: no memory arguments; who 0 = this thread.
            unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) };
            spawn(&s).unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(
            nice_of(sb.pid()),
            0,
            "a task's nice, spawned from a thread at nice {nice}"
        );
        // And its cgroup weighs as much against the others: the weight its CPU limit
        // gives, scaled like a task's by nice (1024 per CPU at 0; about a tenth at 10).
        let full = match Cgroup::handle(&spec.id).unwrap().version() {
            CgroupVersion::V1 => u64::from(spec.limits.cpu_millis) * 1024 / 1000,
            CgroupVersion::V2 => u64::from(spec.limits.cpu_millis) / 10,
        };
        let weight = cpu_weight_of(&spec.id);
        if nice == 0 {
            assert_eq!(weight, full, "cgroup weight at nice 0");
        } else {
            assert!(
                weight * 8 < full && weight * 12 > full,
                "cgroup weight {weight} at nice {nice} (full {full})"
            );
        }
        // Raised again, as a claim does.
        Cgroup::handle(&spec.id).unwrap().set_cpu_nice(0).unwrap();
        assert_eq!(cpu_weight_of(&spec.id), full);
        destroy_and_check(sb, &spec);
    }
}

/// The CPU weight of sandbox `id`'s cgroup (`cpu.shares` on v1, `cpu.weight` on v2).
fn cpu_weight_of(id: &str) -> u64 {
    let cg = Cgroup::handle(id).unwrap();
    let file = match Cgroup::handle(id).unwrap().version() {
        CgroupVersion::V1 => "cpu.shares",
        CgroupVersion::V2 => "cpu.weight",
    };
    let dir = cg
        .dirs()
        .into_iter()
        .find(|d| d.join(file).exists())
        .unwrap_or_else(|| panic!("no {file} in {:?}", cg.dirs()));
    std::fs::read_to_string(dir.join(file))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

fn start_caller(spec: &SandboxSpec) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .env(CALLER_ENV, serde_json::to_string(spec).unwrap())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// The node dies after a create (sandbox orphaned, its init reparented away from us) or
/// in the middle of one (at various points): adopt/remove_leftovers clean up everything.
fn caller_killed_leaves_nothing_after_reconcile(env: &Env) {
    use std::io::BufRead;
    // 1. Killed after the create: the sandbox runs on, adopted by a new "node" (us).
    let spec = env.spec("sleep 60");
    let mut caller = start_caller(&spec);
    let mut line = String::new();
    std::io::BufReader::new(caller.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("spawned"), "{line}");
    let zygote: i32 = line
        .split_whitespace()
        .nth(3)
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no zygote pid in {line:?}"));
    caller.kill().unwrap();
    caller.wait().unwrap();
    // The caller's zygote ends with it (end of file on its socket).
    let deadline = Instant::now() + Duration::from_secs(5);
    while !exited(zygote) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        exited(zygote),
        "the dead caller's zygote {zygote} still runs"
    );
    let sb = Sandbox::adopt(&spec.id, &spec.sandbox_dir).unwrap();
    assert!(sb.is_alive());
    let pid = sb.pid();
    sb.destroy().unwrap();
    assert_clean(&spec, pid);

    // 2. Killed mid-create, at different moments.
    for delay_us in [0u64, 500, 1000, 2000, 3000, 4000, 6000, 9000] {
        let spec = env.spec("sleep 60");
        let mut caller = start_caller(&spec);
        std::thread::sleep(Duration::from_micros(delay_us));
        caller.kill().unwrap();
        caller.wait().unwrap();
        // Let an orphaned helper get as far as it can.
        std::thread::sleep(Duration::from_millis(30));
        cubicle_runtime::remove_leftovers(&spec.id, Some(&spec.sandbox_dir)).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let cg = Cgroup::handle(&spec.id).unwrap();
        assert!(
            !cg.exists(),
            "delay {delay_us}us: cgroup came back: {:?}",
            cg.dirs()
        );
        let left = mounts_mentioning(&spec.sandbox_dir);
        assert!(left.is_empty(), "delay {delay_us}us: {left:?}");
        for sub in ["upper", "work", "ctl", "rootfs"] {
            assert!(
                !spec.sandbox_dir.join(sub).exists(),
                "delay {delay_us}us: {sub} remains"
            );
        }
    }
}

/// With a real Debian template (`CUBICLE_TEST_BASE_ROOTFS=/var/lib/cubicle/templates/base/rootfs`):
/// `sudo` works for uid 1000 (setuid, PAM, setgroups inside the user namespace).
fn base_template_sudo(env: &Env) {
    let Ok(rootfs) = std::env::var("CUBICLE_TEST_BASE_ROOTFS") else {
        println!("    (skipped: set CUBICLE_TEST_BASE_ROOTFS to a built base template rootfs)");
        return;
    };
    let mut spec = env.spec("");
    spec.rootfs = rootfs.into();
    spec.init = vec![
        "/bin/bash".into(),
        "-c".into(),
        "su - user -c 'id -un; sudo -n id -u; sudo -n touch /root/by-sudo && echo sudo-ok; \
         python3 -c \"print(6*7)\"'; echo end"
            .into(),
    ];
    let t = Instant::now();
    let sb = spawn(&spec).unwrap();
    let spawned = t.elapsed();
    assert!(sb.wait_timeout(Duration::from_secs(20)), "{}", env.log(&sb));
    let log = env.log(&sb);
    println!("    base template: spawn {spawned:?}");
    for want in ["user", "0", "sudo-ok", "42", "end"] {
        assert!(
            log.lines().any(|l| l.trim() == want),
            "missing {want:?}: {log}"
        );
    }
    let made = fs::metadata(spec.upper_dir().join("root/by-sudo")).unwrap();
    assert_eq!(made.uid(), spec.uid_base);
    destroy_and_check(sb, &spec);
}

// ---------------------------------------------------------------------------------------

type Test = (&'static str, fn(&Env));

/// A shell (no template: its root an empty directory of its tmpfs) starts its init; a
/// template's root then replaces the shell's under that running init: the template's
/// files, its upper layer and binds, and the shell's /proc (masks included), /dev and /run,
/// and nothing left of the shell's root.
fn a_shell_takes_a_template_root_under_its_running_init(env: &Env) {
    let mut template = env.spec("unused");
    let extra = env.root.join("shell-extra");
    fs::create_dir_all(&extra).unwrap();
    fs::write(extra.join("file"), "bound-after\n").unwrap();
    template.binds.push(BindMount {
        source: extra,
        target: "/opt/data".into(),
        readonly: true,
        idmapped: false,
    });
    let mut shell = template.clone();
    shell.shell = true;
    // The shell's only program: busybox, under /run (which moves to the template's root).
    shell.binds = vec![BindMount {
        source: env.template.join("bin/busybox"),
        target: "/run/bb/busybox".into(),
        readonly: true,
        idmapped: false,
    }];
    shell.init = vec![
        "/run/bb/busybox".into(),
        "sh".into(),
        "-c".into(),
        "bb=/run/bb/busybox; $bb test -e /etc/passwd || echo shell-root-empty; \
         while [ ! -e /attached ]; do $bb sleep 0.02; done; \
         echo root:$($bb cat /attached); $bb head -1 /etc/passwd; \
         $bb test -e /proc/1/ns/pid && echo proc-ok; echo kallsyms:$($bb wc -c < /proc/kallsyms); \
         echo x > /dev/null && echo dev-ok; $bb test -e /run/bb/busybox && echo run-ok; \
         $bb test -e /.cubicle-attach || echo scratch-gone; \
         $bb touch /tmp/t && echo tmp-ok; $bb cat /opt/data/file; echo end"
            .into(),
    ];
    // Not a shell's spec, or another sandbox's: refused before anything happens.
    let sb = spawn(&shell).unwrap_or_else(|e| panic!("spawn shell {}: {e}", shell.id));
    assert!(sb.attach_root(&shell).is_err());
    let mut other = template.clone();
    other.id.push('z');
    assert!(sb.attach_root(&other).is_err());
    assert!(sb.is_alive(), "{}", env.log(&sb));
    assert!(!Path::new(&format!("/proc/{}/root/etc/passwd", sb.pid())).exists());

    // The shell's init looks at its root before the template's is attached (on a busy
    // machine its first command could otherwise run after the attach).
    let t = Instant::now();
    while !env.log(&sb).lines().any(|l| l.trim() == "shell-root-empty") {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the shell's init did not look at its root: {}",
            env.log(&sb)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let marker = template.upper_dir().join("attached");
    fs::write(&marker, "template\n").unwrap();
    chown(&marker, Some(template.uid_base), Some(template.uid_base)).unwrap();
    let timings = sb
        .attach_root(&template)
        .unwrap_or_else(|e| panic!("attach {}: {e}; log: {}", template.id, env.log(&sb)));
    assert!(
        timings.iter().any(|(s, _)| s == "rootfs_ready"),
        "{timings:?}"
    );
    assert!(
        sb.wait_timeout(Duration::from_secs(10)),
        "init did not exit: {}",
        env.log(&sb)
    );
    let log = env.log(&sb);
    for want in [
        "shell-root-empty",
        "root:template",
        "root:x:0:0:root:/root:/bin/sh",
        "proc-ok",
        "kallsyms:0",
        "dev-ok",
        "run-ok",
        "scratch-gone",
        "tmp-ok",
        "bound-after",
        "end",
    ] {
        assert!(
            log.lines().any(|l| l.trim() == want),
            "missing {want:?}: {log}"
        );
    }
    // Nothing of it on the host's side.
    let host = fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!host.contains(&template.id), "{host}");
    sb.destroy().unwrap();
    let _ = fs::remove_dir_all(&template.sandbox_dir);
}

const TESTS: &[Test] = &[
    (
        "uid_zero_inside_maps_to_uid_base",
        uid_zero_inside_maps_to_uid_base,
    ),
    (
        "two_sandboxes_get_distinct_ranges",
        two_sandboxes_get_distinct_ranges,
    ),
    (
        "cgroup_membership_per_hierarchy",
        cgroup_membership_per_hierarchy,
    ),
    (
        "open_files_limit_is_the_specs",
        open_files_limit_is_the_specs,
    ),
    (
        "ps_shows_only_sandbox_processes",
        ps_shows_only_sandbox_processes,
    ),
    ("hostname_and_host_paths", hostname_and_host_paths),
    ("sandboxes_share_one_sysfs", sandboxes_share_one_sysfs),
    (
        "mount_and_privileged_calls_fail",
        mount_and_privileged_calls_fail,
    ),
    (
        "seccomp_denies_dangerous_syscalls",
        seccomp_denies_dangerous_syscalls,
    ),
    ("devices_and_ctl_bind", devices_and_ctl_bind),
    (
        "a_shell_takes_a_template_root_under_its_running_init",
        a_shell_takes_a_template_root_under_its_running_init,
    ),
    (
        "idmapped_binds_at_spawn_and_while_running",
        idmapped_binds_at_spawn_and_while_running,
    ),
    (
        "setuid_works_without_no_new_privs",
        setuid_works_without_no_new_privs,
    ),
    ("fork_bomb_is_contained", fork_bomb_is_contained),
    ("a_forking_sandbox_freezes", a_forking_sandbox_freezes),
    ("memory_limit_oom_kills", memory_limit_oom_kills),
    ("no_oom_without_pressure", no_oom_without_pressure),
    ("adopt_and_reap_after_crash", adopt_and_reap_after_crash),
    ("setup_failure_cleans_up", setup_failure_cleans_up),
    ("a_dead_zygote_is_replaced", a_dead_zygote_is_replaced),
    (
        "sandbox_weighs_as_the_spawning_threads_nice",
        sandbox_weighs_as_the_spawning_threads_nice,
    ),
    (
        "concurrent_cycles_leak_nothing",
        concurrent_cycles_leak_nothing,
    ),
    (
        "caller_killed_leaves_nothing_after_reconcile",
        caller_killed_leaves_nothing_after_reconcile,
    ),
    ("base_template_sudo", base_template_sudo),
];

/// Env var: run as a throwaway "node" that spawns the sandbox of this JSON spec, prints
/// `spawned`, then sleeps (to be killed) — for the crash tests.
const CALLER_ENV: &str = "CUBICLE_RT_TEST_CALLER_SPEC";

fn main() {
    cubicle_runtime::maybe_run_helper();
    if let Ok(json) = std::env::var(CALLER_ENV) {
        let spec: SandboxSpec = serde_json::from_str(&json).unwrap();
        let sb = spawn(&spec).unwrap();
        let zygote = cubicle_runtime::zygote_pid().unwrap();
        println!("spawned {} zygote {zygote}", sb.pid());
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
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
        println!(
            "skipping cubicle-runtime sandbox tests: they need root (namespaces, cgroups, mounts)"
        );
        return;
    }
    // As `cubicle` does: the sandboxes must not inherit the raised limit.
    cubicle_runtime::fd_limit::raise_for_node().unwrap();
    let env = Env::new();
    let selected: Vec<&Test> = TESTS
        .iter()
        .filter(|(n, _)| filters.is_empty() || filters.iter().any(|f| n.contains(f.as_str())))
        .collect();
    println!("running {} sandbox tests", selected.len());
    let mut failed = Vec::new();
    for (name, test) in selected {
        let t = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| test(&env)));
        match r {
            Ok(()) => println!("test {name} ... ok ({:?})", t.elapsed()),
            Err(_) => {
                println!("test {name} ... FAILED");
                failed.push(*name);
            }
        }
    }
    // Leave nothing behind, even after failures.
    let prefix = format!("rtt{}x", std::process::id());
    let _ = cubicle_runtime::reap_orphans(|id| !id.starts_with(&prefix));
    let _ = fs::remove_dir_all(&env.root);
    if failed.is_empty() {
        println!("test result: ok");
    } else {
        println!("test result: FAILED: {failed:?}");
        std::process::exit(1);
    }
}
