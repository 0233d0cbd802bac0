//! Worker slots as seen through Envoy: which slot each worker pid fills (from `peregrine status`),
//! waiting until Envoy holds exactly the registered workers, and which slot each key reaches through a
//! hashing route. Shared by the hashing tests and `cargo xtask bench hashing`.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use anyhow::Context;

use crate::{Envoy, Supervisor, hosts, http_get_with, try_wait_until, worker_pid};

/// The slot index of every registered worker, by pid.
pub fn slots_by_pid(supervisor: &Supervisor, service: &str) -> Option<BTreeMap<u32, u64>> {
    let status = supervisor.status_json().ok()?;
    status["workers"]
        .as_array()?
        .iter()
        .filter(|row| row["service"] == service)
        .map(|row| Some((row["pid"].as_u64()? as u32, row["index"].as_u64()?)))
        .collect()
}

/// Waits (up to 60 s) until Envoy holds `count` healthy hosts in cluster `service` that are exactly the
/// supervisor's registered workers, and its active clusters' config contains `config` (when given: a
/// cluster update and an endpoint update arrive separately, so hosts alone do not say that the
/// cluster's new settings apply); returns their slots by pid.
pub fn wait_for_slots(
    supervisor: &Supervisor,
    envoy: &Envoy,
    service: &str,
    count: usize,
    config: Option<&str>,
) -> anyhow::Result<BTreeMap<u32, u64>> {
    try_wait_until(
        Duration::from_secs(60),
        &format!("Envoy holding the {count} workers of {service}"),
        || {
            let slots = slots_by_pid(supervisor, service).filter(|s| s.len() == count)?;
            if let Some(needle) = config {
                let clusters = envoy
                    .admin_get("/config_dump?resource=dynamic_active_clusters")
                    .ok()?;
                clusters.contains(needle).then_some(())?;
            }
            let hosts = hosts(&envoy.admin_get("/clusters").ok()?, service);
            let all = hosts.len() == count
                && hosts.iter().all(|h| {
                    h.healthy
                        && h.hostname
                            .rsplit('-')
                            .next()
                            .and_then(|pid| pid.parse::<u32>().ok())
                            .is_some_and(|pid| slots.contains_key(&pid))
                });
            all.then_some(slots)
        },
    )
    .with_context(|| format!("{}\n{}", supervisor.logs(), envoy.logs()))
}

/// The slot that each of `keys` reaches through Envoy's `listen` when sent as header `header` on `GET
/// path`, with `clients` requests in flight; `slots` maps the answering pid to its slot.
pub fn route_keys(
    listen: SocketAddr,
    path: &str,
    header: &str,
    keys: &[String],
    clients: usize,
    slots: &BTreeMap<u32, u64>,
) -> anyhow::Result<Vec<u64>> {
    let chunk = keys.len().div_ceil(clients.max(1)).max(1);
    std::thread::scope(|scope| {
        let parts: Vec<_> = keys
            .chunks(chunk)
            .map(|part| {
                scope.spawn(move || {
                    part.iter()
                        .map(|key| {
                            let (code, body) = http_get_with(listen, path, &[(header, key)])?;
                            anyhow::ensure!(code == 200, "{key}: {code} {body}");
                            let pid =
                                worker_pid(&body).with_context(|| format!("{key}: {body}"))?;
                            slots.get(&pid).copied().with_context(|| {
                                format!("{key}: pid {pid} is no registered worker")
                            })
                        })
                        .collect::<anyhow::Result<Vec<u64>>>()
                })
            })
            .collect();
        let mut all = Vec::with_capacity(keys.len());
        for part in parts {
            all.extend(part.join().expect("a routing thread panicked")?);
        }
        Ok(all)
    })
}

/// How many keys reach a different slot in `after` than in `before`.
pub fn moved(before: &[u64], after: &[u64]) -> usize {
    before.iter().zip(after).filter(|(a, b)| a != b).count()
}
