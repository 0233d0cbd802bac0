//! HTTP/1.1: every complete request at the front of a buffer, parsed with `httparse`, turned into an
//! `http::Request`, answered by the application and encoded into the connection's output, in order.
//!
//! Minimal on purpose: `Content-Length` bodies are skipped (the application gets an empty body), a
//! `Transfer-Encoding` request or a malformed one gets a `400` and the connection closes, and there are
//! no limits on head or body size.

use http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body;
use peregrine_worker::{Hello, RequestBody};

use crate::app;

/// Header slots on the stack.
const MAX_HEADERS: usize = 64;

/// Answers every complete request at the front of `buf` into `out`. Returns how many bytes the
/// answered requests took, and whether the connection must close once `out` is sent (the rest of the
/// input then is to be ignored).
pub(crate) fn serve(buf: &[u8], out: &mut Vec<u8>, service: &mut Hello) -> (usize, bool) {
    let mut at = 0;
    while at < buf.len() {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut parsed = httparse::Request::new(&mut headers);
        let head_len = match parsed.parse(&buf[at..]) {
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) => break,
            Err(_) => return refuse(out, StatusCode::BAD_REQUEST),
        };
        let version = if parsed.version == Some(1) {
            Version::HTTP_11
        } else {
            Version::HTTP_10
        };
        let mut keep_alive = version == Version::HTTP_11;
        let mut body_len = 0usize;
        for field in parsed.headers.iter() {
            if field.name.eq_ignore_ascii_case("content-length") {
                match std::str::from_utf8(field.value)
                    .ok()
                    .and_then(|v| v.trim().parse().ok())
                {
                    Some(n) => body_len = n,
                    None => return refuse(out, StatusCode::BAD_REQUEST),
                }
            } else if field.name.eq_ignore_ascii_case("transfer-encoding") {
                return refuse(out, StatusCode::BAD_REQUEST);
            } else if field.name.eq_ignore_ascii_case("connection") {
                for token in field.value.split(|&b| b == b',') {
                    let token = token.trim_ascii();
                    if token.eq_ignore_ascii_case(b"close") {
                        keep_alive = false;
                    } else if token.eq_ignore_ascii_case(b"keep-alive") {
                        keep_alive = true;
                    }
                }
            }
        }
        let Some(len) = head_len.checked_add(body_len) else {
            return refuse(out, StatusCode::BAD_REQUEST);
        };
        if buf.len() - at < len {
            break;
        }
        let Some(request) = to_request(&parsed, version) else {
            return refuse(out, StatusCode::BAD_REQUEST);
        };
        let head_only = request.method() == Method::HEAD;
        let Some(response) = app::call(service, request) else {
            return refuse(out, StatusCode::INTERNAL_SERVER_ERROR);
        };
        if !encode(out, response, version, head_only, keep_alive) {
            return refuse(out, StatusCode::INTERNAL_SERVER_ERROR);
        }
        at += len;
        if !keep_alive {
            return (at, true);
        }
    }
    (at, false)
}

/// The `http::Request` of a parsed head, with an empty body.
fn to_request(
    parsed: &httparse::Request<'_, '_>,
    version: Version,
) -> Option<Request<RequestBody>> {
    let method = Method::from_bytes(parsed.method?.as_bytes()).ok()?;
    let uri = Uri::try_from(parsed.path?).ok()?;
    let mut request = Request::new(RequestBody::default());
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.version_mut() = version;
    let headers = request.headers_mut();
    headers.reserve(parsed.headers.len());
    for field in parsed.headers.iter() {
        let name = HeaderName::from_bytes(field.name.as_bytes()).ok()?;
        let value = HeaderValue::from_bytes(field.value).ok()?;
        headers.append(name, value);
    }
    Some(request)
}

/// Appends a response (head, then body unless `head_only`) to `out`, like the worker's encoder for a
/// body of known size. `false` if the body was not ready at once.
fn encode<B: Body>(
    out: &mut Vec<u8>,
    response: Response<B>,
    version: Version,
    head_only: bool,
    keep_alive: bool,
) -> bool {
    let (parts, body) = response.into_parts();
    let Some(data) = app::body_bytes(body) else {
        return false;
    };
    let len = data.len() as u64;
    if peregrine_worker::http1::head_of_known_size(out, &parts, len, version, head_only, keep_alive)
    {
        out.extend_from_slice(&data);
    }
    true
}

/// Appends a short plain-text refusal that closes the connection; all input counts as consumed.
fn refuse(out: &mut Vec<u8>, status: StatusCode) -> (usize, bool) {
    let reason = status.canonical_reason().unwrap_or("Error");
    out.extend_from_slice(
        format!(
            "HTTP/1.1 {} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{reason}\n",
            status.as_str(),
            reason.len() + 1
        )
        .as_bytes(),
    );
    (usize::MAX, true)
}
