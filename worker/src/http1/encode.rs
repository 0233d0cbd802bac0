//! Response encoding: a response's head, its body in the framing the head announced, and the short
//! responses that refuse a request, all appended to the connection's output buffer.
//!
//! Invariant: a body is sent exactly as its head framed it (`content-length`, chunked, or until close);
//! a body longer or shorter than its `content-length` is a [`BodyError`], never sent as if whole. The
//! output buffer is written only once it grows past [`FLUSH_AT`] (or by the connection, per batch).

use std::{
    io,
    pin::{Pin, pin},
    task::{Context, Poll, Waker},
};

use bytes::Buf;
use http::{HeaderValue, Response, StatusCode, Version, header};
use http_body::Body;
use http_body_util::BodyExt;

use crate::{
    BoxError,
    load_report::{self, Carried, LOAD_METRICS_HEADER},
    stream::Io,
};

/// How a response body follows its head on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Framing {
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
/// header is written when that differs from the version's default. `load_report` is the worker's
/// latest ORCA load report ([`crate::load_report`]), sent unless the application set that header
/// itself.
fn encode_head(
    out: &mut Vec<u8>,
    res: &http::response::Parts,
    size: Option<u64>,
    request_version: Version,
    head_only: bool,
    keep_alive: bool,
    load_report: Option<&HeaderValue>,
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
    let mut load_report = load_report;
    for (name, value) in &res.headers {
        if name == header::CONTENT_LENGTH
            || name == header::TRANSFER_ENCODING
            || name == header::CONNECTION
        {
            continue;
        }
        if load_report.is_some() && name == LOAD_METRICS_HEADER {
            load_report = None;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if let Some(report) = load_report {
        out.extend_from_slice(LOAD_METRICS_HEADER.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(report.as_bytes());
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
pub(super) fn encode_error(out: &mut Vec<u8>, status: StatusCode) {
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
pub(super) enum BodyError {
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

/// Queues the whole of `out` to send and empties it; waits only while the stream's queue is full.
pub(super) async fn flush<I: Io>(io: &I, out: &mut Vec<u8>) -> io::Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    crate::stream::write(io, out).await
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
fn append_ready<B>(
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
async fn write_body<I, B>(
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

/// Appends `res` to `out` (writing as it goes when its body is large or slow); returns whether the
/// connection stays open afterwards. `request_version`, `head_only` and `keep_alive` are as for
/// [`encode_head`]; the latest load report goes with it unless the connection (`carried`) has
/// carried it already.
pub(super) async fn write_response<I, B>(
    io: &I,
    out: &mut Vec<u8>,
    res: Response<B>,
    request_version: Version,
    head_only: bool,
    keep_alive: bool,
    carried: &Carried,
) -> Result<bool, BodyError>
where
    I: Io,
    B: Body,
    B::Error: Into<BoxError>,
{
    let (parts, body) = res.into_parts();
    let size = body.size_hint().exact();
    let (framing, keep_alive) = load_report::with_new_header(carried, |report| {
        encode_head(
            out,
            &parts,
            size,
            request_version,
            head_only,
            keep_alive,
            report,
        )
    });
    let mut body = pin!(body);
    let mut sent = 0;
    match append_ready(out, body.as_mut(), framing, &mut sent) {
        Poll::Ready(result) => result?,
        Poll::Pending => write_body(io, out, body.as_mut(), framing, sent).await?,
    }
    Ok(keep_alive)
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

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
        let got = encode_head(&mut out, &ok, Some(2), Version::HTTP_11, false, true, None);
        assert_eq!(got, (Framing::Length(2), true));
        assert_eq!(
            out,
            b"HTTP/1.1 200 OK\r\nx-a: b\r\ncontent-length: 2\r\n\r\n"
        );

        out.clear();
        let got = encode_head(&mut out, &ok, Some(2), Version::HTTP_10, true, true, None);
        assert_eq!(got, (Framing::Empty, true));
        assert_eq!(
            out,
            b"HTTP/1.1 200 OK\r\nx-a: b\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\n"
        );

        out.clear();
        let got = encode_head(&mut out, &ok, None, Version::HTTP_11, false, true, None);
        assert_eq!(got, (Framing::Chunked, true));
        assert!(out.ends_with(b"transfer-encoding: chunked\r\n\r\n"));

        out.clear();
        let got = encode_head(&mut out, &ok, None, Version::HTTP_10, false, true, None);
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
            None,
        );
        assert_eq!(got, (Framing::Empty, true));
        assert!(!out.windows(14).any(|w| w == b"content-length"));
    }

    #[test]
    fn the_load_report_goes_out_unless_the_application_sent_one() {
        let report = HeaderValue::from_static("CQAAAAAAAOA/");
        let mut out = Vec::new();
        let ok = head(StatusCode::OK);
        encode_head(
            &mut out,
            &ok,
            Some(2),
            Version::HTTP_11,
            false,
            true,
            Some(&report),
        );
        assert_eq!(
            out,
            b"HTTP/1.1 200 OK\r\nx-a: b\r\nendpoint-load-metrics-bin: CQAAAAAAAOA/\r\n\
              content-length: 2\r\n\r\n"
        );
        let mut own = head(StatusCode::OK);
        own.headers
            .insert(LOAD_METRICS_HEADER, HeaderValue::from_static("MQ=="));
        out.clear();
        encode_head(
            &mut out,
            &own,
            Some(2),
            Version::HTTP_11,
            false,
            true,
            Some(&report),
        );
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text.matches("endpoint-load-metrics-bin").count(),
            1,
            "{text}"
        );
        assert!(
            text.contains("endpoint-load-metrics-bin: MQ==\r\n"),
            "{text}"
        );
    }
}
