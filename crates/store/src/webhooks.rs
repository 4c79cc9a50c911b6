//! The teams' webhooks: where lifecycle events are delivered, which types, and the
//! secret each delivery is signed with. The secret must be kept in clear (it signs), so
//! it is never returned by the API, only used by the deliverer.

use crate::db::{Row, args};
use crate::{Error, Result, Store};

/// One webhook.
#[derive(Debug, Clone, PartialEq)]
pub struct WebhookRow {
    /// Id (a uuid).
    pub id: String,
    /// Owner team.
    pub team_id: i64,
    /// A name for humans.
    pub name: String,
    /// Where events are POSTed.
    pub url: String,
    /// Whether events are delivered.
    pub enabled: bool,
    /// Event types delivered (`sandbox.lifecycle.*`).
    pub events: Vec<String>,
    /// Signs each delivery.
    pub secret: String,
    /// Unix ms.
    pub created_at: i64,
}

const COLUMNS: &str = "id, team_id, name, url, enabled, events, secret, created_at";

fn row(r: &Row) -> Result<WebhookRow> {
    let events: String = r.get(5)?;
    Ok(WebhookRow {
        id: r.get(0)?,
        team_id: r.get(1)?,
        name: r.get(2)?,
        url: r.get(3)?,
        enabled: r.get(4)?,
        events: serde_json::from_str(&events)?,
        secret: r.get(6)?,
        created_at: r.get(7)?,
    })
}

impl Store {
    /// Adds a webhook.
    pub fn insert_webhook(&self, w: &WebhookRow) -> Result<()> {
        let events = serde_json::to_string(&w.events)?;
        self.with_conn(|c| {
            c.execute(
                &format!(
                    "INSERT INTO webhooks ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"
                ),
                args![
                    w.id.as_str(),
                    w.team_id,
                    w.name.as_str(),
                    w.url.as_str(),
                    w.enabled,
                    events,
                    w.secret.as_str(),
                    w.created_at
                ],
            )
        })?;
        Ok(())
    }

    /// Replaces a webhook's fields (matched by id and team).
    pub fn update_webhook(&self, w: &WebhookRow) -> Result<()> {
        let events = serde_json::to_string(&w.events)?;
        let n = self.with_conn(|c| {
            c.execute(
                "UPDATE webhooks SET name = ?3, url = ?4, enabled = ?5, events = ?6, secret = ?7
                 WHERE id = ?1 AND team_id = ?2",
                args![
                    w.id.as_str(),
                    w.team_id,
                    w.name.as_str(),
                    w.url.as_str(),
                    w.enabled,
                    events,
                    w.secret.as_str()
                ],
            )
        })?;
        if n == 0 {
            return Err(Error::NotFound(format!("webhook '{}' not found", w.id)));
        }
        Ok(())
    }

    /// Removes a webhook of `team_id`; `false` if there was none.
    pub fn delete_webhook(&self, team_id: i64, id: &str) -> Result<bool> {
        let n = self.with_conn(|c| {
            c.execute(
                "DELETE FROM webhooks WHERE id = ?1 AND team_id = ?2",
                args![id, team_id],
            )
        })?;
        Ok(n > 0)
    }

    /// One webhook of `team_id`.
    pub fn webhook(&self, team_id: i64, id: &str) -> Result<Option<WebhookRow>> {
        self.with_conn(|c| {
            c.query_opt(
                &format!("SELECT {COLUMNS} FROM webhooks WHERE id = ?1 AND team_id = ?2"),
                args![id, team_id],
            )?
            .as_ref()
            .map(row)
            .transpose()
        })
    }

    /// Webhooks of `team_id`, or of every team, oldest first.
    pub fn webhooks(&self, team_id: Option<i64>) -> Result<Vec<WebhookRow>> {
        self.with_conn(|c| {
            c.query(
                &format!(
                    "SELECT {COLUMNS} FROM webhooks WHERE CAST(?1 AS BIGINT) IS NULL OR team_id = ?1 ORDER BY created_at, id"
                ),
                args![team_id],
            )?
            .iter()
            .map(row)
            .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crud_is_per_team() {
        crate::testdb::each_backend(crud_is_per_team_on);
    }

    fn crud_is_per_team_on(s: &Store) {
        let a = s.ensure_team("a").unwrap().id;
        let b = s.ensure_team("b").unwrap().id;
        let mut w = WebhookRow {
            id: "w1".into(),
            team_id: a,
            name: "hook".into(),
            url: "http://127.0.0.1:9/x".into(),
            enabled: true,
            events: vec!["sandbox.lifecycle.created".into()],
            secret: "s3cret".into(),
            created_at: 1,
        };
        s.insert_webhook(&w).unwrap();
        assert_eq!(s.webhook(a, "w1").unwrap().as_ref(), Some(&w));
        assert_eq!(s.webhook(b, "w1").unwrap(), None, "other team");
        w.enabled = false;
        w.events.push("sandbox.lifecycle.killed".into());
        s.update_webhook(&w).unwrap();
        assert_eq!(s.webhooks(Some(a)).unwrap(), vec![w.clone()]);
        assert_eq!(s.webhooks(None).unwrap().len(), 1);
        let mut other = w.clone();
        other.team_id = b;
        assert!(matches!(s.update_webhook(&other), Err(Error::NotFound(_))));
        assert!(!s.delete_webhook(b, "w1").unwrap());
        assert!(s.delete_webhook(a, "w1").unwrap());
        assert!(s.webhooks(None).unwrap().is_empty());
    }
}
