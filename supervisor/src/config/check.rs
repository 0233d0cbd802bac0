//! The checks that turn the raw mirror into the typed [`Config`]: every value is checked, every
//! problem is collected with its key and line (not just the first), and defaults fill what the file
//! leaves out.
//!
//! Invariant: a check never stops at a problem; it reports it and goes on with a default, so that one
//! run names every mistake. A [`Config`] is returned only when no problem was found.
//!
//! [`Checker`] holds what every check needs and checks each kind of value (integer floors and ranges,
//! named choices, texts with a rule) in one method; this file checks the whole file, `[supervisor]`
//! and `[orca]`, [`envoy`] checks `[envoy]`, [`cluster`] checks `[cluster]`, [`service`] checks `[service.NAME]` and
//! [`balancing`](super::balancing) a service's balancing keys.

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    ops::Range,
    path::{Path, PathBuf},
    time::Duration,
};

use toml::Spanned;

use super::{
    Config, DEFAULT_BIND, DEFAULT_CONTROL, DEFAULT_METRICS, DEFAULT_SAMPLE_INTERVAL, GrpcLimits,
    Identity, Lifecycle, NamedFile, OrcaConfig, RestartPolicy, SamplerSetting, ServiceConfig,
    SupervisorConfig,
    error::Problem,
    files::absolute_in,
    limits::{MAX_REPORT_INTERVAL, MAX_TOTAL_WORKERS, MIN_HEALTHY_AFTER, MIN_SAMPLE_INTERVAL},
    raw::{RawConfig, RawOrca, RawSupervisor},
    workers_in_all,
};

pub(super) mod balancing;
pub(crate) mod cluster;
mod envoy;
mod routes;
mod service;
pub(crate) mod tls;

use self::{
    balancing::{MIN_WEIGHT_EXPIRATION, MIN_WEIGHT_UPDATE},
    routes::{DEFAULT_XDS_CLUSTER, XdsClusterName},
    service::{ServiceSpans, busiest},
};

/// Collects problems with their lines.
pub(super) struct Checker<'a> {
    source: &'a str,
    /// The config file's directory: relative paths are taken from it.
    base: &'a Path,
    /// `PATH`, to resolve worker programs.
    search_path: Option<&'a str>,
    /// Who the supervisor is: what a service's `user` is held to.
    identity: Identity,
    problems: Vec<Problem>,
    /// The files the config names, as they are checked.
    files: Vec<NamedFile>,
}

impl Checker<'_> {
    /// Sets `target` to `value` milliseconds if given and at least `min`; else reports `key`.
    pub(super) fn millis(
        &mut self,
        value: Option<Spanned<i64>>,
        key: &str,
        min: u64,
        target: &mut Duration,
    ) {
        if let Some(ms) =
            value.and_then(|value| self.at_least::<u64>(&value, key, min, " (milliseconds)"))
        {
            *target = Duration::from_millis(ms);
        }
    }

    /// An integer key of at least `min` that fits a `T`, reported with its line otherwise; `unit`
    /// follows `min` in the message.
    pub(super) fn at_least<T: TryFrom<u64>>(
        &mut self,
        value: &Spanned<i64>,
        key: &str,
        min: u64,
        unit: &str,
    ) -> Option<T> {
        let fits = u64::try_from(*value.get_ref())
            .ok()
            .filter(|&n| n >= min)
            .and_then(|n| T::try_from(n).ok());
        if fits.is_none() {
            self.report(
                Some(value.span()),
                key.to_owned(),
                format!("must be at least {min}{unit}, got {}", value.get_ref()),
            );
        }
        fits
    }

    /// An integer key within `range`, reported with its line when outside.
    pub(super) fn number(
        &mut self,
        key: &dyn Fn(&str) -> String,
        field: &str,
        raw: &Option<Spanned<i64>>,
        range: Range<u64>,
    ) -> Option<u64> {
        let value = raw.as_ref()?;
        match u64::try_from(*value.get_ref()) {
            Ok(n) if range.contains(&n) => Some(n),
            _ => {
                self.report(
                    Some(value.span()),
                    key(field),
                    format!(
                        "must be between {} and {}, got {}",
                        range.start,
                        range.end - 1,
                        value.get_ref()
                    ),
                );
                None
            }
        }
    }

    /// One of the values `choices` names, `T::default()` when not given; anything else is reported
    /// with its line (and gives the default too).
    pub(super) fn choice<T: Copy + Default>(
        &mut self,
        raw: Option<Spanned<String>>,
        key: &str,
        choices: &[(&str, T)],
    ) -> T {
        let Some(value) = raw else {
            return T::default();
        };
        match choices.iter().find(|(name, _)| name == value.get_ref()) {
            Some(&(_, choice)) => choice,
            None => {
                let names: Vec<&str> = choices.iter().map(|&(name, _)| name).collect();
                self.report(
                    Some(value.span()),
                    key.to_owned(),
                    expected(&names, value.get_ref()),
                );
                T::default()
            }
        }
    }

    /// `raw` if given and `ok`, else `default()`; a value that is not `ok` is reported with `rule` and
    /// gives `T::default()` (an empty text or list: the config is rejected anyway).
    pub(super) fn valid<T: Default>(
        &mut self,
        raw: Option<Spanned<T>>,
        key: String,
        ok: impl FnOnce(&T) -> bool,
        rule: &str,
        default: impl FnOnce() -> T,
    ) -> T {
        match raw {
            Some(value) if !ok(value.get_ref()) => {
                self.report(Some(value.span()), key, rule);
                T::default()
            }
            Some(value) => value.into_inner(),
            None => default(),
        }
    }

    /// Reports a problem at `span` of the file (its line counted from there) under `key`.
    pub(super) fn report(
        &mut self,
        span: Option<Range<usize>>,
        key: String,
        message: impl Into<String>,
    ) {
        let problem = Problem::at(self.source, span, key, message);
        self.problems.push(problem);
    }
}

/// Checks every value of `raw` (read from `source`; relative paths are taken from `base`, overrides
/// from `env`; services' accounts held to what a supervisor that is `identity` may switch to) and
/// returns the typed configuration, or every problem found.
pub(super) fn config(
    mut raw: RawConfig,
    source: &str,
    base: &Path,
    env: &HashMap<String, String>,
    identity: Identity,
) -> Result<Config, Vec<Problem>> {
    let mut check = Checker {
        source,
        base,
        search_path: env.get("PATH").map(String::as_str),
        identity,
        problems: Vec::new(),
        files: Vec::new(),
    };
    let written = ServiceSpans::of_all(&raw);
    let server_tls = raw.supervisor.tls.take();
    let envoy_tls = raw.envoy.tls.take();
    // The control socket's path is known even when another `[supervisor]` key is wrong: the
    // services' worker sockets are named after it.
    let control = check.control(raw.supervisor.control.take(), env);
    let xds_cluster = check.xds_cluster(raw.supervisor.xds_cluster.take());
    let mut supervisor = check.supervisor(raw.supervisor, control.clone(), &xds_cluster, env);
    let mut envoy = check.envoy(raw.envoy);
    let server_span = server_tls.as_ref().map(Spanned::span);
    let envoy_span = envoy_tls.as_ref().map(Spanned::span);
    let server_tls = server_tls.and_then(|tls| check.server_tls(tls));
    let envoy_tls = envoy_tls.and_then(|tls| check.envoy_tls(tls));
    check.tls_sides(
        server_span.map(|span| (span, server_tls.as_ref())),
        envoy_span.map(|span| (span, envoy_tls.as_ref())),
    );
    if let Some(supervisor) = &mut supervisor {
        supervisor.tls = server_tls;
    }
    if let Some(envoy) = &mut envoy {
        envoy.tls = envoy_tls;
    }
    if raw.service.is_empty() {
        // The one problem without a line: there is no line to name.
        check.report(
            None,
            "service".into(),
            "no services: add a [service.NAME] table with the workers to run",
        );
    }
    let services: BTreeMap<String, ServiceConfig> = raw
        .service
        .into_iter()
        .map(|(name, service)| {
            let name_span = written.get(&name).and_then(|spans| spans.name.clone());
            let checked = check.service(name.clone(), name_span, service, &control);
            (name, checked)
        })
        .collect();
    let workers = workers_in_all(&services);
    if workers > MAX_TOTAL_WORKERS
        && let Some((key, span)) = busiest(&services, &written)
    {
        check.report(
            span,
            key,
            format!(
                "{workers} workers in all, this service's the most; a supervisor runs at most \
                 {MAX_TOTAL_WORKERS} (run more supervisors, each with its own control socket)"
            ),
        );
    }
    check.routes(&services, &written, &xds_cluster);
    let sample_interval = supervisor
        .as_ref()
        .map_or(DEFAULT_SAMPLE_INTERVAL, |s| s.sample_interval);
    let orca = check.orca(raw.orca, sample_interval);
    let cluster = raw.cluster.and_then(|cluster| check.cluster(cluster, env));

    if check.problems.is_empty() {
        Ok(Config {
            supervisor: supervisor.expect("no problems"),
            envoy: envoy.expect("no problems"),
            services,
            orca,
            cluster,
            files: check.files,
        })
    } else {
        Err(check.problems)
    }
}

impl Checker<'_> {
    fn orca(&mut self, raw: RawOrca, sample_interval: Duration) -> OrcaConfig {
        let mut orca = OrcaConfig::defaults_for(sample_interval);
        let mut millis = |value, key: &str, min, target: &mut Duration| {
            self.millis(value, &format!("orca.{key}"), min, target)
        };
        let floor_span = raw.min_report_interval_ms.as_ref().map(|v| v.span());
        millis(
            raw.min_report_interval_ms,
            "min_report_interval_ms",
            10,
            &mut orca.min_report_interval,
        );
        let blackout_span = raw.blackout_period_ms.as_ref().map(|v| v.span());
        millis(
            raw.blackout_period_ms,
            "blackout_period_ms",
            0,
            &mut orca.blackout_period,
        );
        let expiration_span = raw.weight_expiration_period_ms.as_ref().map(|v| v.span());
        millis(
            raw.weight_expiration_period_ms,
            "weight_expiration_period_ms",
            MIN_WEIGHT_EXPIRATION.as_millis() as u64,
            &mut orca.weight_expiration_period,
        );
        millis(
            raw.weight_update_period_ms,
            "weight_update_period_ms",
            MIN_WEIGHT_UPDATE.as_millis() as u64,
            &mut orca.weight_update_period,
        );
        // Only a floor written in the file: the default one (the sample interval) is capped where
        // reports are timed (`orca::report_interval`).
        if floor_span.is_some() && orca.min_report_interval > MAX_REPORT_INTERVAL {
            self.report(
                floor_span,
                "orca.min_report_interval_ms".into(),
                format!(
                    "must be at most {} (milliseconds), got {}",
                    MAX_REPORT_INTERVAL.as_millis(),
                    orca.min_report_interval.as_millis()
                ),
            );
        }
        if orca.weight_expiration_period <= orca.blackout_period {
            match expiration_span {
                Some(span) => self.report(
                    Some(span),
                    "orca.weight_expiration_period_ms".into(),
                    format!(
                        "must be longer than orca.blackout_period_ms ({} ms): a weight would \
                         expire before Envoy starts using it",
                        orca.blackout_period.as_millis()
                    ),
                ),
                // Only the blackout was written: it is the key to name.
                None => self.report(
                    blackout_span,
                    "orca.blackout_period_ms".into(),
                    format!(
                        "must be shorter than orca.weight_expiration_period_ms ({} ms by \
                         default): a weight would expire before Envoy starts using it",
                        orca.weight_expiration_period.as_millis()
                    ),
                ),
            }
        }
        orca
    }

    /// `supervisor.control` (or `PEREGRINE_CONTROL`), absolute.
    fn control(&self, raw: Option<Spanned<String>>, env: &HashMap<String, String>) -> PathBuf {
        let control = match env.get("PEREGRINE_CONTROL") {
            Some(c) => Some(c.clone()),
            None => raw.map(|c| c.into_inner()),
        }
        .unwrap_or_else(|| DEFAULT_CONTROL.into());
        absolute_in(self.base, Path::new(&control))
    }

    /// `supervisor.xds_cluster`: the name, and where the file writes it.
    fn xds_cluster(&mut self, raw: Option<Spanned<String>>) -> XdsClusterName {
        let span = raw.as_ref().map(Spanned::span);
        let name = self.valid(
            raw,
            "supervisor.xds_cluster".into(),
            |name| valid_name(name),
            NAME_RULE,
            || DEFAULT_XDS_CLUSTER.into(),
        );
        XdsClusterName { name, span }
    }

    /// `[supervisor]` but its `control` (already made absolute by [`Checker::control`]) and its
    /// `xds_cluster` (checked by [`Checker::xds_cluster`]).
    fn supervisor(
        &mut self,
        raw: RawSupervisor,
        control: PathBuf,
        xds_cluster: &XdsClusterName,
        env: &HashMap<String, String>,
    ) -> Option<SupervisorConfig> {
        let bind = match env.get("PEREGRINE_BIND") {
            Some(bind) => {
                self.http_address(bind, None, "PEREGRINE_BIND (environment)", DEFAULT_BIND)
            }
            None => match &raw.bind {
                Some(b) => {
                    self.http_address(b.get_ref(), Some(b.span()), "supervisor.bind", DEFAULT_BIND)
                }
                None => self.http_address(DEFAULT_BIND, None, "supervisor.bind", DEFAULT_BIND),
            },
        };
        // `""` turns metrics off; the environment wins over the file, as for `bind`.
        let metrics = match env.get("PEREGRINE_METRICS") {
            Some(url) if url.is_empty() => Some(None),
            Some(url) => self
                .http_address(
                    url,
                    None,
                    "PEREGRINE_METRICS (environment)",
                    DEFAULT_METRICS,
                )
                .map(Some),
            None => match &raw.metrics {
                Some(url) if url.get_ref().is_empty() => Some(None),
                Some(url) => self
                    .http_address(
                        url.get_ref(),
                        Some(url.span()),
                        "supervisor.metrics",
                        DEFAULT_METRICS,
                    )
                    .map(Some),
                None => self
                    .http_address(DEFAULT_METRICS, None, "supervisor.metrics", DEFAULT_METRICS)
                    .map(Some),
            },
        };
        let mut restart = RestartPolicy::default();
        if let Some(ms) = raw.restart_delay_ms {
            if *ms.get_ref() == 0 {
                self.report(
                    Some(ms.span()),
                    "supervisor.restart_delay_ms".into(),
                    "must be at least 1: a zero delay lets a crashing worker restart in a tight loop",
                );
            }
            restart.initial = Duration::from_millis(*ms.get_ref());
        }
        match raw.restart_delay_max_ms {
            Some(ms) => {
                if Duration::from_millis(*ms.get_ref()) < restart.initial {
                    self.report(
                        Some(ms.span()),
                        "supervisor.restart_delay_max_ms".into(),
                        format!(
                            "must not be shorter than supervisor.restart_delay_ms ({} ms), got {}",
                            restart.initial.as_millis(),
                            ms.get_ref()
                        ),
                    );
                }
                restart.max = Duration::from_millis(*ms.get_ref());
            }
            // Left out, the cap is never below the first delay: a cap under it would make the second
            // delay shorter than the first.
            None => restart.max = restart.max.max(restart.initial),
        }
        if let Some(ms) = raw.healthy_after_ms {
            let min = MIN_HEALTHY_AFTER.as_millis() as u64;
            match u64::try_from(*ms.get_ref()) {
                Ok(n) if n >= min => restart.healthy_after = Duration::from_millis(n),
                _ => self.report(
                    Some(ms.span()),
                    "supervisor.healthy_after_ms".into(),
                    format!(
                        "must be at least {min} (milliseconds), got {}: a shorter run would count \
                         a worker that crashes at start-up as healthy, and its restart delay would \
                         never grow",
                        ms.get_ref()
                    ),
                ),
            }
        }
        let sampler = self.choice(
            raw.sampler,
            "supervisor.sampler",
            &SamplerSetting::ALL.map(|sampler| (sampler.as_str(), sampler)),
        );
        let mut sample_interval = DEFAULT_SAMPLE_INTERVAL;
        self.millis(
            raw.sample_interval_ms,
            "supervisor.sample_interval_ms",
            MIN_SAMPLE_INTERVAL.as_millis() as u64,
            &mut sample_interval,
        );
        let mut lifecycle = Lifecycle::default();
        let mut millis = |value, key: &str, min, target: &mut Duration| {
            self.millis(value, &format!("supervisor.{key}"), min, target)
        };
        millis(
            raw.drain_timeout_ms,
            "drain_timeout_ms",
            0,
            &mut lifecycle.drain_timeout,
        );
        millis(
            raw.stop_timeout_ms,
            "stop_timeout_ms",
            1,
            &mut lifecycle.stop_timeout,
        );
        millis(
            raw.register_timeout_ms,
            "register_timeout_ms",
            100,
            &mut lifecycle.register_timeout,
        );
        millis(
            raw.orphan_timeout_ms,
            "orphan_timeout_ms",
            0,
            &mut lifecycle.orphan_timeout,
        );
        let mut grpc = GrpcLimits::default();
        millis(
            raw.grpc_handshake_timeout_ms,
            "grpc_handshake_timeout_ms",
            10,
            &mut grpc.handshake_timeout,
        );
        millis(
            raw.grpc_idle_timeout_ms,
            "grpc_idle_timeout_ms",
            100,
            &mut grpc.idle_timeout,
        );
        if let Some(max) = raw.grpc_max_connections
            && let Some(n) = self.at_least(&max, "supervisor.grpc_max_connections", 1, "")
        {
            grpc.max_connections = n;
        }
        if let Some(max) = raw.grpc_max_connections_per_peer
            && let Some(n) = self.at_least(&max, "supervisor.grpc_max_connections_per_peer", 1, "")
        {
            grpc.max_connections_per_peer = n;
        }
        Some(SupervisorConfig {
            bind: bind?,
            metrics: metrics?,
            control,
            xds_cluster: xds_cluster.name.clone(),
            restart,
            sampler,
            sample_interval,
            lifecycle,
            grpc,
            tls: None,
        })
    }

    /// Parses `http://IP:PORT`.
    fn http_address(
        &mut self,
        url: &str,
        span: Option<Range<usize>>,
        key: &str,
        example: &str,
    ) -> Option<SocketAddr> {
        let parsed = url
            .strip_prefix("http://")
            .map(|a| a.trim_end_matches('/'))
            .and_then(|a| a.parse::<SocketAddr>().ok());
        if parsed.is_none() {
            self.report(
                span,
                key.into(),
                super::wording::not_an_http_address(url, example),
            );
        }
        parsed
    }
}

/// A problem with the total of workers of `services` (checked from `source`), at the service with
/// the most ([`busiest`]).
pub(super) fn total_problem(
    source: &str,
    services: &BTreeMap<String, ServiceConfig>,
    message: String,
) -> Problem {
    let written = RawConfig::from_toml(source)
        .map(|raw| ServiceSpans::of_all(&raw))
        .unwrap_or_default();
    let (key, span) = busiest(services, &written).unwrap_or_else(|| ("service".into(), None));
    Problem::at(source, span, key, message)
}

/// `expected "a", "b" or "c", got "d"`: the message for a value that is none of `choices`.
pub(super) fn expected(choices: &[&str], got: &str) -> String {
    format!("expected {}, got {got:?}", alternatives(choices))
}

/// `"a", "b" or "c"`: `choices` quoted, as a sentence lists them.
pub(super) fn alternatives(choices: &[&str]) -> String {
    let quoted: Vec<String> = choices
        .iter()
        .map(|choice| format!("\"{choice}\""))
        .collect();
    match quoted.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// What [`valid_name`] admits, as a problem's message.
const NAME_RULE: &str = "names may use only ASCII letters, digits, '-', '_' and '.'";

/// Whether `name` may name a service or the xDS cluster.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::{
        WorkerCommand,
        testing::{parse, problems},
    };

    #[test]
    fn parses_the_documented_example() {
        let config = parse(
            r#"
[supervisor]
bind = "http://[::1]:18000"
control = "peregrine.sock"

[service.cluster]
count = 2
url = "http://localhost:0"
command = ["peregrine", "worker"]
"#,
        )
        .unwrap();
        assert_eq!(config.supervisor.bind, "[::1]:18000".parse().unwrap());
        assert_eq!(
            config.supervisor.control,
            Path::new("/etc/peregrine/peregrine.sock")
        );
        let service = &config.services["cluster"];
        assert_eq!(service.count, 2);
        assert_eq!(service.command, WorkerCommand::default());
        assert_eq!(service.url_for(1).to_string(), "http://localhost:0");
    }

    #[test]
    fn defaults_are_loopback_and_built_in() {
        let config = parse("[service.app]\n").unwrap();
        assert!(config.supervisor.bind.ip().is_loopback());
        assert!(config.envoy.admin.ip().is_loopback());
        let app = &config.services["app"];
        assert_eq!((app.count, &app.command), (1, &WorkerCommand::default()));
        assert_eq!(app.prefix, "/");
    }

    #[test]
    fn reports_every_problem_not_just_the_first() {
        let got = problems(
            r#"[supervisor]
bind = "localhost"
[service.web]
count = 3
url = "http://127.0.0.1:8080"
[service."bad name"]
count = 0
"#,
        );
        assert_eq!(got.len(), 4, "{got:#?}");
        assert!(
            got[0].starts_with("line 2: supervisor.bind: expected http://IP:PORT"),
            "{got:?}"
        );
        assert!(
            got.iter()
                .any(|p| p.starts_with("line 5: service.web.url: fixed port 8080")),
            "{got:?}"
        );
        assert!(
            got.iter()
                .any(|p| p.contains("service.\"bad name\".count: must be between 1")),
            "{got:?}"
        );
    }

    #[test]
    fn a_bad_service_name_is_named_at_its_line_as_the_file_writes_it() {
        for (source, key) in [
            (
                "[service.web]\n\n[service.\"we\\\"b\"]\n",
                "service.\"we\\\"b\"",
            ),
            (
                "[service.web]\n\n[service.'we\"b']\n",
                "service.\"we\\\"b\"",
            ),
            // The same text earlier in the file is not taken for the name.
            (
                "[supervisor]\nmetrics = \"\"\n[service.\"\"]\n",
                "service.\"\"",
            ),
            (
                "[envoy]\nnode = \"a b\"\n[service.\"a b\"]\n",
                "service.\"a b\"",
            ),
            (
                "[service]\nweb = {}\n\"a/b\" = { count = 2 }\n",
                "service.\"a/b\"",
            ),
            // A terminal escape in a name reaches no terminal.
            (
                "[service.a]\n[service.b]\n[service.\"\\u001b[2J\"]\n",
                "service.\"\\u001B[2J\"",
            ),
        ] {
            let got = problems(source);
            assert_eq!(got, [format!("line 3: {key}: {NAME_RULE}")], "{source:?}");
        }
    }

    #[test]
    fn every_problem_but_a_missing_table_has_a_line() {
        for source in [
            "[service.a]\nuser = \"nobody\"\ngroup = \"no-such-group-here\"\n",
            "[service.a]\ngroup = \"nogroup\"\n",
            "[service.a]\nenv = { \"\" = \"x\" }\n",
            "[service.a]\ncommand = []\n",
            "[service.a]\ncount = 2\nweights = [1]\n",
            "[service.a]\nlb_policy = \"maglev\"\n",
            "[service.a]\nurl = \"unix:///tmp/a.sock\"\norca = true\n",
            "[orca]\nblackout_period_ms = 40000\n[service.a]\n",
            "[supervisor.tls]\ncert = \"a\"\n[service.a]\n",
            "[envoy.tls]\nca = \"a\"\n[service.a]\n",
            "[envoy]\nxds_servers = []\n[service.a]\n",
            "[cluster]\n[service.a]\n",
            "[cluster.tls]\n[service.a]\n",
            "[supervisor]\nxds_cluster = \"a b\"\n[service.a]\n",
            "[service]\nweb = 1\n",
            "[[service]]\n",
            "x\n",
            &(0..5)
                .map(|i| format!("[service.s{i}]\ncount = 4096\n"))
                .collect::<String>(),
            &(0..3)
                .map(|i| format!("[service.s{i}]\n"))
                .chain(["[service.t]\ncount = 4096\n[service.u]\ncount = 4096\n".into()])
                .chain(["[service.v]\ncount = 4096\n[service.w]\ncount = 4096\n".into()])
                .collect::<String>(),
        ] {
            let got = parse(source).expect_err(source);
            assert!(
                got.iter().all(|problem| problem.line.is_some()),
                "{source:?}: {got:?}"
            );
        }
    }

    #[test]
    fn no_services_is_an_error() {
        let got = problems("[supervisor]\n");
        assert!(got[0].contains("no services"), "{got:?}");
    }

    #[test]
    fn the_total_of_workers_is_bounded() {
        let many: String = (0..5)
            .map(|i| format!("[service.s{i}]\ncount = 4096\n"))
            .collect();
        let got = problems(&many);
        assert_eq!(got.len(), 1, "{got:?}");
        // At a count to lower: the largest (the last by name of equals).
        assert!(
            got[0].starts_with("line 10: service.s4.count: 20480 workers in all"),
            "{got:?}"
        );
        let enough: String = (0..4)
            .map(|i| format!("[service.s{i}]\ncount = 4096\n"))
            .collect();
        assert!(parse(&enough).is_ok());
    }

    #[test]
    fn environment_overrides_bind_and_control() {
        let env = HashMap::from([
            (
                "PEREGRINE_BIND".to_string(),
                "http://127.0.0.1:1".to_string(),
            ),
            ("PEREGRINE_CONTROL".to_string(), "/run/x.sock".to_string()),
        ]);
        let config = Config::parse("[service.a]\n", Path::new("/"), &env).unwrap();
        assert_eq!(config.supervisor.bind.port(), 1);
        assert_eq!(config.supervisor.control, Path::new("/run/x.sock"));
    }

    #[test]
    fn metrics_default_to_loopback_turn_off_with_an_empty_url_and_a_bad_one_is_named() {
        let default = parse("[service.a]\n").unwrap();
        assert_eq!(
            default.supervisor.metrics,
            Some("127.0.0.1:9464".parse().unwrap())
        );
        let off = parse("[supervisor]\nmetrics = \"\"\n[service.a]\n").unwrap();
        assert_eq!(off.supervisor.metrics, None);
        let other = parse("[supervisor]\nmetrics = \"http://[::1]:9000\"\n[service.a]\n").unwrap();
        assert_eq!(
            other.supervisor.metrics,
            Some("[::1]:9000".parse().unwrap())
        );
        assert_eq!(
            problems("[supervisor]\nmetrics = \"127.0.0.1:9464\"\n[service.a]\n"),
            [
                "line 2: supervisor.metrics: expected http://IP:PORT (e.g. http://127.0.0.1:9464), got \"127.0.0.1:9464\""
            ]
        );
        let env = HashMap::from([(
            "PEREGRINE_METRICS".to_string(),
            "http://127.0.0.1:0".to_string(),
        )]);
        let config = Config::parse(
            "[supervisor]\nmetrics = \"\"\n[service.a]\n",
            Path::new("/"),
            &env,
        )
        .unwrap();
        assert_eq!(
            config.supervisor.metrics,
            Some("127.0.0.1:0".parse().unwrap())
        );
        let env = HashMap::from([("PEREGRINE_METRICS".to_string(), String::new())]);
        let config = Config::parse("[service.a]\n", Path::new("/"), &env).unwrap();
        assert_eq!(config.supervisor.metrics, None);
    }

    #[test]
    fn the_sampler_defaults_to_auto_every_200_ms() {
        let config = parse("[service.a]\n").unwrap();
        assert_eq!(config.supervisor.sampler, SamplerSetting::Auto);
        assert_eq!(
            config.supervisor.sample_interval,
            Duration::from_millis(200)
        );
        assert_eq!(config.orca.weight_update_period, Duration::from_millis(100));
        let config =
            parse("[supervisor]\nsampler = \"procfs\"\nsample_interval_ms = 10\n[service.a]\n")
                .unwrap();
        assert_eq!(config.supervisor.sampler, SamplerSetting::Procfs);
        assert_eq!(config.supervisor.sample_interval, Duration::from_millis(10));
    }

    #[test]
    fn a_bad_sampler_and_a_short_interval_are_named_with_their_lines() {
        let got =
            problems("[supervisor]\nsampler = \"perf\"\nsample_interval_ms = 9\n[service.a]\n");
        assert_eq!(
            got,
            [
                "line 2: supervisor.sampler: expected \"auto\", \"ebpf\", \"procfs\" or \"off\", got \"perf\"",
                "line 3: supervisor.sample_interval_ms: must be at least 10 (milliseconds), got 9",
            ]
        );
        let got = problems("[supervisor]\nsample_interval_ms = -5\n[service.a]\n");
        assert_eq!(
            got,
            ["line 2: supervisor.sample_interval_ms: must be at least 10 (milliseconds), got -5"]
        );
        let got = problems("[supervisor]\nsampler = 1\n[service.a]\n");
        assert_eq!(
            got,
            ["line 2: supervisor.sampler: expected a string, found integer `1`"]
        );
    }

    #[test]
    fn lifecycle_timeouts_and_restart_batches() {
        let config = parse("[service.a]\n").unwrap();
        assert_eq!(config.supervisor.lifecycle, Lifecycle::default());
        assert_eq!(config.services["a"].restart_batch, 1);
        let config = parse(
            "[supervisor]\ndrain_timeout_ms = 0\nstop_timeout_ms = 500\nregister_timeout_ms = 2000\n\
             orphan_timeout_ms = 0\n[service.a]\ncount = 8\nrestart_batch = 4\n",
        )
        .unwrap();
        assert_eq!(
            config.supervisor.lifecycle,
            Lifecycle {
                drain_timeout: Duration::ZERO,
                stop_timeout: Duration::from_millis(500),
                register_timeout: Duration::from_secs(2),
                orphan_timeout: Duration::ZERO,
            }
        );
        assert_eq!(config.services["a"].restart_batch, 4);
        let got = problems(
            "[supervisor]\nstop_timeout_ms = 0\nregister_timeout_ms = -1\n[service.a]\nrestart_batch = 0\n",
        );
        assert_eq!(
            got,
            [
                "line 2: supervisor.stop_timeout_ms: must be at least 1 (milliseconds), got 0",
                "line 3: supervisor.register_timeout_ms: must be at least 100 (milliseconds), got -1",
                "line 5: service.a.restart_batch: must be at least 1 (workers replaced at once), got 0",
            ]
        );
    }

    #[test]
    fn the_restart_delay_cap_is_never_below_the_first_delay() {
        let restart = |source: &str| parse(source).unwrap().supervisor.restart;
        assert_eq!(restart("[service.a]\n"), RestartPolicy::default());
        // A first delay above the default cap raises the cap to it: the delay never shrinks.
        let long = restart("[supervisor]\nrestart_delay_ms = 30000\n[service.a]\n");
        assert_eq!(
            (long.initial, long.max),
            (Duration::from_secs(30), Duration::from_secs(30))
        );
        let short = restart("[supervisor]\nrestart_delay_ms = 500\n[service.a]\n");
        assert_eq!(short.max, Duration::from_secs(10));
        let both = restart(
            "[supervisor]\nrestart_delay_ms = 30000\nrestart_delay_max_ms = 60000\n[service.a]\n",
        );
        assert_eq!(both.max, Duration::from_secs(60));
        // A cap written below the first delay is refused, at the cap's line.
        assert_eq!(
            problems(
                "[supervisor]\nrestart_delay_ms = 30000\n\nrestart_delay_max_ms = 20000\n[service.a]\n"
            ),
            [
                "line 4: supervisor.restart_delay_max_ms: must not be shorter than \
                 supervisor.restart_delay_ms (30000 ms), got 20000"
            ]
        );
        assert_eq!(
            problems("[supervisor]\nrestart_delay_max_ms = 50\n[service.a]\n"),
            [
                "line 2: supervisor.restart_delay_max_ms: must not be shorter than \
                 supervisor.restart_delay_ms (100 ms), got 50"
            ]
        );
    }

    #[test]
    fn a_healthy_run_lasts_at_least_100_ms_and_a_shorter_one_is_named_with_its_line() {
        let healthy_after = |source: &str| parse(source).unwrap().supervisor.restart.healthy_after;
        assert_eq!(healthy_after("[service.a]\n"), Duration::from_secs(10));
        assert_eq!(
            healthy_after("[supervisor]\nhealthy_after_ms = 100\n[service.a]\n"),
            Duration::from_millis(100)
        );
        for (value, line) in [("0", 3), ("99", 3), ("-1", 3)] {
            assert_eq!(
                problems(&format!(
                    "[supervisor]\nrestart_delay_ms = 200\nhealthy_after_ms = {value}\n[service.a]\n"
                )),
                [format!(
                    "line {line}: supervisor.healthy_after_ms: must be at least 100 (milliseconds), \
                     got {value}: a shorter run would count a worker that crashes at start-up as \
                     healthy, and its restart delay would never grow"
                )]
            );
        }
    }

    #[test]
    fn grpc_limits() {
        let config = parse(
            "[supervisor]\ngrpc_max_connections = 100\ngrpc_max_connections_per_peer = 10\n\
             grpc_handshake_timeout_ms = 500\ngrpc_idle_timeout_ms = 2000\n[service.a]\n",
        )
        .unwrap();
        assert_eq!(
            config.supervisor.grpc,
            GrpcLimits {
                max_connections: 100,
                max_connections_per_peer: 10,
                handshake_timeout: Duration::from_millis(500),
                idle_timeout: Duration::from_secs(2),
            }
        );
        let got = problems("[supervisor]\ngrpc_max_connections = 0\n[service.a]\n");
        assert!(
            got[0].starts_with("line 2: supervisor.grpc_max_connections"),
            "{got:?}"
        );
        let got = problems("[supervisor]\n\ngrpc_max_connections_per_peer = 0\n[service.a]\n");
        assert!(
            got[0].starts_with(
                "line 3: supervisor.grpc_max_connections_per_peer: must be at least 1"
            ),
            "{got:?}"
        );
    }
}
