//! The bind url a worker is given: where its own listener lives.
//!
//! Accepted forms: `http://HOST:PORT` (HOST a name such as `localhost`, an IPv4 address or a bracketed
//! IPv6 address; PORT 0 for an ephemeral port) and `unix:///absolute/path.sock`.

use std::{fmt, path::PathBuf, str::FromStr};

/// The mode of a worker's Unix socket, whoever binds it (the worker, or the supervisor for a server
/// on a passed listener): any local user may connect, as to a port on loopback, so that Envoy
/// reaches it whatever user it runs as (a socket created under the usual umask, 0755, admits only
/// its owner: connecting needs write permission). Who may reach it is the folder's to say.
pub const UNIX_SOCKET_MODE: u32 = 0o666;

/// A parsed bind url.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BindUrl {
    /// A TCP listener on every address `host` resolves to.
    Tcp {
        /// A host name or an IP address (without brackets).
        host: String,
        /// The port; 0 asks the kernel for an ephemeral one.
        port: u16,
    },
    /// A Unix-domain stream socket at an absolute path.
    Unix {
        /// The socket's path.
        path: PathBuf,
    },
}

/// Why a bind url was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// Neither `http://` nor `unix://`.
    #[error("unsupported scheme in {0:?}: expected http://HOST:PORT or unix:///PATH")]
    Scheme(String),
    /// The authority lacks a port or has an invalid one.
    #[error(
        "missing or invalid port in {0:?}: expected http://HOST:PORT (PORT 0 for an ephemeral port)"
    )]
    Port(String),
    /// The host is empty or malformed.
    #[error("missing or invalid host in {0:?}")]
    Host(String),
    /// A path, query or fragment follows the authority.
    #[error("unexpected path in {0:?}: a bind url names only a host and a port")]
    Path(String),
    /// The Unix socket path is not absolute.
    #[error("unix socket path must be absolute in {0:?}: use unix:///absolute/path.sock")]
    RelativeUnixPath(String),
}

impl BindUrl {
    /// The fixed (non-zero) TCP port, if any: such a url can serve only one worker.
    pub fn fixed_port(&self) -> Option<u16> {
        match self {
            BindUrl::Tcp { port, .. } if *port != 0 => Some(*port),
            _ => None,
        }
    }
}

impl FromStr for BindUrl {
    type Err = UrlError;

    fn from_str(s: &str) -> Result<Self, UrlError> {
        if let Some(path) = s.strip_prefix("unix://") {
            if !path.starts_with('/') {
                return Err(UrlError::RelativeUnixPath(s.into()));
            }
            return Ok(BindUrl::Unix { path: path.into() });
        }
        let Some(authority) = s.strip_prefix("http://") else {
            return Err(UrlError::Scheme(s.into()));
        };
        let authority = match authority.strip_suffix('/') {
            Some(a) => a,
            None => authority,
        };
        if authority.contains(['/', '?', '#']) {
            return Err(UrlError::Path(s.into()));
        }
        let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
            let (host, rest) = rest
                .split_once(']')
                .ok_or_else(|| UrlError::Host(s.into()))?;
            host.parse::<std::net::Ipv6Addr>()
                .map_err(|_| UrlError::Host(s.into()))?;
            (
                host,
                rest.strip_prefix(':')
                    .ok_or_else(|| UrlError::Port(s.into()))?,
            )
        } else {
            authority
                .rsplit_once(':')
                .ok_or_else(|| UrlError::Port(s.into()))?
        };
        if host.is_empty() || host.contains([':', '[', ']', '@']) && !authority.starts_with('[') {
            return Err(UrlError::Host(s.into()));
        }
        let port = port.parse::<u16>().map_err(|_| UrlError::Port(s.into()))?;
        Ok(BindUrl::Tcp {
            host: host.into(),
            port,
        })
    }
}

impl fmt::Display for BindUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BindUrl::Tcp { host, port } if host.contains(':') => {
                write!(f, "http://[{host}]:{port}")
            }
            BindUrl::Tcp { host, port } => write!(f, "http://{host}:{port}"),
            BindUrl::Unix { path } => write!(f, "unix://{}", path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_forms() {
        let cases = [
            ("http://localhost:0", "localhost", 0),
            ("http://127.0.0.1:8080", "127.0.0.1", 8080),
            ("http://[::1]:0", "::1", 0),
            ("http://[::1]:9/", "::1", 9),
        ];
        for (url, host, port) in cases {
            assert_eq!(
                url.parse::<BindUrl>(),
                Ok(BindUrl::Tcp {
                    host: host.into(),
                    port
                }),
                "{url}"
            );
        }
        assert_eq!(
            "unix:///run/app.sock".parse::<BindUrl>(),
            Ok(BindUrl::Unix {
                path: "/run/app.sock".into()
            })
        );
    }

    #[test]
    fn round_trips_through_display() {
        for url in [
            "http://localhost:0",
            "http://[::1]:80",
            "unix:///tmp/x.sock",
        ] {
            assert_eq!(url.parse::<BindUrl>().unwrap().to_string(), url);
        }
    }

    #[test]
    fn rejects_bad_urls() {
        assert!(matches!(
            "https://x:1".parse::<BindUrl>(),
            Err(UrlError::Scheme(_))
        ));
        assert!(matches!(
            "http://x".parse::<BindUrl>(),
            Err(UrlError::Port(_))
        ));
        assert!(matches!(
            "http://x:99999".parse::<BindUrl>(),
            Err(UrlError::Port(_))
        ));
        assert!(matches!(
            "http://:80".parse::<BindUrl>(),
            Err(UrlError::Host(_))
        ));
        assert!(matches!(
            "http://[zz]:80".parse::<BindUrl>(),
            Err(UrlError::Host(_))
        ));
        assert!(matches!(
            "http://x:80/a".parse::<BindUrl>(),
            Err(UrlError::Path(_))
        ));
        assert!(matches!(
            "unix://a.sock".parse::<BindUrl>(),
            Err(UrlError::RelativeUnixPath(_))
        ));
        assert_eq!(
            "http://x:1".parse::<BindUrl>().unwrap().fixed_port(),
            Some(1)
        );
        assert_eq!("http://x:0".parse::<BindUrl>().unwrap().fixed_port(), None);
    }
}
