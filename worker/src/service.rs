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
    convert::Infallible,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use bytes::{Buf, Bytes};
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use tower::Service;

use crate::BoxError;

/// The body of every request an application receives: read whole (up to the configured limit) before
/// the call, so an application can look at it at once ([`RequestBody::as_bytes`]) or read it as any
/// `http_body::Body`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestBody {
    data: Bytes,
    /// Whether the data was handed out as a frame already.
    taken: bool,
}

impl RequestBody {
    /// A body holding `data`.
    pub fn new(data: Bytes) -> Self {
        RequestBody { data, taken: false }
    }

    /// The whole body.
    pub fn as_bytes(&self) -> &Bytes {
        &self.data
    }

    /// The whole body, owned.
    pub fn into_bytes(self) -> Bytes {
        self.data
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.taken || self.data.is_empty() {
            return Poll::Ready(None);
        }
        self.taken = true;
        Poll::Ready(Some(Ok(Frame::data(self.data.clone()))))
    }

    fn is_end_stream(&self) -> bool {
        self.taken || self.data.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(if self.is_end_stream() {
            0
        } else {
            self.data.len() as u64
        })
    }
}

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
