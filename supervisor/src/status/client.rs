//! The client side of `peregrine status` and the control commands: one request over the supervisor's
//! local socket, one answer, each step bounded by [`QUERY_TIMEOUT`]: the connection (a supervisor
//! that accepts nothing fills its backlog, and a connection then waits), the request and each read
//! of the answer. A supervisor that does not answer in time is named so ([`StatusError::Timeout`]).

use std::{
    io::{self, Read, Write},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::Duration,
};

use bytes::BytesMut;
use peregrine_proto::{
    FrameError, MAX_STATUS_FRAME_LEN, decode_frame_limited, encode,
    v1::{
        self, StatusRequest, SupervisorMessage, WorkerMessage, refused::Code, supervisor_message,
        worker_message,
    },
};
use socket2::{Domain, SockAddr, Socket, Type};

use crate::printable::printable;

/// How long [`query`] waits for the supervisor at each step.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(10);

/// Why [`query`] got no status.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    /// Nothing listens on the socket.
    #[error("no supervisor is running on {path}")]
    NotRunning {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// This user may not talk to the supervisor: its socket is owner-only (the connection was not
    /// allowed), or the supervisor refused a peer of another user.
    #[error("this user may not ask the supervisor on {path}: {}", who_may(.owner.as_deref()))]
    NotAllowed {
        /// The socket path.
        path: PathBuf,
        /// The socket's owner, the supervisor's user (a name, or `uid N` without one), when this
        /// user may look the socket up.
        owner: Option<String>,
    },
    /// Connecting, writing or reading failed otherwise.
    #[error("cannot ask the supervisor on {path}")]
    Io {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The supervisor did not take the connection, read the request or answer within `after`.
    #[error("the supervisor on {path} did not answer within {}", seconds(*.after))]
    Timeout {
        /// The socket path.
        path: PathBuf,
        /// The time allowed.
        after: Duration,
    },
    /// The supervisor refused to answer.
    #[error("the supervisor on {path} refused: {}", printable(.reason))]
    Refused {
        /// The socket path.
        path: PathBuf,
        /// Why, for programs.
        code: Code,
        /// Why, in words.
        reason: String,
    },
    /// The answer was not the message asked for.
    #[error("the supervisor on {path} sent no answer to the request")]
    Malformed {
        /// The socket path.
        path: PathBuf,
        /// The cause, when the frame itself was bad.
        #[source]
        source: Option<FrameError>,
    },
}

/// Asks the supervisor listening on `socket` for its status (blocking, [`QUERY_TIMEOUT`] per step).
pub fn query(socket: &Path) -> Result<v1::Status, StatusError> {
    query_within(socket, QUERY_TIMEOUT)
}

/// [`query`], each step bounded by `timeout`.
pub fn query_within(socket: &Path, timeout: Duration) -> Result<v1::Status, StatusError> {
    let request = WorkerMessage {
        message: Some(worker_message::Message::Status(StatusRequest {})),
    };
    match exchange(socket, &request, timeout, Some(timeout))? {
        supervisor_message::Message::Status(status) => Ok(status),
        _ => Err(StatusError::Malformed {
            path: socket.to_owned(),
            source: None,
        }),
    }
}

/// Sends `request` to the supervisor listening on `socket` and returns its answer (blocking; each read
/// waits at most `read_timeout`, for ever if `None`). A refusal is an error.
pub fn ask(
    socket: &Path,
    request: &WorkerMessage,
    read_timeout: Option<Duration>,
) -> Result<supervisor_message::Message, StatusError> {
    exchange(socket, request, QUERY_TIMEOUT, read_timeout)
}

/// [`ask`], the connection and the request bounded by `timeout`.
fn exchange(
    socket: &Path,
    request: &WorkerMessage,
    timeout: Duration,
    read_timeout: Option<Duration>,
) -> Result<supervisor_message::Message, StatusError> {
    let path = socket.to_owned();
    // A timeout (a blocking socket's `EAGAIN` once its send or receive timeout passes) is named so.
    let io_error = |after: Duration| {
        let path = path.clone();
        move |source: io::Error| match source.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                StatusError::Timeout { path, after }
            }
            _ => StatusError::Io { path, source },
        }
    };
    let mut stream = connect(socket, timeout).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => StatusError::NotRunning {
            path: path.clone(),
            source,
        },
        io::ErrorKind::PermissionDenied => StatusError::NotAllowed {
            path: path.clone(),
            owner: owner_of(&path),
        },
        _ => io_error(timeout)(source),
    })?;
    stream
        .set_read_timeout(read_timeout)
        .map_err(io_error(timeout))?;
    stream
        .set_write_timeout(Some(timeout))
        .map_err(io_error(timeout))?;
    stream
        .write_all(&encode(request))
        .map_err(io_error(timeout))?;
    let read_error = io_error(read_timeout.unwrap_or(timeout));
    let mut buf = BytesMut::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let answer = loop {
        let decoded = decode_frame_limited::<SupervisorMessage>(&mut buf, MAX_STATUS_FRAME_LEN)
            .map_err(|source| StatusError::Malformed {
                path: path.clone(),
                source: Some(source),
            })?;
        if let Some(answer) = decoded {
            break answer;
        }
        // A read with a timeout is not restarted after a signal handler ran (signal(7)), whatever
        // SA_RESTART says: in a process that handles signals, try again.
        let n = match stream.read(&mut chunk) {
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            other => other.map_err(read_error.clone())?,
        };
        if n == 0 {
            return Err(StatusError::Malformed { path, source: None });
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    match answer.message {
        Some(supervisor_message::Message::Refused(refused))
            if refused.code() == Code::OtherUser =>
        {
            Err(StatusError::NotAllowed {
                owner: owner_of(&path),
                path,
            })
        }
        Some(supervisor_message::Message::Refused(refused)) => Err(StatusError::Refused {
            path,
            code: refused.code(),
            reason: refused.reason,
        }),
        Some(message) => Ok(message),
        None => Err(StatusError::Malformed { path, source: None }),
    }
}

/// A connection to the Unix socket at `path` that waits at most `timeout` for room in a full
/// backlog (a Unix socket's connect waits up to its send timeout, then fails with `EAGAIN`).
fn connect(path: &Path, timeout: Duration) -> io::Result<UnixStream> {
    // Close-on-exec, as std's own sockets.
    let socket = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    socket.set_write_timeout(Some(timeout))?;
    socket.connect(&SockAddr::unix(path)?)?;
    Ok(socket.into())
}

/// The name of the user who owns the file at `path` (`uid N` where the user database has no name
/// for it), if this user may look it up.
fn owner_of(path: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let uid = std::fs::metadata(path).ok()?.uid();
    Some(
        match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
            Ok(Some(user)) => user.name,
            _ => format!("uid {uid}"),
        },
    )
}

/// Who may ask a supervisor whose socket `owner` owns, and how a person runs a command as them.
fn who_may(owner: Option<&str>) -> String {
    match owner {
        None => {
            "only the supervisor's own user may (run the command with sudo, or as that user)".into()
        }
        Some("root") => "only its own user, root, may (run the command with sudo)".into(),
        Some(uid) if uid.starts_with("uid ") => format!(
            "only its own user, {uid}, may (run the command with sudo -u '#{}')",
            &uid[4..]
        ),
        Some(user) => {
            format!("only its own user, {user}, may (run the command with sudo -u {user})")
        }
    }
}

/// `10 s`, `0.2 s`: a timeout for a person.
fn seconds(duration: Duration) -> String {
    if duration.subsec_millis() == 0 {
        format!("{} s", duration.as_secs())
    } else {
        format!("{:.1} s", duration.as_secs_f64())
    }
}

/// Sends a control command (restart, reload) to the supervisor on `socket` and waits for its reply,
/// however long the command takes.
pub fn control(
    socket: &Path,
    request: v1::ControlRequest,
) -> Result<v1::ControlReply, StatusError> {
    let request = WorkerMessage {
        message: Some(worker_message::Message::Control(request)),
    };
    match ask(socket, &request, None)? {
        supervisor_message::Message::Control(reply) => Ok(reply),
        _ => Err(StatusError::Malformed {
            path: socket.to_owned(),
            source: None,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asking_a_socket_without_a_supervisor_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("none.sock");
        let error = query(&path).unwrap_err();
        assert!(matches!(error, StatusError::NotRunning { .. }), "{error:?}");
        assert_eq!(
            error.to_string(),
            format!("no supervisor is running on {}", path.display())
        );
        // A stale socket file, nobody listening.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(matches!(query(&path), Err(StatusError::NotRunning { .. })));
    }

    #[test]
    fn a_socket_this_user_may_not_open_says_whose_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("theirs.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let uid = nix::unistd::geteuid();
        let me = nix::unistd::User::from_uid(uid)
            .unwrap()
            .map_or_else(|| format!("uid {uid}"), |u| u.name);
        assert_eq!(owner_of(&path), Some(me));
        assert_eq!(owner_of(&dir.path().join("none.sock")), None);
        let error = StatusError::NotAllowed {
            owner: Some("root".into()),
            path: path.clone(),
        };
        assert_eq!(
            error.to_string(),
            format!(
                "this user may not ask the supervisor on {}: only its own user, root, may (run \
                 the command with sudo)",
                path.display()
            )
        );
        assert!(who_may(Some("peregrine")).ends_with("(run the command with sudo -u peregrine)"));
        assert!(who_may(Some("uid 4242")).ends_with("(run the command with sudo -u '#4242')"));
        assert!(who_may(None).contains("with sudo, or as that user"));
    }

    #[test]
    fn a_supervisor_that_never_answers_is_named_a_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hung.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        // Accepts, reads the request and never answers; holds the connection until the client
        // closes it.
        let held = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut request = [0u8; 64];
            while stream.read(&mut request).is_ok_and(|n| n > 0) {}
        });
        let started = std::time::Instant::now();
        let error = query_within(&path, Duration::from_millis(200)).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(matches!(error, StatusError::Timeout { .. }), "{error:?}");
        assert_eq!(
            error.to_string(),
            format!(
                "the supervisor on {} did not answer within 0.2 s",
                path.display()
            )
        );
        held.join().unwrap();
        let after = StatusError::Timeout {
            path: path.clone(),
            after: QUERY_TIMEOUT,
        };
        assert!(
            after.to_string().ends_with("did not answer within 10 s"),
            "{after}"
        );
    }

    #[test]
    fn a_supervisor_that_accepts_nothing_is_named_a_timeout_once_its_backlog_is_full() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stopped.sock");
        let socket = Socket::new(Domain::UNIX, Type::STREAM, None).unwrap();
        socket.bind(&SockAddr::unix(&path).unwrap()).unwrap();
        socket.listen(0).unwrap();
        // Connections the listener never accepts, until one is refused for want of room.
        let mut queued = Vec::new();
        let full = loop {
            assert!(queued.len() < 1024, "the backlog never filled");
            let client = Socket::new(Domain::UNIX, Type::STREAM, None).unwrap();
            client.set_nonblocking(true).unwrap();
            match client.connect(&SockAddr::unix(&path).unwrap()) {
                Ok(()) => queued.push(client),
                Err(error) => break error,
            }
        };
        assert_eq!(full.kind(), io::ErrorKind::WouldBlock, "{full}");
        let started = std::time::Instant::now();
        let error = query_within(&path, Duration::from_millis(200)).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(matches!(error, StatusError::Timeout { .. }), "{error:?}");
    }

    #[test]
    fn a_refusal_reaches_the_terminal_escaped() {
        let refused = StatusError::Refused {
            path: "/run/p.sock".into(),
            code: Code::OtherUser,
            reason: "no\x1b[2J".into(),
        };
        assert_eq!(
            refused.to_string(),
            "the supervisor on /run/p.sock refused: no\\x1b[2J"
        );
    }
}
