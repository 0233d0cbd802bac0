//! What the supervisor warns of when it starts, foreseen from the config and this host before
//! anything starts: `run` logs each (and a reload the exposure ones again), and `peregrine check`
//! prints the same list, so that an operator reads them before the start.
//!
//! Invariant: every start-up warning that depends only on the config and the host is made here,
//! never inline in `run`; the few that `run` alone can know (whether the eBPF programs load, the
//! open-file limit after raising it, the subreaper, the fleet in etcd) are listed as such in
//! `run.rs` and checked by `every_startup_warning_of_run_comes_from_here`.

use std::{net::SocketAddr, path::Path};

use peregrine_contract::url::BindUrl;

use super::exposure;
use crate::config::{Config, Warning};

/// Every warning a start of `config` (read from `config_path`) gives on this host.
pub fn at_start(config: &Config, config_path: &Path) -> Vec<Warning> {
    let mut warnings = Vec::new();
    let bind = config.supervisor.bind;
    if !bind.ip().is_loopback() && config.supervisor.tls.is_none() {
        warnings.push(Warning::about_the_host(format!(
            "The gRPC port ({bind}) is reachable from other hosts and has no TLS: anyone who \
             reaches it reads every endpoint, and anyone who impersonates it steers every Envoy; \
             add [supervisor.tls] and [envoy.tls]"
        )));
    }
    if let Some(addr) = config.supervisor.metrics
        && !addr.ip().is_loopback()
    {
        warnings.push(metrics_beyond_the_host(addr));
    }
    if config.cluster.is_some() {
        warnings.extend(loopback_workers_in_a_fleet(config));
    }
    warnings.extend(exposure::warnings(config, config_path));
    warnings.extend(crate::manager::locked_memory_warnings(&config.services));
    warnings.extend(other_users_not_adoptable(config));
    warnings
}

/// Metrics served on an address other hosts reach.
fn metrics_beyond_the_host(addr: SocketAddr) -> Warning {
    Warning::about_the_host(format!(
        "Prometheus metrics ({addr}) are served beyond this host, without TLS or authentication: \
         anyone who reaches the port reads every worker's load"
    ))
}

/// In a fleet, other hosts' Envoys dial each worker's address: a worker on loopback is reachable
/// from this machine only (fine when every host of the fleet runs here, as in tests).
fn loopback_workers_in_a_fleet(config: &Config) -> Vec<Warning> {
    config
        .services
        .values()
        .filter(|service| match service.url_for(0) {
            BindUrl::Tcp { host, .. } => {
                host == "localhost"
                    || host
                        .parse::<std::net::IpAddr>()
                        .is_ok_and(|ip| ip.is_loopback())
            }
            BindUrl::Unix { .. } => true,
        })
        .map(|service| Warning {
            service: Some(service.name.clone()),
            message: format!(
                "In a fleet, these workers ({}) are reachable from this machine only: other hosts' \
                 Envoys cannot reach them unless every host runs here",
                service.url
            ),
        })
        .collect()
}

/// A service that runs as another user whose workers this supervisor could start but not adopt: it
/// cannot read their environment (another user's, mode 0400) without CAP_DAC_READ_SEARCH, so after
/// an upgrade in place or a restart it would replace them rather than keep them.
fn other_users_not_adoptable(config: &Config) -> Vec<Warning> {
    let own = rustix::process::geteuid().as_raw();
    if crate::config::can_read_other_users_files() {
        return Vec::new();
    }
    config
        .services
        .values()
        .filter(|service| service.account.as_ref().is_some_and(|a| a.uid != own))
        .map(|service| Warning {
            service: Some(service.name.clone()),
            message: "These workers run as another user, whose environment this supervisor cannot \
                      read (no CAP_DAC_READ_SEARCH): after `peregrine upgrade` or a restart of the \
                      supervisor they are replaced, not adopted; grant CAP_DAC_READ_SEARCH (the \
                      package's unit does)"
                .into(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Problem;

    fn parse(source: &str) -> Result<Config, Vec<Problem>> {
        Config::parse(
            source,
            Path::new("/etc/peregrine"),
            &std::collections::HashMap::new(),
        )
    }

    #[test]
    fn an_open_grpc_port_open_metrics_and_loopback_workers_in_a_fleet_are_foreseen() {
        let config = parse(
            "[supervisor]\nbind = \"http://0.0.0.0:18000\"\nmetrics = \"http://0.0.0.0:9464\"\n\
             [cluster]\netcd = [\"http://127.0.0.1:2379\"]\nallow_insecure = true\nhost = \"a\"\n\
             [service.web]\nurl = \"http://127.0.0.1:0\"\n",
        )
        .unwrap();
        let said: Vec<String> = at_start(&config, Path::new("/nonexistent.toml"))
            .iter()
            .map(ToString::to_string)
            .collect();
        let has = |text: &str| said.iter().any(|w| w.contains(text));
        assert!(
            has("The gRPC port (0.0.0.0:18000) is reachable"),
            "{said:#?}"
        );
        assert!(has("Prometheus metrics (0.0.0.0:9464)"), "{said:#?}");
        assert!(
            has("service.web: In a fleet, these workers (http://127.0.0.1:0)"),
            "{said:#?}"
        );
    }

    #[test]
    fn a_loopback_host_alone_is_warned_of_nothing_but_its_users() {
        let config = parse("[service.web]\nurl = \"http://127.0.0.1:0\"\nuser = \"nobody\"\n");
        let Ok(config) = config else {
            // Not root: no other user to run as.
            return;
        };
        let said = at_start(&config, Path::new("/nonexistent.toml"));
        assert!(
            said.iter()
                .all(|w| w.message.contains("CAP_DAC_READ_SEARCH")),
            "{said:#?}"
        );
    }

    /// `run.rs` warns inline only of what it alone can know; everything else comes from here.
    #[test]
    fn every_startup_warning_of_run_comes_from_here() {
        let run = include_str!("../run.rs");
        let inline: Vec<&str> = run
            .lines()
            .filter(|line| line.contains("tracing::warn!"))
            .collect();
        // What only a start can tell: the sampler that loads, the subreaper, the open-file limit
        // after raising it, the fleet in etcd, the ORCA listener of the sampler's services, and
        // what a crashed predecessor left.
        let known_to_run_alone = [
            "falling back to procfs",
            "Cannot become the subreaper",
            "gRPC connections capped",
            "Could not check this host's config against the fleet",
            "ORCA listens on a non-loopback address",
            "Cannot read the Envoys the supervisor before this one served",
        ];
        let mut unexplained = Vec::new();
        for (index, line) in run.lines().enumerate() {
            if !line.contains("tracing::warn!") {
                continue;
            }
            // The message is on this line or within the next few.
            let around: String = run.lines().skip(index).take(6).collect();
            if !known_to_run_alone
                .iter()
                .any(|known| around.contains(known))
            {
                unexplained.push(line.trim().to_owned());
            }
        }
        assert!(
            unexplained.is_empty(),
            "warnings in run.rs that `peregrine check` cannot print ({} inline in all): {unexplained:#?}",
            inline.len()
        );
    }
}
