//! API keys as this process last read them from a PostgreSQL store, kept for at most
//! [`KEY_CACHE_TTL`], so that a replica's requests do not each wait a round trip to the
//! database before anything else (docs/cluster.md, "Create latency through a replica").
//!
//! The bound is the contract: a key revoked anywhere (another replica, `cubicle apikey
//! revoke --database`) is refused by every replica at most [`KEY_CACHE_TTL`] later; a
//! revocation through this process's API clears the cache at once. Only found keys are
//! kept (a new key works at once; a wrong one is looked up every time), by the key's
//! SHA-256, and at most [`MAX_ENTRIES`] of them. SQLite (the single host) answers a
//! lookup in microseconds and is not cached.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cubicle_store::FoundKey;

/// How long a key read from the database is trusted without reading it again.
pub const KEY_CACHE_TTL: Duration = Duration::from_secs(2);

/// Keys kept at most (the cache is emptied when full: a bound, not an eviction policy).
const MAX_ENTRIES: usize = 10_000;

/// See the module documentation.
#[derive(Default)]
pub struct KeyCache {
    entries: Mutex<HashMap<String, (Instant, FoundKey)>>,
}

impl KeyCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Instant, FoundKey)>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The key with SHA-256 `hash`, if it was read less than [`KEY_CACHE_TTL`] ago.
    pub fn get(&self, hash: &str) -> Option<FoundKey> {
        let mut m = self.lock();
        match m.get(hash) {
            Some((at, k)) if at.elapsed() < KEY_CACHE_TTL => Some(k.clone()),
            Some(_) => {
                m.remove(hash);
                None
            }
            None => None,
        }
    }

    /// Remembers key `hash` as just read.
    pub fn put(&self, hash: String, key: FoundKey) {
        let mut m = self.lock();
        if m.len() >= MAX_ENTRIES {
            m.clear();
        }
        m.insert(hash, (Instant::now(), key));
    }

    /// Notes that key `hash`'s use at `now` is being recorded (so the next requests
    /// within the minute do not record it again); its read time stays.
    pub fn used(&self, hash: &str, now: i64) {
        if let Some((_, k)) = self.lock().get_mut(hash) {
            k.last_used_at = Some(now);
        }
    }

    /// Forgets every key (a key was revoked through this process).
    pub fn clear(&self) {
        self.lock().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cubicle_store::Team;

    fn key(id: i64) -> FoundKey {
        FoundKey {
            key_id: id,
            team: Team {
                id: 1,
                name: "t".into(),
                created_at: 0,
            },
            last_used_at: None,
        }
    }

    #[test]
    fn entries_expire_and_clear() {
        let c = KeyCache::default();
        c.put("a".into(), key(1));
        assert_eq!(c.get("a").map(|k| k.key_id), Some(1));
        assert!(c.get("b").is_none());
        c.lock().get_mut("a").unwrap().0 = Instant::now() - KEY_CACHE_TTL;
        assert!(
            c.get("a").is_none(),
            "an entry older than the TTL is not used"
        );
        assert!(c.lock().is_empty(), "and is dropped");
        c.put("a".into(), key(1));
        c.clear();
        assert!(c.get("a").is_none());
    }
}
