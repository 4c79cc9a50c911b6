//! Test helper: the same test body against both engines. [`each_backend`] runs it on a
//! fresh in-memory SQLite store, then on a fresh PostgreSQL database.
//!
//! The PostgreSQL server: `CUBICLE_TEST_DATABASE_URL` (a maintenance URL of a server to
//! create databases in), else a private cluster this test process starts once with
//! `scripts/pg-test-cluster.sh start --owner <pid>` (≈ 1–2 s; the script's watcher stops
//! and deletes it when the process exits). Without PostgreSQL on the machine the
//! PostgreSQL half is skipped with a message — unless `CUBICLE_REQUIRE_POSTGRES` is set
//! (scripts/test.sh sets it, so CI never skips it), where that fails the test.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::Store;
use crate::postgres::PgPool;

/// The maintenance URL of the test server, or `None` when there is none (and none is
/// required).
fn server() -> Option<&'static str> {
    static SERVER: OnceLock<Option<String>> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            if let Ok(url) = std::env::var("CUBICLE_TEST_DATABASE_URL") {
                return Some(url);
            }
            let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/pg-test-cluster.sh");
            let out = std::process::Command::new("bash")
                .args([script, "start", "--owner", &std::process::id().to_string()])
                .stderr(std::process::Stdio::inherit())
                .output()
                .expect("running scripts/pg-test-cluster.sh");
            let required = std::env::var_os("CUBICLE_REQUIRE_POSTGRES").is_some();
            if out.status.code() == Some(3) && !required {
                eprintln!(
                    "PostgreSQL is not installed: the PostgreSQL half of the store tests is SKIPPED \
                     (apt-get install postgresql, or set CUBICLE_TEST_DATABASE_URL)"
                );
                return None;
            }
            assert!(
                out.status.success(),
                "starting a private PostgreSQL cluster failed ({}); CUBICLE_REQUIRE_POSTGRES={}",
                out.status,
                required
            );
            let stdout = String::from_utf8_lossy(&out.stdout);
            let url = stdout
                .lines()
                .find_map(|l| l.strip_prefix("url="))
                .expect("pg-test-cluster.sh printed no url=");
            Some(url.to_string())
        })
        .as_deref()
}

/// URL of a new, empty database on the test server (`None`: no server, see above).
pub(crate) fn fresh_database_url() -> Option<String> {
    static N: AtomicU32 = AtomicU32::new(0);
    let server = server()?;
    let name = format!(
        "cubicle_test_{}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        rand::random::<u32>()
    );
    let admin = PgPool::connect(server).expect("connecting to the test PostgreSQL server");
    admin
        .with(|c| c.batch(&format!("CREATE DATABASE {name}")))
        .expect("CREATE DATABASE");
    let (base, _) = server
        .rsplit_once('/')
        .expect("the server URL names a database");
    Some(format!("{base}/{name}"))
}

/// A fresh store on a new PostgreSQL database, if there is a server.
pub(crate) fn postgres_store() -> Option<Store> {
    fresh_database_url().map(|url| Store::open_url(&url).expect("opening the test database"))
}

/// Runs `test` on a fresh SQLite store, then on a fresh PostgreSQL one.
pub(crate) fn each_backend(test: impl Fn(&Store)) {
    eprintln!("--- on SQLite");
    test(&Store::open_in_memory().expect("in-memory store"));
    if let Some(pg) = postgres_store() {
        eprintln!("--- on PostgreSQL");
        test(&pg);
    }
}

/// Runs `test` with a function that opens one more handle (another replica, another
/// process) on the same fresh database: a SQLite file, then a PostgreSQL database.
pub(crate) fn each_shared_backend(test: impl Fn(&dyn Fn() -> Store)) {
    eprintln!("--- on SQLite (a file, several connections)");
    let dir = std::env::temp_dir().join(format!(
        "cubicle-store-shared-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("cubicle.db");
    test(&|| Store::open(&path).expect("opening the SQLite file"));
    std::fs::remove_dir_all(&dir).expect("removing the temp dir");
    if let Some(url) = fresh_database_url() {
        eprintln!("--- on PostgreSQL (several pools)");
        test(&|| Store::open_url(&url).expect("opening the test database"));
    }
}
