//! Out-of-band ORCA clusters ignore the load a worker states about itself.
//!
//! Envoy's client-side weighted round robin reads a load report from every response that carries
//! one (`endpoint-load-metrics-bin`, or `endpoint-load-metrics` in its text, JSON or binary forms),
//! whether or not its out-of-band streams are on, and has no setting to ignore them. Out of band, the
//! reports are the supervisor's, from the kernel's account of each worker; a worker, or a server on
//! a passed socket, that sets the header itself would outweigh them at every response.
//!
//! So an out-of-band ORCA cluster gets an upstream HTTP filter chain that removes these headers
//! (and trailers) from each response before Envoy's router reads it: a `header_mutation` filter, then
//! the `upstream_codec` filter that every upstream chain ends with. Clients never see them either.
//! In band, the header *is* the report, and is left alone.
//!
//! Invariant: the upstream chain of an out-of-band ORCA cluster removes every header Envoy reads
//! a load report from.

use envoy_types::pb::envoy::{
    config::common::mutation_rules::v3::{HeaderMutation, header_mutation::Action},
    extensions::filters::{
        http::{
            header_mutation::v3::{HeaderMutation as HeaderMutationFilter, Mutations},
            upstream_codec::v3::UpstreamCodec,
        },
        network::http_connection_manager::v3::{HttpFilter, http_filter::ConfigType},
    },
};

use super::resources::pack;

/// The response headers Envoy reads a per-request load report from: the binary report in base64,
/// the `TEXT`/`JSON`/`BIN`-prefixed one, and the JSON one of Envoy releases before 1.39.
pub const LOAD_REPORT_HEADERS: [&str; 3] = [
    "endpoint-load-metrics-bin",
    "endpoint-load-metrics",
    "endpoint-load-metrics-json",
];

/// The name of the filter that removes them.
pub const HEADER_MUTATION_FILTER: &str = "envoy.filters.http.header_mutation";
/// The name of the filter every upstream chain must end with.
pub const UPSTREAM_CODEC_FILTER: &str = "envoy.filters.http.upstream_codec";

/// The upstream HTTP filters of an out-of-band ORCA cluster: the workers' own load reports removed
/// from response headers and trailers, then the codec.
pub fn upstream_filters() -> Vec<HttpFilter> {
    let removals = || {
        LOAD_REPORT_HEADERS
            .iter()
            .map(|name| HeaderMutation {
                action: Some(Action::Remove((*name).to_string())),
            })
            .collect::<Vec<_>>()
    };
    let strip = HeaderMutationFilter {
        mutations: Some(Mutations {
            response_mutations: removals(),
            response_trailers_mutations: removals(),
            ..Default::default()
        }),
        ..Default::default()
    };
    vec![
        HttpFilter {
            name: HEADER_MUTATION_FILTER.into(),
            config_type: Some(ConfigType::TypedConfig(pack(&strip))),
            ..Default::default()
        },
        HttpFilter {
            name: UPSTREAM_CODEC_FILTER.into(),
            config_type: Some(ConfigType::TypedConfig(pack(&UpstreamCodec {}))),
            ..Default::default()
        },
    ]
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    #[test]
    fn the_chain_removes_every_load_report_header_and_trailer_then_ends_with_the_codec() {
        let filters = upstream_filters();
        let names: Vec<&str> = filters.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, [HEADER_MUTATION_FILTER, UPSTREAM_CODEC_FILTER]);
        let Some(ConfigType::TypedConfig(any)) = &filters[0].config_type else {
            panic!("a typed config: {filters:?}");
        };
        assert_eq!(
            any.type_url,
            "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
        );
        let mutations = HeaderMutationFilter::decode(any.value.as_slice())
            .unwrap()
            .mutations
            .unwrap();
        let removed = |list: &[HeaderMutation]| -> Vec<String> {
            list.iter()
                .map(|m| match &m.action {
                    Some(Action::Remove(name)) => name.clone(),
                    other => panic!("a removal: {other:?}"),
                })
                .collect()
        };
        for list in [
            &mutations.response_mutations,
            &mutations.response_trailers_mutations,
        ] {
            assert_eq!(
                removed(list),
                [
                    "endpoint-load-metrics-bin",
                    "endpoint-load-metrics",
                    "endpoint-load-metrics-json"
                ]
            );
        }
        assert!(mutations.request_mutations.is_empty());
    }
}
