//! Sandbox lifecycle events, as E2B's events API serves them: one row per event (its
//! JSON body as served, plus the columns the queries filter on), kept for a retention
//! period and then purged.

use crate::db::{Conn, Value, args};
use crate::{Result, Store};

/// One stored event.
#[derive(Debug, Clone, PartialEq)]
pub struct EventRow {
    /// The event's id (a uuid).
    pub id: String,
    /// Owner team.
    pub team_id: i64,
    /// The sandbox it is about.
    pub sandbox_id: String,
    /// `sandbox.lifecycle.created`, …
    pub kind: String,
    /// Unix ms.
    pub at: i64,
    /// The event as served (a JSON object).
    pub body: String,
}

/// Which events a query returns.
#[derive(Debug, Clone, Default)]
pub struct EventQuery {
    /// Only this team's.
    pub team_id: i64,
    /// Only this sandbox's.
    pub sandbox_id: Option<String>,
    /// Only these types (empty: all).
    pub kinds: Vec<String>,
    /// Skip this many.
    pub offset: u64,
    /// At most this many.
    pub limit: u64,
    /// Oldest first (default: newest first).
    pub ascending: bool,
}

impl Store {
    /// Records an event.
    pub fn insert_event(&self, e: &EventRow) -> Result<()> {
        self.insert_events(std::slice::from_ref(e))
    }

    /// Records `events` in one transaction: one commit for a burst of creates' events
    /// instead of one each.
    pub fn insert_events(&self, events: &[EventRow]) -> Result<()> {
        match events {
            [] => Ok(()),
            [e] => self.with_conn(|c| insert_one(c, e)),
            _ => self.transaction(|c| events.iter().try_for_each(|e| insert_one(c, e))),
        }
    }

    /// The events matching `q`, in recording order (or its reverse).
    pub fn events(&self, q: &EventQuery) -> Result<Vec<EventRow>> {
        let mut sql = String::from(
            "SELECT id, team_id, sandbox_id, type, at, body FROM sandbox_events WHERE team_id = ?1",
        );
        let mut args: Vec<Value> = vec![q.team_id.into()];
        let placeholder = |args: &mut Vec<Value>, v: Value| {
            args.push(v);
            format!("?{}", args.len())
        };
        if let Some(sid) = &q.sandbox_id {
            let p = placeholder(&mut args, sid.clone().into());
            sql.push_str(&format!(" AND sandbox_id = {p}"));
        }
        if !q.kinds.is_empty() {
            let ps: Vec<String> = q
                .kinds
                .iter()
                .map(|k| placeholder(&mut args, k.clone().into()))
                .collect();
            sql.push_str(&format!(" AND type IN ({})", ps.join(", ")));
        }
        sql.push_str(if q.ascending {
            " ORDER BY seq ASC"
        } else {
            " ORDER BY seq DESC"
        });
        let limit = placeholder(&mut args, q.limit.into());
        let offset = placeholder(&mut args, q.offset.into());
        sql.push_str(&format!(" LIMIT {limit} OFFSET {offset}"));
        self.with_conn(|c| {
            c.query(&sql, &args)?
                .iter()
                .map(|r| {
                    Ok(EventRow {
                        id: r.get(0)?,
                        team_id: r.get(1)?,
                        sandbox_id: r.get(2)?,
                        kind: r.get(3)?,
                        at: r.get(4)?,
                        body: r.get(5)?,
                    })
                })
                .collect()
        })
    }

    /// Deletes events recorded before `before` (unix ms); returns how many.
    pub fn purge_events(&self, before: i64) -> Result<usize> {
        let n = self
            .with_conn(|c| c.execute("DELETE FROM sandbox_events WHERE at < ?1", args![before]))?;
        Ok(n as usize)
    }
}

fn insert_one(c: &mut Conn<'_>, e: &EventRow) -> Result<()> {
    c.execute(
        "INSERT INTO sandbox_events (id, team_id, sandbox_id, type, at, body)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        args![
            e.id.as_str(),
            e.team_id,
            e.sandbox_id.as_str(),
            e.kind.as_str(),
            e.at,
            e.body.as_str()
        ],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(team: i64, sandbox: &str, kind: &str, at: i64) -> EventRow {
        EventRow {
            id: format!("{sandbox}-{kind}-{at}"),
            team_id: team,
            sandbox_id: sandbox.into(),
            kind: kind.into(),
            at,
            body: "{}".into(),
        }
    }

    #[test]
    fn filters_orders_pages_and_purges() {
        crate::testdb::each_backend(filters_orders_pages_and_purges_on);
    }

    fn filters_orders_pages_and_purges_on(s: &Store) {
        let a = s.ensure_team("a").unwrap().id;
        let b = s.ensure_team("b").unwrap().id;
        s.insert_event(&ev(a, "s1", "sandbox.lifecycle.created", 10))
            .unwrap();
        s.insert_event(&ev(a, "s1", "sandbox.lifecycle.updated", 20))
            .unwrap();
        s.insert_event(&ev(a, "s2", "sandbox.lifecycle.created", 30))
            .unwrap();
        s.insert_event(&ev(b, "s3", "sandbox.lifecycle.created", 40))
            .unwrap();
        s.insert_event(&ev(a, "s1", "sandbox.lifecycle.killed", 50))
            .unwrap();
        let q = |f: &dyn Fn(&mut EventQuery)| {
            let mut q = EventQuery {
                team_id: a,
                limit: 10,
                ..Default::default()
            };
            f(&mut q);
            s.events(&q)
                .unwrap()
                .into_iter()
                .map(|e| e.at)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            q(&|_| {}),
            vec![50, 30, 20, 10],
            "newest first, team a only"
        );
        assert_eq!(q(&|q| q.ascending = true), vec![10, 20, 30, 50]);
        assert_eq!(q(&|q| q.sandbox_id = Some("s1".into())), vec![50, 20, 10]);
        assert_eq!(
            q(&|q| q.kinds = vec!["sandbox.lifecycle.created".into()]),
            vec![30, 10]
        );
        assert_eq!(
            q(&|q| {
                q.offset = 1;
                q.limit = 2
            }),
            vec![30, 20]
        );
        assert_eq!(s.purge_events(25).unwrap(), 2);
        assert_eq!(q(&|_| {}), vec![50, 30]);
    }

    #[test]
    fn a_batch_is_stored_whole_or_not_at_all() {
        crate::testdb::each_backend(a_batch_is_stored_whole_or_not_at_all_on);
    }

    fn a_batch_is_stored_whole_or_not_at_all_on(s: &Store) {
        let a = s.ensure_team("a").unwrap().id;
        let ats = |s: &Store| {
            let q = EventQuery {
                team_id: a,
                limit: 100,
                ascending: true,
                ..Default::default()
            };
            s.events(&q)
                .unwrap()
                .into_iter()
                .map(|e| e.at)
                .collect::<Vec<_>>()
        };
        let batch: Vec<EventRow> = (1..=3)
            .map(|i| ev(a, &format!("s{i}"), "sandbox.lifecycle.created", i))
            .collect();
        s.insert_events(&batch).unwrap();
        assert_eq!(ats(s), vec![1, 2, 3]);
        // A batch with a row whose id is taken fails as a whole: its other row is not
        // stored either (the caller then stores them one by one).
        let again = vec![
            ev(a, "s9", "sandbox.lifecycle.created", 9),
            batch[0].clone(),
        ];
        assert!(s.insert_events(&again).is_err());
        assert_eq!(ats(s), vec![1, 2, 3]);
        s.insert_events(&[]).unwrap();
    }
}
