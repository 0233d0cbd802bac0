//! The connection loop: read, answer every complete request in order, write the batch, wait for more.
//!
//! Each turn parses every complete request already in `input`, calls the application for each in order,
//! appends the responses to `output` and queues the batch on the stream, which sends it at the end of
//! the driver's turn; the connection goes on to wait for the client's bytes without waiting for the
//! send (unless the stream's send queue is full), bounded by the header, body and idle timeouts and by
//! shutdown.
//!
//! Invariant: one request at a time is buffered beyond what is parsed; what `input` holds beyond a head
//! and a read is charged to the worker's budget before the next read, and a connection that cannot be
//! charged is answered `503` and closed. Every path that gives up on the peer shuts the socket down.

use std::{
    future::poll_fn,
    io,
    pin::{Pin, pin},
    rc::Rc,
    task::{Context, Poll, Waker},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use tokio::{sync::watch, time::Sleep};

use super::{
    Limits,
    encode::{BodyError, encode_error, flush, write_response},
    parse::{Parsed, Progress, Reject, SHARE_BELOW, Source, connection_has, parse},
};
use crate::{
    BoxError,
    budget::{Budget, Charge},
    http2::GOAWAY_PROTOCOL_ERROR,
    load_report::Carried,
    service::{HttpService, RequestBody},
    stream::Io,
};

/// How many bytes one read may add to `input` beyond a head, uncharged.
const READ_CHUNK: usize = 16 * 1024;

/// The least room `input` has before a read: a typical request head. It grows by doubling from there,
/// so an idle connection holds about a kilobyte, not a chunk.
const MIN_ROOM: usize = 1024;

const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// Serves HTTP/1 requests on `io` until the client closes, a request asks to close, a request is
/// refused, a timeout passes, or `shutdown` fires while the connection is idle.
///
/// After `shutdown` fires, the requests already read are answered (with `connection: close`) and the
/// connection closes. A request head that takes longer than [`Limits::header_timeout`] is answered
/// `408`, and so is a body that pauses for [`Limits::body_read_timeout`] or takes longer than
/// [`Limits::body_timeout`]; a connection idle for [`Limits::idle_timeout`] closes. The input buffer is
/// charged to `bodies` beyond a head and a read; a request it cannot grow for is answered `503` and
/// the connection closes. Returns an error only for a failed read or write.
///
/// `already_read` holds the bytes read before the connection was handed over (to tell HTTP/1 from
/// HTTP/2); they are parsed first.
pub(crate) async fn serve_connection<I, S>(
    io: I,
    already_read: Vec<u8>,
    service: S,
    limits: &Limits,
    bodies: &Rc<Budget>,
    shutdown: watch::Receiver<bool>,
) -> io::Result<()>
where
    I: Io,
    S: HttpService,
{
    let mut input = already_read;
    input.reserve(MIN_ROOM);
    let mut connection = Connection {
        io,
        service,
        limits,
        bodies,
        stop: Box::pin(stopped(shutdown.clone())),
        shutdown,
        input,
        output: Vec::new(),
        allowance: limits.max_head_bytes + READ_CHUNK,
        charge: Charge::new(bodies),
        clocks: Clocks::default(),
        idle: Idle {
            since: Instant::now(),
            served: false,
            timeout: limits.idle_timeout,
            timer: pin!(tokio::time::sleep(limits.idle_timeout)),
        },
        continued: false,
        first_request: true,
        carried: Carried::default(),
    };
    connection.run().await
}

/// One connection's state between turns.
struct Connection<'a, 't, I, S> {
    io: I,
    service: S,
    limits: &'a Limits,
    bodies: &'a Rc<Budget>,
    shutdown: watch::Receiver<bool>,
    /// Completes once shutdown begins. Made once per connection: an idle wait polls it, and it stays
    /// registered between waits, where a `changed()` future per wait would register and deregister
    /// each time.
    stop: Pin<Box<dyn Future<Output = ()>>>,
    /// Bytes read and not yet answered.
    input: Vec<u8>,
    /// The responses of this turn, written at its end.
    output: Vec<u8>,
    /// What `input` may hold uncharged: a head and a read. Beyond it, it is charged to the worker's
    /// budget through `charge`.
    allowance: usize,
    charge: Charge,
    clocks: Clocks,
    idle: Idle<'t>,
    /// Whether `100 Continue` went out for the request at the front of `input`.
    continued: bool,
    first_request: bool,
    /// Which load report the connection last carried (each goes out once per connection).
    carried: Carried,
}

/// What the front of `input` still lacks after a turn's parsing.
#[derive(Clone, Copy, Debug, Default)]
struct Pending {
    /// Part of a head.
    head: bool,
    /// A whole head: only (part of) its body is missing.
    body: bool,
    /// How many bytes the whole request takes, when its `content-length` says.
    need: Option<usize>,
}

/// How a turn's parsing ended.
enum Turn {
    /// The connection closes once the output is written.
    Close,
    /// The connection waits for more bytes.
    Wait(Pending),
}

/// What ended the wait for more of the client's bytes.
enum Next {
    /// A read completed.
    Read(io::Result<usize>, Vec<u8>),
    /// Shutdown began or the idle timeout passed while the connection was idle.
    Close,
    /// The request head or body did not arrive in time.
    Timeout,
}

/// How long the connection may wait for the client's bytes.
#[derive(Clone, Copy, Debug)]
enum Waiting {
    /// No request has begun: until shutdown or the idle timeout.
    Idle,
    /// A request has begun: until its head or body deadline.
    Until(Instant),
    /// For as long as the client takes.
    Unbounded,
}

// === impl Connection ===

impl<I: Io, S: HttpService> Connection<'_, '_, I, S> {
    async fn run(&mut self) -> io::Result<()> {
        loop {
            let pending = match self.answer_buffered().await? {
                Turn::Wait(pending) => pending,
                Turn::Close => return self.flush_and_close().await,
            };
            if !self.size_input(pending) {
                tracing::debug!(
                    buffered = self.bodies.used(),
                    wanted = self.input.capacity(),
                    "The worker's request-body budget is spent, answering 503"
                );
                return self.refuse(StatusCode::SERVICE_UNAVAILABLE).await;
            }
            let waiting = self.waiting(pending);
            // The responses go out while the next read is already submitted: both operations reach the
            // kernel in the same submission, one event-loop turn per request instead of two.
            let (written, next) = tokio::join!(
                flush(&self.io, &mut self.output),
                read_more(
                    &self.io,
                    std::mem::take(&mut self.input),
                    waiting,
                    &mut self.idle,
                    &mut self.shutdown,
                    self.stop.as_mut(),
                ),
            );
            written?;
            match next {
                Next::Read(result, buf) => {
                    self.input = buf;
                    if result? == 0 {
                        // The client closed; a partial request left in the buffer is dropped.
                        return Ok(());
                    }
                    if pending.body {
                        self.clocks.body_progress = Some(Instant::now());
                    }
                }
                Next::Close => {
                    self.io.shutdown();
                    return Ok(());
                }
                Next::Timeout => {
                    tracing::debug!(body = pending.body, "Request timeout, answering 408");
                    return self.refuse(Reject::Timeout.status()).await;
                }
            }
        }
    }

    /// Answers every complete request at the front of `input`, in order, and drops their bytes.
    async fn answer_buffered(&mut self) -> io::Result<Turn> {
        let shared = (self.input.len() < SHARE_BELOW).then(|| Bytes::copy_from_slice(&self.input));
        let mut start = 0;
        let turn = loop {
            let src = match &shared {
                Some(shared) => Source::shared(shared, start),
                None => Source::copied(&self.input[start..]),
            };
            let progress = parse(src, self.limits);
            let parsed = match self.front(progress, start < self.input.len()) {
                Ok(parsed) => parsed,
                Err(turn) => break turn,
            };
            start += parsed.len;
            if self.answer(parsed).await? {
                break Turn::Close;
            }
        };
        drop(shared);
        self.input.drain(..start);
        Ok(turn)
    }

    /// Takes in what parsing found at the front of `input`: a whole request, to answer (its clocks
    /// begin anew), or how the turn ends: an incomplete request waits for more bytes (and may be told to
    /// go on, `100 Continue`), a refused one gets its answer and the connection closes. `unparsed` says
    /// bytes follow the last request answered.
    fn front(
        &mut self,
        progress: Result<Progress, Reject>,
        unparsed: bool,
    ) -> Result<Parsed, Turn> {
        match progress {
            Ok(Progress::Complete(parsed)) => {
                self.continued = false;
                self.first_request = false;
                self.clocks = Clocks::default();
                self.idle.served = true;
                Ok(parsed)
            }
            Ok(Progress::Partial {
                head_done,
                expects_continue,
                need,
            }) => {
                if expects_continue && !self.continued {
                    self.output.extend_from_slice(CONTINUE);
                    self.continued = true;
                }
                Err(Turn::Wait(Pending {
                    head: !head_done && unparsed,
                    body: head_done,
                    need,
                }))
            }
            Err(Reject::NotHttp1) if self.first_request => {
                // No HTTP/1 version: the peer may be an HTTP/2 client with a broken preface.
                tracing::debug!("Not HTTP/1, answering an HTTP/2 GOAWAY");
                self.output.extend_from_slice(&GOAWAY_PROTOCOL_ERROR);
                Err(Turn::Close)
            }
            Err(reject) => {
                tracing::debug!(?reject, "Refusing request");
                encode_error(&mut self.output, reject.status());
                Err(Turn::Close)
            }
        }
    }

    /// Calls the application with one request and appends its response; returns whether the
    /// connection closes after it.
    async fn answer(&mut self, parsed: Parsed) -> io::Result<bool> {
        // In flight until the response is written, or this future is dropped with its connection.
        let _open = crate::counter::record_request();
        let version = parsed.request.version();
        let head_only = parsed.request.method() == Method::HEAD;
        let res = match call(&mut self.service, parsed.request).await {
            Ok(res) => res,
            Err(error) => {
                tracing::warn!(%error, "Application failed, answering 500");
                encode_error(&mut self.output, StatusCode::INTERNAL_SERVER_ERROR);
                return Ok(true);
            }
        };
        let keep_alive = parsed.keep_alive
            && !connection_has(res.headers(), "close")
            && !*self.shutdown.borrow();
        let written = write_response(
            &self.io,
            &mut self.output,
            res,
            version,
            head_only,
            keep_alive,
            &self.carried,
        )
        .await;
        match written {
            Ok(keep_alive) => Ok(!keep_alive),
            Err(BodyError::Io(error)) => Err(error),
            Err(error) => {
                // The response is cut short; only closing the connection tells the client.
                tracing::warn!(%error, "Response body failed, closing the connection");
                Ok(true)
            }
        }
    }

    /// Sizes `input` for what the request at its front still needs and charges it to the worker's
    /// budget; false when the budget has no room for it.
    fn size_input(&mut self, pending: Pending) -> bool {
        let input = &mut self.input;
        size_for(input, pending, self.allowance);
        self.charge
            .set(input.capacity().saturating_sub(self.allowance))
    }

    /// How long the next wait for bytes may last; starts the clocks of what is pending.
    fn waiting(&mut self, pending: Pending) -> Waiting {
        let idle = self.input.is_empty();
        let now = Instant::now();
        let deadline = self.clocks.deadline(pending, now, self.limits);
        if idle && std::mem::take(&mut self.idle.served) {
            self.idle.since = now;
        }
        match deadline {
            _ if idle => Waiting::Idle,
            Some(deadline) => Waiting::Until(deadline),
            None => Waiting::Unbounded,
        }
    }

    /// Answers `status` (refusing what the client sent) and closes.
    async fn refuse(&mut self, status: StatusCode) -> io::Result<()> {
        encode_error(&mut self.output, status);
        self.flush_and_close().await
    }

    /// Writes what is left of the output and shuts the connection down.
    async fn flush_and_close(&mut self) -> io::Result<()> {
        flush(&self.io, &mut self.output).await?;
        self.io.shutdown();
        Ok(())
    }
}

/// Calls `service` with `request` once it is ready. Most services are ready at once: readiness is asked
/// without a future first.
async fn call<S: HttpService>(
    service: &mut S,
    request: Request<RequestBody>,
) -> Result<http::Response<S::ResBody>, BoxError> {
    let ready = match service.poll_ready(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(ready) => ready,
        Poll::Pending => poll_fn(|cx| service.poll_ready(cx)).await,
    };
    match ready {
        Ok(()) => service.call(request).await.map_err(Into::into),
        Err(error) => Err(error.into()),
    }
}

/// Reads more of the client's bytes into `input` (its spare capacity), waiting as `waiting` allows.
async fn read_more<I: Io>(
    io: &I,
    input: Vec<u8>,
    waiting: Waiting,
    idle: &mut Idle<'_>,
    shutdown: &mut watch::Receiver<bool>,
    stop: Pin<&mut (dyn Future<Output = ()> + '_)>,
) -> Next {
    let read = crate::stream::read(io, input);
    match waiting {
        Waiting::Idle => {
            if *shutdown.borrow_and_update() {
                return Next::Close;
            }
            tokio::select! {
                biased;
                (result, buf) = read => Next::Read(result, buf),
                () = stop => Next::Close,
                () = idle.expired() => {
                    tracing::debug!("Idle timeout, closing");
                    Next::Close
                }
            }
        }
        Waiting::Until(deadline) => tokio::select! {
            biased;
            (result, buf) = read => Next::Read(result, buf),
            () = tokio::time::sleep_until(deadline.into()) => Next::Timeout,
        },
        Waiting::Unbounded => {
            let (result, buf) = read.await;
            Next::Read(result, buf)
        }
    }
}

/// Completes once `shutdown` is true or its sender is gone.
async fn stopped(mut shutdown: watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stopped| *stopped).await;
}

/// The clocks of the request at the front of `input`, for its timeouts.
#[derive(Debug, Default)]
struct Clocks {
    /// When its head was first seen incomplete.
    head_since: Option<Instant>,
    /// When its body began (its head ended).
    body_since: Option<Instant>,
    /// When a byte of its body last came.
    body_progress: Option<Instant>,
}

// === impl Clocks ===

impl Clocks {
    /// When the wait for what is `pending` times out, if it can; starts the clock of what began now.
    fn deadline(&mut self, pending: Pending, now: Instant, limits: &Limits) -> Option<Instant> {
        if pending.head {
            Some(*self.head_since.get_or_insert(now) + limits.header_timeout)
        } else if pending.body {
            self.head_since = None;
            let since = *self.body_since.get_or_insert(now);
            let progress = self.body_progress.unwrap_or(since);
            Some((since + limits.body_timeout).min(progress + limits.body_read_timeout))
        } else {
            *self = Clocks::default();
            None
        }
    }
}

/// The idle timeout of a kept-alive connection.
struct Idle<'t> {
    /// When the connection last began to wait for a request. The timer is re-armed from it only when
    /// it fires, so requests cost no timer work.
    since: Instant,
    /// Whether a request came since the connection last began to wait.
    served: bool,
    timeout: Duration,
    timer: Pin<&'t mut Sleep>,
}

// === impl Idle ===

impl Idle<'_> {
    /// Completes once the connection has waited [`Limits::idle_timeout`] since it last began to wait.
    async fn expired(&mut self) {
        loop {
            self.timer.as_mut().await;
            let due = self.since + self.timeout;
            if Instant::now() >= due {
                return;
            }
            self.timer.as_mut().reset(due.into());
        }
    }
}

/// Sizes `input` for the request at its front (see [`Connection::size_input`]): a large buffer left
/// from a finished request shrinks back; a body of known size gets room for exactly the rest of the
/// request and no more; otherwise a read gets at least [`MIN_ROOM`], growing by doubling up to a chunk
/// at a time.
fn size_for(input: &mut Vec<u8>, pending: Pending, allowance: usize) {
    // A large request is done: give its buffer back rather than keep it for the connection's life.
    if input.capacity() > 2 * allowance && input.len() < READ_CHUNK {
        input.shrink_to(READ_CHUNK);
    }
    match pending.need {
        // The body's size is known: room for exactly the rest of the request, no doubling.
        Some(need) if pending.body && need > input.capacity() => {
            input.reserve_exact(need - input.len());
        }
        // And no more once there is room for it: a read into the last bytes of room is a short
        // read, not a reason to double a buffer the budget is charged for.
        Some(_) if pending.body => {}
        _ if input.capacity() - input.len() < MIN_ROOM => {
            input.reserve(input.len().clamp(MIN_ROOM, READ_CHUNK));
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_of_known_size_never_grows_its_buffer_past_the_request() {
        // The last bytes of room, with the body still arriving: no doubling (it would be charged).
        let mut input = Vec::with_capacity(200_052);
        input.resize(196_660, b'a');
        let pending = Pending {
            head: false,
            body: true,
            need: Some(200_052),
        };
        size_for(&mut input, pending, 32 * 1024);
        assert_eq!(input.capacity(), 200_052);
        // A body larger than the buffer gets exactly its room.
        let mut input = Vec::with_capacity(16 * 1024);
        input.resize(100, b'a');
        let pending = Pending {
            need: Some(50_000),
            ..pending
        };
        size_for(&mut input, pending, 32 * 1024);
        assert_eq!(input.capacity(), 50_000);
        // Without a known size, a nearly full buffer grows by a chunk.
        let mut input = Vec::with_capacity(16 * 1024);
        input.resize(16 * 1024 - 10, b'a');
        let pending = Pending {
            head: true,
            body: false,
            need: None,
        };
        size_for(&mut input, pending, 32 * 1024);
        assert!(input.capacity() >= 16 * 1024 - 10 + READ_CHUNK);
    }
}
