//! Who may register, and what a registration must say: the checks between a peer on the control
//! socket and an endpoint in the registry.
//!
//! A registration is admitted only from a live process in the process table ([`Children`]) of the
//! supervisor's own user (SO_PEERCRED), whose message names that process's own pid and the slot it was
//! started in, with a listener of known protocols and valid addresses.
//!
//! Invariant: admission reads the process table and the peer's credentials and writes nothing; the
//! caller registers what it returns, or refuses with its [`Refusal`].

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

/// The peer's credentials, if it runs as the supervisor's user.
pub(super) fn same_user(stream: &UnixStream) -> Result<tokio::net::unix::UCred, Refusal> {
    let cred = stream.peer_cred().map_err(Refusal::Credentials)?;
    let ours = rustix::process::geteuid().as_raw();
    if cred.uid() != ours {
        return Err(Refusal::OtherUser {
            peer: cred.uid(),
            ours,
        });
    }
    Ok(cred)
}

/// Checks a registration against the peer's credentials and the process table.
pub(super) fn admit(
    stream: &UnixStream,
    message: WorkerMessage,
    children: &Children,
) -> Result<Worker, Refusal> {
    let cred = same_user(stream)?;
    let peer = cred
        .pid()
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
