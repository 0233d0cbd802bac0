//! TLS where the control plane leaves the host: the gRPC port's server side ([`server`]), the PEM
//! files every side reads ([`pem`]), the etcd client's ([`etcd`]), and test certificates for a demo
//! fleet ([`init`]).
//!
//! One crypto provider for every side: rustls with *ring* ([`provider`]), the one tonic's TLS (the
//! etcd client's) is built with too.

use std::sync::Arc;

pub mod etcd;
pub mod init;
pub mod pem;
pub mod server;

/// The crypto provider of every TLS configuration the supervisor builds.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads every TLS file the config names (`[supervisor.tls]`, `[envoy.tls]`, `[cluster.tls]`) as
/// the supervisor and Envoy would at start, for `peregrine check`: first each file alone (one
/// problem per file that cannot be read), then what each table's files hold together (a key that
/// is not its certificate's), each problem at the key and line that name the file.
pub fn check_files(config: &crate::config::Config) -> Vec<crate::config::Problem> {
    use std::collections::BTreeSet;
    let mut problems = Vec::new();
    let mut unread_tables = BTreeSet::new();
    for file in &config.files {
        if let Err(error) = std::fs::File::open(&file.path).and_then(|f| f.metadata()) {
            problems.push(file.problem(format!(
                "cannot read {}: {}",
                file.path.display(),
                peregrine_contract::ErrorChain(&error)
            )));
            unread_tables.insert(file.key.rsplit_once('.').map_or("", |(table, _)| table));
        }
    }
    let at = |key: &str, message: String| match config.files.iter().find(|f| f.key == key) {
        Some(file) => file.problem(message),
        None => crate::config::Problem {
            line: None,
            key: key.to_owned(),
            message,
        },
    };
    if let Some(tls) = &config.supervisor.tls
        && !unread_tables.contains("supervisor.tls")
        && let Err(error) = server::check(tls)
    {
        problems.push(at(error.key, error.source.to_string()));
    }
    if let Some(tls) = &config.envoy.tls
        && !unread_tables.contains("envoy.tls")
    {
        problems.extend(
            envoy_side(tls)
                .err()
                .map(|(key, error)| at(key, error.to_string())),
        );
    }
    if let Some(tls) = config.cluster.as_ref().and_then(|c| c.tls.as_ref())
        && !unread_tables.contains("cluster.tls")
        && let Err(error) = etcd::options(tls)
    {
        problems.push(at(error.key, error.source.to_string()));
    }
    problems.sort_by_key(|problem| problem.line);
    problems
}

/// Envoy's side of the gRPC port's TLS, read as Envoy will: its CA, and its certificate with its
/// key when it has one.
fn envoy_side(tls: &crate::config::EnvoyTlsConfig) -> Result<(), (&'static str, pem::PemError)> {
    pem::roots(&tls.ca).map_err(|error| ("envoy.tls.ca", error))?;
    if let Some(identity) = &tls.identity {
        pem::certified_key(&identity.cert, &identity.key, &provider()).map_err(|error| {
            let key = if error.is_the_keys(&identity.key) {
                "envoy.tls.key"
            } else {
                "envoy.tls.cert"
            };
            (key, error)
        })?;
    }
    Ok(())
}
