//! The PEM files of every TLS side: certificate chains, private keys and CA bundles, read with an
//! error that names the file and what is wrong with it, and certificates described for logs.
//!
//! Invariant: a certificate and key are only ever used as a pair whose public keys match, and a
//! certificate that has expired (or is not valid yet) is refused when read, not when a peer finds
//! out.

use std::{
    fmt,
    path::{Path, PathBuf},
    sync::Arc,
    time::SystemTime,
};

use rustls::{RootCertStore, crypto::CryptoProvider, sign::CertifiedKey};
use rustls_pki_types::{
    CertificateDer, PrivateKeyDer,
    pem::{self, PemObject},
};

/// What is wrong with a TLS file.
#[derive(Debug, thiserror::Error)]
pub enum PemError {
    /// The file could not be read.
    #[error("{}: cannot read it: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file holds no certificate.
    #[error("{}: no certificate in it (expected PEM: -----BEGIN CERTIFICATE-----)", .0.display())]
    NoCertificate(PathBuf),
    /// The file holds no private key.
    #[error(
        "{}: no private key in it (expected PEM: PKCS#8, PKCS#1 (RSA) or SEC1 (EC))",
        .0.display()
    )]
    NoKey(PathBuf),
    /// The file is not PEM, or a section of it does not decode.
    #[error("{}: not a valid PEM file: {reason}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What the decoder said.
        reason: String,
    },
    /// A certificate cannot be parsed.
    #[error("{}: a certificate in it does not parse: {reason}", path.display())]
    BadCertificate {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        reason: String,
    },
    /// The certificate is outside its validity period.
    #[error("{}: {detail}", path.display())]
    OutOfDate {
        /// The file.
        path: PathBuf,
        /// The certificate, its validity and the time now.
        detail: String,
    },
    /// The key cannot be used (an unsupported algorithm), or is not the certificate's.
    #[error("{}: not the key of {}: {reason}", key.display(), cert.display())]
    KeyMismatch {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// What rustls said.
        reason: String,
    },
}

impl PemError {
    /// Whether this error of reading a certificate with its key (the file `key`) is the key's
    /// fault: no key, a key that is not the certificate's, or the key's file unreadable or
    /// malformed. Otherwise it is the certificate's.
    pub fn is_the_keys(&self, key: &Path) -> bool {
        match self {
            PemError::NoKey(_) | PemError::KeyMismatch { .. } => true,
            PemError::Read { path, .. } | PemError::Malformed { path, .. } => path == key,
            _ => false,
        }
    }
}

fn read(path: &Path) -> Result<Vec<u8>, PemError> {
    std::fs::read(path).map_err(|source| PemError::Read {
        path: path.to_owned(),
        source,
    })
}

/// The certificates of `path`, in order (a chain: leaf first).
pub fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, PemError> {
    certificates_in(path, &read(path)?)
}

/// The certificates in `bytes`, read from `path`.
fn certificates_in(path: &Path, bytes: &[u8]) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let certs = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, pem::Error>>()
        .map_err(|error| PemError::Malformed {
            path: path.to_owned(),
            reason: error.to_string(),
        })?;
    if certs.is_empty() {
        return Err(PemError::NoCertificate(path.to_owned()));
    }
    for cert in &certs {
        Summary::of(cert).map_err(|error| PemError::BadCertificate {
            path: path.to_owned(),
            reason: error.to_string(),
        })?;
    }
    Ok(certs)
}

/// The private key of `path`.
pub fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, PemError> {
    private_key_in(path, &read(path)?)
}

/// The private key in `bytes`, read from `path`.
fn private_key_in(path: &Path, bytes: &[u8]) -> Result<PrivateKeyDer<'static>, PemError> {
    match PrivateKeyDer::from_pem_slice(bytes) {
        Ok(key) => Ok(key),
        Err(pem::Error::NoItemsFound) => Err(PemError::NoKey(path.to_owned())),
        Err(error) => Err(PemError::Malformed {
            path: path.to_owned(),
            reason: error.to_string(),
        }),
    }
}

/// A CA bundle: its trust anchors, and the file's bytes (to tell a changed file, or to hand on).
#[derive(Debug)]
pub struct Roots {
    /// Every certificate of the file, as a trust anchor.
    pub store: RootCertStore,
    /// The file as read.
    pub pem: Vec<u8>,
}

/// The CA bundle of `path`: every certificate in it is a trust anchor.
pub fn roots(path: &Path) -> Result<Roots, PemError> {
    let pem = read(path)?;
    let mut store = RootCertStore::empty();
    for cert in certificates_in(path, &pem)? {
        store.add(cert).map_err(|error| PemError::BadCertificate {
            path: path.to_owned(),
            reason: error.to_string(),
        })?;
    }
    Ok(Roots { store, pem })
}

/// A certificate and its key, checked, with the files' bytes (to hand on).
#[derive(Debug)]
pub struct Pair {
    /// The pair as rustls uses it.
    pub key: Arc<CertifiedKey>,
    /// The certificate file as read.
    pub cert_pem: Vec<u8>,
    /// The key file as read.
    pub key_pem: Vec<u8>,
}

/// The certificate chain of `cert` with the key of `key`, checked to be a pair and valid now.
pub fn certified_key(cert: &Path, key: &Path, provider: &CryptoProvider) -> Result<Pair, PemError> {
    let cert_pem = read(cert)?;
    let chain = certificates_in(cert, &cert_pem)?;
    let leaf = Summary::of(&chain[0]).map_err(|error| PemError::BadCertificate {
        path: cert.to_owned(),
        reason: error.to_string(),
    })?;
    leaf.valid_at(SystemTime::now())
        .map_err(|(now, summary)| PemError::OutOfDate {
            path: cert.to_owned(),
            detail: format!(
                "{summary} is not valid now ({now}): valid from {} until {}",
                summary.not_before, summary.not_after
            ),
        })?;
    let key_pem = read(key)?;
    let private = private_key_in(key, &key_pem)?;
    let pair = CertifiedKey::from_der(chain, private, provider).map_err(|error| {
        PemError::KeyMismatch {
            cert: cert.to_owned(),
            key: key.to_owned(),
            reason: match error {
                rustls::Error::InconsistentKeys(_) => {
                    "its public key is not the one the certificate holds".into()
                }
                other => other.to_string(),
            },
        }
    })?;
    Ok(Pair {
        key: Arc::new(pair),
        cert_pem,
        key_pem,
    })
}

/// A certificate as a log line shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    /// Its subject (RFC 4514).
    pub subject: String,
    /// Its issuer (RFC 4514).
    pub issuer: String,
    /// Its serial number, in hex.
    pub serial: String,
    /// `notBefore`, RFC 2822.
    pub not_before: String,
    /// `notAfter`, RFC 2822.
    pub not_after: String,
    not_before_unix: i64,
    not_after_unix: i64,
}

/// Why a certificate's DER does not parse, as the X.509 parser says.
pub type CertificateParseError = x509_parser::nom::Err<x509_parser::error::X509Error>;

impl Summary {
    /// The summary of `der`, or why it does not parse.
    pub fn of(der: &CertificateDer<'_>) -> Result<Summary, CertificateParseError> {
        let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref())?;
        let validity = cert.validity();
        let time = |t: &x509_parser::time::ASN1Time| {
            t.to_rfc2822().unwrap_or_else(|_| t.timestamp().to_string())
        };
        Ok(Summary {
            subject: cert.subject().to_string(),
            issuer: cert.issuer().to_string(),
            serial: cert.raw_serial_as_string().replace(':', ""),
            not_before: time(&validity.not_before),
            not_after: time(&validity.not_after),
            not_before_unix: validity.not_before.timestamp(),
            not_after_unix: validity.not_after.timestamp(),
        })
    }

    /// `Ok` if valid at `now`; else the time as text and this summary.
    fn valid_at(&self, now: SystemTime) -> Result<(), (String, &Summary)> {
        let secs = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        if (self.not_before_unix..=self.not_after_unix).contains(&secs) {
            Ok(())
        } else {
            let text = x509_parser::time::ASN1Time::from_timestamp(secs)
                .ok()
                .and_then(|t| t.to_rfc2822().ok())
                .unwrap_or_else(|| secs.to_string());
            Err((text, self))
        }
    }

    /// Seconds from `now` until `notAfter` (negative once expired).
    pub fn seconds_left(&self, now: SystemTime) -> i64 {
        let secs = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        self.not_after_unix - secs
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "certificate \"{}\" (serial {}, issuer \"{}\")",
            self.subject, self.serial, self.issuer
        )
    }
}

#[cfg(test)]
mod tests {
    use rcgen::{CertificateParams, KeyPair};

    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn self_signed(days: std::ops::Range<i64>) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["peregrine".into()]).unwrap();
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now + time::Duration::days(days.start);
        params.not_after = now + time::Duration::days(days.end);
        let cert = params.self_signed(&key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    #[test]
    fn a_pair_is_read_and_described() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = self_signed(-1..30);
        let cert = write(dir.path(), "c.pem", &cert);
        let key = write(dir.path(), "c.key", &key);
        let pair = certified_key(&cert, &key, &crate::tls::provider()).unwrap();
        let summary = Summary::of(&pair.key.cert[0]).unwrap();
        assert!(summary.subject.contains("rcgen"), "{summary:?}");
        assert!(summary.seconds_left(SystemTime::now()) > 28 * 86_400);
    }

    #[test]
    fn every_mistake_names_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = self_signed(-1..30);
        let (_, other_key) = self_signed(-1..30);
        let (expired, expired_key) = self_signed(-30..-1);
        let cert = write(dir.path(), "c.pem", &cert);
        let key = write(dir.path(), "c.key", &key);
        let other_key = write(dir.path(), "other.key", &other_key);
        let expired = write(dir.path(), "old.pem", &expired);
        let expired_key = write(dir.path(), "old.key", &expired_key);
        let empty = write(dir.path(), "empty.pem", "nothing here\n");
        let broken = write(
            dir.path(),
            "broken.pem",
            "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n",
        );
        let provider = crate::tls::provider();
        let message = |cert: &Path, key: &Path| {
            certified_key(cert, key, &provider)
                .map(|_| ())
                .unwrap_err()
                .to_string()
        };
        let got = message(&dir.path().join("absent.pem"), &key);
        assert!(got.contains("absent.pem: cannot read it"), "{got}");
        let got = message(&empty, &key);
        assert!(got.contains("empty.pem: no certificate"), "{got}");
        let got = message(&broken, &key);
        assert!(got.contains("broken.pem: not a valid PEM file"), "{got}");
        let got = message(&cert, &empty);
        assert!(got.contains("empty.pem: no private key"), "{got}");
        let got = message(&cert, &other_key);
        assert!(got.contains("other.key: not the key of"), "{got}");
        let got = message(&expired, &expired_key);
        assert!(
            got.contains("old.pem: certificate") && got.contains("is not valid now"),
            "{got}"
        );
        assert!(roots(&cert).is_ok());
    }
}
