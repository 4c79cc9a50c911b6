//! TLS to PostgreSQL, chosen by the database URL's libpq-style parameters (rustls with
//! the `ring` provider through `tokio-postgres-rustls`; no OpenSSL):
//!
//! | `sslmode` | What happens |
//! |---|---|
//! | absent, `disable`, `prefer` | plain TCP (as before TLS existed here; `prefer` does not try TLS) |
//! | `require` | TLS or no connection; the server's certificate is not checked, unless `sslrootcert` is given (then as `verify-ca`), as libpq does |
//! | `verify-ca` | TLS; the certificate must chain to `sslrootcert` (else the system's CAs) |
//! | `verify-full` | `verify-ca`, and the certificate must name the host of the URL |
//!
//! `sslrootcert=FILE` is a PEM file of CA certificates (percent-encoded in the URL as any
//! value). Client certificates (`sslcert`/`sslkey`) are not supported: refused with a
//! message. TLS applies to TCP hosts; a Unix-socket host (`?host=/run/postgresql`) with
//! `sslmode=require` fails ("no hostname provided for TLS handshake").
//!
//! tokio-postgres itself knows only `disable|prefer|require` and no `sslrootcert`:
//! [`parse`] takes those parameters out of the URL and gives back what tokio-postgres
//! should see and the TLS connector to use.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};

use crate::{Error, Result};

/// How the connection is secured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SslMode {
    /// Plain TCP (no `sslmode`, `disable`, `prefer`).
    Plain,
    /// TLS without checking the server's certificate.
    Require,
    /// TLS, the certificate chains to the roots.
    VerifyCa,
    /// TLS, the certificate chains to the roots and names the host.
    VerifyFull,
}

/// A database URL with its TLS parameters taken out.
pub(crate) struct Parsed {
    /// What tokio-postgres parses (`sslmode=require` when TLS is wanted).
    pub url: String,
    /// How to secure the connection.
    pub mode: SslMode,
    /// `sslrootcert`.
    pub root_cert: Option<PathBuf>,
}

/// Takes `sslmode` and `sslrootcert` out of a `postgres://` URL. Other forms (key=value
/// strings) pass through to tokio-postgres unchanged.
pub(crate) fn parse(url: &str) -> Result<Parsed> {
    let plain = |url: &str| Parsed {
        url: url.to_string(),
        mode: SslMode::Plain,
        root_cert: None,
    };
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Ok(plain(url));
    }
    let Some((base, query)) = url.split_once('?') else {
        return Ok(plain(url));
    };
    let mut mode = None;
    let mut root_cert = None;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "sslmode" => mode = Some(percent_decode(v)?),
            "sslrootcert" => root_cert = Some(PathBuf::from(percent_decode(v)?)),
            "sslcert" | "sslkey" => {
                return Err(Error::Invalid(format!(
                    "database URL: {k} (client certificates) is not supported; authenticate with a password or trust, over sslmode=verify-full"
                )));
            }
            _ => kept.push(pair),
        }
    }
    let mode = match mode.as_deref() {
        None | Some("disable") | Some("prefer") => SslMode::Plain,
        Some("require") if root_cert.is_some() => SslMode::VerifyCa,
        Some("require") => SslMode::Require,
        Some("verify-ca") => SslMode::VerifyCa,
        Some("verify-full") => SslMode::VerifyFull,
        Some(other) => {
            return Err(Error::Invalid(format!(
                "database URL: sslmode={other} is not one of disable, prefer, require, verify-ca, verify-full"
            )));
        }
    };
    if mode == SslMode::Plain && root_cert.is_some() {
        return Err(Error::Invalid(
            "database URL: sslrootcert needs sslmode=verify-full (or verify-ca, require)".into(),
        ));
    }
    if mode != SslMode::Plain {
        kept.push("sslmode=require");
    } else if let Some(m) = url_mode(query) {
        kept.push(m);
    }
    let url = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok(Parsed {
        url,
        mode,
        root_cert,
    })
}

/// The URL's own `sslmode=disable|prefer` pair, kept for tokio-postgres.
fn url_mode(query: &str) -> Option<&str> {
    query
        .split('&')
        .find(|p| *p == "sslmode=disable" || *p == "sslmode=prefer")
}

fn percent_decode(s: &str) -> Result<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            let Some(byte) = hex else {
                return Err(Error::Invalid(format!(
                    "database URL: bad percent-encoding in '{s}'"
                )));
            };
            out.push(byte);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| Error::Invalid(format!("database URL: '{s}' is not UTF-8")))
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The CA certificates of `path`, or the system's when `None`.
fn roots(path: Option<&Path>) -> Result<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::empty();
    match path {
        Some(p) => {
            let bad = |e: String| {
                Error::Invalid(format!("database URL: sslrootcert {}: {e}", p.display()))
            };
            let certs = CertificateDer::pem_file_iter(p)
                .map_err(|e| bad(e.to_string()))?
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| bad(e.to_string()))?;
            if certs.is_empty() {
                return Err(bad("no PEM certificate in it".into()));
            }
            for c in certs {
                roots.add(c).map_err(|e| bad(e.to_string()))?;
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(native.certs);
            if added == 0 {
                return Err(Error::Invalid(
                    "database URL: sslmode=verify-ca/verify-full without sslrootcert, and this host has no system CA certificates: give sslrootcert=FILE".into(),
                ));
            }
        }
    }
    Ok(roots)
}

/// The connector for `p`'s mode (`None`: plain).
pub(crate) fn connector(p: &Parsed) -> Result<Option<tokio_postgres_rustls::MakeRustlsConnect>> {
    let verifier: Arc<dyn ServerCertVerifier> = match p.mode {
        SslMode::Plain => return Ok(None),
        SslMode::Require => {
            tracing::warn!(
                "database: sslmode=require encrypts but does not check the server's certificate; use sslmode=verify-full&sslrootcert=CA.pem"
            );
            Arc::new(Lenient {
                chain: None,
                provider: provider(),
            })
        }
        SslMode::VerifyCa | SslMode::VerifyFull => {
            let webpki = WebPkiServerVerifier::builder_with_provider(
                Arc::new(roots(p.root_cert.as_deref())?),
                provider(),
            )
            .build()
            .map_err(|e| Error::Invalid(format!("database URL: sslrootcert: {e}")))?;
            if p.mode == SslMode::VerifyFull {
                webpki
            } else {
                Arc::new(Lenient {
                    chain: Some(webpki),
                    provider: provider(),
                })
            }
        }
    };
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Invalid(format!("TLS configuration: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(Some(tokio_postgres_rustls::MakeRustlsConnect::new(config)))
}

/// The verifier of `require` (no chain: any certificate) and `verify-ca` (the chain, not
/// the name). The handshake's signatures are checked either way (the server holds the
/// key of the certificate it shows).
#[derive(Debug)]
struct Lenient {
    chain: Option<Arc<WebPkiServerVerifier>>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_takes_out_the_tls_parameters() {
        let p = parse("postgres://u:pw@db:5432/c?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x").unwrap();
        assert_eq!(p.mode, SslMode::VerifyFull);
        assert_eq!(p.root_cert.as_deref(), Some(Path::new("/etc/ca.pem")));
        assert_eq!(
            p.url,
            "postgres://u:pw@db:5432/c?application_name=x&sslmode=require"
        );
        let p = parse("postgres://u@db/c?sslmode=require").unwrap();
        assert_eq!(p.mode, SslMode::Require);
        let p = parse("postgres://u@db/c?sslmode=require&sslrootcert=/ca.pem").unwrap();
        assert_eq!(p.mode, SslMode::VerifyCa);
        let p = parse("postgres://u@db/c?sslmode=disable").unwrap();
        assert_eq!(
            (p.mode, p.url.as_str()),
            (SslMode::Plain, "postgres://u@db/c?sslmode=disable")
        );
        let p = parse("postgres://u@db/c").unwrap();
        assert_eq!(
            (p.mode, p.url.as_str()),
            (SslMode::Plain, "postgres://u@db/c")
        );
        let p = parse("host=db user=u sslmode=disable").unwrap();
        assert_eq!(p.url, "host=db user=u sslmode=disable");
        for bad in [
            "postgres://u@db/c?sslmode=allow-everything",
            "postgres://u@db/c?sslrootcert=/ca.pem",
            "postgres://u@db/c?sslmode=require&sslcert=/c.pem",
            "postgres://u@db/c?sslmode=verify-full&sslrootcert=%zz",
        ] {
            let e = parse(bad).err().unwrap_or_else(|| panic!("{bad} accepted"));
            assert!(e.to_string().contains("database URL"), "{e}");
        }
    }

    /// A CA, and a server certificate it signed for `names`; PEM (cert, key) pairs.
    fn ca_and_server(ca_name: &str, names: &[&str]) -> (String, (String, String)) {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::default();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, ca_name);
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca, ca_key);
        let key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
        let cert = leaf.signed_by(&key, &issuer).unwrap();
        (ca_cert.pem(), (cert.pem(), key.serialize_pem()))
    }

    /// Whether the connection of `url` is encrypted, as the server sees it.
    fn encrypted(url: &str) -> Result<bool> {
        let pool = crate::postgres::PgPool::connect(url)?;
        let rows = pool.with(|c| {
            c.query(
                "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
                &[],
            )
        })?;
        Ok(rows[0].get::<i64>(0)? == 1)
    }

    /// A private PostgreSQL with ssl=on (scripts/pg-test-cluster.sh --ssl-cert/--ssl-key,
    /// TCP on 127.0.0.1, certificate for `localhost` only): each sslmode against it.
    #[test]
    fn sslmodes_against_a_tls_server() {
        let dir = std::env::temp_dir().join(format!("cubicle-pg-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (ca, (cert, key)) = ca_and_server("cubicle test PostgreSQL CA", &["localhost"]);
        let (other_ca, _) = ca_and_server("another CA", &["localhost"]);
        let file = |name: &str, text: &str| {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            p.display().to_string()
        };
        let (ca, other_ca) = (file("ca.pem", &ca), file("other-ca.pem", &other_ca));
        let (cert, key) = (file("server.pem", &cert), file("server.key", &key));
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../scripts/pg-test-cluster.sh"
        );
        let pid = std::process::id().to_string();
        let out = std::process::Command::new("bash")
            .args([script, "start", "--owner", &pid, "--listen", "127.0.0.1"])
            .args(["--ssl-cert", &cert, "--ssl-key", &key])
            .stderr(std::process::Stdio::inherit())
            .output()
            .unwrap();
        if out.status.code() == Some(3) && std::env::var_os("CUBICLE_REQUIRE_POSTGRES").is_none() {
            eprintln!("PostgreSQL is not installed: SKIPPED");
            return;
        }
        assert!(out.status.success(), "pg-test-cluster.sh: {}", out.status);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let port = stdout
            .lines()
            .find_map(|l| l.strip_prefix("port="))
            .unwrap()
            .to_string();
        let url = |host: &str, pw: &str, q: &str| {
            format!("postgres://postgres{pw}@{host}:{port}/postgres?{q}")
        };

        // Plain, as before: no sslmode (and disable) do not encrypt.
        assert!(!encrypted(&url("127.0.0.1", "", "")).unwrap());
        assert!(!encrypted(&url("127.0.0.1", "", "sslmode=disable")).unwrap());
        // require: encrypted, the certificate is not checked (libpq's meaning).
        assert!(encrypted(&url("127.0.0.1", "", "sslmode=require")).unwrap());
        // verify-full: the chain and the name.
        let full = format!("sslmode=verify-full&sslrootcert={ca}");
        assert!(encrypted(&url("localhost", "", &full)).unwrap());
        // verify-full refuses another CA, and an address the certificate does not name;
        // verify-ca accepts the latter; the password never shows in the error.
        let wrong = format!("sslmode=verify-full&sslrootcert={other_ca}");
        let e = encrypted(&url("localhost", ":sekrit-pw", &wrong))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("UnknownIssuer") || e.contains("unknown issuer"),
            "{e}"
        );
        assert!(!e.contains("sekrit-pw"), "{e}");
        let e = encrypted(&url("127.0.0.1", "", &full))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("NotValidForName") || e.contains("not valid for name"),
            "{e}"
        );
        let ca_only = format!("sslmode=verify-ca&sslrootcert={ca}");
        assert!(encrypted(&url("127.0.0.1", "", &ca_only)).unwrap());
        let e = encrypted(&url(
            "127.0.0.1",
            "",
            &format!("sslmode=verify-ca&sslrootcert={other_ca}"),
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("UnknownIssuer") || e.contains("unknown issuer"),
            "{e}"
        );
        // The whole store over verify-full (schema migrated, a record written and read).
        let store = crate::Store::open_url(&url("localhost", "", &full)).unwrap();
        assert!(store.nodes(crate::now_ms()).unwrap().is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
