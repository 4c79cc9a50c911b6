//! Volume records: which team owns a volume, its name (unique per team) and size. The
//! volume's files are the node's (`cubicle_node::volume`); its content-API token is
//! derived from the id and the server's key, never stored.

use crate::db::{Row, args};
use crate::{Error, Result, Store};

/// One volume as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRow {
    /// Volume id (a UUID).
    pub id: String,
    /// Owner team.
    pub team_id: i64,
    /// Name, unique within the team (`^[a-zA-Z0-9_-]+$`).
    pub name: String,
    /// Size limit, MiB.
    pub size_mb: u64,
    /// Unix ms.
    pub created_at: i64,
}

const COLUMNS: &str = "id, team_id, name, size_mb, created_at";

fn row(r: &Row) -> Result<VolumeRow> {
    Ok(VolumeRow {
        id: r.get(0)?,
        team_id: r.get(1)?,
        name: r.get(2)?,
        size_mb: r.get(3)?,
        created_at: r.get(4)?,
    })
}

impl Store {
    /// Inserts a volume record; a name the team already uses is a [`Error::Conflict`].
    pub fn insert_volume(&self, v: &VolumeRow) -> Result<()> {
        let r = self.with_conn(|c| {
            c.execute(
                &format!("INSERT INTO volumes ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5)"),
                args![
                    v.id.as_str(),
                    v.team_id,
                    v.name.as_str(),
                    v.size_mb,
                    v.created_at
                ],
            )
        });
        match r {
            Err(e) if e.is_unique_violation() => Err(Error::Conflict(format!(
                "Volume with name '{}' already exists",
                v.name
            ))),
            r => r.map(drop),
        }
    }

    /// A volume by id, whatever its team.
    pub fn volume(&self, id: &str) -> Result<Option<VolumeRow>> {
        self.with_conn(|c| {
            c.query_opt(
                &format!("SELECT {COLUMNS} FROM volumes WHERE id = ?1"),
                args![id],
            )?
            .as_ref()
            .map(row)
            .transpose()
        })
    }

    /// A team's volume by name.
    pub fn volume_by_name(&self, team_id: i64, name: &str) -> Result<Option<VolumeRow>> {
        self.with_conn(|c| {
            c.query_opt(
                &format!("SELECT {COLUMNS} FROM volumes WHERE team_id = ?1 AND name = ?2"),
                args![team_id, name],
            )?
            .as_ref()
            .map(row)
            .transpose()
        })
    }

    /// A team's volumes (every team's with `None`), oldest first.
    pub fn volumes(&self, team_id: Option<i64>) -> Result<Vec<VolumeRow>> {
        self.with_conn(|c| {
            c.query(
                &format!(
                    "SELECT {COLUMNS} FROM volumes WHERE (CAST(?1 AS BIGINT) IS NULL OR team_id = ?1) ORDER BY created_at, id"
                ),
                args![team_id],
            )?
            .iter()
            .map(row)
            .collect()
        })
    }

    /// Records the node volume `id` lives on (a cluster's replicas place it there).
    pub fn set_volume_node(&self, id: &str, node_id: &str) -> Result<()> {
        self.with_conn(|c| {
            c.execute(
                "UPDATE volumes SET node_id = ?2 WHERE id = ?1",
                args![id, node_id],
            )
        })
        .map(drop)
    }

    /// The node volume `id` lives on (`None`: unknown volume, or a single host's).
    pub fn volume_node(&self, id: &str) -> Result<Option<String>> {
        self.with_conn(|c| {
            match c.query_opt("SELECT node_id FROM volumes WHERE id = ?1", args![id])? {
                Some(r) => r.get::<Option<String>>(0),
                None => Ok(None),
            }
        })
    }

    /// Deletes a volume record; returns whether it existed.
    pub fn delete_volume(&self, id: &str) -> Result<bool> {
        let n = self.with_conn(|c| c.execute("DELETE FROM volumes WHERE id = ?1", args![id]))?;
        Ok(n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_per_team() {
        crate::testdb::each_backend(names_are_unique_per_team_on);
    }

    fn names_are_unique_per_team_on(s: &Store) {
        let a = s.ensure_team("a").unwrap();
        let b = s.ensure_team("b").unwrap();
        let v = |id: &str, team: i64, name: &str| VolumeRow {
            id: id.into(),
            team_id: team,
            name: name.into(),
            size_mb: 1024,
            created_at: 1,
        };
        s.insert_volume(&v("1", a.id, "data")).unwrap();
        assert!(matches!(
            s.insert_volume(&v("2", a.id, "data")),
            Err(Error::Conflict(m)) if m.contains("already exists")
        ));
        s.insert_volume(&v("3", b.id, "data")).unwrap();
        assert_eq!(s.volume_by_name(a.id, "data").unwrap().unwrap().id, "1");
        assert_eq!(s.volumes(Some(b.id)).unwrap().len(), 1);
        assert_eq!(s.volumes(None).unwrap().len(), 2);
        assert_eq!(s.volume_node("1").unwrap(), None);
        s.set_volume_node("1", "n2").unwrap();
        assert_eq!(s.volume_node("1").unwrap().as_deref(), Some("n2"));
        assert!(s.delete_volume("1").unwrap());
        assert!(!s.delete_volume("1").unwrap());
        assert_eq!(s.volume_node("1").unwrap(), None);
        assert!(s.volume("1").unwrap().is_none());
    }
}
