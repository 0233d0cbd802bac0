//! Spike: the worker's data path on the [compio](https://crates.io/crates/compio) runtime, an honest
//! minimal server built only to be measured against the worker as it was (tokio-uring 0.5, single-shot reads)
//! and hyper (`tests/src/bin/hyper-baseline.rs`), CPU per request.
//!
//! `spike-compio ADDR` listens on `ADDR` (e.g. `127.0.0.1:8080`) with one compio runtime on the main
//! thread (compio is thread-per-core; this is one core, like one worker) and runs until killed. Every
//! request, in either protocol, is answered by the worker's hello app ([`peregrine_worker::Hello`]),
//! called through its `tower::Service` interface with an `http::Request<RequestBody>`, so the spike pays
//! the same `http` types cost as the worker and hyper: status 200, `content-type: text/plain;
//! charset=utf-8`, `content-length: 25`, body `Hello from worker <pid>!\n`, no `date` header.
//!
//! compio 0.19.2 (compio-driver 0.12, io_uring driver only, no polling fallback compiled in), with:
//! - **multishot accept**: `TcpListener::incoming()`, which on Linux submits `AcceptMulti`
//!   (`IORING_OP_ACCEPT` with `IORING_ACCEPT_MULTISHOT`, kernel >= 5.19; re-armed when the kernel ends
//!   it). `TCP_NODELAY` is set on every accepted socket.
//! - **multishot receive into the runtime's provided-buffer ring**: `AsyncReadMulti::read_multi` on the
//!   connection (`RecvMulti`, `IORING_OP_RECV` with `IORING_RECV_MULTISHOT` and buffer select, kernel >=
//!   6.0), one armed receive per connection for its whole life; each completion hands over a pool
//!   buffer (`BufferRef`, returned to the ring on drop). The pool is the runtime's one buffer group,
//!   [`POOL_BUFFERS`] buffers of [`BUFFER_LEN`] bytes, sized with `ProactorBuilder`. When the ring runs
//!   dry (`ENOBUFS`, which compio reports as `ErrorKind::ResourceBusy` and which ends the multishot),
//!   the stream is polled again and compio arms a new one.
//! - writes: one owned-buffer `write_all` (`IORING_OP_SEND`) per batch of responses; the buffer comes
//!   back and is reused.
//!
//! Both multishots were seen in use on kernel 6.18 with the `io_uring:io_uring_submit_req` and
//! `io_uring:io_uring_complete` tracepoints: one `ACCEPT` submitted for the listener and one `RECV` per
//! connection, their completions flagged `IORING_CQE_F_MORE` (and `F_BUFFER` for the receives).
//!
//! HTTP/1.1: the bytes of each receive are made shared (`Bytes`) once and every complete request in
//! them is parsed with `httparse` (method, target and header values sliced from them, as the worker
//! does); a `Content-Length` body is waited for and handed to the app whole; the responses of all of
//! them are encoded in order into one buffer written with one `write_all` (pipelining). Keep-alive by
//! default, `Connection: close` (and HTTP/1.0 without `keep-alive`) honoured.
//!
//! h2c (prior knowledge): when the first bytes are the HTTP/2 preface, the connection is served by the
//! `h2` crate. Its tokio I/O is a small adapter ([`H2Io`]): reads replay the bytes already received and
//! then keep draining the same multishot receive; writes go through compio-io's compat
//! `AsyncWriteStream` (futures-io traits over owned-buffer writes; each flush `h2` asks for is one
//! send). A stream whose request has no body is answered inline in the accept loop (the hello app's
//! future is ready at once); one with a body is spawned on the runtime to read it first.
//!
//! Left out versus the real worker: limits beyond a fixed head/body cap (no configurable
//! header/body/connection limits, no 431/413 responses: an oversized or malformed request gets a bare
//! 400 and a close), chunked request bodies (refused), `Expect: 100-continue`, every timeout (header
//! read, idle, keep-alive, h2 ping), graceful stop and draining, unix-socket listeners, registration
//! with the supervisor, counters/metrics/logging, HTTP/2 stream resets and per-connection stream caps
//! beyond `h2`'s defaults, and the `?cpu=MS` knob's fairness (it burns inline, as in hyper-baseline).

use std::{
    future::poll_fn,
    io,
    net::SocketAddr,
    num::NonZero,
    pin::{Pin, pin},
    task::{Context, Poll, ready},
};

use anyhow::Context as _;
use bytes::{Buf, Bytes};
use compio::{
    driver::{BufferRef, ProactorBuilder},
    io::{AsyncReadMulti, AsyncWrite as _, AsyncWriteExt, compat::AsyncWriteStream},
    net::{TcpListener, TcpStream},
    runtime::RuntimeBuilder,
};
use futures::{Stream, StreamExt};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, Version, header};
use http_body::Body;
use peregrine_worker::{Hello, RequestBody};
use tower::Service;

const USAGE: &str = "usage: spike-compio ADDR (e.g. 127.0.0.1:8080)";

/// The HTTP/2 connection preface a prior-knowledge client opens with.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Buffers in the runtime's provided-buffer ring, shared by every connection's multishot receive.
const POOL_BUFFERS: u16 = 1024;
/// Bytes per ring buffer (and per receive).
const BUFFER_LEN: usize = 4096;
/// Header fields parsed per request.
const MAX_HEADERS: usize = 64;
/// The largest request head.
const MAX_HEAD: usize = 64 * 1024;
/// The largest request body.
const MAX_BODY: usize = 1 << 20;
/// The answer to a request that cannot be served; the connection closes after it.
const BAD_REQUEST: &[u8] =
    b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let addr: SocketAddr = args
        .next()
        .context(USAGE)?
        .parse()
        .context("ADDR must be an ip:port")?;
    if let Some(other) = args.next() {
        anyhow::bail!("unknown argument {other:?}; {USAGE}");
    }
    let mut proactor = ProactorBuilder::new();
    proactor
        .buffer_pool_size(NonZero::new(POOL_BUFFERS).expect("non-zero"))
        .buffer_pool_buffer_len(BUFFER_LEN);
    let runtime = RuntimeBuilder::new()
        .with_proactor(proactor)
        .build()
        .context("compio runtime (io_uring)")?;
    runtime.block_on(serve(addr))
}

/// A listener on `addr` (`SO_REUSEADDR`, backlog 1024, as hyper-baseline).
fn listen(addr: SocketAddr) -> anyhow::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None).context("socket")?;
    socket.set_reuse_address(true).context("SO_REUSEADDR")?;
    socket
        .bind(&addr.into())
        .with_context(|| format!("binding {addr}"))?;
    socket.listen(1024).context("listen")?;
    Ok(socket.into())
}

async fn serve(addr: SocketAddr) -> anyhow::Result<()> {
    let listener = TcpListener::from_std(listen(addr)?)?;
    let app = Hello::new();
    let mut incoming = pin!(listener.incoming());
    while let Some(accepted) = incoming.next().await {
        let stream = match accepted {
            Ok(stream) => stream,
            // Out of file descriptors, or a connection reset before accept: keep serving.
            Err(error) => {
                eprintln!("accept: {error}");
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        compio::runtime::spawn(connection(stream, app.clone())).detach();
    }
    Ok(())
}

/// What the first bytes of a connection say it speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Protocol {
    /// Too few bytes yet to tell.
    Unknown,
    Http1,
    H2,
}

fn sniff(data: &[u8]) -> Protocol {
    if data.len() >= PREFACE.len() {
        if data.starts_with(PREFACE) {
            Protocol::H2
        } else {
            Protocol::Http1
        }
    } else if PREFACE.starts_with(data) {
        Protocol::Unknown
    } else {
        Protocol::Http1
    }
}

/// Serves one connection until the client closes it, asks to, or errs.
async fn connection(stream: TcpStream, mut app: Hello) {
    let mut reader = &stream;
    let mut writer = &stream;
    let mut reads = pin!(reader.read_multi(BUFFER_LEN));
    // Bytes of a request not yet complete (and, before the protocol is known, of the preface).
    let mut pending: Vec<u8> = Vec::new();
    let mut out: Vec<u8> = Vec::with_capacity(BUFFER_LEN);
    let mut protocol = Protocol::Unknown;
    loop {
        let received = match next_read(reads.as_mut()).await {
            Some(Ok(received)) => received,
            Some(Err(_)) | None => return,
        };
        if protocol == Protocol::Unknown {
            pending.extend_from_slice(&received);
            drop(received);
            protocol = sniff(&pending);
            match protocol {
                Protocol::Unknown => continue,
                Protocol::H2 => {
                    let replay = Bytes::from(std::mem::take(&mut pending));
                    let _ = h2_connection(reads.as_mut(), replay, stream.clone(), app).await;
                    return;
                }
                Protocol::Http1 => {}
            }
        } else {
            if pending.len() + received.len() > MAX_HEAD + MAX_BODY {
                return;
            }
            pending.extend_from_slice(&received);
            // Back to the ring before anything is awaited.
            drop(received);
        }
        // The bytes are made shared once; request parts are slices of them.
        let data = Bytes::from(std::mem::take(&mut pending));
        let mut at = 0;
        let mut close = false;
        while at < data.len() {
            match parse(&data, at) {
                Ok(Some(parsed)) => {
                    at += parsed.len;
                    let head_only = parsed.request.method() == Method::HEAD;
                    let version = parsed.request.version();
                    poll_fn(|cx| app.poll_ready(cx))
                        .await
                        .unwrap_or_else(|never| match never {});
                    let response = app
                        .call(parsed.request)
                        .await
                        .unwrap_or_else(|never| match never {});
                    encode(&mut out, response, version, head_only, parsed.keep_alive).await;
                    if !parsed.keep_alive {
                        close = true;
                        break;
                    }
                }
                Ok(None) => break,
                Err(()) => {
                    out.extend_from_slice(BAD_REQUEST);
                    close = true;
                    break;
                }
            }
        }
        if !close && at < data.len() {
            pending.extend_from_slice(&data[at..]);
        }
        if !out.is_empty() {
            let compio::BufResult(written, buffer) = writer.write_all(out).await;
            out = buffer;
            out.clear();
            if written.is_err() {
                return;
            }
        }
        if close {
            let _ = writer.shutdown().await;
            return;
        }
    }
}

/// The next buffer of a multishot receive: `None` at end of stream; a dry buffer ring is waited out
/// (the stream re-arms the receive when polled again).
async fn next_read<S>(mut reads: Pin<&mut S>) -> Option<io::Result<BufferRef>>
where
    S: Stream<Item = io::Result<BufferRef>>,
{
    loop {
        match reads.next().await {
            Some(Err(error)) if error.kind() == io::ErrorKind::ResourceBusy => continue,
            other => return other,
        }
    }
}

/// One complete request from the front of `data[at..]`.
#[derive(Debug)]
struct Parsed {
    request: Request<RequestBody>,
    /// Bytes of head and body.
    len: usize,
    keep_alive: bool,
}

/// Parses the request at `data[at..]`: `Ok(None)` while it is incomplete, `Err` when it cannot be
/// served.
fn parse(data: &Bytes, at: usize) -> Result<Option<Parsed>, ()> {
    let buf = &data[at..];
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut fields);
    let head_len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) if n <= MAX_HEAD => n,
        Ok(httparse::Status::Partial) if buf.len() <= MAX_HEAD => return Ok(None),
        _ => return Err(()),
    };
    let version = match req.version {
        Some(0) => Version::HTTP_10,
        Some(1) => Version::HTTP_11,
        _ => return Err(()),
    };
    let method = req
        .method
        .and_then(|m| Method::from_bytes(m.as_bytes()).ok())
        .ok_or(())?;
    let uri = req
        .path
        .and_then(|p| http::Uri::from_maybe_shared(data.slice_ref(p.as_bytes())).ok())
        .ok_or(())?;
    let mut headers = HeaderMap::with_capacity(req.headers.len());
    let mut content_length: Option<usize> = None;
    let mut keep_alive = version == Version::HTTP_11;
    for field in req.headers.iter() {
        let name = HeaderName::from_bytes(field.name.as_bytes()).map_err(|_| ())?;
        if name == header::CONTENT_LENGTH {
            let n = std::str::from_utf8(field.value)
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .ok_or(())?;
            if content_length.is_some_and(|l| l != n) || n > MAX_BODY {
                return Err(());
            }
            content_length = Some(n);
        } else if name == header::TRANSFER_ENCODING {
            return Err(());
        } else if name == header::CONNECTION {
            for token in field.value.split(|&b| b == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    keep_alive = false;
                } else if token.eq_ignore_ascii_case(b"keep-alive") && version == Version::HTTP_10 {
                    keep_alive = true;
                }
            }
        }
        let value = HeaderValue::from_maybe_shared(data.slice_ref(field.value)).map_err(|_| ())?;
        headers.append(name, value);
    }
    let body_len = content_length.unwrap_or(0);
    let Some(body) = buf.get(head_len..head_len + body_len) else {
        return Ok(None);
    };
    let body = if body.is_empty() {
        Bytes::new()
    } else {
        data.slice_ref(body)
    };
    let mut request = Request::new(RequestBody::new(body));
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.version_mut() = version;
    *request.headers_mut() = headers;
    Ok(Some(Parsed {
        request,
        len: head_len + body_len,
        keep_alive,
    }))
}

/// Appends an HTTP/1.1 response to `out`, framed by `content-length` (the body is gathered first when
/// its size is not known up front).
async fn encode<B>(
    out: &mut Vec<u8>,
    response: Response<B>,
    request_version: Version,
    head_only: bool,
    keep_alive: bool,
) where
    B: Body,
{
    let (parts, body) = response.into_parts();
    let mut body = pin!(body);
    let (len, gathered) = match body.size_hint().exact() {
        Some(n) => (n, None),
        None => {
            let mut all = Vec::new();
            while let Some(Ok(frame)) = poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
                if let Ok(mut data) = frame.into_data() {
                    while data.has_remaining() {
                        all.extend_from_slice(data.chunk());
                        data.advance(data.chunk().len());
                    }
                }
            }
            (all.len() as u64, Some(all))
        }
    };
    let follows = peregrine_worker::http1::head_of_known_size(
        out,
        &parts,
        len,
        request_version,
        head_only,
        keep_alive,
    );
    if !follows {
        return;
    }
    if let Some(all) = gathered {
        out.extend_from_slice(&all);
        return;
    }
    while let Some(Ok(frame)) = poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        if let Ok(mut data) = frame.into_data() {
            while data.has_remaining() {
                out.extend_from_slice(data.chunk());
                data.advance(data.chunk().len());
            }
        }
    }
}

/// Serves an h2c connection whose first bytes (`replay`, the preface and whatever followed it) were
/// taken from `reads` already.
async fn h2_connection<S>(
    reads: Pin<&mut S>,
    replay: Bytes,
    writer: TcpStream,
    mut app: Hello,
) -> Result<(), h2::Error>
where
    S: Stream<Item = io::Result<BufferRef>>,
{
    let io = H2Io {
        replay,
        current: None,
        reads,
        writer: Box::pin(AsyncWriteStream::with_capacity(BUFFER_LEN, writer)),
    };
    let mut conn = h2::server::handshake(io).await?;
    while let Some(accepted) = conn.accept().await {
        let (request, respond) = accepted?;
        if request.body().is_end_stream() {
            // No body to wait for: answered inline (the hello app's future is ready at once).
            h2_respond(&mut app, request.map(|_| RequestBody::default()), respond).await;
        } else {
            let mut app = app.clone();
            compio::runtime::spawn(async move {
                let (parts, mut recv) = request.into_parts();
                let mut body = Vec::new();
                while let Some(chunk) = recv.data().await {
                    let Ok(chunk) = chunk else { return };
                    let _ = recv.flow_control().release_capacity(chunk.len());
                    if body.len() + chunk.len() > MAX_BODY {
                        return;
                    }
                    body.extend_from_slice(&chunk);
                }
                let request = Request::from_parts(parts, RequestBody::new(Bytes::from(body)));
                h2_respond(&mut app, request, respond).await;
            })
            .detach();
        }
    }
    Ok(())
}

/// Calls the app and sends its response on an h2 stream, with `content-length` when the body's size is
/// known.
async fn h2_respond(
    app: &mut Hello,
    request: Request<RequestBody>,
    mut respond: h2::server::SendResponse<Bytes>,
) {
    poll_fn(|cx| app.poll_ready(cx))
        .await
        .unwrap_or_else(|never| match never {});
    let response = app
        .call(request)
        .await
        .unwrap_or_else(|never| match never {});
    let (mut parts, body) = response.into_parts();
    let mut body = pin!(body);
    if let Some(n) = body.size_hint().exact() {
        parts
            .headers
            .insert(header::CONTENT_LENGTH, HeaderValue::from(n));
    }
    let end = body.is_end_stream();
    let Ok(mut send) = respond.send_response(Response::from_parts(parts, ()), end) else {
        return;
    };
    if end {
        return;
    }
    while let Some(frame) = poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        let Ok(frame) = frame.unwrap_or_else(|never| match never {}).into_data() else {
            continue;
        };
        if send.send_data(frame, body.is_end_stream()).is_err() {
            return;
        }
        if body.is_end_stream() {
            return;
        }
    }
    let _ = send.send_data(Bytes::new(), true);
}

/// The tokio I/O `h2` runs on: reads replay the bytes taken already, then drain the connection's
/// multishot receive; writes go to compio's futures-io compat writer.
struct H2Io<'a, S> {
    replay: Bytes,
    /// The receive buffer being handed out, and how much of it was.
    current: Option<(BufferRef, usize)>,
    reads: Pin<&'a mut S>,
    writer: Pin<Box<AsyncWriteStream<TcpStream>>>,
}

impl<S> tokio::io::AsyncRead for H2Io<'_, S>
where
    S: Stream<Item = io::Result<BufferRef>>,
{
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            if !this.replay.is_empty() {
                let n = buf.remaining().min(this.replay.len());
                buf.put_slice(&this.replay[..n]);
                this.replay.advance(n);
                return Poll::Ready(Ok(()));
            }
            if let Some((received, taken)) = &mut this.current {
                let n = buf.remaining().min(received.len() - *taken);
                buf.put_slice(&received[*taken..*taken + n]);
                *taken += n;
                if *taken == received.len() {
                    this.current = None;
                }
                return Poll::Ready(Ok(()));
            }
            match ready!(this.reads.as_mut().poll_next(cx)) {
                Some(Ok(received)) => this.current = Some((received, 0)),
                Some(Err(error)) if error.kind() == io::ErrorKind::ResourceBusy => continue,
                Some(Err(error)) => return Poll::Ready(Err(error)),
                // End of stream: nothing filled.
                None => return Poll::Ready(Ok(())),
            }
        }
    }
}

impl<S> tokio::io::AsyncWrite for H2Io<'_, S>
where
    S: Stream<Item = io::Result<BufferRef>>,
{
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        futures::AsyncWrite::poll_write(self.get_mut().writer.as_mut(), cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        futures::AsyncWrite::poll_flush(self.get_mut().writer.as_mut(), cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        futures::AsyncWrite::poll_close(self.get_mut().writer.as_mut(), cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tells_h2_from_http1() {
        assert_eq!(sniff(b"PRI * HTTP"), Protocol::Unknown);
        assert_eq!(sniff(PREFACE), Protocol::H2);
        assert_eq!(sniff(b"GET / HTTP/1.1\r\n"), Protocol::Http1);
        assert_eq!(sniff(b"PRI / HTTP/1.1\r\n\r\nxxxxxxxxx"), Protocol::Http1);
    }

    #[test]
    fn parses_pipelined_requests() {
        let data = Bytes::from_static(
            b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabcGET /b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\nGET",
        );
        let first = parse(&data, 0).unwrap().unwrap();
        assert_eq!(first.request.body().as_bytes(), "abc");
        assert!(first.keep_alive);
        let second = parse(&data, first.len).unwrap().unwrap();
        assert_eq!(second.request.uri(), "/b");
        assert!(!second.keep_alive);
        assert!(parse(&data, first.len + second.len).unwrap().is_none());
    }
}
