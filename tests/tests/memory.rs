//! Memory after a flood: what thousands of ORCA streams cost the supervisor is given back once they
//! are gone, and floods in a row do not add up (no leak).

use std::time::{Duration, Instant};

use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use peregrine_e2e::{PeregrineToml, ServiceTable, Supervisor, config::Orca, free_port, wait_until};
use peregrine_proto::xds::service::orca::v3::{
    OrcaLoadReportRequest, open_rca_service_client::OpenRcaServiceClient,
};
use tonic::transport::Endpoint;

/// Floods in a row: the memory goes back after each, so none adds up.
const ROUNDS: usize = 2;
/// How far above its RSS before the floods the supervisor may stay (debug build: 35-41 MiB from
/// 28 after 3,200 streams that held it at 75-80; without a trim it stayed at 92-106 from 44).
const SLACK_MIB: f64 = 24.0;
/// Connections of a flood, and streams on each (multiplexed: too few connections closing for a
/// count of connections to notice).
const CONNECTIONS: usize = 16;
const STREAMS_PER_CONNECTION: usize = 200;

fn rss_mib(pid: u32) -> f64 {
    peregrine_contract::procfs::status(pid).map_or(0.0, |status| status.rss_kib as f64 / 1024.0)
}

/// Opens [`CONNECTIONS`] x [`STREAMS_PER_CONNECTION`] ORCA streams for `hostname` on the gRPC
/// port, waits for every stream's first report, holds them `hold`, and closes them all.
fn flood(port: u16, hostname: &str, hold: Duration) -> usize {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut streams = Vec::new();
        for _ in 0..CONNECTIONS {
            let channel = Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
                .unwrap()
                .origin(format!("http://{hostname}").parse().unwrap())
                .connect()
                .await
                .expect("connecting to the gRPC port");
            for _ in 0..STREAMS_PER_CONNECTION {
                let mut client = OpenRcaServiceClient::new(channel.clone());
                streams.push(tokio::spawn(async move {
                    let mut reports = client
                        .stream_core_metrics(OrcaLoadReportRequest {
                            report_interval: Some(ProtoDuration {
                                seconds: 0,
                                nanos: 200_000_000,
                            }),
                            request_cost_names: Vec::new(),
                        })
                        .await
                        .ok()?
                        .into_inner();
                    reports.message().await.ok()??;
                    Some(reports)
                }));
            }
        }
        let mut open = Vec::new();
        for stream in streams {
            if let Ok(Some(reports)) = stream.await {
                open.push(reports);
            }
        }
        tokio::time::sleep(hold).await;
        open.len()
    })
}

#[test]
fn memory_goes_back_after_floods_of_orca_streams() {
    let grpc = free_port();
    let mut config = PeregrineToml::local(grpc);
    config.service("web", ServiceTable::at("http://127.0.0.1:0").orca(Orca::On));
    let supervisor = Supervisor::start(&config.toml());
    let hostname = wait_until(Duration::from_secs(30), "the worker ready", || {
        let status = supervisor.status_json().ok()?;
        status["workers"][0]["hostname"].as_str().map(str::to_owned)
    });
    let pid = supervisor.pid();
    let before = rss_mib(pid);
    for round in 0..ROUNDS {
        let opened = flood(grpc, &hostname, Duration::from_secs(1));
        assert!(
            opened >= CONNECTIONS * STREAMS_PER_CONNECTION * 9 / 10,
            "only {opened} streams served"
        );
        let held = rss_mib(pid);
        let closed = Instant::now();
        let after = wait_until(
            Duration::from_secs(15),
            &format!("RSS back below {before:.1} + {SLACK_MIB} MiB after flood {round}"),
            || Some(rss_mib(pid)).filter(|rss| *rss <= before + SLACK_MIB),
        );
        eprintln!(
            "flood {round}: {opened} streams; RSS {before:.1} MiB before, {held:.1} held, \
             {after:.1} after {:.1} s",
            closed.elapsed().as_secs_f64()
        );
    }
}
