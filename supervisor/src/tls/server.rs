//! The gRPC port's TLS: the server's certificate, the client CA when it asks for client
//! certificates (mutual TLS), each handshake, and certificates rotated on disk without a restart.
//!
//! [`ServerTls`] holds the rustls configuration in effect. Every new connection takes the one in
//! effect when it arrives; a connection keeps what it was handshaken with until it closes, so a
//! rotation drops no stream. The files are looked at every [`WATCH_INTERVAL`] (their inode, size and
//! times) and on `peregrine reload`; a changed set that reads well replaces the configuration, one
//! that does not is logged and the old one stays (a half-written file is read again on the next
//! look).
//!
//! A refused handshake is logged with the peer's address and what was wrong, as the operator must act
//! on it: no certificate, one from another CA, an expired one, a client that is not speaking TLS, or
//! a client that refused ours. One line per kind per 10 s at most, with a count of the rest.
//!
//! Invariant: a client is admitted only by the configuration in effect when it connected; a file
//! that fails to read never replaces a working configuration.

use std::{
    cell::RefCell,
    collections::HashMap,
    fmt,
    net::SocketAddr,
    os::unix::fs::MetadataExt,
    path::Path,
    sync::{Arc, Mutex, RwLock},
    time::{Duration, SystemTime},
};

use rustls::{
    CertificateError, DigitallySignedStruct, DistinguishedName, Error as TlsError, ServerConfig,
    SignatureScheme,
    client::danger::HandshakeSignatureValid,
    server::{
        WebPkiClientVerifier,
        danger::{ClientCertVerified, ClientCertVerifier},
    },
    sign::{CertifiedKey, SingleCertAndKey},
};
use rustls_pki_types::{CertificateDer, UnixTime};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, server::TlsStream};

use super::pem::{self, PemError, Summary};
use crate::{config::ServerTlsConfig, printable::printable, throttle::Throttle};

/// How often the certificate files are looked at for a rotation.
pub const WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// A certificate that expires sooner than this is warned about when it is loaded.
const EXPIRY_WARNING: Duration = Duration::from_secs(7 * 24 * 3600);

/// Why the TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {source}")]
pub struct LoadError {
    /// The config key of the file at fault.
    pub key: &'static str,
    /// What is wrong with it.
    #[source]
    pub source: LoadCause,
}

/// What went wrong building the configuration.
#[derive(Debug, thiserror::Error)]
pub enum LoadCause {
    /// A file.
    #[error(transparent)]
    Pem(#[from] PemError),
    /// rustls refused what the files hold.
    #[error("{0}")]
    Rustls(String),
}

/// A file as `stat` sees it: device, inode, size, modification time (ns) and change time; `None`
/// when it cannot be read.
type Stamp = Option<(u64, u64, u64, i64, i64)>;

/// What the files held when they were read: a change of any of these is a rotation to look at.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Stamps(Vec<Stamp>);

impl Stamps {
    fn of(files: &ServerTlsConfig) -> Stamps {
        let paths = [
            Some(&files.identity.cert),
            Some(&files.identity.key),
            files.client_ca.as_ref(),
        ];
        Stamps(
            paths
                .into_iter()
                .flatten()
                .map(|path| {
                    std::fs::metadata(path).ok().map(|m| {
                        (
                            m.dev(),
                            m.ino(),
                            m.len(),
                            m.mtime_nsec() + m.mtime() * 1_000_000_000,
                            m.ctime(),
                        )
                    })
                })
                .collect(),
        )
    }
}

/// One configuration, as built from the files.
struct Built {
    config: Arc<ServerConfig>,
    /// The server certificate, for logs and to tell a real rotation from a touch.
    leaf: Summary,
    leaf_der: CertificateDer<'static>,
    /// The client CA file's bytes, when there is one.
    client_ca: Option<Vec<u8>>,
}

fn build(files: &ServerTlsConfig) -> Result<Built, LoadError> {
    let provider = super::provider();
    let certified: Arc<CertifiedKey> =
        pem::certified_key(&files.identity.cert, &files.identity.key, &provider)
            .map(|pair| pair.key)
            .map_err(|error| LoadError {
                key: if error.is_the_keys(&files.identity.key) {
                    "supervisor.tls.key"
                } else {
                    "supervisor.tls.cert"
                },
                source: error.into(),
            })?;
    let leaf_der = certified.cert[0].clone();
    let leaf = Summary::of(&leaf_der).map_err(|error| LoadError {
        key: "supervisor.tls.cert",
        source: LoadCause::Rustls(error.to_string()),
    })?;
    let rustls_error = |key| {
        move |error: TlsError| LoadError {
            key,
            source: LoadCause::Rustls(error.to_string()),
        }
    };
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(rustls_error("supervisor.tls.cert"))?;
    let (builder, client_ca) = match &files.client_ca {
        Some(path) => {
            let ca_error = |source: PemError| LoadError {
                key: "supervisor.tls.client_ca",
                source: source.into(),
            };
            let pem::Roots { store, pem: bytes } = pem::roots(path).map_err(ca_error)?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(store), provider)
                .build()
                .map_err(|error| LoadError {
                    key: "supervisor.tls.client_ca",
                    source: LoadCause::Rustls(error.to_string()),
                })?;
            (
                builder.with_client_cert_verifier(Arc::new(Recording(verifier))),
                Some(bytes),
            )
        }
        None => (builder.with_no_client_auth(), None),
    };
    let mut config = builder.with_cert_resolver(Arc::new(SingleCertAndKey::from(certified)));
    // gRPC is HTTP/2; Envoy offers h2 (and forces it on ORCA streams).
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Built {
        config: Arc::new(config),
        leaf,
        leaf_der,
        client_ca,
    })
}

/// Whether `files` build a configuration, as [`ServerTls::load`] would at start (for `peregrine
/// check`: nothing is logged).
pub fn check(files: &ServerTlsConfig) -> Result<(), LoadError> {
    build(files).map(drop)
}

/// What a reload did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reloaded {
    /// The files hold what is in effect already.
    Unchanged,
    /// A new server certificate or client CA is in effect for new connections.
    Replaced {
        /// The server certificate now served.
        certificate: String,
        /// Whether the client CA changed.
        client_ca_changed: bool,
    },
}

struct State {
    files: ServerTlsConfig,
    built: Built,
    /// The files' stamps when `built` was read, or when a read last failed (not read again until
    /// they change).
    stamps: Stamps,
}

/// The gRPC port's TLS: see the module docs.
pub struct ServerTls {
    state: RwLock<State>,
    refusals: Mutex<HashMap<&'static str, Throttle>>,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state.read().unwrap_or_else(|e| e.into_inner());
        f.debug_struct("ServerTls")
            .field("files", &state.files)
            .field("certificate", &state.built.leaf)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Reads `files`; an error names the config key of the file at fault and what is wrong.
    pub fn load(files: &ServerTlsConfig) -> Result<Arc<ServerTls>, LoadError> {
        let stamps = Stamps::of(files);
        let built = build(files)?;
        warn_if_expiring(&built.leaf, &files.identity.cert);
        tracing::info!(
            certificate = %built.leaf,
            not_after = %built.leaf.not_after,
            client_certificates = if files.client_ca.is_some() { "required" } else { "not asked for" },
            "gRPC port: TLS"
        );
        Ok(Arc::new(ServerTls {
            state: RwLock::new(State {
                files: files.clone(),
                built,
                stamps,
            }),
            refusals: Mutex::new(HashMap::new()),
        }))
    }

    /// The rustls configuration new connections get.
    fn current(&self) -> Arc<ServerConfig> {
        self.state
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .built
            .config
            .clone()
    }

    /// The server certificate in effect.
    pub fn certificate(&self) -> Summary {
        self.state
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .built
            .leaf
            .clone()
    }

    /// Reads the files again (those of `files` when given: a reloaded config may name others) and
    /// puts what they hold in effect for new connections. On an error nothing changes.
    pub fn reload(&self, files: Option<&ServerTlsConfig>) -> Result<Reloaded, LoadError> {
        let files = match files {
            Some(files) => files.clone(),
            None => self
                .state
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .files
                .clone(),
        };
        let stamps = Stamps::of(&files);
        let built = match build(&files) {
            Ok(built) => built,
            Err(error) => {
                // Not read again until the files change.
                self.state.write().unwrap_or_else(|e| e.into_inner()).stamps = stamps;
                return Err(error);
            }
        };
        let mut state = self.state.write().unwrap_or_else(|e| e.into_inner());
        let certificate_changed = built.leaf_der != state.built.leaf_der;
        let client_ca_changed = built.client_ca != state.built.client_ca;
        let files_changed = files != state.files;
        state.stamps = stamps;
        if !certificate_changed && !client_ca_changed && !files_changed {
            return Ok(Reloaded::Unchanged);
        }
        warn_if_expiring(&built.leaf, &files.identity.cert);
        let certificate = built.leaf.to_string();
        state.files = files;
        state.built = built;
        Ok(Reloaded::Replaced {
            certificate,
            client_ca_changed,
        })
    }

    /// Whether the files changed since they were last read.
    fn changed_on_disk(&self) -> bool {
        let state = self.state.read().unwrap_or_else(|e| e.into_inner());
        Stamps::of(&state.files) != state.stamps
    }

    /// Looks at the files every [`WATCH_INTERVAL`] and reloads them when they change, until every
    /// other holder of `self` has dropped it (or the task is aborted).
    pub fn spawn_watch(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let tls = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(WATCH_INTERVAL);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let Some(tls) = tls.upgrade() else {
                    return;
                };
                if !tls.changed_on_disk() {
                    continue;
                }
                // Off the runtime's threads: a few file reads and a key parse.
                let result = tokio::task::spawn_blocking(move || tls.reload(None)).await;
                match result {
                    Ok(Ok(reloaded)) => log_reloaded(&reloaded, "the files changed"),
                    Ok(Err(error)) => tracing::error!(
                        %error,
                        "gRPC port: the TLS files changed but cannot be used; new connections \
                         keep the certificate in effect (read again when the files change)"
                    ),
                    Err(join) => {
                        tracing::error!(error = %join, "gRPC port: TLS reload task failed")
                    }
                }
            }
        })
    }

    /// The TLS handshake of `stream` from `peer`, with the configuration in effect now; a refusal is
    /// logged (see the module docs) and returned.
    pub async fn accept(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
    ) -> Result<TlsStream<TcpStream>, Refusal> {
        let mut first = [0u8; 1];
        if let Ok(1) = stream.peek(&mut first).await
            && first[0] != TLS_HANDSHAKE_RECORD
        {
            let refusal = Refusal::NotTls {
                http2: first[0] == b'P',
            };
            self.log(&refusal, peer);
            return Err(refusal);
        }
        let acceptor = TlsAcceptor::from(self.current());
        let (result, presented) = PRESENTED
            .scope(RefCell::new(None), async {
                let result = acceptor.accept(stream).await;
                (result, PRESENTED.with(|p| p.borrow_mut().take()))
            })
            .await;
        match result {
            Ok(stream) => {
                if let Some(cert) = stream
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first())
                    && let Ok(summary) = Summary::of(cert)
                {
                    tracing::debug!(%peer, client = %printable(&summary.subject), "gRPC port: TLS client admitted");
                }
                Ok(stream)
            }
            Err(error) => {
                let refusal = Refusal::from_handshake(&error, presented.as_ref());
                self.log(&refusal, peer);
                Err(refusal)
            }
        }
    }

    fn log(&self, refusal: &Refusal, peer: SocketAddr) {
        if matches!(refusal, Refusal::Closed(_)) {
            tracing::debug!(%peer, refusal = %printable(&refusal.to_string()), "gRPC port: TLS handshake ended");
            return;
        }
        let mut refusals = self.refusals.lock().unwrap_or_else(|e| e.into_inner());
        let throttle = refusals
            .entry(refusal.kind())
            .or_insert_with(|| Throttle::new(Duration::from_secs(10)));
        let kind = refusal.kind();
        if let Some(held_back) = throttle.allow() {
            // The certificate it names is the client's: escaped.
            let refusal = printable(&refusal.to_string()).into_owned();
            tracing::warn!(%peer, kind, held_back, "gRPC port: TLS client refused: {refusal}");
        }
    }
}

fn log_reloaded(reloaded: &Reloaded, why: &str) {
    match reloaded {
        Reloaded::Unchanged => {
            tracing::debug!(why, "gRPC port: TLS files read again, nothing new in them");
        }
        Reloaded::Replaced {
            certificate,
            client_ca_changed,
        } => tracing::info!(
            why,
            %certificate,
            client_ca_changed,
            "gRPC port: new TLS certificates in effect for new connections (open ones keep theirs)"
        ),
    }
}

/// Logs what [`ServerTls::reload`] did for `peregrine reload`.
pub fn log_reload(result: &Result<Reloaded, LoadError>) {
    match result {
        Ok(reloaded) => log_reloaded(reloaded, "reload"),
        Err(error) => {
            tracing::error!(%error, "gRPC port: the TLS files cannot be used; new connections keep the certificate in effect")
        }
    }
}

fn warn_if_expiring(leaf: &Summary, path: &Path) {
    let left = leaf.seconds_left(SystemTime::now());
    if left < EXPIRY_WARNING.as_secs() as i64 {
        tracing::warn!(
            file = %path.display(),
            certificate = %leaf,
            not_after = %leaf.not_after,
            hours_left = left / 3600,
            "gRPC port: the server certificate expires soon: put a new one in place (it is picked up without a restart)"
        );
    }
}

/// The first byte of a TLS handshake record (a ClientHello).
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

tokio::task_local! {
    /// The certificate the client presented in this task's handshake, recorded by [`Recording`]
    /// so that a refusal can say whose it was.
    static PRESENTED: RefCell<Option<CertificateDer<'static>>>;
}

/// Why a client was refused at the TLS handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No client certificate, where `client_ca` asks for one.
    NoCertificate,
    /// A certificate no CA in `client_ca` signed.
    OtherCa {
        /// The certificate, if it parsed.
        presented: Option<String>,
    },
    /// An expired certificate (or one not valid yet).
    OutOfDate {
        /// The certificate, if it parsed.
        presented: Option<String>,
        /// What rustls said (with the times).
        detail: String,
    },
    /// Some other fault in the client's certificate.
    BadCertificate {
        /// The certificate, if it parsed.
        presented: Option<String>,
        /// What rustls said.
        detail: String,
    },
    /// The client refused the supervisor's certificate (its alert).
    ClientRefusedOurs(String),
    /// The client does not speak TLS.
    NotTls {
        /// It sent the cleartext HTTP/2 preface.
        http2: bool,
    },
    /// Another protocol fault (versions, ciphers, ALPN).
    Protocol(String),
    /// The connection ended during the handshake (not worth a warning).
    Closed(String),
}

impl Refusal {
    /// The refusal a failed handshake is, given the certificate the client presented, if any.
    pub fn from_handshake(
        error: &std::io::Error,
        presented: Option<&CertificateDer<'_>>,
    ) -> Refusal {
        let presented = presented
            .and_then(|der| Summary::of(der).ok())
            .map(|s| format!("{s}, valid from {} until {}", s.not_before, s.not_after));
        let Some(tls) = error.get_ref().and_then(|e| e.downcast_ref::<TlsError>()) else {
            return Refusal::Closed(error.to_string());
        };
        match tls {
            TlsError::NoCertificatesPresented => Refusal::NoCertificate,
            TlsError::InvalidCertificate(CertificateError::UnknownIssuer) => {
                Refusal::OtherCa { presented }
            }
            TlsError::InvalidCertificate(
                reason @ (CertificateError::Expired
                | CertificateError::ExpiredContext { .. }
                | CertificateError::NotValidYet
                | CertificateError::NotValidYetContext { .. }),
            ) => Refusal::OutOfDate {
                presented,
                detail: TlsError::InvalidCertificate(reason.clone()).to_string(),
            },
            TlsError::InvalidCertificate(_) => Refusal::BadCertificate {
                presented,
                detail: tls.to_string(),
            },
            TlsError::AlertReceived(alert) => Refusal::ClientRefusedOurs(format!("{alert:?}")),
            other => Refusal::Protocol(other.to_string()),
        }
    }

    /// A short name of the kind, for the log's throttle and field.
    pub fn kind(&self) -> &'static str {
        match self {
            Refusal::NoCertificate => "no-certificate",
            Refusal::OtherCa { .. } => "other-ca",
            Refusal::OutOfDate { .. } => "expired",
            Refusal::BadCertificate { .. } => "bad-certificate",
            Refusal::ClientRefusedOurs(_) => "client-refused-ours",
            Refusal::NotTls { .. } => "not-tls",
            Refusal::Protocol(_) => "protocol",
            Refusal::Closed(_) => "closed",
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let presented = |p: &Option<String>| {
            p.clone()
                .unwrap_or_else(|| "a certificate that does not parse".into())
        };
        match self {
            Refusal::NoCertificate => f.write_str(
                "it presented no client certificate, and supervisor.tls.client_ca requires one \
                 (an Envoy without envoy.tls.cert?)",
            ),
            Refusal::OtherCa { presented: p } => write!(
                f,
                "it presented {}, which no CA in supervisor.tls.client_ca signed",
                presented(p)
            ),
            Refusal::OutOfDate {
                presented: p,
                detail,
            } => write!(
                f,
                "it presented an expired or not yet valid {}: {detail}",
                presented(p)
            ),
            Refusal::BadCertificate {
                presented: p,
                detail,
            } => write!(
                f,
                "it presented {}, which is not acceptable: {detail}",
                presented(p)
            ),
            Refusal::ClientRefusedOurs(alert) => write!(
                f,
                "it refused this supervisor's certificate (alert {alert}): check that its CA \
                 (envoy.tls.ca) signed supervisor.tls.cert and that the certificate names \
                 envoy.tls.server_name"
            ),
            Refusal::NotTls { http2: true } => f.write_str(
                "it sent cleartext HTTP/2 to a TLS port: an Envoy whose bootstrap has no \
                 [envoy.tls]?",
            ),
            Refusal::NotTls { http2: false } => f.write_str("it does not speak TLS"),
            Refusal::Protocol(detail) => write!(f, "TLS handshake failed: {detail}"),
            Refusal::Closed(detail) => {
                write!(f, "the connection ended during the handshake: {detail}")
            }
        }
    }
}

/// A client certificate verifier that records the presented certificate in [`PRESENTED`] before
/// it hands it to webpki's.
#[derive(Debug)]
struct Recording(Arc<dyn ClientCertVerifier>);

impl ClientCertVerifier for Recording {
    fn offer_client_auth(&self) -> bool {
        self.0.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.0.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.0.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, TlsError> {
        let _ = PRESENTED.try_with(|p| *p.borrow_mut() = Some(end_entity.clone().into_owned()));
        self.0.verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use peregrine_e2e::pki::{Ca, ControlPlane, SERVER_NAME, Usage};
    use rustls::{ClientConfig, pki_types::ServerName};
    use tokio::{
        io::AsyncWriteExt,
        net::{TcpListener, TcpStream},
    };
    use tokio_rustls::TlsConnector;

    use super::*;
    use crate::config::CertFiles;

    fn files(plane: &ControlPlane, mutual: bool) -> ServerTlsConfig {
        ServerTlsConfig {
            identity: CertFiles {
                cert: plane.dir.join("server.pem"),
                key: plane.dir.join("server.key"),
            },
            client_ca: mutual.then(|| plane.dir.join("ca.pem")),
        }
    }

    /// A client trusting `plane`'s CA, presenting `identity` if given.
    fn client(plane: &ControlPlane, identity: Option<(&Path, &Path)>) -> TlsConnector {
        let roots = pem::roots(&plane.dir.join("ca.pem")).unwrap().store;
        let builder = ClientConfig::builder_with_provider(crate::tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let mut config = match identity {
            Some((cert, key)) => builder
                .with_client_auth_cert(
                    pem::certificates(cert).unwrap(),
                    pem::private_key(key).unwrap(),
                )
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        TlsConnector::from(Arc::new(config))
    }

    /// One connection from `connector` (or cleartext bytes when `None`): what the server made of it,
    /// and the serial of the certificate the client saw.
    async fn handshake(
        tls: &ServerTls,
        connector: Option<TlsConnector>,
    ) -> (Result<(), Refusal>, Option<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            match connector {
                None => {
                    stream.write_all(crate::grpc_port::PREFACE).await.unwrap();
                    None
                }
                Some(connector) => {
                    let name = ServerName::try_from(SERVER_NAME).unwrap();
                    let mut tls = connector.connect(name, stream).await.ok()?;
                    // TLS 1.3: the server judges the client's certificate after the client is done;
                    // a write and a read make the client wait for that.
                    let _ = tls.write_all(b"x").await;
                    let mut byte = [0u8; 1];
                    let _ = tokio::io::AsyncReadExt::read(&mut tls, &mut byte).await;
                    let serial = tls.get_ref().1.peer_certificates()?.first().cloned()?;
                    Some(Summary::of(&serial).unwrap().serial)
                }
            }
        });
        let (stream, peer) = listener.accept().await.unwrap();
        let result = tls.accept(stream, peer).await.map(drop);
        // The client's read ends when the server's side closes.
        (result, client.await.unwrap())
    }

    #[tokio::test]
    async fn a_client_with_a_certificate_from_the_ca_is_admitted_and_every_other_refused() {
        let dir = tempfile::tempdir().unwrap();
        let plane = ControlPlane::write(dir.path());
        let tls = ServerTls::load(&files(&plane, true)).unwrap();
        let envoy = (plane.dir.join("envoy.pem"), plane.dir.join("envoy.key"));
        let good = client(&plane, Some((&envoy.0, &envoy.1)));
        let (result, serial) = handshake(&tls, Some(good)).await;
        assert_eq!(result, Ok(()));
        assert_eq!(serial, Some(tls.certificate().serial));

        let (result, _) = handshake(&tls, Some(client(&plane, None))).await;
        assert_eq!(result, Err(Refusal::NoCertificate));

        let other = Ca::new("Someone else's CA").leaf("intruder", Usage::Client);
        let other = other.write(dir.path(), "intruder");
        let (result, _) = handshake(&tls, Some(client(&plane, Some((&other.0, &other.1))))).await;
        let Err(Refusal::OtherCa {
            presented: Some(presented),
        }) = &result
        else {
            panic!("{result:?}");
        };
        assert!(presented.contains("CN=intruder"), "{presented}");
        assert!(
            result
                .unwrap_err()
                .to_string()
                .contains("which no CA in supervisor.tls.client_ca signed")
        );

        let expired = plane.ca.leaf_valid("old-envoy", Usage::Client, -30..-1);
        let expired = expired.write(dir.path(), "expired");
        let (result, _) =
            handshake(&tls, Some(client(&plane, Some((&expired.0, &expired.1))))).await;
        let Err(refusal @ Refusal::OutOfDate { .. }) = &result else {
            panic!("{result:?}");
        };
        assert!(refusal.to_string().contains("CN=old-envoy"), "{refusal}");

        // A server's certificate from the right CA, presented as a client's.
        let wrong_use = plane.ca.leaf("a-server", Usage::Server);
        let wrong_use = wrong_use.write(dir.path(), "wrong-use");
        let (result, _) = handshake(
            &tls,
            Some(client(&plane, Some((&wrong_use.0, &wrong_use.1)))),
        )
        .await;
        let Err(refusal @ Refusal::BadCertificate { .. }) = &result else {
            panic!("{result:?}");
        };
        let text = refusal.to_string();
        assert!(
            text.starts_with("it presented certificate \"CN=a-server\"")
                && text.contains(", which is not acceptable: ")
                && !text.contains("certificate certificate"),
            "{text}"
        );

        let (result, _) = handshake(&tls, None).await;
        assert_eq!(result, Err(Refusal::NotTls { http2: true }));
    }

    #[tokio::test]
    async fn new_files_are_used_for_new_connections_and_bad_ones_change_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let plane = ControlPlane::write(dir.path());
        let tls = ServerTls::load(&files(&plane, false)).unwrap();
        let first = tls.certificate();
        assert!(!tls.changed_on_disk());
        assert_eq!(tls.reload(None).unwrap(), Reloaded::Unchanged);

        // A key that is not the certificate's: refused, the old pair stays.
        let stray = plane.ca.leaf(SERVER_NAME, Usage::Server);
        std::fs::write(plane.dir.join("server.key"), &stray.key).unwrap();
        assert!(tls.changed_on_disk());
        let error = tls.reload(None).unwrap_err();
        assert_eq!(error.key, "supervisor.tls.key", "{error}");
        assert!(
            !tls.changed_on_disk(),
            "not read again until the files change"
        );
        assert_eq!(tls.certificate(), first);
        let (result, serial) = handshake(&tls, Some(client(&plane, None))).await;
        assert_eq!((result, serial), (Ok(()), Some(first.serial.clone())));

        // The matching certificate arrives: in effect for the next connection.
        std::fs::write(plane.dir.join("server.pem"), &stray.cert).unwrap();
        assert!(tls.changed_on_disk());
        let Reloaded::Replaced {
            client_ca_changed, ..
        } = tls.reload(None).unwrap()
        else {
            panic!("a new certificate");
        };
        assert!(!client_ca_changed);
        let second = tls.certificate();
        assert_ne!(second.serial, first.serial);
        let (result, serial) = handshake(&tls, Some(client(&plane, None))).await;
        assert_eq!((result, serial), (Ok(()), Some(second.serial)));
    }
}
