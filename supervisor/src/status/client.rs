//! The client side of `peregrine status` and the control commands: one request over the supervisor's
//! local socket, one answer, each step bounded by [`QUERY_TIMEOUT`].

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
        self, StatusRequest, SupervisorMessage, WorkerMessage, supervisor_message, worker_message,
    },
};

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
    /// Connecting, writing or reading failed otherwise.
    #[error("cannot ask the supervisor on {path}")]
    Io {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The supervisor refused to answer.
    #[error("the supervisor on {path} refused: {reason}")]
    Refused {
        /// The socket path.
        path: PathBuf,
        /// Its reason.
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
    let request = WorkerMessage {
        message: Some(worker_message::Message::Status(StatusRequest {})),
    };
    match ask(socket, &request, Some(QUERY_TIMEOUT))? {
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
    let path = socket.to_owned();
    let io_error = |source| StatusError::Io {
        path: path.clone(),
        source,
    };
    let mut stream = UnixStream::connect(socket).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => StatusError::NotRunning {
            path: path.clone(),
            source,
        },
        _ => io_error(source),
    })?;
    stream.set_read_timeout(read_timeout).map_err(io_error)?;
    stream
        .set_write_timeout(Some(QUERY_TIMEOUT))
        .map_err(io_error)?;
    stream.write_all(&encode(request)).map_err(io_error)?;
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
        let n = stream.read(&mut chunk).map_err(io_error)?;
        if n == 0 {
            return Err(StatusError::Malformed { path, source: None });
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    match answer.message {
        Some(supervisor_message::Message::Refused(refused)) => Err(StatusError::Refused {
            path,
            reason: refused.reason,
        }),
        Some(message) => Ok(message),
        None => Err(StatusError::Malformed { path, source: None }),
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
}
