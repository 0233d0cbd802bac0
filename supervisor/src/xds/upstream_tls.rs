//! How Envoy dials a TLS gRPC port: the TLS context of the bootstrap's xDS cluster, and the one of
//! the ORCA streams to workers, which Envoy opens with the worker cluster's transport socket.
//!
//! Workers speak cleartext; the supervisor's port speaks TLS. Envoy 1.40 opens an ORCA stream with
//! the cluster's `transport_socket_matches` entry that `oob_reporting_config.
//! transport_socket_match_criteria` selects (or the cluster's default transport socket), so each
//! ORCA cluster carries one entry, [`ORCA_MATCH`], whose `match` no endpoint's metadata has: worker
//! traffic keeps the default (cleartext), ORCA streams get TLS.
//!
//! Both contexts name their certificates by the static secrets the bootstrap defines
//! ([`ENVOY_CERTIFICATE_SECRET`], [`SUPERVISOR_CA_SECRET`], whose home is the bootstrap): the
//! files' paths live in Envoy's bootstrap alone, and the clusters the supervisor sends name only
//! secrets.
//!
//! Invariant: the clusters never name a file, only the bootstrap's secrets.

use envoy_types::pb::{
    envoy::{
        extensions::transport_sockets::tls::v3::{
            CertificateValidationContext, CommonTlsContext, SdsSecretConfig, SubjectAltNameMatcher,
            UpstreamTlsContext,
            common_tls_context::{CombinedCertificateValidationContext, ValidationContextType},
            subject_alt_name_matcher::SanType,
        },
        r#type::matcher::v3::{StringMatcher, string_matcher::MatchPattern},
    },
    google::protobuf::{Struct, Value, value::Kind},
};

pub use crate::bootstrap::{ENVOY_CERTIFICATE_SECRET, SUPERVISOR_CA_SECRET, TLS_TRANSPORT_SOCKET};

/// The name of the ORCA entry of `transport_socket_matches`, and the key of its match.
pub const ORCA_MATCH: &str = "peregrine-orca";

/// Envoy's side of a TLS gRPC port, as the serving supervisor's `[envoy.tls]` says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvoyTls {
    /// The SNI Envoy sends and the DNS name it requires in the supervisor's certificate.
    pub server_name: String,
    /// Whether Envoy has a client certificate to present ([`ENVOY_CERTIFICATE_SECRET`]).
    pub client_certificate: bool,
}

/// The TLS context Envoy dials a supervisor's gRPC port with (ALPN h2, SNI and SAN
/// `server_name`, the CA and the certificate from the bootstrap's secrets).
pub fn upstream_tls_context(tls: &EnvoyTls) -> UpstreamTlsContext {
    let secret = |name: &str| SdsSecretConfig {
        name: name.into(),
        ..Default::default()
    };
    UpstreamTlsContext {
        sni: tls.server_name.clone(),
        common_tls_context: Some(CommonTlsContext {
            alpn_protocols: vec!["h2".into()],
            tls_certificate_sds_secret_configs: if tls.client_certificate {
                vec![secret(ENVOY_CERTIFICATE_SECRET)]
            } else {
                Vec::new()
            },
            validation_context_type: Some(ValidationContextType::CombinedValidationContext(
                CombinedCertificateValidationContext {
                    default_validation_context: Some(CertificateValidationContext {
                        match_typed_subject_alt_names: vec![SubjectAltNameMatcher {
                            san_type: SanType::Dns as i32,
                            matcher: Some(StringMatcher {
                                match_pattern: Some(MatchPattern::Exact(tls.server_name.clone())),
                                ..Default::default()
                            }),
                            ..Default::default()
                        }],
                        ..Default::default()
                    }),
                    validation_context_sds_secret_config: Some(secret(SUPERVISOR_CA_SECRET)),
                    ..Default::default()
                },
            )),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// `{ "peregrine-orca": true }`: the criteria that select the [`ORCA_MATCH`] entry of an ORCA
/// cluster's `transport_socket_matches` (and the entry's own match).
pub fn orca_match_criteria() -> Struct {
    Struct {
        fields: [(
            ORCA_MATCH.to_string(),
            Value {
                kind: Some(Kind::BoolValue(true)),
            },
        )]
        .into(),
    }
}
