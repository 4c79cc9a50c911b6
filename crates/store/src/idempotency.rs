//! Create idempotency (`Idempotency-Key` header): the first request with a key claims
//! it (sandbox id still unknown), the create fills it in; a repeat with the same body
//! within [`IDEMPOTENCY_TTL_MS`] gets the same sandbox, a repeat with another body is a
//! conflict. Keys are per team.

use crate::db::args;
use crate::{Result, Store, now_ms};

/// How long a key is remembered: 24 h.
pub const IDEMPOTENCY_TTL_MS: i64 = 24 * 3600 * 1000;

/// Outcome of [`Store::claim_idempotency_key`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdempotencyClaim {
    /// The key is ours: create, then [`Store::complete_idempotency_key`] (or
    /// [`Store::release_idempotency_key`] on failure).
    Claimed,
    /// Same key, same request, already done: answer with this sandbox.
    Done(String),
    /// Same key, same request, still being created by another request.
    InFlight,
    /// Same key, different request.
    Mismatch,
}

impl Store {
    /// Claim `key` for a request whose canonical body hashes to `request_hash`.
    pub fn claim_idempotency_key(
        &self,
        team_id: i64,
        key: &str,
        request_hash: &str,
    ) -> Result<IdempotencyClaim> {
        let now = now_ms();
        // The insert is the claim: of concurrent claimers (several replicas), exactly
        // one inserts; the others read what it stored.
        self.transaction(|tx| {
            tx.execute(
                "DELETE FROM idempotency_keys WHERE expires_at < ?1",
                args![now],
            )?;
            let inserted = tx.execute(
                "INSERT INTO idempotency_keys (team_id, key, request_hash, sandbox_id, created_at, expires_at)
                 VALUES (?1, ?2, ?3, NULL, ?4, ?5) ON CONFLICT (team_id, key) DO NOTHING",
                args![team_id, key, request_hash, now, now + IDEMPOTENCY_TTL_MS],
            )?;
            if inserted > 0 {
                return Ok(IdempotencyClaim::Claimed);
            }
            let existing = tx.query_opt(
                "SELECT request_hash, sandbox_id FROM idempotency_keys WHERE team_id = ?1 AND key = ?2",
                args![team_id, key],
            )?;
            Ok(match existing {
                None => IdempotencyClaim::InFlight, // released in between: the client retries
                Some(r) => {
                    let (h, id): (String, Option<String>) = (r.get(0)?, r.get(1)?);
                    match id {
                        _ if h != request_hash => IdempotencyClaim::Mismatch,
                        Some(id) => IdempotencyClaim::Done(id),
                        None => IdempotencyClaim::InFlight,
                    }
                }
            })
        })
    }

    /// Attach the created sandbox to a claimed key.
    pub fn complete_idempotency_key(
        &self,
        team_id: i64,
        key: &str,
        sandbox_id: &str,
    ) -> Result<()> {
        self.with_conn(|c| {
            c.execute(
                "UPDATE idempotency_keys SET sandbox_id = ?1 WHERE team_id = ?2 AND key = ?3",
                args![sandbox_id, team_id, key],
            )
        })?;
        Ok(())
    }

    /// Forget a claimed key whose create failed (a retry may try again).
    pub fn release_idempotency_key(&self, team_id: i64, key: &str) -> Result<()> {
        self.with_conn(|c| {
            c.execute(
                "DELETE FROM idempotency_keys WHERE team_id = ?1 AND key = ?2 AND sandbox_id IS NULL",
                args![team_id, key],
            )
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_complete_repeat_mismatch() {
        crate::testdb::each_backend(claim_complete_repeat_mismatch_on);
    }

    fn claim_complete_repeat_mismatch_on(s: &Store) {
        let a = s.ensure_team("a").unwrap();
        let b = s.ensure_team("b").unwrap();
        assert_eq!(
            s.claim_idempotency_key(a.id, "k", "h1").unwrap(),
            IdempotencyClaim::Claimed
        );
        assert_eq!(
            s.claim_idempotency_key(a.id, "k", "h1").unwrap(),
            IdempotencyClaim::InFlight
        );
        assert_eq!(
            s.claim_idempotency_key(a.id, "k", "h2").unwrap(),
            IdempotencyClaim::Mismatch
        );
        // Keys are per team.
        assert_eq!(
            s.claim_idempotency_key(b.id, "k", "h2").unwrap(),
            IdempotencyClaim::Claimed
        );
        s.complete_idempotency_key(a.id, "k", "sbx").unwrap();
        assert_eq!(
            s.claim_idempotency_key(a.id, "k", "h1").unwrap(),
            IdempotencyClaim::Done("sbx".into())
        );
        s.release_idempotency_key(b.id, "k").unwrap();
        assert_eq!(
            s.claim_idempotency_key(b.id, "k", "h3").unwrap(),
            IdempotencyClaim::Claimed
        );
    }

    #[test]
    fn expired_keys_are_forgotten() {
        crate::testdb::each_backend(expired_keys_are_forgotten_on);
    }

    fn expired_keys_are_forgotten_on(s: &Store) {
        let a = s.ensure_team("a").unwrap();
        assert_eq!(
            s.claim_idempotency_key(a.id, "k", "h1").unwrap(),
            IdempotencyClaim::Claimed
        );
        s.with_conn(|c| c.execute("UPDATE idempotency_keys SET expires_at = 0", &[]))
            .unwrap();
        assert_eq!(
            s.claim_idempotency_key(a.id, "k", "h2").unwrap(),
            IdempotencyClaim::Claimed
        );
    }
}
