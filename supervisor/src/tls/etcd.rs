//! The etcd client's TLS (`[cluster.tls]`): the CA that signs etcd's certificates and the client
//! certificate etcd checks with `--client-cert-auth`.
//!
//! The files are read for every session (every connection to a member), so certificates rotated on
//! disk are used from the next session on, without a restart.
//!
//! Invariant: the files are checked here (a pair whose keys match, valid now) before tonic sees
//! them, so a mistake is reported with its config key instead of as a handshake failure.

use peregrine_etcd::{Certificate, ClientTlsConfig, Identity};

use super::pem::{self, PemError};
use crate::config::EtcdTlsConfig;

/// What is wrong with a `[cluster.tls]` file.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {source}")]
pub struct EtcdTlsError {
    /// The config key of the file.
    pub key: &'static str,
    /// What is wrong with it.
    #[source]
    pub source: PemError,
}

/// The TLS options of an etcd connection, read from `tls`'s files now.
pub fn options(tls: &EtcdTlsConfig) -> Result<ClientTlsConfig, EtcdTlsError> {
    let ca = pem::roots(&tls.ca).map_err(|source| EtcdTlsError {
        key: "cluster.tls.ca",
        source,
    })?;
    let mut options = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca.pem));
    if let Some(identity) = &tls.identity {
        let pair = pem::certified_key(&identity.cert, &identity.key, &super::provider()).map_err(
            |source| EtcdTlsError {
                key: if source.is_the_keys(&identity.key) {
                    "cluster.tls.key"
                } else {
                    "cluster.tls.cert"
                },
                source,
            },
        )?;
        options = options.identity(Identity::from_pem(pair.cert_pem, pair.key_pem));
    }
    Ok(options)
}
