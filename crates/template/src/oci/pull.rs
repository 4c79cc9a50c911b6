//! Pull an image from a registry into the layer store.
//!
//! The manifest and config come first (an image index resolves to linux/amd64); each layer
//! whose diff id is not stored yet is downloaded to a temporary file (its digest checked by
//! `oci-client`), then unpacked on a blocking thread (diff id checked) — all layers at
//! once. Layers already stored (from another image or an earlier pull) are not fetched.
//!
//! Registries: `localhost`/`127.0.0.1` and those listed as insecure are spoken to over
//! plain HTTP, the rest over HTTPS; a mirror can stand in for a registry
//! (`docker.io=localhost:5000`). Credentials are HTTP basic (the registry's token dance
//! is `oci-client`'s).

use std::collections::BTreeMap;
use std::path::PathBuf;

use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};

use super::{Image, ImageConfig};
use crate::TemplateStore;
use crate::error::{Error, Result};

/// How to reach registries.
#[derive(Debug, Clone, Default)]
pub struct RegistryOptions {
    /// Registry host → mirror host used instead (e.g. `docker.io` → `localhost:5000`).
    pub mirrors: BTreeMap<String, String>,
    /// Registries (host[:port]) spoken to over plain HTTP.
    pub insecure: Vec<String>,
}

impl RegistryOptions {
    /// Parse `REGISTRY=MIRROR` pairs; a mirror given as `http://host:port` is insecure.
    pub fn with_mirrors(specs: &[String], insecure: &[String]) -> Result<Self> {
        let mut o = RegistryOptions {
            insecure: insecure.to_vec(),
            ..Default::default()
        };
        for s in specs {
            let (reg, mirror) = s.split_once('=').ok_or_else(|| {
                Error::InvalidRequest(format!(
                    "registry mirror '{s}' must be REGISTRY=MIRROR (e.g. docker.io=localhost:5000)"
                ))
            })?;
            let host = match mirror.strip_prefix("http://") {
                Some(h) => {
                    o.insecure.push(h.trim_end_matches('/').to_string());
                    h
                }
                None => mirror.strip_prefix("https://").unwrap_or(mirror),
            };
            o.mirrors
                .insert(reg.to_string(), host.trim_end_matches('/').to_string());
        }
        Ok(o)
    }

    /// Whether registry `host` (`host[:port]`) is spoken to over plain HTTP: `localhost`
    /// and `127.0.0.1`, and the insecure ones — an entry without a port covers every port
    /// of its host (a cluster's nodes reach a private registry by its address, whichever
    /// port it listens on).
    pub fn plain_http(&self, host: &str) -> bool {
        let bare = host.rsplit_once(':').map_or(host, |(h, _)| h);
        bare == "localhost"
            || bare == "127.0.0.1"
            || self
                .insecure
                .iter()
                .any(|i| i == host || (!i.contains(':') && i == bare))
    }
}

/// Registry credentials (E2B's `fromImageRegistry` of type `registry`).
#[derive(Clone)]
pub struct Credentials {
    /// User name.
    pub username: String,
    /// Password or token.
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({}, ***)", self.username)
    }
}

fn registry_error(reference: &str, e: impl std::fmt::Display) -> Error {
    Error::Registry(format!("pulling {reference}: {e}"))
}

/// Pull `reference` into `store`. `log` receives progress lines.
pub async fn pull(
    store: &TemplateStore,
    reference: &str,
    creds: Option<&Credentials>,
    opts: &RegistryOptions,
    log: &(dyn Fn(String) + Send + Sync),
) -> Result<Image> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut r: Reference = reference.parse().map_err(|e| {
        Error::InvalidRequest(format!("image reference '{reference}' is malformed: {e}"))
    })?;
    if let Some(m) = opts.mirrors.get(r.registry()) {
        r.set_mirror_registry(m.clone());
    }
    let mut plain: Vec<String> = opts.insecure.clone();
    let host = r.resolve_registry().to_string();
    if opts.plain_http(&host) {
        plain.push(host.clone());
    }
    let client = Client::new(ClientConfig {
        protocol: ClientProtocol::HttpsExcept(plain),
        connect_timeout: Some(std::time::Duration::from_secs(10)),
        read_timeout: Some(std::time::Duration::from_secs(300)),
        ..Default::default()
    });
    let auth = match creds {
        Some(c) => RegistryAuth::Basic(c.username.clone(), c.password.clone()),
        None => RegistryAuth::Anonymous,
    };
    log(format!("pulling {reference} from {host}"));
    let (manifest, digest, config) = client
        .pull_manifest_and_config(&r, &auth)
        .await
        .map_err(|e| registry_error(reference, e))?;
    let config = ImageConfig::parse(config.as_bytes())?;
    if config.diff_ids.len() != manifest.layers.len() {
        return Err(Error::BrokenImage(format!(
            "{reference}: the manifest has {} layers, the config {}",
            manifest.layers.len(),
            config.diff_ids.len()
        )));
    }
    let layers = store.layers().clone();
    let mut missing = Vec::new();
    for (desc, diff_id) in manifest.layers.iter().zip(&config.diff_ids) {
        if !layers.contains(diff_id) {
            missing.push((desc.clone(), diff_id.clone()));
        }
    }
    log(format!(
        "{reference} ({digest}): {} layers, {} to fetch",
        config.diff_ids.len(),
        missing.len()
    ));
    let mut tasks = tokio::task::JoinSet::new();
    for (desc, diff_id) in missing {
        let (client, r, layers) = (client.clone(), r.clone(), layers.clone());
        let source = format!("image {reference} layer {}", desc.digest);
        tasks.spawn(async move {
            let tmp: PathBuf = layers
                .root()
                .join(format!(".tmp-{}-blob", crate::unique_suffix()));
            let result = async {
                let f = tokio::fs::File::create(&tmp)
                    .await
                    .map_err(|e| Error::io("create", &tmp, e))?;
                client
                    .pull_blob(&r, &desc, f)
                    .await
                    .map_err(|e| registry_error(&source, e))?;
                let (t2, s2, d2) = (tmp.clone(), source.clone(), diff_id.clone());
                tokio::task::spawn_blocking(move || {
                    let f = std::fs::File::open(&t2).map_err(|e| Error::io("open", &t2, e))?;
                    super::store_layer_blob(&layers, f, &d2, &s2)
                })
                .await
                .map_err(|e| Error::BrokenImage(format!("unpack task: {e}")))?
            }
            .await;
            let _ = tokio::fs::remove_file(&tmp).await;
            result.map(|info| (desc.size, info))
        });
    }
    while let Some(done) = tasks.join_next().await {
        let (size, info) = done.map_err(|e| Error::BrokenImage(format!("pull task: {e}")))??;
        log(format!(
            "layer sha256:{} ({} compressed, {} unpacked)",
            &info.id[..12],
            crate::human_size(size.max(0) as u64),
            crate::human_size(info.size_bytes)
        ));
    }
    Ok(Image {
        reference: reference.to_string(),
        layers: config.diff_ids.clone(),
        config,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirror_specs() {
        let o = RegistryOptions::with_mirrors(
            &[
                "docker.io=http://localhost:5000".into(),
                "ghcr.io=mirror.example".into(),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(o.mirrors["docker.io"], "localhost:5000");
        assert_eq!(o.mirrors["ghcr.io"], "mirror.example");
        assert_eq!(o.insecure, vec!["localhost:5000".to_string()]);
        assert!(RegistryOptions::with_mirrors(&["nope".into()], &[]).is_err());
    }

    #[test]
    fn plain_http_registries() {
        let o = RegistryOptions::with_mirrors(&[], &["10.0.0.1".into(), "reg.lan:5000".into()])
            .unwrap();
        assert!(o.plain_http("localhost:5000") && o.plain_http("127.0.0.1:41234"));
        assert!(o.plain_http("10.0.0.1:5000") && o.plain_http("10.0.0.1"));
        assert!(o.plain_http("reg.lan:5000") && !o.plain_http("reg.lan:5001"));
        assert!(!o.plain_http("10.0.0.10:5000") && !o.plain_http("docker.io"));
        assert!(!o.plain_http("localhost.example.com"));
    }
}
