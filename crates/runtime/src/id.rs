//! [`SandboxId`]: the one rule for what a sandbox id may be.
//!
//! A sandbox id names a cgroup (`cubicle/<id>`), a directory (`<state>/sandboxes/<id>`),
//! the sandbox's hostname and a DNS label (`<port>-<id>.<domain>`), and it arrives from
//! clients in URL paths and headers. So it is 1 to [`SandboxId::MAX_LEN`] characters of
//! `[a-z0-9]`: nothing that could be a path separator, `.`/`..`, an option, or differ
//! between two spellings of one host name. E2B's own ids (`i` + 20 lowercase
//! alphanumerics, as the node makes them) follow the same rule.
//!
//! Every crate checks ids through this type (api, router, node, runtime, storage), so they
//! cannot disagree.

use std::fmt;
use std::ops::Deref;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A valid sandbox id (`^[a-z0-9]{1,32}$`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SandboxId(String);

impl SandboxId {
    /// The longest id.
    pub const MAX_LEN: usize = 32;

    /// Whether `id` follows the rule.
    pub fn is_valid(id: &str) -> bool {
        !id.is_empty()
            && id.len() <= Self::MAX_LEN
            && id
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    }

    /// `id` as a [`SandboxId`], or [`Error::InvalidId`].
    pub fn parse(id: &str) -> Result<SandboxId> {
        if Self::is_valid(id) {
            Ok(SandboxId(id.to_owned()))
        } else {
            Err(Error::InvalidId(id.to_owned()))
        }
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Deref for SandboxId {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for SandboxId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl AsRef<std::path::Path> for SandboxId {
    fn as_ref(&self) -> &std::path::Path {
        self.0.as_ref()
    }
}

impl std::borrow::Borrow<str> for SandboxId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for SandboxId {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        SandboxId::parse(s)
    }
}

impl TryFrom<String> for SandboxId {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        if Self::is_valid(&s) {
            Ok(SandboxId(s))
        } else {
            Err(Error::InvalidId(s))
        }
    }
}

impl From<SandboxId> for String {
    fn from(id: SandboxId) -> String {
        id.0
    }
}

impl PartialEq<str> for SandboxId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for SandboxId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl PartialEq<String> for SandboxId {
    fn eq(&self, other: &String) -> bool {
        &self.0 == other
    }
}

impl PartialEq<SandboxId> for str {
    fn eq(&self, other: &SandboxId) -> bool {
        self == other.0
    }
}

impl PartialEq<SandboxId> for &str {
    fn eq(&self, other: &SandboxId) -> bool {
        *self == other.0
    }
}

impl PartialEq<SandboxId> for String {
    fn eq(&self, other: &SandboxId) -> bool {
        *self == other.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_rule() {
        for ok in ["a", "i0123456789abcdefghij", &"z".repeat(32), "007"] {
            assert!(SandboxId::is_valid(ok), "{ok:?}");
            assert_eq!(
                SandboxId::parse(ok).map(String::from).ok().as_deref(),
                Some(ok)
            );
        }
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "a b",
            "A",
            "I-x",
            "a-b",
            "a_b",
            "../a",
            ".creating-x",
            &"x".repeat(33),
            "é",
        ] {
            assert!(!SandboxId::is_valid(bad), "{bad:?}");
            assert!(matches!(SandboxId::parse(bad), Err(Error::InvalidId(_))));
        }
    }

    #[test]
    fn json_is_a_checked_string() {
        let id: SandboxId = serde_json::from_str("\"abc1\"").unwrap();
        assert_eq!(id, "abc1");
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"abc1\"");
        assert!(serde_json::from_str::<SandboxId>("\"../etc\"").is_err());
    }
}
