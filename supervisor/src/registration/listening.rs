//! Whether a registering process listens on the addresses it names: a worker may publish only its
//! own listeners, never another's port (Envoy's admin port, another worker's).
//!
//! The process's listening sockets are among its descriptors. Where the supervisor may take a
//! duplicate of them (`pidfd_getfd(2)`, as adoption does: root, or `CAP_SYS_PTRACE`), each number up
//! to the process's descriptor table size is taken and asked whether it listens (`SO_ACCEPTCONN`)
//! and where (`getsockname`): a few system calls per descriptor. Otherwise the inodes of its
//! sockets (`/proc/PID/fd/*`, a link `socket:[INODE]`) are matched against the listening entries of
//! its network namespace (`/proc/PID/net/tcp`, `tcp6`: state `0A`; `/proc/PID/net/unix`: the
//! `__SO_ACCEPTCON` flag); reading those walks the kernel's whole socket tables, tens of
//! milliseconds on a busy host, for every registration. These files are
//! not `contract::procfs`'s subject (stat, status, schedstat, `/proc/stat`), so, as ARCHITECTURE.md
//! has it, they are read here, where they are used.
//!
//! The pid is the peer's (SO_PEERCRED), a live child of the supervisor that is not reaped before
//! its registration is answered, so it names the same process throughout.

use std::{
    collections::HashSet,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
};

use crate::{descriptors::ListenAddress, registry::Address};

/// The TCP state `LISTEN` in `/proc/net/tcp`.
const TCP_LISTEN: &str = "0A";
/// `__SO_ACCEPTCON` in `/proc/net/unix`'s flags: a listening socket.
const SO_ACCEPTCON: u32 = 0x10000;

/// The addresses a process listens on.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Listening {
    tcp: HashSet<SocketAddr>,
    unix: HashSet<PathBuf>,
}

impl Listening {
    /// What process `pid` listens on: from duplicates of its descriptors where this process may
    /// take them, else from the kernel's socket tables in `/proc/PID`.
    pub(super) fn of(pid: u32) -> io::Result<Listening> {
        match Listening::of_descriptors(pid) {
            Ok(listening) => Ok(listening),
            Err(error) if error.raw_os_error() == Some(libc::EPERM) => Listening::of_tables(pid),
            Err(error) => Err(error),
        }
    }

    /// What process `pid` listens on, asked of duplicates of its socket descriptors. The descriptor
    /// numbers are walked up to the size of its descriptor table (`FDSize` in `/proc/PID/status`,
    /// which anyone may read): listing `/proc/PID/fd` of another user's process needs
    /// `CAP_DAC_READ_SEARCH`, which the packaged unit does not grant, where `pidfd_getfd` needs only
    /// the `CAP_SYS_PTRACE` adoption needs too. A number nothing is open at costs one failed call.
    fn of_descriptors(pid: u32) -> io::Result<Listening> {
        let raw = i32::try_from(pid).map_err(io::Error::other)?;
        let pid_of =
            rustix::process::Pid::from_raw(raw).ok_or_else(|| io::Error::other("pid 0"))?;
        let pidfd = rustix::process::pidfd_open(pid_of, rustix::process::PidfdFlags::empty())?;
        let mut listening = Listening::default();
        for (_, address) in crate::descriptors::listening(&pidfd, pid)? {
            match address {
                ListenAddress::Tcp(address) => {
                    listening.tcp.insert(canonical(address));
                }
                ListenAddress::Unix(path) => {
                    listening.unix.insert(path);
                }
            }
        }
        Ok(listening)
    }

    /// What process `pid` listens on, read from the kernel's socket tables in `/proc/PID`.
    fn of_tables(pid: u32) -> io::Result<Listening> {
        let proc = PathBuf::from(format!("/proc/{pid}"));
        let inodes = socket_inodes(&proc.join("fd"))?;
        let mut listening = Listening::default();
        for file in ["net/tcp", "net/tcp6"] {
            match std::fs::read_to_string(proc.join(file)) {
                Ok(text) => listening.tcp.extend(tcp_listeners(&text, &inodes)),
                // A kernel without IPv6 has no tcp6.
                Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                Err(error) => return Err(error),
            }
        }
        let unix = std::fs::read_to_string(proc.join("net/unix"))?;
        listening.unix.extend(unix_listeners(&unix, &inodes));
        Ok(listening)
    }

    /// The first of `addresses` not listened on, if any.
    pub(super) fn first_missing<'a>(&self, addresses: &'a [Address]) -> Option<&'a Address> {
        addresses.iter().find(|address| match address {
            Address::Tcp(claimed) => !self.tcp.contains(&canonical(*claimed)),
            Address::Unix(path) => !self.unix.contains(path),
        })
    }
}

/// The inodes of the sockets among the descriptors in `fd_dir` (`/proc/PID/fd`).
fn socket_inodes(fd_dir: &Path) -> io::Result<HashSet<u64>> {
    let mut inodes = HashSet::new();
    for entry in std::fs::read_dir(fd_dir)? {
        // A descriptor closed while the folder is read is simply not there.
        let Ok(target) = std::fs::read_link(entry?.path()) else {
            continue;
        };
        if let Some(inode) = socket_inode(&target.to_string_lossy()) {
            inodes.insert(inode);
        }
    }
    Ok(inodes)
}

/// The inode of a descriptor's link `socket:[INODE]`.
fn socket_inode(link: &str) -> Option<u64> {
    link.strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// The local addresses of the listening sockets of `/proc/net/tcp` or `tcp6` (`text`) whose inode
/// is in `inodes`.
fn tcp_listeners<'a>(
    text: &'a str,
    inodes: &'a HashSet<u64>,
) -> impl Iterator<Item = SocketAddr> + 'a {
    text.lines().skip(1).filter_map(|line| {
        // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (local, state, inode) = (fields.get(1)?, fields.get(3)?, fields.get(9)?);
        if *state != TCP_LISTEN || !inodes.contains(&inode.parse().ok()?) {
            return None;
        }
        tcp_address(local)
    })
}

/// `0100007F:1F90` (IPv4) or 32 hex digits and a port (IPv6): the address as the kernel prints it,
/// each 32-bit word of it in host byte order, the port a number.
fn tcp_address(field: &str) -> Option<SocketAddr> {
    let (ip, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| -> Option<[u8; 4]> {
        let hex = ip.get(i * 8..i * 8 + 8)?;
        Some(u32::from_str_radix(hex, 16).ok()?.to_ne_bytes())
    };
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(0)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for i in 0..4 {
                bytes[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(canonical(SocketAddr::new(ip, port)))
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is.
fn canonical(address: SocketAddr) -> SocketAddr {
    match address.ip() {
        IpAddr::V6(ip) => match ip.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), address.port()),
            None => address,
        },
        IpAddr::V4(_) => address,
    }
}

/// The paths of the listening sockets of `/proc/net/unix` (`text`) whose inode is in `inodes`.
fn unix_listeners<'a>(
    text: &'a str,
    inodes: &'a HashSet<u64>,
) -> impl Iterator<Item = PathBuf> + 'a {
    text.lines().skip(1).filter_map(|line| {
        // Num: RefCount Protocol Flags Type St Inode Path
        let mut fields = line.split_whitespace();
        let flags = fields.nth(3)?;
        let inode = fields.nth(2)?;
        let path = fields.next()?;
        let listening = u32::from_str_radix(flags, 16).ok()? & SO_ACCEPTCON != 0;
        (listening && inodes.contains(&inode.parse().ok()?)).then(|| PathBuf::from(path))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TCP: &str = "\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1001 1 0000000000000000 100 0 0 10 0
   1: 0100007F:26AD 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1002 1 0000000000000000 100 0 0 10 0
   2: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 1003 1 0000000000000000 20 4 30 10 -1
";
    const TCP6: &str = "\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:1F91 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2001 1 0000000000000000 100 0 0 10 0
   1: 0000000000000000FFFF00000100007F:1F92 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2002 1 0000000000000000 100 0 0 10 0
";
    const UNIX: &str = "\
Num       RefCount Protocol Flags    Type St Inode Path
0000000000000000: 00000002 00000000 00010000 0001 01 3001 /run/web.sock
0000000000000000: 00000002 00000000 00010000 0001 01 3002 /run/other.sock
0000000000000000: 00000003 00000000 00000000 0001 03 3003 /run/web.sock
0000000000000000: 00000002 00000000 00010000 0001 01 3004 @abstract
";

    fn listening(inodes: &[u64]) -> Listening {
        let inodes: HashSet<u64> = inodes.iter().copied().collect();
        let mut listening = Listening::default();
        for text in [TCP, TCP6] {
            listening.tcp.extend(tcp_listeners(text, &inodes));
        }
        listening.unix.extend(unix_listeners(UNIX, &inodes));
        listening
    }

    fn tcp(address: &str) -> Address {
        Address::Tcp(address.parse().unwrap())
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn reads_the_listeners_of_its_own_descriptors_from_the_kernels_tables() {
        let all = listening(&[1001, 1002, 1003, 2001, 2002, 3001, 3003]);
        assert_eq!(
            all.tcp,
            HashSet::from([
                "127.0.0.1:8080".parse().unwrap(),
                "127.0.0.1:9901".parse().unwrap(),
                "[::1]:8081".parse().unwrap(),
                // A v4-mapped IPv6 listener is the IPv4 address it serves.
                "127.0.0.1:8082".parse().unwrap(),
            ]),
            "listening sockets only, not the connection 1003"
        );
        assert_eq!(all.unix, HashSet::from([PathBuf::from("/run/web.sock")]));
        // Another process's sockets are in the same tables, not among this one's descriptors.
        let mine = listening(&[1001, 3001]);
        let claims = [tcp("127.0.0.1:8080"), Address::Unix("/run/web.sock".into())];
        assert_eq!(mine.first_missing(&claims), None);
        let admin = [tcp("127.0.0.1:8080"), tcp("127.0.0.1:9901")];
        assert_eq!(mine.first_missing(&admin), Some(&admin[1]));
        let other = [Address::Unix("/run/other.sock".into())];
        assert_eq!(mine.first_missing(&other), Some(&other[0]));
        // The same port on another address is another listener.
        let elsewhere = [tcp("[::1]:8080")];
        assert_eq!(mine.first_missing(&elsewhere), Some(&elsewhere[0]));
        let mapped = [tcp("[::ffff:127.0.0.1]:8080")];
        assert_eq!(mine.first_missing(&mapped), None);
    }

    #[test]
    fn a_descriptors_link_names_a_socket_or_nothing() {
        assert_eq!(socket_inode("socket:[12345]"), Some(12345));
        assert_eq!(socket_inode("/dev/null"), None);
        assert_eq!(socket_inode("pipe:[12345]"), None);
        assert_eq!(socket_inode("socket:[x]"), None);
        assert_eq!(tcp_address("0100007F"), None);
        assert_eq!(tcp_address("0100:1F90"), None);
    }

    #[test]
    fn finds_this_processs_own_listeners_and_not_anothers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.sock");
        let v4 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let unix = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let connected = std::net::TcpStream::connect(v4.local_addr().unwrap()).unwrap();
        let ours = [Address::Tcp(v4.local_addr().unwrap()), Address::Unix(path)];
        let local = [Address::Tcp(connected.local_addr().unwrap())];
        // Both ways agree: the descriptors asked, and the kernel's tables.
        let pid = std::process::id();
        for me in [
            Listening::of_descriptors(pid).unwrap(),
            Listening::of_tables(pid).unwrap(),
        ] {
            assert_eq!(me.first_missing(&ours), None, "{me:?}");
            // A connected socket's local address is not a listener.
            assert_eq!(me.first_missing(&local), Some(&local[0]));
        }
        drop((unix, connected));
    }
}
