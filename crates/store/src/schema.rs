//! Schema and migrations. Each migration is applied once, in order, inside a
//! transaction; `schema_version` records the highest one applied. Never edit a published
//! migration: append a new one.

use rusqlite::Connection;

use crate::{Error, Result};

/// The migrations, in order; index + 1 is the version each one produces.
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
];

/// Newest schema version this binary knows.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

pub(crate) fn current_version(conn: &Connection) -> Result<i64> {
    Ok(conn.query_row(
        "SELECT COALESCE(MAX(version), 0) FROM schema_version",
        [],
        |r| r.get(0),
    )?)
}

pub(crate) fn migrate(conn: &mut Connection) -> Result<()> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS schema_version (
            version     INTEGER PRIMARY KEY,
            applied_at  INTEGER NOT NULL
        );",
    )?;
    // IMMEDIATE: two processes opening a fresh file must not both migrate.
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let found = current_version(&tx)?;
    if found > SCHEMA_VERSION {
        return Err(Error::SchemaTooNew {
            found,
            supported: SCHEMA_VERSION,
        });
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(found as usize) {
        tx.execute_batch(sql)?;
        tx.execute(
            "INSERT INTO schema_version (version, applied_at) VALUES (?1, ?2)",
            rusqlite::params![i as i64 + 1, crate::now_ms()],
        )?;
    }
    tx.commit()?;
    Ok(())
}
