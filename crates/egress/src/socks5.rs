//! A SOCKS5 client (RFC 1928, username/password auth per RFC 1929), optionally inside
//! TLS (rustls: TLS 1.2 or newer, the certificate always verified, against the system
//! trust store or the user's CA certificates): how a sandbox's connections reach the
//! user's egress proxy. The proxy's address must resolve to an address the node lets
//! sandboxes reach; every failure fails the connection (no fallback to going direct).

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::policy::EgressProxy;
use crate::proxy::Upstream;
use crate::{EgressError, Shared, resolver};

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The system trust store (Debian's bundle).
const SYSTEM_ROOTS: &str = "/etc/ssl/certs/ca-certificates.crt";

fn err(msg: impl Into<String>) -> EgressError {
    EgressError::Socks(msg.into())
}

/// Opens a tunnel to `dst` through `proxy`.
pub(crate) async fn connect(
    shared: &Shared,
    proxy: &EgressProxy,
    dst: SocketAddrV4,
) -> Result<Box<dyn Upstream>, EgressError> {
    let work = async {
        let (host, port) = proxy.host_port()?;
        let addrs = match host.parse::<Ipv4Addr>() {
            Ok(ip) => vec![ip],
            Err(_) => resolver::lookup_a(&shared.config.upstream_dns, &host)
                .await
                .map_err(|e| err(format!("resolving {host}: {e}")))?,
        };
        let ip = addrs
            .into_iter()
            .find(|ip| shared.config.guard.check(*ip, Some(port)).is_ok())
            .ok_or_else(|| {
                err(format!(
                    "{host} resolves to no address sandboxes may reach (private, host or reserved)"
                ))
            })?;
        let tcp = TcpStream::connect((ip, port))
            .await
            .map_err(|e| err(format!("connecting to {host}:{port} ({ip}): {e}")))?;
        let _ = tcp.set_nodelay(true);
        match &proxy.tls {
            None => Ok(Box::new(handshake(tcp, proxy, dst).await?) as Box<dyn Upstream>),
            Some(tls) => {
                let name = tls.server_name.clone().unwrap_or(host.clone());
                let config = client_config(tls.ca_cert.as_deref())?;
                let server_name = ServerName::try_from(name.clone())
                    .map_err(|_| err(format!("'{name}' is not a valid TLS server name")))?;
                let stream = tokio_rustls::TlsConnector::from(config)
                    .connect(server_name, tcp)
                    .await
                    .map_err(|e| err(format!("TLS to {host}:{port}: {e}")))?;
                Ok(Box::new(handshake(stream, proxy, dst).await?) as Box<dyn Upstream>)
            }
        }
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, work)
        .await
        .map_err(|_| err(format!("{} did not answer within 10 s", proxy.address)))?
}

pub(crate) fn system_roots() -> Arc<rustls::RootCertStore> {
    static ROOTS: OnceLock<Arc<rustls::RootCertStore>> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let mut store = rustls::RootCertStore::empty();
            if let Ok(iter) = CertificateDer::pem_file_iter(SYSTEM_ROOTS) {
                for cert in iter.flatten() {
                    let _ = store.add(cert);
                }
            }
            Arc::new(store)
        })
        .clone()
}

fn client_config(ca_pem: Option<&str>) -> Result<Arc<rustls::ClientConfig>, EgressError> {
    let roots = match ca_pem {
        None => system_roots(),
        Some(pem) => {
            let mut store = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                let cert = cert.map_err(|e| err(format!("tls.caCert: {e}")))?;
                store
                    .add(cert)
                    .map_err(|e| err(format!("tls.caCert: {e}")))?;
            }
            if store.is_empty() {
                return Err(err("tls.caCert holds no PEM certificate"));
            }
            Arc::new(store)
        }
    };
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| err(format!("TLS setup: {e}")))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::new(config))
}

/// Checks that `pem` holds at least one certificate (for the API's validation).
pub fn check_ca_pem(pem: &str) -> Result<(), EgressError> {
    client_config(Some(pem)).map(drop)
}

/// The SOCKS5 greeting, authentication and CONNECT to `dst` over `s`.
async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    proxy: &EgressProxy,
    dst: SocketAddrV4,
) -> Result<S, EgressError> {
    let io = |e: std::io::Error| err(format!("{}: {e}", proxy.address));
    let with_auth = proxy.username.is_some();
    let greeting: &[u8] = if with_auth { &[5, 1, 2] } else { &[5, 1, 0] };
    s.write_all(greeting).await.map_err(io)?;
    let mut choice = [0u8; 2];
    s.read_exact(&mut choice).await.map_err(io)?;
    match choice {
        [5, 0] if !with_auth => {}
        [5, 2] if with_auth => {
            let user = proxy.username.as_deref().unwrap_or_default().as_bytes();
            let pass = proxy.password.as_deref().unwrap_or_default().as_bytes();
            let mut m = vec![1, user.len() as u8];
            m.extend_from_slice(user);
            m.push(pass.len() as u8);
            m.extend_from_slice(pass);
            s.write_all(&m).await.map_err(io)?;
            let mut status = [0u8; 2];
            s.read_exact(&mut status).await.map_err(io)?;
            if status[1] != 0 {
                return Err(err(format!(
                    "{} refused the username and password",
                    proxy.address
                )));
            }
        }
        [5, 0xff] => {
            return Err(err(format!(
                "{} accepts none of our authentication methods",
                proxy.address
            )));
        }
        other => {
            return Err(err(format!(
                "{} does not speak SOCKS5 (answered {other:?})",
                proxy.address
            )));
        }
    }
    let mut req = vec![5, 1, 0, 1];
    req.extend_from_slice(&dst.ip().octets());
    req.extend_from_slice(&dst.port().to_be_bytes());
    s.write_all(&req).await.map_err(io)?;
    let mut head = [0u8; 4];
    s.read_exact(&mut head).await.map_err(io)?;
    if head[0] != 5 {
        return Err(err(format!("{} does not speak SOCKS5", proxy.address)));
    }
    if head[1] != 0 {
        return Err(err(format!(
            "{} refused the connection to {dst} (SOCKS5 reply {})",
            proxy.address, head[1]
        )));
    }
    let rest = match head[3] {
        1 => 4 + 2,
        4 => 16 + 2,
        3 => {
            let mut l = [0u8; 1];
            s.read_exact(&mut l).await.map_err(io)?;
            l[0] as usize + 2
        }
        _ => return Err(err(format!("{} sent a malformed reply", proxy.address))),
    };
    let mut bound = vec![0u8; rest];
    s.read_exact(&mut bound).await.map_err(io)?;
    Ok(s)
}
