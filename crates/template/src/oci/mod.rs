//! OCI images: pulled from a registry ([`pull`], through the `oci-client` crate: the
//! distribution protocol, token auth, anonymous or with credentials, mirrors) or imported
//! from a local OCI layout or `docker save` archive ([`import`]). Either way an image
//! becomes its layers in the layer store (one directory per diff id, shared by every
//! image and template that has it) plus the parts of its config a template keeps.

pub mod import;
pub mod pull;

use std::collections::BTreeMap;

use serde_json::Value;

use crate::error::{Error, Result};

/// The parts of an image's config a template uses.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ImageConfig {
    /// `Env` (`K=V`), in order.
    pub env: BTreeMap<String, String>,
    /// `WorkingDir`.
    pub workdir: Option<String>,
    /// `User`.
    pub user: Option<String>,
    /// `Entrypoint` + `Cmd`, as one shell command line (empty if neither).
    pub command: Option<String>,
    /// `rootfs.diff_ids`, bottom first, as 64 hex digits.
    pub diff_ids: Vec<String>,
}

/// An image in the layer store.
#[derive(Debug, Clone)]
pub struct Image {
    /// What it was asked as (`localhost:5000/app:1`, `oci:/path`).
    pub reference: String,
    /// Its layer ids (diff ids), bottom first — all stored.
    pub layers: Vec<String>,
    /// Its config.
    pub config: ImageConfig,
}

/// Quote `s` for a POSIX shell when it needs it.
fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,@%+".contains(&b))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Strip `sha256:` and check 64 hex digits.
pub(crate) fn hex_digest(d: &str) -> Result<String> {
    let h = d.strip_prefix("sha256:").unwrap_or(d);
    if crate::layer::valid_id(h) {
        Ok(h.to_string())
    } else {
        Err(Error::BrokenImage(format!(
            "unsupported digest '{d}' (only sha256 is supported)"
        )))
    }
}

impl ImageConfig {
    /// Parse an image config (OCI or Docker; both use the same keys).
    pub fn parse(json: &[u8]) -> Result<Self> {
        let v: Value = serde_json::from_slice(json)
            .map_err(|e| Error::BrokenImage(format!("image config is not JSON: {e}")))?;
        let c = v.get("config").or_else(|| v.get("container_config"));
        let strs = |key: &str| -> Vec<String> {
            c.and_then(|c| c.get(key))
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .map(String::from)
                        .collect()
                })
                .unwrap_or_default()
        };
        let mut env = BTreeMap::new();
        for kv in strs("Env") {
            if let Some((k, val)) = kv.split_once('=') {
                env.insert(k.to_string(), val.to_string());
            }
        }
        let words: Vec<String> = strs("Entrypoint").into_iter().chain(strs("Cmd")).collect();
        let command = (!words.is_empty()).then(|| {
            words
                .iter()
                .map(|w| shell_quote(w))
                .collect::<Vec<_>>()
                .join(" ")
        });
        let get = |key: &str| {
            c.and_then(|c| c.get(key))
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(String::from)
        };
        let diff_ids = v
            .pointer("/rootfs/diff_ids")
            .and_then(Value::as_array)
            .ok_or_else(|| Error::BrokenImage("image config has no rootfs.diff_ids".into()))?
            .iter()
            .map(|d| hex_digest(d.as_str().unwrap_or("")))
            .collect::<Result<Vec<_>>>()?;
        if diff_ids.is_empty() {
            return Err(Error::BrokenImage("image has no layers".into()));
        }
        Ok(ImageConfig {
            env,
            workdir: get("WorkingDir"),
            user: get("User"),
            command,
            diff_ids,
        })
    }
}

/// Unpack a compressed layer blob into the layer store as `expected` (a diff id), unless
/// it is stored already. Checks the diff id. Blocking.
pub(crate) fn store_layer_blob(
    store: &crate::LayerStore,
    blob: impl std::io::Read,
    expected: &str,
    source: &str,
) -> Result<crate::LayerInfo> {
    if let Some(info) = store.info(expected).filter(|_| store.contains(expected)) {
        return Ok(info);
    }
    let staging = store.staging()?;
    let u = crate::unpack::unpack_blob(blob, staging.path())?;
    if u.diff_id != expected {
        return Err(Error::BrokenImage(format!(
            "layer diff id mismatch: the config says sha256:{expected}, the layer is sha256:{}",
            u.diff_id
        )));
    }
    store.store(staging, expected, source)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_config() {
        let j = br#"{"config":{"Env":["PATH=/usr/local/bin:/usr/bin","LANG=C.UTF-8"],
            "WorkingDir":"/app","User":"1000","Entrypoint":["/bin/sh","-c"],
            "Cmd":["echo 'hi there'"]},
            "rootfs":{"type":"layers","diff_ids":["sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"]}}"#;
        let c = ImageConfig::parse(j).unwrap();
        assert_eq!(c.env["PATH"], "/usr/local/bin:/usr/bin");
        assert_eq!(c.workdir.as_deref(), Some("/app"));
        assert_eq!(
            c.command.as_deref(),
            Some("/bin/sh -c 'echo '\\''hi there'\\'''")
        );
        assert_eq!(c.diff_ids.len(), 1);
        assert!(ImageConfig::parse(b"{}").is_err());
        assert!(ImageConfig::parse(b"nope").is_err());
        let md5 = br#"{"rootfs":{"diff_ids":["md5:abc"]}}"#;
        assert!(ImageConfig::parse(md5).is_err());
    }
}
