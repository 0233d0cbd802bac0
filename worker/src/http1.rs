//! HTTP/1.1 (and 1.0) over one connection.
//!
//! The connection owns two buffers and passes them to the kernel and back (completion IO): `input`
//! collects bytes read, `output` collects every response of one batch. Each turn of the loop parses every
//! complete request already in `input`, calls the application for each in order, appends the responses to
//! `output` and writes the batch with one `write_all`; so pipelined requests are answered in order with as
//! few writes as possible. Parsing is a pure function over the buffer ([`parse`]), tested without sockets.
//!
//! Framing rules: a request body is delimited by `Content-Length` or `Transfer-Encoding: chunked`; both
//! at once, differing `Content-Length` values, a malformed head and a bad chunk are answered with
//! `400 Bad Request`, an oversized head with `431`, an oversized body with `413`, and each of these
//! closes the connection, since the next request's start is unknown. Every response carries a
//! `content-length`.
//!
//! Architecture Invariant: nothing here knows which runtime drives it beyond the [`Io`] trait, and
//! nothing here knows about HTTP/2; `server` picks the protocol and runs the accept loops.

use std::{
    future::poll_fn,
    io,
    mem::MaybeUninit,
    pin::{Pin, pin},
    rc::Rc,
    task::{Context, Poll, Waker},
    time::{Duration, Instant},
};

use bytes::{Buf, Bytes};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Version, header};
use http_body::Body;
use http_body_util::BodyExt;

use crate::{
    BoxError,
    budget::{Budget, Charge},
    service::{HttpService, RequestBody},
    stream::Io,
};

/// How many bytes a read asks for at least.
const READ_CHUNK: usize = 16 * 1024;

/// Header slots kept on the stack while parsing; a larger [`Limits::max_headers`] allocates.
const STACK_HEADERS: usize = 128;

/// The limits a connection enforces on requests.
///
/// The defaults:
///
/// | field | default |
/// |---|---|
/// | `first_byte_timeout` | 10 s |
/// | `header_timeout` | 10 s |
/// | `body_read_timeout` | 10 s |
/// | `body_timeout` | 60 s |
/// | `idle_timeout` | 60 s |
/// | `max_head_bytes` | 16 KiB |
/// | `max_headers` | 100 |
/// | `max_body_bytes` | 1 MiB |
///
/// A connection buffers at most one request at a time: its head, its body (at most `max_body_bytes`)
/// and one read; what its buffer holds beyond `max_head_bytes` plus 16 KiB is charged to the worker's
/// budget ([`crate::server::Config::max_buffered_body_bytes`]), and a request that finds no room there is
/// answered `503` with `connection: close`. The buffer shrinks back once a large request is done.
#[derive(Clone, Debug)]
pub struct Limits {
    /// How long a new connection may stay silent before its first byte; then it is closed.
    pub first_byte_timeout: Duration,
    /// How long a client may take to send a whole request head, from its first byte; a slower client is
    /// answered `408` and cut off.
    pub header_timeout: Duration,
    /// How long a request body may go without a byte arriving; then it is answered `408` and cut off.
    pub body_read_timeout: Duration,
    /// How long a whole request body may take, from the end of its head; then `408` and cut off.
    pub body_timeout: Duration,
    /// How long a kept-alive connection may wait for its next request before it is closed.
    pub idle_timeout: Duration,
    /// The largest request head (request line and header fields), in bytes; more is answered with `431`.
    pub max_head_bytes: usize,
    /// The most header fields in one request; more is answered with `431`.
    pub max_headers: usize,
    /// The largest request body (decoded, for chunked bodies), in bytes; more is answered with `413`.
    pub max_body_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            first_byte_timeout: Duration::from_secs(10),
            header_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
            max_head_bytes: 16 * 1024,
            max_headers: 100,
            max_body_bytes: 1024 * 1024,
        }
    }
}

/// A request parsed from the front of a buffer.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub(crate) request: Request<RequestBody>,
    /// How many bytes of the buffer the request took.
    pub(crate) len: usize,
    /// Whether the client allows another request on this connection.
    pub(crate) keep_alive: bool,
}

/// How far parsing got.
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "returned once per parse and matched at once; boxing would allocate per request"
)]
pub(crate) enum Progress {
    /// A whole request.
    Complete(Parsed),
    /// More bytes are needed. `head_done` says the head is complete (only the body is missing),
    /// `expects_continue` that the client waits for `100 Continue` before sending it, and `need` how
    /// many bytes the whole request takes, when its `content-length` says.
    Partial {
        head_done: bool,
        expects_continue: bool,
        need: Option<usize>,
    },
}

/// Why a request is refused before it reaches the application. Each of these closes the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reject {
    /// A malformed request: `400`.
    BadRequest(&'static str),
    /// A transfer coding other than `chunked`: `501`.
    UnsupportedCoding,
    /// The body exceeds the limit: `413`.
    BodyTooLarge,
    /// The head exceeds the limits: `431`.
    HeadTooLarge,
    /// An `Expect` other than `100-continue`: `417`.
    ExpectationFailed,
    /// The head did not arrive within the header timeout: `408`.
    Timeout,
    /// The request line names no HTTP version at all (`INVALID CONNECTION PREFACE`, say): `400`, or, as
    /// the first bytes of a connection, an HTTP/2 GOAWAY (the peer may have meant HTTP/2).
    NotHttp1,
}

impl Reject {
    pub(crate) fn status(self) -> StatusCode {
        match self {
            Reject::BadRequest(_) => StatusCode::BAD_REQUEST,
            Reject::UnsupportedCoding => StatusCode::NOT_IMPLEMENTED,
            Reject::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Reject::HeadTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Reject::ExpectationFailed => StatusCode::EXPECTATION_FAILED,
            Reject::Timeout => StatusCode::REQUEST_TIMEOUT,
            Reject::NotHttp1 => StatusCode::BAD_REQUEST,
        }
    }
}

/// The bytes a request is parsed from, and how its parts become `Bytes`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Source<'a> {
    /// The bytes to parse.
    buf: &'a [u8],
    /// When set, `buf` lies within these shared bytes, and the request's parts (target, header values,
    /// body) are slices of them: no allocation or copy per header.
    shared: Option<&'a Bytes>,
}

impl<'a> Source<'a> {
    /// Parts are copied out of `buf`.
    pub(crate) fn copied(buf: &'a [u8]) -> Self {
        Source { buf, shared: None }
    }

    /// Parts are slices of `shared`, from `offset` on.
    fn shared(shared: &'a Bytes, offset: usize) -> Self {
        Source {
            buf: &shared[offset..],
            shared: Some(shared),
        }
    }

    /// `part` (a sub-slice of `buf`) as `Bytes`.
    fn bytes(&self, part: &[u8]) -> Bytes {
        match self.shared {
            Some(shared) => shared.slice_ref(part),
            None => Bytes::copy_from_slice(part),
        }
    }
}

/// Below this many buffered bytes, a read's bytes are made shared once and every request in them is
/// parsed without copies; above it (a large body arriving over many reads), parts are copied instead, so
/// the buffer is never copied whole again and again.
const SHARE_BELOW: usize = 64 * 1024;

/// Parses one request from the front of `src`.
pub(crate) fn parse(src: Source<'_>, limits: &Limits) -> Result<Progress, Reject> {
    let buf = src.buf;
    const NEED_HEAD: Progress = Progress::Partial {
        head_done: false,
        expects_continue: false,
        need: None,
    };
    // The usual limit fits on the stack, left uninitialised (httparse writes what it uses): no
    // allocation and no 4 KiB of initialisation per request.
    let mut stack = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; STACK_HEADERS];
    let mut heap;
    let fields = if limits.max_headers <= STACK_HEADERS {
        &mut stack[..limits.max_headers]
    } else {
        heap = Vec::with_capacity(limits.max_headers);
        heap.resize_with(limits.max_headers, MaybeUninit::uninit);
        &mut heap[..]
    };
    let mut req = httparse::Request::new(&mut []);
    let head_len = match req.parse_with_uninit_headers(buf, fields) {
        Ok(httparse::Status::Complete(n)) if n > limits.max_head_bytes => {
            return Err(Reject::HeadTooLarge);
        }
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() > limits.max_head_bytes => {
            return Err(Reject::HeadTooLarge);
        }
        Ok(httparse::Status::Partial) => return Ok(NEED_HEAD),
        Err(httparse::Error::TooManyHeaders) => return Err(Reject::HeadTooLarge),
        Err(httparse::Error::Version) => {
            // `GET / HTTP/1.2` is an HTTP client asking for a version we lack; a request line with no
            // `HTTP/` at all is no HTTP/1 client.
            let line = buf.split(|&b| b == b'\n').next().unwrap_or_default();
            return Err(if line.windows(5).any(|w| w == b"HTTP/") {
                Reject::BadRequest("unsupported http version")
            } else {
                Reject::NotHttp1
            });
        }
        Err(_) => return Err(Reject::BadRequest("malformed request head")),
    };
    let version = match req.version {
        Some(0) => Version::HTTP_10,
        Some(1) => Version::HTTP_11,
        _ => return Err(Reject::BadRequest("unsupported http version")),
    };
    let method = req
        .method
        .and_then(|m| Method::from_bytes(m.as_bytes()).ok())
        .ok_or(Reject::BadRequest("invalid method"))?;
    let uri = req
        .path
        .and_then(|p| http::Uri::from_maybe_shared(src.bytes(p.as_bytes())).ok())
        .ok_or(Reject::BadRequest("invalid request target"))?;
    let mut headers = HeaderMap::with_capacity(req.headers.len());
    // Whether any field bears on framing or the connection; most requests (a GET with a few fields)
    // carry none, and then the lookups below, a hash each, are skipped.
    let mut framing_fields = false;
    let mut hosts = 0;
    for field in req.headers.iter() {
        let name = HeaderName::from_bytes(field.name.as_bytes())
            .map_err(|_| Reject::BadRequest("invalid header name"))?;
        hosts += usize::from(name == header::HOST);
        framing_fields |= name == header::CONNECTION
            || name == header::CONTENT_LENGTH
            || name == header::TRANSFER_ENCODING
            || name == header::EXPECT;
        let value = HeaderValue::from_maybe_shared(src.bytes(field.value))
            .map_err(|_| Reject::BadRequest("invalid header value"))?;
        headers.append(name, value);
    }

    // RFC 9112, section 3.2: exactly one `Host` in HTTP/1.1; HTTP/1.0 may omit it, never repeat it.
    match hosts {
        0 if version == Version::HTTP_11 => return Err(Reject::BadRequest("no host header")),
        0 | 1 => {}
        _ => return Err(Reject::BadRequest("more than one host header")),
    }
    let (keep_alive, expects_continue, content_length, chunked) = if framing_fields {
        (
            keep_alive(version, &headers),
            expects_continue(version, &headers)?,
            content_length(&headers)?,
            chunked(&headers)?,
        )
    } else {
        (version == Version::HTTP_11, false, None, false)
    };
    let need_body = |need| Progress::Partial {
        head_done: true,
        expects_continue,
        need,
    };
    let (body, len) = match (content_length, chunked) {
        (Some(_), true) => {
            return Err(Reject::BadRequest(
                "both content-length and transfer-encoding",
            ));
        }
        (Some(n), false) => {
            let n = usize::try_from(n).map_err(|_| Reject::BodyTooLarge)?;
            if n > limits.max_body_bytes {
                return Err(Reject::BodyTooLarge);
            }
            let Some(body) = buf.get(head_len..head_len + n) else {
                return Ok(need_body(Some(head_len + n)));
            };
            (src.bytes(body), head_len + n)
        }
        (None, true) => match decode_chunked(&buf[head_len..], limits)? {
            Some((body, n)) => (Bytes::from(body), head_len + n),
            None => return Ok(need_body(None)),
        },
        (None, false) => (Bytes::new(), head_len),
    };

    let mut request = Request::new(RequestBody::new(body));
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.version_mut() = version;
    *request.headers_mut() = headers;
    Ok(Progress::Complete(Parsed {
        request,
        len,
        keep_alive,
    }))
}

/// Whether the client waits for `100 Continue`; an expectation we cannot meet is refused.
fn expects_continue(version: Version, headers: &HeaderMap) -> Result<bool, Reject> {
    let Some(expect) = headers.get(header::EXPECT) else {
        return Ok(false);
    };
    if !expect.as_bytes().eq_ignore_ascii_case(b"100-continue") {
        return Err(Reject::ExpectationFailed);
    }
    // An HTTP/1.0 client does not know `100 Continue` (RFC 9110, 10.1.1).
    Ok(version == Version::HTTP_11)
}

/// Whether a `Connection` header lists `token`.
fn connection_has(headers: &HeaderMap, token: &str) -> bool {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

fn keep_alive(version: Version, headers: &HeaderMap) -> bool {
    if connection_has(headers, "close") {
        false
    } else if version == Version::HTTP_10 {
        connection_has(headers, "keep-alive")
    } else {
        true
    }
}

/// The request's `Content-Length`; repeated fields (or lists) must agree.
fn content_length(headers: &HeaderMap) -> Result<Option<u64>, Reject> {
    let mut length = None;
    for value in headers.get_all(header::CONTENT_LENGTH) {
        let value = value
            .to_str()
            .map_err(|_| Reject::BadRequest("invalid content-length"))?;
        for item in value.split(',') {
            let item = item.trim();
            if item.is_empty() || !item.bytes().all(|b| b.is_ascii_digit()) {
                return Err(Reject::BadRequest("invalid content-length"));
            }
            let n: u64 = item.parse().map_err(|_| Reject::BodyTooLarge)?;
            if length.is_some_and(|l| l != n) {
                return Err(Reject::BadRequest("differing content-length values"));
            }
            length = Some(n);
        }
    }
    Ok(length)
}

/// Whether the body is chunked; any other transfer coding is refused.
fn chunked(headers: &HeaderMap) -> Result<bool, Reject> {
    let mut codings = Vec::new();
    for value in headers.get_all(header::TRANSFER_ENCODING) {
        let value = value
            .to_str()
            .map_err(|_| Reject::BadRequest("invalid transfer-encoding"))?;
        codings.extend(value.split(',').map(str::trim).filter(|c| !c.is_empty()));
    }
    match codings.as_slice() {
        [] => Ok(false),
        [c] if c.eq_ignore_ascii_case("chunked") => Ok(true),
        _ => Err(Reject::UnsupportedCoding),
    }
}

fn find_crlf(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\r\n")
}

/// Decodes a chunked body from the front of `buf`: the body and the bytes it took, or `Ok(None)` when
/// more bytes are needed. Chunk extensions and trailer fields are read and dropped.
fn decode_chunked(buf: &[u8], limits: &Limits) -> Result<Option<(Vec<u8>, usize)>, Reject> {
    // A chunk-size line or a trailer field longer than this is not a well-meaning client.
    const MAX_LINE: usize = 4096;
    let mut body = Vec::new();
    let mut pos = 0;
    loop {
        let Some(end) = find_crlf(&buf[pos..]) else {
            return if buf.len() - pos > MAX_LINE {
                Err(Reject::BadRequest("chunk size line too long"))
            } else {
                Ok(None)
            };
        };
        let line = &buf[pos..pos + end];
        let digits = line.split(|&b| b == b';').next().unwrap_or_default();
        let digits = digits.trim_ascii();
        if digits.is_empty() || digits.len() > 15 || !digits.iter().all(u8::is_ascii_hexdigit) {
            return Err(Reject::BadRequest("invalid chunk size"));
        }
        let size = digits.iter().fold(0usize, |n, &d| {
            n * 16 + (d as char).to_digit(16).unwrap_or(0) as usize
        });
        pos += end + 2;
        if size == 0 {
            // Trailer fields until an empty line.
            let mut trailers = 0;
            loop {
                let Some(end) = find_crlf(&buf[pos..]) else {
                    return if buf.len() - pos > MAX_LINE {
                        Err(Reject::BadRequest("trailer field too long"))
                    } else {
                        Ok(None)
                    };
                };
                pos += end + 2;
                if end == 0 {
                    return Ok(Some((body, pos)));
                }
                trailers += end;
                if trailers > limits.max_head_bytes {
                    return Err(Reject::HeadTooLarge);
                }
            }
        }
        if body.len() + size > limits.max_body_bytes {
            return Err(Reject::BodyTooLarge);
        }
        let Some(data) = buf.get(pos..pos + size + 2) else {
            return Ok(None);
        };
        if &data[size..] != b"\r\n" {
            return Err(Reject::BadRequest("chunk data not followed by crlf"));
        }
        body.extend_from_slice(&data[..size]);
        pos += size + 2;
    }
}

/// How a response body follows its head on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Framing {
    /// No body: a response to `HEAD`, or a `1xx`, `204` or `304` response.
    Empty,
    /// Exactly this many bytes, announced by `content-length`.
    Length(u64),
    /// `transfer-encoding: chunked` (an HTTP/1.1 client, a body of unknown size).
    Chunked,
    /// Until the connection closes (an HTTP/1.0 client, a body of unknown size).
    UntilClose,
}

/// Appends the status line and header fields of a response to `out`; returns how its body follows and
/// whether the connection stays open afterwards.
///
/// `size` is the body's exact size when known. `head_only` drops the body (a response to `HEAD`) but
/// keeps its `content-length`; `keep_alive` is whether the connection may stay open, and a `connection`
/// header is written when that differs from the version's default.
pub(crate) fn encode_head(
    out: &mut Vec<u8>,
    res: &http::response::Parts,
    size: Option<u64>,
    request_version: Version,
    head_only: bool,
    keep_alive: bool,
) -> (Framing, bool) {
    let status = res.status;
    if status == StatusCode::OK {
        out.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
    } else {
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    for (name, value) in &res.headers {
        if name == header::CONTENT_LENGTH
            || name == header::TRANSFER_ENCODING
            || name == header::CONNECTION
        {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    let bodiless = status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    let framing = match size {
        _ if bodiless => Framing::Empty,
        Some(n) => {
            out.extend_from_slice(b"content-length: ");
            push_decimal(out, n);
            out.extend_from_slice(b"\r\n");
            if head_only {
                Framing::Empty
            } else {
                Framing::Length(n)
            }
        }
        None if head_only => Framing::Empty,
        None if request_version == Version::HTTP_11 => {
            out.extend_from_slice(b"transfer-encoding: chunked\r\n");
            Framing::Chunked
        }
        None => Framing::UntilClose,
    };
    let keep_alive = keep_alive && framing != Framing::UntilClose;
    if !keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    } else if request_version == Version::HTTP_10 {
        out.extend_from_slice(b"connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
    (framing, keep_alive)
}

/// Appends `n` in decimal, without allocating.
fn push_decimal(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

/// Appends a short plain-text response for a refused request, closing the connection.
pub(crate) fn encode_error(out: &mut Vec<u8>, status: StatusCode) {
    let reason = status.canonical_reason().unwrap_or("Error");
    let body = format!("{reason}\n");
    out.extend_from_slice(
        format!(
            "HTTP/1.1 {} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            status.as_str(),
            body.len()
        )
        .as_bytes(),
    );
}

/// Output is written once it grows past this, even in the middle of a body.
const FLUSH_AT: usize = 64 * 1024;

/// Why a response body could not be sent whole.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BodyError {
    /// Writing failed.
    #[error("write failed")]
    Io(#[from] io::Error),
    /// The application's body failed.
    #[error("response body failed")]
    Body(#[source] BoxError),
    /// The body was not as long as its `content-length` said.
    #[error(
        "response body length differs from its content-length ({sent} bytes, announced {announced})"
    )]
    Length {
        /// Bytes the body produced.
        sent: u64,
        /// Bytes announced.
        announced: u64,
    },
}

/// Writes the whole of `out` and empties it.
async fn flush<I: Io>(io: &I, out: &mut Vec<u8>) -> io::Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    let (result, mut buf) = io.write_all(std::mem::take(out)).await;
    buf.clear();
    *out = buf;
    result
}

/// Appends one chunk of body data to `out` in `framing`; `sent` counts the body's bytes so far.
fn append_data(
    out: &mut Vec<u8>,
    mut data: impl Buf,
    framing: Framing,
    sent: &mut u64,
) -> Result<(), BodyError> {
    let len = data.remaining();
    if len == 0 {
        return Ok(());
    }
    *sent += len as u64;
    match framing {
        Framing::Length(announced) if *sent > announced => {
            return Err(BodyError::Length {
                sent: *sent,
                announced,
            });
        }
        Framing::Chunked => out.extend_from_slice(format!("{len:x}\r\n").as_bytes()),
        _ => {}
    }
    while data.has_remaining() {
        let chunk = data.chunk();
        out.extend_from_slice(chunk);
        let n = chunk.len();
        data.advance(n);
    }
    if framing == Framing::Chunked {
        out.extend_from_slice(b"\r\n");
    }
    Ok(())
}

/// Ends a body: the last chunk, or the check that it was as long as announced. Trailers are not sent
/// (HTTP/1 clients seldom ask for them with `TE: trailers`).
fn finish_body(out: &mut Vec<u8>, framing: Framing, sent: u64) -> Result<(), BodyError> {
    match framing {
        Framing::Length(announced) if sent != announced => {
            Err(BodyError::Length { sent, announced })
        }
        Framing::Chunked => {
            out.extend_from_slice(b"0\r\n\r\n");
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Appends what `body` has ready now, without waiting: `Ready` once the body has ended (or failed),
/// `Pending` when it must be awaited or `out` written first. Most bodies (a `Full`, say) are whole at
/// once, so most responses never enter the async [`write_body`].
pub(crate) fn append_ready<B>(
    out: &mut Vec<u8>,
    mut body: Pin<&mut B>,
    framing: Framing,
    sent: &mut u64,
) -> Poll<Result<(), BodyError>>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    if framing == Framing::Empty {
        return Poll::Ready(Ok(()));
    }
    let mut cx = Context::from_waker(Waker::noop());
    while out.len() < FLUSH_AT {
        match body.as_mut().poll_frame(&mut cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(None) => return Poll::Ready(finish_body(out, framing, *sent)),
            Poll::Ready(Some(Err(error))) => {
                return Poll::Ready(Err(BodyError::Body(error.into())));
            }
            Poll::Ready(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data()
                    && let Err(error) = append_data(out, data, framing, sent)
                {
                    return Poll::Ready(Err(error));
                }
            }
        }
    }
    Poll::Pending
}

/// Appends the rest of `body` to `out` in `framing`, writing whenever `out` grows past [`FLUSH_AT`].
pub(crate) async fn write_body<I, B>(
    io: &I,
    out: &mut Vec<u8>,
    mut body: Pin<&mut B>,
    framing: Framing,
    mut sent: u64,
) -> Result<(), BodyError>
where
    I: Io,
    B: Body,
    B::Error: Into<BoxError>,
{
    loop {
        if let Poll::Ready(result) = append_ready(out, body.as_mut(), framing, &mut sent) {
            return result;
        }
        if out.len() >= FLUSH_AT {
            flush(io, out).await?;
            continue;
        }
        // The body is not ready: wait for its next frame with this task's waker.
        match body.frame().await {
            None => return finish_body(out, framing, sent),
            Some(Err(error)) => return Err(BodyError::Body(error.into())),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    append_data(out, data, framing, &mut sent)?;
                }
            }
        }
    }
}

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
    mut service: S,
    limits: &Limits,
    bodies: &Rc<Budget>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> io::Result<()>
where
    I: Io,
    S: HttpService,
{
    let mut input: Vec<u8> = already_read;
    input.reserve(READ_CHUNK);
    let mut output: Vec<u8> = Vec::new();
    // What `input` holds beyond a head and a read is charged to the worker's budget.
    let allowance = limits.max_head_bytes + READ_CHUNK;
    let mut charge = Charge::new(bodies);
    // When the head now at the front of `input` was first seen incomplete.
    let mut head_since: Option<Instant> = None;
    // When the body now at the front of `input` began (its head ended), and when a byte of it last came.
    let mut body_since: Option<Instant> = None;
    let mut body_progress: Option<Instant> = None;
    // When the connection last began to wait for a request; the idle timer is re-armed from it only
    // when it fires, so requests cost no timer work.
    let mut idle_since = Instant::now();
    let mut served_since_wait = false;
    let mut idle_timer = pin!(tokio::time::sleep(limits.idle_timeout));
    // Whether `100 Continue` went out for the request at the front of `input`.
    let mut continued = false;
    let mut first_request = true;
    loop {
        let mut close = false;
        let mut start = 0;
        let mut head_pending = false;
        let mut body_pending = false;
        let mut need = None;
        let shared = (input.len() < SHARE_BELOW).then(|| Bytes::copy_from_slice(&input));
        while !close {
            let src = match &shared {
                Some(shared) => Source::shared(shared, start),
                None => Source::copied(&input[start..]),
            };
            let parsed = match parse(src, limits) {
                Ok(Progress::Complete(parsed)) => parsed,
                Ok(Progress::Partial {
                    head_done,
                    expects_continue,
                    need: needed,
                }) => {
                    head_pending = !head_done && start < input.len();
                    body_pending = head_done;
                    need = needed;
                    if expects_continue && !continued {
                        output.extend_from_slice(CONTINUE);
                        continued = true;
                    }
                    break;
                }
                Err(Reject::NotHttp1) if first_request => {
                    // No HTTP/1 version: the peer may be an HTTP/2 client with a broken preface.
                    tracing::debug!("Not HTTP/1, answering an HTTP/2 GOAWAY");
                    output.extend_from_slice(&crate::server::GOAWAY_PROTOCOL_ERROR);
                    close = true;
                    break;
                }
                Err(reject) => {
                    tracing::debug!(?reject, "Refusing request");
                    encode_error(&mut output, reject.status());
                    close = true;
                    break;
                }
            };
            start += parsed.len;
            continued = false;
            first_request = false;
            head_since = None;
            body_since = None;
            body_progress = None;
            served_since_wait = true;
            crate::counter::record_request();
            let version = parsed.request.version();
            let head_only = parsed.request.method() == Method::HEAD;
            // Most services are ready at once: ask without a future first.
            let ready = match service.poll_ready(&mut Context::from_waker(Waker::noop())) {
                Poll::Ready(ready) => ready,
                Poll::Pending => poll_fn(|cx| service.poll_ready(cx)).await,
            };
            let res = match ready {
                Ok(()) => service.call(parsed.request).await.map_err(Into::into),
                Err(error) => Err(error.into()),
            };
            let res: http::Response<S::ResBody> = match res {
                Ok(res) => res,
                Err(error) => {
                    let error: BoxError = error;
                    tracing::warn!(%error, "Application failed, answering 500");
                    encode_error(&mut output, StatusCode::INTERNAL_SERVER_ERROR);
                    close = true;
                    break;
                }
            };
            let keep_alive =
                parsed.keep_alive && !connection_has(res.headers(), "close") && !*shutdown.borrow();
            let (parts, body) = res.into_parts();
            let size = body.size_hint().exact();
            let (framing, keep_alive) =
                encode_head(&mut output, &parts, size, version, head_only, keep_alive);
            let mut body = pin!(body);
            let mut sent = 0;
            let written = match append_ready(&mut output, body.as_mut(), framing, &mut sent) {
                Poll::Ready(result) => result,
                Poll::Pending => write_body(&io, &mut output, body.as_mut(), framing, sent).await,
            };
            if let Err(error) = written {
                if let BodyError::Io(error) = error {
                    return Err(error);
                }
                // The response is cut short; only closing the connection tells the client.
                tracing::warn!(%error, "Response body failed, closing the connection");
                close = true;
                break;
            }
            close = !keep_alive;
        }
        drop(shared);
        input.drain(..start);

        if close {
            flush(&io, &mut output).await?;
            io.shutdown();
            return Ok(());
        }

        // A large request is done: give its buffer back rather than keep it for the connection's life.
        if input.capacity() > 2 * allowance && input.len() < READ_CHUNK {
            input.shrink_to(READ_CHUNK);
        }
        match need {
            // The body's size is known: room for exactly the rest of the request, no doubling.
            Some(need) if body_pending && need > input.capacity() => {
                input.reserve_exact(need - input.len());
            }
            _ if input.capacity() - input.len() < READ_CHUNK / 2 => input.reserve(READ_CHUNK),
            _ => {}
        }
        if !charge.set(input.capacity().saturating_sub(allowance)) {
            tracing::debug!(
                buffered = bodies.used(),
                wanted = input.capacity(),
                "The worker's request-body budget is spent, answering 503"
            );
            encode_error(&mut output, StatusCode::SERVICE_UNAVAILABLE);
            flush(&io, &mut output).await?;
            io.shutdown();
            return Ok(());
        }
        let idle = input.is_empty();
        let now = Instant::now();
        let deadline = if head_pending {
            Some(*head_since.get_or_insert(now) + limits.header_timeout)
        } else if body_pending {
            head_since = None;
            let since = *body_since.get_or_insert(now);
            let progress = body_progress.unwrap_or(since);
            Some((since + limits.body_timeout).min(progress + limits.body_read_timeout))
        } else {
            head_since = None;
            body_since = None;
            body_progress = None;
            None
        };
        if idle && std::mem::take(&mut served_since_wait) {
            idle_since = now;
        }
        // The responses go out while the next read is already submitted: both operations reach the
        // kernel in the same submission, one event-loop turn per request instead of two.
        let next = async {
            let read = io.read(input);
            if idle {
                if *shutdown.borrow_and_update() {
                    return Next::Close;
                }
                let mut read = pin!(read);
                loop {
                    tokio::select! {
                        (result, buf) = &mut read => return Next::Read(result, buf),
                        _ = shutdown.changed() => return Next::Close,
                        () = idle_timer.as_mut() => {
                            let due = idle_since + limits.idle_timeout;
                            if Instant::now() < due {
                                idle_timer.as_mut().reset(due.into());
                                continue;
                            }
                            tracing::debug!("Idle timeout, closing");
                            return Next::Close;
                        }
                    }
                }
            } else if let Some(deadline) = deadline {
                tokio::select! {
                    (result, buf) = read => Next::Read(result, buf),
                    () = tokio::time::sleep_until(deadline.into()) => Next::Timeout,
                }
            } else {
                let (result, buf) = read.await;
                Next::Read(result, buf)
            }
        };
        let (written, next) = tokio::join!(flush(&io, &mut output), next);
        written?;
        match next {
            Next::Read(result, buf) => {
                input = buf;
                if result? == 0 {
                    // The client closed; a partial request left in the buffer is dropped.
                    return Ok(());
                }
                if body_pending {
                    body_progress = Some(Instant::now());
                }
            }
            Next::Close => {
                io.shutdown();
                return Ok(());
            }
            Next::Timeout => {
                tracing::debug!(body = body_pending, "Request timeout, answering 408");
                encode_error(&mut output, Reject::Timeout.status());
                flush(&io, &mut output).await?;
                io.shutdown();
                return Ok(());
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole request, if one is complete.
    /// Parses `buf` both ways (copied and shared), which must agree.
    fn parse_both(buf: &[u8]) -> Result<Progress, Reject> {
        let shared = Bytes::copy_from_slice(buf);
        let copied = parse(Source::copied(buf), &Limits::default());
        let sliced = parse(Source::shared(&shared, 0), &Limits::default());
        assert_eq!(format!("{copied:?}"), format!("{sliced:?}"));
        copied
    }

    fn complete(buf: &[u8]) -> Result<Option<Parsed>, Reject> {
        Ok(match parse_both(buf)? {
            Progress::Complete(p) => Some(p),
            Progress::Partial { .. } => None,
        })
    }

    fn parse_all(mut buf: &[u8]) -> Result<Vec<Parsed>, Reject> {
        let mut out = Vec::new();
        while let Some(p) = complete(buf)? {
            buf = &buf[p.len..];
            out.push(p);
        }
        assert!(
            buf.is_empty(),
            "left over: {:?}",
            String::from_utf8_lossy(buf)
        );
        Ok(out)
    }

    #[test]
    fn parses_pipelined_requests() {
        let got = parse_all(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nPOST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabcGET /c HTTP/1.0\r\n\r\n")
            .unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].request.uri(), "/a");
        assert!(got[0].keep_alive);
        assert_eq!(got[1].request.body().as_bytes(), "abc");
        assert_eq!(got[2].request.version(), Version::HTTP_10);
        assert!(!got[2].keep_alive);
    }

    #[test]
    fn waits_for_a_whole_request() {
        let full = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello";
        for n in 0..full.len() {
            assert!(complete(&full[..n]).unwrap().is_none(), "complete at {n}");
        }
        assert!(complete(full).unwrap().is_some());
    }

    #[test]
    fn keep_alive_follows_version_and_connection() {
        let ka = |s: &[u8]| complete(s).unwrap().unwrap().keep_alive;
        assert!(ka(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"));
        assert!(!ka(
            b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Close\r\n\r\n"
        ));
        assert!(!ka(b"GET / HTTP/1.0\r\n\r\n"));
        assert!(ka(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"));
    }

    #[test]
    fn decodes_chunked_bodies() {
        let req = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nX-Trailer: y\r\n\r\n";
        for n in 0..req.len() {
            assert!(complete(&req[..n]).unwrap().is_none(), "complete at {n}");
        }
        let p = complete(req).unwrap().unwrap();
        assert_eq!(p.request.body().as_bytes(), "hello, world");
        assert_eq!(p.len, req.len());
    }

    #[test]
    fn refuses_bad_framing() {
        let cases: [(&[u8], Reject); 7] = [
            (
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
                Reject::BadRequest("both content-length and transfer-encoding"),
            ),
            (
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
                Reject::BadRequest("differing content-length values"),
            ),
            (
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
                Reject::BadRequest("invalid content-length"),
            ),
            (
                b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                Reject::BadRequest("invalid chunk size"),
            ),
            (
                b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
                Reject::UnsupportedCoding,
            ),
            (
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n",
                Reject::BodyTooLarge,
            ),
            (
                b"\x01\x02 garbage\r\n\r\n",
                Reject::BadRequest("malformed request head"),
            ),
        ];
        for (req, want) in cases {
            let got = parse_both(req).unwrap_err();
            assert_eq!(got, want, "{}", String::from_utf8_lossy(req));
        }
        // Equal repeated lengths are one length.
        let ok = complete(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nab",
        );
        assert_eq!(ok.unwrap().unwrap().request.body().as_bytes(), "ab");
    }

    #[test]
    fn a_request_line_without_an_http_version_is_not_http1() {
        assert_eq!(
            parse_both(b"INVALID CONNECTION PREFACE\r\n\r\n").unwrap_err(),
            Reject::NotHttp1
        );
        assert_eq!(
            parse_both(b"GET / HTTP/1.2\r\nHost: x\r\n\r\n").unwrap_err(),
            Reject::BadRequest("unsupported http version")
        );
    }

    #[test]
    fn refuses_oversized_heads() {
        let mut long = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ".to_vec();
        long.extend(std::iter::repeat_n(b'a', 20 * 1024));
        // Even before the head is complete.
        assert_eq!(parse_both(&long).unwrap_err(), Reject::HeadTooLarge);
        let mut many = b"GET / HTTP/1.1\r\nHost: x\r\n".to_vec();
        for i in 0..101 {
            many.extend(format!("X-{i}: v\r\n").as_bytes());
        }
        many.extend(b"\r\n");
        assert_eq!(parse_both(&many).unwrap_err(), Reject::HeadTooLarge);
    }

    #[test]
    fn refuses_obs_fold_and_odd_expectations() {
        let folded = b"GET / HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n";
        assert!(matches!(complete(folded), Err(Reject::BadRequest(_))));
        let expect = b"POST / HTTP/1.1\r\nHost: x\r\nExpect: teapot\r\nContent-Length: 1\r\n\r\n";
        assert_eq!(complete(expect).unwrap_err(), Reject::ExpectationFailed);
    }

    #[test]
    fn reports_a_waiting_100_continue() {
        let head =
            b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n";
        assert!(matches!(
            parse_both(head).unwrap(),
            Progress::Partial {
                head_done: true,
                expects_continue: true,
                need: Some(_),
            }
        ));
        assert!(matches!(
            parse_both(&head[..10]).unwrap(),
            Progress::Partial {
                head_done: false,
                expects_continue: false,
                need: None,
            }
        ));
        // HTTP/1.0 clients never get 100 Continue.
        let old = b"POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n";
        assert!(matches!(
            parse_both(old).unwrap(),
            Progress::Partial {
                expects_continue: false,
                ..
            }
        ));
    }

    fn head(status: StatusCode) -> http::response::Parts {
        let mut res = http::Response::new(());
        *res.status_mut() = status;
        res.headers_mut()
            .insert("x-a", HeaderValue::from_static("b"));
        res.into_parts().0
    }

    #[test]
    fn writes_decimals() {
        for n in [0, 7, 10, 25, 1_000_000, u64::MAX] {
            let mut out = Vec::new();
            push_decimal(&mut out, n);
            assert_eq!(out, n.to_string().as_bytes());
        }
    }

    #[test]
    fn frames_bodies_by_length_chunks_or_close() {
        let ok = head(StatusCode::OK);
        let mut out = Vec::new();
        let got = encode_head(&mut out, &ok, Some(2), Version::HTTP_11, false, true);
        assert_eq!(got, (Framing::Length(2), true));
        assert_eq!(
            out,
            b"HTTP/1.1 200 OK\r\nx-a: b\r\ncontent-length: 2\r\n\r\n"
        );

        out.clear();
        let got = encode_head(&mut out, &ok, Some(2), Version::HTTP_10, true, true);
        assert_eq!(got, (Framing::Empty, true));
        assert_eq!(
            out,
            b"HTTP/1.1 200 OK\r\nx-a: b\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\n"
        );

        out.clear();
        let got = encode_head(&mut out, &ok, None, Version::HTTP_11, false, true);
        assert_eq!(got, (Framing::Chunked, true));
        assert!(out.ends_with(b"transfer-encoding: chunked\r\n\r\n"));

        out.clear();
        let got = encode_head(&mut out, &ok, None, Version::HTTP_10, false, true);
        assert_eq!(
            got,
            (Framing::UntilClose, false),
            "an HTTP/1.0 body of unknown size ends with the connection"
        );
        assert!(out.ends_with(b"connection: close\r\n\r\n"));

        out.clear();
        let got = encode_head(
            &mut out,
            &head(StatusCode::NO_CONTENT),
            Some(0),
            Version::HTTP_11,
            false,
            true,
        );
        assert_eq!(got, (Framing::Empty, true));
        assert!(!out.windows(14).any(|w| w == b"content-length"));
    }
}
