//! The transport's scenarios, written once and replayed on every variant of the protocol they hold
//! for: the table at the bottom ([`scenarios!`]) names each scenario and its variants, and each pair
//! becomes a test `<scenario>::<variant>`.
//!
//! A scenario drives a stream's pure state ([`Stream`]) step by step through [`Variant`], which
//! knows how each variant spells a subscription, an ACK or a NACK and how to read a response. Where
//! the variants differ on purpose (state of the world resends every cluster, delta only what
//! changed), the scenario says so with [`sent`].
//!
//! Invariant: a scenario asserts only what is true of every variant it is listed for; rules of one
//! variant alone are tested in that variant's module.

use envoy_types::pb::{
    envoy::{
        config::{cluster::v3::Cluster, endpoint::v3::ClusterLoadAssignment},
        service::discovery::v3::{
            DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
        },
    },
    google::rpc::Status as RpcStatus,
};
use prost::Message;

use super::{Requester, Stream, StreamKind, StreamRules, delta::DeltaWatch, sotw::TypeWatch};
use crate::{
    registry::{Address, Protocol, Registry, Worker},
    xds::{
        cache::{Cache, Resources, TypeResources},
        resources::{CLUSTER_TYPE_URL, ClusterOptions, ENDPOINT_TYPE_URL},
    },
};

/// A registry with services `a` and `b` and a cache building resources from it.
pub(super) struct Fixture {
    pub(super) registry: Registry,
    cache: Cache,
}

impl Fixture {
    pub(super) fn new() -> Self {
        Fixture {
            registry: Registry::new(["a".to_string(), "b".to_string()]),
            cache: Cache::new("e1".into(), ClusterOptions::default()),
        }
    }

    /// Registers a worker and returns the resources of the new revision.
    pub(super) fn register(&mut self, service: &str, index: u32, pid: u32) -> Resources {
        self.register_speaking(service, index, pid, Protocol::Http1)
    }

    /// Registers an HTTP/2-only worker: changes the service's cluster as well as its endpoints.
    pub(super) fn register_h2(&mut self, service: &str, index: u32, pid: u32) -> Resources {
        self.register_speaking(service, index, pid, Protocol::Http2)
    }

    fn register_speaking(
        &mut self,
        service: &str,
        index: u32,
        pid: u32,
        protocol: Protocol,
    ) -> Resources {
        let addr = Address::Tcp(([127, 0, 0, 1], 8000 + index as u16).into());
        let worker = Worker::ready(service, index, pid, vec![protocol], vec![addr]);
        self.registry.register(worker).unwrap();
        self.resources()
    }

    pub(super) fn resources(&mut self) -> Resources {
        self.cache.build(&self.registry.snapshot())
    }
}

/// The rejection every NACK carries.
pub(super) fn rejection() -> RpcStatus {
    RpcStatus {
        code: 3,
        message: "rejected".into(),
        details: vec![],
    }
}

/// One variant of the protocol as the scenarios drive it: `Self` is what a stream of the variant
/// knows about one resource type.
pub(super) trait Variant: Sized {
    type Request;
    type Response;

    /// Whether every CDS response carries every cluster (EDS responses carry what changed on both).
    const STATE_OF_THE_WORLD: bool;
    /// The dedicated CDS, dedicated EDS and ADS kinds of the variant.
    const KINDS: [StreamKind; 3];

    fn on_request(
        state: &mut Stream<Self>,
        request: Self::Request,
        resources: &Resources,
    ) -> Vec<Self::Response>;
    fn on_resources(state: &mut Stream<Self>, resources: &Resources) -> Vec<Self::Response>;

    /// A first request for `type_url` naming `names`.
    fn subscribe(type_url: &str, names: &[&str]) -> Self::Request;
    /// The request that ACKs `response`, still subscribed to `names` (state of the world repeats
    /// them; delta requests carry only changes).
    fn ack(response: &Self::Response, names: &[&str]) -> Self::Request;
    /// The request that NACKs `response`, still subscribed to `names`.
    fn nack(response: &Self::Response, names: &[&str]) -> Self::Request;

    fn type_url(response: &Self::Response) -> &str;
    /// The type version a response carries.
    fn version(response: &Self::Response) -> &str;
    /// The names of the resources a response carries, in order.
    fn names(response: &Self::Response) -> Vec<String>;
    /// The names a response says are gone.
    fn removed(response: &Self::Response) -> Vec<String>;
    /// Whether `response` carries resource `name` as `set` has it.
    fn carries(response: &Self::Response, set: &TypeResources, name: &str) -> bool;
}

/// What a CDS response carries on variant `W` when `all` exist and `changed` changed (state of the
/// world sends every cluster).
fn sent<W: Variant>(all: &'static [&'static str], changed: &'static [&'static str]) -> Vec<String> {
    let names = if W::STATE_OF_THE_WORLD { all } else { changed };
    names.iter().map(|n| n.to_string()).collect()
}

fn kind<W: Variant>(type_url: Option<&str>) -> StreamKind {
    let [cds, eds, ads] = W::KINDS;
    match type_url {
        Some(CLUSTER_TYPE_URL) => cds,
        Some(_) => eds,
        None => ads,
    }
}

fn types<W: Variant>(out: &[W::Response]) -> Vec<&str> {
    out.iter().map(W::type_url).collect()
}

// === impl Variant for TypeWatch ===

impl Variant for TypeWatch {
    type Request = DiscoveryRequest;
    type Response = DiscoveryResponse;

    const STATE_OF_THE_WORLD: bool = true;
    const KINDS: [StreamKind; 3] = [StreamKind::Cds, StreamKind::Eds, StreamKind::Ads];

    fn on_request(
        state: &mut Stream<Self>,
        request: DiscoveryRequest,
        resources: &Resources,
    ) -> Vec<DiscoveryResponse> {
        state.on_request(request, resources).unwrap()
    }

    fn on_resources(state: &mut Stream<Self>, resources: &Resources) -> Vec<DiscoveryResponse> {
        state.on_resources(resources)
    }

    fn subscribe(type_url: &str, names: &[&str]) -> DiscoveryRequest {
        DiscoveryRequest {
            type_url: type_url.into(),
            resource_names: names.iter().map(|n| n.to_string()).collect(),
            ..Default::default()
        }
    }

    fn ack(response: &DiscoveryResponse, names: &[&str]) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: response.version_info.clone(),
            response_nonce: response.nonce.clone(),
            ..Self::subscribe(&response.type_url, names)
        }
    }

    /// Keeps the version accepted before, as Envoy does.
    fn nack(response: &DiscoveryResponse, names: &[&str]) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: String::new(),
            error_detail: Some(rejection()),
            ..Self::ack(response, names)
        }
    }

    fn type_url(response: &DiscoveryResponse) -> &str {
        &response.type_url
    }

    fn version(response: &DiscoveryResponse) -> &str {
        &response.version_info
    }

    fn names(response: &DiscoveryResponse) -> Vec<String> {
        response
            .resources
            .iter()
            .map(|any| match any.type_url.as_str() {
                CLUSTER_TYPE_URL => Cluster::decode(any.value.as_slice()).unwrap().name,
                ENDPOINT_TYPE_URL => {
                    ClusterLoadAssignment::decode(any.value.as_slice())
                        .unwrap()
                        .cluster_name
                }
                other => panic!("unexpected type {other}"),
            })
            .collect()
    }

    fn removed(_: &DiscoveryResponse) -> Vec<String> {
        Vec::new()
    }

    fn carries(response: &DiscoveryResponse, set: &TypeResources, name: &str) -> bool {
        response.resources.contains(&set.resources[name].resource)
    }
}

// === impl Variant for DeltaWatch ===

impl Variant for DeltaWatch {
    type Request = DeltaDiscoveryRequest;
    type Response = DeltaDiscoveryResponse;

    const STATE_OF_THE_WORLD: bool = false;
    const KINDS: [StreamKind; 3] = [
        StreamKind::DeltaCds,
        StreamKind::DeltaEds,
        StreamKind::DeltaAds,
    ];

    fn on_request(
        state: &mut Stream<Self>,
        request: DeltaDiscoveryRequest,
        resources: &Resources,
    ) -> Vec<DeltaDiscoveryResponse> {
        state.on_request(request, resources).unwrap()
    }

    fn on_resources(
        state: &mut Stream<Self>,
        resources: &Resources,
    ) -> Vec<DeltaDiscoveryResponse> {
        state.on_resources(resources)
    }

    fn subscribe(type_url: &str, names: &[&str]) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            type_url: type_url.into(),
            resource_names_subscribe: names.iter().map(|n| n.to_string()).collect(),
            ..Default::default()
        }
    }

    fn ack(response: &DeltaDiscoveryResponse, _: &[&str]) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            type_url: response.type_url.clone(),
            response_nonce: response.nonce.clone(),
            ..Default::default()
        }
    }

    fn nack(response: &DeltaDiscoveryResponse, names: &[&str]) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            error_detail: Some(rejection()),
            ..Self::ack(response, names)
        }
    }

    fn type_url(response: &DeltaDiscoveryResponse) -> &str {
        &response.type_url
    }

    fn version(response: &DeltaDiscoveryResponse) -> &str {
        &response.system_version_info
    }

    fn names(response: &DeltaDiscoveryResponse) -> Vec<String> {
        response.resources.iter().map(|r| r.name.clone()).collect()
    }

    fn removed(response: &DeltaDiscoveryResponse) -> Vec<String> {
        response.removed_resources.clone()
    }

    fn carries(response: &DeltaDiscoveryResponse, set: &TypeResources, name: &str) -> bool {
        let want = &set.resources[name];
        response.resources.iter().any(|r| {
            r.name == name
                && r.version == want.version
                && r.resource.as_ref() == Some(&want.resource)
        })
    }
}

// === the scenarios ===

/// A dedicated EDS stream subscribed to `a`, whose first response (at revision 1) was ACKed.
pub(super) fn eds_synced_at_one<W: Variant>(fixture: &mut Fixture) -> Stream<W> {
    let r1 = fixture.register("a", 0, 10);
    assert_eq!(r1.revision, 1);
    let mut state = Stream::<W>::new(
        kind::<W>(Some(ENDPOINT_TYPE_URL)),
        "envoy".into(),
        Requester::default(),
    );
    let out = W::on_request(&mut state, W::subscribe(ENDPOINT_TYPE_URL, &["a"]), &r1);
    assert_eq!(out.len(), 1);
    assert_eq!(W::names(&out[0]), ["a"]);
    assert!(W::carries(&out[0], &r1.endpoints, "a"));
    assert!(state.serves_endpoints());
    assert_eq!(state.synced_revision(), None, "owed until ACKed");
    assert!(W::on_request(&mut state, W::ack(&out[0], &["a"]), &r1).is_empty());
    assert_eq!(state.synced_revision(), Some(1));
    state
}

fn an_ack_gets_no_reply_and_advances_the_synced_revision<W: Variant>() {
    let mut fixture = Fixture::new();
    let mut state = eds_synced_at_one::<W>(&mut fixture);
    let r2 = fixture.register("a", 1, 11);
    let out = W::on_resources(&mut state, &r2);
    assert_eq!(out.len(), 1);
    assert_eq!(state.synced_revision(), Some(1), "not past 1 until ACKed");
    assert!(W::on_request(&mut state, W::ack(&out[0], &["a"]), &r2).is_empty());
    assert_eq!(state.synced_revision(), Some(2));
}

fn a_stream_owes_an_answer_until_it_acks_or_nacks_the_last_endpoints_response<W: Variant>() {
    let mut fixture = Fixture::new();
    let mut state = eds_synced_at_one::<W>(&mut fixture);
    assert!(!state.awaiting_reply());
    let r2 = fixture.register("a", 1, 11);
    let first = W::on_resources(&mut state, &r2);
    assert!(state.awaiting_reply());
    let r3 = fixture.register("a", 2, 12);
    let second = W::on_resources(&mut state, &r3);
    // An answer to an outdated response is not an answer to the last one.
    W::on_request(&mut state, W::ack(&first[0], &["a"]), &r3);
    assert!(state.awaiting_reply());
    // A NACK is an answer: the client is there, it just rejected the content.
    W::on_request(&mut state, W::nack(&second[0], &["a"]), &r3);
    assert!(!state.awaiting_reply());
    assert_eq!(state.synced_revision(), Some(1));
}

fn a_nack_is_not_answered_with_the_same_content_nor_advances_the_synced_revision<W: Variant>() {
    let mut fixture = Fixture::new();
    let mut state = eds_synced_at_one::<W>(&mut fixture);
    let r2 = fixture.register("a", 1, 11);
    let out = W::on_resources(&mut state, &r2);
    assert_eq!(out.len(), 1);
    assert!(W::on_request(&mut state, W::nack(&out[0], &["a"]), &r2).is_empty());
    assert_eq!(state.synced_revision(), Some(1));
    assert_eq!(
        state.nacks,
        [0, 1],
        "counted as an endpoints NACK, for the metrics"
    );
    // A change the stream does not serve: the rejected content is still owed, not resent.
    let r3 = fixture.register("b", 0, 20);
    assert!(W::on_resources(&mut state, &r3).is_empty());
    assert_eq!(state.synced_revision(), Some(1));
    // New content, ACKed this time.
    let r4 = fixture.register("a", 2, 12);
    let out = W::on_resources(&mut state, &r4);
    assert_eq!(out.len(), 1);
    assert_eq!(W::names(&out[0]), ["a"]);
    assert!(W::on_request(&mut state, W::ack(&out[0], &["a"]), &r4).is_empty());
    assert_eq!(state.synced_revision(), Some(4));
}

fn a_stale_nonce_does_not_advance_the_synced_revision<W: Variant>() {
    let mut fixture = Fixture::new();
    let r1 = fixture.register("a", 0, 10);
    let mut state = Stream::<W>::new(
        kind::<W>(Some(ENDPOINT_TYPE_URL)),
        "envoy".into(),
        Requester::default(),
    );
    let first = W::on_request(&mut state, W::subscribe(ENDPOINT_TYPE_URL, &["a"]), &r1);
    let r2 = fixture.register("a", 1, 11);
    let second = W::on_resources(&mut state, &r2);
    assert_eq!((first.len(), second.len()), (1, 1));
    // The ACK of the first response arrives after the second was sent.
    assert!(W::on_request(&mut state, W::ack(&first[0], &["a"]), &r2).is_empty());
    assert_eq!(state.synced_revision(), None);
    assert!(W::on_request(&mut state, W::ack(&second[0], &["a"]), &r2).is_empty());
    assert_eq!(state.synced_revision(), Some(2));
}

fn an_unrelated_change_syncs_at_once<W: Variant>() {
    let mut fixture = Fixture::new();
    let mut state = eds_synced_at_one::<W>(&mut fixture);
    let r2 = fixture.register("b", 0, 20);
    assert!(W::on_resources(&mut state, &r2).is_empty());
    assert_eq!(state.synced_revision(), Some(2));
    // A revision that changes no resource at all (the same worker again).
    let r3 = fixture.register("b", 0, 20);
    assert_eq!(r3.endpoints.version, r2.endpoints.version);
    assert!(W::on_resources(&mut state, &r3).is_empty());
    assert_eq!(state.synced_revision(), Some(3));
}

fn an_ack_covers_later_revisions_that_owed_nothing_new<W: Variant>() {
    let mut fixture = Fixture::new();
    let r1 = fixture.register("a", 0, 10);
    let mut state = Stream::<W>::new(
        kind::<W>(Some(ENDPOINT_TYPE_URL)),
        "envoy".into(),
        Requester::default(),
    );
    let out = W::on_request(&mut state, W::subscribe(ENDPOINT_TYPE_URL, &["a"]), &r1);
    let r2 = fixture.register("b", 0, 20);
    assert!(W::on_resources(&mut state, &r2).is_empty());
    assert_eq!(
        state.synced_revision(),
        None,
        "the response of revision 1 is still owed"
    );
    assert!(W::on_request(&mut state, W::ack(&out[0], &["a"]), &r2).is_empty());
    assert_eq!(state.synced_revision(), Some(2));
}

fn a_subscription_to_nothing_that_exists_is_synced_at_once<W: Variant>() {
    let mut fixture = Fixture::new();
    let r1 = fixture.register("a", 0, 10);
    let mut state = Stream::<W>::new(
        kind::<W>(Some(ENDPOINT_TYPE_URL)),
        "envoy".into(),
        Requester::default(),
    );
    let out = W::on_request(&mut state, W::subscribe(ENDPOINT_TYPE_URL, &["c"]), &r1);
    assert!(out.is_empty());
    assert!(state.serves_endpoints());
    assert_eq!(state.synced_revision(), Some(1));
}

fn a_change_pushes_the_changed_resource<W: Variant>() {
    let mut fixture = Fixture::new();
    let r1 = fixture.register("a", 0, 10);
    let mut state = Stream::<W>::new(
        kind::<W>(Some(ENDPOINT_TYPE_URL)),
        "envoy".into(),
        Requester::default(),
    );
    let out = W::on_request(
        &mut state,
        W::subscribe(ENDPOINT_TYPE_URL, &["a", "b"]),
        &r1,
    );
    assert_eq!(W::names(&out[0]), ["a", "b"]);
    assert!(W::on_request(&mut state, W::ack(&out[0], &["a", "b"]), &r1).is_empty());
    let r2 = fixture.register("b", 0, 20);
    let out = W::on_resources(&mut state, &r2);
    assert_eq!(out.len(), 1);
    // Both variants send only the changed assignment: state-of-the-world EDS is not full state.
    assert_eq!(W::names(&out[0]), ["b"]);
    assert!(W::carries(&out[0], &r2.endpoints, "b"));
    assert!(W::removed(&out[0]).is_empty());
    assert_eq!(W::version(&out[0]), r2.endpoints.version);
}

fn ads_sends_clusters_before_their_endpoints_which_are_owed_meanwhile<W: Variant>() {
    let mut fixture = Fixture::new();
    let r1 = fixture.register("a", 0, 10);
    let mut state = Stream::<W>::new(kind::<W>(None), "envoy".into(), Requester::default());
    // Clusters first, then endpoints: the cluster is sent, and its endpoints are owed until they
    // are sent and ACKed.
    let out = W::on_request(&mut state, W::subscribe(CLUSTER_TYPE_URL, &[]), &r1);
    assert_eq!(types::<W>(&out), [CLUSTER_TYPE_URL]);
    assert!(W::carries(&out[0], &r1.ads_clusters, "a"));
    assert!(W::on_request(&mut state, W::ack(&out[0], &[]), &r1).is_empty());
    assert!(!state.serves_endpoints(), "a CDS ACK does not count");
    let out = W::on_request(&mut state, W::subscribe(ENDPOINT_TYPE_URL, &["a"]), &r1);
    assert_eq!(types::<W>(&out), [ENDPOINT_TYPE_URL]);
    assert!(state.serves_endpoints());
    assert_eq!(state.synced_revision(), None);
    assert!(W::on_request(&mut state, W::ack(&out[0], &["a"]), &r1).is_empty());
    assert_eq!(state.synced_revision(), Some(1));
    // Only the cluster changes (HTTP/2 upstream, same endpoints): its endpoints follow it.
    let r2 = fixture.register_h2("a", 0, 10);
    assert_eq!(
        r2.endpoints.resources["a"].version,
        r1.endpoints.resources["a"].version
    );
    let out = W::on_resources(&mut state, &r2);
    assert_eq!(types::<W>(&out), [CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL]);
    assert_eq!(W::names(&out[0]), sent::<W>(&["a", "b"], &["a"]));
    assert_eq!(W::names(&out[1]), ["a"]);
}

fn an_ads_stream_without_clusters_gets_the_endpoints_it_names_then_again_after_their_cluster<
    W: Variant,
>() {
    let mut fixture = Fixture::new();
    let r1 = fixture.register("a", 0, 10);
    let mut state = Stream::<W>::new(kind::<W>(None), "envoy".into(), Requester::default());
    // An Envoy with a static EDS cluster on ADS asks for endpoints only: answered at once, as on a
    // dedicated EDS stream, and synced once ACKed.
    let out = W::on_request(&mut state, W::subscribe(ENDPOINT_TYPE_URL, &["a"]), &r1);
    assert_eq!(types::<W>(&out), [ENDPOINT_TYPE_URL]);
    assert_eq!(W::names(&out[0]), ["a"]);
    assert!(
        state.awaiting_reply(),
        "owes an answer, so it can turn silent"
    );
    assert!(W::on_request(&mut state, W::ack(&out[0], &["a"]), &r1).is_empty());
    assert_eq!(state.synced_revision(), Some(1));
    let r2 = fixture.register("a", 1, 11);
    let out = W::on_resources(&mut state, &r2);
    assert_eq!(types::<W>(&out), [ENDPOINT_TYPE_URL]);
    assert!(W::on_request(&mut state, W::ack(&out[0], &["a"]), &r2).is_empty());
    assert_eq!(state.synced_revision(), Some(r2.revision));
    // Should it subscribe to clusters later, a cluster sent is followed by its endpoints again.
    let out = W::on_request(&mut state, W::subscribe(CLUSTER_TYPE_URL, &[]), &r2);
    assert_eq!(types::<W>(&out), [CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL]);
    assert_eq!(W::names(&out[1]), ["a"]);
}

fn a_cds_only_stream_does_not_serve_endpoints<W: Variant>() {
    let mut fixture = Fixture::new();
    let r1 = fixture.register("a", 0, 10);
    for kind in [kind::<W>(Some(CLUSTER_TYPE_URL)), kind::<W>(None)] {
        let mut state = Stream::<W>::new(kind, "envoy".into(), Requester::default());
        let out = W::on_request(&mut state, W::subscribe(CLUSTER_TYPE_URL, &[]), &r1);
        assert_eq!(out.len(), 1);
        assert!(W::on_request(&mut state, W::ack(&out[0], &[]), &r1).is_empty());
        assert!(!state.serves_endpoints(), "{kind}");
        assert_eq!(state.synced_revision(), None, "{kind}");
    }
}

/// One test of `$scenario` on one variant.
macro_rules! variant_test {
    (sotw, $scenario:ident) => {
        #[test]
        fn sotw() {
            super::$scenario::<super::TypeWatch>();
        }
    };
    (delta, $scenario:ident) => {
        #[test]
        fn delta() {
            super::$scenario::<super::DeltaWatch>();
        }
    };
}

fn large_assignments_go_one_response_per_answer_and_sync_with_the_last<W: Variant>() {
    let mut fixture = Fixture::new();
    // Two services whose assignments together pass what one response carries.
    let mut resources = fixture.resources();
    for index in 0..600 {
        fixture.register("a", index, 10_000 + index);
        resources = fixture.register("b", index, 20_000 + index);
    }
    let sizes = ["a", "b"].map(|name| resources.endpoints.resources[name].resource.value.len());
    assert!(
        sizes.iter().sum::<usize>() > super::EDS_RESPONSE_BYTES,
        "the fixture passes one response: {sizes:?}"
    );
    let mut state = Stream::<W>::new(
        kind::<W>(Some(ENDPOINT_TYPE_URL)),
        "envoy".into(),
        Requester::default(),
    );
    let both = ["a", "b"];
    let first = W::on_request(
        &mut state,
        W::subscribe(ENDPOINT_TYPE_URL, &both),
        &resources,
    );
    assert_eq!(first.len(), 1);
    assert_eq!(W::names(&first[0]).len(), 1, "one assignment at a time");
    // The ACK brings the rest, at the same version; the stream is synced once that is ACKed.
    let second = W::on_request(&mut state, W::ack(&first[0], &both), &resources);
    assert_eq!(state.synced_revision(), None, "the rest is owed");
    assert_eq!(second.len(), 1);
    assert_eq!(W::version(&second[0]), W::version(&first[0]));
    let mut names = [W::names(&first[0]), W::names(&second[0])].concat();
    names.sort();
    assert_eq!(names, both);
    assert!(W::on_request(&mut state, W::ack(&second[0], &both), &resources).is_empty());
    assert_eq!(state.synced_revision(), Some(resources.revision));
}

/// A change while the pieces of a large push are still owed: the changed assignment is sent again
/// (it was sent before the change) and every other one once, and the stream syncs with the last.
fn a_change_while_pieces_are_owed_is_sent_too<W: Variant>() {
    let mut fixture = Fixture::new();
    let mut resources = fixture.resources();
    for index in 0..600 {
        fixture.register("a", index, 10_000 + index);
        resources = fixture.register("b", index, 20_000 + index);
    }
    let all = ["a", "b"];
    let mut state = Stream::<W>::new(
        kind::<W>(Some(ENDPOINT_TYPE_URL)),
        "envoy".into(),
        Requester::default(),
    );
    let first = W::on_request(
        &mut state,
        W::subscribe(ENDPOINT_TYPE_URL, &all),
        &resources,
    );
    assert_eq!(W::names(&first[0]), ["a"], "one assignment at a time");
    // "a" changes before the client answers.
    let changed = fixture.register("a", 600, 19_999);
    let mut sent = W::names(&first[0]);
    let mut last = W::on_resources(&mut state, &changed);
    assert!(!last.is_empty(), "the changed assignment is owed at once");
    while let Some(response) = last.pop() {
        assert!(last.is_empty());
        sent.extend(W::names(&response));
        last = W::on_request(&mut state, W::ack(&response, &all), &changed);
    }
    sent.sort();
    assert_eq!(sent, ["a", "a", "b"]);
    assert_eq!(state.synced_revision(), Some(changed.revision));
}

/// The table: each scenario and the variants it is replayed on.
macro_rules! scenarios {
    ($($scenario:ident: $($variant:ident),+;)*) => {
        $(
            mod $scenario {
                $(variant_test!($variant, $scenario);)+
            }
        )*
    };
}

scenarios! {
    an_ack_gets_no_reply_and_advances_the_synced_revision: sotw, delta;
    a_stream_owes_an_answer_until_it_acks_or_nacks_the_last_endpoints_response: sotw, delta;
    a_nack_is_not_answered_with_the_same_content_nor_advances_the_synced_revision: sotw, delta;
    a_stale_nonce_does_not_advance_the_synced_revision: sotw, delta;
    an_unrelated_change_syncs_at_once: sotw, delta;
    an_ack_covers_later_revisions_that_owed_nothing_new: sotw, delta;
    a_subscription_to_nothing_that_exists_is_synced_at_once: sotw, delta;
    a_change_pushes_the_changed_resource: sotw, delta;
    ads_sends_clusters_before_their_endpoints_which_are_owed_meanwhile: sotw, delta;
    an_ads_stream_without_clusters_gets_the_endpoints_it_names_then_again_after_their_cluster:
        sotw, delta;
    a_cds_only_stream_does_not_serve_endpoints: sotw, delta;
    large_assignments_go_one_response_per_answer_and_sync_with_the_last: sotw, delta;
    a_change_while_pieces_are_owed_is_sent_too: sotw, delta;
}
