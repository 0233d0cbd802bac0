//! What a supervisor checks against etcd before it starts any worker in a fleet: that it can take
//! part in the fleet as configured.
//!
//! Envoy opens every worker's ORCA stream to the worker's IP on the cluster's one
//! `oob_reporting_config.port_value`, so every host's supervisor must serve gRPC on the same port; a
//! host that joins a fleet with ORCA on another port would get no load reports from the other hosts'
//! Envoys (and they none from it), which no log line far from the start would explain. The check is
//! made once, at start, against the host records already in etcd; later joiners are checked by their
//! own start, and the session logs any mismatch it sees afterwards.
//!
//! Invariant: only what is certainly wrong stops the start. etcd being away is not: the supervisor
//! starts (its Envoys need their local workers) and says that it could not check.

use std::time::Duration;

use peregrine_etcd::{Client, ConnectOptions};

use super::{
    listing::{self, Listed},
    records::{HostRecord, KeyKind, Keys, Stored},
};
use crate::config::ClusterConfig;

/// How long the check waits for etcd before it gives up (and the supervisor starts unchecked).
const CHECK_TIMEOUT: Duration = Duration::from_secs(3);

/// Why this supervisor cannot join its fleet as configured.
#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    /// Other hosts serve gRPC on another port, and ORCA needs one port fleet-wide.
    #[error(
        "this host serves gRPC on port {ours}, but {} of the fleet at {prefix} serve{} it on another \
         port ({}): Envoy sends every worker's ORCA stream to one port per cluster, so load reports \
         would not reach across hosts; give every supervisor the same supervisor.bind port, or turn \
         ORCA off",
        hosts.len(),
        if hosts.len() == 1 { "s" } else { "" },
        hosts.iter().map(|(h, p)| format!("{h}: {p}")).collect::<Vec<_>>().join(", ")
    )]
    GrpcPort {
        /// This host's gRPC port.
        ours: u16,
        /// The fleet's key prefix.
        prefix: String,
        /// The other hosts and their ports.
        hosts: Vec<(String, u16)>,
    },
    /// The `[cluster.tls]` files cannot be used.
    #[error("cannot reach etcd over TLS")]
    Tls(#[from] crate::tls::etcd::EtcdTlsError),
}

/// What the check found without failing.
#[derive(Debug, PartialEq, Eq)]
pub enum Checked {
    /// etcd answered and nothing is wrong; the other hosts it lists.
    Fine {
        /// How many other hosts are in the fleet.
        hosts: usize,
    },
    /// etcd did not answer in time: nothing could be checked.
    Unchecked(String),
}

/// Checks `cluster` against etcd for a supervisor serving gRPC on `grpc_port`; `orca` says whether
/// any of its services is balanced on ORCA (only then do ports matter).
pub async fn check(
    cluster: &ClusterConfig,
    grpc_port: u16,
    orca: bool,
) -> Result<Checked, PreflightError> {
    let keys = Keys::new(&cluster.prefix);
    let mut options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(1))
        .with_timeout(CHECK_TIMEOUT);
    if let Some(tls) = &cluster.tls {
        options = options.with_tls(crate::tls::etcd::options(tls)?);
    }
    let listed = tokio::time::timeout(CHECK_TIMEOUT, async {
        let client = Client::connect(&cluster.etcd, Some(options)).await?;
        let prefix = format!("{}hosts/", keys.root());
        let mut hosts = Vec::new();
        // In pages, as the session lists: the check cannot be held up by what the range holds.
        listing::list_prefix(&client, &prefix, |listed| {
            let Listed::Record(kv) = listed else { return };
            // A host record under no lease is no host (the session skips it too): whoever wrote
            // it by hand cannot stop the start.
            if kv.lease == 0 {
                return;
            }
            let Some(KeyKind::Host(host)) =
                std::str::from_utf8(&kv.key).ok().and_then(|k| keys.kind(k))
            else {
                return;
            };
            let stored = Stored::new(&kv.value, kv.lease, kv.mod_revision);
            let Ok(value) = stored.text() else { return };
            if let Ok(record) = serde_json::from_str::<HostRecord>(value)
                && host != cluster.host
            {
                hosts.push((host.to_owned(), record.grpc_port));
            }
        })
        .await?;
        Ok::<_, peregrine_etcd::Error>(hosts)
    })
    .await;
    let hosts = match listed {
        Ok(Ok(hosts)) => hosts,
        Ok(Err(error)) => return Ok(Checked::Unchecked(error.to_string())),
        Err(_) => {
            return Ok(Checked::Unchecked(format!(
                "no answer within {CHECK_TIMEOUT:?}"
            )));
        }
    };
    conflicts(cluster, grpc_port, orca, &hosts)?;
    Ok(Checked::Fine { hosts: hosts.len() })
}

/// The pure rule: with ORCA, every other host must serve gRPC on `grpc_port`.
fn conflicts(
    cluster: &ClusterConfig,
    grpc_port: u16,
    orca: bool,
    hosts: &[(String, u16)],
) -> Result<(), PreflightError> {
    let other: Vec<(String, u16)> = hosts
        .iter()
        .filter(|&&(_, port)| port != grpc_port)
        .cloned()
        .collect();
    if orca && !other.is_empty() {
        return Err(PreflightError::GrpcPort {
            ours: grpc_port,
            prefix: cluster.prefix.clone(),
            hosts: other,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Locality, Routing};

    fn cluster() -> ClusterConfig {
        ClusterConfig {
            etcd: vec!["http://127.0.0.1:1".into()],
            host: "a".into(),
            locality: Locality::default(),
            lease_ttl: Duration::from_secs(3),
            prefix: "/peregrine".into(),
            routing: Routing::LocalFirst,
            tls: None,
            allowed_networks: Vec::new(),
        }
    }

    #[test]
    fn with_orca_every_host_must_share_the_grpc_port() {
        let hosts = [("b".to_string(), 18000), ("c".to_string(), 19000)];
        let error = conflicts(&cluster(), 18000, true, &hosts).unwrap_err();
        assert_eq!(
            error.to_string(),
            "this host serves gRPC on port 18000, but 1 of the fleet at /peregrine serves it on \
             another port (c: 19000): Envoy sends every worker's ORCA stream to one port per \
             cluster, so load reports would not reach across hosts; give every supervisor the same \
             supervisor.bind port, or turn ORCA off"
        );
        // Without ORCA the port is nobody's business.
        assert!(conflicts(&cluster(), 18000, false, &hosts).is_ok());
        assert!(conflicts(&cluster(), 18000, true, &hosts[..1]).is_ok());
    }

    #[tokio::test]
    async fn etcd_away_is_unchecked_not_an_error() {
        let checked = check(&cluster(), 18000, true).await.unwrap();
        assert!(matches!(checked, Checked::Unchecked(_)), "{checked:?}");
    }
}
