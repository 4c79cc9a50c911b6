//! Templates built through a cluster's replicas (docs/cluster.md, "Templates through a
//! replica"): a name belongs to the team that first built it, and its builds (their
//! records, logs and tags) live on one node, whichever replica the SDK talks to. The
//! built layers are in the object store, so every node can create from it.

use crate::db::{Row, args};
use crate::{Error, Result, Store};

/// One template name of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterTemplate {
    /// Template name (no tag).
    pub name: String,
    /// Owner team.
    pub team_id: i64,
    /// The node its builds run on and whose template store keeps its records.
    pub node_id: String,
    /// Unix ms.
    pub created_at: i64,
}

const COLUMNS: &str = "name, team_id, node_id, created_at";

fn row(r: &Row) -> Result<ClusterTemplate> {
    Ok(ClusterTemplate {
        name: r.get(0)?,
        team_id: r.get(1)?,
        node_id: r.get(2)?,
        created_at: r.get(3)?,
    })
}

impl Store {
    /// Template `name` for `team_id`: the existing record if the team has it, else a new
    /// one on `node_id`; another team's name is a [`Error::Conflict`].
    pub fn claim_cluster_template(
        &self,
        name: &str,
        team_id: i64,
        node_id: &str,
        now: i64,
    ) -> Result<ClusterTemplate> {
        self.with_conn(|c| {
            c.execute(
                &format!(
                    "INSERT INTO cluster_templates ({COLUMNS}) VALUES (?1, ?2, ?3, ?4) \
                     ON CONFLICT (name) DO NOTHING"
                ),
                args![name, team_id, node_id, now],
            )?;
            let t = c
                .query_opt(
                    &format!("SELECT {COLUMNS} FROM cluster_templates WHERE name = ?1"),
                    args![name],
                )?
                .as_ref()
                .map(row)
                .transpose()?
                .ok_or_else(|| Error::Conflict(format!("template '{name}' vanished")))?;
            if t.team_id != team_id {
                return Err(Error::Conflict(format!(
                    "template name '{name}' belongs to another team"
                )));
            }
            Ok(t)
        })
    }

    /// Template `name`'s record, whatever its team.
    pub fn cluster_template(&self, name: &str) -> Result<Option<ClusterTemplate>> {
        self.with_conn(|c| {
            c.query_opt(
                &format!("SELECT {COLUMNS} FROM cluster_templates WHERE name = ?1"),
                args![name],
            )?
            .as_ref()
            .map(row)
            .transpose()
        })
    }

    /// A team's templates (every team's with `None`), by name.
    pub fn cluster_templates(&self, team_id: Option<i64>) -> Result<Vec<ClusterTemplate>> {
        self.with_conn(|c| {
            let rows = match team_id {
                Some(t) => c.query(
                    &format!(
                        "SELECT {COLUMNS} FROM cluster_templates WHERE team_id = ?1 ORDER BY name"
                    ),
                    args![t],
                )?,
                None => c.query(
                    &format!("SELECT {COLUMNS} FROM cluster_templates ORDER BY name"),
                    &[],
                )?,
            };
            rows.iter().map(row).collect()
        })
    }

    /// Forgets template `name`; whether it was there.
    pub fn delete_cluster_template(&self, name: &str) -> Result<bool> {
        let n = self.with_conn(|c| {
            c.execute("DELETE FROM cluster_templates WHERE name = ?1", args![name])
        })?;
        Ok(n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_belongs_to_one_team() {
        crate::testdb::each_backend(a_name_belongs_to_one_team_on);
    }

    fn a_name_belongs_to_one_team_on(s: &Store) {
        let a = s.ensure_team("a").unwrap();
        let b = s.ensure_team("b").unwrap();
        let t = s.claim_cluster_template("web", a.id, "n1", 5).unwrap();
        assert_eq!(t.node_id, "n1");
        // The same team again: the first record (its node) stays.
        let again = s.claim_cluster_template("web", a.id, "n2", 6).unwrap();
        assert_eq!(again, t);
        assert!(matches!(
            s.claim_cluster_template("web", b.id, "n2", 7),
            Err(Error::Conflict(_))
        ));
        s.claim_cluster_template("api", b.id, "n2", 8).unwrap();
        assert_eq!(s.cluster_templates(Some(a.id)).unwrap(), vec![t.clone()]);
        assert_eq!(s.cluster_templates(None).unwrap().len(), 2);
        assert_eq!(s.cluster_template("web").unwrap(), Some(t));
        assert!(s.delete_cluster_template("web").unwrap());
        assert!(!s.delete_cluster_template("web").unwrap());
        assert_eq!(s.cluster_template("web").unwrap(), None);
    }
}
