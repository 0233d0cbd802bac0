//! Accepting: the accept loops, a slot per connection ([`super::slots`]), the TLS handshake and the
//! preface within the handshake timeout, and the throttled log lines of what was refused.

use std::{io, net::SocketAddr, sync::Arc, time::Duration};

use tokio::{
    io::AsyncReadExt,
    net::{TcpListener, TcpStream},
    sync::mpsc,
    time::Instant,
};
use tokio_stream::wrappers::ReceiverStream;

use super::{
    PREFACE,
    admitted::Admitted,
    conn::Conn,
    slots::{Full, Slot, Slots},
};
use crate::{config::GrpcLimits, throttle::Throttle, tls::server::ServerTls};

/// What every connection of the port shares: the slots and the throttled log lines.
#[derive(Debug)]
pub struct Admission {
    limits: GrpcLimits,
    slots: Arc<Slots>,
    logs: Logs,
    /// TLS, when the port has it (`[supervisor.tls]`): the handshake comes before the preface.
    tls: Option<Arc<ServerTls>>,
}

/// One throttle per kind of line: at most one line per 10 s each, with a count of the rest.
#[derive(Debug)]
struct Logs {
    port_full: Throttle,
    peer_full: Throttle,
    evicted_for_port: Throttle,
    evicted_for_peer: Throttle,
    no_preface: Throttle,
    accept_failed: Throttle,
}

impl Default for Logs {
    fn default() -> Self {
        let every = || Throttle::new(Duration::from_secs(10));
        Logs {
            port_full: every(),
            peer_full: every(),
            evicted_for_port: every(),
            evicted_for_peer: every(),
            no_preface: every(),
            accept_failed: every(),
        }
    }
}

// === impl Admission ===

impl Admission {
    /// Admission under `limits`, with at most `cap` connections (see
    /// [`connection_cap`](super::connection_cap)), and at most `limits.max_connections_per_peer` of
    /// them (no more than `cap`) from one address.
    pub fn new(limits: GrpcLimits, cap: usize) -> Arc<Self> {
        Self::with_tls(limits, cap, None)
    }

    /// [`Admission::new`], with every connection's TLS handshake done by `tls` when given.
    pub fn with_tls(limits: GrpcLimits, cap: usize, tls: Option<Arc<ServerTls>>) -> Arc<Self> {
        Arc::new(Admission {
            limits,
            slots: Slots::new(cap, limits.max_connections_per_peer),
            logs: Logs::default(),
            tls,
        })
    }

    /// How many connections are open (admitted, or still in their handshake).
    pub fn open(&self) -> usize {
        self.slots.held()
    }

    /// The connection cap.
    pub fn cap(&self) -> usize {
        self.slots.cap()
    }

    /// The cap of one address's connections in effect.
    pub fn per_peer_cap(&self) -> usize {
        self.slots.per_peer()
    }

    /// A slot for a new connection from `peer`, or `None` (logged) when it is refused.
    fn take_slot(&self, peer: SocketAddr) -> Option<Slot> {
        let (slot, evicted) = match self.slots.take(peer) {
            Ok(taken) => taken,
            Err(full) => {
                self.log_refused(peer, full);
                return None;
            }
        };
        if let Some((evicted, full)) = evicted {
            let (throttle, cap) = match full {
                Full::Port => (&self.logs.evicted_for_port, self.cap()),
                Full::Peer => (&self.logs.evicted_for_peer, self.per_peer_cap()),
            };
            if let Some(since_last_line) = throttle.allow() {
                tracing::info!(
                    %peer,
                    %evicted,
                    cap,
                    evicted_since_last_line = since_last_line,
                    "gRPC port: {}; the oldest connection that has not proved itself a client (no TLS \
                     handshake with a client certificate, or no client's request yet) was closed to make room",
                    match full {
                        Full::Port => "the cap of open connections is reached",
                        Full::Peer => "an address reached its cap of open connections",
                    }
                );
            }
        }
        Some(slot)
    }

    fn log_refused(&self, peer: SocketAddr, full: Full) {
        match full {
            Full::Port => {
                if let Some(held_back) = self.logs.port_full.allow() {
                    tracing::warn!(
                        %peer,
                        cap = self.cap(),
                        refused_since_last_line = held_back,
                        "gRPC port: connection refused, the cap of open connections is reached and \
                         every one has proved itself a client (supervisor.grpc_max_connections, or \
                         the open-file limit)"
                    );
                }
            }
            Full::Peer => {
                if let Some(held_back) = self.logs.peer_full.allow() {
                    tracing::warn!(
                        %peer,
                        cap = self.per_peer_cap(),
                        refused_since_last_line = held_back,
                        "gRPC port: connection refused, its address has its cap of open connections \
                         and every one has proved itself a client \
                         (supervisor.grpc_max_connections_per_peer)"
                    );
                }
            }
        }
    }
}

/// Accepts on every one of `listeners` and yields the connections admitted (see the module docs),
/// until the stream is dropped.
pub fn incoming(
    listeners: Vec<TcpListener>,
    admission: Arc<Admission>,
) -> ReceiverStream<io::Result<Admitted>> {
    let (tx, rx) = mpsc::channel(64);
    for listener in listeners {
        tokio::spawn(accept_loop(listener, admission.clone(), tx.clone()));
    }
    ReceiverStream::new(rx)
}

async fn accept_loop(
    listener: TcpListener,
    admission: Arc<Admission>,
    tx: mpsc::Sender<io::Result<Admitted>>,
) {
    let addr = listener.local_addr().ok();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = tx.closed() => return,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Typically EMFILE: the cap leaves descriptors for the rest of the supervisor, so
                // this is someone else's doing; wait a little rather than spin.
                if let Some(held_back) = admission.logs.accept_failed.allow() {
                    tracing::warn!(?addr, %error, held_back, "gRPC port: accept failed");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(slot) = admission.take_slot(peer) else {
            drop(stream);
            continue;
        };
        let (admission, tx) = (admission.clone(), tx.clone());
        tokio::spawn(async move {
            if let Some(admitted) = handshake(stream, peer, slot, &admission).await {
                let _ = tx.send(Ok(admitted)).await;
            }
        });
    }
}

/// Does the TLS handshake (when the port has TLS) and reads the preface, both within the handshake
/// timeout; `None` (and the connection closed) if either fails, the preface is not HTTP/2's, or the
/// slot goes to a newer connection meanwhile.
async fn handshake(
    stream: TcpStream,
    peer: SocketAddr,
    slot: Slot,
    admission: &Admission,
) -> Option<Admitted> {
    let conn = tokio::select! {
        () = slot.evicted() => {
            tracing::debug!(%peer, "gRPC port: connection in its handshake evicted for a new one, closing");
            return None;
        }
        conn = handshake_in_time(stream, peer, &slot, admission) => conn?,
    };
    Some(Admitted::new(
        conn,
        peer,
        slot,
        admission.limits.idle_timeout,
    ))
}

/// [`handshake`]'s TLS handshake and preface; a client certificate the CA signed proves the
/// connection at once.
async fn handshake_in_time(
    stream: TcpStream,
    peer: SocketAddr,
    slot: &Slot,
    admission: &Admission,
) -> Option<Conn> {
    let _ = stream.set_nodelay(true);
    let timeout = admission.limits.handshake_timeout;
    let deadline = Instant::now() + timeout;
    let late = || {
        if let Some(held_back) = admission.logs.no_preface.allow() {
            if admission.tls.is_some() {
                tracing::info!(%peer, ?timeout, held_back, "gRPC port: no TLS handshake and HTTP/2 preface in time, closing");
            } else {
                tracing::info!(%peer, ?timeout, held_back, "gRPC port: no HTTP/2 preface in time, closing");
            }
        }
    };
    let mut conn = match &admission.tls {
        None => Conn::Plain(stream),
        Some(tls) => match tokio::time::timeout_at(deadline, tls.accept(stream, peer)).await {
            Ok(Ok(stream)) => {
                if stream.get_ref().1.peer_certificates().is_some() {
                    slot.prover().prove();
                }
                Conn::Tls(Box::new(stream))
            }
            // Logged by the TLS side, which knows why.
            Ok(Err(_)) => return None,
            Err(_) => {
                late();
                return None;
            }
        },
    };
    let mut preface = [0u8; PREFACE.len()];
    match tokio::time::timeout_at(deadline, conn.read_exact(&mut preface)).await {
        Ok(Ok(_)) if &preface == PREFACE => Some(conn),
        Ok(Ok(_)) => {
            tracing::debug!(%peer, "gRPC port: not an HTTP/2 connection preface, closing");
            None
        }
        Ok(Err(error)) => {
            tracing::debug!(%peer, %error, "gRPC port: connection ended before its preface");
            None
        }
        Err(_) => {
            late();
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;
    use tokio_stream::StreamExt;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_connection_without_streams_times_out_and_one_with_a_stream_does_not() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            stream.write_all(PREFACE).await.unwrap();
            stream
        });
        let limits = GrpcLimits {
            idle_timeout: Duration::from_secs(5),
            // The paused clock jumps ahead while the test waits on sockets.
            handshake_timeout: Duration::from_secs(3600),
            ..GrpcLimits::default()
        };
        let admission = Admission::new(limits, 4);
        let mut incoming = incoming(vec![listener], admission.clone());
        let mut admitted = incoming.next().await.unwrap().unwrap();
        let _client = client.await.unwrap();
        assert_eq!(admission.open(), 1);
        let mut preface = [0u8; 24];
        admitted.read_exact(&mut preface).await.unwrap();
        assert_eq!(&preface, PREFACE, "the preface is replayed");
        // A stream is open for 20 s: no timeout meanwhile.
        let info = tonic::transport::server::Connected::connect_info(&admitted);
        let stream = info.streams.opened();
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(20), admitted.read(&mut byte)).await;
        assert!(read.is_err(), "still reading after 20 s: {read:?}");
        drop(stream);
        let started = Instant::now();
        let error = admitted.read(&mut byte).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(
            (Duration::from_secs(5)..Duration::from_secs(6)).contains(&started.elapsed()),
            "{:?}",
            started.elapsed()
        );
        drop(admitted);
        assert_eq!(admission.open(), 0, "the permit is back");
    }

    /// A connection to `addr` from the address `from` (any 127.0.0.0/8 address is this host's).
    async fn connect_from(from: [u8; 4], addr: SocketAddr) -> TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(SocketAddr::from((from, 0))).unwrap();
        socket.connect(addr).await.unwrap()
    }

    /// Whether the server closed `stream` (EOF or a reset) within a second.
    async fn closed(stream: &mut TcpStream) -> bool {
        let mut byte = [0u8; 1];
        match tokio::time::timeout(Duration::from_secs(1), stream.read(&mut byte)).await {
            Ok(Ok(0) | Err(_)) => true,
            Ok(Ok(_)) | Err(_) => false,
        }
    }

    /// Waits (5 s at most) until `admission` holds `n` connections.
    async fn wait_for_open(admission: &Admission, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while admission.open() != n {
            assert!(
                Instant::now() < deadline,
                "{} open, not {n}",
                admission.open()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    mod mutual_tls {
        use std::path::Path;

        use peregrine_e2e::pki::{ControlPlane, SERVER_NAME};
        use rustls::{ClientConfig, pki_types::ServerName};
        use tokio_rustls::{TlsConnector, client::TlsStream};

        use super::*;
        use crate::{
            config::{CertFiles, ServerTlsConfig},
            tls::pem,
        };

        fn server(plane: &ControlPlane) -> Arc<ServerTls> {
            ServerTls::load(&ServerTlsConfig {
                identity: CertFiles {
                    cert: plane.dir.join("server.pem"),
                    key: plane.dir.join("server.key"),
                },
                client_ca: Some(plane.dir.join("ca.pem")),
            })
            .unwrap()
        }

        fn envoy(dir: &Path) -> TlsConnector {
            let roots = pem::roots(&dir.join("ca.pem")).unwrap().store;
            let mut config = ClientConfig::builder_with_provider(crate::tls::provider())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_client_auth_cert(
                    pem::certificates(&dir.join("envoy.pem")).unwrap(),
                    pem::private_key(&dir.join("envoy.key")).unwrap(),
                )
                .unwrap();
            config.alpn_protocols = vec![b"h2".to_vec()];
            TlsConnector::from(Arc::new(config))
        }

        /// A client from `from` with Envoy's certificate that sends the preface, and its admitted
        /// connection.
        async fn client(
            connector: &TlsConnector,
            from: [u8; 4],
            addr: SocketAddr,
            incoming: &mut ReceiverStream<io::Result<Admitted>>,
        ) -> (TlsStream<TcpStream>, Admitted) {
            let name = ServerName::try_from(SERVER_NAME).unwrap();
            let stream = connect_from(from, addr).await;
            let mut tls = connector.connect(name, stream).await.unwrap();
            tls.write_all(PREFACE).await.unwrap();
            let admitted = tokio::time::timeout(Duration::from_secs(5), incoming.next())
                .await
                .expect("admitted in time")
                .unwrap()
                .unwrap();
            (tls, admitted)
        }

        #[tokio::test]
        async fn a_client_with_a_certificate_takes_the_place_of_silent_connections_never_the_reverse()
         {
            let dir = tempfile::tempdir().unwrap();
            let plane = ControlPlane::write(dir.path());
            let limits = GrpcLimits {
                max_connections_per_peer: 2,
                ..GrpcLimits::default()
            };
            let admission = Admission::with_tls(limits, 4, Some(server(&plane)));
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let mut incoming = incoming(vec![listener], admission.clone());

            // Silent connections: a third from 127.0.0.2 takes its first's place (two per address),
            // and two from 127.0.0.3 fill the port.
            let mut first = connect_from([127, 0, 0, 2], addr).await;
            let mut second = connect_from([127, 0, 0, 2], addr).await;
            wait_for_open(&admission, 2).await;
            let mut third = connect_from([127, 0, 0, 2], addr).await;
            assert!(closed(&mut first).await, "evicted for its address's cap");
            let mut others = Vec::new();
            for _ in 0..2 {
                others.push(connect_from([127, 0, 0, 3], addr).await);
            }
            wait_for_open(&admission, 4).await;

            // Envoy gets in, in place of the oldest silent one; and so do three more (two per address).
            let connector = envoy(&plane.dir);
            let mut clients = vec![client(&connector, [127, 0, 0, 1], addr, &mut incoming).await];
            assert!(closed(&mut second).await, "the oldest unproven connection");
            assert!(!closed(&mut third).await, "only one made room");
            for from in [1, 5, 5] {
                clients.push(client(&connector, [127, 0, 0, from], addr, &mut incoming).await);
            }
            assert!(closed(&mut third).await);
            for other in &mut others {
                assert!(closed(other).await);
            }
            assert_eq!(admission.open(), 4);

            // Every slot is a client's: a silent connection is refused, and evicts nobody.
            let mut late = connect_from([127, 0, 0, 2], addr).await;
            assert!(closed(&mut late).await, "refused");
            assert_eq!(admission.open(), 4);
            for (tls, _) in &mut clients {
                let mut byte = [0u8; 1];
                let read = tokio::time::timeout(Duration::from_millis(100), tls.read(&mut byte));
                assert!(read.await.is_err(), "a client's connection stays open");
            }
            drop(clients);
            wait_for_open(&admission, 0).await;
        }
    }

    #[tokio::test]
    async fn on_a_cleartext_port_a_connection_is_proven_by_a_clients_request_not_by_a_stream() {
        let limits = GrpcLimits {
            handshake_timeout: Duration::from_secs(60),
            ..GrpcLimits::default()
        };
        let admission = Admission::new(limits, 2);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = incoming(vec![listener], admission.clone());
        let mut clients = Vec::new();
        let mut admitted = Vec::new();
        for from in [2, 3] {
            let mut client = connect_from([127, 0, 0, from], addr).await;
            client.write_all(PREFACE).await.unwrap();
            clients.push(client);
            admitted.push(incoming.next().await.unwrap().unwrap());
        }
        // The server reads the replayed prefaces; both open a stream, and the first's carries a
        // client's request.
        let mut preface = [0u8; PREFACE.len()];
        for admitted in &mut admitted {
            admitted.read_exact(&mut preface).await.unwrap();
        }
        let info = tonic::transport::server::Connected::connect_info(&admitted[0]);
        let _streams: Vec<_> = admitted
            .iter()
            .map(|admitted| {
                tonic::transport::server::Connected::connect_info(admitted)
                    .streams
                    .opened()
            })
            .collect();
        info.proof().prove();
        // A third connection takes the second's slot.
        let _third = connect_from([127, 0, 0, 4], addr).await;
        let mut buf = [0u8; 64];
        let error = tokio::time::timeout(Duration::from_secs(1), admitted[1].read(&mut buf))
            .await
            .expect("the connection whose stream proved nothing is closed")
            .unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::ConnectionAborted);
        wait_for_open(&admission, 2).await;
        // The proven one stays.
        let pending = tokio::time::timeout(Duration::from_millis(100), admitted[0].read(&mut buf));
        assert!(pending.await.is_err(), "still open");
    }
}
