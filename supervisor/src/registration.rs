//! The registration server: workers announce their listeners over the supervisor's Unix sockets.
//!
//! The control socket is owner-only (mode 0600); the workers of a service with a `user` register on
//! the service's own worker socket beside it ([`WorkerSockets`]: the service's group may open it).
//! For each connection the server reads the peer's credentials (SO_PEERCRED) and accepts a
//! registration only from a live worker process the manager started, running as the uid it was
//! started with, on its service's socket, whose message names that worker's own pid, service and
//! slot ([`admission`]). Anything else gets a `Refused` answer, a log line (with the peer's uid and
//! pid; at most one per kind per 10 s, since any peer that may open the socket can repeat it), and a
//! closed connection; nothing else is touched. A registered worker's connection stays open: its
//! close deregisters the worker. A connection that sends nothing is closed after 10 s, or sooner
//! when newer ones take its place ([`pending`]).
//!
//! The control socket also answers `peregrine status`: a connection whose first message is a status
//! request gets the registry's status ([`crate::status::report`]) and is closed. Control commands
//! (`peregrine restart`, `peregrine reload`) are handed to the supervisor's run loop ([`Commands`])
//! and answered once carried out. Both are taken only from a process of the supervisor's own
//! (effective) user that is neither a worker nor started by one: a worker registers and does nothing
//! else.

use std::{
    io,
    os::unix::fs::{FileTypeExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use bytes::BytesMut;
use peregrine_proto::{
    FrameError, decode_frame, encode,
    v1::{
        self, Refused, Registered, SupervisorMessage, WorkerMessage, supervisor_message,
        worker_message,
    },
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{UnixListener, UnixStream},
    sync::{mpsc, oneshot},
};
use tracing::Instrument;

mod admission;
mod listening;
mod pending;
mod worker_sockets;

pub use self::admission::{ListenerError, PeerCred, Refusal, Socket, admit_peer};
use self::admission::{admit, commander};
use self::pending::{PENDING_CAP, Pending, Ticket};
pub use self::worker_sockets::WorkerSockets;
use crate::{
    children::Children, instance::InstanceLock, registry::Registry, status, throttle::Throttles,
};

/// How long a new connection may take to send its registration.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);

/// At most one log line per kind of refusal (and of failed accept) per socket in this time, with a
/// count of the lines held back.
const LOG_PERIOD: Duration = Duration::from_secs(10);

/// The first pause after a failed accept; it doubles while accepts fail, up to the most.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Why the registration socket could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// A file that is not a socket is in the way.
    #[error("{0} exists and is not a socket; refusing to remove it")]
    NotASocket(PathBuf),
    /// Any other failure.
    #[error("cannot bind the registration socket {path}")]
    Io {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A service's workers could not reach their worker socket.
    #[error(
        "{service}'s workers run as {user}, who cannot reach {path}: {dir} is not searchable by \
         that user (mode {mode:04o}); put the control socket in a directory every service's user \
         may search"
    )]
    Unreachable {
        /// The service.
        service: String,
        /// Its user, as the config names it.
        user: String,
        /// The worker socket.
        path: PathBuf,
        /// The first directory on the way that the user may not search.
        dir: PathBuf,
        /// That directory's mode.
        mode: u32,
    },
}

/// Binds the registration socket at `path`, owner-only, replacing a socket file left by a supervisor
/// that died. `lock` is the socket's instance lock: holding it proves that no other supervisor serves
/// on `path`, so whatever socket is there is stale.
pub fn bind(path: &Path, lock: &InstanceLock) -> Result<UnixListener, BindError> {
    debug_assert_eq!(lock.path(), crate::instance::lock_path(path));
    bind_replacing(path, 0o600)
}

/// Binds a socket at `path` with permission bits `mode`, replacing a socket file left by a
/// supervisor that died; the caller holds the instance lock that proves it stale.
fn bind_replacing(path: &Path, mode: u32) -> Result<UnixListener, BindError> {
    let io_err = |source| BindError::Io {
        path: path.to_owned(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_socket() => {
            return Err(BindError::NotASocket(path.to_owned()));
        }
        Ok(_) => {
            tracing::info!(path = %path.display(), "Removing the registration socket a stopped supervisor left");
            std::fs::remove_file(path).map_err(io_err)?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(e)),
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io_err)?;
    }
    // Until the mode is set, another user could connect; the server admits no one but a worker as the
    // user it was started as, or the supervisor's user (SO_PEERCRED), so such a connection gets
    // nothing.
    let listener = UnixListener::bind(path).map_err(io_err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(io_err)?;
    Ok(listener)
}

/// Where control commands go: each with the channel its reply comes back on.
pub type Commands = mpsc::Sender<(v1::ControlRequest, oneshot::Sender<ControlAnswer>)>;

/// A control command's reply as the run loop hands it back to the connection.
#[derive(Debug)]
pub struct ControlAnswer {
    /// What the client is sent.
    pub reply: v1::ControlReply,
    /// Told once the reply is written to the client, or could not be: an upgrade execs only then,
    /// so that its client hears that it began.
    pub written: Option<oneshot::Sender<()>>,
}

impl From<v1::ControlReply> for ControlAnswer {
    fn from(reply: v1::ControlReply) -> Self {
        ControlAnswer {
            reply,
            written: None,
        }
    }
}

/// What the registration server reads and writes, on every socket.
#[derive(Clone)]
pub struct Server {
    /// Where registered workers go.
    pub registry: Arc<Registry>,
    /// Who is a worker, in which slot, as which user.
    pub children: Arc<Children>,
    /// What the status report reads beside the registry.
    pub records: status::Records,
    /// Where control commands go.
    pub commands: Commands,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").finish_non_exhaustive()
    }
}

/// Accepts registrations, status and control requests on the control socket until the task is
/// dropped.
pub async fn serve(listener: UnixListener, server: Server) {
    serve_on(listener, server, Socket::Control).await;
}

/// Accepts connections on `socket` until the task is dropped.
async fn serve_on(listener: UnixListener, server: Server, socket: Socket) {
    let pending = Pending::new(PENDING_CAP);
    let logs = Arc::new(Throttles::new(LOG_PERIOD));
    let mut backoff = ACCEPT_BACKOFF_MIN;
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                backoff = ACCEPT_BACKOFF_MIN;
                let (server, socket, logs) = (server.clone(), socket.clone(), logs.clone());
                let cred = stream.peer_cred().ok();
                let span = tracing::info_span!(
                    "registration",
                    pid = cred.and_then(|c| c.pid()),
                    uid = cred.map(|c| c.uid()),
                );
                let (ticket, evicted) = pending.enter();
                if evicted && let Some(held_back) = logs.allow("evicted") {
                    tracing::warn!(
                        parent: &span,
                        cap = PENDING_CAP,
                        held_back,
                        "Registration socket: {PENDING_CAP} connections have sent nothing yet; the \
                         oldest is closed to make room"
                    );
                }
                tokio::spawn(
                    async move {
                        if let Err(reason) = handle(stream, &server, &socket, ticket).await {
                            log_closed(&reason, &logs);
                        }
                    }
                    .instrument(span),
                );
                // Lets the connections just accepted read their first message before the next
                // accept, so that a burst of workers does not push its own out of the cap.
                tokio::task::yield_now().await;
            }
            Err(error) => {
                // EMFILE and the like: the descriptors are someone else's doing; the connection
                // stays in the backlog, so try again after a pause that grows while it lasts.
                if let Some(held_back) = logs.allow("accept") {
                    tracing::error!(%error, held_back, retry_in = ?backoff, "Cannot accept a registration connection");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
            }
        }
    }
}

/// Logs why a connection was closed: a line per kind at most every [`LOG_PERIOD`], since any peer
/// that may open the socket can close connections as fast as it likes.
fn log_closed(reason: &Closed, logs: &Throttles) {
    // A connect-and-close (a client that gave up, a port scan of sorts).
    if matches!(reason, Closed::EarlyEof) {
        tracing::debug!(%reason, "Registration connection closed");
        return;
    }
    if let Some(held_back) = logs.allow(reason.kind()) {
        tracing::warn!(%reason, held_back, "Registration connection closed");
    }
}

/// Why a connection was closed.
#[derive(Debug, thiserror::Error)]
enum Closed {
    #[error("refused: {reason}")]
    Refused {
        reason: String,
        code: peregrine_proto::v1::refused::Code,
    },
    #[error("malformed message: {0}")]
    Malformed(#[source] FrameError),
    #[error("unexpected message after registration")]
    Unexpected,
    #[error("no registration within {REGISTER_TIMEOUT:?}")]
    Timeout,
    #[error("connection closed before registering")]
    EarlyEof,
    #[error("closed before its first message: newer connections took its place")]
    Evicted,
    #[error("i/o error")]
    Io(#[from] io::Error),
}

impl Closed {
    /// What its log line is throttled by.
    fn kind(&self) -> &'static str {
        match self {
            Closed::Refused { code, .. } => code.as_str_name(),
            Closed::Malformed(_) => "malformed",
            Closed::Unexpected => "unexpected",
            Closed::Timeout => "timeout",
            Closed::EarlyEof => "early-eof",
            Closed::Evicted => "evicted",
            Closed::Io(_) => "io",
        }
    }
}

/// Serves one connection; `ticket` is its place among the socket's pending connections, given back
/// once its first message is read.
async fn handle(
    mut stream: UnixStream,
    server: &Server,
    socket: &Socket,
    ticket: Ticket,
) -> Result<(), Closed> {
    let Server {
        registry,
        children,
        records,
        commands,
    } = server;
    let mut buf = BytesMut::with_capacity(1024);
    let first = tokio::time::timeout(REGISTER_TIMEOUT, read_message(&mut stream, &mut buf));
    let message = tokio::select! {
        () = ticket.evicted() => return Err(Closed::Evicted),
        first = first => match first {
            Err(_) => return Err(Closed::Timeout),
            Ok(Ok(Some(message))) => message,
            Ok(Ok(None)) => return Err(Closed::EarlyEof),
            Ok(Err(e)) => return Err(e),
        },
    };
    drop(ticket);
    let message = match message.message {
        Some(worker_message::Message::Status(_) | worker_message::Message::Control(_))
            if *socket != Socket::Control =>
        {
            return Err(refuse(&mut stream, &Refusal::RegistrationsOnly).await);
        }
        Some(worker_message::Message::Status(_)) => {
            return answer_status(&mut stream, registry, children, records).await;
        }
        Some(worker_message::Message::Control(request)) => {
            return answer_control(&mut stream, request, children, commands).await;
        }
        other => WorkerMessage { message: other },
    };
    let worker = match admit(&stream, socket, message, children) {
        Ok(worker) => worker,
        Err(refusal) => return Err(refuse(&mut stream, &refusal).await),
    };
    let (service, index, pid) = (worker.service.clone(), worker.index, worker.pid);
    let hostname = worker.hostname.clone();
    if let Err(error) = registry.register(worker) {
        return Err(refuse(&mut stream, &Refusal::from(error)).await);
    }
    tracing::info!(%service, index, pid, %hostname, "Worker registered");
    let answer = SupervisorMessage {
        message: Some(supervisor_message::Message::Registered(Registered {
            hostname,
        })),
    };
    let result = async {
        stream.write_all(&encode(&answer)).await?;
        // The connection now only signals liveness: any message is unexpected, EOF deregisters.
        match read_message(&mut stream, &mut buf).await? {
            None => Ok(()),
            Some(_) => Err(Closed::Unexpected),
        }
    }
    .await;
    if registry.deregister(&service, index, pid) {
        tracing::info!(%service, index, pid, "Worker deregistered: its connection closed");
    }
    result
}

/// Answers a status request from a process of the supervisor's user that is no worker; the caller
/// then closes.
async fn answer_status(
    stream: &mut UnixStream,
    registry: &Registry,
    children: &Children,
    records: &status::Records,
) -> Result<(), Closed> {
    if let Err(refusal) = commander(stream, children) {
        return Err(refuse(stream, &refusal).await);
    }
    let report = status::report_of(registry, records);
    let answer = SupervisorMessage {
        message: Some(supervisor_message::Message::Status(report)),
    };
    stream.write_all(&encode(&answer)).await?;
    tracing::debug!("Status answered");
    Ok(())
}

/// Hands a control command from a process of the supervisor's user that is no worker to the run
/// loop and answers with its reply; the caller then closes.
async fn answer_control(
    stream: &mut UnixStream,
    request: v1::ControlRequest,
    children: &Children,
    commands: &Commands,
) -> Result<(), Closed> {
    if let Err(refusal) = commander(stream, children) {
        return Err(refuse(stream, &refusal).await);
    }
    tracing::info!(?request, "Control command received");
    let (tx, rx) = oneshot::channel();
    let ControlAnswer { reply, written } = match commands.send((request, tx)).await {
        Ok(()) => rx.await.ok(),
        Err(_) => None,
    }
    .unwrap_or_else(|| {
        ControlAnswer::from(v1::ControlReply {
            ok: false,
            summary: "the supervisor is stopping".into(),
            ..Default::default()
        })
    });
    let answer = SupervisorMessage {
        message: Some(supervisor_message::Message::Control(reply)),
    };
    let result = stream.write_all(&encode(&answer)).await;
    if let Some(written) = written {
        let _ = written.send(());
    }
    result?;
    Ok(())
}

/// Sends `refusal` to the peer, as its code and its text.
async fn refuse(stream: &mut UnixStream, refusal: &Refusal) -> Closed {
    let reason = refusal.to_string();
    let answer = SupervisorMessage {
        message: Some(supervisor_message::Message::Refused(Refused {
            reason: reason.clone(),
            code: refusal.code().into(),
        })),
    };
    // The peer may be gone already; the refusal is logged either way.
    let _ = stream.write_all(&encode(&answer)).await;
    Closed::Refused {
        reason,
        code: refusal.code(),
    }
}

/// Reads one message; `None` on a clean EOF between messages.
async fn read_message(
    stream: &mut UnixStream,
    buf: &mut BytesMut,
) -> Result<Option<WorkerMessage>, Closed> {
    loop {
        if let Some(message) = decode_frame::<WorkerMessage>(buf).map_err(Closed::Malformed)? {
            return Ok(Some(message));
        }
        if stream.read_buf(buf).await? == 0 {
            return if buf.is_empty() {
                Ok(None)
            } else {
                Err(Closed::Malformed(FrameError::BadLength))
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{Address, Protocol, Worker};
    use peregrine_proto::v1::refused::Code;

    fn register_message(service: &str, index: u32, pid: u32, port: u32) -> WorkerMessage {
        WorkerMessage {
            message: Some(worker_message::Message::Register(v1::Register {
                service: service.into(),
                index,
                pid,
                listener: Some(v1::Listener {
                    name: service.into(),
                    scheme: "http".into(),
                    protocols: vec![v1::Protocol::Http1 as i32],
                    addresses: vec![v1::Address {
                        address: Some(v1::address::Address::Socket(v1::SocketAddress {
                            ip: "::1".into(),
                            port,
                        })),
                    }],
                }),
            })),
        }
    }

    struct Fixture {
        _dir: tempfile::TempDir,
        path: PathBuf,
        registry: Arc<Registry>,
        children: Arc<Children>,
        server: tokio::task::JoinHandle<()>,
    }

    impl Fixture {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("control.sock");
            let registry = Arc::new(Registry::new(["web".to_string()]));
            let children = Arc::new(Children::default());
            // A run loop that answers every command with what it was asked.
            let (commands, mut requests) =
                mpsc::channel::<(v1::ControlRequest, oneshot::Sender<ControlAnswer>)>(1);
            tokio::spawn(async move {
                while let Some((request, reply)) = requests.recv().await {
                    let _ = reply.send(ControlAnswer::from(v1::ControlReply {
                        ok: true,
                        summary: format!("{:?}", request.action),
                        ..Default::default()
                    }));
                }
            });
            let lock = InstanceLock::acquire(&path).unwrap();
            let server = tokio::spawn(serve(
                bind(&path, &lock).unwrap(),
                Server {
                    registry: registry.clone(),
                    children: children.clone(),
                    records: status::Records::default(),
                    commands,
                },
            ));
            Fixture {
                _dir: dir,
                path,
                registry,
                children,
                server,
            }
        }

        async fn exchange(
            &self,
            message: &WorkerMessage,
        ) -> (UnixStream, Option<SupervisorMessage>) {
            let mut stream = UnixStream::connect(&self.path).await.unwrap();
            stream.write_all(&encode(message)).await.unwrap();
            let answer = read_answer(&mut stream).await;
            (stream, answer)
        }

        async fn wait_for_revision(&self, revision: u64) {
            let mut rx = self.registry.subscribe();
            tokio::time::timeout(
                Duration::from_secs(5),
                rx.wait_for(|s| s.revision >= revision),
            )
            .await
            .expect("registry did not change in time")
            .unwrap();
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            self.server.abort();
        }
    }

    async fn read_answer(stream: &mut UnixStream) -> Option<SupervisorMessage> {
        let mut buf = BytesMut::new();
        loop {
            if let Some(m) = decode_frame(&mut buf).unwrap() {
                return Some(m);
            }
            let n = tokio::time::timeout(Duration::from_secs(5), stream.read_buf(&mut buf))
                .await
                .expect("no answer in time")
                .unwrap();
            if n == 0 {
                return None;
            }
        }
    }

    fn own_pid() -> u32 {
        std::process::id()
    }

    /// A listener of this process on `[::1]`, which it may register.
    fn listener() -> (std::net::TcpListener, u32) {
        let listener = std::net::TcpListener::bind("[::1]:0").unwrap();
        let port = listener.local_addr().unwrap().port().into();
        (listener, port)
    }

    #[test]
    fn the_socket_is_owner_only_and_a_stale_one_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _guard = rt.enter();
        let lock = InstanceLock::acquire(&path).unwrap();
        let listener = bind(&path, &lock).expect("a stale socket is replaced");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        drop(listener);
        let file = dir.path().join("file");
        std::fs::write(&file, "x").unwrap();
        let lock = InstanceLock::acquire(&file).unwrap();
        assert!(matches!(bind(&file, &lock), Err(BindError::NotASocket(_))));
    }

    #[tokio::test]
    async fn registers_a_worker_until_its_connection_closes() {
        let fx = Fixture::new();
        fx.children.insert_for_test(own_pid(), "web", 0);
        let (_listener, port) = listener();
        let (stream, answer) = fx
            .exchange(&register_message("web", 0, own_pid(), port))
            .await;
        let Some(SupervisorMessage {
            message: Some(supervisor_message::Message::Registered(registered)),
        }) = answer
        else {
            panic!("expected Registered, got {answer:?}");
        };
        assert_eq!(
            registered.hostname,
            crate::registry::hostname_for("web", 0, own_pid())
        );
        let snapshot = fx.registry.snapshot();
        let worker = snapshot.services["web"].serving(0).unwrap();
        assert_eq!(
            worker.listener.addresses,
            [Address::Tcp(format!("[::1]:{port}").parse().unwrap())]
        );
        drop(stream);
        fx.wait_for_revision(2).await;
        assert!(fx.registry.snapshot().services["web"].workers.is_empty());
    }

    #[tokio::test]
    async fn refuses_a_process_that_is_not_a_worker() {
        let fx = Fixture::new();
        let (_stream, answer) = fx
            .exchange(&register_message("web", 0, own_pid(), 8080))
            .await;
        let Some(SupervisorMessage {
            message: Some(supervisor_message::Message::Refused(refused)),
        }) = answer
        else {
            panic!("expected Refused, got {answer:?}");
        };
        assert_eq!(refused.code(), Code::NotOurs, "{}", refused.reason);
        assert!(!refused.reason.is_empty());
        assert_eq!(fx.registry.snapshot().revision, 0);
    }

    #[tokio::test]
    async fn refuses_claims_that_do_not_match_the_peer() {
        let fx = Fixture::new();
        fx.children.insert_for_test(own_pid(), "web", 0);
        let (stream, _peer) = UnixStream::pair().unwrap();
        let check = |message: WorkerMessage, expected: fn(&Refusal) -> bool| {
            let refusal = admit(&stream, &Socket::Control, message, &fx.children).unwrap_err();
            assert!(expected(&refusal), "{refusal:?}");
        };
        check(
            register_message("web", 0, own_pid() + 1, 8080),
            |r| matches!(r, Refusal::PidMismatch { claimed, .. } if *claimed == own_pid() + 1),
        );
        check(register_message("web", 1, own_pid(), 8080), |r| {
            matches!(r, Refusal::SlotMismatch { started, claimed, .. }
                if started.index == 0 && claimed.index == 1)
        });
        check(register_message("web", 0, own_pid(), 0), |r| {
            matches!(r, Refusal::Listener(ListenerError::Port(0)))
        });
        // The same refusals reach the peer, as their code beside their text.
        for (message, expected) in [
            (
                register_message("web", 0, own_pid() + 1, 8080),
                Code::PidMismatch,
            ),
            (
                register_message("web", 1, own_pid(), 8080),
                Code::SlotMismatch,
            ),
            (register_message("web", 0, own_pid(), 0), Code::BadListener),
        ] {
            let (_stream, answer) = fx.exchange(&message).await;
            let refused = match answer.and_then(|a| a.message) {
                Some(supervisor_message::Message::Refused(r)) => r,
                other => panic!("expected Refused, got {other:?}"),
            };
            assert_eq!(refused.code(), expected, "{}", refused.reason);
            assert!(!refused.reason.is_empty());
        }
        assert_eq!(fx.registry.snapshot().revision, 0);
    }

    #[tokio::test]
    async fn refuses_an_address_the_worker_does_not_listen_on() {
        let fx = Fixture::new();
        fx.children.insert_for_test(own_pid(), "web", 0);
        // A port this process held and gave up, as another's (Envoy's admin port) would be: no
        // listener of this process is bound to it.
        let (gone, gone_port) = listener();
        drop(gone);
        let (_listener, port) = listener();
        let mut message = register_message("web", 0, own_pid(), port);
        if let Some(worker_message::Message::Register(register)) = &mut message.message {
            let listener = register.listener.as_mut().unwrap();
            listener.addresses.push(v1::Address {
                address: Some(v1::address::Address::Socket(v1::SocketAddress {
                    ip: "::1".into(),
                    port: gone_port,
                })),
            });
        }
        let (_stream, answer) = fx.exchange(&message).await;
        let refused = match answer.and_then(|a| a.message) {
            Some(supervisor_message::Message::Refused(r)) => r,
            other => panic!("expected Refused, got {other:?}"),
        };
        assert_eq!(refused.code(), Code::NotListening, "{}", refused.reason);
        assert_eq!(
            refused.reason,
            format!("process {} does not listen on [::1]:{gone_port}", own_pid())
        );
        assert_eq!(fx.registry.snapshot().revision, 0);
        // Its own listener alone is admitted.
        let (_registered, answer) = fx
            .exchange(&register_message("web", 0, own_pid(), port))
            .await;
        assert!(
            matches!(
                answer.and_then(|a| a.message),
                Some(supervisor_message::Message::Registered(_))
            ),
            "its own listener is admitted"
        );
    }

    fn status_request() -> WorkerMessage {
        WorkerMessage {
            message: Some(worker_message::Message::Status(v1::StatusRequest {})),
        }
    }

    #[tokio::test]
    async fn hands_control_commands_to_the_run_loop_and_answers() {
        let fx = Fixture::new();
        let request = WorkerMessage {
            message: Some(worker_message::Message::Control(v1::ControlRequest {
                action: Some(v1::control_request::Action::Restart(v1::Restart {
                    service: "web".into(),
                })),
            })),
        };
        let (_stream, answer) = fx.exchange(&request).await;
        let Some(supervisor_message::Message::Control(reply)) = answer.and_then(|a| a.message)
        else {
            panic!("expected a control reply");
        };
        assert!(reply.ok);
        assert!(reply.summary.contains("Restart"), "{}", reply.summary);
    }

    #[tokio::test]
    async fn answers_status_to_its_own_user_and_closes() {
        let fx = Fixture::new();
        let addr = Address::Tcp("127.0.0.1:8080".parse().unwrap());
        fx.registry
            .register(Worker::ready(
                "web",
                0,
                4242,
                vec![Protocol::Http1],
                vec![addr],
            ))
            .unwrap();
        fx.registry.set_restarts("web", 0, 3);
        // This process is no worker of the supervisor; a status client need not be.
        let (mut stream, answer) = fx.exchange(&status_request()).await;
        let Some(supervisor_message::Message::Status(status)) = answer.and_then(|a| a.message)
        else {
            panic!("expected a status");
        };
        let row = &status.workers[0];
        assert_eq!(
            (row.service.as_str(), row.index, row.pid, row.restarts),
            ("web", 0, Some(4242), 3)
        );
        assert_eq!(row.addresses, ["127.0.0.1:8080"]);
        assert!(
            read_answer(&mut stream).await.is_none(),
            "closed after the answer"
        );
        assert_eq!(fx.registry.snapshot().revision, 1, "nothing changed");
    }

    #[tokio::test]
    async fn refuses_status_and_control_to_another_user() {
        use rustix::process::Uid;
        if !rustix::process::geteuid().is_root() {
            peregrine_testenv::skip(
                "refuses_status_and_control_to_another_user",
                "making a socket of another user needs root",
            );
            return;
        }
        let restart = WorkerMessage {
            message: Some(worker_message::Message::Control(v1::ControlRequest {
                action: Some(v1::control_request::Action::Restart(v1::Restart::default())),
            })),
        };
        for request in [status_request(), restart] {
            let fx = Fixture::new();
            // Credentials are per thread in the kernel: a thread that is briefly `nobody` makes a
            // socket pair whose peer credentials say so. The thread ends right after.
            let (server, client) = std::thread::spawn(|| {
                rustix::thread::set_thread_res_uid(None, Some(Uid::from_raw(65534)), None).unwrap();
                let pair = std::os::unix::net::UnixStream::pair();
                rustix::thread::set_thread_res_uid(None, Some(Uid::ROOT), None).unwrap();
                pair.unwrap()
            })
            .join()
            .unwrap();
            let tokio_stream = |s: std::os::unix::net::UnixStream| {
                s.set_nonblocking(true).unwrap();
                UnixStream::from_std(s).unwrap()
            };
            let (server, mut client) = (tokio_stream(server), tokio_stream(client));
            let (registry, children) = (fx.registry.clone(), fx.children.clone());
            let (commands, mut received) = mpsc::channel(1);
            let served = tokio::spawn(async move {
                let server_side = Server {
                    registry,
                    children,
                    records: status::Records::default(),
                    commands,
                };
                let (ticket, _) = Pending::new(1).enter();
                handle(server, &server_side, &Socket::Control, ticket).await
            });
            client.write_all(&encode(&request)).await.unwrap();
            let refused = match read_answer(&mut client).await.and_then(|a| a.message) {
                Some(supervisor_message::Message::Refused(refused)) => refused,
                other => panic!("expected a refusal, got {other:?}"),
            };
            assert_eq!(refused.code(), Code::OtherUser);
            assert_eq!(
                refused.reason,
                "peer uid 65534 is not the supervisor's uid 0"
            );
            assert!(matches!(served.await.unwrap(), Err(Closed::Refused { .. })));
            assert!(
                received.try_recv().is_err(),
                "no command reached the run loop"
            );
        }
    }

    #[tokio::test]
    async fn a_malformed_message_closes_only_its_own_connection() {
        let fx = Fixture::new();
        fx.children.insert_for_test(own_pid(), "web", 0);
        let (_listener, port) = listener();
        let (_registered, _) = fx
            .exchange(&register_message("web", 0, own_pid(), port))
            .await;
        let mut bad = UnixStream::connect(&fx.path).await.unwrap();
        bad.write_all(&[4, 0xff, 0xff, 0xff, 0xff]).await.unwrap();
        assert!(
            read_answer(&mut bad).await.is_none(),
            "the malformed connection is closed"
        );
        let snapshot = fx.registry.snapshot();
        assert_eq!(
            snapshot.services["web"].workers.len(),
            1,
            "the other worker is untouched"
        );
        assert_eq!(snapshot.revision, 1);
    }
}
