//! Calling the application through `tower::Service` and reading its (always ready) response body.

use std::{
    pin::pin,
    task::{Context, Poll, Waker},
};

use bytes::{Buf, Bytes, BytesMut};
use http::{Request, Response};
use http_body::Body;
use peregrine_worker::RequestBody;
use tower::Service;

/// Calls `service` with `request`. The spike serves applications whose readiness and futures complete
/// at once (the hello app does); anything else, or an error, is `None`.
pub(crate) fn call<S, B>(service: &mut S, request: Request<RequestBody>) -> Option<Response<B>>
where
    S: Service<Request<RequestBody>, Response = Response<B>>,
{
    let mut cx = Context::from_waker(Waker::noop());
    match service.poll_ready(&mut cx) {
        Poll::Ready(Ok(())) => {}
        _ => return None,
    }
    match pin!(service.call(request)).poll(&mut cx) {
        Poll::Ready(Ok(response)) => Some(response),
        _ => None,
    }
}

/// The whole body, if it is ready at once (trailers are dropped).
pub(crate) fn body_bytes<B>(body: B) -> Option<Bytes>
where
    B: Body,
{
    let mut cx = Context::from_waker(Waker::noop());
    let mut body = pin!(body);
    let mut first: Option<Bytes> = None;
    let mut more: Option<BytesMut> = None;
    loop {
        match body.as_mut().poll_frame(&mut cx) {
            Poll::Ready(None) => break,
            Poll::Ready(Some(Ok(frame))) => {
                if let Ok(mut data) = frame.into_data() {
                    let chunk = data.copy_to_bytes(data.remaining());
                    match (&mut first, &mut more) {
                        (None, _) => first = Some(chunk),
                        (Some(first), None) => {
                            let mut joined = BytesMut::from(&first[..]);
                            joined.extend_from_slice(&chunk);
                            more = Some(joined);
                        }
                        (Some(_), Some(joined)) => joined.extend_from_slice(&chunk),
                    }
                }
            }
            Poll::Ready(Some(Err(_))) | Poll::Pending => return None,
        }
    }
    Some(match more {
        Some(joined) => joined.freeze(),
        None => first.unwrap_or_default(),
    })
}
