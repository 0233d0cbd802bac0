//! Request parsing: a pure function from the front of a buffer to a request, a wait for more bytes, or a
//! refusal ([`parse`]), tested without sockets.
//!
//! Invariant: parsing never reads past the request it returns and never allocates per header field
//! when the buffer is shared ([`Source::shared`]); every framing ambiguity (both `Content-Length` and
//! `Transfer-Encoding`, differing lengths, a bad chunk, obs-fold) is a [`Reject`], never a guess.

use std::mem::MaybeUninit;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Version, header};

use super::Limits;
use crate::service::RequestBody;

/// Header slots kept on the stack while parsing; a larger [`Limits::max_headers`] allocates.
const STACK_HEADERS: usize = 128;

/// A request parsed from the front of a buffer.
#[derive(Debug)]
pub(super) struct Parsed {
    pub(super) request: Request<RequestBody>,
    /// How many bytes of the buffer the request took.
    pub(super) len: usize,
    /// Whether the client allows another request on this connection.
    pub(super) keep_alive: bool,
}

/// How far parsing got.
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "returned once per parse and matched at once; boxing would allocate per request"
)]
pub(super) enum Progress {
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
pub(super) enum Reject {
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
    pub(super) fn status(self) -> StatusCode {
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
pub(super) struct Source<'a> {
    /// The bytes to parse.
    buf: &'a [u8],
    /// When set, `buf` lies within these shared bytes, and the request's parts (target, header values,
    /// body) are slices of them: no allocation or copy per header.
    shared: Option<&'a Bytes>,
}

impl<'a> Source<'a> {
    /// Parts are copied out of `buf`.
    pub(super) fn copied(buf: &'a [u8]) -> Self {
        Source { buf, shared: None }
    }

    /// Parts are slices of `shared`, from `offset` on.
    pub(super) fn shared(shared: &'a Bytes, offset: usize) -> Self {
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
pub(super) const SHARE_BELOW: usize = 64 * 1024;

/// Parses one request from the front of `src`.
pub(super) fn parse(src: Source<'_>, limits: &Limits) -> Result<Progress, Reject> {
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
pub(super) fn connection_has(headers: &HeaderMap, token: &str) -> bool {
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

/// A chunk-size line or a trailer field longer than this is not a well-meaning client.
const MAX_LINE: usize = 4096;

/// The length of the line at the front of `buf` (without its CRLF), `Ok(None)` while it is incomplete,
/// or the refusal `too_long` once more than [`MAX_LINE`] bytes came without a CRLF.
fn line_len(buf: &[u8], too_long: &'static str) -> Result<Option<usize>, Reject> {
    match buf.windows(2).position(|w| w == b"\r\n") {
        Some(end) => Ok(Some(end)),
        None if buf.len() > MAX_LINE => Err(Reject::BadRequest(too_long)),
        None => Ok(None),
    }
}

/// Decodes a chunked body from the front of `buf`: the body and the bytes it took, or `Ok(None)` when
/// more bytes are needed. Chunk extensions and trailer fields are read and dropped.
fn decode_chunked(buf: &[u8], limits: &Limits) -> Result<Option<(Vec<u8>, usize)>, Reject> {
    let mut body = Vec::new();
    let mut pos = 0;
    loop {
        let Some(end) = line_len(&buf[pos..], "chunk size line too long")? else {
            return Ok(None);
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
                let Some(end) = line_len(&buf[pos..], "trailer field too long")? else {
                    return Ok(None);
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
}
