//! Certificates for TLS tests: CAs and the leaves they sign, valid now, expired, or from another CA,
//! written as PEM files the way the supervisor, Envoy and etcd read them.

use std::{
    net::IpAddr,
    ops::Range,
    path::{Path, PathBuf},
};

use crate::config::{EnvoyTls, PeregrineToml, ServerTls};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

/// The DNS name supervisors' certificates carry (`[envoy.tls] server_name`'s default).
pub const SERVER_NAME: &str = "peregrine";

/// A certificate authority.
#[derive(Debug)]
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its key, PEM.
#[derive(Clone, Debug)]
pub struct Leaf {
    /// The certificate.
    pub cert: String,
    /// Its private key (PKCS#8).
    pub key: String,
}

/// What a leaf is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Usage {
    /// A server: named [`SERVER_NAME`], `localhost` and the loopback addresses.
    Server,
    /// A client.
    Client,
}

impl Ca {
    /// A new CA called `name`.
    pub fn new(name: &str) -> Ca {
        let key = KeyPair::generate().expect("a key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        Ca {
            issuer: CertifiedIssuer::self_signed(params, key).expect("a CA"),
        }
    }

    /// The CA's certificate.
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A leaf called `name`, valid now and for a year.
    pub fn leaf(&self, name: &str, usage: Usage) -> Leaf {
        self.leaf_valid(name, usage, -1..365)
    }

    /// A leaf valid over `days` (relative to now: `-30..-1` expired yesterday).
    pub fn leaf_valid(&self, name: &str, usage: Usage, days: Range<i64>) -> Leaf {
        let key = KeyPair::generate().expect("a key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let dns = |name: &str| SanType::DnsName(name.try_into().expect("a DNS name"));
        match usage {
            Usage::Server => {
                params.subject_alt_names = vec![
                    dns(SERVER_NAME),
                    dns("localhost"),
                    SanType::IpAddress(IpAddr::from([127, 0, 0, 1])),
                    SanType::IpAddress(IpAddr::from(std::net::Ipv6Addr::LOCALHOST)),
                ];
                params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
            }
            Usage::Client => {
                params.subject_alt_names = vec![dns(name)];
                params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
            }
        }
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now + time::Duration::days(days.start);
        params.not_after = now + time::Duration::days(days.end);
        let cert = params.signed_by(&key, &self.issuer).expect("signed");
        Leaf {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    /// Writes the CA's certificate to `dir/<stem>.pem`.
    pub fn write(&self, dir: &Path, stem: &str) -> PathBuf {
        let path = dir.join(format!("{stem}.pem"));
        std::fs::write(&path, self.pem()).expect("write the CA");
        path
    }
}

impl Leaf {
    /// Writes `dir/<stem>.pem` and `dir/<stem>.key` (owner-only); returns both paths.
    pub fn write(&self, dir: &Path, stem: &str) -> (PathBuf, PathBuf) {
        use std::os::unix::fs::PermissionsExt;
        let cert = dir.join(format!("{stem}.pem"));
        let key = dir.join(format!("{stem}.key"));
        std::fs::write(&cert, &self.cert).expect("write the certificate");
        std::fs::write(&key, &self.key).expect("write the key");
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        (cert, key)
    }
}

/// The control plane's certificates for a test, in one directory: `ca.pem`, `server.pem`/`.key`,
/// `envoy.pem`/`.key`, as `peregrine tls init` lays them out.
#[derive(Debug)]
pub struct ControlPlane {
    /// The directory.
    pub dir: PathBuf,
    /// The CA that signs both.
    pub ca: Ca,
}

impl ControlPlane {
    /// Writes a fresh set into `dir` (made if missing).
    pub fn write(dir: &Path) -> ControlPlane {
        std::fs::create_dir_all(dir).expect("the certificate directory");
        let ca = Ca::new("Peregrine test CA");
        ca.write(dir, "ca");
        ca.leaf(SERVER_NAME, Usage::Server).write(dir, "server");
        ca.leaf("envoy", Usage::Client).write(dir, "envoy");
        ControlPlane {
            dir: dir.to_owned(),
            ca,
        }
    }

    /// Sets `[supervisor.tls]` and `[envoy.tls]` of `config` to these files: mutual TLS.
    pub fn secure(&self, config: &mut PeregrineToml) {
        secure_control_plane(config, &self.dir);
    }
}

/// Sets `[supervisor.tls]` and `[envoy.tls]` of `config` for mutual TLS, with the control plane's
/// files in `dir` as [`ControlPlane::write`] and `peregrine tls init` lay them out.
pub fn secure_control_plane(config: &mut PeregrineToml, dir: &Path) {
    let path = |name: &str| Some(dir.join(name));
    config.supervisor.tls = Some(ServerTls {
        cert: path("server.pem"),
        key: path("server.key"),
        client_ca: path("ca.pem"),
    });
    config.envoy_mut().tls = Some(EnvoyTls {
        cert: path("envoy.pem"),
        key: path("envoy.key"),
        ca: path("ca.pem"),
        server_name: None,
    });
}

/// Runs `peregrine tls init DIR --san NAME...` with the binary `peregrine`, the command users run,
/// and panics with its output if it fails: a fleet's certificates, every server certificate naming
/// `sans`.
pub fn peregrine_tls_init(peregrine: &Path, dir: &Path, sans: &[String]) {
    let mut command = std::process::Command::new(peregrine);
    command.arg("tls").arg("init").arg(dir);
    for san in sans {
        command.arg("--san").arg(san);
    }
    let output = command.output().expect("peregrine tls init runs");
    assert!(
        output.status.success(),
        "peregrine tls init failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
