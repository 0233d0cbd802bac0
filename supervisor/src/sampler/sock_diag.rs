//! Requests in flight on passed listeners, from the kernel's socket tables: for servers that keep no
//! count of their own (gunicorn, uvicorn, Node on `pass_socket`).
//!
//! At each sample, one netlink `sock_diag` dump per address family asks the kernel for the TCP
//! sockets in LISTEN, ESTABLISHED and CLOSE_WAIT, each with its `tcp_info`; those whose local port is
//! a tracked listener's are classified ([`classify`]):
//! - a listener's receive queue (`idiag_rqueue` of a LISTEN socket) is its accept queue: each
//!   connection in it waits for the server, with its request;
//! - an accepted connection (it has an inode: a connection still in the accept queue has none, and is
//!   counted there) holds a request in flight when bytes wait unread in it, or when it received data
//!   more recently than it sent any (`tcpi_last_data_recv` below `tcpi_last_data_sent`), or received
//!   data and sent none yet. A keep-alive connection between requests last sent its response: idle.
//!
//! This is the count at the moment of the sample, not a mean over the interval: the sampler takes
//! the mean of two consecutive counts. Every field read here is in Linux 4.19 and later (Debian 12's
//! 6.1 included), and the dump needs no privilege: it is the same on the eBPF and the procfs sampler.
//!
//! The cost is one walk of the kernel's TCP tables per address family the listeners use, whatever
//! the number of workers (the walk of the established hash table's buckets is most of it: 1.8 ms
//! for 262,144 buckets on the machine it was measured on, [`tests::what_a_sample_costs`]): the
//! dump carries a filter (`INET_DIAG_REQ_BYTECODE`, [`port_filter`]) that keeps only the sockets
//! whose local port is a tracked listener's, so the kernel fills a `tcp_info` for those alone and
//! the rest of the host's connections (Envoy's, its clients') cost a comparison each. The crate
//! builds requests without a filter: the attribute is appended to its message here.

use std::collections::{HashMap, HashSet};

use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_sock_diag::{
    SockDiagMessage,
    constants::{AF_INET, AF_INET6, IPPROTO_TCP},
    inet::{ExtensionFlags, InetRequest, InetResponse, SocketId, StateFlags, nlas::Nla},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_SOCK_DIAG};

/// `INET_DIAG_REQ_BYTECODE`: the request attribute that holds a filter.
const INET_DIAG_REQ_BYTECODE: u16 = 1;
/// `INET_DIAG_BC_JMP`: jump by `no`.
const INET_DIAG_BC_JMP: u8 = 1;
/// `INET_DIAG_BC_S_EQ`: the local port equals the next op's `no` (Linux 4.15 and later).
const INET_DIAG_BC_S_EQ: u8 = 11;

/// TCP states, as `tcp_states.h` numbers them.
const TCP_ESTABLISHED: u8 = 1;
const TCP_LISTEN: u8 = 10;
const TCP_CLOSE_WAIT: u8 = 8;

/// Why the kernel's socket tables could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DiagError {
    /// The netlink socket failed.
    #[error("sock_diag netlink socket: {0}")]
    Io(#[from] std::io::Error),
    /// The kernel answered with an error.
    #[error("sock_diag: the kernel answered error {0}")]
    Kernel(i32),
    /// An answer could not be decoded.
    #[error("sock_diag: cannot decode the kernel's answer: {0}")]
    Decode(String),
}

/// What one socket of the dump says, as far as requests in flight go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seen {
    /// Its TCP state.
    pub state: u8,
    /// Its local port.
    pub port: u16,
    /// Its inode: 0 for a connection not accepted yet.
    pub inode: u32,
    /// Its receive queue: unread bytes, or for a listener the connections not accepted yet.
    pub rqueue: u32,
    /// From its `tcp_info`, if the kernel sent one.
    pub tcp: Option<TcpTimes>,
}

/// The fields of `tcp_info` that tell a request in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpTimes {
    /// Milliseconds since data was last sent.
    pub last_data_sent_ms: u32,
    /// Milliseconds since data was last received.
    pub last_data_recv_ms: u32,
    /// Bytes sent so far.
    pub bytes_sent: u64,
    /// Bytes received so far.
    pub bytes_received: u64,
}

/// The requests a listener's sockets hold in flight: those waiting in its accept queue, and those
/// its server took and has not answered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Connections not accepted yet, each holding a request.
    pub queued: u64,
    /// Accepted connections holding a request.
    pub serving: u64,
}

impl Held {
    /// Every request held.
    pub fn total(self) -> u64 {
        self.queued.saturating_add(self.serving)
    }

    fn add(&mut self, other: Held) {
        self.queued = self.queued.saturating_add(other.queued);
        self.serving = self.serving.saturating_add(other.serving);
    }
}

/// The requests socket `seen` holds in flight.
pub fn classify(seen: &Seen) -> Held {
    match seen.state {
        TCP_LISTEN => Held {
            queued: u64::from(seen.rqueue),
            serving: 0,
        },
        // Not accepted yet: its listener's queue counts it.
        TCP_ESTABLISHED | TCP_CLOSE_WAIT if seen.inode == 0 => Held::default(),
        TCP_ESTABLISHED | TCP_CLOSE_WAIT => {
            let answering = seen.tcp.is_some_and(|t| {
                t.bytes_received > 0
                    && (t.bytes_sent == 0 || t.last_data_recv_ms < t.last_data_sent_ms)
            });
            Held {
                queued: 0,
                serving: u64::from(seen.rqueue > 0 || answering),
            }
        }
        _ => Held::default(),
    }
}

/// A filter that keeps the sockets whose local port is one of `ports` (`inet_diag_bc_op`s, as `ss`
/// compiles `sport = A or sport = B ...`): per port but the last, `S_EQ port` (true: on to the
/// `JMP`, which jumps to the end, where the socket is kept; false: past the `JMP` to the next port),
/// then `JMP`; the last port's `S_EQ` jumps past the end when false, where the socket is dropped.
/// Every jump lands on an op that the kernel's audit reaches along the `yes` jumps.
pub fn port_filter(ports: &[u16]) -> Vec<u8> {
    let op = |code: u8, yes: u8, no: u16| {
        let mut bytes = [code, yes, 0, 0];
        bytes[2..].copy_from_slice(&no.to_ne_bytes());
        bytes
    };
    let mut code = Vec::with_capacity(ports.len() * 12);
    for (i, &port) in ports.iter().enumerate() {
        let last = i + 1 == ports.len();
        // The length of the filter after this port's ops.
        let rest = (ports.len() - i - 1) * 12 - usize::from(!last) * 4;
        // S_EQ and its port (8 bytes); false: past its JMP (12), or past the end for the last (8 + 4).
        code.extend(op(INET_DIAG_BC_S_EQ, 8, 12));
        code.extend(op(0, 0, port));
        if !last {
            // Always jumps by `no`: to the end. Its `yes` (4) is its size, for the audit's walk.
            code.extend(op(
                INET_DIAG_BC_JMP,
                4,
                u16::try_from(rest + 4).unwrap_or(u16::MAX),
            ));
        }
    }
    code
}

/// The address families to dump: those of the listeners.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Families {
    /// IPv4 listeners.
    pub ipv4: bool,
    /// IPv6 listeners (their IPv4-mapped connections included).
    pub ipv6: bool,
}

/// A netlink `sock_diag` socket, kept open between samples.
pub struct SockDiag {
    socket: Socket,
    buffer: Vec<u8>,
}

impl std::fmt::Debug for SockDiag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SockDiag")
    }
}

impl SockDiag {
    /// Opens the socket.
    pub fn open() -> Result<SockDiag, DiagError> {
        let mut socket = Socket::new(NETLINK_SOCK_DIAG)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(SockDiag {
            socket,
            buffer: vec![0; 64 * 1024],
        })
    }

    /// The requests in flight on each listening port of `ports` (those with none are left out), in
    /// the sockets of `families`.
    pub fn in_flight(
        &mut self,
        ports: &HashSet<u16>,
        families: Families,
    ) -> Result<HashMap<u16, Held>, DiagError> {
        let mut counts = HashMap::new();
        if ports.is_empty() {
            return Ok(counts);
        }
        let mut sorted: Vec<u16> = ports.iter().copied().collect();
        sorted.sort_unstable();
        // A filter's jumps are 16-bit: past 5000 ports the filter is left out, and the ports told
        // apart here alone.
        let filter = (sorted.len() <= 5000).then(|| port_filter(&sorted));
        let wanted = [(AF_INET, families.ipv4), (AF_INET6, families.ipv6)];
        for family in wanted.into_iter().filter_map(|(f, on)| on.then_some(f)) {
            self.dump(family, filter.as_deref(), |seen| {
                if ports.contains(&seen.port) {
                    let held = classify(&seen);
                    if held.total() > 0 {
                        counts
                            .entry(seen.port)
                            .or_insert_with(Held::default)
                            .add(held);
                    }
                }
            })?;
        }
        Ok(counts)
    }

    /// Dumps the TCP sockets of `family` in the states that can hold a request, each to `each`.
    fn dump(
        &mut self,
        family: u8,
        filter: Option<&[u8]>,
        mut each: impl FnMut(Seen),
    ) -> Result<(), DiagError> {
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_DUMP;
        let mut request = NetlinkMessage::new(
            header,
            SockDiagMessage::InetRequest(InetRequest {
                family,
                protocol: IPPROTO_TCP,
                extensions: ExtensionFlags::INFO,
                states: StateFlags::ESTABLISHED | StateFlags::LISTEN | StateFlags::CLOSE_WAIT,
                socket_id: if family == AF_INET {
                    SocketId::new_v4()
                } else {
                    SocketId::new_v6()
                },
            })
            .into(),
        );
        request.finalize();
        let mut bytes = vec![0; request.buffer_len()];
        request.serialize(&mut bytes);
        if let Some(filter) = filter {
            // The attribute: its length (header included) and type, then the filter (a multiple of
            // 4 bytes: no padding); the message's length grows by as much.
            let length = u16::try_from(4 + filter.len()).unwrap_or(u16::MAX);
            bytes.extend(length.to_ne_bytes());
            bytes.extend(INET_DIAG_REQ_BYTECODE.to_ne_bytes());
            bytes.extend(filter);
            let total = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
            bytes[..4].copy_from_slice(&total.to_ne_bytes());
        }
        self.socket.send(&bytes, 0)?;
        loop {
            let size = self.socket.recv(&mut &mut self.buffer[..], 0)?;
            let mut offset = 0;
            while offset < size {
                let message =
                    NetlinkMessage::<SockDiagMessage>::deserialize(&self.buffer[offset..size])
                        .map_err(|e| DiagError::Decode(e.to_string()))?;
                let length = message.header.length as usize;
                match message.payload {
                    NetlinkPayload::Done(_) => return Ok(()),
                    NetlinkPayload::Error(error) => {
                        return match error.code {
                            Some(code) => Err(DiagError::Kernel(code.get())),
                            None => Ok(()),
                        };
                    }
                    NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(response)) => {
                        each(seen(&response));
                    }
                    _ => {}
                }
                if length == 0 {
                    break;
                }
                // Messages are 4-byte aligned in a datagram.
                offset += (length + 3) & !3;
            }
        }
    }
}

/// What a dumped socket says.
fn seen(response: &InetResponse) -> Seen {
    let tcp = response.nlas.iter().find_map(|nla| match nla {
        Nla::TcpInfo(info) => Some(TcpTimes {
            last_data_sent_ms: info.last_data_sent,
            last_data_recv_ms: info.last_data_recv,
            bytes_sent: info.bytes_sent,
            bytes_received: info.bytes_received,
        }),
        _ => None,
    });
    Seen {
        state: response.header.state,
        port: response.header.socket_id.source_port,
        inode: response.header.inode,
        rqueue: response.header.recv_queue,
        tcp,
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io::{Read, Write},
        net::{TcpListener, TcpStream},
        time::{Duration, Instant},
    };

    use super::*;

    const IPV4: Families = Families {
        ipv4: true,
        ipv6: false,
    };

    fn times(sent_ms: u32, recv_ms: u32, bytes_sent: u64, bytes_received: u64) -> Option<TcpTimes> {
        Some(TcpTimes {
            last_data_sent_ms: sent_ms,
            last_data_recv_ms: recv_ms,
            bytes_sent,
            bytes_received,
        })
    }

    fn socket(state: u8, inode: u32, rqueue: u32, tcp: Option<TcpTimes>) -> Seen {
        Seen {
            state,
            port: 8000,
            inode,
            rqueue,
            tcp,
        }
    }

    #[test]
    fn classifies_listeners_connections_and_requests_in_flight() {
        // A listener with three connections not accepted yet: queued.
        assert_eq!(
            classify(&socket(TCP_LISTEN, 9, 3, None)),
            Held {
                queued: 3,
                serving: 0
            }
        );
        // One of those connections, with its request unread: counted with its listener's queue.
        assert_eq!(
            classify(&socket(TCP_ESTABLISHED, 0, 120, times(5, 5, 0, 120))).total(),
            0
        );
        // Accepted, its request read and not answered yet (received in the same millisecond as the
        // connection came: the times are equal, but nothing was sent).
        assert_eq!(
            classify(&socket(TCP_ESTABLISHED, 7, 0, times(3, 3, 0, 120))).total(),
            1
        );
        // Accepted, nothing received yet: no request.
        assert_eq!(
            classify(&socket(TCP_ESTABLISHED, 7, 0, times(3, 3, 0, 0))).total(),
            0
        );
        // Keep-alive: answered 40 ms ago, the request came 45 ms ago: idle.
        assert_eq!(
            classify(&socket(TCP_ESTABLISHED, 7, 0, times(40, 45, 900, 240))).total(),
            0
        );
        // The next request came 10 ms ago, the last response went 40 ms ago: in flight.
        assert_eq!(
            classify(&socket(TCP_ESTABLISHED, 7, 0, times(40, 10, 900, 360))).total(),
            1
        );
        // Bytes unread: in flight whatever the times.
        assert_eq!(
            classify(&socket(TCP_ESTABLISHED, 7, 80, times(1, 50, 900, 360))).total(),
            1
        );
        // The client half-closed after its request: still owed a response.
        assert_eq!(
            classify(&socket(TCP_CLOSE_WAIT, 7, 0, times(40, 10, 900, 360))).total(),
            1
        );
        // Without a tcp_info only unread bytes tell.
        assert_eq!(classify(&socket(TCP_ESTABLISHED, 7, 0, None)).total(), 0);
        // Other states hold none.
        assert_eq!(
            classify(&socket(6, 7, 10, times(40, 10, 900, 360))).total(),
            0
        );
    }

    /// Runs `filter` on a socket of local port `port`, as the kernel's `inet_diag_bc_run` does;
    /// also walks it as its audit does (`yes` jumps only, each landing on an op or the end).
    fn keeps(filter: &[u8], port: u16) -> bool {
        let op = |at: usize| {
            (
                filter[at],
                usize::from(filter[at + 1]),
                usize::from(u16::from_ne_bytes([filter[at + 2], filter[at + 3]])),
            )
        };
        let mut at = 0usize;
        let mut len = filter.len() as isize;
        while len > 0 {
            let (code, yes, no) = op(at);
            let taken = match code {
                INET_DIAG_BC_S_EQ => op(at + 4).2 == usize::from(port),
                INET_DIAG_BC_JMP => false,
                other => panic!("unexpected op {other}"),
            };
            let jump = if taken { yes } else { no };
            // A false jump lands on an op boundary reachable along `yes` jumps, the end, or 4 past.
            assert!(
                jump % 4 == 0 && jump as isize <= len + 4,
                "jump {jump} at {at}"
            );
            len -= jump as isize;
            at += jump;
        }
        len == 0
    }

    #[test]
    fn the_port_filter_keeps_exactly_the_listed_ports() {
        for ports in [vec![8000], vec![8000, 8001], vec![1, 80, 443, 8080, 65535]] {
            let filter = port_filter(&ports);
            for &port in &ports {
                assert!(keeps(&filter, port), "{port} of {ports:?}");
            }
            for other in [0, 2, 79, 81, 8002, 9999, 65534] {
                assert!(!keeps(&filter, other), "{other} not of {ports:?}");
            }
            // The audit's walk along `yes` jumps goes through every op to exactly the end.
            let mut at = 0;
            while at < filter.len() {
                at += usize::from(filter[at + 1]);
            }
            assert_eq!(at, filter.len());
        }
    }

    /// Waits (up to 5 s) until the port's count is `want`.
    fn wait_for(diag: &mut SockDiag, port: u16, want: u64) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(5);
        let ports = HashSet::from([port]);
        loop {
            let got = diag
                .in_flight(&ports, IPV4)
                .unwrap()
                .get(&port)
                .map_or(0, |held| held.total());
            if got == want || Instant::now() > deadline {
                return got;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn counts_queued_connections_and_unanswered_requests_on_a_real_listener() {
        let Ok(mut diag) = SockDiag::open() else {
            peregrine_testenv::skip(
                "counts_queued_connections_and_unanswered_requests_on_a_real_listener",
                "no sock_diag netlink socket here",
            );
            return;
        };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert_eq!(wait_for(&mut diag, port, 0), 0, "idle");
        // Two clients send a request each; neither is accepted: both wait in the queue.
        let mut first = TcpStream::connect(("127.0.0.1", port)).unwrap();
        first.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut second = TcpStream::connect(("127.0.0.1", port)).unwrap();
        second.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(wait_for(&mut diag, port, 2), 2, "two in the accept queue");
        // One accepted and read, not answered: still two.
        let (mut served, _) = listener.accept().unwrap();
        let mut request = [0u8; 18];
        served.read_exact(&mut request).unwrap();
        assert_eq!(wait_for(&mut diag, port, 2), 2, "one read, one queued");
        // Answered: one left.
        served
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            .unwrap();
        std::thread::sleep(Duration::from_millis(3));
        assert_eq!(wait_for(&mut diag, port, 1), 1, "one answered, one queued");
        let mut response = [0u8; 38];
        first.read_exact(&mut response).unwrap();
        // Another port's sockets are not counted.
        let other = TcpListener::bind("127.0.0.1:0").unwrap();
        let other_port = other.local_addr().unwrap().port();
        assert_eq!(wait_for(&mut diag, other_port, 0), 0);
        drop(second);
    }

    /// What one sample's dumps cost with 100 passed listeners, each with two connections (one with
    /// a request in flight): `cargo test -p peregrine-supervisor --release --lib -- --ignored
    /// --nocapture what_a_sample_costs`.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn what_a_sample_costs() {
        let mut diag = SockDiag::open().unwrap();
        let mut held = Vec::new();
        let mut ports = HashSet::new();
        for _ in 0..100 {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let port = listener.local_addr().unwrap().port();
            let mut busy = TcpStream::connect(("127.0.0.1", port)).unwrap();
            busy.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
            let idle = TcpStream::connect(("127.0.0.1", port)).unwrap();
            let accepted = (listener.accept().unwrap().0, listener.accept().unwrap().0);
            ports.insert(port);
            held.push((listener, busy, idle, accepted));
        }
        let rounds = 1000;
        let started = Instant::now();
        let mut total = 0;
        for _ in 0..rounds {
            total += diag
                .in_flight(&ports, IPV4)
                .unwrap()
                .values()
                .map(|held| held.total())
                .sum::<u64>();
        }
        let each = started.elapsed() / rounds;
        eprintln!(
            "one sample over {} listeners: {each:?} ({} requests in flight seen)",
            ports.len(),
            total / u64::from(rounds)
        );
        assert_eq!(total / u64::from(rounds), 100);
    }
}
