//! Who may register, and what a registration must say: the checks between a peer on the control
//! socket and an endpoint in the registry.
//!
//! A registration is admitted only from a live process in the process table ([`Children`]) of the
//! supervisor's own user (SO_PEERCRED), whose message names that process's own pid and the slot it was
//! started in, with a listener of known protocols and valid addresses.
//!
//! Invariant: admission reads the process table and the peer's credentials and writes nothing; the
//! caller registers what it returns, or refuses with its [`Refusal`]. Once the credentials are read
//! from the socket the decision is a pure function ([`admit_peer`]), which the fuzz targets call.

use std::net::{IpAddr, SocketAddr};

use peregrine_proto::v1::{self, WorkerMessage, worker_message};
use tokio::net::UnixStream;

use crate::{
    children::{Children, Slot},
    registry::{Address, Protocol, Worker},
};

/// Why a peer on the control socket was refused: sent back as the `Refused` reason, and logged.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// The peer's credentials could not be read.
    #[error("cannot read peer credentials: {0}")]
    Credentials(std::io::Error),
    /// The peer runs as another user.
    #[error("peer uid {peer} is not the supervisor's uid {ours}")]
    OtherUser {
        /// The peer's uid.
        peer: u32,
        /// The supervisor's.
        ours: u32,
    },
    /// The kernel gave no pid for the peer.
    #[error("peer pid unknown")]
    PidUnknown,
    /// The peer is not in the process table.
    #[error("process {0} is not a worker of this supervisor")]
    NotOurs(u32),
    /// The first message was not a registration.
    #[error("expected a register message")]
    NotRegister,
    /// The message names another pid than the peer's.
    #[error("message claims pid {claimed} but the peer is process {peer}")]
    PidMismatch {
        /// The pid in the message.
        claimed: u32,
        /// The peer's.
        peer: u32,
    },
    /// The message names another slot than the one the process was started in.
    #[error("process {pid} was started as {started}, not {claimed}")]
    SlotMismatch {
        /// The peer.
        pid: u32,
        /// Its slot in the process table.
        started: Slot,
        /// The slot the message names.
        claimed: Slot,
    },
    /// The listener is missing or malformed.
    #[error("{0}")]
    Listener(#[from] ListenerError),
}

/// What is wrong with a registered listener.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ListenerError {
    /// No listener in the message.
    #[error("register has no listener")]
    Missing,
    /// A protocol this supervisor does not know.
    #[error("unknown protocol {0}")]
    UnknownProtocol(i32),
    /// No protocol at all.
    #[error("listener names no protocol")]
    NoProtocol,
    /// An address that is not an IP.
    #[error("invalid ip address {0:?}")]
    Ip(String),
    /// Port 0 or above 65535.
    #[error("invalid port {0}")]
    Port(u32),
    /// A relative Unix path.
    #[error("unix path {0:?} is not absolute")]
    RelativeUnixPath(String),
    /// An address with neither form.
    #[error("empty address")]
    EmptyAddress,
    /// No address at all.
    #[error("listener has no address")]
    NoAddress,
}

/// A peer's credentials as the kernel gives them (SO_PEERCRED).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    /// The peer's effective uid.
    pub uid: u32,
    /// The peer's pid, if the kernel gave one.
    pub pid: Option<i32>,
}

impl PeerCred {
    fn of(stream: &UnixStream) -> Result<PeerCred, Refusal> {
        let cred = stream.peer_cred().map_err(Refusal::Credentials)?;
        Ok(PeerCred {
            uid: cred.uid(),
            pid: cred.pid(),
        })
    }
}

/// Refuses a peer that does not run as the supervisor's user.
pub(super) fn same_user(stream: &UnixStream) -> Result<(), Refusal> {
    check_user(PeerCred::of(stream)?, rustix::process::geteuid().as_raw())
}

/// Refuses a peer that does not run as `ours`.
fn check_user(cred: PeerCred, ours: u32) -> Result<(), Refusal> {
    if cred.uid != ours {
        return Err(Refusal::OtherUser {
            peer: cred.uid,
            ours,
        });
    }
    Ok(())
}

/// Checks a registration against the peer's credentials and the process table.
pub(super) fn admit(
    stream: &UnixStream,
    message: WorkerMessage,
    children: &Children,
) -> Result<Worker, Refusal> {
    let cred = PeerCred::of(stream)?;
    admit_peer(message, cred, rustix::process::geteuid().as_raw(), children)
}

/// Checks a registration from a peer with credentials `cred` against the process table, for a
/// supervisor running as uid `ours`: what [`admit`] decides once the credentials are read. Pure: it
/// reads `children` and writes nothing.
///
/// An admitted worker is ready, in the slot `children` has for the peer's pid, with that pid, a
/// listener of known protocols (without duplicates, at least one) and valid addresses (IPs with a
/// port in 1..=65535, absolute Unix paths; at least one).
pub fn admit_peer(
    message: WorkerMessage,
    cred: PeerCred,
    ours: u32,
    children: &Children,
) -> Result<Worker, Refusal> {
    check_user(cred, ours)?;
    let peer = cred
        .pid
        .and_then(|p| u32::try_from(p).ok())
        .ok_or(Refusal::PidUnknown)?;
    let slot = children.slot_of(peer).ok_or(Refusal::NotOurs(peer))?;
    let Some(worker_message::Message::Register(register)) = message.message else {
        return Err(Refusal::NotRegister);
    };
    if register.pid != peer {
        return Err(Refusal::PidMismatch {
            claimed: register.pid,
            peer,
        });
    }
    let claimed = Slot {
        service: register.service.clone(),
        index: register.index,
    };
    if claimed != slot {
        return Err(Refusal::SlotMismatch {
            pid: peer,
            started: slot,
            claimed,
        });
    }
    let wire = register.listener.ok_or(ListenerError::Missing)?;
    let name = wire.name.clone();
    let scheme = wire.scheme.clone();
    let (protocols, addresses) = listener_from(wire)?;
    let mut worker = Worker::ready(&slot.service, slot.index, peer, protocols, addresses);
    worker.listener.name = name;
    worker.listener.scheme = scheme;
    Ok(worker)
}

/// Converts and checks a listener's protocols and addresses from the wire.
fn listener_from(listener: v1::Listener) -> Result<(Vec<Protocol>, Vec<Address>), ListenerError> {
    let mut protocols = Vec::new();
    for p in &listener.protocols {
        let protocol = match v1::Protocol::try_from(*p) {
            Ok(v1::Protocol::Http1) => Protocol::Http1,
            Ok(v1::Protocol::Http2) => Protocol::Http2,
            _ => return Err(ListenerError::UnknownProtocol(*p)),
        };
        if !protocols.contains(&protocol) {
            protocols.push(protocol);
        }
    }
    if protocols.is_empty() {
        return Err(ListenerError::NoProtocol);
    }
    let mut addresses = Vec::new();
    for address in listener.addresses {
        let address = match address.address {
            Some(v1::address::Address::Socket(s)) => {
                let ip: IpAddr = s.ip.parse().map_err(|_| ListenerError::Ip(s.ip.clone()))?;
                let port = u16::try_from(s.port)
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or(ListenerError::Port(s.port))?;
                Address::Tcp(SocketAddr::new(ip, port))
            }
            Some(v1::address::Address::UnixPath(path)) if path.starts_with('/') => {
                Address::Unix(path.into())
            }
            Some(v1::address::Address::UnixPath(path)) => {
                return Err(ListenerError::RelativeUnixPath(path));
            }
            None => return Err(ListenerError::EmptyAddress),
        };
        addresses.push(address);
    }
    if addresses.is_empty() {
        return Err(ListenerError::NoAddress);
    }
    Ok((protocols, addresses))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::WorkerState;

    const OURS: u32 = 1000;

    fn register(service: &str, index: u32, pid: u32, addresses: Vec<v1::Address>) -> WorkerMessage {
        WorkerMessage {
            message: Some(worker_message::Message::Register(v1::Register {
                service: service.into(),
                index,
                pid,
                listener: Some(v1::Listener {
                    name: "main".into(),
                    scheme: "http".into(),
                    protocols: vec![v1::Protocol::Http2 as i32, v1::Protocol::Http2 as i32],
                    addresses,
                }),
            })),
        }
    }

    fn tcp(ip: &str, port: u32) -> v1::Address {
        v1::Address {
            address: Some(v1::address::Address::Socket(v1::SocketAddress {
                ip: ip.into(),
                port,
            })),
        }
    }

    fn peer(pid: i32) -> PeerCred {
        PeerCred {
            uid: OURS,
            pid: Some(pid),
        }
    }

    #[test]
    fn admits_a_worker_of_the_table_from_its_own_credentials_alone() {
        let children = Children::default();
        children.insert_for_test(42, "web", 3);
        let unix = v1::Address {
            address: Some(v1::address::Address::UnixPath("/run/web.sock".into())),
        };
        let message = register("web", 3, 42, vec![tcp("::1", 8080), unix]);
        let worker = admit_peer(message, peer(42), OURS, &children).unwrap();
        assert_eq!(
            (worker.service.as_str(), worker.index, worker.pid),
            ("web", 3, 42)
        );
        assert_eq!(worker.hostname, crate::registry::hostname_for("web", 3, 42));
        assert_eq!(worker.state, WorkerState::Ready);
        assert_eq!(worker.listener.name, "main");
        assert_eq!(
            worker.listener.protocols,
            [Protocol::Http2],
            "without duplicates"
        );
        assert_eq!(
            worker.listener.addresses,
            [
                Address::Tcp("[::1]:8080".parse().unwrap()),
                Address::Unix("/run/web.sock".into())
            ]
        );
    }

    #[test]
    fn refuses_from_the_credentials_before_reading_the_message() {
        let children = Children::default();
        children.insert_for_test(42, "web", 3);
        let message = || register("web", 3, 42, vec![tcp("127.0.0.1", 8080)]);
        let refusal = |cred| admit_peer(message(), cred, OURS, &children).unwrap_err();
        assert!(matches!(
            refusal(PeerCred {
                uid: 0,
                pid: Some(42)
            }),
            Refusal::OtherUser {
                peer: 0,
                ours: OURS
            }
        ));
        assert!(matches!(
            refusal(PeerCred {
                uid: OURS,
                pid: None
            }),
            Refusal::PidUnknown
        ));
        assert!(matches!(refusal(peer(-1)), Refusal::PidUnknown));
        assert!(matches!(refusal(peer(43)), Refusal::NotOurs(43)));
        let status = WorkerMessage {
            message: Some(worker_message::Message::Status(v1::StatusRequest {})),
        };
        assert!(matches!(
            admit_peer(status, peer(42), OURS, &children),
            Err(Refusal::NotRegister)
        ));
        let bad = register("web", 3, 42, vec![tcp("localhost", 8080)]);
        assert!(matches!(
            admit_peer(bad, peer(42), OURS, &children),
            Err(Refusal::Listener(ListenerError::Ip(ip))) if ip == "localhost"
        ));
    }
}
