//! Counts each request (a gRPC stream) as open on its connection until its response body is done:
//! what "idle" is measured on; and hands the request its connection's [`ClientProof`](super::ClientProof), which the
//! service uses once the stream shows a client.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::Bytes;

use super::admitted::{ConnInfo, StreamGuard};

/// Counts each request (a gRPC stream) as open on its connection until its response body is done.
#[derive(Clone, Copy, Debug, Default)]
pub struct TrackStreamsLayer;

impl<S> tower::Layer<S> for TrackStreamsLayer {
    type Service = TrackStreams<S>;

    fn layer(&self, inner: S) -> TrackStreams<S> {
        TrackStreams(inner)
    }
}

/// See [`TrackStreamsLayer`].
#[derive(Clone, Debug)]
pub struct TrackStreams<S>(S);

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, R> tower::Service<http::Request<B>> for TrackStreams<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    R: http_body::Body<Data = Bytes> + Unpin + Send + 'static,
{
    type Response = http::Response<Tracked<R>>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let info = request.extensions().get::<ConnInfo>().cloned();
        let guard = info.as_ref().map(|info| info.streams.opened());
        if let Some(info) = info {
            request.extensions_mut().insert(info.proof());
        }
        let response = self.0.call(request);
        Box::pin(async move {
            let response = response.await?;
            Ok(response.map(|body| Tracked {
                body,
                _guard: guard,
            }))
        })
    }
}

/// A response body that holds its stream open on its connection until it is dropped.
#[derive(Debug)]
pub struct Tracked<B> {
    body: B,
    _guard: Option<StreamGuard>,
}

impl<B: http_body::Body + Unpin> http_body::Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
