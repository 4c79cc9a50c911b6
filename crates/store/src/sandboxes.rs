//! Sandbox records: who owns a sandbox and what the API promised about it. The node
//! keeps the authoritative runtime state (alive or not, end time); this table keeps what
//! the node does not know (team, alias, traffic token) and what must outlive the sandbox
//! (its death reason, for a while).

use std::collections::BTreeMap;

use crate::db::{Conn, Row, Value, args};
use crate::{Result, Store};

/// Stored lifecycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxRowState {
    /// Alive as far as the API knows.
    Running,
    /// Gone (killed, timed out, crashed); see `death_reason`.
    Ended,
}

impl SandboxRowState {
    fn as_str(self) -> &'static str {
        match self {
            SandboxRowState::Running => "running",
            SandboxRowState::Ended => "ended",
        }
    }
    fn parse(s: &str) -> Self {
        if s == "running" {
            SandboxRowState::Running
        } else {
            SandboxRowState::Ended
        }
    }
}

/// One sandbox as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRow {
    /// Sandbox id.
    pub id: String,
    /// Owner team.
    pub team_id: i64,
    /// Resolved template id (e.g. `base`).
    pub template_id: String,
    /// The name the caller used, when it differs from the id.
    pub alias: Option<String>,
    /// User metadata.
    pub metadata: BTreeMap<String, String>,
    /// Names of the create-time env vars (values are never stored).
    pub env_var_names: Vec<String>,
    /// Required on non-envd ports when set (in clear: `connect` returns it to the SDK,
    /// which sends it on every request to those ports). Cleared when the sandbox ends.
    /// (The envd token is not stored here: the node's record holds it.)
    pub traffic_access_token: Option<String>,
    /// Internet access.
    pub allow_internet: bool,
    /// vCPUs.
    pub cpu_count: u32,
    /// Memory limit, MiB.
    pub memory_mb: u64,
    /// Disk quota, MiB.
    pub disk_mb: u64,
    /// Unix ms.
    pub started_at: i64,
    /// Unix ms.
    pub end_at: i64,
    /// Stored state.
    pub state: SandboxRowState,
    /// `killed`, `timeout`, `oom`, `disk_full`, `exited`, …
    pub death_reason: Option<String>,
    /// Unix ms.
    pub ended_at: Option<i64>,
}

const COLUMNS: &str = "id, team_id, template_id, alias, metadata, env_var_names,
    traffic_access_token, allow_internet, cpu_count, memory_mb, disk_mb, started_at, end_at,
    state, death_reason, ended_at";

fn row(r: &Row) -> Result<SandboxRow> {
    let metadata: String = r.get(4)?;
    let env: String = r.get(5)?;
    let state: String = r.get(13)?;
    Ok(SandboxRow {
        id: r.get(0)?,
        team_id: r.get(1)?,
        template_id: r.get(2)?,
        alias: r.get(3)?,
        metadata: serde_json::from_str(&metadata)?,
        env_var_names: serde_json::from_str(&env)?,
        traffic_access_token: r.get(6)?,
        allow_internet: r.get(7)?,
        cpu_count: r.get(8)?,
        memory_mb: r.get(9)?,
        disk_mb: r.get(10)?,
        started_at: r.get(11)?,
        end_at: r.get(12)?,
        state: SandboxRowState::parse(&state),
        death_reason: r.get(14)?,
        ended_at: r.get(15)?,
    })
}

/// Inserts `s`, owned by node `owner` (`(node id, epoch)`) when given.
pub(crate) fn insert(c: &mut Conn<'_>, s: &SandboxRow, owner: Option<(&str, i64)>) -> Result<()> {
    let mut vals = values(s)?;
    vals.push(owner.map(|o| o.0).into());
    vals.push(owner.map(|o| o.1).into());
    c.execute(
        &format!("INSERT INTO sandboxes ({COLUMNS}, node_id, node_epoch) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18)"),
        &vals,
    )?;
    Ok(())
}

/// Row `s`'s values in [`COLUMNS`]' order (also the sandbox arguments of PostgreSQL's
/// `cubicle_commit`, `nodes.rs`).
pub(crate) fn values(s: &SandboxRow) -> Result<Vec<Value>> {
    Ok(args![
        s.id.as_str(),
        s.team_id,
        s.template_id.as_str(),
        s.alias.as_deref(),
        serde_json::to_string(&s.metadata)?,
        serde_json::to_string(&s.env_var_names)?,
        s.traffic_access_token.as_deref(),
        s.allow_internet,
        s.cpu_count,
        s.memory_mb,
        s.disk_mb,
        s.started_at,
        s.end_at,
        s.state.as_str(),
        s.death_reason.as_deref(),
        s.ended_at,
    ]
    .to_vec())
}

impl Store {
    /// Insert a new sandbox record (owned by no node: the single host; a cluster's
    /// creates go through [`Store::commit_placement`]).
    pub fn insert_sandbox(&self, s: &SandboxRow) -> Result<()> {
        self.with_conn(|c| insert(c, s, None))
    }

    /// A sandbox by id, whatever its state or team.
    pub fn sandbox(&self, id: &str) -> Result<Option<SandboxRow>> {
        self.with_conn(|c| {
            c.query_opt(
                &format!("SELECT {COLUMNS} FROM sandboxes WHERE id = ?1"),
                args![id],
            )?
            .as_ref()
            .map(row)
            .transpose()
        })
    }

    /// Running sandboxes of one team (`Some`) or of every team (`None`).
    pub fn running_sandboxes(&self, team_id: Option<i64>) -> Result<Vec<SandboxRow>> {
        self.with_conn(|c| {
            c.query(
                &format!(
                    "SELECT {COLUMNS} FROM sandboxes WHERE state = 'running' AND (CAST(?1 AS BIGINT) IS NULL OR team_id = ?1) ORDER BY started_at, id"
                ),
                args![team_id],
            )?
            .iter()
            .map(row)
            .collect()
        })
    }

    /// Record a new end time.
    pub fn set_end_at(&self, id: &str, end_at: i64) -> Result<()> {
        self.with_conn(|c| {
            c.execute(
                "UPDATE sandboxes SET end_at = ?1 WHERE id = ?2",
                args![end_at, id],
            )
        })?;
        Ok(())
    }

    /// Mark a sandbox ended (no-op if it already is), forgetting its traffic token.
    /// Returns whether it changed.
    pub fn mark_ended(&self, id: &str, reason: &str, ended_at: i64) -> Result<bool> {
        let n = self.with_conn(|c| {
            c.execute(
                "UPDATE sandboxes SET state = 'ended', death_reason = ?1, ended_at = ?2, traffic_access_token = NULL WHERE id = ?3 AND state = 'running'",
                args![reason, ended_at, id],
            )
        })?;
        Ok(n > 0)
    }

    /// Delete records of sandboxes that ended before `before_ms`; returns their ids.
    pub fn purge_ended(&self, before_ms: i64) -> Result<Vec<String>> {
        self.with_conn(|c| {
            c.query(
                "DELETE FROM sandboxes WHERE state = 'ended' AND ended_at < ?1 RETURNING id",
                args![before_ms],
            )?
            .iter()
            .map(|r| r.get(0))
            .collect()
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample(id: &str, team: i64, started_at: i64) -> SandboxRow {
        SandboxRow {
            id: id.into(),
            team_id: team,
            template_id: "base".into(),
            alias: Some("base".into()),
            metadata: [("k".to_string(), "v".to_string())].into(),
            env_var_names: vec!["FOO".into()],
            traffic_access_token: Some("traffic".into()),
            allow_internet: true,
            cpu_count: 2,
            memory_mb: 512,
            disk_mb: 5120,
            started_at,
            end_at: started_at + 300_000,
            state: SandboxRowState::Running,
            death_reason: None,
            ended_at: None,
        }
    }

    #[test]
    fn sandbox_roundtrip_and_lifecycle() {
        crate::testdb::each_backend(sandbox_roundtrip_and_lifecycle_on);
    }

    fn sandbox_roundtrip_and_lifecycle_on(s: &Store) {
        let a = s.ensure_team("a").unwrap();
        let b = s.ensure_team("b").unwrap();
        let one = sample("one", a.id, 1000);
        s.insert_sandbox(&one).unwrap();
        s.insert_sandbox(&sample("two", b.id, 2000)).unwrap();
        assert_eq!(s.sandbox("one").unwrap(), Some(one.clone()));
        assert!(s.insert_sandbox(&one).is_err(), "duplicate id");
        assert_eq!(s.running_sandboxes(Some(a.id)).unwrap().len(), 1);
        assert_eq!(s.running_sandboxes(None).unwrap().len(), 2);
        s.set_end_at("one", 99).unwrap();
        assert_eq!(s.sandbox("one").unwrap().unwrap().end_at, 99);
        assert!(s.mark_ended("one", "killed", 5000).unwrap());
        assert!(
            !s.mark_ended("one", "timeout", 6000).unwrap(),
            "first reason wins"
        );
        let ended = s.sandbox("one").unwrap().unwrap();
        assert_eq!(ended.state, SandboxRowState::Ended);
        assert_eq!(ended.death_reason.as_deref(), Some("killed"));
        assert_eq!(
            ended.traffic_access_token, None,
            "an ended sandbox keeps no token"
        );
        assert!(s.running_sandboxes(Some(a.id)).unwrap().is_empty());
        assert_eq!(s.purge_ended(4000).unwrap(), Vec::<String>::new());
        assert_eq!(s.purge_ended(5001).unwrap(), vec!["one".to_string()]);
        assert_eq!(s.sandbox("one").unwrap(), None);
    }
}
