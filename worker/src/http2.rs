//! HTTP/2 over one connection: the `h2` crate driven through the completion-IO adapter ([`UringIo`]).
//!
//! [`serve_connection`] serves one connection whose first bytes are the HTTP/2 preface (`PRI * HTTP/2.0`):
//! whoever detected the preface passes the bytes it already read as `already_read`, and they are handed
//! to `h2` before anything else is read. The connection runs as **one future**, which the caller polls (in
//! practice: spawns with `tokio_uring::spawn`); it owns the `h2` connection and every stream's work, so
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
//! 4. drives every call's future and response concurrently: the head, then the body's DATA frames under
//!    flow control (capacity is reserved and awaited per chunk, so a slow reader holds back only its own
//!    stream), then trailers if any. An application error becomes a `500` on that stream only; a
//!    response body error resets that stream.
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
//! Architecture Invariant: nothing here knows how a connection was accepted or detected as HTTP/2, nor
//! which runtime drives it beyond the [`Io`] trait.

use std::{
    cell::Cell,
    collections::VecDeque,
    future::{Future, poll_fn},
    pin::pin,
    rc::Rc,
    task::{Context, Poll, Waker, ready},
    time::Duration,
};

use bytes::{Buf, Bytes, BytesMut};
use futures::{StreamExt, stream::FuturesUnordered};
use h2::{
    Reason, RecvStream, SendStream,
    server::{Builder, SendResponse},
};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body::Body;
use http_body_util::BodyExt;
use tokio::{sync::watch, time::Instant};
use tracing::Instrument;

use crate::{
    BoxError,
    budget::{Budget, Charge},
    service::{HttpService, RequestBody},
    stream::{Io, Stream},
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
/// first. The returned future must be polled on the tokio-uring runtime that owns `io`.
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
    let mut receiving = FuturesUnordered::new();
    let mut queued: VecDeque<Received> = VecDeque::new();
    let mut responding = FuturesUnordered::new();
    let mut idle = pin!(tokio::time::sleep(limits.idle_timeout.unwrap_or_default()));
    // Set when the connection sent GOAWAY for idleness or abuse: a peer that has not answered (the
    // PING of a graceful GOAWAY) or read it by then is not waited for.
    let mut give_up = pin!(tokio::time::sleep(Duration::ZERO));
    let mut giving_up = false;
    let mut draining = false;
    let mut aborted = false;
    let mut busy = false;

    // `h2` logs some of the peer's mistakes once per frame; they are rate-limited while it runs.
    poll_fn(|cx| {
        crate::log_limit::quiet_h2(|| {
            loop {
                let mut progress = false;

                if !draining && stop.as_mut().poll(cx).is_ready() {
                    tracing::debug!("Shutting down: GOAWAY");
                    conn.graceful_shutdown();
                    draining = true;
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
                    crate::counter::record_request();
                    let call = match call {
                        None => Ok(service.call(request)),
                        Some(error) => Err(error),
                    };
                    responding.push(
                        respond_to(call, respond, head_only, charge, &resets).instrument(span),
                    );
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
                    draining = true;
                    // A flooding peer need not read its GOAWAY: it is not waited for long.
                    giving_up = true;
                    give_up
                        .as_mut()
                        .reset(Instant::now() + limits.handshake_timeout);
                    progress = true;
                }

                // The idle timer runs while no stream is in flight.
                let in_flight = receiving.len() + queued.len() + responding.len();
                if let Some(timeout) = limits.idle_timeout
                    && !draining
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
                            draining = true;
                            giving_up = true;
                            give_up
                                .as_mut()
                                .reset(Instant::now() + limits.handshake_timeout);
                            progress = true;
                        }
                    }
                }
                if giving_up && (aborted || in_flight == 0) && give_up.as_mut().poll(cx).is_ready()
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

/// Serves HTTP/2 on an accepted TCP stream, like [`serve_connection`]; for tests that drive the server
/// over real sockets.
#[doc(hidden)]
pub async fn serve_tcp<S: HttpService>(
    stream: tokio_uring::net::TcpStream,
    already_read: Vec<u8>,
    service: S,
    limits: &Limits,
    stopped: watch::Receiver<bool>,
) -> Result<(), ConnectionError> {
    let stream = Rc::new(Stream::Tcp(stream));
    let bodies = Budget::new(usize::MAX, None);
    let result = serve_connection(
        stream.clone(),
        already_read,
        service,
        limits,
        &bodies,
        stopped,
    )
    .await;
    stream.shutdown();
    result
}

/// Completes once `stopped` is true or its sender is gone.
async fn wait_stopped(mut stopped: watch::Receiver<bool>) {
    let _ = stopped.wait_for(|stopped| *stopped).await;
}

/// Counts the connection's streams, those the peer reset before their response completed and those
/// that completed, the last two also over a sliding window (see [`Limits::premature_reset_min_streams`]).
#[derive(Debug)]
struct Resets {
    streams: Cell<u64>,
    resets: Cell<u64>,
    /// Set by every reset, taken by the check.
    changed: Cell<bool>,
    recent: Cell<Recent>,
}

/// Resets and completions in the current window and the one before it.
#[derive(Debug, Clone, Copy)]
struct Recent {
    window: Duration,
    start: Instant,
    resets: [u64; 2],
    completed: [u64; 2],
}

// === impl Recent ===

impl Recent {
    /// Moves the window on to `now`.
    fn roll(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.start);
        if elapsed < self.window {
            return;
        }
        if elapsed < 2 * self.window {
            self.resets = [self.resets[1], 0];
            self.completed = [self.completed[1], 0];
            self.start += self.window;
        } else {
            self.resets = [0, 0];
            self.completed = [0, 0];
            self.start = now;
        }
    }

    /// The count over the last window: all of the current one and the part of the previous one the
    /// window still covers.
    fn estimate(&self, counts: [u64; 2], now: Instant) -> f64 {
        let into =
            now.saturating_duration_since(self.start).as_secs_f64() / self.window.as_secs_f64();
        counts[1] as f64 + counts[0] as f64 * (1.0 - into.min(1.0))
    }
}

// === impl Resets ===

impl Resets {
    fn new(window: Duration, now: Instant) -> Self {
        Resets {
            streams: Cell::new(0),
            resets: Cell::new(0),
            changed: Cell::new(false),
            recent: Cell::new(Recent {
                window: window.max(Duration::from_millis(1)),
                start: now,
                resets: [0, 0],
                completed: [0, 0],
            }),
        }
    }

    fn update(&self, now: Instant, f: impl FnOnce(&mut Recent)) {
        let mut recent = self.recent.get();
        recent.roll(now);
        f(&mut recent);
        self.recent.set(recent);
    }

    /// A stream reset by the peer before its response completed.
    fn record(&self, now: Instant) {
        self.resets.set(self.resets.get() + 1);
        self.changed.set(true);
        self.update(now, |r| r.resets[1] += 1);
    }

    /// A stream whose response completed.
    fn completed(&self, now: Instant) {
        self.update(now, |r| r.completed[1] += 1);
    }

    /// Whether the last window saw at least `min_resets` premature resets, and more of them than
    /// completed streams: a client that cancels now and then, or a proxy whose clients cancel while
    /// this thread is busy, stays well below; a rapid-reset flood reaches it within `min_resets`.
    fn too_many(&self, min_resets: u64, now: Instant) -> bool {
        let mut recent = self.recent.get();
        recent.roll(now);
        self.recent.set(recent);
        let resets = recent.estimate(recent.resets, now);
        let completed = recent.estimate(recent.completed, now);
        resets >= min_resets as f64 && resets > completed
    }

    fn error(&self) -> ConnectionError {
        ConnectionError::TooManyResets {
            resets: self.resets.get(),
            streams: self.streams.get(),
        }
    }
}

/// A request whose body has been read, waiting for the application.
struct Received {
    request: Request<RequestBody>,
    respond: SendResponse<Bytes>,
    head_only: bool,
    /// The budget its body holds, given back once its response is done.
    charge: Option<Charge>,
    span: tracing::Span,
}

/// Reads a request's body under flow control: `None` when the stream is done already (refused with
/// `413`, `503` when the body finds no room in the connection's or the worker's budget, `408` when it
/// pauses or lasts too long, or reset by the peer).
///
/// Capacity is released (the peer may send more) only for bytes charged to `bodies`.
async fn receive(
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

/// Sends a short plain-text error response and ends the stream.
fn send_error(respond: &mut SendResponse<Bytes>, status: StatusCode) {
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
async fn respond_to<F, B, E>(
    call: Result<F, BoxError>,
    mut respond: SendResponse<Bytes>,
    head_only: bool,
    charge: Option<Charge>,
    resets: &Resets,
) where
    F: Future<Output = Result<Response<B>, E>>,
    E: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    let response = match call {
        Ok(future) => tokio::select! {
            biased;
            reset = poll_fn(|cx| respond.poll_reset(cx)) => {
                if let Ok(reason) = reset {
                    resets.record(Instant::now());
                    tracing::debug!(?reason, "Stream reset by the peer during the call");
                }
                return;
            }
            response = future => response.map_err(Into::into),
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
    let sent = send_response(respond, response, head_only).await;
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
) -> Result<(), SendError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = response.into_parts();
    for name in CONNECTION_SPECIFIC {
        parts.headers.remove(name);
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
    let end = head_only || body.is_end_stream();
    let mut send = respond.send_response(Response::from_parts(parts, ()), end)?;
    if end {
        return Ok(());
    }
    let mut body = pin!(body);
    loop {
        let frame = tokio::select! {
            biased;
            reset = poll_fn(|cx| send.poll_reset(cx)) => return Err(match reset {
                Ok(reason) => SendError::Reset(reason),
                Err(error) => error.into(),
            }),
            frame = body.frame() => frame,
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
    while !data.is_empty() {
        send.reserve_capacity(data.len());
        let capacity = poll_fn(|cx| poll_some_capacity(send, cx)).await?;
        let chunk = data.split_to(capacity.min(data.len()));
        send.send_data(chunk, end && data.is_empty())?;
    }
    Ok(())
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn premature_resets_count_after_the_minimum_within_the_window() {
        let start = Instant::now();
        let window = Duration::from_secs(10);
        let resets = Resets::new(window, start);
        for _ in 0..99 {
            resets.record(start);
        }
        assert!(!resets.too_many(100, start), "below the minimum");
        resets.record(start);
        assert!(resets.too_many(100, start));
        // As many completions: a client that cancels half of what it asks for.
        for _ in 0..100 {
            resets.completed(start);
        }
        assert!(!resets.too_many(100, start));
    }

    #[test]
    fn old_resets_leave_the_window() {
        let start = Instant::now();
        let window = Duration::from_secs(10);
        let resets = Resets::new(window, start);
        // 45 cancellations every 10 s, for a minute, with nothing completed (a busy thread): never
        // 100 within one window.
        for tick in 0..6u32 {
            let at = start + window * tick + Duration::from_millis(1);
            for _ in 0..45 {
                resets.record(at);
            }
            assert!(!resets.too_many(100, at), "tick {tick}");
        }
        // Half a window later, the previous window counts half.
        let later = start + window * 6 + window / 2;
        resets.record(later);
        assert!(!resets.too_many(100, later));
        // Long after, a burst of 100 is caught at once, however much came before.
        let much_later = later + window * 5;
        for _ in 0..100 {
            resets.record(much_later);
        }
        assert!(resets.too_many(100, much_later));
    }
}
