//! Prints the latency of the store's hot operations on one database: an API-key lookup
//! (the request path's inline read), a placement reserved and released on a node, and a
//! create's store work on a replica (a placement over the whole cluster, its commit).
//!
//! ```sh
//! cargo run -p cubicle-store --example latency -- /tmp/x.db            # SQLite
//! cargo run -p cubicle-store --example latency -- postgres://…/db       # PostgreSQL
//! ```

use std::time::{Duration, Instant};

use cubicle_store::{
    NodeCapacity, NodeRegistration, Resources, SandboxRow, SandboxRowState, Store, now_ms,
};

fn percentiles(mut v: Vec<Duration>) -> String {
    v.sort();
    let at = |q: f64| v[((v.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    format!("p50 {:.0} µs, p99 {:.0} µs", at(0.5), at(0.99))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .ok_or("usage: latency DATABASE (a path or postgres://…)")?;
    let store = Store::open_url(&url)?;
    let team = store.ensure_team("latency")?;
    let key = store.create_api_key(team.id)?;
    let n = 2000;

    let mut reads = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        store.read(|r| r.find_key(&key.plaintext))?;
        reads.push(t.elapsed());
    }
    println!("API key lookup (inline read):  {}", percentiles(reads));

    let node = format!("latency-{}", std::process::id());
    store.register_node(
        &NodeRegistration {
            id: node.clone(),
            address: "http://127.0.0.1:1".into(),
            capacity: NodeCapacity {
                cpu_count: 1 << 20,
                memory_mb: 1 << 40,
                max_sandboxes: 1 << 20,
            },
            templates: vec![],
            pool_state: serde_json::json!({}),
        },
        now_ms(),
        600_000,
    )?;
    let need = Resources {
        cpu_count: 1,
        memory_mb: 1,
    };
    let mut places = Vec::with_capacity(n / 4);
    for i in 0..n / 4 {
        let id = format!("{node}-{i}");
        let t = Instant::now();
        store.reserve_placement(&node, &id, need, now_ms(), 60_000)?;
        store.release_placement(&id)?;
        places.push(t.elapsed());
    }
    println!("placement reserve + release:   {}", percentiles(places));

    // A create's store work on a replica: the placement (PostgreSQL: one call of
    // `cubicle_place`) and its commit with the sandbox's row (one `cubicle_commit`).
    let (mut placed, mut committed) = (Vec::new(), Vec::new());
    for i in 0..n / 4 {
        let id = format!("{node}-c{i}");
        let t = Instant::now();
        let p = store.place_sandbox(&id, "tiny", need, now_ms(), 60_000)?;
        placed.push(t.elapsed());
        let row = SandboxRow {
            id: id.clone(),
            team_id: team.id,
            template_id: "tiny".into(),
            alias: None,
            metadata: Default::default(),
            env_var_names: vec![],
            traffic_access_token: None,
            allow_internet: true,
            cpu_count: 1,
            memory_mb: 1,
            disk_mb: 1,
            started_at: now_ms(),
            end_at: now_ms() + 60_000,
            state: SandboxRowState::Running,
            death_reason: None,
            ended_at: None,
        };
        let t = Instant::now();
        store.commit_placement(&p, &row, now_ms())?;
        committed.push(t.elapsed());
        store.mark_ended(&id, "killed", now_ms())?;
    }
    println!("place_sandbox (whole cluster): {}", percentiles(placed));
    println!("commit_placement + row:        {}", percentiles(committed));
    Ok(())
}
