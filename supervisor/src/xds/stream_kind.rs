//! Which RPC an xDS stream is, and what that fixes about it: the type a dedicated stream serves, the
//! types ADS serves, and where the clusters sent on it fetch their endpoints.
//!
//! Its own module because two layers need it and neither should need the other: [`acks`] records
//! each stream's kind (and `peregrine status` shows it), and [`transport`] acts on it. Before, the
//! kind lived in the transport, so `acks` imported the transport that imports `acks`.
//!
//! Invariant: this module knows the RPCs and the type URLs, nothing of streams' state; it depends on
//! [`resources`] (the type URLs) and [`cache`] (the cluster variants) only.
//!
//! [`acks`]: super::acks
//! [`transport`]: super::transport
//! [`resources`]: super::resources
//! [`cache`]: super::cache

use std::fmt;

use tonic::Status;

use super::{
    cache::EdsVia,
    resources::{CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL},
};

/// Which RPC a stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// `ClusterDiscoveryService.StreamClusters`.
    Cds,
    /// `EndpointDiscoveryService.StreamEndpoints`.
    Eds,
    /// `AggregatedDiscoveryService.StreamAggregatedResources`.
    Ads,
    /// `ClusterDiscoveryService.DeltaClusters`.
    DeltaCds,
    /// `EndpointDiscoveryService.DeltaEndpoints`.
    DeltaEds,
    /// `AggregatedDiscoveryService.DeltaAggregatedResources`.
    DeltaAds,
}

// === impl StreamKind ===

impl StreamKind {
    /// The type a dedicated stream serves; `None` for ADS.
    pub(super) fn dedicated_type(self) -> Option<&'static str> {
        match self {
            StreamKind::Cds | StreamKind::DeltaCds => Some(CLUSTER_TYPE_URL),
            StreamKind::Eds | StreamKind::DeltaEds => Some(ENDPOINT_TYPE_URL),
            StreamKind::Ads | StreamKind::DeltaAds => None,
        }
    }

    /// Whether the stream is delta (incremental) xDS.
    pub(super) fn is_delta(self) -> bool {
        matches!(
            self,
            StreamKind::DeltaCds | StreamKind::DeltaEds | StreamKind::DeltaAds
        )
    }

    /// Whether the stream is ADS (delta or not).
    pub(super) fn is_ads(self) -> bool {
        self.dedicated_type().is_none()
    }

    /// Where the clusters sent on this stream fetch their endpoints.
    pub(super) fn eds_via(self) -> EdsVia {
        match self {
            StreamKind::Ads | StreamKind::DeltaAds => EdsVia::Ads,
            StreamKind::DeltaCds | StreamKind::DeltaEds => EdsVia::DeltaGrpc,
            StreamKind::Cds | StreamKind::Eds => EdsVia::Grpc,
        }
    }

    /// The type a request on this stream is for: `Ok(None)` for a type ADS does not serve (the
    /// request is ignored), an error for the wrong type on a dedicated stream.
    pub(super) fn requested_type(self, type_url: &str) -> Result<Option<&'static str>, Status> {
        match (self.dedicated_type(), type_url) {
            (Some(expected), "") => Ok(Some(expected)),
            (Some(expected), got) if got == expected => Ok(Some(expected)),
            (Some(expected), got) => {
                tracing::warn!(
                    type_url = got,
                    expected,
                    "Request for the wrong type on a dedicated stream"
                );
                Err(Status::invalid_argument(format!(
                    "this stream serves {expected}, not {got}"
                )))
            }
            (None, CLUSTER_TYPE_URL) => Ok(Some(CLUSTER_TYPE_URL)),
            (None, ENDPOINT_TYPE_URL) => Ok(Some(ENDPOINT_TYPE_URL)),
            (None, got) => {
                tracing::warn!(type_url = got, "Request for a type not served, ignored");
                Ok(None)
            }
        }
    }
}

impl StreamKind {
    /// Every kind, in declaration order.
    pub const ALL: [StreamKind; 6] = [
        StreamKind::Cds,
        StreamKind::Eds,
        StreamKind::Ads,
        StreamKind::DeltaCds,
        StreamKind::DeltaEds,
        StreamKind::DeltaAds,
    ];

    /// What the stream serves (`cds`, `eds` or `ads`) and how (`sotw` or `delta`): the labels of
    /// its metrics.
    pub fn type_and_variant(self) -> (&'static str, &'static str) {
        match self {
            StreamKind::Cds => ("cds", "sotw"),
            StreamKind::Eds => ("eds", "sotw"),
            StreamKind::Ads => ("ads", "sotw"),
            StreamKind::DeltaCds => ("cds", "delta"),
            StreamKind::DeltaEds => ("eds", "delta"),
            StreamKind::DeltaAds => ("ads", "delta"),
        }
    }
}

impl fmt::Display for StreamKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StreamKind::Cds => "cds",
            StreamKind::Eds => "eds",
            StreamKind::Ads => "ads",
            StreamKind::DeltaCds => "delta-cds",
            StreamKind::DeltaEds => "delta-eds",
            StreamKind::DeltaAds => "delta-ads",
        })
    }
}
