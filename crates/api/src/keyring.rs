//! [`Keyring`]: the server's one secret key, and what is derived from it.
//!
//! The master key is 32 random bytes in a file only root can read (`<state>/secrets.key`,
//! mode 0600, made on first start), or a file the operator provides (it must not be
//! readable by group or others). Two keys are derived from it with HMAC-SHA256 and a
//! label each, so that one use can never stand in for the other:
//! - the **sealing key** (XChaCha20-Poly1305, RustCrypto's `chacha20poly1305`): secret
//!   values are stored sealed — a random 24-byte nonce, the ciphertext and the 16-byte
//!   tag — bound to the secret's id (associated data), so a sealed value copied to
//!   another secret's row does not open;
//! - the **volume-token key**: a volume's content-API token is
//!   `HMAC(key, "volume:" + id)`, so tokens need not be stored, and verifying one is a
//!   constant-time comparison.
//!
//! Losing the key file loses every secret value (the records stay; their values no
//! longer open) and changes every volume token. Back it up with the database.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use base64::Engine;
use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use zeroize::{Zeroize, Zeroizing};

type HmacSha256 = Hmac<Sha256>;

/// Prefix of volume tokens (they are opaque to SDKs).
const VOLUME_TOKEN_PREFIX: &str = "cvt_";
const NONCE_LEN: usize = 24;

/// The server's key and its derived keys. `Debug` shows nothing of them.
pub struct Keyring {
    sealing: XChaCha20Poly1305,
    volume_mac: Zeroizing<[u8; 32]>,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keyring(..)")
    }
}

/// Why a key file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// Reading or writing the file failed.
    #[error("key file {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not 64 hex digits, or others may read it.
    #[error("key file {path}: {message}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong and what to do.
        message: String,
    },
}

fn derive(master: &[u8; 32], label: &str) -> Zeroizing<[u8; 32]> {
    // HMAC accepts keys of any length: this cannot fail.
    let mut mac = <HmacSha256 as Mac>::new_from_slice(master).unwrap_or_else(|_| unreachable!());
    mac.update(label.as_bytes());
    let mut out = Zeroizing::new([0u8; 32]);
    out.copy_from_slice(&mac.finalize().into_bytes());
    out
}

impl Keyring {
    /// A keyring over `master`.
    pub fn from_master(master: &[u8; 32]) -> Keyring {
        let sealing_key = derive(master, "cubicle secret sealing v1");
        Keyring {
            sealing: XChaCha20Poly1305::new(sealing_key.as_ref().into()),
            volume_mac: derive(master, "cubicle volume tokens v1"),
        }
    }

    /// A keyring with a fresh random key that lives as long as this process (tests, or
    /// a server without a state directory).
    pub fn ephemeral() -> Keyring {
        let mut master = Zeroizing::new([0u8; 32]);
        rand::Rng::fill(&mut rand::rng(), &mut master[..]);
        Keyring::from_master(&master)
    }

    /// The key in `path`; with `create`, a new random one is written there (mode 0600)
    /// when the file does not exist.
    pub fn load(path: &Path, create: bool) -> Result<Keyring, KeyError> {
        let p = path.display().to_string();
        let io = |source| KeyError::Io {
            path: p.clone(),
            source,
        };
        if create && !path.exists() {
            let mut master = Zeroizing::new([0u8; 32]);
            rand::Rng::fill(&mut rand::rng(), &mut master[..]);
            let mut hex = Zeroizing::new(hex_encode(&master[..]));
            hex.push('\n');
            let tmp = path.with_extension("key.tmp");
            let _ = std::fs::remove_file(&tmp);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(io)?;
            f.write_all(hex.as_bytes()).map_err(io)?;
            f.sync_all().map_err(io)?;
            std::fs::rename(&tmp, path).map_err(io)?;
            return Ok(Keyring::from_master(&master));
        }
        let meta = std::fs::metadata(path).map_err(io)?;
        if meta.mode() & 0o077 != 0 {
            return Err(KeyError::Invalid {
                path: p,
                message: format!(
                    "mode {:o} lets others read the key; chmod 600 it",
                    meta.mode() & 0o777
                ),
            });
        }
        let text = Zeroizing::new(std::fs::read_to_string(path).map_err(io)?);
        let master = hex_decode(text.trim()).ok_or_else(|| KeyError::Invalid {
            path: p,
            message: "expected 64 hexadecimal digits (32 bytes), e.g. from `openssl rand -hex 32`"
                .into(),
        })?;
        Ok(Keyring::from_master(&master))
    }

    /// `plaintext` sealed for the record `id` (nonce || ciphertext || tag).
    pub fn seal(&self, id: &str, plaintext: &[u8]) -> Vec<u8> {
        let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
        let payload = Payload {
            msg: plaintext,
            aad: id.as_bytes(),
        };
        // Encryption only fails for messages beyond what fits in memory.
        let ct = self
            .sealing
            .encrypt(&nonce, payload)
            .unwrap_or_else(|_| unreachable!());
        let mut out = Vec::with_capacity(NONCE_LEN + ct.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&ct);
        out
    }

    /// The plaintext of `sealed` for the record `id`; `None` if it was sealed with
    /// another key, for another record, or altered.
    pub fn unseal(&self, id: &str, sealed: &[u8]) -> Option<Zeroizing<Vec<u8>>> {
        if sealed.len() < NONCE_LEN {
            return None;
        }
        let (nonce, ct) = sealed.split_at(NONCE_LEN);
        self.sealing
            .decrypt(
                XNonce::from_slice(nonce),
                Payload {
                    msg: ct,
                    aad: id.as_bytes(),
                },
            )
            .ok()
            .map(Zeroizing::new)
    }

    /// The content-API token of volume `id`.
    pub fn volume_token(&self, id: &str) -> String {
        let mut mac = <HmacSha256 as Mac>::new_from_slice(&self.volume_mac[..])
            .unwrap_or_else(|_| unreachable!());
        mac.update(b"volume:");
        mac.update(id.as_bytes());
        let tag = mac.finalize().into_bytes();
        format!(
            "{VOLUME_TOKEN_PREFIX}{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(tag)
        )
    }

    /// Whether `token` is volume `id`'s (constant time).
    pub fn check_volume_token(&self, id: &str, token: &str) -> bool {
        let Some(b64) = token.strip_prefix(VOLUME_TOKEN_PREFIX) else {
            return false;
        };
        let Ok(tag) = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(b64) else {
            return false;
        };
        let mut mac = <HmacSha256 as Mac>::new_from_slice(&self.volume_mac[..])
            .unwrap_or_else(|_| unreachable!());
        mac.update(b"volume:");
        mac.update(id.as_bytes());
        mac.verify_slice(&tag).is_ok()
    }
}

fn hex_encode(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn hex_decode(s: &str) -> Option<Zeroizing<[u8; 32]>> {
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut out = Zeroizing::new([0u8; 32]);
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

impl Drop for Keyring {
    fn drop(&mut self) {
        self.volume_mac.zeroize();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn sealed_values_open_only_for_their_record_and_key() {
        let k = Keyring::ephemeral();
        let sealed = k.seal("sec_a", b"hunter2");
        assert!(!sealed.windows(7).any(|w| w == b"hunter2"), "not in clear");
        assert_eq!(k.unseal("sec_a", &sealed).unwrap().as_slice(), b"hunter2");
        assert!(k.unseal("sec_b", &sealed).is_none(), "bound to the record");
        assert!(Keyring::ephemeral().unseal("sec_a", &sealed).is_none());
        let mut tampered = sealed.clone();
        *tampered.last_mut().unwrap() ^= 1;
        assert!(k.unseal("sec_a", &tampered).is_none());
        assert_ne!(k.seal("sec_a", b"x"), k.seal("sec_a", b"x"), "fresh nonces");
    }

    #[test]
    fn volume_tokens() {
        let k = Keyring::ephemeral();
        let t = k.volume_token("v1");
        assert!(k.check_volume_token("v1", &t));
        assert!(!k.check_volume_token("v2", &t));
        assert!(!k.check_volume_token("v1", "cvt_AAAA"));
        assert!(!k.check_volume_token("v1", "garbage"));
        assert!(!Keyring::ephemeral().check_volume_token("v1", &t));
    }

    #[test]
    fn key_files() {
        let dir = std::env::temp_dir().join(format!("cubicle-keyring-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("secrets.key");
        let a = Keyring::load(&path, true).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let b = Keyring::load(&path, true).unwrap();
        assert_eq!(
            a.volume_token("v"),
            b.volume_token("v"),
            "the same key again"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            Keyring::load(&path, false),
            Err(KeyError::Invalid { .. })
        ));
        std::fs::write(dir.join("bad.key"), "xyz").unwrap();
        std::fs::set_permissions(dir.join("bad.key"), std::fs::Permissions::from_mode(0o600))
            .unwrap();
        assert!(matches!(
            Keyring::load(&dir.join("bad.key"), false),
            Err(KeyError::Invalid { .. })
        ));
        assert!(Keyring::load(&dir.join("missing.key"), false).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
