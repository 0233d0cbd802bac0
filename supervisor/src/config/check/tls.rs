//! The checks of the TLS tables: `[supervisor.tls]` (the gRPC port), `[envoy.tls]` (Envoy's side of
//! it, in the bootstrap) and `[cluster.tls]` (the etcd client).
//!
//! Invariant: the two sides of the gRPC port agree: `[supervisor.tls]` and `[envoy.tls]` come
//! together (an Envoy speaking TLS to a cleartext port, or the reverse, never connects), and a
//! supervisor that asks for client certificates has one for Envoy to present. Whether the files hold
//! what they should is checked by `peregrine check` (`tls::check_files`, each file at the key and
//! line recorded here as a [`NamedFile`]) and when the supervisor starts, not here: this layer reads
//! only the config's text.

use std::{ops::Range, path::PathBuf};

use toml::Spanned;

use super::Checker;
use crate::config::{
    CertFiles, EnvoyTlsConfig, EtcdTlsConfig, Line, NamedFile, ServerTlsConfig,
    error::line_of,
    files::absolute_in,
    raw::{RawClusterTls, RawEnvoyTls, RawServerTls},
};

/// `envoy.tls.server_name` when left out, and the name `peregrine tls init` gives supervisors.
pub const DEFAULT_SERVER_NAME: &str = "peregrine";

/// Whether `name` can be an SNI and a certificate's DNS name: labels of letters, digits and `-`,
/// joined by `.`, at most 253 characters.
fn dns_name(name: &str) -> bool {
    name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        })
}

impl Checker<'_> {
    /// A file key of table `table` (at `span`): required unless `optional`, not empty, taken from
    /// the config's directory.
    fn tls_file(
        &mut self,
        raw: Option<Spanned<String>>,
        table: &str,
        field: &str,
        span: &Range<usize>,
    ) -> Option<PathBuf> {
        let key = format!("{table}.{field}");
        match raw {
            None => {
                self.report(Some(span.clone()), key, "missing: the path of a PEM file");
                None
            }
            Some(path) if path.get_ref().is_empty() => {
                self.report(
                    Some(path.span()),
                    key,
                    "must not be empty: the path of a PEM file",
                );
                None
            }
            Some(path) => {
                let absolute = absolute_in(self.base, path.get_ref().as_ref());
                self.files.push(NamedFile {
                    key,
                    line: Line(line_of(self.source, path.span())),
                    path: absolute.clone(),
                });
                Some(absolute)
            }
        }
    }

    /// `cert` and `key` of `table`: both or neither (`None`), or both required.
    fn identity(
        &mut self,
        cert: Option<Spanned<String>>,
        key: Option<Spanned<String>>,
        table: &str,
        span: &Range<usize>,
        required: bool,
    ) -> Option<CertFiles> {
        if !required && cert.is_none() && key.is_none() {
            return None;
        }
        if !required && cert.is_none() != key.is_none() {
            let (given, missing) = if cert.is_some() {
                ("cert", "key")
            } else {
                ("key", "cert")
            };
            self.report(
                Some(span.clone()),
                format!("{table}.{missing}"),
                format!("missing: {table}.{given} is set, and a certificate needs its key"),
            );
            return None;
        }
        let cert = self.tls_file(cert, table, "cert", span);
        let key = self.tls_file(key, table, "key", span);
        Some(CertFiles {
            cert: cert?,
            key: key?,
        })
    }

    /// `[supervisor.tls]`.
    pub(super) fn server_tls(&mut self, raw: Spanned<RawServerTls>) -> Option<ServerTlsConfig> {
        let span = raw.span();
        let raw = raw.into_inner();
        let identity = self.identity(raw.cert, raw.key, "supervisor.tls", &span, true);
        let client_ca = match raw.client_ca {
            None => None,
            some => Some(self.tls_file(some, "supervisor.tls", "client_ca", &span)?),
        };
        Some(ServerTlsConfig {
            identity: identity?,
            client_ca,
        })
    }

    /// `[envoy.tls]`.
    pub(super) fn envoy_tls(&mut self, raw: Spanned<RawEnvoyTls>) -> Option<EnvoyTlsConfig> {
        let span = raw.span();
        let raw = raw.into_inner();
        let identity = self.identity(raw.cert, raw.key, "envoy.tls", &span, false);
        let ca = self.tls_file(raw.ca, "envoy.tls", "ca", &span);
        let server_name = self.valid(
            raw.server_name,
            "envoy.tls.server_name".into(),
            |name: &String| dns_name(name),
            "expected a DNS name (letters, digits, '-' and '.'): the SNI Envoy sends and the name it \
             requires in the supervisor's certificate",
            || DEFAULT_SERVER_NAME.into(),
        );
        Some(EnvoyTlsConfig {
            identity,
            ca: ca?,
            server_name,
        })
    }

    /// `[cluster.tls]`.
    pub(super) fn etcd_tls(&mut self, raw: Spanned<RawClusterTls>) -> Option<EtcdTlsConfig> {
        let span = raw.span();
        let raw = raw.into_inner();
        let identity = self.identity(raw.cert, raw.key, "cluster.tls", &span, false);
        let ca = self.tls_file(raw.ca, "cluster.tls", "ca", &span);
        Some(EtcdTlsConfig { ca: ca?, identity })
    }

    /// The two sides of the gRPC port agree (see the module's invariant). `supervisor` and `envoy`
    /// are the tables as written (their spans), checked or not.
    pub(super) fn tls_sides(
        &mut self,
        supervisor: Option<(Range<usize>, Option<&ServerTlsConfig>)>,
        envoy: Option<(Range<usize>, Option<&EnvoyTlsConfig>)>,
    ) {
        match (supervisor, envoy) {
            (Some((span, _)), None) => self.report(
                Some(span),
                "envoy.tls".into(),
                "missing: with [supervisor.tls], Envoy must dial the gRPC port over TLS too (and \
                 the ORCA clusters name its certificates): add [envoy.tls] with ca (and cert, key)",
            ),
            (None, Some((span, _))) => self.report(
                Some(span),
                "supervisor.tls".into(),
                "missing: [envoy.tls] makes Envoy speak TLS to the gRPC port, which is cleartext \
                 without [supervisor.tls] (cert, key)",
            ),
            (Some((span, Some(server))), Some((_, Some(envoy))))
                if server.client_ca.is_some() && envoy.identity.is_none() =>
            {
                self.report(
                    Some(span),
                    "envoy.tls.cert".into(),
                    "missing: supervisor.tls.client_ca requires a client certificate, and Envoy \
                     would present none: add envoy.tls.cert and envoy.tls.key",
                );
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use crate::config::testing::{parse, problems};

    const BOTH: &str = "[supervisor.tls]\ncert = \"tls/server.pem\"\nkey = \"tls/server.key\"\n\
                        client_ca = \"/etc/ca/ca.pem\"\n[envoy.tls]\ncert = \"tls/envoy.pem\"\n\
                        key = \"tls/envoy.key\"\nca = \"tls/ca.pem\"\n[service.a]\n";

    #[test]
    fn every_file_named_is_recorded_at_its_line_and_lines_change_no_meaning() {
        let config = parse(BOTH).unwrap();
        let named: Vec<(&str, usize)> = config
            .files
            .iter()
            .map(|file| (file.key.as_str(), file.line.0))
            .collect();
        assert_eq!(
            named,
            [
                ("supervisor.tls.cert", 2),
                ("supervisor.tls.key", 3),
                ("supervisor.tls.client_ca", 4),
                ("envoy.tls.cert", 6),
                ("envoy.tls.key", 7),
                ("envoy.tls.ca", 8),
            ]
        );
        let moved = parse(&format!("# a comment\n\n{BOTH}")).unwrap();
        assert_eq!(moved.files[0].line.0, 4);
        assert_eq!(moved, config, "the same config, written lower");
    }

    #[test]
    fn both_sides_of_the_grpc_port_with_paths_from_the_config_directory() {
        let config = parse(BOTH).unwrap();
        let server = config.supervisor.tls.unwrap();
        assert_eq!(
            server.identity.cert,
            PathBuf::from("/etc/peregrine/tls/server.pem")
        );
        assert_eq!(server.client_ca, Some(PathBuf::from("/etc/ca/ca.pem")));
        let envoy = config.envoy.tls.unwrap();
        assert_eq!(envoy.server_name, "peregrine", "the default");
        assert_eq!(envoy.ca, PathBuf::from("/etc/peregrine/tls/ca.pem"));
        assert_eq!(
            envoy.identity.unwrap().key,
            PathBuf::from("/etc/peregrine/tls/envoy.key")
        );
        let none = parse("[service.a]\n").unwrap();
        assert_eq!((none.supervisor.tls, none.envoy.tls), (None, None));
    }

    #[test]
    fn one_side_alone_is_refused_with_the_table_missing() {
        let got = problems("[supervisor.tls]\ncert = \"a\"\nkey = \"b\"\n[service.a]\n");
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(got[0].starts_with("line 1: envoy.tls: missing"), "{got:?}");
        let got = problems("[envoy.tls]\nca = \"a\"\n[service.a]\n");
        assert!(
            got[0].starts_with("line 1: supervisor.tls: missing"),
            "{got:?}"
        );
    }

    #[test]
    fn mutual_tls_needs_a_client_certificate_for_envoy() {
        let got = problems(
            "[supervisor.tls]\ncert = \"a\"\nkey = \"b\"\nclient_ca = \"c\"\n\
             [envoy.tls]\nca = \"c\"\n[service.a]\n",
        );
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(got[0].contains("envoy.tls.cert: missing"), "{got:?}");
        // Without client_ca, Envoy need not present one.
        parse(
            "[supervisor.tls]\ncert = \"a\"\nkey = \"b\"\n[envoy.tls]\nca = \"c\"\n[service.a]\n",
        )
        .unwrap();
    }

    #[test]
    fn every_tls_key_is_checked_with_its_line() {
        let got = problems(
            "[supervisor.tls]\ncert = \"\"\n\n[envoy.tls]\nkey = \"k\"\nca = \"c\"\n\
             server_name = \"not a name\"\n[service.a]\n",
        );
        for (line, key) in [
            (2, "supervisor.tls.cert: must not be empty"),
            (1, "supervisor.tls.key: missing"),
            (4, "envoy.tls.cert: missing: envoy.tls.key is set"),
            (7, "envoy.tls.server_name: expected a DNS name"),
        ] {
            assert!(
                got.iter()
                    .any(|p| p.starts_with(&format!("line {line}: {key}"))),
                "{key} on line {line}: {got:#?}"
            );
        }
        let got = problems("[supervisor.tls]\ncert = \"a\"\nkey = \"b\"\nkye = 1\n");
        assert!(got[0].contains("kye"), "{got:?}");
    }
}
