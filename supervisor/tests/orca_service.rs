//! The ORCA service with a scripted gRPC client on port 0: a stream names its worker by `:authority`,
//! an unknown one gets NOT_FOUND, the first report waits for a real sample, reports come no faster
//! than the floor, every report carries non-zero fields, and the stream ends with OK when the worker
//! leaves the registry.

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use peregrine_proto::xds::service::orca::v3::{
    OrcaLoadReportRequest, open_rca_service_client::OpenRcaServiceClient,
};
use peregrine_supervisor::{
    orca::{OrcaService, stats::OrcaStats},
    registry::{Address, Loads, Protocol, Registry, Worker, WorkerLoad},
    run,
    xds::{XdsOptions, acks::Acks},
};
use tokio::sync::oneshot;
use tonic::{Code, transport::Endpoint};

const WITHIN: Duration = Duration::from_secs(5);

struct Server {
    port: u16,
    /// What the service records of its streams.
    stats: Arc<OrcaStats>,
    _stop: oneshot::Sender<()>,
}

async fn start(registry: Arc<Registry>, min_interval: Duration) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop, stopped) = oneshot::channel::<()>();
    let stats = Arc::new(OrcaStats::default());
    tokio::spawn(run::grpc::serve(
        run::grpc::Ports::single(listener, 1024),
        run::grpc::Inputs {
            snapshots: registry.subscribe(),
            options: tokio::sync::watch::channel(XdsOptions::default()).1,
            acks: Arc::new(Acks::default()),
            counters: Default::default(),
            orca: Some(OrcaService::new(registry, stats.clone(), min_interval)),
        },
        async {
            let _ = stopped.await;
        },
    ));
    Server {
        port,
        stats,
        _stop: stop,
    }
}

/// A client whose requests carry `:authority` = `authority`, as Envoy's do.
async fn client(port: u16, authority: &str) -> OpenRcaServiceClient<tonic::transport::Channel> {
    let channel = Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .origin(format!("http://{authority}").parse().unwrap())
        .connect()
        .await
        .unwrap();
    OpenRcaServiceClient::new(channel)
}

fn request(interval: Duration) -> OrcaLoadReportRequest {
    OrcaLoadReportRequest {
        report_interval: Some(envoy_types::pb::google::protobuf::Duration {
            seconds: interval.as_secs() as i64,
            nanos: interval.subsec_nanos() as i32,
        }),
        request_cost_names: vec![],
    }
}

fn web_worker(pid: u32) -> Worker {
    Worker::ready(
        "web",
        0,
        pid,
        vec![Protocol::Http2],
        vec![Address::Tcp(([127, 0, 0, 1], 9).into())],
    )
}

fn sampled(pid: u32, rates: bool) -> Loads {
    Loads::new(
        None,
        [WorkerLoad {
            service: "web".into(),
            index: 0,
            pid,
            cpu_cores: rates.then_some(0.3),
            runq_wait_cores: rates.then_some(0.1),
            requests_per_second: rates.then_some(120.0),
            cpu_seconds_total: 1.0,
            runq_wait_seconds_total: 0.1,
            requests_total: 500,
            in_flight: None,
            in_flight_now: None,
            in_flight_utilization: None,
            smoothed: None,
            sampled_at: SystemTime::now(),
        }],
    )
}

#[tokio::test]
async fn an_unknown_authority_gets_not_found() {
    let registry = Arc::new(Registry::new(["web".to_string()]));
    let server = start(registry, Duration::from_millis(10)).await;
    let mut client = client(server.port, "web-0-999").await;
    let error = client
        .stream_core_metrics(request(Duration::from_secs(1)))
        .await
        .expect_err("no such worker");
    assert_eq!(error.code(), Code::NotFound, "{error:?}");
    assert!(error.message().contains("web-0-999"), "{error:?}");
}

#[tokio::test]
async fn a_worker_stream_reports_real_samples_at_the_interval_and_ends_when_the_worker_goes() {
    let registry = Arc::new(Registry::new(["web".to_string()]));
    let worker = web_worker(4242);
    registry.register(worker.clone()).unwrap();
    registry.publish_loads(sampled(4242, false));
    // Envoy asks for 10 ms; the floor is 100 ms.
    let server = start(registry.clone(), Duration::from_millis(100)).await;
    let mut client = client(server.port, &worker.hostname).await;
    let mut stream = client
        .stream_core_metrics(request(Duration::from_millis(10)))
        .await
        .expect("a stream for a registered worker")
        .into_inner();

    // Only a baseline so far: no report.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), stream.message())
            .await
            .is_err(),
        "a report before a real sample"
    );
    let stream_open = server.stats.current(&registry.snapshot());
    assert_eq!(stream_open[&worker.hostname].open, 1);

    registry.publish_loads(sampled(4242, true));
    let first = tokio::time::timeout(WITHIN, stream.message())
        .await
        .expect("the first report as soon as a real sample exists")
        .unwrap()
        .expect("a report");
    assert_eq!(first.cpu_utilization, 0.3);
    assert!((first.application_utilization - 0.4).abs() < 1e-9);
    assert_eq!(first.rps_fractional, 120.0);

    let started = tokio::time::Instant::now();
    for _ in 0..3 {
        tokio::time::timeout(WITHIN, stream.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
    let elapsed = started.elapsed();
    // Three intervals of 100 ms, less the first one's delivery jitter (the clock starts when the first
    // report arrives): well above the 30 ms that Envoy's 10 ms would take.
    assert!(
        elapsed >= Duration::from_millis(200),
        "3 reports in {elapsed:?}: faster than the 100 ms floor"
    );
    assert!(server.stats.current(&registry.snapshot())[&worker.hostname].reports >= 4);

    assert!(registry.deregister("web", 0, 4242));
    let end = tokio::time::timeout(WITHIN, async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the stream ends when the worker goes");
    assert!(
        matches!(end, Ok(None)),
        "ended with OK, not an error: {end:?}"
    );
    tokio::time::timeout(WITHIN, async {
        while server
            .stats
            .current(&registry.snapshot())
            .contains_key(&worker.hostname)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the gone worker's stream state is dropped");
}
