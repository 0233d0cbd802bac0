//! The gRPC wire of the three discovery services: which method a request calls, its requests decoded
//! with tonic's [`Streaming`], and each response framed into an allocation of its own.
//!
//! Written by hand instead of using the servers `envoy-types` generates, for memory: tonic's
//! response encoder keeps one buffer per stream for the stream's whole life, and that buffer never
//! shrinks below the largest message the stream ever sent (it is reclaimed in place once the bytes
//! handed to HTTP/2 are written). An EDS stream sends responses of up to 64 KiB, so every stream kept
//! 64-128 KiB (measured with heaptrack at 10,000 endpoints: 121 KiB per client, half of its memory).
//! Here a response is encoded into a buffer of exactly its size, which HTTP/2 frees once it is
//! written: an idle stream holds no response bytes. Requests (Envoy's ACKs, a few hundred bytes)
//! start in a 1 KiB buffer instead of tonic's 8 KiB; a larger one grows it.
//!
//! What tonic's generated servers do besides is kept: unknown methods and REST-style fetches are
//! answered `UNIMPLEMENTED`, a compressed request is refused as tonic refuses one it was not set up
//! for, and a stream's end (or error) goes out as gRPC trailers.
//!
//! Invariant: this module only frames; what a stream sends is the transport's ([`XdsService::open`]).

use std::{
    convert::Infallible,
    future::{Ready, ready},
    pin::Pin,
    task::{Context, Poll},
};

use bytes::{BufMut, Bytes};
use futures::{Stream, StreamExt};
use http_body::Frame;
use prost::Message;
use tonic::{
    Status, Streaming,
    body::Body,
    codec::{BufferSettings, CompressionEncoding},
    server::NamedService,
};
use tonic_prost::ProstCodec;

use super::{XdsService, delta::DeltaWatch, sotw::TypeWatch};
use crate::{grpc_port::ClientProof, xds::stream_kind::StreamKind};

/// The bytes before each message on the wire: a compression flag and the length (big-endian).
const FRAME_HEADER: usize = 5;

/// A request stream's first buffer: an ACK from Envoy (its node is sent on the first request only)
/// is a few hundred bytes.
const REQUEST_BUFFER: usize = 1024;

/// The answer to a REST-style fetch.
const NO_FETCH: &str = "fetch (REST-style) xDS is not supported, use a stream";

/// What a method of a discovery service does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Method {
    /// Opens a stream of this kind.
    Open(StreamKind),
    /// A REST-style fetch: refused.
    Fetch,
}

/// One of the three discovery services over [`XdsService`]: its name on the wire, and its methods.
macro_rules! discovery_server {
    (
        $(#[$doc:meta])* $server:ident = $name:literal {
            $($method:literal => $what:expr),+ $(,)?
        }
    ) => {
        $(#[$doc])*
        #[derive(Clone, Debug)]
        pub struct $server(pub XdsService);

        impl NamedService for $server {
            const NAME: &'static str = $name;
        }

        impl $server {
            /// What the method named by the last segment of a request's path does.
            fn method(name: &str) -> Option<Method> {
                match name {
                    $($method => Some($what),)+
                    _ => None,
                }
            }
        }

        impl tower::Service<http::Request<Body>> for $server {
            type Response = http::Response<Body>;
            type Error = Infallible;
            type Future = Ready<Result<http::Response<Body>, Infallible>>;

            fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
                Poll::Ready(Ok(()))
            }

            fn call(&mut self, request: http::Request<Body>) -> Self::Future {
                let method = request.uri().path().rsplit('/').next().and_then(Self::method);
                ready(Ok(answer(&self.0, method, request)))
            }
        }
    };
}

discovery_server!(
    /// `envoy.service.cluster.v3.ClusterDiscoveryService`.
    ClusterServer = "envoy.service.cluster.v3.ClusterDiscoveryService" {
        "StreamClusters" => Method::Open(StreamKind::Cds),
        "DeltaClusters" => Method::Open(StreamKind::DeltaCds),
        "FetchClusters" => Method::Fetch,
    }
);

discovery_server!(
    /// `envoy.service.endpoint.v3.EndpointDiscoveryService`.
    EndpointServer = "envoy.service.endpoint.v3.EndpointDiscoveryService" {
        "StreamEndpoints" => Method::Open(StreamKind::Eds),
        "DeltaEndpoints" => Method::Open(StreamKind::DeltaEds),
        "FetchEndpoints" => Method::Fetch,
    }
);

discovery_server!(
    /// `envoy.service.discovery.v3.AggregatedDiscoveryService`.
    AggregatedServer = "envoy.service.discovery.v3.AggregatedDiscoveryService" {
        "StreamAggregatedResources" => Method::Open(StreamKind::Ads),
        "DeltaAggregatedResources" => Method::Open(StreamKind::DeltaAds),
    }
);

/// The HTTP response to a call of `method` (`None`: a method the service does not have).
fn answer(
    service: &XdsService,
    method: Option<Method>,
    request: http::Request<Body>,
) -> http::Response<Body> {
    let kind = match opens(method, &request) {
        Ok(kind) => kind,
        Err(status) => return status.into_http(),
    };
    let proof = request.extensions().get::<ClientProof>().cloned();
    let body = request.into_body();
    let body = if kind.is_delta() {
        Body::new(Framed::new(service.open::<DeltaWatch>(
            kind,
            requests(body),
            proof,
        )))
    } else {
        Body::new(Framed::new(service.open::<TypeWatch>(
            kind,
            requests(body),
            proof,
        )))
    };
    let mut response = http::Response::new(body);
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        tonic::metadata::GRPC_CONTENT_TYPE,
    );
    response
}

/// The kind of stream a call of `method` opens, or why it opens none.
fn opens(method: Option<Method>, request: &http::Request<Body>) -> Result<StreamKind, Status> {
    let kind = match method {
        Some(Method::Open(kind)) => kind,
        Some(Method::Fetch) => return Err(Status::unimplemented(NO_FETCH)),
        None => {
            let path = request.uri().path();
            return Err(Status::unimplemented(format!("no method {path}")));
        }
    };
    match request.headers().get("grpc-encoding") {
        Some(encoding) if encoding != "identity" => {
            let encoding = String::from_utf8_lossy(encoding.as_bytes());
            Err(Status::unimplemented(format!(
                "Content is compressed with `{encoding}` which isn't supported"
            )))
        }
        _ => Ok(kind),
    }
}

/// The stream of requests a call's body carries.
fn requests<M: Message + Default + Send + 'static>(body: Body) -> Streaming<M> {
    let decoder = ProstCodec::<M, M>::raw_decoder(BufferSettings::new(REQUEST_BUFFER, 32 * 1024));
    Streaming::new_request(decoder, body, None::<CompressionEncoding>, None)
}

/// A stream of responses as a gRPC response body: each message one data frame in a buffer of its
/// own, then the trailers (`OK`, or the status the stream ended with).
struct Framed<S> {
    responses: S,
    ended: bool,
}

impl<S> Framed<S> {
    fn new(responses: S) -> Self {
        Framed {
            responses,
            ended: false,
        }
    }
}

impl<S, M> http_body::Body for Framed<S>
where
    S: Stream<Item = Result<M, Status>> + Unpin,
    M: Message,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let status = match std::task::ready!(self.responses.poll_next_unpin(cx)) {
            Some(Ok(message)) => match frame(&message) {
                Ok(data) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                Err(status) => status,
            },
            Some(Err(status)) => status,
            None => Status::ok(""),
        };
        self.ended = true;
        let mut trailers = http::HeaderMap::new();
        Poll::Ready(Some(
            status
                .add_header(&mut trailers)
                .map(|()| Frame::trailers(trailers)),
        ))
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

/// `message` as one gRPC message on the wire (uncompressed), in an allocation of exactly its size.
fn frame(message: &impl Message) -> Result<Bytes, Status> {
    let len = message.encoded_len();
    let prefix = u32::try_from(len).map_err(|_| {
        Status::resource_exhausted(format!(
            "a response of {len} bytes is more than gRPC can carry"
        ))
    })?;
    let mut buf = Vec::with_capacity(FRAME_HEADER + len);
    buf.put_u8(0);
    buf.put_u32(prefix);
    message.encode_raw(&mut buf);
    debug_assert_eq!(buf.len(), buf.capacity());
    Ok(Bytes::from(buf))
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse;

    use super::*;

    #[test]
    fn a_frame_is_the_message_behind_its_length() {
        let response = DiscoveryResponse {
            version_info: "7".into(),
            nonce: "n".into(),
            ..Default::default()
        };
        let data = frame(&response).unwrap();
        let len = response.encoded_len();
        assert_eq!(data[0], 0, "not compressed");
        assert_eq!(
            u32::from_be_bytes(data[1..5].try_into().unwrap()) as usize,
            len
        );
        assert_eq!(DiscoveryResponse::decode(&data[5..]).unwrap(), response);
    }

    #[test]
    fn each_service_knows_its_methods() {
        assert_eq!(
            ClusterServer::method("DeltaClusters"),
            Some(Method::Open(StreamKind::DeltaCds))
        );
        assert_eq!(
            EndpointServer::method("StreamEndpoints"),
            Some(Method::Open(StreamKind::Eds))
        );
        assert_eq!(
            EndpointServer::method("FetchEndpoints"),
            Some(Method::Fetch)
        );
        assert_eq!(
            AggregatedServer::method("StreamAggregatedResources"),
            Some(Method::Open(StreamKind::Ads))
        );
        assert_eq!(AggregatedServer::method("StreamClusters"), None);
    }

    #[test]
    fn fetches_unknown_methods_and_compressed_requests_open_nothing() {
        let call = |path: &str, encoding: Option<&str>| {
            let mut request = http::Request::builder().uri(path);
            if let Some(encoding) = encoding {
                request = request.header("grpc-encoding", encoding);
            }
            let request = request.body(Body::empty()).unwrap();
            let method = path.rsplit('/').next().and_then(ClusterServer::method);
            opens(method, &request).map_err(|status| (status.code(), status.message().to_string()))
        };
        let path = "/envoy.service.cluster.v3.ClusterDiscoveryService";
        assert_eq!(
            call(&format!("{path}/DeltaClusters"), None),
            Ok(StreamKind::DeltaCds)
        );
        assert_eq!(
            call(&format!("{path}/StreamClusters"), Some("identity")),
            Ok(StreamKind::Cds)
        );
        assert_eq!(
            call(&format!("{path}/FetchClusters"), None),
            Err((tonic::Code::Unimplemented, NO_FETCH.to_string()))
        );
        let (code, message) = call(&format!("{path}/Nothing"), None).unwrap_err();
        assert_eq!(code, tonic::Code::Unimplemented);
        assert!(message.contains("/Nothing"), "{message}");
        let (code, message) = call(&format!("{path}/StreamClusters"), Some("gzip")).unwrap_err();
        assert_eq!(code, tonic::Code::Unimplemented);
        assert!(message.contains("gzip"), "{message}");
    }
}
