//! TLS interception for connections to domains with header rules: the node's own CA,
//! the leaf certificates it mints per server name, and both TLS ends of an intercepted
//! connection.
//!
//! The CA (ECDSA P-256, `rcgen`) is made on the node's first start: its key in
//! `<dir>/egress-ca.key` (mode 0600, root only), its certificate in `<dir>/egress-ca.pem`,
//! which every sandbox trusts (the node adds it to the sandbox's CA bundle). The CA's
//! subject and key identifier are rebuilt from the key on later starts, so leaves chain
//! to the certificate on disk. Leaves (one per server name, cached) are signed with it.
//!
//! Toward the sandbox the proxy is the TLS server (ALPN `http/1.1` only: the proxy
//! rewrites HTTP/1 request heads); toward the destination it is a TLS client that
//! verifies the real server against the system's roots (plus the operator's extra CA
//! file, if configured). Only connections to a name with a header rule are intercepted;
//! everything else is relayed as bytes, never decrypted.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};

use crate::EgressError;

/// File names in the CA directory.
pub const CA_KEY_FILE: &str = "egress-ca.key";
pub const CA_CERT_FILE: &str = "egress-ca.pem";
/// Leaves cached before the cache starts over.
const MAX_LEAVES: usize = 4096;

fn err(what: &str, e: impl std::fmt::Display) -> EgressError {
    EgressError::Policy(format!("egress CA: {what}: {e}"))
}

/// The node's interception CA and its caches.
pub(crate) struct Interceptor {
    ca_pem: String,
    ca_der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
    leaves: Mutex<HashMap<String, Arc<rustls::ServerConfig>>>,
    upstream_ca: Option<PathBuf>,
    /// The upstream client config and the extra CA file's mtime it was built with.
    upstream: Mutex<Option<(Option<SystemTime>, Arc<rustls::ClientConfig>)>>,
}

fn ca_params() -> CertificateParams {
    let mut p = CertificateParams::default();
    p.distinguished_name
        .push(DnType::CommonName, "Cubicle egress CA");
    p.distinguished_name
        .push(DnType::OrganizationName, "Cubicle node");
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl Interceptor {
    /// Loads the CA from `dir`, making it first if it does not exist.
    pub(crate) fn load_or_create(
        dir: &Path,
        upstream_ca: Option<PathBuf>,
    ) -> Result<Interceptor, EgressError> {
        let key_path = dir.join(CA_KEY_FILE);
        let cert_path = dir.join(CA_CERT_FILE);
        let (key, ca_pem) = match std::fs::read_to_string(&key_path) {
            Ok(pem) => {
                let key = KeyPair::from_pem(&pem).map_err(|e| err("reading the key", e))?;
                let cert = match std::fs::read_to_string(&cert_path) {
                    Ok(c) => c,
                    Err(_) => {
                        // The certificate can be made again from the key.
                        let c = ca_params()
                            .self_signed(&key)
                            .map_err(|e| err("signing", e))?
                            .pem();
                        std::fs::write(&cert_path, &c)
                            .map_err(|e| err(&cert_path.display().to_string(), e))?;
                        c
                    }
                };
                (key, cert)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir_all(dir).map_err(|e| err(&dir.display().to_string(), e))?;
                let key = KeyPair::generate().map_err(|e| err("making a key", e))?;
                let cert = ca_params()
                    .self_signed(&key)
                    .map_err(|e| err("signing", e))?
                    .pem();
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&key_path)
                    .map_err(|e| err(&key_path.display().to_string(), e))?;
                f.write_all(key.serialize_pem().as_bytes())
                    .and_then(|_| f.sync_all())
                    .map_err(|e| err(&key_path.display().to_string(), e))?;
                std::fs::write(&cert_path, &cert)
                    .map_err(|e| err(&cert_path.display().to_string(), e))?;
                tracing::info!(
                    "egress: made the node's interception CA in {}",
                    dir.display()
                );
                (key, cert)
            }
            Err(e) => return Err(err(&key_path.display().to_string(), e)),
        };
        let ca_der = CertificateDer::pem_slice_iter(ca_pem.as_bytes())
            .next()
            .ok_or_else(|| err(&cert_path.display().to_string(), "no certificate"))?
            .map_err(|e| err(&cert_path.display().to_string(), e))?;
        Ok(Interceptor {
            ca_pem,
            ca_der,
            issuer: Issuer::new(ca_params(), key),
            leaves: Mutex::new(HashMap::new()),
            upstream_ca,
            upstream: Mutex::new(None),
        })
    }

    /// The CA certificate (PEM) sandboxes trust.
    pub(crate) fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The TLS server config presenting a leaf for `name` (minted on first use).
    pub(crate) fn server_config(
        &self,
        name: &str,
    ) -> Result<Arc<rustls::ServerConfig>, EgressError> {
        let mut leaves = self.leaves.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = leaves.get(name) {
            return Ok(c.clone());
        }
        let key = KeyPair::generate().map_err(|e| err("making a leaf key", e))?;
        let mut params =
            CertificateParams::new(vec![name.to_string()]).map_err(|e| err("leaf name", e))?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::NoCa;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
        let leaf = params
            .signed_by(&key, &self.issuer)
            .map_err(|e| err("signing a leaf", e))?;
        let chain = vec![leaf.der().clone(), self.ca_der.clone()];
        let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| err("TLS setup", e))?
            .with_no_client_auth()
            .with_single_cert(chain, key_der)
            .map_err(|e| err("TLS setup", e))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let config = Arc::new(config);
        if leaves.len() >= MAX_LEAVES {
            leaves.clear();
        }
        leaves.insert(name.to_string(), config.clone());
        Ok(config)
    }

    /// The TLS client config toward destinations: the system's roots plus the extra CA
    /// file (re-read when it changes), ALPN `http/1.1`.
    pub(crate) fn client_config(&self) -> Result<Arc<rustls::ClientConfig>, EgressError> {
        let mtime = self
            .upstream_ca
            .as_ref()
            .and_then(|p| std::fs::metadata(p).ok())
            .and_then(|m| m.modified().ok());
        let mut cached = self.upstream.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((t, c)) = cached.as_ref()
            && *t == mtime
        {
            return Ok(c.clone());
        }
        let mut roots = (*crate::socks5::system_roots()).clone();
        if let Some(p) = &self.upstream_ca
            && let Ok(pem) = std::fs::read(p)
        {
            for c in CertificateDer::pem_slice_iter(&pem).flatten() {
                let _ = roots.add(c);
            }
        }
        let mut config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| err("TLS setup", e))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let config = Arc::new(config);
        *cached = Some((mtime, config.clone()));
        Ok(config)
    }

    /// Opens TLS to the destination over `upstream`, verifying it as `name`.
    pub(crate) async fn connect<S>(
        &self,
        upstream: S,
        name: &str,
    ) -> Result<tokio_rustls::client::TlsStream<S>, EgressError>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let server_name = ServerName::try_from(name.to_string())
            .map_err(|_| err("server name", format!("'{name}' is not valid")))?;
        tokio_rustls::TlsConnector::from(self.client_config()?)
            .connect(server_name, upstream)
            .await
            .map_err(|e| EgressError::io(format!("TLS to {name}"), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_ca_is_made_once_and_leaves_chain_to_it() {
        let dir = std::env::temp_dir().join(format!("cubicle-egress-ca-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let a = Interceptor::load_or_create(&dir, None).unwrap();
        let mode = std::fs::metadata(dir.join(CA_KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let b = Interceptor::load_or_create(&dir, None).unwrap();
        assert_eq!(a.ca_pem(), b.ca_pem(), "the second start reuses the CA");
        // A leaf minted by the second start verifies against the first's certificate.
        let _ = b.server_config("api.example.test").unwrap();
        let leaf = {
            let leaves = b.leaves.lock().unwrap();
            assert_eq!(leaves.len(), 1);
            drop(leaves);
            let key = KeyPair::generate().unwrap();
            let mut p = CertificateParams::new(vec!["api.example.test".to_string()]).unwrap();
            p.use_authority_key_identifier_extension = true;
            p.signed_by(&key, &b.issuer).unwrap().der().clone()
        };
        let mut roots = rustls::RootCertStore::empty();
        roots.add(a.ca_der.clone()).unwrap();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            provider(),
        )
        .build()
        .unwrap();
        use rustls::client::danger::ServerCertVerifier;
        verifier
            .verify_server_cert(
                &leaf,
                &[],
                &ServerName::try_from("api.example.test").unwrap(),
                &[],
                rustls_pki_types::UnixTime::now(),
            )
            .unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
