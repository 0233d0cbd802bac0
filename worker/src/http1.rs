//! HTTP/1.1 (and 1.0) over one connection.
//!
//! The connection owns two buffers and passes them to the kernel and back (completion IO): `input`
//! collects bytes read, `output` collects every response of one batch. Each turn of the loop parses every
//! complete request already in `input`, calls the application for each in order, appends the responses to
//! `output` and writes the batch with one `write_all`; so pipelined requests are answered in order with as
//! few writes as possible.
//!
//! Framing rules: a request body is delimited by `Content-Length` or `Transfer-Encoding: chunked`; both
//! at once, differing `Content-Length` values, a malformed head and a bad chunk are answered with
//! `400 Bad Request`, an oversized head with `431`, an oversized body with `413`, and each of these
//! closes the connection, since the next request's start is unknown. Every response carries a
//! `content-length`.
//!
//! The parts, one idea each: `parse` (bytes to requests, a pure function tested without sockets),
//! `encode` (responses to bytes, in the framing their heads announce) and `connection` (the loop that
//! reads, answers and writes, with its timeouts and its charge on the worker's body budget).
//!
//! Architecture Invariant: nothing here knows which runtime drives it beyond the [`Io`](crate::stream::Io)
//! trait, and nothing here knows about HTTP/2 but the bytes of the GOAWAY that answers a peer that meant
//! it (`http2::GOAWAY_PROTOCOL_ERROR`); `server` picks the protocol and runs the accept loops.

use std::time::Duration;

mod connection;
mod encode;
mod parse;

pub(crate) use self::connection::serve_connection;

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
