//! The transport's stream rules for the fuzz targets in `supervisor/fuzz`, with the `fuzzing` feature
//! (not a stable API).
//!
//! [`SotwStream`] and [`DeltaStream`] are a state-of-the-world and a delta stream's pure state, as
//! [`run_stream`](super::run_stream) drives it, without gRPC: a target feeds them requests and
//! resources and checks what they answer. Nothing else of the transport is exposed.

use envoy_types::pb::envoy::{
    config::core::v3::Node,
    service::discovery::v3::{
        DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
    },
};
use tonic::Status;

use super::{
    Requester, Resources, Stream, StreamKind, StreamRules, delta::DeltaWatch, sotw::TypeWatch,
};

/// Defines a wrapper around one variant's stream state, with the calls [`run_stream`] makes on it.
///
/// [`run_stream`]: super::run_stream
macro_rules! driven_stream {
    ($(#[$doc:meta])* $name:ident($watch:ty): $request:ty => $response:ty) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name(Stream<$watch>);

        impl $name {
            /// A stream of `kind` whose first request names `node`: the node's id and locality are
            /// the stream's, as on a real stream.
            pub fn new(kind: StreamKind, node: Option<&Node>) -> Self {
                let id = node.map(|n| n.id.clone()).unwrap_or_default();
                $name(Stream::new(kind, id, Requester::of(node)))
            }

            /// Applies a request: the responses now owed, or the status that ends the stream.
            pub fn on_request(
                &mut self,
                request: $request,
                resources: &Resources,
            ) -> Result<Vec<$response>, Status> {
                self.0.on_request(request, resources)
            }

            /// The responses owed after the cache published `resources`.
            pub fn on_resources(&mut self, resources: &Resources) -> Vec<$response> {
                self.0.on_resources(resources)
            }

            /// The highest registry revision at which the client ACKed every endpoints response owed.
            pub fn synced_revision(&self) -> Option<u64> {
                self.0.synced_revision()
            }

            /// Whether the stream serves endpoints.
            pub fn serves_endpoints(&self) -> bool {
                self.0.serves_endpoints()
            }

            /// Whether the client has answered neither ACK nor NACK to the last endpoints response.
            pub fn awaiting_reply(&self) -> bool {
                self.0.awaiting_reply()
            }
        }
    };
}

driven_stream!(
    /// A state-of-the-world stream (`StreamClusters`, `StreamEndpoints`, `StreamAggregatedResources`).
    SotwStream(TypeWatch): DiscoveryRequest => DiscoveryResponse
);

driven_stream!(
    /// A delta stream (`DeltaClusters`, `DeltaEndpoints`, `DeltaAggregatedResources`).
    DeltaStream(DeltaWatch): DeltaDiscoveryRequest => DeltaDiscoveryResponse
);
