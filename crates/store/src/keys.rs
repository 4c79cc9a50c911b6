//! Teams and API keys. A key is `e2b_` + 40 lowercase hex characters (160 random bits,
//! the shape E2B users know); only its SHA-256 is stored, plus a short display prefix.
//! Because the key is high-entropy, a plain (unsalted) hash is enough: it cannot be
//! brute-forced, and it lets authentication be one indexed lookup.

use rand::RngCore;
use sha2::{Digest, Sha256};

use crate::db::{Row, args};
use crate::{Error, Result, Store, now_ms};

/// Every key starts with this.
pub const KEY_PREFIX: &str = "e2b_";
/// Characters of a key kept for display (`e2b_` + 8 hex).
const DISPLAY_PREFIX_LEN: usize = 12;

/// A team: the owner of keys and sandboxes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Team {
    /// Row id.
    pub id: i64,
    /// Unique name.
    pub name: String,
    /// Unix ms.
    pub created_at: i64,
}

/// What the store knows of a key (never the key itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKeyInfo {
    /// Row id.
    pub id: i64,
    /// Owner team.
    pub team_id: i64,
    /// Owner team's name.
    pub team_name: String,
    /// Display prefix (`e2b_1a2b3c4d`).
    pub prefix: String,
    /// Unix ms.
    pub created_at: i64,
    /// Unix ms of the last authentication (updated at most once a minute).
    pub last_used_at: Option<i64>,
    /// Unix ms of revocation.
    pub revoked_at: Option<i64>,
}

/// A freshly created key: the only moment the plaintext exists.
#[derive(Debug, Clone)]
pub struct ApiKey {
    /// The key to hand to the user.
    pub plaintext: String,
    /// Its stored facts.
    pub info: ApiKeyInfo,
}

/// Uses of a key are recorded at most this often.
const KEY_USE_GRANULARITY_MS: i64 = 60_000;

/// A valid key, as [`Store::find_key`] found it.
#[derive(Debug, Clone)]
pub struct FoundKey {
    pub key_id: i64,
    pub team: Team,
    pub last_used_at: Option<i64>,
}

impl FoundKey {
    /// Whether its recorded last use is old enough to be written again.
    pub fn use_is_stale(&self, now: i64) -> bool {
        self.last_used_at
            .is_none_or(|t| t < now - KEY_USE_GRANULARITY_MS)
    }
}

/// Hex SHA-256 of a key.
pub fn hash_key(key: &str) -> String {
    let d = Sha256::digest(key.as_bytes());
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `key` has the shape of a Cubicle key (`e2b_` + 40 lowercase hex).
pub fn is_well_formed_key(key: &str) -> bool {
    key.strip_prefix(KEY_PREFIX).is_some_and(|h| {
        h.len() == 40
            && h.bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
    })
}

fn new_key() -> String {
    let mut bytes = [0u8; 20];
    rand::rng().fill_bytes(&mut bytes);
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("{KEY_PREFIX}{hex}")
}

fn validate_team_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c));
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "team name '{name}' must be 1-64 characters of [A-Za-z0-9._-]"
        )))
    }
}

fn key_info(r: &Row) -> Result<ApiKeyInfo> {
    Ok(ApiKeyInfo {
        id: r.get(0)?,
        team_id: r.get(1)?,
        team_name: r.get(2)?,
        prefix: r.get(3)?,
        created_at: r.get(4)?,
        last_used_at: r.get(5)?,
        revoked_at: r.get(6)?,
    })
}

fn team(r: &Row) -> Result<Team> {
    Ok(Team {
        id: r.get(0)?,
        name: r.get(1)?,
        created_at: r.get(2)?,
    })
}

const KEY_COLUMNS: &str =
    "k.id, k.team_id, t.name, k.prefix, k.created_at, k.last_used_at, k.revoked_at";

impl Store {
    /// The team called `name`, created if missing.
    pub fn ensure_team(&self, name: &str) -> Result<Team> {
        validate_team_name(name)?;
        self.with_conn(|c| {
            c.execute(
                "INSERT INTO teams (name, created_at) VALUES (?1, ?2) ON CONFLICT (name) DO NOTHING",
                args![name, now_ms()],
            )?;
            team(&c.query_one(
                "SELECT id, name, created_at FROM teams WHERE name = ?1",
                args![name],
            )?)
        })
    }

    /// The team with id `id`.
    pub fn team(&self, id: i64) -> Result<Option<Team>> {
        self.with_conn(|c| {
            c.query_opt(
                "SELECT id, name, created_at FROM teams WHERE id = ?1",
                args![id],
            )?
            .as_ref()
            .map(team)
            .transpose()
        })
    }

    /// The team called `name`, if it exists.
    pub fn team_by_name(&self, name: &str) -> Result<Option<Team>> {
        self.with_conn(|c| {
            c.query_opt(
                "SELECT id, name, created_at FROM teams WHERE name = ?1",
                args![name],
            )?
            .as_ref()
            .map(team)
            .transpose()
        })
    }

    /// Number of teams.
    pub fn team_count(&self) -> Result<i64> {
        self.with_conn(|c| c.query_one("SELECT COUNT(*) FROM teams", &[])?.get(0))
    }

    /// A new key for team `team_id`. The plaintext is returned once and never stored.
    pub fn create_api_key(&self, team_id: i64) -> Result<ApiKey> {
        let plaintext = new_key();
        let prefix = plaintext[..DISPLAY_PREFIX_LEN].to_string();
        let info = self.with_conn(|c| {
            let id: i64 = c
                .query_one(
                    "INSERT INTO api_keys (team_id, key_hash, prefix, created_at) VALUES (?1, ?2, ?3, ?4) RETURNING id",
                    args![team_id, hash_key(&plaintext), prefix, now_ms()],
                )?
                .get(0)?;
            key_info(&c.query_one(
                &format!("SELECT {KEY_COLUMNS} FROM api_keys k JOIN teams t ON t.id = k.team_id WHERE k.id = ?1"),
                args![id],
            )?)
        })?;
        Ok(ApiKey { plaintext, info })
    }

    /// The team owning `key`, if the key exists and is not revoked. Records the use (at
    /// most one write per key and minute).
    pub fn authenticate(&self, key: &str) -> Result<Option<Team>> {
        let Some(found) = self.find_key(key)? else {
            return Ok(None);
        };
        if found.use_is_stale(now_ms()) {
            self.record_key_use(found.key_id)?;
        }
        Ok(Some(found.team))
    }

    /// Read-only half of [`Store::authenticate`] (works on [`Store::read`]'s view): the
    /// key's id, team and last use, if it exists and is not revoked.
    pub fn find_key(&self, key: &str) -> Result<Option<FoundKey>> {
        if !is_well_formed_key(key) {
            return Ok(None);
        }
        let row = self.with_conn(|c| {
            c.query_opt(
                "SELECT k.id, k.last_used_at, t.id, t.name, t.created_at FROM api_keys k JOIN teams t ON t.id = k.team_id
                 WHERE k.key_hash = ?1 AND k.revoked_at IS NULL",
                args![hash_key(key)],
            )
        })?;
        row.map(|r| {
            Ok(FoundKey {
                key_id: r.get(0)?,
                last_used_at: r.get(1)?,
                team: Team {
                    id: r.get(2)?,
                    name: r.get(3)?,
                    created_at: r.get(4)?,
                },
            })
        })
        .transpose()
    }

    /// Records that key `key_id` was used now (unless it was within the last minute).
    pub fn record_key_use(&self, key_id: i64) -> Result<()> {
        let now = now_ms();
        self.with_conn(|c| {
            c.execute(
                "UPDATE api_keys SET last_used_at = ?1 WHERE id = ?2 AND (last_used_at IS NULL OR last_used_at < ?3)",
                args![now, key_id, now - KEY_USE_GRANULARITY_MS],
            )
        })?;
        Ok(())
    }

    /// All keys, oldest first.
    pub fn list_api_keys(&self) -> Result<Vec<ApiKeyInfo>> {
        self.with_conn(|c| {
            c.query(
                &format!(
                    "SELECT {KEY_COLUMNS} FROM api_keys k JOIN teams t ON t.id = k.team_id ORDER BY k.id"
                ),
                &[],
            )?
            .iter()
            .map(key_info)
            .collect()
        })
    }

    /// Keys of one team, oldest first.
    pub fn team_api_keys(&self, team_id: i64) -> Result<Vec<ApiKeyInfo>> {
        self.with_conn(|c| {
            c.query(
                &format!(
                    "SELECT {KEY_COLUMNS} FROM api_keys k JOIN teams t ON t.id = k.team_id WHERE k.team_id = ?1 ORDER BY k.id"
                ),
                args![team_id],
            )?
            .iter()
            .map(key_info)
            .collect()
        })
    }

    /// Revoke the one unrevoked key whose display prefix starts with `prefix` (at least
    /// `e2b_` + 4 characters). Errors if none or several match.
    pub fn revoke_api_key(&self, prefix: &str) -> Result<ApiKeyInfo> {
        self.revoke_matching(prefix, None)
    }

    /// [`Store::revoke_api_key`] among team `team_id`'s keys only (another team's key is
    /// "not found").
    pub fn revoke_team_api_key(&self, team_id: i64, prefix: &str) -> Result<ApiKeyInfo> {
        self.revoke_matching(prefix, Some(team_id))
    }

    fn revoke_matching(&self, prefix: &str, team_id: Option<i64>) -> Result<ApiKeyInfo> {
        if prefix.len() < KEY_PREFIX.len() + 4 || !prefix.starts_with(KEY_PREFIX) {
            return Err(Error::Invalid(format!(
                "give at least the first 8 characters of the key (e.g. e2b_1a2b), not '{prefix}'"
            )));
        }
        // Keys are ASCII: anything else starts none of them (and the byte slice below
        // needs a char boundary).
        if !prefix.is_ascii() {
            return Err(Error::NotFound(format!(
                "no active API key starts with {prefix:?}"
            )));
        }
        // The display prefix is 12 chars; a longer argument (the whole key) also works.
        let wanted = &prefix[..prefix.len().min(DISPLAY_PREFIX_LEN)];
        let matches: Vec<ApiKeyInfo> = self
            .list_api_keys()?
            .into_iter()
            .filter(|k| k.revoked_at.is_none() && k.prefix.starts_with(wanted))
            .filter(|k| team_id.is_none_or(|t| k.team_id == t))
            .filter(|_| prefix.len() <= DISPLAY_PREFIX_LEN || is_well_formed_key(prefix))
            .collect();
        let key = match matches.as_slice() {
            [] => {
                return Err(Error::NotFound(format!(
                    "no active API key starts with '{prefix}'"
                )));
            }
            [k] => k.clone(),
            _ => {
                return Err(Error::Conflict(format!(
                    "{} active keys start with '{prefix}'; give more characters",
                    matches.len()
                )));
            }
        };
        let now = now_ms();
        self.with_conn(|c| {
            c.execute(
                "UPDATE api_keys SET revoked_at = ?1 WHERE id = ?2",
                args![now, key.id],
            )
        })?;
        Ok(ApiKeyInfo {
            revoked_at: Some(now),
            ..key
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testdb::each_backend;

    #[test]
    fn keys_are_hashed_and_authenticate_their_team() {
        each_backend(|s| {
            let a = s.ensure_team("a").unwrap();
            let b = s.ensure_team("b").unwrap();
            assert_eq!(s.ensure_team("a").unwrap(), a);
            let ka = s.create_api_key(a.id).unwrap();
            let kb = s.create_api_key(b.id).unwrap();
            assert!(is_well_formed_key(&ka.plaintext), "{}", ka.plaintext);
            assert_ne!(ka.plaintext, kb.plaintext);
            assert_eq!(s.authenticate(&ka.plaintext).unwrap(), Some(a.clone()));
            assert_eq!(s.authenticate(&kb.plaintext).unwrap(), Some(b));
            assert_eq!(
                s.authenticate("e2b_0000000000000000000000000000000000000000")
                    .unwrap(),
                None
            );
            assert_eq!(s.authenticate("").unwrap(), None);
            assert_eq!(s.authenticate("nonsense").unwrap(), None);
            // The plaintext is nowhere in the database.
            let n: i64 = s
                .with_conn(|c| {
                    c.query_one(
                        "SELECT COUNT(*) FROM api_keys WHERE key_hash = ?1 OR prefix = ?1",
                        args![ka.plaintext.as_str()],
                    )?
                    .get(0)
                })
                .unwrap();
            assert_eq!(n, 0);
            let listed = s.list_api_keys().unwrap();
            assert_eq!(listed.len(), 2);
            assert!(listed[0].last_used_at.is_some());
            assert_eq!(listed[0].prefix, &ka.plaintext[..12]);
        });
    }

    #[test]
    fn revocation_by_prefix() {
        each_backend(|s| {
            let t = s.ensure_team("admin").unwrap();
            let k = s.create_api_key(t.id).unwrap();
            assert!(matches!(s.revoke_api_key("e2b_"), Err(Error::Invalid(_))));
            assert!(matches!(
                s.revoke_api_key("e2b_0\u{1b}×íZ\u{87078}v»Ä"),
                Err(Error::NotFound(_))
            ));
            assert!(matches!(
                s.revoke_api_key("e2b_zzzzzzzz"),
                Err(Error::NotFound(_))
            ));
            let r = s.revoke_api_key(&k.plaintext[..10]).unwrap();
            assert!(r.revoked_at.is_some());
            assert_eq!(s.authenticate(&k.plaintext).unwrap(), None);
            assert!(matches!(
                s.revoke_api_key(&k.plaintext),
                Err(Error::NotFound(_))
            ));
        });
    }

    #[test]
    fn a_team_sees_and_revokes_only_its_own_keys() {
        each_backend(|s| {
            let a = s.ensure_team("a").unwrap();
            let b = s.ensure_team("b").unwrap();
            let ka = s.create_api_key(a.id).unwrap();
            let kb = s.create_api_key(b.id).unwrap();
            let listed: Vec<_> = s.team_api_keys(a.id).unwrap();
            assert_eq!(listed.len(), 1);
            assert_eq!(listed[0].prefix, ka.info.prefix);
            assert!(matches!(
                s.revoke_team_api_key(a.id, &kb.info.prefix),
                Err(Error::NotFound(_))
            ));
            assert!(s.authenticate(&kb.plaintext).unwrap().is_some());
            let r = s.revoke_team_api_key(b.id, &kb.info.prefix).unwrap();
            assert_eq!(r.team_name, "b");
            assert!(s.authenticate(&kb.plaintext).unwrap().is_none());
        });
    }

    #[test]
    fn bad_team_names_are_refused() {
        each_backend(|s| {
            assert!(s.ensure_team("").is_err());
            assert!(s.ensure_team("a b").is_err());
            assert!(s.ensure_team(&"x".repeat(65)).is_err());
        });
    }
}
