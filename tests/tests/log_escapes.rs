//! What an xDS client sends reaches the supervisor's text log escaped: a node id or a NACK message
//! with a newline and a terminal escape cannot forge a log line nor clear the reader's screen.

use std::time::Duration;

use envoy_types::pb::{
    envoy::{
        config::core::v3::Node,
        service::{
            discovery::v3::DiscoveryRequest,
            endpoint::v3::endpoint_discovery_service_client::EndpointDiscoveryServiceClient,
        },
    },
    google::rpc::Status,
};
use peregrine_e2e::{PeregrineToml, ServiceTable, Supervisor, free_port, wait_until};

const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const FORGED: &str = "\n2026-12-07T00:00:00.000000Z ERROR forged: the supervisor is compromised";
const CLEAR: &str = "\x1b[2J";

#[test]
fn a_clients_node_id_and_nack_reach_the_log_escaped() {
    let grpc = free_port();
    let mut config = PeregrineToml::local(grpc);
    config.service(
        "web",
        ServiceTable::at(format!("http://127.0.0.1:{}", free_port())),
    );
    let supervisor = Supervisor::start(&config.toml());
    wait_until(Duration::from_secs(30), "the worker registered", || {
        supervisor.status_pids().ok().filter(|pids| pids.len() == 1)
    });

    // A thread of its own drives the client's connection while the test waits on the log.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut client =
            EndpointDiscoveryServiceClient::connect(format!("http://127.0.0.1:{grpc}"))
                .await
                .expect("connect to the supervisor");
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let request = |nonce: String, error: Option<Status>| DiscoveryRequest {
            node: Some(Node {
                id: format!("envoy{FORGED}{CLEAR}"),
                ..Node::default()
            }),
            type_url: EDS.into(),
            resource_names: vec!["web".into()],
            response_nonce: nonce,
            error_detail: error,
            ..DiscoveryRequest::default()
        };
        tx.send(request(String::new(), None)).unwrap();
        let mut responses = client
            .stream_endpoints(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .expect("an EDS stream")
            .into_inner();
        let response = tokio::time::timeout(Duration::from_secs(10), responses.message())
            .await
            .expect("a response in time")
            .expect("a response")
            .expect("a response");
        let nack = Status {
            code: 3,
            message: format!("rejected{FORGED} nack{CLEAR}"),
            ..Status::default()
        };
        tx.send(request(response.nonce, Some(nack))).unwrap();
        let logs = wait_until(Duration::from_secs(10), "the NACK logged", || {
            let logs = supervisor.logs();
            logs.contains("Envoy rejected a response (NACK)")
                .then_some(logs)
        });
        drop(tx);
        let nack = logs
            .lines()
            .find(|line| line.contains("Envoy rejected a response (NACK)"))
            .unwrap();
        assert!(
            nack.contains("envoy\\x0a2026-12-07T00:00:00.000000Z ERROR forged"),
            "the node id is escaped: {nack}"
        );
        assert!(nack.contains("nack\\x1b[2J"), "the NACK is escaped: {nack}");
        assert!(
            !logs
                .lines()
                .any(|line| line.starts_with("2026-12-07T00:00:00")),
            "no forged line:\n{logs}"
        );
        assert!(!logs.contains(CLEAR), "no raw escape:\n{logs:?}");
    });
}
