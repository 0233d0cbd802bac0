//! `peregrine tls init DIR`: a test CA and certificates for a demo fleet, so that TLS can be tried in
//! one command.
//!
//! Two trust domains, as a real deployment keeps them: the control plane's CA (`ca.pem`) signs the
//! supervisors' server certificate (`server.pem`, for the gRPC port: xDS and ORCA) and Envoy's client
//! certificate (`envoy.pem`); etcd's CA (`etcd-ca.pem`) signs etcd's server certificate
//! (`etcd-server.pem`), the certificate etcd's members present to one another (`etcd-peer.pem`,
//! for both ends of a peer connection) and the supervisors' client certificate for etcd
//! (`etcd-client.pem`). Every
//! key is ECDSA P-256 in PKCS#8 PEM beside its certificate (`*.key`), readable by its owner only.
//! Server and peer certificates name `peregrine` (the SNI Envoy sends by default), `localhost`, the
//! loopback addresses and every name or address asked for.
//!
//! These are test certificates: the CAs' keys sit beside them and they never expire. Real ones come
//! from the operator's own CA (docs/tls.md, "Real certificates").
//!
//! Invariant: nothing is overwritten; a directory that already holds any of the files is refused
//! before anything is written.

use std::{
    fs::OpenOptions,
    io::Write,
    net::IpAddr,
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

/// The SNI and SAN a supervisor's certificate carries by default (`[envoy.tls] server_name`).
pub const SERVER_NAME: &str = crate::config::DEFAULT_SERVER_NAME;

/// Why the files could not be written.
#[derive(Debug, thiserror::Error)]
pub enum TlsInitError {
    /// A file this would write is there already.
    #[error("{} exists: remove it (or choose another directory); nothing was written", .0.display())]
    Exists(PathBuf),
    /// A name asked for is neither a DNS name nor an IP address.
    #[error("--san {0:?}: not a DNS name or an IP address")]
    BadName(String),
    /// The certificates could not be made.
    #[error("cannot make the certificates")]
    Certificate(#[from] rcgen::Error),
    /// A file could not be written.
    #[error("cannot write {}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// What a certificate is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// A server: it names the hosts (`--san`), for server authentication.
    Server,
    /// A client: it names itself, for client authentication.
    Client,
    /// An etcd member to the others: it names the hosts, for both ends of a connection.
    Peer,
}

/// One certificate to make: its file stem, who it is, what it is for.
struct Leaf {
    stem: &'static str,
    common_name: &'static str,
    role: Role,
}

/// The leaves under each CA (its file stem first).
const DOMAINS: [(&str, &str, &[Leaf]); 2] = [
    (
        "ca",
        "Peregrine test CA (control plane)",
        &[
            Leaf {
                stem: "server",
                common_name: SERVER_NAME,
                role: Role::Server,
            },
            Leaf {
                stem: "envoy",
                common_name: "envoy",
                role: Role::Client,
            },
        ],
    ),
    (
        "etcd-ca",
        "Peregrine test CA (etcd)",
        &[
            Leaf {
                stem: "etcd-server",
                common_name: "etcd",
                role: Role::Server,
            },
            Leaf {
                stem: "etcd-peer",
                common_name: "etcd-peer",
                role: Role::Peer,
            },
            Leaf {
                stem: "etcd-client",
                common_name: "peregrine",
                role: Role::Client,
            },
        ],
    ),
];

/// Writes both CAs and their certificates into `dir` (made if missing); server certificates also
/// name every entry of `sans` (DNS names or IP addresses: the hosts supervisors and etcd run on).
/// Returns the files written.
pub fn init(dir: &Path, sans: &[String]) -> Result<Vec<PathBuf>, TlsInitError> {
    let mut server_names = vec![
        SanType::DnsName(SERVER_NAME.try_into()?),
        SanType::DnsName("localhost".try_into()?),
        SanType::IpAddress(IpAddr::from([127, 0, 0, 1])),
        SanType::IpAddress(IpAddr::from(std::net::Ipv6Addr::LOCALHOST)),
    ];
    for name in sans {
        let san = match name.parse::<IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(
                name.as_str()
                    .try_into()
                    .map_err(|_| TlsInitError::BadName(name.clone()))?,
            ),
        };
        if !server_names.contains(&san) {
            server_names.push(san);
        }
    }
    let stems = DOMAINS
        .iter()
        .flat_map(|(ca, _, leaves)| std::iter::once(*ca).chain(leaves.iter().map(|l| l.stem)));
    let files = stems
        .flat_map(|stem| [format!("{stem}.pem"), format!("{stem}.key")])
        .map(|name| dir.join(name))
        .collect::<Vec<_>>();
    if let Some(there) = files.iter().find(|f| f.exists()) {
        return Err(TlsInitError::Exists(there.clone()));
    }
    let mut contents = Vec::new();
    for (ca_stem, ca_name, leaves) in &DOMAINS {
        let ca_key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, *ca_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_key_pem = ca_key.serialize_pem();
        let ca = CertifiedIssuer::self_signed(params, ca_key)?;
        contents.push((*ca_stem, ca.pem(), ca_key_pem));
        for leaf in leaves.iter() {
            let key = KeyPair::generate()?;
            let mut params = CertificateParams::new(Vec::<String>::new())?;
            params
                .distinguished_name
                .push(DnType::CommonName, leaf.common_name);
            params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
            let (names, usages) = match leaf.role {
                Role::Server => (
                    server_names.clone(),
                    vec![ExtendedKeyUsagePurpose::ServerAuth],
                ),
                Role::Client => (
                    vec![SanType::DnsName(leaf.common_name.try_into()?)],
                    vec![ExtendedKeyUsagePurpose::ClientAuth],
                ),
                Role::Peer => (
                    server_names.clone(),
                    vec![
                        ExtendedKeyUsagePurpose::ServerAuth,
                        ExtendedKeyUsagePurpose::ClientAuth,
                    ],
                ),
            };
            params.subject_alt_names = names;
            params.extended_key_usages = usages;
            let cert = params.signed_by(&key, &ca)?;
            contents.push((leaf.stem, cert.pem(), key.serialize_pem()));
        }
    }
    std::fs::create_dir_all(dir).map_err(|source| TlsInitError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut written = Vec::new();
    for (stem, cert, key) in contents {
        for (name, text, mode) in [
            (format!("{stem}.pem"), cert, 0o644),
            (format!("{stem}.key"), key, 0o600),
        ] {
            let path = dir.join(name);
            write_new(&path, &text, mode).map_err(|source| TlsInitError::Write {
                path: path.clone(),
                source,
            })?;
            written.push(path);
        }
    }
    Ok(written)
}

/// Writes `text` to a new file `path` with permissions `mode` (never over an existing one).
fn write_new(path: &Path, text: &str, mode: u32) -> std::io::Result<()> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)?;
    file.write_all(text.as_bytes())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn writes_two_cas_with_their_certificates_and_owner_only_keys() {
        let dir = tempfile::tempdir().unwrap();
        let tls = dir.path().join("tls");
        let written = init(&tls, &["10.0.0.1".into(), "host-a".into()]).unwrap();
        assert_eq!(written.len(), 14, "{written:?}");
        for path in &written {
            let text = std::fs::read_to_string(path).unwrap();
            let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
            if path.extension().is_some_and(|e| e == "key") {
                assert!(text.starts_with("-----BEGIN PRIVATE KEY-----"), "{path:?}");
                assert_eq!(mode, 0o600, "{path:?}");
            } else {
                assert!(text.starts_with("-----BEGIN CERTIFICATE-----"), "{path:?}");
                assert_eq!(mode, 0o644, "{path:?}");
            }
        }
        // A second run refuses, and changes nothing.
        let before = std::fs::read(tls.join("ca.pem")).unwrap();
        let error = init(&tls, &[]).unwrap_err();
        assert!(matches!(error, TlsInitError::Exists(_)), "{error}");
        assert_eq!(std::fs::read(tls.join("ca.pem")).unwrap(), before);
    }

    #[test]
    fn a_name_that_is_neither_dns_nor_ip_is_refused_before_anything_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let tls = dir.path().join("tls");
        let error = init(&tls, &["hôte".into()]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "--san \"hôte\": not a DNS name or an IP address"
        );
        assert!(!tls.exists());
    }
}
