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
    // 7: nothing for SQLite. PostgreSQL's 7 adds functions that make a placement's
    // reservation and its commit one round trip each; SQLite runs those as
    // transactions in the process (no round trips to save).
    "SELECT 1;",
    // 8: paused sandboxes whose copy is in the object store (docs/cluster.md, "Paused
    // sandboxes outlive their node"): when the node published it (unix ms; NULL while
    // it runs, or is paused with no published copy). A lost node's sandboxes with one
    // become unowned instead of ended, and resume on another node.
    "ALTER TABLE sandboxes ADD COLUMN published_at INTEGER;",
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
    // 7: a placement in one round trip each (crates/store/src/nodes.rs): the
    // reservation (lock the node's row, sum its use, reserve if the sandbox fits) and
    // its commit (check the epoch, drop the reservation, insert the sandbox's row) as
    // functions. Each statement in a VOLATILE function takes a fresh snapshot, so the
    // sum after the row lock sees every reservation committed before it, as the
    // statements of a READ COMMITTED transaction do. They decide; nodes.rs words the
    // answers (one text for both engines).
    r#"
    CREATE FUNCTION cubicle_reserve(p_node TEXT, p_sandbox TEXT, p_cpu BIGINT, p_mem BIGINT,
                                    p_now BIGINT, p_ttl BIGINT,
        OUT r_node TEXT, OUT r_status TEXT, OUT r_epoch BIGINT, OUT r_state TEXT,
        OUT r_lease BIGINT, OUT r_cpu BIGINT, OUT r_mem BIGINT, OUT r_max BIGINT,
        OUT u_count BIGINT, OUT u_cpu BIGINT, OUT u_mem BIGINT)
    LANGUAGE plpgsql VOLATILE AS $fn$
    BEGIN
        r_node := p_node;
        SELECT n.epoch, n.state, n.lease_expires_at, n.cpu_count, n.memory_mb, n.max_sandboxes
          INTO r_epoch, r_state, r_lease, r_cpu, r_mem, r_max
          FROM nodes n WHERE n.id = p_node FOR UPDATE;
        IF NOT FOUND THEN
            r_status := 'missing';
            RETURN;
        END IF;
        IF r_state <> 'active' OR r_lease <= p_now THEN
            r_status := 'closed';
            RETURN;
        END IF;
        DELETE FROM placements p WHERE p.node_id = p_node AND p.expires_at <= p_now;
        SELECT COUNT(*), COALESCE(SUM(x.cpu_count), 0), COALESCE(SUM(x.memory_mb), 0)
          INTO u_count, u_cpu, u_mem
          FROM (SELECT s.cpu_count, s.memory_mb FROM sandboxes s
                WHERE s.node_id = p_node AND s.state = 'running'
                UNION ALL
                SELECT p.cpu_count, p.memory_mb FROM placements p
                WHERE p.node_id = p_node AND p.expires_at > p_now) x;
        IF u_count + 1 > r_max OR u_cpu + p_cpu > r_cpu OR u_mem + p_mem > r_mem THEN
            r_status := 'full';
            RETURN;
        END IF;
        INSERT INTO placements (sandbox_id, node_id, node_epoch, cpu_count, memory_mb, expires_at)
            VALUES (p_sandbox, p_node, r_epoch, p_cpu, p_mem, p_now + p_ttl);
        r_status := 'reserved';
    END
    $fn$;

    -- The candidates in placement order (active, lease valid; template present first,
    -- then fewest sandboxes, then name), tried until one reserves or answers anything
    -- but "closed" or "full"; one row per node tried. (Variables keep their values
    -- when a block's exception rolls its subtransaction back.)
    CREATE FUNCTION cubicle_place(p_sandbox TEXT, p_template TEXT, p_cpu BIGINT, p_mem BIGINT,
                                  p_now BIGINT, p_ttl BIGINT)
    RETURNS TABLE (r_node TEXT, r_status TEXT, r_epoch BIGINT, r_state TEXT, r_lease BIGINT,
                   r_cpu BIGINT, r_mem BIGINT, r_max BIGINT, u_count BIGINT, u_cpu BIGINT,
                   u_mem BIGINT)
    LANGUAGE plpgsql VOLATILE AS $fn$
    DECLARE
        c RECORD;
    BEGIN
        FOR c IN
            SELECT n.id FROM nodes n LEFT JOIN (
                SELECT x.node_id AS owner, COUNT(*) AS cnt
                FROM (SELECT s.node_id FROM sandboxes s
                      WHERE s.state = 'running' AND s.node_id IS NOT NULL
                      UNION ALL
                      SELECT p.node_id FROM placements p WHERE p.expires_at > p_now) x
                GROUP BY x.node_id) u ON u.owner = n.id
            WHERE n.state = 'active' AND n.lease_expires_at > p_now
            ORDER BY (n.templates::jsonb ? p_template) DESC, COALESCE(u.cnt, 0), n.id COLLATE "C"
        LOOP
            -- A node that does not take the sandbox is tried in a subtransaction rolled
            -- back at once: its row lock is released before the next node is locked, so
            -- two placements trying nodes in different orders cannot deadlock.
            BEGIN
                SELECT * INTO r_node, r_status, r_epoch, r_state, r_lease, r_cpu, r_mem, r_max,
                              u_count, u_cpu, u_mem
                  FROM cubicle_reserve(c.id, p_sandbox, p_cpu, p_mem, p_now, p_ttl);
                IF r_status IN ('closed', 'full') THEN
                    RAISE SQLSTATE 'CB001';
                END IF;
            EXCEPTION WHEN SQLSTATE 'CB001' THEN
                NULL;
            END;
            RETURN NEXT;
            IF r_status NOT IN ('closed', 'full') THEN
                RETURN;
            END IF;
        END LOOP;
    END
    $fn$;

    CREATE FUNCTION cubicle_commit(p_key TEXT, p_node TEXT, p_epoch BIGINT, p_now BIGINT,
        p_id TEXT, p_team BIGINT, p_template TEXT, p_alias TEXT, p_metadata TEXT, p_env TEXT,
        p_traffic TEXT, p_internet BOOLEAN, p_cpu BIGINT, p_mem BIGINT, p_disk BIGINT,
        p_started BIGINT, p_end BIGINT, p_state TEXT, p_reason TEXT, p_ended BIGINT)
    RETURNS TEXT LANGUAGE plpgsql VOLATILE AS $fn$
    DECLARE
        cur BIGINT;
        st TEXT;
    BEGIN
        SELECT n.epoch, n.state INTO cur, st FROM nodes n WHERE n.id = p_node FOR SHARE;
        IF NOT FOUND THEN
            RETURN 'missing';
        END IF;
        IF cur <> p_epoch OR st = 'lost' THEN
            RETURN 'fenced';
        END IF;
        DELETE FROM placements p WHERE p.sandbox_id = p_key AND p.node_id = p_node
            AND p.node_epoch = p_epoch AND p.expires_at > p_now;
        IF NOT FOUND THEN
            RETURN 'expired';
        END IF;
        INSERT INTO sandboxes (id, team_id, template_id, alias, metadata, env_var_names,
            traffic_access_token, allow_internet, cpu_count, memory_mb, disk_mb, started_at,
            end_at, state, death_reason, ended_at, node_id, node_epoch)
        VALUES (p_id, p_team, p_template, p_alias, p_metadata, p_env, p_traffic, p_internet,
            p_cpu, p_mem, p_disk, p_started, p_end, p_state, p_reason, p_ended, p_node, p_epoch);
        RETURN 'committed';
    END
    $fn$;
    "#,
    // 8: paused sandboxes with a published copy (see SQLite's 8).
    "ALTER TABLE sandboxes ADD COLUMN published_at BIGINT;",
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
