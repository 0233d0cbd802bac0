//! HTTP/2 over one connection: the `h2` crate driven through the completion-IO adapter ([`UringIo`]).
//!
//! [`serve_connection`] serves one connection whose first bytes are the HTTP/2 preface (`PRI * HTTP/2.0`):
//! whoever detected the preface passes the bytes it already read as `already_read`, and they are handed
//! to `h2` before anything else is read. The connection runs as **one future**, which the caller polls (in
//! practice: spawns on the worker's runtime); it owns the `h2` connection and every stream's work, so
//! dropping it drops them all. Nothing is spawned. Each turn it:
//!
//! 1. polls the `h2` connection, which reads and writes frames and hands over new streams;
//! 2. reads each stream's request body (releasing flow-control capacity as it consumes and charges it,
//!    so a body larger than the window flows; a body over [`Limits::max_body_bytes`] is answered with
//!    `413`, one that finds no room in the connection's or the worker's body budget `503`, one that
//!    pauses for [`Limits::body_read_timeout`] or outlasts [`Limits::body_timeout`] `408`);
//! 3. hands complete requests to the application one at a time, in the order they completed
//!    (`poll_ready` then `call`: the service is `&mut` per connection), counting each in
//!    [`crate::counter`]; a stream the peer reset while it waited is dropped without a call;
//! 4. polls each call's response future once where the call is made: most are ready at once, and
//!    their responses are sent from there, the future living in a box kept for the next call; one
//!    that must wait joins the others, and they are all driven concurrently: the head, then the
//!    body's DATA frames under flow control (capacity is reserved and awaited per chunk, so a slow
//!    reader holds back only its own stream; a body's last chunk, when one frame or less, goes to
//!    `h2` at once, which holds it until the window allows), then trailers if any. An application
//!    error becomes a `500` on that stream only; a response body error resets that stream.
//!
//! A stream the peer resets stops its work at once (its call's future is dropped).
//!
//! **Shutdown.** When `stopped` turns true (or its sender is dropped), the connection sends GOAWAY
//! (`h2`'s graceful shutdown: GOAWAY with the last stream id after a PING round trip), refuses new
//! streams, lets the streams in flight finish and then returns `Ok(())`. A connection without streams for
//! [`Limits::idle_timeout`] shuts down the same way, and returns if the peer has not answered within
//! [`Limits::handshake_timeout`] (a peer that never reads never acknowledges the PING). The handshake
//! itself must complete within [`Limits::handshake_timeout`]. There is no drain deadline here: the
//! server's drain timeout bounds how long it waits for connections.
//!
//! **Abuse.** Rapid reset (streams opened and reset at once) is caught by a rate: the connection is
//! closed with `ENHANCE_YOUR_CALM` when, within the last [`Limits::premature_reset_window`], the peer
//! reset at least [`Limits::premature_reset_min_streams`] streams before their response completed and
//! more streams than completed in that window. A count over the connection's life would catch a proxy:
//! Envoy resets a stream whenever its client goes away, and while this thread is busy in a long call,
//! those resets pile up, and the streams that complete meanwhile are few. `h2`'s own cap,
//! [`Limits::max_pending_accept_reset_streams`], counts reset streams not yet accepted, which is
//! exactly what piles up while the thread is busy; it is sized to bound the accept queue's memory,
//! not to detect anything. A reset stream costs the application nothing (it is never called), so a
//! flood costs frames only. Locally caused resets are bounded by
//! [`Limits::max_local_error_reset_streams`], the header list by [`Limits::max_header_list_size`].
//! `h2` logs some peer mistakes at WARN per frame (an unsolicited PING acknowledgement); while it runs,
//! its warnings are rate-limited (one line per 5 s, then a count of those suppressed).
//!
//! **Memory.** Request bodies a connection holds (read, and not yet done with: until their response
//! is sent) are charged to a budget of [`Limits::max_connection_body_bytes`] within the worker's
//! ([`crate::server::Config::max_buffered_body_bytes`]); capacity is released only for charged bytes, and
//! the connection window is at most that budget, so what the peer can make this side hold, read or not,
//! is bounded by it. Responses add at most `max_send_buffer_size` per stream in `h2`.
//!
//! The parts: this module holds the settings and the connection's loop; `request` reads and charges
//! request bodies, `response` drives calls to responses sent under flow control, and `resets` keeps the
//! rapid-reset rate.
//!
//! Architecture Invariant: nothing here knows how a connection was accepted or detected as HTTP/2, nor
//! which runtime drives it beyond the [`Io`] trait.

mod request;
mod resets;
mod response;
#[cfg(test)]
mod socket_tests;

use std::{
    collections::VecDeque,
    future::{Future, poll_fn},
    pin::{Pin, pin},
    rc::Rc,
    task::{Context, Poll, Waker},
    time::Duration,
};

use bytes::Bytes;
use futures::{FutureExt, StreamExt, stream::FuturesUnordered};
use h2::{Reason, server::Builder};
use http::{Method, Request};
use tokio::{
    sync::watch,
    time::{Instant, Sleep},
};
use tracing::Instrument;

use self::{
    request::{Received, receive},
    resets::Resets,
    response::respond_to,
};
use crate::{
    budget::Budget,
    load_report::Carried,
    service::{HttpService, RequestBody},
    stream::Io,
    uring_io::UringIo,
};

/// The settings and limits of an HTTP/2 connection.
///
/// The defaults:
///
/// | field | default |
/// |---|---|
/// | `max_concurrent_streams` | 256 |
/// | `max_header_list_size` | 16 KiB |
/// | `max_body_bytes` | 1 MiB (as HTTP/1) |
/// | `max_connection_body_bytes` | 32 MiB |
/// | `initial_stream_window` | 1 MiB |
/// | `initial_connection_window` | 4 MiB (never more than `max_connection_body_bytes`) |
/// | `max_frame_size` | 16 KiB (the protocol's default) |
/// | `max_send_buffer_size` | 256 KiB |
/// | `max_pending_accept_reset_streams` | 1024 |
/// | `max_local_error_reset_streams` | 1024 |
/// | `premature_reset_min_streams` | 200 |
/// | `premature_reset_window` | 10 s |
/// | `handshake_timeout` | 10 s |
/// | `body_read_timeout` | 10 s |
/// | `body_timeout` | 60 s |
/// | `idle_timeout` | 60 s |
///
/// The windows were measured on loopback (the `throughput` test in `tests/http2.rs`, release build: 8
/// streams echoing 16 MiB each on one connection): a 64 KiB stream window moved about 850 MiB/s, 1 MiB
/// about 1000 MiB/s, 4 MiB about 900 MiB/s. A higher round-trip time favours larger windows.
#[derive(Clone, Debug)]
pub struct Limits {
    /// How many streams the peer may have open at once (`SETTINGS_MAX_CONCURRENT_STREAMS`).
    pub max_concurrent_streams: u32,
    /// The largest header list (decoded, as HTTP/2 counts it) a request may carry
    /// (`SETTINGS_MAX_HEADER_LIST_SIZE`); more resets the stream.
    pub max_header_list_size: u32,
    /// The largest request body, in bytes; more is answered with `413`.
    pub max_body_bytes: usize,
    /// How many bytes of request bodies one connection buffers at once (what the streams read and
    /// hold until their response is done); a stream whose body finds no room here, or in the worker's
    /// budget ([`crate::server::Config::max_buffered_body_bytes`]), is answered `503`. The connection
    /// window never exceeds it, so what the peer may send unread is bounded by it too.
    pub max_connection_body_bytes: usize,
    /// How many bytes of a request body the peer may send before this side reads them
    /// (`SETTINGS_INITIAL_WINDOW_SIZE`).
    pub initial_stream_window: u32,
    /// How many bytes of request bodies the peer may send on the connection before this side reads them;
    /// at most `max_connection_body_bytes`.
    pub initial_connection_window: u32,
    /// The largest frame payload the peer may send (`SETTINGS_MAX_FRAME_SIZE`, 16 KiB to 16 MiB - 1).
    pub max_frame_size: u32,
    /// How many bytes of response data `h2` buffers per stream before it stops granting capacity.
    pub max_send_buffer_size: usize,
    /// How many streams reset by the peer may wait in `h2`'s accept queue before the connection is closed
    /// with `ENHANCE_YOUR_CALM`. This bounds the queue's memory, not a rate: streams are accepted as soon
    /// as the connection is polled, so the queue holds what one read brought, and a busy thread (an
    /// application call that runs long) lets a proxy's cancellations pile up there legitimately. Rapid
    /// reset is caught by the premature-reset rule instead.
    pub max_pending_accept_reset_streams: usize,
    /// How many streams this side may reset because of the peer's protocol errors before the connection
    /// is closed with `ENHANCE_YOUR_CALM`.
    pub max_local_error_reset_streams: usize,
    /// The premature-reset rule: a connection whose peer, within the last `premature_reset_window`,
    /// reset at least this many streams before their response completed, and more streams than it saw
    /// completed, is closed with `ENHANCE_YOUR_CALM`.
    pub premature_reset_min_streams: u64,
    /// The sliding window of the premature-reset rule.
    pub premature_reset_window: Duration,
    /// How long a new connection has to complete the HTTP/2 handshake (preface and SETTINGS), and a
    /// peer sent GOAWAY for idleness or abuse has to answer (or read) it before the socket is closed.
    pub handshake_timeout: Duration,
    /// How long a request body may go without a DATA frame; then it is answered `408`.
    pub body_read_timeout: Duration,
    /// How long a whole request body may take, from its HEADERS; then it is answered `408`.
    pub body_timeout: Duration,
    /// How long a connection without streams stays open; `None` keeps it open.
    pub idle_timeout: Option<Duration>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_concurrent_streams: 256,
            max_header_list_size: 16 * 1024,
            max_body_bytes: 1024 * 1024,
            max_connection_body_bytes: 32 * 1024 * 1024,
            initial_stream_window: 1024 * 1024,
            initial_connection_window: 4 * 1024 * 1024,
            max_frame_size: 16 * 1024,
            max_send_buffer_size: 256 * 1024,
            max_pending_accept_reset_streams: 1024,
            max_local_error_reset_streams: 1024,
            premature_reset_min_streams: 200,
            premature_reset_window: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            idle_timeout: Some(Duration::from_secs(60)),
        }
    }
}

impl Limits {
    fn builder(&self) -> Builder {
        let cap = u32::try_from(self.max_connection_body_bytes).unwrap_or(u32::MAX);
        let mut builder = Builder::new();
        builder
            .max_concurrent_streams(self.max_concurrent_streams)
            .max_header_list_size(self.max_header_list_size)
            .initial_window_size(self.initial_stream_window.min(cap))
            .initial_connection_window_size(self.initial_connection_window.min(cap))
            .max_frame_size(self.max_frame_size)
            .max_send_buffer_size(self.max_send_buffer_size)
            .max_pending_accept_reset_streams(self.max_pending_accept_reset_streams)
            .max_local_error_reset_streams(Some(self.max_local_error_reset_streams));
        builder
    }
}

/// An HTTP/2 GOAWAY frame, last stream 0, `PROTOCOL_ERROR`: the answer to a broken preface (RFC 9113,
/// section 3.4), sent before the connection closes. `server` sends it to a connection that begins
/// `PRI ` but is not the preface, and `http1` to one whose first request line names no HTTP version:
/// either peer meant HTTP/2, and an HTTP/1 answer would be garbage to it.
pub(crate) const GOAWAY_PROTOCOL_ERROR: [u8; 17] = [
    0, 0, 8, // length
    7, // type: GOAWAY
    0, // flags
    0, 0, 0, 0, // stream 0
    0, 0, 0, 0, // last stream id
    0, 0, 0, 1, // PROTOCOL_ERROR
];

/// Why an HTTP/2 connection ended with an error.
#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    /// The client did not complete the HTTP/2 handshake.
    #[error("http/2 handshake failed")]
    Handshake(#[source] h2::Error),
    /// The client sent no preface and SETTINGS within the handshake timeout.
    #[error("http/2 handshake timed out")]
    HandshakeTimeout,
    /// The connection failed: an IO error, a protocol error, or a limit `h2` enforces.
    #[error("http/2 connection failed")]
    Connection(#[source] h2::Error),
    /// The peer reset too many of its streams; the connection was closed with `ENHANCE_YOUR_CALM`.
    #[error("the peer reset {resets} of {streams} streams")]
    TooManyResets {
        /// The streams the peer reset before their response completed.
        resets: u64,
        /// The streams the peer opened.
        streams: u64,
    },
}

/// Serves HTTP/2 on `io` until the peer closes, a connection error, or a graceful shutdown (`stopped`
/// turning true, or the idle timeout) completes; see the module docs.
///
/// `already_read` are bytes read from `io` before (the preface, or part of it); they are handed to `h2`
/// first. The returned future must be polled on the worker's runtime, which drives `io`.
pub(crate) async fn serve_connection<S, T>(
    io: Rc<T>,
    already_read: Vec<u8>,
    mut service: S,
    limits: &Limits,
    worker_bodies: &Rc<Budget>,
    stopped: watch::Receiver<bool>,
) -> Result<(), ConnectionError>
where
    S: HttpService,
    T: Io + 'static,
{
    let io = UringIo::new(io, already_read);
    let mut stop = pin!(wait_stopped(stopped));
    let bodies = Budget::new(
        limits.max_connection_body_bytes,
        Some(worker_bodies.clone()),
    );

    let handshake = limits.builder().handshake::<_, Bytes>(io);
    let handshake = async {
        tokio::time::timeout(limits.handshake_timeout, handshake)
            .await
            .map_err(|_| ConnectionError::HandshakeTimeout)?
            .map_err(ConnectionError::Handshake)
    };
    let mut conn = tokio::select! {
        conn = handshake => conn?,
        () = stop.as_mut() => return Ok(()),
    };
    tracing::debug!("HTTP/2 connection established");

    let resets = Resets::new(limits.premature_reset_window, Instant::now());
    // Which load report the connection last carried (each goes out once per connection).
    let carried = Carried::default();
    let mut receiving = FuturesUnordered::new();
    let mut queued: VecDeque<Received> = VecDeque::new();
    let mut responding = FuturesUnordered::new();
    let mut spare = None;
    let mut idle = pin!(tokio::time::sleep(limits.idle_timeout.unwrap_or_default()));
    let mut closing = Closing {
        draining: false,
        giving_up: false,
        give_up: pin!(tokio::time::sleep(Duration::ZERO)),
    };
    let mut aborted = false;
    let mut busy = false;

    // `h2` logs some of the peer's mistakes once per frame; they are rate-limited while it runs.
    poll_fn(|cx| {
        crate::log_limit::quiet_h2(|| {
            loop {
                let mut progress = false;

                if !closing.draining && stop.as_mut().poll(cx).is_ready() {
                    tracing::debug!("Shutting down: GOAWAY");
                    conn.graceful_shutdown();
                    closing.draining = true;
                }

                // The `h2` connection: frames in and out, new streams.
                match conn.poll_accept(cx) {
                    Poll::Ready(Some(Ok((request, respond)))) => {
                        resets.streams.set(resets.streams.get() + 1);
                        let span =
                            tracing::debug_span!("stream", id = respond.stream_id().as_u32());
                        if request.body().is_end_stream() {
                            // No body to read (a GET, say): straight to the application.
                            let (parts, _) = request.into_parts();
                            queued.push_back(Received {
                                head_only: parts.method == Method::HEAD,
                                request: Request::from_parts(parts, RequestBody::default()),
                                respond,
                                charge: None,
                                span,
                            });
                        } else {
                            receiving.push(
                                receive(request, respond, limits, &bodies, &resets, span.clone())
                                    .instrument(span),
                            );
                        }
                        progress = true;
                    }
                    Poll::Ready(Some(Err(error))) => {
                        return Poll::Ready(Err(if aborted {
                            resets.error()
                        } else {
                            ConnectionError::Connection(error)
                        }));
                    }
                    Poll::Ready(None) => {
                        tracing::debug!("HTTP/2 connection closed");
                        return Poll::Ready(if aborted { Err(resets.error()) } else { Ok(()) });
                    }
                    Poll::Pending => {}
                }

                // Request bodies.
                while let Poll::Ready(Some(received)) = receiving.poll_next_unpin(cx) {
                    progress = true;
                    queued.extend(received);
                }

                // The application, one call at a time.
                while !queued.is_empty() {
                    let call = match service.poll_ready(cx) {
                        Poll::Pending => break,
                        Poll::Ready(Ok(())) => None,
                        Poll::Ready(Err(error)) => Some(error.into()),
                    };
                    let Some(Received {
                        request,
                        mut respond,
                        head_only,
                        charge,
                        span,
                    }) = queued.pop_front()
                    else {
                        break;
                    };
                    progress = true;
                    // A stream the peer reset while it waited (a proxy whose client went away while this
                    // thread was busy, say) costs the application nothing.
                    if let Poll::Ready(reset) =
                        respond.poll_reset(&mut Context::from_waker(Waker::noop()))
                    {
                        if reset.is_ok() {
                            resets.record(Instant::now());
                        }
                        span.in_scope(|| tracing::debug!("Stream reset before the call, skipped"));
                        continue;
                    }
                    let open = crate::counter::record_request();
                    let call = match call {
                        None => Ok(service.call(request)),
                        Some(error) => Err(error),
                    };
                    // Most calls are ready at once: the response is sent from here, in a box kept
                    // for the next one, and only one that must wait joins `responding`.
                    let response =
                        respond_to(call, (respond, open), head_only, charge, &resets, &carried)
                            .instrument(span);
                    let mut slot = match spare.take() {
                        Some(mut slot) => {
                            Pin::set(&mut slot, response.fuse());
                            slot
                        }
                        None => Box::pin(response.fuse()),
                    };
                    if slot.as_mut().poll(cx).is_ready() {
                        spare = Some(slot);
                    } else {
                        responding.push(slot);
                    }
                }

                // Responses.
                while let Poll::Ready(Some(())) = responding.poll_next_unpin(cx) {
                    progress = true;
                }

                if !aborted
                    && resets.changed.take()
                    && resets.too_many(limits.premature_reset_min_streams, Instant::now())
                {
                    tracing::warn!(
                        resets = resets.resets.get(),
                        streams = resets.streams.get(),
                        window_ms = limits.premature_reset_window.as_millis() as u64,
                        "Peer resets too many streams, closing the connection"
                    );
                    conn.abrupt_shutdown(Reason::ENHANCE_YOUR_CALM);
                    aborted = true;
                    // A flooding peer need not read its GOAWAY: it is not waited for long.
                    closing.give_up_after(limits.handshake_timeout);
                    progress = true;
                }

                // The idle timer runs while no stream is in flight.
                let in_flight = receiving.len() + queued.len() + responding.len();
                if let Some(timeout) = limits.idle_timeout
                    && !closing.draining
                {
                    if in_flight > 0 {
                        busy = true;
                    } else {
                        if busy {
                            busy = false;
                            idle.as_mut().reset(Instant::now() + timeout);
                        }
                        if idle.as_mut().poll(cx).is_ready() {
                            tracing::debug!("Idle connection: GOAWAY");
                            conn.graceful_shutdown();
                            closing.give_up_after(limits.handshake_timeout);
                            progress = true;
                        }
                    }
                }
                if closing.giving_up
                    && (aborted || in_flight == 0)
                    && closing.give_up.as_mut().poll(cx).is_ready()
                {
                    tracing::debug!("The peer did not answer GOAWAY in time, closing");
                    return Poll::Ready(if aborted { Err(resets.error()) } else { Ok(()) });
                }

                if !progress {
                    return Poll::Pending;
                }
            }
        })
    })
    .await
}

/// How far a connection is in closing.
struct Closing<'t> {
    /// A GOAWAY went out: the streams in flight finish, no new ones are accepted.
    draining: bool,
    /// Set when the connection sent GOAWAY for idleness or abuse: a peer that has not answered (the
    /// PING of a graceful GOAWAY) or read it once `give_up` fires is not waited for.
    giving_up: bool,
    give_up: Pin<&'t mut Sleep>,
}

// === impl Closing ===

impl Closing<'_> {
    /// After a GOAWAY the peer must answer or read: drains, and waits at most `timeout` for the peer.
    fn give_up_after(&mut self, timeout: Duration) {
        self.draining = true;
        self.giving_up = true;
        self.give_up.as_mut().reset(Instant::now() + timeout);
    }
}

/// Completes once `stopped` is true or its sender is gone.
async fn wait_stopped(mut stopped: watch::Receiver<bool>) {
    let _ = stopped.wait_for(|stopped| *stopped).await;
}
