//! Restarts, reloads and upgrades, carried out one at a time: from the control socket (`peregrine
//! restart`, `peregrine reload`, `peregrine upgrade`) or a signal (SIGHUP, SIGUSR2). A restart or
//! reload re-reads the config file, checks it, and applies it through the manager; a bad config
//! changes nothing and its error is the reply. An upgrade ([`crate::upgrade`]) execs a new image of
//! the supervisor once its program passed its checks, and returns only if it did not.

use std::{collections::BTreeSet, path::PathBuf, sync::Arc};

use peregrine_proto::v1;
use tokio::sync::{mpsc, oneshot, watch};

use super::envoy_facing::{self, OrcaReach};
use crate::{
    children,
    config::{ClusterConfig, Config},
    manager::Manager,
    registration::{self, ControlAnswer},
    sampler::ErrorChain,
    service_manager,
    tls::server::{self, ServerTls},
    upgrade::{self, Image},
    xds,
};

/// What operations change besides the workers.
pub(super) struct Outputs {
    /// The cluster options xDS serves.
    pub(super) xds_options: watch::Sender<xds::XdsOptions>,
    /// Where ORCA can reach workers.
    pub(super) orca: OrcaReach,
    /// The gRPC port's TLS, when it has it: a reload reads its files again.
    pub(super) tls: Option<Arc<ServerTls>>,
    /// The worker sockets of the services with a `user`.
    pub(super) worker_sockets: registration::WorkerSockets,
    /// The program image this supervisor runs, which an upgrade replaces.
    pub(super) image: Image,
    /// The `[cluster]` the fleet session runs with: a reload that changes what it holds is refused.
    pub(super) cluster: Option<ClusterConfig>,
    /// How each service is balanced, for `peregrine status`: set once a config is applied.
    pub(super) services: Arc<crate::status::ServiceNotes>,
}

/// The `[cluster]` keys whose change a reload cannot apply, because the fleet session holds them
/// from its start (etcd, the lease, the records' filter): each one that `new` changes, or
/// `cluster` itself if the table comes or goes. `routing` is not among them: xDS applies it.
fn unappliable_cluster_changes(
    running: Option<&ClusterConfig>,
    new: Option<&ClusterConfig>,
) -> Vec<&'static str> {
    let (running, new) = match (running, new) {
        (None, None) => return Vec::new(),
        (Some(running), Some(new)) => (running, new),
        _ => return vec!["cluster"],
    };
    [
        ("cluster.etcd", running.etcd != new.etcd),
        ("cluster.host", running.host != new.host),
        (
            "cluster.region",
            running.locality.region != new.locality.region,
        ),
        ("cluster.zone", running.locality.zone != new.locality.zone),
        ("cluster.lease_ttl_ms", running.lease_ttl != new.lease_ttl),
        ("cluster.prefix", running.prefix != new.prefix),
        ("cluster.tls", running.tls != new.tls),
        (
            "cluster.allowed_networks",
            running.allowed_networks != new.allowed_networks,
        ),
    ]
    .into_iter()
    .filter_map(|(key, changed)| changed.then_some(key))
    .collect()
}

/// A control command and, unless it came from a signal, where its reply goes.
pub(super) type Operation = (v1::ControlRequest, Option<oneshot::Sender<ControlAnswer>>);

/// Carries out restarts and reloads one at a time until the channel closes; returns the manager.
pub(super) async fn operate(
    mut manager: Manager,
    path: PathBuf,
    mut operations: mpsc::Receiver<Operation>,
    mut outputs: Outputs,
) -> Manager {
    while let Some((request, reply)) = operations.recv().await {
        if let Some(v1::control_request::Action::Upgrade(_)) = request.action {
            upgrade::carry_out(&mut manager, &outputs.image, &path, reply).await;
            continue;
        }
        let begun = std::time::Instant::now();
        service_manager::reloading();
        let answer = apply(&mut manager, &path, request, &mut outputs).await;
        service_manager::reloaded(&answer.summary);
        if answer.ok {
            tracing::info!(summary = %answer.summary, took = ?begun.elapsed(), "Control command done");
        } else {
            tracing::warn!(summary = %answer.summary, failures = ?answer.failures, took = ?begun.elapsed(), "Control command failed");
        }
        if let Some(reply) = reply {
            let _ = reply.send(ControlAnswer::from(answer));
        }
    }
    manager
}

/// Re-reads the config and applies it; for a restart, then replaces the workers.
async fn apply(
    manager: &mut Manager,
    path: &std::path::Path,
    request: v1::ControlRequest,
    outputs: &mut Outputs,
) -> v1::ControlReply {
    let Outputs {
        xds_options,
        orca,
        tls,
        worker_sockets,
        image: _,
        cluster,
        services,
    } = outputs;
    let failed = |summary: String, failures: Vec<String>| v1::ControlReply {
        ok: false,
        summary,
        failures,
        ..Default::default()
    };
    let restart = match request.action {
        Some(v1::control_request::Action::Restart(restart)) => Some(restart.service),
        Some(v1::control_request::Action::Reload(_)) => None,
        Some(v1::control_request::Action::Upgrade(_)) => {
            return failed("an upgrade is not a reload".into(), Vec::new());
        }
        None => return failed("an empty control command".into(), Vec::new()),
    };
    let config = match Config::load(path) {
        Ok(config) => config,
        Err(error) => {
            return failed(
                format!(
                    "{} is not valid; nothing changed: the workers keep running as they were",
                    path.display()
                ),
                vec![ErrorChain(&error).to_string()],
            );
        }
    };
    if let Some(service) = restart.as_deref().filter(|s| !s.is_empty())
        && !config.services.contains_key(service)
    {
        return failed(
            format!(
                "no service {service:?} in {}; nothing changed",
                path.display()
            ),
            Vec::new(),
        );
    }
    let unappliable = unappliable_cluster_changes(cluster.as_ref(), config.cluster.as_ref());
    if !unappliable.is_empty() {
        return failed(
            format!(
                "{} changed in {}, and [cluster] applies only when the supervisor starts (or \
                 upgrades in place: `peregrine upgrade`); nothing changed",
                unappliable.join(", "),
                path.display()
            ),
            Vec::new(),
        );
    }
    if let Err(error) = manager.check(&config) {
        return failed(
            "the new config cannot be applied; nothing changed".into(),
            vec![ErrorChain(&error).to_string()],
        );
    }
    match (tls, &config.supervisor.tls) {
        (Some(tls), Some(files)) => {
            let reloaded = tls.reload(Some(files));
            server::log_reload(&reloaded);
            if let Err(error) = reloaded {
                return failed(
                    "the new TLS files cannot be used; nothing changed".into(),
                    vec![ErrorChain(&error).to_string()],
                );
            }
        }
        (None, None) => {}
        (running, _) => {
            return failed(
                format!(
                    "[supervisor.tls] is {} in {} but {} in the running supervisor: TLS on the \
                     gRPC port is switched on or off only when the supervisor starts; nothing \
                     changed",
                    if running.is_some() { "gone" } else { "new" },
                    path.display(),
                    if running.is_some() { "on" } else { "off" },
                ),
                Vec::new(),
            );
        }
    }
    // The new clusters (balancers, weights, ring sizes) are published before the workers change; a
    // service on its way out keeps its cluster as it was while its workers drain.
    // A service that gets a `user` needs its worker socket before its new workers start.
    if let Err(error) = worker_sockets.open(&config) {
        return failed(
            "the new config cannot be applied; nothing changed".into(),
            vec![ErrorChain(&error).to_string()],
        );
    }
    let new_options =
        envoy_facing::xds_options(&config, &orca.services(&config), orca.bound.port());
    let meanwhile = new_options.keeping_departed(&xds_options.borrow());
    xds_options.send_replace(meanwhile);
    let reloaded = manager.reload(&config).await;
    xds_options.send_replace(new_options);
    if reloaded.is_ok() {
        worker_sockets.retain(&config);
        services.set(&config);
        for warning in super::exposure::warnings(&config, path) {
            warning.log();
        }
    }
    let mut report = match reloaded {
        Ok(report) => report,
        Err(error) => {
            return failed(
                "the new config cannot be applied; nothing changed".into(),
                vec![ErrorChain(&error).to_string()],
            );
        }
    };
    if let Some(service) = restart {
        let service = Some(service).filter(|s| !s.is_empty());
        let replaced: BTreeSet<children::Slot> =
            report.replaced.iter().map(|r| r.slot.clone()).collect();
        let restarted = manager.restart(service.as_deref(), &replaced).await;
        report.merge(restarted);
    }
    v1::ControlReply {
        ok: report.failures.is_empty(),
        summary: report.summary(),
        replaced: report.replaced.len() as u32,
        added: report.added.len() as u32,
        removed: report.removed.len() as u32,
        failures: report.failures.iter().map(ToString::to_string).collect(),
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, path::Path};

    use super::*;

    fn cluster(extra: &str) -> Option<ClusterConfig> {
        Config::parse(
            &format!(
                "[service.web]\n[cluster]\netcd = [\"http://127.0.0.1:2379\"]\nhost = \"a\"\n\
                 allow_insecure = true\n{extra}"
            ),
            Path::new("/tmp"),
            &HashMap::new(),
        )
        .expect("a valid config")
        .cluster
    }

    #[test]
    fn a_reload_names_each_cluster_key_it_cannot_apply_and_only_those() {
        let running = cluster("");
        assert!(unappliable_cluster_changes(running.as_ref(), running.as_ref()).is_empty());
        assert!(unappliable_cluster_changes(None, None).is_empty());
        assert_eq!(
            unappliable_cluster_changes(running.as_ref(), None),
            ["cluster"]
        );
        assert_eq!(
            unappliable_cluster_changes(None, running.as_ref()),
            ["cluster"]
        );
        let networks = cluster("allowed_networks = [\"10.0.0.0/8\"]\n");
        assert_eq!(
            unappliable_cluster_changes(running.as_ref(), networks.as_ref()),
            ["cluster.allowed_networks"]
        );
        let moved = cluster("prefix = \"/other\"\nallowed_networks = [\"10.0.0.0/8\"]\n");
        assert_eq!(
            unappliable_cluster_changes(running.as_ref(), moved.as_ref()),
            ["cluster.prefix", "cluster.allowed_networks"]
        );
    }
}
