//! The PostgreSQL backend: a small pool of connections made with `tokio-postgres`, used
//! through the store's blocking interface.
//!
//! Why not the sync `postgres` crate: it drives each connection on a private runtime
//! with `Runtime::block_on`, which panics on a thread that runs async tasks — and
//! [`crate::Store::read`] is called right on the API's runtime threads. Here every
//! connection's socket is driven by one background runtime thread of the store's own
//! (`cubicle-pg`), and a caller waits for its query with `futures_executor::block_on`,
//! which works on any thread: a runtime worker (`Store::read`, a short point query),
//! the blocking pool (`Store::call`) or a plain thread (CLI, tests).
//!
//! Prepared statements are cached per connection (keyed by the statement's text), so a
//! repeated query costs one round trip. A connection that broke (server restart) is
//! dropped instead of going back to the pool; the next checkout connects anew.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use bytes::BytesMut;
use tokio_postgres::types::{IsNull, ToSql, Type, to_sql_checked};
use tokio_postgres::{Client, NoTls, Statement};

use crate::db::{Row, Value, to_postgres_placeholders};
use crate::{Error, Result};

/// Connections one store keeps open at most (each replica or node has one store).
const MAX_CONNECTIONS: usize = 16;

/// The runtime that drives every PostgreSQL connection's socket in this process. It
/// lives as long as the process: a runtime cannot be dropped from async code, and a
/// `Store` may be.
fn runtime() -> Result<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<std::result::Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("cubicle-pg")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| Error::Task(format!("starting the PostgreSQL runtime: {e}")))
}

/// Drives one connection's socket until it ends.
async fn drive<F: std::future::Future<Output = std::result::Result<(), tokio_postgres::Error>>>(
    connection: F,
) {
    if let Err(e) = connection.await {
        tracing::debug!("PostgreSQL connection ended: {e}");
    }
}

/// One open connection and its prepared statements.
pub(crate) struct PgConn {
    client: Client,
    statements: HashMap<String, Statement>,
}

impl PgConn {
    fn connect(
        config: &tokio_postgres::Config,
        tls: &Option<tokio_postgres_rustls::MakeRustlsConnect>,
    ) -> Result<PgConn> {
        let config = config.clone();
        let tls = tls.clone();
        let task = runtime()?.spawn(async move {
            // The connection future's type depends on the connector: spawned per case.
            let client = match tls {
                None => {
                    let (client, connection) = config.connect(NoTls).await?;
                    tokio::spawn(drive(connection));
                    client
                }
                Some(tls) => {
                    let (client, connection) = config.connect(tls).await?;
                    tokio::spawn(drive(connection));
                    client
                }
            };
            Ok::<_, tokio_postgres::Error>(client)
        });
        let client = futures_executor::block_on(task)
            .map_err(|e| Error::Task(format!("connecting to PostgreSQL: {e}")))??;
        Ok(PgConn {
            client,
            statements: HashMap::new(),
        })
    }

    fn statement(&mut self, sql: &str) -> Result<Statement> {
        if let Some(st) = self.statements.get(sql) {
            return Ok(st.clone());
        }
        let st = futures_executor::block_on(self.client.prepare(&to_postgres_placeholders(sql)))?;
        self.statements.insert(sql.to_string(), st.clone());
        Ok(st)
    }

    pub(crate) fn execute(&mut self, sql: &str, args: &[Value]) -> Result<u64> {
        let st = self.statement(sql)?;
        let params: Vec<&(dyn ToSql + Sync)> = args.iter().map(|v| v as _).collect();
        Ok(futures_executor::block_on(
            self.client.execute(&st, &params),
        )?)
    }

    pub(crate) fn query(&mut self, sql: &str, args: &[Value]) -> Result<Vec<Row>> {
        let st = self.statement(sql)?;
        let params: Vec<&(dyn ToSql + Sync)> = args.iter().map(|v| v as _).collect();
        let rows = futures_executor::block_on(self.client.query(&st, &params))?;
        rows.iter().map(read_row).collect()
    }

    pub(crate) fn batch(&mut self, sql: &str) -> Result<()> {
        Ok(futures_executor::block_on(self.client.batch_execute(sql))?)
    }
}

fn read_row(r: &tokio_postgres::Row) -> Result<Row> {
    let mut vals = Vec::with_capacity(r.len());
    for (i, col) in r.columns().iter().enumerate() {
        let t = col.type_();
        let v = if *t == Type::INT8 {
            r.try_get::<_, Option<i64>>(i)?.map(Value::Int)
        } else if *t == Type::INT4 {
            r.try_get::<_, Option<i32>>(i)?
                .map(|n| Value::Int(n.into()))
        } else if *t == Type::INT2 {
            r.try_get::<_, Option<i16>>(i)?
                .map(|n| Value::Int(n.into()))
        } else if *t == Type::BOOL {
            r.try_get::<_, Option<bool>>(i)?
                .map(|b| Value::Int(b.into()))
        } else if *t == Type::BYTEA {
            r.try_get::<_, Option<Vec<u8>>>(i)?.map(Value::Blob)
        } else if [Type::TEXT, Type::VARCHAR, Type::BPCHAR, Type::NAME].contains(t) {
            r.try_get::<_, Option<String>>(i)?.map(Value::Text)
        } else {
            return Err(Error::Column(format!(
                "column '{}' has type {t}, which the store does not read (cast it)",
                col.name()
            )));
        };
        vals.push(v.unwrap_or(Value::Null));
    }
    Ok(Row(vals))
}

impl ToSql for Value {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> std::result::Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            Value::Null => Ok(IsNull::Yes),
            Value::Int(n) => {
                if *ty == Type::INT8 {
                    n.to_sql(ty, out)
                } else if *ty == Type::INT4 {
                    i32::try_from(*n)?.to_sql(ty, out)
                } else if *ty == Type::INT2 {
                    i16::try_from(*n)?.to_sql(ty, out)
                } else if *ty == Type::BOOL {
                    (*n != 0).to_sql(ty, out)
                } else {
                    Err(format!("an integer cannot be stored as {ty}").into())
                }
            }
            Value::Text(s) => s.as_str().to_sql(ty, out),
            Value::Blob(b) => b.as_slice().to_sql(ty, out),
        }
    }

    fn accepts(_: &Type) -> bool {
        true
    }

    to_sql_checked!();
}

/// The connections of one store.
pub(crate) struct PgPool {
    config: tokio_postgres::Config,
    /// TLS (`sslmode=require|verify-ca|verify-full`, `crate::pg_tls`), or plain.
    tls: Option<tokio_postgres_rustls::MakeRustlsConnect>,
    idle: Mutex<PoolState>,
    freed: Condvar,
}

struct PoolState {
    idle: Vec<PgConn>,
    open: usize,
}

impl PgPool {
    /// Checks the URL and opens the first connection (so that a wrong URL, password or
    /// database fails at start-up, with the server's reason).
    pub(crate) fn connect(url: &str) -> Result<Arc<PgPool>> {
        let parsed = crate::pg_tls::parse(url)?;
        let config = tokio_postgres::Config::from_str(&parsed.url).map_err(|e| {
            Error::Invalid(format!(
                "database URL: {e} (expected postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE[?sslmode=verify-full&sslrootcert=CA.pem])"
            ))
        })?;
        let tls = crate::pg_tls::connector(&parsed)?;
        let first = PgConn::connect(&config, &tls)?;
        Ok(Arc::new(PgPool {
            config,
            tls,
            idle: Mutex::new(PoolState {
                idle: vec![first],
                open: 1,
            }),
            freed: Condvar::new(),
        }))
    }

    /// Runs `f` with a connection of the pool (waiting for one when all are busy).
    pub(crate) fn with<T>(&self, f: impl FnOnce(&mut PgConn) -> Result<T>) -> Result<T> {
        let conn = {
            let mut st = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if let Some(c) = st.idle.pop() {
                    break c;
                }
                if st.open < MAX_CONNECTIONS {
                    st.open += 1;
                    drop(st);
                    match PgConn::connect(&self.config, &self.tls) {
                        Ok(c) => break c,
                        Err(e) => {
                            self.lock().open -= 1;
                            self.freed.notify_one();
                            return Err(e);
                        }
                    }
                }
                st = self.freed.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        // Given back (or forgotten, when broken) even if `f` panics.
        let mut out = Checkout {
            pool: self,
            conn: Some(conn),
        };
        match out.conn.as_mut() {
            Some(c) => f(c),
            None => Err(Error::Task("no connection".to_string())),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A connection out of the pool; goes back on drop.
struct Checkout<'a> {
    pool: &'a PgPool,
    conn: Option<PgConn>,
}

impl Drop for Checkout<'_> {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        let mut st = self.pool.lock();
        // A connection that broke, or that a panic left inside a transaction, is not
        // reused.
        if conn.client.is_closed() || std::thread::panicking() {
            st.open -= 1;
        } else {
            st.idle.push(conn);
        }
        drop(st);
        self.pool.freed.notify_one();
    }
}
