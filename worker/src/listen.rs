//! Binding the worker's own listeners.
//!
//! A worker binds its listeners itself, with `socket2`, before it registers: the supervisor learns the
//! concrete addresses from the registration, never the other way round.
//!
//! Architecture Invariant: no socket is ever bound with `SO_REUSEPORT`. A listener belongs to exactly
//! one worker process, so a port the kernel reports as taken really is taken.

use std::{
    fmt, io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, ToSocketAddrs},
    os::unix::{
        fs::FileTypeExt,
        net::{UnixListener, UnixStream},
    },
    path::{Path, PathBuf},
};

use socket2::{Domain, SockAddr, Socket, Type};

use peregrine_contract::url::BindUrl;

/// The listen backlog of every listener.
pub const BACKLOG: i32 = 1024;

/// A bound, listening std socket.
#[derive(Debug)]
pub enum Listener {
    /// A TCP listener.
    Tcp(TcpListener),
    /// A Unix-domain stream listener.
    Unix(UnixListener),
}

/// A concrete address a listener is bound to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum BoundAddr {
    /// An IP socket address with its concrete (never 0) port.
    Ip(SocketAddr),
    /// The path of a Unix-domain socket.
    Unix(PathBuf),
}

/// A listener and the address it is bound to.
#[derive(Debug)]
pub struct BoundListener {
    /// The listening socket.
    pub listener: Listener,
    /// Where it listens.
    pub addr: BoundAddr,
}

/// Why a listener could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// The host name could not be resolved.
    #[error("cannot resolve {host}")]
    Resolve {
        /// The host name.
        host: String,
        /// The resolver's error.
        #[source]
        source: io::Error,
    },
    /// The host name resolved to no address.
    #[error("{host} resolves to no address")]
    NoAddress {
        /// The host name.
        host: String,
    },
    /// A socket could not be created, bound or put into the listening state.
    #[error("cannot bind {addr}")]
    Bind {
        /// The address (`ip:port` or a Unix path).
        addr: String,
        /// The system's error.
        #[source]
        source: io::Error,
    },
    /// Something other than a socket exists at the Unix socket's path.
    #[error("refusing to replace {}: it exists and is not a socket", path.display())]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// A live process is listening on the Unix socket's path.
    #[error("cannot bind {}: another process is listening on it", path.display())]
    InUse {
        /// The path.
        path: PathBuf,
    },
    /// A stale socket file could not be removed.
    #[error("cannot remove stale socket {}", path.display())]
    RemoveStale {
        /// The path.
        path: PathBuf,
        /// The system's error.
        #[source]
        source: io::Error,
    },
}

/// Binds every listener `url` asks for and returns them with their concrete addresses.
///
/// - `http://HOST:PORT` binds each address `HOST` resolves to, each on its own socket (`IPV6_V6ONLY` on
///   IPv6 sockets). `localhost` always means both `::1` and `127.0.0.1` (RFC 6761), whatever the hosts
///   file says. With port 0 the first socket gets an ephemeral port and the others try the same port,
///   falling back to an ephemeral port of their own when it is taken.
/// - `unix:///PATH` removes a stale socket file at `PATH` (only a socket nobody listens on; any other
///   file is refused) and binds there.
pub fn bind(url: &BindUrl) -> Result<Vec<BoundListener>, BindError> {
    match url {
        BindUrl::Tcp { host, port } => bind_tcp(host, *port),
        BindUrl::Unix { path } => bind_unix(path).map(|b| vec![b]),
    }
}

fn resolve(host: &str, port: u16) -> Result<Vec<IpAddr>, BindError> {
    if host.eq_ignore_ascii_case("localhost") {
        return Ok(vec![
            IpAddr::V6(Ipv6Addr::LOCALHOST),
            IpAddr::V4(Ipv4Addr::LOCALHOST),
        ]);
    }
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![ip]);
    }
    let resolved = (host, port)
        .to_socket_addrs()
        .map_err(|source| BindError::Resolve {
            host: host.into(),
            source,
        })?;
    let mut ips: Vec<IpAddr> = Vec::new();
    for addr in resolved {
        if !ips.contains(&addr.ip()) {
            ips.push(addr.ip());
        }
    }
    if ips.is_empty() {
        return Err(BindError::NoAddress { host: host.into() });
    }
    Ok(ips)
}

fn bind_tcp(host: &str, port: u16) -> Result<Vec<BoundListener>, BindError> {
    let ips = resolve(host, port)?;
    let several = ips.len() > 1;
    let mut bound: Vec<BoundListener> = Vec::with_capacity(ips.len());
    for ip in ips {
        // The first ephemeral port becomes everyone's port, so one name maps to one port when possible.
        let shared = match bound.first() {
            Some(BoundListener {
                addr: BoundAddr::Ip(first),
                ..
            }) if port == 0 => first.port(),
            _ => port,
        };
        let result = match bind_ip(SocketAddr::new(ip, shared)) {
            Err(e) if shared != port && e.kind() == io::ErrorKind::AddrInUse => {
                tracing::debug!(%ip, port = shared, "Port taken on this address, binding an ephemeral one");
                bind_ip(SocketAddr::new(ip, 0))
            }
            other => other,
        };
        match result {
            Ok(listener) => {
                let addr = listener.local_addr().map_err(|source| BindError::Bind {
                    addr: SocketAddr::new(ip, shared).to_string(),
                    source,
                })?;
                bound.push(BoundListener {
                    listener: Listener::Tcp(listener),
                    addr: BoundAddr::Ip(addr),
                });
            }
            // A name may resolve to a family the host lacks (no IPv6 on loopback): skip that address.
            Err(e) if several && e.kind() == io::ErrorKind::AddrNotAvailable => {
                tracing::warn!(%ip, %host, error = %e, "Address unavailable, not listening on it");
            }
            Err(source) => {
                return Err(BindError::Bind {
                    addr: SocketAddr::new(ip, shared).to_string(),
                    source,
                });
            }
        }
    }
    if bound.is_empty() {
        return Err(BindError::NoAddress { host: host.into() });
    }
    Ok(bound)
}

fn bind_ip(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    // SO_REUSEADDR only lets a restarted worker rebind a port with connections in TIME_WAIT; it never
    // lets two live listeners share a port (that would be SO_REUSEPORT, which Peregrine never sets).
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

fn bind_unix(path: &Path) -> Result<BoundListener, BindError> {
    remove_stale(path)?;
    let err = |source| BindError::Bind {
        addr: path.display().to_string(),
        source,
    };
    let socket = Socket::new(Domain::UNIX, Type::STREAM, None).map_err(err)?;
    socket
        .bind(&SockAddr::unix(path).map_err(err)?)
        .map_err(err)?;
    socket.listen(BACKLOG).map_err(err)?;
    std::fs::set_permissions(
        path,
        std::os::unix::fs::PermissionsExt::from_mode(peregrine_contract::url::UNIX_SOCKET_MODE),
    )
    .map_err(err)?;
    Ok(BoundListener {
        listener: Listener::Unix(socket.into()),
        addr: BoundAddr::Unix(path.to_path_buf()),
    })
}

/// Removes a socket file nobody listens on; refuses any other kind of file.
fn remove_stale(path: &Path) -> Result<(), BindError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(BindError::Bind {
                addr: path.display().to_string(),
                source,
            });
        }
    };
    if !meta.file_type().is_socket() {
        return Err(BindError::NotASocket { path: path.into() });
    }
    if UnixStream::connect(path).is_ok() {
        return Err(BindError::InUse { path: path.into() });
    }
    tracing::debug!(path = %path.display(), "Removing stale socket");
    std::fs::remove_file(path).map_err(|source| BindError::RemoveStale {
        path: path.into(),
        source,
    })
}

// === impl BoundAddr ===

impl fmt::Display for BoundAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BoundAddr::Ip(addr) => write!(f, "{addr}"),
            BoundAddr::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    fn url(s: &str) -> BindUrl {
        s.parse().unwrap()
    }

    #[test]
    fn localhost_binds_both_families_on_distinct_sockets() {
        let bound = bind(&url("http://localhost:0")).unwrap();
        let addrs: Vec<_> = bound.iter().map(|b| b.addr.clone()).collect();
        let ips: Vec<IpAddr> = addrs
            .iter()
            .map(|a| match a {
                BoundAddr::Ip(sa) => {
                    assert_ne!(sa.port(), 0);
                    sa.ip()
                }
                BoundAddr::Unix(_) => panic!("unexpected {a}"),
            })
            .collect();
        assert!(ips.contains(&IpAddr::V4(Ipv4Addr::LOCALHOST)), "{addrs:?}");
        assert!(ips.contains(&IpAddr::V6(Ipv6Addr::LOCALHOST)), "{addrs:?}");
        let fds: Vec<_> = bound
            .iter()
            .map(|b| match &b.listener {
                Listener::Tcp(l) => l.as_raw_fd(),
                Listener::Unix(l) => l.as_raw_fd(),
            })
            .collect();
        assert_ne!(fds[0], fds[1]);
        // Each address really accepts connections.
        for addr in &addrs {
            let BoundAddr::Ip(sa) = addr else {
                unreachable!()
            };
            std::net::TcpStream::connect(sa).unwrap();
        }
    }

    #[test]
    fn binds_one_explicit_address() {
        let bound = bind(&url("http://[::1]:0")).unwrap();
        assert_eq!(bound.len(), 1);
        let BoundAddr::Ip(sa) = bound[0].addr else {
            panic!()
        };
        assert_eq!(sa.ip(), IpAddr::V6(Ipv6Addr::LOCALHOST));
        assert_ne!(sa.port(), 0);
    }

    #[test]
    fn a_taken_port_is_an_error_naming_the_address() {
        let first = bind(&url("http://127.0.0.1:0")).unwrap();
        let BoundAddr::Ip(sa) = first[0].addr else {
            panic!()
        };
        let err = bind(&url(&format!("http://{sa}"))).unwrap_err();
        assert!(
            matches!(&err, BindError::Bind { addr, source }
            if *addr == sa.to_string() && source.kind() == io::ErrorKind::AddrInUse),
            "{err:?}"
        );
    }

    #[test]
    fn unix_removes_a_stale_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.sock");
        drop(UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let bound = bind(&BindUrl::Unix { path: path.clone() }).unwrap();
        assert_eq!(bound[0].addr, BoundAddr::Unix(path.clone()));
        UnixStream::connect(&path).unwrap();
        // Any local user may connect (Envoy runs as its own), whatever the umask.
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, peregrine_contract::url::UNIX_SOCKET_MODE);
    }

    #[test]
    fn unix_refuses_a_live_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.sock");
        let _live = UnixListener::bind(&path).unwrap();
        let err = bind(&BindUrl::Unix { path: path.clone() }).unwrap_err();
        assert!(matches!(err, BindError::InUse { .. }), "{err:?}");
    }

    #[test]
    fn unix_refuses_to_remove_a_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data.txt");
        std::fs::write(&path, b"precious").unwrap();
        let err = bind(&BindUrl::Unix { path: path.clone() }).unwrap_err();
        assert!(
            matches!(&err, BindError::NotASocket { path: p } if *p == path),
            "{err:?}"
        );
        assert!(err.to_string().contains("not a socket"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"precious");
    }
}
