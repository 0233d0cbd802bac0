//! `service.NAME.lb_policy` and the keys beside it: how Envoy spreads a service's requests over its
//! workers, what it hashes for affinity, and the workers' weights.
//!
//! Invariant: a hashing policy always knows what to hash by, an option is accepted only with a policy it
//! applies to, and a service has exactly one weight per worker.

use std::{ops::Range, time::Duration};

use toml::Spanned;

use super::{Checker, alternatives, expected};
use crate::{
    balancer::{Balancer, OrcaPolicy},
    config::{
        MIN_SAMPLE_INTERVAL,
        concurrency::ListenerMode,
        raw::{RawBalancing, RawOrcaMode},
    },
};

/// The shortest `orca.weight_expiration_period_ms`.
pub(super) const MIN_WEIGHT_EXPIRATION: Duration = Duration::from_millis(1000);
/// The shortest `orca.weight_update_period_ms`.
pub(super) const MIN_WEIGHT_UPDATE: Duration = Duration::from_millis(100);

/// How Envoy balances a service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Balancing {
    /// Client-side weighted round robin on the workers' ORCA load reports (`orca = true`, the default
    /// for IP urls), which travel as the field says.
    Orca(OrcaReports),
    /// `lb_policy = "round_robin"`.
    RoundRobin,
    /// `lb_policy = "least_request"`: the worker with fewer active requests of `choice_count` random
    /// ones.
    LeastRequest {
        /// `choice_count` (2 by default).
        choice_count: u32,
    },
    /// `lb_policy = "random"`.
    Random,
    /// `lb_policy = "ring_hash"`: consistent hashing on a ring with virtual nodes.
    RingHash {
        /// What each request is hashed by.
        hash_on: HashOn,
        /// `ring_size_min`, fixed; by default (`None`) the ring gets [`RING_POINTS_PER_WORKER`] points
        /// per worker (per unit of weight), so that adding a worker adds its points and takes none
        /// from the others (a fixed ring size gives each worker fewer points as workers are added,
        /// which moves keys between the old workers too).
        min_ring_size: Option<u64>,
        /// `ring_size_max` (8M by default).
        max_ring_size: u64,
        /// `hash_balance_factor`: bounded loads, in percent of the average (none by default).
        hash_balance_factor: Option<u32>,
    },
    /// `lb_policy = "maglev"`: consistent hashing with a lookup table.
    Maglev {
        /// What each request is hashed by.
        hash_on: HashOn,
        /// `table_size`, a prime (65537 by default).
        table_size: u64,
        /// `hash_balance_factor`.
        hash_balance_factor: Option<u32>,
    },
}

impl Balancing {
    /// The `lb_policy` value that selects it (`"orca"` for ORCA-weighted round robin).
    pub fn name(&self) -> &'static str {
        match self {
            Balancing::Orca(_) => "orca",
            Balancing::RoundRobin => "round_robin",
            Balancing::LeastRequest { .. } => "least_request",
            Balancing::Random => "random",
            Balancing::RingHash { .. } => "ring_hash",
            Balancing::Maglev { .. } => "maglev",
        }
    }

    /// What requests are hashed by, for the hashing policies.
    pub fn hash_on(&self) -> Option<&HashOn> {
        match self {
            Balancing::RingHash { hash_on, .. } | Balancing::Maglev { hash_on, .. } => {
                Some(hash_on)
            }
            _ => None,
        }
    }
}

/// How a service's ORCA load reports reach Envoy (`service.NAME.orca`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrcaReports {
    /// `orca = true` or `"out-of-band"`: each Envoy opens a gRPC stream per worker to the
    /// supervisor, which reports on it.
    OutOfBand,
    /// `orca = "in-band"`: a worker's responses carry its latest report, each once per connection (the
    /// `endpoint-load-metrics-bin` header), which the supervisor leaves in the worker's shared memory;
    /// no stream. Reaches `unix://` workers too; not `pass_socket` servers, which add no header.
    InBand,
}

/// The values `orca` takes, as a refusal lists them.
const ORCA_VALUES: &str = "true, false, \"out-of-band\" or \"in-band\"";

/// `service.NAME.hash_on`: what a request is hashed by, in the generated Envoy route.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HashOn {
    /// `"header:NAME"`: a request header (e.g. `x-entity-id`).
    Header(String),
    /// `"cookie:NAME"`: a cookie.
    Cookie(String),
    /// `"source_ip"`: the client's address.
    SourceIp,
}

/// Ring points per worker (per unit of weight) when `ring_size_min` is not given.
pub const RING_POINTS_PER_WORKER: u64 = 1024;
/// Envoy's largest ring size.
const DEFAULT_MAX_RING: u64 = 8 * 1024 * 1024;
/// Envoy's default Maglev table size, and its largest.
const DEFAULT_TABLE_SIZE: u64 = 65537;
const MAX_TABLE_SIZE: u64 = 5_000_011;
/// The largest worker weight.
pub const MAX_WEIGHT: u32 = 1000;

/// Which policies a key applies to, for "does not apply" errors.
const OPTION_POLICIES: [(&str, &[&str]); 5] = [
    ("choice_count", &["least_request"]),
    ("ring_size_min", &["ring_hash"]),
    ("ring_size_max", &["ring_hash"]),
    ("table_size", &["maglev"]),
    ("hash_balance_factor", &["ring_hash", "maglev"]),
];

/// `choice_count`'s default: least request compares two workers per pick.
pub const DEFAULT_CHOICE_COUNT: u32 = 2;

/// The `choice_count` values accepted.
const CHOICE_COUNTS: Range<u64> = 2..101;
/// The `hash_balance_factor` values accepted (percent).
const HASH_BALANCE_FACTORS: Range<u64> = 100..10_001;
/// The ring sizes accepted.
const RING_SIZES: Range<u64> = 1..DEFAULT_MAX_RING + 1;
/// The Maglev table sizes accepted (a prime among them).
const TABLE_SIZES: Range<u64> = 2..MAX_TABLE_SIZE + 1;

/// Whether Envoy's ORCA streams can reach a service's workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum OrcaReach {
    /// They listen on IP addresses.
    Yes,
    /// They listen on Unix sockets, which Envoy's ORCA streams (to each worker's IP) cannot reach.
    Unix,
}

impl Checker<'_> {
    /// The service's balancing and its workers' weights (one per slot); `pass_socket`: whether its
    /// workers are servers on passed sockets, which cannot report in band.
    pub(super) fn balancing(
        &mut self,
        service: &str,
        raw: RawBalancing,
        count: Option<u32>,
        reach: OrcaReach,
        (pass_socket, listener): (bool, ListenerMode),
    ) -> (Balancing, Vec<u32>) {
        let shared = listener == ListenerMode::Shared;
        let key = |field: &str| format!("service.{service}.{field}");
        let weights = self.weights(&key, &raw, count);
        let policy = raw
            .lb_policy
            .as_ref()
            .map(|p| (p.get_ref().as_str(), p.span()));

        // orca = true, "out-of-band", "in-band" (on, with where reports travel) or false (off); a
        // value that is none of these is refused and counts as not written.
        let orca = raw.orca.as_ref().and_then(|orca| {
            let reports = match orca.get_ref() {
                RawOrcaMode::Flag(true) => Some(OrcaReports::OutOfBand),
                RawOrcaMode::Flag(false) => None,
                RawOrcaMode::Text(text) if text == "out-of-band" => Some(OrcaReports::OutOfBand),
                RawOrcaMode::Text(text) if text == "in-band" => Some(OrcaReports::InBand),
                RawOrcaMode::Text(text) => {
                    self.report(
                        Some(orca.span()),
                        key("orca"),
                        format!("expected {ORCA_VALUES}, got {text:?}"),
                    );
                    return None;
                }
            };
            let written = match orca.get_ref() {
                RawOrcaMode::Flag(flag) => flag.to_string(),
                RawOrcaMode::Text(text) => format!("{text:?}"),
            };
            Some((reports, written, orca.span()))
        });
        let reports = orca
            .as_ref()
            .and_then(|(reports, _, _)| *reports)
            .unwrap_or(OrcaReports::OutOfBand);

        // orca against lb_policy: each must agree with the other when both are written.
        let orca_wanted = match (&orca, policy.clone()) {
            (Some((Some(_), written, span)), Some((name, _))) if name != "orca" => {
                self.report(
                    Some(span.clone()),
                    key("orca"),
                    format!(
                        "orca = {written} balances on ORCA reports (client-side weighted round \
                         robin), which replaces lb_policy = \"{name}\": remove one of them"
                    ),
                );
                false
            }
            (Some((None, _, span)), Some(("orca", _))) => {
                self.report(
                    Some(span.clone()),
                    key("orca"),
                    "lb_policy = \"orca\" needs ORCA reports; orca = false turns them off: \
                     remove one of them",
                );
                false
            }
            (Some((reports, _, _)), _) => reports.is_some(),
            (None, Some((name, _))) => name == "orca",
            // A shared listener is one endpoint per host, which Envoy balances between hosts by
            // least request unless told to weigh them on ORCA reports of the host's load.
            (None, None) => reach == OrcaReach::Yes && !shared,
        };
        let orca_key = if raw.orca.is_some() {
            "orca"
        } else {
            "lb_policy"
        };
        let orca_span = raw
            .orca
            .as_ref()
            .map(Spanned::span)
            .or(policy.clone().map(|(_, s)| s));
        let why_not = match (reach, reports) {
            (_, OrcaReports::InBand) if pass_socket => Some(
                "orca = \"in-band\" needs the worker's responses to carry its load report (a \
                 header the worker library adds), which a pass_socket server does not send: use \
                 orca = true (out of band) for it",
            ),
            (OrcaReach::Yes, _) | (OrcaReach::Unix, OrcaReports::InBand) => None,
            (OrcaReach::Unix, OrcaReports::OutOfBand) => Some(
                "ORCA cannot reach unix:// workers out of band: Envoy opens each worker's ORCA \
                 stream to its IP address; orca = \"in-band\" carries the reports in the workers' \
                 responses instead, or choose another lb_policy (ORCA is off by default for \
                 unix:// urls)",
            ),
        };
        if let Some(why_not) = why_not.filter(|_| orca_wanted) {
            self.report(orca_span, key(orca_key), why_not);
        }

        let name = match (policy.clone(), orca_wanted) {
            (_, true) => "orca",
            (Some((name, _)), false) if name != "orca" => name,
            // Between hosts' shared listeners (in a fleet), the one with the fewest requests in
            // flight.
            _ if shared => "least_request",
            _ => "round_robin",
        };
        // Options that do not apply to the chosen policy.
        let given = [
            ("choice_count", raw.choice_count.as_ref().map(Spanned::span)),
            (
                "ring_size_min",
                raw.ring_size_min.as_ref().map(Spanned::span),
            ),
            (
                "ring_size_max",
                raw.ring_size_max.as_ref().map(Spanned::span),
            ),
            ("table_size", raw.table_size.as_ref().map(Spanned::span)),
            (
                "hash_balance_factor",
                raw.hash_balance_factor.as_ref().map(Spanned::span),
            ),
        ];
        for ((option, span), (_, applies)) in given.into_iter().zip(OPTION_POLICIES) {
            if let Some(span) = span
                && !applies.contains(&name)
            {
                self.report(
                    Some(span),
                    key(option),
                    format!(
                        "applies to lb_policy = {}, not {name}",
                        alternatives(applies)
                    ),
                );
            }
        }
        let hash_on = self.hash_on(
            &key,
            raw.hash_on.as_ref(),
            name,
            policy.clone().map(|(_, s)| s),
        );
        let factor = self.number(
            &key,
            "hash_balance_factor",
            &raw.hash_balance_factor,
            HASH_BALANCE_FACTORS,
        );
        let balancing = match name {
            "orca" => Balancing::Orca(reports),
            "round_robin" => Balancing::RoundRobin,
            "random" => Balancing::Random,
            "least_request" => Balancing::LeastRequest {
                choice_count: self
                    .number(&key, "choice_count", &raw.choice_count, CHOICE_COUNTS)
                    .unwrap_or(u64::from(DEFAULT_CHOICE_COUNT))
                    as u32,
            },
            "ring_hash" => {
                let min = self.number(&key, "ring_size_min", &raw.ring_size_min, RING_SIZES);
                let max = self
                    .number(&key, "ring_size_max", &raw.ring_size_max, RING_SIZES)
                    .unwrap_or(DEFAULT_MAX_RING);
                if let Some(min) = min.filter(|&min| min > max) {
                    self.report(
                        raw.ring_size_min.as_ref().map(Spanned::span),
                        key("ring_size_min"),
                        format!("{min} is larger than ring_size_max ({max})"),
                    );
                }
                Balancing::RingHash {
                    hash_on: hash_on.unwrap_or(HashOn::SourceIp),
                    min_ring_size: min,
                    max_ring_size: max,
                    hash_balance_factor: factor.map(|f| f as u32),
                }
            }
            "maglev" => {
                let table_size = self
                    .number(&key, "table_size", &raw.table_size, TABLE_SIZES)
                    .unwrap_or(DEFAULT_TABLE_SIZE);
                if !is_prime(table_size) {
                    self.report(
                        raw.table_size.as_ref().map(Spanned::span),
                        key("table_size"),
                        format!(
                            "must be a prime (Envoy requires it), got {table_size}; e.g. 65537"
                        ),
                    );
                }
                Balancing::Maglev {
                    hash_on: hash_on.unwrap_or(HashOn::SourceIp),
                    table_size,
                    hash_balance_factor: factor.map(|f| f as u32),
                }
            }
            other => {
                self.report(
                    policy.map(|(_, s)| s),
                    key("lb_policy"),
                    expected(
                        &[
                            "orca",
                            "round_robin",
                            "least_request",
                            "random",
                            "ring_hash",
                            "maglev",
                        ],
                        other,
                    ),
                );
                Balancing::RoundRobin
            }
        };
        (balancing, weights)
    }

    /// `hash_on`, required by (and only allowed with) the hashing policies.
    fn hash_on(
        &mut self,
        key: &dyn Fn(&str) -> String,
        raw: Option<&Spanned<String>>,
        policy: &str,
        policy_span: Option<Range<usize>>,
    ) -> Option<HashOn> {
        let hashing = matches!(policy, "ring_hash" | "maglev");
        let Some(raw) = raw else {
            if hashing {
                self.report(
                    policy_span,
                    key("hash_on"),
                    format!(
                        "lb_policy = \"{policy}\" needs hash_on: what to hash each request by, \
                         \"header:NAME\" (e.g. \"header:x-entity-id\"), \"cookie:NAME\" or \"source_ip\""
                    ),
                );
            }
            return None;
        };
        if !hashing {
            self.report(
                Some(raw.span()),
                key("hash_on"),
                format!("applies to lb_policy = \"ring_hash\" or \"maglev\", not {policy}"),
            );
            return None;
        }
        let text = raw.get_ref();
        let parsed = match text.split_once(':') {
            Some(("header", name)) if valid_token(name) => Some(HashOn::Header(name.to_owned())),
            Some(("cookie", name)) if valid_token(name) => Some(HashOn::Cookie(name.to_owned())),
            None if text == "source_ip" => Some(HashOn::SourceIp),
            _ => None,
        };
        if parsed.is_none() {
            self.report(
                Some(raw.span()),
                key("hash_on"),
                expected(&["header:NAME", "cookie:NAME", "source_ip"], text),
            );
        }
        parsed
    }

    /// `weight` (every slot) or `weights` (one per slot), each 1..=MAX_WEIGHT; 1 by default.
    /// `count` is `None` when it was given wrong: `weights` is then not held to it.
    fn weights(
        &mut self,
        key: &dyn Fn(&str) -> String,
        raw: &RawBalancing,
        count: Option<u32>,
    ) -> Vec<u32> {
        let known = count;
        let count = count.unwrap_or(1);
        let mut weights = vec![1; count as usize];
        if let (Some(_), Some(list)) = (&raw.weight, &raw.weights) {
            self.report(
                Some(list.span()),
                key("weights"),
                "give weight (for every worker) or weights (one per worker), not both",
            );
            return weights;
        }
        if let Some(weight) = self.number(key, "weight", &raw.weight, 1..u64::from(MAX_WEIGHT) + 1)
        {
            weights.fill(weight as u32);
        }
        if let Some(list) = &raw.weights {
            if known.is_some_and(|count| list.get_ref().len() != count as usize) {
                self.report(
                    Some(list.span()),
                    key("weights"),
                    format!(
                        "has {} entries for {count} workers: one weight per worker, by index",
                        list.get_ref().len()
                    ),
                );
            } else if let Some(bad) = list
                .get_ref()
                .iter()
                .find(|w| !(1..=i64::from(MAX_WEIGHT)).contains(*w))
            {
                self.report(
                    Some(list.span()),
                    key("weights"),
                    format!("each weight must be between 1 and {MAX_WEIGHT}, got {bad}"),
                );
            } else {
                weights = list.get_ref().iter().map(|&w| w as u32).collect();
            }
        }
        weights
    }
}

/// Why `balancer`, a service's spec as another host of a fleet published it, is one this config
/// could not have made (and Envoy may refuse), if it is: the bounds above, checked on the spec.
pub fn balancer_problem(balancer: &Balancer) -> Option<String> {
    let outside = |what: &str, value: u64, range: Range<u64>| {
        (!range.contains(&value)).then(|| {
            format!(
                "{what} must be between {} and {}, got {value}",
                range.start,
                range.end - 1
            )
        })
    };
    let factor = |factor: Option<u32>| {
        factor.and_then(|f| outside("hash_balance_factor", f.into(), HASH_BALANCE_FACTORS))
    };
    match *balancer {
        Balancer::RoundRobin | Balancer::Random => None,
        Balancer::LeastRequest { choice_count } => {
            outside("choice_count", choice_count.into(), CHOICE_COUNTS)
        }
        Balancer::RingHash {
            min_ring_size,
            max_ring_size,
            hash_balance_factor,
        } => outside("ring_size_min", min_ring_size, RING_SIZES)
            .or_else(|| outside("ring_size_max", max_ring_size, RING_SIZES))
            .or_else(|| {
                (min_ring_size > max_ring_size).then(|| {
                    format!("ring_size_min {min_ring_size} is larger than ring_size_max ({max_ring_size})")
                })
            })
            .or_else(|| factor(hash_balance_factor)),
        Balancer::Maglev {
            table_size,
            hash_balance_factor,
        } => outside("table_size", table_size, TABLE_SIZES)
            .or_else(|| {
                (!is_prime(table_size))
                    .then(|| format!("table_size must be a prime, got {table_size}"))
            })
            .or_else(|| factor(hash_balance_factor)),
        Balancer::Orca(policy) => orca_problem(&policy),
    }
}

/// Why `policy` is one the `[orca]` checks would not have let through, if it is.
fn orca_problem(policy: &OrcaPolicy) -> Option<String> {
    // A protobuf Duration's largest (10,000 years): Envoy refuses more.
    const LONGEST: Duration = Duration::from_secs(315_576_000_000);
    let periods = [
        (
            "reporting_period",
            policy.reporting_period,
            MIN_SAMPLE_INTERVAL,
        ),
        ("blackout_period", policy.blackout_period, Duration::ZERO),
        (
            "weight_expiration_period",
            policy.weight_expiration_period,
            MIN_WEIGHT_EXPIRATION,
        ),
        (
            "weight_update_period",
            policy.weight_update_period,
            MIN_WEIGHT_UPDATE,
        ),
    ];
    if policy.port == 0 {
        return Some("the ORCA port is 0".into());
    }
    for (what, period, least) in periods {
        if period < least || period > LONGEST {
            return Some(format!(
                "{what} must be between {least:?} and {LONGEST:?}, got {period:?}"
            ));
        }
    }
    (policy.weight_expiration_period <= policy.blackout_period)
        .then(|| "weight_expiration_period must be longer than blackout_period".to_owned())
}

/// An HTTP header or cookie name.
fn valid_token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn is_prime(n: u64) -> bool {
    n >= 2
        && (2..)
            .take_while(|d| d * d <= n)
            .all(|d| !n.is_multiple_of(d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{
        DEFAULT_SAMPLE_INTERVAL, MAX_REPORT_INTERVAL, OrcaConfig,
        testing::{parse, problems},
    };

    #[test]
    fn primes() {
        assert!(is_prime(65537) && is_prime(5_000_011) && is_prime(2));
        assert!(!is_prime(65536) && !is_prime(1) && !is_prime(9));
    }

    #[test]
    fn tokens() {
        assert!(valid_token("x-entity-id"));
        assert!(!valid_token("") && !valid_token("a b") && !valid_token("a:b"));
    }

    #[test]
    fn orca_is_on_for_ip_workers_and_off_for_unix_ones_or_another_lb_policy() {
        let config = parse(
            "[service.a]\n[service.b]\nurl = \"unix:///run/b.sock\"\n\
             [service.c]\nlb_policy = \"least_request\"\n[service.d]\norca = false\n",
        )
        .unwrap();
        let orca = |name: &str| config.services[name].orca();
        assert!(orca("a") && !orca("b") && !orca("c") && !orca("d"));
        assert_eq!(
            config.services["c"].balancing,
            Balancing::LeastRequest { choice_count: 2 }
        );
        assert_eq!(config.services["d"].balancing, Balancing::RoundRobin);
        assert_eq!(
            config.orca,
            OrcaConfig::defaults_for(DEFAULT_SAMPLE_INTERVAL)
        );
    }

    #[test]
    fn orca_false_beside_lb_policy_orca_is_refused_with_its_line() {
        let got = problems("[service.a]\nlb_policy = \"orca\"\norca = false\n");
        assert_eq!(
            got,
            [
                "line 3: service.a.orca: lb_policy = \"orca\" needs ORCA reports; orca = false \
                 turns them off: remove one of them"
            ]
        );
        // Either order, and the keys that agree, are fine.
        let config = parse(
            "[service.a]\norca = true\nlb_policy = \"orca\"\n\
             [service.b]\norca = false\nlb_policy = \"round_robin\"\n",
        )
        .unwrap();
        assert_eq!(
            config.services["a"].balancing,
            Balancing::Orca(OrcaReports::OutOfBand)
        );
        assert_eq!(config.services["b"].balancing, Balancing::RoundRobin);
    }

    #[test]
    fn orca_in_band_reaches_unix_workers_and_refuses_passed_sockets() {
        let config = parse(
            "[service.a]\norca = \"in-band\"\n\
             [service.b]\nurl = \"unix:///run/b.sock\"\norca = \"in-band\"\nlb_policy = \"orca\"\n\
             [service.c]\norca = \"out-of-band\"\n[service.d]\norca = true\n",
        )
        .unwrap();
        let reports = |name: &str| config.services[name].balancing.clone();
        assert_eq!(reports("a"), Balancing::Orca(OrcaReports::InBand));
        assert_eq!(reports("b"), Balancing::Orca(OrcaReports::InBand));
        assert_eq!(reports("c"), Balancing::Orca(OrcaReports::OutOfBand));
        assert_eq!(reports("d"), Balancing::Orca(OrcaReports::OutOfBand));
        assert!(config.services["a"].orca_in_band() && !config.services["d"].orca_in_band());

        let got = problems(
            "[service.p]\npass_socket = true\ncommand = [\"/bin/true\"]\norca = \"in-band\"\n",
        );
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(
            got[0].starts_with(
                "line 4: service.p.orca: orca = \"in-band\" needs the worker's responses to \
                 carry its load report"
            ),
            "{got:?}"
        );
        let got = problems("[service.u]\nurl = \"unix:///run/u.sock\"\norca = \"out-of-band\"\n");
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(
            got[0].starts_with(
                "line 3: service.u.orca: ORCA cannot reach unix:// workers out of band"
            ) && got[0].contains("orca = \"in-band\""),
            "{got:?}"
        );
    }

    #[test]
    fn orca_values_that_are_not_known_are_refused_with_their_line() {
        let got = problems("[service.a]\n\norca = \"inband\"\n");
        assert_eq!(
            got,
            [
                "line 3: service.a.orca: expected true, false, \"out-of-band\" or \"in-band\", \
                 got \"inband\""
            ]
        );
        let got = problems("[service.a]\norca = 1\n");
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(
            got[0].contains("service.a.orca") || got[0].contains("orca"),
            "{got:?}"
        );
        let got = problems("[service.a]\norca = \"in-band\"\nlb_policy = \"random\"\n");
        assert!(
            got[0]
                .starts_with("line 2: service.a.orca: orca = \"in-band\" balances on ORCA reports"),
            "{got:?}"
        );
    }

    #[test]
    fn hashing_policies_with_their_options_and_weights() {
        let config = parse(
            "[service.ring]\ncount = 3\nlb_policy = \"ring_hash\"\nhash_on = \"header:x-entity-id\"\n\
             ring_size_min = 4096\nhash_balance_factor = 150\nweights = [1, 2, 3]\n\
             [service.mag]\nlb_policy = \"maglev\"\nhash_on = \"cookie:session\"\nweight = 5\n\
             [service.ip]\nlb_policy = \"ring_hash\"\nhash_on = \"source_ip\"\n",
        )
        .unwrap();
        assert_eq!(
            config.services["ring"].balancing,
            Balancing::RingHash {
                hash_on: HashOn::Header("x-entity-id".into()),
                min_ring_size: Some(4096),
                max_ring_size: 8 * 1024 * 1024,
                hash_balance_factor: Some(150),
            }
        );
        assert_eq!(config.services["ring"].weights, [1, 2, 3]);
        assert_eq!(
            config.services["mag"].balancing,
            Balancing::Maglev {
                hash_on: HashOn::Cookie("session".into()),
                table_size: 65537,
                hash_balance_factor: None,
            }
        );
        assert_eq!(config.services["mag"].weights, [5]);
        assert_eq!(
            config.services["ip"].balancing.hash_on(),
            Some(&HashOn::SourceIp)
        );
        assert!(!config.services["ip"].orca());
    }

    #[test]
    fn hashing_mistakes_are_named_with_their_lines() {
        let got = problems(
            "[service.a]\nlb_policy = \"ring_hash\"\n\
             [service.b]\nlb_policy = \"maglev\"\nhash_on = \"query:id\"\ntable_size = 65536\n\
             [service.c]\nlb_policy = \"round_robin\"\nhash_on = \"source_ip\"\nhash_balance_factor = 150\n\
             [service.d]\ncount = 2\nweights = [1]\n[service.e]\nlb_policy = \"ring_hash\"\n\
             hash_on = \"source_ip\"\nhash_balance_factor = 50\nring_size_min = 9000\nring_size_max = 8000\n",
        );
        let expect = [
            "line 2: service.a.hash_on: lb_policy = \"ring_hash\" needs hash_on",
            "line 5: service.b.hash_on: expected \"header:NAME\"",
            "line 6: service.b.table_size: must be a prime",
            "line 10: service.c.hash_balance_factor: applies to lb_policy = \"ring_hash\" or \"maglev\", not round_robin",
            "line 9: service.c.hash_on: applies to lb_policy = \"ring_hash\" or \"maglev\"",
            "line 13: service.d.weights: has 1 entries for 2 workers",
            "line 17: service.e.hash_balance_factor: must be between 100 and 10000, got 50",
            "line 18: service.e.ring_size_min: 9000 is larger than ring_size_max (8000)",
        ];
        assert_eq!(got.len(), expect.len(), "{got:#?}");
        for (got, expect) in got.iter().zip(expect) {
            assert!(
                got.starts_with(expect),
                "{got}\n  should start with\n{expect}"
            );
        }
    }

    #[test]
    fn orca_conflicts_and_bad_values_are_named_with_their_lines() {
        let got = problems(
            "[service.a]\nurl = \"unix:///run/a.sock\"\norca = true\n\
             [service.b]\nlb_policy = \"random\"\norca = true\n\
             [service.c]\nlb_policy = \"fastest\"\n",
        );
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(
            got[0].starts_with("line 3: service.a.orca: ORCA cannot reach unix:// workers"),
            "{got:?}"
        );
        assert!(
            got[1].starts_with("line 6: service.b.orca: orca = true balances on ORCA reports")
                && got[1].contains("lb_policy = \"random\""),
            "{got:?}"
        );
        assert!(
            got[2].starts_with("line 8: service.c.lb_policy: expected \"orca\", \"round_robin\""),
            "{got:?}"
        );
        let got = problems(
            "[orca]\nmin_report_interval_ms = 5\nblackout_period_ms = 40000\n[service.a]\n",
        );
        assert_eq!(
            got,
            [
                "line 2: orca.min_report_interval_ms: must be at least 10 (milliseconds), got 5",
                "line 3: orca.blackout_period_ms: must be shorter than \
                 orca.weight_expiration_period_ms (30000 ms by default): a weight would expire \
                 before Envoy starts using it",
            ]
        );
        // A floor over an hour is refused: one far enough (up to 2^64 - 1 ms) made every stream's
        // report timer overflow, as the orca_requests fuzz target found for the interval Envoy asks.
        let got = problems("[orca]\nmin_report_interval_ms = 3600001\n[service.a]\n");
        assert_eq!(
            got,
            [
                "line 2: orca.min_report_interval_ms: must be at most 3600000 (milliseconds), got 3600001"
            ]
        );
        let hour = parse("[orca]\nmin_report_interval_ms = 3600000\n[service.a]\n").unwrap();
        assert_eq!(hour.orca.min_report_interval, MAX_REPORT_INTERVAL);
    }

    #[test]
    fn a_published_spec_is_held_to_the_same_bounds() {
        let orca = OrcaPolicy {
            port: 18000,
            reporting_period: DEFAULT_SAMPLE_INTERVAL,
            blackout_period: Duration::ZERO,
            weight_expiration_period: Duration::from_secs(30),
            weight_update_period: Duration::from_millis(100),
            tls: false,
            in_band: false,
        };
        for fine in [
            Balancer::RoundRobin,
            Balancer::LeastRequest { choice_count: 2 },
            Balancer::Maglev {
                table_size: 65537,
                hash_balance_factor: Some(150),
            },
            Balancer::RingHash {
                min_ring_size: 1024,
                max_ring_size: DEFAULT_MAX_RING,
                hash_balance_factor: None,
            },
            Balancer::Orca(orca),
        ] {
            assert_eq!(balancer_problem(&fine), None, "{fine:?}");
        }
        for (bad, problem) in [
            (
                Balancer::Maglev {
                    table_size: 65536,
                    hash_balance_factor: None,
                },
                "table_size must be a prime, got 65536",
            ),
            (
                Balancer::Maglev {
                    table_size: 65537,
                    hash_balance_factor: Some(99),
                },
                "hash_balance_factor must be between 100 and 10000, got 99",
            ),
            (
                Balancer::LeastRequest { choice_count: 1 },
                "choice_count must be between 2 and 100, got 1",
            ),
            (
                Balancer::RingHash {
                    min_ring_size: 2048,
                    max_ring_size: 1024,
                    hash_balance_factor: None,
                },
                "ring_size_min 2048 is larger than ring_size_max (1024)",
            ),
            (
                Balancer::Orca(OrcaPolicy { port: 0, ..orca }),
                "the ORCA port is 0",
            ),
            (
                Balancer::Orca(OrcaPolicy {
                    blackout_period: Duration::from_secs(60),
                    ..orca
                }),
                "weight_expiration_period must be longer than blackout_period",
            ),
        ] {
            assert_eq!(balancer_problem(&bad).as_deref(), Some(problem), "{bad:?}");
        }
    }
}
