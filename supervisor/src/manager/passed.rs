//! Workers whose listener the supervisor binds and passes (`pass_socket`): the listener, the
//! command's placeholders, and the readiness probe that registers such a worker on its behalf.
//!
//! The listener is bound anew for every start (port 0 gives each worker instance a fresh port, as a
//! worker binding its own would have), never with `SO_REUSEPORT`, and passed as descriptor
//! [`PASSED_FD`] with systemd's socket-activation variables (`LISTEN_FDS`, `LISTEN_FDNAMES`, and
//! `LISTEN_PID`, which only the child can know: `peregrine exec-passed` sets it and execs the
//! server, keeping the pid). The supervisor keeps no copy: the worker owns its listener.
//!
//! A shared listener (`listener = "shared"`) is bound once per service and url instead, kept by the
//! supervisor, and a duplicate passed to every worker: one accept queue, from which whichever
//! worker is free takes the next connection. A supervisor that starts again takes it back from the
//! workers it adopts ([`PassedListener::take_back`]). Its readiness probe reaches whichever worker
//! accepts it, so it says that the service answers; a replacement is then ready once its own
//! processes have settled ([`settled`]).
//!
//! A worker is published once `GET ready_path` on its listener answers with a status below 500; the
//! probe also asks, with the HTTP/2 preface, whether it speaks h2c. Until then, what the last probe
//! found is in the slot's status (`peregrine status`) and logged every [`PROBE_REPORT`]; the slot
//! task stops a worker that is not ready within `register_timeout_ms`.
//!
//! Invariant: a passed-socket worker is registered only after its own listener answered, and only by
//! the task of its slot (through [`register_when_ready`]).

use std::{
    io,
    net::{IpAddr, SocketAddr},
    os::fd::{BorrowedFd, OwnedFd},
    path::Path,
    sync::{Arc, Mutex},
    time::Duration,
};

use peregrine_contract::url::BindUrl;
use socket2::{Domain, SockAddr, Socket, Type};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::{TcpStream, UnixStream},
};

use crate::{
    config::{ADDRESS_PLACEHOLDER, FD_PLACEHOLDER, PASSED_FD, PORT_PLACEHOLDER},
    descriptors::ListenAddress,
    registry::{Address, Protocol, Registry, Worker},
};

/// The backlog of a passed listener, as the built-in worker's.
const BACKLOG: i32 = 1024;
/// How long one probe may take to connect and to be answered.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// The first pause between probes, doubled up to [`PROBE_PAUSE_MAX`].
const PROBE_PAUSE: Duration = Duration::from_millis(20);
const PROBE_PAUSE_MAX: Duration = Duration::from_millis(500);
/// How often a worker that is not ready yet is logged, with what its last probe found.
const PROBE_REPORT: Duration = Duration::from_secs(3);
/// The most of an answer's head the probe reads for its status line.
const MAX_STATUS_LINE: usize = 1024;
/// The HTTP/2 connection preface, then an empty SETTINGS frame.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";

/// A listener bound for one worker instance (or, shared, for every worker of a service), and where
/// it listens.
#[derive(Debug)]
pub(super) struct PassedListener {
    pub(super) fd: OwnedFd,
    pub(super) address: Address,
}

impl PassedListener {
    /// Binds `url` (a TCP url with an IP address, or a Unix path) and listens.
    pub(super) fn bind(url: &BindUrl) -> io::Result<Self> {
        match url {
            BindUrl::Tcp { host, port } => {
                let ip: IpAddr = host.parse().map_err(|_| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{host:?} is not an IP address"),
                    )
                })?;
                let addr = SocketAddr::new(ip, *port);
                let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
                // A restarted worker may bind the port its predecessor's connections linger on.
                socket.set_reuse_address(true)?;
                if ip.is_ipv6() {
                    socket.set_only_v6(true)?;
                }
                // Accepted connections inherit it. A server that takes its listener as a file
                // descriptor may not set it on them: uvicorn (`--fd`) wraps the descriptor as a Unix
                // socket, so asyncio leaves Nagle's algorithm on, and every answer after a kept-alive
                // connection's first waited for the client's delayed ACK (45 ms for a 5 ms request).
                socket.set_tcp_nodelay(true)?;
                socket.bind(&addr.into())?;
                socket.listen(BACKLOG)?;
                let bound = socket
                    .local_addr()?
                    .as_socket()
                    .ok_or_else(|| io::Error::other("the listener has no IP address"))?;
                Ok(PassedListener {
                    fd: socket.into(),
                    address: Address::Tcp(bound),
                })
            }
            BindUrl::Unix { path } => {
                remove_stale_socket(path)?;
                let socket = Socket::new(Domain::UNIX, Type::STREAM, None)?;
                socket.bind(&SockAddr::unix(path)?)?;
                socket.listen(BACKLOG)?;
                // Bound by root under its umask it would admit root alone: Envoy could not connect.
                std::fs::set_permissions(
                    path,
                    std::os::unix::fs::PermissionsExt::from_mode(
                        peregrine_contract::url::UNIX_SOCKET_MODE,
                    ),
                )?;
                Ok(PassedListener {
                    fd: socket.into(),
                    address: Address::Unix(path.clone()),
                })
            }
        }
    }

    /// A duplicate of this listener, for one more worker of a shared listener: the supervisor keeps
    /// the original, so the accept queue outlives every worker that accepts from it.
    pub(super) fn share(&self) -> io::Result<PassedListener> {
        Ok(PassedListener {
            fd: self.fd.try_clone()?,
            address: self.address.clone(),
        })
    }

    /// The listener at `address` among the descriptors of the adopted worker `pid` (open as
    /// `pidfd`), if it still holds one: a shared listener taken back after this supervisor started
    /// again, so that new workers join the queue the adopted ones accept from.
    pub(super) fn take_back(
        pidfd: BorrowedFd<'_>,
        pid: u32,
        address: &Address,
    ) -> io::Result<Option<PassedListener>> {
        let found = crate::descriptors::listening(pidfd, pid)?
            .into_iter()
            .find(|(_, at)| match (at, address) {
                (ListenAddress::Tcp(at), Address::Tcp(address)) => at == address,
                (ListenAddress::Unix(at), Address::Unix(address)) => at == address,
                _ => false,
            });
        Ok(found.map(|(fd, _)| PassedListener {
            fd,
            address: address.clone(),
        }))
    }

    /// The bind url a worker on this listener is told it has (`PEREGRINE_URL`).
    pub(super) fn url(&self) -> BindUrl {
        match &self.address {
            Address::Tcp(addr) => BindUrl::Tcp {
                host: addr.ip().to_string(),
                port: addr.port(),
            },
            Address::Unix(path) => BindUrl::Unix { path: path.clone() },
        }
    }

    /// `arg` with `{fd}`, `{port}` and `{address}` replaced for this listener.
    pub(super) fn substitute(&self, arg: &str) -> String {
        let (port, address) = match &self.address {
            Address::Tcp(addr) => (addr.port().to_string(), addr.to_string()),
            Address::Unix(path) => (String::new(), path.display().to_string()),
        };
        arg.replace(FD_PLACEHOLDER, &PASSED_FD.to_string())
            .replace(PORT_PLACEHOLDER, &port)
            .replace(ADDRESS_PLACEHOLDER, &address)
    }
}

/// Whether `address` is where a listener bound for `url` listens: the same path, or the same IP
/// and (unless the url leaves it to the kernel) port.
pub(super) fn bound_for(address: &Address, url: &BindUrl) -> bool {
    match (address, url) {
        (Address::Tcp(at), BindUrl::Tcp { host, port }) => {
            host.parse::<IpAddr>().is_ok_and(|ip| ip == at.ip())
                && (*port == 0 || *port == at.port())
        }
        (Address::Unix(at), BindUrl::Unix { path }) => at == path,
        _ => false,
    }
}

/// Removes a socket file at `path` that nothing listens on (left by a worker that died); a live one
/// is an error: its listener is somebody's.
fn remove_stale_socket(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
        Ok(meta) if !meta.file_type().is_socket() => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket", path.display()),
        )),
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("{} is in use: something listens on it", path.display()),
            )),
            Err(_) => std::fs::remove_file(path),
        },
    }
}

/// What the last probe of a worker that is not ready yet found, for the report when it never is.
pub(super) type LastProbe = Arc<Mutex<Option<String>>>;

/// How long a new worker of a shared listener may take to settle once the service answers; past
/// it the worker is taken as ready (its probe could not reach it alone).
const SETTLE_MAX: Duration = Duration::from_secs(10);
/// How often a new worker's processes are looked at while it settles.
const SETTLE_LOOK: Duration = Duration::from_millis(20);
/// How many looks in a row a settled worker's processes stay the same, each seen asleep in one.
const SETTLE_WINDOW: usize = 5;

/// Whether worker `pid` has settled: over the last [`SETTLE_WINDOW`] looks, its processes (it and
/// its descendants: a gunicorn arbiter and the worker it forks) were the same, and each was seen
/// asleep (`S`, waiting, as a server waiting for a connection is) in at least one. A server still
/// starting runs (`R`) or reads its files (`D`) all along; one that serves sleeps between requests.
/// Waits at most [`SETTLE_MAX`]; returns whether it settled.
pub(super) async fn settled(pid: u32) -> bool {
    let deadline = tokio::time::Instant::now() + SETTLE_MAX;
    let mut window: std::collections::VecDeque<Vec<(u32, char)>> = Default::default();
    while tokio::time::Instant::now() < deadline {
        let look = tokio::task::spawn_blocking(move || process_tree(pid))
            .await
            .unwrap_or_default();
        window.push_back(look);
        if window.len() > SETTLE_WINDOW {
            window.pop_front();
        }
        if window.len() == SETTLE_WINDOW && asleep_in_turn(window.make_contiguous()) {
            return true;
        }
        tokio::time::sleep(SETTLE_LOOK).await;
    }
    false
}

/// Whether `looks` (each the pids of a tree with their states) all hold the same processes, each
/// seen asleep in at least one.
fn asleep_in_turn(looks: &[Vec<(u32, char)>]) -> bool {
    let Some(first) = looks.first().filter(|first| !first.is_empty()) else {
        return false;
    };
    let pids = |look: &Vec<(u32, char)>| look.iter().map(|(pid, _)| *pid).collect::<Vec<_>>();
    looks.iter().all(|look| pids(look) == pids(first))
        && first.iter().all(|(pid, _)| {
            looks
                .iter()
                .any(|look| look.iter().any(|(p, state)| p == pid && *state == 'S'))
        })
}

/// Process `pid` and its descendants, sorted by pid, each with its state; empty once it is gone.
fn process_tree(pid: u32) -> Vec<(u32, char)> {
    let mut tree = Vec::new();
    let mut next = vec![pid];
    while let Some(pid) = next.pop() {
        let Ok(stat) = peregrine_contract::procfs::stat(pid) else {
            continue;
        };
        tree.push((pid, stat.state));
        next.extend(super::leftovers::children_of(&pid.to_string()).unwrap_or_default());
    }
    tree.sort_unstable();
    tree
}

/// Probes `address` until `GET ready_path` answers below 500, then registers worker `pid` of
/// `service`'s slot `index` with the protocols it speaks. Runs until it has registered (the slot
/// task bounds it with the registration timeout, and aborts it when the worker exits).
///
/// Meanwhile what the last probe found is in `last` and in the slot's status (`last_probe`), and
/// logged every [`PROBE_REPORT`].
pub(super) async fn register_when_ready(
    registry: Arc<Registry>,
    (service, index, pid): (String, u32, u32),
    (address, shared): (Address, bool),
    ready_path: String,
    last: LastProbe,
) {
    let begun = tokio::time::Instant::now();
    let mut reported = begun;
    let mut pause = PROBE_PAUSE;
    let mut shown: Option<String> = None;
    let mut set_status = |probe: Option<&str>| {
        if shown.as_deref() != probe {
            shown = probe.map(str::to_owned);
            registry.update_slot(&service, index, |status| {
                status.last_probe = probe.map(str::to_owned);
            });
        }
    };
    loop {
        match probe_ready(&address, &ready_path).await {
            Ok(status) => {
                if shared {
                    // The probe reached whichever worker took it from the shared queue: the service
                    // answers. This worker is ready once its own processes have settled.
                    set_status(Some(
                        "the shared listener answers; waiting for this worker to settle",
                    ));
                    if !settled(pid).await {
                        tracing::info!(pid, %address, wait = ?SETTLE_MAX, "Worker on the shared listener did not settle; taking it as ready");
                    }
                }
                let mut protocols = vec![Protocol::Http1];
                if speaks_h2c(&address).await {
                    protocols.push(Protocol::Http2);
                }
                tracing::info!(pid, %address, status, ?protocols, ready_path, "Worker ready");
                set_status(None);
                let worker = Worker::ready(&service, index, pid, protocols, vec![address]);
                if let Err(error) = registry.register(worker) {
                    tracing::error!(pid, %error, "Cannot register the ready worker");
                }
                return;
            }
            Err(why) => {
                let why = why.to_string();
                tracing::debug!(pid, %address, why, "Worker not ready yet");
                if reported.elapsed() >= PROBE_REPORT {
                    reported = tokio::time::Instant::now();
                    tracing::info!(pid, %address, ready_path, waited = ?begun.elapsed(), last_probe = why, "Worker not ready yet");
                }
                set_status(Some(&why));
                *last.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(PROBE_PAUSE_MAX);
    }
}

/// Why a readiness probe did not find the server ready; its text is the slot's `last_probe`.
#[derive(Debug, thiserror::Error)]
enum NotReady {
    /// Connecting, sending or reading failed.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The server did not answer within [`PROBE_TIMEOUT`].
    #[error("no answer within {PROBE_TIMEOUT:?}")]
    Timeout,
    /// The server closed the connection without an answer.
    #[error("closed without an answer")]
    Closed,
    /// The answer's first line is not an HTTP/1 status line.
    #[error("not an HTTP/1 answer: {0:?}")]
    NotHttp1(String),
    /// The server answered with a status of 500 or above.
    #[error("GET {path} answered {status}")]
    Failing {
        /// The ready path.
        path: String,
        /// The status it answered.
        status: u16,
    },
}

/// Sends `GET path` and returns the answer's status when below 500; else why not.
async fn probe_ready(address: &Address, path: &str) -> Result<u16, NotReady> {
    let host = match address {
        Address::Tcp(addr) => addr.to_string(),
        Address::Unix(_) => "localhost".to_owned(),
    };
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: peregrine-ready\r\nConnection: close\r\n\r\n"
    );
    let answer = exchange(address, request.as_bytes(), MAX_STATUS_LINE).await?;
    let status = status_of(&answer)?;
    if status >= 500 {
        return Err(NotReady::Failing {
            path: path.to_owned(),
            status,
        });
    }
    Ok(status)
}

/// The status code of an HTTP/1 answer's first line.
fn status_of(answer: &[u8]) -> Result<u16, NotReady> {
    let line = answer.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut words = line.split_ascii_whitespace();
    match (words.next(), words.next().map(str::parse::<u16>)) {
        (Some(version), Some(Ok(status))) if version.starts_with("HTTP/1.") => Ok(status),
        _ if answer.is_empty() => Err(NotReady::Closed),
        _ => Err(NotReady::NotHttp1(line.trim_end().to_owned())),
    }
}

/// Whether the server answers the HTTP/2 preface with a SETTINGS frame (h2c with prior knowledge).
async fn speaks_h2c(address: &Address) -> bool {
    exchange(address, H2_PREFACE, 9)
        .await
        .is_ok_and(|head| head.len() >= 9 && head[3] == 0x4 && head[5..9] == [0, 0, 0, 0])
}

/// Connects, sends `request`, and reads until `want` bytes or the end, within [`PROBE_TIMEOUT`].
async fn exchange(address: &Address, request: &[u8], want: usize) -> Result<Vec<u8>, NotReady> {
    let run = async {
        match address {
            Address::Tcp(addr) => {
                let stream = TcpStream::connect(addr).await?;
                send_and_read(stream, request, want).await
            }
            Address::Unix(path) => {
                let stream = UnixStream::connect(path).await?;
                send_and_read(stream, request, want).await
            }
        }
    };
    match tokio::time::timeout(PROBE_TIMEOUT, run).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(error)) => Err(NotReady::Io(error)),
        Err(_) => Err(NotReady::Timeout),
    }
}

async fn send_and_read(
    mut stream: impl AsyncRead + AsyncWrite + Unpin,
    request: &[u8],
    want: usize,
) -> io::Result<Vec<u8>> {
    stream.write_all(request).await?;
    let mut answer = Vec::with_capacity(want);
    let mut chunk = [0u8; 512];
    while answer.len() < want {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&chunk[..n]);
        if want == MAX_STATUS_LINE && answer.contains(&b'\n') {
            break;
        }
    }
    answer.truncate(want);
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_has_settled_once_each_of_its_processes_was_seen_asleep_and_none_came_or_went() {
        let look = |states: &[(u32, char)]| states.to_vec();
        // gunicorn's arbiter asleep, its worker still loading the app: not yet.
        let starting = vec![look(&[(10, 'S'), (11, 'R')]); 5];
        assert!(!asleep_in_turn(&starting));
        // Each asleep at some look (a worker serving sleeps between requests): settled.
        let serving = [
            look(&[(10, 'S'), (11, 'R')]),
            look(&[(10, 'S'), (11, 'R')]),
            look(&[(10, 'S'), (11, 'S')]),
            look(&[(10, 'R'), (11, 'R')]),
            look(&[(10, 'S'), (11, 'D')]),
        ];
        assert!(asleep_in_turn(&serving));
        // The arbiter alone, before it forks: its worker is still to come.
        let forking = [
            look(&[(10, 'S')]),
            look(&[(10, 'S')]),
            look(&[(10, 'S')]),
            look(&[(10, 'S')]),
            look(&[(10, 'S'), (11, 'R')]),
        ];
        assert!(!asleep_in_turn(&forking));
        // Gone: never settled.
        assert!(!asleep_in_turn(&vec![Vec::new(); 5]));
    }

    #[test]
    fn a_listener_taken_back_must_be_where_the_url_binds() {
        let tcp = |a: &str| Address::Tcp(a.parse().unwrap());
        let url = |u: &str| u.parse::<BindUrl>().unwrap();
        assert!(bound_for(
            &tcp("127.0.0.1:4000"),
            &url("http://127.0.0.1:0")
        ));
        assert!(bound_for(
            &tcp("127.0.0.1:4000"),
            &url("http://127.0.0.1:4000")
        ));
        assert!(!bound_for(
            &tcp("127.0.0.1:4000"),
            &url("http://127.0.0.1:4001")
        ));
        assert!(!bound_for(
            &tcp("127.0.0.2:4000"),
            &url("http://127.0.0.1:0")
        ));
        assert!(!bound_for(&tcp("[::1]:4000"), &url("http://127.0.0.1:0")));
        let unix = Address::Unix("/run/a.sock".into());
        assert!(bound_for(&unix, &url("unix:///run/a.sock")));
        assert!(!bound_for(&unix, &url("unix:///run/b.sock")));
        assert!(!bound_for(&unix, &url("http://127.0.0.1:0")));
    }

    #[test]
    fn a_shared_listener_is_duplicated_for_each_worker_and_outlives_their_copies() {
        let shared = PassedListener::bind(&"http://127.0.0.1:0".parse().unwrap()).unwrap();
        let copy = shared.share().unwrap();
        assert_eq!(copy.address, shared.address);
        drop(copy);
        // The supervisor's own is still open and listening.
        let Address::Tcp(at) = shared.address else {
            panic!("a TCP listener")
        };
        std::net::TcpStream::connect(at).expect("the listener is still open");
    }

    #[test]
    fn a_passed_unix_socket_admits_any_local_user() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("app.sock");
        let old = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o022));
        let bound = PassedListener::bind(&BindUrl::Unix { path: path.clone() });
        rustix::process::umask(old);
        bound.unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, peregrine_contract::url::UNIX_SOCKET_MODE);
    }

    #[test]
    fn reads_the_status_of_an_answer() {
        assert_eq!(status_of(b"HTTP/1.1 204 No Content\r\n").unwrap(), 204);
        assert_eq!(status_of(b"HTTP/1.0 404 Not Found\r\n\r\n").unwrap(), 404);
        assert!(matches!(status_of(b""), Err(NotReady::Closed)));
        let ssh = status_of(b"SSH-2.0-OpenSSH\r\n").unwrap_err();
        assert!(matches!(&ssh, NotReady::NotHttp1(line) if line == "SSH-2.0-OpenSSH"));
        assert_eq!(ssh.to_string(), "not an HTTP/1 answer: \"SSH-2.0-OpenSSH\"");
    }

    #[test]
    fn binds_a_fresh_port_and_fills_the_placeholders() {
        let url: BindUrl = "http://127.0.0.1:0".parse().unwrap();
        let listener = PassedListener::bind(&url).unwrap();
        let Address::Tcp(addr) = listener.address else {
            panic!("not TCP");
        };
        assert_ne!(addr.port(), 0);
        assert_eq!(
            listener.substitute("--bind=fd://{fd} --port {port} {address}"),
            format!("--bind=fd://3 --port {} {addr}", addr.port())
        );
        assert_eq!(listener.url().to_string(), format!("http://{addr}"));
        // Not SO_REUSEPORT: nobody else can bind it while it lives.
        assert!(std::net::TcpListener::bind(addr).is_err());
        // Nagle's algorithm off on the listener, so on every connection accepted from it, whether
        // the server sets it or not.
        assert!(rustix::net::sockopt::tcp_nodelay(&listener.fd).unwrap());
        let _client = std::net::TcpStream::connect(addr).unwrap();
        let (accepted, _) = rustix::net::acceptfrom(&listener.fd).unwrap();
        assert!(rustix::net::sockopt::tcp_nodelay(&accepted).unwrap());
    }

    #[test]
    fn a_stale_unix_socket_is_replaced_and_a_live_one_refused() {
        let dir = std::env::temp_dir().join(format!("peregrine-passed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.sock");
        let url = BindUrl::Unix { path: path.clone() };
        let first = PassedListener::bind(&url).unwrap();
        let refused = PassedListener::bind(&url).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::AddrInUse, "{refused}");
        drop(first);
        let second = PassedListener::bind(&url).expect("the stale socket is replaced");
        drop(second);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_server_is_ready_once_it_answers_below_500_and_h2c_is_asked_for() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = Address::Tcp(listener.local_addr().unwrap());
        let statuses = ["503 Service Unavailable", "200 OK"];
        let server = tokio::spawn(async move {
            for status in statuses {
                let (mut stream, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 256];
                let n = stream.read(&mut buf).await.unwrap();
                assert!(buf[..n].starts_with(b"GET /healthz HTTP/1.1\r\n"));
                let answer = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n");
                stream.write_all(answer.as_bytes()).await.unwrap();
            }
            // The h2c question: this server speaks HTTP/1 only and closes.
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 64];
            let n = stream.read(&mut buf).await.unwrap();
            assert!(buf[..n].starts_with(b"PRI * HTTP/2.0"));
        });
        let failing = probe_ready(&address, "/healthz").await.unwrap_err();
        assert!(matches!(failing, NotReady::Failing { status: 503, .. }));
        assert_eq!(failing.to_string(), "GET /healthz answered 503");
        assert_eq!(probe_ready(&address, "/healthz").await.unwrap(), 200);
        assert!(!speaks_h2c(&address).await);
        server.await.unwrap();
    }
}
