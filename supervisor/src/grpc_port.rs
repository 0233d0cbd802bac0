//! The gRPC port's front door: which TCP connections reach the xDS and ORCA server, and for how long.
//!
//! Anyone who can reach the port can connect; without limits, 20,000 idle connections take every file
//! descriptor the supervisor has, and then a dead worker cannot be restarted nor `peregrine status`
//! answered, and one address could keep every Envoy out. So every connection, from its accept to its
//! close, holds one of [`GrpcLimits::max_connections`] slots, and one address may hold at most
//! [`GrpcLimits::max_connections_per_peer`] of them ([`slots`]). When a cap is full, a new
//! connection takes the slot of the oldest connection that has not proved itself a client (no TLS
//! handshake with a client certificate, or, where the port asks for none, no client's request yet:
//! [`ClientProof`]), and is
//! refused only when every one has (with a log line at most every 10 s saying how many were). A
//! connection must send the HTTP/2 client preface within [`GrpcLimits::handshake_timeout`]; and once
//! admitted it is closed after [`GrpcLimits::idle_timeout`] without an open stream. The cap is
//! lowered at start to what the open-file limit leaves after [`reserved_fds`] (raised first from its
//! soft to its hard value, [`raise_nofile_limit`]), so workers and the control socket never starve.
//!
//! With `[supervisor.tls]` the TLS handshake ([`ServerTls::accept`](crate::tls::server::ServerTls::accept))
//! comes first, within the same handshake timeout as the preface; a connection whose first byte is
//! not a TLS handshake record (cleartext HTTP/2, say) is closed at once.
//!
//! The pieces: [`incoming`] accepts on the listeners and yields [`Admitted`] connections (the
//! preface read and replayed to the server); [`TrackStreamsLayer`] counts each connection's open
//! streams (gRPC calls), which is what "idle" is measured on, and hands each request its
//! connection's [`ClientProof`], which the service calls once a stream carried a client's request
//! (where no client certificate proved the connection); [`Admitted`] closes itself (a read error, which ends the connection in
//! the server) once idle too long, or once its slot went to a newer connection.
//!
//! Invariant: nothing here knows xDS or ORCA; it sees TCP connections, their TLS, the HTTP/2
//! preface and the count of open requests.

mod admission;
mod admitted;
mod conn;
mod slots;
mod track;

pub use self::{
    admission::{Admission, incoming},
    admitted::{Admitted, ClientProof, ConnInfo},
    track::{TrackStreams, TrackStreamsLayer, Tracked},
};
use crate::config::GrpcLimits;

/// The gRPC port's listen backlog: every Envoy of a fleet connects again at once when its
/// supervisor restarts, and 1,000 at once overflowed the 1,024 a listener gets by default (the
/// kernel then answered with SYN cookies). The kernel caps it at `net.core.somaxconn`.
const BACKLOG: u32 = 4096;

/// Binds a listener of the gRPC port (xDS and ORCA, or ORCA alone) at `addr`, with [`BACKLOG`];
/// within a Tokio runtime.
pub fn bind(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As `TcpListener::bind` does: a restarted supervisor binds again while old connections wait.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// The HTTP/2 client connection preface (RFC 9113, section 3.4).
pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// File descriptors kept back from the gRPC port for the rest of the supervisor: per worker lane a
/// pidfd, its registration connection and the pipes of a spawn, plus the control socket's clients,
/// the sampler, the runtime and logs.
pub fn reserved_fds(lanes: usize) -> u64 {
    256 + 8 * lanes as u64
}

/// Raises the soft limit on open files to the hard limit; returns the limit now in effect (`None`:
/// unlimited).
pub fn raise_nofile_limit() -> Option<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        let before = limit.current;
        limit.current = limit.maximum;
        match setrlimit(Resource::Nofile, limit) {
            Ok(()) => {
                tracing::info!(from = ?before, to = ?limit.maximum, "Raised the open-file limit (RLIMIT_NOFILE) to its hard limit");
            }
            Err(error) => {
                tracing::warn!(%error, "Cannot raise the open-file limit (RLIMIT_NOFILE) to its hard limit");
                return before;
            }
        }
    }
    limit.current
}

/// The connection cap in effect: `limits.max_connections`, lowered to what `nofile` open files leave
/// after the reserve for `lanes` worker lanes (at least 16).
pub fn connection_cap(limits: &GrpcLimits, nofile: Option<u64>, lanes: usize) -> usize {
    let budget = nofile.map_or(u64::MAX, |n| n.saturating_sub(reserved_fds(lanes)));
    let cap = limits
        .max_connections
        .min(usize::try_from(budget).unwrap_or(usize::MAX));
    cap.max(16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_leaves_descriptors_for_the_rest() {
        let limits = GrpcLimits::default();
        assert_eq!(connection_cap(&limits, None, 64), 8192);
        assert_eq!(connection_cap(&limits, Some(1 << 20), 64), 8192);
        // 20,000 open files, 16 lanes: 20,000 - 256 - 128.
        let small = GrpcLimits {
            max_connections: 100_000,
            ..limits
        };
        assert_eq!(connection_cap(&small, Some(20_000), 16), 19_616);
        assert_eq!(connection_cap(&limits, Some(300), 16), 16, "never below 16");
    }
}
