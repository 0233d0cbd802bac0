//! Entry points for the fuzz targets in `worker/fuzz` (feature `fuzzing`; not a stable API).
//!
//! [`http1_connection`] runs the whole HTTP/1 request path (parsing, framing, 100-continue, pipelining,
//! response encoding) over an in-memory stream that delivers the input in the pieces given, and checks
//! that what the server wrote is a well-formed sequence of HTTP/1.1 responses.

use std::{
    cell::RefCell,
    collections::VecDeque,
    convert::Infallible,
    io,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;

use crate::{
    http1::{self, Limits},
    service::RequestBody,
    stream::Io,
};

/// An in-memory stream: reads return the queued pieces, then end of stream; writes are collected.
struct Script {
    reads: RefCell<VecDeque<Vec<u8>>>,
    written: RefCell<Vec<u8>>,
}

impl Io for &Script {
    /// One piece per read, as one receive would bring it; what the reader leaves stays at the front.
    fn poll_read(
        &self,
        _: &mut Context<'_>,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Poll<io::Result<usize>> {
        let mut reads = self.reads.borrow_mut();
        Poll::Ready(Ok(match reads.pop_front() {
            Some(mut piece) => {
                let n = take(&piece);
                if n < piece.len() {
                    piece.drain(..n);
                    reads.push_front(piece);
                }
                n
            }
            None => 0,
        }))
    }

    fn poll_write(&self, _: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        self.written.borrow_mut().extend_from_slice(data);
        Poll::Ready(Ok(data.len()))
    }

    fn poll_flushed(&self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn shutdown(&self) {}
}

/// Echoes the method, the target and the body.
async fn echo(req: Request<RequestBody>) -> Result<Response<Full<Bytes>>, Infallible> {
    let mut body = format!("{} {} ", req.method(), req.uri()).into_bytes();
    body.extend_from_slice(req.body().as_bytes());
    Ok(Response::new(Full::new(Bytes::from(body))))
}

/// Serves `input`, cut at `cuts` (offsets, in any order), on one HTTP/1 connection; returns what the
/// server wrote.
///
/// # Panics
///
/// When the server's output is not a sequence of well-formed HTTP/1.1 responses, each with a body the
/// length it announces, or when it answers more requests than the input holds.
pub fn http1_connection(input: &[u8], cuts: &[usize]) -> Vec<u8> {
    let mut offsets: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
    offsets.push(input.len());
    offsets.sort_unstable();
    let mut pieces = VecDeque::new();
    let mut start = 0;
    for end in offsets {
        if end > start {
            pieces.push_back(input[start..end].to_vec());
            start = end;
        }
    }
    let script = Script {
        reads: RefCell::new(pieces),
        written: RefCell::new(Vec::new()),
    };
    let limits = Limits {
        max_body_bytes: 64 * 1024,
        max_head_bytes: 8 * 1024,
        ..Limits::default()
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
    let (_stop, stopped) = tokio::sync::watch::channel(false);
    let service = tower::service_fn(echo);
    let bodies = crate::budget::Budget::new(usize::MAX, None);
    // Reads never block, so the connection ends when the input does (or on an error response).
    let _ = runtime.block_on(http1::serve_connection(
        &script,
        Vec::new(),
        service,
        &limits,
        &bodies,
        stopped,
    ));
    let written = script.written.into_inner();
    check_responses(&written, input);
    written
}

/// Asserts that `out` is a sequence of complete HTTP/1.1 responses (interim `100 Continue` allowed).
fn check_responses(mut out: &[u8], input: &[u8]) {
    // Bytes that name no HTTP/1 version are answered as a broken HTTP/2 preface.
    if out == crate::http2::GOAWAY_PROTOCOL_ERROR {
        return;
    }
    let mut finals = 0;
    while !out.is_empty() {
        let mut fields = [httparse::EMPTY_HEADER; 16];
        let mut res = httparse::Response::new(&mut fields);
        let head = match res.parse(out) {
            Ok(httparse::Status::Complete(n)) => n,
            other => panic!(
                "malformed response head ({other:?}): {:?}",
                String::from_utf8_lossy(out)
            ),
        };
        let status = res.code.expect("a status");
        let length = res
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("content-length"))
            .map(|h| {
                std::str::from_utf8(h.value)
                    .unwrap()
                    .parse::<usize>()
                    .unwrap()
            });
        if status == 100 {
            assert_eq!(length, None, "an interim response has no body");
            out = &out[head..];
            continue;
        }
        finals += 1;
        // The echo app and every error response have a known length, so every final response carries
        // one. A response to HEAD has no body: the next response (or the end) follows its head. No body
        // of ours starts like a response: echoes start with a method, errors with a reason phrase.
        let length = length.expect("every final response announces its length");
        let rest = &out[head..];
        if rest.is_empty() || rest.starts_with(b"HTTP/1.1 ") {
            out = rest;
        } else {
            assert!(
                rest.len() >= length,
                "a body shorter than its content-length: {:?}",
                String::from_utf8_lossy(rest)
            );
            out = &rest[length..];
        }
    }
    // Every answered request ends its head with an empty line (CRLF or, as httparse allows, a bare LF);
    // at most one more response refuses what followed the last of them.
    let heads = (0..input.len())
        .filter(|&i| {
            input[i] == b'\n'
                && (input.get(i + 1) == Some(&b'\n')
                    || (input.get(i + 1) == Some(&b'\r') && input.get(i + 2) == Some(&b'\n')))
        })
        .count();
    assert!(
        finals <= heads + 1,
        "{finals} responses to at most {heads} requests and one refusal"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipelined_requests_in_every_split_get_the_same_answers() {
        let input = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nPOST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nxyzPOST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n";
        let whole = http1_connection(input, &[]);
        assert_eq!(
            String::from_utf8_lossy(&whole)
                .matches("HTTP/1.1 200")
                .count(),
            3
        );
        for cut in 0..input.len() {
            assert_eq!(
                http1_connection(input, &[cut, cut / 2]),
                whole,
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn bad_input_gets_one_error_response() {
        for input in [
            &b"\x00\x01garbage\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        ] {
            let out = http1_connection(input, &[3]);
            assert!(
                out.starts_with(b"HTTP/1.1 400 "),
                "{}",
                String::from_utf8_lossy(&out)
            );
        }
    }
}
