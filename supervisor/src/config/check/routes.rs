//! The checks across services of what Envoy's bootstrap makes of them together
//! (`peregrine envoy-bootstrap`, [`bootstrap`](crate::bootstrap)): the clusters it names and the
//! routes it writes.
//!
//! Invariant: Envoy takes the bootstrap, and every route the file writes reaches its service. No
//! service takes the name of the static cluster that reaches the supervisor's gRPC port (Envoy
//! would send the service's requests there). Services with the same list of domains share a
//! virtual host, so no two of them have the same prefix when either writes its route (`prefix` or
//! `domains`): the first route would take every request. Services that write neither share the
//! default route (`/` on `*`), which goes to the first of them by name; they are accepted, for an
//! Envoy whose routes are its own (it reaches every service's cluster by name). Services with other
//! lists of domains have virtual hosts of their own, so they have no domain in common (Envoy
//! refuses a domain in two virtual hosts, and twice in one: it compares them lowercased).

use std::{collections::BTreeMap, ops::Range};

use super::{Checker, service::ServiceSpans};
use crate::config::{ServiceConfig, raw::key_part};

type Span = Range<usize>;

/// The default of `supervisor.xds_cluster`.
pub(super) const DEFAULT_XDS_CLUSTER: &str = "xds_cluster";

/// `supervisor.xds_cluster`, checked, and where the file writes it.
#[derive(Clone, Debug)]
pub(super) struct XdsClusterName {
    /// The name (the default when left out or invalid).
    pub(super) name: String,
    /// Its span; `None` when left out.
    pub(super) span: Option<Span>,
}

impl Checker<'_> {
    /// The checks of the module's invariant over every service (`written`: where the file writes
    /// each one's keys).
    pub(super) fn routes(
        &mut self,
        services: &BTreeMap<String, ServiceConfig>,
        written: &BTreeMap<String, ServiceSpans>,
        xds_cluster: &XdsClusterName,
    ) {
        let spans = |name: &str| written.get(name).cloned().unwrap_or_default();
        if let Some(service) = services.get(&xds_cluster.name) {
            let how = match xds_cluster.span {
                Some(_) => "supervisor.xds_cluster names",
                None => "is, by default (supervisor.xds_cluster),",
            };
            self.report(
                spans(&service.name).name,
                format!("service.{}", key_part(&service.name)),
                format!(
                    "{how} the cluster in Envoy's bootstrap that reaches the supervisor's gRPC \
                     port: Envoy would send this service's requests to the supervisor; rename the \
                     service, or set supervisor.xds_cluster to another name"
                ),
            );
        }
        // The services in the bootstrap's order (by name): a route written first is matched first.
        let mut domain_owners: BTreeMap<String, &ServiceConfig> = BTreeMap::new();
        // Each route's first service, and whether the file writes its route.
        let mut routes: BTreeMap<(&[String], &str), (&ServiceConfig, bool)> = BTreeMap::new();
        for service in services.values() {
            let spans = spans(&service.name);
            let table = format!("service.{}", key_part(&service.name));
            let domains_span = spans.domains.clone().or(spans.name.clone());
            let mut own: Vec<String> = Vec::new();
            let mut clashes: Vec<(&str, &ServiceConfig)> = Vec::new();
            for domain in &service.domains {
                let lowercase = domain.to_ascii_lowercase();
                if own.contains(&lowercase) {
                    self.report(
                        domains_span.clone(),
                        format!("{table}.domains"),
                        format!(
                            "{domain:?} is written twice: Envoy refuses a domain twice in its \
                             routes (it compares them lowercased)"
                        ),
                    );
                    continue;
                }
                own.push(lowercase.clone());
                match domain_owners.get(&lowercase) {
                    Some(other) if other.domains != service.domains => {
                        if !clashes.iter().any(|(_, seen)| seen.name == other.name) {
                            clashes.push((domain, other));
                        }
                    }
                    Some(_) => {}
                    None => {
                        domain_owners.insert(lowercase, service);
                    }
                }
            }
            for (domain, other) in clashes {
                self.report(
                    domains_span.clone(),
                    format!("{table}.domains"),
                    format!(
                        "{domain:?} is a domain of service {} too, whose domains are another \
                         list: the bootstrap gives each list of domains a virtual host, and Envoy \
                         refuses a domain in two; give both services the same domains (in the \
                         same order), or none in common",
                        key_part(&other.name)
                    ),
                );
            }
            let route = (service.domains.as_slice(), service.prefix.as_str());
            let routed = spans.prefix.is_some() || spans.domains.is_some();
            match routes.get(&route) {
                Some((first, first_routed)) if routed || *first_routed => self.report(
                    spans.prefix.clone().or(spans.name.clone()),
                    format!("{table}.prefix"),
                    format!(
                        "{:?} is the prefix of service {} too, on the same domains: Envoy sends \
                         every request it matches to {} (the first route), and this service \
                         would get none; give one of them another prefix or other domains",
                        service.prefix,
                        key_part(&first.name),
                        key_part(&first.name),
                    ),
                ),
                Some(_) => {}
                None => {
                    routes.insert(route, (service, routed));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::testing::{parse, problems};

    #[test]
    fn a_service_may_not_take_the_xds_clusters_name() {
        assert_eq!(
            problems("[service.web]\n\n[service.xds_cluster]\ncount = 2\n"),
            [
                "line 3: service.xds_cluster: is, by default (supervisor.xds_cluster), the \
                 cluster in Envoy's bootstrap that reaches the supervisor's gRPC port: Envoy \
                 would send this service's requests to the supervisor; rename the service, or \
                 set supervisor.xds_cluster to another name"
            ]
        );
        // The name the file gives the xDS cluster is the one reserved.
        let got = problems("[supervisor]\nxds_cluster = \"control\"\n[service.control]\n");
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(
            got[0].starts_with(
                "line 3: service.control: supervisor.xds_cluster names the cluster in Envoy's \
                 bootstrap"
            ),
            "{got:?}"
        );
        assert!(parse("[supervisor]\nxds_cluster = \"control\"\n[service.xds_cluster]\n").is_ok());
    }

    #[test]
    fn two_services_on_one_route_are_refused_naming_both() {
        assert_eq!(
            problems("[service.api]\n[service.web]\ncount = 2\nprefix = \"/\"\n"),
            [
                "line 4: service.web.prefix: \"/\" is the prefix of service api too, on the same \
                 domains: Envoy sends every request it matches to api (the first route), and this \
                 service would get none; give one of them another prefix or other domains"
            ]
        );
        let got = problems(
            "[service.api]\nprefix = \"/v1/\"\n[service.web]\nprefix = \"/\"\n\
             [service.www]\ndomains = [\"*\"]\n\nprefix = \"/v1/\"\n",
        );
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(
            got[0].starts_with(
                "line 8: service.www.prefix: \"/v1/\" is the prefix of service api too"
            ),
            "{got:?}"
        );
        // A route the file writes is refused where another service's default one takes it.
        let got = problems("[service.api]\nprefix = \"/\"\n[service.web]\n");
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(
            got[0]
                .starts_with("line 3: service.web.prefix: \"/\" is the prefix of service api too"),
            "{got:?}"
        );
        // Services that write no route share the default one, for an Envoy with routes of its own.
        assert!(parse("[service.api]\n[service.web]\n").is_ok());
        // Other prefixes, or the same prefix on other domains, are reachable.
        assert!(
            parse(
                "[service.api]\nprefix = \"/api\"\n[service.web]\n\
                 [service.blog]\ndomains = [\"blog.example\"]\n\
                 [service.shop]\ndomains = [\"shop.example\", \"www.shop.example\"]\n"
            )
            .is_ok()
        );
    }

    #[test]
    fn a_domain_is_in_one_virtual_host_once() {
        let got = problems(
            "[service.a]\ndomains = [\"A.example\"]\n\
             [service.b]\nprefix = \"/b\"\ndomains = [\"a.example\", \"b.example\"]\n\
             [service.c]\ndomains = [\"c.example\", \"C.example\"]\n",
        );
        assert_eq!(
            got,
            [
                "line 5: service.b.domains: \"a.example\" is a domain of service a too, whose \
                 domains are another list: the bootstrap gives each list of domains a virtual \
                 host, and Envoy refuses a domain in two; give both services the same domains \
                 (in the same order), or none in common",
                "line 7: service.c.domains: \"C.example\" is written twice: Envoy refuses a \
                 domain twice in its routes (it compares them lowercased)",
            ]
        );
        let got = problems("[service.a]\n[service.b]\nprefix = \"/b\"\ndomains = [\"*\", \"b\"]\n");
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(
            got[0].starts_with("line 4: service.b.domains: \"*\" is a domain of service a too"),
            "{got:?}"
        );
    }
}
