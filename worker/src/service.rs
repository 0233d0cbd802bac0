//! The application interface: any `tower::Service` over `http` types.
//!
//! A worker calls its application with a [`Request<RequestBody>`] whose body has been read whole (up to
//! the configured limit), and accepts any `http_body::Body` as the response body: HTTP/1 streams it
//! (with `content-length` when its size is known, chunked otherwise) and HTTP/2 sends it as DATA frames
//! under flow control. An axum `Router` is such a service.
//!
//! [`HttpService`] names the bounds once; it is implemented for every fitting `tower::Service`. The worker
//! runs on one thread, so neither the service nor its futures need to be `Send`.

use std::{
    future::Future,
    task::{Context, Poll},
};

use bytes::{Buf, Bytes};
use http::{Request, Response};
use http_body::Body;
use tower::Service;

use crate::BoxError;

/// The body of every request an application receives: read whole before the call.
pub type RequestBody = http_body_util::Full<Bytes>;

/// A `tower::Service` a worker can serve: `Request<RequestBody>` in, `Response<impl Body>` out.
pub trait HttpService: 'static {
    /// The response body.
    type ResBody: Body<Data = Self::Data, Error = Self::BodyError> + 'static;
    /// The response body's chunks.
    type Data: Buf + 'static;
    /// The response body's error.
    type BodyError: Into<BoxError>;
    /// The service's error; it becomes a `500` (and, on HTTP/1, a closed connection).
    type Error: Into<BoxError>;
    /// The future of one call.
    type Future: Future<Output = Result<Response<Self::ResBody>, Self::Error>> + 'static;

    /// `tower::Service::poll_ready`.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>>;
    /// `tower::Service::call`.
    fn call(&mut self, request: Request<RequestBody>) -> Self::Future;
}

impl<S, B> HttpService for S
where
    S: Service<Request<RequestBody>, Response = Response<B>> + 'static,
    S::Error: Into<BoxError>,
    S::Future: 'static,
    B: Body + 'static,
    B::Data: 'static,
    B::Error: Into<BoxError>,
{
    type ResBody = B;
    type Data = B::Data;
    type BodyError = B::Error;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Service::poll_ready(self, cx)
    }

    fn call(&mut self, request: Request<RequestBody>) -> Self::Future {
        Service::call(self, request)
    }
}

/// Waits until `service` is ready, then calls it.
#[allow(dead_code, reason = "the protocol modules move to HttpService next")]
pub(crate) async fn ready_call<S: HttpService>(
    service: &mut S,
    request: Request<RequestBody>,
) -> Result<Response<S::ResBody>, BoxError> {
    std::future::poll_fn(|cx| service.poll_ready(cx))
        .await
        .map_err(Into::into)?;
    service.call(request).await.map_err(Into::into)
}
