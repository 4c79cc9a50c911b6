//! cubicle-store: the control plane's durable metadata, in one SQLite file
//! (`<state>/cubicle.db`, WAL mode, so `cubicle apikey …` can use it while the server runs)
//! or in PostgreSQL (`postgres://…`: a cluster's shared state, docs/cluster.md).
//!
//! What it holds: teams, API keys (only their SHA-256; the plaintext is shown once),
//! sandbox records (owner team, template, metadata, tokens needed to route, limits,
//! timestamps, state and death reason), create idempotency keys, volume records (owner,
//! name, size), secrets (name, metadata, version, and the value sealed by the control
//! plane: encrypted, never stored in clear), sandbox lifecycle events, the teams'
//! webhooks (with the secrets that sign their deliveries), and the cluster's
//! coordination: nodes with their leases and fencing epochs, which node owns each
//! sandbox, placements reserved on a node ([`Store::register_node`] and the rest of
//! `nodes.rs`). Environment-variable *values* are never stored (they may be secrets):
//! only their names.
//!
//! Both engines share everything but their migrations: each query is written once in
//! SQL both accept, and `db.rs` runs it on the engine at hand ([`Store::open_url`]
//! picks it). Every store test runs on both (`testdb.rs`).
//!
//! Every method blocks (database I/O). Async callers use [`Store::call`], which runs the
//! closure on tokio's blocking pool, never on a runtime thread; [`Store::read`] is for
//! short point reads right on the calling thread (safe on a runtime thread with either
//! engine).
//!
//! ```no_run
//! # fn demo() -> cubicle_store::Result<()> {
//! let store = cubicle_store::Store::open("/var/lib/cubicle/cubicle.db".as_ref())?;
//! let team = store.ensure_team("admin")?;
//! let key = store.create_api_key(team.id)?; // shown once; stored hashed
//! assert_eq!(store.authenticate(&key.plaintext)?.map(|t| t.id), Some(team.id));
//! # Ok(()) }
//! ```

#![forbid(unsafe_code)]

mod cluster_templates;
mod db;
mod events;
mod idempotency;
mod keys;
mod nodes;
mod pg_tls;
mod postgres;
mod sandboxes;
mod schema;
mod secrets;
#[cfg(test)]
pub(crate) mod testdb;
mod volumes;
mod webhooks;

use std::path::Path;
use std::sync::{Arc, Mutex};

pub use cluster_templates::ClusterTemplate;
pub use db::Dialect;
use db::{Conn, Isolation};
pub use events::{EventQuery, EventRow};
pub use idempotency::{IDEMPOTENCY_TTL_MS, IdempotencyClaim};
pub use keys::{ApiKey, ApiKeyInfo, FoundKey, KEY_PREFIX, Team, hash_key, is_well_formed_key};
pub use nodes::{
    LostNode, MovedFrom, NODE_LOST_REASON, NodeCapacity, NodeLease, NodeRegistration, NodeRow,
    NodeState, Placement, Resources, SandboxOwner,
};
pub use sandboxes::{SandboxRow, SandboxRowState};
pub use schema::SCHEMA_VERSION;
pub use secrets::SecretRow;
pub use volumes::VolumeRow;
pub use webhooks::WebhookRow;

/// The store's single error type.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// SQLite failed.
    #[error("database: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// PostgreSQL failed (or could not be reached).
    #[error("database: {}", postgres_message(.0))]
    Postgres(#[from] tokio_postgres::Error),
    /// A column did not hold what the code expected (a schema the code does not match).
    #[error("database record: {0}")]
    Column(String),
    /// A JSON column could not be encoded or decoded.
    #[error("database record: {0}")]
    Json(#[from] serde_json::Error),
    /// The database was written by a newer Cubicle.
    #[error(
        "database schema version {found} is newer than this binary supports ({supported}); upgrade cubicle"
    )]
    SchemaTooNew {
        /// Version in the file.
        found: i64,
        /// Newest version this binary knows.
        supported: i64,
    },
    /// Something the caller asked for does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The request conflicts with the stored state.
    #[error("{0}")]
    Conflict(String),
    /// The request is malformed.
    #[error("{0}")]
    Invalid(String),
    /// A node acted with a lease epoch that is no longer current: it was declared lost
    /// (or registered again) since. It must stop acting on what it owned and register
    /// anew.
    #[error(
        "node '{node}' acted with lease epoch {epoch}, which is no longer current (declared lost or re-registered): register again"
    )]
    Fenced {
        /// The node.
        node: String,
        /// The stale epoch it presented.
        epoch: i64,
    },
    /// No node has room (or the asked one has none) for a placement.
    #[error("{0}")]
    NoCapacity(String),
    /// The blocking task running the query failed.
    #[error("database task: {0}")]
    Task(String),
    /// The database file could not be created or its permissions set.
    #[error("{what} {}: {source}", path.display())]
    File {
        /// What was being done.
        what: &'static str,
        /// Which file.
        path: std::path::PathBuf,
        /// Why it failed.
        source: std::io::Error,
    },
}

/// PostgreSQL's own message (with its detail) rather than tokio-postgres' generic "db
/// error".
fn postgres_message(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => match db.detail() {
            Some(d) => format!("{} ({d})", db.message()),
            None => db.message().to_string(),
        },
        None => {
            // tokio-postgres' own text is generic ("error performing TLS handshake"):
            // the reason is in its sources.
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(e);
            while let Some(s) = src {
                msg.push_str(": ");
                msg.push_str(&s.to_string());
                src = s.source();
            }
            if msg.contains("TLS handshake") {
                msg.push_str(
                    " (the server's certificate must chain to the URL's sslrootcert and, with sslmode=verify-full, name its host)",
                );
            }
            msg
        }
    }
}

impl Error {
    /// A unique or primary key was already taken.
    pub(crate) fn is_unique_violation(&self) -> bool {
        match self {
            Error::Sqlite(rusqlite::Error::SqliteFailure(e, _)) => {
                e.code == rusqlite::ErrorCode::ConstraintViolation
            }
            Error::Postgres(e) => {
                e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION)
            }
            _ => false,
        }
    }

    /// The transaction lost a race (serialization failure, deadlock) and may simply be
    /// run again.
    pub(crate) fn is_retryable(&self) -> bool {
        use tokio_postgres::error::SqlState;
        match self {
            Error::Postgres(e) => matches!(
                e.code(),
                Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE || *c == SqlState::T_R_DEADLOCK_DETECTED
            ),
            _ => false,
        }
    }
}

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Where the data lives.
enum Backend {
    /// One connection behind a mutex (SQLite serialises writers anyway, and every
    /// statement here is short), plus a read-only one for [`Store::read`] (the same one
    /// for an in-memory database, which a second connection could not see).
    Sqlite {
        writer: Arc<Mutex<rusqlite::Connection>>,
        reader: Arc<Mutex<rusqlite::Connection>>,
    },
    /// A pool of connections to a PostgreSQL server.
    Postgres(Arc<postgres::PgPool>),
}

/// SQLite's own page cache of the writer connection, in KiB (`PRAGMA cache_size` takes a negative
/// number for KiB; SQLite's default is 2 MiB). A create inserts into indexes keyed by
/// random ids (the sandbox's, its event's), so it touches leaf pages all over them; with
/// the default cache most of those come from the OS page cache through `pread`, and a
/// page the kernel dropped meanwhile (memory pressure, or proactive reclaim of pages idle
/// for a minute, which the development VM runs) is a disk read made under the writer's
/// lock, on a disk the sandboxes keep busy: one such read held every create of a burst
/// for 174 ms (`docs/bench.md`, round 14). Pages in this cache are the process's own
/// memory, allocated as they are first read, so a small database costs only its size.
/// Only the writer gets it: a WAL reader drops its whole cache whenever another
/// connection committed since its last read, which for the read-only connection is
/// nearly always.
const PAGE_CACHE_KIB: i64 = 64 * 1024;

/// Index scans that read every page of the indexes keyed by random ids, the ones a
/// create and a kill write to anywhere (see [`PAGE_CACHE_KIB`]).
const RANDOM_KEY_INDEXES: [&str; 3] = [
    "SELECT count(*) FROM sandboxes WHERE id > ''",
    "SELECT count(*) FROM sandbox_events WHERE id > ''",
    "SELECT count(*) FROM sandbox_events WHERE sandbox_id > ''",
];

/// Reads the indexes keyed by random ids into the writer's page cache once, at open, so
/// that no create waits for one of their pages to come from disk while it holds the
/// writer (milliseconds for a young database; about a second for 100,000 sandboxes'
/// records on a cold disk). Best effort: a failure only leaves the cache cold.
fn warm_writer_cache(conn: &rusqlite::Connection) {
    let t0 = std::time::Instant::now();
    for q in RANDOM_KEY_INDEXES {
        if let Err(e) = conn.query_row(q, [], |r| r.get::<_, i64>(0)) {
            tracing::debug!("warming the database's page cache ({q}): {e}");
        }
    }
    tracing::debug!(
        ms = t0.elapsed().as_millis() as u64,
        "database page cache warmed"
    );
}

/// How often [`spawn_checkpointer`] copies the WAL into the database file.
const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

/// Checkpoints the WAL of the SQLite file at `path` from a connection and thread of its
/// own, every [`CHECKPOINT_EVERY`], until the store is dropped. SQLite's automatic
/// checkpoint runs inside a commit, with its two `fsync`s, while the writer connection's
/// lock is held: every write queued behind it waited, and on a host whose disk is busy
/// (sandboxes' files on the same filesystem) one such `fsync` took 100–200 ms, which a
/// burst of creates saw all at once. A passive checkpoint on another connection takes
/// no lock a writer needs (WAL mode), so commits stay free of `fsync` (synchronous
/// NORMAL: still durable across a crash of the process).
fn spawn_checkpointer(path: &Path, backend: std::sync::Weak<Backend>) -> Result<()> {
    let conn = rusqlite::Connection::open(path)?;
    conn.busy_timeout(std::time::Duration::from_secs(1))?;
    std::thread::Builder::new()
        .name("cubicle-sqlite-ckpt".into())
        .spawn(move || {
            loop {
                std::thread::sleep(CHECKPOINT_EVERY);
                if backend.strong_count() == 0 {
                    return;
                }
                if let Err(e) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
                    tracing::debug!("checkpointing the database's WAL: {e}");
                }
            }
        })
        .map_err(|e| Error::Invalid(format!("starting the checkpoint thread: {e}")))?;
    Ok(())
}

/// A handle on the database. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    backend: Arc<Backend>,
    /// This handle is [`Store::read`]'s view (SQLite: the read-only connection).
    read_view: bool,
}

impl Store {
    /// Open the database `url` names: `postgres://…` / `postgresql://…` (a PostgreSQL
    /// server, e.g. a cluster's shared state), `sqlite://PATH` or a plain path (a SQLite
    /// file, as [`Store::open`]). Migrations are applied either way.
    pub fn open_url(url: &str) -> Result<Store> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Self::open_postgres(url)
        } else {
            let path = url.strip_prefix("sqlite://").unwrap_or(url);
            if path.is_empty() || path.contains("://") {
                return Err(Error::Invalid(format!(
                    "database '{url}': give postgres://USER@HOST/DATABASE, sqlite://PATH or a file path"
                )));
            }
            Self::open(Path::new(path))
        }
    }

    /// Open (creating if needed) the SQLite database at `path`, switch it to WAL mode
    /// and apply pending migrations.
    pub fn open(path: &Path) -> Result<Store> {
        restrict_to_owner(path)?;
        let conn = rusqlite::Connection::open(path)?;
        let writer = Self::setup_sqlite(conn)?;
        warm_writer_cache(&writer);
        // Its commits never checkpoint: see `spawn_checkpointer`.
        writer.pragma_update(None, "wal_autocheckpoint", 0)?;
        // After setup: the file exists and is in WAL mode, so this reader never blocks
        // on the writer, nor the writer on it.
        let reader = rusqlite::Connection::open_with_flags(
            path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        reader.busy_timeout(std::time::Duration::from_secs(1))?;
        let backend = Arc::new(Backend::Sqlite {
            writer: Arc::new(Mutex::new(writer)),
            reader: Arc::new(Mutex::new(reader)),
        });
        spawn_checkpointer(path, Arc::downgrade(&backend))?;
        Ok(Store {
            backend,
            read_view: false,
        })
    }

    /// A private in-memory SQLite database (tests). Its one connection serves reads
    /// too (a second connection could not see it).
    pub fn open_in_memory() -> Result<Store> {
        let conn = Arc::new(Mutex::new(Self::setup_sqlite(
            rusqlite::Connection::open_in_memory()?,
        )?));
        Ok(Store {
            backend: Arc::new(Backend::Sqlite {
                writer: conn.clone(),
                reader: conn,
            }),
            read_view: false,
        })
    }

    /// Connect to PostgreSQL at `url` and apply pending migrations (under an advisory
    /// lock, so replicas starting together migrate once).
    pub fn open_postgres(url: &str) -> Result<Store> {
        let pool = postgres::PgPool::connect(url)?;
        let store = Store {
            backend: Arc::new(Backend::Postgres(pool)),
            read_view: false,
        };
        store.with_conn(schema::migrate)?;
        Ok(store)
    }

    fn setup_sqlite(conn: rusqlite::Connection) -> Result<rusqlite::Connection> {
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        // WAL: readers never block the writer, and a second process (the CLI) can work
        // on the file while the server runs. NORMAL sync is durable across app crashes.
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "cache_size", -PAGE_CACHE_KIB)?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        // Deleted rows (revoked keys, ended sandboxes' tokens) are overwritten, not left
        // in free pages.
        conn.pragma_update(None, "secure_delete", "ON")?;
        schema::migrate(&mut Conn::Sqlite(&conn))?;
        Ok(conn)
    }

    /// Which engine this store uses.
    pub fn dialect(&self) -> Dialect {
        match &*self.backend {
            Backend::Sqlite { .. } => Dialect::Sqlite,
            Backend::Postgres(_) => Dialect::Postgres,
        }
    }

    /// Runs `f` with a connection (SQLite: the writer or, in a read view, the reader;
    /// PostgreSQL: one of the pool).
    pub(crate) fn with_conn<T>(&self, f: impl FnOnce(&mut Conn<'_>) -> Result<T>) -> Result<T> {
        match &*self.backend {
            Backend::Sqlite { writer, reader } => {
                let guard = if self.read_view {
                    reader.lock()
                } else {
                    writer.lock()
                }
                .unwrap_or_else(|p| p.into_inner());
                f(&mut Conn::Sqlite(&guard))
            }
            Backend::Postgres(pool) => pool.with(|c| f(&mut Conn::Postgres(c))),
        }
    }

    /// Runs `f` inside a transaction (see [`Conn::transaction`]).
    pub(crate) fn transaction<T>(&self, f: impl FnMut(&mut Conn<'_>) -> Result<T>) -> Result<T> {
        self.with_conn(|c| c.transaction(Isolation::ReadCommitted, f))
    }

    /// Run `f` on the blocking pool (for async callers).
    pub async fn call<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Store) -> Result<T> + Send + 'static,
    {
        let store = self.clone();
        tokio::task::spawn_blocking(move || f(&store))
            .await
            .map_err(|e| Error::Task(e.to_string()))?
    }

    /// Run the read-only `f` right here: for point reads on the request path (an API
    /// key, one sandbox row), where a hop to the blocking pool costs more than the query.
    /// SQLite: on the read connection (WAL mode: a read never waits for a writer; writes
    /// through the view `f` gets fail, the connection is read-only). PostgreSQL: on a
    /// pooled connection, waiting on this thread for one round trip.
    pub fn read<T>(&self, f: impl FnOnce(&Store) -> Result<T>) -> Result<T> {
        let view = Store {
            backend: self.backend.clone(),
            read_view: true,
        };
        f(&view)
    }

    /// Schema version of the open database.
    pub fn schema_version(&self) -> Result<i64> {
        self.with_conn(schema::current_version)
    }
}

/// Makes the database and its WAL and shared-memory files readable by their owner only
/// (0600): they hold API-key hashes and traffic tokens. Creates the database file with
/// that mode when it is missing; SQLite gives the `-wal` and `-shm` files it creates the
/// database file's mode.
fn restrict_to_owner(db: &Path) -> Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let file_err = |what, path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::File { what, path, source }
    };
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(db)
        .map_err(file_err("creating", db))?;
    for suffix in ["", "-wal", "-shm"] {
        let mut name = db.as_os_str().to_owned();
        name.push(suffix);
        let p = Path::new(&name);
        match std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600)) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !suffix.is_empty() => {}
            r => r.map_err(file_err("chmod 0600", p))?,
        }
    }
    Ok(())
}

/// Unix time in milliseconds.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_apply_once_and_survive_reopen() {
        let dir = std::env::temp_dir().join(format!("cubicle-store-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cubicle.db");
        let s = Store::open(&path).unwrap();
        assert_eq!(s.schema_version().unwrap(), schema::SCHEMA_VERSION);
        let t = s.ensure_team("admin").unwrap();
        let k = s.create_api_key(t.id).unwrap();
        drop(s);
        let s = Store::open(&path).unwrap();
        assert_eq!(s.schema_version().unwrap(), schema::SCHEMA_VERSION);
        assert_eq!(
            s.authenticate(&k.plaintext).unwrap().map(|t| t.name),
            Some("admin".into())
        );
        let mode: String = s
            .with_conn(|c| c.query_one("PRAGMA journal_mode", &[])?.get(0))
            .unwrap();
        assert_eq!(mode, "wal");
        // A second handle (another process, e.g. `cubicle apikey`) sees the same data.
        let other = Store::open(&path).unwrap();
        assert_eq!(other.list_api_keys().unwrap().len(), 1);
        drop((s, other));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The inline read connection sees every committed write at once (a revoked key is
    /// refused on the next request) and cannot write.
    #[test]
    fn read_view_sees_commits_and_cannot_write() {
        let dir = std::env::temp_dir().join(format!("cubicle-store-read-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let s = Store::open(&dir.join("cubicle.db")).unwrap();
        let t = s.ensure_team("t1").unwrap();
        let k = s.create_api_key(t.id).unwrap();
        let found = s
            .read(|r| r.find_key(&k.plaintext))
            .unwrap()
            .expect("key visible");
        assert_eq!(found.team.name, "t1");
        assert!(found.use_is_stale(now_ms()), "never used yet");
        s.record_key_use(found.key_id).unwrap();
        let found = s.read(|r| r.find_key(&k.plaintext)).unwrap().unwrap();
        assert!(!found.use_is_stale(now_ms()), "use recorded and seen");
        // Another handle (the CLI) revokes: the reader refuses the key at once.
        let cli = Store::open(&dir.join("cubicle.db")).unwrap();
        cli.revoke_api_key(&k.info.prefix).unwrap();
        assert!(s.read(|r| r.find_key(&k.plaintext)).unwrap().is_none());
        let err = s.read(|r| r.record_key_use(found.key_id)).unwrap_err();
        assert!(err.to_string().contains("readonly"), "{err}");
        drop((s, cli));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Read system calls this thread has made (the store's writer runs its statements on
    /// the calling thread; the checkpointer has a thread of its own).
    fn reads_by_this_thread() -> i64 {
        let io = std::fs::read_to_string("/proc/thread-self/io").unwrap();
        io.lines()
            .find_map(|l| l.strip_prefix("syscr: "))
            .and_then(|n| n.trim().parse().ok())
            .expect("syscr in /proc/thread-self/io")
    }

    /// A create's inserts into the indexes keyed by random ids find their pages in the
    /// writer's cache, warmed at open: none is read from the file (where a page the kernel
    /// dropped would be a disk read under the writer's lock).
    #[test]
    fn creates_write_random_key_indexes_from_the_warmed_cache() {
        let dir = std::env::temp_dir().join(format!("cubicle-store-warm-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cubicle.db");
        let random_id = || {
            format!(
                "{:016x}{:04x}",
                rand::random::<u64>(),
                rand::random::<u16>()
            )
        };
        let record = |s: &Store, id: &str, at: i64| {
            s.insert_sandbox(&sandboxes::tests::sample(id, 1, at))
                .unwrap();
            s.insert_event(&EventRow {
                id: format!("{:032x}", rand::random::<u128>()),
                team_id: 1,
                sandbox_id: id.into(),
                kind: "sandbox.lifecycle.created".into(),
                at,
                body: "{}".into(),
            })
            .unwrap();
        };
        let s = Store::open(&path).unwrap();
        let team = s.ensure_team("warm").unwrap();
        assert_eq!(team.id, 1);
        // Enough history for the indexes to span many pages (tens of leaves each).
        s.with_conn(|c| c.execute("BEGIN", &[])).unwrap();
        for i in 0..5000 {
            record(&s, &random_id(), i);
        }
        s.with_conn(|c| c.execute("COMMIT", &[])).unwrap();
        drop(s);

        let before_open = reads_by_this_thread();
        let s = Store::open(&path).unwrap();
        let warmed = reads_by_this_thread() - before_open;
        assert!(warmed > 100, "the open read the indexes: {warmed} reads");
        // The first creates read the append-only B-trees' right edges, which no warm-up
        // scan covers; after that, random ids must not read.
        for i in 0..5 {
            record(&s, &random_id(), 10_000 + i);
        }
        // What a look at /proc costs.
        let overhead = -reads_by_this_thread() + reads_by_this_thread();
        let before = reads_by_this_thread();
        for i in 0..100 {
            record(&s, &random_id(), 10_100 + i);
        }
        let reads = reads_by_this_thread() - before - overhead;
        // A few pages are new (the B-trees grow); without the warm-up, over 100.
        assert!(reads <= 10, "{reads} reads from the file for 100 creates");
        drop(s);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Commits never checkpoint (no `fsync` under the writer's lock); the store's own
    /// thread copies the WAL into the database file soon after.
    #[test]
    fn the_wal_is_checkpointed_in_the_background() {
        let dir = std::env::temp_dir().join(format!("cubicle-store-ckpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cubicle.db");
        let s = Store::open(&path).unwrap();
        let auto: i64 = s
            .with_conn(|c| c.query_one("PRAGMA wal_autocheckpoint", &[])?.get(0))
            .unwrap();
        assert_eq!(auto, 0, "the writer must not checkpoint in its commits");
        let before = std::fs::metadata(&path).unwrap().len();
        let t = s.ensure_team("ckpt").unwrap();
        for _ in 0..200 {
            s.create_api_key(t.id).unwrap();
        }
        // Nothing else writes or checkpoints now: the file grows only by the thread's
        // checkpoint.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::fs::metadata(&path).unwrap().len() <= before {
            assert!(
                std::time::Instant::now() < deadline,
                "the WAL was not checkpointed"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        drop(s);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A local user must not read the database: 0600 for the file, its WAL and its
    /// shared memory, also when an older Cubicle left them world-readable.
    #[test]
    fn database_files_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("cubicle-store-mode-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cubicle.db");
        let modes = || {
            ["cubicle.db", "cubicle.db-wal", "cubicle.db-shm"]
                .map(|f| std::fs::metadata(dir.join(f)).unwrap().permissions().mode() & 0o777)
        };
        let s = Store::open(&path).unwrap();
        s.ensure_team("t").unwrap();
        assert_eq!(modes(), [0o600; 3]);
        drop(s);
        for f in ["cubicle.db", "cubicle.db-wal", "cubicle.db-shm"] {
            let p = dir.join(f);
            if p.exists() {
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
            }
        }
        let s = Store::open(&path).unwrap();
        s.ensure_team("u").unwrap();
        assert_eq!(modes(), [0o600; 3]);
        drop(s);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Version 1 kept every sandbox's envd token; version 2 drops them (the node's
    /// record holds them) and the traffic tokens of ended sandboxes.
    #[test]
    fn migration_2_forgets_tokens_it_does_not_need() {
        let dir = std::env::temp_dir().join(format!("cubicle-store-mig-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cubicle.db");
        {
            let c = rusqlite::Connection::open(&path).unwrap();
            c.execute_batch(
                "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at INTEGER NOT NULL);",
            )
            .unwrap();
            c.execute_batch(schema::MIGRATIONS[0]).unwrap();
            c.execute_batch(
                "INSERT INTO schema_version VALUES (1, 0);
                 INSERT INTO teams VALUES (1, 't', 0);
                 INSERT INTO sandboxes VALUES ('live', 1, 'base', NULL, '{}', '[]', 'envd-secret',
                     'traffic-live', 1, 2, 512, 5120, 1, 2, 'running', NULL, NULL);
                 INSERT INTO sandboxes VALUES ('gone', 1, 'base', NULL, '{}', '[]', 'envd-secret',
                     'traffic-gone', 1, 2, 512, 5120, 1, 2, 'ended', 'killed', 3);",
            )
            .unwrap();
        }
        let s = Store::open(&path).unwrap();
        assert_eq!(s.schema_version().unwrap(), schema::SCHEMA_VERSION);
        let live = s.sandbox("live").unwrap().unwrap();
        assert_eq!(live.traffic_access_token.as_deref(), Some("traffic-live"));
        let gone = s.sandbox("gone").unwrap().unwrap();
        assert_eq!(gone.traffic_access_token, None);
        let cols: Vec<String> = s
            .with_conn(|c| {
                c.query("SELECT name FROM pragma_table_info('sandboxes')", &[])?
                    .iter()
                    .map(|r| r.get(0))
                    .collect()
            })
            .unwrap();
        assert!(!cols.iter().any(|c| c == "envd_access_token"), "{cols:?}");
        drop(s);
        // Not in freed pages either (secure_delete), once the last handle closed.
        let raw = std::fs::read(&path).unwrap();
        let has = |needle: &[u8]| raw.windows(needle.len()).any(|w| w == needle);
        assert!(!has(b"envd-secret") && !has(b"traffic-gone"));
        assert!(has(b"traffic-live"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// PostgreSQL: migrations apply once (also when two stores open a fresh database at
    /// the same time), survive reopening, and a newer schema is refused.
    #[test]
    fn postgres_migrations_apply_once_and_newer_is_refused() {
        let Some(url) = testdb::fresh_database_url() else {
            return;
        };
        let opens: Vec<_> = (0..4)
            .map(|_| {
                let url = url.clone();
                std::thread::spawn(move || Store::open_url(&url).map(|s| s.schema_version()))
            })
            .collect();
        for o in opens {
            assert_eq!(o.join().unwrap().unwrap().unwrap(), SCHEMA_VERSION);
        }
        let s = Store::open_url(&url).unwrap();
        assert_eq!(s.dialect(), Dialect::Postgres);
        let applied: i64 = s
            .with_conn(|c| {
                c.query_one("SELECT COUNT(*) FROM schema_version", &[])?
                    .get(0)
            })
            .unwrap();
        assert_eq!(applied, SCHEMA_VERSION);
        s.with_conn(|c| c.execute("INSERT INTO schema_version VALUES (999, 0)", &[]))
            .unwrap();
        assert!(matches!(
            Store::open_url(&url),
            Err(Error::SchemaTooNew { found: 999, .. })
        ));
    }

    /// The request path's inline read runs on a tokio worker thread: with PostgreSQL it
    /// must not panic (as the sync `postgres` crate would), and async callers' `call`
    /// works too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_reads_work_on_runtime_threads() {
        let Some(s) = testdb::postgres_store() else {
            return;
        };
        let t = s.call(|s| s.ensure_team("t")).await.unwrap();
        let k = s.call(move |s| s.create_api_key(t.id)).await.unwrap();
        let found = s.read(|r| r.find_key(&k.plaintext)).unwrap().unwrap();
        assert_eq!(found.team.name, "t");
        // Many at once from many tasks (the pool hands out and takes back connections).
        let tasks: Vec<_> = (0..64)
            .map(|_| {
                let (s, key) = (s.clone(), k.plaintext.clone());
                tokio::spawn(async move { s.read(|r| r.find_key(&key)).map(|f| f.is_some()) })
            })
            .collect();
        for t in tasks {
            assert!(t.await.unwrap().unwrap());
        }
    }

    /// What the URL names decides the engine; nonsense is refused with a hint.
    #[test]
    fn open_url_picks_the_engine() {
        let dir = std::env::temp_dir().join(format!("cubicle-store-url-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.db");
        let s = Store::open_url(&format!("sqlite://{}", path.display())).unwrap();
        assert_eq!(s.dialect(), Dialect::Sqlite);
        assert!(path.exists());
        let s = Store::open_url(path.to_str().unwrap()).unwrap();
        assert_eq!(s.schema_version().unwrap(), SCHEMA_VERSION);
        assert!(matches!(
            Store::open_url("mysql://x/y"),
            Err(Error::Invalid(_))
        ));
        let err = Store::open_url("postgres://nobody@127.0.0.1:1/x")
            .err()
            .unwrap();
        assert!(err.to_string().contains("database"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn newer_schema_is_refused() {
        let dir = std::env::temp_dir().join(format!("cubicle-store-new-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cubicle.db");
        drop(Store::open(&path).unwrap());
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute("INSERT INTO schema_version VALUES (999, 0)", [])
            .unwrap();
        drop(c);
        assert!(matches!(
            Store::open(&path),
            Err(Error::SchemaTooNew { found: 999, .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
