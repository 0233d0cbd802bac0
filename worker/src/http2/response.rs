//! Responses: each call's future driven to a response, whose head, DATA frames (under flow control)
//! and trailers are sent on its stream; the short error responses that refuse a stream.
//!
//! Invariant: a slow reader holds back only its own stream (capacity is reserved and awaited per
//! chunk), and every response that ends, however it ends, is counted in the connection's [`Resets`].

use std::{
    future::{Future, poll_fn},
    pin::pin,
    task::{Context, Poll, ready},
};

use bytes::{Buf, Bytes};
use h2::{Reason, SendStream, server::SendResponse};
use http::{HeaderMap, HeaderValue, Response, StatusCode, header};
use http_body::Body;
use http_body_util::BodyExt;
use tokio::time::Instant;

use super::resets::Resets;
use crate::{
    BoxError,
    budget::Charge,
    load_report::{self, Carried, LOAD_METRICS_HEADER},
};

/// Sends a short plain-text error response and ends the stream.
pub(super) fn send_error(respond: &mut SendResponse<Bytes>, status: StatusCode) {
    let reason = status.canonical_reason().unwrap_or("Error");
    let mut head = Response::new(());
    *head.status_mut() = status;
    head.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    // The body is small: it is buffered whatever the window, and the stream is gone if this fails.
    if let Ok(mut send) = respond.send_response(head, false) {
        let _ = send.send_data(Bytes::from(format!("{reason}\n")), true);
    }
}

/// Why sending a response stopped early.
#[derive(Debug, thiserror::Error)]
enum SendError {
    /// The peer reset the stream.
    #[error("the peer reset the stream ({0:?})")]
    Reset(Reason),
    /// The stream or the connection failed.
    #[error("the stream failed")]
    H2(#[source] h2::Error),
    /// The stream can no longer send (closed under us).
    #[error("the stream closed")]
    Closed,
    /// The response body failed; the stream was reset.
    #[error("the response body failed")]
    Body(#[source] BoxError),
}

impl From<h2::Error> for SendError {
    fn from(error: h2::Error) -> Self {
        match error.reason() {
            Some(reason) if error.is_reset() && error.is_remote() => SendError::Reset(reason),
            _ => SendError::H2(error),
        }
    }
}

/// Runs one call and sends its response; an error becomes a `500`, a reset by the peer drops the call.
pub(super) async fn respond_to<F, B, E>(
    call: Result<F, BoxError>,
    // The stream, and the request in flight on it until this future ends (or is dropped).
    (mut respond, _open): (SendResponse<Bytes>, crate::counter::Open),
    head_only: bool,
    charge: Option<Charge>,
    resets: &Resets,
    carried: &Carried,
) where
    F: Future<Output = Result<Response<B>, E>>,
    E: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    let response = match call {
        // The call first: most are ready at once, and then the reset is not asked about (a reset that
        // came meanwhile fails the response's send instead).
        Ok(future) => tokio::select! {
            biased;
            response = future => response.map_err(Into::into),
            reset = poll_fn(|cx| respond.poll_reset(cx)) => {
                if let Ok(reason) = reset {
                    resets.record(Instant::now());
                    tracing::debug!(?reason, "Stream reset by the peer during the call");
                }
                return;
            }
        },
        Err(error) => Err(error),
    };
    let response = match response {
        Ok(response) => response,
        Err(error) => {
            tracing::warn!(%error, "Application failed, answering 500");
            send_error(&mut respond, StatusCode::INTERNAL_SERVER_ERROR);
            resets.completed(Instant::now());
            return;
        }
    };
    let sent = send_response(respond, response, head_only, carried).await;
    // The request body's bytes are the application's no more.
    drop(charge);
    match sent {
        Ok(()) => resets.completed(Instant::now()),
        Err(SendError::Reset(reason)) => {
            resets.record(Instant::now());
            tracing::debug!(?reason, "Stream reset by the peer during the response");
        }
        Err(error) => {
            tracing::debug!(%error, source = ?std::error::Error::source(&error), "Sending the response failed")
        }
    }
}

/// Response header fields HTTP/2 forbids (RFC 9113, section 8.2.2).
const CONNECTION_SPECIFIC: [&str; 5] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
];

/// Sends a response: the head, the body under flow control, trailers if any.
async fn send_response<B>(
    mut respond: SendResponse<Bytes>,
    response: Response<B>,
    head_only: bool,
    carried: &Carried,
) -> Result<(), SendError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = response.into_parts();
    // Looked for before they are removed: a removal hashes the name even when it is absent.
    if parts
        .headers
        .keys()
        .any(|name| CONNECTION_SPECIFIC.contains(&name.as_str()))
    {
        for name in CONNECTION_SPECIFIC {
            parts.headers.remove(name);
        }
    }
    // A body of known size says so, as over HTTP/1 (Envoy and clients use it to size buffers).
    if let Some(len) = body.size_hint().exact()
        && !parts.headers.contains_key(header::CONTENT_LENGTH)
        && !matches!(parts.status.as_u16(), 100..=199 | 204 | 304)
    {
        parts
            .headers
            .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    }
    // The worker's ORCA load report, once per connection, unless the application sent one itself.
    if let Some(report) = load_report::new_header(carried)
        && let header::Entry::Vacant(entry) = parts.headers.entry(LOAD_METRICS_HEADER)
    {
        entry.insert(report);
    }
    let end = head_only || body.is_end_stream();
    let mut send = respond.send_response(Response::from_parts(parts, ()), end)?;
    if end {
        return Ok(());
    }
    let mut body = pin!(body);
    loop {
        let frame = tokio::select! {
            biased;
            frame = body.frame() => frame,
            reset = poll_fn(|cx| send.poll_reset(cx)) => return Err(match reset {
                Ok(reason) => SendError::Reset(reason),
                Err(error) => error.into(),
            }),
        };
        let frame = match frame {
            None => {
                send.send_data(Bytes::new(), true)?;
                return Ok(());
            }
            Some(Err(error)) => {
                send.send_reset(Reason::INTERNAL_ERROR);
                return Err(SendError::Body(error.into()));
            }
            Some(Ok(frame)) => frame,
        };
        match frame.into_data() {
            Ok(mut data) => {
                let data = data.copy_to_bytes(data.remaining());
                let end = body.is_end_stream();
                send_data(&mut send, data, end).await?;
                if end {
                    return Ok(());
                }
            }
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    send_trailers(&mut send, trailers)?;
                    return Ok(());
                }
            }
        }
    }
}

fn send_trailers(send: &mut SendStream<Bytes>, trailers: HeaderMap) -> Result<(), SendError> {
    send.send_trailers(trailers)?;
    Ok(())
}

/// Sends `data` as the window allows: reserves capacity for what is left, waits for some, sends that much.
async fn send_data(
    send: &mut SendStream<Bytes>,
    mut data: Bytes,
    end: bool,
) -> Result<(), SendError> {
    if data.is_empty() {
        if end {
            send.send_data(data, true)?;
        }
        return Ok(());
    }
    // A body's last chunk of at most one frame goes to `h2` at once, which holds it until the window
    // allows: waiting for capacity first would cost every small response a round of bookkeeping. Only
    // the last: a body streaming small chunks to a slow reader must still wait for capacity, or `h2`
    // would buffer all of it.
    if end && data.len() <= SMALL_CHUNK {
        send.send_data(data, end)?;
        return Ok(());
    }
    while !data.is_empty() {
        send.reserve_capacity(data.len());
        let capacity = poll_fn(|cx| poll_some_capacity(send, cx)).await?;
        let chunk = data.split_to(capacity.min(data.len()));
        send.send_data(chunk, end && data.is_empty())?;
    }
    Ok(())
}

/// The largest last body chunk handed to `h2` without reserving capacity first: one frame at the
/// protocol's default size.
const SMALL_CHUNK: usize = 16 * 1024;

/// Ready once the stream has send capacity, with how much.
fn poll_some_capacity(
    send: &mut SendStream<Bytes>,
    cx: &mut Context<'_>,
) -> Poll<Result<usize, SendError>> {
    loop {
        let capacity = send.capacity();
        if capacity > 0 {
            return Poll::Ready(Ok(capacity));
        }
        match ready!(send.poll_capacity(cx)) {
            Some(Ok(_)) => {}
            Some(Err(error)) => return Poll::Ready(Err(error.into())),
            None => return Poll::Ready(Err(SendError::Closed)),
        }
    }
}
