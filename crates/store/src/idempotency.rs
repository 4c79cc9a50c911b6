//! Create idempotency (`Idempotency-Key` header): the first request with a key claims
//! it (sandbox id still unknown), the create fills it in; a repeat with the same body
//! within [`IDEMPOTENCY_TTL_MS`] gets the same sandbox, a repeat with another body is a
//! conflict. Keys are per team.

use rusqlite::{OptionalExtension, params};

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
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let now = now_ms();
        tx.execute(
            "DELETE FROM idempotency_keys WHERE expires_at < ?1",
            params![now],
        )?;
        let existing: Option<(String, Option<String>)> = tx
            .query_row(
                "SELECT request_hash, sandbox_id FROM idempotency_keys WHERE team_id = ?1 AND key = ?2",
                params![team_id, key],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?;
        let claim = match existing {
            Some((h, _)) if h != request_hash => IdempotencyClaim::Mismatch,
            Some((_, Some(id))) => IdempotencyClaim::Done(id),
            Some((_, None)) => IdempotencyClaim::InFlight,
            None => {
                tx.execute(
                    "INSERT INTO idempotency_keys (team_id, key, request_hash, sandbox_id, created_at, expires_at)
                     VALUES (?1, ?2, ?3, NULL, ?4, ?5)",
                    params![team_id, key, request_hash, now, now + IDEMPOTENCY_TTL_MS],
                )?;
                IdempotencyClaim::Claimed
            }
        };
        tx.commit()?;
        Ok(claim)
    }

    /// Attach the created sandbox to a claimed key.
    pub fn complete_idempotency_key(
        &self,
        team_id: i64,
        key: &str,
        sandbox_id: &str,
    ) -> Result<()> {
        self.conn().execute(
            "UPDATE idempotency_keys SET sandbox_id = ?1 WHERE team_id = ?2 AND key = ?3",
            params![sandbox_id, team_id, key],
        )?;
        Ok(())
    }

    /// Forget a claimed key whose create failed (a retry may try again).
    pub fn release_idempotency_key(&self, team_id: i64, key: &str) -> Result<()> {
        self.conn().execute(
            "DELETE FROM idempotency_keys WHERE team_id = ?1 AND key = ?2 AND sandbox_id IS NULL",
            params![team_id, key],
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_complete_repeat_mismatch() {
        let s = Store::open_in_memory().unwrap();
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
        let s = Store::open_in_memory().unwrap();
        let a = s.ensure_team("a").unwrap();
        assert_eq!(
            s.claim_idempotency_key(a.id, "k", "h1").unwrap(),
            IdempotencyClaim::Claimed
        );
        s.conn()
            .execute("UPDATE idempotency_keys SET expires_at = 0", [])
            .unwrap();
        assert_eq!(
            s.claim_idempotency_key(a.id, "k", "h2").unwrap(),
            IdempotencyClaim::Claimed
        );
    }
}
