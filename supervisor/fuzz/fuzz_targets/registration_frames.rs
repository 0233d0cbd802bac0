//! Worker registration frames, from bytes on the control socket to an admitted worker: the input is
//! split into the reads a stream would deliver, the frames are decoded as the server decodes them, and
//! every decoded `WorkerMessage` goes through admission with a process table that has workers in it.
//!
//! Checked: nothing panics; the length prefix is read as protobuf's varint (what prost reads), and a
//! frame announced over the 64 KiB cap is refused as soon as its prefix is in, never waited for
//! (buffered); splitting the stream changes nothing that is decoded; an admitted registration comes
//! from the uid the table started its pid with, claims the peer's own pid and the slot the table started it in, has a
//! listener of known protocols (at least one, no duplicates) and valid addresses (an IP with a port in
//! 1..=65535, or an absolute Unix path; at least one), exactly the ones it sent; and it registers in
//! a registry of the table's services, whose resources then build.
#![no_main]

use std::{
    net::{IpAddr, SocketAddr},
    sync::{Arc, LazyLock},
};

use bytes::BytesMut;
use libfuzzer_sys::{arbitrary::Unstructured, fuzz_target};
use peregrine_proto::{
    FrameError, MAX_FRAME_LEN, decode_frame,
    v1::{self, WorkerMessage, worker_message},
};
use peregrine_supervisor::{
    children::{Child, Children, CounterRef, Counters, Slot},
    registration::{PeerCred, Refusal, Socket, admit_peer},
    registry::{Address, Protocol, Registry, WorkerState, hostname_for},
    xds::{cache::Cache, resources::ClusterOptions},
};

/// The supervisor's uid: this process's (a worker started without a `user` runs as it, and registers
/// on the control socket).
static OURS: LazyLock<u32> = LazyLock::new(|| rustix::process::geteuid().as_raw());

/// The process table: pid, service, index.
const TABLE: [(u32, &str, u32); 3] = [(4242, "web", 0), (4243, "web", 1), (7, "api", 3)];

static CHILDREN: LazyLock<Children> = LazyLock::new(|| {
    let counters = Arc::new(Counters::memfd(TABLE.len()).expect("a memfd"));
    let children = Children::default();
    for (lane, (pid, service, index)) in TABLE.into_iter().enumerate() {
        let slot = Slot {
            service: service.into(),
            index,
        };
        let counter = CounterRef::new(counters.clone(), lane);
        children.insert(
            pid,
            Child {
                slot,
                lane,
                counter,
                counts_requests: true,
                listen_port: None,
                uid: *OURS,
            },
        );
    }
    children
});

/// What a decoder made of a stream: each frame decoded, then how it ended.
#[derive(Debug, PartialEq)]
enum Outcome {
    Frame(WorkerMessage),
    /// The connection would be closed: the error's text.
    Closed(String),
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let cred = peer(&mut u);
    let cuts: Vec<usize> = (0..u.int_in_range(0..=8).unwrap_or(0))
        .map(|_| u.int_in_range(1..=300).unwrap_or(1))
        .collect();
    let bytes = u.take_rest();

    let split = decode_stream(bytes, &cuts);
    let whole = decode_stream(bytes, &[]);
    assert_eq!(split, whole, "the reads' sizes changed what was decoded");
    for outcome in split {
        if let Outcome::Frame(message) = outcome {
            check_admission(message, cred);
        }
    }
});

/// The peer's credentials: the supervisor's user or another, a pid of the table or not, or none.
fn peer(u: &mut Unstructured<'_>) -> PeerCred {
    let uid = if u.ratio(7, 8).unwrap_or(true) {
        *OURS
    } else {
        u.arbitrary().unwrap_or(0)
    };
    let pid = match u.int_in_range(0..=5).unwrap_or(0) {
        0..=3 => Some(TABLE[usize::from(u.int_in_range(0u8..=2).unwrap_or(0))].0 as i32),
        4 => None,
        _ => Some(u.arbitrary().unwrap_or(-1)),
    };
    PeerCred { uid, pid }
}

/// Decodes `bytes` as the server reads a connection, delivered in reads of the sizes in `cuts` (the
/// last repeated; all at once if none), until the stream ends or a frame is refused.
fn decode_stream(bytes: &[u8], cuts: &[usize]) -> Vec<Outcome> {
    let mut out = Vec::new();
    let mut buf = BytesMut::new();
    let mut rest = bytes;
    let mut reads = cuts
        .iter()
        .copied()
        .chain(std::iter::repeat(*cuts.last().unwrap_or(&usize::MAX)));
    while !rest.is_empty() {
        let (read, later) = rest.split_at(reads.next().unwrap_or(usize::MAX).min(rest.len()));
        rest = later;
        buf.extend_from_slice(read);
        loop {
            let before = buf.clone();
            match decode_frame::<WorkerMessage>(&mut buf) {
                Ok(Some(message)) => {
                    let (len, prefix) = prefix_of(&before).expect("a frame has a valid prefix");
                    assert!(len <= MAX_FRAME_LEN);
                    assert_eq!(
                        &before[prefix + len..],
                        &buf[..],
                        "exactly the frame is consumed"
                    );
                    out.push(Outcome::Frame(message));
                }
                Ok(None) => {
                    assert_eq!(before, buf, "nothing is consumed from an incomplete frame");
                    match prefix_of(&buf) {
                        Some((len, prefix)) => {
                            // Waiting for the rest of a frame: only ever one within the cap.
                            assert!(len <= MAX_FRAME_LEN, "waits for a frame of {len} bytes");
                            assert!(buf.len() < prefix + len);
                        }
                        None => assert!(
                            buf.len() < 10 && buf.iter().all(|b| b & 0x80 != 0),
                            "waits on a prefix that is whole or invalid: {:?}",
                            &buf[..buf.len().min(10)]
                        ),
                    }
                    break;
                }
                Err(error) => {
                    match &error {
                        FrameError::TooLong { len, limit } => {
                            assert_eq!(*limit, MAX_FRAME_LEN);
                            assert!(*len > MAX_FRAME_LEN);
                            assert_eq!(prefix_of(&before).map(|p| p.0), Some(*len));
                        }
                        FrameError::BadLength => assert!(
                            prefix_of(&before).is_none() && before.len() >= 10,
                            "a valid prefix refused: {:?}",
                            &before[..10.min(before.len())]
                        ),
                        FrameError::Invalid(_) => {
                            let (len, prefix) = prefix_of(&before).expect("a valid prefix");
                            assert!(len <= MAX_FRAME_LEN && before.len() >= prefix + len);
                        }
                    }
                    assert!(!error.to_string().is_empty());
                    out.push(Outcome::Closed(error.to_string()));
                    return out;
                }
            }
        }
    }
    // The server closes a connection that ends inside a frame; the frames before it stand.
    if !buf.is_empty() {
        out.push(Outcome::Closed("end of stream inside a frame".into()));
    }
    out
}

/// The length a whole, valid varint prefix of `buf` announces and the prefix's size, as protobuf
/// reads it (prost's own decoder); `None` if the prefix is not whole or not valid.
fn prefix_of(buf: &[u8]) -> Option<(usize, usize)> {
    let end = buf.iter().take(10).position(|b| b & 0x80 == 0)?;
    let mut prefix = &buf[..=end];
    let len = prost::decode_length_delimiter(&mut prefix).ok()?;
    Some((len, end + 1))
}

/// Runs `message` through admission from `cred` and checks what is admitted.
fn check_admission(message: WorkerMessage, cred: PeerCred) {
    let result = admit_peer(message.clone(), cred, &Socket::Control, &CHILDREN);
    let worker = match result {
        Ok(worker) => worker,
        Err(refusal) => {
            assert!(!refusal.to_string().is_empty());
            // The credentials are checked first, whatever the message.
            let pid = cred.pid.and_then(|p| u32::try_from(p).ok());
            match pid {
                None => assert!(matches!(refusal, Refusal::PidUnknown), "{refusal:?}"),
                Some(pid) if CHILDREN.child(pid).is_none() => {
                    assert!(matches!(refusal, Refusal::NotOurs(_)), "{refusal:?}")
                }
                Some(_) if cred.uid != *OURS => {
                    assert!(matches!(refusal, Refusal::NotItsUser { .. }), "{refusal:?}")
                }
                Some(_) => {}
            }
            return;
        }
    };
    let Some(worker_message::Message::Register(register)) = message.message else {
        panic!("admitted a message that is no registration: {worker:?}");
    };
    let peer = u32::try_from(cred.pid.expect("admitted without a pid")).expect("a negative pid");
    assert_eq!(cred.uid, *OURS);
    assert_eq!(worker.pid, peer, "the peer's pid");
    assert_eq!(register.pid, peer, "the claimed pid is the peer's");
    let started = CHILDREN
        .slot_of(peer)
        .expect("admitted a process not in the table");
    assert_eq!(
        (register.service.as_str(), register.index),
        (started.service.as_str(), started.index)
    );
    assert_eq!(
        (worker.service.as_str(), worker.index),
        (started.service.as_str(), started.index)
    );
    assert_eq!(
        worker.hostname,
        hostname_for(&worker.service, worker.index, worker.pid)
    );
    assert_eq!(worker.state, WorkerState::Ready);
    assert!(worker.stalled.is_none());

    let wire = register.listener.expect("admitted without a listener");
    assert_eq!(worker.listener.name, wire.name);
    assert_eq!(worker.listener.scheme, wire.scheme);
    let protocols = &worker.listener.protocols;
    assert!(!protocols.is_empty(), "admitted without a protocol");
    for (i, protocol) in protocols.iter().enumerate() {
        assert!(!protocols[..i].contains(protocol), "a duplicate protocol");
        let wire_value = match protocol {
            Protocol::Http1 => v1::Protocol::Http1,
            Protocol::Http2 => v1::Protocol::Http2,
        } as i32;
        assert!(wire.protocols.contains(&wire_value));
    }
    for p in &wire.protocols {
        assert!(
            *p == v1::Protocol::Http1 as i32 || *p == v1::Protocol::Http2 as i32,
            "admitted unknown protocol {p}"
        );
    }
    assert!(
        !worker.listener.addresses.is_empty(),
        "admitted without an address"
    );
    assert_eq!(worker.listener.addresses.len(), wire.addresses.len());
    for (address, sent) in worker.listener.addresses.iter().zip(&wire.addresses) {
        match (address, &sent.address) {
            (Address::Tcp(addr), Some(v1::address::Address::Socket(s))) => {
                assert_ne!(addr.port(), 0, "admitted port 0");
                assert_eq!(u32::from(addr.port()), s.port);
                let ip: IpAddr = s.ip.parse().expect("admitted an invalid ip");
                assert_eq!(*addr, SocketAddr::new(ip, addr.port()));
            }
            (Address::Unix(path), Some(v1::address::Address::UnixPath(sent))) => {
                assert!(path.is_absolute(), "admitted a relative unix path {path:?}");
                assert_eq!(path.as_os_str(), sent.as_str());
            }
            other => panic!("admitted address differs from the one sent: {other:?}"),
        }
    }

    // What the caller does next: register it, and serve its endpoints.
    let registry = Registry::new(TABLE.map(|(_, service, _)| service.to_string()));
    registry
        .register(worker.clone())
        .expect("an admitted worker registers");
    let snapshot = registry.snapshot();
    assert_eq!(
        snapshot.services[&worker.service].instance(worker.index, worker.pid),
        Some(&worker)
    );
    let resources = Cache::new("e1".into(), ClusterOptions::default()).build(&snapshot);
    assert!(resources.endpoints.resources.contains_key(&worker.service));
}
