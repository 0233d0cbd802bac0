//! An EDS stream that never ACKs (anyone who can reach the gRPC port can open one) does not hold up
//! drains: once it has owed its answer for the silence grace, a rolling restart of the real
//! supervisor's workers goes at the speed of the drains, and `peregrine status` names the stream as
//! silent. One that ACKs every push seconds late (never silent) costs each drain at most the late
//! bound.

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::{
    config::core::v3::Node,
    service::{
        discovery::v3::DiscoveryRequest,
        endpoint::v3::endpoint_discovery_service_client::EndpointDiscoveryServiceClient,
    },
};
use peregrine_e2e::{
    PeregrineToml, ServiceTable, Supervisor, config::Sampler, free_port, wait_until,
};
use peregrine_supervisor::xds::acks::{LATE_ANSWER, SILENCE_GRACE};
use tokio_stream::wrappers::ReceiverStream;

const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

#[test]
fn a_stream_that_never_acks_does_not_stall_a_rolling_restart() {
    let grpc = free_port();
    let mut config = PeregrineToml::local(grpc);
    config.supervisor.sampler = Some(Sampler::Off);
    config.service("web", ServiceTable::default().count(2));
    let supervisor = Supervisor::start(&config.toml());
    wait_until(Duration::from_secs(30), "two workers registered", || {
        (supervisor.status_pids().ok()?.len() == 2).then_some(())
    });
    let runtime = tokio::runtime::Runtime::new().unwrap();
    // The script: subscribe to the service's endpoints, take the first response, never answer.
    let (_requests, mut responses) = runtime.block_on(async {
        let mut client =
            EndpointDiscoveryServiceClient::connect(format!("http://127.0.0.1:{grpc}"))
                .await
                .expect("connected");
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tx.send(DiscoveryRequest {
            node: Some(Node {
                id: "never-acks".into(),
                ..Default::default()
            }),
            type_url: EDS.into(),
            resource_names: vec!["web".into()],
            ..Default::default()
        })
        .await
        .unwrap();
        let responses = client
            .stream_endpoints(ReceiverStream::new(rx))
            .await
            .expect("stream opened")
            .into_inner();
        (tx, responses)
    });
    let first = runtime.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), responses.message()).await
    });
    assert!(matches!(first, Ok(Ok(Some(_)))), "{first:?}");
    let opened = Instant::now();
    let table = wait_until(SILENCE_GRACE * 3, "the stream shown as silent", || {
        let table = supervisor.status_table().ok()?;
        table
            .contains("never-acks (eds) not synced yet, silent for")
            .then_some(table)
    });
    assert!(
        opened.elapsed() >= SILENCE_GRACE - Duration::from_millis(100),
        "{table}"
    );

    // Two drains; each waited 10 s (drain_timeout_ms) for the script before.
    let started = Instant::now();
    let output = supervisor.control("restart", &[]).expect("restart");
    let took = started.elapsed();
    assert!(output.contains("2 replaced"), "{output}");
    assert!(
        took < Duration::from_secs(4),
        "the restart took {took:?}: {output}"
    );
    let logs = supervisor.logs();
    assert!(
        logs.contains(r#"silent=["never-acks"]"#),
        "the drain says whom it did not wait for:\n{logs}"
    );
    assert!(
        !logs.contains("Not every Envoy ACKed the drain in time"),
        "{logs}"
    );
    drop(responses);
}

#[test]
fn a_stream_that_acks_every_push_late_costs_each_drain_at_most_the_late_bound() {
    let grpc = free_port();
    let mut config = PeregrineToml::local(grpc);
    config.supervisor.sampler = Some(Sampler::Off);
    config.service("web", ServiceTable::default().count(4));
    let supervisor = Supervisor::start(&config.toml());
    wait_until(Duration::from_secs(30), "four workers registered", || {
        (supervisor.status_pids().ok()?.len() == 4).then_some(())
    });
    let runtime = tokio::runtime::Runtime::new().unwrap();
    // The script: subscribe to the service's endpoints and ACK every response 4.5 s after it came,
    // so it always answers within the silence grace and never turns silent.
    let late_by = Duration::from_millis(4500);
    let (tx, mut responses, subscribe) = runtime.block_on(async move {
        let mut client =
            EndpointDiscoveryServiceClient::connect(format!("http://127.0.0.1:{grpc}"))
                .await
                .expect("connected");
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let subscribe = DiscoveryRequest {
            type_url: EDS.into(),
            resource_names: vec!["web".into()],
            ..Default::default()
        };
        tx.send(DiscoveryRequest {
            node: Some(Node {
                id: "acks-late".into(),
                ..Default::default()
            }),
            ..subscribe.clone()
        })
        .await
        .unwrap();
        let responses = client
            .stream_endpoints(ReceiverStream::new(rx))
            .await
            .expect("stream opened")
            .into_inner();
        (tx, responses, subscribe)
    });
    let script = runtime.spawn(async move {
        while let Ok(Some(response)) = responses.message().await {
            tokio::time::sleep(late_by).await;
            let ack = DiscoveryRequest {
                version_info: response.version_info,
                response_nonce: response.nonce,
                ..subscribe.clone()
            };
            if tx.send(ack).await.is_err() {
                return;
            }
        }
    });
    wait_until(late_by * 3, "the late stream synced once", || {
        let status = supervisor.status_json().ok()?;
        let streams = status["xds_streams"].as_array()?;
        streams
            .iter()
            .any(|s| s["node"] == "acks-late" && s["synced_revision"].is_u64())
            .then_some(())
    });

    // Four drains; before the late bound, each waited for the script's late ACK: 29 s in all.
    let started = Instant::now();
    let output = supervisor.control("restart", &[]).expect("restart");
    let took = started.elapsed();
    assert!(output.contains("4 replaced"), "{output}");
    eprintln!("a rolling restart of 4 workers beside a stream that ACKs late took {took:?}");
    assert!(
        took < LATE_ANSWER * 4 + Duration::from_secs(3),
        "the restart took {took:?}: {output}"
    );
    let logs = supervisor.logs();
    assert_eq!(
        logs.matches(r#"late=["acks-late"]"#).count(),
        4,
        "each drain says whom it stopped waiting for:\n{logs}"
    );
    assert!(!logs.contains(r#"silent=["acks-late"]"#), "{logs}");
    script.abort();
}
