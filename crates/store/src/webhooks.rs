//! The teams' webhooks: where lifecycle events are delivered, which types, and the
//! secret each delivery is signed with. The secret must be kept in clear (it signs), so
//! it is never returned by the API, only used by the deliverer.

use rusqlite::{OptionalExtension, params};

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

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<(WebhookRow, String)> {
    Ok((
        WebhookRow {
            id: r.get(0)?,
            team_id: r.get(1)?,
            name: r.get(2)?,
            url: r.get(3)?,
            enabled: r.get::<_, i64>(4)? != 0,
            events: Vec::new(),
            secret: r.get(6)?,
            created_at: r.get(7)?,
        },
        r.get(5)?,
    ))
}

fn decode((mut w, events): (WebhookRow, String)) -> Result<WebhookRow> {
    w.events = serde_json::from_str(&events)?;
    Ok(w)
}

impl Store {
    /// Adds a webhook.
    pub fn insert_webhook(&self, w: &WebhookRow) -> Result<()> {
        self.conn().execute(
            &format!("INSERT INTO webhooks ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"),
            params![
                w.id,
                w.team_id,
                w.name,
                w.url,
                w.enabled as i64,
                serde_json::to_string(&w.events)?,
                w.secret,
                w.created_at
            ],
        )?;
        Ok(())
    }

    /// Replaces a webhook's fields (matched by id and team).
    pub fn update_webhook(&self, w: &WebhookRow) -> Result<()> {
        let n = self.conn().execute(
            "UPDATE webhooks SET name = ?3, url = ?4, enabled = ?5, events = ?6, secret = ?7
             WHERE id = ?1 AND team_id = ?2",
            params![
                w.id,
                w.team_id,
                w.name,
                w.url,
                w.enabled as i64,
                serde_json::to_string(&w.events)?,
                w.secret
            ],
        )?;
        if n == 0 {
            return Err(Error::NotFound(format!("webhook '{}' not found", w.id)));
        }
        Ok(())
    }

    /// Removes a webhook of `team_id`; `false` if there was none.
    pub fn delete_webhook(&self, team_id: i64, id: &str) -> Result<bool> {
        Ok(self.conn().execute(
            "DELETE FROM webhooks WHERE id = ?1 AND team_id = ?2",
            params![id, team_id],
        )? > 0)
    }

    /// One webhook of `team_id`.
    pub fn webhook(&self, team_id: i64, id: &str) -> Result<Option<WebhookRow>> {
        self.conn()
            .query_row(
                &format!("SELECT {COLUMNS} FROM webhooks WHERE id = ?1 AND team_id = ?2"),
                params![id, team_id],
                row,
            )
            .optional()?
            .map(decode)
            .transpose()
    }

    /// Webhooks of `team_id`, or of every team, oldest first.
    pub fn webhooks(&self, team_id: Option<i64>) -> Result<Vec<WebhookRow>> {
        let conn = self.conn();
        let mut st = conn.prepare(&format!(
            "SELECT {COLUMNS} FROM webhooks WHERE ?1 IS NULL OR team_id = ?1 ORDER BY created_at, id"
        ))?;
        let rows = st.query_map(params![team_id], row)?;
        rows.map(|r| decode(r?)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crud_is_per_team() {
        let s = Store::open_in_memory().unwrap();
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
