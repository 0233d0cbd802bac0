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

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::{
    balancer::Balancer,
    config::{
        Locality, MAX_FLEET_SERVICE_NAME, MAX_WEIGHT, balancer_problem, fleet_name,
        fleet_service_name,
    },
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

/// The host whose record (host, service or worker) `key` is, if it is one.
pub fn host_of<'a>(keys: &Keys, key: &'a str) -> Option<&'a str> {
    match keys.kind(key)? {
        KeyKind::Host(host) | KeyKind::Service { host, .. } | KeyKind::Worker { host, .. } => {
            Some(host)
        }
        KeyKind::Acks(_) => None,
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
        /// Its value (its start, when long).
        value: String,
    },
    /// A host or service name the config's rules refuse.
    #[error(
        "{what} name {name:?} is not valid: ASCII letters, digits, '-', '_' and '.' only, at most \
         {max}"
    )]
    Name {
        /// `host` or `service`.
        what: &'static str,
        /// The name (its start, when long).
        name: String,
        /// The longest allowed.
        max: usize,
    },
    /// A host record under no lease: it would never expire.
    #[error("a host record under no lease: a host counts only while its supervisor keeps one")]
    NoLease,
    /// A service or worker record of a host that has no (valid) host record.
    #[error("its host has no valid record under a lease")]
    NoHost,
    /// A service or worker record that is not under its host's lease: it would outlive the host.
    #[error("under lease {lease:x}, not its host's ({host_lease:x})")]
    OtherLease {
        /// The record's lease (0: none).
        lease: i64,
        /// The host record's.
        host_lease: i64,
    },
    /// An address no worker can be at, or one outside `cluster.allowed_networks`.
    #[error("address {address} is refused: {why}")]
    Address {
        /// The address.
        address: SocketAddr,
        /// Why.
        why: &'static str,
    },
    /// A service's spec that the config's own checks refuse.
    #[error("a spec this config could not make: {0}")]
    Spec(String),
}

impl RecordError {
    /// A short name of the kind of problem, as a metric's label.
    pub fn reason(&self) -> &'static str {
        match self {
            RecordError::TooLarge { .. } => "too_large",
            RecordError::NotUtf8 | RecordError::Shape { .. } => "shape",
            RecordError::Value { .. } => "value",
            RecordError::Name { .. } => "name",
            RecordError::NoLease => "no_lease",
            RecordError::NoHost => "no_host",
            RecordError::OtherLease { .. } => "other_lease",
            RecordError::Address { .. } => "address",
            RecordError::Spec(_) => "spec",
        }
    }
}

/// What another host's records are held to beyond their shape, from this host's config.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rules {
    /// `cluster.allowed_networks`: when not empty, every address of another host's worker must be
    /// in one of them.
    pub allowed_networks: Vec<IpNet>,
}

/// The start of `text`, for a message: at most 64 characters.
fn shown(text: &str) -> String {
    const SHOWN: usize = 64;
    match text.char_indices().nth(SHOWN) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text.to_owned(),
    }
}

/// Why `address` cannot be another host's worker, if it cannot: it must be unicast, not
/// unspecified, with a port; in one of `allowed` when that is not empty, else not link-local.
/// Loopback is allowed unless `allowed` leaves it out: a fleet on one machine is on it.
pub fn address_problem(address: SocketAddr, allowed: &[IpNet]) -> Option<&'static str> {
    // An IPv4 address written as IPv6 (::ffff:a.b.c.d) is held to IPv4's rules.
    let ip = address.ip().to_canonical();
    if address.port() == 0 {
        return Some("port 0");
    }
    let unspecified = match ip {
        // 0.0.0.0/8 is "this network": no host is at it.
        IpAddr::V4(v4) => v4.octets()[0] == 0,
        IpAddr::V6(v6) => v6.is_unspecified(),
    };
    if unspecified {
        return Some("unspecified");
    }
    if ip.is_multicast() {
        return Some("multicast");
    }
    if let IpAddr::V4(v4) = ip
        && v4.is_broadcast()
    {
        return Some("broadcast");
    }
    if !allowed.is_empty() {
        return (!allowed.iter().any(|net| net.contains(&ip)))
            .then_some("outside cluster.allowed_networks");
    }
    let link_local = match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.segments()[0] & 0xffc0 == 0xfe80,
    };
    link_local.then_some("link-local (list its network in cluster.allowed_networks to allow it)")
}

/// Whether `text` (an EDS hostname or a hash key) is one a supervisor makes: a host, a service, an
/// index and a pid joined by `-`, so the characters of names and at most as long as they make it.
fn derived_name(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 63 + MAX_FLEET_SERVICE_NAME + 24
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// A remote worker from its record, held to `rules`.
pub fn remote_worker(
    service: &str,
    index: u32,
    pid: u32,
    value: &str,
    rules: &Rules,
) -> Result<RemoteWorker, RecordError> {
    let record: WorkerRecord = serde_json::from_str(value).map_err(|e| RecordError::Shape {
        what: "worker",
        reason: e.to_string(),
    })?;
    let bad = |field, value: &str| RecordError::Value {
        field,
        value: shown(value),
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
        .map(|a| {
            let address: SocketAddr = a.parse().map_err(|_| bad("address", a))?;
            match address_problem(address, &rules.allowed_networks) {
                Some(why) => Err(RecordError::Address { address, why }),
                None => Ok(Address::Tcp(address)),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    if addresses.is_empty() {
        return Err(bad("addresses", "[]"));
    }
    if !derived_name(&record.hostname) {
        return Err(bad("hostname", &record.hostname));
    }
    if !derived_name(&record.hash_key) {
        return Err(bad("hash_key", &record.hash_key));
    }
    if record.weight > MAX_WEIGHT {
        return Err(bad("weight", &record.weight.to_string()));
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

/// The other hosts of the fleet from every key of its range (`kvs`), leaving out `me`, held to
/// `rules`. Returns the fleet and the records skipped, with their keys and why.
///
/// A host counts only with a host record under a lease (etcd deletes it when the lease expires),
/// and its services and workers only while they are under that same lease: whoever writes a record
/// by hand cannot make one that outlives its host, nor a host that never leaves. Names are held to
/// the config's rules, addresses to [`address_problem`], services' specs to the config's checks.
pub fn fleet_from<'a>(
    keys: &Keys,
    me: &str,
    rules: &Rules,
    kvs: impl IntoIterator<Item = (&'a str, &'a Stored)>,
) -> (Fleet, Vec<(String, RecordError)>) {
    let mut skipped = Vec::new();
    // Hosts first: every other record is judged by its host's.
    let mut hosts: BTreeMap<&str, (i64, RemoteHost)> = BTreeMap::new();
    let mut others = Vec::new();
    for (key, stored) in kvs {
        let (host, other) = match keys.kind(key) {
            Some(KeyKind::Host(host)) => (host, None),
            Some(KeyKind::Service { host, service }) => (host, Some((service, None))),
            Some(KeyKind::Worker {
                host,
                service,
                index,
                pid,
            }) => (host, Some((service, Some((index, pid))))),
            Some(KeyKind::Acks(_)) | None => continue,
        };
        if host == me {
            continue;
        }
        match other {
            Some((service, worker)) => others.push((key, host, service, worker, stored)),
            None => match read_host(host, stored) {
                Ok(remote) => {
                    hosts.insert(host, (stored.lease, remote));
                }
                Err(error) => skipped.push((key.to_owned(), error)),
            },
        }
    }
    for (key, host, service, worker, stored) in others {
        let read = match hosts.get_mut(host) {
            None => Err(RecordError::NoHost),
            Some((lease, _)) if stored.lease != *lease => Err(RecordError::OtherLease {
                lease: stored.lease,
                host_lease: *lease,
            }),
            Some((_, remote)) => read_other(remote, service, worker, stored, rules),
        };
        if let Err(error) = read {
            skipped.push((key.to_owned(), error));
        }
    }
    let fleet = hosts
        .into_iter()
        .map(|(host, (_, remote))| (host.to_owned(), Arc::new(remote)))
        .collect();
    (fleet, skipped)
}

/// Reads the record of `service` (of its worker `(index, pid)`, if given) into its host, `remote`.
fn read_other(
    remote: &mut RemoteHost,
    service: &str,
    worker: Option<(u32, u32)>,
    stored: &Stored,
    rules: &Rules,
) -> Result<(), RecordError> {
    if !fleet_service_name(service) {
        return Err(RecordError::Name {
            what: "service",
            name: shown(service),
            max: MAX_FLEET_SERVICE_NAME,
        });
    }
    let value = stored.text()?;
    match worker {
        Some((index, pid)) => {
            let worker = remote_worker(service, index, pid, value, rules)?;
            remote
                .workers
                .insert((service.to_owned(), index, pid), worker);
        }
        None => {
            let record: ServiceRecord =
                serde_json::from_str(value).map_err(|e| RecordError::Shape {
                    what: "service",
                    reason: e.to_string(),
                })?;
            if let Some(problem) = balancer_problem(&record.balancer) {
                return Err(RecordError::Spec(problem));
            }
            remote.services.insert(service.to_owned(), record.balancer);
        }
    }
    Ok(())
}

/// Another host from its host record.
fn read_host(host: &str, stored: &Stored) -> Result<RemoteHost, RecordError> {
    if !fleet_name(host) || host.is_empty() {
        return Err(RecordError::Name {
            what: "host",
            name: shown(host),
            max: 63,
        });
    }
    if stored.lease == 0 {
        return Err(RecordError::NoLease);
    }
    let record: HostRecord =
        serde_json::from_str(stored.text()?).map_err(|e| RecordError::Shape {
            what: "host",
            reason: e.to_string(),
        })?;
    for (field, name) in [("region", &record.region), ("zone", &record.zone)] {
        if !fleet_name(name) {
            return Err(RecordError::Value {
                field,
                value: shown(name),
            });
        }
    }
    Ok(RemoteHost {
        locality: Locality {
            region: record.region,
            zone: record.zone,
        },
        grpc_port: record.grpc_port,
        ..RemoteHost::default()
    })
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
        fleet_from(
            keys,
            me,
            &Rules::default(),
            range.iter().map(|(k, s)| (k.as_str(), s)),
        )
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
    fn a_hosts_records_hold_its_membership_and_no_load() {
        // The records are made from the registry's snapshot (membership), which no load sample
        // changes: a busy worker writes nothing to etcd.
        let registry = Registry::new(["web".to_string()]);
        registry
            .register(Worker::ready(
                "web",
                0,
                42,
                vec![Protocol::Http1],
                vec![Address::Tcp("10.0.0.1:8001".parse().unwrap())],
            ))
            .unwrap();
        let keys = Keys::new("/peregrine");
        let (weights, balancers) = (BTreeMap::new(), BTreeMap::new());
        let specs = || Specs {
            balancers: &balancers,
            weights: &weights,
        };
        let before = registry.snapshot();
        let records = own_records(&keys, &me(), &before, specs());
        registry.publish_loads(crate::registry::Loads::new(
            None,
            [crate::registry::WorkerLoad {
                service: "web".into(),
                index: 0,
                pid: 42,
                cpu_cores: Some(1.9),
                runq_wait_cores: Some(0.7),
                requests_per_second: Some(12_000.0),
                cpu_seconds_total: 300.0,
                runq_wait_seconds_total: 40.0,
                requests_total: 1_000_000,
                in_flight: Some(64.0),
                in_flight_now: Some(64),
                in_flight_utilization: Some(1.0),
                smoothed: None,
                sampled_at: std::time::SystemTime::now(),
            }],
        ));
        let after = registry.snapshot();
        assert_eq!(
            after.revision, before.revision,
            "a load sample is no membership change"
        );
        assert_eq!(own_records(&keys, &me(), &after, specs()), records);
        let text: String = records.values().cloned().collect();
        for load in ["cpu", "runq", "request", "in_flight", "utilization"] {
            assert!(!text.contains(load), "{load} in {records:#?}");
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
        let (fleet, skipped) = fleet_from(
            &keys,
            "me",
            &Rules::default(),
            range.iter().map(|(k, s)| (k.as_str(), s)),
        );
        assert_eq!(skipped.len(), 1, "{skipped:?}");
        assert!(fleet["b"].services.is_empty());
    }

    /// A worker record at `address`.
    fn worker_at(address: &str) -> String {
        format!(
            r#"{{"hostname":"b-web-0-1","protocols":["http1"],"addresses":["{address}"],"health":"serving","weight":1,"hash_key":"b-web-0"}}"#
        )
    }

    /// What [`fleet_from`] makes of `records` (key, value, lease) with `rules`: the workers and
    /// services it keeps, and the reason of each record it skips, by key.
    fn judged(
        rules: &Rules,
        records: &[(&str, &str, i64)],
    ) -> (Fleet, BTreeMap<String, &'static str>) {
        let keys = Keys::new("/p");
        let range: BTreeMap<String, Stored> = records
            .iter()
            .map(|&(k, v, lease)| (k.to_owned(), Stored::new(v.as_bytes(), lease, 1)))
            .collect();
        let (fleet, skipped) = fleet_from(
            &keys,
            "me",
            rules,
            range.iter().map(|(k, s)| (k.as_str(), s)),
        );
        let reasons = skipped
            .iter()
            .map(|(key, error)| (key.clone(), error.reason()))
            .collect();
        (fleet, reasons)
    }

    #[test]
    fn records_count_only_under_their_hosts_lease() {
        let worker = worker_at("10.0.0.1:80");
        let (fleet, skipped) = judged(
            &Rules::default(),
            &[
                ("/p/v1/hosts/b", HOST, 7),
                ("/p/v1/workers/b/web/0/1", &worker, 7),
                // Written by hand into a real host's range, under no lease or another one.
                ("/p/v1/workers/b/web/1/2", &worker, 0),
                ("/p/v1/workers/b/web/2/3", &worker, 8),
                (
                    "/p/v1/services/b/web",
                    r#"{"balancer":{"kind":"random"}}"#,
                    0,
                ),
                // A host under no lease, and its workers: none of it counts.
                ("/p/v1/hosts/c", HOST, 0),
                ("/p/v1/workers/c/web/0/1", &worker, 0),
                // Workers of no host.
                ("/p/v1/workers/d/web/0/1", &worker, 9),
            ],
        );
        assert_eq!(fleet.keys().collect::<Vec<_>>(), ["b"]);
        assert_eq!(fleet["b"].workers.len(), 1);
        assert!(fleet["b"].services.is_empty());
        assert_eq!(
            skipped,
            BTreeMap::from([
                ("/p/v1/hosts/c".to_string(), "no_lease"),
                ("/p/v1/services/b/web".to_string(), "other_lease"),
                ("/p/v1/workers/b/web/1/2".to_string(), "other_lease"),
                ("/p/v1/workers/b/web/2/3".to_string(), "other_lease"),
                ("/p/v1/workers/c/web/0/1".to_string(), "no_host"),
                ("/p/v1/workers/d/web/0/1".to_string(), "no_host"),
            ])
        );
    }

    #[test]
    fn names_follow_the_configs_rules() {
        let worker = worker_at("10.0.0.1:80");
        let long = "w".repeat(5000);
        let quoted = "/p/v1/workers/b/we\"b/0/1".to_string();
        let newline = "/p/v1/services/b/we\nb".to_string();
        let too_long = format!("/p/v1/workers/b/{long}/0/1");
        let bad_host = "/p/v1/hosts/b c".to_string();
        let spec = r#"{"balancer":{"kind":"random"}}"#;
        let (fleet, skipped) = judged(
            &Rules::default(),
            &[
                ("/p/v1/hosts/b", HOST, 7),
                (&quoted, &worker, 7),
                (&newline, spec, 7),
                (&too_long, &worker, 7),
                (&bad_host, HOST, 7),
                (
                    "/p/v1/workers/b/web/0/1",
                    &worker.replace("b-web-0-1", "b-web 0-1"),
                    7,
                ),
            ],
        );
        assert!(fleet["b"].workers.is_empty() && fleet["b"].services.is_empty());
        assert_eq!(skipped[&quoted], "name");
        assert_eq!(skipped[&newline], "name");
        assert_eq!(skipped[&too_long], "name");
        assert_eq!(skipped[&bad_host], "name");
        assert_eq!(skipped["/p/v1/workers/b/web/0/1"], "value");
    }

    #[test]
    fn addresses_are_unicast_and_where_the_config_allows() {
        let default = Rules::default();
        let refused = [
            "0.0.0.0:0",
            "0.0.0.0:80",
            "0.1.2.3:80",
            "[::]:80",
            "10.0.0.1:0",
            "224.0.0.1:80",
            "[ff02::1]:80",
            "255.255.255.255:80",
            "169.254.169.254:80",
            "[fe80::1]:80",
            "[::ffff:169.254.169.254]:80",
        ];
        for address in refused {
            let address: SocketAddr = address.parse().unwrap();
            assert!(address_problem(address, &[]).is_some(), "{address}");
        }
        for address in ["127.0.0.1:22", "10.0.0.1:80", "8.8.8.8:53", "[fd00::1]:80"] {
            let address: SocketAddr = address.parse().unwrap();
            assert_eq!(address_problem(address, &[]), None, "{address}");
        }
        let rules = Rules {
            allowed_networks: vec![
                "10.0.0.0/8".parse().unwrap(),
                "169.254.0.0/16".parse().unwrap(),
            ],
        };
        let judge =
            |address: &str| address_problem(address.parse().unwrap(), &rules.allowed_networks);
        assert_eq!(judge("10.1.2.3:80"), None);
        assert_eq!(judge("[::ffff:10.1.2.3]:80"), None, "IPv4 written as IPv6");
        assert_eq!(
            judge("169.254.1.1:80"),
            None,
            "a listed network allows link-local"
        );
        assert_eq!(
            judge("127.0.0.1:22"),
            Some("outside cluster.allowed_networks")
        );
        assert_eq!(
            judge("8.8.8.8:53"),
            Some("outside cluster.allowed_networks")
        );
        assert_eq!(
            judge("0.0.0.0:80"),
            Some("unspecified"),
            "a network cannot allow it"
        );
        // In a record: the worker is skipped, with its address.
        let metadata = worker_at("169.254.169.254:80");
        let (fleet, skipped) = judged(
            &default,
            &[
                ("/p/v1/hosts/b", HOST, 7),
                ("/p/v1/workers/b/web/0/1", &metadata, 7),
            ],
        );
        assert!(fleet["b"].workers.is_empty());
        assert_eq!(skipped["/p/v1/workers/b/web/0/1"], "address");
    }

    #[test]
    fn a_spec_the_config_would_refuse_is_never_counted() {
        let (fleet, skipped) = judged(
            &Rules::default(),
            &[
                ("/p/v1/hosts/b", HOST, 7),
                (
                    "/p/v1/services/b/web",
                    r#"{"balancer":{"kind":"maglev","table_size":65536,"hash_balance_factor":null}}"#,
                    7,
                ),
                (
                    "/p/v1/services/b/api",
                    r#"{"balancer":{"kind":"maglev","table_size":65537,"hash_balance_factor":null}}"#,
                    7,
                ),
            ],
        );
        assert_eq!(skipped["/p/v1/services/b/web"], "spec");
        assert_eq!(
            fleet["b"].services.keys().collect::<Vec<_>>(),
            ["api"],
            "b votes for api's spec only"
        );
    }
}
