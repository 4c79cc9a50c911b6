//! The one place that knows there are two database engines. Every query in this crate is
//! written once, in the SQL both SQLite and PostgreSQL accept (`?1`-style placeholders,
//! `ON CONFLICT … DO NOTHING`, `RETURNING`, `CAST(… AS BIGINT)`), and runs through
//! [`Conn`], which turns it into the engine's call: placeholders become `$1` for
//! PostgreSQL, values ([`Value`]) are converted to the column types the engine reports,
//! and rows come back as [`Row`]s of [`Value`]s read with [`Row::get`].
//!
//! What differs between the engines stays here or in [`Dialect`]: row locks (`FOR
//! UPDATE` / `FOR SHARE` exist only in PostgreSQL; a SQLite write transaction holds the
//! whole file), how a transaction starts, and which errors mean "unique key taken" or
//! "try the transaction again". The migrations are per engine (`schema.rs`).

use crate::postgres::PgConn;
use crate::{Error, Result};

/// Which SQL engine a [`Conn`] talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// One SQLite file (single host).
    Sqlite,
    /// A PostgreSQL server (shared by a cluster's replicas and nodes).
    Postgres,
}

impl Dialect {
    /// The clause that locks the selected rows against concurrent writers until the
    /// transaction ends: empty for SQLite, whose write transactions are exclusive.
    pub(crate) fn for_update(self) -> &'static str {
        match self {
            Dialect::Sqlite => "",
            Dialect::Postgres => " FOR UPDATE",
        }
    }

    /// Like [`Dialect::for_update`], but other readers that also only share-lock go on.
    pub(crate) fn for_share(self) -> &'static str {
        match self {
            Dialect::Sqlite => "",
            Dialect::Postgres => " FOR SHARE",
        }
    }
}

/// A value passed to or read from a query. Booleans are integers (0/1) on this side;
/// the PostgreSQL conversion writes them into `BOOLEAN` columns.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// SQL NULL.
    Null,
    /// Any integer column (and booleans).
    Int(i64),
    /// Text.
    Text(String),
    /// Bytes.
    Blob(Vec<u8>),
}

impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::Int(v)
    }
}
impl From<u32> for Value {
    fn from(v: u32) -> Self {
        Value::Int(v.into())
    }
}
impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::Int(v.min(i64::MAX as u64) as i64)
    }
}
impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Int(v.into())
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::Text(v.to_string())
    }
}
impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::Text(v)
    }
}
impl From<&String> for Value {
    fn from(v: &String) -> Self {
        Value::Text(v.clone())
    }
}
impl From<&[u8]> for Value {
    fn from(v: &[u8]) -> Self {
        Value::Blob(v.to_vec())
    }
}
impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(v: Option<T>) -> Self {
        v.map_or(Value::Null, Into::into)
    }
}

/// Query arguments: `args![a, b, c]` is `&[Value::from(a), …]`.
macro_rules! args {
    ($($x:expr),* $(,)?) => { &[$($crate::db::Value::from($x)),*][..] };
}
pub(crate) use args;

/// One result row.
#[derive(Debug, Clone)]
pub struct Row(pub(crate) Vec<Value>);

impl Row {
    /// Column `i` as a `T`.
    pub fn get<T: FromValue>(&self, i: usize) -> Result<T> {
        let v = self.0.get(i).unwrap_or(&Value::Null);
        T::from_value(v).ok_or_else(|| {
            Error::Column(format!(
                "column {i} holds {v:?}, not a {}",
                std::any::type_name::<T>()
            ))
        })
    }
}

/// Types a column can be read as.
pub trait FromValue: Sized {
    /// `None` when the value does not fit.
    fn from_value(v: &Value) -> Option<Self>;
}
impl FromValue for i64 {
    fn from_value(v: &Value) -> Option<Self> {
        match v {
            Value::Int(n) => Some(*n),
            _ => None,
        }
    }
}
impl FromValue for u32 {
    fn from_value(v: &Value) -> Option<Self> {
        i64::from_value(v).and_then(|n| u32::try_from(n).ok())
    }
}
impl FromValue for u64 {
    fn from_value(v: &Value) -> Option<Self> {
        i64::from_value(v).and_then(|n| u64::try_from(n).ok())
    }
}
impl FromValue for bool {
    fn from_value(v: &Value) -> Option<Self> {
        i64::from_value(v).map(|n| n != 0)
    }
}
impl FromValue for String {
    fn from_value(v: &Value) -> Option<Self> {
        match v {
            Value::Text(s) => Some(s.clone()),
            _ => None,
        }
    }
}
impl FromValue for Vec<u8> {
    fn from_value(v: &Value) -> Option<Self> {
        match v {
            Value::Blob(b) => Some(b.clone()),
            Value::Text(s) => Some(s.clone().into_bytes()),
            _ => None,
        }
    }
}
impl<T: FromValue> FromValue for Option<T> {
    fn from_value(v: &Value) -> Option<Self> {
        match v {
            Value::Null => Some(None),
            v => T::from_value(v).map(Some),
        }
    }
}

/// How a transaction isolates itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isolation {
    /// PostgreSQL's default (each statement sees what was committed before it); the
    /// transaction's own row locks (`FOR UPDATE`) give it the order it needs.
    ReadCommitted,
}

/// A connection, borrowed for one call or one transaction.
pub(crate) enum Conn<'a> {
    Sqlite(&'a rusqlite::Connection),
    Postgres(&'a mut PgConn),
}

impl Conn<'_> {
    pub(crate) fn dialect(&self) -> Dialect {
        match self {
            Conn::Sqlite(_) => Dialect::Sqlite,
            Conn::Postgres(_) => Dialect::Postgres,
        }
    }

    /// Runs a statement; returns how many rows it changed.
    pub(crate) fn execute(&mut self, sql: &str, args: &[Value]) -> Result<u64> {
        match self {
            Conn::Sqlite(c) => {
                let mut st = c.prepare_cached(sql)?;
                Ok(st.execute(rusqlite::params_from_iter(args.iter()))? as u64)
            }
            Conn::Postgres(c) => c.execute(sql, args),
        }
    }

    /// Runs a query; returns every row.
    pub(crate) fn query(&mut self, sql: &str, args: &[Value]) -> Result<Vec<Row>> {
        match self {
            Conn::Sqlite(c) => {
                let mut st = c.prepare_cached(sql)?;
                let n = st.column_count();
                let mut rows = st.query(rusqlite::params_from_iter(args.iter()))?;
                let mut out = Vec::new();
                while let Some(r) = rows.next()? {
                    let mut vals = Vec::with_capacity(n);
                    for i in 0..n {
                        vals.push(match r.get_ref(i)? {
                            rusqlite::types::ValueRef::Null => Value::Null,
                            rusqlite::types::ValueRef::Integer(v) => Value::Int(v),
                            rusqlite::types::ValueRef::Real(v) => Value::Int(v as i64),
                            rusqlite::types::ValueRef::Text(t) => {
                                Value::Text(String::from_utf8_lossy(t).into_owned())
                            }
                            rusqlite::types::ValueRef::Blob(b) => Value::Blob(b.to_vec()),
                        });
                    }
                    out.push(Row(vals));
                }
                Ok(out)
            }
            Conn::Postgres(c) => c.query(sql, args),
        }
    }

    /// The first row, if any.
    pub(crate) fn query_opt(&mut self, sql: &str, args: &[Value]) -> Result<Option<Row>> {
        Ok(self.query(sql, args)?.into_iter().next())
    }

    /// The first row (a query that always returns one, like `COUNT(*)`).
    pub(crate) fn query_one(&mut self, sql: &str, args: &[Value]) -> Result<Row> {
        self.query_opt(sql, args)?
            .ok_or_else(|| Error::Column(format!("no row from {sql}")))
    }

    /// Runs statements without arguments (migrations, transaction control).
    pub(crate) fn batch(&mut self, sql: &str) -> Result<()> {
        match self {
            Conn::Sqlite(c) => Ok(c.execute_batch(sql)?),
            Conn::Postgres(c) => c.batch(sql),
        }
    }

    /// Runs `f` in a transaction: committed when it returns `Ok`, rolled back when it
    /// fails. PostgreSQL transactions that lost a serialization race or a deadlock are
    /// run again (a few times); SQLite's (`BEGIN IMMEDIATE`) wait for the file's lock.
    pub(crate) fn transaction<T>(
        &mut self,
        isolation: Isolation,
        mut f: impl FnMut(&mut Conn<'_>) -> Result<T>,
    ) -> Result<T> {
        let begin = match (self.dialect(), isolation) {
            (Dialect::Sqlite, _) => "BEGIN IMMEDIATE",
            (Dialect::Postgres, Isolation::ReadCommitted) => "BEGIN ISOLATION LEVEL READ COMMITTED",
        };
        let mut attempt = 0;
        loop {
            attempt += 1;
            self.batch(begin)?;
            let r = f(self).and_then(|v| self.batch("COMMIT").map(|()| v));
            match r {
                Ok(v) => return Ok(v),
                Err(e) => {
                    // The rollback's own failure (connection gone) is secondary.
                    let _ = self.batch("ROLLBACK");
                    if attempt < 8 && e.is_retryable() {
                        continue;
                    }
                    return Err(e);
                }
            }
        }
    }
}

/// Rewrites `?N` placeholders as PostgreSQL's `$N` (outside quoted text).
pub(crate) fn to_postgres_placeholders(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut in_quote = false;
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_quote = !in_quote;
                out.push(c);
            }
            '?' if !in_quote && chars.peek().is_some_and(char::is_ascii_digit) => out.push('$'),
            c => out.push(c),
        }
    }
    out
}

impl rusqlite::ToSql for Value {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, ValueRef};
        Ok(ToSqlOutput::Borrowed(match self {
            Value::Null => ValueRef::Null,
            Value::Int(n) => ValueRef::Integer(*n),
            Value::Text(s) => ValueRef::Text(s.as_bytes()),
            Value::Blob(b) => ValueRef::Blob(b),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_rewritten_outside_quotes() {
        assert_eq!(
            to_postgres_placeholders("SELECT '?1', x FROM t WHERE a = ?1 AND b = ?12 OR c = ?"),
            "SELECT '?1', x FROM t WHERE a = $1 AND b = $12 OR c = ?"
        );
    }
}
