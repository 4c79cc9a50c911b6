//! Node configuration: where state lives, which envd binary goes into sandboxes, the
//! uid range plan and the defaults.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::{Error, Result};

/// Default state directory.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/cubicle";
/// Default [`NodeConfig::max_sandboxes`] (`--max-sandboxes`).
pub const DEFAULT_MAX_SANDBOXES: u32 = 4096;
/// File name of the agent binary.
pub const ENVD_BIN_NAME: &str = "cubicle-envd";

/// [`NodeConfig::recycle_quota_dirs`] of `cubicle serve` and `cubicle node serve`.
pub const SERVE_RECYCLED_QUOTA_DIRS: usize = 256;

/// How a [`crate::Node`] is set up.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// State directory (`templates/`, `sandboxes/`).
    pub state_dir: PathBuf,
    /// Host path of `cubicle-envd` (static binary).
    pub envd_binary: PathBuf,
    /// First host uid of slot 0's range.
    pub uid_base: u32,
    /// First slot this node allocates (slot `s`: uids `uid_base + s*65536..`, network
    /// address pair `s`). Two nodes on one host must use disjoint slot ranges: opening a
    /// node whose range overlaps another live node's fails (`host_slots.rs`).
    pub first_slot: u32,
    /// Most sandboxes alive at once (slots `first_slot..first_slot+max_sandboxes`).
    pub max_sandboxes: u32,
    /// When the slot range overlaps another node's, use the first free range of the same
    /// size above it instead of failing (tests, which run side by side on one host).
    pub any_free_slots: bool,
    /// When another process uses the state directory, wait for it to finish instead of
    /// failing at once with a message that names it.
    pub wait_for_lock: bool,
    /// Sandbox lifetime when the request names none.
    pub default_timeout: Duration,
    /// How long create waits for envd's `/health`.
    pub envd_ready_timeout: Duration,
    /// Show a progress bar when a built-in template is built on first use.
    pub template_progress: bool,
    /// Max tasks per sandbox.
    pub pids_limit: u32,
    /// Warm pools: template name → sandboxes kept ready (empty: no pools). See `pool/mod.rs`.
    pub pool: std::collections::BTreeMap<String, usize>,
    /// Host memory all pooled sandboxes together may use (measured), in MiB.
    pub pool_memory_mb: u64,
    /// Cold creates (and pool refills) in progress at once; more wait their turn (FIFO).
    pub create_concurrency: usize,
    /// While claims overlap (a burst of creates), the pool's refill starts nothing for
    /// at most this long, unless a pool ran dry (`pool/mod.rs`).
    pub refill_burst_hold: Duration,
    /// `kill` answers once the sandbox's processes are killed and its death recorded;
    /// the teardown (cgroups, network, quota directory, slot) finishes in the background
    /// (the sandbox shows as `dying` meanwhile). Off: `kill` returns when all is gone.
    pub async_teardown: bool,
    /// With `async_teardown`: while a pool is below its target (the refill is making
    /// sandboxes), a killed sandbox's teardown waits for at most this long, so that the
    /// refill has the CPU first (`Pool::yield_to_refill`). Zero: teardowns start at once.
    pub teardown_yield: Duration,
    /// btrfs quota storage: emptied sandbox directories kept for the next creates instead
    /// of dropped (each drop commits a transaction on kernels 6.10+; see the runtime's
    /// `storage/recycle.rs`). 0: none.
    pub recycle_quota_dirs: usize,
    /// Sandbox networking: the egress layer's ports, upstream DNS, limits.
    pub network: NetworkOptions,
}

/// How sandboxes reach the network (see `docs/network.md`).
#[derive(Debug, Clone)]
pub struct NetworkOptions {
    /// Port of the node's DNS resolver (every sandbox query is redirected to it); 0: any
    /// free port.
    pub dns_port: u16,
    /// Port of the node's egress proxy; 0: any free port.
    pub proxy_port: u16,
    /// Upstream DNS servers for sandboxes that name none (empty: the host's
    /// `/etc/resolv.conf`).
    pub upstream_dns: Vec<std::net::Ipv4Addr>,
    /// Extra CA certificates (a PEM file) the egress proxy trusts, besides the system's,
    /// when it verifies the destinations of connections it intercepts (header rules).
    pub upstream_ca: Option<std::path::PathBuf>,
    /// Per-sandbox connection, connection-rate and bandwidth limits.
    pub limits: cubicle_runtime::network::SandboxLimits,
    /// Let sandboxes open outbound SMTP (port 25).
    pub allow_smtp: bool,
    /// A slot (and so a sandbox address) freed less than this long ago is not handed
    /// out again while another slot is free.
    pub address_quarantine: Duration,
}

impl Default for NetworkOptions {
    fn default() -> Self {
        let n = cubicle_runtime::network::NetworkConfig::default();
        NetworkOptions {
            dns_port: 0,
            proxy_port: 0,
            upstream_dns: Vec::new(),
            upstream_ca: None,
            limits: n.limits,
            allow_smtp: n.allow_smtp,
            address_quarantine: Duration::from_secs(60),
        }
    }
}

impl NodeConfig {
    /// Defaults for `state_dir` and the given envd binary (see [`find_envd_binary`]).
    pub fn new(state_dir: impl Into<PathBuf>, envd_binary: impl Into<PathBuf>) -> Self {
        NodeConfig {
            state_dir: state_dir.into(),
            envd_binary: envd_binary.into(),
            uid_base: 200_000,
            first_slot: 0,
            max_sandboxes: DEFAULT_MAX_SANDBOXES,
            any_free_slots: false,
            wait_for_lock: false,
            default_timeout: Duration::from_secs(300),
            envd_ready_timeout: Duration::from_secs(10),
            template_progress: false,
            pids_limit: 1024,
            pool: Default::default(),
            pool_memory_mb: 1024,
            create_concurrency: std::thread::available_parallelism()
                .map(|n| n.get() * 2)
                .unwrap_or(4)
                .max(4),
            refill_burst_hold: Duration::from_millis(250),
            async_teardown: false,
            teardown_yield: Duration::from_secs(2),
            recycle_quota_dirs: 0,
            network: NetworkOptions::default(),
        }
    }
}

/// `$CUBICLE_STATE_DIR`, else `/var/lib/cubicle`.
pub fn default_state_dir() -> PathBuf {
    std::env::var_os("CUBICLE_STATE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIR))
}

/// Find `cubicle-envd`: the explicit path, else `$CUBICLE_ENVD_BIN`, else next to the
/// running executable (also its parent dir, for test binaries in `target/*/deps`, and
/// the static-target dir `target/x86_64-unknown-linux-gnu/<profile>` of a cargo build).
pub fn find_envd_binary(explicit: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(p) = explicit.or_else(|| std::env::var_os("CUBICLE_ENVD_BIN").map(PathBuf::from)) {
        return if p.is_file() {
            // Absolute: it is bind-mounted into every sandbox, long after a relative
            // path's working directory stopped meaning anything.
            std::fs::canonicalize(&p).map_err(|e| Error::io("canonicalize", &p, e))
        } else {
            Err(Error::InvalidRequest(format!(
                "envd binary {} does not exist",
                p.display()
            )))
        };
    }
    let exe = std::env::current_exe().map_err(|e| Error::io("current_exe", "/proc/self/exe", e))?;
    let candidates = envd_candidates(&exe);
    // A dynamically linked envd cannot run inside a rootfs without the host's libc.
    candidates.iter().find(|p| p.is_file() && is_static_elf(p)).cloned().ok_or_else(|| {
        Error::InvalidRequest(format!(
            "cannot find a statically linked {ENVD_BIN_NAME} (looked in {}); build it (cargo build -p cubicle-envd --target x86_64-unknown-linux-gnu) or pass --envd-binary / CUBICLE_ENVD_BIN",
            candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        ))
    })
}

fn envd_candidates(exe: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dir = exe.parent().map(Path::to_path_buf);
    // exe dir, then up to two parents (target/debug/deps/x -> target/debug -> target)
    for _ in 0..3 {
        let Some(d) = dir else { break };
        if let (Some(profile), Some(target)) = (d.file_name(), d.parent()) {
            out.push(
                target
                    .join("x86_64-unknown-linux-gnu")
                    .join(profile)
                    .join(ENVD_BIN_NAME),
            );
        }
        out.push(d.join(ENVD_BIN_NAME));
        dir = d.parent().map(Path::to_path_buf);
    }
    out
}

pub use crate::fsutil::is_static_elf;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_explicit_relative_path_becomes_absolute() {
        // The test runs in the crate's directory, which holds Cargo.toml.
        let p = find_envd_binary(Some(PathBuf::from("Cargo.toml"))).unwrap();
        assert!(p.is_absolute(), "{}", p.display());
        assert!(p.ends_with("crates/node/Cargo.toml"), "{}", p.display());
        assert!(find_envd_binary(Some(PathBuf::from("no-such-envd"))).is_err());
    }

    #[test]
    fn candidates_cover_cargo_layouts() {
        let c = envd_candidates(Path::new("/w/target/debug/deps/node-abc"));
        assert!(c.contains(&PathBuf::from("/w/target/debug/cubicle-envd")));
        assert!(c.contains(&PathBuf::from(
            "/w/target/x86_64-unknown-linux-gnu/debug/cubicle-envd"
        )));
        let c = envd_candidates(Path::new("/usr/local/bin/cubicle"));
        assert!(c.contains(&PathBuf::from("/usr/local/bin/cubicle-envd")));
    }

    #[test]
    fn detects_static_binaries() {
        // /bin/busybox from busybox-static is static; /bin/ls is dynamic.
        if Path::new("/bin/busybox").exists() {
            assert!(is_static_elf(Path::new("/bin/busybox")));
        }
        assert!(!is_static_elf(Path::new("/bin/ls")));
        assert!(!is_static_elf(Path::new("/etc/hostname")));
    }
}
