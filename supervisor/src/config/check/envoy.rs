//! The checks of `[envoy]`: what `peregrine envoy-bootstrap` writes into Envoy's bootstrap.
//!
//! Invariant: a route's per-try timeout never exceeds its overall timeout, which bounds all tries.

use std::{net::SocketAddr, time::Duration};

use toml::Spanned;

use super::Checker;
use crate::config::{EnvoyConfig, XdsVariant, raw::RawEnvoy};

/// The default of `envoy.timeout_ms` and of `envoy.per_try_timeout_ms`: Envoy's route timeout.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(15);

impl Checker<'_> {
    fn socket_address(
        &mut self,
        raw: Option<Spanned<String>>,
        default: &str,
        key: &str,
    ) -> Option<SocketAddr> {
        match raw {
            None => Some(default.parse().expect("valid default")),
            Some(value) => {
                let parsed = value.get_ref().parse().ok();
                if parsed.is_none() {
                    self.report(
                        Some(value.span()),
                        key.into(),
                        format!(
                            "expected IP:PORT (e.g. {default}), got {:?}",
                            value.get_ref()
                        ),
                    );
                }
                parsed
            }
        }
    }

    /// `envoy.xds_servers`: `http://IP:PORT` each.
    fn xds_servers(&mut self, raw: Option<Spanned<Vec<String>>>) -> Vec<SocketAddr> {
        let Some(raw) = raw else {
            return Vec::new();
        };
        let span = raw.span();
        let mut servers = Vec::new();
        for server in raw.into_inner() {
            match server
                .strip_prefix("http://")
                .and_then(|rest| rest.strip_suffix('/').unwrap_or(rest).parse().ok())
            {
                Some(addr) => servers.push(addr),
                None => self.report(
                    Some(span.clone()),
                    "envoy.xds_servers".into(),
                    crate::config::wording::not_an_http_address(&server, "http://10.0.0.1:18000"),
                ),
            }
        }
        if servers.is_empty() {
            self.report(
                Some(span),
                "envoy.xds_servers".into(),
                "names no server (leave it out to dial supervisor.bind)",
            );
        }
        servers
    }

    pub(super) fn envoy(&mut self, raw: RawEnvoy) -> Option<EnvoyConfig> {
        let node = self.valid(
            raw.node,
            "envoy.node".into(),
            |node: &String| !node.is_empty(),
            "must not be empty",
            || "peregrine".into(),
        );
        let listen = self.socket_address(raw.listen, "0.0.0.0:10000", "envoy.listen");
        let admin = self.socket_address(raw.admin, "127.0.0.1:9901", "envoy.admin");
        let xds = self.choice(
            raw.xds,
            "envoy.xds",
            &[
                ("sotw", XdsVariant::StateOfTheWorld),
                ("delta", XdsVariant::Delta),
            ],
        );
        let mut timeout = DEFAULT_TIMEOUT;
        let mut per_try_timeout = DEFAULT_TIMEOUT;
        let timeout_span = raw.timeout_ms.as_ref().map(|v| v.span());
        let per_try_span = raw.per_try_timeout_ms.as_ref().map(|v| v.span());
        self.millis(raw.timeout_ms, "envoy.timeout_ms", 1, &mut timeout);
        self.millis(
            raw.per_try_timeout_ms,
            "envoy.per_try_timeout_ms",
            1,
            &mut per_try_timeout,
        );
        if per_try_timeout > timeout && per_try_span.is_none() {
            // Only the overall timeout was written: it is the key to name, and the per-try timeout
            // the way out.
            self.report(
                timeout_span,
                "envoy.timeout_ms".into(),
                format!(
                    "{} ms is shorter than each try's default timeout ({} ms), which must fit \
                     within it: write a per_try_timeout_ms of at most {} too",
                    timeout.as_millis(),
                    DEFAULT_TIMEOUT.as_millis(),
                    timeout.as_millis()
                ),
            );
        } else if per_try_timeout > timeout {
            self.report(
                per_try_span,
                "envoy.per_try_timeout_ms".into(),
                format!(
                    "must not be longer than envoy.timeout_ms ({} ms), which bounds all tries",
                    timeout.as_millis()
                ),
            );
        }
        let xds_servers = self.xds_servers(raw.xds_servers);
        Some(EnvoyConfig {
            xds_servers,
            node,
            listen: listen?,
            admin: admin?,
            ads: raw.ads,
            xds,
            timeout,
            per_try_timeout,
            tls: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::{
        XdsVariant,
        testing::{parse, problems},
    };

    #[test]
    fn envoy_xds_is_sotw_or_delta() {
        let config = parse("[service.a]\n").unwrap();
        assert_eq!(config.envoy.xds, XdsVariant::StateOfTheWorld);
        let config = parse("[envoy]\nads = true\nxds = \"delta\"\n[service.a]\n").unwrap();
        assert_eq!(
            (config.envoy.ads, config.envoy.xds),
            (true, XdsVariant::Delta)
        );
        assert_eq!(
            problems("[envoy]\nxds = \"incremental\"\n[service.a]\n"),
            ["line 2: envoy.xds: expected \"sotw\" or \"delta\", got \"incremental\""]
        );
    }

    #[test]
    fn xds_servers_are_ip_addresses() {
        let config = parse(
            "[envoy]\nxds_servers = [\"http://10.0.0.1:18000\", \"http://[fd00::2]:18000\"]\n[service.a]\n",
        )
        .unwrap();
        assert_eq!(config.envoy.xds_servers.len(), 2);
        assert_eq!(config.envoy.xds_servers[1].port(), 18000);
        assert!(parse("[service.a]\n").unwrap().envoy.xds_servers.is_empty());
        let got = problems("[envoy]\nxds_servers = [\"10.0.0.1:18000\"]\n[service.a]\n");
        assert!(
            got[0].starts_with("line 2: envoy.xds_servers: expected http://IP:PORT"),
            "{got:?}"
        );
        let got = problems("[envoy]\nxds_servers = []\n[service.a]\n");
        assert!(got[0].contains("names no server"), "{got:?}");
    }

    #[test]
    fn route_and_try_timeouts() {
        let config =
            parse("[envoy]\ntimeout_ms = 20000\nper_try_timeout_ms = 500\n[service.a]\n").unwrap();
        assert_eq!(config.envoy.timeout, Duration::from_secs(20));
        assert_eq!(config.envoy.per_try_timeout, Duration::from_millis(500));
        let defaults = parse("[service.a]\n").unwrap();
        assert_eq!(defaults.envoy.timeout, Duration::from_secs(15));
        assert_eq!(defaults.envoy.per_try_timeout, Duration::from_secs(15));
        let got =
            problems("[envoy]\ntimeout_ms = 1000\n\nper_try_timeout_ms = 2000\n[service.a]\n");
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(
            got[0].starts_with("line 4: envoy.per_try_timeout_ms: must not be longer"),
            "{got:?}"
        );
        // A short timeout alone: the per-try default does not fit under it, and the problem is the
        // key that was written, at its line.
        assert_eq!(
            problems("[envoy]\n\ntimeout_ms = 1000\n[service.a]\n"),
            [
                "line 3: envoy.timeout_ms: 1000 ms is shorter than each try's default timeout \
                 (15000 ms), which must fit within it: write a per_try_timeout_ms of at most 1000 too"
            ]
        );
        // A long per-try timeout alone is named at its own line.
        let got = problems("[envoy]\nper_try_timeout_ms = 20000\n[service.a]\n");
        assert_eq!(
            got,
            [
                "line 2: envoy.per_try_timeout_ms: must not be longer than envoy.timeout_ms \
                 (15000 ms), which bounds all tries"
            ]
        );
    }
}
