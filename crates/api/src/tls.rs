//! TLS set-up, in one place, on rustls with the `ring` provider (pure Rust and assembly:
//! no OpenSSL, no cmake): the server side of `cubicle serve --tls-cert/--tls-key` and of
//! `cubicle node --tls-cert/--tls-key` (optionally requiring client certificates:
//! mutual TLS between replicas and nodes), and the client side of webhook deliveries, of
//! the `cubicle` command line and of a replica's calls to its nodes (`--node-ca`).
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
    server_config_with_client_ca(cert, key, None)
}

/// [`server_config`], and with `client_ca` every client must present a certificate that
/// chains to a certificate of that PEM file (mutual TLS; others fail the handshake).
pub fn server_config_with_client_ca(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<rustls::ServerConfig, TlsError> {
    let certs = read_certs(cert)?;
    let key = read_key(key)?;
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let roots = roots_of(path)?;
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider(),
            )
            .build()
            .map_err(|e| TlsError::Config(format!("client CA {}: {e}", path.display())))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut cfg = builder
        .with_single_cert(certs, key)
        .map_err(|e| TlsError::Config(format!("certificate and key do not fit: {e}")))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// The system's trust anchors, and how many there are.
fn system_roots() -> (rustls::RootCertStore, usize) {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for e in &native.errors {
        tracing::debug!("system certificate store: {e}");
    }
    let (added, _ignored) = roots.add_parsable_certificates(native.certs);
    (roots, added)
}

/// The client configuration: the system's roots plus the certificates in `extra_ca`.
/// A host without a certificate store still gets a configuration (https then fails
/// with "unknown issuer", plain http works).
pub fn client_config(extra_ca: Option<&Path>) -> Result<rustls::ClientConfig, TlsError> {
    let (mut roots, added) = system_roots();
    if let Some(path) = extra_ca {
        roots.roots.extend(roots_of(path)?.roots);
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

/// The certificates of a PEM file as trust anchors.
fn roots_of(path: &Path) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in read_certs(path)? {
        roots.add(c).map_err(|e| TlsError::File {
            what: "CA certificate",
            path: path.to_path_buf(),
            detail: e.to_string(),
        })?;
    }
    Ok(roots)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::File {
        what: "private key file",
        path: path.to_path_buf(),
        detail: e.to_string(),
    })
}

/// The client configuration of a replica's calls to `https://` nodes: trusting only the
/// certificates of `ca` when given (the cluster's own CA), else the system's store; with
/// `client` (certificate chain, key; PEM) presented to nodes that require one (mutual
/// TLS).
pub fn node_client_config(
    ca: Option<&Path>,
    client: Option<(&Path, &Path)>,
) -> Result<rustls::ClientConfig, TlsError> {
    let roots = match ca {
        Some(path) => roots_of(path)?,
        None => system_roots().0,
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(roots);
    match client {
        None => Ok(builder.with_no_client_auth()),
        Some((cert, key)) => builder
            .with_client_auth_cert(read_certs(cert)?, read_key(key)?)
            .map_err(|e| TlsError::Config(format!("client certificate and key do not fit: {e}"))),
    }
}
