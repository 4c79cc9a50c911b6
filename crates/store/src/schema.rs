//! Schema and migrations, one list per engine. Each migration is applied once, in order,
//! inside a transaction; `schema_version` records the highest one applied. Version N
//! means the same tables in both engines (only the column types are each engine's own),
//! so the two lists always have the same length. Never edit a published migration:
//! append a new one, to both lists.

use crate::db::{Conn, Dialect, args};
use crate::{Error, Result};

/// The SQLite migrations, in order; index + 1 is the version each one produces.
pub(crate) const MIGRATIONS: &[&str] = &[
    // 1: teams, API keys, sandboxes, idempotency keys.
    r#"
    CREATE TABLE teams (
        id          INTEGER PRIMARY KEY,
        name        TEXT NOT NULL UNIQUE,
        created_at  INTEGER NOT NULL
    );
    CREATE TABLE api_keys (
        id            INTEGER PRIMARY KEY,
        team_id       INTEGER NOT NULL REFERENCES teams(id),
        key_hash      TEXT NOT NULL UNIQUE,      -- hex SHA-256 of the whole key
        prefix        TEXT NOT NULL,             -- first characters, for display
        created_at    INTEGER NOT NULL,          -- unix ms
        last_used_at  INTEGER,
        revoked_at    INTEGER
    );
    CREATE TABLE sandboxes (
        id                    TEXT PRIMARY KEY,
        team_id               INTEGER NOT NULL REFERENCES teams(id),
        template_id           TEXT NOT NULL,
        alias                 TEXT,
        metadata              TEXT NOT NULL,     -- JSON object of strings
        env_var_names         TEXT NOT NULL,     -- JSON array (values are never stored)
        envd_access_token     TEXT NOT NULL,
        traffic_access_token  TEXT,
        allow_internet        INTEGER NOT NULL,
        cpu_count             INTEGER NOT NULL,
        memory_mb             INTEGER NOT NULL,
        disk_mb               INTEGER NOT NULL,
        started_at            INTEGER NOT NULL,  -- unix ms
        end_at                INTEGER NOT NULL,  -- unix ms (kept in sync with the node)
        state                 TEXT NOT NULL,     -- running | ended
        death_reason          TEXT,
        ended_at              INTEGER
    );
    CREATE INDEX sandboxes_by_team ON sandboxes(team_id, state, started_at);
    CREATE INDEX sandboxes_by_end ON sandboxes(state, ended_at);
    CREATE TABLE idempotency_keys (
        team_id       INTEGER NOT NULL REFERENCES teams(id),
        key           TEXT NOT NULL,
        request_hash  TEXT NOT NULL,
        sandbox_id    TEXT,                      -- NULL while the create is in flight
        created_at    INTEGER NOT NULL,
        expires_at    INTEGER NOT NULL,
        PRIMARY KEY (team_id, key)
    );
    "#,
    // 2: store only what is needed. The envd token lives in the node's record (which
    // needs it to reach envd after a restart); the API reads it from there. An ended
    // sandbox needs no traffic token.
    r#"
    ALTER TABLE sandboxes DROP COLUMN envd_access_token;
    UPDATE sandboxes SET traffic_access_token = NULL WHERE state = 'ended';
    "#,
    // 3: volumes (their files are the node's) and secrets (values sealed by the control
    // plane with the server's key: never in clear here).
    r#"
    CREATE TABLE volumes (
        id          TEXT PRIMARY KEY,                    -- uuid
        team_id     INTEGER NOT NULL REFERENCES teams(id),
        name        TEXT NOT NULL,
        size_mb     INTEGER NOT NULL,
        created_at  INTEGER NOT NULL,                    -- unix ms
        UNIQUE (team_id, name)
    );
    CREATE TABLE secrets (
        id          TEXT PRIMARY KEY,                    -- sec_…
        team_id     INTEGER NOT NULL REFERENCES teams(id),
        name        TEXT NOT NULL,                       -- canonical: lowercase
        version     INTEGER NOT NULL,
        sealed      BLOB NOT NULL,                       -- nonce || ciphertext || tag
        metadata    TEXT NOT NULL,                       -- JSON object of strings
        created_at  INTEGER NOT NULL,                    -- unix ms
        updated_at  INTEGER NOT NULL,
        UNIQUE (team_id, name)
    );
    "#,
    // 4: sandbox lifecycle events (E2B's events API) and the teams' webhooks.
    r#"
    CREATE TABLE sandbox_events (
        seq         INTEGER PRIMARY KEY AUTOINCREMENT,   -- order of recording
        id          TEXT NOT NULL UNIQUE,                -- the event's uuid
        team_id     INTEGER NOT NULL REFERENCES teams(id),
        sandbox_id  TEXT NOT NULL,
        type        TEXT NOT NULL,                       -- sandbox.lifecycle.*
        at          INTEGER NOT NULL,                    -- unix ms
        body        TEXT NOT NULL                        -- the event as served (JSON)
    );
    CREATE INDEX sandbox_events_by_team ON sandbox_events(team_id, seq);
    CREATE INDEX sandbox_events_by_sandbox ON sandbox_events(sandbox_id, seq);
    CREATE INDEX sandbox_events_by_time ON sandbox_events(at);
    CREATE TABLE webhooks (
        id          TEXT PRIMARY KEY,                    -- uuid
        team_id     INTEGER NOT NULL REFERENCES teams(id),
        name        TEXT NOT NULL,
        url         TEXT NOT NULL,
        enabled     INTEGER NOT NULL,
        events      TEXT NOT NULL,                       -- JSON array of event types
        secret      TEXT NOT NULL,                       -- signs deliveries (needed in clear)
        created_at  INTEGER NOT NULL                     -- unix ms
    );
    CREATE INDEX webhooks_by_team ON webhooks(team_id);
    "#,
    // 5: the cluster's coordination (docs/cluster.md): nodes with their leases and
    // fencing epochs, which node owns a sandbox, and placements reserved on a node
    // while the sandbox is being created there.
    r#"
    CREATE TABLE nodes (
        id                  TEXT PRIMARY KEY,
        address             TEXT NOT NULL,
        state               TEXT NOT NULL,       -- active | draining | lost
        epoch               INTEGER NOT NULL,    -- fencing token: +1 on register and on loss
        cpu_count           INTEGER NOT NULL,    -- capacity
        memory_mb           INTEGER NOT NULL,
        max_sandboxes       INTEGER NOT NULL,
        templates           TEXT NOT NULL,       -- JSON array of template ids present
        pool_state          TEXT NOT NULL,       -- JSON (warm pool entries, as the node reports)
        registered_at       INTEGER NOT NULL,    -- unix ms
        renewed_at          INTEGER NOT NULL,
        lease_expires_at    INTEGER NOT NULL,
        lost_at             INTEGER
    );
    ALTER TABLE sandboxes ADD COLUMN node_id TEXT;
    ALTER TABLE sandboxes ADD COLUMN node_epoch INTEGER;
    CREATE INDEX sandboxes_by_node ON sandboxes(node_id, state);
    CREATE TABLE placements (
        sandbox_id  TEXT PRIMARY KEY,
        node_id     TEXT NOT NULL REFERENCES nodes(id),
        node_epoch  INTEGER NOT NULL,
        cpu_count   INTEGER NOT NULL,
        memory_mb   INTEGER NOT NULL,
        expires_at  INTEGER NOT NULL             -- unix ms; a replica that died mid-create
    );
    CREATE INDEX placements_by_node ON placements(node_id, expires_at);
    "#,
    // 6: templates built through the cluster's replicas (docs/cluster.md, "Templates
    // through a replica"): each name's owner team and the node its builds run on; the
    // node a volume lives on ("Volumes through a replica"; NULL on a single host).
    r#"
    ALTER TABLE volumes ADD COLUMN node_id TEXT;
    CREATE TABLE cluster_templates (
        name        TEXT PRIMARY KEY,
        team_id     INTEGER NOT NULL REFERENCES teams(id),
        node_id     TEXT NOT NULL,               -- the node its builds and records live on
        created_at  INTEGER NOT NULL             -- unix ms
    );
    "#,
];

/// The PostgreSQL migrations: the same versions as [`MIGRATIONS`], in PostgreSQL's
/// types (BIGINT for integers and unix-ms times, BOOLEAN, BYTEA, identity columns).
pub(crate) const POSTGRES_MIGRATIONS: &[&str] = &[
    // 1: teams, API keys, sandboxes, idempotency keys.
    r#"
    CREATE TABLE teams (
        id          BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
        name        TEXT NOT NULL UNIQUE,
        created_at  BIGINT NOT NULL
    );
    CREATE TABLE api_keys (
        id            BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
        team_id       BIGINT NOT NULL REFERENCES teams(id),
        key_hash      TEXT NOT NULL UNIQUE,
        prefix        TEXT NOT NULL,
        created_at    BIGINT NOT NULL,
        last_used_at  BIGINT,
        revoked_at    BIGINT
    );
    CREATE TABLE sandboxes (
        id                    TEXT PRIMARY KEY,
        team_id               BIGINT NOT NULL REFERENCES teams(id),
        template_id           TEXT NOT NULL,
        alias                 TEXT,
        metadata              TEXT NOT NULL,
        env_var_names         TEXT NOT NULL,
        envd_access_token     TEXT NOT NULL,
        traffic_access_token  TEXT,
        allow_internet        BOOLEAN NOT NULL,
        cpu_count             BIGINT NOT NULL,
        memory_mb             BIGINT NOT NULL,
        disk_mb               BIGINT NOT NULL,
        started_at            BIGINT NOT NULL,
        end_at                BIGINT NOT NULL,
        state                 TEXT NOT NULL,
        death_reason          TEXT,
        ended_at              BIGINT
    );
    CREATE INDEX sandboxes_by_team ON sandboxes(team_id, state, started_at);
    CREATE INDEX sandboxes_by_end ON sandboxes(state, ended_at);
    CREATE TABLE idempotency_keys (
        team_id       BIGINT NOT NULL REFERENCES teams(id),
        key           TEXT NOT NULL,
        request_hash  TEXT NOT NULL,
        sandbox_id    TEXT,
        created_at    BIGINT NOT NULL,
        expires_at    BIGINT NOT NULL,
        PRIMARY KEY (team_id, key)
    );
    "#,
    // 2: as SQLite's.
    r#"
    ALTER TABLE sandboxes DROP COLUMN envd_access_token;
    UPDATE sandboxes SET traffic_access_token = NULL WHERE state = 'ended';
    "#,
    // 3: volumes and secrets.
    r#"
    CREATE TABLE volumes (
        id          TEXT PRIMARY KEY,
        team_id     BIGINT NOT NULL REFERENCES teams(id),
        name        TEXT NOT NULL,
        size_mb     BIGINT NOT NULL,
        created_at  BIGINT NOT NULL,
        UNIQUE (team_id, name)
    );
    CREATE TABLE secrets (
        id          TEXT PRIMARY KEY,
        team_id     BIGINT NOT NULL REFERENCES teams(id),
        name        TEXT NOT NULL,
        version     BIGINT NOT NULL,
        sealed      BYTEA NOT NULL,
        metadata    TEXT NOT NULL,
        created_at  BIGINT NOT NULL,
        updated_at  BIGINT NOT NULL,
        UNIQUE (team_id, name)
    );
    "#,
    // 4: sandbox lifecycle events and the teams' webhooks.
    r#"
    CREATE TABLE sandbox_events (
        seq         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        id          TEXT NOT NULL UNIQUE,
        team_id     BIGINT NOT NULL REFERENCES teams(id),
        sandbox_id  TEXT NOT NULL,
        type        TEXT NOT NULL,
        at          BIGINT NOT NULL,
        body        TEXT NOT NULL
    );
    CREATE INDEX sandbox_events_by_team ON sandbox_events(team_id, seq);
    CREATE INDEX sandbox_events_by_sandbox ON sandbox_events(sandbox_id, seq);
    CREATE INDEX sandbox_events_by_time ON sandbox_events(at);
    CREATE TABLE webhooks (
        id          TEXT PRIMARY KEY,
        team_id     BIGINT NOT NULL REFERENCES teams(id),
        name        TEXT NOT NULL,
        url         TEXT NOT NULL,
        enabled     BOOLEAN NOT NULL,
        events      TEXT NOT NULL,
        secret      TEXT NOT NULL,
        created_at  BIGINT NOT NULL
    );
    CREATE INDEX webhooks_by_team ON webhooks(team_id);
    "#,
    // 5: the cluster's coordination (see SQLite's 5).
    r#"
    CREATE TABLE nodes (
        id                  TEXT PRIMARY KEY,
        address             TEXT NOT NULL,
        state               TEXT NOT NULL,
        epoch               BIGINT NOT NULL,
        cpu_count           BIGINT NOT NULL,
        memory_mb           BIGINT NOT NULL,
        max_sandboxes       BIGINT NOT NULL,
        templates           TEXT NOT NULL,
        pool_state          TEXT NOT NULL,
        registered_at       BIGINT NOT NULL,
        renewed_at          BIGINT NOT NULL,
        lease_expires_at    BIGINT NOT NULL,
        lost_at             BIGINT
    );
    ALTER TABLE sandboxes ADD COLUMN node_id TEXT;
    ALTER TABLE sandboxes ADD COLUMN node_epoch BIGINT;
    CREATE INDEX sandboxes_by_node ON sandboxes(node_id, state);
    CREATE TABLE placements (
        sandbox_id  TEXT PRIMARY KEY,
        node_id     TEXT NOT NULL REFERENCES nodes(id),
        node_epoch  BIGINT NOT NULL,
        cpu_count   BIGINT NOT NULL,
        memory_mb   BIGINT NOT NULL,
        expires_at  BIGINT NOT NULL
    );
    CREATE INDEX placements_by_node ON placements(node_id, expires_at);
    "#,
    // 6: templates built through the cluster's replicas (see SQLite's 6).
    r#"
    ALTER TABLE volumes ADD COLUMN node_id TEXT;
    CREATE TABLE cluster_templates (
        name        TEXT PRIMARY KEY,
        team_id     BIGINT NOT NULL REFERENCES teams(id),
        node_id     TEXT NOT NULL,
        created_at  BIGINT NOT NULL
    );
    "#,
];

const _: () = assert!(MIGRATIONS.len() == POSTGRES_MIGRATIONS.len());

/// Newest schema version this binary knows.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

pub(crate) fn current_version(c: &mut Conn<'_>) -> Result<i64> {
    c.query_one(
        "SELECT CAST(COALESCE(MAX(version), 0) AS BIGINT) FROM schema_version",
        &[],
    )?
    .get(0)
}

/// Key of the PostgreSQL advisory lock held while migrating (any constant: it only
/// has to be the same in every Cubicle).
const MIGRATION_LOCK: i64 = 0x6375_6269_636c_6501;

pub(crate) fn migrate(c: &mut Conn<'_>) -> Result<()> {
    let dialect = c.dialect();
    if dialect == Dialect::Sqlite {
        c.batch(
            "CREATE TABLE IF NOT EXISTS schema_version (
                version     INTEGER PRIMARY KEY,
                applied_at  INTEGER NOT NULL
            );",
        )?;
    }
    // SQLite: IMMEDIATE, so two processes opening a fresh file do not both migrate.
    // PostgreSQL: the advisory lock, taken before the version table even exists, so
    // replicas starting together do not both create it or migrate.
    c.transaction(crate::db::Isolation::ReadCommitted, |tx| {
        let migrations = match dialect {
            Dialect::Sqlite => MIGRATIONS,
            Dialect::Postgres => {
                tx.execute("SELECT pg_advisory_xact_lock(?1)", args![MIGRATION_LOCK])?;
                tx.batch(
                    "CREATE TABLE IF NOT EXISTS schema_version (
                        version     BIGINT PRIMARY KEY,
                        applied_at  BIGINT NOT NULL
                    );",
                )?;
                POSTGRES_MIGRATIONS
            }
        };
        let found = current_version(tx)?;
        if found > SCHEMA_VERSION {
            return Err(Error::SchemaTooNew {
                found,
                supported: SCHEMA_VERSION,
            });
        }
        for (i, sql) in migrations.iter().enumerate().skip(found as usize) {
            tx.batch(sql)?;
            tx.execute(
                "INSERT INTO schema_version (version, applied_at) VALUES (?1, ?2)",
                args![i as i64 + 1, crate::now_ms()],
            )?;
        }
        Ok(())
    })
}
