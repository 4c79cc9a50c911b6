//! The standing escape suite (issue 10): every known way out of a sandbox, tried from
//! inside a real one — the `base` template (Debian 12), the real static `cubicle-envd` as
//! PID 1, the attacker as root of the sandbox — each asserting that the attack was
//! contained AND that the host is unchanged afterwards.
//!
//! - `attacks/`: one attack per file, listed in `attacks/mod.rs` (how to add one is
//!   written there). An attack creates its sandboxes, attacks, asserts containment and
//!   kills them (checking that nothing of them is left).
//! - `kit.rs`: what attacks use (run bash, python3 or a static C program as root or
//!   `user`, parse results).
//! - `host.rs`: the host snapshot compared before and after every attack.
//!
//! State: a private state dir (`/tmp/cbescape-<pid>`) holding the `base` template of
//! this host (see `../common/mod.rs`), slots 4700..4716 (no other test uses them). One
//! run per host at a time (an abstract-socket lock).
//!
//! Needs root. Run: `cargo test -p cubicle-node --test escape [-- FILTER…]`; on a shared
//! machine inside a private network namespace:
//! `unshare --net bash -c 'ip link set lo up; cargo test -p cubicle-node --test escape'`.
//! `harness = false`: main() first hands over to the runtime's sandbox helper.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../common/mod.rs"]
mod common;

mod attacks;
mod host;
mod kit;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cubicle_node::{Node, NodeConfig};

use host::HostSnapshot;
use kit::Ctx;

const FIRST_SLOT: u32 = 4700;
const MAX_SANDBOXES: u32 = 16;

fn main() {
    let Some(h) = common::Harness::start("escape", "user namespaces, cgroups, mounts, netns", &[])
    else {
        return;
    };
    let selected: Vec<&kit::Attack> = attacks::ALL.iter().filter(|a| h.selects(a.name)).collect();
    if selected.is_empty() {
        println!("escape: 0 attacks match {:?}", h.filters);
        return;
    }
    let common::Harness { envd, rt, .. } = h;
    let _lock = common::host_lock("escape");
    // A marker left by an earlier, escaped run would hide this run's escape.
    let _ = std::fs::remove_file(host::MARKER);
    let state = PathBuf::from(format!("/tmp/cbescape-{}", std::process::id()));
    let ctx = match rt.block_on(setup(&envd, &state)) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            println!("escape: FAILED — setup: {e:#}");
            let _ = common::remove_state_dir(&state);
            std::process::exit(1);
        }
    };
    let mut failed = 0;
    for attack in &selected {
        let t = Instant::now();
        rt.block_on(shells_ready(&ctx));
        let before = HostSnapshot::take(&state, &envd, ctx.shells > 0);
        let mut res = rt.block_on((attack.run)(ctx.clone()));
        // Whatever happened, the attack's sandboxes must be gone before the next one.
        let left = ctx.node.list();
        if !left.is_empty() {
            rt.block_on(ctx.node.kill_all());
            if res.is_ok() {
                res = Err(anyhow::anyhow!(
                    "sandboxes left running: {:?}",
                    left.iter().map(|i| &i.id).collect::<Vec<_>>()
                ));
            }
        }
        rt.block_on(shells_ready(&ctx));
        let changed = before.diff(&HostSnapshot::take(&state, &envd, ctx.shells > 0));
        if res.is_ok() && !changed.is_empty() {
            res = Err(anyhow::anyhow!(
                "the host changed:\n    {}",
                changed.join("\n    ")
            ));
        }
        if res.is_ok()
            && let Err(e) = common::host_can_fork()
        {
            res = Err(e);
        }
        match res {
            Ok(()) => println!(
                "attack {} ... contained ({:.1}s)",
                attack.name,
                t.elapsed().as_secs_f64()
            ),
            Err(e) => {
                failed += 1;
                println!(
                    "attack {} ... ESCAPED or FAILED: {e:#}\n  ({})",
                    attack.name, attack.about
                );
            }
        }
    }
    if ctx.shells > 0 {
        // The pass is about sandboxes that were shells: make sure they were.
        let claims = ctx.node.pool_stats().claims;
        println!("escape: {claims} of the attacks' sandboxes were shells");
        if claims == 0 {
            println!("escape: FAILED — no sandbox was made from a shell");
            failed += 1;
        }
    }
    ctx.node.close();
    drop(ctx);
    rt.shutdown_timeout(Duration::from_secs(2));
    if let Some(e) = common::remove_state_dir(&state) {
        println!("escape: {e}");
        failed += 1;
    }
    let _ = std::fs::remove_file(host::MARKER);
    println!(
        "escape: {} contained, {failed} failed",
        selected.len() - failed
    );
    if failed > 0 {
        std::process::exit(1);
    }
}

/// With shells (`CUBICLE_ESCAPE_SHELLS`), waits (up to a minute) until all are ready
/// again and no teardown is under way: the host is at rest for its snapshot.
async fn shells_ready(ctx: &Ctx) {
    let t = Instant::now();
    while ctx.shells > 0 && t.elapsed() < Duration::from_secs(60) {
        let st = ctx.node.pool_stats();
        let ready = st.ready.get(cubicle_node::SHELL_POOL).copied().unwrap_or(0);
        if ready >= ctx.shells && st.teardowns == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A node on a fresh state dir holding the `base` template, with `CUBICLE_ESCAPE_SHELLS`
/// shells if set: the suite then attacks sandboxes that were shells.
async fn setup(envd: &Path, state: &Path) -> anyhow::Result<Ctx> {
    common::prepare_base_template(state).await?;
    let shells: usize = match std::env::var("CUBICLE_ESCAPE_SHELLS") {
        Ok(v) => v.parse()?,
        Err(_) => 0,
    };
    let mut cfg = NodeConfig::new(state, envd);
    if shells > 0 {
        cfg.pool.insert(cubicle_node::SHELL_POOL.into(), shells);
    }
    cfg.first_slot = FIRST_SLOT;
    cfg.max_sandboxes = MAX_SANDBOXES;
    cfg.any_free_slots = true;
    // As `cubicle serve` runs: dead sandboxes' directories are emptied and reused.
    cfg.recycle_quota_dirs = cubicle_node::config::SERVE_RECYCLED_QUOTA_DIRS;
    let node = Node::open(cfg).await?;
    common::ensure_base(&node).await?;
    Ok(Ctx {
        node,
        state: state.to_path_buf(),
        bin: state.join("escape-bin"),
        shells,
    })
}
