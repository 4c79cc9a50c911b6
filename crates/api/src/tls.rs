//! TLS set-up, in one place, on rustls with the `ring` provider (pure Rust and assembly:
//! no OpenSSL, no cmake): the server side of `cubicle serve --tls-cert/--tls-key` and
//! the client side of webhook deliveries and of the `cubicle` command line.
//!
//! Clients trust the system's certificate store (`/etc/ssl/certs`; `SSL_CERT_FILE` and
//! `SSL_CERT_DIR` override it, as with OpenSSL) plus any extra PEM bundle given.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// What can go wrong setting up TLS.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A certificate or key file could not be read or parsed.
    #[error("{what} {}: {detail}", path.display())]
    File {
        /// Which file it was meant to be.
        what: &'static str,
        /// The file.
        path: std::path::PathBuf,
        /// What went wrong.
        detail: String,
    },
    /// rustls refused the configuration (e.g. the key does not match the certificate).
    #[error("TLS configuration: {0}")]
    Config(String),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads every certificate of a PEM file.
pub fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bad = |detail: String| TlsError::File {
        what: "certificate file",
        path: path.to_path_buf(),
        detail,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no PEM certificate in it".into()));
    }
    Ok(certs)
}

/// The server configuration for a certificate chain and its private key (PEM files;
/// the key in PKCS#8, PKCS#1 or SEC1 form). HTTP/1.1 only, as the listener.
pub fn server_config(cert: &Path, key: &Path) -> Result<rustls::ServerConfig, TlsError> {
    let certs = read_certs(cert)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::File {
        what: "private key file",
        path: key.to_path_buf(),
        detail: e.to_string(),
    })?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| TlsError::Config(format!("certificate and key do not fit: {e}")))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// The client configuration: the system's roots plus the certificates in `extra_ca`.
/// A host without a certificate store still gets a configuration (https then fails
/// with "unknown issuer", plain http works).
pub fn client_config(extra_ca: Option<&Path>) -> Result<rustls::ClientConfig, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for e in &native.errors {
        tracing::debug!("system certificate store: {e}");
    }
    let (added, _ignored) = roots.add_parsable_certificates(native.certs);
    if let Some(path) = extra_ca {
        for c in read_certs(path)? {
            roots.add(c).map_err(|e| TlsError::File {
                what: "CA certificate",
                path: path.to_path_buf(),
                detail: e.to_string(),
            })?;
        }
    } else if added == 0 {
        tracing::warn!(
            "no trusted CA certificates found on this host: https connections will fail"
        );
    }
    // No ALPN here: connectors that speak HTTP set it themselves (hyper-rustls insists).
    Ok(rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}
