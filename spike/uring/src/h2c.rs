//! HTTP/2 with prior knowledge, served by the `h2` crate without a runtime.
//!
//! Each connection's `h2` server runs over an in-memory [`Io`]: reads come from the bytes the driver's
//! receive completions queued ([`H2Conn::received`]), returning `Pending` (and keeping the waker) when
//! none are left; writes append to an output buffer the driver moves into the connection's send buffer
//! after each poll. The connection's [`Waker`] sets a flag and puts the connection on the driver's
//! ready list once, and the driver polls the ready connections in its loop ([`H2Conn::poll`]).

use std::{
    cell::RefCell,
    io,
    pin::Pin,
    rc::Rc,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll, Wake, Waker},
};

use bytes::Bytes;
use h2::{
    Reason, RecvStream,
    server::{self, Connection, Handshake, SendResponse},
};
use http::{HeaderValue, Method, Request, Response, header};
use peregrine_worker::{Hello, RequestBody};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::app;

/// Connections (slot, generation) woken since the driver last looked.
pub(crate) type ReadyList = Arc<Mutex<Vec<(u32, u32)>>>;

/// A connection's waker: puts it on the ready list once until it is polled again.
struct ConnWaker {
    slot: u32,
    generation: u32,
    woken: AtomicBool,
    ready: ReadyList,
}

impl Wake for ConnWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if !self.woken.swap(true, Ordering::AcqRel) {
            self.ready
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((self.slot, self.generation));
        }
    }
}

/// What the connection's IO and the driver share.
#[derive(Default)]
struct Shared {
    /// Received bytes; `input[read_at..]` are not read yet.
    input: Vec<u8>,
    read_at: usize,
    /// The peer closed its side.
    eof: bool,
    /// Written bytes, not yet taken by the driver.
    out: Vec<u8>,
    read_waker: Option<Waker>,
}

/// The in-memory IO object the `h2` server reads and writes.
struct Io(Rc<RefCell<Shared>>);

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let mut shared = self.0.borrow_mut();
        let available = shared.input.len() - shared.read_at;
        if available > 0 {
            let n = available.min(buf.remaining());
            let at = shared.read_at;
            buf.put_slice(&shared.input[at..at + n]);
            shared.read_at += n;
            if shared.read_at == shared.input.len() {
                shared.input.clear();
                shared.read_at = 0;
            }
            Poll::Ready(Ok(()))
        } else if shared.eof {
            Poll::Ready(Ok(()))
        } else {
            shared.read_waker = Some(cx.waker().clone());
            Poll::Pending
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.0.borrow_mut().out.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut shared = self.0.borrow_mut();
        let mut n = 0;
        for buf in bufs {
            shared.out.extend_from_slice(buf);
            n += buf.len();
        }
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

enum State {
    Handshake(Handshake<Io, Bytes>),
    Serve(Connection<Io, Bytes>),
    Done,
}

/// One HTTP/2 connection's server.
pub(crate) struct H2Conn {
    shared: Rc<RefCell<Shared>>,
    flag: Arc<ConnWaker>,
    waker: Waker,
    state: State,
}

impl H2Conn {
    /// A server for connection (`slot`, `generation`) whose first received bytes are `first`; it is
    /// put on the ready list at once.
    pub(crate) fn new(slot: u32, generation: u32, ready: &ReadyList, first: &[u8]) -> Box<Self> {
        let shared = Rc::new(RefCell::new(Shared {
            input: first.to_vec(),
            ..Shared::default()
        }));
        let flag = Arc::new(ConnWaker {
            slot,
            generation,
            woken: AtomicBool::new(false),
            ready: ready.clone(),
        });
        let waker = Waker::from(flag.clone());
        waker.wake_by_ref();
        Box::new(H2Conn {
            state: State::Handshake(server::handshake(Io(shared.clone()))),
            shared,
            flag,
            waker,
        })
    }

    /// Queues received bytes and wakes the server if it waits for them.
    pub(crate) fn received(&self, data: &[u8]) {
        let waker = {
            let mut shared = self.shared.borrow_mut();
            shared.input.extend_from_slice(data);
            shared.read_waker.take()
        };
        // A server that is not waiting on a read is woken all the same: it may be waiting for these.
        waker.unwrap_or_else(|| self.waker.clone()).wake();
    }

    /// The peer closed its side.
    pub(crate) fn eof(&self) {
        let waker = {
            let mut shared = self.shared.borrow_mut();
            shared.eof = true;
            shared.read_waker.take()
        };
        waker.unwrap_or_else(|| self.waker.clone()).wake();
    }

    /// Moves what the server wrote onto the end of `out`.
    pub(crate) fn take_output(&self, out: &mut Vec<u8>) {
        let mut shared = self.shared.borrow_mut();
        if out.is_empty() {
            std::mem::swap(out, &mut shared.out);
        } else {
            out.extend_from_slice(&shared.out);
            shared.out.clear();
        }
    }

    /// Runs the server as far as it goes, answering every request accepted. `true` once it has ended.
    pub(crate) fn poll(&mut self, service: &mut Hello) -> bool {
        self.flag.woken.store(false, Ordering::Release);
        let mut cx = Context::from_waker(&self.waker);
        loop {
            match &mut self.state {
                State::Handshake(handshake) => match Pin::new(handshake).poll(&mut cx) {
                    Poll::Ready(Ok(connection)) => self.state = State::Serve(connection),
                    Poll::Ready(Err(_)) => break,
                    Poll::Pending => return false,
                },
                State::Serve(connection) => match connection.poll_accept(&mut cx) {
                    Poll::Ready(Some(Ok((request, respond)))) => answer(service, request, respond),
                    Poll::Ready(Some(Err(_)) | None) => break,
                    Poll::Pending => return false,
                },
                State::Done => return true,
            }
        }
        self.state = State::Done;
        true
    }
}

/// Answers one request: the head, with `content-length`, and the body in one DATA frame.
fn answer(service: &mut Hello, request: Request<RecvStream>, mut respond: SendResponse<Bytes>) {
    let head_only = request.method() == Method::HEAD;
    let (parts, _body) = request.into_parts();
    let Some(response) = app::call(service, Request::from_parts(parts, RequestBody::default()))
    else {
        respond.send_reset(Reason::INTERNAL_ERROR);
        return;
    };
    let (mut parts, body) = response.into_parts();
    let Some(data) = app::body_bytes(body) else {
        respond.send_reset(Reason::INTERNAL_ERROR);
        return;
    };
    if !matches!(parts.status.as_u16(), 100..=199 | 204 | 304) {
        parts
            .headers
            .insert(header::CONTENT_LENGTH, HeaderValue::from(data.len()));
    }
    let end = head_only || data.is_empty();
    if let Ok(mut send) = respond.send_response(Response::from_parts(parts, ()), end)
        && !end
    {
        let _ = send.send_data(data, true);
    }
}
