//! The fleet the supervisor serves: remote hosts' records in a real etcd, written as other hosts'
//! supervisors would write them (`supervisor/src/fleet/records.rs`: a host record and each host's
//! services and workers under the host's lease), through the supervisor's own etcd calls
//! (`peregrine-etcd`).
//!
//! `M` endpoints in `S` services: hosts of [`PER_HOST`] workers each; worker `g` (counting over all
//! hosts) is in service `g % S`, on `127.0.0.1`. A *change* puts one worker's record again with a new
//! port and a new EDS hostname, the *marker* the clients look for in their endpoints.

use std::{collections::HashMap, net::SocketAddr, time::Instant};

use anyhow::ensure;
use serde_json::json;

/// Workers per remote host.
const PER_HOST: usize = 100;
/// The most operations etcd takes in one transaction (`--max-txn-ops`' default).
const TXN_OPS: usize = 128;
/// The leases' TTL: longer than any run, and revoked at the end.
const LEASE_TTL_S: u64 = 3600;

/// One remote worker.
#[derive(Clone, Debug)]
struct Worker {
    host: usize,
    service: usize,
    /// Its slot on its host.
    index: usize,
    port: u16,
    /// The change that wrote it last (0: none yet).
    generation: u64,
}

/// The fleet's records, as last written.
#[derive(Debug)]
pub(super) struct Fleet {
    /// The etcd calls run on a runtime of their own: the benchmark's are blocking.
    runtime: tokio::runtime::Runtime,
    client: peregrine_etcd::Client,
    prefix: String,
    /// Each host's lease.
    leases: Vec<i64>,
    workers: Vec<Worker>,
    /// The next port a changed worker gets.
    next_port: u16,
}

/// A change written: the cluster it is in, the marker its endpoints now hold, and when the put
/// returned.
#[derive(Clone, Debug)]
pub(super) struct Written {
    pub(super) cluster: String,
    pub(super) marker: Vec<u8>,
    pub(super) at: Instant,
}

/// The name of service `s`.
pub(super) fn service_name(s: usize) -> String {
    format!("svc-{s:04}")
}

fn host_name(h: usize) -> String {
    format!("h{h:04}")
}

impl Fleet {
    /// Writes `endpoints` workers in `services` services under `prefix` (hosts, their leases,
    /// services and workers).
    pub(super) fn write(
        etcd: SocketAddr,
        prefix: &str,
        endpoints: usize,
        services: usize,
    ) -> anyhow::Result<Fleet> {
        ensure!(services >= 1 && endpoints >= services, "M >= S >= 1");
        let hosts = endpoints.div_ceil(PER_HOST);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let client = runtime.block_on(peregrine_etcd::Client::connect(
            [format!("http://{etcd}")],
            None,
        ))?;
        let mut fleet = Fleet {
            runtime,
            client,
            prefix: prefix.to_owned(),
            leases: Vec::with_capacity(hosts),
            workers: (0..endpoints)
                .map(|g| Worker {
                    host: g / PER_HOST,
                    service: g % services,
                    index: g % PER_HOST,
                    port: 20000 + (g % 40000) as u16,
                    generation: 0,
                })
                .collect(),
            next_port: 1024,
        };
        for h in 0..hosts {
            let lease = fleet.grant()?;
            fleet.leases.push(lease);
            let mut puts = vec![(
                fleet.key(&format!("hosts/{}", host_name(h))),
                json!({"region": "r", "zone": "z-remote", "grpc_port": 18000}).to_string(),
            )];
            let mut services_of_host: Vec<usize> = fleet
                .workers
                .iter()
                .filter(|w| w.host == h)
                .map(|w| w.service)
                .collect();
            services_of_host.sort_unstable();
            services_of_host.dedup();
            for s in services_of_host {
                puts.push((
                    fleet.key(&format!("services/{}/{}", host_name(h), service_name(s))),
                    json!({"balancer": {"kind": "round_robin"}}).to_string(),
                ));
            }
            for w in fleet.workers.iter().filter(|w| w.host == h) {
                puts.push((fleet.worker_key(w), worker_value(w)));
            }
            // The host record first: a worker whose host is not there yet is skipped until it is.
            for batch in puts.chunks(TXN_OPS) {
                fleet.txn(batch, lease)?;
            }
        }
        Ok(fleet)
    }

    /// How many workers there are.
    pub(super) fn len(&self) -> usize {
        self.workers.len()
    }

    /// Changes worker `w` (a new port and hostname, under change `generation`); returns what to look
    /// for and when the put returned.
    pub(super) fn change(&mut self, w: usize, generation: u64) -> anyhow::Result<Written> {
        self.next_port = if self.next_port >= 19999 {
            1024
        } else {
            self.next_port + 1
        };
        let worker = &mut self.workers[w];
        worker.port = self.next_port;
        worker.generation = generation;
        let worker = worker.clone();
        let lease = self.leases[worker.host];
        self.runtime.block_on(self.client.put(
            self.worker_key(&worker),
            worker_value(&worker),
            lease,
        ))?;
        Ok(Written {
            cluster: service_name(worker.service),
            marker: hostname(&worker).into_bytes(),
            at: Instant::now(),
        })
    }

    /// The markers of written changes, by cluster.
    pub(super) fn markers(written: &[Written]) -> HashMap<String, Vec<Vec<u8>>> {
        let mut markers: HashMap<String, Vec<Vec<u8>>> = HashMap::new();
        for w in written {
            markers
                .entry(w.cluster.clone())
                .or_default()
                .push(w.marker.clone());
        }
        markers
    }

    /// What change `generation` of worker `w` will write: its cluster and marker.
    pub(super) fn marker_of(&self, w: usize, generation: u64) -> (String, Vec<u8>) {
        let worker = Worker {
            generation,
            ..self.workers[w].clone()
        };
        (service_name(worker.service), hostname(&worker).into_bytes())
    }

    /// Revokes every lease: etcd deletes the records.
    pub(super) fn remove(&self) -> anyhow::Result<()> {
        for lease in &self.leases {
            self.runtime.block_on(self.client.lease_revoke(*lease))?;
        }
        Ok(())
    }

    fn key(&self, rest: &str) -> String {
        format!("{}/v1/{rest}", self.prefix)
    }

    fn worker_key(&self, w: &Worker) -> String {
        // The pid is the slot's: a change rewrites the same key, as a worker whose address changes.
        self.key(&format!(
            "workers/{}/{}/{}/{}",
            host_name(w.host),
            service_name(w.service),
            w.index,
            1000 + w.index
        ))
    }

    fn grant(&self) -> anyhow::Result<i64> {
        Ok(self
            .runtime
            .block_on(self.client.lease_grant(LEASE_TTL_S as i64))?)
    }

    fn txn(&self, puts: &[(String, String)], lease: i64) -> anyhow::Result<()> {
        let operations = puts
            .iter()
            .map(|(key, value)| peregrine_etcd::put_op(key.as_str(), value.as_str(), lease))
            .collect();
        self.runtime.block_on(self.client.txn(operations))?;
        Ok(())
    }
}

/// A worker's EDS hostname: its host, service and slot, and the change that wrote it (fixed width,
/// so no marker is a prefix of another).
fn hostname(w: &Worker) -> String {
    format!(
        "{}-{}-{}-g{:08}",
        host_name(w.host),
        service_name(w.service),
        w.index,
        w.generation
    )
}

fn worker_value(w: &Worker) -> String {
    json!({
        "hostname": hostname(w),
        "protocols": ["http1"],
        "addresses": [format!("127.0.0.1:{}", w.port)],
        "health": "serving",
        "weight": 1,
        "hash_key": format!("{}-{}-{}", host_name(w.host), service_name(w.service), w.index),
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_are_unique_per_change() {
        let w = Worker {
            host: 1,
            service: 2,
            index: 3,
            port: 1,
            generation: 42,
        };
        assert_eq!(hostname(&w), "h0001-svc-0002-3-g00000042");
        let value: serde_json::Value = serde_json::from_str(&worker_value(&w)).unwrap();
        assert_eq!(value["addresses"][0], "127.0.0.1:1");
    }
}
