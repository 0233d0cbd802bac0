//! The byte streams connections run over, as owned-buffer (completion) operations on io_uring.
//!
//! [`Io`] is what the protocol modules see: a read hands a buffer to the kernel and gets it back with the
//! result, even on error; so does a write. [`Stream`] is an accepted TCP or Unix connection.

use std::io;

use tokio_uring::buf::BoundedBuf;

/// The byte stream a connection runs over: an owned-buffer (completion) interface.
pub(crate) trait Io {
    /// Reads into the spare capacity of `buf` and hands the buffer back.
    async fn read(&self, buf: Vec<u8>) -> (io::Result<usize>, Vec<u8>);
    /// Writes all of `buf` and hands the buffer back.
    async fn write_all(&self, buf: Vec<u8>) -> (io::Result<()>, Vec<u8>);
    /// Shuts the stream down in both directions.
    fn shutdown(&self);
}

/// An accepted connection.
#[allow(
    missing_debug_implementations,
    reason = "tokio-uring's streams are not Debug"
)]
pub(crate) enum Stream {
    Tcp(tokio_uring::net::TcpStream),
    Unix(tokio_uring::net::UnixStream),
}

// === impl Stream ===

impl Io for Stream {
    async fn read(&self, buf: Vec<u8>) -> (io::Result<usize>, Vec<u8>) {
        // A read fills a buffer from its start; a slice over the spare capacity appends instead.
        let spare = {
            let len = buf.len();
            buf.slice(len..)
        };
        let (result, spare) = match self {
            Stream::Tcp(s) => s.read(spare).await,
            Stream::Unix(s) => s.read(spare).await,
        };
        (result, spare.into_inner())
    }

    async fn write_all(&self, buf: Vec<u8>) -> (io::Result<()>, Vec<u8>) {
        match self {
            Stream::Tcp(s) => s.write_all(buf).await,
            Stream::Unix(s) => s.write_all(buf).await,
        }
    }

    fn shutdown(&self) {
        // The peer may be gone already; the socket closes on drop either way.
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Stream::Unix(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }
}
