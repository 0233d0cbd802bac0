//! The checks of `[cluster]`: this host's place in a fleet whose membership is kept in etcd.
//!
//! Invariant: a fleet's names (host, region, zone, prefix) are kept to characters that are safe in an
//! etcd key and an Envoy locality, so no other part has to escape them.

use std::{collections::HashMap, time::Duration};

use ipnet::IpNet;
use toml::Spanned;

use super::Checker;
use crate::config::{ClusterConfig, Locality, Routing, raw::RawCluster};

/// The shortest lease: etcd grants whole seconds and enforces a minimum of about 1.5 s (with its
/// default election settings), so a TTL below 2 s would be raised by etcd behind our back.
pub(crate) const MIN_LEASE_TTL: Duration = Duration::from_secs(2);
/// `cluster.lease_ttl_ms` when left out.
pub(crate) const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(3);
/// `cluster.prefix` when left out.
pub(crate) const DEFAULT_PREFIX: &str = "/peregrine";
/// The environment variable that replaces `cluster.etcd` (comma-separated endpoints).
pub const ENV_ETCD: &str = "PEREGRINE_ETCD";

/// Whether `name` is a fleet name: letters, digits, `.`, `_` and `-`, at most 63 of them. Other
/// hosts' names (and regions and zones) in etcd are held to it too.
pub fn fleet_name(name: &str) -> bool {
    name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// The longest service name another host of a fleet may publish: far longer than any config's,
/// short enough that a name in etcd cannot make an Envoy cluster name of kilobytes.
pub const MAX_FLEET_SERVICE_NAME: usize = 255;

/// Whether `name`, a service another host of a fleet published, is one a config could name: the
/// config's own rule for service names, at most [`MAX_FLEET_SERVICE_NAME`] long.
pub fn fleet_service_name(name: &str) -> bool {
    name.len() <= MAX_FLEET_SERVICE_NAME && super::valid_name(name)
}

/// Why an etcd endpoint is not one, if it is not: `https://HOST:PORT` with `[cluster.tls]`,
/// `http://HOST:PORT` without.
fn endpoint_problem(endpoint: &str, tls: bool) -> Option<String> {
    let (scheme, other) = if tls {
        ("https://", "http://")
    } else {
        ("http://", "https://")
    };
    let example = format!("{scheme}127.0.0.1:2379");
    let Some(authority) = endpoint.strip_prefix(scheme) else {
        return Some(if endpoint.starts_with(other) && tls {
            format!(
                "{endpoint:?}: with [cluster.tls] the etcd endpoints are https:// (e.g. {example})"
            )
        } else if endpoint.starts_with(other) {
            format!(
                "{endpoint:?}: https:// needs [cluster.tls] (ca, and cert and key when etcd checks \
                 client certificates)"
            )
        } else {
            format!("{endpoint:?}: expected {scheme}HOST:PORT (e.g. {example})")
        });
    };
    let authority = authority.strip_suffix('/').unwrap_or(authority);
    let port_ok = authority
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0));
    (!port_ok || authority.contains('/'))
        .then(|| format!("{endpoint:?}: expected {scheme}HOST:PORT (e.g. {example})"))
}

/// This machine's hostname, cut to what a fleet name may hold.
fn machine_hostname() -> String {
    let uname = rustix::system::uname();
    let name = uname.nodename().to_string_lossy();
    let name: String = name
        .chars()
        .map(|c| if fleet_name(&c.to_string()) { c } else { '-' })
        .take(63)
        .collect();
    if name.is_empty() { "host".into() } else { name }
}

impl Checker<'_> {
    pub(super) fn cluster(
        &mut self,
        raw: Spanned<RawCluster>,
        env: &HashMap<String, String>,
    ) -> Option<ClusterConfig> {
        let table = raw.span();
        let mut raw = raw.into_inner();
        // Written counts, even with a problem in it: the endpoints are checked for https then.
        let secure = raw.tls.is_some();
        let tls = raw.tls.take().and_then(|tls| self.etcd_tls(tls));
        let allow_insecure = raw.allow_insecure.as_ref().is_some_and(|a| *a.get_ref());
        if !secure && !allow_insecure {
            self.report(
                Some(table.clone()),
                "cluster.tls".into(),
                "missing: a fleet's membership travels between hosts, so the etcd client speaks \
                 TLS: add [cluster.tls] (ca, cert, key), or write allow_insecure = true in \
                 [cluster] to run without it on a network you trust",
            );
        }
        let etcd: Vec<String> = match env.get(ENV_ETCD) {
            Some(list) => {
                let endpoints: Vec<String> = list
                    .split(',')
                    .map(str::trim)
                    .filter(|e| !e.is_empty())
                    .map(str::to_owned)
                    .collect();
                for problem in endpoints.iter().filter_map(|e| endpoint_problem(e, secure)) {
                    self.report(None, format!("{ENV_ETCD} (cluster.etcd)"), problem);
                }
                endpoints
            }
            None => match raw.etcd {
                Some(list) => {
                    let span = list.span();
                    let endpoints = list.into_inner();
                    for problem in endpoints.iter().filter_map(|e| endpoint_problem(e, secure)) {
                        self.report(Some(span.clone()), "cluster.etcd".into(), problem);
                    }
                    if endpoints.is_empty() {
                        self.report(Some(span), "cluster.etcd".into(), "names no endpoint");
                    }
                    endpoints
                }
                None => {
                    self.report(
                        Some(table),
                        "cluster.etcd".into(),
                        format!(
                            "missing: a fleet needs its etcd endpoints (e.g. etcd = \
                             [\"https://127.0.0.1:2379\"]), or {ENV_ETCD}"
                        ),
                    );
                    Vec::new()
                }
            },
        };
        let name_rule = "letters, digits, '.', '_' and '-' only, at most 63";
        let host = self.valid(
            raw.host,
            "cluster.host".into(),
            |host: &String| !host.is_empty() && fleet_name(host),
            &format!("must not be empty: {name_rule}"),
            machine_hostname,
        );
        let region = self.valid(
            raw.region,
            "cluster.region".into(),
            |name: &String| fleet_name(name),
            name_rule,
            String::new,
        );
        let zone = self.valid(
            raw.zone,
            "cluster.zone".into(),
            |name: &String| fleet_name(name),
            name_rule,
            String::new,
        );
        let mut lease_ttl = DEFAULT_LEASE_TTL;
        self.millis(
            raw.lease_ttl_ms,
            "cluster.lease_ttl_ms",
            MIN_LEASE_TTL.as_millis() as u64,
            &mut lease_ttl,
        );
        // etcd counts whole seconds.
        let lease_ttl = Duration::from_secs(lease_ttl.as_millis().div_ceil(1000) as u64);
        let prefix = self.valid(
            raw.prefix,
            "cluster.prefix".into(),
            |prefix: &String| {
                prefix.starts_with('/')
                    && prefix.len() > 1
                    && !prefix.ends_with('/')
                    && prefix[1..]
                        .split('/')
                        .all(|part| !part.is_empty() && fleet_name(part))
            },
            "expected an absolute key path such as /peregrine (segments of letters, digits, '.', \
             '_' and '-'; no trailing '/')",
            || DEFAULT_PREFIX.into(),
        );
        let routing = self.choice(
            raw.routing,
            "cluster.routing",
            &Routing::ALL.map(|routing| (routing.as_str(), routing)),
        );
        let mut allowed_networks = Vec::new();
        if let Some(list) = raw.allowed_networks {
            let span = list.span();
            for entry in list.into_inner() {
                match entry.parse::<IpNet>() {
                    // Written as 10.1.2.3/8, it means 10.0.0.0/8.
                    Ok(net) => allowed_networks.push(net.trunc()),
                    Err(_) => {
                        self.report(
                            Some(span.clone()),
                            "cluster.allowed_networks".into(),
                            format!(
                                "{entry:?} is not a network: expected ADDRESS/PREFIX_LENGTH (e.g. \"10.0.0.0/8\")"
                            ),
                        );
                    }
                }
            }
        }
        Some(ClusterConfig {
            etcd,
            host,
            locality: Locality { region, zone },
            lease_ttl,
            prefix,
            routing,
            tls,
            allowed_networks,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, path::Path, time::Duration};

    use crate::config::{
        Config, Routing,
        testing::{parse, problems},
    };

    #[test]
    fn a_cluster_table_with_its_defaults() {
        assert_eq!(parse("[service.a]\n").unwrap().cluster, None, "single host");
        let config = parse(
            "[cluster]\nallow_insecure = true\netcd = [\"http://10.0.0.1:2379\", \"http://10.0.0.2:2379\"]\n\
             host = \"host-a\"\n[service.a]\n",
        )
        .unwrap();
        let cluster = config.cluster.unwrap();
        assert_eq!(cluster.etcd.len(), 2);
        assert_eq!(cluster.host, "host-a");
        assert_eq!(cluster.lease_ttl, Duration::from_secs(3));
        assert_eq!(cluster.prefix, "/peregrine");
        assert_eq!(cluster.routing, Routing::LocalFirst);
        assert_eq!(cluster.locality.region, "");
        let config = parse(
            "[cluster]\nallow_insecure = true\netcd = [\"http://127.0.0.1:2379\"]\nregion = \"r1\"\nzone = \"z1\"\n\
             lease_ttl_ms = 4500\nprefix = \"/fleets/blue\"\nrouting = \"fleet\"\n[service.a]\n",
        )
        .unwrap();
        let cluster = config.cluster.unwrap();
        assert!(!cluster.host.is_empty(), "the machine's hostname");
        assert_eq!(
            (
                cluster.locality.region.as_str(),
                cluster.locality.zone.as_str()
            ),
            ("r1", "z1")
        );
        assert_eq!(cluster.lease_ttl, Duration::from_secs(5), "whole seconds");
        assert_eq!(cluster.prefix, "/fleets/blue");
        assert_eq!(cluster.routing, Routing::Fleet);
    }

    #[test]
    fn every_cluster_key_is_checked_with_its_line() {
        let got = problems(
            "[cluster]\netcd = [\"10.0.0.1:2379\"]\nhost = \"a b\"\nregion = \"r/1\"\n\
             lease_ttl_ms = 1000\nprefix = \"peregrine/\"\nrouting = \"nearest\"\n\
             allow_insecure = true\n[service.a]\n",
        );
        assert_eq!(got.len(), 6, "{got:#?}");
        for (line, key) in [
            (2, "cluster.etcd"),
            (3, "cluster.host"),
            (4, "cluster.region"),
            (5, "cluster.lease_ttl_ms"),
            (6, "cluster.prefix"),
            (7, "cluster.routing"),
        ] {
            assert!(
                got.iter()
                    .any(|p| p.starts_with(&format!("line {line}: {key}: "))),
                "{key} on line {line}: {got:#?}"
            );
        }
        let got = problems("[cluster]\nhost = \"a\"\nallow_insecure = true\n[service.a]\n");
        assert!(
            got[0].starts_with("line 1: cluster.etcd: missing"),
            "{got:?}"
        );
    }

    #[test]
    fn allowed_networks_are_networks() {
        let config = parse(
            "[cluster]\nallow_insecure = true\netcd = [\"http://10.0.0.1:2379\"]\n\
             allowed_networks = [\"10.1.2.3/8\", \"fd00::/8\"]\n[service.a]\n",
        )
        .unwrap();
        let networks: Vec<String> = config
            .cluster
            .unwrap()
            .allowed_networks
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(networks, ["10.0.0.0/8", "fd00::/8"], "written as a network");
        let got = problems(
            "[cluster]\nallow_insecure = true\netcd = [\"http://10.0.0.1:2379\"]\n\
             allowed_networks = [\"10.0.0.0\", \"10.0.0.0/33\"]\n[service.a]\n",
        );
        assert_eq!(
            got,
            [
                "line 4: cluster.allowed_networks: \"10.0.0.0\" is not a network: expected \
                 ADDRESS/PREFIX_LENGTH (e.g. \"10.0.0.0/8\")",
                "line 4: cluster.allowed_networks: \"10.0.0.0/33\" is not a network: expected \
                 ADDRESS/PREFIX_LENGTH (e.g. \"10.0.0.0/8\")",
            ]
        );
    }

    #[test]
    fn the_environment_names_the_etcd_endpoints() {
        let env = HashMap::from([(
            "PEREGRINE_ETCD".to_string(),
            "http://127.0.0.1:2379, http://127.0.0.1:2381".to_string(),
        )]);
        let source =
            "[cluster]\netcd = [\"http://10.9.9.9:2379\"]\nallow_insecure = true\n[service.a]\n";
        let config = Config::parse(source, Path::new("/etc/peregrine"), &env).unwrap();
        assert_eq!(
            config.cluster.unwrap().etcd,
            ["http://127.0.0.1:2379", "http://127.0.0.1:2381"]
        );
        // It also fills a table that names none.
        let config = Config::parse(
            "[cluster]\nallow_insecure = true\n[service.a]\n",
            Path::new("/etc/peregrine"),
            &env,
        )
        .unwrap();
        assert_eq!(config.cluster.unwrap().etcd.len(), 2);
    }

    #[test]
    fn a_fleet_speaks_tls_to_etcd_unless_told_otherwise() {
        let got = problems("[cluster]\netcd = [\"http://10.0.0.1:2379\"]\n[service.a]\n");
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(
            got[0].starts_with("line 1: cluster.tls: missing") && got[0].contains("allow_insecure"),
            "{got:?}"
        );
        let got = problems(
            "[cluster]\netcd = [\"http://10.0.0.1:2379\"]\nallow_insecure = false\n[service.a]\n",
        );
        assert!(
            got[0].contains("cluster.tls: missing"),
            "false is no: {got:?}"
        );
        let config = parse(
            "[cluster]\netcd = [\"https://10.0.0.1:2379\"]\n[cluster.tls]\nca = \"tls/etcd-ca.pem\"\n\
             cert = \"tls/etcd-client.pem\"\nkey = \"tls/etcd-client.key\"\n[service.a]\n",
        )
        .unwrap();
        let tls = config.cluster.unwrap().tls.unwrap();
        assert_eq!(
            tls.ca,
            std::path::PathBuf::from("/etc/peregrine/tls/etcd-ca.pem")
        );
        assert!(tls.identity.is_some());
        // The scheme follows [cluster.tls].
        let got = problems(
            "[cluster]\netcd = [\"http://10.0.0.1:2379\"]\n[cluster.tls]\nca = \"c\"\n[service.a]\n",
        );
        assert!(
            got[0].contains("with [cluster.tls] the etcd endpoints are https://"),
            "{got:?}"
        );
        let got = problems(
            "[cluster]\netcd = [\"https://10.0.0.1:2379\"]\nallow_insecure = true\n[service.a]\n",
        );
        assert!(got[0].contains("https:// needs [cluster.tls]"), "{got:?}");
        let got = problems(
            "[cluster]\netcd = [\"https://10.0.0.1:2379\"]\n\n[cluster.tls]\ncert = \"c\"\n[service.a]\n",
        );
        assert!(
            got.iter()
                .any(|p| p.starts_with("line 4: cluster.tls.ca: missing")),
            "{got:?}"
        );
        assert!(
            got.iter()
                .any(|p| p.starts_with("line 4: cluster.tls.key: missing")),
            "{got:?}"
        );
    }
}
