//! What a supervisor keeps in etcd, and how: the key layout and the records, as pure functions.
//!
//! Under `<prefix>/v1/`:
//! - `hosts/<host>`: the host (its locality and gRPC port), under the host's lease;
//! - `workers/<host>/<service>/<index>/<pid>`: one worker instance (hostname, protocols, addresses,
//!   health, weight, hash key), under the host's lease;
//! - `services/<host>/<service>`: the Envoy-facing spec of a service the host runs (its balancer),
//!   under the host's lease: what every supervisor serves a service's cluster with, also one it does
//!   not run;
//! - `acks/<host>`: the newest etcd revision of the fleet whose view every endpoint stream of the
//!   host's supervisor has ACKed, under the host's lease: what another host's drain waits on. It is
//!   written only when the host sees another host's worker start draining (and once per session), so
//!   a worker that starts or stops costs one write, and only a drain costs one more per host.
//!
//! A worker change is one put or one delete of its own key, and a host's keys are one range, so a
//! host that leaves (its lease expires) takes exactly its own keys with it. Values are JSON, so that
//! `etcdctl get --prefix /peregrine` is readable by an operator.
//!
//! Invariant: only IP endpoints are published (another host cannot reach a Unix socket), and a record
//! that does not parse is skipped with a reason, never half-applied.

use std::{collections::BTreeMap, sync::Arc};

use serde::{Deserialize, Serialize};

use crate::{
    balancer::Balancer,
    config::Locality,
    registry::{Address, Fleet, Health, Protocol, RemoteHost, RemoteWorker, Snapshot},
    xds::resources::slot_hash_key,
};

/// The layout's version: a new layout gets a new one, and old supervisors do not read it.
const LAYOUT: &str = "v1";

/// The largest record read: a worker record is about 200 bytes, a host's about 60. A value over it
/// is skipped with its size as the reason, and never kept.
pub const MAX_RECORD_BYTES: usize = 64 * 1024;

/// The keys of one fleet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keys {
    root: String,
}

/// What is under a key of the fleet's range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyKind<'a> {
    /// `hosts/<host>`.
    Host(&'a str),
    /// `workers/<host>/<service>/<index>/<pid>`.
    Worker {
        /// The host.
        host: &'a str,
        /// The service.
        service: &'a str,
        /// The slot index.
        index: u32,
        /// The process id.
        pid: u32,
    },
    /// `services/<host>/<service>`.
    Service {
        /// The host.
        host: &'a str,
        /// The service.
        service: &'a str,
    },
    /// `acks/<host>`.
    Acks(&'a str),
}

impl Keys {
    /// The keys under `prefix` (e.g. `/peregrine`).
    pub fn new(prefix: &str) -> Keys {
        Keys {
            root: format!("{prefix}/{LAYOUT}/"),
        }
    }

    /// Every key of the fleet starts with this.
    pub fn root(&self) -> &str {
        &self.root
    }

    /// `hosts/<host>`.
    pub fn host(&self, host: &str) -> String {
        format!("{}hosts/{host}", self.root)
    }

    /// `workers/<host>/<service>/<index>/<pid>`.
    pub fn worker(&self, host: &str, service: &str, index: u32, pid: u32) -> String {
        format!("{}workers/{host}/{service}/{index}/{pid}", self.root)
    }

    /// `services/<host>/<service>`.
    pub fn service(&self, host: &str, service: &str) -> String {
        format!("{}services/{host}/{service}", self.root)
    }

    /// `acks/<host>`.
    pub fn acks(&self, host: &str) -> String {
        format!("{}acks/{host}", self.root)
    }

    /// The prefixes of every key of `host` that goes into the view (not its acks): its host record,
    /// its services, its workers.
    pub fn host_prefixes(&self, host: &str) -> [String; 3] {
        [
            self.host(host),
            format!("{}services/{host}/", self.root),
            format!("{}workers/{host}/", self.root),
        ]
    }

    /// What `key` names, if it is a key of this layout.
    pub fn kind<'a>(&self, key: &'a str) -> Option<KeyKind<'a>> {
        let rest = key.strip_prefix(self.root.as_str())?;
        let mut parts = rest.split('/');
        match parts.next()? {
            "hosts" => {
                let host = parts.next()?;
                parts.next().is_none().then_some(KeyKind::Host(host))
            }
            "services" => {
                let (host, service) = (parts.next()?, parts.next()?);
                parts
                    .next()
                    .is_none()
                    .then_some(KeyKind::Service { host, service })
            }
            "acks" => {
                let host = parts.next()?;
                parts.next().is_none().then_some(KeyKind::Acks(host))
            }
            "workers" => {
                let (host, service) = (parts.next()?, parts.next()?);
                let index = parts.next()?.parse().ok()?;
                let pid = parts.next()?.parse().ok()?;
                parts.next().is_none().then_some(KeyKind::Worker {
                    host,
                    service,
                    index,
                    pid,
                })
            }
            _ => None,
        }
    }
}

/// `hosts/<host>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostRecord {
    /// Region.
    pub region: String,
    /// Zone.
    pub zone: String,
    /// The supervisor's gRPC port (xDS, and ORCA on its workers' addresses).
    pub grpc_port: u16,
}

/// `workers/...`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    /// The EDS hostname (the ORCA `:authority`).
    pub hostname: String,
    /// `http1`, `http2`.
    pub protocols: Vec<String>,
    /// `IP:PORT`, in order of preference.
    pub addresses: Vec<String>,
    /// `serving`, `draining` or `unhealthy`.
    pub health: String,
    /// The load-balancing weight.
    pub weight: u32,
    /// The consistent-hashing key.
    pub hash_key: String,
}

/// `services/...`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceRecord {
    /// How Envoy balances the service's cluster.
    pub balancer: Balancer,
}

/// `acks/...`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcksRecord {
    /// The newest etcd revision of the fleet's range that every endpoint stream of the host has
    /// ACKed a view of.
    pub revision: i64,
}

/// Who this host is, for its own records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The host's name.
    pub host: String,
    /// Its locality.
    pub locality: Locality,
    /// Its gRPC port.
    pub grpc_port: u16,
}

fn protocol_name(protocol: Protocol) -> &'static str {
    match protocol {
        Protocol::Http1 => "http1",
        Protocol::Http2 => "http2",
    }
}

/// What of this host's config its records say: each service's balancer and weights by slot index.
#[derive(Clone, Copy, Debug)]
pub struct Specs<'a> {
    /// Each service's balancer (round robin if absent).
    pub balancers: &'a BTreeMap<String, Balancer>,
    /// Each service's worker weights by slot index (1 if absent).
    pub weights: &'a BTreeMap<String, Vec<u32>>,
}

/// The keys and values this host must have in etcd for `snapshot`: its host record, one record per
/// service it runs, and one per local worker instance with an IP address.
pub fn own_records(
    keys: &Keys,
    me: &Identity,
    snapshot: &Snapshot,
    specs: Specs<'_>,
) -> BTreeMap<String, String> {
    let weights = specs.weights;
    let mut records = BTreeMap::new();
    let host = HostRecord {
        region: me.locality.region.clone(),
        zone: me.locality.zone.clone(),
        grpc_port: me.grpc_port,
    };
    records.insert(
        keys.host(&me.host),
        serde_json::to_string(&host).expect("a record serializes"),
    );
    for (service, view) in &snapshot.services {
        let record = ServiceRecord {
            balancer: specs
                .balancers
                .get(service)
                .copied()
                .unwrap_or(Balancer::RoundRobin),
        };
        records.insert(
            keys.service(&me.host, service),
            serde_json::to_string(&record).expect("a record serializes"),
        );
        for worker in view.workers.values() {
            let addresses: Vec<String> = worker
                .listener
                .addresses
                .iter()
                .filter_map(|a| match a {
                    Address::Tcp(addr) => Some(addr.to_string()),
                    Address::Unix(_) => None,
                })
                .collect();
            if addresses.is_empty() {
                continue;
            }
            let record = WorkerRecord {
                hostname: worker.hostname.clone(),
                protocols: worker
                    .listener
                    .protocols
                    .iter()
                    .map(|p| protocol_name(*p).to_owned())
                    .collect(),
                addresses,
                health: worker.health().as_str().to_owned(),
                weight: weights
                    .get(service)
                    .and_then(|w| w.get(worker.index as usize))
                    .copied()
                    .unwrap_or(1),
                hash_key: slot_hash_key(Some(&me.host), service, worker.index),
            };
            records.insert(
                keys.worker(&me.host, service, worker.index, worker.pid),
                serde_json::to_string(&record).expect("a record serializes"),
            );
        }
    }
    records
}

/// One key of the fleet's range as a supervisor keeps it: its value (unless it is over
/// [`MAX_RECORD_BYTES`]), the lease it is attached to (0: none) and the etcd revision it was last
/// written at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// The value.
    pub value: StoredValue,
    /// The lease the key is attached to; 0 for none.
    pub lease: i64,
    /// The revision of the key's last write (`mod_revision`).
    pub revision: i64,
}

/// The value of a [`Stored`] key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoredValue {
    /// Text, as written.
    Text(Box<str>),
    /// Over [`MAX_RECORD_BYTES`]: its size, if it could be read at all.
    TooLarge(Option<usize>),
    /// Not UTF-8.
    NotUtf8,
}

impl Stored {
    /// `value`, attached to `lease`, written at `revision`.
    pub fn new(value: &[u8], lease: i64, revision: i64) -> Stored {
        let value = if value.len() > MAX_RECORD_BYTES {
            StoredValue::TooLarge(Some(value.len()))
        } else {
            match std::str::from_utf8(value) {
                Ok(text) => StoredValue::Text(text.into()),
                Err(_) => StoredValue::NotUtf8,
            }
        };
        Stored {
            value,
            lease,
            revision,
        }
    }

    /// A key whose value was too large to be read at all.
    pub fn unreadable(lease: i64, revision: i64) -> Stored {
        Stored {
            value: StoredValue::TooLarge(None),
            lease,
            revision,
        }
    }

    /// The value as text, or why there is none.
    pub fn text(&self) -> Result<&str, RecordError> {
        match &self.value {
            StoredValue::Text(text) => Ok(text),
            StoredValue::TooLarge(bytes) => Err(RecordError::TooLarge { bytes: *bytes }),
            StoredValue::NotUtf8 => Err(RecordError::NotUtf8),
        }
    }
}

/// Why a record of another host was skipped.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordError {
    /// Over [`MAX_RECORD_BYTES`].
    #[error("{}over the {MAX_RECORD_BYTES}-byte limit of a record", match bytes {
        Some(bytes) => format!("{bytes} bytes, "),
        None => "too large to read, ".to_owned(),
    })]
    TooLarge {
        /// Its size, if it could be read.
        bytes: Option<usize>,
    },
    /// Not UTF-8, so not JSON.
    #[error("not UTF-8")]
    NotUtf8,
    /// Not JSON of the expected shape.
    #[error("not a {what} record: {reason}")]
    Shape {
        /// Which record.
        what: &'static str,
        /// serde's reason.
        reason: String,
    },
    /// A field's value is not one this layout knows.
    #[error("{field} {value:?} is not valid")]
    Value {
        /// The field.
        field: &'static str,
        /// Its value.
        value: String,
    },
}

/// A remote worker from its record.
pub fn remote_worker(
    service: &str,
    index: u32,
    pid: u32,
    value: &str,
) -> Result<RemoteWorker, RecordError> {
    let record: WorkerRecord = serde_json::from_str(value).map_err(|e| RecordError::Shape {
        what: "worker",
        reason: e.to_string(),
    })?;
    let bad = |field, value: &str| RecordError::Value {
        field,
        value: value.to_owned(),
    };
    let protocols = record
        .protocols
        .iter()
        .map(|p| match p.as_str() {
            "http1" => Ok(Protocol::Http1),
            "http2" => Ok(Protocol::Http2),
            other => Err(bad("protocol", other)),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let addresses = record
        .addresses
        .iter()
        .map(|a| a.parse().map(Address::Tcp).map_err(|_| bad("address", a)))
        .collect::<Result<Vec<_>, _>>()?;
    if addresses.is_empty() {
        return Err(bad("addresses", "[]"));
    }
    Ok(RemoteWorker {
        service: service.to_owned(),
        index,
        pid,
        hostname: record.hostname,
        protocols,
        addresses,
        health: Health::parse(&record.health).ok_or_else(|| bad("health", &record.health))?,
        weight: record.weight.max(1),
        hash_key: record.hash_key,
    })
}

/// Whether `value`, put at `key`, is another host's worker (not `me`'s) that is draining: then the
/// drain waits for every host's acks.
pub fn is_remote_drain(keys: &Keys, me: &str, key: &str, value: &str) -> bool {
    matches!(keys.kind(key), Some(KeyKind::Worker { host, .. }) if host != me)
        && serde_json::from_str::<WorkerRecord>(value)
            .is_ok_and(|r| r.health == Health::Draining.as_str())
}

/// Every other host's acks revision from the fleet's range (`kvs`), leaving out `me`; a record that
/// does not parse counts as none.
pub fn acks_from<'a>(
    keys: &Keys,
    me: &str,
    kvs: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> BTreeMap<String, i64> {
    kvs.into_iter()
        .filter_map(|(key, value)| match keys.kind(key) {
            Some(KeyKind::Acks(host)) if host != me => {
                let record = serde_json::from_str::<AcksRecord>(value).ok()?;
                Some((host.to_owned(), record.revision))
            }
            _ => None,
        })
        .collect()
}

/// The other hosts of the fleet from every key of its range (`kvs`), leaving out `me`. Returns the
/// fleet and the records skipped, with their keys and why.
pub fn fleet_from<'a>(
    keys: &Keys,
    me: &str,
    kvs: impl IntoIterator<Item = (&'a str, &'a Stored)>,
) -> (Fleet, Vec<(String, RecordError)>) {
    let mut fleet: BTreeMap<String, RemoteHost> = BTreeMap::new();
    let mut skipped = Vec::new();
    for (key, stored) in kvs {
        let Some(kind) = keys.kind(key) else { continue };
        let host = match kind {
            KeyKind::Host(host) | KeyKind::Service { host, .. } | KeyKind::Worker { host, .. } => {
                host
            }
            KeyKind::Acks(_) => continue,
        };
        if host == me {
            continue;
        }
        let read = match stored.text() {
            Ok(value) => match read_record(&kind, value) {
                Some(read) => read,
                None => continue,
            },
            Err(error) => Err(error),
        };
        match read {
            Ok(record) => {
                let remote = fleet.entry(host.to_owned()).or_default();
                match record {
                    Record::Host(record) => {
                        remote.locality = Locality {
                            region: record.region,
                            zone: record.zone,
                        };
                        remote.grpc_port = record.grpc_port;
                    }
                    Record::Service(service, record) => {
                        remote.services.insert(service, record.balancer);
                    }
                    Record::Worker(worker) => {
                        let id = (worker.service.clone(), worker.index, worker.pid);
                        remote.workers.insert(id, worker);
                    }
                }
            }
            Err(error) => skipped.push((key.to_owned(), error)),
        }
    }
    let fleet = fleet.into_iter().map(|(h, r)| (h, Arc::new(r))).collect();
    (fleet, skipped)
}

/// A record of another host, read.
enum Record {
    Host(HostRecord),
    Service(String, ServiceRecord),
    Worker(RemoteWorker),
}

/// The record `value` at a key of `kind`; `None` for an acks key, which is no host's record.
fn read_record(kind: &KeyKind<'_>, value: &str) -> Option<Result<Record, RecordError>> {
    let shape = |what| {
        move |e: serde_json::Error| RecordError::Shape {
            what,
            reason: e.to_string(),
        }
    };
    let read = match *kind {
        KeyKind::Host(_) => serde_json::from_str(value)
            .map(Record::Host)
            .map_err(shape("host")),
        KeyKind::Service { service, .. } => serde_json::from_str(value)
            .map(|record| Record::Service(service.to_owned(), record))
            .map_err(shape("service")),
        KeyKind::Worker {
            service,
            index,
            pid,
            ..
        } => remote_worker(service, index, pid, value).map(Record::Worker),
        KeyKind::Acks(_) => return None,
    };
    Some(read)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{Registry, Worker};

    fn me() -> Identity {
        Identity {
            host: "host-a".into(),
            locality: Locality {
                region: "r1".into(),
                zone: "z1".into(),
            },
            grpc_port: 18000,
        }
    }

    /// A host record.
    const HOST: &str = r#"{"region":"r","zone":"z","grpc_port":18000}"#;
    /// The lease every record of [`read`] is under.
    const LEASE: i64 = 7;

    fn as_strs<'a>((key, value): (&'a String, &'a String)) -> (&'a str, &'a str) {
        (key, value)
    }

    /// [`fleet_from`] of `kvs`, each under [`LEASE`].
    fn read<'a>(
        keys: &Keys,
        me: &str,
        kvs: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> (Fleet, Vec<(String, RecordError)>) {
        let range: BTreeMap<String, Stored> = kvs
            .into_iter()
            .map(|(k, v)| (k.to_owned(), Stored::new(v.as_bytes(), LEASE, 1)))
            .collect();
        fleet_from(keys, me, range.iter().map(|(k, s)| (k.as_str(), s)))
    }

    #[test]
    fn keys_name_hosts_and_workers_and_nothing_else() {
        let keys = Keys::new("/peregrine");
        assert_eq!(keys.host("a"), "/peregrine/v1/hosts/a");
        let worker = keys.worker("a", "web", 2, 77);
        assert_eq!(worker, "/peregrine/v1/workers/a/web/2/77");
        assert_eq!(
            keys.kind(&worker),
            Some(KeyKind::Worker {
                host: "a",
                service: "web",
                index: 2,
                pid: 77
            })
        );
        assert_eq!(keys.kind("/peregrine/v1/hosts/a"), Some(KeyKind::Host("a")));
        assert_eq!(keys.acks("a"), "/peregrine/v1/acks/a");
        assert_eq!(keys.kind("/peregrine/v1/acks/a"), Some(KeyKind::Acks("a")));
        assert_eq!(
            keys.kind(&keys.service("a", "web")),
            Some(KeyKind::Service {
                host: "a",
                service: "web"
            })
        );
        for other in [
            "/peregrine/v1/hosts/a/b",
            "/peregrine/v1/workers/a/web/x/1",
            "/peregrine/v2/hosts/a",
            "/other/v1/hosts/a",
            "/peregrine/v1/acks/a/b",
            "/peregrine/v1/services/a",
            "/peregrine/v1/leases/a",
        ] {
            assert_eq!(keys.kind(other), None, "{other}");
        }
    }

    #[test]
    fn own_records_round_trip_into_another_hosts_view() {
        let registry = Registry::new(["web".to_string()]);
        registry
            .register(Worker::ready(
                "web",
                1,
                42,
                vec![Protocol::Http1, Protocol::Http2],
                vec![
                    Address::Tcp("10.0.0.1:8001".parse().unwrap()),
                    Address::Tcp("[fd00::1]:8001".parse().unwrap()),
                ],
            ))
            .unwrap();
        registry
            .register(Worker::ready(
                "web",
                2,
                43,
                vec![Protocol::Http1],
                vec![Address::Unix("/run/w.sock".into())],
            ))
            .unwrap();
        let keys = Keys::new("/peregrine");
        let weights = BTreeMap::from([("web".to_string(), vec![1, 3])]);
        let balancers = BTreeMap::from([(
            "web".to_string(),
            Balancer::LeastRequest { choice_count: 3 },
        )]);
        let specs = Specs {
            balancers: &balancers,
            weights: &weights,
        };
        let records = own_records(&keys, &me(), &registry.snapshot(), specs);
        assert_eq!(
            records.len(),
            3,
            "the host, its service and the one IP worker: {records:#?}"
        );
        let (fleet, skipped) = read(&keys, "host-b", records.iter().map(as_strs));
        assert!(skipped.is_empty(), "{skipped:?}");
        let host = &fleet["host-a"];
        assert_eq!(host.locality.zone, "z1");
        assert_eq!(
            host.services,
            BTreeMap::from([(
                "web".to_string(),
                Balancer::LeastRequest { choice_count: 3 }
            )])
        );
        assert_eq!(host.grpc_port, 18000);
        let worker = &host.workers[&("web".to_string(), 1, 42)];
        assert_eq!(worker.hostname, "web-1-42");
        assert_eq!(worker.weight, 3);
        assert_eq!(worker.hash_key, "host-a-web-1");
        assert_eq!(worker.health, Health::Serving);
        assert_eq!(worker.protocols, [Protocol::Http1, Protocol::Http2]);
        assert_eq!(worker.addresses.len(), 2);
        // A host never reads itself back as remote.
        let (mine, _) = read(&keys, "host-a", records.iter().map(as_strs));
        assert!(mine.is_empty());
    }

    #[test]
    fn acks_and_drains_are_read_from_other_hosts_only() {
        let keys = Keys::new("/p");
        let acks = acks_from(
            &keys,
            "me",
            [
                ("/p/v1/acks/b", r#"{"revision":41}"#),
                ("/p/v1/acks/me", r#"{"revision":50}"#),
                ("/p/v1/acks/c", "not json"),
                ("/p/v1/hosts/d", r#"{"revision":1}"#),
            ],
        );
        assert_eq!(acks, BTreeMap::from([("b".to_string(), 41)]));
        let worker = |health: &str| {
            format!(
                r#"{{"hostname":"h","protocols":["http1"],"addresses":["1.2.3.4:5"],"health":"{health}","weight":1,"hash_key":"k"}}"#
            )
        };
        assert!(is_remote_drain(
            &keys,
            "me",
            "/p/v1/workers/b/web/0/1",
            &worker("draining")
        ));
        assert!(!is_remote_drain(
            &keys,
            "me",
            "/p/v1/workers/b/web/0/1",
            &worker("serving")
        ));
        assert!(!is_remote_drain(
            &keys,
            "me",
            "/p/v1/workers/me/web/0/1",
            &worker("draining")
        ));
        assert!(!is_remote_drain(
            &keys,
            "me",
            "/p/v1/hosts/b",
            &worker("draining")
        ));
    }

    #[test]
    fn a_bad_record_is_skipped_with_its_reason() {
        let keys = Keys::new("/p");
        let (fleet, skipped) = read(
            &keys,
            "me",
            [
                ("/p/v1/hosts/b", HOST),
                ("/p/v1/workers/b/web/0/1", "not json"),
                (
                    "/p/v1/workers/b/web/1/2",
                    r#"{"hostname":"h","protocols":["spdy"],"addresses":["1.2.3.4:5"],"health":"serving","weight":1,"hash_key":"k"}"#,
                ),
                (
                    "/p/v1/workers/b/web/2/3",
                    r#"{"hostname":"h","protocols":["http1"],"addresses":["1.2.3.4:5"],"health":"serving","weight":1,"hash_key":"k"}"#,
                ),
            ],
        );
        assert_eq!(skipped.len(), 2, "{skipped:?}");
        assert!(matches!(
            skipped[1].1,
            RecordError::Value {
                field: "protocol",
                ..
            }
        ));
        assert_eq!(fleet["b"].workers.len(), 1);
    }

    #[test]
    fn a_record_over_the_limit_is_never_kept() {
        let huge = vec![b'x'; MAX_RECORD_BYTES + 1];
        let stored = Stored::new(&huge, LEASE, 3);
        assert_eq!(
            stored.value,
            StoredValue::TooLarge(Some(MAX_RECORD_BYTES + 1))
        );
        assert_eq!(
            stored.text().unwrap_err().to_string(),
            "65537 bytes, over the 65536-byte limit of a record"
        );
        assert_eq!(
            Stored::unreadable(LEASE, 3).text().unwrap_err().to_string(),
            "too large to read, over the 65536-byte limit of a record"
        );
        assert_eq!(
            Stored::new(b"\xff", LEASE, 3).text(),
            Err(RecordError::NotUtf8)
        );
        let keys = Keys::new("/p");
        let range = BTreeMap::from([
            (
                "/p/v1/hosts/b".to_string(),
                Stored::new(HOST.as_bytes(), LEASE, 1),
            ),
            ("/p/v1/services/b/web".to_string(), stored),
        ]);
        let (fleet, skipped) = fleet_from(&keys, "me", range.iter().map(|(k, s)| (k.as_str(), s)));
        assert_eq!(skipped.len(), 1, "{skipped:?}");
        assert!(fleet["b"].services.is_empty());
    }
}
