//! TLS between the roles of a cluster (docs/cluster.md, "Deploying"): the options of
//! `cubicle node`'s listener ([`NodeListenTls`]: `--tls-cert/--tls-key`, and
//! `--tls-client-ca` for mutual TLS) and of a replica's connections to its nodes
//! ([`NodeClientTls`]: `--node-ca`, `--node-server-name`, `--node-client-cert/-key`).
//! The node token stays required either way: TLS protects it on the wire and proves the
//! node to the replica (and, with client certificates, the replica to the node); the
//! token remains the authorisation. Without these options both sides speak plain HTTP
//! (a private network).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;

/// TLS of the node-side API (`cubicle node`).
#[derive(clap::Args, Debug, Default)]
pub struct NodeListenTls {
    /// Serve the node-side API over TLS with this certificate chain (PEM; it must name
    /// the address replicas use, or the name they give as --node-server-name). Needs
    /// --tls-key. Replicas then name this node `https://HOST:PORT`.
    #[arg(
        long,
        env = "CUBICLE_TLS_CERT",
        value_name = "PEM",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM). Needs --tls-cert.
    #[arg(
        long,
        env = "CUBICLE_TLS_KEY",
        value_name = "PEM",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS: accept only clients (replicas) presenting a certificate that chains to
    /// a CA of this PEM file. Needs --tls-cert.
    #[arg(
        long,
        env = "CUBICLE_TLS_CLIENT_CA",
        value_name = "PEM",
        requires = "tls_cert"
    )]
    pub tls_client_ca: Option<PathBuf>,
}

impl NodeListenTls {
    /// The acceptor, when TLS is asked for.
    pub fn acceptor(&self) -> anyhow::Result<Option<tokio_rustls::TlsAcceptor>> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            return Ok(None);
        };
        let cfg = cubicle_api::tls::server_config_with_client_ca(
            cert,
            key,
            self.tls_client_ca.as_deref(),
        )?;
        Ok(Some(tokio_rustls::TlsAcceptor::from(Arc::new(cfg))))
    }
}

/// TLS of an API replica's connections to its nodes (`cubicle serve --node https://…`).
#[derive(clap::Args, Debug, Default)]
pub struct NodeClientTls {
    /// The cluster's CA (PEM): `https://` nodes must present a certificate that chains
    /// to it (only to it: the system's CAs are then not trusted for nodes). Without it,
    /// `https://` nodes are checked against the system's CAs.
    #[arg(long, env = "CUBICLE_NODE_CA", value_name = "PEM")]
    pub node_ca: Option<PathBuf>,
    /// Check every node's certificate against this name instead of the host of its
    /// address (one certificate shared by the nodes, e.g. `cubicle-node`, while they are
    /// reached by IP address).
    #[arg(long, env = "CUBICLE_NODE_SERVER_NAME", value_name = "NAME")]
    pub node_server_name: Option<String>,
    /// Client certificate (PEM) presented to nodes that require one (`cubicle node
    /// --tls-client-ca`). Needs --node-client-key.
    #[arg(
        long,
        env = "CUBICLE_NODE_CLIENT_CERT",
        value_name = "PEM",
        requires = "node_client_key"
    )]
    pub node_client_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM). Needs --node-client-cert.
    #[arg(
        long,
        env = "CUBICLE_NODE_CLIENT_KEY",
        value_name = "PEM",
        requires = "node_client_cert"
    )]
    pub node_client_key: Option<PathBuf>,
}

impl NodeClientTls {
    /// The TLS set-up for `nodes`: `Some` when they are `https://` (all of them), `None`
    /// for `http://` ones, where the TLS options are refused as a likely mistake. With
    /// no addresses yet (nodes found later, e.g. in the database), `Some` exactly when
    /// a TLS option is given.
    pub fn config(&self, nodes: &[String]) -> anyhow::Result<Option<cubicle_router::NodeTls>> {
        let given = self.node_ca.is_some()
            || self.node_server_name.is_some()
            || self.node_client_cert.is_some();
        let https =
            nodes.iter().any(|n| n.trim().starts_with("https://")) || (nodes.is_empty() && given);
        if !https {
            if given {
                anyhow::bail!(
                    "--node-ca, --node-server-name and --node-client-cert apply to https:// node addresses; give the nodes as https://HOST:PORT (they serve TLS with `cubicle node --tls-cert/--tls-key`)"
                );
            }
            return Ok(None);
        }
        let client = match (&self.node_client_cert, &self.node_client_key) {
            (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
            _ => None,
        };
        let config = cubicle_api::tls::node_client_config(self.node_ca.as_deref(), client)?;
        let server_name = self
            .node_server_name
            .as_deref()
            .map(|n| {
                rustls::pki_types::ServerName::try_from(n.to_string()).with_context(|| {
                    format!("--node-server-name '{n}' is not a DNS name or IP address")
                })
            })
            .transpose()?;
        Ok(Some(cubicle_router::NodeTls {
            config: Arc::new(config),
            server_name,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_options_go_with_https_nodes() {
        let http = ["http://10.0.0.1:3100".to_string()];
        let https = ["https://10.0.0.1:3100".to_string()];
        let plain = NodeClientTls::default();
        assert!(plain.config(&http).unwrap().is_none());
        assert!(plain.config(&[]).unwrap().is_none());
        // https:// without options: the system's CAs.
        assert!(plain.config(&https).unwrap().is_some());
        let with_ca = NodeClientTls {
            node_ca: Some("/nonexistent/cluster-ca.pem".into()),
            ..Default::default()
        };
        let e = with_ca.config(&http).unwrap_err().to_string();
        assert!(e.contains("https://HOST:PORT"), "{e}");
        let e = format!("{:#}", with_ca.config(&https).unwrap_err());
        assert!(e.contains("/nonexistent/cluster-ca.pem"), "{e}");
        let bad_name = NodeClientTls {
            node_server_name: Some("not a name".into()),
            ..Default::default()
        };
        let e = format!("{:#}", bad_name.config(&https).unwrap_err());
        assert!(e.contains("--node-server-name"), "{e}");
    }
}
