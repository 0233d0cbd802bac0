//! A process's listening sockets, taken from its descriptor table with `pidfd_getfd(2)`.
//!
//! Registration asks them to check that a worker listens where it says; adoption takes a shared
//! listener back from the workers that hold it. Each descriptor number up to the process's table
//! size (`FDSize` in `/proc/PID/status`, which anyone may read) is taken and asked whether it
//! listens (`SO_ACCEPTCONN`) and where (`getsockname`): a few system calls per descriptor, and one
//! failed call per number nothing is open at. Listing `/proc/PID/fd` instead would need
//! `CAP_DAC_READ_SEARCH` for another user's process, which the packaged unit does not grant;
//! `pidfd_getfd` needs the `CAP_SYS_PTRACE` (or the same user) that adoption needs too.
//!
//! Invariant: only listening sockets are returned, each with the address the kernel gives it.

use std::{
    io,
    net::SocketAddr,
    os::fd::{AsFd, OwnedFd},
    path::PathBuf,
};

/// The descriptor numbers walked when `/proc/PID/status` shows no `FDSize`.
const DESCRIPTORS_WITHOUT_FDSIZE: u64 = 1024;
/// The most descriptor numbers walked: a worker's listeners are among its first descriptors.
const MAX_DESCRIPTORS: u64 = 65_536;

/// Where a listening socket listens.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ListenAddress {
    /// An IP address and port.
    Tcp(SocketAddr),
    /// A Unix socket's path.
    Unix(PathBuf),
}

/// Duplicates of the listening sockets of process `pid` (open as `pidfd`), with where each
/// listens. `EPERM` when this process may not take another's descriptors.
pub fn listening(pidfd: impl AsFd, pid: u32) -> io::Result<Vec<(OwnedFd, ListenAddress)>> {
    let table = peregrine_contract::procfs::StatusText::read(pid)
        .ok()
        .and_then(|status| status.number("FDSize"))
        .unwrap_or(DESCRIPTORS_WITHOUT_FDSIZE)
        .min(MAX_DESCRIPTORS);
    let mut found = Vec::new();
    for number in 0..table {
        let socket = match rustix::process::pidfd_getfd(
            &pidfd,
            number as i32,
            rustix::process::PidfdGetfdFlags::empty(),
        ) {
            Ok(socket) => socket,
            // Nothing open at that number (or closed since).
            Err(rustix::io::Errno::BADF) => continue,
            Err(error) => return Err(error.into()),
        };
        // Not a socket (ENOTSOCK), or not a listening one.
        if !rustix::net::sockopt::socket_acceptconn(&socket).unwrap_or(false) {
            continue;
        }
        let Ok(name) = rustix::net::getsockname(&socket) else {
            continue;
        };
        if let Ok(address) = SocketAddr::try_from(name.clone()) {
            found.push((socket, ListenAddress::Tcp(address)));
        } else if let Ok(unix) = rustix::net::SocketAddrUnix::try_from(name)
            && let Some(path) = unix.path()
        {
            use std::os::unix::ffi::OsStrExt;
            let path = std::ffi::OsStr::from_bytes(path.to_bytes());
            found.push((socket, ListenAddress::Unix(PathBuf::from(path))));
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_this_processs_own_listeners_and_no_other_socket() {
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let at = tcp.local_addr().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.sock");
        let _unix = std::os::unix::net::UnixListener::bind(&path).unwrap();
        // A connected socket is no listener.
        let _client = std::net::TcpStream::connect(at).unwrap();
        let pid = std::process::id();
        let pidfd = rustix::process::pidfd_open(
            rustix::process::getpid(),
            rustix::process::PidfdFlags::empty(),
        )
        .unwrap();
        let found: Vec<ListenAddress> = listening(&pidfd, pid)
            .unwrap()
            .into_iter()
            .map(|(_, address)| address)
            .collect();
        assert!(found.contains(&ListenAddress::Tcp(at)), "{found:?}");
        assert!(found.contains(&ListenAddress::Unix(path)), "{found:?}");
        let connected = _client.local_addr().unwrap();
        assert!(!found.contains(&ListenAddress::Tcp(connected)), "{found:?}");
    }
}
