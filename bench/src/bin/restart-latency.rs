//! Benchmark: from a worker's SIGKILL to the real Envoy holding its replacement endpoint.
//!
//! Runs `peregrine run` (the binary named by `PEREGRINE`, else a debug build) with 2 hello workers and
//! the real Envoy, kills a worker `--kills` times (20 by default), with `--user NAME` as that service
//! `user` (a root supervisor switching each worker to it), and splits each kill into:
//!
//! - **exit**: SIGKILL -> the EDS push without the dead worker (pidfd wake-up, reap, deregistration);
//! - **restart**: SIGKILL -> the EDS push with the replacement (backoff, spawn, bind, register, publish);
//! - **xDS**: that push -> Envoy's admin `/clusters` listing the replacement (Envoy receiving and
//!   applying it; admin is polled every millisecond, so this part is exact to about 1 ms).
//!
//! The pushes are timestamped by a scripted EDS subscriber of our own on the supervisor's gRPC port,
//! which sees what Envoy's EDS stream sees at the same moment. `healthy_after_ms` is set low so that
//! every kill restarts after the initial backoff (100 ms), not a grown one.
//!
//! `cargo xtask bench restart` builds in release mode and runs this.

use std::{
    collections::BTreeSet,
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use envoy_types::pb::envoy::{
    config::{
        core::v3::Node, endpoint::v3::ClusterLoadAssignment,
        endpoint::v3::lb_endpoint::HostIdentifier,
    },
    service::{
        discovery::v3::DiscoveryRequest,
        endpoint::v3::endpoint_discovery_service_client::EndpointDiscoveryServiceClient,
    },
};
use peregrine_e2e::{
    CLUSTER, Envoy, PeregrineToml, Supervisor, config::AccountId, envoy_path, free_port, hosts,
    try_wait_until,
};

const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const DEADLINE: Duration = Duration::from_secs(30);

/// One EDS push seen by the subscriber.
struct Push {
    at: Instant,
    hostnames: BTreeSet<String>,
}

fn main() -> anyhow::Result<()> {
    let kills: usize = match std::env::args().skip_while(|a| a != "--kills").nth(1) {
        Some(n) => n.parse().context("--kills N")?,
        None => 20,
    };
    // `--user NAME`: the workers run as NAME, as a service's `user` makes them (a root supervisor).
    let user = std::env::args()
        .skip_while(|a| a != "--user")
        .nth(1)
        .map(AccountId::Name);
    if envoy_path().is_none() {
        bail!("no Envoy binary: set ENVOY or run `cargo xtask envoy`");
    }
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let mut config = PeregrineToml::one_service(grpc, listen, admin, 2);
    config.supervisor.healthy_after_ms = Some(150);
    config.service_mut(CLUSTER).user = user;
    let supervisor = Supervisor::start(&config.toml());
    let envoy = Envoy::start(&supervisor.envoy_bootstrap()?);
    // The supervisor starts listening once its sampler is loaded and its workers are on their way:
    // subscribe only then.
    try_wait_until(DEADLINE, "the supervisor's gRPC port", || {
        std::net::TcpStream::connect(("127.0.0.1", grpc)).ok()
    })?;
    let pushes = subscribe(grpc);
    let envoy_hostnames = || -> BTreeSet<String> {
        hosts(&envoy.clusters(), "cluster")
            .into_iter()
            .map(|h| h.hostname)
            .collect()
    };
    let mut current = try_wait_until(DEADLINE, "2 hosts in Envoy", || {
        let names = envoy_hostnames();
        (names.len() == 2).then_some(names)
    })?;
    while pushes.try_recv().is_ok() {}

    println!("kill  victim          exit(ms)  restart(ms)  xDS(ms)  total(ms)");
    let (mut exits, mut restarts, mut xds, mut totals) = (vec![], vec![], vec![], vec![]);
    for kill in 0..kills {
        let victim = current.iter().nth(kill % 2).unwrap().clone();
        let pid: i32 = victim.rsplit('-').next().unwrap().parse()?;
        let survivor: BTreeSet<String> =
            current.iter().filter(|h| **h != victim).cloned().collect();
        let killed_at = Instant::now();
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid).unwrap(),
            rustix::process::Signal::KILL,
        )?;
        // The EDS pushes: first without the victim, then with a replacement.
        let mut removed_at = None;
        let (published_at, replacement) = loop {
            let push = pushes
                .recv_timeout(DEADLINE)
                .context("no EDS push in time")?;
            if !push.hostnames.contains(&victim) && removed_at.is_none() {
                removed_at = Some(push.at);
            }
            let new: Vec<_> = push
                .hostnames
                .difference(&survivor)
                .filter(|h| **h != victim)
                .cloned()
                .collect();
            if let [replacement] = new.as_slice() {
                break (push.at, replacement.clone());
            }
        };
        let held_at = loop {
            let names = envoy_hostnames();
            if names.contains(&replacement) && !names.contains(&victim) {
                break Instant::now();
            }
            if killed_at.elapsed() > DEADLINE {
                bail!("Envoy did not take {replacement} in time");
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let exit = ms(removed_at.unwrap_or(published_at) - killed_at);
        let restart = ms(published_at - killed_at);
        let x = ms(held_at.saturating_duration_since(published_at));
        let total = ms(held_at - killed_at);
        println!("{kill:>4}  {victim:<14} {exit:>9.1} {restart:>12.1} {x:>8.1} {total:>10.1}");
        exits.push(exit);
        restarts.push(restart);
        xds.push(x);
        totals.push(total);
        current = survivor;
        current.insert(replacement);
        // Let the replacement pass `healthy_after_ms`, so the next kill of this slot starts from the
        // initial backoff again (this paces the benchmark; it measures nothing).
        std::thread::sleep(Duration::from_millis(200));
    }
    println!();
    println!("over {kills} kills       median      max");
    for (name, values) in [
        ("exit noticed", &mut exits),
        ("restart (registered)", &mut restarts),
        ("xDS (Envoy holds it)", &mut xds),
        ("total", &mut totals),
    ] {
        values.sort_by(f64::total_cmp);
        println!(
            "{name:<22} {:>7.1} ms {:>7.1} ms",
            median(values),
            values[values.len() - 1]
        );
    }
    drop(envoy);
    drop(supervisor);
    Ok(())
}

fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

/// Subscribes to EDS for `cluster` on a thread of its own, ACKing every push; returns the pushes.
fn subscribe(grpc: u16) -> mpsc::Receiver<Push> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let mut client =
                EndpointDiscoveryServiceClient::connect(format!("http://127.0.0.1:{grpc}"))
                    .await
                    .expect("connect to the supervisor");
            let (req_tx, req_rx) = tokio::sync::mpsc::unbounded_channel();
            let request = |version: String, nonce: String| DiscoveryRequest {
                node: Some(Node {
                    id: "restart-latency".into(),
                    ..Node::default()
                }),
                type_url: EDS.into(),
                resource_names: vec!["cluster".into()],
                version_info: version,
                response_nonce: nonce,
                ..DiscoveryRequest::default()
            };
            req_tx.send(request(String::new(), String::new())).unwrap();
            let mut stream = client
                .stream_endpoints(tokio_stream::wrappers::UnboundedReceiverStream::new(req_rx))
                .await
                .expect("EDS stream")
                .into_inner();
            while let Ok(Some(response)) = stream.message().await {
                let at = Instant::now();
                let mut hostnames = BTreeSet::new();
                for resource in &response.resources {
                    let cla: ClusterLoadAssignment =
                        prost::Message::decode(resource.value.as_slice()).unwrap();
                    for lb in cla.endpoints.iter().flat_map(|l| &l.lb_endpoints) {
                        if let Some(HostIdentifier::Endpoint(e)) = &lb.host_identifier {
                            hostnames.insert(e.hostname.clone());
                        }
                    }
                }
                let _ = req_tx.send(request(
                    response.version_info.clone(),
                    response.nonce.clone(),
                ));
                if tx.send(Push { at, hostnames }).is_err() {
                    return;
                }
            }
        });
    });
    rx
}
