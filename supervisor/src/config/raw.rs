//! The serde mirror of `peregrine.toml`: one struct per table, field for field its keys, and nothing
//! checked beyond the types serde checks.
//!
//! Invariant: unknown keys are errors (`deny_unknown_fields` on every table), and each value that a
//! later check may reject is kept [`Spanned`], so that [`check`](super::check) can name its line. A
//! file that does not fit this mirror yields exactly one [`Problem`]: serde stops at the first.

use std::{collections::BTreeMap, ops::Range};

use serde::Deserialize;
use toml::{
    Spanned,
    de::{DeTable, DeValue},
};

use super::{error::Problem, wording};
use crate::printable::is_bidi_control;

// Each table has its own struct though their shapes repeat: `deny_unknown_fields` then names a
// misspelt key within its own table, the defaults stay per table, and a shared generic shape (a map of
// spanned values) would lose the types serde checks.

/// The whole file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    #[serde(default)]
    pub(super) supervisor: RawSupervisor,
    #[serde(default)]
    pub(super) envoy: RawEnvoy,
    #[serde(default)]
    pub(super) service: BTreeMap<String, RawService>,
    #[serde(default)]
    pub(super) orca: RawOrca,
    pub(super) cluster: Option<Spanned<RawCluster>>,
    /// Where each `[service.NAME]` names its service: the span of the name as written (quoted or
    /// not), for a problem with the name itself. Serde gives map keys no span.
    #[serde(skip)]
    pub(super) service_names: BTreeMap<String, Range<usize>>,
}

/// `[cluster]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCluster {
    pub(super) etcd: Option<Spanned<Vec<String>>>,
    pub(super) host: Option<Spanned<String>>,
    pub(super) region: Option<Spanned<String>>,
    pub(super) zone: Option<Spanned<String>>,
    pub(super) lease_ttl_ms: Option<Spanned<i64>>,
    pub(super) prefix: Option<Spanned<String>>,
    pub(super) routing: Option<Spanned<String>>,
    pub(super) allow_insecure: Option<Spanned<bool>>,
    pub(super) allowed_networks: Option<Spanned<Vec<String>>>,
    pub(super) tls: Option<Spanned<RawClusterTls>>,
}

/// `[cluster.tls]`: the etcd client's TLS.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawClusterTls {
    pub(super) ca: Option<Spanned<String>>,
    pub(super) cert: Option<Spanned<String>>,
    pub(super) key: Option<Spanned<String>>,
}

/// `[supervisor.tls]`: the gRPC port's TLS.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServerTls {
    pub(super) cert: Option<Spanned<String>>,
    pub(super) key: Option<Spanned<String>>,
    pub(super) client_ca: Option<Spanned<String>>,
}

/// `[envoy.tls]`: Envoy's side of the gRPC port's TLS.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEnvoyTls {
    pub(super) cert: Option<Spanned<String>>,
    pub(super) key: Option<Spanned<String>>,
    pub(super) ca: Option<Spanned<String>>,
    pub(super) server_name: Option<Spanned<String>>,
}

/// `[orca]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOrca {
    pub(super) min_report_interval_ms: Option<Spanned<i64>>,
    pub(super) blackout_period_ms: Option<Spanned<i64>>,
    pub(super) weight_expiration_period_ms: Option<Spanned<i64>>,
    pub(super) weight_update_period_ms: Option<Spanned<i64>>,
}

/// `[supervisor]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSupervisor {
    pub(super) bind: Option<Spanned<String>>,
    pub(super) metrics: Option<Spanned<String>>,
    pub(super) control: Option<Spanned<String>>,
    pub(super) xds_cluster: Option<Spanned<String>>,
    pub(super) restart_delay_ms: Option<Spanned<u64>>,
    pub(super) restart_delay_max_ms: Option<Spanned<u64>>,
    pub(super) healthy_after_ms: Option<Spanned<i64>>,
    pub(super) sampler: Option<Spanned<String>>,
    pub(super) sample_interval_ms: Option<Spanned<i64>>,
    pub(super) drain_timeout_ms: Option<Spanned<i64>>,
    pub(super) stop_timeout_ms: Option<Spanned<i64>>,
    pub(super) register_timeout_ms: Option<Spanned<i64>>,
    pub(super) orphan_timeout_ms: Option<Spanned<i64>>,
    pub(super) grpc_max_connections: Option<Spanned<i64>>,
    pub(super) grpc_max_connections_per_peer: Option<Spanned<i64>>,
    pub(super) grpc_handshake_timeout_ms: Option<Spanned<i64>>,
    pub(super) grpc_idle_timeout_ms: Option<Spanned<i64>>,
    pub(super) tls: Option<Spanned<RawServerTls>>,
}

/// `[envoy]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEnvoy {
    pub(super) node: Option<Spanned<String>>,
    pub(super) listen: Option<Spanned<String>>,
    pub(super) admin: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) ads: bool,
    pub(super) xds: Option<Spanned<String>>,
    pub(super) timeout_ms: Option<Spanned<i64>>,
    pub(super) per_try_timeout_ms: Option<Spanned<i64>>,
    pub(super) xds_servers: Option<Spanned<Vec<String>>>,
    pub(super) tls: Option<Spanned<RawEnvoyTls>>,
}

/// `[service.NAME]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawService {
    pub(super) count: Option<Spanned<i64>>,
    pub(super) restart_batch: Option<Spanned<i64>>,
    pub(super) url: Option<Spanned<String>>,
    pub(super) command: Option<Spanned<Vec<String>>>,
    pub(super) pass_socket: Option<Spanned<bool>>,
    pub(super) ready_path: Option<Spanned<String>>,
    pub(super) stop_signal: Option<Spanned<String>>,
    pub(super) concurrency: Option<Spanned<RawConcurrency>>,
    pub(super) listener: Option<Spanned<String>>,
    pub(super) user: Option<Spanned<AccountId>>,
    pub(super) group: Option<Spanned<AccountId>>,
    pub(super) env: Option<Spanned<BTreeMap<String, String>>>,
    pub(super) prefix: Option<Spanned<String>>,
    pub(super) domains: Option<Spanned<Vec<String>>>,
    pub(super) orca: Option<Spanned<RawOrcaMode>>,
    pub(super) lb_policy: Option<Spanned<String>>,
    pub(super) choice_count: Option<Spanned<i64>>,
    pub(super) ring_size_min: Option<Spanned<i64>>,
    pub(super) ring_size_max: Option<Spanned<i64>>,
    pub(super) table_size: Option<Spanned<i64>>,
    pub(super) hash_balance_factor: Option<Spanned<i64>>,
    pub(super) hash_on: Option<Spanned<String>>,
    pub(super) weight: Option<Spanned<i64>>,
    pub(super) weights: Option<Spanned<Vec<i64>>>,
}

impl RawConfig {
    /// Reads `source` into the mirror: a TOML syntax error, a wrong type or an unknown key is the one
    /// problem returned.
    pub(super) fn from_toml(source: &str) -> Result<RawConfig, Problem> {
        let document = DeTable::parse(source).map_err(|err| {
            let message = match (err.message().trim(), err.span()) {
                ("duplicate key", Some(span)) => wording::duplicate(source, span),
                (message, _) => message.to_owned(),
            };
            Problem::at(source, err.span(), "(syntax)".into(), message)
        })?;
        let service_names = service_names(document.get_ref());
        let deserializer = toml::de::Deserializer::from(document);
        let mut raw: RawConfig = serde_path_to_error::deserialize(deserializer).map_err(|err| {
            let key = dotted_key(err.path());
            let inner = err.into_inner();
            Problem::at(
                source,
                inner.span(),
                key,
                wording::serde_message(inner.message().trim()),
            )
        })?;
        raw.service_names = service_names;
        Ok(raw)
    }
}

/// The span of each name under `service` in `document`, where it is a table.
fn service_names(document: &DeTable<'_>) -> BTreeMap<String, Range<usize>> {
    let services = document
        .iter()
        .find(|(key, _)| key.get_ref() == "service")
        .map(|(_, value)| value.get_ref());
    match services {
        Some(DeValue::Table(services)) => services
            .keys()
            .map(|name| (name.get_ref().to_string(), name.span()))
            .collect(),
        _ => BTreeMap::new(),
    }
}

/// `part` as one part of a dotted TOML key: bare when TOML allows it (ASCII letters, digits, `_`
/// and `-`), else a quoted basic string in which `"`, `\`, control characters and bidirectional
/// formatting characters are escaped: a problem's key reads as the file writes it, and never carries
/// a terminal escape to the terminal that shows it.
pub(super) fn key_part(part: &str) -> std::borrow::Cow<'_, str> {
    let bare = !part.is_empty()
        && part
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'));
    if bare {
        return part.into();
    }
    let mut quoted = String::with_capacity(part.len() + 2);
    quoted.push('"');
    for c in part.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            c if c.is_control() || is_bidi_control(c) => {
                quoted.push_str(&format!("\\u{:04X}", u32::from(c)));
            }
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted.into()
}

impl RawService {
    /// Moves the balancing keys out, for [`Checker::balancing`](super::check::Checker::balancing).
    pub(super) fn take_balancing(&mut self) -> RawBalancing {
        RawBalancing {
            orca: self.orca.take(),
            lb_policy: self.lb_policy.take(),
            choice_count: self.choice_count.take(),
            ring_size_min: self.ring_size_min.take(),
            ring_size_max: self.ring_size_max.take(),
            table_size: self.table_size.take(),
            hash_balance_factor: self.hash_balance_factor.take(),
            hash_on: self.hash_on.take(),
            weight: self.weight.take(),
            weights: self.weights.take(),
        }
    }
}

/// `service.NAME.orca`: a flag (`true`, `false`) or a text (`"out-of-band"`, `"in-band"`, checked by
/// [`balancing`](super::balancing)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum RawOrcaMode {
    /// `true` or `false`.
    Flag(bool),
    /// A text, not checked yet.
    Text(String),
}

impl<'de> Deserialize<'de> for RawOrcaMode {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = RawOrcaMode;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("true, false, \"out-of-band\" or \"in-band\"")
            }

            fn visit_bool<E: serde::de::Error>(self, flag: bool) -> Result<RawOrcaMode, E> {
                Ok(RawOrcaMode::Flag(flag))
            }

            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<RawOrcaMode, E> {
                Ok(RawOrcaMode::Text(text.to_owned()))
            }
        }
        // As for `AccountId`: a TOML value says what it is, whatever is asked.
        deserializer.deserialize_str(Visitor)
    }
}

/// `service.NAME.concurrency`: a number, or a text (`"auto"`), checked by the service's check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum RawConcurrency {
    /// A number, not checked yet.
    Number(i64),
    /// A text, not checked yet.
    Text(String),
}

impl<'de> Deserialize<'de> for RawConcurrency {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = RawConcurrency;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a number of requests (1 or more) or \"auto\"")
            }

            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<RawConcurrency, E> {
                Ok(RawConcurrency::Number(n))
            }

            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<RawConcurrency, E> {
                Ok(RawConcurrency::Number(i64::try_from(n).unwrap_or(i64::MAX)))
            }

            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<RawConcurrency, E> {
                Ok(RawConcurrency::Text(text.to_owned()))
            }
        }
        // As for `AccountId`: a TOML value says what it is, whatever is asked.
        deserializer.deserialize_str(Visitor)
    }
}

/// `user` and `group`: a name, or a numeric id written as an integer (`65534`) or as a text of digits
/// (`"65534"`); either way the text of digits.
#[derive(Debug)]
pub(super) struct AccountId(pub(super) String);

impl<'de> Deserialize<'de> for AccountId {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = AccountId;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a name or a numeric id")
            }

            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<AccountId, E> {
                Ok(AccountId(text.to_owned()))
            }

            fn visit_u64<E: serde::de::Error>(self, id: u64) -> Result<AccountId, E> {
                Ok(AccountId(id.to_string()))
            }

            fn visit_i64<E: serde::de::Error>(self, id: i64) -> Result<AccountId, E> {
                u64::try_from(id)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(id), &self))
                    .and_then(|id| self.visit_u64(id))
            }
        }
        // A text is asked for, and an integer is taken too: a TOML value says what it is, whatever
        // is asked (and the key walk of `reference` answers a text).
        deserializer.deserialize_str(Visitor)
    }
}

/// The balancing keys of a `[service.NAME]` table, as [`balancing`](super::balancing) checks them.
///
/// They are written again in [`RawService`] rather than included with `#[serde(flatten)]`: serde
/// does not support `flatten` with `deny_unknown_fields`, and a flattened value loses its span.
#[derive(Debug, Default)]
pub(super) struct RawBalancing {
    pub(super) orca: Option<Spanned<RawOrcaMode>>,
    pub(super) lb_policy: Option<Spanned<String>>,
    pub(super) choice_count: Option<Spanned<i64>>,
    pub(super) ring_size_min: Option<Spanned<i64>>,
    pub(super) ring_size_max: Option<Spanned<i64>>,
    pub(super) table_size: Option<Spanned<i64>>,
    pub(super) hash_balance_factor: Option<Spanned<i64>>,
    pub(super) hash_on: Option<Spanned<String>>,
    pub(super) weight: Option<Spanned<i64>>,
    pub(super) weights: Option<Spanned<Vec<i64>>>,
}

impl RawBalancing {
    /// Whether the table chooses how Envoy balances over the workers themselves: a policy, ORCA
    /// on, or per-worker weights. Each needs the workers to be endpoints of their own.
    pub(super) fn balances_workers(&self) -> bool {
        let orca_on = self
            .orca
            .as_ref()
            .is_some_and(|orca| *orca.get_ref() != RawOrcaMode::Flag(false));
        orca_on || self.lb_policy.is_some() || self.weight.is_some() || self.weights.is_some()
    }
}

/// A serde path as the dotted key a user wrote, without serde's private wrapper segments.
fn dotted_key(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut key = String::new();
    for segment in path.iter() {
        let part = match segment {
            Segment::Map { key } if key.starts_with("$__") => continue,
            Segment::Map { key } | Segment::Enum { variant: key } => key_part(key).into_owned(),
            Segment::Seq { index } => index.to_string(),
            Segment::Unknown => continue,
        };
        if !key.is_empty() {
            key.push('.');
        }
        key.push_str(&part);
    }
    if key.is_empty() {
        "(top level)".into()
    } else {
        key
    }
}

#[cfg(test)]
mod tests {
    use crate::config::testing::problems;

    #[test]
    fn a_type_error_names_the_key_and_line() {
        let got = problems("[service.cluster]\ncount = \"two\"\n");
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(
            got[0].starts_with("line 2: service.cluster.count: "),
            "{got:?}"
        );
        assert!(!got[0].contains('\n'), "one line: {got:?}");
    }

    #[test]
    fn an_unknown_key_is_named() {
        let got = problems("[service.cluster]\ncuont = 2\n");
        assert!(
            got[0].contains("line 2") && got[0].contains("cuont"),
            "{got:?}"
        );
    }

    #[test]
    fn a_syntax_error_has_a_line() {
        let got = problems("[service.cluster]\ncount = = 2\n");
        assert!(got[0].starts_with("line 2: "), "{got:?}");
    }

    #[test]
    fn errors_deep_inside_tables_have_lines() {
        for source in [
            "[service.web]\n\n[service.web.env.a.b.c]\nd = 1\n",
            "[service.web]\n\nenv = { a = { b = { c = 1 } } }\n",
            &format!(
                "[service.web]\n\nx = {}1{}\n",
                "{a=".repeat(200),
                "}".repeat(200)
            ),
        ] {
            let got = problems(source);
            assert!(got[0].starts_with("line 3: "), "{source:?}: {got:?}");
        }
    }
}
