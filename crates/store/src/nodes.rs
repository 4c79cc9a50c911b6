//! The cluster's coordination state (docs/cluster.md): which nodes exist, their leases,
//! which node owns each sandbox, and the capacity reserved on a node while a sandbox is
//! being created there.
//!
//! - **Lease and fencing.** A node registers ([`Store::register_node`]) and renews its
//!   lease ([`Store::renew_lease`]) every few seconds. Every registration and every
//!   loss increments the node's `epoch`; renewals, placements and ownership claims
//!   carry the epoch they were granted under and fail with [`Error::Fenced`] once it is
//!   no longer current. So a node that was declared lost (its lease ran out:
//!   [`Store::expire_lost_nodes`]) cannot act on what it owned even if it comes back:
//!   it must register again, under a new epoch, and adopt what is still its own.
//! - **Ownership.** A sandbox row names its owning node and the epoch it was claimed
//!   under (`node_id`, `node_epoch`): one column, so one owner. A claim
//!   ([`Store::claim_sandbox`]) only takes an unowned sandbox or one its own node owned
//!   before; concurrent claimers serialise on the row, and exactly one wins.
//! - **Placement.** [`Store::reserve_placement`] locks the node's row (`FOR UPDATE`),
//!   sums what its running sandboxes and live reservations use, and records a
//!   reservation only if the new sandbox fits: concurrent reservations from any number
//!   of replicas queue on that row lock and never oversubscribe a node.
//!   [`Store::commit_placement`] turns the reservation into the sandbox's row once the
//!   node created it; a reservation whose replica died expires.
//!
//! Both engines implement all of this with the same SQL (SQLite's write transactions
//! hold the whole file, so the row locks are simply not needed there): a single host
//! could register itself as a node, but `cubicle serve` does not need to.

use serde_json::Value as Json;

use crate::db::{Conn, Dialect, Row, Value, args};
use crate::sandboxes::{self, SandboxRow};
use crate::{Error, Result, Store};

/// Death reason of the sandboxes of a node declared lost.
pub const NODE_LOST_REASON: &str = "node_lost";

/// A node's lifecycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeState {
    /// Takes new sandboxes.
    Active,
    /// Keeps its sandboxes but takes no new ones (being emptied).
    Draining,
    /// Its lease ran out: its sandboxes were reported dead; it must register again.
    Lost,
}

impl NodeState {
    /// As stored (and printed).
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Active => "active",
            NodeState::Draining => "draining",
            NodeState::Lost => "lost",
        }
    }
    fn parse(s: &str) -> Self {
        match s {
            "active" => NodeState::Active,
            "draining" => NodeState::Draining,
            _ => NodeState::Lost,
        }
    }
}

/// What a node offers for placement (it may include an overcommit factor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeCapacity {
    /// vCPUs that sandboxes may be given in total.
    pub cpu_count: u32,
    /// Memory (MiB) that sandboxes may be given in total.
    pub memory_mb: u64,
    /// Sandboxes at most.
    pub max_sandboxes: u32,
}

/// What one sandbox needs of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resources {
    /// vCPUs.
    pub cpu_count: u32,
    /// Memory, MiB.
    pub memory_mb: u64,
}

/// A node introducing itself.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeRegistration {
    /// Stable name (e.g. the host name).
    pub id: String,
    /// Where replicas reach its node-side API (`http://10.0.0.5:3001`).
    pub address: String,
    /// What it offers.
    pub capacity: NodeCapacity,
    /// Templates present on it.
    pub templates: Vec<String>,
    /// Its warm pools, as it reports them (opaque here).
    pub pool_state: Json,
}

/// A granted lease: act under `epoch` until `expires_at` (renew well before).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeLease {
    /// The node.
    pub node_id: String,
    /// Fencing token: current until the node is lost or registers again.
    pub epoch: i64,
    /// Unix ms.
    pub expires_at: i64,
}

/// A node as stored, with its current load.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeRow {
    /// Name.
    pub id: String,
    /// Node-side API address.
    pub address: String,
    /// Lifecycle state.
    pub state: NodeState,
    /// Current fencing epoch.
    pub epoch: i64,
    /// What it offers.
    pub capacity: NodeCapacity,
    /// Templates present.
    pub templates: Vec<String>,
    /// Warm pools as last reported.
    pub pool_state: Json,
    /// Unix ms of the last registration.
    pub registered_at: i64,
    /// Unix ms of the last renewal.
    pub renewed_at: i64,
    /// Unix ms.
    pub lease_expires_at: i64,
    /// Unix ms it was declared lost.
    pub lost_at: Option<i64>,
    /// Running sandboxes it owns plus live reservations.
    pub sandboxes: u64,
    /// vCPUs those use.
    pub cpu_used: u64,
    /// MiB those use.
    pub memory_mb_used: u64,
}

/// Capacity reserved on a node for a sandbox being created there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The sandbox to be.
    pub sandbox_id: String,
    /// Where.
    pub node_id: String,
    /// The node's epoch when reserved (its sandbox will be owned under it).
    pub node_epoch: i64,
    /// Unix ms after which the reservation no longer counts.
    pub expires_at: i64,
}

/// Who owns a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxOwner {
    /// The node.
    pub node_id: String,
    /// The node's epoch the ownership was taken under.
    pub epoch: i64,
}

/// Who had a sandbox before [`Store::move_sandbox`] took it (to give it back).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MovedFrom {
    /// Its owner then (`None`: unowned, its node lost).
    pub owner: Option<SandboxOwner>,
    /// Its `published_at` then.
    pub published_at: Option<i64>,
}

/// A node [`Store::expire_lost_nodes`] declared lost, with the sandboxes it reported dead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostNode {
    /// The node.
    pub id: String,
    /// Its epoch now (the one it held + 1).
    pub epoch: i64,
    /// `(sandbox id, team id)` of each sandbox marked ended with [`NODE_LOST_REASON`].
    pub sandboxes: Vec<(String, i64)>,
    /// Paused sandboxes with a published copy ([`Store::mark_published`]): left
    /// unowned, for the next resume to take to another node
    /// ([`Store::claim_published`]).
    pub unowned: Vec<String>,
}

const NODE_COLUMNS: &str = "id, address, state, epoch, cpu_count, memory_mb, max_sandboxes, \
    templates, pool_state, registered_at, renewed_at, lease_expires_at, lost_at";

fn node_row(r: &Row, usage: Usage) -> Result<NodeRow> {
    let state: String = r.get(2)?;
    let templates: String = r.get(7)?;
    let pool: String = r.get(8)?;
    Ok(NodeRow {
        id: r.get(0)?,
        address: r.get(1)?,
        state: NodeState::parse(&state),
        epoch: r.get(3)?,
        capacity: NodeCapacity {
            cpu_count: r.get(4)?,
            memory_mb: r.get(5)?,
            max_sandboxes: r.get(6)?,
        },
        templates: serde_json::from_str(&templates)?,
        pool_state: serde_json::from_str(&pool)?,
        registered_at: r.get(9)?,
        renewed_at: r.get(10)?,
        lease_expires_at: r.get(11)?,
        lost_at: r.get(12)?,
        sandboxes: usage.sandboxes,
        cpu_used: usage.cpu,
        memory_mb_used: usage.memory_mb,
    })
}

#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    sandboxes: u64,
    cpu: u64,
    memory_mb: u64,
}

/// What node `node_id` has given out at `now`: its running sandboxes and live
/// reservations.
fn usage(c: &mut Conn<'_>, node_id: &str, now: i64) -> Result<Usage> {
    let r = c.query_one(
        "SELECT CAST(COUNT(*) AS BIGINT), CAST(COALESCE(SUM(cpu_count), 0) AS BIGINT),
                CAST(COALESCE(SUM(memory_mb), 0) AS BIGINT)
         FROM (SELECT cpu_count, memory_mb FROM sandboxes WHERE node_id = ?1 AND state = 'running'
               UNION ALL
               SELECT cpu_count, memory_mb FROM placements WHERE node_id = ?1 AND expires_at > ?2) u",
        args![node_id, now],
    )?;
    Ok(Usage {
        sandboxes: r.get(0)?,
        cpu: r.get(1)?,
        memory_mb: r.get(2)?,
    })
}

/// Locks node `node_id`'s row (shared) and checks that `epoch` is its current one.
fn check_epoch(c: &mut Conn<'_>, node_id: &str, epoch: i64) -> Result<()> {
    let sql = format!(
        "SELECT epoch, state FROM nodes WHERE id = ?1{}",
        c.dialect().for_share()
    );
    let fenced = || Error::Fenced {
        node: node_id.to_string(),
        epoch,
    };
    let row = c
        .query_opt(&sql, args![node_id])?
        .ok_or_else(|| not_registered(node_id))?;
    let (current, state): (i64, String) = (row.get(0)?, row.get(1)?);
    if current != epoch || NodeState::parse(&state) == NodeState::Lost {
        return Err(fenced());
    }
    Ok(())
}

fn not_registered(node_id: &str) -> Error {
    Error::NotFound(format!("node '{node_id}' is not registered"))
}

/// A reservation's unique-key violation: the key has a placement already.
fn taken(e: Error, sandbox_id: &str) -> Error {
    if e.is_unique_violation() {
        Error::Conflict(format!("sandbox '{sandbox_id}' already has a placement"))
    } else {
        e
    }
}

fn no_room(reasons: Vec<String>) -> Error {
    Error::NoCapacity(if reasons.is_empty() {
        "no active node: none is registered with a valid lease".to_string()
    } else {
        format!("no node has room: {}", reasons.join("; "))
    })
}

/// One reservation attempt as decided (by the transaction on SQLite, by
/// `cubicle_reserve` on PostgreSQL): `status` is `missing`, `closed` (not active or lease
/// ran out), `full` or `reserved`. Both engines' answers are worded here.
struct Attempt {
    node: String,
    status: String,
    epoch: i64,
    state: String,
    lease: i64,
    /// vCPUs, MiB, sandboxes.
    capacity: (u64, u64, u64),
    used: Usage,
}

impl Attempt {
    fn missing(node: &str) -> Attempt {
        Attempt {
            node: node.to_string(),
            status: "missing".into(),
            epoch: 0,
            state: String::new(),
            lease: 0,
            capacity: (0, 0, 0),
            used: Usage::default(),
        }
    }

    /// A row of `cubicle_reserve` / `cubicle_place`.
    fn read(r: &Row) -> Result<Attempt> {
        let opt = |i| -> Result<i64> { Ok(r.get::<Option<i64>>(i)?.unwrap_or(0)) };
        let cap = |i| -> Result<u64> { Ok(r.get::<Option<u64>>(i)?.unwrap_or(0)) };
        Ok(Attempt {
            node: r.get(0)?,
            status: r.get(1)?,
            epoch: opt(2)?,
            state: r.get::<Option<String>>(3)?.unwrap_or_default(),
            lease: opt(4)?,
            capacity: (cap(5)?, cap(6)?, cap(7)?),
            used: Usage {
                sandboxes: cap(8)?,
                cpu: cap(9)?,
                memory_mb: cap(10)?,
            },
        })
    }

    fn outcome(
        self,
        sandbox_id: &str,
        need: Resources,
        now: i64,
        ttl_ms: i64,
    ) -> Result<Placement> {
        let node_id = &self.node;
        match self.status.as_str() {
            "reserved" => Ok(Placement {
                sandbox_id: sandbox_id.to_string(),
                node_id: self.node.clone(),
                node_epoch: self.epoch,
                expires_at: now + ttl_ms,
            }),
            "missing" => Err(not_registered(node_id)),
            "closed" => Err(Error::NoCapacity(format!(
                "node '{node_id}' takes no sandboxes (state {}, lease {})",
                self.state,
                if self.lease <= now {
                    "expired"
                } else {
                    "valid"
                }
            ))),
            _ => {
                let ((cpu, mem, max), used) = (self.capacity, self.used);
                Err(Error::NoCapacity(format!(
                    "node '{node_id}' is full: {} of {max} sandboxes, {} of {cpu} vCPUs, {} of {mem} MiB in use; \
                     {} vCPUs and {} MiB asked",
                    used.sandboxes, used.cpu, used.memory_mb, need.cpu_count, need.memory_mb
                )))
            }
        }
    }
}

impl Store {
    /// Registers node `n` (or registers it again: after a restart, or after it was
    /// declared lost), granting a lease until `now + lease_ms` under a new epoch. A
    /// draining node stays draining.
    pub fn register_node(
        &self,
        n: &NodeRegistration,
        now: i64,
        lease_ms: i64,
    ) -> Result<NodeLease> {
        if n.id.is_empty() || n.address.is_empty() {
            return Err(Error::Invalid(
                "a node needs a name and an address".to_string(),
            ));
        }
        let templates = serde_json::to_string(&n.templates)?;
        let pool = serde_json::to_string(&n.pool_state)?;
        let r = self.with_conn(|c| {
            c.query_one(
                &format!(
                    "INSERT INTO nodes ({NODE_COLUMNS}) VALUES (?1, ?2, 'active', 1, ?3, ?4, ?5, ?6, ?7, ?8, ?8, ?9, NULL)
                     ON CONFLICT (id) DO UPDATE SET
                         address = excluded.address, cpu_count = excluded.cpu_count,
                         memory_mb = excluded.memory_mb, max_sandboxes = excluded.max_sandboxes,
                         templates = excluded.templates, pool_state = excluded.pool_state,
                         registered_at = excluded.registered_at, renewed_at = excluded.renewed_at,
                         lease_expires_at = excluded.lease_expires_at, lost_at = NULL,
                         epoch = nodes.epoch + 1,
                         state = CASE WHEN nodes.state = 'draining' THEN 'draining' ELSE 'active' END
                     RETURNING epoch"
                ),
                args![
                    n.id.as_str(),
                    n.address.as_str(),
                    n.capacity.cpu_count,
                    n.capacity.memory_mb,
                    n.capacity.max_sandboxes,
                    templates,
                    pool,
                    now,
                    now + lease_ms
                ],
            )
        })?;
        Ok(NodeLease {
            node_id: n.id.clone(),
            epoch: r.get(0)?,
            expires_at: now + lease_ms,
        })
    }

    /// Extends `lease` to `now + lease_ms` and records what the node has now. Fails with
    /// [`Error::Fenced`] once the node was declared lost or registered again since.
    pub fn renew_lease(
        &self,
        lease: &NodeLease,
        now: i64,
        lease_ms: i64,
        templates: &[String],
        pool_state: &Json,
    ) -> Result<NodeLease> {
        let templates = serde_json::to_string(templates)?;
        let pool = serde_json::to_string(pool_state)?;
        let n = self.with_conn(|c| {
            c.execute(
                "UPDATE nodes SET renewed_at = ?1, lease_expires_at = ?2, templates = ?3, pool_state = ?4
                 WHERE id = ?5 AND epoch = ?6 AND state <> 'lost'",
                args![
                    now,
                    now + lease_ms,
                    templates,
                    pool,
                    lease.node_id.as_str(),
                    lease.epoch
                ],
            )
        })?;
        if n == 0 {
            return Err(Error::Fenced {
                node: lease.node_id.clone(),
                epoch: lease.epoch,
            });
        }
        Ok(NodeLease {
            expires_at: now + lease_ms,
            ..lease.clone()
        })
    }

    /// Declares lost every node whose lease ran out before `now`: its epoch moves on
    /// (fencing it), its paused sandboxes with a published copy become unowned (another
    /// node resumes them: [`Store::claim_published`]), its other sandboxes are marked
    /// ended with [`NODE_LOST_REASON`], its reservations are dropped. Returns what it did, for events and logs; when
    /// several replicas run this at once, each node is reported by exactly one of them.
    pub fn expire_lost_nodes(&self, now: i64) -> Result<Vec<LostNode>> {
        self.transaction(|tx| {
            let lost = tx.query(
                "UPDATE nodes SET state = 'lost', epoch = epoch + 1, lost_at = ?1
                 WHERE state <> 'lost' AND lease_expires_at < ?1 RETURNING id, epoch",
                args![now],
            )?;
            let mut out = Vec::with_capacity(lost.len());
            for r in &lost {
                let id: String = r.get(0)?;
                let unowned = tx
                    .query(
                        "UPDATE sandboxes SET node_id = NULL, node_epoch = NULL
                         WHERE node_id = ?1 AND state = 'running' AND published_at IS NOT NULL
                         RETURNING id",
                        args![id.as_str()],
                    )?
                    .iter()
                    .map(|r| r.get(0))
                    .collect::<Result<Vec<String>>>()?;
                let sandboxes = tx
                    .query(
                        "UPDATE sandboxes SET state = 'ended', death_reason = ?1, ended_at = ?2,
                             traffic_access_token = NULL
                         WHERE node_id = ?3 AND state = 'running' RETURNING id, team_id",
                        args![NODE_LOST_REASON, now, id.as_str()],
                    )?
                    .iter()
                    .map(|r| Ok((r.get(0)?, r.get(1)?)))
                    .collect::<Result<Vec<_>>>()?;
                tx.execute(
                    "DELETE FROM placements WHERE node_id = ?1",
                    args![id.as_str()],
                )?;
                out.push(LostNode {
                    id,
                    epoch: r.get(1)?,
                    sandboxes,
                    unowned,
                });
            }
            out.sort_by(|a, b| a.id.cmp(&b.id));
            Ok(out)
        })
    }

    /// Stops (or resumes, `false`) new placements on a node; its sandboxes stay.
    pub fn set_node_draining(&self, node_id: &str, draining: bool) -> Result<()> {
        let (to, from) = if draining {
            ("draining", "active")
        } else {
            ("active", "draining")
        };
        let n = self.with_conn(|c| {
            c.execute(
                "UPDATE nodes SET state = ?1 WHERE id = ?2 AND state IN (?1, ?3)",
                args![to, node_id, from],
            )
        })?;
        if n == 0 {
            return Err(match self.node(node_id, crate::now_ms())? {
                None => Error::NotFound(format!("node '{node_id}' is not registered")),
                Some(_) => Error::Conflict(format!(
                    "node '{node_id}' is lost: it must register again first"
                )),
            });
        }
        Ok(())
    }

    /// One node with its load at `now`.
    pub fn node(&self, node_id: &str, now: i64) -> Result<Option<NodeRow>> {
        self.with_conn(|c| {
            let Some(r) = c.query_opt(
                &format!("SELECT {NODE_COLUMNS} FROM nodes WHERE id = ?1"),
                args![node_id],
            )?
            else {
                return Ok(None);
            };
            let u = usage(c, node_id, now)?;
            node_row(&r, u).map(Some)
        })
    }

    /// Every node with its load at `now`, by name (one query: placement reads this on
    /// every create).
    pub fn nodes(&self, now: i64) -> Result<Vec<NodeRow>> {
        self.with_conn(|c| {
            let rows = c.query(
                &format!(
                    "SELECT {NODE_COLUMNS}, CAST(COALESCE(u.cnt, 0) AS BIGINT),
                            CAST(COALESCE(u.cpu, 0) AS BIGINT), CAST(COALESCE(u.mem, 0) AS BIGINT)
                     FROM nodes LEFT JOIN (
                         SELECT node_id AS owner, COUNT(*) AS cnt, SUM(cpu_count) AS cpu,
                                SUM(memory_mb) AS mem
                         FROM (SELECT node_id, cpu_count, memory_mb FROM sandboxes
                               WHERE state = 'running' AND node_id IS NOT NULL
                               UNION ALL
                               SELECT node_id, cpu_count, memory_mb FROM placements
                               WHERE expires_at > ?1) x
                         GROUP BY node_id) u ON u.owner = nodes.id
                     ORDER BY id"
                ),
                args![now],
            )?;
            rows.iter()
                .map(|r| {
                    let u = Usage {
                        sandboxes: r.get(13)?,
                        cpu: r.get(14)?,
                        memory_mb: r.get(15)?,
                    };
                    node_row(r, u)
                })
                .collect()
        })
    }

    /// Reserves `need` on node `node_id` for sandbox `sandbox_id` until `now + ttl_ms`.
    /// [`Error::NoCapacity`] when the node is not active, its lease ran out, or the
    /// sandbox does not fit beside what it already runs and has reserved.
    pub fn reserve_placement(
        &self,
        node_id: &str,
        sandbox_id: &str,
        need: Resources,
        now: i64,
        ttl_ms: i64,
    ) -> Result<Placement> {
        if self.dialect() == Dialect::Postgres {
            // One round trip: PostgreSQL's `cubicle_reserve` (schema.rs, 7) does what the
            // transaction below does.
            let r = self
                .with_conn(|c| {
                    c.query_one(
                        "SELECT * FROM cubicle_reserve(?1, ?2, ?3, ?4, ?5, ?6)",
                        args![
                            node_id,
                            sandbox_id,
                            need.cpu_count,
                            need.memory_mb,
                            now,
                            ttl_ms
                        ],
                    )
                })
                .map_err(|e| taken(e, sandbox_id))?;
            return Attempt::read(&r)?.outcome(sandbox_id, need, now, ttl_ms);
        }
        self.transaction(|tx| {
            let sql = format!(
                "SELECT epoch, state, lease_expires_at, cpu_count, memory_mb, max_sandboxes
                 FROM nodes WHERE id = ?1{}",
                tx.dialect().for_update()
            );
            let Some(node) = tx.query_opt(&sql, args![node_id])? else {
                return Attempt::missing(node_id).outcome(sandbox_id, need, now, ttl_ms);
            };
            let mut a = Attempt {
                node: node_id.to_string(),
                status: String::new(),
                epoch: node.get(0)?,
                state: node.get(1)?,
                lease: node.get(2)?,
                capacity: (node.get(3)?, node.get(4)?, node.get(5)?),
                used: Usage::default(),
            };
            if a.state != "active" || a.lease <= now {
                a.status = "closed".into();
                return a.outcome(sandbox_id, need, now, ttl_ms);
            }
            tx.execute(
                "DELETE FROM placements WHERE node_id = ?1 AND expires_at <= ?2",
                args![node_id, now],
            )?;
            a.used = usage(tx, node_id, now)?;
            let (cpu, mem, max) = a.capacity;
            if a.used.sandboxes + 1 > max
                || a.used.cpu + u64::from(need.cpu_count) > cpu
                || a.used.memory_mb + need.memory_mb > mem
            {
                a.status = "full".into();
                return a.outcome(sandbox_id, need, now, ttl_ms);
            }
            tx.execute(
                "INSERT INTO placements (sandbox_id, node_id, node_epoch, cpu_count, memory_mb, expires_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                args![sandbox_id, node_id, a.epoch, need.cpu_count, need.memory_mb, now + ttl_ms],
            )
            .map_err(|e| taken(e, sandbox_id))?;
            a.status = "reserved".into();
            a.outcome(sandbox_id, need, now, ttl_ms)
        })
    }

    /// Reserves `need` for `sandbox_id` on the best node that takes it: active, lease
    /// valid, preferring nodes that have `template`, then the least loaded (fewest
    /// sandboxes). [`Error::NoCapacity`] when none has room.
    pub fn place_sandbox(
        &self,
        sandbox_id: &str,
        template: &str,
        need: Resources,
        now: i64,
        ttl_ms: i64,
    ) -> Result<Placement> {
        let mut reasons = Vec::new();
        if self.dialect() == Dialect::Postgres {
            // One round trip: `cubicle_place` (schema.rs, 7) orders the candidates as
            // below and runs `cubicle_reserve` on each until one takes the sandbox.
            let rows = self
                .with_conn(|c| {
                    c.query(
                        "SELECT * FROM cubicle_place(?1, ?2, ?3, ?4, ?5, ?6)",
                        args![
                            sandbox_id,
                            template,
                            need.cpu_count,
                            need.memory_mb,
                            now,
                            ttl_ms
                        ],
                    )
                })
                .map_err(|e| taken(e, sandbox_id))?;
            for r in &rows {
                match Attempt::read(r)?.outcome(sandbox_id, need, now, ttl_ms) {
                    Err(Error::NoCapacity(why)) => reasons.push(why),
                    r => return r,
                }
            }
            return Err(no_room(reasons));
        }
        let mut candidates: Vec<NodeRow> = self
            .nodes(now)?
            .into_iter()
            .filter(|n| n.state == NodeState::Active && n.lease_expires_at > now)
            .collect();
        candidates.sort_by_key(|n| {
            (
                !n.templates.iter().any(|t| t == template),
                n.sandboxes,
                n.id.clone(),
            )
        });
        for n in &candidates {
            match self.reserve_placement(&n.id, sandbox_id, need, now, ttl_ms) {
                Err(Error::NoCapacity(why)) => reasons.push(why),
                r => return r,
            }
        }
        Err(no_room(reasons))
    }

    /// Drops a reservation (the create failed); `false` if there was none.
    pub fn release_placement(&self, sandbox_id: &str) -> Result<bool> {
        let n = self.with_conn(|c| {
            c.execute(
                "DELETE FROM placements WHERE sandbox_id = ?1",
                args![sandbox_id],
            )
        })?;
        Ok(n > 0)
    }

    /// Records the sandbox created under placement `p` (its row `s`), owned by `p`'s
    /// node under `p`'s epoch, and drops the reservation — unless the node was declared
    /// lost or registered again meanwhile ([`Error::Fenced`]) or the reservation expired
    /// ([`Error::Conflict`]): then the caller must discard the sandbox it created.
    /// `s.id` may differ from `p.sandbox_id`: a replica reserves under a key of its own
    /// before the node names the sandbox (a warm-pool claim hands out an id it chose).
    pub fn commit_placement(&self, p: &Placement, s: &SandboxRow, now: i64) -> Result<()> {
        let expired = || {
            Error::Conflict(format!(
                "the placement of sandbox '{}' on node '{}' expired or was released",
                p.sandbox_id, p.node_id
            ))
        };
        if self.dialect() == Dialect::Postgres {
            // One round trip: `cubicle_commit` (schema.rs, 7) is the transaction below.
            let mut vals: Vec<Value> =
                args![p.sandbox_id.as_str(), p.node_id.as_str(), p.node_epoch, now].to_vec();
            vals.extend(sandboxes::values(s)?);
            let placeholders: Vec<String> = (1..=vals.len()).map(|i| format!("?{i}")).collect();
            let sql = format!("SELECT cubicle_commit({})", placeholders.join(", "));
            let status: String = self.with_conn(|c| c.query_one(&sql, &vals))?.get(0)?;
            return match status.as_str() {
                "committed" => Ok(()),
                "missing" => Err(not_registered(&p.node_id)),
                "fenced" => Err(Error::Fenced {
                    node: p.node_id.clone(),
                    epoch: p.node_epoch,
                }),
                _ => Err(expired()),
            };
        }
        self.transaction(|tx| {
            check_epoch(tx, &p.node_id, p.node_epoch)?;
            let n = tx.execute(
                "DELETE FROM placements WHERE sandbox_id = ?1 AND node_id = ?2 AND node_epoch = ?3 AND expires_at > ?4",
                args![p.sandbox_id.as_str(), p.node_id.as_str(), p.node_epoch, now],
            )?;
            if n == 0 {
                return Err(expired());
            }
            sandboxes::insert(tx, s, Some((&p.node_id, p.node_epoch)))
        })
    }

    /// Node `node_id` (under lease epoch `epoch`) takes ownership of running sandbox
    /// `sandbox_id`: adopting its own sandboxes after a restart, or taking an unowned
    /// one (e.g. to resume it). `Ok(false)` when another node owns it or it is not
    /// running; [`Error::Fenced`] when `epoch` is not the node's current one.
    pub fn claim_sandbox(&self, sandbox_id: &str, node_id: &str, epoch: i64) -> Result<bool> {
        self.transaction(|tx| {
            check_epoch(tx, node_id, epoch)?;
            let n = tx.execute(
                "UPDATE sandboxes SET node_id = ?2, node_epoch = ?3
                 WHERE id = ?1 AND state = 'running' AND (node_id IS NULL OR node_id = ?2)",
                args![sandbox_id, node_id, epoch],
            )?;
            Ok(n > 0)
        })
    }

    /// Sandbox `sandbox_id` moves to node `node_id` (under lease epoch `epoch`): a replica
    /// resumed it there from the object store because its owner was gone, draining or
    /// full, and the old node released its copy. Unlike [`Store::claim_sandbox`] it takes
    /// the sandbox from whichever node owned it, and its published copy no longer counts
    /// (it runs there now). `Ok(false)` when the sandbox has ended; [`Error::Fenced`]
    /// when `epoch` is not the node's current one.
    pub fn transfer_sandbox(&self, sandbox_id: &str, node_id: &str, epoch: i64) -> Result<bool> {
        self.transaction(|tx| {
            check_epoch(tx, node_id, epoch)?;
            let n = tx.execute(
                "UPDATE sandboxes SET node_id = ?2, node_epoch = ?3, published_at = NULL
                 WHERE id = ?1 AND state = 'running'",
                args![sandbox_id, node_id, epoch],
            )?;
            Ok(n > 0)
        })
    }

    /// Node `node_id` (under `epoch`) published paused sandbox `sandbox_id` to the object
    /// store at `now`: if the node is lost before the sandbox resumes, the sandbox is
    /// left unowned instead of ended ([`Store::expire_lost_nodes`]). `Ok(false)` when the
    /// node does not own it (any more) or it ended; [`Error::Fenced`] under a stale epoch.
    pub fn mark_published(
        &self,
        sandbox_id: &str,
        node_id: &str,
        epoch: i64,
        now: i64,
    ) -> Result<bool> {
        self.transaction(|tx| {
            check_epoch(tx, node_id, epoch)?;
            let n = tx.execute(
                "UPDATE sandboxes SET published_at = ?3
                 WHERE id = ?1 AND node_id = ?2 AND state = 'running'",
                args![sandbox_id, node_id, now],
            )?;
            Ok(n > 0)
        })
    }

    /// Node `node_id` (under `epoch`) is about to resume its paused sandbox
    /// `sandbox_id`: the published copy stops counting (it becomes stale). `Ok(false)`
    /// when the node does not own it any more — its lease ran out and the sandbox was
    /// left unowned, or another node took it: the node must not resume it;
    /// [`Error::Fenced`] under a stale epoch (the same verdict).
    pub fn clear_published(&self, sandbox_id: &str, node_id: &str, epoch: i64) -> Result<bool> {
        self.transaction(|tx| {
            check_epoch(tx, node_id, epoch)?;
            let n = tx.execute(
                "UPDATE sandboxes SET published_at = NULL
                 WHERE id = ?1 AND node_id = ?2 AND state = 'running'",
                args![sandbox_id, node_id],
            )?;
            Ok(n > 0)
        })
    }

    /// Whether sandbox `sandbox_id` is paused with a published copy and owned by no node
    /// (its node was lost): the next resume takes it to a live node.
    pub fn is_unowned_published(&self, sandbox_id: &str) -> Result<bool> {
        self.with_conn(|c| {
            Ok(c.query_opt(
                "SELECT id FROM sandboxes WHERE id = ?1 AND state = 'running'
                     AND node_id IS NULL AND published_at IS NOT NULL",
                args![sandbox_id],
            )?
            .is_some())
        })
    }

    /// Node `node_id` (under `epoch`) takes unowned published sandbox `sandbox_id` to
    /// resume it there. Of concurrent claimers exactly one gets `Ok(true)`; the copy no
    /// longer counts as published (the new owner resumes it: [`Store::disown`] gives it
    /// back if that fails). `Ok(false)`: not unowned and published (taken already,
    /// ended); [`Error::Fenced`] when `epoch` is not the node's current one.
    pub fn claim_published(&self, sandbox_id: &str, node_id: &str, epoch: i64) -> Result<bool> {
        self.transaction(|tx| {
            check_epoch(tx, node_id, epoch)?;
            let n = tx.execute(
                "UPDATE sandboxes SET node_id = ?2, node_epoch = ?3, published_at = NULL
                 WHERE id = ?1 AND state = 'running' AND node_id IS NULL
                     AND published_at IS NOT NULL",
                args![sandbox_id, node_id, epoch],
            )?;
            Ok(n > 0)
        })
    }

    /// Undoes [`Store::claim_published`] when the resume on node `node_id` failed: the
    /// sandbox is unowned and published (at `published_at`) again, if that node still
    /// owns it under `epoch`. `Ok(false)` otherwise.
    pub fn disown(
        &self,
        sandbox_id: &str,
        node_id: &str,
        epoch: i64,
        published_at: i64,
    ) -> Result<bool> {
        let n = self.with_conn(|c| {
            c.execute(
                "UPDATE sandboxes SET node_id = NULL, node_epoch = NULL, published_at = ?4
                 WHERE id = ?1 AND node_id = ?2 AND node_epoch = ?3 AND state = 'running'",
                args![sandbox_id, node_id, epoch, published_at],
            )
        })?;
        Ok(n > 0)
    }

    /// Sandbox `sandbox_id` moves to node `node_id` (under its epoch `epoch`) before that
    /// node takes it over, from node `from` (unreachable, draining or full) — or from
    /// nobody when `from` was lost meanwhile and left it unowned with a published copy.
    /// Compare and set: of concurrent moves of the same sandbox exactly one gets
    /// `Some` (what it was before, for [`Store::give_back`]); `None` when `from` does not
    /// own it any more (another move won, or it ended). From then on `from` cannot
    /// resume it itself ([`Store::clear_published`] answers `false`). [`Error::Fenced`]
    /// when `epoch` is not `node_id`'s current one.
    pub fn move_sandbox(
        &self,
        sandbox_id: &str,
        from: &str,
        node_id: &str,
        epoch: i64,
    ) -> Result<Option<MovedFrom>> {
        self.transaction(|tx| {
            check_epoch(tx, node_id, epoch)?;
            let sql = format!(
                "SELECT node_id, node_epoch, published_at FROM sandboxes
                 WHERE id = ?1 AND state = 'running'{}",
                tx.dialect().for_update()
            );
            let Some(r) = tx.query_opt(&sql, args![sandbox_id])? else {
                return Ok(None);
            };
            let (owner, owner_epoch, published_at): (Option<String>, Option<i64>, Option<i64>) =
                (r.get(0)?, r.get(1)?, r.get(2)?);
            let movable = match owner.as_deref() {
                Some(o) => o == from,
                None => published_at.is_some(),
            };
            if !movable {
                return Ok(None);
            }
            tx.execute(
                "UPDATE sandboxes SET node_id = ?2, node_epoch = ?3, published_at = NULL
                 WHERE id = ?1",
                args![sandbox_id, node_id, epoch],
            )?;
            Ok(Some(MovedFrom {
                owner: owner
                    .zip(owner_epoch)
                    .map(|(node_id, epoch)| SandboxOwner { node_id, epoch }),
                published_at,
            }))
        })
    }

    /// Undoes [`Store::move_sandbox`] when node `node_id`'s takeover failed (if that node
    /// still owns the sandbox under `epoch`): back to its previous owner while that node
    /// is current (same epoch, not lost); else unowned when it had a published copy (the
    /// next resume takes it elsewhere), else ended with [`NODE_LOST_REASON`] (its only
    /// copy was on a node that is gone). `Ok(false)` when nothing was undone.
    pub fn give_back(
        &self,
        sandbox_id: &str,
        node_id: &str,
        epoch: i64,
        before: &MovedFrom,
        now: i64,
    ) -> Result<bool> {
        self.transaction(|tx| {
            let current = match &before.owner {
                Some(o) => tx
                    .query_opt(
                        "SELECT id FROM nodes WHERE id = ?1 AND epoch = ?2 AND state <> 'lost'",
                        args![o.node_id.as_str(), o.epoch],
                    )?
                    .is_some(),
                None => false,
            };
            let n = match (&before.owner, before.published_at) {
                (Some(o), _) if current => tx.execute(
                    "UPDATE sandboxes SET node_id = ?4, node_epoch = ?5, published_at = ?6
                     WHERE id = ?1 AND node_id = ?2 AND node_epoch = ?3 AND state = 'running'",
                    args![
                        sandbox_id,
                        node_id,
                        epoch,
                        o.node_id.as_str(),
                        o.epoch,
                        before.published_at
                    ],
                )?,
                (_, Some(at)) => tx.execute(
                    "UPDATE sandboxes SET node_id = NULL, node_epoch = NULL, published_at = ?4
                     WHERE id = ?1 AND node_id = ?2 AND node_epoch = ?3 AND state = 'running'",
                    args![sandbox_id, node_id, epoch, at],
                )?,
                (_, None) => tx.execute(
                    "UPDATE sandboxes SET state = 'ended', death_reason = ?4, ended_at = ?5,
                         traffic_access_token = NULL
                     WHERE id = ?1 AND node_id = ?2 AND node_epoch = ?3 AND state = 'running'",
                    args![sandbox_id, node_id, epoch, NODE_LOST_REASON, now],
                )?,
            };
            Ok(n > 0)
        })
    }

    /// Who owns sandbox `sandbox_id` (`None`: nobody, or no such sandbox).
    pub fn sandbox_owner(&self, sandbox_id: &str) -> Result<Option<SandboxOwner>> {
        self.with_conn(|c| {
            let Some(r) = c.query_opt(
                "SELECT node_id, node_epoch FROM sandboxes WHERE id = ?1",
                args![sandbox_id],
            )?
            else {
                return Ok(None);
            };
            let (node, epoch): (Option<String>, Option<i64>) = (r.get(0)?, r.get(1)?);
            Ok(node
                .zip(epoch)
                .map(|(node_id, epoch)| SandboxOwner { node_id, epoch }))
        })
    }

    /// Ids of the running sandboxes node `node_id` owns.
    pub fn node_sandboxes(&self, node_id: &str) -> Result<Vec<String>> {
        self.with_conn(|c| {
            c.query(
                "SELECT id FROM sandboxes WHERE node_id = ?1 AND state = 'running' ORDER BY id",
                args![node_id],
            )?
            .iter()
            .map(|r| r.get(0))
            .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::sync::{Arc, Barrier};

    use super::*;
    use crate::SandboxRowState;
    use crate::testdb::{each_backend, each_shared_backend};

    const LEASE: i64 = 10_000;

    fn reg(id: &str, max_sandboxes: u32) -> NodeRegistration {
        NodeRegistration {
            id: id.into(),
            address: format!("http://{id}:3001"),
            capacity: NodeCapacity {
                cpu_count: 8,
                memory_mb: 8192,
                max_sandboxes,
            },
            templates: vec!["base".into()],
            pool_state: serde_json::json!({"base": 2}),
        }
    }

    fn sandbox(id: &str, team: i64) -> SandboxRow {
        SandboxRow {
            id: id.into(),
            team_id: team,
            template_id: "base".into(),
            alias: None,
            metadata: BTreeMap::new(),
            env_var_names: vec![],
            traffic_access_token: Some("t".into()),
            allow_internet: true,
            cpu_count: 2,
            memory_mb: 512,
            disk_mb: 1024,
            started_at: 1,
            end_at: 2,
            state: SandboxRowState::Running,
            death_reason: None,
            ended_at: None,
        }
    }

    const NEED: Resources = Resources {
        cpu_count: 2,
        memory_mb: 512,
    };

    /// A replica reserves under a key of its own; the node names the sandbox (a
    /// warm-pool claim): the commit records that sandbox, owned, and the reservation is
    /// gone (the capacity is counted once, by the sandbox).
    #[test]
    fn commit_under_a_reservation_key_records_the_named_sandbox() {
        each_backend(|s| {
            let team = s.ensure_team("t").unwrap().id;
            s.register_node(&reg("n1", 1), 1_000, LEASE).unwrap();
            let p = s
                .place_sandbox("key1", "base", NEED, 1_000, 60_000)
                .unwrap();
            s.commit_placement(&p, &sandbox("pooled1", team), 1_001)
                .unwrap();
            let owner = s.sandbox_owner("pooled1").unwrap().unwrap();
            assert_eq!((owner.node_id.as_str(), owner.epoch), ("n1", p.node_epoch));
            assert!(!s.release_placement("key1").unwrap(), "reservation dropped");
            let n = s.node("n1", 1_002).unwrap().unwrap();
            assert_eq!(n.sandboxes, 1);
            // The node is full now (one sandbox at most).
            assert!(matches!(
                s.place_sandbox("key2", "base", NEED, 1_002, 60_000),
                Err(Error::NoCapacity(_))
            ));
        });
    }

    /// Placement's order and answers are the same on both engines (PostgreSQL runs them
    /// as `cubicle_place`/`cubicle_reserve`, SQLite as transactions here): the template
    /// first, then the fewest sandboxes, then the name; closed, full, unknown and taken
    /// are worded alike.
    #[test]
    fn placement_order_and_answers() {
        each_backend(|s| {
            let team = s.ensure_team("t").unwrap().id;
            let mut other = reg("a-no-template", 4);
            other.templates = vec!["tiny".into()];
            s.register_node(&other, 1_000, LEASE).unwrap();
            s.register_node(&reg("n2", 1), 1_000, LEASE).unwrap();
            s.register_node(&reg("n1", 2), 1_000, LEASE).unwrap();
            let take = |key: &str| {
                s.place_sandbox(key, "base", NEED, 1_000, 60_000)
                    .unwrap()
                    .node_id
            };
            // With the template, fewest sandboxes, then by name: n1, n2, n1; then
            // the node without it.
            assert_eq!(take("k1"), "n1");
            assert_eq!(take("k2"), "n2");
            assert_eq!(take("k3"), "n1");
            assert_eq!(take("k4"), "a-no-template");
            assert!(matches!(
                s.place_sandbox("k4", "tiny", NEED, 1_000, 60_000),
                Err(Error::Conflict(m)) if m == "sandbox 'k4' already has a placement"
            ));
            match s.reserve_placement("n2", "k5", NEED, 1_000, 60_000) {
                Err(Error::NoCapacity(m)) => assert_eq!(
                    m,
                    "node 'n2' is full: 1 of 1 sandboxes, 2 of 8 vCPUs, 512 of 8192 MiB in use; 2 vCPUs and 512 MiB asked"
                ),
                other => panic!("{other:?}"),
            }
            match s.reserve_placement("nx", "k5", NEED, 1_000, 60_000) {
                Err(Error::NotFound(m)) => assert_eq!(m, "node 'nx' is not registered"),
                other => panic!("{other:?}"),
            }
            s.set_node_draining("a-no-template", true).unwrap();
            match s.reserve_placement("a-no-template", "k5", NEED, 1_000, 60_000) {
                Err(Error::NoCapacity(m)) => assert_eq!(
                    m,
                    "node 'a-no-template' takes no sandboxes (state draining, lease valid)"
                ),
                other => panic!("{other:?}"),
            }
            match s.place_sandbox("k5", "base", NEED, 1_000, 60_000) {
                Err(Error::NoCapacity(m)) => assert_eq!(
                    m,
                    "no node has room: node 'n2' is full: 1 of 1 sandboxes, 2 of 8 vCPUs, 512 of 8192 MiB in use; \
                     2 vCPUs and 512 MiB asked; node 'n1' is full: 2 of 2 sandboxes, 4 of 8 vCPUs, 1024 of 8192 MiB in use; \
                     2 vCPUs and 512 MiB asked"
                ),
                other => panic!("{other:?}"),
            }
            // A reservation that expired no longer counts; the node's lease running out
            // closes it.
            assert!(matches!(
                s.place_sandbox("k6", "base", NEED, 61_000, 60_000),
                Err(Error::NoCapacity(m)) if m == "no active node: none is registered with a valid lease"
            ));
            s.register_node(&reg("n2", 1), 61_000, LEASE).unwrap();
            let p = s.place_sandbox("k6", "base", NEED, 61_000, 60_000).unwrap();
            assert_eq!(p.node_id, "n2");
            s.commit_placement(&p, &sandbox("sb6", team), 61_001)
                .unwrap();
            assert!(matches!(
                s.commit_placement(&p, &sandbox("sb7", team), 61_002),
                Err(Error::Conflict(_))
            ));
        });
    }

    /// Register, renew, lose the lease, be fenced, register again.
    #[test]
    fn lease_expiry_fences_the_node_and_reports_its_sandboxes() {
        each_backend(|s| {
            let team = s.ensure_team("t").unwrap().id;
            let lease = s.register_node(&reg("n1", 10), 1_000, LEASE).unwrap();
            assert_eq!((lease.epoch, lease.expires_at), (1, 11_000));
            let other = s.register_node(&reg("n2", 10), 1_000, LEASE).unwrap();
            let p = s.place_sandbox("sb1", "base", NEED, 1_000, 60_000).unwrap();
            s.commit_placement(&p, &sandbox("sb1", team), 1_001)
                .unwrap();
            let owner = s.sandbox_owner("sb1").unwrap().unwrap();
            assert_eq!(owner.node_id, p.node_id);
            // Renewing in time keeps it alive past the first expiry.
            let lease = s
                .renew_lease(
                    &lease,
                    9_000,
                    LEASE,
                    &["base".into()],
                    &serde_json::json!({}),
                )
                .unwrap();
            assert_eq!(lease.expires_at, 19_000);
            s.renew_lease(&other, 9_000, LEASE, &[], &serde_json::json!({}))
                .unwrap();
            assert!(s.expire_lost_nodes(18_999).unwrap().is_empty());
            // n2 renews, n1 does not: n1 is lost, its sandboxes end.
            s.renew_lease(&other, 18_000, LEASE, &[], &serde_json::json!({}))
                .unwrap();
            let n1_sandboxes = s.node_sandboxes("n1").unwrap();
            let lost = s.expire_lost_nodes(19_001).unwrap();
            assert_eq!(lost.len(), 1);
            assert_eq!(lost[0].id, "n1");
            assert_eq!(lost[0].epoch, 2, "loss moves the epoch on");
            let reported: Vec<String> = lost[0].sandboxes.iter().map(|x| x.0.clone()).collect();
            assert_eq!(reported, n1_sandboxes);
            for id in &reported {
                let row = s.sandbox(id).unwrap().unwrap();
                assert_eq!(row.state, SandboxRowState::Ended);
                assert_eq!(row.death_reason.as_deref(), Some(NODE_LOST_REASON));
            }
            assert!(
                s.expire_lost_nodes(30_000)
                    .unwrap()
                    .iter()
                    .all(|l| l.id != "n1"),
                "reported once"
            );
            // The lost node's renewals, claims and placements are fenced.
            assert!(matches!(
                s.renew_lease(&lease, 19_002, LEASE, &[], &serde_json::json!({})),
                Err(Error::Fenced { epoch: 1, .. })
            ));
            assert!(matches!(
                s.claim_sandbox("sb1", "n1", 1),
                Err(Error::Fenced { .. })
            ));
            assert!(matches!(
                s.reserve_placement("n1", "sb2", NEED, 19_002, 60_000),
                Err(Error::NoCapacity(_))
            ));
            let row = s.node("n1", 19_002).unwrap().unwrap();
            assert_eq!((row.state, row.sandboxes), (NodeState::Lost, 0));
            // Registering again: a new epoch, active.
            let back = s.register_node(&reg("n1", 10), 20_000, LEASE).unwrap();
            assert_eq!(back.epoch, 3);
            assert_eq!(
                s.node("n1", 20_000).unwrap().unwrap().state,
                NodeState::Active
            );
            // Draining: no new placements; stays draining across a re-registration.
            s.set_node_draining("n1", true).unwrap();
            s.register_node(&reg("n1", 10), 20_001, LEASE).unwrap();
            assert!(matches!(
                s.reserve_placement("n1", "sb3", NEED, 20_002, 60_000),
                Err(Error::NoCapacity(m)) if m.contains("draining")
            ));
            assert!(matches!(
                s.set_node_draining("nope", true),
                Err(Error::NotFound(_))
            ));
        });
    }

    /// A placement whose node was lost in between cannot become a sandbox; one that
    /// expired neither; expired reservations free their capacity.
    #[test]
    fn placements_commit_only_under_a_current_epoch() {
        each_backend(|s| {
            let team = s.ensure_team("t").unwrap().id;
            s.register_node(&reg("n1", 2), 0, LEASE).unwrap();
            let p1 = s.reserve_placement("n1", "a", NEED, 0, 1_000).unwrap();
            let _p2 = s.reserve_placement("n1", "b", NEED, 0, 5_000).unwrap();
            assert!(matches!(
                s.reserve_placement("n1", "c", NEED, 0, 1_000),
                Err(Error::NoCapacity(m)) if m.contains("2 of 2 sandboxes")
            ));
            assert!(matches!(
                s.reserve_placement("n1", "b", NEED, 0, 1_000),
                Err(Error::NoCapacity(_))
            ));
            // p1 expired: its room is free again, and it cannot be committed.
            let p3 = s.reserve_placement("n1", "c", NEED, 1_500, 5_000).unwrap();
            assert!(matches!(
                s.commit_placement(&p1, &sandbox("a", team), 1_500),
                Err(Error::Conflict(_))
            ));
            assert!(s.sandbox("a").unwrap().is_none());
            // The node is lost before c is committed: fenced.
            assert_eq!(s.expire_lost_nodes(LEASE + 1).unwrap().len(), 1);
            assert!(matches!(
                s.commit_placement(&p3, &sandbox("c", team), 2_000),
                Err(Error::Fenced { .. })
            ));
            assert!(s.sandbox("c").unwrap().is_none());
            assert!(!s.release_placement("c").unwrap(), "dropped with the node");
        });
    }

    /// Many replicas (separate handles, each with its own connections) claim the same
    /// unowned sandboxes at once: every sandbox ends up with exactly one owner, and
    /// exactly one claimer was told it won.
    #[test]
    fn a_moved_sandbox_changes_owner_under_the_new_nodes_epoch() {
        each_backend(|s| {
            let team = s.ensure_team("t").unwrap().id;
            let e1 = s.register_node(&reg("n1", 10), 0, LEASE).unwrap().epoch;
            let e2 = s.register_node(&reg("n2", 10), 0, LEASE).unwrap().epoch;
            s.insert_sandbox(&sandbox("sb", team)).unwrap();
            assert!(s.claim_sandbox("sb", "n1", e1).unwrap());
            // claim_sandbox never takes another node's sandbox; a move does.
            assert!(!s.claim_sandbox("sb", "n2", e2).unwrap());
            assert!(s.transfer_sandbox("sb", "n2", e2).unwrap());
            let owner = s.sandbox_owner("sb").unwrap().unwrap();
            assert_eq!((owner.node_id.as_str(), owner.epoch), ("n2", e2));
            assert!(s.node_sandboxes("n1").unwrap().is_empty());
            assert_eq!(s.node_sandboxes("n2").unwrap(), vec!["sb".to_string()]);
            // Under a stale epoch (n2 registered again since): fenced, nothing changes.
            let e2b = s.register_node(&reg("n2", 10), 0, LEASE).unwrap().epoch;
            assert!(matches!(
                s.transfer_sandbox("sb", "n2", e2),
                Err(Error::Fenced { .. })
            ));
            assert!(s.transfer_sandbox("sb", "n1", e1).unwrap());
            assert!(s.transfer_sandbox("sb", "n2", e2b).unwrap());
            // An ended sandbox stays where it ended.
            assert!(s.mark_ended("sb", "killed", 1).unwrap());
            assert!(!s.transfer_sandbox("sb", "n1", e1).unwrap());
            assert_eq!(s.sandbox_owner("sb").unwrap().unwrap().node_id, "n2");
        });
    }

    /// A lost node's paused sandboxes with a published copy outlive it: left unowned,
    /// claimed by exactly one other node, given back when that node's resume fails, and
    /// never resumed by the lost node under its old epoch.
    #[test]
    fn published_paused_sandboxes_outlive_their_lost_node() {
        each_backend(|s| {
            let team = s.ensure_team("t").unwrap().id;
            let l1 = s.register_node(&reg("n1", 10), 0, LEASE).unwrap();
            for id in ["run", "paused", "local"] {
                let p = s.reserve_placement("n1", id, NEED, 0, 60_000).unwrap();
                s.commit_placement(&p, &sandbox(id, team), 1).unwrap();
            }
            // "paused" was published; "local" was paused without a copy (the database
            // cannot tell it from "run").
            assert!(s.mark_published("paused", "n1", l1.epoch, 5).unwrap());
            assert!(!s.mark_published("nope", "n1", l1.epoch, 5).unwrap());
            // Resumed at home and published again: the copy counts only while paused.
            assert!(s.clear_published("paused", "n1", l1.epoch).unwrap());
            assert!(s.mark_published("paused", "n1", l1.epoch, 6).unwrap());
            let l2 = s.register_node(&reg("n2", 10), 9_000, LEASE).unwrap();
            assert!(
                !s.mark_published("paused", "n2", l2.epoch, 7).unwrap(),
                "not n2's"
            );
            assert!(!s.clear_published("paused", "n2", l2.epoch).unwrap());
            assert!(!s.is_unowned_published("paused").unwrap());
            assert!(
                !s.claim_published("paused", "n2", l2.epoch).unwrap(),
                "owned"
            );

            // n1's lease runs out: the published one is left unowned, the others end.
            let lost = s.expire_lost_nodes(LEASE + 1).unwrap();
            assert_eq!(lost.len(), 1);
            let mut ended: Vec<&str> = lost[0].sandboxes.iter().map(|x| x.0.as_str()).collect();
            ended.sort();
            assert_eq!(ended, ["local", "run"]);
            assert_eq!(lost[0].unowned, ["paused".to_string()]);
            let row = s.sandbox("paused").unwrap().unwrap();
            assert_eq!(row.state, SandboxRowState::Running);
            assert_eq!(s.sandbox_owner("paused").unwrap(), None);
            assert!(s.is_unowned_published("paused").unwrap());
            assert!(s.node_sandboxes("n1").unwrap().is_empty());
            // The lost node cannot resume it under its old epoch.
            assert!(matches!(
                s.clear_published("paused", "n1", l1.epoch),
                Err(Error::Fenced { .. })
            ));
            assert!(matches!(
                s.claim_published("paused", "n1", l1.epoch),
                Err(Error::Fenced { .. })
            ));

            // n2 claims it to resume it; nobody else can, n1 back under a new epoch
            // neither (its reconciliation drops its copy).
            assert!(s.claim_published("paused", "n2", l2.epoch).unwrap());
            assert!(!s.claim_published("paused", "n2", l2.epoch).unwrap());
            let b1 = s.register_node(&reg("n1", 10), 12_000, LEASE).unwrap();
            assert!(!s.claim_published("paused", "n1", b1.epoch).unwrap());
            assert!(!s.claim_sandbox("paused", "n1", b1.epoch).unwrap());
            assert!(!s.clear_published("paused", "n1", b1.epoch).unwrap());
            let owner = s.sandbox_owner("paused").unwrap().unwrap();
            assert_eq!((owner.node_id.as_str(), owner.epoch), ("n2", l2.epoch));
            assert!(!s.is_unowned_published("paused").unwrap());

            // n2's resume failed: it gives the sandbox back; then n1, back, adopts it
            // (its copy is the published one) and keeps it movable.
            assert!(!s.disown("paused", "n2", l2.epoch - 1, 6).unwrap(), "stale");
            assert!(s.disown("paused", "n2", l2.epoch, 6).unwrap());
            assert!(s.is_unowned_published("paused").unwrap());
            assert!(s.claim_sandbox("paused", "n1", b1.epoch).unwrap());
            assert!(!s.is_unowned_published("paused").unwrap());
            assert_eq!(
                s.expire_lost_nodes(12_000 + LEASE + 1).unwrap()[0].unowned,
                ["paused".to_string()],
                "still published"
            );

            // A move through the database (transfer) resumes it: no copy counts after.
            let l3 = s.register_node(&reg("n3", 10), 30_000, LEASE).unwrap();
            assert!(s.claim_published("paused", "n3", l3.epoch).unwrap());
            assert!(s.clear_published("paused", "n3", l3.epoch).unwrap());
            assert!(s.mark_published("paused", "n3", l3.epoch, 30_001).unwrap());
            assert!(s.transfer_sandbox("paused", "n3", l3.epoch).unwrap());
            let lost = s.expire_lost_nodes(30_000 + LEASE + 1).unwrap();
            let n3 = lost.iter().find(|l| l.id == "n3").unwrap();
            assert!(n3.unowned.is_empty());
            assert_eq!(n3.sandboxes.len(), 1, "ended with its node");
        });
    }

    /// A move from a node that is unreachable, draining or full is a compare and set:
    /// one of two concurrent moves wins, the old node can no longer resume the sandbox
    /// itself, and a failed takeover gives it back (or leaves it unowned once its old
    /// node is lost).
    #[test]
    fn a_move_claims_the_sandbox_from_its_old_node_once() {
        each_backend(|s| {
            let team = s.ensure_team("t").unwrap().id;
            let l1 = s.register_node(&reg("n1", 10), 0, LEASE).unwrap();
            let l2 = s.register_node(&reg("n2", 10), 0, LEASE).unwrap();
            let l3 = s.register_node(&reg("n3", 10), 0, LEASE).unwrap();
            let p = s.reserve_placement("n1", "sb", NEED, 0, 60_000).unwrap();
            s.commit_placement(&p, &sandbox("sb", team), 1).unwrap();
            assert!(s.mark_published("sb", "n1", l1.epoch, 2).unwrap());
            let before = s.move_sandbox("sb", "n1", "n2", l2.epoch).unwrap().unwrap();
            assert_eq!(
                before.owner,
                Some(SandboxOwner {
                    node_id: "n1".into(),
                    epoch: l1.epoch
                })
            );
            assert_eq!(before.published_at, Some(2));
            assert!(
                s.move_sandbox("sb", "n1", "n3", l3.epoch)
                    .unwrap()
                    .is_none(),
                "lost the race"
            );
            assert!(
                !s.clear_published("sb", "n1", l1.epoch).unwrap(),
                "n1 may not resume it"
            );
            assert!(matches!(
                s.move_sandbox("sb", "n2", "n1", l1.epoch - 1),
                Err(Error::Fenced { .. })
            ));
            // n2's takeover failed: back to n1, published as before.
            assert!(s.give_back("sb", "n2", l2.epoch, &before, 3).unwrap());
            assert_eq!(s.sandbox_owner("sb").unwrap().unwrap().node_id, "n1");
            assert!(!s.give_back("sb", "n2", l2.epoch, &before, 3).unwrap());
            // n1 is lost while n3 takes it over, which fails: unowned, for the next resume.
            let before = s.move_sandbox("sb", "n1", "n3", l3.epoch).unwrap().unwrap();
            s.renew_lease(&l3, 9_000, LEASE, &[], &serde_json::json!({}))
                .unwrap();
            assert_eq!(s.expire_lost_nodes(LEASE + 1).unwrap()[0].id, "n1");
            assert!(
                s.give_back("sb", "n3", l3.epoch, &before, LEASE + 2)
                    .unwrap()
            );
            assert!(s.is_unowned_published("sb").unwrap());
            // An unowned published sandbox is movable from any node name.
            assert!(
                s.move_sandbox("sb", "n1", "n3", l3.epoch)
                    .unwrap()
                    .is_some()
            );
            // No published copy and the old node gone: the failed move ends it.
            let p = s
                .reserve_placement("n3", "bare", NEED, LEASE, 60_000)
                .unwrap();
            s.commit_placement(&p, &sandbox("bare", team), LEASE)
                .unwrap();
            let l4 = s.register_node(&reg("n4", 10), LEASE, LEASE).unwrap();
            let before = s
                .move_sandbox("bare", "n3", "n4", l4.epoch)
                .unwrap()
                .unwrap();
            s.register_node(&reg("n3", 10), LEASE, LEASE).unwrap();
            assert!(
                s.give_back("bare", "n4", l4.epoch, &before, LEASE + 3)
                    .unwrap()
            );
            let row = s.sandbox("bare").unwrap().unwrap();
            assert_eq!(row.state, SandboxRowState::Ended);
        });
    }

    /// Many replicas resume the same unowned sandboxes at once, each on its own node:
    /// every sandbox gets exactly one new owner.
    #[test]
    fn concurrent_claims_of_published_sandboxes_give_one_owner() {
        each_shared_backend(|open| {
            let s = open();
            let team = s.ensure_team("t").unwrap().id;
            let mut big = reg("gone", 100);
            big.capacity.cpu_count = 100;
            let l0 = s.register_node(&big, 0, LEASE).unwrap();
            let ids: Vec<String> = (0..12).map(|i| format!("p{i}")).collect();
            for id in &ids {
                let p = s.reserve_placement("gone", id, NEED, 0, 60_000).unwrap();
                s.commit_placement(&p, &sandbox(id, team), 1).unwrap();
                assert!(s.mark_published(id, "gone", l0.epoch, 2).unwrap());
            }
            let nodes = ["n1", "n2", "n3", "n4"];
            let epochs: Vec<i64> = nodes
                .iter()
                .map(|n| s.register_node(&reg(n, 100), 5_000, LEASE).unwrap().epoch)
                .collect();
            let lost = s.expire_lost_nodes(LEASE + 1).unwrap();
            assert_eq!(lost.len(), 1);
            assert_eq!(lost[0].unowned.len(), ids.len());
            race_claims(open, &nodes, &epochs, &ids, |st, id, n, e| {
                st.claim_published(id, n, e).unwrap()
            });
        });
    }

    #[test]
    fn concurrent_claims_give_a_sandbox_one_owner() {
        each_shared_backend(|open| {
            let s = open();
            let team = s.ensure_team("t").unwrap().id;
            let nodes = ["n1", "n2", "n3", "n4"];
            let epochs: Vec<i64> = nodes
                .iter()
                .map(|n| s.register_node(&reg(n, 100), 0, LEASE).unwrap().epoch)
                .collect();
            let ids: Vec<String> = (0..20).map(|i| format!("sb{i}")).collect();
            for id in &ids {
                s.insert_sandbox(&sandbox(id, team)).unwrap();
            }
            race_claims(open, &nodes, &epochs, &ids, |st, id, n, e| {
                st.claim_sandbox(id, n, e).unwrap()
            });
        });
    }

    /// Each node (under its epoch) claims every id at once, from its own connection
    /// (`claim(store, id, node, epoch)`): each id must be won exactly once, by a node
    /// the store then names as its owner.
    fn race_claims(
        open: &dyn Fn() -> Store,
        nodes: &[&str],
        epochs: &[i64],
        ids: &[String],
        claim: fn(&Store, &str, &str, i64) -> bool,
    ) {
        let barrier = Arc::new(Barrier::new(nodes.len()));
        let handles: Vec<_> = nodes
            .iter()
            .zip(epochs)
            .map(|(n, &epoch)| {
                let (store, barrier, ids, n) =
                    (open(), barrier.clone(), ids.to_vec(), n.to_string());
                std::thread::spawn(move || {
                    barrier.wait();
                    ids.iter()
                        .filter(|id| claim(&store, id, &n, epoch))
                        .cloned()
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let won: Vec<Vec<String>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let mut all: Vec<&String> = won.iter().flatten().collect();
        all.sort();
        assert_eq!(
            all.len(),
            ids.len(),
            "each sandbox won exactly once: {won:?}"
        );
        all.dedup();
        assert_eq!(all.len(), ids.len(), "no sandbox won twice: {won:?}");
        let s = open();
        for (n, w) in nodes.iter().zip(&won) {
            for id in w {
                assert_eq!(s.sandbox_owner(id).unwrap().unwrap().node_id, *n);
            }
        }
    }

    /// Many replicas place many sandboxes at once on three nodes: exactly the
    /// capacity gets placed, and no node is ever over its limits.
    #[test]
    fn concurrent_placements_never_oversubscribe() {
        each_shared_backend(|open| {
            let s = open();
            // n1, n2: 8 vCPUs, room for 4 sandboxes of 2 vCPUs; n3: 3 sandboxes at most.
            for (n, max) in [("n1", 10), ("n2", 10), ("n3", 3)] {
                s.register_node(&reg(n, max), 0, LEASE).unwrap();
            }
            let capacity = 4 + 4 + 3;
            let (replicas, per_replica) = (6, 10);
            let barrier = Arc::new(Barrier::new(replicas));
            let handles: Vec<_> = (0..replicas)
                .map(|r| {
                    let (store, barrier) = (open(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        let mut placed = Vec::new();
                        for i in 0..per_replica {
                            match store.place_sandbox(&format!("r{r}-{i}"), "base", NEED, 1, 60_000)
                            {
                                Ok(p) => placed.push(p),
                                Err(Error::NoCapacity(_)) => {}
                                Err(e) => panic!("placement failed: {e}"),
                            }
                        }
                        placed
                    })
                })
                .collect();
            let placed: Vec<Placement> = handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect();
            assert_eq!(placed.len(), capacity, "{placed:?}");
            let ids: BTreeSet<&str> = placed.iter().map(|p| p.sandbox_id.as_str()).collect();
            assert_eq!(ids.len(), capacity);
            for n in s.nodes(2).unwrap() {
                assert!(n.sandboxes <= u64::from(n.capacity.max_sandboxes), "{n:?}");
                assert!(n.cpu_used <= u64::from(n.capacity.cpu_count), "{n:?}");
                let here = placed.iter().filter(|p| p.node_id == n.id).count() as u64;
                assert_eq!(here, n.sandboxes, "{n:?}");
            }
        });
    }

    /// Several replicas expire the same lost nodes at once: each node and each of its
    /// sandboxes is reported by exactly one of them.
    #[test]
    fn concurrent_expiry_reports_each_loss_once() {
        each_shared_backend(|open| {
            let s = open();
            let team = s.ensure_team("t").unwrap().id;
            for n in ["n1", "n2", "n3"] {
                s.register_node(&reg(n, 100), 0, LEASE).unwrap();
            }
            for i in 0..12 {
                let p = s
                    .place_sandbox(&format!("sb{i}"), "base", NEED, 1, 60_000)
                    .unwrap();
                s.commit_placement(&p, &sandbox(&format!("sb{i}"), team), 2)
                    .unwrap();
            }
            let barrier = Arc::new(Barrier::new(5));
            let handles: Vec<_> = (0..5)
                .map(|_| {
                    let (store, barrier) = (open(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        store.expire_lost_nodes(LEASE + 1).unwrap()
                    })
                })
                .collect();
            let lost: Vec<LostNode> = handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect();
            let nodes: Vec<&str> = lost.iter().map(|l| l.id.as_str()).collect();
            assert_eq!(nodes.len(), 3, "{nodes:?}");
            let sandboxes: BTreeSet<String> = lost
                .iter()
                .flat_map(|l| l.sandboxes.iter().map(|x| x.0.clone()))
                .collect();
            assert_eq!(
                sandboxes.len(),
                lost.iter().map(|l| l.sandboxes.len()).sum::<usize>()
            );
            assert_eq!(sandboxes.len(), 12);
            assert!(s.running_sandboxes(None).unwrap().is_empty());
        });
    }
}
