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

use std::{future::poll_fn, io};

use bytes::Bytes;
use http::{
    HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Version, header,
};
use tower::Service;

use crate::{BoxError, stream::Io};

/// How many bytes a read asks for at least.
const READ_CHUNK: usize = 16 * 1024;

/// Header slots kept on the stack while parsing; a larger [`Limits::max_headers`] allocates.
const STACK_HEADERS: usize = 128;

/// The limits a connection enforces on requests.
///
/// The defaults are: a 16 KiB request head, 100 header fields and a 1 MiB body.
#[derive(Clone, Debug)]
pub struct Limits {
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
            max_head_bytes: 16 * 1024,
            max_headers: 100,
            max_body_bytes: 1024 * 1024,
        }
    }
}

/// A request parsed from the front of a buffer.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub(crate) request: Request<Bytes>,
    /// How many bytes of the buffer the request took.
    pub(crate) len: usize,
    /// Whether the client allows another request on this connection.
    pub(crate) keep_alive: bool,
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
}

impl Reject {
    pub(crate) fn status(self) -> StatusCode {
        match self {
            Reject::BadRequest(_) => StatusCode::BAD_REQUEST,
            Reject::UnsupportedCoding => StatusCode::NOT_IMPLEMENTED,
            Reject::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Reject::HeadTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        }
    }
}

/// Parses one request from the front of `buf`: `Ok(None)` when more bytes are needed.
pub(crate) fn parse(buf: &[u8], limits: &Limits) -> Result<Option<Parsed>, Reject> {
    // The usual limit fits on the stack: no allocation per request.
    let mut stack = [httparse::EMPTY_HEADER; STACK_HEADERS];
    let mut heap;
    let fields = if limits.max_headers <= STACK_HEADERS {
        &mut stack[..limits.max_headers]
    } else {
        heap = vec![httparse::EMPTY_HEADER; limits.max_headers];
        &mut heap[..]
    };
    let mut req = httparse::Request::new(fields);
    let head_len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) if n > limits.max_head_bytes => {
            return Err(Reject::HeadTooLarge);
        }
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() > limits.max_head_bytes => {
            return Err(Reject::HeadTooLarge);
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(Reject::HeadTooLarge),
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
        .and_then(|p| http::Uri::try_from(p).ok())
        .ok_or(Reject::BadRequest("invalid request target"))?;
    let mut headers = HeaderMap::with_capacity(req.headers.len());
    for field in req.headers.iter() {
        let name = HeaderName::from_bytes(field.name.as_bytes())
            .map_err(|_| Reject::BadRequest("invalid header name"))?;
        let value = HeaderValue::from_bytes(field.value)
            .map_err(|_| Reject::BadRequest("invalid header value"))?;
        headers.append(name, value);
    }

    let keep_alive = keep_alive(version, &headers);
    let content_length = content_length(&headers)?;
    let chunked = chunked(&headers)?;
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
                return Ok(None);
            };
            (Bytes::copy_from_slice(body), head_len + n)
        }
        (None, true) => match decode_chunked(&buf[head_len..], limits)? {
            Some((body, n)) => (Bytes::from(body), head_len + n),
            None => return Ok(None),
        },
        (None, false) => (Bytes::new(), head_len),
    };

    let mut request = Request::new(body);
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.version_mut() = version;
    *request.headers_mut() = headers;
    Ok(Some(Parsed {
        request,
        len,
        keep_alive,
    }))
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

/// Appends `res` to `out` as an HTTP/1.1 response.
///
/// `head_only` drops the body (a response to `HEAD`) but keeps its `content-length`; `keep_alive` says
/// whether the connection stays open, for a `connection` header when it differs from the version's default.
pub(crate) fn encode_response(
    out: &mut Vec<u8>,
    res: &Response<Bytes>,
    request_version: Version,
    head_only: bool,
    keep_alive: bool,
) {
    let status = res.status();
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in res.headers() {
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
    if !bodiless {
        out.extend_from_slice(format!("content-length: {}\r\n", res.body().len()).as_bytes());
    }
    if !keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    } else if request_version == Version::HTTP_10 {
        out.extend_from_slice(b"connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
    if !bodiless && !head_only {
        out.extend_from_slice(res.body());
    }
}

/// A short plain-text response for a refused request.
pub(crate) fn error_response(status: StatusCode) -> Response<Bytes> {
    let reason = status.canonical_reason().unwrap_or("Error");
    let mut res = Response::new(Bytes::from(format!("{reason}\n")));
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    res
}

/// Calls the application once it is ready.
async fn call<S>(service: &mut S, request: Request<Bytes>) -> Result<Response<Bytes>, BoxError>
where
    S: Service<Request<Bytes>, Response = Response<Bytes>>,
    S::Error: Into<BoxError>,
{
    poll_fn(|cx| service.poll_ready(cx))
        .await
        .map_err(Into::into)?;
    service.call(request).await.map_err(Into::into)
}

/// Serves HTTP/1 requests on `io` until the client closes, a request asks to close, a request is
/// refused, or `shutdown` fires while the connection is idle.
///
/// After `shutdown` fires, the requests already read are answered (with `connection: close`) and the
/// connection closes. Returns an error only for a failed read or write.
pub(crate) async fn serve_connection<I, S>(
    io: I,
    mut service: S,
    limits: &Limits,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> io::Result<()>
where
    I: Io,
    S: Service<Request<Bytes>, Response = Response<Bytes>>,
    S::Error: Into<BoxError>,
{
    let mut input: Vec<u8> = Vec::with_capacity(READ_CHUNK);
    let mut output: Vec<u8> = Vec::new();
    loop {
        let mut close = false;
        let mut start = 0;
        while !close {
            let parsed = match parse(&input[start..], limits) {
                Ok(Some(parsed)) => parsed,
                Ok(None) => break,
                Err(reject) => {
                    tracing::debug!(?reject, "Refusing request");
                    let res = error_response(reject.status());
                    encode_response(&mut output, &res, Version::HTTP_11, false, false);
                    close = true;
                    break;
                }
            };
            start += parsed.len;
            crate::counter::record_request();
            let version = parsed.request.version();
            let head_only = parsed.request.method() == Method::HEAD;
            let res = match call(&mut service, parsed.request).await {
                Ok(res) => res,
                Err(error) => {
                    tracing::warn!(%error, "Application failed, answering 500");
                    close = true;
                    error_response(StatusCode::INTERNAL_SERVER_ERROR)
                }
            };
            let keep_alive = parsed.keep_alive
                && !close
                && !connection_has(res.headers(), "close")
                && !*shutdown.borrow();
            encode_response(&mut output, &res, version, head_only, keep_alive);
            close = !keep_alive;
        }
        input.drain(..start);

        if !output.is_empty() {
            let (result, buf) = io.write_all(output).await;
            output = buf;
            output.clear();
            result?;
        }
        if close {
            io.shutdown();
            return Ok(());
        }

        if input.capacity() - input.len() < READ_CHUNK / 2 {
            input.reserve(READ_CHUNK);
        }
        let idle = input.is_empty();
        let read = io.read(input);
        let (result, buf) = if idle {
            if *shutdown.borrow_and_update() {
                return Ok(());
            }
            tokio::select! {
                r = read => r,
                _ = shutdown.changed() => return Ok(()),
            }
        } else {
            read.await
        };
        input = buf;
        if result? == 0 {
            // The client closed; a partial request left in the buffer is dropped.
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(mut buf: &[u8]) -> Result<Vec<Parsed>, Reject> {
        let mut out = Vec::new();
        while let Some(p) = parse(buf, &Limits::default())? {
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
        let got = parse_all(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nPOST /b HTTP/1.1\r\nContent-Length: 3\r\n\r\nabcGET /c HTTP/1.0\r\n\r\n")
            .unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].request.uri(), "/a");
        assert!(got[0].keep_alive);
        assert_eq!(got[1].request.body(), "abc");
        assert_eq!(got[2].request.version(), Version::HTTP_10);
        assert!(!got[2].keep_alive);
    }

    #[test]
    fn waits_for_a_whole_request() {
        let full = b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello";
        for n in 0..full.len() {
            assert!(
                parse(&full[..n], &Limits::default()).unwrap().is_none(),
                "complete at {n}"
            );
        }
        assert!(parse(full, &Limits::default()).unwrap().is_some());
    }

    #[test]
    fn keep_alive_follows_version_and_connection() {
        let ka = |s: &[u8]| parse(s, &Limits::default()).unwrap().unwrap().keep_alive;
        assert!(ka(b"GET / HTTP/1.1\r\n\r\n"));
        assert!(!ka(b"GET / HTTP/1.1\r\nConnection: Close\r\n\r\n"));
        assert!(!ka(b"GET / HTTP/1.0\r\n\r\n"));
        assert!(ka(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"));
    }

    #[test]
    fn decodes_chunked_bodies() {
        let req = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nX-Trailer: y\r\n\r\n";
        for n in 0..req.len() {
            assert!(
                parse(&req[..n], &Limits::default()).unwrap().is_none(),
                "complete at {n}"
            );
        }
        let p = parse(req, &Limits::default()).unwrap().unwrap();
        assert_eq!(p.request.body(), "hello, world");
        assert_eq!(p.len, req.len());
    }

    #[test]
    fn refuses_bad_framing() {
        let cases: [(&[u8], Reject); 7] = [
            (
                b"POST / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
                Reject::BadRequest("both content-length and transfer-encoding"),
            ),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
                Reject::BadRequest("differing content-length values"),
            ),
            (
                b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
                Reject::BadRequest("invalid content-length"),
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                Reject::BadRequest("invalid chunk size"),
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
                Reject::UnsupportedCoding,
            ),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 2000000\r\n\r\n",
                Reject::BodyTooLarge,
            ),
            (
                b"\x01\x02 garbage\r\n\r\n",
                Reject::BadRequest("malformed request head"),
            ),
        ];
        for (req, want) in cases {
            let got = parse(req, &Limits::default()).unwrap_err();
            assert_eq!(got, want, "{}", String::from_utf8_lossy(req));
        }
        // Equal repeated lengths are one length.
        let ok = parse(
            b"POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nab",
            &Limits::default(),
        );
        assert_eq!(ok.unwrap().unwrap().request.body(), "ab");
    }

    #[test]
    fn refuses_oversized_heads() {
        let mut long = b"GET / HTTP/1.1\r\nX-Big: ".to_vec();
        long.extend(std::iter::repeat_n(b'a', 20 * 1024));
        // Even before the head is complete.
        assert_eq!(
            parse(&long, &Limits::default()).unwrap_err(),
            Reject::HeadTooLarge
        );
        let mut many = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..101 {
            many.extend(format!("X-{i}: v\r\n").as_bytes());
        }
        many.extend(b"\r\n");
        assert_eq!(
            parse(&many, &Limits::default()).unwrap_err(),
            Reject::HeadTooLarge
        );
    }

    #[test]
    fn encodes_responses_with_a_length() {
        let mut res = Response::new(Bytes::from_static(b"hi"));
        res.headers_mut()
            .insert("x-a", HeaderValue::from_static("b"));
        let mut out = Vec::new();
        encode_response(&mut out, &res, Version::HTTP_11, false, true);
        assert_eq!(
            out,
            b"HTTP/1.1 200 OK\r\nx-a: b\r\ncontent-length: 2\r\n\r\nhi"
        );
        out.clear();
        encode_response(&mut out, &res, Version::HTTP_10, true, true);
        assert_eq!(
            out,
            b"HTTP/1.1 200 OK\r\nx-a: b\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\n"
        );
        out.clear();
        encode_response(&mut out, &res, Version::HTTP_11, false, false);
        assert!(out.ends_with(b"connection: close\r\n\r\nhi"));
    }
}
