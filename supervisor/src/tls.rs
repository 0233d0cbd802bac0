//! TLS where the control plane leaves the host: the gRPC port's server side ([`server`]), the PEM
//! files every side reads ([`pem`]), the etcd client's ([`etcd`]), and test certificates for a demo
//! fleet ([`init`]).
//!
//! One crypto provider for every side: rustls with *ring* ([`provider`]), the one tonic's and
//! etcd-client's TLS are built with too.

use std::sync::Arc;

pub mod etcd;
pub mod init;
pub mod pem;
pub mod server;

/// The crypto provider of every TLS configuration the supervisor builds.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads every TLS file the supervisor itself uses (`[supervisor.tls]`, `[cluster.tls]`) as it
/// would at start, for `peregrine check`: each problem names its config key and file.
pub fn check_files(config: &crate::config::Config) -> Vec<String> {
    let mut problems = Vec::new();
    if let Some(tls) = &config.supervisor.tls
        && let Err(error) = server::check(tls)
    {
        problems.push(error.to_string());
    }
    if let Some(tls) = config.cluster.as_ref().and_then(|c| c.tls.as_ref())
        && let Err(error) = etcd::options(tls)
    {
        problems.push(error.to_string());
    }
    problems
}
