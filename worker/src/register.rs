//! The registration client: tells the supervisor which addresses this worker serves on.
//!
//! The worker connects to the supervisor's control socket, sends one `Register` message and waits for
//! `Registered` (which carries the worker's unique hostname) or `Refused`. The connection then stays open
//! for as long as the worker serves: its close is how the supervisor learns that the worker is gone.
//!
//! A worker outlives its supervisor. [`Registration::keep`] holds the connection and, when it ends (the
//! supervisor was killed, crashed or restarts), registers again on the same control socket path with the
//! same `Register` message, waiting a [`Backoff`] before each attempt, while the worker goes on serving.
//! It completes only when the worker should stop: a supervisor refused the new registration (the worker
//! is no longer wanted), or none accepted one within the orphan timeout ([`Abandoned`]).

use std::{
    fmt, io,
    path::{Path, PathBuf},
    time::Duration,
};

use bytes::BytesMut;
use peregrine_proto::{
    FrameError, decode_frame, encode,
    v1::{
        Address, Listener, Protocol, Register, SocketAddress, SupervisorMessage, WorkerMessage,
        address, refused::Code, supervisor_message, worker_message,
    },
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::UnixStream,
};

use crate::listen::BoundAddr;

/// How long the supervisor has to answer a registration.
pub const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);

/// Why registration failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// The control socket could not be reached.
    #[error("cannot connect to the supervisor at {}", path.display())]
    Connect {
        /// The control socket's path.
        path: std::path::PathBuf,
        /// The system's error.
        #[source]
        source: io::Error,
    },
    /// Reading or writing the connection failed.
    #[error("registration connection failed")]
    Io(#[source] io::Error),
    /// The supervisor sent something that is not a valid message.
    #[error("invalid message from the supervisor")]
    Frame(#[source] FrameError),
    /// The supervisor refused the registration.
    #[error("the supervisor refused the registration: {reason}")]
    Refused {
        /// Why, for programs to match on.
        code: Code,
        /// Why, in words.
        reason: String,
    },
    /// The supervisor closed the connection without answering.
    #[error("the supervisor closed the connection before answering")]
    Closed,
    /// The supervisor answered with an empty message (or one that is not for a worker).
    #[error("the supervisor sent an empty answer")]
    Empty,
    /// The supervisor did not answer in time.
    #[error("the supervisor did not answer within {0:?}")]
    Timeout(Duration),
}

/// What a worker tells the supervisor about itself.
#[derive(Clone, Debug)]
pub struct Announcement<'a> {
    /// The service the worker belongs to.
    pub service: &'a str,
    /// The worker's slot within its service.
    pub index: u32,
    /// Every address the worker listens on.
    pub addresses: &'a [BoundAddr],
}

/// An accepted registration: the worker's hostname and the connection that keeps it registered.
///
/// It remembers the control socket's path and the `Register` message, to register again with a later
/// supervisor ([`Registration::keep`]).
pub struct Registration {
    hostname: String,
    stream: UnixStream,
    buf: BytesMut,
    control: PathBuf,
    message: Vec<u8>,
}

/// Why [`Registration::keep`] gave up: the worker should stop.
#[derive(Debug)]
pub enum Abandoned {
    /// A supervisor answered a new registration with `Refused` ([`RegisterError::Refused`]): the worker is
    /// no longer wanted (its slot may have been removed from the configuration).
    Refused(RegisterError),
    /// No supervisor accepted a registration for this long (the orphan timeout).
    Orphaned(Duration),
}

/// The delays before successive attempts to register again: exponential, from [`Backoff::FIRST`]
/// doubling up to [`Backoff::MAX`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backoff {
    next: Duration,
}

/// Builds the `Register` message for this process.
pub fn register_message(announcement: &Announcement<'_>) -> WorkerMessage {
    let addresses = announcement
        .addresses
        .iter()
        .map(|addr| Address {
            address: Some(match addr {
                BoundAddr::Ip(sa) => address::Address::Socket(SocketAddress {
                    ip: sa.ip().to_string(),
                    port: u32::from(sa.port()),
                }),
                BoundAddr::Unix(path) => address::Address::UnixPath(path.display().to_string()),
            }),
        })
        .collect();
    WorkerMessage {
        message: Some(worker_message::Message::Register(Register {
            service: announcement.service.into(),
            index: announcement.index,
            pid: std::process::id(),
            listener: Some(Listener {
                name: announcement.service.into(),
                scheme: "http".into(),
                protocols: vec![Protocol::Http1.into(), Protocol::Http2.into()],
                addresses,
            }),
        })),
    }
}

/// Connects to the control socket at `control`, registers and waits for the answer (at most
/// [`REGISTER_TIMEOUT`]). Must run on the worker's runtime ([`crate::runtime`]).
pub async fn register(
    control: &Path,
    announcement: &Announcement<'_>,
) -> Result<Registration, RegisterError> {
    exchange(control, encode(&register_message(announcement))).await
}

/// Connects, sends the encoded `Register` message and waits for the answer (at most
/// [`REGISTER_TIMEOUT`]).
async fn exchange(control: &Path, message: Vec<u8>) -> Result<Registration, RegisterError> {
    let exchange = async {
        let mut stream =
            UnixStream::connect(control)
                .await
                .map_err(|source| RegisterError::Connect {
                    path: control.into(),
                    source,
                })?;
        stream
            .write_all(&message)
            .await
            .map_err(|e| match e.kind() {
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => RegisterError::Closed,
                _ => RegisterError::Io(e),
            })?;
        let mut buf = BytesMut::new();
        let answer = read_message(&mut stream, &mut buf)
            .await?
            .ok_or(RegisterError::Closed)?;
        match answer.message {
            Some(supervisor_message::Message::Registered(registered)) => Ok(Registration {
                hostname: registered.hostname,
                stream,
                buf,
                control: control.into(),
                message,
            }),
            Some(supervisor_message::Message::Refused(refused)) => Err(RegisterError::Refused {
                code: refused.code(),
                reason: refused.reason,
            }),
            Some(
                supervisor_message::Message::Status(_) | supervisor_message::Message::Control(_),
            )
            | None => Err(RegisterError::Empty),
        }
    };
    tokio::time::timeout(REGISTER_TIMEOUT, exchange)
        .await
        .map_err(|_| RegisterError::Timeout(REGISTER_TIMEOUT))?
}

/// Reads one message: `Ok(None)` on a clean end of stream.
async fn read_message(
    stream: &mut UnixStream,
    buf: &mut BytesMut,
) -> Result<Option<SupervisorMessage>, RegisterError> {
    loop {
        if let Some(message) =
            decode_frame::<SupervisorMessage>(buf).map_err(RegisterError::Frame)?
        {
            return Ok(Some(message));
        }
        buf.reserve(4096);
        let result = stream.read_buf(buf).await;
        // A peer that closes with our bytes unread resets the connection: that is a close too.
        let n = match result {
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => 0,
            other => other.map_err(RegisterError::Io)?,
        };
        match n {
            0 if buf.is_empty() => return Ok(None),
            0 => return Err(RegisterError::Closed),
            _ => {}
        }
    }
}

// === impl Registration ===

impl Registration {
    /// The worker's unique hostname, as the supervisor publishes it.
    pub fn hostname(&self) -> &str {
        &self.hostname
    }

    /// Keeps the worker registered for as long as a supervisor will have it; must run on the worker's
    /// runtime.
    ///
    /// Holds the connection and, whenever it ends (end of stream, reset or error: one warning), registers
    /// again at the same control socket path with the same `Register` message, waiting a [`Backoff`]
    /// before each attempt (each failure is logged at debug), and holds the new connection in turn.
    ///
    /// Completes only when the worker should stop: when a supervisor refuses a new registration
    /// ([`Abandoned::Refused`]), or when no supervisor has accepted one for `orphan_timeout` since the
    /// connection ended ([`Abandoned::Orphaned`]; [`Duration::ZERO`] means wait forever). Dropping the
    /// future closes the connection, which deregisters the worker.
    pub async fn keep(mut self, orphan_timeout: Duration) -> Abandoned {
        loop {
            match self.closed().await {
                Ok(()) => tracing::warn!(
                    "The supervisor closed the registration connection; still serving, registering again"
                ),
                Err(error) => tracing::warn!(
                    %error,
                    "Registration connection lost; still serving, registering again"
                ),
            }
            let again = self.register_again();
            let answer = if orphan_timeout.is_zero() {
                again.await
            } else {
                match tokio::time::timeout(orphan_timeout, again).await {
                    Ok(answer) => answer,
                    Err(_) => {
                        tracing::warn!(
                            timeout = ?orphan_timeout,
                            "No supervisor for {orphan_timeout:?}: exiting"
                        );
                        return Abandoned::Orphaned(orphan_timeout);
                    }
                }
            };
            match answer {
                Ok(registration) => {
                    tracing::info!(
                        hostname = registration.hostname(),
                        "Registered again with a new supervisor"
                    );
                    self = registration;
                }
                Err(error) => {
                    tracing::error!(%error, "The worker is no longer wanted: stopping");
                    return Abandoned::Refused(error);
                }
            }
        }
    }

    /// Reads the connection until it ends: `Ok` on a clean end of stream, the error otherwise.
    async fn closed(&mut self) -> Result<(), RegisterError> {
        loop {
            match read_message(&mut self.stream, &mut self.buf).await? {
                Some(message) => {
                    tracing::debug!(?message, "Unexpected message from the supervisor, ignored")
                }
                None => return Ok(()),
            }
        }
    }

    /// Registers again until a supervisor answers: the new registration, or the refusal.
    async fn register_again(&self) -> Result<Registration, RegisterError> {
        let mut backoff = Backoff::default();
        let mut attempt = 0u64;
        loop {
            tokio::time::sleep(backoff.next_delay()).await;
            attempt += 1;
            match exchange(&self.control, self.message.clone()).await {
                Ok(registration) => return Ok(registration),
                Err(refused @ RegisterError::Refused { .. }) => return Err(refused),
                Err(error) => tracing::debug!(attempt, %error, "Cannot register again yet"),
            }
        }
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("hostname", &self.hostname)
            .finish_non_exhaustive()
    }
}

// === impl Backoff ===

impl Backoff {
    /// The first delay.
    pub const FIRST: Duration = Duration::from_millis(20);
    /// The longest delay: a failed connect to a local socket costs microseconds, and a supervisor
    /// that comes back should not wait for its workers.
    pub const MAX: Duration = Duration::from_millis(100);

    /// The delay before the next attempt; each call doubles the one after, up to [`Backoff::MAX`].
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = delay.saturating_mul(2).min(Self::MAX);
        delay
    }
}

impl Default for Backoff {
    /// A backoff whose next delay is [`Backoff::FIRST`].
    fn default() -> Self {
        Backoff { next: Self::FIRST }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_from_20ms_up_to_100ms() {
        let mut backoff = Backoff::default();
        let delays: Vec<Duration> = (0..9).map(|_| backoff.next_delay()).collect();
        let millis = |ms: &[u64]| -> Vec<Duration> {
            ms.iter().copied().map(Duration::from_millis).collect()
        };
        assert_eq!(delays, millis(&[20, 40, 80, 100, 100, 100, 100, 100, 100]));
    }

    #[test]
    fn the_message_lists_every_address() {
        let addresses = [
            BoundAddr::Ip("[::1]:8080".parse().unwrap()),
            BoundAddr::Ip("127.0.0.1:8080".parse().unwrap()),
            BoundAddr::Unix("/run/w.sock".into()),
        ];
        let message = register_message(&Announcement {
            service: "web",
            index: 2,
            addresses: &addresses,
        });
        let Some(worker_message::Message::Register(reg)) = message.message else {
            panic!("not a register message")
        };
        assert_eq!(
            (reg.service.as_str(), reg.index, reg.pid),
            ("web", 2, std::process::id())
        );
        let listener = reg.listener.unwrap();
        assert_eq!(listener.name, "web");
        assert_eq!(listener.scheme, "http");
        assert_eq!(
            listener.protocols,
            vec![i32::from(Protocol::Http1), i32::from(Protocol::Http2)]
        );
        let got: Vec<_> = listener
            .addresses
            .into_iter()
            .map(|a| a.address.unwrap())
            .collect();
        assert_eq!(
            got,
            vec![
                address::Address::Socket(SocketAddress {
                    ip: "::1".into(),
                    port: 8080
                }),
                address::Address::Socket(SocketAddress {
                    ip: "127.0.0.1".into(),
                    port: 8080
                }),
                address::Address::UnixPath("/run/w.sock".into()),
            ]
        );
    }
}
