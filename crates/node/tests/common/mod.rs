//! What the node's sandbox tests share (`abuse`, `escape`): the static envd, a state dir
//! holding the real `base` template (borrowed read-only from a built copy on this host,
//! or built once), running a command in a sandbox through envd, and the checks that a
//! killed sandbox left nothing behind.
//!
//! Include with `#[path = "../common/mod.rs"] mod common;` (or `mod common;` from a test
//! at the top of `tests/`). Every test binary uses a different part: hence the allow.
#![allow(dead_code)]

pub mod lab;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use cubicle_node::{CreateRequest, DeathReason, Node, ProcessEvent, ProcessSpec, SandboxInfo};

/// State dirs whose built `base` template a test may borrow (read-only).
pub const BASE_CACHES: &[&str] = &["/var/lib/cubicle", "/var/lib/cubicle-e2e", BUILD_CACHE];
/// Where a test builds `base` when no state dir has it (kept: built once per machine).
pub const BUILD_CACHE: &str = "/var/lib/cubicle-test-abuse";

/// Template `name` in `state` (a node's state dir): `tiny`'s files and config with start
/// command `cmd`, run as `start_user` (the template's default when `None`). Returns its
/// config and directory (a test may change the config and write it again).
pub fn derived_template(
    node: &Node,
    state: &Path,
    name: &str,
    cmd: &str,
    start_user: Option<&str>,
) -> anyhow::Result<(cubicle_node::template::TemplateConfig, PathBuf)> {
    let tiny = node.templates().ensure("tiny", false)?;
    let dir = state.join("templates").join(name);
    std::fs::create_dir_all(&dir)?;
    let st = Command::new("cp")
        .arg("-a")
        .arg(&tiny.rootfs)
        .arg(dir.join("rootfs"))
        .status()?;
    anyhow::ensure!(st.success(), "copying tiny's files: {st}");
    let mut tc = tiny.config.clone();
    tc.name = name.into();
    tc.start_command = Some(cmd.into());
    if let Some(u) = start_user {
        tc.start_user = Some(u.into());
    }
    cubicle_node::fsutil::write_json_atomic(&dir.join("template.json"), &tc)?;
    Ok((tc, dir))
}

/// One run per host at a time of the test called `name` (its slots and names are
/// fixed): an abstract Unix socket, released by the kernel when this process exits.
pub fn host_lock(name: &str) -> std::os::unix::net::UnixListener {
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(
        format!("cubicle-{name}-tests").as_bytes(),
    )
    .expect("abstract socket name");
    let mut waited = false;
    loop {
        match std::os::unix::net::UnixListener::bind_addr(&addr) {
            Ok(l) => return l,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                if !waited {
                    println!("{name}: another {name} run is in progress; waiting");
                    waited = true;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("{name} test lock: {e}"),
        }
    }
}

/// The static envd next to the test binary's target dir; built if missing.
pub fn static_envd() -> anyhow::Result<PathBuf> {
    if let Ok(p) = cubicle_node::config::find_envd_binary(None) {
        return Ok(p);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/build-envd.sh");
    eprintln!("building the static cubicle-envd with {}", script.display());
    let st = Command::new("bash").arg(&script).status()?;
    anyhow::ensure!(st.success(), "{} failed: {st}", script.display());
    Ok(cubicle_node::config::find_envd_binary(None)?)
}

/// Give the fresh state dir `state` the `base` template (copied from the operator's
/// cache when there is one, else built there first).
pub async fn prepare_base_template(state: &Path) -> anyhow::Result<()> {
    let _ = cubicle_node::fsutil::remove_tree(state);
    std::fs::create_dir_all(state.join("templates"))?;
    let t = Instant::now();
    let found = BASE_CACHES
        .iter()
        .find_map(|d| one_layer_template(Path::new(d), "base"));
    let cache = match found {
        Some(c) => c,
        None => {
            println!(
                "  no built base template on this host: building it in {BUILD_CACHE} (one to a few minutes, once per machine)"
            );
            let store = cubicle_node::template::TemplateStore::open(Path::new(BUILD_CACHE))?;
            let built = tokio::task::spawn_blocking(move || store.ensure("base", false)).await??;
            println!("  base template built in {:.0}s", t.elapsed().as_secs_f64());
            (built.dir.join("template.json"), built.rootfs)
        }
    };
    let t = Instant::now();
    let how = share_template(&cache, &state.join("templates/base"))?;
    println!(
        "  base template {how} from {} in {:.1}s",
        cache.1.display(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Makes sure the node's store has `base` ready (it was put there by
/// [`prepare_base_template`]).
pub async fn ensure_base(node: &Node) -> anyhow::Result<()> {
    let store = node.templates().clone();
    let t = Instant::now();
    let base = tokio::task::spawn_blocking(move || store.ensure("base", false)).await??;
    println!(
        "  base template ready ({}, {:.1}s)",
        base.config.builder,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// A built one-layer template in the state dir `state`: its config file and its layer
/// (`layers/<id>` for the layered layout, `templates/<name>/rootfs` for the older one).
fn one_layer_template(state: &Path, name: &str) -> Option<(PathBuf, PathBuf)> {
    let dir = state.join("templates").join(name);
    let cfg = dir.join("template.json");
    let text = std::fs::read_to_string(&cfg).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let rootfs = match v.get("layers").and_then(|l| l.as_array()) {
        Some(layers) if layers.len() == 1 => state.join("layers").join(layers[0].as_str()?),
        Some(_) => return None,
        None => dir.join("rootfs"),
    };
    rootfs.is_dir().then_some((cfg, rootfs))
}

/// Put the cached template at `dest` in the older one-directory layout: its config
/// copied (without its layer list), its layer bind-mounted read-only at `rootfs/`
/// (instant; a sandbox's overlay only ever reads its lower layer, and the read-only mount
/// guarantees the operator's copy cannot change). A template built before file
/// capabilities were fitted to what a sandbox can hold needs its own writable copy (the
/// node fits it on first use), as does one whose bind mount fails: a full copy
/// (`cp -a --reflink=auto`, ~10-30 s for the 600 MiB rootfs here). Either way, removing
/// the state dir (`fsutil::remove_tree`) unmounts and deletes it.
fn share_template(cache: &(PathBuf, PathBuf), dest: &Path) -> anyhow::Result<&'static str> {
    let (cfg, layer) = cache;
    let rootfs = dest.join("rootfs");
    std::fs::create_dir_all(&rootfs)?;
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(cfg)?)?;
    let fitted = v["fileCapsFitted"] == serde_json::Value::Bool(true);
    if let Some(o) = v.as_object_mut() {
        o.remove("layers");
    }
    std::fs::write(dest.join("template.json"), serde_json::to_vec_pretty(&v)?)?;
    if fitted && bind_read_only(layer, &rootfs).is_ok() {
        return Ok("bind-mounted read-only");
    }
    std::fs::remove_dir(&rootfs)?;
    let st = Command::new("cp")
        .args(["-a", "--reflink=auto", "-T"])
        .arg(layer)
        .arg(&rootfs)
        .status()?;
    anyhow::ensure!(st.success(), "copying {}: {st}", layer.display());
    Ok("copied")
}

/// Bind `src` on `dst`, then make that mount read-only; verified with statvfs. On any
/// failure nothing stays mounted.
fn bind_read_only(src: &Path, dst: &Path) -> anyhow::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let (s, d) = (
        std::ffi::CString::new(src.as_os_str().as_bytes())?,
        std::ffi::CString::new(dst.as_os_str().as_bytes())?,
    );
    // SAFETY: valid NUL-terminated paths; NULL fstype/data are allowed for binds.
    if unsafe {
        libc::mount(
            s.as_ptr(),
            d.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    } != 0
    {
        return Err(std::io::Error::last_os_error().into());
    }
    let flags = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY;
    // SAFETY: as above; remounts the bind we just made.
    let r = unsafe {
        libc::mount(
            std::ptr::null(),
            d.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        )
    };
    let ro = nix::sys::statvfs::statvfs(dst)
        .is_ok_and(|v| v.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY));
    if r != 0 || !ro {
        let _ = cubicle_node::fsutil::umount_detach(dst);
        anyhow::bail!(
            "could not make the bind mount of {} read-only",
            src.display()
        );
    }
    Ok(())
}

/// Unmount everything under `state` (the shared template's read-only bind, the quota
/// filesystem) and only then delete it. Returns what went wrong, if anything.
pub fn remove_state_dir(state: &Path) -> Option<String> {
    cubicle_node::fsutil::unmount_all_under(state);
    let still = cubicle_node::fsutil::mounts_under(state);
    if !still.is_empty() {
        return Some(format!(
            "still mounted under {}: {still:?}",
            state.display()
        ));
    }
    cubicle_node::fsutil::remove_tree(state)
        .err()
        .map(|e| format!("could not remove {}: {e}", state.display()))
}

/// A `base` sandbox with a 300 s timeout.
pub fn base() -> CreateRequest {
    CreateRequest {
        template: "base".into(),
        timeout: Some(Duration::from_secs(300)),
        ..Default::default()
    }
}

/// What a command printed and how it ended.
pub struct Out {
    pub out: String,
    pub err: String,
    pub code: i32,
}

/// Run `script` under bash through envd as `user` (`None`: the template's default user,
/// `user`), bounded by `limit`.
pub async fn bash(
    node: &Node,
    id: &str,
    user: Option<&str>,
    script: &str,
    limit: Duration,
) -> anyhow::Result<Out> {
    run(node, id, user, "/bin/bash", &["-c", script], limit).await
}

/// Run `cmd args…` through envd as `user`, bounded by `limit`.
pub async fn run(
    node: &Node,
    id: &str,
    user: Option<&str>,
    cmd: &str,
    args: &[&str],
    limit: Duration,
) -> anyhow::Result<Out> {
    let client = node.envd(id)?;
    let spec = ProcessSpec {
        cmd: cmd.into(),
        args: args.iter().map(|a| a.to_string()).collect(),
        user: user.map(String::from),
        ..Default::default()
    };
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let end = tokio::time::timeout(
        limit,
        client.run(&spec, |ev| match ev {
            ProcessEvent::Stdout(b) => out.extend(b),
            ProcessEvent::Stderr(b) => err.extend(b),
            ProcessEvent::Start(_) => {}
        }),
    )
    .await
    .map_err(|_| anyhow::anyhow!("{cmd} {args:?} in {id} did not finish within {limit:?}"))??;
    Ok(Out {
        out: String::from_utf8_lossy(&out).into(),
        err: String::from_utf8_lossy(&err).into(),
        code: end.exit_code,
    })
}

/// The host still forks and execs.
pub fn host_can_fork() -> anyhow::Result<()> {
    let t = Instant::now();
    let st = Command::new("true").status()?;
    anyhow::ensure!(st.success(), "host `true` failed: {st}");
    anyhow::ensure!(
        t.elapsed() < Duration::from_secs(2),
        "host fork+exec took {:?}",
        t.elapsed()
    );
    Ok(())
}

/// The node's slot of a sandbox, from its uid range.
pub fn slot_of(uid_base: u32) -> u32 {
    (uid_base - 200_000) / 65536
}

/// Shell-quote for bash.
pub fn q(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Kill `s` (if still alive), check it is recorded as `want` and that nothing of it is
/// left on the host (`state` is the node's state dir).
pub async fn kill_and_check(
    node: &Node,
    state: &Path,
    s: &SandboxInfo,
    want: DeathReason,
) -> anyhow::Result<SandboxInfo> {
    let t = Instant::now();
    match node.kill(&s.id).await {
        Ok(()) | Err(cubicle_node::Error::SandboxNotFound(_)) => {}
        Err(e) => return Err(e.into()),
    }
    let dead = node.get(&s.id)?;
    anyhow::ensure!(
        dead.state == cubicle_node::SandboxState::Dead && dead.death_reason == Some(want),
        "{}: state {:?}, reason {:?}, want {want}",
        s.id,
        dead.state,
        dead.death_reason
    );
    let left = cubicle_node::traces::leftovers(state, &s.id, Some(slot_of(s.uid_base)), s.pid);
    anyhow::ensure!(left.is_empty(), "sandbox {} left traces: {left:?}", s.id);
    println!(
        "  {} gone ({want}) in {:.0} ms",
        s.id,
        t.elapsed().as_secs_f64() * 1e3
    );
    Ok(dead)
}

/// A `harness = false` test's signature: its context in, its verdict out.
pub type TestFn<C> =
    fn(C) -> std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>>>>;

/// What every sandbox test binary needs before its first test: root, the host `tools`
/// it names (e.g. `/bin/busybox`), the static envd and a multi-threaded runtime. Prints
/// `<suite>: SKIPPED — …` and returns `None` without root or a tool (`needs` says what
/// root is for); exits 1 when there is no static envd (a broken build, not a skip).
/// The command line's non-flag arguments are the name filters.
pub struct Harness {
    /// The suite's name, printed before each verdict line.
    pub suite: &'static str,
    /// The static envd.
    pub envd: PathBuf,
    /// The runtime the tests run on.
    pub rt: tokio::runtime::Runtime,
    /// Substrings of the test names to run (all when empty).
    pub filters: Vec<String>,
}

impl Harness {
    /// See [`Harness`].
    pub fn start(suite: &'static str, needs: &str, tools: &[&str]) -> Option<Harness> {
        cubicle_runtime::maybe_run_helper();
        // The node's warnings (a teardown that failed, a refill that gave up) go to stderr
        // beside the test lines, so that a failure shows its cause; RUST_LOG for more.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            )
            .with_writer(std::io::stderr)
            .try_init();
        if !nix::unistd::geteuid().is_root() {
            println!("{suite}: SKIPPED — needs root ({needs})");
            return None;
        }
        if let Some(t) = tools.iter().find(|t| !Path::new(t).exists()) {
            println!(
                "{suite}: SKIPPED — {t} missing (apt-get install busybox-static curl util-linux)"
            );
            return None;
        }
        let envd = match static_envd() {
            Ok(p) => p,
            Err(e) => {
                println!("{suite}: FAILED — no static cubicle-envd (scripts/build-envd.sh): {e:#}");
                std::process::exit(1);
            }
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        let filters = std::env::args()
            .skip(1)
            .filter(|a| !a.starts_with('-'))
            .collect();
        Some(Harness {
            suite,
            envd,
            rt,
            filters,
        })
    }

    /// Whether the command line selects the test `name`.
    pub fn selects(&self, name: &str) -> bool {
        self.filters.is_empty() || self.filters.iter().any(|f| name.contains(f.as_str()))
    }

    /// Runs the selected `tests` one after the other, each given `ctx` (cloned), then
    /// `after` (a check and clean-up that runs whatever the test did; its error fails a
    /// test that passed); prints a line per test. [`Verdict::finish`] prints the summary.
    pub fn run<C: Clone>(
        &self,
        ctx: C,
        tests: Vec<(&str, TestFn<C>)>,
        after: impl Fn(&tokio::runtime::Runtime) -> anyhow::Result<()>,
    ) -> Verdict {
        let mut v = Verdict {
            suite: self.suite,
            ran: 0,
            failed: 0,
        };
        for (name, f) in tests {
            if !self.selects(name) {
                continue;
            }
            v.ran += 1;
            let t = Instant::now();
            let res = self.rt.block_on(f(ctx.clone()));
            let res = res.and(after(&self.rt));
            match res {
                Ok(()) => println!("test {name} ... ok ({:.1}s)", t.elapsed().as_secs_f64()),
                Err(e) => v.fail(&format!("test {name} ... FAILED: {e:#}")),
            }
        }
        v
    }
}

/// What a suite's tests came to.
pub struct Verdict {
    suite: &'static str,
    ran: usize,
    failed: usize,
}

impl Verdict {
    /// One more failure (a test's, or the suite's own clean-up's), printed.
    pub fn fail(&mut self, line: &str) {
        self.failed += 1;
        println!("{line}");
    }

    /// Prints `<suite>: N passed, M failed` and exits 1 if something failed.
    pub fn finish(self) {
        println!(
            "{}: {} passed, {} failed",
            self.suite,
            self.ran.saturating_sub(self.failed),
            self.failed
        );
        if self.failed > 0 {
            std::process::exit(1);
        }
    }
}
