//! xDS streams, state of the world and delta, CDS, EDS and ADS: a sequence of requests (known type
//! URLs and garbage; nonces the stream sent, outdated ones and garbage; real service names and
//! garbage; NACKs; `initial_resource_versions`) interleaved with registry changes, through the
//! transport's stream rules (`xds::transport::fuzzing`), as `run_stream` drives them.
//!
//! Checked: nothing panics; only a dedicated stream asked for another type ends (and only then);
//! every response has a nonce of its own on the stream, a type the stream serves and was asked for,
//! and carries resources exactly as the cache has them (state of the world: its type's version, all
//! clusters, only endpoints subscribed; delta: no name twice, none both updated and removed, removed
//! only what is gone, and never an empty response but a first one); on ADS endpoints come only for
//! clusters sent on the stream; the rules are at rest after every step (the same resources again owe
//! nothing); an ACK or NACK of the latest nonce that changes no subscription gets no reply; the synced
//! revision never goes back, never passes the current revision, and does not move while the last
//! endpoints response is not ACKed (so a NACK never advances it); after an ACK of it the stream owes
//! no answer.
#![no_main]

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use envoy_types::pb::{
    envoy::{
        config::{
            cluster::v3::Cluster,
            core::v3::{Locality, Node},
            endpoint::v3::ClusterLoadAssignment,
        },
        service::discovery::v3::{
            DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
        },
    },
    google::{protobuf::Any, rpc::Status as RpcStatus},
};
use libfuzzer_sys::{
    arbitrary::{Result, Unstructured},
    fuzz_target,
};
use peregrine_supervisor::{
    registry::{Address, Protocol, Registry, Stall, Worker},
    xds::{
        cache::{Cache, EdsVia, Resources, TypeResources},
        priorities::Requester,
        resources::{CLUSTER_TYPE_URL, ClusterOptions, ENDPOINT_TYPE_URL},
        stream_kind::StreamKind,
        transport::fuzzing::{DeltaStream, SotwStream},
    },
};
use prost::Message;

const SERVICES: [&str; 3] = ["a", "b", "c"];
const TYPES: [&str; 2] = [CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL];
const MAX_STEPS: usize = 48;

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let _ = run(&mut u);
});

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    let delta = u.arbitrary::<bool>()?;
    let kind = match (delta, u.int_in_range(0..=2)?) {
        (false, 0) => StreamKind::Cds,
        (false, 1) => StreamKind::Eds,
        (false, _) => StreamKind::Ads,
        (true, 0) => StreamKind::DeltaCds,
        (true, 1) => StreamKind::DeltaEds,
        (true, _) => StreamKind::DeltaAds,
    };
    let node = if u.arbitrary()? {
        Some(Node {
            id: "envoy".into(),
            locality: Some(Locality {
                region: "r".into(),
                zone: u.choose(&["z1", "z2"])?.to_string(),
                sub_zone: u.choose(&["h1", "h2", ""])?.to_string(),
            }),
            ..Default::default()
        })
    } else {
        None
    };
    let mut world = World::new();
    let mut model = Model::new(kind);
    if delta {
        let mut stream = DeltaStream::new(kind, node.as_ref());
        drive(u, &mut world, &mut model, &mut stream)
    } else {
        let mut stream = SotwStream::new(kind, node.as_ref());
        drive(u, &mut world, &mut model, &mut stream)
    }
}

/// The registry and the cache that builds resources from it.
struct World {
    registry: Registry,
    cache: Cache,
    resources: Resources,
}

impl World {
    fn new() -> Self {
        let registry = Registry::new(["a".to_string(), "b".to_string()]);
        let mut cache = Cache::new("e1".into(), ClusterOptions::default());
        let resources = cache.build(&registry.snapshot());
        World {
            registry,
            cache,
            resources,
        }
    }

    /// Changes the registry as its writers may; whether anything changed.
    fn change(&mut self, u: &mut Unstructured<'_>) -> Result<bool> {
        let service = *u.choose(&SERVICES)?;
        let index = u.int_in_range(0..=2)?;
        let pid = u.int_in_range(1..=6)?;
        let before = self.registry.snapshot().revision;
        match u.int_in_range(0..=5)? {
            0 | 1 => {
                let protocol = *u.choose(&[Protocol::Http1, Protocol::Http2])?;
                let address = if u.ratio(1, 8)? {
                    Address::Unix(format!("/run/{service}-{index}.sock").into())
                } else {
                    Address::Tcp(([127, 0, 0, 1], u.int_in_range(1..=u16::MAX)?).into())
                };
                let _ = self.registry.register(Worker::ready(
                    service,
                    index,
                    pid,
                    vec![protocol],
                    vec![address],
                ));
            }
            2 => {
                self.registry.deregister(service, index, pid);
            }
            3 => {
                self.registry.drain(service, index, pid);
            }
            4 => {
                let stall = u.arbitrary::<bool>()?.then_some(Stall::Stopped);
                self.registry.set_stalled(service, index, pid, stall);
            }
            _ => {
                let services = SERVICES
                    .iter()
                    .filter(|_| u.arbitrary().unwrap_or(true))
                    .map(|s| s.to_string())
                    .collect::<Vec<_>>();
                self.registry.set_services(services);
            }
        }
        let snapshot = self.registry.snapshot();
        if snapshot.revision == before {
            return Ok(false);
        }
        self.resources = self.cache.build(&snapshot);
        Ok(true)
    }
}

/// What the fuzz target knows of the stream from outside: what it sent and what it was told.
struct Model {
    kind: StreamKind,
    /// Every nonce the stream sent.
    nonces: HashSet<String>,
    /// The nonces in the order sent, for requests that echo one.
    sent: Vec<String>,
    /// The last nonce and version sent per type.
    last: HashMap<&'static str, (String, String)>,
    /// The types the client asked for (a request the stream took).
    asked: HashSet<&'static str>,
    /// State of the world: the endpoint names subscribed.
    sotw_names: BTreeSet<String>,
    /// State of the world ADS: the clusters of the last CDS response.
    sotw_clusters: BTreeSet<String>,
    /// Delta: every endpoint name ever subscribed, and whether a wildcard ever was.
    delta_names: BTreeSet<String>,
    delta_wildcard: bool,
    /// Delta ADS: every cluster the client was ever sent or said it had.
    delta_clusters: BTreeSet<String>,
    /// Whether the last endpoints response was ACKed (`None` before the first).
    eds_acked: Option<bool>,
    /// Responses per type, for delta's first response.
    responses: HashMap<&'static str, usize>,
    synced: Option<u64>,
}

impl Model {
    fn new(kind: StreamKind) -> Self {
        Model {
            kind,
            nonces: HashSet::new(),
            sent: Vec::new(),
            last: HashMap::new(),
            asked: HashSet::new(),
            sotw_names: BTreeSet::new(),
            sotw_clusters: BTreeSet::new(),
            delta_names: BTreeSet::new(),
            delta_wildcard: false,
            delta_clusters: BTreeSet::new(),
            eds_acked: None,
            responses: HashMap::new(),
            synced: None,
        }
    }

    fn dedicated(&self) -> Option<&'static str> {
        match self.kind {
            StreamKind::Cds | StreamKind::DeltaCds => Some(CLUSTER_TYPE_URL),
            StreamKind::Eds | StreamKind::DeltaEds => Some(ENDPOINT_TYPE_URL),
            _ => None,
        }
    }

    fn ads(&self) -> bool {
        self.dedicated().is_none()
    }

    fn via(&self) -> EdsVia {
        match self.kind {
            StreamKind::Ads | StreamKind::DeltaAds => EdsVia::Ads,
            StreamKind::DeltaCds | StreamKind::DeltaEds => EdsVia::DeltaGrpc,
            _ => EdsVia::Grpc,
        }
    }

    /// The type a request for `type_url` is for, as the stream must read it: `Err` where a dedicated
    /// stream must end, `Ok(None)` where ADS ignores it.
    fn requested(&self, type_url: &str) -> std::result::Result<Option<&'static str>, ()> {
        match self.dedicated() {
            Some(expected) if type_url.is_empty() || type_url == expected => Ok(Some(expected)),
            Some(_) => Err(()),
            None => Ok(TYPES.into_iter().find(|t| *t == type_url)),
        }
    }

    fn nonce(&self, u: &mut Unstructured<'_>, type_url: &str) -> Result<String> {
        Ok(match u.int_in_range(0..=5)? {
            0 => String::new(),
            1 | 2 => self
                .last
                .get(type_url)
                .map(|(n, _)| n.clone())
                .unwrap_or_default(),
            3 if !self.sent.is_empty() => u.choose(&self.sent)?.clone(),
            _ => u.arbitrary()?,
        })
    }

    fn version(&self, u: &mut Unstructured<'_>, type_url: &str) -> Result<String> {
        Ok(match u.int_in_range(0..=2)? {
            0 => String::new(),
            1 => self
                .last
                .get(type_url)
                .map(|(_, v)| v.clone())
                .unwrap_or_default(),
            _ => u.arbitrary()?,
        })
    }

    /// Checks responses the stream sent at the world's current resources, and records them.
    fn responses<R: Response>(&mut self, out: &[R], world: &World) {
        let mut types_seen = Vec::new();
        for response in out {
            let nonce = response.nonce();
            assert!(!nonce.is_empty(), "a response without a nonce");
            assert!(
                self.nonces.insert(nonce.to_string()),
                "nonce {nonce} sent twice"
            );
            self.sent.push(nonce.to_string());
            let type_url = TYPES
                .into_iter()
                .find(|t| *t == response.type_url())
                .unwrap_or_else(|| panic!("a response of type {:?}", response.type_url()));
            assert!(
                self.dedicated().is_none_or(|t| t == type_url),
                "{type_url} on {}",
                self.kind
            );
            assert!(
                self.asked.contains(type_url),
                "{type_url} sent, never asked for"
            );
            // The node's locality picks the endpoints a stream is sent only under local-first
            // routing, which this world does not have: every requester gets the default one's.
            let set = world
                .resources
                .get(type_url, self.via(), &Requester::default())
                .expect("a type served");
            response.check(self, &set);
            let first = self.responses.entry(type_url).or_default();
            *first += 1;
            self.last.insert(
                type_url,
                (nonce.to_string(), response.version().to_string()),
            );
            if type_url == ENDPOINT_TYPE_URL {
                self.eds_acked = Some(false);
            }
            types_seen.push(type_url);
        }
        // Clusters before endpoints within one step.
        if let Some(e) = types_seen.iter().position(|t| *t == ENDPOINT_TYPE_URL) {
            assert!(
                !types_seen[e..].contains(&CLUSTER_TYPE_URL),
                "endpoints before clusters"
            );
        }
    }

    /// Checks the synced revision after a step.
    fn synced(&mut self, synced: Option<u64>, world: &World, before_unacked: bool) {
        assert!(
            synced >= self.synced,
            "synced went back: {:?} -> {synced:?}",
            self.synced
        );
        assert!(
            synced <= Some(world.resources.revision),
            "synced past the revision"
        );
        if before_unacked {
            assert_eq!(
                synced, self.synced,
                "synced moved while the last endpoints were not ACKed"
            );
        }
        self.synced = synced;
    }
}

/// What the target needs of a response, on either variant.
trait Response: std::fmt::Debug {
    fn nonce(&self) -> &str;
    fn type_url(&self) -> &str;
    fn version(&self) -> &str;
    /// Checks what it carries against `set`, the resources of its type now; records what the client
    /// has from it.
    fn check(&self, model: &mut Model, set: &TypeResources);
}

fn name_of(any: &Any) -> String {
    match any.type_url.as_str() {
        CLUSTER_TYPE_URL => {
            Cluster::decode(any.value.as_slice())
                .expect("a cluster")
                .name
        }
        ENDPOINT_TYPE_URL => {
            ClusterLoadAssignment::decode(any.value.as_slice())
                .expect("an assignment")
                .cluster_name
        }
        other => panic!("a resource of type {other}"),
    }
}

impl Response for DiscoveryResponse {
    fn nonce(&self) -> &str {
        &self.nonce
    }
    fn type_url(&self) -> &str {
        &self.type_url
    }
    fn version(&self) -> &str {
        &self.version_info
    }
    fn check(&self, model: &mut Model, set: &TypeResources) {
        assert_eq!(self.version_info, set.version, "the type's version");
        let names: Vec<String> = self.resources.iter().map(name_of).collect();
        let unique: BTreeSet<String> = names.iter().cloned().collect();
        assert_eq!(unique.len(), names.len(), "a resource twice: {names:?}");
        for (name, any) in names.iter().zip(&self.resources) {
            let resource = set.resources.get(name).expect("a resource the cache has");
            assert_eq!(&resource.resource, any, "{name} as the cache has it");
        }
        if self.type_url == CLUSTER_TYPE_URL {
            assert_eq!(
                unique,
                set.resources.keys().cloned().collect(),
                "every cluster"
            );
            model.sotw_clusters = unique;
        } else {
            assert!(!names.is_empty(), "an empty endpoints response");
            assert!(
                unique.is_subset(&model.sotw_names),
                "{unique:?} not all subscribed"
            );
            if model.ads() {
                assert!(
                    unique.is_subset(&model.sotw_clusters),
                    "endpoints before their cluster"
                );
            }
        }
    }
}

impl Response for DeltaDiscoveryResponse {
    fn nonce(&self) -> &str {
        &self.nonce
    }
    fn type_url(&self) -> &str {
        &self.type_url
    }
    fn version(&self) -> &str {
        &self.system_version_info
    }
    fn check(&self, model: &mut Model, set: &TypeResources) {
        assert_eq!(self.system_version_info, set.version, "the type's version");
        let mut names = BTreeSet::new();
        for resource in &self.resources {
            assert!(
                names.insert(resource.name.clone()),
                "{} twice",
                resource.name
            );
            let want = set
                .resources
                .get(&resource.name)
                .expect("a resource the cache has");
            assert_eq!(resource.version, want.version);
            assert_eq!(resource.resource.as_ref(), Some(&want.resource));
            assert_eq!(name_of(&want.resource), resource.name);
        }
        let mut removed = BTreeSet::new();
        for name in &self.removed_resources {
            assert!(removed.insert(name.clone()), "{name} removed twice");
            assert!(!names.contains(name), "{name} both updated and removed");
            assert!(
                !set.resources.contains_key(name),
                "{name} removed but exists"
            );
        }
        let type_url = TYPES
            .into_iter()
            .find(|t| *t == self.type_url)
            .expect("a type");
        if model.responses.get(type_url).copied().unwrap_or(0) > 0 {
            assert!(
                !names.is_empty() || !removed.is_empty(),
                "an empty delta response"
            );
        }
        if type_url == CLUSTER_TYPE_URL {
            model.delta_clusters.extend(names);
        } else {
            if !model.delta_wildcard {
                assert!(
                    names.is_subset(&model.delta_names),
                    "{names:?} never subscribed"
                );
            }
            if model.ads() {
                assert!(
                    names.is_subset(&model.delta_clusters),
                    "endpoints {names:?} before their cluster"
                );
            }
        }
    }
}

/// One variant's stream, as the target drives it.
trait Driven {
    /// Whether the stream is state of the world.
    const SOTW: bool;
    type Request;
    type Response: Response;
    fn on_request(
        &mut self,
        request: Self::Request,
        resources: &Resources,
    ) -> std::result::Result<Vec<Self::Response>, tonic::Status>;
    fn on_resources(&mut self, resources: &Resources) -> Vec<Self::Response>;
    fn synced_revision(&self) -> Option<u64>;
    fn awaiting_reply(&self) -> bool;
    /// An arbitrary request and what the target needs to know of it.
    fn request(
        u: &mut Unstructured<'_>,
        model: &Model,
        world: &World,
    ) -> Result<(Self::Request, Sent)>;
    /// Records what a request the stream took said, before its responses are checked; whether it
    /// changed a subscription.
    fn subscribed(model: &mut Model, request: &Sent, type_url: &'static str, stale: bool) -> bool;
}

/// What a request said, in the terms the checks need.
#[derive(Debug)]
struct Sent {
    type_url: String,
    nonce: String,
    nack: bool,
    /// State of the world: the names; delta: the names subscribed.
    names: Vec<String>,
    unsubscribe: Vec<String>,
    initial: Vec<String>,
}

fn names(u: &mut Unstructured<'_>) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for _ in 0..u.int_in_range(0..=3)? {
        names.push(match u.int_in_range(0..=5)? {
            0..=2 => u.choose(&SERVICES)?.to_string(),
            3 => "*".to_string(),
            _ => u.arbitrary()?,
        });
    }
    Ok(names)
}

fn type_url(u: &mut Unstructured<'_>) -> Result<String> {
    Ok(match u.int_in_range(0..=7)? {
        0..=2 => CLUSTER_TYPE_URL.into(),
        3..=5 => ENDPOINT_TYPE_URL.into(),
        6 => String::new(),
        _ => u.arbitrary()?,
    })
}

fn rejection(u: &mut Unstructured<'_>) -> Result<Option<RpcStatus>> {
    Ok(u.ratio(1, 4)?.then(|| RpcStatus {
        code: 3,
        message: "rejected".into(),
        details: vec![],
    }))
}

impl Driven for SotwStream {
    const SOTW: bool = true;
    type Request = DiscoveryRequest;
    type Response = DiscoveryResponse;
    fn on_request(
        &mut self,
        request: DiscoveryRequest,
        resources: &Resources,
    ) -> std::result::Result<Vec<DiscoveryResponse>, tonic::Status> {
        SotwStream::on_request(self, request, resources)
    }
    fn on_resources(&mut self, resources: &Resources) -> Vec<DiscoveryResponse> {
        SotwStream::on_resources(self, resources)
    }
    fn synced_revision(&self) -> Option<u64> {
        SotwStream::synced_revision(self)
    }
    fn awaiting_reply(&self) -> bool {
        SotwStream::awaiting_reply(self)
    }
    fn request(
        u: &mut Unstructured<'_>,
        model: &Model,
        _: &World,
    ) -> Result<(DiscoveryRequest, Sent)> {
        let type_url = type_url(u)?;
        let request = DiscoveryRequest {
            version_info: model.version(u, &type_url)?,
            resource_names: names(u)?,
            type_url: type_url.clone(),
            response_nonce: model.nonce(u, &type_url)?,
            error_detail: rejection(u)?,
            ..Default::default()
        };
        let sent = Sent {
            type_url,
            nonce: request.response_nonce.clone(),
            nack: request.error_detail.is_some(),
            names: request.resource_names.clone(),
            unsubscribe: Vec::new(),
            initial: Vec::new(),
        };
        Ok((request, sent))
    }
    fn subscribed(model: &mut Model, request: &Sent, type_url: &'static str, stale: bool) -> bool {
        if type_url != ENDPOINT_TYPE_URL || stale {
            return false;
        }
        let names: BTreeSet<String> = request.names.iter().cloned().collect();
        let changed = names != model.sotw_names;
        model.sotw_names = names;
        changed
    }
}

impl Driven for DeltaStream {
    const SOTW: bool = false;
    type Request = DeltaDiscoveryRequest;
    type Response = DeltaDiscoveryResponse;
    fn on_request(
        &mut self,
        request: DeltaDiscoveryRequest,
        resources: &Resources,
    ) -> std::result::Result<Vec<DeltaDiscoveryResponse>, tonic::Status> {
        DeltaStream::on_request(self, request, resources)
    }
    fn on_resources(&mut self, resources: &Resources) -> Vec<DeltaDiscoveryResponse> {
        DeltaStream::on_resources(self, resources)
    }
    fn synced_revision(&self) -> Option<u64> {
        DeltaStream::synced_revision(self)
    }
    fn awaiting_reply(&self) -> bool {
        DeltaStream::awaiting_reply(self)
    }
    fn request(
        u: &mut Unstructured<'_>,
        model: &Model,
        world: &World,
    ) -> Result<(DeltaDiscoveryRequest, Sent)> {
        let type_url = type_url(u)?;
        let mut initial = BTreeMap::new();
        for _ in 0..u.int_in_range(0..=2)? {
            let name = names(u)?.pop().unwrap_or_else(|| "a".into());
            let real = TYPES
                .into_iter()
                .find(|t| *t == type_url)
                .and_then(|t| world.resources.get(t, model.via(), &Requester::default()))
                .and_then(|set| set.resources.get(&name).map(|r| r.version.clone()));
            let version = match real {
                Some(version) if u.arbitrary()? => version,
                _ => u.arbitrary()?,
            };
            initial.insert(name, version);
        }
        let request = DeltaDiscoveryRequest {
            type_url: type_url.clone(),
            resource_names_subscribe: names(u)?,
            resource_names_unsubscribe: names(u)?,
            initial_resource_versions: initial.into_iter().collect(),
            response_nonce: model.nonce(u, &type_url)?,
            error_detail: rejection(u)?,
            ..Default::default()
        };
        let sent = Sent {
            type_url,
            nonce: request.response_nonce.clone(),
            nack: request.error_detail.is_some(),
            names: request.resource_names_subscribe.clone(),
            unsubscribe: request.resource_names_unsubscribe.clone(),
            initial: request.initial_resource_versions.keys().cloned().collect(),
        };
        Ok((request, sent))
    }
    fn subscribed(model: &mut Model, request: &Sent, type_url: &'static str, _stale: bool) -> bool {
        // A stale nonce still changes subscriptions on delta streams.
        let first = !model.asked.contains(type_url);
        if type_url == ENDPOINT_TYPE_URL {
            if (first && request.names.is_empty()) || request.names.iter().any(|n| n == "*") {
                model.delta_wildcard = true;
            }
            model.delta_names.extend(request.names.iter().cloned());
        } else if first {
            model.delta_clusters.extend(request.initial.iter().cloned());
        }
        first || !request.names.is_empty() || !request.unsubscribe.is_empty()
    }
}

fn drive<S: Driven>(
    u: &mut Unstructured<'_>,
    world: &mut World,
    model: &mut Model,
    stream: &mut S,
) -> Result<()> {
    for _ in 0..MAX_STEPS {
        if u.is_empty() {
            break;
        }
        let unacked = model.eds_acked == Some(false);
        match u.int_in_range(0..=9)? {
            0..=5 => {
                let (request, sent) = S::request(u, model, world)?;
                let requested = model.requested(&sent.type_url);
                let result = stream.on_request(request, &world.resources);
                let (type_url, out) = match (requested, result) {
                    (Err(()), Err(status)) => {
                        assert_eq!(status.code(), tonic::Code::InvalidArgument);
                        return Ok(());
                    }
                    (Ok(None), Ok(out)) => {
                        assert!(out.is_empty(), "answered a type not served");
                        continue;
                    }
                    (Ok(Some(type_url)), Ok(out)) => (type_url, out),
                    (requested, result) => {
                        panic!(
                            "{:?} on {}: {requested:?}, got {result:?}",
                            sent.type_url, model.kind
                        )
                    }
                };
                let last = model.last.get(type_url).map(|(n, _)| n.clone());
                let latest = last.as_deref().is_some_and(|l| l == sent.nonce);
                let stale =
                    !sent.nonce.is_empty() && last.as_deref().is_some_and(|l| l != sent.nonce);
                let changed = S::subscribed(model, &sent, type_url, stale);
                model.asked.insert(type_url);
                model.responses(&out, world);
                if latest && !changed {
                    assert!(
                        out.is_empty(),
                        "{} of the latest nonce answered: {sent:?}",
                        if sent.nack { "a NACK" } else { "an ACK" }
                    );
                }
                if stale && S::SOTW {
                    assert!(out.is_empty(), "a stale request answered");
                }
                let acked = type_url == ENDPOINT_TYPE_URL && latest && !sent.nack;
                model.synced(stream.synced_revision(), world, unacked && !acked);
                if acked && out.iter().all(|r| r.type_url() != ENDPOINT_TYPE_URL) {
                    model.eds_acked = Some(true);
                    assert!(!stream.awaiting_reply(), "owes an answer after an ACK");
                }
            }
            6..=8 => {
                if world.change(u)? {
                    let out = stream.on_resources(&world.resources);
                    model.responses(&out, world);
                    model.synced(stream.synced_revision(), world, unacked);
                }
            }
            _ => {}
        }
        // At rest: the same resources again owe nothing.
        let again = stream.on_resources(&world.resources);
        assert!(
            again.is_empty(),
            "the same resources answered again: {} responses",
            again.len()
        );
        model.synced(
            stream.synced_revision(),
            world,
            model.eds_acked == Some(false),
        );
    }
    Ok(())
}
