//! Who may register, and what a registration must say: the checks between a peer on the control
//! socket and an endpoint in the registry.
//!
//! A registration is admitted only from a live process in the process table ([`Children`]), running
//! as the user it was started as (SO_PEERCRED: its service's `user`, or the supervisor's own), on the
//! socket its service registers on, whose message names that process's own pid and the slot it was
//! started in, with a listener of known protocols and valid addresses. A status request or a control
//! command is taken only from a process of the supervisor's own user that is neither a worker nor a
//! descendant of one ([`commander`]).
//!
//! Invariant: admission reads the process table and the peer's credentials and writes nothing; the
//! caller registers what it returns, or refuses with its [`Refusal`]. Once the credentials are read
//! from the socket the decision is a pure function ([`admit_peer`]), which the fuzz targets call.

use std::net::{IpAddr, SocketAddr};

use peregrine_proto::v1::{self, WorkerMessage, refused::Code, worker_message};
use tokio::net::UnixStream;

use super::listening::Listening;
use crate::{
    children::{Children, Slot},
    registry::{Address, Protocol, RegistryError, Worker},
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
    /// A worker runs as another user than the one it was started as.
    #[error("process {pid} runs as uid {peer}, not as uid {started}, which it was started as")]
    NotItsUser {
        /// The peer.
        pid: u32,
        /// The peer's uid.
        peer: u32,
        /// The uid its slot was started with.
        started: u32,
    },
    /// A worker registers on another service's worker socket, or on the control socket while its
    /// service has a socket of its own.
    #[error("process {pid} is a worker of {service}, which does not register on this socket")]
    WrongSocket {
        /// The peer.
        pid: u32,
        /// Its service.
        service: String,
    },
    /// A worker, or a process a worker started, asked for a status or a command.
    #[error("process {pid} is worker {worker} or was started by it: workers may only register")]
    FromWorker {
        /// The peer.
        pid: u32,
        /// The worker it is, or descends from.
        worker: u32,
    },
    /// A process of the supervisor's own process tree that is no worker (a worker's orphan, handed
    /// to the supervisor as the subreaper of everything it starts) asked for a status or a command.
    #[error(
        "process {pid} descends from this supervisor through process {child}, which is no worker (a \
         worker's orphan): the supervisor's own process tree may only register"
    )]
    FromDescendant {
        /// The peer.
        pid: u32,
        /// The supervisor's child it is, or descends from.
        child: u32,
    },
    /// A status request or a command on a service's worker socket.
    #[error("a worker socket takes registrations only")]
    RegistrationsOnly,
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
    /// The process serves on a listener the supervisor bound and passed it (`pass_socket`): the
    /// supervisor registers it itself, at the address it bound, once it answers there.
    #[error(
        "process {pid} is a worker of {service}, whose listener the supervisor binds and registers: \
         it may not register one"
    )]
    PassedSocket {
        /// The peer.
        pid: u32,
        /// Its service.
        service: String,
    },
    /// The process does not listen on an address it names.
    #[error("process {pid} does not listen on {address}")]
    NotListening {
        /// The peer.
        pid: u32,
        /// The first address it names and does not listen on.
        address: Address,
    },
    /// What the process listens on could not be read.
    #[error("cannot read what process {pid} listens on: {error}")]
    ListenersUnreadable {
        /// The peer.
        pid: u32,
        /// Why.
        #[source]
        error: std::io::Error,
    },
    /// The listener is missing or malformed.
    #[error("{0}")]
    Listener(#[from] ListenerError),
    /// The registry did not take the worker.
    #[error("{0}")]
    Registry(#[from] RegistryError),
}

impl Refusal {
    /// The code the peer gets beside the text, for programs to match on.
    pub fn code(&self) -> Code {
        match self {
            Refusal::Credentials(_) => Code::Credentials,
            Refusal::OtherUser { .. } => Code::OtherUser,
            Refusal::NotItsUser { .. } => Code::NotItsUser,
            Refusal::WrongSocket { .. } => Code::WrongSocket,
            Refusal::FromWorker { .. } | Refusal::FromDescendant { .. } => Code::FromWorker,
            Refusal::RegistrationsOnly => Code::RegistrationsOnly,
            Refusal::PidUnknown => Code::PidUnknown,
            Refusal::NotOurs(_) => Code::NotOurs,
            Refusal::NotRegister => Code::NotRegister,
            Refusal::PidMismatch { .. } => Code::PidMismatch,
            Refusal::SlotMismatch { .. } => Code::SlotMismatch,
            Refusal::PassedSocket { .. } => Code::PassedSocket,
            Refusal::NotListening { .. } | Refusal::ListenersUnreadable { .. } => {
                Code::NotListening
            }
            Refusal::Listener(_) | Refusal::Registry(RegistryError::NoAddress) => Code::BadListener,
            Refusal::Registry(RegistryError::UnknownService(_)) => Code::UnknownService,
        }
    }
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

/// Which socket a peer came in on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Socket {
    /// The control socket (owner-only): registrations of workers that run as the supervisor's user,
    /// status requests and commands from its user.
    Control,
    /// A service's worker socket (its group may open it): registrations of that service's workers
    /// alone.
    Workers {
        /// The service.
        service: String,
    },
}

/// Refuses a status request or a command from a peer that does not run as the supervisor's user, or
/// that is a worker or a descendant of one (a worker's children, however deep, until they leave its
/// process tree): workers register, and do nothing else.
pub(super) fn commander(stream: &UnixStream, children: &Children) -> Result<(), Refusal> {
    let cred = PeerCred::of(stream)?;
    check_user(cred, rustix::process::geteuid().as_raw())?;
    let pid = cred
        .pid
        .and_then(|p| u32::try_from(p).ok())
        .ok_or(Refusal::PidUnknown)?;
    let parent = |pid| {
        peregrine_contract::procfs::stat(pid)
            .ok()
            .map(|stat| stat.ppid)
    };
    match worker_ancestor(pid, children, std::process::id(), parent) {
        Some(Ancestor::Worker(worker)) => Err(Refusal::FromWorker { pid, worker }),
        Some(Ancestor::Child(child)) => Err(Refusal::FromDescendant { pid, child }),
        None => Ok(()),
    }
}

/// Why a peer is in a worker's process tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ancestor {
    /// It is this worker, or descends from it.
    Worker(u32),
    /// It is this child of the supervisor, or descends from it, and that child is no worker: a
    /// worker's orphan (the supervisor is the subreaper of everything it starts), or a helper.
    Child(u32),
}

/// How many parents up a peer is looked at for a worker: deeper than any server's process tree.
const ANCESTRY: usize = 64;

/// The worker `pid` is, or the nearest worker among its ancestors (`parent` gives a process's parent,
/// `None` once it cannot be read); else, if the chain reaches the supervisor (`own`), the child of
/// the supervisor it goes through; none once it reaches init or [`ANCESTRY`] steps, or for the
/// supervisor itself.
fn worker_ancestor(
    pid: u32,
    children: &Children,
    own: u32,
    parent: impl Fn(u32) -> Option<u32>,
) -> Option<Ancestor> {
    let mut current = pid;
    for _ in 0..ANCESTRY {
        if current <= 1 || current == own {
            return None;
        }
        if children.slot_of(current).is_some() {
            return Some(Ancestor::Worker(current));
        }
        let up = parent(current)?;
        if up == own {
            return Some(Ancestor::Child(current));
        }
        current = up;
    }
    None
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

/// Checks a registration on `socket` against the peer's credentials and the process table, then
/// that the peer listens on every address it names ([`Listening`]: its descriptors and its network
/// namespace's tables in procfs).
pub(super) fn admit(
    stream: &UnixStream,
    socket: &Socket,
    message: WorkerMessage,
    children: &Children,
) -> Result<Worker, Refusal> {
    let cred = PeerCred::of(stream)?;
    let worker = admit_peer(message, cred, socket, children)?;
    let pid = worker.pid;
    let listening =
        Listening::of(pid).map_err(|error| Refusal::ListenersUnreadable { pid, error })?;
    if let Some(address) = listening.first_missing(&worker.listener.addresses) {
        return Err(Refusal::NotListening {
            pid,
            address: address.clone(),
        });
    }
    Ok(worker)
}

/// Checks a registration on `socket` from a peer with credentials `cred` against the process table:
/// what [`admit`] decides once the credentials are read. Pure: it reads `children` and writes
/// nothing.
///
/// An admitted worker is ready, in the slot `children` has for the peer's pid, running as the uid it
/// was started with, on its service's socket, with that pid, a listener of known protocols (without
/// duplicates, at least one) and valid addresses (IPs with a port in 1..=65535, absolute Unix paths;
/// at least one).
pub fn admit_peer(
    message: WorkerMessage,
    cred: PeerCred,
    socket: &Socket,
    children: &Children,
) -> Result<Worker, Refusal> {
    let peer = cred
        .pid
        .and_then(|p| u32::try_from(p).ok())
        .ok_or(Refusal::PidUnknown)?;
    let child = children.child(peer).ok_or(Refusal::NotOurs(peer))?;
    if cred.uid != child.uid {
        return Err(Refusal::NotItsUser {
            pid: peer,
            peer: cred.uid,
            started: child.uid,
        });
    }
    let slot = child.slot.clone();
    let on_its_socket = match socket {
        Socket::Workers { service } => *service == slot.service,
        // A worker of the supervisor's user registers here; one of another user on its own socket
        // (it cannot open this one: owner-only).
        Socket::Control => child.uid == rustix::process::geteuid().as_raw(),
    };
    if !on_its_socket {
        return Err(Refusal::WrongSocket {
            pid: peer,
            service: slot.service,
        });
    }
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
    // Its address is the one the supervisor bound: whatever it claims would only stand beside it,
    // or in its place, so it is refused rather than ignored, and the log says who tried.
    if child.is_passed() {
        return Err(Refusal::PassedSocket {
            pid: peer,
            service: slot.service,
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
    use std::{collections::HashMap, sync::Arc};

    use super::*;
    use crate::registry::WorkerState;

    /// The supervisor's uid: this process's.
    fn ours() -> u32 {
        rustix::process::geteuid().as_raw()
    }

    /// A uid that is not [`ours`].
    fn other() -> u32 {
        if ours() == 65534 { 65533 } else { 65534 }
    }

    const CONTROL: &Socket = &Socket::Control;

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
            uid: ours(),
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
        let worker = admit_peer(message, peer(42), CONTROL, &children).unwrap();
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
        let refusal = |cred| admit_peer(message(), cred, CONTROL, &children).unwrap_err();
        assert!(matches!(
            refusal(PeerCred {
                uid: other(),
                pid: Some(42)
            }),
            Refusal::NotItsUser { pid: 42, peer, started } if peer == other() && started == ours()
        ));
        assert!(matches!(
            refusal(PeerCred {
                uid: ours(),
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
            admit_peer(status, peer(42), CONTROL, &children),
            Err(Refusal::NotRegister)
        ));
        let bad = register("web", 3, 42, vec![tcp("localhost", 8080)]);
        assert!(matches!(
            admit_peer(bad, peer(42), CONTROL, &children),
            Err(Refusal::Listener(ListenerError::Ip(ip))) if ip == "localhost"
        ));
    }

    #[test]
    fn a_worker_of_its_own_user_registers_on_its_services_socket_alone() {
        let children = Children::default();
        children.insert_as_for_test(42, "web", 0, other());
        children.insert_as_for_test(43, "api", 0, other());
        let cred = |pid| PeerCred {
            uid: other(),
            pid: Some(pid),
        };
        let web = Socket::Workers {
            service: "web".into(),
        };
        let message = |service: &str, pid| register(service, 0, pid, vec![tcp("127.0.0.1", 8080)]);
        let worker = admit_peer(message("web", 42), cred(42), &web, &children).unwrap();
        assert_eq!((worker.service.as_str(), worker.pid), ("web", 42));
        // A worker of api, of the same user, on web's socket: as itself, or claiming to be web's.
        assert!(matches!(
            admit_peer(message("api", 43), cred(43), &web, &children),
            Err(Refusal::WrongSocket { pid: 43, service }) if service == "api"
        ));
        assert!(matches!(
            admit_peer(message("web", 43), cred(43), &web, &children),
            Err(Refusal::WrongSocket { pid: 43, .. })
        ));
        // Nor on the control socket, which is the supervisor's user's.
        assert!(matches!(
            admit_peer(message("web", 42), cred(42), CONTROL, &children),
            Err(Refusal::WrongSocket { pid: 42, .. })
        ));
        // A process of that user that is no worker.
        assert!(matches!(
            admit_peer(message("web", 44), cred(44), &web, &children),
            Err(Refusal::NotOurs(44))
        ));
        // A worker of the supervisor's user has no business on a worker socket either.
        assert!(matches!(
            admit_peer(message("web", 42), peer(42), &web, &children),
            Err(Refusal::NotItsUser { pid: 42, .. })
        ));
    }

    #[test]
    fn a_passed_socket_server_may_not_register_an_address() {
        let children = Children::default();
        let counters = Arc::new(crate::children::Counters::memfd(2).unwrap());
        children.insert_counted_for_test(42, ("app", 0), 0, &counters, false);
        children.insert_counted_for_test(43, ("web", 0), 1, &counters, true);
        let message = |service: &str, pid| register(service, 0, pid, vec![tcp("127.0.0.1", 9901)]);
        let refusal = admit_peer(message("app", 42), peer(42), CONTROL, &children).unwrap_err();
        assert!(
            matches!(&refusal, Refusal::PassedSocket { pid: 42, service } if service == "app"),
            "{refusal:?}"
        );
        assert_eq!(refusal.code(), Code::PassedSocket);
        // A built-in worker goes on to have its addresses checked against its listeners.
        assert!(admit_peer(message("web", 43), peer(43), CONTROL, &children).is_ok());
    }

    #[test]
    fn a_worker_and_whatever_it_starts_and_its_orphans_are_found_up_the_process_tree() {
        let children = Children::default();
        children.insert_for_test(100, "web", 0);
        // 300 -> 200 -> 100 (a worker) -> 50 (the supervisor) -> 1; 400 -> 1; a worker's orphan
        // 700, handed to the supervisor, and what it started: 800 -> 700 -> 50.
        let own = 50;
        let parents = HashMap::from([
            (300, 200),
            (200, 100),
            (100, own),
            (own, 1),
            (400, 1),
            (700, own),
            (800, 700),
        ]);
        let parent = |pid| parents.get(&pid).copied();
        let ancestor = |pid| worker_ancestor(pid, &children, own, parent);
        assert_eq!(ancestor(100), Some(Ancestor::Worker(100)));
        assert_eq!(ancestor(300), Some(Ancestor::Worker(100)));
        assert_eq!(ancestor(400), None);
        assert_eq!(ancestor(own), None, "the supervisor itself");
        // An orphan is no worker, but it is of the supervisor's process tree all the same.
        assert_eq!(ancestor(700), Some(Ancestor::Child(700)));
        assert_eq!(ancestor(800), Some(Ancestor::Child(700)));
        // A process that is gone, or a chain that never ends, is no worker's.
        assert_eq!(ancestor(500), None);
        assert_eq!(
            worker_ancestor(600, &children, own, |pid| Some(pid + 1)),
            None
        );
    }
}
