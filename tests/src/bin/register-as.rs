//! Test fixture: a registration client that claims whatever it is told to, for the tests that check
//! who a supervisor admits (`tests/tests/privileges.rs`).
//!
//! `register-as [--stay SECS] ATTEMPT...` makes each attempt in turn, on a connection of its own, and
//! prints one line per attempt on stdout:
//!
//! ```text
//! register-as: uid U pid P: SERVICE/INDEX as pid C on SOCKET: OUTCOME
//! ```
//!
//! where OUTCOME is `registered as HOSTNAME`, `refused CODE: REASON` (CODE as the protocol names it,
//! e.g. `CODE_NOT_OURS`), `closed without an answer` or
//! `cannot connect: ERROR`. An ATTEMPT is `SOCKET,SERVICE,INDEX` or `SOCKET,SERVICE,INDEX,PID`,
//! optionally followed by `@ADDRESS`: register on the Unix socket SOCKET (`-`: the one in
//! `PEREGRINE_CONTROL_SOCKET`, as a worker would) as worker INDEX of SERVICE, process PID (this
//! process when left out), listening on ADDRESS (`IP:PORT`, or `listen`: a listener this process
//! binds on `127.0.0.1:0` and keeps; `127.0.0.1:9` when left out). A registered connection is kept
//! open until the process exits. With `--stay`, the process then sleeps SECS seconds (a worker that
//! exited at once would only be started again).

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener},
    os::unix::net::UnixStream,
    path::PathBuf,
    time::Duration,
};

use anyhow::{Context, bail};
use bytes::BytesMut;
use peregrine_proto::{
    decode_frame, encode,
    v1::{self, SupervisorMessage, WorkerMessage, supervisor_message, worker_message},
};

const USAGE: &str = "usage: register-as [--stay SECS] SOCKET,SERVICE,INDEX[,PID][@ADDRESS]...";

/// How long an answer may take.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// One claim to make.
#[derive(Debug)]
struct Attempt {
    socket: PathBuf,
    service: String,
    index: u32,
    pid: u32,
    address: SocketAddr,
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1).peekable();
    let mut stay = None;
    if args.peek().map(String::as_str) == Some("--stay") {
        args.next();
        let secs: u64 = args.next().context(USAGE)?.parse().context(USAGE)?;
        stay = Some(Duration::from_secs(secs));
    }
    // The listeners of `@listen` attempts, held until the process exits.
    let mut listeners = Vec::new();
    let attempts: Vec<Attempt> = args
        .map(|arg| parse(&arg, &mut listeners))
        .collect::<Result<_, _>>()?;
    if attempts.is_empty() {
        bail!(USAGE);
    }
    let uid = rustix::process::getuid().as_raw();
    let me = std::process::id();
    // Registered connections stay open: closing one deregisters it.
    let mut kept = Vec::new();
    for attempt in &attempts {
        let (outcome, stream) = match register(attempt) {
            Ok((outcome, stream)) => (outcome, stream),
            Err(error) => (format!("{error:#}"), None),
        };
        println!(
            "register-as: uid {uid} pid {me}: {}/{} as pid {} on {}: {outcome}",
            attempt.service,
            attempt.index,
            attempt.pid,
            attempt.socket.display()
        );
        kept.extend(stream);
    }
    std::io::stdout().flush()?;
    if let Some(stay) = stay {
        std::thread::sleep(stay);
    }
    drop((kept, listeners));
    Ok(())
}

/// `SOCKET,SERVICE,INDEX[,PID][@ADDRESS]`; a listener it binds (`@listen`) goes to `listeners`.
fn parse(arg: &str, listeners: &mut Vec<TcpListener>) -> anyhow::Result<Attempt> {
    let (arg, address) = match arg.rsplit_once('@') {
        Some((arg, "listen")) => {
            let listener = TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0")?;
            let address = listener.local_addr()?;
            listeners.push(listener);
            (arg, address)
        }
        Some((arg, address)) => (
            arg,
            address
                .parse()
                .with_context(|| format!("address in {arg:?}"))?,
        ),
        None => (arg, SocketAddr::from(([127, 0, 0, 1], 9))),
    };
    let parts: Vec<&str> = arg.split(',').collect();
    let (socket, service, index, pid) = match parts[..] {
        [socket, service, index] => (socket, service, index, None),
        [socket, service, index, pid] => (socket, service, index, Some(pid)),
        _ => bail!("{arg:?} is not SOCKET,SERVICE,INDEX[,PID][@ADDRESS]\n{USAGE}"),
    };
    let socket = match socket {
        "-" => std::env::var_os("PEREGRINE_CONTROL_SOCKET")
            .context("`-` names PEREGRINE_CONTROL_SOCKET, which is not set")?
            .into(),
        path => PathBuf::from(path),
    };
    Ok(Attempt {
        socket,
        service: service.to_owned(),
        index: index.parse().with_context(|| format!("index in {arg:?}"))?,
        pid: match pid {
            Some(pid) => pid.parse().with_context(|| format!("pid in {arg:?}"))?,
            None => std::process::id(),
        },
        address,
    })
}

/// Makes the attempt: what came of it, and the connection if it was registered.
fn register(attempt: &Attempt) -> anyhow::Result<(String, Option<UnixStream>)> {
    let mut stream = match UnixStream::connect(&attempt.socket) {
        Ok(stream) => stream,
        Err(error) => return Ok((format!("cannot connect: {error}"), None)),
    };
    stream.set_read_timeout(Some(ANSWER_TIMEOUT))?;
    let message = WorkerMessage {
        message: Some(worker_message::Message::Register(v1::Register {
            service: attempt.service.clone(),
            index: attempt.index,
            pid: attempt.pid,
            listener: Some(v1::Listener {
                name: attempt.service.clone(),
                scheme: "http".into(),
                protocols: vec![v1::Protocol::Http1 as i32],
                addresses: vec![v1::Address {
                    address: Some(v1::address::Address::Socket(v1::SocketAddress {
                        ip: attempt.address.ip().to_string(),
                        port: attempt.address.port().into(),
                    })),
                }],
            }),
        })),
    };
    if let Err(error) = stream.write_all(&encode(&message)) {
        return Ok((format!("closed without an answer ({error})"), None));
    }
    Ok(match read_answer(&mut stream)? {
        Some(supervisor_message::Message::Registered(registered)) => (
            format!("registered as {}", registered.hostname),
            Some(stream),
        ),
        Some(supervisor_message::Message::Refused(refused)) => {
            let code = refused.code().as_str_name();
            (format!("refused {code}: {}", refused.reason), None)
        }
        Some(other) => (format!("answered {other:?}"), None),
        None => ("closed without an answer".to_owned(), None),
    })
}

/// The supervisor's answer, or `None` when it closes the connection without one.
fn read_answer(stream: &mut UnixStream) -> anyhow::Result<Option<supervisor_message::Message>> {
    let mut buf = BytesMut::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(answer) = decode_frame::<SupervisorMessage>(&mut buf)? {
            return Ok(answer.message);
        }
        let n = match stream.read(&mut chunk) {
            Ok(n) => n,
            // A connection reset after a refusal is a close too.
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => 0,
            Err(error) => return Err(error).context("reading the answer"),
        };
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}
