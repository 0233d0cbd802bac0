//! The fleet the supervisor serves: remote hosts' records in a real etcd, written as other hosts'
//! supervisors would write them (`supervisor/src/fleet/records.rs`: a host record and each host's
//! services and workers under the host's lease), through etcd's JSON gateway (`/v3/lease/grant`,
//! `/v3/kv/txn`, `/v3/kv/put`, `/v3/lease/revoke`) so the benchmarks need no etcd client (and so no
//! protoc).
//!
//! `M` endpoints in `S` services: hosts of [`PER_HOST`] workers each; worker `g` (counting over all
//! hosts) is in service `g % S`, on `127.0.0.1`. A *change* puts one worker's record again with a new
//! port and a new EDS hostname, the *marker* the clients look for in their endpoints.

use std::{collections::HashMap, net::SocketAddr, time::Instant};

use anyhow::{Context, ensure};
use peregrine_e2e::http_post_json;
use serde_json::{Value, json};

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
    etcd: SocketAddr,
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

/// base64 (standard, padded), as the gateway takes keys and values.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
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
        let mut fleet = Fleet {
            etcd,
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
        self.post(
            "/v3/kv/put",
            &json!({
                "key": base64(self.worker_key(&worker).as_bytes()),
                "value": base64(worker_value(&worker).as_bytes()),
                "lease": lease.to_string(),
            }),
        )?;
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
            self.post("/v3/lease/revoke", &json!({"ID": lease.to_string()}))?;
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
        let answer = self.post("/v3/lease/grant", &json!({"TTL": LEASE_TTL_S.to_string()}))?;
        answer["ID"]
            .as_str()
            .and_then(|id| id.parse().ok())
            .with_context(|| format!("no lease ID in {answer}"))
    }

    fn txn(&self, puts: &[(String, String)], lease: i64) -> anyhow::Result<()> {
        let success: Vec<Value> = puts
            .iter()
            .map(|(k, v)| {
                json!({"request_put": {
                    "key": base64(k.as_bytes()),
                    "value": base64(v.as_bytes()),
                    "lease": lease.to_string(),
                }})
            })
            .collect();
        self.post("/v3/kv/txn", &json!({"success": success}))?;
        Ok(())
    }

    fn post(&self, path: &str, body: &Value) -> anyhow::Result<Value> {
        let (status, answer) = http_post_json(self.etcd, path, &body.to_string())?;
        ensure!(status == 200, "etcd {path}: {status} {answer}");
        serde_json::from_str(&answer).with_context(|| format!("etcd {path}: {answer}"))
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
    fn base64_as_etcd_reads_it() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"/peregrine/v1/"), "L3BlcmVncmluZS92MS8=");
    }

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
        let value: Value = serde_json::from_str(&worker_value(&w)).unwrap();
        assert_eq!(value["addresses"][0], "127.0.0.1:1");
    }
}
