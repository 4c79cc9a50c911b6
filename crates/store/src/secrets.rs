//! Secret records: name, metadata, version and the value **sealed** (encrypted and
//! authenticated by the control plane before it gets here: this module never sees a
//! value in clear, and nothing reads the sealed bytes back out except the one method
//! the egress layer's resolver uses).

use std::collections::BTreeMap;

use crate::db::{Row, args};
use crate::{Error, Result, Store};

/// One secret as stored (without its sealed value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretRow {
    /// `sec_…`.
    pub id: String,
    /// Owner team.
    pub team_id: i64,
    /// Canonical (lowercase) name, unique within the team.
    pub name: String,
    /// Current version (1 after create, +1 per update).
    pub version: i64,
    /// User metadata.
    pub metadata: BTreeMap<String, String>,
    /// Unix ms.
    pub created_at: i64,
    /// Unix ms.
    pub updated_at: i64,
}

const COLUMNS: &str = "id, team_id, name, version, metadata, created_at, updated_at";

fn row(r: &Row) -> Result<SecretRow> {
    let metadata: String = r.get(4)?;
    Ok(SecretRow {
        id: r.get(0)?,
        team_id: r.get(1)?,
        name: r.get(2)?,
        version: r.get(3)?,
        metadata: serde_json::from_str(&metadata)?,
        created_at: r.get(5)?,
        updated_at: r.get(6)?,
    })
}

impl Store {
    /// Inserts a secret with its sealed first value; a name the team already uses is a
    /// [`Error::Conflict`].
    pub fn insert_secret(&self, s: &SecretRow, sealed: &[u8]) -> Result<()> {
        let metadata = serde_json::to_string(&s.metadata)?;
        let r = self.with_conn(|c| {
            c.execute(
                &format!(
                    "INSERT INTO secrets ({COLUMNS}, sealed) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"
                ),
                args![
                    s.id.as_str(),
                    s.team_id,
                    s.name.as_str(),
                    s.version,
                    metadata,
                    s.created_at,
                    s.updated_at,
                    sealed
                ],
            )
        });
        match r {
            Err(e) if e.is_unique_violation() => Err(Error::Conflict(format!(
                "Secret with name '{}' already exists",
                s.name
            ))),
            r => r.map(drop),
        }
    }

    /// A team's secret by id (`sec_…`) or canonical name.
    pub fn secret(&self, team_id: i64, id_or_name: &str) -> Result<Option<SecretRow>> {
        self.with_conn(|c| {
            c.query_opt(
                &format!(
                    "SELECT {COLUMNS} FROM secrets WHERE team_id = ?1 AND (id = ?2 OR name = ?2)"
                ),
                args![team_id, id_or_name],
            )?
            .as_ref()
            .map(row)
            .transpose()
        })
    }

    /// A team's secrets ordered by name, `limit` of them after the name `after`.
    pub fn secrets(
        &self,
        team_id: i64,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<SecretRow>> {
        self.with_conn(|c| {
            c.query(
                &format!(
                    "SELECT {COLUMNS} FROM secrets WHERE team_id = ?1 AND (CAST(?2 AS TEXT) IS NULL OR name > ?2) ORDER BY name LIMIT ?3"
                ),
                args![team_id, after, limit as i64],
            )?
            .iter()
            .map(row)
            .collect()
        })
    }

    /// Replaces a secret's sealed value (version + 1) and, when given, its metadata.
    /// Returns the updated record, `None` if it does not exist.
    pub fn update_secret(
        &self,
        team_id: i64,
        id: &str,
        sealed: &[u8],
        metadata: Option<&BTreeMap<String, String>>,
        now: i64,
    ) -> Result<Option<SecretRow>> {
        let metadata = metadata.map(serde_json::to_string).transpose()?;
        let n = self.with_conn(|c| {
            c.execute(
                "UPDATE secrets SET sealed = ?1, version = version + 1, updated_at = ?2,
                     metadata = COALESCE(?3, metadata)
                 WHERE team_id = ?4 AND id = ?5",
                args![sealed, now, metadata, team_id, id],
            )
        })?;
        if n == 0 {
            return Ok(None);
        }
        self.secret(team_id, id)
    }

    /// The id, version and sealed value of a team's secret by canonical name, for the
    /// one reader that unseals it (the egress layer's header injection).
    pub fn sealed_secret(
        &self,
        team_id: i64,
        name: &str,
    ) -> Result<Option<(String, i64, Vec<u8>)>> {
        self.with_conn(|c| {
            c.query_opt(
                "SELECT id, version, sealed FROM secrets WHERE team_id = ?1 AND name = ?2",
                args![team_id, name],
            )?
            .map(|r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .transpose()
        })
    }

    /// Deletes a secret; returns whether it existed.
    pub fn delete_secret(&self, team_id: i64, id: &str) -> Result<bool> {
        let n = self.with_conn(|c| {
            c.execute(
                "DELETE FROM secrets WHERE team_id = ?1 AND id = ?2",
                args![team_id, id],
            )
        })?;
        Ok(n > 0)
    }

    /// Whether a secret row with this id exists (any team): ids must be unique.
    pub fn secret_id_taken(&self, id: &str) -> Result<bool> {
        self.with_conn(|c| {
            Ok(
                c.query_opt("SELECT 1 FROM secrets WHERE id = ?1", args![id])?
                    .is_some(),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_update_list_delete() {
        crate::testdb::each_backend(create_update_list_delete_on);
    }

    fn create_update_list_delete_on(s: &Store) {
        let t = s.ensure_team("t").unwrap();
        let row = |id: &str, name: &str| SecretRow {
            id: id.into(),
            team_id: t.id,
            name: name.into(),
            version: 1,
            metadata: [("m".to_string(), "1".to_string())].into(),
            created_at: 1,
            updated_at: 1,
        };
        s.insert_secret(&row("sec_a", "alpha"), b"sealed-1")
            .unwrap();
        s.insert_secret(&row("sec_b", "beta"), b"sealed-2").unwrap();
        assert!(matches!(
            s.insert_secret(&row("sec_c", "alpha"), b"x"),
            Err(Error::Conflict(_))
        ));
        assert_eq!(s.secret(t.id, "alpha").unwrap().unwrap().id, "sec_a");
        assert_eq!(s.secret(t.id, "sec_b").unwrap().unwrap().name, "beta");
        let u = s
            .update_secret(t.id, "sec_a", b"sealed-3", Some(&BTreeMap::new()), 5)
            .unwrap()
            .unwrap();
        assert_eq!((u.version, u.updated_at, u.metadata.len()), (2, 5, 0));
        let u = s
            .update_secret(t.id, "sec_a", b"sealed-4", None, 6)
            .unwrap()
            .unwrap();
        assert_eq!(u.version, 3);
        assert_eq!(
            s.sealed_secret(t.id, "alpha").unwrap().unwrap(),
            ("sec_a".to_string(), 3, b"sealed-4".to_vec())
        );
        let page = s.secrets(t.id, None, 1).unwrap();
        assert_eq!(page.len(), 1);
        let rest = s.secrets(t.id, Some(&page[0].name), 10).unwrap();
        assert_eq!(rest.len(), 1);
        assert!(s.delete_secret(t.id, "sec_a").unwrap());
        assert!(!s.delete_secret(t.id, "sec_a").unwrap());
        let other = s.ensure_team("o").unwrap();
        assert!(s.secret(other.id, "beta").unwrap().is_none());
    }
}
