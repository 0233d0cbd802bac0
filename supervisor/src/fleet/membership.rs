//! The etcd session of one supervisor: its lease, its own records under it, and the watch that
//! builds the other hosts' view in the registry.
//!
//! One session is: connect, grant a lease of `lease_ttl`, put this host's records in one transaction,
//! list the fleet's range and watch it from the listing's revision + 1 (no gap, no event twice), then
//! keep the lease alive every third of its TTL, publish every change of the registry's own workers as
//! one put or delete, and apply every watch event to the registry's view of the other hosts.
//!
//! For drains across hosts ([`FleetDrains`]) it records at which etcd revision each registry revision
//! of this host's workers was published and how far every other host has ACKed, and it writes this
//! host's own `acks/<host>`: whenever it sees another host's worker start draining, once every
//! endpoint stream here has ACKed the view with it.
//!
//! Invariant: etcd being away never empties the view: a failed session keeps the last view in the
//! registry (Envoy goes on with the endpoints it has) and a new session replaces it whole once it has
//! listed the range again. A lost lease (this supervisor was paused longer than the TTL, or etcd
//! expired it) is granted anew and every own key put back.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::{Duration, SystemTime},
};

use futures::FutureExt;
use peregrine_etcd::{
    Client, ConnectOptions, EventType, LeaseKeepAliveResponse, LeaseKeeper, delete_op, put_op,
};
use tokio::{sync::watch, time::Instant};
use tonic::Streaming;

use super::{
    backoff::Backoff,
    drains::FleetDrains,
    listing::{self, Listed},
    records::{self, AcksRecord, Identity, KeyKind, Keys, Rules, Stored},
    skipped::SkippedRecords,
    trim::Trimmer,
};
use peregrine_contract::ErrorChain;

use crate::{
    config::ClusterConfig,
    fleet::{EtcdState, FleetStatus, SessionStatus},
    registry::{Fleet, Registry, SpecChoices},
    throttle::Throttle,
    xds::{XdsOptions, acks::Acks, resources::Balancer},
};

/// The longest pause between two sessions while this host holds no lease (while it holds one etcd
/// has not said is gone, the next session comes within a third of its TTL: see [`Membership::run`]).
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// The most watch messages applied as one: a bound on how long the view waits for a burst.
const MAX_BATCHED_MESSAGES: usize = 1000;

/// The largest watch message read: one revision's events come in one message, and a host whose
/// lease expires deletes every key of it at one revision (16,384 workers: about 1.5 MB of keys).
const WATCH_DECODE_LIMIT: usize = 64 * 1024 * 1024;

/// Why a session ended.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// etcd refused or could not be reached.
    #[error("etcd: {0}")]
    Etcd(#[from] peregrine_etcd::Error),
    /// The `[cluster.tls]` files cannot be used (read again for the next session).
    #[error(transparent)]
    Tls(#[from] crate::tls::etcd::EtcdTlsError),
    /// The watch stream ended.
    #[error("the watch of the fleet's keys ended")]
    WatchClosed,
    /// etcd cancelled the watch (for example: its start revision was compacted).
    #[error("etcd cancelled the watch of the fleet's keys: {0}")]
    WatchCanceled(String),
    /// The lease is gone: the keys under it were deleted.
    #[error("the lease expired")]
    LeaseLost,
    /// etcd has not answered a keep-alive for a whole TTL: by now the lease has expired there, or
    /// etcd is out of reach.
    #[error("no keep-alive answered for {0:?}")]
    KeepAliveSilent(Duration),
}

/// The lease this host's keys are under, as this supervisor last heard of it: a new session (after
/// an error) takes it up again while etcd says it lives, so the keys never leave the fleet for a
/// session that broke and came back within the TTL.
///
/// It is asked about even after `expires` has passed: when etcd loses its quorum, the leader elected
/// once it is back extends every lease by its TTL, so a lease outlives this supervisor's reckoning by
/// however long the quorum was lost. Only etcd's answer (or a lease this supervisor revoked) ends it.
#[derive(Clone, Copy, Debug)]
struct HeldLease {
    /// The lease.
    id: i64,
    /// When it expires unless kept alive, by the last keep-alive answer.
    expires: Instant,
}

/// This host's records as last published.
#[derive(Debug, Default)]
struct Published {
    /// Key -> value.
    records: BTreeMap<String, String>,
    /// The etcd revision of the last write.
    revision: i64,
}

/// What the task and the drains share with it: the streams' ACKs it reports, the drains it informs.
#[derive(Clone, Debug)]
pub struct Shared {
    /// This host's Envoys' ACKs.
    pub acks: Arc<Acks>,
    /// What drains here wait on.
    pub drains: Arc<FleetDrains>,
    /// Where the session is, for `status` and the metrics.
    pub status: Arc<SessionStatus>,
}

/// The membership task of one supervisor.
#[derive(Debug)]
pub struct Membership {
    cluster: ClusterConfig,
    grpc_port: u16,
    registry: Arc<Registry>,
    options: watch::Receiver<XdsOptions>,
    /// This host's Envoys' ACKs: what this host's acks record says.
    acks: Arc<Acks>,
    /// What drains here wait on.
    drains: Arc<FleetDrains>,
    /// Where the session is: this task's to write.
    status: Arc<SessionStatus>,
    /// Rate-limits the error about hosts on another gRPC port.
    port_conflict: Throttle,
    /// The lease of this host's keys, across sessions.
    lease: Option<HeldLease>,
    /// Which of the etcd endpoints the next session talks to (modulo their count).
    endpoint: usize,
    /// Whether the last session joined the fleet (listed the range and watched it).
    joined: bool,
    /// What other hosts' records are held to.
    rules: Rules,
    /// The records skipped, each logged once.
    skipped: SkippedRecords,
    /// Gives memory back after the view shrinks.
    trimmer: Trimmer,
    /// The fleet's choice of each service's spec, across changes of the view.
    specs: SpecChoices,
}

impl Membership {
    /// The task for `cluster`, on a supervisor serving gRPC on `grpc_port`: it publishes the
    /// registry's own workers (with their weights from `options`) and writes the other hosts into it;
    /// `shared` is what it reports for drains across hosts.
    pub fn new(
        cluster: ClusterConfig,
        grpc_port: u16,
        registry: Arc<Registry>,
        options: watch::Receiver<XdsOptions>,
        shared: Shared,
    ) -> Membership {
        let cluster_host = cluster.host.clone();
        let rules = Rules {
            allowed_networks: cluster.allowed_networks.clone(),
        };
        Membership {
            cluster,
            grpc_port,
            registry,
            options,
            acks: shared.acks,
            drains: shared.drains,
            status: shared.status,
            port_conflict: Throttle::new(Duration::from_secs(60)),
            lease: None,
            // Hosts start on different members, so that a fleet spreads over its etcd cluster.
            endpoint: spread(&cluster_host),
            joined: false,
            rules,
            skipped: SkippedRecords::default(),
            trimmer: Trimmer::default(),
            specs: SpecChoices::default(),
        }
    }

    /// Runs sessions until `stop` turns true.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let keys = Keys::new(&self.cluster.prefix);
        let me = Identity {
            host: self.cluster.host.clone(),
            locality: self.cluster.locality.clone(),
            grpc_port: self.grpc_port,
        };
        let unavailable = Throttle::new(Duration::from_secs(10));
        let mut backoff = Backoff::new(spread(&me.host) as u64);
        self.status.set(FleetStatus {
            host: me.host.clone(),
            etcd: EtcdState::Connecting,
            since: SystemTime::now(),
            lease: None,
            conflicts: Vec::new(),
            skipped: self.skipped.counts(),
        });
        loop {
            let ended = self.session(&keys, &me, &mut stop).await;
            self.drains.set_connected(false);
            if std::mem::take(&mut self.joined) {
                backoff.reset();
            }
            if ended.is_err() {
                // The next session tries the next member: one that died or was cut off is left
                // at once instead of being dialed again.
                self.endpoint = self.endpoint.wrapping_add(1);
            }
            match ended {
                Ok(()) => return,
                Err(SessionError::LeaseLost) => {
                    tracing::warn!(host = %me.host, "The fleet lease expired: putting this host's keys back under a new one");
                    backoff.reset();
                    continue;
                }
                Err(error) => {
                    let previous = self.status.get();
                    let since = match &previous {
                        Some(status) if matches!(status.etcd, EtcdState::Unavailable { .. }) => {
                            status.since
                        }
                        _ => SystemTime::now(),
                    };
                    self.status.set(FleetStatus {
                        host: me.host.clone(),
                        etcd: EtcdState::Unavailable {
                            error: ErrorChain(&error).to_string(),
                        },
                        since,
                        lease: previous.as_ref().and_then(|s| s.lease),
                        conflicts: previous.map(|s| s.conflicts).unwrap_or_default(),
                        skipped: self.skipped.counts(),
                    });
                    if let Some(suppressed) = unavailable.allow() {
                        tracing::warn!(error = %ErrorChain(&error), suppressed, etcd = ?self.cluster.etcd, "etcd unavailable: serving the last fleet view");
                    }
                }
            }
            // While this host holds a lease etcd has not said is gone, never longer than a third of
            // its TTL: a session that broke must come back while its lease lives, or this host's
            // workers leave every other host's view (each session renews the lease before it lists
            // anything). That holds past the lease's expiry as reckoned here: after a lost quorum
            // etcd extends every lease by its TTL from the moment a leader is back (see
            // `HeldLease`). Without a lease there is nothing to keep, and the pauses grow to
            // MAX_BACKOFF: sessions that keep failing (etcd overloaded, a member refusing) are not
            // repeated every second. A listing no longer fails for what the range holds: it is
            // paged, and an oversized record is skipped.
            let cap = match self.lease {
                Some(_) => (self.cluster.lease_ttl / 3).min(MAX_BACKOFF),
                None => MAX_BACKOFF,
            };
            tokio::select! {
                () = tokio::time::sleep(backoff.next(cap)) => {}
                () = stopped(&mut stop) => return,
            }
        }
    }

    /// One session, until it fails or `stop` turns true (then the lease is revoked, so that the other
    /// hosts drop this one at once instead of after its TTL).
    async fn session(
        &mut self,
        keys: &Keys,
        me: &Identity,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<(), SessionError> {
        if *stop.borrow() {
            return Ok(());
        }
        let ttl = self.cluster.lease_ttl;
        // HTTP/2 pings find a member that went away (a cut link sends no reset) within the TTL.
        let mut options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(1))
            .with_timeout(ttl)
            .with_keep_alive(ttl / 3, ttl / 3)
            .with_keep_alive_while_idle(true);
        // Read for every session: certificates rotated on disk are used from the next one on.
        if let Some(tls) = &self.cluster.tls {
            options = options.with_tls(crate::tls::etcd::options(tls)?);
        }
        // One member per session: every member serves every request (followers hand writes to the
        // leader), and a session bound to one member fails as a whole when that member does, so
        // the next one moves on; a client balancing over every member would go on sending some
        // requests to a dead one.
        let endpoint = &self.cluster.etcd[self.endpoint % self.cluster.etcd.len()];
        let client = Client::connect([endpoint], Some(options)).await?;
        // Subscribed before the first publish, so that a worker registering meanwhile is published
        // by the loop below rather than missed.
        let mut snapshots = self.registry.subscribe();
        let (lease, mut keeper, mut alive) = self.take_lease(&client, ttl).await?;
        let mut last_alive = Instant::now();
        let mut published = Published::default();
        self.publish(&client, keys, me, lease, &mut published)
            .await?;
        let mut range: BTreeMap<String, Stored> = BTreeMap::new();
        let revision = listing::list_prefix(&client, keys.root(), |listed| {
            let (kv, stored) = match listed {
                Listed::Record(kv) => (kv, Stored::new(&kv.value, kv.lease, kv.mod_revision)),
                Listed::Unreadable(kv) => (kv, Stored::unreadable(kv.lease, kv.mod_revision)),
            };
            // Only the layout's keys are kept: nothing else is read.
            if let Ok(key) = std::str::from_utf8(&kv.key)
                && keys.kind(key).is_some()
            {
                range.insert(key.to_owned(), stored);
            }
        })
        .await?;
        let mut fleet = Fleet::new();
        self.apply(keys, me, &range, &mut fleet, None);
        self.drains.set_connected(true);
        self.report_hosts(keys, me, &range, &fleet);
        // Whoever waits on this host's acks gets them once for the view just listed.
        let mut ack_due = Some((self.registry.snapshot().revision, revision));
        // One revision's events come in one message (a host whose lease expires: one delete per
        // key); the limit is far above any of ordinary size. A message over it ends the session, and
        // the next one lists the range again, in pages.
        let (_watcher, mut watch) = client
            .watch_prefix(keys.root().as_bytes(), revision + 1, WATCH_DECODE_LIMIT)
            .await?;
        self.status.set(FleetStatus {
            host: me.host.clone(),
            etcd: EtcdState::Connected,
            since: SystemTime::now(),
            lease: Some(lease),
            conflicts: self.status.get().map(|s| s.conflicts).unwrap_or_default(),
            skipped: self.skipped.counts(),
        });
        self.joined = true;
        tracing::info!(host = %me.host, lease, revision, hosts = self.registry.snapshot().fleet.len(), "Joined the fleet");
        let mut renew = tokio::time::interval(ttl / 3);
        let mut options_open = true;
        loop {
            let (due_registry, due_etcd) = ack_due.unwrap_or_default();
            tokio::select! {
                _ = renew.tick() => {
                    if last_alive.elapsed() >= ttl {
                        return Err(SessionError::KeepAliveSilent(last_alive.elapsed()));
                    }
                    keeper.keep_alive().await?;
                }
                synced = self.acks.wait_synced(due_registry, ttl), if ack_due.is_some() => {
                    if synced.is_synced() {
                        let value = serde_json::to_string(&AcksRecord { revision: due_etcd })
                            .expect("an acks record serializes");
                        client.put(keys.acks(&me.host), value, lease).await?;
                        tracing::debug!(revision = due_etcd, streams = synced.synced, "Acked the fleet's view");
                        ack_due = None;
                    }
                },
                answer = alive.message() => match answer.map_err(peregrine_etcd::Error::from)? {
                    Some(answer) if answer.ttl > 0 => {
                        last_alive = Instant::now();
                        self.held(lease, answer.ttl);
                    }
                    _ => {
                        self.lease = None;
                        return Err(SessionError::LeaseLost);
                    }
                },
                changed = snapshots.changed() => {
                    if changed.is_err() {
                        return Ok(());
                    }
                    self.publish(&client, keys, me, lease, &mut published).await?;
                }
                changed = self.options.changed(), if options_open => {
                    if changed.is_err() {
                        // No reload comes any more (the supervisor is stopping): the weights stay
                        // as they are, and the session goes on until the drains are done.
                        options_open = false;
                        continue;
                    }
                    self.publish(&client, keys, me, lease, &mut published).await?;
                }
                () = stopped(stop) => {
                    self.lease = None;
                    let _ = client.lease_revoke(lease).await;
                    tracing::info!(host = %me.host, "Left the fleet");
                    return Ok(());
                }
                message = watch.message() => {
                    let mut message = message.map_err(peregrine_etcd::Error::from)?;
                    let mut ours_gone = false;
                    // The hosts whose records (not only acks) the batch touched, and the newest
                    // revision of another host's drain in it.
                    let mut touched = BTreeSet::new();
                    let mut drain_at = None;
                    // Every message already received joins the first: a burst of writes (a host
                    // putting thousands of workers) is applied once, not once per revision.
                    for batched in 1.. {
                    let Some(response) = message else {
                        return Err(SessionError::WatchClosed);
                    };
                    if response.canceled {
                        return Err(SessionError::WatchCanceled(response.cancel_reason));
                    }
                    for event in &response.events {
                        let Some(kv) = &event.kv else { continue };
                        let Ok(key) = std::str::from_utf8(&kv.key) else { continue };
                        let kind = keys.kind(key);
                        if kind.is_none() {
                            continue;
                        }
                        match kind {
                            Some(
                                KeyKind::Host(host)
                                | KeyKind::Worker { host, .. }
                                | KeyKind::Service { host, .. },
                            ) if host != me.host => {
                                touched.insert(host.to_owned());
                            }
                            _ => {}
                        }
                        match event.r#type() {
                            EventType::Put => {
                                let stored = Stored::new(&kv.value, kv.lease, kv.mod_revision);
                                if let Ok(value) = stored.text()
                                    && records::is_remote_drain(keys, &me.host, key, value)
                                {
                                    drain_at = drain_at.max(Some(kv.mod_revision));
                                }
                                range.insert(key.to_owned(), stored);
                            }
                            EventType::Delete => {
                                range.remove(key);
                                ours_gone |= published.records.contains_key(key);
                            }
                        }
                    }
                    match watch.message().now_or_never() {
                        Some(next) if batched < MAX_BATCHED_MESSAGES => {
                            message = next.map_err(peregrine_etcd::Error::from)?;
                        }
                        _ => break,
                    }
                    }
                    if ours_gone {
                        // Only the lease's expiry deletes our keys (we delete our own only after
                        // forgetting them): the lease is gone.
                        return Err(SessionError::LeaseLost);
                    }
                    if !touched.is_empty() {
                        self.apply(keys, me, &range, &mut fleet, Some(&touched));
                    }
                    self.report_hosts(keys, me, &range, &fleet);
                    if let Some(at) = drain_at {
                        // Acked once every stream here has the view with the drain.
                        ack_due = Some((self.registry.snapshot().revision, at));
                    }
                }
            }
        }
    }

    /// The lease for a new session: the one held before, if etcd says it still lives (its keys are
    /// still there), else a new one. Returns it with its keep-alive stream.
    async fn take_lease(
        &mut self,
        client: &Client,
        ttl: Duration,
    ) -> Result<(i64, LeaseKeeper, Streaming<LeaseKeepAliveResponse>), SessionError> {
        if let Some(held) = self.lease {
            // Past its expiry as reckoned here, etcd may still hold it (a quorum came back): ask,
            // and wait as long as a keep-alive may take.
            let left = held
                .expires
                .saturating_duration_since(Instant::now())
                .max(ttl / 3);
            let asked = async {
                // Opening the stream renews the lease once; its answer says whether it lives.
                let (keeper, mut alive) = client.lease_keep_alive(held.id).await?;
                let answer = alive.message().await?;
                Ok::<_, peregrine_etcd::Error>((keeper, alive, answer))
            };
            match tokio::time::timeout(left, asked).await {
                Ok(Ok((keeper, alive, Some(answer)))) if answer.ttl > 0 => {
                    tracing::info!(
                        lease = held.id,
                        "Kept the fleet lease across a new session with etcd"
                    );
                    self.held(held.id, answer.ttl);
                    return Ok((held.id, keeper, alive));
                }
                // etcd says it is gone, and with it this host's keys: an answer of no TTL, or
                // the error etcd's client makes of it.
                Ok(Ok((_, _, Some(_)))) => self.lease = None,
                Ok(Err(error)) if lease_not_found(&error) => self.lease = None,
                // No answer: it may live yet, and the next session asks again if no new one is
                // granted now.
                Ok(Ok((_, _, None))) | Ok(Err(_)) | Err(_) => {}
            }
        }
        let id = client.lease_grant(ttl.as_secs() as i64).await?;
        let (keeper, alive) = client.lease_keep_alive(id).await?;
        self.lease = Some(HeldLease {
            id,
            expires: Instant::now() + ttl,
        });
        Ok((id, keeper, alive))
    }

    /// etcd said lease `id` lives for `ttl_secs` more.
    fn held(&mut self, id: i64, ttl_secs: i64) {
        let ttl = Duration::from_secs(u64::try_from(ttl_secs).unwrap_or(0));
        self.lease = Some(HeldLease {
            id,
            expires: Instant::now() + ttl,
        });
    }

    /// Puts what changed of this host's records and deletes what went, in one transaction.
    async fn publish(
        &self,
        client: &Client,
        keys: &Keys,
        me: &Identity,
        lease: i64,
        published: &mut Published,
    ) -> Result<(), SessionError> {
        let snapshot = self.registry.snapshot();
        let wanted = {
            let options = self.options.borrow();
            let specs = records::Specs {
                balancers: &options.balancers,
                weights: &options.weights,
            };
            records::own_records(keys, me, &snapshot, specs)
        };
        let mut ops = Vec::new();
        for (key, value) in &wanted {
            if published.records.get(key) != Some(value) {
                ops.push(put_op(key.as_str(), value.as_str(), lease));
            }
        }
        let gone: Vec<String> = published
            .records
            .keys()
            .filter(|key| !wanted.contains_key(*key))
            .cloned()
            .collect();
        for key in &gone {
            ops.push(delete_op(key.as_str()));
        }
        if !ops.is_empty() {
            // Forgotten before the delete is sent, so that its watch event is not taken for the
            // lease's expiry.
            for key in &gone {
                published.records.remove(key);
            }
            let done = client.txn(ops).await?;
            published.records = wanted;
            published.revision = done.header.map_or(published.revision, |h| h.revision);
        }
        self.drains
            .set_published(snapshot.revision, published.revision);
        Ok(())
    }

    /// Says which services hosts disagree on the spec of, and whose spec is served (every host picks
    /// the same: see [`choose_specs`]): in the log when that changes, and in `status`.
    fn report_conflicts(&mut self, me: &Identity, fleet: &Fleet) {
        let own = {
            let options = self.options.borrow();
            self.registry
                .snapshot()
                .services
                .keys()
                .map(|s| {
                    let balancer = options.balancers.get(s).copied();
                    (s.clone(), balancer.unwrap_or(Balancer::RoundRobin))
                })
                .collect()
        };
        let conflicts: Vec<String> = self
            .specs
            .choose(&me.host, &own, fleet)
            .iter()
            .filter(|(_, choice)| !choice.disagreeing.is_empty())
            .map(|(service, choice)| {
                format!(
                    "service {service}: {} configured otherwise; every host serves {}'s spec",
                    choice.disagreeing.join(", "),
                    choice.from
                )
            })
            .collect();
        self.status.update(|status| {
            if status.conflicts != conflicts {
                for conflict in &conflicts {
                    tracing::warn!(%conflict, "Hosts of the fleet disagree on a service's spec");
                }
                status.conflicts = conflicts;
            }
        });
    }

    /// Tells the drains which other hosts are live (have a host record) and how far each acked.
    fn report_hosts(
        &self,
        keys: &Keys,
        me: &Identity,
        range: &BTreeMap<String, Stored>,
        fleet: &Fleet,
    ) {
        let hosts = fleet
            .keys()
            .filter(|host| range.contains_key(&keys.host(host)))
            .map(|host| {
                let key = keys.acks(host);
                let acked = range
                    .get_key_value(&key)
                    .and_then(|(k, v)| Some((k.as_str(), v.text().ok()?)));
                let revision = records::acks_from(keys, &me.host, acked).remove(host);
                (host.clone(), revision)
            })
            .collect();
        self.drains.set_hosts(hosts);
    }

    /// Brings the view of the other hosts up to date with `range`: the hosts `touched` (every host
    /// when `None`) are read again from their records, the others are as they were; the registry
    /// gets the whole view.
    fn apply(
        &mut self,
        keys: &Keys,
        me: &Identity,
        range: &BTreeMap<String, Stored>,
        fleet: &mut Fleet,
        touched: Option<&BTreeSet<String>>,
    ) {
        let skipped = match touched {
            None => {
                let (all, skipped) =
                    records::fleet_from(keys, &me.host, &self.rules, range.iter().map(as_stored));
                *fleet = all;
                skipped
            }
            Some(hosts) => {
                let mut skipped = Vec::new();
                for host in hosts {
                    let own = keys
                        .host_prefixes(host)
                        .into_iter()
                        .flat_map(|prefix| {
                            range
                                .range(prefix.clone()..)
                                .take_while(move |(k, _)| k.starts_with(&prefix))
                        })
                        // `hosts/b` is a prefix of `hosts/bc` too.
                        .filter(|(k, _)| records::host_of(keys, k) == Some(host))
                        .map(as_stored);
                    let (mut one, mut bad) = records::fleet_from(keys, &me.host, &self.rules, own);
                    skipped.append(&mut bad);
                    match one.remove(host) {
                        // A host read again as it was keeps its shared copy.
                        Some(remote) if fleet.get(host) == Some(&remote) => {}
                        Some(remote) => {
                            fleet.insert(host.clone(), remote);
                        }
                        None => {
                            fleet.remove(host);
                        }
                    }
                }
                skipped
            }
        };
        // Each bad record is logged once, when it appears or changes: the hosts touched are read
        // again whole at every change of theirs.
        let now = skipped
            .into_iter()
            .map(|(key, error)| {
                let revision = range.get(&key).map_or(0, |stored| stored.revision);
                (key, revision, error)
            })
            .collect();
        let fresh = match touched {
            None => self.skipped.update(|_| true, now),
            Some(hosts) => self.skipped.update(
                |key| records::host_of(keys, key).is_some_and(|host| hosts.contains(host)),
                now,
            ),
        };
        for (key, error) in fresh {
            tracing::warn!(key, %error, "Skipping a fleet record");
        }
        let counts = self.skipped.counts();
        self.status.update(|status| status.skipped = counts);
        let fleet = &*fleet;
        // Envoy opens every worker's ORCA stream to the worker's IP on the cluster's one ORCA port:
        // a host whose supervisor listens elsewhere gets no load reports from another host's Envoy.
        let orca = self
            .options
            .borrow()
            .balancers
            .values()
            .any(|b| matches!(b, Balancer::Orca(_)));
        for (host, remote) in fleet {
            if orca
                && remote.grpc_port != 0
                && remote.grpc_port != me.grpc_port
                && let Some(suppressed) = self.port_conflict.allow()
            {
                tracing::error!(
                    host,
                    port = remote.grpc_port,
                    ours = me.grpc_port,
                    suppressed,
                    "A host of the fleet serves gRPC on another port: Envoy sends ORCA streams to one \
                     port per cluster, so its workers get no load reports from this host's Envoys; \
                     give every supervisor the same supervisor.bind port"
                );
            }
        }
        self.report_conflicts(me, fleet);
        let hosts = fleet.len();
        let workers: usize = fleet.values().map(|h| h.workers.len()).sum();
        if self.registry.set_fleet(fleet.clone()) {
            tracing::debug!(hosts, workers, "Fleet view changed");
        }
        self.trimmer.observe(workers);
    }
}

/// A start among the etcd endpoints that differs from host to host.
fn spread(host: &str) -> usize {
    host.bytes().fold(0usize, |h, b| {
        h.wrapping_mul(31).wrapping_add(usize::from(b))
    })
}

/// A key of the range and its record, borrowed.
fn as_stored<'a>((key, stored): (&'a String, &'a Stored)) -> (&'a str, &'a Stored) {
    (key, stored)
}

/// Resolves once `stop` is true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

/// Whether `error` is etcd saying a lease does not exist (any more).
fn lease_not_found(error: &peregrine_etcd::Error) -> bool {
    matches!(error, peregrine_etcd::Error::Status(status) if status.code() == tonic::Code::NotFound)
}
