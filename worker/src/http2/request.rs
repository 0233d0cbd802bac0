//! Request bodies: each stream's body read under flow control and charged to the connection's budget
//! before its request goes to the application.
//!
//! Invariant: flow-control capacity is released only for bytes charged to the budget, so the peer can
//! never make the connection hold more than its budget; a body that finds no room is refused at once.

use std::rc::Rc;

use bytes::{Bytes, BytesMut};
use h2::{RecvStream, server::SendResponse};
use http::{Method, Request, StatusCode, header};
use tokio::time::Instant;

use super::{Limits, resets::Resets, response::send_error};
use crate::{
    budget::{Budget, Charge},
    service::RequestBody,
};

/// A request whose body has been read, waiting for the application.
pub(super) struct Received {
    pub(super) request: Request<RequestBody>,
    pub(super) respond: SendResponse<Bytes>,
    pub(super) head_only: bool,
    /// The budget its body holds, given back once its response is done.
    pub(super) charge: Option<Charge>,
    pub(super) span: tracing::Span,
}

/// Reads a request's body under flow control: `None` when the stream is done already (refused with
/// `413`, `503` when the body finds no room in the connection's or the worker's budget, `408` when it
/// pauses or lasts too long, or reset by the peer).
///
/// Capacity is released (the peer may send more) only for bytes charged to `bodies`.
pub(super) async fn receive(
    request: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    limits: &Limits,
    bodies: &Rc<Budget>,
    resets: &Resets,
    span: tracing::Span,
) -> Option<Received> {
    let max_body = limits.max_body_bytes;
    let (parts, mut body) = request.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max_body as u64) {
        send_error(&mut respond, StatusCode::PAYLOAD_TOO_LARGE);
        return None;
    }
    let mut charge = Charge::new(bodies);
    // A declared body is charged whole at once (its buffer is allocated whole).
    if let Some(n) = declared
        && !charge.grow(n as usize)
    {
        tracing::debug!(
            buffered = bodies.used(),
            "No room for the request body, answering 503"
        );
        send_error(&mut respond, StatusCode::SERVICE_UNAVAILABLE);
        return None;
    }
    let started = Instant::now();
    let mut last = started;
    let mut data = BytesMut::with_capacity(declared.map_or(0, |n| n as usize));
    let mut first: Option<Bytes> = None;
    loop {
        let deadline = (started + limits.body_timeout).min(last + limits.body_read_timeout);
        let chunk = match tokio::time::timeout_at(deadline, body.data()).await {
            Err(_) => {
                tracing::debug!("Request body timeout, answering 408");
                send_error(&mut respond, StatusCode::REQUEST_TIMEOUT);
                return None;
            }
            Ok(None) => break,
            Ok(Some(chunk)) => chunk,
        };
        last = Instant::now();
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(error) => {
                if error.is_reset() && error.is_remote() {
                    resets.record(last);
                }
                tracing::debug!(%error, "Request body failed");
                return None;
            }
        };
        let len = first.as_ref().map_or(0, Bytes::len) + data.len() + chunk.len();
        if len > max_body {
            send_error(&mut respond, StatusCode::PAYLOAD_TOO_LARGE);
            return None;
        }
        if len > charge.held() && !charge.set(len) {
            tracing::debug!(
                buffered = bodies.used(),
                "No room for the request body, answering 503"
            );
            send_error(&mut respond, StatusCode::SERVICE_UNAVAILABLE);
            return None;
        }
        // The peer may send more once this side has taken (and charged) the bytes.
        let _ = body.flow_control().release_capacity(chunk.len());
        // A body in one DATA frame is kept as it is; more are joined.
        match first.take() {
            None if data.is_empty() => first = Some(chunk),
            None => data.extend_from_slice(&chunk),
            Some(head) => {
                data.extend_from_slice(&head);
                data.extend_from_slice(&chunk);
            }
        }
    }
    // Request trailers are read by `h2` and dropped: a `RequestBody` has none.
    let body = first.unwrap_or_else(|| data.freeze());
    let head_only = parts.method == Method::HEAD;
    Some(Received {
        request: Request::from_parts(parts, RequestBody::new(body)),
        respond,
        head_only,
        charge: Some(charge),
        span,
    })
}
